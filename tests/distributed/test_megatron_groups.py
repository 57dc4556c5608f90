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


def _reduced_over_parallel_state(split: bool) -> list[float]:
    """A face wrapper built without ``pg_collection`` while a stand-in for Megatron's initialised
    ``parallel_state`` names one data-parallel group per rank (as tensor parallelism over both ranks would),
    or, with ``split=False``, no Megatron at all: the gradient each rank ends with."""
    import dataclasses
    import sys
    import types

    import torch
    import torch.distributed as dist
    from torch import nn

    from optstack.megatron import DistributedDataParallel, DistributedDataParallelConfig

    rank = dist.get_rank()
    own = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]

    @dataclasses.dataclass
    class Collection:  # Megatron's ProcessGroupCollection: declared fields, filled from parallel_state
        tp: object = None
        dp: object = None
        dp_cp: object = None
        expt_dp: object = None
        intra_dist_opt: object = None

        @classmethod
        def use_mpu_process_groups(cls) -> Collection:
            return cls(dp=own, dp_cp=own, tp=dist.group.WORLD)

    state = types.SimpleNamespace(model_parallel_is_initialized=lambda: True)
    config = types.SimpleNamespace(ProcessGroupCollection=Collection)
    saved = {name: sys.modules.get(name) for name in ("megatron.core.parallel_state",
                                                       "megatron.core.process_groups_config")}
    try:
        if split:
            sys.modules["megatron.core.parallel_state"] = state
            sys.modules["megatron.core.process_groups_config"] = config
        torch.manual_seed(0)
        module = nn.Linear(4, 1, bias=False)
        model = DistributedDataParallel(None, DistributedDataParallelConfig(), module)
        model.zero_grad_buffer()
        module(torch.full((1, 4), float(rank + 1))).sum().backward()
        model.finish_grad_sync()
        return model.main_grad(module.weight).flatten().tolist()
    finally:
        for name, module_ in saved.items():
            if module_ is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module_


def test_wrapper_without_pg_collection_reduces_over_megatrons_parallel_state(world2) -> None:
    # Megatron's wrapper takes its groups from parallel_state; the world would average across what are
    # tensor-parallel ranks there
    assert world2.run(_reduced_over_parallel_state, True) == [[1.0] * 4, [2.0] * 4]
    assert world2.run(_reduced_over_parallel_state, False) == [[1.5] * 4, [1.5] * 4]
