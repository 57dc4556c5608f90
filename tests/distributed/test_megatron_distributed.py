"""The Megatron face on real gloo ranks: DistributedDataParallel + get_megatron_optimizer, trained with
Megatron's loop, equals get_megatron_optimizer on one process with the full batch."""

from __future__ import annotations

import pytest

STEPS = 5


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.ReLU(), nn.Linear(13, 5))


def _batches(world: int, micro_batches: int):
    """Per step, ``micro_batches`` global micro-batches of 4 rows per rank."""
    import torch

    g = torch.Generator().manual_seed(3)
    return [[(torch.randn(4 * world, 7, generator=g), torch.randn(4 * world, 5, generator=g))
             for _ in range(micro_batches)] for _ in range(STEPS)]


def _optimizer_config(case: dict):
    from optstack.megatron import OptimizerConfig

    return OptimizerConfig(**case["optimizer"])


def _scheduler(opt):
    from optstack.megatron import OptimizerParamScheduler

    lr = opt.config.lr
    return OptimizerParamScheduler(opt, init_lr=0.0, max_lr=lr, min_lr=lr / 10, lr_warmup_steps=2,
                                   lr_decay_steps=STEPS, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                   wd_incr_steps=STEPS, wd_incr_style="constant")


def _flat(model) -> list[float]:
    import torch

    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def _train_distributed(case: dict, micro_batches: int) -> dict:
    """Megatron's training loop on this rank's slice of every global micro-batch."""
    import torch
    import torch.distributed as dist

    from optstack.megatron import DistributedDataParallel, DistributedDataParallelConfig, get_megatron_optimizer

    world, rank = dist.get_world_size(), dist.get_rank()
    module = _model()
    model = DistributedDataParallel(None, DistributedDataParallelConfig(**case["ddp"]), module)
    opt = get_megatron_optimizer(_optimizer_config(case), [model])
    scheduler = _scheduler(opt)
    params, norms = [], []
    for step_batches in _batches(world, micro_batches):
        model.zero_grad_buffer()
        opt.zero_grad()
        for i, (x, y) in enumerate(step_batches):
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
            if i < len(step_batches) - 1:
                with model.no_sync():
                    torch.nn.functional.mse_loss(model(x), y).backward()
            else:
                torch.nn.functional.mse_loss(model(x), y).backward()
        model.finish_grad_sync()
        ok, norm, _ = opt.step()
        assert ok
        scheduler.step(increment=1)
        opt.finish_param_sync()  # with overlap_param_gather the next forward would wait instead
        params.append(_flat(module))
        norms.append(norm)
    return {"params": params, "norms": norms, "stages": [s.kind for s in opt.built.optimizer.stages]}


def _train_reference(case: dict, world: int, micro_batches: int) -> dict:
    import torch

    from optstack.megatron import get_megatron_optimizer

    single = {k: v for k, v in case["optimizer"].items()
              if k not in ("use_distributed_optimizer", "use_layer_wise_distributed_optimizer",
                           "overlap_param_gather")}
    model = _model()
    opt = get_megatron_optimizer(_optimizer_config({"optimizer": single}), [model])
    scheduler = _scheduler(opt)
    params, norms = [], []
    for step_batches in _batches(world, micro_batches):
        opt.zero_grad()
        for x, y in step_batches:
            torch.nn.functional.mse_loss(model(x), y).backward()
        ok, norm, _ = opt.step()
        assert ok
        scheduler.step(increment=1)
        params.append(_flat(model))
        norms.append(norm)
    return {"params": params, "norms": norms}


