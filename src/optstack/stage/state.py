"""The one state format: a stage's optimizer state as name-keyed parameter shards, and back.

Per parameter a rank steps, a ``ParamShard``: elements ``[start, end)`` of the flattened parameter, with
``"param"`` (the stepped tensor: the fp32 master, or the parameter itself) and each element-wise state
tensor flat, the rest (``step``) as scalars. ``Stage.state_dict()`` is the same as plain containers (for
``torch.save`` / ``weights_only`` loads); checkpoints and any DCP adapter serialise these.

``migrate`` reads the tagged per-stage formats of optstack 0.1 (``{"kind": "fp32" | "mixed" | "sharded" |
"layerwise", ...}``) into this one.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from optstack.protocol import ParamShard, algorithm_name
from optstack.stage.placement import Piece

__all__ = ["exported_state", "from_plain", "load_into", "migrate", "settings_of", "shards_of", "to_plain"]


def _inner_params(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    return [(p, group) for group in optimizer.param_groups for p in group["params"]]


def exported_state(optimizer: torch.optim.Optimizer, tensor: torch.Tensor) -> dict[str, Any]:
    """``optimizer.state[tensor]`` in its portable form: ``optimizer.exported_state(tensor)`` where the
    algorithm keeps state in a form of its own (AdamW's 8-bit moments, given as fp32), else the live state."""
    export = getattr(optimizer, "exported_state", None)
    return export(tensor) if export is not None else optimizer.state.get(tensor, {})


def shards_of(optimizer: torch.optim.Optimizer, pieces: Sequence[Piece],
              groups: Sequence[Mapping[str, Any]]) -> dict[str, ParamShard]:
    """``optimizer``'s state as ``ParamShard``s by name; ``pieces[i]`` is its i-th parameter in group order.
    Tensors are flat views of the live ones; ``group`` is the live model-side group dict (``groups[i]`` for
    the optimizer's group i)."""
    algorithm = algorithm_name(optimizer)
    outer = {id(inner): groups[i] for i, inner in enumerate(optimizer.param_groups)}
    out = {}
    for piece, (inner, inner_group) in zip(pieces, _inner_params(optimizer), strict=True):
        group = outer[id(inner_group)]
        tensors: dict[str, torch.Tensor] = {"param": inner.detach().reshape(-1)}
        scalars: dict[str, Any] = {}
        for key, value in exported_state(optimizer, inner).items():
            if isinstance(value, torch.Tensor) and value.shape == inner.shape:
                tensors[key] = value.reshape(-1)
            else:
                scalars[key] = value
        out[piece.name] = ParamShard(tuple(piece.param.shape), piece.start, piece.end, tensors, scalars, group,
                                     algorithm)
    return out


def load_into(owner: str, optimizer: torch.optim.Optimizer, pieces: Sequence[Piece],
              shards: Mapping[str, ParamShard], *, apply: bool = True) -> None:
    """Load ``shards`` into ``optimizer`` (described by ``pieces``, as for ``shards_of``): each piece's
    range is cut out of its parameter's shard, ``"param"`` copied into the stepped tensor, the rest made the
    optimizer's state (replacing it). Names not held are ignored. ``apply=False`` only checks.

    Raises:
        ValueError: naming ``owner`` and the parameter, when a piece has no shard (or no ``"param"``), a
            shape differs, a shard does not cover the piece's range, or a tensor's size does not match its
            range. Everything is checked before anything changes.
    """
    per_param: dict[int, dict[str, Any]] = {}
    values: list[tuple[torch.Tensor, torch.Tensor]] = []
    for index, (piece, (inner, _)) in enumerate(zip(pieces, _inner_params(optimizer), strict=True)):
        shard = shards.get(piece.name)
        shape = tuple(piece.param.shape)
        if shard is None or "param" not in shard.tensors:
            held = {p.name for p in pieces}
            unknown = [n for n in shards if n not in held][:8]
            raise ValueError(f"{owner}: no state for parameter {piece.name!r} (needs at least its 'param')"
                             + (f"; the state has parameters this rank does not step: {unknown}" if unknown else "")
                             + "; is it from another model, grouping or rank?")
        if tuple(shard.shape) != shape or not shard.start <= piece.start <= piece.end <= shard.end:
            raise ValueError(
                f"{owner}: the state of {piece.name!r} covers elements [{shard.start}, {shard.end}) of shape "
                f"{tuple(shard.shape)}; this rank needs [{piece.start}, {piece.end}) of shape {shape} (load "
                "another data-parallel size or layout through a checkpoint)")
        lo = piece.start - shard.start
        loaded = {}
        for key, tensor in shard.tensors.items():
            if not isinstance(tensor, torch.Tensor) or tensor.numel() != shard.end - shard.start:
                got = tensor.numel() if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(f"{owner}: {key!r} of {piece.name!r} has {got} elements for the range "
                                 f"[{shard.start}, {shard.end})")
            if key == "param" and not tensor.is_floating_point():
                raise ValueError(f"{owner}: 'param' of {piece.name!r} is {tensor.dtype}, not floating point")
            current = optimizer.state.get(inner, {}).get(key)
            if isinstance(current, torch.Tensor) and current.dtype.is_floating_point != tensor.is_floating_point():
                raise ValueError(f"{owner}: {key!r} of {piece.name!r} is {tensor.dtype}, here {current.dtype}")
            if apply:
                part = (tensor.reshape(inner.shape) if lo == 0 and tensor.numel() == inner.numel()
                        else tensor.reshape(-1)[lo : lo + piece.end - piece.start].view(inner.shape))
                loaded[key] = part.to(inner.device, copy=True)
        if not apply:
            continue
        values.append((inner, loaded.pop("param")))
        loaded.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in shard.scalars.items()})
        if loaded:
            per_param[index] = loaded
    if not apply:
        return
    _load_state(optimizer, per_param)
    with torch.no_grad():
        for inner, value in values:
            inner.copy_(value)


