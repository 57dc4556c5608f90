"""Bytes per parameter of the whole training state, measured from the live tensors, against Megatron's formulas.

Run:  PYTHONPATH=src .venv/bin/python benchmarks/bench_memory.py            # dp = 1, 2, 4 (gloo, spawned ranks)
      PYTHONPATH=src .venv/bin/python benchmarks/bench_memory.py --dp 1 2 --width 512

Each rank builds ``wrap_data_parallel`` + ``build_optimizer`` (ZeRO-1, AdamW) over a stack of ``Linear(width,
width)`` layers, takes one step (state is created lazily) and adds up the storages (``untyped_storage().nbytes()``,
each storage once) of everything the training state holds between steps: the model's parameters and gradients,
the data-parallel parameter and gradient buffers, the stages' masters / remainders / fp32 gradient copies, and
every optimizer state tensor. Divided by the model's parameter count, that is compared with the formula of
Megatron's distributed-optimizer table (``d`` = data-parallel size), per rank (rank 0; the ranks agree):

- ``fp32``: fp32 params + grads, fp32 moments                                          8 + 8/d
- ``bf16 + fp32 masters``: bf16 params, fp32 grad buffers, fp32 masters and moments    6 + 12/d
- ``+ remainders``: the masters as int16 remainders (``masters.store_remainders``)     6 + 10/d
- ``+ bf16 moments``: ``adam.exp_avg_dtype = exp_avg_sq_dtype = 'bf16'``                6 + 6/d
- ``+ bf16 grads``: bf16 gradient buffers read as they are (``masters.grad_dtype``)     4 + 6/d
- ``+ remainders + 8-bit moments``: ``adam.exp_avg_dtype = exp_avg_sq_dtype = '8bit'``
  (codes 1 B + an fp32 scale per 256-element block, each moment), fp32 grads            6 + (4 + 8/256)/d

``step ms`` is the median ``optimizer.step()`` time of a few more steps on rank 0 and its ratio to the row
above it: the step-time cost of each option (CPU, noisy on shared cores: read the ratios). The last column
is what the optimizer still holds on the device after ``offload_states()`` (masters, moments, gradient
copies, staging scratch, in bytes): 0, else the run fails.

Not counted (printed apart): AdamW's reused fp32 staging scratch for low-precision tensors (a fixed
4 x 2^20 x 4 B = 16 MiB per device, whatever the model size), and the remainders' fp32 workspace, which exists
only during a step (freed between steps; measured here as 0).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

ROWS = {  # name -> (config changes, formula(d))
    "fp32": ({"precision": "fp32"}, lambda d: 8 + 8 / d),
    "bf16 + fp32 masters": ({"grad_dtype": "fp32"}, lambda d: 6 + 12 / d),
    "+ remainders": ({"grad_dtype": "fp32", "remainders": True}, lambda d: 6 + 10 / d),
    "+ bf16 moments": ({"grad_dtype": "fp32", "remainders": True, "moments": "bf16"}, lambda d: 6 + 6 / d),
    "+ bf16 grads": ({"grad_dtype": "bf16", "remainders": True, "moments": "bf16", "bf16_grads": True},
                     lambda d: 4 + 6 / d),
    # 8-bit moments: 1 B per element each + one fp32 scale per block each (the masters as remainders, fp32 grads)
    "+ remainders + 8-bit moments": ({"grad_dtype": "fp32", "remainders": True, "moments": "8bit"},
                                     lambda d: 6 + (2 + 2 + 8 / BLOCK) / d),
}
BLOCK = 256  # adam.block_size of the 8-bit row


def _config(row: dict):
    from optstack.config import AdamConfig, DistributedConfig, MastersConfig, OptimizerConfig

    return OptimizerConfig(
        lr=1e-3, precision=row.get("precision", "bf16"),
        distributed=DistributedConfig(sharding="zero1", grad_dtype=row.get("grad_dtype")),
        masters=MastersConfig(store_remainders=row.get("remainders", False),
                              grad_dtype="bf16" if row.get("bf16_grads") else "fp32"),
        adam=AdamConfig(exp_avg_dtype=row.get("moments", "fp32"), exp_avg_sq_dtype=row.get("moments", "fp32"),
                        block_size=BLOCK))


def measure(width: int, layers: int, row: dict, steps: int = 5) -> dict[str, float]:
    """One step of the row's stack on this rank; bytes of its live state by kind, per model parameter."""
    from optstack.factory import build_optimizer, wrap_data_parallel
    from optstack.offload.states import scratch_of

    config = _config(row)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    model = model.to(torch.float32 if config.precision == "fp32" else torch.bfloat16)
    wrapped = wrap_data_parallel(config, model)
    optimizer = build_optimizer(config, wrapped).optimizer
    x = torch.randn(4, width, dtype=next(model.parameters()).dtype)
    wrapped(x).float().square().mean().backward()
    optimizer.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    seen: set[int] = set()

    def nbytes(tensors) -> int:
        total = 0
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
        return total

    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    buffers = wrapped.param_and_grad_buffers
    out = {"params": nbytes([b.param_data for b in buffers] + params),
           "grads": nbytes([b.grad_data for b in buffers] + [p.grad for p in params])}
    def owned() -> tuple[int, int, int, int]:
        masters = copies = state = scratch = 0
        for stage in optimizer.stages:
            masters += nbytes(stage.precision.held())
            copies += nbytes(stage.precision.scratch())
            state += nbytes(v for s in stage.optimizer.state.values() for v in s.values())
            scratch += nbytes(scratch_of(stage.optimizer))
        return masters, copies, state, scratch

    masters, copies, state, scratch = owned()
    out.update(masters=masters, grad_copies=copies, moments=state)
    per_param = {k: v / numel for k, v in out.items()}
    per_param["total"] = sum(out.values()) / numel
    per_param["scratch_mib"] = scratch / 2**20
    optimizer.offload_states()  # everything the optimizer owns leaves the device (host copies not counted)
    seen.clear()
    per_param["offloaded"] = sum(owned())
    optimizer.reload_states()
    per_param["step_ms"] = 1e3 * statistics.median(times) if times else float("nan")
    return per_param


