"""Parameter matchers: immutable predicates over ``(param, name)`` that compose with ``&``, ``|``, ``~``.

A matcher is a value: equal matchers compare and hash equal, and ``repr`` reads like the expression that
built it (``Name('*.bias') | Ndim(lt=2)``), so rules can be printed, compared and deduplicated.
"""

from __future__ import annotations

import fnmatch
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

__all__ = [
    "Matcher", "And", "Or", "Not", "Name", "Attr", "Ndim", "Shape", "Predicate", "NamedPredicate",
    "Always", "Never", "uses_name",
]


class Matcher:
    """Base class: ``matcher(param, name) -> bool``; ``a & b``, ``a | b`` and ``~a`` build new matchers."""

    __slots__ = ()

    def __call__(self, param: torch.Tensor, name: str) -> bool:
        raise NotImplementedError

    # (a | b) | c is stored as Or(a, b, c): shorter reprs, and equal expressions compare equal.
    def __and__(self, other: Matcher) -> Matcher:
        return And(*_flatten(And, self), *_flatten(And, other))

    def __or__(self, other: Matcher) -> Matcher:
        return Or(*_flatten(Or, self), *_flatten(Or, other))

    def __invert__(self) -> Matcher:
        return Not(self)


def _flatten(kind: type, m: Any) -> tuple[Any, ...]:
    return m.parts if type(m) is kind else (m,)


def _check_operand(op: str, other: Any) -> None:
    if not isinstance(other, Matcher):
        raise ValueError(f"cannot combine a Matcher with {other!r} using {op!r}; both sides must be Matchers")


def _strings(kind: str, values: tuple[Any, ...]) -> tuple[str, ...]:
    if not values or not all(isinstance(v, str) and v for v in values):
        raise ValueError(f"{kind}(...) needs one or more non-empty strings, got {values!r}")
    return values


def _call_repr(kind: str, args: tuple[Any, ...]) -> str:
    return f"{kind}({', '.join(map(repr, args))})"


@dataclass(frozen=True, init=False, repr=False)
class _Parts(Matcher):
    """Base of ``And`` and ``Or``: ``combine`` (all / any) of the parts' results."""

    parts: tuple[Matcher, ...]
    op: ClassVar[str]
    empty: ClassVar[str]  # the repr of no parts
    combine: ClassVar[Callable[[Iterable[bool]], bool]]

    def __init__(self, *parts: Matcher) -> None:
        for p in parts:
            _check_operand(self.op, p)
        object.__setattr__(self, "parts", parts)

    def __call__(self, param: torch.Tensor, name: str) -> bool:
        return self.combine(p(param, name) for p in self.parts)

    def __repr__(self) -> str:
        texts = (f"({p!r})" if isinstance(self, And) and isinstance(p, Or) else repr(p) for p in self.parts)
        return f" {self.op} ".join(texts) or self.empty


class And(_Parts):
    """All parts match."""

    op, empty, combine = "&", "Always()", all


class Or(_Parts):
    """Any part matches."""

    op, empty, combine = "|", "Never()", any


@dataclass(frozen=True, repr=False)
class Not(Matcher):
    """The inner matcher does not match."""

    inner: Matcher

    def __post_init__(self) -> None:
        _check_operand("~", self.inner)

    def __call__(self, param: torch.Tensor, name: str) -> bool:
        return not self.inner(param, name)

    def __invert__(self) -> Matcher:
        return self.inner

    def __repr__(self) -> str:
        return f"~({self.inner!r})" if isinstance(self.inner, _Parts) else f"~{self.inner!r}"


@dataclass(frozen=True, init=False, repr=False)
class Name(Matcher):
    """The ``named_parameters`` name matches any glob (``fnmatch.fnmatchcase``: ``*``, ``?``, ``[ab]``).

    ``Name('*.bias')`` matches ``layer.bias`` but not ``layer.bias_scale``; ``'*'`` crosses dots.
    """

    globs: tuple[str, ...]

    def __init__(self, *globs: str) -> None:
        object.__setattr__(self, "globs", _strings("Name", globs))

    def __call__(self, param: torch.Tensor, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, g) for g in self.globs)

    def __repr__(self) -> str:
        return _call_repr("Name", self.globs)