def _load_state(optimizer: torch.optim.Optimizer, state: dict[int, dict[str, Any]]) -> None:
    """``optimizer.load_state_dict`` of ``state`` (by position in group order) with the optimizer's own groups.

    torch's load scans the groups' parameter lists for every state value (minutes for 50,000 parameters), so
    where the class keeps torch's ``load_state_dict`` and no load hooks are registered, the state is set here
    with torch's per-value rules (floating tensors in the param's dtype, every tensor on its device, ``step``
    kept unless the group is fused or capturable) and its ``__setstate__``; the groups stay the live ones.
    """
    own_load = type(optimizer).load_state_dict is not torch.optim.Optimizer.load_state_dict
    if (own_load or getattr(optimizer, "_optimizer_load_state_dict_pre_hooks", None)
            or getattr(optimizer, "_optimizer_load_state_dict_post_hooks", None)):
        saved = optimizer.state_dict()
        saved["state"] = state
        optimizer.load_state_dict(saved)
        return
    params = _inner_params(optimizer)
    loaded: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
    for index, values in state.items():
        param, group = params[index]
        # torch's rule for one value, asked of a one-parameter group so that it looks at this group only
        policy = [{"params": [index], "fused": group.get("fused", False), "capturable": group.get("capturable", False)}]
        loaded[param] = {key: _cast(param, index, policy, value, key) for key, value in values.items()}
    optimizer.__setstate__({"state": loaded, "param_groups": optimizer.param_groups})


