"""Megatron Core's ``DistributedDataParallel`` and ``DistributedDataParallelConfig`` over optstack's wrapper.

``from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig`` becomes
``from optstack.megatron import ...``. ``DistributedDataParallelConfig`` has Megatron's field names, order
and defaults; ``DistributedDataParallel(config, ddp_config, module)`` translates it into the core
``optstack.distributed.ddp.DataParallel`` (it *is* one, so ``get_megatron_optimizer`` and ``build_optimizer``
take it as the wrapped model):

- ``use_distributed_optimizer`` -> sharded gradients (ZeRO-1: each rank needs only its range reduced), by a
  reduce-scatter on every backend (emulated on gloo), so ranges a rank does not own hold its own scaled, unreduced
  gradients, as in Megatron;
- ``num_distributed_optimizer_instances`` > 1 -> a partial distributed optimizer: buckets are sharded inside each
  instance (runs of consecutive data-parallel ranks, or ``pg_collection.intra_dp_cp``), reduced inside it into
  each rank's shard, then that shard all-reduced across instances (over the ranks holding the same shard, or
  ``pg_collection.inter_dist_opt``), as Megatron does; each instance keeps optimizer state for its shards only.
  ``force_all_reduce`` all-reduces over the whole data-parallel group (whole gradients on every rank; Megatron's
  reduces only the owned shard across instances);
- ``grad_reduce_in_fp32`` -> an fp32 gradient buffer (else the parameter dtype);
- ``param_name_patterns_for_fp32_local_accumulation`` -> the matching parameters (fnmatch on the wrapped
  module's names; ``'all'``: every one) accumulate their gradients in an fp32 tensor of their own, rounded into
  the buffer for the reduction and given the reduced gradient back (the core's ``local_grad_dtypes``);
- ``overlap_grad_reduce`` -> bucket reductions launched from the backward hooks;
- ``bucket_size`` -> elements per bucket, as Megatron sizes it: None means max(40M, 1M x data-parallel
  size), and there is a single bucket per buffer without ``overlap_grad_reduce``, with
  ``disable_bucketing``, or on a pipeline stage after the first; ``num_buckets`` instead -> the wrapped module's
  parameter count // ``num_buckets`` elements per bucket (Megatron's training script resolves it so, over all
  model chunks);
- ``check_for_nan_in_grad`` -> the non-finite check before each bucket's reduction;
- ``average_in_collective``: gradients are averaged over data-parallel ranks either way: False divides each
  bucket by the data-parallel size before the sum, True averages in the collective (after the sum), so, as in
  Megatron, ranges a rank does not own under a reduce-scatter stay unscaled.
  ``config.calculate_per_token_loss=True`` sums instead, as in Megatron.
- ``overlap_param_gather`` is carried out by the optimizer's ZeRO-1 stage (it owns the gathers);
  ``get_megatron_optimizer`` requires the optimizer config to agree with this one. Without
  ``use_distributed_optimizer`` it is for the layer-wise optimizer (Megatron's current main): the bucket groups
  gather what each rank stepped (``start_param_sync``, ``next_param_gather_bucket_group``, the forward pre-hooks
  and ``enable_forward_pre_hook`` / ``disable_forward_pre_hook``), as Megatron's do, into ``grad_data``.

Fields that only configure Megatron FSDP (``data_parallel_sharding_strategy``,
``suggested_communication_unit_size``, ``preserve_fp32_weights``, ``keep_fp8_transpose_cache``,
``fsdp_double_buffer``, ``outer_dp_sharding_strategy``, ``gradient_reduce_div_fusion``) and
``disable_symmetric_registration`` (NCCL user buffers) are accepted and change nothing while
``use_megatron_fsdp`` and ``nccl_ub`` are False, as in Megatron. ``use_megatron_fsdp=True`` is for Megatron's
``FullyShardedDataParallel`` wrapper (``optstack.megatron.fsdp``, on FSDP2, which reads those fields);
``DistributedDataParallel`` refuses it, naming that wrapper. Every other field set to a value optstack does not
implement is a ``ValueError`` naming it.

Buckets are cut as Megatron cuts them (``optstack.distributed.buffers.Bucketing``): in backward order, a bucket
closes once it holds ``bucket_size`` elements or more; with ``use_distributed_optimizer`` parameters start at
multiples of 64 elements, buckets are padded to a multiple of ``lcm(data-parallel size, 128)`` and a parameter
with a truthy ``shared_embedding`` attribute gets a bucket of its own; without it nothing is padded.

Megatron's public surface: ``buffers`` / ``expert_parallel_buffers`` (optstack's ``ParamAndGradBuffer``: ``param_data``,
``grad_data``, ``buckets``, ``numel``, ``numel_unpadded``), ``bucket_groups`` / ``expert_parallel_bucket_groups``
(one ``BucketGroup`` per bucket), ``register_grad_ready``, ``start_grad_sync``, ``finish_grad_sync(force_all_reduce=)``,
``start_param_sync``, ``scale_gradients``, ``zero_grad_buffer``, ``broadcast_params``, ``no_sync``.

``param.main_grad`` is Megatron's: the parameter's view of its gradient buffer (this face sets it; the core sets no
attributes), zeroed by ``zero_grad_buffer`` (eagerly, so it reads zero). A tensor the caller assigns to it instead
is taken, as Megatron's optimizers read ``param.main_grad``: ``finish_grad_sync`` (which the optimizers' step and
``prepare_grads`` call) copies it into the buffer view and makes ``main_grad`` the view again.
``finish_grad_sync()`` called again with no
gradient in between is a no-op. Megatron does the same with ``overlap_grad_reduce``; without it Megatron reduces the
buffers again. optstack cannot: its optimizers call ``finish_grad_sync()`` at the start of each step (so a loop that
forgets it still steps reduced gradients), after Megatron's loop already did, and a second reduction would sum the
sums with per-token losses (x data-parallel size) and, under a reduce-scatter, fold other ranks' unreduced ranges
into the owned shard. To reduce what the buffers hold on purpose: ``finish_grad_sync(force_all_reduce=True)``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from optstack.distributed.buffers import Bucket, Bucketing, ParamAndGradBuffer
from optstack.distributed.comm import Comm, NullComm, new_subgroups, world_comm
from optstack.distributed.ddp import DataParallel
from optstack.distributed.parallel import ParallelGroups
from optstack.megatron.param_and_grad_buffer import (
    BucketView,
    BufferView,
    FullParamLayout,
    megatron_bucketing_for,
    megatron_key,
)
from optstack.megatron.process_groups import (
    ProcessGroupCollection,
    collection_group,
    megatron_mpu_collection,
    to_parallel_groups,
)

__all__ = ["BucketGroup", "DDPConfigAssertion", "DistributedDataParallel", "DistributedDataParallelConfig",
           "GradSyncError", "check_ddp_config", "megatron_bucket_size", "megatron_bucketing", "partition_buckets"]

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
    ("pad_buckets_for_high_nccl_busbw", False,
     "optstack pads buckets only to split evenly across ranks (aligned); set it False"),
    ("reduce_scatter_with_fp32_accumulation", False,
     "use grad_reduce_in_fp32=True to accumulate and reduce gradients in fp32"),
    ("fp8_param_gather", False, "FP8 parameters are not implemented; set it False"),
    ("fp4_param_gather", False, "FP4 parameters are not implemented; set it False"),
    ("reuse_grad_buf_for_mxfp8_param_ag", False, "MXFP8 parameters are not implemented; set it False"),
    ("nccl_ub", False, "NCCL user-buffer registration is not implemented; set it False"),
    ("delay_wgrad_compute", False, "delayed weight-gradient computation is not implemented; set it False"),
)
_BOOL_FIELDS = ("grad_reduce_in_fp32", "overlap_grad_reduce", "overlap_param_gather",
                "use_distributed_optimizer", "check_for_nan_in_grad", "average_in_collective")


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
    for field in ("use_megatron_fsdp", "use_custom_fsdp"):
        if not isinstance(getattr(config, field), bool):
            raise ValueError(f"DistributedDataParallelConfig.{field} must be True or False, got "
                             f"{getattr(config, field)!r}")
    if config.use_custom_fsdp and not config.use_megatron_fsdp:
        raise ValueError("DistributedDataParallelConfig.use_custom_fsdp=True is not supported alone: it is "
                         "Megatron's deprecated name; set use_megatron_fsdp=True (Megatron sets both)")
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
    """Elements per bucket as Megatron chooses them (None: one bucket per buffer).

    ``num_buckets`` set: ``num_parameters // num_buckets`` (Megatron's training script counts every parameter of
    the model chunks; here of the wrapped module). Megatron's default grows with the data-parallel size so that
    each rank's part of a bucket stays large enough for the collectives to be bandwidth-bound rather than
    latency-bound.
    """
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
    parameters whose name matches a pattern (fnmatch; ``'all'`` matches every one)."""
    return {name: torch.float32 for name, p in module.named_parameters()
            if p.requires_grad and any(pat == "all" or fnmatch.fnmatch(name, pat) for pat in patterns)}


