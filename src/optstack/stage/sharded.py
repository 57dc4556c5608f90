"""A sharded stage's torch-format state as ``ShardedTensor``s, so DCP writes each range once and reads it back
at another data-parallel size.

Under ZeRO-1 (ranges of flattened parameters) and layer-wise (whole parameters on their owner) each rank holds
a different part of a parameter's state under the same key; as plain tensors DCP would keep one rank's and
drop the rest. Here each element-wise state tensor becomes a ``ShardedTensor`` whose local shard is a view of
the live state (``dcp.load`` writes straight into it), on every rank of the shard group, holding a part or not.
Scalars (``step``) stay plain, on the ranks holding a part.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from optstack.distributed.comm import Comm

if TYPE_CHECKING:
    from optstack.layout import Run

__all__ = ["is_sharded", "local_part", "to_sharded"]


def _element_wise(key: str, value: Any) -> bool:
    return isinstance(value, torch.Tensor) and (value.dim() > 0 or key == "master")


def to_sharded(entries: Mapping[int, Mapping[str, Any]], params: Sequence[torch.Tensor],
               ranges: Mapping[int, tuple[int, int, str]], comm: Comm, whole: bool = False,
               runs: Sequence[Sequence[Run]] | None = None) -> dict[int, dict[str, Any]]:
    """``entries`` (``id(param)`` -> this rank's state, as ``Stage.torch_state``) for every one of ``params``,
    element-wise tensors as ``ShardedTensor``s over ``comm`` of the flattened parameter, ``(numel,)``.
    ``ranges``: ``id(param)`` -> the flat range this rank holds and its device. ``whole``: each parameter is
    held whole by its one holder (layer-wise, DTensor owners): the state keeps the parameter's shape, as one
    process and FSDP2 save it, so DCP moves it between them. ``runs``: per parameter, what every rank of
    ``comm`` holds (``Placement.holdings``), if known.

    Collective over ``comm``. Given ``runs``, the ranks exchange only their state's keys and dtypes (a few per
    stage): where every parameter a rank holds has the same ones, every rank builds every ``ShardedTensor``'s
    metadata itself. Otherwise (state made lazily, for some parameters only) the ranks exchange their tables.
    Either way each ``ShardedTensor`` lists every rank's shard: torch's format, so its metadata on every rank
    grows as ranks x parameters (DCP's planner then gathers each rank's items to its coordinator as well)."""
    mine = {i: (*ranges[id(p)], {k: str(v.dtype) for k, v in entries[id(p)].items() if _element_wise(k, v)})
            for i, p in enumerate(params) if id(p) in entries}
    tables = _derived(mine, params, runs, comm) if runs is not None else None
    tables = tables if tables is not None else comm.all_gather_object(mine)
    me = comm.global_ranks[comm.rank]
    out: dict[int, dict[str, Any]] = {}
    for i, param in enumerate(params):
        holders = [(comm.global_ranks[r], table[i]) for r, table in enumerate(tables) if i in table]
        if not holders:
            continue
        local = entries.get(id(param), {})
        entry = {k: v for k, v in local.items() if not _element_wise(k, v)}
        keys = {k: d for _, (*_, dtypes) in holders for k, d in dtypes.items()}
        shape = list(param.shape) if whole and param.dim() else [param.numel()]
        metas = {rank: ShardMetadata([start] + [0] * (len(shape) - 1), shape if len(shape) > 1 else [end - start],
                                     f"rank:{rank}/{device}")
                 for rank, (start, end, device, _) in holders if end > start}
        for key, dtype in keys.items():
            shards = [Shard(local[key].detach().reshape(shape if len(shape) > 1 else -1), metas[me])
                      ] if me in metas and key in local else []
            properties = TensorProperties(dtype=getattr(torch, dtype.removeprefix("torch.")), requires_grad=False)
            metadata = ShardedTensorMetadata(list(metas.values()), torch.Size(shape), properties)
            entry[key] = ShardedTensor._init_from_local_shards_and_global_metadata(
                shards, metadata, process_group=comm.group)
        out[id(param)] = entry
    return out


def _derived(mine: Mapping[int, tuple[int, int, str, dict[str, str]]], params: Sequence[torch.Tensor],
             runs: Sequence[Sequence[Run]], comm: Comm) -> list[dict[int, Any]] | None:
    """Every rank's table as ``to_sharded`` gathers it, from ``runs`` and the ranks' keys (None: the ranks'
    parameters do not all have the same keys and dtypes)."""
    kinds = {tuple(sorted(dtypes.items())) for start, end, _, dtypes in mine.values() if end > start}
    device = next((d for _, _, d, _ in mine.values()), "cpu")
    everyone = comm.all_gather_object(next(iter(kinds)) if len(kinds) == 1 else None if kinds else ())
    held = {k for k in everyone if k != ()}
    if None in held or len(held) > 1:
        return None
    dtypes = dict(next(iter(held), ()))
    tables: list[dict[int, Any]] = [{} for _ in range(comm.size)]
    for i, param_runs in enumerate(runs):
        for first, lo, hi, count in param_runs:
            for k in range(count):
                tables[first + k][i] = (lo + k * (hi - lo), hi + k * (hi - lo), device, dtypes)
    tables[comm.rank] = dict(mine)  # this rank's own (its empty ranges included)
    return tables


def is_sharded(value: Any) -> bool:
    return isinstance(value, ShardedTensor)


def local_part(value: ShardedTensor) -> torch.Tensor | None:
    """This rank's elements of a flat ``ShardedTensor`` (its local shards in offset order), None if none."""
    shards = sorted(value.local_shards(), key=lambda s: s.metadata.shard_offsets[0])
    if not shards:
        return None
    return torch.cat([s.tensor.reshape(-1) for s in shards]) if len(shards) > 1 else shards[0].tensor.reshape(-1)
