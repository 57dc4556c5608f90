"""The one protocol every runtime layer of optstack speaks, and the typed result of a step.

Layers wrap each other (algorithm -> precision -> distribution -> chained). The outermost object a user
holds exposes ``step() -> StepResult``, ``zero_grad()``, ``state_dict()``, ``load_state_dict()`` and
``param_groups``. Inside, a *stage* (one precision/distribution layer around one inner ``torch.optim``
optimizer) exposes the finer phases that a chained optimizer sequences across all stages so that there is
one global grad norm, one clip factor and one skip decision:

    found_inf = any(stage.prepare_grads(inv_scale) for stage in stages)  # copy/unscale grads, inf check
    norm      = sqrt(sum(stage.grad_norm_sq() for stage in stages))  # each stage reduces over its own group
    clip, then stage.scale_grads(coeff) ; stage.step_with_ready_grads()

The chained optimizer owns the single loss scaler; a plain single optimizer is a chain of one stage.
The inner algorithm never knows whether it sees whole parameters or flat shard views.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["StepResult", "Stage", "phase", "set_phase_hook"]


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did.

    Attributes:
        applied: False when the step was skipped (non-finite gradient, or grad norm above the skip threshold);
            then no parameter and no optimizer state changed.
        grad_norm: the global gradient norm before clipping (None when the step was skipped for a
            non-finite gradient, as in Megatron).
        num_zeros: number of zero gradient elements, when counting was asked for, else None.
        loss_scale: the loss scale in force after the step (1.0 when there is no scaler).
    """

    applied: bool
    grad_norm: float | None
    num_zeros: int | None
    loss_scale: float


class Stage(ABC):
    """One optimizer stage: an inner ``torch.optim.Optimizer`` plus how its gradients are prepared.

    Subclasses: the fp32 stage, the mixed-precision stage (fp32 masters), the ZeRO-1 stage (shard masters),
    the layer-wise stage. ``param_groups`` are the inner optimizer's groups (the scheduler writes ``lr`` and
    ``weight_decay`` into them).
    """

    @property
    @abstractmethod
    def param_groups(self) -> list[dict[str, Any]]: ...

    @abstractmethod
    def prepare_grads(self, inv_scale: float) -> bool:
        """Make the inner optimizer's ``.grad`` tensors ready: copy to masters and multiply by ``inv_scale``
        (1 / loss scale; the chained optimizer owns the one loss scaler).

        Returns:
            True when a non-finite value was found in this stage's gradients (already agreed across the
            ranks this stage spans, so every rank returns the same answer).
        """

    @abstractmethod
    def grad_norm_sq(self, norm_type: float) -> torch.Tensor:
        """This stage's contribution to the global grad norm: sum of |g|^p (or max |g| for inf), as a 0-d
        fp32 tensor, reduced over the ranks the stage's gradients are split across, duplicates counted once."""

    @abstractmethod
    def count_zeros(self) -> int:
        """Number of zero elements in this stage's gradients, reduced like ``grad_norm_sq``."""

    @abstractmethod
    def scale_grads(self, factor: float) -> None:
        """Multiply the ready gradients by ``factor`` (clipping)."""

    @abstractmethod
    def step_with_ready_grads(self) -> None:
        """Run the inner optimizer and publish the results to the model parameters."""

    @abstractmethod
    def zero_grad(self, set_to_none: bool = True) -> None: ...

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


# Observability: one hook, not timers threaded through every function.
_phase_hook: Callable[[str], contextlib.AbstractContextManager[None]] | None = None


def set_phase_hook(hook: Callable[[str], contextlib.AbstractContextManager[None]] | None) -> None:
    """Install a callback ``hook(name) -> context manager`` entered around each named phase of a step
    (e.g. ``torch.profiler.record_function`` or a timer). None removes it."""
    global _phase_hook
    _phase_hook = hook


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark a named phase of the step (``prepare_grads``, ``clip``, ``inner_step``, ...) for the phase hook."""
    if _phase_hook is None:
        yield
    else:
        with _phase_hook(name):
            yield
