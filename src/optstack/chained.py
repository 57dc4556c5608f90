"""Several optimizer stages stepped as one: one loss scaler, one global grad norm, one clip factor, one skip
decision, and one state dict.

Dense and expert parameters, or Muon and its scalar optimizer, live in separate stages; a plain single
optimizer is a chain of one stage, and a rank with nothing to optimize holds a chain of none (it still
returns a ``StepResult``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from optstack.clip import check_norm_type, clip_coefficient
from optstack.precision.scaler import LossScaler, NoScaler
from optstack.protocol import Stage, StepResult, phase

__all__ = ["ChainedOptimizer", "GradSync"]


class GradSync(Protocol):
    """What a data-parallel wrapper offers the optimizer (optstack's ``DataParallel`` is one)."""

    def finish_grad_sync(self) -> None: ...

    def zero_grad_buffer(self) -> None: ...


class ChainedOptimizer:
    """Steps a sequence of stages as one optimizer.

    Args:
        stages: the stages, each over its own parameters (no parameter in two stages).
        scaler: the one loss scaler of the run (default: ``NoScaler``).
        clip_grad: clip the global grad norm to this value; 0 disables clipping.
        norm_type: p of the grad norm (2.0; ``float('inf')`` for the max-norm).
        grad_norm_skip_threshold: skip the whole step when the global grad norm exceeds this (None: never).
        log_num_zeros_in_grad: count zero gradient elements into ``StepResult.num_zeros``.
        grad_syncs: objects owning the model's gradients (data-parallel wrappers): ``step`` first calls
            their ``finish_grad_sync()`` (a no-op when the training loop already did) and ``zero_grad``
            calls their ``zero_grad_buffer()``.
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        *,
        scaler: LossScaler | None = None,
        clip_grad: float = 0.0,
        norm_type: float = 2.0,
        grad_norm_skip_threshold: float | None = None,
        log_num_zeros_in_grad: bool = False,
        grad_syncs: Sequence[GradSync] = (),
    ) -> None:
        stages = list(stages)
        for index, stage in enumerate(stages):
            if not isinstance(stage, Stage):
                raise ValueError(f"stages[{index}] must be an optstack Stage, got {type(stage).__name__}")
        seen: dict[int, int] = {}
        for index, stage in enumerate(stages):
            for group in stage.param_groups:
                for param in group["params"]:
                    if seen.setdefault(id(param), index) != index:
                        raise ValueError(
                            f"a parameter of shape {tuple(param.shape)} is in stages[{seen[id(param)]}] and "
                            f"stages[{index}]; every parameter must belong to exactly one stage"
                        )
        if scaler is not None and not isinstance(scaler, LossScaler):
            raise ValueError(
                f"scaler must be a LossScaler (NoScaler, ConstantScaler, DynamicScaler), got {scaler!r}"
            )
        if isinstance(clip_grad, bool) or not isinstance(clip_grad, (int, float)) or not clip_grad >= 0:
            raise ValueError(f"clip_grad must be a number >= 0 (0 disables clipping), got {clip_grad!r}")
        if grad_norm_skip_threshold is not None and not (
            isinstance(grad_norm_skip_threshold, (int, float)) and grad_norm_skip_threshold > 0
        ):
            raise ValueError(
                f"grad_norm_skip_threshold must be None or a number > 0, got {grad_norm_skip_threshold!r}"
            )
        self._stages = stages
        self._scaler: LossScaler = scaler if scaler is not None else NoScaler()
        self.clip_grad = float(clip_grad)
        self.norm_type = check_norm_type(norm_type)
        self.grad_norm_skip_threshold = grad_norm_skip_threshold
        self.log_num_zeros_in_grad = bool(log_num_zeros_in_grad)
        self._grad_syncs = list(grad_syncs)

    def __repr__(self) -> str:
        kinds = ", ".join(type(s).__name__ for s in self._stages)
        return (
            f"ChainedOptimizer([{kinds}], scaler={type(self._scaler).__name__}, clip_grad={self.clip_grad})"
        )

    # -- views ---------------------------------------------------------------------------------------
    @property
    def stages(self) -> list[Stage]:
        return list(self._stages)

    @property
    def scaler(self) -> LossScaler:
        return self._scaler

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every stage's param groups, in stage order (live dicts: a scheduler may write ``lr`` into them)."""
        return [group for stage in self._stages for group in stage.param_groups]

    @property
    def loss_scale(self) -> float:
        return self._scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss multiplied by the current loss scale; call ``backward()`` on this."""
        return self._scaler.scale_loss(loss)

    # -- the step ------------------------------------------------------------------------------------
    def _global_norm(self) -> float:
        pows = [stage.grad_norm_sq(self.norm_type) for stage in self._stages]
        if not pows:
            return 0.0
        device = pows[0].device
        stacked = torch.stack([p.to(device) for p in pows])
        if math.isinf(self.norm_type):
            return float(stacked.max().item())
        return float(stacked.sum().item()) ** (1.0 / self.norm_type)

    def step(self, closure: Callable[[], Any] | None = None) -> StepResult:
        """One step of every stage, or of none.

        A non-finite gradient in any stage skips the step (no parameter, optimizer state or step count
        changes) and reports ``grad_norm=None``; a global norm above ``grad_norm_skip_threshold`` skips it
        too, reporting the norm. ``closure``, if given, is called first with grad enabled (its loss is not
        returned; take it from your training loop).
        """
        if closure is not None:
            with torch.enable_grad():
                closure()
        if self._grad_syncs:
            with phase("finish_grad_sync"):
                for sync in self._grad_syncs:
                    sync.finish_grad_sync()
        with phase("prepare_grads"):
            found = [stage.prepare_grads(self._scaler.inv_scale) for stage in self._stages]
        found_inf = any(found)
        self._scaler.update(found_inf)
        if found_inf:
            return StepResult(applied=False, grad_norm=None, num_zeros=None, loss_scale=self._scaler.scale)
        with phase("grad_norm"):
            grad_norm = self._global_norm()
        if self.grad_norm_skip_threshold is not None and grad_norm > self.grad_norm_skip_threshold:
            return StepResult(
                applied=False, grad_norm=grad_norm, num_zeros=None, loss_scale=self._scaler.scale
            )
        if self.clip_grad > 0:
            coeff = clip_coefficient(grad_norm, self.clip_grad)
            if coeff < 1.0:
                with phase("clip"):
                    for stage in self._stages:
                        stage.scale_grads(coeff)
        num_zeros = None
        if self.log_num_zeros_in_grad:
            with phase("count_zeros"):
                num_zeros = sum(stage.count_zeros() for stage in self._stages)
        with phase("inner_step"):
            for stage in self._stages:
                stage.step_with_ready_grads()
        return StepResult(
            applied=True, grad_norm=grad_norm, num_zeros=num_zeros, loss_scale=self._scaler.scale
        )

    def finish_param_sync(self) -> None:
        """Wait for every stage's overlapped parameter gathers (before evaluation or saving)."""
        for stage in self._stages:
            stage.finish_param_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for sync in self._grad_syncs:
            sync.zero_grad_buffer()
        for stage in self._stages:
            stage.zero_grad(set_to_none)

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"stages": [each stage's state dict], "scaler": the scaler's}``."""
        return {"stages": [stage.state_dict() for stage in self._stages], "scaler": self._scaler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """All or nothing: every stage's part and the scaler's are validated before any is applied; on a
        mismatch a ``ValueError`` names it and the optimizer is unchanged."""
        if not isinstance(state_dict, dict) or not {"stages", "scaler"} <= state_dict.keys():
            raise ValueError("chained optimizer state dict must be a dict with 'stages' and 'scaler'")
        parts = state_dict["stages"]
        if not isinstance(parts, (list, tuple)) or len(parts) != len(self._stages):
            got = len(parts) if isinstance(parts, (list, tuple)) else type(parts).__name__
            raise ValueError(
                f"state dict has {got} stages, this optimizer has {len(self._stages)}; it was saved from an "
                "optimizer built with a different set of stages (dense/expert, algorithms)"
            )
        for index, (stage, part) in enumerate(zip(self._stages, parts, strict=True)):
            try:
                stage.validate_state_dict(part)
            except ValueError as exc:
                raise ValueError(f"stages[{index}] ({type(stage).__name__}): {exc}") from exc
        self._scaler.validate_state_dict(state_dict["scaler"])
        for stage, part in zip(self._stages, parts, strict=True):
            stage.load_state_dict(part)
        self._scaler.load_state_dict(state_dict["scaler"])