def _rank(rank: int, size: int, store: str, width: int, layers: int, steps: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, size), rank=rank, world_size=size,
                            timeout=timedelta(seconds=120))
    try:
        rows = {name: measure(width, layers, row, steps) for name, (row, _) in ROWS.items()}
        if rank == 0:
            results.put(rows)
    finally:
        dist.destroy_process_group()


def run(dp: int, width: int, layers: int, steps: int) -> dict[str, dict[str, float]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(dp, os.path.join(tmp, "store"), width, layers, steps, results), nprocs=dp,
                           start_method="spawn")
    return results.get(timeout=10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row")
    args = parser.parse_args()
    print(f"{args.layers} x Linear({args.width}, {args.width}), ZeRO-1 AdamW; bytes per parameter on rank 0\n")
    print("| row | dp | params | grads | masters | fp32 grad copies | moments | measured | formula | diff | step ms "
          "| optimizer bytes after offload_states |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    scratch = set()
    for dp in args.dp:
        previous = None
        for name, rows in run(dp, args.width, args.layers, args.steps).items():
            formula = ROWS[name][1](dp)
            got = rows["total"]
            diff = 100 * (got - formula) / formula
            worst = max(worst, abs(diff))
            scratch.add(rows["scratch_mib"])
            cells = " | ".join(f"{rows[k]:.3f}" for k in ("params", "grads", "masters", "grad_copies", "moments"))
            ratio = f" ({rows['step_ms'] / previous:.2f}x)" if previous else ""
            previous = rows["step_ms"]
            left = rows["offloaded"]
            worst = max(worst, 100.0 * (left != 0))  # everything the optimizer owns must leave the device
            print(f"| {name} | {dp} | {cells} | {got:.3f} | {formula:.3f} | {diff:+.2f}% | {previous:.1f}{ratio} "
                  f"| {left:.0f} |")
    print(f"\nlargest |diff|: {worst:.2f}%; fixed AdamW staging scratch per rank (not per parameter, not counted): "
          f"{sorted(scratch)} MiB")
    return 0 if worst <= 2.0 else 1


if __name__ == "__main__":
    sys.exit(main())
