"""Placements: which elements of which parameters this rank steps, where their gradients are, over which
ranks the gradient statistics are reduced, and how the stepped values reach every rank.

A placement turns the model-side param groups into ``Piece``s, the one record of "what a rank holds of a
parameter": elements ``[start, end)`` of the flattened parameter, as a tensor of the model's own storage.

- ``Whole``: every parameter whole on every rank (a single process, or replicated data parallelism).
- ``Zero1``: this rank's range of every bucket of a data-parallel wrapper (``ShardedLayout``: views of its
  buffers, never the wrapper); the ranges cut across parameters, except in whole-shard buffers, where each is
  a whole parameter (so Muon steps reduce-scattered matrices); the wrapper's gather publishes them.
- ``LayerWise``: whole parameters, each stepped by one owner rank (balanced by cost), then broadcast.
- ``OwnersOverShards``: as ``LayerWise``, over reduce-scattered gradients: each owner gathers its matrices'
  reduced pieces from the ranks' shards (point to point), so no rank needs whole gradients it does not step.

A DTensor placement (local shards of ``fully_shard`` / tensor-parallel parameters) is one more of these.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from optstack.clip import counts_toward_norm
from optstack.distributed.comm import Comm, NullComm
from optstack.distributed.ddp import unwrapped_use_error, wrapper_holding
from optstack.distributed.parallel import ComposedComm
from optstack.distributed.param_gather import GradGather, GradShards, OwnerBroadcast, ParamGather, ShardedLayout
from optstack.layout import Run
from optstack.plan import assign_params, newton_schulz_cost
from optstack.protocol import ParamShard, phase
from optstack.stage.sharded import to_sharded

__all__ = ["GradOf", "Holdings", "LayerWise", "OwnersOverShards", "Piece", "Placement", "Run", "Whole", "Zero1",
           "assign_params", "newton_schulz_cost", "owners_of"]

GradOf = Callable[[torch.Tensor], "torch.Tensor | None"]


@dataclass(frozen=True)
class Holdings:
    """What every rank holds of a stage's parameters, computed on any one rank (no communication).

    Attributes:
        ranks: the global ranks that the runs' ranks index, in group order; None: every rank holds every
            parameter whole (replicated).
        runs: per parameter (in the order asked), its ``Run``s; empty when no rank holds any of it.
    """

    ranks: tuple[int, ...] | None
    runs: tuple[tuple[Run, ...], ...] = ()


def _grad_attr(param: torch.Tensor) -> torch.Tensor | None:
    return param.grad


@dataclass(eq=False)
class Piece:
    """What this rank steps of one parameter.

    Attributes:
        name: the parameter's name.
        param: the model parameter (its attributes decide how its gradient counts in the norm).
        start, end: the range ``[start, end)`` of the flattened parameter.
        value: those elements in the model's storage: the parameter itself, or a 1-D view of its buffer.
        grad: a fixed view of its (reduced) gradient, or None when the placement reads it each step.
    """

    name: str
    param: torch.Tensor
    start: int
    end: int
    value: torch.Tensor
    grad: torch.Tensor | None = None


class Placement:
    """Whole parameters on every rank; the base of the other placements.

    Args:
        grad_of: a parameter's (reduced) gradient: ``p.grad`` by default, a grad-buffer view under a
            data-parallel wrapper.
        reduce_over: the groups whose ranks hold other gradients (model-parallel; expert-parallel for expert
            parameters): norms and non-finite flags are reduced over them.
        tp_rank: this rank's tensor-parallel rank (tensor-parallel duplicates count on rank 0 only).
        device: where a rank with no parameters runs its reductions (NCCL cannot reduce CPU tensors).
    """

    kind = "whole"

    def __init__(self, *, grad_of: GradOf | None = None, reduce_over: Sequence[Any] = (), tp_rank: int = 0,
                 device: torch.device | None = None) -> None:
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or tp_rank < 0:
            raise ValueError(f"tp_rank must be an int >= 0, got {tp_rank!r}")
        self.grad_of: GradOf = grad_of if grad_of is not None else _grad_attr
        self.comm = ComposedComm(list(reduce_over))
        #: the group whose ranks hold different parts of one parameter's state (None: every rank holds it all)
        self.shard_comm: Comm | NullComm | None = None
        self.tp_rank = tp_rank
        self.device = device
        self._first_read = True

    def pieces(self, names: list[list[str]], params: list[list[torch.Tensor]]) -> list[list[Piece]]:
        """Per group, the pieces this rank steps (groups are kept, possibly empty)."""
        return [[Piece(n, p, 0, p.numel(), p) for n, p in zip(gn, gp, strict=True)]
                for gn, gp in zip(names, params, strict=True)]

    def grads(self, pieces: Sequence[Piece]) -> list[torch.Tensor | None]:
        """The current model gradient of each piece (shaped like ``piece.value``), None where absent.

        Raises:
            RuntimeError: at the first read, no gradient at all and the parameters held by a data-parallel
                wrapper (an optimizer built before wrapping: its steps would change nothing).
        """
        grads = [p.grad if p.grad is not None else self.grad_of(p.param) for p in pieces]
        if self._first_read and self.grad_of is _grad_attr:
            self._first_read = False
            if pieces and all(g is None for g in grads) and wrapper_holding(pieces[0].param) is not None:
                raise RuntimeError(unwrapped_use_error(pieces[0].name, "this optimizer (built before wrapping?)"))
        return grads

    def norm_params(self, pieces: Sequence[Piece]) -> list[torch.Tensor]:
        """The parameters whose gradients make this rank's part of the global norm (fixed at construction)."""
        return [p.param for p in pieces]

    def norm_grads(self, ready: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Their gradients, given the pieces' ready ones, in ``norm_params`` order."""
        return list(ready)

    def norm_counts(self, params: Sequence[torch.Tensor]) -> list[bool]:
        """Which of ``params``' (``norm_params``') norm terms count on this rank, fixed with the parameters:
        tensor-parallel duplicates on tp rank 0 only."""
        return [counts_toward_norm(p, self.tp_rank) for p in params]

    #: each piece is a whole parameter on its one owner rank (layer-wise, DTensor owners): the sharded state
    #: keeps the parameter's shape (``sharded_state``)
    owns_whole = False

    def group_settings(self, pieces: Sequence[Piece]) -> dict[str, Any]:
        """Settings the inner optimizer's group over ``pieces`` gets from the placement (not the model-side
        group's: what the placement knows of its parameters' layout); none here."""
        return {}

    def element_rows(self, piece: Piece) -> torch.Tensor:
        """The row of the whole 2-D parameter each element of ``piece``'s stepped value lies in, in the value's
        order (QK-clip's per-row factors): here a range ``[start, end)`` of the flattened parameter."""
        return torch.arange(piece.start, piece.end, device=piece.value.device) // piece.param.shape[-1]

    def flat_shards(self, shards: dict[str, ParamShard]) -> dict[str, ParamShard]:
        """This rank's ``ParamShard``s as the name-keyed state holds them: ranges of flattened parameters (the
        pieces are those already here; a placement whose pieces are blocks converts them, collectively)."""
        return shards

    def local_shards(self, shards: Mapping[str, ParamShard]) -> Mapping[str, ParamShard]:
        """The inverse of ``flat_shards``: name-keyed state cut to this rank's pieces (collective where blocks)."""
        return shards

    def refresh(self) -> None:
        """Take the model's current values into what is stepped, where that is a copy (nothing here)."""

    def sharded_state(self, entries: dict[int, dict[str, Any]], pieces: Sequence[Piece],
                      params: Sequence[torch.Tensor]) -> dict[int, dict[str, Any]]:
        """``Stage.torch_state`` entries as DCP needs them to reshard: where the state of ``params`` is spread
        over ``shard_comm``, element-wise tensors as ``ShardedTensor``s of the flattened parameter
        (``stage/sharded.py``). Collective over that group."""
        comm = self.shard_comm
        if comm is None or comm.size == 1:
            return entries
        ranges = {id(p.param): (p.start, p.end, str(p.value.device)) for p in pieces}
        held = self.holdings(params)
        runs = held.runs if held is not None and held.ranks == tuple(comm.global_ranks) else None
        return to_sharded(entries, params, ranges, comm, whole=self.owns_whole, runs=runs)

    def holdings(self, params: Sequence[torch.Tensor]) -> Holdings | None:
        """What every rank holds of ``params`` (every parameter of the stage), or None where this placement
        cannot tell without asking the other ranks (a checkpoint then exchanges their tables)."""
        return None

    def cannot_add(self) -> str | None:
        """Why parameters cannot be added after construction, or None when they can."""
        if self.grad_of is not _grad_attr:
            return "its gradients are read from a data-parallel wrapper's buffers, laid out when the model was wrapped"
        return None

    def publish(self) -> None:
        """Bring every rank's stepped values to every rank (collective); nothing to do for whole params."""

    def finish(self) -> None:
        """Wait for a publish still in flight."""


class Whole(Placement):
    """Every parameter whole on every rank (a single process, or replicated data parallelism)."""

    def holdings(self, params: Sequence[torch.Tensor]) -> Holdings | None:
        return Holdings(None)


class WholeOverShards(Whole):
    """Every parameter whole on every rank, over a wrapper that reduce-scatters their buckets: before the
    gradients are read, every rank's reduced shard is all-gathered into the buckets (``GradGather``), so the
    wrapper stays as it was built."""

    def __init__(self, *, gather: GradGather, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gather = gather

    def grads(self, pieces: Sequence[Piece]) -> list[torch.Tensor | None]:
        with phase("gather_grads"):
            self.gather.run()
        return super().grads(pieces)


class Zero1(Placement):
    """ZeRO-1: the pieces are this rank's ranges of a data-parallel wrapper's buckets.

    Args:
        layout: the wrapper's ``ShardedLayout`` for these parameters (``DataParallel.sharded_layout``): the
            owned slices of the parameter and gradient buffers, the reduction groups and the gather.
    """

    kind = "zero1"

    def __init__(self, layout: ShardedLayout) -> None:
        super().__init__(reduce_over=layout.reduce_over, tp_rank=layout.tp_rank, device=layout.device)
        self.layout = layout
        self.gather: ParamGather = layout.gather
        self.shard_comm = layout.reduce_over[0]
        self.owns_whole = layout.whole  # whole-shard buffers: each parameter, shaped, on its one owner

    def pieces(self, names: list[list[str]], params: list[list[torch.Tensor]]) -> list[list[Piece]]:
        return [[Piece(n, p, *owned) for n, p in zip(gn, gp, strict=True)
                 if (owned := self.layout.owned(p)) is not None]  # (start, end, value, grad) of this rank's range
                for gn, gp in zip(names, params, strict=True)]

    def cannot_add(self) -> str | None:
        return "ZeRO-1 shards the data-parallel wrapper's buffers, laid out when the model was wrapped"

    def holdings(self, params: Sequence[torch.Tensor]) -> Holdings | None:
        comm = self.shard_comm
        if comm is None or comm.size == 1:  # one shard per group: every rank holds every parameter whole
            return Holdings(None)
        runs = [self.layout.parts(p) for p in params]
        if any(r is None for r in runs):
            return None
        return Holdings(tuple(comm.global_ranks), tuple(tuple(r) for r in runs))  # type: ignore[arg-type]

    def publish(self) -> None:
        with phase("param_gather"):
            self.gather.launch()
            if not self.gather.overlap:  # else each bucket is waited for before the next forward uses it
                self.gather.wait()

    def finish(self) -> None:
        self.gather.wait()


class Publisher(Protocol):
    """Who brings the parameters owners stepped to every rank, when not the placement's own broadcast (e.g. a
    wrapper's bucket gathers, overlapped with the next forward)."""

    def stepped(self) -> None:
        """The owners stepped their parameters: publish them (now or later)."""

    def wait(self) -> None:
        """Wait for a publication in flight (before the parameters are read or stepped again)."""


def owners_of(planned: Mapping[str, int] | None, names: Sequence[str], params: Sequence[torch.Tensor], ranks: int,
              cost: Callable[[Sequence[int]], float], who: str) -> list[int]:
    """Each parameter's owner rank: the plan's (``planned``: name -> rank, checked to cover ``names`` with ranks in
    ``[0, ranks)``), else balanced by ``cost`` here."""
    if planned is None:
        return assign_params([cost(tuple(p.shape)) for p in params], ranks)
    missing = [n for n in names if n not in planned]
    if missing or any(not 0 <= planned[n] < ranks for n in names):
        raise ValueError(f"{who}: the owners given do not cover these parameters with ranks in [0, {ranks}) "
                         f"(e.g. {(missing or list(names))[0]!r}); plan them for this group")
    return [planned[n] for n in names]


class LayerWise(Placement):
    """Whole parameters, each stepped by its owner rank, then broadcast to every rank (what Muon needs).

    Gradients are complete on every rank (a replicated reduction), so the norm is computed over every
    parameter on every rank, in the order a replicated run uses: the clip factor is the replicated run's to
    the bit. Only the model-parallel groups (``reduce_over``) are reduced over.

    Args:
        comm: the data-parallel group the parameters are spread over.
        cost: a parameter's update cost from its shape (balances the assignment).
        owners: parameter name -> owner rank, decided beforehand (``optstack.plan``); None: balanced by ``cost``.
        publisher: publishes the stepped parameters instead of the placement's broadcast (``Publisher``).
        other arguments: as ``Placement``.
    """

    kind = "layerwise"
    owns_whole = True

    def __init__(self, *, comm: Comm | NullComm, grad_of: GradOf | None = None, reduce_over: Sequence[Any] = (),
                 tp_rank: int = 0, device: torch.device | None = None,
                 cost: Callable[[Sequence[int]], float] = newton_schulz_cost,
                 owners: Mapping[str, int] | None = None, publisher: Publisher | None = None) -> None:
        super().__init__(grad_of=grad_of, reduce_over=reduce_over, tp_rank=tp_rank, device=device)
        self.publisher = publisher
        self.dp = self.shard_comm = comm
        self.cost = cost
        self._planned = dict(owners) if owners is not None else None
        self.owners: list[int] = []
        self._all: list[torch.Tensor] = []
        self._broadcast: OwnerBroadcast | None = None

    def pieces(self, names: list[list[str]], params: list[list[torch.Tensor]]) -> list[list[Piece]]:
        self._all = [p for group in params for p in group]
        self.owners = owners_of(self._planned, [n for group in names for n in group], self._all, self.dp.size,
                                self.cost, type(self).__name__)
        self._broadcast = OwnerBroadcast(self.dp, self._all, self.owners)
        owner = iter(self.owners)
        return [[Piece(n, p, 0, p.numel(), p) for n, p in zip(gn, gp, strict=True) if next(owner) == self.dp.rank]
                for gn, gp in zip(names, params, strict=True)]

    @property
    def params(self) -> list[torch.Tensor]:
        """Every parameter of the stage, in the order of ``owners``."""
        return list(self._all)

    def cannot_add(self) -> str | None:
        return "the layer-wise placement assigns owner ranks to all parameters at construction"

    def holdings(self, params: Sequence[torch.Tensor]) -> Holdings | None:
        owner_of = self.owner_of()
        if any(id(p) not in owner_of for p in params):
            return None
        return Holdings(tuple(self.dp.global_ranks),
                        tuple(((owner_of[id(p)], 0, p.numel(), 1),) if p.numel() else () for p in params))

    def norm_params(self, pieces: Sequence[Piece]) -> list[torch.Tensor]:
        return list(self._all)

    def norm_grads(self, ready: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        mine = iter(ready)
        return [next(mine) if owner == self.dp.rank else self.grad_of(p)
                for p, owner in zip(self._all, self.owners, strict=True)]

    def owner_of(self) -> dict[int, int]:
        """``id(parameter)`` -> the rank stepping it."""
        return {id(p): owner for p, owner in zip(self._all, self.owners, strict=True)}

    def publish(self) -> None:
        if self.publisher is not None:
            self.publisher.stepped()
        elif self._broadcast is not None:
            with phase("param_gather"):
                self._broadcast.run()

    def finish(self) -> None:
        if self.publisher is not None:
            self.publisher.wait()


class OwnersOverShards(LayerWise):
    """Whole parameters stepped by owner ranks over reduce-scattered gradients (ZeRO-1 for Muon where whole-shard
    buffers would pad too much): after the reduce-scatter each rank holds the reduced gradient of its range of
    every bucket; each owner gathers its matrices' pieces from the ranks holding them (point to point, into one
    whole gradient per owned matrix kept between steps), steps them whole, then broadcasts them as ``LayerWise``.
    Per rank that moves the gradient once in the reduce-scatter and its own matrices' once more, where an
    all-reduce + broadcast moves every gradient twice.

    The norm is each owner's over its matrices, summed over the shard group (as ZeRO-1's), so every element counts
    once.

    Args:
        shards: the wrapper's ``GradShards`` for these parameters.
        owners: parameter name -> owner rank of ``shards.comm`` (a plan's); None: balanced by ``cost`` here.
        cost: as ``LayerWise``.
    """

    kind = "owners"

    def __init__(self, *, shards: GradShards, owners: Mapping[str, int] | None = None,
                 cost: Callable[[Sequence[int]], float] = newton_schulz_cost) -> None:
        super().__init__(comm=shards.comm, reduce_over=shards.reduce_over, tp_rank=shards.tp_rank,
                         device=shards.device, cost=cost, owners=owners)
        self.shards = shards
        self._parts: list[list[tuple[int, int, int]]] = []  # per parameter (on its owner): (rank, start, end)
        self._whole: dict[int, torch.Tensor] = {}  # id(param) -> its gathered gradient, flat (owner only)

    def pieces(self, names: list[list[str]], params: list[list[torch.Tensor]]) -> list[list[Piece]]:
        out = super().pieces(names, params)
        me = self.dp.rank
        self._parts = []
        for param, owner in zip(self._all, self.owners, strict=True):
            parts = []
            if owner == me:
                for rank in range(self.dp.size):
                    part = self.shards.part_on(param, rank)
                    if part is not None:
                        parts.append((rank, *part))
                self._whole[id(param)] = torch.zeros(param.numel(), dtype=self.shards.grad_dtype[id(param)],
                                                     device=self.device)
            self._parts.append(parts)
        return out

    def grads(self, pieces: Sequence[Piece]) -> list[torch.Tensor | None]:
        comm, me = self.dp, self.dp.rank
        handles = []
        with phase("gather_grads"), torch.no_grad():
            for i, (param, owner) in enumerate(zip(self._all, self.owners, strict=True)):
                mine = self.shards.mine[id(param)]
                local = None if mine is None else mine[2]
                if owner != me:
                    handles.append(comm.gather_async(local, owner, (), tag=i))
                    continue
                whole = self._whole[id(param)]
                parts: list[torch.Tensor | None] = [None] * comm.size
                for rank, start, end in self._parts[i]:
                    parts[rank] = whole[start:end]
                handles.append(comm.gather_async(local, owner, parts, tag=i))
            for handle in handles:
                handle.wait()
        return [self._whole[id(p.param)].view(p.param.shape) for p in pieces]

    # Placement's, not LayerWise's: each owner's norm terms are its own matrices' (class docstring)
    norm_params = Placement.norm_params
    norm_grads = Placement.norm_grads
