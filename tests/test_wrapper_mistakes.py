"""Habits that used to go silently wrong with the data-parallel wrapper now fail at once, saying what to do
(issue "The first hour", item 3)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optstack import OptimizerConfig, build_optimizer, wrap_data_parallel


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def test_optimizer_built_before_wrapping_refuses_its_first_step_and_changes_nothing():
    model, config = _model(), OptimizerConfig(lr=0.1)
    opt = build_optimizer(config, model).optimizer  # before wrapping: it reads p.grad
    ddp = wrap_data_parallel(config, model)
    before = [p.detach().clone() for p in model.parameters()]
    ddp(torch.randn(3, 4)).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match=r"held by a DataParallel wrapper .* model = wrap_data_parallel"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_optimizer_over_the_module_inside_the_wrapper_is_refused_at_build():
    config = OptimizerConfig(lr=0.1)
    ddp = wrap_data_parallel(config, _model())
    with pytest.raises(ValueError, match="given the module inside the wrapper"):
        build_optimizer(config, ddp.module)


def test_an_unwrapped_model_without_gradients_still_steps_quietly():
    model = _model()
    opt = build_optimizer(OptimizerConfig(lr=0.1), model).optimizer
    opt.step()  # no backward yet: nothing to do, no error (torch's behaviour)
    assert opt.last_result is None or opt.last_result.grad_norm == 0.0


def test_torch_clip_after_finish_grad_sync_clips_what_the_optimizer_steps():
    config = OptimizerConfig(algorithm="sgd", lr=0.5)
    x = torch.randn(3, 4)
    ref = _model()
    ref_opt = build_optimizer(config, ref).optimizer
    ref(x).pow(2).mean().backward()
    want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    ref_opt.step()

    ddp = wrap_data_parallel(config, _model())
    opt = build_optimizer(config, ddp).optimizer
    ddp(x).pow(2).mean().backward()
    assert all(p.grad is None for p in ddp.parameters())  # reduced inside step() unless finished first
    ddp.finish_grad_sync()
    norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.01)
    assert norm.item() == pytest.approx(want_norm.item()) and norm.item() > 0.01
    opt.step()
    for a, b in zip(ref.parameters(), ddp.module.parameters(), strict=True):
        torch.testing.assert_close(a, b)
