"""optstack.schedule against Megatron Core's OptimizerParamScheduler, value for value.

Skipped unless ``megatron.core`` imports (it is not a dependency; CI skips this file). To run it, install
megatron-core into a separate environment with the CPU torch pinned (see shared/PEERS.md).
"""

from __future__ import annotations

from typing import Any

import pytest

from optstack.schedule import LRSchedule, Scheduler, WDSchedule

megatron_scheduler = pytest.importorskip("megatron.core.optimizer_param_scheduler")

STEPS = [0, 1, 2, 9, 10, 11, 30, 59, 60, 61, 89, 90, 91, 95, 100, 119, 120, 121, 500]


class Groups:
    def __init__(self, groups: list[dict[str, Any]]) -> None:
        self.param_groups = [dict(g) for g in groups]


# lr_mult stays 1: recent Megatron no longer applies it (its max_lr/min_lr overrides replaced it).
GROUPS = [
    {"params": [], "wd_mult": 1.0, "lr_mult": 1.0},
    {"params": [], "wd_mult": 0.0, "lr_mult": 1.0, "max_lr": 3e-3, "min_lr": 2e-4},
    {"params": [], "wd_mult": 0.5, "lr_mult": 1.0, "min_lr": 0.0},
]

CASES = [
    dict(lr_decay_style=style, wsd_decay_steps=None, lr_wsd_decay_style=None)
    for style in ("constant", "linear", "cosine", "inverse-square-root")
] + [
    dict(lr_decay_style="WSD", wsd_decay_steps=wsd, lr_wsd_decay_style=wsd_style)
    for wsd in (0, 30, 115)
    for wsd_style in ("linear", "cosine", "exponential", "minus_sqrt")
]


def build_both(case: dict[str, Any], warmup: int, wd_style: str) -> tuple[Any, Scheduler]:
    wd_end = 0.1 if wd_style == "constant" else 0.3
    theirs = megatron_scheduler.OptimizerParamScheduler(
        Groups(GROUPS),
        init_lr=1e-4,
        max_lr=1e-3,
        min_lr=1e-5,
        lr_warmup_steps=warmup,
        lr_decay_steps=120,
        start_wd=0.1,
        end_wd=wd_end,
        wd_incr_steps=100,
        wd_incr_style=wd_style,
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=False,
        **case,
    )
    lr = LRSchedule(
        init_lr=1e-4,
        max_lr=1e-3,
        min_lr=1e-5,
        warmup_steps=warmup,
        decay_steps=120,
        style=case["lr_decay_style"],
        wsd_decay_steps=case["wsd_decay_steps"],
        wsd_style=case["lr_wsd_decay_style"] or "exponential",
    )
    wd = WDSchedule(start_wd=0.1, end_wd=wd_end, incr_steps=100, style=wd_style)
    return theirs, Scheduler(Groups(GROUPS), lr, wd)


@pytest.mark.parametrize("wd_style", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 10])
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c['lr_decay_style']}-{c['wsd_decay_steps']}-{c['lr_wsd_decay_style']}"
)
def test_group_values_match_megatron(case: dict[str, Any], warmup: int, wd_style: str) -> None:
    theirs, ours = build_both(case, warmup, wd_style)
    for step in STEPS:
        theirs.step(step - theirs.num_steps)
        ours.step(increment=step - ours.num_steps)
        for index, (a, b) in enumerate(
            zip(theirs.optimizer.param_groups, ours.optimizer.param_groups, strict=True)
        ):
            assert b["lr"] == pytest.approx(a["lr"], rel=1e-14, abs=0), (step, index)
            assert b["weight_decay"] == pytest.approx(a["weight_decay"], rel=1e-14, abs=0), (step, index)
            assert ours.group_lr(b) == pytest.approx(theirs.get_lr(a), rel=1e-14, abs=0)


# Megatron's state_dict key -> (our section, our field); see the report of issue 2 item 4.
STATE_KEYS = {
    "max_lr": ("lr", "max_lr"),
    "min_lr": ("lr", "min_lr"),
    "lr_warmup_steps": ("lr", "warmup_steps"),
    "lr_decay_steps": ("lr", "decay_steps"),
    "lr_decay_style": ("lr", "style"),
    "start_wd": ("wd", "start_wd"),
    "end_wd": ("wd", "end_wd"),
    "wd_incr_steps": ("wd", "incr_steps"),
    "wd_incr_style": ("wd", "style"),
}


def test_state_dict_fields_map_one_to_one() -> None:
    theirs, ours = build_both(CASES[2], 10, "linear")
    theirs.step(42)
    ours.step(increment=42)
    their_state, our_state = theirs.state_dict(), ours.state_dict()
    assert set(their_state) == set(STATE_KEYS) | {"num_steps"}
    assert their_state["num_steps"] == our_state["num_steps"]
    for key, (section, field) in STATE_KEYS.items():
        assert our_state[section][field] == their_state[key], key


def test_match_policy_rejects_what_megatron_rejects() -> None:
    theirs, ours = build_both(CASES[1], 10, "linear")
    their_state, our_state = theirs.state_dict(), ours.state_dict()
    their_state["max_lr"] = 2e-3
    our_state["lr"]["max_lr"] = 2e-3
    with pytest.raises(AssertionError):
        theirs.load_state_dict(their_state)
    with pytest.raises(ValueError, match="lr.max_lr"):
        ours.load_state_dict(our_state)
