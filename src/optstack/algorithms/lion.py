"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): the sign of an interpolated
momentum, decoupled weight decay, one state tensor (``exp_avg``, the momentum m, in the param's dtype).

    update = sign(beta1 * m + (1 - beta1) * g)
    p     *= 1 - lr * weight_decay
    p     -= lr * update
    m      = beta2 * m + (1 - beta2) * g

``lion_reference`` is the single-tensor kernel (the test oracle); the fast path is ``foreach`` (torch has no
fused Lion), with back-to-back tensors stepped as one flat tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch

from optstack.algorithms._common import PerDeviceOptimizer, coalesce, zeros_in_runs

__all__ = ["Lion", "kwargs_from_config", "lion_reference"]


def lion_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, lr: float, beta1: float,
                   beta2: float, weight_decay: float) -> None:
    """One Lion step on single tensors, in place (``grad`` is only read).

    ``lerp(m, g, 1 - beta)`` is ``beta * m + (1 - beta) * g`` in one rounding.

    Args:
        param, grad, exp_avg: tensors of one shape.
        lr, beta1, beta2, weight_decay: the hyperparameters (weight decay is decoupled).
    """
    update = exp_avg.lerp(grad, 1 - beta1).sign_()
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    param.add_(update, alpha=-lr)
    exp_avg.lerp_(grad, 1 - beta2)


def kwargs_from_config(config: Any) -> dict[str, Any]:
    """``Lion``'s kwargs from an ``OptimizerConfig``'s ``lion`` section (the registry adds the base ones)."""
    return {"betas": (config.lion.beta1, config.lion.beta2)}


class Lion(PerDeviceOptimizer):
    """Lion on any leaf tensors with ``.grad`` set; tensors whose grad is None are skipped.

    Groups may override ``lr``, ``betas`` and ``weight_decay`` and carry extra keys. Lion's update has unit
    magnitude per element, so its lr is typically 3-10x smaller than AdamW's and its weight decay larger.

    Args:
        params: tensors or param-group dicts.
        lr: learning rate, >= 0.
        betas: (beta1, beta2) in [0, 1): beta1 interpolates the update, beta2 is the momentum decay.
        weight_decay: decoupled weight decay, >= 0.
        impl: "auto" (= "foreach"), "foreach" or "reference".
    """

    _name, _checked = "Lion", ("lr", "betas", "weight_decay")

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-4,
                 betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0, *,
                 impl: Literal["auto", "foreach", "reference"] = "auto") -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay}, impl,
                         ("auto", "foreach", "reference"))

    def _step_device(self, group: dict[str, Any], params: list[torch.Tensor], device: torch.device) -> None:
        new = [p for p in params if "exp_avg" not in self.state[p]]
        for p, exp_avg in zip(new, zeros_in_runs(new), strict=True):
            self.state[p]["exp_avg"] = exp_avg
        grads = [p.grad for p in params]
        exp_avgs = [self.state[p]["exp_avg"] for p in params]
        beta1, beta2 = (float(b) for b in group["betas"])
        hyper = {"lr": float(group["lr"]), "beta1": beta1, "beta2": beta2,
                 "weight_decay": float(group["weight_decay"])}
        if self.impl == "reference":
            for p, g, m in zip(params, grads, exp_avgs, strict=True):
                lion_reference(p, g, m, **hyper)
            return
        batches: dict[torch.dtype, list[int]] = {}  # foreach ops take one dtype per call
        for i, p in enumerate(params):
            batches.setdefault(p.dtype, []).append(i)
        for picked in batches.values():
            merged, _ = coalesce([[ts[i] for i in picked] for ts in (params, grads, exp_avgs)])
            _foreach(*merged, **hyper)


def _foreach(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor], *,
             lr: float, beta1: float, beta2: float, weight_decay: float) -> None:
    """``lion_reference`` over lists with ``torch._foreach_*`` ops (the same ops, so the same bits)."""
    updates = torch._foreach_lerp(exp_avgs, grads, 1 - beta1)
    torch._foreach_sign_(updates)
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_add_(params, updates, alpha=-lr)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta2)
