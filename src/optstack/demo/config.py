"""The configuration of ``optstack train``: typed sections, TOML in and out, and ``--set`` overrides.

A run is described by five sections, each a frozen dataclass: ``[model]`` (``GPTConfig``), ``[data]``,
``[train]``, ``[schedule]`` and ``[optimizer]`` (optstack's own ``OptimizerConfig``, with its sub-tables
``[optimizer.adam]``, ``[optimizer.muon]``, ...). Values are layered: the defaults here, then a TOML file
(``--config``), then command-line overrides (``--set section.key=value`` and the shortcut flags). Every key is
checked against the dataclass fields and their types before anything is built, so a typo or a wrong type is
one message naming the key (and its line in the file). The resolved config is written back as TOML into the
run directory; ``--config runs/x/config.toml`` repeats the run.

Demo defaults that differ from ``OptimizerConfig``'s own: when the user sets no ``optimizer.lr``, it is taken
per algorithm from ``DEFAULT_LR``; ``min_lr`` defaults to lr / 10, ``weight_decay`` to 0.1 and ``clip_grad`` to
1.0 (the core default is no clipping); with several processes, ``optimizer.distributed.sharding`` defaults to
``zero1`` (for Muon: each matrix whole in its owner's reduce-scatter shard).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from optstack.config import OptimizerConfig
from optstack.demo.gpt import GPTConfig
from optstack.typecheck import type_ok

__all__ = [
    "DataConfig", "LoopConfig", "ScheduleConfig", "TrainConfig", "DEFAULT_LR",
    "load_config", "parse_override", "to_toml", "config_to_dict",
]

#: The learning rate each algorithm gets when the user sets none (picked from short demo-model sweeps).
DEFAULT_LR = {"adamw": 3e-3, "adam": 3e-3, "sgd": 0.1, "lion": 1e-3, "muon": 0.02, "normuon": 0.02, "adamuon": 0.02,
              "adaptive_muon": 0.02, "schedule_free_adamw": 3e-3, "schedule_free_sgd": 0.1, "soap": 3e-3}


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the bytes come from. ``path`` unset = the Python standard library's source."""

    path: str | None = None
    max_bytes: int = 4_000_000
    val_fraction: float = 0.05

    def __post_init__(self) -> None:
        if self.max_bytes < 2:
            raise ValueError(f"data.max_bytes must be >= 2, got {self.max_bytes}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    """The training loop (section ``[train]``). A step = ``grad_accum`` micro-batches of ``batch_size``."""

    steps: int = 600
    batch_size: int = 32
    grad_accum: int = 1
    eval_every: int = 50
    eval_batches: int = 8
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    sample_bytes: int = 400
    sample_prompt: str = "def "
    sample_temperature: float = 0.8

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "eval_every", "eval_batches", "checkpoint_every",
                     "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.sample_bytes < 0:
            raise ValueError(f"train.sample_bytes must be >= 0, got {self.sample_bytes}")
        if not self.sample_prompt:
            raise ValueError("train.sample_prompt must not be empty (generation needs a first byte)")
        if not (self.sample_temperature > 0 and math.isfinite(self.sample_temperature)):
            raise ValueError(f"train.sample_temperature must be > 0, got {self.sample_temperature}")


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """The LR schedule (weight decay stays ``optimizer.weight_decay`` times each group's ``wd_mult``).

    ``decay_steps`` unset = ``train.steps``; set it beyond ``train.steps`` to stop a run early and extend it
    later with ``--resume`` on the same schedule. ``warmup_steps`` unset = a tenth of the decay steps, at most
    50 (so a short ``--steps`` run just works).
    """

    style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = "cosine"
    warmup_steps: int | None = None
    decay_steps: int | None = None
    init_lr: float = 0.0
    wsd_decay_steps: int | None = None
    wsd_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "exponential"


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything ``optstack train`` needs."""

    model: GPTConfig = field(default_factory=GPTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: LoopConfig = field(default_factory=LoopConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)

    def __post_init__(self) -> None:
        if self.model.vocab_size != 256:
            raise ValueError(f"model.vocab_size must be 256 for byte data, got {self.model.vocab_size}")
        decay = self.schedule.decay_steps
        if decay is not None and decay < self.train.steps:
            raise ValueError(f"schedule.decay_steps ({decay}) must be >= train.steps ({self.train.steps})")
        if self.warmup_steps > self.decay_steps:
            raise ValueError(
                f"schedule.warmup_steps ({self.warmup_steps}) must be <= the decay steps "
                f"({self.decay_steps}); lower it or raise train.steps"
            )

    @property
    def decay_steps(self) -> int:
        return self.schedule.decay_steps if self.schedule.decay_steps is not None else self.train.steps

    @property
    def warmup_steps(self) -> int:
        if self.schedule.warmup_steps is not None:
            return self.schedule.warmup_steps
        return min(50, self.decay_steps // 10)


# -- building from nested dicts, with key and type checks -------------------------------------------------
class ConfigError(ValueError):
    """A user error in a config file or override; the message names the key (and line)."""


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_describe(h) for h in typing.get_args(hint) if h is not type(None))
    return getattr(hint, "__name__", str(hint))


def _build(cls: type, data: dict[str, Any], prefix: str, where: dict[str, str]) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'} must be a table, got {data!r}{where.get(prefix, '')}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else key
        if key not in fields:
            raise ConfigError(
                f"unknown key {path!r}{where.get(path, '')}; known keys in "
                f"{'[' + prefix + ']' if prefix else 'the top level'}: {sorted(fields)}"
            )
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value, path, where)
        elif not type_ok(value, hint):
            raise ConfigError(f"{path}{where.get(path, '')} must be {_describe(hint)}, got {value!r}")
        else:
            is_float = hint is float or (typing.get_origin(hint) in (types.UnionType, typing.Union)
                                         and float in typing.get_args(hint))
            kwargs[key] = float(value) if is_float and isinstance(value, int) else value
    try:
        return cls(**kwargs)
    except ValueError as error:
        raise ConfigError(f"[{prefix}]{where.get(prefix, '')}: {error}" if prefix else str(error)) from None


def _key_lines(text: str, filename: str) -> dict[str, str]:
    """Map each ``table.key`` of a TOML file to ' (file, line N)' for error messages (best effort)."""
    out: dict[str, str] = {}
    table = ""
    for number, line in enumerate(text.splitlines(), start=1):
        if m := re.match(r"\s*\[\s*([A-Za-z0-9_.\-]+)\s*\]\s*(#.*)?$", line):
            table = m.group(1)
            out.setdefault(table, f" ({filename}, line {number})")
        elif m := re.match(r"\s*([A-Za-z0-9_.\-]+)\s*=", line):
            out.setdefault(f"{table}.{m.group(1)}" if table else m.group(1), f" ({filename}, line {number})")
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merge(out[key], value) if nested else copy.deepcopy(value)  # never alias the caller's dicts
    return out


def parse_override(text: str) -> dict[str, Any]:
    """``'optimizer.adam.beta2=0.95'`` -> ``{'optimizer': {'adam': {'beta2': 0.95}}}``.

    The value is read as a TOML value (numbers, true/false, quoted strings, arrays); anything that is not
    valid TOML is taken as a bare string, so ``optimizer.algorithm=muon`` works without quotes.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+", key):
        raise ConfigError(f"--set expects section.key=value (e.g. optimizer.lr=3e-4), got {text!r}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    out: dict[str, Any] = {}
    node = out
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def load_config(
    file: str | Path | None = None,
    overrides: list[dict[str, Any]] | tuple[dict[str, Any], ...] = (),
    *,
    base: dict[str, Any] | None = None,
    nproc: int = 1,
) -> TrainConfig:
    """Resolve a ``TrainConfig`` from defaults, an optional base dict, a TOML file, then overrides.

    Args:
        file: a TOML file (sections as in ``TrainConfig``).
        overrides: nested dicts (``parse_override`` output), applied in order.
        base: a nested dict applied before the file (a resumed run's saved config).
        nproc: the processes the run will have; with more than one and no ``optimizer.distributed.sharding``
            given anywhere, the sharding defaults to ``zero1``.

    Raises:
        ConfigError: unreadable file, TOML syntax error, unknown key or wrong type (naming key and line).
    """
    where: dict[str, str] = {}
    layers: list[dict[str, Any]] = [base or {}]
    if file is not None:
        path = Path(file)
        try:
            text = path.read_text()
        except OSError as error:
            raise ConfigError(f"cannot read config file {str(file)!r}: {error.strerror}") from None
        try:
            layers.append(tomllib.loads(text))
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"config file {str(file)!r} is not valid TOML: {error}") from None
        where = _key_lines(text, path.name)
    layers.extend(overrides)
    raw: dict[str, Any] = {}
    for layer in layers:
        raw = _merge(raw, layer)
    opt = raw.setdefault("optimizer", {})
    if isinstance(opt, dict):  # demo defaults, only where the user said nothing
        algorithm = opt.get("algorithm", "adamw")
        lr = opt.setdefault("lr", DEFAULT_LR.get(algorithm, 1e-3))
        if isinstance(lr, int | float) and not isinstance(lr, bool):
            opt.setdefault("min_lr", float(f"{lr / 10:.6g}"))
        opt.setdefault("weight_decay", 0.1)
        opt.setdefault("clip_grad", 1.0)
        if nproc > 1 and isinstance(dist := opt.setdefault("distributed", {}), dict):
            dist.setdefault("sharding", "zero1")
    return _build(TrainConfig, raw, "", where)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A dataclass config as a nested dict (tuples as lists)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "inf" if value == math.inf else "-inf" if value == -math.inf else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to TOML")


def to_toml(data: dict[str, Any], _prefix: str = "") -> str:
    """Write a nested dict as TOML (None values are left out: TOML has no null, and unset = default)."""
    scalars = [f"{k} = {_toml_value(v)}" for k, v in data.items()
               if not isinstance(v, dict) and v is not None]
    lines = ([f"[{_prefix}]"] if _prefix and (scalars or not data) else []) + scalars
    for key, value in data.items():
        if isinstance(value, dict):
            sub = to_toml(value, f"{_prefix}.{key}" if _prefix else key)
            lines.extend(["", sub] if lines else [sub])
    return "\n".join(lines) + ("\n" if not _prefix else "")
