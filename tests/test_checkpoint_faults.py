"""Checkpoints under storage faults and concurrent jobs (one process; tests/distributed has the 2-rank cases).

A full disk or an I/O error at any stage of a save is one ``CheckpointError`` naming the path, the rank and the
error: before the commit nothing is left behind and the previous checkpoint loads bitwise; after it the error
says the step IS committed and loads find it. A failed load changes nothing. Two jobs saving into one root
never delete each other's work, and every checkpoint reported saved loads. Faults are injected by patching the
writes (no tmpfs needs mounting): DCP's file write, the manifest, fsync, the rename, ``latest``, the reads.
"""

from __future__ import annotations

import errno
import os
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
from optim_harness import shard_numbers
from torch import nn

from optstack.checkpoint import CheckpointError, io, load_checkpoint, save_checkpoint
from optstack.config import OptimizerConfig
from optstack.factory import BuiltOptimizer, build_optimizer

pytestmark = pytest.mark.faults

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
EIO = OSError(errno.EIO, os.strerror(errno.EIO))


def _stack(seed: int = 0, steps: int = 2) -> tuple[nn.Module, BuiltOptimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    built = build_optimizer(OptimizerConfig(lr=1e-2), model)
    for step in range(steps):
        gen = torch.Generator().manual_seed(seed * 100 + step)
        model(torch.randn(5, 4, generator=gen)).square().mean().backward()
        built.optimizer.step()
        built.optimizer.zero_grad()
    return model, built


def _numbers(model: nn.Module, built: BuiltOptimizer) -> dict[str, torch.Tensor]:
    return shard_numbers(built.optimizer, model)


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def _loads_as(path: Path, want: dict[str, torch.Tensor]) -> None:
    """``path`` loads into a fresh stack with other numbers, bitwise equal to ``want``."""
    model, built = _stack(seed=7, steps=1)
    load_checkpoint(path, built.optimizer, model=model)
    _assert_equal(_numbers(model, built), want)


def _hidden(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, nn.Module, BuiltOptimizer, dict[str, torch.Tensor]]:
    """A root holding step 1; the stack trained on after it; the numbers step 1 holds."""
    model, built = _stack()
    save_checkpoint(tmp_path, built.optimizer, step=1, model=model)
    want = _numbers(model, built)
    gen = torch.Generator().manual_seed(9)
    model(torch.randn(5, 4, generator=gen)).square().mean().backward()
    built.optimizer.step()
    return tmp_path, model, built, want


def _fail_on(monkeypatch: pytest.MonkeyPatch, where: str, error: OSError) -> None:
    """Make the save stage ``where`` raise ``error``."""
    if where == "dcp-write":  # inside DCP: it arrives wrapped in DCP's CheckpointException (a BaseException)
        def write_item(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise error
        monkeypatch.setattr(dcp_fs, "_write_item", write_item)
    elif where in ("manifest", "group-map", "latest"):
        name = {"manifest": "manifest.json", "group-map": "group_map.json", "latest": ".latest.tmp-"}[where]
        original = io.write_synced

        def write_synced(path: Path, text: str) -> None:
            if path.name.startswith(name):
                path.write_text(text[: len(text) // 2])  # half written, as a full disk leaves it
                raise error
            original(path, text)
        monkeypatch.setattr(io, "write_synced", write_synced)
    elif where == "fsync":
        def fsync_path(path: Path) -> None:
            raise error
        monkeypatch.setattr(io, "fsync_path", fsync_path)
    elif where == "rename":
        original_rename = os.rename

        def rename(src, dst):  # type: ignore[no-untyped-def]
            if Path(dst).name.startswith("step_"):
                raise error
            original_rename(src, dst)
        monkeypatch.setattr(os, "rename", rename)
    else:
        raise AssertionError(where)


@pytest.mark.parametrize("where", ["dcp-write", "fsync", "manifest", "group-map", "rename"])
@pytest.mark.parametrize("error", [ENOSPC, EIO], ids=["ENOSPC", "EIO"])
def test_a_storage_error_before_the_commit_leaves_nothing(saved, monkeypatch: pytest.MonkeyPatch, where: str,
                                                          error: OSError) -> None:
    root, model, built, want = saved
    _fail_on(monkeypatch, where, error)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(root, built.optimizer, step=2, model=model)
    monkeypatch.undo()
    message = str(info.value)
    assert not info.value.committed and info.value.path == root / "step_00000002"
    assert f"saving checkpoint {root / 'step_00000002'} failed; nothing was committed" in message
    assert os.strerror(error.errno) in message and "rank 0" in message
    assert "RANK 0" not in message and "Traceback" not in message  # DCP's wrapper is unwrapped
    assert _hidden(root) == [] and sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]
    _loads_as(root, want)
    save_checkpoint(root, built.optimizer, step=2, model=model)  # the disk has room again: the save works


def test_a_failing_latest_says_the_step_is_committed(saved, monkeypatch: pytest.MonkeyPatch) -> None:
    root, model, built, _ = saved
    now = _numbers(model, built)
    _fail_on(monkeypatch, "latest", ENOSPC)
    with pytest.raises(CheckpointError, match=r"step_00000002 IS committed \(complete and loadable\).*"
                                              r"No space left on device") as info:
        save_checkpoint(root, built.optimizer, step=2, model=model)
    monkeypatch.undo()
    assert info.value.committed
    assert _hidden(root) == [] and (root / "latest").read_text().strip() == "step_00000001"
    with pytest.warns(UserWarning, match="step_00000002 is the newest committed checkpoint"):
        _loads_as(root, now)
    # Saving the step again (the caller retried) replaces the unacknowledged directory and moves latest.
    save_checkpoint(root, built.optimizer, step=2, model=model)
    assert (root / "latest").read_text().strip() == "step_00000002" and _hidden(root) == []
    with pytest.raises(ValueError, match="already exists and 'latest' names it"):
        save_checkpoint(root, built.optimizer, step=2, model=model)


def test_killed_between_the_rename_and_latest(saved) -> None:
    """The state such a kill leaves: step 2 committed, latest naming step 1. Restarts neither fail nor loop."""
    root, model, built, want = saved
    save_checkpoint(root, built.optimizer, step=2, model=model)
    now = _numbers(model, built)
    (root / "latest").write_text("step_00000001\n")
    for _ in range(2):  # a restart resumes from step 2, every time
        with pytest.warns(UserWarning, match="names 'step_00000001' but step_00000002 is the newest"):
            _loads_as(root, now)
    _loads_as(root / "step_00000001", want)  # an explicit directory is taken as it is
    model2, built2 = _stack(seed=3)  # a restart that re-saves step 2 from other numbers replaces it
    save_checkpoint(root, built2.optimizer, step=2, model=model2)
    assert (root / "latest").read_text().strip() == "step_00000002" and _hidden(root) == []
    _loads_as(root, _numbers(model2, built2))


@pytest.mark.parametrize("where", ["verify", "read"])
def test_a_storage_error_on_load_changes_nothing(saved, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    root, model, built, _ = saved
    before = _numbers(model, built)
    if where == "verify":
        def checksum(path: Path) -> dict:
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        monkeypatch.setattr(io, "file_checksum", checksum)
    else:  # inside DCP's read: wrapped in its CheckpointException
        def slice_file(self, file, info):  # type: ignore[no-untyped-def]
            raise EIO  # reading an item's bytes (the data-only reader reads each through DCP's _slice_file)
        monkeypatch.setattr(dcp_fs.FileSystemReader, "_slice_file", slice_file)
    with pytest.raises(CheckpointError, match=r"cannot load checkpoint .*step_00000001: rank 0.*Input/output error"):
        load_checkpoint(root, built.optimizer, model=model)
    _assert_equal(_numbers(model, built), before)


def test_an_unreadable_latest_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "latest").write_text("step_00000009\n")
    _, built = _stack()
    with pytest.raises(ValueError, match="names 'step_00000009', which is not a checkpoint"):
        load_checkpoint(tmp_path, built.optimizer)


def test_a_manifest_missing_a_ranks_data_files_is_refused(saved) -> None:
    """What a save whose data files were deleted under it used to commit: the manifest lists only .metadata."""
    root, model, built, _ = saved
    manifest_path = root / "step_00000001" / "manifest.json"
    from optstack.checkpoint.format import seal, unseal

    manifest = unseal(manifest_path.read_text(), str(manifest_path))
    manifest["files"] = {k: v for k, v in manifest["files"].items() if k.endswith(".metadata")}
    manifest_path.write_text(seal(manifest))
    for data in (root / "step_00000001" / "rank_00000").glob("*.distcp"):
        data.unlink()
    before = _numbers(model, built)
    with pytest.raises(ValueError, match=r"rank_00000: the manifest lists \['rank_00000/.metadata'\] for rank 0"):
        load_checkpoint(root, built.optimizer, model=model)
    _assert_equal(_numbers(model, built), before)


# -- temporary directories and concurrent jobs -----------------------------------------------------------
def test_stale_removes_only_abandoned_saves(tmp_path: Path) -> None:
    live = io.make_temp(tmp_path / "step_00000005")  # a save in progress: locked by this process
    dead = io.make_temp(tmp_path / "step_00000006")
    dead.release()  # its process is gone: the kernel dropped the lock
    unlocked = tmp_path / ".step_00000007.tmp-0123456789ab"  # killed before it locked (or an older version)
    unlocked.mkdir()
    fresh_latest = tmp_path / ".latest.tmp-0123456789ab"  # another job's pointer, being written
    fresh_latest.write_text("step_00000005\n")
    io.remove_stale(tmp_path)
    assert _hidden(tmp_path) == sorted([live.path.name, fresh_latest.name])
    os.utime(fresh_latest, (0, 0))  # an old one was left by a killed save
    io.remove_stale(tmp_path)
    assert _hidden(tmp_path) == [live.path.name]
    live.release()
    io.remove_stale(tmp_path)
    assert _hidden(tmp_path) == []


def test_two_jobs_saving_into_one_root(tmp_path: Path) -> None:
    """Two jobs (threads: flock locks are per open file, so they exclude each other like processes) save 8
    checkpoints each into one root. Every reported success loads, bitwise, as the job saved it."""
    reported: dict[int, dict[str, torch.Tensor]] = {}
    errors: list[BaseException] = []

    def job(parity: int) -> None:
        model, built = _stack(seed=parity, steps=1)
        try:
            for step in range(parity, 16, 2):
                save_checkpoint(tmp_path, built.optimizer, step=step, model=model)
                reported[step] = _numbers(model, built)
                model(torch.randn(5, 4)).square().mean().backward()
                built.optimizer.step()
                built.optimizer.zero_grad()
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        threads = [threading.Thread(target=job, args=(parity,)) for parity in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors
    assert sorted(reported) == list(range(16))
    for step, want in reported.items():
        _loads_as(tmp_path / f"step_{step:08d}", want)
    assert _hidden(tmp_path) == []


def test_two_jobs_with_keep_last_prune_only_their_own(tmp_path: Path) -> None:
    """Issue 27: two jobs sharing a root with keep_last deleted each other's checkpoints right after they were
    returned (4-6 of 20), and racing prunes raised CheckpointError(committed=True) for saves that succeeded.
    Each job now prunes only its own: every returned checkpoint loads as saved, and each job keeps its newest 2."""
    reported: dict[int, dict[str, torch.Tensor]] = {}
    errors: list[BaseException] = []

    def job(parity: int) -> None:
        model, built = _stack(seed=parity, steps=1)
        try:
            for step in range(parity, 20, 2):
                path = save_checkpoint(tmp_path, built.optimizer, step=step, model=model, keep_last=2)
                reported[step] = _numbers(model, built)
                _loads_as(path, reported[step])  # right after it was returned: still there, whole
                model(torch.randn(5, 4)).square().mean().backward()
                built.optimizer.step()
                built.optimizer.zero_grad()
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        threads = [threading.Thread(target=job, args=(parity,)) for parity in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == [
        "step_00000016", "step_00000017", "step_00000018", "step_00000019"]
    for step in (16, 17, 18, 19):
        _loads_as(tmp_path / f"step_{step:08d}", reported[step])
    assert _hidden(tmp_path) == []


def test_a_resumed_job_prunes_its_own_line_and_no_other(tmp_path: Path) -> None:
    model, built = _stack(seed=0)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, built.optimizer, step=step, keep_last=2)
    other_model, other = _stack(seed=3)  # another job, never loaded from this root
    save_checkpoint(tmp_path, other.optimizer, step=10, keep_last=1)
    resumed_model, resumed = _stack(seed=5)
    load_checkpoint(tmp_path / "step_00000003", resumed.optimizer)  # continues the first job
    save_checkpoint(tmp_path, resumed.optimizer, step=4, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == [
        "step_00000003", "step_00000004", "step_00000010"]
    save_checkpoint(tmp_path, other.optimizer, step=11, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == [
        "step_00000003", "step_00000004", "step_00000011"]
