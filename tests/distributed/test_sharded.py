"""ZeRO-1 (``ShardedStage``) on real gloo ranks against the single-process replicated stages.

The reference runs in one process (rank 0 of the world, one thread): the replicated ``FP32Stage`` /
``MixedPrecisionStage`` in a ``ChainedOptimizer``, over the same global batch cut into the same per-rank
micro-batches, each micro-batch gradient scaled by 1 / data-parallel size and summed in rank order: what
the data-parallel reduction computes, so the two runs agree to fp32 round-off (bf16 too: its gradients
are accumulated and reduced in fp32).
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import pytest
import torch
from torch import nn

from optstack.algorithms import get_algorithm
from optstack.distributed.comm import world_comm
from optstack.distributed.ddp import DataParallel
from optstack.distributed.parallel import ParallelGroups
from optstack.distributed.param_gather import gather_via
from optstack.optimizer import ChainedOptimizer
from optstack.precision import DynamicScaler
from optstack.protocol import ParamShard
from optstack.stage import replicated_stage, zero1_stage

# the replicated stage with and without fp32 masters (the names of optstack 0.1)
FP32Stage = functools.partial(replicated_stage, masters=False)
MixedPrecisionStage = replicated_stage

STEPS = 10
HYPER: dict[str, dict[str, Any]] = {
    "adamw": {"lr": 1e-2, "weight_decay": 0.1},
    "sgd": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01},
    "lion": {"lr": 1e-3, "weight_decay": 0.1},
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# -- shared pieces (run inside the workers) -----------------------------------------------------------
def _mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 5))
    with torch.no_grad():  # bf16-representable values, so every precision starts at the same point
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model.to(dtype)


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two groups (no weight decay for biases), as the grouping layer makes them."""
    named = list(model.named_parameters())
    decay = [(n, p) for n, p in named if p.ndim > 1]
    plain = [(n, p) for n, p in named if p.ndim <= 1]
    return [{"params": [p for _, p in g], "param_names": [n for n, _ in g], "wd_mult": m}
            for g, m in ((decay, 1.0), (plain, 0.0))]


