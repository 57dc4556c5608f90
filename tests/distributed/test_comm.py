"""The communicator on a real 2-rank gloo world."""

from __future__ import annotations

import pytest
import torch

from optstack.distributed.comm import NullComm, world_comm


def _all_reduce_and_gather() -> tuple[list[float], list[int]]:
    import torch.distributed as dist

    comm = world_comm()
    t = torch.tensor([float(dist.get_rank() + 1)])
    comm.all_reduce(t)
    m = torch.tensor([float(dist.get_rank())])
    comm.all_reduce(m, op="max")
    return [t.item(), m.item()], comm.all_gather_object(dist.get_rank())


def test_all_reduce_and_object_gather(world2):
    results = world2.run(_all_reduce_and_gather)
    for sums, ranks in results:
        assert sums == [3.0, 1.0]
        assert ranks == [0, 1]


def _raise_on_rank1() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")


def test_failure_reports_rank_traceback(world2):
    with pytest.raises(AssertionError, match="boom on rank 1"):
        world2.run(_raise_on_rank1)


def test_null_comm_is_identity():
    c = NullComm()
    t = torch.ones(3)
    assert c.all_reduce(t) is t and c.all_gather_object(5) == [5] and c.size == 1
    with pytest.raises(ValueError, match="op must be one of"):
        c.all_reduce(t, op="prod")
