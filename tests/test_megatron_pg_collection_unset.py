"""Megatron's own ``ProcessGroupCollection`` before current main (core_v0.16.1) declares its groups without
defaults: an attribute never set raises AttributeError. The face reads such a collection as Megatron does."""

from __future__ import annotations

from dataclasses import field, make_dataclass
from typing import Any

from torch import nn

from optstack.megatron import DistributedDataParallel, DistributedDataParallelConfig, ProcessGroupCollection


def _set(self: Any, **kwargs: Any) -> None:
    for key, value in kwargs.items():
        setattr(self, key, value)


# core_v0.16.1's class, reduced to the groups the face reads: declared with field(init=False) and no default
_CollectionV016 = make_dataclass(
    "_CollectionV016",
    [(name, Any, field(init=False)) for name in ("tp", "dp", "dp_cp", "expt_dp", "intra_dp_cp", "intra_dist_opt",
                                                 "inter_dist_opt", "pp", "ep", "mp")],
    init=False, namespace={"__init__": _set})


def test_ddp_takes_a_collection_with_unset_groups() -> None:
    collection = _CollectionV016(dp=None)  # as Megatron's test sets only some groups, one by one
    assert isinstance(collection, ProcessGroupCollection)
    ddp = DistributedDataParallel(None, DistributedDataParallelConfig(), nn.Linear(3, 3), pg_collection=collection)
    assert ddp.groups.dp.size == 1 and ddp.groups.tp.size == 1
