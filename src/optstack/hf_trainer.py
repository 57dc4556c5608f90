"""Hugging Face ``Trainer`` driving an optstack optimizer: the one habit that goes wrong silently, caught.

Trainer clips ``p.grad`` itself before ``optimizer.step()`` unless ``TrainingArguments(max_grad_norm=0)``
(its default is 1.0). With ``OptimizerConfig.clip_grad > 0`` optstack clips again and measures (and reports) the
already clipped norm. optstack does not import ``transformers``: the check looks for a running ``Trainer`` among
the callers of the first step, once per optimizer.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch

__all__ = ["warn_if_trainer_clips_too"]

_MAX_FRAMES = 64  # Trainer's loop is a few frames above the step (accelerate's optimizer wrapper in between)


def warn_if_trainer_clips_too(optimizer: torch.optim.Optimizer, clip_grad: float) -> None:
    """Warn once, at ``optimizer``'s first step, when a Hugging Face ``Trainer`` with ``max_grad_norm > 0``
    drives it and optstack clips too (``clip_grad > 0``; with 0, Trainer's clipping is the only one)."""
    if clip_grad <= 0:
        return
    checked = False

    def check(opt: Any, args: Any, kwargs: Any) -> None:
        nonlocal checked
        if checked:
            return
        checked = True
        trainer = _calling_trainer()
        norm = getattr(getattr(trainer, "args", None), "max_grad_norm", None)
        if norm is not None and norm > 0:
            warnings.warn(
                f"Hugging Face Trainer clips the gradients (TrainingArguments.max_grad_norm={norm}; its default is "
                f"1.0) before optstack's step, which clips them again (OptimizerConfig.clip_grad={clip_grad}) and "
                "reports the already clipped norm. Pass TrainingArguments(max_grad_norm=0) and let optstack clip "
                "(one global norm over every stage, after loss unscaling), or set clip_grad=0", UserWarning,
                stacklevel=3)

    optimizer.register_step_pre_hook(check)


def _calling_trainer() -> Any:
    """The ``transformers.Trainer`` whose method is among the callers, or None (nothing is imported)."""
    module = sys.modules.get("transformers.trainer")
    cls = getattr(module, "Trainer", None)
    if cls is None:
        return None
    frame = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, cls):
            return candidate
        frame = frame.f_back
    return None
