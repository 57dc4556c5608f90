"""Tests for optstack.schedule: LR/WD values at every boundary, the Scheduler, checkpoints, bad input.

Expected values are written out by hand (closed forms such as cos(pi/4) = sqrt(2)/2 evaluated once), not
recomputed with the module's own formulas.
"""

from __future__ import annotations

import io
import math
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from optstack.schedule import LRSchedule, Scheduler, WDSchedule

# One shape used throughout: 10 warmup steps to 1.0, decay to 0.1 at step 110 (100 decay steps).
BASE: dict[str, Any] = dict(init_lr=0.0, max_lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=110)
FAR = 10**9


def lr_at(schedule: LRSchedule, steps: list[int]) -> list[float]:
    return [schedule(s) for s in steps]


# ---------------------------------------------------------------------------------------------- LR styles
BOUNDARY_STEPS = [0, 1, 9, 10, 11, 35, 60, 110, 111, FAR]
WARMUP_PART = [0.0, 0.1, 0.9, 1.0]  # steps 0, 1, warmup-1, warmup


@pytest.mark.parametrize(
    "style, after_warmup",
    [
        # steps 11 (first decay step), 35 (r=1/4), 60 (r=1/2), 110 (decay end), 111, far beyond
        ("linear", [0.991, 0.775, 0.55, 0.1, 0.1, 0.1]),
        ("cosine", [0.9997779521645792, 0.8681980515339464, 0.55, 0.1, 0.1, 0.1]),
        ("constant", [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
    ],
)
def test_lr_boundaries_linear_cosine_constant(style: str, after_warmup: list[float]) -> None:
    schedule = LRSchedule(**BASE, style=style)
    assert lr_at(schedule, BOUNDARY_STEPS) == pytest.approx(WARMUP_PART + after_warmup, rel=1e-12, abs=1e-15)


def test_warmup_starts_at_init_lr() -> None:
    schedule = LRSchedule(init_lr=0.2, max_lr=1.0, warmup_steps=4, decay_steps=8, style="linear")
    assert lr_at(schedule, [0, 1, 2, 4]) == pytest.approx([0.2, 0.4, 0.6, 1.0])
    # after the warmup the decay is from max_lr to min_lr (0.0): r = (6 - 4) / (8 - 4)
    assert schedule(6) == pytest.approx(0.5)


def test_no_warmup_starts_at_max_lr() -> None:
    schedule = LRSchedule(max_lr=1.0, min_lr=0.0, decay_steps=4, style="linear")
    assert lr_at(schedule, [0, 1, 2, 4, 5]) == pytest.approx([1.0, 0.75, 0.5, 0.0, 0.0])


def test_warmup_equal_to_decay_steps_is_allowed() -> None:
    # Megatron asserts warmup < decay; we accept equality: warm up to max_lr, then min_lr.
    linear = LRSchedule(max_lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=10, style="linear")
    assert lr_at(linear, [0, 5, 10, 11]) == pytest.approx([0.0, 0.5, 1.0, 0.1])
    constant = LRSchedule(max_lr=1.0, warmup_steps=10, decay_steps=10, style="constant")
    assert lr_at(constant, [10, 11, FAR]) == [1.0, 1.0, 1.0]


def test_inverse_square_root_with_warmup() -> None:
    schedule = LRSchedule(
        max_lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=1000, style="inverse-square-root"
    )
    steps = [0, 1, 3, 4, 5, 16, 64, 400, 900, 1000, 1001, FAR]
    # max_lr * sqrt(4) / sqrt(step), floored at min_lr; min_lr after decay_steps
    expected = [0.0, 0.25, 0.75, 1.0, 0.8944271909999159, 0.5, 0.25, 0.1, 0.1, 0.1, 0.1, 0.1]
    assert lr_at(schedule, steps) == pytest.approx(expected, rel=1e-12)


def test_inverse_square_root_without_warmup_uses_max_of_one() -> None:
    schedule = LRSchedule(max_lr=1.0, min_lr=0.0, decay_steps=100, style="inverse-square-root")
    assert lr_at(schedule, [0, 1, 4, 25, 100, 101]) == pytest.approx([1.0, 1.0, 0.5, 0.2, 0.1, 0.0])


# WSD: warmup 10, decay_steps 110, the last 20 anneal (anneal start 90); min_lr 0 so coeff == lr.
WSD_STEPS = [0, 1, 9, 10, 11, 60, 90, 91, 95, 100, 110, 111, FAR]


@pytest.mark.parametrize(
    "wsd_style, at_95, at_100",
    [  # r = 1/4 at step 95, r = 1/2 at step 100
        ("linear", 0.75, 0.5),
        ("cosine", 0.8535533905932737, 0.5),  # (1 + sqrt(2)/2) / 2
        ("exponential", 0.681792830507429, 0.41421356237309515),  # 2 * 2**-r - 1
        ("minus_sqrt", 0.5, 0.2928932188134524),  # 1 - sqrt(r)
    ],
)
def test_wsd_each_decay_style(wsd_style: str, at_95: float, at_100: float) -> None:
    schedule = LRSchedule(
        max_lr=1.0,
        min_lr=0.0,
        warmup_steps=10,
        decay_steps=110,
        style="WSD",
        wsd_decay_steps=20,
        wsd_style=wsd_style,
    )
    at_91 = {
        "linear": 0.95,
        "cosine": 0.9938441702975689,
        "exponential": 0.9318726578496912,
        "minus_sqrt": 0.7763932022500211,
    }[wsd_style]  # r = 1/20
    expected = [0.0, 0.1, 0.9, 1.0, 1.0, 1.0, 1.0, at_91, at_95, at_100, 0.0, 0.0, 0.0]
    assert lr_at(schedule, WSD_STEPS) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_wsd_default_decay_style_is_exponential_and_respects_min_lr() -> None:
    schedule = LRSchedule(
        max_lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=110, style="WSD", wsd_decay_steps=20
    )
    assert schedule.wsd_style == "exponential"
    assert schedule(91) == pytest.approx(0.9386853920647221, rel=1e-12)  # 0.1 + 0.9 * (2 * 2**-0.05 - 1)
    assert schedule(110) == pytest.approx(0.1)


def test_wsd_zero_decay_steps_stays_flat_until_decay_steps() -> None:
    schedule = LRSchedule(max_lr=1.0, min_lr=0.1, decay_steps=50, style="WSD", wsd_decay_steps=0)
    assert lr_at(schedule, [0, 49, 50, 51]) == [1.0, 1.0, 1.0, 0.1]


def test_wsd_anneal_may_start_inside_warmup() -> None:
    # anneal start = 20 - 15 = 5 < warmup 10: the first step after the warmup already anneals (as Megatron)
    schedule = LRSchedule(
        max_lr=1.0, warmup_steps=10, decay_steps=20, style="WSD", wsd_decay_steps=15, wsd_style="linear"
    )
    assert schedule(10) == 1.0
    assert schedule(11) == pytest.approx(0.6)  # r = (11 - 5) / 15


def test_per_group_max_and_min_lr_override() -> None:
    schedule = LRSchedule(**BASE, style="linear")
    # warmup from the schedule's init_lr to the group's max_lr
    assert schedule(5, max_lr=2.0) == pytest.approx(1.0)
    assert schedule(60, max_lr=2.0, min_lr=0.2) == pytest.approx(1.1)
    assert schedule(FAR, min_lr=0.05) == 0.05
    assert schedule(60, max_lr=None, min_lr=None) == schedule(60)


# ---------------------------------------------------------------------------------------------- WD
def test_wd_linear_cosine_constant() -> None:
    linear = WDSchedule(start_wd=0.0, end_wd=0.1, incr_steps=100, style="linear")
    assert [linear(s) for s in (0, 1, 50, 100, 101, FAR)] == pytest.approx([0.0, 0.001, 0.05, 0.1, 0.1, 0.1])
    cosine = WDSchedule(start_wd=0.0, end_wd=0.1, incr_steps=100, style="cosine")
    expected = [0.0, 0.014644660940672627, 0.05, 0.1, 0.1]  # step 25: 0.1 * (1 - sqrt(2)/2) / 2
    assert [cosine(s) for s in (0, 25, 50, 100, 101)] == pytest.approx(expected, rel=1e-12, abs=1e-15)
    constant = WDSchedule.constant(0.1)
    assert [constant(s) for s in (0, 1, FAR)] == [0.1, 0.1, 0.1]


def test_wd_may_fall_and_groups_may_override_ends() -> None:
    falling = WDSchedule(start_wd=0.1, end_wd=0.0, incr_steps=10, style="linear")
    assert falling(5) == pytest.approx(0.05)
    assert falling(5, start_wd=0.2, end_wd=0.4) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="start_wd == end_wd"):
        WDSchedule.constant(0.1)(3, end_wd=0.2)


# ---------------------------------------------------------------------------------------------- Scheduler
class Groups:
    """Not a torch optimizer: anything with param_groups will do (e.g. a chained optimizer)."""

    def __init__(self, *groups: dict[str, Any]) -> None:
        self.param_groups = [dict(g) for g in groups]


def make_scheduler(
    *groups: dict[str, Any],
    on_checkpoint: str = "match",
    lr: LRSchedule | None = None,
    wd: WDSchedule | None = None,
) -> Scheduler:
    return Scheduler(
        Groups(*(groups or ({"params": []},))),
        lr or LRSchedule(**BASE, style="linear"),
        wd or WDSchedule(start_wd=0.0, end_wd=0.1, incr_steps=100, style="linear"),
        on_checkpoint=on_checkpoint,
    )


def test_construction_applies_step_zero() -> None:
    sched = make_scheduler()
    group = sched.optimizer.param_groups[0]
    assert sched.num_steps == 0
    assert (group["lr"], group["weight_decay"]) == (0.0, 0.0)


def test_step_increments_and_writes_every_group() -> None:
    sched = make_scheduler(
        {"params": []},
        {"params": [], "max_lr": 2.0, "min_lr": 0.2, "lr_mult": 0.5, "wd_mult": 0.0},
        {"params": [], "max_lr": None, "wd_mult": 2.0, "start_wd": 0.1, "end_wd": 0.3},
    )
    sched.step()
    sched.step(increment=59)
    assert sched.num_steps == 60
    plain, custom, wd_group = sched.optimizer.param_groups
    assert (plain["lr"], plain["weight_decay"]) == pytest.approx((0.55, 0.06))
    assert (custom["lr"], custom["weight_decay"]) == pytest.approx((1.1 * 0.5, 0.0))
    assert (wd_group["lr"], wd_group["weight_decay"]) == pytest.approx((0.55, 2.0 * 0.22))
    # group_lr is before lr_mult (as Megatron's get_lr); get_wd is before wd_mult
    assert sched.group_lr(custom) == pytest.approx(1.1)
    assert sched.get_wd() == pytest.approx(0.06)
    assert sched.get_wd(wd_group) == pytest.approx(0.22)
    sched.step(increment=0)
    assert sched.num_steps == 60


def test_scheduler_drives_torch_adamw() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([{"params": [p], "lr_mult": 1.0}], lr=123.0, weight_decay=123.0, eps=1e-12)
    sched = Scheduler(opt, LRSchedule(**BASE, style="linear"), WDSchedule.constant(0.01))
    assert opt.param_groups[0]["lr"] == 0.0 and opt.param_groups[0]["weight_decay"] == 0.01
    sched.step(increment=10)
    assert opt.param_groups[0]["lr"] == 1.0
    p.grad = torch.full((3,), 0.5)
    opt.step()
    # first AdamW step: p * (1 - lr * wd) - lr * g / |g|  = 1 * (1 - 0.01) - 1
    torch.testing.assert_close(p.detach(), torch.full((3,), -0.01))
    assert opt.state_dict()["param_groups"][0]["lr"] == 1.0


def test_step_failure_changes_nothing() -> None:
    sched = make_scheduler({"params": []}, {"params": []})
    sched.step(increment=5)
    groups = sched.optimizer.param_groups
    before = [dict(g) for g in groups]
    groups[1]["min_lr"] = 5.0  # now above the schedule's max_lr
    with pytest.raises(ValueError, match=r"param group 1: min_lr \(5.0\) must be <= max_lr \(1.0\)"):
        sched.step()
    assert sched.num_steps == 5
    assert groups[0] == before[0]
    with pytest.raises(ValueError, match="increment"):
        sched.step(increment=-1)


# ---------------------------------------------------------------------------------------------- torch surface
def test_is_a_torch_lr_scheduler_over_any_param_groups() -> None:
    # accelerate's prepare() wraps only LRScheduler instances; a plain param_groups holder still works.
    sched = make_scheduler()
    assert isinstance(sched, torch.optim.lr_scheduler.LRScheduler)
    assert isinstance(sched.optimizer, Groups)
    assert sched.get_last_lr() == [0.0] and sched.last_epoch == 0
    sched._step_count += 1  # what accelerate does on accumulation steps; torch's counter, not our state
    sched.step()
    assert sched.last_epoch == 1


def test_torch_surface_values_after_several_steps() -> None:
    sched = make_scheduler({"params": []}, {"params": [], "max_lr": 2.0, "min_lr": 0.2, "lr_mult": 0.25})
    for _ in range(3):
        sched.step()
    groups = sched.optimizer.param_groups
    assert sched.last_epoch == sched.num_steps == 3
    assert sched.base_lrs == [1.0, 0.5]  # max_lr * lr_mult
    # step 3 of a 10-step warmup from 0: 0.3 of max_lr, times lr_mult
    assert sched.get_last_lr() == pytest.approx([0.3, 0.15])
    assert sched.get_last_lr() == [g["lr"] for g in groups]
    assert sched.get_lr() == sched.get_last_lr()
    groups[1]["lr"] = 9.0  # someone else's write: get_last_lr is what the scheduler wrote
    assert sched.get_last_lr() == pytest.approx([0.3, 0.15])
    sched.get_last_lr()[0] = 5.0  # a copy: the caller cannot corrupt it
    assert sched.get_last_lr()[0] == pytest.approx(0.3)


def test_last_epoch_is_settable_and_step_continues_from_it() -> None:
    sched = make_scheduler({"params": []})
    sched.last_epoch = 60
    assert sched.num_steps == 60
    assert sched.get_last_lr() == pytest.approx([0.55])
    assert sched.optimizer.param_groups[0]["lr"] == pytest.approx(0.55)
    sched.step()
    assert sched.last_epoch == 61
    assert sched.get_last_lr() == pytest.approx([1.0 - 0.9 * 51 / 100])
    with pytest.raises(ValueError, match="last_epoch must be an integer >= 0, got -1"):
        sched.last_epoch = -1
    assert sched.last_epoch == 61


def test_step_epoch_sets_the_step_and_warns_increment_advances() -> None:
    sched = make_scheduler({"params": []})
    sched.step(increment=20)
    with pytest.warns(UserWarning, match=r"sets the step to 7 \(it was 20\).*step\(increment=n\)"):
        sched.step(7)
    assert sched.last_epoch == 7
    assert sched.get_last_lr() == pytest.approx([0.7])
    with pytest.raises(ValueError, match="not both"):
        sched.step(5, increment=1)
    with pytest.raises(ValueError, match="epoch must be an integer >= 0, got -1"):
        sched.step(-1)
    assert sched.last_epoch == 7


def test_torch_adamw_in_a_torch_loop() -> None:
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = torch.optim.AdamW([{"params": [ours[0]]}, {"params": [ours[1]], "lr_mult": 0.5}], lr=99.0)
    sched = Scheduler(opt, LRSchedule(max_lr=0.1, min_lr=0.01, warmup_steps=2, decay_steps=6, style="linear"),
                      WDSchedule.constant(0.01))
    ref_opt = torch.optim.AdamW([{"params": [ref[0]]}, {"params": [ref[1]]}], lr=0.0, weight_decay=0.01)
    # warmup 0 -> 0.1 over 2 steps, then linear to 0.01 at step 6 (r = 1/4 per step)
    expected = [0.0, 0.05, 0.1, 0.0775, 0.055, 0.0325, 0.01, 0.01]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no torch "step order" or deprecation warnings on the plain path
        for step, lr in enumerate(expected):
            assert sched.get_last_lr() == pytest.approx([lr, lr / 2], abs=1e-15)
            for group, group_lr in zip(ref_opt.param_groups, (lr, lr / 2), strict=True):
                group["lr"] = group_lr
            for params, o in ((ours, opt), (ref, ref_opt)):
                o.zero_grad()
                sum((p * p).sum() * (i + 1) for i, p in enumerate(params)).backward()
                o.step()
            sched.step()
            assert sched.last_epoch == step + 1
    for p, q in zip(ours, ref, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert not torch.equal(ours[0], ref[0].new_zeros(4))


def test_lr_schedule_default_style_is_cosine() -> None:
    schedule = LRSchedule(max_lr=1.0, decay_steps=10)
    assert schedule.style == "cosine"
    assert lr_at(schedule, [0, 5, 10]) == pytest.approx([1.0, 0.5, 0.0], abs=1e-15)


# ---------------------------------------------------------------------------------------------- state
def test_state_round_trip_through_torch_save() -> None:
    source = make_scheduler({"params": [], "max_lr": 2.0})
    source.step(increment=37)
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    target = make_scheduler({"params": [], "max_lr": 2.0})
    target.load_state_dict(state)
    assert target.num_steps == 37
    assert target.last_epoch == 37 and target.get_last_lr() == source.get_last_lr() != [0.0]
    assert target.optimizer.param_groups == source.optimizer.param_groups
    assert target.state_dict() == source.state_dict()
    assert state == {
        "version": 1,
        "num_steps": 37,
        "lr": {
            "init_lr": 0.0,
            "max_lr": 1.0,
            "min_lr": 0.1,
            "warmup_steps": 10,
            "decay_steps": 110,
            "style": "linear",
            "wsd_decay_steps": None,
            "wsd_style": "exponential",
        },
        "wd": {"start_wd": 0.0, "end_wd": 0.1, "incr_steps": 100, "style": "linear"},
    }


def other_checkpoint(num_steps: int = 60) -> dict[str, Any]:
    other = make_scheduler(
        lr=LRSchedule(**{**BASE, "max_lr": 2.0}, style="cosine"),
        wd=WDSchedule(start_wd=0.0, end_wd=0.2, incr_steps=100, style="linear"),
    )
    other.step(increment=num_steps)
    return other.state_dict()


def test_match_policy_names_every_differing_field_and_changes_nothing() -> None:
    sched = make_scheduler()
    sched.step(increment=3)
    before = sched.state_dict(), dict(sched.optimizer.param_groups[0])
    with pytest.raises(ValueError) as error:
        sched.load_state_dict(other_checkpoint())
    message = str(error.value)
    for piece in (
        "lr.max_lr: constructor 1.0, checkpoint 2.0",
        "lr.style: constructor 'linear', checkpoint 'cosine'",
        "wd.end_wd: constructor 0.1, checkpoint 0.2",
        "use_checkpoint",
        "use_class",
    ):
        assert piece in message
    assert "min_lr" not in message
    assert (sched.state_dict(), sched.optimizer.param_groups[0]) == before


def test_use_checkpoint_policy_adopts_checkpoint_schedule() -> None:
    sched = make_scheduler(on_checkpoint="use_checkpoint")
    checkpoint = other_checkpoint()
    sched.load_state_dict(checkpoint)
    assert sched.state_dict() == checkpoint
    assert sched.wd_schedule.end_wd == 0.2
    assert sched.num_steps == 60
    assert sched.lr_schedule.max_lr == 2.0 and sched.lr_schedule.style == "cosine"
    assert sched.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 + 1.9 * 0.5)  # cosine midpoint
    assert sched.optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.12)


