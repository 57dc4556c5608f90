"""Megatron's optimizer classes, class for class, over optstack's stages.

``from megatron.core.optimizer import ChainedOptimizer, FP32Optimizer, ...`` becomes
``from optstack.megatron import ...``. Each class is what Megatron's is to its caller, translated to the core:

- a Megatron optimizer over one torch optimizer is one core ``Stage`` whose inner optimizer is that torch
  optimizer: ``FP32Optimizer`` steps the parameters directly (``Whole`` + ``Direct``),
  ``Float16OptimizerWithFloat16Params`` steps fp32 masters of the bf16/fp16 ones (``Whole`` + ``Masters``;
  the torch optimizer's groups then hold the masters, as in Megatron), ``DistributedOptimizer`` steps this
  rank's ranges of a ``DistributedDataParallel`` model's buckets (``Zero1`` + ``Masters``);
- the step (finite check, one global norm, clip, skip, inner step, publish) is the core
  ``optstack.optimizer.ChainedOptimizer``'s over those stages; ``ChainedOptimizer`` here joins the stages of
  every optimizer it is given into one core chain, so they share one norm, one clip factor and one skip
  decision, as in Megatron.

What Megatron callers read is Megatron's: ``param_groups`` and ``state`` are the inner torch optimizer's (the
groups hold the tensors stepped: masters, or flat shards under the distributed optimizer; the scheduler's
writes there reach the step), ``step()`` returns ``(update_successful, grad_norm, num_zeros_in_grad)``,
``get_loss_scale()`` a 1-element tensor.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from optstack.clip import norm_pows
from optstack.distributed.comm import Comm, NullComm
from optstack.distributed.ddp import DataParallel, is_expert_param
from optstack.megatron.bucket_groups import wrapper_holding
from optstack.megatron.bucket_state import BucketRanges
from optstack.megatron.ddp import DistributedDataParallel
from optstack.megatron.keys import ParamGroupOverride
from optstack.megatron.layer_wise import (
    BucketSyncedLayerWise,
    comm_of,
    fresh_precision,
    is_managed_by_layer_wise_optimizer,
    plan_bucket_gathers,
    tag_params_for_buffer_routing,
    torch_layer_wise_stage,
    wrapper_of,
)
from optstack.megatron.norm_groups import (
    SEPARATE_GRAD_NORM_GROUPS,
    GradNormGroups,
    _get_param_grad_norm_group,
    _is_separate_grad_norm_group,
    _validate_grad_norm_group,
    clip_by_norm,
    grad_norm,
    norm_group_kwargs,
)
from optstack.megatron.param_and_grad_buffer import (
    FullParamLayout,
    PerBufferParamLayout,
    bucket_end_divisor,
    build_model_gbuf_range,
    compute_full_param_layout,
    plan_buffer,
)
from optstack.optimizer import ChainedOptimizer as CoreChained
from optstack.precision.scaler import ConstantScaler, DynamicScaler, LossScaler, NoScaler
from optstack.protocol import StepResult
from optstack.stage import Direct, Masters, Stage, Whole, layerwise_stage, zero1_stage
from optstack.stage.placement import LayerWise

__all__ = [
    "MegatronOptimizer", "FP32Optimizer", "MixedPrecisionOptimizer", "Float16OptimizerWithFloat16Params",
    "DistributedOptimizer", "ChainedOptimizer", "LayerWiseDistributedOptimizer", "ProxyDict",
    "ConstantGradScaler", "DynamicGradScaler", "MegatronGradScaler", "param_group_identifier_keys",
    "copy_optimizer_param_metadata", "is_managed_by_layer_wise_optimizer", "tag_params_for_buffer_routing",
]

_NOT_SETTINGS = ("params", "param_names")
_PROTOCOL = ("prepare_grads", "get_grad_norm", "step_with_ready_grads")


def _param_group_override_keys() -> tuple[str, ...]:
    """Every field ``ParamGroupOverride`` declares (sorted)."""
    return tuple(sorted(ParamGroupOverride.__annotations__))


#: The group fields that tell saved param groups apart when a state dict is matched to the current groups
#: (Megatron's name): every ``ParamGroupOverride`` field and the structural flags; never ``lr``,
#: ``weight_decay`` or ``step``, which change every step.
param_group_identifier_keys: tuple[str, ...] = (
    *_param_group_override_keys(), "lr_mult", "is_expert_parallel", "is_decoupled_lr")
_LOW_PRECISION = (torch.bfloat16, torch.float16)

#: Megatron's grad scalers are optstack's loss scalers (same arithmetic, same state).
MegatronGradScaler = LossScaler


def ConstantGradScaler(initial_scale: float) -> ConstantScaler:  # noqa: N802 (Megatron's class name)
    """Megatron's ``ConstantGradScaler``: optstack's ``ConstantScaler``."""
    return ConstantScaler(initial_scale)


def DynamicGradScaler(  # noqa: N802 (Megatron's class name)
    initial_scale: float, min_scale: float, growth_factor: float, backoff_factor: float,
    growth_interval: int, hysteresis: int,
) -> DynamicScaler:
    """Megatron's ``DynamicGradScaler`` (same arguments): optstack's ``DynamicScaler``."""
    return DynamicScaler(initial_scale=initial_scale, min_scale=min_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=int(growth_interval), hysteresis=hysteresis)


def copy_optimizer_param_metadata(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Megatron's helper for code making its own parameter copies: copy the attributes that decide how a
    parameter is reduced and counted (``allreduce``, ``shared``, ``grad_norm_group``). optstack itself keeps no
    attributes on tensors; it reads these from the model's parameters."""
    for name in ("allreduce", "shared", "grad_norm_group"):
        if hasattr(source, name):
            setattr(destination, name, getattr(source, name))


