"""``save_checkpoint``: every rank writes the slices it owns, rank 0 commits the whole atomically.

The steps, each a point where all ranks agree before going on (so one rank's failure is every rank's
error, never a hang)::

    collect   each rank's name-keyed ParamShards (and the model's tensors, when asked)
    plan      tables gathered over Comm; the same pure plan on every rank: replicated state written once,
              ZeRO-1 ranges and layer-wise parameters by their owners, writes balanced by bytes
    write     rank 0 makes a temporary directory beside the target; each rank writes its DCP directory
              there, flushes it and checksums its files
    commit    rank 0 writes the sealed manifest and the group map, flushes, renames the directory into
              place, repoints ``latest`` and prunes to ``keep_last``
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from optstack.checkpoint import io
from optstack.checkpoint.format import FORMAT, GROUP_MAP, MANIFEST, VERSION, dtype_name, model_key, optim_key, seal
from optstack.checkpoint.state import HeldParam, SavePlan, collect, describe, group_map, plan_save
from optstack.checkpoint.storage import Chunk, rank_dir_name, write_chunks
from optstack.distributed.comm import Comm, NullComm, world_comm
from optstack.names import model_state
from optstack.optimizer import ChainedOptimizer
from optstack.protocol import ParamShard
from optstack.schedule import Scheduler

__all__ = ["save_checkpoint", "agree", "model_tensors", "check_optimizer"]


def agree(comm: Comm | NullComm, error: str | None, what: str) -> None:
    """Raise the same ``ValueError`` on every rank when any rank has an ``error`` (collective)."""
    errors = comm.all_gather_object(error)
    found = list(dict.fromkeys(e for e in errors if e))
    if found:
        raise ValueError(f"{what}: " + "\n".join(found))


def check_optimizer(optimizer: Any) -> ChainedOptimizer:
    if not isinstance(optimizer, ChainedOptimizer):
        raise ValueError(f"optimizer must be an optstack ChainedOptimizer (build_optimizer(...).optimizer), got "
                         f"{type(optimizer).__name__}")
    return optimizer


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state-dict tensors under the names parameters have everywhere (``optstack.names.model_state``:
    wrappers and ``torch.compile`` looked through); detached views sharing the model's storage."""
    return model_state(model)


def save_checkpoint(
    root: str | os.PathLike[str],
    optimizer: ChainedOptimizer,
    *,
    step: int,
    scheduler: Scheduler | None = None,
    model: nn.Module | None = None,
    comm: Comm | NullComm | None = None,
    keep_last: int | None = None,
) -> Path:
    """Save the whole optimizer (collective: every rank of ``comm`` calls it).

    Saves fp32 master weights, every algorithm's state, the loss scaler, the scheduler when given and the
    model's tensors when given, keyed by parameter name, as ``root/step_<step>`` (see ``format.py``), and
    points ``root/latest`` at it. Atomic: a crash at any point leaves the previous checkpoints loadable.

    Args:
        root: the directory of checkpoints (created if needed; shared by every rank).
        optimizer: the chained optimizer (any stages: replicated, ZeRO-1, layer-wise).
        step: the training step; names the checkpoint.
        scheduler: its state is saved too.
        model: its state-dict tensors (parameters and buffers) are saved too.
        comm: the ranks that hold the optimizer's state (default: the world; one process without
            torch.distributed).
        keep_last: keep only this many newest checkpoints in ``root`` (None: keep all).

    Returns:
        The checkpoint directory.

    Raises:
        ValueError: bad arguments, a checkpoint of ``step`` exists already, state that cannot be saved by
            name, or ranks that disagree (the same error on every rank).
        RuntimeError: writing failed on some rank (named); nothing was committed.
    """
    optimizer = check_optimizer(optimizer)
    comm = comm if comm is not None else world_comm("checkpoint")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be None or an int >= 1, got {keep_last!r}")
    root = Path(root)
    name = io.checkpoint_name(step)
    target = root / name

    optimizer.finish_param_sync()  # overlapped parameter gathers must land before the model is read
    error, shards, tensors, tables = None, {}, {}, ({}, None)
    try:
        shards = {n: s for per_stage in collect(optimizer.stages) for n, s in per_stage.items()}
        tensors = model_tensors(model) if model is not None else {}
        tables = (describe(shards), None if model is None else
                  {k: (tuple(t.shape), dtype_name(t.dtype)) for k, t in tensors.items()})
    except ValueError as exc:
        error = f"rank {comm.rank}: {exc}"
    agree(comm, error, f"cannot save checkpoint {target}")
    gathered: list[tuple[dict[str, HeldParam], Any]] = comm.all_gather_object(tables)
    model_tables = None if model is None else [m for _, m in gathered]
    plan = plan_save([t for t, _ in gathered], model_tables)  # pure: the same result or error everywhere

    temp, error = None, None
    if comm.rank == 0:
        try:
            temp = _make_temp(target)
        except (OSError, ValueError) as exc:
            error = str(exc)
    temp, error = comm.broadcast_object((temp, error))
    if error:
        raise ValueError(error)

    files, error = {}, None
    try:
        files = _write_rank(temp, comm.rank, plan, shards, tensors)
    except Exception as exc:  # noqa: BLE001 - reported to every rank, re-raised below
        error = f"rank {comm.rank} could not write its files: {exc!r}"
    reports = comm.all_gather_object((files, error))

    outcome: tuple[str, str] | None = None
    if comm.rank == 0:
        errors = [e for _, e in reports if e]
        if errors:
            shutil.rmtree(temp, ignore_errors=True)
            outcome = ("error", "\n".join(errors))
        else:
            try:
                all_files = {k: v for f, _ in reports for k, v in f.items()}
                _commit(temp, target, plan, all_files, optimizer, scheduler, step, comm.size, keep_last)
                outcome = ("ok", "")
            except Exception as exc:  # noqa: BLE001 - reported to every rank
                shutil.rmtree(temp, ignore_errors=True)
                outcome = ("error", f"rank 0 could not commit: {exc!r}")
    status, message = comm.broadcast_object(outcome)
    if status != "ok":
        raise RuntimeError(f"saving checkpoint {target} failed; the previous checkpoints are unchanged:\n{message}")
    return target


