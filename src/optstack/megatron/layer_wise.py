"""The parts of Megatron's ``LayerWiseDistributedOptimizer`` (``layer_wise_optimizer.py``).

- ``torch_layer_wise_stage`` places a plain torch optimizer's groups layer-wise, its gradients read from
  ``param.main_grad`` (set by Megatron's ``DistributedDataParallel``) or ``param.grad``.
- Megatron's current main lays the wrapper's buffers out for it (``tag_params_for_buffer_routing``): each matrix
  it manages lies whole inside one rank's reduce-scatter shard, so that rank steps it from its shard and the
  buckets' all-gather publishes it.
- With ``overlap_param_gather`` the wrapper's bucket groups send what each owner stepped
  (``bucket_synced_layer_wise``; ``plan_bucket_gathers`` writes each bucket's ``layerwise_params_list``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from optstack.distributed.comm import Comm, NullComm
from optstack.megatron.ddp import DistributedDataParallel
from optstack.protocol import MakeOptimizer
from optstack.stage import Precision, Remainders, Stage, layerwise_stage, zero1_stage
from optstack.stage.placement import LayerWise, assign_params

__all__ = ["BucketGroupsPublisher", "publishing_wrapper", "bucket_synced_layer_wise", "fresh_precision",
           "is_managed_by_layer_wise_optimizer", "main_grad_or_grad", "plan_bucket_gathers",
           "tag_params_for_buffer_routing", "torch_layer_wise_stage", "wrapper_of"]


def is_managed_by_layer_wise_optimizer(param: torch.Tensor) -> bool:
    """Megatron's rule for the parameters the layer-wise optimizer steps: the matrices Muon orthogonalises (2-D,
    not an embedding or output parameter, not excluded with ``use_muon=False``); the rest go to Muon's scalar
    optimizer. It must agree with Muon's routing (``get_megatron_optimizer`` routes the same way)."""
    return (bool(getattr(param, "use_muon", True)) and param.dim() == 2
            and not getattr(param, "is_embedding_or_output_parameter", False))


def tag_params_for_buffer_routing(model_chunks: Sequence[torch.nn.Module]) -> None:
    """Megatron's: set ``is_managed_by_layer_wise_optimizer`` on every trainable parameter of the (not yet
    wrapped) model chunks, so that ``DistributedDataParallel`` puts the layer-wise optimizer's matrices in
    whole-shard buffers and the rest in buffers of their own. Megatron routes buffers by this attribute, so the
    face sets it as Megatron does (optstack's core takes the choice as an argument instead)."""
    for chunk in model_chunks:
        for param in chunk.parameters():
            if param.requires_grad:
                param.is_managed_by_layer_wise_optimizer = is_managed_by_layer_wise_optimizer(param)


def main_grad_or_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient Megatron's optimizers read: ``param.main_grad`` when set, else ``param.grad``."""
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


def fresh_precision(precision: Precision) -> Precision:
    """A new precision of the same kind and settings (a rebuilt stage makes its own masters)."""
    if isinstance(precision, Remainders):
        return Remainders(copy_grads=precision.copy_grads)
    return type(precision)(copy_grads=precision.copy_grads, host_fraction=precision.host_fraction)


def wrapper_of(params: Sequence[torch.Tensor], chunks: Sequence[Any]) -> DistributedDataParallel | None:
    """The one ``DistributedDataParallel`` of ``chunks`` holding every parameter of ``params`` (None if none).

    Raises:
        ValueError: some parameters in a wrapper of ``chunks`` and some not.
    """
    for chunk in chunks:
        if isinstance(chunk, DistributedDataParallel):
            held = [id(p) in chunk._main_grad_views for p in params]
            if all(held) and held:
                return chunk
            if any(held):
                raise ValueError("LayerWiseDistributedOptimizer: an optimizer holds parameters of the "
                                 "DistributedDataParallel model in model_chunks and others; give each optimizer "
                                 "parameters of one model chunk")
    return None


