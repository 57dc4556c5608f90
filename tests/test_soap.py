"""SOAP: the batched step against the single-tensor reference over 20 steps, the reference against a written-out
formula (eigh at every refresh vs one power iteration: the same on a slowly moving factor), one-sided
preconditioning above max_precond_dim, the paged checkpoint form of the square state, config, registry, routing
and bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from optstack import OptimizerConfig, build_optimizer
from optstack.algorithms.registry import get_algorithm
from optstack.algorithms.soap import SOAP, _refresh, soap_reference
from optstack.config import SOAPConfig
from optstack.stage.state import exported_state

HYPER = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, shampoo_beta=0.9, precondition_frequency=3,
             correct_bias=True, power_iter_steps=1)
# Factors of full rank from the first step (square matrices; a rectangle's long side above max_precond_dim):
# a rank-deficient factor's null space has no preferred basis, where SOAP follows round-off (module docstring).
SHAPES = [(16, 16), (16, 16), (24, 24), (12, 20), (20, 12)]
MAX_DIM = 16  # (12, 20) and (20, 12): only the 12-side preconditioned; (24, 24): neither (Adam)


def _params(shapes: list[tuple[int, ...]], seed: int) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


def _grads(params: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) for p in params]


def _batched_and_reference(seed: int, steps: int, grad_seed: int, **options: bool
                           ) -> tuple[SOAP, list[nn.Parameter], list[torch.Tensor], list[dict]]:
    """``steps`` steps of the batched SOAP and of ``soap_reference`` on the same gradients: the optimizer, its
    parameters, the reference's parameters and states."""
    params = _params(SHAPES, seed)
    refs = [p.detach().clone() for p in params]
    states: list[dict] = [{} for _ in refs]
    opt = SOAP(params, max_precond_dim=MAX_DIM, **HYPER, **options)
    for t in range(steps):
        grads = _grads(params, grad_seed + t)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
        for p, g, s in zip(refs, grads, states, strict=True):
            soap_reference(p, g, s, max_precond_dim=MAX_DIM, **HYPER, **options)
    return opt, params, refs, states


def test_batched_step_equals_reference_over_20_steps() -> None:
    opt, params, refs, states = _batched_and_reference(0, 20, 100)
    start = _params(SHAPES, 0)
    for p, r, s0 in zip(params, refs, start, strict=True):
        assert (r - s0.detach()).abs().max() > 1e-2  # the steps moved it
        torch.testing.assert_close(p.detach(), r, rtol=1e-6, atol=1e-6)
    for p, s in zip(params, states, strict=True):
        live = opt.state[p]
        assert sorted(live) == sorted(s) and live["step"] == 20
        for key in ("exp_avg_sq", "GG_left", "GG_right"):
            if key in s:
                torch.testing.assert_close(live[key], s[key], rtol=1e-5, atol=1e-7)
    assert {k for k in opt.state[params[3]]} == {"step", "exp_avg", "exp_avg_sq", "GG_left", "Q_left"}
    assert {k for k in opt.state[params[2]]} == {"step", "exp_avg", "exp_avg_sq"}


def _written_out(p0: torch.Tensor, grads: list[torch.Tensor], lr: float, b1: float, b2: float, sb: float,
                 wd: float, eps: float) -> torch.Tensor:
    """SOAP typed out in float64, its eigenbases from the first step's factors (no refresh after it)."""
    p = p0.double().clone()
    m_, n_ = p.shape
    L, R = torch.zeros(m_, m_, dtype=torch.float64), torch.zeros(n_, n_, dtype=torch.float64)
    M, V = torch.zeros_like(p), torch.zeros_like(p)
    QL = QR = None
    for k, g in enumerate(grads):
        g, t = g.double(), k
        b = 1 - (1 - sb) / (1 - sb ** (k + 1))
        L, R = b * L + (1 - b) * g @ g.T, b * R + (1 - b) * g.T @ g
        if k == 0:  # the first step only computes the eigenbases
            QL, QR = torch.linalg.eigh(L).eigenvectors, torch.linalg.eigh(R).eigenvectors
            continue
        gp = QL.T @ g @ QR
        M = b1 * M + (1 - b1) * gp
        V = b2 * V + (1 - b2) * gp**2
        u = (M / (1 - b1**t)) / ((V / (1 - b2**t)).sqrt() + eps)
        p = p * (1 - lr * wd) - lr * QL @ u @ QR.T
    return p


