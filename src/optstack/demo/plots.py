"""PNG plots of a run's metrics (loss and validation loss, learning rate, grad norm), via matplotlib (Agg).

matplotlib is the ``demo`` extra; without it the run still works and the plots are skipped with a note
(``MISSING_NOTE``, printed by the run).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["MISSING_NOTE", "grad_norm_figure", "loss_figure", "lr_figure", "lr_series", "plots_available",
           "write_plots"]


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


#: The extra that brings matplotlib, and what to run without it (the note a run prints when plots are skipped).
MISSING_NOTE = ("plots skipped: matplotlib is not installed (it comes with the demo extra: "
                "pip install 'optstack[demo]'); metrics.jsonl holds every number")
#: Line styles cycled over the param groups: groups that share a schedule draw on top of each other, and a
#: dashed line over a solid one keeps both visible.
_STYLES = ("-", "--", ":", "-.")


def plots_available() -> bool:
    """Whether matplotlib can be imported (the ``demo`` extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot
    import matplotlib.pyplot as plt

    return plt


def loss_figure(rows: Sequence[dict[str, Any]], baseline: float | None = None) -> Any:
    """Training and validation loss against the step, with the baseline as a dashed line."""
    fig, ax = _pyplot().subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1, alpha=0.8, label="train loss")
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val, strict=True), "o-", lw=2, label="validation loss")
    if baseline is not None:
        ax.axhline(baseline, ls="--", color="gray", label=f"unigram baseline ({baseline:.3f})")
    ax.set(xlabel="step", ylabel="loss (nats/byte)", title="loss")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def lr_figure(rows: Sequence[dict[str, Any]], group_labels: Sequence[str] = ()) -> Any:
    """One line per param group (``lr_series``), each in its own style and a little thinner than the one before,
    so that groups on the same schedule all stay visible."""
    fig, ax = _pyplot().subplots(figsize=(7, 4))
    series = {label: pts for label, pts in lr_series(rows, group_labels).items() if pts}
    for i, (label, pts) in enumerate(series.items()):
        ax.plot(*zip(*pts, strict=True), ls=_STYLES[i % len(_STYLES)], lw=max(2.5 - 0.5 * i, 1.0), label=label)
    ax.set(xlabel="step", ylabel="learning rate", title="learning rate per param group")
    if series:
        ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return fig


def grad_norm_figure(rows: Sequence[dict[str, Any]], clip_grad: float = 0.0) -> Any:
    """The grad norm before clipping (log scale), with the clip value as a dashed line when clipping is on."""
    fig, ax = _pyplot().subplots(figsize=(7, 4))
    gn = [(r["step"], r["grad_norm"]) for r in rows if r.get("grad_norm") is not None]
    if gn:
        ax.plot(*zip(*gn, strict=True), lw=1, label="grad norm")
    if clip_grad > 0:
        ax.axhline(clip_grad, ls="--", color="red", label=f"clipped above {clip_grad:g}")
        ax.legend(fontsize="small")
    ax.set(xlabel="step", ylabel="grad norm (before clipping)", title="gradient norm", yscale="log")
    ax.grid(alpha=0.3)
    return fig


def write_plots(
    rows: Sequence[dict[str, Any]], out_dir: Path, *, baseline: float | None = None,
    group_labels: Sequence[str] = (), clip_grad: float = 0.0,
) -> list[Path]:
    """Write ``loss.png``, ``lr.png`` and ``grad_norm.png`` from metrics rows into ``out_dir``.

    Args:
        rows: metrics rows (``step``, ``loss``, ``val_loss`` or None, ``lr`` {kind: lr}, ``group_lr`` [lr per
            param group], ``grad_norm``).
        out_dir: where the PNGs go.
        baseline: a horizontal reference line on the loss plot (the unigram entropy, nats/byte).
        group_labels: the legend's name of each param group in ``group_lr`` (see ``lr_series``).
        clip_grad: the clip value, a horizontal line on the grad-norm plot (0: no clipping, no line).

    Returns:
        The files written (empty when matplotlib is not installed, see ``plots_available``, or there are no rows).
    """
    if not rows or not plots_available():
        return []
    plt = _pyplot()
    written: list[Path] = []
    for name, fig in (("loss.png", loss_figure(rows, baseline)), ("lr.png", lr_figure(rows, group_labels)),
                      ("grad_norm.png", grad_norm_figure(rows, clip_grad))):
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
