"""Newton-Schulz orthogonalisation, the matrix kernel inside Muon: the named coefficient sets, their
per-iteration schedules, the iteration (one matrix or a stack of same-shaped ones), and the precision its matmuls
run at on each device.

The iteration maps ``X = U S V^T`` to ``U p(S) V^T``, ``p`` the composition of the odd quintics
``s -> a s + b s^3 + c s^5``, one per step. After normalising by the Frobenius norm the singular values lie in
``[0, 1]``; the tuned schedules push them towards 1 in a few steps, without an SVD. The result is *near*-orthogonal
(singular values in a band around 1 that depends on the set), which is all Muon needs.

Coefficient sets (as NVIDIA Emerging-Optimizers, which Megatron Core's Muon uses): ``simple`` (Keller Jordan's
original, every step), ``quintic`` (modded-nanogpt's tuned 5 steps), ``polar_express`` (Amsel et al. 2025,
arXiv:2505.16932, 8 steps, the 1.01 safety factor folded into all but the last, as Emerging-Optimizers ships it),
or a custom sequence of ``(a, b, c)`` triples. Past its length, ``polar_express`` repeats its last polynomial
(which converges to 1) and the other sets *cycle* from the start, as in Megatron; cycling ``quintic`` is safe (its
first polynomial has no positive root) and ends closer to 1 after two passes.

Precision (Megatron's ``muon_fp32_matmul_prec`` names, read as torch's ``set_float32_matmul_precision``: the
*lowest* precision allowed, the hardware picking the fastest it has at or above it): ``"highest"`` fp32 matmuls;
``"high"`` TF32 on a CUDA GPU, fp32 elsewhere; ``"medium"`` bf16 matmuls where the device multiplies bf16 natively
(a CUDA GPU with bf16 tensor cores; a CPU with AVX512-BF16 or AMX), fp32 elsewhere (a CPU without bf16 hardware
runs bf16 matmul tens of times slower than fp32). The choice is a capability check, not a timing, so that every
rank of a replicated run takes the same one (each computes every update; they must agree to the bit).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from itertools import chain, cycle, islice, repeat
from typing import Literal

import torch
from torch import Tensor

__all__ = ["COEFFICIENT_SETS", "MatmulPrecision", "coefficient_schedule", "has_native_bf16_matmul", "matmul_precision",
           "newton_schulz", "ns_matmul_dtype"]

Triple = tuple[float, float, float]
Coefficients = str | Sequence[Triple]
MatmulPrecision = Literal["highest", "high", "medium"]
MATMUL_PRECISIONS: tuple[str, ...] = ("highest", "high", "medium")

COEFFICIENT_SETS: dict[str, tuple[Triple, ...]] = {
    "simple": ((3.4445, -4.7750, 2.0315),),
    "quintic": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    "polar_express": (
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ),
}
# Sets whose tail converges to 1 repeat their last polynomial; the rest cycle (Emerging-Optimizers' rule).
_REPEAT_LAST = frozenset({"polar_express"})


def coefficient_schedule(coefficients: Coefficients, steps: int) -> list[Triple]:
    """The ``(a, b, c)`` triple of each of ``steps`` (>= 1) iterations: the set (a name from ``COEFFICIENT_SETS``
    or a non-empty sequence of triples) in order, then its last triple repeated (``polar_express``) or the set
    cycled from the start (every other set, custom ones included).

    Raises:
        ValueError: unknown set name, malformed custom set, or ``steps`` < 1.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"Newton-Schulz steps must be an integer >= 1, got {steps!r}")
    if isinstance(coefficients, str):
        if coefficients not in COEFFICIENT_SETS:
            raise ValueError(f"unknown Newton-Schulz coefficient set {coefficients!r}; known sets: "
                             f"{sorted(COEFFICIENT_SETS)}, or pass a sequence of (a, b, c) triples")
        triples = COEFFICIENT_SETS[coefficients]
    else:
        try:
            triples = tuple(tuple(float(v) for v in t) for t in coefficients)  # type: ignore[misc]
        except (TypeError, ValueError):
            triples = ()
        if not triples or any(len(t) != 3 for t in triples):
            raise ValueError(f"custom Newton-Schulz coefficients must be a non-empty sequence of (a, b, c) number "
                             f"triples, got {coefficients!r}; or use a named set: {sorted(COEFFICIENT_SETS)}")
    repeat_last = isinstance(coefficients, str) and coefficients in _REPEAT_LAST
    source: Iterator[Triple] = chain(triples, repeat(triples[-1])) if repeat_last else cycle(triples)
    return list(islice(source, steps))


