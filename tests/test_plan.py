"""ParamPlan: pure, deterministic, from capabilities; the wrapper and the stages are built from it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optstack import DistributedConfig, OptimizerConfig, build_optimizer, default_rules, wrap_data_parallel
from optstack.algorithms import get_algorithm
from optstack.algorithms.registry import _REGISTRY, Capabilities, register
from optstack.distributed.ddp import DataParallel
from optstack.names import named_parameters
from optstack.plan import (
    ParamPlan,
    ParamSpec,
    Topology,
    choose_whole_matrix_layout,
    pack_owners,
    placement_of,
    spec_digest,
    specs_of,
)
from optstack.rules import resolve
from optstack.stage.placement import assign_params, newton_schulz_cost


def _llama_specs(layers: int = 4, h: int = 512, f: int = 1536, kv: int = 128) -> list[ParamSpec]:
    specs = [ParamSpec("embed.weight", (1000, h), torch.bfloat16)]
    for i in range(layers):
        for name, shape in (("q", (h, h)), ("k", (kv, h)), ("v", (kv, h)), ("o", (h, h)), ("gate", (f, h)),
                            ("up", (f, h)), ("down", (h, f)), ("n1", (h,)), ("n2", (h,))):
            specs.append(ParamSpec(f"layers.{i}.{name}.weight", shape, torch.bfloat16))
    return specs


def _resolved(config: OptimizerConfig, specs: list[ParamSpec]) -> dict:
    with torch.device("meta"):
        named = [(s.name, nn.Parameter(torch.empty(s.shape, dtype=s.dtype))) for s in specs]
    named[0][1].is_embedding_or_output_parameter = True
    return resolve(named, default_rules(config))


def _muon(sharding: str = "zero1", **distributed) -> OptimizerConfig:
    return OptimizerConfig(algorithm="muon", precision="bf16",
                           distributed=DistributedConfig(sharding=sharding, **distributed))


def test_placement_follows_capabilities_not_names():
    whole = Capabilities(elementwise=False, whole_matrices=True)
    element = Capabilities()
    assert placement_of(whole, "zero1", wrapped=True) == "zero1_whole"
    assert placement_of(whole, "layerwise", wrapped=True) == "layerwise"
    assert placement_of(whole, "replicated", wrapped=True) == "replicated"
    assert placement_of(element, "zero1", wrapped=True) == "zero1"
    assert placement_of(element, "layerwise", wrapped=True) == "replicated"
    assert placement_of(element, "zero1", wrapped=False) == "replicated"
    assert placement_of(whole, "zero1", wrapped=True, dtensor=True) == "dtensor_owner"
    assert placement_of(element, "zero1", wrapped=True, dtensor=True) == "dtensor"
    with pytest.raises(ValueError, match="elementwise or needs whole_matrices"):
        Capabilities(elementwise=True, whole_matrices=True)


def test_a_registered_whole_matrix_algorithm_is_planned_like_muon():
    register("test_plan_shampoo", torch.optim.SGD, family="other",
             capabilities=Capabilities(elementwise=False, whole_matrices=True))
    try:
        assert get_algorithm("test_plan_shampoo").capabilities.whole_matrices
        config = OptimizerConfig(algorithm="test_plan_shampoo", distributed=DistributedConfig(sharding="zero1"))
        specs = [ParamSpec("a", (64, 64), torch.float32), ParamSpec("b", (64, 64), torch.float32)]
        named = [(s.name, nn.Parameter(torch.zeros(s.shape))) for s in specs]
        plan = ParamPlan.build(config, specs, resolve(named, []), Topology(dp=2))
        assert [s.placement for s in plan.stages] == ["zero1_whole"]
        assert {p.owner for p in plan.params} == {0, 1}
    finally:
        del _REGISTRY["test_plan_shampoo"]


def test_plan_is_identical_on_every_rank_and_digest_tracks_changes():
    config = _muon()
    specs = _llama_specs()
    resolved = _resolved(config, specs)
    plans = [ParamPlan.build(config, specs, resolved, Topology(dp=4, rank=r)) for r in range(4)]
    assert len({p.digest() for p in plans}) == 1
    assert plans[0].params == plans[3].params
    other = ParamPlan.build(config, specs, resolved, Topology(dp=8))
    assert other.digest() != plans[0].digest()
    changed = [*specs[:-1], ParamSpec(specs[-1].name, (7,), torch.bfloat16)]
    assert spec_digest(changed) != spec_digest(specs)


def test_whole_shard_layout_is_chosen_only_while_padding_is_small():
    big = [ParamSpec(f"m{i}", (4096, 4096 + 512 * (i % 3)), torch.bfloat16) for i in range(12)]
    placement, why, _ = choose_whole_matrix_layout(big, 1024, bucket_size=40_000_000)
    assert placement == "zero1_owners" and "12 matrices for 1024 ranks" in why
    placement, why, _ = choose_whole_matrix_layout(big, 8, bucket_size=40_000_000)
    assert placement == "zero1_owners" and "would pad" in why  # three shapes into 8 shards, too few for big buckets
    padding = float(why.split("pad ")[1].split("%")[0])
    assert padding > 5
    even = [ParamSpec(f"m{i}", (4096, 4096), torch.bfloat16) for i in range(64)]
    placement, why, size = choose_whole_matrix_layout(even, 8, bucket_size=40_000_000)
    assert placement == "zero1_whole" and "0.0% padding" in why and size == 40_000_000


def test_whole_shard_buckets_grow_where_that_keeps_padding_small():
    # a Llama-like mix of three matrix sizes: at the configured bucket size 8 shards pad > 5%; buckets of a few
    # times 8 x the largest matrix pad < 5% and still leave >= 4 buckets to overlap with backward
    mats = []
    for i in range(32):
        mats += [ParamSpec(f"{i}.q", (1024, 1024), torch.bfloat16), ParamSpec(f"{i}.k", (128, 1024), torch.bfloat16),
                 ParamSpec(f"{i}.v", (128, 1024), torch.bfloat16), ParamSpec(f"{i}.o", (1024, 1024), torch.bfloat16),
                 ParamSpec(f"{i}.g", (3584, 1024), torch.bfloat16), ParamSpec(f"{i}.u", (3584, 1024), torch.bfloat16),
                 ParamSpec(f"{i}.d", (1024, 3584), torch.bfloat16)]
    placement, why, size = choose_whole_matrix_layout(mats, 8, bucket_size=4_000_000)
    assert placement == "zero1_whole" and "buckets of >=" in why, why
    assert size > 4_000_000
    config = _muon(bucket_size=4_000_000)
    plan = ParamPlan.build(config, mats, _resolved(config, mats), Topology(dp=8))
    [whole] = [b for b in plan.buffers if b.whole]
    assert whole.padding <= 0.05 * whole.layout.numel and len(whole.layout.buckets) >= 4


def test_large_plan_pads_at_most_five_percent_and_balances_owners():
    config = _muon()
    specs = _llama_specs(layers=16, h=2048, f=5632, kv=256)
    resolved = _resolved(config, specs)
    for dp in (8, 64, 1024):
        plan = ParamPlan.build(config, specs, resolved, Topology(dp=dp))
        numel = sum(b.layout.numel for b in plan.buffers)
        assert sum(b.padding for b in plan.buffers) <= 0.05 * numel + (1 << 20), dp
        muon = [p for p in plan.params if p.algorithm == "muon"]
        assert all(p.owner is not None and 0 <= p.owner < dp for p in muon)
        loads: dict[int, float] = {}
        for p in muon:
            loads[p.owner] = loads.get(p.owner, 0.0) + newton_schulz_cost(p.spec.shape)
        working = list(loads.values())
        assert max(working) / (sum(working) / len(working)) <= 1.25, (dp, plan.notes)


def test_pack_owners_keeps_the_greedy_makespan_with_fewer_busy_ranks():
    costs = [8.0] * 10 + [3.0] * 20 + [0.1] * 20
    greedy = assign_params(costs, 64)
    packed = pack_owners(costs, 64)

    def loads(owners):
        out: dict[int, float] = {}
        for c, o in zip(costs, owners, strict=True):
            out[o] = out.get(o, 0.0) + c
        return out

    assert max(loads(packed).values()) <= max(loads(greedy).values()) + 1e-9
    assert len(loads(packed)) < len(loads(greedy))
    assert pack_owners([2.0, 1.0], 1) == [0, 0] and pack_owners([], 3) == []
    with pytest.raises(ValueError, match="costs\\[0\\]"):
        pack_owners([float("nan")], 2)


def test_plan_runs_on_meta_tensors_of_a_large_model():
    config = OptimizerConfig(algorithm="adamw", precision="bf16", distributed=DistributedConfig(sharding="zero1"))
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(8192, 8192, bias=False) for _ in range(40)]).to(torch.bfloat16)
    named = named_parameters(model)
    plan = ParamPlan.build(config, specs_of(named), resolve(named, default_rules(config)), Topology(dp=1024))
    assert [s.placement for s in plan.stages] == ["zero1"]
    assert all(b.reduction == "reduce_scatter" for b in plan.buffers)


def test_wrapper_is_laid_out_by_the_plan_and_refuses_another_models():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    config = OptimizerConfig(algorithm="muon", distributed=DistributedConfig(sharding="zero1"))
    ddp = wrap_data_parallel(config, model)
    assert ddp.plan is not None
    assert [b.layout for b in ddp.param_and_grad_buffers] == [b.layout for b in ddp.plan.buffers]
    built = build_optimizer(config, ddp)
    kinds = [s.placement.kind for s in built.optimizer.stages]
    assert len(kinds) == len(ddp.plan.stages)
    other = nn.Sequential(nn.Linear(16, 32))
    with pytest.raises(ValueError, match="the plan was built for other parameters: at position"):
        DataParallel(other, plan=ddp.plan, shard_grads=True)


_FSDP2_AT_SCALE = """
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.fsdp import fully_shard
dist.init_process_group("fake", store=FakeStore(), rank={rank}, world_size=256)
from optstack import OptimizerConfig, build_optimizer
from optstack.cli.plan import LlamaShape, llama_like
model = llama_like(LlamaShape(hidden=1024, layers=4, ffn=2816, kv=256, vocab=32000))
for block in model.layers:
    fully_shard(block)
fully_shard(model)
for p in (model.embed.weight, model.output.weight):  # fully_shard replaces parameters: flag them again
    p.is_embedding_or_output_parameter = True
built = build_optimizer(OptimizerConfig(algorithm="muon", precision="bf16"), model)
print(sorted(type(s.placement).__name__ for s in built.optimizer.stages))
"""


@pytest.mark.parametrize("rank", [0, 255])
def test_muon_over_fsdp2_builds_on_meta_parameters_at_256_ranks(rank):
    # every rank's routes and norm counts come from the mesh: no table of every rank's shards, and no copy of
    # meta tensors (a simulated rank of a fake process group over a meta-device model)
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FSDP2_AT_SCALE.format(rank=rank)], capture_output=True, text=True,
                          timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "['DTensorLocal', 'DTensorOwners']"
