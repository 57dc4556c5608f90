"""SGD with momentum (heavy-ball or nesterov), dampening and L2 weight decay, equal to ``torch.optim.SGD``.

``sgd_reference`` is the single-tensor kernel (the test oracle). Paths: ``fused`` (``torch._fused_sgd_``, on CPU
and CUDA), ``foreach`` (``torch._foreach_*``), ``reference``; ``auto`` picks fused where it exists. Back-to-back
tensors are stepped as one flat tensor. State: ``momentum_buffer`` (only with momentum), in the param's dtype.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from optstack.algorithms._common import Impl, PerDeviceOptimizer, coalesce, resolve_impl, zeros_in_runs

__all__ = ["SGD", "kwargs_from_config", "sgd_reference"]

_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def sgd_reference(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor | None, *, lr: float,
                  momentum: float, dampening: float, weight_decay: float, nesterov: bool, first_step: bool,
                  maximize: bool = False) -> None:
    """One SGD step on single tensors, in place (``grad`` is only read), as ``torch.optim.SGD``.

    Args:
        param, grad: tensors of one shape.
        momentum_buffer: same shape; required when ``momentum != 0``. On ``first_step`` it is overwritten with
            the (decayed) gradient, as torch.optim does for a missing buffer.
        lr, momentum, dampening, weight_decay, nesterov: the hyperparameters (weight decay is L2).
        first_step: the buffer holds no history yet.
        maximize: ascend the objective (the gradient's sign flipped first, as torch's ``maximize``).
    """
    grad = -grad if maximize else grad
    d_p = grad.add(param, alpha=weight_decay) if weight_decay != 0 else grad
    if momentum != 0:
        if momentum_buffer is None:
            raise ValueError("sgd_reference: momentum_buffer is required when momentum != 0")
        if first_step:
            momentum_buffer.copy_(d_p)
        else:
            momentum_buffer.mul_(momentum).add_(d_p, alpha=1 - dampening)
        d_p = d_p.add(momentum_buffer, alpha=momentum) if nesterov else momentum_buffer
    param.add_(d_p, alpha=-lr)


def kwargs_from_config(config: Any) -> dict[str, Any]:
    """``SGD``'s kwargs from an ``OptimizerConfig``'s ``sgd`` section (the registry adds the base ones)."""
    return {"momentum": config.sgd.momentum, "nesterov": config.sgd.nesterov}


class SGD(PerDeviceOptimizer):
    """SGD, equal to ``torch.optim.SGD``, on any leaf tensors with ``.grad`` set.

    Tensors whose grad is None are skipped. Groups may override every hyperparameter and carry extra keys.

    Args:
        params: tensors or param-group dicts.
        lr: learning rate, >= 0.
        momentum: >= 0; 0 keeps no state.
        dampening: multiplies the gradient's share of the momentum update by (1 - dampening).
        weight_decay: L2 penalty, >= 0.
        nesterov: nesterov momentum (needs momentum > 0 and dampening 0).
        maximize: ascend the objective instead of descending; a per-group key.
        impl: "auto", "fused", "foreach" or "reference" (see the module docstring).
    """

    _name, _checked = "SGD", ("lr", "momentum", "weight_decay")
    # Its update is linear in the gradient, so a stage may hand it a sparse gradient densified (the same result
    # as torch's SGD stepping the sparse one); Adam-like state would read the missing rows as zero gradients.
    accepts_sparse_grads = True

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False, *,
                 maximize: bool = False, impl: Impl = "auto") -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "dampening": dampening,
                                  "weight_decay": weight_decay, "nesterov": nesterov, "maximize": maximize}, impl)

    def _check_group(self, index: int, group: dict[str, Any]) -> None:
        super()._check_group(index, group)
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(f"SGD param group {index}: nesterov needs momentum > 0 and dampening == 0, got "
                             f"momentum={group['momentum']!r}, dampening={group['dampening']!r}")

    _folds_grad_scale = True

    def keeps_state(self) -> bool:
        """Whether a step makes state: only groups with momentum keep a ``momentum_buffer``."""
        return any(group["momentum"] != 0 for group in self.param_groups)

    def _step_device(self, group: dict[str, Any], params: list[torch.Tensor], device: torch.device,
                     grad_scale: float = 1.0) -> None:
        impl = resolve_impl(self.impl, device, has_fused=True)
        hyper: dict[str, Any] = {k: float(group[k]) for k in ("lr", "momentum", "dampening", "weight_decay")}
        hyper["nesterov"] = bool(group["nesterov"])
        hyper["maximize"] = bool(group.get("maximize", False))
        grads = [p.grad for p in params]
        with_momentum = hyper["momentum"] != 0
        buffers: list[torch.Tensor | None] = [None] * len(params)
        first = [False] * len(params)
        if with_momentum:
            states = [self.state[p] for p in params]
            first = [state.get("momentum_buffer") is None for state in states]  # torch saves None without momentum
            new = [p for p, is_first in zip(params, first, strict=True) if is_first]
            for p, buffer in zip(new, zeros_in_runs(new), strict=True):
                self.state[p]["momentum_buffer"] = buffer
            buffers = [state["momentum_buffer"] for state in states]
        if impl == "reference":
            if grad_scale != 1.0:
                torch._foreach_mul_(grads, grad_scale)  # type: ignore[arg-type]
            for p, g, buffer, is_first in zip(params, grads, buffers, first, strict=True):
                sgd_reference(p, g, buffer, first_step=is_first, **hyper)
            return
        # One kernel call per (fused?, first step?, dtype) batch; a first step copies the gradient into the buffer.
        batches: dict[tuple[bool, bool, torch.dtype], list[int]] = {}
        for i, p in enumerate(params):
            tensors = [t for t in (p, grads[i], buffers[i]) if t is not None]
            fused = impl == "fused" and p.dtype in _FUSED_DTYPES and all(
                t.dtype == p.dtype and t.is_contiguous() for t in tensors)
            batches.setdefault((fused, first[i], p.dtype), []).append(i)
        for (fused, is_first, _), picked in batches.items():
            lists = [[ts[i] for i in picked] for ts in ((params, grads, buffers) if with_momentum else (params, grads))]
            merged, _ = coalesce(lists)  # type: ignore[arg-type]
            if fused:  # torch's kernel divides the gradients by its grad_scale (and writes them back)
                hyper["grad_scale"] = torch.tensor(1.0 / grad_scale, device=device) if grad_scale != 1.0 else None
            elif grad_scale != 1.0:
                torch._foreach_mul_(merged[1], grad_scale)
            (_fused if fused else _foreach)(merged[0], merged[1], merged[2] if with_momentum else [], is_first, hyper)


def _fused(params: list[torch.Tensor], grads: list[torch.Tensor], buffers: list[torch.Tensor], first_step: bool,
           hyper: dict[str, Any]) -> None:
    """torch's fused SGD kernel over tensors of one dtype and device (``buffers`` empty without momentum)."""
    torch._fused_sgd_(params, grads, buffers, weight_decay=hyper["weight_decay"], momentum=hyper["momentum"],
                      lr=hyper["lr"], dampening=hyper["dampening"], nesterov=hyper["nesterov"],
                      maximize=hyper["maximize"], is_first_step=first_step, grad_scale=hyper.get("grad_scale"))


def _foreach(params: list[torch.Tensor], grads: list[torch.Tensor], buffers: list[torch.Tensor], first_step: bool,
             hyper: dict[str, Any]) -> None:
    """``sgd_reference`` over lists with ``torch._foreach_*`` ops."""
    momentum, wd = hyper["momentum"], hyper["weight_decay"]
    grads = torch._foreach_neg(grads) if hyper["maximize"] else grads
    d_p = torch._foreach_add(grads, params, alpha=wd) if wd != 0 else grads
    if momentum != 0:
        if first_step:
            torch._foreach_copy_(buffers, d_p)
        else:
            torch._foreach_mul_(buffers, momentum)
            torch._foreach_add_(buffers, d_p, alpha=1 - hyper["dampening"])
        d_p = torch._foreach_add(d_p, buffers, alpha=momentum) if hyper["nesterov"] else buffers
    torch._foreach_add_(params, d_p, alpha=-hyper["lr"])