def _scaler(grad_scaler: Any, owner: str) -> LossScaler:
    if grad_scaler is None:
        return NoScaler()
    if not isinstance(grad_scaler, LossScaler):
        raise ValueError(f"{owner}: grad_scaler must be None, ConstantGradScaler(...) or DynamicGradScaler(...) "
                         f"(optstack LossScalers), got {type(grad_scaler).__name__}")
    return grad_scaler


def _skip_threshold(config: Any) -> float | None:
    skip = getattr(config, "grad_norm_skip_threshold", None)
    return None if skip is None or skip == float("inf") else skip


def _core_chain(stages: Sequence[Stage], config: Any, scaler: LossScaler, grad_syncs: Sequence[Any] = ()
                ) -> CoreChained:
    """The core chain stepping ``stages`` with ``config``'s clip, skip and zero counting (Megatron's fields);
    parameters in a separate gradient-norm group (MTP) are clipped by their group's own norm."""
    return CoreChained(stages, scaler=scaler, clip_grad=getattr(config, "clip_grad", 0.0),
                       grad_norm_skip_threshold=_skip_threshold(config),
                       log_num_zeros_in_grad=getattr(config, "log_num_zeros_in_grad", False),
                       grad_syncs=list(grad_syncs),
                       **norm_group_kwargs(p for s in stages for g in s.param_groups for p in g["params"]))


def _rebind(optimizer: torch.optim.Optimizer, owner: str) -> Callable[[list[dict[str, Any]]], Any]:
    """A ``make_optimizer`` handing the stage ``optimizer`` itself, its groups' ``params`` replaced by the
    tensors the stage steps (masters, shard views), as Megatron replaces them; state moves along when the
    stepped tensor has the parameter's shape."""
    def make(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        if len(groups) != len(optimizer.param_groups):
            raise ValueError(f"{owner}: the optimizer has {len(optimizer.param_groups)} param groups, "
                             f"the stage {len(groups)}")
        for mine, given in zip(optimizer.param_groups, groups, strict=True):
            for old, new in zip(list(mine["params"]), given["params"], strict=False):
                if old is not new and old in optimizer.state:
                    entry = optimizer.state.pop(old)
                    if any(isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape != new.shape
                           for v in entry.values()):
                        raise ValueError(f"{owner}: the optimizer already has state for a parameter of shape "
                                         f"{tuple(old.shape)}; build it before its first step")
                    optimizer.state[new] = entry
            mine["params"] = list(given["params"])
        return optimizer
    return make


def _plain_groups(optimizer: torch.optim.Optimizer, owner: str) -> list[dict[str, Any]]:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"{owner}: optimizer must be a torch.optim.Optimizer (or None on a rank without "
                         f"parameters), got {type(optimizer).__name__}")
    return [{k: v for k, v in g.items() if k != "param_names"} for g in optimizer.param_groups]


def _whole_groups(optimizer: torch.optim.Optimizer, owner: str) -> list[dict[str, Any]]:
    """``_plain_groups`` for a stage stepping whole parameters: a data-parallel wrapper holding them that shards
    its gradients is told to reduce them whole (else no rank's ``p.grad`` would hold the reduced gradient)."""
    groups = _plain_groups(optimizer, owner)
    ddp = wrapper_holding([p for g in groups for p in g["params"]])
    if ddp is not None and ddp.shard_grads:
        ddp.require_whole_grads()
    return groups