def _make(algorithm: str):
    spec = get_algorithm(algorithm)

    def make(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        wd = HYPER[algorithm]["weight_decay"]
        inner = [{**g, "weight_decay": wd * g.get("wd_mult", 1.0)} for g in groups]
        return spec.cls(inner, **{**spec.defaults, **HYPER[algorithm]})

    return make


def _batch(step: int, dp: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: (dp, micro, 4, features)."""
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(dp, micro, 4, 7, generator=gen), torch.randn(dp, micro, 4, 5, generator=gen)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro: int) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    return ((model(x.to(dtype)).float() - y) ** 2).mean() / micro


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _reference(cfg: dict[str, Any], dp: int) -> dict[str, Any]:
    """The replicated single-process run of ``cfg`` on the global batch (see the module docstring)."""
    dtype = DTYPES[cfg["dtype"]]
    model = _mlp(dtype)
    acc = {p: torch.zeros(p.shape) for p in model.parameters()}
    stage_cls = FP32Stage if dtype == torch.float32 else MixedPrecisionStage
    stage = stage_cls(_groups(model), _make(cfg["algorithm"]), grad_of=acc.__getitem__)
    chain = ChainedOptimizer([stage], clip_grad=cfg.get("clip", 0.0))
    params, norms = [], []
    for step in range(STEPS):
        xs, ys = _batch(step, dp, cfg["micro"])
        for a in acc.values():
            a.zero_()
        for rank in range(dp):
            part = {p: torch.zeros(p.shape) for p in model.parameters()}
            for m in range(cfg["micro"]):
                model.zero_grad(set_to_none=True)
                _loss(model, xs[rank, m], ys[rank, m], cfg["micro"]).backward()
                for p in model.parameters():
                    part[p].add_(p.grad)
            for p in model.parameters():
                acc[p].add_(part[p].mul_(1.0 / dp))
        chain.step()
        result = chain.last_result
        params.append(_flat(model))
        norms.append(result.grad_norm)
    masters = {}
    if stage_cls is MixedPrecisionStage:
        names = [n for g in _groups(model) for n in g["param_names"]]
        masters = dict(zip(names, stage.master_params, strict=True))
    return {"params": params, "norms": norms, "masters": masters}


def _ddp(model: nn.Module, cfg: dict[str, Any], groups: ParallelGroups | None = None) -> DataParallel:
    grad_dtype = DTYPES[cfg["grad_dtype"]] if cfg.get("grad_dtype") else None
    return DataParallel(
        model, groups=groups, bucket_size=cfg.get("bucket_size", 120), grad_dtype=grad_dtype,
        overlap_grad_reduce=cfg.get("overlap_grad", True), shard_grads=True,
        sharded_reduction=cfg.get("sharded_reduction", "auto"), shard_align=4, param_align=4,
    )


def train_sharded(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run ``cfg`` with ZeRO-1 on this rank; rank 0 also runs the reference."""
    dp = world_comm().size
    rank = world_comm().rank
    model = _mlp(DTYPES[cfg["dtype"]])
    ddp = _ddp(model, cfg)
    stage = zero1_stage(_groups(model), _make(cfg["algorithm"]), ddp=ddp,
                         overlap_param_gather=cfg.get("overlap_param", False),
                         param_gather=cfg.get("param_gather", "auto"))
    chain = ChainedOptimizer([stage], clip_grad=cfg.get("clip", 0.0))
    params, norms, clipped = [], [], 0
    for step in range(STEPS):
        xs, ys = _batch(step, dp, cfg["micro"])
        ddp.zero_grad_buffer()
        for m in range(cfg["micro"]):
            last = m == cfg["micro"] - 1
            if last:
                _loss(ddp, xs[rank, m], ys[rank, m], cfg["micro"]).backward()
            else:
                with ddp.no_sync():
                    _loss(ddp, xs[rank, m], ys[rank, m], cfg["micro"]).backward()
            if step > 0 and m == 0:
                # With overlap_param_gather the forward's pre-hooks have just waited for the gathers.
                params.append(_flat(model))
        ddp.finish_grad_sync()
        chain.step()
        result = chain.last_result
        assert result.applied
        norms.append(result.grad_norm)
        clipped += cfg.get("clip", 0.0) > 0 and result.grad_norm > cfg["clip"]
    stage.finish_param_sync()
    params.append(_flat(model))
    out = {"params": params, "norms": norms, "clipped": clipped, "masters": {}}
    for name, shard in stage.param_shards().items():
        out["masters"][name] = (shard.start, shard.end, shard.tensors["param"].clone())
    if rank == 0:
        out["reference"] = _reference(cfg, dp)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _check_against_reference(results: list[dict[str, Any]], cfg: dict[str, Any]) -> None:
    ref = results[0]["reference"]
    for rank, out in enumerate(results):
        for step in range(STEPS):
            assert torch.equal(out["params"][step], results[0]["params"][step]), (rank, step)
            assert _rel(out["params"][step], ref["params"][step]) < 1e-6, (rank, step)
            assert math.isclose(out["norms"][step], ref["norms"][step], rel_tol=1e-6)
    for name, master in ref["masters"].items():  # every element of every master on exactly one rank
        covered = torch.zeros(master.numel(), dtype=torch.int64)
        for out in results:
            if name in out["masters"]:
                start, end, local = out["masters"][name]
                covered[start:end] += 1
                assert _rel(local, master.reshape(-1)[start:end]) < 1e-6, name
        assert (covered == 1).all(), name
    if cfg.get("clip"):
        assert results[0]["clipped"] >= STEPS // 2  # clipping was really active


CASES_2 = {
    "adamw-overlap-grad-clip": {"algorithm": "adamw", "dtype": "fp32", "micro": 1, "clip": 0.3},
    "adamw-overlap-param-accumulate": {"algorithm": "adamw", "dtype": "fp32", "micro": 2,
                                       "overlap_grad": False, "overlap_param": True},
    "adamw-reduce-scatter": {"algorithm": "adamw", "dtype": "fp32", "micro": 1,
                             "sharded_reduction": "reduce_scatter", "overlap_param": True},
    "sgd-overlap-both": {"algorithm": "sgd", "dtype": "fp32", "micro": 2, "overlap_param": True,
                         "clip": 0.3},
    "lion-all-gather": {"algorithm": "lion", "dtype": "fp32", "micro": 1, "overlap_grad": False,
                        "param_gather": "all_gather"},
    # "auto" overlapped gathers use broadcasts on gloo (the cases above); the all-gather overlaps too
    "adamw-overlap-param-all-gather": {"algorithm": "adamw", "dtype": "fp32", "micro": 1, "overlap_param": True,
                                       "param_gather": "all_gather"},
    "bf16-adamw-clip": {"algorithm": "adamw", "dtype": "bf16", "grad_dtype": "fp32", "micro": 2,
                        "overlap_param": True, "clip": 0.3},
}
CASES_3 = {
    "adamw-overlap-both-accumulate-clip": {"algorithm": "adamw", "dtype": "fp32", "micro": 2,
                                           "overlap_param": True, "clip": 0.3},
    "sgd-all-gather": {"algorithm": "sgd", "dtype": "fp32", "micro": 1, "overlap_grad": False,
                       "param_gather": "all_gather"},
    "lion-one-bucket": {"algorithm": "lion", "dtype": "fp32", "micro": 1, "bucket_size": None},
    "bf16-adamw": {"algorithm": "adamw", "dtype": "bf16", "grad_dtype": "fp32", "micro": 1,
                   "overlap_param": True},
}


@pytest.mark.parametrize("case", sorted(CASES_2))
def test_zero1_equals_replicated_at_two_ranks(world2, case: str) -> None:
    _check_against_reference(world2.run(train_sharded, CASES_2[case]), CASES_2[case])


@pytest.mark.parametrize("case", sorted(CASES_3))
def test_zero1_equals_replicated_at_three_ranks(world3, case: str) -> None:
    _check_against_reference(world3.run(train_sharded, CASES_3[case]), CASES_3[case])


# -- memory: only the shard's state -------------------------------------------------------------------
def state_bytes() -> dict[str, int]:
    model = _mlp(torch.bfloat16)
    cfg = {"grad_dtype": "fp32"}
    ddp = _ddp(model, cfg)
    stage = zero1_stage(_groups(model), _make("adamw"), ddp=ddp)
    chain = ChainedOptimizer([stage])
    x, y = _batch(0, 1, 1)
    _loss(ddp, x[0, 0], y[0, 0], 1).backward()
    ddp.finish_grad_sync()
    chain.step()
    opt = stage.optimizer
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items()
                if isinstance(t, torch.Tensor) and k != "step")
    masters = sum(m.numel() * m.element_size() for m in stage.master_params)
    owned = sum(p.numel() for g in opt.param_groups for p in g["params"])
    return {"state": state, "masters": masters, "owned": owned,
            "total": sum(p.numel() for p in model.parameters())}


@pytest.mark.parametrize("world", ["world2", "world3"])
def test_optimizer_state_is_only_the_shard(world: str, request: pytest.FixtureRequest) -> None:
    results = request.getfixturevalue(world).run(state_bytes)
    total = results[0]["total"]
    assert sum(r["owned"] for r in results) == total  # every element owned once
    for r in results:
        assert r["state"] + r["masters"] == 12 * r["owned"]  # fp32 master + two fp32 moments
        # equal ranges of every bucket: within one alignment unit per bucket of params / ranks
        assert abs(r["owned"] - total / len(results)) <= 0.1 * total


# -- dense + expert chained ---------------------------------------------------------------------------
class _MoE(nn.Module):
    """A dense input layer, experts (each rank holds the ones listed), a dense output layer."""

    def __init__(self, experts: list[int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(7, 9)
        self.out = nn.Linear(9, 5)
        self.experts = nn.ModuleList()
        for e in experts:
            torch.manual_seed(10 + e)
            self.experts.append(nn.Linear(9, 9))
        self.ids = list(experts)
        for p in self.experts.parameters():
            p.allreduce = False  # Megatron's mark of expert (MoE) parameters

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(torch.tanh(self.experts[self.ids.index(expert)](h)))


def _moe_groups(model: nn.Module, expert: bool) -> list[dict[str, Any]]:
    named = [(n, p) for n, p in model.named_parameters() if n.startswith("experts.") == expert]
    return [{"params": [p for _, p in named], "param_names": [n for n, _ in named], "wd_mult": 1.0}]


def train_moe(ep: int, num_experts: int) -> dict[str, Any]:
    """Micro-batch of data-parallel rank r goes through expert r % num_experts; with ep > 1 each rank holds
    only its experts."""
    world = world_comm()
    dp, rank = world.size, world.rank
    groups = ParallelGroups.from_world(ep=ep)
    mine = [e for e in range(num_experts) if e % ep == groups.ep.rank]
    model = _MoE(mine)
    ddp = DataParallel(model, groups=groups, bucket_size=60, shard_grads=True, shard_align=4, param_align=4)
    dense = zero1_stage(_moe_groups(model, False), _make("adamw"), ddp=ddp, overlap_param_gather=True)
    expert = zero1_stage(_moe_groups(model, True), _make("adamw"), ddp=ddp, expert=True)
    chain = ChainedOptimizer([dense, expert], clip_grad=0.3)

    ref_model = _MoE(list(range(num_experts)))
    acc = {p: torch.zeros(p.shape) for p in ref_model.parameters()}
    ref = ChainedOptimizer([FP32Stage(_moe_groups(ref_model, e), _make("adamw"), grad_of=acc.__getitem__)
                            for e in (False, True)], clip_grad=0.3)
    diffs, norms = [], []
    for step in range(6):
        xs, ys = _batch(step, dp, 1)
        ddp.zero_grad_buffer()
        ((ddp(xs[rank, 0], rank % num_experts) - ys[rank, 0]) ** 2).mean().backward()
        ddp.finish_grad_sync()
        chain.step()
        got = chain.last_result
        for a in acc.values():
            a.zero_()
        for r in range(dp):
            ref_model.zero_grad()
            ((ref_model(xs[r, 0], r % num_experts) - ys[r, 0]) ** 2).mean().backward()
            for p in ref_model.parameters():
                if p.grad is not None:
                    acc[p].add_(p.grad * (1.0 / dp))
        ref.step()
        want = ref.last_result
        norms.append((got.grad_norm, want.grad_norm))
        dense.finish_param_sync()
        ref_params = dict(ref_model.named_parameters())
        for name, p in model.named_parameters():
            ref_name = name
            if name.startswith("experts."):
                _, index, leaf = name.split(".")
                ref_name = f"experts.{mine[int(index)]}.{leaf}"
            diffs.append(_rel(p.detach(), ref_params[ref_name].detach()))
    return {"diffs": diffs, "norms": norms, "dense": _flat(nn.ModuleList([model.inp, model.out])),
            "experts": mine}


@pytest.mark.parametrize("ep", [1, 2])
def test_dense_and_expert_stages_chained(world2, ep: int) -> None:
    """ep=2: each rank holds a different expert (expert data-parallel size 1): the norm must sum over the
    expert-parallel group. ep=1: both ranks hold both experts, sharded over expert data-parallel."""
    results = world2.run(train_moe, ep, 2)
    for out in results:
        assert max(out["diffs"]) < 1e-6
        for got, want in out["norms"]:
            assert math.isclose(got, want, rel_tol=1e-6)
    assert torch.equal(results[0]["dense"], results[1]["dense"])
    assert [out["experts"] for out in results] == ([[0], [1]] if ep == 2 else [[0, 1], [0, 1]])


# -- fp16: a non-finite gradient on one rank skips the step everywhere --------------------------------
def fp16_inf_on_one_rank() -> dict[str, Any]:
    world = world_comm()
    model = _mlp(torch.float16)
    ddp = _ddp(model, {})
    stage = zero1_stage(_groups(model), _make("adamw"), ddp=ddp)
    chain = ChainedOptimizer([stage], scaler=DynamicScaler(initial_scale=2.0**10, hysteresis=1))
    applied, scales = [], []
    for step in range(3):
        xs, ys = _batch(step, world.size, 1)
        before = _flat(model)
        masters = [m.clone() for m in stage.master_params]
        ddp.zero_grad_buffer()
        chain.scale_loss(_loss(ddp, xs[world.rank, 0], ys[world.rank, 0], 1)).backward()
        ddp.finish_grad_sync()
        if step == 1 and world.rank == 1:
            # after the reduction, inside the part only this rank reads: no other rank can see it
            buffer = ddp.param_and_grad_buffers[0]
            buffer.grad_shard_view(0, 1)[0] = float("inf")
        chain.step()
        result = chain.last_result
        applied.append(result.applied)
        scales.append(result.loss_scale)
        if not result.applied:
            assert torch.equal(_flat(model), before)
            assert all(torch.equal(a, b) for a, b in zip(masters, stage.master_params, strict=True))
    return {"applied": applied, "scales": scales, "params": _flat(model)}


def test_fp16_inf_on_one_rank_skips_everywhere(world2) -> None:
    results = world2.run(fp16_inf_on_one_rank)
    for out in results:
        assert out["applied"] == [True, False, True]
        assert out["scales"] == [2.0**10, 2.0**9, 2.0**9]
    assert torch.equal(results[0]["params"], results[1]["params"])


# -- state dicts ---------------------------------------------------------------------------------------
def state_roundtrip() -> dict[str, Any]:
    world = world_comm()
    model = _mlp(torch.bfloat16)
    ddp = _ddp(model, {"grad_dtype": "fp32"})
    stage = zero1_stage(_groups(model), _make("adamw"), ddp=ddp)
    chain = ChainedOptimizer([stage])

    def one_step(step: int) -> None:
        xs, ys = _batch(step, world.size, 1)
        ddp.zero_grad_buffer()
        _loss(ddp, xs[world.rank, 0], ys[world.rank, 0], 1).backward()
        ddp.finish_grad_sync()
        chain.step()

    one_step(0)
    saved = _clone(chain.state_dict())
    sharded = _clone(stage.param_shards())
    model_saved = _flat(model)
    one_step(1)
    after_one = _flat(model)
    # rank-local load: the same next step again
    chain.load_state_dict(saved)
    _set_flat(model, model_saved)
    one_step(1)
    same_local = torch.equal(_flat(model), after_one)
    # name-keyed load from full tensors (what a resharding checkpoint hands over)
    full: dict[str, ParamShard] = {}
    for per_rank in world.all_gather_object(sharded):
        for name, shard in per_rank.items():
            numel = math.prod(shard.shape)
            have = full.get(name)
            tensors = dict(have.tensors) if have is not None else {}
            for key, value in shard.tensors.items():
                flat = tensors.setdefault(key, torch.zeros(numel, dtype=value.dtype))
                flat[shard.start:shard.end] = value
            full[name] = ParamShard(shard.shape, 0, numel, tensors, shard.scalars, {}, shard.algorithm)
    chain.load_state_dict(saved)  # then overwrite masters and moments from the full tensors
    for entry in stage.optimizer.state.values():
        entry["exp_avg"].zero_()
    stage.load_param_shards(full)
    _set_flat(model, model_saved)
    one_step(1)
    same_sharded = torch.equal(_flat(model), after_one)
    bad = {name: ParamShard(shard.shape, 1, 2, {"param": torch.zeros(1)}) for name, shard in full.items()}
    try:
        stage.load_param_shards(bad)
        error = ""
    except ValueError as exc:
        error = str(exc)
    return {"local": same_local, "sharded": same_sharded, "error": error}


def _set_flat(model: nn.Module, flat: torch.Tensor) -> None:
    """Copy ``flat`` into the parameters in place (they are views into the DataParallel buffer)."""
    with torch.no_grad():
        for p, chunk in zip(model.parameters(), flat.split([p.numel() for p in model.parameters()]),
                            strict=True):
            p.copy_(chunk.view_as(p))


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, ParamShard):  # a snapshot, without the live group (it holds the parameters)
        return ParamShard(obj.shape, obj.start, obj.end, _clone(dict(obj.tensors)), _clone(dict(obj.scalars)),
                          {}, obj.algorithm)
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


def test_state_dict_and_param_shards_round_trip(world2) -> None:
    for out in world2.run(state_roundtrip):
        assert out["local"] and out["sharded"]
        assert "this rank needs" in out["error"]


# -- a rank whose ranges hold only padding ---------------------------------------------------------------
def tiny_model_on_three_ranks() -> dict[str, Any]:
    """Linear(3, 2): 8 elements in a bucket padded to 3 x 128, so ranks 1 and 2 own nothing; they still
    take part in every collective (norm, non-finite flag, gather)."""
    world = world_comm()
    torch.manual_seed(0)
    model, ref = nn.Linear(3, 2), nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    ddp = DataParallel(model, shard_grads=True)
    stage = zero1_stage([{"params": list(model.parameters())}], _make("adamw"), ddp=ddp)
    chain = ChainedOptimizer([stage], clip_grad=0.1)
    acc = {p: torch.zeros(p.shape) for p in ref.parameters()}
    ref_chain = ChainedOptimizer([FP32Stage([{"params": list(ref.parameters())}], _make("adamw"),
                                            grad_of=acc.__getitem__)], clip_grad=0.1)
    for step in range(3):
        x = torch.randn(world.size, 4, 3, generator=torch.Generator().manual_seed(step))
        ddp.zero_grad_buffer()
        ddp(x[world.rank]).square().mean().backward()
        ddp.finish_grad_sync()
        chain.step()
        got = chain.last_result
        for a in acc.values():
            a.zero_()
        for r in range(world.size):
            ref.zero_grad()
            ref(x[r]).square().mean().backward()
            for p in ref.parameters():
                acc[p].add_(p.grad * (1.0 / world.size))
        ref_chain.step()
        want = ref_chain.last_result
        assert math.isclose(got.grad_norm, want.grad_norm, rel_tol=1e-6)
    owned = sum(p.numel() for g in stage.optimizer.param_groups for p in g["params"])
    return {"owned": owned, "groups": len(stage.optimizer.param_groups), "diff": _rel(_flat(model), _flat(ref))}


def test_ranks_owning_nothing_take_part(world3) -> None:
    results = world3.run(tiny_model_on_three_ranks)
    assert [r["owned"] for r in results] == [8, 0, 0]
    assert all(r["groups"] == 1 and r["diff"] < 1e-6 for r in results)


# -- bad input (one process: DataParallel without torch.distributed is a world of one) --------------------
def test_bad_input() -> None:
    model, other = _mlp(torch.float32), _mlp(torch.float32)
    ddp = DataParallel(model, shard_grads=True)
    with pytest.raises(ValueError, match="not a trainable parameter of the DataParallel-wrapped module"):
        zero1_stage(_groups(other), _make("adamw"), ddp=ddp)
    with pytest.raises(ValueError, match=r"ZeRO-1 \(expert=True\): '0.weight' is a dense parameter"):
        zero1_stage(_groups(model), _make("adamw"), ddp=ddp, expert=True)
    with pytest.raises(ValueError, match="appears twice"):
        zero1_stage([{"params": [model[0].weight, model[0].weight]}], _make("adamw"), ddp=ddp)
    with pytest.raises(ValueError, match="param_gather must be 'auto', 'all_gather' or 'broadcast'"):
        zero1_stage(_groups(model), _make("adamw"), ddp=ddp, param_gather="ring")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ddp must be an optstack DataParallel"):
        zero1_stage(_groups(model), _make("adamw"), ddp=model)  # type: ignore[arg-type]
    stage = zero1_stage(_groups(model), _make("adamw"), ddp=ddp)
    with pytest.raises(ValueError, match="the 0.1 'mixed' state dict has no 'optimizer'"):
        stage.load_state_dict({"kind": "mixed"})
    state = stage.state_dict()
    other = {**state, "params": {n: {**e, "start": e["start"] + 1} for n, e in state["params"].items()}}
    with pytest.raises(ValueError, match=r"covers elements \[1, .*this rank needs \[0, "):  # another rank's range
        stage.load_state_dict(other)


def test_one_process_is_the_replicated_run() -> None:
    """Without torch.distributed the wrapper is a world of one: ZeRO-1 then owns everything, gathers
    nothing, and equals the replicated stage."""
    cfg = {"algorithm": "adamw", "dtype": "bf16", "grad_dtype": "fp32", "micro": 2, "overlap_param": True,
           "clip": 0.3}
    _check_against_reference([train_sharded(cfg)], cfg)


def test_gather_transport_per_backend() -> None:
    """gloo gathers by broadcasts, overlapped or not (several times faster than its all-gather); other
    backends by all-gathers; an explicit choice wins."""
    assert gather_via("auto", "gloo", overlap=True) == "broadcast"
    assert gather_via("auto", "gloo", overlap=False) == "broadcast"
    assert gather_via("auto", "nccl", overlap=True) == "all_gather"
    assert gather_via("all_gather", "gloo", overlap=True) == "all_gather"
    assert gather_via("broadcast", "nccl", overlap=True) == "broadcast"


def test_a_0_1_sharded_state_dict_is_migrated() -> None:
    """optstack 0.1's ZeRO-1 state dict ({"kind": "sharded", "shard", "optimizer" over the pieces,
    "fp32_masters" per group}) loads into this rank's stage and gives the same state."""
    def trained(steps: int) -> tuple[nn.Module, Any]:
        model = _mlp(torch.bfloat16)
        ddp = DataParallel(model, shard_grads=True, grad_dtype=torch.float32, bucket_size=150, shard_align=4,
                           param_align=4)
        stage = zero1_stage(_groups(model), _make("adamw"), ddp=ddp)
        chain = ChainedOptimizer([stage])
        for step in range(steps):
            x, y = _batch(step, 1, 1)
            ddp.zero_grad_buffer()
            _loss(ddp, x[0, 0], y[0, 0], 1).backward()
            chain.step()
        return model, stage

    model, stage = trained(3)
    masters = {id(m) for m in stage.master_params}
    by_group = [[p for p in g["params"] if id(p) in masters] for g in stage.optimizer.param_groups]
    old = copy.deepcopy({"kind": "sharded", "shard": (0, 1), "optimizer": stage.optimizer.state_dict(),
                         "fp32_masters": by_group})
    _, fresh = trained(0)
    fresh.load_state_dict(old)
    for name, entry in stage.state_dict()["params"].items():
        got = fresh.state_dict()["params"][name]
        assert (got["start"], got["end"]) == (entry["start"], entry["end"])
        for key, tensor in entry["tensors"].items():
            assert torch.equal(got["tensors"][key], tensor), (name, key)
