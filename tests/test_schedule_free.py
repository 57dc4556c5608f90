"""Schedule-Free AdamW: against the ``schedulefree`` package's ``AdamWScheduleFree`` (skipped when it is not
installed) and against the single-tensor reference over 20 steps, the train/eval swap through the optimizer
the user holds, state that loads in either mode, registry and config, and the refusals."""

from __future__ import annotations

import copy

import pytest
import torch

from optstack import OptimizerConfig, build_optimizer
from optstack.algorithms.registry import get_algorithm
from optstack.algorithms.schedule_free import (
    ScheduleFreeAdamW,
    ScheduleFreeSGD,
    schedule_free_adamw_reference,
    schedule_free_sgd_reference,
)
from optstack.config import DistributedConfig, ScheduleFreeConfig

SHAPES = [(6, 5), (5,), (4, 3, 2)]
HYPER = dict(lr=0.02, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05, warmup_steps=5, r=0.5, weight_lr_power=2.0)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(*s, generator=g) for s in SHAPES]


def _step(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], step: int) -> None:
    for p, g in zip(params, _grads(step), strict=True):
        p.grad = g.clone()  # the package divides the gradients in place
    opt.step()


def test_equals_the_schedulefree_package_over_20_steps_in_train_and_eval() -> None:
    schedulefree = pytest.importorskip(
        "schedulefree", reason="the schedulefree package is not installed (pip install -e '.[dev]' pins it)")
    ours, theirs = _params(), _params()
    opt = ScheduleFreeAdamW(ours, **HYPER)
    ref = schedulefree.AdamWScheduleFree(theirs, **HYPER)
    ref.train()
    for t in range(20):
        _step(opt, ours, t)
        _step(ref, theirs, t)
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
    opt.eval()
    ref.eval()
    for a, b, s in zip(ours, theirs, _params(), strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
        assert (a.detach() - s.detach()).abs().max() > 1e-2
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(opt.state[p]["z"], ref.state[q]["z"], rtol=1e-6, atol=1e-7)


def test_equals_the_reference_over_20_steps() -> None:
    params = _params()
    refs = [p.detach().clone() for p in params]
    zs = [r.clone() for r in refs]
    vs = [torch.zeros_like(r) for r in refs]
    opt = ScheduleFreeAdamW(params, **HYPER)
    weight_sum, lr_max = 0.0, -1.0
    settings = {k: v for k, v in HYPER.items() if k != "betas"}
    for t in range(20):
        _step(opt, params, t)
        sums = [schedule_free_adamw_reference(p, g, z, v, step=t, weight_sum=weight_sum, lr_max=lr_max,
                                              beta1=0.9, beta2=0.99, **settings)
                for p, g, z, v in zip(refs, _grads(t), zs, vs, strict=True)]
        weight_sum, lr_max = sums[0]
    for p, r, z in zip(params, refs, zs, strict=True):
        torch.testing.assert_close(p.detach(), r, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[p]["z"], z, rtol=1e-6, atol=1e-7)
    opt.eval()
    for p, r, z in zip(params, refs, zs, strict=True):  # x = (y - (1 - beta1) z) / beta1
        torch.testing.assert_close(p.detach(), (r - 0.1 * z) / 0.9, rtol=1e-5, atol=1e-6)


def test_eval_then_train_restores_y_and_a_step_in_eval_mode_is_refused() -> None:
    params = _params()
    opt = ScheduleFreeAdamW(params, **HYPER)
    for t in range(3):
        _step(opt, params, t)
    y = [p.detach().clone() for p in params]
    opt.eval()
    assert all((p.detach() - w).abs().max() > 1e-4 for p, w in zip(params, y, strict=True))
    opt.eval()  # twice: still x, not swapped back and forth
    x = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match=r"step\(\) in eval mode.*call optimizer.train\(\)"):
        _step(opt, params, 3)
    assert all(torch.equal(p.detach(), w) for p, w in zip(params, x, strict=True))  # nothing changed
    opt.train()
    for p, w in zip(params, y, strict=True):
        torch.testing.assert_close(p.detach(), w, rtol=1e-6, atol=1e-6)


