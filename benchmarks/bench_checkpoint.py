"""Checkpoint save and load: optstack vs torch.distributed.checkpoint (DCP) of a plain AdamW state.

A ~50M-parameter fp32 model on 2 gloo processes (one thread each), one AdamW step taken so the moments
exist. Side by side, in one run:

- ``DCP, torch AdamW``: ``torch.optim.AdamW`` replicated on both ranks, ``get_state_dict(model, optim)``
  saved with ``dcp.save`` over the process group (DCP writes each replicated tensor once), loaded with
  ``dcp.load`` + ``set_state_dict``: model weights + ``exp_avg`` + ``exp_avg_sq`` + steps.
- ``optstack ZeRO-1``: ``save_checkpoint`` / ``load_checkpoint`` of the ZeRO-1 stack (each rank writes its
  ranges; the fp32 ``param`` is the model weight itself): the same numbers, plus CRC-32 checksums of every
  file, a sealed manifest, the atomic rename and the ``latest`` pointer. The load verifies every checksum
  and reads everything before applying anything.
- ``optstack ZeRO-1 + model``: also the model's state dict (the weights a second time, as a user asking for
  the model tensors gets them).

With ``--params N``, the model is instead N tiny tensors (4 x 4, MoE-like experts): what is measured is the
per-tensor cost (planning, the manifest, DCP's per-item records), not bandwidth. ``--sharding`` picks the
optstack layout (replicated by default there: the ZeRO-1 build of 50,000 parameters is slow on its own).

With ``--async-save``, instead: how long the trainer is blocked by an asynchronous save, beside a blocking
save of the same state, for optstack (ZeRO-1: ``save_checkpoint(..., blocking=False)`` until it returns, then
until ``handle.wait()``) and DCP (torch AdamW: ``dcp.async_save`` over a gloo group of its own until it
returns, then until its future is done), all in one run. "blocked" is the slowest rank's time from a barrier
until the call returns; "total" until the checkpoint is committed on every rank.

Times are the slowest rank's, best of ``--repeat``, with a warm page cache (the files were just written).

    .venv/bin/python benchmarks/bench_checkpoint.py [--width 2500 --layers 8 --repeat 2]
    .venv/bin/python benchmarks/bench_checkpoint.py --params 50000 --repeat 1 --no-dcp
    .venv/bin/python benchmarks/bench_checkpoint.py --async-save --repeat 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD = 2


class _Experts(nn.Module):
    """``n`` tiny expert tensors: the shape of a checkpoint dominated by per-tensor costs."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.experts = nn.ParameterList([nn.Parameter(torch.randn(4, 4)) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.stack(list(self.experts)) @ x).square().mean()


def _model(width: int, layers: int, params: int | None = None) -> nn.Module:
    torch.manual_seed(0)
    if params is not None:
        return _Experts(params)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _backward(model: nn.Module, width: int) -> None:
    gen = torch.Generator().manual_seed(1)
    if isinstance(getattr(model, "module", model), _Experts):
        model(torch.randn(4, 1, generator=gen)).backward()
        return
    x = torch.randn(4, width, generator=gen)
    model(x).square().mean().backward()


