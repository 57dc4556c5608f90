"""FP32 and mixed-precision stages: exactness against torch.optim, bf16 tracking fp32, fp16 with dynamic
loss scaling, skipped steps, gradient sources, state dicts."""

from __future__ import annotations

import copy
import functools
import io
from collections.abc import Callable

import pytest
import torch

from optstack.optimizer import ChainedOptimizer
from optstack.precision import DynamicScaler
from optstack.stage import Stage, replicated_stage

# the replicated stage with and without fp32 masters (the names of optstack 0.1)
FP32Stage = functools.partial(replicated_stage, masters=False)
MixedPrecisionStage = replicated_stage

LR = 1e-2


def _model(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    with torch.no_grad():  # a bf16-representable start, so runs in any precision begin at the same point
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    return model.to(dtype)


def _groups(model: torch.nn.Module) -> list[dict]:
    names, params = zip(*model.named_parameters(), strict=True)
    return [{"params": list(params), "param_names": list(names), "wd_mult": 1.0}]


def _adamw(groups: list[dict]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=LR, weight_decay=0.1)


def _batches(n: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, 32, 16, generator=gen), torch.randn(n, 32, 4, generator=gen)


def _backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float = 1.0) -> float:
    dtype = next(model.parameters()).dtype
    loss = ((model(x.to(dtype)).float() - y) ** 2).mean()
    (loss * scale).backward()
    return loss.item()


