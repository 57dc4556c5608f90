"""Checkpoint faults on one rank of two (gloo, ZeRO-1): every rank gets the same clear error within seconds.

A storage error or any exception on rank 1 alone, while saving or loading, is one error on both ranks, naming
rank 1, the path and the cause, long before the process group's timeout (the world's is 30 s): the ranks agree
on each step's outcome, so none leaves the save early. The previous checkpoint still loads bitwise; a failed
load changes nothing.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
from optim_harness import shard_numbers

from optstack.checkpoint import CheckpointError, io, load_checkpoint, save_checkpoint
from optstack.distributed.comm import world_comm

_spec = importlib.util.spec_from_file_location("_reshard_cases_faults",
                                               Path(__file__).with_name("test_checkpoint_reshard.py"))
reshard = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = reshard
_spec.loader.exec_module(reshard)

pytestmark = pytest.mark.faults
CASE = {**reshard.CASES["zero1-adamw-bf16"], "overlap": False}
FAILING = 1
# A fault must end the save / load on every rank at once, not when the session world's 30 s timeout fires; the
# margin below that is for a loaded machine (one such run took 6 s)
PROMPT_S = 20.0


def _numbers(built: Any) -> dict[str, torch.Tensor]:
    """This rank's optimizer numbers (its ZeRO-1 shards), copied."""
    return shard_numbers(built.optimizer, scalars=False)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _inject(mp: pytest.MonkeyPatch, where: str, built: Any) -> None:
    def raise_(error: BaseException) -> Any:
        def fail(*args: Any, **kwargs: Any) -> Any:
            raise error
        return fail

    enospc, eio = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), OSError(errno.EIO, os.strerror(errno.EIO))
    if where == "dcp-write":  # DCP wraps it in its CheckpointException, a BaseException
        mp.setattr(dcp_fs, "_write_item", raise_(enospc))
    elif where == "dcp-read":
        mp.setattr(dcp_fs.FileSystemReader, "_slice_file", raise_(eio))  # how the data-only reader reads items
    elif where == "verify":
        mp.setattr(io, "file_checksum", raise_(eio))
    elif where == "raise":  # not a storage error: a bug, on one rank
        mp.setattr(built.optimizer.stages[0], "param_shards", raise_(RuntimeError("injected failure in param_shards")))
    else:
        raise AssertionError(where)


def save_with_fault(root: str, where: str) -> dict[str, Any]:
    """Save step 1; train on; save step 2 with ``where`` failing on rank 1; then load step 1 into a fresh stack."""
    comm = world_comm()
    _, wrapped, built = reshard._stack(CASE, "zero1", seed=0)
    reshard._train(wrapped, built, range(2))
    save_checkpoint(root, built.optimizer, step=1, scheduler=built.scheduler)
    want = _numbers(built)
    reshard._train(wrapped, built, range(2, 3))
    error: BaseException | None = None
    with pytest.MonkeyPatch.context() as mp:
        if comm.rank == FAILING:
            _inject(mp, where, built)
        start = time.monotonic()
        try:
            save_checkpoint(root, built.optimizer, step=2, scheduler=built.scheduler)
        except (CheckpointError, ValueError) as exc:
            error = exc
        elapsed = time.monotonic() - start
    hidden = sorted(p.name for p in Path(root).iterdir() if p.name.startswith("."))
    _, wrapped2, fresh = reshard._stack(CASE, "zero1", seed=7)
    load_checkpoint(root, fresh.optimizer, scheduler=fresh.scheduler)
    return {"type": type(error).__name__, "message": str(error), "elapsed": elapsed, "hidden": hidden,
            "entries": sorted(p.name for p in Path(root).iterdir()), "previous": _equal(_numbers(fresh), want)}


def load_with_fault(root: str, where: str) -> dict[str, Any]:
    """Save step 1; load it with ``where`` failing on rank 1 into a stack trained elsewhere."""
    comm = world_comm()
    _, wrapped, built = reshard._stack(CASE, "zero1", seed=0)
    reshard._train(wrapped, built, range(2))
    save_checkpoint(root, built.optimizer, step=1, scheduler=built.scheduler)
    _, wrapped2, other = reshard._stack(CASE, "zero1", seed=7)
    reshard._train(wrapped2, other, range(5, 6))
    before, lr = _numbers(other), [g["lr"] for g in other.optimizer.param_groups]
    error: BaseException | None = None
    with pytest.MonkeyPatch.context() as mp:
        if comm.rank == FAILING:
            _inject(mp, where, other)
        start = time.monotonic()
        try:
            load_checkpoint(root, other.optimizer, scheduler=other.scheduler)
        except (CheckpointError, ValueError) as exc:
            error = exc
        elapsed = time.monotonic() - start
    unchanged = _equal(_numbers(other), before) and [g["lr"] for g in other.optimizer.param_groups] == lr
    return {"type": type(error).__name__, "message": str(error), "elapsed": elapsed, "unchanged": unchanged}


@pytest.mark.parametrize("where, kind, cause", [
    ("dcp-write", "CheckpointError", "No space left on device"),
    ("raise", "ValueError", "RuntimeError: injected failure in param_shards"),
])
def test_a_fault_on_one_rank_during_save(world2, tmp_path: Path, where: str, kind: str, cause: str) -> None:
    outs = world2.run(save_with_fault, str(tmp_path / "ckpt"), where)
    assert outs[0]["message"] == outs[1]["message"]  # one error, everywhere
    for out in outs:
        assert out["type"] == kind and out["elapsed"] < PROMPT_S, out
        assert f"rank {FAILING}" in out["message"] and cause in out["message"], out["message"]
        assert "step_00000002" in out["message"]
        assert out["hidden"] == [] and out["entries"] == ["latest", "step_00000001"]
        assert out["previous"]


@pytest.mark.parametrize("where, kind, cause", [
    ("dcp-read", "CheckpointError", "Input/output error"),
    ("verify", "CheckpointError", "Input/output error"),
    ("raise", "ValueError", "RuntimeError: injected failure in param_shards"),
])
def test_a_fault_on_one_rank_during_load(world2, tmp_path: Path, where: str, kind: str, cause: str) -> None:
    outs = world2.run(load_with_fault, str(tmp_path / "ckpt"), where)
    assert outs[0]["message"] == outs[1]["message"]
    for out in outs:
        assert out["type"] == kind and out["elapsed"] < PROMPT_S, out
        assert f"rank {FAILING}" in out["message"] and cause in out["message"], out["message"]
        assert "step_00000001" in out["message"] and out["unchanged"]
