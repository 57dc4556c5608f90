"""Megatron's gradient-sync semantics on 2 gloo ranks: what the buffers hold after a reduce-scatter, by
``average_in_collective``, and ``force_all_reduce``."""

from __future__ import annotations

import pytest


def _sync(average_in_collective: bool, force_all_reduce: bool) -> dict[str, float]:
    import torch.distributed as dist
    from torch import nn

    from optstack.megatron import DistributedDataParallel, DistributedDataParallelConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                           average_in_collective=average_in_collective)
    model = DistributedDataParallel(None, config, nn.Linear(16, 16, bias=False))
    (buffer,) = model.buffers
    buffer.grad_data.fill_(float(rank + 1))  # rank r's local gradient: r + 1 everywhere
    model.start_grad_sync(force_all_reduce=force_all_reduce)  # written directly: start it (no backward hooks)
    model.finish_grad_sync(force_all_reduce=force_all_reduce)
    shard = buffer.grad_data.numel() // world
    owned = buffer.grad_data[rank * shard:(rank + 1) * shard]
    other = buffer.grad_data[(1 - rank) * shard:(2 - rank) * shard]
    return {"owned": owned.unique().tolist(), "other": other.unique().tolist()}


@pytest.mark.parametrize(("average_in_collective", "force_all_reduce"), [(False, False), (True, False),
                                                                         (False, True)])
def test_reduce_scatter_leaves_other_ranges_as_megatron(world2, average_in_collective: bool,
                                                        force_all_reduce: bool) -> None:
    for rank, out in enumerate(world2.run(_sync, average_in_collective, force_all_reduce)):
        assert out["owned"] == [1.5]  # the mean of 1 and 2
        if force_all_reduce:
            assert out["other"] == [1.5]  # whole gradients on every rank
        elif average_in_collective:
            assert out["other"] == [rank + 1.0]  # untouched: the average happens in the collective
        else:
            assert out["other"] == [(rank + 1.0) / 2]  # scaled by 1/dp before the sum, not reduced


def _first_batch(steps: int) -> list[tuple[list[float], bool, list[float]]]:
    import torch
    import torch.distributed as dist
    from torch import nn

    from optstack.megatron import DistributedDataParallel, DistributedDataParallelConfig

    rank = dist.get_rank()
    module = nn.Linear(2, 1, bias=False)
    model = DistributedDataParallel(None, DistributedDataParallelConfig(overlap_grad_reduce=True), module)
    out = []
    for _ in range(steps):
        model.zero_grad_buffer()
        module(torch.full((1, 2), float(rank + 1))).sum().backward()
        after_backward = module.weight.main_grad.flatten().tolist()
        launched = model.bucket_launched(0)
        model.finish_grad_sync()
        out.append((after_backward, launched, module.weight.main_grad.flatten().tolist()))
    return out


def test_first_batch_launches_no_reduction_in_backward_as_megatron(world2) -> None:
    # Megatron's first batch learns the order in which gradients come; its reductions start at finish_grad_sync
    for rank, steps in enumerate(world2.run(_first_batch, 2)):
        (before, launched, after), (_, launched_next, after_next) = steps
        assert not launched and before == [(rank + 1) / 2] * 2  # this rank's own gradient, scaled by 1/dp
        assert after == after_next == [1.5, 1.5]
        assert launched_next  # from the second batch on, backward launches the bucket


def _written_into_main_grad() -> list[list[float]]:
    import torch.distributed as dist
    from torch import nn

    from optstack.megatron import DistributedDataParallel, DistributedDataParallelConfig

    rank = dist.get_rank()
    module = nn.Linear(2, 1, bias=False)
    model = DistributedDataParallel(None, DistributedDataParallelConfig(), module)
    seen = []
    for _ in range(2):
        model.zero_grad_buffer()
        module.weight.main_grad.fill_(float(rank + 1))  # no backward: written into the buffer directly
        model.finish_grad_sync()
        seen.append(module.weight.main_grad.flatten().tolist())
        model.finish_grad_sync()  # again with nothing new: a no-op (the optimizer's step calls it too)
        seen.append(module.weight.main_grad.flatten().tolist())
    return seen


def test_first_finish_after_zero_reduces_what_main_grad_holds(world2) -> None:
    for seen in world2.run(_written_into_main_grad):
        assert seen == [[1.5, 1.5]] * 4  # (1 + 2) / 2 each time, never reduced twice
