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

Times are the slowest rank's, best of ``--repeat``, with a warm page cache (the files were just written).

    .venv/bin/python benchmarks/bench_checkpoint.py [--width 2500 --layers 8 --repeat 2]
    .venv/bin/python benchmarks/bench_checkpoint.py --params 50000 --repeat 1 --no-dcp
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


def _worker(rank: int, store: str, root: str, width: int, layers: int, repeat: int, params: int | None,
            sharding: str, dcp_too: bool, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD,
                            timeout=timedelta(minutes=10))
    layout = {"zero1": "ZeRO-1", "replicated": "replicated", "layerwise": "layer-wise"}[sharding]
    try:
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
    args = parser.parse_args()
    sharding = args.sharding or ("replicated" if args.params else "zero1")
    numel = args.params * 16 if args.params else args.layers * (args.width * args.width + args.width)
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, str(root / "store"), str(root), args.width, args.layers,
                                               args.repeat, args.params, sharding, not args.no_dcp, out))
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
