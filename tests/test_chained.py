"""The chained optimizer: one global norm, one clip factor, one skip decision, one state dict."""

from __future__ import annotations

import contextlib
import copy
import io
import math
from collections.abc import Iterator

import pytest
import torch

from optstack.optimizer import ChainedOptimizer
from optstack.precision import ConstantScaler, DynamicScaler
from optstack.protocol import set_phase_hook
from optstack.stage import replicated_stage


class _TwoPart(torch.nn.Module):
    """A bf16 'dense' part and an fp32 'expert' part, to be stepped by two stages."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.dense = torch.nn.Linear(8, 8).to(torch.bfloat16)
        self.expert = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.expert(torch.tanh(self.dense(x.to(torch.bfloat16))).float())


def _groups(module: torch.nn.Module, prefix: str) -> list[dict]:
    names, params = zip(*module.named_parameters(prefix=prefix), strict=True)
    return [{"params": list(params), "param_names": list(names)}]


def _chain(model: _TwoPart, lr: float = 1e-2, **kwargs: object) -> ChainedOptimizer:
    def adamw(groups: list[dict]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(groups, lr=lr)

    dense = replicated_stage(_groups(model.dense, "dense"), adamw)
    expert = replicated_stage(_groups(model.expert, "expert"), adamw, masters=False)
    return ChainedOptimizer([dense, expert], **kwargs)  # type: ignore[arg-type]


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 8, generator=gen), torch.randn(16, 3, generator=gen)


def _backward(model: _TwoPart, chain: ChainedOptimizer, step: int, grad_mult: float = 1.0) -> None:
    x, y = _data(step)
    loss = ((model(x) - y) ** 2).mean() * grad_mult
    chain.scale_loss(loss).backward()


def _sgd_chain(
    params_a: list[torch.Tensor], params_b: list[torch.Tensor], **kwargs: object
) -> ChainedOptimizer:
    def sgd(groups: list[dict]) -> torch.optim.Optimizer:
        return torch.optim.SGD(groups, lr=1.0)

    stages = [replicated_stage([{"params": params_a}], sgd, masters=False),
              replicated_stage([{"params": params_b}], sgd, masters=False)]
    return ChainedOptimizer(stages, **kwargs)  # type: ignore[arg-type]


def _params_with_grads(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    a = [torch.zeros(3, 4), torch.zeros(5)]
    b = [torch.zeros(7), torch.zeros(2, 2)]
    for p in a + b:
        p.grad = torch.randn(p.shape, generator=gen)
    return a, b


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_global_norm_is_the_norm_of_all_grads_concatenated(norm_type: float) -> None:
    a, b = _params_with_grads()
    everything = torch.cat([p.grad.flatten() for p in a + b])
    expected = everything.norm(norm_type).item()
    chain = _sgd_chain(a, b, norm_type=norm_type)
    chain.step()
    result = chain.last_result
    assert result.applied and result.grad_norm == pytest.approx(expected, rel=1e-6)


def test_clipping_applies_one_coefficient_to_every_stage() -> None:
    a, b = _params_with_grads()
    grads = [p.grad.clone() for p in a + b]
    norm = torch.cat([g.flatten() for g in grads]).norm().item()
    chain = _sgd_chain(a, b, clip_grad=norm / 4)
    chain.step()
    result = chain.last_result
    coeff = (norm / 4) / (norm + 1e-6)
    assert result.grad_norm == pytest.approx(norm)  # reported before clipping
    for p, g in zip(a + b, grads, strict=True):
        torch.testing.assert_close(p, -coeff * g)  # SGD lr=1 from zero: the update is the clipped grad


@pytest.mark.parametrize("scale", [1.0, 8.0])
def test_a_separate_norm_group_is_clipped_by_its_own_norm(scale: float) -> None:
    """norm_groups: the tagged parameters leave the global norm (reported, read by the skip threshold) and are
    clipped by their group's norm; a stage mixing both kinds scales each piece by its own factor."""
    a, b = _params_with_grads()
    aux = {id(a[1]), id(b[0])}  # one tagged parameter in each stage
    grads = [p.grad.clone() for p in a + b]
    for p in a + b:
        p.grad.mul_(scale)  # loss-scaled gradients: norms and factors are of the unscaled ones
    main_norm = torch.cat([g.flatten() for p, g in zip(a + b, grads, strict=True) if id(p) not in aux]).norm().item()
    aux_norm = torch.cat([g.flatten() for p, g in zip(a + b, grads, strict=True) if id(p) in aux]).norm().item()
    clip = min(main_norm, aux_norm) / 3
    chain = _sgd_chain(a, b, clip_grad=clip, scaler=ConstantScaler(scale), grad_norm_skip_threshold=main_norm * 1.01,
                       norm_groups=("aux",), norm_group_of=lambda p: "aux" if id(p) in aux else None)
    chain.step()
    result = chain.last_result
    assert result.applied and result.grad_norm == pytest.approx(main_norm, rel=1e-6)
    assert chain.norms_by_group == {"aux": pytest.approx(aux_norm, rel=1e-6)}
    for p, g in zip(a + b, grads, strict=True):
        norm = aux_norm if id(p) in aux else main_norm
        torch.testing.assert_close(p, -(clip / (norm + 1e-6)) * g)
    with pytest.raises(ValueError, match="norm group 'other'.*not among norm_groups"):
        _sgd_chain(a, b, norm_groups=("aux",), norm_group_of=lambda p: "other")


