"""`optstack train` end to end on a tiny model: loss falls, artefacts, exact resume, config errors."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from optstack.cli.main import main
from optstack.demo.config import config_to_dict, load_config, parse_override, to_toml

SETTINGS = [
    "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "data.max_bytes=60000",
    "train.batch_size=8", "train.eval_batches=2", "schedule.warmup_steps=3", "train.sample_bytes=40",
    "train.checkpoint_every=10",
]
TINY = [arg for s in SETTINGS for arg in ("--set", s)] + ["--no-progress"]


def run(out: Path, *args: str) -> int:
    return main(["train", "--out", str(out), *TINY, *args])


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 steps in one go, on a schedule that decays over 40 steps."""
    out = tmp_path_factory.mktemp("runs") / "straight"
    assert run(out, "--steps", "40", "--eval-every", "10", "--set", "schedule.decay_steps=40") == 0
    return out


def test_loss_falls_and_every_artefact_is_written(straight: Path) -> None:
    metrics = rows(straight)
    assert [r["step"] for r in metrics] == list(range(1, 41))
    first, last = metrics[0], metrics[-1]
    assert first["loss"] > 5.0  # ~ln(256) at initialisation
    assert sum(r["loss"] for r in metrics[-5:]) / 5 < first["loss"] - 1.5
    assert [r["step"] for r in metrics if r["val_loss"] is not None] == [10, 20, 30, 40]
    for key in ("lr", "grad_norm", "loss_scale", "skipped", "tokens_per_s", "peak_mem_mb"):
        assert key in last, key
    assert set(last["lr"]) == {"default"} and last["lr"]["default"] > 0 and not last["skipped"]
    assert math.isfinite(last["grad_norm"]) and last["peak_mem_mb"] > 0
    for name in ("config.toml", "groups.json", "loss.png", "lr.png", "grad_norm.png", "sample.txt",
                 "summary.json"):
        assert (straight / name).stat().st_size > 0, name
    checkpoints = sorted(p.name for p in (straight / "checkpoints").iterdir())
    assert checkpoints == ["latest", "step_00000030", "step_00000030.train_state.json",  # keep_checkpoints = 2
                           "step_00000040", "step_00000040.train_state.json"]
    assert (straight / "checkpoints" / "latest").read_text().strip() == "step_00000040"
    assert (straight / "checkpoints" / "step_00000040" / "group_map.json").is_file()
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["last_step"] == 40 and summary["best_val_loss"] < first["loss"]
    assert (straight / "sample.txt").read_text().startswith("def ")
    groups = json.loads((straight / "groups.json").read_text())
    no_wd = next(g for g in groups if g["settings"]["wd_mult"] == 0.0)
    assert "blocks.0.ln1.weight" in no_wd["params"]


def test_resume_repeats_the_uninterrupted_run(straight: Path, tmp_path: Path) -> None:
    out = tmp_path / "resumed"
    assert run(out, "--steps", "20", "--eval-every", "10", "--set", "schedule.decay_steps=40") == 0
    assert run(out, "--steps", "40", "--resume") == 0  # the rest comes from the run's own config.toml
    a, b = rows(straight), rows(out)
    assert [r["step"] for r in b] == list(range(1, 41))
    keys = ("loss", "val_loss", "grad_norm", "lr", "loss_scale", "skipped")
    assert [[r[k] for k in keys] for r in b] == [[r[k] for k in keys] for r in a]
    assert (out / "sample.txt").read_text() == (straight / "sample.txt").read_text()


