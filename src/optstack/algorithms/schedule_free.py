"""Schedule-Free AdamW (Defazio et al. 2024, facebookresearch/schedule_free's ``AdamWScheduleFree``): no learning
rate schedule; the parameters hold an interpolation ``y`` of a fast sequence ``z`` and its weighted average ``x``.

Per element, step ``k`` (0-based), with ``lr_k = lr * min(1, (k + 1) / warmup_steps)``::

    v   = beta2 * v + (1 - beta2) * g**2
    d   = g / (sqrt(v / (1 - beta2**(k + 1))) + eps) + weight_decay * y      # decay at y, as the package
    lr_max = max(lr_max, lr_k);  w = (k + 1)**r * lr_max**weight_lr_power;  W += w;  c = w / W
    y   = (1 - c) * y + c * z - lr_k * (1 - beta1 * (1 - c)) * d               # = lerp(y, z, c) + ...
    z   = z - lr_k * d

and the averaged weights to evaluate are ``x = (y - (1 - beta1) z) / beta1``. ``eval()`` puts ``x`` into the
parameters, ``train()`` puts ``y`` back; the optimizer the user holds (``ChainedOptimizer.train`` / ``eval``)
forwards them to every stage, which then publishes the parameters as after a step (masters to the model,
ZeRO-1 gathers). A step in eval mode is refused.

Everything is element-wise, so any range of a flat buffer can be stepped alone (ZeRO-1 range shards, DTensor
local shards). State per parameter: ``"z"`` and ``"exp_avg_sq"`` (the parameter's shape), and the scalars
``"step"``, ``"weight_sum"``, ``"lr_max"`` (kept per parameter, not per group as the package does, so that
name-keyed checkpoints carry them) and ``"eval_weights"`` (whether the parameter holds ``x``). Checkpoints hold
both sequences: the parameter (``y``, or ``x`` when saved in eval mode, as the package advises) and ``z``. After
loading, call ``train()`` (as the package requires): it swaps exactly the parameters that hold ``x``; a step on
parameters still holding ``x`` is refused (its gradient was taken at the wrong weights).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from optstack.algorithms._common import PerDeviceOptimizer

__all__ = ["ScheduleFreeAdamW", "ScheduleFreeSGD", "kwargs_from_config", "schedule_free_adamw_reference",
           "schedule_free_sgd_reference", "sgd_kwargs_from_config"]


def _weights(step: int, lr: float, warmup_steps: int, lr_max: float, weight_sum: float, r: float,
             weight_lr_power: float) -> tuple[float, float, float, float]:
    """(this step's lr, the new lr_max, the new weight_sum, the averaging coefficient c) for 0-based ``step``."""
    lr = lr * ((step + 1) / warmup_steps if step < warmup_steps else 1.0)
    lr_max = max(lr, lr_max)
    weight = (step + 1) ** r * lr_max**weight_lr_power
    weight_sum += weight
    return lr, lr_max, weight_sum, (weight / weight_sum if weight_sum != 0 else 0.0)


def schedule_free_adamw_reference(param: Tensor, grad: Tensor, z: Tensor, exp_avg_sq: Tensor, *, step: int,
                                  weight_sum: float, lr_max: float, lr: float, beta1: float, beta2: float,
                                  eps: float, weight_decay: float, warmup_steps: int, r: float,
                                  weight_lr_power: float) -> tuple[float, float]:
    """One Schedule-Free AdamW step on single tensors in train mode (``param`` holds ``y``), in place: the
    formula of the module docstring, the test oracle. ``step`` is 0-based. Returns the new
    ``(weight_sum, lr_max)``."""
    lr, lr_max, weight_sum, c = _weights(step, lr, warmup_steps, lr_max, weight_sum, r, weight_lr_power)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    d = grad / (exp_avg_sq / (1 - beta2 ** (step + 1))).sqrt().add_(eps)
    if weight_decay != 0:
        d.add_(param, alpha=weight_decay)
    param.lerp_(z, c)
    param.add_(d, alpha=lr * (beta1 * (1 - c) - 1))
    z.sub_(d, alpha=lr)
    return weight_sum, lr_max


def schedule_free_sgd_reference(param: Tensor, grad: Tensor, z: Tensor, *, step: int, weight_sum: float,
                                lr_max: float, lr: float, momentum: float, weight_decay: float, warmup_steps: int,
                                r: float, weight_lr_power: float) -> tuple[float, float]:
    """One Schedule-Free SGD step on single tensors in train mode, in place: AdamW's formula with ``d = g +
    weight_decay * y`` (no second moment) and ``momentum`` in place of ``beta1``, as ``schedulefree.SGDScheduleFree``.
    Returns the new ``(weight_sum, lr_max)``."""
    lr, lr_max, weight_sum, c = _weights(step, lr, warmup_steps, lr_max, weight_sum, r, weight_lr_power)
    d = grad + weight_decay * param if weight_decay != 0 else grad
    param.lerp_(z, c)
    param.add_(d, alpha=lr * (momentum * (1 - c) - 1))
    z.sub_(d, alpha=lr)
    return weight_sum, lr_max


def kwargs_from_config(config: Any) -> dict[str, Any]:
    """``ScheduleFreeAdamW``'s kwargs from an ``OptimizerConfig``'s ``schedule_free`` section."""
    s = config.schedule_free
    return {"betas": (s.beta1, s.beta2), "eps": s.eps, "warmup_steps": s.warmup_steps, "r": s.r,
            "weight_lr_power": s.weight_lr_power}


def sgd_kwargs_from_config(config: Any) -> dict[str, Any]:
    """``ScheduleFreeSGD``'s kwargs from an ``OptimizerConfig``'s ``schedule_free`` section (``beta1`` is SGD's
    ``momentum``: the same interpolation between ``z`` and ``x``)."""
    s = config.schedule_free
    return {"momentum": s.beta1, "warmup_steps": s.warmup_steps, "r": s.r, "weight_lr_power": s.weight_lr_power}


class _ScheduleFree(PerDeviceOptimizer):
    """The train / eval swap and the refusals Schedule-Free AdamW and SGD share; subclasses name their
    interpolation coefficient (``_beta1``) and step a device's tensors (``_update``)."""

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        self.train_mode = True
        super().__init__(params, defaults, "foreach", impls=("foreach",))

    def _beta1(self, group: dict[str, Any]) -> float:
        raise NotImplementedError

    def _check_group(self, index: int, group: dict[str, Any]) -> None:
        super()._check_group(index, group)
        if self._beta1(group) == 0.0:
            raise ValueError(f"{self._name} param group {index}: {self._beta1_key} must be in (0, 1): x = (y - (1 - "
                             f"beta1) z) / beta1 needs beta1 > 0, got {self._beta1(group)!r}")

    _beta1_key = "betas[0]"

    @torch.no_grad()
    def eval(self) -> None:
        """Put the averaged weights ``x`` into every parameter that has state (``train()`` undoes it)."""
        self._swap(to_eval=True)
        self.train_mode = False

    @torch.no_grad()
    def train(self) -> None:
        """Put the training sequence ``y`` back into every parameter that has state."""
        self._swap(to_eval=False)
        self.train_mode = True

    def _swap(self, *, to_eval: bool) -> None:
        for group in self.param_groups:
            beta1 = self._beta1(group)
            for p in group["params"]:
                state = self.state.get(p)
                if state and "z" in state and state["eval_weights"] != to_eval:
                    # y = (1 - beta1) z + beta1 x  <=>  x = y + (1 - 1 / beta1) (z - y)
                    p.lerp_(state["z"], (1 - 1 / beta1) if to_eval else (1 - beta1))
                    state["eval_weights"] = to_eval

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, grad_scale: float = 1.0) -> Any:  # type: ignore[override]
        """One step (``PerDeviceOptimizer.step``), refused before anything changes when a parameter holds ``x``:
        in eval mode, or after loading state saved in eval mode without ``train()``."""
        if not self.train_mode:
            raise RuntimeError(f"{self._name}: step() in eval mode (the parameters hold the averaged weights x); "
                               "call optimizer.train() before training and optimizer.eval() before evaluating")
        if any(self.state.get(p, {}).get("eval_weights") for g in self.param_groups for p in g["params"]):
            raise RuntimeError(f"{self._name}: the parameters hold the averaged weights x (state loaded from a "
                               "checkpoint saved in eval mode), so this gradient was taken at x, not at the "
                               "training weights y; call optimizer.train() after loading, before the forward")
        return super().step(closure, grad_scale=grad_scale)

    def _fresh_state(self, p: Tensor) -> dict[str, Any]:
        return {"z": p.detach().clone(memory_format=torch.preserve_format), "step": 0, "weight_sum": 0.0,
                "lr_max": -1.0, "eval_weights": False}

    def _step_device(self, group: dict[str, Any], params: list[Tensor], device: torch.device) -> None:
        for p in params:
            if "z" not in self.state[p]:
                self.state[p].update(self._fresh_state(p))
        # params of one group share their step count unless some missed steps (no grad): batch by the count
        by_step: dict[tuple[int, float, float], list[Tensor]] = {}
        for p in params:
            s = self.state[p]
            by_step.setdefault((int(s["step"]), float(s["weight_sum"]), float(s["lr_max"])), []).append(p)
        for (step, weight_sum, lr_max), ps in by_step.items():
            lr, lr_max, weight_sum, c = _weights(step, float(group["lr"]), int(group["warmup_steps"]), lr_max,
                                                 weight_sum, float(group["r"]), float(group["weight_lr_power"]))
            d = self._direction(group, ps, step)
            if float(group["weight_decay"]) != 0:
                torch._foreach_add_(d, ps, alpha=float(group["weight_decay"]))
            zs = [self.state[p]["z"] for p in ps]
            torch._foreach_lerp_(ps, zs, c)
            torch._foreach_add_(ps, d, alpha=lr * (self._beta1(group) * (1 - c) - 1))
            torch._foreach_sub_(zs, d, alpha=lr)
            for p in ps:
                self.state[p].update(step=step + 1, weight_sum=weight_sum, lr_max=lr_max)

    def _direction(self, group: dict[str, Any], params: list[Tensor], step: int) -> list[Tensor]:
        """The step direction before weight decay (fresh tensors: the gradients are left as they were)."""
        raise NotImplementedError


