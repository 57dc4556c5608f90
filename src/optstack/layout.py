"""Buffer layouts: where each parameter lies in a contiguous buffer, how buckets are cut and how they split into
equal, aligned shards (pure: shapes in, numbers out). ``optstack.plan`` lays buffers out with it;
``distributed.buffers`` allocates them.

Parameters come in *backward* order (as in Megatron) so the first bucket fills first; each starts at a multiple
of ``param_align``. Buckets are cut at parameter boundaries while they fit in ``bucket_size`` elements (a larger
parameter gets its own) and zero-padded to a multiple of ``dp_size * shard_align``, so they split into
``dp_size`` equal, aligned shards: rank ``r`` owns ``[r * shard, (r + 1) * shard)``, cutting across parameters.
``Bucketing`` selects another rule, for a face that must reproduce a framework's layout (Megatron's).

Whole-shard layouts (``whole=True``): every parameter lies whole inside one rank's shard, so a reduce-scatter
hands each rank whole gradients of the parameters it owns. A bucket's parameters go to shards largest first,
each to the least-filled shard (little padding; ``Bucketing.whole_balance="cost"`` balances update cost
instead), in backward order inside a shard; the shards are padded to one size. A bucket closes once it holds
``max(bucket_size, dp_size x its largest parameter)`` elements (fewer would leave shards mostly padding), before
the first parameter that does not fit in the padding its shards need anyway.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

__all__ = ["BucketSlot", "Bucketing", "BufferLayout", "OwnedSlice", "ParamSlot", "Run", "newton_schulz_cost"]

#: A whole-shard bucket's shards are filled by cost only up to this multiple of its mean shard (bounded padding).
WHOLE_SHARD_SLACK = 1.3


def newton_schulz_cost(shape: Sequence[int]) -> float:
    """One parameter's update cost: ``max(m, n) * min(m, n) ** 2`` for an ``(m, n)`` matrix (a Newton-Schulz
    iteration's matmuls), ``b`` times that for a ``(b, m, n)`` stack of matrices (grouped experts, heads: one
    Newton-Schulz per matrix), the element count otherwise (an element-wise update)."""
    if len(shape) in (2, 3):
        *batch, m, n = shape
        return float(math.prod(batch) * max(m, n) * min(m, n) ** 2)
    return float(math.prod(shape))


def _align_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


#: ``(first rank, start, end, count)``: ranks ``first .. first + count - 1`` of a group each hold a stretch of
#: ``end - start`` elements of a flattened parameter, the i-th from ``start + i * (end - start)``
Run = tuple[int, int, int, int]


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
        whole_balance: how a whole-shard bucket's parameters go to shards: "elements": largest first, each to the
            least-filled shard (least padding); "cost": dearest first, each to the shard with the least cost over
            the buffer so far among those it leaves within ``WHOLE_SHARD_SLACK`` x the mean shard (Megatron's).
    """

    close: Literal["fit", "reach"] = "fit"
    pad: Literal["aligned", "even", "none"] = "aligned"
    param_align: int | None = None
    alone: frozenset[str] = frozenset()
    shard_align: int | None = None
    whole_balance: Literal["elements", "cost"] = "elements"

    def __post_init__(self) -> None:
        if self.close not in ("fit", "reach"):
            raise ValueError(f"Bucketing.close must be 'fit' or 'reach', got {self.close!r}")
        if self.pad not in ("aligned", "even", "none"):
            raise ValueError(f"Bucketing.pad must be 'aligned', 'even' or 'none', got {self.pad!r}")
        if self.whole_balance not in ("elements", "cost"):
            raise ValueError(f"Bucketing.whole_balance must be 'elements' or 'cost', got {self.whole_balance!r}")
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
             whole: bool = False, costs: Sequence[float] | None = None) -> BufferLayout:
        """Lay out ``params`` (name, shape), given in backward order, cut as ``bucketing`` says (module docstring);
        ``whole``: each parameter whole inside one rank's shard, balanced by ``costs`` (one per parameter; default
        ``newton_schulz_cost`` of the shapes). ``params`` of the result keep the given order; a bucket's
        ``param_names`` are in buffer order. ValueError for a size < 1, a repeated name or costs not matching the
        parameters."""
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
            if costs is None:
                costs = [newton_schulz_cost(shape) for _, shape in params]
            elif len(costs) != len(params):
                raise ValueError(f"costs has {len(costs)} entries for {len(params)} parameters")
            # each shard starts aligned too
            return cls._plan_whole(params, costs, dp_size, bucket_size, param_align,
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
    def _plan_whole(cls, params: Sequence[tuple[str, Sequence[int]]], costs: Sequence[float], dp_size: int,
                    bucket_size: int | None, param_align: int, multiple: int, rule: Bucketing) -> BufferLayout:
        """``plan(whole=True)``: buckets of whole-shard parameters (module docstring); ``multiple`` divides each
        bucket's size (a multiple of ``dp_size``)."""
        slots: dict[str, ParamSlot] = {}
        buckets: list[BucketSlot] = []
        start = 0
        members: list[tuple[str, tuple[int, ...], int, float]] = []  # the open bucket: (name, shape, numel, cost)
        loads = [0] * dp_size  # its shards, as arriving parameters fill them (close() re-plans them)
        held = largest = 0  # its elements, its largest parameter's
        work = [0.0] * dp_size  # each shard's cost over the buffer's buckets so far

        def least(values: list[int] | list[float], among: Sequence[int] | None = None) -> int:
            # ties: the lower rank (min keeps the first of equal keys; index finds the first minimum)
            return values.index(min(values)) if among is None else min(among, key=values.__getitem__)

        def close(alone: bool) -> None:
            nonlocal start, members, loads, held, largest
            filled, owner = [0] * dp_size, {}
            by_cost, cap = rule.whole_balance == "cost", WHOLE_SHARD_SLACK * held / dp_size
            for i in sorted(range(len(members)), key=lambda i: (-members[i][3 if by_cost else 2], i)):
                numel = members[i][2]
                fits = [r for r in range(dp_size) if filled[r] + numel <= cap] if by_cost else []
                # a bucket of its own (a shared embedding) goes to shard 0 and adds no work, as in Megatron
                owner[i] = rank = 0 if alone else least(work, fits) if fits else least(filled)
                filled[rank] += _align_up(numel, param_align)
                if not alone:
                    work[rank] += members[i][3]
            shard = _align_up(max(max(filled), 1) * dp_size, multiple) // dp_size
            index, order, unpadded = len(buckets), [], 0
            for rank in range(dp_size):
                at = start + rank * shard
                for i, (name, shape, numel, _) in enumerate(members):
                    if owner[i] == rank:
                        slots[name] = ParamSlot(name, shape, at, numel, index)
                        order.append(name)
                        unpadded = at + numel - start
                        at += _align_up(numel, param_align)
            buckets.append(BucketSlot(index, start, shard * dp_size, shard, tuple(order), unpadded))
            start, members, loads, held, largest = start + shard * dp_size, [], [0] * dp_size, 0, 0

        for (name, shape), cost in zip(params, costs, strict=True):
            numel = math.prod(shape)
            alone = name in rule.alone
            enough = bucket_size is not None and held >= max(bucket_size, dp_size * largest)
            # a parameter that fits in the padding the shards already need joins a bucket that is full enough
            absorbed = min(loads) + numel <= _align_up(max(loads), param_align)
            if members and (alone or (enough and not absorbed)):
                close(False)
            members.append((name, tuple(int(s) for s in shape), numel, float(cost)))
            loads[least(loads)] += _align_up(numel, param_align)
            held, largest = held + numel, max(largest, numel)
            if alone:
                close(True)
        if members:
            close(False)
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

    def runs(self, name: str) -> list[Run]:
        """Every rank's part of parameter ``name`` (``owned_slice`` of each rank) in at most three ``Run``s (the
        shards of a bucket are equal, so only the first and last rank's parts differ in size)."""
        slot = self.slot(name)
        if slot.numel == 0:
            return []
        bucket = self.buckets[slot.bucket]
        size, base = bucket.shard_numel, bucket.offset
        first, last = (slot.offset - base) // size, (slot.end - 1 - base) // size
        if first == last:
            return [(first, 0, slot.numel, 1)]
        head = base + (first + 1) * size - slot.offset  # where the second rank's part starts
        runs = [(first, 0, head, 1)]
        if last - first > 1:
            runs.append((first + 1, head, head + size, last - first - 1))
        runs.append((last, head + (last - first - 1) * size, slot.numel, 1))
        return runs

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
