"""Megatron Core's ``OptimizerConfig`` (field names, order and defaults) and ``to_core``, its translation to
``optstack.config.OptimizerConfig``, the only config the rest of optstack reads.

A field set to a value optstack does not support is a ``ValueError`` naming it, at construction and again in
``to_core`` (Megatron code mutates configs). Accepted and without effect, as they tune only Megatron's
implementation or logging: ``use_torch_optimizer_for_cpu_offload``, ``pin_cpu_grads``, ``pin_cpu_params``,
``barrier_with_L1_time``, ``timers``, ``config_logger_dir``; the ``soap_*`` / ``adaptive_muon_*`` fields for other
optimizers; ``optimizer_offload_fraction`` without ``optimizer_cpu_offload``.

- ``adaptive_muon`` -> the core's, not sign-stabilised, no norm restore (Megatron's ``adamuon``); ``soap`` -> the
  core's with Emerging-Optimizers' options (KL-Shampoo from ``soap_use_kl_shampoo``, an update from the first
  step, ``eigh`` at every refresh, every side preconditioned) and Adam's betas / eps. An emerging optimizer with
  ``fp16=True`` is refused when the optimizer is built, not the config (as Megatron).
- ``muon_use_nesterov`` (megatron-core 0.16) and ``muon_nesterov`` (later): either one turns Nesterov on.
- ``overlap_param_gather_with_optimizer_step`` is what optstack's overlapped gathers do already (each stage
  launches its gathers as soon as its step wrote them).
- The precision-aware optimizer (``use_precision_aware_optimizer=True``; here without needing
  ``use_distributed_optimizer``): ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` -> ``adam`` (torch.uint8, Transformer
  Engine's FP8 moments, -> optstack's 8-bit block-quantized ``'8bit'``); ``main_params_dtype`` fp32 (masters) or
  bf16 (bf16 parameters stepped directly) -> ``masters.dtype``; ``main_grads_dtype`` bf16 ->
  ``masters.grad_dtype`` (no fp32 gradient copy); ``store_param_remainders`` -> ``masters.store_remainders`` for
  bf16 parameters with fp32 masters. Without the switch masters are whole fp32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import sys
import types
import typing
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from optstack import config as core
from optstack.typecheck import type_ok

__all__ = [
    "OptimizerConfig", "AdamOptimizerConfig", "SGDOptimizerConfig", "to_core", "core_algorithm",
    "SUPPORTED_OPTIMIZERS", "EMERGING_OPTIMIZERS",
]

#: Values of ``OptimizerConfig.optimizer`` optstack implements ('dist_muon' is Megatron's deprecated spelling
#: of muon with the layer-wise distributed optimizer).
SUPPORTED_OPTIMIZERS = ("adam", "sgd", "lion", "muon", "dist_muon", "adaptive_muon", "soap")
#: Megatron's emerging optimizers (``emerging_optimizers.py``): whole matrices, no fp16.
EMERGING_OPTIMIZERS = ("muon", "dist_muon", "adaptive_muon", "soap")
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# Megatron's torch.uint8 moments (Transformer Engine's FP8 state) become optstack's 8-bit block-quantized ones.
_MOMENT_DTYPES = {**_DTYPE_NAMES, torch.uint8: "8bit"}
_MUON_TP_MODES = ("blockwise", "duplicated", "distributed")

# optstack.config field paths -> the Megatron field a user set, for errors raised by the core's validation.
_CORE_TO_MEGATRON = {
    "adam.beta1": "adam_beta1", "adam.beta2": "adam_beta2", "adam.eps": "adam_eps",
    "sgd.momentum": "sgd_momentum", "lion.beta1": "lion_beta1", "lion.beta2": "lion_beta2",
    "muon.momentum": "muon_momentum", "muon.ns_steps": "muon_num_ns_steps",
    "muon.coefficients": "muon_coefficient_type", "muon.scale_mode": "muon_scale_mode",
    "muon.extra_scale_factor": "muon_extra_scale_factor", "muon.matmul_precision": "muon_fp32_matmul_prec",
    "adaptive_muon.moment2_method": "adaptive_muon_moment2_method", "adaptive_muon.beta2": "adaptive_muon_beta2",
    "adaptive_muon.eps": "adaptive_muon_eps",
    "loss_scale.initial": "initial_loss_scale (or loss_scale)", "loss_scale.min_scale": "min_loss_scale",
    "loss_scale.window": "loss_scale_window", "loss_scale.hysteresis": "hysteresis",
    "offload.fraction": "optimizer_offload_fraction", "offload.enabled": "optimizer_cpu_offload",
    "masters.dtype": "main_params_dtype", "masters.store_remainders": "store_param_remainders",
    "masters.grad_dtype": "main_grads_dtype",
}


@contextlib.contextmanager
def renamed_errors(owner: str, names: Mapping[str, str]) -> Iterator[None]:
    """Re-raise a core ``ValueError`` with the core's field names replaced by the Megatron ones."""
    try:
        yield
    except ValueError as exc:
        pattern = re.compile("|".join(rf"\b{re.escape(k)}\b" for k in sorted(names, key=len, reverse=True)))
        message = pattern.sub(lambda m: names[m.group(0)], str(exc)) if names else str(exc)
        raise ValueError(f"{owner}: {message}") from exc


