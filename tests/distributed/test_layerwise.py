"""Layer-wise distributed Muon (``LayerWiseStage``) on real gloo ranks against single-process Muon.

The model's matrices go to Muon (each stepped by its owner rank, then gathered), its biases to AdamW
(ZeRO-1 ``ShardedStage`` over the same buckets, or the replicated stage), all in one ``ChainedOptimizer``.
The reference is the replicated run in one process over the same per-rank micro-batches (gradients
scaled by 1 / data-parallel size and summed in rank order, as the reduction does). The matrices all have
different shapes, so Muon orthogonalises each on its own in both runs (no batching differences).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from torch import nn

from optstack.algorithms import get_algorithm
from optstack.distributed import param_gather
from optstack.distributed.comm import NullComm, new_subgroups, world_comm
from optstack.distributed.ddp import DataParallel
from optstack.optimizer import ChainedOptimizer
from optstack.protocol import ParamShard
from optstack.stage import layerwise_stage, replicated_stage, zero1_stage

# the replicated stage with and without fp32 masters (the names of optstack 0.1)
FP32Stage = functools.partial(replicated_stage, masters=False)
MixedPrecisionStage = replicated_stage

STEPS = 10
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 5))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model.to(dtype)


def _split(model: nn.Module, muon: tuple[str, ...]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(Muon groups, AdamW groups): the named matrices to Muon, everything else to AdamW."""
    named = list(model.named_parameters())
    to_muon = [(n, p) for n, p in named if n in muon]
    rest = [(n, p) for n, p in named if n not in muon]
    return ([{"params": [p for _, p in to_muon], "param_names": [n for n, _ in to_muon]}],
            [{"params": [p for _, p in rest], "param_names": [n for n, _ in rest]}])


