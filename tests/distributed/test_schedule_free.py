"""Schedule-Free AdamW and SGD on real gloo ranks: ZeRO-1 range shards, a replicated wrapper and FSDP2 at dp=2
(ZeRO-1 at dp=3 too) against one process, in train mode (``y``) and after ``eval()`` from the optimizer the user
holds (``x``, published to every rank's model), and a checkpoint saved in eval mode at dp=2 resumed in one
process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from optstack import OptimizerConfig, build_optimizer, wrap_data_parallel
from optstack.config import DistributedConfig, ScheduleFreeConfig
from optstack.distributed.comm import world_comm

STEPS, ROWS = 20, 12  # rows split evenly over 2 and 3 ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 5))  # 5 rows: uneven FSDP2 shards


def _config(sharding: str = "replicated", algorithm: str = "schedule_free_adamw") -> OptimizerConfig:
    return OptimizerConfig(algorithm=algorithm, lr=0.02, weight_decay=0.05, clip_grad=0.5,
                           schedule_free=ScheduleFreeConfig(warmup_steps=4, r=0.5),
                           distributed=DistributedConfig(sharding=sharding, bucket_size=40))


def _steps(model: nn.Module, opt: Any, steps: range, rows: slice) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 5, generator=g)
        (model(x[rows]) - y[rows]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max()).item() for n in b)


def placements_vs_one_process(layout: str, algorithm: str = "schedule_free_adamw") -> dict[str, float]:
    """On every rank: ``layout`` (zero1, replicated: the data-parallel wrapper; fsdp: FSDP2) at dp = the world's
    size, each rank its part of every batch, against one process on whole batches; relative gaps of y and of x."""
    rank, world = world_comm().rank, world_comm().size
    half = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    ref = _model()
    ref_opt = build_optimizer(_config(algorithm=algorithm), ref).optimizer
    _steps(ref, ref_opt, range(STEPS), slice(None))
    if layout == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = _model()
        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
        config = _config(algorithm=algorithm)
    else:
        config = _config(layout, algorithm)
        model = _model()
        wrapped = wrap_data_parallel(config, model)
    opt = build_optimizer(config, wrapped).optimizer
    _steps(wrapped, opt, range(STEPS), half)
    out = {"y": _gap(_full(model), _full(ref)), "moved": _gap(_full(model), _full(_model()))}
    ref_opt.eval()
    opt.eval()
    out["x"] = _gap(_full(model), _full(ref))
    return out


@pytest.mark.parametrize("algorithm", ["schedule_free_adamw", "schedule_free_sgd"])
@pytest.mark.parametrize("layout", ["zero1", "replicated", "fsdp"])
def test_schedule_free_equals_one_process_in_train_and_eval(world2, layout: str, algorithm: str) -> None:
    for out in world2.run(placements_vs_one_process, layout, algorithm):
        assert out["moved"] > 1e-2, out  # the steps did something
        assert out["y"] <= 1e-6 and out["x"] <= 1e-6, out


@pytest.mark.parametrize("algorithm", ["schedule_free_adamw", "schedule_free_sgd"])
def test_schedule_free_under_zero1_at_dp3_equals_one_process(world3, algorithm: str) -> None:
    for out in world3.run(placements_vs_one_process, "zero1", algorithm):
        assert out["moved"] > 1e-2, out
        assert out["y"] <= 1e-6 and out["x"] <= 1e-6, out


def checkpoint_in_eval_mode(root: str, algorithm: str = "schedule_free_adamw") -> dict[str, float]:
    """Steps 0-9 under ZeRO-1 dp=2, eval(), save; one process loads it, train(), steps 10-19; against one
    uninterrupted process."""
    from optstack.checkpoint import load_checkpoint, save_checkpoint
    from optstack.distributed.comm import NullComm

    rank = world_comm().rank
    ref = _model()
    ref_opt = build_optimizer(_config(algorithm=algorithm), ref).optimizer
    _steps(ref, ref_opt, range(STEPS), slice(None))
    config = _config("zero1", algorithm)
    model = _model()
    wrapped = wrap_data_parallel(config, model)
    opt = build_optimizer(config, wrapped).optimizer
    _steps(wrapped, opt, range(STEPS // 2), slice(rank * ROWS // 2, (rank + 1) * ROWS // 2))
    opt.eval()  # the parameters (and the checkpoint's masters) hold x; z travels as element-wise state
    save_checkpoint(f"{root}/sf", opt, step=STEPS // 2)
    torch.manual_seed(7)
    single = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 5))
    single_opt = build_optimizer(_config(algorithm=algorithm), single).optimizer
    load_checkpoint(f"{root}/sf/step_{STEPS // 2:08d}", single_opt, comm=NullComm())
    single_opt.train()  # the loaded parameters hold x: back to y before the next forward
    _steps(single, single_opt, range(STEPS // 2, STEPS), slice(None))
    out = {"y": _gap(_full(single), _full(ref))}
    single_opt.eval()
    ref_opt.eval()
    out["x"] = _gap(_full(single), _full(ref))
    return out


@pytest.mark.parametrize("algorithm", ["schedule_free_adamw", "schedule_free_sgd"])
def test_checkpoint_saved_in_eval_mode_at_dp2_resumes_in_one_process(world2, tmp_path, algorithm: str) -> None:
    for out in world2.run(checkpoint_in_eval_mode, str(tmp_path), algorithm):
        assert out["y"] <= 1e-6 and out["x"] <= 1e-6, out