class MegatronOptimizer(GradNormGroups):
    """Megatron's optimizer interface over one core stage (``None``: a stub, a rank without parameters).

    Megatron's gradient-norm methods (``get_grads_for_grad_norm``, ``has_grad_norm_group``, ``get_grad_norm``,
    ``clip_grad_norm``) come from ``GradNormGroups``. The step leaves parameters in a separate gradient-norm
    group (MTP) out of the main norm (what it returns and the skip threshold reads) and clips them by their
    group's own norm (``grad_norms_by_group``), as Megatron.

    Args:
        optimizer: the torch optimizer (what Megatron calls the base optimizer).
        config: the Megatron ``OptimizerConfig`` (its ``clip_grad``, ``grad_norm_skip_threshold`` and
            ``log_num_zeros_in_grad`` drive the step).
        init_state_fn: kept as ``self.init_state_fn`` (Megatron calls it to create state before a load;
            optstack's loads create state themselves).

    Attributes:
        optimizer: the torch optimizer, whose ``param_groups`` hold the tensors stepped.
        config, init_state_fn: as given. is_stub_optimizer: True without an optimizer.
    """

    #: True on an optimizer ``get_megatron_optimizer`` built over bf16 parameters with ``bf16=False`` (optstack
    #: steps fp32 masters of them where Megatron builds an ``FP32Optimizer``): ``LayerWiseDistributedOptimizer``
    #: with ``bf16`` re-wraps it as Megatron re-wraps that ``FP32Optimizer``.
    megatron_fp32 = False

    def __init__(self, optimizer: torch.optim.Optimizer | None, config: Any,
                 init_state_fn: Callable | None = lambda x: None) -> None:
        self.optimizer = optimizer
        self.config = config
        self.init_state_fn = init_state_fn
        self.is_stub_optimizer = optimizer is None
        self.grad_norms_by_group: dict[str, float] = {}
        self._stage: Stage | None = None
        self._chain = _core_chain([], config, NoScaler())

    def _attach(self, stage: Stage | None, chain: CoreChained) -> None:
        """Step through ``chain`` (over ``stage``); the inner groups lose optstack's ``param_names`` key."""
        self._stage, self._chain = stage, chain
        if stage is not None:
            self.optimizer = stage.optimizer
            self.is_stub_optimizer = False
            for group in stage.optimizer.param_groups:  # optstack's bookkeeping, not a Megatron group key
                group.pop("param_names", None)

    @classmethod
    def _over(cls, stage: Stage, config: Any, chain: CoreChained, *, megatron_fp32: bool = False
              ) -> MegatronOptimizer:
        """This class over a stage the core built (``get_megatron_optimizer``)."""
        out = cls.__new__(cls)
        MegatronOptimizer.__init__(out, stage.optimizer, config)
        out.megatron_fp32 = megatron_fp32
        if isinstance(out, MixedPrecisionOptimizer):
            out.grad_scaler = chain.scaler
        out._attach(stage, chain)
        return out

    def _solo(self) -> CoreChained:
        """The core chain over this optimizer's stage alone: ``self._chain`` unless that one was built for a
        whole chain (``get_megatron_optimizer``), then one over the stage, with the same loss scaler and
        data-parallel wrappers, so this optimizer's own ``step`` and ``state_dict`` cover only its part."""
        if self._chain.stages == self.stages:
            return self._chain
        if getattr(self, "_own", None) is None:
            self._own = CoreChained(self.stages, scaler=self._chain.scaler, clip_grad=self._chain.clip_grad,
                                    grad_norm_skip_threshold=self._chain.grad_norm_skip_threshold,
                                    log_num_zeros_in_grad=self._chain.log_num_zeros_in_grad,
                                    grad_syncs=self._chain._grad_syncs, norm_groups=self._chain.norm_groups,
                                    norm_group_of=self._chain.norm_group_of)
        return self._own

    # -- views ---------------------------------------------------------------------------------------
    @property
    def stages(self) -> list[Stage]:
        """optstack's stages doing the work (one, or none for a stub)."""
        return [self._stage] if self._stage is not None else []

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The torch optimizer's groups (live: write ``lr`` / ``weight_decay`` here)."""
        return [] if self.optimizer is None else self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        if self.optimizer is not None:
            self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        """The torch optimizer's state (keyed by the tensors stepped)."""
        return {} if self.optimizer is None else self.optimizer.state

    def get_parameters(self) -> list[torch.Tensor]:
        """The tensors the torch optimizer steps (masters / shards where there are, as in Megatron)."""
        return [p for g in self.param_groups for p in g["params"]]

    def get_loss_scale(self) -> torch.Tensor:
        """The loss scale as a 1-element fp32 tensor on the parameters' device."""
        device = self._stage.device if self._stage is not None else torch.device("cpu")
        return torch.tensor([self._chain.loss_scale], dtype=torch.float32, device=device)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (shape ``[1]``)."""
        return self.get_loss_scale() * loss

    # -- the step ------------------------------------------------------------------------------------
    def step(self) -> tuple[bool, float | None, int | None]:
        """Unscale, check for inf/nan, clip and step.

        Returns:
            ``(update_successful, grad_norm, num_zeros_in_grad)``: ``(False, None, None)`` on a non-finite
            gradient, ``(False, norm, None)`` above ``grad_norm_skip_threshold``.

        Raises:
            ValueError: a param group's ``lr`` is None (``OptimizerConfig.lr=None`` and no scheduler set it).
        """
        chain = self._solo()
        result = _step(chain, self.param_groups, self.config)
        self.grad_norms_by_group = _norms_by_group(chain, self.config)
        return result.applied, result.grad_norm, result.num_zeros

    def prepare_grads(self) -> bool:
        """Megatron's first part of ``step()``: finish the data-parallel gradient sync and make the gradients
        ready (the stepped tensors' ``.grad``: fp32 masters' for bf16/fp16 parameters), so ``get_grad_norm()``
        reads them; returns whether any gradient is non-finite (on any rank). Loss-scaled as they are."""
        return _prepare(self._solo())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (and the data-parallel wrapper's buffers when the model is wrapped)."""
        self._solo().zero_grad(set_to_none)

    def finish_param_sync(self) -> None:
        """Wait for parameter gathers left in flight by ``overlap_param_gather`` (optstack's addition)."""
        self._chain.finish_param_sync()

    def offload_states(self) -> int:
        """Move every master, remainder and moment to host memory (pinned and asynchronous on CUDA) and free
        their device memory, e.g. while the device serves generation; returns the bytes moved (this rank).
        ``OptimizerConfig.offload_optimizer_states=True`` does this after every step."""
        return self._chain.offload_states()

    def reload_states(self) -> None:
        """Bring back what ``offload_states`` moved, bit for bit; a step reloads by itself, this starts the
        copies early (e.g. before the forward pass)."""
        self._chain.reload_states()

    def reload_model_params(self, state_dict: Mapping[str, torch.Tensor] | None = None) -> None:
        """Copy the model's values (or ``state_dict``'s, by parameter name) into the fp32 masters, e.g. after
        loading model weights without the optimizer. Parameters stepped directly need nothing."""
        _reload(self.stages, state_dict)

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's format, optstack's core chain's (state keyed by position, ``"optstack"``: the scaler)."""
        chain = self._solo()
        _pull(chain)
        return chain.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a ``state_dict()`` (all or nothing; a mismatch is a ``ValueError``)."""
        self._solo().load_state_dict(state_dict)

    def sharded_state_dict(self, model_sharded_state_dict: Any = None, is_loading: bool = False,
                           metadata: dict | None = None) -> dict[str, Any]:
        """The optimizer's part of a distributed checkpoint: ``{"optimizer": state dict}`` whose state of a
        sharded optimizer is ``ShardedTensor``s of whole parameters (torch.distributed.checkpoint reshards it;
        ``optstack.checkpoint.OptimizerState`` saves it with the scheduler). Parameters are matched by name,
        so ``model_sharded_state_dict`` and Megatron's ``metadata`` sharding types are not needed."""
        return {"optimizer": MegatronOptimizer.state_dict(self)}  # a chain's too: one dict over all its stages

    @staticmethod
    def _filter_and_reorder_param_groups(current_groups: list[dict], state_dict_groups: list[dict]
                                         ) -> list[dict]:
        """Megatron's matching of saved groups to the current ones by ``param_group_identifier_keys`` (a missing
        key reads as None; NeMo's ``pre_<key>`` aliases count): per current group, the saved group with its
        identifier, holding the ``params`` of the saved group at the same position.

        Raises:
            ValueError: a current group's identifier is not among the saved ones.
        """
        def identifier(group: dict) -> tuple:
            return tuple(group.get(k, group.get(f"pre_{k}")) for k in param_group_identifier_keys)

        loaded = {identifier(g): g for g in state_dict_groups}
        saved_params = [g["params"] for g in state_dict_groups]  # before the matches below replace them
        out = []
        for group, params in zip(current_groups, saved_params, strict=False):
            key = identifier(group)
            if key not in loaded:
                available = "\n".join(str(k) for k in loaded)
                raise ValueError(f"Could not find parameter group with key {key} in loaded checkpoint.\n"
                                 f"Available keys:\n{available}\n"
                                 f"Parameter group key definition: {param_group_identifier_keys}")
            match = loaded[key]
            match["params"] = params
            out.append(match)
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._stage!r})"


