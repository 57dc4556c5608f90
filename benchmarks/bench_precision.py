"""Mixed-precision step (bf16 params, fp32 masters) vs the fp32 step, both through the chained optimizer with
torch's fused AdamW as the inner optimizer.

Run: .venv/bin/python benchmarks/bench_precision.py [--params-m 20] [--tensors 20] [--steps 10]
     [--threads 2] [--device cpu|cuda]

A step here is the whole ``ChainedOptimizer.step()``: prepare grads (mixed: copy bf16 grads into the fp32
masters' grads), the fused non-finite check and unscale, the global grad norm, the inner AdamW step, and
(mixed) rounding the masters back into the bf16 params. The phase columns come from the phase hook. The
GB/s column (median step) counts the least bytes a step must move: fp32 AdamW >= 28 B/param (param, grad,
two moments); mixed adds the grad copy (2 B read, 4 B written) and the copy back (4 B read, 2 B written).
Variants are interleaved step by step; the min column is the uncontended figure on a shared machine.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator

import torch

from optstack.optimizer import ChainedOptimizer
from optstack.protocol import set_phase_hook
from optstack.stage import replicated_stage

PHASES = ("prepare_grads", "grad_norm", "inner_step", "publish_params")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(mode: str, numel: int, tensors: int, device: torch.device) -> ChainedOptimizer:
    dtype = torch.float32 if mode == "fp32" else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    rows = numel // tensors // 1024
    params = []
    for _ in range(tensors):
        param = torch.nn.Parameter(torch.randn(rows, 1024, generator=gen, device=device).to(dtype) * 0.02)
        param.grad = (torch.randn(rows, 1024, generator=gen, device=device) * 1e-3).to(dtype)
        params.append(param)
    groups = [{"params": params, "param_names": [f"layer{i}.weight" for i in range(tensors)]}]

    def adamw(inner_groups: list[dict]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(inner_groups, lr=1e-4, weight_decay=0.1, fused=True)

    stage = replicated_stage(groups, adamw, masters=mode != "fp32")
    return ChainedOptimizer([stage], clip_grad=1.0)


def measure(
    chains: dict[str, ChainedOptimizer], steps: int, device: torch.device
) -> dict[str, dict[str, float]]:
    """Median milliseconds of the step and of each phase, per variant. The variants' steps are interleaved
    so that a burst of load from elsewhere hits them alike; grads are kept, so every step is a full one."""
    current = ""
    phase_times: dict[tuple[str, str], list[float]] = defaultdict(list)

    @contextlib.contextmanager
    def timer(name: str) -> Iterator[None]:
        _sync(device)
        t0 = time.perf_counter()
        yield
        _sync(device)
        phase_times[current, name].append(time.perf_counter() - t0)

    for chain in chains.values():
        chain.step()  # warm-up: creates optimizer state
    step_times: dict[str, list[float]] = defaultdict(list)
    set_phase_hook(timer)
    try:
        for _ in range(steps):
            for current, chain in chains.items():
                _sync(device)
                t0 = time.perf_counter()
                chain.step()
                result = chain.last_result
                _sync(device)
                step_times[current].append(time.perf_counter() - t0)
                assert result.applied
    finally:
        set_phase_hook(None)
    out = {}
    for mode in chains:
        row = {"step": statistics.median(step_times[mode]) * 1e3, "min": min(step_times[mode]) * 1e3}
        for name in PHASES:
            times = phase_times[mode, name]
            row[name] = statistics.median(times) * 1e3 if times else 0.0
        out[mode] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params-m", type=float, default=20.0, help="millions of parameters")
    parser.add_argument("--tensors", type=int, default=20)
    parser.add_argument(
        "--steps", type=int, default=10, help="timed steps per variant (after 1 warm-up), interleaved"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    numel = int(args.params_m * 1e6) // (args.tensors * 1024) * args.tensors * 1024

    chains = {mode: build(mode, numel, args.tensors, device) for mode in ("fp32", "bf16 + fp32 masters")}
    results = measure(chains, args.steps, device)

    base, base_min = results["fp32"]["step"], results["fp32"]["min"]
    print(
        f"\n{numel / 1e6:.1f}M params in {args.tensors} tensors, {args.device}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, median of {args.steps} steps\n"
    )
    # publish_params runs inside inner_step; show the inner optimizer's own time next to it
    labels = ["prepare_grads ms", "grad_norm ms", "inner AdamW ms", "publish_params ms"]
    header = "| mode | median step ms | vs fp32 | min step ms | vs fp32 | " + " | ".join(labels) + " | GB/s |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for mode, row in results.items():
        bytes_moved = numel * (28 if mode == "fp32" else 28 + 6 + 6)
        row["inner_step"] -= row["publish_params"]
        phases = " | ".join(f"{row[p]:.1f}" for p in PHASES)
        print(
            f"| {mode} | {row['step']:.1f} | {row['step'] / base:.2f}x | {row['min']:.1f} | "
            f"{row['min'] / base_min:.2f}x | {phases} | "
            f"{bytes_moved / (row['step'] / 1e3) / 1e9:.1f} |"
        )


if __name__ == "__main__":
    main()
