"""Adaptive Muon (NorMuon, AdaMuon): the batched step against the single-tensor reference over 20 steps, the
reference against a written-out formula, the checkpoint form of NorMuon's per-row moment, config and registry,
and bad input."""

from __future__ import annotations

import copy

import pytest
import torch

from optstack import OptimizerConfig, build_optimizer
from optstack.algorithms import newton_schulz as newton_schulz_module
from optstack.algorithms.adaptive_muon import AdaptiveMuon, adaptive_muon_reference
from optstack.algorithms.muon import muon_scale_factor
from optstack.algorithms.newton_schulz import newton_schulz
from optstack.algorithms.registry import get_algorithm
from optstack.config import AdaptiveMuonConfig
from optstack.stage.state import exported_state


@pytest.fixture(autouse=True)
def _fp32_newton_schulz(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 Newton-Schulz on every machine (as tests/test_muon.py): these tests compare fp32 formulas."""
    monkeypatch.setattr(newton_schulz_module, "_native_bf16", lambda device_type, index: False)


HYPER = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1, ns_steps=5, scale_mode="spectral",
             extra_scale_factor=0.2, beta2=0.9, eps=1e-8, sign_stabilised=True, preserve_norm=True)
METHODS = ["normuon", "adamuon"]
# repeated shapes (the batched path), wide and tall, a lone shape and a 3-D stack
SHAPES = [(16, 32), (16, 32), (32, 16), (24, 24), (3, 16, 32)]


def _params(shapes: list[tuple[int, ...]], seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


def _grads(params: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) for p in params]


def _moment2(p: torch.Tensor, method: str) -> torch.Tensor:
    return torch.zeros(p.shape if method == "adamuon" else (*p.shape[:-1], 1))


@pytest.mark.parametrize("method", METHODS)
def test_batched_step_equals_reference_over_20_steps(method: str) -> None:
    params = _params(SHAPES, 0)
    refs = [p.detach().clone() for p in params]
    m1 = [torch.zeros_like(p) for p in refs]
    m2 = [_moment2(p, method) for p in refs]
    opt = AdaptiveMuon(params, moment2_method=method, **HYPER)
    for t in range(20):
        grads = _grads(params, 100 + t)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
        for p, g, m, v in zip(refs, grads, m1, m2, strict=True):
            adaptive_muon_reference(p, g, m, v, coefficients="quintic", moment2_method=method, **HYPER)
    start = _params(SHAPES, 0)
    for p, r, s in zip(params, refs, start, strict=True):
        assert (r - s.detach()).abs().max() > 1e-2  # the steps moved it
        torch.testing.assert_close(p.detach(), r, rtol=1e-6, atol=1e-6)
    for p, v in zip(params, m2, strict=True):
        assert opt.state[p]["moment2_buffer"].shape == v.shape
        torch.testing.assert_close(opt.state[p]["moment2_buffer"], v, rtol=1e-6, atol=1e-9)


def _written_out(p0: torch.Tensor, grads: list[torch.Tensor], method: str, lr: float, beta: float, beta2: float,
                 wd: float, eps: float) -> torch.Tensor:
    """The formula typed out in float64 (Newton-Schulz from the package, its own tests cover it)."""
    p, m = p0.double().clone(), torch.zeros_like(p0, dtype=torch.float64)
    rows, cols = p.shape
    v = torch.zeros(rows, 1 if method == "normuon" else cols, dtype=torch.float64)
    for g in grads:
        g = g.double()
        m = beta * m + (1 - beta) * g
        u = (1 - beta) * g + beta * m
        if method == "adamuon":
            u = torch.sign(u)
        o = newton_schulz(u.float(), steps=5).double()
        v = beta2 * v + (1 - beta2) * ((o**2).mean(dim=1, keepdim=True) if method == "normuon" else o**2)
        n = o / (v.sqrt() + eps)
        n = n * (o.norm() / n.norm())
        p = p * (1 - lr * wd) - lr * muon_scale_factor(rows, cols, "spectral") * n
    return p


@pytest.mark.parametrize("method", METHODS)
def test_optimizer_equals_written_out_formula(method: str) -> None:
    (p,) = _params([(12, 20)], 3)
    p0 = p.detach().clone()
    grads = _grads([p] * 4, 7)
    opt = AdaptiveMuon([p], lr=0.03, momentum=0.8, nesterov=True, weight_decay=0.2, moment2_method=method, beta2=0.7)
    for g in grads:
        p.grad = g
        opt.step()
    want = _written_out(p0, grads, method, lr=0.03, beta=0.8, beta2=0.7, wd=0.2, eps=1e-8)
    torch.testing.assert_close(p.detach().double(), want, rtol=1e-5, atol=1e-5)


def test_normuon_update_keeps_the_rms_of_the_orthogonalised_update() -> None:
    # with preserve_norm, the normalised update has NS(u)'s Frobenius norm: the step's RMS is Muon's
    (p,) = _params([(16, 48)], 4)
    g = torch.randn(16, 48, generator=torch.Generator().manual_seed(5)) * torch.linspace(0.1, 10, 16)[:, None]
    p0 = p.detach().clone()
    opt = AdaptiveMuon([p], lr=1.0, momentum=0.0, scale_mode="unit_rms_norm", extra_scale_factor=1.0)
    p.grad = g
    opt.step()
    step = p0 - p.detach()
    o = newton_schulz(g, steps=5) * muon_scale_factor(16, 48, "unit_rms_norm")
    torch.testing.assert_close(step.norm(), o.norm(), rtol=1e-5, atol=0)
    # ... but it is not Muon's update: each row was normalised by its own second moment
    assert (step - o).abs().max() > 1e-3


@pytest.mark.parametrize("method", METHODS)
def test_state_dict_and_exported_form_continue_identically(method: str) -> None:
    params = _params([(16, 32), (32, 16)], 6)
    opt = AdaptiveMuon(params, moment2_method=method, lr=0.03)
    for t in range(3):
        for p, g in zip(params, _grads(params, 10 + t), strict=True):
            p.grad = g
        opt.step()
    exported = [exported_state(opt, p) for p in params]
    for p, e in zip(params, exported, strict=True):  # element-wise: what checkpoints shard
        assert {k: tuple(v.shape) for k, v in e.items()} == {"momentum_buffer": tuple(p.shape),
                                                              "moment2_buffer": tuple(p.shape)}
    saved = copy.deepcopy(opt.state_dict())
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
    again = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt_sd = AdaptiveMuon(fresh, moment2_method=method, lr=0.5)
    opt_sd.load_state_dict(saved)
    opt_ex = AdaptiveMuon(again, moment2_method=method, lr=0.03)
    for p, e in zip(again, exported, strict=True):
        opt_ex.state[p] = {k: v.clone() for k, v in e.items()}
    for t in range(3):
        for group in (params, fresh, again):
            for p, g in zip(group, _grads(group, 50 + t), strict=True):
                p.grad = g
        for o in (opt, opt_sd, opt_ex):
            o.step()
    for a, b, c in zip(params, fresh, again, strict=True):
        assert torch.equal(a.detach(), b.detach())
        assert torch.equal(a.detach(), c.detach())
        assert opt_ex.state[c]["moment2_buffer"].shape == opt.state[a]["moment2_buffer"].shape


@pytest.mark.parametrize(("name", "method", "state"), [("normuon", "normuon", 1), ("adamuon", "adamuon", 2)])
def test_registered_with_whole_matrix_capabilities_and_config_section(name: str, method: str, state: int) -> None:
    spec = get_algorithm(name)
    assert spec.family == "muon" and spec.capabilities.whole_matrices and not spec.capabilities.elementwise
    assert len(spec.capabilities.state) == state
    config = OptimizerConfig(algorithm=name, adaptive_muon=AdaptiveMuonConfig(moment2_method="adamuon", beta2=0.5))
    kwargs = spec.kwargs(config)
    assert kwargs["moment2_method"] == method and kwargs["beta2"] == 0.5  # the name fixes the method
    assert get_algorithm("adaptive_muon").kwargs(config)["moment2_method"] == "adamuon"
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    built = build_optimizer(config, model)
    model(torch.randn(5, 8)).square().mean().backward()
    built.optimizer.step()
    inner = {type(s.optimizer).__name__ for s in built.optimizer.stages}
    assert inner == {"AdaptiveMuon", "AdamW"}  # vectors routed to the scalar algorithm, as for Muon


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"moment2_method": "namo"}, "moment2_method must be one of"),
    ({"beta2": 1.0}, "beta2 must be in [0, 1)"),
    ({"eps": 0.0}, "eps must be a number > 0"),
    ({"preserve_norm": 1}, "preserve_norm must be True or False"),
    ({"qkv_split_shapes": (2, 1, 1)}, "qkv_split_shapes is Muon's only"),
    ({"tp_mode": "blockwise"}, "tp_mode='blockwise' is Muon's only"),
])
def test_bad_settings_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        AdaptiveMuon(_params([(8, 8)], 0), **kwargs)


def test_config_section_is_validated_and_vectors_are_refused() -> None:
    with pytest.raises(ValueError, match="adaptive_muon.beta2 must be in"):
        AdaptiveMuonConfig(beta2=1.5)
    with pytest.raises(ValueError, match="Muon needs 2-D parameters.*Route it to AdamW"):
        AdaptiveMuon([torch.nn.Parameter(torch.zeros(4))])


@pytest.mark.parametrize("method", METHODS)
def test_stacks_cut_into_chunks_keep_each_matrix_moment(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A stack larger than the chunk limit is split along its batch dim: each part's rows of v go with it.
    from optstack.algorithms import adaptive_muon

    monkeypatch.setattr(adaptive_muon, "_MAX_STACK_ELEMENTS", 2 * 16 * 32)  # at most 2 matrices per chunk
    params = _params([(5, 16, 32), (16, 32)], 8)
    refs = [p.detach().clone() for p in params]
    m1, m2 = [torch.zeros_like(p) for p in refs], [_moment2(p, method) for p in refs]
    opt = AdaptiveMuon(params, moment2_method=method, **HYPER)
    for t in range(5):
        grads = _grads(params, 30 + t)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
        for p, g, m, v in zip(refs, grads, m1, m2, strict=True):
            adaptive_muon_reference(p, g, m, v, coefficients="quintic", moment2_method=method, **HYPER)
    for p, r, v in zip(params, refs, m2, strict=True):
        torch.testing.assert_close(p.detach(), r, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["moment2_buffer"], v, rtol=1e-6, atol=1e-9)
