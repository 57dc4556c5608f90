"""The cross-rank union of param-group keys, so every rank builds the same groups (some of them empty).

Ranks can hold different parameters (pipeline stages, expert shards), hence different local keys; the
distributed optimizer and checkpoints need the same group list everywhere. The only collective is one
``all_gather_object`` through ``Comm``.
"""

from __future__ import annotations

from collections.abc import Sequence

from optstack.distributed.comm import Comm, NullComm
from optstack.groups import GroupKey

__all__ = ["union_group_keys"]


def union_group_keys(local_keys: Sequence[GroupKey], comm: Comm | NullComm) -> list[GroupKey]:
    """Every rank's keys, unioned, in group order (identical on every rank of ``comm``).

    Collective: every rank of ``comm`` must call it, including ranks with no parameters (pass ``[]``).

    Args:
        local_keys: this rank's keys, e.g. ``group_keys(resolve(model, rules))``.
        comm: the group to union over (``NullComm`` for one process).

    Raises:
        ValueError: when ``local_keys`` holds something other than ``GroupKey``.
    """
    local = list(local_keys)
    for k in local:
        if not isinstance(k, GroupKey):
            raise ValueError(f"union_group_keys needs GroupKey values (from group_keys()), got {k!r}")
    gathered = comm.all_gather_object(local)
    return sorted({k for rank_keys in gathered for k in rank_keys})
