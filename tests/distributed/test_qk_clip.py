"""QK-clip on real gloo ranks: ``clip_qk`` after each step under ZeRO-1 (range shards that cut the query weight's
rows) and layer-wise NorMuon at dp=2 equals one process, and so do FSDP2 (local row ranges; NorMuon's owners) and tensor
parallelism (a column-split query weight: blocks of every row)."""

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


def clip_under_dtensor(algorithm: str, layout: str) -> tuple[float, list[str]]:
    """``clip_qk`` after each step on DTensor parameters against one process: ``fsdp`` (FSDP2 at dp=2, each rank
    half of every batch; flat row ranges, or whole matrices on owners for NorMuon) or ``tp`` (tensor parallel
    over 2 ranks on whole batches: the query weight column-split, a block of every row; the key weight
    row-split, each rank one key head)."""
    from torch.distributed.device_mesh import init_device_mesh

    rank = world_comm().rank
    ref = _model()
    want = _train(ref, ref, OptimizerConfig(algorithm=algorithm, lr=0.02), slice(None))
    model = _model()
    mesh = init_device_mesh("cpu", (2,))
    if layout == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.values():
            fully_shard(layer, mesh=mesh)
        rows = slice(rank * 4, rank * 4 + 4)
    else:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(model, mesh, {"q": RowwiseParallel(input_layouts=Replicate()),
                                         "k": ColwiseParallel(output_layouts=Replicate())})
        rows = slice(None)
    placements = [str(model[n].weight.placements) for n in ("q", "k")]
    got = _train(model, model, OptimizerConfig(algorithm=algorithm, lr=0.02), rows)
    got = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in got.items()}
    return max((got[n] - want[n]).abs().max().item() for n in want), placements


@pytest.mark.parametrize(("algorithm", "layout"), [("adamw", "fsdp"), ("normuon", "fsdp"), ("adamw", "tp")])
def test_clip_qk_on_dtensor_parameters_equals_one_process(world2, algorithm: str, layout: str) -> None:
    for gap, placements in world2.run(clip_under_dtensor, algorithm, layout):
        assert placements == (["(Shard(dim=1),)", "(Shard(dim=0),)"] if layout == "tp" else ["(Shard(dim=0),)"] * 2)
        assert gap <= 1e-6
