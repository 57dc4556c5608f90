"""Muon step time: optstack's Muon vs torch.optim.Muon at the same Newton-Schulz precision, on 8 x (1024 x 1024)
matrices and on one grouped-expert (16, 512, 512) stack; and layer-wise Muon at 2 gloo ranks vs one rank.

Run: .venv/bin/python benchmarks/bench_muon.py [--steps 3] [--threads 2] [--include-torch] [--include-reference]
     .venv/bin/python benchmarks/bench_muon.py --layerwise [--steps 3]

Precision: optstack's default ``matmul_precision="medium"`` runs Newton-Schulz in bf16 where the CPU multiplies
bf16 natively (AVX512-BF16 / AMX) and in fp32 elsewhere (``newton_schulz.ns_matmul_dtype``); the dtype it picked
is printed. torch.optim.Muon always runs Newton-Schulz in bf16; to compare at the same precision on a CPU
without bf16, its Newton-Schulz function is swapped for the same code with its one ``.bfloat16()`` cast made
``.float()`` (the row says so). ``--include-torch`` also times the unmodified bf16 torch.optim.Muon there
(``--torch-steps`` steps; tens of times slower without bf16 hardware). torch.optim.Muon takes 2-D parameters
only: for the (16, 512, 512) case it gets the 16 matrices as 16 parameters.

Rates: the Newton-Schulz matmul FLOPs of a step (the step's cost; the element-wise work is <1%) divided by the
step's time, against the best matmul rate measured here per dtype at the same size ((n x n) @ (n x n), and
batched for the stack), best of ~1 s of repetitions (a peak, robust to other processes sharing the cores).
Variants are timed interleaved (one step each in turn) so load from other processes hits all alike.

``--layerwise``: Muon over 8 x (512 x 512) matrices built from a config at 2 gloo ranks (spawned, FileStore, one
thread each), ``sharding="layerwise"`` (gradients all-reduced, each matrix broadcast by its owner) and
``sharding="zero1"`` (whole-shard buffers: gradients reduce-scattered into whole matrices, all-gathered), vs the
replicated optimizer in one process (one thread); the Newton-Schulz phase is the ``inner_step`` phase
(``optstack.protocol.set_phase_hook``), wall and CPU time, and the whole synchronisation plus step
(``finish_grad_sync()`` + ``optimizer.step()``, which publishes), wall, the slowest rank; the final parameters are
compared.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from optstack.algorithms.muon import Muon, muon_reference
from optstack.algorithms.newton_schulz import ns_matmul_dtype

HYPER: dict[str, Any] = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01)
NS_STEPS = 5


def ns_flops(rows: int, cols: int, ns_steps: int) -> float:
    """Matmul FLOPs of Newton-Schulz on one (rows, cols) matrix: X X^T, A A and B X per step (small side)."""
    m, n = min(rows, cols), max(rows, cols)
    return ns_steps * (2 * m * m * n + 2 * m**3 + 2 * m * m * n)


def matmul_peak_gflops(size: int, dtype: torch.dtype, batch: int | None = None,
                       budget_s: float = 1.0) -> tuple[float, float]:
    """Best rate of ``(size x size) @ (size x size)`` (``batch`` of them with ``torch.bmm``) in ``dtype`` over
    ~``budget_s`` of repetitions (one when a single one takes longer: slow dtypes), per wall second and per CPU
    second of this process (the latter robust to other processes' load)."""
    shape = (size, size) if batch is None else (batch, size, size)
    a, b = torch.randn(*shape).to(dtype), torch.randn(*shape).to(dtype)
    t0, c0 = time.perf_counter(), time.process_time()
    a @ b  # warm up (and time once: a slow dtype stops here)
    best, best_cpu = time.perf_counter() - t0, time.process_time() - c0
    deadline = time.perf_counter() + budget_s
    while best < budget_s / 4 and time.perf_counter() < deadline:
        t0, c0 = time.perf_counter(), time.process_time()
        a @ b
        best, best_cpu = min(best, time.perf_counter() - t0), min(best_cpu, time.process_time() - c0)
    flops = (batch or 1) * 2 * size**3 / 1e9
    return flops / best, flops / max(best_cpu, 1e-9)


def time_interleaved(
    variants: dict[str, tuple[Callable[[], None], int, bool]],
) -> dict[str, list[tuple[float, float]]]:
    """Time ``{name: (step, timed_steps, warm_up)}`` in rounds of one step per variant in turn, so that load
    from other processes hits every variant alike and the ratios stay fair: ``(wall, CPU)`` seconds per step
    (the CPU time of all this process's threads: the work, which other processes' load inflates far less)."""
    for step, _, warm_up in variants.values():
        if warm_up:
            step()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for r in range(max(count for _, count, _ in variants.values())):
        for name, (step, count, _) in variants.items():
            if r < count:
                t0, c0 = time.perf_counter(), time.process_time()
                step()
                times[name].append((time.perf_counter() - t0, time.process_time() - c0))
    return times


@contextlib.contextmanager
def torch_ns_in(dtype: torch.dtype) -> Iterator[None]:
    """torch.optim.Muon with its Newton-Schulz in ``dtype``: its own function (bf16), or the same code with the
    one bf16 cast made ``dtype``."""
    from torch.optim import _muon

    original = _muon._zeropower_via_newtonschulz
    if dtype == torch.bfloat16:
        yield
        return

    def same_code_in_dtype(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                           eps: float) -> torch.Tensor:
        a, b, c = ns_coefficients
        ortho = grad.to(dtype)
        if grad.size(0) > grad.size(1):
            ortho = ortho.T
        ortho.div_(ortho.norm().clamp(min=eps))
        for _ in range(ns_steps):
            gram = ortho @ ortho.T
            update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            ortho = torch.addmm(ortho, update, ortho, beta=a)
        return ortho.T if grad.size(0) > grad.size(1) else ortho

    _muon._zeropower_via_newtonschulz = same_code_in_dtype
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz = original


def run_case(title: str, shapes: list[tuple[int, ...]], args: argparse.Namespace) -> None:
    """Time optstack's Muon over parameters of ``shapes`` (2-D, or 3-D stacks) against torch.optim.Muon over
    the same matrices as 2-D parameters, and print the table."""
    torch.manual_seed(0)
    init = [torch.randn(*s) for s in shapes]
    grads = [torch.randn(*s) for s in shapes]
    *_, rows, cols = shapes[0]
    matrices = sum(math.prod(s[:-2]) for s in shapes)
    ns_dtype = ns_matmul_dtype("medium", torch.device("cpu"))
    dtype_name = str(ns_dtype).removeprefix("torch.")

    def params(split: bool) -> list[torch.nn.Parameter]:
        values = [m for t in init for m in (t.unbind(0) if split and t.ndim == 3 else [t])]
        gs = [m for t in grads for m in (t.unbind(0) if split and t.ndim == 3 else [t])]
        ps = [torch.nn.Parameter(v.clone()) for v in values]
        for p, g in zip(ps, gs, strict=True):
            p.grad = g.clone()
        return ps

    ours = params(split=False)
    opt = Muon(ours, extra_scale_factor=0.2, matmul_precision="medium", **HYPER)
    ours_name = f"optstack Muon (NS {dtype_name})"
    variants: dict[str, tuple[Callable[[], None], int, bool]] = {ours_name: (opt.step, args.steps, True)}

    theirs = params(split=True)
    topt = torch.optim.Muon(theirs, adjust_lr_fn="match_rms_adamw", **HYPER)

    def torch_same() -> None:
        with torch_ns_in(ns_dtype):
            topt.step()

    same_note = "" if ns_dtype == torch.bfloat16 else ", its NS code in fp32"
    variants[f"torch.optim.Muon (NS {dtype_name}{same_note})"] = (torch_same, args.steps, True)
    if args.include_torch and ns_dtype != torch.bfloat16:
        tbf16 = torch.optim.Muon(params(split=True), adjust_lr_fn="match_rms_adamw", **HYPER)
        variants["torch.optim.Muon (NS bf16, as shipped)"] = (tbf16.step, args.torch_steps, False)
    if args.include_reference:
        ref = [p.detach() for p in params(split=False)]
        bufs = [torch.zeros_like(p) for p in ref]

        def reference_step() -> None:
            for p, g, b in zip(ref, grads, bufs, strict=True):
                muon_reference(p, g, b, ns_steps=NS_STEPS, coefficients="quintic", scale_mode="spectral",
                               extra_scale_factor=0.2, **HYPER)

        variants["plain per-matrix reference loop (fp32)"] = (reference_step, args.steps, True)

    batch = matrices if any(len(s) == 3 for s in shapes) else None
    size = min(rows, cols)
    measured = [(dtype, matmul_peak_gflops(size, dtype, batch=b)) for dtype in (torch.float32, torch.bfloat16)
                for b in ([None] if batch is None else [None, batch])]
    results = time_interleaved(variants)
    measured.append((torch.float32, matmul_peak_gflops(size, torch.float32, batch=batch)))  # again, after
    peaks = {d: max(r[0] for dt, r in measured if dt == d) for d in (torch.float32, torch.bfloat16)}
    cpu_peaks = {d: max(r[1] for dt, r in measured if dt == d) for d in (torch.float32, torch.bfloat16)}
    best, best_cpu = max(peaks.values()), max(cpu_peaks.values())
    flops = matrices * ns_flops(rows, cols, NS_STEPS)
    base = statistics.median(w for w, _ in results[ours_name])
    base_cpu = statistics.median(c for _, c in results[ours_name])
    print(f"\n### {title}: {matrices} matrices ({rows} x {cols}), {NS_STEPS} NS steps, {args.threads} threads, "
          f"torch {torch.__version__}")
    print("matmul peak measured here: " + ", ".join(
        f"{str(d).removeprefix('torch.')} {r:.1f} GFLOP/s ({cpu_peaks[d]:.1f} per CPU s)" for d, r in peaks.items())
          + f"; NS work per step {flops / 1e9:.1f} GFLOP; optstack's NS dtype: {dtype_name}\n")
    print(f"| variant | s / step (median of {args.steps}) | GFLOP/s | % of {dtype_name} matmul peak "
          "| % of best matmul peak | time vs optstack | CPU s / step | CPU time vs optstack "
          "| % of best peak per CPU s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, times in results.items():
        t, c = statistics.median(w for w, _ in times), statistics.median(c for _, c in times)
        rate = flops / t / 1e9
        print(f"| {name} | {t:.3f} | {rate:.1f} | {100 * rate / peaks[ns_dtype]:.0f}% | {100 * rate / best:.0f}% "
              f"| {t / base:.2f}x | {c:.3f} | {c / base_cpu:.2f}x | {100 * flops / c / 1e9 / best_cpu:.0f}% |")


# ----------------------------------------------------------------------------------------------------------
# Layer-wise at 2 ranks


def _layerwise_run(rank: int, size: int, store: str, steps: int, out: Any, sharding: str) -> None:
    import torch.distributed as dist

    from optstack import DistributedConfig, OptimizerConfig, build_optimizer, wrap_data_parallel
    from optstack.protocol import set_phase_hook

    torch.set_num_threads(1)
    if size > 1:
        dist.init_process_group("gloo", store=dist.FileStore(store, size), rank=rank, world_size=size)
    config = OptimizerConfig(algorithm="muon", lr=0.02, distributed=DistributedConfig(sharding=sharding))
    torch.manual_seed(0)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(512, 512)) for _ in range(8)])
    # each rank's loss sum(W_i * R_i) has gradient R_i; one process gets the ranks' mean
    grads = [[torch.randn(512, 512, generator=torch.Generator().manual_seed(100 * r + i)) for i in range(8)]
             for r in range(2)]
    mine = grads[rank] if size > 1 else [(a + b) / 2 for a, b in zip(*grads, strict=True)]
    ddp = wrap_data_parallel(config, model) if size > 1 else model
    optimizer = build_optimizer(config, ddp).optimizer
    wall: list[float] = []
    cpu: list[float] = []
    whole: list[float] = []  # finish_grad_sync + step

    @contextlib.contextmanager
    def timer(name: str) -> Iterator[None]:
        t0, c0 = time.perf_counter(), time.thread_time()
        yield
        if name == "inner_step":
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)

    set_phase_hook(timer)
    for _ in range(steps + 1):
        if size > 1:
            ddp.zero_grad_buffer()
        else:
            model.zero_grad()
        sum((w * g).sum() for w, g in zip(ddp.module if size > 1 else model, mine, strict=True)).backward()
        t0 = time.perf_counter()
        if size > 1:
            ddp.finish_grad_sync()
        optimizer.step()
        whole.append(time.perf_counter() - t0)
    # As bytes: a tensor sent through the queue shares its storage by file descriptor, which dies with this process.
    buffer = io.BytesIO()
    torch.save(torch.cat([p.detach().reshape(-1) for p in model]), buffer)
    out.put((rank, statistics.median(wall[1:]), statistics.median(cpu[1:]), statistics.median(whole[1:]),
             buffer.getvalue()))
    if size > 1:
        dist.destroy_process_group()