class BucketGroupsPublisher:
    """Publishes what layer-wise owners stepped through ``ddp``'s bucket groups (``overlap_param_gather``): after
    a step each bucket group gathers again, started by ``start_param_sync`` or a forward pre-hook; a step first
    waits for a gather in flight (the core ``LayerWise``'s ``publisher``)."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.ddp = ddp

    def stepped(self) -> None:
        self.ddp._layer_wise_params_stepped()

    def wait(self) -> None:
        self.ddp._wait_layer_wise_param_sync()


def bucket_synced_layer_wise(ddp: DistributedDataParallel, *, expert: bool) -> LayerWise:
    """The layer-wise placement over ``ddp``'s groups and buffers whose parameters reach the other ranks through
    its bucket groups."""
    g = ddp.groups
    return LayerWise(comm=g.expert_dp if expert else g.dp, grad_of=ddp.main_grad,
                     reduce_over=[g.ep, g.mp] if expert else [g.mp], tp_rank=g.tp.rank, device=ddp.device,
                     publisher=BucketGroupsPublisher(ddp))


def publishing_wrapper(placement: Any) -> DistributedDataParallel | None:
    """The wrapper whose bucket groups publish a layer-wise ``placement``'s parameters, else None."""
    publisher = getattr(placement, "publisher", None)
    return publisher.ddp if isinstance(publisher, BucketGroupsPublisher) else None


def torch_layer_wise_stage(groups: list[dict[str, Any]], make: MakeOptimizer, *, precision: Precision, expert: bool,
                           ddp: DistributedDataParallel | None, dp: Comm | NullComm, bucket_synced: bool) -> Stage:
    """A layer-wise stage over a torch optimizer's ``groups``: over ``ddp``'s groups and gradient buffers when
    the parameters are its (its bucket groups gather them with ``bucket_synced``; a wrapper sharding its
    gradients must hold them in whole-shard buffers: ZeRO-1 over those), else over ``dp`` with gradients from
    ``main_grad_or_grad``."""
    if ddp is not None and ddp.shard_grads:
        # a wrapper laid out for the layer-wise optimizer (wrap_model_chunks_with_ddp): each rank steps the whole
        # parameters of its reduce-scatter shard; the buckets' all-gather publishes them (overlapped: bucket_synced)
        params = [p for g in groups for p in g["params"]]
        if params and not ddp.holds_whole(params):
            raise ValueError("LayerWiseDistributedOptimizer: the model's DistributedDataParallel reduce-scatters "
                             "gradients (use_distributed_optimizer=True) and cuts some of this optimizer's "
                             "parameters across ranks; wrap the model with wrap_model_chunks_with_ddp(..., "
                             "use_layer_wise_distributed_optimizer=True) and give this optimizer the parameters "
                             "it tags (is_managed_by_layer_wise_optimizer), or build the wrapper with "
                             "use_distributed_optimizer=False")
        return zero1_stage(groups, make, ddp=ddp, expert=expert, overlap_param_gather=bucket_synced,
                           precision=precision)
    if ddp is not None and bucket_synced:
        return Stage(groups, make, placement=bucket_synced_layer_wise(ddp, expert=expert), precision=precision)
    if ddp is not None:
        return layerwise_stage(groups, make, ddp=ddp, expert=expert, precision=precision)
    return layerwise_stage(groups, make, comm=dp, grad_of=main_grad_or_grad, precision=precision)


def plan_bucket_gathers(stages: Sequence[Stage]) -> None:
    """Write every bucket's ``layerwise_params_list`` (per rank, the bucket's parameters, in bucket order, that
    the rank sends) for the bucket-synced stages' wrappers: a layer-wise parameter's owner sends it; one stepped
    on every rank (the replicated scalar optimizer's) is sent by one rank, balanced by size (the values are the
    same everywhere; Megatron shards those too, so its buckets send every parameter once as well)."""
    by_ddp: dict[int, tuple[DistributedDataParallel, dict[int, int]]] = {}
    for stage in stages:
        ddp = publishing_wrapper(stage.placement)
        if ddp is not None:
            by_ddp.setdefault(id(ddp), (ddp, {}))[1].update(stage.placement.owner_of())
    stepped = {id(p) for stage in stages for group in stage.param_groups for p in group["params"]}
    for ddp, owners in by_ddp.values():
        for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
            size = ddp.shard_comm(group.buffer).size
            rest = [p for b in group.buckets for p in b.params_list if id(p) in stepped and id(p) not in owners]
            owners.update(zip(map(id, rest), assign_params([float(p.numel()) for p in rest], size), strict=True))
            for bucket in group.buckets:
                lists: list[list[torch.nn.Parameter]] = [[] for _ in range(size)]
                for param in bucket.params_list:
                    if id(param) in owners:
                        lists[owners[id(param)]].append(param)
                bucket.set_layerwise_params_list(lists)
