"""Megatron's ``_get_param_groups`` as ``get_param_groups``: model chunks + config + overrides -> group dicts.

The work is the core's (``optstack.rules.resolve``, ``optstack.groups``; group keys unioned across ranks, so every
rank gets the same groups, some empty); this module renames the result into Megatron's group dicts and order.
Names are matched as Megatron matches them, against each chunk's own ``named_parameters`` (a glob such as
``'decoder.*'`` works on every chunk); a tensor shared by two chunks is grouped once, under the core's name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from optstack.distributed.comm import world_comm
from optstack.distributed.group_keys import union_group_keys
from optstack.groups import GroupKey, build_param_groups, group_keys
from optstack.megatron.config import OptimizerConfig, megatron_optimizer_name
from optstack.megatron.keys import ConfigOverrides, get_standard_config_overrides, to_rules
from optstack.names import named_parameters
from optstack.rules import Resolved, Rule, resolve

__all__ = ["get_param_groups", "_get_param_groups", "resolve_chunks", "as_chunks"]


def as_chunks(model_chunks: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """One module or a list of modules -> a list of modules (a ValueError for anything else)."""
    if isinstance(model_chunks, nn.Module):
        return [model_chunks]
    chunks = list(model_chunks) if isinstance(model_chunks, Sequence) else []
    if not chunks or not all(isinstance(c, nn.Module) for c in chunks):
        raise ValueError(f"model_chunks must be an nn.Module or a list of them, got {model_chunks!r}")
    return chunks


def resolve_chunks(
    chunks: list[nn.Module], rules: Sequence[Rule]
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Resolved]]:
    """Resolve ``rules`` against each chunk's own parameter names, keyed by the core's unique names.

    Returns:
        ``(named, resolved)``: the core's trainable ``named_parameters(chunks)`` (wrappers looked through, a
        ``chunk{i}.`` prefix only when chunks share names) and the resolved settings of each of them, ready
        for ``build_param_groups`` or ``build_optimizer(..., resolved=resolved)``.
    """
    named = named_parameters(chunks)
    unique_name = {id(p): n for n, p in named}
    resolved: dict[str, Resolved] = {}
    for chunk in chunks:
        own = list(chunk.named_parameters())  # Megatron matches the chunk's names as they are, wrapper and all
        local = dict(named_parameters(own))
        for local_name, r in resolve(own, rules).items():
            name = unique_name[id(local[local_name])]
            if name not in resolved:  # a tensor shared by two chunks is grouped once, under its first name
                resolved[name] = dataclasses.replace(r, name=name)
    return named, resolved


def get_param_groups(
    model_chunks: nn.Module | Sequence[nn.Module],
    config: OptimizerConfig,
    config_overrides: ConfigOverrides | None,
) -> list[dict[str, Any]]:
    """Megatron's parameter groups.

    Args:
        model_chunks: the model chunks (or one module).
        config: supplies the defaults ``max_lr = config.lr`` and ``min_lr = config.min_lr`` (None stays
            None, as in Megatron; ``OptimizerParamScheduler`` then uses its own values), and
            ``decoupled_weight_decay`` for an override's ``optimizer``.
        config_overrides: ``{ParamKey: ParamGroupOverride}``. None means the standard overrides
            (``get_standard_config_overrides(config)``); ``{}`` means none at all.

    Returns:
        One dict per group: ``params``, ``param_names`` (optstack's addition; torch.optim understands it),
        ``is_expert_parallel``, ``default_config`` (True when no override key contains "lr"), ``wd_mult=1.0``,
        ``lr_mult=1.0``, ``is_decoupled_lr=False``, ``max_lr``, ``min_lr``, then the merged override. Order:
        the group without overrides first, then by the sorted override items, dense before expert.
        Frozen parameters are left out; parameters with the same merged override and expert flag share a
        group.

    Raises:
        ValueError: two overrides set one key of one parameter to different values, or an override the core
            cannot take (``params``, ``lr``, ``weight_decay``).

    Differences from Megatron: an override that sets nothing does not make a group of its own; dense and
    expert groups with the same override are ordered dense first (Megatron: first seen on the rank); a tensor
    shared by two chunks is grouped once (Megatron lists it twice); override values that do not compare
    (None and a float) keep a deterministic order (Megatron: TypeError); list values become tuples
    (Megatron: TypeError); ``lr``, ``weight_decay``, the derived fields (``is_expert_parallel``,
    ``default_config``, ``param_names``) and schedule values that are not finite numbers >= 0 are
    ``ValueError`` s (Megatron copies them into the group).
    """
    chunks = as_chunks(model_chunks)
    if config_overrides is None:
        config_overrides = get_standard_config_overrides(config)
    named, resolved = resolve_chunks(chunks, to_rules(config, config_overrides))
    keys = group_keys(resolved)
    comm = world_comm()
    if comm.size > 1:  # every rank must build the same groups (checkpoints, the distributed optimizer)
        keys = union_group_keys(keys, comm)
    core_groups = build_param_groups(named, resolved, lr=0.0, min_lr=0.0, keys=keys)
    groups = [_to_megatron(g, k, config) for g, k in zip(core_groups, keys, strict=True)]
    try:
        groups = sorted(groups, key=_megatron_order)
    except TypeError:
        pass  # override values that do not compare (e.g. None and a float): keep the core's repr order
    return [g for g, _ in groups]


def _get_param_groups(
    model_chunks: nn.Module | Sequence[nn.Module],
    config: OptimizerConfig,
    config_overrides: ConfigOverrides | None,
) -> list[dict[str, Any]]:
    """Megatron's ``_get_param_groups``: ``get_param_groups`` without optstack's ``param_names`` key, so the
    group dicts have exactly Megatron's keys."""
    return [{k: v for k, v in g.items() if k != "param_names"}
            for g in get_param_groups(model_chunks, config, config_overrides)]


def _to_megatron(
    core_group: dict[str, Any], key: GroupKey, config: OptimizerConfig
) -> tuple[dict[str, Any], tuple]:
    """A core group and its key -> (Megatron's group dict, its override as sorted items)."""
    override = {
        ("optimizer" if k == "algorithm" else k): (megatron_optimizer_name(v) if k == "algorithm" else v)
        for k, v in key.settings
    }
    group = {
        "params": core_group["params"],
        "param_names": core_group["param_names"],
        "is_expert_parallel": core_group["is_expert_parallel"],
        "default_config": not any("lr" in k for k in override),
        "wd_mult": 1.0,
        "lr_mult": 1.0,
        "is_decoupled_lr": False,
        "max_lr": config.lr,
        "min_lr": config.min_lr,
        **override,
    }
    return group, tuple(sorted(override.items()))


def _megatron_order(item: tuple[dict[str, Any], tuple]) -> tuple:
    group, override = item
    return (bool(override), override, group["is_expert_parallel"])