def test_state_saved_in_eval_mode_continues_in_train_mode() -> None:
    params = _params()
    opt = ScheduleFreeAdamW(params, **HYPER)
    for t in range(3):
        _step(opt, params, t)
    opt.eval()  # the package's advice: save in eval mode (the parameters hold x)
    saved, weights = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params]
    opt.train()
    for t in range(3, 6):
        _step(opt, params, t)
    fresh = [torch.nn.Parameter(w.clone()) for w in weights]
    again = ScheduleFreeAdamW(fresh, **HYPER)  # in train mode; the state says the parameters hold x
    again.load_state_dict(saved)
    with pytest.raises(RuntimeError, match=r"hold the averaged weights x.*call optimizer.train\(\) after loading"):
        _step(again, fresh, 3)
    assert all(torch.equal(p.detach(), w) for p, w in zip(fresh, weights, strict=True))  # refused, unchanged
    again.train()  # as the package requires after loading
    for t in range(3, 6):
        _step(again, fresh, t)
    for a, b in zip(params, fresh, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-6)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-remainders"])
def test_eval_is_reachable_from_the_built_optimizer_and_publishes_to_the_model(precision: str) -> None:
    from optstack.config import MastersConfig

    remainders = precision == "bf16-remainders"
    precision = "bf16" if remainders else precision
    config = OptimizerConfig(algorithm="schedule_free_adamw", lr=0.1, weight_decay=0.0, precision=precision,
                             schedule_free=ScheduleFreeConfig(warmup_steps=2),
                             masters=MastersConfig(store_remainders=remainders))
    model = _model().to(torch.bfloat16 if precision == "bf16" else torch.float32)
    built = build_optimizer(config, model)
    plain = _model()
    ref = ScheduleFreeAdamW(plain.parameters(), lr=0.1, weight_decay=0.0, warmup_steps=2)
    for step in range(4):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        model(x.to(next(model.parameters()).dtype)).float().square().mean().backward()
        built.optimizer.step()
        built.optimizer.zero_grad()
        plain(x).square().mean().backward()
        ref.step()
        ref.zero_grad()
    before = [p.detach().float().clone() for p in model.parameters()]
    built.optimizer.eval()
    ref.eval()
    tol = 1e-2 if precision == "bf16" else 1e-6
    # the model itself holds x now (under bf16, the fp32 masters were swapped and published)
    assert min((p.detach().float() - b).abs().max().item() for p, b in zip(model.parameters(), before,
                                                                            strict=True)) > 1e-3
    for (name, a), b in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.detach().float(), b.detach(), rtol=tol, atol=tol, msg=name)
    built.optimizer.train()
    ref.train()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.detach().float(), b.detach(), rtol=tol, atol=tol)


def test_registered_element_wise_with_a_weight_swap_and_a_config_section() -> None:
    spec = get_algorithm("schedule_free_adamw")
    caps = spec.capabilities
    assert caps.elementwise and caps.swaps_weights and not caps.whole_matrices and not spec.offloadable
    kwargs = spec.kwargs(OptimizerConfig(schedule_free=ScheduleFreeConfig(beta1=0.95, warmup_steps=7)))
    assert kwargs["betas"] == (0.95, 0.999) and kwargs["warmup_steps"] == 7


def test_bad_settings_and_placements_are_refused() -> None:
    with pytest.raises(ValueError, match=r"schedule_free.beta1 must be in \(0, 1\)"):
        ScheduleFreeConfig(beta1=0.0)
    with pytest.raises(ValueError, match="betas"):
        ScheduleFreeAdamW(_params(), betas=(0.0, 0.9))
    # layer-wise assigns whole matrices to ranks (what a whole-matrix algorithm needs); element-wise state is
    # sharded by zero1 instead
    with pytest.raises(ValueError, match="sharding='layerwise'.*schedule_free_adamw.*sharding='zero1'"):
        OptimizerConfig(algorithm="schedule_free_adamw", distributed=DistributedConfig(sharding="layerwise"))


def test_offload_is_refused_naming_the_algorithm() -> None:
    from optstack.config import OffloadConfig

    with pytest.raises(ValueError, match="host kernel, but 'schedule_free_adamw' has none"):
        OptimizerConfig(algorithm="schedule_free_adamw", offload=OffloadConfig(enabled=True, fraction=1.0))


SGD_HYPER = dict(lr=0.05, momentum=0.9, weight_decay=0.05, warmup_steps=5, r=0.5, weight_lr_power=2.0)


