"""The data-parallel wrapper: gradients accumulate into contiguous bucketed buffers (``buffers.py``) and a
bucket's reduction starts as soon as its last gradient arrives, overlapping the rest of backward::

    ddp.zero_grad_buffer()
    with ddp.no_sync():             # micro-batches 1 .. n-1: accumulate locally, no communication
        ddp(x1).loss.backward()
    ddp(xn).loss.backward()          # hooks launch each bucket's reduction when it is complete
    ddp.finish_grad_sync()           # wait for all; ddp.main_grad(p) now holds the reduced gradient

Buckets launch in one fixed order on every rank (backward order of their first parameter), so collectives
match whatever order hooks fire in; a bucket with a parameter that got no gradient, and those after it, are
left to ``finish_grad_sync``, so unused parameters never hang it. Zeroing is lazy (no memset per step): a first
gradient is copied, not added; unwritten views are zeroed at launch or by ``main_grad``. Averaging scales each
gradient in the hook when that equals scaling the sum (a step from zeroed buffers without ``no_sync``), else the
bucket at launch.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import hashlib
import os
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from optstack.distributed.buffers import Bucket, Bucketing, ParamAndGradBuffer, build_buffers
from optstack.distributed.comm import Comm, Handle, NullComm, is_initialized
from optstack.distributed.parallel import ParallelGroups
from optstack.distributed.param_gather import (
    GradGather,
    GradShards,
    ParamGather,
    ShardedLayout,
    gather_via,
    plan_bucket_gathers,
    register_wait_hooks,
)
from optstack.names import named_parameters
from optstack.plan import ParamPlan, first_difference

__all__ = ["DataParallel", "GradSync", "check_launched_world", "is_expert_param", "wrapper_holding",
           "wrappers_owning"]

# gloo (loopback, 2 ranks): a reduce-scatter alone costs more than an all-reduce (benchmarks/bench_collectives.py).
_SHARDED_REDUCTION_BY_BACKEND: dict[str, Literal["all_reduce", "reduce_scatter"]] = {"gloo": "all_reduce"}


def check_launched_world(what: str) -> None:
    """Refuse to start one of several launched processes as an independent run.

    A launcher (torchrun, a Slurm script) that started ``WORLD_SIZE`` > 1 processes, each building an optimizer
    or a wrapper without ``init_process_group``, gives that many independent runs that each train alone and race
    on one checkpoint directory, with no word. This raises rather than warns: a warning scrolls past in N
    interleaved logs, and nothing would stop the runs overwriting each other's checkpoints.

    Raises:
        RuntimeError: ``WORLD_SIZE`` > 1 in the environment and torch.distributed not initialised.
    """
    size = os.environ.get("WORLD_SIZE", "").strip()
    if size.isdigit() and int(size) > 1 and not is_initialized():
        raise RuntimeError(
            f"{what}: WORLD_SIZE={size} in the environment (a launcher such as torchrun started {size} processes) "
            "but torch.distributed is not initialised, so each process would train and save alone, racing on "
            "the same checkpoints. Call torch.distributed.init_process_group() first (before wrapping the model "
            "and building the optimizer), or unset WORLD_SIZE to run one independent process")


def is_expert_param(param: nn.Parameter) -> bool:
    """Megatron's convention: expert (MoE) parameters carry ``allreduce = False``."""
    return not getattr(param, "allreduce", True)


class GradSync(enum.Enum):
    """Where a step's gradients are in a ``DataParallel`` wrapper's buffers; one at a time.

    ZEROED: ``zero_grad_buffer`` since the last reduction: every gradient is zero (views zeroed lazily: when first
        written, read with ``main_grad``, or launched).
    FILLING: gradients written since, over zeroed buffers (a view's first gradient is copied, not added), not yet
        all reduced; reductions may be in flight.
    ADDING: gradients written over the last reduced ones (no ``zero_grad_buffer`` in between), not yet all reduced.
    REDUCED: ``finish_grad_sync``: every bucket reduced (``p.grad`` exposed where whole).
    """

    ZEROED = "zeroed"
    FILLING = "filling"
    ADDING = "adding"
    REDUCED = "reduced"


#: no gradient written since the buffers were zeroed or reduced (``finish_grad_sync`` has nothing to do)
_SETTLED = frozenset({GradSync.ZEROED, GradSync.REDUCED})
#: views not yet written this step are zero only logically (lazy zeroing)
_LAZY = frozenset({GradSync.ZEROED, GradSync.FILLING})


