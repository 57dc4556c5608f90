"""What a running ``optstack train`` shows and logs as it goes: the progress bar and TensorBoard.

Both are optional extras (``tqdm``; ``tensorboard``); without them the run works the same and prints a
status line at each evaluation instead. Null objects stand in for each, so the loop has no ``if`` checks.
Only rank 0 of a multi-process run gets the real ones.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

__all__ = ["progress_bar", "tensorboard", "NoBar", "Board"]


class NoBar:
    """The progress bar's interface, doing nothing but print status lines."""

    def update(self, n: int) -> None: ...
    def set_postfix(self, **kw: Any) -> None: ...
    def close(self) -> None: ...
    def write(self, s: str) -> None:
        print(s, flush=True)


def progress_bar(total: int, initial: int, enabled: bool) -> Any:
    """A tqdm bar on stderr when ``enabled`` and tqdm is installed, else ``NoBar()``."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is the `demo` extra; without it, status lines at each evaluation
        enabled = False
    if not enabled:
        return NoBar()
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)


class Board:
    """Metrics rows to TensorBoard when ``tensorboard`` is installed; otherwise it does nothing."""

    def __init__(self, writer: Any) -> None:
        self._writer = writer

    def log(self, row: dict[str, Any]) -> None:
        if self._writer is None:
            return
        flat = {f"lr/{k}": v for k, v in row["lr"].items()}
        flat |= {k: row[k] for k in ("loss", "val_loss", "grad_norm", "loss_scale", "tokens_per_s")}
        for key, value in flat.items():
            if value is not None:
                self._writer.add_scalar(key, value, row["step"])

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def tensorboard(path: Path | None) -> Board:
    """A ``Board`` writing under ``path/tensorboard`` (a silent one when ``path`` is None or the package is
    missing)."""
    if path is None:
        return Board(None)
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # the tensorboard package is optional
        return Board(None)
    return Board(SummaryWriter(str(path / "tensorboard")))
