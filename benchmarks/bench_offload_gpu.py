"""CPU offload of AdamW state on one GPU: peak device memory and step time at offload fraction 0, 0.5 and 1,
with and without overlapped transfers, and equality with the non-offloaded run.

Run (one GPU):   python3 benchmarks/bench_offload_gpu.py            # ~1B parameters, a few minutes
                 python3 benchmarks/bench_offload_gpu.py --small    # ~17M parameters, seconds
Check the script without a GPU (the same code path on a tiny model, "device" = CPU):
                 .venv/bin/python benchmarks/bench_offload_gpu.py --cpu-dry-run
On a lent GPU machine, as one prepared command (its python3 holds torch; the script finds src/ itself):
   PYTHONUNBUFFERED=1 python3 benchmarks/bench_offload_gpu.py --small &&
   PYTHONUNBUFFERED=1 python3 benchmarks/bench_offload_gpu.py --json $OUT/offload.json | tee $OUT/offload.md
Exit status: 0 all variants equal to round-off, 1 a variant differs, 2 no CUDA.

The model is a stack of bias-free ``Linear(width, width)`` layers in bf16 (``--width 4096 --layers 60``:
1.007e9 parameters), trained by ``build_optimizer`` with ``precision='bf16'`` (fp32 masters) and AdamW. Every
variant starts from the same weights and sees the same batches. Rows:

- ``plain``: offload disabled (the reference);
- ``f=F``: ``OffloadConfig(enabled=True, fraction=F)``, ``+overlap`` with ``overlap_transfers=True``.

Columns: host elements (offloaded share), peak device memory (``torch.cuda.max_memory_allocated`` over
building the optimizer and training) and its ratio to ``plain``; the median optimizer step and the median
whole iteration (forward + backward + step), each with its ratio to ``plain``; the median host time inside
the step (host AdamW steps, from the phase hook); and the largest difference of the fp32 masters and of the
bf16 parameters from ``plain`` after the run (host and device AdamW kernels differ in the last bits: "equal"
means every master is within rtol 1e-5 / atol 1e-7 of the reference).

What offload saves on the device: the optimizer state and the fp32 masters of the offloaded share (12 bytes per
element for AdamW; the precision stage keeps those masters in pinned host memory); their gradients are copied
to the host each step.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

try:
    import optstack  # noqa: F401
except ImportError:  # a bare checkout (the GPU machine): use the source tree next to this script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from optstack.config import OffloadConfig, OptimizerConfig
from optstack.factory import build_optimizer
from optstack.protocol import set_phase_hook

VARIANTS: list[tuple[str, OffloadConfig]] = [
    ("plain", OffloadConfig()),
    ("f=0", OffloadConfig(enabled=True, fraction=0.0)),
    ("f=0.5", OffloadConfig(enabled=True, fraction=0.5)),
    ("f=0.5+overlap", OffloadConfig(enabled=True, fraction=0.5, overlap_transfers=True)),
    ("f=1", OffloadConfig(enabled=True, fraction=1.0)),
    ("f=1+overlap", OffloadConfig(enabled=True, fraction=1.0, overlap_transfers=True)),
]


@dataclass
class Result:
    name: str
    params: int
    host_elements: int
    peak_bytes: int | None
    step_ms: float
    iter_ms: float
    host_ms: float
    master_diff: float = 0.0
    param_diff: float = 0.0
    equal: bool = True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _HostTimer:
    """Phase hook: wall time of the host AdamW steps (``host_step``) within one optimizer step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start


def _model(width: int, layers: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False, device=device, dtype=torch.bfloat16)
                            for _ in range(layers)])
    with torch.no_grad():  # variance-preserving init, so the deep linear stack has usable gradients
        for layer in model:
            layer.weight.normal_(0.0, width**-0.5)
    return model


def _batches(width: int, batch: int, steps: int, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(batch, width, generator=g).to(device, torch.bfloat16) for _ in range(steps)]


def _masters(built) -> dict[str, torch.Tensor]:
    return {n: s.tensors["param"] for stage in built.optimizer.stages for n, s in stage.param_shards().items()}