def _muon(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    # fp32 Newton-Schulz on every machine: with bf16 matmul (native on some CPUs) the 1-ulp differences of another
    # reduction order would round to bf16 ulps, past the fp32 bounds below
    return get_algorithm("muon").cls(groups, lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.01,
                                     matmul_precision="highest")


def _adamw(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return get_algorithm("adamw").cls(groups, lr=1e-2, weight_decay=0.0)


def _batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(200 + step)
    return torch.randn(dp, 4, 7, generator=gen), torch.randn(dp, 4, 5, generator=gen)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    return ((model(x.to(dtype)).float() - y) ** 2).mean()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _reference(cfg: dict[str, Any], dp: int) -> dict[str, Any]:
    model = _mlp(DTYPES[cfg["dtype"]])
    acc = {p: torch.zeros(p.shape) for p in model.parameters()}
    stage_cls = FP32Stage if cfg["dtype"] == "fp32" else MixedPrecisionStage
    muon_groups, adamw_groups = _split(model, cfg["muon"])
    stages = [stage_cls(muon_groups, _muon, grad_of=acc.__getitem__),
              stage_cls(adamw_groups, _adamw, grad_of=acc.__getitem__)]
    chain = ChainedOptimizer(stages, clip_grad=cfg["clip"])
    params, norms = [], []
    for step in range(STEPS):
        xs, ys = _batch(step, dp)
        for a in acc.values():
            a.zero_()
        for rank in range(dp):
            model.zero_grad(set_to_none=True)
            _loss(model, xs[rank], ys[rank]).backward()
            for p in model.parameters():
                acc[p].add_(p.grad.float().mul_(1.0 / dp if cfg.get("average", True) else 1.0))
        chain.step()
        norms.append(chain.last_result.grad_norm)
        params.append(_flat(model))
    return {"params": params, "norms": norms}


def train_layerwise(cfg: dict[str, Any]) -> dict[str, Any]:
    # The test matrices are small: lower the size from which a matrix is broadcast in place (instead of
    # packed) to cover both ways; the plan is made when the stage is built.
    default = param_gather.BROADCAST_IN_PLACE
    param_gather.BROADCAST_IN_PLACE = cfg.get("in_place_from", default)
    try:
        return _train_layerwise(cfg)
    finally:
        param_gather.BROADCAST_IN_PLACE = default


def _whole_shard_plan(model: nn.Module, cfg: dict[str, Any], world: Any) -> Any:
    """The wrapper's plan: Muon's matrices whole in their owners' shards, the rest ZeRO-1 ranges."""
    from optstack.config import DistributedConfig, OptimizerConfig
    from optstack.names import named_parameters
    from optstack.plan import ParamPlan, Topology, specs_of
    from optstack.rules import Name, Rule, resolve

    config = OptimizerConfig(algorithm="adamw", distributed=DistributedConfig(sharding="zero1",
                                                                            whole_matrices="whole_shards"))
    named = named_parameters(model)
    topology = Topology(dp=world.size, rank=world.rank, instances=cfg.get("instances", 1))
    return ParamPlan.build(config, specs_of(named), resolve(named, [Rule(Name(*cfg["muon"]), algorithm="muon")]),
                           topology, bucket_size=150, shard_align=4, param_align=4, grad_dtype=torch.float32)


def _train_layerwise(cfg: dict[str, Any]) -> dict[str, Any]:
    world = world_comm()
    model = _mlp(DTYPES[cfg["dtype"]])
    whole = cfg.get("whole", False)  # Muon's matrices in whole-shard buffers: reduce-scattered, ZeRO-1 stepped
    parts: dict[str, Any] = {}
    if cfg.get("instances", 1) > 1:  # a partial ZeRO-1: sharded inside runs of ranks, all-reduced across them
        size = world.size // cfg["instances"]
        parts["shard_group"] = new_subgroups([range(i, i + size) for i in range(0, world.size, size)], name="part")
        parts["cross_shard_group"] = new_subgroups([range(r, world.size, size) for r in range(size)], name="across")
    plan = _whole_shard_plan(model, cfg, world) if whole else None
    ddp = DataParallel(model, bucket_size=150, grad_dtype=torch.float32, shard_grads=whole, shard_align=4,
                       param_align=4, average=cfg.get("average", True), plan=plan, **parts)
    muon_groups, adamw_groups = _split(model, cfg["muon"])
    if whole:
        muon = zero1_stage(muon_groups, _muon, ddp=ddp, overlap_param_gather=cfg.get("overlap_param", False))
        assert muon.placement.owns_whole
    else:
        muon = layerwise_stage(muon_groups, _muon, ddp=ddp)
    if cfg["scalars"] == "zero1":
        scalars = zero1_stage(adamw_groups, _adamw, ddp=ddp, param_gather=cfg.get("param_gather", "auto"),
                               overlap_param_gather=cfg.get("overlap_param", False))
    else:
        stage_cls = FP32Stage if cfg["dtype"] == "fp32" else MixedPrecisionStage
        scalars = stage_cls(adamw_groups, _adamw, grad_of=ddp.main_grad)
    chain = ChainedOptimizer([muon, scalars], clip_grad=cfg["clip"])
    params, norms, clipped = [], [], 0
    for step in range(STEPS):
        xs, ys = _batch(step, world.size)
        ddp.zero_grad_buffer()
        _loss(ddp, xs[world.rank], ys[world.rank]).backward()
        ddp.finish_grad_sync()
        chain.step()
        result = chain.last_result
        norms.append(result.grad_norm)
        clipped += result.grad_norm > cfg["clip"]
        chain.finish_param_sync()  # with overlap_param_gather the gathers are still in flight
        params.append(_flat(model))
    owned = sorted(muon.param_shards())
    state_numel = sum(t.numel() for s in muon.optimizer.state.values() for t in s.values())
    out = {"params": params, "norms": norms, "clipped": clipped, "owned": owned, "state_numel": state_numel}
    if world.rank == 0:
        out["reference"] = _reference(cfg, world.size)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


ALL = ("0.weight", "2.weight", "4.weight")
CASES = {
    # With clipping every stage's norm must be the reference's to the bit (a 1-ulp clip factor is amplified
    # by Newton-Schulz, see below): the layer-wise stage's is; a ZeRO-1 stage's sums shards in another order.
    "fp32-replicated-scalars-clip": {"dtype": "fp32", "muon": ALL, "scalars": "replicated", "clip": 0.3},
    "bf16-zero1-scalars": {"dtype": "bf16", "muon": ALL, "scalars": "zero1", "clip": 0.0},
    # the biases share buckets with the matrices: ZeRO-1 gathers only its own pieces, packed
    "fp32-zero1-scalars-all-gather": {"dtype": "fp32", "muon": ALL, "scalars": "zero1", "clip": 0.0,
                                      "param_gather": "all_gather", "in_place_from": 100},
    # ... and overlapped: on gloo the packed pieces travel as one asynchronous broadcast per rank
    "fp32-zero1-scalars-overlap": {"dtype": "fp32", "muon": ALL, "scalars": "zero1", "clip": 0.0,
                                   "overlap_param": True, "in_place_from": 100},
    # Muon as ZeRO-1 over whole-shard buffers: reduce-scattered whole matrices, all-gathered (overlapped too)
    "bf16-whole-shards": {"dtype": "bf16", "muon": ALL, "scalars": "zero1", "clip": 0.0, "whole": True},
    "fp32-whole-shards-overlap": {"dtype": "fp32", "muon": ALL, "scalars": "zero1", "clip": 0.0, "whole": True,
                                  "overlap_param": True},
}


def _check(results: list[dict[str, Any]], cfg: dict[str, Any], rtol: float = 1e-6) -> None:
    ref = results[0]["reference"]
    for out in results:
        for step in range(STEPS):
            assert torch.equal(out["params"][step], results[0]["params"][step]), step  # identical replicas
            assert _rel(out["params"][step], ref["params"][step]) < rtol, step
            assert math.isclose(out["norms"][step], ref["norms"][step], rel_tol=1e-6)
        assert out["clipped"] > 0 or not cfg["clip"]
    owned = [name for out in results for name in out["owned"]]
    assert sorted(owned) == sorted(cfg["muon"])  # each matrix stepped by exactly one rank


@pytest.mark.parametrize("case", sorted(CASES))
def test_layerwise_muon_equals_single_process_at_two_ranks(world2, case: str) -> None:
    results = world2.run(train_layerwise, CASES[case])
    _check(results, CASES[case])
    numels = {"0.weight": 91, "2.weight": 143, "4.weight": 55}
    for out in results:  # Muon's state (one momentum buffer) only for the owned matrices
        assert out["state_numel"] == sum(numels[n] for n in out["owned"])


def test_layerwise_at_three_ranks_with_a_rank_owning_nothing(world3) -> None:
    # bf16 gradients summed (not averaged) in fp32 add up exactly in any order, so the 3-rank reduction
    # equals the reference bit for bit (see the next test for why that matters to Muon)
    cfg = {"dtype": "bf16", "muon": ("0.weight", "2.weight"), "scalars": "zero1", "clip": 0.0,
           "average": False}
    results = world3.run(train_layerwise, cfg)
    _check(results, cfg)
    assert [out["owned"] for out in results] == [["2.weight"], ["0.weight"], []]


def test_layerwise_at_three_ranks_one_matrix_each(world3) -> None:
    # A 3-rank all-reduce adds fp32 gradients in another order than the reference (1 ulp apart), and
    # Newton-Schulz's quintic iteration amplifies such differences (slope ~3.4 per iteration near zero):
    # measured ~1e-6 relative after 10 steps, so the bound here is 1e-5. At 2 ranks the runs are bitwise
    # equal (a + b = b + a).
    cfg = {"dtype": "fp32", "muon": ALL, "scalars": "zero1", "clip": 0.3}
    results = world3.run(train_layerwise, cfg)
    _check(results, cfg, rtol=1e-5)
    assert all(len(out["owned"]) == 1 for out in results)


def test_zero1_muon_over_a_wrapper_cutting_its_matrices_gathers_them_to_owners(world2) -> None:
    # the wrapper is left as it was built (reduce-scattering): owners gather their matrices from the shards
    results = world2.run(train_experts_from_config, "zero1", True)
    ref = _experts_reference(2)
    for out in results:
        assert _rel(out["params"], ref) < 1e-5
        assert out["muon_placement"] == "owners" and not out["whole_grads"] and out["shard_grads"]
    assert sorted(n for out in results for n in out["owned"]) == ["experts", "inp.weight", "out.weight"]


def test_whole_shard_muon_in_two_instances_of_two_ranks(world4) -> None:
    # each matrix whole in one rank's shard of its instance, stepped there and on its peer in the other
    # instance (both hold the all-reduced shard), gathered inside each instance
    cfg = {"dtype": "bf16", "muon": ALL, "scalars": "zero1", "clip": 0.0, "whole": True, "instances": 2,
           "average": False}
    results = world4.run(train_layerwise, cfg)
    _check(results[:2], cfg)  # the first instance against the reference: each matrix owned once in it
    for out in results[2:]:  # the second: the same parameters, owned alike
        assert all(torch.equal(a, b) for a, b in zip(out["params"], results[0]["params"], strict=True))
    assert [out["owned"] for out in results[:2]] == [out["owned"] for out in results[2:]]


def layerwise_state_roundtrip() -> dict[str, Any]:
    world = world_comm()
    model = _mlp(torch.float32)
    ddp = DataParallel(model, bucket_size=None, shard_grads=False)
    muon_groups, adamw_groups = _split(model, ALL)
    muon = layerwise_stage(muon_groups, _muon, ddp=ddp)
    chain = ChainedOptimizer([muon, replicated_stage(adamw_groups, _adamw, grad_of=ddp.main_grad, masters=False)])

    def one_step(step: int) -> torch.Tensor:
        xs, ys = _batch(step, world.size)
        ddp.zero_grad_buffer()
        _loss(ddp, xs[world.rank], ys[world.rank]).backward()
        ddp.finish_grad_sync()
        chain.step()
        return _flat(model)

    one_step(0)
    named = {n: ParamShard(s.shape, s.start, s.end, {k: t.clone() for k, t in s.tensors.items()},
                           {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.scalars.items()},
                           s.group, s.algorithm)
             for n, s in muon.param_shards().items()}
    params = [p.detach().clone() for p in model.parameters()]
    after = one_step(1)
    with torch.no_grad():
        for p, value in zip(model.parameters(), params, strict=True):
            p.copy_(value)
    for state in muon.optimizer.state.values():
        state["momentum_buffer"].zero_()
    muon.load_param_shards(named)
    # the AdamW stage's state moved on (its biases differ), but the Muon matrices see the same gradients
    # and the restored momentum: they must come out the same
    again = one_step(1)
    mask = torch.cat([torch.full((p.numel(),), n in ALL) for n, p in model.named_parameters()])
    return {"same": torch.equal(after[mask], again[mask])}


def test_param_shards_round_trip(world2) -> None:
    assert all(out["same"] for out in world2.run(layerwise_state_roundtrip))


def test_layerwise_rejects_sharded_gradients(world2) -> None:
    assert world2.run(rejects_sharded) == ["shard_grads=False", "shard_grads=False"]


def rejects_sharded() -> str:
    model = _mlp(torch.float32)
    ddp = DataParallel(model, shard_grads=True)
    try:
        layerwise_stage(_split(model, ALL)[0], _muon, ddp=ddp)
    except ValueError as exc:
        return "shard_grads=False" if "shard_grads=False" in str(exc) else str(exc)
    return "no error"


def test_bad_input() -> None:
    model = _mlp(torch.float32)
    weight = model[0].weight
    with pytest.raises(ValueError, match="appears twice"):
        layerwise_stage([{"params": [weight]}, {"params": [weight]}], _muon, comm=NullComm())
    with pytest.raises(ValueError, match="floating-point tensors"):
        layerwise_stage([{"params": [torch.zeros(2, 2, dtype=torch.int64)]}], _muon, comm=NullComm())
    with pytest.raises(ValueError, match="param group 0 must be a dict with a 'params' list"):
        layerwise_stage([[weight]], _muon, comm=NullComm())  # type: ignore[list-item]
    stage = layerwise_stage(_split(model, ALL)[0], _muon, comm=NullComm())
    other = {"params": {n: {**e, "start": 1} for n, e in stage.state_dict()["params"].items()},
             "groups": stage.state_dict()["groups"]}
    with pytest.raises(ValueError, match="this rank needs"):  # e.g. another rank's state
        stage.load_state_dict(other)


# ----------------------------------------------------------------------------------------------------------
# Built from a config: ZeRO-1 and layer-wise Muon own whole matrices, 3-D expert stacks included


class _Experts(nn.Module):
    """A linear layer, a grouped-expert stack ``(experts, out, in)`` (Muon's, per matrix), an output layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.inp = nn.Linear(6, 8)
        self.experts = nn.Parameter(torch.randn(3, 8, 8) / 3)
        self.out = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(torch.tanh(torch.einsum("eoi,bi->bo", self.experts, h)))


def _expert_config(sharding: str) -> Any:
    from optstack import DistributedConfig, MuonConfig, OptimizerConfig

    return OptimizerConfig(algorithm="muon", lr=0.02, weight_decay=0.01, muon=MuonConfig(nesterov=True),
                           distributed=DistributedConfig(sharding=sharding))  # type: ignore[arg-type]


def _expert_batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(300 + step)
    return torch.randn(dp, 4, 6, generator=gen), torch.randn(dp, 4, 5, generator=gen)


def train_experts_from_config(sharding: str, plain_wrapper: bool = False) -> dict[str, Any]:
    from optstack import build_optimizer, wrap_data_parallel

    world = world_comm()
    model = _Experts()
    config = _expert_config(sharding)
    # plain_wrapper: reduce-scattered buckets that cut the matrices (no whole-shard buffers)
    ddp = DataParallel(model, shard_grads=True) if plain_wrapper else wrap_data_parallel(config, model)
    optimizer = build_optimizer(config, ddp).optimizer
    for step in range(4):
        xs, ys = _expert_batch(step, world.size)
        ddp.zero_grad_buffer()
        ((ddp(xs[world.rank]) - ys[world.rank]) ** 2).mean().backward()
        ddp.finish_grad_sync()
        optimizer.step()
    muon = optimizer.stages[0]
    owned = sorted(muon.param_shards())
    state = sum(t.numel() for s in muon.optimizer.state.values() for t in s.values() if t.dim() > 0)
    return {"params": _flat(model), "owned": owned, "state_numel": state, "shard_grads": ddp.shard_grads,
            "stages": repr(optimizer), "muon_placement": muon.placement.kind, "whole_grads": ddp.whole_grads}


def _experts_reference(dp: int) -> torch.Tensor:
    from optstack import build_optimizer

    model = _Experts()
    optimizer = build_optimizer(_expert_config("replicated"), model).optimizer
    for step in range(4):
        xs, ys = _expert_batch(step, dp)
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for rank in range(dp):
            model.zero_grad(set_to_none=True)
            ((model(xs[rank]) - ys[rank]) ** 2).mean().backward()
            for g, p in zip(grads, model.parameters(), strict=True):
                g.add_(p.grad.mul(1.0 / dp))
        for g, p in zip(grads, model.parameters(), strict=True):
            p.grad = g
        optimizer.step()
    return _flat(model)


@pytest.mark.parametrize("sharding", ["zero1", "layerwise"])
def test_muon_from_config_owns_whole_matrices_and_equals_one_process(world2, sharding: str) -> None:
    results = world2.run(train_experts_from_config, sharding)
    ref = _experts_reference(2)
    for out in results:
        assert torch.equal(out["params"], results[0]["params"])  # identical replicas
        assert _rel(out["params"], ref) < 1e-5
        # Muon needs whole reduced gradients: under ZeRO-1 each matrix lies whole in its owner's reduce-scatter
        # shard (whole-shard buffers); layer-wise all-reduces
        assert out["shard_grads"] == (sharding == "zero1") and out["muon_placement"] == sharding
    # every Muon matrix (the 3-D expert stack as one) stepped whole by exactly one rank, its state there only
    owned = sorted(n for out in results for n in out["owned"])
    assert owned == ["experts", "inp.weight", "out.weight"]
    numel = {"experts": 3 * 8 * 8, "inp.weight": 8 * 6, "out.weight": 5 * 8}
    for out in results:
        assert out["state_numel"] == sum(numel[n] for n in out["owned"])
        assert ("zero1" in out["stages"]) == (sharding == "zero1")  # the scalar optimizer's state by range