def _snapshot(model: torch.nn.Module, stage: Stage) -> dict:
    buffer = io.BytesIO()  # a real copy of everything, step tensors included
    torch.save({"model": model.state_dict(), "stage": stage.state_dict()}, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def _assert_bitwise_equal(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_bitwise_equal(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_bitwise_equal(x, y)
    else:
        assert a == b


def test_fp32_stage_equals_torch_adamw_bitwise() -> None:
    ours, ref = _model(), _model()
    chain = ChainedOptimizer([replicated_stage(_groups(ours), _adamw, masters=False)])
    ref_opt = _adamw([{"params": list(ref.parameters())}])
    xs, ys = _batches(5)
    for x, y in zip(xs, ys, strict=True):
        _backward(ours, x, y)
        _backward(ref, x, y)
        chain.step()
        assert chain.last_result.applied
        ref_opt.step()
        chain.zero_grad()
        ref_opt.zero_grad()
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


def test_mixed_step_is_fp32_adamw_on_masters_then_rounded_back() -> None:
    model = _model(torch.bfloat16)
    stage = replicated_stage(_groups(model), _adamw)
    ref = [p.detach().float().clone() for p in model.parameters()]
    ref_opt = _adamw([{"params": ref}])
    storage = [p.data_ptr() for p in model.parameters()]
    xs, ys = _batches(3)
    for x, y in zip(xs, ys, strict=True):
        _backward(model, x, y)
        for r, p in zip(ref, model.parameters(), strict=True):
            r.grad = p.grad.float()
        assert stage.grad_stats(2.0)[1] == 0  # no non-finite gradient
        stage.step()
        ref_opt.step()
        stage.zero_grad()
    for r, master, p in zip(ref, stage.master_params, model.parameters(), strict=True):
        assert torch.equal(master, r)
        assert torch.equal(p, r.to(torch.bfloat16))
    assert [p.data_ptr() for p in model.parameters()] == storage  # updated in place
    assert all(p.grad is None for p in model.parameters())
    assert all(m.grad is None for m in stage.master_params)


def test_bf16_with_fp32_masters_tracks_fp32_run() -> None:
    # Tolerance: bf16 forward/backward carries ~3 significant digits; over 20 AdamW steps the measured
    # loss gap stays below 1e-3 relative and the masters within 1% (L2) of the fp32 weights.
    ref, low = _model(), _model(torch.bfloat16)
    ref_chain = ChainedOptimizer([replicated_stage(_groups(ref), _adamw, masters=False)])
    stage = replicated_stage(_groups(low), _adamw)
    chain = ChainedOptimizer([stage])
    xs, ys = _batches(20)
    for x, y in zip(xs, ys, strict=True):
        ref_loss, low_loss = _backward(ref, x, y), _backward(low, x, y)
        assert abs(low_loss - ref_loss) <= 2e-3 * ref_loss
        ref_chain.step()
        chain.step()
        assert ref_chain.last_result.applied and chain.last_result.applied
        ref_chain.zero_grad()
        chain.zero_grad()
    for p, master in zip(ref.parameters(), stage.master_params, strict=True):
        assert ((p - master).norm() / p.norm()).item() < 2e-2
        assert not torch.equal(p, master)  # the runs really differ: the check is not vacuous


def test_fp16_dynamic_scaling_recovers_from_injected_infs() -> None:
    model = _model(torch.float16)
    stage = replicated_stage(_groups(model), _adamw)
    chain = ChainedOptimizer(
        [stage], scaler=DynamicScaler(initial_scale=1024.0, growth_interval=3, hysteresis=2)
    )
    inject = {1, 2, 3, 8}
    scales, applied, losses = [], [], []
    xs, ys = _batches(12)
    for step, (x, y) in enumerate(zip(xs, ys, strict=True)):
        losses.append(_backward(model, x, y, scale=chain.loss_scale))
        if step in inject:
            next(model.parameters()).grad[0, 0] = float("inf")
        chain.step()
        result = chain.last_result
        chain.zero_grad()
        scales.append(result.loss_scale)
        applied.append(result.applied)
        assert (result.grad_norm is None) == (step in inject)
    assert applied == [step not in inject for step in range(12)]
    # hysteresis 2: the first overflow keeps the scale, each later one halves it; 3 clean steps grow it
    assert scales == [1024, 1024, 512, 256, 256, 256, 512, 512, 512, 512, 512, 1024]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert losses[-1] < losses[0]


def test_fp16_real_overflow_backs_off_until_finite() -> None:
    model = _model(torch.float16)
    chain = ChainedOptimizer(
        [replicated_stage(_groups(model), _adamw)],
        scaler=DynamicScaler(initial_scale=2.0**24, hysteresis=1),
    )
    results = []
    xs, ys = _batches(14)
    for x, y in zip(xs, ys, strict=True):
        _backward(model, x, y, scale=chain.loss_scale)
        chain.step()
        results.append(chain.last_result)
        chain.zero_grad()
    # 2**24 overflows fp16 gradients: with hysteresis 1 every overflow halves the scale at once, every
    # clean step keeps it (the growth window is 1000), until the scaled gradients fit and training proceeds.
    scale = 2.0**24
    for result in results:
        scale = scale if result.applied else scale / 2
        assert result.loss_scale == scale
    assert not results[0].applied and sum(r.applied for r in results) >= len(results) // 2
    assert scale < 2.0**20


@pytest.mark.parametrize("stage_cls", [FP32Stage, MixedPrecisionStage])
def test_skipped_step_changes_nothing(stage_cls: type) -> None:
    model = _model(torch.float32 if stage_cls is FP32Stage else torch.bfloat16)
    stage = stage_cls(_groups(model), _adamw)
    chain = ChainedOptimizer([stage], scaler=DynamicScaler(initial_scale=4.0, hysteresis=1))
    xs, ys = _batches(3)
    for x, y in zip(xs[:2], ys[:2], strict=True):
        _backward(model, x, y, scale=chain.loss_scale)
        chain.step()
        chain.zero_grad()
    before = _snapshot(model, stage)
    _backward(model, xs[2], ys[2], scale=chain.loss_scale)
    list(model.parameters())[-1].grad[0] = float("nan")
    chain.step()
    result = chain.last_result
    assert not result.applied and result.grad_norm is None and result.loss_scale == 2.0
    _assert_bitwise_equal(_snapshot(model, stage), before)  # params, masters, moments, step counts


def test_grad_of_supplies_gradients_from_a_buffer() -> None:
    fp32, low = _model(), _model(torch.bfloat16)
    buffers = {p: torch.full_like(p, 0.5) for p in [*fp32.parameters(), *low.parameters()]}
    grad_of: Callable[[torch.Tensor], torch.Tensor] = buffers.__getitem__
    fp32_stage = replicated_stage(_groups(fp32), _adamw, grad_of=grad_of, masters=False)
    mixed = replicated_stage(_groups(low), _adamw, grad_of=grad_of)
    # The loss scale (here 2) is not applied to the gradients before the step: the norm divides it out and
    # the step folds it into its grad scale. Gradients are used where they are, or copied to fp32 masters.
    assert fp32_stage.grad_stats(2.0)[1] == 0 and mixed.grad_stats(2.0)[1] == 0
    for p in fp32.parameters():
        assert p.grad is buffers[p] and torch.equal(p.grad, torch.full_like(p, 0.5))
    for p, master in zip(low.parameters(), mixed.master_params, strict=True):
        assert p.grad is None and master.grad.dtype == torch.float32
        assert torch.equal(master.grad, torch.full_like(master, 0.5))
    ref = [p.detach().clone().requires_grad_(False) for p in fp32.parameters()]
    for r in ref:
        r.grad = torch.full_like(r, 0.25)
    _adamw([{"params": ref}]).step()
    fp32_stage.step(grad_scale=0.5)
    for p, r in zip(fp32.parameters(), ref, strict=True):
        assert torch.allclose(p, r, rtol=0, atol=1e-7)  # the step saw the unscaled gradients
    mixed.step(grad_scale=0.5)
    for p in low.parameters():
        assert torch.equal(buffers[p], torch.full_like(p, 0.5))  # the model-side buffer is left alone


class _GainHead(torch.nn.Module):
    """A bf16 body with an fp32 output gain (e.g. a router or norm kept in fp32)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(16, 4).to(torch.bfloat16)
        self.gain = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x.to(torch.bfloat16)).float() * self.gain


def test_mixed_steps_fp32_params_directly() -> None:
    torch.manual_seed(0)
    model = _GainHead()
    stage = replicated_stage(_groups(model), _adamw)
    inner = stage.optimizer.param_groups[0]["params"]
    names = stage.optimizer.param_groups[0]["param_names"]
    assert names == ["gain", "body.weight", "body.bias"]  # module's own params come first
    assert inner[0] is model.gain and inner[1] is not model.body.weight and inner[2] is not model.body.bias
    assert [m.dtype for m in stage.master_params] == [torch.float32] * 2
    x, y = (b[0] for b in _batches(1))
    ((model(x) - y) ** 2).mean().backward()
    gain_before = model.gain.detach().clone()
    chain = ChainedOptimizer([stage])
    chain.step()
    assert chain.last_result.applied
    assert not torch.equal(model.gain, gain_before) and stage.optimizer.state[model.gain]["step"] == 1
    assert torch.equal(model.body.weight, stage.master_params[0].to(torch.bfloat16))


def test_zero_grad_keep_buffers() -> None:
    model = _model(torch.bfloat16)
    stage = replicated_stage(_groups(model), _adamw)
    _backward(model, *(b[0] for b in _batches(1)))
    stage.grad_stats(2.0)
    stage.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert all(m.grad is not None and not m.grad.any() for m in stage.master_params)


def test_bad_construction_is_refused() -> None:
    model = _model()
    params = list(model.parameters())
    with pytest.raises(ValueError, match="twice"):
        replicated_stage([{"params": params}, {"params": params[:1]}], _adamw, masters=False)
    with pytest.raises(ValueError, match="floating-point"):
        replicated_stage([{"params": [torch.zeros(2, dtype=torch.int64)]}], _adamw, masters=False)
    with pytest.raises(ValueError, match="param_names"):
        replicated_stage([{"params": params, "param_names": ["a"]}], _adamw, masters=False)
    with pytest.raises(ValueError, match="exactly the groups"):
        FP32Stage([{"params": params}], lambda groups: _adamw([{"params": groups[0]["params"][::-1]}]))
    with pytest.raises(ValueError, match="torch.optim.Optimizer"):
        replicated_stage([{"params": params}], lambda groups: None, masters=False)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="tp_rank"):
        replicated_stage([{"params": params}], _adamw, tp_rank=-1, masters=False)
    caller_groups = _groups(model)
    replicated_stage(caller_groups, _adamw, masters=False)
    assert set(caller_groups[0]) == {"params", "param_names", "wd_mult"}  # the caller's dict is not mutated


def _trained_stage(dtype: torch.dtype, steps: int) -> tuple[torch.nn.Module, MixedPrecisionStage]:
    model = _model(dtype)
    stage = replicated_stage(_groups(model), _adamw)
    xs, ys = _batches(steps)
    for x, y in zip(xs, ys, strict=True):
        _backward(model, x, y)
        ChainedOptimizer([stage]).step()
        stage.zero_grad()
    return model, stage


def test_mixed_state_dict_round_trip_restores_masters_and_does_not_alias() -> None:
    _, trained = _trained_stage(torch.bfloat16, 3)
    _, fresh = _trained_stage(torch.bfloat16, 0)
    saved = trained.state_dict()
    fresh.load_state_dict(saved)
    _assert_bitwise_equal(fresh.state_dict(), saved)
    for master, theirs in zip(fresh.master_params, trained.master_params, strict=True):
        assert master.data_ptr() != theirs.data_ptr()
    moments = next(iter(fresh.optimizer.state.values()))["exp_avg"]
    assert all(moments.data_ptr() != s["exp_avg"].data_ptr() for s in trained.optimizer.state.values())


def test_mismatched_state_dict_is_refused_and_changes_nothing() -> None:
    _, stage = _trained_stage(torch.bfloat16, 2)
    good = copy.deepcopy(stage.state_dict())
    before = copy.deepcopy(good)

    def broken(edit: Callable[[dict], None]) -> dict:
        state = copy.deepcopy(good)
        edit(state)
        return state

    def shrink_master(s: dict) -> None:
        s["params"]["0.bias"]["tensors"]["param"] = torch.zeros(3)

    def shrink_moment(s: dict) -> None:
        s["params"]["0.weight"]["tensors"]["exp_avg"] = torch.zeros(9)

    def rename(s: dict) -> None:
        s["params"]["head.weight"] = s["params"].pop("2.weight")

    cases = {
        "needs 'params'": lambda s: s.pop("params"),
        "2 param groups": lambda s: s["groups"].append(s["groups"][0]),
        "no state for": lambda s: s["params"].pop("0.bias"),
        "'param' of '0.bias'": shrink_master,
        "'exp_avg' of '0.weight'": shrink_moment,
        "'head.weight'": rename,
    }
    for message, edit in cases.items():
        with pytest.raises(ValueError, match=message):
            stage.load_state_dict(broken(edit))
        _assert_bitwise_equal(stage.state_dict(), before)


def test_an_empty_stage_reduces_on_the_given_device():
    # Under NCCL an empty rank must run its flag/norm reductions on the accelerator; here we check the
    # device is taken from the argument (meta stands in for a device this CPU machine does not have).
    from optstack.stage import replicated_stage

    stage = replicated_stage([{"params": []}], lambda groups: torch.optim.SGD(groups, lr=0.1),
                      device=torch.device("meta"), masters=False)
    assert stage.device == torch.device("meta")
    assert FP32Stage([{"params": []}], lambda groups: torch.optim.SGD(groups, lr=0.1)).device.type == "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_0_1_tagged_state_dict_is_migrated(dtype: torch.dtype) -> None:
    # optstack 0.1 saved {"kind", "optimizer": the inner torch state dict, "fp32_masters"}; directly stepped
    # parameters were the model checkpoint's business, so the model is loaded first, as it was then.
    trained_model, trained = _trained_stage(dtype, 3)
    old = copy.deepcopy({"kind": "mixed" if dtype == torch.bfloat16 else "fp32",
                         "optimizer": trained.optimizer.state_dict(),
                         "fp32_masters": [list(trained.master_params)]})
    if dtype == torch.float32:
        del old["fp32_masters"]
    model, fresh = _trained_stage(dtype, 0)
    model.load_state_dict(trained_model.state_dict())
    fresh.load_state_dict(old)
    _assert_bitwise_equal(fresh.state_dict(), trained.state_dict())
    with pytest.raises(ValueError, match="unknown 0.1 stage state kind 'sparse'"):
        fresh.load_state_dict({**old, "kind": "sparse"})
