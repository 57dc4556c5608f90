"""Every parameter publication: after a step, each bucket's updated ranges to every rank (ZeRO-1; with overlap,
forward pre-hooks wait for each module's buckets: ``register_wait_hooks``), whole parameters from their owners
(layer-wise), and DTensor shards scattered back from the owner that stepped their whole matrix (``OwnerRoutes``,
which also gathers them to it); before one, whole reduced gradients from reduce-scattered shards (``GradShards``
for owners, ``GradGather`` for a replicated stage).

A ZeRO-1 gather is planned once per bucket: whole and in place when the bucket holds only this stage's
parameters, else this stage's pieces packed per rank, so two stages sharing a bucket (e.g. Muon matrices
layer-wise, biases by ZeRO-1) never write the same elements.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from optstack.distributed.buffers import ParamAndGradBuffer
from optstack.distributed.comm import Comm, Handle, NullComm

__all__ = ["BucketGather", "GatherVia", "GradShards", "OwnerBroadcast", "OwnerRoutes", "ParamGather",
           "ShardedLayout", "gather_via", "plan_bucket_gathers", "register_wait_hooks", "root_placements"]

GatherVia = Literal["all_gather", "broadcast"]

# gloo: a broadcast per rank in place is 2-5x faster than an all-gather (2 ranks, 5M-element shards: 16 vs 60 ms).
_GATHER_BY_BACKEND: dict[str, GatherVia] = {"gloo": "broadcast"}


@dataclass(eq=False)
class BucketGather:
    """The parameter gather of one bucket for one stage: the whole bucket (``pieces`` empty: every rank's
    range of ``bucket_data``, in place), or this stage's pieces packed per rank (``pieces[rank]``: (offset in
    the rank's packet, offset in the bucket, numel) each; ``widths[rank]``: its packet's size)."""

    comm: Comm | NullComm
    bucket_data: torch.Tensor  # the bucket's slice of the parameter buffer
    via: GatherVia
    pieces: tuple[tuple[tuple[int, int, int], ...], ...] = ()
    widths: tuple[int, ...] = ()
    handles: list[Handle] = field(default_factory=list)
    packets: list[torch.Tensor] = field(default_factory=list)  # in flight: every rank's packet, to unpack

    def _packet(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s part: a view of its range, or its pieces packed (this rank's filled in)."""
        if not self.pieces:
            shard = self.bucket_data.numel() // self.comm.size
            return self.bucket_data[rank * shard:(rank + 1) * shard]
        packet = self.bucket_data.new_zeros(max(self.widths) if self.via == "all_gather" else self.widths[rank])
        if rank == self.comm.rank:
            for offset, at, numel in self.pieces[rank]:
                packet[offset:offset + numel].copy_(self.bucket_data[at:at + numel])
        return packet

    def launch(self) -> None:
        """Start the gather (collective: every rank, same order); ``wait()`` finishes it."""
        comm = self.comm
        if self.via == "broadcast":
            packets = [self._packet(rank) for rank in range(comm.size)]
            self.handles = [comm.broadcast_async(packet, rank) for rank, packet in enumerate(packets)]
        else:
            mine = self._packet(comm.rank)
            out = mine.new_empty(mine.numel() * comm.size) if self.pieces else self.bucket_data
            self.handles = [comm.all_gather_into_async(out, mine)]
            packets = list(out.view(comm.size, -1)) if self.pieces else []
        self.packets = packets if self.pieces else []  # a whole bucket is gathered in place: nothing to unpack

    def wait(self) -> None:
        """Wait for the gather started by ``launch()`` and unpack it (a no-op when none is in flight)."""
        if not self.handles:
            return
        for handle in self.handles:
            handle.wait()
        self.handles = []
        for rank, packet in enumerate(self.packets):
            if rank != self.comm.rank:
                for offset, at, numel in self.pieces[rank]:
                    self.bucket_data[at:at + numel].copy_(packet[offset:offset + numel])
        self.packets = []


