"""The copies between device and host memory that CPU offload makes every step, and their ordering.

``HybridDeviceOptimizer`` (``offload.py``) moves gradients device -> host before its host step and updated
values host -> device after it. Two implementations of one small protocol:

- ``CudaCopies``: asynchronous copies from/into pinned host memory. With ``overlap`` they run on two side
  streams (one per direction) so they overlap the device step running on the current stream; an event per
  batch of device -> host copies tells the host when it may read them. Without ``overlap`` the copies are
  queued on the current stream (the host steps still overlap the device step, which is launched before
  them, but the copies wait behind it).
- ``SyncCopies``: the "device" is host memory too (a CPU-only machine, or a device without streams): plain
  synchronous copies; waiting is a no-op. The host copies are still separate tensors, so the same transfer
  logic runs and is tested.

Ordering on CUDA (why each wait is there):

- ``start``: both side streams wait for the current stream's work so far: the gradients (and the values a
  refresh reads) are produced there, and the last forward/backward may still read the parameters the
  host -> device copies are about to overwrite. The device step is launched after ``start``, so the side
  streams do not wait for it.
- ``wait(event)``: the host blocks until one batch of device -> host copies is done, then steps it.
- ``finish``: the current stream waits for the host -> device copies, so what follows the step on it
  (publishing masters to the model, the parameter gather) sees the new values. The host does not block.

Device memory read or written on a side stream is never freed early: every device -> host batch is waited
for before the step returns, and the host -> device destinations are parameters that live on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

__all__ = ["Copies", "CudaCopies", "SyncCopies", "copies_for"]


class Copies(Protocol):
    """How one step's transfers are issued and ordered (see the module docstring)."""

    def start(self) -> None: ...

    def to_host(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> torch.cuda.Event | None:
        """Copy ``src[i]`` (device) into ``dst[i]`` (host); returns what ``wait`` needs to know it is done."""
        ...

    def wait(self, done: torch.cuda.Event | None) -> None: ...

    def to_device(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None: ...

    def finish(self) -> None: ...


class SyncCopies:
    """Synchronous copies: the "device" tensors live in host memory too (no streams, nothing to wait for)."""

    overlap = False

    def start(self) -> None:
        pass

    def to_host(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
        _copy(dst, src, non_blocking=False)

    def wait(self, done: torch.cuda.Event | None) -> None:
        pass

    def to_device(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
        _copy(dst, src, non_blocking=False)

    def finish(self) -> None:
        pass


class CudaCopies:
    """Asynchronous copies between a CUDA device and pinned host memory.

    Args:
        device: the CUDA device the parameters live on.
        overlap: run the copies on two side streams (device -> host, host -> device) instead of the current
            stream.
    """

    def __init__(self, device: torch.device, *, overlap: bool) -> None:
        self.device = device
        self.overlap = overlap
        self._to_host_stream = torch.cuda.Stream(device) if overlap else None
        self._to_device_stream = torch.cuda.Stream(device) if overlap else None
        self._main: torch.cuda.Stream | None = None

    def _stream(self, side: torch.cuda.Stream | None) -> torch.cuda.Stream:
        return side if side is not None else self._current()

    def _current(self) -> torch.cuda.Stream:
        return self._main if self._main is not None else torch.cuda.current_stream(self.device)

    def start(self) -> None:
        # The current stream is read afresh every step (the caller may step under another stream).
        self._main = torch.cuda.current_stream(self.device)
        for side in (self._to_host_stream, self._to_device_stream):
            if side is not None:
                side.wait_stream(self._main)

    def to_host(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> torch.cuda.Event:
        stream = self._stream(self._to_host_stream)
        with torch.cuda.stream(stream):
            _copy(dst, src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def wait(self, done: torch.cuda.Event | None) -> None:
        if done is not None:
            done.synchronize()

    def to_device(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
        with torch.cuda.stream(self._stream(self._to_device_stream)):
            _copy(dst, src, non_blocking=True)

    def finish(self) -> None:
        if self._to_device_stream is not None:
            self._current().wait_stream(self._to_device_stream)
        self._main = None


def copies_for(device: torch.device, *, overlap: bool) -> CudaCopies | SyncCopies:
    """The transfers for parameters on ``device``: asynchronous on CUDA, synchronous anywhere else (where
    ``overlap`` has nothing to overlap and is ignored)."""
    if device.type == "cuda":
        return CudaCopies(device, overlap=overlap)
    return SyncCopies()


def _copy(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], *, non_blocking: bool) -> None:
    # One copy per tensor: a cross-device foreach copy falls back to this loop anyway, and offloaded
    # parameters are few and large (the per-copy launch cost is noise next to the bytes moved).
    for d, s in zip(dst, src, strict=True):
        d.copy_(s, non_blocking=non_blocking)
