"""``load_checkpoint``: any checkpoint into any layout, all or nothing.

All ranks agree after each step: a problem anywhere is the same ``ValueError`` everywhere (a ``CheckpointError``
when the storage failed), nothing changed yet::

    manifest  resolve the newest committed checkpoint, check the manifest's seal (and signature, given a key),
              ``migrate()`` it to the current version, check every field's type
    verify    the files, split over the ranks: each exists, has its size and its CRC-32 (and SHA-256, given a
              key); each DCP ``.metadata`` holds DCP metadata only (``safe.py``: no code runs); every rank that
              wrote state has its DCP metadata and data files listed
    match     every rank's parameters (names, shapes, dtypes, groups), the model; scaler, scheduler on a dry run
    read      each rank the ranges it holds (from whichever ranks wrote them), into new tensors
    apply     only now: stages, group lr / weight decay, scaler, scheduler, model
"""

from __future__ import annotations

import functools
import gc
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar, cast

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata

from optstack.checkpoint import background, io
from optstack.checkpoint.digest import check_key, check_signature, file_sha256
from optstack.checkpoint.format import (
    MANIFEST,
    PART,
    check_manifest,
    check_part,
    decode_scalar,
    dtype_from_name,
    migrate,
    model_key,
    optim_key,
    unseal,
)
from optstack.checkpoint.manifest import Agreement, agreement, chunk_runs, overlapping, view_of
from optstack.checkpoint.pack import check_packs, read_packed
from optstack.checkpoint.safe import METADATA, load_metadata_file
from optstack.checkpoint.save import adopt_job, check_optimizer, load_into, local_state, together
from optstack.checkpoint.state import HeldParam, ModelTable, check_load, restore_group_settings
from optstack.checkpoint.storage import Chunk, rank_dir_name
from optstack.distributed.comm import Comm, NullComm, world_comm
from optstack.optimizer import ChainedOptimizer
from optstack.schedule import Scheduler

__all__ = ["CheckpointInfo", "Read", "Saved", "check_dtypes", "load_checkpoint", "load_view", "read_manifest", "reads",
           "verify_files", "read_ranges", "read_model"]


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``load_checkpoint`` loaded: the directory, its step, format version and data-parallel size."""

    path: Path
    step: int | None
    version: int
    world_size: int


def read_manifest(path: str | os.PathLike[str], key: bytes | str | None = None) -> tuple[Path, dict[str, Any]]:
    """(checkpoint directory, its manifest migrated to the current version); ``ValueError`` when damaged, of
    unexpected types, or (given ``key``) unsigned or not signed with ``key``."""
    key = check_key(key)
    directory = io.resolve_checkpoint(path)
    inside(directory, directory / MANIFEST)
    try:
        text = (directory / MANIFEST).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {directory / MANIFEST}: {exc}") from exc
    where = str(directory / MANIFEST)
    body = unseal(text, where)
    if key is not None:
        check_signature(body, key, where)
    try:
        manifest = migrate(body)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    check_manifest(manifest, where)
    check_packs(manifest.get("packs"), manifest["world_size"], where)
    named = io.step_of_name(directory.name)
    if named is not None and manifest.get("step") is not None and manifest["step"] != named:
        # e.g. an older (validly signed) checkpoint copied in under a newer step's name: loading it would
        # silently roll training back
        raise ValueError(f"{where} is the checkpoint of step {manifest['step']} but its directory is named for step "
                         f"{named}: it was renamed or replaced; load it by its own step_{manifest['step']} "
                         "directory if it is the one you want")
    return directory, manifest


def inside(directory: Path, path: Path) -> None:
    """Refuse ``path`` when it (or a directory on the way) is a symbolic link leading out of ``directory``: a
    checkpoint's files are its own, never another checkpoint's or the system's."""
    try:
        resolved, home = path.resolve(), directory.resolve()
    except (OSError, RuntimeError) as exc:  # a loop of links
        raise ValueError(f"{path}: cannot resolve ({exc})") from None
    if resolved != home and home not in resolved.parents:
        raise ValueError(f"{path} is a symbolic link to {resolved}, outside the checkpoint {directory}: refusing "
                         "to read it (a checkpoint's files must be inside its directory)")


