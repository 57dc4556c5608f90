"""Checks of a precision stage's rank-local ``state_dict`` against the stage, before anything is loaded.

``FP32Stage`` / ``MixedPrecisionStage`` (``stages.py``) load all or nothing: ``validate_state_dict`` runs
these checks, each raising a ``ValueError`` that names what differs (group counts and sizes, parameter
names, state shapes, fp32 masters), and only then does the load change anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["check_masters", "check_optimizer_state"]


def check_optimizer_state(
    owner: str,
    kind: str,
    state_dict: Any,
    optimizer: torch.optim.Optimizer,
    inner_params: Sequence[torch.Tensor],
    names: Sequence[str],
) -> None:
    """Raise ``ValueError`` unless ``state_dict`` is ``{"kind": kind, "optimizer": a state dict of
    ``optimizer``'s shape}``: the same group count and sizes, the same parameter names where both have
    them, and state tensors shaped like the state held (or like the parameter) for known parameters.

    Args:
        owner: the stage's name, for errors.
        kind: the stage's ``kind``.
        optimizer: the stage's inner optimizer.
        inner_params: its parameters in group order; ``names`` are their model names.
    """
    if not isinstance(state_dict, dict) or state_dict.get("kind") != kind:
        got = state_dict.get("kind") if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(f"{owner}: state dict is for a {got!r} stage, this stage is {kind!r}")
    saved = state_dict.get("optimizer")
    if not isinstance(saved, dict) or not {"state", "param_groups"} <= saved.keys():
        raise ValueError(f"{owner}: state dict needs an 'optimizer' entry with 'state' and 'param_groups'")
    ours = optimizer.param_groups
    if len(saved["param_groups"]) != len(ours):
        raise ValueError(
            f"{owner}: state dict has {len(saved['param_groups'])} param groups, this stage has {len(ours)}"
        )
    id_map: dict[Any, tuple[torch.Tensor, str]] = {}
    position = 0
    for index, (theirs, mine) in enumerate(zip(saved["param_groups"], ours, strict=True)):
        if len(theirs["params"]) != len(mine["params"]):
            raise ValueError(
                f"{owner}: param group {index} has {len(theirs['params'])} params in the state dict and "
                f"{len(mine['params'])} in this optimizer"
            )
        saved_names, our_names = theirs.get("param_names"), mine.get("param_names")
        if saved_names is not None and our_names is not None and list(saved_names) != list(our_names):
            first = next(j for j, (a, b) in enumerate(zip(saved_names, our_names, strict=True)) if a != b)
            raise ValueError(
                f"{owner}: param group {index} position {first} is {saved_names[first]!r}"
                f" in the state dict but {our_names[first]!r} here; the state dict is from a different"
                " model or grouping"
            )
        for saved_id in theirs["params"]:
            id_map[saved_id] = (inner_params[position], names[position])
            position += 1
    for saved_id, entry in saved["state"].items():
        if saved_id not in id_map:
            raise ValueError(f"{owner}: state dict has state for unknown parameter id {saved_id!r}")
        param, name = id_map[saved_id]
        current = optimizer.state.get(param, {})
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor):
                continue
            expected = current.get(key)
            # State shaped like the parameter must match it; other shapes (factored, scalar) are checked
            # against the state already held when there is some.
            want = (
                expected.shape
                if isinstance(expected, torch.Tensor)
                else (param.shape if value.dim() == param.dim() else None)
            )
            if want is not None and value.shape != want:
                raise ValueError(
                    f"{owner}: state {key!r} of {name!r} has shape {tuple(value.shape)}"
                    f" in the state dict, expected {tuple(want)}"
                )


def check_masters(owner: str, saved: Any, group_masters: Sequence[Sequence[torch.Tensor]]) -> None:
    """Raise ``ValueError`` unless ``saved`` (a state dict's ``fp32_masters``) lists, per group, floating
    tensors shaped like ``group_masters``' (the stage's fp32 masters per group)."""
    if not isinstance(saved, list) or len(saved) != len(group_masters):
        got = len(saved) if isinstance(saved, list) else type(saved).__name__
        raise ValueError(f"{owner}: state dict 'fp32_masters' must list {len(group_masters)} groups, got {got}")
    for index, (theirs, mine) in enumerate(zip(saved, group_masters, strict=True)):
        if len(theirs) != len(mine):
            raise ValueError(
                f"{owner}: param group {index} has {len(theirs)} fp32 masters in the state dict, {len(mine)} here"
            )
        for position, (value, master) in enumerate(zip(theirs, mine, strict=True)):
            if not isinstance(value, torch.Tensor) or value.shape != master.shape or not value.is_floating_point():
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(
                    f"{owner}: fp32 master {position} of param group {index} is {got} in the "
                    f"state dict, expected a floating tensor of shape {tuple(master.shape)}"
                )
