"""FSDP2 + optstack AdamW vs FSDP2 + torch ``AdamW(fused=True)``, data-parallel size 2 on gloo.

Run: .venv/bin/python benchmarks/bench_fsdp.py [--quick] [--rounds 3] [--steps 15] [bench_distributed's options]

The workload, the measurement and the table are ``bench_distributed.py``'s (the 18.9M-parameter MLP, each rank
its own batch, one thread per rank, a fresh 2-rank world per configuration); only the rows differ:

- ``fsdp2`` (the baseline): ``fully_shard`` per Linear and on the root + ``torch.optim.AdamW(fused=True)``
  stepping the DTensor parameters.
- ``optstack_fsdp2``: the same model + ``build_optimizer(OptimizerConfig(algorithm="adamw", clip_grad=0.0),
  model, rules=[])``: the DTensor placement steps each rank's local shards with optstack's fused AdamW, and
  computes the global grad norm (one all-reduce) every step for ``StepResult.grad_norm``.

Targets (the DTensor issue): step time <= 1.0x, optimizer-state bytes per rank equal (12 B x params / 2),
peak RSS (+idle) <= 1.05x.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_distributed as bd  # noqa: E402  (its machinery; spawned ranks re-run this module's top level)

import optstack  # noqa: E402, F401  (imported before the ranks measure their idle memory: code is not state)


class FsdpOptstackRunner(bd.Runner):
    """FSDP2 as in ``bd.make_fsdp2``, stepped by optstack's optimizer built as a user builds it."""

    def __init__(self, model: nn.Module, args: argparse.Namespace) -> None:
        from torch.distributed.fsdp import fully_shard

        from optstack import OptimizerConfig, build_optimizer

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        self.module = fully_shard(model)
        config = OptimizerConfig(algorithm="adamw", clip_grad=0.0, **bd.HYPER)
        self.chain = build_optimizer(config, model, rules=[]).optimizer  # rules=[]: one group, as torch's
        (stage,) = self.chain.stages
        self.optimizer = stage.optimizer  # over the local shards (plain tensors)
        self.stepped = [p for g in self.optimizer.param_groups for p in g["params"]]

    def step(self, x: torch.Tensor, y: torch.Tensor, t: bd.Timer) -> torch.Tensor:
        with t("zero_grad"):
            self.chain.zero_grad()
        with t("forward"):
            loss = bd.mse(self.module(x), y)
        with t("backward"):
            loss.backward()
        with t("optimizer"):
            self.chain.step()
        return loss


bd.CONFIGS["fsdp2"] = "FSDP2 fully_shard + torch AdamW(fused)"
bd.CONFIGS["optstack_fsdp2"] = "FSDP2 fully_shard + optstack AdamW (DTensor placement)"
bd.MAKERS["optstack_fsdp2"] = FsdpOptstackRunner
bd.BASELINE = "fsdp2"


def _targets(by: dict[str, dict[str, Any]], formula_mb: float) -> list[str]:
    if not {"fsdp2", "optstack_fsdp2"} <= by.keys():
        return []
    ours, base = by["optstack_fsdp2"], by["fsdp2"]
    step = ours["step_ms"] / base["step_ms"]
    cpu = ours["cpu_ms"] / base["cpu_ms"]
    rss = ours["extra_mb"] / base["extra_mb"]
    return [f"step time <= 1.0x torch's: {step:.2f}x wall, {cpu:.2f}x CPU: {'MET' if step <= 1.0 else 'NOT MET'}",
            f"optimizer state per rank equal: {ours['state_mb']:.2f} vs {base['state_mb']:.2f} MB (12P/N = "
            f"{formula_mb:.2f}): {'MET' if abs(ours['state_mb'] - base['state_mb']) < 1e-6 else 'NOT MET'}",
            f"peak RSS (+idle) <= 1.05x: {rss:.2f}x: {'MET' if rss <= 1.05 else 'NOT MET'}"]


bd.targets = _targets

if __name__ == "__main__":
    bd.main(["--configs", "fsdp2", "optstack_fsdp2", *sys.argv[1:]])
