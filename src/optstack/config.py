"""Typed, frozen configuration of the optimizer stack, validated once at construction: each section checks its
fields (a table of field -> check, one check per kind of field), and ``check_combination`` alone decides which
settings may go together. Sections build their objects (``LossScaleConfig.build``, ``OffloadConfig.wrap``). The
names are optstack's own (Megatron's live in ``optstack.megatron``); every invalid value is a ``ValueError``
naming the field, the value and what is allowed.
"""

from __future__ import annotations

import difflib
import functools
import math
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, Literal

import torch

from optstack.algorithms.registry import AlgorithmSpec, algorithm_names, check_name, get_algorithm
from optstack.clip import check_norm_type
from optstack.offload import offloaded
from optstack.precision.scaler import ConstantScaler, DynamicScaler, LossScaler, NoScaler
from optstack.protocol import MakeOptimizer

__all__ = ["AdamConfig", "AdaptiveMuonConfig", "DistributedConfig", "LionConfig", "LossScaleConfig", "MastersConfig",
           "MuonConfig", "OffloadConfig", "SOAPConfig", "ScheduleFreeConfig",
           "OptimizerConfig", "SGDConfig", "check_combination", "dtype_from_name"]

Precision = Literal["fp32", "bf16", "fp16"]
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
Check = Callable[[str, Any], None]  # check(field name, value): a ValueError naming the field, else nothing


def dtype_from_name(name: str, field_name: str = "dtype") -> torch.dtype:
    """'fp32' | 'bf16' | 'fp16' -> torch dtype (a ValueError naming ``field_name`` otherwise)."""
    if isinstance(name, str) and name in _DTYPES:
        return _DTYPES[name]
    raise ValueError(f"{field_name} must be one of {sorted(_DTYPES)}, got {name!r}")


def _validate(prefix: str, config: Any, **checks: Check) -> None:
    """Run each field's check, in order, on its value in ``config``, naming it ``prefix + field``."""
    for name, check in checks.items():
        check(prefix + name, getattr(config, name))


