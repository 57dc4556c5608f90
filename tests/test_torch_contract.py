"""The optimizer build_optimizer returns keeps torch.optim.Optimizer's contract: param_groups, state, defaults,
add_param_group, zero_grad, step(closure), state_dict / load_state_dict, hooks, and torch's LR schedulers."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from optstack import optim as optstack_optim
from optstack.config import DistributedConfig, OptimizerConfig, SGDConfig
from optstack.distributed.ddp import DataParallel
from optstack.factory import build_optimizer
from optstack.protocol import StepResult


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.LayerNorm(12), nn.Linear(12, 3)).to(dtype)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
    return model(x.to(next(model.parameters()).dtype)).float().pow(2).mean()


def _built(model, **config):
    return build_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0, **config), model, rules=[])


def test_it_is_a_torch_optimizer_with_live_groups_state_and_defaults() -> None:
    model = _model()
    opt = _built(model).optimizer
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.defaults["lr"] == 1e-2 and "betas" in opt.defaults
    assert [p for g in opt.param_groups for p in g["params"]] == list(model.parameters())
    assert not opt.state  # no state before the first step, as torch
    _loss(model, 0).backward()
    opt.step()
    assert len(opt.state) == len(list(model.parameters()))
    weight = model[0].weight
    assert opt.state[weight]["exp_avg"].shape == weight.shape and int(opt.state[weight]["step"]) == 1
    opt.state[weight]["exp_avg"].fill_(0.25)  # live: the next step reads it
    assert float(opt.stages[0].optimizer.state[weight]["exp_avg"][0, 0]) == 0.25


def test_bf16_state_shows_the_fp32_master() -> None:
    model = _model(torch.bfloat16)
    opt = _built(model, precision="bf16").optimizer
    _loss(model, 0).backward()
    opt.step()
    entry = opt.state[model[0].weight]
    assert entry["master"].dtype == torch.float32 and entry["master"].shape == model[0].weight.shape
    torch.testing.assert_close(entry["master"].to(torch.bfloat16), model[0].weight.detach())


def test_step_closure_returns_the_loss_and_last_result_says_what_happened() -> None:
    model = _model()
    opt = _built(model).optimizer
    assert opt.last_result is None

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = _loss(model, 0)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.item() == pytest.approx(_loss(_model(), 0).item())
    assert isinstance(opt.last_result, StepResult) and opt.last_result.applied
    assert opt.step() is None  # no closure: torch returns None


def test_zero_grad_set_to_none_false_keeps_zeroed_tensors() -> None:
    model = _model()
    opt = _built(model).optimizer
    _loss(model, 0).backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_step_and_state_dict_hooks_run() -> None:
    model = _model()
    opt = _built(model).optimizer
    calls: list[str] = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "tag": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: {k: v for k, v in sd.items() if k != "tag"})
    _loss(model, 0).backward()
    opt.step()
    assert calls == ["pre", "post"]
    saved = opt.state_dict()
    assert saved["tag"] == 1
    opt.load_state_dict(saved)


@pytest.mark.parametrize("make", [
    lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (step + 1)),
    lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5, eta_min=1e-4),
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=5e-2, total_steps=6),
], ids=["LambdaLR", "CosineAnnealingLR", "OneCycleLR"])
def test_torch_lr_schedulers_drive_it_as_they_drive_torch_adamw(make) -> None:
    ours, ref = _model(), _model()
    opt = _built(ours).optimizer
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    sched, ref_sched = make(opt), make(ref_opt)
    for step in range(5):
        for model, o, s in ((ours, opt, sched), (ref, ref_opt, ref_sched)):
            o.zero_grad()
            _loss(model, step).backward()
            o.step()
            s.step()
        assert sched.get_last_lr() == ref_sched.get_last_lr()
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_state_dict_is_torchs_format_and_loads_by_position() -> None:
    model = _model()
    opt = _built(model).optimizer
    for step in range(2):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
    saved = opt.state_dict()
    assert set(saved) == {"state", "param_groups", "optstack"}
    assert [i for g in saved["param_groups"] for i in g["params"]] == list(range(len(list(model.parameters()))))
    # What DCP's set_optimizer_state_dict hands over: the same dict keyed by names instead of indices.
    names = [n for g in saved["param_groups"] for n in g["param_names"]]
    by_name = {"state": {names[i]: v for i, v in saved["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]}
    reference = _model()
    reference.load_state_dict(model.state_dict())
    fresh = _built(reference).optimizer
    fresh.load_state_dict(by_name)
    for o, m in ((opt, model), (fresh, reference)):
        o.zero_grad()
        _loss(m, 5).backward()
        o.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


def test_add_param_group_steps_the_new_parameters() -> None:
    model, extra = _model(), nn.Linear(3, 2)
    opt = _built(model).optimizer
    opt.add_param_group({"params": list(extra.parameters()), "lr": 0.5})
    assert opt.param_groups[-1]["lr"] == 0.5 and opt.param_groups[-1]["betas"] == opt.defaults["betas"]
    before = extra.weight.detach().clone()
    (_loss(model, 0) + extra(torch.ones(1, 3)).sum()).backward()
    opt.step()
    assert not torch.equal(before, extra.weight) and extra.weight in opt.state
    with pytest.raises(ValueError, match="already in a param group"):
        opt.add_param_group({"params": [model[0].weight]})


def test_add_param_group_is_refused_where_the_placement_is_fixed() -> None:
    model = DataParallel(_model(), shard_grads=True)  # ZeRO-1 on a world of one process
    config = OptimizerConfig(lr=1e-2, distributed=DistributedConfig(sharding="zero1"))
    opt = build_optimizer(config, model).optimizer
    groups_before = [dict(g) for g in opt.param_groups]
    with pytest.raises(ValueError, match="ZeRO-1 shards.*Build the optimizer over every parameter"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    assert [dict(g) for g in opt.param_groups] == groups_before


def test_pickling_says_what_to_save_instead() -> None:
    opt = _built(_model()).optimizer
    with pytest.raises(TypeError, match="state_dict"):
        copy.deepcopy(opt)


def test_state_is_a_writable_mapping_whose_user_entries_are_kept_saved_and_restored() -> None:
    model = _model()
    opt = _built(model).optimizer
    weight, bias = model[0].weight, model[0].bias
    opt.state[weight]["ema"] = torch.zeros(3)  # before the first step: kept, not dropped
    opt.state[bias] = {"seen": 1}
    opt.state["tag"] = "run-7"  # a key that is not a parameter, as torch's state-dict hooks add
    assert weight in opt.state and opt.state[weight]["ema"].shape == (3,)
    _loss(model, 0).backward()
    opt.step()
    assert set(opt.state[weight]) == {"step", "exp_avg", "exp_avg_sq", "ema"}
    opt.state[weight]["exp_avg"] = torch.full_like(weight, 0.5)  # optstack's own: written into the live tensor
    assert float(opt.stages[0].optimizer.state[weight]["exp_avg"][0, 0]) == 0.5
    with pytest.raises(ValueError, match="own state"):
        del opt.state[weight]["exp_avg"]
    saved = copy.deepcopy(opt.state_dict())
    assert saved["state"]["tag"] == "run-7" and saved["state"][1]["seen"] == 1
    assert torch.equal(saved["state"][0]["ema"], torch.zeros(3))
    fresh = _built(_model()).optimizer
    fresh.load_state_dict(saved)
    assert fresh.state["tag"] == "run-7" and fresh.state[fresh.param_groups[0]["params"][1]]["seen"] == 1
    loaded = fresh.state[fresh.param_groups[0]["params"][0]]
    assert torch.equal(loaded["ema"], torch.zeros(3)) and torch.equal(loaded["exp_avg"], saved["state"][0]["exp_avg"])
    # the user's keys stay out of the algorithm's state: the next step runs
    fresh_model = _model()
    fresh2 = _built(fresh_model).optimizer
    fresh2.load_state_dict(saved)
    _loss(fresh_model, 1).backward()
    fresh2.step()
    assert "ema" not in fresh2.stages[0].optimizer.state[fresh_model[0].weight]


def test_frozen_parameters_are_kept_and_stepped_once_they_have_gradients() -> None:
    model, ref = _model(), _model()
    model[2].requires_grad_(False)
    ref[2].requires_grad_(False)
    opt = _built(model).optimizer
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    assert [p for g in opt.param_groups for p in g["params"]] == list(model.parameters())
    frozen = model[2].weight.detach().clone()
    for step in range(4):
        if step == 2:  # gradual unfreezing: the layer trains from here on
            model[2].requires_grad_(True)
            ref[2].requires_grad_(True)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            _loss(m, step).backward()
            o.step()
        if step < 2:
            assert torch.equal(model[2].weight, frozen)
    assert not torch.equal(model[2].weight, frozen)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_an_all_frozen_model_builds_and_steps_nothing() -> None:
    model = _model().requires_grad_(False)
    opt = _built(model).optimizer
    before = [p.clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_frozen_parameters_under_a_wrapper_are_left_out_with_a_warning_at_build() -> None:
    plain = _model()
    plain[2].requires_grad_(False)
    model = DataParallel(plain, shard_grads=True)
    config = OptimizerConfig(lr=1e-2, distributed=DistributedConfig(sharding="zero1"))
    with pytest.warns(UserWarning, match=r"requires_grad=False.*wrap the model again"):
        opt = build_optimizer(config, model).optimizer
    assert plain[2].weight not in {p for g in opt.param_groups for p in g["params"]}


@pytest.mark.parametrize("named_from", [False, True])
@pytest.mark.parametrize("named_to", [False, True])
def test_load_state_dict_matches_by_position_named_or_not(named_from: bool, named_to: bool) -> None:
    def built(model: nn.Module, named: bool):
        return _built(model if named else model.parameters()).optimizer

    model = _model()
    opt = built(model, named_from)
    for step in range(2):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    twin = _model()
    twin.load_state_dict(model.state_dict())
    other = built(twin, named_to)
    other.load_state_dict(saved)
    names = [n for g in other.state_dict()["param_groups"] for n in g["param_names"]]
    real = [n for n, _ in model.named_parameters()]
    assert names == (real if named_from or named_to else [f"param.{i}" for i in range(len(real))])
    for m, o in ((model, opt), (twin, other)):
        o.zero_grad()
        _loss(m, 5).backward()
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))


def test_load_state_dict_names_a_real_mismatch() -> None:
    model = _model()
    opt = _built(model).optimizer
    _loss(model, 0).backward()
    opt.step()
    saved = opt.state_dict()
    renamed = copy.deepcopy(saved)
    renamed["param_groups"][0]["param_names"][0] = "encoder.weight"
    with pytest.raises(ValueError, match="encoder.weight"):
        _built(_model()).optimizer.load_state_dict(renamed)
    other = nn.Sequential(nn.Linear(6, 12), nn.LayerNorm(12), nn.Linear(12, 4))  # one more output
    other_opt = _built(other.parameters()).optimizer
    with pytest.raises(ValueError, match=r"shape \(3, 12\).*\(4, 12\)"):
        other_opt.load_state_dict(saved)
    with pytest.raises(ValueError, match="holds 6 parameters in the state dict, 4 here"):
        _built(nn.Sequential(nn.Linear(6, 12), nn.Linear(12, 3))).optimizer.load_state_dict(saved)


def test_global_step_hooks_run_once_per_step_with_the_users_optimizer() -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    model = _model()
    opt = build_optimizer(OptimizerConfig(algorithm="muon"), model).optimizer  # two stages: Muon and its AdamW
    assert len(opt.stages) == 2
    seen: list[tuple[str, object]] = []
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: seen.append(("pre", o))),
               register_optimizer_step_post_hook(lambda o, a, k: seen.append(("post", o)))]
    try:
        _loss(model, 0).backward()
        opt.step()
    finally:
        for handle in handles:
            handle.remove()
    assert seen == [("pre", opt), ("post", opt)]


def test_a_parameter_listed_twice_has_one_id_and_duplicates_warn() -> None:
    model = _model()
    opt = _built(model).optimizer
    _loss(model, 0).backward()
    opt.step()
    one = opt.state_dict()["param_groups"][-1]
    opt.param_groups.extend(opt.param_groups)  # torch's own check of this (test_state_dict_deterministic)
    assert opt.state_dict()["param_groups"][-1]["params"] == one["params"]
    weight = nn.Parameter(torch.ones(3))
    with pytest.warns(UserWarning, match="duplicate parameters"):
        again = _built([weight, weight]).optimizer
    assert [len(g["params"]) for g in again.param_groups] == [1]


def test_sparse_gradients_are_refused_naming_the_parameter() -> None:
    model = nn.Embedding(10, 4, sparse=True)
    opt = build_optimizer(OptimizerConfig(lr=0.1, algorithm="adamw"), model, rules=[]).optimizer
    model(torch.tensor([1, 2])).sum().backward()
    before = model.weight.detach().clone()
    with pytest.raises(RuntimeError, match="'weight' has a torch.sparse_coo gradient.*sparse=False"):
        opt.step()
    assert torch.equal(model.weight, before)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sgd_steps_sparse_gradients_as_their_dense_equals(momentum: float, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    sparse, dense = nn.Embedding(10, 4, sparse=True).to(dtype), nn.Embedding(10, 4).to(dtype)
    dense.load_state_dict(sparse.state_dict())
    config = OptimizerConfig(lr=0.1, algorithm="sgd", weight_decay=0.01, clip_grad=0.5,
                             sgd=SGDConfig(momentum=momentum), precision="bf16" if dtype == torch.bfloat16 else "fp32")
    opts = [build_optimizer(config, m, rules=[]).optimizer for m in (sparse, dense)]
    for step in range(4):
        ids = torch.tensor([1, 2, 2, step + 3])  # a repeated row: an uncoalesced gradient
        for model, opt in zip((sparse, dense), opts, strict=True):
            opt.zero_grad()
            model(ids).square().sum().backward()
        assert sparse.weight.grad.is_sparse
        opts[0].step()
        opts[1].step()
        torch.testing.assert_close(sparse.weight, dense.weight, rtol=0, atol=0)
    # the reference: torch's SGD on the sparse gradients (no clipping there: compare one unclipped step)
    model = nn.Embedding(10, 4, sparse=True)
    theirs = nn.Embedding(10, 4, sparse=True)
    theirs.load_state_dict(model.state_dict())
    ours = optstack_optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    ref = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=momentum)
    for step in range(3):
        for m, opt in ((model, ours), (theirs, ref)):
            opt.zero_grad()
            m(torch.tensor([0, step, step])).sum().backward()
            opt.step()
    torch.testing.assert_close(model.weight, theirs.weight)


def test_a_single_tensor_as_params_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"single torch.FloatTensor.*pass \[tensor\]"):
        build_optimizer(OptimizerConfig(), torch.zeros(3, requires_grad=True))
