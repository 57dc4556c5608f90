"""One prepared check of every CUDA path of optstack against its CPU result, and the speed table, on one GPU.

Run (one GPU, ~2-4 minutes, at most --time-limit s):
    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py | tee $OUT/gpu_check.md
Without CUDA it refuses in one line with exit status 2. The same code on CPU, tiny sizes (what CI runs):
    .venv/bin/python benchmarks/gpu_check.py --cpu-dry-run
Exit status: 0 every check passed, 1 a check failed (or the time limit hit), 2 no CUDA.

Checks (each trains a small model -- a linear layer, a (4, w, w) grouped-expert stack, an output layer -- for a
few steps through ``build_optimizer`` on the device and on the CPU from the same weights and batches, and
compares the parameters' change ``||d_dev - d_cpu|| / ||d_cpu||``; mixed precision compares the fp32 masters):
fused AdamW, SGD and Lion (``impl="auto"``: torch's fused kernels on CUDA), bf16 params with fp32 masters, fp16
with dynamic loss scaling (a non-finite step skipped and the scale backed off, as on the CPU), Muon (bf16
Newton-Schulz in fp32 trained; and one step with bf16 Newton-Schulz on the GPU against fp32 on the CPU, from
full-rank gradients, bounded by bf16's orthogonalisation error), CPU offload of half the AdamW state with
transfers on side streams and events, the data-parallel wrapper (replicated, ZeRO-1 with overlapped parameter
gather, ZeRO-1 Muon) on a 1-rank NCCL group, and a checkpoint saved, loaded into a fresh optimizer and continued
(equal to continuing the original).

Speed table: AdamW's step (the fused kernel alone, and the whole optimizer step with its grad-norm pass) as
achieved memory bandwidth (28 bytes per fp32 element: read p, g, m, v, write p, m, v; the whole step also
reads g once more for the norm: 32) against a measured device copy (``dst.copy_(src)``, read + write); Muon's
Newton-Schulz on a (16, 2048, 2048) stack and Muon's whole step, in TFLOP/s against the best measured bf16
matmul (8192^2 and batched 16 x 2048^2); offload: the step with transfers overlapped on side streams against
the same step with transfers in line.

The check functions (``check_*``, ``measure_*``) take a device and are importable (tests run them on CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

try:
    import optstack  # noqa: F401
except ImportError:  # a bare checkout (the GPU machine): use the source tree next to this script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from optstack import (
    DistributedConfig,
    LossScaleConfig,
    MuonConfig,
    OffloadConfig,
    OptimizerConfig,
    build_optimizer,
    wrap_data_parallel,
)
from optstack.algorithms import get_algorithm
from optstack.algorithms._common import resolve_impl
from optstack.algorithms.newton_schulz import newton_schulz, ns_matmul_dtype
from optstack.checkpoint import load_checkpoint, save_checkpoint

CPU = torch.device("cpu")
STEPS = 5


@dataclass
class Check:
    """One path's result: the relative difference of the device run from the CPU run, and its bound."""

    name: str
    diff: float
    tol: float
    note: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.diff <= self.tol


@dataclass
class Measure:
    """One speed figure against a measured reference (``ratio = achieved / reference``)."""

    name: str
    achieved: float
    reference: float
    unit: str
    target: float | None = None
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.achieved / self.reference if self.reference else math.nan


# ----------------------------------------------------------------------------------------------------------
# A small model and its training loop


class Net(nn.Module):
    """Linear -> tanh -> a grouped-expert stack (experts, width, width) mixed -> tanh -> Linear."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(32, width)
        self.experts = nn.Parameter(torch.randn(4, width, width) / math.sqrt(width))
        self.out = nn.Linear(width, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(torch.tanh(torch.einsum("eoi,bi->bo", self.experts, h) / 2))


def _batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 32, generator=gen).to(device), torch.randn(8, 16, generator=gen).to(device)


@dataclass
class Run:
    """What a training run leaves: the parameters before and after (fp32, on CPU), the fp32 masters after,
    each step's ``(applied, loss_scale)``."""

    before: list[torch.Tensor]
    after: list[torch.Tensor]
    masters: list[torch.Tensor]
    steps: list[tuple[bool, float]] = field(default_factory=list)


def _cpu(tensors: Any) -> list[torch.Tensor]:
    return [t.detach().float().cpu().clone() for t in tensors]


