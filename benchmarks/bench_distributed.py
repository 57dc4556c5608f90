"""Data-parallel training step at size 2 on gloo: optstack (replicated, ZeRO-1 with and without overlap) vs
PyTorch DDP + AdamW, torch's ZeroRedundancyOptimizer, FSDP2 and DeepSpeed ZeRO-1 / ZeRO-2.

Run: .venv/bin/python benchmarks/bench_distributed.py [--quick] [--configs ddp optstack_zero1 ...]
     [--rounds 3] [--steps 15] [--warmup 5] [--bucket-mb 25] [--peers-python .venv-peers/bin/python]

Every configuration runs in two fresh processes (spawned here, FileStore rendezvous, gloo, one thread per
rank), so per-rank peak memory never mixes configurations. The model is an MLP of ``--layers`` x
Linear(``--hidden``) with biases and ReLUs (8 x 1536: 18.9M parameters), trained with AdamW (one group,
the same lr and weight decay for every parameter, no clipping) on MSE; each rank gets its own batch of
``--batch`` rows per step, the same in every configuration, so every configuration should follow DDP's loss
trajectory to fp32 round-off (the table shows the largest difference).

Columns:
- step ms: per step, the slowest rank's wall time for zero-grad + forward + backward + grad sync + optimizer
  step (all communication included; a parameter all-gather overlapped with the next forward is counted in
  that forward); the median over ``--steps`` steps after ``--warmup`` steps (with ``--rounds N``, every
  configuration runs N times, interleaved, and the median over rounds is shown, "best round" the fastest).
- CPU ms: per step, the CPU time of both ranks together (every thread, gloo's included): the work a step
  costs, which load from other processes on a shared machine inflates far less than wall time.
- peak RSS: each rank's peak resident memory (VmHWM), the larger of the two ranks; "+idle" is the peak
  minus the rank's memory right after ``init_process_group`` (Python, torch and gloo).
- state MB: per rank, the optimizer state tensors (AdamW's exp_avg and exp_avg_sq; the step counter is left
  out) plus 4 bytes for every fp32 element the optimizer steps (its master). With an fp32 model the master
  of DDP, torch ZeRO, FSDP2 and optstack is the (shard of the) parameter itself; DeepSpeed keeps a separate
  fp32 copy of its partition; either way 12 bytes per stepped element. "vs 12P/N" divides by the formula
  12 bytes x parameters / ranks: 1.00 is a perfect shard, 2.00 is fully replicated.
- final loss: the mean over ranks of the last step's loss; max |dloss|: the largest difference from DDP's
  loss over all steps.

The optstack rows are built as users build them: ``wrap_data_parallel(config, model)`` and
``build_optimizer(config, ddp, rules=[])`` with ``OptimizerConfig(algorithm="adamw", clip_grad=0.0,
distributed=DistributedConfig(sharding=..., overlap_grad_reduce=..., overlap_param_gather=...))``: the
``DataParallel`` wrapper over contiguous bucketed buffers, a ``Stage`` (placement Whole or Zero1) with
optstack's AdamW, in a ``ChainedOptimizer`` (clipping off; it still computes the global grad norm every
step, for ``StepResult.grad_norm``).
A second table gives the median time of each phase of the loop and, for optstack, of the named phases of the
step (``optstack.protocol.set_phase_hook``). DeepSpeed rows need ``deepspeed``: imported here when it can
be, else rerun under ``--peers-python`` (default ``.venv-peers/bin/python``; see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.util
import json
import os
import queue as queue_mod
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

CONFIGS: dict[str, str] = {
    "ddp": "PyTorch DDP + AdamW(fused)",
    "torch_zero": "torch ZeroRedundancyOptimizer(AdamW fused) + DDP",
    "fsdp2": "FSDP2 fully_shard + AdamW",
    "ds_zero1": "DeepSpeed ZeRO-1 + torch AdamW(fused)",
    "ds_zero2": "DeepSpeed ZeRO-2 + torch AdamW(fused)",
    "optstack_replicated": "optstack replicated (DataParallel + whole-parameter Stage)",
    "optstack_zero1": "optstack ZeRO-1, no overlap",
    "optstack_zero1_overlap_grad": "optstack ZeRO-1, overlapped grad reduce",
    "optstack_zero1_overlap": "optstack ZeRO-1, overlapped grad reduce + param gather",
}
BASELINE = "ddp"
STEP_PHASES = ["step:finish_grad_sync", "step:prepare_grads", "step:grad_norm", "step:clip", "step:inner_step",
               "step:publish_params", "step:param_gather"]
HYPER = {"lr": 1e-4, "weight_decay": 0.01}
REPO = Path(__file__).resolve().parent.parent


# -- the workload (identical in every configuration) ----------------------------------------------------
def build_model(hidden: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(hidden, hidden))
        if i < layers - 1:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def make_batches(rank: int, count: int, batch: int, hidden: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for step in range(count):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(batch, hidden, generator=gen)
        out.append((x, torch.sin(x.roll(1, dims=1))))
    return out


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, y)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # FSDP2 keeps DTensors


def state_bytes(optimizer: torch.optim.Optimizer, stepped: list[torch.Tensor]) -> int:
    """Moment tensors of ``optimizer`` plus 4 bytes (fp32 master) per element it steps; see the docstring."""
    elems = sum(_local(p).numel() for p in stepped)
    moments = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                moments += _local(value).numel() * value.element_size()
    return moments + 4 * elems


# -- one runner per configuration: step(x, y) returns the loss tensor; timed phases go to `timer` ----------
class Timer:
    """Accumulates wall time per phase name for the current step."""

    def __init__(self) -> None:
        self.now: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.now[name] = self.now.get(name, 0.0) + time.perf_counter() - start


class Runner:
    optimizer: torch.optim.Optimizer
    stepped: list[torch.Tensor]

    def step(self, x: torch.Tensor, y: torch.Tensor, t: Timer) -> torch.Tensor:
        raise NotImplementedError

    def finish(self) -> None:
        """Complete anything still in flight (e.g. an overlapped parameter gather)."""


class TorchRunner(Runner):
    """DDP, torch ZeRO and FSDP2: forward, backward (which reduces), ``step_optimizer.step()``.

    ``optimizer`` holds the state to count (torch ZeRO: its local optimizer over this rank's share)."""

    def __init__(self, module: nn.Module, step_optimizer: torch.optim.Optimizer,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        self.module, self.step_optimizer = module, step_optimizer
        self.optimizer = optimizer or step_optimizer
        self.stepped = [p for g in self.optimizer.param_groups for p in g["params"]]

    def step(self, x: torch.Tensor, y: torch.Tensor, t: Timer) -> torch.Tensor:
        with t("zero_grad"):
            self.step_optimizer.zero_grad(set_to_none=True)
        with t("forward"):
            loss = mse(self.module(x), y)
        with t("backward"):
            loss.backward()
        with t("optimizer"):
            self.step_optimizer.step()  # torch ZeRO: local step + broadcast of every rank's parameters
        return loss


def _torch_adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, fused=True, **HYPER)


def make_ddp(model: nn.Module, args: argparse.Namespace) -> Runner:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    return TorchRunner(ddp, _torch_adamw(ddp.parameters()))


def make_torch_zero(model: nn.Module, args: argparse.Namespace) -> Runner:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, fused=True, **HYPER)
    return TorchRunner(ddp, zero, zero.optim)


