"""DTensor placements: parameters that are ``torch.distributed.tensor.DTensor``s, from FSDP2's ``fully_shard``,
tensor parallelism's ``parallelize_module``, both on a 2-D ``DeviceMesh``, or HSDP (replicate x shard).

- ``DTensorLocal``: each rank steps its local shard of every parameter (``param.to_local()`` with
  ``grad.to_local()``) with the same fused kernels as any placement; the model's sharding is left as it is,
  so there is nothing to publish. For element-wise algorithms (AdamW, SGD, Lion, ...).
- ``DTensorOwners``: whole matrices, for Muon: each parameter has one owner rank (cost-balanced over the
  ranks); its gradient (and value, where stepped without a master) is gathered to the owner only, one copy of
  each distinct shard, the owner steps the whole matrix (its state and fp32 master are whole, on the owner
  only), then scatters each rank its shard of the result (both moves: ``distributed.param_gather.OwnerRoutes``).

The global grad norm counts every element once across shards and replicas (``_counted_once``, decided when the
stage is built), so each step is one sum (max for the inf-norm) over ``comm``. Non-DTensor parameters in a
DTensor model are taken as replicated on every rank of ``comm`` (their gradients must already agree, as for
torch's own optimizers): stepped whole everywhere and counted once.

State: ``DTensorLocal``'s element-wise state is the parameters' DTensors for DCP; in the name-keyed format a
shard that is a block (tensor-parallel ``Shard(1)``, FSDP2's strided shards over a tensor-parallel split) is
converted to an even flat range per rank of its mesh (``flat_shards``) and back (``local_shards``), collectively,
so optstack's checkpoints reshard it like any other. ``DTensorOwners``' state is whole, in the parameter's shape.
Placements other than ``Shard`` / ``Replicate`` are refused at construction (``check_dtensor_params``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from optstack.distributed.comm import Comm, NullComm
from optstack.distributed.param_gather import OwnerRoutes, root_placements
from optstack.protocol import MakeOptimizer, ParamShard, phase
from optstack.stage.placement import Piece, Placement, newton_schulz_cost, owners_of
from optstack.stage.precision import Direct, Masters, Precision
from optstack.stage.stage import Stage

__all__ = ["TP_MESH_DIMS", "DTensorLocal", "DTensorOwners", "check_dtensor_params", "dtensor_stage", "flat_range",
           "is_dtensor", "tp_blocks"]


def is_dtensor(tensor: Any) -> bool:
    return isinstance(tensor, DTensor)


def check_dtensor_params(named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Refuse a DTensor parameter whose placements optstack cannot step correctly.

    Raises:
        ValueError: naming the parameter and its placements: a ``Partial`` placement (a pending sum, not a
            value), or a placement that is not ``Shard``, FSDP2's strided shard or ``Replicate``.
    """
    for name, param in named:
        if not is_dtensor(param):
            continue
        for dim, placement in enumerate(param.placements):
            if placement.is_partial():
                raise ValueError(
                    f"DTensor parameter {name!r} has placements {tuple(param.placements)}: a Partial placement "
                    f"(mesh dim {dim}) is an unreduced sum, not a parameter value; redistribute it to Replicate() "
                    "or Shard(d) before building the optimizer")
            if not isinstance(placement, (Shard, _StridedShard, Replicate)):
                raise ValueError(
                    f"DTensor parameter {name!r} has placements {tuple(param.placements)}: {placement!r} (mesh dim "
                    f"{dim}) is not supported; optstack steps parameters placed with Shard(d) and Replicate()")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view of its live storage, not a copy), or the tensor itself."""
    if not is_dtensor(tensor):
        return tensor
    with torch.no_grad():
        return tensor.to_local()


def _is_block(param: torch.Tensor) -> bool:
    """Whether the parameter's shards are blocks, not ranges of its flattened elements (a shard of a dim other
    than 0, or a strided shard, over a mesh dim of more than one rank); the same answer on every rank."""
    return any((isinstance(p, _StridedShard) or (isinstance(p, Shard) and p.dim > 0)) and size > 1
               for p, size in zip(param.placements, param.device_mesh.shape, strict=True))


def flat_range(param: torch.Tensor) -> tuple[int, int] | None:
    """The range ``[start, end)`` of the flattened global parameter this rank's shard is, or None when the shard
    is a block (``_is_block``)."""
    if not is_dtensor(param):
        return 0, param.numel()
    if _is_block(param):
        return None
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    row = math.prod(shape[1:])
    start = offset[0] * row if shape else 0
    return start, start + math.prod(shape)


def _cut(param: torch.Tensor) -> tuple[int, int]:
    """This rank's even range of the flattened block parameter: its row-major place among the mesh's ranks."""
    mesh = param.device_mesh
    index, n, k = 0, param.numel(), mesh.size()
    for coordinate, size in zip(mesh.get_coordinate(), mesh.shape, strict=True):
        index = index * size + coordinate
    return index * n // k, (index + 1) * n // k


def _tiles(ranges: Sequence[tuple[int, int]], numel: int) -> bool:
    """Whether the sorted ``ranges`` (overlaps allowed: replicas) cover ``[0, numel)``."""
    end = 0
    for lo, hi in ranges:
        if lo > end:
            return False
        end = max(end, hi)
    return end >= numel


def _counted_once(flat: Sequence[tuple[str, torch.Tensor]], comm: Comm | NullComm) -> list[bool]:
    """For each parameter, whether this rank counts its shard in the norm, so that every element counts once.

    A DTensor's shard is counted by its holder at coordinate 0 of every dim of its root mesh it is not sharded
    over (``root_placements``; decided here, from the mesh: no exchange); an empty shard, or none, is not counted.
    Plain parameters (replicated) are counted by the lowest rank holding them: ranks exchange a digest of their
    names (O(world) bytes) and only when those differ (pipeline stages holding different layers) the names
    themselves. Collective."""
    counted: list[bool] = []
    plain = []
    for name, p in flat:
        if not is_dtensor(p):
            plain.append(name)
            counted.append(False)
            continue
        _, placements, _, coordinate = root_placements(p)
        counted.append(coordinate is not None and bool(_local(p).numel()) and all(
            c == 0 for c, placement in zip(coordinate, placements, strict=True)
            if not isinstance(placement, (Shard, _StridedShard))))
    digest = hashlib.sha256(repr(plain).encode()).digest()
    if all(d == digest for d in comm.all_gather_object(digest)):
        first = dict.fromkeys(plain, 0)
    else:
        first = {}
        for rank, names in enumerate(comm.all_gather_object(plain)):
            for name in names:
                first.setdefault(name, rank)
    return [c if is_dtensor(p) else first[name] == comm.rank for c, (name, p) in zip(counted, flat, strict=True)]


class _DTensorPlacement(Placement):
    """What both DTensor placements share: the reduction over ``comm`` and the per-shard norm counts."""

    def __init__(self, *, comm: Comm | NullComm, device: torch.device | None = None) -> None:
        super().__init__(reduce_over=[comm], device=device)
        self.dp = comm
        self._counted: dict[int, bool] = {}  # id(param) -> this rank counts its norm term

    def norm_counts(self, params: Sequence[torch.Tensor]) -> list[bool]:
        """Whether each norm term counts on this rank (so that every element counts once over ``comm``)."""
        return [self._counted.get(id(p), False) for p in params]

    def _grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The parameter's gradient, placed as the parameter (e.g. a Partial gradient reduced)."""
        grad = self.grad_of(param)
        if is_dtensor(grad) and grad.placements != param.placements:
            grad = grad.redistribute(param.device_mesh, param.placements)
        return grad

    def cannot_add(self) -> str | None:
        return "which rank counts which DTensor shard in the grad norm is agreed over all ranks at construction"


