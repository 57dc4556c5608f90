"""Every collective optstack uses, behind one small object. The only module that calls torch.distributed.

A ``Comm`` wraps one process group. ``NullComm`` (world size 1) makes every collective a no-op, so
single-process code paths are the same code. Collectives on a ``Comm`` are synchronous unless the method
says it returns a work handle; each names its operation and group in the error raised when it fails or
times out, so a rank that dies gives the others a clear message instead of a hang.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Comm", "NullComm", "CommError", "world_comm", "is_initialized"]


class CommError(RuntimeError):
    """A collective failed or timed out; the message names the operation and the group."""


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


class Comm:
    """Collectives over one process group.

    Args:
        group: the process group (None = the default world group).
        name: a human name for error messages ("data-parallel", "expert-data-parallel", ...).
        timeout: how long a blocking collective may wait before it fails (None = the group's own timeout).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        name: str = "world",
        timeout: datetime.timedelta | None = None,
    ) -> None:
        if not is_initialized():
            raise ValueError(
                f"Comm({name!r}) needs an initialised torch.distributed process group; "
                "call torch.distributed.init_process_group first, or use NullComm() for one process"
            )
        self.group = group
        self.name = name
        self.timeout = timeout
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))

    def __repr__(self) -> str:
        return f"Comm({self.name!r}, rank={self.rank}, size={self.size}, backend={self.backend})"

    # -- helpers -------------------------------------------------------------------------------------
    def _wait(self, op: str, work: Any) -> None:
        try:
            if self.timeout is not None:
                work.wait(self.timeout)
            else:
                work.wait()
        except Exception as exc:  # gloo/nccl raise RuntimeError subclasses with terse text
            raise CommError(
                f"{op} on the {self.name!r} group (rank {self.rank} of {self.size}, {self.backend}) failed: "
                f"{exc}. A peer rank may have died, stalled or called a different collective."
            ) from exc

    def _run(self, opname: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        try:
            work = fn(*args, group=self.group, async_op=True, **kwargs)
        except Exception as exc:
            raise CommError(
                f"{opname} on the {self.name!r} group (rank {self.rank} of {self.size}) failed: {exc}"
            ) from exc
        self._wait(opname, work)

    # -- collectives ---------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce of ``tensor`` with ``op`` in {"sum", "max", "min", "avg"}; returns it."""
        if op == "avg":
            self._run("all_reduce", dist.all_reduce, tensor, op=dist.ReduceOp.SUM)
            tensor.div_(self.size)
        else:
            self._run("all_reduce", dist.all_reduce, tensor, op=_REDUCE_OPS[op])
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In-place broadcast from group rank ``src``."""
        self._run("broadcast", dist.broadcast, tensor, src=dist.get_global_rank(self.group, src)
                  if self.group is not None else src)
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in group-rank order."""
        out: list[Any] = [None] * self.size
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except Exception as exc:
            raise CommError(f"all_gather_object on the {self.name!r} group (rank {self.rank}) failed: {exc}") from exc
        return out

    def barrier(self) -> None:
        self._run("barrier", dist.barrier)


class NullComm:
    """A world of one: every collective returns its input unchanged."""

    def __init__(self, name: str = "single-process") -> None:
        self.group = None
        self.name = name
        self.timeout = None
        self.rank = 0
        self.size = 1
        self.backend = "none"

    def __repr__(self) -> str:
        return f"NullComm({self.name!r})"

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if op not in _REDUCE_OPS and op != "avg":
            raise ValueError(f"all_reduce op must be one of sum, max, min, avg; got {op!r}")
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        return None


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def world_comm(name: str = "world", timeout: datetime.timedelta | None = None) -> Comm | NullComm:
    """The whole world as a Comm when torch.distributed is initialised with more than one rank, else NullComm."""
    if is_initialized() and dist.get_world_size() > 1:
        return Comm(None, name=name, timeout=timeout)
    return NullComm(name)