def test_use_class_policy_keeps_constructor_schedule_but_takes_the_step() -> None:
    sched = make_scheduler(on_checkpoint="use_class")
    sched.load_state_dict(other_checkpoint())
    assert sched.num_steps == 60
    assert sched.lr_schedule == LRSchedule(**BASE, style="linear")
    assert sched.optimizer.param_groups[0]["lr"] == pytest.approx(0.55)
    assert sched.optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.06)


def test_load_sets_the_step_rather_than_adding_it() -> None:
    sched = make_scheduler(on_checkpoint="use_class")
    sched.step(increment=20)
    sched.load_state_dict(other_checkpoint(num_steps=7))
    assert sched.num_steps == 7


def test_load_that_cannot_serve_a_group_changes_nothing() -> None:
    # the group's own min_lr 0.5 is above the checkpoint's max_lr 0.3
    sched = make_scheduler({"params": [], "min_lr": 0.5}, on_checkpoint="use_checkpoint")
    state = sched.state_dict()
    state["lr"] = {**state["lr"], "max_lr": 0.3, "min_lr": 0.0}
    state["num_steps"] = 50
    before = sched.state_dict(), dict(sched.optimizer.param_groups[0])
    with pytest.raises(ValueError, match="param group 0"):
        sched.load_state_dict(state)
    assert (sched.state_dict(), sched.optimizer.param_groups[0]) == before


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda s: s.pop("wd"), "expected"),
        (lambda s: s.update(extra=1), "expected"),
        (lambda s: s.update(version=2), "version 2"),
        (lambda s: s.update(num_steps=-1), "num_steps"),
        (lambda s: s.update(num_steps=1.5), "num_steps"),
        (lambda s: s["lr"].update(bogus=1), "unknown keys \\['bogus'\\]"),
        (lambda s: s["lr"].pop("max_lr"), "missing keys \\['max_lr'\\]"),
        (lambda s: s["lr"].update(min_lr=2.0), "min_lr"),
        (lambda s: s["wd"].update(style="step"), "style"),
    ],
)
def test_malformed_checkpoint_is_rejected(edit: Any, match: str) -> None:
    sched = make_scheduler(on_checkpoint="use_class")
    state = sched.state_dict()
    edit(state)
    with pytest.raises(ValueError, match=match):
        sched.load_state_dict(state)
    assert sched.num_steps == 0


