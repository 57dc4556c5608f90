"""Learning-rate and weight-decay schedules, and the scheduler that writes them into param groups.

``LRSchedule`` and ``WDSchedule`` are frozen, validated values and pure functions of the step, with the semantics
of Megatron Core's ``OptimizerParamScheduler``; ``Scheduler`` applies both to every param group of anything with
``param_groups``, its only state the step count, and has torch's ``LRScheduler`` surface too. Where this module
differs from Megatron or torch on purpose, the class concerned says so.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from numbers import Integral, Real
from typing import Any, ClassVar, Literal, Protocol, Self, get_args

from torch.optim.lr_scheduler import LRScheduler

__all__ = ["LRSchedule", "WDSchedule", "Scheduler", "LRStyle", "WSDStyle", "WDStyle", "OnCheckpoint"]

LRStyle = Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"]
WSDStyle = Literal["linear", "cosine", "exponential", "minus_sqrt"]
WDStyle = Literal["constant", "linear", "cosine"]
OnCheckpoint = Literal["match", "use_checkpoint", "use_class"]


def _check_count(owner: str, name: str, value: object, *, minimum: int = 0) -> None:
    # bool is an Integral, but True as a step count is always a mistake.
    if not isinstance(value, Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an integer >= {minimum}, got {value!r}")


def _check_rate(owner: str, name: str, value: object) -> None:
    if not isinstance(value, Real) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{owner}.{name} must be a finite number >= 0, got {value!r}")


def _check_choice(owner: str, name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{owner}.{name} must be one of {list(allowed)}, got {value!r}")


def _group_value(name: str, value: float | None, default: float) -> float:
    """A param group's own value for ``name`` (validated), or the schedule's when the group has none."""
    if value is None:
        return default
    _check_rate("param group", name, value)
    return value


def _check_order(owner: str, low: str, high: str, values: Any, why: str = "") -> None:
    if getattr(values, low) > getattr(values, high):
        raise ValueError(f"{owner}.{low} ({getattr(values, low)}) must be <= {high} ({getattr(values, high)}){why}")


class _Schedule:
    """``to_dict`` / ``from_dict`` for the frozen schedule dataclasses."""

    def to_dict(self) -> dict[str, Any]:
        """The fields as a flat dict of plain Python values (the inverse of ``from_dict``)."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """Build from ``to_dict()`` output; unknown or missing required keys are a ``ValueError``."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{cls.__name__}.from_dict needs a mapping, got {type(data).__name__}")
        fields = [f for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
        names, unknown = [f.name for f in fields], sorted(set(data) - {f.name for f in fields})
        missing = [f.name for f in fields if f.default is dataclasses.MISSING and f.name not in data]
        if unknown or missing:
            raise ValueError(
                f"{cls.__name__}.from_dict: unknown keys {unknown}, missing keys {missing}; the keys are {names}")
        return cls(**{n: data[n] for n in names if n in data})


@dataclasses.dataclass(frozen=True, kw_only=True)
class LRSchedule(_Schedule):
    """The learning rate as a function of the step (Megatron's ``get_lr``), piecewise, in this order of precedence:

    1. warmup (only when ``warmup_steps > 0``), for ``step <= warmup_steps``:
       ``init_lr + (max_lr - init_lr) * step / warmup_steps``;
    2. ``style == "constant"``: ``max_lr`` for every later step (``decay_steps`` plays no part);
    3. ``step > decay_steps``: ``min_lr``;
    4. ``"inverse-square-root"``: ``max(min_lr, max_lr * sqrt(max(warmup_steps, 1)) / sqrt(max(step, 1)))``;
    5. ``"linear"`` / ``"cosine"``: ``min_lr + coeff * (max_lr - min_lr)`` with
       ``r = (step - warmup_steps) / (decay_steps - warmup_steps)`` and coeff ``1 - r`` or ``(cos(pi * r) + 1) / 2``;
    6. ``"WSD"``: coeff 1 up to ``decay_steps - wsd_decay_steps``, then over the last ``wsd_decay_steps`` steps,
       with ``r`` the fraction of them done, ``wsd_style`` gives coeff: linear ``1 - r``, cosine
       ``(cos(pi * r) + 1) / 2``, exponential ``2 * 0.5**r - 1``, minus_sqrt ``1 - sqrt(r)``.

    Differences from Megatron, in what is accepted only: ``warmup_steps == decay_steps`` is allowed (Megatron
    asserts ``<``; the value is still well defined); ``wsd_decay_steps`` may not exceed ``decay_steps``;
    ``wsd_style`` defaults to ``"exponential"`` (Megatron's ``--lr-wsd-decay-style`` default; its class default
    ``None`` fails on the first annealing step).

    Attributes:
        init_lr: learning rate at step 0 of the warmup.
        max_lr: peak learning rate, reached at the end of the warmup.
        min_lr: floor of the decay, and the value after ``decay_steps``.
        warmup_steps: steps of linear warmup; 0 for none.
        decay_steps: the step at which the decay reaches ``min_lr`` (counted from step 0, warmup included).
        style: the shape after the warmup (default ``"cosine"``, the most common LLM schedule; Megatron and torch
            have no default).
        wsd_decay_steps: WSD only: the length of the final annealing phase (0 = no annealing).
        wsd_style: WSD only: the shape of the annealing phase.
    """

    init_lr: float = 0.0
    max_lr: float
    min_lr: float = 0.0
    warmup_steps: int = 0
    decay_steps: int
    style: LRStyle = "cosine"
    wsd_decay_steps: int | None = None
    wsd_style: WSDStyle = "exponential"

    STYLES: ClassVar[tuple[str, ...]] = get_args(LRStyle)
    WSD_STYLES: ClassVar[tuple[str, ...]] = get_args(WSDStyle)

    def __post_init__(self) -> None:
        owner = "LRSchedule"
        _check_choice(owner, "style", self.style, self.STYLES)
        _check_choice(owner, "wsd_style", self.wsd_style, self.WSD_STYLES)
        for name in ("init_lr", "max_lr", "min_lr"):
            _check_rate(owner, name, getattr(self, name))
        _check_order(owner, "min_lr", "max_lr", self)
        _check_order(owner, "init_lr", "max_lr", self, ": the warmup rises to max_lr")
        _check_count(owner, "warmup_steps", self.warmup_steps)
        # decay_steps >= 1 even for "constant": Megatron requires it, and 0 would make the decay ratio 0/0.
        _check_count(owner, "decay_steps", self.decay_steps, minimum=1)
        _check_order(owner, "warmup_steps", "decay_steps", self, "; decay_steps counts from step 0 and includes the "
                     "warmup")
        if self.wsd_decay_steps is not None:
            _check_count(owner, "wsd_decay_steps", self.wsd_decay_steps)
        if self.style == "WSD":
            if self.wsd_decay_steps is None:
                raise ValueError("LRSchedule.wsd_decay_steps is required when style='WSD': the length of the final "
                                 f"annealing phase, an integer in [0, decay_steps={self.decay_steps}]")
            _check_order(owner, "wsd_decay_steps", "decay_steps", self, ": annealing ends at decay_steps")

    def __call__(self, step: int, *, max_lr: float | None = None, min_lr: float | None = None) -> float:
        """The learning rate at ``step`` (>= 0), before any per-group ``lr_mult``.

        Args:
            step: the number of steps taken.
            max_lr, min_lr: a param group's own peak and floor (None: the schedule's), as Megatron's
                ``param_group["max_lr"]``; the warmup still starts from the schedule's ``init_lr``.
        """
        _check_count("LRSchedule", "step", step)
        max_lr = _group_value("max_lr", max_lr, self.max_lr)
        min_lr = _group_value("min_lr", min_lr, self.min_lr)
        if min_lr > max_lr:
            raise ValueError(f"min_lr ({min_lr}) must be <= max_lr ({max_lr})")
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * float(step) / float(self.warmup_steps)
        if self.style == "constant":
            return max_lr
        if step > self.decay_steps:
            return min_lr
        if self.style == "inverse-square-root":
            return max(min_lr, max_lr * max(self.warmup_steps, 1) ** 0.5 / max(step, 1) ** 0.5)
        return min_lr + self._decay_coeff(step) * (max_lr - min_lr)

    def _decay_coeff(self, step: int) -> float:
        """Fraction of (max_lr - min_lr) left at ``step``, for warmup_steps < step <= decay_steps."""
        if self.style in ("linear", "cosine"):
            ratio, style = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps), self.style
        else:  # WSD (wsd_decay_steps is set): with 0 annealing steps, step never passes the anneal start here
            anneal_start = self.decay_steps - (self.wsd_decay_steps or 0)
            if step <= anneal_start:
                return 1.0
            ratio, style = (step - anneal_start) / (self.wsd_decay_steps or 0), self.wsd_style
        if style == "linear":
            return 1.0 - ratio
        if style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if style == "exponential":
            return 2.0 * math.pow(0.5, ratio) - 1.0
        return 1.0 - math.sqrt(ratio)  # minus_sqrt


