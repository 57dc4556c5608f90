"""``save_checkpoint``: every rank writes the slices it owns, rank 0 commits the whole atomically.

All ranks agree after each step (one rank's failure is every rank's error, never a hang): every error a step
can raise, DCP's ``BaseException`` included, is caught and exchanged, so each rank leaves a failed save together
with the others, as soon as the slowest has finished the step::

    collect   each rank's name-keyed ParamShards (and the model's tensors, when asked)
    plan      the same pure plan on every rank: replicated state written once, writes balanced by bytes
    write     each rank its DCP directory, flushed and checksummed, into rank 0's temporary (locked) directory;
              each checks that every data file its DCP metadata names is there
    commit    rank 0: every listed file present at its size, the sealed manifest and the group map, flush,
              rename into place (the commit), then ``latest`` and prune
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, overload

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from optstack.checkpoint import background, io
from optstack.checkpoint.digest import DIGEST, check_key, file_sha256, sign
from optstack.checkpoint.format import (
    FORMAT,
    GROUP_MAP,
    MANIFEST,
    PART,
    VERSION,
    dtype_name,
    json_lines,
    model_key,
    optim_key,
    seal,
)
from optstack.checkpoint.io import FAILURES, CheckpointError
from optstack.checkpoint.manifest import Agreement, agreement, plan_from_view, view_of
from optstack.checkpoint.pack import pack_chunks
from optstack.checkpoint.safe import METADATA, load_metadata
from optstack.checkpoint.state import (
    HeldParam,
    ModelTable,
    SavePlan,
    collect,
    describe,
    fingerprint,
    group_map,
    part_of,
    plan_save,
)
from optstack.checkpoint.storage import Chunk, rank_dir_name, write_chunks
from optstack.distributed.comm import Comm, NullComm, world_comm
from optstack.names import model_state
from optstack.optimizer import ChainedOptimizer
from optstack.protocol import ParamShard
from optstack.schedule import Scheduler

__all__ = ["save_checkpoint", "save_plan", "manifest_of", "together", "local_state", "check_optimizer", "load_into",
           "whole_values"]

T = TypeVar("T")
Failure = tuple[bool, str] | None  # (a storage error?, its line), exchanged between ranks

#: How long rank 0 waits, at the start of a save, for every other rank to call ``save_checkpoint`` too before it
#: raises (the habit of single-file saves, ``if rank == 0: save(...)``, would otherwise hang until the process
#: group's timeout, 30 minutes by default). The other ranks wait as long as the group allows: rank 0 is often
#: the late one (logging, evaluation on rank 0 only).
ARRIVAL_TIMEOUT_S = 20.0


def _every_rank_arrives(comm: Comm | NullComm, target: Path) -> None:
    """Rank 0 raises within ``ARRIVAL_TIMEOUT_S`` when another rank of ``comm`` does not call the save."""
    if comm.size == 1:
        return
    # on the device the Comm exchanges objects on (host memory for gloo, the current accelerator for NCCL)
    handle = comm.all_reduce_async(torch.ones(1, device=comm.object_device()))
    if comm.rank == 0:
        deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
        while not handle.is_completed():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"cannot save checkpoint {target}: rank 0 waited {ARRIVAL_TIMEOUT_S:g} s for the other "
                    f"{comm.size - 1} rank(s) of the {comm.name!r} group to call save_checkpoint too. Saving is "
                    "collective (each rank writes the optimizer state it holds): call save_checkpoint(...) on every "
                    "rank, not under `if rank == 0:`. The group now holds an unfinished collective: restart the "
                    "job. (If the other ranks were only late, raise optstack.checkpoint.save.ARRIVAL_TIMEOUT_S.)")
            time.sleep(0.002)
    handle.wait()


@dataclass(frozen=True)
class Job:
    """Who writes an optimizer's checkpoints: ``keep_last`` prunes only checkpoints of the same job.

    A job is an optimizer's line of checkpoints: a fresh id on its first save, or the id of the checkpoint
    ``load_checkpoint`` loaded into it (a resumed run continues its job). ``legacy``: loaded from a checkpoint
    written before manifests named their job, which this job may then prune too."""

    id: str
    legacy: bool = False


_JOBS: weakref.WeakKeyDictionary[ChainedOptimizer, Job] = weakref.WeakKeyDictionary()


def job_of_optimizer(optimizer: ChainedOptimizer) -> Job:
    return _JOBS.setdefault(optimizer, Job(uuid.uuid4().hex))


def adopt_job(optimizer: ChainedOptimizer, job: Any) -> None:
    """After a load: ``optimizer`` continues the job of the checkpoint whose manifest names ``job``."""
    _JOBS[optimizer] = Job(job) if isinstance(job, str) and job else Job(uuid.uuid4().hex, legacy=True)


def _agree(comm: Comm | NullComm, failure: Failure, what: str, path: Path | None = None, storage: bool = False,
           cause: BaseException | None = None, committed: bool = False) -> None:
    """Raise one error on every rank when any rank has a ``failure`` (collective): a ``CheckpointError`` about
    ``path`` if ``storage`` or any rank's failure is a storage error (and ``path`` is given), else ``ValueError``."""
    failures = [f for f in comm.all_gather_object(failure) if f]
    if not failures:
        return
    message = f"{what}: " + "\n".join(dict.fromkeys(line for _, line in failures))
    if path is not None and (storage or any(s for s, _ in failures)):
        raise CheckpointError(message, path, committed) from cause
    raise ValueError(message) from cause


