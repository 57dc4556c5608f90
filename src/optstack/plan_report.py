"""What a ``ParamPlan`` costs, per rank: bytes of parameters, gradients, fp32 masters and optimizer state, bucket
padding, communication per step and the owner balance of whole-matrix algorithms. Pure (numbers from the plan,
no tensors): ``optstack plan`` prints it, and a test checks it against the live tensors of a small real run.

Communication figures are the bytes one rank moves per step with ring collectives (all-reduce ``2 (n-1)/n`` of the
buffer, reduce-scatter and all-gather ``(n-1)/n`` each; a broadcast from owners: what the rank does not own, once;
an owner's gather: its own matrices, once), the usual first-order model (DeepSpeed's and Megatron's estimates).
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass
from typing import Any

import torch

from optstack.algorithms.registry import get_algorithm
from optstack.plan import ParamPlan, PlannedBuffer

__all__ = ["RankCost", "PlanReport", "report", "format_report"]


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class RankCost:
    """One rank's bytes (optimizer state in fp32, per the algorithm's declared state: its parameter-shaped
    tensors, and its ``matrix_state`` on the rank that steps the whole matrix)."""

    rank: int
    param_bytes: int
    grad_bytes: int
    master_bytes: int
    state_bytes: int
    stepped_elements: int
    comm_bytes: int
    owner_cost: float

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.master_bytes + self.state_bytes


@dataclass(frozen=True)
class PlanReport:
    """Per-rank costs and the plan-wide figures ``optstack plan`` prints."""

    dp: int
    parameters: int
    tensors: int
    buffers: list[dict[str, Any]]
    stages: list[dict[str, Any]]
    ranks: list[RankCost]
    owner_balance: float | None  # max / mean whole-matrix cost among ranks holding such work
    idle_owner_ranks: int | None
    notes: list[str]

    def most(self) -> RankCost:
        """The rank holding the most bytes."""
        return max(self.ranks, key=lambda r: (r.total_bytes, -r.rank))

    def as_dict(self, ranks: list[int] | None = None) -> dict[str, Any]:
        chosen = self.ranks if ranks is None else [self.ranks[r] for r in ranks]
        out = asdict(self)
        out["ranks"] = [asdict(r) | {"total_bytes": r.total_bytes} for r in chosen]
        out["most"] = asdict(self.most()) | {"total_bytes": self.most().total_bytes}
        return out


def _covered(buffer: PlannedBuffer, names: set[str]) -> list[tuple[list[int], list[int], list[int]]]:
    """Per bucket: sorted starts, ends and prefix sums of the sizes of the parameters ``names`` (relative to the
    bucket)."""
    out: list[tuple[list[int], list[int], list[int]]] = [([], [], [0]) for _ in buffer.layout.buckets]
    for slot in sorted((s for s in buffer.layout.params if s.name in names), key=lambda s: s.offset):
        starts, ends, prefix = out[slot.bucket]
        base = buffer.layout.buckets[slot.bucket].offset
        starts.append(slot.offset - base)
        ends.append(slot.end - base)
        prefix.append(prefix[-1] + slot.numel)
    return out


def _elements_below(x: int, starts: list[int], ends: list[int], prefix: list[int]) -> int:
    """Parameter elements of a bucket before position ``x``."""
    i = bisect.bisect_right(starts, x)  # parameters starting at or before x
    if i == 0:
        return 0
    return prefix[i - 1] + max(0, min(ends[i - 1], x) - starts[i - 1])


def _matrix_state_bytes(plan: ParamPlan, config: Any) -> dict[str, int]:
    """Bytes (fp32) of each parameter's ``matrix_state`` (SOAP's factors and eigenbases), sized by its algorithm's
    declared capabilities under its group's settings (the config's kwargs, then the group's keys)."""
    out: dict[str, int] = {}
    kwargs: dict[str, dict[str, Any]] = {}
    for p in plan.params:
        spec = get_algorithm(p.algorithm)
        if spec.capabilities.matrix_state:
            if p.algorithm not in kwargs:
                kwargs[p.algorithm] = spec.kwargs(config)
            settings = kwargs[p.algorithm] | dict(plan.keys[p.group].settings)
            out[p.name] = 4 * spec.capabilities.matrix_state_numel(p.spec.shape, settings)
    return out


