"""Rules and their merge: ``Rule`` (a matcher, settings and a reason), ``resolve`` and ``explain``.

Parameters are named by ``optstack.names.named_parameters`` (modules, model chunks, pairs or tensors).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from optstack.algorithms.registry import check_name
from optstack.names import NamedParams, look_through, named_parameters
from optstack.rules.matchers import Matcher, uses_name

__all__ = [
    "Rule", "Resolved", "Explanation", "resolve", "explain", "format_explain", "named_parameters_of", "LR_KEYS",
    "PROTECTED_KEYS", "check_names_available",
]

#: Keys that change the learning rate schedule of a group (a group with none of them is "default_config").
LR_KEYS = frozenset({"max_lr", "min_lr", "lr_mult"})
#: Keys the group builder owns; a rule may not set them.
PROTECTED_KEYS = frozenset({"params", "param_names", "is_expert_parallel", "default_config"})
# Non-negative finite numbers; stored as float so that 0 and 0.0 are one value (one group).
_NUMERIC_KEYS = frozenset({"max_lr", "min_lr", "lr_mult", "wd_mult", "start_wd", "end_wd"})
# Names that look like settings but would be silently overwritten or are aliases: say what to use instead.
_REDIRECTED_KEYS = {
    "lr": "the scheduler writes 'lr' every step; set max_lr / min_lr (absolute) or lr_mult (relative)",
    "weight_decay": "the scheduler writes 'weight_decay' every step; set wd_mult, or start_wd / end_wd",
    "optimizer": "the core calls it 'algorithm', e.g. algorithm='adamw'",
}
# Plain, picklable values with a stable repr: group keys travel between ranks and sort by repr.
_PLAIN_TYPES = (type(None), bool, int, float, str, torch.dtype)


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def nonnegative(field: str, value: Any, where: str = "") -> float:
    """``value`` as a float when it is a finite number >= 0, else a ``ValueError`` naming ``where`` and ``field``."""
    if not is_number(value) or value < 0:
        raise ValueError(f"{where}{field} must be a finite number >= 0, got {value!r}")
    return float(value)


def _canonical_value(where: str, key: str, value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_canonical_value(where, key, v) for v in value)
    if not isinstance(value, _PLAIN_TYPES):
        raise ValueError(
            f"{where}: setting {key}={value!r} has type {type(value).__name__}; settings must be None, "
            "bool, int, float, str, torch.dtype or tuples/lists of those (they are compared, sorted and sent "
            "between ranks)"
        )
    if isinstance(value, float) and math.isnan(value):
        raise ValueError(f"{where}: setting {key}=nan is not allowed (nan never equals itself)")
    return value


def _validate_setting(where: str, key: str, value: Any) -> Any:
    if not isinstance(key, str) or not key.isidentifier():
        raise ValueError(f"{where}: setting name {key!r} must be a Python identifier")
    if key in PROTECTED_KEYS:
        raise ValueError(
            f"{where}: {key!r} is set by the group builder and cannot be overridden by a rule; "
            f"protected keys are {sorted(PROTECTED_KEYS)}"
        )
    if key in _REDIRECTED_KEYS:
        raise ValueError(f"{where}: a rule cannot set {key!r}: {_REDIRECTED_KEYS[key]}")
    if key in _NUMERIC_KEYS:
        return nonnegative(key, value, f"{where}: ")
    if key == "algorithm":
        check_name("algorithm", value, f"{where}: ")
    return _canonical_value(where, key, value)


@dataclass(frozen=True, init=False)
class Rule:
    """A matcher, the settings it applies to matching parameters, and why. Immutable, hashable, picklable.

    Args:
        matcher: which parameters the rule applies to.
        why: a short reason, shown by ``explain`` and in conflict errors (default: the matcher's repr).
        **settings: ``max_lr``, ``min_lr``, ``lr_mult``, ``wd_mult``, ``start_wd``, ``end_wd`` (finite, >= 0),
            ``algorithm`` (optimizer name) and any algorithm hyperparameter (``eps``, ``betas``, ...). Lists
            become tuples. ``params``, ``param_names``, ``is_expert_parallel`` and ``default_config`` are
            protected.

    Raises:
        ValueError: on a protected or redirected key, a bad number or an unhashable value.
    """

    matcher: Matcher
    _items: tuple[tuple[str, Any], ...]
    why: str

    def __init__(self, matcher: Matcher, *, why: str = "", **settings: Any) -> None:
        if not isinstance(matcher, Matcher):
            raise ValueError(
                f"Rule needs a Matcher (Name, Attr, Ndim, Shape, Predicate, ...), got {matcher!r}; "
                "e.g. Rule(Name('*.bias'), wd_mult=0.0)"
            )
        if not isinstance(why, str):
            raise ValueError(f"Rule why= must be a string, got {why!r}")
        where = f"Rule({matcher!r}{', why=' + repr(why) if why else ''})"
        object.__setattr__(self, "matcher", matcher)
        object.__setattr__(self, "_items", tuple(sorted((k, _validate_setting(where, k, v))
                                                        for k, v in settings.items())))
        object.__setattr__(self, "why", why)

    @property
    def settings(self) -> Mapping[str, Any]:
        """The settings, read-only, sorted by key."""
        return MappingProxyType(dict(self._items))

    @property
    def label(self) -> str:
        """How the rule is named in tables and errors: its reason, else its matcher."""
        return self.why or repr(self.matcher)

    def __repr__(self) -> str:
        parts = [repr(self.matcher)] + [f"{k}={v!r}" for k, v in self._items]
        return f"Rule({', '.join(parts + ([f'why={self.why!r}'] if self.why else []))})"


def named_parameters_of(source: NamedParams) -> list[tuple[str, torch.Tensor]]:
    """Every parameter of ``source``, frozen ones included: ``named_parameters(source, trainable_only=False)``."""
    return named_parameters(source, trainable_only=False)


def check_names_available(source: NamedParams, rules: Sequence[Rule], *, exempt: Sequence[Rule] = ()) -> None:
    """Refuse rules that match by ``Name`` when ``source`` is bare tensors (``model.parameters()``), named only
    ``param.0``, ``param.1``, ... by position; ``exempt`` rules (the defaults, whose ``Name`` parts have ``Ndim``
    twins) pass.

    Raises:
        ValueError: naming every such rule and what to pass instead.
    """
    items = [] if isinstance(source, torch.nn.Module) else list(source)
    if not items or not all(isinstance(t, torch.Tensor) for t in items):
        return
    by_name = [r.label for r in rules if isinstance(r, Rule) and r not in exempt and uses_name(r.matcher)]
    if by_name:
        raise ValueError(
            f"rule(s) {by_name} match parameters by Name, but the parameters were given bare (model.parameters()), "
            "so their only names are param.0, param.1, ... by position; pass the model or model.named_parameters() "
            "instead")


@dataclass(frozen=True)
class Resolved:
    """One trainable parameter's merged settings.

    Attributes:
        name: the parameter's name.
        settings: merged settings, sorted by key (empty when no rule matched).
        sources: for each key, the rules that set it (several when they agree), in rule order.
        is_expert: an expert-parallel parameter (Megatron's ``allreduce=False``: not reduced over full DP).
        shape: the parameter's shape.
    """

    name: str
    settings: Mapping[str, Any]
    sources: Mapping[str, tuple[Rule, ...]]
    is_expert: bool
    shape: tuple[int, ...] = ()


def resolve(named_params: NamedParams, rules: Sequence[Rule], *, strict: bool = False,
            trainable_only: bool = True) -> dict[str, Resolved]:
    """Merge every matching rule into each trainable parameter's settings: ``{name: Resolved}`` in model order.

    Args:
        named_params: a module, model chunks, ``(name, tensor)`` pairs or tensors; frozen ones are skipped.
        rules: the rules; all that match a parameter apply.
        strict: raise when a rule matches no trainable parameter (catches typos in globs).
        trainable_only: skip frozen parameters (False: resolve them too, for an optimizer that keeps them).

    Raises:
        ValueError: when two rules set one key of one parameter to different values (naming the parameter,
            both rules and both values), or, with ``strict``, when a rule matches nothing.
    """
    rules = list(rules)
    for r in rules:
        if not isinstance(r, Rule):
            raise ValueError(f"rules must be Rule objects, got {r!r}; e.g. Rule(Name('*.bias'), wd_mult=0.0)")
    source = named_params if isinstance(named_params, torch.nn.Module) else list(named_params)  # read once
    named = named_parameters(source, trainable_only=trainable_only)
    aliases = tied_aliases(source, named)
    unused = dict.fromkeys(range(len(rules)))
    out: dict[str, Resolved] = {}
    for name, param in named:
        settings: dict[str, Any] = {}
        sources: dict[str, list[Rule]] = {}
        for i, rule in enumerate(rules):
            if not any(rule.matcher(param, n) for n in (name, *aliases.get(name, ()))):
                continue
            unused.pop(i, None)
            for key, value in rule._items:
                if key in settings and settings[key] != value:
                    raise ValueError(
                        f"conflicting rules for parameter {name!r}: rule {sources[key][0].label!r} sets "
                        f"{key}={settings[key]!r} but rule {rule.label!r} sets {key}={value!r}. "
                        "Make their matchers disjoint (e.g. add '& ~...') or give both the same value."
                    )
                settings[key] = value
                sources.setdefault(key, []).append(rule)
        out[name] = Resolved(
            name=name,
            settings=MappingProxyType(dict(sorted(settings.items()))),
            sources=MappingProxyType({k: tuple(sources[k]) for k in sorted(sources)}),
            is_expert=not getattr(param, "allreduce", True),
            shape=tuple(param.shape),
        )
    if strict and unused:
        raise ValueError(
            f"strict=True: rule(s) {[rules[i].label for i in unused]} match no trainable parameter; check the "
            "globs/attributes against the model's named_parameters(), or drop the rule, or pass strict=False"
        )
    return out


def tied_aliases(source: NamedParams, named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, tuple[str, ...]]:
    """A tied parameter's other names (``lm_head.weight`` for an embedding it shares), keyed by the name
    ``named_parameters`` keeps (the first): a rule naming any of them applies to the one shared tensor. Only
    modules and model chunks have aliases; names follow ``named_parameters`` (``_orig_mod`` dropped, ``chunk{i}.``
    when it prefixes)."""
    chunks = [source] if isinstance(source, torch.nn.Module) else list(source)  # type: ignore[arg-type]
    if not chunks or not all(isinstance(m, torch.nn.Module) for m in chunks):
        return {}
    kept = {id(p): n for n, p in named}
    prefixed = len(chunks) > 1 and all(n.startswith("chunk") for n in kept.values())
    out: dict[str, list[str]] = {}
    for i, chunk in enumerate(chunks):
        for n, p in look_through(chunk).named_parameters(remove_duplicate=False):
            alias = ".".join(part for part in n.split(".") if part != "_orig_mod")
            alias = f"chunk{i}.{alias}" if prefixed else alias
            first = kept.get(id(p))
            if first is not None and alias != first and alias not in out.get(first, ()):
                out.setdefault(first, []).append(alias)
    return {n: tuple(a) for n, a in out.items()}


@dataclass(frozen=True)
class Explanation:
    """What one parameter gets and why: ``Resolved`` with each setting's rules given by their labels."""

    settings: Mapping[str, Any]
    sources: Mapping[str, tuple[str, ...]]
    is_expert: bool
    shape: tuple[int, ...]


def explain(model_or_named_params: NamedParams, rules: Sequence[Rule], **kw: Any) -> dict[str, Explanation]:
    """For each trainable parameter, its final settings and the rules that set each one (by label).

    ``model_or_named_params``, ``rules`` and ``**kw`` (``strict``) are as for ``resolve``.
    """
    return {
        name: Explanation(r.settings, MappingProxyType({k: tuple(rule.label for rule in rs)
                                                        for k, rs in r.sources.items()}), r.is_expert, r.shape)
        for name, r in resolve(model_or_named_params, rules, **kw).items()
    }


def format_explain(explanations: Mapping[str, Explanation]) -> str:
    """A plain-text table: parameter, shape, expert flag, settings, and which rule set what."""
    header = ("parameter", "shape", "expert", "settings", "set by")
    rows = [header]
    for name, e in explanations.items():
        settings = ", ".join(f"{k}={v!r}" for k, v in e.settings.items()) or "-"
        by_rules: dict[tuple[str, ...], list[str]] = {}
        for key, labels in e.sources.items():
            by_rules.setdefault(labels, []).append(key)
        set_by = "; ".join(f"{','.join(keys)} <- {' + '.join(labels)}" for labels, keys in by_rules.items())
        shape = "x".join(map(str, e.shape)) or "scalar"
        rows.append((name, shape, "yes" if e.is_expert else "no", settings, set_by or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    lines = ["  ".join([c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)] + [r[-1]]) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * len(header[-1]))
    return "\n".join(line.rstrip() for line in lines)