@dataclass
class OptimizerConfig:
    """Configuration of the Megatron optimizer, with Megatron Core's field names, order and defaults.

    Build the optimizer with ``optstack.megatron.get_megatron_optimizer(config, model_chunks)``; the fields'
    meaning is Megatron's (see its docstrings). ``lr`` and ``min_lr`` default to None as in Megatron, whose
    training script always sets them; optstack needs ``lr`` to build an optimizer (``to_core`` raises when it
    is None) and reads ``min_lr=None`` as 0.0 (the default of Megatron's ``--min-lr``).
    """

    # General
    lr: float | None = None
    min_lr: float | None = None
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None
    weight_decay: float = 0.01
    apply_wd_to_qk_layernorm: bool = False
    # Precision
    fp8_recipe: str | None = None
    fp16: bool = False
    bf16: bool = False
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    params_dtype: torch.dtype = torch.float32
    use_precision_aware_optimizer: bool = False
    store_param_remainders: bool = True
    main_grads_dtype: torch.dtype = torch.float32
    main_params_dtype: torch.dtype = torch.float32
    exp_avg_dtype: torch.dtype = torch.float32
    exp_avg_sq_dtype: torch.dtype = torch.float32
    optimizer: str = "adam"
    # Loss scaling
    loss_scale: float | None = None
    initial_loss_scale: float = 2**32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    # Adam, SGD, emerging optimizers, Lion
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-08
    decoupled_weight_decay: bool = True
    sgd_momentum: float = 0.9
    muon_momentum: float = 0.95
    muon_split_qkv: bool = True
    muon_nesterov: bool = False
    muon_use_nesterov: bool = False
    muon_scale_mode: str = "spectral"
    muon_fp32_matmul_prec: str = "medium"
    muon_coefficient_type: str = "quintic"
    muon_num_ns_steps: int = 5
    muon_tp_mode: str = "duplicated"  # Megatron main's default
    muon_extra_scale_factor: float = 1.0
    soap_shampoo_beta: float = 0.95
    soap_precondition_frequency: int = 1
    soap_use_kl_shampoo: bool = True
    adaptive_muon_moment2_method: str = "adamuon"
    adaptive_muon_beta2: float = 0.95
    adaptive_muon_eps: float = 1e-8
    muon_scalar_optimizer: str = "adam"
    lion_beta1: float = 0.95
    lion_beta2: float = 0.98
    # Distributed optimizer
    use_distributed_optimizer: bool = False
    use_layer_wise_distributed_optimizer: bool = False
    overlap_param_gather: bool = False
    overlap_param_gather_with_optimizer_step: bool = False
    # Optimizer offload
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 0.0
    use_torch_optimizer_for_cpu_offload: bool = False
    overlap_cpu_optimizer_d2h_h2d: bool = False
    pin_cpu_grads: bool = True
    pin_cpu_params: bool = True
    offload_optimizer_states: bool = False
    # Miscellaneous
    clip_grad: float = 1.0
    grad_norm_skip_threshold: float = float("inf")
    log_num_zeros_in_grad: bool = False
    barrier_with_L1_time: bool = False
    timers: Callable | None = None
    config_logger_dir: str = ""
    optimizer_cuda_graph: bool = False

    def __post_init__(self) -> None:
        check_supported(self)


