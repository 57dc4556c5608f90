"""``save_checkpoint``: every rank writes the slices it owns, rank 0 commits the whole atomically.

All ranks agree after each step (one rank's failure is every rank's error, never a hang)::

    collect   each rank's name-keyed ParamShards (and the model's tensors, when asked)
    plan      the same pure plan on every rank: replicated state written once, writes balanced by bytes
    write     each rank its DCP directory, flushed and checksummed, into rank 0's temporary directory
    commit    rank 0: the sealed manifest and the group map, flush, rename into place, ``latest``, prune
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from optstack.checkpoint import io
from optstack.checkpoint.format import FORMAT, GROUP_MAP, MANIFEST, VERSION, dtype_name, model_key, optim_key, seal
from optstack.checkpoint.state import HeldParam, ModelTable, SavePlan, collect, describe, group_map, plan_save
from optstack.checkpoint.storage import Chunk, rank_dir_name, write_chunks
from optstack.distributed.comm import Comm, NullComm, world_comm
from optstack.names import model_state
from optstack.optimizer import ChainedOptimizer
from optstack.protocol import ParamShard
from optstack.schedule import Scheduler

__all__ = ["save_checkpoint", "agree", "together", "model_tensors", "local_state", "check_optimizer"]

T = TypeVar("T")


def agree(comm: Comm | NullComm, error: str | None, what: str) -> None:
    """Raise the same ``ValueError`` on every rank when any rank has an ``error`` (collective)."""
    errors = comm.all_gather_object(error)
    found = list(dict.fromkeys(e for e in errors if e))
    if found:
        raise ValueError(f"{what}: " + "\n".join(found))


def together(comm: Comm | NullComm, what: str, fn: Callable[[], T], prefix: str = "",
             catch: tuple[type[Exception], ...] = (ValueError,)) -> T:
    """``fn()`` on this rank; a ``catch`` error on any rank becomes one ``ValueError`` on every rank (collective)."""
    try:
        result, error = fn(), None
    except catch as exc:
        result, error = None, f"{prefix}{exc if isinstance(exc, ValueError) else repr(exc)}"
    agree(comm, error, what)
    return result  # type: ignore[return-value]


def local_state(optimizer: ChainedOptimizer, model: nn.Module | None) -> tuple[
        dict[str, ParamShard], dict[str, HeldParam], dict[str, torch.Tensor], ModelTable | None]:
    """This rank's shards of all stages and their table, the model's tensors and theirs (None: no model)."""
    shards = {name: shard for per_stage in collect(optimizer.stages) for name, shard in per_stage.items()}
    tensors = model_tensors(model) if model is not None else {}
    table = None if model is None else {k: (tuple(t.shape), dtype_name(t.dtype)) for k, t in tensors.items()}
    return shards, describe(shards), tensors, table


def check_optimizer(optimizer: Any) -> ChainedOptimizer:
    if not isinstance(optimizer, ChainedOptimizer):
        raise ValueError(f"optimizer must be an optstack ChainedOptimizer (build_optimizer(...).optimizer), got "
                         f"{type(optimizer).__name__}")
    return optimizer


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state-dict tensors as detached views, named as by ``optstack.names.model_state``."""
    tensors = model_state(model)
    for name, tensor in tensors.items():
        if isinstance(tensor, DTensor):
            raise ValueError(
                f"model tensor {name!r} is a DTensor (placements {tuple(tensor.placements)}); this checkpoint writes "
                "whole model tensors. Leave model= out (the optimizer's state holds the trainable parameters' values) "
                "or save the model with DCP: dcp.save({'model': model.state_dict(), 'optim': "
                "OptimizerState(model, optimizer)}, checkpoint_id=...)")
    return tensors