def report(plan: ParamPlan, config: Any) -> PlanReport:
    """The costs of ``plan`` under ``config`` (its precision decides the masters) for every data-parallel rank."""
    dp = plan.topology.dp
    masters = config.precision != "fp32"
    param_bytes = sum(b.layout.numel * _size(b.param_dtype) for b in plan.buffers) or sum(
        p.spec.numel * _size(p.spec.dtype) for p in plan.params)
    grad_bytes = sum(b.layout.numel * _size(b.grad_dtype) for b in plan.buffers) or param_bytes
    stepped, state, master, comm = ([0] * dp for _ in range(4))
    owner_cost = [0.0] * dp
    state_per_element = [len(get_algorithm(s.algorithm).capabilities.state) * 4 for s in plan.stages]
    matrix_state = _matrix_state_bytes(plan, config)  # on whoever steps the whole matrix
    by_buffer: dict[int, list[Any]] = {}
    for p in plan.params:
        if p.buffer is not None:
            by_buffer.setdefault(p.buffer, []).append(p)
    owned_placements = ("zero1_whole", "zero1_owners", "layerwise")
    for b in plan.buffers:
        n = plan.topology.expert_dp if b.expert else plan.topology.shard_size
        nbytes_g, nbytes_p = b.layout.numel * _size(b.grad_dtype), b.layout.numel * _size(b.param_dtype)
        ring = (n - 1) / n if n > 1 else 0.0
        half = masters and b.param_dtype in (torch.bfloat16, torch.float16)
        for r in range(dp):  # the buffer's reduction
            comm[r] += int((ring if b.reduction == "reduce_scatter" else 2 * ring) * nbytes_g)
        by_stage: dict[int, list[Any]] = {}
        for p in by_buffer[b.index]:
            by_stage.setdefault(p.stage, []).append(p)
        for index, members in by_stage.items():
            placement, per_element = plan.stages[index].placement, state_per_element[index]
            member_bytes = sum(p.spec.numel for p in members) * _size(b.param_dtype)
            if placement == "zero1":
                covered = _covered(b, {p.name for p in members})
                gathered = nbytes_p if len(members) == len(by_buffer[b.index]) else member_bytes
                for r in range(dp):
                    rr = r // plan.topology.ep if b.expert else r % n
                    own = 0
                    for bucket, (starts, ends, prefix) in zip(b.layout.buckets, covered, strict=True):
                        lo, hi = rr * bucket.shard_numel, (rr + 1) * bucket.shard_numel
                        own += _elements_below(hi, starts, ends, prefix) - _elements_below(lo, starts, ends, prefix)
                    stepped[r] += own
                    state[r] += own * per_element
                    master[r] += own * 4 if half else 0
                    comm[r] += int(ring * gathered)  # the all-gather of the updated ranges
                continue
            owned: dict[int, list[Any]] = {}
            for p in members:
                if p.owner is not None:
                    owned.setdefault(p.owner, []).append(p)
            for r in range(dp):
                if placement in owned_placements:
                    mine = owned.get(r if placement == "layerwise" else r % n, [])
                    owner_cost[r] += sum(p.spec.cost for p in mine)
                else:
                    mine = members
                own = sum(p.spec.numel for p in mine)
                stepped[r] += own
                state[r] += own * per_element + sum(matrix_state.get(p.name, 0) for p in mine)
                master[r] += own * 4 if half else 0
                # a broadcast from owners: every rank receives (and, pipelined, forwards) what it does not own
                broadcast = member_bytes - own * _size(b.param_dtype)
                if placement == "zero1_whole":
                    comm[r] += int(ring * nbytes_p)
                elif placement == "zero1_owners":  # the own matrices gathered from the shards, then broadcast
                    comm[r] += own * _size(b.grad_dtype) + broadcast
                elif placement == "layerwise":
                    comm[r] += broadcast
    if not plan.buffers:  # no wrapper: every rank steps everything
        for r in range(dp):
            for p in plan.params:
                per_element = state_per_element[p.stage]
                stepped[r] += p.spec.numel
                state[r] += p.spec.numel * per_element + matrix_state.get(p.name, 0)
                master[r] += p.spec.numel * 4 if masters and p.spec.dtype != torch.float32 else 0
    ranks = [RankCost(r, param_bytes, grad_bytes, master[r], state[r], stepped[r], comm[r], owner_cost[r])
             for r in range(dp)]
    working = [c for c in owner_cost if c > 0]
    whole = any(s.placement in owned_placements for s in plan.stages)
    balance = max(working) / (sum(working) / len(working)) if working else None
    buffers = [{"index": b.index, "param_dtype": str(b.param_dtype).removeprefix("torch."),
                "grad_dtype": str(b.grad_dtype).removeprefix("torch."), "expert": b.expert, "whole": b.whole,
                "reduction": b.reduction, "buckets": len(b.layout.buckets), "elements": b.layout.numel,
                "padding": b.padding, "padding_fraction": b.padding / b.layout.numel if b.layout.numel else 0.0}
               for b in plan.buffers]
    stages = [{"algorithm": s.algorithm, "expert": s.expert, "placement": s.placement, "why": s.why,
               "parameters": sum(1 for p in plan.params if p.stage == i)} for i, s in enumerate(plan.stages)]
    return PlanReport(dp, sum(p.spec.numel for p in plan.params), len(plan.params), buffers, stages, ranks,
                      balance if whole else None, (dp - len(working)) if whole else None, list(plan.notes))


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def format_report(rep: PlanReport, ranks: list[int] | None = None) -> str:
    """A human-readable table of ``rep`` for ``ranks`` (default: the first, the last and the one holding most)."""
    chosen = sorted({0, rep.dp - 1, rep.most().rank} if ranks is None else set(ranks))
    lines = [f"{rep.parameters / 1e9:,.2f}B parameters in {rep.tensors} tensors, data-parallel {rep.dp}", "",
             "stages:"]
    for s in rep.stages:
        lines.append(f"  {s['algorithm']}{' (expert)' if s['expert'] else ''}: {s['placement']}, "
                     f"{s['parameters']} tensors - {s['why']}")
    lines += ["", "buffers:"]
    for b in rep.buffers:
        lines.append(f"  #{b['index']} {b['param_dtype']}/{b['grad_dtype']}{' expert' if b['expert'] else ''}"
                     f"{' whole-shard' if b['whole'] else ''}: {b['buckets']} buckets, {b['elements']:,} elements, "
                     f"padding {b['padding_fraction']:.2%}, {b['reduction']}")
    header = f"{'rank':>6} {'params':>12} {'grads':>12} {'masters':>12} {'state':>12} {'total':>12} {'comm/step':>12}"
    lines += ["", "per rank (bytes held; bytes moved per step, ring estimate):", header]
    for r in chosen:
        c = rep.ranks[r]
        mark = " <- most" if r == rep.most().rank else ""
        lines.append(f"{r:>6} {_gb(c.param_bytes):>12} {_gb(c.grad_bytes):>12} {_gb(c.master_bytes):>12} "
                     f"{_gb(c.state_bytes):>12} {_gb(c.total_bytes):>12} {_gb(c.comm_bytes):>12}{mark}")
    if rep.owner_balance is not None:
        lines += ["", f"whole-matrix owners: max/mean Newton-Schulz cost {rep.owner_balance:.2f} among ranks holding "
                  f"work; {rep.idle_owner_ranks} of {rep.dp} ranks hold none"]
    if rep.notes:
        lines += ["", *[f"note: {n}" for n in rep.notes]]
    return "\n".join(lines)
