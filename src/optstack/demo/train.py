"""``optstack train``: train the demo GPT with the optimizer stack and leave a practitioner's run directory.

``train(cfg, out)`` is the whole run in one process: load the corpus, build the model, build the optimizer
and scheduler through ``make_optimizer`` (the one place the optimizer comes from), then loop: micro-batches
with gradient accumulation, ``optimizer.step() -> StepResult``, the scheduler stepped only when the update
was applied (as Megatron does), validation every ``train.eval_every`` steps, a metrics row per step and a
checkpoint every ``train.checkpoint_every`` steps. At the end: plots, a generated text sample, a summary.

Resuming restores the model, optimizer, scheduler and the data sampler's RNG, so a resumed run repeats the
uninterrupted run's numbers exactly (same machine, same threads).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from optstack.demo.config import TrainConfig, config_to_dict, to_toml
from optstack.demo.data import Corpus, load_corpus, unigram_entropy
from optstack.demo.gpt import GPT, generate
from optstack.demo.plots import write_plots
from optstack.demo.rundir import RunDir
from optstack.schedule import LRSchedule

__all__ = ["TrainSummary", "make_optimizer", "train", "group_kind"]


@dataclass(frozen=True)
class TrainSummary:
    """What a finished run reports (also written to ``summary.json``).

    Attributes:
        run_dir: the run directory.
        start_step / last_step: the step the run (re)started from and the last step taken.
        final_loss: training loss of the last step (nats/byte).
        best_val_loss: best validation loss seen (nats/byte), None if never evaluated.
        baseline: unigram cross-entropy of the validation split under the training bytes' frequencies.
        train_seconds: time in training steps (all sessions of the run), excluding evaluation and checkpoints.
        tokens_per_s: training throughput over the whole run.
        num_params: trainable parameters.
        skipped_steps: steps the optimizer skipped (non-finite gradients).
        sample: the generated text.
    """

    run_dir: str
    start_step: int
    last_step: int
    final_loss: float
    best_val_loss: float | None
    baseline: float
    train_seconds: float
    tokens_per_s: float
    num_params: int
    skipped_steps: int
    sample: str


def make_optimizer(cfg: TrainConfig, model: nn.Module) -> Any:
    """The optimizer stack and scheduler for ``model``: ``optstack.build_optimizer`` with the default rules.

    Returns:
        An object with ``optimizer`` (``step() -> StepResult``, ``zero_grad``, ``scale_loss``,
        ``param_groups``, ``state_dict``), ``scheduler`` and ``param_groups`` (the model-side groups).
    """
    from optstack.factory import build_optimizer

    s = cfg.schedule
    lr_schedule = LRSchedule(
        init_lr=s.init_lr, max_lr=cfg.optimizer.lr, min_lr=cfg.optimizer.min_lr, warmup_steps=s.warmup_steps,
        decay_steps=cfg.decay_steps, style=s.style, wsd_decay_steps=s.wsd_decay_steps, wsd_style=s.wsd_style,
    )
    return build_optimizer(cfg.optimizer, model, lr_schedule=lr_schedule)


def group_kind(group: dict[str, Any], base_algorithm: str) -> str:
    """A short label for a param group in logs: 'default', or what sets its LR apart (e.g. 'max_lr=0.01')."""
    parts = []
    if not group.get("default_config", True):
        parts.append(f"max_lr={group['max_lr']:.3g}")
    if group.get("algorithm", base_algorithm) != base_algorithm:
        parts.append(group["algorithm"])
    if group.get("is_expert_parallel"):
        parts.append("expert")
    return ",".join(parts) or "default"


def _lr_by_kind(groups: list[dict[str, Any]], base_algorithm: str) -> dict[str, float]:
    return {group_kind(g, base_algorithm): float(g["lr"]) for g in groups}


def _pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device='cuda' but no CUDA device is available; use 'auto' or 'cpu'")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource
    except ImportError:  # not on Windows
        return float("nan")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@torch.no_grad()
def _evaluate(model: nn.Module, corpus: Corpus, cfg: TrainConfig, device: torch.device) -> float:
    # The same validation batches every time (fixed seed), so curves compare across steps and runs.
    gen = torch.Generator().manual_seed(cfg.train.seed + 1_000_003)
    model.eval()
    total = 0.0
    for _ in range(cfg.train.eval_batches):
        x, y = corpus.get_batch("val", cfg.train.batch_size, cfg.model.seq_len, gen)
        total += _loss(model, x.to(device), y.to(device)).item()
    model.train()
    return total / cfg.train.eval_batches


def train(
    cfg: TrainConfig,
    out: str | Path,
    *,
    resume: bool = False,
    progress: bool | None = None,
    echo: Callable[[str], None] = print,
) -> TrainSummary:
    """Train the demo GPT and write the run directory.

    Args:
        cfg: the resolved configuration.
        out: the run directory.
        resume: continue from the latest checkpoint in ``out`` (an error when there is none).
        progress: show a tqdm progress bar (None = when stderr is a terminal).
        echo: where status lines go.

    Raises:
        ValueError: user errors (no checkpoint to resume, a run directory that already holds checkpoints
            without ``resume``, a checkpoint from another model, bad data path, ...).
    """
    run = RunDir(out)
    latest = run.latest_checkpoint()
    if resume and latest is None:
        raise ValueError(f"--resume: no checkpoint in {str(run.checkpoints)!r} to resume from")
    if not resume and latest is not None:
        raise ValueError(
            f"run directory {str(run.path)!r} already holds checkpoints (latest {latest.name}); pass "
            "--resume to continue it, or choose another --out"
        )
    device = _pick_device(cfg.train.device)
    corpus = load_corpus(cfg.data.path, max_bytes=cfg.data.max_bytes, val_fraction=cfg.data.val_fraction)
    for split in ("train", "val"):
        if corpus.split(split).numel() < cfg.model.seq_len + 1:
            raise ValueError(
                f"the {split} split has {corpus.split(split).numel()} bytes, fewer than model.seq_len + 1 = "
                f"{cfg.model.seq_len + 1}; use more data (data.max_bytes, --data) or a shorter model.seq_len"
            )
    baseline = unigram_entropy(corpus.val, reference=corpus.train)

    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model).to(device=device, dtype=cfg.optimizer.param_dtype)
    num_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    built = make_optimizer(cfg, model)
    optimizer, scheduler = built.optimizer, built.scheduler
    data_gen = torch.Generator().manual_seed(cfg.train.seed)
    start, best_val, skipped, train_time = 0, math.inf, 0, 0.0

    run.create()
    if resume:
        start, best_val, skipped, train_time = _restore(run, latest, cfg, model, optimizer, scheduler, data_gen)
        run.truncate_metrics(start)
        echo(f"resumed {run.path} from {latest.name} (step {start})")
    else:
        run.metrics.unlink(missing_ok=True)
    run.config.write_text(to_toml(config_to_dict(cfg)))
    run.write_json("groups.json", _group_table(built.param_groups))

    bs, seq, accum, steps = cfg.train.batch_size, cfg.model.seq_len, cfg.train.grad_accum, cfg.train.steps
    tokens_per_step = bs * seq * accum
    echo(f"data: {corpus.source}: {corpus.train.numel():,} train / {corpus.val.numel():,} val bytes, "
         f"{corpus.num_files} files; unigram baseline {baseline.nats:.3f} nats/byte "
         f"({baseline.bits:.2f} bits)")
    echo(f"model: {num_params:,} parameters {dataclasses.asdict(cfg.model)} on {device}, "
         f"{cfg.optimizer.precision}; optimizer {cfg.optimizer.algorithm}, lr {cfg.optimizer.lr:g} "
         f"-> {cfg.optimizer.min_lr:g} ({cfg.schedule.style}, warmup {cfg.schedule.warmup_steps}); "
         f"{len(built.param_groups)} param groups; {tokens_per_step:,} tokens/step")
    board = _tensorboard(run.path)
    show_bar = sys.stderr.isatty() if progress is None else progress
    bar = _progress_bar(steps, start, show_bar)
    say = bar.write if show_bar else echo
    last_loss, step = math.nan, start
    try:
        for step in range(start + 1, steps + 1):
            t0 = time.perf_counter()
            optimizer.zero_grad()
            loss_sum = 0.0
            for _ in range(accum):
                x, y = corpus.get_batch("train", bs, seq, data_gen)
                loss = _loss(model, x.to(device), y.to(device)) / accum
                optimizer.scale_loss(loss).backward()
                loss_sum += loss.item()
            lrs = _lr_by_kind(optimizer.param_groups, cfg.optimizer.algorithm)  # the lr this step uses
            result = optimizer.step()
            if result.applied:
                scheduler.step()
            else:
                skipped += 1
            dt = time.perf_counter() - t0
            train_time += dt
            last_loss = loss_sum
            val_loss = None
            if step % cfg.train.eval_every == 0 or step == steps:
                val_loss = _evaluate(model, corpus, cfg, device)
                best_val = min(best_val, val_loss)
                say(f"step {step}/{steps}: loss {loss_sum:.4f}, val loss {val_loss:.4f}, "
                    f"{tokens_per_step / dt:,.0f} tokens/s")
            row = {
                "step": step, "loss": loss_sum, "val_loss": val_loss, "lr": lrs,
                "grad_norm": result.grad_norm, "loss_scale": result.loss_scale, "skipped": not result.applied,
                "tokens_per_s": tokens_per_step / dt, "peak_mem_mb": _peak_memory_mb(device),
                "time_s": train_time,
            }
            run.append_metrics(row)
            board.log(row)
            bar.update(1)
            bar.set_postfix(loss=f"{loss_sum:.3f}", lr=f"{next(iter(lrs.values())):.2e}",
                            gnorm=f"{result.grad_norm or math.nan:.2f}", tok_s=f"{tokens_per_step / dt:,.0f}")
            if step % cfg.train.checkpoint_every == 0 or step == steps:
                payload = _payload(cfg, model, optimizer, scheduler, data_gen, best_val, skipped, train_time)
                run.save_checkpoint(step, payload, keep=cfg.train.keep_checkpoints)
    except KeyboardInterrupt:
        bar.close()
        ckpt = run.latest_checkpoint()
        raise KeyboardInterrupt(
            f"interrupted at step {step}; the latest checkpoint is {ckpt.name if ckpt else 'none'}; "
            f"continue with: optstack train --out {run.path} --resume"
        ) from None
    bar.close()
    board.close()
    return _finish(run, cfg, model, device, start, step, last_loss, best_val, baseline.nats, train_time,
                   tokens_per_step, num_params, skipped, echo)


def _progress_bar(total: int, initial: int, enabled: bool) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is the `demo` extra; without it, status lines at each evaluation
        enabled = False
    if not enabled:
        return _NoBar()
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)


class _TensorBoard:
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


def _tensorboard(path: Path) -> _TensorBoard:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # the tensorboard package is optional
        return _TensorBoard(None)
    return _TensorBoard(SummaryWriter(str(path / "tensorboard")))


class _NoBar:
    """The progress bar's interface, doing nothing (so the loop has no `if bar` checks)."""

    def update(self, n: int) -> None: ...
    def set_postfix(self, **kw: Any) -> None: ...
    def close(self) -> None: ...
    def write(self, s: str) -> None:
        print(s)


