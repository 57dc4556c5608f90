"""DTensor placements: parameters that are ``torch.distributed.tensor.DTensor``s, from FSDP2's ``fully_shard``,
tensor parallelism's ``parallelize_module``, both on a 2-D ``DeviceMesh``, or HSDP (replicate x shard).

- ``DTensorLocal``: each rank steps its local shard of every parameter (``param.to_local()`` with
  ``grad.to_local()``) with the same fused kernels as any placement; the model's sharding is left as it is,
  so there is nothing to publish. For element-wise algorithms (AdamW, SGD, Lion, ...).
- ``DTensorOwners``: whole matrices, for Muon: each parameter has one owner rank (cost-balanced over the
  ranks); its value and gradient are assembled (``full_tensor``), the owner steps the whole matrix (its state
  and fp32 master are whole, on the owner only), then broadcasts the result and every rank keeps its shard.

The global grad norm counts every element once across shards and replicas: when the stage is built every
rank tells the others which shard of which parameter it holds (a parameter's name and its mesh coordinates
on the sharded dims: equal names on two ranks are one parameter), and the lowest rank holding a shard counts
it; each step is then one sum (max for the inf-norm) over ``comm``. Non-DTensor parameters in a DTensor
model are taken as replicated on every rank of ``comm`` (their gradients must already agree, as for torch's
own optimizers): stepped whole everywhere and counted once.

A ``Partial`` placement, or any placement other than ``Shard`` / ``Replicate`` (and the strided shards FSDP2
makes over tensor-parallel dims), is refused at construction, naming the parameter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from optstack.distributed.comm import Comm, NullComm
from optstack.protocol import MakeOptimizer, phase
from optstack.stage.placement import Piece, Placement, assign_params, newton_schulz_cost
from optstack.stage.precision import Direct, Masters, Precision
from optstack.stage.stage import Stage

__all__ = ["DTensorLocal", "DTensorOwners", "check_dtensor_params", "dtensor_stage", "flat_range", "is_dtensor"]


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


def _shard_key(name: str, param: torch.Tensor) -> tuple[Any, ...] | None:
    """Which shard of which parameter this rank holds: equal keys are replicas. None: no part of it here."""
    if not is_dtensor(param):
        return (name,)
    coordinate = param.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    return (name, tuple(-1 if p.is_replicate() else c for c, p in zip(coordinate, param.placements, strict=True)))


def flat_range(param: torch.Tensor) -> tuple[int, int] | None:
    """The range ``[start, end)`` of the flattened global parameter this rank's shard is, or None when the shard
    is not one contiguous range (a shard of a dim other than 0, or a strided shard)."""
    if not is_dtensor(param):
        return 0, param.numel()
    if any(isinstance(p, _StridedShard) for p in param.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if tuple(shape[1:]) != tuple(param.shape[1:]):
        return None
    row = math.prod(shape[1:])
    start = offset[0] * row if shape else 0
    return start, start + math.prod(shape)


def _counted_once(keys: Sequence[tuple[Any, ...] | None], comm: Comm | NullComm) -> list[bool]:
    """For each of this rank's shard keys, whether this rank is the lowest one holding that shard. Collective."""
    tables = comm.all_gather_object([k for k in keys if k is not None])
    first: dict[tuple[Any, ...], int] = {}
    for rank, table in enumerate(tables):
        for key in table:
            first.setdefault(key, rank)
    return [key is not None and first[key] == comm.rank for key in keys]


class _DTensorPlacement(Placement):
    """What both DTensor placements share: the reduction over ``comm`` and the per-shard norm counts."""

    def __init__(self, *, comm: Comm | NullComm, device: torch.device | None = None) -> None:
        super().__init__(reduce_over=[comm], device=device)
        self.dp = comm
        self._counted: dict[int, bool] = {}  # id(param) -> this rank counts its norm term

    def norm_counts(self, params: Sequence[torch.Tensor]) -> list[bool]:
        """Whether each norm term counts on this rank (so that every element counts once over ``comm``)."""
        return [self._counted.get(id(p), False) for p in params]

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
        #: names of parameters whose shard here is not one flat range (the name-keyed state cannot hold them)
        self.not_flat: dict[str, str] = {}

    def pieces(self, names: list[list[str]], params: list[list[torch.Tensor]]) -> list[list[Piece]]:
        flat = [(n, p) for gn, gp in zip(names, params, strict=True) for n, p in zip(gn, gp, strict=True)]
        check_dtensor_params(flat)
        keys = [_shard_key(n, p) for n, p in flat]
        keys = [k if k is not None and _local(p).numel() else None for k, (_, p) in zip(keys, flat, strict=True)]
        self._counted.update({id(p): c for (_, p), c in zip(flat, _counted_once(keys, self.dp), strict=True)})
        out = []
        for gn, gp in zip(names, params, strict=True):
            group = []
            for name, param in zip(gn, gp, strict=True):
                value = _local(param)
                if not value.numel():
                    continue  # a rank with an empty shard (fewer rows than ranks) steps nothing of it
                span = flat_range(param)
                if span is None:
                    self.not_flat[name] = str(tuple(param.placements))
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
            grad = self.grad_of(param)
            if is_dtensor(grad) and grad.placements != param.placements:
                grad = grad.redistribute(param.device_mesh, param.placements)  # e.g. a Partial grad: reduce it
            out.append(_local(grad) if grad is not None else None)
        return out


    def sharded_state(self, entries: dict[int, dict[str, Any]], pieces: Sequence[Piece],
                      params: Sequence[torch.Tensor]) -> dict[int, dict[str, Any]]:
        """``Stage.torch_state`` entries with element-wise state as DTensors placed as their parameter (torch's
        optimizers keep FSDP2 state so): DCP saves each shard once and reshards it to any mesh. No collective."""
        out = {}
        for piece in pieces:
            entry = entries.get(id(piece.param))
            if entry is None or not is_dtensor(piece.param):
                if entry is not None:
                    out[id(piece.param)] = entry
                continue
            param = piece.param
            out[id(param)] = {
                key: DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                        shape=param.shape, stride=param.stride())
                if isinstance(value, torch.Tensor) and value.shape == piece.value.shape and value.dim() else value
                for key, value in entry.items()}
        return out