def run_layerwise(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results: dict[tuple[int, str], list[tuple[int, float, float, float, torch.Tensor]]] = {}
    runs = [(1, "replicated")] + [(2, s) for s in ("layerwise", "zero1")] * args.rounds  # interleaved rounds
    for size, sharding in runs:
        with tempfile.TemporaryDirectory() as tmp:
            queue = ctx.Queue()
            procs = [ctx.Process(target=_layerwise_run,
                                 args=(r, size, os.path.join(tmp, "store"), args.steps, queue, sharding))
                     for r in range(size)]
            for p in procs:
                p.start()
            got = sorted(queue.get(timeout=600) for _ in procs)
            for p in procs:
                p.join()
            # per run, the slowest rank's figures; over rounds, their medians
            slowest = (max(r[1] for r in got), max(r[2] for r in got), max(r[3] for r in got))
            params = torch.load(io.BytesIO(got[0][4]), weights_only=True)
            diff = max((torch.load(io.BytesIO(r[4]), weights_only=True) - params).abs().max().item() for r in got)
            results.setdefault((size, sharding), []).append((*slowest, params, diff))
    (wall1, cpu1, step1, params1, _), = results[(1, "replicated")]
    print(f"\n### Distributed Muon, 8 x (512 x 512), fp32, gloo, one thread per rank, {args.steps} timed steps, "
          f"{args.rounds} round(s)")
    print("| run | NS phase wall s | NS phase CPU s | sync + step wall s | NS speed-up (wall) | sync + step vs 1 rank "
          "| max diff vs 1 rank |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(f"| 1 rank, replicated | {wall1:.3f} | {cpu1:.3f} | {step1:.3f} | 1.00x | 1.00x | - |")
    for sharding in ("layerwise", "zero1"):
        rows = results[(2, sharding)]
        wall, cpu, step = (statistics.median(r[i] for r in rows) for i in range(3))
        diff = max(max(r[4], (r[3] - params1).abs().max().item()) for r in rows)
        print(f"| 2 ranks, {sharding} | {wall:.3f} | {cpu:.3f} | {step:.3f} | {wall1 / wall:.2f}x | "
              f"{step / step1:.2f}x | {diff:.2e} |")
    print("\n(the slowest rank of each run; zero1 reduce-scatters whole matrices into their owners' shards and "
          "all-gathers, layerwise all-reduces and broadcasts)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (after 1 warm-up)")
    parser.add_argument("--include-torch", action="store_true",
                        help="also time torch.optim.Muon as shipped (bf16 NS) where optstack's NS is fp32")
    parser.add_argument("--torch-steps", type=int, default=1, help="timed steps of torch.optim.Muon as shipped")
    parser.add_argument("--include-reference", action="store_true", help="also time the per-matrix reference loop")
    parser.add_argument("--layerwise", action="store_true",
                        help="distributed Muon (layerwise, zero1) at 2 gloo ranks vs one rank")
    parser.add_argument("--rounds", type=int, default=1, help="--layerwise: runs per 2-rank sharding, interleaved")
    args = parser.parse_args()
    if args.layerwise:
        run_layerwise(args)
        return
    torch.set_num_threads(args.threads)
    run_case("8 x 1024^2", [(1024, 1024)] * 8, args)
    run_case("grouped experts [16, 512, 512]", [(16, 512, 512)], args)


if __name__ == "__main__":
    main()
