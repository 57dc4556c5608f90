"""``ParamPlan``: who holds and steps which parameter, decided once, before any wrapper, buffer or stage exists.

A pure, deterministic function of the parameter specs (shapes alone, or meta tensors), their resolved settings,
the config and a ``Topology`` given as numbers. Per parameter it records group, algorithm, placement, buffer,
bucket, offset and owner rank; the data-parallel wrapper lays its buffers out from it, the factory builds one
stage per ``PlannedStage``, and ``optstack plan`` prints what it costs per rank. Ranks agree on it by exchanging
``digest()``, never the lists themselves.

Placement follows from the algorithm's declared capabilities and ``config.distributed.sharding``
(``placement_of``); for whole matrices under ZeRO-1 the plan weighs two layouts (``choose_whole_matrix_layout``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from optstack.algorithms.registry import Capabilities, get_algorithm
from optstack.groups import GroupKey, group_keys
from optstack.layout import Bucketing, BufferLayout, newton_schulz_cost
from optstack.rules import Resolved

__all__ = ["ParamSpec", "Placement", "PlannedBuffer", "PlannedParam", "PlannedStage", "ParamPlan", "Topology",
           "WHOLE_SHARD_MAX_PADDING", "WHOLE_SHARD_MIN_BUCKETS", "WHOLE_SHARD_PADDING_FLOOR", "assign_params",
           "choose_whole_matrix_layout", "first_difference", "newton_schulz_cost", "pack_owners", "placement_of",
           "spec_digest", "specs_of"]

#: the whole-shard layout is used while it pads its buffers by at most this fraction ...
WHOLE_SHARD_MAX_PADDING = 0.05
#: ... or by at most this many elements in all (padding that small costs nothing worth a layer-wise step)
WHOLE_SHARD_PADDING_FLOOR = 1 << 20
#: whole-shard buckets made larger to pad less must still number this many (their reductions overlap backward)
WHOLE_SHARD_MIN_BUCKETS = 4

Placement = Literal["replicated", "zero1", "zero1_whole", "zero1_owners", "layerwise", "dtensor", "dtensor_owner"]
Reduction = Literal["all_reduce", "reduce_scatter"]


@dataclass(frozen=True)
class ParamSpec:
    """What the plan knows of one parameter: no tensor, so a 100B model plans on a laptop."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    expert: bool = False
    #: the matrix the update runs on when larger than the tensor (a tensor-parallel shard gathered first)
    update_shape: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def cost(self) -> float:
        """The update's cost (``newton_schulz_cost`` of the matrix it runs on)."""
        return newton_schulz_cost(self.update_shape or self.shape)

    def key(self) -> tuple[Any, ...]:
        """A canonical, printable form (digests, error messages)."""
        out = (self.name, self.shape, str(self.dtype).removeprefix("torch."), self.expert)
        return out if self.update_shape is None else (*out, self.update_shape)


def specs_of(named: Iterable[tuple[str, torch.Tensor]]) -> list[ParamSpec]:
    """Specs of ``(name, parameter)`` pairs (meta tensors work); Megatron's ``allreduce = False`` marks experts."""
    return [ParamSpec(n, tuple(int(s) for s in p.shape), p.dtype, not getattr(p, "allreduce", True))
            for n, p in named]


def spec_digest(specs: Sequence[ParamSpec]) -> bytes:
    """32 bytes that differ when the specs (names, shapes, dtypes, expert flags, order) differ."""
    h = hashlib.sha256()
    for spec in specs:
        h.update(repr(spec.key()).encode())
        h.update(b"\0")
    return h.digest()


@dataclass(frozen=True, kw_only=True)
class Topology:
    """The world as numbers (no process groups): data-parallel size, this rank's data-parallel rank,
    distributed-optimizer instances (dense gradients sharded over ``dp // instances`` ranks), expert parallelism
    (expert gradients sharded over ``dp // ep``), and the model-parallel sizes."""

    dp: int = 1
    rank: int = 0
    instances: int = 1
    ep: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "instances", "ep", "tp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Topology.{name} must be a positive integer, got {value!r}")
        if not 0 <= self.rank < self.dp:
            raise ValueError(f"Topology.rank must be in [0, dp={self.dp}), got {self.rank}")
        for name in ("instances", "ep"):
            if self.dp % getattr(self, name):
                raise ValueError(f"Topology.{name}={getattr(self, name)} must divide dp={self.dp}")

    @property
    def shard_size(self) -> int:
        """Ranks a dense bucket is split across (one distributed-optimizer instance)."""
        return self.dp // self.instances

    @property
    def expert_dp(self) -> int:
        """Ranks an expert bucket is split across."""
        return self.dp // self.ep


