"""The Megatron face's separate gradient-norm groups (MTP), core_v0.16.1's TensorParallelMuon names, and
Megatron's own ProcessGroupCollection class accepted where the face's is."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from optstack.megatron import (
    ChainedOptimizer,
    FP32Optimizer,
    OptimizerConfig,
    ProcessGroupCollection,
    TensorParallelMuon,
    get_megatron_optimizer,
)
from optstack.megatron.norm_groups import GradNormGroups
from optstack.megatron.process_groups import check_optimizer_groups


def _param(fill: float, group: str | None = None) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(3, 4))
    p.grad = torch.full_like(p, fill)
    if group is not None:
        p.grad_norm_group = group
    return p


class _Member(GradNormGroups):
    """The least a Megatron-protocol optimizer implements; the grad-norm methods are the face's."""

    def __init__(self, params: list[torch.Tensor], config: OptimizerConfig) -> None:
        self.params, self.config, self.stepped = params, config, False

    def get_parameters(self) -> list[torch.Tensor]:
        return self.params

    def prepare_grads(self) -> bool:
        return False

    def step_with_ready_grads(self) -> bool:
        self.stepped = True
        return True


def test_mtp_gradients_leave_the_main_norm_and_are_clipped_by_their_own() -> None:
    main, mtp = _param(0.1), _param(5.0, "mtp")
    member = _Member([main, mtp], OptimizerConfig(lr=1e-3, clip_grad=1.0))
    assert member.has_grad_norm_group("mtp")
    assert [g is main.grad for g in member.get_grads_for_grad_norm()] == [True]
    assert [g is mtp.grad for g in member.get_grads_for_grad_norm("mtp")] == [True]
    main_norm = member.clip_grad_norm(1.0)
    assert main_norm == pytest.approx(0.1 * math.sqrt(12), rel=1e-5)  # below 1: main grads untouched
    torch.testing.assert_close(main.grad, torch.full_like(main, 0.1))
    assert member.grad_norms_by_group["mtp"] == pytest.approx(5.0 * math.sqrt(12), rel=1e-5)
    assert mtp.grad.norm().item() == pytest.approx(1.0, rel=1e-4)  # clipped to clip_grad by its own norm


def test_chained_step_skips_on_the_main_norm_only() -> None:
    config = OptimizerConfig(lr=1e-3, clip_grad=1.0, grad_norm_skip_threshold=2.0)
    first, second = _Member([_param(0.1)], config), _Member([_param(50.0, "mtp")], config)
    chained = ChainedOptimizer([first, second])
    applied, norm, zeros = chained.step()
    assert applied and first.stepped and second.stepped and zeros is None
    assert norm == pytest.approx(0.1 * math.sqrt(12), rel=1e-5)
    assert chained.grad_norms_by_group["mtp"] == pytest.approx(50.0 * math.sqrt(12), rel=1e-5)
    big = _Member([_param(1.0)], config)  # main norm sqrt(12) > 2: skipped, nothing stepped
    assert ChainedOptimizer([big, _Member([_param(0.0, "mtp")], config)]).step()[0] is False
    assert not big.stepped


def test_unknown_group_is_refused() -> None:
    with pytest.raises(ValueError, match="Unknown grad_norm_group 'vision'"):
        _Member([_param(1.0, "vision")], OptimizerConfig(lr=1e-3)).get_grads_for_grad_norm()
    with pytest.raises(ValueError, match="Unknown grad_norm_group 'vision'"):
        FP32Optimizer(torch.optim.SGD([_param(1.0, "vision")], lr=0.1), OptimizerConfig(lr=0.1))


def _mtp_model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)).to(dtype)
    model[1].weight.grad_norm_group = "mtp"  # Megatron's MTP layers tag their parameters
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimizers_over_core_stages_clip_mtp_by_its_own_norm(dtype: torch.dtype) -> None:
    """get_megatron_optimizer and the classes over a torch optimizer: the MTP gradients leave the main norm
    (returned, read by the skip threshold) and are clipped by their own (SGD lr=1: the update is the clipped
    gradient)."""
    x = torch.linspace(-1, 1, 20).reshape(5, 4)
    for build in ("factory", "class"):
        model = _mtp_model(dtype)
        config = OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.5,
                                 bf16=dtype == torch.bfloat16, grad_norm_skip_threshold=1e6)
        if build == "factory":
            opt = get_megatron_optimizer(config, [model])
        else:
            opt = ChainedOptimizer([FP32Optimizer(torch.optim.SGD(model.parameters(), lr=1.0), config)])
        start = [p.detach().float().clone() for p in model.parameters()]
        model(x.to(dtype)).float().square().sum().backward()
        grads = [p.grad.float().clone() for p in model.parameters()]
        tagged = [getattr(p, "grad_norm_group", None) == "mtp" for p in model.parameters()]
        main = math.sqrt(sum(g.square().sum().item() for g, t in zip(grads, tagged, strict=True) if not t))
        mtp = math.sqrt(sum(g.square().sum().item() for g, t in zip(grads, tagged, strict=True) if t))
        assert mtp > 0.5 and main > 0.5 and abs(mtp - main) > 0.1  # both clipped, by different factors
        applied, norm, _ = opt.step()
        assert applied and norm == pytest.approx(main, rel=1e-3)
        assert opt.grad_norms_by_group["mtp"] == pytest.approx(mtp, rel=1e-3)
        for p, g, s0, t in zip(model.parameters(), grads, start, tagged, strict=True):
            want = s0 - 0.5 / ((mtp if t else main) + 1e-6) * g
            torch.testing.assert_close(p.float(), want.to(dtype).float(), rtol=1e-2 if dtype != torch.float32 else 1e-5,
                                       atol=1e-3 if dtype != torch.float32 else 1e-6)


