"""Files and directories of checkpoints: atomic commits, the ``latest`` pointer, keep-last-K, checksums.

A save writes into a temporary directory beside its target (``.step_00000100.tmp-<id>``), flushes every
file and directory to disk, then renames it into place (one atomic ``rename`` on POSIX file systems) and
atomically replaces the ``latest`` pointer file. A process killed at any point leaves the previous
checkpoints and ``latest`` as they were; its temporary directory is ignored by loads and removed by the
next save. Old checkpoints are first renamed out of the way, then deleted, so a half-deleted one never
looks like a checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
import zlib
from pathlib import Path

from optstack.checkpoint.format import MANIFEST

__all__ = [
    "LATEST", "checkpoint_name", "temp_dir_beside", "fsync_path", "fsync_tree", "commit_dir",
    "write_latest", "resolve_checkpoint", "prune", "remove_stale", "file_checksum",
]

LATEST = "latest"
_NAME = re.compile(r"^step_(\d+)$")
_CHUNK = 1 << 23  # bytes read at a time while checksumming


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint of ``step`` (sorts by step)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return f"step_{step:08d}"


def temp_dir_beside(target: Path) -> Path:
    """A new empty directory in ``target``'s parent, named so loads ignore it and saves clean it up."""
    path = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:12]}"
    path.mkdir(parents=False)
    return path


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


def commit_dir(temp: Path, target: Path) -> None:
    """Rename the finished ``temp`` to ``target`` and flush the parent directory.

    Raises:
        ValueError: ``target`` exists (checkpoints are never overwritten in place).
    """
    if target.exists():
        raise ValueError(f"checkpoint {target} already exists; checkpoints are never overwritten: delete it or "
                         "save under another step")
    os.rename(temp, target)
    fsync_path(target.parent)


def write_latest(root: Path, name: str) -> None:
    """Point ``root/latest`` at checkpoint ``name``: written aside, flushed, renamed over the old pointer."""
    temp = root / f".{LATEST}.tmp-{uuid.uuid4().hex[:12]}"
    with open(temp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, root / LATEST)
    fsync_path(root)


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The checkpoint directory ``path`` names: itself when it holds a manifest, else the one its ``latest``
    pointer names.

    Raises:
        ValueError: neither, or ``latest`` names a checkpoint that does not exist.
    """
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    pointer = path / LATEST
    if not pointer.is_file():
        if path.is_dir() and any(p.name.startswith(".step_") for p in path.iterdir()):
            raise ValueError(f"{path} holds only unfinished saves (no '{LATEST}' pointer, no {MANIFEST}); a "
                             "save was interrupted before any checkpoint was committed")
        raise ValueError(f"no checkpoint at {path}: it has neither {MANIFEST} nor a '{LATEST}' pointer")
    name = pointer.read_text().strip()
    if not _NAME.match(name) or not (path / name / MANIFEST).is_file():
        raise ValueError(f"{pointer} names {name!r}, which is not a checkpoint in {path}")
    return path / name


def _checkpoints(root: Path) -> list[tuple[int, Path]]:
    found = []
    for entry in root.iterdir():
        match = _NAME.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _remove(path: Path) -> None:
    # Rename first: a crash mid-delete then leaves a hidden directory, never a damaged checkpoint.
    trash = path.parent / f".{path.name}.tmp-deleting-{uuid.uuid4().hex[:8]}"
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def prune(root: Path, keep_last: int, keep: Path) -> list[Path]:
    """Delete all but the ``keep_last`` newest checkpoints in ``root`` (never ``keep``); returns the deleted."""
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be None or an int >= 1, got {keep_last!r}")
    found = [p for _, p in _checkpoints(root)]
    doomed = [p for p in found[: max(len(found) - keep_last, 0)] if p.resolve() != keep.resolve()]
    for path in doomed:
        _remove(path)
    if doomed:
        fsync_path(root)
    return doomed


def remove_stale(root: Path) -> None:
    """Delete temporary directories and pointer files left in ``root`` by saves that were killed."""
    for entry in root.iterdir():
        if entry.name.startswith((".step_", f".{LATEST}.tmp-")) and ".tmp-" in entry.name:
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def file_checksum(path: Path) -> tuple[int, str]:
    """(size in bytes, CRC-32 as 8 hex digits) of a file, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, f"{crc:08x}"