class DTensorLocal(_DTensorPlacement):
    """Every rank steps the local shards of its parameters; the model keeps its own sharding.

    Args:
        comm: every rank holding a part of these parameters (the world, for meshes that span it): the norm
            and the non-finite check are reduced over it.
        device: where a rank with no parameters runs its reductions.
    """

    kind = "dtensor"

    def __init__(self, *, comm: Comm | NullComm, device: torch.device | None = None) -> None:
        super().__init__(comm=comm, device=device)
        #: the parameters whose shards are blocks (``_is_block``), in one order on every rank (all of them: the
        #: exchange of ``local_shards`` is over ``comm``)
        self.blocks: list[tuple[str, torch.Tensor]] = []

    def pieces(self, names: list[list[str]], params: list[list[torch.Tensor]]) -> list[list[Piece]]:
        flat = [(n, p) for gn, gp in zip(names, params, strict=True) for n, p in zip(gn, gp, strict=True)]
        check_dtensor_params(flat)
        self.blocks += [(n, p) for n, p in flat if is_dtensor(p) and _is_block(p)]
        self._counted.update({id(p): c for (_, p), c in zip(flat, _counted_once(flat, self.dp), strict=True)})
        out = []
        for gn, gp in zip(names, params, strict=True):
            group = []
            for name, param in zip(gn, gp, strict=True):
                value = _local(param)
                span = flat_range(param)
                if (not value.numel() and span is not None) or (is_dtensor(param)
                                                               and param.device_mesh.get_coordinate() is None):
                    continue  # a rank with an empty shard (fewer rows than ranks), or none, steps nothing of it
                # a block's piece stands for its elements in the local shard's order (kept even when empty:
                # every rank of its mesh takes part in flat_shards / local_shards)
                start, end = span or (0, value.numel())
                group.append(Piece(name, param, start, end, value))
            out.append(group)
        return out

    def grads(self, pieces: Sequence[Piece]) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for piece in pieces:
            param = piece.param
            if _local(param).data_ptr() != piece.value.data_ptr():
                raise ValueError(
                    f"the local shard of DTensor parameter {piece.name!r} was replaced after the optimizer was built "
                    "(load_state_dict(assign=True), model.to(...), or new parameters); build the optimizer after that")
            grad = self._grad(param)
            out.append(_local(grad) if grad is not None else None)
        return out

    def element_rows(self, piece: Piece) -> torch.Tensor:
        """A block's rows: the global row index of each element, laid out by the parameter's own placements (each
        rank takes its local part, no communication), so strided and column shards map as the model's do."""
        param = piece.param
        if not is_dtensor(param) or not _is_block(param):
            return super().element_rows(piece)
        rows = torch.arange(param.shape[0], device=piece.value.device).unsqueeze(1).expand(param.shape).contiguous()
        local = distribute_tensor(rows, param.device_mesh, param.placements, src_data_rank=None).to_local()
        return local.reshape(-1)

    def flat_shards(self, shards: dict[str, ParamShard]) -> dict[str, ParamShard]:
        """Each block's state as a flat range: rank ``i`` of the ``k`` ranks of the parameter's mesh (row-major
        coordinate) gets elements ``[i n / k, (i+1) n / k)`` of the assembled whole. Collective over each block
        parameter's mesh (one all-gather per state tensor); the other shards pass as they are."""
        out = dict(shards)
        with torch.no_grad():
            for name, param in self.blocks:
                shard = shards.get(name)
                if shard is None:
                    continue  # this rank is not in the parameter's mesh
                start, end = _cut(param)
                shape, mesh = _local(param).shape, param.device_mesh
                tensors = {}
                for key, value in shard.tensors.items():  # one key order on every rank: one algorithm's
                    whole = DTensor.from_local(value.reshape(shape), mesh, param.placements, run_check=False,
                                               shape=param.shape, stride=param.stride()).full_tensor()
                    tensors[key] = whole.reshape(-1)[start:end].clone()
                out[name] = replace(shard, start=start, end=end, tensors=tensors)
        return out

    def local_shards(self, shards: Mapping[str, ParamShard]) -> Mapping[str, ParamShard]:
        """Each block's name-keyed state (flat ranges, from any layout) cut to this rank's block: every rank's
        ranges are gathered over ``comm`` and the whole assembled. Collective over ``comm``.

        Raises:
            ValueError: on every rank alike, when the ranks' ranges of a block parameter leave a gap.
        """
        if not self.blocks:
            return shards
        mine = {n: (s.start, s.end, {k: str(t.dtype) for k, t in s.tensors.items()})
                for n, _ in self.blocks if (s := shards.get(n)) is not None}
        tables = self.dp.all_gather_object(mine)
        out = dict(shards)
        with torch.no_grad():
            for name, param in self.blocks:
                held = [(rank, table[name]) for rank, table in enumerate(tables) if name in table]
                dtypes = {k: d for *_, keys in (h for _, h in held) for k, d in keys.items()}
                covered = sorted((lo, hi) for _, (lo, hi, _) in held)
                if held and not _tiles(covered, param.numel()):
                    raise ValueError(f"the ranks' ranges of {name!r} ({covered}) do not cover its {param.numel()} "
                                     "elements; load state saved from a whole optimizer (every rank's ranges)")
                shard = shards.get(name)
                tensors = {}
                for key, dtype in dtypes.items():
                    value = shard.tensors.get(key) if shard is not None else None
                    dt = getattr(torch, dtype.removeprefix("torch."))
                    empty = torch.empty(0, dtype=dt, device=_local(param).device)
                    parts = self.dp.all_gather_uneven(value.reshape(-1).to(dt) if value is not None else empty)
                    whole = torch.empty(param.numel(), dtype=dt, device=empty.device)
                    for (rank, (lo, hi, keys)) in held:
                        if key in keys:
                            whole[lo:hi] = parts[rank]
                    if shard is not None:
                        block = distribute_tensor(whole.view(param.shape), param.device_mesh, param.placements,
                                                  src_data_rank=None)
                        tensors[key] = block.to_local().reshape(-1).clone()
                if shard is not None:
                    out[name] = replace(shard, start=0, end=_local(param).numel(), tensors=tensors)
        return out

    def sharded_state(self, entries: dict[int, dict[str, Any]], pieces: Sequence[Piece],
                      params: Sequence[torch.Tensor]) -> dict[int, dict[str, Any]]:
        """``Stage.torch_state`` entries with element-wise state as DTensors placed as their parameter (torch's
        optimizers keep FSDP2 state so): DCP saves each shard once and reshards it to any mesh. No collective."""
        out = {}
        for piece in pieces:
            param = piece.param
            entry = entries.get(id(param))
            if entry is None or not is_dtensor(param):
                if entry is not None:
                    out[id(param)] = entry
                continue
            out[id(param)] = {
                key: DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                        shape=param.shape, stride=param.stride())
                if isinstance(value, torch.Tensor) and value.shape == piece.value.shape and value.dim() else value
                for key, value in entry.items()}
        return out


