"""The algorithm registry: optimizer classes by name, and plug-in of any ``torch.optim.Optimizer`` subclass.

Built-in: ``adamw``, ``adam`` (L2 weight decay, as ``torch.optim.Adam``), ``sgd``, ``lion``, ``muon``, ``normuon``,
``adamuon``, ``adaptive_muon`` (its ``moment2_method`` from the config), ``soap``, ``schedule_free_adamw`` and
``schedule_free_sgd``; any other class as ``"torch.optim.<Class>"`` or ``"package.module:Class"``. Each name also
says how its constructor kwargs come from an ``OptimizerConfig``: ``lr`` and ``weight_decay``, plus what its
module's ``kwargs_from_config`` reads from its section (a plug-in gets only the two). Adding an optimizer is a file
and a ``register`` line. The matrix algorithms are registered by import path, imported on first lookup (no
Newton-Schulz import before). The config is typed ``Any``: ``optstack.config`` builds on this registry, which must
not import it back.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import torch

__all__ = ["AlgorithmSpec", "Capabilities", "Family", "KwargsFromConfig", "algorithm_names", "check_name",
           "get_algorithm", "register"]

Family = Literal["adam", "sgd", "lion", "muon", "other"]
_FAMILIES: tuple[str, ...] = ("adam", "sgd", "lion", "muon", "other")
_OFFLOADABLE_FAMILIES: tuple[str, ...] = ("adam", "sgd")  # with a host kernel fast enough for offloaded state


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What an algorithm needs of the parameters it steps; placement follows from it (``optstack.plan``).

    Attributes:
        elementwise: its state and update are per element, so any range of a flat buffer may be stepped alone
            (ZeRO-1 range shards, DTensor local shards).
        whole_matrices: it needs whole matrices (Newton-Schulz, preconditioners): under sharding, owner ranks
            step whole matrices.
        matrix_ndims: the parameter ranks it takes as matrices (2-D; 3-D stacks of matrices).
        host_kernel: it has a host kernel fast enough for offloaded state (CPU offload).
        state: its per-element state tensors, each shaped like the parameter (memory estimates).
        matrix_state: its state that is not shaped like the parameter (SOAP's square Kronecker factors and
            eigenbases): the i-th key a square fp32 matrix over side ``i % 2`` of each matrix (rows, columns).
            Only a whole-matrix algorithm may keep it (its owner holds the whole parameter), and its optimizer's
            ``exported_state`` must give it in a parameter-shaped form (pages) that name-keyed checkpoints shard
            and reshard, folding it back when stepped.
        matrix_state_max_side: the constructor kwarg (or group key) above whose value a side keeps no
            ``matrix_state`` (SOAP's ``max_precond_dim``); None: every side keeps it.
        reads_loss: its step calls the closure (reads a loss).
        swaps_weights: its optimizer has ``train()`` / ``eval()`` that swap the parameters between the sequence
            it steps and the weights to evaluate (Schedule-Free); ``ChainedOptimizer.train`` / ``eval`` forward
            them, and each stage publishes the swapped values as after a step.
    """

    elementwise: bool = True
    whole_matrices: bool = False
    matrix_ndims: tuple[int, ...] = (2, 3)
    host_kernel: bool = False
    state: tuple[str, ...] = ()
    matrix_state: tuple[str, ...] = ()
    matrix_state_max_side: str | None = None
    reads_loss: bool = False
    swaps_weights: bool = False

    def __post_init__(self) -> None:
        if self.elementwise and self.whole_matrices:
            raise ValueError("Capabilities: an algorithm is either elementwise or needs whole_matrices, not both")
        if self.matrix_state and not self.whole_matrices:
            raise ValueError(f"Capabilities: matrix_state {self.matrix_state} needs whole_matrices=True (only the "
                             "owner of a whole matrix can keep state that is not shaped like a range of it)")
        if self.matrix_state_max_side is not None and not self.matrix_state:
            raise ValueError(f"Capabilities: matrix_state_max_side={self.matrix_state_max_side!r} needs matrix_state")

    def matrix_state_numel(self, shape: Sequence[int], settings: Mapping[str, Any]) -> int:
        """Elements of the ``matrix_state`` of a parameter of ``shape`` (a matrix, or a stack of them: its last two
        dims) in a group with ``settings`` (constructor kwargs, then group keys): memory estimates."""
        if not self.matrix_state:
            return 0
        *batch, rows, cols = shape
        limit = math.inf if self.matrix_state_max_side is None else settings[self.matrix_state_max_side]
        sides = [(rows, cols)[i % 2] for i in range(len(self.matrix_state))]
        return math.prod(batch) * sum(side * side for side in sides if side <= limit)


