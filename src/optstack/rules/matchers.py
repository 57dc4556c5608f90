"""Parameter matchers: immutable predicates over ``(param, name)`` that compose with ``&``, ``|``, ``~``.

A matcher is a value: equal matchers compare and hash equal, and ``repr`` reads like the expression that
built it (``Name('*.bias') | Ndim(lt=2)``), so rules can be printed, compared and deduplicated.
Re-exported by ``optstack.rules``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "Matcher", "And", "Or", "Not", "Name", "Attr", "Ndim", "Shape", "Predicate", "NamedPredicate",
    "Always", "Never",
]


class Matcher:
    """Base class: ``matcher(param, name) -> bool``; ``a & b``, ``a | b`` and ``~a`` build new matchers."""

    __slots__ = ()

    def __call__(self, param: torch.Tensor, name: str) -> bool:
        raise NotImplementedError

    def __and__(self, other: Matcher) -> Matcher:
        _check_operand("&", other)
        return And(*_flatten(And, self), *_flatten(And, other))

    def __or__(self, other: Matcher) -> Matcher:
        _check_operand("|", other)
        return Or(*_flatten(Or, self), *_flatten(Or, other))

    def __invert__(self) -> Matcher:
        return Not(self)


def _check_operand(op: str, other: Any) -> None:
    if not isinstance(other, Matcher):
        raise ValueError(f"cannot combine a Matcher with {other!r} using {op!r}; both sides must be Matchers")


def _flatten(kind: type, m: Matcher) -> tuple[Matcher, ...]:
    # (a | b) | c is stored as Or(a, b, c): shorter reprs, and equal expressions compare equal.
    return m.parts if type(m) is kind else (m,)  # type: ignore[attr-defined]


def _strings(kind: str, values: tuple[Any, ...]) -> tuple[str, ...]:
    if not values or not all(isinstance(v, str) and v for v in values):
        raise ValueError(f"{kind}(...) needs one or more non-empty strings, got {values!r}")
    return values


@dataclass(frozen=True, init=False, repr=False)
class And(Matcher):
    """All parts match."""

    parts: tuple[Matcher, ...]

    def __init__(self, *parts: Matcher) -> None:
        for p in parts:
            _check_operand("&", p)
        object.__setattr__(self, "parts", parts)

    def __call__(self, param: torch.Tensor, name: str) -> bool:
        return all(p(param, name) for p in self.parts)

    def __repr__(self) -> str:
        return " & ".join(f"({p!r})" if isinstance(p, Or) else repr(p) for p in self.parts) or "Always()"


@dataclass(frozen=True, init=False, repr=False)
class Or(Matcher):
    """Any part matches."""

    parts: tuple[Matcher, ...]

    def __init__(self, *parts: Matcher) -> None:
        for p in parts:
            _check_operand("|", p)
        object.__setattr__(self, "parts", parts)

    def __call__(self, param: torch.Tensor, name: str) -> bool:
        return any(p(param, name) for p in self.parts)

    def __repr__(self) -> str:
        return " | ".join(repr(p) for p in self.parts) or "Never()"


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
        return f"~({self.inner!r})" if isinstance(self.inner, And | Or) else f"~{self.inner!r}"


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
        return f"Name({', '.join(map(repr, self.globs))})"


@dataclass(frozen=True, init=False, repr=False)
class Attr(Matcher):
    """Any of the attributes is present and truthy on the tensor (``getattr(p, a, False)``)."""

    attrs: tuple[str, ...]

    def __init__(self, *attrs: str) -> None:
        object.__setattr__(self, "attrs", _strings("Attr", attrs))

    def __call__(self, param: torch.Tensor, name: str) -> bool:
        return any(bool(getattr(param, a, False)) for a in self.attrs)

    def __repr__(self) -> str:
        return f"Attr({', '.join(map(repr, self.attrs))})"


_NDIM_OPS: dict[str, Callable[[int, int], bool]] = {
    "eq": lambda n, v: n == v,
    "lt": lambda n, v: n < v,
    "le": lambda n, v: n <= v,
    "gt": lambda n, v: n > v,
    "ge": lambda n, v: n >= v,
}


@dataclass(frozen=True, init=False, repr=False)
class Ndim(Matcher):
    """``param.dim()`` satisfies every given bound: ``Ndim(eq=2)``, ``Ndim(lt=2)``, ``Ndim(ge=1, le=3)``."""

    bounds: tuple[tuple[str, int], ...]

    def __init__(
        self,
        *,
        eq: int | None = None,
        lt: int | None = None,
        le: int | None = None,
        gt: int | None = None,
        ge: int | None = None,
    ) -> None:
        given = {"eq": eq, "lt": lt, "le": le, "gt": gt, "ge": ge}
        bounds = tuple((k, v) for k, v in given.items() if v is not None)
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
        return f"Shape({', '.join(map(str, self.shape))})"


def _check_fn(kind: str, fn: Any, label: Any) -> None:
    if not callable(fn):
        raise ValueError(f"{kind} needs a callable, got {fn!r}")
    if not isinstance(label, str) or not label:
        raise ValueError(f"{kind} needs a non-empty label string naming what it tests, got {label!r}")


@dataclass(frozen=True, repr=False)
class Predicate(Matcher):
    """``fn(param)`` is truthy. ``label`` names the test in reprs and tables."""

    fn: Callable[[torch.Tensor], Any]
    label: str

    def __post_init__(self) -> None:
        _check_fn("Predicate", self.fn, self.label)

    def __call__(self, param: torch.Tensor, name: str) -> bool:
        return bool(self.fn(param))

    def __repr__(self) -> str:
        return f"Predicate({self.label!r})"


@dataclass(frozen=True, repr=False)
class NamedPredicate(Matcher):
    """``fn(param, name)`` is truthy. ``label`` names the test in reprs and tables."""

    fn: Callable[[torch.Tensor, str], Any]
    label: str

    def __post_init__(self) -> None:
        _check_fn("NamedPredicate", self.fn, self.label)

    def __call__(self, param: torch.Tensor, name: str) -> bool:
        return bool(self.fn(param, name))

    def __repr__(self) -> str:
        return f"NamedPredicate({self.label!r})"


@dataclass(frozen=True, repr=False)
class Always(Matcher):
    """Matches every parameter."""

    def __call__(self, param: torch.Tensor, name: str) -> bool:
        return True

    def __repr__(self) -> str:
        return "Always()"


@dataclass(frozen=True, repr=False)
class Never(Matcher):
    """Matches no parameter."""

    def __call__(self, param: torch.Tensor, name: str) -> bool:
        return False

    def __repr__(self) -> str:
        return "Never()"
