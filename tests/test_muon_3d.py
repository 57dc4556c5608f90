"""Muon over 3-D stacks of matrices (grouped experts, per-head blocks) and bf16 Newton-Schulz: per-matrix
orthogonalisation and scaling against the per-matrix reference, batching across params and chunks, the QKV split
per matrix, routing, and the bf16 iteration's error against fp32's."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from optstack import OptimizerConfig, build_optimizer
from optstack.algorithms import muon as muon_module
from optstack.algorithms.muon import Muon, muon_reference
from optstack.algorithms.newton_schulz import newton_schulz, ns_matmul_dtype

ns_module = importlib.import_module("optstack.algorithms.newton_schulz")
HYPER = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1, extra_scale_factor=0.2)
CPU = torch.device("cpu")


@pytest.fixture
def native_bf16(monkeypatch: pytest.MonkeyPatch):
    """Set whether the machine multiplies bf16 natively (the capability check), for both branches anywhere."""

    def set_native(value: bool) -> None:
        monkeypatch.setattr(ns_module, "_native_bf16", lambda device_type, index: value)

    set_native(False)
    return set_native


def _pair(shapes: list[tuple[int, ...]], seed: int) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]
    return params, [p.detach().clone() for p in params]


def _steps(opt: Muon, params: list[nn.Parameter], refs: list[torch.Tensor], seed: int, steps: int = 3,
           **reference: object) -> None:
    g = torch.Generator().manual_seed(seed)
    bufs = [torch.zeros_like(r) for r in refs]
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        for p, r, b in zip(params, refs, bufs, strict=True):
            settings = {"scale_mode": "spectral", **HYPER, **reference}
            muon_reference(r, p.grad, b, ns_steps=5, coefficients="quintic", **settings)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["spectral", "unit_rms_norm", "shape_scaling"])
def test_3d_stack_is_orthogonalised_and_scaled_per_matrix(native_bf16, mode: str) -> None:
    # (4, 24, 40): wide matrices, (3, 40, 24): tall ones, the 2-D (24, 40) batched with the first stack
    params, refs = _pair([(4, 24, 40), (3, 40, 24), (24, 40)], 0)
    opt = Muon(params, scale_mode=mode, **HYPER)  # type: ignore[arg-type]
    _steps(opt, params, refs, 1, scale_mode=mode)
    for p, r in zip(params, refs, strict=True):
        torch.testing.assert_close(p.detach(), r, atol=2e-5, rtol=1e-5)
    assert opt.state[params[0]]["momentum_buffer"].shape == (4, 24, 40)


def test_3d_stack_equals_its_matrices_as_separate_params(native_bf16) -> None:
    stack, _ = _pair([(5, 16, 32)], 2)
    separate = [nn.Parameter(m.detach().clone()) for m in stack[0]]
    opt_stack, opt_separate = Muon(stack, **HYPER), Muon(separate, **HYPER)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        grad = torch.randn(5, 16, 32, generator=g)
        stack[0].grad = grad
        for p, gi in zip(separate, grad, strict=True):
            p.grad = gi.clone()
        opt_stack.step()
        opt_separate.step()
    torch.testing.assert_close(stack[0].detach(), torch.stack([p.detach() for p in separate]), atol=1e-6, rtol=1e-6)


def test_chunks_split_stacks_and_mix_params(native_bf16, monkeypatch: pytest.MonkeyPatch) -> None:
    params, refs = _pair([(5, 8, 12), (8, 12), (3, 8, 12)], 4)
    # room for 2 matrices per stack: the 5-stack splits across chunks, the 2-D one shares one
    monkeypatch.setattr(muon_module, "_MAX_STACK_ELEMENTS", 2 * 8 * 12)
    opt = Muon(params, **HYPER)
    _steps(opt, params, refs, 5)
    for p, r in zip(params, refs, strict=True):
        torch.testing.assert_close(p.detach(), r, atol=2e-5, rtol=1e-5)


def test_qkv_split_applies_to_each_matrix_of_a_stack(native_bf16) -> None:
    # 2 heads-blocks of a fused (2 groups x (4 + 2 + 2) rows, 12) QKV weight, stacked
    params, refs = _pair([(2, 16, 12)], 6)
    opt = Muon([dict(params=params, qkv_split_shapes=(4, 2, 2))], **HYPER)
    _steps(opt, params, refs, 7, qkv_split_shapes=(4, 2, 2))
    torch.testing.assert_close(params[0].detach(), refs[0], atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"\(4, 2, 2\).*8 rows.*shape \(2, 12, 12\)"):
        Muon([dict(params=[nn.Parameter(torch.zeros(2, 12, 12))], qkv_split_shapes=(4, 2, 2))])


def test_3d_params_are_routed_to_muon_and_the_rest_to_the_scalar_optimizer(native_bf16) -> None:
    model = nn.Module()
    model.embed = nn.Embedding(10, 8)
    model.embed.weight.is_embedding_or_output_parameter = True  # type: ignore[attr-defined]
    model.experts = nn.Parameter(torch.randn(4, 8, 8))
    model.proj = nn.Linear(8, 8)
    model.conv = nn.Conv2d(2, 2, 3)
    built = build_optimizer(OptimizerConfig(algorithm="muon"), model)
    algorithm = {n: g.get("algorithm", "muon") for g in built.param_groups for n in g["param_names"]}
    assert algorithm == {"embed.weight": "adamw", "experts": "muon", "proj.weight": "muon", "proj.bias": "adamw",
                         "conv.weight": "adamw", "conv.bias": "adamw"}


# ----------------------------------------------------------------------------------------------------------
# Precision


def test_ns_dtype_follows_the_hardware(native_bf16) -> None:
    assert [ns_matmul_dtype(p, CPU) for p in ("highest", "high", "medium")] == [torch.float32] * 3
    native_bf16(True)
    assert [ns_matmul_dtype(p, CPU) for p in ("highest", "high", "medium")] == [torch.float32] * 2 + [torch.bfloat16]
    with pytest.raises(ValueError, match="matmul_precision must be one of"):
        ns_matmul_dtype("low", CPU)  # type: ignore[arg-type]


@pytest.mark.parametrize("coefficients", ["quintic", "polar_express", "simple"])
@pytest.mark.parametrize("shape", [(48, 96), (96, 48), (3, 40, 64)])
def test_bf16_ns_error_is_bounded_against_fp32(coefficients: str, shape: tuple[int, ...]) -> None:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(8))
    fp32 = newton_schulz(x, coefficients=coefficients)
    bf16 = newton_schulz(x, coefficients=coefficients, matmul_dtype=torch.bfloat16)
    assert bf16.dtype == torch.float32
    # measured <= 1.5e-2 relative (bf16 has 8 mantissa bits; the iteration does not amplify its round-off)
    assert ((bf16 - fp32).norm() / fp32.norm()).item() < 2.5e-2
    s32, s16 = torch.linalg.svdvals(fp32), torch.linalg.svdvals(bf16)
    assert (s16 - s32).abs().max().item() < 3e-2  # the same singular values to bf16 round-off
    assert s16.max().item() < s32.max().item() + 1e-2  # no larger than fp32's band


def test_muon_takes_bf16_where_native_and_fp32_elsewhere(native_bf16) -> None:
    shapes = [(2, 24, 40), (40, 24)]
    params, refs = _pair(shapes, 9)
    _steps(Muon(params, **HYPER), params, refs, 10)  # no native bf16: "medium" is fp32, to round-off
    for p, r in zip(params, refs, strict=True):
        torch.testing.assert_close(p.detach(), r, atol=2e-5, rtol=1e-5)
    native_bf16(True)
    params, refs = _pair(shapes, 9)
    init = [r.clone() for r in refs]
    _steps(Muon(params, **HYPER), params, refs, 10, matmul_dtype=torch.bfloat16)
    for p, r in zip(params, refs, strict=True):
        torch.testing.assert_close(p.detach(), r, atol=2e-5, rtol=1e-5)  # the bf16 reference
    params32, refs32 = _pair(shapes, 9)
    _steps(Muon(params32, matmul_precision="highest", **HYPER), params32, refs32, 10)  # "highest" stays fp32
    for p, p32, p0 in zip(params, params32, init, strict=True):
        moved, moved32 = p.detach() - p0, p32.detach() - p0
        assert ((moved - moved32).norm() / moved32.norm()).item() < 3e-2  # bf16 steps near fp32's