def together(comm: Comm | NullComm, what: str, fn: Callable[[], T], prefix: str = "", *, path: Path | None = None,
             storage: bool = False) -> T:
    """``fn()`` on this rank; any error on any rank becomes one error on every rank (collective; ``_agree``).

    ``ValueError``s read as they are, other errors with their type; ``prefix`` (e.g. the rank) leads the line."""
    try:
        result, failure, cause = fn(), None, None
    except FAILURES as exc:
        text = str(exc) if isinstance(exc, ValueError) else io.describe_error(exc)
        result, failure, cause = None, (io.is_storage_error(exc), prefix + text), exc
    _agree(comm, failure, what, path, storage, cause)
    return result  # type: ignore[return-value]


def local_state(optimizer: ChainedOptimizer, model: nn.Module | None, fingerprints: bool = True) -> tuple[
        dict[str, ParamShard], dict[str, HeldParam], dict[str, torch.Tensor], ModelTable | None]:
    """This rank's shards of all stages and their table, the model's tensors and theirs (None: no model)."""
    shards = {name: shard for per_stage in collect(optimizer.stages) for name, shard in per_stage.items()}
    tensors = model_state(model) if model is not None else {}  # a DTensor stays one (``whole_values``, ``load_into``)
    # (a DTensor's shape is the whole tensor's: the table is the same on every rank)
    table = None if model is None else {k: (tuple(t.shape), dtype_name(t.dtype)) for k, t in tensors.items()}
    return shards, describe(shards, fingerprints), tensors, table


def save_plan(optimizer: ChainedOptimizer, shards: Mapping[str, ParamShard], held: Mapping[str, HeldParam],
              table: ModelTable | None, comm: Comm | NullComm) -> SavePlan:
    """Who writes what and the manifest's parameters, groups and model (collective; no data is read or written).

    Computed on each rank from the optimizer's stages (``manifest.py``); ranks exchange only a fixed-size
    ``Agreement``. Where a stage cannot say what the other ranks hold, or the ranks' views differ, the ranks
    exchange their tables instead and ``state.plan_save`` plans from them (naming any disagreement).

    Raises:
        ValueError: on every rank alike, when the ranks' state cannot be saved by name (``plan_save``).
    """
    where = "cannot plan the checkpoint"

    def mine() -> tuple[Any, Agreement]:
        view = view_of(optimizer.stages, comm.global_ranks)
        whole = {} if view is None else {n: fingerprint(shards[n].tensors["param"]) for n, p in view.items()
                                        if p.runs is None and n in shards}
        return view, Agreement.of(view, table, held, whole, comm.rank)

    view, agreed = together(comm, where, mine, f"rank {comm.rank}: ")
    if agreement(comm.all_gather_object(agreed)):
        return plan_from_view(view, table, comm.size, comm.rank)
    full = together(comm, where, lambda: describe(shards), f"rank {comm.rank}: ")
    gathered = comm.all_gather_object((full, table))
    return plan_save([t for t, _ in gathered], None if table is None else [m for _, m in gathered])  # pure


def manifest_of(plan: SavePlan, step: int, world_size: int, scaler: dict[str, Any],
                scheduler: dict[str, Any] | None, files: dict[str, Any], job: str) -> dict[str, Any]:
    """The manifest of a save (``format.py``), unsealed and unsigned."""
    return {"format": FORMAT, "version": VERSION, "step": step, "world_size": world_size,
            "checksum_algorithm": "crc32", "params": plan.params, "groups": plan.groups, "scaler": scaler,
            "scheduler": scheduler, "model": plan.model, "files": files, "job": job}


