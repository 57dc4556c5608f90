"""Gradient statistics: which grads count, the norm of each gradient, the clip factor, the zero count, and
their reduction in a stage."""

from __future__ import annotations

import math

import pytest
import torch

from optstack.clip import check_norm_type, clip_coefficient, counts_toward_norm, norm_pows, zero_count
from optstack.stage import Stage, Whole

CPU = torch.device("cpu")


def _param(*shape: int, **attrs: bool) -> torch.Tensor:
    param = torch.zeros(*shape)
    for key, value in attrs.items():
        setattr(param, key, value)  # what a Megatron-style model puts on its params
    return param


def test_counts_toward_norm_excludes_shared_and_tensor_parallel_duplicates() -> None:
    plain = _param(2)
    split = _param(2, tensor_model_parallel=True)
    replicated = _param(2, tensor_model_parallel=False)
    shared = _param(2, shared=True)
    params = [plain, split, replicated, shared]
    assert [counts_toward_norm(p, 0) for p in params] == [True, True, True, False]  # shared never
    assert [counts_toward_norm(p, 1) for p in params] == [False, True, False, False]  # only the TP split


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_norm_pows_match_the_concatenated_norm(norm_type: float) -> None:
    gen = torch.Generator().manual_seed(0)
    grads = [
        torch.randn(5, 3, generator=gen),
        torch.randn(7, generator=gen).to(torch.bfloat16),
        torch.randn(4, generator=gen).double(),
        torch.randn(300, 300, generator=gen),  # large enough for the BLAS-dot path
        None,
    ]
    flat = torch.cat([g.double().flatten() for g in grads if g is not None])
    pows = norm_pows(grads, norm_type, CPU)
    assert pows.dtype == torch.float32 and pows.shape == (5,) and pows[4] == 0
    result = pows.max() if math.isinf(norm_type) else pows.sum()
    expected = flat.abs().max().item() if math.isinf(norm_type) else flat.abs().pow(norm_type).sum().item()
    # p-th powers of fp32 norms: the relative error grows with p (3e-5 at p = 3 here)
    assert result.item() == pytest.approx(expected, rel=1e-5 if norm_type in (1.0, 2.0, math.inf) else 1e-4)


def test_norm_pows_of_nothing_and_bad_norm_types() -> None:
    assert norm_pows([], 2.0, CPU).numel() == 0
    for bad in (0.0, 0.5, -2.0, True, "2"):
        with pytest.raises(ValueError, match="norm_type"):
            check_norm_type(bad)  # type: ignore[arg-type]


def test_norm_pows_propagate_non_finite() -> None:
    big = torch.ones(1 << 16)
    big[3] = math.inf
    assert math.isinf(norm_pows([torch.tensor([1.0, math.inf])], 2.0, CPU)[0].item())
    assert math.isnan(norm_pows([torch.tensor([1.0, math.nan])], 2.0, CPU)[0].item())
    assert math.isinf(norm_pows([big], 2.0, CPU)[0].item())


def test_clip_coefficient_is_megatrons_rule() -> None:
    assert clip_coefficient(10.0, 1.0) == pytest.approx(1.0 / (10.0 + 1e-6), rel=1e-12)
    assert clip_coefficient(0.5, 1.0) == 1.0  # below the limit: no clipping
    assert clip_coefficient(1.0, 1.0) < 1.0  # the eps tips an exact hit into clipping, as in Megatron
    with pytest.raises(ValueError, match="clip_grad"):
        clip_coefficient(1.0, 0.0)


def test_zero_count() -> None:
    grads = [torch.tensor([0.0, 1.0, -0.0]), torch.zeros(2, 2), torch.tensor([3.0]).to(torch.bfloat16)]
    assert zero_count(grads, CPU).item() == 6
    assert zero_count([], CPU).item() == 0


class _TwoRanks:
    """Stands in for a 2-rank group whose other rank holds the same values: records the ops asked for."""

    size, name = 2, "two"

    def __init__(self) -> None:
        self.ops: list[str] = []

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self.ops.append(op)
        return tensor.mul_(2) if op == "sum" else tensor


def _stage(params: list[torch.Tensor], tp_rank: int, comm: _TwoRanks) -> Stage:
    placement = Whole(reduce_over=[comm], tp_rank=tp_rank)
    return Stage([{"params": params}], lambda g: torch.optim.SGD(g, lr=0.1), placement=placement)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_a_stage_reduces_what_counts(norm_type: float) -> None:
    params = [_param(3), _param(2, shared=True), _param(4, tensor_model_parallel=False),
              _param(2, tensor_model_parallel=True)]
    grads = [torch.tensor([1.0, -2.0, 0.0]), torch.full((2,), 9.0), torch.full((4,), 0.5), torch.tensor([3.0, 4.0])]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    comm = _TwoRanks()
    stats = _stage(params, 1, comm).grad_stats(norm_type)  # tp rank 1: only the tensor-parallel split counts
    op = "max" if math.isinf(norm_type) else "sum"
    assert comm.ops == [op]
    local = 4.0 if math.isinf(norm_type) else 9 + 16
    assert _stage(params, 0, _TwoRanks()).grad_stats(norm_type)[0].item() == (
        4.0 if math.isinf(norm_type) else 2 * (1 + 4 + 4 * 0.25 + 25))  # tp rank 0: all but the shared one
    assert stats[0].item() == (local if math.isinf(norm_type) else 2 * local) and stats[1].item() == 0
    params[1].grad = torch.tensor([math.nan, 0.0])  # not counted in the norm, but checked for finiteness
    assert _stage(params, 1, _TwoRanks()).grad_stats(norm_type)[1].item() > 0


def test_a_stage_counts_zeros_over_the_group() -> None:
    params = [_param(3), _param(2, shared=True), _param(2)]
    params[0].grad, params[1].grad = torch.tensor([1.0, 0.0, 0.0]), torch.zeros(2)
    comm = _TwoRanks()
    stage = _stage(params, 0, comm)
    stage.grad_stats(2.0)
    assert stage.count_zeros().item() == 4 and comm.ops == ["sum", "sum"]
