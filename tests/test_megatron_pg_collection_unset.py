"""Megatron's own ``ProcessGroupCollection`` before current main (core_v0.16.1) declares its groups without
defaults: an attribute never set raises AttributeError. The face reads such a collection as Megatron does."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from optstack.megatron import DistributedDataParallel, DistributedDataParallelConfig, ProcessGroupCollection


@dataclass
class _CollectionV016:
    """core_v0.16.1's class, reduced to the fields the face reads (``field(init=False)``, no default)."""

    tp: Any = field(init=False)
    dp: Any = field(init=False)
    dp_cp: Any = field(init=False)
    expt_dp: Any = field(init=False)
    intra_dp_cp: Any = field(init=False)
    intra_dist_opt: Any = field(init=False)
    inter_dist_opt: Any = field(init=False)

    def __init__(self, **kwargs: Any) -> None:
        for key, value in kwargs.items():
            setattr(self, key, value)


def test_ddp_takes_a_collection_with_unset_groups() -> None:
    collection = _CollectionV016(dp=None)  # as Megatron's test sets only some groups, one by one
    assert isinstance(collection, ProcessGroupCollection)
    ddp = DistributedDataParallel(None, DistributedDataParallelConfig(), nn.Linear(3, 3), pg_collection=collection)
    assert ddp.groups.dp.size == 1 and ddp.groups.tp.size == 1