def _layer_wise_managed(name: str, param: nn.Parameter) -> bool:
    """Whether ``param`` goes to a whole-shard buffer: tagged for the layer-wise optimizer by Megatron's
    ``tag_params_for_buffer_routing`` (``is_managed_by_layer_wise_optimizer``)."""
    return bool(getattr(param, "is_managed_by_layer_wise_optimizer", False))


def megatron_bucketing(module: nn.Module, *, dp_size: int, distributed_optimizer: bool) -> Bucketing:
    """Megatron's bucket boundaries (module docstring) for ``module``'s parameters."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    return megatron_bucketing_for(named, distributed_optimizer=distributed_optimizer)


# Live wrappers, so partition_buckets (Megatron's signature: buffers only) finds the wrapper of its buffers.
_WRAPPERS: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()


def wrapper_holding(params: list[torch.Tensor]) -> DistributedDataParallel | None:
    """The live ``DistributedDataParallel`` whose buffers hold every parameter of ``params`` (None if none)."""
    for ddp in list(_WRAPPERS):
        if params and all(id(p) in ddp._main_grad_views for p in params):
            return ddp
    return None


class _BufferList(list):
    """Megatron's ``model.buffers`` (a list of grad buffers) that is still ``nn.Module.buffers`` when called, so
    code iterating module buffers (``model.buffers()``) keeps working."""

    def __init__(self, items: list[BufferView], module: nn.Module) -> None:
        super().__init__(items)
        self._module = module

    def __call__(self, recurse: bool = True) -> Any:
        return nn.Module.buffers(self._module, recurse)


class GradSyncError(RuntimeError, AssertionError):
    """A gradient sync asked for out of order (Megatron asserts; an ``AssertionError`` too, for its callers)."""


class _Handles:
    """The broadcasts of one bucket group's layer-wise gather, waited for as one (Megatron's handle)."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def wait(self) -> None:
        for handle in self.handles:
            handle.wait()
        self.handles = []


