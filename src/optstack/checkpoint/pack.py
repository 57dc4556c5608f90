"""Many small tensors as a few DCP items: what makes 50,000 tiny parameters save and load in seconds.

DCP writes each item as its own ``torch.save`` record and reads it back with its own ``torch.load`` (about half
a millisecond each, whatever the size), so the three states of 50,000 tiny parameters took minutes. A rank with
at least ``MIN_PACKED`` small chunks writes them concatenated per dtype instead, in segments of at most
``SEGMENT_BYTES`` (DCP key ``pack/<i>``); a read takes each segment it needs whole, once. The manifest's
``packs`` says, per writing rank, each segment's dtype and items ``[DCP key, start, numel]`` in order (an item's
offset in its segment is the sum of the lengths before it). Fewer small chunks keep one item each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from optstack.checkpoint.format import dtype_from_name, dtype_name, is_count
from optstack.checkpoint.storage import Chunk, read_chunks

__all__ = ["SMALL_BYTES", "MIN_PACKED", "SEGMENT_BYTES", "pack_chunks", "read_packed", "check_packs"]

SMALL_BYTES = 1 << 16  # a chunk at most this large may be packed
MIN_PACKED = 256  # fewer small chunks than this cost little as items of their own
SEGMENT_BYTES = 1 << 24  # a segment is read whole: bounded, so a read of a few items stays cheap
Segment = list[Any]  # [dtype name, [[DCP key, start, numel], ...]]


def pack_key(index: int) -> str:
    return f"pack/{index}"


def pack_chunks(chunks: Sequence[Chunk]) -> tuple[list[Chunk], list[Segment]]:
    """The chunks to write (big ones as they are, small ones packed) and the segments' manifest entry."""
    small = [c for c in chunks if 0 < c.tensor.numel() * c.tensor.element_size() <= SMALL_BYTES]
    if len(small) < MIN_PACKED:
        return list(chunks), []
    packed = {id(c) for c in small}
    out = [c for c in chunks if id(c) not in packed]
    by_dtype: dict[torch.dtype, list[Chunk]] = {}
    for c in small:
        by_dtype.setdefault(c.tensor.dtype, []).append(c)
    segments: list[Segment] = []
    for dtype, members in by_dtype.items():
        start = 0
        while start < len(members):
            end, size = start, 0
            while end < len(members) and (end == start or size + members[end].tensor.numel() * dtype.itemsize
                                          <= SEGMENT_BYTES):
                size += members[end].tensor.numel() * dtype.itemsize
                end += 1
            part = members[start:end]
            flat = torch.cat([c.tensor for c in part])  # chunks are 1-D
            out.append(Chunk(pack_key(len(segments)), flat, 0, flat.numel()))
            segments.append([dtype_name(dtype), [[c.key, c.start, c.tensor.numel()] for c in part]])
            start = end
    return out, segments


def read_packed(directory: Path, packs: Mapping[str, Sequence[Segment]] | None,
                by_rank: Mapping[int, list[Chunk]], known: dict[Path, Metadata] | None = None) -> None:
    """``read_chunks``, taking the chunks a rank packed from its segments (``packs``: the manifest's entry)."""
    plain: dict[int, list[Chunk]] = {}
    for rank, chunks in by_rank.items():
        segments = (packs or {}).get(str(rank))
        if not segments:
            plain[rank] = chunks
            continue
        where = _index(rank, segments)
        wanted: dict[int, list[tuple[Chunk, int]]] = {}  # segment -> (chunk, its offset in the segment)
        for c in chunks:
            if (found := where.get(c.key)) is None:
                plain.setdefault(rank, []).append(c)
                continue
            index, offset, start, numel = found
            if not start <= c.start <= c.start + c.tensor.numel() <= start + numel:
                raise ValueError(f"{c.key!r} elements [{c.start}, {c.start + c.tensor.numel()}) are not in rank "
                                 f"{rank}'s pack, which holds [{start}, {start + numel}): the manifest is damaged")
            wanted.setdefault(index, []).append((c, offset + c.start - start))
        flats = {i: torch.empty(sum(n for _, _, n in segments[i][1]), dtype=dtype_from_name(segments[i][0]))
                 for i in wanted}
        read_chunks(directory, {rank: [Chunk(pack_key(i), flat, 0, flat.numel()) for i, flat in flats.items()]},
                    known)
        for index, members in wanted.items():
            for c, offset in members:
                c.tensor.copy_(flats[index][offset : offset + c.tensor.numel()])
    read_chunks(directory, plain, known)


def check_packs(packs: Any, world_size: int, where: str) -> None:
    """The manifest's ``packs`` have the format's types and sizes (``ValueError`` naming ``where`` and the field):
    a rank of the world, items of at most ``SMALL_BYTES``, segments of at most ``SEGMENT_BYTES`` (what a read
    allocates for a segment, checked before it does)."""
    if packs is None:
        return
    if not isinstance(packs, dict):
        raise ValueError(f"{where}: packs is a {type(packs).__name__}, expected a dict")
    for rank, segments in packs.items():
        if not (isinstance(rank, str) and rank.isdigit() and len(rank) < 10 and int(rank) < world_size):
            raise ValueError(f"{where}: packs has the key {rank[:40]!r}, expected a rank < {world_size}")
        _index(int(rank), segments, where)


def _index(rank: int, segments: Any, where: str = "the manifest") -> dict[str, tuple[int, int, int, int]]:
    """{DCP key: (segment, offset in it, start, numel)} of ``rank``'s packs; ValueError unless the manifest's
    entry has the format's types and sizes (it is read from disk: checked before use)."""
    where_ = f"{where}: the packs of rank {rank}, packs[{str(rank)!r}]"
    malformed = ValueError(f"{where_}, are not [[dtype, [[key, start, numel], ...]], ...]: the manifest was altered "
                           "or written by something other than optstack")
    if not isinstance(segments, list):
        raise malformed
    out: dict[str, tuple[int, int, int, int]] = {}
    for index, segment in enumerate(segments):
        if not (isinstance(segment, list) and len(segment) == 2 and isinstance(segment[0], str)
                and isinstance(segment[1], list)):
            raise malformed
        itemsize = dtype_from_name(segment[0]).itemsize
        offset = 0
        for i, item in enumerate(segment[1]):
            if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and is_count(item[1])
                    and is_count(item[2])):
                raise malformed
            if item[2] * itemsize > SMALL_BYTES or (offset + item[2]) * itemsize > SEGMENT_BYTES:
                raise ValueError(f"{where_}[{index}][1][{i}] holds {item[2]} elements of {segment[0]}: an item "
                                 f"is at most {SMALL_BYTES} bytes and a segment {SEGMENT_BYTES}; the manifest "
                                 "was altered")
            out[item[0]] = (index, offset, item[1], item[2])
            offset += item[2]
    return out
