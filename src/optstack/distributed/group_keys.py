"""The cross-rank union of param-group keys: ranks holding different parameters still build the same groups."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from optstack.distributed.comm import Comm, NullComm
from optstack.groups import GroupKey

__all__ = ["union_group_keys"]


def union_group_keys(local_keys: Sequence[GroupKey], comm: Comm | NullComm) -> list[GroupKey]:
    """Every rank's ``group_keys(...)``, unioned, in group order. Collective: a rank with no parameters passes []."""
    local = list(local_keys)
    for k in local:
        if not isinstance(k, GroupKey):
            raise ValueError(f"union_group_keys needs GroupKey values (from group_keys()), got {k!r}")
    # A digest first (O(world) bytes): ranks usually hold the same keys; the lists only when some differ.
    digest = hashlib.sha256(repr(sorted(local)).encode()).digest()
    if all(d == digest for d in comm.all_gather_object(digest)):
        return sorted(set(local))
    return sorted({k for rank_keys in comm.all_gather_object(local) for k in rank_keys})
