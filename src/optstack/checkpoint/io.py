"""Files and directories of checkpoints: atomic commits, the ``latest`` pointer, keep-last-K, checksums, and
``CheckpointError``, what a storage failure becomes.

A save writes into a temporary directory beside its target (``.step_00000100.tmp-<id>``), flushes it, renames
it into place and atomically replaces ``latest``: a process killed at any point leaves the previous checkpoints
and ``latest`` as they were. The rename is the commit: a step directory always holds a complete checkpoint, and
loads take the newest one even when ``latest`` is stale (a save killed between the rename and ``latest``).

Several jobs may save into one root. The saving process holds an ``flock`` on ``<temp>/.owner`` for the whole
save; the kernel drops it when the process dies, however it dies. So the next save removes exactly the
temporary directories whose owner is gone (lock free) and never another job's save in progress (lock held).
Where the file system cannot lock (some network mounts), a temporary directory is removed only after a day.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import time
import uuid
import warnings
import zlib
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from optstack.checkpoint.format import MANIFEST

__all__ = ["LATEST", "CheckpointError", "FAILURES", "describe_error", "is_storage_error", "TempDir",
           "checkpoint_name", "replaceable", "make_temp", "remove_stale", "fsync_path", "fsync_tree", "write_synced",
           "commit_dir", "write_latest", "committed_steps", "resolve_checkpoint", "prune", "job_of", "file_checksum",
           "step_of_name"]

LATEST = "latest"
OWNER = ".owner"  # in a temporary directory: flock-ed by the saving process while it saves
STALE_AFTER_S = 24 * 3600  # age after which an unlockable temporary directory counts as abandoned
_LATEST_TEMP_AGE_S = 60.0  # a latest pointer's temporary file lives for milliseconds
_NAME = re.compile(r"^step_(\d+)$")
#: What a failed checkpoint step may raise: DCP's ``CheckpointException`` derives from ``BaseException``.
FAILURES: tuple[type[BaseException], ...] = (Exception, CheckpointException)


class CheckpointError(RuntimeError):
    """Writing or reading a checkpoint's files failed (a full disk, an I/O error, ...), on the rank(s) named.

    Attributes:
        path: the checkpoint directory concerned.
        committed: for a save, True when the step directory was committed (complete and loadable) before the
            failure (only ``latest`` or pruning failed); False when nothing was committed.
    """

    def __init__(self, message: str, path: str | os.PathLike[str], committed: bool = False) -> None:
        super().__init__(message)
        self.path, self.committed = Path(path), committed

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.path, self.committed)


def _causes(exc: BaseException) -> list[BaseException]:
    """The errors inside DCP's ``CheckpointException`` (whose own text names a DCP rank, always 0 here), else exc."""
    if isinstance(exc, CheckpointException):
        return [inner for inner, _ in exc.failures.values()] or [exc]
    return [exc]


def describe_error(exc: BaseException) -> str:
    """One line: the type and text of ``exc`` (of each error DCP wrapped)."""
    return "; ".join(f"{type(e).__name__}: {e}" for e in _causes(exc))


def is_storage_error(exc: BaseException | None) -> bool:
    """Whether ``exc`` is the storage failing (an ``OSError`` but a missing file, which is a damaged checkpoint),
    also inside DCP's wrapper or as the cause of another error (a ``ValueError`` raised from it)."""
    while exc is not None:
        if any(isinstance(e, OSError) and not isinstance(e, FileNotFoundError) for e in _causes(exc)):
            return True
        exc = exc.__cause__
    return False


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint of ``step`` (sorts by step)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return f"step_{step:08d}"


