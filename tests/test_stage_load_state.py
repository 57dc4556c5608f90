"""Loading name-keyed state into a stage's inner optimizer gives the state torch's ``load_state_dict`` gives
(values, dtypes, devices, ``step``), for each inner algorithm; the stage sets it directly (linear time)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from optstack.algorithms import SGD, AdamW, Lion, Muon
from optstack.protocol import ParamShard
from optstack.stage import Stage, replicated_stage

ALGORITHMS: dict[str, Callable[[list[dict]], torch.optim.Optimizer]] = {
    "adamw": lambda groups: AdamW(groups, lr=1e-2, weight_decay=0.1),
    "adamw_bf16_moments": lambda groups: AdamW(groups, lr=1e-2, exp_avg_dtype=torch.bfloat16,
                                               exp_avg_sq_dtype=torch.bfloat16),
    "sgd_momentum": lambda groups: SGD(groups, lr=0.1, momentum=0.9),
    "lion": lambda groups: Lion(groups, lr=1e-3, weight_decay=0.1),
    "muon": lambda groups: Muon(groups, lr=0.02),
    "torch_adam": lambda groups: torch.optim.Adam(groups, lr=1e-2),
    "torch_adam_fused": lambda groups: torch.optim.Adam(groups, lr=1e-2, fused=True),
}


def _stage(make: Callable[[list[dict]], torch.optim.Optimizer], seed: int = 0) -> Stage:
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((6, 4), (3, 5), (4, 4))]
    groups = [{"params": params[:2], "param_names": ["a", "b"]}, {"params": params[2:], "param_names": ["c"]}]
    return replicated_stage(groups, make, masters=False)


def _stepped(make: Callable[[list[dict]], torch.optim.Optimizer]) -> Stage:
    stage = _stage(make)
    for _ in range(2):
        for group in stage.param_groups:
            for p in group["params"]:
                p.grad = torch.randn_like(p)
        stage.step()
    return stage


def _torch_loaded(make: Callable[[list[dict]], torch.optim.Optimizer],
                  shards: dict[str, ParamShard]) -> torch.optim.Optimizer:
    """A fresh stage's inner optimizer after torch's own ``load_state_dict`` of ``shards``."""
    optimizer = _stage(make, seed=1).optimizer
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = optimizer.state_dict()
    saved["state"] = {i: {**{k: v.view(p.shape).clone() for k, v in shard.tensors.items() if k != "param"},
                          **shard.scalars}
                      for i, (p, shard) in enumerate(zip(params, shards.values(), strict=True))}
    optimizer.load_state_dict(saved)
    return optimizer


def _assert_same_state(got: torch.optim.Optimizer, want: torch.optim.Optimizer) -> None:
    got_params = [p for group in got.param_groups for p in group["params"]]
    want_params = [p for group in want.param_groups for p in group["params"]]
    for i, (g, w) in enumerate(zip(got_params, want_params, strict=True)):
        g_state, w_state = got.state[g], want.state[w]
        assert sorted(g_state) == sorted(w_state), f"param {i}"
        for key, value in w_state.items():
            other = g_state[key]
            if isinstance(value, torch.Tensor):
                assert isinstance(other, torch.Tensor), f"param {i} {key}"
                assert (other.dtype, other.device, other.shape) == (value.dtype, value.device, value.shape), key
                assert torch.equal(other, value), f"param {i} {key}"
                for p in got_params:  # a copy, never the loaded shard's storage
                    assert other.data_ptr() != p.data_ptr() or other.numel() == 0
            else:
                assert other == value, f"param {i} {key}"
    assert [{k: v for k, v in g.items() if k != "params"} for g in got.param_groups] == \
        [{k: v for k, v in g.items() if k != "params"} for g in want.param_groups]


def _retyped(shards: dict[str, ParamShard], dtype: torch.dtype) -> dict[str, ParamShard]:
    """The shards with floating state (not ``param``) in ``dtype`` and steps as Python floats."""
    out = {}
    for name, shard in shards.items():
        tensors = {k: v if k == "param" or not v.is_floating_point() else v.to(dtype)
                   for k, v in shard.tensors.items()}
        scalars: dict[str, Any] = {k: float(v) if k == "step" else v for k, v in shard.scalars.items()}
        out[name] = ParamShard(shard.shape, shard.start, shard.end, tensors, scalars, shard.group)
    return out


@pytest.mark.parametrize("retype", [None, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_loaded_state_matches_torch_load_state_dict(algorithm: str, retype: torch.dtype | None) -> None:
    make = ALGORITHMS[algorithm]
    source = _stepped(make)
    shards = {name: ParamShard(s.shape, s.start, s.end, {k: v.clone() for k, v in s.tensors.items()},
                               dict(s.scalars), s.group)
              for name, s in source.param_shards().items()}
    if retype is not None:
        shards = _retyped(shards, retype)
    target = _stage(make, seed=1)
    target.load_param_shards(shards)
    _assert_same_state(target.optimizer, _torch_loaded(make, shards))
    for piece, shard in zip(target.pieces, shards.values(), strict=True):
        assert torch.equal(piece.param.detach().reshape(-1), shard.tensors["param"])
    target.step()  # the loaded state steps (step counts of the right type, moments of usable dtypes)


def test_load_hooks_still_run() -> None:
    """With load hooks registered the stage goes through the optimizer's own ``load_state_dict``."""
    make = ALGORITHMS["torch_adam"]
    shards = _stepped(make).param_shards()
    target = _stage(make, seed=1)
    calls = []
    target.optimizer.register_load_state_dict_pre_hook(lambda opt, sd: calls.append(len(sd["state"])))
    target.optimizer.register_load_state_dict_post_hook(lambda opt: calls.append("post"))
    target.load_param_shards(shards)
    assert calls == [3, "post"]
    _assert_same_state(target.optimizer, _torch_loaded(make, shards))


def test_load_checkpoint_leaves_the_cycle_collector_as_it_was(tmp_path) -> None:
    import gc

    from optstack.checkpoint import load_checkpoint
    from optstack.optimizer import ChainedOptimizer

    optimizer = ChainedOptimizer([_stage(ALGORITHMS["sgd_momentum"])])
    assert gc.isenabled()
    with pytest.raises((ValueError, RuntimeError)):
        load_checkpoint(tmp_path / "missing", optimizer)
    assert gc.isenabled()
