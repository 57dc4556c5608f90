"""Moving a set of state tensors to host memory between steps and back, keeping the tensor objects.

``HostCopy`` copies each distinct storage under the given tensors into a host buffer (pinned on CUDA,
``non_blocking`` on the current stream, an event recorded after) and then shrinks the device storage to
0 bytes, so the memory is freed while every tensor object and every view (back-to-back state, step counters
that are views of one buffer, optimizer state keyed by tensor) stays what it was. ``reload`` grows the
storages back and copies the bytes in: the values are bit for bit the same.

While moved out, the tensors must not be read (their storage is empty); the owners (``Stage``) reload
before anything reads them. On a CPU-only run "host" is the same memory kind: the storages are still
emptied and refilled, so the path that runs is the one that runs on CUDA.

Scratch (buffers whose values a step writes before it reads them: fp32 gradient copies, an algorithm's
staging buffers) is freed without a copy and regrown zero-filled, as it was allocated: no bytes cross for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["HostCopy", "scratch_of"]


def scratch_of(optimizer: Any) -> list[torch.Tensor]:
    """``optimizer.scratch_tensors()`` (its reused buffers whose values do not outlive a step: optstack's
    algorithms and ``HybridDeviceOptimizer`` say which), or none for an optimizer that keeps none (torch's)."""
    scratch = getattr(optimizer, "scratch_tensors", None)
    return list(scratch()) if scratch is not None else []


class HostCopy:
    """The host copies of the storages under ``tensors`` (module docstring).

    Args:
        tensors: the tensors to move (views of one storage are moved once, with the whole storage).
        device: the device whose storages move (others are left alone: on CUDA, host tensors are skipped).
        scratch: tensors whose storages are freed without a copy and regrown zero-filled by ``reload``; a
            storage also under ``tensors`` is moved.
    """

    def __init__(self, tensors: Iterable[torch.Tensor], device: torch.device,
                 scratch: Iterable[torch.Tensor] = ()) -> None:
        self.device = device
        storages, self._freed = _storages(tensors, device), _storages(scratch, device)
        for key in storages.keys() & self._freed.keys():
            del self._freed[key]
        self._freed_nbytes = [s.nbytes() for s in self._freed.values()]
        for storage in self._freed.values():
            storage.resize_(0)  # nothing reads it before the reload regrows it
        pin = device.type == "cuda"
        self._moved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        for storage in storages.values():
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin)
            host.copy_(_bytes(storage), non_blocking=pin)
            self._moved.append((storage, host))
        self._event = _record(device)
        for storage, _ in self._moved:  # stream-ordered: the allocator reuses the memory after the copies
            storage.resize_(0)

    @property
    def nbytes(self) -> int:
        """Bytes moved to the host (freed scratch not counted: see ``freed_nbytes``)."""
        return sum(host.numel() for _, host in self._moved)

    @property
    def freed_nbytes(self) -> int:
        """Bytes of scratch freed on the device without a copy."""
        return sum(self._freed_nbytes)

    def reload(self) -> None:
        """Grow each storage back and copy its bytes in (asynchronously on CUDA, ordered after the offload)."""
        if self._event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._event)
        pin = self.device.type == "cuda"
        for storage, host in self._moved:
            storage.resize_(host.numel())
            _bytes(storage).copy_(host, non_blocking=pin)
        for storage, nbytes in zip(self._freed.values(), self._freed_nbytes, strict=True):
            storage.resize_(nbytes)
            _bytes(storage).zero_()
        self._moved, self._freed, self._freed_nbytes = [], {}, []


def _storages(tensors: Iterable[torch.Tensor], device: torch.device) -> dict[int, torch.UntypedStorage]:
    """The distinct non-empty storages under ``tensors`` that lie on ``device``, by data pointer."""
    storages: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if tensor.device == device and storage.nbytes() > 0:
            storages.setdefault(storage.data_ptr(), storage)
    return storages


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _record(device: torch.device) -> torch.cuda.Event | None:
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
