"""optstack.stage: the runtime core. One ``Stage`` = a placement x a precision around one inner algorithm.

The builders below are the usual combinations; ``Stage(groups, make, placement=..., precision=...)`` is
the general form.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from optstack.distributed.comm import Comm, NullComm
from optstack.distributed.ddp import DataParallel
from optstack.protocol import MakeOptimizer
from optstack.stage.placement import (
    GradOf,
    LayerWise,
    OwnersOverShards,
    Piece,
    Placement,
    Whole,
    WholeOverShards,
    Zero1,
    assign_params,
    newton_schulz_cost,
)
from optstack.stage.precision import Direct, Masters, Precision, Remainders
from optstack.stage.stage import Stage

__all__ = [
    "Direct", "GradOf", "LayerWise", "Masters", "OwnersOverShards", "Piece", "Placement", "Precision", "Remainders",
    "Stage", "Whole", "WholeOverShards", "Zero1",
    "assign_params", "layerwise_stage", "newton_schulz_cost", "owners_stage", "replicated_stage", "zero1_stage",
]


def _params(param_groups: Sequence[Any]) -> list[Any]:
    """The groups' parameters (malformed groups skipped here: ``Stage`` refuses them, saying why)."""
    return [p for g in param_groups for p in (g["params"] if isinstance(g, dict) and "params" in g else [])]


def replicated_stage(param_groups: Sequence[dict[str, Any]], make_optimizer: MakeOptimizer, *,
                     masters: bool = True, grad_of: GradOf | None = None, reduce_over: Sequence[Any] = (),
                     tp_rank: int = 0, device: Any = None, ddp: DataParallel | None = None,
                     expert: bool = False, precision: Precision | None = None) -> Stage:
    """Whole parameters on every rank. With ``ddp``, gradients come from its buffers (gathered from the shards
    where it reduce-scatters them: ``WholeOverShards``) and expert norms also reduce over the expert-parallel
    group; ``masters=False`` steps bf16/fp16 parameters directly; a ``precision`` given replaces the one
    ``masters`` picks."""
    if precision is None:
        precision = Masters() if masters else Direct()
    if ddp is None:
        placement = Whole(grad_of=grad_of, reduce_over=reduce_over, tp_rank=tp_rank, device=device)
    else:
        g = ddp.groups
        common = {"grad_of": ddp.main_grad, "reduce_over": [g.ep, g.mp] if expert else [g.mp], "tp_rank": g.tp.rank,
                 "device": ddp.device}
        gather = ddp.grad_gather(_params(param_groups))
        placement = WholeOverShards(gather=gather, **common) if gather.buckets else Whole(**common)
    return Stage(param_groups, make_optimizer, placement=placement, precision=precision)


def zero1_stage(param_groups: Sequence[dict[str, Any]], make_optimizer: MakeOptimizer, *, ddp: DataParallel,
                expert: bool = False, overlap_param_gather: bool = False,
                param_gather: Literal["auto", "all_gather", "broadcast"] = "auto",
                precision: Precision | None = None) -> Stage:
    """ZeRO-1 over ``ddp``'s buffers: masters and state only for this rank's ranges (see ``Zero1``);
    ``precision`` defaults to ``Masters()``."""
    if not isinstance(ddp, DataParallel):
        raise ValueError(f"a ZeRO-1 stage: ddp must be an optstack DataParallel, got {type(ddp).__name__}")
    layout = ddp.sharded_layout(_params(param_groups), expert=expert, overlap_param_gather=overlap_param_gather,
                                param_gather=param_gather)
    return Stage(param_groups, make_optimizer, placement=Zero1(layout), precision=precision or Masters())


def layerwise_stage(param_groups: Sequence[dict[str, Any]], make_optimizer: MakeOptimizer, *,
                    ddp: DataParallel | None = None, comm: Comm | NullComm | None = None, expert: bool = False,
                    grad_of: GradOf | None = None, reduce_over: Sequence[Any] = (), tp_rank: int = 0,
                    cost: Callable[[Sequence[int]], float] = newton_schulz_cost,
                    precision: Precision | None = None, owners: Mapping[str, int] | None = None) -> Stage:
    """Whole parameters stepped by owner ranks of ``comm`` (or of ``ddp``'s data-parallel group: gradients
    from its buffers, which must be reduced whole), then broadcast (see ``LayerWise``); ``owners``: parameter
    name -> owner rank (a plan's), else balanced by ``cost`` here."""
    if ddp is not None:
        if not ddp.reduces_whole(_params(param_groups)):
            raise ValueError("the layer-wise stage needs every rank to hold complete gradients; build the "
                             "DataParallel wrapper with shard_grads=False, or use owners_stage, whose owners "
                             "gather their matrices from the reduce-scattered shards")
        g = ddp.groups
        comm, grad_of, tp_rank = (g.expert_dp if expert else g.dp), ddp.main_grad, g.tp.rank
        reduce_over = [g.ep, g.mp] if expert else [g.mp]
    if comm is None:
        raise ValueError("layerwise_stage needs comm= (the data-parallel group) or ddp=")
    placement = LayerWise(comm=comm, grad_of=grad_of, reduce_over=reduce_over, tp_rank=tp_rank,
                          device=ddp.device if ddp is not None else None, cost=cost, owners=owners)
    return Stage(param_groups, make_optimizer, placement=placement, precision=precision or Masters())


def owners_stage(param_groups: Sequence[dict[str, Any]], make_optimizer: MakeOptimizer, *, ddp: DataParallel,
                 expert: bool = False, owners: Mapping[str, int] | None = None,
                 precision: Precision | None = None) -> Stage:
    """Whole parameters stepped by owner ranks over ``ddp``'s reduce-scattered gradients (``OwnersOverShards``):
    each owner gathers its matrices' reduced pieces from the shards, steps them, and broadcasts them."""
    placement = OwnersOverShards(shards=ddp.grad_shards(_params(param_groups), expert=expert), owners=owners)
    return Stage(param_groups, make_optimizer, placement=placement, precision=precision or Masters())
