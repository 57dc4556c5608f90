"""`optstack compare` on a tiny model: one run per optimizer, the two-panel plot and the table files."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from optstack.cli.main import main
from optstack.demo.compare import CompareRow, format_table

SETTINGS = [
    "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "data.max_bytes=60000",
    "train.batch_size=4", "train.eval_batches=1", "train.sample_bytes=0", "schedule.warmup_steps=1",
]
TINY = [arg for s in SETTINGS for arg in ("--set", s)] + ["--no-progress"]


def test_compare_writes_one_run_per_optimizer_a_plot_and_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cmp"
    assert main(["compare", "--out", str(out), "--steps", "4", *TINY]) == 0
    printed = capsys.readouterr().out
    names = ["adamw", "muon", "lion"]  # the default --optimizers
    for name in names:
        assert json.loads((out / name / "summary.json").read_text())["last_step"] == 4
        assert f"| {name}" in printed
        # the same schedule and data for each: eval every max(1, steps // 10) = 1 step
        metrics = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["val_loss"] is not None for r in metrics] == [True] * 4
    assert (out / "compare.png").stat().st_size > 10_000
    report = json.loads((out / "compare.json").read_text())
    assert [r["optimizer"] for r in report["rows"]] == names and report["baseline"] > 0
    assert [r["lr"] for r in report["rows"]] == [3e-3, 0.02, 1e-3]  # each optimizer's own default lr
    for row in report["rows"]:
        assert row["best_val_loss"] <= row["final_val_loss"] and row["tokens_per_s"] > 0
    with open(out / "compare.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["optimizer"] for r in table] == names and "train_seconds" in table[0]
    assert (out / "compare.md").read_text().startswith("| optimizer | lr | final val loss")


def test_compare_input_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--out", str(tmp_path / "c"), "--optimizers", "adamw,nosuch"]) == 2
    assert "nosuch" in capsys.readouterr().err
    assert main(["compare", "--out", str(tmp_path / "c"), "--optimizers", "adamw,adamw"]) == 2
    assert "distinct" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_table_marks_the_best_and_survives_missing_values() -> None:
    rows = [CompareRow("a", 0.1, 2.0, 1.9, 3.0, 100.0, 0, "x"), CompareRow("b", 0.2, None, None, 1.0, 50.0, 2, "y")]
    text = format_table(rows, baseline=3.1)
    assert "| a * | 0.1 | 2.0000 | 1.9000 |" in text and "| b | 0.2 | n/a | n/a |" in text
    assert "3.1000" in text


def test_compare_sweeps_each_optimizers_lr_and_keeps_the_best(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep"
    args = ["compare", "--out", str(out), "--steps", "2", "--optimizers", "adamw,soap,schedule_free_adamw",
            "--lr-sweep", "0.5,2", *TINY]
    assert main(args) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "compare.json").read_text())
    assert [r["optimizer"] for r in report["rows"]] == ["adamw", "soap", "schedule_free_adamw"]
    assert len(report["sweep"]) == 6  # every lr of every optimizer was a run of its own
    for name, default in (("adamw", 3e-3), ("soap", 3e-3), ("schedule_free_adamw", 3e-3)):
        runs = [r for r in report["sweep"] if r["optimizer"] == name]
        assert [r["lr"] for r in runs] == [default * 0.5, default * 2]
        for r in runs:
            assert json.loads((out / name / f"lr={r['lr']:g}" / "summary.json").read_text())["last_step"] == 2
        best = min(runs, key=lambda r: r["best_val_loss"])
        (row,) = [r for r in report["rows"] if r["optimizer"] == name]
        assert row["lr"] == best["lr"] and row["lrs_tried"] == [default * 0.5, default * 2]
    # Schedule-Free runs a constant schedule after warmup (its average replaces the decay); the others decay
    assert "constant" in (out / "schedule_free_adamw" / "lr=0.0015" / "config.toml").read_text()
    assert "cosine" in (out / "adamw" / "lr=0.0015" / "config.toml").read_text()
    assert "lrs tried" in printed and (out / "compare.png").stat().st_size > 10_000


def test_bad_lr_sweep_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("0,1", "a,b", "1,1", ""):
        assert main(["compare", "--out", str(tmp_path / "c"), "--lr-sweep", bad]) == 2
        assert "--lr-sweep must list distinct positive factors" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