def train(config: OptimizerConfig, device: torch.device, *, steps: int = STEPS, wrap: bool = False,
          poison: int | None = None, model: nn.Module | None = None, built: Any = None,
          start: int = 0) -> tuple[Run, nn.Module, Any]:
    """Train ``Net`` (or ``model``) on ``device`` in ``config.precision`` for ``steps`` steps from batch
    ``start``; ``wrap``: through ``wrap_data_parallel``; ``poison``: the step whose loss is made infinite."""
    if model is None:
        model = Net().to(device=device, dtype=config.param_dtype)
    target = wrap_data_parallel(config, model) if wrap else model
    if built is None:
        built = build_optimizer(config, target)
    optimizer = built.optimizer
    before = _cpu(model.parameters())
    run = Run(before, [], [])
    for step in range(start, start + steps):
        x, y = _batch(step, device)
        if wrap:
            target.zero_grad_buffer()
        else:
            optimizer.zero_grad()
        loss = ((target(x.to(config.param_dtype)).float() - y) ** 2).mean()
        if step == poison:
            loss = loss * math.inf
        optimizer.scale_loss(loss).backward()
        if wrap:
            target.finish_grad_sync()
        optimizer.step()
        optimizer.finish_param_sync()
        result = optimizer.last_result
        run.steps.append((bool(result.applied), float(result.loss_scale)))
    run.after = _cpu(model.parameters())
    run.masters = _cpu(m for stage in optimizer.stages for m in stage.master_params)
    return run, model, built


def change_diff(dev: Run, cpu: Run, *, masters: bool = False) -> float:
    """``||d_dev - d_cpu|| / ||d_cpu||`` over all parameters, ``d`` the change of the run (of the fp32 masters
    when ``masters``: their error against the CPU's over the size of the CPU run's change of the parameters)."""
    moved = math.sqrt(sum(float((a - b).square().sum()) for a, b in zip(cpu.after, cpu.before, strict=True)))
    pairs = zip(dev.masters, cpu.masters, strict=True) if masters else zip(dev.after, cpu.after, strict=True)
    error = math.sqrt(sum(float((a - b).square().sum()) for a, b in pairs))
    return error / max(moved, 1e-30)


def _against_cpu(name: str, config: OptimizerConfig, device: torch.device, tol: float, *,
                 cpu_config: OptimizerConfig | None = None, masters: bool = False, note: str = "",
                 **kwargs: Any) -> Check:
    dev, _, _ = train(config, device, **kwargs)
    cpu, _, _ = train(cpu_config or config, CPU, poison=kwargs.get("poison"))
    if dev.steps != cpu.steps:
        return Check(name, math.inf, tol, note, f"step results differ: device {dev.steps}, CPU {cpu.steps}")
    return Check(name, change_diff(dev, cpu, masters=masters), tol, note)


# ----------------------------------------------------------------------------------------------------------
# Checks


def check_algorithm(algorithm: str, device: torch.device) -> Check:
    """AdamW / SGD / Lion at ``impl="auto"`` (fused on CUDA for AdamW and SGD, foreach for Lion)."""
    config = OptimizerConfig(algorithm=algorithm, lr=1e-2 if algorithm != "lion" else 1e-3)
    impl = resolve_impl("auto", device, has_fused=algorithm in ("adamw", "sgd"))
    return _against_cpu(f"{algorithm} fp32 (impl {impl})", config, device, 1e-4)


def check_bf16_masters(device: torch.device) -> Check:
    """bf16 parameters, fp32 masters (AdamW): the masters against the CPU's."""
    config = OptimizerConfig(algorithm="adamw", lr=1e-2, precision="bf16")
    return _against_cpu("bf16 params + fp32 masters (adamw)", config, device, 3e-2, masters=True)


def check_fp16_dynamic_scaling(device: torch.device) -> Check:
    """fp16 with dynamic loss scaling: step 2's infinite loss skips the step and halves the scale on both."""
    config = OptimizerConfig(algorithm="adamw", lr=1e-2, precision="fp16",
                             loss_scale=LossScaleConfig(mode="dynamic", initial=2.0**16, hysteresis=1))
    check = _against_cpu("fp16 + dynamic loss scale (adamw)", config, device, 3e-2, masters=True, poison=2)
    dev, _, _ = train(config, device, poison=2)
    if check.ok and (dev.steps[2][0] or dev.steps[3][1] >= dev.steps[1][1]):
        check.error = f"the poisoned step was not skipped with the scale backed off: {dev.steps}"
    check.note = "applied, scale per step: " + " ".join(f"{int(a)},{s:g}" for a, s in dev.steps)
    return check


