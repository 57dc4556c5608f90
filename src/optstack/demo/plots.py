"""PNG plots of a run's metrics (loss and validation loss, learning rate, grad norm), via matplotlib (Agg).

matplotlib is the ``demo`` extra; without it the run still works and the plots are skipped with a note.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["write_plots"]


def write_plots(
    rows: Sequence[dict[str, Any]], out_dir: Path, *, baseline: float | None = None
) -> list[Path]:
    """Write ``loss.png``, ``lr.png`` and ``grad_norm.png`` from metrics rows into ``out_dir``.

    Args:
        rows: metrics rows (``step``, ``loss``, ``val_loss`` or None, ``lr`` {kind: lr}, ``grad_norm``).
        out_dir: where the PNGs go.
        baseline: a horizontal reference line on the loss plot (the unigram entropy, nats/byte).

    Returns:
        The files written (empty when matplotlib is not installed or there are no rows).
    """
    if not rows:
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed; must precede pyplot
        import matplotlib.pyplot as plt
    except ImportError:
        return []

    steps = [r["step"] for r in rows]
    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in rows], lw=1, alpha=0.8, label="train loss")
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val, strict=True), "o-", lw=2, label="validation loss")
    if baseline is not None:
        ax.axhline(baseline, ls="--", color="gray", label=f"unigram baseline ({baseline:.3f})")
    ax.set(xlabel="step", ylabel="loss (nats/byte)", title="loss")
    ax.legend()
    ax.grid(alpha=0.3)
    save(fig, "loss.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    kinds = sorted({k for r in rows for k in r.get("lr", {})})
    for kind in kinds:
        pts = [(r["step"], r["lr"][kind]) for r in rows if kind in r.get("lr", {})]
        ax.plot(*zip(*pts, strict=True), label=kind)
    ax.set(xlabel="step", ylabel="learning rate", title="learning rate per group kind")
    if kinds:
        ax.legend()
    ax.grid(alpha=0.3)
    save(fig, "lr.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    gn = [(r["step"], r["grad_norm"]) for r in rows if r.get("grad_norm") is not None]
    if gn:
        ax.plot(*zip(*gn, strict=True), lw=1)
    ax.set(xlabel="step", ylabel="grad norm (before clipping)", title="gradient norm", yscale="log")
    ax.grid(alpha=0.3)
    save(fig, "grad_norm.png")
    return written
