"""``optstack train``: train the demo GPT with the optimizer stack and leave a practitioner's run directory.

``train(cfg, out)`` is the whole run on one rank: load the corpus, build the model, wrap it for data
parallelism (``wrap_data_parallel``; a world of one process is a world too), build the optimizer and
scheduler through ``make_optimizer`` (the one place the optimizer comes from), then loop: micro-batches with
gradient accumulation, ``optimizer.step()`` (its ``last_result`` a ``StepResult``), the scheduler stepped
only when the update was applied (as Megatron does), validation every ``train.eval_every`` steps, a metrics
row per step and a checkpoint every ``train.checkpoint_every`` steps. At the end: plots, a generated
text sample, a summary.

Several processes (``optstack.demo.launch``) run the same function, one per rank: every rank draws the same
global batch from the same sampler and keeps its slice of ``batch_size / world size`` rows; the wrapper
averages the gradients, so the run equals one process on the same global batch (to fp32 round-off). The
reported loss is the mean over ranks. Only rank 0 prints and writes metrics, plots and the sample; every rank
takes part in the (collective) checkpoint saves and loads.

Resuming restores the model, optimizer and scheduler (``optstack.checkpoint``, at any process count) and the
loop's train state (``rundir.TrainState``), so a resumed run repeats the uninterrupted run's numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from optstack.checkpoint import SaveHandle, load_checkpoint, save_checkpoint
from optstack.checkpoint.io import checkpoint_name
from optstack.demo.config import TrainConfig, config_to_dict, to_toml
from optstack.demo.data import Corpus, load_corpus, unigram_entropy
from optstack.demo.gpt import GPT, generate
from optstack.demo.plots import MISSING_NOTE, plots_available, write_plots
from optstack.demo.progress import progress_bar, tensorboard
from optstack.demo.rundir import RunDir, TrainState
from optstack.distributed.comm import Comm, NullComm, world_comm
from optstack.factory import build_optimizer, wrap_data_parallel
from optstack.schedule import LRSchedule

__all__ = ["TrainSummary", "make_optimizer", "train", "group_kind", "group_label", "pick_device", "check_start"]


@dataclass(frozen=True)
class TrainSummary:
    """What a finished run reports (also written to ``summary.json``).

    Attributes:
        run_dir: the run directory.
        start_step / last_step: the step the run (re)started from and the last step taken.
        final_loss: training loss of the last step (nats/byte).
        final_val_loss: validation loss at the last step (nats/byte), None if not evaluated.
        best_val_loss: best validation loss seen (nats/byte), None if never evaluated.
        baseline: unigram cross-entropy of the validation split under the training bytes' frequencies.
        train_seconds: time in training steps (all sessions of the run), excluding evaluation and checkpoints.
        tokens_per_s: training throughput over the whole run (all processes together).
        num_params: trainable parameters.
        skipped_steps: steps the optimizer skipped (non-finite gradients).
        world_size: processes of this session.
        sample: the generated text.
    """

    run_dir: str
    start_step: int
    last_step: int
    final_loss: float
    final_val_loss: float | None
    best_val_loss: float | None
    baseline: float
    train_seconds: float
    tokens_per_s: float
    num_params: int
    skipped_steps: int
    world_size: int
    sample: str


def make_optimizer(cfg: TrainConfig, model: nn.Module) -> Any:
    """The optimizer stack and scheduler for ``model``: ``optstack.build_optimizer`` with the default rules.

    Args:
        cfg: the run's configuration.
        model: the model, wrapped by ``wrap_data_parallel(cfg.optimizer, model)`` for any sharding but
            ``replicated``.

    Returns:
        ``BuiltOptimizer``: ``optimizer`` (``step()`` with ``last_result``, ``zero_grad``, ``scale_loss``,
        ``param_groups``, ``finish_param_sync``), ``scheduler`` and ``param_groups`` (the model-side groups).
    """
    s = cfg.schedule
    lr_schedule = LRSchedule(
        init_lr=s.init_lr, max_lr=cfg.optimizer.lr, min_lr=cfg.optimizer.min_lr, warmup_steps=cfg.warmup_steps,
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


def group_label(index: int, group: dict[str, Any], base_algorithm: str) -> str:
    """A param group's name in plots: its index, what sets it apart (lr, algorithm, weight decay) and its first
    parameter, e.g. ``'1: wd_mult=0 (blocks.0.ln1.weight +33)'``."""
    kind = group_kind(group, base_algorithm)
    parts = ([f"lr_mult={group['lr_mult']:g}"] if group.get("lr_mult", 1.0) != 1.0 else []) + \
        ([kind] if kind != "default" else []) + \
        ([f"wd_mult={group['wd_mult']:g}"] if group.get("wd_mult", 1.0) != 1.0 else [])
    names = group.get("param_names") or []
    first = f"{names[0]}{f' +{len(names) - 1}' if len(names) > 1 else ''}" if names else "empty"
    return f"{index}: {', '.join(parts) or 'default'} ({first})"


def _lr_by_kind(groups: list[dict[str, Any]], base_algorithm: str) -> dict[str, float]:
    # Groups of one kind may differ in lr (lr_mult); the last wins here, `group_lr` keeps them all.
    return {group_kind(g, base_algorithm): float(g["lr"]) for g in groups}


def pick_device(name: str) -> torch.device:
    """The device ``train.device`` names ('auto': CUDA when available); a CUDA device gets the current index
    (the launcher sets one per rank)."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device='cuda' but no CUDA device is available; use 'auto' or 'cpu'")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device(name)


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource
    except ImportError:  # not on Windows
        return float("nan")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _my_rows(t: torch.Tensor, comm: Comm | NullComm) -> torch.Tensor:
    """This rank's contiguous slice of a global batch (its rows ``[rank * n, (rank + 1) * n)``)."""
    n = t.shape[0] // comm.size
    return t[comm.rank * n:(comm.rank + 1) * n]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@torch.no_grad()