def test_sgd_equals_the_schedulefree_package_over_20_steps_in_train_and_eval() -> None:
    schedulefree = pytest.importorskip(
        "schedulefree", reason="the schedulefree package is not installed (pip install -e '.[dev]' pins it)")
    ours, theirs = _params(), _params()
    opt = ScheduleFreeSGD(ours, **SGD_HYPER)
    ref = schedulefree.SGDScheduleFree(theirs, **SGD_HYPER)
    ref.train()
    for t in range(20):
        _step(opt, ours, t)
        _step(ref, theirs, t)  # the package adds the decay to the gradient in place: each gets its own copy
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
    opt.eval()
    ref.eval()
    for a, b, s in zip(ours, theirs, _params(), strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
        assert (a.detach() - s.detach()).abs().max() > 1e-2
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(opt.state[p]["z"], ref.state[q]["z"], rtol=1e-6, atol=1e-7)
    opt.train()
    ref.train()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


def test_sgd_equals_the_reference_over_20_steps_and_leaves_the_gradients() -> None:
    params = _params()
    refs = [p.detach().clone() for p in params]
    zs = [r.clone() for r in refs]
    opt = ScheduleFreeSGD(params, **SGD_HYPER)
    weight_sum, lr_max = 0.0, -1.0
    for t in range(20):
        _step(opt, params, t)
        assert all(torch.equal(p.grad, g) for p, g in zip(params, _grads(t), strict=True))
        sums = [schedule_free_sgd_reference(p, g, z, step=t, weight_sum=weight_sum, lr_max=lr_max, **SGD_HYPER)
                for p, g, z in zip(refs, _grads(t), zs, strict=True)]
        weight_sum, lr_max = sums[0]
    for p, r, z in zip(params, refs, zs, strict=True):
        torch.testing.assert_close(p.detach(), r, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[p]["z"], z, rtol=1e-6, atol=1e-7)
    assert set(opt.state[params[0]]) == {"z", "step", "weight_sum", "lr_max", "eval_weights"}


def test_sgd_state_saved_in_eval_mode_continues_after_train_and_a_step_in_eval_is_refused() -> None:
    params = _params()
    opt = ScheduleFreeSGD(params, **SGD_HYPER)
    for t in range(3):
        _step(opt, params, t)
    opt.eval()
    with pytest.raises(RuntimeError, match=r"ScheduleFreeSGD: step\(\) in eval mode"):
        _step(opt, params, 3)
    saved, weights = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params]
    opt.train()
    for t in range(3, 6):
        _step(opt, params, t)
    fresh = [torch.nn.Parameter(w.clone()) for w in weights]
    again = ScheduleFreeSGD(fresh, **SGD_HYPER)
    again.load_state_dict(saved)
    with pytest.raises(RuntimeError, match="hold the averaged weights x"):
        _step(again, fresh, 3)
    again.train()
    for t in range(3, 6):
        _step(again, fresh, t)
    for a, b in zip(params, fresh, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-6)


def test_sgd_registered_with_the_schedule_free_section_and_bad_momentum_refused() -> None:
    spec = get_algorithm("schedule_free_sgd")
    assert spec.capabilities.elementwise and spec.capabilities.swaps_weights and spec.capabilities.state == ("z",)
    kwargs = spec.kwargs(OptimizerConfig(lr=0.3, schedule_free=ScheduleFreeConfig(beta1=0.8, warmup_steps=3)))
    assert kwargs == {"lr": 0.3, "weight_decay": 0.01, "momentum": 0.8, "warmup_steps": 3, "r": 0.0,
                      "weight_lr_power": 2.0}
    for momentum in (0.0, 1.0, True):
        with pytest.raises(ValueError, match=r"ScheduleFreeSGD param group 0: momentum must be in \(0, 1\)"):
            ScheduleFreeSGD(_params(), momentum=momentum)
    model = _model()
    built = build_optimizer(OptimizerConfig(algorithm="schedule_free_sgd", lr=0.1), model)
    for _ in range(2):  # after one step y = z = x (the average of one point)
        model(torch.randn(2, 4)).square().mean().backward()
        built.optimizer.step()
        built.optimizer.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    built.optimizer.eval()  # reachable from the optimizer the user holds, published to the model
    assert any(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))
    built.optimizer.train()
    for p, b in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(p.detach(), b, rtol=1e-6, atol=1e-6)