def check_muon(device: torch.device) -> Check:
    """Muon (2-D and the (4, w, w) expert stack) with fp32 Newton-Schulz, trained on the device and on CPU."""
    config = OptimizerConfig(algorithm="muon", lr=2e-2, muon=MuonConfig(matmul_precision="highest"))
    return _against_cpu("muon fp32 NS (3-D experts)", config, device, 1e-3)


def check_muon_bf16(device: torch.device) -> Check:
    """One Muon step at "medium" (bf16 Newton-Schulz where native) on the device against fp32 on the CPU, from
    the same random full-rank gradients: the orthogonalisation error of bf16 (a few training steps would
    compound it through the gradients; tests/test_muon_3d.py bounds the same error on CPU)."""
    gen = torch.Generator().manual_seed(7)
    shapes = [(4, 256, 256), (256, 512), (512, 256)]
    values = [torch.randn(*s, generator=gen) for s in shapes]
    grads = [torch.randn(*s, generator=gen) for s in shapes]
    moved = []
    for where, precision in ((device, "medium"), (CPU, "highest")):
        params = [nn.Parameter(v.to(where, copy=True)) for v in values]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.to(where)
        get_algorithm("muon").cls(params, lr=1e-2, matmul_precision=precision).step()
        moved.append([p.detach().cpu() - v for p, v in zip(params, values, strict=True)])
    dev, cpu = moved
    error = math.sqrt(sum(float((a - b).square().sum()) for a, b in zip(dev, cpu, strict=True)))
    size = math.sqrt(sum(float(b.square().sum()) for b in cpu))
    dtype = str(ns_matmul_dtype("medium", device)).removeprefix("torch.")
    return Check("muon one step, NS at 'medium' vs fp32 CPU", error / size, 3e-2, f"device NS dtype {dtype}")


def check_offload(device: torch.device) -> Check:
    """Half of AdamW's state on the host, transfers on side streams with events, against the CPU run."""
    config = OptimizerConfig(algorithm="adamw", lr=1e-2,
                             offload=OffloadConfig(enabled=True, fraction=0.5, overlap_transfers=True))
    return _against_cpu("offload 0.5 + overlapped transfers (adamw)", config, device, 1e-4,
                        cpu_config=OptimizerConfig(algorithm="adamw", lr=1e-2))


@contextlib.contextmanager
def one_rank_group(device: torch.device) -> Iterator[str]:
    """A 1-rank process group (NCCL on CUDA, gloo on CPU) through a file store, destroyed afterwards."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield backend
        finally:
            dist.destroy_process_group()


def check_data_parallel(device: torch.device) -> list[Check]:
    """The data-parallel wrapper on a 1-rank NCCL group: replicated AdamW, ZeRO-1 AdamW with overlapped
    parameter gather, ZeRO-1 Muon (whole matrices), each against the CPU run without the wrapper."""
    cases = [
        ("replicated adamw", OptimizerConfig(algorithm="adamw", lr=1e-2), 1e-4),
        ("zero1 adamw + overlapped gather", OptimizerConfig(
            algorithm="adamw", lr=1e-2, distributed=DistributedConfig(sharding="zero1", overlap_param_gather=True)),
         1e-4),
        ("zero1 muon (whole matrices)", OptimizerConfig(
            algorithm="muon", lr=2e-2, muon=MuonConfig(matmul_precision="highest"),
            distributed=DistributedConfig(sharding="zero1")), 1e-4),
    ]
    checks = []
    with one_rank_group(device) as backend:
        for name, config, tol in cases:
            checks.append(_guarded(f"data parallel ({backend}, 1 rank): {name}", lambda c=config, t=tol, n=name:
                                   _dp_case(n, c, t, device, backend)))
    return checks


def _dp_case(name: str, config: OptimizerConfig, tol: float, device: torch.device, backend: str) -> Check:
    dev, _, _ = train(config, device, wrap=True)
    cpu, _, _ = train(config.with_changes(distributed=DistributedConfig()), CPU)
    return Check(f"data parallel ({backend}, 1 rank): {name}", change_diff(dev, cpu), tol)


def check_checkpoint(device: torch.device) -> Check:
    """Save after 3 steps, load into a fresh model and optimizer, continue 2 steps: equal to continuing the
    original (to the bit), and near the CPU run."""
    config = OptimizerConfig(algorithm="adamw", lr=1e-2, precision="bf16")
    with tempfile.TemporaryDirectory() as tmp:
        _, model, built = train(config, device, steps=3)
        save_checkpoint(tmp, built.optimizer, step=3, model=model)
        continued, _, _ = train(config, device, steps=2, model=model, built=built, start=3)
        fresh = Net().to(device=device, dtype=config.param_dtype)
        fresh_built = build_optimizer(config, fresh)
        load_checkpoint(tmp, fresh_built.optimizer, model=fresh)
        resumed, _, _ = train(config, device, steps=2, model=fresh, built=fresh_built, start=3)
    diff = max(float((a - b).abs().max()) for a, b in zip(continued.masters, resumed.masters, strict=True))
    return Check("checkpoint save/load/continue (bf16 adamw)", diff, 0.0, "resumed vs continued masters, max |diff|")


def _guarded(name: str, run: Callable[[], Check]) -> Check:
    """``run()``, or a failed check carrying the error."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 -- one failing path must not hide the others' results
        traceback.print_exc(file=sys.stderr)
        return Check(name, math.inf, 0.0, error=f"{type(exc).__name__}: {str(exc)[:160]}")


