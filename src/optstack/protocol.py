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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["MakeOptimizer", "ParamShard", "StepResult", "Stage", "algorithm_name", "phase", "set_phase_hook"]

#: Builds a stage's inner optimizer over exactly the param groups it is given (in order).
MakeOptimizer = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


def algorithm_name(optimizer: torch.optim.Optimizer) -> str:
    """The name that identifies ``optimizer``'s algorithm in checkpoints (``ParamShard.algorithm``): its
    ``algorithm_name`` attribute when it has one (an optimizer standing in for another, e.g. CPU offload's
    ``HybridDeviceOptimizer``, gives the name of the one it replaces), else its class name."""
    return getattr(optimizer, "algorithm_name", type(optimizer).__name__)


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


@dataclass(frozen=True)
class ParamShard:
    """What one rank holds of one parameter's optimizer state: elements ``[start, end)`` of the flattened
    (row-major) parameter. A stage that holds whole parameters gives ``start=0, end=numel``.

    This is the name-keyed, layout-free form checkpoints are made of: a stage maps parameter names to
    ``ParamShard``s (``Stage.param_shards``), and loads them back (``Stage.load_param_shards``) whatever
    layout they were saved from, once the checkpoint has cut them to the range the stage holds.

    Attributes:
        shape: the whole parameter's shape.
        start: first flat element held (inclusive).
        end: last flat element held (exclusive); ``start <= end <= prod(shape)``.
        tensors: element-wise tensors, each 1-D with ``end - start`` elements: ``"param"`` (the fp32 master,
            or the parameter itself when it is stepped directly) and each element-wise optimizer state
            (``exp_avg``, ``momentum_buffer``, ...) in its storage dtype. References when a stage gives
            them (copy to snapshot while training goes on).
        scalars: per-parameter state that is not element-wise, as numbers or 0-d tensors (e.g. ``"step"``).
        group: the settings of the param group holding the parameter (``lr``, ``weight_decay``, ``max_lr``,
            ``min_lr``, ``wd_mult``, ``lr_mult``, ...; never ``params``). When a stage gives it, it is its
            live group dict: a checkpoint writes the saved ``lr``/``weight_decay`` into it.
        algorithm: ``algorithm_name`` of the inner optimizer (``"AdamW"``, ``"Muon"``): with the group's
            settings, it identifies the group a parameter belongs to across layouts.
    """

    shape: tuple[int, ...]
    start: int
    end: int
    tensors: Mapping[str, torch.Tensor]
    scalars: Mapping[str, Any] = field(default_factory=dict)
    group: Mapping[str, Any] = field(default_factory=dict)
    algorithm: str = ""

    @property
    def numel(self) -> int:
        """Elements held (``end - start``)."""
        return self.end - self.start


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

    def finish_param_sync(self) -> None:  # noqa: B027 - optional hook
        """Wait for parameter gathers still in flight after a step (when they overlap the next forward), so
        the model parameters are current: call before evaluating or saving outside the training loop."""

    def validate_state_dict(self, state_dict: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Raise ValueError naming what differs if ``state_dict`` cannot be loaded; change nothing.

        The chained optimizer validates every stage before loading any, so a load is all-or-nothing."""

    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    # -- name-keyed state (checkpoints) ---------------------------------------------------------------
    # Not abstract, so a stage written before checkpoints existed still builds; checkpoints name it.
    def param_shards(self) -> dict[str, ParamShard]:
        """What this rank holds of each parameter, by parameter name (tensors are references).

        Parameters this rank holds nothing of are absent. Every rank of a stage calls it at the same point
        (a stage may first wait for collectives in flight).
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement param_shards(); it cannot be "
                                  "saved in a name-keyed checkpoint")

    def load_param_shards(self, shards: Mapping[str, ParamShard]) -> None:
        """Load name-keyed state: for each parameter this rank holds, a ``ParamShard`` of the same range
        as ``param_shards()`` gives (the checkpoint cuts it out). Optimizer state that does not exist yet
        (before the first step) is created, and the loaded values are published to the model parameters
        as a step publishes them (collective: every rank of the stage calls it, as ``param_shards``), so
        afterwards the model holds the loaded masters. Raises ``ValueError`` naming the parameter when one
        is missing or does not fit; then nothing changes."""
        raise NotImplementedError(f"{type(self).__name__} does not implement load_param_shards(); it cannot "
                                  "be loaded from a name-keyed checkpoint")


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
