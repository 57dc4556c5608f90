"""Contiguous parameter and gradient buffers and their buckets, laid out as ``optstack.layout`` says (no
collectives): one per (param dtype, grad dtype, dense/expert), parameters in backward order; every parameter's
``.data`` becomes a view of its buffer.

Local accumulation (``local_grad_dtypes``): chosen parameters accumulate their micro-batch gradients in a
tensor of their own, in a wider dtype (e.g. fp32 for bf16 gradients), rounded into the gradient buffer only
for the reduction (``stage_local_grads``) and given the reduced gradient back (``unstage_local_grads``), as
Megatron's ``param_name_patterns_for_fp32_local_accumulation`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from optstack.layout import Bucketing, BucketSlot, BufferLayout, OwnedSlice, ParamSlot

__all__ = ["ParamSlot", "BucketSlot", "OwnedSlice", "BufferLayout", "BufferKey", "Bucket", "Bucketing",
           "ParamAndGradBuffer", "build_buffers"]


@dataclass(frozen=True)
class BufferKey:
    """What makes parameters share a buffer."""

    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    is_expert: bool
    #: every parameter whole inside one rank's shard (``BufferLayout.plan(whole=True)``)
    whole: bool = False
    #: reduced whole on every rank (all-reduce) even where gradients are sharded: the stage stepping these
    #: parameters needs whole gradients (``optstack.plan``)
    all_reduce: bool = False


@dataclass(frozen=True, eq=False)
class Bucket:
    """A bucket's live tensors: 1-D views of the parameter and gradient buffers, and its parameters."""

    index: int
    slot: BucketSlot
    params: tuple[nn.Parameter, ...]
    param_data: torch.Tensor
    grad_data: torch.Tensor

    @property
    def numel_unpadded(self) -> int:
        """Elements up to the end of the bucket's last parameter (its padding excluded)."""
        return self.slot.numel_unpadded


