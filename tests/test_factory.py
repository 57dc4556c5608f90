"""build_optimizer: the whole single-process stack from a config, against torch.optim references."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optstack.config import LossScaleConfig, OptimizerConfig
from optstack.distributed.ddp import DataParallel
from optstack.factory import build_optimizer, default_rules
from optstack.rules import Attr, Name, Ndim, Rule, resolve
from optstack.schedule import LRSchedule, WDSchedule


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 12), nn.LayerNorm(12), nn.Linear(12, 3))
    m[2].weight.is_embedding_or_output_parameter = True  # the model's own flag, read by rules
    return m.to(dtype)


def _batches(n: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 6, generator=g).to(dtype) for _ in range(n)]


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


def test_default_groups_follow_standard_rules():
    built = build_optimizer(OptimizerConfig(lr=1e-3, decoupled_lr=5e-4), _model())
    by_name = {n: g for g in built.param_groups for n in g["param_names"]}
    assert by_name["0.bias"]["wd_mult"] == 0.0 and by_name["1.weight"]["wd_mult"] == 0.0
    assert by_name["0.weight"]["wd_mult"] == 1.0 and by_name["0.weight"]["default_config"]
    assert by_name["2.weight"]["max_lr"] == 5e-4 and not by_name["2.weight"]["default_config"]
    # Without a scheduler the inner groups already carry lr = max_lr * lr_mult and wd = weight_decay * wd_mult.
    lrs = sorted({g["lr"] for g in built.optimizer.param_groups})
    assert lrs == [5e-4, 1e-3]
    assert built.group_of()["0.weight"] != built.group_of()["0.bias"]


def test_adamw_trajectory_equals_torch_with_the_same_groups():
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0)
    ours, ref = _model(), _model()
    built = build_optimizer(cfg, ours)
    ref_params = dict(ref.named_parameters())
    ref_groups = [
        {"params": [ref_params[n] for n in g["param_names"]], "weight_decay": 0.1 * g["wd_mult"]}
        for g in built.param_groups
    ]
    torch_opt = torch.optim.AdamW(ref_groups, lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
    for x in _batches(20):
        for model, opt in ((ours, built.optimizer), (ref, torch_opt)):
            opt.zero_grad()
            _loss(model, x).backward()
            opt.step()
    for (n, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=n)


def test_scheduler_drives_every_group():
    built = build_optimizer(
        OptimizerConfig(lr=1e-2, min_lr=1e-3, weight_decay=0.1),
        _model(),
        lr_schedule=LRSchedule(max_lr=1e-2, min_lr=1e-3, warmup_steps=2, decay_steps=6, style="linear"),
        wd_schedule=WDSchedule(start_wd=0.1, end_wd=0.2, incr_steps=6, style="linear"),
    )
    assert built.scheduler is not None
    for _ in range(6):
        built.scheduler.step()
    for g in built.optimizer.param_groups:
        assert g["lr"] == pytest.approx(1e-3)
        assert g["weight_decay"] == pytest.approx(0.2 * g["wd_mult"])


def test_muon_routes_non_matrices_to_adamw_and_explains_it():
    built = build_optimizer(OptimizerConfig(algorithm="muon", lr=0.02), _model())
    algos = {n: g.get("algorithm", "muon") for g in built.param_groups for n in g["param_names"]}
    assert algos["0.weight"] == "muon"
    assert algos["0.bias"] == "adamw" and algos["1.weight"] == "adamw"
    assert algos["2.weight"] == "adamw"  # output layer: Muon is for hidden matrices
    assert {type(s.param_groups and s).__name__ for s in built.optimizer.stages}  # two stages exist
    assert len(built.optimizer.stages) == 2


def test_expert_params_get_their_own_stage():
    m = _model()
    m[0].weight.allreduce = False  # an expert parameter, Megatron's flag
    built = build_optimizer(OptimizerConfig(), m)
    experts = [g for g in built.param_groups if g["is_expert_parallel"]]
    assert [g["param_names"] for g in experts] == [["0.weight"]]
    assert len(built.optimizer.stages) == 2


def test_bf16_masters_track_fp32():
    cfg32, cfg16 = OptimizerConfig(lr=1e-2), OptimizerConfig(lr=1e-2, precision="bf16")
    m32, m16 = _model(), _model(torch.bfloat16)
    o32, o16 = build_optimizer(cfg32, m32).optimizer, build_optimizer(cfg16, m16).optimizer
    for x in _batches(10):
        for model, opt, dt in ((m32, o32, torch.float32), (m16, o16, torch.bfloat16)):
            opt.zero_grad()
            _loss(model, x.to(dt)).backward()
            opt.step()
            assert opt.last_result.applied
    for p, q in zip(m32.parameters(), m16.parameters(), strict=True):
        assert q.dtype == torch.bfloat16
        torch.testing.assert_close(q.float(), p, rtol=0.05, atol=0.02)


def test_fp16_default_dynamic_scaler_skips_overflow_then_recovers():
    m = _model(torch.float16)
    cfg = OptimizerConfig(precision="fp16", loss_scale=LossScaleConfig(initial=2.0**8, hysteresis=1))
    opt = build_optimizer(cfg, m).optimizer
    before = [p.clone() for p in m.parameters()]
    opt.zero_grad()
    opt.scale_loss(_loss(m, _batches(1, torch.float16)[0]) * 1e10).backward()  # overflows fp16 grads
    opt.step()
    r = opt.last_result
    assert not r.applied and r.loss_scale == 2.0**7
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))
    opt.zero_grad()
    opt.scale_loss(_loss(m, _batches(1, torch.float16)[0])).backward()
    opt.step()
    assert opt.last_result.applied


def test_explicit_empty_rules_means_one_group_and_user_rules_extend_defaults():
    m = _model()
    assert len(build_optimizer(OptimizerConfig(), m, rules=[]).param_groups) == 1
    extra = Rule(Name("0.*"), lr_mult=0.5, why="slow first layer")
    built = build_optimizer(OptimizerConfig(), m, rules=default_rules(OptimizerConfig()) + [extra])
    lr_mults = {n: g["lr_mult"] for g in built.param_groups for n in g["param_names"]}
    assert lr_mults["0.weight"] == 0.5 and lr_mults["2.weight"] == 1.0


def test_settings_resolved_elsewhere_are_taken_as_they_are():
    m = _model()
    resolved = resolve(m, [Rule(Name("0.*"), lr_mult=0.5, why="slow first layer")])
    built = build_optimizer(OptimizerConfig(), m, resolved=resolved)
    assert built.group_of() == {"0.weight": 1, "0.bias": 1, "1.weight": 0, "1.bias": 0, "2.weight": 0, "2.bias": 0}
    assert built.param_groups[1]["lr_mult"] == 0.5
    with pytest.raises(ValueError, match="rules or resolved"):
        build_optimizer(OptimizerConfig(), m, rules=[], resolved=resolved)
    with pytest.raises(ValueError, match="missing from `resolved`"):
        build_optimizer(OptimizerConfig(), m, resolved={k: v for k, v in resolved.items() if k != "2.bias"})


def test_precision_must_match_the_model_naming_a_parameter():
    with pytest.raises(ValueError, match=r"'bf16' but every parameter is torch.float32 \(e.g. '0.weight'\)"):
        build_optimizer(OptimizerConfig(precision="bf16"), _model())
    with pytest.raises(ValueError, match=r"parameter '0.weight' is torch.bfloat16 but config.precision is 'fp16'"):
        build_optimizer(OptimizerConfig(precision="fp16"), _model(torch.bfloat16))
    mixed = _model(torch.bfloat16)
    mixed[1].float()  # fp32 norms beside bf16 matrices: stepped directly, as in Megatron
    build_optimizer(OptimizerConfig(precision="bf16"), mixed)


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="known"):
        build_optimizer(OptimizerConfig(algorithm="adamz"), _model())
    with pytest.raises(ValueError, match="precision"):
        build_optimizer(OptimizerConfig(), _model(torch.bfloat16))
    frozen = _model().requires_grad_(False)  # kept as torch keeps them without a wrapper (test_torch_contract.py)
    with pytest.raises(ValueError, match="no trainable"), pytest.warns(UserWarning, match="requires_grad=False"):
        build_optimizer(OptimizerConfig(), DataParallel(frozen))
    with pytest.raises(ValueError, match="wd_schedule"):
        build_optimizer(OptimizerConfig(), _model(), wd_schedule=WDSchedule.constant(0.1))
    with pytest.raises(ValueError, match="match no trainable parameter"):
        build_optimizer(OptimizerConfig(), _model(), rules=[Rule(Name("nope.*"), wd_mult=0.0)], strict_rules=True)


def test_state_dict_round_trip_continues_identically():
    cfg = OptimizerConfig(lr=1e-2)
    a, b = _model(), _model()
    oa = build_optimizer(cfg, a).optimizer
    xs = _batches(8)
    for x in xs[:4]:
        oa.zero_grad()
        _loss(a, x).backward()
        oa.step()
    b.load_state_dict(a.state_dict())
    ob = build_optimizer(cfg, b).optimizer
    ob.load_state_dict(oa.state_dict())
    for x in xs[4:]:
        for model, opt in ((a, oa), (b, ob)):
            opt.zero_grad()
            _loss(model, x).backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("matcher", [Name("0.*"), Ndim(eq=2) & ~Name("*.bias"), Attr("x") | (Ndim(eq=1) & Name("a"))])
def test_name_rules_with_bare_parameters_are_refused(matcher):
    rule = Rule(matcher, lr_mult=0.5, why="by name")
    with pytest.raises(ValueError, match=r"\['by name'\] match parameters by Name.*param\.0, param\.1.*"
                                         r"pass the model or model\.named_parameters\(\) instead"):
        build_optimizer(OptimizerConfig(), _model().parameters(), rules=[Rule(Ndim(eq=1), wd_mult=0.0), rule])
    # with names, the same rules work
    build_optimizer(OptimizerConfig(), _model().named_parameters(), rules=[rule])
    build_optimizer(OptimizerConfig(), _model(), rules=[rule])


def test_bare_parameters_keep_the_default_rules_and_name_free_rules():
    cfg = OptimizerConfig(lr=1e-3)
    built = build_optimizer(cfg, _model().parameters())  # rules=None: the defaults (Name parts have Ndim twins)
    assert {g["wd_mult"] for g in built.param_groups} == {0.0, 1.0}
    slower = Rule(Ndim(eq=2), lr_mult=0.5)
    built = build_optimizer(cfg, _model().parameters(), rules=[*default_rules(cfg), slower])
    assert sorted({g["lr_mult"] for g in built.param_groups}) == [0.5, 1.0]


def test_zero1_muon_wrapper_lays_the_matrices_muon_steps_whole_in_their_shards():
    from optstack.config import DistributedConfig
    from optstack.factory import wrap_data_parallel

    config = OptimizerConfig(algorithm="muon", lr=0.02, distributed=DistributedConfig(sharding="zero1"))

    def whole_buffers(rules: list[Rule] | None) -> list[tuple[str, ...]]:
        torch.manual_seed(0)
        ddp = wrap_data_parallel(config, nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)), rules=rules)
        return [b.names for b in ddp.param_and_grad_buffers if b.key.whole]

    assert whole_buffers(None) == [("2.weight", "0.weight")]  # backward order; the biases go to AdamW
    # rules that route a matrix to the scalar optimizer: only Muon's matrices are laid out whole
    rules = default_rules(config) + [Rule(Name("2.weight"), algorithm="adamw")]
    assert whole_buffers(rules) == [("0.weight",)]
    ddp = wrap_data_parallel(config, nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)), rules=rules)
    stages = build_optimizer(config, ddp, rules=rules).optimizer.stages
    assert [(s.placement.kind, s.placement.owns_whole, sorted(s.param_shards())) for s in stages] == [
        ("zero1", True, ["0.weight"]), ("zero1", False, ["0.bias", "2.bias", "2.weight"])]
