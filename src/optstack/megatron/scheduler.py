"""Megatron Core's ``OptimizerParamScheduler`` and ``get_canonical_lr_for_logging``, over the core Scheduler.

The values come from ``optstack.schedule`` (``LRSchedule``, ``WDSchedule``, ``Scheduler``); this module keeps
Megatron's constructor, attribute names, ``state_dict`` keys (reading its legacy key names too) and its
checkpoint policy flags, mapped to the core's ``on_checkpoint``:

=====================================  ==============================  ====================
use_checkpoint_opt_param_scheduler     override_opt_param_scheduler    core on_checkpoint
=====================================  ==============================  ====================
True (default)                         False (default)                 "use_checkpoint"
False                                  False                           "match"
False                                  True                            "use_class"
True                                   True                            error (as Megatron)
=====================================  ==============================  ====================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from optstack.megatron.config import renamed_errors
from optstack.schedule import HasParamGroups, LRSchedule, OnCheckpoint, Scheduler, WDSchedule

__all__ = ["OptimizerParamScheduler", "get_canonical_lr_for_logging"]

# Core schedule field -> Megatron constructor argument, for error messages.
_NAMES = {
    "LRSchedule.init_lr": "init_lr", "LRSchedule.max_lr": "max_lr", "LRSchedule.min_lr": "min_lr",
    "LRSchedule.warmup_steps": "lr_warmup_steps", "LRSchedule.decay_steps": "lr_decay_steps",
    "LRSchedule.style": "lr_decay_style", "LRSchedule.wsd_decay_steps": "wsd_decay_steps",
    "LRSchedule.wsd_style": "lr_wsd_decay_style", "WDSchedule.start_wd": "start_wd",
    "WDSchedule.end_wd": "end_wd", "WDSchedule.incr_steps": "wd_incr_steps",
    "WDSchedule.style": "wd_incr_style",
}
# Megatron state_dict key -> (legacy key names, what _check_and_set calls it, core schedule, core field).
_FIELDS = (
    ("max_lr", ("start_lr",), "learning rate", "lr", "max_lr"),
    ("min_lr", (), "minimum learning rate", "lr", "min_lr"),
    ("lr_warmup_steps", ("warmup_iter", "warmup_steps"), "warmup iterations", "lr", "warmup_steps"),
    ("lr_decay_steps", ("end_iter", "decay_steps"), "total number of iterations", "lr", "decay_steps"),
    ("lr_decay_style", ("decay_style",), "learning rate decay style", "lr", "style"),
    ("start_wd", (), "start weight decay", "wd", "start_wd"),
    ("end_wd", (), "end weight decay", "wd", "end_wd"),
    ("wd_incr_steps", (), "total number of weight decay iterations", "wd", "incr_steps"),
    ("wd_incr_style", (), "weight decay incr style", "wd", "style"),
)


def get_canonical_lr_for_logging(param_groups: list[dict]) -> float | None:
    """The ``lr`` of the first ``default_config=True`` group (empty ones included), else None."""
    for group in param_groups:
        if group.get("default_config", False):
            return group.get("lr")
    return None


class OptimizerParamScheduler:
    """Anneals every param group's learning rate and weight decay (Megatron's semantics).

    Per group: ``lr`` from warmup then ``lr_decay_style`` between the group's ``max_lr`` / ``min_lr`` (the
    scheduler's when the group has none or None), times the group's ``lr_mult``; ``weight_decay`` from
    ``wd_incr_style`` between the group's ``start_wd`` / ``end_wd`` (default the scheduler's), times
    ``wd_mult``. Construction applies step 0.

    Args:
        optimizer: anything with ``param_groups`` (the face's optimizer, optstack's, any torch.optim one).
        init_lr / max_lr / min_lr: warmup start, peak and floor.
        lr_warmup_steps / lr_decay_steps: warmup length; the step where the decay reaches min_lr.
        lr_decay_style: 'constant', 'linear', 'cosine', 'inverse-square-root' or 'WSD'.
        start_wd / end_wd / wd_incr_steps / wd_incr_style: the weight-decay ramp ('constant', 'linear',
            'cosine').
        use_checkpoint_opt_param_scheduler: ``load_state_dict`` takes the checkpoint's values.
        override_opt_param_scheduler: ``load_state_dict`` keeps the constructor's values.
        wsd_decay_steps: WSD: length of the final annealing phase.
        lr_wsd_decay_style: WSD annealing shape ('linear', 'cosine', 'exponential', 'minus_sqrt'); None means
            'exponential', the default of Megatron's ``--lr-wsd-decay-style``.

    Differences from Megatron: ``load_state_dict`` sets the step to the checkpoint's (Megatron adds it to the
    current count; the same on a fresh scheduler); ``lr_mult`` is applied (Megatron's groups carry 1.0);
    invalid arguments are ``ValueError`` s, raised at construction.
    """

    def __init__(
        self,
        optimizer: HasParamGroups,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        lr_decay_style: str,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: str,
        use_checkpoint_opt_param_scheduler: bool | None = True,
        override_opt_param_scheduler: bool | None = False,
        wsd_decay_steps: int | None = None,
        lr_wsd_decay_style: str | None = None,
    ) -> None:
        if override_opt_param_scheduler and use_checkpoint_opt_param_scheduler:
            raise ValueError(
                "OptimizerParamScheduler: both override_opt_param_scheduler and "
                "use_checkpoint_opt_param_scheduler are set; set at most one"
            )
        on_checkpoint: OnCheckpoint = (
            "use_class" if override_opt_param_scheduler
            else "use_checkpoint" if use_checkpoint_opt_param_scheduler else "match"
        )
        with renamed_errors("OptimizerParamScheduler", _NAMES):
            lr = LRSchedule(
                init_lr=init_lr, max_lr=float(max_lr), min_lr=min_lr, warmup_steps=lr_warmup_steps,
                decay_steps=lr_decay_steps, style=lr_decay_style, wsd_decay_steps=wsd_decay_steps,
                wsd_style=lr_wsd_decay_style or "exponential",
            )
            wd = WDSchedule(start_wd=start_wd, end_wd=end_wd, incr_steps=wd_incr_steps, style=wd_incr_style)
            self._core = Scheduler(optimizer, lr, wd, on_checkpoint=on_checkpoint)
        self.optimizer = optimizer
        self.use_checkpoint_opt_param_scheduler = bool(use_checkpoint_opt_param_scheduler)
        self.override_opt_param_scheduler = bool(override_opt_param_scheduler)

    # -- Megatron's attributes, read from the schedules in force ---------------------------------------
    num_steps = property(lambda self: self._core.num_steps)
    init_lr = property(lambda self: self._core.lr_schedule.init_lr)
    max_lr = property(lambda self: self._core.lr_schedule.max_lr)
    min_lr = property(lambda self: self._core.lr_schedule.min_lr)
    lr_warmup_steps = property(lambda self: self._core.lr_schedule.warmup_steps)
    lr_decay_steps = property(lambda self: self._core.lr_schedule.decay_steps)
    lr_decay_style = property(lambda self: self._core.lr_schedule.style)
    wsd_decay_steps = property(lambda self: self._core.lr_schedule.wsd_decay_steps)
    lr_wsd_decay_style = property(lambda self: self._core.lr_schedule.wsd_style)
    start_wd = property(lambda self: self._core.wd_schedule.start_wd)
    end_wd = property(lambda self: self._core.wd_schedule.end_wd)
    wd_incr_steps = property(lambda self: self._core.wd_schedule.incr_steps)
    wd_incr_style = property(lambda self: self._core.wd_schedule.style)

    @property
    def core(self) -> Scheduler:
        """The optstack ``Scheduler`` doing the work."""
        return self._core

    # -- Megatron's methods -----------------------------------------------------------------------------
    def get_wd(self, param_group: dict | None = None) -> float:
        """The weight decay at the current step, before ``wd_mult`` (the group's start_wd/end_wd win)."""
        return self._core.get_wd(param_group)

    def get_lr(self, param_group: dict) -> float:
        """The learning rate of ``param_group`` at the current step, before its ``lr_mult``."""
        return self._core.group_lr(param_group)

    def step(self, increment: int) -> None:
        """Advance by ``increment`` steps and write ``lr`` and ``weight_decay`` into every param group."""
        self._core.step(increment=increment)

    def state_dict(self) -> dict[str, Any]:
        """Megatron's keys: max_lr, lr_warmup_steps, num_steps, lr_decay_style, lr_decay_steps, min_lr,
        start_wd, end_wd, wd_incr_style, wd_incr_steps."""
        lr, wd = self._core.lr_schedule, self._core.wd_schedule
        return {
            "max_lr": lr.max_lr,
            "lr_warmup_steps": lr.warmup_steps,
            "num_steps": self._core.num_steps,
            "lr_decay_style": lr.style,
            "lr_decay_steps": lr.decay_steps,
            "min_lr": lr.min_lr,
            "start_wd": wd.start_wd,
            "end_wd": wd.end_wd,
            "wd_incr_style": wd.style,
            "wd_incr_steps": wd.incr_steps,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore from a Megatron scheduler state dict (current or legacy key names; the weight-decay keys
        are optional, as in old checkpoints).

        With ``override_opt_param_scheduler`` the constructor's values are kept; with
        ``use_checkpoint_opt_param_scheduler`` the checkpoint's are taken; with neither they must match.
        The step always comes from the checkpoint. All or nothing.

        Raises:
            ValueError: a missing key, or (neither flag) values that differ, each named with both values.
        """
        if not isinstance(state_dict, Mapping):
            raise ValueError(
                f"OptimizerParamScheduler.load_state_dict needs a mapping, got {type(state_dict).__name__}"
            )
        lr, wd = self._core.lr_schedule.to_dict(), self._core.wd_schedule.to_dict()
        saved = {"lr": dict(lr), "wd": dict(wd)}
        mismatches = []
        for key, legacy, label, schedule, core_field in _FIELDS:
            if schedule == "wd" and "start_wd" not in state_dict:
                continue  # checkpoints from before the weight-decay schedule
            value = _read(state_dict, key, legacy)
            saved[schedule][core_field] = value
            ours = (lr if schedule == "lr" else wd)[core_field]
            if value != ours:
                mismatches.append(f"{key} ({label}): class value {ours!r}, checkpoint value {value!r}")
        if self._core.on_checkpoint == "match" and mismatches:
            raise ValueError(
                "OptimizerParamScheduler.load_state_dict: class and checkpoint values differ: "
                f"{'; '.join(mismatches)}. Pass use_checkpoint_opt_param_scheduler=True to take the "
                "checkpoint's values or override_opt_param_scheduler=True to keep the class values."
            )
        num_steps = _read(state_dict, "num_steps", ("num_iters",))
        with renamed_errors("OptimizerParamScheduler.load_state_dict", _NAMES):
            self._core.load_state_dict(
                {"version": Scheduler.STATE_VERSION, "num_steps": num_steps, **saved}
            )


def _read(state_dict: Mapping[str, Any], key: str, legacy: tuple[str, ...]) -> Any:
    for name in (*legacy, key):
        if name in state_dict:
            return state_dict[name]
    also = f" (nor its legacy names {list(legacy)})" if legacy else ""
    raise ValueError(
        f"OptimizerParamScheduler.load_state_dict: the state dict has no {key!r}{also}; "
        f"keys: {sorted(state_dict)}"
    )
