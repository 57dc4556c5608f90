"""The Megatron face's emerging optimizers (one process): the registry helpers, TensorParallelAdaptiveMuon and
SOAP against plain references, Emerging-Optimizers' Lion, and get_megatron_optimizer's routing of 'adaptive_muon'
and 'soap'."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from optstack.algorithms.muon import muon_scale_factor
from optstack.algorithms.newton_schulz import newton_schulz
from optstack.megatron import OptimizerConfig, get_megatron_optimizer, to_core
from optstack.megatron import emerging_optimizers as eo
from optstack.megatron.torch_optimizers import Lion


def test_registry_helpers() -> None:
    assert set(eo.get_supported_coefficient_types()) == {"simple", "quintic", "polar_express"}
    eo.validate_coefficient_type("quintic")
    with pytest.raises(ValueError, match="Unsupported muon coefficient type 'cubic'"):
        eo.validate_coefficient_type("cubic")
    cfg = SimpleNamespace(num_attention_heads=16, num_query_groups=8, kv_channels=64)
    assert eo._get_qkv_split_shapes(cfg) == [128, 64, 64]
    assert eo._get_qkv_split_shapes(SimpleNamespace(**vars(cfg), attention_output_gate=True)) == [128, 128, 64, 64]
    assert set(eo._EMERGING_OPTIMIZERS) >= {"muon", "adaptive_muon", "soap"}
    config = OptimizerConfig(lr=0.1, optimizer="adaptive_muon", adaptive_muon_beta2=0.9, muon_momentum=0.8)
    kwargs = eo._adaptive_muon_config_to_kwargs(config, [], None)
    assert kwargs["beta2"] == 0.9 and kwargs["momentum"] == 0.8 and kwargs["moment2_method"] == "adamuon"


@pytest.mark.parametrize("method", ["adamuon", "normuon"])
@pytest.mark.parametrize("shape", [(12, 8), (8, 12)])
def test_adaptive_muon_equals_reference(method: str, shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(shape))
    ref, m, v = p.detach().clone(), torch.zeros(shape), None
    opt = eo.TensorParallelAdaptiveMuon([p], lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1,
                                        fp32_matmul_prec="highest", moment2_method=method, beta2=0.8, eps=1e-8)
    dim = 1 if shape[0] >= shape[1] else 0
    for _ in range(3):
        g = torch.randn(shape)
        p.grad = g.clone()
        opt.step()
        # Megatron's formulas: EMA momentum, Nesterov, scaled Newton-Schulz, then the second moment
        m = 0.9 * m + 0.1 * g
        u = 0.1 * g + 0.9 * m
        o = newton_schulz(u, steps=5, coefficients="quintic") * muon_scale_factor(*shape, "spectral")
        if method == "adamuon":
            v = (0.8 * v if v is not None else 0) + 0.2 * o.square()
            n = o / (v.sqrt() + 1e-8)
        else:
            v = (0.8 * v if v is not None else 0) + 0.2 * o.square().mean(dim=dim, keepdim=True)
            n = o / v.clamp_min(1e-8).sqrt()
        ref = ref * (1 - 0.05 * 0.1) - 0.05 * n
    torch.testing.assert_close(p.detach(), ref, rtol=1e-5, atol=1e-6)
    assert opt.state[p]["moment2_buffer"].shape == (shape if method == "adamuon" else
                                                    (shape[0], 1) if dim == 1 else (1, shape[1]))


def test_soap_equals_reference() -> None:
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(6, 5))
    ref = p.detach().clone()
    L, R, m, v = torch.zeros(6, 6), torch.zeros(5, 5), torch.zeros(6, 5), torch.zeros(6, 5)
    # (6, 5): the first factor L has one null direction, unique up to sign (two would leave the basis inside them,
    # and so the next steps' updates, to round-off: see optstack.algorithms.soap). eps 1e-2: the first update is
    # in the gradient's own eigenbasis, where it is diagonal but for round-off, and Adam's ratio of round-off to
    # round-off is +-1 at a tiny eps (in the class and in any reference alike; at 1e-3, 1e-6 of it remains)
    opt = eo.SOAP([p], lr=0.01, betas=(0.9, 0.99), shampoo_beta=0.9, eps=1e-2, weight_decay=0.1,
                  precondition_frequency=2)
    for t in range(1, 5):
        g = torch.randn(6, 5)
        p.grad = g.clone()
        opt.step()
        # the same operations as the class (lerp): a rank-deficient factor's null-space eigenvectors depend on
        # the rounding
        L, R = torch.lerp(L, g @ g.T, 0.1), torch.lerp(R, g.T @ g, 0.1)
        if t % 2 == 1:  # refreshed at steps 1, 3
            QL, QR = torch.linalg.eigh((L + L.T) / 2)[1], torch.linalg.eigh((R + R.T) / 2)[1]
        m = torch.lerp(m, g, 0.1)
        v = torch.lerp(v, (QL.T @ g @ QR).square(), 0.01)
        u = QL @ ((QL.T @ m @ QR) / (1 - 0.9**t) / ((v / (1 - 0.99**t)).sqrt() + 1e-2)) @ QR.T
        ref = ref * (1 - 0.01 * 0.1) - 0.01 * u
    torch.testing.assert_close(p.detach(), ref, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="SOAP needs 2-D"):
        eo.SOAP([nn.Parameter(torch.ones(3, requires_grad=True))], lr=0.1)._init_group(
            {"params": [nn.Parameter(torch.ones(3))]}, skip_non_grad_params=False)


def test_kl_shampoo_changes_the_factors() -> None:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(6, 4)) for _ in range(2)]
    opts = [eo.SOAP([p], lr=0.01, use_kl_shampoo=kl) for p, kl in zip(params, (False, True), strict=True)]
    for _ in range(2):
        g = torch.randn(6, 4)
        for p, opt in zip(params, opts, strict=True):
            p.grad = g.clone()
            opt.step()
    assert not torch.allclose(opts[0].state[params[0]]["GG_left"], opts[1].state[params[1]]["GG_left"])


def test_lion_l2_decay_reads_the_decayed_gradient() -> None:
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(5, 3))
    b.data.copy_(a.data)
    g = torch.randn(5, 3)
    a.grad, b.grad = g.clone(), g + 0.5 * b.detach()
    Lion([a], lr=0.1, weight_decay=0.5, weight_decay_method="l2").step()
    Lion([b], lr=0.1, weight_decay=0.0).step()
    torch.testing.assert_close(a, b)
    assert torch.equal(a.grad, g)  # the caller's gradient is left as it was
    with pytest.raises(ValueError, match="weight_decay_method"):
        Lion([a], weight_decay_method="l1")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))


def test_get_megatron_optimizer_routes_adaptive_muon_and_soap() -> None:
    core = to_core(OptimizerConfig(lr=0.1, optimizer="adaptive_muon", adaptive_muon_moment2_method="normuon",
                                   adaptive_muon_beta2=0.9))
    assert core.algorithm == "adaptive_muon" and core.adaptive_muon.moment2_method == "normuon"
    assert core.adaptive_muon.beta2 == 0.9 and not core.adaptive_muon.sign_stabilised
    for name, matrix_cls in (("adaptive_muon", "AdaptiveMuon"), ("soap", "SOAP")):
        model = _net()
        opt = get_megatron_optimizer(OptimizerConfig(lr=0.01, optimizer=name, soap_shampoo_beta=0.5,
                                                     soap_precondition_frequency=3), [model])
        inner = {type(s.optimizer).__name__: s.optimizer for s in opt.built.optimizer.stages}
        assert set(inner) == {"AdamW", matrix_cls}  # biases to Adam, as Megatron's default overrides
        assert all(p.dim() == 2 for g in inner[matrix_cls].param_groups for p in g["params"])
        if name == "soap":
            assert all(g["shampoo_beta"] == 0.5 and g["precondition_frequency"] == 3
                       for g in inner[matrix_cls].param_groups)
        before = [p.detach().clone() for p in model.parameters()]
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_soap_state_round_trips_through_the_optimizers_state_dict() -> None:
    """optimizer='soap' (Emerging-Optimizers' SOAP, KL-Shampoo): its square factors and eigenbases travel as
    parameter-shaped pages; a fresh optimizer loaded from the state dict steps exactly as the one saved."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)

    def built() -> tuple[nn.Module, object]:
        model = _net()
        return model, get_megatron_optimizer(OptimizerConfig(lr=0.01, optimizer="soap",
                                                             soap_precondition_frequency=2), [model])

    model, opt = built()
    for _ in range(3):
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
    saved = opt.state_dict()
    model2, opt2 = built()
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(saved)
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).square().sum().backward()
        o.step()
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["decoupled", "l2"])
def test_lion_grad_scale_scales_the_gradient_not_the_decay(method: str) -> None:
    """A stage steps Emerging-Optimizers' Lion with ``grad_scale`` (loss scale, clip): the same as stepping the
    scaled gradient; under ``l2`` the decay term joins unscaled."""
    torch.manual_seed(0)
    a, b = torch.randn(5, 4), torch.randn(5, 4)
    a.grad = torch.randn(5, 4)
    b.data.copy_(a.data)
    b.grad = a.grad * 0.25
    opts = [Lion([p], lr=0.1, weight_decay=0.5, weight_decay_method=method) for p in (a, b)]
    for _ in range(3):
        opts[0].step(grad_scale=0.25)
        opts[1].step()
    torch.testing.assert_close(a, b, rtol=0, atol=0)
