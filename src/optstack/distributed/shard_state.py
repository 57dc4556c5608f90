"""Name-keyed optimizer state of the distributed stages: ``ShardSpec`` and the save and load loops that the
ZeRO-1 (``sharded.py``) and layer-wise (``layerwise.py``) stages share.

Each stage holds, per model parameter it steps, one *inner* tensor (an fp32 master, or a view of the
parameter) covering a flat range of the parameter: part of it for ZeRO-1, all of it for layer-wise. Its
state is saved as ``{name: {"param": ShardSpec, <element-wise state>: ShardSpec, <scalar state>: value}}``,
which a checkpoint can reshard; each stage decides which saved ranges it accepts (``Cut``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["Cut", "ShardSpec", "load_param_state", "param_state_entry"]


class ShardSpec(NamedTuple):
    """Which flat range of a full parameter-shaped tensor this rank holds.

    ``local`` is the 1-D tensor of elements ``[flat_start, flat_end)`` of the flattened ``global_shape``.
    """

    global_shape: tuple[int, ...]
    flat_start: int
    flat_end: int
    local: torch.Tensor


# (index of the inner tensor, state key, saved ShardSpec) -> the inner tensor's part, checked and copied
Cut = Callable[[int, str, ShardSpec], torch.Tensor]


def param_state_entry(
    global_shape: tuple[int, ...], start: int, end: int, inner: torch.Tensor, state: Mapping[str, Any]
) -> dict[str, ShardSpec | Any]:
    """One parameter's saved form: ``"param"`` (``inner``) and every state tensor shaped like ``inner`` as
    ``ShardSpec``s of ``[start, end)`` (1-D views, references); other state (e.g. ``"step"``) as it is."""
    entry: dict[str, ShardSpec | Any] = {"param": ShardSpec(global_shape, start, end, inner.view(-1))}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.shape == inner.shape:
            entry[key] = ShardSpec(global_shape, start, end, value.view(-1))
        else:
            entry[key] = value
    return entry


def load_param_state(
    owner: str,
    optimizer: torch.optim.Optimizer,
    owned: Sequence[tuple[str, torch.Tensor]],
    state: Mapping[str, Mapping[str, ShardSpec | Any]],
    cut: Cut,
) -> None:
    """Load ``param_state_entry``-form state into ``optimizer`` and its parameters.

    Args:
        owner: the stage's name, for errors.
        optimizer: the inner optimizer; ``owned`` lists its parameters in group order.
        owned: (parameter name, inner tensor) per inner parameter.
        state: the saved entries by name; names not in ``owned`` are ignored.
        cut: this stage's part of a saved ``ShardSpec`` (raises ``ValueError`` when it does not fit).

    Raises:
        ValueError: an owned parameter has no entry (or no ``"param"``), or ``cut`` refuses a range; nothing
            is changed then.
    """
    per_param: dict[int, dict[str, Any]] = {}
    values: list[tuple[torch.Tensor, torch.Tensor]] = []
    for index, (name, inner) in enumerate(owned):
        entry = state.get(name)
        if entry is None or "param" not in entry:
            raise ValueError(f"{owner}: no state for parameter {name!r} (needs at least 'param')")
        loaded = {key: cut(index, key, value) if isinstance(value, ShardSpec) else _copy(value)
                  for key, value in entry.items()}
        values.append((inner, loaded.pop("param")))
        per_param[index] = loaded
    saved = optimizer.state_dict()
    saved["state"] = {i: v for i, v in per_param.items() if v}
    optimizer.load_state_dict(saved)
    with torch.no_grad():
        for inner, value in values:
            inner.copy_(value)


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value