# What each built-in family declares (a registration may pass its own).
_FAMILY_CAPABILITIES: dict[str, Capabilities] = {
    "adam": Capabilities(host_kernel=True, state=("exp_avg", "exp_avg_sq")),
    "sgd": Capabilities(host_kernel=True, state=("momentum_buffer",)),
    "lion": Capabilities(state=("exp_avg",)),
    "muon": Capabilities(elementwise=False, whole_matrices=True, state=("momentum_buffer",)),
    "other": Capabilities(),
}

#: An algorithm's own constructor kwargs from an ``OptimizerConfig`` (read from its section, e.g. ``config.adam``).
KwargsFromConfig = Callable[[Any], Mapping[str, Any]]


@dataclass(frozen=True)
class AlgorithmSpec:
    """How to build one algorithm.

    Attributes:
        name: the registry name (or the plug-in string it was looked up by).
        cls: the ``torch.optim.Optimizer`` subclass; build with ``cls(params, **defaults, **kwargs)``.
        family: what kind of update it is (MuP's rules and the precision of its gradients use it).
        defaults: constructor kwargs fixed by the name (e.g. ``adam`` -> ``{"decoupled": False}``).
        offloadable: it has a host kernel, so its state and step can be offloaded to CPU.
        kwargs_from_config: its own constructor kwargs from an ``OptimizerConfig`` (None: only the base ones).
        capabilities: what it needs of the parameters it steps (placement follows from it, ``optstack.plan``).
    """

    name: str
    cls: type[torch.optim.Optimizer]
    family: Family
    defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    offloadable: bool = False
    kwargs_from_config: KwargsFromConfig | None = None
    capabilities: Capabilities = field(default_factory=Capabilities)

    def kwargs(self, config: Any) -> dict[str, Any]:
        """Constructor kwargs from an ``OptimizerConfig``: ``lr`` and ``weight_decay``, the algorithm's own
        (``kwargs_from_config``), then the ``defaults`` fixed by the name."""
        own = self.kwargs_from_config(config) if self.kwargs_from_config is not None else {}
        return {"lr": config.lr, "weight_decay": config.weight_decay} | dict(own) | dict(self.defaults)


@dataclass(frozen=True)
class _Entry:
    target: type[torch.optim.Optimizer] | str  # a class, or "module:Class" imported on first lookup
    family: Family
    defaults: Mapping[str, Any]
    offloadable: bool
    kwargs: KwargsFromConfig | str | None  # a function, or "module:function" imported on first lookup
    capabilities: Capabilities


_REGISTRY: dict[str, _Entry] = {}


