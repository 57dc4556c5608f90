"""Build cost at scale, simulated: one process acts as rank r of a data-parallel world of N (PyTorch's fake process
group: collectives return at once, an all-gather copies this rank's object into every slot) over a Llama-like model
on the meta device (no memory for the tensors), so what is measured is what optstack itself does per rank.

Run: .venv/bin/python benchmarks/bench_scale.py [--preset 110b] [--dp 1024] [--ranks 0,1023]
                                                [--cases zero1-adamw,fsdp2-adamw,fsdp2-muon] [--src PATH]

Each (case, rank) runs in a fresh process. Columns:
- plan+wrap+build CPU s: ``wrap_data_parallel`` (or ``fully_shard``'s wrapping is excluded: only optstack's part)
  and ``build_optimizer``, CPU time of the process;
- peak MB: the process's peak resident memory above its baseline just before (Python objects, plans, tables);
- stages: the placements built.
Cases: ``zero1-<algorithm>`` (``wrap_data_parallel`` + ``build_optimizer``), ``fsdp2-<algorithm>``, and
``megatron-adam`` (the Megatron face: ``DistributedDataParallel`` with the distributed optimizer +
``get_megatron_optimizer``).
``--src`` points at another checkout's ``src`` (e.g. a worktree of an older commit) for a before / after table.
Target (issue "Plan first"): 110B (795 tensors), bf16 + fp32 masters, dp=1,024: <= 1 s CPU and <= 100 MB above
the baseline per rank, for ZeRO-1 and for FSDP2 + build_optimizer (AdamW and Muon).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _child(args: argparse.Namespace) -> None:
    sys.path.insert(0, args.src)
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.dp)
    import importlib.util  # the presets (cli/plan.py) by path: an older --src may not have them

    from optstack import DistributedConfig, OptimizerConfig, build_optimizer, wrap_data_parallel

    spec = importlib.util.spec_from_file_location("_presets", ROOT / "src" / "optstack" / "cli" / "plan.py")
    presets = importlib.util.module_from_spec(spec)
    sys.modules["_presets"] = presets  # dataclasses look their module up
    spec.loader.exec_module(presets)
    PRESETS, llama_like = presets.PRESETS, presets.llama_like

    kind, algorithm = args.case.split("-")
    model = llama_like(PRESETS[args.preset], torch.bfloat16)
    sharding = "zero1" if kind == "zero1" else "replicated"
    config = OptimizerConfig(algorithm=algorithm, precision="bf16", distributed=DistributedConfig(sharding=sharding))
    torch.optim.SGD([nn.Parameter(torch.zeros(1))])  # torch's one-off import of dynamo, not ours
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        for p in (model.embed.weight, model.output.weight):  # fully_shard replaces parameters: flag them again
            p.is_embedding_or_output_parameter = True
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    c0, t0 = time.process_time(), time.perf_counter()
    if kind == "megatron":  # the Megatron face: its wrapper (a plan of its ddp_config) and its optimizer
        from optstack import megatron as mcore

        ddp = mcore.DistributedDataParallel(None, mcore.DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True), model)
        chain = mcore.get_megatron_optimizer(mcore.OptimizerConfig(optimizer=algorithm, bf16=True,
                                                                   use_distributed_optimizer=True), [ddp])
        stages = [type(s.placement).__name__ for m in chain.chained_optimizers for s in [m._stage]]
    else:
        target = wrap_data_parallel(config, model) if kind == "zero1" else model
        stages = [type(s.placement).__name__ for s in build_optimizer(config, target).optimizer.stages]
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    print(json.dumps({"case": args.case, "rank": args.rank, "cpu_s": cpu, "wall_s": wall, "peak_mb": peak,
                      "stages": stages}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="110b")
    parser.add_argument("--dp", type=int, default=1024)
    parser.add_argument("--ranks", default=None, help="default: 0 and the last rank")
    parser.add_argument("--cases", default="zero1-adamw,fsdp2-adamw,fsdp2-muon")
    parser.add_argument("--src", default=str(ROOT / "src"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    ranks = [0, args.dp - 1] if args.ranks is None else [int(r) for r in args.ranks.split(",")]
    print(f"{args.preset}, dp={args.dp}, src={args.src}")
    print(f"{'case':<14} {'rank':>5} {'CPU s':>7} {'wall s':>7} {'peak MB':>8}  stages")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for case in args.cases.split(","):
        for rank in ranks:
            cmd = [sys.executable, __file__, "--child", "--case", case, "--rank", str(rank), "--dp", str(args.dp),
                   "--preset", args.preset, "--src", args.src]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
            if done.returncode:
                tail = (done.stderr.strip().splitlines() or ["?"])[-1]
                print(f"{case:<14} {rank:>5} failed: {tail[:150]}")
                continue
            row = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{case:<14} {rank:>5} {row['cpu_s']:>7.2f} {row['wall_s']:>7.2f} {row['peak_mb']:>8.0f}  "
                  f"{','.join(row['stages'])}")


if __name__ == "__main__":
    main()
