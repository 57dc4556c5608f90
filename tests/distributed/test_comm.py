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


# -- flat-tensor collectives, uneven gathers, objects (world of 3: an uneven size) ------------------------
def _flat_collectives() -> dict:
    import warnings

    import torch.distributed as dist

    from optstack.distributed.comm import Comm

    rank, size = dist.get_rank(), dist.get_world_size()
    comm = Comm(None, name="test-world")
    out: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the renamed collectives must not warn
        inp = torch.arange(4.0 * size) * (rank + 1)  # sum over ranks: arange * 6 for size 3
        shard = torch.empty(4)
        comm.reduce_scatter(shard, inp)
        out["rs"] = shard.tolist()
        avg = torch.empty(4)
        comm.reduce_scatter_async(avg, inp, "avg").wait()
        out["rs_avg"] = avg.tolist()
        inplace = inp.clone()
        comm.reduce_scatter(inplace[4 * rank:4 * rank + 4], inplace)
        out["rs_inplace"] = inplace[4 * rank:4 * rank + 4].tolist()
        comm._native_reduce_scatter = False  # the emulation for backends without a reduce-scatter
        emulated = torch.empty(4)
        comm.reduce_scatter(emulated, inp, "max")
        out["rs_emulated_max"] = emulated.tolist()
        gathered = torch.empty(2 * size)
        comm.all_gather_into_async(gathered, torch.full((2,), float(rank))).wait()
        out["ag"] = gathered.tolist()
        inplace_ag = torch.zeros(2 * size)
        inplace_ag[2 * rank:2 * rank + 2] = float(rank)
        comm.all_gather_into(inplace_ag, inplace_ag[2 * rank:2 * rank + 2])  # what ZeRO-1's param gather does
        out["ag_inplace"] = inplace_ag.tolist()
        t = torch.full((3,), float(rank))
        h = comm.all_reduce_async(t, "avg")
        h.wait()
        out["ar_avg"] = t.tolist()
        shapes = {0: (2, 3), 1: (0, 3), 2: (5,)}
        mine = torch.arange(float(torch.Size(shapes[rank]).numel())).reshape(shapes[rank]) + 100 * rank
        out["uneven"] = [(tuple(x.shape), x.reshape(-1).tolist()) for x in comm.all_gather_uneven(mine)]
        out["objects"] = comm.all_gather_object({"rank": rank, "pad": "x" * rank * 50})
        out["bcast"] = comm.broadcast_object(("from", rank), src=1)
    try:
        comm.all_gather_uneven(torch.zeros(2, dtype=torch.float64 if rank == 2 else torch.float32))
    except ValueError as exc:
        out["dtype_error"] = str(exc)
    return out


def test_flat_collectives_uneven_gathers_and_objects(world3):
    results = world3.run(_flat_collectives)
    expected_sum = (torch.arange(12.0) * 6).view(3, 4)
    for rank, out in enumerate(results):
        assert out["rs"] == expected_sum[rank].tolist() == out["rs_inplace"]
        assert out["rs_avg"] == pytest.approx((expected_sum[rank] / 3).tolist())
        assert out["rs_emulated_max"] == (torch.arange(12.0) * 3).view(3, 4)[rank].tolist()
        assert out["ag"] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0] == out["ag_inplace"]
        assert out["ar_avg"] == [1.0, 1.0, 1.0]
        assert out["uneven"] == [((2, 3), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]), ((0, 3), []),
                                 ((5,), [200.0, 201.0, 202.0, 203.0, 204.0])]
        assert [o["rank"] for o in out["objects"]] == [0, 1, 2] and out["objects"][2]["pad"] == "x" * 100
        assert out["bcast"] == ("from", 1)
        assert "needs one dtype on every rank" in out["dtype_error"] and "float64" in out["dtype_error"]


def _subgroups() -> list:
    import torch.distributed as dist

    from optstack.distributed.comm import new_group, new_subgroups

    rank = dist.get_rank()
    pair = new_group([2, 0], name="pair")
    parts = new_subgroups([[0, 2], [1]], name="parts")
    t = torch.tensor([float(rank + 1)])
    if pair is not None:
        pair.all_reduce(t)
    try:
        new_subgroups([[0, 1]], name="bad")
    except ValueError as exc:
        error = str(exc)
    return [None if pair is None else (pair.rank, pair.size, pair.global_ranks), type(parts).__name__,
            parts.size, t.item(), error]


