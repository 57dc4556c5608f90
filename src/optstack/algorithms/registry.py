"""The algorithm registry: optimizer classes by name, and plug-in of any ``torch.optim.Optimizer`` subclass.

Built-in names: ``adamw`` (decoupled weight decay), ``adam`` (L2 weight decay added to the gradient, as
``torch.optim.Adam``), ``sgd``, ``lion``, ``muon``. Any other optimizer class is usable by name as
``"torch.optim.<Class>"`` (e.g. ``"torch.optim.RMSprop"``) or ``"package.module:Class"``.

``muon`` is registered by import path and imported on first lookup, so the registry (and ``adamw`` etc.)
work without importing Muon's Newton-Schulz machinery.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import torch

__all__ = ["AlgorithmSpec", "Family", "algorithm_names", "get_algorithm", "register"]

Family = Literal["adam", "sgd", "lion", "muon", "other"]
_FAMILIES: tuple[str, ...] = ("adam", "sgd", "lion", "muon", "other")
# Families with a host (CPU) kernel fast enough to run offloaded optimizer state.
_OFFLOADABLE_FAMILIES: tuple[str, ...] = ("adam", "sgd")


@dataclass(frozen=True)
class AlgorithmSpec:
    """How to build one algorithm.

    Attributes:
        name: the registry name (or the plug-in string it was looked up by).
        cls: the ``torch.optim.Optimizer`` subclass; build with ``cls(params, **defaults, **kwargs)``.
        family: what kind of update it is (the factory and MuP rules use it).
        defaults: constructor kwargs fixed by the name (e.g. ``adam`` -> ``{"decoupled": False}``).
        offloadable: it has a host kernel, so its state and step can be offloaded to CPU.
    """

    name: str
    cls: type[torch.optim.Optimizer]
    family: Family
    defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    offloadable: bool = False


@dataclass(frozen=True)
class _Entry:
    target: type[torch.optim.Optimizer] | str  # a class, or "module:Class" imported on first lookup
    family: Family
    defaults: Mapping[str, Any]
    offloadable: bool


_REGISTRY: dict[str, _Entry] = {}


def register(
    name: str,
    cls: type[torch.optim.Optimizer] | str,
    *,
    family: Family,
    defaults: Mapping[str, Any] | None = None,
    offloadable: bool | None = None,
) -> None:
    """Register an algorithm under ``name``.

    Args:
        name: the lookup name; must be new and not look like a plug-in string (no ``:``, no ``torch.optim.``).
        cls: an Optimizer subclass, or ``"package.module:Class"`` to import on first lookup.
        family: "adam", "sgd", "lion", "muon" or "other".
        defaults: constructor kwargs fixed by this name.
        offloadable: has a host kernel; default: True for the adam and sgd families.
    """
    if not name or ":" in name or name.startswith("torch.optim."):
        raise ValueError(f"register: name must be plain (no ':', no 'torch.optim.' prefix), got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"register: algorithm {name!r} is already registered; pick another name")
    if family not in _FAMILIES:
        raise ValueError(f"register: family must be one of {', '.join(_FAMILIES)}, got {family!r}")
    if isinstance(cls, str):
        if cls.count(":") != 1:
            raise ValueError(f"register: a lazy class must be given as 'package.module:Class', got {cls!r}")
    else:
        _check_optimizer_class(name, cls)
    _REGISTRY[name] = _Entry(
        target=cls,
        family=family,
        defaults=MappingProxyType(dict(defaults or {})),
        offloadable=family in _OFFLOADABLE_FAMILIES if offloadable is None else offloadable,
    )


def algorithm_names() -> list[str]:
    """The registered names, sorted."""
    return sorted(_REGISTRY)


def get_algorithm(name: str) -> AlgorithmSpec:
    """The spec for a registered name, ``"torch.optim.<Class>"`` or ``"package.module:Class"``.

    Raises:
        ValueError: unknown name (the message lists the known names and the plug-in forms), a plug-in that
            cannot be imported, or a class that is not a ``torch.optim.Optimizer`` subclass.
    """
    entry = _REGISTRY.get(name)
    if entry is not None:
        cls = _import_class(name, entry.target) if isinstance(entry.target, str) else entry.target
        return AlgorithmSpec(name, cls, entry.family, entry.defaults, entry.offloadable)
    if name.startswith("torch.optim.") and ":" not in name:
        target = "torch.optim:" + name.removeprefix("torch.optim.")
        return AlgorithmSpec(name, _import_class(name, target), "other")
    if name.count(":") == 1:
        return AlgorithmSpec(name, _import_class(name, name), "other")
    raise ValueError(
        f"unknown algorithm {name!r}. Known: {', '.join(algorithm_names())}. Or plug in any "
        "torch.optim.Optimizer subclass as 'torch.optim.<Class>' (e.g. 'torch.optim.RMSprop') or "
        "'package.module:Class'."
    )


def _import_class(name: str, target: str) -> type[torch.optim.Optimizer]:
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"algorithm {name!r}: cannot import module {module_name!r}: {error}") from error
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(f"algorithm {name!r}: module {module_name!r} has no attribute {class_name!r}")
    _check_optimizer_class(name, cls)
    return cls


def _check_optimizer_class(name: str, cls: object) -> None:
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"algorithm {name!r}: {cls!r} is not a torch.optim.Optimizer subclass")


def _register_builtins() -> None:
    from optstack.algorithms.adamw import AdamW
    from optstack.algorithms.lion import Lion
    from optstack.algorithms.sgd import SGD

    register("adamw", AdamW, family="adam", defaults={"decoupled": True})
    register("adam", AdamW, family="adam", defaults={"decoupled": False})
    register("sgd", SGD, family="sgd")
    register("lion", Lion, family="lion")
    register("muon", "optstack.algorithms.muon:Muon", family="muon")


_register_builtins()
