"""Manifests from the plan: what every rank holds of every parameter, computed on each rank alone.

Each stage's placement knows every rank's part of its parameters (ZeRO-1 from the buffer layouts, layer-wise
from the owners, replicated trivially: ``Placement.holdings``), so a save's manifest, who writes what, and a
load's reads at any other world size are pure functions every rank computes for itself. Ranks exchange only a
fixed-size ``Agreement`` (a digest of that view, whether their own state fits it, a fingerprint of replicated
values): O(world) bytes, whatever the number of parameters. Where a placement cannot tell (DTensor stages) or
the ranks' views differ (ranks holding different parameters, e.g. pipeline stages, or a rank whose state does
not fit its view), the caller falls back to exchanging the ranks' tables (``state.plan_save``), which also
names what differs.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from optstack.checkpoint.format import group_identity, settings_of
from optstack.checkpoint.state import HeldParam, ModelTable, SavePlan
from optstack.layout import Run
from optstack.protocol import algorithm_name
from optstack.stage import Stage

__all__ = ["Agreement", "View", "ViewParam", "agreement", "chunk_runs", "overlapping", "plan_from_view",
           "view_of"]


@dataclass(frozen=True)
class ViewParam:
    """One parameter as every rank sees it: shape, its group's identity and settings, and who holds it.
    ``runs``: over the checkpoint's ranks (``Run``); None: every rank holds it whole."""

    shape: tuple[int, ...]
    identity: dict[str, Any]
    settings: dict[str, Any]
    runs: tuple[Run, ...] | None


View = dict[str, ViewParam]


def view_of(stages: Sequence[Stage], ranks: Sequence[int]) -> View | None:
    """Every parameter of ``stages`` and what every one of ``ranks`` (the checkpoint's group, as global ranks)
    holds of it; None when a placement cannot tell, or shards over a group other than ``ranks``."""
    out: View = {}
    for stage in stages:
        params = [p for g in stage.param_groups for p in g["params"]]
        held = stage.placement.holdings(params)
        if held is None or held.ranks is not None and tuple(held.ranks) != tuple(ranks):
            return None
        algorithm = algorithm_name(stage.optimizer)
        runs = iter(held.runs)
        for group in stage.param_groups:
            identity, settings = group_identity(group, algorithm), settings_of(group)
            for name, param in zip(group["param_names"], group["params"], strict=True):
                if name in out:
                    return None  # a name in two stages: the tables' path names it
                out[name] = ViewParam(tuple(param.shape), identity, settings,
                                      None if held.ranks is None else next(runs))
    return out


