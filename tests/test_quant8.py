"""8-bit block-quantized Adam moments (``algorithms/_quant8.py`` and AdamW's ``'8bit'`` moments): the maps,
the per-block round-trip error bound, exact re-quantization, the AdamW trajectory against fp32 moments,
state dicts across moment dtypes, bad input. (ZeRO-1 / layer-wise: ``tests/distributed/test_precision_memory.py``.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optstack.algorithms._quant8 import Q8, blocks_of, dequantize_, dynamic_map, quantize_, zeros_q8
from optstack.algorithms.adamw import AdamW
from optstack.config import AdamConfig, OptimizerConfig
from optstack.factory import build_optimizer


def _round_trip(values: torch.Tensor, block: int, sqrt: bool) -> tuple[Q8, torch.Tensor]:
    state = zeros_q8(values, block, sqrt=sqrt)
    padded = torch.zeros(blocks_of(values.numel(), block) * block)
    padded[: values.numel()] = values.reshape(-1)
    quantize_(state, padded)
    return state, dequantize_(state, torch.empty_like(padded)).clone()


def _wide(numel: int, seed: int, signed: bool) -> torch.Tensor:
    """Values spanning 8 decades, block maxima differing by 1000x, exact zeros."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=gen) * 10.0 ** torch.empty(numel).uniform_(-8, 0, generator=gen)
    values *= 10.0 ** torch.randint(-3, 1, (numel // 64 + 1,), generator=gen).repeat_interleave(64)[:numel]
    values[::37] = 0.0
    return values if signed else values.abs()


def test_dynamic_maps_hold_zero_and_the_block_maximum_exactly() -> None:
    signed, unsigned = torch.tensor(dynamic_map(True)), torch.tensor(dynamic_map(False))
    for table in (signed, unsigned):
        assert table.numel() == 256 and bool((table[1:] > table[:-1]).all()) and 0.0 in table and 1.0 in table
    assert signed[0] == -1.0 and (signed < 0).sum() == 127
    assert unsigned[0] == 0.0 and 0 < unsigned[1] < 1e-6  # the smallest non-zero value: ~3e-7 of the maximum
    # resolution grows with the exponent: the top decade's gaps are ~0.7% (unsigned) / ~1.4% (signed) of the max
    assert (unsigned[-2] - unsigned[-3]).item() == pytest.approx(0.9 / 128, rel=1e-5)
    assert signed[-2] - signed[-3] < 0.015


@pytest.mark.parametrize("sqrt", [False, True])
@pytest.mark.parametrize("numel, block", [(1000, 256), (4096, 64), (7, 256)])
def test_round_trip_error_is_at_most_half_a_map_gap_per_block(sqrt: bool, numel: int, block: int) -> None:
    values = _wide(numel, seed=numel + block, signed=not sqrt)
    state, back = _round_trip(values, block, sqrt)
    assert state.codes.dtype == torch.uint8 and state.scales.numel() == blocks_of(numel, block)
    stored = values.sqrt() if sqrt else values  # what the codes encode
    got = back[:numel].sqrt() if sqrt else back[:numel]
    padded = torch.zeros(state.scales.numel() * block)
    padded[:numel] = stored
    scales = padded.view(-1, block).abs().amax(1)
    assert torch.equal(state.scales, scales)  # each block's scale is its absolute maximum
    scale = scales.repeat_interleave(block)[:numel]
    table = torch.tensor(dynamic_map(not sqrt))
    normalized = stored / scale.clamp_min(1e-38)
    upper = torch.bucketize(normalized, table).clamp(1, 255)  # the map entries around each value
    gap = table[upper] - table[upper - 1]
    bound = 0.5 * gap * scale * (1 + 1e-5) + 1e-30
    assert bool(((got - stored).abs() <= bound).all())
    assert bool((back[:numel][values == 0] == 0).all()) and bool((back[numel:] == 0).all())  # zeros, zero padding
    # a block's maximum is held exactly
    top = padded.view(-1, block).abs().argmax(1) + torch.arange(state.scales.numel()) * block
    top = top[top < numel]
    assert torch.equal(got[top].abs(), stored[top].abs())


@pytest.mark.parametrize("sqrt", [False, True])
def test_quantizing_dequantized_values_again_is_exact(sqrt: bool) -> None:
    values = _wide(1000, seed=3, signed=not sqrt)
    first, back = _round_trip(values, 256, sqrt)
    again, _ = _round_trip(back[:1000], 256, sqrt)
    assert torch.equal(first.codes, again.codes) and torch.equal(first.scales, again.scales)


def _train(moments: str, steps: int = 25, **config) -> tuple[list[torch.Tensor], nn.Module, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 64), nn.Tanh(), nn.Linear(64, 8))
    built = build_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, adam=AdamConfig(
        exp_avg_dtype=moments, exp_avg_sq_dtype=moments), **config), model)
    start = [p.detach().clone() for p in model.parameters()]
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, 24, generator=gen), torch.randn(32, 8, generator=gen)
        ((model(x) - y) ** 2).mean().backward()
        built.optimizer.step()
        built.optimizer.zero_grad()
    return start, model, built