def all_checks(device: torch.device) -> list[Check]:
    checks = [_guarded(f"{a} fp32", lambda a=a: check_algorithm(a, device)) for a in ("adamw", "sgd", "lion")]
    for fn in (check_bf16_masters, check_fp16_dynamic_scaling, check_muon, check_muon_bf16, check_offload):
        checks.append(_guarded(fn.__name__, lambda fn=fn: fn(device)))
    try:
        checks += check_data_parallel(device)
    except Exception as exc:  # noqa: BLE001 -- the group could not be made: one failed row
        checks.append(Check("data parallel (1-rank group)", math.inf, 0.0, error=f"{type(exc).__name__}: {exc}"))
    checks.append(_guarded("checkpoint", lambda: check_checkpoint(device)))
    return checks


# ----------------------------------------------------------------------------------------------------------
# Speed


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after ``warmup`` (the device synchronised around each)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _time_copy(device: torch.device, numel: int, reps: int) -> float:
    src, dst = torch.randn(numel, device=device), torch.empty(numel, device=device)
    return timed(functools.partial(dst.copy_, src), device, reps)


def _time_matmul(device: torch.device, shape: tuple[int, ...], reps: int) -> float:
    a, b = (torch.randn(*shape, device=device, dtype=torch.bfloat16) for _ in range(2))
    return timed(functools.partial(torch.matmul, a, b), device, reps)


