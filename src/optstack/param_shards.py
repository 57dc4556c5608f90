"""A stage's inner optimizer as name-keyed ``ParamShard``s and back: the save and load loops every stage's
``param_shards`` / ``load_param_shards`` share (FP32, mixed precision, ZeRO-1, layer-wise).

Each stage holds, per model parameter it steps, one *inner* tensor (what its inner optimizer steps: the
parameter itself, its fp32 master, or a flat ZeRO-1 piece of it) covering elements ``[start, end)`` of the
flattened parameter: all of it, or this rank's range. The stage describes its inner tensors with ``Held``
entries, in the inner optimizer's parameter order; the loops here do the rest. A saved shard loads when it
covers the range held (the checkpoint cuts ranges to fit; a whole parameter always covers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from optstack.protocol import ParamShard, algorithm_name

__all__ = ["Held", "load_into", "shards_of"]


class Held(NamedTuple):
    """What an inner tensor covers: elements ``[start, end)`` of the flattened parameter ``name`` of
    ``shape``."""

    name: str
    shape: tuple[int, ...]
    start: int
    end: int


def _inner_params(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    """(inner tensor, its group) in group order."""
    return [(p, group) for group in optimizer.param_groups for p in group["params"]]


def shards_of(optimizer: torch.optim.Optimizer, held: Sequence[Held]) -> dict[str, ParamShard]:
    """``optimizer``'s state as ``ParamShard``s by parameter name; ``held[i]`` describes its i-th parameter
    in group order.

    ``"param"`` is the inner tensor, then each state tensor shaped like it, as flat views (references);
    any other state (``step``, factored statistics) goes to ``scalars`` as it is. ``group`` is the live
    group dict, ``algorithm`` is ``algorithm_name(optimizer)``.
    """
    algorithm = algorithm_name(optimizer)
    out = {}
    for h, (inner, group) in zip(held, _inner_params(optimizer), strict=True):
        tensors: dict[str, torch.Tensor] = {"param": inner.detach().reshape(-1)}
        scalars: dict[str, Any] = {}
        for key, value in optimizer.state.get(inner, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == inner.shape:
                tensors[key] = value.reshape(-1)
            else:
                scalars[key] = value
        out[h.name] = ParamShard(h.shape, h.start, h.end, tensors, scalars, group, algorithm)
    return out


def load_into(owner: str, optimizer: torch.optim.Optimizer, held: Sequence[Held],
              shards: Mapping[str, ParamShard]) -> None:
    """Load ``shards`` into ``optimizer`` (described by ``held``, as for ``shards_of``): each inner tensor's
    range is cut out of its parameter's shard and copied, ``"param"`` into the inner tensor itself, the rest
    as the optimizer's state (replacing it; created when there was none). Names not held are ignored.

    Raises:
        ValueError: naming ``owner`` and the parameter, when a held parameter has no shard (or no
            ``"param"``), a shard's shape differs, it does not cover the range held, or a tensor's size does
            not match its range. Everything is checked before anything changes.
    """
    per_param: dict[int, dict[str, Any]] = {}
    values: list[tuple[torch.Tensor, torch.Tensor]] = []
    for index, (h, (inner, _)) in enumerate(zip(held, _inner_params(optimizer), strict=True)):
        shard = shards.get(h.name)
        if shard is None or "param" not in shard.tensors:
            raise ValueError(f"{owner}: no state for parameter {h.name!r} (needs at least its 'param')")
        if tuple(shard.shape) != tuple(h.shape) or not shard.start <= h.start <= h.end <= shard.end:
            raise ValueError(
                f"{owner}: the state of {h.name!r} covers elements [{shard.start}, {shard.end}) of shape "
                f"{tuple(shard.shape)}; this rank needs [{h.start}, {h.end}) of shape {tuple(h.shape)}")
        lo = h.start - shard.start
        loaded = {}
        for key, tensor in shard.tensors.items():
            if tensor.numel() != shard.end - shard.start:
                raise ValueError(f"{owner}: {key!r} of {h.name!r} has {tensor.numel()} elements for the range "
                                 f"[{shard.start}, {shard.end})")
            part = tensor.reshape(-1)[lo : lo + h.end - h.start].view(inner.shape)
            loaded[key] = part.to(inner.device, copy=True)
        values.append((inner, loaded.pop("param")))
        loaded.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in shard.scalars.items()})
        if loaded:
            per_param[index] = loaded
    saved = optimizer.state_dict()
    saved["state"] = per_param
    optimizer.load_state_dict(saved)
    with torch.no_grad():
        for inner, value in values:
            inner.copy_(value)