def placement_of(capabilities: Capabilities, sharding: str, *, wrapped: bool, dtensor: bool = False) -> Placement:
    """Where an algorithm's parameters are stepped, from what it declares and ``config.distributed.sharding``.

    ``zero1`` for an algorithm needing whole matrices means owners stepping whole matrices: ``zero1_whole``
    here, which ``choose_whole_matrix_layout`` may turn into ``layerwise``."""
    if dtensor:
        return "dtensor_owner" if capabilities.whole_matrices else "dtensor"
    if not wrapped:
        return "replicated"
    if capabilities.whole_matrices:
        return {"zero1": "zero1_whole", "layerwise": "layerwise"}.get(sharding, "replicated")  # type: ignore
    return "zero1" if sharding == "zero1" and capabilities.elementwise else "replicated"


def _check_capabilities(spec: ParamSpec, algorithm: str, config: Any) -> None:
    """Refuse a parameter that its algorithm's capabilities cannot take (a whole-matrix algorithm given a vector
    or a 4-D kernel), naming the parameter, the algorithm and the rule that routes it elsewhere."""
    caps = get_algorithm(algorithm).capabilities
    if caps.whole_matrices and len(spec.shape) not in caps.matrix_ndims:
        scalar = config.muon.scalar_algorithm
        rule = (f'Rule(Ndim(lt={min(caps.matrix_ndims)}), algorithm="{scalar}")' if len(spec.shape) < 2
                else f'Rule(Name("{spec.name}"), algorithm="{scalar}")')
        raise ValueError(f"algorithm {algorithm!r} needs whole matrices of {' or '.join(map(str, caps.matrix_ndims))}"
                         f" dims (its capabilities); parameter {spec.name!r} has shape {spec.shape}. Route it to an "
                         f"element-wise algorithm with a rule, e.g. {rule}")


def pack_owners(costs: Sequence[float], ranks: int) -> list[int]:
    """Owner rank of each item: the makespan of largest-first-to-least-loaded (the optimum within the largest
    cost), then the items packed largest first into as few ranks as that makespan allows (first fit), so that
    the ranks holding work hold about equal work; where first fit needs more ranks, the greedy assignment.
    ``assign_params`` checks the arguments."""
    greedy = assign_params(list(costs), ranks)
    loads = [0.0] * ranks
    for cost, owner in zip(costs, greedy, strict=True):
        loads[owner] += cost
    capacity = max(loads, default=0.0)
    bins: list[float] = []
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        slot = next((b for b, load in enumerate(bins) if load + costs[i] <= capacity * (1 + 1e-9)), None)
        if slot is None:
            if len(bins) == ranks:
                return greedy
            bins.append(0.0)
            slot = len(bins) - 1
        bins[slot] += costs[i]
        owners[i] = slot
    return owners


def assign_params(costs: Sequence[float], dp_size: int) -> list[int]:
    """The owner rank of each parameter: largest cost first, each to the least-loaded rank so far (ties: the
    earlier parameter, the lower rank). Pure and deterministic; the largest load is at most the optimum plus
    the largest single cost.

    Raises:
        ValueError: ``dp_size`` < 1, or a cost that is negative or not finite.
    """
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be an int >= 1, got {dp_size!r}")
    for index, cost in enumerate(costs):
        if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not 0 <= cost < math.inf:
            raise ValueError(f"costs[{index}] must be a finite number >= 0, got {cost!r}")
    loads = [(0.0, rank) for rank in range(dp_size)]
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(loads)
        owners[i] = rank
        heapq.heappush(loads, (load + costs[i], rank))
    return owners


@dataclass(frozen=True)
class PlannedBuffer:
    """One contiguous parameter + gradient buffer: its key, layout, the ranks its buckets split across and how its
    gradients are reduced (``reduce_scatter``: each rank needs only its shard; ``all_reduce``: whole gradients)."""

    index: int
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    expert: bool
    whole: bool
    reduction: Reduction
    layout: BufferLayout

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(slot.name for slot in self.layout.params)

    @property
    def padding(self) -> int:
        """Elements of the buffer that hold no parameter."""
        return self.layout.numel - sum(slot.numel for slot in self.layout.params)


