"""Flat runs of back-to-back tensors (coalesce, zeros_in_runs) and the shared hyperparameter checks."""

from __future__ import annotations

import pytest
import torch

from optstack.algorithms._common import check_betas, check_min, coalesce, resolve_impl, zeros_in_runs


def test_back_to_back_views_merge_in_storage_order() -> None:
    flat, grad = torch.arange(10.0), torch.arange(10.0) * 10
    params, grads = list(flat.split([3, 3, 4])), list(grad.split([3, 3, 4]))
    merged, firsts = coalesce([params[::-1], grads[::-1]])  # the list order does not matter
    assert len(merged[0]) == 1 and firsts == [2]  # entry 2 of the reversed list is the first in storage
    assert torch.equal(merged[0][0], flat) and torch.equal(merged[1][0], grad)
    merged[0][0].add_(1)  # a view: writes reach the original tensors
    assert params[0][0].item() == 1


def test_nothing_to_merge_returns_the_same_objects() -> None:
    a, b = torch.zeros(3), torch.zeros(3)
    merged, firsts = coalesce([[a, b]])
    assert merged[0][0] is a and merged[0][1] is b and firsts == [0, 1]


def test_runs_break_where_any_list_breaks() -> None:
    flat = torch.zeros(12)
    params = list(flat.split(4))
    state = [torch.zeros(4), *torch.zeros(8).split(4)]  # entry 0's state lives elsewhere
    merged, firsts = coalesce([params, state])
    assert [t.numel() for t in merged[0]] == [4, 8] and firsts == [0, 1]


def test_different_keys_do_not_merge() -> None:
    params = list(torch.zeros(8).split(4))
    merged, _ = coalesce([params], keys=[1.0, 2.0])
    assert len(merged[0]) == 2


def test_non_contiguous_tensors_do_not_merge() -> None:
    flat = torch.zeros(8)
    matrix = flat[:4].view(2, 2).t()  # same memory, column-major order
    merged, _ = coalesce([[matrix, flat[4:]]])
    assert merged[0][0] is matrix


def test_separate_storages_do_not_merge_even_when_adjacent() -> None:
    memory = memoryview(bytearray(32))
    a = torch.frombuffer(memory[:16], dtype=torch.float32)  # two storages, adjacent addresses
    b = torch.frombuffer(memory[16:], dtype=torch.float32)
    assert a.data_ptr() + a.nbytes == b.data_ptr()
    assert len(coalesce([[a, b]])[0][0]) == 2


def test_zeros_in_runs_lays_out_state_like_the_params() -> None:
    flat = torch.zeros(10)
    views = list(flat.split([4, 6]))
    lone = torch.zeros(2, 3).t()
    state = zeros_in_runs([views[1], lone, views[0]], torch.bfloat16)
    assert [s.shape for s in state] == [(6,), (3, 2), (4,)]
    assert all(s.dtype == torch.bfloat16 and not s.any() for s in state)
    assert state[2].data_ptr() + state[2].nbytes == state[0].data_ptr()  # back to back, like the views
    assert state[1].stride() == lone.stride()


def test_resolve_impl() -> None:
    assert resolve_impl("auto", torch.device("cpu"), has_fused=True) == "fused"
    assert resolve_impl("auto", torch.device("cpu"), has_fused=False) == "foreach"
    assert resolve_impl("auto", torch.device("meta"), has_fused=True) == "foreach"
    assert resolve_impl("reference", torch.device("cpu"), has_fused=True) == "reference"


@pytest.mark.parametrize("value", [-1.0, float("nan"), "0.1", None])
def test_check_min_rejects(value: object) -> None:
    with pytest.raises(ValueError, match="X param group 3: lr must be a number >= 0"):
        check_min("X", 3, {"lr": value}, "lr")


def test_check_betas_accepts_tensors_and_lists() -> None:
    check_betas("X", 0, {"betas": [torch.tensor(0.9), 0.0]})
    with pytest.raises(ValueError, match=r"betas\[0\]"):
        check_betas("X", 0, {"betas": (torch.tensor(1.5), 0.9)})
