"""The algorithm registry: optimizer classes by name, and plug-in of any ``torch.optim.Optimizer`` subclass.

Built-in names: ``adamw`` (decoupled weight decay), ``adam`` (L2 weight decay added to the gradient, as
``torch.optim.Adam``), ``sgd``, ``lion``, ``muon``. Any other optimizer class is usable by name as
``"torch.optim.<Class>"`` (e.g. ``"torch.optim.RMSprop"``) or ``"package.module:Class"``.

Each name also says how its constructor kwargs come from an ``optstack.config.OptimizerConfig``: the base
``lr`` and ``weight_decay`` for every algorithm, plus what the algorithm's own ``kwargs_from_config`` (in its
module, next to the class) reads from its config section. A plug-in class gets only ``lr`` and
``weight_decay``. Adding an optimizer is a file and a ``register`` line.

``muon`` (class and kwargs function) is registered by import path and imported on first lookup, so the
registry (and ``adamw`` etc.) work without importing Muon's Newton-Schulz machinery.

The config is typed ``Any`` here: ``optstack.config`` builds on this registry (its combination check asks
which algorithms are offloadable), so the registry and the algorithms must not import it back.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import torch

__all__ = ["AlgorithmSpec", "Family", "KwargsFromConfig", "algorithm_names", "get_algorithm", "register"]

Family = Literal["adam", "sgd", "lion", "muon", "other"]
_FAMILIES: tuple[str, ...] = ("adam", "sgd", "lion", "muon", "other")
# Families with a host (CPU) kernel fast enough to run offloaded optimizer state.
_OFFLOADABLE_FAMILIES: tuple[str, ...] = ("adam", "sgd")

#: An algorithm's own constructor kwargs from an ``OptimizerConfig`` (read from its section, e.g. ``config.adam``).
KwargsFromConfig = Callable[[Any], Mapping[str, Any]]


@dataclass(frozen=True)
class AlgorithmSpec:
    """How to build one algorithm.

    Attributes:
        name: the registry name (or the plug-in string it was looked up by).
        cls: the ``torch.optim.Optimizer`` subclass; build with ``cls(params, **defaults, **kwargs)``.
        family: what kind of update it is (the factory and MuP rules use it).
        defaults: constructor kwargs fixed by the name (e.g. ``adam`` -> ``{"decoupled": False}``).
        offloadable: it has a host kernel, so its state and step can be offloaded to CPU.
        kwargs_from_config: its own constructor kwargs from an ``OptimizerConfig`` (None: only the base ones).
    """

    name: str
    cls: type[torch.optim.Optimizer]
    family: Family
    defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    offloadable: bool = False
    kwargs_from_config: KwargsFromConfig | None = None

    def kwargs(self, config: Any) -> dict[str, Any]:
        """Constructor kwargs from an ``optstack.config.OptimizerConfig``: ``lr`` and ``weight_decay``, the
        algorithm's own (``kwargs_from_config``), then the ``defaults`` fixed by the name."""
        own = self.kwargs_from_config(config) if self.kwargs_from_config is not None else {}
        return {"lr": config.lr, "weight_decay": config.weight_decay} | dict(own) | dict(self.defaults)


@dataclass(frozen=True)
class _Entry:
    target: type[torch.optim.Optimizer] | str  # a class, or "module:Class" imported on first lookup
    family: Family
    defaults: Mapping[str, Any]
    offloadable: bool
    kwargs: KwargsFromConfig | str | None  # a function, or "module:function" imported on first lookup


_REGISTRY: dict[str, _Entry] = {}


def register(
    name: str,
    cls: type[torch.optim.Optimizer] | str,
    *,
    family: Family,
    defaults: Mapping[str, Any] | None = None,
    offloadable: bool | None = None,
    kwargs: KwargsFromConfig | str | None = None,
) -> None:
    """Register an algorithm under ``name``.

    Args:
        name: the lookup name; must be new and not look like a plug-in string (no ``:``, no ``torch.optim.``).
        cls: an Optimizer subclass, or ``"package.module:Class"`` to import on first lookup.
        family: "adam", "sgd", "lion", "muon" or "other".
        defaults: constructor kwargs fixed by this name.
        offloadable: has a host kernel; default: True for the adam and sgd families.
        kwargs: its constructor kwargs from an ``OptimizerConfig`` besides ``lr`` and ``weight_decay``
            (conventionally the ``kwargs_from_config`` of its module), or ``"package.module:function"`` to
            import on first lookup; None: only those two.
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
    if isinstance(kwargs, str):
        if kwargs.count(":") != 1:
            raise ValueError(f"register: lazy kwargs must be given as 'package.module:function', got {kwargs!r}")
    elif kwargs is not None and not callable(kwargs):
        raise ValueError(f"register: kwargs must be a function of the config, a lazy path or None, got {kwargs!r}")
    _REGISTRY[name] = _Entry(
        target=cls,
        family=family,
        defaults=MappingProxyType(dict(defaults or {})),
        offloadable=family in _OFFLOADABLE_FAMILIES if offloadable is None else offloadable,
        kwargs=kwargs,
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
        kwargs = _import_kwargs(name, entry.kwargs) if isinstance(entry.kwargs, str) else entry.kwargs
        return AlgorithmSpec(name, cls, entry.family, entry.defaults, entry.offloadable, kwargs)
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
    cls = _import_attribute(name, target)
    _check_optimizer_class(name, cls)
    return cls


def _import_kwargs(name: str, target: str) -> KwargsFromConfig:
    function = _import_attribute(name, target)
    if not callable(function):
        raise ValueError(f"algorithm {name!r}: kwargs {target!r} is not a function of the config")
    return function


def _import_attribute(name: str, target: str) -> Any:
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"algorithm {name!r}: cannot import module {module_name!r}: {error}") from error
    value = getattr(module, attribute, None)
    if value is None:
        raise ValueError(f"algorithm {name!r}: module {module_name!r} has no attribute {attribute!r}")
    return value


def _check_optimizer_class(name: str, cls: object) -> None:
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"algorithm {name!r}: {cls!r} is not a torch.optim.Optimizer subclass")


def _register_builtins() -> None:
    from optstack.algorithms import adamw, lion, sgd

    register("adamw", adamw.AdamW, family="adam", defaults={"decoupled": True}, kwargs=adamw.kwargs_from_config)
    register("adam", adamw.AdamW, family="adam", defaults={"decoupled": False}, kwargs=adamw.kwargs_from_config)
    register("sgd", sgd.SGD, family="sgd", kwargs=sgd.kwargs_from_config)
    register("lion", lion.Lion, family="lion", kwargs=lion.kwargs_from_config)
    register("muon", "optstack.algorithms.muon:Muon", family="muon",
             kwargs="optstack.algorithms.muon:kwargs_from_config")


_register_builtins()
