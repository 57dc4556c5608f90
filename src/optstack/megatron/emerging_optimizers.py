"""Megatron's emerging-optimizer registry (``megatron.core.optimizer.emerging_optimizers``) on optstack's kernels:
``_EMERGING_OPTIMIZERS`` maps a name to an ``EmergingOptimizerEntry``; the classes are optstack's, so NVIDIA
Emerging-Optimizers is not needed (``HAVE_EMERGING_OPTIMIZERS`` is True).

- ``TensorParallelMuon``: core ``Muon`` with Megatron's plain-tensor tensor parallelism: a parameter carrying
  ``partition_dim`` is this rank's shard of a matrix split over ``pg_collection.tp`` (``expt_tp`` for
  ``expert_tp``). ``tp_mode``: ``duplicated`` gathers the shards and orthogonalises the whole matrix (equal to one
  process); ``distributed`` runs Newton-Schulz on the shards with the Gram products all-reduced (equal to fp32
  round-off); ``blockwise`` orthogonalises each shard alone. Without a tensor-parallel group of several ranks the
  step is core Muon's (batched). GTP weight rematerialisation follows Megatron's
  ``scaled_orthogonalize_fn_with_gtp_remat``.
- ``TensorParallelAdaptiveMuon``: the same, then Megatron's second moment of the scaled orthogonalised update
  (``adamuon``: element-wise, ``o / (sqrt(v) + eps)``; ``normuon``: the mean over the columns when rows >= cols,
  else the rows, ``o / sqrt(max(v, eps))``), summed across tensor-parallel shards where the mean runs along the
  split. (The core's ``adaptive_muon`` is dion's NorMuon / the AdaMuon paper's form; this class is Megatron's.)
- ``SOAP``: Emerging-Optimizers' arguments and defaults on the core ``SOAP`` with that package's options.

Megatron's tests patch this module's ``get_pg_size`` / ``get_pg_rank`` / ``is_emerging_optimizers_min_version``;
the classes look them up here at call time.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from optstack.algorithms._orthogonal import NS_EPS, momentum_updates
from optstack.algorithms.muon import Muon, muon_scale_factor, newton_schulz_blocks
from optstack.algorithms.newton_schulz import COEFFICIENT_SETS, matmul_precision, newton_schulz, ns_matmul_dtype
from optstack.algorithms.soap import SOAP as CoreSOAP
from optstack.distributed.comm import Comm
from optstack.megatron.keys import ParamKey, ParamPredicate

__all__ = ["HAVE_EMERGING_OPTIMIZERS", "EmergingOptimizerEntry", "TensorParallelMuon", "TensorParallelAdaptiveMuon",
           "get_supported_coefficient_types", "validate_coefficient_type", "get_emerging_optimizers_version",
           "is_emerging_optimizers_min_version", "get_pg_size", "get_pg_rank", "SOAP"]

#: The face implements the optimizers the flag guards in Megatron (no ``emerging_optimizers`` needed).
HAVE_EMERGING_OPTIMIZERS = True
#: The Emerging-Optimizers API the classes follow (``use_syrk`` of 0.4's ``newton_schulz_tp`` included).
_EMERGING_OPTIMIZERS_API = "0.4.0"
_SYRK_MIN_EO_VERSION = "0.4.0.dev0"


def get_emerging_optimizers_version() -> str:
    """The Emerging-Optimizers API version this face implements."""
    return _EMERGING_OPTIMIZERS_API


def is_emerging_optimizers_min_version(version: str) -> bool:
    """Whether the API implemented is at least ``version``."""
    from packaging.version import Version

    return Version(get_emerging_optimizers_version()) >= Version(version)


def get_pg_size(group: Any = None) -> int:
    """Ranks in ``group``; 1 for None or without torch.distributed (Megatron's ``get_pg_size``)."""
    return 1 if group is None or not dist.is_initialized() else dist.get_world_size(group)


def get_pg_rank(group: Any = None) -> int:
    """This rank's index in ``group``; 0 for None or without torch.distributed."""
    return 0 if group is None or not dist.is_initialized() else dist.get_rank(group)


def get_supported_coefficient_types() -> tuple[str, ...]:
    """The named Newton-Schulz coefficient sets (``optstack.algorithms.newton_schulz.COEFFICIENT_SETS``)."""
    return tuple(COEFFICIENT_SETS)


def validate_coefficient_type(coefficient_type: str) -> None:
    """Raise ``ValueError`` if ``coefficient_type`` is not a named set."""
    supported = get_supported_coefficient_types()
    if coefficient_type not in supported:
        raise ValueError(f"Unsupported muon coefficient type '{coefficient_type}'. Supported types: {supported}")


# ---------------------------------------------------------------------------------------------------- registry


def _eopt_init_state_fn(opt: torch.optim.Optimizer, config: Any = None) -> None:
    """Create every parameter's state now (checkpoint formats need it before the first step)."""
    for group in opt.param_groups:
        opt._init_group(group, skip_non_grad_params=False)  # type: ignore[attr-defined]


def _is_nonlinear_or_embedding(param: Tensor) -> bool:
    """True for parameters an emerging optimizer leaves to Adam: not 2-D, or embedding / output."""
    return getattr(param, "is_embedding_or_output_parameter", False) or len(param.shape) != 2


def _is_muon_excluded(param: Tensor) -> bool:
    """True for parameters Muon leaves to its scalar optimizer (``use_muon=False`` too)."""
    return not getattr(param, "use_muon", True) or _is_nonlinear_or_embedding(param)


def _to_adam(name: str, fn: Callable[[Tensor], bool]) -> dict[ParamKey, dict[str, Any]]:
    """Default overrides sending the parameters ``fn`` selects to Adam."""
    return {ParamKey(predicate=ParamPredicate(name=name, fn=fn)): {"optimizer": "adam"}}


def _default_param_overrides_factory() -> dict[ParamKey, dict[str, Any]]:
    return _to_adam("nonlinear_or_embedding", _is_nonlinear_or_embedding)


@dataclass
class EmergingOptimizerEntry:
    """What Megatron needs to build one emerging optimizer.

    Attributes:
        optimizer_cls: the torch optimizer class.
        init_state_fn: creates the state of every parameter (checkpoint formats).
        config_to_kwargs: ``(config, model_chunks, pg_collection) -> constructor kwargs``; None: the class's
            parameters read from ``config`` (``<name>_<arg>``, then ``<arg>``) and Adam's betas.
        default_param_overrides: per-parameter overrides applied by default (non-matrices to Adam).
    """

    optimizer_cls: type
    init_state_fn: Callable = _eopt_init_state_fn
    config_to_kwargs: Callable | None = None
    default_param_overrides: dict[ParamKey, dict[str, Any]] = field(default_factory=_default_param_overrides_factory)


def _get_qkv_split_shapes(model_cfg: Any) -> list[int]:
    """Rows of q, k, v per query group of a fused QKV weight (q twice with ``attention_output_gate``)."""
    query = model_cfg.num_attention_heads // model_cfg.num_query_groups * model_cfg.kv_channels
    if getattr(model_cfg, "attention_output_gate", False):
        return [query, query, model_cfg.kv_channels, model_cfg.kv_channels]
    return [query, model_cfg.kv_channels, model_cfg.kv_channels]


def _kwargs_from_config(optimizer_cls: type, prefix: str, config: Any) -> dict[str, Any]:
    """The constructor's parameters found on ``config``: ``<prefix>_<name>`` first, then ``<name>``."""
    kwargs: dict[str, Any] = {}
    for name in inspect.signature(optimizer_cls.__init__).parameters:
        if name in ("self", "params"):
            continue
        for attr in (f"{prefix}_{name}", name):
            if hasattr(config, attr):
                kwargs[name] = getattr(config, attr)
                break
    return kwargs


def _muon_config_to_kwargs(config: Any, model_chunks: list[Any], pg_collection: Any) -> dict[str, Any]:
    kwargs = _kwargs_from_config(TensorParallelMuon, "muon", config)
    kwargs["nesterov"] = bool(getattr(config, "muon_nesterov", False) or getattr(config, "muon_use_nesterov", False))
    kwargs["is_qkv_fn"] = lambda p: getattr(p, "is_qkv", False)
    model_cfg = getattr(model_chunks[0], "config", None) if model_chunks else None
    kwargs["qkv_split_shapes"] = _get_qkv_split_shapes(model_cfg) if model_cfg is not None else None
    kwargs["split_qkv"] = kwargs.get("split_qkv", False) and kwargs["qkv_split_shapes"] is not None
    kwargs["pg_collection"] = pg_collection
    return kwargs


def _adaptive_muon_config_to_kwargs(config: Any, model_chunks: list[Any], pg_collection: Any) -> dict[str, Any]:
    kwargs = _muon_config_to_kwargs(config, model_chunks, pg_collection)
    own = _kwargs_from_config(TensorParallelAdaptiveMuon, "adaptive_muon", config)
    return {**kwargs, **{k: own[k] for k in ("moment2_method", "beta2", "eps") if k in own}}


def _soap_config_to_kwargs(config: Any, model_chunks: list[Any], pg_collection: Any) -> dict[str, Any]:
    kwargs = _kwargs_from_config(SOAP, "soap", config)
    kwargs["betas"] = (config.adam_beta1, config.adam_beta2)
    kwargs["eps"] = config.adam_eps
    return kwargs


# -------------------------------------------------------------------------------------- tensor-parallel Muon


def _groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    items = list(params)
    if items and isinstance(items[0], dict):
        return [dict(g, params=list(g["params"])) for g in items]
    return [{"params": items}]


def _split_qkv(groups: list[dict[str, Any]], is_qkv: Callable[[Tensor], bool],
               shapes: tuple[int, ...]) -> list[dict[str, Any]]:
    """Each group's QKV parameters in a group of their own (same settings, ``qkv_split_shapes`` set)."""
    out = []
    for group in groups:
        qkv = [p for p in group["params"] if is_qkv(p)]
        rest = [p for p in group["params"] if not is_qkv(p)]
        if rest:
            out.append({**group, "params": rest})
        if qkv:
            out.append({**group, "params": qkv, "qkv_split_shapes": shapes})
    return out


def _renamed(owner: str, name: str, value: Any, default: Any, old_name: str, old_value: Any) -> Any:
    """``value``, or the release's spelling ``old_value`` when only that was given."""
    if old_value is None:
        return value
    if value != default and value != old_value:
        raise ValueError(f"{owner}: {name}={value!r} and {old_name}={old_value!r} disagree; "
                         f"{old_name} is core_v0.16.1's name for {name}: pass one")
    return old_value


class TensorParallelMuon(Muon):
    """Megatron's ``TensorParallelMuon`` (its defaults) on optstack's ``Muon`` (module docstring).

    Args:
        params: 2-D parameters or param groups.
        lr, momentum, nesterov, weight_decay: as Megatron's (nesterov defaults to True here, as there).
        use_decoupled_weight_decay: must be True (optstack's Muon decays decoupled).
        split_qkv, is_qkv_fn, qkv_split_shapes: with ``split_qkv``, the parameters ``is_qkv_fn`` selects (all,
            when None) have their q, k and v rows orthogonalised separately (``qkv_split_shapes=(q, k, v)``).
        fp32_matmul_prec, coefficient_type, num_ns_steps, scale_mode, extra_scale_factor: Newton-Schulz settings.
        pg_collection: Megatron's ``ProcessGroupCollection`` (``tp`` / ``expt_tp``, ``gtp_remat`` /
            ``expt_gtp_remat`` read), or None.
        tp_mode: ``"duplicated"``, ``"blockwise"`` or ``"distributed"`` (module docstring).
        use_syrk: accepted (the Gram products are plain matmuls here; the result is the same).
        momentum_beta, use_nesterov, mode: core_v0.16.1's names of ``momentum``, ``nesterov`` and ``tp_mode``.

    Raises:
        ValueError: ``use_decoupled_weight_decay=False``, ``split_qkv`` without ``qkv_split_shapes``,
            ``num_ns_steps < 1``, or what optstack's Muon refuses.
    """

    def __init__(self, params: Iterable[Any], lr: float = 3e-4, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.01, use_decoupled_weight_decay: bool = True, split_qkv: bool = False,
                 is_qkv_fn: Callable[[Tensor], bool] | None = None, qkv_split_shapes: list[int] | None = None,
                 fp32_matmul_prec: str = "medium", coefficient_type: str = "quintic", num_ns_steps: int = 5,
                 scale_mode: str = "spectral", extra_scale_factor: float = 1.0, pg_collection: Any = None,
                 tp_mode: str = "duplicated", use_syrk: bool = False, *, momentum_beta: float | None = None,
                 use_nesterov: bool | None = None, mode: str | None = None) -> None:
        owner = type(self).__name__
        momentum = _renamed(owner, "momentum", momentum, 0.95, "momentum_beta", momentum_beta)
        nesterov = _renamed(owner, "nesterov", nesterov, True, "use_nesterov", use_nesterov)
        tp_mode = _renamed(owner, "tp_mode", tp_mode, "duplicated", "mode", mode)
        if num_ns_steps < 1:
            raise ValueError(f"num_ns_steps must be at least 1, got {num_ns_steps}")
        if use_syrk and not is_emerging_optimizers_min_version(_SYRK_MIN_EO_VERSION):
            raise ValueError(f"use_syrk requires emerging_optimizers >= {_SYRK_MIN_EO_VERSION}, but "
                             f"{get_emerging_optimizers_version()} is implemented; drop --muon-use-syrk")
        if not use_decoupled_weight_decay:
            raise ValueError(f"{owner}: use_decoupled_weight_decay=False is not supported by optstack's Muon "
                             "(weight decay is decoupled); set it True")
        if split_qkv and qkv_split_shapes is None:
            raise ValueError(f"{owner}: split_qkv=True needs qkv_split_shapes=[q, k, v] (rows per group)")
        self.pg_collection = pg_collection
        self.tp_mode = tp_mode
        self.split_qkv = split_qkv
        self.is_qkv_fn = is_qkv_fn
        self.qkv_split_shapes = qkv_split_shapes
        self.use_syrk = use_syrk
        self.scale_mode, self.extra_scale_factor = scale_mode, extra_scale_factor
        self._ns = dict(steps=num_ns_steps, coefficients=coefficient_type, precision=fp32_matmul_prec)
        groups = _groups(params)
        if split_qkv:
            groups = _split_qkv(groups, is_qkv_fn or (lambda p: True), tuple(qkv_split_shapes or ()))
        super().__init__(groups, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                         ns_coefficients=coefficient_type, ns_steps=num_ns_steps,  # type: ignore[arg-type]
                         scale_mode=scale_mode, extra_scale_factor=extra_scale_factor,  # type: ignore[arg-type]
                         matmul_precision=fp32_matmul_prec)  # type: ignore[arg-type]

    # -- Megatron's orthogonalisation hooks (tests replace scaled_orthogonalize_fn on the instance)

    def scaled_orthogonalize_fn(self, grad: Tensor, tp_group: Any, partition_dim: int | None = None) -> Tensor:
        """The scaled Newton-Schulz of ``grad``, this rank's shard along ``partition_dim`` of a matrix split over
        ``tp_group`` (None: a whole matrix); scaled by the whole matrix's shape."""
        size = [grad.size(-2), grad.size(-1)]
        parts = get_pg_size(tp_group) if partition_dim is not None else 1
        size[partition_dim if partition_dim is not None else 0] *= parts
        steps, coefficients, precision = self._ns["steps"], self._ns["coefficients"], self._ns["precision"]
        matmul_dtype = ns_matmul_dtype(precision, grad.device)  # type: ignore[arg-type]
        with matmul_precision(precision, grad.device):  # type: ignore[arg-type]
            if parts == 1:
                out = newton_schulz(grad, steps=steps, coefficients=coefficients, eps=NS_EPS,
                                    matmul_dtype=matmul_dtype)
            elif self.tp_mode == "distributed":
                (out,) = newton_schulz_blocks([grad], partition_dim, steps=steps, coefficients=coefficients,
                                              matmul_dtype=matmul_dtype,
                                              all_reduce=Comm(tp_group, name="tensor-parallel").all_reduce)
            else:  # duplicated: the whole matrix on every rank, this rank's part kept
                whole = self._all_gather_tensor(grad, tp_group, partition_dim)
                out = newton_schulz(whole, steps=steps, coefficients=coefficients, eps=NS_EPS,
                                    matmul_dtype=matmul_dtype)
                out = out.chunk(parts, partition_dim)[get_pg_rank(tp_group)].contiguous()
        return out * (muon_scale_factor(size[0], size[1], self.scale_mode) * self.extra_scale_factor)

    @staticmethod
    def _all_gather_tensor(t: Tensor, group: Any, dim: int) -> Tensor:
        """Equal shards of ``t`` from every rank of ``group``, joined along ``dim`` (Megatron's static method:
        ``torch.distributed.all_gather`` with positional arguments, as its tests replace it)."""
        shards = [torch.empty_like(t) for _ in range(get_pg_size(group))]
        dist.all_gather(shards, t.contiguous(), group)
        return torch.cat(shards, dim=dim)

    @staticmethod
    def _strip_pad(t: Tensor, pad_length: int) -> Tensor:
        return t[:-pad_length] if pad_length else t

    @staticmethod
    def _restore_pad(t: Tensor, pad_length: int) -> Tensor:
        return torch.nn.functional.pad(t, (0, 0, 0, pad_length)) if pad_length else t

    def scaled_orthogonalize_fn_with_gtp_remat(self, p: Tensor, grad: Tensor, tp_group: Any,
                                               partition_dim: int | None) -> Tensor:
        """``scaled_orthogonalize_fn`` for a parameter row-sharded by GTP weight rematerialisation (dim 0 padded
        by ``p.pad_length`` rows over the whole matrix): ``blockwise`` orthogonalises this rank's rows less its
        own padding; ``duplicated`` gathers the rows, strips the padding, orthogonalises and keeps this rank's
        rows; ``distributed`` runs Newton-Schulz over the GTP group (with tensor parallelism too: the smaller
        group is gathered first). Without GTP it is ``scaled_orthogonalize_fn``."""
        group = None
        if self.pg_collection is not None:
            group = getattr(self.pg_collection, "expt_gtp_remat" if getattr(p, "expert_tp", False)
                            else "gtp_remat", None)
        if group is None or get_pg_size(group) <= 1 or not getattr(p, "is_gtp_weight_remat", False):
            return self.scaled_orthogonalize_fn(grad, tp_group, partition_dim)
        size, rank, pad = get_pg_size(group), get_pg_rank(group), getattr(p, "pad_length", 0)
        if self.tp_mode == "blockwise":
            rows = grad.size(0)
            # the padding is the matrix's last rows: this rank holds those after (size - 1 - rank) full shards
            own_pad = min(rows, max(0, pad - (size - 1 - rank) * rows))
            if own_pad == rows:
                return torch.zeros_like(grad)  # all padding: NS(0) = 0
            return self._restore_pad(self.scaled_orthogonalize_fn(self._strip_pad(grad, own_pad), tp_group, None),
                                     own_pad)
        if self.tp_mode == "duplicated":
            whole = self._strip_pad(self._all_gather_tensor(grad, group, 0), pad)
            out = self._restore_pad(self.scaled_orthogonalize_fn(whole, tp_group, partition_dim), pad)
            rows = out.size(0) // size
            return out[rank * rows:(rank + 1) * rows].contiguous()
        if partition_dim is None or tp_group is None or get_pg_size(tp_group) <= 1:
            return self.scaled_orthogonalize_fn(grad, group, partition_dim=0)
        # GTP and TP both split the matrix: gather the smaller group, distribute over the larger
        if size >= get_pg_size(tp_group):
            small, small_dim, large, large_dim = tp_group, partition_dim, group, 0
        else:
            small, small_dim, large, large_dim = group, 0, tp_group, partition_dim
        out = self.scaled_orthogonalize_fn(self._all_gather_tensor(grad, small, small_dim), large, large_dim)
        width = out.size(small_dim) // get_pg_size(small)
        return out.narrow(small_dim, get_pg_rank(small) * width, width).contiguous()

    def orthogonalize(self, p: Tensor, grad: Tensor, **group: Any) -> Tensor:
        """The scaled orthogonalised ``grad`` of ``p`` (this rank's shard): its q, k, v rows separately for a
        group with ``qkv_split_shapes``, through its tensor-parallel group (``p.partition_dim``, not for
        ``blockwise``) and GTP rematerialisation."""
        tp_group = None
        if self.pg_collection is not None:
            tp_group = getattr(self.pg_collection, "expt_tp" if getattr(p, "expert_tp", False) else "tp", None)
        partition_dim = None if self.tp_mode == "blockwise" else getattr(p, "partition_dim", None)
        partition_dim = None if partition_dim == -1 else partition_dim
        shapes = getattr(p, "qkv_split_shapes", None) or group.get("qkv_split_shapes")
        if not shapes:
            return self.scaled_orthogonalize_fn_with_gtp_remat(p, grad, tp_group, partition_dim)
        rows, cols = grad.shape
        if rows % sum(shapes):
            raise RuntimeError(f"Muon QKV split shape mismatch: grad_shape={tuple(grad.shape)}, "
                               f"split_shapes={list(shapes)}")
        groups = rows // sum(shapes)
        blocks = torch.split(grad.view(groups, sum(shapes), cols), list(shapes), dim=1)
        out = [self.scaled_orthogonalize_fn_with_gtp_remat(p, b.reshape(-1, cols), tp_group, partition_dim)
               for b in blocks]
        return torch.cat([o.view(groups, -1, cols) for o in out], dim=1).view(grad.shape)

    # -- the step

    def _per_parameter(self) -> bool:
        """Step parameter by parameter rather than by core Muon's batched step: when some process group of
        ``pg_collection`` splits matrices across ranks."""
        pgs = self.pg_collection
        return pgs is not None and any(get_pg_size(getattr(pgs, n, None)) > 1
                                       for n in ("tp", "expt_tp", "gtp_remat", "expt_gtp_remat"))

    def _init_group(self, group: dict[str, Any], skip_non_grad_params: bool = True) -> None:
        """Create the state of the group's parameters (those with a gradient unless ``skip_non_grad_params``)."""
        for p in group["params"]:
            if p.grad is not None or not skip_non_grad_params:
                self.state[p].setdefault("momentum_buffer", torch.zeros_like(p, memory_format=torch.preserve_format))

    def _normalised(self, p: Tensor, o: Tensor, group: dict[str, Any]) -> Tensor:
        """The update from the scaled orthogonalised ``o`` (Muon: ``o`` itself)."""
        return o

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step; through the tensor-parallel groups when one splits matrices, else core Muon's batched step."""
        if not self._per_parameter():
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._init_group(group)
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            updates = momentum_updates([p.grad for p in params], [self.state[p]["momentum_buffer"] for p in params],
                                       group["momentum"], group["nesterov"])
            lr, wd = float(group["lr"]), float(group["weight_decay"])
            for p, update in zip(params, updates, strict=True):
                step = self._normalised(p, self.orthogonalize(p, update, **group), group)
                if wd != 0:
                    p.mul_(1 - lr * wd)
                p.add_(step, alpha=-lr)
        return loss


class TensorParallelAdaptiveMuon(TensorParallelMuon):
    """Megatron's ``TensorParallelAdaptiveMuon``: ``TensorParallelMuon``, then a second moment of the scaled
    orthogonalised update ``o`` (module docstring). Takes ``TensorParallelMuon``'s arguments and:

    Args:
        moment2_method: ``"adamuon"`` (``v`` the parameter's shape) or ``"normuon"`` (``v`` the mean of ``o**2``
            over the whole matrix's columns when rows >= cols, else its rows; that dimension kept as 1).
        beta2: EMA coefficient of ``v``. eps: ``adamuon``'s denominator term, ``normuon``'s floor of ``v``.

    State per parameter: ``"momentum_buffer"`` and ``"moment2_buffer"``.
    """

    def __init__(self, params: Iterable[Any], lr: float = 3e-4, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.01, use_decoupled_weight_decay: bool = True, split_qkv: bool = False,
                 is_qkv_fn: Callable[[Tensor], bool] | None = None, qkv_split_shapes: list[int] | None = None,
                 fp32_matmul_prec: str = "medium", coefficient_type: str = "quintic", num_ns_steps: int = 5,
                 scale_mode: str = "spectral", extra_scale_factor: float = 1.0, pg_collection: Any = None,
                 tp_mode: str = "duplicated", use_syrk: bool = False, moment2_method: str = "adamuon",
                 beta2: float = 0.95, eps: float = 1e-8) -> None:
        if moment2_method not in ("adamuon", "normuon"):
            raise ValueError(f"TensorParallelAdaptiveMuon: moment2_method must be 'adamuon' or 'normuon', got "
                             f"{moment2_method!r}")
        if not 0.0 <= beta2 < 1.0 or not eps > 0:
            raise ValueError(f"TensorParallelAdaptiveMuon: beta2 must be in [0, 1) and eps > 0, got beta2={beta2}, "
                             f"eps={eps}")
        super().__init__(params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                         use_decoupled_weight_decay=use_decoupled_weight_decay, split_qkv=split_qkv,
                         is_qkv_fn=is_qkv_fn, qkv_split_shapes=qkv_split_shapes, fp32_matmul_prec=fp32_matmul_prec,
                         coefficient_type=coefficient_type, num_ns_steps=num_ns_steps, scale_mode=scale_mode,
                         extra_scale_factor=extra_scale_factor, pg_collection=pg_collection, tp_mode=tp_mode,
                         use_syrk=use_syrk)
        self.moment2_method = moment2_method
        for group in self.param_groups:
            group.setdefault("beta2", beta2)
            group.setdefault("eps", eps)

    def _split(self, p: Tensor) -> tuple[Any, int | None]:
        """``p``'s tensor-parallel group and split dimension when its whole matrix is split across ranks."""
        if self.tp_mode == "blockwise" or self.pg_collection is None or getattr(p, "partition_dim", -1) in (None, -1):
            return None, None
        group = getattr(self.pg_collection, "expt_tp" if getattr(p, "expert_tp", False) else "tp", None)
        return (group, p.partition_dim) if get_pg_size(group) > 1 else (None, None)

    def _mean_dim(self, p: Tensor) -> int:
        """The dimension ``normuon`` averages over: the whole matrix's columns when rows >= cols, else its rows."""
        group, dim = self._split(p)
        shape = list(p.shape)
        if dim is not None:
            shape[dim] *= get_pg_size(group)
        return 1 if shape[0] >= shape[1] else 0

    def _init_group(self, group: dict[str, Any], skip_non_grad_params: bool = True) -> None:
        super()._init_group(group, skip_non_grad_params)
        for p in group["params"]:
            state = self.state[p]
            if "momentum_buffer" in state and "moment2_buffer" not in state:
                shape = list(p.shape)
                if self.moment2_method == "normuon":
                    shape[self._mean_dim(p)] = 1
                state["moment2_buffer"] = p.new_zeros(shape)

    def _normalised(self, p: Tensor, o: Tensor, group: dict[str, Any]) -> Tensor:
        v, beta2, eps = self.state[p]["moment2_buffer"], group["beta2"], group["eps"]
        if self.moment2_method == "adamuon":
            v.lerp_(o.square(), 1 - beta2)
            return o / (v.sqrt() + eps)
        dim = self._mean_dim(p)
        tp_group, split = self._split(p)
        if split == dim:  # the mean runs across the shards: sum them over the tensor-parallel group
            total = Comm(tp_group, name="tensor-parallel").all_reduce(o.square().sum(dim=dim, keepdim=True))
            mean = total / (o.size(dim) * get_pg_size(tp_group))
        else:
            mean = o.square().mean(dim=dim, keepdim=True)
        v.lerp_(mean, 1 - beta2)
        return o * v.clamp_min(eps).rsqrt()

    def _per_parameter(self) -> bool:
        return True  # core Muon's batched step has no second moment


class SOAP(CoreSOAP):
    """Emerging-Optimizers' ``SOAP`` (its arguments and defaults, which Megatron's tests construct) on the core
    ``SOAP``: KL-Shampoo factors (``use_kl_shampoo``), an update from the first step, ``eigh`` at every refresh,
    every side preconditioned. State and ``exported_state`` are the core's.

    Raises:
        ValueError: a bad setting; a parameter that is not 2-D (route it to Adam).
    """

    def __init__(self, params: Iterable[Any], lr: float = 3e-3, betas: tuple[float, float] = (0.9, 0.95),
                 shampoo_beta: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.01,
                 precondition_frequency: int = 1, use_kl_shampoo: bool = False) -> None:
        super().__init__(params, lr, tuple(betas), eps, weight_decay, shampoo_beta=shampoo_beta,
                         precondition_frequency=precondition_frequency, use_kl_shampoo=use_kl_shampoo,
                         update_first_step=True, use_eigh=True, max_precond_dim=sys.maxsize)


#: Megatron's registry: optimizer name -> how to build it.
_EMERGING_OPTIMIZERS: dict[str, EmergingOptimizerEntry] = {
    "muon": EmergingOptimizerEntry(optimizer_cls=TensorParallelMuon, config_to_kwargs=_muon_config_to_kwargs,
                                   default_param_overrides=_to_adam("muon_excluded", _is_muon_excluded)),
    "adaptive_muon": EmergingOptimizerEntry(
        optimizer_cls=TensorParallelAdaptiveMuon, config_to_kwargs=_adaptive_muon_config_to_kwargs,
        default_param_overrides=_to_adam("muon_excluded", _is_muon_excluded)),
    "soap": EmergingOptimizerEntry(optimizer_cls=SOAP, config_to_kwargs=_soap_config_to_kwargs),
}
