"""The raw bytes of a tensor without numpy, which is not a core dependency (``.numpy()`` raises without it)."""

from __future__ import annotations

import torch


def tensor_bytes(t: torch.Tensor) -> bytearray:
    """The bytes of ``t``'s elements in row-major order and native byte order, as ``t.numpy().tobytes()``
    gives them, for a tensor on any device. One copy, made by torch straight into the returned buffer
    (``bytes(t.tolist())`` and ``bytes(t.untyped_storage())`` go element by element in Python)."""
    # contiguous() first: reshape(-1) keeps a 1-D strided view as it is, and view(uint8) needs stride 1.
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    out = bytearray(flat.numel())
    if out:  # torch.frombuffer refuses an empty buffer
        torch.frombuffer(out, dtype=torch.uint8).copy_(flat)
    return out