def check_optimizer(optimizer: Any) -> ChainedOptimizer:
    if not isinstance(optimizer, ChainedOptimizer):
        raise ValueError(f"optimizer must be an optstack ChainedOptimizer (build_optimizer(...).optimizer), got "
                         f"{type(optimizer).__name__}")
    return optimizer


def whole_values(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with every DTensor gathered whole (collective over its mesh, in name order on every rank, so
    every rank calls the same gathers): a checkpoint holds whole model tensors, which load at any sharding. Each
    rank holds the whole of every sharded tensor until it is written: for models too large for that, save the
    model with DCP (``dcp.save({"model": model.state_dict(), ...})``) and the optimizer here."""
    return {name: t.full_tensor() if isinstance(t, DTensor) else t for name, t in tensors.items()}


def load_into(target: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy a loaded whole tensor into a model tensor: a DTensor takes its shard of it (no communication)."""
    if isinstance(target, DTensor):
        from torch.distributed.tensor import distribute_tensor

        if target.device_mesh.get_coordinate() is None:
            return  # this rank holds none of it
        whole = distribute_tensor(whole.to(target.device_mesh.device_type), target.device_mesh,
                                  target.placements, src_data_rank=None).to_local()
        target.to_local().copy_(whole)
    else:
        target.copy_(whole)


@overload
def save_checkpoint(root: str | os.PathLike[str], optimizer: ChainedOptimizer, *, step: int,
                    scheduler: Scheduler | None = None, model: nn.Module | None = None,
                    comm: Comm | NullComm | None = None, keep_last: int | None = None,
                    key: bytes | str | None = None, blocking: Literal[True] = True) -> Path: ...


@overload
def save_checkpoint(root: str | os.PathLike[str], optimizer: ChainedOptimizer, *, step: int,
                    scheduler: Scheduler | None = None, model: nn.Module | None = None,
                    comm: Comm | NullComm | None = None, keep_last: int | None = None,
                    key: bytes | str | None = None, blocking: Literal[False]) -> background.SaveHandle: ...


def save_checkpoint(root: str | os.PathLike[str], optimizer: ChainedOptimizer, *, step: int,
                    scheduler: Scheduler | None = None, model: nn.Module | None = None,
                    comm: Comm | NullComm | None = None, keep_last: int | None = None,
                    key: bytes | str | None = None, blocking: bool = True) -> Path | background.SaveHandle:
    """Save the whole optimizer as ``root/step_<step>`` (returned), then point ``root/latest`` at it (collective).

    Saves the fp32 masters, every algorithm's state and the loss scaler by parameter name, and the scheduler and
    model when given. Atomic: a crash at any point leaves the previous checkpoints loadable.

    Args:
        root: the directory of checkpoints (created if needed; shared by every rank).
        optimizer: the chained optimizer (any stages: replicated, ZeRO-1, layer-wise).
        scheduler, model: saved too (the model's parameters and buffers).
        comm: the ranks that hold the optimizer's state (default: the world, or this process alone).
        keep_last: keep only this many newest checkpoints of this job in ``root`` (None: all). A job is this
            optimizer's line of checkpoints (``Job``): checkpoints other jobs write into ``root`` are never
            pruned, and neither is the one this call returns.
        key: a secret to sign the checkpoint with (``digest.py``): every file's SHA-256 and an HMAC-SHA256 of the
            manifest, which ``load_checkpoint(..., key=...)`` checks (None: unsigned; CRC-32s only).
        blocking: False: return a ``SaveHandle`` as soon as this rank's state is copied to host memory (pinned
            for device tensors); the write, the checks, the commit, ``latest`` and pruning go on in a background
            thread (over a process group of their own), while training steps. ``handle.wait()`` returns the
            path or raises what a blocking save would; ``handle.done()``; ``handle.error``. The next save (or
            load) waits for it first.

    Returns:
        The checkpoint's directory (``blocking=True``), or a ``SaveHandle`` for it (``blocking=False``).

    Another save of ``step`` (the same or another job's) may replace ``root/step_<step>`` only while no ``latest``
    names it: a save killed after its commit, before ``latest``, is replaced rather than blocking every restart.

    Raises:
        RuntimeError: on rank 0 within ``ARRIVAL_TIMEOUT_S``, when another rank does not call ``save_checkpoint``.
        ValueError: on every rank alike, for bad arguments, a checkpoint of ``step`` that ``latest`` names, state
            that cannot be saved by name, or ranks that disagree.
        CheckpointError: (a ``RuntimeError``) on every rank alike, naming the rank(s), path and error: writing
            failed (a full disk, an I/O error); its ``committed`` is False, the temporary files are removed and
            the previous checkpoints are unchanged. Or, with ``committed`` True, the step was committed (complete,
            loadable) but updating ``latest`` or pruning then failed.
    """
    optimizer = check_optimizer(optimizer)
    comm = comm if comm is not None else world_comm("checkpoint")
    key = check_key(key)
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be None or an int >= 1, got {keep_last!r}")
    if not isinstance(blocking, bool):
        raise ValueError(f"blocking must be True or False, got {blocking!r}")
    target = Path(root) / io.checkpoint_name(step)
    background.wait_pending()  # the previous asynchronous save first: saves commit in order
    where = f"cannot save checkpoint {target}"
    _every_rank_arrives(comm, target)
    job = job_of_optimizer(optimizer)
    optimizer.finish_param_sync()  # overlapped parameter gathers must land before the model is read

    shards, held, tensors, table = together(comm, where, lambda: local_state(optimizer, model, fingerprints=False),
                                            f"rank {comm.rank}: ")
    tensors = whole_values(tensors)  # collective where the model is sharded (FSDP2, tensor parallel)
    plan = save_plan(optimizer, shards, held, table, comm)
    writer = background.comm_for(comm) if not blocking else comm  # created before the temporary directory
    temp = together(comm, where, lambda: io.make_temp(target) if comm.rank == 0 else None, "rank 0: ", path=target)
    path = comm.broadcast_object(temp.path if temp is not None else None)
    save = _Save(target, step, path, temp, plan, shards, held, tensors, job, keep_last, key,
                 optimizer.scaler.state_dict(), scheduler.state_dict() if scheduler is not None else None)
    if blocking:
        save.run(comm)
        return target
    try:
        save = together(comm, where, save.on_host, f"rank {comm.rank} could not copy its state to host memory: ")
    except BaseException:
        save.abandon()
        background.give_back(save.buffers)
        raise
    return background.start(target, lambda: save.run(writer))


@dataclass
class _Save:
    """One save from the write on: its plan and this rank's state (live for a blocking save, host copies for
    an asynchronous one), run on every rank over one ``Comm`` (the caller's, or the background's)."""

    target: Path
    step: int
    path: Path  # rank 0's temporary directory
    temp: io.TempDir | None  # rank 0: its lock
    plan: SavePlan
    shards: dict[str, ParamShard]
    held: dict[str, HeldParam]
    tensors: dict[str, torch.Tensor]
    job: Job
    keep_last: int | None
    key: bytes | None
    scaler: dict[str, Any]
    scheduler: dict[str, Any] | None
    buffers: list[torch.Tensor] = dataclasses.field(default_factory=list)  # host buffers to give back

    def on_host(self) -> _Save:
        """This save with every tensor copied to host memory (pinned for a device's), so training may go on."""
        self.shards, self.tensors, self.buffers = background.on_host(self.shards, self.tensors)
        return self

    def abandon(self) -> None:
        if self.temp is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.temp.release()

    def run(self, comm: Comm | NullComm) -> Path:
        """Write, commit, ``latest``, prune (collective over ``comm``); ``save_checkpoint``'s errors."""
        target, path, temp, plan, key, job, keep_last = (self.target, self.path, self.temp, self.plan, self.key,
                                                         self.job, self.keep_last)

        def commit(files: dict[str, Any]) -> str | None:
            """Rank 0: commit, then ``latest`` and prune; raise when nothing was committed, else return the error."""
            _check_written(path, files)
            manifest = manifest_of(plan, self.step, comm.size, self.scaler, self.scheduler, files, job.id)
            if key is not None:
                manifest[DIGEST] = sign(manifest, key)
            io.write_synced(path / MANIFEST, seal(manifest))
            io.write_synced(path / GROUP_MAP, json_lines(group_map(plan.params, plan.groups)))
            io.fsync_path(path)
            aside = io.commit_dir(path, target)
            try:  # committed: what fails from here on leaves a complete checkpoint behind
                (target / io.OWNER).unlink(missing_ok=True)
                io.fsync_path(target.parent)
                io.write_latest(target.parent, target.name)
                if aside is not None:
                    shutil.rmtree(aside, ignore_errors=True)
                if keep_last is not None:
                    io.prune(target.parent, keep_last, keep=target, job=job.id, legacy=job.legacy)
            except FAILURES as exc:
                return io.describe_error(exc)
            return None

        failed = f"saving checkpoint {target} failed; nothing was committed, the previous checkpoints are unchanged"
        committed = False
        try:
            written = together(comm, failed, lambda: _write_rank(path, comm.rank, plan, self.shards, self.held,
                                                                 self.tensors, key is not None),
                               f"rank {comm.rank} could not write its files: ", path=target, storage=True)
            # each rank's few files' sizes and checksums: O(world) bytes, whatever the number of parameters
            files = {k: v for mine in comm.all_gather_object(written) for k, v in mine.items()}
            late = together(comm, failed, lambda: commit(files) if comm.rank == 0 else None,
                            "rank 0 could not commit: ", path=target, storage=True)
            committed = True
            _agree(comm, None if late is None else (True, f"rank 0: {late}"),
                   f"checkpoint {target} IS committed (complete and loadable), but then updating '{io.LATEST}' or "
                   f"pruning failed; '{io.LATEST}' may still name an earlier checkpoint (loads take the newest "
                   "committed one regardless)", target, storage=True, committed=True)
        except (CheckpointError, ValueError):  # agreed: every rank is here
            if not committed:
                if temp is not None:
                    shutil.rmtree(path, ignore_errors=True)  # every rank has left the write: nothing writes into it
                comm.barrier()  # so that no rank sees the error while the temporary files still exist
            raise
        finally:
            if temp is not None:
                if not committed:
                    shutil.rmtree(path, ignore_errors=True)  # also after a failed collective (a rank died)
                temp.release()
            self.shards, self.held, self.tensors = {}, {}, {}
            background.give_back(self.buffers)  # for the next asynchronous save
        return target


def _check_written(temp: Path, files: Mapping[str, Mapping[str, Any]]) -> None:
    """Every file the ranks listed is in ``temp`` at its size (ValueError naming the first that is not)."""
    for name, want in files.items():
        try:
            size = (temp / name).stat().st_size
        except FileNotFoundError:
            raise ValueError(f"{temp / name} was written but is gone (removed by another process?)") from None
        if size != want["bytes"]:
            raise ValueError(f"{temp / name} has {size} bytes, written were {want['bytes']} (changed by another "
                             "process?)")


def _write_rank(temp: Path, rank: int, plan: SavePlan, shards: Mapping[str, ParamShard],
                held: Mapping[str, HeldParam], tensors: Mapping[str, torch.Tensor], signed: bool = False
                ) -> dict[str, dict[str, Any]]:
    """Write this rank's share of the plan as one DCP directory and its part of the manifest (``PART``);
    return its files' sizes and checksums (and SHA-256s when ``signed``)."""
    chunks = [Chunk(optim_key(name, key), t, start, torch.Size(shards[name].shape).numel())
              for name, start, _ in plan.writes[rank] for key, t in shards[name].tensors.items()]
    for key in plan.model_writes[rank]:
        t = tensors[key].detach().reshape(-1)
        chunks.append(Chunk(model_key(key), t, 0, t.numel()))
    data = any(c.tensor.numel() for c in chunks)
    if not data and not plan.writes[rank]:
        return {}
    chunks, segments = pack_chunks(chunks) if data else ([], [])
    directory = temp / rank_dir_name(rank)
    if data:
        write_chunks(directory, chunks)
    directory.mkdir(exist_ok=True)  # without data: a part alone, the state entries of empty parameters
    io.write_synced(directory / PART, seal(part_of(plan.writes[rank], held, segments)))
    io.fsync_tree(directory)
    files = {f"{directory.name}/{path.name}": io.file_checksum(path) | ({"sha256": file_sha256(path)} if signed else {})
             for path in sorted(directory.iterdir())}
    if data:
        _check_named_files(directory, files)
    return files


def _check_named_files(directory: Path, files: Mapping[str, Mapping[str, Any]]) -> None:
    """Every data file the DCP metadata just written in ``directory`` names is among ``files``, long enough.

    The manifest lists ``files`` and load verifies them, the metadata included; so a checkpoint whose metadata
    names a file that is not there is never committed (it could not be loaded)."""
    needed: dict[str, int] = {}
    with open(directory / METADATA, "rb") as f:  # an OSError here is a storage error, as for the writes
        metadata = load_metadata(f, str(directory / METADATA))  # data only, like every read of a checkpoint
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in needed.items():
        got = files.get(f"{directory.name}/{name}")
        if got is None or got["bytes"] < size:
            raise ValueError(f"{directory / name}, which the DCP metadata names, is "
                             f"{'missing' if got is None else 'truncated'} after the write")