def gather_via(choice: Literal["auto", "all_gather", "broadcast"], backend: str, *, overlap: bool) -> GatherVia:
    """``choice``, or for "auto" the fastest on ``backend`` (``overlap`` changes nothing today: both are async)."""
    if choice not in ("auto", "all_gather", "broadcast"):
        raise ValueError(f"param_gather must be 'auto', 'all_gather' or 'broadcast', got {choice!r}")
    return _GATHER_BY_BACKEND.get(backend, "all_gather") if choice == "auto" else choice


def plan_bucket_gathers(buckets: Sequence[tuple[ParamAndGradBuffer, int, set[str]]], comm: Comm | NullComm,
                        via: GatherVia, module: nn.Module) -> list[BucketGather]:
    """One gather per (buffer, bucket index, the stage's parameter names in it), the same list on every rank, in
    forward order (by the bucket's first parameter in ``module``): what the next forward needs goes first."""
    if comm.size == 1:
        return []
    position = {id(p): i for i, p in enumerate(module.parameters())}
    keyed: list[tuple[int, BucketGather]] = []
    for buffer, index, names in buckets:
        bucket = buffer.buckets[index]
        pieces: list[tuple[tuple[int, int, int], ...]] = []
        if names != set(bucket.slot.param_names):
            for rank in range(comm.size):
                mine, offset = [], 0
                for part in buffer.layout.owned_slices(index, rank):
                    if part.name in names:
                        mine.append((offset, part.buffer_start - bucket.slot.offset, part.numel))
                        offset += part.numel
                pieces.append(tuple(mine))
        widths = tuple(sum(numel for *_, numel in mine) for mine in pieces)
        first_use = min(position[id(p)] for p in bucket.params)
        keyed.append((first_use, BucketGather(comm, bucket.param_data, via, tuple(pieces), widths)))
    keyed.sort(key=lambda kg: kg[0])
    return [gather for _, gather in keyed]


@dataclass(eq=False)
class ParamGather:
    """One stage's bucket gathers, in forward order; ``wait`` is a no-op with nothing in flight (for pre-hooks)."""

    gathers: list[BucketGather]
    overlap: bool = False  # the step leaves the gathers in flight; forward pre-hooks wait for them
    pending: bool = False
    # installs the forward pre-hooks; run at the first launch, so building a stage attaches nothing to the model
    attach: Callable[[], None] | None = None

    def launch(self) -> None:
        if self.attach is not None:
            self.attach()
            self.attach = None
        for gather in self.gathers:
            gather.launch()
        self.pending = bool(self.gathers)

    def wait(self) -> None:
        if self.pending:
            for gather in self.gathers:
                gather.wait()
            self.pending = False


def register_wait_hooks(module: nn.Module, gather: ParamGather) -> list[Any]:
    """A forward pre-hook per submodule of ``module`` waiting for just its buckets of ``gather`` (the overlap: the
    first layer starts while the others' gathers travel). Returns the hooks' handles."""
    # Sorted spans and a binary search per parameter: linear in parameters, whatever the number of buckets.
    spans = sorted(((g.bucket_data.data_ptr(), g.bucket_data.data_ptr() + g.bucket_data.nbytes, g)
                    for g in gather.gathers), key=lambda span: span[0])
    starts = [lo for lo, _, _ in spans]

    def gather_of(param: torch.Tensor) -> Any:
        i = bisect.bisect_right(starts, param.data_ptr()) - 1
        return spans[i][2] if i >= 0 and param.data_ptr() < spans[i][1] else None

    hooks = []
    for sub in module.modules():
        needed = [g for g in dict.fromkeys(gather_of(p) for p in sub.parameters(recurse=False)) if g is not None]
        if needed:
            hooks.append(sub.register_forward_pre_hook(functools.partial(_wait_for, needed)))
    return hooks


def _wait_for(gathers: list[BucketGather], module: nn.Module, args: Any) -> None:
    for gather in gathers:
        gather.wait()


