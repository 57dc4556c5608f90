"""Muon and its Newton-Schulz kernel: near-orthogonality, the reference kernel as oracle, an independent
written-out formula, scale modes, QKV split, nesterov, weight decay, state_dict round trip, bad input."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from optstack.algorithms import newton_schulz as newton_schulz_module
from optstack.algorithms.muon import Muon, muon_reference, muon_scale_factor
from optstack.algorithms.newton_schulz import (
    COEFFICIENT_SETS,
    coefficient_schedule,
    matmul_precision,
    newton_schulz,
    ns_matmul_dtype,
)


@pytest.fixture(autouse=True)
def _fp32_newton_schulz(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests check the fp32 formulas to fp32 round-off, so Muon's default "medium" must resolve to fp32
    on every machine (on a CPU or GPU with native bf16 it would pick bf16; tests/test_muon_3d.py tests that)."""
    monkeypatch.setattr(newton_schulz_module, "_native_bf16", lambda device_type, index: False)


# Wide and tall, all <= 64x128 so the whole file runs in a few seconds.
SHAPES = [(16, 64), (32, 64), (64, 32), (64, 128), (128, 64), (48, 64), (64, 48)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _compose(s: torch.Tensor, name: str, steps: int) -> torch.Tensor:
    """The scalar map Newton-Schulz applies to each normalised singular value, in float64."""
    for a, b, c in coefficient_schedule(name, steps):
        s = a * s + b * s**3 + c * s**5
    return s


# ----------------------------------------------------------------------------------------------------------
# Newton-Schulz


@pytest.mark.parametrize("name", ["simple", "quintic", "polar_express"])
@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_ns_maps_singular_values_through_the_composed_polynomial(name: str, shape: tuple[int, int]) -> None:
    # X = U diag(s) V^T with a known spectrum: NS(X) must be U diag(p(s / ||s||)) V^T.
    g = _gen(0)
    k = min(shape)
    u, _ = torch.linalg.qr(torch.randn(shape[0], k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(shape[1], k, generator=g, dtype=torch.float64))
    s = torch.linspace(0.05, 3.0, k, dtype=torch.float64)
    x = (u * s) @ v.T
    expected = (u * _compose(s / s.norm(), name, 5)) @ v.T
    out = newton_schulz(x.float(), steps=5, coefficients=name)
    assert out.shape == shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=0)


# Bands: the range of the composed scalar polynomial over normalised singular values in [0.01, 1] (float64,
# rounded outward by 0.01); the normalised spectra of these Gaussian wide/tall matrices lie in that range.
# Square Gaussian matrices have near-zero singular values that 5 steps do not lift; they are not tested here.
BANDS = {
    ("simple", 5): (0.67, 1.15),  # Keller Jordan's "Uniform(0.5, 1.5)-ish", measured 0.682..1.134
    ("quintic", 5): (0.96, 1.05),  # measured 0.978..1.032
    ("polar_express", 5): (0.86, 1.14),  # first 5 of its 8 polynomials: measured 0.870..1.124
    ("polar_express", 8): (0.99, 1.01),  # the full schedule converges: 1.000
    ("quintic", 10): (0.96, 1.04),  # cycled twice: 0.978..1.026
}


@pytest.mark.parametrize(("name", "steps"), list(BANDS))
def test_ns_output_is_near_orthogonal_for_random_matrices(name: str, steps: int) -> None:
    lo, hi = BANDS[(name, steps)]
    grid = torch.logspace(-2, 0, 4001, dtype=torch.float64)
    poly = _compose(grid, name, steps)
    assert lo <= poly.min() and poly.max() <= hi, "band must cover the polynomial's range"
    g = _gen(1)
    for shape in SHAPES:
        x = torch.randn(*shape, generator=g)
        sv = torch.linalg.svdvals(newton_schulz(x, steps=steps, coefficients=name))
        assert sv.min() >= lo and sv.max() <= hi, (shape, sv.min().item(), sv.max().item())


def test_ns_batched_equals_one_by_one_and_handles_zero() -> None:
    g = _gen(2)
    for shape in [(32, 64), (64, 32)]:
        xs = torch.randn(3, *shape, generator=g)
        batched = newton_schulz(xs, coefficients="polar_express")
        single = torch.stack([newton_schulz(x, coefficients="polar_express") for x in xs])
        torch.testing.assert_close(batched, single, atol=1e-6, rtol=1e-6)
    assert torch.equal(newton_schulz(torch.zeros(8, 4)), torch.zeros(8, 4))


def test_ns_runs_in_fp32_on_a_cpu_without_bf16_whatever_is_asked() -> None:
    # bf16 Newton-Schulz on CPU is asked for with "medium" and taken only where the CPU multiplies bf16 natively
    # (the autouse fixture says this one does not; tests/test_muon_3d.py covers the bf16 branch).
    x = torch.randn(16, 32, generator=_gen(3))
    fp32 = newton_schulz(x)
    assert torch.equal(newton_schulz(x, matmul_dtype=ns_matmul_dtype("medium", torch.device("cpu"))), fp32)
    out = newton_schulz(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), newton_schulz(x.bfloat16().float()), atol=8e-3, rtol=0)
    before = torch.get_float32_matmul_precision()
    with matmul_precision("medium", torch.device("cpu")):
        assert torch.get_float32_matmul_precision() == "highest"
    assert torch.get_float32_matmul_precision() == before


