"""Megatron's bucket groups over a ``DistributedDataParallel``'s buckets: ``BucketGroup`` (reductions started and
finished together; the layer-wise optimizer's parameter gathers with ``overlap_param_gather``) and
``partition_buckets``. The wrapper is typed as its core base ``DataParallel`` so the import runs one way.
"""

from __future__ import annotations

from typing import Any

import torch

from optstack.distributed.buffers import Bucket, ParamAndGradBuffer
from optstack.distributed.ddp import DataParallel, wrappers_owning
from optstack.distributed.param_gather import start_packed_broadcasts, unpack_broadcasts
from optstack.megatron.param_and_grad_buffer import BucketView

__all__ = ["BucketGroup", "GradSyncError", "partition_buckets"]

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

    def __init__(self, ddp: DataParallel, positions: int | list[int]) -> None:
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
                ddp.gather_bucket(self.buffer, bucket)
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
        for bucket in self.buckets:
            bucket.layerwise_gather_list = None
            sizes = bucket.layerwise_param_flat_sizes
            if comm.size == 1 or not sizes or max(sizes) == 0:
                continue
            # Megatron's: the gather lands in the gradient buffer, as the parameters' dtype
            parts, started = start_packed_broadcasts(comm, bucket.layerwise_params_list,
                                                     bucket.grad_data.view(bucket.params_list[0].dtype))
            handles += started
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
        if not self.param_gather_dispatched:
            self.start_param_sync()
        sharded = self._ddp.shard_grads
        if not sharded:
            if self.param_gather_handle is None:
                return
            self.param_gather_handle.wait()
        following = self.next_param_gather_bucket_group
        if following is not None and not skip_next_bucket_dispatch and not following.param_gather_dispatched:
            following.start_param_sync()
        if sharded:
            self.param_gather_dispatched = False
        else:
            self._wait_layer_wise()

    def _wait_layer_wise(self) -> None:
        """Wait for a layer-wise gather in flight and copy what other ranks stepped into the parameters."""
        if self.param_gather_handle is None:
            return
        self.param_gather_handle.wait()
        self.param_gather_handle = None
        rank = self._ddp.shard_comm(self.buffer).rank
        for bucket in self.buckets:
            if bucket.layerwise_gather_list is not None and bucket.layerwise_params_list is not None:
                unpack_broadcasts(rank, bucket.layerwise_params_list, bucket.layerwise_gather_list)
                with torch.no_grad():
                    bucket.grad_data.zero_()  # it held the gather, not gradients
            bucket.layerwise_gather_list = None

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
    owners = {id(ddp): ddp for ddp in wrappers_owning(buffers)}
    if not buffers or len(owners) != 1:
        raise ValueError(f"partition_buckets: buffers must be a non-empty list of one DistributedDataParallel's "
                         f"buffers (model.buffers), got {len(buffers)} buffers of {len(owners)} wrappers")
    ddp = next(iter(owners.values()))
    ids = {id(b) for b in buffers}
    positions = [i for i, (buf, _) in enumerate(ddp.bucket_order) if id(buf) in ids]
    if force_single_bucket_group:
        return [BucketGroup(ddp, positions)]
    return [BucketGroup(ddp, p) for p in positions]