#: mesh dims with these names are tensor-parallel: a matrix split over them is what Muon's ``tp_mode`` is about
TP_MESH_DIMS = ("tp",)


def tp_blocks(param: torch.Tensor) -> tuple[int, int] | None | bool:
    """``(dim, parts)`` when the DTensor ``param`` is a matrix split by tensor parallelism (``Shard(dim)`` over one
    mesh dim named in ``TP_MESH_DIMS``, of ``parts`` > 1 ranks); True when it is split by tensor parallelism
    otherwise (over two such dims, or a 3-D stack), which Muon's ``blockwise`` / ``distributed`` cannot take;
    None when it is not split by tensor parallelism."""
    if not is_dtensor(param):
        return None
    names = param.device_mesh.mesh_dim_names or ()
    splits = [p for p, size, name in zip(param.placements, param.device_mesh.shape, names, strict=False)
              if name in TP_MESH_DIMS and isinstance(p, (Shard, _StridedShard)) and size > 1]
    if not splits:
        return None
    [first, *rest] = splits
    if rest or isinstance(first, _StridedShard) or param.dim() != 2:
        return True
    return first.dim, param.device_mesh.shape[param.placements.index(first)]


class DTensorOwners(_DTensorPlacement):
    """Whole matrices stepped by owner ranks (Muon; module docstring); the moves are ``OwnerRoutes``', planned
    when the pieces are.

    Args:
        comm: every rank holding a part of these parameters (owners are assigned over it).
        masters: the stage's precision gives bf16/fp16 parameters fp32 masters (``Masters``): their whole
            copies are never stepped, so they need no refresh from the model.
        cost: a parameter's update cost from its global shape (balances the assignment).
        owners: parameter name -> owner rank of ``comm`` (a plan's); None: balanced by ``cost`` here.
        device: where a rank with no parameters runs its reductions.
    """

    kind = "dtensor-owners"
    owns_whole = True

    def __init__(self, *, comm: Comm | NullComm, masters: bool, device: torch.device | None = None,
                 cost: Callable[[Sequence[int]], float] = newton_schulz_cost,
                 owners: Mapping[str, int] | None = None) -> None:
        super().__init__(comm=comm, device=device)
        self.shard_comm = comm
        self.masters = masters
        self.cost = cost
        self._planned = dict(owners) if owners is not None else None
        self.owners: list[int] = []
        self._all: list[tuple[str, torch.Tensor]] = []
        self._routes = OwnerRoutes(comm, (), ())  # over _all, planned by pieces()
        self._whole: dict[int, torch.Tensor] = {}  # index in _all -> the owner's whole copy (model dtype)

    def pieces(self, names: list[list[str]], params: list[list[torch.Tensor]]) -> list[list[Piece]]:
        self._all = [(n, p) for gn, gp in zip(names, params, strict=True) for n, p in zip(gn, gp, strict=True)]
        check_dtensor_params(self._all)
        self.owners = owners_of(self._planned, [n for n, _ in self._all], [p for _, p in self._all], self.dp.size,
                                self.cost, type(self).__name__)
        mine = {id(p) for (_, p), owner in zip(self._all, self.owners, strict=True) if owner == self.dp.rank}
        self._counted.update({id(p): id(p) in mine for _, p in self._all})
        self._routes = OwnerRoutes(self.dp, [p for _, p in self._all], self.owners)
        for i, (_, param) in enumerate(self._all):
            if id(param) in mine:
                self._whole[i] = (torch.empty(param.shape, dtype=param.dtype, device=_local(param).device)
                                  if is_dtensor(param) else param)
        self.refresh()
        whole_of = {id(p): self._whole[i] for i, (_, p) in enumerate(self._all) if i in self._whole}
        return [[Piece(n, p, 0, p.numel(), whole_of[id(p)]) for n, p in zip(gn, gp, strict=True) if id(p) in mine]
                for gn, gp in zip(names, params, strict=True)]

    def group_settings(self, pieces: Sequence[Piece]) -> dict[str, Any]:
        """Muon's ``tp_blocks``: how each tensor-parallel matrix of the group is split (for its ``tp_mode``)."""
        blocks = {p.name: None if split is True else split for p in pieces
                  if (split := tp_blocks(p.param)) is not None}  # None: split in a way only `duplicated` takes
        return {"tp_blocks": blocks} if blocks else {}

    def refresh(self, stepped_only: bool = False) -> None:
        """Copy the model's current values into the owners' whole copies (collective; before a load, where a
        missing master is taken from them). ``stepped_only``: only where the copy is what is stepped (no fp32
        master), as each step does: the model is the truth for those and may have been loaded or written
        since the last step (a version counter would miss writes through ``to_local()``, so each step gathers)."""
        low = (torch.bfloat16, torch.float16)
        skip = [stepped_only and self.masters and p.dtype in low for _, p in self._all]
        with torch.no_grad():
            values = [None if s else _local(p).contiguous() for (_, p), s in zip(self._all, skip, strict=True)]
            self._routes.gather(values, self._whole)

    def grads(self, pieces: Sequence[Piece]) -> list[torch.Tensor | None]:
        self.refresh(stepped_only=True)
        held: dict[int, torch.Tensor | None] = {}
        with phase("gather_grads"), torch.no_grad():
            locals_: list[torch.Tensor | None] = []
            into: dict[int, torch.Tensor] = {}
            for i, ((_, param), owner) in enumerate(zip(self._all, self.owners, strict=True)):
                grad = self._grad(param)
                if not is_dtensor(param):
                    locals_.append(None)
                    if owner == self.dp.rank:
                        held[id(param)] = grad
                    continue
                # a rank without a gradient sends zeros (all ranks have one, or none: FSDP2 reduces them)
                local = _local(grad).contiguous() if grad is not None else torch.zeros_like(_local(param))
                locals_.append(local)
                if owner == self.dp.rank:
                    into[i] = local.new_empty(param.shape)
                    held[id(param)] = into[i] if grad is not None else None
            self._routes.gather(locals_, into)
        return [held[id(p.param)] for p in pieces]

    def publish(self) -> None:
        with phase("scatter_params"):
            self._routes.scatter(self._whole)


def dtensor_stage(param_groups: Sequence[dict[str, Any]], make_optimizer: MakeOptimizer, *, comm: Comm | NullComm,
                  masters: bool = True, whole_matrices: bool = False, precision: Precision | None = None,
                  owners: Mapping[str, int] | None = None) -> Stage:
    """A stage over DTensor parameters: local shards (``DTensorLocal``), or with ``whole_matrices`` whole
    matrices on owner ranks (``DTensorOwners``, for Muon; ``owners``: the plan's, else balanced here).
    ``masters``: fp32 masters for bf16/fp16 shards. Collective over ``comm``; a ``precision`` given replaces the
    one ``masters`` picks."""
    if precision is None:
        precision = Masters() if masters else Direct()
    masters = not isinstance(precision, Direct)
    placement = (DTensorOwners(comm=comm, masters=masters, owners=owners) if whole_matrices
                 else DTensorLocal(comm=comm))
    return Stage(param_groups, make_optimizer, placement=placement, precision=precision)
