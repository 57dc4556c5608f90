"""QK-clip on real gloo ranks: ``clip_qk`` after each step under ZeRO-1 (range shards that cut the query weight's
rows) and layer-wise NorMuon at dp=2 equals one process; FSDP2 is refused naming the parameter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optstack import OptimizerConfig, build_optimizer, wrap_data_parallel
from optstack.config import DistributedConfig
from optstack.distributed.comm import world_comm

LOGITS = [torch.tensor([50.0, 200.0, 90.0, 400.0]), torch.tensor([150.0, 20.0, 300.0, 99.0])]


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 4 query heads of 8 rows, 2 key heads; wide enough that ZeRO-1's 128-element alignment cuts the weights
    return nn.ModuleDict({"q": nn.Linear(40, 32), "k": nn.Linear(40, 16), "out": nn.Linear(48, 3)})


def _forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    inner = model.module if hasattr(model, "module") else model
    return inner["out"](torch.tanh(torch.cat([inner["q"](x), inner["k"](x)], dim=-1)))


def _train(model: nn.Module, wrapped: nn.Module, config: OptimizerConfig, rows: slice) -> dict[str, torch.Tensor]:
    opt = build_optimizer(config, wrapped).optimizer
    for step in range(4):
        x = torch.randn(8, 40, generator=torch.Generator().manual_seed(step))
        _forward(wrapped, x[rows]).square().mean().backward()
        opt.step()
        opt.clip_qk({("q.weight", "k.weight"): LOGITS[step % 2] * (1 + step)}, threshold=100.0)
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def clip_vs_one_process(algorithm: str, sharding: str) -> float:
    rank = world_comm().rank
    config = OptimizerConfig(algorithm=algorithm, lr=0.02, distributed=DistributedConfig(sharding=sharding))
    ref = _model()
    want = _train(ref, ref, OptimizerConfig(algorithm=algorithm, lr=0.02), slice(None))
    model = _model()
    got = _train(model, wrap_data_parallel(config, model), config, slice(rank * 4, rank * 4 + 4))
    return max((got[n] - want[n]).abs().max().item() for n in want)


@pytest.mark.parametrize(("algorithm", "sharding"), [("adamw", "zero1"), ("normuon", "layerwise")])
def test_clip_qk_equals_one_process(world2, algorithm: str, sharding: str) -> None:
    assert max(world2.run(clip_vs_one_process, algorithm, sharding)) <= 1e-6


def fsdp_refused() -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.values():
        fully_shard(layer, mesh=mesh)
    opt = build_optimizer(OptimizerConfig(lr=0.02), model).optimizer  # a container: no root fully_shard
    try:
        opt.clip_qk({("q.weight", "k.weight"): LOGITS[0]}, threshold=100.0)
    except ValueError as error:
        return str(error)
    return ""


def test_clip_qk_under_fsdp2_is_refused_naming_the_parameter(world2) -> None:
    for message in world2.run(fsdp_refused):
        assert "'k.weight'" in message or "'q.weight'" in message
        assert "not supported for DTensor parameters" in message
