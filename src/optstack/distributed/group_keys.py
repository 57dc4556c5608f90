"""The cross-rank union of param-group keys, so every rank builds the same groups (some of them empty):
ranks can hold different parameters (pipeline stages, expert shards), hence different local keys."""

from __future__ import annotations

from collections.abc import Sequence

from optstack.distributed.comm import Comm, NullComm
from optstack.groups import GroupKey

__all__ = ["union_group_keys"]


def union_group_keys(local_keys: Sequence[GroupKey], comm: Comm | NullComm) -> list[GroupKey]:
    """Every rank's keys (e.g. ``group_keys(resolve(model, rules))``), unioned, in group order: the same on
    every rank of ``comm``. Collective: every rank calls it, a rank with no parameters with ``[]``."""
    local = list(local_keys)
    for k in local:
        if not isinstance(k, GroupKey):
            raise ValueError(f"union_group_keys needs GroupKey values (from group_keys()), got {k!r}")
    return sorted({k for rank_keys in comm.all_gather_object(local) for k in rank_keys})