class ParamAndGradBuffer:
    """One layout's flat storage: every parameter's ``.data`` becomes a view of ``param_data`` (values kept).

    Args:
        named_params: (name, parameter) in backward order; one dtype and one device.
        dp_size: the ranks the buckets are split across (expert data-parallel for experts).
        bucket_size: elements per bucket (None = one bucket).
        grad_dtype: gradient buffer dtype (None = the parameters' dtype).
        local_grad_dtypes: parameter name -> the dtype its gradient accumulates in locally, in a tensor of its
            own (``local_grads``; module docstring); names not in this buffer are ignored.
        whole: each parameter whole inside one rank's shard (``BufferLayout.plan``).
        all_reduce: reduced whole on every rank even where gradients are sharded (``BufferKey.all_reduce``).
        layout: the layout, planned beforehand (``optstack.plan``) for exactly these parameters in this order, of
            ``dp_size`` shards; None: planned here from the arguments above.
    """

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], *, dp_size: int,
                 bucket_size: int | None, grad_dtype: torch.dtype | None = None, is_expert: bool = False,
                 shard_align: int = 128, param_align: int = 64, bucketing: Bucketing | None = None,
                 local_grad_dtypes: Mapping[str, torch.dtype] | None = None, whole: bool = False,
                 all_reduce: bool = False, layout: BufferLayout | None = None) -> None:
        if not named_params:
            raise ValueError("ParamAndGradBuffer needs at least one parameter")
        first = named_params[0][1]
        for name, p in named_params:
            if p.dtype != first.dtype or p.device != first.device:
                raise ValueError(f"a buffer holds one dtype on one device; {name!r} is {p.dtype} on "
                                 f"{p.device}, {named_params[0][0]!r} is {first.dtype} on {first.device}")
        self.key = BufferKey(first.dtype, grad_dtype or first.dtype, is_expert, whole, all_reduce)
        if layout is None:
            layout = BufferLayout.plan([(n, tuple(p.shape)) for n, p in named_params], dp_size=dp_size,
                                       bucket_size=bucket_size, shard_align=shard_align, param_align=param_align,
                                       bucketing=bucketing, whole=whole)
        elif [(s.name, s.shape) for s in layout.params] != [(n, tuple(p.shape)) for n, p in named_params] \
                or layout.dp_size != dp_size:
            raise ValueError(f"ParamAndGradBuffer: the layout given is for other parameters or another number of "
                             f"shards ({layout.dp_size}, here {dp_size}); plan it for these parameters")
        self.layout = layout
        self.names = tuple(n for n, _ in named_params)
        self.params = tuple(p for _, p in named_params)
        self.param_data = torch.zeros(self.layout.numel, dtype=self.key.param_dtype, device=first.device)
        self.grad_data = torch.zeros(self.layout.numel, dtype=self.key.grad_dtype, device=first.device)
        self._slots = {id(p): slot for p, slot in zip(self.params, self.layout.params, strict=True)}
        self._by_name = dict(named_params)
        with torch.no_grad():
            for slot, p in zip(self.layout.params, self.params, strict=True):
                view = self.param_data[slot.offset:slot.end].view(slot.shape)
                view.copy_(p.data)
                p.data = view
        self.buckets = tuple(Bucket(b.index, b, tuple(self._by_name[n] for n in b.param_names),
                                    self.param_data[b.offset:b.end], self.grad_data[b.offset:b.end])
                             for b in self.layout.buckets)
        wanted = local_grad_dtypes or {}
        #: name -> the parameter's local accumulator (its shape, the dtype asked for), in buffer order
        self.local_grads: dict[str, torch.Tensor] = {
            n: torch.zeros(p.shape, dtype=wanted[n], device=first.device) for n, p in named_params if n in wanted}

    def __repr__(self) -> str:
        k = self.key
        return (f"ParamAndGradBuffer({len(self.params)} params, {self.layout.numel} elements, "
                f"{len(self.buckets)} buckets, param {k.param_dtype}, grad {k.grad_dtype}, expert={k.is_expert}"
                f"{', whole' if k.whole else ''})")

    def __contains__(self, param: object) -> bool:
        return id(param) in self._slots

    @property
    def numel(self) -> int:
        """Elements of the buffer, padding included."""
        return self.layout.numel

    @property
    def numel_unpadded(self) -> int:
        """Elements of the buffer without the buckets' end padding (the sum of ``Bucket.numel_unpadded``)."""
        return sum(b.numel_unpadded for b in self.buckets)

    def slot_of(self, param: torch.Tensor) -> ParamSlot:
        """The layout slot of ``param``."""
        if id(param) not in self._slots:
            raise ValueError(f"parameter of shape {tuple(param.shape)} is not in this buffer ({self!r})")
        return self._slots[id(param)]

    def name_of(self, param: torch.Tensor) -> str:
        return self.slot_of(param).name

    def param_of(self, name: str) -> nn.Parameter:
        """The parameter called ``name``."""
        self.layout.slot(name)  # raises a clear error for unknown names
        return self._by_name[name]

    def grad_view(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s gradient: a view of ``grad_data`` with ``param``'s shape, in the grad dtype."""
        slot = self.slot_of(param)
        return self.grad_data[slot.offset:slot.end].view(slot.shape)

    def local_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param``'s local accumulator, or None when it accumulates in the buffer (``grad_view``)."""
        return self.local_grads.get(self.name_of(param))

    def stage_local_grads(self, bucket: int) -> None:
        """Round the local accumulators of bucket ``bucket``'s parameters into the gradient buffer (before its
        reduction)."""
        with torch.no_grad():
            for name in self.layout.buckets[bucket].param_names:
                if name in self.local_grads:
                    self.grad_view(self._by_name[name]).copy_(self.local_grads[name])

    def unstage_local_grads(self, bucket: int) -> None:
        """Copy bucket ``bucket``'s reduced gradients back into its parameters' local accumulators."""
        with torch.no_grad():
            for name in self.layout.buckets[bucket].param_names:
                if name in self.local_grads:
                    self.local_grads[name].copy_(self.grad_view(self._by_name[name]))

    def scale_gradients(self, factor: float) -> None:
        """Multiply every gradient by ``factor``: the buffer's and the local accumulators."""
        with torch.no_grad():
            self.grad_data.mul_(factor)
            for grad in self.local_grads.values():
                grad.mul_(factor)

    def zero_gradients(self) -> None:
        """Zero every gradient: the buffer's and the local accumulators."""
        with torch.no_grad():
            self.grad_data.zero_()
            for grad in self.local_grads.values():
                grad.zero_()

    def param_shard_view(self, bucket: int, rank: int) -> torch.Tensor:
        """1-D view of the parameter buffer over ``rank``'s owned range of ``bucket``."""
        return self._shard(self.param_data, bucket, rank)

    def grad_shard_view(self, bucket: int, rank: int) -> torch.Tensor:
        """1-D view of the gradient buffer over ``rank``'s owned range of ``bucket``."""
        return self._shard(self.grad_data, bucket, rank)

    def _shard(self, data: torch.Tensor, bucket: int, rank: int) -> torch.Tensor:
        lo, hi = self.layout.owned_range(bucket, rank)
        offset = self.layout.buckets[bucket].offset
        return data[offset + lo:offset + hi]


def build_buffers(named_params: Sequence[tuple[str, nn.Parameter]], *, dp_size: int, expert_dp_size: int,
                  bucket_size: int | None, grad_dtype: torch.dtype | None = None,
                  is_expert: Callable[[nn.Parameter], bool] = lambda p: False,
                  shard_align: int = 128, param_align: int = 64, bucketing: Bucketing | None = None,
                  local_grad_dtypes: Mapping[str, torch.dtype] | None = None,
                  whole: Callable[[str, nn.Parameter], bool] | None = None) -> list[ParamAndGradBuffer]:
    """One ``ParamAndGradBuffer`` per ``BufferKey`` of ``named_params`` (backward order), in order of first use;
    ``is_expert`` ones split across ``expert_dp_size`` ranks; buckets cut as ``bucketing`` says; the parameters
    named in ``local_grad_dtypes`` accumulate locally in that dtype (``ParamAndGradBuffer``); those ``whole``
    chooses in buffers of their own, each whole inside one rank's shard.

    Raises:
        ValueError: a ``local_grad_dtypes`` name that is not in ``named_params``, or a dtype not floating-point.
    """
    names = {name for name, _ in named_params}
    for name, dtype in (local_grad_dtypes or {}).items():
        if name not in names:
            raise ValueError(f"local_grad_dtypes names {name!r}, which is not a trainable parameter here; "
                             f"the parameters are {sorted(names)[:8]}{' ...' if len(names) > 8 else ''}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"local_grad_dtypes[{name!r}] must be a floating-point torch.dtype, got {dtype!r}")
    groups: dict[BufferKey, list[tuple[str, nn.Parameter]]] = {}
    for name, p in named_params:
        in_whole = whole is not None and bool(whole(name, p))
        key = BufferKey(p.dtype, grad_dtype or p.dtype, bool(is_expert(p)), in_whole)
        groups.setdefault(key, []).append((name, p))
    return [ParamAndGradBuffer(members, dp_size=expert_dp_size if key.is_expert else dp_size,
                               bucket_size=bucket_size, grad_dtype=key.grad_dtype, is_expert=key.is_expert,
                               shard_align=shard_align, param_align=param_align, bucketing=bucketing,
                               local_grad_dtypes=local_grad_dtypes, whole=key.whole)
            for key, members in groups.items()]