def _make_temp(target: Path) -> Path:
    """The temporary directory beside ``target``, after clearing what killed saves left behind."""
    target.parent.mkdir(parents=True, exist_ok=True)
    io.remove_stale(target.parent)
    if target.exists():
        raise ValueError(f"checkpoint {target} already exists; checkpoints are never overwritten: delete it or "
                         "save under another step")
    return io.temp_dir_beside(target)


def _write_rank(temp: Path, rank: int, plan: SavePlan, shards: Mapping[str, ParamShard],
                tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Write this rank's share of the plan as one DCP directory; return its files' sizes and checksums."""
    chunks = []
    for name, start, _ in plan.writes[rank]:
        shard = shards[name]
        numel = torch.Size(shard.shape).numel()
        chunks += [Chunk(optim_key(name, key), t, start, numel) for key, t in shard.tensors.items()]
    for key in plan.model_writes[rank]:
        t = tensors[key].detach().reshape(-1)
        chunks.append(Chunk(model_key(key), t, 0, t.numel()))
    if not any(c.tensor.numel() for c in chunks):
        return {}
    directory = temp / rank_dir_name(rank)
    write_chunks(directory, chunks)
    io.fsync_tree(directory)
    out = {}
    for path in sorted(directory.iterdir()):
        size, crc = io.file_checksum(path)
        out[f"{directory.name}/{path.name}"] = {"bytes": size, "crc32": crc}
    return out


def _commit(temp: Path, target: Path, plan: SavePlan, files: dict[str, Any], optimizer: ChainedOptimizer,
            scheduler: Scheduler | None, step: int, world_size: int, keep_last: int | None) -> None:
    manifest = {
        "format": FORMAT, "version": VERSION, "step": step, "world_size": world_size,
        "checksum_algorithm": "crc32", "params": plan.params, "groups": plan.groups,
        "scaler": optimizer.scaler.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "model": plan.model, "files": files,
    }
    for file_name, text in ((MANIFEST, seal(manifest)),
                            (GROUP_MAP, json.dumps(group_map(plan.params, plan.groups), indent=1))):
        with open(temp / file_name, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    io.fsync_path(temp)
    io.commit_dir(temp, target)
    io.write_latest(target.parent, target.name)
    if keep_last is not None:
        io.prune(target.parent, keep_last, keep=target)
