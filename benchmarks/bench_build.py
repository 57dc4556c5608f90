"""Build time at scale: ``wrap_data_parallel`` + ``build_optimizer`` (ZeRO-1, AdamW) of a model of N tiny
parameter tensors (MoE-like: many small experts), at data-parallel size 2 on gloo.

Run: .venv/bin/python benchmarks/bench_build.py [--sizes 10 1000 10000 50000] [--numel 16] [--sharding zero1]

Each size runs in two fresh processes (spawned here, FileStore rendezvous, one thread per rank). Columns:
- wrap s: ``wrap_data_parallel(config, model)`` (buffers, buckets, hooks), the slower rank;
- build s: ``build_optimizer(config, ddp, rules=[])`` (names, groups, stages, ZeRO-1 pieces and gather plan);
- wrap+build CPU s: the CPU time of both (this process, every thread), less inflated by a loaded machine;
- first step s: the first backward and ``optimizer.step()`` (state created lazily there);
- us/param (CPU): wrap+build CPU / N, which stays flat when build time grows linearly in N.
The one-off import of ``torch._dynamo`` by the first ``torch.optim.Optimizer`` of a process is paid before
timing (it does not depend on the model).
Target (issue 15): 50,000 parameters build in <= 10 s at dp=2.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


class Experts(nn.Module):
    """``count`` tiny parameter tensors, used in one forward (a sum), so every one gets a gradient."""

    def __init__(self, count: int, numel: int) -> None:
        super().__init__()
        self.experts = nn.ParameterList(nn.Parameter(torch.randn(numel) * 0.01) for _ in range(count))

    def forward(self) -> torch.Tensor:
        return torch.stack([p.sum() for p in self.experts]).pow(2).sum()


def _rank(rank: int, store_path: str, count: int, numel: int, sharding: str, out: str) -> None:
    import torch.distributed as dist

    from optstack import DistributedConfig, OptimizerConfig, build_optimizer, wrap_data_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))
    torch.manual_seed(0)
    model = Experts(count, numel)
    config = OptimizerConfig(algorithm="adamw", distributed=DistributedConfig(sharding=sharding))
    # The first torch.optim.Optimizer of a process imports torch._dynamo (2-9 s here), whatever the model:
    # paid before timing, so the table shows what grows with the parameters.
    torch.optim.SGD([nn.Parameter(torch.zeros(1))])
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    ddp = wrap_data_parallel(config, model)
    t1 = time.perf_counter()
    built = build_optimizer(config, ddp, rules=[])
    t2, c2 = time.perf_counter(), time.process_time()
    ddp().backward()
    built.optimizer.step()
    t3 = time.perf_counter()
    Path(f"{out}.{rank}").write_text(f"{t1 - t0} {t2 - t1} {c2 - c0} {t3 - t2}")
    dist.barrier()
    dist.destroy_process_group()


def measure(count: int, numel: int, sharding: str) -> tuple[float, ...]:
    """(wrap, build, wrap + build CPU, first step) seconds for ``count`` parameters, the slower rank of two."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times")
        mp.start_processes(_rank, args=(os.path.join(tmp, "store"), count, numel, sharding, out), nprocs=2,
                           start_method="spawn")
        times = [tuple(float(x) for x in Path(f"{out}.{r}").read_text().split()) for r in range(2)]
    return tuple(max(t[i] for t in times) for i in range(4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 1000, 10_000, 50_000])
    parser.add_argument("--numel", type=int, default=16, help="elements per parameter tensor")
    parser.add_argument("--sharding", default="zero1", choices=["replicated", "zero1"])
    args = parser.parse_args()
    print(f"build at dp=2 (gloo), sharding={args.sharding}, AdamW, tensors of {args.numel} elements\n")
    print("| params | wrap s | build s | wrap+build CPU s | first step s | us/param (CPU) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for count in args.sizes:
        wrap, build, cpu, step = measure(count, args.numel, args.sharding)
        print(f"| {count:,} | {wrap:.2f} | {build:.2f} | {cpu:.2f} | {step:.2f} | {cpu / count * 1e6:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