def test_new_group_and_subgroups(world3):
    r0, r1, r2 = world3.run(_subgroups)
    assert r0[:4] == [(0, 2, [0, 2]), "Comm", 2, 4.0] and r2[:4] == [(1, 2, [0, 2]), "Comm", 2, 4.0]
    assert r1[:4] == [None, "NullComm", 1, 2.0]
    assert "must cover every rank of the world (size 3) exactly once; got [[0, 1]]" in r0[4]


# -- timeouts: a stalled or failed peer gives a CommError naming the operation and the group --------------
def _peer_fails(how: str, timeout_s: float, op: str = "all_reduce") -> tuple[str, float]:
    import datetime
    import time

    import torch.distributed as dist

    from optstack.distributed.comm import Comm, CommError

    # A separate group with a short timeout: the session world (30 s) stays usable afterwards.
    timeout = datetime.timedelta(seconds=timeout_s)
    comm = Comm(dist.new_group([0, 1], timeout=timeout), name="short-timeout", timeout=timeout)
    start = time.monotonic()
    try:
        if dist.get_rank() == 1:
            if how == "raise":
                raise RuntimeError("rank 1 fails before the collective")
            time.sleep(timeout_s + 4)  # arrives after rank 0 gave up, even on a loaded machine
        if op == "broadcast_async":
            comm.broadcast_async(torch.ones(3), src=1).wait()
        else:
            comm.all_reduce(torch.ones(3))
        return "no error", time.monotonic() - start
    except (CommError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start


@pytest.mark.parametrize("how", ["stall", "raise"])
def test_peer_that_stalls_or_raises_gives_comm_error_within_timeout(world2, how):
    (msg0, elapsed0), (msg1, _) = world2.run(_peer_fails, how, 1.0)
    assert msg0.startswith(
        "CommError: all_reduce on the 'short-timeout' group (rank 0 of 2, gloo, timeout 1 s)")
    assert "A peer rank may have died, stalled" in msg0
    # the group's 1 s, not the session's 30 s (the upper bound leaves room for a loaded machine)
    assert 0.9 < elapsed0 < 5.0
    assert msg1 != "no error"
    # the session world still works
    assert world2.run(_all_reduce_and_gather)[0] == ([3.0, 1.0], [0, 1])


def test_stalled_broadcast_async_gives_comm_error_naming_broadcast(world2):
    (msg0, elapsed0), _ = world2.run(_peer_fails, "stall", 1.0, "broadcast_async")
    assert msg0.startswith("CommError: broadcast on the 'short-timeout' group (rank 0 of 2, gloo, timeout 1 s)")
    assert 0.9 < elapsed0 < 5.0


def _broadcasts_in_flight() -> dict:
    from optstack.distributed.comm import world_comm

    comm = world_comm()
    rank = comm.rank
    # One in-place broadcast per source rank, all in flight at once (as the overlapped parameter gather
    # does), into disjoint ranges of one buffer.
    buf = torch.full((2, 3), float(rank + 1))
    handles = [comm.broadcast_async(buf[src], src) for src in range(comm.size)]
    ops = [h.op for h in handles]
    for h in handles:
        h.wait()
    out = {"buf": buf.tolist(), "ops": ops, "done": all(h.is_completed() for h in handles)}
    try:
        comm.broadcast_async(buf[0], src=comm.size)
    except ValueError as exc:
        out["error"] = str(exc)
    return out


def test_broadcast_async_from_every_rank_at_once(world2):
    for out in world2.run(_broadcasts_in_flight):
        assert out["buf"] == [[1.0] * 3, [2.0] * 3]
        assert out["ops"] == ["broadcast", "broadcast"] and out["done"]
        assert "src must be a group rank in [0, 2), got 2" in out["error"]


# -- process groups ------------------------------------------------------------------------------------
def _parallel_groups() -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from optstack.distributed.parallel import ParallelGroups

    out: dict = {}
    default = ParallelGroups.from_world()
    out["default"] = [default.dp.size, default.tp.size, default.expert_dp.size, type(default.mp).__name__]
    tp2 = ParallelGroups.from_world(tp=2)
    t = torch.tensor([float(dist.get_rank() + 1)])
    tp2.tp.all_reduce(t)
    out["tp2"] = [tp2.dp.size, tp2.tp.size, tp2.mp.size, tp2.tp.name, t.item()]
    ep2 = ParallelGroups.from_world(ep=2)
    out["ep2"] = [ep2.dp.size, ep2.ep.size, ep2.expert_dp.size, type(ep2.expert_dp).__name__]
    mesh = ParallelGroups.from_device_mesh(init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)))
    out["mesh"] = [mesh.dp.size, mesh.tp.size, mesh.expert_dp.size, mesh.dp.all_gather_object(mesh.dp.rank)]
    user = ParallelGroups.from_process_groups(dp=dist.group.WORLD)
    out["user"] = [user.dp.size, user.expert_dp.size, user.tp.size]
    try:
        ParallelGroups.from_world(tp=3)
    except ValueError as exc:
        out["error"] = str(exc)
    return out