def _latest_name(root: Path) -> str | None:
    try:
        return (root / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def replaceable(target: Path) -> bool:
    """Whether a save of ``target``'s step may replace it: absent, or committed but never acknowledged (``latest``
    does not name it: its save was killed between the rename and ``latest``, or reported that ``latest`` failed)."""
    return not target.exists() or (target / MANIFEST).is_file() and _latest_name(target.parent) != target.name


def _refuse_existing(target: Path) -> None:
    if replaceable(target):
        return
    if (target / MANIFEST).is_file():
        raise ValueError(f"checkpoint {target} already exists and '{LATEST}' names it; checkpoints are never "
                         "overwritten: resume from it, delete it, or save under another step")
    raise ValueError(f"{target} already exists but is not a checkpoint (no {MANIFEST}); move or delete it")


def _hidden(path: Path, tag: str = "") -> Path:
    """A fresh name beside ``path`` that loads ignore and the next save removes."""
    return path.parent / f".{path.name}.tmp-{tag}{uuid.uuid4().hex[:12]}"


class TempDir:
    """A save's temporary directory, owned (``flock`` on ``.owner``) until ``release()``."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path, self._fd = path, fd

    def release(self) -> None:
        """Drop the lock (after the directory was renamed into place or removed)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _try_lock(fd: int) -> bool | None:
    """flock ``fd`` without waiting: True (locked), False (another process holds it), None (cannot lock here)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return None


def make_temp(target: Path) -> TempDir:
    """A new empty directory beside ``target``, locked by this process, after removing abandoned saves' leftovers.

    Raises:
        ValueError: ``target`` exists and may not be replaced (``replaceable``).
        OSError: the file system failed.
    """
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    remove_stale(root)
    _refuse_existing(target)
    while True:
        path = _hidden(target)
        path.mkdir()
        try:
            fd = os.open(path / OWNER, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:
            continue  # another save's cleanup took the directory before the lock existed: take a new name
        locked = _try_lock(fd)
        # The same file still at its place: no cleanup took it between mkdir and the lock (else try again).
        if locked is not False and _same_file(fd, path / OWNER):
            return TempDir(path, fd)
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def remove_stale(root: Path) -> None:
    """Remove the temporary entries of saves whose process is gone; keep every save in progress (module doc)."""
    now = time.time()
    for entry in root.iterdir():
        if not (entry.name.startswith((".step_", f".{LATEST}.tmp-")) and ".tmp-" in entry.name):
            continue
        try:
            if not entry.is_dir():  # a latest pointer written aside; another job's lives for milliseconds
                if now - entry.stat().st_mtime > _LATEST_TEMP_AGE_S:
                    entry.unlink(missing_ok=True)
                continue
            _remove_if_abandoned(entry, now)
        except FileNotFoundError:
            continue  # its owner renamed or removed it meanwhile


def _remove_if_abandoned(entry: Path, now: float) -> None:
    try:
        fd = os.open(entry / OWNER, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:  # a save killed before it locked, a pruned checkpoint, or a save this instant
        shutil.rmtree(entry, ignore_errors=True)  # (that save finds its lock file gone and takes a new name)
        return
    try:
        locked = _try_lock(fd)
        if locked is False or locked is None and now - entry.stat().st_mtime < STALE_AFTER_S:
            return  # a save in progress, or cannot tell yet
        shutil.rmtree(entry, ignore_errors=True)  # while holding the lock: its owner is gone
    finally:
        os.close(fd)


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's entry to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush every file and directory under ``path`` (and ``path`` itself) to disk."""
    for root, _, files in os.walk(path):
        for name in files:
            fsync_path(Path(root) / name)
        fsync_path(Path(root))


def write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def commit_dir(temp: Path, target: Path) -> Path | None:
    """Rename the finished ``temp`` to ``target``: the commit. An unacknowledged ``target`` (``replaceable``) is
    first renamed aside; returns that hidden directory, for the caller to remove once ``latest`` is written.

    Raises:
        ValueError: ``target`` exists and may not be replaced (e.g. another job committed it meanwhile).
        OSError: the rename failed (nothing was committed).
    """
    _refuse_existing(target)
    aside = None
    if target.exists():
        aside = _hidden(target, "deleting-")
        os.rename(target, aside)
    os.rename(temp, target)  # fails (ENOTEMPTY) rather than replace a checkpoint another job committed meanwhile
    return aside


def write_latest(root: Path, name: str) -> None:
    """Point ``root/latest`` at checkpoint ``name``: written aside, flushed, renamed over the old pointer."""
    temp = _hidden(root / LATEST)
    try:
        write_synced(temp, name + "\n")
        os.replace(temp, root / LATEST)
    finally:
        temp.unlink(missing_ok=True)  # only left when the write or the rename failed
    fsync_path(root)


def committed_steps(root: Path) -> list[Path]:
    """The committed checkpoints in ``root`` (step directories with a manifest), oldest first."""
    try:
        entries = list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = sorted((step, p) for p in entries
                   if (step := step_of_name(p.name)) is not None and (p / MANIFEST).is_file())
    return [p for _, p in found]


def step_of_name(name: str) -> int | None:
    """The step a checkpoint directory's name ``step_<N>`` stands for, None for another name."""
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """``path`` when it holds a manifest, else the newest committed checkpoint in it (normally the one ``latest``
    names; a newer one when a save was killed between its commit and ``latest``: a warning says so).

    Raises:
        ValueError: ``path`` holds no committed checkpoint.
    """
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    steps, pointer, name = committed_steps(path), path / LATEST, _latest_name(path)
    if not steps:
        if name is not None:
            raise ValueError(f"{pointer} names {name!r}, which is not a checkpoint in {path}")
        if path.is_dir() and any(p.name.startswith(".step_") for p in path.iterdir()):
            raise ValueError(f"{path} holds only unfinished saves (no '{LATEST}' pointer, no {MANIFEST}); a "
                             "save was interrupted before any checkpoint was committed")
        raise ValueError(f"no checkpoint at {path}: it has neither {MANIFEST} nor a '{LATEST}' pointer")
    if name != steps[-1].name:
        said = f"names {name!r}" if name is not None else "is missing"
        warnings.warn(f"{pointer} {said} but {steps[-1].name} is the newest committed checkpoint in {path} (a save "
                      f"ended between its commit and '{LATEST}'); loading {steps[-1].name}", stacklevel=2)
    return steps[-1]


def job_of(path: Path) -> str | None:
    """The ``job`` a committed checkpoint's manifest names (None: none, or unreadable: never this job's)."""
    try:
        text = (path / MANIFEST).read_text()
        stat = (path / MANIFEST).stat()
    except (OSError, UnicodeDecodeError):
        return None
    key = (str(path), stat.st_ino, stat.st_mtime_ns, stat.st_size)
    if key not in _JOB_CACHE:
        try:
            job = json.loads(text, parse_int=lambda s: 0).get("job")  # ints are not what is read here
        except (ValueError, RecursionError, AttributeError):
            job = None
        if len(_JOB_CACHE) > 4096:
            _JOB_CACHE.clear()
        _JOB_CACHE[key] = job if isinstance(job, str) else None
    return _JOB_CACHE[key]


_JOB_CACHE: dict[tuple[str, int, int, int], str | None] = {}


def prune(root: Path, keep_last: int, keep: Path, job: str, legacy: bool = False) -> None:
    """Delete all but the ``keep_last`` newest checkpoints in ``root`` that ``job`` wrote (never ``keep``; with
    ``legacy``, also those written before manifests named their job). Another job's checkpoints are never
    touched, so jobs sharing a root prune only their own; a checkpoint another prune takes meanwhile is skipped."""
    def mine(path: Path) -> bool:
        owner = job_of(path)
        return owner == job or legacy and owner is None and (path / MANIFEST).is_file()

    keep = keep.resolve()
    found = sorted((step, p) for p in root.iterdir() if (step := step_of_name(p.name)) is not None and p.is_dir()
                   and (p.resolve() == keep or mine(p)))
    doomed = [p for _, p in found[: max(len(found) - keep_last, 0)] if p.resolve() != keep]
    for path in doomed:
        # Rename first: a crash mid-delete then leaves a hidden directory, never a damaged checkpoint.
        trash = _hidden(path, "deleting-")
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            continue  # another prune of this job took it
        shutil.rmtree(trash, ignore_errors=True)
    if doomed:
        fsync_path(root)


def file_checksum(path: Path) -> dict[str, Any]:
    """A file's manifest entry, read in chunks: ``{"bytes": size, "crc32": CRC-32 as 8 hex digits}``."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"bytes": size, "crc32": f"{crc:08x}"}