class BucketGroup:
    """Megatron's bucket group: buckets of the wrapper whose reductions are started and finished together
    (one bucket each, as ``DistributedDataParallel.bucket_groups`` has them; several with
    ``partition_buckets(..., force_single_bucket_group=True)``).

    Attributes:
        buckets: its buckets (``param_data``, ``grad_data``, ``params``, ``numel_unpadded``).
        params: their parameters (a set).
    """

    def __init__(self, ddp: DistributedDataParallel, positions: int | list[int]) -> None:
        self._ddp = ddp
        self._positions = [positions] if isinstance(positions, int) else sorted(positions)
        order = ddp.bucket_order
        self.buffer: ParamAndGradBuffer = order[self._positions[0]][0]
        self._core_buckets: list[Bucket] = [order[p][1] for p in self._positions]
        view = ddp._view_of(self.buffer)
        self.buckets: list[BucketView] = [view.buckets[b.index] for b in self._core_buckets]
        self.params = {p for bucket in self._core_buckets for p in bucket.params}
        self.intra_distributed_optimizer_instance_size = ddp.shard_comm(self.buffer).size
        self.param_gather_handle: Any = None  # the layer-wise gather in flight (its broadcasts, waited as one)
        self.param_gather_dispatched = False
        #: the group whose gather this one's finish starts (forward order; set with overlap_param_gather)
        self.next_param_gather_bucket_group: BucketGroup | None = None
        self._registered: set[torch.Tensor] = set()  # register_grad_ready calls this step
        self._first_batch = True  # Megatron's: registrations are recorded, the reduction waits for finish

    def __repr__(self) -> str:
        return f"BucketGroup(positions={self._positions}, {len(self.params)} params)"

    def register_grad_ready(self, param: torch.Tensor) -> None:
        """``param``'s gradient is complete in the buffer (for a gradient written there directly; the backward
        hooks need no call). As in Megatron, the first batch only records which parameters register; once
        ``reset()`` has ended it, the group's reduction starts when all of them have registered.

        Raises:
            GradSyncError: without ``overlap_grad_reduce`` (Megatron's assertion).
            ValueError: ``param`` is not in this bucket group.
        """
        if not self._ddp.ddp_config.overlap_grad_reduce:
            raise GradSyncError("register_grad_ready() should only be called when overlap_grad_reduce is True")
        if param not in self.params:
            raise ValueError(f"a parameter of shape {tuple(param.shape)} is not in this bucket group")
        self._registered.add(param)
        if not self._first_batch and len(self._registered) == len(self.params):
            for p in self._registered:
                self._ddp.grad_ready(p)
            self.start_grad_sync()

    def start_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Start this group's reductions (buckets earlier in the launch order start too: every rank reduces
        them in one order)."""
        self._ddp.start_grad_sync(through=self._positions[-1], force_all_reduce=force_all_reduce)

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Wait for this group's reductions (started here without ``overlap_grad_reduce``, or in the first batch).

        With ``overlap_grad_reduce`` after the first batch and a reduction not started yet: a no-op with
        ``num_distributed_optimizer_instances`` > 1 (as in Megatron), else an error.

        Raises:
            GradSyncError: with ``overlap_grad_reduce`` after the first batch, one instance, a parameter of the group
                not registered ready yet.
        """
        ddp = self._ddp
        if not all(ddp.bucket_launched(p) for p in self._positions):
            config = ddp.ddp_config
            if config.overlap_grad_reduce and not self._first_batch and config.num_distributed_optimizer_instances > 1:
                return  # Megatron: with several instances the reduction runs on its own stream; nothing to wait for
            if config.overlap_grad_reduce and not self._first_batch:
                raise GradSyncError(
                    f"the bucket's reduction has not started: {len(self._registered)} of {len(self.params)} "
                    "parameters have their gradient ready (call register_grad_ready for each, or "
                    "finish_grad_sync() on the model)")
            self.start_grad_sync(force_all_reduce)
        for position in self._positions:
            ddp.wait_bucket(position)
        ddp._finished.update(self._positions)
        if len(ddp._finished) == len(ddp.bucket_order):
            ddp.finish_grad_sync()  # every bucket done: reset for the next step

    def reset(self) -> None:
        """End the first batch (if parameters registered in it) and forget this step's registrations
        (``zero_grad_buffer`` calls it); the wrapper resets its own bookkeeping in ``finish_grad_sync`` and
        ``zero_grad_buffer``."""
        if self._first_batch and self._registered:
            self._first_batch = False
        self._registered = set()

    def start_param_sync(self, force_sync: bool = False) -> None:
        """Gather this group's parameters from the ranks that stepped them.

        Distributed optimizer: each rank's range of the buckets, synchronously. Layer-wise optimizer with
        ``overlap_param_gather`` (``bucket.layerwise_params_list`` set by it): each rank's parameters of the
        buckets, broadcast from their owner into ``grad_data`` (idle between the step and the next backward;
        zeroed once unpacked, as Megatron does), asynchronously unless ``force_sync`` (which also finishes a
        gather already in flight). Otherwise nothing to gather.

        Raises:
            GradSyncError: an asynchronous gather started while one is in flight (Megatron's assertion).
        """
        ddp = self._ddp
        if ddp.shard_grads:
            DataParallel.finish_param_sync(ddp)  # the optimizer's overlapped gathers still in flight land first
            for bucket in self._core_buckets:
                ddp._gather_bucket(self.buffer, bucket)
            self.param_gather_dispatched = True
            return
        if self.param_gather_handle is not None:
            if force_sync:
                self._wait_layer_wise()
                return
            raise GradSyncError("start_param_sync(): this bucket group's parameter gather is already in flight; "
                                "finish it first (finish_param_sync())")
        comm = ddp.shard_comm(self.buffer)
        handles = []
        with torch.no_grad():
            for bucket in self.buckets:
                bucket.layerwise_gather_list = None
                sizes = bucket.layerwise_param_flat_sizes
                if comm.size == 1 or not sizes or max(sizes) == 0:
                    continue
                # Megatron's: the gather lands in the gradient buffer, as the parameters' dtype
                receive = bucket.grad_data.view(bucket.params_list[0].dtype)
                parts = list(receive[:sum(sizes)].split(sizes))
                if sizes[comm.rank]:
                    torch.cat([p.detach().reshape(-1) for p in bucket.layerwise_params_list[comm.rank]],
                              out=parts[comm.rank])
                handles += [comm.broadcast_async(part, rank) for rank, part in enumerate(parts) if part.numel()]
                bucket.layerwise_gather_list = parts
        self.param_gather_handle = _Handles(handles) if handles else None
        self.param_gather_dispatched = True
        if force_sync or not ddp.ddp_config.overlap_param_gather:
            self._wait_layer_wise()

    def finish_param_sync(self, skip_next_bucket_dispatch: bool = False) -> None:
        """Finish this group's parameter gather (starting it first if it was not), then, unless
        ``skip_next_bucket_dispatch``, start the next group's (``next_param_gather_bucket_group``), as Megatron's
        forward pre-hooks do. The distributed optimizer's gathers are synchronous: nothing to wait for (the
        next group's starts all the same, so the chain reads as Megatron's)."""
        if self._ddp.shard_grads:
            if not self.param_gather_dispatched:
                self.start_param_sync()
            following = self.next_param_gather_bucket_group
            if following is not None and not skip_next_bucket_dispatch and not following.param_gather_dispatched:
                following.start_param_sync()
            self.param_gather_dispatched = False
            return
        if not self.param_gather_dispatched:
            self.start_param_sync()
        if self.param_gather_handle is None:
            return
        self.param_gather_handle.wait()
        following = self.next_param_gather_bucket_group
        if following is not None and not skip_next_bucket_dispatch and not following.param_gather_dispatched:
            following.start_param_sync()
        self._wait_layer_wise()

    def _wait_layer_wise(self) -> None:
        """Wait for a layer-wise gather in flight and copy what other ranks stepped into the parameters."""
        if self.param_gather_handle is None:
            return
        self.param_gather_handle.wait()
        self.param_gather_handle = None
        rank = self._ddp.shard_comm(self.buffer).rank
        with torch.no_grad():
            for bucket in self.buckets:
                if bucket.layerwise_gather_list is None or bucket.layerwise_params_list is None:
                    bucket.layerwise_gather_list = None
                    continue
                for owner, (params, part) in enumerate(zip(bucket.layerwise_params_list,
                                                           bucket.layerwise_gather_list, strict=True)):
                    if owner != rank and params:
                        for param, value in zip(params, part.split([p.numel() for p in params]), strict=True):
                            param.copy_(value.view_as(param))
                bucket.layerwise_gather_list = None
                bucket.grad_data.zero_()  # it held the gather, not gradients

    def free_overlap_buffers(self) -> None:
        """Finish a parameter gather in flight and drop the buckets' gather scratch (Megatron frees them
        before an asynchronous checkpoint save)."""
        self._wait_layer_wise()
        for bucket in self.buckets:
            bucket.layerwise_gather_list = None


