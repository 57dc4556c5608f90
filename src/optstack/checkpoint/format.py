"""The checkpoint format: its version, the manifest's shape and seal, and the one ``migrate()``.

``step_00000100/`` holds ``manifest.json``, ``group_map.json`` (for people; never read back) and one
torch.distributed.checkpoint directory ``rank_00000/`` ... per rank that wrote something, with that rank's part
of the manifest, ``state.json``. The manifest (version 3) is keyed by parameter name, never by buffer offset or
group position, and holds only what every rank computes alike from the plan (``manifest.py``), so no rank needs
another's tables to write it::

    format, version, step, world_size, checksum_algorithm, job
    params:    {name: {shape, group: index, chunks: [[rank, start, end] or [rank, start, end, count], ...]}}
               a chunk of ``count`` ranks: ranks rank .. rank + count - 1 wrote end - start elements each, the i-th
               from start + i * (end - start) (ZeRO-1's ranges of one parameter in a few entries at any world size)
    groups:    [{identity: {algorithm, is_expert_parallel, max_lr, min_lr, wd_mult, lr_mult}, settings: {lr, ...}}]
    scaler, scheduler (or null), model: {key: {shape, dtype, rank}} (or null)
    files:     {relative path: {bytes, crc32, sha256 (only when signed)}}: every rank's files, its part included
    hmac_sha256 (only when saved with a key): HMAC-SHA256 of the canonical JSON of everything above (``digest.py``)
    seal:      CRC-32 of the canonical JSON of everything above

    rank_<r>/state.json (sealed the same way; its checksums are in the manifest's files):
    params:    {name: {dtypes: {key: dtype}, scalars: {key: Scalar}}}: of each parameter rank r wrote, its state
    packs:     [[dtype, [[DCP key, start, numel], ...]], ...]: small chunks packed as DCP key pack/<i> (pack.py)

Version 2 kept ``dtypes`` and ``scalars`` in ``params`` and every rank's ``packs`` in the manifest (each rank's
table gathered to every rank); it loads as it is: ``migrate`` marks it ``inline``.

DCP keys: ``optim/<name>/<key>`` (1-D, the parameter's numel, each rank's chunk at its offset), ``model/<key>``.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from optstack.protocol import ParamShard

__all__ = ["FORMAT", "VERSION", "MANIFEST", "PART", "check_part", "GROUP_MAP", "migrate", "seal", "unseal",
           "dtype_name", "dtype_from_name", "json_lines", "encode_scalar", "decode_scalar", "identity_of",
           "group_identity", "settings_of",
           "optim_key", "model_key", "canonical", "check_manifest", "is_count"]

FORMAT = "optstack.checkpoint"
VERSION = 3
MANIFEST = "manifest.json"
PART = "state.json"  # a writing rank's part of the manifest, in its directory
GROUP_MAP = "group_map.json"
#: The group settings that identify a parameter's group across layouts (with the algorithm and expert flag).
IDENTITY_KEYS = ("max_lr", "min_lr", "wd_mult", "lr_mult")
_DTYPES = {n: getattr(torch, n) for n in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16",
                                         "int8", "uint8", "bool", "complex64", "complex128")}
optim_key = "optim/{}/{}".format  # (parameter name, state key) -> the DCP key of element-wise state
model_key = "model/{}".format  # model state-dict key -> its DCP key


_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    if (name := _NAMES.get(dtype)) is None:
        raise ValueError(f"checkpoints store tensors of dtypes {sorted(_DTYPES)}; got {dtype}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r} in the checkpoint; known: {sorted(_DTYPES)}")
    return _DTYPES[name]


def encode_scalar(where: str, value: Any) -> dict[str, Any]:
    """A JSON form of non-element-wise state (a number or 0-d tensor) that decodes to the same type and bits."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(
                f"{where} is a tensor of shape {tuple(value.shape)} that is neither element-wise (the "
                "parameter's shape) nor a scalar; name-keyed checkpoints cannot reshard it")
        return {"tensor": dtype_name(value.dtype), "value": value.item()}
    if isinstance(value, bool | int | float) or value is None:
        return {"value": value}
    raise ValueError(f"{where} is a {type(value).__name__}; checkpoints store numbers and 0-d tensors")


def decode_scalar(encoded: Mapping[str, Any]) -> Any:
    if "tensor" in encoded:
        return torch.tensor(encoded["value"], dtype=dtype_from_name(encoded["tensor"]))
    return encoded["value"]