@dataclass
class AdamOptimizerConfig(OptimizerConfig):
    """Megatron's Adam config class: ``OptimizerConfig`` with ``optimizer='adam'``."""

    optimizer: str = "adam"


@dataclass
class SGDOptimizerConfig(OptimizerConfig):
    """Megatron's SGD config class: ``OptimizerConfig`` with ``optimizer='sgd'``."""

    optimizer: str = "sgd"


def _unsupported(field: str, value: object, fix: str) -> ValueError:
    return ValueError(f"OptimizerConfig.{field}={value!r} is not supported by optstack; {fix}")


# (field, the only supported value, why / what to do instead)
_FIXED_FIELDS: tuple[tuple[str, object, str], ...] = (
    ("fp8_recipe", None, "FP8 training is not implemented; leave it None"),
    ("reuse_grad_buf_for_mxfp8_param_ag", False, "it belongs to MXFP8 training, which is not implemented"),
    ("optimizer_cuda_graph", False, "CUDA-graph capture of the step is not implemented; set it False"),
)


# Float fields where inf has a meaning (Megatron's "never skip"); every other float field must be finite.
_INF_ALLOWED = frozenset({"grad_norm_skip_threshold"})


@functools.cache
def _field_types(cls: type) -> tuple[tuple[str, Any], ...]:
    return tuple((f.name, typing.get_type_hints(cls)[f.name]) for f in dataclasses.fields(cls))


def _type_name(hint: Any, *, inf_allowed: bool) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arg, inf_allowed=inf_allowed) for arg in typing.get_args(hint))
    names = {type(None): "None", bool: "a bool (True or False)", int: "an int", str: "a str",
             float: "a number" if inf_allowed else "a finite number", torch.dtype: "a torch.dtype"}
    return names.get(hint, "a callable")


def check_types(config: OptimizerConfig) -> None:
    """Raise a ``ValueError`` naming the first field whose value is not of its annotated type (e.g. ``bf16="false"``,
    ``initial_loss_scale=None``, ``loss_scale_window=float("inf")``, ``muon_num_ns_steps=True``)."""
    for name, hint in _field_types(type(config)):
        value, inf_allowed = getattr(config, name), name in _INF_ALLOWED
        if not type_ok(value, hint, inf_allowed=inf_allowed):
            raise ValueError(f"OptimizerConfig.{name} must be {_type_name(hint, inf_allowed=inf_allowed)}, got "
                             f"{type(value).__name__} {value!r:.80}")


