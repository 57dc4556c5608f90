"""The run directory of ``optstack train``: where the config, metrics and checkpoints live, and their I/O.

Layout::

    runs/<name>/
      config.toml            the resolved config (``--config`` it to repeat the run)
      groups.json            which parameter went to which param group, with the group's settings
      metrics.jsonl          one JSON object per step; ``group_lr`` lists each optimizer param group's lr
      checkpoints/           optstack.checkpoint's directory (name-keyed, reshardable, atomic)
        step_00000200/       one checkpoint: optimizer state, scheduler, model tensors, group_map.json
        step_00000200.train_state.json   the loop's own state at that step (below)
        latest               names the newest committed checkpoint
      loss.png lr.png grad_norm.png, sample.txt, summary.json   written at the end

The optimizer, scheduler and model go through ``optstack.checkpoint`` (collective: every rank writes what
it owns). What only the training loop knows (the data sampler's RNG, torch's RNG, best validation loss,
skipped steps, training time, the model size) is a small JSON *train state* beside each checkpoint. Rank 0
writes it atomically (temporary file, fsync, rename) *before* the collective save, and ``latest`` moves
only when that save commits; so the checkpoint ``latest`` names always has its train state on disk. A
train state whose checkpoint never committed is harmless (overwritten or pruned by a later save). Every rank
draws the same global batch from the same sampler (each then keeps its slice), so one sampler state serves
any number of processes.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import torch

from optstack.checkpoint.io import LATEST, resolve_checkpoint
from optstack.tensor_bytes import tensor_bytes

__all__ = ["RunDir", "TrainState", "TRAIN_STATE_VERSION"]

TRAIN_STATE_VERSION = 1
_STATE = re.compile(r"(step_\d+)\.train_state\.json")
_TYPES = {"step": (int,), "model": (dict,), "data_rng": (str,), "torch_rng": (str,), "skipped_steps": (int,),
          "train_seconds": (int, float), "world_size": (int,), "best_val_loss": (int, float, type(None))}


@dataclasses.dataclass(frozen=True)
class TrainState:
    """The training loop's state at a checkpoint (the optimizer's lives in the checkpoint itself).

    Attributes:
        step: the last step taken.
        model: the model size (``GPTConfig`` fields) the run was created with.
        data_rng / torch_rng: ``torch.Generator.get_state()`` of the batch sampler and of torch's default
            CPU generator (uint8 tensors).
        best_val_loss: best validation loss so far (``inf`` before the first evaluation).
        skipped_steps: steps the optimizer skipped.
        train_seconds: time spent in training steps so far.
        world_size: processes the run had when it saved (for information: a resume may use another).
    """

    step: int
    model: dict[str, Any]
    data_rng: torch.Tensor
    torch_rng: torch.Tensor
    best_val_loss: float
    skipped_steps: int
    train_seconds: float
    world_size: int

    def to_json(self) -> str:
        data = dataclasses.asdict(self) | {
            "version": TRAIN_STATE_VERSION,
            "data_rng": _b64(self.data_rng), "torch_rng": _b64(self.torch_rng),
            "best_val_loss": self.best_val_loss if math.isfinite(self.best_val_loss) else None,
        }
        return json.dumps(data, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> TrainState:
        try:
            data = json.loads(text)
            if data.pop("version") != TRAIN_STATE_VERSION:
                raise ValueError("another format version")
            for field, kinds in _TYPES.items():  # JSON is data only; still, each field must be of its kind
                if not isinstance(data.get(field), kinds) or isinstance(data.get(field), bool):
                    raise ValueError(f"{field} is {data.get(field)!r}, expected {'/'.join(k.__name__ for k in kinds)}")
            best = data.pop("best_val_loss")
            rngs = {field: _rng_state(field, data[field]) for field in ("data_rng", "torch_rng")}
            return cls(**data | rngs | {"best_val_loss": math.inf if best is None else float(best)})
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"train state {where!r} is damaged or from another optstack ({error}); "
                             "start a new run with another --out") from None


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(tensor_bytes(t)).decode()


def _rng_state(field: str, text: str) -> torch.Tensor:
    """A generator state from its base64 form, checked by setting it on a throwaway generator (the resume sets
    it on the real ones: a bad state must fail here, naming the file, not there with a bare traceback)."""
    try:
        state = _unb64(text)
        torch.Generator().set_state(state)
    except (ValueError, RuntimeError) as error:
        raise ValueError(f"{field} is not a torch generator state ({str(error).splitlines()[0][:120]})") from None
    return state


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


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
    def latest_checkpoint(self) -> Path | None:
        """The checkpoint ``checkpoints/latest`` names, or None when the run has committed none.

        Raises:
            ValueError: ``latest`` exists but names no checkpoint (the directory was damaged by hand).
        """
        if not (self.checkpoints / LATEST).is_file():
            return None
        return resolve_checkpoint(self.checkpoints)

    def check_start(self, resume: bool) -> Path | None:
        """The checkpoint a run starts from (None for a fresh run), after checking ``resume`` fits the directory.

        Raises:
            ValueError: ``resume`` without a checkpoint, or a fresh run into a directory holding checkpoints.
        """
        latest = self.latest_checkpoint()
        if resume and latest is None:
            raise ValueError(f"--resume: no checkpoint in {str(self.checkpoints)!r} to resume from")
        if not resume and latest is not None:
            raise ValueError(
                f"run directory {str(self.path)!r} already holds checkpoints (latest {latest.name}); pass "
                "--resume to continue it, or choose another --out"
            )
        return latest

    def train_state_path(self, checkpoint: Path) -> Path:
        return checkpoint.parent / f"{checkpoint.name}.train_state.json"

    def write_train_state(self, checkpoint: Path, state: TrainState) -> None:
        """Write the train state of ``checkpoint`` (which need not exist yet) atomically."""
        final = self.train_state_path(checkpoint)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.tmp")
        with open(tmp, "w") as f:
            f.write(state.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(final.parent)

    def read_train_state(self, checkpoint: Path) -> TrainState:
        path = self.train_state_path(checkpoint)
        try:
            text = path.read_text()
        except OSError:
            raise ValueError(f"checkpoint {str(checkpoint)!r} has no train state {path.name!r} beside it; it was "
                             "not written by optstack train (start a new run with another --out)") from None
        return TrainState.from_json(text, str(path))

    def prune_train_states(self) -> None:
        """Delete train states whose checkpoint is gone (pruned by ``keep_last``, or never committed)."""
        for entry in self.checkpoints.iterdir():
            m = _STATE.fullmatch(entry.name)
            if m and not (self.checkpoints / m.group(1)).is_dir():
                entry.unlink(missing_ok=True)

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
