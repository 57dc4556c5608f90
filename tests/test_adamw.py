"""AdamW / Adam: trajectories equal torch.optim's for every impl, low-precision state, flat shard views,
validation and state_dict round trips."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from optim_harness import IMPLS, batches, clones_with_grads, flat_views, make_model, max_rel_diff, train
from torch import nn

from optstack.algorithms import AdamW, _staging, adamw_reference


def groups(model: nn.Module) -> list[dict]:
    """Two groups with different hyperparameters: per-group values must be honoured."""
    first, second = model[0], model[2]
    return [
        {"params": [first.weight, first.bias], "lr": 1e-2, "weight_decay": 0.1},
        {"params": [second.weight, second.bias], "lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6,
         "weight_decay": 0.0},
    ]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_trajectory_equals_torch(impl: str, decoupled: bool) -> None:
    data = batches(50)
    reference_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    model = make_model()
    expected = train(model, reference_cls(groups(model), lr=1e-3), data)
    model = make_model()
    opt = AdamW(groups(model), lr=1e-3, decoupled=decoupled, impl=impl)
    got = train(model, opt, data)
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert max_rel_diff(g, e) <= 1e-6, f"step {step}"
    assert float(opt.state[model[0].weight]["step"]) == 50


@pytest.mark.parametrize("decoupled", [True, False])
def test_reference_and_foreach_are_bitwise_torch(decoupled: bool) -> None:
    data = batches(20)
    reference_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    model = make_model()
    expected = train(model, reference_cls(groups(model), lr=1e-3, foreach=False), data)
    for impl in ("reference", "foreach"):
        model = make_model()
        got = train(model, AdamW(groups(model), decoupled=decoupled, impl=impl), data)
        assert all(torch.equal(g, e) for g, e in zip(got[-1], expected[-1], strict=True)), impl


def test_reference_kernel_single_tensor() -> None:
    gen = torch.Generator().manual_seed(2)
    p, g = torch.randn(5, generator=gen), torch.randn(5, generator=gen)
    m, v = torch.zeros(5), torch.zeros(5)
    expected = p.clone()
    adamw_reference(p, g, m, v, step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.5,
                    decoupled=True)
    # First step: m_hat = g, v_hat = g^2, so the update is lr * sign(g) (up to eps), after decay.
    expected = expected * (1 - 0.1 * 0.5) - 0.1 * g / (g.abs() + 1e-8)
    torch.testing.assert_close(p, expected)
    torch.testing.assert_close(m, 0.1 * g)


def test_params_without_grad_are_skipped_and_plain_tensors_work() -> None:
    a, b = torch.ones(3), torch.ones(2)  # plain leaf tensors, no requires_grad
    a.grad = torch.full((3,), 0.5)
    opt = AdamW([a, b], lr=0.1, weight_decay=0.0)
    opt.step()
    torch.testing.assert_close(a, torch.full((3,), 0.9))
    assert torch.equal(b, torch.ones(2))
    assert b not in opt.state or not opt.state[b]


def test_closure_loss_is_returned() -> None:
    model = make_model()
    opt = AdamW(model.parameters())
    x, y = batches(1)[0]

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.item() > 0
    assert opt.state[model[0].weight]["exp_avg"].abs().sum() > 0


def test_steps_differ_when_some_grads_are_missing() -> None:
    """Params stepped at different rates keep their own step count (partial step-buffer updates)."""
    data = batches(12)

    def run(make) -> list[torch.Tensor]:
        model = make_model()
        opt = make(model.parameters())
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if i % 3:
                model[2].weight.grad = None
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    expected = run(lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    for impl in IMPLS:
        assert max_rel_diff(run(lambda ps, impl=impl: AdamW(ps, lr=1e-2, impl=impl)), expected) <= 1e-6, impl


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_flat_shard_views_step_in_one_call(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    numels = [7, 1, 30, 12]
    _, views = flat_views(numels, seed=3)
    views = views[::-1]  # the order in the group does not matter, the storage order does
    clones = clones_with_grads(views)
    calls: list[int] = []
    name = "_fused_adamw_" if impl == "fused" else "_foreach_lerp_"
    original = getattr(torch, name)
    def counting(tensors: list[torch.Tensor], *args, **kwargs) -> None:
        calls.append(len(tensors))
        original(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, name, counting)
    opt = AdamW(views, lr=1e-2, impl=impl)
    reference = torch.optim.AdamW(clones, lr=1e-2)
    for _ in range(3):
        opt.step()
        reference.step()
    assert calls == [1, 1, 1]  # one flat tensor per call
    assert max_rel_diff(views, clones) <= 1e-6
    storages = {opt.state[v]["exp_avg"].untyped_storage().data_ptr() for v in views}
    assert len(storages) == 1  # the state of back-to-back params is back to back too


@pytest.mark.parametrize("impl", ["fused", "foreach", "reference"])
def test_bf16_state_is_stored_in_bf16_and_tracks_fp32(impl: str) -> None:
    data = batches(50)
    model = make_model()
    expected = train(model, AdamW(model.parameters(), lr=1e-2, impl=impl), data)
    model = make_model()
    opt = AdamW(model.parameters(), lr=1e-2, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16,
                impl=impl)
    got = train(model, opt, data)
    state = opt.state[model[0].weight]
    assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg_sq"].dtype == torch.bfloat16
    assert 0 < max_rel_diff(got[-1], expected[-1]) <= 2e-2


def test_low_precision_impls_agree() -> None:
    data = batches(20)
    results = []
    for impl in ("reference", "foreach", "fused"):
        model = make_model()
        opt = AdamW(model.parameters(), lr=1e-2, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.float16,
                    impl=impl)
        results.append(train(model, opt, data)[-1])
    assert max_rel_diff(results[1], results[0]) == 0  # foreach is the reference's ops
    assert max_rel_diff(results[2], results[0]) <= 1e-3  # fused may round a moment the other way now and then


def test_fp16_second_moment_is_stored_as_grad_rms() -> None:
    """g = 1e-4: (1 - beta2) * g**2 = 1e-11 is below fp16's smallest subnormal; the gradient's RMS is not."""
    def run(**kwargs) -> tuple[torch.Tensor, AdamW]:
        p = torch.zeros(100)
        opt = AdamW([p], lr=1e-3, weight_decay=0.0, **kwargs)
        gen = torch.Generator().manual_seed(4)
        for _ in range(30):
            p.grad = 1e-4 * (1 + torch.rand(100, generator=gen))
            opt.step()
        return p, opt

    assert torch.tensor(1e-11).half() == 0  # what storing v itself in fp16 would give
    expected, _ = run()
    got, opt = run(exp_avg_sq_dtype=torch.float16)
    state = opt.state[got]
    assert "exp_avg_sq" not in state and state["grad_rms"].dtype == torch.float16
    assert (state["grad_rms"] > 0).all()
    assert max_rel_diff([got], [expected]) <= 1e-3


@pytest.mark.parametrize("impl", ["fused", "foreach"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_staged_batches_equal_whole_tensors(impl: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    """Low-precision state goes through a scratch buffer in batches of CHUNK elements: cutting large tensors
    and packing small ones (and a non-contiguous one) into batches changes no bit."""
    def run() -> list[torch.Tensor]:
        params = [torch.linspace(-1, 1, 100), torch.linspace(0, 1, 5), torch.linspace(-2, 0, 7),
                  torch.linspace(-1, 1, 24).view(4, 6).t()]
        opt = AdamW(params, lr=1e-2, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype, impl=impl)
        for i in range(5):
            for p in params:
                p.grad = torch.sin(p * (i + 1))
            opt.step()
        return params

    whole = run()
    monkeypatch.setattr(_staging, "CHUNK", 16)
    assert all(torch.equal(a, b) for a, b in zip(run(), whole, strict=True))


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_mixed_dtypes_in_one_group_match_the_reference(impl: str) -> None:
    def run(impl: str) -> list[torch.Tensor]:
        params = [torch.linspace(-1, 1, 6, dtype=dtype) for dtype in (torch.float32, torch.float64, torch.bfloat16)]
        opt = AdamW(params, lr=1e-2, impl=impl)
        for i in range(3):
            for p in params:
                p.grad = torch.cos(p * (i + 1))
            opt.step()
        return params

    for got, expected in zip(run(impl), run("reference"), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


def test_bf16_params_step_with_fp32_math() -> None:
    data = batches(10)
    results = []
    for impl in ("reference", "fused"):
        model = make_model().to(torch.bfloat16)
        opt = AdamW(model.parameters(), lr=1e-2, impl=impl)
        results.append(train(model, opt, [(x.bfloat16(), y.bfloat16()) for x, y in data])[-1])
        assert opt.state[model[0].weight]["exp_avg"].dtype == torch.float32
    assert max_rel_diff(results[1], results[0]) <= 2e-2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"betas": (1.0, 0.999)}, r"param group 0: betas\[0\] must be in \[0, 1\)"),
        ({"betas": (0.9, -0.1)}, r"betas\[1\]"),
        ({"betas": 0.9}, "betas must be a pair"),
        ({"lr": -1.0}, "lr must be a number >= 0"),
        ({"eps": -1e-8}, "eps must be"),
        ({"weight_decay": -0.1}, "weight_decay must be"),
        ({"lr": float("nan")}, "lr must be"),
        ({"impl": "cuda"}, "impl must be one of"),
        ({"exp_avg_dtype": torch.int8}, "exp_avg_dtype must be one of"),
    ],
)
def test_bad_hyperparameters(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AdamW([torch.zeros(2)], **kwargs)


def test_bad_group_override_names_the_group() -> None:
    with pytest.raises(ValueError, match=r"Adam param group 1: eps"):
        AdamW([{"params": [torch.zeros(2)]}, {"params": [torch.zeros(2)], "eps": -1.0}], decoupled=False)


def test_bad_value_written_later_is_caught_at_step() -> None:
    p = torch.zeros(2)
    p.grad = torch.ones(2)
    opt = AdamW([p])
    opt.param_groups[0]["lr"] = -0.5  # e.g. a broken scheduler
    with pytest.raises(ValueError, match="AdamW param group 0: lr"):
        opt.step()


def continue_after_load(make, k: int = 7, extra: int = 8, through_bytes: bool = False) -> None:
    """Train k steps, save, load into a fresh optimizer over fresh params, continue: bitwise identical."""
    data = batches(k + extra)
    model = make_model()
    opt = make(model.parameters())
    train(model, opt, data[:k])
    saved = copy.deepcopy(opt.state_dict())
    if through_bytes:
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        buffer.seek(0)
        saved = torch.load(buffer)
    fresh_model = copy.deepcopy(model)
    fresh = make(fresh_model.parameters())
    fresh.load_state_dict(saved)
    expected = train(model, opt, data[k:])[-1]
    got = train(fresh_model, fresh, data[k:])[-1]
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    for p, q in zip(model.parameters(), fresh_model.parameters(), strict=True):
        for key, value in opt.state[p].items():
            assert torch.equal(fresh.state[q][key], value), key
            assert fresh.state[q][key].dtype == value.dtype


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_state_dict_round_trip(impl: str, dtype: torch.dtype) -> None:
    continue_after_load(lambda ps: AdamW(ps, lr=1e-2, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype, impl=impl),
                        through_bytes=impl == "auto")


def test_state_dict_moves_between_optstack_and_torch() -> None:
    data = batches(10)
    model = make_model()
    opt = AdamW(model.parameters(), lr=1e-2)
    train(model, opt, data[:5])
    torch_model = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-2)
    torch_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert max_rel_diff(train(torch_model, torch_opt, data[5:])[-1], train(model, opt, data[5:])[-1]) <= 1e-6
    back_model = copy.deepcopy(torch_model)
    back = AdamW(back_model.parameters(), lr=1e-2, exp_avg_sq_dtype=torch.float16)
    back.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    rms = back.state[back_model[0].weight]["grad_rms"]
    v = torch_opt.state[torch_model[0].weight]["exp_avg_sq"]
    expected = (v / (1 - 0.999**10)).sqrt()  # after 10 steps
    torch.testing.assert_close(rms.float(), expected, rtol=1e-3, atol=1e-7)
    round_trip = AdamW(copy.deepcopy(back_model).parameters(), lr=1e-2)
    round_trip.load_state_dict(back.state_dict())  # grad_rms back to exp_avg_sq
    torch.testing.assert_close(next(iter(round_trip.state.values()))["exp_avg_sq"],
                               torch_opt.state[torch_model[0].weight]["exp_avg_sq"], rtol=2e-3, atol=1e-12)


def test_load_rejects_a_wrong_shape_and_changes_nothing() -> None:
    model = make_model()
    opt = AdamW(model.parameters())
    train(model, opt, batches(1))
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][0]["exp_avg"] = torch.zeros(3, 3)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"state of parameter 0 \(shape \(12, 6\)\): saved 'exp_avg'"):
        opt.load_state_dict(saved)
    after = opt.state_dict()
    assert all(torch.equal(after["state"][0][k], v) for k, v in before["state"][0].items())


@pytest.mark.parametrize("impl", ["fused", "foreach", "reference"])
def test_grad_scale_multiplies_the_gradients_as_they_are_read(impl: str) -> None:
    # The stages fold 1 / loss scale and the clip factor into step(grad_scale=...); on the fused path it is
    # the kernel's own grad_scale (no separate pass). Same update as torch on the scaled-down gradients.
    torch.manual_seed(0)
    ours = [torch.randn(50, requires_grad=True) for _ in range(3)]
    ref = [p.detach().clone().requires_grad_() for p in ours]
    opt = AdamW(ours, lr=0.1, weight_decay=0.01, impl=impl)
    ref_opt = torch.optim.AdamW(ref, lr=0.1, weight_decay=0.01)
    for _ in range(3):
        for a, b in zip(ours, ref, strict=True):
            grad = torch.randn(50)
            a.grad, b.grad = grad * 8, grad.clone()
        opt.step(grad_scale=0.125)
        ref_opt.step()
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("flags", [{"amsgrad": True}, {"maximize": True}, {"amsgrad": True, "maximize": True}],
                         ids=["amsgrad", "maximize", "both"])
def test_amsgrad_and_maximize_equal_torch(impl: str, flags: dict) -> None:
    data = batches(30)
    model = make_model()
    expected = train(model, torch.optim.AdamW(groups(model), lr=1e-3, foreach=False, **flags), data)
    model = make_model()
    opt = AdamW(groups(model), lr=1e-3, impl=impl, **flags)
    got = train(model, opt, data)
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert max_rel_diff(g, e) <= 1e-6, f"step {step}"
    assert ("max_exp_avg_sq" in opt.state[model[0].weight]) == flags.get("amsgrad", False)


def test_amsgrad_and_maximize_are_per_group_and_the_reference_is_bitwise_torch() -> None:
    data = batches(20)

    def per_group(model: nn.Module) -> list[dict]:
        first, second = groups(model)
        return [{**first, "amsgrad": True}, {**second, "maximize": True}]

    model = make_model()
    expected = train(model, torch.optim.AdamW(per_group(model), lr=1e-3, foreach=False), data)[-1]
    model = make_model()
    got = train(model, AdamW(per_group(model), lr=1e-3, impl="reference"), data)[-1]
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


@pytest.mark.parametrize("impl", IMPLS)
def test_fp64_parameters_keep_fp64_moments_and_match_torch(impl: str) -> None:
    data = [(x.double(), y.double()) for x, y in batches(20)]
    model = make_model().double()
    expected = train(model, torch.optim.AdamW(groups(model), lr=1e-3, foreach=False), data)
    model = make_model().double()
    opt = AdamW(groups(model), lr=1e-3, impl=impl)
    got = train(model, opt, data)
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.float64
    assert max_rel_diff(got[-1], expected[-1]) <= 1e-12


def test_amsgrad_needs_full_precision_moments() -> None:
    with pytest.raises(ValueError, match="amsgrad.*fp32 / fp64 moments"):
        AdamW(make_model().parameters(), amsgrad=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
