"""How the face's optimizer classes drive optstack's core chain (``optstack.optimizer.ChainedOptimizer``): a torch
optimizer's groups become a stage's and the torch optimizer its inner optimizer (``_rebind``); Megatron's step,
``prepare_grads`` and ``reload_model_params`` over the chain, with the torch optimizer's groups as the truth for
their settings (``_pull``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from optstack.distributed.ddp import wrapper_holding
from optstack.megatron.norm_groups import norm_group_kwargs
from optstack.optimizer import ChainedOptimizer as CoreChained
from optstack.precision.scaler import LossScaler
from optstack.protocol import StepResult
from optstack.stage import Stage, Whole, WholeOverShards

_NOT_SETTINGS = ("params", "param_names")


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


def _chain_like(chain: CoreChained, stages: Sequence[Stage], **changes: Any) -> CoreChained:
    """A core chain over ``stages`` with ``chain``'s scaler, clip, skip, zero counting, gradient syncs and norm
    groups, ``changes`` overriding them."""
    settings = dict(scaler=chain.scaler, clip_grad=chain.clip_grad, log_num_zeros_in_grad=chain.log_num_zeros_in_grad,
                    grad_norm_skip_threshold=chain.grad_norm_skip_threshold, grad_syncs=chain.grad_syncs,
                    norm_groups=chain.norm_groups, norm_group_of=chain.norm_group_of)
    return CoreChained(stages, **{**settings, **changes})


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


def _whole_placement(groups: Sequence[dict[str, Any]]) -> Whole:
    """The placement of a stage stepping ``groups``' parameters whole on every rank: over a data-parallel wrapper
    that reduce-scatters their buckets, each rank's reduced shard is gathered into them first (else no rank
    would hold the reduced gradient); the wrapper stays as it was built."""
    params = [p for g in groups for p in g["params"]]
    ddp = wrapper_holding(*params)
    if ddp is not None:
        gather = ddp.grad_gather(params)
        if gather.buckets:
            return WholeOverShards(gather=gather, grad_of=ddp.main_grad)
    return Whole()


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


def _prepare(chain: CoreChained) -> bool:
    """Megatron's ``prepare_grads`` over a core chain: finish the gradient syncs, make the gradients ready (the
    stepped tensors' ``.grad``); whether any is non-finite on any rank."""
    for sync in chain.grad_syncs:
        sync.finish_grad_sync()
    return chain.global_stats()[1]
