"""Gradient statistics for clipping: which gradients count toward the norm, the local norm, the clip factor
and the zero count.

These are local computations. A stage reduces the result over the ranks its gradients are split across
(through its ``Comm``; ``reduced_norm_pow`` and ``reduced_zero_count`` do both steps), and the chained
optimizer combines the stages into the one global norm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

__all__ = [
    "AllReduce",
    "check_norm_type",
    "clip_coefficient",
    "count_zeros",
    "grads_for_norm",
    "local_norm_pow",
    "reduced_norm_pow",
    "reduced_zero_count",
]


class AllReduce(Protocol):
    """What the reductions below need of a group: a ``Comm``, a ``NullComm`` or a ``ComposedComm``."""

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor: ...

# Megatron adds this to the norm so a zero norm does not divide by zero.
_CLIP_EPS = 1.0e-6


def check_norm_type(norm_type: float) -> float:
    """``norm_type`` as a float, after checking it is a p >= 1 or ``inf`` (below 1 it is no norm: p=0.01 makes
    the "norm" of any real gradient overflow to inf every step)."""
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type >= 1:
        raise ValueError(f"norm_type must be a number >= 1 (2.0 for L2, 1.0 for L1) or float('inf'), "
                         f"got {norm_type!r}")
    return float(norm_type)


def grads_for_norm(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], *, tp_rank: int
) -> list[torch.Tensor]:
    """The gradients that count toward the global norm, each counted once across model-parallel ranks.

    Excluded: missing gradients, parameters with a truthy ``shared`` attribute (e.g. a tied embedding already
    counted on another pipeline stage), and tensor-parallel duplicates (a parameter whose
    ``tensor_model_parallel`` attribute is falsy is replicated across the tensor-parallel group and counts
    only on tensor-parallel rank 0).

    Args:
        params: model parameters, parallel to ``grads`` (their attributes decide).
        grads: the ready gradients (fp32 masters' grads in a mixed-precision stage), None where absent.
        tp_rank: this rank's tensor-parallel rank.
    """
    if len(params) != len(grads):
        raise ValueError(
            f"params and grads must be parallel lists, got {len(params)} params and {len(grads)} grads"
        )
    out = []
    for param, grad in zip(params, grads, strict=True):
        if grad is None or getattr(param, "shared", False):
            continue
        if getattr(param, "tensor_model_parallel", False) or tp_rank == 0:
            out.append(grad)
    return out


def local_norm_pow(
    grads: Sequence[torch.Tensor], norm_type: float, *, device: torch.device | None = None
) -> torch.Tensor:
    """Sum of ``|g|^p`` over all elements of ``grads`` (``max |g|`` for the inf-norm), as a 0-d fp32 tensor.

    One multi-tensor norm per (device, dtype) instead of a kernel per tensor; low-precision gradients are
    reduced in fp32.

    Args:
        grads: gradients of any floating dtype, on any devices.
        norm_type: p > 0 or ``inf``.
        device: where the result lives (default: the first gradient's device, CPU when there is none).
    """
    norm_type = check_norm_type(norm_type)
    if device is None:
        device = grads[0].device if grads else torch.device("cpu")
    partials = []
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        buckets.setdefault((grad.device, grad.dtype), []).append(grad)
    for (_, dtype), bucket in buckets.items():
        # _foreach_norm refuses a narrowing dtype (fp64 -> fp32), so only widen low-precision inputs.
        if dtype in (torch.float16, torch.bfloat16):
            norms = torch._foreach_norm(bucket, norm_type, dtype=torch.float32)
        else:
            norms = torch._foreach_norm(bucket, norm_type)
        stacked = torch.stack(norms).to(device=device, dtype=torch.float32)
        partials.append(stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum())
    if not partials:
        return torch.zeros((), dtype=torch.float32, device=device)
    stacked = torch.stack(partials)
    return stacked.max() if math.isinf(norm_type) else stacked.sum()


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor to multiply every gradient by: ``max_norm / (total_norm + 1e-6)`` when that is below 1
    (Megatron's rule), else exactly 1.0 (no clipping)."""
    if not max_norm > 0:
        raise ValueError(f"max_norm (clip_grad) must be > 0 to clip, got {max_norm!r}")
    coeff = max_norm / (total_norm + _CLIP_EPS)
    return coeff if coeff < 1.0 else 1.0


def count_zeros(grads: Sequence[torch.Tensor]) -> int:
    """Number of elements equal to zero across ``grads`` (one host sync)."""
    if not grads:
        return 0
    return int(_zeros(grads, grads[0].device).item())


def reduced_norm_pow(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], norm_type: float, *, tp_rank: int,
    device: torch.device, comm: AllReduce,
) -> torch.Tensor:
    """``local_norm_pow`` of the gradients that count (``grads_for_norm``), reduced over ``comm`` (max for
    the inf-norm, else sum): a 0-d fp32 tensor on ``device``, the same on every rank of ``comm``."""
    total = local_norm_pow(grads_for_norm(params, grads, tp_rank=tp_rank), norm_type, device=device)
    return comm.all_reduce(total, op="max" if math.isinf(norm_type) else "sum")


def reduced_zero_count(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], *, tp_rank: int,
    device: torch.device, comm: AllReduce,
) -> int:
    """Zero elements of the gradients that count (``grads_for_norm``), summed over ``comm`` (one host sync)."""
    counted = grads_for_norm(params, grads, tp_rank=tp_rank)
    total = _zeros(counted, device) if counted else torch.zeros(1, dtype=torch.int64, device=device)
    return int(comm.all_reduce(total.reshape(1), op="sum").item())


def _zeros(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Zero elements across ``grads`` (non-empty) as a 0-d int64 tensor on ``device``, without a host sync."""
    numel = sum(grad.numel() for grad in grads)
    nonzero = torch.stack([torch.count_nonzero(grad).to(device) for grad in grads]).sum()
    return numel - nonzero
