"""Megatron Core's ``DistributedDataParallel`` and ``DistributedDataParallelConfig`` over optstack's wrapper.

``from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig`` becomes
``from optstack.megatron import ...``. ``DistributedDataParallelConfig`` has Megatron's field names, order
and defaults; ``DistributedDataParallel(config, ddp_config, module)`` translates it into the core
``optstack.distributed.ddp.DataParallel`` (it *is* one, so ``get_megatron_optimizer`` and ``build_optimizer``
take it as the wrapped model):

- ``use_distributed_optimizer`` -> sharded gradients (ZeRO-1: each rank needs only its range reduced);
- ``grad_reduce_in_fp32`` -> an fp32 gradient buffer (else the parameter dtype);
- ``overlap_grad_reduce`` -> bucket reductions launched from the backward hooks;
- ``bucket_size`` -> elements per bucket, as Megatron sizes it: None means max(40M, 1M x data-parallel
  size), and there is a single bucket per buffer without ``overlap_grad_reduce``, with
  ``disable_bucketing``, or on a pipeline stage after the first;
- ``check_for_nan_in_grad`` -> the non-finite check before each bucket's reduction;
- ``average_in_collective``: gradients are averaged over data-parallel ranks either way (optstack divides
  before the sum, Megatron's ``average_in_collective=False`` path); the numbers are the same.
  ``config.calculate_per_token_loss=True`` sums instead, as in Megatron.
- ``overlap_param_gather`` is carried out by the optimizer's ZeRO-1 stage (it owns the gathers);
  ``get_megatron_optimizer`` requires the optimizer config to agree with this one.

Fields that only configure Megatron FSDP (``data_parallel_sharding_strategy``,
``suggested_communication_unit_size``, ``preserve_fp32_weights``, ``keep_fp8_transpose_cache``,
``fsdp_double_buffer``, ``outer_dp_sharding_strategy``, ``gradient_reduce_div_fusion``) and
``disable_symmetric_registration`` (NCCL user buffers) are accepted and change nothing while
``use_megatron_fsdp`` and ``nccl_ub`` are False, as in Megatron. Every other field set to a value optstack
does not implement is a ``ValueError`` naming it.

Not offered: ``param.main_grad`` (optstack sets no attributes on parameters; ``ddp.main_grad(param)`` is the
gradient in the buffer), ``start_grad_sync`` / ``start_param_sync`` and the forward pre-hook switches (the
optimizer stage owns the parameter gathers: ``MegatronOptimizer.finish_param_sync()`` waits for them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from optstack.distributed.ddp import DataParallel
from optstack.distributed.parallel import ParallelGroups

__all__ = ["DistributedDataParallel", "DistributedDataParallelConfig", "check_ddp_config", "megatron_bucket_size"]

_SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass
class DistributedDataParallelConfig:
    """Configuration of ``DistributedDataParallel``, with Megatron Core's field names, order and defaults.

    The meaning of each field is Megatron's; the module docstring says how optstack carries out the ones it
    supports. A mutable dataclass, as in Megatron: it is checked at construction and again when a
    ``DistributedDataParallel`` is built from it (which keeps its own copy and never modifies it).
    """

    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    align_param_gather: bool = False
    use_distributed_optimizer: bool = False
    num_distributed_optimizer_instances: int = 1
    check_for_nan_in_grad: bool = False
    check_for_large_grads: bool = False
    bucket_size: int | None = None
    pad_buckets_for_high_nccl_busbw: bool = False
    reduce_scatter_with_fp32_accumulation: bool = False
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


# (field, the only supported value, why / what to do instead)
_FIXED_FIELDS: tuple[tuple[str, object, str], ...] = (
    ("align_param_gather", False,
     "parameter gathers are launched by the optimizer step, not by a pipeline schedule; set it False"),
    ("num_distributed_optimizer_instances", 1,
     "partial distributed optimizers are not implemented; ZeRO-1 shards over the whole data-parallel group"),
    ("check_for_large_grads", False, "the large-gradient check is not implemented; set it False"),
    ("pad_buckets_for_high_nccl_busbw", False,
     "optstack pads buckets only to split evenly across ranks (aligned); set it False"),
    ("reduce_scatter_with_fp32_accumulation", False,
     "use grad_reduce_in_fp32=True to accumulate and reduce gradients in fp32"),
    ("fp8_param_gather", False, "FP8 parameters are not implemented; set it False"),
    ("fp4_param_gather", False, "FP4 parameters are not implemented; set it False"),
    ("reuse_grad_buf_for_mxfp8_param_ag", False, "MXFP8 parameters are not implemented; set it False"),
    ("use_megatron_fsdp", False,
     "Megatron FSDP is not implemented; use use_distributed_optimizer=True for ZeRO-1"),
    ("use_custom_fsdp", False,
     "Megatron FSDP is not implemented; use use_distributed_optimizer=True for ZeRO-1"),
    ("nccl_ub", False, "NCCL user-buffer registration is not implemented; set it False"),
    ("delay_wgrad_compute", False, "delayed weight-gradient computation is not implemented; set it False"),
)
_BOOL_FIELDS = ("grad_reduce_in_fp32", "overlap_grad_reduce", "overlap_param_gather",
                "use_distributed_optimizer", "check_for_nan_in_grad", "average_in_collective")


def check_ddp_config(config: DistributedDataParallelConfig) -> None:
    """Raise a ``ValueError`` naming the first field of ``config`` that is invalid or unsupported."""
    for field, allowed, fix in _FIXED_FIELDS:
        value = getattr(config, field)
        if value != allowed or type(value) is not type(allowed):
            raise ValueError(f"DistributedDataParallelConfig.{field}={value!r} is not supported by optstack; "
                             f"{fix}")
    for field in _BOOL_FIELDS:
        value = getattr(config, field)
        if not isinstance(value, bool):
            raise ValueError(f"DistributedDataParallelConfig.{field} must be True or False, got {value!r}")
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
    if config.overlap_param_gather and not config.use_distributed_optimizer:
        raise ValueError(
            "DistributedDataParallelConfig.overlap_param_gather=True needs use_distributed_optimizer=True "
            "(only sharded parameters are gathered)"
        )


def megatron_bucket_size(config: DistributedDataParallelConfig, *, dp_size: int, bucketing: bool) -> int | None:
    """Elements per bucket as Megatron chooses them (None: one bucket per buffer).

    Megatron's default grows with the data-parallel size so that each rank's part of a bucket stays large
    enough for the collectives to be bandwidth-bound rather than latency-bound.
    """
    if not bucketing or not config.overlap_grad_reduce:
        return None
    if config.bucket_size is None:
        return max(40_000_000, 1_000_000 * dp_size)
    return config.bucket_size


class DistributedDataParallel(DataParallel):
    """Megatron's data-parallel wrapper: contiguous gradient buffers, bucketed (overlapped) reductions.

    Args:
        config: Megatron's ``TransformerConfig`` (or None); only ``calculate_per_token_loss`` is read
            (True: gradients are summed over data-parallel ranks instead of averaged).
        ddp_config: the ``DistributedDataParallelConfig`` (copied; the caller's object is not modified).
        module: the model; its trainable parameters become views into the parameter buffers, so move it to
            its device and dtype before wrapping.
        disable_bucketing: one bucket per buffer whatever ``bucket_size`` says.
        pg_collection: None (torch.distributed's world, every rank data-parallel; one process works without
            it) or an optstack ``ParallelGroups`` (e.g. ``ParallelGroups.from_world(tp=2)``). Megatron's
            ``ProcessGroupCollection`` is not accepted: wrap its groups with
            ``ParallelGroups.from_process_groups(dp=..., tp=..., ...)``.

    Attributes:
        module: the wrapped model. config / ddp_config: as given (``ddp_config`` a copy).
        bucket_size: the elements per bucket in effect (None: one bucket per buffer).

    Training loop (Megatron's)::

        model = DistributedDataParallel(transformer_config, ddp_config, model)
        optimizer = get_megatron_optimizer(optimizer_config, [model])
        for batch in batches:
            model.zero_grad_buffer()
            optimizer.zero_grad()
            loss_fn(model(batch)).backward()      # with model.no_sync() for all but the last micro-batch
            model.finish_grad_sync()
            update_successful, grad_norm, num_zeros = optimizer.step()

    Raises:
        ValueError: an invalid or unsupported ``ddp_config`` value (naming the field), per-token loss with
            ``average_in_collective``, a bad ``pg_collection``, or data-parallel ranks wrapping different
            parameters.
    """

    def __init__(
        self,
        config: Any,
        ddp_config: DistributedDataParallelConfig,
        module: nn.Module,
        disable_bucketing: bool = False,
        pg_collection: ParallelGroups | None = None,
    ) -> None:
        if not isinstance(ddp_config, DistributedDataParallelConfig):
            raise ValueError(f"ddp_config must be an optstack.megatron.DistributedDataParallelConfig, got "
                             f"{type(ddp_config).__name__}")
        if not isinstance(module, nn.Module):
            raise ValueError(f"module must be an nn.Module, got {type(module).__name__}")
        check_ddp_config(ddp_config)
        if pg_collection is not None and not isinstance(pg_collection, ParallelGroups):
            raise ValueError(
                f"pg_collection must be None (torch.distributed's world) or an optstack ParallelGroups, got "
                f"{type(pg_collection).__name__}; wrap Megatron's process groups with "
                "ParallelGroups.from_process_groups(dp=..., tp=..., pp=..., ep=..., expert_dp=...)"
            )
        per_token_loss = bool(getattr(config, "calculate_per_token_loss", False))
        if per_token_loss and ddp_config.average_in_collective:
            raise ValueError(
                "DistributedDataParallelConfig.average_in_collective=True cannot be used with "
                "config.calculate_per_token_loss=True (per-token losses are summed, not averaged); set "
                "average_in_collective=False"
            )
        groups = pg_collection if pg_collection is not None else ParallelGroups.from_world()
        # Later pipeline stages are off the critical path: one bucket each, as in Megatron.
        bucket_size = megatron_bucket_size(ddp_config, dp_size=groups.dp.size,
                                           bucketing=not disable_bucketing and groups.pp.rank == 0)
        super().__init__(
            module,
            groups=groups,
            bucket_size=bucket_size,
            grad_dtype=torch.float32 if ddp_config.grad_reduce_in_fp32 else None,
            overlap_grad_reduce=ddp_config.overlap_grad_reduce,
            shard_grads=ddp_config.use_distributed_optimizer,
            average=not per_token_loss,
            check_for_nan=ddp_config.check_for_nan_in_grad,
        )
        self.config = config
        self.ddp_config = dataclasses.replace(ddp_config)
        self.bucket_size = bucket_size

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every gradient in the buffers by ``scaling_factor`` (e.g. 1 / tokens, after
        ``finish_grad_sync``, with ``calculate_per_token_loss``)."""
        with torch.no_grad():
            for buffer in self.param_and_grad_buffers:
                buffer.grad_data.mul_(scaling_factor)

    def broadcast_params(self) -> None:
        """Copy data-parallel rank 0's parameters to every rank (expert parameters: expert data-parallel
        rank 0's), one broadcast per buffer."""
        with torch.no_grad():
            for buffer in self.param_and_grad_buffers:
                self.reduce_comm(buffer).broadcast(buffer.param_data, 0)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's state dict (no ``module.`` prefix), as Megatron's wrapper returns it."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True) -> Any:  # type: ignore[override]
        """Copy ``state_dict`` (the wrapped module's keys) into the parameters in place, so they stay in
        the buffers."""
        return self.module.load_state_dict(state_dict, strict=strict)
