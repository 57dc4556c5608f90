"""``optstack plan``'s byte figures (``plan_report``) equal the live tensors of a real 2-rank gloo run (SOAP: its
square factors and eigenbases on the rank owning each matrix, none for a side above ``max_precond_dim``)."""

from __future__ import annotations

import pytest


def _live(algorithm: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn

    from optstack import DistributedConfig, OptimizerConfig, build_optimizer, wrap_data_parallel
    from optstack.config import SOAPConfig
    from optstack.plan_report import report

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.LayerNorm(96), nn.Linear(96, 64), nn.Linear(64, 32)).to(torch.bfloat16)
    config = OptimizerConfig(algorithm=algorithm, precision="bf16", soap=SOAPConfig(max_precond_dim=64),  # 96: not
                             distributed=DistributedConfig(sharding="zero1", bucket_size=4000))
    ddp = wrap_data_parallel(config, model)
    opt = build_optimizer(config, ddp).optimizer
    ddp(torch.randn(8, 64, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    opt.step()
    rank = dist.get_rank()
    rep = report(ddp.plan, config).ranks[rank]
    masters = sum(m.numel() * m.element_size() for s in opt.stages for m in s.master_params)
    state = sum(v.numel() * v.element_size() for s in opt.stages for st in s.optimizer.state.values()
                for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {
        "planned": (rep.param_bytes, rep.grad_bytes, rep.master_bytes, rep.state_bytes),
        "live": (sum(b.param_data.numel() * b.param_data.element_size() for b in ddp.param_and_grad_buffers),
                 sum(b.grad_data.numel() * b.grad_data.element_size() for b in ddp.param_and_grad_buffers),
                 masters, state),
        "placements": [s.placement for s in ddp.plan.stages],
        "square": sorted((k, tuple(v.shape)) for s in opt.stages for st in s.optimizer.state.values()
                         for k, v in st.items() if k.startswith(("GG_", "Q_"))),
    }


@pytest.mark.parametrize("algorithm", ["adamw", "muon", "soap"])
def test_plan_report_bytes_equal_the_live_tensors(world2, algorithm):
    ranks = world2.run(_live, algorithm)
    for out in ranks:
        assert out["planned"] == out["live"], out
    if algorithm == "soap":  # each matrix's square state on its owner only; (96, 64) and (64, 96): the 64-side
        assert sorted(sq for out in ranks for sq in out["square"]) == sorted(
            [("GG_right", (64, 64)), ("Q_right", (64, 64)), ("GG_left", (64, 64)), ("Q_left", (64, 64)),
             ("GG_left", (32, 32)), ("Q_left", (32, 32)), ("GG_right", (64, 64)), ("Q_right", (64, 64))])
        assert all(out["square"] for out in ranks), ranks  # both ranks own a matrix: the per-rank split is tested


def _mlp():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 32), nn.Tanh(), nn.Linear(32, 8))


def _batches(world: int):
    import torch

    g = torch.Generator().manual_seed(5)
    return [(torch.randn(4 * world, 24, generator=g), torch.randn(4 * world, 8, generator=g)) for _ in range(4)]


def _config(layout: str, sharding: str = "zero1"):
    from optstack import DistributedConfig, OptimizerConfig

    return OptimizerConfig(algorithm="muon", lr=0.05, clip_grad=0.5,
                           distributed=DistributedConfig(sharding=sharding, bucket_size=700, whole_matrices=layout))


def _owners_over_shards(layout: str) -> dict:
    import torch
    import torch.distributed as dist

    from optstack import build_optimizer
    from optstack.distributed.ddp import DataParallel
    from optstack.distributed.parallel import ParallelGroups
    from optstack.factory import default_rules, topology_of
    from optstack.names import named_parameters
    from optstack.plan import ParamPlan, specs_of
    from optstack.rules import resolve

    world, rank = dist.get_world_size(), dist.get_rank()
    model, config, groups = _mlp(), _config(layout), ParallelGroups.from_world()
    named = named_parameters(model)
    plan = ParamPlan.build(config, specs_of(named), resolve(named, default_rules(config)), topology_of(groups))
    # a real reduce-scatter (on gloo the wrapper would otherwise all-reduce, its faster collective there)
    ddp = DataParallel(model, groups=groups, shard_grads=True, sharded_reduction="reduce_scatter", plan=plan)
    opt = build_optimizer(config, ddp).optimizer
    norms = []
    for x, y in _batches(world):
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
        norms.append(opt.last_result.grad_norm)
    muon = opt.stages[0]
    return {"params": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(), "norms": norms,
            "kind": muon.placement.kind, "owned": sorted(muon.param_shards()),
            "whole_grads": ddp.reduces_whole([p for g in muon.param_groups for p in g["params"]])}


def _one_process() -> tuple[list[float], list[float]]:
    import torch

    from optstack import build_optimizer

    model = _mlp()
    opt = build_optimizer(_config("auto", "replicated"), model).optimizer
    norms = []
    for x, y in _batches(2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        norms.append(opt.last_result.grad_norm)
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(), norms


@pytest.mark.parametrize("layout", ["gather", "whole_shards"])
def test_zero1_muon_owners_over_reduce_scattered_shards_equal_one_process(world2, layout):
    import torch

    want, want_norms = _one_process()
    ranks = world2.run(_owners_over_shards, layout)
    assert sorted(n for out in ranks for n in out["owned"]) == ["0.weight", "2.weight", "4.weight"]
    for out in ranks:
        assert out["kind"] == ("owners" if layout == "gather" else "zero1")
        assert not out["whole_grads"]  # reduce-scattered: no rank holds gradients it does not step
        # the norm sums the owners' terms in another order than one process (1 ulp), which Newton-Schulz
        # amplifies a little: the relative difference of the whole parameter vector, as the layer-wise tests
        got, ref = torch.tensor(out["params"]), torch.tensor(want)
        assert ((got - ref).norm() / ref.norm()).item() < 1e-5
        torch.testing.assert_close(torch.tensor(out["norms"]), torch.tensor(want_norms), rtol=1e-5, atol=0)


def _differing_configs(field: str) -> str:
    import torch.distributed as dist
    from torch import nn

    from optstack import DistributedConfig, OptimizerConfig, wrap_data_parallel

    rank = dist.get_rank()
    kwargs = {"lr": 1e-3 * (1 + rank)} if field == "lr" else {}
    distributed = DistributedConfig(sharding="zero1", bucket_size=1000 + 500 * rank if field == "bucket" else 1000)
    config = OptimizerConfig(algorithm="adamw", distributed=distributed, **kwargs)
    try:
        wrap_data_parallel(config, nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)))
    except ValueError as error:
        return str(error)
    return ""


@pytest.mark.parametrize(("field", "named"), [("lr", "config.lr: 0.001 vs 0.002"),
                                              ("bucket", "config.distributed.bucket_size: 1000 vs 1500")])
def test_ranks_with_different_configs_get_one_clear_error_naming_the_field(world2, field, named):
    for message in world2.run(_differing_configs, field):
        assert "ranks planned differently: rank 0 and rank 1 differ at" in message and named in message, message
