"""Moving a set of state tensors to host memory between steps and back, keeping the tensor objects.

``HostCopy`` copies each distinct storage under the given tensors into a host buffer (pinned on CUDA,
``non_blocking`` on the current stream, an event recorded after) and then shrinks the device storage to
0 bytes, so the memory is freed while every tensor object and every view (back-to-back state, step counters
that are views of one buffer, optimizer state keyed by tensor) stays what it was. ``reload`` grows the
storages back and copies the bytes in: the values are bit for bit the same.

While moved out, the tensors must not be read (their storage is empty); the owners (``Stage``) reload
before anything reads them. On a CPU-only run "host" is the same memory kind: the storages are still
emptied and refilled, so the path that runs is the one that runs on CUDA.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["HostCopy"]


class HostCopy:
    """The host copies of the storages under ``tensors`` that lie on ``device`` (others are left alone),
    each storage once; the device storages are emptied once the copies are issued.

    Args:
        tensors: the tensors to move (views of one storage are moved once, with the whole storage).
        device: the device whose storages move (on CUDA, host tensors already there are skipped).
    """

    def __init__(self, tensors: Iterable[torch.Tensor], device: torch.device) -> None:
        self.device = device
        storages: dict[int, torch.UntypedStorage] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if tensor.device == device and storage.nbytes() > 0:
                storages.setdefault(storage.data_ptr(), storage)
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
        """Bytes moved to the host."""
        return sum(host.numel() for _, host in self._moved)

    def reload(self) -> None:
        """Grow each storage back and copy its bytes in (asynchronously on CUDA, ordered after the offload)."""
        if self._event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._event)
        pin = self.device.type == "cuda"
        for storage, host in self._moved:
            storage.resize_(host.numel())
            _bytes(storage).copy_(host, non_blocking=pin)
        self._moved = []


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _record(device: torch.device) -> torch.cuda.Event | None:
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
