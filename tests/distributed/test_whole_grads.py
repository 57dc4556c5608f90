"""A replicated optimizer over a wrapper that shards gradients (ZeRO-1's reduce-scatter) at 2 gloo ranks: the
stage gathers every rank's reduced shard into the buckets before it reads them, the wrapper staying as it was
built, so the step equals a single process stepping the mean gradient (Megatron steps gradients reduced only in
each rank's shard there)."""

from __future__ import annotations

import pytest

STEPS = 3


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))


def _data(world: int):
    import torch

    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4 * world, 7, generator=g), torch.randn(4 * world, 5, generator=g)) for _ in range(STEPS)]


def _flat(model) -> list[float]:
    import torch

    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def _reference(algorithm: str, megatron: bool = False) -> list[float]:
    """One process, the whole batch: the mean gradient of the ranks' halves."""
    import torch

    from optstack import megatron as mcore
    from optstack.config import OptimizerConfig
    from optstack.factory import build_optimizer

    model = _model()
    opt = (mcore.get_megatron_optimizer(mcore.OptimizerConfig(optimizer=algorithm, lr=0.1), [model]) if megatron
           else build_optimizer(OptimizerConfig(algorithm=algorithm, lr=0.1), model).optimizer)
    for x, y in _data(2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return _flat(model)


def _plain_sgd() -> list[float]:
    """One process, the whole batch, torch's SGD (lr 0.1) as it is."""
    import torch

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _data(2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return _flat(model)


def _core(sharding: str, overlap: bool, algorithm: str) -> dict:
    """build_optimizer over a DataParallel that reduce-scatters (shard_grads, on gloo too). ``zero1``: a ZeRO-1
    stage over a wrapper that all-reduces its sharded buckets."""
    import torch
    import torch.distributed as dist

    from optstack.config import DistributedConfig, OptimizerConfig
    from optstack.distributed.ddp import DataParallel
    from optstack.factory import build_optimizer

    world, rank = dist.get_world_size(), dist.get_rank()
    model = _model()
    ddp = DataParallel(model, shard_grads=True, overlap_grad_reduce=overlap, bucket_size=64,
                       sharded_reduction="all_reduce" if sharding == "zero1" else "reduce_scatter")
    cfg = OptimizerConfig(algorithm=algorithm, lr=0.1, distributed=DistributedConfig(sharding=sharding))
    opt = build_optimizer(cfg, ddp).optimizer
    launched = []
    for x, y in _data(world):
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        launched.append(ddp.launched_buckets)  # with overlap, launched from the hooks (once: none relaunched)
        opt.step()
        assert opt.last_result.applied
    # the optimizer changed nothing in the wrapper: it still reduces only each rank's shard of every bucket
    scattered = [ddp.reduces_whole(b.params) for b in ddp.param_and_grad_buffers]
    return {"params": _flat(model), "kinds": [s.placement.kind for s in opt.stages], "launched": launched,
            "buckets": len(ddp.bucket_order), "scattered": not any(scattered) and not ddp.whole_grads}


@pytest.mark.parametrize(("sharding", "overlap", "algorithm"),
                         [("replicated", False, "sgd"), ("replicated", True, "adamw"), ("zero1", True, "sgd")])
def test_replicated_optimizer_over_a_sharding_wrapper_steps_the_mean_gradient(world2, sharding, overlap, algorithm):
    import torch

    ranks = world2.run(_core, sharding, overlap, algorithm)
    want = _reference(algorithm)
    assert ranks[0]["kinds"] == ["whole" if sharding == "replicated" else "zero1"]
    assert ranks[0]["buckets"] > 1
    if overlap:
        assert ranks[0]["launched"] == [ranks[0]["buckets"]] * STEPS
    for out in ranks:
        torch.testing.assert_close(torch.tensor(out["params"]), torch.tensor(want), rtol=1e-5, atol=1e-6)
        assert out["scattered"]


def _face(overlap: bool, own_torch_optimizer: bool = False) -> list[float]:
    """Megatron's non-distributed optimizer over a wrapper built for the distributed one, Megatron's loop (with
    ``own_torch_optimizer``: an ``FP32Optimizer`` the caller built over a torch SGD)."""
    import torch
    import torch.distributed as dist

    from optstack.megatron import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        FP32Optimizer,
        OptimizerConfig,
        get_megatron_optimizer,
    )

    world, rank = dist.get_world_size(), dist.get_rank()
    model = _model()
    ddp = DistributedDataParallel(None, DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=overlap, bucket_size=64), model)
    config = OptimizerConfig(optimizer="sgd", lr=0.1, use_distributed_optimizer=False)
    if own_torch_optimizer:  # no factory in between: the wrapper is found through the parameters
        opt = FP32Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), config)
    else:
        opt = get_megatron_optimizer(config, [ddp])
        assert [type(m).__name__ for m in opt.chained_optimizers] == ["FP32Optimizer"]
    for x, y in _data(world):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        ddp.finish_grad_sync()
        assert opt.step()[0]
    return _flat(model)


@pytest.mark.parametrize(("overlap", "own_torch_optimizer"), [(False, False), (True, False), (False, True)])
def test_megatron_non_distributed_optimizer_over_a_distributed_optimizer_wrapper(world2, overlap,
                                                                                  own_torch_optimizer):
    import torch

    want = _reference("sgd", megatron=True) if not own_torch_optimizer else _plain_sgd()
    for got in world2.run(_face, overlap, own_torch_optimizer):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
