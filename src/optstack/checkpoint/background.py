"""Asynchronous saves (``save_checkpoint(..., blocking=False)``): the copy to host memory, the background thread
and its handle, one save at a time.

The thread writes, checks, commits, points ``latest`` and prunes exactly as a blocking save does, its
collectives over a process group of their own (``comm_for``: gloo, created once per set of ranks), so they
never interleave with the training's collectives on the caller's group. Saves commit in order: a save or a
load first waits for the asynchronous save in flight (``wait_pending``). The crash guarantees are the blocking
save's: the thread writes into the locked temporary directory and the rename is the commit.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from optstack.distributed.comm import Comm, NullComm
from optstack.protocol import ParamShard

__all__ = ["SaveHandle", "start", "wait_pending", "comm_for", "to_host", "on_host", "give_back", "release_buffers"]


class SaveHandle:
    """A checkpoint being written in the background (``save_checkpoint(..., blocking=False)``).

    Call ``wait()`` before ``torch.distributed.destroy_process_group()`` (the save's collectives need the
    process group) and to learn its outcome; an exiting interpreter finishes the save first.

    Attributes:
        path: the checkpoint directory the save commits (``root/step_<step>``).
    """

    def __init__(self, path: Path, run: Callable[[], Path]) -> None:
        self.path = path
        self._error: BaseException | None = None
        self._seen = False  # whether the caller asked for the outcome (else the next save warns of a failure)
        self._thread = threading.Thread(target=self._run, args=(run,), name=f"optstack-save-{path.name}")
        self._thread.start()  # not a daemon: an interpreter that exits finishes the save first

    def _run(self, run: Callable[[], Path]) -> None:
        try:
            run()
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException; kept for wait()
            self._error = exc

    def done(self) -> bool:
        """Whether the save has finished (committed, or failed)."""
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        """Wait for the save; return its directory, or raise what a blocking save would have raised.

        Raises:
            TimeoutError: still running after ``timeout`` seconds.
            ValueError, CheckpointError: the save failed (as ``save_checkpoint`` documents), on every rank alike.
        """
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the save of {self.path} is still running after {timeout} s")
        self._seen = True
        if self._error is not None:
            raise self._error
        return self.path

    @property
    def error(self) -> BaseException | None:
        """The error the save ended with; None while it runs or when it committed."""
        if self.done():
            self._seen = True
        return self._error if self.done() else None

    def __repr__(self) -> str:
        state = "running" if not self.done() else "failed" if self._error is not None else "committed"
        return f"SaveHandle({str(self.path)!r}, {state})"


_pending: SaveHandle | None = None
_lock = threading.Lock()


def start(path: Path, run: Callable[[], Path]) -> SaveHandle:
    """Run ``run`` (the rest of a save) in the background; the handle is the pending save."""
    global _pending
    with _lock:
        _pending = SaveHandle(path, run)
        return _pending


def wait_pending() -> None:
    """Wait for the asynchronous save in flight, if any; warn of its failure if nobody asked for it."""
    global _pending
    with _lock:
        pending, _pending = _pending, None
    if pending is None:
        return
    pending._thread.join()
    if pending._error is not None and not pending._seen:
        pending._seen = True
        warnings.warn(f"the asynchronous save of {pending.path} failed and nothing was committed ({pending._error}); "
                      "call wait() on the handle save_checkpoint(..., blocking=False) returned to see such errors",
                      stacklevel=3)


_comms: dict[tuple[int, ...], Comm] = {}


def comm_for(comm: Comm | NullComm) -> Comm | NullComm:
    """A ``Comm`` over ``comm``'s ranks on a gloo group of its own, for a background save's collectives
    (created on the first asynchronous save: collective over ``comm``'s ranks, which all save together)."""
    if isinstance(comm, NullComm):
        return comm
    ranks = tuple(comm.global_ranks)
    if ranks not in _comms:
        group = dist.new_group(list(ranks), backend="gloo", timeout=comm.timeout, use_local_synchronization=True)
        _comms[ranks] = Comm(group, name=f"{comm.name} (background save)", timeout=comm.timeout)
    return _comms[ranks]


class _Buffers:
    """Host buffers kept from one asynchronous save to the next, by shape and dtype: a fresh buffer costs its
    page faults (0.5 s for 300 MB here, most of the copy), a reused one only the copy. Holds one copy of the
    largest saved state between saves (``release_buffers()`` frees it); a save takes them after the previous
    save finished (saves run one at a time), so no save writes from a buffer another fills."""

    def __init__(self) -> None:
        self.free: dict[tuple[tuple[int, ...], torch.dtype, bool], list[torch.Tensor]] = {}
        self.lock = threading.Lock()

    def take(self, shape: torch.Size, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        with self.lock:
            found = self.free.get((tuple(shape), dtype, pinned))
            if found:
                return found.pop()
        return torch.empty(shape, dtype=dtype, pin_memory=pinned)

    def give(self, tensors: list[torch.Tensor]) -> None:
        with self.lock:
            for t in tensors:
                self.free.setdefault((tuple(t.shape), t.dtype, t.is_pinned() if t.device.type == "cpu"
                                      and torch.accelerator.is_available() else False), []).append(t)


_buffers = _Buffers()
give_back = _buffers.give  # a save's host buffers, for the next asynchronous save


def release_buffers() -> None:
    """Free the host buffers kept for the next asynchronous save (``_Buffers``)."""
    with _buffers.lock:
        _buffers.free.clear()


def to_host(tensor: torch.Tensor, taken: list[torch.Tensor] | None = None) -> torch.Tensor:
    """A host copy of ``tensor`` that training may not change, in a kept buffer (``_Buffers``; appended to
    ``taken``): filled synchronously from the CPU, asynchronously into pinned memory from a device (``on_host``
    waits for those copies)."""
    tensor = tensor.detach()
    device = tensor.device.type != "cpu"
    out = _buffers.take(tensor.shape, tensor.dtype, pinned=device)
    out.copy_(tensor, non_blocking=device)
    if taken is not None:
        taken.append(out)
    return out


def on_host(shards: Mapping[str, ParamShard], tensors: Mapping[str, torch.Tensor]
            ) -> tuple[dict[str, ParamShard], dict[str, torch.Tensor], list[torch.Tensor]]:
    """``shards`` and ``tensors`` with every tensor copied to host memory (``to_host``), the copies complete;
    and the buffers taken (``give_back`` them once the save is written)."""
    devices, taken = False, []

    def copy(value: Any) -> Any:
        nonlocal devices
        if not isinstance(value, torch.Tensor):
            return value
        devices |= value.device.type != "cpu"
        return to_host(value, taken)

    out_shards = {n: replace(s, tensors={k: copy(t) for k, t in s.tensors.items()},
                             scalars={k: copy(v) for k, v in s.scalars.items()}) for n, s in shards.items()}
    out_tensors = {k: copy(t) for k, t in tensors.items()}
    if devices:
        torch.accelerator.synchronize()  # the non-blocking copies into pinned memory have landed
    return out_shards, out_tensors, taken