def _number(lo: float, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False) -> Check:
    """A finite number (not a bool) >= ``lo`` (> when ``lo_open``) and <= ``hi`` (< when ``hi_open``)."""
    if hi is None:
        allowed = f"{'>' if lo_open else '>='} {lo}"
    else:
        allowed = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"

    def check(name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        if (value <= lo if lo_open else value < lo) or (hi is not None and (value >= hi if hi_open else value > hi)):
            raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return check


def _or_none(check: Check) -> Check:
    return lambda name, value: None if value is None else check(name, value)


def _int(lo: int, *, optional: bool = False) -> Check:
    def check(name: str, value: Any) -> None:
        if not (optional and value is None) and (isinstance(value, bool) or not isinstance(value, int) or value < lo):
            raise ValueError(f"{name} must be an int >= {lo}{' or None' if optional else ''}, got {value!r}")
    return check


def _flag(name: str, value: Any) -> None:
    # bool("false") is True: a string or 0/1 from a config file must not pass for a flag.
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (True or False), got {value!r}")


def _one_of(*allowed: Any) -> Check:
    def check(name: str, value: Any) -> None:
        if value not in allowed:
            raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
    return check


# p-norms above this underflow in fp32: sum(|g|**p) of gradients ~1e-3 is 0 for p >= 13 (so p=1000 "clips" with a
# norm of 0.0); 1, 2 and inf are the usual ones, 3 and 4 still sound for any gradient a model trains with.
_MAX_FINITE_NORM_TYPE = 4.0


def _norm_type(name: str, value: Any) -> None:
    check_norm_type(value)  # a number >= 1 or inf
    if value != math.inf and value > _MAX_FINITE_NORM_TYPE:
        raise ValueError(f"{name} must be in [1, {_MAX_FINITE_NORM_TYPE:g}] or float('inf'), got {value!r}: "
                         f"sum(|g|**p) underflows in fp32 for large p, making the norm 0.0 and clipping nothing "
                         "(use 2.0 for L2, float('inf') for the largest element)")


def _precision(name: str, value: Any) -> None:
    dtype_from_name(value, name)


_BETA, _POSITIVE, _NON_NEGATIVE = _number(0.0, 1.0, hi_open=True), _number(0.0, lo_open=True), _number(0.0)


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
        _validate("loss_scale.", self, mode=_one_of(None, "none", "constant", "dynamic"), initial=_POSITIVE,
                  min_scale=_POSITIVE, window=_int(1), hysteresis=_int(1), growth_factor=_number(1.0, lo_open=True),
                  backoff_factor=_number(0.0, 1.0, lo_open=True, hi_open=True))
        if self.min_scale > self.initial:
            raise ValueError(f"loss_scale.min_scale ({self.min_scale}) must be <= loss_scale.initial ({self.initial})")

    def resolved_mode(self, precision: Precision) -> Literal["none", "constant", "dynamic"]:
        """The mode in effect for parameters of ``precision`` (``mode``, or its default when None)."""
        return self.mode if self.mode is not None else "dynamic" if precision == "fp16" else "none"

    def build(self, precision: Precision) -> LossScaler:
        """The loss scaler for parameters of ``precision``: ``NoScaler``, ``ConstantScaler(initial)`` or a
        ``DynamicScaler`` starting at ``initial`` (window -> growth_interval)."""
        mode = self.resolved_mode(precision)
        if mode == "none":
            return NoScaler()
        if mode == "constant":
            return ConstantScaler(self.initial)
        return DynamicScaler(initial_scale=self.initial, min_scale=self.min_scale, growth_factor=self.growth_factor,
                             backoff_factor=self.backoff_factor, growth_interval=self.window,
                             hysteresis=self.hysteresis)


@dataclass(frozen=True, kw_only=True)
class AdamConfig:
    """Adam's hyperparameters and the storage of its moments.

    Attributes:
        exp_avg_dtype, exp_avg_sq_dtype: 'fp32' | 'bf16' | 'fp16', or '8bit': block-quantized (bitsandbytes'
            dynamic map, one fp32 absmax scale per ``block_size`` elements; the second moment in sqrt space),
            1 B per element + 4 B per block. One name for both moments: each uses the map its sign needs.
        block_size: elements per quantization block of '8bit' moments (a power of two in [16, 4096]).
    """

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    exp_avg_dtype: Precision | Literal["8bit"] = "fp32"
    exp_avg_sq_dtype: Precision | Literal["8bit"] = "fp32"
    block_size: int = 256

    def __post_init__(self) -> None:
        _validate("adam.", self, beta1=_BETA, beta2=_BETA, eps=_NON_NEGATIVE,
                  exp_avg_dtype=_one_of("fp32", "bf16", "fp16", "8bit"),
                  exp_avg_sq_dtype=_one_of("fp32", "bf16", "fp16", "8bit"), block_size=_int(16))
        if self.block_size & (self.block_size - 1) or self.block_size > 4096:
            raise ValueError(f"adam.block_size must be a power of two in [16, 4096], got {self.block_size}")

    @property
    def state_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """The storage dtypes of (exp_avg, exp_avg_sq); torch.uint8 for '8bit' (the codes)."""
        return tuple(torch.uint8 if name == "8bit" else _DTYPES[name]
                     for name in (self.exp_avg_dtype, self.exp_avg_sq_dtype))  # type: ignore[return-value]


@dataclass(frozen=True, kw_only=True)
class MastersConfig:
    """What the optimizer steps for bf16/fp16 parameters (the precision-aware optimizer; Megatron's
    ``main_params_dtype``, ``store_param_remainders``, ``main_grads_dtype``). fp32 parameters are always
    stepped as they are.

    Attributes:
        dtype: 'fp32': an fp32 master per parameter (4 B/param); 'bf16': no master, the bf16 parameters are
            stepped directly (math in fp32, rounded back; needs precision='bf16').
        store_remainders: keep only the low 16 bits of each fp32 master (2 B/param): the bf16 parameter is
            the high half, and every step is bit for bit the fp32-master step (needs precision='bf16' and
            dtype='fp32').
        stochastic_rounding: with dtype='bf16', round the stepped values into the parameters stochastically
            (unbiased: small updates are not lost); needs an Adam-family algorithm.
        grad_dtype: 'fp32': low-precision gradients are copied into fp32 buffers for the step; 'bf16': the
            algorithm reads them as they are (no copy: needs an Adam-family algorithm, which converts in its
            kernel).
    """

    dtype: Literal["fp32", "bf16"] = "fp32"
    store_remainders: bool = False
    stochastic_rounding: bool = False
    grad_dtype: Literal["fp32", "bf16"] = "fp32"

    def __post_init__(self) -> None:
        _validate("masters.", self, dtype=_one_of("fp32", "bf16"), store_remainders=_flag,
                  stochastic_rounding=_flag, grad_dtype=_one_of("fp32", "bf16"))
        if self.store_remainders and self.dtype != "fp32":
            raise ValueError(f"masters.store_remainders=True needs masters.dtype='fp32' (it stores the low half of "
                             f"fp32 masters), got dtype={self.dtype!r}; set one of them back")
        if self.stochastic_rounding and self.dtype != "bf16":
            raise ValueError("masters.stochastic_rounding=True needs masters.dtype='bf16' (it rounds the step into "
                             f"bf16 parameters), got dtype={self.dtype!r}")


@dataclass(frozen=True, kw_only=True)
class SGDConfig:
    momentum: float = 0.9
    nesterov: bool = False

    def __post_init__(self) -> None:
        _validate("sgd.", self, momentum=_BETA, nesterov=_flag)
        if self.nesterov and self.momentum == 0.0:
            raise ValueError("sgd.nesterov needs sgd.momentum > 0, got momentum=0.0")


@dataclass(frozen=True, kw_only=True)
class LionConfig:
    beta1: float = 0.9
    beta2: float = 0.99

    def __post_init__(self) -> None:
        _validate("lion.", self, beta1=_BETA, beta2=_BETA)


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
    #: Megatron's ``muon_tp_mode``, for matrices split by tensor parallelism (DTensor ``Shard`` over a mesh dim
    #: named "tp"): ``duplicated`` orthogonalises the whole matrix, ``blockwise`` each tensor-parallel block as
    #: a matrix of its own (the update depends on the TP size), ``distributed`` the whole matrix by
    #: Newton-Schulz over its blocks with their Gram products summed (equal to ``duplicated`` to round-off)
    tp_mode: Literal["duplicated", "blockwise", "distributed"] = "duplicated"

    def __post_init__(self) -> None:
        _validate("muon.", self, momentum=_BETA, nesterov=_flag, ns_steps=_int(1),
                  coefficients=_one_of("quintic", "simple", "polar_express"),
                  scale_mode=_one_of("spectral", "unit_rms_norm", "shape_scaling"), extra_scale_factor=_POSITIVE,
                  matmul_precision=_one_of("highest", "high", "medium"), split_qkv=_flag,
                  scalar_algorithm=check_name, tp_mode=_one_of("duplicated", "blockwise", "distributed"))
        if self.scalar_algorithm == "muon" or get_algorithm(self.scalar_algorithm).capabilities.whole_matrices:
            raise ValueError(f"muon.scalar_algorithm must not be {self.scalar_algorithm!r} (it takes what Muon cannot: "
                             "vectors, embeddings; that algorithm steps whole matrices); e.g. 'adamw'")


@dataclass(frozen=True, kw_only=True)
class AdaptiveMuonConfig:
    """The second moment of the adaptive Muons (``normuon``, ``adamuon``, ``adaptive_muon``:
    ``algorithms/adaptive_muon.py``); momentum, Newton-Schulz and scale come from ``muon``. ``moment2_method``
    is read by ``adaptive_muon`` only (the other two names fix it)."""

    moment2_method: Literal["normuon", "adamuon"] = "normuon"
    beta2: float = 0.95
    eps: float = 1e-8
    sign_stabilised: bool = True
    preserve_norm: bool = True

    def __post_init__(self) -> None:
        _validate("adaptive_muon.", self, moment2_method=_one_of("normuon", "adamuon"), beta2=_BETA, eps=_POSITIVE,
                  sign_stabilised=_flag, preserve_norm=_flag)


@dataclass(frozen=True, kw_only=True)
class ScheduleFreeConfig:
    """Schedule-Free AdamW and SGD (``schedule_free_adamw``, ``schedule_free_sgd``,
    ``algorithms/schedule_free.py``): ``beta1`` interpolates between the fast sequence and the average (SGD's
    ``momentum``), ``beta2`` is Adam's; the learning rate is constant after
    ``warmup_steps`` (build the optimizer without ``lr_schedule``), the average weighted by
    ``(k + 1) ** r * lr_max ** weight_lr_power``."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    warmup_steps: int = 0
    r: float = 0.0
    weight_lr_power: float = 2.0

    def __post_init__(self) -> None:
        _validate("schedule_free.", self, beta1=_number(0.0, 1.0, lo_open=True, hi_open=True), beta2=_BETA,
                  eps=_NON_NEGATIVE, warmup_steps=_int(0), r=_NON_NEGATIVE, weight_lr_power=_NON_NEGATIVE)


@dataclass(frozen=True, kw_only=True)
class SOAPConfig:
    """SOAP (``soap``, ``algorithms/soap.py``; Megatron's ``soap_*`` fields): Adam's ``beta1`` / ``beta2`` /
    ``eps`` in the eigenbasis of the Kronecker factors, whose EMA coefficient is ``shampoo_beta``; the eigenbases
    are refreshed every ``precondition_frequency`` steps (``power_iter_steps`` power iterations + QR); a side longer
    than ``max_precond_dim`` is not preconditioned; ``correct_bias``: Adam's and the factors' bias correction.
    Emerging-Optimizers' variant (Megatron's ``optimizer='soap'``): ``use_kl_shampoo`` (KL-Shampoo's factors),
    ``update_first_step`` (an update on the first step too), ``use_eigh`` (``eigh`` at every refresh)."""

    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    shampoo_beta: float = 0.95
    precondition_frequency: int = 10
    max_precond_dim: int = 8192
    correct_bias: bool = True
    power_iter_steps: int = 1
    use_kl_shampoo: bool = False
    update_first_step: bool = False
    use_eigh: bool = False

    def __post_init__(self) -> None:
        _validate("soap.", self, beta1=_BETA, beta2=_BETA, eps=_NON_NEGATIVE, shampoo_beta=_BETA,
                  precondition_frequency=_int(1), max_precond_dim=_int(1), correct_bias=_flag,
                  power_iter_steps=_int(1), use_kl_shampoo=_flag, update_first_step=_flag, use_eigh=_flag)
        if self.use_kl_shampoo and self.eps <= 0:
            raise ValueError(f"soap.eps must be > 0 with soap.use_kl_shampoo (it floors the factors' eigenvalues), "
                             f"got {self.eps}")


@dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """How optimizer state is spread across data-parallel ranks: ``sharding`` ``replicated`` (every rank holds
    everything), ``zero1`` (each rank owns an equal slice of every bucket; ``overlap_param_gather`` needs it) or
    ``layerwise`` (whole parameters assigned to ranks; what Muon needs, and only for Muon).

    ``whole_matrices``: how ``zero1`` lays out the parameters of an algorithm needing whole matrices (Muon):
    ``whole_shards`` (each matrix whole inside its owner's reduce-scatter shard: padding), ``gather`` (ordinary
    buffers; each owner gathers its matrices' pieces from the reduce-scattered shards) or ``auto`` (whole shards
    unless they pad more than 5% or there are fewer matrices than ranks; ``optstack plan`` says which and why)."""

    sharding: Literal["replicated", "zero1", "layerwise"] = "replicated"
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    bucket_size: int | None = None
    grad_dtype: Precision | None = None
    average_in_collective: bool = True
    whole_matrices: Literal["auto", "whole_shards", "gather"] = "auto"

    def __post_init__(self) -> None:
        _validate("distributed.", self, sharding=_one_of("replicated", "zero1", "layerwise"),
                  whole_matrices=_one_of("auto", "whole_shards", "gather"),
                  overlap_grad_reduce=_flag, overlap_param_gather=_flag, average_in_collective=_flag,
                  bucket_size=_int(1, optional=True), grad_dtype=_or_none(_precision))


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """CPU offload of optimizer state (``optstack.offload``); needs an algorithm with a host kernel (adamw, adam,
    sgd) and ``distributed.sharding`` 'replicated' or 'zero1'. While ``enabled`` is False the other fields are
    ignored (as Megatron ignores ``optimizer_offload_fraction`` without ``optimizer_cpu_offload``).

    Attributes:
        enabled: the first ``fraction`` of each optimizer's elements (in group order; of this rank's shard under
            ZeRO-1) keep their fp32 master and state in host memory and are stepped there, the rest on the device.
        fraction: share of the elements stepped on the host, in [0, 1] (0 by default, as Megatron's
            ``optimizer_offload_fraction``: set it, e.g. 1.0 to offload everything).
        overlap_transfers: on CUDA, copy gradients to the host and parameters back on side streams, overlapping
            the device step.
    """

    enabled: bool = False
    fraction: float = 0.0
    overlap_transfers: bool = False

    def __post_init__(self) -> None:
        _validate("offload.", self, enabled=_flag, overlap_transfers=_flag, fraction=_number(0.0, 1.0))

    def wrap(self, make_optimizer: MakeOptimizer, spec: AlgorithmSpec) -> MakeOptimizer:
        """``make_optimizer`` (building ``spec``'s optimizer) with this offload; itself while not ``enabled``.

        Raises:
            ValueError: ``spec`` has no host kernel (a rule may route groups to another algorithm than the config's).
        """
        if not self.enabled:
            return make_optimizer
        _check_offloadable(spec)
        return offloaded(make_optimizer, fraction=self.fraction, overlap_transfers=self.overlap_transfers)


#: Argument names that torch, Hugging Face and Megatron users pass by habit, and what optstack takes instead.
_FOREIGN_NAMES = {
    "learning_rate": "lr=...", "max_lr": "lr=... (the peak; the schedule is build_optimizer(lr_schedule=...))",
    "min_learning_rate": "min_lr=...", "betas": "adam=AdamConfig(beta1=..., beta2=...)",
    "beta1": "adam=AdamConfig(beta1=...)", "beta2": "adam=AdamConfig(beta2=...)", "eps": "adam=AdamConfig(eps=...)",
    "adam_beta1": "adam=AdamConfig(beta1=...)", "adam_beta2": "adam=AdamConfig(beta2=...)",
    "adam_eps": "adam=AdamConfig(eps=...)", "adam_epsilon": "adam=AdamConfig(eps=...)",
    "momentum": "sgd=SGDConfig(momentum=...) (or muon=MuonConfig(momentum=...))",
    "nesterov": "sgd=SGDConfig(nesterov=...)", "max_grad_norm": "clip_grad=...", "grad_clip": "clip_grad=...",
    "optimizer": "algorithm=... (a name: 'adamw', 'muon', 'torch.optim.RMSprop')", "optim": "algorithm=...",
    "bf16": "precision='bf16'", "fp16": "precision='fp16'", "dtype": "precision='bf16' | 'fp16' | 'fp32'",
    "warmup_steps": "build_optimizer(..., lr_schedule=LRSchedule(warmup_steps=..., ...))",
    "lr_warmup_steps": "build_optimizer(..., lr_schedule=LRSchedule(warmup_steps=..., ...))",
    "lr_scheduler_type": "build_optimizer(..., lr_schedule=LRSchedule(style=..., ...))",
    "lr_decay_style": "build_optimizer(..., lr_schedule=LRSchedule(style=..., ...))",
    "use_distributed_optimizer": "distributed=DistributedConfig(sharding='zero1')",
}


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Everything ``build_optimizer`` needs besides the model and the rules.

    Args:
        algorithm: registry name ("adamw", "adam", "sgd", "lion", "muon", "torch.optim.<Class>", "pkg.mod:Class").
        lr / min_lr: the base (max) and final learning rate; groups may override through rules.
        weight_decay: base weight decay; each group gets it times its ``wd_mult``.
        decoupled_lr / decoupled_min_lr: LR for embedding/output parameters (standard rules).
        mup_width_mult: MuP width multiplier (1 = no MuP rules).
        precision: dtype of the model parameters; bf16/fp16 keep fp32 master weights (see ``masters``).
        masters: what is stepped for bf16/fp16 parameters (fp32 masters, their remainders, or none).
        clip_grad: clip the global grad norm to this; 0 (the default, as torch's AdamW) = no clipping.
        grad_norm_skip_threshold: skip the step when the grad norm exceeds this (None = never).
        log_num_zeros_in_grad: count zero gradient elements each step.
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
    clip_grad: float = 0.0
    norm_type: float = 2.0
    grad_norm_skip_threshold: float | None = None
    log_num_zeros_in_grad: bool = False
    adam: AdamConfig = field(default_factory=AdamConfig)
    sgd: SGDConfig = field(default_factory=SGDConfig)
    lion: LionConfig = field(default_factory=LionConfig)
    muon: MuonConfig = field(default_factory=MuonConfig)
    adaptive_muon: AdaptiveMuonConfig = field(default_factory=AdaptiveMuonConfig)
    schedule_free: ScheduleFreeConfig = field(default_factory=ScheduleFreeConfig)
    soap: SOAPConfig = field(default_factory=SOAPConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    masters: MastersConfig = field(default_factory=MastersConfig)

    def __new__(cls, *args: Any, **kwargs: Any) -> OptimizerConfig:
        # Before the dataclass __init__, whose TypeError for a name of torch's or Megatron's says only "unexpected".
        names = [f.name for f in fields(cls)]
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(k, names, n=1)
                hints.append(f"no field {k!r}: use {_FOREIGN_NAMES[k]}" if k in _FOREIGN_NAMES else
                             f"no field {k!r} (did you mean {close[0]!r}?)" if close else f"no field {k!r}")
            raise TypeError(f"OptimizerConfig has {'; '.join(hints)}. Its fields are {', '.join(names)} "
                            "(optstack.megatron.OptimizerConfig takes Megatron's names)")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        for f in fields(self):  # the sections: the fields whose default their class builds
            cls, value = f.default_factory, getattr(self, f.name)
            if cls is not MISSING and not isinstance(value, cls):  # type: ignore[arg-type]
                raise ValueError(f"{f.name} must be of type {cls.__name__}, got {type(value).__name__} {value!r:.80}; "
                                 f"pass {f.name}={cls.__name__}(...)")
        _validate("", self, algorithm=check_name, lr=_NON_NEGATIVE, min_lr=_NON_NEGATIVE,
                  weight_decay=_NON_NEGATIVE, decoupled_lr=_or_none(_NON_NEGATIVE),
                  decoupled_min_lr=_or_none(_NON_NEGATIVE), mup_width_mult=_POSITIVE, precision=_precision,
                  clip_grad=_NON_NEGATIVE, norm_type=_norm_type,
                  grad_norm_skip_threshold=_or_none(_POSITIVE), apply_wd_to_qk_layernorm=_flag,
                  log_num_zeros_in_grad=_flag)
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must be <= lr ({self.lr})")
        if self.decoupled_min_lr is not None and self.decoupled_lr is None:
            raise ValueError("decoupled_min_lr is set but decoupled_lr is None; set decoupled_lr too")
        if self.decoupled_min_lr is not None and self.decoupled_min_lr > self.decoupled_lr:  # type: ignore[operator]
            raise ValueError(
                f"decoupled_min_lr ({self.decoupled_min_lr}) must be <= decoupled_lr ({self.decoupled_lr})")
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


def check_combination(config: OptimizerConfig, spec_of: Callable[[str], AlgorithmSpec] = get_algorithm) -> None:
    """Decide whether the settings of ``config`` may go together: the one place that does. Each refused
    combination has its own error naming the fields and what to do instead. The algorithm is looked up
    (``spec_of``, the registry by default) only for a rule that needs it, so a plug-in is not imported sooner.

    Raises:
        ValueError: the first refused combination (or an unknown algorithm, from ``spec_of``).
    """
    algorithm, precision, distributed = config.algorithm, config.precision, config.distributed
    spec = functools.cache(lambda: spec_of(algorithm))
    if precision == "fp16" and spec().family == "muon":
        raise ValueError(f"precision='fp16' is not supported with algorithm={algorithm!r} (Newton-Schulz overflows "
                         "in fp16); use precision='bf16' or 'fp32'")
    if precision == "fp32" and config.loss_scale.resolved_mode(precision) != "none":
        raise ValueError(f"loss_scale.mode={config.loss_scale.mode!r} needs precision 'fp16' or 'bf16', got 'fp32'; "
                         "leave loss_scale.mode None (or 'none') for fp32")
    if distributed.overlap_param_gather and distributed.sharding != "zero1":
        raise ValueError("distributed.overlap_param_gather needs distributed.sharding='zero1' (only sharded "
                         f"parameters are gathered), got sharding={distributed.sharding!r}; set "
                         "overlap_param_gather=False or sharding='zero1'")
    masters = config.masters
    for name, value in (("store_remainders", masters.store_remainders), ("dtype", masters.dtype == "bf16")):
        if value and precision != "bf16":
            why = "fp32 parameters have no master to split" if precision == "fp32" else "bf16 parameters only"
            raise ValueError(f"masters.{name}={'True' if name == 'store_remainders' else repr('bf16')} needs "
                             f"precision='bf16', got precision={precision!r} ({why}); set precision='bf16' or "
                             f"leave masters.{name} at its default")
    adam_only = (("stochastic_rounding", masters.stochastic_rounding), ("grad_dtype", masters.grad_dtype != "fp32"))
    for name, value in adam_only:
        if value and spec().family != "adam":
            raise ValueError(f"masters.{name} needs an Adam-family algorithm (AdamW converts through fp32 in its "
                             f"kernel), got algorithm={algorithm!r}; leave masters.{name} at its default")
    if config.offload.enabled:
        _check_offloadable(spec())
        if distributed.sharding == "layerwise":
            raise ValueError("offload.enabled=True cannot be combined with distributed.sharding='layerwise' (whole "
                             "parameters assigned to ranks for Muon); use distributed.sharding='replicated' or "
                             "'zero1' with offload")
    for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        if getattr(config.adam, name) == "8bit" and spec().family not in ("adam", "muon"):
            raise ValueError(f"adam.{name}='8bit' quantizes Adam's moments, but algorithm={algorithm!r} keeps none "
                             "(the setting would be ignored); use an Adam-family algorithm (or Muon, whose "
                             f"scalar parameters AdamW steps), or leave adam.{name} at 'fp32'")
    if distributed.sharding == "layerwise" and not spec().capabilities.whole_matrices:
        raise ValueError("distributed.sharding='layerwise' needs a Muon-family algorithm (one whose capabilities "
                         "declare whole_matrices: muon, normuon, adamuon, or one registered so; it assigns whole "
                         f"matrices to ranks for Newton-Schulz), got algorithm={algorithm!r}, whose state would "
                         "silently stay replicated; use distributed.sharding='zero1' to shard it, or algorithm='muon'")


def _check_offloadable(spec: AlgorithmSpec) -> None:
    if not spec.offloadable:
        able = ", ".join(n for n in algorithm_names() if get_algorithm(n).offloadable)
        raise ValueError(f"offload.enabled=True needs an algorithm with a host kernel, but {spec.name!r} has none; "
                         f"offloadable algorithms: {able}. Set offload.enabled=False, or route these parameters to "
                         "one of them with a rule (e.g. Rule(..., algorithm='adamw'))")
