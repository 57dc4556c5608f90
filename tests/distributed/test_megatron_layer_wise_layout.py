"""The layer-wise optimizer over a wrapper laid out for it (Megatron's current main: ``wrap_model_chunks_with_ddp``
with ``use_layer_wise_distributed_optimizer``) on real gloo ranks: gradients reduce-scattered, each Muon matrix
stepped whole by the rank whose shard holds it, the rest by a distributed optimizer, parameters all-gathered
from the buffers; the same training as one process stepping Muon on the whole batch."""

from __future__ import annotations

import contextlib

STEPS = 3


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 20), nn.Tanh(),
                          nn.Linear(20, 8))
    model[4].weight.use_muon = False  # a matrix Muon must leave to the scalar optimizer (Megatron's exclusion)
    return model


def _batch(rank: int, step: int):
    import torch

    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 16, generator=g), torch.randn(6, 8, generator=g)


def _config(overlap: bool):
    from optstack.megatron import OptimizerConfig

    return OptimizerConfig(optimizer="muon", lr=2e-2, weight_decay=0.01, clip_grad=0.5, overlap_param_gather=overlap,
                           use_layer_wise_distributed_optimizer=True)


@contextlib.contextmanager
def _one_thread():
    """References run with the ranks' single thread: a multi-threaded matmul rounds differently (CI's 2 cores)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _flat(model) -> list[float]:
    import torch

    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def _laid_out(overlap: bool, bucket_size: int | None) -> dict:
    """One rank: wrap_model_chunks_with_ddp + get_megatron_optimizer, STEPS steps of this rank's half batch."""
    import torch
    import torch.distributed as dist

    from optstack.megatron import (
        DistributedDataParallelConfig,
        DistributedOptimizer,
        LayerWiseDistributedOptimizer,
        get_megatron_optimizer,
    )
    from optstack.megatron.training import wrap_model_chunks_with_ddp

    rank, inner = dist.get_rank(), _model()
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=overlap, overlap_param_gather=overlap,
                                               bucket_size=bucket_size)
    (model,) = wrap_model_chunks_with_ddp([inner], None, ddp_config, use_layer_wise_distributed_optimizer=True)
    assert ddp_config.use_distributed_optimizer  # Megatron's: set in place for the reduce-scatter
    managed = [n for n, p in inner.named_parameters() if p.is_managed_by_layer_wise_optimizer]
    assert managed == ["0.weight", "2.weight", "6.weight"]  # 4.weight: use_muon=False
    opt = get_megatron_optimizer(_config(overlap), [model])
    lw, distopt = opt.chained_optimizers
    assert isinstance(lw, LayerWiseDistributedOptimizer) and isinstance(distopt, DistributedOptimizer)
    assert lw.use_buffer_param_sync and lw.overlap_param_gather == overlap
    # this rank's Muon matrices, stepped whole (their fp32 masters have the parameter's shape; the three managed
    # matrices' shapes differ, so a shape names its matrix)
    by_shape = {tuple(p.shape): n for n, p in inner.named_parameters() if n in managed}
    mine = sorted(by_shape[tuple(t.shape)] for t in lw.get_parameters())
    loss_fn = torch.nn.MSELoss()
    x_probe = torch.randn(2, 16, generator=torch.Generator().manual_seed(7))
    groups = model.bucket_groups
    for step in range(STEPS):
        model.zero_grad_buffer()
        opt.zero_grad()
        x, y = _batch(rank, step)
        loss_fn(model(x), y).backward()
        model.finish_grad_sync()
        applied, norm, _ = opt.step()
        assert applied and norm > 0
        if overlap:
            if step == 0:  # finishing the last bucket group starts the next one (forward order), as Megatron's
                assert len(groups) > 1
                following = groups[-1].next_param_gather_bucket_group
                assert not following.param_gather_dispatched
                groups[-1].finish_param_sync()
                assert following.param_gather_dispatched
                for group in reversed(groups[:-1]):
                    group.finish_param_sync()
            elif step == 1:
                model.start_param_sync()
                model(x_probe)  # the forward pre-hooks finish the gathers
            else:
                model.start_param_sync(force_sync=True)
            assert all(not b.grad_data.any() for g in groups for b in g.buckets)  # consumed, zeroed after the sync
    return {"params": _flat(model), "mine": mine}


def _direct() -> list[float]:
    """Megatron's own wiring over the laid-out wrapper: LayerWiseDistributedOptimizer over a torch Muon of the
    tagged matrices and a DistributedOptimizer over an AdamW of the rest, chained; an optimizer holding
    parameters the wrapper cuts across ranks is refused."""
    import pytest
    import torch
    import torch.distributed as dist

    from optstack.megatron import (
        ChainedOptimizer,
        DistributedDataParallelConfig,
        DistributedOptimizer,
        LayerWiseDistributedOptimizer,
        OptimizerConfig,
        TensorParallelMuon,
    )
    from optstack.megatron.training import wrap_model_chunks_with_ddp

    rank, inner = dist.get_rank(), _model()
    (model,) = wrap_model_chunks_with_ddp([inner], None, DistributedDataParallelConfig(),
                                          use_layer_wise_distributed_optimizer=True)
    managed = [p for p in inner.parameters() if p.is_managed_by_layer_wise_optimizer]
    rest = [p for p in inner.parameters() if not p.is_managed_by_layer_wise_optimizer]
    config = OptimizerConfig(optimizer="muon", lr=2e-2, clip_grad=0.0)
    with pytest.raises(ValueError, match="cuts some of this optimizer's parameters"):
        LayerWiseDistributedOptimizer([torch.optim.AdamW(rest, lr=1e-2)], config, model_chunks=[model])
    lw = LayerWiseDistributedOptimizer([TensorParallelMuon(managed, lr=2e-2)], config, model_chunks=[model])
    opt = ChainedOptimizer([lw, DistributedOptimizer(torch.optim.AdamW(rest, lr=1e-2), config, None,
                                                     model_chunks=[model])])
    for step in range(STEPS):
        model.zero_grad_buffer()
        x, y = _batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        model.finish_grad_sync()
        assert opt.step()[0]
    return _flat(model)


