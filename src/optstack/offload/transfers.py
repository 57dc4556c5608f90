"""The device <-> host copies of an offloaded step (gradients out, updated values back) and their ordering.

Why each wait on CUDA (copies from/into pinned host memory, asynchronous): ``start`` makes the side streams wait
for the current stream so far (it produced the gradients, and the last backward may still read the parameters
about to be overwritten), not for the device step launched after it; ``wait(event)`` blocks the host until a
device -> host batch is done; ``finish`` makes the current stream (not the host) wait for the host -> device
copies, so what follows the step sees the new values. Side-stream memory is never freed early: every device ->
host batch is waited for before the step returns; host -> device destinations are parameters that live on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["Pairs", "Transfers"]

Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]  # (destination, source) per copy


class Transfers:
    """One step's copies for parameters on ``device``: async on CUDA (one side stream per direction with
    ``overlap``, else the current stream), synchronous elsewhere (``overlap`` ignored, waits no-ops)."""

    def __init__(self, device: torch.device, *, overlap: bool) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.overlap = overlap and self.cuda
        # (device -> host, host -> device); None: the current stream
        self._sides = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if self.overlap else (None, None)
        self._main: torch.cuda.Stream | None = None

    def start(self) -> None:
        if self.cuda:  # read afresh every step: the caller may step under another stream
            self._main = torch.cuda.current_stream(self.device)
            for side in self._sides:
                if side is not None:
                    side.wait_stream(self._main)

    def to_host(self, pairs: Pairs) -> torch.cuda.Event | None:
        """Copy each (host, device) pair; returns what ``wait`` needs to know they are done."""
        return self._copy(pairs, self._sides[0], record=True)

    def wait(self, done: torch.cuda.Event | None) -> None:
        if done is not None:
            done.synchronize()

    def to_device(self, pairs: Pairs) -> None:
        self._copy(pairs, self._sides[1], record=False)

    def finish(self) -> None:
        if self._sides[1] is not None:
            self._main.wait_stream(self._sides[1])  # type: ignore[union-attr]
        self._main = None

    def _copy(self, pairs: Pairs, side: torch.cuda.Stream | None, *, record: bool) -> torch.cuda.Event | None:
        # One copy per tensor: a cross-device foreach copy loops anyway, and offloaded tensors are few and large.
        if not self.cuda:
            for dst, src in pairs:
                dst.copy_(src)
            return None
        stream = side if side is not None else self._main
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            if not record:
                return None
            done = torch.cuda.Event()
            done.record(stream)
            return done
