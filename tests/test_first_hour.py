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


# -- 4: torch.compile of the step or of a train step --------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["adamw", "muon"])
@pytest.mark.parametrize("what", ["opt.step", "train step"])
def test_compiled_step_equals_eager(algorithm, what):
    torch._dynamo.reset()
    config = OptimizerConfig(algorithm=algorithm, lr=1e-2, clip_grad=1.0)
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def run(compiled: bool) -> nn.Module:
        model = _model()
        opt = build_optimizer(config, model).optimizer
        step = torch.compile(opt.step, backend="aot_eager") if compiled and what == "opt.step" else opt.step

        def train(x: torch.Tensor) -> None:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            step()

        train_step = torch.compile(train, backend="aot_eager") if compiled and what == "train step" else train
        for x in batches:
            train_step(x)
            assert opt.last_result.applied
        return model

    eager, compiled = run(False), run(True)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7, msg=name)