def check_supported(config: OptimizerConfig) -> None:
    """Raise a ``ValueError`` naming the first field set to a value optstack does not support (or of the wrong
    type: ``check_types``)."""
    check_types(config)
    for field, allowed, fix in _FIXED_FIELDS:
        value = getattr(config, field)
        if value != allowed:
            raise _unsupported(field, value, fix)
    if config.optimizer not in SUPPORTED_OPTIMIZERS:
        raise _unsupported("optimizer", config.optimizer, f"supported: {list(SUPPORTED_OPTIMIZERS)}")
    if config.fp16 and config.bf16:
        raise ValueError("OptimizerConfig: fp16=True and bf16=True are exclusive; set at most one of them")
    precision_dtype = _precision_dtype(config)
    if config.params_dtype not in (torch.float32, precision_dtype):
        raise ValueError(
            f"OptimizerConfig.params_dtype={config.params_dtype} does not match fp16={config.fp16}, "
            f"bf16={config.bf16}; allowed: torch.float32 or {precision_dtype} (set bf16=True for bfloat16 "
            "params, fp16=True for float16 params)"
        )
    for field, allowed in (("exp_avg_dtype", _MOMENT_DTYPES), ("exp_avg_sq_dtype", _MOMENT_DTYPES),
                           ("main_params_dtype", _MAIN_DTYPES), ("main_grads_dtype", _MAIN_DTYPES)):
        value = getattr(config, field)
        if value not in allowed:
            raise _unsupported(field, value, f"allowed: {', '.join(map(str, allowed))}")
        if value != torch.float32 and not config.use_precision_aware_optimizer:
            raise ValueError(
                f"OptimizerConfig.{field}={value} needs use_precision_aware_optimizer=True (as in Megatron); "
                "set it, or leave the dtype torch.float32"
            )
    if config.use_precision_aware_optimizer and config.optimizer != "adam":
        raise ValueError(
            "OptimizerConfig.use_precision_aware_optimizer=True needs optimizer='adam', "
            f"got {config.optimizer!r}"
        )
    if config.muon_tp_mode not in _MUON_TP_MODES:
        raise _unsupported("muon_tp_mode", config.muon_tp_mode, f"allowed: {list(_MUON_TP_MODES)}")
    if config.muon_scalar_optimizer not in ("adam", "lion"):
        raise _unsupported("muon_scalar_optimizer", config.muon_scalar_optimizer, "allowed: 'adam' or 'lion'")
    if config.use_distributed_optimizer and config.use_layer_wise_distributed_optimizer:
        raise ValueError(
            "OptimizerConfig: use_distributed_optimizer and use_layer_wise_distributed_optimizer are both "
            "True; pick one (layer-wise is what Muon needs, ZeRO-1 the distributed optimizer for the rest)"
        )
    layer_wise = config.use_layer_wise_distributed_optimizer or config.optimizer == "dist_muon"
    if config.overlap_param_gather and not (config.use_distributed_optimizer or layer_wise):
        raise ValueError(
            "OptimizerConfig.overlap_param_gather=True needs use_distributed_optimizer=True or the layer-wise "
            "optimizer (only sharded parameters are gathered)"
        )
    if config.overlap_param_gather_with_optimizer_step and not (
            config.use_distributed_optimizer and config.overlap_param_gather):
        raise ValueError(
            "OptimizerConfig.overlap_param_gather_with_optimizer_step=True needs use_distributed_optimizer=True "
            "and overlap_param_gather=True (as in Megatron)"
        )


def check_buildable(config: OptimizerConfig) -> None:
    """What Megatron refuses when the optimizer is built, not when the config is (``to_core`` calls it)."""
    steps = config.muon_num_ns_steps
    if config.optimizer in ("muon", "dist_muon", "adaptive_muon") and isinstance(steps, int) and steps < 1:
        raise ValueError(f"OptimizerConfig.muon_num_ns_steps={steps}: num_ns_steps must be at least 1 (Newton-Schulz "
                         "iterations)")
    if config.optimizer in EMERGING_OPTIMIZERS and config.fp16:
        raise ValueError(
            f"OptimizerConfig: optimizer={config.optimizer!r} with fp16=True is not supported (an emerging "
            "optimizer with fp16 is not supported, as in Megatron); use bf16=True"
        )


def _adaptive_muon(config: OptimizerConfig) -> core.AdaptiveMuonConfig:
    """The core's second-moment section from the ``adaptive_muon_*`` fields (read only for that optimizer).
    Megatron's ``adamuon`` neither sign-stabilises nor restores the norm."""
    if config.optimizer != "adaptive_muon":
        return core.AdaptiveMuonConfig()
    return core.AdaptiveMuonConfig(moment2_method=config.adaptive_muon_moment2_method,
                                   beta2=config.adaptive_muon_beta2, eps=config.adaptive_muon_eps,
                                   sign_stabilised=False, preserve_norm=False)


