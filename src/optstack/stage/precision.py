"""Precisions: which tensors the inner algorithm steps for a placement's pieces, how their gradients get
ready, and how the stepped values reach the model.

- ``Direct``: the algorithm steps the pieces' model storage itself (the parameter, or its buffer view).
- ``Masters``: bf16/fp16 pieces get fp32 master copies (one flat fp32 tensor per group, so the fused kernels
  step a group's masters as one run); fp32 pieces are stepped directly (Megatron's fp32-from-fp32 groups).
  After a step the masters are rounded into the model storage in place.

A gradient becomes the stepped tensor's ``.grad`` as it is when its dtype is the stepped tensor's (no copy:
an fp32 gradient buffer under fp32 masters), else it is copied into an fp32 buffer allocated once (laid out
back to back where the stepped tensors are). A remainder-stored master (bf16 parameter + its low 16 bits)
is one more precision.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from optstack.stage.placement import Piece

__all__ = ["Direct", "Masters", "Precision"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class Precision:
    """Direct: the pieces' model storage is what the algorithm steps (the base of ``Masters``)."""

    kind = "direct"

    def __init__(self) -> None:
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (model storage, its master)
        self._inner: list[torch.Tensor] = []
        self._copy_to: list[torch.Tensor] = []  # fp32 grads of the pieces whose grads are copied
        self._copied: list[int] = []
        self._dtypes: list[torch.dtype | None] | None = None  # the gradient dtypes the plan was made for

    def _wants_master(self, piece: Piece) -> bool:
        return False

    def inner(self, pieces: Sequence[Sequence[Piece]], device: torch.device) -> list[list[torch.Tensor]]:
        """Per group, the tensors the algorithm steps, one per piece (appended to those of earlier calls)."""
        out = []
        for group in pieces:
            low = [p for p in group if self._wants_master(p)]
            flat = torch.empty(sum(p.end - p.start for p in low), dtype=torch.float32, device=device)
            masters = iter(flat.split([p.end - p.start for p in low]))
            stepped = []
            with torch.no_grad():
                for p in group:
                    if self._wants_master(p):
                        master = next(masters).view(p.value.shape)
                        master.copy_(p.value)
                        self._pairs.append((p.value, master))
                        stepped.append(master)
                    else:
                        stepped.append(p.value)
            out.append(stepped)
        self._inner += [t for group in out for t in group]
        self._dtypes = None  # plan the gradient copies again
        return out

    @property
    def masters(self) -> list[torch.Tensor]:
        """The fp32 masters, in group order."""
        return [m for _, m in self._pairs]

    def ready(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Make ``grads`` (the model gradients, one per piece) the stepped tensors' ``.grad``; returns them.
        Gradients are used as they are (loss scale and clip factor are applied in the step)."""
        inner = self._inner
        dtypes = [None if g is None else g.dtype for g in grads]
        if dtypes != self._dtypes:  # planned on the first step (and again if a gradient's dtype changes)
            self._dtypes = dtypes
            self._copied = [i for i, d in enumerate(dtypes) if d is not None and d != inner[i].dtype]
            self._copy_to = _back_to_back([inner[i] for i in self._copied])
        ready: list[torch.Tensor | None] = list(grads)
        if self._copied:
            torch._foreach_copy_(self._copy_to, [grads[i] for i in self._copied])  # type: ignore[misc]
            for k, i in enumerate(self._copied):
                ready[i] = self._copy_to[k]
        for tensor, grad in zip(inner, ready, strict=True):
            if tensor.grad is not grad:
                tensor.grad = grad
        return ready

    def publish(self) -> None:
        """Round the masters into the model storage (after a step or a load)."""
        if self._pairs:
            with torch.no_grad():
                torch._foreach_copy_([v for v, _ in self._pairs], [m for _, m in self._pairs])

    def clear(self, set_to_none: bool) -> None:
        """Clear the stepped tensors' gradients (and the model's, for pieces that are whole parameters)."""
        for tensor in self._inner:
            if tensor.grad is None:
                continue
            if set_to_none:
                tensor.grad = None
            elif tensor.grad.grad_fn is not None:
                tensor.grad.detach_().zero_()
            else:
                tensor.grad.requires_grad_(False).zero_()


class Direct(Precision):
    """The algorithm steps the model's own storage (bf16/fp16 parameters too, without masters)."""


class Masters(Precision):
    """fp32 masters for bf16/fp16 pieces; fp32 pieces are stepped directly."""

    kind = "masters"

    def _wants_master(self, piece: Piece) -> bool:
        return piece.value.dtype in _LOW_PRECISION


def _back_to_back(like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Zero fp32 tensors shaped like ``like``, back to back in one allocation: where the stepped tensors lie
    back to back their gradients do too, so the fused kernels step the run as one tensor."""
    if not like:
        return []
    flat = torch.zeros(sum(t.numel() for t in like), dtype=torch.float32, device=like[0].device)
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in like]), like, strict=True)]
