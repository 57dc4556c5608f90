"""Asynchronous saves on two gloo ranks: ``save_checkpoint(..., blocking=False)`` while the ranks train on
(their collectives on the training group, the save's on its own), and DCP's ``async_save`` with
``OptimizerState``. Each asynchronous checkpoint equals a blocking one taken at the same step."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from optstack.checkpoint import OptimizerState, SaveHandle, save_checkpoint

_spec = importlib.util.spec_from_file_location("_reshard_cases", Path(__file__).with_name("test_checkpoint_reshard.py"))
reshard = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = reshard
_spec.loader.exec_module(reshard)

K, MORE = reshard.K, reshard.MORE


def async_then_train(root: str, name: str) -> list[bool]:
    """Save step K blocking ("blocking") and asynchronously ("async"), train MORE steps while the async one
    writes, wait."""
    case = reshard.CASES[name]
    model, wrapped, built = reshard._stack(case, case["sharding"], seed=0)
    reshard._train(wrapped, built, range(K))
    save_checkpoint(Path(root) / "blocking", built.optimizer, step=K, scheduler=built.scheduler, model=model)
    handle = save_checkpoint(Path(root) / "async", built.optimizer, step=K, scheduler=built.scheduler, model=model,
                             blocking=False)
    running = not handle.done()
    reshard._train(wrapped, built, range(K, K + MORE))
    assert handle.wait(timeout=60) == Path(root) / "async" / f"step_{K:08d}"

    return [isinstance(handle, SaveHandle), running]


def dcp_async_then_train(root: str, name: str, sharding: str) -> None:
    """DCP's async_save of OptimizerState at step K, training on while it writes; a blocking optstack save of
    step K to compare with once the DCP checkpoint is loaded back into a fresh stack (default planner)."""
    case = reshard.CASES[name]
    model, wrapped, built = reshard._stack(case, sharding, seed=0)
    reshard._train(wrapped, built, range(K))
    built.optimizer.finish_param_sync()
    save_checkpoint(Path(root) / "at-K", built.optimizer, step=K, scheduler=built.scheduler, model=model)
    state = {"model": model.state_dict(), "optim": OptimizerState(wrapped, built.optimizer, built.scheduler)}
    # DCP's background collectives need a group of their own too (torch's docs advise a gloo one)
    future = dcp.async_save(state, checkpoint_id=Path(root) / "dcp", process_group=dist.new_group(backend="gloo"))
    reshard._train(wrapped, built, range(K, K + MORE))
    future.result(timeout=60)
    fresh_model, fresh_wrapped, fresh = reshard._stack(case, sharding, seed=7)
    state = {"model": fresh_model.state_dict(), "optim": OptimizerState(fresh_wrapped, fresh.optimizer,
                                                                      fresh.scheduler)}
    dcp.load(state, checkpoint_id=Path(root) / "dcp")
    save_checkpoint(Path(root) / "from-dcp", fresh.optimizer, step=K, scheduler=fresh.scheduler, model=fresh_model)


def test_async_save_while_training_equals_a_blocking_save(world2, tmp_path: Path) -> None:
    out = world2.run(async_then_train, str(tmp_path), "zero1-adamw-bf16")
    assert all(is_handle for is_handle, _ in out)
    reshard._assert_same_run(tmp_path, "async", "blocking")


def test_dcp_async_save_of_optimizer_state(world2, tmp_path: Path) -> None:
    """Replicated state (plain tensors). ZeRO-1 and layer-wise state are ShardedTensors, which torch 2.13's
    async stager cannot copy (it takes every tensor's data_ptr): use save_checkpoint(..., blocking=False)."""
    world2.run(dcp_async_then_train, str(tmp_path), "zero1-adamw-bf16", "replicated")
    reshard._assert_same_run(tmp_path, "from-dcp", "at-K")
