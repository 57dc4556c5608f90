"""Megatron's ``FullyShardedDataParallel`` (Megatron-FSDP, ``use_megatron_fsdp=True``) on torch's FSDP2.

``fully_shard`` is applied to each FSDP unit of the module and to the module itself, on the data-parallel mesh, so
its parameters become DTensors that ``get_megatron_optimizer`` steps through optstack's DTensor placement
(``optstack.stage.dtensor``: state for the local shard only, fp32 masters for bf16 parameters)::

    ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                               data_parallel_sharding_strategy="optim_grads_params")
    model = FullyShardedDataParallel(transformer_config, ddp_config, model)
    optimizer = get_megatron_optimizer(OptimizerConfig(..., use_distributed_optimizer=True), [model])

Megatron's fields on FSDP2:

- ``data_parallel_sharding_strategy``: ``"optim_grads_params"`` (ZeRO-3) reshards after forward;
  ``"optim_grads"`` (ZeRO-2) keeps a unit's parameters gathered from its forward to its backward; ``"no_shard"``
  replicates (an HSDP mesh of dp x 1, gradients all-reduced). ``"optim"`` is refused: ``DistributedDataParallel``
  with ``use_distributed_optimizer=True`` is optstack's ZeRO-1.
- ``num_distributed_optimizer_instances`` = R > 1: HSDP, R replicas each sharding over dp / R consecutive ranks.
- FSDP units (``fsdp_unit_modules``): module classes or submodules given their own ``fully_shard``; None: with
  ``"optim_grads_params"`` every child of an ``nn.ModuleList`` / ``nn.Sequential`` (Megatron's
  ``TransformerLayer`` default), otherwise the root alone.
- ``grad_reduce_in_fp32`` -> ``MixedPrecisionPolicy(reduce_dtype=float32)``; ``config.calculate_per_token_loss``
  -> gradients summed over ranks (divide factor 1).
- ``overlap_grad_reduce`` / ``overlap_param_gather`` / ``bucket_size`` / ``suggested_communication_unit_size`` /
  ``average_in_collective`` / ``gradient_reduce_div_fusion``: accepted; FSDP2 always overlaps, per unit.
- ``check_for_nan_in_grad``, ``preserve_fp32_weights=False``, ``fsdp_double_buffer``, ``keep_fp8_transpose_cache``,
  ``outer_dp_sharding_strategy`` other than "no_shard": refused, naming the field.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from optstack.distributed.comm import device_mesh, is_initialized
from optstack.distributed.parallel import ParallelGroups
from optstack.megatron.ddp_config import DistributedDataParallelConfig, check_ddp_config
from optstack.megatron.process_groups import ProcessGroupCollection, megatron_mpu_collection, to_parallel_groups

__all__ = ["FullyShardedDataParallel", "default_fsdp_units"]


def default_fsdp_units(module: nn.Module) -> list[nn.Module]:
    """The model's layers: every trainable child of an ``nn.ModuleList`` or ``nn.Sequential`` inside ``module``
    (outermost containers only), the generic stand-in for Megatron's ``TransformerLayer`` units."""
    if isinstance(module, (nn.ModuleList, nn.Sequential)):
        return [c for c in module.children() if any(p.requires_grad for p in c.parameters())]
    return [unit for child in module.children() for unit in default_fsdp_units(child)]


def _units(module: nn.Module, unit_modules: Sequence[type[nn.Module] | nn.Module] | None,
           strategy: str) -> list[nn.Module]:
    if unit_modules is None:
        return default_fsdp_units(module) if strategy == "optim_grads_params" else []
    classes = tuple(u for u in unit_modules if isinstance(u, type))
    instances = {id(u) for u in unit_modules if isinstance(u, nn.Module)}
    bad = [u for u in unit_modules if not isinstance(u, type | nn.Module)]
    if bad:
        raise ValueError(f"fsdp_unit_modules must hold nn.Module classes or submodules, got {bad[0]!r}")
    found: list[nn.Module] = []
    inside: set[int] = set()  # units are not nested: the outermost match wins
    for sub in module.modules():
        if sub is module or id(sub) in inside:
            continue
        if (classes and isinstance(sub, classes)) or id(sub) in instances:
            found.append(sub)
            inside.update(id(m) for m in sub.modules())
    return found