def _soap(config: OptimizerConfig) -> core.SOAPConfig:
    """The core's SOAP section as Emerging-Optimizers' SOAP (read only for ``optimizer='soap'``)."""
    if config.optimizer != "soap":
        return core.SOAPConfig()
    return core.SOAPConfig(beta1=config.adam_beta1, beta2=config.adam_beta2, eps=config.adam_eps,
                           shampoo_beta=config.soap_shampoo_beta,
                           precondition_frequency=config.soap_precondition_frequency,
                           use_kl_shampoo=config.soap_use_kl_shampoo, update_first_step=True, use_eigh=True,
                           max_precond_dim=sys.maxsize)  # Emerging-Optimizers has no size limit


_MAIN_DTYPES = (torch.float32, torch.bfloat16)  # main params / grads: fp32, or bf16 without a copy


def _masters(config: OptimizerConfig) -> core.MastersConfig:
    """``masters`` from the precision-aware fields (Megatron reads them only under the switch)."""
    if not config.use_precision_aware_optimizer:
        return core.MastersConfig()
    bf16_main = config.main_params_dtype == torch.bfloat16
    return core.MastersConfig(
        dtype="bf16" if bf16_main else "fp32",
        store_remainders=config.store_param_remainders and config.bf16 and not bf16_main,
        grad_dtype="bf16" if config.main_grads_dtype == torch.bfloat16 else "fp32",
    )


def _precision_dtype(config: OptimizerConfig) -> torch.dtype:
    return torch.float16 if config.fp16 else torch.bfloat16 if config.bf16 else torch.float32


def core_algorithm(optimizer: str, decoupled_weight_decay: bool) -> str:
    """Megatron's optimizer name -> optstack's algorithm ('adam' is AdamW when weight decay is decoupled)."""
    if optimizer == "adam":
        return "adamw" if decoupled_weight_decay else "adam"
    if optimizer == "dist_muon":
        return "muon"
    return optimizer


def megatron_optimizer_name(algorithm: str) -> str:
    """optstack's algorithm name -> Megatron's optimizer name (the inverse of ``core_algorithm``)."""
    return "adam" if algorithm in ("adam", "adamw") else algorithm


def _loss_scale(config: OptimizerConfig, precision: str) -> core.LossScaleConfig:
    window = config.loss_scale_window  # a finite number (check_types)
    if window != int(window):
        raise ValueError(f"OptimizerConfig.loss_scale_window must be a whole number, got {window!r}")
    common = dict(min_scale=config.min_loss_scale, window=int(window), hysteresis=config.hysteresis)
    if config.loss_scale:  # Megatron: a truthy loss_scale means a constant scaler
        value = config.loss_scale  # a finite number (check_types)
        if value <= 0:
            raise ValueError(f"OptimizerConfig.loss_scale must be None or a finite number > 0, got {value!r}")
        if precision == "fp32":
            raise ValueError(
                f"OptimizerConfig.loss_scale={value!r} needs fp16=True or bf16=True; fp32 training has no "
                "loss scaling (leave loss_scale None)"
            )
        return core.LossScaleConfig(mode="constant", initial=float(value), **common)
    mode = "dynamic" if precision == "fp16" else "none"
    return core.LossScaleConfig(mode=mode, initial=float(config.initial_loss_scale), **common)


