"""Megatron's view of the wrapper's buffers and its ``param_layout`` names.

``BufferView`` and ``BucketView`` present one core buffer (``optstack.distributed.buffers``) with the attribute
names Megatron code reads (``param_index_map``, ``params_list``, ``offset``, ``data_parallel_group``, ...; reads
only, plus Megatron's per-bucket scratch ``layerwise_gather_list``). ``plan_buffer`` lays out one buffer as the
wrapper does, so a precomputed ``FullParamLayout`` (``ddp_config.compute_full_param_layout``) is the layout the
wrapper builds. Megatron's ``BufferKey`` is the core's with Megatron's field names (``is_expert_parallel``,
``is_managed_by_layer_wise_optimizer``: ``is_expert``, ``whole``). A buffer of parameters managed by the
layer-wise optimizer is the core's whole-shard buffer, packed by Newton-Schulz cost as Megatron packs it; a
GTP-sharded weight (``is_gtp_weight_remat``) costs the whole matrix it is gathered into (``update_shape``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from optstack.distributed.buffers import Bucket, Bucketing, BufferLayout, ParamAndGradBuffer
from optstack.distributed.buffers import BufferKey as CoreBufferKey
from optstack.distributed.comm import Comm, NullComm, torch_group
from optstack.layout import newton_schulz_cost

__all__ = ["BucketView", "BufferKey", "BufferView", "FullParamLayout", "PerBufferParamLayout", "Range",
           "bucket_end_divisor", "build_model_gbuf_range", "group_params_for_buffers",
           "megatron_bucketing_for", "megatron_key", "pad_bucket_end", "pad_param_start", "pad_to_divisor",
           "per_buffer_layout", "plan_buffer", "update_shape"]


def pad_to_divisor(value: int, divisor: int) -> int:
    """``value`` rounded up to a multiple of ``divisor`` (Megatron's helper)."""
    return -(-value // divisor) * divisor


def pad_param_start(param_start_index: int) -> int:
    """A parameter's start rounded up to a multiple of 64 elements (Megatron's alignment)."""
    return pad_to_divisor(param_start_index, 64)


def bucket_end_divisor(data_parallel_world_size: int, pad_for_high_nccl_busbw: bool) -> int:
    """What a distributed-optimizer bucket's length is a multiple of: ``lcm(dp, 128)`` (``lcm(dp, 128, 2**16)``
    with ``pad_for_high_nccl_busbw``: ``DistributedDataParallelConfig.pad_buckets_for_high_nccl_busbw``)."""
    if pad_for_high_nccl_busbw:
        return math.lcm(data_parallel_world_size, 128, 2**16)
    return math.lcm(data_parallel_world_size, 128)


def pad_bucket_end(bucket_end_index: int, data_parallel_world_size: int, pad_for_high_nccl_busbw: bool) -> int:
    """A bucket's end rounded up to ``bucket_end_divisor`` (Megatron's helper)."""
    return pad_to_divisor(bucket_end_index, bucket_end_divisor(data_parallel_world_size, pad_for_high_nccl_busbw))


@dataclass(frozen=True)
class BufferKey:
    """Megatron's identity of a buffer: parameters sharing all four fields share a buffer.

    Attributes:
        param_dtype / grad_dtype: the buffer's dtypes.
        is_expert_parallel: expert (``allreduce=False``) parameters, reduced over expert data-parallel.
        is_managed_by_layer_wise_optimizer: parameters the layer-wise optimizer steps (Muon's matrices), laid out
            so that each lies whole inside one rank's shard (the core's ``BufferKey.whole``).
    """

    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    is_expert_parallel: bool
    is_managed_by_layer_wise_optimizer: bool = False


def megatron_key(key: CoreBufferKey) -> BufferKey:
    """Megatron's ``BufferKey`` of a core buffer's key."""
    return BufferKey(key.param_dtype, key.grad_dtype, key.is_expert, key.whole)


def _key_of(param: nn.Parameter, grad_reduce_in_fp32: bool) -> BufferKey:
    return BufferKey(param.dtype, torch.float32 if grad_reduce_in_fp32 else param.dtype,
                     not getattr(param, "allreduce", True),
                     bool(getattr(param, "is_managed_by_layer_wise_optimizer", False)))


def group_params_for_buffers(params: Sequence[nn.Parameter], grad_reduce_in_fp32: bool
                             ) -> dict[BufferKey, tuple[list[nn.Parameter], list[int]]]:
    """Megatron's grouping of ``params`` into buffers: ``{BufferKey: (its parameters in the given order, each
    one's index among the parameters of its key)}``, keys in order of first appearance.

    Raises:
        ValueError: a parameter that does not require gradients (the wrapper holds trainable ones only).
    """
    out: dict[BufferKey, tuple[list[nn.Parameter], list[int]]] = {}
    for index, param in enumerate(params):
        if not param.requires_grad:
            raise ValueError(f"group_params_for_buffers: parameter {index} (shape {tuple(param.shape)}) does not "
                             "require gradients; pass the trainable parameters only")
        members, indices = out.setdefault(_key_of(param, grad_reduce_in_fp32), ([], []))
        indices.append(len(members))
        members.append(param)
    return out


def megatron_bucketing_for(params: Sequence[tuple[str, nn.Parameter]], *, distributed_optimizer: bool,
                           high_nccl_busbw: bool = False) -> Bucketing:
    """Megatron's bucket rule for (name, param) pairs: closes a bucket once it reaches ``bucket_size``; with the
    distributed optimizer, parameters 64-aligned, buckets padded to ``lcm(dp, 128)`` (``lcm(dp, 128, 2**16)`` with
    ``high_nccl_busbw``: ``pad_buckets_for_high_nccl_busbw``), a truthy ``shared_embedding`` parameter in a
    bucket of its own and whole-shard buckets packed by Newton-Schulz cost; without it nothing padded."""
    if not distributed_optimizer:
        return Bucketing(close="reach", pad="none", param_align=1)
    shared = frozenset(n for n, p in params if getattr(p, "shared_embedding", False))
    return Bucketing(close="reach", pad="even", param_align=64, alone=shared,
                     shard_align=2**16 if high_nccl_busbw else 128, whole_balance="cost")


@dataclass
class PerBufferParamLayout:
    """Megatron's layout of one buffer: ``param_index_map`` {param: (start, end, bucket_id)}, ``bucket_indices``
    [(start, end)] (padding included), ``per_bucket_numel_unpadded``, ``param_indices`` and
    ``num_optimizer_shards`` (the ranks each bucket is split across)."""

    param_index_map: dict[nn.Parameter, tuple[int, int, int]] = field(default_factory=dict)
    bucket_indices: list[tuple[int, int]] = field(default_factory=list)
    per_bucket_numel_unpadded: list[int] = field(default_factory=list)
    param_indices: list[int] = field(default_factory=list)
    num_optimizer_shards: int | None = None


@dataclass
class FullParamLayout:
    """Megatron's layouts of every buffer of a model chunk, keyed by Megatron's ``BufferKey``."""

    layouts: dict[BufferKey, PerBufferParamLayout] = field(default_factory=dict)


def per_buffer_layout(layout: BufferLayout, params: Sequence[nn.Parameter], *, shards: int | None,
                indices: Sequence[int] | None = None) -> PerBufferParamLayout:
    """Megatron's ``PerBufferParamLayout`` of a core layout whose slots are ``params`` (backward order);
    ``indices``: each parameter's index among its key's in forward order (default: their backward positions
    reversed)."""
    return PerBufferParamLayout(
        param_index_map={p: (s.offset, s.end, s.bucket) for p, s in zip(params, layout.params, strict=True)},
        bucket_indices=[(b.offset, b.end) for b in layout.buckets],
        per_bucket_numel_unpadded=[b.numel_unpadded for b in layout.buckets],
        param_indices=list(indices) if indices is not None else list(range(len(params)))[::-1],
        num_optimizer_shards=shards)


def update_shape(param: nn.Parameter) -> tuple[int, ...] | None:
    """The matrix Newton-Schulz runs on for a GTP-sharded weight (Megatron's ``is_gtp_weight_remat``: a row shard
    gathered from ``gtp_remat_size`` ranks first), else None (its own shape)."""
    if getattr(param, "is_gtp_weight_remat", False) and param.dim() == 2:
        return (param.shape[0] * int(getattr(param, "gtp_remat_size", 1)), param.shape[1])
    return None


def plan_buffer(params: Sequence[nn.Parameter], bucket_size: int | None, dp_size: int, ddp_config: Any, *,
                whole: bool, indices: Sequence[int] | None = None) -> PerBufferParamLayout:
    """The distributed-optimizer layout of one buffer's ``params`` (forward order) as the face's wrapper builds
    it from ``ddp_config``: the core's plan with Megatron's bucket rule, split across ``dp_size`` ranks;
    ``whole``: each parameter whole inside one rank's shard (the layer-wise optimizer's buffers)."""
    backward = list(reversed(params))
    named = [(str(i), p) for i, p in enumerate(backward)]
    rule = megatron_bucketing_for(named, distributed_optimizer=True,
                                  high_nccl_busbw=bool(getattr(ddp_config, "pad_buckets_for_high_nccl_busbw", False)))
    plan = BufferLayout.plan([(n, tuple(p.shape)) for n, p in named], dp_size=dp_size, bucket_size=bucket_size,
                             bucketing=rule, whole=whole,
                             costs=[newton_schulz_cost(update_shape(p) or p.shape) for p in backward])
    return per_buffer_layout(plan, backward, shards=dp_size, indices=None if indices is None else list(indices)[::-1])


def _compute_default_per_buffer_param_layout(params: Sequence[nn.Parameter], bucket_size: int | None
                                             ) -> PerBufferParamLayout:
    """Megatron's layout of a buffer without the distributed optimizer: ``params`` (forward order) in backward
    order, unpadded, a bucket closing once it reaches ``bucket_size``."""
    backward = list(reversed(params))
    named = [(str(i), p) for i, p in enumerate(backward)]
    plan = BufferLayout.plan([(n, tuple(p.shape)) for n, p in named], dp_size=1, bucket_size=bucket_size,
                             bucketing=megatron_bucketing_for(named, distributed_optimizer=False))
    out = per_buffer_layout(plan, backward, shards=None)
    out.param_indices = []
    return out


@dataclass(frozen=True)
class Range:
    """Megatron's index range ``[start, end)``."""

    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start

    def normalize(self, start: int = 0) -> Range:
        return Range(start, start + self.size)


class BucketView:
    """One core bucket with Megatron's attribute names; other attributes are the core bucket's.

    Attributes:
        params_list: its parameters in buffer order; params: the same, as a set.
        param_to_index: {param: (start, end)} relative to the bucket's start.
        offset: the bucket's start in the buffer. layerwise_gather_list: the layer-wise gather in flight (None).
        layerwise_params_list / layerwise_param_flat_sizes: the layer-wise optimizer's parameters of this bucket
            per data-parallel rank, and their element counts (None without ``overlap_param_gather``).
    """

    def __init__(self, bucket: Bucket, buffer: ParamAndGradBuffer) -> None:
        self.core = bucket
        self.offset = bucket.slot.offset
        self.params_list = list(bucket.params)
        self.params = set(bucket.params)
        self.param_to_index = {p: (buffer.slot_of(p).offset - self.offset, buffer.slot_of(p).end - self.offset)
                               for p in bucket.params}
        self.layerwise_gather_list: list[torch.Tensor] | None = None
        # Megatron's layer-wise gather plan (set by LayerWiseDistributedOptimizer with overlap_param_gather):
        # per data-parallel rank, the bucket's parameters that rank steps, and their element counts.
        self.layerwise_params_list: list[list[nn.Parameter]] | None = None
        self.layerwise_param_flat_sizes: list[int] | None = None
        # the bucket's parameters with an fp32 local accumulator (param_name_patterns_for_fp32_local_accumulation)
        self.params_with_extra_main_grads: list[nn.Parameter] = []

    def set_layerwise_params_list(self, layerwise_params_list: list[list[nn.Parameter]]) -> None:
        """Set, per data-parallel rank, the parameters of this bucket that rank steps (and their sizes).

        Raises:
            ValueError: a parameter not in this bucket.
        """
        stray = [tuple(p.shape) for params in layerwise_params_list for p in params if p not in self.params]
        if stray:
            raise ValueError(f"layerwise_params_list holds parameters of shapes {stray} that are not in this bucket")
        self.layerwise_params_list = [list(params) for params in layerwise_params_list]
        self.layerwise_param_flat_sizes = [sum(p.numel() for p in params) for params in layerwise_params_list]

    def __getattr__(self, name: str) -> Any:  # only for names not set here: the core bucket's
        if name == "core":
            raise AttributeError(name)
        return getattr(self.core, name)

    @property
    def bucket_id(self) -> int:
        return self.core.index

    def __repr__(self) -> str:
        return f"BucketView({self.core.index}, {len(self.params_list)} params, offset {self.offset})"


class BufferView:
    """One core ``ParamAndGradBuffer`` with Megatron's attribute names; other attributes are the core buffer's.

    Attributes:
        buckets: ``BucketView`` per bucket. param_index_map: {param: (start, end, bucket_id)}.
        data_parallel_group: the torch process group its buckets are split across (None on one process).
        param_dtype / grad_dtype: the buffer's dtypes. num_optimizer_shards: ranks a bucket is split across.
    """

    def __init__(self, buffer: ParamAndGradBuffer, shard_comm: Comm | NullComm) -> None:
        self.core = buffer
        self._comm = shard_comm
        self.buckets = tuple(BucketView(b, buffer) for b in buffer.buckets)
        self.param_index_map = {p: (buffer.slot_of(p).offset, buffer.slot_of(p).end, buffer.slot_of(p).bucket)
                                for p in buffer.params}
        self._group: Any = None
        self.param_dtype, self.grad_dtype = buffer.key.param_dtype, buffer.key.grad_dtype
        self.num_optimizer_shards = shard_comm.size
        # Megatron's fp32 local accumulation: the parameters' own accumulators (the core's local_grads)
        self.extra_main_grads: list[torch.Tensor] = list(buffer.local_grads.values())
        for view in self.buckets:
            view.params_with_extra_main_grads = [p for p in view.params_list if buffer.local_grad(p) is not None]

    def __getattr__(self, name: str) -> Any:  # only for names not set above: the core buffer's
        if name in ("core", "_comm"):
            raise AttributeError(name)
        return getattr(self.core, name)

    def __contains__(self, param: object) -> bool:
        return param in self.core

    def __repr__(self) -> str:
        return f"BufferView({self.core!r})"

    def reset(self) -> None:
        """Zero every gradient, the fp32 local accumulators' too (Megatron's name)."""
        self.core.zero_gradients()

    @property
    def data_parallel_group(self) -> Any:
        """The torch process group the buckets are split across: the group's own, or for a group of one rank a
        group of just this rank (None when torch.distributed is not initialised)."""
        if self._group is None:
            self._group = torch_group(self._comm)
        return self._group

    @property
    def shard_rank(self) -> int:
        return self._comm.rank

    def param_layout(self) -> PerBufferParamLayout:
        """This buffer's layout as Megatron's ``PerBufferParamLayout``."""
        return per_buffer_layout(self.core.layout, self.core.params, shards=self.num_optimizer_shards)


def build_model_gbuf_range(buffer: BufferView, bucket_index: int) -> dict[str, Any]:
    """Megatron's ``DistributedOptimizer._build_model_gbuf_range``: ``{"param_map": {param: ranges}}`` for the
    parameters of bucket ``bucket_index`` inside this rank's shard; ranges are Megatron's ``gbuf_world``,
    ``gbuf_world_in_bucket``, ``gbuf_local`` and ``param`` ``Range``s."""
    core, rank = buffer.core, buffer.shard_rank
    bucket = core.layout.buckets[bucket_index]
    shards = bucket.numel // bucket.shard_numel if bucket.shard_numel else 1
    if shards != buffer.num_optimizer_shards:
        raise ValueError(f"bucket {bucket_index} is split into {shards} shards but the buffer's group has "
                         f"{buffer.num_optimizer_shards} ranks")
    param_map = {}
    for part in core.layout.owned_slices(bucket_index, rank):
        world = Range(part.buffer_start, part.buffer_start + part.numel)
        param_map[core.param_of(part.name)] = {
            "gbuf_world": world,
            "gbuf_world_in_bucket": Range(world.start - bucket.offset, world.end - bucket.offset),
            "gbuf_local": Range(part.shard_start, part.shard_start + part.numel),
            "param": Range(part.param_start, part.param_end),
        }
    return {"param_map": param_map}
