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

``--muon [--steps 3]``: Muon on FSDP2 dp=2 (8 x (512 x 512) bias-free Linears, ``fully_shard`` per layer and
on the root; the DTensor owners placement: each matrix whole on one rank) vs one process stepping every matrix
(one thread per rank, spawned gloo ranks); the Newton-Schulz phase is the ``inner_step`` phase
(``optstack.protocol.set_phase_hook``), wall and CPU time, the slowest rank; the final parameters are compared.
Target: the phase >= 1.6x faster at dp=2, the same result as one process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
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


def _muon_run(rank: int, size: int, store: str, steps: int, out: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from optstack import OptimizerConfig, build_optimizer
    from optstack.protocol import set_phase_hook

    torch.set_num_threads(1)
    if size > 1:
        dist.init_process_group("gloo", store=dist.FileStore(store, size), rank=rank, world_size=size)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(8)])
    if size > 1:
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    optimizer = build_optimizer(OptimizerConfig(algorithm="muon", lr=0.02), model).optimizer
    wall = [0.0] * (steps + 1)  # per step: the stages' inner_step phases summed
    cpu = [0.0] * (steps + 1)
    step = 0

    @contextlib.contextmanager
    def timer(name: str) -> Iterator[None]:
        t0, c0 = time.perf_counter(), time.thread_time()
        yield
        if name == "inner_step":
            wall[step] += time.perf_counter() - t0
            cpu[step] += time.thread_time() - c0

    set_phase_hook(timer)
    for step in range(steps + 1):  # the timer reads step
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, 512, generator=g), torch.randn(32, 512, generator=g)
        rows = slice(rank * 16, rank * 16 + 16) if size > 1 else slice(None)  # FSDP2 averages the halves
        (model(x[rows]) - y[rows]).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    params = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                        for p in model.parameters()])
    # numpy: pickled by value (a tensor would be shared memory that this process's exit may close first)
    out.put((rank, sum(wall[1:]) / steps, sum(cpu[1:]) / steps, params.numpy()))
    if size > 1:
        dist.destroy_process_group()


def run_muon(steps: int) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results: dict[int, list[tuple[int, float, float, Any]]] = {}
    for size in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            queue = ctx.Queue()
            procs = [ctx.Process(target=_muon_run, args=(r, size, os.path.join(tmp, "store"), steps, queue))
                     for r in range(size)]
            for p in procs:
                p.start()
            results[size] = sorted(queue.get(timeout=600) for _ in procs)
            for p in procs:
                p.join()
    (_, wall1, cpu1, params1), = results[1]
    wall2, cpu2 = max(r[1] for r in results[2]), max(r[2] for r in results[2])
    diff = max(abs(r[3] - params1).max() for r in results[2])
    print(f"\n### Muon on FSDP2, 8 x (512 x 512), fp32, gloo, one thread per rank, {steps} timed steps")
    print("| run | NS phase wall s/step (slowest rank) | NS phase CPU s/step (slowest rank) | speed-up (wall) | "
          "speed-up (CPU) |")
    print("|---|---:|---:|---:|---:|")
    print(f"| 1 process, every matrix | {wall1:.3f} | {cpu1:.3f} | 1.00x | 1.00x |")
    print(f"| FSDP2 dp=2, DTensor owners | {wall2:.3f} | {cpu2:.3f} | {wall1 / wall2:.2f}x | {cpu1 / cpu2:.2f}x |")
    speedup = wall1 / wall2
    print(f"\nNS phase >= 1.6x faster: {speedup:.2f}x wall, {cpu1 / cpu2:.2f}x CPU: "
          f"{'MET' if speedup >= 1.6 else 'NOT MET'}; max |dp=2 - one process| over the parameters after "
          f"{steps + 1} steps: {diff:.2e}")


if __name__ == "__main__" and "--muon" in sys.argv:
    muon_parser = argparse.ArgumentParser()
    muon_parser.add_argument("--muon", action="store_true")
    muon_parser.add_argument("--steps", type=int, default=3, help="timed steps (after 1 warm-up)")
    run_muon(muon_parser.parse_args().steps)
elif __name__ == "__main__":
    bd.main(["--configs", "fsdp2", "optstack_fsdp2", *sys.argv[1:]])