class ScheduleFreeAdamW(_ScheduleFree):
    """Schedule-Free AdamW, equal to ``schedulefree.AdamWScheduleFree`` (see the module docstring).

    Starts in train mode (the parameters hold ``y``; at the start ``x = y = z``). Call ``eval()`` before
    evaluating or saving weights for inference, ``train()`` before the next step.

    Args:
        params: tensors or param-group dicts.
        lr: learning rate (constant: no scheduler is needed), >= 0.
        betas: (beta1: interpolation between ``z`` and ``x``, beta2: the second moment), each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: >= 0, applied at ``y`` through the gradient.
        warmup_steps: linear warmup of the learning rate over this many steps (0: none).
        r: polynomial weighting power of the average.
        weight_lr_power: the average's weights are ``lr_max ** weight_lr_power`` (0: uniform).
    """

    _name = "ScheduleFreeAdamW"
    _checked = ("lr", "betas", "eps", "weight_decay", "warmup_steps", "r", "weight_lr_power")

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float = 0.0025,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0, *,
                 warmup_steps: int = 0, r: float = 0.0, weight_lr_power: float = 2.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                                  "warmup_steps": warmup_steps, "r": r, "weight_lr_power": weight_lr_power})

    def _beta1(self, group: dict[str, Any]) -> float:
        return float(group["betas"][0])

    def _fresh_state(self, p: Tensor) -> dict[str, Any]:
        return super()._fresh_state(p) | {"exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}

    def _direction(self, group: dict[str, Any], params: list[Tensor], step: int) -> list[Tensor]:
        beta2 = float(group["betas"][1])
        grads = [p.grad for p in params]
        vs = [self.state[p]["exp_avg_sq"] for p in params]
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, grads, grads, value=1 - beta2)
        denom = torch._foreach_div(vs, 1 - beta2 ** (step + 1))
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, float(group["eps"]))
        return torch._foreach_div(grads, denom)


