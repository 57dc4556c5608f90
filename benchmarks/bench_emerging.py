"""Emerging optimizers' step time, side by side in one run: NorMuon and AdaMuon against Muon, Schedule-Free AdamW
and SOAP against AdamW, on the matrices of a small GPT (``--layers`` blocks of width ``--width``: fused QKV, attention
output, MLP in and out) and its vectors (one bias per matrix); the optimizer alone (gradients are fixed random
tensors), one process. Then SOAP against AdamW in the whole training step a user of the demo runs.

Run: .venv/bin/python benchmarks/bench_emerging.py [--width 256] [--layers 4] [--steps 20] [--threads 2]
     [--only optimizer|train-step]

SOAP (its matrices; the vectors on AdamW, as the default rules route them) refreshes its eigenbases every
``precondition_frequency`` steps (10, the demo's and the paper's), so its cost is amortised: the mean over whole
refresh periods (``--steps`` a multiple of 10), against AdamW's mean. Targets (issue 28): NorMuon within 1.1x of
Muon, SOAP's amortised step within 2x of AdamW's.

Newton-Schulz runs at optstack's default precision (``matmul_precision="medium"``: bf16 where the CPU multiplies
bf16 natively, else fp32). Variants are timed interleaved (one step each in turn, ``bench_muon.time_interleaved``)
so that load from other processes hits all alike; the table gives the median wall and CPU time per step and the
ratio to the baseline of its family (Muon, AdamW): of the medians, and for SOAP of the means (amortised).

Train step (the second table): the demo's default model and batch (``optstack train``: GPT of d_model 192, 4
layers, 32 x 128 tokens, random bytes), ``zero_grad`` + forward + backward + ``optimizer.step()`` with the optimizer
``optstack.demo.train.make_optimizer`` builds (``build_optimizer`` with the default rules: on SOAP the 16 block
matrices, on AdamW the vectors, embeddings and output layer; clipping at 1.0 as the demo's default), interleaved,
means over two whole refresh periods; ``optimizer.step()``'s own mean beside it.

Why the optimizer alone cannot reach 2x of AdamW on a CPU: AdamW is memory-bound, a few passes over 4 tensors of
the parameters' size (~3.2M elements here: ~5 ms). SOAP's ordinary step is six matrix products per ``(m, n)``
matrix (``G G^T``, ``G^T G``, two into the eigenbasis, two back: ``6 m n (m + n)`` FLOPs), 21.7 GFLOP at width 256;
at this shared 2-core machine's best fp32 matmul rate (measured 69 GFLOP/s on 1 thread, 80-129 on 2; printed) that
is 170-320 ms before any element-wise work: 40-50x AdamW's step whatever the implementation. Each refresh adds per
side a product and a QR (Householder, LAPACK: ~0.5 s for four 1024 x 1024 on 1 thread) and four products moving
the momentum between bases: amortised SOAP is ~80-95x AdamW here. The ratio is FLOPs against bytes; it shrinks where
a training step's forward and backward (6 x parameters x tokens FLOPs) dominate: in the demo's train step SOAP's
products are ~9 GFLOP against ~47 of forward and backward, and the target holds (1.15-1.20x AdamW, measured).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from optstack.algorithms.adamw import AdamW
from optstack.algorithms.adaptive_muon import AdaptiveMuon
from optstack.algorithms.muon import Muon
from optstack.algorithms.schedule_free import ScheduleFreeAdamW
from optstack.algorithms.soap import SOAP
from optstack.demo.config import load_config
from optstack.demo.gpt import GPT
from optstack.demo.train import make_optimizer

try:
    from bench_muon import matmul_peak_gflops, time_interleaved
except ImportError:  # run from the repository root
    from benchmarks.bench_muon import matmul_peak_gflops, time_interleaved


def shapes(width: int, layers: int) -> list[tuple[int, int]]:
    block = [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)]
    return block * layers


def soap_step_flops(matrices: list[tuple[int, int]]) -> float:
    """Matmul FLOPs of SOAP's ordinary step: ``G G^T``, ``G^T G``, two products into the eigenbasis and two back,
    ``6 m n (m + n)`` per ``(m, n)`` matrix (every side preconditioned)."""
    return sum(6 * m * n * (m + n) for m, n in matrices)


class _Chained:
    """SOAP on the matrices and AdamW on the vectors, stepped together (what build_optimizer's stages do)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()


def optimizer_alone(args: argparse.Namespace) -> None:
    """The first table: each optimizer's step on fixed random gradients, and SOAP's matmul floor."""
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
    print(f"Optimizer alone: {len(matrices)} matrices ({numel / 1e6:.2f}M elements), width {args.width}, "
          f"{args.layers} blocks, {args.threads} threads, {args.steps} steps\n")
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
    flops = soap_step_flops(matrices)
    rate, _ = matmul_peak_gflops(4 * args.width, torch.float32)
    print(f"\nSOAP's ordinary step: {flops / 1e9:.1f} GFLOP of matmuls; at this machine's best fp32 matmul rate "
          f"({rate:.0f} GFLOP/s, ({4 * args.width})^2 products) that alone is {flops / rate / 1e6:.0f} ms, "
          f"{flops / rate / 1e9 / wall['adamw']:.0f}x AdamW's median step (refreshes not counted)")


def train_step(args: argparse.Namespace) -> None:
    """The second table: the demo's whole training step (zero_grad, forward, backward, ``optimizer.step()``) on
    its default model and batch, AdamW against SOAP as ``optstack train --optimizer.algorithm ...`` builds them."""
    built, batches = {}, {}
    for algorithm in ("adamw", "soap"):
        cfg = load_config(overrides=[{"optimizer": {"algorithm": algorithm}}])
        torch.manual_seed(cfg.train.seed)
        model = GPT(cfg.model)
        g = torch.Generator().manual_seed(0)  # random bytes: the step's cost does not depend on which
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.model.seq_len + 1), generator=g)
        built[algorithm] = (model, make_optimizer(cfg, model).optimizer)
        batches[algorithm] = (tokens[:, :-1], tokens[:, 1:])
    step_times: dict[str, list[float]] = {name: [] for name in built}

    def one_step(name: str) -> Callable[[], None]:
        model, optimizer = built[name]
        x, y = batches[name]

        def run() -> None:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            optimizer.scale_loss(loss).backward()
            t0 = time.perf_counter()
            optimizer.step()
            step_times[name].append(time.perf_counter() - t0)
        return run

    times = time_interleaved({name: (one_step(name), args.steps, True) for name in built})
    cfg = load_config()
    model, optimizer = built["soap"]
    soap = next(stage.optimizer for stage in optimizer.stages if isinstance(stage.optimizer, SOAP))
    matrices = [tuple(p.shape) for group in soap.param_groups for p in group["params"]]
    tokens = cfg.train.batch_size * cfg.model.seq_len
    forward_backward = 6 * sum(p.numel() for p in model.parameters() if p.ndim == 2) * tokens
    print(f"\nTrain step of the demo model ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"d_model {cfg.model.d_model}, {cfg.model.n_layer} layers, batch {cfg.train.batch_size} x "
          f"{cfg.model.seq_len} tokens): zero_grad + forward + backward + optimizer.step(), {args.threads} threads, "
          f"{args.steps} steps after 1 warm-up\n")
    print("| optimizer | wall ms / train step (median) | wall ms (mean) | CPU ms (mean) "
          "| optimizer.step() ms (mean) | vs |")
    print("|---|---:|---:|---:|---:|---|")
    mean = {n: statistics.fmean(w for w, _ in t) for n, t in times.items()}
    for name, t in times.items():
        ratio = "" if name == "adamw" else f"{mean[name] / mean['adamw']:.2f}x adamw (amortised, means)"
        print(f"| {name} | {statistics.median(w for w, _ in t) * 1e3:.1f} | {mean[name] * 1e3:.1f} "
              f"| {statistics.fmean(c for _, c in t) * 1e3:.1f} | {statistics.fmean(step_times[name][1:]) * 1e3:.1f} "
              f"| {ratio} |")
    print(f"\nSOAP's ordinary step on the demo's {len(matrices)} SOAP matrices: {soap_step_flops(matrices) / 1e9:.1f} "
          f"GFLOP of matmuls; forward + backward ~{forward_backward / 1e9:.0f} GFLOP (6 x matrix parameters x "
          "tokens, attention aside)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20,
                        help="timed steps per variant (after 1 warm-up); a multiple of 10 for SOAP's mean")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", choices=("optimizer", "train-step"),
                        help="one table: the optimizer alone, or the demo's train step (default: both)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.only != "train-step":
        optimizer_alone(args)
    if args.only != "optimizer":
        train_step(args)


if __name__ == "__main__":
    main()
