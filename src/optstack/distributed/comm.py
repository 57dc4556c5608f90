"""Every collective optstack uses, behind one small object; the only module that calls torch.distributed.

Every wait is bounded by the Comm's ``timeout`` (gloo per call; NCCL through the group's own, which ``new_group``
sets alike) and fails with a ``CommError`` naming the operation and group: a dead peer gives a message, not a
hang. PyTorch 2.13 renamed the flat collectives (``reduce_scatter_single``, ``all_gather_single``; the old names
warn); a backend without a native reduce-scatter gets an all-reduce.

``all_gather_object`` / ``broadcast_object`` pickle objects and unpickle what other ranks send: a rank can run
code on every other. The trust boundary is the cluster (every process in the group, and the network between them
and the rendezvous store); checkpoints, which cross it, are read as data only (``checkpoint/safe.py``).
"""

from __future__ import annotations

import datetime
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from optstack.tensor_bytes import tensor_bytes

__all__ = ["Comm", "NullComm", "CommError", "Handle", "ProcessGroup", "world_comm", "is_initialized", "world_rank",
           "world_size", "new_group", "new_subgroups", "torch_group", "device_mesh", "init_process_group",
           "destroy_process_group"]

ProcessGroup = dist.ProcessGroup
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_MAX_NDIM = 16  # all_gather_uneven exchanges shapes in a fixed-size header
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]


class CommError(RuntimeError):
    """A collective failed or timed out; the message names the operation and the group."""


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_rank() -> int:
    """This process's rank in the default group (0 when torch.distributed is not initialised)."""
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    """The number of processes in the default group (1 when torch.distributed is not initialised)."""
    return dist.get_world_size() if is_initialized() else 1


class Handle:
    """An in-flight collective; ``wait()`` blocks (within the timeout), then runs ``then`` (e.g. divides an average)."""

    def __init__(self, op: str, comm: Comm | NullComm, works: Sequence[Any] = (),
                 then: Callable[[], None] | None = None) -> None:
        self.op, self._comm, self._works, self._then, self._done = op, comm, list(works), then, False

    def __repr__(self) -> str:
        return f"Handle({self.op!r} on {self._comm.name!r}, done={self._done})"

    def is_completed(self) -> bool:
        """True once ``wait()`` has returned, or when every underlying work finished (does not block)."""
        return self._done or all(w.is_completed() for w in self._works)

    def wait(self) -> None:
        if self._done:
            return
        comm = self._comm
        for work in self._works:
            try:
                work.wait(comm.timeout) if comm.timeout is not None else work.wait()
            except Exception as exc:  # gloo/nccl raise RuntimeError subclasses with terse text
                limit = f", timeout {comm.timeout.total_seconds():g} s" if comm.timeout is not None else ""
                raise CommError(
                    f"{self.op} on the {comm.name!r} group (rank {comm.rank} of {comm.size}, {comm.backend}"
                    f"{limit}) failed: {exc}. A peer rank may have died, stalled or called a different collective."
                ) from exc
        self._done = True
        if self._then is not None:
            self._then()


def _reduce_op(op: str) -> Any:
    """The torch reduction for ``op`` ("avg" is a sum, divided afterwards)."""
    if op not in _REDUCE_OPS and op != "avg":
        raise ValueError(f"reduction op must be one of sum, max, min, avg; got {op!r}")
    return _REDUCE_OPS["sum" if op == "avg" else op]


