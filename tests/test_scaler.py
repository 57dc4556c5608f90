"""Loss scalers: Megatron's dynamic-scaling sequence step by step, validation, state round trips."""

from __future__ import annotations

import pytest
import torch

from optstack.precision.scaler import ConstantScaler, DynamicScaler, LossScaler, NoScaler, make_scaler


def _run(scaler: DynamicScaler, found_infs: list[bool]) -> list[tuple[float, int, int]]:
    out = []
    for found_inf in found_infs:
        scaler.update(found_inf)
        out.append((scaler.scale, scaler.growth_tracker, scaler.hysteresis_tracker))
    return out


def test_no_scaler_is_identity() -> None:
    scaler = NoScaler()
    loss = torch.tensor(3.0)
    assert scaler.scale == 1.0 and scaler.inv_scale == 1.0
    assert scaler.scale_loss(loss) is loss
    scaler.update(True)
    assert scaler.scale == 1.0
    assert scaler.state_dict() == {"kind": "none"}


def test_constant_scaler_never_changes() -> None:
    scaler = ConstantScaler(128.0)
    assert scaler.scale_loss(torch.tensor(2.0)).item() == 256.0
    assert scaler.inv_scale == 1 / 128
    for found_inf in (True, True, False, True):
        scaler.update(found_inf)
    assert scaler.scale == 128.0


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_constant_scaler_rejects_bad_scale(bad: float) -> None:
    with pytest.raises(ValueError, match="scale"):
        ConstantScaler(bad)


def test_dynamic_hysteresis_then_backoff_then_growth() -> None:
    scaler = DynamicScaler(initial_scale=1024.0, growth_interval=3, hysteresis=2)
    assert (scaler.scale, scaler.growth_tracker, scaler.hysteresis_tracker) == (1024.0, 0, 2)
    steps = [True, True, True, False, False, False, True, False, True]
    assert _run(scaler, steps) == [
        (1024.0, 0, 1),  # first overflow: hysteresis absorbs it, scale kept
        (512.0, 0, 0),  # second: hysteresis used up, back off
        (256.0, 0, -1),  # tracker stays spent: every further overflow backs off at once
        (256.0, 1, -1),
        (256.0, 2, -1),
        (512.0, 0, 2),  # growth_interval clean steps: grow and reset both trackers
        (512.0, 0, 1),
        (512.0, 1, 1),  # a clean step does not restore hysteresis (only growth does)
        (256.0, 0, 0),
    ]


def test_dynamic_growth_exactly_at_window() -> None:
    scaler = DynamicScaler(initial_scale=4.0, growth_interval=5)
    scales = [s for s, _, _ in _run(scaler, [False] * 10)]
    assert scales == [4.0] * 4 + [8.0] + [8.0] * 4 + [16.0]


def test_dynamic_backoff_clamps_at_min_scale() -> None:
    scaler = DynamicScaler(initial_scale=8.0, min_scale=2.0, hysteresis=1)
    assert [s for s, _, _ in _run(scaler, [True] * 4)] == [4.0, 2.0, 2.0, 2.0]


def test_dynamic_defaults_match_megatron() -> None:
    scaler = DynamicScaler()
    assert scaler.scale == 2.0**32 and scaler.min_scale == 1.0
    assert (scaler.growth_factor, scaler.backoff_factor) == (2.0, 0.5)
    assert (scaler.growth_interval, scaler.hysteresis) == (1000, 2)
    assert scaler.inv_scale == 2.0**-32


def test_dynamic_scale_is_fp32_like_megatrons_tensor() -> None:
    # Megatron multiplies fp32 tensors; a non-power-of-two factor must round the same way.
    scaler = DynamicScaler(initial_scale=3.0, backoff_factor=0.3, min_scale=1e-3, hysteresis=1)
    expected = torch.tensor([3.0], dtype=torch.float32)
    for _ in range(4):
        scaler.update(True)
        expected = torch.max(expected * torch.tensor([0.3]), torch.tensor([1e-3]))
        assert scaler.scale == expected.item()
    assert scaler.inv_scale == expected.double().reciprocal().float().item()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("initial_scale", 0.0),
        ("initial_scale", float("inf")),
        ("min_scale", -1.0),
        ("min_scale", 2.0**40),  # above initial_scale
        ("growth_factor", 1.0),
        ("backoff_factor", 1.0),
        ("backoff_factor", 0.0),
        ("growth_interval", 0),
        ("growth_interval", 2.5),
        ("hysteresis", 0),
        ("hysteresis", True),
    ],
)
def test_dynamic_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        DynamicScaler(**{field: value})


def test_dynamic_state_round_trip_continues_identically() -> None:
    first = DynamicScaler(initial_scale=64.0, growth_interval=3, hysteresis=2)
    _run(first, [True, False, False])
    restored = DynamicScaler(initial_scale=1.0, growth_interval=3, hysteresis=2)
    restored.load_state_dict(first.state_dict())
    tail = [False, True, True, False, False, False]
    assert _run(restored, tail) == _run(first, tail)


def test_state_of_another_kind_is_refused_and_changes_nothing() -> None:
    scaler = DynamicScaler(initial_scale=64.0)
    before = scaler.state_dict()
    with pytest.raises(ValueError, match="'constant' scaler"):
        scaler.load_state_dict(ConstantScaler(2.0).state_dict())
    with pytest.raises(ValueError, match="growth_tracker"):
        scaler.load_state_dict({**before, "scale": 8.0, "growth_tracker": "x"})
    assert scaler.state_dict() == before


def test_make_scaler() -> None:
    assert isinstance(make_scaler("none"), NoScaler)
    assert make_scaler("constant", scale=8.0).scale == 8.0
    dynamic = make_scaler("dynamic", initial_scale=16.0, hysteresis=1)
    assert isinstance(dynamic, DynamicScaler) and dynamic.scale == 16.0
    assert all(isinstance(s, LossScaler) for s in (make_scaler("none"), dynamic))
    with pytest.raises(ValueError, match="one of"):
        make_scaler("bf16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dynamic"):
        make_scaler("dynamic", window=10)
    with pytest.raises(ValueError, match="none"):
        make_scaler("none", scale=2.0)
