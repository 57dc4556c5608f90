"""`optstack groups` (tables and JSON) and the command line's handling of user errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from optstack.cli.main import main
from optstack.demo.plots import lr_series
from optstack.demo.train import group_label


def groups_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["groups", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_biases_and_norms_get_no_weight_decay(capsys: pytest.CaptureFixture[str]) -> None:
    report = groups_json(capsys)
    rows = {r["name"]: r for r in report["parameters"]}
    assert rows["blocks.0.attn.qkv.bias"]["wd_mult"] == 0.0
    assert rows["blocks.0.ln1.weight"]["wd_mult"] == 0.0 and rows["ln_f.bias"]["wd_mult"] == 0.0
    assert rows["blocks.0.attn.qkv.weight"]["wd_mult"] == 1.0 and rows["head.weight"]["wd_mult"] == 1.0
    assert rows["blocks.0.ln1.weight"]["rules"]["wd_mult"] == ["no weight decay on biases and 1-D params"]
    assert rows["blocks.0.attn.qkv.weight"]["rules"] == {}
    # without decoupled lr, embeddings share the base lr
    assert rows["tok_emb.weight"]["max_lr"] == rows["blocks.0.mlp.fc.weight"]["max_lr"]
    # the per-group summary covers every parameter exactly once
    assert sum(g["count"] for g in report["groups"]) == len(rows)
    assert sum(g["numel"] for g in report["groups"]) == sum(r["numel"] for r in rows.values())
    assert sorted(n for g in report["groups"] for n in g["params"]) == sorted(rows)


def test_decoupled_lr_goes_to_embedding_and_output(capsys: pytest.CaptureFixture[str]) -> None:
    report = groups_json(capsys, "--lr", "0.001", "--decoupled-lr", "0.01", "--decoupled-min-lr", "0.002")
    rows = {r["name"]: r for r in report["parameters"]}
    for name in ("tok_emb.weight", "pos_emb.weight", "head.weight"):
        assert (rows[name]["max_lr"], rows[name]["min_lr"]) == (0.01, 0.002)
        assert rows[name]["rules"]["max_lr"] == ["decoupled LR for embedding and output"]
    assert rows["blocks.1.mlp.fc.weight"]["max_lr"] == 0.001
    assert rows["blocks.1.mlp.fc.bias"]["max_lr"] == 0.001
    assert len({r["group"] for r in rows.values()}) == 3  # default, decoupled, no-wd


def test_muon_routes_what_it_cannot_take_to_adamw(capsys: pytest.CaptureFixture[str]) -> None:
    rows = {r["name"]: r for r in groups_json(capsys, "--optimizer", "muon")["parameters"]}
    assert rows["blocks.0.attn.qkv.weight"]["algorithm"] == "muon"
    for name in ("tok_emb.weight", "head.weight", "blocks.0.attn.qkv.bias", "ln_f.weight"):
        assert rows[name]["algorithm"] == "adamw", name


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["groups", "--decoupled-lr", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "parameter" in out and "decided by" in out and "numel" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("blocks.0.attn.qkv.bias"))
    assert "no weight decay" in line
    assert "decoupled LR" in next(ln for ln in out.splitlines() if ln.startswith("head.weight"))


def test_model_factory_spec(capsys: pytest.CaptureFixture[str]) -> None:
    report = groups_json(capsys, "--model", "optstack.demo.gpt:build_demo_model")
    assert report["parameters"][0]["name"] == "tok_emb.weight"
    bad = [("nocolon", "package.module:factory"), ("no_such_module_x:f", "cannot import"),
           ("optstack.demo.gpt:nothing", "no callable"), ("optstack.demo.gpt:GPTConfig", "nn.Module"),
           (".relative:build", "package.module:factory"), ("optstack.demo.gpt:a.b", "package.module:factory")]
    for spec, message in bad:
        assert main(["groups", "--model", spec]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


def test_user_errors_exit_2_without_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["groups", "--lr", "-1"]) == 2
    assert "lr" in capsys.readouterr().err
    assert main(["train", "--nproc", "0"]) == 2
    assert "--nproc" in capsys.readouterr().err
    assert main(["train", "--resume"]) == 2
    assert "--out" in capsys.readouterr().err
    assert main([]) == 2
    with pytest.raises(SystemExit) as exit_info:
        main(["groups", "--no-such-flag"])
    assert exit_info.value.code == 2


def test_factory_that_needs_arguments_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["groups", "--model", "torch.nn:Linear"]) == 2
    err = capsys.readouterr().err
    assert "'torch.nn:Linear'" in err and "callable with no arguments" in err
    assert "in_features, out_features" in err and "wrap it in a function" in err
    assert "Traceback" not in err and "TypeError" not in err


@pytest.mark.parametrize("command", ["train", "groups", "compare"])
def test_unknown_option_prints_the_subcommands_usage(capsys: pytest.CaptureFixture[str], command: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--stepz", "3"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: optstack {command} ")
    assert f"optstack {command}: error: unrecognized arguments: --stepz 3" in err


def test_lr_plot_has_one_line_per_param_group() -> None:
    # Two groups of one kind ("default") with different lrs: the old `lr` dict kept only one of them.
    rows = [{"step": s, "lr": {"default": 0.5 * s}, "group_lr": [1.0 * s, 0.5 * s]} for s in (1, 2)]
    series = lr_series(rows, ["0: default (a.weight +3)", "1: lr_mult=0.5 (b.weight)"])
    assert series == {"0: default (a.weight +3)": [(1, 1.0), (2, 2.0)],
                      "1: lr_mult=0.5 (b.weight)": [(1, 0.5), (2, 1.0)]}
    assert list(lr_series(rows)) == ["group 0", "group 1"]
    # metrics written before group_lr: one line per kind, as before
    old = [{"step": 1, "lr": {"default": 0.1, "max_lr=0.01": 0.01}}]
    assert lr_series(old) == {"default": [(1, 0.1)], "max_lr=0.01": [(1, 0.01)]}


def test_group_label_names_index_difference_and_first_param() -> None:
    group = {"param_names": ["b.weight", "c.weight"], "lr_mult": 0.5, "default_config": True}
    assert group_label(1, group, "adamw") == "1: lr_mult=0.5 (b.weight +1)"
    routed = {"param_names": ["n.bias"], "algorithm": "adamw", "default_config": False, "max_lr": 0.01}
    assert group_label(2, routed, "muon") == "2: max_lr=0.01,adamw (n.bias)"
    assert group_label(0, {"param_names": []}, "adamw") == "0: default (empty)"


def test_metrics_log_every_groups_lr(tmp_path: Path) -> None:
    out = tmp_path / "run"
    tiny = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.seq_len=16", "data.max_bytes=20000",
            "train.batch_size=4", "train.eval_batches=1", "train.sample_bytes=0", "schedule.warmup_steps=1",
            "optimizer.algorithm=muon"]
    assert main(["train", "--out", str(out), "--steps", "2", "--no-progress",
                 *(a for s in tiny for a in ("--set", s))]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    groups = json.loads((out / "groups.json").read_text())
    for row in rows:
        assert len(row["group_lr"]) == len(groups) == 3  # muon, adamw (no decay), adamw (embeddings)
        assert set(row["lr"].values()) <= set(row["group_lr"])  # the old per-kind dict is still there
    assert (out / "lr.png").stat().st_size > 0
