"""Adam's kernels on tensors they cannot take as they are (low-precision moments or params, mixed dtypes,
non-contiguous tensors): each is copied into a slice of a reused fp32 (fp64 for fp64 params) scratch buffer of
``CHUNK`` elements per operand, the kernel runs over a batch of slices, and the results are rounded back.
Reusing the scratch keeps the copies in cache and allocates nothing per step: a bf16-state step costs ~1.6x
the fp32 one (fresh temporaries ~8x, mostly page faults; 20M params, 1 thread). Large tensors are cut into
``CHUNK``-element pieces (exact: the math is element-wise). The fp16 second moment is stored as
``grad_rms = sqrt(v / (1 - beta2**step))`` (see ``adamw.py``), decoded on the way in, encoded on the way out.
An 8-bit block-quantized moment (a ``Q8``, ``_quant8.py``) is dequantized into its scratch slice, which starts
on a block boundary and is padded to whole blocks, and quantized back after the kernel.
With ``stochastic=True`` bf16 parameters are rounded back stochastically: random low 16 bits are added to the
fp32 result before truncation, so a value rounds up with probability equal to its distance from the lower bf16
neighbour (unbiased; updates far below a bf16 ulp still move the parameter on average).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from optstack.algorithms._quant8 import Q8, dequantize_, quantize_

__all__ = ["CHUNK", "rms_to_v", "round_stochastic_", "run_staged", "v_to_rms"]

CHUNK = 1 << 20  # elements per operand per batch: 4 MiB of fp32, about a cache (measured best of 2^16..2^20)

Kernel = Callable[..., None]  # kernel(params, grads, exp_avgs, exp_avg_sqs, steps, step_values, hyper)
Operand = torch.Tensor | Q8
_Batch = list[tuple[tuple[Operand, ...], torch.Tensor, float]]  # (quad or a piece of it, step, step value)


def rms_to_v(rms: torch.Tensor, step: float, beta2: float) -> torch.Tensor:
    """The second moment, as a new fp32 tensor, from its stored form after ``step`` steps."""
    v = rms.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    return v.square_().mul_(1 - beta2**step)


def v_to_rms(v: torch.Tensor, step: float, beta2: float) -> torch.Tensor:
    """``sqrt(v / (1 - beta2**step))`` in place on ``v`` (zero before the first step)."""
    return v.zero_() if step == 0 else v.div_(1 - beta2**step).sqrt_()


def run_staged(kernel: Kernel, quads: list[tuple[Operand, ...]], steps: list[torch.Tensor], values: list[float],
               *, as_rms: bool, hyper: dict[str, Any],
               scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor], stochastic: bool = False) -> None:
    """Run ``kernel`` over math-dtype copies of (param, grad, exp_avg, exp_avg_sq) and round the results back.

    Args:
        kernel: the fused or foreach kernel (tensors of one dtype, contiguous).
        quads: (param, grad, exp_avg, exp_avg_sq) per tensor, all on one device; the grad is only read; a
            moment may be a ``Q8`` (8-bit block-quantized).
        steps, values: each tensor's step tensor and its value after this step's increment.
        as_rms: exp_avg_sq holds the fp16 ``grad_rms`` form.
        hyper: the kernel's hyperparameters (``beta2`` decodes ``grad_rms``).
        scratch: the optimizer's reusable buffers by (math dtype, device); filled on first use.
        stochastic: round bf16 parameters back stochastically (``round_stochastic_``).
    """
    pending: dict[tuple[torch.dtype, torch.device], _Batch] = {}  # by scratch key: (math dtype, device)
    filled: dict[tuple[torch.dtype, torch.device], int] = {}  # scratch elements the pending pieces take
    for quad, step, value in zip(quads, steps, values, strict=True):
        key = (torch.float64 if quad[0].dtype == torch.float64 else torch.float32, quad[0].device)
        if key not in scratch:
            scratch[key] = torch.empty(4, CHUNK, dtype=key[0], device=key[1])
        for piece in _pieces(quad):
            span = _span(piece)
            if key in pending and filled[key] + span > CHUNK:
                _run_batch(kernel, pending.pop(key), scratch[key], as_rms, hyper, stochastic)
            if key not in pending:
                pending[key], filled[key] = [], 0
            pending[key].append((piece, step, value))
            filled[key] += span
    for key, batch in pending.items():
        _run_batch(kernel, batch, scratch[key], as_rms, hyper, stochastic)


def _pieces(quad: tuple[Operand, ...]) -> Iterator[tuple[Operand, ...]]:
    """Aligned flat pieces of at most ``CHUNK`` elements (the whole tensors when one is not contiguous; a
    ``Q8``'s codes are, and ``CHUNK`` is a whole number of its blocks)."""
    if quad[0].numel() <= CHUNK or not all(t.codes.is_contiguous() if isinstance(t, Q8) else t.is_contiguous()
                                           for t in quad):
        yield quad
    else:
        yield from zip(*(t.split(CHUNK) if isinstance(t, Q8) else t.view(-1).split(CHUNK) for t in quad),
                       strict=True)


def _span(quad: tuple[Operand, ...]) -> int:
    """Scratch elements a piece takes: its size (at most ``CHUNK``), rounded up to whole blocks for a ``Q8``."""
    numel = min(quad[0].numel(), CHUNK)
    block = max((t.block for t in quad if isinstance(t, Q8)), default=1)
    return -(-numel // block) * block


def round_stochastic_(stored: torch.Tensor, math: torch.Tensor) -> None:
    """Round fp32 ``math`` into bf16 ``stored`` stochastically (``math`` is used as scratch and changed)."""
    bits = math.view(torch.int32)
    bits.add_(torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device)).bitwise_and_(-(1 << 16))
    stored.copy_(math)  # exact: the low 16 bits are zero


def _run_batch(kernel: Kernel, batch: _Batch, scratch: torch.Tensor, as_rms: bool, hyper: dict[str, Any],
               stochastic: bool = False) -> None:
    """``kernel`` over ``batch``'s (quad, step, value), each tensor it cannot take as it is copied into a slice of
    ``scratch`` (4, CHUNK), a row per operand. The copies are batched into ``torch._foreach_*`` calls: per-tensor
    dispatch, not bytes, is the cost for many small tensors."""
    lists: list[list[torch.Tensor]] = [[], [], [], []]
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (math, stored), plain operands
    results: list[tuple[torch.Tensor, torch.Tensor]] = []  # (math, stored) to round back: not grads
    rms: list[tuple[torch.Tensor, torch.Tensor, float]] = []  # (math, stored grad_rms, step)
    rounded: list[tuple[torch.Tensor, torch.Tensor]] = []  # (math, stored) bf16 params, rounded stochastically
    quantized: list[tuple[torch.Tensor, Q8]] = []  # (padded math, stored) 8-bit moments
    offset = 0
    for quad, _, value in batch:
        numel = quad[0].numel()
        span = _span(quad)
        for k, t in enumerate(quad):
            if isinstance(t, Q8):  # (past CHUNK only for a large non-contiguous param: a one-off temporary)
                padded = scratch[k, offset : offset + span] if span <= CHUNK else scratch.new_empty(span)
                quantized.append((padded, t))
                lists[k].append(dequantize_(t, quantized[-1][0]).view(t.codes.shape))
                continue
            encoded = as_rms and k == 3
            if not encoded and t.dtype == scratch.dtype and t.is_contiguous():
                lists[k].append(t)  # usable as it is
                continue
            if numel <= CHUNK:
                math = scratch[k, offset : offset + numel].view(t.shape)
            else:  # a large non-contiguous tensor: a one-off temporary
                math = torch.empty(t.shape, dtype=scratch.dtype, device=t.device)
            lists[k].append(math)
            if encoded:
                rms.append((math, t, value))
            else:
                copies.append((math, t))
                if k == 0 and stochastic and t.dtype == torch.bfloat16:
                    rounded.append((math, t))
                elif k != 1:  # the grad is only read
                    results.append((math, t))
        offset += span
    if copies:
        torch._foreach_copy_([m for m, _ in copies], [t for _, t in copies])
    decoded, encoded_rms, rms_steps = [list(c) for c in zip(*rms, strict=True)] or [[], [], []]
    beta2 = hyper["beta2"]
    if decoded:  # v = grad_rms**2 * (1 - beta2**(step - 1)), step - 1 being the count before this step
        torch._foreach_copy_(decoded, encoded_rms)
        torch._foreach_mul_(decoded, decoded)
        torch._foreach_mul_(decoded, [1 - beta2 ** (s - 1) for s in rms_steps])
    kernel(*lists, [step for _, step, _ in batch], [value for _, _, value in batch], hyper)
    if decoded:
        torch._foreach_div_(decoded, [1 - beta2**s for s in rms_steps])
        torch._foreach_sqrt_(decoded)
        torch._foreach_copy_(encoded_rms, decoded)
    for math, state in quantized:
        quantize_(state, math)
    if results:
        torch._foreach_copy_([t for _, t in results], [m for m, _ in results])
    for math, stored in rounded:
        round_stochastic_(stored, math)