class FullyShardedDataParallel(nn.Module):
    """Megatron's Megatron-FSDP wrapper on torch's FSDP2 (module docstring).

    Args:
        config: Megatron's ``TransformerConfig`` (or None); only ``calculate_per_token_loss`` is read.
        ddp_config: a ``DistributedDataParallelConfig`` with ``use_megatron_fsdp=True`` (copied).
        module: the model, on its device and dtype; ``fully_shard`` is applied to it in place.
        fsdp_unit_modules: module classes (or submodules) sharded as units; None: module docstring.
        disable_bucketing: accepted (FSDP2 communicates per unit).
        device: accepted; the parameters' device is used.
        pg_collection: None (torch.distributed's world), Megatron's ``ProcessGroupCollection`` (its ``dp_cp`` or
            ``dp``) or an optstack ``ParallelGroups``; tensor, pipeline and expert parallel sizes must be 1.

    Raises:
        ValueError: ``use_megatron_fsdp`` not set, an unsupported field (named), torch.distributed not
            initialised, or model parallelism in ``pg_collection``.
    """

    def __init__(self, config: Any, ddp_config: DistributedDataParallelConfig, module: nn.Module,
                 fsdp_unit_modules: Sequence[type[nn.Module] | nn.Module] | None = None,
                 disable_bucketing: bool = False, device: torch.device | None = None,
                 pg_collection: ProcessGroupCollection | ParallelGroups | None = None) -> None:
        super().__init__()
        if not isinstance(ddp_config, DistributedDataParallelConfig):
            raise ValueError(f"ddp_config must be an optstack.megatron.DistributedDataParallelConfig, got "
                             f"{type(ddp_config).__name__}")
        check_ddp_config(ddp_config)
        if not ddp_config.use_megatron_fsdp:
            raise ValueError("FullyShardedDataParallel needs DistributedDataParallelConfig.use_megatron_fsdp=True; "
                             "for data parallelism over gradient buffers use DistributedDataParallel")
        if not isinstance(module, nn.Module):
            raise ValueError(f"module must be an nn.Module, got {type(module).__name__}")
        if not is_initialized():
            raise ValueError("FullyShardedDataParallel needs torch.distributed initialised (FSDP2 runs on a "
                             "DeviceMesh); call torch.distributed.init_process_group() first")
        if pg_collection is None:  # Megatron's parallel_state groups when the program initialised them
            pg_collection = megatron_mpu_collection()
        groups = (to_parallel_groups(pg_collection) if isinstance(pg_collection, ProcessGroupCollection)
                  else pg_collection if pg_collection is not None else ParallelGroups.from_world())
        if not isinstance(groups, ParallelGroups):
            raise ValueError(f"pg_collection must be None, a ProcessGroupCollection or an optstack ParallelGroups, "
                             f"got {type(pg_collection).__name__}")
        for name in ("tp", "pp", "ep"):
            if getattr(groups, name).size != 1:
                raise ValueError(f"pg_collection.{name} has size {getattr(groups, name).size}: optstack's "
                                 "FullyShardedDataParallel is data-parallel only; for tensor parallelism apply "
                                 "parallelize_module and fully_shard on a 2-D DeviceMesh yourself")
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        strategy = ddp_config.data_parallel_sharding_strategy
        dp = groups.dp
        replicas = dp.size if strategy == "no_shard" else ddp_config.num_distributed_optimizer_instances
        params = [p for p in module.parameters() if p.requires_grad]
        device_type = params[0].device.type if params else "cpu"
        self.device_mesh = device_mesh(dp, device_type, replicas=replicas)
        policy = MixedPrecisionPolicy(reduce_dtype=torch.float32 if ddp_config.grad_reduce_in_fp32 else None)
        kwargs = {"mesh": self.device_mesh, "mp_policy": policy,
                  "reshard_after_forward": strategy == "optim_grads_params"}
        self.fsdp_units = _units(module, fsdp_unit_modules, strategy)
        for unit in self.fsdp_units:
            fully_shard(unit, **kwargs)
        self.module = fully_shard(module, **kwargs)
        self.config = config
        self.ddp_config = dataclasses.replace(ddp_config)
        self.groups = groups
        if getattr(config, "calculate_per_token_loss", False):
            for m in self._fsdp_modules():
                m.set_gradient_divide_factor(1.0)  # summed over ranks, as Megatron's per-token losses

    def _fsdp_modules(self) -> list[Any]:
        from torch.distributed.fsdp import FSDPModule

        return [m for m in self.module.modules() if isinstance(m, FSDPModule)]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def zero_grad_buffer(self) -> None:
        """Drop every gradient (FSDP2 keeps no separate gradient buffer)."""
        for p in self.module.parameters():
            p.grad = None

    def start_grad_sync(self, *unused: Any, **unused_kwargs: Any) -> None:
        """A no-op: FSDP2 starts each unit's reduce-scatter inside backward."""

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """A no-op: FSDP2's backward waits for its reductions before returning.

        Raises:
            ValueError: ``force_all_reduce=True`` (FSDP2 gradients stay sharded).
        """
        if force_all_reduce:
            raise ValueError("finish_grad_sync(force_all_reduce=True) is not supported with use_megatron_fsdp=True: "
                             "FSDP2 reduce-scatters gradients into shards; full_tensor() a gradient to see it whole")

    def start_param_sync(self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """A no-op: FSDP2 gathers each unit's parameters in its forward pre-hook."""

    def finish_param_sync(self) -> None:
        """A no-op (``start_param_sync``)."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward accumulates gradients without reducing them; the first backward after it reduces."""
        modules = self._fsdp_modules()
        for m in modules:
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for m in modules:
                m.set_requires_gradient_sync(True, recurse=False)

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every (local shard of a) gradient by ``scaling_factor``."""
        with torch.no_grad():
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(scaling_factor)

    def broadcast_params(self) -> None:
        """A no-op: no rank holds a replica of another's shard, and FSDP2 builds replicas from rank 0's module."""

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's state dict (DTensor values, no ``module.`` prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
                           ) -> dict[str, Any]:
        """The model's part of a distributed checkpoint: the module's DTensor state dict, keys prefixed."""
        return {prefix + k: v for k, v in self.module.state_dict().items()}

    def load_state_dict(self, state_dict: Any, strict: bool = True) -> Any:  # type: ignore[override]
        """Load the wrapped module's keys (DTensors, or whole tensors that FSDP2 shards)."""
        return self.module.load_state_dict(state_dict, strict=strict)
