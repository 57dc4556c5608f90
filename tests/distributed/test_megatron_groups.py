"""The Megatron face's get_param_groups unions group keys across real ranks (some groups empty)."""

from __future__ import annotations


def _groups_on_rank() -> list[tuple[float, float, bool, int]]:
    import torch
    import torch.distributed as dist
    from torch import nn

    from optstack.megatron import OptimizerConfig, get_param_groups

    torch.manual_seed(0)
    # Rank 0 holds a layer norm (a no-weight-decay group); rank 1 holds only a bias-free matrix.
    if dist.get_rank() == 0:
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    else:
        model = nn.Sequential(nn.Linear(4, 4, bias=False))
    groups = get_param_groups([model], OptimizerConfig(lr=1e-3, min_lr=1e-4), None)
    return [(g["wd_mult"], g["max_lr"], g["is_expert_parallel"], len(g["params"])) for g in groups]


def test_every_rank_gets_the_same_groups(world2):
    r0, r1 = world2.run(_groups_on_rank)
    assert [g[:3] for g in r0] == [g[:3] for g in r1]
    assert len(r0) == 2
    # Rank 1 has no vector-like params: its no-weight-decay group exists but is empty.
    assert sorted(g[3] for g in r1) == [0, 1]