def register(name: str, cls: type[torch.optim.Optimizer] | str, *, family: Family,
             defaults: Mapping[str, Any] | None = None, offloadable: bool | None = None,
             kwargs: KwargsFromConfig | str | None = None,
             capabilities: Capabilities | None = None) -> None:
    """Register an algorithm under ``name``.

    Args:
        name: the lookup name; must be new and not look like a plug-in string (no ``:``, no ``torch.optim.``).
        cls: an Optimizer subclass, or ``"package.module:Class"`` to import on first lookup.
        family: "adam", "sgd", "lion", "muon" or "other".
        defaults: constructor kwargs fixed by this name.
        offloadable: has a host kernel; default: True for the adam and sgd families.
        kwargs: its constructor kwargs from an ``OptimizerConfig`` besides ``lr`` and ``weight_decay`` (usually
            its module's ``kwargs_from_config``), or ``"package.module:function"`` to import on first lookup.
        capabilities: what it needs of its parameters (placement follows from it); default: its family's
            (element-wise, or whole matrices for "muon"), with ``host_kernel`` = ``offloadable``.
    """
    if not name or ":" in name or name.startswith("torch.optim."):
        raise ValueError(f"register: name must be plain (no ':', no 'torch.optim.' prefix), got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"register: algorithm {name!r} is already registered; pick another name")
    if family not in _FAMILIES:
        raise ValueError(f"register: family must be one of {', '.join(_FAMILIES)}, got {family!r}")
    if isinstance(cls, str) and cls.count(":") != 1:
        raise ValueError(f"register: a lazy class must be given as 'package.module:Class', got {cls!r}")
    if not isinstance(cls, str):
        _optimizer_class(name, cls)
    if isinstance(kwargs, str) and kwargs.count(":") != 1:
        raise ValueError(f"register: lazy kwargs must be given as 'package.module:function', got {kwargs!r}")
    if not (kwargs is None or isinstance(kwargs, str) or callable(kwargs)):
        raise ValueError(f"register: kwargs must be a function of the config, a lazy path or None, got {kwargs!r}")
    if capabilities is not None and not isinstance(capabilities, Capabilities):
        raise ValueError(f"register: capabilities must be a Capabilities, got {capabilities!r}")
    host = (capabilities.host_kernel if capabilities is not None else family in _OFFLOADABLE_FAMILIES) \
        if offloadable is None else offloadable
    caps = capabilities if capabilities is not None else _FAMILY_CAPABILITIES[family]
    caps = dataclasses.replace(caps, host_kernel=host)
    _REGISTRY[name] = _Entry(cls, family, MappingProxyType(dict(defaults or {})), host, kwargs, caps)


def algorithm_names() -> list[str]:
    """The registered names, sorted."""
    return sorted(_REGISTRY)


#: optstack's own kernels for torch's classes of the same math (``torch.optim.AdamW`` -> ``"adamw"``)
_OWN_NAMES = {"AdamW": "adamw", "Adam": "adam", "SGD": "sgd"}


def check_name(field: str, value: object, where: str = "") -> None:
    """``value`` is a non-empty string; an optimizer class or object (torch's habit) is an error that spells out
    the name to pass instead."""
    if isinstance(value, str) and value:
        return
    cls = value if isinstance(value, type) else type(value)
    if not issubclass(cls, torch.optim.Optimizer):
        raise ValueError(f"{where}{field} must be a non-empty optimizer name (e.g. 'adamw', 'muon', "
                         f"'torch.optim.RMSprop'), got {value!r}")
    in_torch = getattr(torch.optim, cls.__name__, None) is cls
    plugin = f"torch.optim.{cls.__name__}" if in_torch else f"{cls.__module__}:{cls.__qualname__}"
    own = _OWN_NAMES.get(cls.__name__) if in_torch else None
    names = f"{field}={plugin!r}"
    if own:
        names = f"{field}={own!r} (optstack's kernel, the same math) or {names}"
    what = "an optimizer class" if isinstance(value, type) else "an optimizer object"
    raise ValueError(f"{where}{field} must be a non-empty optimizer name, got {what} ({cls.__name__}): optstack "
                     f"builds the optimizer itself, per group of parameters. Pass {names}, with its settings in the "
                     "config")


def get_algorithm(name: str) -> AlgorithmSpec:
    """The spec for a registered name, ``"torch.optim.<Class>"`` or ``"package.module:Class"``.

    Raises:
        ValueError: unknown name (the message lists the known names and the plug-in forms), a plug-in that
            cannot be imported, or a class that is not a ``torch.optim.Optimizer`` subclass.
    """
    check_name("algorithm", name)
    entry = _REGISTRY.get(name)
    if entry is not None:
        cls = _optimizer_class(name, entry.target)
        kwargs = _load(name, entry.kwargs) if isinstance(entry.kwargs, str) else entry.kwargs
        if not (kwargs is None or callable(kwargs)):
            raise ValueError(f"algorithm {name!r}: kwargs {entry.kwargs!r} is not a function of the config")
        return AlgorithmSpec(name, cls, entry.family, entry.defaults, entry.offloadable, kwargs, entry.capabilities)
    if name.startswith("torch.optim.") and ":" not in name:
        return AlgorithmSpec(name, _optimizer_class(name, "torch.optim:" + name.removeprefix("torch.optim.")), "other")
    if name.count(":") == 1:
        return AlgorithmSpec(name, _optimizer_class(name, name), "other")
    raise ValueError(f"unknown algorithm {name!r}. Known: {', '.join(algorithm_names())}. Or plug in any "
                     "torch.optim.Optimizer subclass as 'torch.optim.<Class>' (e.g. 'torch.optim.RMSprop') or "
                     "'package.module:Class'.")


def _optimizer_class(name: str, cls: object) -> type[torch.optim.Optimizer]:
    """``cls`` (imported first when it is a ``"module:Class"`` path), checked to be an Optimizer subclass."""
    cls = _load(name, cls) if isinstance(cls, str) else cls
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"algorithm {name!r}: {cls!r} is not a torch.optim.Optimizer subclass")
    return cls