@dataclasses.dataclass(frozen=True, kw_only=True)
class WDSchedule(_Schedule):
    """Weight decay as a function of the step (Megatron's ``get_wd``).

    ``end_wd`` for ``step > incr_steps``; otherwise, with ``r = step / incr_steps``, ``"constant"`` gives ``end_wd``
    (which equals ``start_wd``), ``"linear"`` ``start_wd + r * (end_wd - start_wd)`` and ``"cosine"``
    ``start_wd + (cos(pi * (1 - r)) + 1) / 2 * (end_wd - start_wd)``.

    Differences from Megatron, in what is accepted only: ``end_wd < start_wd`` is allowed (Megatron asserts
    ``>=``); ``"linear"`` / ``"cosine"`` need ``incr_steps >= 1`` (Megatron divides by zero at step 0);
    ``"constant"`` with a group's own ``start_wd != end_wd`` is a ``ValueError`` at every step (Megatron asserts
    only up to ``incr_steps``).

    Attributes:
        start_wd: weight decay at step 0.
        end_wd: weight decay from ``incr_steps`` on.
        incr_steps: the length of the ramp.
        style: the shape of the ramp.
    """

    start_wd: float
    end_wd: float
    incr_steps: int = 0
    style: WDStyle = "constant"

    STYLES: ClassVar[tuple[str, ...]] = get_args(WDStyle)

    def __post_init__(self) -> None:
        _check_choice("WDSchedule", "style", self.style, self.STYLES)
        for name in ("start_wd", "end_wd"):
            _check_rate("WDSchedule", name, getattr(self, name))
        _check_count("WDSchedule", "incr_steps", self.incr_steps, minimum=0 if self.style == "constant" else 1)
        if self.style == "constant" and self.start_wd != self.end_wd:
            raise ValueError(f"WDSchedule.style='constant' needs start_wd == end_wd, got {self.start_wd} and "
                             f"{self.end_wd}; use style='linear' or 'cosine' for a changing weight decay")

    @classmethod
    def constant(cls, wd: float) -> WDSchedule:
        """A weight decay of ``wd`` at every step."""
        return cls(start_wd=wd, end_wd=wd)

    def __call__(self, step: int, *, start_wd: float | None = None, end_wd: float | None = None) -> float:
        """The weight decay at ``step`` (>= 0), before any per-group ``wd_mult``.

        Args:
            step: the number of steps taken.
            start_wd, end_wd: a param group's own values (None: the schedule's), as Megatron's ``param_group``.
        """
        _check_count("WDSchedule", "step", step)
        start_wd = _group_value("start_wd", start_wd, self.start_wd)
        end_wd = _group_value("end_wd", end_wd, self.end_wd)
        if self.style == "constant":
            if start_wd != end_wd:
                raise ValueError(f"weight decay style 'constant' needs start_wd == end_wd, got {start_wd} and {end_wd}")
            return end_wd
        if step > self.incr_steps:
            return end_wd
        ratio = step / self.incr_steps
        coeff = ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return start_wd + coeff * (end_wd - start_wd)