def test_run_dir_and_resume_errors(
    straight: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(straight, "--steps", "40") == 2
    assert "--resume" in capsys.readouterr().err
    assert run(straight, "--steps", "40", "--resume", "--set", "model.d_model=64") == 2
    assert "model" in capsys.readouterr().err
    assert run(tmp_path / "empty", "--resume") == 2
    assert "config.toml" in capsys.readouterr().err
    (tmp_path / "nothing").mkdir()
    assert run(tmp_path / "x", "--data", str(tmp_path / "nothing")) == 2
    assert "no text files" in capsys.readouterr().err


def test_config_file_errors_name_the_key_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nsteps = 5\n\n[optimizer]\nlr = 0.001\nlearning_rate = 3\n")
    assert main(["train", "--config", str(bad), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "optimizer.learning_rate" in err and "line 6" in err and "Traceback" not in err
    bad.write_text("[train]\nsteps = 'many'\n")
    assert main(["train", "--config", str(bad), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "train.steps" in err and "line 2" in err and "int" in err
    bad.write_text("[modle]\nn_layer = 2\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "'modle'" in capsys.readouterr().err
    assert main(["train", "--set", "optimizer.adam.beta1=1.5"]) == 2
    assert "beta1" in capsys.readouterr().err
    assert main(["train", "--set", "steps=3"]) == 2
    assert "section.key=value" in capsys.readouterr().err
    assert main(["train", "--set", "model.compute_dtype=bf16"]) == 2
    assert "model.compute_dtype" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_config_layers_and_round_trip(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[optimizer]\nalgorithm = "lion"\n[train]\nsteps = 70\n')
    cfg = load_config(f, [parse_override("train.steps=90"), parse_override("optimizer.adam.beta2=0.95")])
    assert cfg.train.steps == 90 and cfg.optimizer.adam.beta2 == 0.95
    assert cfg.optimizer.algorithm == "lion" and cfg.optimizer.lr == 1e-3  # per-algorithm default lr
    assert cfg.optimizer.min_lr == pytest.approx(1e-4)
    assert load_config(overrides=[parse_override("optimizer.lr=1")]).optimizer.lr == 1.0  # int -> float
    saved = tmp_path / "saved.toml"
    saved.write_text(to_toml(config_to_dict(cfg)))
    assert load_config(saved) == cfg


def test_print_config_is_a_valid_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--print-config", "--optimizer", "sgd", "--steps", "77", "--bf16"]) == 0
    f = tmp_path / "printed.toml"
    f.write_text(capsys.readouterr().out)
    cfg = load_config(f)
    assert (cfg.optimizer.algorithm, cfg.train.steps, cfg.optimizer.precision) == ("sgd", 77, "bf16")


def test_grad_accumulation_matches_one_big_batch(tmp_path: Path) -> None:
    # Two micro-batches of 4 draw the same windows as one batch of 8 (one generator, drawn in sequence).
    common = ["--steps", "5", "--set", "train.sample_bytes=0", "--set", "schedule.warmup_steps=0"]
    assert run(tmp_path / "big", *common, "--batch-size", "8") == 0
    assert run(tmp_path / "accum", *common, "--batch-size", "4", "--grad-accum", "2") == 0
    big, accum = rows(tmp_path / "big"), rows(tmp_path / "accum")
    for a, b in zip(big, accum, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_default_warmup_follows_a_short_run():
    from optstack.demo.config import load_config

    assert load_config(overrides=[{"train": {"steps": 20}}]).warmup_steps == 2
    assert load_config().warmup_steps == 50  # the default 600-step run keeps its 50 warmup steps
    assert load_config(overrides=[{"schedule": {"warmup_steps": 7}}]).warmup_steps == 7


def test_demo_clips_at_one_explicitly(capsys: pytest.CaptureFixture[str]) -> None:
    # The core default is no clipping; the demo keeps its 1.0, visible in the resolved config.toml.
    assert load_config().optimizer.clip_grad == 1.0
    assert load_config(overrides=[parse_override("optimizer.clip_grad=0")]).optimizer.clip_grad == 0.0
    assert main(["train", "--print-config"]) == 0
    assert "\nclip_grad = 1.0\n" in capsys.readouterr().out


def test_resume_with_a_damaged_rng_state_names_the_file(straight: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "damaged"
    assert run(out, "--steps", "10", "--set", "schedule.decay_steps=40") == 0
    state = out / "checkpoints" / "step_00000010.train_state.json"
    data = json.loads(state.read_text())
    data["torch_rng"] = "AAAA" + data["torch_rng"][:40]  # valid base64, not a generator state
    state.write_text(json.dumps(data))
    capsys.readouterr()
    assert run(out, "--steps", "20", "--resume") == 2
    err = capsys.readouterr().err
    assert "step_00000010.train_state.json" in err and "torch_rng" in err and "Traceback" not in err


def test_checkpoints_are_saved_in_the_background(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "async"
    assert run(out, "--steps", "20", "--set", "schedule.decay_steps=40") == 0
    done = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("done:"))
    assert re.search(r"; 2 checkpoints saved in the background, training blocked \d+\.\d\d s by them", done)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "latest", "step_00000010", "step_00000010.train_state.json", "step_00000020",
        "step_00000020.train_state.json"]


def test_schedule_free_evaluates_the_averaged_weights_and_resumes_exactly(tmp_path: Path) -> None:
    # eval() before each evaluation puts x in the model, train() puts y back; the checkpoint (saved after)
    # resumes into the same run
    common = ["--optimizer", "schedule_free_adamw", "--eval-every", "6", "--set", "schedule.decay_steps=12"]
    assert run(tmp_path / "a", "--steps", "12", *common) == 0
    assert run(tmp_path / "b", "--steps", "6", *common) == 0
    assert run(tmp_path / "b", "--steps", "12", "--resume") == 0
    a, b = rows(tmp_path / "a"), rows(tmp_path / "b")
    assert [r["step"] for r in a if r["val_loss"] is not None] == [6, 12]
    keys = ("loss", "val_loss", "grad_norm")
    assert [[r[k] for k in keys] for r in b] == [[r[k] for k in keys] for r in a]
    assert a[-1]["loss"] < a[0]["loss"] - 0.5
