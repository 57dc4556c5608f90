"""Typed, frozen configuration for the whole optimizer stack, validated once at construction.

Each section checks its own fields in ``__post_init__``; ``check_combination`` is the one place that decides
which settings may go together (one error each, naming the fields and the alternative), run when an
``OptimizerConfig`` is made and again by ``build_optimizer``. Sections build their objects:
``LossScaleConfig.build`` the loss scaler, ``OffloadConfig.wrap`` the offloading optimizer maker; an
algorithm's constructor kwargs come from its registry entry (``AlgorithmSpec.kwargs``).

The names here are optstack's own; Megatron's field names live only in ``optstack.megatron``, which
translates to these. Every invalid value is a ``ValueError`` naming the field, the value and what is allowed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

import torch

from optstack.algorithms.registry import AlgorithmSpec, algorithm_names, get_algorithm
from optstack.clip import check_norm_type
from optstack.offload import offloaded
from optstack.precision.scaler import ConstantScaler, DynamicScaler, LossScaler, NoScaler
from optstack.protocol import MakeOptimizer

__all__ = [
    "AdamConfig",
    "DistributedConfig",
    "LionConfig",
    "LossScaleConfig",
    "MuonConfig",
    "OffloadConfig",
    "OptimizerConfig",
    "SGDConfig",
    "check_combination",
    "dtype_from_name",
]

Precision = Literal["fp32", "bf16", "fp16"]
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_from_name(name: str, field_name: str = "dtype") -> torch.dtype:
    """'fp32' | 'bf16' | 'fp16' -> torch dtype (a ValueError naming ``field_name`` otherwise)."""
    if isinstance(name, str) and name in _DTYPES:
        return _DTYPES[name]
    raise ValueError(f"{field_name} must be one of {sorted(_DTYPES)}, got {name!r}")


def _finite(name: str, value: float, *, lo: float | None = None, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value!r}")


def _choice(name: str, value: Any, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _bool(name: str, value: Any) -> None:
    # bool("false") is True: a string or 0/1 from a config file must not pass for a flag.
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (True or False), got {value!r}")


def _int(name: str, value: Any, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")


def _section(name: str, value: Any, cls: type) -> None:
    if not isinstance(value, cls):
        raise ValueError(f"{name} must be of type {cls.__name__}, got {type(value).__name__} {value!r:.80}; "
                         f"pass {name}={cls.__name__}(...)")


def _beta(name: str, value: float) -> None:
    _finite(name, value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")


@dataclass(frozen=True, kw_only=True)
class LossScaleConfig:
    """Loss scaling. ``mode=None`` picks the usual default: dynamic for fp16, none otherwise."""

    mode: Literal["none", "constant", "dynamic"] | None = None
    initial: float = 2.0**32
    min_scale: float = 1.0
    window: int = 1000
    hysteresis: int = 2
    growth_factor: float = 2.0
    backoff_factor: float = 0.5

    def __post_init__(self) -> None:
        _choice("loss_scale.mode", self.mode, (None, "none", "constant", "dynamic"))
        _finite("loss_scale.initial", self.initial, lo=0.0, lo_open=True)
        _finite("loss_scale.min_scale", self.min_scale, lo=0.0, lo_open=True)
        if self.min_scale > self.initial:
            raise ValueError(
                f"loss_scale.min_scale ({self.min_scale}) must be <= loss_scale.initial ({self.initial})"
            )
        _int("loss_scale.window", self.window, 1)
        _int("loss_scale.hysteresis", self.hysteresis, 1)
        _finite("loss_scale.growth_factor", self.growth_factor, lo=1.0, lo_open=True)
        _finite("loss_scale.backoff_factor", self.backoff_factor, lo=0.0, lo_open=True)
        if self.backoff_factor >= 1.0:
            raise ValueError(f"loss_scale.backoff_factor must be in (0, 1), got {self.backoff_factor!r}")

    def resolved_mode(self, precision: Precision) -> Literal["none", "constant", "dynamic"]:
        """The mode in effect for parameters of ``precision`` (``mode``, or its default when None)."""
        if self.mode is not None:
            return self.mode
        return "dynamic" if precision == "fp16" else "none"

    def build(self, precision: Precision) -> LossScaler:
        """The loss scaler for parameters of ``precision``: ``NoScaler``, ``ConstantScaler(initial)`` or a
        ``DynamicScaler`` starting at ``initial`` (window -> growth_interval)."""
        mode = self.resolved_mode(precision)
        if mode == "none":
            return NoScaler()
        if mode == "constant":
            return ConstantScaler(self.initial)
        return DynamicScaler(
            initial_scale=self.initial,
            min_scale=self.min_scale,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.window,
            hysteresis=self.hysteresis,
        )


@dataclass(frozen=True, kw_only=True)
class AdamConfig:
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    exp_avg_dtype: Precision = "fp32"
    exp_avg_sq_dtype: Precision = "fp32"

    def __post_init__(self) -> None:
        _beta("adam.beta1", self.beta1)
        _beta("adam.beta2", self.beta2)
        _finite("adam.eps", self.eps, lo=0.0)
        dtype_from_name(self.exp_avg_dtype, "adam.exp_avg_dtype")
        dtype_from_name(self.exp_avg_sq_dtype, "adam.exp_avg_sq_dtype")

    @property
    def state_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """The storage dtypes of (exp_avg, exp_avg_sq)."""
        return dtype_from_name(self.exp_avg_dtype), dtype_from_name(self.exp_avg_sq_dtype)


@dataclass(frozen=True, kw_only=True)
class SGDConfig:
    momentum: float = 0.9
    nesterov: bool = False

    def __post_init__(self) -> None:
        _beta("sgd.momentum", self.momentum)
        _bool("sgd.nesterov", self.nesterov)
        if self.nesterov and self.momentum == 0.0:
            raise ValueError("sgd.nesterov needs sgd.momentum > 0, got momentum=0.0")


@dataclass(frozen=True, kw_only=True)
class LionConfig:
    beta1: float = 0.9
    beta2: float = 0.99

    def __post_init__(self) -> None:
        _beta("lion.beta1", self.beta1)
        _beta("lion.beta2", self.beta2)


@dataclass(frozen=True, kw_only=True)
class MuonConfig:
    """Muon's hyperparameters; parameters Muon cannot take go to ``scalar_algorithm``."""

    momentum: float = 0.95
    nesterov: bool = False
    ns_steps: int = 5
    coefficients: str = "quintic"
    scale_mode: Literal["spectral", "unit_rms_norm", "shape_scaling"] = "spectral"
    extra_scale_factor: float = 1.0
    split_qkv: bool = True
    matmul_precision: Literal["highest", "high", "medium"] = "medium"
    scalar_algorithm: str = "adamw"

    def __post_init__(self) -> None:
        _beta("muon.momentum", self.momentum)
        _bool("muon.nesterov", self.nesterov)
        _int("muon.ns_steps", self.ns_steps, 1)
        _choice("muon.coefficients", self.coefficients, ("quintic", "simple", "polar_express"))
        _choice("muon.scale_mode", self.scale_mode, ("spectral", "unit_rms_norm", "shape_scaling"))
        _finite("muon.extra_scale_factor", self.extra_scale_factor, lo=0.0, lo_open=True)
        _choice("muon.matmul_precision", self.matmul_precision, ("highest", "high", "medium"))
        _bool("muon.split_qkv", self.split_qkv)
        if not isinstance(self.scalar_algorithm, str) or not self.scalar_algorithm:
            raise ValueError(f"muon.scalar_algorithm must be a non-empty registry name, got {self.scalar_algorithm!r}")
        if self.scalar_algorithm == "muon":
            raise ValueError("muon.scalar_algorithm must not be 'muon' (it takes what Muon cannot)")


@dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """How optimizer state is spread across data-parallel ranks.

    sharding: ``replicated`` (every rank holds everything), ``zero1`` (each rank owns an equal slice of every
    bucket), ``layerwise`` (whole parameters assigned to ranks; what Muon needs, and only for Muon).
    ``overlap_param_gather`` needs ``zero1`` (``check_combination`` decides what goes together).
    """

    sharding: Literal["replicated", "zero1", "layerwise"] = "replicated"
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    bucket_size: int | None = None
    grad_dtype: Precision | None = None
    average_in_collective: bool = True

    def __post_init__(self) -> None:
        _choice("distributed.sharding", self.sharding, ("replicated", "zero1", "layerwise"))
        for name in ("overlap_grad_reduce", "overlap_param_gather", "average_in_collective"):
            _bool(f"distributed.{name}", getattr(self, name))
        size = self.bucket_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"distributed.bucket_size must be an int >= 1 or None, got {size!r}")
        if self.grad_dtype is not None:
            dtype_from_name(self.grad_dtype, "distributed.grad_dtype")


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """CPU offload of optimizer state (``optstack.offload``): with ``enabled``, the first ``fraction`` of each
    optimizer's elements (in group order; of this rank's shard under ZeRO-1) keep their fp32 master and
    optimizer state in host memory and are stepped there; the rest stay on the device. Fraction 0 and 1 are
    the two ends of the same code path. Needs an algorithm with a host kernel (adamw, adam, sgd) and
    ``distributed.sharding`` 'replicated' or 'zero1' (``check_combination``). While ``enabled`` is False the
    other fields are ignored (as Megatron ignores ``optimizer_offload_fraction`` without ``optimizer_cpu_offload``).
    ``wrap`` puts the offload into a stage's optimizer maker.

    Attributes:
        enabled: step through the host/device hybrid optimizer.
        fraction: share of the elements stepped on the host, in [0, 1] (0 by default, as Megatron's
            ``optimizer_offload_fraction``: set it, e.g. 1.0 to offload everything).
        overlap_transfers: on CUDA, run the device->host gradient and host->device parameter copies on side
            streams overlapping the device step; nothing to overlap without CUDA.
    """

    enabled: bool = False
    fraction: float = 0.0
    overlap_transfers: bool = False

    def __post_init__(self) -> None:
        for name in ("enabled", "overlap_transfers"):
            _bool(f"offload.{name}", getattr(self, name))
        _finite("offload.fraction", self.fraction)
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"offload.fraction must be in [0, 1], got {self.fraction!r}")

    def wrap(self, make_optimizer: MakeOptimizer, spec: AlgorithmSpec) -> MakeOptimizer:
        """``make_optimizer`` (building ``spec``'s optimizer) with this offload; itself while not ``enabled``.

        Raises:
            ValueError: ``spec`` has no host kernel. ``check_combination`` refuses that for the config's
                algorithm; a rule may route groups to another one, which is refused here by the same check.
        """
        if not self.enabled:
            return make_optimizer
        _check_offloadable(spec)
        return offloaded(make_optimizer, fraction=self.fraction, overlap_transfers=self.overlap_transfers)


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Everything ``build_optimizer`` needs besides the model and the rules.

    Args:
        algorithm: registry name ("adamw", "adam", "sgd", "lion", "muon", "torch.optim.<Class>", "pkg.mod:Class").
        lr / min_lr: the base (max) and final learning rate; groups may override through rules.
        weight_decay: base weight decay; each group gets it times its ``wd_mult``.
        decoupled_lr / decoupled_min_lr: LR for embedding/output parameters (standard rules).
        mup_width_mult: MuP width multiplier (1 = no MuP rules).
        precision: dtype of the model parameters; bf16/fp16 keep fp32 master weights.
        clip_grad: clip the global grad norm to this (0 = no clipping).
        grad_norm_skip_threshold: skip the step when the grad norm exceeds this (None = never).
        log_num_zeros_in_grad: count zero gradient elements each step.

    Which settings may go together is decided by ``check_combination``, called at the end of construction.
    """

    algorithm: str = "adamw"
    lr: float = 1e-3
    min_lr: float = 0.0
    weight_decay: float = 0.01
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None
    apply_wd_to_qk_layernorm: bool = False
    mup_width_mult: float = 1.0
    precision: Precision = "fp32"
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    clip_grad: float = 1.0
    norm_type: float = 2.0
    grad_norm_skip_threshold: float | None = None
    log_num_zeros_in_grad: bool = False
    adam: AdamConfig = field(default_factory=AdamConfig)
    sgd: SGDConfig = field(default_factory=SGDConfig)
    lion: LionConfig = field(default_factory=LionConfig)
    muon: MuonConfig = field(default_factory=MuonConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            _section(name, getattr(self, name), cls)
        if not isinstance(self.algorithm, str) or not self.algorithm:
            raise ValueError(f"algorithm must be a non-empty registry name, got {self.algorithm!r}")
        _finite("lr", self.lr, lo=0.0)
        _finite("min_lr", self.min_lr, lo=0.0)
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must be <= lr ({self.lr})")
        _finite("weight_decay", self.weight_decay, lo=0.0)
        if self.decoupled_lr is not None:
            _finite("decoupled_lr", self.decoupled_lr, lo=0.0)
        if self.decoupled_min_lr is not None:
            _finite("decoupled_min_lr", self.decoupled_min_lr, lo=0.0)
            if self.decoupled_lr is None:
                raise ValueError("decoupled_min_lr is set but decoupled_lr is None; set decoupled_lr too")
            if self.decoupled_min_lr > self.decoupled_lr:
                raise ValueError(
                    f"decoupled_min_lr ({self.decoupled_min_lr}) must be <= decoupled_lr ({self.decoupled_lr})"
                )
        _finite("mup_width_mult", self.mup_width_mult, lo=0.0, lo_open=True)
        dtype_from_name(self.precision, "precision")
        _finite("clip_grad", self.clip_grad, lo=0.0)
        check_norm_type(self.norm_type)
        if self.grad_norm_skip_threshold is not None:
            _finite("grad_norm_skip_threshold", self.grad_norm_skip_threshold, lo=0.0, lo_open=True)
        for name in ("apply_wd_to_qk_layernorm", "log_num_zeros_in_grad"):
            _bool(name, getattr(self, name))
        check_combination(self)

    @property
    def param_dtype(self) -> torch.dtype:
        return dtype_from_name(self.precision, "precision")

    def with_changes(self, **changes: Any) -> OptimizerConfig:
        """A copy with top-level fields replaced (validated again)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"OptimizerConfig has no field(s) {unknown}; known fields: {sorted(known)}")
        return replace(self, **changes)