def test_no_clipping_below_the_limit() -> None:
    a, b = _params_with_grads()
    grads = [p.grad.clone() for p in a + b]
    _sgd_chain(a, b, clip_grad=1e6).step()
    for p, g in zip(a + b, grads, strict=True):
        assert torch.equal(p, -g)


def test_skip_threshold_skips_every_stage() -> None:
    model = _TwoPart()
    chain = _chain(model, grad_norm_skip_threshold=1e-3)
    before = copy.deepcopy(model.state_dict())
    _backward(model, chain, 0)
    chain.step()
    result = chain.last_result
    assert not result.applied and result.grad_norm is not None and result.grad_norm > 1e-3
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    assert all(not stage.optimizer.state for stage in chain.stages)  # no optimizer state was created


def test_non_finite_in_one_stage_skips_all_and_backs_off() -> None:
    model = _TwoPart()
    chain = _chain(model, scaler=DynamicScaler(initial_scale=8.0, hysteresis=1))
    _backward(model, chain, 0)
    chain.step()
    steps_before = [s["step"].clone() for stage in chain.stages for s in stage.optimizer.state.values()]
    params_before = copy.deepcopy(model.state_dict())
    _backward(model, chain, 1)
    model.expert.bias.grad[0] = float("inf")
    chain.step()
    result = chain.last_result
    assert result == type(result)(applied=False, grad_norm=None, num_zeros=None, loss_scale=4.0)
    steps_after = [s["step"] for stage in chain.stages for s in stage.optimizer.state.values()]
    assert all(torch.equal(x, y) for x, y in zip(steps_before, steps_after, strict=True))
    for key, value in model.state_dict().items():
        assert torch.equal(value, params_before[key])


def test_shared_and_tensor_parallel_duplicates_are_left_out_of_the_norm() -> None:
    a, b = _params_with_grads()
    a[1].shared = True  # e.g. a tied embedding counted on another pipeline stage
    b[0].tensor_model_parallel = False  # replicated across tensor-parallel ranks
    b[1].tensor_model_parallel = True

    def sgd(groups: list[dict]) -> torch.optim.Optimizer:
        return torch.optim.SGD(groups, lr=1.0)

    def chain_on(tp_rank: int) -> ChainedOptimizer:
        stages = [
            replicated_stage([{"params": a}], sgd, tp_rank=tp_rank, masters=False),
            replicated_stage([{"params": b}], sgd, tp_rank=tp_rank, masters=False),
        ]
        return ChainedOptimizer(stages, log_num_zeros_in_grad=True)

    a[0].grad[0, 0] = 0.0  # one zero in a counted grad
    a[1].grad[0] = 0.0  # and one in the shared param, never counted
    # rank 0 counts everything but the shared param; rank 1 only the tensor-parallel split param
    for tp_rank, counted in ((0, [a[0], b[0], b[1]]), (1, [b[1]])):
        chain = chain_on(tp_rank)
        chain.step()
        result = chain.last_result
        expected = torch.cat([p.grad.flatten() for p in counted])
        assert result.grad_norm == pytest.approx(expected.norm().item(), rel=1e-6)
        assert result.num_zeros == int((expected == 0).sum())


def test_num_zeros_is_counted_across_stages() -> None:
    a, b = _params_with_grads()
    a[0].grad[0] = 0.0  # 4 zeros
    b[1].grad.zero_()  # 4 zeros
    counting, plain = _sgd_chain(a, b, log_num_zeros_in_grad=True), _sgd_chain(*_params_with_grads())
    counting.step()
    plain.step()
    assert counting.last_result.num_zeros == 8
    assert plain.last_result.num_zeros is None


def test_a_chain_of_no_stages_still_steps() -> None:
    chain = ChainedOptimizer([], clip_grad=1.0, log_num_zeros_in_grad=True)
    chain.step()
    assert chain.last_result == type(chain.last_result)(applied=True, grad_norm=0.0, num_zeros=0, loss_scale=1.0)
    assert chain.param_groups == []
    chain.load_state_dict(chain.state_dict())


def test_param_groups_are_the_live_inner_groups() -> None:
    model = _TwoPart()
    chain = _chain(model)
    assert len(chain.param_groups) == 2
    for group in chain.param_groups:
        group["lr"] = 0.5  # what a scheduler does
    _backward(model, chain, 0)
    chain.step()  # the model-side settings reach the inner optimizers at the step
    assert [g["lr"] for stage in chain.stages for g in stage.optimizer.param_groups] == [0.5, 0.5]