class HasParamGroups(Protocol):
    """Anything with a list of dicts ``param_groups``: a ``torch.optim.Optimizer``, a chained optimizer."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...


class Scheduler(LRScheduler):
    """Writes ``lr`` and ``weight_decay`` into every param group from an ``LRSchedule`` and a ``WDSchedule``.

    Per group: ``lr = lr_schedule(step, max_lr=group["max_lr"], min_lr=group["min_lr"]) * group["lr_mult"]`` and
    ``weight_decay = wd_schedule(step, start_wd=group["start_wd"], end_wd=group["end_wd"]) * group["wd_mult"]``,
    each key optional (absent or None: the schedule's value, multipliers 1); empty groups too (logging reads their
    lr). Construction applies step 0, as Megatron's. All groups' values are computed before any is written, so a
    bad group changes nothing. Unlike Megatron, ``load_state_dict`` *sets* the step to the checkpoint's (Megatron
    adds it, the same on a fresh scheduler) and writes the groups after all fields are settled; ``lr_mult`` is
    applied as in Megatron before its per-group ``max_lr``/``min_lr`` made it vestigial.

    It is a ``torch.optim.lr_scheduler.LRScheduler`` (so Hugging Face accelerate's ``prepare()`` wraps it and its
    Trainer can drive it) with torch's surface: ``optimizer``, ``last_epoch`` (the step count), ``base_lrs``,
    ``get_last_lr()``, ``get_lr()`` and ``step()``. ``LRScheduler.__init__`` is not called: it needs a
    ``torch.optim.Optimizer``, overwrites the groups' lrs and patches ``optimizer.step``. Differences from
    torch: setting ``last_epoch`` writes the groups at once (torch waits for the next ``step()``); ``step(epoch)``
    (torch's deprecated form) sets the step, ``step(increment=n)`` advances by ``n``; ``state_dict`` is this
    class's own format, not torch's copy of ``__dict__``.

    Args:
        optimizer: the object whose ``param_groups`` are written; read afresh on every step.
        lr: the learning-rate schedule.
        wd: the weight-decay schedule.
        on_checkpoint: how ``load_state_dict`` treats a checkpoint's schedule fields: ``"match"`` requires them to
            equal the constructor's (Megatron with neither flag), ``"use_checkpoint"`` adopts them
            (``use_checkpoint_opt_param_scheduler``), ``"use_class"`` keeps the constructor's
            (``override_opt_param_scheduler``). The step always comes from the checkpoint.
    """

    STATE_VERSION: ClassVar[int] = 1
    ON_CHECKPOINT: ClassVar[tuple[str, ...]] = get_args(OnCheckpoint)

    def __init__(self, optimizer: HasParamGroups, lr: LRSchedule, wd: WDSchedule, *,
                 on_checkpoint: OnCheckpoint = "match") -> None:
        if not isinstance(getattr(optimizer, "param_groups", None), list):
            raise ValueError("Scheduler.optimizer must have a list `param_groups` (a torch.optim.Optimizer or a "
                             f"chained optimizer), got {type(optimizer).__name__}")
        if not isinstance(lr, LRSchedule):
            raise ValueError(f"Scheduler.lr must be an LRSchedule, got {type(lr).__name__}")
        if not isinstance(wd, WDSchedule):
            raise ValueError(f"Scheduler.wd must be a WDSchedule, got {type(wd).__name__}")
        _check_choice("Scheduler", "on_checkpoint", on_checkpoint, self.ON_CHECKPOINT)
        self.optimizer = optimizer  # type: ignore[assignment]  # any param_groups holder, not only torch's
        self.on_checkpoint: OnCheckpoint = on_checkpoint
        self._lr, self._wd, self._num_steps = lr, wd, 0
        self._last_lr: list[float] = []
        # torch's count of step() calls (1 after its initial step); accelerate increments it directly.
        self._step_count = 1
        self._apply(lr, wd, 0)

    @property
    def num_steps(self) -> int:
        """The number of steps taken (the scheduler's only state)."""
        return self._num_steps

    @property
    def last_epoch(self) -> int:  # type: ignore[override]
        """torch's name for ``num_steps``; setting it writes the groups at that step."""
        return self._num_steps

    @last_epoch.setter
    def last_epoch(self, value: int) -> None:
        _check_count("Scheduler", "last_epoch", value)
        self._apply(self._lr, self._wd, value)

    @property
    def lr_schedule(self) -> LRSchedule:
        """The learning-rate schedule in force (the checkpoint's after a ``use_checkpoint`` load)."""
        return self._lr

    @property
    def wd_schedule(self) -> WDSchedule:
        """The weight-decay schedule in force."""
        return self._wd

    @property
    def base_lrs(self) -> list[float]:  # type: ignore[override]
        """Each group's peak lr: its ``max_lr`` (the schedule's when it has none) times its ``lr_mult``."""
        return [_group_value("max_lr", g.get("max_lr"), self._lr.max_lr) * g.get("lr_mult", 1.0)
                for g in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        """Each param group's ``lr`` as this scheduler last wrote it, in ``optimizer.param_groups`` order."""
        return list(self._last_lr)

    def get_lr(self) -> list[float]:
        """Each param group's ``lr`` at the current step (``lr_mult`` applied), computed afresh."""
        return [group_lr for group_lr, _ in self._values(self._lr, self._wd, self._num_steps)]

    def group_lr(self, group: Mapping[str, Any]) -> float:
        """The learning rate of ``group`` at the current step, before its ``lr_mult`` (Megatron's
        ``get_lr(param_group)``; the Megatron face keeps that name)."""
        return self._lr(self._num_steps, max_lr=group.get("max_lr"), min_lr=group.get("min_lr"))

    def get_wd(self, group: Mapping[str, Any] | None = None) -> float:
        """The weight decay at the current step, before ``wd_mult``; ``group``'s start_wd/end_wd win."""
        group = group or {}
        return self._wd(self._num_steps, start_wd=group.get("start_wd"), end_wd=group.get("end_wd"))

    def step(self, epoch: int | None = None, *, increment: int | None = None) -> None:
        """Advance the step and write every group's ``lr`` and ``weight_decay``.

        ``step()`` advances by one (what torch's and Hugging Face's loops call); ``step(increment=n)`` advances
        by ``n >= 0`` (Megatron's ``step(increment)``, which the Megatron face keeps positional). ``step(epoch)``
        is torch's deprecated form: it *sets* the step to ``epoch`` and warns, as torch does.

        Raises:
            ValueError: a negative or non-integer ``epoch`` / ``increment``, or both given.
        """
        if epoch is not None and increment is not None:
            raise ValueError(f"Scheduler.step: pass epoch (sets the step) or increment (advances it), not both; "
                             f"got epoch={epoch!r}, increment={increment!r}")
        if epoch is not None:
            _check_count("Scheduler.step", "epoch", epoch)
            # Megatron's step(increment) is positional: a caller used to it must not silently set the step.
            warnings.warn(f"Scheduler.step({epoch}) is torch's deprecated `epoch` form: it sets the step to "
                          f"{epoch} (it was {self._num_steps}); call step() to advance by one or "
                          "step(increment=n) to advance by n", UserWarning, stacklevel=2)
            num_steps = epoch
        else:
            increment = 1 if increment is None else increment
            _check_count("Scheduler.step", "increment", increment)
            num_steps = self._num_steps + increment
        self._apply(self._lr, self._wd, num_steps)
        self._step_count += 1

    def _values(self, lr: LRSchedule, wd: WDSchedule, num_steps: int) -> list[tuple[float, float]]:
        """Every group's ``(lr, weight_decay)`` at ``num_steps``, multipliers applied; nothing is written."""
        values = []
        for index, group in enumerate(self.optimizer.param_groups):
            try:
                group_lr = lr(num_steps, max_lr=group.get("max_lr"), min_lr=group.get("min_lr"))
                group_wd = wd(num_steps, start_wd=group.get("start_wd"), end_wd=group.get("end_wd"))
            except ValueError as error:
                raise ValueError(f"param group {index}: {error}") from error
            values.append((group_lr * group.get("lr_mult", 1.0), group_wd * group.get("wd_mult", 1.0)))
        return values

    def _apply(self, lr: LRSchedule, wd: WDSchedule, num_steps: int) -> None:
        """Compute every group's values at ``num_steps``, then commit them, the schedules and the step."""
        values = self._values(lr, wd, num_steps)
        for group, (group_lr, group_wd) in zip(self.optimizer.param_groups, values, strict=True):
            group["lr"], group["weight_decay"] = group_lr, group_wd
        self._lr, self._wd, self._num_steps = lr, wd, num_steps
        self._last_lr = [group_lr for group_lr, _ in values]

    def state_dict(self) -> dict[str, Any]:
        """``{"version": 1, "num_steps": int, "lr": LRSchedule.to_dict(), "wd": WDSchedule.to_dict()}``."""
        return {"version": self.STATE_VERSION, "num_steps": self._num_steps, "lr": self._lr.to_dict(),
                "wd": self._wd.to_dict()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the step, and the schedules as ``on_checkpoint`` says; all or nothing.

        Raises:
            ValueError: a malformed checkpoint; with ``on_checkpoint="match"``, any schedule field that differs
                (every such field is named with both values); a group the loaded schedule cannot serve.
        """
        if not isinstance(state_dict, Mapping):
            raise ValueError(f"Scheduler.load_state_dict needs a mapping, got {type(state_dict).__name__}")
        expected = {"version", "num_steps", "lr", "wd"}
        if set(state_dict) != expected:
            raise ValueError(f"Scheduler.load_state_dict: keys {sorted(state_dict)}, expected {sorted(expected)} "
                             "(from Scheduler.state_dict())")
        if state_dict["version"] != self.STATE_VERSION:
            raise ValueError(f"Scheduler.load_state_dict: version {state_dict['version']!r} is not supported "
                             f"(this optstack reads version {self.STATE_VERSION})")
        num_steps = state_dict["num_steps"]
        _check_count("scheduler checkpoint", "num_steps", num_steps)
        saved_lr, saved_wd = LRSchedule.from_dict(state_dict["lr"]), WDSchedule.from_dict(state_dict["wd"])
        if self.on_checkpoint == "use_class":
            saved_lr, saved_wd = self._lr, self._wd
        elif self.on_checkpoint == "match":
            differences = [f"{prefix}.{name}: constructor {ours[name]!r}, checkpoint {theirs[name]!r}"
                           for prefix, ours, theirs in (("lr", self._lr.to_dict(), saved_lr.to_dict()),
                                                        ("wd", self._wd.to_dict(), saved_wd.to_dict()))
                           for name in ours if ours[name] != theirs[name]]
            if differences:
                raise ValueError(
                    "Scheduler.load_state_dict: the checkpoint's schedule differs from the constructor's "
                    f"(on_checkpoint='match'): {'; '.join(differences)}. Pass on_checkpoint='use_checkpoint' to "
                    "take the checkpoint's values or on_checkpoint='use_class' to keep the constructor's.")
        self._apply(saved_lr, saved_wd, num_steps)