def _cast(param: torch.Tensor, index: int, policy: list[dict[str, Any]], value: Any, key: Any = None) -> Any:
    """torch's load cast of one state value (a copy of containers, tensors by torch's rule for ``key``)."""
    if isinstance(value, torch.Tensor):
        return torch.optim.Optimizer._process_value_according_to_param_policy(param, value, index, policy, key)
    if isinstance(value, dict):
        return {k: _cast(param, index, policy, v, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(param, index, policy, v) for v in value)
    return value


def settings_of(group: Mapping[str, Any]) -> dict[str, Any]:
    """A group's settings: every key but ``params`` and ``param_names``."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def to_plain(shards: Mapping[str, ParamShard], groups: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``{"params": {name: {shape, start, end, tensors, scalars, group}}, "groups": [settings]}``: plain
    containers (tensors are references; ``torch.save`` or deep-copy to snapshot)."""
    index = {id(g): i for i, g in enumerate(groups)}
    params = {name: {"shape": list(s.shape), "start": s.start, "end": s.end, "tensors": dict(s.tensors),
                     "scalars": dict(s.scalars), "group": index[id(s.group)]} for name, s in shards.items()}
    return {"params": params, "groups": [settings_of(g) for g in groups]}


def from_plain(owner: str, state: Any, groups: Sequence[Mapping[str, Any]]) -> dict[str, ParamShard]:
    """The ``ParamShard``s of a ``to_plain`` dict, after checking its form (``ValueError`` naming what)."""
    if not isinstance(state, dict) or not isinstance(state.get("params"), dict):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{owner}: a state dict needs 'params' (name -> shard) and 'groups'; got {got}. "
                         "State dicts of optstack 0.1 load through optstack.stage.state.migrate()")
    saved_groups = state.get("groups")
    if not isinstance(saved_groups, list) or len(saved_groups) != len(groups):
        got = len(saved_groups) if isinstance(saved_groups, list) else type(saved_groups).__name__
        raise ValueError(f"{owner}: the state dict has {got} param groups, this stage has {len(groups)}")
    out = {}
    for name, entry in state["params"].items():
        try:
            group = groups[entry["group"]]
            out[name] = ParamShard(tuple(entry["shape"]), int(entry["start"]), int(entry["end"]),
                                   dict(entry["tensors"]), dict(entry.get("scalars", {})), group)
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise ValueError(f"{owner}: the state of {name!r} is malformed ({exc!r}); it needs shape, start, "
                             "end, tensors, scalars and group") from exc
    return out


def migrate(old: Mapping[str, Any], pieces: Sequence[Piece], stepped: Sequence[torch.Tensor],
            masters: Sequence[bool]) -> dict[str, Any]:
    """A tagged 0.1 stage state dict in this format, for a stage whose pieces and stepped tensors (inner
    order) are ``pieces`` / ``stepped``, ``masters[i]`` saying whether piece i has an fp32 master. The 0.1
    formats held no values for directly stepped tensors (they were the model's): those keep their values."""
    kind = old.get("kind")
    if kind == "layerwise":
        old = old["inner"]
    elif kind not in ("fp32", "mixed", "sharded"):
        raise ValueError(f"unknown 0.1 stage state kind {kind!r}; expected fp32, mixed, sharded or layerwise")
    inner = old.get("optimizer")
    if not isinstance(inner, dict) or not {"state", "param_groups"} <= inner.keys():
        raise ValueError(f"the 0.1 {kind!r} state dict has no 'optimizer' with 'state' and 'param_groups'")
    saved_masters = iter(m for group in old.get("fp32_masters", []) for m in group)
    ids = [pid for group in inner["param_groups"] for pid in group["params"]]
    if len(ids) != len(pieces):
        raise ValueError(f"the 0.1 state dict holds {len(ids)} parameters, this stage {len(pieces)}")
    params: dict[str, Any] = {}
    group_of = [i for i, group in enumerate(inner["param_groups"]) for _ in group["params"]]
    for pid, piece, tensor, has_master, gi in zip(ids, pieces, stepped, masters, group_of, strict=True):
        tensors, scalars = {}, {}
        for key, value in inner["state"].get(pid, {}).items():
            if isinstance(value, torch.Tensor) and value.numel() == piece.end - piece.start and value.dim() > 0:
                tensors[key] = value.reshape(-1)
            else:
                scalars[key] = value
        tensors["param"] = (next(saved_masters) if has_master else tensor.detach().clone()).reshape(-1)
        params[piece.name] = {"shape": list(piece.param.shape), "start": piece.start, "end": piece.end,
                              "tensors": tensors, "scalars": scalars, "group": gi}
    return {"params": params, "groups": [settings_of(g) for g in inner["param_groups"]]}
