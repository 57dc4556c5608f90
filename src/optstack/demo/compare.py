"""``optstack compare``: the same short training with several optimizers, one after another, side by side.

Each optimizer gets its own run (``<out>/<optimizer>/``, a full ``optstack train`` run directory) with the
same model, data, seed and schedule; only ``optimizer.algorithm`` (and so its default lr) differs. With a learning
rate sweep (several configs per optimizer, e.g. ``--lr-sweep 0.3,1,3`` times its default lr), each lr is a run
of its own (``<out>/<optimizer>/lr=<lr>/``) and the optimizer is represented by its best (lowest best
validation loss): tuning each optimizer a little is what makes the comparison fair (the 2025 "Fantastic
pretraining optimizers" comparison's point). Runs are
sequential in one process, so their wall times compare on the same machine (not under the same load, if
something else runs meanwhile). The results::

    <out>/compare.png    validation loss against steps and against training wall time (two panels)
    <out>/compare.md     the table below (also printed)
    <out>/compare.json   the same rows, plus the unigram baseline
    <out>/compare.csv    the same rows

Columns: optimizer, peak lr (the best of the sweep), final and best validation loss (nats/byte), training time
(s, evaluation and checkpoints excluded), tokens/s, skipped steps and the lrs tried; ``compare.json`` also holds
every run of the sweep.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from optstack.demo.config import TrainConfig
from optstack.demo.rundir import RunDir
from optstack.demo.train import train

__all__ = ["CompareRow", "compare", "format_table", "write_compare_plot"]


@dataclass(frozen=True)
class CompareRow:
    """One optimizer's result (nats/byte for losses; None when never evaluated)."""

    optimizer: str
    lr: float
    final_val_loss: float | None
    best_val_loss: float | None
    train_seconds: float
    tokens_per_s: float
    skipped_steps: int
    run_dir: str
    lrs_tried: tuple[float, ...] = ()