CASES = {
    "replicated": {"optimizer": {"lr": 1e-2}, "ddp": {"overlap_grad_reduce": True, "bucket_size": 100}},
    "zero1": {"optimizer": {"lr": 1e-2, "use_distributed_optimizer": True},
              "ddp": {"use_distributed_optimizer": True}},
    "zero1-overlap": {
        "optimizer": {"lr": 1e-2, "use_distributed_optimizer": True, "overlap_param_gather": True},
        "ddp": {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "overlap_param_gather": True,
                "bucket_size": 100, "grad_reduce_in_fp32": True, "average_in_collective": True},
    },
    "layerwise-muon": {"optimizer": {"lr": 1e-2, "optimizer": "muon", "use_layer_wise_distributed_optimizer": True},
                       "ddp": {"overlap_grad_reduce": True, "bucket_size": 100}},
    "zero1-lion": {"optimizer": {"lr": 1e-3, "optimizer": "lion", "use_distributed_optimizer": True},
                   "ddp": {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "bucket_size": 100}},
    # A partial distributed optimizer: each rank its own instance, gradients all-reduced over both
    "zero1-instances": {"optimizer": {"lr": 1e-2, "use_distributed_optimizer": True},
                        "ddp": {"use_distributed_optimizer": True, "num_distributed_optimizer_instances": 2,
                                "overlap_grad_reduce": True, "bucket_size": 100}},
    # Megatron's current main: the layer-wise optimizer with overlap_param_gather, no distributed optimizer
    "layerwise-overlap": {"optimizer": {"lr": 1e-2, "optimizer": "muon", "use_layer_wise_distributed_optimizer": True,
                                        "overlap_param_gather": True},
                          "ddp": {"overlap_grad_reduce": True, "overlap_param_gather": True}},
}
STAGES = {"replicated": {"whole+direct"}, "zero1": {"zero1+masters"}, "zero1-overlap": {"zero1+masters"},
          "layerwise-muon": {"layerwise+masters", "whole+direct"}, "zero1-lion": {"zero1+masters"},
          "layerwise-overlap": {"layerwise+masters", "whole+direct"}, "zero1-instances": {"zero1+masters"}}


