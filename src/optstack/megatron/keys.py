"""Megatron Core's parameter keys and overrides, and ``to_rules``, their translation into optstack rules.

A ``ParamKey`` selects parameters; a ``ParamGroupOverride`` is the group settings for what a key selects; a
``{ParamKey: ParamGroupOverride}`` mapping is Megatron's ``config_overrides``. Each key becomes a core
``Matcher``, so merging, conflict detection and grouping are the core's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch

from optstack.megatron.config import OptimizerConfig, core_algorithm
from optstack.rules import Attr, Matcher, Name, NamedPredicate, Never, Or, Predicate, Rule, mup_rules

__all__ = [
    "ParamPredicate", "ParamWithNamePredicate", "ParamKey", "ParamGroupOverride",
    "combine_param_group_overrides", "param_group_override_to_tuple", "get_standard_config_overrides",
    "get_mup_config_overrides", "check_config_overrides_consistency", "to_rules",
]

logger = logging.getLogger(__name__)

ConfigOverrides = Mapping["ParamKey", "ParamGroupOverride"]


@dataclass(frozen=True)
class ParamPredicate:
    """A named test ``fn(param) -> bool``; equality and hashing use ``name`` only (as in Megatron)."""

    name: str
    fn: Callable[[torch.nn.Parameter], bool] = field(compare=False, hash=False)

    def __call__(self, param: torch.nn.Parameter) -> bool:
        return self.fn(param)


@dataclass(frozen=True)
class ParamWithNamePredicate:
    """A named test ``fn(param, name) -> bool``; equality and hashing use ``name`` only (as in Megatron)."""

    name: str
    fn: Callable[[torch.nn.Parameter, str], bool] = field(compare=False, hash=False)

    def __call__(self, param: torch.nn.Parameter, name: str) -> bool:
        return self.fn(param, name)


def _as_tuple(kind: str, value: Any, item_type: type) -> tuple[Any, ...]:
    items = (value,) if isinstance(value, item_type) else value
    if not isinstance(items, tuple) or not all(isinstance(v, item_type) for v in items):
        raise ValueError(
            f"ParamKey.{kind} must be a {item_type.__name__} or a tuple of them, got {value!r}"
        )
    return items


@dataclass(frozen=True, slots=True)
class ParamKey:
    """Selects parameters: it matches when ANY given name glob, attribute, predicate or name-predicate does.

    Each field is one value or a tuple of them. An empty key matches nothing.

    Attributes:
        name: ``fnmatch`` glob(s) over the ``named_parameters`` name (``'*.bias'`` matches ``'fc.bias'`` but
            not ``'fc.bias_scale'``; ``'*.bias*'`` matches both).
        attr: attribute name(s); matches when ``getattr(param, attr, False)`` is truthy.
        predicate: ``ParamPredicate``(s), called with the parameter.
        with_name_predicate: ``ParamWithNamePredicate``(s), called with the parameter and its name.
    """

    name: str | tuple[str, ...] = field(default_factory=tuple)
    attr: str | tuple[str, ...] = field(default_factory=tuple)
    predicate: ParamPredicate | tuple[ParamPredicate, ...] = field(default_factory=tuple)
    with_name_predicate: ParamWithNamePredicate | tuple[ParamWithNamePredicate, ...] = field(
        default_factory=tuple
    )

    def to_matcher(self) -> Matcher:
        """The equivalent core ``Matcher`` (``Never()`` for an empty key)."""
        parts: list[Matcher] = []
        names = _as_tuple("name", self.name, str)
        if names:
            parts.append(Name(*names))
        attrs = _as_tuple("attr", self.attr, str)
        if attrs:
            parts.append(Attr(*attrs))
        parts += [Predicate(p, p.name) for p in _as_tuple("predicate", self.predicate, ParamPredicate)]
        parts += [
            NamedPredicate(p, p.name)
            for p in _as_tuple("with_name_predicate", self.with_name_predicate, ParamWithNamePredicate)
        ]
        if not parts:
            return Never()
        return parts[0] if len(parts) == 1 else Or(*parts)

    def matches(self, param: torch.nn.Parameter, param_name: str) -> bool:
        """True when the parameter (with its ``named_parameters`` name) is selected by this key."""
        return self.to_matcher()(param, param_name)


class ParamGroupOverride(TypedDict, total=False):
    """Settings for the parameters a ``ParamKey`` selects (any further key is allowed, e.g. ``eps``).

    ``max_lr`` / ``min_lr``: this group's schedule bounds; ``start_wd`` / ``end_wd``: its weight-decay
    schedule bounds; ``wd_mult``: multiplier on the weight decay; ``optimizer``: the group's optimizer
    (Megatron's current main; it may only repeat ``OptimizerConfig.optimizer``, as there).
    """

    max_lr: float
    min_lr: float
    start_wd: float
    end_wd: float
    wd_mult: float
    optimizer: str


def param_group_override_to_tuple(
    param_group_override: ParamGroupOverride | None,
) -> tuple[tuple[str, Any], ...] | None:
    """The override as a tuple of items sorted by key (hashable), or None for None."""
    if param_group_override is None:
        return None
    return tuple(sorted(param_group_override.items()))


def combine_param_group_overrides(
    param_group_overrides: list[ParamGroupOverride | None],
) -> ParamGroupOverride:
    """Merge overrides into one (None entries are skipped).

    Raises:
        ValueError: when two overrides give one key different values.
    """
    combined = ParamGroupOverride()
    for override in param_group_overrides:
        if override is None:
            continue
        for key, value in override.items():
            if key in combined and combined[key] != value:  # type: ignore[literal-required]
                raise ValueError(
                    f"Conflicting overrides for {key}: {combined[key]!r} and {value!r}"  # type: ignore[literal-required]
                )
            combined[key] = value  # type: ignore[literal-required]
    return combined


def get_standard_config_overrides(config: OptimizerConfig) -> dict[ParamKey, ParamGroupOverride]:
    """Megatron's standard overrides: ``wd_mult=0`` for ``*.bias`` and 1-D parameters (keeping weight decay
    on q/k layer norms when ``config.apply_wd_to_qk_layernorm``), and ``decoupled_lr`` / ``decoupled_min_lr``
    as ``max_lr`` / ``min_lr`` for parameters flagged ``is_embedding_or_output_parameter``."""
    overrides: dict[ParamKey, ParamGroupOverride] = {}
    if config.apply_wd_to_qk_layernorm:
        no_wd = ParamKey(
            with_name_predicate=ParamWithNamePredicate(name="s1_not_qkln", fn=_no_wd_except_qk_norm)
        )
    else:
        no_wd = ParamKey(name="*.bias", predicate=ParamPredicate(name="param_len_1", fn=_is_1d))
    overrides[no_wd] = ParamGroupOverride(wd_mult=0.0)
    if config.decoupled_lr is not None:
        decoupled = ParamGroupOverride(max_lr=config.decoupled_lr)
        if config.decoupled_min_lr is not None:
            decoupled["min_lr"] = config.decoupled_min_lr
        overrides[ParamKey(attr="is_embedding_or_output_parameter")] = decoupled
    return overrides


def _is_1d(param: torch.Tensor) -> bool:
    return len(param.shape) == 1


def _no_wd_except_qk_norm(param: torch.Tensor, name: str) -> bool:
    # The Qwen3-Next recipe: biases and 1-D params skip weight decay, q/k layer norms keep it.
    is_qk_norm = "q_layernorm." in name or "k_layernorm." in name
    return (len(param.shape) == 1 or name.endswith(".bias")) and not is_qk_norm


def _mup_family(optimizer_type: str) -> str:
    # Megatron tests substrings: 'adam' in the name is Adam-like, 'muon' Muon-like, 'sgd' exactly SGD; any
    # other optimizer gets the hidden-LR rule without eps, which is the core's 'lion' family.
    lower = optimizer_type.lower()
    if lower == "sgd":
        return "sgd"
    if "muon" in lower:
        return "muon"
    return "adam" if "adam" in lower else "lion"


def get_mup_config_overrides(
    config: OptimizerConfig, mup_width_mult: float, optimizer_type: str = "adam"
) -> dict[ParamKey, ParamGroupOverride]:
    """MuP overrides with Megatron's semantics (``w = mup_width_mult``), built from the core's ``mup_rules``.

    Adam-like: hidden matrices ``max_lr = lr / w``, ``min_lr = min_lr / w``, ``eps = adam_eps / w``; vectors
    and embeddings keep the base values. SGD: vector-like parameters ``lr * w``. Muon: matrices Muon manages
    get nothing. Other optimizers: hidden ``lr / w``, no eps. With ``decoupled_lr`` set, embedding/output
    parameters keep the decoupled LR. ``w == 1`` gives ``{}``.

    Raises:
        ValueError: ``w`` is not a finite number > 0, or ``config.lr`` is None while ``w != 1`` (Megatron then
            silently skips the LR part; optstack asks for the LR instead).
    """
    family = _mup_family(optimizer_type)
    if config.decoupled_lr is not None:
        logger.warning(
            "Both decoupled_lr and MuP LR scaling are enabled: decoupled_lr sets an absolute LR for "
            "embedding and output parameters, which MuP LR scaling leaves alone."
        )
    if family == "muon" and config.muon_scale_mode == "spectral":
        logger.warning(
            "MuP with muon_scale_mode='spectral': Muon-managed matrices keep spectral scaling; set "
            "muon_scale_mode='unit_rms_norm' for MuP-consistent Muon updates."
        )
    if mup_width_mult == 1.0:
        return {}
    if config.lr is None:
        raise ValueError(
            f"get_mup_config_overrides(mup_width_mult={mup_width_mult!r}) needs config.lr (the LR to scale); "
            "set OptimizerConfig(lr=...)"
        )
    rules = mup_rules(
        mup_width_mult,
        family=family,  # type: ignore[arg-type]
        lr=config.lr,
        min_lr=config.min_lr,
        eps=config.adam_eps if family == "adam" else None,
        decoupled_lr=config.decoupled_lr,
        decoupled_min_lr=config.decoupled_min_lr,
    )
    # Each core rule becomes a key named after the rule, selecting exactly what the rule's matcher selects.
    return {
        ParamKey(with_name_predicate=ParamWithNamePredicate(name=rule.label, fn=rule.matcher)):
            ParamGroupOverride(**rule.settings)  # type: ignore[typeddict-item]
        for rule in rules
    }


_NOT_OVERRIDABLE = ("overlap_param_gather_with_optimizer_step", "optimizer", "optimizer_cpu_offload")


def check_config_overrides_consistency(
    config: OptimizerConfig, config_overrides: ConfigOverrides | None
) -> bool:
    """Overrides may not change ``optimizer``, ``optimizer_cpu_offload`` or
    ``overlap_param_gather_with_optimizer_step`` (they may repeat the config's value).

    Returns:
        True.

    Raises:
        ValueError: naming the field, the override's value and the config's.
    """
    if config_overrides is None:
        return True
    for field_name in _NOT_OVERRIDABLE:
        base = getattr(config, field_name, None)
        for key, override in config_overrides.items():
            if field_name in override and override[field_name] != base:  # type: ignore[literal-required]
                raise ValueError(
                    f"Field {field_name} should not be overridden in a config override: {key} sets "
                    f"{field_name}={override[field_name]!r} but the config has {base!r}; "  # type: ignore[literal-required]
                    "change it in OptimizerConfig instead"
                )
    return True


# Override keys the core does not take as settings: what a Megatron user should write instead.
_REJECTED_KEYS = {
    "lr": "the scheduler overwrites 'lr' every step; override max_lr / min_lr instead",
    "weight_decay": "the scheduler overwrites 'weight_decay' every step; override wd_mult, start_wd, end_wd",
}


def to_rules(config: OptimizerConfig, config_overrides: ConfigOverrides) -> list[Rule]:
    """One core ``Rule`` per ``(ParamKey, override)``: the key's matcher and the override's settings, with
    ``optimizer`` renamed to the core's ``algorithm`` (Megatron's 'adam' -> 'adamw' when weight decay is
    decoupled).

    Raises:
        ValueError: a malformed key, an override that is not a mapping, or a key the core cannot take
            (``params``, ``lr``, ``weight_decay``, unhashable values).
    """
    rules = []
    for key, override in config_overrides.items():
        if not isinstance(key, ParamKey):
            raise ValueError(f"config_overrides keys must be ParamKey, got {key!r}")
        if not isinstance(override, Mapping):
            raise ValueError(f"config_overrides[{key}] must be a dict (ParamGroupOverride), got {override!r}")
        settings: dict[str, Any] = {}
        for name, value in override.items():
            if name in _REJECTED_KEYS:
                raise ValueError(f"config_overrides[{key}] sets {name!r}: {_REJECTED_KEYS[name]}")
            if name == "optimizer":
                if not isinstance(value, str):
                    raise ValueError(f"config_overrides[{key}]: optimizer must be a name, got {value!r}")
                settings["algorithm"] = core_algorithm(value, config.decoupled_weight_decay)
            else:
                settings[name] = value
        rules.append(Rule(key.to_matcher(), why=_describe(key), **settings))
    return rules


def _describe(key: ParamKey) -> str:
    parts = [f"{f}={getattr(key, f)!r}" for f in ("name", "attr") if getattr(key, f)]
    for f in ("predicate", "with_name_predicate"):
        value = getattr(key, f)
        if value:
            names = [value.name] if not isinstance(value, tuple) else [p.name for p in value]
            parts.append(f"{f}={names}")
    return f"ParamKey({', '.join(parts)})"