class FP32Optimizer(MegatronOptimizer):
    """Megatron's fp32 optimizer: the torch optimizer steps the parameters themselves, no loss scaling.

    Args: as ``MegatronOptimizer`` (``optimizer`` over fp32 parameters, or None).
    """

    def __init__(self, optimizer: torch.optim.Optimizer | None, config: Any,
                 init_state_fn: Callable | None = None) -> None:
        super().__init__(optimizer, config, init_state_fn)
        if optimizer is not None:
            owner = type(self).__name__
            stage = Stage(_whole_groups(optimizer, owner), lambda groups: optimizer, placement=Whole(),
                          precision=Direct())
            self._attach(stage, _core_chain([stage], config, NoScaler()))


class MixedPrecisionOptimizer(MegatronOptimizer):
    """Megatron's base of the fp16/bf16 optimizers: a loss scaler (``grad_scaler``) and fp32 masters."""

    def __init__(self, optimizer: torch.optim.Optimizer | None, config: Any, grad_scaler: Any,
                 init_state_fn: Callable | None) -> None:
        super().__init__(optimizer, config, init_state_fn)
        self.grad_scaler = _scaler(grad_scaler, type(self).__name__)
        if grad_scaler is None and getattr(config, "fp16", False):
            raise ValueError(f"{type(self).__name__}: fp16 needs a grad scaler (ConstantGradScaler or "
                             "DynamicGradScaler), as in Megatron")


