"""What the matrix algorithms (Muon, adaptive Muon, SOAP) share around their matrix kernels: the Newton-Schulz
norm floor, the size of the stacks same-shaped matrices are batched into, and the cutting of a list of matrices
and 3-D stacks into such stacks. Public within the package: each algorithm module imports these, none imports
another algorithm's privates.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["MAX_STACK_ELEMENTS", "NS_EPS", "momentum_updates", "stack_chunks"]

#: lower bound of Newton-Schulz's normalising norm (a zero update maps to zero)
NS_EPS = 1e-7
#: Same-shaped matrices are processed as one batched matmul chain, in stacks of at most this many elements: big
#: enough to batch many small matrices (one BLAS call instead of dozens), small enough that the stack and the
#: kernel's few temporaries of its size stay a modest extra memory (~0.5 GB fp32).
MAX_STACK_ELEMENTS = 2**25


def stack_chunks(matrices: list[tuple[int, Tensor]], limit: int) -> list[list[tuple[int, Tensor]]]:
    """``(index, matrix or stack)`` pairs cut into chunks of at most ``limit`` matrices, in order; a stack
    larger than the room left is split along its batch dimension (views)."""
    chunks: list[list[tuple[int, Tensor]]] = [[]]
    room = limit
    for i, m in matrices:
        for part in m.split(limit) if m.ndim == 3 else [m]:
            count = 1 if part.ndim == 2 else part.size(0)
            if count > room:
                chunks.append([])
                room = limit
            chunks[-1].append((i, part))
            room -= count
    return [c for c in chunks if c]


def momentum_updates(grads: list[Tensor], buffers: list[Tensor], beta: float, nesterov: bool) -> list[Tensor]:
    """Muon's momentum over a group at once: ``buffers`` (in place) ``beta * m + (1 - beta) * g``; the update is
    the buffer, or with ``nesterov`` ``beta * m + (1 - beta) * g`` of the new buffer."""
    torch._foreach_mul_(buffers, beta)
    torch._foreach_add_(buffers, grads, alpha=1 - beta)
    if not nesterov:
        return buffers
    updates = torch._foreach_mul(grads, 1 - beta)
    torch._foreach_add_(updates, buffers, alpha=beta)
    return updates
