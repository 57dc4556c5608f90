"""What a new user does by habit in the first hour (issue 30) either works or fails at once, saying what to do.

One test per habit; each failed before the fix (silently wrong, a crash deep inside, or a hang).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optstack import OptimizerConfig, build_optimizer
from optstack.schedule import LRSchedule


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


# -- 2: a schedule that disagrees with the config ------------------------------------------------------------


@pytest.mark.parametrize(("config", "schedule", "named"), [
    (OptimizerConfig(), LRSchedule(max_lr=3e-4, decay_steps=10),
     ["LRSchedule.max_lr=0.0003", "OptimizerConfig.lr=0.001"]),
    (OptimizerConfig(lr=3e-4), LRSchedule(max_lr=3e-4, min_lr=3e-5, decay_steps=10),
     ["LRSchedule.min_lr=3e-05", "OptimizerConfig.min_lr=0.0"]),
])
def test_schedule_disagreeing_with_config_is_an_error(config, schedule, named):
    with pytest.raises(ValueError, match="disagrees with the config") as raised:
        build_optimizer(config, _model(), lr_schedule=schedule)
    for text in named:
        assert text in str(raised.value)
    assert "OptimizerConfig(lr=0.0003" in str(raised.value)  # the fix, spelled out


def test_schedule_agreeing_with_config_runs_as_written():
    built = build_optimizer(OptimizerConfig(lr=3e-4, min_lr=3e-5), _model(),
                            lr_schedule=LRSchedule(max_lr=3e-4, min_lr=3e-5, warmup_steps=2, decay_steps=4))
    lrs = []
    for _ in range(6):
        built.scheduler.step()
        lrs.append(built.scheduler.get_last_lr()[0])
    assert lrs[1] == pytest.approx(3e-4) and lrs[-1] == pytest.approx(3e-5)