def test_parallel_groups_from_world_mesh_and_user_groups(world2):
    for out in world2.run(_parallel_groups):
        assert out["default"] == [2, 1, 2, "NullComm"]
        assert out["tp2"] == [1, 2, 2, "tensor-parallel", 3.0]
        assert out["ep2"] == [2, 2, 1, "NullComm"]
        assert out["mesh"] == [2, 1, 2, [0, 1]]
        assert out["user"] == [2, 2, 1]
        assert "tp * pp = 3 * 1 must divide the world size 2" in out["error"]


def test_null_comm_collectives_are_identity():
    c = NullComm("data-parallel")
    t = torch.arange(4.0)
    out = torch.empty(4)
    c.reduce_scatter(out, t)
    assert torch.equal(out, t)
    c.all_gather_into(out, t * 2)
    assert torch.equal(out, t * 2)
    h = c.all_reduce_async(t, "avg")
    h.wait()
    assert h.is_completed() and torch.equal(t, torch.arange(4.0))
    assert c.all_gather_uneven(t)[0] is t and c.broadcast_object("x") == "x"
    b = c.broadcast_async(t)
    b.wait()
    assert b.op == "broadcast" and b.is_completed() and torch.equal(t, torch.arange(4.0))
    with pytest.raises(ValueError, match="equal size"):
        c.reduce_scatter(torch.empty(3), t)


def _gather_scatter() -> dict:
    """A gather to rank 1 of uneven parts (rank 2 sends nothing, as a replica would) and two in flight at once
    (tags), then a scatter from rank 1 of uneven parts (rank 0 gets nothing)."""
    comm = world_comm()
    rank = comm.rank
    mine = torch.arange(rank + 2, dtype=torch.float32) + 10 * rank
    parts = [torch.empty(2), torch.empty(3), None] if rank == 1 else []
    again = [torch.empty(2), torch.empty(3), torch.empty(4)] if rank == 1 else []
    first = comm.gather_async(mine if rank != 2 else None, 1, parts, tag=0)
    second = comm.gather_async(mine * 2, 1, again, tag=1)
    second.wait()
    first.wait()
    out = {"gathered": [None if p is None else p.tolist() for p in parts], "again": [p.tolist() for p in again]}
    got = torch.full((rank + 1,), -1.0) if rank != 0 else None
    send = [None, torch.tensor([5.0, 6.0]), torch.tensor([7.0, 8.0, 9.0])] if rank == 1 else []
    comm.scatter(got, 1, send)
    out["scattered"] = None if got is None else got.tolist()
    return out


def test_gather_to_one_rank_and_scatter_with_uneven_and_absent_parts(world3):
    r0, r1, r2 = world3.run(_gather_scatter)
    assert r1["gathered"] == [[0.0, 1.0], [10.0, 11.0, 12.0], None]
    assert r1["again"] == [[0.0, 2.0], [20.0, 22.0, 24.0], [40.0, 42.0, 44.0, 46.0]]
    assert r0["scattered"] is None and r1["scattered"] == [5.0, 6.0] and r2["scattered"] == [7.0, 8.0, 9.0]


def test_null_comm_gather_and_scatter_copy():
    c = NullComm()
    part, out = torch.empty(3), torch.empty(3)
    c.gather(torch.arange(3.0), 0, [part])
    c.scatter(out, 0, [torch.arange(3.0) * 2])
    assert part.tolist() == [0.0, 1.0, 2.0] and out.tolist() == [0.0, 2.0, 4.0]
    with pytest.raises(ValueError, match="dst=0 and one part"):
        c.gather(part, 1, [part])
