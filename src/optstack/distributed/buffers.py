"""Contiguous parameter and gradient buffers, their buckets, and the range plan that shards them (no collectives).

One buffer per (param dtype, grad dtype, dense/expert), parameters in *backward* order (as in Megatron) so the
first bucket fills first. ``BufferLayout.plan``: each parameter starts at a multiple of ``param_align``; buckets
are cut at parameter boundaries while they fit in ``bucket_size`` elements (a larger parameter gets its own) and
zero-padded to a multiple of ``dp_size * shard_align``, so they split into ``dp_size`` equal, aligned shards:
rank ``r`` owns ``[r * shard, (r + 1) * shard)``, cutting across parameters.

``Bucketing`` selects another rule for a face that must reproduce a framework's layout (Megatron's: a bucket
closes once it *reaches* ``bucket_size``; padding only under the distributed optimizer; a shared embedding in
a bucket of its own); the default is the rule above.

Whole-shard buffers (``whole=True``): every parameter lies whole inside one rank's shard, so a reduce-scatter
hands each rank whole gradients of the parameters it owns and the stage can step whole matrices (Muon's
Newton-Schulz) over sharded gradients, then all-gather. A bucket's parameters are assigned to shards largest
first, each to the least-filled shard (balancing elements, so little padding), in backward order inside a shard;
the shards are padded to one size. A bucket closes once it holds ``max(bucket_size, dp_size x its largest
parameter)`` elements (fewer would leave shards mostly padding), before the first parameter that does not fit in
the padding its shards need anyway.

Local accumulation (``local_grad_dtypes``): chosen parameters accumulate their micro-batch gradients in a
tensor of their own, in a wider dtype (e.g. fp32 for bf16 gradients), rounded into the gradient buffer only
for the reduction (``stage_local_grads``) and given the reduced gradient back (``unstage_local_grads``), as
Megatron's ``param_name_patterns_for_fp32_local_accumulation`` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch
from torch import nn

__all__ = ["ParamSlot", "BucketSlot", "OwnedSlice", "BufferLayout", "BufferKey", "Bucket", "Bucketing",
           "ParamAndGradBuffer", "build_buffers"]


def _align_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its buffer: elements ``[offset, offset + numel)`` of bucket ``bucket``."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    bucket: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class BucketSlot:
    """One bucket: buffer elements ``[offset, offset + numel)``, padding included; ``param_names`` in buffer order;
    ``numel_unpadded``: up to the end of its last parameter."""

    index: int
    offset: int
    numel: int
    shard_numel: int
    param_names: tuple[str, ...]
    numel_unpadded: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class OwnedSlice:
    """The part ``[param_start, param_end)`` of one flattened parameter inside one rank's owned range of a
    bucket; ``buffer_start`` / ``shard_start``: where ``param_start`` sits in the buffer / the rank's shard."""

    name: str
    param_start: int
    param_end: int
    buffer_start: int
    shard_start: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


@dataclass(frozen=True)
class Bucketing:
    """How ``BufferLayout.plan`` cuts buckets (the defaults are optstack's rule, module docstring).

    Attributes:
        close: "fit": a bucket closes before a parameter that would take it over ``bucket_size`` (a larger
            parameter gets its own); "reach": a bucket closes once it holds ``bucket_size`` elements or more
            (Megatron's rule).
        pad: "aligned": each bucket is zero-padded to a multiple of ``dp_size * shard_align`` (equal shards,
            each aligned); "even": to a multiple of ``lcm(dp_size, shard_align)`` (equal shards; Megatron's
            distributed optimizer); "none": not padded (buckets that are never sharded).
        param_align: each parameter starts at a multiple of this; None: the plan's ``param_align``.
        shard_align: what "aligned" / "even" padding aligns to; None: the plan's ``shard_align``.
        alone: names of parameters that get a bucket to themselves.
    """

    close: Literal["fit", "reach"] = "fit"
    pad: Literal["aligned", "even", "none"] = "aligned"
    param_align: int | None = None
    alone: frozenset[str] = frozenset()
    shard_align: int | None = None

    def __post_init__(self) -> None:
        if self.close not in ("fit", "reach"):
            raise ValueError(f"Bucketing.close must be 'fit' or 'reach', got {self.close!r}")
        if self.pad not in ("aligned", "even", "none"):
            raise ValueError(f"Bucketing.pad must be 'aligned', 'even' or 'none', got {self.pad!r}")
        for name in ("param_align", "shard_align"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"Bucketing.{name} must be None or a positive integer, got {value!r}")


