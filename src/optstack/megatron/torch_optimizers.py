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
from optstack.offload.hybrid import _StateView, plan_offload

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

    With ``param_update_in_fp32`` each bf16/fp16 parameter gets an fp32 copy (``param_to_fp32_param``; in host
    memory for the offloaded ones, on the parameter's device otherwise) that is stepped in its place: the
    gradient is copied into it, the step updates it in fp32 and its value is copied (rounded) back into the
    parameter, as in Megatron. ``param_groups`` and ``state`` are keyed by the model's parameters; under
    ``param_update_in_fp32`` each state entry of ``state_dict()`` carries the tensor stepped as
    ``"master_param"``, and ``load_state_dict`` restores the fp32 copies from it (the model's parameters are
    not written: they come from the model's checkpoint).

    Args:
        params: parameters or param groups, as for a torch optimizer.
        offload_fraction: share of the elements stepped on the host, in [0, 1].
        cpu_optimizer_cls / gpu_optimizer_cls: torch optimizer classes of one algorithm (default
            ``torch.optim.AdamW``); keyword arguments a class does not take are left out for it.
        param_update_in_fp32: step bf16/fp16 parameters through fp32 copies (above).
        pin_cpu_grads / pin_cpu_params: host buffers are pinned whenever the device is CUDA.
        overlap_cpu_optimizer_d2h_h2d: overlap the copies with the device step (CUDA streams).
        **kwargs: the optimizers' hyperparameters (``lr``, ``betas``, ``weight_decay``, ...).

    Attributes:
        param_to_fp32_param: ``{bf16/fp16 parameter: its fp32 copy}`` (empty without ``param_update_in_fp32``).

    Raises:
        ValueError: a bad fraction.
    """

    def __init__(self, params: Iterable[Any], offload_fraction: float = 0.5,
                 cpu_optimizer_cls: type[torch.optim.Optimizer] | None = None,
                 gpu_optimizer_cls: type[torch.optim.Optimizer] | None = None, param_update_in_fp32: bool = False,
                 pin_cpu_grads: bool = True, pin_cpu_params: bool = True,
                 overlap_cpu_optimizer_d2h_h2d: bool = True, **kwargs: Any) -> None:
        cpu_cls = cpu_optimizer_cls or torch.optim.AdamW
        gpu_cls = gpu_optimizer_cls or cpu_cls
        groups = _groups(params)
        model_params = [p for g in groups for p in g["params"]]
        masters = _fp32_copies(model_params, offload_fraction) if param_update_in_fp32 else {}
        inner = gpu_cls([{**g, "params": [masters.get(p, p) for p in g["params"]]} for g in groups],
                        **_accepted(gpu_cls, kwargs))

        def make(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
            on_host = all(p.device.type == "cpu" for g in groups for p in g["params"])
            cls = cpu_cls if on_host else gpu_cls
            return cls(groups, **_accepted(cls, kwargs))

        super().__init__(inner, make, fraction=offload_fraction, overlap_transfers=overlap_cpu_optimizer_d2h_h2d)
        self.offload_fraction = offload_fraction
        self.param_update_in_fp32 = param_update_in_fp32
        self.param_to_fp32_param: dict[torch.Tensor, torch.Tensor] = masters
        if masters:  # the core steps the fp32 copies; Megatron's callers see the model's parameters
            for param, master in masters.items():
                self._owners[id(param)] = self._owners[id(master)]
            positions = iter(model_params)
            for group in self.param_groups:
                group["params"] = [next(positions) for _ in group["params"]]
            self.state = _StateView(self._owners, model_params)  # type: ignore[assignment]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """The step; under ``param_update_in_fp32`` the gradients go to the fp32 copies first and their
        updated values back into the parameters after."""
        if not self.param_to_fp32_param:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for param, master in self.param_to_fp32_param.items():
            if param.grad is None:
                master.grad = None
                continue
            if master.grad is None:
                master.grad = torch.empty_like(master, pin_memory=master.is_pinned())
            master.grad.copy_(param.grad)
        super().step()
        for param, master in self.param_to_fp32_param.items():
            if master.grad is not None:
                param.copy_(master)  # rounded to the parameter's dtype, as Megatron's copy back
        return loss

    def state_dict(self) -> dict[str, Any]:
        """torch's format over the model's parameters; under ``param_update_in_fp32`` every entry also holds
        ``"master_param"``: the tensor stepped (the fp32 copy, or the fp32 parameter itself)."""
        out = super().state_dict()
        if self.param_update_in_fp32:
            params = [p for g in self.param_groups for p in g["params"]]
            out["state"] = {i: {**entry, "master_param": self.param_to_fp32_param.get(params[i], params[i])}
                            for i, entry in out["state"].items()}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict()``'s format; ``"master_param"`` entries go into the fp32 copies (none for an fp32
        parameter, whose value is the model's)."""
        masters = getattr(self, "param_to_fp32_param", {})
        params = [p for g in self.param_groups for p in g["params"]]
        saved = {}
        state = {}
        for index, entry in state_dict["state"].items():
            entry = dict(entry)
            value = entry.pop("master_param", None)
            if isinstance(value, torch.Tensor) and index < len(params) and params[index] in masters:
                saved[index] = value
            state[index] = entry
        super().load_state_dict({**state_dict, "state": state})
        with torch.no_grad():
            for index, value in saved.items():
                masters[params[index]].copy_(value.reshape(params[index].shape))

    def update_fp32_param_by_new_param(self) -> None:
        """Copy the parameters' current values into their fp32 copies (e.g. after loading model weights)."""
        with torch.no_grad():
            for param, master in self.param_to_fp32_param.items():
                master.copy_(param)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for master in self.param_to_fp32_param.values():
            master.grad = None  # set from the parameter's gradient at the next step


def _fp32_copies(params: list[torch.Tensor], fraction: float) -> dict[torch.Tensor, torch.Tensor]:
    """An fp32 copy of each bf16/fp16 parameter: in host memory (pinned on CUDA) for those the offload plan
    puts on the host (the leading ``fraction`` of elements), else on the parameter's device."""
    on_host = {id(p) for p in params[:plan_offload([p.numel() for p in params], fraction)]}
    out = {}
    for p in params:
        if p.dtype in _LOW_PRECISION:
            host = id(p) in on_host
            master = torch.empty(p.shape, dtype=torch.float32, device="cpu" if host else p.device,
                                 pin_memory=host and p.device.type == "cuda")
            master.copy_(p.detach())
            out[p] = master
    return out


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