def verify_files(directory: Path, files: Mapping[str, Mapping[str, Any]], rank: int = 0, size: int = 1,
                 sha256: bool = False, writers: Sequence[int] = ()) -> dict[Path, Metadata]:
    """Check this rank's share of ``files`` (every ``size``-th from ``rank``): size, CRC-32, the SHA-256 too when
    ``sha256`` (a signed load), DCP metadata holding only metadata; on rank 0, that no file is unlisted and that
    each of ``writers`` (the ranks the manifest says wrote state) has its DCP metadata and a data file listed.
    Together: the files DCP's metadata names are the listed ones (a save checks its metadata's files before it
    commits). Returns the DCP metadata it read, by path (a load checks each once)."""
    names = sorted(files)
    known: dict[Path, Metadata] = {}
    if rank == 0:
        for writer in sorted(set(writers)):
            mine = [n for n in names if n.startswith(f"{rank_dir_name(writer)}/")]
            if f"{rank_dir_name(writer)}/.metadata" not in mine or len(mine) < 2:
                raise ValueError(f"{directory / rank_dir_name(writer)}: the manifest lists {mine or 'no files'} for "
                                 f"rank {writer}, which wrote state; need its DCP .metadata and data files (the "
                                 "checkpoint is incomplete)")
    for name in names[rank::size]:
        path, want = directory / name, files[name]
        inside(directory, path)
        if not path.is_file():
            raise ValueError(f"{path} is missing (a shard of the checkpoint)")
        got = io.file_checksum(path)
        if got["bytes"] != want["bytes"]:
            raise ValueError(f"{path} has {got['bytes']} bytes, the manifest says {want['bytes']}: truncated or "
                             "overwritten")
        if got["crc32"] != want["crc32"]:
            raise ValueError(f"{path} fails its checksum (crc32 {got['crc32']}, the manifest says "
                             f"{want['crc32']}): the file is corrupted")
        if sha256 and file_sha256(path) != want.get("sha256"):
            raise ValueError(f"{path} fails its SHA-256 check against the signed manifest: the file was changed "
                             "after the checkpoint was saved")
        if path.name == METADATA:
            known[path] = load_metadata_file(path)  # refuses anything but DCP metadata, running no code from it
    if rank == 0:
        listed = {directory / n for n in names}
        extra = sorted(str(p.relative_to(directory)) for d in sorted({p.parent for p in listed}) if d.is_dir()
                       for p in d.iterdir() if p not in listed)
        if extra:
            raise ValueError(f"{directory} has files its manifest does not list: {extra}")
    return known


def _writers(manifest: Mapping[str, Any]) -> list[int]:
    """The ranks that wrote element-wise state or model tensors, by the manifest."""
    ranks = {rank + i for entry in manifest["params"].values()
             for rank, lo, hi, count in chunk_runs(entry["chunks"]) if hi > lo for i in range(count)}
    ranks |= {entry["rank"] for entry in (manifest.get("model") or {}).values() if math.prod(entry["shape"]) > 0}
    return sorted(ranks)


