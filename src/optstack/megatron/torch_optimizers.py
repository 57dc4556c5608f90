"""The torch optimizers Megatron builds by name, with Megatron's signatures: ``HybridDeviceOptimizer`` (CPU
offload of a fraction of the step, on ``optstack.offload.HybridDeviceOptimizer``), ``Lion`` (Emerging-Optimizers'
signature, on ``optstack.algorithms.lion.Lion``), and ``TensorParallelMuon`` / ``TensorParallelAdaptiveMuon``
(from ``emerging_optimizers.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

from optstack.algorithms.lion import Lion as CoreLion
from optstack.megatron.emerging_optimizers import TensorParallelAdaptiveMuon, TensorParallelMuon, _groups
from optstack.offload.hybrid import HybridDeviceOptimizer as _CoreHybrid
from optstack.offload.hybrid import _StateView, plan_offload

__all__ = ["HybridDeviceOptimizer", "Lion", "TensorParallelAdaptiveMuon", "TensorParallelMuon"]

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
    ``gpu_optimizer_cls``; results equal the non-offloaded step. ``param_groups`` and ``state`` are keyed by the
    model's parameters.

    With ``param_update_in_fp32`` each bf16/fp16 parameter gets an fp32 copy (``param_to_fp32_param``; on the host
    for the offloaded ones) that is stepped in its place and rounded back into the parameter, as in Megatron;
    ``state_dict()`` entries carry it as ``"master_param"``, which ``load_state_dict`` restores (the model's
    parameters come from the model's checkpoint).

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


class Lion(CoreLion):
    """Emerging-Optimizers' ``Lion`` signature on optstack's Lion: ``weight_decay_method`` ``"decoupled"`` (the
    core's ``p *= 1 - lr * wd``) or ``"l2"`` (``wd * p`` added to the gradient the sign update reads).

    Raises:
        ValueError: an unknown ``weight_decay_method``, or what optstack's Lion refuses.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, weight_decay_method: str = "decoupled") -> None:
        if weight_decay_method not in ("decoupled", "l2"):
            raise ValueError(f"Lion: weight_decay_method must be 'decoupled' or 'l2', got {weight_decay_method!r}")
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)
        for group in self.param_groups:
            group.setdefault("weight_decay_method", weight_decay_method)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *,  # type: ignore[override]
             grad_scale: float = 1.0) -> Any:
        """One step; ``l2`` groups step on ``grad_scale * grad + wd * p`` with no decoupled decay (gradients and
        settings restored after); ``grad_scale`` as the core's (a stage's loss-scale and clip factor)."""
        l2 = {id(g) for g in self.param_groups if g["weight_decay_method"] == "l2" and g["weight_decay"] != 0}
        if not l2:
            return super().step(closure, grad_scale=grad_scale)
        # wd * p joins the scaled gradient: the scale is applied here, to every group
        grads = [(p, p.grad) for g in self.param_groups for p in g["params"] if p.grad is not None]
        decays = [(g, g["weight_decay"]) for g in self.param_groups if id(g) in l2]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grad = p.grad.mul(grad_scale) if grad_scale != 1.0 else p.grad
                    p.grad = grad.add(p, alpha=group["weight_decay"]) if id(group) in l2 else grad
        for group, _ in decays:
            group["weight_decay"] = 0.0
        try:
            return super().step(closure)
        finally:
            for group, wd in decays:
                group["weight_decay"] = wd
            for p, grad in grads:
                p.grad = grad
