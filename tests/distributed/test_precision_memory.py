"""Precision-aware state on real gloo ranks: remainder-held masters step bit for bit like whole fp32 masters
under ZeRO-1 and layer-wise sharding; their checkpoints reshard to one process and load into fp32 masters;
``offload_states`` / ``reload_states`` under ZeRO-1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

_ALGORITHM = {"zero1": "adamw", "layerwise": "muon"}


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).bfloat16()


def _config(sharding: str, remainders: bool, algorithm: str):
    from optstack.config import DistributedConfig, MastersConfig, OptimizerConfig

    return OptimizerConfig(algorithm=algorithm, lr=1e-2, weight_decay=0.1,
                           precision="bf16", masters=MastersConfig(store_remainders=remainders),
                           distributed=DistributedConfig(sharding=sharding, bucket_size=200))


def _train(model, optimizer, steps: range, world: int = 1, rank: int = 0) -> list[float]:
    import torch

    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y)
        loss.backward()
        optimizer.step()
        assert optimizer.last_result.applied
        optimizer.finish_param_sync()
        losses.append(loss.item())
    return losses


def remainders_like_masters(sharding: str, root: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from optstack.checkpoint import save_checkpoint
    from optstack.factory import build_optimizer, wrap_data_parallel
    from optstack.offload.states import scratch_of

    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict[str, Any] = {}
    for remainders in (False, True):
        config = _config(sharding, remainders, _ALGORITHM[sharding])
        model = _model()
        wrapped = wrap_data_parallel(config, model)
        optimizer = build_optimizer(config, wrapped).optimizer
        losses = _train(wrapped, optimizer, range(4), world, rank)
        if remainders and sharding == "zero1":  # offload between steps: the next steps are unchanged
            moved = optimizer.offload_states()
            assert moved > 0 and all(t.untyped_storage().nbytes() == 0 for t in optimizer.stages[0].precision.held())
            scratch = [t for s in optimizer.stages for t in s.precision.scratch() + scratch_of(s.optimizer)]
            assert scratch and all(t.untyped_storage().nbytes() == 0 for t in scratch)  # fp32 grad copies too
            optimizer.reload_states()
        losses += _train(wrapped, optimizer, range(4, 6), world, rank)
        save_checkpoint(f"{root}/{'remainders' if remainders else 'masters'}", optimizer, step=6)
        out[str(remainders)] = {
            "losses": losses,
            "kinds": [s.kind for s in optimizer.stages],
            "masters": [m.view(torch.int32).clone() for s in optimizer.stages for m in s.master_params],
            "params": [p.detach().clone() for p in model.parameters()],
        }
    if sharding == "zero1":  # bf16 parameters stepped directly (stochastic rounding), bf16 moments and grads
        from dataclasses import replace

        from optstack.config import AdamConfig, MastersConfig

        config = replace(_config(sharding, False, "adamw"), masters=MastersConfig(
            dtype="bf16", stochastic_rounding=True, grad_dtype="bf16"), adam=AdamConfig(exp_avg_dtype="bf16"))
        model = _model()
        wrapped = wrap_data_parallel(config, model)
        optimizer = build_optimizer(config, wrapped).optimizer
        out["direct"] = {"losses": _train(wrapped, optimizer, range(6), world, rank),
                         "kinds": [s.kind for s in optimizer.stages], "masters": optimizer.stages[0].master_params}
    return out


@pytest.mark.parametrize("sharding", ["zero1", "layerwise"])
def test_remainders_step_like_fp32_masters_and_reshard(world2, tmp_path: Path, sharding: str) -> None:
    import torch

    from optstack.checkpoint import load_checkpoint
    from optstack.factory import build_optimizer

    for rank in world2.run(remainders_like_masters, sharding, str(tmp_path)):
        masters, remainders = rank["False"], rank["True"]
        assert remainders["kinds"][0] == f"{sharding}+remainders" and masters["kinds"][0] == f"{sharding}+masters"
        assert remainders["losses"] == masters["losses"]
        assert len(remainders["masters"]) == len(masters["masters"]) > 0
        assert all(torch.equal(a, b) for a, b in zip(remainders["masters"], masters["masters"], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(remainders["params"], masters["params"], strict=True))
        if "direct" in rank:
            direct = rank["direct"]
            assert direct["kinds"] == ["zero1+direct"] and direct["masters"] == []
            assert abs(direct["losses"][-1] - masters["losses"][5]) < 0.1 * masters["losses"][5]
    # one process, replicated: the remainder checkpoint loads into whole fp32 masters and back, exactly
    loaded = {}
    for saved, remainders in (("remainders", False), ("masters", True), ("remainders", True)):
        model = _model()
        optimizer = build_optimizer(_config("replicated", remainders, _ALGORITHM[sharding]), model).optimizer
        load_checkpoint(tmp_path / saved, optimizer, model=None)
        loaded[saved, remainders] = [m.view(torch.int32) for s in optimizer.stages for m in s.master_params]
    first, *others = loaded.values()
    assert all(torch.equal(a, b) for other in others for a, b in zip(first, other, strict=True))


def _config_8bit(sharding: str, moments: str, algorithm: str = ""):
    from dataclasses import replace

    from optstack.config import AdamConfig

    config = _config(sharding, False, algorithm or _ALGORITHM[sharding])  # layer-wise: Muon + 8-bit AdamW
    return replace(config, adam=AdamConfig(exp_avg_dtype=moments, exp_avg_sq_dtype=moments, block_size=16))


def eight_bit_moments(sharding: str, root: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from optstack.checkpoint import save_checkpoint
    from optstack.factory import build_optimizer, wrap_data_parallel

    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict[str, Any] = {}
    for moments in ("fp32", "8bit"):
        config = _config_8bit(sharding, moments)
        model = _model()
        wrapped = wrap_data_parallel(config, model)
        optimizer = build_optimizer(config, wrapped).optimizer
        losses = _train(wrapped, optimizer, range(4), world, rank)
        if moments == "8bit":  # offload between steps: the codes and scales come back bit for bit
            codes = [t.clone() for s in optimizer.stages for st in s.optimizer.state.values() for t in st.values()]
            optimizer.offload_states()
            optimizer.reload_states()
            assert all(torch.equal(a, b) for a, b in zip(codes, [t for s in optimizer.stages for st in
                                                                 s.optimizer.state.values() for t in st.values()],
                                                         strict=True))
            out["keys"] = sorted({k for s in optimizer.stages for st in s.optimizer.state.values() for k in st})
        losses += _train(wrapped, optimizer, range(4, 6), world, rank)
        save_checkpoint(f"{root}/{moments}", optimizer, step=6)
        out[moments] = losses
    return out


@pytest.mark.parametrize("sharding", ["zero1", "layerwise"])
def test_8bit_moments_shard_track_fp32_and_reshard(world2, tmp_path: Path, sharding: str) -> None:
    import torch

    from optstack.checkpoint import load_checkpoint
    from optstack.factory import build_optimizer

    for rank in world2.run(eight_bit_moments, sharding, str(tmp_path)):
        assert "exp_avg_codes" in rank["keys"] and "exp_avg_sq_sqrt_scales" in rank["keys"]
        assert rank["8bit"] != rank["fp32"]  # really quantized
        assert abs(rank["8bit"][-1] - rank["fp32"][-1]) < 0.05 * rank["fp32"][-1]
    # one process, replicated: the 8-bit checkpoint (fp32 moments on disk) loads into fp32 and 8-bit moments
    states = {}
    for moments in ("fp32", "8bit"):
        model = _model()
        optimizer = build_optimizer(_config_8bit("replicated", moments, _ALGORITHM[sharding]), model).optimizer
        load_checkpoint(tmp_path / "8bit", optimizer, model=None)
        states[moments] = optimizer.state_dict()["state"]
    assert states["fp32"].keys() == states["8bit"].keys()
    adam = [index for index, entry in states["fp32"].items() if "exp_avg" in entry]  # (Muon's: momentum_buffer)
    assert len(adam) >= 3
    for index in adam:
        want, got = states["fp32"][index], states["8bit"][index]
        for key in ("exp_avg", "exp_avg_sq"):  # requantized in this layout's blocks: within the 8-bit error
            assert want[key].dtype == got[key].dtype == torch.float32
            assert (got[key] - want[key]).abs().max() <= 0.02 * want[key].abs().max(), (index, key)
