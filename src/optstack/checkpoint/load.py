"""``load_checkpoint``: any checkpoint into any layout, all or nothing.

Every rank takes the same path, agreeing after each step, so a problem anywhere is the same ``ValueError``
everywhere and nothing has been changed yet::

    manifest  resolve ``latest``, check the manifest's seal, ``migrate()`` it to the current version
    verify    the checkpoint's files split over the ranks: each exists, has its size and its CRC-32
    match     every rank's parameters (gathered) against the checkpoint: names, shapes, the optimizer's
              dtype, group identity; the model's tensors; the scaler and the scheduler on a dry run
    read      each rank reads the ranges it holds (from whichever ranks wrote them) into new tensors
    apply     only now: stages, group lr / weight decay, scaler, scheduler, model
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from optstack.checkpoint import io
from optstack.checkpoint.format import (
    MANIFEST,
    decode_scalar,
    dtype_from_name,
    dtype_name,
    migrate,
    model_key,
    optim_key,
    unseal,
)
from optstack.checkpoint.save import agree, check_optimizer, model_tensors
from optstack.checkpoint.state import HeldParam, check_load, collect, describe, distribute, restore_group_settings
from optstack.checkpoint.storage import Chunk, rank_dir_name, read_chunks
from optstack.distributed.comm import Comm, NullComm, world_comm
from optstack.optimizer import ChainedOptimizer
from optstack.protocol import ParamShard
from optstack.schedule import Scheduler

__all__ = ["CheckpointInfo", "load_checkpoint", "read_manifest", "verify_files", "read_ranges", "read_model"]


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``load_checkpoint`` loaded: the directory, its step, format version and data-parallel size."""

    path: Path
    step: int | None
    version: int
    world_size: int