def _plain(value: Any) -> Any:
    """A JSON value for a group setting: numbers, strings, lists; anything else as its repr."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, bool | int | str) or value is None:
        return value
    return [_plain(v) for v in value] if isinstance(value, list | tuple) else repr(value)


def identity_of(shard: ParamShard) -> dict[str, Any]:
    """What identifies ``shard``'s group in any layout: algorithm, expert flag, ``IDENTITY_KEYS`` (float or None)."""
    return group_identity(shard.group, shard.algorithm)


def group_identity(group: Mapping[str, Any], algorithm: str) -> dict[str, Any]:
    """``identity_of`` a parameter of ``group`` stepped by ``algorithm``."""
    out: dict[str, Any] = {"algorithm": algorithm,
                           "is_expert_parallel": bool(group.get("is_expert_parallel", False))}
    for key in IDENTITY_KEYS:
        value = group.get(key)
        out[key] = None if value is None else float(value.item() if isinstance(value, torch.Tensor) else value)
    return out


def settings_of(group: Mapping[str, Any]) -> dict[str, Any]:
    """Every setting of a group but its parameters, as JSON values (a load restores ``lr``, ``weight_decay``)."""
    return {k: _plain(v) for k, v in group.items() if k not in ("params", "param_names")}


def canonical(body: Mapping[str, Any]) -> bytes:
    """The one byte form of a manifest's ``body`` that its seal and signature cover."""
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _crc(body: Mapping[str, Any]) -> str:
    return f"{zlib.crc32(canonical(body)):08x}"


def seal(manifest: Mapping[str, Any]) -> str:
    """The manifest as JSON with a ``seal``, the CRC-32 of its canonical form (finds damage to the manifest)."""
    body = {k: v for k, v in manifest.items() if k != "seal"}
    return json_lines({**body, "seal": _crc(body)}, sort_keys=True)


def json_lines(value: Any, depth: int = 2, sort_keys: bool = False) -> str:
    """JSON with each entry of a dict, and of the dicts in it (to ``depth``), on a line of its own: readable, and
    linear in time (json's ``indent`` takes its pure-Python encoder: seconds for 50,000 parameters)."""
    if depth == 0 or not isinstance(value, dict) or not value:
        return json.dumps(value, sort_keys=sort_keys)
    items = sorted(value.items()) if sort_keys else value.items()
    return "{\n" + ",\n".join(f"{json.dumps(k)}: {json_lines(v, depth - 1, sort_keys)}" for k, v in items) + "\n}"


MAX_INT_DIGITS = 30  # an int in a manifest is a count, a size or a step: 30 digits is beyond any of them


class _LongInt(Exception):
    pass


def _parse_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:  # before int(): Python's own limit is 4,300 digits
        raise _LongInt(digits)
    return int(digits)


def _place(text: str, at: int) -> str:
    """'line L column C (after key K)' of position ``at`` in ``text``: where a refused value is."""
    line = text.count("\n", 0, at) + 1
    column = at - (text.rfind("\n", 0, at) + 1) + 1
    keys = re.findall(r'"([^"\\]{1,80})"\s*:', text[max(0, at - 400) : at])
    return f"line {line} column {column}" + (f" (after key {keys[-1]!r})" if keys else "")


def _too_deep(text: str, limit: int) -> int:
    """The position where ``text``'s containers first nest deeper than ``limit`` (only on the error path)."""
    depth = 0
    for match in re.finditer(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > limit:
                return match.start()
        elif token in "]}":
            depth -= 1
    return 0


def unseal(text: str, where: str) -> dict[str, Any]:
    """Parse and check a sealed manifest; ``ValueError`` naming ``where`` (and the place in it) when it is not
    intact: not JSON, an int of more than ``MAX_INT_DIGITS`` digits, nesting too deep for the parser."""
    try:
        body = json.loads(text, parse_int=_parse_int)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON ({exc}); the checkpoint is corrupted or truncated") from exc
    except _LongInt as exc:
        digits = exc.args[0]
        raise ValueError(f"{where}: an integer of {len(digits)} digits at {_place(text, text.find(digits))}; a "
                         f"manifest holds ints of at most {MAX_INT_DIGITS} digits: it was altered") from None
    except RecursionError:
        raise ValueError(f"{where}: containers nested too deep to parse, from {_place(text, _too_deep(text, 100))}; "
                         "a manifest nests a few levels: it was altered") from None
    if not isinstance(body, dict) or "seal" not in body:
        raise ValueError(f"{where} has no seal; it is not an optstack checkpoint manifest")
    stored, actual = body.pop("seal"), _crc(body)
    if stored != actual:
        raise ValueError(f"{where} fails its checksum (stored {stored}, computed {actual}); the manifest is "
                         "corrupted")
    return body


# One function per old version, each lifting a manifest by one version. Version 1 is the first.
_UPGRADES: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {
    1: lambda manifest: {**manifest, "packs": {}},  # version 2 packs small chunks
    # version 3 moves dtypes, scalars and packs into the writers' parts; a version-2 manifest keeps them, and
    # a load reads them from it (``load.Saved``)
    2: lambda manifest: {**manifest, "inline": True},
}


def migrate(manifest: dict[str, Any]) -> dict[str, Any]:
    """Bring a manifest of any supported version to the current one (``VERSION``).

    Raises:
        ValueError: not an optstack checkpoint, newer than this optstack reads, or with no upgrade path.
    """
    if manifest.get("format") != FORMAT:
        raise ValueError(f"not an optstack checkpoint: format {manifest.get('format')!r}, expected {FORMAT!r}")
    version = manifest.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"checkpoint version must be an int >= 1, got {version!r}")
    if version > VERSION:
        raise ValueError(f"checkpoint version {version} was written by a newer optstack; this one reads up to "
                         f"version {VERSION}: upgrade optstack")
    while version < VERSION:
        if version not in _UPGRADES:
            raise ValueError(f"no upgrade from checkpoint version {version} to {version + 1}")
        manifest = _UPGRADES[version](manifest)
        version = manifest["version"] = version + 1
    return manifest