def test_schedule_dict_round_trip() -> None:
    schedule = LRSchedule(init_lr=0.1, max_lr=1.0, decay_steps=9, style="WSD", wsd_decay_steps=3)
    assert LRSchedule.from_dict(schedule.to_dict()) == schedule
    wd = WDSchedule(start_wd=0.0, end_wd=0.1, incr_steps=4, style="cosine")
    assert WDSchedule.from_dict(wd.to_dict()) == wd
    with pytest.raises(AttributeError):
        schedule.max_lr = 2.0  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "changes, match",
    [
        ({"style": "step"}, r"LRSchedule.style must be one of \['constant', 'linear', 'cosine', "),
        ({"style": "WSD", "wsd_decay_steps": 1, "wsd_style": "square"}, "wsd_style"),
        ({"warmup_steps": 111}, r"warmup_steps \(111\) must be <= decay_steps \(110\)"),
        ({"max_lr": -1.0, "min_lr": 0.0}, "max_lr must be a finite number >= 0, got -1.0"),
        ({"max_lr": math.inf}, "max_lr must be a finite number"),
        ({"min_lr": math.nan}, "min_lr must be a finite number"),
        ({"init_lr": -0.1}, "init_lr"),
        ({"init_lr": 2.0}, r"init_lr \(2.0\) must be <= max_lr"),
        ({"min_lr": 1.5}, r"min_lr \(1.5\) must be <= max_lr \(1.0\)"),
        ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0, got -1"),
        ({"warmup_steps": 2.5}, "warmup_steps must be an integer"),
        ({"decay_steps": 0, "warmup_steps": 0}, "decay_steps must be an integer >= 1, got 0"),
        ({"decay_steps": True}, "decay_steps"),
        ({"style": "WSD"}, "wsd_decay_steps is required when style='WSD'"),
        ({"style": "WSD", "wsd_decay_steps": 111}, r"wsd_decay_steps \(111\) must be <= decay_steps \(110\)"),
        ({"wsd_decay_steps": -3}, "wsd_decay_steps must be an integer >= 0"),
    ],
)
def test_bad_lr_schedule(changes: dict[str, Any], match: str) -> None:
    fields = {**BASE, "style": "linear", **changes}
    with pytest.raises(ValueError, match=match):
        LRSchedule(**fields)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"start_wd": 0.0, "end_wd": 0.1}, "style='constant' needs start_wd == end_wd, got 0.0 and 0.1"),
        (
            {"start_wd": 0.0, "end_wd": 0.1, "incr_steps": 0, "style": "linear"},
            "incr_steps must be an integer >= 1",
        ),
        ({"start_wd": -0.1, "end_wd": -0.1}, "start_wd must be a finite number >= 0"),
        ({"start_wd": 0.1, "end_wd": math.inf, "incr_steps": 3, "style": "cosine"}, "end_wd"),
        ({"start_wd": 0.1, "end_wd": 0.1, "style": "exponential"}, r"style must be one of \['constant', "),
    ],
)
def test_bad_wd_schedule(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        WDSchedule(**fields)


def test_bad_calls_and_scheduler_arguments() -> None:
    schedule = LRSchedule(**BASE, style="linear")
    with pytest.raises(ValueError, match="step must be an integer >= 0, got -1"):
        schedule(-1)
    with pytest.raises(ValueError, match="param group.max_lr"):
        schedule(3, max_lr=math.nan)
    with pytest.raises(ValueError, match="step"):
        WDSchedule.constant(0.1)(-2)
    wd = WDSchedule.constant(0.0)
    with pytest.raises(ValueError, match="on_checkpoint must be one of"):
        Scheduler(Groups(), schedule, wd, on_checkpoint="override")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="param_groups"):
        Scheduler(object(), schedule, wd)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Scheduler.lr must be an LRSchedule"):
        Scheduler(Groups(), wd, wd)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="param group 0: min_lr"):
        Scheduler(Groups({"params": [], "max_lr": 0.01}), schedule, wd)