def compare(
    configs: Mapping[str, TrainConfig | Sequence[TrainConfig]],
    out: str | os.PathLike[str],
    *,
    progress: bool | None = None,
    echo: Callable[[str], None] = print,
) -> list[CompareRow]:
    """Train each config in turn (into ``out/<name>``, or ``out/<name>/lr=<lr>`` for a sweep) and write the
    comparison (module docstring).

    Args:
        configs: optimizer name -> its run's configuration, or its sweep's (same model, data, seed and steps).
        out: the comparison directory.
        progress: a progress bar for each run (None = when stderr is a terminal).
        echo: where status lines go.

    Returns:
        One row per optimizer (its best run), in the order given.

    Raises:
        ValueError: no configs, an empty sweep, or a user error of one of the runs (as ``train`` raises it).
    """
    if not configs:
        raise ValueError("compare needs at least one optimizer")
    sweeps = {name: [c] if isinstance(c, TrainConfig) else list(c) for name, c in configs.items()}
    empty = [name for name, runs in sweeps.items() if not runs]
    if empty:
        raise ValueError(f"compare: optimizer {empty[0]!r} has no run to make (an empty lr sweep)")
    steps = {c.train.steps for runs in sweeps.values() for c in runs}
    if len(steps) != 1:
        raise ValueError(f"compared runs must take the same number of steps, got {sorted(steps)}")
    out = Path(out)
    rows, curves, every, baseline = [], {}, [], math.nan
    for name, runs in sweeps.items():
        tried = []
        for cfg in runs:
            where = out / name if len(runs) == 1 else out / name / f"lr={cfg.optimizer.lr:g}"
            echo(f"=== {name}" + (f" lr={cfg.optimizer.lr:g}" if len(runs) > 1 else "") + " ===")
            summary = train(cfg, where, progress=progress, echo=echo)
            baseline = summary.baseline
            metrics = RunDir(where).read_metrics()
            curve = [(r["step"], r["time_s"], r["val_loss"]) for r in metrics if r.get("val_loss") is not None]
            row = CompareRow(
                optimizer=name, lr=cfg.optimizer.lr, final_val_loss=summary.final_val_loss,
                best_val_loss=summary.best_val_loss, train_seconds=summary.train_seconds,
                tokens_per_s=summary.tokens_per_s, skipped_steps=summary.skipped_steps, run_dir=summary.run_dir,
                lrs_tried=tuple(c.optimizer.lr for c in runs))
            tried.append((row, curve))
            every.append(row)
        # the best lr: lowest best validation loss (a diverged run's NaN or missing loss never wins)
        row, curve = min(tried, key=lambda rc: _loss_key(rc[0].best_val_loss))
        rows.append(row)
        curves[name if len(runs) == 1 else f"{name} (lr={row.lr:g})"] = curve
    table = format_table(rows, baseline)
    (out / "compare.md").write_text(table + "\n")
    (out / "compare.json").write_text(json.dumps(
        {"baseline": baseline, "rows": [dataclasses.asdict(r) for r in rows],
         "sweep": [dataclasses.asdict(r) for r in every]}, indent=2) + "\n")
    with open(out / "compare.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[fl.name for fl in dataclasses.fields(CompareRow)])
        writer.writeheader()
        writer.writerows(dataclasses.asdict(r) for r in rows)
    plot = write_compare_plot(curves, out / "compare.png", baseline=baseline)
    echo(table)
    echo(f"wrote {out / 'compare.md'}, compare.json, compare.csv" + (", compare.png" if plot else ""))
    return rows


def _loss_key(loss: float | None) -> float:
    return loss if loss is not None and math.isfinite(loss) else math.inf


def _num(value: float | None, fmt: str) -> str:
    return "n/a" if value is None or not math.isfinite(value) else format(value, fmt)


def format_table(rows: Sequence[CompareRow], baseline: float) -> str:
    """The rows as a markdown table, best validation loss first marked, with the unigram baseline below."""
    best = min((r.best_val_loss for r in rows if r.best_val_loss is not None), default=None)
    swept = any(len(r.lrs_tried) > 1 for r in rows)
    lines = ["| optimizer | lr | final val loss | best val loss | train time (s) | tokens/s | skipped |"
             + (" lrs tried |" if swept else ""),
             "|---|---:|---:|---:|---:|---:|---:|" + ("---|" if swept else "")]
    for r in rows:
        mark = " *" if best is not None and r.best_val_loss == best and len(rows) > 1 else ""
        lines.append(f"| {r.optimizer}{mark} | {r.lr:g} | {_num(r.final_val_loss, '.4f')} | "
                     f"{_num(r.best_val_loss, '.4f')} | {r.train_seconds:.1f} | {r.tokens_per_s:,.0f} | "
                     f"{r.skipped_steps} |" + (f" {', '.join(f'{lr:g}' for lr in r.lrs_tried)} |" if swept else ""))
    lines.append(f"\nLosses in nats/byte; the unigram baseline of the validation split is {_num(baseline, '.4f')}."
                 + (" * = lowest best val loss." if len(rows) > 1 else ""))
    return "\n".join(lines)


def write_compare_plot(curves: Mapping[str, Sequence[tuple[int, float, float]]], path: Path, *,
                       baseline: float | None = None) -> Path | None:
    """Validation loss against steps (left) and against training seconds (right), one line per optimizer.

    Args:
        curves: name -> [(step, training seconds so far, validation loss)].
        path: the PNG to write.
        baseline: a dashed reference line (the unigram entropy).

    Returns:
        ``path``, or None when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed; must precede pyplot
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for name, points in curves.items():
        if not points:
            continue
        steps, seconds, losses = zip(*points, strict=True)
        by_step.plot(steps, losses, "o-", lw=1.5, ms=3, label=name)
        by_time.plot(seconds, losses, "o-", lw=1.5, ms=3, label=name)
    for ax, xlabel in ((by_step, "step"), (by_time, "training time (s)")):
        if baseline is not None and math.isfinite(baseline):
            ax.axhline(baseline, ls="--", color="gray", label=f"unigram baseline ({baseline:.3f})")
        ax.set(xlabel=xlabel)
        ax.grid(alpha=0.3)
    by_step.set(ylabel="validation loss (nats/byte)", title="validation loss by step")
    by_time.set(title="validation loss by wall time")
    by_step.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