@dataclass(frozen=True)
class PlannedStage:
    """One optimizer stage: an algorithm over dense or expert groups, its placement, and why."""

    algorithm: str
    expert: bool
    placement: Placement
    groups: tuple[int, ...]
    why: str


@dataclass(frozen=True)
class PlannedParam:
    """One parameter's row of the plan. ``owner``: the data-parallel rank stepping it whole (whole-matrix
    placements), else None; ``buffer`` / ``bucket`` / ``offset``: where it lives in the wrapper (None without one)."""

    spec: ParamSpec
    group: int
    stage: int
    algorithm: str
    placement: Placement
    buffer: int | None = None
    bucket: int | None = None
    offset: int | None = None
    owner: int | None = None

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class ParamPlan:
    """The plan: per parameter, per buffer and per stage (module docstring). Build with ``ParamPlan.build``."""

    topology: Topology
    sharding: str
    params: tuple[PlannedParam, ...]
    buffers: tuple[PlannedBuffer, ...]
    stages: tuple[PlannedStage, ...]
    keys: tuple[GroupKey, ...]
    bucket_size: int | None
    notes: tuple[str, ...] = field(default=())
    #: the config's fields as (dotted name, repr): ranks must agree on them too (``rows``)
    config_items: tuple[tuple[str, str], ...] = field(default=())

    @classmethod
    def build(cls, config: Any, specs: Sequence[ParamSpec], resolved: Mapping[str, Resolved], topology: Topology,
              *, keys: Sequence[GroupKey] | None = None, wrapped: bool = True, dtensor: bool = False,
              bucketing: Bucketing | None = None, shard_align: int = 128, param_align: int = 64,
              grad_dtype: torch.dtype | None = None, bucket_size: int | None | str = "config") -> ParamPlan:
        """Plan ``specs`` (model order) with their ``resolved`` settings for ``config`` on ``topology``.

        Args:
            keys: the groups, in order (default ``group_keys(resolved)``; the cross-rank union under pipelines).
            wrapped: the model is (to be) wrapped by optstack's data-parallel wrapper: buffers are planned.
            dtensor: the parameters are DTensors (FSDP2 / tensor parallel): DTensor placements, no buffers.
            bucketing, shard_align, param_align, grad_dtype: the wrapper's layout settings (``DataParallel``).
            bucket_size: elements per bucket, None for one bucket per buffer; "config":
                ``config.distributed.bucket_size`` (None there: 40M).

        Raises:
            ValueError: a spec without resolved settings, or an unknown algorithm (listing the known ones).
        """
        keys = tuple(group_keys(resolved) if keys is None else keys)
        group_index = {k: i for i, k in enumerate(keys)}
        sharding = config.distributed.sharding
        if bucket_size == "config":
            bucket_size = config.distributed.bucket_size if config.distributed.bucket_size is not None else 40_000_000
        # stages: one per (algorithm, expert), in first-appearance order of the groups (the factory's order)
        kind_of = [(dict(k.settings).get("algorithm", config.algorithm), k.is_expert) for k in keys]
        kinds: dict[tuple[str, bool], list[int]] = {}
        for i, kind in enumerate(kind_of):
            kinds.setdefault(kind, []).append(i)
        stage_of: dict[tuple[str, bool], int] = {kind: s for s, kind in enumerate(kinds)}
        placements = {kind: placement_of(get_algorithm(kind[0]).capabilities, sharding, wrapped=wrapped,
                                         dtensor=dtensor) for kind in kinds}
        rows: list[tuple[ParamSpec, int, tuple[str, bool]]] = []
        for spec in specs:
            r = resolved.get(spec.name)
            if r is None:
                raise ValueError(f"ParamPlan: parameter {spec.name!r} has no resolved settings; resolve the same "
                                 "parameters the plan is built for")
            g = group_index[GroupKey.of(r)]
            rows.append((spec, g, kind_of[g]))
            _check_capabilities(spec, kind_of[g][0], config)
        notes: list[str] = []
        whole_bucket_sizes: dict[bool, int | None] = {}  # expert -> the bucket size of its whole-shard buffers
        whys = {kind: _why(kind[0], placements[kind], sharding, wrapped, dtensor) for kind in kinds}
        if wrapped and not dtensor:
            for kind, placement in placements.items():
                if placement != "zero1_whole":
                    continue
                members = [spec for spec, _, k in rows if k == kind]
                ranks = topology.expert_dp if kind[1] else topology.shard_size
                chosen, why, size = choose_whole_matrix_layout(members, ranks, bucket_size=bucket_size,
                                                               param_align=param_align, shard_align=shard_align,
                                                               bucketing=bucketing,
                                                               prefer=config.distributed.whole_matrices)
                placements[kind], whys[kind] = chosen, why
                if chosen == "zero1_whole":
                    whole_bucket_sizes[kind[1]] = max(whole_bucket_sizes.get(kind[1]) or 0, size or 0) or None
                notes.append(f"{kind[0]}{' (expert)' if kind[1] else ''}: {why}")
        buffers = (_plan_buffers(rows, placements, topology, sharding, bucket_size, bucketing, shard_align,
                                 param_align, grad_dtype, whole_bucket_sizes) if wrapped and not dtensor else ())
        where = {name: (b.index, b.layout.slot(name)) for b in buffers for name in b.names}
        owners = _owners(rows, placements, buffers, where, topology)
        params = []
        for spec, g, kind in rows:
            buffer, slot = where.get(spec.name, (None, None))
            params.append(PlannedParam(spec, g, stage_of[kind], kind[0], placements[kind], buffer,
                                       None if slot is None else slot.bucket, None if slot is None else slot.offset,
                                       owners.get(spec.name)))
        stages = tuple(PlannedStage(kind[0], kind[1], placements[kind], tuple(gs), whys[kind])
                       for kind, gs in kinds.items())
        return cls(topology, sharding, tuple(params), buffers, stages, keys,
                   bucket_size, tuple(notes), _config_items(config))

    # ---- views -------------------------------------------------------------------------------------------------
    def stage_owners(self, stage: int) -> dict[str, int] | None:
        """Parameter name -> owner rank for a stage the plan placed with owners of its own choosing (``layerwise``
        over the data-parallel group, ``zero1_owners`` over the shard group, ``dtensor_owner`` over the ranks of
        the DTensor model), else None."""
        if self.stages[stage].placement not in ("layerwise", "zero1_owners", "dtensor_owner"):
            return None
        return {p.name: p.owner for p in self.params if p.stage == stage and p.owner is not None}

    def whole_shard_names(self) -> frozenset[str]:
        """Parameters laid out whole inside one rank's shard (whole-shard buffers)."""
        return frozenset(n for b in self.buffers if b.whole for n in b.names)

    def rows(self) -> list[tuple[str, str]]:
        """The plan as (what, value) rows, in a fixed order: the config's fields, the topology, the groups, then
        one row per parameter and per buffer. Equal on every rank that computed the same plan (this rank's own
        data-parallel rank left out); ``digest`` hashes them, and ranks whose digests differ compare them to
        name the first difference."""
        t = self.topology
        out = list(self.config_items)
        out.append(("topology", repr((t.dp, t.instances, t.ep, t.tp, t.pp, self.sharding, self.bucket_size))))
        out += [(f"group {i}", repr((k.settings, k.is_expert))) for i, k in enumerate(self.keys)]
        out += [(f"parameter {p.name!r}", repr((p.spec.key()[1:], p.group, p.stage, p.algorithm, p.placement,
                                                p.buffer, p.bucket, p.offset, p.owner))) for p in self.params]
        out += [(f"buffer {b.index}", repr((str(b.param_dtype), str(b.grad_dtype), b.expert, b.whole, b.reduction,
                                            b.layout.numel, [(x.offset, x.numel) for x in b.layout.buckets])))
                for b in self.buffers]
        return out

    def digest(self) -> bytes:
        """32 bytes identifying the plan and the config it was built from (``rows``)."""
        h = hashlib.sha256()
        for what, value in self.rows():
            h.update(what.encode())
            h.update(b"\0")
            h.update(value.encode())
            h.update(b"\0")
        return h.digest()