def is_count(value: Any) -> bool:
    """An int >= 0 (not a bool): what a file's sizes, offsets and ranks must be."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _need(ok: bool, where: str, field: str, value: Any, expected: str) -> None:
    if not ok:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise ValueError(f"{where}: {field} is {shown} ({type(value).__name__}), expected {expected}; the manifest "
                         "was altered or written by something other than optstack")


def _shape(where: str, field: str, value: Any) -> int:
    _need(isinstance(value, list) and all(is_count(d) for d in value), where, field, value, "a list of ints >= 0")
    return math.prod(value)


def _dtype(where: str, field: str, value: Any) -> None:
    _need(isinstance(value, str) and value in _DTYPES, where, field, value, f"one of {sorted(_DTYPES)}")


def check_manifest(manifest: Mapping[str, Any], where: str) -> None:
    """Check every field a load reads has the type and range the format gives it (after ``migrate``).

    JSON holds only data, but a load trusts the shapes of what it reads (an index, a range, a dtype name):
    anything else is a ``ValueError`` naming ``where`` and the field, before any of it is used.
    """
    world = manifest.get("world_size")
    _need(is_count(world) and world >= 1, where, "world_size", world, "an int >= 1")
    step = manifest.get("step")
    _need(step is None or is_count(step), where, "step", step, "an int >= 0 or null")
    groups = manifest.get("groups")
    _need(isinstance(groups, list), where, "groups", groups, "a list")
    for i, group in enumerate(groups):
        _need(isinstance(group, dict) and isinstance(group.get("identity"), dict)
              and isinstance(group.get("settings"), dict), where, f"groups[{i}]", group,
              "a dict with 'identity' and 'settings' dicts")
        _check_group(where, f"groups[{i}]", group)
    params = manifest.get("params")
    _need(isinstance(params, dict), where, "params", params, "a dict")
    for name, entry in params.items():
        at = f"params[{name!r}]"
        _need(isinstance(entry, dict), where, at, entry, "a dict")
        numel = _shape(where, f"{at}.shape", entry.get("shape"))
        if manifest.get("inline"):
            _check_state(where, at, entry)
        group = entry.get("group")
        _need(is_count(group) and group < len(groups), where, f"{at}.group", group, f"an index < {len(groups)}")
        chunks = entry.get("chunks")
        _need(isinstance(chunks, list), where, f"{at}.chunks", chunks, "a list")
        for chunk in chunks:
            ok = isinstance(chunk, list) and len(chunk) in (3, 4) and all(is_count(c) for c in chunk)
            ok = ok and (len(chunk) == 3 or chunk[3] >= 1)
            count = chunk[3] if ok and len(chunk) == 4 else 1
            _need(ok and chunk[0] + count <= world and chunk[1] <= chunk[2]
                  and chunk[2] + (count - 1) * (chunk[2] - chunk[1]) <= numel, where, f"a chunk of {at}", chunk,
                  f"[rank, start, end] or [rank, start, end, count] with rank + count <= {world} and its ranges "
                  f"inside [0, {numel}]")
    model = manifest.get("model")
    _need(model is None or isinstance(model, dict), where, "model", model, "a dict or null")
    for key, entry in (model or {}).items():
        at = f"model[{key!r}]"
        _need(isinstance(entry, dict), where, at, entry, "a dict")
        _shape(where, f"{at}.shape", entry.get("shape"))
        _dtype(where, f"{at}.dtype", entry.get("dtype"))
        rank = entry.get("rank")
        _need(is_count(rank) and rank < world, where, f"{at}.rank", rank, f"a rank < {world}")
    _need(isinstance(manifest.get("scaler"), dict), where, "scaler", manifest.get("scaler"), "a dict")
    scheduler = manifest.get("scheduler")
    _need(scheduler is None or isinstance(scheduler, dict), where, "scheduler", scheduler, "a dict or null")
    files = manifest.get("files")
    _need(isinstance(files, dict), where, "files", files, "a dict")
    for name, entry in files.items():
        parts = name.split("/")
        # A file inside the checkpoint: '<rank directory>/<file>', never absolute or '..'.
        _need(len(parts) == 2 and all(p and p not in (".", "..") and "\\" not in p for p in parts), where,
              "a file name", name, "'<rank directory>/<file>'")
        _need(isinstance(entry, dict) and is_count(entry.get("bytes")) and _hex(entry.get("crc32"), 8)
              and ("sha256" not in entry or _hex(entry["sha256"], 64)), where, f"files[{name!r}]", entry,
              "{'bytes': int, 'crc32': 8 hex digits} (and 'sha256': 64)")


def _check_state(where: str, at: str, entry: Mapping[str, Any]) -> None:
    """A parameter's ``dtypes`` and ``scalars`` (a part's entry, or a version-2 manifest's) have the format's
    types, and its scalars finite values (a step >= 0)."""
    dtypes = entry.get("dtypes")
    _need(isinstance(dtypes, dict), where, f"{at}.dtypes", dtypes, "a dict")
    for key, dtype in dtypes.items():
        _dtype(where, f"{at}.dtypes[{key!r}]", dtype)
    scalars = entry.get("scalars")
    _need(isinstance(scalars, dict), where, f"{at}.scalars", scalars, "a dict")
    for key, scalar in scalars.items():
        ok = isinstance(scalar, dict) and set(scalar) in ({"value"}, {"tensor", "value"})
        value = scalar.get("value") if ok else None
        ok = ok and (value is None or isinstance(value, bool | int | float))
        _need(ok, where, f"{at}.scalars[{key!r}]", scalar, "{'value': a number, bool or null} (and 'tensor')")
        if "tensor" in scalar:
            _dtype(where, f"{at}.scalars[{key!r}].tensor", scalar["tensor"])
        # Optimizer scalars are steps and counters: a NaN or negative one makes the next update non-finite.
        _need(value is None or math.isfinite(value) and (key != "step" or value >= 0), where,
              f"{at}.scalars[{key!r}]", value, "a finite number" + (" >= 0" if key == "step" else ""))


def check_part(part: Any, where: str) -> None:
    """A rank's part of the manifest (``PART``) has the format's types and values (``ValueError`` naming
    ``where`` and the field); its ``packs`` are ``pack.check_packs``'s to check."""
    _need(isinstance(part, dict) and isinstance(part.get("params"), dict) and isinstance(part.get("packs"), list),
          where, "the part", type(part).__name__, "a dict with 'params' (a dict) and 'packs' (a list)")
    for name, entry in part["params"].items():
        _need(isinstance(entry, dict), where, f"params[{name!r}]", entry, "a dict")
        _check_state(where, f"params[{name!r}]", entry)