@dataclass(frozen=True, eq=False)
class ShardedLayout:
    """What a ZeRO-1 placement sees of a data-parallel wrapper (``DataParallel.sharded_layout``).

    Attributes:
        slices: ``id(param)`` -> (start, end, parameter-buffer view, gradient-buffer view), 1-D, for the
            parameters this rank owns ``[start, end)`` of (flattened).
        reduce_over: the shard group first, then the groups holding other gradients.
        gather: the stage's parameter gather (its forward pre-hooks, with overlap, are the wrapper's).
        whole: every parameter lies whole in one rank's range: the views have the parameters' shapes.
        where: ``id(param)`` -> (its buffer's layout, its name there): what any rank of the shard group holds
            (``parts``, pure), so a checkpoint knows every rank's ranges without asking them.
    """

    slices: Mapping[int, tuple[int, int, torch.Tensor, torch.Tensor]]
    reduce_over: Sequence[Comm | NullComm]
    tp_rank: int
    device: torch.device
    gather: ParamGather
    whole: bool = False
    where: Mapping[int, tuple[Any, str]] = field(default_factory=dict)

    def owned(self, param: torch.Tensor) -> tuple[int, int, torch.Tensor, torch.Tensor] | None:
        return self.slices.get(id(param))

    def parts(self, param: torch.Tensor) -> list[tuple[int, int, int, int]] | None:
        """Every shard-group rank's part of ``param`` as runs ``(first rank, start, end, count)``: ranks
        ``first .. first + count - 1`` hold consecutive stretches of ``end - start`` elements of the flattened
        parameter, the i-th from ``start + i * (end - start)``. None: the layout is unknown here."""
        if id(param) not in self.where:
            return None
        layout, name = self.where[id(param)]
        return layout.runs(name)


@dataclass(frozen=True)
class GradShards:
    """Where reduce-scattered gradients lie (``DataParallel.grad_shards``): per parameter, this rank's reduced
    part (``[start, end)`` of the flattened parameter and a 1-D view of the gradient buffer, or None) and, for
    any rank, which part of it that rank's shard holds (``part_on``, pure: from the buffer layout)."""

    comm: Comm | NullComm
    reduce_over: Sequence[Comm | NullComm]
    tp_rank: int
    device: torch.device
    mine: Mapping[int, tuple[int, int, torch.Tensor] | None]  # id(param) -> this rank's part
    where: Mapping[int, tuple[Any, str]]  # id(param) -> (its buffer's layout, its name there)
    grad_dtype: Mapping[int, torch.dtype]

    def part_on(self, param: torch.Tensor, rank: int) -> tuple[int, int] | None:
        """``[start, end)`` of the flattened ``param`` held reduced by ``rank`` (None: nothing)."""
        layout, name = self.where[id(param)]
        part = layout.owned_slice(name, rank)
        return None if part is None else (part.param_start, part.param_end)


@dataclass(frozen=True)
class GradGather:
    """Whole reduced gradients on every rank from buckets the wrapper reduce-scatters: each rank's reduced shard
    of every bucket all-gathered into the bucket (``DataParallel.grad_gather``), for a stage stepping whole
    parameters replicated over a wrapper built to shard. A reduce-scatter and an all-gather move what one
    all-reduce moves; the wrapper's reductions stay as built. Idempotent within a step."""

    #: per bucket: (the group it is sharded over, this rank's reduced shard, the bucket's gradient)
    buckets: Sequence[tuple[Comm | NullComm, torch.Tensor, torch.Tensor]]

    @torch.no_grad()
    def run(self) -> None:
        for comm, shard, whole in self.buckets:
            comm.all_gather_into(whole, shard.clone())  # the shard is a view of the output


@torch.no_grad()
def gather_bucket(comm: Comm | NullComm, buffer: ParamAndGradBuffer, index: int) -> None:
    """All-gather bucket ``index`` of ``buffer`` from every rank's shard of it, synchronously (the parameters each
    rank's ZeRO-1 ranges hold, written by means other than a stage's own gather)."""
    own = buffer.param_shard_view(index, comm.rank).clone()  # a view of the output
    comm.all_gather_into(buffer.buckets[index].param_data, own)