def first_difference(mine: Sequence[tuple[str, str]], theirs: Sequence[tuple[str, str]]) -> str:
    """Where two ranks' ``ParamPlan.rows`` first differ: '<what>: <first's> vs <second's>'."""
    for k in range(max(len(mine), len(theirs))):
        a = mine[k] if k < len(mine) else ("(nothing)", "")
        b = theirs[k] if k < len(theirs) else ("(nothing)", "")
        if a != b:
            return f"{a[0]}: {a[1]} vs {b[1]}" if a[0] == b[0] else f"{a[0]} = {a[1]} vs {b[0]} = {b[1]}"
    return "nothing (equal rows)"


def _config_items(config: Any, prefix: str = "") -> tuple[tuple[str, str], ...]:
    """A dataclass config's leaf fields as (dotted name, repr), in field order."""
    if not dataclasses.is_dataclass(config):
        return ()
    out: list[tuple[str, str]] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out += _config_items(value, f"{prefix}{f.name}.")
        else:
            out.append((f"config.{prefix}{f.name}", repr(value)))
    return tuple(out)


def choose_whole_matrix_layout(members: Sequence[ParamSpec], ranks: int, *, bucket_size: int | None,
                               param_align: int = 64, shard_align: int = 128,
                               bucketing: Bucketing | None = None,
                               prefer: str = "auto") -> tuple[Placement, str, int | None]:
    """Whole matrices under ZeRO-1: ``zero1_whole`` (whole-shard buffers, reduce-scatter, ZeRO-1 over whole
    matrices) while that pads the buffers by at most ``WHOLE_SHARD_MAX_PADDING`` (or
    ``WHOLE_SHARD_PADDING_FLOOR`` elements) and every rank gets a matrix; else ``zero1_owners`` (ordinary
    reduce-scattered buffers; owners balanced by Newton-Schulz cost gather their matrices' pieces). Buckets of
    whole matrices may be made larger than ``bucket_size`` (2, 4 or 8 times ranks x the largest matrix) where that
    brings the padding under the bound and still leaves ``WHOLE_SHARD_MIN_BUCKETS`` buckets to overlap with
    backward. ``prefer`` (``config.distributed.whole_matrices``) other than "auto" takes that layout whatever it
    costs. Returns the placement, why, and the bucket size of the whole-shard buffers."""
    if prefer == "gather":
        return "zero1_owners", ("distributed.whole_matrices='gather': owners balanced by Newton-Schulz cost gather "
                                "their matrices from the reduce-scattered shards"), bucket_size
    if prefer == "whole_shards":
        return "zero1_whole", "distributed.whole_matrices='whole_shards': matrices whole in their owners' shards", \
            bucket_size
    if ranks == 1:
        return "zero1_whole", "one rank: every matrix whole on it", bucket_size
    by_dtype: dict[torch.dtype, list[ParamSpec]] = {}
    for spec in members:
        by_dtype.setdefault(spec.dtype, []).append(spec)

    def padding_of(size: int | None) -> tuple[int, int, int]:
        numel = padding = buckets = 0
        for group in by_dtype.values():
            layout = BufferLayout.plan([(s.name, s.shape) for s in reversed(group)], dp_size=ranks,
                                       bucket_size=size, shard_align=shard_align, param_align=param_align,
                                       bucketing=bucketing, whole=True, costs=[s.cost for s in reversed(group)])
            numel += layout.numel
            padding += layout.numel - sum(s.numel for s in group)
            buckets += len(layout.buckets)
        return numel, padding, buckets

    def small(numel: int, padding: int) -> bool:
        return padding <= WHOLE_SHARD_MAX_PADDING * numel or padding <= WHOLE_SHARD_PADDING_FLOOR

    numel, padding, _ = padding_of(bucket_size)
    fraction = padding / numel if numel else 0.0
    if len(members) < ranks:
        return "zero1_owners", (f"{len(members)} matrices for {ranks} ranks: whole-shard buffers would leave "
                                f"ranks without a matrix and pad {fraction:.0%}; owners balanced by Newton-Schulz "
                                "cost gather their matrices from the reduce-scattered shards"), bucket_size
    if small(numel, padding):
        return "zero1_whole", (f"matrices whole in their owners' reduce-scatter shards ({fraction:.1%} padding at "
                               f"{ranks} ranks)"), bucket_size
    largest = max(s.numel for s in members)
    for factor in (2, 4, 8):
        size = factor * ranks * largest
        if bucket_size is not None and size <= bucket_size:
            continue
        big_numel, big_padding, buckets = padding_of(size)
        if buckets >= WHOLE_SHARD_MIN_BUCKETS and small(big_numel, big_padding):
            return "zero1_whole", (f"matrices whole in their owners' reduce-scatter shards, in {buckets} buckets "
                                   f"of >= {size:,} elements ({big_padding / big_numel:.1%} padding at {ranks} "
                                   f"ranks; {fraction:.1%} at bucket_size)"), size
    return "zero1_owners", (f"whole-shard buffers would pad {fraction:.1%} (> {WHOLE_SHARD_MAX_PADDING:.0%}) at "
                            f"{ranks} ranks, or leave fewer than {WHOLE_SHARD_MIN_BUCKETS} buckets with larger "
                            "ones; owners balanced by Newton-Schulz cost gather their matrices from the "
                            "reduce-scattered shards"), bucket_size