def _group_table(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"group": i, "params": list(g["param_names"]),
         # lr / weight_decay are the scheduler's current values, not settings
         "settings": {k: v for k, v in g.items() if k not in ("params", "param_names", "lr", "weight_decay")}}
        for i, g in enumerate(groups)
    ]


def _payload(cfg: TrainConfig, model: nn.Module, optimizer: Any, scheduler: Any, data_gen: torch.Generator,
             best_val: float, skipped: int, train_time: float) -> dict[str, Any]:
    return {
        "model_size": dataclasses.asdict(cfg.model),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "data_rng": data_gen.get_state(),
        "torch_rng": torch.get_rng_state(),
        "best_val_loss": best_val,
        "skipped_steps": skipped,
        "train_seconds": train_time,
    }


def _restore(run: RunDir, path: Path, cfg: TrainConfig, model: nn.Module, optimizer: Any, scheduler: Any,
             data_gen: torch.Generator) -> tuple[int, float, int, float]:
    ckpt = run.load_checkpoint(path)
    if ckpt["model_size"] != dataclasses.asdict(cfg.model):
        raise ValueError(
            f"cannot resume {str(run.path)!r}: it was created with model {ckpt['model_size']}, but this "
            f"config has model {dataclasses.asdict(cfg.model)}; drop the model overrides or use another --out"
        )
    model.load_state_dict(ckpt["model"])
    try:
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
    except (ValueError, KeyError, RuntimeError) as error:
        raise ValueError(
            f"cannot resume {str(run.path)!r} from {path.name}: the optimizer or schedule in the config "
            f"differs from the checkpoint's ({error}). Resume with the run's own config.toml (a longer run "
            "needs schedule.decay_steps set from the start)"
        ) from None
    data_gen.set_state(ckpt["data_rng"])
    torch.set_rng_state(ckpt["torch_rng"])
    return int(ckpt["step"]), float(ckpt["best_val_loss"]), int(ckpt["skipped_steps"]), float(ckpt["train_seconds"])