class Saved:
    """The state entries of a checkpoint besides its data: each parameter's dtypes and scalars, each writer's
    packs. In a version-3 checkpoint they are in the writers' parts (``format.PART``), each read (and checked)
    once, when a load first needs one of its parameters; in a version-2 one, in the manifest."""

    def __init__(self, directory: Path, manifest: Mapping[str, Any]) -> None:
        self.directory, self.manifest = directory, manifest
        self.inline = bool(manifest.get("inline"))
        self._parts: dict[int, dict[str, Any]] = {}

    def part(self, rank: int) -> dict[str, Any]:
        if rank not in self._parts:
            path = self.directory / rank_dir_name(rank) / PART
            inside(self.directory, path)
            try:
                text = path.read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"cannot read {path}, rank {rank}'s part of the manifest: {exc}") from exc
            part = unseal(text, str(path))
            check_part(part, str(path))
            check_packs({str(rank): part["packs"]}, rank + 1, str(path))
            self._parts[rank] = part
        return self._parts[rank]

    def state(self, name: str, start: int, end: int) -> dict[str, Any]:
        """``{"dtypes", "scalars"}`` of ``name`` as saved by the writer of its first element in ``[start, end)``
        (of its first chunk when the range is empty)."""
        entry = self.manifest["params"][name]
        if self.inline:
            return entry
        runs = chunk_runs(entry["chunks"])
        writer = next((rank for rank, _, _ in overlapping(runs, start, max(end, start + 1))),
                      runs[0][0] if runs else None)
        if writer is None:
            raise ValueError(f"{self.directory / MANIFEST}: no rank wrote parameter {name!r}, so its state has no "
                             "dtypes; the checkpoint holds none of it")
        found = self.part(writer)["params"].get(name)
        if found is None:
            raise ValueError(f"{self.directory / rank_dir_name(writer) / PART} has no entry for {name!r}, which the "
                             f"manifest says rank {writer} wrote: the checkpoint is damaged")
        return cast(dict[str, Any], found)

    def packs(self, ranks: Iterable[int]) -> dict[str, Any]:
        """The packs of ``ranks`` as ``pack.read_packed`` takes them."""
        if self.inline:
            return cast(dict[str, Any], self.manifest.get("packs") or {})
        return {str(r): self.part(r)["packs"] for r in ranks}


@dataclass(frozen=True)
class Read:
    """Elements ``[start, end)`` of state ``key`` of parameter ``name`` (``numel`` elements, flattened) in
    ``dtype``, from ``sources``: (writer rank, lo, hi) per stretch."""

    name: str
    key: str
    dtype: str
    numel: int
    start: int
    end: int
    sources: list[tuple[int, int, int]]


def reads(manifest: Mapping[str, Any], saved: Saved, wanted: Mapping[str, tuple[int, int]],
          keys: Mapping[str, list[str]] | None = None) -> list[Read]:
    """What to read for ``wanted`` (elements ``[start, end)`` of each parameter's state, ``keys[name]`` or all),
    from the manifest and the parts of the ranks read from; no data read, nothing allocated."""
    out = []
    for name, (start, end) in wanted.items():
        entry = manifest["params"][name]
        dtypes = saved.state(name, start, end)["dtypes"]
        runs = chunk_runs(entry["chunks"])
        for key in (keys or {}).get(name, dtypes):
            if key not in dtypes:
                raise ValueError(f"{saved.directory}: no state {key!r} of {name!r} was saved (it has {sorted(dtypes)})")
            out.append(Read(name, key, dtypes[key], math.prod(entry["shape"]), start, end,
                            list(overlapping(runs, start, end))))
    return out