@dataclass(frozen=True)
class BufferLayout:
    """The pure plan of one buffer (module docstring); build it with ``BufferLayout.plan``."""

    params: tuple[ParamSlot, ...]
    buckets: tuple[BucketSlot, ...]
    numel: int
    dp_size: int

    @classmethod
    def plan(cls, params: Sequence[tuple[str, Sequence[int]]], *, dp_size: int, bucket_size: int | None,
             shard_align: int = 128, param_align: int = 64, bucketing: Bucketing | None = None,
             whole: bool = False) -> BufferLayout:
        """Lay out ``params`` (name, shape), given in backward order, cut as ``bucketing`` says (default: the
        module docstring's rule); ``whole``: each parameter whole inside one rank's shard (module docstring).
        ``params`` of the result keep the given order; a bucket's ``param_names`` are in buffer order.
        ValueError for a size < 1 or a repeated name."""
        rule = bucketing if bucketing is not None else Bucketing()
        if rule.param_align is not None:
            param_align = rule.param_align
        if rule.shard_align is not None:
            shard_align = rule.shard_align
        sizes = {"dp_size": dp_size, "shard_align": shard_align, "param_align": param_align,
                 "bucket_size": 1 if bucket_size is None else bucket_size}
        for field_name, value in sizes.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field_name} must be a positive integer, got {value!r}")
        names = [name for name, _ in params]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"parameter names must be unique; {dup!r} appears twice")
        multiple = {"aligned": dp_size * shard_align, "even": math.lcm(dp_size, shard_align), "none": 1}[rule.pad]
        if whole:
            # each shard starts aligned too
            return cls._plan_whole(params, dp_size, bucket_size, param_align,
                                   math.lcm(multiple, dp_size * param_align), rule)
        slots: list[ParamSlot] = []
        buckets: list[BucketSlot] = []
        start, offset, members = 0, 0, []  # the open bucket's start, the next free element, its parameters

        def close() -> None:
            nonlocal start, offset, members
            end = max(_align_up(offset, multiple), start + multiple)
            buckets.append(BucketSlot(len(buckets), start, end - start, (end - start) // dp_size, tuple(members),
                                      offset - start))
            start, offset, members = end, end, []

        for name, shape in params:
            numel, at = math.prod(shape), _align_up(offset, param_align)
            alone = name in rule.alone
            too_big = rule.close == "fit" and bucket_size is not None and at + numel - start > bucket_size
            if members and (too_big or alone):
                close()
                at = _align_up(offset, param_align)
            slots.append(ParamSlot(name, tuple(int(s) for s in shape), at, numel, len(buckets)))
            members.append(name)
            offset = at + numel
            if alone or (rule.close == "reach" and bucket_size is not None and offset - start >= bucket_size):
                close()
        if members:
            close()
        return cls(tuple(slots), tuple(buckets), start, dp_size)

    @classmethod
    def _plan_whole(cls, params: Sequence[tuple[str, Sequence[int]]], dp_size: int, bucket_size: int | None,
                    param_align: int, multiple: int, rule: Bucketing) -> BufferLayout:
        """``plan(whole=True)``: buckets of whole-shard parameters (module docstring); ``multiple`` divides each
        bucket's size (a multiple of ``dp_size``)."""
        slots: dict[str, ParamSlot] = {}
        buckets: list[BucketSlot] = []
        start = 0
        members: list[tuple[str, tuple[int, ...], int]] = []  # the open bucket: (name, shape, numel)
        loads = [0] * dp_size  # its shards, as arriving parameters fill them (close() re-plans them)
        held = largest = 0  # its elements, its largest parameter's

        def least_loaded(shard_loads: list[int]) -> int:
            return shard_loads.index(min(shard_loads))  # ties: the lower rank

        def close() -> None:
            nonlocal start, members, loads, held, largest
            final, owner = [0] * dp_size, {}
            for i in sorted(range(len(members)), key=lambda i: (-members[i][2], i)):
                owner[i] = rank = least_loaded(final)
                final[rank] += _align_up(members[i][2], param_align)
            shard = _align_up(max(max(final), 1) * dp_size, multiple) // dp_size
            index, order, unpadded = len(buckets), [], 0
            for rank in range(dp_size):
                at = start + rank * shard
                for i, (name, shape, numel) in enumerate(members):
                    if owner[i] == rank:
                        slots[name] = ParamSlot(name, shape, at, numel, index)
                        order.append(name)
                        unpadded = at + numel - start
                        at += _align_up(numel, param_align)
            buckets.append(BucketSlot(index, start, shard * dp_size, shard, tuple(order), unpadded))
            start, members, loads, held, largest = start + shard * dp_size, [], [0] * dp_size, 0, 0

        for name, shape in params:
            numel = math.prod(shape)
            alone = name in rule.alone
            enough = bucket_size is not None and held >= max(bucket_size, dp_size * largest)
            # a parameter that fits in the padding the shards already need joins a bucket that is full enough
            absorbed = min(loads) + numel <= _align_up(max(loads), param_align)
            if members and (alone or (enough and not absorbed)):
                close()
            members.append((name, tuple(int(s) for s in shape), numel))
            loads[least_loaded(loads)] += _align_up(numel, param_align)
            held, largest = held + numel, max(largest, numel)
            if alone:
                close()
        if members:
            close()
        return cls(tuple(slots[name] for name, _ in params), tuple(buckets), start, dp_size)

    @cached_property
    def holds_whole(self) -> bool:
        """Every parameter lies inside one rank's shard of its bucket (a reduce-scatter gives it whole)."""
        return all(self.owner_of(p.name) is not None for p in self.params)

    def owner_of(self, name: str) -> int | None:
        """The rank whose shard holds parameter ``name`` whole, or None when shards cut it."""
        p = self.slot(name)
        b = self.buckets[p.bucket]
        first, last = ((x - b.offset) // b.shard_numel for x in (p.offset, max(p.end - 1, p.offset)))
        return first if first == last else None

    @cached_property
    def _by_name(self) -> dict[str, ParamSlot]:
        return {slot.name: slot for slot in self.params}

    def slot(self, name: str) -> ParamSlot:
        """The slot of parameter ``name``."""
        try:
            return self._by_name[name]
        except KeyError:
            raise ValueError(f"no parameter {name!r} in this buffer; it has {list(self._by_name)}") from None

    def owned_range(self, bucket: int, rank: int) -> tuple[int, int]:
        """``[start, end)`` owned by ``rank`` within bucket ``bucket`` (relative to the bucket's start)."""
        if not 0 <= rank < self.dp_size:
            raise ValueError(f"rank must be in [0, {self.dp_size}), got {rank}")
        shard = self.buckets[bucket].shard_numel
        return rank * shard, (rank + 1) * shard

    def owned_slices(self, bucket: int, rank: int) -> tuple[OwnedSlice, ...]:
        """Per parameter of ``bucket`` that intersects ``rank``'s owned range, its part of it (buffer order)."""
        parts = (self.owned_slice(name, rank) for name in self.buckets[bucket].param_names)
        return tuple(part for part in parts if part is not None)

    def owned_slice(self, name: str, rank: int) -> OwnedSlice | None:
        """The part of parameter ``name`` inside ``rank``'s owned range of its bucket, or None (no overlap).
        Constant time, so a caller walking every parameter stays linear in the bucket's size."""
        p = self.slot(name)
        lo, hi = (self.buckets[p.bucket].offset + x for x in self.owned_range(p.bucket, rank))
        start, end = max(p.offset, lo), min(p.end, hi)
        return OwnedSlice(p.name, start - p.offset, end - p.offset, start, start - lo) if start < end else None


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
                  whole: Callable[[str, nn.Parameter], bool] | None = None,
                  all_reduce: Callable[[str, nn.Parameter], bool] | None = None) -> list[ParamAndGradBuffer]:
    """One ``ParamAndGradBuffer`` per ``BufferKey`` of ``named_params`` (backward order), in order of first use;
    ``is_expert`` ones split across ``expert_dp_size`` ranks; buckets cut as ``bucketing`` says; the parameters
    named in ``local_grad_dtypes`` accumulate locally in that dtype (``ParamAndGradBuffer``); those ``whole``
    chooses in buffers of their own, each whole inside one rank's shard; those ``all_reduce`` chooses in buffers
    of their own, reduced whole (``BufferKey.all_reduce``).

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
        reduced_whole = all_reduce is not None and bool(all_reduce(name, p))
        key = BufferKey(p.dtype, grad_dtype or p.dtype, bool(is_expert(p)), in_whole, reduced_whole)
        groups.setdefault(key, []).append((name, p))
    return [ParamAndGradBuffer(members, dp_size=expert_dp_size if key.is_expert else dp_size,
                               bucket_size=bucket_size, grad_dtype=key.grad_dtype, is_expert=key.is_expert,
                               shard_align=shard_align, param_align=param_align, bucketing=bucketing,
                               local_grad_dtypes=local_grad_dtypes, whole=key.whole, all_reduce=key.all_reduce)
            for key, members in groups.items()]
