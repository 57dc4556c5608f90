"""``type_ok``: whether a config value is of its field's annotated type, strictly (``bool("false")`` is True, so
a bool field takes only bools). Shared by the configs that check annotations (the Megatron face, the demo)."""

from __future__ import annotations

import collections.abc
import math
import types
import typing
from typing import Any, Literal

import torch

__all__ = ["type_ok"]


def type_ok(value: Any, hint: Any, *, inf_allowed: bool = True) -> bool:
    """Whether ``value`` is of the annotated type ``hint``: a bool only for bool, an int (never a bool) for int,
    an int or float but no NaN for float (nor inf unless ``inf_allowed``), a str, a torch.dtype, a callable, one
    of a Literal's values; a union takes any of its members. A type it does not know is left to the field's own
    check (True)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return value in typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(type_ok(value, arg, inf_allowed=inf_allowed) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return (isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)
                and (inf_allowed or math.isfinite(value)))
    if hint in (str, torch.dtype):
        return isinstance(value, hint)
    if hint is collections.abc.Callable or origin is collections.abc.Callable:
        return callable(value)
    return True
