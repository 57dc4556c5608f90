"""Megatron's ``get_megatron_optimizer``: parameters grouped as ``get_param_groups`` groups them, the resolved
settings handed to ``optstack.factory.build_optimizer``, and Megatron's classes over the core chain's stages.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from optstack.algorithms.registry import get_algorithm
from optstack.distributed.comm import world_comm
from optstack.distributed.ddp import DataParallel
from optstack.distributed.parallel import ParallelGroups
from optstack.factory import BuiltOptimizer, algorithm_kwargs, build_optimizer
from optstack.groups import group_map
from optstack.megatron.chained import ChainedOptimizer
from optstack.megatron.config import EMERGING_OPTIMIZERS, OptimizerConfig, to_core
from optstack.megatron.core_chain import _chain_like
from optstack.megatron.ddp import DistributedDataParallel
from optstack.megatron.fsdp import FullyShardedDataParallel
from optstack.megatron.groups import as_chunks, resolve_chunks
from optstack.megatron.keys import (
    ConfigOverrides,
    check_config_overrides_consistency,
    get_standard_config_overrides,
    to_rules,
)
from optstack.megatron.layer_wise_optimizer import LayerWiseDistributedOptimizer, steps_whole
from optstack.megatron.norm_groups import norm_group_kwargs
from optstack.megatron.optimizers import (
    DistributedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
)
from optstack.megatron.process_groups import ProcessGroupCollection, check_optimizer_groups
from optstack.megatron.torch_optimizers import Lion
from optstack.rules import Ndim, Predicate, Rule, muon_routing_rule

__all__ = ["get_megatron_optimizer", "get_megatron_muon_optimizer"]


def get_megatron_optimizer(
    config: OptimizerConfig,
    model_chunks: nn.Module | Sequence[nn.Module],
    config_overrides: ConfigOverrides | None = None,
    use_gloo_process_groups: bool = True,
    pg_collection: Any = None,
    dump_param_to_param_group_map: str | None = None,
) -> ChainedOptimizer:
    """Build the optimizer for the model chunks, with Megatron Core's semantics.

    Args:
        config: the Megatron ``OptimizerConfig``. ``lr=None`` builds, with every group's ``lr`` None until a
            scheduler sets it (a step before is a ``ValueError``). bf16/fp16 parameters with ``bf16=False`` and
            ``fp16=False`` are stepped through fp32 masters (Megatron steps them in their own dtype).
        model_chunks: the model chunks (or one module).
        config_overrides: ``{ParamKey: ParamGroupOverride}``; None means the standard overrides, ``{}`` none.
            They may not change ``optimizer``, ``optimizer_cpu_offload`` or
            ``overlap_param_gather_with_optimizer_step``. For Muon, matrices Muon cannot take go to
            ``muon_scalar_optimizer`` as in Megatron. The caller's dict is not modified.
        use_gloo_process_groups: optstack's communicator needs no extra groups; with a
            ``ProcessGroupCollection`` it must be False, as in Megatron.
        pg_collection: None, a Megatron ``ProcessGroupCollection`` (Megatron's checks: ``dp``, ``expt_dp``,
            ``intra_dist_opt``, ``mp`` and ``tp_ep_pp`` set; its data-parallel group must be the wrapped
            model's), or the optstack ``ParallelGroups`` the ``DistributedDataParallel`` model was built with
            (the optimizer always uses the wrapped model's groups).
        dump_param_to_param_group_map: a file path; the parameter name -> index into
            ``optimizer.param_groups`` map is written there as JSON (by rank 0, all ranks' names).

    Returns:
        A ``ChainedOptimizer`` (``LayerWiseDistributedOptimizer`` for the layer-wise optimizer) over one
        Megatron optimizer per algorithm and kind: ``DistributedOptimizer`` (``use_distributed_optimizer``),
        ``Float16OptimizerWithFloat16Params`` (bf16/fp16) or ``FP32Optimizer``; expert parameters
        (``allreduce=False``) get their own, chained with the dense one (one grad norm, one skip decision).
        ``.built`` is optstack's ``BuiltOptimizer`` (its ``param_groups`` carry the parameter names).

    Data parallelism: pass the model wrapped in ``optstack.megatron.DistributedDataParallel`` (one chunk), whose
    buckets and gradient dtype are used. ``use_distributed_optimizer`` builds ZeRO-1 over its buffers,
    ``use_layer_wise_distributed_optimizer`` (or ``'dist_muon'``) the layer-wise optimizer; otherwise every rank
    steps whole parameters on all-reduced gradients (also over a wrapper built for the distributed optimizer,
    where Megatron would step gradients reduced only in each rank's shard). ``step()`` finishes the gradient sync
    if the loop did not; ``zero_grad()`` zeroes the wrapper's buffers.

    Raises:
        ValueError: an unsupported config value, an override changing a protected field, conflicting
            overrides, a ``pg_collection`` that is not the wrapped model's groups, a distributed optimizer
            asked for without a wrapped model, or an optimizer config disagreeing with the wrapper's
            ``DistributedDataParallelConfig`` (``use_distributed_optimizer``, ``overlap_param_gather``).
    """
    if not isinstance(config, OptimizerConfig):
        raise ValueError(
            f"config must be an optstack.megatron.OptimizerConfig, got {type(config).__name__}"
        )
    if isinstance(pg_collection, ProcessGroupCollection):
        check_optimizer_groups(pg_collection, use_gloo_process_groups)
    if config_overrides is None:
        config_overrides = get_standard_config_overrides(config)
    check_config_overrides_consistency(config, config_overrides)
    chunks = as_chunks(model_chunks)
    # lr=None (Megatron's default; its training script's scheduler sets every group's lr before the first
    # step): build with a placeholder, then leave lr None in the groups so a step before it is set is an error.
    core_config = to_core(_with_model_precision(
        config if config.lr is not None else dataclasses.replace(config, lr=0.0), chunks))
    rules = to_rules(config, config_overrides)
    whole = _whole_shard_wrapper(config, chunks)
    if config.optimizer in EMERGING_OPTIMIZERS:  # Megatron's default overrides: what they cannot take -> Adam
        scalar = core_config.muon.scalar_algorithm
        rules.append(muon_routing_rule(scalar))
    if config.optimizer == "soap":
        rules.append(Rule(Ndim(eq=3), algorithm=scalar, why="SOAP preconditions 2-D matrices"))
    elif core_config.algorithm in ("muon", "adaptive_muon"):
        rules.append(Rule(Predicate(_muon_excluded, "use_muon=False"), algorithm=scalar,
                          why="excluded from Muon (use_muon=False)"))
        if whole is not None:  # Muon steps exactly what the wrapper laid out whole (its tags)
            rules.append(Rule(Predicate(_not_in_whole_shards, "not is_managed_by_layer_wise_optimizer"),
                              algorithm=scalar, why="not in the layer-wise optimizer's whole-shard buffers"))
    if whole is not None:
        # Muon's matrices are stepped whole from each owner's reduce-scatter shard, the rest by range: the core's
        # ZeRO-1 over a wrapper with whole-shard buffers; the buckets' all-gather publishes both
        core_config = dataclasses.replace(core_config, distributed=dataclasses.replace(
            core_config.distributed, sharding="zero1", overlap_param_gather=config.overlap_param_gather))
    _check_data_parallel(config, chunks, pg_collection)
    if any(isinstance(c, FullyShardedDataParallel) for c in chunks) and core_config.distributed.sharding == "zero1":
        # FSDP2 already shards: the DTensor placement steps each rank's shard (Megatron's distributed optimizer).
        core_config = dataclasses.replace(core_config, distributed=dataclasses.replace(
            core_config.distributed, sharding="replicated", overlap_param_gather=False))
    _, resolved = resolve_chunks(chunks, rules)  # Megatron's matching, on each chunk's own names
    built = build_optimizer(core_config, chunks, resolved=resolved)
    if dump_param_to_param_group_map is not None:
        _dump_group_map(built, dump_param_to_param_group_map)
    return _as_megatron(built, config)


def _muon_excluded(param: torch.Tensor) -> bool:
    """Megatron's exclusion of a matrix from Muon: ``use_muon=False`` (it goes to the scalar optimizer)."""
    return not getattr(param, "use_muon", True)


def _not_in_whole_shards(param: torch.Tensor) -> bool:
    return not getattr(param, "is_managed_by_layer_wise_optimizer", False)


def _whole_shard_wrapper(config: OptimizerConfig, chunks: list[nn.Module]) -> DistributedDataParallel | None:
    """The wrapper laid out for the layer-wise optimizer (``wrap_model_chunks_with_ddp``: distributed optimizer,
    tagged matrices in whole-shard buffers) when ``config`` asks for the layer-wise optimizer, else None."""
    if not (config.use_layer_wise_distributed_optimizer or config.optimizer == "dist_muon"):
        return None
    for chunk in chunks:
        if isinstance(chunk, DistributedDataParallel) and chunk.shard_grads and any(
                b.key.whole for b in chunk.param_and_grad_buffers):
            return chunk
    return None


def _with_model_precision(config: OptimizerConfig, chunks: list[nn.Module]) -> OptimizerConfig:
    """Megatron builds bf16/fp16 parameters with ``bf16=False, fp16=False`` (an fp32-configured optimizer over
    them); optstack steps them through fp32 masters, so the core config takes the parameters' dtype."""
    if config.fp16 or config.bf16:
        return config
    dtypes = {p.dtype for c in chunks for p in c.parameters() if p.requires_grad}
    if torch.bfloat16 in dtypes and torch.float16 not in dtypes:  # fp16 would need a loss scaler: say so
        return dataclasses.replace(config, bf16=True)
    return config


def _as_megatron(built: BuiltOptimizer, config: OptimizerConfig) -> ChainedOptimizer:
    """Megatron's classes over the core chain's stages: one Megatron optimizer per stage, chained."""
    chain = built.optimizer
    norm_groups = norm_group_kwargs(p for s in chain.stages for g in s.param_groups for p in g["params"])
    if norm_groups:  # MTP parameters: the same chain, their gradients clipped by their group's own norm
        chain = _chain_like(chain, chain.stages, norm_type=chain.norm_type, defaults=chain.defaults, **norm_groups)
        built = dataclasses.replace(built, optimizer=chain)
    members: list[MegatronOptimizer] = []
    for stage in chain.stages:
        kind = stage.placement.kind
        cls = (DistributedOptimizer if kind == "zero1" and not steps_whole(stage) else
               Float16OptimizerWithFloat16Params if stage.precision.masters else FP32Optimizer)
        members.append(cls._over(stage, config, chain,
                                 megatron_fp32=stage.precision.masters and not (config.bf16 or config.fp16)))
    if config.lr is None:
        for member in members:
            for group in member.param_groups:
                group["lr"] = None  # the placeholder must not train: set by the scheduler
                if group.get("max_lr") == 0.0 and not group.get("is_decoupled_lr"):
                    group["max_lr"] = None
    layer_wise = any(s.placement.kind == "layerwise" for s in chain.stages)
    whole = [m for m in members if steps_whole(m._stage)]
    if whole:
        # Megatron's current main over a wrapper laid out for it: the layer-wise optimizer holds Muon's whole-shard
        # matrices, a distributed optimizer the rest, chained (one norm, one clip, one skip)
        rest = [m for m in members if m not in whole]
        lw = LayerWiseDistributedOptimizer._of_members(whole, config)
        out = ChainedOptimizer([lw, *rest]) if rest else lw
    elif layer_wise:
        out = LayerWiseDistributedOptimizer._of_members(members, config)
    else:
        out = ChainedOptimizer(members)
    # overlap_param_gather rebuilds the layer-wise stages (LayerWiseDistributedOptimizer): built names the chain stepped
    out.built = built if out._chain is chain else dataclasses.replace(built, optimizer=out._chain)
    return out


def _get_megatron_optimizer_based_on_param_groups(
    config: OptimizerConfig, model_chunks: Sequence[nn.Module], param_groups: list[dict[str, Any]],
    per_model_buffers: Any = None, model_parallel_group: Any = None, data_parallel_group: Any = None,
    data_parallel_group_gloo: Any = None, data_parallel_group_idx: int | None = None,
    intra_dist_opt_group: Any = None, distributed_optimizer_instance_id: int | None = 0,
    pg_collection: Any = None, skip_megatron_wrapping: bool = False,
) -> MegatronOptimizer | tuple[torch.optim.Optimizer | None, Any]:
    """Megatron's one-optimizer builder over ``param_groups`` (Megatron's group dicts, one algorithm): the torch
    optimizer ``config.optimizer`` names (optstack's kernels: AdamW / Adam, SGD, Lion), wrapped as
    ``DistributedOptimizer`` (``use_distributed_optimizer``, over the one ``DistributedDataParallel`` chunk),
    ``Float16OptimizerWithFloat16Params`` (fp16 / bf16) or ``FP32Optimizer``; ``skip_megatron_wrapping``
    returns ``(torch optimizer, None)``. The process-group arguments are the wrapped model's in optstack.

    Raises:
        ValueError: ``optimizer='muon'`` / ``'dist_muon'`` (build Muon with ``get_megatron_optimizer``) or
            ``optimizer_cpu_offload`` (use ``get_megatron_optimizer`` or ``HybridDeviceOptimizer``).
    """
    if config.optimizer in ("muon", "dist_muon") or config.optimizer_cpu_offload:
        what = "optimizer_cpu_offload=True" if config.optimizer_cpu_offload else f"optimizer={config.optimizer!r}"
        raise ValueError(f"_get_megatron_optimizer_based_on_param_groups: {what} is built by "
                         "get_megatron_optimizer(config, model_chunks) in optstack")
    core_config = to_core(config if config.lr is not None else dataclasses.replace(config, lr=0.0))
    optimizer = None
    # Lion as Megatron builds it: Emerging-Optimizers' class (the face's, on optstack's kernel), its state made
    # by init_state_fn before a load
    lion = config.optimizer == "lion"
    if param_groups:
        cls = Lion if lion else get_algorithm(core_config.algorithm).cls
        optimizer = cls(param_groups, **algorithm_kwargs(core_config.algorithm, core_config))
    if skip_megatron_wrapping:
        return optimizer, None
    init_state_fn = _lion_init_state if lion else None
    scaler = core_config.loss_scale.build(core_config.precision)
    if config.use_distributed_optimizer:
        return DistributedOptimizer(optimizer, config, scaler, init_state_fn, model_chunks=list(model_chunks))
    if config.fp16 or config.bf16:
        return Float16OptimizerWithFloat16Params(optimizer, config, scaler, init_state_fn)
    return FP32Optimizer(optimizer, config, init_state_fn)


def _lion_init_state(optimizer: torch.optim.Optimizer, config: Any = None) -> None:
    """Megatron's Lion ``init_state_fn``: every parameter's ``exp_avg``, zero, in the parameter's dtype."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                optimizer.state[p]["exp_avg"] = torch.zeros_like(p.data)


def get_megatron_muon_optimizer(*args: Any, layer_wise_distributed_optimizer: bool = False,
                                **kwargs: Any) -> ChainedOptimizer:
    """Megatron's deprecated Muon getter: ``get_megatron_optimizer`` with the same arguments.

    Raises:
        ValueError: ``layer_wise_distributed_optimizer=True`` with an optimizer name not starting with
            ``dist_`` (Megatron's rule: the layer-wise optimizer is named ``dist_muon`` there).
    """
    config = kwargs["config"] if "config" in kwargs else args[0]
    if layer_wise_distributed_optimizer and not config.optimizer.startswith("dist_"):
        raise ValueError("Layer-wise distributed optimizer is enabled by dist_ prefix in optimizer name "
                         "(OptimizerConfig(optimizer='dist_muon'))")
    return get_megatron_optimizer(*args, **kwargs)


def _check_data_parallel(config: OptimizerConfig, chunks: list[nn.Module], pg_collection: Any) -> None:
    """The optimizer config must agree with how the model was wrapped (Megatron's training script derives
    both configs from the same arguments; here they are built separately, so say which one to change)."""
    wrapped = [c for c in chunks if isinstance(c, DataParallel)]
    if isinstance(pg_collection, ProcessGroupCollection):
        _check_same_dp(pg_collection, wrapped)
    elif pg_collection is not None and not (
        isinstance(pg_collection, ParallelGroups) and any(c.groups is pg_collection for c in wrapped)
    ):
        raise ValueError(
            "get_megatron_optimizer(pg_collection=...) must be None, a ProcessGroupCollection, or the optstack "
            "ParallelGroups the DistributedDataParallel model was built with (the optimizer uses the wrapped "
            "model's groups); "
            f"got {type(pg_collection).__name__}; pass pg_collection=None"
        )
    layer_wise = config.use_layer_wise_distributed_optimizer or config.optimizer == "dist_muon"
    if any(isinstance(c, FullyShardedDataParallel) for c in chunks):
        if layer_wise:
            raise ValueError("the layer-wise distributed optimizer needs DistributedDataParallel; over a "
                             "FullyShardedDataParallel model use optimizer='muon' (DTensor Muon gathers each matrix)")
        return  # FSDP2 DTensor parameters: the DTensor placement is the distributed optimizer
    if not wrapped and (config.use_distributed_optimizer or layer_wise):
        field = "use_distributed_optimizer" if config.use_distributed_optimizer else (
            "use_layer_wise_distributed_optimizer" if config.use_layer_wise_distributed_optimizer
            else "optimizer='dist_muon'")
        want = config.use_distributed_optimizer
        raise ValueError(
            f"OptimizerConfig.{field} needs the model wrapped for data parallelism: model = "
            f"optstack.megatron.DistributedDataParallel(transformer_config, DistributedDataParallelConfig("
            f"use_distributed_optimizer={want}), model), then get_megatron_optimizer(config, [model])"
        )
    for ddp in (c for c in wrapped if isinstance(c, DistributedDataParallel)):
        ddp_config = ddp.ddp_config
        # A non-distributed optimizer over a wrapper built for the distributed one: Megatron steps the wrapper's
        # gradients as they are (only each rank's shard reduced); here the core has the wrapper all-reduce them.
        # The layer-wise optimizer over a wrapper laid out for it (whole-shard buffers) steps reduce-scattered
        # shards, as Megatron's current main does.
        laid_out = layer_wise and any(b.key.whole for b in ddp.param_and_grad_buffers)
        if ddp_config.use_distributed_optimizer != config.use_distributed_optimizer and not (
                ddp_config.use_distributed_optimizer and (not layer_wise or laid_out)):
            why = (" (the layer-wise optimizer needs whole reduced gradients, or a wrapper laid out for it: build "
                   "it with use_distributed_optimizer=False, or with wrap_model_chunks_with_ddp(..., "
                   "use_layer_wise_distributed_optimizer=True))" if layer_wise else "; set both the same")
            raise ValueError(
                f"OptimizerConfig.use_distributed_optimizer={config.use_distributed_optimizer} but the model's "
                f"DistributedDataParallelConfig.use_distributed_optimizer={ddp_config.use_distributed_optimizer}"
                f"{why}"
            )
        if ddp_config.overlap_param_gather != config.overlap_param_gather:
            raise ValueError(
                f"OptimizerConfig.overlap_param_gather={config.overlap_param_gather} but the model's "
                f"DistributedDataParallelConfig.overlap_param_gather={ddp_config.overlap_param_gather}; "
                "set both the same"
            )


def _check_same_dp(pg_collection: ProcessGroupCollection, wrapped: list[DataParallel]) -> None:
    """The optimizer steps over the wrapped model's groups: a collection naming another data-parallel group
    would be silently ignored, so it is an error."""
    group = pg_collection.dp_cp if pg_collection.dp_cp is not None else pg_collection.dp
    if not wrapped or group is None or not torch.distributed.is_initialized():
        return
    ranks = list(torch.distributed.get_process_group_ranks(group))
    for ddp in wrapped:
        if list(ddp.groups.dp.global_ranks) != ranks:
            raise ValueError(
                f"pg_collection's data-parallel group has ranks {ranks} but the DistributedDataParallel model "
                f"reduces over {list(ddp.groups.dp.global_ranks)}; build the model with the same "
                "pg_collection (DistributedDataParallel(..., pg_collection=pg_collection))")


def _dump_group_map(built: BuiltOptimizer, path: str) -> None:
    """Write ``{parameter name: index into optimizer.param_groups}`` as JSON, atomically, from rank 0."""
    local = group_map(built.optimizer.param_groups)["param_to_group"]
    comm = world_comm()
    merged: dict[str, int] = {}
    for rank_map in comm.all_gather_object(local):
        merged.update(rank_map)
    if comm.rank != 0:
        return
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".param_groups.", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(merged, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