#: Group settings a load restores or steps with, and the range ``OptimizerConfig`` allows them.
_SETTING_RANGES: dict[str, tuple[float, float]] = {
    "lr": (0.0, math.inf), "weight_decay": (0.0, math.inf), "max_lr": (0.0, math.inf), "min_lr": (0.0, math.inf),
    "lr_mult": (0.0, math.inf), "wd_mult": (0.0, math.inf), "eps": (0.0, math.inf), "momentum": (0.0, 1.0),
    "betas": (0.0, 1.0),
}


def _numbers(value: Any) -> list[Any]:
    """The numbers in a setting (itself, or a list's members); non-numbers are left to their users."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]


def _check_group(where: str, at: str, group: Mapping[str, Any]) -> None:
    """Every number of a group's identity and settings is finite (a checkpoint writes a non-finite setting as
    its repr string), and those in ``_SETTING_RANGES`` lie in their range: an infinite weight decay or a
    negative learning rate would make the next step non-finite or wrong while reporting success."""
    for part in ("identity", "settings"):
        for key, value in group[part].items():
            lo, hi = _SETTING_RANGES.get(key, (-math.inf, math.inf))
            for number in _numbers(value):
                _need(math.isfinite(number) and lo <= number <= hi, where, f"{at}.{part}[{key!r}]", value,
                      f"finite numbers in [{lo:g}, {hi:g}]")


def _hex(value: Any, digits: int) -> bool:
    return isinstance(value, str) and len(value) == digits and all(c in "0123456789abcdef" for c in value)
