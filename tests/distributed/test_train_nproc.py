"""`optstack train --nproc 2` end to end: the CLI as a subprocess starting two gloo ranks on a tiny model.

Two processes each take half of the same global batch, so their loss curve equals one process on that batch
to fp32 round-off; a two-process run stopped and resumed repeats the uninterrupted two-process run exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from optstack.cli.main import main
from optstack.demo.launch import RankFailed, _verdict, allowed_processes

SETTINGS = [
    "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "data.max_bytes=60000",
    "train.batch_size=8", "train.eval_batches=2", "schedule.warmup_steps=2", "train.sample_bytes=16",
    "train.checkpoint_every=3", "schedule.decay_steps=6", "train.device=cpu",  # gloo, even where CUDA is
]
TINY = [arg for s in SETTINGS for arg in ("--set", s)] + ["--no-progress", "--eval-every", "3"]
pytestmark = pytest.mark.skipif(allowed_processes("cpu")[0] < 2, reason="--nproc 2 needs 2 CPU cores")
KEYS = ("loss", "val_loss", "grad_norm", "lr", "loss_scale", "skipped")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``optstack`` in a fresh interpreter (the launcher spawns its ranks from there, as a user's shell would)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("OPTSTACK_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "optstack.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Six steps in one process (in place) and in two processes (the CLI), on the same global batch."""
    root = tmp_path_factory.mktemp("nproc")
    one, two = root / "one", root / "two"
    assert main(["train", "--out", str(one), "--steps", "6", *TINY]) == 0
    done = cli("train", "--out", str(two), "--steps", "6", "--nproc", "2", *TINY)
    assert done.returncode == 0, done.stderr
    return {"one": one, "two": two}


def test_two_processes_give_the_one_process_curve(runs: dict[str, Path]) -> None:
    one, two = rows(runs["one"]), rows(runs["two"])
    assert [r["step"] for r in two] == list(range(1, 7))
    assert [r["step"] for r in two if r["val_loss"] is not None] == [3, 6]
    for a, b in zip(one, two, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        if a["val_loss"] is not None:
            assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-5)
        assert b["lr"] == a["lr"] and b["skipped"] == a["skipped"] is False
    assert one[-1]["loss"] < one[0]["loss"] - 0.2  # it trains at all (lr warmed up by step 3)
    summary = json.loads((runs["two"] / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["last_step"] == 6
    assert "zero1" in (runs["two"] / "config.toml").read_text()  # the default sharding with --nproc > 1
    for name in ("loss.png", "sample.txt", "groups.json", "checkpoints/latest",
                 "checkpoints/step_00000006/group_map.json", "checkpoints/step_00000006.train_state.json"):
        assert (runs["two"] / name).stat().st_size > 0, name


def test_two_process_resume_repeats_the_uninterrupted_run(runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "resumed"
    first = cli("train", "--out", str(out), "--steps", "3", "--nproc", "2", *TINY)
    assert first.returncode == 0, first.stderr
    assert [r["step"] for r in rows(out)] == [1, 2, 3]
    second = cli("train", "--out", str(out), "--steps", "6", "--nproc", "2", "--resume", "--no-progress")
    assert second.returncode == 0, second.stderr
    assert "resumed" in second.stdout and "step_00000003" in second.stdout
    straight, resumed = rows(runs["two"]), rows(out)
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert [[r[k] for k in KEYS] for r in resumed] == [[r[k] for k in KEYS] for r in straight]
    assert (out / "sample.txt").read_text() == (runs["two"] / "sample.txt").read_text()


def test_how_ranks_ended_decides_what_the_launcher_raises() -> None:
    # The launcher's verdict over the ranks' reports (the worker -> queue -> launcher path runs above).
    summary = object()
    assert _verdict([None, None], {0: ("ok", summary), 1: ("ok", None)}, "r") is summary
    with pytest.raises(ValueError, match="bad lr"):  # a user error wins over its peers' collective failures
        _verdict([None, None], {0: ("error", "Traceback: CommError"), 1: ("user", "bad lr")}, "r")
    with pytest.raises(KeyboardInterrupt, match="interrupted at step 3"):
        _verdict([None, None], {0: ("interrupt", "interrupted at step 3"), 1: ("stopped", None)}, "r")
    with pytest.raises(RankFailed, match=r"rank 1 of 2:\nrank 1 exited with code -9(.|\n)*--resume --nproc 2"):
        _verdict([None, None], {0: ("error", "Traceback: CommError"), 1: ("died", "rank 1 exited with code -9")},
                 "r")


def test_nproc_beyond_the_machine_is_a_clear_error(tmp_path: Path) -> None:
    limit, _ = allowed_processes("cpu")
    done = cli("train", "--out", str(tmp_path / "r"), "--nproc", str(limit + 1), "--set", "train.device=cpu")
    assert done.returncode == 2
    assert f"--nproc {limit + 1} is more than this machine allows" in done.stderr and "cores" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "r").exists()


def test_a_batch_the_processes_cannot_split_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--out", str(tmp_path / "r"), "--nproc", "2", "--batch-size", "5",
                 "--set", "train.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert "train.batch_size (5) must be divisible by the number of processes (2)" in err
    assert main(["train", "--out", str(tmp_path / "r"), "--nproc", "0"]) == 2
    assert "--nproc must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
