"""Megatron Core's ``DistributedDataParallel`` over optstack's ``DataParallel`` (it *is* one, so the optimizer
factories take it as the wrapped model). The config's fields and their translation: ``ddp_config``; the bucket
groups: ``bucket_groups``.

``param.main_grad`` is Megatron's: the parameter's view of its gradient buffer (the face sets it; the core sets no
attributes), zeroed eagerly by ``zero_grad_buffer``. A tensor the caller assigns to it instead is copied into the
buffer by ``finish_grad_sync`` (which the optimizers' step calls), and ``main_grad`` becomes the view again.

``finish_grad_sync()`` called again with no gradient in between is a no-op, as Megatron's with
``overlap_grad_reduce`` (without it Megatron reduces again). optstack's optimizers call it at the start of each
step (so a loop that forgets it still steps reduced gradients), after Megatron's loop already did; a second
reduction would sum the sums with per-token losses and, under a reduce-scatter, fold other ranks' unreduced
ranges into the owned shard. To reduce the buffers on purpose: ``finish_grad_sync(force_all_reduce=True)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from optstack.distributed.buffers import Bucket, ParamAndGradBuffer
from optstack.distributed.ddp import DataParallel
from optstack.distributed.parallel import ParallelGroups
from optstack.distributed.param_gather import gather_bucket
from optstack.megatron.bucket_groups import BucketGroup, GradSyncError
from optstack.megatron.ddp_config import (
    DistributedDataParallelConfig,
    _instance_groups,
    check_ddp_config,
    fp32_local_accumulation,
    megatron_bucket_size,
    megatron_plan,
)
from optstack.megatron.param_and_grad_buffer import BufferView, FullParamLayout, megatron_key
from optstack.megatron.process_groups import (
    ProcessGroupCollection,
    collection_group,
    megatron_mpu_collection,
    to_parallel_groups,
)

__all__ = ["DistributedDataParallel"]


class _BufferList(list):
    """Megatron's ``model.buffers`` (a list of grad buffers) that is still ``nn.Module.buffers`` when called, so
    code iterating module buffers (``model.buffers()``) keeps working."""

    def __init__(self, items: list[BufferView], module: nn.Module) -> None:
        super().__init__(items)
        self._module = module

    def __call__(self, recurse: bool = True) -> Any:
        return nn.Module.buffers(self._module, recurse)


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
        full_param_layout: Megatron's precomputed layout (``compute_full_param_layout``), checked to be the one
            built; None: built (kept with ``use_distributed_optimizer``, as Megatron computes it then).

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
            shard_group=shard_group,
            cross_shard_group=cross_shard_group,
            # Megatron's buffers hold unreduced gradients outside each rank's shard, on every backend (the core's
            # "auto" all-reduces whole buckets on gloo, where that is faster).
            sharded_reduction="reduce_scatter",
            divide_after_sum=ddp_config.average_in_collective,
            local_grad_dtypes=fp32_local_accumulation(
                module, ddp_config.param_name_patterns_for_fp32_local_accumulation),
            plan=megatron_plan(module, ddp_config, groups, bucket_size=bucket_size,
                               instances=ddp_config.num_distributed_optimizer_instances),
            # Megatron's first batch only learns which parameters get gradients: backward launches no reduction
            # (finish_grad_sync starts them), so until then every main_grad holds this rank's own gradient
            overlap_after_first_sync=True,
        )
        self.config = config
        self._finished: set[int] = set()  # bucket groups finished one by one this step
        self.ddp_config = dataclasses.replace(ddp_config)
        self.bucket_size = bucket_size
        self._views = {id(b): BufferView(b, self.shard_comm(b)) for b in self.param_and_grad_buffers}
        #: Megatron's current main: tagged matrices in whole-shard buffers (wrap_model_chunks_with_ddp)
        self._laid_out_for_layer_wise = any(b.key.whole for b in self.param_and_grad_buffers)
        self.full_param_layout = self._check_layout(full_param_layout)
        # param.main_grad, Megatron's contract (module docstring)
        self._main_grad_views: dict[int, torch.Tensor] = {}
        self._synced_since_zero = False  # finish_grad_sync reduces at least once after zero_grad_buffer
        for buffer in self.param_and_grad_buffers:
            for param in buffer.params:
                local = buffer.local_grad(param)  # fp32 local accumulation: main_grad is the accumulator
                view = self._main_grad_views[id(param)] = local if local is not None else buffer.grad_view(param)
                param.main_grad = view
                if local is not None:
                    param.main_grad_copy_in_grad_buffer = buffer.grad_view(param)
        DataParallel.zero_grad_buffer(self, lazy=False)  # main_grad is read directly: no lazily stale view
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

    def _view_of(self, buffer: ParamAndGradBuffer) -> BufferView:
        return self._views[id(buffer)]

    def _check_layout(self, given: FullParamLayout | None) -> FullParamLayout | None:
        """``full_param_layout`` (class docstring)."""
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
        group = self._group_of.get(id(param))
        if group is None:
            raise ValueError(f"a parameter of shape {tuple(param.shape)} is not a trainable parameter of the model")
        group.register_grad_ready(param)

    def start_grad_sync(self, *unused: Any, through: int | None = None, force_all_reduce: bool = False) -> None:
        """Start the reductions of every bucket not started yet."""
        super().start_grad_sync(through=through, force_all_reduce=force_all_reduce)

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:  # type: ignore[override]
        """Finish every bucket's reduction; a no-op when nothing was accumulated since the last one (the optimizer's
        step calls it too; module docstring).
        ``force_all_reduce``: the buckets not started yet are all-reduced (even under the distributed
        optimizer, so every rank holds whole gradients), whatever the buffers hold, as Megatron does."""
        self._wait_layer_wise_param_sync()  # its gathers land in grad_data: done before gradients go there
        if force_all_reduce or not self._synced_since_zero:
            # whatever the buffers hold (gradients may have been written into main_grad directly), as Megatron's
            super().start_grad_sync(force_all_reduce=force_all_reduce)
        super().finish_grad_sync(force_all_reduce=force_all_reduce)
        self._synced_since_zero = True
        self._finished = set()
        self._take_assigned_main_grads()

    def _take_assigned_main_grads(self) -> None:
        """A ``param.main_grad`` the caller assigned (Megatron's optimizers read ``param.main_grad``) replaces the
        parameter's gradient in the buffer, which the optimizer reads; ``main_grad`` is the buffer view again."""
        views = self._main_grad_views
        with torch.no_grad():
            for name, param in self.wrapped_parameters:
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

    def start_param_sync(self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """Gather every bucket's parameters from the ranks owning them, as ``BucketGroup.start_param_sync`` does
        for its buckets (the distributed optimizer's step gathers by itself: call it after writing owned ranges of
        ``param_data`` by other means); the forward pre-hooks finish asynchronous gathers."""
        if self.shard_grads:
            super().finish_param_sync()  # the optimizer's overlapped gathers still in flight land first
            for buffer, bucket in self.bucket_order:
                self.gather_bucket(buffer, bucket)
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

    def gather_bucket(self, buffer: ParamAndGradBuffer, bucket: Bucket) -> None:
        """All-gather one bucket's parameters from their owners' shards (the core's ``gather_bucket``). In a
        wrapper laid out for the layer-wise optimizer the bucket's gradients are zeroed afterwards, as Megatron's
        layer-wise gathers leave them (the step consumed them; the next backward starts from zero)."""
        if not self.shard_grads:
            return
        gather_bucket(self.shard_comm(buffer), buffer, bucket.index)
        if self._laid_out_for_layer_wise:
            with torch.no_grad():
                bucket.grad_data.zero_()

    def zero_grad_buffer(self) -> None:
        """Wait for in-flight reductions, zero every gradient and reset the bucket groups (as Megatron does)."""
        self._wait_layer_wise_param_sync()  # a gather in flight lands in grad_data
        super().zero_grad_buffer(lazy=False)  # main_grad is read directly: no lazily stale view
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
