"""The run directory of ``optstack train``: where the config, metrics and checkpoints live, and their I/O.

Layout::

    runs/<name>/
      config.toml            the resolved config (``--config`` it to repeat the run)
      groups.json            which parameter went to which param group, with the group's settings
      metrics.jsonl          one JSON object per step
      checkpoints/step_000200.pt ...   the last ``train.keep_checkpoints`` checkpoints
      loss.png lr.png grad_norm.png, sample.txt, summary.json   written at the end

Checkpoints are written atomically (temporary file, fsync, rename, fsync of the folder), so a crash while
saving leaves the previous checkpoint whole. This is the demo's own format until ``optstack.checkpoint``
provides the name-keyed, reshardable one.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

__all__ = ["RunDir", "CHECKPOINT_VERSION"]

CHECKPOINT_VERSION = 1
_CKPT = re.compile(r"step_(\d+)\.pt")


class RunDir:
    """Paths and file I/O of one run directory.

    Args:
        path: the run directory (created on demand).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @property
    def config(self) -> Path:
        return self.path / "config.toml"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def create(self) -> None:
        self.checkpoints.mkdir(parents=True, exist_ok=True)

    # -- checkpoints -------------------------------------------------------------------------------------
    def checkpoint_paths(self) -> list[Path]:
        """Checkpoints in step order (oldest first)."""
        if not self.checkpoints.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.checkpoints.iterdir() if (m := _CKPT.fullmatch(p.name))]
        return [p for _, p in sorted(found)]

    def latest_checkpoint(self) -> Path | None:
        paths = self.checkpoint_paths()
        return paths[-1] if paths else None

    def save_checkpoint(self, step: int, payload: dict[str, Any], keep: int) -> Path:
        """Write ``payload`` (plus step, version) as ``step_<step>.pt`` atomically; keep the last ``keep``."""
        self.create()
        final = self.checkpoints / f"step_{step:06d}.pt"
        tmp = final.with_name(final.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save({"version": CHECKPOINT_VERSION, "step": step, **payload}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(self.checkpoints)
        for old in self.checkpoint_paths()[:-keep]:
            old.unlink()
        return final

    @staticmethod
    def load_checkpoint(path: Path) -> dict[str, Any]:
        """Read a checkpoint written by ``save_checkpoint``.

        Raises:
            ValueError: the file is truncated, not a checkpoint, or from another format version.
        """
        try:
            data = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as error:  # torch raises several types for a damaged file; all mean the same here
            raise ValueError(
                f"checkpoint {str(path)!r} cannot be read ({type(error).__name__}: {error}); it may be "
                "truncated. Delete it to resume from the previous checkpoint, or start a new run with "
                "another --out"
            ) from None
        if not isinstance(data, dict) or data.get("version") != CHECKPOINT_VERSION:
            found = data.get("version") if isinstance(data, dict) else type(data).__name__
            raise ValueError(
                f"checkpoint {str(path)!r} has format version {found!r}; this optstack reads version "
                f"{CHECKPOINT_VERSION}"
            )
        return data

    # -- metrics -----------------------------------------------------------------------------------------
    def append_metrics(self, row: dict[str, Any]) -> None:
        with open(self.metrics, "a") as f:
            f.write(json.dumps(row) + "\n")

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics.exists():
            return []
        return [json.loads(line) for line in self.metrics.read_text().splitlines() if line.strip()]

    def truncate_metrics(self, last_step: int) -> None:
        """Drop rows after ``last_step`` (written after the checkpoint a resumed run starts from)."""
        rows = [r for r in self.read_metrics() if r["step"] <= last_step]
        tmp = self.metrics.with_name(self.metrics.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, self.metrics)

    def write_json(self, name: str, data: Any) -> Path:
        path = self.path / name
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")  # dtypes etc. as text
        return path


def _fsync_dir(path: Path) -> None:
    # The rename is durable only once the directory entry is on disk (POSIX); Windows cannot open a folder.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