def overlapping(runs: Sequence[Run], start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """``(rank, lo, hi)`` of each rank's stretch in ``runs`` that meets ``[start, end)``, clipped to it; a run of
    many ranks is walked only where it meets the range."""
    for first, lo, hi, count in runs:
        size = hi - lo
        if size <= 0:
            continue
        begin = max(0, (start - lo) // size)
        stop = min(count, -(-(end - lo) // size))
        for i in range(begin, stop):
            a, b = max(start, lo + i * size), min(end, lo + (i + 1) * size)
            if a < b:
                yield first + i, a, b


def chunk_runs(chunks: Sequence[Sequence[int]]) -> list[Run]:
    """A manifest's ``chunks`` (``[rank, start, end]`` or ``[rank, start, end, count]``) as ``Run``s."""
    return [(c[0], c[1], c[2], c[3] if len(c) > 3 else 1) for c in chunks]


def _mine(view: View, rank: int) -> dict[str, tuple[int, int]]:
    """The non-empty range ``rank`` holds of each parameter, by the view."""
    out = {}
    for name, p in view.items():
        numel = math.prod(p.shape)
        if p.runs is None:
            out[name] = (0, numel)
            continue
        for first, lo, hi, count in p.runs:
            if first <= rank < first + count and hi > lo:
                i = rank - first
                out[name] = (lo + i * (hi - lo), hi + i * (hi - lo))
    return out


def _rows(view: View, model: ModelTable | None) -> list[tuple[str, str]]:
    """The view as (what, value) rows, equal on every rank that computed the same view (``Agreement`` hashes them)."""
    rows = [(f"parameter {name!r}", json.dumps([p.shape, p.identity, p.settings, p.runs], sort_keys=True))
            for name, p in view.items()]
    return rows + [(f"model tensor {k!r}", repr(v)) for k, v in (model or {}).items()]


@dataclass(frozen=True)
class Agreement:
    """What a rank sends the others before a save or load (fixed size): the digest of its view (empty: it has
    none), whether its own state is what the view says it holds (None: yes, else the first difference), and a
    CRC-32 of the fingerprints of what every rank holds whole (replicated values must be equal)."""

    digest: bytes
    misfit: str | None
    replicated: str

    @classmethod
    def of(cls, view: View | None, model: ModelTable | None, held: Mapping[str, HeldParam],
           fingerprints: Mapping[str, str], rank: int) -> Agreement:
        if view is None:
            return cls(b"", None, "")
        h = hashlib.sha256()
        for what, value in _rows(view, model):
            h.update(what.encode() + b"\0" + value.encode() + b"\0")
        mine = _mine(view, rank)
        misfit = next((f"rank {rank} holds [{h.start}, {h.end}) of {n!r}, its plan says {mine.get(n)}"
                       for n, h in held.items() if mine.get(n, (0, 0)) != (h.start, h.end) and h.end > h.start),
                      None)
        misfit = misfit or next((f"rank {rank} holds nothing of {n!r}, its plan says {r}" for n, r in mine.items()
                                 if n not in held), None)
        crc = 0
        for name, value in sorted(fingerprints.items()):
            crc = zlib.crc32(f"{name}={value};".encode(), crc)
        return cls(h.digest(), misfit[:300] if misfit else None, f"{crc:08x}")


def agreement(everyone: Sequence[Agreement]) -> bool:
    """True when every rank computed the same view and holds what it says: the view alone plans the save."""
    first = everyone[0]
    return bool(first.digest) and all(a.digest == first.digest and a.misfit is None
                                      and a.replicated == first.replicated for a in everyone)


def plan_from_view(view: View, model: ModelTable | None, size: int, rank: int) -> SavePlan:
    """The ``SavePlan`` of ``view`` over ``size`` ranks, with ``rank``'s writes only (the others' are left empty:
    no rank needs them). Sharded ranges are written by their one holder; what every rank holds whole, and the
    model, by the least loaded rank (in elements), largest first, as ``state.plan_save`` balances them."""
    load = [0] * (size + 1)  # a difference array over ranks: runs add to consecutive ranks
    for p in view.values():
        for first, lo, hi, count in p.runs or ():
            load[first] += hi - lo
            load[first + count] -= hi - lo
    for r in range(1, size):
        load[r] += load[r - 1]
    heap = [(load[r], r) for r in range(size)]
    heapq.heapify(heap)

    def least_loaded(numel: int) -> int:
        elements, writer = heapq.heappop(heap)
        heapq.heappush(heap, (elements + numel, writer))
        return writer

    replicated = sorted((n for n, p in view.items() if p.runs is None), key=lambda n: (-math.prod(view[n].shape), n))
    writer_of = {n: least_loaded(math.prod(view[n].shape)) for n in replicated}
    writes: list[list[tuple[str, int, int]]] = [[] for _ in range(size)]
    groups: dict[str, int] = {}
    group_list: list[dict[str, Any]] = []
    params: dict[str, dict[str, Any]] = {}
    for name, p in view.items():
        numel = math.prod(p.shape)
        if p.runs is None:  # (an empty parameter too: its writer's part holds its dtypes and scalars)
            chunks = [[writer_of[name], 0, numel]]
        else:
            chunks = [[first, lo, hi] if count == 1 else [first, lo, hi, count]
                      for first, lo, hi, count in sorted(p.runs, key=lambda r: r[1]) if hi > lo]
        for first, lo, hi, count in chunk_runs(chunks):
            if first <= rank < first + count:
                i = rank - first
                writes[rank].append((name, lo + i * (hi - lo), hi + i * (hi - lo)))
        key = json.dumps([p.identity, p.settings], sort_keys=True)
        if key not in groups:
            groups[key] = len(group_list)
            group_list.append({"identity": p.identity, "settings": p.settings})
        params[name] = {"shape": list(p.shape), "group": groups[key], "chunks": chunks}
    model_entries, model_writes = None, [[] for _ in range(size)]
    if model is not None:
        largest_first = sorted(model, key=lambda k: (-math.prod(model[k][0]), k))
        rank_of = {k: least_loaded(math.prod(model[k][0])) for k in largest_first}
        model_entries = {k: {"shape": list(s), "dtype": d, "rank": rank_of[k]} for k, (s, d) in model.items()}
        model_writes[rank] = [k for k, e in model_entries.items() if e["rank"] == rank]
    return SavePlan(params, group_list, model_entries, writes, model_writes)
