"""The state of ``HybridDeviceOptimizer`` (``hybrid.py``) in the form of the inner optimizer it replaces.

The hybrid steps its tensors with several sub-optimizers (the device part, host chunks), each numbering its
own tensors. Checkpoints must not see that: the hybrid's ``state_dict`` is exactly the plain inner
optimizer's (its groups, each tensor's state indexed in group order), so it loads into a plain optimizer and
a plain optimizer's loads into the hybrid. Here: the mapping between the two numberings (a *slot* per tensor:
which sub-optimizer steps it, and its index there), both directions of the state-dict translation, and the
live ``state`` view keyed by the hybrid's own (device) tensors.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

__all__ = ["NOT_SYNCED", "Slot", "StateView", "loaded_groups", "merge_state_dicts", "split_state_dict"]

Slot = tuple[int, int]  # (index of the sub-optimizer stepping a tensor, the tensor's index in its state dict)

NOT_SYNCED = ("params", "param_names")  # group keys each sub-optimizer keeps its own of


class StateView(Mapping[torch.Tensor, dict[str, Any]]):
    """Device tensor -> its state dict in whichever sub-optimizer steps it (live, never copied).

    Args:
        owners: ``id(device tensor)`` -> (the sub-optimizer stepping it, the tensor it steps in its place).
        params: the device tensors, in group order (the iteration order).
    """

    def __init__(self, owners: Mapping[int, tuple[torch.optim.Optimizer, torch.Tensor]],
                 params: Sequence[torch.Tensor]) -> None:
        self._owners = owners
        self._params = list(params)

    def __getitem__(self, param: torch.Tensor) -> dict[str, Any]:
        owner = self._owners.get(id(param))
        if owner is None:
            raise KeyError(param)
        optimizer, stepped = owner
        return optimizer.state[stepped]  # a defaultdict, as torch.optim's own ``state``

    def get(self, param: torch.Tensor, default: Any = None) -> Any:  # type: ignore[override]
        return self[param] if param in self else default

    def __contains__(self, param: object) -> bool:
        owner = self._owners.get(id(param))
        return owner is not None and owner[1] in owner[0].state

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (p for p in self._params if p in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def merge_state_dicts(groups: Sequence[dict[str, Any]], slots: Sequence[Slot],
                      sub_states: Sequence[Mapping[Any, Any]]) -> dict[str, Any]:
    """The plain optimizer's state dict: ``groups``' settings, and the state of the tensor in each slot
    (``sub_states[k]`` is sub-optimizer ``k``'s ``state_dict()["state"]``) indexed in group order."""
    state: dict[int, Any] = {}
    for index, (k, local) in enumerate(slots):
        if local in sub_states[k]:
            state[index] = sub_states[k][local]
    packed_groups, index = [], 0
    for group in groups:
        packed = {key: value for key, value in group.items() if key != "params"}
        packed["params"] = list(range(index, index + len(group["params"])))
        index += len(group["params"])
        packed_groups.append(packed)
    return {"state": state, "param_groups": packed_groups}


def split_state_dict(state_dict: Mapping[str, Any], groups: Sequence[dict[str, Any]], slots: Sequence[Slot],
                     count: int) -> list[dict[str, Any]]:
    """One state dict per sub-optimizer (``count`` of them) from a plain optimizer's: every group's saved
    settings, and the state of each tensor it steps. Raises ``ValueError`` if the groups' sizes differ."""
    saved_groups = state_dict["param_groups"]
    sizes = [len(g["params"]) for g in saved_groups]
    ours = [len(g["params"]) for g in groups]
    if sizes != ours:
        raise ValueError(f"HybridDeviceOptimizer: the state dict's groups hold {sizes} parameters, this "
                         f"optimizer's {ours}")
    subs: list[dict[str, Any]] = [{"state": {}, "param_groups": []} for _ in range(count)]
    position = 0
    for group, saved in zip(groups, saved_groups, strict=True):
        names = saved.get("param_names", group.get("param_names"))
        settings = {key: value for key, value in saved.items() if key not in NOT_SYNCED}
        members: list[list[int]] = [[] for _ in range(count)]
        for j, saved_id in enumerate(saved["params"]):
            k = slots[position + j][0]
            members[k].append(j)
            if saved_id in state_dict["state"]:
                subs[k]["state"][saved_id] = state_dict["state"][saved_id]
        for k, picked in enumerate(members):
            sub = {**settings, "params": [saved["params"][j] for j in picked]}
            if names is not None:
                sub["param_names"] = [names[j] for j in picked]
            subs[k]["param_groups"].append(sub)
        position += len(group["params"])
    return subs


def loaded_groups(groups: Sequence[dict[str, Any]], saved_groups: Sequence[dict[str, Any]]
                  ) -> list[dict[str, Any]]:
    """What ``torch.optim`` makes of its groups on a load: (copies of) the saved ones, with our parameters
    (and our names, where none were saved)."""
    out = []
    for group, saved in zip(groups, saved_groups, strict=True):
        loaded = copy.deepcopy({key: value for key, value in saved.items() if key != "params"})
        loaded["params"] = group["params"]
        if "param_names" in group and "param_names" not in loaded:
            loaded["param_names"] = group["param_names"]
        out.append(loaded)
    return out
