"""Megatron's ``get_megatron_optimizer``: the Megatron config and overrides in, optstack's stack underneath.

``get_megatron_optimizer`` groups parameters exactly as ``get_param_groups`` does (Megatron's name matching,
its override semantics), hands the settings it resolved to ``optstack.factory.build_optimizer``, and wraps the
chained optimizer it returns in ``MegatronOptimizer``, whose ``step()`` returns Megatron's
``(update_successful, grad_norm, num_zeros_in_grad)`` tuple.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from optstack.distributed.comm import world_comm
from optstack.distributed.ddp import DataParallel
from optstack.distributed.parallel import ParallelGroups
from optstack.factory import BuiltOptimizer, build_optimizer
from optstack.groups import group_map
from optstack.megatron.config import OptimizerConfig, to_core
from optstack.megatron.ddp import DistributedDataParallel
from optstack.megatron.groups import as_chunks, resolve_chunks
from optstack.megatron.keys import (
    ConfigOverrides,
    check_config_overrides_consistency,
    get_standard_config_overrides,
    to_rules,
)
from optstack.rules import muon_routing_rule

__all__ = ["MegatronOptimizer", "get_megatron_optimizer"]


class MegatronOptimizer:
    """What ``get_megatron_optimizer`` returns: Megatron's optimizer interface over optstack's stack.

    Attributes:
        config: the Megatron ``OptimizerConfig`` it was built from.
        built: optstack's ``BuiltOptimizer`` (``built.optimizer`` is the chained optimizer doing the work).
    """

    def __init__(self, built: BuiltOptimizer, config: OptimizerConfig) -> None:
        self.built = built
        self.config = config

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every chained optimizer's param groups (live dicts: the scheduler writes lr and weight_decay)."""
        return self.built.optimizer.param_groups

    def get_parameters(self) -> list[torch.nn.Parameter]:
        """The model parameters being optimized."""
        return [p for group in self.built.param_groups for p in group["params"]]

    def step(self) -> tuple[bool, float | None, int | None]:
        """Unscale, check for inf/nan, clip and step, all optimizers together.

        Returns:
            ``(update_successful, grad_norm, num_zeros_in_grad)``: a non-finite gradient gives
            ``(False, None, None)``; a norm above ``grad_norm_skip_threshold`` gives ``(False, norm, None)``;
            ``num_zeros_in_grad`` is None unless ``log_num_zeros_in_grad``.
        """
        self.built.optimizer.step()
        result = self.built.optimizer.last_result
        return result.applied, result.grad_norm, result.num_zeros

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the data-parallel wrapper's grad buffers (if the model is wrapped) and the stages' grads."""
        self.built.optimizer.zero_grad(set_to_none)

    def finish_param_sync(self) -> None:
        """Wait for the parameter gathers that ``overlap_param_gather`` leaves in flight after ``step()``
        (the next forward waits for them itself; call this before reading the parameters otherwise).
        optstack's addition: Megatron does this with ``model.disable_forward_pre_hook()``."""
        self.built.optimizer.finish_param_sync()

    def get_loss_scale(self) -> torch.Tensor:
        """The current loss scale as a 1-element fp32 tensor on the parameters' device (Megatron's form)."""
        params = self.get_parameters()
        device = params[0].device if params else torch.device("cpu")
        return torch.tensor([self.built.optimizer.loss_scale], dtype=torch.float32, device=device)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale, to call ``backward()`` on (shape ``[1]``, as in Megatron)."""
        return self.get_loss_scale() * loss

    def state_dict(self) -> dict[str, Any]:
        """optstack's chained state dict (stages and loss scaler); loads back with ``load_state_dict``."""
        return self.built.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """All or nothing; a state dict from another model or group layout is a ``ValueError``."""
        self.built.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"MegatronOptimizer(optimizer={self.config.optimizer!r}, {self.built.optimizer!r})"


