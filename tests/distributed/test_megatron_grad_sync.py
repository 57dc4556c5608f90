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
