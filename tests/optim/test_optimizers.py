"""optstack.optim's torch-style constructors: a one-line swap for torch.optim's classes (same signatures,
defaults, per-group options, results and state dicts), with torch's errors for bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from optim_harness import batches, make_model, max_rel_diff, train
from torch import nn

import optstack.optim as oo
from optstack.optimizer import ChainedOptimizer


def _groups(model: nn.Module, **second: object) -> list[dict]:
    first, last = model[0], model[2]
    return [{"params": [first.weight, first.bias]},
            {"params": [last.weight, last.bias], "lr": 3e-3, "weight_decay": 0.0, **second}]


@pytest.mark.parametrize("fused", [True, None])
def test_adamw_is_a_one_line_swap_bitwise_equal_to_torchs_fused(fused: bool | None) -> None:
    data = batches(20)
    model = make_model()
    expected = train(model, torch.optim.AdamW(_groups(model), lr=1e-2, fused=True), data)
    model = make_model()
    opt = oo.AdamW(_groups(model), lr=1e-2, fused=fused)
    got = train(model, opt, data)
    assert isinstance(opt, torch.optim.Optimizer) and isinstance(opt, ChainedOptimizer)
    assert all(torch.equal(g, e) for g, e in zip(got[-1], expected[-1], strict=True))
    assert opt.defaults == torch.optim.AdamW([nn.Parameter(torch.ones(1))], lr=1e-2, fused=fused).defaults


@pytest.mark.parametrize(("ours", "theirs", "kwargs"), [
    (oo.Adam, torch.optim.Adam, {"weight_decay": 0.1}),
    (oo.Adam, torch.optim.Adam, {"weight_decay": 0.1, "decoupled_weight_decay": True}),
    (oo.AdamW, torch.optim.AdamW, {"amsgrad": True, "maximize": True}),
    (oo.SGD, torch.optim.SGD, {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1}),
    (oo.SGD, torch.optim.SGD, {"maximize": True}),
], ids=["adam", "adam-decoupled", "adamw-amsgrad-maximize", "sgd-nesterov", "sgd-maximize"])
@pytest.mark.parametrize("foreach", [False, True])
def test_torch_classes_swap_with_the_same_trajectory(ours, theirs, kwargs: dict, foreach: bool) -> None:
    data = batches(20)
    model = make_model()
    expected = train(model, theirs(_groups(model), lr=1e-2, foreach=foreach, **kwargs), data)
    model = make_model()
    got = train(model, ours(_groups(model), lr=1e-2, foreach=foreach, **kwargs), data)
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert max_rel_diff(g, e) <= 1e-6, f"step {step}"


def test_per_group_options_are_honoured() -> None:
    data = batches(15)
    model = make_model()
    expected = train(model, torch.optim.AdamW(_groups(model, amsgrad=True, maximize=True), lr=1e-2,
                                              foreach=False), data)
    model = make_model()
    got = train(model, oo.AdamW(_groups(model, amsgrad=True, maximize=True), lr=1e-2, foreach=False), data)
    assert all(torch.equal(g, e) for g, e in zip(got[-1], expected[-1], strict=True))


def test_fp64_adamw_is_within_1e_12_of_torch() -> None:
    data = [(x.double(), y.double()) for x, y in batches(20)]
    model = make_model().double()
    expected = train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), data)
    model = make_model().double()
    opt = oo.AdamW(model.parameters(), lr=1e-2)
    got = train(model, opt, data)
    assert max_rel_diff(got[-1], expected[-1]) <= 1e-12
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.float64


def test_a_tensor_lr_steps_as_the_same_float_and_schedulers_drive_it() -> None:
    data = batches(6)
    a, b = make_model(), make_model()
    lr = torch.tensor(1e-2)  # an fp32 number: the float below is the same one
    opt_a, opt_b = oo.AdamW(a.parameters(), lr=lr), oo.AdamW(b.parameters(), lr=lr.item())
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, step_size=2, gamma=0.5)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, step_size=2, gamma=0.5)
    for x in data:
        for model, opt, sched in ((a, opt_a, sched_a), (b, opt_b, sched_b)):
            train(model, opt, [x])
            sched.step()
    assert isinstance(opt_a.param_groups[0]["lr"], torch.Tensor)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_foreach_and_fused_choose_optstacks_kernel() -> None:
    def impl(**flags: object) -> str:
        return oo.AdamW(make_model().parameters(), **flags).stages[0].optimizer.impl

    assert (impl(), impl(fused=True), impl(foreach=True), impl(foreach=False)) == (
        "auto", "fused", "foreach", "reference")
    assert oo.Lion(make_model().parameters(), fused=True).stages[0].optimizer.impl == "auto"  # a hint


def test_named_parameters_and_torch_state_dicts_move_both_ways() -> None:
    data = batches(6)
    model, twin = make_model(), make_model()
    theirs = torch.optim.AdamW(model.named_parameters(), lr=1e-2)
    train(model, theirs, data[:3])
    ours = oo.AdamW(twin.named_parameters(), lr=1e-2)
    twin.load_state_dict(model.state_dict())
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
    train(model, theirs, data[3:])
    train(twin, ours, data[3:])
    assert max_rel_diff(list(twin.parameters()), list(model.parameters())) <= 1e-6
    back = torch.optim.AdamW(make_model().named_parameters(), lr=1e-2)
    back.load_state_dict(copy.deepcopy(ours.state_dict()))
    assert back.state_dict()["param_groups"][0]["param_names"] == [n for n, _ in model.named_parameters()]


def test_bf16_parameters_are_stepped_through_fp32_masters() -> None:
    model = make_model().to(torch.bfloat16)
    opt = oo.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6, dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    assert opt.state[model[0].weight]["master"].dtype == torch.float32


def test_add_param_group_fills_torchs_defaults() -> None:
    model, extra = make_model(), nn.Linear(3, 2)
    opt = oo.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.add_param_group({"params": extra.weight, "lr": 0.5})
    assert opt.param_groups[-1]["lr"] == 0.5 and opt.param_groups[-1]["momentum"] == 0.9
    assert opt.param_groups[-1]["foreach"] is None
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        opt.add_param_group({"params": [extra.weight]})


def test_muon_takes_torchs_arguments_and_descends() -> None:
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(8, 4))
    target = torch.randn(8, 4)
    opt = oo.Muon([weight], lr=0.05, adjust_lr_fn="match_rms_adamw")
    start = (weight - target).square().sum().item()
    for _ in range(10):
        opt.zero_grad()
        (weight - target).square().sum().backward()
        opt.step()
    assert (weight - target).square().sum().item() < start
    assert opt.stages[0].optimizer.param_groups[0]["scale_mode"] == "spectral"


@pytest.mark.parametrize(("make", "error", "match"), [
    (lambda p: oo.AdamW(p[0]), TypeError, "should be an iterable of Tensors or dicts"),
    (lambda p: oo.AdamW([]), ValueError, "empty parameter list"),
    (lambda p: oo.AdamW(p, lr=-1), ValueError, "Invalid learning rate: -1"),
    (lambda p: oo.AdamW(p, betas=(1.0, 0.9)), ValueError, "Invalid beta parameter at index 0: 1.0"),
    (lambda p: oo.Adam(p, weight_decay=-1), ValueError, "Invalid weight_decay value: -1"),
    (lambda p: oo.AdamW(p, lr=torch.tensor([1e-3, 1e-3])), ValueError, "Tensor lr must be 1-element"),
    (lambda p: oo.AdamW(p, foreach=True, fused=True), RuntimeError, "`fused` and `foreach` cannot be `True`"),
    (lambda p: oo.AdamW(p, capturable=True), ValueError, "capturable=True is not supported"),
    (lambda p: oo.SGD(p, differentiable=True), ValueError, "differentiable=True is not supported"),
    (lambda p: oo.SGD(p, momentum=-0.5), ValueError, "Invalid momentum value: -0.5"),
    (lambda p: oo.SGD(p, nesterov=True), ValueError, "Nesterov momentum requires a momentum"),
    (lambda p: oo.AdamW([{"params": p[0]}, {"params": p[0]}]), ValueError, "more than one parameter group"),
    (lambda p: oo.AdamW([("w", p[0]), p[1]]), ValueError, "with/without names"),
    (lambda p: oo.AdamW([torch.zeros(2, dtype=torch.complex64, requires_grad=True)]), ValueError, "view_as_real"),
    (lambda p: oo.Muon([p[1]]), ValueError, "Muon only supports 2D parameters"),
    (lambda p: oo.Muon([p[0]], adjust_lr_fn="x"), ValueError, "Adjust learning rate function x is not supported"),
])
def test_bad_input_raises_torchs_errors(make, error: type, match: str) -> None:
    params = [nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.ones(2))]
    with pytest.raises(error, match=match):
        make(params)


def test_a_duplicate_parameter_warns_as_torch_and_is_kept_once() -> None:
    weight = nn.Parameter(torch.ones(2))
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = oo.SGD([weight, weight], lr=0.1)
    assert len(opt.param_groups[0]["params"]) == 1


def test_a_meta_model_builds_steps_nothing_and_fused_refuses_meta_gradients() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    opt = oo.AdamW(model.parameters(), fused=True)
    opt.step()  # no gradients: nothing to do, as torch
    assert not opt.last_result.applied
    with torch.device("meta"):
        for p in model.parameters():
            p.grad = torch.rand_like(p)
    with pytest.raises(RuntimeError, match="`fused=True` requires all the params to be floating point Tensors"):
        opt.step()
    plain = oo.AdamW(model.parameters())
    with pytest.raises(RuntimeError, match="meta device.*to_empty"):
        plain.step()