@torch.no_grad()
def start_packed_broadcasts(comm: Comm | NullComm, per_owner: Sequence[Sequence[torch.Tensor]],
                            scratch: torch.Tensor) -> tuple[list[torch.Tensor], list[Handle]]:
    """Start publishing parameters stepped by their owners: rank r's ``per_owner[r]`` packed into the r-th part
    of ``scratch`` (1-D, of their dtype) and broadcast from r (Megatron's layer-wise bucket gather, into the
    idle gradient buffer). Returns the parts and the handles; ``unpack_broadcasts`` once they are waited for."""
    sizes = [sum(p.numel() for p in params) for params in per_owner]
    parts = list(scratch[:sum(sizes)].split(sizes))
    if sizes[comm.rank]:
        torch.cat([p.detach().reshape(-1) for p in per_owner[comm.rank]], out=parts[comm.rank])
    handles = [comm.broadcast_async(part, rank) for rank, part in enumerate(parts) if part.numel()]
    return parts, handles


@torch.no_grad()
def unpack_broadcasts(rank: int, per_owner: Sequence[Sequence[torch.Tensor]],
                      parts: Sequence[torch.Tensor]) -> None:
    """Copy the other owners' broadcast parts (``start_packed_broadcasts``) into their parameters."""
    for owner, (params, part) in enumerate(zip(per_owner, parts, strict=True)):
        if owner != rank and params:
            for param, value in zip(params, part.split([p.numel() for p in params]), strict=True):
                param.copy_(value.view_as(param))


# Parameters of at least this many elements are broadcast in place, smaller ones packed per owner and dtype.
# gloo, 2 ranks, 24 matrices: 11.4M elements 30-35 ms (per-parameter 35, all-gather 95-195); 0.3M packed 1.1 vs 5.
BROADCAST_IN_PLACE = 1 << 16


class OwnerBroadcast:
    """Whole parameters from their owner ranks to every rank (the layer-wise publish), planned once."""

    def __init__(self, comm: Comm | NullComm, params: Sequence[torch.Tensor], owners: Sequence[int]) -> None:
        self.comm = comm
        self.plan: list[tuple[list[torch.Tensor], list[list[torch.Tensor]]]] = []  # per owner: in place, packs
        for rank in range(comm.size):
            large: list[torch.Tensor] = []
            packs: dict[torch.dtype, list[torch.Tensor]] = {}
            for p in (p for p, owner in zip(params, owners, strict=True) if owner == rank):
                if p.numel() >= BROADCAST_IN_PLACE and p.is_contiguous():
                    large.append(p)
                else:
                    packs.setdefault(p.dtype, []).append(p)
            self.plan.append((large, list(packs.values())))

    @torch.no_grad()
    def run(self) -> None:
        comm = self.comm
        if comm.size == 1:
            return
        for owner, (large, small) in enumerate(self.plan):
            for param in large:
                comm.broadcast(param.data, owner)
            for members in small:
                if owner == comm.rank:
                    packet = torch.cat([p.detach().reshape(-1) for p in members])
                else:
                    packet = members[0].new_empty(sum(p.numel() for p in members))
                comm.broadcast(packet, owner)
                if owner != comm.rank:
                    for p, part in zip(members, packet.split([p.numel() for p in members]), strict=True):
                        p.copy_(part.view_as(p))