def test_loss_scale_and_scale_loss() -> None:
    chain = _chain(_TwoPart(), scaler=ConstantScaler(64.0))
    assert chain.loss_scale == 64.0
    assert chain.scale_loss(torch.tensor(0.5)).item() == 32.0


def test_phases_are_reported_in_order() -> None:
    seen: list[str] = []

    @contextlib.contextmanager
    def hook(name: str) -> Iterator[None]:
        seen.append(name)
        yield

    a, b = _params_with_grads()
    set_phase_hook(hook)
    try:
        _sgd_chain(a, b, clip_grad=0.1, log_num_zeros_in_grad=True).step()
    finally:
        set_phase_hook(None)
    assert seen == [  # the finite check is the norm's pass; clipping is folded into the step
        "grad_norm",
        "count_zeros",
        "inner_step",
        "publish_params",
        "publish_params",
    ]


def test_bad_configuration_is_refused() -> None:
    a, b = _params_with_grads()
    with pytest.raises(ValueError, match="clip_grad"):
        _sgd_chain(a, b, clip_grad=-1.0)
    with pytest.raises(ValueError, match="norm_type"):
        _sgd_chain(a, b, norm_type=0.0)
    with pytest.raises(ValueError, match="grad_norm_skip_threshold"):
        _sgd_chain(a, b, grad_norm_skip_threshold=0.0)
    with pytest.raises(ValueError, match="scaler"):
        _sgd_chain(a, b, scaler=2.0)
    with pytest.raises(ValueError, match="exactly one stage"):
        _sgd_chain(a, a)
    with pytest.raises(ValueError, match="Stage"):
        ChainedOptimizer([torch.optim.SGD(a, lr=1.0)])  # type: ignore[list-item]


def _save(model: torch.nn.Module, chain: ChainedOptimizer) -> bytes:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": chain.state_dict()}, buffer)
    return buffer.getvalue()


def _load(blob: bytes) -> dict:
    return torch.load(io.BytesIO(blob))


def _train(model: _TwoPart, chain: ChainedOptimizer, steps: range) -> None:
    for step in steps:
        # a large multiplier on some steps overflows nothing in fp32 but exercises clipping
        _backward(model, chain, step, grad_mult=10.0 if step % 3 == 0 else 1.0)
        if step == 4:
            model.dense.weight.grad[0, 0] = float("nan")  # one skipped step in the window
        chain.step()
        chain.zero_grad()


def test_state_dict_round_trip_continues_bitwise_identically() -> None:
    def build(model: _TwoPart) -> ChainedOptimizer:
        scaler = DynamicScaler(initial_scale=2.0**10, growth_interval=3, hysteresis=2)
        return _chain(model, scaler=scaler, clip_grad=0.5)

    model = _TwoPart()
    chain = build(model)
    _train(model, chain, range(0, 6))
    checkpoint = _save(model, chain)
    _train(model, chain, range(6, 12))

    fresh_model = _TwoPart(seed=123)
    fresh = build(fresh_model)
    state = _load(checkpoint)
    fresh_model.load_state_dict(state["model"])
    fresh.load_state_dict(state["optimizer"])
    _train(fresh_model, fresh, range(6, 12))

    assert _save(fresh_model, fresh) == _save(
        model, chain
    )  # bitwise: params, masters, moments, steps, scaler
    assert fresh.loss_scale == chain.loss_scale


def test_mismatched_state_dict_is_refused_whole() -> None:
    model = _TwoPart()
    chain = _chain(model, scaler=DynamicScaler(initial_scale=64.0))
    _train(model, chain, range(2))
    good = _load(_save(model, chain))["optimizer"]
    _train(model, chain, range(2, 3))  # now every part of `good` differs from the live state
    before = _save(model, chain)

    misfit = copy.deepcopy(good)  # exp_avg of a wider expert layer
    names = [n for g in good["param_groups"] for n in g["param_names"]]
    misfit["state"][names.index("expert.weight")]["exp_avg"] = torch.zeros(5 * 8)

    with pytest.raises(ValueError, match="param groups"):
        chain.load_state_dict({**good, "param_groups": good["param_groups"][:1]})
    with pytest.raises(ValueError, match=r"Stage.*expert.weight|expert.weight.*elements"):
        chain.load_state_dict(misfit)
    with pytest.raises(ValueError, match="'constant' scaler"):
        chain.load_state_dict({**good, "optstack": {"version": 2, "scaler": ConstantScaler(2.0).state_dict()}})
    with pytest.raises(ValueError, match="'state' and 'param_groups'"):
        chain.load_state_dict({"state": good["state"]})
    legacy = {"stages": [s.state_dict() for s in chain.stages], "scaler": chain.scaler.state_dict()}
    with pytest.raises(ValueError, match="stages"):  # optstack 0.2's format, still read
        chain.load_state_dict({**legacy, "stages": legacy["stages"][:1]})
    assert _save(model, chain) == before  # no stage was loaded before a later part failed
    chain.load_state_dict(good)
    assert _save(model, chain) != before