def test_coefficient_schedules() -> None:
    quintic = COEFFICIENT_SETS["quintic"]
    assert coefficient_schedule("quintic", 7) == [*quintic, quintic[0], quintic[1]]  # cycles (Megatron)
    polar = COEFFICIENT_SETS["polar_express"]
    assert coefficient_schedule("polar_express", 10) == [*polar, polar[-1], polar[-1]]  # repeats the last
    assert coefficient_schedule("simple", 3) == [(3.4445, -4.7750, 2.0315)] * 3
    custom = [(2.0, -1.5, 0.5), (1.5, -0.5, 0.0)]
    assert coefficient_schedule(custom, 3) == [custom[0], custom[1], custom[0]]
    # the quintic schedule starts steep so tiny singular values grow fast
    assert quintic[0] == (4.0848, -6.8946, 2.9270)


# ----------------------------------------------------------------------------------------------------------
# Muon against its reference and against an independent formula

HYPER = dict(
    lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1, ns_steps=5, scale_mode="spectral",
    extra_scale_factor=0.2,
)  # fmt: skip


def _params(shapes: list[tuple[int, int]], seed: int) -> list[torch.nn.Parameter]:
    g = _gen(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


def _grads(params: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    g = _gen(seed)
    return [torch.randn(p.shape, generator=g) for p in params]


def _run_muon(opt: Muon, params: list[torch.nn.Parameter], steps: int, first_seed: int = 100) -> None:
    for t in range(steps):
        for p, grad in zip(params, _grads(params, first_seed + t), strict=True):
            p.grad = grad
        opt.step()


def test_muon_equals_reference_over_steps_with_per_group_settings() -> None:
    # Repeated shapes exercise the batched path; the second group overrides several settings.
    shapes_a = [(32, 64), (32, 64), (64, 32), (48, 48)]
    shapes_b = [(16, 64), (64, 16), (16, 64)]
    pa, pb = _params(shapes_a, 0), _params(shapes_b, 1)
    group_b = dict(
        params=pb, ns_coefficients="polar_express", ns_steps=6, scale_mode="shape_scaling", nesterov=False,
        momentum=0.5, weight_decay=0.0, lr=0.01, extra_scale_factor=1.0,
    )  # fmt: skip
    opt = Muon([dict(params=pa), group_b], **{k: v for k, v in HYPER.items() if k != "ns_steps"})
    ref_a, ref_b = [p.detach().clone() for p in pa], [p.detach().clone() for p in pb]
    bufs_a, bufs_b = [torch.zeros_like(p) for p in ref_a], [torch.zeros_like(p) for p in ref_b]
    settings_b = {k: v for k, v in group_b.items() if k not in ("params", "ns_coefficients")}
    for t in range(4):
        _run_muon(opt, pa + pb, 1, first_seed=100 + t)
        grads = _grads(pa + pb, 100 + t)
        for p, b, grad in zip(ref_a, bufs_a, grads[: len(pa)], strict=True):
            muon_reference(p, grad, b, coefficients="quintic", **HYPER)
        for p, b, grad in zip(ref_b, bufs_b, grads[len(pa) :], strict=True):
            muon_reference(p, grad, b, coefficients="polar_express", **settings_b)
    for p, r in zip(pa + pb, ref_a + ref_b, strict=True):
        torch.testing.assert_close(p.detach(), r, atol=1e-6, rtol=1e-6)
    for p, b in zip(pa + pb, bufs_a + bufs_b, strict=True):
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], b, atol=0, rtol=0)