def test_adamw_with_8bit_moments_tracks_fp32_moments() -> None:
    """Per step, 8-bit moments change the update ``m / sqrt(v)`` of an element by the relative error of its
    codes: at most half a map gap, i.e. 0.35-0.7% for values near their block's maximum, up to ~7% at the
    bottom of a decade (the fraction is linear inside a decade), so typically a few percent. The errors do
    not compound (each step re-reads the gradient): over 25 steps the parameters should stay within a few
    percent of the distance they travelled from the fp32-moment run's (measured: 2.5%; bf16 moments, 8
    significant bits everywhere: 0.3%). The bound is 5%: twice the measured drift, and far below what a
    broken map or scale would give (a code off by one block scale moves updates by O(1))."""
    start, reference, _ = _train("fp32")
    drift = {}
    for moments in ("8bit", "bf16"):
        _, model, _ = _train(moments)
        moved = sum((p - s).norm() ** 2 for p, s in zip(reference.parameters(), start, strict=True)) ** 0.5
        apart = sum((p - q).norm() ** 2 for p, q in zip(model.parameters(), reference.parameters(),
                                                          strict=True)) ** 0.5
        drift[moments] = (apart / moved).item()
    assert 0 < drift["bf16"] < drift["8bit"] < 0.05, drift


def test_8bit_state_is_exported_as_fp32_and_loads_into_any_moment_dtype() -> None:
    _, model, built = _train("8bit", steps=5)
    stage = built.optimizer.stages[0]
    inner = stage.optimizer
    live = inner.state[stage._stepped[0]]
    assert {"exp_avg_codes", "exp_avg_scales", "exp_avg_sq_sqrt_codes", "exp_avg_sq_sqrt_scales"} <= live.keys()
    assert live["exp_avg_codes"].dtype == torch.uint8 and live["exp_avg_scales"].numel() == blocks_of(24 * 64, 256)
    saved = built.optimizer.state_dict()
    entry = saved["state"][0]
    assert entry["exp_avg"].dtype == entry["exp_avg_sq"].dtype == torch.float32  # the portable form
    assert "exp_avg_codes" not in entry
    # into fp32 moments: the dequantized values, exactly; back into 8-bit: the same codes, exactly
    for moments in ("fp32", "8bit"):
        _, _, other = _train(moments, steps=1)
        other.optimizer.load_state_dict(saved)
        got = other.optimizer.state_dict()["state"][0]
        assert all(torch.equal(got[k], entry[k]) for k in ("exp_avg", "exp_avg_sq")), moments
        if moments == "8bit":
            mine = other.optimizer.stages[0].optimizer.state[other.optimizer.stages[0]._stepped[0]]
            assert all(torch.equal(mine[k], live[k]) for k in live if k != "step")
    # an fp32-moment state loads into 8-bit moments within the quantization error
    _, _, plain = _train("fp32", steps=5)
    _, _, quantized = _train("8bit", steps=1)
    quantized.optimizer.load_state_dict(plain.optimizer.state_dict())
    want, got = plain.optimizer.state_dict()["state"][0], quantized.optimizer.state_dict()["state"][0]
    for key in ("exp_avg", "exp_avg_sq"):
        scale = want[key].abs().max()
        assert (got[key] - want[key]).abs().max() <= 0.02 * scale  # about half a gap of the top decade
    # torch's own AdamW takes the exported state
    params = [p for g in built.optimizer.param_groups for p in g["params"]]
    torch_adamw = torch.optim.AdamW([{"params": [params[i] for i in g["params"]]} for g in saved["param_groups"]])
    torch_adamw.load_state_dict({"state": saved["state"], "param_groups": [
        {**{k: v for k, v in g.items() if k in ("lr", "betas", "eps", "weight_decay")}, "params": g["params"]}
        for g in saved["param_groups"]]})
    assert torch.equal(torch_adamw.state[params[0]]["exp_avg"], entry["exp_avg"])


