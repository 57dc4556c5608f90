"""Faults at data-parallel size 2 (issue 15): a rank that raises or stalls in backward, in the optimizer step or
in the ZeRO-1 parameter gather makes every rank fail with a traceback within seconds, never a hang; a NaN
storm on one rank makes every rank skip every step, back the loss scale off and leave the parameters unchanged.

Each fault runs in a fresh pair of forked processes (a fault leaves gloo's pairs inconsistent) whose optimizer
collectives time out after ``TIMEOUT_S``; each rank must fail within a few timeouts of the fault (plus the
stall, for the stalled rank), and the pair must report within ``DEADLINE_S``, else the test fails as a hang.
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import time
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from optstack.config import DistributedConfig, OptimizerConfig
from optstack.distributed.parallel import ParallelGroups
from optstack.factory import build_optimizer, wrap_data_parallel
from optstack.protocol import set_phase_hook

pytestmark = pytest.mark.faults

TIMEOUT_S = 2.0  # the optimizer's collectives' timeout: how long a rank waits for a dead or stalled peer
STALL_S = 4.0  # a stalled rank sleeps this long (longer than the timeout)
SETUP_TIMEOUT_S = 60.0  # starting the pair and building (not timed)
DEADLINE_S = 120.0  # for the pair to report at all, setup included; past it the test fails as a hang


class _Injected(Exception):
    """The fault a test raises on purpose."""


def _fault(kind: str) -> None:
    if kind == "raise":
        raise _Injected("injected fault")
    time.sleep(STALL_S)


def _rank_main(rank: int, store: str, where: str, kind: str, results: Any) -> None:
    start = time.monotonic()
    try:
        torch.set_num_threads(1)
        # Setup may be slow on a loaded machine: the group's own timeout is long; the optimizer's collectives
        # wait at most TIMEOUT_S (the Comm timeout), which is what the faults exercise.
        dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=SETUP_TIMEOUT_S))
        groups = ParallelGroups.from_process_groups(dp=dist.group.WORLD,
                                                    timeout=datetime.timedelta(seconds=TIMEOUT_S))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        config = OptimizerConfig(distributed=DistributedConfig(sharding="zero1", bucket_size=100))
        ddp = wrap_data_parallel(config, model, groups=groups)
        opt = build_optimizer(config, ddp).optimizer
        dist.barrier()
        start = time.monotonic()  # the fault phase
        faulty = rank == 1

        class _Hook:  # a phase hook entering the fault at the chosen phase of the step, on rank 1
            def __init__(self, name: str) -> None:
                self.name = name

            def __enter__(self) -> None:
                if faulty and self.name == where:
                    _fault(kind)

            def __exit__(self, *exc: Any) -> None:
                return None

        set_phase_hook(_Hook)
        for _ in range(3):
            opt.zero_grad()
            hidden = ddp.module[0](torch.randn(4, 8))
            if faulty and where == "backward":
                hidden.register_hook(lambda grad: _fault(kind))
            ddp.module[2](ddp.module[1](hidden)).pow(2).mean().backward()
            opt.step()
            opt.finish_param_sync()
        results.put((rank, "ok", "", time.monotonic() - start))
    except BaseException:
        results.put((rank, "error", traceback.format_exc(), time.monotonic() - start))
    finally:
        results.close()
        results.join_thread()
        os._exit(0)  # no teardown of a broken gloo group: its destructor may wait on the dead peer


def _run_pair(where: str, kind: str) -> dict[int, tuple[str, str, float]]:
    # The first torch.optim.Optimizer imports torch._dynamo (seconds): once here, so the forked pair inherits it.
    torch.optim.SGD([nn.Parameter(torch.zeros(1))])
    ctx = torch.multiprocessing.get_context("fork")  # a fresh pair in ~1 s: torch and optstack are imported
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank_main, args=(r, os.path.join(tmp, "store"), where, kind, results))
                 for r in range(2)]
        for p in procs:
            p.start()
        out: dict[int, tuple[str, str, float]] = {}
        deadline = time.monotonic() + DEADLINE_S
        try:
            while len(out) < 2:
                rank, status, tb, elapsed = results.get(timeout=max(0.1, deadline - time.monotonic()))
                out[rank] = (status, tb, elapsed)
        except queue.Empty:
            pass
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    assert len(out) == 2, f"{kind} in {where}: ranks {sorted(set(range(2)) - set(out))} hung (no result in " \
                          f"{DEADLINE_S} s); got {out}"
    return out


@pytest.mark.parametrize("kind", ["raise", "stall"])
@pytest.mark.parametrize("where", ["backward", "inner_step", "param_gather"])
def test_a_faulty_rank_makes_every_rank_fail_within_seconds(where, kind):
    out = _run_pair(where, kind)
    for rank, (status, tb, elapsed) in out.items():
        assert status == "error", f"{kind} in {where}: rank {rank} finished without an error"
        assert "Traceback" in tb
        limit = (STALL_S if kind == "stall" and rank == 1 else 0.0) + 4 * TIMEOUT_S + 5.0
        assert elapsed < limit, f"{kind} in {where}: rank {rank} failed only after {elapsed:.1f} s:\n{tb}"
    faulty, peer = out[1][1], out[0][1]
    if kind == "raise":
        assert "_Injected: injected fault" in faulty
    # the healthy rank is told a collective failed (a dead or stalled peer), not left waiting
    assert "CommError" in peer or "Connection" in peer or "timed out" in peer.lower(), peer


def _nan_storm(steps: int) -> tuple[list[bool], list[float], bool]:
    import torch.distributed as dist

    from optstack.config import DistributedConfig, LossScaleConfig, OptimizerConfig
    from optstack.factory import build_optimizer, wrap_data_parallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(torch.bfloat16)
    config = OptimizerConfig(precision="bf16", loss_scale=LossScaleConfig(mode="dynamic", initial=2.0**10,
                                                                           hysteresis=1),
                             distributed=DistributedConfig(sharding="zero1", bucket_size=100))
    ddp = wrap_data_parallel(config, model)
    opt = build_optimizer(config, ddp).optimizer
    before = [p.detach().clone() for p in model.parameters()]
    applied, scales = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = ddp(torch.randn(4, 8, dtype=torch.bfloat16)).float().pow(2).mean()
        if dist.get_rank() == 1:
            loss = loss * float("nan")  # every step non-finite on this rank only
        opt.scale_loss(loss).backward()
        opt.step()
        opt.finish_param_sync()
        applied.append(opt.last_result.applied)
        scales.append(opt.last_result.loss_scale)
    unchanged = all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    return applied, scales, unchanged


def test_a_nan_storm_on_one_rank_skips_every_step_on_every_rank(world2):
    for applied, scales, unchanged in world2.run(_nan_storm, 4, timeout_s=120):  # the first use starts the world
        assert applied == [False] * 4
        assert scales == [2.0**9, 2.0**8, 2.0**7, 2.0**6]  # backed off by 0.5 each skipped step
        assert unchanged