@pytest.mark.parametrize("name", list(CASES))
def test_megatron_loop_matches_single_process(world2, name):
    import torch

    micro_batches = 2 if name == "zero1" else 1  # gradient accumulation with no_sync()
    ranks = world2.run(_train_distributed, CASES[name], micro_batches)
    ref = _train_reference(CASES[name], world=2, micro_batches=micro_batches)
    assert set(ranks[0]["stages"]) == STAGES[name]
    assert ranks[0]["params"] == ranks[1]["params"], "replicas diverged"
    torch.testing.assert_close(torch.tensor(ranks[0]["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=0)
    for step, (got, want) in enumerate(zip(ranks[0]["params"], ref["params"], strict=True)):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, step=step: f"step {step}: {m}")
    assert ref["params"][0] != ref["params"][-1]  # the run trained


def _broadcast_params() -> list[float]:
    import torch
    import torch.distributed as dist

    from optstack.megatron import DistributedDataParallel, DistributedDataParallelConfig

    model = DistributedDataParallel(None, DistributedDataParallelConfig(use_distributed_optimizer=True), _model())
    with torch.no_grad():
        for p in model.module.parameters():
            p.add_(dist.get_rank())  # ranks start out different
    model.broadcast_params()
    return _flat(model.module)


def test_broadcast_params_copies_rank_0(world2):
    ranks = world2.run(_broadcast_params)
    assert ranks[0] == ranks[1] == _flat(_model())


def _mismatched_config() -> str:
    from optstack.megatron import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )

    # (the other way round builds: tests/distributed/test_whole_grads.py)
    model = DistributedDataParallel(None, DistributedDataParallelConfig(use_distributed_optimizer=False), _model())
    try:
        get_megatron_optimizer(OptimizerConfig(lr=1e-2, use_distributed_optimizer=True), [model])
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_optimizer_and_wrapper_must_agree_on_the_distributed_optimizer(world2):
    for message in world2.run(_mismatched_config):
        assert "OptimizerConfig.use_distributed_optimizer=True" in message
        assert "DistributedDataParallelConfig.use_distributed_optimizer=False" in message


# Megatron's partial distributed optimizer at 4 ranks: 2 instances of 2 (ranks 0-1 and 2-3), so a shard lives on
# two ranks, one per instance.
INSTANCES = {"optimizer": {"lr": 1e-2, "use_distributed_optimizer": True},
             "ddp": {"use_distributed_optimizer": True, "num_distributed_optimizer_instances": 2,
                     "overlap_grad_reduce": True, "bucket_size": 100}}


def _instances_state(case: dict, interleaved: bool = False) -> dict:
    """One step's reduced gradients (Megatron's collectives, then force_all_reduce), and after training the
    elements of optimizer state this rank holds per parameter name. ``interleaved``: the instances {0, 2} and
    {1, 3} given through a ProcessGroupCollection (first checking that intra_dp_cp alone is refused)."""
    import contextlib

    import torch
    import torch.distributed as dist

    from optstack.megatron import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        ProcessGroupCollection,
        get_megatron_optimizer,
    )

    world, rank = dist.get_world_size(), dist.get_rank()
    module = _model()
    ddp_config = DistributedDataParallelConfig(**case["ddp"])
    pgs = None
    if interleaved:
        intra = [dist.new_group(r) for r in ([0, 2], [1, 3])][rank % 2]
        inter = [dist.new_group(r) for r in ([0, 1], [2, 3])][rank // 2]
        try:
            DistributedDataParallel(None, ddp_config, module, pg_collection=ProcessGroupCollection(
                dp=dist.group.WORLD, intra_dp_cp=intra))
            raise AssertionError("intra_dp_cp without inter_dist_opt was accepted")
        except ValueError as exc:
            assert "inter_dist_opt" in str(exc), exc
        pgs = ProcessGroupCollection(dp=dist.group.WORLD, intra_dp_cp=intra, inter_dist_opt=inter)
    model = DistributedDataParallel(None, ddp_config, module, pg_collection=pgs)
    (buffer,) = model.buffers
    x, y = _batches(world, 1)[0][0]
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    grads = {}
    for force in (True, False):
        model.zero_grad_buffer()
        # force_all_reduce applies to buckets not launched yet: with it, backward launches none
        with model.no_sync() if force else contextlib.nullcontext():
            torch.nn.functional.mse_loss(model(x), y).backward()
        model.finish_grad_sync(force_all_reduce=force)
        grads[force] = buffer.grad_data.clone()
    shard = model.shard_comm(buffer)
    owned = torch.zeros(buffer.grad_data.numel(), dtype=torch.bool)
    for bucket in buffer.buckets:
        lo, hi = buffer.layout.owned_range(bucket.index, shard.rank)
        owned[buffer.layout.buckets[bucket.index].offset + lo:buffer.layout.buckets[bucket.index].offset + hi] = True
    exposed = any(p.grad is not None for p in module.parameters())
    opt = get_megatron_optimizer(_optimizer_config(case), [model])
    for _ in range(2):
        model.zero_grad_buffer()
        torch.nn.functional.mse_loss(model(x), y).backward()
        model.finish_grad_sync()
        assert opt.step()[0]
    names = {p: n for n, p in module.named_parameters()}
    state = {names[p]: int(entry["exp_avg"].numel()) for p, entry in opt.built.optimizer.state.items()
             if "exp_avg" in entry}
    return {"whole": grads[True], "megatron": grads[False], "owned": owned, "exposed": exposed,
            "shard": (shard.size, shard.rank), "state": state}


def test_partial_distributed_optimizer_matches_single_process(world4):
    import torch

    ranks = world4.run(_train_distributed, INSTANCES, 2)
    ref = _train_reference(INSTANCES, world=4, micro_batches=2)
    assert set(ranks[0]["stages"]) == {"zero1+masters"}
    assert all(r["params"] == ranks[0]["params"] for r in ranks), "replicas diverged"
    torch.testing.assert_close(torch.tensor(ranks[0]["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=0)
    for step, (got, want) in enumerate(zip(ranks[0]["params"], ref["params"], strict=True)):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, step=step: f"step {step}: {m}")
    assert ref["params"][0] != ref["params"][-1]  # the run trained


@pytest.mark.parametrize("interleaved", [False, True])
def test_partial_distributed_optimizer_reduces_and_keeps_state_per_instance(world4, interleaved):
    import torch

    out = world4.run(_instances_state, INSTANCES, interleaved)
    if interleaved:  # the given groups: instances {0, 2} and {1, 3}
        assert [o["shard"] for o in out] == [(2, 0), (2, 0), (2, 1), (2, 1)]
        out = [out[0], out[2], out[1], out[3]]  # in instance order, as below
    else:  # instances of consecutive ranks
        assert [o["shard"] for o in out] == [(2, 0), (2, 1), (2, 0), (2, 1)]
    whole = out[0]["whole"]
    numel = sum(p.numel() for p in _model().parameters())
    for rank, o in enumerate(out):
        # force_all_reduce: the whole data-parallel mean on every rank
        torch.testing.assert_close(o["whole"], whole, rtol=0, atol=0)
        # Megatron's reduction: this rank's shard holds the whole mean, the rest only its instance's part
        owned = o["owned"]
        torch.testing.assert_close(o["megatron"][owned], whole[owned], rtol=1e-6, atol=1e-7)
        assert not torch.allclose(o["megatron"][~owned], whole[~owned]), f"rank {rank}: reduced over all ranks"
        assert not o["exposed"], f"rank {rank}: p.grad exposed though only a shard is whole"
        assert 0 < sum(o["state"].values()) < numel
    # state: each instance splits every parameter between its two ranks; the other instance holds the same split
    for a, b in ((0, 1), (2, 3)):
        names = set(out[a]["state"]) | set(out[b]["state"])
        assert sum(out[a]["state"].values()) + sum(out[b]["state"].values()) == numel, names
    assert out[0]["state"] == out[2]["state"] and out[1]["state"] == out[3]["state"]
    assert out[0]["owned"].tolist() == out[2]["owned"].tolist() != out[1]["owned"].tolist()


def _second_finish_grad_sync() -> dict:
    """Megatron's loop with per-token losses (gradients summed over ranks, no overlap): the reduced gradients
    after finish_grad_sync, after a second call, and after the optimizer's step (which calls it too), and the
    full batch's summed gradient computed on this rank alone."""
    import types

    import torch
    import torch.distributed as dist

    from optstack.megatron import DistributedDataParallel, DistributedDataParallelConfig, get_megatron_optimizer

    world, rank = dist.get_world_size(), dist.get_rank()
    x, y = _batches(world, 1)[0][0]
    alone = _model()
    torch.nn.functional.mse_loss(alone(x), y, reduction="sum").backward()
    module = _model()
    model = DistributedDataParallel(types.SimpleNamespace(calculate_per_token_loss=True),
                                    DistributedDataParallelConfig(average_in_collective=False), module)
    # no clipping: it would scale the gradients in place
    opt = get_megatron_optimizer(_optimizer_config({"optimizer": {"lr": 1e-2, "clip_grad": 0.0}}), [model])

    def grads() -> torch.Tensor:
        return torch.cat([model.main_grad(p).flatten() for p in module.parameters()]).clone()

    model.zero_grad_buffer()
    torch.nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank], reduction="sum").backward()
    model.finish_grad_sync()
    first = grads()
    model.finish_grad_sync()  # Megatron (overlap_grad_reduce=False) would sum the sums again
    second = grads()
    assert opt.step()[0]
    return {"first": first, "second": second, "stepped": grads(),
            "alone": torch.cat([p.grad.flatten() for p in alone.parameters()])}


def test_second_finish_grad_sync_keeps_the_reduced_gradients(world2):
    import torch

    for out in world2.run(_second_finish_grad_sync):
        torch.testing.assert_close(out["first"], out["alone"], rtol=1e-5, atol=1e-5)
        assert torch.equal(out["second"], out["first"]) and torch.equal(out["stepped"], out["first"])


def _core_partial(sharded_reduction: str) -> dict:
    """optstack's core wrapper under 2 parts of 2 ranks with the given in-part reduction (NCCL's default is the
    reduce-scatter, which gloo runs here): owned shard vs. a replicated wrapper's whole mean."""
    import torch.distributed as dist
    from torch import nn

    from optstack.distributed.comm import new_subgroups
    from optstack.distributed.ddp import DataParallel

    world, rank = dist.get_world_size(), dist.get_rank()
    x, y = _batches(world, 1)[0][0]
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    part = new_subgroups([[0, 1], [2, 3]], name="part")
    cross = new_subgroups([[0, 2], [1, 3]], name="cross")
    try:
        DataParallel(_model(), shard_grads=True, shard_group=part)
        raise AssertionError("a shard_group smaller than data-parallel without cross_shard_group was accepted")
    except ValueError as exc:
        assert "cross_shard_group" in str(exc), exc
    out = {}
    for name, kwargs in (("whole", {}), ("partial", {"shard_grads": True, "shard_group": part,
                                                    "cross_shard_group": cross,
                                                    "sharded_reduction": sharded_reduction})):
        model = DataParallel(_model(), bucket_size=None, **kwargs)  # one bucket: each rank owns parameters
        nn.functional.mse_loss(model(x), y).backward()
        model.finish_grad_sync()
        out[name] = {n: model.main_grad(p).clone() for n, p in model.module.named_parameters()}
        if name == "partial":
            (buffer,) = model.param_and_grad_buffers
            owned = {}
            for n, _ in model.module.named_parameters():
                piece = buffer.layout.owned_slice(n, part.rank)
                if piece is not None:
                    owned[n] = (piece.param_start, piece.param_end)
    return {"whole": out["whole"], "partial": out["partial"], "owned": owned}


@pytest.mark.parametrize("sharded_reduction", ["reduce_scatter", "all_reduce"])
def test_core_partial_reduction_owned_shard_is_the_whole_mean(world4, sharded_reduction):
    import torch

    for rank, out in enumerate(world4.run(_core_partial, sharded_reduction)):
        assert out["owned"], f"rank {rank} owns nothing"
        for name, (lo, hi) in out["owned"].items():
            torch.testing.assert_close(out["partial"][name].flatten()[lo:hi], out["whole"][name].flatten()[lo:hi],
                                       rtol=1e-6, atol=1e-7, msg=lambda m, w=f"rank {rank} {name}": f"{w}: {m}")
