"""``save_checkpoint(..., blocking=False)``: the state of the moment of the call, written while training goes on.

The handle's checkpoint loads bitwise as the stack was when the save was called, however many steps ran
while it was written; a failure reaches ``wait()`` (and leaves the previous checkpoint as it was); the next
save waits for the one in flight; a process killed while the background thread writes leaves the previous
checkpoint whole. (tests/distributed/test_checkpoint_async.py: two ranks, and DCP's ``async_save``.)
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from optim_harness import shard_numbers
from torch import nn

from optstack.checkpoint import CheckpointError, SaveHandle, io, load_checkpoint, save_checkpoint
from optstack.config import OptimizerConfig
from optstack.factory import BuiltOptimizer, build_optimizer

HERE = Path(__file__).parent


def _stack(seed: int = 0, steps: int = 2) -> tuple[nn.Module, BuiltOptimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    built = build_optimizer(OptimizerConfig(lr=1e-2), model)
    _train(model, built, range(steps), seed)
    return model, built


def _train(model: nn.Module, built: BuiltOptimizer, steps: range, seed: int = 0) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(seed * 100 + step)
        model(torch.randn(5, 4, generator=gen)).square().mean().backward()
        built.optimizer.step()
        built.optimizer.zero_grad()


def _numbers(model: nn.Module, built: BuiltOptimizer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in shard_numbers(built.optimizer, model).items()}


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def _loads_as(path: Path, want: dict[str, torch.Tensor]) -> None:
    model, built = _stack(seed=7, steps=1)
    load_checkpoint(path, built.optimizer, model=model)
    _assert_equal(_numbers(model, built), want)


def test_an_async_save_holds_the_state_of_its_call_while_training_steps(tmp_path: Path) -> None:
    model, built = _stack()
    at_save = _numbers(model, built)
    handle = save_checkpoint(tmp_path, built.optimizer, step=2, model=model, blocking=False)
    assert isinstance(handle, SaveHandle) and handle.path == tmp_path / "step_00000002"
    _train(model, built, range(2, 6))  # the stack changes while the checkpoint is written
    assert _numbers(model, built)["0.weight.param"].ne(at_save["0.weight.param"]).any()
    assert handle.wait(timeout=60) == tmp_path / "step_00000002"
    assert handle.done() and handle.error is None
    assert (tmp_path / "latest").read_text().strip() == "step_00000002"
    _loads_as(tmp_path, at_save)


def test_saves_commit_in_order_and_keep_last_applies(tmp_path: Path) -> None:
    model, built = _stack()
    wanted = {}
    handles = []
    for step in (2, 3, 4):
        wanted[step] = _numbers(model, built)
        handles.append(save_checkpoint(tmp_path, built.optimizer, step=step, model=model, blocking=False,
                                       keep_last=2))
        assert all(h.done() for h in handles[:-1])  # each save waited for the one before
        _train(model, built, range(step, step + 1))
    assert handles[-1].wait(timeout=60) == tmp_path / "step_00000004"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == ["step_00000003",
                                                                                       "step_00000004"]
    for step in (3, 4):
        _loads_as(tmp_path / f"step_{step:08d}", wanted[step])


def test_a_failure_in_the_background_reaches_wait_and_commits_nothing(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    model, built = _stack()
    save_checkpoint(tmp_path, built.optimizer, step=2, model=model)
    before = _numbers(model, built)

    def write_synced(path: Path, text: str) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(io, "write_synced", write_synced)
    _train(model, built, range(2, 3))
    handle = save_checkpoint(tmp_path, built.optimizer, step=3, model=model, blocking=False)
    with pytest.raises(CheckpointError, match=r"saving checkpoint .*step_00000003 failed; nothing was committed.*"
                                              r"No space left on device") as caught:
        handle.wait(timeout=60)
    assert not caught.value.committed and isinstance(handle.error, CheckpointError)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002"]
    _loads_as(tmp_path, before)


def test_an_unobserved_failure_is_reported_by_the_next_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, built = _stack()

    def write_synced(path: Path, text: str) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))

    monkeypatch.setattr(io, "write_synced", write_synced)
    handle = save_checkpoint(tmp_path, built.optimizer, step=2, blocking=False)
    while not handle.done():
        time.sleep(0.01)
    monkeypatch.undo()
    with pytest.warns(UserWarning, match=r"asynchronous save of .*step_00000002 failed"):
        save_checkpoint(tmp_path, built.optimizer, step=3)


def child_async_save(root: str, signal_file: str) -> None:
    """Runs in a subprocess: save step 2, then start an async save of step 4 that hangs mid-write in its
    thread while the main thread trains on."""
    from optstack.checkpoint import storage

    model, built = _stack()
    save_checkpoint(root, built.optimizer, step=2, model=model)
    _train(model, built, range(2, 4))
    original = storage._ChunkSavePlanner.resolve_data

    def resolve_data(self, item):  # type: ignore[no-untyped-def]
        Path(signal_file).touch()
        time.sleep(600)
        return original(self, item)

    storage._ChunkSavePlanner.resolve_data = resolve_data  # type: ignore[method-assign]
    save_checkpoint(root, built.optimizer, step=4, model=model, blocking=False)
    _train(model, built, range(4, 8))
    time.sleep(600)


def test_sigkill_during_an_async_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    signal_file, root = tmp_path / "hanging", tmp_path / "ckpt"
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); from test_checkpoint_async import child_async_save; "
            f"child_async_save({str(root)!r}, {str(signal_file)!r})")
    child = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while not signal_file.exists():
            assert child.poll() is None, "the child exited before it reached the kill point"
            assert time.monotonic() < deadline, "the child never reached the kill point"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert (root / "latest").read_text().strip() == "step_00000002"
    assert [p.name for p in root.iterdir() if p.name.startswith("step_")] == ["step_00000002"]
    model, built = _stack()
    _loads_as(root, _numbers(model, built))
    save_checkpoint(root, built.optimizer, step=4)  # the next save clears the leftovers and commits
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "step_00000004"]
