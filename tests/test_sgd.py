"""SGD: trajectories equal torch.optim.SGD for every impl and momentum variant, flat shard views, validation,
state_dict round trips."""

from __future__ import annotations

import copy

import pytest
import torch
from optim_harness import IMPLS, batches, clones_with_grads, flat_views, make_model, max_rel_diff, train
from torch import nn

from optstack.algorithms import SGD, sgd_reference

CONFIGS = {
    "plain": {},
    "weight_decay": {"weight_decay": 1e-2},
    "momentum": {"momentum": 0.9},
    "nesterov": {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-2},
    "dampening": {"momentum": 0.8, "dampening": 0.1, "weight_decay": 1e-2},
}


def groups(model: nn.Module) -> list[dict]:
    return [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), "lr": 0.02}]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_trajectory_equals_torch(impl: str, config: dict) -> None:
    data = batches(50)
    model = make_model()
    expected = train(model, torch.optim.SGD(groups(model), lr=0.05, **config), data)
    model = make_model()
    got = train(model, SGD(groups(model), lr=0.05, impl=impl, **config), data)
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert max_rel_diff(g, e) <= 1e-6, f"step {step}"


@pytest.mark.parametrize("impl", ["reference", "foreach"])
def test_reference_and_foreach_are_bitwise_torch(impl: str) -> None:
    data = batches(20)
    config = CONFIGS["nesterov"]
    model = make_model()
    expected = train(model, torch.optim.SGD(model.parameters(), lr=0.05, foreach=False, **config), data)[-1]
    model = make_model()
    got = train(model, SGD(model.parameters(), lr=0.05, impl=impl, **config), data)[-1]
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


def test_reference_kernel_first_step_and_after() -> None:
    p, g, buf = torch.ones(3), torch.full((3,), 2.0), torch.full((3,), 99.0)
    sgd_reference(p, g, buf, lr=0.1, momentum=0.5, dampening=0.0, weight_decay=0.0, nesterov=False,
                  first_step=True)
    torch.testing.assert_close(buf, torch.full((3,), 2.0))  # the first step takes the gradient as it is
    torch.testing.assert_close(p, torch.full((3,), 0.8))
    sgd_reference(p, g, buf, lr=0.1, momentum=0.5, dampening=0.0, weight_decay=0.0, nesterov=False,
                  first_step=False)
    torch.testing.assert_close(buf, torch.full((3,), 3.0))
    torch.testing.assert_close(p, torch.full((3,), 0.5))
    with pytest.raises(ValueError, match="momentum_buffer is required"):
        sgd_reference(p, g, None, lr=0.1, momentum=0.5, dampening=0.0, weight_decay=0.0, nesterov=False,
                      first_step=True)


def test_state_keys_like_torch() -> None:
    model = make_model()
    with_momentum = SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, with_momentum, batches(2))
    assert set(with_momentum.state[model[0].weight]) == {"momentum_buffer"}
    plain = SGD(model.parameters(), lr=0.1)
    train(model, plain, batches(2))
    assert not plain.state.get(model[0].weight)


@pytest.mark.parametrize("impl", IMPLS)
def test_mixed_dtypes_in_one_group(impl: str) -> None:
    params = [torch.ones(3), torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.bfloat16)]
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    opt = SGD(params, lr=0.2, momentum=0.9, impl=impl)
    opt.step()
    opt.step()
    for p in params:  # 1 - 0.2 * 0.5 - 0.2 * (0.9 * 0.5 + 0.5)
        atol = 1e-2 if p.dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(p, torch.full_like(p, 0.71), rtol=0, atol=atol)


def test_params_without_grad_are_skipped_and_plain_tensors_work() -> None:
    a, b = torch.ones(3), torch.ones(2)
    a.grad = torch.full((3,), 0.5)
    opt = SGD([a, b], lr=0.2, momentum=0.9)
    opt.step()
    torch.testing.assert_close(a, torch.full((3,), 0.9))
    assert torch.equal(b, torch.ones(2)) and not opt.state.get(b)


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_flat_shard_views_step_in_one_call(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    numels = [5, 9, 1, 20]
    _, views = flat_views(numels, seed=3)
    views = views[::-1]
    clones = clones_with_grads(views)
    calls: list[int] = []
    name = "_fused_sgd_" if impl == "fused" else "_foreach_add_"
    original = getattr(torch, name)

    def counting(tensors: list[torch.Tensor], *args, **kwargs) -> None:
        calls.append(len(tensors))
        original(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, name, counting)
    opt = SGD(views, lr=0.1, momentum=0.9, impl=impl)
    reference = torch.optim.SGD(clones, lr=0.1, momentum=0.9)
    for _ in range(3):
        opt.step()
        reference.step()
    assert calls and all(n == 1 for n in calls)
    assert max_rel_diff(views, clones) <= 1e-6


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -0.1}, "SGD param group 0: lr must be a number >= 0"),
        ({"momentum": -0.5}, "momentum must be"),
        ({"weight_decay": -1.0}, "weight_decay must be"),
        ({"nesterov": True}, "nesterov needs momentum > 0 and dampening == 0"),
        ({"nesterov": True, "momentum": 0.9, "dampening": 0.1}, "nesterov needs"),
        ({"impl": "fast"}, "impl must be one of"),
    ],
)
def test_bad_hyperparameters(kwargs: dict, match: str) -> None:
    kwargs = {"lr": 0.1, **kwargs}
    with pytest.raises(ValueError, match=match):
        SGD([torch.zeros(2)], **kwargs)


