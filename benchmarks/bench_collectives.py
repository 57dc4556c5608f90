"""Collectives on a 2-process gloo world: all-reduce vs reduce-scatter + all-gather vs reduce-scatter alone.

Run: .venv/bin/python benchmarks/bench_collectives.py [--sizes-m 4 8 16 32 64] [--ranks 2] [--repeats 5]

This decides how ``DataParallel(shard_grads=True)`` reduces a bucket on each backend: a ZeRO-1 rank only
needs its own slice of the reduced gradients, which a reduce-scatter gives with half the traffic of an
all-reduce on a ring; but gloo's reduce-scatter is not a ring, so on gloo an all-reduce (keeping the local
slice) is faster and gives the same numbers. Buffers are fp32; everything goes through ``optstack``'s
``Comm`` (the code paths the wrapper uses). Variants are interleaved repeat by repeat, so a burst of load
from elsewhere hits them alike; the table shows the median over repeats of the slowest rank, and each
variant's time relative to one all-reduce of the same buffer (> 1: slower).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from optstack.distributed.comm import Comm

VARIANTS = ["all_reduce", "reduce_scatter + all_gather", "reduce_scatter", "all_gather",
            "all_reduce + keep slice"]


def _ops(comm: Comm, numel: int) -> dict[str, Callable[[], None]]:
    full = torch.randn(numel)
    shard = torch.empty(numel // comm.size)
    gathered = torch.empty(numel)

    def emulated() -> None:
        comm.all_reduce(full)
        shard.copy_(full[comm.rank * shard.numel():(comm.rank + 1) * shard.numel()])

    return {
        "all_reduce": lambda: comm.all_reduce(full),
        "reduce_scatter + all_gather": lambda: (comm.reduce_scatter(shard, full),
                                                comm.all_gather_into(gathered, shard)),
        "reduce_scatter": lambda: comm.reduce_scatter(shard, full),
        "all_gather": lambda: comm.all_gather_into(gathered, shard),
        "all_reduce + keep slice": emulated,
    }


def _worker(rank: int, size: int, store_path: str, sizes_m: list[int], repeats: int, queue: mp.Queue) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=600))
    comm = Comm(None, name="bench")
    results: dict[tuple[int, str], list[float]] = {}
    for size_m in sizes_m:
        numel = size_m * 1024 * 1024 // size * size
        ops = _ops(comm, numel)
        for op in ops.values():  # warm-up: connections, allocations
            op()
        for _ in range(repeats):
            for name, op in ops.items():
                comm.barrier()
                start = time.perf_counter()
                op()
                elapsed = time.perf_counter() - start
                # the slowest rank decides when the collective is done
                slowest = max(comm.all_gather_object(elapsed))
                results.setdefault((size_m, name), []).append(slowest)
        del ops
    if rank == 0:
        queue.put({k: statistics.median(v) for k, v in results.items()})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-m", type=int, nargs="+", default=[4, 8, 16, 32, 64],
                        help="buffer sizes in Mi fp32 elements")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, args.ranks, store, args.sizes_m, args.repeats, queue))
                 for r in range(args.ranks)]
        for p in procs:
            p.start()
        medians = queue.get()
        for p in procs:
            p.join()

    print(f"gloo, {args.ranks} ranks, 1 thread each, fp32 buffers; median of {args.repeats} repeats "
          "(slowest rank), ms; in brackets: x one all-reduce of the same buffer")
    cols = [max(len(v), 17) for v in VARIANTS]
    header = f"{'buffer':>14} | " + " | ".join(f"{v:>{w}}" for v, w in zip(VARIANTS, cols, strict=True))
    print(header)
    print("-" * len(header))
    for size_m in args.sizes_m:
        base = medians[(size_m, "all_reduce")]
        cells = []
        for v, w in zip(VARIANTS, cols, strict=True):
            t = medians[(size_m, v)]
            cell = f"{t * 1e3:.1f}" if v == "all_reduce" else f"{t * 1e3:.1f} ({t / base:.2f}x)"
            cells.append(f"{cell:>{w}}")
        print(f"{f'{size_m}M ({size_m * 4.194304:.0f} MB)':>14} | " + " | ".join(cells))
    rs_ag = [medians[(s, "reduce_scatter + all_gather")] / medians[(s, "all_reduce")] for s in args.sizes_m]
    rs = [medians[(s, "reduce_scatter")] / medians[(s, "all_reduce")] for s in args.sizes_m]
    choice = "all_reduce" if min(rs) > 1.0 else "reduce_scatter"
    print(f"\nreduce-scatter + all-gather / all-reduce: {min(rs_ag):.2f}x .. {max(rs_ag):.2f}x; "
          f"reduce-scatter alone / all-reduce: {min(rs):.2f}x .. {max(rs):.2f}x")
    print(f"=> fastest way for a sharded gradient reduction on gloo here: {choice}")


if __name__ == "__main__":
    main()