@dataclass(frozen=True, init=False, repr=False)
class Attr(Matcher):
    """Any of the attributes is present and truthy on the tensor (``getattr(p, a, False)``)."""

    attrs: tuple[str, ...]

    def __init__(self, *attrs: str) -> None:
        object.__setattr__(self, "attrs", _strings("Attr", attrs))

    def __call__(self, param: torch.Tensor, name: str) -> bool:
        return any(bool(getattr(param, a, False)) for a in self.attrs)

    def __repr__(self) -> str:
        return _call_repr("Attr", self.attrs)


_NDIM_OPS: dict[str, Callable[[int, int], bool]] = {
    "eq": operator.eq, "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
}


@dataclass(frozen=True, init=False, repr=False)
class Ndim(Matcher):
    """``param.dim()`` satisfies every given bound: ``Ndim(eq=2)``, ``Ndim(lt=2)``, ``Ndim(ge=1, le=3)``."""

    bounds: tuple[tuple[str, int], ...]

    def __init__(self, *, eq: int | None = None, lt: int | None = None, le: int | None = None,
                 gt: int | None = None, ge: int | None = None) -> None:
        bounds = tuple((k, v) for k, v in zip(_NDIM_OPS, (eq, lt, le, gt, ge), strict=True) if v is not None)
        if not bounds:
            raise ValueError("Ndim() needs at least one of eq, lt, le, gt, ge, e.g. Ndim(eq=2)")
        for k, v in bounds:
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"Ndim({k}=...) must be an int, got {v!r}")
        object.__setattr__(self, "bounds", bounds)

    def __call__(self, param: torch.Tensor, name: str) -> bool:
        return all(_NDIM_OPS[k](param.dim(), v) for k, v in self.bounds)

    def __repr__(self) -> str:
        return f"Ndim({', '.join(f'{k}={v}' for k, v in self.bounds)})"


@dataclass(frozen=True, init=False, repr=False)
class Shape(Matcher):
    """The tensor's shape is exactly ``shape``: ``Shape(4, 8)``; ``Shape()`` matches scalars."""

    shape: tuple[int, ...]

    def __init__(self, *shape: int) -> None:
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shape):
            raise ValueError(f"Shape(...) needs non-negative ints, got {shape!r}")
        object.__setattr__(self, "shape", tuple(shape))

    def __call__(self, param: torch.Tensor, name: str) -> bool:
        return tuple(param.shape) == self.shape

    def __repr__(self) -> str:
        return _call_repr("Shape", self.shape)


@dataclass(frozen=True, repr=False)
class _Labelled(Matcher):
    """Base of ``Predicate`` and ``NamedPredicate``: a callable and the label naming it in reprs and tables."""

    fn: Callable[..., Any]
    label: str

    def __post_init__(self) -> None:
        kind = type(self).__name__
        if not callable(self.fn):
            raise ValueError(f"{kind} needs a callable, got {self.fn!r}")
        if not isinstance(self.label, str) or not self.label:
            raise ValueError(f"{kind} needs a non-empty label string naming what it tests, got {self.label!r}")

    def __repr__(self) -> str:
        return _call_repr(type(self).__name__, (self.label,))


class Predicate(_Labelled):
    """``fn(param)`` is truthy. ``label`` names the test in reprs and tables."""

    def __call__(self, param: torch.Tensor, name: str) -> bool:
        return bool(self.fn(param))


class NamedPredicate(_Labelled):
    """``fn(param, name)`` is truthy. ``label`` names the test in reprs and tables."""

    def __call__(self, param: torch.Tensor, name: str) -> bool:
        return bool(self.fn(param, name))


@dataclass(frozen=True)
class Always(Matcher):
    """Matches every parameter."""

    def __call__(self, param: torch.Tensor, name: str) -> bool:
        return True


@dataclass(frozen=True)
class Never(Matcher):
    """Matches no parameter."""

    def __call__(self, param: torch.Tensor, name: str) -> bool:
        return False


def uses_name(matcher: Matcher) -> bool:
    """Whether ``matcher`` tests parameter names through a ``Name``, anywhere inside ``&``, ``|``, ``~``."""
    if isinstance(matcher, Name):
        return True
    if isinstance(matcher, _Parts):
        return any(uses_name(p) for p in matcher.parts)
    return isinstance(matcher, Not) and uses_name(matcher.inner)