def _written_out_muon(
    p0: torch.Tensor, grads: list[torch.Tensor], lr: float, beta: float, wd: float
) -> torch.Tensor:
    """Classic Muon with the summed momentum m = beta m + g and nesterov g + beta m, its NS typed out with
    the quintic coefficients: independent of the package's code (the EMA form differs only by a constant
    factor that the Frobenius normalisation removes)."""
    coeffs = [
        (4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012),
    ]  # fmt: skip
    p, m = p0.double().clone(), torch.zeros_like(p0, dtype=torch.float64)
    rows, cols = p.shape
    for g in grads:
        g = g.double()
        m = beta * m + g
        u = g + beta * m
        x = u.T if rows > cols else u
        x = x / x.norm()
        for a, b, c in coeffs:
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        o = x.T if rows > cols else x
        p = p * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(rows, cols)) * o
    return p


def test_muon_equals_independent_written_out_formula() -> None:
    params = _params([(32, 64), (64, 32)], 5)
    start = [p.detach().clone() for p in params]
    opt = Muon(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1, extra_scale_factor=0.2)
    _run_muon(opt, params, 5)
    for i, p in enumerate(params):
        grads = [_grads(params, 100 + t)[i] for t in range(5)]
        expected = _written_out_muon(start[i], grads, lr=0.05, beta=0.9, wd=0.1)
        torch.testing.assert_close(p.detach().double(), expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize(
    ("mode", "shape", "factor"),
    [
        ("spectral", (16, 64), 8.0),
        ("spectral", (64, 16), 8.0),
        ("unit_rms_norm", (16, 64), 0.5),
        ("unit_rms_norm", (64, 16), 2.0),
        ("shape_scaling", (16, 64), 1.0),
        ("shape_scaling", (64, 16), 2.0),
    ],
)
@pytest.mark.parametrize("extra", [1.0, 0.2])
def test_scale_modes(mode: str, shape: tuple[int, int], factor: float, extra: float) -> None:
    assert muon_scale_factor(*shape, mode) == factor  # type: ignore[arg-type]
    (p,) = _params([shape], 6)
    start = p.detach().clone()
    opt = Muon([p], lr=0.1, momentum=0.0, scale_mode=mode, extra_scale_factor=extra)  # type: ignore[arg-type]
    p.grad = torch.randn(shape, generator=_gen(7))
    opt.step()
    expected = start - 0.1 * extra * factor * newton_schulz(p.grad)
    torch.testing.assert_close(p.detach(), expected, atol=1e-6, rtol=0)


def test_qkv_split_equals_per_block_orthogonalisation_by_hand() -> None:
    groups, (q, k, v), cols = 3, (8, 4, 4), 24
    (w,) = _params([(groups * (q + k + v), cols)], 8)
    start = w.detach().clone()
    opt = Muon([dict(params=[w], qkv_split_shapes=(q, k, v))], lr=0.1, momentum=0.0)
    w.grad = torch.randn(w.shape, generator=_gen(9))
    opt.step()
    # By hand: gather the rows of each block from every attention group, orthogonalise, scatter back.
    expected_step = torch.empty_like(start)
    offsets = {"q": (0, q), "k": (q, k), "v": (q + k, v)}
    for first, size in offsets.values():
        rows = [g * (q + k + v) + first + r for g in range(groups) for r in range(size)]
        block = w.grad[rows]
        expected_step[rows] = newton_schulz(block) * math.sqrt(max(len(rows), cols))
    torch.testing.assert_close(w.detach(), start - 0.1 * expected_step, atol=1e-6, rtol=0)
    unsplit = start - 0.1 * newton_schulz(w.grad) * math.sqrt(max(w.shape))
    assert not torch.allclose(w.detach(), unsplit, atol=1e-3)

    # and the reference kernel agrees
    ref = start.clone()
    muon_reference(
        ref, w.grad, torch.zeros_like(ref), lr=0.1, momentum=0.0, nesterov=False, weight_decay=0.0,
        ns_steps=5, coefficients="quintic", scale_mode="spectral", extra_scale_factor=1.0,
        qkv_split_shapes=(q, k, v),
    )  # fmt: skip
    torch.testing.assert_close(w.detach(), ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("nesterov", [False, True])
def test_nesterov_and_plain_momentum_follow_their_formulas(nesterov: bool) -> None:
    (p,) = _params([(32, 48)], 10)
    start = p.detach().clone()
    beta, lr = 0.8, 0.05
    opt = Muon([p], lr=lr, momentum=beta, nesterov=nesterov)
    _run_muon(opt, [p], 2)
    g1, g2 = _grads([p], 100)[0], _grads([p], 101)[0]
    m1 = (1 - beta) * g1
    m2 = beta * m1 + (1 - beta) * g2
    u1 = (1 - beta) * g1 + beta * m1 if nesterov else m1
    u2 = (1 - beta) * g2 + beta * m2 if nesterov else m2
    scale = math.sqrt(48)
    expected = start - lr * scale * newton_schulz(u1) - lr * scale * newton_schulz(u2)
    torch.testing.assert_close(p.detach(), expected, atol=2e-6, rtol=0)
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], m2, atol=1e-6, rtol=0)
    # the other form gives a different second step (the first is the same direction, g1, for both)
    u2_other = m2 if nesterov else (1 - beta) * g2 + beta * m2
    other = start - lr * scale * newton_schulz(u1) - lr * scale * newton_schulz(u2_other)
    assert not torch.allclose(p.detach(), other, atol=1e-4)