class Float16OptimizerWithFloat16Params(MixedPrecisionOptimizer):
    """Megatron's fp16/bf16 optimizer: fp32 masters of the bf16/fp16 parameters replace them in the torch
    optimizer's groups (fp32 parameters stay as they are); gradients are copied to the masters, the step
    runs on them and they are rounded back into the model.

    Args:
        optimizer: a torch optimizer over the model parameters, not stepped yet (or None).
        config: the Megatron ``OptimizerConfig``.
        grad_scaler: None (no loss scaling; not with fp16), ``ConstantGradScaler`` or ``DynamicGradScaler``.
        init_state_fn: kept, as in ``MegatronOptimizer``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer | None, config: Any, grad_scaler: Any,
                 init_state_fn: Callable | None = None) -> None:
        super().__init__(optimizer, config, grad_scaler, init_state_fn)
        if optimizer is not None:
            owner = type(self).__name__
            stage = Stage(_whole_groups(optimizer, owner), _rebind(optimizer, owner), placement=Whole(),
                          precision=Masters())
            self._attach(stage, _core_chain([stage], config, self.grad_scaler))


class DistributedOptimizer(BucketRanges, MixedPrecisionOptimizer):
    """Megatron's distributed optimizer (ZeRO-1): each rank keeps fp32 masters and optimizer state only for
    its range of every bucket of the ``DistributedDataParallel`` model's buffers; the step reduce-scatters
    (or all-reduces) the gradients, steps the ranges, and gathers the parameters. Megatron's bucket-space view
    (``gbuf_ranges``, ``get_parameter_state_dp_reshardable``, ...) comes from ``BucketRanges``.

    Args:
        optimizer: a torch optimizer over the model parameters, not stepped yet (its groups then hold this
            rank's flat fp32 shards, as in Megatron).
        config, grad_scaler, init_state_fn: as ``Float16OptimizerWithFloat16Params``.
        model_chunks: the one ``DistributedDataParallel`` model (built with ``use_distributed_optimizer=True``)
            holding the parameters, or a list of it.
        per_model_buffers, data_parallel_group, data_parallel_group_gloo, data_parallel_group_idx,
        distributed_optimizer_instance_id: accepted for Megatron's signature; the buffers and groups are the
            model's.

    Raises:
        ValueError: no wrapped model, a wrapper without sharded gradients, or parameters of both kinds
            (dense and expert: build one optimizer per kind, as Megatron does).
    """

    def __init__(self, optimizer: torch.optim.Optimizer | None, config: Any, grad_scaler: Any,
                 init_state_fn: Callable | None = None, model_chunks: Any = None, per_model_buffers: Any = None,
                 data_parallel_group: Any = None, data_parallel_group_gloo: Any = None,
                 data_parallel_group_idx: int | None = None, distributed_optimizer_instance_id: int = 0) -> None:
        super().__init__(optimizer, config, grad_scaler, init_state_fn)
        if optimizer is None:
            return
        owner = type(self).__name__
        chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks or [])
        wrapped = [c for c in chunks if isinstance(c, DataParallel)]
        if len(wrapped) != 1 or not wrapped[0].shard_grads:
            raise ValueError(f"{owner}: model_chunks must be the one DistributedDataParallel model, built with "
                             "DistributedDataParallelConfig(use_distributed_optimizer=True)")
        groups = _plain_groups(optimizer, owner)
        kinds = {is_expert_param(p) for g in groups for p in g["params"]}
        if len(kinds) > 1:
            raise ValueError(f"{owner}: the optimizer holds dense and expert (allreduce=False) parameters; build "
                             "one optimizer per kind and chain them with ChainedOptimizer")
        stage = zero1_stage(groups, _rebind(optimizer, owner), ddp=wrapped[0], expert=kinds == {True},
                            overlap_param_gather=wrapped[0].ddp_config.overlap_param_gather
                            if hasattr(wrapped[0], "ddp_config") else False)
        self._attach(stage, _core_chain([stage], config, self.grad_scaler, [wrapped[0]]))

    # Megatron's (current main) layout helpers, for code that precomputes the wrapper's layout.
    compute_full_param_layout = staticmethod(compute_full_param_layout)
    _build_model_gbuf_range = staticmethod(build_model_gbuf_range)

    @staticmethod
    def _compute_per_buffer_param_layout(params: Sequence[torch.nn.Parameter], bucket_size: int | None,
                                         data_parallel_world_size: int, ddp_config: Any,
                                         param_indices: Sequence[int] | None = None) -> PerBufferParamLayout:
        """Megatron's: one buffer's distributed-optimizer layout (``params`` in forward order)."""
        return plan_buffer(params, bucket_size, data_parallel_world_size, whole=False, indices=param_indices)

    @property
    def optimizer_state_keys(self) -> tuple[str, ...]:
        """The torch optimizer's tensor state keys by ``config.optimizer`` (Muon's scalar optimizer for Muon):
        ``('exp_avg',)`` for Lion, else Adam's ``('exp_avg', 'exp_avg_sq')`` (Megatron's table)."""
        name = self.config.optimizer
        if name == "muon":
            name = self.config.muon_scalar_optimizer
        return {"lion": ("exp_avg",)}.get(name, ("exp_avg", "exp_avg_sq"))

    def _get_state_key_dtype(self, key: str) -> torch.dtype:
        """The dtype of a state key (``exp_avg_dtype`` / ``exp_avg_sq_dtype``; others fp32)."""
        return {"exp_avg": self.config.exp_avg_dtype, "exp_avg_sq": self.config.exp_avg_sq_dtype}.get(
            key, torch.float32)


def _step(chain: CoreChained, groups: Sequence[dict[str, Any]], config: Any = None) -> StepResult:
    for index, group in enumerate(groups):
        if group.get("lr") is None:
            raise ValueError(
                f"param group {index} has lr=None (OptimizerConfig.lr is None): set it before stepping, e.g. "
                "with OptimizerParamScheduler(...).step(1), or build with OptimizerConfig(lr=...)")
    _pull(chain)
    chain.step()  # reloads offloaded state first
    assert chain.last_result is not None
    if getattr(config, "offload_optimizer_states", False):
        chain.offload_states()  # the device holds no optimizer state between steps (RL colocation)
    return chain.last_result


def _norms_by_group(chain: CoreChained, config: Any) -> dict[str, float]:
    """Megatron's ``grad_norms_by_group`` after a step: each separate group's norm, when clipping."""
    return dict(chain.norms_by_group) if getattr(config, "clip_grad", 0.0) > 0.0 else {}


def _pull(chain: CoreChained) -> None:
    """Megatron's truth is the torch optimizer's groups: copy their settings into the core's model-side
    groups, which the stage copies back into the torch optimizer at the step."""
    for stage in chain.stages:
        for outer, inner in zip(stage.param_groups, stage.optimizer.param_groups, strict=True):
            outer.update({k: v for k, v in inner.items() if k not in _NOT_SETTINGS})


def _reload(stages: Sequence[Stage], state_dict: Mapping[str, torch.Tensor] | None) -> None:
    with torch.no_grad():
        for stage in stages:
            stepped = [t for g in stage.optimizer.param_groups for t in g["params"]]
            for piece, tensor in zip(stage.pieces, stepped, strict=True):
                if tensor is piece.value:
                    continue  # stepped directly: the model's values are the optimizer's
                if state_dict is None:
                    tensor.copy_(piece.value.reshape(tensor.shape))
                    continue
                if piece.name not in state_dict:
                    raise ValueError(
                        f"reload_model_params: the state dict has no {piece.name!r} (it has "
                        f"{sorted(state_dict)[:8]}); values are matched by parameter name, which only an optimizer "
                        "built by get_megatron_optimizer knows (Megatron's own reloads only from the model)")
                source = state_dict[piece.name].detach().reshape(-1)[piece.start:piece.end]
                tensor.copy_(source.reshape(tensor.shape))


class ProxyDict(Mapping[tuple[int, Any], Any]):
    """Megatron's view of several optimizers' ``state`` as one mapping keyed ``(optimizer index, key)``."""

    def __init__(self, inner_dicts: Sequence[Any]) -> None:
        self._inner_dicts = list(inner_dicts)

    def __getitem__(self, key: tuple[int, Any]) -> Any:
        index, inner_key = key
        return self._inner_dicts[index].get(inner_key)

    def __setitem__(self, key: tuple[int, Any], value: Any) -> None:
        index, inner_key = key
        self._inner_dicts[index][inner_key] = value

    def __len__(self) -> int:
        return sum(len(d) for d in self._inner_dicts)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return ((i, k) for i, d in enumerate(self._inner_dicts) for k in d)


class ChainedOptimizer(MegatronOptimizer):
    """Megatron's ``ChainedOptimizer``: several optimizers stepped as one (one global grad norm, one clip
    factor, one skip decision; dense and expert optimizers, or Muon and its scalar optimizer).

    Args:
        chained_optimizers: the optimizers: this module's (their stages join one core chain, with the first
            one's loss scaler and config), or plain ``torch.optim`` optimizers (stepped as an
            ``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params`` by their dtype would step them, with
            the chain's config; without any Megatron optimizer in the chain: no clipping, no loss scaling).
            Other objects with ``param_groups`` are listed and zeroed but cannot be stepped. Empty on a rank
            without parameters.

    Attributes:
        chained_optimizers: as given. config: the first Megatron optimizer's config (None without one).
        built: optstack's ``BuiltOptimizer`` when ``get_megatron_optimizer`` built it, else None.
    """

    def __init__(self, chained_optimizers: Sequence[Any]) -> None:
        self.chained_optimizers = list(chained_optimizers)
        self.built: Any = None
        self.grad_norms_by_group: dict[str, float] = {}
        configs = [o.config for o in self.chained_optimizers
                   if isinstance(o, MegatronOptimizer) or all(hasattr(o, k) for k in _PROTOCOL + ("config",))]
        config = configs[0] if configs else None
        self.config = config
        self.init_state_fn = None
        self.optimizer = None
        self.is_stub_optimizer = all(getattr(o, "is_stub_optimizer", False) for o in self.chained_optimizers)
        self._stage = None
        self._members = [self._member(o, config) for o in self.chained_optimizers]
        stages = [s for m in self._members if m is not None for s in m.stages]
        chains = [m._chain for m in self._members if m is not None and m.stages]
        shared = chains[0] if chains and all(c is chains[0] for c in chains) else None
        if shared is not None and shared.stages == stages:
            self._chain = shared  # built together (get_megatron_optimizer): one chain already
        else:
            scaler = chains[0].scaler if chains else NoScaler()
            syncs = list({id(s): s for c in chains for s in c._grad_syncs}.values())
            self._chain = _core_chain(stages, config if config is not None else _NO_CLIP, scaler, syncs)

    @staticmethod
    def _member(optimizer: Any, config: Any) -> MegatronOptimizer | None:
        if isinstance(optimizer, MegatronOptimizer):
            return optimizer
        if isinstance(optimizer, torch.optim.Optimizer):
            low = any(p.dtype in _LOW_PRECISION for g in optimizer.param_groups for p in g["params"])
            cfg = config if config is not None else _NO_CLIP
            return (Float16OptimizerWithFloat16Params(optimizer, cfg, None) if low
                    else FP32Optimizer(optimizer, cfg))
        return None

    @property
    def stages(self) -> list[Stage]:
        return self._chain.stages

    @property
    def optimizer(self) -> Any:  # type: ignore[override]
        """The one chained optimizer's torch optimizer (Megatron's backward-compatible accessor)."""
        if len(self.chained_optimizers) != 1:
            raise ValueError(f"ChainedOptimizer.optimizer needs exactly one chained optimizer, there are "
                             f"{len(self.chained_optimizers)}; use chained_optimizers[i].optimizer")
        only = self.chained_optimizers[0]
        return only if isinstance(only, torch.optim.Optimizer) else only.optimizer

    @optimizer.setter
    def optimizer(self, value: Any) -> None:
        pass  # MegatronOptimizer.__init__'s assignment; the chained optimizers hold theirs

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """Every chained optimizer's groups, in order (live dicts)."""
        return [g for o in self.chained_optimizers for g in o.param_groups]

    @property
    def state(self) -> ProxyDict:  # type: ignore[override]
        """``(index into chained_optimizers, tensor) -> state``, Megatron's ``ProxyDict``."""
        return ProxyDict([o.state for o in self.chained_optimizers])

    def get_parameters(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for o in self.chained_optimizers:
            out += o.get_parameters() if hasattr(o, "get_parameters") else [
                p for g in o.param_groups for p in g["params"]]
        return out

    def step(self) -> tuple[bool, float | None, int | None]:
        unsteppable = [type(o).__name__ for o, m in zip(self.chained_optimizers, self._members, strict=True)
                       if m is None]
        if unsteppable and len(unsteppable) == len(self.chained_optimizers) and all(
                all(hasattr(o, k) for k in _PROTOCOL) for o in self.chained_optimizers):
            return self._step_protocol()
        if unsteppable:
            raise ValueError(f"ChainedOptimizer.step: {unsteppable} are neither optstack.megatron optimizers nor "
                             "torch.optim optimizers; chain those only")
        result = _step(self._chain, self.param_groups, self.config)
        self.grad_norms_by_group = _norms_by_group(self._chain, self.config)
        return result.applied, result.grad_norm, result.num_zeros

    def has_grad_norm_group(self, grad_norm_group: str) -> bool:
        """Whether any chained optimizer holds parameters of ``grad_norm_group`` (on any rank)."""
        _validate_grad_norm_group(grad_norm_group)
        cache = vars(self).setdefault("_has_grad_norm_group_cache", {})
        if grad_norm_group not in cache:
            # an object without Megatron's grad-norm-group methods (an older protocol) holds no such group
            cache[grad_norm_group] = any(o.has_grad_norm_group(grad_norm_group) for o in self.chained_optimizers
                                         if hasattr(o, "has_grad_norm_group"))
        return cache[grad_norm_group]

    def get_grad_norm(self) -> float:
        """The main norm over every chained optimizer (each reduced over its own grad-stats group)."""
        return math.sqrt(sum(float(o.get_grad_norm() or 0.0) ** 2 for o in self.chained_optimizers))

    @torch.no_grad()
    def _get_grad_norm_for_group(self, grad_norm_group: str) -> float:
        _validate_grad_norm_group(grad_norm_group)
        norms = [grad_norm(o.get_grads_for_grad_norm(grad_norm_group), o.get_grad_stats_parallel_group())
                 for o in self.chained_optimizers if hasattr(o, "get_grads_for_grad_norm")]
        return math.sqrt(sum(n * n for n in norms))

    @torch.no_grad()
    def _compute_grad_norms_by_group(self) -> dict[str, float]:
        self.grad_norms_by_group = {name: self._get_grad_norm_for_group(name)
                                    for name in SEPARATE_GRAD_NORM_GROUPS if self.has_grad_norm_group(name)}
        return self.grad_norms_by_group

    @torch.no_grad()
    def _step_protocol(self) -> tuple[bool, float | None, int | None]:
        """Megatron's chained step over objects that implement Megatron's optimizer protocol themselves
        (``prepare_grads``, ``get_grad_norm``, ``step_with_ready_grads``): one skip decision for all, read
        from the main norm; gradients in a separate gradient-norm group (MTP) clipped by their group's norm."""
        self.grad_norms_by_group = {}
        if any([o.prepare_grads() for o in self.chained_optimizers]):  # every one prepares, as in Megatron
            return False, None, None
        main_norm = self.get_grad_norm()
        live = [o for o in self.chained_optimizers if not getattr(o, "is_stub_optimizer", False)]
        if any(o.config.clip_grad > 0.0 for o in live):
            self._compute_grad_norms_by_group()
        skip = False
        for o in live:
            params = o.get_parameters()
            by_group: dict[str | None, list[torch.Tensor]] = {}
            for p in params:
                group = _get_param_grad_norm_group(p)
                by_group.setdefault(group if _is_separate_grad_norm_group(group) else None, []).append(p)
            if o.config.clip_grad > 0.0:
                for group, members in by_group.items():
                    total = main_norm if group is None else self.grad_norms_by_group.get(group)
                    if total is not None:
                        clip_by_norm(members, o.config.clip_grad, total)
            threshold = _skip_threshold(o.config)
            skip = skip or (None in by_group and threshold is not None and main_norm > threshold)
        zeros = None
        if self.config is not None and getattr(self.config, "log_num_zeros_in_grad", False):
            zeros = sum(int(o.count_zeros()) for o in self.chained_optimizers)
        if skip:
            return False, main_norm, zeros
        return all([o.step_with_ready_grads() for o in self.chained_optimizers]), main_norm, zeros

    def state_dict(self) -> Any:  # type: ignore[override]
        """Megatron's: the one chained optimizer's state dict, or a list of each chained optimizer's."""
        if len(self.chained_optimizers) == 1:
            return self.chained_optimizers[0].state_dict()
        return [o.state_dict() for o in self.chained_optimizers]

    def load_state_dict(self, state_dict: Any) -> None:
        """Load ``state_dict()``'s form: one chained optimizer's dict, or a list (or ``{index: dict}``) with one
        per chained optimizer; also the whole chain's dict (``sharded_state_dict()["optimizer"]``).

        Raises:
            ValueError: a list of another length than ``chained_optimizers``.
        """
        if len(self.chained_optimizers) == 1:
            self.chained_optimizers[0].load_state_dict(state_dict)
            return
        if isinstance(state_dict, Mapping) and "param_groups" in state_dict:
            super().load_state_dict(state_dict)
            return
        parts = [v for _, v in sorted(state_dict.items())] if isinstance(state_dict, Mapping) else list(state_dict)
        if len(parts) != len(self.chained_optimizers):
            raise ValueError(f"ChainedOptimizer.load_state_dict: expected {len(self.chained_optimizers)} entries "
                             f"(one per chained optimizer), got {len(parts)}")
        for optimizer, part in zip(self.chained_optimizers, parts, strict=True):
            optimizer.load_state_dict(part)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._chain.zero_grad(set_to_none)
        for o, m in zip(self.chained_optimizers, self._members, strict=True):
            if m is None and hasattr(o, "zero_grad"):
                o.zero_grad(set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        device = self.stages[0].device if self.stages else torch.device("cpu")
        return torch.tensor([self._chain.loss_scale], dtype=torch.float32, device=device)

    def reload_model_params(self, state_dict: Mapping[str, torch.Tensor] | None = None) -> None:
        _reload(self.stages, state_dict)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({[type(o).__name__ for o in self.chained_optimizers]})"


class LayerWiseDistributedOptimizer(ChainedOptimizer):
    """Megatron's layer-wise distributed optimizer: whole parameters stepped by owner ranks of the
    data-parallel group (balanced by Newton-Schulz cost), then sent to every rank; what Muon needs.

    ``get_megatron_optimizer(OptimizerConfig(optimizer='muon', use_layer_wise_distributed_optimizer=True),
    [model])`` builds it over the ``DistributedDataParallel`` model; its chained optimizers are Muon's
    (layer-wise) and the scalar optimizer's (replicated).

    Built directly, as Megatron's callers do, over:

    - plain torch optimizers (Megatron's way): each one's groups are placed layer-wise and, with
      ``config.bf16``, stepped through fp32 masters as a ``Float16OptimizerWithFloat16Params`` (else an
      ``FP32Optimizer``); gradients are read from ``param.main_grad`` (set by ``DistributedDataParallel``) or
      ``param.grad``, over ``pg_collection``'s ``dp_cp`` / ``expt_dp`` groups; over the wrapper's own groups and
      buffers when ``model_chunks`` holds the ``DistributedDataParallel`` model of their parameters;
    - Megatron optimizers: those over one whole-parameter stage (what ``get_megatron_optimizer`` builds without
      the distributed optimizer, or ``FP32Optimizer(torch_optimizer, config)``) are placed layer-wise with a
      fresh inner optimizer of the same class and defaults (so they must not have stepped); with
      ``config.bf16`` an ``FP32Optimizer`` becomes a ``Float16OptimizerWithFloat16Params`` (megatron-core 0.16
      unwraps and re-wraps it; current main refuses it) and a ``Float16OptimizerWithFloat16Params`` is refused
      (both releases), unless ``get_megatron_optimizer`` built it over bf16 parameters with ``bf16=False``
      (Megatron's ``FP32Optimizer`` there: ``megatron_fp32``). Others are kept.

    With ``config.overlap_param_gather`` (and the model's ``DistributedDataParallelConfig`` agreeing) the step
    leaves the parameters other ranks stepped to the model's bucket groups, as Megatron does:
    ``model.start_param_sync()`` starts their gathers, the forward pre-hooks finish them (each bucket's
    ``layerwise_params_list`` says which rank sends what; the replicated scalar optimizer's parameters are sent by
    one rank each). Until then other ranks' parameters are the previous step's here: read the model after a
    forward, ``model.start_param_sync(force_sync=True)`` or ``optimizer.finish_param_sync()``.

    Args:
        optimizers: the optimizers (see above).
        config: the Megatron ``OptimizerConfig``.
        pg_collection: Megatron's ``ProcessGroupCollection`` (its ``dp_cp`` or ``dp``, ``expt_dp``), or None
            (torch.distributed's world); not needed when ``model_chunks`` holds the wrapper.
        init_state_fn_list: one per optimizer, kept as the wrapping optimizers' ``init_state_fn``.
        model_chunks: the ``DistributedDataParallel`` model chunks (needed with ``overlap_param_gather``).

    Attributes:
        overlap_param_gather: whether the bucket groups gather the parameters (above). pg_collection,
            model_chunks: as given.

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
        return plan_buffer(params, bucket_size, data_parallel_world_size, whole=True, indices=param_indices)

    @staticmethod
    def compute_full_param_layout(params: Sequence[torch.nn.Parameter], bucket_size: int | None,
                                  data_parallel_world_size: int, ddp_config: Any,
                                  expert_data_parallel_world_size: int | None = None) -> FullParamLayout:
        """Megatron's (current main): the layouts of the buffers of ``params`` (forward order) for a wrapper with
        ``use_distributed_optimizer``, the parameters tagged ``is_managed_by_layer_wise_optimizer``
        (``tag_params_for_buffer_routing``) each whole inside one rank's shard, the others in the distributed
        optimizer's layout (``DistributedOptimizer.compute_full_param_layout``)."""
        return compute_full_param_layout(params, bucket_size, data_parallel_world_size, ddp_config,
                                         expert_data_parallel_world_size, whole_for_layer_wise=True)

    def finish_param_sync(self) -> None:
        """Make every rank hold every updated parameter: with ``overlap_param_gather`` the bucket groups' gathers
        not started yet run now (collective: every rank calls it), and those in flight are waited for."""
        super().finish_param_sync()
        if self.overlap_param_gather:
            for ddp in {id(s.placement.ddp): s.placement.ddp for s in self.stages
                        if isinstance(s.placement, BucketSyncedLayerWise)}.values():
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
            elif isinstance(stage.placement, LayerWise) and not isinstance(stage.placement, BucketSyncedLayerWise):
                stage.placement.publish()

    @torch.no_grad()
    def broadcast_params(self) -> None:
        """Send every layer-wise parameter from the rank that stepped it to every rank, one broadcast each
        (Megatron's reference for ``allgather_params``). Collective."""
        for stage in self.stages:
            placement = stage.placement
            if isinstance(placement, LayerWise):
                for param, owner in zip(placement._all, placement.owners, strict=True):
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
                local = (norm_pows(grads, 2.0, stage.device).sum().reshape(1) if grads
                         else torch.zeros(1, device=stage.device))
                # whole on every rank of the data-parallel group; other parts over the expert/model-parallel ones
                total += float(stage.placement.comm.all_reduce(stage.placement.dp.all_reduce(local)).item())
            else:
                total += float(member.get_grad_norm() or 0.0) ** 2
        return math.sqrt(total)


def steps_whole(stage: Stage | None) -> bool:
    """Whether ``stage`` is ZeRO-1 over whole-shard buffers: each rank steps whole parameters from its
    reduce-scatter shard (the layer-wise optimizer over a wrapper laid out for it)."""
    return stage is not None and stage.placement.kind == "zero1" and stage.placement.owns_whole


def _prepare(chain: CoreChained) -> bool:
    """Megatron's ``prepare_grads`` over a core chain: finish the gradient syncs, make the gradients ready (the
    stepped tensors' ``.grad``); whether any is non-finite on any rank."""
    for sync in chain._grad_syncs:
        sync.finish_grad_sync()
    return chain._global_stats()[1]


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
    syncs = [s for s in optimizer._chain._grad_syncs if isinstance(s, DataParallel)]
    kind = stage.placement.kind
    in_layer_wise_chain = any(s.placement.kind == "layerwise" for s in optimizer._chain.stages)
    if len(syncs) > 1 or (syncs and syncs[0].shard_grads) or isinstance(stage.placement, BucketSyncedLayerWise) \
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

    if bucket_synced:
        placed = Stage(groups, make, placement=BucketSyncedLayerWise(ddp=ddp, expert=expert), precision=precision)
    elif ddp is not None:
        placed = layerwise_stage(groups, make, ddp=ddp, expert=expert, precision=precision)
    else:
        placed = torch_layer_wise_stage(groups, make, precision=precision, expert=expert, ddp=None,
                                        dp=_dp_comm(pg_collection, expert), bucket_synced=False)
    cls = Float16OptimizerWithFloat16Params if to_bf16 else type(optimizer)
    return cls._over(placed, config, _core_chain([placed], config, optimizer._chain.scaler, syncs))


def _dp_comm(pg_collection: Any, expert: bool) -> Comm | NullComm:
    """The data-parallel group of ``pg_collection`` (``expt_dp`` for experts, else ``dp_cp`` or ``dp``; None:
    torch.distributed's world) as optstack's communicator."""
    group = None if pg_collection is None else (
        getattr(pg_collection, "expt_dp", None) if expert else
        getattr(pg_collection, "dp_cp", None) or getattr(pg_collection, "dp", None))
    return comm_of(group, "expert data-parallel" if expert else "data-parallel")


class _NoClip:
    """The config of a chain of plain torch optimizers: stepped as they would be alone."""

    clip_grad = 0.0
    grad_norm_skip_threshold = float("inf")
    log_num_zeros_in_grad = False


_NO_CLIP = _NoClip()
