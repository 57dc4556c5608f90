"""Megatron Core's ``DistributedDataParallelConfig``, its checks, and its translation into the core
``DataParallel``'s arguments and plan:

- ``use_distributed_optimizer`` -> sharded gradients (ZeRO-1) by a reduce-scatter on every backend (emulated on
  gloo), so ranges a rank does not own hold its own scaled, unreduced gradients, as in Megatron;
- ``num_distributed_optimizer_instances`` > 1 -> a partial distributed optimizer: buckets sharded and reduced
  inside each instance (runs of consecutive data-parallel ranks, or ``pg_collection.intra_dp_cp``), then each
  shard all-reduced across instances (or over ``pg_collection.inter_dist_opt``); ``force_all_reduce`` reduces
  over the whole data-parallel group (Megatron's only the owned shard across instances);
- ``grad_reduce_in_fp32`` -> an fp32 gradient buffer (else the parameter dtype);
- ``param_name_patterns_for_fp32_local_accumulation`` -> matching parameters (fnmatch on the wrapped module's
  names; ``'all'``: every one) accumulate in an fp32 tensor of their own (the core's ``local_grad_dtypes``);
- ``overlap_grad_reduce`` -> bucket reductions launched from the backward hooks;
- ``bucket_size`` / ``num_buckets`` -> elements per bucket as Megatron sizes them (``megatron_bucket_size``);
- ``check_for_nan_in_grad`` -> the non-finite check before each bucket's reduction;
- ``average_in_collective``: False divides each bucket by the data-parallel size before the sum, True averages
  in the collective, so, as in Megatron, unowned ranges under a reduce-scatter stay unscaled;
  ``config.calculate_per_token_loss=True`` sums instead;
- ``overlap_param_gather``: the optimizer's ZeRO-1 stage owns the gathers (``get_megatron_optimizer`` requires
  the optimizer config to agree); without ``use_distributed_optimizer`` it is the layer-wise optimizer's, whose
  bucket groups gather into ``grad_data`` (``start_param_sync``, the forward pre-hooks), as Megatron's do.

Megatron-FSDP's fields and ``disable_symmetric_registration`` change nothing while ``use_megatron_fsdp`` and
``nccl_ub`` are False; ``use_megatron_fsdp=True`` is for ``FullyShardedDataParallel`` (``optstack.megatron.fsdp``),
which ``DistributedDataParallel`` names when refusing it. Any other unsupported value is a ``ValueError`` naming
the field.

Buckets are cut as Megatron cuts them: in backward order, a bucket closes once it holds ``bucket_size`` elements;
with ``use_distributed_optimizer`` parameters start at multiples of 64 elements, buckets are padded to a multiple
of ``lcm(data-parallel size, 128)`` and a truthy ``shared_embedding`` parameter gets a bucket of its own.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from optstack.config import DistributedConfig, OptimizerConfig
from optstack.distributed.comm import Comm, NullComm, new_subgroups, world_comm
from optstack.distributed.parallel import ParallelGroups
from optstack.megatron.param_and_grad_buffer import (
    BufferKey,
    FullParamLayout,
    PerBufferParamLayout,
    group_params_for_buffers,
    megatron_bucketing_for,
    per_buffer_layout,
    update_shape,
)
from optstack.names import named_parameters
from optstack.plan import ParamPlan, Topology, specs_of
from optstack.rules import Attr, Rule, resolve

__all__ = ["DDPConfigAssertion", "DistributedDataParallelConfig", "check_ddp_config", "megatron_bucket_size",
           "megatron_plan"]

_SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass
class DistributedDataParallelConfig:
    """Configuration of ``DistributedDataParallel``: Megatron Core's field names, order, defaults and meaning
    (module docstring). Mutable, as Megatron's: checked at construction and again by the wrapper, which keeps
    its own copy."""

    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    align_param_gather: bool = False
    use_distributed_optimizer: bool = False
    num_distributed_optimizer_instances: int = 1
    check_for_nan_in_grad: bool = False
    check_for_large_grads: bool = False
    bucket_size: int | None = None
    num_buckets: int | None = None
    pad_buckets_for_high_nccl_busbw: bool = False
    reduce_scatter_with_fp32_accumulation: bool = False
    param_name_patterns_for_fp32_local_accumulation: tuple[str, ...] = ()
    average_in_collective: bool = False
    fp8_param_gather: bool = False
    fp4_param_gather: bool = False
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    use_megatron_fsdp: bool = False
    use_custom_fsdp: bool = False
    data_parallel_sharding_strategy: str = "no_shard"
    gradient_reduce_div_fusion: bool = True
    suggested_communication_unit_size: int | None = None
    preserve_fp32_weights: bool = True
    keep_fp8_transpose_cache: bool = False
    nccl_ub: bool = False
    fsdp_double_buffer: bool = False
    outer_dp_sharding_strategy: str = "no_shard"
    disable_symmetric_registration: bool = False
    delay_wgrad_compute: bool = False

    def __post_init__(self) -> None:
        check_ddp_config(self)


class DDPConfigAssertion(ValueError, AssertionError):
    """An invalid ``DistributedDataParallelConfig`` combination that Megatron asserts against (an
    ``AssertionError`` too, for its callers)."""


# (field, the only supported value, why / what to do instead)
_FIXED_FIELDS: tuple[tuple[str, object, str], ...] = (
    ("align_param_gather", False,
     "parameter gathers are launched by the optimizer step, not by a pipeline schedule; set it False"),
    ("check_for_large_grads", False, "the large-gradient check is not implemented; set it False"),
    ("reduce_scatter_with_fp32_accumulation", False,
     "use grad_reduce_in_fp32=True to accumulate and reduce gradients in fp32"),
    ("fp8_param_gather", False, "FP8 parameters are not implemented; set it False"),
    ("fp4_param_gather", False, "FP4 parameters are not implemented; set it False"),
    ("reuse_grad_buf_for_mxfp8_param_ag", False, "MXFP8 parameters are not implemented; set it False"),
    ("nccl_ub", False, "NCCL user-buffer registration is not implemented; set it False"),
    ("delay_wgrad_compute", False, "delayed weight-gradient computation is not implemented; set it False"),
)
_BOOL_FIELDS = ("use_megatron_fsdp", "use_custom_fsdp", "grad_reduce_in_fp32", "overlap_grad_reduce",
                "overlap_param_gather", "use_distributed_optimizer", "check_for_nan_in_grad", "average_in_collective",
                "pad_buckets_for_high_nccl_busbw")


# With use_megatron_fsdp=True (FSDP2 underneath, optstack.megatron.fsdp): (field, the only supported value, why).
_FSDP_FIXED_FIELDS: tuple[tuple[str, object, str], ...] = (
    ("outer_dp_sharding_strategy", "no_shard",
     "HSDP's outer level replicates (set num_distributed_optimizer_instances for the number of replicas)"),
    ("check_for_nan_in_grad", False, "FSDP2 reduces gradients inside backward, before a check could run; set it "
     "False and rely on the optimizer's non-finite check"),
    ("preserve_fp32_weights", True, "optstack's optimizer always keeps fp32 master weights for bf16/fp16 "
     "parameters; set it True"),
    ("fsdp_double_buffer", False, "FSDP2 manages its own communication buffers; set it False"),
    ("keep_fp8_transpose_cache", False, "FP8 parameters are not implemented; set it False"),
)
_FSDP_STRATEGIES = ("no_shard", "optim_grads", "optim_grads_params")


def _check_fsdp_config(config: DistributedDataParallelConfig) -> None:
    """The fields ``use_megatron_fsdp=True`` reads, as FSDP2 can carry them out (module docstring of
    ``optstack.megatron.fsdp``)."""
    strategy = config.data_parallel_sharding_strategy
    if strategy not in _FSDP_STRATEGIES:
        raise ValueError(
            f"DistributedDataParallelConfig.data_parallel_sharding_strategy={strategy!r} is not supported with "
            f"use_megatron_fsdp=True (FSDP2 shards gradients with the optimizer state); use 'optim_grads' or "
            f"'optim_grads_params', or for 'optim' (ZeRO-1) DistributedDataParallel with "
            f"use_megatron_fsdp=False, use_distributed_optimizer=True")
    for field, allowed, why in _FSDP_FIXED_FIELDS:
        value = getattr(config, field)
        if value != allowed:
            raise ValueError(f"DistributedDataParallelConfig.{field}={value!r} is not supported with "
                             f"use_megatron_fsdp=True: {why}")


def check_ddp_config(config: DistributedDataParallelConfig) -> None:
    """Raise a ``ValueError`` naming the first field of ``config`` that is invalid or unsupported."""
    for field in _BOOL_FIELDS:
        value = getattr(config, field)
        if not isinstance(value, bool):
            raise ValueError(f"DistributedDataParallelConfig.{field} must be True or False, got {value!r}")
    if config.use_custom_fsdp and not config.use_megatron_fsdp:
        raise ValueError("DistributedDataParallelConfig.use_custom_fsdp=True is not supported alone: it is "
                         "Megatron's deprecated name; set use_megatron_fsdp=True (Megatron sets both)")
    for field, allowed, fix in _FIXED_FIELDS:
        value = getattr(config, field)
        if value != allowed or type(value) is not type(allowed):
            raise ValueError(f"DistributedDataParallelConfig.{field}={value!r} is not supported by optstack; "
                             f"{fix}")
    size = config.bucket_size
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(
            f"DistributedDataParallelConfig.bucket_size must be None (Megatron's default size) or a number of "
            f"elements >= 1, got {size!r}"
        )
    for field in ("data_parallel_sharding_strategy", "outer_dp_sharding_strategy"):
        value = getattr(config, field)
        if value not in _SHARDING_STRATEGIES:
            raise ValueError(f"DistributedDataParallelConfig.{field}={value!r}; allowed: "
                             f"{list(_SHARDING_STRATEGIES)}")
    if config.use_megatron_fsdp:
        _check_fsdp_config(config)
    instances = config.num_distributed_optimizer_instances
    if isinstance(instances, bool) or not isinstance(instances, int) or instances < 1:
        raise ValueError(f"DistributedDataParallelConfig.num_distributed_optimizer_instances must be an int >= 1, "
                         f"got {instances!r}")
    if instances > 1 and not config.use_distributed_optimizer:
        raise ValueError("DistributedDataParallelConfig.num_distributed_optimizer_instances > 1 needs "
                         "use_distributed_optimizer=True (a partial distributed optimizer)")
    buckets = config.num_buckets
    if buckets is not None:  # Megatron's assertions
        if config.bucket_size is not None:
            raise DDPConfigAssertion("DistributedDataParallelConfig: cannot specify both num_buckets and "
                                     "bucket_size; set one of them")
        if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 1:
            raise DDPConfigAssertion(f"DistributedDataParallelConfig.num_buckets must be an int greater than 0, "
                                     f"got {buckets!r}")
    if config.param_name_patterns_for_fp32_local_accumulation and config.grad_reduce_in_fp32:  # Megatron's
        raise DDPConfigAssertion("DistributedDataParallelConfig.param_name_patterns_for_fp32_local_accumulation "
                                 "is only needed when grad_reduce_in_fp32 is False")


def megatron_bucket_size(config: DistributedDataParallelConfig, *, dp_size: int, bucketing: bool,
                         num_parameters: int = 0) -> int | None:
    """Elements per bucket as Megatron chooses them: None (one bucket per buffer) without ``overlap_grad_reduce``
    or ``bucketing`` (``disable_bucketing``, a pipeline stage after the first); ``num_parameters // num_buckets``
    (Megatron's training script counts the model chunks' parameters; here the wrapped module's); else
    ``bucket_size``, whose default max(40M, 1M x dp) keeps each rank's part large enough to be bandwidth-bound."""
    if not bucketing or not config.overlap_grad_reduce:
        return None
    if config.num_buckets is not None:
        return max(1, num_parameters // config.num_buckets)  # 0 elements: every parameter closes its bucket
    if config.bucket_size is None:
        return max(40_000_000, 1_000_000 * dp_size)
    return config.bucket_size


def _instance_groups(dp: Comm | NullComm, instances: int, intra: Any, inter: Any
                     ) -> tuple[Comm | NullComm | None, Comm | NullComm | None]:
    """This rank's distributed-optimizer instance (Megatron's intra partial data-parallel group: ``instances`` runs
    of consecutive data-parallel ranks) and the ranks holding its shard in the other instances (the inter-instance
    group), or the given ``intra_dp_cp`` / ``inter_dist_opt`` groups. (None, None) for one instance. Collective
    over the world when it creates the groups."""
    if instances == 1:
        return None, None
    if dp.size % instances:
        raise ValueError(f"DistributedDataParallelConfig.num_distributed_optimizer_instances={instances} must divide "
                         f"the data-parallel size {dp.size}")
    if (intra is None) != (inter is None):
        raise ValueError("pg_collection: with num_distributed_optimizer_instances > 1 set both intra_dp_cp (this "
                         "rank's instance) and inter_dist_opt (the ranks holding its shard in each instance), or "
                         "neither (optstack then builds them from the data-parallel group)")
    if intra is not None:
        return Comm(intra, name="intra_dp"), Comm(inter, name="inter_dist_opt")
    size = dp.size // instances
    everyone = sorted({tuple(r) for r in world_comm("intra-dp").all_gather_object(list(dp.global_ranks))})
    intra_lists = [ranks[i * size:(i + 1) * size] for ranks in everyone for i in range(instances)]
    inter_lists = [ranks[j::size] for ranks in everyone for j in range(size)]
    return new_subgroups(intra_lists, name="intra_dp"), new_subgroups(inter_lists, name="inter_dist_opt")


def fp32_local_accumulation(module: nn.Module, patterns: tuple[str, ...]) -> dict[str, torch.dtype]:
    """Megatron's ``param_name_patterns_for_fp32_local_accumulation``: {name: float32} for the trainable
    parameters whose name (the wrapped module's, as Megatron matches it) matches a pattern (fnmatch; ``'all'``
    matches every one), keyed by the core's name of the parameter (``optstack.names``)."""
    core_name = {id(p): n for n, p in named_parameters(module)}
    return {core_name[id(p)]: torch.float32 for name, p in module.named_parameters()
            if p.requires_grad and id(p) in core_name
            and any(pat == "all" or fnmatch.fnmatch(name, pat) for pat in patterns)}


def megatron_layout_plan(named: Sequence[tuple[str, torch.Tensor]], ddp_config: Any, topology: Topology, *,
                         bucket_size: int | None, sharded: bool) -> ParamPlan:
    """The core ``ParamPlan`` of the face's buffers for ``named`` parameters (model order), ``ddp_config``
    translated (module docstring). Parameters tagged ``is_managed_by_layer_wise_optimizer`` are planned as Muon's,
    so under the distributed optimizer (``sharded``) they get whole-shard buffers of their own (Megatron's current
    main); the rest as AdamW's (any range of a bucket). Only the layout is used: the optimizers plan their stages."""
    config = OptimizerConfig(algorithm="adamw", distributed=DistributedConfig(
        sharding="zero1" if sharded else "replicated", whole_matrices="whole_shards",
        overlap_grad_reduce=bool(getattr(ddp_config, "overlap_grad_reduce", False)),
        average_in_collective=bool(getattr(ddp_config, "average_in_collective", False))))
    rules = [Rule(Attr("is_managed_by_layer_wise_optimizer"), algorithm="muon",
                  why="tag_params_for_buffer_routing: the layer-wise optimizer's")]
    bucketing = megatron_bucketing_for(named, distributed_optimizer=sharded,
                                       high_nccl_busbw=bool(getattr(ddp_config, "pad_buckets_for_high_nccl_busbw",
                                                                    False)))
    fp32 = bool(getattr(ddp_config, "grad_reduce_in_fp32", False))
    specs = [dataclasses.replace(s, update_shape=update_shape(p)) for s, (_, p) in zip(specs_of(named), named,
                                                                                            strict=True)]
    return ParamPlan.build(config, specs, resolve(named, rules), topology, bucketing=bucketing,
                           bucket_size=bucket_size, grad_dtype=torch.float32 if fp32 else None)


def megatron_plan(module: nn.Module, ddp_config: DistributedDataParallelConfig, groups: ParallelGroups, *,
                  bucket_size: int | None, instances: int = 1) -> ParamPlan:
    """The core ``ParamPlan`` of the face's wrapper over ``module`` (``megatron_layout_plan`` on this rank's
    groups)."""
    dp = groups.dp.size
    topology = Topology(dp=dp, rank=groups.dp.rank, instances=instances, ep=max(1, dp // groups.expert_dp.size),
                        tp=groups.tp.size, pp=groups.pp.size)
    return megatron_layout_plan(named_parameters(module), ddp_config, topology, bucket_size=bucket_size,
                                sharded=ddp_config.use_distributed_optimizer)


def compute_full_param_layout(params: Sequence[nn.Parameter], bucket_size: int | None,
                              data_parallel_world_size: int, ddp_config: Any,
                              expert_data_parallel_world_size: int | None = None) -> FullParamLayout:
    """Megatron's ``DistributedOptimizer.compute_full_param_layout`` (and ``LayerWiseDistributedOptimizer``'s): the
    layout of each buffer of ``params`` (forward order; Megatron's ``group_params_for_buffers``), a view of the
    plan the wrapper is built from, buckets split across ``data_parallel_world_size`` ranks (experts, planned
    apart: ``expert_data_parallel_world_size``). Tagged parameters (``is_managed_by_layer_wise_optimizer``) lie
    each whole inside one rank's shard."""
    groups = group_params_for_buffers([p for p in params if p.requires_grad],
                                      bool(getattr(ddp_config, "grad_reduce_in_fp32", False)))
    layouts: dict[BufferKey, PerBufferParamLayout] = {}
    for expert in (False, True):
        position = {id(p): (key, i) for key, (ps, idx) in groups.items() if key.is_expert_parallel == expert
                    for p, i in zip(ps, idx, strict=True)}
        if not position:
            continue
        dp = (expert_data_parallel_world_size or data_parallel_world_size) if expert else data_parallel_world_size
        ordered = [p for p in params if id(p) in position]
        named = [(str(i), p) for i, p in enumerate(ordered)]
        plan = megatron_layout_plan(named, ddp_config, Topology(dp=dp), bucket_size=bucket_size, sharded=True)
        by_name = dict(named)
        for planned in plan.buffers:
            backward = [by_name[n] for n in planned.names]
            key = position[id(backward[0])][0]
            if any(position[id(p)][0] != key for p in backward):  # the plan's buffers are Megatron's groups
                raise AssertionError(f"compute_full_param_layout: a planned buffer mixes Megatron's buffer keys "
                                     f"({sorted({str(position[id(p)][0]) for p in backward})})")
            layouts[key] = per_buffer_layout(planned.layout, backward, shards=dp,
                                             indices=[position[id(p)][1] for p in backward])
    return FullParamLayout({key: layouts[key] for key in groups})
