"""The torch optimizers Megatron builds by name, with Megatron's signatures: ``HybridDeviceOptimizer`` (CPU
offload of a fraction of the step) and ``TensorParallelMuon`` (Muon), translated to optstack's
``optstack.offload.HybridDeviceOptimizer`` and ``optstack.algorithms.muon.Muon``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

from optstack.algorithms.muon import Muon
from optstack.offload.hybrid import HybridDeviceOptimizer as _CoreHybrid

__all__ = ["HybridDeviceOptimizer", "TensorParallelMuon"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _accepted(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``cls`` takes (Megatron passes TE/Apex-only ones such as ``bias_correction``)."""
    parameters = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in parameters}


class HybridDeviceOptimizer(_CoreHybrid):
    """Megatron's ``HybridDeviceOptimizer``: the first ``offload_fraction`` of the parameters' elements (in
    group order) are stepped on the host by ``cpu_optimizer_cls``, the rest on their device by
    ``gpu_optimizer_cls``; results equal the non-offloaded step.

    Args:
        params: parameters or param groups, as for a torch optimizer.
        offload_fraction: share of the elements stepped on the host, in [0, 1].
        cpu_optimizer_cls / gpu_optimizer_cls: torch optimizer classes of one algorithm (default
            ``torch.optim.AdamW``); keyword arguments a class does not take are left out for it.
        param_update_in_fp32: the host step's precision for bf16/fp16 parameters; optstack steps them in their
            own dtype, so True with such parameters is refused (``get_megatron_optimizer`` with
            ``optimizer_cpu_offload=True`` and ``bf16=True`` offloads fp32 masters instead).
        pin_cpu_grads / pin_cpu_params: host buffers are pinned whenever the device is CUDA.
        overlap_cpu_optimizer_d2h_h2d: overlap the copies with the device step (CUDA streams).
        **kwargs: the optimizers' hyperparameters (``lr``, ``betas``, ``weight_decay``, ...).

    Raises:
        ValueError: a bad fraction, or ``param_update_in_fp32=True`` with bf16/fp16 parameters.
    """

    def __init__(self, params: Iterable[Any], offload_fraction: float = 0.5,
                 cpu_optimizer_cls: type[torch.optim.Optimizer] | None = None,
                 gpu_optimizer_cls: type[torch.optim.Optimizer] | None = None, param_update_in_fp32: bool = False,
                 pin_cpu_grads: bool = True, pin_cpu_params: bool = True,
                 overlap_cpu_optimizer_d2h_h2d: bool = True, **kwargs: Any) -> None:
        cpu_cls = cpu_optimizer_cls or torch.optim.AdamW
        gpu_cls = gpu_optimizer_cls or cpu_cls
        inner = gpu_cls(params, **_accepted(gpu_cls, kwargs))
        low = sorted({str(p.dtype) for g in inner.param_groups for p in g["params"] if p.dtype in _LOW_PRECISION})
        if param_update_in_fp32 and low:
            raise ValueError(
                f"HybridDeviceOptimizer: param_update_in_fp32=True with {low} parameters is not supported (optstack "
                "steps offloaded tensors in their own dtype); offload fp32 masters instead: "
                "get_megatron_optimizer(OptimizerConfig(optimizer_cpu_offload=True, bf16=True, ...), model)")

        def make(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
            on_host = all(p.device.type == "cpu" for g in groups for p in g["params"])
            cls = cpu_cls if on_host else gpu_cls
            return cls(groups, **_accepted(cls, kwargs))

        super().__init__(inner, make, fraction=offload_fraction, overlap_transfers=overlap_cpu_optimizer_d2h_h2d)
        self.offload_fraction = offload_fraction


class TensorParallelMuon(Muon):
    """Megatron's ``TensorParallelMuon`` (Emerging-Optimizers' Muon, Megatron's defaults) on optstack's Muon.

    Args:
        params: 2-D parameters or param groups.
        lr, momentum, nesterov, weight_decay: as Megatron's (nesterov defaults to True here, as there).
        use_decoupled_weight_decay: must be True (optstack's Muon decays decoupled).
        split_qkv, is_qkv_fn, qkv_split_shapes: with ``split_qkv``, the parameters ``is_qkv_fn`` selects (all,
            when None) have their q, k and v rows orthogonalised separately (``qkv_split_shapes=(q, k, v)``).
        fp32_matmul_prec, coefficient_type, num_ns_steps, scale_mode, extra_scale_factor: Newton-Schulz settings.
        pg_collection, tp_mode: optstack runs Muon without tensor parallelism, where the three ``tp_mode`` s
            coincide; a ``pg_collection`` with a tensor-parallel group of more than one rank is refused.
        use_syrk: accepted; optstack's Newton-Schulz batches its matmuls instead.
        momentum_beta, use_nesterov, mode: core_v0.16.1's names of ``momentum``, ``nesterov`` and ``tp_mode``.

    Raises:
        ValueError: ``use_decoupled_weight_decay=False``, ``split_qkv`` without ``qkv_split_shapes``, a
            tensor-parallel group of size > 1, ``num_ns_steps < 1``, or what optstack's Muon refuses.
    """

    def __init__(self, params: Iterable[Any], lr: float = 3e-4, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.01, use_decoupled_weight_decay: bool = True, split_qkv: bool = False,
                 is_qkv_fn: Callable[[torch.Tensor], bool] | None = None, qkv_split_shapes: list[int] | None = None,
                 fp32_matmul_prec: str = "medium", coefficient_type: str = "quintic", num_ns_steps: int = 5,
                 scale_mode: str = "spectral", extra_scale_factor: float = 1.0, pg_collection: Any = None,
                 tp_mode: str = "duplicated", use_syrk: bool = False, *, momentum_beta: float | None = None,
                 use_nesterov: bool | None = None, mode: str | None = None) -> None:
        momentum = _renamed("momentum", momentum, 0.95, "momentum_beta", momentum_beta)
        nesterov = _renamed("nesterov", nesterov, True, "use_nesterov", use_nesterov)
        tp_mode = _renamed("tp_mode", tp_mode, "duplicated", "mode", mode)
        if num_ns_steps < 1:
            raise ValueError(f"num_ns_steps must be at least 1, got {num_ns_steps}")
        if not use_decoupled_weight_decay:
            raise ValueError("TensorParallelMuon: use_decoupled_weight_decay=False is not supported by optstack's "
                             "Muon (weight decay is decoupled); set it True")
        if split_qkv and qkv_split_shapes is None:
            raise ValueError("TensorParallelMuon: split_qkv=True needs qkv_split_shapes=[q, k, v] (rows per group)")
        tp = getattr(pg_collection, "tp", None)
        if tp is not None and tp.size() > 1:
            raise ValueError(f"TensorParallelMuon: tensor-parallel size {tp.size()} is not supported (optstack has "
                             "no tensor parallelism); use tp=1")
        groups = _groups(params)
        if split_qkv:
            groups = _split_qkv(groups, is_qkv_fn or (lambda p: True), tuple(qkv_split_shapes or ()))
        super().__init__(groups, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                         ns_coefficients=coefficient_type, ns_steps=num_ns_steps,  # type: ignore[arg-type]
                         scale_mode=scale_mode, extra_scale_factor=extra_scale_factor,  # type: ignore[arg-type]
                         matmul_precision=fp32_matmul_prec)  # type: ignore[arg-type]


def _renamed(name: str, value: Any, default: Any, old_name: str, old_value: Any) -> Any:
    """``value``, or the release's spelling ``old_value`` when only that was given."""
    if old_value is None:
        return value
    if value != default and value != old_value:
        raise ValueError(f"TensorParallelMuon: {name}={value!r} and {old_name}={old_value!r} disagree; "
                         f"{old_name} is core_v0.16.1's name for {name}: pass one")
    return old_value


def _groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    items = list(params)
    if items and isinstance(items[0], dict):
        return [dict(g, params=list(g["params"])) for g in items]
    return [{"params": items}]


def _split_qkv(groups: list[dict[str, Any]], is_qkv: Callable[[torch.Tensor], bool],
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