def test_bad_group_override_names_the_group() -> None:
    with pytest.raises(ValueError, match="SGD param group 1: momentum"):
        SGD([{"params": [torch.zeros(2)]}, {"params": [torch.zeros(2)], "momentum": -1.0}], lr=0.1)


@pytest.mark.parametrize("impl", IMPLS)
def test_state_dict_round_trip(impl: str) -> None:
    data = batches(12)
    model = make_model()
    opt = SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, impl=impl)
    train(model, opt, data[:5])
    saved = copy.deepcopy(opt.state_dict())
    fresh_model = copy.deepcopy(model)
    fresh = SGD(fresh_model.parameters(), lr=0.05, momentum=0.9, nesterov=True, impl=impl)
    fresh.load_state_dict(saved)
    expected = train(model, opt, data[5:])[-1]
    got = train(fresh_model, fresh, data[5:])[-1]
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


@pytest.mark.parametrize("impl", ["fused", "foreach", "reference"])
def test_grad_scale_multiplies_the_gradients_as_they_are_read(impl: str) -> None:
    # The stages fold 1 / loss scale and the clip factor into step(grad_scale=...): the same update as
    # torch.optim.SGD on the scaled-down gradients, without a separate multiply pass on the fused path.
    torch.manual_seed(0)
    ours = [torch.randn(50, requires_grad=True) for _ in range(3)]
    ref = [p.detach().clone().requires_grad_() for p in ours]
    opt = SGD(ours, lr=0.1, momentum=0.9, weight_decay=0.01, impl=impl)
    ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9, weight_decay=0.01)
    for _ in range(3):
        for a, b in zip(ours, ref, strict=True):
            grad = torch.randn(50)
            a.grad, b.grad = grad * 4, grad.clone()
        opt.step(grad_scale=0.25)
        ref_opt.step()
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_plain_sgd_state_dict_round_trips_through_the_optimizer_users_hold() -> None:
    from optstack.config import OptimizerConfig, SGDConfig
    from optstack.factory import build_optimizer

    config = OptimizerConfig(algorithm="sgd", lr=0.1, sgd=SGDConfig(momentum=0.0))
    model, twin = make_model(), make_model()
    opt = build_optimizer(config, model, rules=[]).optimizer
    data = batches(3)
    train(model, opt, data[:2])
    saved = copy.deepcopy(opt.state_dict())
    assert saved["state"] == {} and not saved["optstack"]["has_state"]  # it keeps no state, and says so
    twin.load_state_dict(model.state_dict())
    other = build_optimizer(config, twin, rules=[]).optimizer
    other.load_state_dict(saved)
    train(model, opt, data[2:])
    train(twin, other, data[2:])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))


def test_momentum_sgd_loads_torchs_plain_state_with_none_buffers() -> None:
    model, ref = make_model(), make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, foreach=False)
    ours = SGD(model.parameters(), lr=0.1, momentum=0.9, impl="reference")
    plain = torch.optim.SGD(make_model().parameters(), lr=0.1)  # keeps {"momentum_buffer": None} per param
    for p in plain.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    plain.step()
    state = copy.deepcopy(plain.state_dict())
    state["param_groups"][0]["momentum"] = 0.9
    ours.load_state_dict(state)
    ref_opt.load_state_dict(state)
    data = batches(3)
    for a, b in zip(train(model, ours, data), train(ref, ref_opt, data), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_maximize_equals_torch(impl: str, config: dict) -> None:
    data = batches(20)
    model = make_model()
    expected = train(model, torch.optim.SGD(groups(model), lr=0.05, maximize=True, foreach=False, **config), data)
    model = make_model()
    got = train(model, SGD(groups(model), lr=0.05, impl=impl, maximize=True, **config), data)
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert max_rel_diff(g, e) <= 1e-6, f"step {step}"
