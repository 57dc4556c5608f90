"""Models named on the command line: ``package.module:factory`` -> the module it builds."""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

from torch import nn

__all__ = ["load_model"]


def load_model(spec: str) -> nn.Module:
    """Build a model from ``'package.module:factory'`` (the factory is called with no arguments)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", module_name) \
            or not re.fullmatch(r"[A-Za-z_]\w*", attr):
        raise ValueError(f"--model must look like package.module:factory (an importable module, a colon, then "
                         f"the name of a function in it), got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"--model {spec!r}: cannot import {module_name!r} ({error})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {module_name!r} has no callable {attr!r}")
    _check_no_arguments_needed(spec, factory)
    model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {spec!r}: the factory returned {type(model).__name__}, not an nn.Module")
    return model


def _check_no_arguments_needed(spec: str, factory: Any) -> None:
    # Checked before the call: a TypeError from inside the factory is the user's own bug and keeps its traceback.
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # some builtins have no signature: let the call decide
        return
    required = [name for name, p in signature.parameters.items() if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if required:
        raise ValueError(
            f"--model {spec!r}: the factory must be callable with no arguments, but it needs {', '.join(required)}; "
            f"wrap it in a function of your own module, e.g. def build(): return {spec.partition(':')[2]}(...), "
            "and pass --model your_module:build")