def measure_adamw_bandwidth(device: torch.device, numel: int, reps: int) -> list[Measure]:
    """AdamW's step as bytes moved per second against a measured ``copy_`` of ``numel`` fp32 elements."""
    copy_bw = 8 * numel / _time_copy(device, numel, reps)
    n = 16
    params = [nn.Parameter(torch.randn(numel // n, device=device)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn_like(p)
    kernel = get_algorithm("adamw").cls(params, lr=1e-3)
    kernel_bw = 28 * numel / timed(kernel.step, device, reps)
    del kernel
    built = build_optimizer(OptimizerConfig(algorithm="adamw", lr=1e-3), [(f"p{i}", p) for i, p in enumerate(params)],
                            rules=[])
    whole_bw = 32 * numel / timed(built.optimizer.step, device, reps)
    gb = 1e9
    return [Measure("AdamW fused kernel, achieved bandwidth", kernel_bw / gb, copy_bw / gb, "GB/s", 0.85,
                    f"{numel / 2**20:g} Mi fp32 elements, 28 B/element"),
            Measure("AdamW whole optimizer step (norm + step)", whole_bw / gb, copy_bw / gb, "GB/s", None,
                    "32 B/element")]


def measure_muon(device: torch.device, batch: int, size: int, big: int, reps: int) -> list[Measure]:
    """Newton-Schulz (bf16 where native) on a (batch, size, size) stack and Muon's whole step, in TFLOP/s,
    against the best of a bf16 (big x big) matmul and a bf16 batched (batch, size, size) one."""
    flop = 1e12
    mm = 2 * big**3 / _time_matmul(device, (big, big), reps)
    bmm = batch * 2 * size**3 / _time_matmul(device, (batch, size, size), reps)
    peak = max(mm, bmm)
    ns_flops = batch * 5 * 6 * size**3  # X X^T, A A, B X per step (square matrices), 5 steps
    dtype = ns_matmul_dtype("medium", device)
    x = torch.randn(batch, size, size, device=device)
    ns = ns_flops / timed(lambda: newton_schulz(x, matmul_dtype=dtype), device, reps)
    param = nn.Parameter(torch.randn(batch, size, size, device=device))
    param.grad = torch.randn_like(param)
    muon = get_algorithm("muon").cls([param], lr=1e-3)
    step = ns_flops / timed(muon.step, device, reps)
    note = f"({batch}, {size}, {size}) fp32 params, NS in {str(dtype).removeprefix('torch.')}"
    return [Measure("Muon Newton-Schulz", ns / flop, peak / flop, "TFLOP/s", 0.70, note),
            Measure("Muon whole step", step / flop, peak / flop, "TFLOP/s", None, note)]


def measure_offload_overlap(device: torch.device, numel: int, reps: int) -> list[Measure]:
    """The step with half of AdamW's state on the host: transfers overlapped on side streams vs in line
    (achieved = steps per second overlapped, reference = in line; > 1 when overlap helps)."""
    times = {}
    for overlap in (False, True):
        params = [nn.Parameter(torch.randn(numel // 8, device=device)) for _ in range(8)]
        for p in params:
            p.grad = torch.randn_like(p)
        config = OptimizerConfig(algorithm="adamw", lr=1e-3,
                                 offload=OffloadConfig(enabled=True, fraction=0.5, overlap_transfers=overlap))
        built = build_optimizer(config, [(f"p{i}", p) for i, p in enumerate(params)], rules=[])
        times[overlap] = timed(built.optimizer.step, device, reps)
    return [Measure("offload 0.5: step speed, overlapped vs in-line transfers", 1 / times[True], 1 / times[False],
                    "steps/s", None, f"{numel / 2**20:g} Mi fp32 elements; in-line {times[False] * 1e3:.1f} ms, "
                    f"overlapped {times[True] * 1e3:.1f} ms")]


def all_measures(device: torch.device, *, small: bool) -> list[Measure]:
    reps = 3 if small else 10
    sizes = dict(numel=2**16, batch=2, size=64, big=128) if small else dict(numel=2**28, batch=16, size=2048,
                                                                                  big=8192)
    out: list[Measure] = []
    for fn in (lambda: measure_adamw_bandwidth(device, sizes["numel"], reps),
               lambda: measure_muon(device, sizes["batch"], sizes["size"], sizes["big"], reps),
               lambda: measure_offload_overlap(device, sizes["numel"] // 4, reps)):
        try:
            out += fn()
        except Exception as exc:  # noqa: BLE001 -- report the rest
            traceback.print_exc(file=sys.stderr)
            out.append(Measure(f"(failed: {type(exc).__name__}: {str(exc)[:120]})", math.nan, math.nan, ""))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------------------------------------


def print_tables(device_name: str, checks: list[Check], measures: list[Measure]) -> None:
    print(f"\n## optstack GPU check on {device_name}, torch {torch.__version__}\n")
    print("| check (device vs CPU) | rel. diff of the change | bound | result | note |")
    print("|---|---:|---:|---|---|")
    for c in checks:
        result = "ok" if c.ok else f"FAIL {c.error}".strip()
        print(f"| {c.name} | {c.diff:.2e} | {c.tol:.0e} | {result} | {c.note} |")
    print("\n| measure | achieved | measured reference | ratio | target | note |")
    print("|---|---:|---:|---:|---:|---|")
    for m in measures:
        target = "" if m.target is None else f">= {m.target:.0%}"
        print(f"| {m.name} | {m.achieved:.4g} {m.unit} | {m.reference:.4g} {m.unit} | {m.ratio:.2f} | {target} "
              f"| {m.note} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-dry-run", action="store_true", help="run everything on CPU at tiny sizes")
    parser.add_argument("--time-limit", type=float, default=450.0, help="seconds before giving up (exit 1)")
    args = parser.parse_args(argv)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (torch.cuda.is_available() is False); nothing checked. "
              "Run on a GPU machine, or --cpu-dry-run to exercise the script on CPU.", file=sys.stderr)
        return 2
    device = CPU if args.cpu_dry_run else torch.device("cuda", torch.cuda.current_device())
    name = "CPU (dry run)" if device.type == "cpu" else torch.cuda.get_device_name(device)
    if hasattr(signal, "SIGALRM"):
        def give_up(*_: Any) -> None:
            print(f"gpu_check: time limit of {args.time_limit:.0f} s reached", file=sys.stderr, flush=True)
            os._exit(1)
        signal.signal(signal.SIGALRM, give_up)
        signal.alarm(max(1, int(args.time_limit)))
    t0 = time.perf_counter()
    checks = all_checks(device)
    measures = all_measures(device, small=device.type == "cpu")
    print_tables(name, checks, measures)
    print(f"\n{sum(c.ok for c in checks)}/{len(checks)} checks passed in {time.perf_counter() - t0:.0f} s")
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
