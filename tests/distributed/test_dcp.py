"""torch.distributed.checkpoint with optstack optimizers on real gloo ranks: saved at one data-parallel size
through ``OptimizerState`` (torch's get/set_optimizer_state_dict underneath), resumed at another, the run goes
on as the uninterrupted one. The cases, the data and the comparison are test_checkpoint_reshard's: after the
resumed steps both runs are written with optstack's own checkpoint and compared element by element."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from optstack.checkpoint import OptimizerState, save_checkpoint
from optstack.distributed.comm import world_comm

_spec = importlib.util.spec_from_file_location("_reshard_cases", Path(__file__).with_name("test_checkpoint_reshard.py"))
reshard = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = reshard
_spec.loader.exec_module(reshard)

K, MORE = reshard.K, reshard.MORE


def run(root: str, name: str, sharding: str, source: str | None, tag: str, default_planner: bool = False) -> int:
    """On every rank: train K steps and dcp.save ``tag``-K (``source`` None), or dcp.load ``source`` into a
    fresh stack with other weights; then train MORE steps and save ``tag``-end with optstack's checkpoint."""
    case = reshard.CASES[name]
    model, wrapped, built = reshard._stack(case, sharding, seed=0 if source is None else 7)
    state = {"model": model.state_dict(), "optim": OptimizerState(wrapped, built.optimizer, built.scheduler)}
    if source is None:
        reshard._train(wrapped, built, range(K))
        built.optimizer.finish_param_sync()
        dcp.save(state, checkpoint_id=Path(root) / f"{tag}-K")
    else:
        # torch 2.13's default flatten_sharded_tensors (for FSDP's nested ShardedTensors) breaks the plan on ranks
        # holding no part of some parameter ("Missing key ... param_groups"); flat ones need no flattening.
        planner = None if default_planner else DefaultLoadPlanner(flatten_sharded_tensors=False)
        dcp.load(state, checkpoint_id=Path(root) / source, planner=planner)
    reshard._train(wrapped, built, range(K, K + MORE))
    save_checkpoint(Path(root) / f"{tag}-end", built.optimizer, step=K + MORE, scheduler=built.scheduler,
                    model=model)
    return world_comm().size


def sharded_entries(name: str) -> dict[str, bool]:
    """ZeRO-1 state through torch's get_optimizer_state_dict: every parameter on every rank, its element-wise
    state a ShardedTensor whose shards tile the flattened parameter, this rank's part the live state."""
    case = reshard.CASES[name]
    model, wrapped, built = reshard._stack(case, "zero1", seed=0)
    reshard._train(wrapped, built, range(1))
    osd = get_optimizer_state_dict(wrapped, built.optimizer)
    names = {n for n, _ in wrapped.named_parameters()}
    tiles, live = True, True
    for fqn, entry in osd["state"].items():
        st = entry["exp_avg"]
        sizes = sorted((m.shard_offsets[0], m.shard_sizes[0]) for m in st.metadata().shards_metadata)
        ends = [0] + [o + s for o, s in sizes]
        tiles &= all(o == ends[i] for i, (o, _) in enumerate(sizes)) and ends[-1] == st.size()[0]
        for shard in st.local_shards():
            param = dict(wrapped.named_parameters())[fqn]
            live &= shard.tensor.data_ptr() == built.optimizer.state[param]["exp_avg"].data_ptr()
    return {"all": set(osd["state"]) == names, "tiles": tiles, "live": live}


def test_zero1_state_is_sharded_tensors_tiling_each_parameter(world2) -> None:
    for out in world2.run(sharded_entries, "zero1-adamw-bf16"):
        assert out == {"all": True, "tiles": True, "live": True}


@pytest.mark.parametrize("name, sharding", [("zero1-adamw-bf16", "zero1"), ("layerwise-muon", "layerwise"),
                                            ("zero1-muon-bf16", "zero1"),
                                            ("zero1-adamw-bf16", "replicated")])
def test_dcp_save_at_2_resume_at_3(world2, world3, tmp_path: Path, name: str, sharding: str) -> None:
    assert world2.run(run, str(tmp_path), name, sharding, None, "dp2") == [2, 2]
    assert world3.run(run, str(tmp_path), name, sharding, "dp2-K", "dp3") == [3, 3, 3]
    reshard._assert_same_run(tmp_path, "dp3-end", "dp2-end")


@pytest.mark.parametrize("name, sharding", [("zero1-adamw-bf16", "zero1"), ("zero1-muon-bf16", "zero1"),
                                            ("layerwise-muon", "layerwise")])
def test_dcp_load_with_the_default_planner(world2, world3, tmp_path: Path, name: str, sharding: str) -> None:
    """Issue 30: torch's default planner flattened away the entries a rank holds no part of and then read the
    checkpoint as a pre-2.4 one ("Missing key ... param_groups"); OptimizerState's staging copy keeps them."""
    assert world2.run(run, str(tmp_path), name, sharding, None, "dp2") == [2, 2]
    assert world3.run(run, str(tmp_path), name, sharding, "dp2-K", "dp3", True) == [3, 3, 3]
    reshard._assert_same_run(tmp_path, "dp3-end", "dp2-end")


def test_loading_into_a_fresh_optimizer_without_the_adapter_is_an_error(tmp_path: Path) -> None:
    """dcp.load({"optim": optimizer}) straight into a stateless optimizer has no tensors to read into: refused,
    nothing changed, with the way out named."""
    case = reshard.CASES["zero1-adamw-bf16"]
    _, wrapped, built = reshard._stack(case, "replicated", seed=0)
    reshard._train(wrapped, built, range(2))
    dcp.save({"optim": built.optimizer}, checkpoint_id=tmp_path / "plain")
    _, fresh_wrapped, fresh = reshard._stack(case, "replicated", seed=7)
    before = [p.detach().clone() for p in fresh_wrapped.parameters()]
    with pytest.raises(ValueError, match="OptimizerState"):
        dcp.load({"optim": fresh.optimizer}, checkpoint_id=tmp_path / "plain")
    assert all(torch.equal(a, b) for a, b in zip(before, fresh_wrapped.parameters(), strict=True))
    assert not fresh.optimizer.state
    # With state to read into, the optimizer itself is a Stateful DCP loads in place.
    reshard._train(fresh_wrapped, fresh, range(1))
    dcp.load({"optim": fresh.optimizer}, checkpoint_id=tmp_path / "plain")
    saved = built.optimizer.state_dict()["state"]
    for i, entry in fresh.optimizer.state_dict()["state"].items():
        assert torch.equal(entry["exp_avg"], saved[i]["exp_avg"]) and int(entry["step"]) == 2
