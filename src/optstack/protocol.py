"""The ground-floor types of optstack's runtime: the typed result of a step, the name-keyed parameter shard
(the one state format), the inner-optimizer maker, and the one observability hook (``phase``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["MakeOptimizer", "ParamShard", "StepResult", "algorithm_name", "phase", "set_phase_hook", "unhooked_step"]

#: Builds a stage's inner optimizer over exactly the param groups it is given (in order).
MakeOptimizer = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


def algorithm_name(optimizer: torch.optim.Optimizer) -> str:
    """The name that identifies ``optimizer``'s algorithm in checkpoints (``ParamShard.algorithm``): its
    ``algorithm_name`` attribute when it has one (an optimizer standing in for another, e.g. CPU offload's
    ``HybridDeviceOptimizer``, gives the name of the one it replaces), else its class name."""
    return getattr(optimizer, "algorithm_name", type(optimizer).__name__)


def unhooked_step(optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
    """``optimizer.step`` without torch's hook wrapper, for an optimizer that is a part of the one the user
    holds: that one's step runs torch's global and its own step hooks once per user-visible step, so global
    hooks never see optstack's inner objects (nor run once more per stage)."""
    step = type(optimizer).step
    return functools.partial(getattr(step, "__wrapped__", step), optimizer)


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


# Observability: one hook, not timers threaded through every function.
_phase_hook: Callable[[str], contextlib.AbstractContextManager[None]] | None = None


def set_phase_hook(hook: Callable[[str], contextlib.AbstractContextManager[None]] | None) -> None:
    """Install a callback ``hook(name) -> context manager`` entered around each named phase of a step
    (e.g. ``torch.profiler.record_function`` or a timer). None removes it."""
    global _phase_hook
    _phase_hook = hook


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark a named phase of the step (``grad_norm``, ``inner_step``, ``param_gather``, ...) for the phase hook."""
    if _phase_hook is None:
        yield
    else:
        with _phase_hook(name):
            yield