def _finish(run: RunDir, cfg: TrainConfig, model: GPT, device: torch.device, start: int, step: int,
            last_loss: float, best_val: float, baseline: float, train_time: float, tokens_per_step: int,
            num_params: int, skipped: int, echo: Callable[[str], None]) -> TrainSummary:
    write_plots(run.read_metrics(), run.path, baseline=baseline)
    sample = ""
    if cfg.train.sample_bytes:
        prompt = torch.tensor(list(cfg.train.sample_prompt.encode()), dtype=torch.long, device=device)
        ids = generate(model, prompt[-cfg.model.seq_len:], cfg.train.sample_bytes,
                       temperature=cfg.train.sample_temperature,
                       generator=torch.Generator().manual_seed(cfg.train.seed))
        sample = bytes(ids.tolist()).decode("utf-8", errors="replace")
        (run.path / "sample.txt").write_text(sample)
        echo(f"--- sample ({cfg.train.sample_bytes} bytes) ---\n{sample}\n--- end of sample ---")
    summary = TrainSummary(
        run_dir=str(run.path), start_step=start, last_step=step, final_loss=last_loss,
        best_val_loss=best_val if math.isfinite(best_val) else None, baseline=baseline,
        train_seconds=train_time, tokens_per_s=step * tokens_per_step / train_time if train_time else 0.0,
        num_params=num_params, skipped_steps=skipped, sample=sample,
    )
    run.write_json("summary.json", dataclasses.asdict(summary))
    best = f"{summary.best_val_loss:.4f}" if summary.best_val_loss is not None else "n/a"
    echo(f"done: steps {start}->{step}, {train_time:.1f} s of training in all ({summary.tokens_per_s:,.0f} tokens/s); "
         f"best val loss {best} nats/byte ({_bits(summary.best_val_loss)}) vs unigram baseline "
         f"{baseline:.4f} ({_bits(baseline)}); run dir {run.path}")
    return summary


def _bits(nats: float | None) -> str:
    return "n/a" if nats is None else f"{nats / math.log(2):.3f} bits/byte"