def get_megatron_optimizer(
    config: OptimizerConfig,
    model_chunks: nn.Module | Sequence[nn.Module],
    config_overrides: ConfigOverrides | None = None,
    use_gloo_process_groups: bool = True,
    pg_collection: Any = None,
    dump_param_to_param_group_map: str | None = None,
) -> MegatronOptimizer:
    """Build the optimizer for the model chunks, with Megatron Core's semantics.

    Args:
        config: the Megatron ``OptimizerConfig`` (``lr`` must be set).
        model_chunks: the model chunks (or one module).
        config_overrides: ``{ParamKey: ParamGroupOverride}``; None means the standard overrides, ``{}`` none.
            They may not change ``optimizer``, ``optimizer_cpu_offload`` or
            ``overlap_param_gather_with_optimizer_step``. For Muon, matrices Muon cannot take go to
            ``muon_scalar_optimizer`` as in Megatron. The caller's dict is not modified.
        use_gloo_process_groups: accepted for compatibility; optstack's communicator needs no extra groups.
        pg_collection: None, or the optstack ``ParallelGroups`` the ``DistributedDataParallel`` model was
            built with (the distributed optimizer always uses the wrapped model's groups).
        dump_param_to_param_group_map: a file path; the parameter name -> index into
            ``optimizer.param_groups`` map is written there as JSON (by rank 0, all ranks' names).

    Returns:
        A ``MegatronOptimizer``; expert parameters (``allreduce=False``) get an optimizer of their own,
        chained with the dense one (one grad norm, one skip decision).

    Data parallelism: pass the model wrapped in ``optstack.megatron.DistributedDataParallel`` (one chunk).
    ``use_distributed_optimizer`` builds the ZeRO-1 optimizer over its gradient buffers (parameters
    gathered after the step, overlapped with the next forward with ``overlap_param_gather``);
    ``use_layer_wise_distributed_optimizer`` (or ``optimizer='dist_muon'``) the layer-wise one for Muon's
    matrices; otherwise every rank steps the whole model on the all-reduced gradients. Bucket size and
    gradient dtype are the wrapper's (``DistributedDataParallelConfig``). ``step()`` finishes the gradient
    sync itself if the training loop did not; ``zero_grad()`` zeroes the wrapper's grad buffers.

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
    if config_overrides is None:
        config_overrides = get_standard_config_overrides(config)
    check_config_overrides_consistency(config, config_overrides)
    core_config = to_core(config)
    rules = to_rules(config, config_overrides)
    if core_config.algorithm == "muon":
        rules.append(muon_routing_rule(core_config.muon.scalar_algorithm))
    chunks = as_chunks(model_chunks)
    _check_data_parallel(config, chunks, pg_collection)
    _, resolved = resolve_chunks(chunks, rules)  # Megatron's matching, on each chunk's own names
    built = build_optimizer(core_config, chunks, resolved=resolved)
    if dump_param_to_param_group_map is not None:
        _dump_group_map(built, dump_param_to_param_group_map)
    return MegatronOptimizer(built, config)


def _check_data_parallel(config: OptimizerConfig, chunks: list[nn.Module], pg_collection: Any) -> None:
    """The optimizer config must agree with how the model was wrapped (Megatron's training script derives
    both configs from the same arguments; here they are built separately, so say which one to change)."""
    wrapped = [c for c in chunks if isinstance(c, DataParallel)]
    if pg_collection is not None and not (
        isinstance(pg_collection, ParallelGroups) and any(c.groups is pg_collection for c in wrapped)
    ):
        raise ValueError(
            "get_megatron_optimizer(pg_collection=...) must be None or the optstack ParallelGroups the "
            "DistributedDataParallel model was built with (the optimizer uses the wrapped model's groups); "
            f"got {type(pg_collection).__name__}; pass pg_collection=None"
        )
    layer_wise = config.use_layer_wise_distributed_optimizer or config.optimizer == "dist_muon"
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
        if ddp_config.use_distributed_optimizer != config.use_distributed_optimizer:
            why = (" (the layer-wise optimizer needs whole reduced gradients: build the wrapper with "
                   "use_distributed_optimizer=False)" if layer_wise else "; set both the same")
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