def test_reference_equals_written_out_formula() -> None:
    (p,) = _params([(6, 6)], 3)
    p0 = p.detach().clone()
    grads = _grads([p] * 6, 7)
    state: dict = {}
    for g in grads:
        soap_reference(p.data, g, state, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, shampoo_beta=0.9,
                       precondition_frequency=100, max_precond_dim=64, correct_bias=True, power_iter_steps=1)
    want = _written_out(p0, grads, lr=0.01, b1=0.9, b2=0.95, sb=0.9, wd=0.1, eps=1e-8)
    torch.testing.assert_close(p.detach().double(), want, rtol=1e-5, atol=1e-5)
    assert (want - p0.double()).abs().max() > 1e-2


def test_refresh_converges_to_the_eigenbasis_and_keeps_the_moments_with_their_vectors() -> None:
    g = torch.randn(8, 8, generator=torch.Generator().manual_seed(8))
    factor = g @ g.T
    exact = torch.linalg.eigh(factor.double()).eigenvectors.flip(-1)  # largest first
    start = torch.linalg.qr(torch.randn(8, 8, generator=torch.Generator().manual_seed(9))).Q
    v = torch.arange(64.0).view(8, 8)
    q, v_sorted = _refresh(factor, start, v, -2, power_iter_steps=200)
    # the same vectors up to sign
    torch.testing.assert_close((q.double().T @ exact).abs(), torch.eye(8, dtype=torch.float64), atol=1e-4, rtol=0)
    # V's rows were permuted as the starting basis's columns were sorted
    estimated = torch.diagonal(start.T @ factor @ start)
    order = torch.argsort(estimated, descending=True)
    assert torch.equal(v_sorted, v[order])


def test_first_step_fills_the_factors_and_the_second_is_adam_in_their_eigenbasis() -> None:
    (p,) = _params([(8, 8)], 5)
    p0 = p.detach().clone()
    g0, g1 = _grads([p, p], 6)
    opt = SOAP([p], lr=0.1, weight_decay=0.5)
    p.grad = g0
    opt.step()
    assert torch.equal(p.detach(), p0)  # no update (nor decay): the basis diagonalises g0 but for round-off
    torch.testing.assert_close(opt.state[p]["GG_left"], g0 @ g0.T)
    p.grad = g1
    opt.step()
    # Adam's first bias-corrected update is sign(QL^T G QR) (eps aside), in g0's eigenbasis
    ql = torch.linalg.eigh(g0.double() @ g0.double().T).eigenvectors
    qr = torch.linalg.eigh(g0.double().T @ g0.double()).eigenvectors
    want = p0.double() * (1 - 0.05) - 0.1 * ql @ torch.sign(ql.T @ g1.double() @ qr) @ qr.T
    torch.testing.assert_close(p.detach().double(), want, rtol=1e-5, atol=1e-5)


def test_state_dict_and_paged_export_continue_identically() -> None:
    params = _params([(6, 6), (4, 10)], 6)  # (4, 10): GG_right (100 elements) is three pages of 40
    opt = SOAP(params, precondition_frequency=2, lr=0.01)
    for t in range(3):
        for p, g in zip(params, _grads(params, 10 + t), strict=True):
            p.grad = g
        opt.step()
    exported = [exported_state(opt, p) for p in params]
    for p, e in zip(params, exported, strict=True):  # every tensor parameter-shaped: what checkpoints shard
        assert all(v.shape == p.shape for v in e.values() if isinstance(v, torch.Tensor))
    assert sorted(k for k in exported[1] if k.startswith("GG_right")) == ["GG_right.0", "GG_right.1", "GG_right.2"]
    saved = copy.deepcopy(opt.state_dict())
    fresh = [nn.Parameter(p.detach().clone()) for p in params]
    again = [nn.Parameter(p.detach().clone()) for p in params]
    opt_sd = SOAP(fresh, precondition_frequency=2, lr=0.01)
    opt_sd.load_state_dict(saved)
    opt_ex = SOAP(again, precondition_frequency=2, lr=0.01)
    for p, e in zip(again, exported, strict=True):
        opt_ex.state[p] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in e.items()}
    assert exported_state(opt_ex, again[1]).keys() == exported[1].keys()  # still paged: exported as it is
    for t in range(4):  # through a refresh (steps 4 and 6 of precondition_frequency 2)
        for group in (params, fresh, again):
            for p, g in zip(group, _grads(group, 50 + t), strict=True):
                p.grad = g
        for o in (opt, opt_sd, opt_ex):
            o.step()
    for a, b, c in zip(params, fresh, again, strict=True):
        assert torch.equal(a.detach(), b.detach())
        assert torch.equal(a.detach(), c.detach())
    assert opt_ex.state[again[1]]["GG_right"].shape == (10, 10)



