"""``optstack plan``: presets on the meta device, per-rank figures, JSON, and clear errors."""

from __future__ import annotations

import json

import pytest

from optstack.cli.main import main


def test_plan_70b_muon_at_1024_ranks_json(capsys):
    assert main(["plan", "--preset", "70b", "--dp", "1024", "--algorithm", "muon", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dp"] == 1024 and 70e9 < out["parameters"] < 71e9
    assert all(b["padding_fraction"] <= 0.05 for b in out["buffers"])
    assert {s["algorithm"]: s["placement"] for s in out["stages"]} == {"muon": "zero1_owners", "adamw": "zero1"}
    assert out["owner_balance"] <= 1.25
    assert [r["rank"] for r in out["ranks"]] == sorted({0, 1023, out["most"]["rank"]})


def test_plan_table_names_the_choice_and_the_rank_holding_most(capsys):
    assert main(["plan", "--preset", "7b", "--dp", "8", "--set", "distributed.bucket_size=50000000"]) == 0
    text = capsys.readouterr().out
    assert "adamw: zero1" in text and "<- most" in text and "comm/step" in text


def test_plan_bad_input_is_one_clear_error(capsys):
    assert main(["plan", "--dp", "0"]) == 2
    assert "--dp must be >= 1" in capsys.readouterr().err
    assert main(["plan", "--dp", "4", "--ranks", "9"]) == 2
    assert "--ranks must name ranks in [0, 4)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--preset", "1t"])
