"""Lion: equal to its reference kernel and to an independent written-out formula; flat shard views,
validation, state_dict round trips."""

from __future__ import annotations

import copy

import pytest
import torch
from optim_harness import batches, clones_with_grads, flat_views, make_model, train
from torch import nn

from optstack.algorithms import Lion, lion_reference


def groups(model: nn.Module) -> list[dict]:
    return [
        {"params": list(model[0].parameters()), "weight_decay": 0.5},
        {"params": list(model[2].parameters()), "lr": 3e-4, "betas": (0.8, 0.95)},
    ]


class WrittenOutLion(torch.optim.Optimizer):
    """Lion exactly as the paper's pseudo-code writes it, independent of optstack."""

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0
                 ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                c = beta1 * m + (1 - beta1) * p.grad
                p.copy_(p * (1 - group["lr"] * group["weight_decay"]) - group["lr"] * torch.sign(c))
                m.copy_(beta2 * m + (1 - beta2) * p.grad)


def test_foreach_equals_reference_bitwise() -> None:
    data = batches(50)
    results = []
    for impl in ("reference", "foreach", "auto"):
        model = make_model()
        results.append(train(model, Lion(groups(model), lr=1e-3, impl=impl), data)[-1])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(other, results[0], strict=True))


@pytest.mark.parametrize("impl", ["reference", "foreach"])
def test_equals_written_out_formula(impl: str) -> None:
    data = batches(50)
    model = make_model()
    expected = train(model, WrittenOutLion(groups(model), lr=1e-3), data)[-1]
    model = make_model()
    got = train(model, Lion(groups(model), lr=1e-3, impl=impl), data)[-1]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)


def test_reference_kernel_single_step() -> None:
    p, g, m = torch.tensor([1.0, 1.0, 1.0]), torch.tensor([2.0, -1.0, 0.0]), torch.tensor([-1.0, 0.0, 0.0])
    lion_reference(p, g, m, lr=0.1, beta1=0.9, beta2=0.5, weight_decay=1.0)
    # c = 0.9 m + 0.1 g = (-0.7, -0.1, 0): sign (-1, -1, 0); p = 0.9 p - 0.1 sign(c)
    torch.testing.assert_close(p, torch.tensor([1.0, 1.0, 0.9]))
    torch.testing.assert_close(m, torch.tensor([0.5, -0.5, 0.0]))


def test_state_is_one_tensor_and_grad_none_is_skipped() -> None:
    a, b = torch.ones(3), torch.ones(2)
    a.grad = torch.tensor([1.0, -1.0, 0.0])
    opt = Lion([a, b], lr=0.1)
    opt.step()
    torch.testing.assert_close(a, torch.tensor([0.9, 1.1, 1.0]))
    assert set(opt.state[a]) == {"exp_avg"} and not opt.state.get(b)
    assert torch.equal(b, torch.ones(2))


def test_flat_shard_views_equal_separate_tensors() -> None:
    numels = [4, 11, 2]
    _, views = flat_views(numels, seed=3)
    clones = clones_with_grads(views)
    opt = Lion(views, lr=0.1, weight_decay=0.1)
    reference = Lion(clones, lr=0.1, weight_decay=0.1, impl="reference")
    for _ in range(3):
        opt.step()
        reference.step()
    assert all(torch.equal(v, c) for v, c in zip(views, clones, strict=True))
    assert len({opt.state[v]["exp_avg"].untyped_storage().data_ptr() for v in views}) == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, "Lion param group 0: lr must be"),
        ({"betas": (0.9, 1.0)}, r"betas\[1\] must be in \[0, 1\)"),
        ({"weight_decay": -0.1}, "weight_decay must be"),
        ({"impl": "fused"}, "impl must be one of"),
    ],
)
def test_bad_hyperparameters(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Lion([torch.zeros(2)], **kwargs)


@pytest.mark.parametrize("impl", ["foreach", "reference"])
def test_state_dict_round_trip(impl: str) -> None:
    data = batches(12)
    model = make_model()
    opt = Lion(groups(model), lr=1e-3, impl=impl)
    train(model, opt, data[:5])
    saved = copy.deepcopy(opt.state_dict())
    fresh_model = copy.deepcopy(model)
    fresh = Lion(groups(fresh_model), lr=1e-3, impl=impl)
    fresh.load_state_dict(saved)
    expected = train(model, opt, data[5:])[-1]
    assert all(torch.equal(g, e) for g, e in zip(train(fresh_model, fresh, data[5:])[-1], expected, strict=True))
