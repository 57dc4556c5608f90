"""AdamW step on ~50M fp32 parameters: optstack (auto and each impl) vs torch.optim.AdamW (for-loop, foreach,
fused) and, when ``import deepspeed`` works, DeepSpeed's CPU Adam.

Run: .venv/bin/python benchmarks/bench_adamw.py [--threads 1 2] [--params-m 50] [--steps 7]

Layouts: few large tensors (50 x 1M), many small tensors (5000 x 10k), and the same many small tensors as
back-to-back views of one flat buffer (what a sharded optimizer's inner step sees; optstack steps such a run
as one tensor). Every optimizer steps the same tensors; the variants' steps are interleaved step by step, so a
burst of load from elsewhere hits them alike. The table gives the median step, the bytes moved per second
counting the least an AdamW step must move (28 B per fp32 param: param read+write, grad read, two moments
read+write), that as a share of the measured memory bandwidth (best in-place add, 12 B per element), and
the speed relative to torch's fused AdamW (> 1: faster). The bf16-moments row is counted at 28 B too,
though it moves 20 B: it shows what the memory saving costs in time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from optstack.algorithms import AdamW

BYTES_PER_PARAM = 28
HYPER = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def layouts(total: int) -> dict[str, Callable[[], list[torch.Tensor]]]:
    def separate(count: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        tensors = [torch.randn(total // count, generator=gen) * 0.02 for _ in range(count)]
        for t in tensors:
            t.grad = torch.randn(t.shape, generator=gen) * 1e-3
        return tensors

    def flat_views(count: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        flat = torch.randn(total // count * count, generator=gen) * 0.02
        flat_grad = torch.randn(flat.shape, generator=gen) * 1e-3
        views = list(flat.split(total // count))
        for view, grad in zip(views, flat_grad.split(total // count), strict=True):
            view.grad = grad
        return views

    return {
        f"50 x {_count(total // 50)}": lambda: separate(50),
        f"5000 x {_count(total // 5000)}": lambda: separate(5000),
        f"5000 x {_count(total // 5000)} flat views": lambda: flat_views(5000),
    }


def _count(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k"


def variants() -> dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]]:
    out: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
        "torch for-loop": lambda ts: torch.optim.AdamW(ts, foreach=False, **HYPER),
        "torch foreach": lambda ts: torch.optim.AdamW(ts, foreach=True, **HYPER),
        "torch fused": lambda ts: torch.optim.AdamW(ts, fused=True, **HYPER),
    }
    for impl in ("auto", "fused", "foreach", "reference"):
        out[f"optstack {impl}"] = lambda ts, impl=impl: AdamW(ts, impl=impl, **HYPER)
    # Not comparable in bytes (20 B/param): how much the memory saving costs in time.
    out["optstack auto, bf16 moments"] = lambda ts: AdamW(
        ts, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, **HYPER
    )
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # optional extra; JIT-compiles on first use
    except Exception:  # noqa: BLE001 - any failure to import means "no DeepSpeed column"
        return out
    out["deepspeed cpu adam"] = lambda ts: DeepSpeedCPUAdam(ts, adamw_mode=True, **HYPER)
    return out


def bandwidth(numel: int, repeats: int) -> float:
    """Bytes per second of ``a += b`` over ``numel`` fp32 elements (reads a and b, writes a): the best of
    ``repeats``, as the machine's attainable bandwidth (a median would count other load on a shared host)."""
    a, b = torch.ones(numel), torch.ones(numel)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        a.add_(b)
        times.append(time.perf_counter() - t0)
    return 12 * numel / min(times[1:])


def measure(tensors: list[torch.Tensor], steps: int) -> dict[str, float]:
    """Median seconds per step of every variant, stepping the same tensors, interleaved."""
    optimizers = {}
    for name, make in variants().items():
        optimizers[name] = make(tensors)
        optimizers[name].step()  # warm-up: creates the state
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for _ in range(steps):
        for name, opt in optimizers.items():
            t0 = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def table(threads: int, total: int, steps: int) -> str:
    torch.set_num_threads(threads)
    bw = bandwidth(total, 3 * steps)
    results = {}
    for layout, make in layouts(total).items():
        tensors = make()
        numel = sum(t.numel() for t in tensors)
        results[layout] = (numel, measure(tensors, steps))
        del tensors
    names = list(next(iter(results.values()))[1])
    head = ["path"]
    for layout in results:
        head += [f"{layout}: ms", "GB/s", "% bw", "x torch fused"]
    lines = [
        f"### {threads} thread(s): memory bandwidth (in-place add) {bw / 1e9:.1f} GB/s",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for name in names:
        row = [name]
        for numel, seconds in results.values():
            rate = BYTES_PER_PARAM * numel / seconds[name]
            row += [f"{seconds[name] * 1e3:.1f}", f"{rate / 1e9:.1f}", f"{100 * rate / bw:.0f}",
                    f"{seconds['torch fused'] / seconds[name]:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads, a table each")
    parser.add_argument("--params-m", type=float, default=50, help="millions of fp32 parameters")
    parser.add_argument("--steps", type=int, default=7, help="timed steps per variant (median reported)")
    args = parser.parse_args()
    total = int(args.params_m * 1e6) // 5000 * 5000
    if "deepspeed cpu adam" not in variants():
        print("(DeepSpeed not importable: no DeepSpeed CPU Adam column; it is an optional extra)\n")
    print(f"AdamW step, {total / 1e6:g}M fp32 params, torch {torch.__version__}, "
          f"median of {args.steps} steps\n")
    for threads in args.threads:
        print(table(threads, total, args.steps))
        print()


if __name__ == "__main__":
    main()
