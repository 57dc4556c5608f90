"""Name-keyed optimizer state (``Stage.param_shards``): plan who writes what, check a checkpoint against an
optimizer. All but ``collect`` is pure over tables every rank has, so all reach one plan and verdict."""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from optstack.checkpoint.format import dtype_from_name, dtype_name, encode_scalar, identity_of, settings_of
from optstack.groups import group_map as core_group_map
from optstack.protocol import ParamShard
from optstack.stage import Stage
from optstack.tensor_bytes import tensor_bytes

__all__ = ["HeldParam", "SavePlan", "collect", "describe", "fingerprint", "plan_save", "check_load", "part_of",
           "group_map", "restore_group_settings"]

_MAX_NAMED = 8  # names listed in one error line before "and N more"
_MAX_LINES = 20  # lines of differences in one error
ModelTable = Mapping[str, tuple[tuple[int, ...], str]]  # model key -> (shape, dtype name)


@dataclass(frozen=True)
class HeldParam:
    """What one rank holds of one parameter, without the data: the table ranks exchange."""

    name: str
    shape: tuple[int, ...]
    start: int
    end: int
    dtypes: dict[str, str]  # element-wise key -> dtype name
    scalars: dict[str, dict[str, Any]]  # key -> encoded scalar
    identity: dict[str, Any]
    settings: dict[str, Any]
    fingerprint: str = ""  # of the 'param' values: ranks holding one range must hold the same numbers


def collect(stages: Sequence[Stage]) -> list[dict[str, ParamShard]]:
    """Each stage's ``ParamShard``s on this rank, by parameter name; ``ValueError`` if a name is in two."""
    out: list[dict[str, ParamShard]] = []
    seen: dict[str, int] = {}
    for index, stage in enumerate(stages):
        out.append(stage.param_shards())
        for name in out[-1]:
            if seen.setdefault(name, index) != index:
                raise ValueError(f"parameter {name!r} is in stages[{seen[name]}] and stages[{index}]; "
                                 "checkpoints key state by parameter name, so names must be unique")
    return out


def restore_group_settings(shards: Mapping[str, ParamShard], settings: Mapping[str, Mapping[str, Any]]) -> None:
    """Write ``settings[name]``'s ``lr`` and ``weight_decay`` into the live group of each held parameter."""
    for name, shard in shards.items():
        for key in ("lr", "weight_decay"):
            value, live = settings[name].get(key), shard.group
            if key in live and isinstance(value, int | float) and not isinstance(value, bool):
                if isinstance(live[key], torch.Tensor):
                    live[key].fill_(value)
                else:
                    live[key] = value  # type: ignore[index]


def describe(shards: Mapping[str, ParamShard], fingerprints: bool = True) -> dict[str, HeldParam]:
    """The data-free table of ``shards``, after checking each is well formed (``fingerprints``: only a save's
    plan compares them)."""
    out = {}
    groups: dict[tuple[int, str], tuple[dict[str, Any], dict[str, Any]]] = {}  # one identity, settings per group
    for name, s in shards.items():
        numel = math.prod(s.shape)
        if not 0 <= s.start <= s.end <= numel or "param" not in s.tensors:
            raise ValueError(f"the state of {name!r} holds [{s.start}, {s.end}) of {numel} elements with keys "
                             f"{sorted(s.tensors)}; need a range inside the parameter and a 'param'")
        for key, t in s.tensors.items():
            if t.dim() != 1 or t.numel() != s.end - s.start:
                raise ValueError(f"state {key!r} of {name!r} has shape {tuple(t.shape)}; expected 1-D with "
                                 f"{s.end - s.start} elements")
        key = (id(s.group), s.algorithm)
        if key not in groups:
            groups[key] = identity_of(s), settings_of(s.group)
        out[name] = HeldParam(
            name, tuple(s.shape), s.start, s.end, {k: dtype_name(t.dtype) for k, t in s.tensors.items()},
            {k: encode_scalar(f"state {k!r} of {name!r}", v) for k, v in s.scalars.items()},
            *groups[key], fingerprint(s.tensors["param"]) if fingerprints else "")
    return out


def fingerprint(values: torch.Tensor) -> str:
    """CRC-32 of the bits of ~1024 evenly spaced elements: cheap, exact, thread-count independent (unlike a sum)."""
    return f"{zlib.crc32(tensor_bytes(values[:: max(1, values.numel() // 1024)])):08x}"