def read_manifest(path: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    """(checkpoint directory, its manifest migrated to the current version); ``ValueError`` when damaged."""
    directory = io.resolve_checkpoint(path)
    try:
        text = (directory / MANIFEST).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {directory / MANIFEST}: {exc}") from exc
    return directory, migrate(unseal(text, str(directory / MANIFEST)))


def verify_files(directory: Path, files: Mapping[str, Mapping[str, Any]], rank: int = 0, size: int = 1) -> None:
    """Check this rank's share of the checkpoint's files (every ``size``-th from ``rank``) and that no file is
    missing or unexpected in any rank directory; ``ValueError`` naming the file otherwise."""
    names = sorted(files)
    for name in names[rank::size]:
        path = directory / name
        if not path.is_file():
            raise ValueError(f"{path} is missing (a shard of the checkpoint)")
        got, crc = io.file_checksum(path)
        if got != files[name]["bytes"]:
            raise ValueError(f"{path} has {got} bytes, the manifest says {files[name]['bytes']}: truncated or "
                             "overwritten")
        if crc != files[name]["crc32"]:
            raise ValueError(f"{path} fails its checksum (crc32 {crc}, the manifest says {files[name]['crc32']}): "
                             "the file is corrupted")
    if rank == 0:
        rank_dirs = {n.split("/")[0] for n in names}
        for rank_dir in sorted(rank_dirs):
            if (directory / rank_dir).is_dir():
                extra = sorted(f"{rank_dir}/{p.name}" for p in (directory / rank_dir).iterdir()
                               if f"{rank_dir}/{p.name}" not in files)
                if extra:
                    raise ValueError(f"{directory} has files its manifest does not list: {extra}")


def read_ranges(directory: Path, manifest: Mapping[str, Any], wanted: Mapping[str, tuple[int, int]],
                keys: Mapping[str, list[str]] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """Read elements ``[start, end)`` of each wanted parameter's element-wise state (all its saved keys, or
    ``keys[name]``) from the ranks that wrote them: ``{name: {key: 1-D tensor}}`` in the saved dtypes."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    by_dir: dict[str, list[Chunk]] = {}
    for name, (start, end) in wanted.items():
        entry = manifest["params"][name]
        numel = torch.Size(entry["shape"]).numel()
        out[name] = {}
        for key in (keys or {}).get(name, entry["dtypes"]):
            dest = torch.empty(end - start, dtype=dtype_from_name(entry["dtypes"][key]))
            out[name][key] = dest
            for rank, lo, hi in entry["chunks"]:
                lo, hi = max(lo, start), min(hi, end)
                if lo < hi:
                    by_dir.setdefault(rank_dir_name(rank), []).append(
                        Chunk(optim_key(name, key), dest[lo - start : hi - start], lo, numel))
    for rank_dir, chunks in sorted(by_dir.items()):
        read_chunks(directory / rank_dir, chunks)
    return out


def read_model(directory: Path, manifest: Mapping[str, Any], keys: list[str]) -> dict[str, torch.Tensor]:
    """Read the model tensors ``keys`` whole, in their saved shapes and dtypes."""
    by_dir: dict[str, list[Chunk]] = {}
    out = {}
    for key in keys:
        entry = manifest["model"][key]
        dest = torch.empty(entry["shape"], dtype=dtype_from_name(entry["dtype"]))
        out[key] = dest
        flat = dest.view(-1)
        by_dir.setdefault(rank_dir_name(entry["rank"]), []).append(Chunk(model_key(key), flat, 0, flat.numel()))
    for rank_dir, chunks in sorted(by_dir.items()):
        read_chunks(directory / rank_dir, chunks)
    return out


class _Groups:
    """Copies of an optimizer's group settings: what a scheduler dry run may write into."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        self.param_groups = [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _dry_run(optimizer: ChainedOptimizer, scheduler: Scheduler | None, manifest: Mapping[str, Any]) -> None:
    """Check the scaler's and the scheduler's saved state load, changing neither."""
    optimizer.scaler.validate_state_dict(manifest["scaler"])
    if scheduler is None:
        return
    if manifest.get("scheduler") is None:
        raise ValueError("a scheduler was given but the checkpoint holds no scheduler state (save with "
                         "scheduler=...)")
    probe = Scheduler(_Groups(optimizer.param_groups), scheduler.lr_schedule, scheduler.wd_schedule,
                      on_checkpoint=scheduler.on_checkpoint)
    probe.load_state_dict(manifest["scheduler"])


def load_checkpoint(
    path: str | os.PathLike[str],
    optimizer: ChainedOptimizer,
    *,
    scheduler: Scheduler | None = None,
    model: nn.Module | None = None,
    comm: Comm | NullComm | None = None,
) -> CheckpointInfo:
    """Load a checkpoint saved at any data-parallel size and layout into ``optimizer`` (collective).

    Parameters are matched by name, groups by their identifying settings (algorithm, expert flag, max_lr,
    min_lr, wd_mult, lr_mult); each group's ``lr`` and ``weight_decay`` are restored. Optimizer state that
    does not exist yet (a fresh optimizer) is created. The optimizer's ``"param"`` is the fp32 master (or
    the fp32 parameter itself); the stages publish the loaded masters to the model's trainable parameters
    (rounded to their dtype, gathered under ZeRO-1 and layer-wise) on every rank, so ``model`` is not
    needed for them. Pass ``model`` to restore all its saved state-dict tensors too (buffers included).

    Args:
        path: a checkpoint directory, or a root whose ``latest`` pointer names one.
        optimizer: the chained optimizer to load into.
        scheduler: restored too (the checkpoint must hold scheduler state).
        model: its state-dict tensors are restored (the checkpoint must hold them).
        comm: the ranks that hold the optimizer's state (default: the world).

    Returns:
        ``CheckpointInfo`` of the checkpoint loaded.

    Raises:
        ValueError: a missing, truncated or corrupted checkpoint, or one that does not fit (missing or extra
            parameters, shapes, dtypes, group settings, scaler or scheduler): it names what differs, and
            the optimizer, scheduler and model are unchanged. Raised on every rank alike.
    """
    optimizer = check_optimizer(optimizer)
    comm = comm if comm is not None else world_comm("checkpoint")
    where = f"cannot load checkpoint {path}"

    directory, manifest, error = Path(path), {}, None
    try:
        directory, manifest = read_manifest(path)
        where = f"cannot load checkpoint {directory}"
    except ValueError as exc:
        error = str(exc)
    agree(comm, error, where)

    error = None
    try:
        verify_files(directory, manifest["files"], comm.rank, comm.size)
    except ValueError as exc:
        error = str(exc)
    agree(comm, error, where)

    error, per_stage, tensors = None, [], {}
    held: dict[str, HeldParam] = {}
    try:
        per_stage = collect(optimizer.stages)
        held = describe({n: s for shards in per_stage for n, s in shards.items()})
        tensors = model_tensors(model) if model is not None else {}
    except ValueError as exc:
        error = f"rank {comm.rank}: {exc}"
    agree(comm, error, where)
    everyone: dict[str, HeldParam] = {}
    for table in comm.all_gather_object(held):
        for name, h in table.items():
            everyone.setdefault(name, h)
    error = None
    try:
        model_table = None if model is None else {k: (tuple(t.shape), dtype_name(t.dtype)) for k, t in tensors.items()}
        errors = check_load(manifest, everyone, model_table)
        if errors:
            raise ValueError("the checkpoint does not fit this optimizer:\n  " + "\n  ".join(errors))
        _dry_run(optimizer, scheduler, manifest)
    except ValueError as exc:
        error = str(exc)
    agree(comm, error, where)

    error, staged, staged_model = None, {}, {}
    try:
        staged = read_ranges(directory, manifest, {n: (h.start, h.end) for n, h in held.items()})
        staged_model = read_model(directory, manifest, list(tensors)) if model is not None else {}
    except Exception as exc:  # noqa: BLE001 - any read failure is reported by every rank
        error = f"rank {comm.rank} could not read its part: {exc!r}"
    agree(comm, error, where)

    optimizer.finish_param_sync()  # a gather still in flight would overwrite the loaded parameters
    _apply(optimizer, per_stage, manifest, staged, scheduler, tensors, staged_model)
    return CheckpointInfo(directory, manifest.get("step"), manifest["version"], manifest["world_size"])


def _apply(optimizer: ChainedOptimizer, per_stage: list[dict[str, ParamShard]], manifest: Mapping[str, Any],
           staged: Mapping[str, dict[str, torch.Tensor]], scheduler: Scheduler | None,
           tensors: Mapping[str, torch.Tensor], staged_model: Mapping[str, torch.Tensor]) -> None:
    params = manifest["params"]
    loaded = [{name: ParamShard(s.shape, s.start, s.end, staged[name],
                                {k: decode_scalar(v) for k, v in params[name]["scalars"].items()},
                                s.group, s.algorithm)
               for name, s in shards.items()} for shards in per_stage]
    distribute(optimizer.stages, loaded)
    for shards in per_stage:
        restore_group_settings(shards, manifest["groups"], {n: params[n]["group"] for n in shards})
    optimizer.scaler.load_state_dict(manifest["scaler"])
    if scheduler is not None:
        scheduler.load_state_dict(manifest["scheduler"])
    with torch.no_grad():
        for key, tensor in tensors.items():
            tensor.copy_(staged_model[key])
