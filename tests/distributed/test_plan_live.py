"""``optstack plan``'s byte figures (``plan_report``) equal the live tensors of a real 2-rank gloo run."""

from __future__ import annotations

import pytest


def _live(algorithm: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn

    from optstack import DistributedConfig, OptimizerConfig, build_optimizer, wrap_data_parallel
    from optstack.plan_report import report

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.LayerNorm(96), nn.Linear(96, 64), nn.Linear(64, 32)).to(torch.bfloat16)
    config = OptimizerConfig(algorithm=algorithm, precision="bf16",
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
    }


@pytest.mark.parametrize("algorithm", ["adamw", "muon"])
def test_plan_report_bytes_equal_the_live_tensors(world2, algorithm):
    for out in world2.run(_live, algorithm):
        assert out["planned"] == out["live"], out