class DataParallel(nn.Module):
    """Wrap ``module`` for data-parallel training over contiguous gradient buffers (module docstring).

    Args:
        module: any nn.Module; its trainable parameters become views into the parameter buffers.
        groups: the process groups (None = ``ParallelGroups.from_world()``: the whole world is data-parallel).
        bucket_size: elements per bucket (None = one bucket per buffer).
        grad_dtype: gradient buffer dtype (None = the parameter dtype; fp32 accumulates bf16 gradients in fp32).
        overlap_grad_reduce: launch reductions from the backward hooks (False: all in ``finish_grad_sync``).
        overlap_after_first_sync: the hooks launch nothing before the first ``finish_grad_sync``, which starts
            every reduction (Megatron's first batch, which learns which parameters get gradients).
        shard_grads: only each rank's owned slice must be reduced (ZeRO-1); a stage stepping whole parameters
            over such buffers gathers what it needs from the shards (``grad_gather``, ``grad_shards``).
        average: scale by 1 / data-parallel size before the sum (expert buckets too, as in Megatron); else sum.
        divide_after_sum: with ``average``, divide after the sum (in the collective, Megatron's
            ``average_in_collective``) instead of scaling before it: gradients outside a rank's reduce-scatter
            shard stay unscaled.
        check_for_nan: check local gradients before each reduction; ``finish_grad_sync`` raises, naming them.
        sharded_reduction: how ``shard_grads`` reduces ("auto": the backend's fastest).
        shard_align, param_align: buffer alignment in elements (``optstack.distributed.buffers``).
        bucketing: how buckets are cut (``buffers.Bucketing``; None: optstack's rule).
        shard_group: with ``shard_grads``, the group dense gradients are sharded over, a part of the
            data-parallel group (a partial distributed optimizer, Megatron's instances: ZeRO-1 inside each
            part); None: the data-parallel group.
        cross_shard_group: with a ``shard_group`` smaller than the data-parallel group, the ranks holding this
            rank's shard in the other parts (Megatron's inter-instance group). A bucket is reduced inside the
            part (reduced into this rank's shard), then that shard is all-reduced across the parts, as
            Megatron does; only the owned shard holds the whole data-parallel sum.
        local_grad_dtypes: parameter name -> a dtype its micro-batch gradients accumulate in, in a tensor of its
            own (e.g. fp32 in a bf16 gradient buffer; ``buffers.py``); ``main_grad`` returns it.
        plan: the ``optstack.plan.ParamPlan`` the buffers are laid out by, fixed here (``wrap_data_parallel`` and
            the Megatron face pass one): which parameters lie whole in their owners' shards (``holds_whole``), which
            buffers are reduced whole, how buckets are cut; it replaces ``bucket_size`` / ``bucketing`` /
            ``shard_align`` / ``param_align``.

    Raises:
        ValueError: a bad argument, or the data-parallel ranks wrap different parameters (names the first).
    """

    def __init__(self, module: nn.Module, *, groups: ParallelGroups | None = None,
                 bucket_size: int | None = 40_000_000, grad_dtype: torch.dtype | None = None,
                 overlap_grad_reduce: bool = True, shard_grads: bool = False, average: bool = True,
                 check_for_nan: bool = False,
                 sharded_reduction: Literal["auto", "reduce_scatter", "all_reduce"] = "auto",
                 shard_align: int = 128, param_align: int = 64, bucketing: Bucketing | None = None,
                 shard_group: Comm | NullComm | None = None,
                 cross_shard_group: Comm | NullComm | None = None, divide_after_sum: bool = False,
                 local_grad_dtypes: Mapping[str, torch.dtype] | None = None,
                 plan: ParamPlan | None = None, overlap_after_first_sync: bool = False) -> None:
        super().__init__()
        if bucket_size is not None and (not isinstance(bucket_size, int) or bucket_size < 1):
            raise ValueError(f"bucket_size must be a positive element count or None, got {bucket_size!r}")
        if grad_dtype is not None and not grad_dtype.is_floating_point:
            raise ValueError(f"grad_dtype must be a floating-point dtype or None, got {grad_dtype}")
        if sharded_reduction not in ("auto", "reduce_scatter", "all_reduce"):
            raise ValueError(f"sharded_reduction must be 'auto', 'reduce_scatter' or 'all_reduce', "
                             f"got {sharded_reduction!r}")
        if groups is None:
            check_launched_world("DataParallel")
        self.module = module
        self.groups = groups if groups is not None else ParallelGroups.from_world()
        self.overlap_grad_reduce, self.shard_grads, self.average = overlap_grad_reduce, shard_grads, average
        self.divide_after_sum = average and divide_after_sum
        self.check_for_nan, self._sharded_reduction = check_for_nan, sharded_reduction

        self._dense_shard = shard_group if shard_group is not None else self.groups.dp
        if shard_group is not None and (not shard_grads or self.groups.dp.size % shard_group.size):
            raise ValueError(f"shard_group needs shard_grads=True and a size dividing the data-parallel size "
                             f"{self.groups.dp.size}; got size {shard_group.size}, shard_grads={shard_grads}")
        parts = self.groups.dp.size // self._dense_shard.size
        if parts > 1 and (cross_shard_group is None or cross_shard_group.size != parts):
            got = None if cross_shard_group is None else f"size {cross_shard_group.size}"
            raise ValueError(f"a shard_group of size {self._dense_shard.size} splits the data-parallel group into "
                             f"{parts} parts: pass cross_shard_group, the {parts} ranks holding this rank's shard "
                             f"in each part; got {got}")
        self._cross_shard = cross_shard_group if parts > 1 else None
        self._named = named = _trainable(module)
        _check_same_params(self.groups.dp, [(n, p) for n, p in named if not is_expert_param(p)], "dense")
        _check_same_params(self.groups.expert_dp, [(n, p) for n, p in named if is_expert_param(p)], "expert")
        #: the plan the buffers were laid out by (None: built from the arguments alone)
        self.plan = plan
        if plan is None:
            self.param_and_grad_buffers: list[ParamAndGradBuffer] = build_buffers(
                list(reversed(named)), dp_size=self._dense_shard.size, expert_dp_size=self.groups.expert_dp.size,
                bucket_size=bucket_size, grad_dtype=grad_dtype, is_expert=is_expert_param,
                shard_align=shard_align, param_align=param_align, bucketing=bucketing,
                local_grad_dtypes=local_grad_dtypes)
        else:
            if bucketing is not None:
                raise ValueError("DataParallel: pass a plan or bucketing, not both (the plan's layouts say how "
                                 "buckets are cut)")
            self.param_and_grad_buffers = _buffers_of(plan, module, self, local_grad_dtypes)
            _check_same_plan(self.groups.dp, plan)
        self._data_ptrs = [p.data_ptr() for _, p in named]
        backward_pos = {id(p): i for i, (_, p) in enumerate(reversed(named))}
        self._order: list[tuple[ParamAndGradBuffer, Bucket]] = sorted(
            ((buf, b) for buf in self.param_and_grad_buffers for b in buf.buckets),
            key=lambda fb: backward_pos[id(fb[1].params[0])])
        self._slot_of_param: dict[int, tuple[int, ParamAndGradBuffer]] = {
            id(p): (pos, buf) for pos, (buf, b) in enumerate(self._order) for p in b.params}
        # The hook's accumulation targets, made once: a view per call costs as much as the add for small params.
        self._grad_views: dict[int, torch.Tensor] = {
            id(p): buf.grad_view(p) for buf in self.param_and_grad_buffers for p in buf.params}
        # Where backward accumulates: the buffer view, or the parameter's local accumulator (local_grad_dtypes).
        self._accum_views = {**self._grad_views, **{
            id(buf.param_of(n)): g for buf in self.param_and_grad_buffers for n, g in buf.local_grads.items()}}
        self._sync_enabled = True  # False inside no_sync()
        #: where this step's gradients are (``GradSync``); written only at transitions (nn.Module.__setattr__ is
        #: slow on the hooks' path)
        self._sync = GradSync.ZEROED
        # Lazy zeroing: while ZEROED / FILLING, only the views of parameters in _written hold this step's gradients.
        self._written: set[int] = set()
        self._hook_scale: float | None = None  # this step's scale applied in the hook (None: at launch)
        self._reset_sync_state()
        # The hooks reach the wrapper through a weak reference: a tensor's hooks are held from C++, where the garbage
        # collector cannot see the cycle parameter -> hook -> wrapper -> parameter; a bound method would keep every
        # discarded wrapper alive (its buffers, and its process groups with their threads).
        self._hooks = [p.register_post_accumulate_grad_hook(_weak_hook(self)) for _, p in named]
        self._gather_hooks: list[Any] = []  # forward pre-hooks waiting for overlapped parameter gathers
        self._param_gathers: list[ParamGather] = []  # every stage's, so reading the model can finish them
        # The module's state_dict (read directly, or through this wrapper) waits for overlapped parameter gathers:
        # right after an overlapped step each rank holds only its own updated ranges.
        self._hooks.append(module.register_state_dict_pre_hook(self._finish_param_sync_hook))
        self._grads_exposed = False  # p.grad are views of the reduced buffers (finish_grad_sync)
        _LIVE.add(self)
        self._force_all_reduce = False  # finish_grad_sync(force_all_reduce=True): whole reduced gradients
        self._hooks_launch = overlap_grad_reduce and not overlap_after_first_sync  # until the first sync

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_params_unchanged()
        if self._grads_exposed:  # backward must not accumulate into last step's reduced gradients in place
            self._hide_grads()
        return self.module(*args, **kwargs)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        pos, buf = self._slot_of_param[id(param)]
        if param.grad is None:
            return
        if param.grad.numel() and param.grad.data_ptr() == self._grad_views[id(param)].data_ptr():
            raise RuntimeError(f"parameter {buf.name_of(param)!r}: backward accumulated into the last step's reduced "
                               "gradient (p.grad, a view of the gradient buffer after finish_grad_sync); call "
                               "optimizer.zero_grad() (or ddp.zero_grad_buffer()) before the next backward, or run "
                               "the forward through the DataParallel wrapper")
        # Checked before accumulating: the bucket may be in flight, and adding to it would race.
        if self._handles[pos] is not None or (self._sync_enabled and id(param) in self._ready):
            raise RuntimeError(f"parameter {buf.name_of(param)!r} got a second gradient before finish_grad_sync(); "
                               "accumulate micro-batches inside no_sync() and call finish_grad_sync() once per step")
        if self._sync in _SETTLED:  # the first gradient of a step
            self._begin_step(in_hook=True)
        self._write_grad(param, param.grad)
        param.grad = None
        if not self._sync_enabled:
            return
        self._ready.add(id(param))
        self._pending[pos] -= 1
        if self._hooks_launch:
            self._launch_ready()

    def _write_grad(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        view, scale = self._accum_views[id(param)], self._hook_scale
        with torch.no_grad():
            if self._sync is GradSync.FILLING and id(param) not in self._written:  # the first since zeroing
                self._written.add(id(param))
                if scale is None:
                    view.copy_(grad)
                elif grad.dtype == view.dtype:
                    torch.mul(grad, scale, out=view)
                else:  # scale in the buffer's (wider) dtype, as the bucket multiply would
                    view.copy_(grad).mul_(scale)
            elif scale is None:
                view.add_(grad)
            else:
                view.add_(grad, alpha=scale)

    def _zero_unwritten(self, params: Sequence[nn.Parameter]) -> None:
        for p in params:
            if id(p) not in self._written:
                self._written.add(id(p))
                self._accum_views[id(p)].zero_()

    def _begin_step(self, *, in_hook: bool) -> None:
        """The first gradient since the buffers were zeroed (FILLING) or reduced (ADDING). Scaling gradients as the
        hooks write them equals scaling the sum only from zeroed buffers without no_sync (module docstring)."""
        cleared = self._sync is GradSync.ZEROED
        self._sync = GradSync.FILLING if cleared else GradSync.ADDING
        self._hook_scale = self._average_scale() if in_hook and cleared and self._sync_enabled else None

    def _reset_sync_state(self) -> None:
        """Forget this step's launches (the gradients' state is ``_sync``)."""
        self._ready: set[int] = set()
        self._pending = [len(b.params) for _, b in self._order]
        self._handles: list[Handle | None] = [None] * len(self._order)
        self._next = 0
        self._nonfinite: list[str] = []

    def _launch_ready(self) -> None:
        while self._next < len(self._order) and self._pending[self._next] == 0:
            self._launch(self._next)

    def _launch(self, pos: int) -> None:
        buf, bucket = self._order[pos]
        comm = self.reduce_comm(buf)
        if self._sync is GradSync.FILLING:
            self._zero_unwritten(bucket.params)
        if buf.local_grads:
            buf.stage_local_grads(bucket.index)
        if self.check_for_nan and not bool(torch.isfinite(bucket.grad_data).all()):
            self._nonfinite += [buf.name_of(p) for p in bucket.params
                                if not bool(torch.isfinite(buf.grad_view(p)).all())]
        scale = self._average_scale()
        if scale is not None and self._hook_scale is None:
            bucket.grad_data.mul_(scale)
        op = "avg" if self.divide_after_sum else "sum"
        if self.divide_after_sum and comm.size != self.groups.dp.size:  # expert: 1 / dp overall, as dense
            bucket.grad_data.mul_(comm.size / self.groups.dp.size)
        whole = self._force_all_reduce or buf.key.all_reduce
        if self._partial(buf) and not whole:
            handle = self._reduce_in_part(buf, bucket, op)
        elif self.shard_grads and not whole and self._sharded_via(comm) == "reduce_scatter":
            handle = comm.reduce_scatter_async(buf.grad_shard_view(bucket.index, comm.rank), bucket.grad_data, op)
        else:  # force_all_reduce: the whole sum on every rank (even under a partial shard_group)
            handle = comm.all_reduce_async(bucket.grad_data, op)
        self._handles[pos] = handle
        self._next = pos + 1

    @property
    def whole_grads(self) -> bool:
        """Every bucket is reduced whole on every rank (no ``shard_grads``)."""
        return not self.shard_grads

    def reduces_whole(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether every one of ``params`` gets its whole reduced gradient on every rank: no ``shard_grads``, or
        its buffer is reduced whole (the plan said so at construction)."""
        if self.whole_grads:
            return True
        entries = [self._slot_of_param.get(id(param)) for param in params]
        return all(e is not None and e[1].key.all_reduce for e in entries)

    def _scattered(self, buf: ParamAndGradBuffer) -> bool:
        """Whether only each rank's shard of ``buf`` holds its reduced gradient after a sync."""
        return self.shard_grads and not buf.key.all_reduce and (
            self._sharded_via(self.reduce_comm(buf)) == "reduce_scatter" or self._partial(buf))

    def _partial(self, buf: ParamAndGradBuffer) -> bool:
        """Whether ``buf`` is sharded over a part of the group it is reduced over (a partial ZeRO-1)."""
        return self._cross_shard is not None and self.shard_comm(buf) is not self.reduce_comm(buf)

    def _reduce_in_part(self, buf: ParamAndGradBuffer, bucket: Bucket, op: str) -> Handle:
        """Megatron's multi-instance reduction: inside the part into this rank's shard, then that shard across
        the parts. The first is waited for here, so the second is issued in launch order on every rank (Megatron
        runs both synchronously too, on a side stream)."""
        part = self._dense_shard
        own = buf.grad_shard_view(bucket.index, part.rank)
        if self._sharded_via(part) == "reduce_scatter":
            part.reduce_scatter(own, bucket.grad_data, op)
        else:
            part.all_reduce(bucket.grad_data, op)
        assert self._cross_shard is not None
        return self._cross_shard.all_reduce_async(own, op)

    def _average_scale(self) -> float | None:
        """The scale applied before the sum (None: none, or averaged in the collective)."""
        if not self.average or self.divide_after_sum or self.groups.dp.size == 1:
            return None
        return 1.0 / self.groups.dp.size

    def _sharded_via(self, comm: Comm | NullComm) -> str:
        if self._sharded_reduction != "auto":
            return self._sharded_reduction
        return _SHARDED_REDUCTION_BY_BACKEND.get(comm.backend, "reduce_scatter")

    def _wait_all(self) -> None:
        for handle in self._handles:
            if handle is not None:
                handle.wait()

    def grad_ready(self, param: torch.Tensor) -> None:
        """Mark ``param``'s gradient as complete for this step, as its backward hook does after accumulating
        (for a gradient written into ``main_grad(param)`` directly); with ``overlap_grad_reduce`` the buckets
        now complete are launched.

        Raises:
            ValueError: not a trainable parameter of the wrapped module. RuntimeError: marked twice in a step.
        """
        pos, buf = self._entry(param)
        if id(param) in self._ready or self._handles[pos] is not None:
            raise RuntimeError(f"parameter {buf.name_of(param)!r} was already marked ready this step; call "
                               "finish_grad_sync() first")
        if self._sync in _SETTLED:
            self._begin_step(in_hook=False)  # written directly: scale at launch
        self._ready.add(id(param))
        self._pending[pos] -= 1
        if self._hooks_launch and self._sync_enabled:
            self._launch_ready()

    def start_grad_sync(self, *, through: int | None = None, force_all_reduce: bool = False) -> None:
        """Launch the reductions of the buckets not launched yet (in launch order, up to position ``through``
        of ``bucket_order`` when given), whether or not their gradients were marked ready."""
        if self._sync in _SETTLED:
            self._begin_step(in_hook=False)
        last = len(self._order) - 1 if through is None else through
        self._force_all_reduce = force_all_reduce
        try:
            while self._next <= last:
                self._launch(self._next)
        finally:
            self._force_all_reduce = False

    def wait_bucket(self, position: int) -> None:
        """Wait for the reduction of the bucket at ``position`` of ``bucket_order`` (launched: ``bucket_launched``)."""
        handle = self._handles[position]
        if handle is None:
            raise RuntimeError(f"bucket {position} of bucket_order has not been launched; mark its gradients ready "
                               "or call start_grad_sync()")
        handle.wait()
        self._unstage(position)

    def _unstage(self, position: int) -> None:
        """The reduced gradients of a bucket back into its parameters' local accumulators (if any)."""
        buf, bucket = self._order[position]
        if buf.local_grads:
            buf.unstage_local_grads(bucket.index)

    def bucket_launched(self, position: int) -> bool:
        """Whether the reduction of the bucket at ``position`` of ``bucket_order`` has started this step."""
        return self._handles[position] is not None

    @property
    def bucket_order(self) -> list[tuple[ParamAndGradBuffer, Bucket]]:
        """Every (buffer, bucket) in the fixed order their reductions launch (the same on every rank)."""
        return list(self._order)

    def finish_grad_sync(self, *, force_all_reduce: bool = False) -> None:
        """Launch the buckets not launched yet, wait for every reduction, reset for the next step; a no-op when
        called again with no backward in between (so the optimizer can call it whether or not the loop did).
        ``force_all_reduce``: buckets launched here are all-reduced even when gradients are sharded.

        Raises:
            RuntimeError: the module's parameters changed after wrapping, or (``check_for_nan``) non-finite
                local gradients on this rank; CommError: a collective failed.
        """
        self._check_params_unchanged()
        if self._sync is GradSync.REDUCED:
            return
        if self._sync is GradSync.ZEROED:  # no gradient since zero_grad_buffer: every gradient is zero
            self._zero_all_now()
            return
        self.start_grad_sync(force_all_reduce=force_all_reduce)
        self._wait_all()
        for position in range(len(self._order)):
            self._unstage(position)
        nonfinite = self._nonfinite
        self._reset_sync_state()
        self._sync, self._written = GradSync.REDUCED, set()  # every view written or zeroed
        self._hooks_launch = self.overlap_grad_reduce
        self._expose_grads()
        if nonfinite:
            raise RuntimeError(f"non-finite local gradient on {self.groups.dp.name} rank {self.groups.dp.rank} before "
                               f"the reduction, in {nonfinite} (check_for_nan=True); check the loss and inputs on "
                               "this rank")

    def _expose_grads(self) -> None:
        """Make each ``p.grad`` its reduced gradient, a view of the buffer (torch DDP's ``gradient_as_bucket_view``),
        for readers of ``.grad`` such as ``clip_grad_norm_``. Left None where the buffer does not hold the whole
        reduced gradient in the parameter's dtype (a reduce-scatter; an fp32 buffer of bf16 parameters): there,
        clip through the optimizer (``OptimizerConfig.clip_grad``) and read gradients with ``main_grad(p)``."""
        for buf in self.param_and_grad_buffers:
            if not self._scattered(buf) and buf.key.grad_dtype == buf.key.param_dtype:
                for p in buf.params:
                    p.grad = self._grad_views[id(p)]
                self._grads_exposed = True

    def _hide_grads(self) -> None:
        for _, p in self._named:
            p.grad = None
        self._grads_exposed = False

    def finish_param_sync(self) -> None:
        """Wait for the parameter gathers still in flight after an overlapped ZeRO-1 step, so every rank holds
        every updated parameter (a no-op when none is in flight). ``state_dict()`` calls it."""
        for gather in self._param_gathers:
            gather.wait()

    def quiesce(self, timeout_s: float = 5.0) -> None:
        """Let the collectives this wrapper and its stages' gathers still have in flight complete (up to
        ``timeout_s``: a peer may be gone or hung) and drop them, results unused: at process exit."""
        handles = [h for h in self._handles if h is not None]
        handles += [h for gather in self._param_gathers for bucket in gather.gathers for h in bucket.handles]
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(Exception):
            while not all(h.is_completed() for h in handles) and time.monotonic() < deadline:
                time.sleep(0.01)
        self._handles = [None] * len(self._order)
        for gather in self._param_gathers:
            for bucket in gather.gathers:
                bucket.handles, bucket.packets = [], []
            gather.pending = False

    def _finish_param_sync_hook(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self.finish_param_sync()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward only accumulates into the grad buffers here; the first backward after it reduces."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def zero_grad_buffer(self, *, lazy: bool = True) -> None:
        """Wait for in-flight reductions and zero every gradient: lazily (``grad_data`` is stale until a view is
        written, read with ``main_grad`` or its bucket launched; the few local accumulators now), or with
        ``lazy=False`` all of ``grad_data`` now (for readers of the buffers themselves, e.g. Megatron's
        ``param.main_grad``)."""
        self._wait_all()
        self._sync, self._written = GradSync.ZEROED, set()
        with torch.no_grad():
            for buf in self.param_and_grad_buffers:
                for grad in buf.local_grads.values():
                    grad.zero_()
        if not lazy:
            self._zero_all_now()
        self._hide_grads()
        self._reset_sync_state()

    def _zero_all_now(self) -> None:
        """Zero every view now (they count as written: nothing is left to zero lazily)."""
        for buf in self.param_and_grad_buffers:
            buf.zero_gradients()
        self._written = set(self._accum_views)

    @property
    def wrapped_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The wrapped module's trainable ``(name, parameter)`` pairs, in module order (fixed at construction)."""
        return list(self._named)

    @property
    def grad_sync(self) -> GradSync:
        """Where this step's gradients are: ``ZEROED``, ``FILLING`` / ``ADDING`` (written, not yet all reduced) or
        ``REDUCED``."""
        return self._sync

    @property
    def launched_buckets(self) -> int:
        """How many buckets' reductions have started since the last ``finish_grad_sync``."""
        return self._next

    @property
    def device(self) -> torch.device:
        """Where the buffers live (CPU when the module has no trainable parameters)."""
        return _device_of(self.param_and_grad_buffers)

    def main_grad(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s gradient buffer view (its local accumulator with ``local_grad_dtypes``); reduced after
        ``finish_grad_sync`` (only owned slices: ``shard_grads``)."""
        buf = self._entry(param)[1]
        if self._sync in _LAZY:
            self._zero_unwritten([param])  # its gradient is zero until written
        local = buf.local_grad(param)
        return local if local is not None else buf.grad_view(param)

    def holds_whole(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether every one of ``params`` is in a whole-shard buffer (the plan's): whole inside one
        rank's shard, so that a ZeRO-1 stage steps it whole, in its shape, on its owner."""
        entries = [self._slot_of_param.get(id(param)) for param in params]
        return bool(entries) and all(e is not None and e[1].key.whole for e in entries)

    def sharded_layout(self, params: Sequence[torch.Tensor], *, expert: bool = False,
                       overlap_param_gather: bool = False,
                       param_gather: Literal["auto", "all_gather", "broadcast"] = "auto") -> ShardedLayout:
        """The views a ZeRO-1 placement steps ``params`` through: this rank's owned part of each (over expert
        data-parallel for ``expert``) and the gather publishing them after a step. With ``overlap_param_gather``
        each module's forward pre-hook waits for its buckets' gathers, overlapping the next forward. Where every
        one of ``params`` is in a whole-shard buffer (``holds_whole``) the views have the parameters' shapes.

        Args:
            param_gather: "all_gather" (per bucket), "broadcast" (per rank and bucket, in place) or "auto".

        Raises:
            ValueError: a parameter not trainable in the wrapped module, of the other kind (dense vs expert),
                or given twice; an unknown ``param_gather``.
        """
        comm = self.groups.expert_dp if expert else self._dense_shard
        via = gather_via(param_gather, comm.backend, overlap=overlap_param_gather)
        slices: dict[int, tuple[int, int, torch.Tensor, torch.Tensor]] = {}
        where: dict[int, tuple[Any, str]] = {}
        whole = self.holds_whole(params)
        in_buckets: dict[tuple[int, int], tuple[ParamAndGradBuffer, int, set[str]]] = {}
        for param in params:
            buffer = self._buffer_holding(param, "; build the groups from ddp.module.named_parameters()")
            slot = buffer.slot_of(param)
            if buffer.key.is_expert != expert:
                kind = "an expert" if buffer.key.is_expert else "a dense"
                raise ValueError(f"ZeRO-1 (expert={expert}): {slot.name!r} is {kind} parameter; put dense and "
                                 "expert (allreduce=False) parameters in separate stages")
            names = in_buckets.setdefault((id(buffer), slot.bucket), (buffer, slot.bucket, set()))[2]
            if slot.name in names:
                raise ValueError(f"parameter {slot.name!r} appears twice in param_groups")
            names.add(slot.name)
            where[id(param)] = (buffer.layout, slot.name)
            part = buffer.layout.owned_slice(slot.name, comm.rank)  # per parameter: linear in the bucket's size
            if part is not None:
                at = slice(part.buffer_start, part.buffer_start + part.numel)
                views = buffer.param_data[at], buffer.grad_data[at]
                if whole:
                    views = tuple(v.view(param.shape) for v in views)
                slices[id(param)] = (part.param_start, part.param_end, *views)
        # with overlap, each module's forward pre-hook waits for its buckets (installed at the first launch)
        gather = ParamGather(plan_bucket_gathers(list(in_buckets.values()), comm, via, self.module),
                             overlap=overlap_param_gather,
                             attach=(lambda: self._gather_hooks.extend(register_wait_hooks(self.module, gather)))
                             if overlap_param_gather else None)
        self._param_gathers.append(gather)
        g = self.groups
        device = _device_of([b for b in self.param_and_grad_buffers if b.key.is_expert == expert])
        return ShardedLayout(slices, [comm, g.ep, g.mp] if expert else [comm, g.mp], g.tp.rank, device, gather,
                             whole, where)

    def grad_shards(self, params: Sequence[torch.Tensor], *, expert: bool = False) -> GradShards:
        """Where ``params``' reduced gradients lie across the ranks their buffers are sharded over (each rank
        its range of every bucket, cutting across parameters): for a stage whose owners gather whole
        gradients from the shards (``stage.placement.OwnersOverShards``).

        Raises:
            ValueError: a parameter not trainable in the wrapped module, or of the other kind (dense vs expert).
        """
        comm = self.groups.expert_dp if expert else self._dense_shard
        mine: dict[int, tuple[int, int, torch.Tensor] | None] = {}
        where: dict[int, tuple[Any, str]] = {}
        dtypes: dict[int, torch.dtype] = {}
        for param in params:
            buffer = self._buffer_holding(param)
            slot = buffer.slot_of(param)
            if buffer.key.is_expert != expert:
                raise ValueError(f"{slot.name!r} is {'an expert' if buffer.key.is_expert else 'a dense'} parameter; "
                                 "put dense and expert (allreduce=False) parameters in separate stages")
            part = buffer.layout.owned_slice(slot.name, comm.rank)
            mine[id(param)] = None if part is None else (
                part.param_start, part.param_end, buffer.grad_data[part.buffer_start:part.buffer_start + part.numel])
            where[id(param)] = (buffer.layout, slot.name)
            dtypes[id(param)] = buffer.key.grad_dtype
        g = self.groups
        device = _device_of([b for b in self.param_and_grad_buffers if b.key.is_expert == expert])
        return GradShards(comm, [comm, g.ep, g.mp] if expert else [comm, g.mp], g.tp.rank, device, mine, where,
                          dtypes)

    def grad_gather(self, params: Sequence[torch.Tensor]) -> GradGather:
        """The all-gathers that give every rank the whole reduced gradients of ``params`` where their buckets are
        reduce-scattered (none where they are reduced whole): for a stage stepping them replicated.

        Raises:
            ValueError: a parameter not trainable in the wrapped module.
        """
        wanted: dict[tuple[int, int], tuple[Comm | NullComm, torch.Tensor, torch.Tensor]] = {}
        for param in params:
            buffer = self._buffer_holding(param)
            if not self._scattered(buffer):
                continue
            bucket = buffer.buckets[buffer.slot_of(param).bucket]
            comm = self.shard_comm(buffer)
            wanted[(id(buffer), bucket.index)] = (comm, buffer.grad_shard_view(bucket.index, comm.rank),
                                                  bucket.grad_data)
        return GradGather(list(wanted.values()))

    def _entry(self, param: torch.Tensor) -> tuple[int, ParamAndGradBuffer]:
        """``param``'s position in ``bucket_order`` and its buffer."""
        entry = self._slot_of_param.get(id(param))
        if entry is None:
            raise ValueError(f"parameter of shape {tuple(param.shape)} is not a trainable parameter of the "
                             "wrapped module")
        return entry

    def _buffer_holding(self, param: torch.Tensor, fix: str = "") -> ParamAndGradBuffer:
        if id(param) not in self._slot_of_param:
            raise ValueError(f"a parameter of shape {tuple(param.shape)} is not a trainable parameter of the "
                             f"DataParallel-wrapped module{fix}")
        return self._slot_of_param[id(param)][1]

    def shard_comm(self, buffer: ParamAndGradBuffer) -> Comm | NullComm:
        """The group a buffer's buckets are split across (``shard_group`` for dense buffers when given)."""
        return self.groups.expert_dp if buffer.key.is_expert else self._dense_shard

    def reduce_comm(self, buffer: ParamAndGradBuffer) -> Comm | NullComm:
        """The group a buffer is reduced (and sharded) over: expert data-parallel for expert buffers."""
        return self.groups.expert_dp if buffer.key.is_expert else self.groups.dp

    def _check_params_unchanged(self) -> None:
        now = _trainable(self.module)
        for i, ((name, p), ptr) in enumerate(zip(self._named, self._data_ptrs, strict=True)):
            if i >= len(now) or now[i][0] != name:
                raise RuntimeError(
                    "the wrapped module's parameters changed after DataParallel was built: expected "
                    f"{name!r} at position {i}, found {repr(now[i][0]) if i < len(now) else 'nothing'}; wrap "
                    "the model again after changing it")
            if now[i][1] is not p:
                raise RuntimeError(f"parameter {name!r} was replaced by a new tensor after DataParallel was "
                                   "built; copy values into it in place, or wrap the model again")
            if p.data_ptr() != ptr:
                raise RuntimeError(
                    f"parameter {name!r} no longer lives in the DataParallel buffer (its .data was replaced, "
                    "e.g. by module.to() or an assignment); move the model before wrapping it")
        if len(now) > len(self._named):
            raise RuntimeError(
                "the wrapped module's parameters changed after DataParallel was built: "
                f"{now[len(self._named)][0]!r} is new; build a new DataParallel after changing the model")


def _weak_hook(ddp: DataParallel) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook calling ``ddp._on_grad_ready`` while ``ddp`` lives (see ``__init__``)."""
    ref = weakref.ref(ddp)

    def on_grad_ready(param: torch.Tensor) -> None:
        owner = ref()
        if owner is not None:
            owner._on_grad_ready(param)

    return on_grad_ready


# Every live wrapper, so that collectives still in flight at exit (an overlapped gather after the last step, a
# reduction launched by a backward that no step finished) are waited for while the interpreter is whole: a gloo
# worker thread still holding their tensors during finalisation can abort the process (SIGABRT, "terminate
# called without an active exception").
_LIVE: weakref.WeakSet[DataParallel] = weakref.WeakSet()


def wrapper_holding(*params: torch.Tensor) -> DataParallel | None:
    """The live wrapper whose buffers hold every one of ``params`` (their gradients go there, not to
    ``param.grad``), or None."""
    for ddp in list(_LIVE):
        if params and all(id(p) in ddp._slot_of_param for p in params):
            return ddp
    return None


def wrappers_owning(buffers: Sequence[ParamAndGradBuffer]) -> list[DataParallel]:
    """The live wrappers owning any of ``buffers`` (Megatron's ``partition_buckets`` gets only buffers)."""
    ids = {id(b) for b in buffers}
    return [ddp for ddp in list(_LIVE) if any(id(b) in ids for b in ddp.param_and_grad_buffers)]


def unwrapped_use_error(name: str, what: str) -> str:
    """Why an optimizer reading ``.grad`` of a wrapped parameter would step nothing, and what to do."""
    return (f"parameter {name!r} is held by a DataParallel wrapper (its gradients go to the wrapper's buffers, "
            f"never to .grad) but {what} reads its .grad, so steps would change nothing. Build the optimizer on "
            "the wrapper, after wrapping: model = wrap_data_parallel(config, model), then "
            "build_optimizer(config, model)")


@atexit.register
def _quiesce_at_exit() -> None:
    for ddp in list(_LIVE):
        ddp.quiesce()


def _disagreeing(comm: Comm | NullComm, digest: Callable[[], bytes], rows: Callable[[], Any]
                 ) -> tuple[int, list[Any]] | None:
    """The first rank of ``comm`` whose ``rows()`` differ from rank 0's, and every rank's rows; None when all agree.
    Ranks exchange a 32-byte ``digest()`` (O(world) bytes, whatever the model), the rows only when digests differ."""
    if comm.size == 1:
        return None
    mine = digest()
    if all(d == mine for d in comm.all_gather_object(mine)):
        return None
    everyone = comm.all_gather_object(rows())
    return next(r for r, theirs in enumerate(everyone) if theirs != everyone[0]), everyone


def _first_mismatch(a: Sequence[Any], b: Sequence[Any]) -> tuple[int, Any, Any]:
    """The first position where ``a`` and ``b`` differ, and their entries there ("no parameter" past an end)."""
    i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return i, *(x[i] if i < len(x) else "no parameter" for x in (a, b))


def _check_same_plan(comm: Comm | NullComm, plan: ParamPlan) -> None:
    """Every rank of ``comm`` planned alike (same config, groups, placements, layouts)."""
    found = _disagreeing(comm, plan.digest, plan.rows)
    if found is None:
        return
    rank, everyone = found
    raise ValueError(f"the {comm.name} ranks planned differently: rank 0 and rank {rank} differ at "
                     f"{first_difference(everyone[0], everyone[rank])}; every rank must build from the same "
                     "config and rules")


def _buffers_of(plan: ParamPlan, module: nn.Module, ddp: DataParallel,
                local_grad_dtypes: Mapping[str, torch.dtype] | None) -> list[ParamAndGradBuffer]:
    """The buffers ``plan`` lays out, in its order, over ``module``'s parameters (named as
    ``optstack.names.named_parameters`` names them: the wrapper's own names may carry ``_orig_mod``)."""
    named = named_parameters(module)
    mine = [(n, tuple(int(s) for s in p.shape), str(p.dtype).removeprefix("torch.")) for n, p in named]
    planned = [p.spec.key()[:3] for p in plan.params]
    if mine != planned:
        i, a, b = _first_mismatch(mine, planned)
        raise ValueError(f"DataParallel: the plan was built for other parameters: at position {i} the module has "
                         f"{a} but the plan {b}; build the plan from this module (wrap_data_parallel does)")
    if plan.sharding == "zero1" and not ddp.shard_grads:
        raise ValueError("DataParallel: the plan shards gradients (sharding='zero1'); pass shard_grads=True")
    t = plan.topology
    if (t.shard_size, t.expert_dp) != (ddp._dense_shard.size, ddp.groups.expert_dp.size):
        raise ValueError(f"DataParallel: the plan shards over {t.shard_size} (expert {t.expert_dp}) ranks but "
                         f"these groups over {ddp._dense_shard.size} (expert {ddp.groups.expert_dp.size}); plan "
                         "for these groups (optstack.factory.topology_of)")
    wanted = dict(local_grad_dtypes or {})
    unknown = sorted(set(wanted) - {n for n, _ in named})
    if unknown:
        raise ValueError(f"local_grad_dtypes names {unknown[0]!r}, which is not a trainable parameter here")
    by_name = dict(named)
    return [ParamAndGradBuffer([(n, by_name[n]) for n in b.names], dp_size=b.layout.dp_size, bucket_size=None,
                               grad_dtype=b.grad_dtype, is_expert=b.expert, whole=b.whole,
                               all_reduce=ddp.shard_grads and b.reduction == "all_reduce", layout=b.layout,
                               local_grad_dtypes=wanted)
            for b in plan.buffers]


def _device_of(buffers: Sequence[ParamAndGradBuffer]) -> torch.device:
    return buffers[0].param_data.device if buffers else torch.device("cpu")


def _trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def _check_same_params(comm: Comm | NullComm, named: list[tuple[str, nn.Parameter]], kind: str) -> None:
    """Every rank of ``comm`` wraps the same parameters (names, shapes, dtypes, in order)."""
    if comm.size == 1:
        return
    dtype_names = {dtype: str(dtype).removeprefix("torch.") for dtype in {p.dtype for _, p in named}}
    mine = [(n, tuple(p.shape), dtype_names[p.dtype]) for n, p in named]
    found = _disagreeing(comm, lambda: hashlib.sha256(repr(mine).encode()).digest(), lambda: mine)
    if found is None:
        return
    rank, everyone = found
    i, a, b = _first_mismatch(everyone[0], everyone[rank])
    raise ValueError(f"the {comm.name} ranks wrap different {kind} parameters: at position {i} rank 0 has {a} "
                     f"but rank {rank} has {b} (global ranks {comm.global_ranks[0]} and "
                     f"{comm.global_ranks[rank]}); every data-parallel rank must wrap the same model")
