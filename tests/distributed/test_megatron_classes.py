"""Megatron's classes and the wrapper's Megatron surface on real gloo ranks."""

from __future__ import annotations


def _model(dtype=None):
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))
    return model.to(dtype) if dtype is not None else model


def _batch(world: int):
    import torch

    g = torch.Generator().manual_seed(3)
    return torch.randn(4 * world, 7, generator=g), torch.randn(4 * world, 5, generator=g)


def _flat(model) -> list[float]:
    import torch

    return torch.cat([p.detach().float().flatten() for p in model.parameters()]).tolist()


def _distributed_optimizer_from_torch(steps: int) -> list[float]:
    """Megatron's DistributedOptimizer built from a torch optimizer over the wrapped model, Megatron's loop."""
    import torch
    import torch.distributed as dist

    from optstack.megatron import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        DistributedOptimizer,
        OptimizerConfig,
    )

    world, rank = dist.get_world_size(), dist.get_rank()
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                               bucket_size=60)
    model = DistributedDataParallel(None, ddp_config, _model())
    config = OptimizerConfig(lr=1e-2, clip_grad=0.5, use_distributed_optimizer=True)
    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), config, None, None,
                               model_chunks=[model])
    numel = sum(p.numel() for p in opt.get_parameters())
    assert 0 < numel < sum(p.numel() for p in model.parameters())  # this rank's ranges only
    x, y = _batch(world)
    for _ in range(steps):
        model.zero_grad_buffer()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        model.finish_grad_sync()
        assert opt.step()[0] is True
    return _flat(model.module)


def test_distributed_optimizer_from_a_torch_optimizer_matches_one_process(world2):
    import torch

    from optstack.megatron import FP32Optimizer, OptimizerConfig

    ranks = world2.run(_distributed_optimizer_from_torch, 3)
    model = _model()
    opt = FP32Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), OptimizerConfig(lr=1e-2, clip_grad=0.5))
    x, y = _batch(2)
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert ranks[0] == ranks[1]
    torch.testing.assert_close(torch.tensor(ranks[0]), torch.tensor(_flat(model)), rtol=1e-5, atol=1e-6)


def _reload_model_params() -> list[bool]:
    """Megatron's test_optimizer_reload_model_params, on gloo: bf16 model, distributed optimizer, lr=None."""
    import torch

    from optstack.megatron import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )

    model = _model(torch.bfloat16)
    for p in model.parameters():
        p.data.fill_(1.0)
    model = DistributedDataParallel(None, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", bf16=True, use_distributed_optimizer=True),
                                 [model])

    def masters_are(value: float) -> bool:
        masters = [m for g in opt.param_groups for m in g["params"]]
        return bool(masters) and all(m.dtype == torch.float32 and torch.equal(m, torch.full_like(m, value))
                                     for m in masters)

    for p in model.parameters():
        p.data.fill_(2.0)
    checks = [masters_are(1.0)]
    opt.reload_model_params()
    checks.append(masters_are(2.0))
    opt.reload_model_params({n: torch.full_like(p, 3.0) for n, p in model.state_dict().items()})
    checks += [masters_are(3.0), all(torch.equal(p, torch.full_like(p, 2.0)) for p in model.parameters())]
    return checks


def test_reload_model_params_under_the_distributed_optimizer(world2):
    for checks in world2.run(_reload_model_params):
        assert checks == [True, True, True, True]


def _grad_sync_surface() -> dict:
    import torch
    import torch.distributed as dist

    from optstack.megatron import DistributedDataParallel, DistributedDataParallelConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for overlap in (True, False):
        config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=overlap,
                                               bucket_size=None)
        model = DistributedDataParallel(None, config, _model())
        buffer = model.buffers[0]
        buffer.grad_data.fill_(1.0 + rank)
        if overlap:
            for group in model.bucket_groups:
                for p in sorted(group.params, key=id):
                    group.register_grad_ready(p)
                group.finish_grad_sync()
        else:
            model.finish_grad_sync(force_all_reduce=True)
        # averaged over ranks: (1 + 2 + ...) / world, everywhere when all-reduced, on owned ranges otherwise
        owned = buffer.grad_shard_view(0, rank)
        out[overlap] = (owned.tolist(), buffer.grad_data[:buffer.numel_unpadded].tolist())
    # start_param_sync: each rank writes its owned range, then every rank holds all of them
    model = DistributedDataParallel(None, DistributedDataParallelConfig(use_distributed_optimizer=True), _model())
    buffer = model.buffers[0]
    with torch.no_grad():
        buffer.param_shard_view(0, rank).fill_(10.0 + rank)
    model.start_param_sync()
    shard = buffer.layout.buckets[0].shard_numel
    out["gathered"] = [buffer.param_data[r * shard:(r + 1) * shard].unique().tolist() for r in range(world)]
    return out


