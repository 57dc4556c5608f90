"""Megatron's ``LayerWiseDistributedOptimizer``: the optimizers it is given placed layer-wise (torch optimizers:
``_torch_layer_wise``; Megatron optimizers: ``_placed_layer_wise``) from ``layer_wise``'s parts.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from optstack.clip import norm_pows
from optstack.distributed.comm import Comm, NullComm
from optstack.distributed.ddp import DataParallel
from optstack.megatron.chained import ChainedOptimizer
from optstack.megatron.core_chain import _core_chain, _plain_groups, _rebind
from optstack.megatron.ddp import DistributedDataParallel
from optstack.megatron.ddp_config import compute_full_param_layout
from optstack.megatron.layer_wise import (
    fresh_precision,
    plan_bucket_gathers,
    publishing_wrapper,
    torch_layer_wise_stage,
    wrapper_of,
)
from optstack.megatron.optimizers import Float16OptimizerWithFloat16Params, FP32Optimizer, MegatronOptimizer
from optstack.megatron.param_and_grad_buffer import PerBufferParamLayout, bucket_end_divisor, plan_buffer
from optstack.precision.scaler import NoScaler
from optstack.stage import Direct, Masters, Stage
from optstack.stage.placement import LayerWise

__all__ = ["LayerWiseDistributedOptimizer"]


class LayerWiseDistributedOptimizer(ChainedOptimizer):
    """Megatron's layer-wise distributed optimizer: whole parameters stepped by owner ranks of the
    data-parallel group (balanced by Newton-Schulz cost), then sent to every rank; what Muon needs.
    ``get_megatron_optimizer`` builds it for ``use_layer_wise_distributed_optimizer`` over Muon's (layer-wise)
    and the scalar optimizer's (replicated) optimizers. Built directly, as Megatron's callers do, over:

    - plain torch optimizers: each one's groups placed layer-wise, stepped as a
      ``Float16OptimizerWithFloat16Params`` with ``config.bf16`` (else an ``FP32Optimizer``), gradients read from
      ``param.main_grad`` or ``param.grad`` over ``pg_collection``'s ``dp_cp`` / ``expt_dp``, or over the
      wrapper's groups and buffers when ``model_chunks`` holds the ``DistributedDataParallel`` model;
    - Megatron optimizers over one whole-parameter stage: placed layer-wise with a fresh inner optimizer of the
      same class and defaults (so they must not have stepped); with ``config.bf16`` an ``FP32Optimizer`` becomes a
      ``Float16OptimizerWithFloat16Params`` (megatron-core 0.16 re-wraps it) and a
      ``Float16OptimizerWithFloat16Params`` is refused, unless ``get_megatron_optimizer`` built it over bf16
      parameters with ``bf16=False`` (``megatron_fp32``). Others are kept.

    With ``config.overlap_param_gather`` the model's bucket groups gather the parameters other ranks stepped, as
    Megatron's: ``model.start_param_sync()`` starts them, the forward pre-hooks finish them. Until then other
    ranks' parameters are the previous step's: read the model after a forward, or call
    ``optimizer.finish_param_sync()``.

    Args:
        optimizers: the optimizers (above).
        config: the Megatron ``OptimizerConfig``.
        pg_collection: Megatron's ``ProcessGroupCollection`` (``dp_cp`` or ``dp``, ``expt_dp``), or None
            (torch.distributed's world); not needed when ``model_chunks`` holds the wrapper.
        init_state_fn_list: one per optimizer, kept as the wrapping optimizers' ``init_state_fn``.
        model_chunks: the ``DistributedDataParallel`` model chunks (needed with ``overlap_param_gather``).

    Attributes:
        overlap_param_gather: whether the bucket groups gather the parameters. pg_collection, model_chunks: as
            given.

    Raises:
        TypeError: with ``config.bf16``, an optimizer already wrapped as ``Float16OptimizerWithFloat16Params``
            (Megatron's error: pass the base torch optimizers).
        ValueError: none of the optimizers can be placed layer-wise, a torch optimizer mixing dense and expert
            groups, fp16, ``overlap_param_gather`` without the wrapped model, or ``init_state_fn_list`` of
            another length.
    """

    def __init__(self, optimizers: Sequence[Any], config: Any, pg_collection: Any = None,
                 init_state_fn_list: Sequence[Callable] | None = None, model_chunks: Any = None) -> None:
        if getattr(config, "bf16", False):
            for optimizer in optimizers:
                if isinstance(optimizer, Float16OptimizerWithFloat16Params) and not optimizer.megatron_fp32:
                    raise TypeError("LayerWiseDistributedOptimizer expects base torch optimizers, got "
                                    f"{type(optimizer).__name__}. Do not pre-wrap with Megatron optimizers "
                                    "(LayerWiseDistributedOptimizer received Float16 optimizer already).")
        self._build(list(optimizers), config, pg_collection, init_state_fn_list, model_chunks, rewrap=True)

    @classmethod
    def _of_members(cls, members: Sequence[MegatronOptimizer], config: Any) -> LayerWiseDistributedOptimizer:
        """Over the Megatron optimizers ``get_megatron_optimizer`` built (already placed layer-wise)."""
        out = cls.__new__(cls)
        out._build(list(members), config, None, None, None, rewrap=False)
        return out

    def _build(self, optimizers: list[Any], config: Any, pg_collection: Any,
               init_state_fn_list: Sequence[Callable] | None, model_chunks: Any, *, rewrap: bool) -> None:
        if init_state_fn_list and len(init_state_fn_list) != len(optimizers):
            raise ValueError(f"LayerWiseDistributedOptimizer: init_state_fn_list has {len(init_state_fn_list)} "
                             f"functions for {len(optimizers)} optimizers; give one per optimizer or None")
        chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks or [])
        self.overlap_param_gather = bool(getattr(config, "overlap_param_gather", False))
        members = []
        for i, optimizer in enumerate(optimizers):
            if isinstance(optimizer, torch.optim.Optimizer):
                member = _torch_layer_wise(optimizer, config, pg_collection, chunks, self.overlap_param_gather)
                member.init_state_fn = init_state_fn_list[i] if init_state_fn_list else None
                members.append(member)
            else:
                # Megatron wraps an FP32Optimizer's torch optimizer for bf16 (megatron-core 0.16)
                to_bf16 = rewrap and bool(getattr(config, "bf16", False)) and (
                    isinstance(optimizer, FP32Optimizer) or getattr(optimizer, "megatron_fp32", False))
                members.append(_placed_layer_wise(optimizer, config, bucket_synced=self.overlap_param_gather,
                                                  to_bf16=to_bf16, pg_collection=pg_collection))
        super().__init__(members)
        self.config = config
        self.pg_collection = pg_collection
        self.model_chunks = chunks
        #: Megatron's: the parameters reach the other ranks through the wrapper's buffer all-gather (ZeRO-1 over
        #: whole-shard buffers), not through this optimizer's own gathers
        self.use_buffer_param_sync = any(steps_whole(s) for s in self.stages)
        if not self.use_buffer_param_sync and not any(isinstance(s.placement, LayerWise) for s in self.stages):
            raise ValueError("LayerWiseDistributedOptimizer: none of the optimizers can be placed layer-wise; pass "
                             "torch optimizers, or build them with get_megatron_optimizer(config, [ddp_model]) over a "
                             "DistributedDataParallel model with use_distributed_optimizer=False")
        if self.overlap_param_gather:
            plan_bucket_gathers(self.stages)

    @staticmethod
    def _shard_divisor(data_parallel_world_size: int, ddp_config: Any) -> int:
        """Megatron's: what each shard of a whole-shard bucket is a multiple of (64-aligned starts, buckets a
        multiple of ``bucket_end_divisor``)."""
        divisor = bucket_end_divisor(data_parallel_world_size, bool(ddp_config.pad_buckets_for_high_nccl_busbw))
        return math.lcm(64, divisor // data_parallel_world_size)

    @staticmethod
    def _compute_per_buffer_param_layout(params: Sequence[torch.nn.Parameter], bucket_size: int | None,
                                         data_parallel_world_size: int, ddp_config: Any,
                                         param_indices: Sequence[int] | None = None) -> PerBufferParamLayout:
        """Megatron's: one buffer's whole-shard layout (``params`` in forward order), as the face's wrapper lays
        it out (the core's packing: module docstring of ``param_and_grad_buffer``)."""
        return plan_buffer(params, bucket_size, data_parallel_world_size, ddp_config, whole=True,
                           indices=param_indices)

    # Megatron's (current main): the tagged parameters each lie whole inside one rank's shard (its docstring)
    compute_full_param_layout = staticmethod(compute_full_param_layout)

    def finish_param_sync(self) -> None:
        """Make every rank hold every updated parameter: with ``overlap_param_gather`` the bucket groups' gathers
        not started yet run now (collective: every rank calls it), and those in flight are waited for."""
        super().finish_param_sync()
        if self.overlap_param_gather:
            wrappers = (publishing_wrapper(s.placement) for s in self.stages)
            for ddp in {id(d): d for d in wrappers if d is not None}.values():
                ddp._finish_layer_wise_param_sync()

    @torch.no_grad()
    def allgather_params(self) -> None:
        """Send the parameters each rank stepped to every rank, as the step does after stepping (packed per owner;
        over a wrapper laid out for this optimizer, its buckets' all-gather; with ``overlap_param_gather`` the
        bucket groups do it instead: ``model.start_param_sync()``). Collective."""
        for stage in self.stages:
            if steps_whole(stage):  # over a laid-out wrapper: its buckets' all-gather
                stage.placement.publish()
                stage.placement.finish()
            elif isinstance(stage.placement, LayerWise) and publishing_wrapper(stage.placement) is None:
                stage.placement.publish()

    @torch.no_grad()
    def broadcast_params(self) -> None:
        """Send every layer-wise parameter from the rank that stepped it to every rank, one broadcast each
        (Megatron's reference for ``allgather_params``). Collective."""
        for stage in self.stages:
            placement = stage.placement
            if isinstance(placement, LayerWise):
                for param, owner in zip(placement.params, placement.owners, strict=True):
                    placement.dp.broadcast(param.data, owner)

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """The global gradient norm after ``prepare_grads``: each parameter counted once, the layer-wise ones'
        squares summed over their data-parallel group (Megatron reduces over the world)."""
        total = 0.0
        for member in self.chained_optimizers:
            stage = getattr(member, "_stage", None)
            if stage is not None and isinstance(stage.placement, LayerWise):
                grads = member.get_grads_for_grad_norm()
                local = norm_pows(grads, 2.0, stage.device).sum().reshape(1)
                # whole on every rank of the data-parallel group; other parts over the expert/model-parallel ones
                total += float(stage.placement.comm.all_reduce(stage.placement.dp.all_reduce(local)).item())
            else:
                total += float(member.get_grad_norm() or 0.0) ** 2
        return math.sqrt(total)


def steps_whole(stage: Stage | None) -> bool:
    """Whether ``stage`` is ZeRO-1 over whole-shard buffers: each rank steps whole parameters from its
    reduce-scatter shard (the layer-wise optimizer over a wrapper laid out for it)."""
    return stage is not None and stage.placement.kind == "zero1" and stage.placement.owns_whole


def _torch_layer_wise(optimizer: torch.optim.Optimizer, config: Any, pg_collection: Any, chunks: list[Any],
                      bucket_synced: bool) -> MegatronOptimizer:
    """A torch optimizer's groups placed layer-wise (``layer_wise.torch_layer_wise_stage``), wrapped as Megatron
    wraps it: ``Float16OptimizerWithFloat16Params`` with ``bf16`` (or bf16 parameters), else ``FP32Optimizer``."""
    owner = "LayerWiseDistributedOptimizer"
    groups = _plain_groups(optimizer, owner)
    params = [p for g in groups for p in g["params"]]
    kinds = {bool(g.get("is_expert_parallel", False)) for g in groups if g["params"]}
    if len(kinds) > 1:
        raise ValueError(f"{owner}: a torch optimizer holds dense and expert (is_expert_parallel) groups; give one "
                         "optimizer per kind")
    if getattr(config, "fp16", False) or any(p.dtype == torch.float16 for p in params):
        raise ValueError(f"{owner} over torch optimizers steps bf16 or fp32 parameters (Megatron wraps them for "
                         "bf16 only); build fp16 models with get_megatron_optimizer")
    expert = kinds == {True}
    ddp = wrapper_of(params, chunks)
    if bucket_synced and ddp is None:
        raise ValueError(f"{owner}: with overlap_param_gather the model's bucket groups gather the parameters; pass "
                         "model_chunks=[the DistributedDataParallel model] (Megatron asserts the same)")
    dp = NullComm() if ddp is not None else _dp_comm(pg_collection, expert)
    masters = bool(getattr(config, "bf16", False)) or any(p.dtype == torch.bfloat16 for p in params)
    stage = torch_layer_wise_stage(groups, _rebind(optimizer, owner), precision=Masters() if masters else Direct(),
                                   expert=expert, ddp=ddp, dp=dp, bucket_synced=bucket_synced)
    cls = Float16OptimizerWithFloat16Params if masters else FP32Optimizer
    return cls._over(stage, config, _core_chain([stage], config, NoScaler(), [ddp] if ddp is not None else []))


def _placed_layer_wise(optimizer: Any, config: Any, *, bucket_synced: bool, to_bf16: bool = False,
                       pg_collection: Any = None) -> Any:
    """Megatron re-wraps optimizers layer-wise: a member over one whole-parameter stage (what
    ``get_megatron_optimizer`` builds without the distributed optimizer, or an ``FP32Optimizer`` over a torch
    optimizer) becomes the same class (``to_bf16``: a ``Float16OptimizerWithFloat16Params``) over a layer-wise
    stage of the same groups, with a fresh inner optimizer of the same class and defaults (so it must not have
    stepped): over its ``DistributedDataParallel`` model's groups and buffers, else over ``pg_collection``'s
    data-parallel group reading ``param.main_grad`` / ``param.grad``. ``bucket_synced``: placed to leave their
    gathers to the wrapper's bucket groups, layer-wise stages too. Other members are kept."""
    stage = optimizer._stage if isinstance(optimizer, MegatronOptimizer) else None
    if stage is None:
        return optimizer
    syncs = [s for s in optimizer._chain.grad_syncs if isinstance(s, DataParallel)]
    kind = stage.placement.kind
    in_layer_wise_chain = any(s.placement.kind == "layerwise" for s in optimizer._chain.stages)
    if len(syncs) > 1 or (syncs and syncs[0].shard_grads) or publishing_wrapper(stage.placement) is not None \
            or kind not in ("whole", "layerwise") or (kind == "whole" and in_layer_wise_chain):
        return optimizer  # get_megatron_optimizer's layer-wise chain keeps its scalar optimizer replicated
    ddp = syncs[0] if syncs else None
    bucket_synced = bucket_synced and isinstance(ddp, DistributedDataParallel)
    if kind == "layerwise" and not bucket_synced:
        return optimizer
    inner = stage.optimizer
    if any(inner.state.values()):
        raise ValueError(f"LayerWiseDistributedOptimizer: {type(optimizer).__name__} has already stepped; wrap "
                         "the optimizers before the first step")
    accepted = inspect.signature(type(inner).__init__).parameters
    defaults = {k: v for k, v in inner.defaults.items() if k in accepted}
    groups = [dict(g) for g in stage.param_groups]
    expert = bool(groups[0].get("is_expert_parallel", False))
    precision = Masters() if to_bf16 else fresh_precision(stage.precision)

    def make(gs: list[dict[str, Any]]) -> torch.optim.Optimizer:
        return type(inner)(gs, **defaults)

    placed = torch_layer_wise_stage(groups, make, precision=precision, expert=expert, ddp=ddp,
                                    dp=NullComm() if ddp is not None else _dp_comm(pg_collection, expert),
                                    bucket_synced=bucket_synced)
    cls = Float16OptimizerWithFloat16Params if to_bf16 else type(optimizer)
    return cls._over(placed, config, _core_chain([placed], config, optimizer._chain.scaler, syncs))


def _dp_comm(pg_collection: Any, expert: bool) -> Comm | NullComm:
    """The data-parallel group of ``pg_collection`` (``expt_dp`` for experts, else ``dp_cp`` or ``dp``; None:
    torch.distributed's world) as optstack's communicator."""
    group = None if pg_collection is None else (
        getattr(pg_collection, "expt_dp", None) if expert else
        getattr(pg_collection, "dp_cp", None) or getattr(pg_collection, "dp", None))
    name = "expert data-parallel" if expert else "data-parallel"
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size(group) == 1:
        return NullComm(name)
    return Comm(group, name=name)