def _why(algorithm: str, placement: Placement, sharding: str, wrapped: bool, dtensor: bool) -> str:
    caps = get_algorithm(algorithm).capabilities
    if dtensor:
        return ("DTensor parameters: " + ("whole matrices stepped on owner ranks" if caps.whole_matrices
                                          else "each rank steps its local shards"))
    if not wrapped:
        return "no data-parallel wrapper: every rank steps every parameter"
    if placement == "replicated" and sharding != "replicated":
        return (f"sharding={sharding!r} applies to " + ("whole-matrix algorithms" if sharding == "layerwise"
                                                          else "element-wise algorithms") + f"; {algorithm!r} "
                "is stepped replicated")
    return {"replicated": "sharding='replicated'", "zero1": "element-wise: ZeRO-1 ranges of every bucket",
            "layerwise": "whole matrices stepped by owner ranks, then broadcast",
            "zero1_owners": "whole matrices gathered from reduce-scattered shards to owner ranks",
            "zero1_whole": "whole matrices in their owners' reduce-scatter shards"}.get(placement, placement)


def _plan_buffers(rows: Sequence[tuple[ParamSpec, int, tuple[str, bool]]],
                  placements: Mapping[tuple[str, bool], Placement], topology: Topology, sharding: str,
                  bucket_size: int | None, bucketing: Bucketing | None, shard_align: int, param_align: int,
                  grad_dtype: torch.dtype | None,
                  whole_bucket_sizes: Mapping[bool, int | None]) -> tuple[PlannedBuffer, ...]:
    """One buffer per (param dtype, grad dtype, expert, whole, reduction), parameters in backward order, in order
    of first use (``distributed.buffers.build_buffers``)."""
    members: dict[tuple[torch.dtype, torch.dtype, bool, bool, Reduction], list[ParamSpec]] = {}
    for spec, _, kind in reversed(rows):
        placement = placements[kind]
        # shards of layer-wise owners' or replicated stages' gradients would be no use to them: all-reduce
        sharded = sharding == "zero1" and placement in ("zero1", "zero1_whole", "zero1_owners")
        reduction: Reduction = "reduce_scatter" if sharded else "all_reduce"
        key = (spec.dtype, grad_dtype or spec.dtype, spec.expert, placement == "zero1_whole", reduction)
        members.setdefault(key, []).append(spec)
    out = []
    for index, ((param_dtype, gdtype, expert, whole, reduction), specs) in enumerate(members.items()):
        ranks = topology.expert_dp if expert else topology.shard_size
        size = whole_bucket_sizes.get(expert, bucket_size) if whole else bucket_size
        layout = BufferLayout.plan([(s.name, s.shape) for s in specs], dp_size=ranks, bucket_size=size,
                                   shard_align=shard_align, param_align=param_align, bucketing=bucketing,
                                   whole=whole, costs=[s.cost for s in specs] if whole else None)
        out.append(PlannedBuffer(index, param_dtype, gdtype, expert, whole, reduction, layout))
    return tuple(out)


def _owners(rows: Sequence[tuple[ParamSpec, int, tuple[str, bool]]],
            placements: Mapping[tuple[str, bool], Placement], buffers: Sequence[PlannedBuffer],
            where: Mapping[str, tuple[int, Any]], topology: Topology) -> dict[str, int]:
    """Owner rank per parameter of a whole-matrix placement: the rank whose shard holds it (whole-shard buffers),
    else packed by cost over the ranks the stage spreads over."""
    owners: dict[str, int] = {}
    for spec, _, kind in rows:
        if placements[kind] == "zero1_whole":
            owner = buffers[where[spec.name][0]].layout.owner_of(spec.name)
            if owner is not None:
                owners[spec.name] = owner
    for kind, placement in placements.items():
        if placement in ("layerwise", "zero1_owners", "dtensor_owner"):
            members = [spec for spec, _, k in rows if k == kind]
            if placement == "dtensor_owner":  # every rank holding a part of the DTensor model
                ranks = topology.dp
            elif kind[1]:
                ranks = topology.expert_dp
            else:
                ranks = topology.shard_size if placement == "zero1_owners" else topology.dp
            owners |= zip((s.name for s in members), pack_owners([s.cost for s in members], ranks), strict=True)
    return owners
