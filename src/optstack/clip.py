"""Gradient statistics: which gradients count toward the global norm, the norm of each gradient, the zero
count, and the clip factor. Local computations: a stage reduces them over its placement's groups and the
optimizer combines the stages into the one global norm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["check_norm_type", "clip_coefficient", "counts_toward_norm", "norm_pows", "zero_count"]

# Megatron adds this to the norm so a zero norm does not divide by zero.
_CLIP_EPS = 1.0e-6


def check_norm_type(norm_type: float) -> float:
    """``norm_type`` as a float, after checking it is a p >= 1 or ``inf`` (below 1 it is no norm: p=0.01 makes
    the "norm" of any real gradient overflow to inf every step)."""
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type >= 1:
        raise ValueError(f"norm_type must be a number >= 1 (2.0 for L2, 1.0 for L1) or float('inf'), "
                         f"got {norm_type!r}")
    return float(norm_type)


def counts_toward_norm(param: torch.Tensor, tp_rank: int) -> bool:
    """Whether ``param``'s gradient counts toward the global norm on this rank, so that each counts once
    across model-parallel ranks: not a parameter with a truthy ``shared`` attribute (a tied embedding counted
    on another pipeline stage), and a tensor-parallel duplicate (``tensor_model_parallel`` falsy: replicated
    across the tensor-parallel group) only on tensor-parallel rank 0."""
    if getattr(param, "shared", False):
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


# A BLAS dot per tensor beats ``_foreach_norm`` on CPU from about this size (benchmarks/bench_norm.py, one
# thread); below it the per-call cost of a view and a dot loses to the multi-tensor norm.
_DOT_FROM = 1 << 16


def norm_pows(grads: Sequence[torch.Tensor | None], norm_type: float, device: torch.device) -> torch.Tensor:
    """``|g|_p^p`` of each gradient (``max |g|`` for the inf-norm; 0 where absent) as one fp32 tensor on
    ``device``: per (device, dtype), one multi-tensor norm, or for the 2-norm of large contiguous fp32 CPU
    tensors one BLAS dot each (no square root to undo)."""
    out = torch.zeros(len(grads), dtype=torch.float32, device=device)
    buckets: dict[tuple[torch.device, torch.dtype, bool], list[int]] = {}
    for i, grad in enumerate(grads):  # few attribute reads per tensor: this loop runs over every gradient
        if grad is not None:
            buckets.setdefault((grad.device, grad.dtype, grad.numel() >= _DOT_FROM), []).append(i)
    for (where, dtype, large), indices in buckets.items():
        bucket: list[torch.Tensor] = [grads[i] for i in indices]  # type: ignore[misc]
        dot = (large and norm_type == 2.0 and dtype == torch.float32 and where.type == "cpu"
               and all(g.is_contiguous() for g in bucket))
        if dot:
            pows = torch.stack([torch.dot(v, v) for v in (g.view(-1) for g in bucket)]).to(device)
        else:
            # _foreach_norm refuses a narrowing dtype (fp64 -> fp32), so only widen low-precision inputs.
            wide = {"dtype": torch.float32} if dtype in (torch.float16, torch.bfloat16) else {}
            norms = torch.stack(torch._foreach_norm(bucket, norm_type, **wide)).to(device=device, dtype=torch.float32)
            pows = norms if math.isinf(norm_type) else norms.pow(norm_type)
        if len(indices) == len(grads):
            return pows
        out[torch.tensor(indices, device=device)] = pows
    return out


def zero_count(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Zero elements across ``grads`` as a 1-element int64 tensor on ``device``, without a host sync."""
    total = torch.zeros(1, dtype=torch.int64, device=device)
    if grads:
        numel = sum(g.numel() for g in grads)
        total += numel - torch.stack([torch.count_nonzero(g).to(device) for g in grads]).sum()
    return total


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor to multiply every gradient by: ``max_norm / (total_norm + 1e-6)`` when that is below 1
    (Megatron's rule), else exactly 1.0 (no clipping)."""
    if not max_norm > 0:
        raise ValueError(f"max_norm (clip_grad) must be > 0 to clip, got {max_norm!r}")
    coeff = max_norm / (total_norm + _CLIP_EPS)
    return coeff if coeff < 1.0 else 1.0
