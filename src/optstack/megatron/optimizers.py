"""Megatron's optimizer interface and its classes over one torch optimizer, each one core ``Stage`` whose inner
optimizer is that torch optimizer: ``FP32Optimizer`` steps the parameters (``Whole`` + ``Direct``),
``Float16OptimizerWithFloat16Params`` fp32 masters of the bf16/fp16 ones (``Whole`` + ``Masters``),
``DistributedOptimizer`` this rank's ranges of a ``DistributedDataParallel`` model's buckets (``Zero1`` +
``Masters``). The step is the core ``ChainedOptimizer``'s over those stages (``core_chain``).

What callers read is Megatron's: ``param_groups`` and ``state`` are the torch optimizer's (its groups hold the
tensors stepped, masters or flat shards; the scheduler's writes there reach the step), ``step()`` returns
``(update_successful, grad_norm, num_zeros_in_grad)``, ``get_loss_scale()`` a 1-element tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from optstack.distributed.ddp import DataParallel, is_expert_param
from optstack.megatron.bucket_state import BucketRanges
from optstack.megatron.core_chain import (
    _chain_like,
    _core_chain,
    _norms_by_group,
    _plain_groups,
    _prepare,
    _pull,
    _rebind,
    _reload,
    _step,
    _whole_placement,
)
from optstack.megatron.ddp_config import compute_full_param_layout
from optstack.megatron.keys import ParamGroupOverride
from optstack.megatron.norm_groups import GradNormGroups
from optstack.megatron.param_and_grad_buffer import PerBufferParamLayout, build_model_gbuf_range, plan_buffer
from optstack.optimizer import ChainedOptimizer as CoreChained
from optstack.precision.scaler import LossScaler, NoScaler
from optstack.stage import Direct, Masters, Stage, zero1_stage

__all__ = [
    "MegatronOptimizer", "FP32Optimizer", "MixedPrecisionOptimizer", "Float16OptimizerWithFloat16Params",
    "DistributedOptimizer", "param_group_identifier_keys", "copy_optimizer_param_metadata",
]


def _param_group_override_keys() -> tuple[str, ...]:
    """Every field ``ParamGroupOverride`` declares (sorted)."""
    return tuple(sorted(ParamGroupOverride.__annotations__))


#: The group fields that tell saved param groups apart when a state dict is matched to the current groups
#: (Megatron's name): every ``ParamGroupOverride`` field and the structural flags; never ``lr``,
#: ``weight_decay`` or ``step``, which change every step.
param_group_identifier_keys: tuple[str, ...] = (
    *_param_group_override_keys(), "lr_mult", "is_expert_parallel", "is_decoupled_lr")


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

    def _attach(self, stage: Stage, chain: CoreChained) -> None:
        """Step through ``chain`` (over ``stage``); the inner groups lose optstack's ``param_names`` key."""
        self._stage, self._chain = stage, chain
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
            self._own = _chain_like(self._chain, self.stages)
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
        device = self.stages[0].device if self.stages else torch.device("cpu")
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
            groups = _plain_groups(optimizer, type(self).__name__)
            stage = Stage(groups, lambda groups: optimizer, placement=_whole_placement(groups), precision=Direct())
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
            groups = _plain_groups(optimizer, owner)
            stage = Stage(groups, _rebind(optimizer, owner), placement=_whole_placement(groups),
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
        return plan_buffer(params, bucket_size, data_parallel_world_size, ddp_config, whole=False,
                           indices=param_indices)

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
