"""Several stages stepped as one optimizer: one loss scaler, one global grad norm, one clip factor, one skip
decision, one state dict.

Dense and expert parameters, or Muon and its scalar optimizer, live in separate stages; a plain optimizer
is a chain of one stage; a rank with nothing to optimize holds a chain of none (it still returns a
``StepResult``). The step reads every gradient once before the update (``Stage.grad_stats``) and syncs
with the host once for the norm and the finite check of all stages together.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from optstack.clip import check_norm_type, clip_coefficient
from optstack.precision.scaler import LossScaler, NoScaler
from optstack.protocol import StepResult, phase
from optstack.stage import Stage

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
            their ``zero_grad_buffer()``.
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
        seen: dict[int, int] = {}
        for index, stage in enumerate(stages):
            if not isinstance(stage, Stage):
                raise ValueError(f"stages[{index}] must be an optstack Stage, got {type(stage).__name__}")
            for piece in stage.pieces:
                if seen.setdefault(id(piece.param), index) != index:
                    raise ValueError(
                        f"a parameter of shape {tuple(piece.param.shape)} is in stages[{seen[id(piece.param)]}] "
                        f"and stages[{index}]; every parameter must belong to exactly one stage")
        if scaler is not None and not isinstance(scaler, LossScaler):
            raise ValueError(f"scaler must be a LossScaler (NoScaler, ConstantScaler, DynamicScaler), got {scaler!r}")
        if isinstance(clip_grad, bool) or not isinstance(clip_grad, (int, float)) or not clip_grad >= 0:
            raise ValueError(f"clip_grad must be a number >= 0 (0 disables clipping), got {clip_grad!r}")
        if grad_norm_skip_threshold is not None and not (
            isinstance(grad_norm_skip_threshold, (int, float)) and grad_norm_skip_threshold > 0
        ):
            raise ValueError(f"grad_norm_skip_threshold must be None or a number > 0, got {grad_norm_skip_threshold!r}")
        self._stages = stages
        self._scaler: LossScaler = scaler if scaler is not None else NoScaler()
        self.clip_grad = float(clip_grad)
        self.norm_type = check_norm_type(norm_type)
        self.grad_norm_skip_threshold = grad_norm_skip_threshold
        self.log_num_zeros_in_grad = bool(log_num_zeros_in_grad)
        self._grad_syncs = list(grad_syncs)

    def __repr__(self) -> str:
        kinds = ", ".join(repr(s) for s in self._stages)
        return f"ChainedOptimizer([{kinds}], scaler={type(self._scaler).__name__}, clip_grad={self.clip_grad})"

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
    def step(self, closure: Callable[[], Any] | None = None) -> StepResult:
        """One step of every stage, or of none.

        A non-finite gradient in any stage skips the step (no parameter, optimizer state or step count
        changes) and reports ``grad_norm=None``; a global norm above ``grad_norm_skip_threshold`` skips it
        too, reporting the norm. ``closure``, if given, is called first with grad enabled.
        """
        if closure is not None:
            with torch.enable_grad():
                closure()
        if self._grad_syncs:
            with phase("finish_grad_sync"):
                for sync in self._grad_syncs:
                    sync.finish_grad_sync()
        inv_scale = self._scaler.inv_scale
        with phase("grad_norm"):
            total, nonfinite = self._global_stats()
        self._scaler.update(nonfinite)
        if nonfinite:
            return StepResult(applied=False, grad_norm=None, num_zeros=None, loss_scale=self._scaler.scale)
        inf = math.isinf(self.norm_type)
        grad_norm = (total if inf else total ** (1.0 / self.norm_type)) * inv_scale
        if self.grad_norm_skip_threshold is not None and grad_norm > self.grad_norm_skip_threshold:
            return StepResult(applied=False, grad_norm=grad_norm, num_zeros=None, loss_scale=self._scaler.scale)
        coeff = clip_coefficient(grad_norm, self.clip_grad) if self.clip_grad > 0 else 1.0
        num_zeros = None
        if self.log_num_zeros_in_grad:
            with phase("count_zeros"):
                counts = [stage.count_zeros() for stage in self._stages]
                num_zeros = int(sum(int(c.item()) for c in counts))
        with phase("inner_step"):
            for stage in self._stages:
                stage.step(grad_scale=inv_scale * coeff)
        return StepResult(applied=True, grad_norm=grad_norm, num_zeros=num_zeros, loss_scale=self._scaler.scale)

    def _global_stats(self) -> tuple[float, bool]:
        """(sum over stages of sum |g|^p, or the max for inf; whether any gradient is non-finite): one host
        sync for all stages."""
        stats = [stage.grad_stats(self.norm_type) for stage in self._stages]
        if not stats:
            return 0.0, False
        stacked = torch.stack([s.to(stats[0].device) for s in stats])
        norm = stacked[:, 0].max() if math.isinf(self.norm_type) else stacked[:, 0].sum()
        total, nonfinite = torch.stack([norm, stacked[:, 1].max()]).tolist()
        return total, nonfinite > 0

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
        """``{"stages": [each stage's name-keyed state dict], "scaler": the scaler's}``."""
        return {"stages": [stage.state_dict() for stage in self._stages], "scaler": self._scaler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """All or nothing: every stage's part and the scaler's are validated before any is applied; on a
        mismatch a ``ValueError`` names it and the optimizer is unchanged."""
        if not isinstance(state_dict, dict) or not {"stages", "scaler"} <= state_dict.keys():
            raise ValueError("chained optimizer state dict must be a dict with 'stages' and 'scaler'")
        parts = state_dict["stages"]
        if not isinstance(parts, (list, tuple)) or len(parts) != len(self._stages):
            got = len(parts) if isinstance(parts, (list, tuple)) else type(parts).__name__
            raise ValueError(f"state dict has {got} stages, this optimizer has {len(self._stages)}; it was saved "
                             "from an optimizer built with a different set of stages (dense/expert, algorithms)")
        for index, (stage, part) in enumerate(zip(self._stages, parts, strict=True)):
            try:
                stage.validate_state_dict(part)
            except ValueError as exc:
                raise ValueError(f"stages[{index}] ({stage!r}): {exc}") from exc
        self._scaler.validate_state_dict(state_dict["scaler"])
        for stage, part in zip(self._stages, parts, strict=True):
            stage.load_state_dict(part)
        self._scaler.load_state_dict(state_dict["scaler"])
