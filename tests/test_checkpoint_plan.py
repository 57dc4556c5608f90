"""The pure parts of checkpointing: who writes what (replicated state once, balanced bytes, ranges that tile
every parameter), and the checks of a checkpoint against an optimizer."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from optstack.checkpoint.manifest import chunk_runs, overlapping
from optstack.checkpoint.state import HeldParam, check_load, plan_save
from optstack.layout import BufferLayout

IDENTITY = {"algorithm": "AdamW", "is_expert_parallel": False, "max_lr": 0.01, "min_lr": 0.0, "wd_mult": 1.0,
            "lr_mult": 1.0}


def _held(name: str, shape: tuple[int, ...], start: int, end: int, **identity: object) -> HeldParam:
    return HeldParam(name, shape, start, end, {"param": "float32", "exp_avg": "float32"},
                     {"step": {"tensor": "float32", "value": 3.0}}, {**IDENTITY, **identity}, {"lr": 0.001})


def test_replicated_state_is_written_once_and_balanced() -> None:
    tables = [{n: _held(n, (10,), 0, 10) for n in "abcd"} for _ in range(2)]
    plan = plan_save(tables, None)
    assert sorted(len(w) for w in plan.writes) == [2, 2]
    assert sorted(n for w in plan.writes for n, _, _ in w) == ["a", "b", "c", "d"]
    assert all(len(plan.params[n]["chunks"]) == 1 for n in "abcd")


def test_zero1_ranges_are_written_by_their_owners() -> None:
    tables = [{"w": _held("w", (4, 5), 0, 7), "b": _held("b", (5,), 0, 5)},
              {"w": _held("w", (4, 5), 7, 20)}]
    plan = plan_save(tables, [{"x": ((3,), "bfloat16")}] * 2)
    assert plan.params["w"]["chunks"] == [[0, 0, 7], [1, 7, 20]]
    assert plan.writes[1] == [("w", 7, 20)]
    assert plan.model == {"x": {"shape": [3], "dtype": "bfloat16", "rank": 0}}  # rank 0 wrote fewer bytes
    assert [g["identity"] for g in plan.groups] == [IDENTITY]


def test_ranges_must_tile_each_parameter() -> None:
    with pytest.raises(ValueError, match=r"ranges of 'w' \(\[\(0, 7\), \(8, 20\)\]\) do not tile its 20"):
        plan_save([{"w": _held("w", (20,), 0, 7)}, {"w": _held("w", (20,), 8, 20)}], None)
    with pytest.raises(ValueError, match="do not tile"):
        plan_save([{"w": _held("w", (20,), 0, 12)}, {"w": _held("w", (20,), 8, 20)}], None)
    with pytest.raises(ValueError, match="ranks disagree on the shape of 'w'"):
        plan_save([{"w": _held("w", (20,), 0, 20)}, {"w": _held("w", (4, 5), 0, 20)}], None)
    clash = _held("e", (3,), 0, 3)
    with pytest.raises(ValueError, match=r"ranks 0 and 1 hold different values for elements \[0, 3\) of 'e'"):
        plan_save([{"e": clash}, {"e": dataclasses.replace(clash, fingerprint="1.5")}], None)
    with pytest.raises(ValueError, match="rank 1's model differs"):
        plan_save([{}, {}], [{"x": ((3,), "float32")}, {"x": ((4,), "float32")}])


def test_check_load_names_every_difference() -> None:
    tables = [{"w": _held("w", (4, 5), 0, 20), "b": _held("b", (5,), 0, 5)}]
    plan = plan_save(tables, [{"x": ((3,), "float32")}])
    manifest = {"params": plan.params, "groups": plan.groups, "model": plan.model}
    assert check_load(manifest, tables[0], {"x": ((3,), "float32")}) == []
    here = {"w": _held("w", (4, 6), 0, 24), "c": _held("c", (5,), 0, 5, max_lr=0.02)}
    errors = check_load(manifest, here, {"x": ((3,), "bfloat16"), "y": ((1,), "float32")})
    assert errors == [
        "the checkpoint has 1 parameters this optimizer does not: 'b'",
        "this optimizer has 1 parameters the checkpoint does not: 'c'",
        "parameter 'w' has shape (4, 5) in the checkpoint, (4, 6) here",
        "this model has tensors the checkpoint does not: 'y'",
        "model tensor 'x' is (3,) float32 in the checkpoint, (3,) bfloat16 here",
    ]
    regrouped = {"w": _held("w", (4, 5), 0, 20, wd_mult=0.0, algorithm="Muon"), "b": _held("b", (5,), 0, 5)}
    assert check_load(manifest, regrouped, None) == [
        "parameter 'w' is in a different group: algorithm 'AdamW' in the checkpoint, 'Muon' here; wd_mult 1.0 in "
        "the checkpoint, 0.0 here"]


@pytest.mark.parametrize("dp", [1, 3, 16, 97])
def test_runs_are_every_ranks_owned_slices(dp: int) -> None:
    """What a manifest derives from the plan: each parameter's runs are exactly every rank's ``owned_slice``,
    and ``overlapping`` walks them as a scan of every rank would."""
    rng = random.Random(dp)
    shapes = [(rng.randrange(1, 300), rng.randrange(1, 40)) for _ in range(30)] + [(0,), (7,)]
    layout = BufferLayout.plan([(f"p{i}", s) for i, s in enumerate(shapes)], dp_size=dp, bucket_size=2000,
                               shard_align=8, param_align=4)
    for i, shape in enumerate(shapes):
        name, numel = f"p{i}", math.prod(shape)
        runs = layout.runs(name)
        assert len(runs) <= 3
        parts = [(first + k, lo + k * (hi - lo), hi + k * (hi - lo)) for first, lo, hi, count in runs
                 for k in range(count)]
        owned = [(r, s.param_start, s.param_end) for r in range(dp) if (s := layout.owned_slice(name, r))]
        assert parts == owned
        for _ in range(10):
            a = rng.randrange(numel + 1)
            b = rng.randrange(a, numel + 1)
            assert list(overlapping(chunk_runs([list(r) for r in runs]), a, b)) == [
                (r, max(s, a), min(e, b)) for r, s, e in owned if max(s, a) < min(e, b)]
