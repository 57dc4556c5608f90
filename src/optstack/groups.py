"""Partition resolved parameters into deterministic optimizer param groups. Pure: no collectives, no globals.

Parameters with equal merged settings and expert flag share a ``GroupKey``; keys sort the same way on every
rank (no settings first, then by the settings' repr, dense before expert). Ranks holding different parameters
pass the cross-rank union (``distributed.group_keys.union_group_keys``) as ``keys``, so all build the same
groups, some empty::

    torch.optim.AdamW(build_param_groups(model, resolve(model, rules), lr=3e-4, min_lr=3e-5))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import total_ordering
from typing import Any

from optstack.names import NamedParams, named_parameters
from optstack.rules import LR_KEYS, Resolved
from optstack.rules.resolve import nonnegative

__all__ = ["GroupKey", "group_keys", "build_param_groups", "group_map", "param_group_table"]


@total_ordering
@dataclass(frozen=True)
class GroupKey:
    """What makes a param group: merged settings and the expert flag. Hashable, picklable.

    Attributes:
        settings: ``((key, value), ...)``, stored sorted by key; empty for parameters no rule matched.
        is_expert: expert-parallel parameters get their own groups (they reduce over another group).
    """

    settings: tuple[tuple[str, Any], ...] = ()
    is_expert: bool = False

    def __post_init__(self) -> None:
        # Canonical form, so two keys built from the same mapping in any order are equal.
        settings = tuple(sorted((tuple(kv) for kv in self.settings), key=lambda kv: kv[0]))
        names = [k for k, _ in settings]
        if len(set(names)) != len(names) or not all(isinstance(k, str) for k in names):
            raise ValueError(f"GroupKey settings need distinct string keys, got {self.settings!r}")
        object.__setattr__(self, "settings", settings)
        object.__setattr__(self, "is_expert", bool(self.is_expert))

    @classmethod
    def of(cls, resolved: Resolved) -> GroupKey:
        """The key of one resolved parameter."""
        return cls(tuple(resolved.settings.items()), resolved.is_expert)

    @property
    def default_config(self) -> bool:
        """True when no LR key (max_lr, min_lr, lr_mult) is overridden (Megatron logs such groups' lr)."""
        return not any(k in LR_KEYS for k, _ in self.settings)

    def _order(self) -> tuple[bool, str, bool]:
        # repr, not the values: values of different types do not compare, and repr is the same on every rank.
        return (bool(self.settings), repr(self.settings), self.is_expert)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, GroupKey):
            return NotImplemented
        return self._order() < other._order()

    def __str__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self.settings) or "defaults"
        return f"{body}{' [expert]' if self.is_expert else ''}"


def group_keys(resolved: Mapping[str, Resolved]) -> list[GroupKey]:
    """The distinct keys of ``resolved``, in group order."""
    return sorted({GroupKey.of(r) for r in resolved.values()})


def build_param_groups(
    named_params: NamedParams,
    resolved: Mapping[str, Resolved],
    *,
    lr: float,
    min_lr: float,
    keys: Sequence[GroupKey] | None = None,
    trainable_only: bool = True,
) -> list[dict[str, Any]]:
    """One param-group dict per key, in key order; parameters keep model order within a group.

    Args:
        named_params: the same parameters ``resolved`` (``resolve(named_params, rules)``) came from.
        resolved: the parameters' settings.
        lr / min_lr: the base ``max_lr`` and ``min_lr`` for groups that do not override them.
        keys: the groups to build, in order (default ``group_keys(resolved)``; e.g. the cross-rank union);
            groups without local parameters are built empty.
        trainable_only: leave out parameters with ``requires_grad=False`` (False: group them too, as torch.optim
            keeps them; ``resolved`` must then cover them).

    Returns:
        Dicts with ``params``, ``param_names``, ``is_expert_parallel``, ``default_config``, ``wd_mult=1.0``,
        ``lr_mult=1.0``, ``max_lr=lr``, ``min_lr=min_lr``, then the key's settings (which win).

    Raises:
        ValueError: on a bad ``lr``/``min_lr``, duplicate ``keys``, a parameter whose key is not in ``keys``,
            or ``resolved`` not matching ``named_params``.
    """
    nonnegative("lr", lr, "build_param_groups: ")
    nonnegative("min_lr", min_lr, "build_param_groups: ")
    keys = group_keys(resolved) if keys is None else list(keys)
    if len(set(keys)) != len(keys):
        dupes = sorted({str(k) for k in keys if keys.count(k) > 1})
        raise ValueError(f"build_param_groups: keys must be distinct; repeated: {dupes}")
    groups = [{"params": [], "param_names": [], "is_expert_parallel": key.is_expert,
               "default_config": key.default_config, "wd_mult": 1.0, "lr_mult": 1.0, "max_lr": lr,
               "min_lr": min_lr, **dict(key.settings)} for key in keys]
    index = {k: i for i, k in enumerate(keys)}
    for name, param in named_parameters(named_params, trainable_only=trainable_only):
        r = resolved.get(name)
        if r is None:
            raise ValueError(
                f"trainable parameter {name!r} is missing from `resolved`; resolve the same parameters "
                "(the same module / chunks) that you pass here"
            )
        key = GroupKey.of(r)
        if key not in index:
            raise ValueError(
                f"parameter {name!r} has group key {key} which is not in `keys`; pass keys that include "
                "every local key (e.g. union_group_keys(group_keys(resolved), comm))"
            )
        groups[index[key]]["params"].append(param)
        groups[index[key]]["param_names"].append(name)
    seen = {n for g in groups for n in g["param_names"]}
    missing = [n for n in resolved if n not in seen]
    if missing:
        raise ValueError(
            f"`resolved` names parameters that are not trainable parameters of named_params: {missing[:5]}; "
            "resolve the same parameters you pass here, after freezing"
        )
    return groups


def group_map(groups: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The one parameter -> group map of any group dicts (``build_param_groups``', an optimizer's ``param_groups``).

    Returns:
        ``{"groups": [{"index": g, "settings": {...}, "params": [names]}, ...], "param_to_group": {name: g}}``:
        ``settings`` is every group field but ``params`` and ``param_names``, as it is in the group (so an
        optimizer's groups show the ``lr`` and ``weight_decay`` in use); a group without ``param_names`` names
        its parameters ``group{g}.param{i}``; ``param_to_group`` is in group order, then parameter order.
    """
    out_groups = []
    param_to_group: dict[str, int] = {}
    for index, group in enumerate(groups):
        names = list(group.get("param_names")
                     or [f"group{index}.param{i}" for i in range(len(group.get("params", ())))])
        settings = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        out_groups.append({"index": index, "settings": settings, "params": names})
        param_to_group.update(dict.fromkeys(names, index))
    return {"groups": out_groups, "param_to_group": param_to_group}


def param_group_table(groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per parameter, for dumps and CLIs: name, group index, shape, numel, expert flag, settings.

    The names, indices and ``settings`` are ``group_map(groups)``'s, plus each tensor's shape.
    """
    return [
        {"name": name, "group": entry["index"], "shape": list(p.shape), "numel": p.numel(),
         "is_expert_parallel": bool(group.get("is_expert_parallel", False)), "settings": dict(entry["settings"])}
        for group, entry in zip(groups, group_map(groups)["groups"], strict=True)
        for name, p in zip(entry["params"], group["params"], strict=True)
    ]
