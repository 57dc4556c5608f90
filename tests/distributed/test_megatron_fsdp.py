"""``use_megatron_fsdp=True`` on real gloo ranks: Megatron's ``FullyShardedDataParallel`` (FSDP2 underneath) in
Megatron's training loop, stepped by ``get_megatron_optimizer``, against one process on the same global batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

ROWS, IN, HIDDEN, OUT = 8, 6, 8, 5  # 5 output rows split unevenly over 2 ranks (FSDP2 pads the last shard)
STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, OUT))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, IN, generator=g), torch.randn(ROWS, OUT, generator=g)


def _whole(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _megatron_loop(strategy: str, instances: int) -> dict[str, Any]:
    """Megatron's loop over FullyShardedDataParallel (each rank its rows of each batch) and over the plain model
    (every row): the largest parameter difference after STEPS AdamW steps, and what the wrapper built."""
    import dataclasses

    import torch.distributed as dist

    from optstack.megatron import (
        DistributedDataParallelConfig,
        FullyShardedDataParallel,
        OptimizerConfig,
        get_megatron_optimizer,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    config = OptimizerConfig(optimizer="adam", lr=0.05, weight_decay=0.1, clip_grad=0.3,
                             use_distributed_optimizer=True)
    ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                               data_parallel_sharding_strategy=strategy,
                                               num_distributed_optimizer_instances=instances)
    ref = _model()
    model = FullyShardedDataParallel(None, ddp_config, _model())
    rows = ROWS // world
    for m, part in ((ref, slice(None)), (model, slice(rank * rows, (rank + 1) * rows))):
        # one process: no wrapper, so no distributed optimizer
        opt = get_megatron_optimizer(config if m is model else dataclasses.replace(
            config, use_distributed_optimizer=False), [m])
        for step in range(STEPS):
            x, y = _batch(step)
            if m is model:
                model.zero_grad_buffer()
            opt.zero_grad()
            (m(x[part]) - y[part]).pow(2).mean().backward()
            if m is model:
                model.finish_grad_sync()
                model.start_param_sync()
            applied, grad_norm, _ = opt.step()
            assert applied and grad_norm > 0
    got, want = _whole(model.module), _whole(ref)
    first = next(model.module.parameters())
    return {"diff": max((got[n] - want[n]).abs().max().item() for n in want),
            "moved": max((want[n] - _whole(_model())[n]).abs().max().item() for n in want),
            "placements": [type(pl).__name__ for pl in first.placements], "units": len(model.fsdp_units),
            "names": sorted(got) == sorted(want)}


@pytest.mark.parametrize(("strategy", "instances", "placements", "units"), [
    ("optim_grads_params", 1, ["Shard"], 3),   # ZeRO-3, a unit per layer with parameters
    ("optim_grads", 2, ["Replicate", "Shard"], 0),  # HSDP: 2 replicas of 1 (world 2)
    ("no_shard", 1, ["Replicate", "Shard"], 0),  # replicated: a dp x 1 mesh
])
def test_use_megatron_fsdp_matches_one_process(world2, strategy: str, instances: int, placements: list[str],
                                               units: int) -> None:
    for out in world2.run(_megatron_loop, strategy, instances):
        assert out["moved"] > 1e-3 and out["names"]
        assert out["diff"] <= 1e-6, out
        assert out["placements"] == placements and out["units"] == units, out


def _refusals() -> list[str]:
    from optstack.megatron import DistributedDataParallel, DistributedDataParallelConfig, FullyShardedDataParallel

    messages = []
    fsdp = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads")
    for call in (lambda: DistributedDataParallel(None, fsdp, _model()),
                 lambda: FullyShardedDataParallel(None, DistributedDataParallelConfig(), _model()),
                 lambda: FullyShardedDataParallel(None, fsdp, _model()).finish_grad_sync(force_all_reduce=True)):
        try:
            call()
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def test_fsdp_refusals_name_the_field(world2) -> None:
    from optstack.megatron import DistributedDataParallelConfig

    for field, value in (("data_parallel_sharding_strategy", "optim"), ("check_for_nan_in_grad", True),
                         ("preserve_fp32_weights", False), ("outer_dp_sharding_strategy", "optim"),
                         ("fsdp_double_buffer", True)):
        with pytest.raises(ValueError, match=f"DistributedDataParallelConfig.{field}=.*use_megatron_fsdp=True"):
            DistributedDataParallelConfig(use_megatron_fsdp=True, **{field: value})
    with pytest.raises(ValueError, match="use_custom_fsdp=True is not supported alone"):
        DistributedDataParallelConfig(use_custom_fsdp=True)
    DistributedDataParallelConfig(use_megatron_fsdp=True, use_custom_fsdp=True)  # Megatron sets both
    for messages in world2.run(_refusals):
        assert len(messages) == 3, messages
        assert "FullyShardedDataParallel" in messages[0] and "use_megatron_fsdp=True" in messages[1]
        assert "force_all_reduce=True" in messages[2]