def test_a_state_dict_saved_before_the_options_existed_loads_with_the_defaults() -> None:
    params = _params([(6, 6)], 7)
    opt = SOAP(params, precondition_frequency=2, lr=0.01)
    for t in range(2):
        params[0].grad = _grads(params, t)[0]
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    for group in saved["param_groups"]:
        for key in ("use_kl_shampoo", "update_first_step", "use_eigh"):
            del group[key]
    fresh = [nn.Parameter(params[0].detach().clone())]
    loaded = SOAP(fresh, precondition_frequency=2, lr=0.01)
    loaded.load_state_dict(saved)
    assert {k: loaded.param_groups[0][k] for k in ("use_kl_shampoo", "update_first_step", "use_eigh")} == {
        "use_kl_shampoo": False, "update_first_step": False, "use_eigh": False}
    for t in range(3):
        for group in (params, fresh):
            group[0].grad = _grads(group, 20 + t)[0]
        opt.step()
        loaded.step()
    assert torch.equal(params[0].detach(), fresh[0].detach())

def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))


def test_build_routes_vectors_to_adamw_and_registry_declares_whole_matrices() -> None:
    caps = get_algorithm("soap").capabilities
    assert caps.whole_matrices and not caps.elementwise and caps.matrix_ndims == (2,)
    assert caps.matrix_state == ("GG_left", "GG_right", "Q_left", "Q_right")
    config = OptimizerConfig(algorithm="soap", lr=0.01, soap=SOAPConfig(precondition_frequency=2, shampoo_beta=0.8))
    model = _mlp()
    built = build_optimizer(config, model)
    stages = {type(s.optimizer).__name__: s for s in built.optimizer.stages}
    assert set(stages) == {"SOAP", "AdamW"}
    soap = stages["SOAP"].optimizer
    assert soap.param_groups[0]["shampoo_beta"] == 0.8 and soap.param_groups[0]["precondition_frequency"] == 2
    assert sum(p.ndim == 2 for g in soap.param_groups for p in g["params"]) == 2
    x = torch.randn(4, 8)
    for _ in range(3):
        model(x).pow(2).mean().backward()
        built.optimizer.step()
        built.optimizer.zero_grad()
    assert soap.state[soap.param_groups[0]["params"][0]]["step"] == 3


def test_vector_without_a_routing_rule_is_refused_naming_parameter_algorithm_and_rule() -> None:
    with pytest.raises(ValueError, match=r"'soap'.*'0\.bias'.*shape \(8,\).*Rule\(Ndim\(lt=2\), algorithm=\"adamw\"\)"):
        build_optimizer(OptimizerConfig(algorithm="soap"), _mlp(), rules=[])
    with pytest.raises(ValueError, match=r"SOAP needs 2-D parameters; param 'v'.*shape \(3,\).*Rule\(Ndim\(lt=2\)"):
        SOAP([{"params": [nn.Parameter(torch.zeros(3))], "param_names": ["v"]}])
    with pytest.raises(ValueError, match=r"'soap' needs whole matrices of 2 dims.*'experts'.*\(2, 3, 4\)"):
        build_optimizer(OptimizerConfig(algorithm="soap"), [("experts", nn.Parameter(torch.zeros(2, 3, 4)))])


@pytest.mark.parametrize("field, value, message", [
    ("shampoo_beta", 1.0, "soap.shampoo_beta"), ("precondition_frequency", 0, "soap.precondition_frequency"),
    ("max_precond_dim", 0, "soap.max_precond_dim"), ("beta2", -0.1, "soap.beta2")])
def test_bad_config_names_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SOAPConfig(**{field: value})


