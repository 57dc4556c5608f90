"""Checkpoint metadata at scale, simulated: what a save and a resharding load cost per rank before any data moves.

One process acts as rank r of a data-parallel world (PyTorch's fake process group: collectives return at once)
over a Llama-like model on the meta device (``cli/plan.py`` presets), AdamW ZeRO-1, bf16 + fp32 masters. Its
state is described as after a step (``param``, ``exp_avg``, ``exp_avg_sq`` in fp32 and a ``step``), since meta
tensors cannot be stepped.

Run: .venv/bin/python benchmarks/bench_checkpoint_scale.py [--presets 70b,110b] [--dp 1024] [--to 768]
                                                           [--src PATH] [--work DIR]

Each (preset, phase, rank) runs in a fresh process, for rank 0 and the last rank. Columns:
- save: the save's metadata, as ``save_checkpoint`` computes it: this rank's table, the plan of who writes what
  (with whatever the ranks exchange for it), the sealed manifest (rank 0) and this rank's part of it;
- load: a load at ``--to`` ranks of that manifest: read it, what every rank holds (with whatever the ranks
  exchange for it), the fit check, and which stretches of which old ranks' files this rank reads. Not the
  verification of the files' checksums nor the data;
- CPU s: CPU time of the process; peak MB: peak resident memory above the baseline after the optimizer was built;
- exchanged MB: what this rank receives in the collectives of that phase (an all-gather of objects pads every
  rank's bytes to the largest rank's).

``--src`` points at another checkout's ``src`` (e.g. ``git worktree add /tmp/ckpt-before <commit>``). A checkout
without ``checkpoint/manifest.py`` gathers every rank's table: the fake group would hand back this rank's table
for every rank, so a separate process first computes every rank's table from the buffer layouts and stores them
pickled, as they arrive in a real all-gather; the measured process reads them, unpickles them and plans from
them as that commit's save does (``plan_save``), and its load merges them and walks the manifest's chunks as its
``read_ranges`` does. Target (issue 27): <= 1 s CPU and <= 100 MB per rank, bytes exchanged independent of the
number of parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STATE = {"param": "float32", "exp_avg": "float32", "exp_avg_sq": "float32"}
STEP = {"step": {"tensor": "float32", "value": 1000.0}}


def _build(args: argparse.Namespace, dp: int) -> Any:
    """The ZeRO-1 AdamW optimizer of ``args.preset`` as rank ``args.rank`` of ``dp`` (meta tensors)."""
    sys.path.insert(0, args.src)
    import importlib.util

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=dp)
    from optstack import DistributedConfig, OptimizerConfig, build_optimizer, wrap_data_parallel

    spec = importlib.util.spec_from_file_location("_presets", ROOT / "src" / "optstack" / "cli" / "plan.py")
    presets = importlib.util.module_from_spec(spec)
    sys.modules["_presets"] = presets
    spec.loader.exec_module(presets)
    model = presets.llama_like(presets.PRESETS[args.preset], torch.bfloat16)
    config = OptimizerConfig(algorithm="adamw", precision="bf16", distributed=DistributedConfig(sharding="zero1"))
    torch.optim.SGD([nn.Parameter(torch.zeros(1))])  # torch's one-off import of dynamo, not ours
    wrapped = wrap_data_parallel(config, model)
    return wrapped, build_optimizer(config, wrapped).optimizer


def _as_stepped(held: dict[str, Any]) -> dict[str, Any]:
    import dataclasses

    return {n: dataclasses.replace(h, dtypes=dict(STATE), scalars=dict(STEP)) for n, h in held.items()}


class _Counted:
    """Bytes this rank receives in ``Comm.all_gather_object`` (each rank's object padded to the largest; under
    the fake group every rank's is this rank's)."""

    def __init__(self) -> None:
        from optstack.distributed.comm import Comm

        self.received, self.comm, self.gather = 0, Comm, Comm.all_gather_object
        counter = self

        def counted(comm: Any, obj: Any) -> list[Any]:
            counter.received += comm.size * len(pickle.dumps(obj))
            return counter.gather(comm, obj)

        Comm.all_gather_object = counted


def _tables(optimizer: Any, wrapped: Any, dp: int) -> list[dict[str, Any]]:
    """Every rank's table (``HeldParam``s) as that rank's ``describe`` gives it, from the buffer layouts."""
    from types import SimpleNamespace

    from optstack.checkpoint.format import identity_of, settings_of
    from optstack.checkpoint.state import HeldParam
    from optstack.protocol import algorithm_name

    shapes, groups = {}, {}
    for stage in optimizer.stages:
        algorithm = algorithm_name(stage.optimizer)
        for group in stage.param_groups:
            identity = identity_of(SimpleNamespace(group=group, algorithm=algorithm))
            for name, p in zip(group["param_names"], group["params"], strict=True):
                shapes[name], groups[name] = tuple(p.shape), (identity, settings_of(group))
    tables: list[dict[str, Any]] = [{} for _ in range(dp)]
    for buffer in wrapped.plan.buffers:
        layout = buffer.layout
        for bucket in range(len(layout.buckets)):
            for rank in range(dp):
                for part in layout.owned_slices(bucket, rank):
                    tables[rank][part.name] = HeldParam(part.name, shapes[part.name], part.param_start,
                                                        part.param_end, dict(STATE), dict(STEP),
                                                        *groups[part.name])
    return tables


def _child(args: argparse.Namespace) -> None:
    dp = args.dp if args.phase in ("gen-save", "save") else args.to
    wrapped, optimizer = _build(args, args.to if args.phase == "gen-load" else dp)
    import gc

    from optstack.checkpoint.format import seal
    from optstack.distributed.comm import world_comm

    comm = world_comm("checkpoint")
    work = Path(args.work)
    if args.phase.startswith("gen-"):  # the old path's received tables, computed outside the measured process
        tables = _tables(optimizer, wrapped, comm.size)
        (work / f"{args.phase}.pkl").write_bytes(pickle.dumps([pickle.dumps(t) for t in tables]))
        return
    new = (Path(args.src) / "optstack" / "checkpoint" / "manifest.py").exists()
    from optstack.checkpoint import load as load_module
    from optstack.checkpoint import save as save_module
    from optstack.checkpoint.state import plan_save

    counter = _Counted()
    gc.collect()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    c0, t0 = time.process_time(), time.perf_counter()
    directory = work / "step"
    if args.phase == "save":
        shards, held, _, table = save_module.local_state(optimizer, None, fingerprints=False)
        held = _as_stepped(held)
        if new:
            from optstack.checkpoint.format import PART
            from optstack.checkpoint.state import part_of
            from optstack.checkpoint.storage import rank_dir_name

            plan = save_module.save_plan(optimizer, shards, held, table, comm)
            manifest = save_module.manifest_of(plan, 1000, comm.size, {}, None, {}, "bench")
            part = directory / rank_dir_name(comm.rank)
            part.mkdir(parents=True, exist_ok=True)
            (part / PART).write_text(seal(part_of(plan.writes[comm.rank], held, [])))
        else:
            received = (work / "gen-save.pkl").read_bytes()
            counter.received += comm.size * max(map(len, pickle.loads(received)))
            tables = [pickle.loads(b) for b in pickle.loads(received)]
            plan = plan_save(tables, None)
            manifest = {"format": "optstack.checkpoint", "version": 2, "step": 1000, "world_size": comm.size,
                        "checksum_algorithm": "crc32", "params": plan.params, "groups": plan.groups, "scaler": {},
                        "scheduler": None, "model": None, "files": {}, "packs": {}, "job": "bench"}
        if comm.rank == 0:
            text = seal(manifest)
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "manifest.json").write_text(text)
        held_count = len(plan.writes[comm.rank])
    else:
        path, manifest = load_module.read_manifest(directory)
        shards, held, _, table = save_module.local_state(optimizer, None, fingerprints=False)
        held = _as_stepped(held)
        wanted = {n: (h.start, h.end) for n, h in held.items()}
        if new:
            everyone = load_module.load_view(optimizer, held, table, comm)
            saved = load_module.Saved(path, manifest)
            errors = load_module.check_load(manifest, everyone, table) + load_module.check_dtypes(manifest, saved,
                                                                                                   held)
            reads = load_module.reads(manifest, saved, wanted)
        else:
            received = (work / "gen-load.pkl").read_bytes()
            counter.received += comm.size * max(map(len, pickle.loads(received)))
            everyone = {}
            for theirs in (pickle.loads(b) for b in pickle.loads(received)):
                everyone |= {n: h for n, h in theirs.items() if n not in everyone}
            errors = load_module.check_load(manifest, everyone, table)
            reads = []  # read_ranges' walk of the chunks, without allocating the tensors it reads into
            for name, (start, end) in wanted.items():
                entry = manifest["params"][name]
                for key in entry["dtypes"]:
                    for rank, lo, hi in entry["chunks"]:
                        lo, hi = max(lo, start), min(hi, end)
                        if lo < hi:
                            reads.append((name, key, rank, lo, hi))
        assert not errors, errors[:3]
        held_count = len(reads)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    print(json.dumps({"cpu_s": cpu, "wall_s": wall, "peak_mb": peak, "exchanged_mb": counter.received / 2**20,
                      "entries": held_count}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="70b,110b")
    parser.add_argument("--dp", type=int, default=1024)
    parser.add_argument("--to", type=int, default=768)
    parser.add_argument("--src", default=str(ROOT / "src"))
    parser.add_argument("--work", default="/tmp/bench_checkpoint_scale")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--preset", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    new = (Path(args.src) / "optstack" / "checkpoint" / "manifest.py").exists()
    print(f"dp={args.dp} -> {args.to}, src={args.src} ({'plan-derived manifest' if new else 'gathered tables'})")
    print(f"{'preset':<7} {'phase':<5} {'rank':>5} {'CPU s':>7} {'wall s':>7} {'peak MB':>8} {'exchanged MB':>13}")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for preset in args.presets.split(","):
        work = Path(args.work) / f"{preset}-{'new' if new else 'old'}"
        work.mkdir(parents=True, exist_ok=True)
        # the save's ranks whose parts the load's first and last ranks read (new), then the load's
        steps = [("gen-save", 0, False)] if not new else []
        saves = sorted({0, args.dp - 1} | ({1, args.dp - 2} if new else set()))
        steps += [("save", r, r in (0, args.dp - 1)) for r in saves]
        steps += [] if new else [("gen-load", 0, False)]
        steps += [("load", r, True) for r in (0, args.to - 1)]
        for phase, rank, shown in steps:
            cmd = [sys.executable, __file__, "--child", "--phase", phase, "--preset", preset, "--rank", str(rank),
                   "--dp", str(args.dp), "--to", str(args.to), "--src", args.src, "--work", str(work)]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
            if done.returncode:
                tail = (done.stderr.strip().splitlines() or ["?"])[-1]
                print(f"{preset:<7} {phase:<5} {rank:>5} failed: {tail[:200]}")
                continue
            if shown:
                row = json.loads(done.stdout.strip().splitlines()[-1])
                print(f"{preset:<7} {phase:<5} {rank:>5} {row['cpu_s']:>7.2f} {row['wall_s']:>7.2f} "
                      f"{row['peak_mb']:>8.0f} {row['exchanged_mb']:>13.3f}", flush=True)


if __name__ == "__main__":
    main()
