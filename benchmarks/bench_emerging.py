"""Emerging optimizers' step time, side by side in one run: NorMuon and AdaMuon against Muon, Schedule-Free AdamW
and SOAP against AdamW, on the matrices of a small GPT (``--layers`` blocks of width ``--width``: fused QKV, attention
output, MLP in and out) and its vectors (one bias per matrix); the optimizer alone (gradients are fixed random
tensors), one process.

Run: .venv/bin/python benchmarks/bench_emerging.py [--width 256] [--layers 4] [--steps 20] [--threads 2]

SOAP (its matrices; the vectors on AdamW, as the default rules route them) refreshes its eigenbases every
``precondition_frequency`` steps (10, the demo's and the paper's), so its cost is amortised: the mean over whole
refresh periods (``--steps`` a multiple of 10), against AdamW's mean. Targets (issue 28): NorMuon within 1.1x of
Muon, SOAP's amortised step within 2x of AdamW's.

Newton-Schulz runs at optstack's default precision (``matmul_precision="medium"``: bf16 where the CPU multiplies
bf16 natively, else fp32). Variants are timed interleaved (one step each in turn, ``bench_muon.time_interleaved``)
so that load from other processes hits all alike; the table gives the median wall and CPU time per step and the
ratio to the baseline of its family (Muon, AdamW): of the medians, and for SOAP of the means (amortised).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from optstack.algorithms.adamw import AdamW
from optstack.algorithms.adaptive_muon import AdaptiveMuon
from optstack.algorithms.muon import Muon
from optstack.algorithms.schedule_free import ScheduleFreeAdamW
from optstack.algorithms.soap import SOAP

try:
    from bench_muon import time_interleaved
except ImportError:  # run from the repository root
    from benchmarks.bench_muon import time_interleaved


def shapes(width: int, layers: int) -> list[tuple[int, int]]:
    block = [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)]
    return block * layers


class _Chained:
    """SOAP on the matrices and AdamW on the vectors, stepped together (what build_optimizer's stages do)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20,
                        help="timed steps per variant (after 1 warm-up); a multiple of 10 for SOAP's mean")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    matrices = shapes(args.width, args.layers)
    vectors = [(rows,) for rows, _ in matrices]

    def params(of: list[tuple[int, ...]]) -> list[torch.nn.Parameter]:
        out = [torch.nn.Parameter(torch.randn(*s, generator=g) * 0.02) for s in of]
        for p in out:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        return out

    muon = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01)
    variants = {
        "muon": Muon(params(matrices), **muon),
        "normuon": AdaptiveMuon(params(matrices), moment2_method="normuon", **muon),
        "adamuon": AdaptiveMuon(params(matrices), moment2_method="adamuon", **muon),
        "adamw": AdamW(params(matrices + vectors), lr=1e-3),
        "adamw_foreach": AdamW(params(matrices + vectors), lr=1e-3, impl="foreach"),  # Schedule-Free's kind of path
        "schedule_free_adamw": ScheduleFreeAdamW(params(matrices + vectors), lr=1e-3),
        "soap": _Chained(SOAP(params(matrices), lr=3e-3, precondition_frequency=10), AdamW(params(vectors), lr=1e-3)),
    }
    times = time_interleaved({name: (opt.step, args.steps, True) for name, opt in variants.items()})
    numel = sum(torch.Size(s).numel() for s in matrices)
    print(f"{len(matrices)} matrices ({numel / 1e6:.2f}M elements), width {args.width}, {args.layers} blocks, "
          f"{args.threads} threads, median of {args.steps} steps\n")
    print("| optimizer | wall ms / step (median) | CPU ms / step | wall ms / step (mean) | vs |")
    print("|---|---:|---:|---:|---|")
    base = {"muon": "muon", "normuon": "muon", "adamuon": "muon", "adamw": "adamw", "adamw_foreach": "adamw",
            "schedule_free_adamw": "adamw", "soap": "adamw"}
    wall = {n: statistics.median(w for w, _ in t) for n, t in times.items()}
    cpu = {n: statistics.median(c for _, c in t) for n, t in times.items()}
    mean = {n: statistics.fmean(w for w, _ in t) for n, t in times.items()}
    for name in variants:
        if name == "soap":  # amortised: the mean over whole refresh periods, against AdamW's mean
            ratio = f"{mean[name] / mean['adamw']:.2f}x adamw (amortised, means)"
        else:
            ratio = "" if base[name] == name else f"{wall[name] / wall[base[name]]:.2f}x {base[name]}"
        if name == "schedule_free_adamw":
            ratio += f", {wall[name] / wall['adamw_foreach']:.2f}x adamw_foreach"
        print(f"| {name} | {wall[name] * 1e3:.1f} | {cpu[name] * 1e3:.1f} | {mean[name] * 1e3:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
