"""torch.distributed.checkpoint (DCP) for optstack optimizers: a ``Stateful`` to put beside the model.

    dcp.save({"model": model.state_dict(), "optim": OptimizerState(model, optimizer, scheduler)}, checkpoint_id=d)
    dcp.load({"model": model.state_dict(), "optim": OptimizerState(model, optimizer, scheduler)},
             storage_reader=SafeFileSystemReader(d))   # the default planner: no argument needed

It goes through torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` (state keyed by parameter
name; a fresh optimizer's state is made first, so ``dcp.load`` has a tensor to read each entry into), and adds
what they leave out: the loss scaler and, if given, the scheduler. Replicated, ZeRO-1 and layer-wise state
loads at another data-parallel size (ZeRO-1 and layer-wise state are ``ShardedTensor``s: ``stage/sharded.py``).
State held whole (one process, layer-wise, Muon's owner ranks on DTensor models) keeps the parameter's shape,
as FSDP2's DTensor state does, so it moves between those; ZeRO-1's is flat: between other placements, use
``optstack.checkpoint.save_checkpoint`` / ``load_checkpoint``. A failed ``dcp.load`` changes nothing
(``OptimizerState``). ``dcp.async_save`` works for replicated and DTensor state; torch 2.13's async stager
cannot copy ``ShardedTensor``s (it takes each tensor's ``data_ptr``): for ZeRO-1 and layer-wise state use
``save_checkpoint(..., blocking=False)``.

DCP's own ``FileSystemReader`` (``checkpoint_id=d``) unpickles ``.metadata`` with ``pickle.load`` and bytes
items with ``torch.load(weights_only=False)``: loading a checkpoint from anyone else can run their code.
``SafeFileSystemReader`` (from ``optstack.checkpoint``; ``safe.py``) deserialises data only and refuses anything
else with a ``ValueError`` naming the file (inside torch's ``CheckpointException``).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from optstack.checkpoint.save import check_optimizer
from optstack.optimizer import ChainedOptimizer
from optstack.schedule import Scheduler

__all__ = ["OptimizerState"]

_LOADER = "torch.distributed.checkpoint.state_dict_loader"  # the module whose dcp.load asks for state_dict()


class OptimizerState:
    """The optimizer's state, loss scaler and scheduler as one DCP ``Stateful``.

    Args:
        model: the module the optimizer was built over (as passed to ``build_optimizer``; names come from it).
        optimizer: ``build_optimizer(...).optimizer``.
        scheduler: an optstack ``Scheduler`` saved and loaded with it (None: none).

    For ``dcp.save`` / ``dcp.async_save``, ``state_dict()`` is the live state (DCP copies what it writes). For
    ``dcp.load`` (recognised by its caller, torch's ``state_dict_loader``) it is a staging copy that DCP reads
    into; ``load_state_dict`` checks the scaler's and the scheduler's state, then commits (copies the staged
    values into the live state): a load that fails in DCP (a refused or truncated file) leaves the optimizer,
    scaler and scheduler as they were. Each rank's staging copy also holds an empty part of every sharded entry
    of which it holds nothing, so that torch's default load planner keeps the entry: no planner argument is
    needed. (Root cause, torch 2.13: with its default
    ``flatten_sharded_tensors=True``, ``_flatten_sharded_tensors`` returns without setting a ``ShardedTensor``
    that has no local shard, so the entry is missing from the rank's state dict; ``create_local_plan`` then
    takes the missing keys for a pre-2.4 checkpoint, re-flattens with the 2.3 key mapping and fails with
    "Missing key ... param_groups". ``DefaultLoadPlanner(flatten_sharded_tensors=False)`` avoids it too.)
    """

    def __init__(self, model: nn.Module, optimizer: ChainedOptimizer, scheduler: Scheduler | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"OptimizerState.model must be the nn.Module the optimizer was built over, got "
                             f"{type(model).__name__}")
        self.model, self.optimizer, self.scheduler = model, check_optimizer(optimizer), scheduler
        self._live: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        out = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer),
               "scaler": self.optimizer.scaler.state_dict()}
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        if sys._getframe(1).f_globals.get("__name__") != _LOADER:
            return out  # a save: the live state
        self._live = out
        return _map_tensors(out, _staged)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        wanted = ("optimizer", "scaler") + (("scheduler",) if self.scheduler is not None else ())
        missing = [k for k in wanted if k not in state_dict]
        if missing:
            raise ValueError(f"the checkpoint's optimizer entry has no {missing}; was it saved by OptimizerState "
                             f"{'with a scheduler' if 'scheduler' in missing else ''}?")
        self.optimizer.scaler.validate_state_dict(state_dict["scaler"])
        if self.scheduler is not None:  # checked on a copy first: loading it must not fail after the commit
            groups = SimpleNamespace(param_groups=[{k: v for k, v in g.items() if k != "params"}
                                                   for g in self.optimizer.param_groups])
            Scheduler(groups, self.scheduler.lr_schedule, self.scheduler.wd_schedule,
                      on_checkpoint=self.scheduler.on_checkpoint).load_state_dict(state_dict["scheduler"])
        live, self._live = self._live, None
        optimizer_state = state_dict["optimizer"]
        if live is not None:  # dcp.load read into the staging copy: commit it into the live tensors
            optimizer_state = _commit(state_dict["optimizer"], live["optimizer"])
        set_optimizer_state_dict(self.model, self.optimizer, optimizer_state)
        self.optimizer.scaler.load_state_dict(state_dict["scaler"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict["scheduler"])


def _map_tensors(value: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    if isinstance(value, torch.Tensor):
        return fn(value)
    return value


def _staged(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` for DCP to read into (same placement and sharding)."""
    if isinstance(tensor, ShardedTensor):
        shards = [Shard(s.tensor.detach().clone(), copy.deepcopy(s.metadata)) for s in tensor.local_shards()]
        metadata = copy.deepcopy(tensor.metadata())
        if not shards:  # an empty part, so that a flattening planner keeps the entry (class docstring)
            ndim = len(metadata.size)
            empty = ShardMetadata([0] * ndim, [0] * ndim, f"rank:{torch.distributed.get_rank()}/cpu")
            metadata.shards_metadata.append(empty)
            dtype = metadata.tensor_properties.dtype
            shards = [Shard(torch.empty([0] * ndim, dtype=dtype), copy.deepcopy(empty))]
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, metadata,
                                                                        process_group=tensor._process_group)
    return tensor.detach().clone()  # a DTensor clones its local part, keeping its placements


def _commit(staged: Any, live: Any) -> Any:
    """``staged``'s values, its tensors copied into ``live``'s (the optimizer's own) and those returned."""
    if isinstance(staged, dict) and isinstance(live, dict):
        return {k: _commit(v, live[k]) if k in live else v for k, v in staged.items()}
    if isinstance(staged, list) and isinstance(live, list) and len(staged) == len(live):
        return [_commit(s, v) for s, v in zip(staged, live, strict=True)]
    if isinstance(live, ShardedTensor) and isinstance(staged, ShardedTensor):
        by_offset = {tuple(s.metadata.shard_offsets): s.tensor for s in staged.local_shards()}
        with torch.no_grad():
            for shard in live.local_shards():
                shard.tensor.copy_(by_offset[tuple(shard.metadata.shard_offsets)])
        return live
    if isinstance(live, torch.Tensor) and isinstance(staged, torch.Tensor):
        with torch.no_grad():
            live.copy_(staged)
        return live
    return staged