class DTensorOwners(_DTensorPlacement):
    """Whole matrices stepped by owner ranks (Muon): each gradient assembled with ``full_tensor()``, the owner
    steps the whole matrix (state and master whole, on the owner only), broadcasts the result over ``comm``,
    and every rank keeps its shard of it.

    Args:
        comm: every rank holding a part of these parameters (owners are assigned over it).
        masters: the stage's precision gives bf16/fp16 parameters fp32 masters (``Masters``): their whole
            copies are never stepped, so they need no refresh from the model.
        cost: a parameter's update cost from its global shape (balances the assignment).
        device: where a rank with no parameters runs its reductions.
    """

    kind = "dtensor-owners"

    def __init__(self, *, comm: Comm | NullComm, masters: bool, device: torch.device | None = None,
                 cost: Callable[[Sequence[int]], float] = newton_schulz_cost) -> None:
        super().__init__(comm=comm, device=device)
        self.shard_comm = comm
        self.masters = masters
        self.cost = cost
        self.owners: list[int] = []
        self._all: list[tuple[str, torch.Tensor]] = []
        self._whole: dict[int, torch.Tensor] = {}  # id(param) -> the owner's whole copy (model dtype)

    def pieces(self, names: list[list[str]], params: list[list[torch.Tensor]]) -> list[list[Piece]]:
        self._all = [(n, p) for gn, gp in zip(names, params, strict=True) for n, p in zip(gn, gp, strict=True)]
        check_dtensor_params(self._all)
        self.owners = assign_params([self.cost(tuple(p.shape)) for _, p in self._all], self.dp.size)
        mine = {id(p) for (_, p), owner in zip(self._all, self.owners, strict=True) if owner == self.dp.rank}
        self._counted.update({id(p): id(p) in mine for _, p in self._all})
        with torch.no_grad():
            for _, param in self._all:  # full_tensor() is collective over the parameter's mesh: every rank calls
                whole = param.full_tensor() if is_dtensor(param) else param
                if id(param) in mine:
                    self._whole[id(param)] = whole
        return [[Piece(n, p, 0, p.numel(), self._whole[id(p)]) for n, p in zip(gn, gp, strict=True) if id(p) in mine]
                for gn, gp in zip(names, params, strict=True)]

    def refresh(self, stepped_only: bool = False) -> None:
        """Copy the model's current values into the owners' whole copies (collective; before a load, where a
        missing master is taken from them). ``stepped_only``: only where the copy is what is stepped (no fp32
        master), as each step does: the model is the truth for those and may have been loaded or written
        since the last step (a version counter would miss writes through ``to_local()``, so each step gathers)."""
        low = (torch.bfloat16, torch.float16)
        with torch.no_grad():
            for (_, param), owner in zip(self._all, self.owners, strict=True):
                if is_dtensor(param) and not (stepped_only and self.masters and param.dtype in low):
                    whole = param.full_tensor()  # collective over the parameter's mesh: every rank calls
                    if owner == self.dp.rank:
                        self._whole[id(param)].copy_(whole)

    def grads(self, pieces: Sequence[Piece]) -> list[torch.Tensor | None]:
        self.refresh(stepped_only=True)
        held: dict[int, torch.Tensor | None] = {}
        with phase("gather_grads"), torch.no_grad():
            for (_, param), owner in zip(self._all, self.owners, strict=True):
                grad = self.grad_of(param)
                whole = grad.full_tensor() if is_dtensor(grad) else grad  # collective: every rank calls
                if owner == self.dp.rank:
                    held[id(param)] = whole
        return [held[id(p.param)] for p in pieces]

    def publish(self) -> None:
        comm = self.dp
        with phase("scatter_params"), torch.no_grad():
            for (_, param), owner in zip(self._all, self.owners, strict=True):
                if not is_dtensor(param):
                    if comm.size > 1:
                        comm.broadcast(param.data, owner)
                    continue
                local = _local(param)
                whole = self._whole.get(id(param))
                if whole is None:
                    whole = local.new_empty(param.shape)
                if comm.size > 1:
                    comm.broadcast(whole, owner)
                # src_data_rank=None: every rank has the whole value, each cuts out its own shard (no exchange)
                mine = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
                local.copy_(mine.to_local())


def dtensor_stage(param_groups: Sequence[dict[str, Any]], make_optimizer: MakeOptimizer, *, comm: Comm | NullComm,
                  masters: bool = True, whole_matrices: bool = False, precision: Precision | None = None) -> Stage:
    """A stage over DTensor parameters: local shards (``DTensorLocal``), or with ``whole_matrices`` whole
    matrices on owner ranks (``DTensorOwners``, for Muon). ``masters``: fp32 masters for bf16/fp16 shards.
    Collective over ``comm``; a ``precision`` given replaces the one ``masters`` picks."""
    if precision is None:
        precision = Masters() if masters else Direct()
    masters = not isinstance(precision, Direct)
    placement = DTensorOwners(comm=comm, masters=masters) if whole_matrices else DTensorLocal(comm=comm)
    return Stage(param_groups, make_optimizer, placement=placement, precision=precision)