class ScheduleFreeSGD(_ScheduleFree):
    """Schedule-Free SGD, equal to ``schedulefree.SGDScheduleFree``: ``ScheduleFreeAdamW`` without the second
    moment (``d = g + weight_decay * y``), ``momentum`` the interpolation between ``z`` and ``x``. Same train /
    eval swap, refusals and state (``"z"`` and the scalars; no ``"exp_avg_sq"``).

    Args:
        params: tensors or param-group dicts.
        lr: learning rate (constant: no scheduler is needed), >= 0 (the package's default 1.0).
        momentum: in (0, 1): ``x = (y - (1 - momentum) z) / momentum``.
        weight_decay: >= 0, applied at ``y`` through the gradient.
        warmup_steps, r, weight_lr_power: as ``ScheduleFreeAdamW``.
    """

    _name = "ScheduleFreeSGD"
    _checked = ("lr", "momentum", "weight_decay", "warmup_steps", "r", "weight_lr_power")
    _beta1_key = "momentum"

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float = 1.0, momentum: float = 0.9,
                 weight_decay: float = 0.0, *, warmup_steps: int = 0, r: float = 0.0,
                 weight_lr_power: float = 2.0) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                                  "warmup_steps": warmup_steps, "r": r, "weight_lr_power": weight_lr_power})

    def _check_group(self, index: int, group: dict[str, Any]) -> None:
        momentum = group["momentum"]
        if not isinstance(momentum, int | float) or isinstance(momentum, bool) or not 0.0 < momentum < 1.0:
            raise ValueError(f"{self._name} param group {index}: momentum must be in (0, 1), got {momentum!r}")
        super()._check_group(index, group)

    def _beta1(self, group: dict[str, Any]) -> float:
        return float(group["momentum"])

    def _direction(self, group: dict[str, Any], params: list[Tensor], step: int) -> list[Tensor]:
        return [p.grad.clone() for p in params]
