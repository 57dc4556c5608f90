"""Files and directories of checkpoints: atomic commits, the ``latest`` pointer, keep-last-K, checksums.

A save writes into a temporary directory beside its target (``.step_00000100.tmp-<id>``), flushes it, renames
it into place and atomically replaces ``latest``: a process killed at any point leaves the previous checkpoints
and ``latest`` as they were. Loads ignore hidden ``.tmp-`` entries; the next save removes them.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
import zlib
from pathlib import Path
from typing import Any

from optstack.checkpoint.format import MANIFEST

__all__ = ["LATEST", "checkpoint_name", "make_temp", "fsync_path", "fsync_tree", "write_synced", "commit_dir",
           "write_latest", "resolve_checkpoint", "prune", "file_checksum"]

LATEST = "latest"
_NAME = re.compile(r"^step_(\d+)$")


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint of ``step`` (sorts by step)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return f"step_{step:08d}"


def _refuse_existing(target: Path) -> None:
    if target.exists():
        raise ValueError(f"checkpoint {target} already exists; checkpoints are never overwritten: delete it or "
                         "save under another step")


def _hidden(path: Path, tag: str = "") -> Path:
    """A fresh name beside ``path`` that loads ignore and the next save removes."""
    return path.parent / f".{path.name}.tmp-{tag}{uuid.uuid4().hex[:12]}"


def make_temp(target: Path) -> Path:
    """A new empty directory beside ``target`` (ValueError if that exists), after clearing killed saves' leftovers."""
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    for entry in root.iterdir():
        if entry.name.startswith((".step_", f".{LATEST}.tmp-")) and ".tmp-" in entry.name:
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
    _refuse_existing(target)
    path = _hidden(target)
    path.mkdir()
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


def write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def commit_dir(temp: Path, target: Path) -> None:
    """Rename the finished ``temp`` to ``target`` (never over an existing one) and flush the parent."""
    _refuse_existing(target)
    os.rename(temp, target)
    fsync_path(target.parent)


def write_latest(root: Path, name: str) -> None:
    """Point ``root/latest`` at checkpoint ``name``: written aside, flushed, renamed over the old pointer."""
    temp = _hidden(root / LATEST)
    write_synced(temp, name + "\n")
    os.replace(temp, root / LATEST)
    fsync_path(root)


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """``path`` when it holds a manifest, else the checkpoint its ``latest`` names; ValueError when neither exists."""
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


def prune(root: Path, keep_last: int, keep: Path) -> None:
    """Delete all but the ``keep_last`` newest checkpoints in ``root`` (never ``keep``)."""
    found = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir())
    doomed = [p for _, p in found[: max(len(found) - keep_last, 0)] if p.resolve() != keep.resolve()]
    for path in doomed:
        # Rename first: a crash mid-delete then leaves a hidden directory, never a damaged checkpoint.
        trash = _hidden(path, "deleting-")
        os.rename(path, trash)
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