def test_weight_decay_is_decoupled() -> None:
    p_wd, p_plain = _params([(32, 64)], 11)[0], _params([(32, 64)], 11)[0]
    start = p_wd.detach().clone()
    lr, wd = 0.05, 0.3
    opt_wd = Muon([p_wd], lr=lr, weight_decay=wd)
    opt_plain = Muon([p_plain], lr=lr)
    grad = torch.randn(32, 64, generator=_gen(12))
    p_wd.grad, p_plain.grad = grad.clone(), grad.clone()
    opt_wd.step()
    opt_plain.step()
    # decay shrinks the old weights and leaves the orthogonalised step unchanged
    torch.testing.assert_close(p_wd.detach(), p_plain.detach() - lr * wd * start, atol=1e-6, rtol=0)


def test_state_dict_round_trip_continues_identically() -> None:
    shapes = [(32, 64), (32, 64), (64, 16)]
    params = _params(shapes, 13)
    opt = Muon(params, lr=0.03, nesterov=True, weight_decay=0.05)
    _run_muon(opt, params, 3)
    saved_params = [p.detach().clone() for p in params]
    saved_state = copy.deepcopy(opt.state_dict())
    _run_muon(opt, params, 3, first_seed=200)

    fresh = [torch.nn.Parameter(t.clone()) for t in saved_params]
    opt2 = Muon(fresh, lr=0.5)  # the loaded groups override the constructor's settings
    opt2.load_state_dict(saved_state)
    assert opt2.param_groups[0]["lr"] == 0.03
    _run_muon(opt2, fresh, 3, first_seed=200)
    for a, b in zip(params, fresh, strict=True):
        assert torch.equal(a.detach(), b.detach())
        assert torch.equal(opt.state[a]["momentum_buffer"], opt2.state[b]["momentum_buffer"])


def test_params_without_grad_are_left_alone() -> None:
    a, b = _params([(8, 16), (8, 16)], 14)
    before = b.detach().clone()
    opt = Muon([a, b])
    a.grad = torch.randn(8, 16, generator=_gen(15))
    opt.step()
    assert torch.equal(b.detach(), before) and b not in opt.state
    assert not torch.equal(a.detach(), _params([(8, 16)], 14)[0].detach())


# ----------------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(ns_coefficients="cubic"), r"unknown Newton-Schulz coefficient set 'cubic'.*polar_express"),
        (dict(ns_coefficients=[(1.0, 2.0)]), r"\(a, b, c\) number triples"),
        (dict(ns_steps=0), r"steps must be an integer >= 1, got 0"),
        (dict(momentum=1.0), r"momentum must be in \[0, 1\), got 1.0"),
        (dict(momentum=-0.1), r"momentum must be in \[0, 1\)"),
        (dict(scale_mode="rms"), r"unknown scale_mode 'rms'.*spectral"),
        (dict(matmul_precision="low"), r"matmul_precision must be one of"),
        (dict(lr=-1.0), r"lr must be a number >= 0"),
        (dict(weight_decay=-0.1), r"weight_decay must be a number >= 0"),
        (dict(qkv_split_shapes=(8, 4)), r"qkv_split_shapes must be None or three positive ints"),
    ],
)
def test_bad_settings_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Muon(_params([(32, 16)], 0), **kwargs)


def test_non_matrix_parameter_is_named_with_a_fix() -> None:
    w, bias = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=r"param 1 in group 0 has shape \(4,\).*Rule\(Ndim\(lt=2\)"):
        Muon([w, bias])
    group = dict(params=[w, bias], param_names=["proj.weight", "norm.weight"])
    with pytest.raises(ValueError, match=r"'norm.weight' \(index 1\) in group 0 has shape \(4,\)"):
        Muon([group])
    # 3-D stacks of matrices are Muon's (tests/test_muon_3d.py); 4-D and up are not
    with pytest.raises(ValueError, match=r"shape \(2, 2, 2, 2\).*Ndim\(gt=3\)"):
        Muon([torch.nn.Parameter(torch.zeros(2, 2, 2, 2))])


