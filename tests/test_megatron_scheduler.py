"""optstack.megatron.OptimizerParamScheduler: Megatron's values, state_dict keys and checkpoint policies."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from optstack.megatron import (
    OptimizerConfig,
    OptimizerParamScheduler,
    get_canonical_lr_for_logging,
    get_param_groups,
)

MEGATRON_KEYS = ["max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style", "lr_decay_steps", "min_lr",
                 "start_wd", "end_wd", "wd_incr_style", "wd_incr_steps"]


def optimizer() -> torch.optim.Optimizer:
    torch.manual_seed(0)
    groups = [
        {"params": [nn.Parameter(torch.randn(2))], "default_config": True},
        {"params": [nn.Parameter(torch.randn(2))], "max_lr": 2.0, "min_lr": 0.2, "wd_mult": 0.0,
         "default_config": False},
        {"params": [nn.Parameter(torch.randn(2))], "max_lr": None, "min_lr": None, "default_config": True},
    ]
    return torch.optim.SGD(groups, lr=0.0)


def sched(opt: torch.optim.Optimizer | None = None, **kw: object) -> OptimizerParamScheduler:
    args = dict(init_lr=0.0, max_lr=1.0, min_lr=0.1, lr_warmup_steps=2, lr_decay_steps=10,
                lr_decay_style="cosine", start_wd=0.0, end_wd=0.1, wd_incr_steps=10, wd_incr_style="linear")
    args.update(kw)
    return OptimizerParamScheduler(opt if opt is not None else optimizer(), **args)  # type: ignore[arg-type]


def lrs_at(s: OptimizerParamScheduler, step: int) -> list[float]:
    s.step(step - s.num_steps)
    return [g["lr"] for g in s.optimizer.param_groups]


def test_cosine_with_warmup_values() -> None:
    s = sched()
    assert [g["lr"] for g in s.optimizer.param_groups] == [0.0, 0.0, 0.0]  # the constructor applies step 0
    assert lrs_at(s, 1) == pytest.approx([0.5, 1.0, 0.5])  # warmup rises to each group's own max_lr
    assert lrs_at(s, 2) == pytest.approx([1.0, 2.0, 1.0])
    cos4 = 0.5 * (math.cos(math.pi * 0.25) + 1)
    assert lrs_at(s, 4) == pytest.approx([0.1 + cos4 * 0.9, 0.2 + cos4 * 1.8, 0.1 + cos4 * 0.9])
    assert lrs_at(s, 6) == pytest.approx([0.55, 1.1, 0.55])
    assert lrs_at(s, 10) == pytest.approx([0.1, 0.2, 0.1])
    assert lrs_at(s, 11) == pytest.approx([0.1, 0.2, 0.1])
    assert s.get_lr({"max_lr": 3.0}) == pytest.approx(0.1)  # past decay: the scheduler's min_lr


def test_weight_decay_ramp_and_wd_mult() -> None:
    s = sched()
    s.step(5)
    assert s.get_wd() == pytest.approx(0.05)
    assert [g["weight_decay"] for g in s.optimizer.param_groups] == pytest.approx([0.05, 0.0, 0.05])
    assert s.get_wd({"start_wd": 0.2, "end_wd": 0.4}) == pytest.approx(0.3)  # a group's own bounds win
    s.step(20)
    assert s.get_wd() == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("kw", "step", "expected"),
    [
        (dict(lr_decay_style="linear"), 6, 0.55),
        (dict(lr_decay_style="constant"), 50, 1.0),
        (dict(lr_decay_style="inverse-square-root", lr_warmup_steps=4, lr_decay_steps=100), 16, 0.5),
        (dict(lr_decay_style="WSD", wsd_decay_steps=4, lr_wsd_decay_style="linear"), 6, 1.0),
        (dict(lr_decay_style="WSD", wsd_decay_steps=4, lr_wsd_decay_style="linear"), 8, 0.55),
        (dict(lr_decay_style="WSD", wsd_decay_steps=4), 8, 0.1 + 0.9 * (2 * 0.5**0.5 - 1)),  # exponential
    ],
)
def test_decay_styles(kw: dict, step: int, expected: float) -> None:
    s = sched(**kw)
    s.step(step)
    assert s.get_lr({}) == pytest.approx(expected)


def test_state_dict_has_megatrons_keys() -> None:
    s = sched()
    s.step(3)
    sd = s.state_dict()
    assert list(sd) == MEGATRON_KEYS
    assert sd == {"max_lr": 1.0, "lr_warmup_steps": 2, "num_steps": 3, "lr_decay_style": "cosine",
                  "lr_decay_steps": 10, "min_lr": 0.1, "start_wd": 0.0, "end_wd": 0.1,
                  "wd_incr_style": "linear", "wd_incr_steps": 10}
    assert (s.max_lr, s.lr_warmup_steps, s.lr_decay_style, s.wd_incr_style, s.num_steps) == (
        1.0, 2, "cosine", "linear", 3)


def test_use_checkpoint_is_the_default_policy() -> None:
    saved = sched()
    saved.step(5)
    s = sched(max_lr=2.0, min_lr=0.0, end_wd=0.2)
    s.load_state_dict(saved.state_dict())
    assert (s.max_lr, s.min_lr, s.end_wd, s.num_steps) == (1.0, 0.1, 0.1, 5)
    assert [g["lr"] for g in s.optimizer.param_groups] == pytest.approx(
        [g["lr"] for g in saved.optimizer.param_groups])


def test_override_keeps_the_class_values() -> None:
    saved = sched()
    saved.step(5)
    s = sched(max_lr=2.0, override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False)
    s.load_state_dict(saved.state_dict())
    assert (s.max_lr, s.num_steps) == (2.0, 5)


def test_neither_flag_requires_a_match() -> None:
    saved = sched()
    saved.step(5)
    s = sched(max_lr=2.0, lr_decay_style="linear", use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match=r"max_lr \(learning rate\): class value 2.0, checkpoint value 1.0.*"
                                         r"lr_decay_style .*'linear'.*'cosine'"):
        s.load_state_dict(saved.state_dict())
    assert (s.num_steps, s.max_lr) == (0, 2.0)  # unchanged
    same = sched(use_checkpoint_opt_param_scheduler=False)
    same.load_state_dict(saved.state_dict())
    assert same.num_steps == 5


def test_legacy_keys_and_missing_wd_keys() -> None:
    legacy = {"start_lr": 1.0, "min_lr": 0.1, "warmup_iter": 2, "end_iter": 10, "decay_style": "cosine",
              "num_iters": 4}
    s = sched(use_checkpoint_opt_param_scheduler=False)
    s.load_state_dict(legacy)
    assert s.num_steps == 4 and s.end_wd == 0.1  # no wd keys: the class's weight-decay values stay
    s2 = sched()
    s2.load_state_dict({"max_lr": 1.0, "min_lr": 0.1, "warmup_steps": 3, "decay_steps": 12,
                        "lr_decay_style": "linear", "num_steps": 1})
    assert (s2.lr_warmup_steps, s2.lr_decay_steps, s2.lr_decay_style) == (3, 12, "linear")
    with pytest.raises(ValueError, match=r"no 'lr_warmup_steps' \(nor its legacy names"):
        sched().load_state_dict({"max_lr": 1.0, "min_lr": 0.1})


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(use_checkpoint_opt_param_scheduler=True, override_opt_param_scheduler=True), "both"),
        (dict(lr_warmup_steps=11), "lr_warmup_steps"),
        (dict(lr_decay_style="exp"), "lr_decay_style must be one of"),
        (dict(lr_decay_style="WSD"), "wsd_decay_steps is required"),
        (dict(min_lr=2.0), r"min_lr \(2.0\) must be <= max_lr"),
        (dict(init_lr=2.0), "init_lr"),
        (dict(wd_incr_style="constant"), "wd_incr_style='constant' needs start_wd == end_wd"),
        (dict(lr_decay_steps=0), "lr_decay_steps must be an integer >= 1"),
    ],
)
def test_bad_arguments(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sched(**kw)


def test_with_megatron_groups_and_lr_none() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    groups = get_param_groups(model, OptimizerConfig(), None)  # lr None: max_lr None in every group
    opt = torch.optim.AdamW(groups, lr=0.0)
    s = sched(opt, lr_warmup_steps=0, lr_decay_style="constant")
    assert [g["lr"] for g in opt.param_groups] == [1.0, 1.0]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.0]
    s.step(5)
    assert [g["weight_decay"] for g in opt.param_groups] == pytest.approx([0.05, 0.0])  # wd_mult 0 on group 2


def test_canonical_lr_for_logging() -> None:
    groups = [{"params": [], "default_config": False, "lr": 1.0},
              {"params": [], "default_config": True, "lr": 2.0},
              {"params": [], "default_config": True, "lr": 3.0}]
    assert get_canonical_lr_for_logging(groups) == 2.0  # the first default group, even an empty one
    assert get_canonical_lr_for_logging(groups[:1]) is None
    assert get_canonical_lr_for_logging([]) is None
