"""The cross-rank union of group keys on a real 2-rank gloo world."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optstack.distributed.comm import NullComm, world_comm
from optstack.distributed.group_keys import union_group_keys
from optstack.groups import GroupKey, build_param_groups, group_keys
from optstack.rules import Rule, Shape, resolve, standard_rules

DENSE = GroupKey()
NO_WD = GroupKey((("wd_mult", 0.0),))
ADAM = GroupKey((("algorithm", "adamw"), ("eps", 1e-8)))
EXPERT = GroupKey((("wd_mult", 0.0),), True)


def _union_of_different_local_sets() -> list[GroupKey]:
    import torch.distributed as dist

    local = [ADAM, DENSE] if dist.get_rank() == 0 else [EXPERT, NO_WD, ADAM]
    return union_group_keys(local, world_comm())


def test_union_is_identical_and_ordered_on_every_rank(world2):
    r0, r1 = world2.run(_union_of_different_local_sets)
    assert r0 == r1 == [DENSE, ADAM, NO_WD, EXPERT] == sorted({DENSE, ADAM, NO_WD, EXPERT})


def _stage_groups() -> list[tuple[list[str], dict]]:
    """Each rank holds a different pipeline stage; after the union both build the same groups."""
    import torch.distributed as dist

    torch.manual_seed(0)
    rank = dist.get_rank()
    if rank == 0:
        stage = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4))
        stage[0].weight.is_embedding_or_output_parameter = True
    else:
        stage = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 6, bias=False))
        stage[1].weight.allreduce = False  # pretend it is an expert-parallel parameter
    rules = standard_rules(decoupled_lr=0.01) + [Rule(Shape(6, 4), algorithm="adamw", why="head")]
    resolved = resolve(stage, rules)
    keys = union_group_keys(group_keys(resolved), world_comm())
    groups = build_param_groups(stage, resolved, lr=1e-3, min_lr=1e-4, keys=keys)
    return [(g["param_names"], {k: v for k, v in g.items() if k not in ("params", "param_names")})
            for g in groups]


def test_ranks_with_different_params_build_the_same_groups(world2):
    r0, r1 = world2.run(_stage_groups)
    assert [s for _, s in r0] == [s for _, s in r1]  # same group settings, same order
    assert len(r0) == 5
    # defaults, algorithm=adamw, max_lr=0.01 (decoupled), wd_mult=0 dense, wd_mult=0 expert
    assert [n for n, _ in r0] == [["1.weight"], [], ["0.weight"], ["1.bias"], []]
    assert [n for n, _ in r1] == [["0.weight"], ["2.weight"], [], ["0.bias", "1.bias"], ["1.weight"]]
    assert [s.get("algorithm") for _, s in r0] == [None, "adamw", None, None, None]
    assert [s["max_lr"] for _, s in r0] == [1e-3, 1e-3, 0.01, 1e-3, 1e-3]
    assert [s["is_expert_parallel"] for _, s in r0] == [False, False, False, False, True]


def test_null_comm_union_and_bad_keys():
    assert union_group_keys([NO_WD, DENSE, NO_WD], NullComm()) == [DENSE, NO_WD]
    assert union_group_keys([], NullComm()) == []
    with pytest.raises(ValueError, match="needs GroupKey values"):
        union_group_keys([(("wd_mult", 0.0),)], NullComm())  # type: ignore[list-item]