def _load(name: str, target: str) -> Any:
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"algorithm {name!r}: cannot import module {module_name!r}: {error}") from error
    value = getattr(module, attribute, None)
    if value is None:
        raise ValueError(f"algorithm {name!r}: module {module_name!r} has no attribute {attribute!r}")
    return value


def _register_builtins() -> None:
    from optstack.algorithms import adamw, lion, sgd

    register("adamw", adamw.AdamW, family="adam", defaults={"decoupled": True}, kwargs=adamw.kwargs_from_config)
    register("adam", adamw.AdamW, family="adam", defaults={"decoupled": False}, kwargs=adamw.kwargs_from_config)
    register("sgd", sgd.SGD, family="sgd", kwargs=sgd.kwargs_from_config)
    register("lion", lion.Lion, family="lion", kwargs=lion.kwargs_from_config)
    register("muon", "optstack.algorithms.muon:Muon", family="muon",
             kwargs="optstack.algorithms.muon:kwargs_from_config")
    both = dataclasses.replace(_FAMILY_CAPABILITIES["muon"], state=("momentum_buffer", "moment2_buffer"))
    adaptive, adaptive_kwargs = "optstack.algorithms.adaptive_muon:AdaptiveMuon", \
        "optstack.algorithms.adaptive_muon:kwargs_from_config"
    register("normuon", adaptive, family="muon", defaults={"moment2_method": "normuon"}, kwargs=adaptive_kwargs)
    register("adamuon", adaptive, family="muon", defaults={"moment2_method": "adamuon"}, kwargs=adaptive_kwargs,
             capabilities=both)
    register("adaptive_muon", adaptive, family="muon", kwargs=adaptive_kwargs, capabilities=both)
    register("soap", "optstack.algorithms.soap:SOAP", family="other",
             kwargs="optstack.algorithms.soap:kwargs_from_config",
             capabilities=Capabilities(elementwise=False, whole_matrices=True, matrix_ndims=(2,),
                                       state=("exp_avg", "exp_avg_sq"),
                                       matrix_state=("GG_left", "GG_right", "Q_left", "Q_right"),
                                       matrix_state_max_side="max_precond_dim"))
    register("schedule_free_adamw", "optstack.algorithms.schedule_free:ScheduleFreeAdamW", family="other",
             kwargs="optstack.algorithms.schedule_free:kwargs_from_config",
             capabilities=Capabilities(state=("z", "exp_avg_sq"), swaps_weights=True))
    register("schedule_free_sgd", "optstack.algorithms.schedule_free:ScheduleFreeSGD", family="other",
             kwargs="optstack.algorithms.schedule_free:sgd_kwargs_from_config",
             capabilities=Capabilities(state=("z",), swaps_weights=True))


_register_builtins()