def run_variant(name: str, offload: OffloadConfig, args: argparse.Namespace, device: torch.device,
                batches: list[torch.Tensor]) -> tuple[Result, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Build and train one variant; returns its result and (masters, parameters), both on the device."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = _model(args.width, args.layers, device)
    cfg = OptimizerConfig(algorithm="adamw", lr=1e-4, weight_decay=0.1, precision="bf16", clip_grad=1.0,
                          offload=offload)
    built = build_optimizer(cfg, model)
    timer = _HostTimer()
    step_s, iter_s, host_s = [], [], []
    for index, x in enumerate(batches):
        _sync(device)
        start = time.perf_counter()
        built.optimizer.zero_grad()
        model(x).float().pow(2).mean().backward()
        _sync(device)
        before_step = time.perf_counter()
        timer.seconds.clear()
        set_phase_hook(timer)
        try:
            built.optimizer.step()
            result = built.optimizer.last_result
        finally:
            set_phase_hook(None)
        _sync(device)
        end = time.perf_counter()
        if not result.applied:
            raise RuntimeError(f"{name}: step {index} was skipped (non-finite gradient)")
        if index >= args.warmup:
            step_s.append(end - before_step)
            iter_s.append(end - start)
            host_s.append(timer.seconds["host_step"])
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    stage_optimizer = built.optimizer.stages[0].optimizer
    host_elements = sum(t.numel() for t in getattr(stage_optimizer, "host_tensors", []))
    masters = {n: t.detach().clone() for n, t in _masters(built).items()}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    total = sum(p.numel() for p in model.parameters())
    del built, model, stage_optimizer
    gc.collect()
    ms = 1e3
    return (Result(name, total, host_elements, peak, statistics.median(step_s) * ms,
                   statistics.median(iter_s) * ms, statistics.median(host_s) * ms), masters, params)


def compare(result: Result, masters: dict[str, torch.Tensor], params: dict[str, torch.Tensor],
            ref_masters: dict[str, torch.Tensor], ref_params: dict[str, torch.Tensor]) -> None:
    """Fill the difference columns (tensor by tensor, on the variant's device; references in host memory)."""
    for name, ref in ref_masters.items():
        got = masters[name]
        want = ref.to(got.device)
        result.master_diff = max(result.master_diff, (got - want).abs().max().item())
        result.equal &= bool(torch.allclose(got, want, rtol=1e-5, atol=1e-7))
    for name, ref in ref_params.items():
        got = params[name].float()
        result.param_diff = max(result.param_diff, (got - ref.to(got.device).float()).abs().max().item())


def table(results: list[Result]) -> str:
    base = results[0]

    def ratio(value: float | None, ref: float | None) -> str:
        return f"{value / ref:.2f}" if value is not None and ref else "n/a"

    def gib(value: int | None) -> str:
        return f"{value / 2**30:.2f}" if value is not None else "n/a"

    lines = ["| variant | host elements | peak device GiB | x plain | step ms | x plain | iteration ms | x plain "
             "| host step ms | max master diff | max param diff | equal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        share = f"{r.host_elements / r.params:.0%}" if r.params else "0%"
        cells = [r.name, f"{r.host_elements:,} ({share})", gib(r.peak_bytes), ratio(r.peak_bytes, base.peak_bytes),
                 f"{r.step_ms:.1f}", ratio(r.step_ms, base.step_ms), f"{r.iter_ms:.1f}",
                 ratio(r.iter_ms, base.iter_ms), f"{r.host_ms:.1f}", f"{r.master_diff:.2e}", f"{r.param_diff:.2e}",
                 "yes" if r.equal else "NO"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="~17M parameters (width 1024, 16 layers)")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="run the script's logic on a tiny model on the CPU (no GPU needed)")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=7, help="steps per variant, warmup included")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.small:
        args.width, args.layers = 1024, 16
    if args.cpu_dry_run:
        args.width, args.layers, args.batch, args.steps, args.warmup = 64, 4, 4, 3, 1
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("bench_offload_gpu: CUDA is not available, and this benchmark measures device memory and step "
              "time on one GPU. Run it on a GPU machine, or with --cpu-dry-run to check the script on the CPU.",
              file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    if args.warmup >= args.steps:
        parser.error(f"--warmup ({args.warmup}) must be < --steps ({args.steps})")

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"
    print(f"# CPU offload of AdamW state: {where}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"{torch.get_num_threads()} torch threads")
    print(f"model: {args.layers} x Linear({args.width}, {args.width}) bf16 = "
          f"{args.layers * args.width**2:,} parameters; batch {args.batch}; {args.steps} steps per variant, "
          f"medians over the last {args.steps - args.warmup}\n", flush=True)
    batches = _batches(args.width, args.batch, args.steps, device)
    results: list[Result] = []
    ref_masters: dict[str, torch.Tensor] = {}
    ref_params: dict[str, torch.Tensor] = {}
    for name, offload in VARIANTS:
        result, masters, params = run_variant(name, offload, args, device, batches)
        if not results:  # the reference stays in host memory, so it does not count in later peaks
            ref_masters = {n: t.cpu() for n, t in masters.items()}
            ref_params = {n: t.cpu() for n, t in params.items()}
        else:
            compare(result, masters, params, ref_masters, ref_params)
        del masters, params
        gc.collect()
        results.append(result)
        print(f"  {name}: step {result.step_ms:.1f} ms, peak "
              f"{'n/a' if result.peak_bytes is None else f'{result.peak_bytes / 2**30:.2f} GiB'}", flush=True)
    print()
    print(table(results))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    if not all(r.equal for r in results):
        print("\nFAILED: an offloaded run differs from the plain run beyond round-off", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
