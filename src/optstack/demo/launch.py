"""``optstack train --nproc N``: start N processes on this machine, each running ``train`` as one rank.

One process (N = 1) runs ``train`` in place, without torch.distributed. For N > 1 the launcher checks what it
can before starting anything (N against the machine: CPU cores, or CUDA devices when training on CUDA; the
batch split; the run directory), then spawns N fresh interpreters. They meet through a ``FileStore`` in a
private temporary directory (no port to choose or to collide on) and form a gloo world on CPU or an NCCL
world on CUDA (rank r on ``cuda:r``), with an explicit timeout on the rendezvous and on every collective.
Each rank gets ``cores / N`` torch threads, so N processes do not oversubscribe the machine.

Each worker reports how it ended (done, a user error, interrupted, or a crash with its traceback) on a
queue. When one rank fails, the others are given a short grace period (they are usually blocked in a
collective with the dead rank) and then terminated; the launcher raises the first failure: a ``ValueError``
for a user error (printed by the CLI without a traceback), ``KeyboardInterrupt`` for Ctrl-C, and
``RankFailed`` (a ``RuntimeError``) carrying the rank's traceback, or exit code when it died without one.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from optstack.demo.config import TrainConfig
from optstack.demo.train import TrainSummary, check_start, train

__all__ = ["launch", "allowed_processes", "RankFailed", "COLLECTIVE_TIMEOUT"]

#: How long the rendezvous and any one collective may wait for a peer before failing.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
_GRACE_S = 10.0  # after one rank fails, how long the others get to notice and exit on their own
_INTERRUPT_GRACE_S = 30.0  # after Ctrl-C, how long the ranks get to finish their step and save a checkpoint


def _device_type(name: str) -> str:
    # Without initialising CUDA in the launcher (torch.cuda.is_available does not create a context).
    return "cuda" if name == "cuda" or (name == "auto" and torch.cuda.is_available()) else "cpu"


def allowed_processes(device: str) -> tuple[int, str]:
    """The most processes ``--nproc`` may start for ``train.device`` = ``device``, and what limits it."""
    if _device_type(device) == "cuda":
        return torch.cuda.device_count(), "CUDA devices (one process per device)"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores, "CPU cores available to this process (one process per core)"


def launch(cfg: TrainConfig, out: str | Path, *, nproc: int = 1, resume: bool = False,
           progress: bool | None = None) -> TrainSummary | None:
    """Train with ``nproc`` processes (see the module docstring).

    Returns:
        The summary (from rank 0's report with several processes; None when it could not be sent).

    Raises:
        ValueError: a user error, found before starting or reported by a rank.
        KeyboardInterrupt: Ctrl-C; the message says how to resume.
        RankFailed: a rank crashed or died (its traceback or exit code is in the message).
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc must be an integer >= 1, got {nproc!r}")
    if nproc == 1:
        return train(cfg, out, resume=resume, progress=progress)
    limit, what = allowed_processes(cfg.train.device)
    if nproc > limit:
        raise ValueError(f"--nproc {nproc} is more than this machine allows: {limit} {what}; use --nproc "
                         f"{max(limit, 1)} or fewer" + (" (or train.device='cpu')" if "CUDA" in what else ""))
    check_start(cfg, out, resume=resume, world_size=nproc)  # fail fast, before starting processes

    threads = max(1, allowed_processes("cpu")[0] // nproc)
    ctx = mp.get_context("spawn")  # fresh interpreters: no forked torch or CUDA state
    reports: Any = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="optstack-train-")
    store = os.path.join(tmp, "store")
    procs = [ctx.Process(target=_worker, name=f"optstack-rank{r}", daemon=True,
                         args=(r, nproc, store, cfg, str(out), resume, progress, threads, reports))
             for r in range(nproc)]
    try:
        for p in procs:
            p.start()
        outcomes = _wait(procs, reports)
    except KeyboardInterrupt:
        # The ranks got the same Ctrl-C: they finish their step, save a checkpoint together and report (a
        # second Ctrl-C stops them at once). The first rank's report says which checkpoint to resume from.
        _stop(procs, grace_s=_INTERRUPT_GRACE_S)
        said = _interrupt_report(reports)
        raise KeyboardInterrupt(said or f"interrupted; continue with: optstack train --out {out} --resume "
                                f"--nproc {nproc}") from None
    finally:
        _stop(procs, grace_s=0.0)
        shutil.rmtree(tmp, ignore_errors=True)
    return _verdict(procs, outcomes, out)


def _wait(procs: list[Any], reports: Any) -> dict[int, tuple[str, Any]]:
    """Collect each rank's report; once any rank failed, give the rest ``_GRACE_S`` and stop them."""
    outcomes: dict[int, tuple[str, Any]] = {}
    failed_at: float | None = None
    dead_since: dict[int, float] = {}
    while len(outcomes) < len(procs):
        try:
            rank, kind, value = reports.get(timeout=0.2)
            outcomes[rank] = (kind, value)
            continue
        except queue.Empty:
            pass
        now = time.monotonic()
        for r, p in enumerate(procs):
            if r in outcomes or p.exitcode is None:
                continue
            # Exited without a report yet: it may still be in the pipe; after a moment, it is not coming
            # (killed, out of memory, a crash in native code).
            if now - dead_since.setdefault(r, now) > 2.0:
                outcomes[r] = ("died", f"rank {r} exited with code {p.exitcode} without a report (killed, "
                                       "out of memory, or a crash in native code)")
        if failed_at is None and any(kind != "ok" for kind, _ in outcomes.values()):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > _GRACE_S:
            _stop(procs, grace_s=0.0)
            for r in range(len(procs)):
                outcomes.setdefault(r, ("stopped", None))
    for p in procs:
        p.join(timeout=_GRACE_S)
    return outcomes


def _interrupt_report(reports: Any) -> str | None:
    """The lowest rank's interrupt message among the reports that arrived, if any."""
    said: dict[int, str] = {}
    while True:
        try:
            rank, kind, value = reports.get(timeout=0.5)
        except (queue.Empty, OSError, ValueError):
            break
        if kind == "interrupt":
            said[rank] = value
    return said[min(said)] if said else None


def _stop(procs: list[Any], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for p in procs:
        if p.pid is not None:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)


class RankFailed(RuntimeError):
    """A rank crashed or died; the message holds its traceback (or exit code) and how to resume."""


def _verdict(procs: list[Any], outcomes: dict[int, tuple[str, Any]], out: str | Path) -> TrainSummary | None:
    by_kind: dict[str, list[tuple[int, Any]]] = {}
    for rank in sorted(outcomes):
        kind, value = outcomes[rank]
        by_kind.setdefault(kind, []).append((rank, value))
    if "user" in by_kind:  # every rank usually finds the same user error; say it once
        raise ValueError(by_kind["user"][0][1])
    if "interrupt" in by_kind:
        raise KeyboardInterrupt(by_kind["interrupt"][0][1])
    # A rank that died is the cause; the errors of the others (failed collectives with it) are the effect.
    for kind in ("died", "error"):
        if kind in by_kind:
            rank, text = by_kind[kind][0]
            raise RankFailed(f"training failed on rank {rank} of {len(procs)}:\n{text.rstrip()}\nThe other ranks "
                             f"were stopped. Continue from the latest checkpoint with: optstack train --out {out} "
                             f"--resume --nproc {len(procs)}")
    ok = dict(by_kind.get("ok", []))
    return ok.get(0)


def _worker(rank: int, size: int, store: str, cfg: TrainConfig, out: str, resume: bool, progress: bool | None,
            threads: int, reports: Any) -> None:
    """One rank: join the world, train, leave; report how it ended (and exit non-zero unless done)."""
    from optstack.distributed.comm import destroy_process_group, init_process_group

    torch.set_num_threads(threads)
    for stream in (sys.stdout, sys.stderr):  # status lines as they happen, even into a pipe or a file
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    report: tuple[str, Any]
    try:
        device = None
        if _device_type(cfg.train.device) == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        init_process_group(rank, size, store_path=store, device=device, timeout=COLLECTIVE_TIMEOUT)
        try:
            summary = train(cfg, out, resume=resume, progress=progress)
        finally:
            destroy_process_group()
        report = ("ok", summary if rank == 0 else None)
    except ValueError as error:
        report = ("user", str(error))
    except KeyboardInterrupt as interrupt:
        report = ("interrupt", str(interrupt) or "interrupted")
    except BaseException:  # noqa: BLE001 - a crash: its traceback goes to the launcher
        report = ("error", traceback.format_exc())
    reports.put((rank, *report))
    reports.close()
    reports.join_thread()  # the report must reach the pipe before this process exits
    if report[0] != "ok":
        os._exit(2)  # skip interpreter teardown: a peer may be wedged in a collective with us
