"""Megatron's layer-wise optimizer on real gloo ranks: over plain torch optimizers, and with overlap_param_gather
through the wrapper's bucket groups (Megatron's current main)."""

from __future__ import annotations


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 8))


def _grads(model, seed: int) -> list:
    """The same gradients on every rank, one per parameter."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) for p in model.parameters()]


def _flat(model) -> list[float]:
    import torch

    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def _over_torch_optimizers(steps: int) -> tuple[list[float], int]:
    """Megatron's way: LayerWiseDistributedOptimizer([torch.optim.Adam, ...]) over the wrapper's parameters,
    gradients assigned to param.main_grad."""
    import torch

    from optstack.megatron import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        LayerWiseDistributedOptimizer,
        OptimizerConfig,
    )

    model = DistributedDataParallel(None, DistributedDataParallelConfig(), _model())
    params = list(model.parameters())
    base = [torch.optim.Adam(params[:3], lr=1e-2), torch.optim.Adam(params[3:], lr=1e-2)]
    opt = LayerWiseDistributedOptimizer(base, OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.0))
    assert len(opt.chained_optimizers) == 2
    for step in range(steps):
        for p, g in zip(params, _grads(model, step), strict=True):
            p.main_grad = g
        assert opt.step()[0] is True
    return _flat(model), sum(p.numel() for p in opt.get_parameters())


def test_layer_wise_over_torch_optimizers_matches_adam_on_one_process(world2):
    import torch

    (first, owned0), (second, owned1) = world2.run(_over_torch_optimizers, 3)
    model = _model()
    reference = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(3):
        for p, g in zip(model.parameters(), _grads(model, step), strict=True):
            p.grad = g
        reference.step()
    total = sum(p.numel() for p in model.parameters())
    assert first == second and 0 < owned0 < total and owned0 + owned1 == total  # each rank steps its own
    torch.testing.assert_close(torch.tensor(first), torch.tensor(_flat(model)), rtol=1e-6, atol=1e-7)


def _overlapped(steps: int, overlap: bool) -> dict:
    """get_megatron_optimizer's layer-wise Muon with overlap_param_gather: the step leaves the parameters other
    ranks stepped to the bucket groups, gathered by start_param_sync / the forward pre-hooks / finish_param_sync."""
    import torch
    import torch.distributed as dist

    from optstack.megatron import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )

    rank = dist.get_rank()
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True, overlap_param_gather=overlap, bucket_size=400)
    model = DistributedDataParallel(None, ddp_config, _model())
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=1e-2, clip_grad=1.0, overlap_param_gather=overlap,
                                                 use_layer_wise_distributed_optimizer=True), [model])
    groups, x = model.bucket_groups, torch.randn(4, 16, generator=torch.Generator().manual_seed(9))
    out: dict = {"params": [], "stale": [], "chained": None}
    if overlap:
        assert len(groups) > 1 and opt.overlap_param_gather
        for group in groups:  # every bucket parameter sent by exactly one rank
            for bucket in group.buckets:
                sent = [p for params in bucket.layerwise_params_list for p in params]
                assert len(sent) == len(bucket.params) and set(sent) == bucket.params
                assert bucket.layerwise_param_flat_sizes == [sum(p.numel() for p in ps)
                                                             for ps in bucket.layerwise_params_list]
        mine = {p for g in groups for b in g.buckets for p in b.layerwise_params_list[rank]}
    for step in range(steps):
        before = [p.detach().clone() for p in model.parameters()]
        for p, g in zip(model.parameters(), _grads(model, step), strict=True):
            p.main_grad = g
        assert opt.step()[0] is True
        if overlap:
            # others' parameters wait for the gather (Muon's matrices: the scalar optimizer steps every bias here)
            out["stale"].append(all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True)
                                    if p not in mine and p.dim() == 2))
            if step == 0:  # finishing the last group starts the next one
                groups[-1].start_param_sync()
                following = groups[-1].next_param_gather_bucket_group
                out["chained"] = [following.param_gather_dispatched]
                groups[-1].finish_param_sync()
                out["chained"].append(following.param_gather_dispatched)
                for group in reversed(groups[:-1]):
                    group.finish_param_sync()
            elif step == 1:  # the forward pre-hooks finish what start_param_sync started
                model.start_param_sync()
                model(x)
            else:  # hooks off: nothing waits until the optimizer finishes the gathers
                model.disable_forward_pre_hook(param_sync=False)
                opt.finish_param_sync()
                model.enable_forward_pre_hook()
            assert all(not b.grad_data.any() for g in groups for b in g.buckets)  # the gathers' scratch, zeroed
        out["params"].append(_flat(model))
    return out


def test_overlap_param_gather_through_bucket_groups_matches_the_step_gather(world2):
    overlapped = world2.run(_overlapped, 3, True)
    synced = world2.run(_overlapped, 3, False)
    for rank in (0, 1):
        assert overlapped[rank]["stale"] == [True, True, True]
        assert overlapped[rank]["chained"] == [False, True]
        assert overlapped[rank]["params"] == synced[rank]["params"]  # bit for bit
    assert overlapped[0]["params"] == overlapped[1]["params"]
    assert synced[0]["params"][0] != synced[0]["params"][-1]  # it trained