@dataclass(frozen=True)
class SavePlan:
    """Who writes what, and the manifest's ``params``, ``groups`` and ``model`` entries."""

    params: dict[str, dict[str, Any]]
    groups: list[dict[str, Any]]
    model: dict[str, dict[str, Any]] | None
    writes: list[list[tuple[str, int, int]]]  # per rank: (name, start, end) ranges it writes
    model_writes: list[list[str]]  # per rank: model keys it writes


def plan_save(tables: Sequence[Mapping[str, HeldParam]], model_tables: Sequence[ModelTable] | None) -> SavePlan:
    """Write replicated state and the model once, balance writes by bytes, check the ranges tile each parameter;
    ValueError when ranks disagree (shape, dtypes, group, model) or ranges overlap or leave a gap."""
    first: dict[str, HeldParam] = {}
    holders: dict[tuple[str, int, int], list[int]] = {}
    for rank, table in enumerate(tables):
        for name, held in table.items():
            ref = first.setdefault(name, held)
            for field in ("shape", "dtypes", "identity"):
                if getattr(held, field) != getattr(ref, field):
                    raise ValueError(f"ranks disagree on the {field} of {name!r}: {getattr(ref, field)} and "
                                     f"{getattr(held, field)} (rank {rank})")
            if held.end > held.start or math.prod(held.shape) == 0:  # an empty one: a writer of its state
                ranks = holders.setdefault((name, held.start, held.end), [])
                if ranks and tables[ranks[0]][name].fingerprint != held.fingerprint:
                    raise ValueError(
                        f"ranks {ranks[0]} and {rank} hold different values for elements [{held.start}, "
                        f"{held.end}) of {name!r}; names must be unique across ranks (e.g. experts named by "
                        "their global index when expert-parallel)")
                ranks.append(rank)
    load = [0] * len(tables)  # bytes each rank writes: the next item goes to the least loaded holder
    writes: list[list[tuple[str, int, int]]] = [[] for _ in tables]
    chunks: dict[str, list[list[int]]] = {name: [] for name in first}
    for (name, start, end), ranks in sorted(holders.items(), key=lambda kv: (kv[0][1] - kv[0][2], kv[0])):
        writer = min(ranks, key=lambda r: (load[r], r))
        load[writer] += (end - start) * sum(dtype_from_name(d).itemsize for d in first[name].dtypes.values())
        writes[writer].append((name, start, end))
        chunks[name].append([writer, start, end])
    groups: dict[str, dict[str, Any]] = {}  # by identity and settings, in order of first use
    index: dict[str, int] = {}
    params: dict[str, dict[str, Any]] = {}
    for name, held in first.items():
        ranges, numel = sorted((s, e) for _, s, e in chunks[name]), math.prod(held.shape)
        ends = [0] + [e for _, e in ranges]
        if any(s != ends[i] for i, (s, _) in enumerate(ranges)) or ends[-1] != numel:
            raise ValueError(f"the ranks' ranges of {name!r} ({ranges}) do not tile its {numel} elements "
                             "exactly once")
        key = json.dumps([held.identity, held.settings], sort_keys=True)
        if key not in index:
            index[key] = len(groups)
            groups[key] = {"identity": held.identity, "settings": held.settings}
        # dtypes and scalars: in each writer's part of the manifest (``part_of``)
        params[name] = {"shape": list(held.shape), "group": index[key],
                        "chunks": sorted(chunks[name], key=lambda c: c[1])}
    model, model_writes = None, [[] for _ in tables]  # model tensors are replicated: one writer each
    if model_tables is not None:
        ref = dict(model_tables[0])
        for rank, table in enumerate(model_tables):
            if dict(table) != ref:
                raise ValueError(f"rank {rank}'s model differs from rank 0's: "
                                 f"{sorted(set(table.items()) ^ set(ref.items()))[:_MAX_NAMED]}")
        sizes = {k: math.prod(s) * dtype_from_name(d).itemsize for k, (s, d) in ref.items()}
        rank_of = {}
        for key in sorted(ref, key=lambda k: (-sizes[k], k)):
            rank_of[key] = writer = min(range(len(tables)), key=lambda r: (load[r], r))
            load[writer] += sizes[key]
            model_writes[writer].append(key)
        model = {k: {"shape": list(s), "dtype": d, "rank": rank_of[k]} for k, (s, d) in ref.items()}
    return SavePlan(params, list(groups.values()), model, writes, model_writes)


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_MAX_NAMED])
    return shown + (f" and {len(names) - _MAX_NAMED} more" if len(names) > _MAX_NAMED else "")


