"""Rank layouts of the parallel groups (pure arithmetic, no processes)."""

from __future__ import annotations

import pytest

from optstack.distributed.parallel import ParallelGroups, RankLayout


def test_megatron_rank_order_tp_fastest_then_dp_then_pp():
    layout = RankLayout(world_size=16, tp=2, pp=2, ep=2)
    assert layout.dp == 4 and layout.expert_dp == 2
    assert layout.groups("tp")[:3] == [[0, 1], [2, 3], [4, 5]]
    assert layout.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert layout.groups("pp")[:2] == [[0, 8], [1, 9]]
    assert layout.groups("mp") == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    # ep splits dp, ep fastest: data-parallel ranks (0, 2, 4, 6) form ep groups (0, 2), (4, 6)
    assert layout.groups("ep")[:2] == [[0, 2], [1, 3]] and [4, 6] in layout.groups("ep")
    assert [0, 4] in layout.groups("expert_dp") and [2, 6] in layout.groups("expert_dp")


@pytest.mark.parametrize("kind", ["dp", "tp", "pp", "ep", "expert_dp", "mp"])
@pytest.mark.parametrize("sizes", [dict(world_size=1), dict(world_size=12, tp=2, pp=3),
                                   dict(world_size=24, tp=2, pp=2, ep=3), dict(world_size=8, ep=4)])
def test_groups_partition_the_world(kind, sizes):
    layout = RankLayout(**sizes)
    ranks = sorted(r for group in layout.groups(kind) for r in group)
    assert ranks == list(range(layout.world_size))
    expected = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "ep": layout.ep,
                "expert_dp": layout.expert_dp, "mp": layout.tp * layout.pp}[kind]
    assert {len(g) for g in layout.groups(kind)} == {expected}


def test_sizes_that_do_not_divide_are_errors():
    with pytest.raises(ValueError, match=r"tp \* pp = 4 \* 1 must divide the world size 6"):
        RankLayout(world_size=6, tp=4)
    with pytest.raises(ValueError, match="ep = 4 must divide the data-parallel size 6"):
        RankLayout(world_size=6, ep=4)
    with pytest.raises(ValueError, match="tp must be a positive integer, got 0"):
        RankLayout(world_size=6, tp=0)


def test_single_process_groups_are_null():
    groups = ParallelGroups.from_world()  # torch.distributed is not initialised in this process
    assert all(getattr(groups, k).size == 1 for k in ("dp", "tp", "pp", "ep", "expert_dp", "mp"))
    assert ParallelGroups.single().expert_dp.name == "expert-data-parallel"
    with pytest.raises(ValueError, match="need an initialised torch.distributed"):
        ParallelGroups.from_world(tp=2)


def test_package_re_exports_the_main_names() -> None:
    import optstack.distributed as distributed
    import optstack.stage as stage
    from optstack.distributed.comm import Comm, NullComm
    from optstack.distributed.ddp import DataParallel
    from optstack.stage.stage import Stage

    assert (distributed.Comm, distributed.NullComm, distributed.DataParallel) == (Comm, NullComm, DataParallel)
    assert distributed.ParallelGroups is ParallelGroups
    assert stage.Stage is Stage
    assert set(distributed.__all__) >= {"ComposedComm", "DataParallel"}
    assert set(stage.__all__) >= {"Stage", "Whole", "Zero1", "LayerWise", "Direct", "Masters"}