def test_tensor_parallel_muon_takes_the_release_names() -> None:
    torch.manual_seed(0)
    start = torch.randn(8, 6)
    weights = [torch.nn.Parameter(start.clone()) for _ in range(2)]
    for w in weights:
        w.grad = torch.ones_like(w)
    TensorParallelMuon([weights[0]], lr=0.1, momentum=0.9, nesterov=False, tp_mode="blockwise").step()
    TensorParallelMuon([weights[1]], lr=0.1, momentum_beta=0.9, use_nesterov=False, mode="blockwise").step()
    torch.testing.assert_close(weights[0], weights[1])
    with pytest.raises(ValueError, match="momentum=0.8 and momentum_beta=0.9 disagree"):
        TensorParallelMuon([weights[0]], momentum=0.8, momentum_beta=0.9)


@dataclasses.dataclass
class _MegatronCollection:
    """Shaped as Megatron's own ProcessGroupCollection (a dataclass, fields set as attributes)."""

    tp: object = dataclasses.field(init=False)
    dp: object = dataclasses.field(init=False)
    expt_dp: object = dataclasses.field(init=False)
    intra_dist_opt: object = dataclasses.field(init=False)


def test_megatrons_own_collection_counts_as_one() -> None:
    theirs = _MegatronCollection()
    assert isinstance(theirs, ProcessGroupCollection) and not isinstance(object(), ProcessGroupCollection)
    with pytest.raises(ValueError, match="dp process group is required"):
        check_optimizer_groups(theirs, use_gloo_process_groups=False)


def test_one_optimizer_from_megatron_param_groups() -> None:
    from optstack.megatron.optimizer import _get_megatron_optimizer_based_on_param_groups

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    groups = [{"params": list(model.parameters()), "is_expert_parallel": False, "wd_mult": 1.0}]
    config = OptimizerConfig(optimizer="lion", lr=1e-2, lion_beta1=0.9, lion_beta2=0.99, weight_decay=0.1)
    wrapped = _get_megatron_optimizer_based_on_param_groups(config, [model], groups)
    assert isinstance(wrapped, FP32Optimizer) and type(wrapped.optimizer).__name__ == "Lion"
    assert wrapped.optimizer.param_groups[0]["betas"] == (0.9, 0.99)
    before = model.weight.detach().clone()
    model(torch.randn(5, 4)).sum().backward()
    applied, _, _ = wrapped.step()
    # Lion moves every weight by lr * sign(update) plus decoupled decay
    assert applied and torch.allclose((model.weight - before * (1 - 1e-3)).abs(), torch.full_like(before, 1e-2))
    raw, init_state_fn = _get_megatron_optimizer_based_on_param_groups(
        config, [model], groups, skip_megatron_wrapping=True)
    assert isinstance(raw, torch.optim.Optimizer) and init_state_fn is None
    with pytest.raises(ValueError, match="optimizer='muon' is built by get_megatron_optimizer"):
        _get_megatron_optimizer_based_on_param_groups(OptimizerConfig(optimizer="muon", lr=1e-2), [model], groups)


def test_distributed_optimizer_state_keys_follow_the_algorithm() -> None:
    from optstack.megatron import DistributedOptimizer

    bare = object.__new__(DistributedOptimizer)  # the keys read only the config
    bare.config = OptimizerConfig(optimizer="muon", lr=1e-3, muon_scalar_optimizer="lion")
    assert bare.optimizer_state_keys == ("exp_avg",)
    bare.config = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, use_precision_aware_optimizer=True,
                                  use_distributed_optimizer=True, exp_avg_dtype=torch.bfloat16)
    assert bare.optimizer_state_keys == ("exp_avg", "exp_avg_sq")
    assert bare._get_state_key_dtype("exp_avg") == torch.bfloat16
    assert bare._get_state_key_dtype("step") == torch.float32


def test_the_grad_norm_methods_work_copied_one_by_one_onto_a_mock() -> None:
    # Megatron's own test (test_mtp_grad_clipping_uses_separate_norms) copies exactly these methods from
    # MegatronOptimizer onto a plain class: none of them may lean on another method of the class
    from optstack.megatron import MegatronOptimizer

    class Mock:
        _filter_grads_for_norm = MegatronOptimizer._filter_grads_for_norm
        get_grads_for_grad_norm = MegatronOptimizer.get_grads_for_grad_norm
        get_grad_stats_parallel_group = MegatronOptimizer.get_grad_stats_parallel_group
        has_grad_norm_group = MegatronOptimizer.has_grad_norm_group
        _compute_grad_norms_by_group = MegatronOptimizer._compute_grad_norms_by_group
        clip_grad_norm = MegatronOptimizer.clip_grad_norm

        def __init__(self, params: list[torch.Tensor]) -> None:
            self.params, self.config = params, OptimizerConfig(lr=0.01)

        def get_parameters(self) -> list[torch.Tensor]:
            return self.params

    main, mtp = _param(10.0), _param(1e-3, "mtp")
    mtp_before = mtp.grad.clone()
    norm = Mock([main, mtp]).clip_grad_norm(1.0)
    assert norm == pytest.approx(10.0 * math.sqrt(12), rel=1e-5)  # the main norm only
    assert main.grad.norm().item() == pytest.approx(1.0, rel=1e-4)
    torch.testing.assert_close(mtp.grad, mtp_before)  # below the clip by its own norm: untouched
