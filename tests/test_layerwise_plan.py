"""The layer-wise assignment (pure, no processes): balance, determinism, edge cases, bad input."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optstack.stage import assign_params, newton_schulz_cost


def _loads(costs: list[float], owners: list[int], dp_size: int) -> list[float]:
    loads = [0.0] * dp_size
    for cost, owner in zip(costs, owners, strict=True):
        loads[owner] += cost
    return loads


def test_newton_schulz_cost_grows_with_the_small_side_squared() -> None:
    assert newton_schulz_cost((1024, 256)) == 1024 * 256**2
    assert newton_schulz_cost((256, 1024)) == newton_schulz_cost((1024, 256))  # transposes cost the same
    assert newton_schulz_cost((512, 512)) > newton_schulz_cost((1024, 256))  # same numel, squarer is dearer
    assert newton_schulz_cost((7,)) == 7.0  # element-wise updates: one unit per element
    assert newton_schulz_cost((2, 3, 4)) == 2 * newton_schulz_cost((3, 4))  # a stack: one NS per matrix
    assert newton_schulz_cost((2, 3, 4, 5)) == 120.0


def test_example_largest_first_to_the_least_loaded() -> None:
    # 9 -> r0; 7 -> r1; 5 -> r1 (7 < 9); 4 -> r0 (9 < 12); 3 -> r1 (12 < 13)
    assert assign_params([4, 9, 5, 7, 3], 2) == [0, 0, 1, 1, 1]
    assert _loads([4, 9, 5, 7, 3], [0, 0, 1, 1, 1], 2) == [13, 15]


def test_ties_go_to_the_earlier_parameter_and_the_lower_rank() -> None:
    assert assign_params([1.0, 1.0, 1.0, 1.0], 2) == [0, 1, 0, 1]
    assert assign_params([5.0, 5.0, 5.0], 3) == [0, 1, 2]


def test_more_ranks_than_parameters_leaves_ranks_empty() -> None:
    assert assign_params([2.0, 8.0], 4) == [1, 0]
    assert assign_params([], 3) == []


def test_one_rank_owns_everything() -> None:
    assert assign_params([3.0, 1.0, 2.0], 1) == [0, 0, 0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1e6, allow_nan=False), max_size=40), st.integers(1, 8))
def test_balanced_and_deterministic(costs: list[float], dp_size: int) -> None:
    owners = assign_params(costs, dp_size)
    assert owners == assign_params(list(costs), dp_size)  # the same plan on every rank
    assert all(0 <= o < dp_size for o in owners)
    loads = _loads(costs, owners, dp_size)
    # greedy largest-first: no rank exceeds the average by more than the largest single cost
    bound = sum(costs) / dp_size + (max(costs) if costs else 0.0)
    assert max(loads) <= bound * (1 + 1e-12) + 1e-9


def test_muon_like_model_is_balanced_within_ten_percent() -> None:
    shapes = [(3 * 512, 512), (512, 512), (2048, 512), (512, 2048)] * 6  # qkv, proj, fc1, fc2 of 6 layers
    costs = [newton_schulz_cost(s) for s in shapes]
    loads = _loads(costs, assign_params(costs, 4), 4)
    assert max(loads) / (sum(costs) / 4) < 1.10


@pytest.mark.parametrize(("costs", "dp_size", "match"), [
    ([1.0], 0, "dp_size must be an int >= 1, got 0"),
    ([1.0], 2.0, "dp_size must be an int >= 1"),
    ([1.0, -1.0], 2, r"costs\[1\] must be a finite number >= 0, got -1.0"),
    ([float("nan")], 2, r"costs\[0\] must be a finite number >= 0"),
    ([float("inf")], 2, r"costs\[0\] must be a finite number >= 0"),
    (["big"], 2, r"costs\[0\] must be a finite number >= 0, got 'big'"),
])
def test_bad_input(costs: list, dp_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        assign_params(costs, dp_size)