def test_raw_8bit_state_dicts_load_with_another_block_size() -> None:
    params = [torch.randn(300, requires_grad=True)]
    first = AdamW(params, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8, block_size=64)
    params[0].grad = torch.randn(300)
    first.step()
    second = AdamW(params, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8, block_size=256)
    second.load_state_dict(first.state_dict())  # raw codes of 64-blocks, read and quantized into 256-blocks
    assert second.state[params[0]]["exp_avg_scales"].numel() == 2
    want, got = first.exported_state(params[0]), second.exported_state(params[0])
    assert (got["exp_avg"] - want["exp_avg"]).abs().max() <= 0.02 * want["exp_avg"].abs().max()


@pytest.mark.parametrize("impl", ["reference", "foreach", "fused"])
def test_every_path_steps_8bit_moments_alike(impl: str) -> None:
    results = []
    for path in ("fused", impl):
        torch.manual_seed(0)
        params = [torch.randn(70, 5), torch.randn(300)]
        opt = AdamW([{"params": params, "lr": 1e-2}], exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8,
                    impl=path, block_size=64)
        for step in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            opt.step()
        results.append(params)
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_8bit_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match=r"adam.exp_avg_dtype='8bit' quantizes Adam's moments, but algorithm='sgd'"):
        OptimizerConfig(algorithm="sgd", adam=AdamConfig(exp_avg_dtype="8bit"))
    with pytest.raises(ValueError, match=r"adam.block_size must be a power of two"):
        AdamConfig(exp_avg_dtype="8bit", block_size=100)
    with pytest.raises(ValueError, match=r"adam.exp_avg_sq_dtype must be one of"):
        AdamConfig(exp_avg_sq_dtype="int8")
    with pytest.raises(ValueError, match=r"block_size must be a power of two"):
        AdamW([torch.zeros(3)], exp_avg_dtype=torch.uint8, block_size=8)
    weight = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    opt = AdamW([{"params": [weight], "param_names": ["head.weight"]}], exp_avg_dtype=torch.uint8)
    weight.grad = torch.ones(4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"parameter 'head.weight' is torch.float64"):
        opt.step()


def test_cpu_offload_steps_8bit_moments_like_the_device() -> None:
    from optstack.config import OffloadConfig

    _, plain, plain_built = _train("8bit", steps=4)
    _, hybrid, hybrid_built = _train("8bit", steps=4, offload=OffloadConfig(enabled=True, fraction=0.8))
    assert hybrid_built.optimizer.stages[0].optimizer.offloaded  # some tensors are stepped on the host
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), hybrid.parameters(), strict=True))
    want, got = plain_built.optimizer.state_dict()["state"], hybrid_built.optimizer.state_dict()["state"]
    assert all(torch.equal(want[i][k], got[i][k]) for i in want for k in ("exp_avg", "exp_avg_sq"))