@pytest.mark.parametrize("kwargs, message", [
    ({"shampoo_beta": 1.5}, "shampoo_beta must be in"), ({"precondition_frequency": 0}, "precondition_frequency"),
    ({"betas": (0.9, 1.0)}, r"betas\[1\]"), ({"correct_bias": 1}, "correct_bias")])
def test_bad_group_setting_names_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SOAP([nn.Parameter(torch.zeros(2, 2))], **kwargs)


EMERGING = dict(use_kl_shampoo=True, update_first_step=True, use_eigh=True)


@pytest.mark.parametrize("options", [EMERGING, dict(use_kl_shampoo=True), dict(update_first_step=True)],
                         ids=["all", "kl", "first_step"])
def test_batched_step_equals_reference_with_emerging_optimizers_options(options: dict) -> None:
    opt, params, refs, states = _batched_and_reference(1, 10, 200, **options)
    for p, r, s0 in zip(params, refs, _params(SHAPES, 1), strict=True):
        assert (r - s0.detach()).abs().max() > 1e-2
        torch.testing.assert_close(p.detach(), r, rtol=1e-6, atol=1e-6)
    for p, s in zip(params, states, strict=True):
        for key in ("exp_avg_sq", "GG_left", "GG_right"):
            if key in s:
                torch.testing.assert_close(opt.state[p][key], s[key], rtol=1e-5, atol=1e-7)


def test_emerging_optimizers_options_equal_their_written_out_formula() -> None:
    """KL-Shampoo's factors, an update from the first step, eigh at every refresh, typed out in float64 as
    Emerging-Optimizers' SOAP (momentum in the parameter's basis: the core's rotated momentum is the same)."""
    (p,) = _params([(6, 5)], 4)
    p0 = p.detach().clone()
    grads = _grads([p] * 6, 9)
    lr, b1, b2, sb, wd, eps, freq = 0.01, 0.9, 0.95, 0.9, 0.1, 1e-3, 2
    state: dict = {}
    for g in grads:
        soap_reference(p.data, g, state, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, shampoo_beta=sb,
                       precondition_frequency=freq, max_precond_dim=64, correct_bias=True, **EMERGING)
    w = p0.double().clone()
    L, R = torch.zeros(6, 6, dtype=torch.float64), torch.zeros(5, 5, dtype=torch.float64)
    M, V = torch.zeros_like(w), torch.zeros_like(w)
    QL, QR = torch.eye(6, dtype=torch.float64), torch.eye(5, dtype=torch.float64)
    for k, g in enumerate(grads):
        g, t = g.double(), k + 1
        b = 1 - (1 - sb) / (1 - sb**t)

        def inverse(F: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
            return Q @ torch.diag(1 / (Q.T @ F @ Q).diagonal().clamp_min(eps)) @ Q.T

        if k > 0:  # KL-Shampoo from the second step, both from the factors before this step's update
            L, R = b * L + (1 - b) * g @ inverse(R, QR) @ g.T / 5, b * R + (1 - b) * g.T @ inverse(L, QL) @ g / 6
        else:
            L, R = b * L + (1 - b) * g @ g.T, b * R + (1 - b) * g.T @ g
        if k % freq == 0:
            QL, QR = torch.linalg.eigh(L).eigenvectors, torch.linalg.eigh(R).eigenvectors
        M = b1 * M + (1 - b1) * g
        V = b2 * V + (1 - b2) * (QL.T @ g @ QR) ** 2
        u = QL @ ((QL.T @ M @ QR) / (1 - b1**t) / ((V / (1 - b2**t)).sqrt() + eps)) @ QR.T
        w = w * (1 - lr * wd) - lr * u
    torch.testing.assert_close(p.detach().double(), w, rtol=1e-4, atol=1e-5)
    assert (w - p0.double()).abs().max() > 1e-2


def test_update_first_step_updates_and_defaults_do_not() -> None:
    (p,) = _params([(8, 8)], 5)
    p0 = p.detach().clone()
    p.grad = _grads([p], 6)[0]
    SOAP([p], lr=0.1, update_first_step=True).step()
    assert not torch.equal(p.detach(), p0)
    with pytest.raises(ValueError, match="use_kl_shampoo needs eps > 0"):
        SOAP([p], eps=0.0, use_kl_shampoo=True)
    with pytest.raises(ValueError, match="soap.eps must be > 0 with soap.use_kl_shampoo"):
        SOAPConfig(eps=0.0, use_kl_shampoo=True)