# ---------------------------------------------------------------------------------------------- properties
@st.composite
def lr_schedules(draw: st.DrawFn) -> LRSchedule:
    max_lr = draw(st.floats(0.0, 10.0))
    decay_steps = draw(st.integers(1, 60))
    style = draw(st.sampled_from(LRSchedule.STYLES))
    return LRSchedule(
        init_lr=max_lr * draw(st.floats(0.0, 1.0)),
        max_lr=max_lr,
        min_lr=max_lr * draw(st.floats(0.0, 1.0)),
        warmup_steps=draw(st.integers(0, decay_steps)),
        decay_steps=decay_steps,
        style=style,
        wsd_decay_steps=draw(st.integers(0, decay_steps)) if style == "WSD" else None,
        wsd_style=draw(st.sampled_from(LRSchedule.WSD_STYLES)),
    )


@settings(max_examples=300, deadline=None)
@given(lr_schedules())
def test_lr_stays_in_range_and_never_rises_after_warmup(schedule: LRSchedule) -> None:
    tol = 1e-12 * (1.0 + schedule.max_lr)
    low = min(schedule.init_lr, schedule.min_lr)
    values = [schedule(step) for step in range(schedule.decay_steps + 3)]
    assert all(low - tol <= v <= schedule.max_lr + tol for v in values)
    warmup = values[: schedule.warmup_steps + 1]
    assert all(a <= b + tol for a, b in zip(warmup, warmup[1:], strict=False))
    after = values[schedule.warmup_steps :]
    assert all(b <= a + tol for a, b in zip(after, after[1:], strict=False))
    assert schedule(FAR) == (schedule.max_lr if schedule.style == "constant" else schedule.min_lr)
