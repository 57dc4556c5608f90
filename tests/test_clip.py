"""Gradient statistics: which grads count, the local norm power, the clip factor, the zero count."""

from __future__ import annotations

import math

import pytest
import torch

from optstack.clip import (
    check_norm_type,
    clip_coefficient,
    count_zeros,
    grads_for_norm,
    local_norm_pow,
    reduced_norm_pow,
    reduced_zero_count,
)


def _param(*shape: int, **attrs: bool) -> torch.Tensor:
    param = torch.zeros(*shape)
    for key, value in attrs.items():
        setattr(param, key, value)  # what a Megatron-style model puts on its params
    return param


def test_grads_for_norm_excludes_shared_and_tensor_parallel_duplicates() -> None:
    plain = _param(2)
    split = _param(2, tensor_model_parallel=True)
    replicated = _param(2, tensor_model_parallel=False)
    shared = _param(2, shared=True)
    no_grad = _param(2)
    params = [plain, split, replicated, shared, no_grad]
    grads = [torch.full((2,), float(i)) for i in range(4)] + [None]
    on_rank0 = grads_for_norm(params, grads, tp_rank=0)
    on_rank1 = grads_for_norm(params, grads, tp_rank=1)
    assert [g[0].item() for g in on_rank0] == [0.0, 1.0, 2.0]  # shared never, missing grad never
    assert [g[0].item() for g in on_rank1] == [1.0]  # only the tensor-parallel split param
    with pytest.raises(ValueError, match="parallel lists"):
        grads_for_norm(params, grads[:2], tp_rank=0)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_local_norm_pow_matches_concatenated_norm(norm_type: float) -> None:
    gen = torch.Generator().manual_seed(0)
    grads = [
        torch.randn(5, 3, generator=gen),
        torch.randn(7, generator=gen).to(torch.bfloat16),
        torch.randn(4, generator=gen).double(),
        torch.randn(2, 2, generator=gen),
    ]
    flat = torch.cat([g.double().flatten() for g in grads])
    result = local_norm_pow(grads, norm_type)
    assert result.dtype == torch.float32 and result.dim() == 0
    if math.isinf(norm_type):
        expected = flat.abs().max().item()
    else:
        expected = flat.abs().pow(norm_type).sum().item()
    assert result.item() == pytest.approx(expected, rel=1e-5)


def test_local_norm_pow_of_nothing_is_zero_and_bad_norm_type_is_refused() -> None:
    assert local_norm_pow([], 2.0).item() == 0.0
    assert local_norm_pow([], math.inf).item() == 0.0
    for bad in (0.0, -2.0, True, "2"):
        with pytest.raises(ValueError, match="norm_type"):
            check_norm_type(bad)  # type: ignore[arg-type]


def test_local_norm_pow_propagates_non_finite() -> None:
    assert math.isinf(local_norm_pow([torch.tensor([1.0, math.inf])], 2.0).item())
    assert math.isnan(local_norm_pow([torch.tensor([1.0, math.nan])], 2.0).item())


def test_clip_coefficient_is_megatrons_rule() -> None:
    assert clip_coefficient(10.0, 1.0) == pytest.approx(1.0 / (10.0 + 1e-6), rel=1e-12)
    assert clip_coefficient(0.5, 1.0) == 1.0  # below the limit: no clipping
    assert clip_coefficient(1.0, 1.0) < 1.0  # the eps tips an exact hit into clipping, as in Megatron
    with pytest.raises(ValueError, match="clip_grad"):
        clip_coefficient(1.0, 0.0)


def test_count_zeros() -> None:
    grads = [torch.tensor([0.0, 1.0, -0.0]), torch.zeros(2, 2), torch.tensor([3.0]).to(torch.bfloat16)]
    assert count_zeros(grads) == 6
    assert count_zeros([]) == 0


class _TwoRanks:
    """Stands in for a 2-rank group whose other rank holds the same values: records the ops asked for."""

    def __init__(self) -> None:
        self.ops: list[str] = []

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self.ops.append(op)
        return tensor.mul_(2) if op == "sum" else tensor


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_reduced_norm_pow_counts_what_grads_for_norm_keeps_and_reduces(norm_type: float) -> None:
    params = [_param(3), _param(2, shared=True), _param(4, tensor_model_parallel=False)]
    grads = [torch.tensor([1.0, -2.0, 0.0]), torch.full((2,), 9.0), torch.full((4,), 0.5)]
    comm = _TwoRanks()
    got = reduced_norm_pow(params, grads, norm_type, tp_rank=1, device=torch.device("cpu"), comm=comm)
    local = local_norm_pow(grads_for_norm(params, grads, tp_rank=1), norm_type)
    assert comm.ops == ["max" if math.isinf(norm_type) else "sum"]
    assert got.item() == (local.item() if math.isinf(norm_type) else 2 * local.item())


def test_reduced_zero_count_sums_over_the_group() -> None:
    params = [_param(3), _param(2, shared=True), _param(2)]
    grads = [torch.tensor([1.0, 0.0, 0.0]), torch.zeros(2), None]
    comm = _TwoRanks()
    assert reduced_zero_count(params, grads, tp_rank=0, device=torch.device("cpu"), comm=comm) == 4
    assert comm.ops == ["sum"]
    assert reduced_zero_count([], [], tp_rank=0, device=torch.device("cpu"), comm=comm) == 0
