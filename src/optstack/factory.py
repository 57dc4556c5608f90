"""``build_optimizer``: config + model chunk(s) + rules -> the optimizer stack, and nothing more.

names -> rules -> deterministic groups -> one stage per (algorithm, dense/expert) -> one chained optimizer
(the one loss scaler, global clipping, the skip decision); plus the scheduler when a schedule is given.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from optstack.algorithms import get_algorithm
from optstack.config import OptimizerConfig, check_combination, dtype_from_name
from optstack.distributed.comm import Comm, NullComm, is_initialized, world_comm
from optstack.distributed.ddp import DataParallel, check_launched_world, unwrapped_use_error, wrapper_holding
from optstack.distributed.group_keys import union_group_keys
from optstack.distributed.parallel import ParallelGroups
from optstack.groups import build_param_groups, group_keys, group_map
from optstack.hf_trainer import warn_if_trainer_clips_too
from optstack.names import NamedParams, named_parameters
from optstack.optimizer import ChainedOptimizer
from optstack.plan import ParamPlan, Topology, specs_of
from optstack.rules import Resolved, Rule, check_names_available, muon_routing_rule, mup_rules, resolve, standard_rules
from optstack.schedule import LRSchedule, Scheduler, WDSchedule
from optstack.stage import (
    Direct,
    Masters,
    Precision,
    Remainders,
    Stage,
    layerwise_stage,
    owners_stage,
    replicated_stage,
    zero1_stage,
)
from optstack.stage.dtensor import check_dtensor_params, dtensor_stage, is_dtensor

__all__ = ["BuiltOptimizer", "algorithm_kwargs", "build_optimizer", "default_rules", "topology_of",
           "wrap_data_parallel"]

GradOf = Callable[[torch.Tensor], torch.Tensor | None]


def default_rules(config: OptimizerConfig) -> list[Rule]:
    """The rules ``build_optimizer`` uses when none are given: standard (no weight decay on biases and
    norms, decoupled embedding/output LR), MuP when ``mup_width_mult != 1``, and Muon's routing of the
    parameters it cannot take to its scalar optimizer. Extend it: ``default_rules(cfg) + [my_rule]``."""
    decoupled = {"decoupled_lr": config.decoupled_lr, "decoupled_min_lr": config.decoupled_min_lr}
    rules = standard_rules(**decoupled, apply_wd_to_qk_layernorm=config.apply_wd_to_qk_layernorm)
    family = get_algorithm(config.algorithm).family
    if config.mup_width_mult != 1.0:
        rules += mup_rules(
            config.mup_width_mult, family=family if family in ("adam", "sgd", "muon", "lion") else "adam",
            lr=config.lr, min_lr=config.min_lr, eps=config.adam.eps if family == "adam" else None, **decoupled,
        )
    if get_algorithm(config.algorithm).capabilities.whole_matrices:
        rules.append(muon_routing_rule(config.muon.scalar_algorithm))
    return rules


def algorithm_kwargs(name: str, config: OptimizerConfig) -> dict[str, Any]:
    """Constructor keyword arguments of the algorithm ``name`` taken from ``config`` (``AlgorithmSpec.kwargs``)."""
    return get_algorithm(name).kwargs(config)


def wrap_data_parallel(
    config: OptimizerConfig, model: nn.Module, *, groups: ParallelGroups | None = None,
    rules: Sequence[Rule] | None = None,
) -> DataParallel:
    """Wrap ``model`` for data-parallel training as ``config.distributed`` says (bucket size, grad dtype,
    overlapped reduction; sharded gradients for ZeRO-1). ``groups`` defaults to the whole initialised
    world as data-parallel (a single process without torch.distributed works too).

    The buffers are laid out by a ``ParamPlan`` of ``config`` and ``rules`` (default ``default_rules(config)``;
    pass the ones ``build_optimizer`` gets), kept as ``ddp.plan``. Under ZeRO-1 it decides whether the matrices
    of a whole-matrix algorithm (Muon) lie whole in their owners' reduce-scatter shards or are gathered by
    owners from ordinary shards (``optstack.plan``; ``optstack plan`` shows the choice and why)."""
    d = config.distributed
    named = named_parameters(model)
    _refuse_dtensor(named, "wrap_data_parallel")
    if groups is None:
        check_launched_world("wrap_data_parallel")
        groups = ParallelGroups.from_world() if is_initialized() else ParallelGroups.single()
    grad_dtype = dtype_from_name(d.grad_dtype, "distributed.grad_dtype") if d.grad_dtype else None
    resolved = resolve(named, default_rules(config) if rules is None else rules)
    plan = ParamPlan.build(config, specs_of(named), resolved, topology_of(groups), grad_dtype=grad_dtype)
    return DataParallel(
        model,
        groups=groups,
        bucket_size=plan.bucket_size,
        grad_dtype=grad_dtype,
        overlap_grad_reduce=d.overlap_grad_reduce,
        shard_grads=d.sharding == "zero1",
        average=d.average_in_collective,
        plan=plan,
    )


def topology_of(groups: ParallelGroups) -> Topology:
    """The ``Topology`` (numbers) of live process groups."""
    dp = groups.dp.size
    return Topology(dp=dp, rank=groups.dp.rank, ep=max(1, dp // groups.expert_dp.size), tp=groups.tp.size,
                    pp=groups.pp.size)


@dataclass(frozen=True)
class BuiltOptimizer:
    """What ``build_optimizer`` returns.

    Attributes:
        optimizer: the chained optimizer (``step() -> StepResult``, ``zero_grad``, ``state_dict``, ...).
        scheduler: the LR/WD scheduler over the optimizer's groups, or None when no schedule was given.
        param_groups: the model-side groups (params, param_names, settings) the stages were built from.
    """

    optimizer: ChainedOptimizer
    scheduler: Scheduler | None
    param_groups: list[dict[str, Any]]

    def group_of(self) -> dict[str, int]:
        """Parameter name -> index of its group in ``param_groups`` (``groups.group_map``)."""
        return group_map(self.param_groups)["param_to_group"]


def build_optimizer(
    config: OptimizerConfig,
    model_chunks: NamedParams,
    *,
    rules: Sequence[Rule] | None = None,
    resolved: Mapping[str, Resolved] | None = None,
    strict_rules: bool = False,
    lr_schedule: LRSchedule | None = None,
    wd_schedule: WDSchedule | None = None,
    grad_of: GradOf | None = None,
) -> BuiltOptimizer:
    """Build the optimizer stack for a model.

    Args:
        config: the optimizer configuration.
        model_chunks: the model, its chunks (pipeline stages / virtual chunks), ``model.parameters()`` or
            ``(name, param)`` pairs; parameters are named by ``optstack.names.named_parameters`` (wrappers and
            ``torch.compile`` looked through; bare parameters are ``param.0``, ``param.1``, ...).
        rules: per-parameter rules; None uses ``default_rules(config)``; ``[]`` means no rules at all.
        resolved: instead of ``rules``, settings already resolved for these names (``rules.resolve``, or a
            face with its own name matching, e.g. Megatron's per-chunk names).
        strict_rules: a rule that matches no parameter is an error.
        lr_schedule / wd_schedule: when ``lr_schedule`` is given, a ``Scheduler`` is built (weight decay
            constant at ``config.weight_decay`` unless ``wd_schedule`` is given).
        grad_of: where the stages read each parameter's gradient (default ``param.grad``; ignored when the
            model is an optstack ``DataParallel``, whose grad buffers are read).

    A model wrapped by ``wrap_data_parallel`` gets the distributed stages ``config.distributed.sharding``
    names: replicated, ZeRO-1 (``zero1``) or layer-wise (``layerwise``, for Muon's matrices).

    A model with DTensor parameters (FSDP2's ``fully_shard``, ``parallelize_module``, HSDP) gets DTensor stages
    (``stage/dtensor.py``): each rank steps its local shards, Muon steps whole matrices on owner ranks. Plain
    parameters beside them are taken as replicated (their gradients must agree on every rank, as for torch's
    optimizers). Building is collective over the world.
    """
    check_combination(config)
    check_launched_world("build_optimizer")
    if lr_schedule is not None:
        _check_schedule_agrees(config, lr_schedule)
    if rules is not None and resolved is not None:
        raise ValueError("build_optimizer: pass rules or resolved (settings already resolved), not both")
    if isinstance(model_chunks, torch.Tensor):
        raise TypeError(f"model_chunks must be a model, its chunks or an iterable of parameters, got a single "
                        f"{torch.typename(model_chunks)}; pass [tensor]")
    source = model_chunks if isinstance(model_chunks, nn.Module) else list(model_chunks)  # read iterators once
    named = _with_frozen(source, resolved)
    trainable = [(n, p) for n, p in named if p.requires_grad]
    if not named:
        raise ValueError("the model has no trainable parameters: model_chunks holds none (an iterator read "
                         "already?); pass the model, its chunks or model.parameters()")
    _check_dtypes(trainable or named, config)
    dtensor = any(is_dtensor(p) for _, p in named)
    if dtensor:
        _check_dtensor_model(named, config, source)
    ddp = None if dtensor else _data_parallel_of(source, config)
    if ddp is None and not dtensor and wrapper_holding(named[0][1]) is not None:
        raise ValueError(unwrapped_use_error(named[0][0], "build_optimizer, given the module inside the wrapper,"))
    if ddp is not None or dtensor:
        named = _without_frozen(named, "a DataParallel wrapper" if ddp is not None else "DTensor parameters")
    if resolved is None:
        if rules is not None:
            check_names_available(source, rules, exempt=default_rules(config))
        resolved = resolve(named, default_rules(config) if rules is None else rules, strict=strict_rules,
                           trainable_only=False)
        if dtensor:  # (a face passing `resolved` has its own flags and names)
            _check_flags_survived(source, named, resolved, config)
    keys = group_keys(resolved)
    if ddp is not None or dtensor:
        # Every rank must build the same stages and groups (some possibly empty), e.g. under pipeline
        # parallelism where ranks hold different layers.
        keys = union_group_keys(keys, world_comm("group-keys"))
    groups = build_param_groups(named, resolved, lr=config.lr, min_lr=config.min_lr, keys=keys, trainable_only=False)
    ranks = world_comm("dtensor") if dtensor else None
    if ddp is None:  # a DTensor model's owners are planned over every rank holding a part of it
        topology = Topology(dp=ranks.size, rank=ranks.rank) if ranks is not None else Topology()
    else:  # the wrapper's plan's (its instances), else its groups'
        topology = ddp.plan.topology if ddp.plan is not None else topology_of(ddp.groups)
    # over the wrapper's topology this equals the wrapper's plan when settings and groups do (its digest); when
    # they differ the stages follow what the wrapper holds (_build_stages)
    plan = ParamPlan.build(config, specs_of(named), resolved, topology, keys=keys, wrapped=ddp is not None,
                           dtensor=dtensor)
    optimizer = ChainedOptimizer(
        _build_stages(groups, config, grad_of, ddp, plan, ranks),
        scaler=config.loss_scale.build(config.precision),  # dynamic by default for fp16, else none
        clip_grad=config.clip_grad,
        norm_type=config.norm_type,
        grad_norm_skip_threshold=config.grad_norm_skip_threshold,
        log_num_zeros_in_grad=config.log_num_zeros_in_grad,
        grad_syncs=[ddp] if ddp is not None else [],
    )
    warn_if_trainer_clips_too(optimizer, config.clip_grad)
    if lr_schedule is None and wd_schedule is not None:
        raise ValueError("wd_schedule was given without lr_schedule; pass both (the scheduler sets lr and wd)")
    scheduler = None if lr_schedule is None else Scheduler(
        optimizer, lr_schedule, wd_schedule or WDSchedule.constant(config.weight_decay))
    return BuiltOptimizer(optimizer=optimizer, scheduler=scheduler, param_groups=groups)


def _check_schedule_agrees(config: OptimizerConfig, schedule: LRSchedule) -> None:
    """The schedule's ``max_lr`` / ``min_lr`` equal ``config.lr`` / ``config.min_lr``.

    The groups' peak and floor come from the config (rules scale or replace them per group: ``lr_mult``,
    ``decoupled_lr``, MuP) and the scheduler reads each group's own values, as Megatron's does, so a schedule
    that disagrees with the config would silently run the config's values. Neither can win without surprising
    someone (torch's ``OneCycleLR(max_lr=)`` overrides the optimizer's lr, Megatron's scheduler does not), so a
    disagreement is an error naming both values."""
    differ = [(field, theirs, ours) for field, theirs, ours in (("max_lr", schedule.max_lr, config.lr),
                                                                 ("min_lr", schedule.min_lr, config.min_lr))
              if theirs != ours]
    if differ:
        said = "; ".join(f"LRSchedule.{field}={theirs!r} but OptimizerConfig.{'lr' if field == 'max_lr' else field}="
                         f"{ours!r}" for field, theirs, ours in differ)
        raise ValueError(
            f"the LR schedule disagrees with the config: {said}. The param groups take their peak and floor from "
            "the config (rules scale them per group), so the config's values would run. Give both the same values: "
            f"OptimizerConfig(lr={schedule.max_lr!r}, min_lr={schedule.min_lr!r}, ...) for the schedule's, or "
            f"LRSchedule(max_lr={config.lr!r}, min_lr={config.min_lr!r}, ...) for the config's")

def _with_frozen(source: nn.Module | list[Any], resolved: Mapping[str, Resolved] | None
                 ) -> list[tuple[str, torch.Tensor]]:
    """Every parameter, frozen ones (``requires_grad=False``) included, as torch.optim keeps them: a step
    leaves a parameter without a gradient unchanged and steps it once it has one (gradual unfreezing). With
    ``resolved`` given (a face resolving its own parameters), the parameters it resolved and the trainable ones."""
    named = named_parameters(source, trainable_only=False)
    if resolved is None:
        return named
    return [(n, p) for n, p in named if p.requires_grad or n in resolved]


def _without_frozen(named: list[tuple[str, torch.Tensor]], where: str) -> list[tuple[str, torch.Tensor]]:
    """The trainable parameters, warning about frozen ones left out: a data-parallel wrapper lays out gradient
    buffers (and ZeRO-1 its shards) for the parameters trainable when it was built, and FSDP2 / DTensor models
    reduce only those, so a parameter unfrozen later has nowhere to get its reduced gradient from."""
    frozen = [n for n, p in named if not p.requires_grad]
    if frozen:
        warnings.warn(
            f"build_optimizer: {len(frozen)} parameter(s) with requires_grad=False (e.g. {frozen[:3]}) are left out "
            f"under {where}: their gradients have no place in its reduced buffers. To train them later, unfreeze "
            "them, wrap the model again and build a new optimizer (optstack's DataParallel refuses a changed set of "
            "trainable parameters at the next step); on a single process without a wrapper they are kept and "
            "stepped once they have gradients", UserWarning, stacklevel=3)
    trainable = [(n, p) for n, p in named if p.requires_grad]
    if not trainable:
        raise ValueError(f"the model has no trainable parameters under {where} (every parameter has "
                         "requires_grad=False); unfreeze some before wrapping the model")
    return trainable


def _check_dtypes(named: Sequence[tuple[str, torch.Tensor]], config: OptimizerConfig) -> None:
    """The parameters' dtypes agree with ``config.precision``: no half-precision parameter under fp32 or of the
    other half type, and under bf16/fp16 at least one parameter of that dtype (an fp32 model built with a bf16
    config would train in fp32 with no word; fp32 parameters beside bf16 ones are stepped directly, as in
    Megatron)."""
    halves = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    for name, p in named:
        if p.dtype in halves and halves[p.dtype] != config.precision:
            raise ValueError(
                f"parameter {name!r} is {p.dtype} but config.precision is {config.precision!r}; set precision="
                f"'{halves[p.dtype]}' to train it with fp32 master weights"
            )
    if config.precision != "fp32" and not any(p.dtype in halves for _, p in named):
        name, p = named[0]
        dtype = "torch.bfloat16" if config.precision == "bf16" else "torch.float16"
        raise ValueError(
            f"config.precision is {config.precision!r} but every parameter is {p.dtype} (e.g. {name!r}): the model "
            f"would train in {p.dtype} with no master weights. Convert the model first (model.to({dtype})), or "
            "set precision='fp32'"
        )


def _refuse_dtensor(named: Iterable[tuple[str, torch.Tensor]], what: str) -> None:
    for name, p in named:
        if is_dtensor(p):
            raise ValueError(
                f"{what}: parameter {name!r} is a DTensor (placements {tuple(p.placements)}): the model is already "
                "sharded or replicated by FSDP2 / tensor parallelism, which reduce its gradients; optstack's "
                "data-parallel wrapper is for plain modules. Build the optimizer on the DTensor model directly: "
                "build_optimizer(config, model) with distributed.sharding='replicated'")


def _check_dtensor_model(named: Sequence[tuple[str, torch.Tensor]], config: OptimizerConfig,
                         source: nn.Module | list[Any]) -> None:
    check_dtensor_params(named)
    if any(isinstance(c, DataParallel) for c in ([source] if isinstance(source, nn.Module) else source)):
        _refuse_dtensor(named, "build_optimizer")
    if config.distributed.sharding == "zero1":
        name, p = next((n, p) for n, p in named if is_dtensor(p))
        raise ValueError(
            f"distributed.sharding='zero1' does not apply to DTensor parameters ({name!r} has placements "
            f"{tuple(p.placements)}): FSDP2 already shards them and optstack steps each rank's shard; leave "
            "distributed.sharding='replicated' (Muon steps whole matrices on owner ranks by itself)")


def _check_flags_survived(source: nn.Module | list[Any], named: Sequence[tuple[str, torch.Tensor]],
                          resolved: Mapping[str, Resolved], config: OptimizerConfig) -> None:
    """On a DTensor model where no parameter carries ``is_embedding_or_output_parameter``, ``decoupled_lr`` or an
    ``nn.Embedding``'s weight routed to Muon is an error: FSDP2's ``fully_shard`` replaces every parameter, so flags
    set before it are gone, and the decoupled LR would apply to nothing, the embedding and output layer would go to
    Muon instead of AdamW, silently."""
    if any(getattr(p, "is_embedding_or_output_parameter", False) for _, p in named):
        return
    lost = ("fully_shard replaces every parameter, so flags set before it are gone. Set them after fully_shard (e.g. "
            "model.{name}.is_embedding_or_output_parameter = True, and on the output layer's weight), or route by "
            "name: rules=default_rules(config) + [Rule(Name({name!r}, '<output layer>.weight'), {setting})]")
    if config.decoupled_lr is not None:
        raise ValueError(
            f"decoupled_lr={config.decoupled_lr} applies to the parameters flagged is_embedding_or_output_parameter, "
            "and no parameter of this FSDP2 / DTensor model carries the flag: it would apply to none. "
            + lost.format(name="<embedding>.weight", setting=f"max_lr={config.decoupled_lr}"))
    modules = [source] if isinstance(source, nn.Module) else [c for c in source if isinstance(c, nn.Module)]
    embeddings = {id(m.weight) for chunk in modules for m in chunk.modules() if isinstance(m, nn.Embedding)}
    # an algorithm stepping whole matrices (Muon and its kin) is no place for an embedding table
    to_muon = [name for name, p in named if id(p) in embeddings and get_algorithm(
        resolved[name].settings.get("algorithm", config.algorithm)).capabilities.whole_matrices]
    if to_muon:
        algorithm = resolved[to_muon[0]].settings.get("algorithm", config.algorithm)
        target = "Muon" if get_algorithm(algorithm).family == "muon" else f"{algorithm!r} (whole matrices)"
        raise ValueError(
            f"parameter {to_muon[0]!r} is an nn.Embedding's weight, and it would go to {target}: no parameter of this "
            "FSDP2 / DTensor model carries is_embedding_or_output_parameter, the flag that routes embeddings and "
            "the output layer to AdamW. " + lost.format(name=to_muon[0], setting="algorithm='adamw'"))


def _data_parallel_of(source: nn.Module | list[Any], config: OptimizerConfig) -> DataParallel | None:
    chunks = [source] if isinstance(source, nn.Module) else source
    wrapped = [c for c in chunks if isinstance(c, DataParallel)]
    sharding = config.distributed.sharding
    if not wrapped and sharding != "replicated":
        raise ValueError(
            f"distributed.sharding={sharding!r} needs the model wrapped for data parallelism: "
            "model = wrap_data_parallel(config, model) after torch.distributed.init_process_group "
            "(one process works too), then build_optimizer(config, model)"
        )
    if not wrapped:
        return None
    if len(chunks) != 1:
        raise ValueError(
            f"got {len(chunks)} model chunks with a DataParallel among them; wrap one module holding every "
            "chunk (e.g. nn.ModuleList(chunks)) in one DataParallel"
        )
    ddp = wrapped[0]
    if sharding == "zero1" and not ddp.shard_grads and not get_algorithm(config.algorithm).capabilities.whole_matrices:
        raise ValueError("distributed.sharding='zero1' needs DataParallel(shard_grads=True); build the wrapper "
                         "with wrap_data_parallel(config, model)")
    return ddp


def _stage_precision(config: OptimizerConfig, family: str) -> Precision:
    """What a stage of an algorithm of ``family`` steps for low-precision parameters (``config.masters``):
    gradients are read as they are only by an Adam-family algorithm (the others get fp32 copies)."""
    masters = config.masters
    copy_grads = masters.grad_dtype == "fp32" or family != "adam"
    if masters.dtype == "bf16":
        return Direct(copy_grads=copy_grads)
    if masters.store_remainders:
        return Remainders(copy_grads=copy_grads)
    # the masters of what CPU offload steps on the host live there (none of them on the device)
    offload = config.offload
    return Masters(copy_grads=copy_grads, host_fraction=offload.fraction if offload.enabled else 0.0)


def _build_stages(
    groups: list[dict[str, Any]], config: OptimizerConfig, grad_of: GradOf | None, ddp: DataParallel | None,
    plan: ParamPlan, dtensor: Comm | NullComm | None = None,
) -> list[Stage]:
    """One stage per ``plan.stages`` entry (an algorithm over dense or expert groups), placed as the plan says;
    ``ddp`` (the wrapped model) supplies the buffers, ``dtensor`` (the ranks of a DTensor model) the group."""
    stages: list[Stage] = []
    for index_of_stage, planned in enumerate(plan.stages):
        # the inner optimizer's hyperparameters until a scheduler (if any) overwrites them every step
        kind_groups = [{**g, "lr": g.get("lr", g["max_lr"] * g["lr_mult"]),
                        "weight_decay": g.get("weight_decay", config.weight_decay * g["wd_mult"])}
                       for g in (groups[i] for i in planned.groups)]
        if ddp is None and dtensor is None and not any(g["params"] for g in kind_groups):
            continue
        spec = get_algorithm(planned.algorithm)
        # CPU offload lives inside the inner optimizer.
        make = config.offload.wrap(partial(spec.cls, **algorithm_kwargs(planned.algorithm, config)), spec)
        precision = _stage_precision(config, spec.family)
        # replicated and DTensor stages step an fp32 model directly; the sharded ones keep the configured
        # precision, which steps fp32 pieces directly anyway
        replicated_precision = precision if config.precision != "fp32" else Direct()
        placement, expert = planned.placement, planned.expert
        params = [p for g in kind_groups for p in g["params"]]
        owned = placement in ("zero1_whole", "zero1_owners", "layerwise")
        if placement in ("dtensor", "dtensor_owner"):
            assert dtensor is not None
            stage = dtensor_stage(kind_groups, make, comm=dtensor, precision=replicated_precision,
                                  whole_matrices=placement == "dtensor_owner", owners=plan.stage_owners(index_of_stage))
        elif ddp is None:
            stage = replicated_stage(kind_groups, make, grad_of=grad_of, precision=replicated_precision)
        elif placement == "zero1" or (owned and config.distributed.sharding == "zero1" and ddp.shard_grads
                                      and ddp.holds_whole(params)):
            # ZeRO-1 ranges, or whole matrices in their owners' reduce-scatter shards (ZeRO-1 over whole matrices)
            stage = zero1_stage(kind_groups, make, ddp=ddp, expert=expert,
                                overlap_param_gather=config.distributed.overlap_param_gather, precision=precision)
        elif owned:
            # owners step whole matrices; the plan's owners serve a stage over the group they were balanced over
            owners = plan.stage_owners(index_of_stage)
            same_group = plan.topology.instances == 1
            if ddp.shard_grads and not ddp.reduces_whole(params):
                # reduce-scattered gradients (the plan's choice, or a hand-built wrapper cutting the matrices):
                # owners gather their matrices' pieces from the shards; the wrapper stays as it was built
                stage = owners_stage(kind_groups, make, ddp=ddp, expert=expert, precision=precision,
                                     owners=owners if same_group or placement == "zero1_owners" else None)
            else:  # whole reduced gradients on every rank: owners step whole matrices, then broadcast
                stage = layerwise_stage(kind_groups, make, ddp=ddp, expert=expert, precision=precision,
                                        owners=owners if same_group or placement == "layerwise" else None)
        else:
            # (over a hand-built sharding wrapper it gathers the reduced shards: the wrapper stays as built)
            stage = replicated_stage(kind_groups, make, ddp=ddp, expert=expert, precision=replicated_precision)
        stages.append(stage)
    return stages