def test_grad_and_param_sync_surface(world2):
    for rank, out in enumerate(world2.run(_grad_sync_surface)):
        owned, _ = out[True]
        assert set(owned) == {1.5}  # reduce-scattered: this rank's range is averaged
        _, whole = out[False]
        assert set(whole) == {1.5}  # force_all_reduce: every element averaged on every rank
        assert out["gathered"] == [[10.0], [11.0]], rank


def _bucket_space_state() -> dict:
    """The distributed optimizer's Megatron bucket-space view: gbuf_ranges and the dp_reshardable round trip."""
    import torch
    import torch.distributed as dist

    from optstack.megatron import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )

    world, rank = dist.get_world_size(), dist.get_rank()
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                               bucket_size=60)
    model = DistributedDataParallel(None, ddp_config, _model(torch.bfloat16))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True, use_distributed_optimizer=True), [model])
    dist_opt = opt.chained_optimizers[0]

    def train_step() -> None:
        x, y = _batch(world)
        opt.zero_grad()
        out = model(x.chunk(world)[rank].bfloat16()).float()
        torch.nn.functional.mse_loss(out, y.chunk(world)[rank]).backward()
        assert opt.step()[0] is True

    train_step()
    names = {id(p): n for n, p in model.module.named_parameters()}
    covered, keys = [], set()
    for ranges_of_buffer in dist_opt.gbuf_ranges:
        for (param_dtype, grad_dtype), buckets in ranges_of_buffer.items():
            assert (param_dtype, grad_dtype) == (torch.bfloat16, torch.bfloat16)
            for bucket in buckets:
                for param, r in bucket["param_map"].items():
                    assert r["param"].size == r["gbuf_local"].size == r["gbuf_world"].size
                    covered.append((names[id(param)], r["param"].start, r["param"].end))
                    tensors = dist_opt._get_main_param_and_optimizer_states(param)
                    keys |= set(tensors)
                    main = tensors["param"]
                    assert main.dtype == torch.float32 and main.numel() == r["param"].size
                    model_part = param.detach().reshape(-1)[r["param"].start:r["param"].end]
                    assert torch.equal(main.bfloat16(), model_part)  # the model holds the rounded master
    for param in (p for g in dist_opt.optimizer.param_groups for p in g["params"]):
        dist_opt.optimizer.state[param]["found_inf"] = False  # non-tensor state is left out, as in Megatron
    saved = dist_opt.get_parameter_state_dp_reshardable()
    snapshot = {k: [[{n: t.clone() for n, t in e.items() if isinstance(t, torch.Tensor)} for e in b] for b in v[d]]
                for k, v in saved.items() if isinstance(k, int) for d in v}
    train_step()  # changes masters and moments
    restored = {k: {d: [[{**e, "padding": False, "step_count": 7} for e in b] for b in snapshot[k]]
                    for d in v} for k, v in saved.items() if isinstance(k, int)}
    restored["per_bucket_numel_unpadded"] = saved["per_bucket_numel_unpadded"]
    dist_opt.load_parameter_state_from_dp_reshardable(restored)
    now = dist_opt.get_parameter_state_dp_reshardable()
    reloaded = all(torch.equal(now[k][d][b][i][n], snapshot[k][b][i][n])
                   for k in snapshot for d in now[k] for b in range(len(snapshot[k]))
                   for i in range(len(snapshot[k][b])) for n in snapshot[k][b][i])
    bad = dict(restored, per_bucket_numel_unpadded=[{d: [1] for d in by} for by in saved["per_bucket_numel_unpadded"]])
    try:
        dist_opt.load_parameter_state_from_dp_reshardable(bad)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {"covered": covered, "keys": sorted(keys), "reloaded": reloaded, "refused": refused,
            "buckets": [len(b) for r in dist_opt.gbuf_ranges for b in r.values()],
            "numel": dist_opt.per_bucket_numel, "unpadded": saved["per_bucket_numel_unpadded"]}