def _only(these: Mapping[str, Any], others: Mapping[str, Any], line: str) -> list[str]:
    """``line`` (with ``{n}`` and ``{names}``) about the keys of ``these`` not in ``others``, if any."""
    names = [k for k in these if k not in others]
    return [line.format(n=len(names), names=_names(names))] if names else []


def check_load(manifest: Mapping[str, Any], held: Mapping[str, HeldParam], model: ModelTable | None) -> list[str]:
    """Every difference between a checkpoint and ``held`` (every rank's parameters) and ``model``; empty: a fit."""
    saved = manifest["params"]
    errors = _only(saved, held, "the checkpoint has {n} parameters this optimizer does not: {names}")
    errors += _only(held, saved, "this optimizer has {n} parameters the checkpoint does not: {names}")
    regrouped: dict[str, list[str]] = {}  # one line per kind of group difference, naming the parameters
    for name, h in held.items():
        entry = saved.get(name)
        if entry is None:
            continue
        if tuple(entry["shape"]) != h.shape:
            errors.append(f"parameter {name!r} has shape {tuple(entry['shape'])} in the checkpoint, {h.shape} here")
            continue
        if "dtypes" in entry and "param" in h.dtypes and entry["dtypes"].get("param") != h.dtypes["param"]:
            # (a version-2 manifest; a version-3 one keeps dtypes in its writers' parts: ``load.check_dtypes``)
            errors.append(f"parameter {name!r}: the optimizer's copy ('param') is {entry['dtypes'].get('param')} "
                          f"in the checkpoint, {h.dtypes['param']} here")
        identity = manifest["groups"][entry["group"]]["identity"]
        diff = [f"{k} {identity.get(k)!r} in the checkpoint, {h.identity[k]!r} here"
                for k in h.identity if identity.get(k) != h.identity[k]]
        if diff:
            regrouped.setdefault("; ".join(diff), []).append(name)
    for diff, names in regrouped.items():
        many = len(names) > 1
        errors.append(f"parameter{'s' if many else ''} {_names(names)} {'are' if many else 'is'} in a different "
                      f"group: {diff}")
    if model is not None and (stored := manifest.get("model")) is None:
        errors.append("a model was given but the checkpoint holds no model tensors (save with model=...)")
    elif model is not None:
        errors += _only(stored, model, "the checkpoint has model tensors this model does not: {names}")
        errors += _only(model, stored, "this model has tensors the checkpoint does not: {names}")
        errors += [f"model tensor {key!r} is {tuple(e['shape'])} {e['dtype']} in the checkpoint, {shape} {dtype} here"
                   for key, (shape, dtype) in model.items()
                   if (e := stored.get(key)) is not None and (tuple(e["shape"]), e["dtype"]) != (shape, dtype)]
    if len(errors) > _MAX_LINES:
        errors = errors[:_MAX_LINES] + [f"... and {len(errors) - _MAX_LINES} more differences"]
    return errors


def part_of(writes: Sequence[tuple[str, int, int]], held: Mapping[str, HeldParam],
            packs: list[Any]) -> dict[str, Any]:
    """One writing rank's part of the manifest (``format.py``): the dtypes and scalars of each parameter it
    writes (of its own state: no other rank's table is needed), and its packs."""
    return {"params": {name: {"dtypes": held[name].dtypes, "scalars": held[name].scalars} for name, _, _ in writes},
            "packs": packs}


def group_map(params: Mapping[str, Mapping[str, Any]], groups: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``groups.group_map`` of a manifest's ``params`` and ``groups``, each group also showing its identity."""
    members: list[list[str]] = [[] for _ in groups]
    for name, entry in params.items():
        members[entry["group"]].append(name)
    core = core_group_map([{**g["settings"], "param_names": members[i]} for i, g in enumerate(groups)])
    return {
        "groups": [{"index": e["index"], **g["identity"], "settings": g["settings"], "params": e["params"]}
                   for e, g in zip(core["groups"], groups, strict=True)],
        "param_to_group": {name: core["param_to_group"][name] for name in params},
    }