# The sections of an OptimizerConfig and their types (a dict or None in their place is refused by name).
_SECTIONS: dict[str, type] = {
    "loss_scale": LossScaleConfig, "adam": AdamConfig, "sgd": SGDConfig, "lion": LionConfig, "muon": MuonConfig,
    "distributed": DistributedConfig, "offload": OffloadConfig,
}


def check_combination(config: OptimizerConfig, spec_of: Callable[[str], AlgorithmSpec] = get_algorithm) -> None:
    """Decide whether the settings of ``config`` may go together: the one place that does.

    Refused, each with its own error naming the fields and what to do instead:

    - ``precision='fp16'`` with a Muon-family algorithm (Newton-Schulz overflows in fp16);
    - a loss scale (``loss_scale.mode`` 'constant' or 'dynamic') with ``precision='fp32'``;
    - ``distributed.overlap_param_gather`` without ``distributed.sharding='zero1'`` (only shards are gathered);
    - ``offload.enabled`` with an algorithm that has no host kernel, or with ``distributed.sharding='layerwise'``;
    - ``distributed.sharding='layerwise'`` with an algorithm outside the Muon family (its parameters would
      silently stay replicated).

    ``OptimizerConfig`` calls it when constructed and ``build_optimizer`` before it builds. The algorithm is
    looked up (``spec_of``, the registry by default) only for a rule that needs it, so a plug-in is not
    imported sooner than it must be.

    Raises:
        ValueError: the first refused combination (or an unknown algorithm, from ``spec_of``).
    """
    algorithm, precision, distributed = config.algorithm, config.precision, config.distributed
    spec = functools.cache(lambda: spec_of(algorithm))
    if precision == "fp16" and spec().family == "muon":
        raise ValueError(
            f"precision='fp16' is not supported with algorithm={algorithm!r} (Newton-Schulz overflows in fp16); "
            "use precision='bf16' or 'fp32'"
        )
    if precision == "fp32" and config.loss_scale.resolved_mode(precision) != "none":
        raise ValueError(
            f"loss_scale.mode={config.loss_scale.mode!r} needs precision 'fp16' or 'bf16', got 'fp32'; "
            "leave loss_scale.mode None (or 'none') for fp32"
        )
    if distributed.overlap_param_gather and distributed.sharding != "zero1":
        raise ValueError(
            "distributed.overlap_param_gather needs distributed.sharding='zero1' (only sharded parameters are "
            f"gathered), got sharding={distributed.sharding!r}; set overlap_param_gather=False or sharding='zero1'"
        )
    if config.offload.enabled:
        _check_offloadable(spec())
        if distributed.sharding == "layerwise":
            raise ValueError(
                "offload.enabled=True cannot be combined with distributed.sharding='layerwise' (whole parameters "
                "assigned to ranks for Muon); use distributed.sharding='replicated' or 'zero1' with offload"
            )
    if distributed.sharding == "layerwise" and spec().family != "muon":
        raise ValueError(
            f"distributed.sharding='layerwise' needs a Muon-family algorithm (it assigns whole matrices to ranks "
            f"for Newton-Schulz), got algorithm={algorithm!r}, whose state would silently stay replicated; use "
            "distributed.sharding='zero1' to shard it, or algorithm='muon'"
        )


def _check_offloadable(spec: AlgorithmSpec) -> None:
    if not spec.offloadable:
        able = ", ".join(n for n in algorithm_names() if get_algorithm(n).offloadable)
        raise ValueError(
            f"offload.enabled=True needs an algorithm with a host kernel, but {spec.name!r} has none; "
            f"offloadable algorithms: {able}. Set offload.enabled=False, or route these parameters to one of "
            "them with a rule (e.g. Rule(..., algorithm='adamw'))"
        )
