"""Checkpoints never lose a good save and never half-load a bad one.

A process SIGKILLed in the middle of a save leaves the previous checkpoint whole and loadable; a flipped
byte, a truncated file, a missing shard, a checkpoint of another model or of other settings is a clear
``ValueError`` naming what differs, and the optimizer, scheduler and model are unchanged afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from optim_harness import stack_state
from torch import nn

from optstack.checkpoint import load_checkpoint, save_checkpoint
from optstack.config import LossScaleConfig, OptimizerConfig
from optstack.factory import BuiltOptimizer, build_optimizer
from optstack.schedule import LRSchedule

HERE = Path(__file__).parent


def _model(width: int = 10, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 3)).to(dtype)


def _build(model: nn.Module, *, lr: float = 1e-2, precision: str = "bf16") -> BuiltOptimizer:
    scaler = LossScaleConfig(mode="dynamic", initial=2.0**14) if precision != "fp32" else LossScaleConfig()
    config = OptimizerConfig(lr=lr, precision=precision, loss_scale=scaler)
    return build_optimizer(config, model, lr_schedule=LRSchedule(max_lr=lr, warmup_steps=10, decay_steps=50,
                                                                 style="cosine"))


def _train(model: nn.Module, built: BuiltOptimizer, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        loss = ((model(x.to(next(model.parameters()).dtype)).float() - y) ** 2).mean()
        built.optimizer.scale_loss(loss).backward()
        built.optimizer.step()
        built.optimizer.zero_grad()
        assert built.scheduler is not None
        built.scheduler.step()




def _assert_unchanged(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key, value in before.items():
        same = torch.equal(value, after[key]) if isinstance(value, torch.Tensor) else value == after[key]
        assert same, key


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    model = _model()
    built = _build(model)
    _train(model, built, range(3))
    save_checkpoint(tmp_path, built.optimizer, step=3, scheduler=built.scheduler, model=model)
    return tmp_path


@pytest.fixture
def victim() -> tuple[nn.Module, BuiltOptimizer]:
    """A trained stack whose state differs from the checkpoint's everywhere."""
    model = _model(seed=5)
    built = _build(model)
    _train(model, built, range(20, 24))
    return model, built


def _expect_refusal(path: Path, victim: tuple[nn.Module, BuiltOptimizer], match: str) -> None:
    model, built = victim
    before = stack_state(model, built)
    with pytest.raises(ValueError, match=match):
        load_checkpoint(path, built.optimizer, scheduler=built.scheduler, model=model)
    _assert_unchanged(before, stack_state(model, built))


def _data_file(root: Path) -> Path:
    return root / "step_00000003" / "rank_00000" / "__0_0.distcp"


def test_flipped_byte_is_a_checksum_error(saved: Path, victim: tuple[nn.Module, BuiltOptimizer]) -> None:
    path = _data_file(saved)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    _expect_refusal(saved, victim, r"__0_0.distcp fails its checksum")


def test_truncated_file(saved: Path, victim: tuple[nn.Module, BuiltOptimizer]) -> None:
    path = _data_file(saved)
    path.write_bytes(path.read_bytes()[:-100])
    _expect_refusal(saved, victim, r"__0_0.distcp has \d+ bytes, the manifest says \d+: truncated")


def test_missing_shard(saved: Path, victim: tuple[nn.Module, BuiltOptimizer]) -> None:
    _data_file(saved).unlink()
    _expect_refusal(saved, victim, r"__0_0.distcp is missing")


def test_flipped_byte_in_the_manifest(saved: Path, victim: tuple[nn.Module, BuiltOptimizer]) -> None:
    path = saved / "step_00000003" / "manifest.json"
    path.write_text(path.read_text().replace('"step": 3', '"step": 4'))
    _expect_refusal(saved, victim, r"manifest.json fails its checksum")


def test_checkpoint_of_another_model(saved: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 3))
    model = model.to(torch.bfloat16)
    built = _build(model)
    _train(model, built, range(2))
    _expect_refusal(saved, (model, built), r"this optimizer has 2 parameters the checkpoint does not: '4.weight'")


def test_other_shapes(saved: Path) -> None:
    model = _model(width=12)
    built = _build(model)
    _train(model, built, range(2))
    _expect_refusal(saved, (model, built), r"parameter '0.weight' has shape \(10, 6\) in the checkpoint, \(12, 6\)")


def test_other_dtype(saved: Path) -> None:
    model = _model(dtype=torch.float32)
    built = _build(model, precision="fp32")
    _train(model, built, range(2))
    _expect_refusal(saved, (model, built), r"model tensor '0.weight' is \(10, 6\) bfloat16 in the checkpoint, "
                                           r"\(10, 6\) float32 here")


def test_other_group_settings(saved: Path) -> None:
    model = _model()
    built = _build(model, lr=3e-2)
    _train(model, built, range(2))
    _expect_refusal(saved, (model, built), r"parameters '0.weight', '2.weight', '0.bias', '2.bias' are in "
                                           r"a different group: max_lr 0.01 in the checkpoint, 0.03 here")


def test_no_checkpoint(tmp_path: Path, victim: tuple[nn.Module, BuiltOptimizer]) -> None:
    _expect_refusal(tmp_path, victim, "no checkpoint at")


# -- a save killed half way ------------------------------------------------------------------------------
def child_save(root: str, signal_file: str, where: str) -> None:
    """Runs in a subprocess: save step 3, train on, then start saving step 5 and hang at ``where``."""
    from optstack.checkpoint import io as ckpt_io
    from optstack.checkpoint import storage

    model = _model()
    built = _build(model)
    _train(model, built, range(3))
    save_checkpoint(root, built.optimizer, step=3, scheduler=built.scheduler, model=model)
    _train(model, built, range(3, 5))

    def hang() -> None:
        Path(signal_file).touch()
        time.sleep(600)

    if where == "mid-write":
        original = storage._ChunkSavePlanner.resolve_data
        calls = []

        def resolve_data(self, item):  # type: ignore[no-untyped-def]
            calls.append(item)
            if len(calls) == 3:  # two items are in the file already
                hang()
            return original(self, item)

        storage._ChunkSavePlanner.resolve_data = resolve_data  # type: ignore[method-assign]
    else:  # everything written and flushed, manifest included: killed just before the rename
        ckpt_io.commit_dir = lambda temp, target: hang()  # type: ignore[assignment]
    save_checkpoint(root, built.optimizer, step=5, scheduler=built.scheduler, model=model)


@pytest.mark.parametrize("where", ["mid-write", "before-rename"])
def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path: Path, where: str) -> None:
    signal_file = tmp_path / "hanging"
    root = tmp_path / "ckpt"
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); from test_checkpoint_safety import child_save; "
            f"child_save({str(root)!r}, {str(signal_file)!r}, {where!r})")
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
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(".step_00000005.tmp-")]
    assert len(leftovers) == 1  # the killed save's directory, half or fully written
    assert (root / "latest").read_text().strip() == "step_00000003"

    # The previous checkpoint is whole: it loads, and equals a stack trained the same 3 steps.
    model = _model(seed=9)
    built = _build(model)
    load_checkpoint(root, built.optimizer, scheduler=built.scheduler, model=model)
    ref_model = _model()
    ref = _build(ref_model)
    _train(ref_model, ref, range(3))
    _assert_unchanged(stack_state(ref_model, ref), stack_state(model, built))

    # The next save clears the leftovers and commits normally.
    save_checkpoint(root, built.optimizer, step=5)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000003", "step_00000005"]