def _direct_reference() -> list[float]:
    import torch

    from optstack.megatron import TensorParallelMuon

    model = _model()
    managed = [p for p in model.parameters() if p.dim() == 2 and getattr(p, "use_muon", True)]
    rest = [p for p in model.parameters() if not any(p is m for m in managed)]
    muon, adamw = TensorParallelMuon(managed, lr=2e-2), torch.optim.AdamW(rest, lr=1e-2)
    for step in range(STEPS):
        for opt in (muon, adamw):
            opt.zero_grad()
        for rank in (0, 1):
            x, y = _batch(rank, step)
            (torch.nn.functional.mse_loss(model(x), y) / 2).backward()
        muon.step()
        adamw.step()
    return _flat(model)


def test_megatrons_own_wiring_over_the_laid_out_wrapper(world2):
    import torch

    first, second = world2.run(_direct)
    assert first == second
    with _one_thread():
        reference = _direct_reference()
    torch.testing.assert_close(torch.tensor(first), torch.tensor(reference), rtol=1e-5, atol=1e-6)


def _one_process() -> list[float]:
    """The reference: the whole batch (both ranks' halves) on one process, Muon replicated."""
    import dataclasses

    import torch

    from optstack.megatron import get_megatron_optimizer

    model = _model()
    opt = get_megatron_optimizer(dataclasses.replace(_config(False), use_layer_wise_distributed_optimizer=False),
                                 [model])
    loss_fn = torch.nn.MSELoss()
    for step in range(STEPS):
        opt.zero_grad()
        for rank in (0, 1):  # the data-parallel average of the two halves' gradients
            x, y = _batch(rank, step)
            (loss_fn(model(x), y) / 2).backward()
        assert opt.step()[0]
    return _flat(model)


def test_laid_out_layer_wise_matches_one_process(world2):
    import torch

    with _one_thread():
        reference = torch.tensor(_one_process())
    for overlap, bucket_size in ((False, None), (True, 500)):
        first, second = world2.run(_laid_out, overlap, bucket_size)
        assert first["params"] == second["params"]  # the buckets' all-gather gave every rank every parameter
        # each Muon matrix stepped by exactly one rank
        assert sorted(first["mine"] + second["mine"]) == ["0.weight", "2.weight", "6.weight"]
        assert first["mine"] and second["mine"]
        torch.testing.assert_close(torch.tensor(first["params"]), reference, rtol=1e-5, atol=1e-6)


def _instances(instances: int) -> dict:
    """One of 4 ranks: the laid-out layer-wise optimizer with ``instances`` distributed-optimizer instances."""
    import torch
    import torch.distributed as dist

    from optstack.megatron import DistributedDataParallelConfig, get_megatron_optimizer
    from optstack.megatron.training import wrap_model_chunks_with_ddp

    rank, inner = dist.get_rank(), _model()
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                               num_distributed_optimizer_instances=instances)
    (model,) = wrap_model_chunks_with_ddp([inner], None, ddp_config, use_layer_wise_distributed_optimizer=True)
    opt = get_megatron_optimizer(_config(False), [model])
    by_shape = {tuple(p.shape): n for n, p in inner.named_parameters()}
    mine = sorted(by_shape[tuple(t.shape)] for t in opt.chained_optimizers[0].get_parameters())
    for step in range(STEPS):
        model.zero_grad_buffer()
        opt.zero_grad()
        x, y = _batch(rank, step)
        torch.nn.MSELoss()(model(x), y).backward()
        model.finish_grad_sync()
        assert opt.step()[0]
    return {"params": _flat(model), "mine": mine}


def test_laid_out_layer_wise_in_two_instances_matches_one_process(world4):
    """Two distributed-optimizer instances of 2 ranks (Megatron's layer-wise optimizer refuses them): each matrix
    whole in one rank's shard of its instance, the shard all-reduced across instances; the 4 ranks' training
    equals one process on the 4 half batches."""
    import dataclasses

    import torch

    from optstack.megatron import get_megatron_optimizer

    model = _model()
    opt = get_megatron_optimizer(dataclasses.replace(_config(False), use_layer_wise_distributed_optimizer=False),
                                 [model])
    params = list(model.parameters())
    with _one_thread():
        for step in range(STEPS):
            opt.zero_grad()
            grads = []
            for rank in range(4):
                x, y = _batch(rank, step)
                grads.append(torch.autograd.grad(torch.nn.MSELoss()(model(x), y) / 4, params))
            # summed in the ranks' order: each instance's pair, then across the two instances
            for p, g0, g1, g2, g3 in zip(params, *grads, strict=True):
                p.grad = (g0 + g1) + (g2 + g3)
            assert opt.step()[0]
    reference = torch.tensor(_flat(model))
    outs = world4.run(_instances, 2)
    for out in outs:
        torch.testing.assert_close(torch.tensor(out["params"]), reference, rtol=1e-5, atol=1e-6)
    # inside each instance every Muon matrix has one owner; the instances mirror each other
    for part in (outs[:2], outs[2:]):
        assert sorted(part[0]["mine"] + part[1]["mine"]) == ["0.weight", "2.weight", "6.weight"]
    assert [o["mine"] for o in outs[:2]] == [o["mine"] for o in outs[2:]]
