"""What ``ChainedOptimizer`` shows as torch.optim's: ``optimizer.state`` as a mapping users may write (optstack's
live entries of each parameter beside the user's own), and the checks a torch-format state dict's groups get on
load (names compared only where both sides have real ones, shapes of parameter-shaped state).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor

__all__ = ["OptimizerState", "ParamState", "check_names", "check_shapes", "is_placeholder_name"]


class ChainedOptimizer(Protocol):
    """What these views read of the optimizer that holds them (``optimizer.ChainedOptimizer``; named by its
    shape so that this module, which it imports, imports nothing back)."""

    _extra: dict[int, dict[Any, Any]]
    _other: dict[Any, Any]
    _stage_of: Mapping[int, Any]
    _has_state: bool

    def _live_entry(self, param: torch.Tensor) -> dict[str, Any]: ...


def is_placeholder_name(name: Any) -> bool:
    """Whether ``name`` is a stand-in for a parameter without a name (``param.3`` for bare tensors, ``group 0
    param 3`` inside a stage), which says nothing about which parameter it is."""
    return isinstance(name, str) and _PLACEHOLDER.fullmatch(name) is not None


_PLACEHOLDER = re.compile(r"param\.\d+|group \d+ param \d+")


def check_names(index: int, theirs: Any, ours: Any) -> list[str] | None:
    """Compare a saved group's ``param_names`` with ours where both are real names (``ValueError`` naming the
    first that differ); return the saved names when ours are placeholders and theirs real (this optimizer
    takes them, as torch keeps the names of a state dict), else None."""
    if theirs is None or ours is None:
        return None
    theirs, ours = list(theirs), list(ours)
    if len(theirs) != len(ours):
        raise ValueError(f"param group {index} names {len(theirs)} parameters in the state dict, {len(ours)} here")
    differ = [f"{a!r} vs {b!r}" for a, b in zip(theirs, ours, strict=True)
              if a != b and not is_placeholder_name(a) and not is_placeholder_name(b)]
    if differ:
        raise ValueError(f"param group {index} holds other parameters in the state dict than here (saved vs here: "
                         f"{differ[:4]}); load a state dict of an optimizer over the same parameters, in the same "
                         "order (a model built the same way)")
    if all(is_placeholder_name(b) for b in ours) and not any(is_placeholder_name(a) for a in theirs):
        return theirs
    return None


def check_shapes(param: torch.Tensor, entry: Any, group: Mapping[str, Any], index: int) -> None:
    """A saved state tensor shaped like a parameter (more than one dimension) must be shaped like this one."""
    if not isinstance(entry, Mapping) or isinstance(param, DTensor):
        return  # (a DTensor's state is its local shard, or the whole matrix on an owner: the stage checks it)
    for key, value in entry.items():
        if isinstance(value, torch.Tensor) and value.dim() > 1 and tuple(value.shape) != tuple(param.shape):
            names = group.get("param_names") or []
            position = next(i for i, p in enumerate(group["params"]) if p is param)
            name = names[position] if position < len(names) else f"group {index} param {position}"
            saved, here = tuple(value.shape), tuple(param.shape)
            raise ValueError(
                f"cannot load the optimizer state: its {key!r} of parameter {name!r} has {value.numel()} elements, "
                f"but {name!r} has {param.numel()} (shape {here}): the state dict was saved with another model (its "
                f"shape {saved}, here {here}), or before this one changed. Load the state dict saved with this "
                "model's optimizer; to start from another model's weights, load those into the model "
                "(model.load_state_dict) and keep this fresh optimizer")


class ParamState(MutableMapping[Any, Any]):
    """``optimizer.state[param]``: optstack's live entries of one parameter and the user's own, as one dict."""

    def __init__(self, owner: ChainedOptimizer, param: torch.Tensor) -> None:
        self._owner, self._param = owner, param

    def _live(self) -> dict[str, Any]:
        return self._owner._live_entry(self._param)

    def _extra(self) -> dict[Any, Any]:
        return self._owner._extra.get(id(self._param), {})

    def __getitem__(self, key: Any) -> Any:
        live = self._live()
        return live[key] if key in live else self._extra()[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        live = self._live()
        if key not in live:
            self._owner._extra.setdefault(id(self._param), {})[key] = value
            return
        current = live[key]
        if not isinstance(current, torch.Tensor):
            live[key] = value
            return
        if isinstance(value, torch.Tensor) and value.numel() != current.numel():
            raise ValueError(f"state[param][{key!r}] holds {current.numel()} elements (shape {tuple(current.shape)}) "
                             f"on this rank; got a tensor of shape {tuple(value.shape)}. optstack's own state is "
                             "written in place; load another layout's state through load_state_dict")
        with torch.no_grad():
            if isinstance(value, torch.Tensor):
                current.copy_(value.reshape(current.shape))
            else:
                current.fill_(value)

    def __delitem__(self, key: Any) -> None:
        extra = self._extra()
        if key in extra:
            del extra[key]
        elif key in self._live():
            raise ValueError(f"state[param][{key!r}] is optstack's own state, which a step needs; it cannot be "
                             "deleted (overwrite it, or load a state dict)")
        else:
            raise KeyError(key)

    def __iter__(self) -> Iterator[Any]:
        live = self._live()
        return iter([*live, *(k for k in self._extra() if k not in live)])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return repr(dict(self.items()))


class OptimizerState(MutableMapping[Any, Any]):
    """``ChainedOptimizer.state``: model parameter -> its state on this rank (``ParamState``), plus the user's
    entries under keys that are not parameters."""

    def __init__(self, owner: ChainedOptimizer) -> None:
        self._owner = owner

    def _known(self, param: torch.Tensor) -> bool:
        return id(param) in self._owner._stage_of

    def __bool__(self) -> bool:
        return self._owner._has_state or any(True for _ in self)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, torch.Tensor):
            if not self._known(key):  # torch's defaultdict would insert it; a stray tensor is a mistake here
                raise KeyError(f"not a parameter of this optimizer (shape {tuple(key.shape)})")
            return ParamState(self._owner, key)
        return self._owner._other[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        if not isinstance(key, torch.Tensor):
            self._owner._other[key] = value
            return
        if not self._known(key):
            raise KeyError(f"optimizer.state takes the parameters of this optimizer as keys; got a tensor of shape "
                           f"{tuple(key.shape)} that is not one")
        if not isinstance(value, Mapping):
            raise TypeError(f"optimizer.state[param] must be set to a dict of state values, got {type(value).__name__}")
        entry = ParamState(self._owner, key)
        self._owner._extra.pop(id(key), None)
        for k, v in value.items():
            entry[k] = v

    def __delitem__(self, key: Any) -> None:
        if not isinstance(key, torch.Tensor):
            del self._owner._other[key]
            return
        if self._owner._live_entry(key):
            raise ValueError("optimizer.state[param] holds optstack's own state, which a step needs; it cannot be "
                             "deleted (load a state dict to replace it)")
        if self._owner._extra.pop(id(key), None) is None:
            raise KeyError(f"no state for the parameter of shape {tuple(key.shape)}")

    def __iter__(self) -> Iterator[Any]:
        owner = self._owner
        held = {key for stage in owner._stages for key, entry in stage.torch_state().items() if entry}
        seen: set[int] = set()
        for group in owner.param_groups:
            for param in group["params"]:
                if id(param) not in seen and (id(param) in held or owner._extra.get(id(param))):
                    seen.add(id(param))
                    yield param
        yield from list(owner._other)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, torch.Tensor):
            return self._known(key) and bool(self._owner._live_entry(key) or self._owner._extra.get(id(key)))
        return key in self._owner._other

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default

    def __repr__(self) -> str:
        return repr({k: dict(v.items()) if isinstance(v, ParamState) else v for k, v in self.items()})
