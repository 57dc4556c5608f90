"""Muon step time: optstack's Muon (same-shaped matrices batched) vs a plain per-matrix reference loop vs
torch.optim.Muon, on a set of square fp32 matrices, CPU.

Run: .venv/bin/python benchmarks/bench_muon.py [--num-matrices 8] [--size 1024] [--threads 2]
     [--include-torch]

Reports time per step and achieved GFLOP/s of the Newton-Schulz matmuls (the step's cost; the elementwise
work is <1%), against the fp32 matmul rate measured on this machine at the same size. torch.optim.Muon runs
Newton-Schulz in bf16, which common CPUs have no matmul hardware for (tens of times slower), so it only runs
with --include-torch, for --torch-steps steps (default 1).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from optstack.algorithms.muon import Muon, muon_reference


def ns_flops(rows: int, cols: int, ns_steps: int) -> float:
    """Matmul FLOPs of Newton-Schulz on one (rows, cols) matrix: X X^T, A A and B X per step (small side)."""
    m, n = min(rows, cols), max(rows, cols)
    return ns_steps * (2 * m * m * n + 2 * m**3 + 2 * m * m * n)


def matmul_peak_gflops(size: int) -> float:
    """Best fp32 (size x size) @ (size x size) rate over ~1 s of repetitions (the best, not the median: a
    peak, and robust to other processes sharing the cores)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm up the BLAS
    reps = max(5, int(2e9 / (2 * size**3)))
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e9


def time_interleaved(variants: dict[str, tuple[Callable[[], None], int, bool]]) -> dict[str, list[float]]:
    """Time ``{name: (step, timed_steps, warm_up)}`` in rounds of one step per variant in turn, so that load
    from other processes hits every variant alike and the ratios stay fair."""
    for step, _, warm_up in variants.values():
        if warm_up:
            step()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(max(count for _, count, _ in variants.values())):
        for name, (step, count, _) in variants.items():
            if r < count:
                t0 = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-matrices", type=int, default=8)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant (after 1 warm-up)")
    parser.add_argument("--include-torch", action="store_true", help="also time torch.optim.Muon (bf16 NS)")
    parser.add_argument("--torch-steps", type=int, default=1, help="timed torch.optim.Muon steps")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    n, size, ns_steps = args.num_matrices, args.size, 5
    hyper: dict[str, Any] = dict(
        lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01, extra_scale_factor=0.2
    )
    init = [torch.randn(size, size) for _ in range(n)]
    grads = [torch.randn(size, size) for _ in range(n)]

    def params() -> list[torch.nn.Parameter]:
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        for p, g in zip(ps, grads, strict=True):
            p.grad = g
        return ps

    ours = params()
    opt = Muon(ours, **hyper)
    ref = [p.detach() for p in params()]
    bufs = [torch.zeros_like(p) for p in ref]

    def reference_step() -> None:
        for p, g, b in zip(ref, grads, bufs, strict=True):
            muon_reference(p, g, b, ns_steps=ns_steps, coefficients="quintic", scale_mode="spectral", **hyper)

    ours_name = "optstack Muon (batched NS, fp32)"
    variants = {
        ours_name: (opt.step, args.steps, True),
        "plain reference loop (fp32)": (reference_step, args.steps, True),
    }
    torch_note = "torch.optim.Muon skipped (it runs Newton-Schulz in bf16; pass --include-torch)"
    if args.include_torch and hasattr(torch.optim, "Muon"):
        theirs = params()
        topt = torch.optim.Muon(
            theirs, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"
        )
        # One step by default: bf16 matmul is very slow on CPUs without bf16 hardware.
        variants["torch.optim.Muon (bf16 NS)"] = (topt.step, args.torch_steps, args.torch_steps > 1)
        torch_note = f"torch.optim.Muon: {args.torch_steps} timed step(s)" + (
            ", no warm-up" if args.torch_steps == 1 else ""
        )
    peak = matmul_peak_gflops(size)
    results = time_interleaved(variants)
    diff = max((a.detach() - b).abs().max().item() for a, b in zip(ours, ref, strict=True))

    peak = max(peak, matmul_peak_gflops(size))
    flops = n * ns_flops(size, size, ns_steps)
    base = statistics.median(results[ours_name])

    print(
        f"\nMuon step, {n} x ({size} x {size}) fp32 params, {ns_steps} quintic NS steps, "
        f"{args.threads} threads, torch {torch.__version__}"
    )
    print(
        f"fp32 matmul peak measured at {size}^3: {peak:.1f} GFLOP/s; "
        f"NS work per step: {flops / 1e9:.1f} GFLOP\n"
    )
    print("| variant | s / step (median) | GFLOP/s | % of fp32 matmul peak | time vs optstack |")
    print("|---|---:|---:|---:|---:|")
    for name, times in results.items():
        t = statistics.median(times)
        rate = flops / t / 1e9
        print(f"| {name} | {t:.3f} | {rate:.1f} | {100 * rate / peak:.0f}% | {t / base:.2f}x |")
    print(f"\nmax |optstack - reference| after {args.steps + 1} steps: {diff:.2e}; {torch_note}")


if __name__ == "__main__":
    main()