def _evaluate(model: nn.Module, corpus: Corpus, cfg: TrainConfig, device: torch.device,
              comm: Comm | NullComm) -> float:
    # The same validation batches every time (fixed seed), so curves compare across steps and runs.
    gen = torch.Generator().manual_seed(cfg.train.seed + 1_000_003)
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for _ in range(cfg.train.eval_batches):
        x, y = corpus.get_batch("val", cfg.train.batch_size, cfg.model.seq_len, gen)
        total += _loss(model, _my_rows(x, comm).to(device), _my_rows(y, comm).to(device)).double()
    model.train()
    comm.all_reduce(total, "avg")
    return total.item() / cfg.train.eval_batches


def _silent(_: str) -> None: ...


class _GracefulStop:
    """While active (in the main thread), the first Ctrl-C (SIGINT) asks the loop to stop at the end of the
    current step, where it saves a checkpoint so that ``--resume`` always has one; a second Ctrl-C interrupts at
    once, as Python's default does. Nothing is printed from the handler (it may run in the middle of a print)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> _GracefulStop:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def agreed(self, comm: Comm | NullComm, device: torch.device) -> bool:
        """Whether any rank was asked to stop (every rank must stop at the same step: saving is collective)."""
        if comm.size == 1:
            return self.requested
        flag = torch.tensor(float(self.requested), device=device)
        return bool(comm.all_reduce(flag, "max").item())


def _resume_hint(run: RunDir, comm: Comm | NullComm) -> str:
    return f"optstack train --out {run.path} --resume" + (f" --nproc {comm.size}" if comm.size > 1 else "")


def check_start(cfg: TrainConfig, out: str | Path, *, resume: bool, world_size: int
                ) -> tuple[Path | None, TrainState | None]:
    """What a run can check before building anything: the run directory against ``resume``, the saved
    model size against ``cfg.model``, and the batch split over ``world_size`` processes.

    Returns:
        The checkpoint to resume from and its train state (both None for a fresh run).

    Raises:
        ValueError: the user error found, naming the fix.
    """
    run = RunDir(out)
    latest = run.check_start(resume)
    if cfg.train.batch_size % world_size:
        raise ValueError(f"train.batch_size ({cfg.train.batch_size}) must be divisible by the number of "
                         f"processes ({world_size}): each takes an equal slice of the global batch")
    saved = run.read_train_state(latest) if latest is not None else None
    shape = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k != "compute_dtype"}  # not the weights
    if saved is not None and {k: v for k, v in saved.model.items() if k != "compute_dtype"} != shape:
        raise ValueError(
            f"cannot resume {str(run.path)!r}: it was created with model {saved.model}, but this config has "
            f"model {dataclasses.asdict(cfg.model)}; drop the model overrides or use another --out"
        )
    return latest, saved


def train(
    cfg: TrainConfig,
    out: str | Path,
    *,
    resume: bool = False,
    progress: bool | None = None,
    echo: Callable[[str], None] = print,
) -> TrainSummary:
    """Train the demo GPT and write the run directory (on every rank of the world, when there are several).

    Args:
        cfg: the resolved configuration.
        out: the run directory.
        resume: continue from the latest checkpoint in ``out`` (an error when there is none).
        progress: show a tqdm progress bar (None = when stderr is a terminal); rank 0 only.
        echo: where status lines go (rank 0 only).

    Raises:
        ValueError: user errors (no checkpoint to resume, a run directory that already holds checkpoints
            without ``resume``, a checkpoint from another model, bad data path, a batch the processes cannot
            split evenly, ...).
    """
    comm = world_comm("train")
    lead = comm.rank == 0
    echo = echo if lead else _silent
    run = RunDir(out)
    latest, saved = check_start(cfg, run.path, resume=resume, world_size=comm.size)
    if saved is not None and saved.step >= cfg.train.steps and (run.path / "summary.json").is_file():
        # A finished run: nothing to train, and nothing is rewritten (the summary stays the finished run's).
        echo(f"{run.path} is finished: its latest checkpoint is of step {saved.step} and train.steps is "
             f"{cfg.train.steps}; nothing to do. To train further, pass a larger --steps (with "
             "schedule.decay_steps set from the start, the schedule continues as planned)")
        return TrainSummary(**json.loads((run.path / "summary.json").read_text()))
    device = pick_device(cfg.train.device)
    corpus = load_corpus(cfg.data.path, max_bytes=cfg.data.max_bytes, val_fraction=cfg.data.val_fraction)
    for split in ("train", "val"):
        if corpus.split(split).numel() < cfg.model.seq_len + 1:
            raise ValueError(
                f"the {split} split has {corpus.split(split).numel()} bytes, fewer than model.seq_len + 1 = "
                f"{cfg.model.seq_len + 1}; use more data (data.max_bytes, --data) or a shorter model.seq_len"
            )
    baseline = unigram_entropy(corpus.val, reference=corpus.train)

    torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank
    gpt = GPT(cfg.model).to(device=device, dtype=cfg.optimizer.param_dtype)
    model = wrap_data_parallel(cfg.optimizer, gpt)
    num_params = sum(p.numel() for p in gpt.parameters() if p.requires_grad)
    built = make_optimizer(cfg, model)
    optimizer, scheduler = built.optimizer, built.scheduler
    data_gen = torch.Generator().manual_seed(cfg.train.seed)
    start, best_val, skipped, train_time = 0, math.inf, 0, 0.0
    if saved is not None and latest is not None:
        _restore(run, latest, saved, model, optimizer, scheduler, comm)
        data_gen.set_state(saved.data_rng)
        torch.set_rng_state(saved.torch_rng)
        start, best_val, skipped, train_time = (saved.step, saved.best_val_loss, saved.skipped_steps,
                                                saved.train_seconds)
        echo(f"resumed {run.path} from {latest.name} (step {start}, saved by {saved.world_size} process(es))")
    if lead:
        run.create()
        if saved is not None:
            run.truncate_metrics(start)
        else:
            run.metrics.unlink(missing_ok=True)
        run.config.write_text(to_toml(config_to_dict(cfg)))
        run.write_json("groups.json", _group_table(built.param_groups))

    bs, seq, accum, steps = cfg.train.batch_size, cfg.model.seq_len, cfg.train.grad_accum, cfg.train.steps
    tokens_per_step = bs * seq * accum  # the global batch, over all processes
    echo(f"data: {corpus.source}: {corpus.train.numel():,} train / {corpus.val.numel():,} val bytes, "
         f"{corpus.num_files} files; unigram baseline {baseline.nats:.3f} nats/byte "
         f"({baseline.bits:.2f} bits)")
    echo(f"model: {num_params:,} parameters {dataclasses.asdict(cfg.model)} on {device}, "
         f"{cfg.optimizer.precision}; optimizer {cfg.optimizer.algorithm}, lr {cfg.optimizer.lr:g} "
         f"-> {cfg.optimizer.min_lr:g} ({cfg.schedule.style}, warmup {cfg.warmup_steps}); "
         f"{len(built.param_groups)} param groups; {tokens_per_step:,} tokens/step"
         + (f" over {comm.size} processes ({cfg.optimizer.distributed.sharding})" if comm.size > 1 else ""))
    board = tensorboard(run.path if lead else None)
    show_bar = lead and (sys.stderr.isatty() if progress is None else progress)
    bar = progress_bar(steps, start, show_bar)
    say = bar.write if show_bar else echo
    last_loss, val_loss, step = math.nan, None, start
    if saved is not None and (last_row := next(reversed(run.read_metrics()), None)) is not None:
        last_loss, val_loss = last_row["loss"], last_row["val_loss"]  # what a resume that takes no step reports
    stopped = False
    saves = _Saves(run, comm)
    with _GracefulStop() as stop:
        try:
            for step in range(start + 1, steps + 1):
                t0 = time.perf_counter()
                optimizer.zero_grad()
                loss_sum = torch.zeros((), dtype=torch.float64, device=device)
                for micro in range(accum):
                    x, y = corpus.get_batch("train", bs, seq, data_gen)  # the global batch, on every rank
                    x, y = _my_rows(x, comm).to(device), _my_rows(y, comm).to(device)
                    # Gradients are reduced once per step: the last micro-batch's backward starts the reduction.
                    with model.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                        loss = _loss(model, x, y) / accum
                        optimizer.scale_loss(loss).backward()
                    loss_sum += loss.detach().double()
                lrs = _lr_by_kind(optimizer.param_groups, cfg.optimizer.algorithm)  # the lr this step uses
                group_lrs = [float(g["lr"]) for g in optimizer.param_groups]
                optimizer.step()  # with overlap_param_gather, the next forward waits for the params
                result = optimizer.last_result
                if result.applied:
                    scheduler.step()
                else:
                    skipped += 1
                last_loss = comm.all_reduce(loss_sum, "avg").item()
                dt = time.perf_counter() - t0
                train_time += dt
                val_loss = None
                if step % cfg.train.eval_every == 0 or step == steps:
                    optimizer.finish_param_sync()  # every parameter current before evaluation reads them
                    optimizer.eval()  # Schedule-Free: evaluate the averaged weights (a no-op for the others)
                    val_loss = _evaluate(gpt, corpus, cfg, device, comm)
                    optimizer.train()
                    best_val = min(best_val, val_loss)
                    say(f"step {step}/{steps}: loss {last_loss:.4f}, val loss {val_loss:.4f}, "
                        f"{tokens_per_step / dt:,.0f} tokens/s")
                if lead:
                    row = {
                        "step": step, "loss": last_loss, "val_loss": val_loss, "lr": lrs, "group_lr": group_lrs,
                        "grad_norm": result.grad_norm, "loss_scale": result.loss_scale,
                        "skipped": not result.applied, "tokens_per_s": tokens_per_step / dt,
                        "peak_mem_mb": _peak_memory_mb(device), "time_s": train_time,
                    }
                    run.append_metrics(row)
                    board.log(row)
                bar.update(1)
                bar.set_postfix(loss=f"{last_loss:.3f}", lr=f"{next(iter(lrs.values())):.2e}",
                                gnorm=f"{result.grad_norm or math.nan:.2f}", tok_s=f"{tokens_per_step / dt:,.0f}")
                stopped = stop.agreed(comm, device) and step < steps  # at the last step: finish as usual
                if step % cfg.train.checkpoint_every == 0 or step == steps or stopped:
                    if stopped:
                        say(f"interrupted: saving a checkpoint of step {step} (Ctrl-C again to quit without it)")
                    state = TrainState(step=step, model=dataclasses.asdict(cfg.model), data_rng=data_gen.get_state(),
                                       torch_rng=torch.get_rng_state(), best_val_loss=best_val, skipped_steps=skipped,
                                       train_seconds=train_time, world_size=comm.size)
                    saves.save(state, cfg, model, optimizer, scheduler)
                if stopped:
                    break
            saves.finish()
        except KeyboardInterrupt:  # a second Ctrl-C: the step in progress is not saved
            bar.close()
            saves.finish()  # the save in flight commits: it is the checkpoint the message names
            ckpt = run.latest_checkpoint()
            raise KeyboardInterrupt(
                f"interrupted at step {step}; the latest checkpoint is {ckpt.name}; continue with: "
                f"{_resume_hint(run, comm)}" if ckpt is not None else
                f"interrupted at step {step}, before any checkpoint was saved: nothing to resume; start the run "
                "again (without --resume)"
            ) from None
    bar.close()
    if stopped:
        board.close()
        raise KeyboardInterrupt(f"interrupted after step {step}, saved as checkpoint {checkpoint_name(step)}; "
                                f"continue with: {_resume_hint(run, comm)}")
    board.close()
    optimizer.finish_param_sync()  # the sample is generated from the final parameters
    labels = [group_label(i, g, cfg.optimizer.algorithm) for i, g in enumerate(optimizer.param_groups)]
    return _finish(run, cfg, gpt, device, start, step, last_loss, val_loss, best_val, baseline.nats, train_time,
                   tokens_per_step, num_params, skipped, comm, echo, labels, saves.note())


def _group_table(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"group": i, "params": list(g["param_names"]),
         # lr / weight_decay are the scheduler's current values, not settings
         "settings": {k: v for k, v in g.items() if k not in ("params", "param_names", "lr", "weight_decay")}}
        for i, g in enumerate(groups)
    ]


class _Saves:
    """The run's checkpoints, saved asynchronously: the train state (rank 0, first), then
    ``save_checkpoint(..., blocking=False)``, which returns once the state is in host memory; the next save
    (or ``finish``) waits for the one in flight, then drops the train states of pruned checkpoints."""

    def __init__(self, run: RunDir, comm: Comm | NullComm) -> None:
        self.run, self.comm = run, comm
        self.pending: SaveHandle | None = None
        self.count, self.blocked = 0, 0.0  # saves, and seconds the loop waited for them

    def save(self, state: TrainState, cfg: TrainConfig, model: nn.Module, optimizer: Any, scheduler: Any) -> None:
        start = time.perf_counter()
        self._settle()
        target = self.run.checkpoints / checkpoint_name(state.step)
        error = None
        if self.comm.rank == 0:
            try:
                self.run.write_train_state(target, state)
            except OSError as exc:
                error = f"cannot write the train state of {target}: {exc}"
        error = self.comm.broadcast_object(error)  # every rank learns of rank 0's failure instead of waiting on it
        if error:
            raise RuntimeError(error)
        self.pending = save_checkpoint(self.run.checkpoints, optimizer, step=state.step, scheduler=scheduler,
                                       model=model, comm=self.comm, keep_last=cfg.train.keep_checkpoints,
                                       blocking=False)
        self.count += 1
        self.blocked += time.perf_counter() - start

    def finish(self) -> None:
        start = time.perf_counter()
        self._settle()
        self.blocked += time.perf_counter() - start

    def _settle(self) -> None:
        """Wait for the save in flight (its error is every rank's), then prune the train states."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        pending.wait()
        if self.comm.rank == 0:
            self.run.prune_train_states()

    def note(self) -> str:
        return (f"; {self.count} checkpoint{'s' * (self.count != 1)} saved in the background, training blocked "
                f"{self.blocked:.2f} s by them" if self.count else "")


def _restore(run: RunDir, path: Path, saved: TrainState, model: nn.Module, optimizer: Any, scheduler: Any,
             comm: Comm | NullComm) -> None:
    try:
        info = load_checkpoint(path, optimizer, scheduler=scheduler, model=model, comm=comm)
    except ValueError as error:
        raise ValueError(
            f"cannot resume {str(run.path)!r} from {path.name}: the optimizer or schedule in the config "
            f"differs from the checkpoint's, or the checkpoint is damaged ({error}). Resume with the run's own "
            "config.toml (a longer run needs schedule.decay_steps set from the start)"
        ) from None
    if info.step != saved.step:  # the same on every rank: both files are shared
        raise ValueError(f"checkpoint {str(path)!r} is of step {info.step} but its train state of step "
                         f"{saved.step}; the run directory was changed by hand; start a new run with another --out")


def _finish(run: RunDir, cfg: TrainConfig, model: GPT, device: torch.device, start: int, step: int,
            last_loss: float, val_loss: float | None, best_val: float, baseline: float, train_time: float,
            tokens_per_step: int, num_params: int, skipped: int, comm: Comm | NullComm,
            echo: Callable[[str], None], group_labels: list[str], checkpoints: str = "") -> TrainSummary:
    sample = ""
    if comm.rank == 0:
        if plots_available():
            write_plots(run.read_metrics(), run.path, baseline=baseline, group_labels=group_labels,
                        clip_grad=cfg.optimizer.clip_grad)
        else:
            echo(MISSING_NOTE)
        if cfg.train.sample_bytes:
            prompt = torch.tensor(list(cfg.train.sample_prompt.encode()), dtype=torch.long, device=device)
            ids = generate(model, prompt[-cfg.model.seq_len:], cfg.train.sample_bytes,
                           temperature=cfg.train.sample_temperature,
                           generator=torch.Generator().manual_seed(cfg.train.seed))
            sample = bytes(ids.tolist()).decode("utf-8", errors="replace")
            (run.path / "sample.txt").write_text(sample)
            echo(f"--- sample ({cfg.train.sample_bytes} bytes) ---\n{sample}\n--- end of sample ---")
    summary = TrainSummary(
        run_dir=str(run.path), start_step=start, last_step=step, final_loss=last_loss, final_val_loss=val_loss,
        best_val_loss=best_val if math.isfinite(best_val) else None, baseline=baseline,
        train_seconds=train_time, tokens_per_s=step * tokens_per_step / train_time if train_time else 0.0,
        num_params=num_params, skipped_steps=skipped, world_size=comm.size, sample=sample,
    )
    if comm.rank == 0:
        run.write_json("summary.json", dataclasses.asdict(summary))
    best = f"{summary.best_val_loss:.4f}" if summary.best_val_loss is not None else "n/a"
    echo(f"done: steps {start}->{step}, {train_time:.1f} s of training in all ({summary.tokens_per_s:,.0f} tokens/s); "
         f"best val loss {best} nats/byte ({_bits(summary.best_val_loss)}) vs unigram baseline "
         f"{baseline:.4f} ({_bits(baseline)}){checkpoints}; run dir {run.path}")
    return summary


def _bits(nats: float | None) -> str:
    return "n/a" if nats is None else f"{nats / math.log(2):.3f} bits/byte"