def make_fsdp2(model: nn.Module, args: argparse.Namespace) -> Runner:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return TorchRunner(model, _torch_adamw(model.parameters()))


class DeepSpeedRunner(Runner):
    """DeepSpeed ZeRO-1/2 over the initialised gloo world, with torch's fused AdamW as the base optimizer."""

    def __init__(self, model: nn.Module, args: argparse.Namespace, stage: int) -> None:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")  # reuses the initialised world
        bucket = int(args.bucket_mb * 2**20 // 4)
        config = {
            "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket,
                                  "allgather_bucket_size": bucket},
            "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0, "steps_per_print": 10**9,
        }
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=_torch_adamw(model.parameters()),
                                                    config=config)
        self.optimizer = self.engine.optimizer.optimizer  # the base optimizer over this rank's fp32 partition
        self.stepped = list(self.engine.optimizer.single_partition_of_fp32_groups)

    def step(self, x: torch.Tensor, y: torch.Tensor, t: Timer) -> torch.Tensor:
        with t("forward"):
            loss = mse(self.engine(x), y)
        with t("backward"):
            self.engine.backward(loss)
        with t("optimizer"):
            self.engine.step()  # reduce (ZeRO-2: during backward) + step + all-gather; zeroes the grads
        return loss


class OptstackRunner(Runner):
    """optstack as a user builds it: ``wrap_data_parallel`` + ``build_optimizer`` from one config."""

    def __init__(self, model: nn.Module, args: argparse.Namespace, *, sharding: str,
                 overlap: tuple[bool, bool]) -> None:
        """``overlap``: (overlap the grad reduction with backward, the param all-gather with forward)."""
        from optstack import DistributedConfig, OptimizerConfig, build_optimizer, wrap_data_parallel

        config = OptimizerConfig(
            algorithm="adamw", clip_grad=0.0, **HYPER,
            distributed=DistributedConfig(sharding=sharding, bucket_size=int(args.bucket_mb * 2**20 // 4),
                                          overlap_grad_reduce=overlap[0], overlap_param_gather=overlap[1]),
        )
        self.ddp = wrap_data_parallel(config, model)
        # rules=[]: one group, weight decay on every parameter, as the peers' single group
        self.chain = build_optimizer(config, self.ddp, rules=[]).optimizer
        (self.stage,) = self.chain.stages
        self.optimizer = self.stage.optimizer
        self.stepped = [p for g in self.optimizer.param_groups for p in g["params"]]

    def step(self, x: torch.Tensor, y: torch.Tensor, t: Timer) -> torch.Tensor:
        with t("zero_grad"):
            self.chain.zero_grad()  # zeroes the DataParallel grad buffers
        with t("forward"):
            loss = mse(self.ddp(x), y)
        with t("backward"):
            loss.backward()
        with t("optimizer"):
            self.chain.step()  # waits for the grad reduction first (phase finish_grad_sync)
        return loss

    def finish(self) -> None:
        self.chain.finish_param_sync()


MAKERS: dict[str, Callable[[nn.Module, argparse.Namespace], Runner]] = {
    "ddp": make_ddp,
    "torch_zero": make_torch_zero,
    "fsdp2": make_fsdp2,
    "ds_zero1": lambda m, a: DeepSpeedRunner(m, a, stage=1),
    "ds_zero2": lambda m, a: DeepSpeedRunner(m, a, stage=2),
    "optstack_replicated": lambda m, a: OptstackRunner(m, a, sharding="replicated", overlap=(True, False)),
    "optstack_zero1": lambda m, a: OptstackRunner(m, a, sharding="zero1", overlap=(False, False)),
    "optstack_zero1_overlap_grad": lambda m, a: OptstackRunner(m, a, sharding="zero1", overlap=(True, False)),
    "optstack_zero1_overlap": lambda m, a: OptstackRunner(m, a, sharding="zero1", overlap=(True, True)),
}


# -- the ranks -------------------------------------------------------------------------------------------
def _rss_mb(field: str = "VmRSS") -> float:
    """Resident memory of this process, MB (``VmHWM``: the peak since start or since ``_reset_peak``). Read
    from /proc: ``ru_maxrss`` would include the parent's memory from before ``exec``."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # Linux: reset VmHWM to the current RSS


def _run_one(name: str, rank: int, args: argparse.Namespace) -> dict[str, Any]:
    gc.collect()
    _reset_peak()
    idle = _rss_mb()
    model = build_model(args.hidden, args.layers)
    params = sum(p.numel() for p in model.parameters())
    runner = MAKERS[name](model, args)
    torch.set_num_threads(1)  # DeepSpeed's CPU accelerator may change it
    batches = make_batches(rank, args.warmup + args.steps, args.batch, args.hidden)
    hook_timer = Timer()
    from optstack.protocol import set_phase_hook

    set_phase_hook(hook_timer if name.startswith("optstack") else None)
    losses, phases = [], []
    for i, (x, y) in enumerate(batches):
        loop_timer = Timer()
        hook_timer.now = {}
        start, cpu = time.perf_counter(), time.process_time()
        loss = runner.step(x, y, loop_timer)
        total, cpu = time.perf_counter() - start, time.process_time() - cpu
        losses.append(float(loss.detach()))
        if i >= args.warmup:
            inner = {f"step:{k}": v for k, v in hook_timer.now.items()}
            phases.append({"total": total, "cpu": cpu, **loop_timer.now, **inner})
    runner.finish()
    set_phase_hook(None)
    return {"losses": losses, "phases": phases, "idle_mb": idle, "peak_mb": _rss_mb("VmHWM"),
            "state_bytes": state_bytes(runner.optimizer, runner.stepped), "params": params}


def _rank_main(rank: int, size: int, store: str, names: list[str], args: argparse.Namespace,
               out: Any) -> None:
    os.environ.update({"DS_ACCELERATOR": "cpu", "RANK": str(rank), "LOCAL_RANK": str(rank),
                       "WORLD_SIZE": str(size), "LOCAL_WORLD_SIZE": str(size)})
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, size), rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=args.timeout))
    for name in names:
        try:
            out.put((name, rank, _run_one(name, rank, args)))
        except BaseException:
            out.put((name, rank, {"error": traceback.format_exc()}))
            break  # the other rank may be stuck in a collective: the driver ends this world
    with contextlib.suppress(RuntimeError):  # the peer may be gone after a failure
        dist.barrier()
    out.close()
    out.join_thread()
    os._exit(0)  # a clean interpreter exit with torch and gloo loaded takes seconds


Results = dict[str, list[dict[str, Any]]]  # configuration -> per-rank results


def run_world(names: list[str], args: argparse.Namespace) -> tuple[Results, dict[str, str]]:
    """Run ``names`` one after another on one fresh 2-rank world. Returns the per-rank results of those that
    ran and the error of the one that failed (the world ends there; the caller may start another)."""
    ctx = mp.get_context("spawn")
    done: Results = {}
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-dist-") as tmp:
        out = ctx.Queue()
        procs = [ctx.Process(target=_rank_main, args=(r, 2, os.path.join(tmp, "store"), names, args, out))
                 for r in range(2)]
        for p in procs:
            p.start()
        got: dict[str, dict[int, dict[str, Any]]] = {}
        try:
            for name in names:
                deadline = time.monotonic() + args.timeout
                while len(got.get(name, {})) < 2:
                    try:
                        item, rank, res = out.get(timeout=max(1.0, deadline - time.monotonic()))
                    except queue_mod.Empty:
                        errors[name] = f"no result within {args.timeout} s"
                        return done, errors
                    if "error" in res:
                        errors[item] = f"rank {rank}:\n{res['error']}"
                        return done, errors
                    got.setdefault(item, {})[rank] = res
                done[name] = [got[name][0], got[name][1]]
                print(f"{name}: {summarize(name, done[name])['step_ms']:.0f} ms/step", flush=True)
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.1)
                if p.is_alive():
                    p.kill()
    return done, errors


def run_configs(names: list[str], args: argparse.Namespace) -> tuple[Results, dict[str, str]]:
    """Each configuration on its own fresh world (``--shared-world``: one world for all, starting a new one
    after a failure)."""
    done: Results = {}
    errors: dict[str, str] = {}
    todo = list(names)
    while todo:
        batch = todo if args.shared_world else todo[:1]
        ran, failed = run_world(batch, args)
        done |= ran
        errors |= failed
        todo = [n for n in todo if n not in done and n not in errors]
    return done, errors


# -- the driver -------------------------------------------------------------------------------------------
def _peers_python(args: argparse.Namespace) -> str | None:
    """``--peers-python`` when it can import deepspeed and optstack, else None."""
    exe = args.peers_python
    if not exe or not Path(exe).exists():
        return None
    probe = subprocess.run([exe, "-c", "import deepspeed, optstack"], capture_output=True,
                           env={**os.environ, "DS_ACCELERATOR": "cpu"}, timeout=300)
    return exe if probe.returncode == 0 else None


def run_in(python: str, names: list[str], args: argparse.Namespace) -> tuple[Results, dict[str, str]]:
    """Run ``names`` with this script under another interpreter (the peers' venv); results come as JSON."""
    with tempfile.TemporaryDirectory(prefix="bench-dist-") as tmp:
        path = os.path.join(tmp, "out.json")
        forward = [f"--{k.replace('_', '-')}={getattr(args, k)}"
                   for k in ("hidden", "layers", "batch", "warmup", "steps", "bucket_mb", "timeout")]
        forward.append("--shared-world" if args.shared_world else "--no-shared-world")
        proc = subprocess.run([python, __file__, *forward, "--configs", *names, "--json-out", path])
        if proc.returncode != 0 or not os.path.exists(path):
            return {}, {n: f"{python} exited with {proc.returncode}" for n in names}
        with open(path) as f:
            saved = json.load(f)
    return saved["done"], saved["errors"]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(name: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    steps = len(ranks[0]["phases"])
    total = [max(r["phases"][i]["total"] for r in ranks) for i in range(steps)]
    cpu = [sum(r["phases"][i]["cpu"] for r in ranks) for i in range(steps)]
    keys = sorted({k for r in ranks for p in r["phases"] for k in p if k not in ("total", "cpu")})
    phases = {k: _median([max(r["phases"][i].get(k, 0.0) for r in ranks) for i in range(steps)])
              for k in keys}
    losses = [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(len(ranks[0]["losses"]))]
    return {"name": name, "step_ms": 1e3 * _median(total), "cpu_ms": 1e3 * _median(cpu),
            "peak_mb": max(r["peak_mb"] for r in ranks),
            "extra_mb": max(r["peak_mb"] - r["idle_mb"] for r in ranks),
            "state_mb": max(r["state_bytes"] for r in ranks) / 2**20, "params": ranks[0]["params"],
            "losses": losses, "phases": {k: 1e3 * v for k, v in phases.items()}}


def combine(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the rounds of one configuration: medians over rounds (losses from the first round)."""
    row = dict(rounds[0])
    for key in ("step_ms", "cpu_ms", "peak_mb", "extra_mb"):
        row[key] = _median([r[key] for r in rounds])
    row["phases"] = {k: _median([r["phases"].get(k, 0.0) for r in rounds]) for k in rounds[0]["phases"]}
    row["rounds_ms"] = [r["step_ms"] for r in rounds]
    row["best_ms"] = min(row["rounds_ms"])
    return row


def print_tables(rows: list[dict[str, Any]], skipped: dict[str, str], args: argparse.Namespace) -> None:
    params = rows[0]["params"] if rows else 0
    formula_mb = 12 * params / 2 / 2**20
    base = next((r for r in rows if r["name"] == BASELINE), None)
    print(f"\nData-parallel size 2, gloo, 1 thread/rank; MLP {args.layers} x Linear({args.hidden}) = "
          f"{params / 1e6:.2f}M params, batch {args.batch}/rank, bucket {args.bucket_mb} MB; median of "
          f"{args.steps} steps after {args.warmup}"
          + (f", median of {args.rounds} interleaved rounds" if args.rounds > 1 else "")
          + f". Ratios vs {CONFIGS[BASELINE]} (< 1 is better). "
          f"Formula 12 B x params / 2 ranks = {formula_mb:.1f} MB."
          + (" Shared world: peak memory is reset per configuration, not exact." if args.shared_world else ""))
    print("\n| configuration | step ms | vs DDP | best round ms | CPU ms | vs DDP | peak RSS MB | +idle MB | vs DDP "
          "| state MB/rank | vs 12P/N | final loss | max abs dloss vs DDP |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio_t = f"{r['step_ms'] / base['step_ms']:.2f}" if base else "-"
        ratio_c = f"{r['cpu_ms'] / base['cpu_ms']:.2f}" if base else "-"
        ratio_m = f"{r['extra_mb'] / base['extra_mb']:.2f}" if base else "-"
        dloss = (f"{max(abs(a - b) for a, b in zip(r['losses'], base['losses'], strict=True)):.1e}"
                 if base else "-")
        print(f"| {CONFIGS[r['name']]} | {r['step_ms']:.0f} | {ratio_t} | {r['best_ms']:.0f} | "
              f"{r['cpu_ms']:.0f} | {ratio_c} | {r['peak_mb']:.0f} | "
              f"{r['extra_mb']:.0f} | {ratio_m} | {r['state_mb']:.1f} | {r['state_mb'] / formula_mb:.3f} | "
              f"{r['losses'][-1]:.6f} | {dloss} |")
    for name, why in skipped.items():
        print(f"| {CONFIGS[name]} | skipped: {why} |" + " |" * 11)
    keys = ["zero_grad", "forward", "backward", "optimizer"]
    seen = {k for r in rows for k in r["phases"] if k.startswith("step:")}
    step_keys = [k for k in STEP_PHASES if k in seen] + sorted(seen - set(STEP_PHASES))
    print("\nPhase medians, ms (slowest rank per step); step:* are optstack's named phases inside "
          "`optimizer` (inner_step includes publish_params and param_gather):\n")
    print("| configuration | " + " | ".join(keys + step_keys) + " |")
    print("|---|" + "---|" * (len(keys) + len(step_keys)))
    for r in rows:
        cells = [f"{r['phases'][k]:.1f}" if k in r["phases"] else "" for k in keys + step_keys]
        print(f"| {r['name']} | " + " | ".join(cells) + " |")
    if args.rounds > 1:
        print("\nStep ms per round:")
        for r in rows:
            print(f"  {r['name']:<28} " + " ".join(f"{v:.0f}" for v in r["rounds_ms"]))
    print("\nLoss per step (mean over ranks):")
    for r in rows:
        print(f"  {r['name']:<28} " + " ".join(f"{v:.6f}" for v in r["losses"]))
    checks = targets({r["name"]: r for r in rows}, formula_mb)
    if checks:
        print("\nTargets:\n" + "\n".join(f"- {c}" for c in checks))


def targets(by: dict[str, dict[str, Any]], formula_mb: float) -> list[str]:
    """The issue's targets, each MET / NOT MET on wall time and on CPU time, for the rows that ran."""
    def verdict(a: dict[str, Any], b: dict[str, Any], ok: Callable[[float, float], bool]) -> str:
        wall = "MET" if ok(a["step_ms"], b["step_ms"]) else "NOT MET"
        cpu = "MET" if ok(a["cpu_ms"], b["cpu_ms"]) else "NOT MET"
        return (f"{a['step_ms']:.0f} vs {b['step_ms']:.0f} ms: {wall}; CPU {a['cpu_ms']:.0f} vs "
                f"{b['cpu_ms']:.0f} ms: {cpu}")

    zero1 = [by[n] for n in ("optstack_zero1", "optstack_zero1_overlap_grad", "optstack_zero1_overlap") if n in by]
    out = []
    if zero1:
        best = min(zero1, key=lambda r: r["step_ms"])
        if BASELINE in by:
            out.append(f"optstack ZeRO-1 (fastest: {best['name']}) no slower than DDP + AdamW: "
                       + verdict(best, by[BASELINE], lambda a, b: a <= b))
        if "ds_zero1" in by:
            out.append(f"optstack ZeRO-1 (fastest: {best['name']}) faster than DeepSpeed ZeRO-1: "
                       + verdict(best, by["ds_zero1"], lambda a, b: a < b))
        worst = max(abs(r["state_mb"] / formula_mb - 1) for r in zero1)
        out.append(f"optstack ZeRO-1 state within 2% of 12 B x params / ranks (worst {100 * worst:.2f}%): "
                   f"{'MET' if worst <= 0.02 else 'NOT MET'}")
    if "optstack_zero1" in by and "optstack_zero1_overlap" in by:
        out.append("overlapped ZeRO-1 faster than non-overlapped: "
                   + verdict(by["optstack_zero1_overlap"], by["optstack_zero1"], lambda a, b: a < b))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                        help="rows to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="small model, few steps: a smoke test (< 1 min)")
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="rows per rank per step")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--bucket-mb", type=float, default=25.0,
                        help="gradient bucket size, MB of fp32 (torch DDP's default is 25)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every configuration this many times, interleaved, and take the median "
                             "(load from other processes then hits every configuration alike)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per configuration")
    default_peers = REPO / ".venv-peers" / "bin" / "python"
    parser.add_argument("--peers-python", default=str(default_peers) if default_peers.exists() else None,
                        help="interpreter with deepspeed installed, for the DeepSpeed rows")
    parser.add_argument("--shared-world", action=argparse.BooleanOptionalAction, default=None,
                        help="run every configuration on one 2-rank world (default with --quick: saves "
                             "the ~10 s start of each world; peak memory is reset per configuration, inexact)")
    parser.add_argument("--json-out", help=argparse.SUPPRESS)  # used when rerunning under --peers-python
    args = parser.parse_args(argv)
    if args.shared_world is None:
        args.shared_world = args.quick
    if args.quick:
        args.hidden, args.layers, args.warmup, args.steps = 256, 4, 2, 3
        args.bucket_mb = min(args.bucket_mb, 0.25)
    return args


def run_round(args: argparse.Namespace, peers: str | None) -> tuple[Results, dict[str, str]]:
    """Every configuration once (the DeepSpeed ones under ``peers`` when deepspeed does not import here)."""
    ds_here = importlib.util.find_spec("deepspeed") is not None
    here = [n for n in args.configs if ds_here or not n.startswith("ds_")]
    there = [n for n in args.configs if n not in here]
    done, errors = run_configs(here, args)
    if there and peers is not None:
        ran, failed = run_in(peers, there, args)
        done |= ran
        errors |= failed
    return done, errors


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    skipped: dict[str, str] = {}
    peers = None
    if importlib.util.find_spec("deepspeed") is None and any(n.startswith("ds_") for n in args.configs):
        peers = _peers_python(args)
        if peers is None:
            missing = [n for n in args.configs if n.startswith("ds_")]
            skipped = dict.fromkeys(missing, "deepspeed does not import (see benchmarks/README.md)")
            print(f"note: skipping {', '.join(missing)}: deepspeed imports neither here nor with "
                  f"--peers-python ({args.peers_python})", flush=True)
    rounds: dict[str, list[dict[str, Any]]] = {}
    errors: dict[str, str] = {}
    for index in range(args.rounds):
        if args.rounds > 1 and not args.json_out:
            print(f"-- round {index + 1} of {args.rounds}", flush=True)
        done, failed = run_round(args, peers)
        errors |= {name: f"(round {index + 1}) {err}" for name, err in failed.items()}
        for name, ranks in done.items():
            rounds.setdefault(name, []).append(summarize(name, ranks) if not args.json_out else ranks)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"done": {n: r[0] for n, r in rounds.items()}, "errors": errors}, f)
        return
    for name, err in errors.items():
        print(f"error: {name} failed {err}", flush=True)
        if name not in rounds:
            skipped[name] = "failed (error above)"
    rows = [combine(rounds[n]) for n in args.configs if n in rounds]
    print_tables(rows, {n: skipped[n] for n in args.configs if n in skipped}, args)
    if errors:
        sys.exit(1)


if __name__ == "__main__":
    main()