def partition_buckets(buffers: list[ParamAndGradBuffer], force_single_bucket_group: bool = False
                      ) -> list[BucketGroup]:
    """Megatron's grouping of the buckets of ``buffers`` (one ``DistributedDataParallel``'s): a group per bucket,
    in launch order, or with ``force_single_bucket_group`` one group of every bucket.

    Raises:
        ValueError: ``buffers`` empty or not all of one live ``DistributedDataParallel``.
    """
    buffers = [getattr(b, "core", b) for b in buffers]  # BufferView or the core buffer
    owners = {id(ddp): ddp for ddp in list(_WRAPPERS)
              if any(b is own for b in buffers for own in ddp.param_and_grad_buffers)}
    if not buffers or len(owners) != 1:
        raise ValueError(f"partition_buckets: buffers must be a non-empty list of one DistributedDataParallel's "
                         f"buffers (model.buffers), got {len(buffers)} buffers of {len(owners)} wrappers")
    ddp = next(iter(owners.values()))
    ids = {id(b) for b in buffers}
    positions = [i for i, (buf, _) in enumerate(ddp.bucket_order) if id(buf) in ids]
    if force_single_bucket_group:
        return [BucketGroup(ddp, positions)]
    return [BucketGroup(ddp, p) for p in positions]


class DistributedDataParallel(DataParallel):
    """Megatron's data-parallel wrapper: contiguous gradient buffers, bucketed (overlapped) reductions.

    Args:
        config: Megatron's ``TransformerConfig`` (or None); only ``calculate_per_token_loss`` is read
            (True: gradients are summed over data-parallel ranks instead of averaged).
        ddp_config: the ``DistributedDataParallelConfig`` (copied; the caller's object is not modified).
        module: the model; its trainable parameters become views into the parameter buffers, so move it to
            its device and dtype before wrapping.
        disable_bucketing: one bucket per buffer whatever ``bucket_size`` says.
        pg_collection: None (the groups of Megatron's ``parallel_state`` when the program initialised it, as
            Megatron's wrapper; else torch.distributed's world, every rank data-parallel; one process works
            without it), Megatron's ``ProcessGroupCollection`` (its ``dp_cp`` or ``dp``, ``tp``, ``pp``, ``ep``,
            ``expt_dp``, ``mp`` groups) or an optstack ``ParallelGroups``.

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
        full_param_layout: FullParamLayout | None = None,
    ) -> None:
        if not isinstance(ddp_config, DistributedDataParallelConfig):
            raise ValueError(f"ddp_config must be an optstack.megatron.DistributedDataParallelConfig, got "
                             f"{type(ddp_config).__name__}")
        if not isinstance(module, nn.Module):
            raise ValueError(f"module must be an nn.Module, got {type(module).__name__}")
        check_ddp_config(ddp_config)
        if ddp_config.use_megatron_fsdp:
            raise ValueError("DistributedDataParallelConfig.use_megatron_fsdp=True: wrap the model with "
                             "optstack.megatron.FullyShardedDataParallel(config, ddp_config, module), Megatron's "
                             "wrapper for Megatron-FSDP (optstack builds it on torch's FSDP2), not "
                             "DistributedDataParallel")
        intra = inter = None
        if pg_collection is None:  # Megatron's wrapper then reduces over its parallel_state's groups
            pg_collection = megatron_mpu_collection()
        if isinstance(pg_collection, ProcessGroupCollection):
            intra = collection_group(pg_collection, "intra_dp_cp")
            inter = collection_group(pg_collection, "inter_dist_opt")
            pg_collection = to_parallel_groups(pg_collection)
        if pg_collection is not None and not isinstance(pg_collection, ParallelGroups):
            raise ValueError(
                f"pg_collection must be None (torch.distributed's world), a ProcessGroupCollection or an optstack "
                f"ParallelGroups, got {type(pg_collection).__name__}"
            )
        per_token_loss = bool(getattr(config, "calculate_per_token_loss", False))
        if per_token_loss and ddp_config.average_in_collective:
            raise ValueError(
                "DistributedDataParallelConfig.average_in_collective=True cannot be used with "
                "config.calculate_per_token_loss=True (per-token losses are summed, not averaged); set "
                "average_in_collective=False"
            )
        groups = pg_collection if pg_collection is not None else ParallelGroups.from_world()
        shard_group, cross_shard_group = _instance_groups(groups.dp, ddp_config.num_distributed_optimizer_instances,
                                                          intra, inter)
        # Later pipeline stages are off the critical path: one bucket each, as in Megatron.
        bucket_size = megatron_bucket_size(ddp_config, dp_size=groups.dp.size,
                                           bucketing=not disable_bucketing and groups.pp.rank == 0,
                                           num_parameters=sum(p.numel() for p in module.parameters()))
        super().__init__(
            module,
            groups=groups,
            bucket_size=bucket_size,
            grad_dtype=torch.float32 if ddp_config.grad_reduce_in_fp32 else None,
            overlap_grad_reduce=ddp_config.overlap_grad_reduce,
            shard_grads=ddp_config.use_distributed_optimizer,
            average=not per_token_loss,
            check_for_nan=ddp_config.check_for_nan_in_grad,
            bucketing=megatron_bucketing(module, dp_size=groups.dp.size,
                                         distributed_optimizer=ddp_config.use_distributed_optimizer),
            shard_group=shard_group,
            cross_shard_group=cross_shard_group,
            # Megatron's buffers hold unreduced gradients outside each rank's shard, on every backend (the core's
            # "auto" all-reduces whole buckets on gloo, where that is faster).
            sharded_reduction="reduce_scatter",
            divide_after_sum=ddp_config.average_in_collective,
            local_grad_dtypes=fp32_local_accumulation(
                module, ddp_config.param_name_patterns_for_fp32_local_accumulation),
            # Megatron's current main: parameters tagged for the layer-wise optimizer (tag_params_for_buffer_routing)
            # get whole-shard buffers of their own when gradients are reduce-scattered
            whole_shards=_layer_wise_managed if ddp_config.use_distributed_optimizer else None,
        )
        self.config = config
        self._finished: set[int] = set()  # bucket groups finished one by one this step
        self.ddp_config = dataclasses.replace(ddp_config)
        self.bucket_size = bucket_size
        self._views = {id(b): BufferView(b, self.shard_comm(b)) for b in self.param_and_grad_buffers}
        #: Megatron's current main: tagged matrices in whole-shard buffers (wrap_model_chunks_with_ddp)
        self._laid_out_for_layer_wise = any(b.key.whole for b in self.param_and_grad_buffers)
        self.full_param_layout = self._check_layout(full_param_layout)
        # Megatron's public contract: param.main_grad is the parameter's view of the gradient buffer (the face
        # only; the core sets no attributes). A tensor the caller assigns instead is taken at finish_grad_sync.
        self._main_grad_views: dict[int, torch.Tensor] = {}
        self._megatron_first_batch = True  # until the first finish_grad_sync (_launch_ready)
        self._synced_since_zero = False  # finish_grad_sync reduces at least once after zero_grad_buffer
        for buffer in self.param_and_grad_buffers:
            for param in buffer.params:
                local = buffer.local_grad(param)  # fp32 local accumulation: main_grad is the accumulator
                view = self._main_grad_views[id(param)] = local if local is not None else buffer.grad_view(param)
                param.main_grad = view
                if local is not None:
                    param.main_grad_copy_in_grad_buffer = buffer.grad_view(param)
        self._zero_now()  # main_grad is read directly: no lazily stale view
        # Megatron's forward pre-hooks (overlap_param_gather without the distributed optimizer: the layer-wise
        # optimizer's parameters reach the other ranks through the bucket groups, finished before first use).
        self.use_forward_hook = ddp_config.overlap_param_gather
        self._pre_hooks: list[Any] = []
        groups = self._groups(expert=False), self._groups(expert=True)
        if ddp_config.overlap_param_gather:
            for kind in groups:  # all-gathers run in forward order: the reverse of the buckets'
                for later, earlier in zip(kind[1:], kind[:-1], strict=True):
                    later.next_param_gather_bucket_group = earlier
            self.enable_forward_pre_hook()
        _WRAPPERS.add(self)

    def _view_of(self, buffer: ParamAndGradBuffer) -> BufferView:
        return self._views[id(buffer)]

    def _check_layout(self, given: FullParamLayout | None) -> FullParamLayout | None:
        """The layout of the buffers (Megatron's ``full_param_layout``): the given one, checked to be the one
        built, or with the distributed optimizer the one built (Megatron computes it then)."""
        built = FullParamLayout({megatron_key(b.key): self._view_of(b).param_layout()
                                 for b in self.param_and_grad_buffers})
        if given is None:
            return built if self.ddp_config.use_distributed_optimizer else None
        if not isinstance(given, FullParamLayout) or set(given.layouts) != set(built.layouts):
            raise ValueError(f"full_param_layout must be a FullParamLayout with a layout per buffer "
                             f"{sorted(map(str, built.layouts))} (parameters tagged by tag_params_for_buffer_routing "
                             f"have buffers of their own: compute the layout after tagging); got {given!r:.200}")
        for key, layout in built.layouts.items():
            theirs = given.layouts[key]
            if theirs.param_index_map != layout.param_index_map or theirs.bucket_indices != layout.bucket_indices:
                raise ValueError(
                    f"full_param_layout for buffer {key} differs from the layout this wrapper builds (bucket "
                    f"{theirs.bucket_indices} vs {layout.bucket_indices}); compute it with "
                    "DistributedOptimizer.compute_full_param_layout(params, bucket_size, dp_size, ddp_config) "
                    "(LayerWiseDistributedOptimizer's for parameters tagged by tag_params_for_buffer_routing) over "
                    "the same parameters, bucket size and data-parallel size, or pass None")
        return given

    @property
    def buffers(self) -> _BufferList:  # type: ignore[override]
        """The dense parameters' grad buffers (``BufferView``: Megatron's names over the core buffer), Megatron's
        list; called, ``nn.Module.buffers(recurse)``."""
        return _BufferList([self._view_of(b) for b in self.param_and_grad_buffers if not b.key.is_expert], self)

    @property
    def expert_parallel_buffers(self) -> list[BufferView]:
        """The expert (``allreduce=False``) parameters' buffers."""
        return [self._view_of(b) for b in self.param_and_grad_buffers if b.key.is_expert]

    def free_overlap_buffers(self) -> None:
        """Wait for parameter gathers in flight and free every bucket group's gather scratch (Megatron calls it
        before an asynchronous checkpoint save)."""
        self.finish_param_sync()
        for group in self.bucket_groups + self.expert_parallel_bucket_groups:
            group.free_overlap_buffers()

    @property
    def bucket_groups(self) -> list[BucketGroup]:
        """One ``BucketGroup`` per dense bucket, in launch order."""
        return self._groups(expert=False)

    @property
    def expert_parallel_bucket_groups(self) -> list[BucketGroup]:
        """One ``BucketGroup`` per expert bucket, in launch order."""
        return self._groups(expert=True)

    def _groups(self, *, expert: bool) -> list[BucketGroup]:
        if not hasattr(self, "_bucket_groups"):
            self._bucket_groups = [BucketGroup(self, i) for i in range(len(self.bucket_order))]
            self._group_of = {id(p): g for g in self._bucket_groups for p in g.params}
        return [g for g in self._bucket_groups if g.buffer.key.is_expert == expert]

    def register_grad_ready(self, param: torch.Tensor) -> None:
        """``param``'s gradient is complete in the buffer (the bucket group of ``param`` does the rest)."""
        for group in self._groups(expert=False) + self._groups(expert=True):
            if param in group.params:
                group.register_grad_ready(param)
                return
        raise ValueError(f"a parameter of shape {tuple(param.shape)} is not a trainable parameter of the model")

    def start_grad_sync(self, *unused: Any, through: int | None = None, force_all_reduce: bool = False) -> None:
        """Start the reductions of every bucket not started yet."""
        super().start_grad_sync(through=through, force_all_reduce=force_all_reduce)

    def _launch_ready(self) -> None:
        # Megatron's first batch only learns which parameters get gradients: backward launches no reduction
        # (finish_grad_sync starts them), so until then every main_grad holds this rank's own gradient.
        if self._megatron_first_batch:
            return
        super()._launch_ready()

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:  # type: ignore[override]
        """Finish every bucket's reduction; a no-op when nothing was accumulated since the last one (the optimizer's
        step calls it too; module docstring).
        ``force_all_reduce``: the buckets not started yet are all-reduced (even under the distributed
        optimizer, so every rank holds whole gradients), whatever the buffers hold, as Megatron does."""
        self._wait_layer_wise_param_sync()  # its gathers land in grad_data: done before gradients go there
        if force_all_reduce or not self._synced_since_zero:
            # the first sync since zero_grad_buffer reduces whatever the buffers hold, as Megatron's always does
            # (gradients may have been written into main_grad directly); later ones are no-ops until the next
            # gradient (the optimizer's step calls it again)
            super().start_grad_sync(force_all_reduce=force_all_reduce)
        super().finish_grad_sync(force_all_reduce=force_all_reduce)
        self._megatron_first_batch, self._synced_since_zero = False, True
        self._finished = set()
        self._take_assigned_main_grads()

    def _take_assigned_main_grads(self) -> None:
        """A ``param.main_grad`` the caller assigned (Megatron's optimizers read ``param.main_grad``) replaces the
        parameter's gradient in the buffer, which the optimizer reads; ``main_grad`` is the buffer view again."""
        views = self._main_grad_views
        with torch.no_grad():
            for name, param in self._named:
                view = views.get(id(param))
                given = getattr(param, "main_grad", view)
                if view is None or given is view:
                    continue
                if not isinstance(given, torch.Tensor) or given.numel() != view.numel():
                    raise ValueError(f"{name}.main_grad must be a tensor of {view.numel()} elements (the "
                                     f"parameter's gradient), got {type(given).__name__} "
                                     f"{tuple(getattr(given, 'shape', ()))}")
                view.copy_(given.detach().reshape(view.shape))
                param.main_grad = view

    def _zero_now(self) -> None:
        """Zero every gradient now (the core zeroes lazily), so ``param.main_grad`` reads zero, as in Megatron."""
        with torch.no_grad():
            for buffer in self.param_and_grad_buffers:
                buffer.grad_data.zero_()
        self._stale, self._written = False, set()

    def start_param_sync(self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """Gather every bucket's parameters from the ranks owning them.

        With ``use_distributed_optimizer`` (whose step gathers by itself; call it after writing owned ranges of
        ``param_data`` by other means): synchronous. With ``overlap_param_gather`` and the layer-wise optimizer:
        each bucket group's gather of the parameters its owner ranks stepped, asynchronous (the forward
        pre-hooks finish it) unless ``force_sync``; the gathers land in ``grad_data``, zeroed afterwards, as
        in Megatron. Otherwise a no-op (every rank holds every parameter)."""
        if self.shard_grads:
            super().finish_param_sync()  # the optimizer's overlapped gathers still in flight land first
            for buffer, bucket in self.bucket_order:
                self._gather_bucket(buffer, bucket)
            return
        for group in self.bucket_groups + self.expert_parallel_bucket_groups:
            group.start_param_sync(force_sync=force_sync)

    def enable_forward_pre_hook(self) -> None:
        """Register the forward pre-hooks that finish a bucket group's parameter gather before a module uses
        its parameters (Megatron's; ``overlap_param_gather`` only).

        Raises:
            GradSyncError: without ``overlap_param_gather``, or when the hooks are already registered.
        """
        if not self.use_forward_hook or self._pre_hooks:
            raise GradSyncError("enable_forward_pre_hook() needs overlap_param_gather=True and the hooks disabled "
                                f"(overlap_param_gather={self.ddp_config.overlap_param_gather}, hooks "
                                f"{'registered' if self._pre_hooks else 'not registered'})")
        self._pre_hooks = [m.register_forward_pre_hook(self._finish_param_sync_hook_for)
                           for m in self.module.modules()]

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """Remove the forward pre-hooks; with ``param_sync`` gather every parameter now (synchronously).

        Raises:
            GradSyncError: without ``overlap_param_gather``, or when the hooks are not registered.
        """
        if not self.use_forward_hook or not self._pre_hooks:
            raise GradSyncError("disable_forward_pre_hook() needs overlap_param_gather=True and the hooks enabled")
        for handle in self._pre_hooks:
            handle.remove()
        self._pre_hooks = []
        if param_sync:
            with torch.no_grad():
                self.start_param_sync(force_sync=True)

    def _finish_param_sync_hook_for(self, module: nn.Module, args: Any) -> None:
        if self.shard_grads:
            return  # the distributed optimizer's gathers have hooks of their own (the core's)
        for param in module.parameters(recurse=False):
            group = self._group_of.get(id(param))
            if group is not None:
                group.finish_param_sync()

    def finish_param_sync(self) -> None:
        """Wait for the parameter gathers in flight (the distributed optimizer's, and the bucket groups' of the
        layer-wise optimizer); gathers not started are left to the forward pre-hooks or ``start_param_sync``."""
        super().finish_param_sync()
        self._wait_layer_wise_param_sync()

    def _wait_layer_wise_param_sync(self) -> None:
        for group in getattr(self, "_bucket_groups", ()):
            group._wait_layer_wise()

    def _finish_layer_wise_param_sync(self) -> None:
        """Run the layer-wise gathers not started since the last step and finish those in flight."""
        for group in getattr(self, "_bucket_groups", ()):
            if group.param_gather_dispatched:
                group._wait_layer_wise()
            else:
                group.start_param_sync(force_sync=True)

    def _layer_wise_params_stepped(self) -> None:
        """The layer-wise optimizer stepped its owned parameters: each bucket group gathers them again."""
        for group in getattr(self, "_bucket_groups", ()):
            group._wait_layer_wise()
            group.param_gather_dispatched = False

    def _gather_bucket(self, buffer: ParamAndGradBuffer, bucket: Bucket) -> None:
        """All-gather one bucket's parameters from their owners' shards. In a wrapper laid out for the layer-wise
        optimizer the bucket's gradients are zeroed afterwards, as Megatron's layer-wise gathers leave them (the
        step consumed them; the next backward starts from zero)."""
        if not self.shard_grads:
            return
        comm = self.shard_comm(buffer)
        with torch.no_grad():
            own = buffer.param_shard_view(bucket.index, comm.rank).clone()
            comm.all_gather_into(bucket.param_data, own)
            if self._laid_out_for_layer_wise:
                bucket.grad_data.zero_()

    def zero_grad_buffer(self) -> None:
        """Wait for in-flight reductions, zero every gradient and reset the bucket groups (as Megatron does)."""
        self._wait_layer_wise_param_sync()  # a gather in flight lands in grad_data
        super().zero_grad_buffer()
        self._zero_now()
        self._finished, self._synced_since_zero = set(), False
        for group in getattr(self, "_bucket_groups", ()):
            group.reset()

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every gradient in the buffers by ``scaling_factor`` (e.g. 1 / tokens, after
        ``finish_grad_sync``, with ``calculate_per_token_loss``)."""
        for buffer in self.param_and_grad_buffers:
            buffer.scale_gradients(scaling_factor)

    def broadcast_params(self) -> None:
        """Copy data-parallel rank 0's parameters to every rank (expert parameters: expert data-parallel
        rank 0's), one broadcast per buffer."""
        with torch.no_grad():
            for buffer in self.param_and_grad_buffers:
                self.reduce_comm(buffer).broadcast(buffer.param_data, 0)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's state dict (no ``module.`` prefix), as Megatron's wrapper returns it."""
        return self.module.state_dict(*args, **kwargs)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
                           ) -> dict[str, Any]:
        """The model's part of a distributed checkpoint: the wrapped module's state dict (every rank holds whole
        parameters, which torch.distributed.checkpoint saves once), keys prefixed with ``prefix``."""
        return {prefix + k: v for k, v in self.module.state_dict().items()}

    def load_state_dict(self, state_dict: Any, strict: bool = True) -> Any:  # type: ignore[override]
        """Copy ``state_dict`` (the wrapped module's keys) into the parameters in place, so they stay in
        the buffers."""
        return self.module.load_state_dict(state_dict, strict=strict)
