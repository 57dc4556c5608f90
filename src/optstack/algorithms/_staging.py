"""Adam's kernels on tensors they cannot take as they are (low-precision moments or params, mixed dtypes,
non-contiguous tensors): each is copied into a slice of a reused fp32 (fp64 for fp64 params) scratch buffer of
``CHUNK`` elements per operand, the kernel runs over a batch of slices, and the results are rounded back.
Reusing the scratch keeps the copies in cache and allocates nothing per step: a bf16-state step costs ~1.6x
the fp32 one (fresh temporaries ~8x, mostly page faults; 20M params, 1 thread). Large tensors are cut into
``CHUNK``-element pieces (exact: the math is element-wise). The fp16 second moment is stored as
``grad_rms = sqrt(v / (1 - beta2**step))`` (see ``adamw.py``), decoded on the way in, encoded on the way out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["CHUNK", "rms_to_v", "run_staged", "v_to_rms"]

CHUNK = 1 << 20  # elements per operand per batch: 4 MiB of fp32, about a cache (measured best of 2^16..2^20)

Kernel = Callable[..., None]  # kernel(params, grads, exp_avgs, exp_avg_sqs, steps, step_values, hyper)


def rms_to_v(rms: torch.Tensor, step: float, beta2: float) -> torch.Tensor:
    """The second moment, as a new fp32 tensor, from its stored form after ``step`` steps."""
    v = rms.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    return v.square_().mul_(1 - beta2**step)


def v_to_rms(v: torch.Tensor, step: float, beta2: float) -> torch.Tensor:
    """``sqrt(v / (1 - beta2**step))`` in place on ``v`` (zero before the first step)."""
    return v.zero_() if step == 0 else v.div_(1 - beta2**step).sqrt_()


def run_staged(kernel: Kernel, quads: list[tuple[torch.Tensor, ...]], steps: list[torch.Tensor], values: list[float],
               *, as_rms: bool, hyper: dict[str, Any],
               scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor]) -> None:
    """Run ``kernel`` over math-dtype copies of (param, grad, exp_avg, exp_avg_sq) and round the results back.

    Args:
        kernel: the fused or foreach kernel (tensors of one dtype, contiguous).
        quads: (param, grad, exp_avg, exp_avg_sq) per tensor, all on one device; the grad is only read.
        steps, values: each tensor's step tensor and its value after this step's increment.
        as_rms: exp_avg_sq holds the fp16 ``grad_rms`` form.
        hyper: the kernel's hyperparameters (``beta2`` decodes ``grad_rms``).
        scratch: the optimizer's reusable buffers by (math dtype, device); filled on first use.
    """
    batches: dict[torch.dtype, _Batch] = {}
    for quad, step, value in zip(quads, steps, values, strict=True):
        dtype = torch.float64 if quad[0].dtype == torch.float64 else torch.float32
        if dtype not in batches:
            key = (dtype, quad[0].device)
            if key not in scratch:
                scratch[key] = torch.empty(4, CHUNK, dtype=dtype, device=quad[0].device)
            batches[dtype] = _Batch(scratch[key], as_rms, hyper["beta2"])
        for piece in _pieces(quad):
            if batches[dtype].numel + piece[0].numel() > CHUNK:
                batches[dtype].run(kernel, hyper)
            batches[dtype].add(piece, step, value)
    for batch in batches.values():
        batch.run(kernel, hyper)


def _pieces(quad: tuple[torch.Tensor, ...]) -> Iterator[tuple[torch.Tensor, ...]]:
    """Aligned flat pieces of at most ``CHUNK`` elements (the whole tensors when one is not contiguous)."""
    if quad[0].numel() <= CHUNK or not all(t.is_contiguous() for t in quad):
        yield quad
    else:
        yield from zip(*(t.view(-1).split(CHUNK) for t in quad), strict=True)


class _Batch:
    """Scratch slices holding math-dtype copies, the tensors they come from and go back to, and their steps.

    The copies are batched into ``torch._foreach_*`` calls: per-tensor dispatch, not bytes, is the cost for
    many small tensors."""

    def __init__(self, scratch: torch.Tensor, as_rms: bool, beta2: float) -> None:
        self.scratch, self.as_rms, self.beta2 = scratch, as_rms, beta2  # scratch: (4, CHUNK), a row per operand
        self.clear()

    def clear(self) -> None:
        self.lists: list[list[torch.Tensor]] = [[], [], [], []]
        self.steps: list[torch.Tensor] = []
        self.values: list[float] = []
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (math, stored), plain operands
        self.results: list[tuple[torch.Tensor, torch.Tensor]] = []  # (math, stored) to round back: not grads
        self.rms: list[tuple[torch.Tensor, torch.Tensor, float]] = []  # (math, stored grad_rms, step)
        self.numel = 0

    def add(self, quad: tuple[torch.Tensor, ...], step: torch.Tensor, value: float) -> None:
        numel = quad[0].numel()
        for k, t in enumerate(quad):
            encoded = self.as_rms and k == 3
            if not encoded and t.dtype == self.scratch.dtype and t.is_contiguous():
                self.lists[k].append(t)  # usable as it is
                continue
            if numel <= CHUNK:
                math = self.scratch[k, self.numel : self.numel + numel].view(t.shape)
            else:  # a large non-contiguous tensor: a one-off temporary
                math = torch.empty(t.shape, dtype=self.scratch.dtype, device=t.device)
            self.lists[k].append(math)
            if encoded:
                self.rms.append((math, t, value))
            else:
                self.copies.append((math, t))
                if k != 1:  # the grad is only read
                    self.results.append((math, t))
        self.steps.append(step)
        self.values.append(value)
        self.numel += min(numel, CHUNK)

    def run(self, kernel: Kernel, hyper: dict[str, Any]) -> None:
        if not self.steps:
            return
        if self.copies:
            torch._foreach_copy_([m for m, _ in self.copies], [t for _, t in self.copies])
        math, stored, steps = ([list(c) for c in zip(*self.rms, strict=True)] or [[], [], []])
        if math:  # v = grad_rms**2 * (1 - beta2**(step - 1)), step - 1 being the count before this step
            torch._foreach_copy_(math, stored)
            torch._foreach_mul_(math, math)
            torch._foreach_mul_(math, [1 - self.beta2 ** (s - 1) for s in steps])
        kernel(*self.lists, self.steps, self.values, hyper)
        if math:
            torch._foreach_div_(math, [1 - self.beta2**s for s in steps])
            torch._foreach_sqrt_(math)
            torch._foreach_copy_(stored, math)
        if self.results:
            torch._foreach_copy_([t for _, t in self.results], [m for m, _ in self.results])
        self.clear()