def read_ranges(directory: Path, manifest: Mapping[str, Any], wanted: Mapping[str, tuple[int, int]],
                keys: Mapping[str, list[str]] | None = None, known: dict[Path, Metadata] | None = None,
                saved: Saved | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """Elements ``[start, end)`` of each wanted parameter's saved state (``keys[name]`` or all): {name: {key: 1-D}}."""
    saved = saved if saved is not None else Saved(directory, manifest)
    out: dict[str, dict[str, torch.Tensor]] = {name: {} for name in wanted}
    by_rank: dict[int, list[Chunk]] = {}
    for r in reads(manifest, saved, wanted, keys):
        dest = out[r.name][r.key] = torch.empty(r.end - r.start, dtype=dtype_from_name(r.dtype))
        for rank, lo, hi in r.sources:
            by_rank.setdefault(rank, []).append(Chunk(optim_key(r.name, r.key), dest[lo - r.start : hi - r.start],
                                                      lo, r.numel))
    read_packed(directory, saved.packs(by_rank), by_rank, known)
    return out


def read_model(directory: Path, manifest: Mapping[str, Any], keys: list[str],
               known: dict[Path, Metadata] | None = None, saved: Saved | None = None) -> dict[str, torch.Tensor]:
    """Read the model tensors ``keys`` whole, in their saved shapes and dtypes."""
    saved = saved if saved is not None else Saved(directory, manifest)
    out, by_rank = {}, {}
    for key in keys:
        entry = manifest["model"][key]
        out[key] = torch.empty(entry["shape"], dtype=dtype_from_name(entry["dtype"]))
        flat = out[key].view(-1)
        by_rank.setdefault(entry["rank"], []).append(Chunk(model_key(key), flat, 0, flat.numel()))
    read_packed(directory, saved.packs(by_rank), by_rank, known)
    return out


def load_view(optimizer: ChainedOptimizer, held: Mapping[str, HeldParam], table: ModelTable | None,
              comm: Comm | NullComm) -> dict[str, HeldParam]:
    """Every parameter of every rank, as ``check_load`` takes them (collective). From this rank's stages alone
    when every rank computes the same view of them (``manifest.py``; only a fixed-size ``Agreement`` is
    exchanged): this rank's own entries where it holds a part, the view's (without dtypes) elsewhere. Else the
    ranks' tables, gathered (each parameter's first holder's entry)."""
    view = together(comm, "cannot load the checkpoint", lambda: view_of(optimizer.stages, comm.global_ranks),
                    f"rank {comm.rank}: ")
    if agreement(comm.all_gather_object(Agreement.of(view, table, held, {}, comm.rank))):
        return {n: held.get(n) or HeldParam(n, p.shape, 0, 0, {}, {}, p.identity, p.settings)
                for n, p in view.items()}
    everyone: dict[str, HeldParam] = {}
    for theirs in comm.all_gather_object(held):
        everyone |= {n: h for n, h in theirs.items() if n not in everyone}
    return everyone


def check_dtypes(manifest: Mapping[str, Any], saved: Saved, held: Mapping[str, HeldParam]) -> list[str]:
    """Where the optimizer's copy ('param') of a parameter this rank holds has another dtype in the
    checkpoint (as its writer's part says); the parts a load reads from are read and checked here."""
    errors = []
    for name, h in held.items():
        if name in manifest["params"] and "param" in h.dtypes:
            dtype = saved.state(name, h.start, h.end)["dtypes"].get("param")
            if dtype != h.dtypes["param"]:
                errors.append(f"parameter {name!r}: the optimizer's copy ('param') is {dtype} in the checkpoint, "
                              f"{h.dtypes['param']} here")
    return errors


_F = TypeVar("_F", bound=Callable[..., Any])


def _gc_paused(fn: _F) -> _F:
    """``fn`` with Python's cycle collector off: a load makes millions of acyclic objects (per-parameter
    records and tensors), and the full-heap passes they trigger cost a quarter of a 50,000-parameter load."""
    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> Any:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()
    return cast(_F, paused)


@_gc_paused
def load_checkpoint(path: str | os.PathLike[str], optimizer: ChainedOptimizer, *, scheduler: Scheduler | None = None,
                    model: nn.Module | None = None, comm: Comm | NullComm | None = None,
                    key: bytes | str | None = None) -> CheckpointInfo:
    """Load a checkpoint saved at any data-parallel size and layout into ``optimizer`` (collective).

    Parameters are matched by name, groups by ``format.identity_of``; groups' ``lr`` and ``weight_decay`` are
    restored, missing state is created. The stages publish the loaded masters to the model's trainable
    parameters, so ``model`` is needed only for its other state-dict tensors (buffers).

    Args:
        path: a checkpoint directory, or a root whose ``latest`` pointer names one.
        scheduler, model: restored too (the checkpoint must hold their state).
        comm: the ranks that hold the optimizer's state (default: the world).
        key: the secret the checkpoint was saved with (``save_checkpoint(..., key=...)``): its HMAC-SHA256 and
            every file's SHA-256 are checked before anything else is read. None: CRC-32s only (accidents, not
            tampering). Either way every file is deserialised as data only: no code in a checkpoint runs.

    Raises:
        ValueError: on every rank alike, for a missing, truncated, corrupted or (given ``key``) unsigned or
            altered checkpoint, a file holding anything but data, or one that does not fit (parameters, shapes,
            dtypes, group settings, scaler, scheduler, model): it names what differs or the file, and the
            optimizer, scheduler and model are unchanged.
        CheckpointError: (a ``RuntimeError``) on every rank alike, when reading failed (an I/O error): it names
            the rank(s), the path and the error; the optimizer, scheduler and model are unchanged.
    """
    optimizer = check_optimizer(optimizer)
    comm = comm if comm is not None else world_comm("checkpoint")
    background.wait_pending()  # an asynchronous save in flight commits first
    directory, manifest = together(comm, f"cannot load checkpoint {path}", lambda: read_manifest(path, key),
                                   f"rank {comm.rank}: ", path=Path(path))
    where = f"cannot load checkpoint {directory}"
    known = together(comm, where, lambda: verify_files(directory, manifest["files"], comm.rank, comm.size,
                                                       key is not None, _writers(manifest)),
                     f"rank {comm.rank}: ", path=directory)
    shards, held, tensors, table = together(comm, where, lambda: local_state(optimizer, model, fingerprints=False),
                                            f"rank {comm.rank}: ")
    everyone = load_view(optimizer, held, table, comm)
    saved = Saved(directory, manifest)

    def check() -> None:  # and the scaler's and scheduler's state load, changing neither
        errors = check_load(manifest, everyone, table)
        if not errors and not saved.inline:  # this rank's dtypes against its writers' parts
            errors = check_dtypes(manifest, saved, held)
        if errors:
            raise ValueError("the checkpoint does not fit this optimizer:\n  " + "\n  ".join(errors))
        optimizer.scaler.validate_state_dict(manifest["scaler"])
        if scheduler is not None and manifest.get("scheduler") is None:
            raise ValueError("a scheduler was given but the checkpoint holds no scheduler state (save with "
                             "scheduler=...)")
        if scheduler is not None:
            copies = SimpleNamespace(param_groups=[{k: v for k, v in g.items() if k != "params"}
                                                   for g in optimizer.param_groups])
            Scheduler(copies, scheduler.lr_schedule, scheduler.wd_schedule,
                      on_checkpoint=scheduler.on_checkpoint).load_state_dict(manifest["scheduler"])

    together(comm, where, check)
    staged, staged_model = together(
        comm, where, lambda: (read_ranges(directory, manifest, {n: (h.start, h.end) for n, h in held.items()},
                                          known=known, saved=saved),
                              read_model(directory, manifest, list(tensors), known, saved)),
        f"rank {comm.rank} could not read its part: ", path=directory)

    # Only now is anything changed.
    optimizer.finish_param_sync()  # a gather still in flight would overwrite the loaded parameters
    params = manifest["params"]
    loaded = {n: replace(s, tensors=staged[n], scalars={k: decode_scalar(v) for k, v in
                                                        saved.state(n, s.start, s.end)["scalars"].items()})
              for n, s in shards.items()}
    for stage in optimizer.stages:  # each takes the parameters it steps
        stage.load_param_shards(loaded)
    restore_group_settings(shards, {n: manifest["groups"][params[n]["group"]]["settings"] for n in shards})
    optimizer.scaler.load_state_dict(manifest["scaler"])
    if scheduler is not None:
        scheduler.load_state_dict(manifest["scheduler"])
    with torch.no_grad():
        for key, tensor in tensors.items():
            load_into(tensor, staged_model[key])  # a DTensor takes its shard
    adopt_job(optimizer, manifest.get("job"))  # a resumed run continues the job it resumes: its keep_last
    return CheckpointInfo(directory, manifest.get("step"), manifest["version"], manifest["world_size"])