def has_native_bf16_matmul(device: torch.device) -> bool:
    """Whether ``device`` multiplies bf16 matrices in hardware: a CUDA GPU with bf16 tensor cores (Ampere or
    later), a CPU with AVX512-BF16 or AMX tiles. Other devices: False (fp32 stays the safe choice)."""
    return _native_bf16(device.type, device.index)


@functools.cache
def _native_bf16(device_type: str, index: int | None) -> bool:
    if device_type == "cuda":  # bf16 tensor cores from compute capability 8.0 (Ampere) on
        return torch.cuda.get_device_capability(index if index is not None else torch.cuda.current_device())[0] >= 8
    if device_type == "cpu":
        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private, so looked up defensively
        return any(bool(getattr(torch.cpu, probe, lambda: False)()) for probe in probes)
    return False


def ns_matmul_dtype(precision: MatmulPrecision, device: torch.device) -> torch.dtype:
    """The dtype Newton-Schulz multiplies in at ``precision`` on ``device``: bf16 for ``"medium"`` where the
    device has native bf16 matmul (``has_native_bf16_matmul``), else fp32 (TF32 for ``"high"`` on CUDA comes from
    ``matmul_precision``, not from the dtype).

    Raises:
        ValueError: unknown ``precision``.
    """
    if precision not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul_precision must be one of {list(MATMUL_PRECISIONS)}, got {precision!r}")
    return torch.bfloat16 if precision == "medium" and has_native_bf16_matmul(device) else torch.float32


@contextlib.contextmanager
def matmul_precision(precision: MatmulPrecision, device: torch.device) -> Iterator[None]:
    """Run fp32 matmuls at ``precision`` for the duration of the block, then restore the global setting.

    On CPU the block always runs at ``"highest"``: reduced-precision *fp32* matmul there is oneDNN's bf16
    emulation (0.65x fp32's speed measured on a CPU without bf16); bf16 on CPU comes from ``ns_matmul_dtype``.
    """
    if precision not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul_precision must be one of {list(MATMUL_PRECISIONS)}, got {precision!r}")
    wanted = "highest" if device.type == "cpu" else precision
    previous = torch.get_float32_matmul_precision()
    if wanted == previous:
        yield
        return
    torch.set_float32_matmul_precision(wanted)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def newton_schulz(x: Tensor, *, steps: int = 5, coefficients: Coefficients = "quintic", eps: float = 1e-7,
                  matmul_dtype: torch.dtype | None = None) -> Tensor:
    """Near-orthogonalise ``x`` (approximately the polar factor ``U V^T`` of ``x = U S V^T``).

    Normalises by ``max(||x||_F, eps)``, works on the side whose Gram matrix is smaller (transposes when rows >
    columns), and iterates ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` for each ``(a, b, c)`` of
    ``coefficient_schedule(coefficients, steps)``.

    Args:
        x: ``(m, n)`` matrix or ``(batch, m, n)`` stack of same-shaped matrices, any float dtype.
        steps: number of iterations (>= 1).
        coefficients: named set (``"simple"``, ``"quintic"``, ``"polar_express"``) or ``(a, b, c)`` triples.
        eps: lower bound of the normalising norm, so a zero matrix maps to zero.
        matmul_dtype: dtype of the iteration's matmuls (e.g. ``torch.bfloat16``, see ``ns_matmul_dtype``);
            ``None``: fp32. The normalisation is always computed in fp32.

    Returns:
        A tensor of ``x``'s shape and dtype.

    Raises:
        ValueError: ``x`` is not 2-D or 3-D, or bad ``steps`` / ``coefficients``.
    """
    if x.ndim not in (2, 3):
        raise ValueError(f"newton_schulz needs a (m, n) matrix or a (batch, m, n) stack, got shape {tuple(x.shape)}")
    schedule = coefficient_schedule(coefficients, steps)
    work_dtype = torch.float32 if matmul_dtype is None else matmul_dtype
    transpose = x.size(-2) > x.size(-1)
    X = (x.mT if transpose else x).to(torch.float32)
    X = (X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp_min(eps)).to(work_dtype)
    # addmm/baddbmm fuse the scaled sums into the GEMM epilogue (no extra passes over A or X).
    addmm = torch.baddbmm if X.ndim == 3 else torch.addmm
    for a, b, c in schedule:
        A = X @ X.mT
        B = addmm(A, A, A, beta=b, alpha=c)
        X = addmm(X, B, X, beta=a)
    return (X.mT if transpose else X).to(x.dtype)