def _timed(fn: Any, *args: Any, **kwargs: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn(*args, **kwargs)
    dist.barrier()
    return time.perf_counter() - start


def _bytes(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def _dcp_baseline(width: int, layers: int, root: Path, repeat: int, params: int | None) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _model(width, layers, params)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _backward(model, width)
    optim.step()
    saves, loads = [], []
    for i in range(repeat):
        path = root / f"dcp-{i}"
        model_sd, optim_sd = get_state_dict(model, optim)
        saves.append(_timed(dcp.save, {"model": model_sd, "optim": optim_sd}, checkpoint_id=path))
        loads.append(_timed(_dcp_load, model, optim, path))
    size, files = _bytes(root / "dcp-0")
    return {"save": min(saves), "load": min(loads), "bytes": size, "files": files}


def _dcp_load(model: nn.Module, optim: torch.optim.Optimizer, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _optstack(width: int, layers: int, root: Path, repeat: int, with_model: bool, params: int | None,
              sharding: str) -> dict[str, float]:
    from optstack.checkpoint import load_checkpoint, save_checkpoint
    from optstack.config import DistributedConfig, OptimizerConfig
    from optstack.factory import build_optimizer, wrap_data_parallel

    config = OptimizerConfig(lr=1e-3, clip_grad=0.0, distributed=DistributedConfig(sharding=sharding))
    model = _model(width, layers, params)
    wrapped = wrap_data_parallel(config, model)
    start = time.perf_counter()
    optimizer = build_optimizer(config, wrapped).optimizer
    build = time.perf_counter() - start
    _backward(wrapped, width)
    optimizer.step()
    saves, loads = [], []
    tag = "model" if with_model else "optim"
    for i in range(repeat):
        path = root / f"optstack-{tag}-{i}"
        extra = {"model": model} if with_model else {}
        saves.append(_timed(save_checkpoint, path, optimizer, step=1, **extra))
        loads.append(_timed(load_checkpoint, path, optimizer, **extra))
    size, files = _bytes(root / f"optstack-{tag}-0")
    return {"save": min(saves), "load": min(loads), "bytes": size, "files": files, "build": build}


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _blocked(start_save: Any, finish: Any) -> tuple[float, float]:
    """(slowest rank's seconds until ``start_save()`` returns, until ``finish(its result)`` returns on all)."""
    dist.barrier()
    start = time.perf_counter()
    pending = start_save()
    blocked = time.perf_counter() - start
    finish(pending)
    total = time.perf_counter() - start
    dist.barrier()
    return _slowest(blocked), _slowest(total)


def _async_rows(width: int, layers: int, root: Path, repeat: int) -> dict[str, dict[str, float]]:
    """The trainer's blocked time for blocking and asynchronous saves, optstack ZeRO-1 and DCP (module doc)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from optstack.checkpoint import save_checkpoint
    from optstack.config import DistributedConfig, OptimizerConfig
    from optstack.factory import build_optimizer, wrap_data_parallel

    rows: dict[str, dict[str, list[float]]] = {}

    def add(name: str, times: tuple[float, float]) -> None:
        row = rows.setdefault(name, {"blocked": [], "total": []})
        row["blocked"].append(times[0])
        row["total"].append(times[1])

    def optstack_saves() -> None:  # its own scope: the stack is freed before DCP's is built
        config = OptimizerConfig(lr=1e-3, clip_grad=0.0, distributed=DistributedConfig(sharding="zero1"))
        wrapped = wrap_data_parallel(config, _model(width, layers))
        optimizer = build_optimizer(config, wrapped).optimizer
        _backward(wrapped, width)
        optimizer.step()
        for i in range(repeat):
            add("optstack ZeRO-1, blocking", _blocked(
                lambda i=i: save_checkpoint(root / f"os-block-{i}", optimizer, step=1), lambda _: None))
            add("optstack ZeRO-1, blocking=False", _blocked(
                lambda i=i: save_checkpoint(root / f"os-async-{i}", optimizer, step=1, blocking=False),
                lambda handle: handle.wait()))

    optstack_saves()
    torch_model = _model(width, layers)
    torch_optim = torch.optim.AdamW(torch_model.parameters(), lr=1e-3)
    _backward(torch_model, width)
    torch_optim.step()
    group = dist.new_group(backend="gloo")  # DCP's background collectives: a group of their own
    for i in range(repeat):
        model_sd, optim_sd = get_state_dict(torch_model, torch_optim)
        state = {"model": model_sd, "optim": optim_sd}
        add("DCP torch AdamW, dcp.save", _blocked(
            lambda i=i, state=state: dcp.save(state, checkpoint_id=root / f"dcp-block-{i}"), lambda _: None))
        add("DCP torch AdamW, dcp.async_save", _blocked(
            lambda i=i, state=state: dcp.async_save(state, checkpoint_id=root / f"dcp-async-{i}",
                                                    process_group=group),
            lambda future: future.result()))
    return {name: {k: min(v) for k, v in row.items()} for name, row in rows.items()}


def _worker(rank: int, store: str, root: str, width: int, layers: int, repeat: int, params: int | None,
            sharding: str, dcp_too: bool, out: Any, async_save: bool = False) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD,
                            timeout=timedelta(minutes=10))
    layout = {"zero1": "ZeRO-1", "replicated": "replicated", "layerwise": "layer-wise"}[sharding]
    try:
        if async_save:
            out.put((rank, _async_rows(width, layers, Path(root), repeat)))
            return
        results = {
            **({"DCP, torch AdamW": _dcp_baseline(width, layers, Path(root), repeat, params)} if dcp_too else {}),
            f"optstack {layout}": _optstack(width, layers, Path(root), repeat, False, params, sharding),
            f"optstack {layout} + model": _optstack(width, layers, Path(root), repeat, True, params, sharding),
        }
        out.put((rank, results))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=2500)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--params", type=int, default=None, help="instead: this many tiny (4 x 4) tensors")
    parser.add_argument("--sharding", choices=["zero1", "replicated", "layerwise"], default=None,
                        help="optstack's layout (default: zero1; replicated with --params)")
    parser.add_argument("--no-dcp", action="store_true", help="skip the DCP baseline (minutes at 50,000 params)")
    parser.add_argument("--async-save", action="store_true",
                        help="instead: the trainer's blocked time, asynchronous vs blocking saves, optstack and DCP")
    args = parser.parse_args()
    sharding = args.sharding or ("replicated" if args.params else "zero1")
    numel = args.params * 16 if args.params else args.layers * (args.width * args.width + args.width)
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, str(root / "store"), str(root), args.width, args.layers,
                                               args.repeat, args.params, sharding, not args.no_dcp, out,
                                               args.async_save))
             for r in range(WORLD)]
    try:
        for p in procs:
            p.start()
        per_rank = dict(out.get(timeout=1800) for _ in procs)
        for p in procs:
            p.join()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = per_rank[0]
    if args.async_save:
        print(f"\n{numel / 1e6:.1f}M fp32 parameters, AdamW, data-parallel size {WORLD} (gloo, 1 thread per "
              f"rank), best of {args.repeat}; {os.cpu_count()} CPUs; blocked = the trainer waits, total = "
              "until committed\n")
        print("| save | blocked s | total s | blocked / its blocking save |")
        print("|---|---:|---:|---:|")
        for name, r in rows.items():
            blocking = rows[name.split(",")[0] + (", blocking" if name.startswith("optstack") else ", dcp.save")]
            print(f"| {name} | {r['blocked']:.2f} | {r['total']:.2f} | {r['blocked'] / blocking['blocked']:.2f} |")
        return
    base = rows.get("DCP, torch AdamW")
    what = f"{args.params} tiny tensors ({numel} elements)" if args.params else f"{numel / 1e6:.1f}M"
    print(f"\n{what} fp32 parameters, AdamW, data-parallel size {WORLD} (gloo, 1 thread per rank), "
          f"best of {args.repeat}, warm page cache; {os.cpu_count()} CPUs; optstack build "
          f"{max(r.get('build', 0.0) for r in rows.values()):.1f} s\n")
    print("| checkpoint | save s | load s | MB written | files | save / DCP | load / DCP | MB / DCP |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        ratios = ([f"{r[k] / base[k]:.2f}" for k in ("save", "load", "bytes")] if base is not None else ["-"] * 3)
        print(f"| {name} | {r['save']:.2f} | {r['load']:.2f} | {r['bytes'] / 1e6:.0f} | {r['files']:.0f} | "
              + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()
