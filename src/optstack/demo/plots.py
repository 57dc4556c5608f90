"""PNG plots of a run's metrics (loss and validation loss, learning rate, grad norm), via matplotlib (Agg).

matplotlib is the ``demo`` extra; without it the run still works and the plots are skipped with a note.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["write_plots", "lr_series"]


def lr_series(
    rows: Sequence[dict[str, Any]], group_labels: Sequence[str] = ()
) -> dict[str, list[tuple[int, float]]]:
    """The lines of ``lr.png``: label -> ``(step, lr)`` points.

    One line per param group from the rows' ``group_lr`` (labelled ``group_labels[i]``, else ``group i``);
    rows written before ``group_lr`` existed give one line per group kind from their ``lr`` dict.
    """
    if any("group_lr" in r for r in rows):
        count = max(len(r.get("group_lr", ())) for r in rows)
        labels = [group_labels[i] if i < len(group_labels) else f"group {i}" for i in range(count)]
        return {label: [(r["step"], r["group_lr"][i]) for r in rows if i < len(r.get("group_lr", ()))]
                for i, label in enumerate(labels)}
    kinds = sorted({k for r in rows for k in r.get("lr", {})})
    return {kind: [(r["step"], r["lr"][kind]) for r in rows if kind in r.get("lr", {})] for kind in kinds}


def write_plots(
    rows: Sequence[dict[str, Any]], out_dir: Path, *, baseline: float | None = None,
    group_labels: Sequence[str] = (),
) -> list[Path]:
    """Write ``loss.png``, ``lr.png`` and ``grad_norm.png`` from metrics rows into ``out_dir``.

    Args:
        rows: metrics rows (``step``, ``loss``, ``val_loss`` or None, ``lr`` {kind: lr}, ``group_lr`` [lr per
            param group], ``grad_norm``).
        out_dir: where the PNGs go.
        baseline: a horizontal reference line on the loss plot (the unigram entropy, nats/byte).
        group_labels: the legend's name of each param group in ``group_lr`` (see ``lr_series``).

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
    series = lr_series(rows, group_labels)
    for label, pts in series.items():
        if pts:
            ax.plot(*zip(*pts, strict=True), label=label)
    ax.set(xlabel="step", ylabel="learning rate", title="learning rate per param group")
    if series:
        ax.legend(fontsize="small")
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