def test_distributed_optimizer_bucket_space_view(world2):
    import torch

    outs = world2.run(_bucket_space_state)
    sizes = {n: p.numel() for n, p in _model().named_parameters()}
    by_param: dict[str, list[tuple[int, int]]] = {}
    for out in outs:
        assert out["keys"] == ["exp_avg", "exp_avg_sq", "param", "step"]
        assert out["reloaded"] is True
        assert "same layout" in out["refused"]
        assert out["buckets"][0] >= 2  # bucket_size=60 splits the model
        assert out["numel"] == outs[0]["numel"] and out["unpadded"] == outs[0]["unpadded"]
        for name, start, end in out["covered"]:
            by_param.setdefault(name, []).append((start, end))
    for name, size in sizes.items():  # every element is owned by exactly one rank
        spans = sorted(by_param[name])
        assert spans[0][0] == 0 and spans[-1][1] == size
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    dtype = (torch.bfloat16, torch.bfloat16)
    for padded, unpadded in zip(outs[0]["numel"][0][dtype], outs[0]["unpadded"][0][dtype], strict=True):
        assert padded % 2 == 0 and unpadded <= padded  # buckets split evenly across the 2 ranks


def _non_distributed_optimizer_over_a_sharding_wrapper() -> str:
    from optstack.megatron import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )

    model = DistributedDataParallel(None, DistributedDataParallelConfig(use_distributed_optimizer=True), _model())
    get_megatron_optimizer(OptimizerConfig(lr=1e-2), [model])  # builds: the wrapper all-reduces whole gradients
    try:
        get_megatron_optimizer(OptimizerConfig(lr=1e-2, optimizer="muon", use_layer_wise_distributed_optimizer=True),
                               [model])
    except ValueError as e:
        return str(e)
    return ""


def test_a_sharding_wrapper_refuses_the_layer_wise_optimizer_over_two_ranks(world2):
    """Over 2 data-parallel ranks the wrapper built for the distributed optimizer takes the non-distributed one
    (it then all-reduces: tests/distributed/test_whole_grads.py) but not the layer-wise one, whose owner ranks
    need every gradient whole and unsharded buffers (one rank: tests/test_megatron_ddp.py)."""
    import re

    for message in world2.run(_non_distributed_optimizer_over_a_sharding_wrapper):
        assert re.search(r"OptimizerConfig\.use_distributed_optimizer=False but the "
                         r"model's DistributedDataParallelConfig\.use_distributed_optimizer=True", message)
        assert "layer-wise optimizer needs whole reduced gradients" in message


def _mtp_step(distributed: bool) -> tuple[list[float], float, float]:
    """One clipped SGD step with an MTP-tagged layer, under the distributed optimizer (ranges cut across
    parameters) or on one process."""
    import torch
    import torch.distributed as dist

    from optstack.megatron import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )

    module = _model()
    module[2].weight.grad_norm_group = "mtp"
    config = OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.05,
                             use_distributed_optimizer=distributed)
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    model = module
    if distributed:
        model = DistributedDataParallel(None, DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=40), module)
    opt = get_megatron_optimizer(config, [model])
    x, y = _batch(2)
    torch.nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    applied, norm, _ = opt.step()
    assert applied
    return _flat(module), norm, opt.grad_norms_by_group["mtp"]


def test_distributed_optimizer_clips_mtp_by_its_own_norm(world2):
    import pytest
    import torch

    ranks = world2.run(_mtp_step, True)
    params, norm, mtp = _mtp_step(False)
    assert mtp > 0.05 and norm > 0.05 and abs(mtp - norm) > 1e-3  # two different clip factors
    for got, got_norm, got_mtp in ranks:
        assert got_norm == pytest.approx(norm, rel=1e-5)
        assert got_mtp == pytest.approx(mtp, rel=1e-5)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(params), rtol=1e-5, atol=1e-6)
