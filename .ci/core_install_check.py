"""The core install (no extras, so no numpy) runs a 2-rank ZeRO-1 step and a checkpoint save and load.

Run by ``make check-core`` with the Python of ``.venv-core``. The test suite cannot see a numpy dependency
(matplotlib, a demo extra, brings numpy in), so this runs the public API where numpy is absent: two gloo
processes on a FileStore build a small model, take one ZeRO-1 step, save a checkpoint, load it into a
freshly initialised stack and check that the parameters and the next step are the same. Every wait is
bounded (gloo's collective timeout, the join deadline), so a hang fails in about a minute, not never.
Exits non-zero on any failure.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import optstack
from optstack import DistributedConfig, OptimizerConfig, build_optimizer, wrap_data_parallel
from optstack.checkpoint import load_checkpoint, save_checkpoint

SIZE = 2
COLLECTIVE_TIMEOUT_S = 30  # one stuck collective raises on its rank after this long
DEADLINE_S = 60  # the whole check, process start-up included


def _stack(seed: int) -> tuple[nn.Module, nn.Module, optstack.ChainedOptimizer]:
    """A small MLP wrapped for ZeRO-1 and its optimizer; ``seed`` sets the initial weights."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
    # A small bucket gives several buckets, each cut between the ranks.
    config = OptimizerConfig(lr=1e-2, distributed=DistributedConfig(sharding="zero1", bucket_size=100))
    wrapped = wrap_data_parallel(config, model)
    return model, wrapped, build_optimizer(config, wrapped).optimizer


def _step(wrapped: nn.Module, optimizer: optstack.ChainedOptimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    loss = ((wrapped(x) - y) ** 2).mean()
    optimizer.zero_grad()
    optimizer.scale_loss(loss).backward()
    optimizer.step()
    assert optimizer.last_result.applied, "the step was skipped"


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(rank: int, store_path: str, root: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, SIZE)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=SIZE,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        model, wrapped, optimizer = _stack(seed=0)
        _step(wrapped, optimizer, seed=1)
        save_checkpoint(root, optimizer, step=1, model=model)
        saved = _params(model)

        fresh_model, fresh_wrapped, fresh_optimizer = _stack(seed=7)
        assert any(not torch.equal(p, saved[n]) for n, p in fresh_model.named_parameters()), "seeds gave one model"
        info = load_checkpoint(root, fresh_optimizer, model=fresh_model)
        assert info.step == 1, info
        for name, p in fresh_model.named_parameters():
            assert torch.equal(p, saved[name]), f"rank {rank}: {name} differs after load"

        # The optimizer state (Adam's moments, step counts) came back too: the next step is the same.
        _step(wrapped, optimizer, seed=2)
        _step(fresh_wrapped, fresh_optimizer, seed=2)
        for (name, p), q in zip(model.named_parameters(), fresh_model.parameters(), strict=True):
            assert torch.equal(p, q), f"rank {rank}: {name} differs one step after load"
    finally:
        dist.destroy_process_group()


def main() -> int:
    print(f"optstack {optstack.__file__}, torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory(prefix="optstack-core-") as tmp:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(r, str(Path(tmp) / "store"), str(Path(tmp) / "ckpt")))
                 for r in range(SIZE)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + DEADLINE_S
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
            procs[r].join()
        failed = [r for r, p in enumerate(procs) if p.exitcode != 0 and r not in hung]
    if hung:
        print(f"core install check: ranks {hung} still running after {DEADLINE_S}s; killed", file=sys.stderr)
    if failed:
        print(f"core install check: ranks {failed} failed (tracebacks above)", file=sys.stderr)
    if hung or failed:
        return 1
    print(f"core install check: {SIZE}-rank ZeRO-1 step, checkpoint save and load: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