def _shard(param: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard: a view of its live storage, not a copy."""
    with torch.no_grad():
        return param.to_local()


def root_placements(param: torch.Tensor) -> tuple[torch.Tensor, list[Any], list[int], list[int] | None]:
    """The DTensor ``param``'s placement over the root of its mesh: the root's global ranks, one placement per root
    dim (``Replicate()`` for a dim the parameter's submesh leaves out: its ranks hold replicas, e.g. FSDP2 over the
    "dp" half of a dp x tp mesh), the root's dim sizes and this rank's root coordinate. A mesh that is its own
    root, or whose dims cannot be matched to its root's by name, is taken as it is."""
    mesh = param.device_mesh
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    names, root_names = list(mesh.mesh_dim_names or ()), list(root.mesh_dim_names or ())
    if root is mesh or not names or any(n not in root_names for n in names) \
            or [root_names.index(n) for n in names] != sorted(root_names.index(n) for n in names):
        return torch.as_tensor(mesh.mesh), list(param.placements), list(mesh.shape), mesh.get_coordinate()
    placements = [param.placements[names.index(n)] if n in names else Replicate() for n in root_names]
    return torch.as_tensor(root.mesh), placements, list(root.shape), root.get_coordinate()


class _Route:
    """Who sends which part of one DTensor parameter to its owner, and who gets which part back, decided from the
    mesh on every rank without an exchange: a shard is fixed by its coordinates on the mesh dims the parameter is
    sharded over (its replicas differ only on the others); the owner sends itself what it holds, else the lowest
    rank holding a shard sends it. Only the owner computes every rank's region of the whole parameter (``sends``:
    (rank, region, shape); ``gets``: (rank, region)), once, so a step only indexes."""

    def __init__(self, param: torch.Tensor, owner: int, comm: Comm | NullComm) -> None:
        me = comm.rank
        ranks, placements, sizes, mine = root_placements(param)
        sharded = [i for i, p in enumerate(placements) if isinstance(p, (Shard, _StridedShard))]
        rank_of = {g: r for r, g in enumerate(comm.global_ranks)}

        def holders(coordinate: Sequence[int]) -> list[int]:
            select = tuple(coordinate[i] if i in sharded else slice(None) for i in range(ranks.dim()))
            return sorted(rank_of[g] for g in ranks[select].flatten().tolist() if g in rank_of)

        def sender(group: list[int]) -> int:
            return owner if owner in group else group[0]

        has_mine = mine is not None and bool(_shard(param).numel())
        self.sends_mine = has_mine and me != owner and sender(holders(mine)) == me
        self.gets_mine = has_mine and me != owner
        self.sends: list[tuple[int, tuple[torch.Tensor, ...], list[int]]] = []
        self.gets: list[tuple[int, tuple[torch.Tensor, ...]]] = []
        if me != owner:
            return
        per_dim = [_split_indices(int(n), [(i, p, sizes[i]) for i, p in enumerate(placements)
                                           if isinstance(p, (Shard, _StridedShard)) and p.dim == dim])
                   for dim, n in enumerate(param.shape)]
        device = _shard(param).device
        whole_dims = [torch.arange(int(n), device=device) for n in param.shape]  # shared by every region
        for key in itertools.product(*(range(sizes[i]) for i in sharded)):
            coordinate = [0] * len(sizes)
            for i, c in zip(sharded, key, strict=True):
                coordinate[i] = c
            indices = [table(coordinate) for table in per_dim]
            group = holders(coordinate)
            if any(x is not None and not x.numel() for x in indices) or not group:
                continue
            region, shape = _region(indices, whole_dims, device)
            self.sends.append((sender(group), region, shape))
            self.gets += [(rank, region) for rank in group]
        self.sends.sort(key=lambda item: item[0])
        self.gets.sort(key=lambda item: item[0])


def _split_indices(numel: int, splits: Sequence[tuple[int, Any, int]]) -> Callable[[Sequence[int]], Any]:
    """For one dim of ``numel`` elements split by ``splits`` ((mesh dim, placement, mesh dim size), in mesh-dim
    order): a function of a mesh coordinate giving the global indices (in local order) of that rank's part of the
    dim, None when the dim is whole. DTensor's own split (each mesh dim splits what the previous left, strided
    shards too), computed once for every coordinate as views of one ``arange``, so nothing is exchanged."""
    if not splits:
        return lambda coordinate: None
    tree: dict[tuple[int, ...], torch.Tensor] = {(): torch.arange(numel)}
    for _, placement, size in splits:
        split = (_StridedShard(0, split_factor=placement.split_factor) if isinstance(placement, _StridedShard)
                 else Shard(0))
        nxt = {}
        for path, index in tree.items():
            chunks = split._split_tensor(index, size, with_padding=False, contiguous=False)[0]
            for c in range(size):
                nxt[(*path, c)] = chunks[c] if c < len(chunks) else index[:0]
        tree = nxt
    dims = [i for i, _, _ in splits]
    return lambda coordinate: tree[tuple(coordinate[i] for i in dims)]


def _region(indices: Sequence[torch.Tensor | None], whole_dims: Sequence[torch.Tensor], device: torch.device
            ) -> tuple[tuple[torch.Tensor, ...], list[int]]:
    """Advanced indices selecting a shard of a whole tensor (broadcast per dim; ``whole_dims``: each dim's every
    index, for a dim the shard holds whole), and the shard's shape."""
    index, sizes = [], []
    for dim, values in enumerate(indices):
        values = whole_dims[dim] if values is None else values.to(device)
        index.append(values.view([1] * dim + [-1] + [1] * (len(whole_dims) - dim - 1)))
        sizes.append(values.numel())
    return tuple(index), sizes


class OwnerRoutes:
    """DTensor parameters stepped whole by one owner rank each: the ranks' shards gathered to the owner (each
    distinct shard sent once, point to point: ``Comm.gather_async``) and each rank's shard of the stepped whole
    scattered back (``Comm.scatter_async``); a parameter that is not a DTensor (replicated) is broadcast from its
    owner. Routes are planned here, once, from the meshes (no exchange).

    Args:
        comm: the ranks the owners are ranks of (every rank holding a part of ``params``).
        params: the parameters, in one order on every rank; calls name them by index in it.
        owners: each parameter's owner rank of ``comm``.
    """

    def __init__(self, comm: Comm | NullComm, params: Sequence[torch.Tensor], owners: Sequence[int]) -> None:
        self.comm = comm
        self.params = list(params)
        self.owners = list(owners)
        self.routes = [_Route(p, owner, comm) if isinstance(p, DTensor) else None
                       for p, owner in zip(self.params, self.owners, strict=True)]

    @torch.no_grad()
    def gather(self, locals_: Sequence[torch.Tensor | None], into: Mapping[int, torch.Tensor]) -> None:
        """Assemble ``into[i]`` (an owner's whole tensor of parameter i) from the ranks' local shards
        ``locals_[i]`` (contiguous; None where parameter i is skipped, and for parameters that are not
        DTensors). Collective over ``comm``: every rank passes the same skips."""
        comm, me = self.comm, self.comm.rank
        handles, placed = [], []
        for i, (route, local) in enumerate(zip(self.routes, locals_, strict=True)):
            if route is None or local is None:
                continue
            owner = self.owners[i]
            if me != owner:
                handles.append(comm.gather_async(local if route.sends_mine else None, owner, (), tag=i))
                continue
            whole = into[i]
            parts: list[torch.Tensor | None] = [None] * comm.size
            for rank, _, shape in route.sends:
                parts[rank] = whole.new_empty(shape)
            handles.append(comm.gather_async(local, owner, parts, tag=i))
            placed.append((whole, parts, route.sends))
        for handle in handles:
            handle.wait()
        for whole, parts, sends in placed:
            for rank, region, _ in sends:
                whole[region] = parts[rank]

    @torch.no_grad()
    def scatter(self, wholes: Mapping[int, torch.Tensor]) -> None:
        """Write every rank's shard of each parameter from its owner's whole ``wholes[i]`` (given on the owner
        only) into the parameter's local shard; broadcast parameters that are not DTensors from their owners.
        Collective over ``comm``."""
        comm, me = self.comm, self.comm.rank
        handles, copies = [], []
        for i, (param, owner, route) in enumerate(zip(self.params, self.owners, self.routes, strict=True)):
            if route is None:
                if comm.size > 1:
                    handles.append(comm.broadcast_async(param.data, owner))
                continue
            local = _shard(param)
            out = local if local.is_contiguous() else torch.empty_like(local)
            if out is not local:
                copies.append((local, out))
            if me != owner:
                handles.append(comm.scatter_async(out if route.gets_mine else None, owner, (), tag=i))
                continue
            whole = wholes[i]
            parts: list[torch.Tensor | None] = [None] * comm.size
            for rank, region in route.gets:
                parts[rank] = whole[region]
            handles.append(comm.scatter_async(out if parts[me] is not None else None, owner, parts, tag=i))
        for handle in handles:
            handle.wait()
        for local, out in copies:
            local.copy_(out)