class _Blocking:
    """The blocking collectives of ``Comm`` and ``NullComm``: each is its ``_async`` form, waited for."""

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce of ``tensor`` with ``op`` in {"sum", "max", "min", "avg"}; returns it."""
        self.all_reduce_async(tensor, op).wait()  # type: ignore[attr-defined]
        return tensor

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``inp`` (``size * n`` elements) into ``out``: this rank's slice, rank-major (``out`` may alias it)."""
        self.reduce_scatter_async(out, inp, op).wait()  # type: ignore[attr-defined]
        return out

    def all_gather_into(self, out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        """Gather every rank's ``inp`` (one shape) into ``out`` (rank-major); ``inp`` may be this rank's slice of it."""
        self.all_gather_into_async(out, inp).wait()  # type: ignore[attr-defined]
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In-place broadcast from group rank ``src`` (``src``'s own must not change until it is done)."""
        self.broadcast_async(tensor, src).wait()  # type: ignore[attr-defined]
        return tensor

    def gather(self, tensor: torch.Tensor | None, dst: int, parts: Sequence[torch.Tensor | None] = (),
               tag: int = 0) -> None:
        """Gather into ``parts`` on group rank ``dst`` (see ``gather_async``), waited for."""
        self.gather_async(tensor, dst, parts, tag).wait()  # type: ignore[attr-defined]

    def scatter(self, out: torch.Tensor | None, src: int, parts: Sequence[torch.Tensor | None] = (),
                tag: int = 0) -> None:
        """Scatter ``parts`` from group rank ``src`` into each rank's ``out`` (see ``scatter_async``), waited for."""
        self.scatter_async(out, src, parts, tag).wait()  # type: ignore[attr-defined]


class Comm(_Blocking):
    """Collectives over one process group.

    Args:
        group: the process group (None = the default world group).
        name: a human name for error messages ("data-parallel", "expert-data-parallel", ...).
        timeout: how long a blocking collective may wait before it fails (None = the group's own timeout).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, name: str = "world",
                 timeout: datetime.timedelta | None = None) -> None:
        if not is_initialized():
            raise ValueError(f"Comm({name!r}) needs an initialised torch.distributed process group; call "
                             "torch.distributed.init_process_group first, or use NullComm() for one process")
        self.group, self.name, self.timeout = group, name, timeout
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.global_ranks: list[int] = dist.get_process_group_ranks(group or dist.group.WORLD)
        self._native_reduce_scatter = True  # set False on the first "not supported" from the backend

    def __repr__(self) -> str:
        return f"Comm({self.name!r}, rank={self.rank}, size={self.size}, backend={self.backend})"

    def _start(self, opname: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, group=self.group, async_op=True, **kwargs)
        except Exception as exc:
            raise CommError(f"{opname} on the {self.name!r} group (rank {self.rank} of {self.size}) "
                            f"failed: {exc}") from exc

    def _check_sizes(self, op: str, *, whole: torch.Tensor, part: torch.Tensor) -> None:
        if whole.numel() != part.numel() * self.size or whole.dtype != part.dtype:
            raise ValueError(f"{op} on {self.name!r} needs a whole tensor of size x part elements (size {self.size}), "
                             f"one dtype; got whole {tuple(whole.shape)} {whole.dtype}, part {tuple(part.shape)} "
                             f"{part.dtype}")

    def object_device(self) -> torch.device:
        """Where this group's small host-chosen tensors go (objects, flags): host memory under gloo, else the
        current accelerator (no tensor to take the device from)."""
        acc = None if "gloo" in self.backend else torch.accelerator.current_accelerator()
        return torch.device("cpu") if acc is None else torch.device(acc.type, torch.accelerator.current_device_index())

    def all_reduce_async(self, tensor: torch.Tensor, op: str = "sum") -> Handle:
        """Start an in-place all-reduce; ``tensor`` holds the result once the handle's ``wait()`` returns."""
        work = self._start("all_reduce", dist.all_reduce, tensor, op=_reduce_op(op))
        return Handle("all_reduce", self, [work], (lambda: tensor.div_(self.size)) if op == "avg" else None)

    def reduce_scatter_async(self, out: torch.Tensor, inp: torch.Tensor, op: str = "sum") -> Handle:
        """Start ``reduce_scatter``; ``out`` holds this rank's reduced slice once ``wait()`` returns."""
        rop = _reduce_op(op)
        self._check_sizes("reduce_scatter", whole=inp, part=out)
        finish_avg = (lambda: out.div_(self.size)) if op == "avg" else None
        if self._native_reduce_scatter:
            try:
                work = dist.reduce_scatter_single(out, inp, op=rop, group=self.group, async_op=True)
                return Handle("reduce_scatter", self, [work], finish_avg)
            except (RuntimeError, NotImplementedError) as exc:
                if not any(s in str(exc).lower() for s in ("not supported", "unsupported", "not implemented")):
                    raise CommError(f"reduce_scatter on the {self.name!r} group (rank {self.rank}) failed: "
                                    f"{exc}") from exc
                self._native_reduce_scatter = False
        # Emulation: all-reduce a copy of the whole input, keep our slice (same numbers, more traffic).
        full = inp.detach().clone()
        work = self._start("reduce_scatter", dist.all_reduce, full, op=rop)
        n = out.numel()

        def finish() -> None:
            out.copy_(full.view(-1)[self.rank * n:(self.rank + 1) * n].view_as(out))
            if finish_avg is not None:
                finish_avg()

        return Handle("reduce_scatter", self, [work], finish)

    def all_gather_into_async(self, out: torch.Tensor, inp: torch.Tensor) -> Handle:
        """Start ``all_gather_into``; ``out`` is complete once ``wait()`` returns."""
        self._check_sizes("all_gather_into", whole=out, part=inp)
        return Handle("all_gather", self, [self._start("all_gather", dist.all_gather_single, out, inp)])

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0) -> Handle:
        """Start an in-place broadcast from group rank ``src``; done once the handle's ``wait()`` returns."""
        if not 0 <= src < self.size:
            raise ValueError(f"broadcast on {self.name!r}: src must be a group rank in [0, {self.size}), "
                             f"got {src}")
        return Handle("broadcast", self, [self._start("broadcast", dist.broadcast, tensor, src=self.global_ranks[src])])

    def _p2p(self, op: str, fn: Any, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        try:
            return fn(tensor.contiguous() if fn is dist.isend else tensor, self.global_ranks[peer], group=self.group,
                      tag=tag)
        except Exception as exc:
            raise CommError(f"{op} between group ranks {self.rank} and {peer} of the {self.name!r} group "
                            f"failed: {exc}") from exc

    def gather_async(self, tensor: torch.Tensor | None, dst: int, parts: Sequence[torch.Tensor | None] = (),
                     tag: int = 0) -> Handle:
        """Start a gather to group rank ``dst``: each rank's ``tensor`` (None: it sends nothing) into ``parts[r]``
        on ``dst`` (``size`` receive buffers of the senders' sizes, None where a rank sends nothing; ``dst``'s
        own is copied). Unlike torch's gather, sizes may differ and ranks may stay out (replicas of a shard):
        point-to-point underneath, ``tag`` telling apart gathers in flight between the same ranks. Every rank
        must agree on who sends what; the parts are filled once the handle's ``wait()`` returns."""
        return self._rooted("gather", dst, parts, tensor, tag, at_root=dist.irecv, at_peer=dist.isend)

    def scatter_async(self, out: torch.Tensor | None, src: int, parts: Sequence[torch.Tensor | None] = (),
                      tag: int = 0) -> Handle:
        """Start a scatter from group rank ``src``: ``parts[r]`` (given on ``src``; None: rank ``r`` gets nothing)
        into rank ``r``'s ``out`` (None where it gets nothing). Sizes may differ; point-to-point underneath, as
        ``gather_async``. ``out`` is filled once the handle's ``wait()`` returns."""
        return self._rooted("scatter", src, parts, out, tag, at_root=dist.isend, at_peer=dist.irecv)

    def _rooted(self, op: str, root: int, parts: Sequence[torch.Tensor | None], mine: torch.Tensor | None,
                tag: int, *, at_root: Callable, at_peer: Callable) -> Handle:
        """Gather (the root receives ``parts``) or scatter (the root sends them) point to point; the root's own
        part and ``mine`` are copied into each other in the direction of the data."""
        if not 0 <= root < self.size:
            raise ValueError(f"{op} on {self.name!r}: the root must be a group rank in [0, {self.size}), got {root}")
        works = []
        if self.rank == root:
            if len(parts) != self.size:
                side = "dst" if op == "gather" else "src"
                raise ValueError(f"{op} on {self.name!r}: {side} needs {self.size} parts (None where a rank "
                                 f"{'sends' if op == 'gather' else 'gets'} nothing), got {len(parts)}")
            for peer, part in enumerate(parts):
                if part is not None and peer != root:
                    works.append(self._p2p(op, at_root, part, peer, tag))
            own = parts[root]
            if own is not None and mine is not None and own.data_ptr() != mine.data_ptr():
                if op == "gather":
                    own.copy_(mine.view_as(own))
                else:
                    mine.copy_(own.view_as(mine))
        elif mine is not None:
            works.append(self._p2p(op, at_peer, mine, root, tag))
        return Handle(op, self, works)

    def all_gather_uneven(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` in group-rank order; shapes may differ, dtypes may not. gloo has no uneven
        all-gather: shapes go first, then data padded to the largest; the results are views of one buffer."""
        if tensor.ndim > _MAX_NDIM or tensor.dtype not in _DTYPES:
            raise ValueError(f"all_gather_uneven supports up to {_MAX_NDIM} dims of dtypes {_DTYPES}; got "
                             f"{tensor.ndim} dims of {tensor.dtype}")
        dims = [tensor.ndim, _DTYPES.index(tensor.dtype), *tensor.shape] + [0] * (_MAX_NDIM - tensor.ndim)
        header = torch.tensor(dims, dtype=torch.int64, device=tensor.device)
        headers = torch.empty(self.size * header.numel(), dtype=torch.int64, device=tensor.device)
        rows = self.all_gather_into(headers, header).view(self.size, -1).tolist()
        shapes = [tuple(row[2:2 + row[0]]) for row in rows]
        dtypes = [_DTYPES[row[1]] for row in rows]
        if any(d != tensor.dtype for d in dtypes):
            raise ValueError(f"all_gather_uneven on {self.name!r} needs one dtype on every rank; got "
                             f"{dict(enumerate(dtypes))}")
        numels = [int(torch.Size(s).numel()) for s in shapes]
        width = max(numels)
        padded = torch.zeros(width, dtype=tensor.dtype, device=tensor.device)
        padded[: tensor.numel()] = tensor.reshape(-1)
        gathered = torch.empty(self.size * width, dtype=tensor.dtype, device=tensor.device)
        self.all_gather_into(gathered, padded)
        return [gathered[r * width: r * width + numels[r]].view(shapes[r]) for r in range(self.size)]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in group-rank order."""
        data = _to_bytes(obj, self.object_device())
        return [pickle.loads(tensor_bytes(t)) for t in self.all_gather_uneven(data)]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Group rank ``src``'s ``obj`` (picklable) on every rank; other ranks' ``obj`` is ignored."""
        device = self.object_device()
        data = _to_bytes(obj, device) if self.rank == src else torch.empty(0, dtype=torch.uint8)
        length = self.broadcast(torch.tensor([data.numel()], dtype=torch.int64, device=device), src)
        if self.rank != src:
            data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
        self.broadcast(data, src)
        return obj if self.rank == src else pickle.loads(tensor_bytes(data))

    def barrier(self) -> None:
        Handle("barrier", self, [self._start("barrier", dist.barrier)]).wait()


def _to_bytes(obj: Any, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


class NullComm(_Blocking):
    """A world of one: every collective leaves its input as it is (reductions and gathers of one rank)."""

    group, timeout, rank, size, backend = None, None, 0, 1, "none"

    def __init__(self, name: str = "single-process") -> None:
        self.name = name
        self.global_ranks = [world_rank()]

    def __repr__(self) -> str:
        return f"NullComm({self.name!r})"

    def _copy(self, op: str, out: torch.Tensor, inp: torch.Tensor) -> Handle:
        if out.numel() != inp.numel():
            raise ValueError(f"{op} on one rank needs output and input of equal size; got "
                             f"{tuple(out.shape)} and {tuple(inp.shape)}")
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp.view_as(out))
        return Handle(op.removesuffix("_into"), self)

    def all_reduce_async(self, tensor: torch.Tensor, op: str = "sum") -> Handle:
        _reduce_op(op)
        return Handle("all_reduce", self)

    def reduce_scatter_async(self, out: torch.Tensor, inp: torch.Tensor, op: str = "sum") -> Handle:
        _reduce_op(op)
        return self._copy("reduce_scatter", out, inp)

    def all_gather_into_async(self, out: torch.Tensor, inp: torch.Tensor) -> Handle:
        return self._copy("all_gather_into", out, inp)

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0) -> Handle:
        return Handle("broadcast", self)

    def gather_async(self, tensor: torch.Tensor | None, dst: int, parts: Sequence[torch.Tensor | None] = (),
                     tag: int = 0) -> Handle:
        if dst != 0 or len(parts) != 1:
            raise ValueError(f"gather on one rank needs dst=0 and one part, got dst={dst} and {len(parts)} parts")
        if parts[0] is not None and tensor is not None and parts[0].data_ptr() != tensor.data_ptr():
            parts[0].copy_(tensor.view_as(parts[0]))
        return Handle("gather", self)

    def scatter_async(self, out: torch.Tensor | None, src: int, parts: Sequence[torch.Tensor | None] = (),
                      tag: int = 0) -> Handle:
        if src != 0 or len(parts) != 1:
            raise ValueError(f"scatter on one rank needs src=0 and one part, got src={src} and {len(parts)} parts")
        if parts[0] is not None and out is not None and parts[0].data_ptr() != out.data_ptr():
            out.copy_(parts[0].view_as(out))
        return Handle("scatter", self)

    def all_gather_uneven(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor]

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        return None


def world_comm(name: str = "world", timeout: datetime.timedelta | None = None) -> Comm | NullComm:
    """The whole world as a Comm when torch.distributed is initialised with several ranks, else NullComm."""
    if is_initialized() and dist.get_world_size() > 1:
        return Comm(None, name=name, timeout=timeout)
    return NullComm(name)


def new_group(ranks: Sequence[int], *, name: str, timeout: datetime.timedelta | None = None) -> Comm | NullComm | None:
    """A Comm over global ``ranks`` for its members (NullComm for one rank, the world group for all), else None.
    Collective: every rank calls it with the same ``ranks``, in one order relative to other group creations."""
    ranks = sorted(int(r) for r in ranks)
    size, me = world_size(), world_rank()
    if not ranks or len(set(ranks)) != len(ranks) or ranks[0] < 0 or ranks[-1] >= size:
        raise ValueError(f"new_group({name!r}): ranks must be distinct ranks in [0, {size}); got {ranks}")
    if len(ranks) == 1:
        return NullComm(name) if me in ranks else None
    if len(ranks) == size:
        return Comm(None, name=name, timeout=timeout)
    try:
        group = dist.new_group(ranks, timeout=timeout)
    except Exception as exc:
        raise CommError(f"creating the {name!r} group over ranks {ranks} failed on rank {me}: {exc}") from exc
    return Comm(group, name=name, timeout=timeout) if me in ranks else None


def torch_group(comm: Comm | NullComm) -> dist.ProcessGroup | None:
    """``comm``'s torch process group for code that calls torch.distributed itself (Megatron's face): the world's
    for the world Comm, a group of only this rank for a NullComm in an initialised world (only it takes part in
    creating it), None without torch.distributed."""
    if isinstance(comm, Comm):
        return comm.group if comm.group is not None else dist.group.WORLD
    if not is_initialized():
        return None
    return dist.new_group([dist.get_rank()], use_local_synchronization=True)


def device_mesh(comm: Comm | NullComm, device_type: str, *, replicas: int = 1) -> Any:
    """A torch ``DeviceMesh`` over ``comm``'s ranks for FSDP2 (``fully_shard``): 1-D ("shard",) or, with
    ``replicas`` > 1, HSDP's 2-D ("replicate", "shard") of ``replicas`` x ``size // replicas`` (consecutive ranks
    shard together). Collective over the world when it creates groups.

    Raises:
        ValueError: ``replicas`` does not divide the size, or a 2-D mesh over a group smaller than the world.
    """
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if replicas < 1 or comm.size % replicas:
        raise ValueError(f"device_mesh: replicas={replicas} must divide the group size {comm.size}")
    whole = isinstance(comm, NullComm) or comm.group is None or comm.size == world_size()
    if replicas > 1:
        if not whole:
            raise ValueError("device_mesh: a 2-D (replicate x shard) mesh needs the whole world as the group")
        return init_device_mesh(device_type, (replicas, comm.size // replicas), mesh_dim_names=("replicate", "shard"))
    if whole:
        return init_device_mesh(device_type, (comm.size,), mesh_dim_names=("shard",))
    return DeviceMesh.from_group(comm.group, device_type, mesh_dim_names=("shard",))


def new_subgroups(rank_lists: Sequence[Sequence[int]], *, name: str,
                  timeout: datetime.timedelta | None = None) -> Comm | NullComm:
    """This rank's Comm of a partition of the world (each rank in one list). Collective: all pass the same lists."""
    flat = sorted(int(r) for ranks in rank_lists for r in ranks)
    if flat != list(range(world_size())):
        raise ValueError(f"new_subgroups({name!r}): the rank lists must cover every rank of the world "
                         f"(size {world_size()}) exactly once; got {[list(r) for r in rank_lists]}")
    comms = [new_group(ranks, name=name, timeout=timeout) for ranks in rank_lists]
    return next(c for c in comms if c is not None)  # every rank is in one list (checked above)


def init_process_group(rank: int, size: int, *, store_path: str | os.PathLike[str], device: torch.device | None = None,
                       timeout: datetime.timedelta = datetime.timedelta(minutes=5)) -> Comm | NullComm:
    """Join a world of ``size`` processes on one machine through the file ``store_path`` (no port to pick; the
    same on every rank, absent before the first calls) and return its Comm. NCCL for a CUDA ``device`` (bound
    to it), else gloo; ``timeout`` bounds the rendezvous and every collective of the world group.

    Raises:
        ValueError: ``rank`` / ``size`` out of range or a world already initialised.
        CommError: the rendezvous failed or timed out.
    """
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"init_process_group: need 0 <= rank < size, got rank={rank}, size={size}")
    if is_initialized():
        raise ValueError("init_process_group: torch.distributed is already initialised in this process")
    cuda = device is not None and device.type == "cuda"
    try:
        store = dist.FileStore(os.fspath(store_path), size)
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=size,
                                timeout=timeout, device_id=device if cuda else None)
    except Exception as exc:
        raise CommError(f"rank {rank} of {size} could not join the world through {os.fspath(store_path)!r} "
                        f"within {timeout.total_seconds():g} s: {exc}") from exc
    return world_comm("world", timeout)


def destroy_process_group() -> None:
    """Leave the world joined by ``init_process_group`` (nothing to do when none is initialised)."""
    if is_initialized():
        dist.destroy_process_group()