def save_checkpoint(root: str | os.PathLike[str], optimizer: ChainedOptimizer, *, step: int,
                    scheduler: Scheduler | None = None, model: nn.Module | None = None,
                    comm: Comm | NullComm | None = None, keep_last: int | None = None) -> Path:
    """Save the whole optimizer as ``root/step_<step>`` (returned), then point ``root/latest`` at it (collective).

    Saves the fp32 masters, every algorithm's state and the loss scaler by parameter name, and the scheduler and
    model when given. Atomic: a crash at any point leaves the previous checkpoints loadable.

    Args:
        root: the directory of checkpoints (created if needed; shared by every rank).
        optimizer: the chained optimizer (any stages: replicated, ZeRO-1, layer-wise).
        scheduler, model: saved too (the model's parameters and buffers).
        comm: the ranks that hold the optimizer's state (default: the world, or this process alone).
        keep_last: keep only this many newest checkpoints in ``root`` (None: all).

    Raises:
        ValueError: on every rank alike, for bad arguments, an existing checkpoint of ``step``, state that
            cannot be saved by name, or ranks that disagree.
        RuntimeError: writing failed on some rank (named); nothing was committed.
    """
    optimizer = check_optimizer(optimizer)
    comm = comm if comm is not None else world_comm("checkpoint")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be None or an int >= 1, got {keep_last!r}")
    target = Path(root) / io.checkpoint_name(step)
    where = f"cannot save checkpoint {target}"
    optimizer.finish_param_sync()  # overlapped parameter gathers must land before the model is read

    shards, held, tensors, table = together(comm, where, lambda: local_state(optimizer, model), f"rank {comm.rank}: ")
    gathered = comm.all_gather_object((held, table))
    plan = plan_save([t for t, _ in gathered], None if model is None else [m for _, m in gathered])  # pure
    temp = comm.broadcast_object(together(comm, where, lambda: io.make_temp(target) if comm.rank == 0 else None,
                                          catch=(OSError, ValueError)))

    def commit(files: dict[str, Any]) -> None:
        manifest = {
            "format": FORMAT, "version": VERSION, "step": step, "world_size": comm.size, "checksum_algorithm": "crc32",
            "params": plan.params, "groups": plan.groups, "scaler": optimizer.scaler.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None, "model": plan.model,
            "files": files,
        }
        io.write_synced(temp / MANIFEST, seal(manifest))
        io.write_synced(temp / GROUP_MAP, json.dumps(group_map(plan.params, plan.groups), indent=1))
        io.fsync_path(temp)
        io.commit_dir(temp, target)
        io.write_latest(target.parent, target.name)
        if keep_last is not None:
            io.prune(target.parent, keep_last, keep=target)

    failed = f"saving checkpoint {target} failed; the previous checkpoints are unchanged"
    try:
        files = together(comm, failed, lambda: _write_rank(temp, comm.rank, plan, shards, tensors),
                         f"rank {comm.rank} could not write its files: ", (Exception,))
        files = {k: v for mine in comm.all_gather_object(files) for k, v in mine.items()}
        together(comm, failed, lambda: commit(files) if comm.rank == 0 else None, "rank 0 could not commit: ",
                 (Exception,))
    except ValueError as exc:
        if comm.rank == 0:
            shutil.rmtree(temp, ignore_errors=True)
        raise RuntimeError(str(exc)) from exc
    return target


def _write_rank(temp: Path, rank: int, plan: SavePlan, shards: Mapping[str, ParamShard],
                tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Write this rank's share of the plan as one DCP directory; return its files' sizes and checksums."""
    chunks = [Chunk(optim_key(name, key), t, start, torch.Size(shards[name].shape).numel())
              for name, start, _ in plan.writes[rank] for key, t in shards[name].tensors.items()]
    for key in plan.model_writes[rank]:
        t = tensors[key].detach().reshape(-1)
        chunks.append(Chunk(model_key(key), t, 0, t.numel()))
    if not any(c.tensor.numel() for c in chunks):
        return {}
    directory = temp / rank_dir_name(rank)
    write_chunks(directory, chunks)
    io.fsync_tree(directory)
    return {f"{directory.name}/{path.name}": io.file_checksum(path) for path in sorted(directory.iterdir())}