def test_qkv_shapes_that_do_not_divide_rows_are_rejected() -> None:
    w = torch.nn.Parameter(torch.zeros(30, 8))
    group = dict(params=[w], param_names=["attn.qkv.weight"], qkv_split_shapes=(8, 4, 4))
    with pytest.raises(ValueError, match=r"\(8, 4, 4\).*16 rows.*'attn.qkv.weight'.*\(30, 8\)"):
        Muon([group])


def test_rejected_group_is_not_added() -> None:
    opt = Muon(_params([(4, 4)], 0))
    with pytest.raises(ValueError):
        opt.add_param_group(dict(params=_params([(4, 4)], 1), momentum=2.0))
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("dim", [0, 1])
def test_tp_modes_blockwise_per_block_and_distributed_equal_to_the_whole(dim: int) -> None:
    # tp_blocks {name: (dim, parts)}: blockwise orthogonalises each block (and scales it by its own shape);
    # distributed runs Newton-Schulz over the blocks with summed Grams: the whole matrix's result to round-off
    shape = (12, 8)
    grad = torch.randn(shape, generator=_gen(3))
    out = {}
    for mode in ("duplicated", "blockwise", "distributed"):
        (w,) = _params([shape], 4)
        start = w.detach().clone()
        opt = Muon([dict(params=[w], param_names=["w"], tp_mode=mode, tp_blocks={"w": (dim, 2)})], lr=0.1,
                   momentum=0.0, matmul_precision="highest")
        w.grad = grad.clone()
        opt.step()
        out[mode] = (start - w.detach()) / 0.1
    blocks = grad.chunk(2, dim)
    by_hand = torch.cat([newton_schulz(b) * math.sqrt(max(b.shape)) for b in blocks], dim)
    torch.testing.assert_close(out["blockwise"], by_hand, atol=1e-5, rtol=0)
    torch.testing.assert_close(out["duplicated"], newton_schulz(grad) * math.sqrt(max(shape)), atol=1e-5, rtol=0)
    gap = (out["distributed"] - out["duplicated"]).abs().max().item()
    assert 0 < gap <= 1e-5  # the same matrix by other arithmetic (a block-wise Gram), not the duplicated path
    assert (out["blockwise"] - out["duplicated"]).abs().max().item() > 1e-2


def test_tp_mode_blockwise_splits_qkv_within_each_block_and_refuses_uneven_blocks() -> None:
    groups, (q, k, v), cols = 4, (4, 2, 2), 8
    rows = groups * (q + k + v)
    grad = torch.randn(rows, cols, generator=_gen(5))
    (w,) = _params([(rows, cols)], 6)
    start = w.detach().clone()
    opt = Muon([dict(params=[w], param_names=["qkv"], tp_mode="blockwise", tp_blocks={"qkv": (0, 2)},
                     qkv_split_shapes=(q, k, v))], lr=0.1, momentum=0.0, matmul_precision="highest")
    w.grad = grad.clone()
    opt.step()
    # each tensor-parallel block holds 2 whole attention groups: its own q, k, v split (Megatron's local split)
    expected = torch.empty_like(grad)
    for half in range(2):
        part = slice(half * rows // 2, (half + 1) * rows // 2)
        local = Muon([dict(params=[p := torch.nn.Parameter(torch.zeros(rows // 2, cols))], qkv_split_shapes=(q, k, v))],
                     lr=1.0, momentum=0.0, matmul_precision="highest")
        p.grad = grad[part].clone()
        local.step()
        expected[part] = -p.detach()
    torch.testing.assert_close((start - w.detach()) / 0.1, expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"tp_mode 'blockwise' needs param 'odd' .* split evenly"):
        Muon([dict(params=[torch.nn.Parameter(torch.zeros(5, 4))], param_names=["odd"], tp_mode="blockwise",
                   tp_blocks={"odd": (0, 2)})])
    with pytest.raises(ValueError, match=r"'distributed' takes a matrix split .* 'both' .*tp_mode='duplicated'"):
        Muon([dict(params=[torch.nn.Parameter(torch.zeros(4, 4))], param_names=["both"], tp_mode="distributed",
                   tp_blocks={"both": None})])
    Muon([dict(params=[torch.nn.Parameter(torch.zeros(4, 4))], param_names=["both"], tp_blocks={"both": None})])
