"""The gradient-norm pass alone: optstack's ``clip.norm_pows`` (a BLAS dot per large fp32 CPU tensor,
``_foreach_norm`` otherwise) against torch's ``_foreach_norm``, on the layouts of ``bench_step.py``.

This is the one read pass of optstack's step (the finite check is this norm); ``bench_step.py`` times the
whole ``optimizer.step()``. Ratios, not absolute times: the machines are shared.

    PYTHONPATH=src python benchmarks/bench_norm.py [--repeats 21] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from optstack.clip import norm_pows

LAYOUTS = {"50 x 1M": (50, (1000, 1000)), "5000 x 10k": (5000, (100, 100))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    print(f"torch {torch.__version__}, {args.threads} thread(s), median of {args.repeats} interleaved repeats\n")
    print("| layout | torch `_foreach_norm` ms | optstack `norm_pows` ms | optstack / torch |")
    print("|---|---|---|---|")
    for label, (count, shape) in LAYOUTS.items():
        grads = [torch.randn(shape) for _ in range(count)]
        rows = {
            "torch": lambda grads=grads: bool(torch.stack(torch._foreach_norm(grads)).isfinite().all()),
            "optstack": lambda grads=grads: bool(norm_pows(grads, 2.0, cpu).isfinite().all()),
        }
        times: dict[str, list[float]] = {k: [] for k in rows}
        for fn in rows.values():
            fn()  # warm-up
        for _ in range(args.repeats):
            for key, fn in rows.items():
                start = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - start)
        t, o = (statistics.median(times[k]) * 1e3 for k in ("torch", "optstack"))
        same = torch.allclose(norm_pows(grads, 2.0, cpu).sum().sqrt(),
                              torch.stack(torch._foreach_norm(grads)).pow(2).sum().sqrt(), rtol=1e-5)
        print(f"| {label} | {t:.1f} | {o:.1f} | {o / t:.2f}{'' if same else ' (NORMS DIFFER)'} |")


if __name__ == "__main__":
    main()