def to_core(config: OptimizerConfig) -> core.OptimizerConfig:
    """Translate a Megatron ``OptimizerConfig`` into ``optstack.config.OptimizerConfig`` (module docstring), and:
    'adam' -> 'adamw' with ``decoupled_weight_decay``; 'dist_muon' -> 'muon', layer-wise (a DeprecationWarning,
    as Megatron's); ``loss_scale`` set -> constant scaling, None -> dynamic for fp16, else none;
    ``use_distributed_optimizer`` -> 'zero1', ``use_layer_wise_distributed_optimizer`` -> 'layerwise';
    ``optimizer_cpu_offload`` -> ``offload.fraction = optimizer_offload_fraction``; ``grad_norm_skip_threshold``
    inf -> None; ``min_lr`` None -> 0.0; ``clip_grad`` always passed on (Megatron's default 1.0; the core's 0.0).

    Raises:
        ValueError: ``lr`` is None, a field has a value optstack does not support, or a value is invalid
            (the message names the Megatron field).
    """
    if not isinstance(config, OptimizerConfig):
        raise ValueError(f"to_core needs an optstack.megatron.OptimizerConfig, got {type(config).__name__}")
    check_supported(config)
    check_buildable(config)
    if config.lr is None:
        raise ValueError(
            "OptimizerConfig.lr is None; optstack needs the base learning rate to build the optimizer "
            "(Megatron's training script sets it from --lr): set OptimizerConfig(lr=...)"
        )
    precision = _DTYPE_NAMES[_precision_dtype(config)]
    sharding = "replicated"
    if config.use_distributed_optimizer:
        sharding = "zero1"
    if config.use_layer_wise_distributed_optimizer:
        sharding = "layerwise"
    if config.optimizer == "dist_muon":
        warnings.warn(
            "optimizer='dist_muon' is deprecated; use optimizer='muon' with "
            "use_layer_wise_distributed_optimizer=True",
            DeprecationWarning,
            stacklevel=2,
        )
        sharding = "layerwise"
    skip = config.grad_norm_skip_threshold
    with renamed_errors("OptimizerConfig", _CORE_TO_MEGATRON):
        return core.OptimizerConfig(
            algorithm=core_algorithm(config.optimizer, config.decoupled_weight_decay),
            lr=config.lr,
            min_lr=0.0 if config.min_lr is None else config.min_lr,
            weight_decay=config.weight_decay,
            decoupled_lr=config.decoupled_lr,
            decoupled_min_lr=config.decoupled_min_lr if config.decoupled_lr is not None else None,
            apply_wd_to_qk_layernorm=config.apply_wd_to_qk_layernorm,
            precision=precision,
            loss_scale=_loss_scale(config, precision),
            clip_grad=config.clip_grad,
            grad_norm_skip_threshold=None if skip is None or skip == math.inf else skip,
            log_num_zeros_in_grad=config.log_num_zeros_in_grad,
            adam=core.AdamConfig(
                beta1=config.adam_beta1,
                beta2=config.adam_beta2,
                eps=config.adam_eps,
                exp_avg_dtype=_MOMENT_DTYPES[config.exp_avg_dtype],
                exp_avg_sq_dtype=_MOMENT_DTYPES[config.exp_avg_sq_dtype],
            ),
            sgd=core.SGDConfig(momentum=config.sgd_momentum, nesterov=False),
            adaptive_muon=_adaptive_muon(config),
            soap=_soap(config),
            lion=core.LionConfig(beta1=config.lion_beta1, beta2=config.lion_beta2),
            muon=core.MuonConfig(
                momentum=config.muon_momentum,
                nesterov=config.muon_nesterov or config.muon_use_nesterov,
                ns_steps=config.muon_num_ns_steps,
                coefficients=config.muon_coefficient_type,
                scale_mode=config.muon_scale_mode,
                extra_scale_factor=config.muon_extra_scale_factor,
                split_qkv=config.muon_split_qkv,
                matmul_precision=config.muon_fp32_matmul_prec,
                tp_mode=config.muon_tp_mode,  # for tensor-parallel DTensor matrices (muon.tp_mode)
                scalar_algorithm=core_algorithm(config.muon_scalar_optimizer, config.decoupled_weight_decay),
            ),
            distributed=core.DistributedConfig(
                # The layer-wise optimizer's overlapped gathers are the face's (LayerWiseDistributedOptimizer).
                sharding=sharding, overlap_param_gather=config.overlap_param_gather and sharding == "zero1"
            ),
            masters=_masters(config),
            offload=core.OffloadConfig(
                enabled=config.optimizer_cpu_offload,
                fraction=config.optimizer_offload_fraction if config.optimizer_cpu_offload else 0.0,
                overlap_transfers=config.overlap_cpu_optimizer_d2h_h2d and config.optimizer_cpu_offload,
            ),
        )
