"""Loss scalers: none, constant and dynamic (Megatron's hysteresis semantics).

The chained optimizer owns the one scaler of a run: it multiplies the loss before backward, hands the stages
``inv_scale``, and calls ``update(found_inf)`` once per step. The scale is a Python float rounded to fp32, the
precision of Megatron's scale tensor, so a run reproduces Megatron's scale sequence exactly even for
non-power-of-two factors; ``inv_scale`` is the reciprocal taken in double and rounded to fp32, as Megatron does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import torch

__all__ = ["LossScaler", "NoScaler", "ConstantScaler", "DynamicScaler", "make_scaler"]


def _fp32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def _number(field: str, value: Any, lo: float = 0.0, hi: float = math.inf) -> float:
    """``value`` as a float when it is a finite number in ``(lo, hi)``, else a ``ValueError`` naming ``field``."""
    if not (isinstance(value, int | float) and math.isfinite(value) and lo < value < hi):
        bound = f"a finite number > {lo:g}" if hi == math.inf else f"in ({lo:g}, {hi:g})"
        raise ValueError(f"{field} must be {bound}, got {value!r}")
    return float(value)


def _int(field: str, value: Any, lo: int | None = None) -> int:
    """``value`` when it is an int (not a bool) ``>= lo``, else a ``ValueError`` naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, int) or (lo is not None and value < lo):
        raise ValueError(f"{field} must be an int{'' if lo is None else f' >= {lo}'}, got {value!r}")
    return value


def _positive_fp32(field: str, value: Any) -> float:
    return _fp32(_number(field, value))


class LossScaler:
    """What the chained optimizer needs from a loss scaler; on its own, a scale of 1 that never changes.

    A subclass names its ``kind`` and lists in ``_state`` the attributes (``_`` + key) its ``state_dict``
    holds, each with the check that turns a loaded value into the attribute's.
    """

    kind: str = "none"
    _state: dict[str, Callable[[str, Any], Any]] = {}
    _scale: float = 1.0

    @property
    def scale(self) -> float:
        """The factor the loss is multiplied by before backward."""
        return self._scale

    @property
    def inv_scale(self) -> float:
        """``1 / scale``, computed in double and rounded to fp32 (the factor gradients are multiplied by)."""
        return _fp32(1.0 / self.scale)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (the loss itself when the scale is 1), to call ``backward()`` on."""
        return loss if self.scale == 1.0 else loss * self.scale

    def update(self, found_inf: bool) -> None:
        """Advance by one optimizer step; ``found_inf`` says whether any gradient was non-finite."""

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **{key: getattr(self, "_" + key) for key in self._state}}

    def validate_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The attribute values ``state_dict`` holds; ``ValueError`` when it cannot be loaded. Changes nothing."""
        if not isinstance(state_dict, dict):
            raise ValueError(f"loss scaler state must be a dict, got {type(state_dict).__name__}")
        if state_dict.get("kind") != self.kind:
            raise ValueError(
                f"loss scaler state is for a {state_dict.get('kind')!r} scaler but this optimizer has a "
                f"{self.kind!r} scaler; build the optimizer with the same loss-scale mode as the checkpoint"
            )
        return {key: check(f"loss scaler state {key!r}", state_dict.get(key)) for key, check in self._state.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key, value in self.validate_state_dict(state_dict).items():
            setattr(self, "_" + key, value)


class NoScaler(LossScaler):
    """No loss scaling (fp32 and bf16 training): the scale is always 1."""


class ConstantScaler(LossScaler):
    """A fixed loss scale, never adjusted (a non-finite step is still skipped by the optimizer).

    Args:
        scale: the loss scale, a finite number > 0.
    """

    kind = "constant"
    _state = {"scale": _positive_fp32}

    def __init__(self, scale: float) -> None:
        self._scale = _positive_fp32("scale", scale)


class DynamicScaler(LossScaler):
    """Megatron's dynamic loss scaler.

    On a step with a non-finite gradient the growth tracker resets and the hysteresis tracker drops by one;
    only when it reaches zero does the scale back off (``max(scale * backoff_factor, min_scale)``), and it
    stays at zero, so later overflows back off at once until the scale grows again. After
    ``growth_interval`` consecutive clean steps the scale grows by ``growth_factor`` and both trackers reset.

    Args:
        initial_scale: the first loss scale (Megatron: 2**32).
        min_scale: the scale never backs off below this; ``0 < min_scale <= initial_scale``.
        growth_factor: multiplier after ``growth_interval`` clean steps, > 1.
        backoff_factor: multiplier on backoff, in (0, 1).
        growth_interval: clean steps between growths (Megatron's ``loss_scale_window``), an int > 0.
        hysteresis: how many overflows are tolerated before backing off, an int > 0.
    """

    kind = "dynamic"
    _state = {"scale": _positive_fp32, "growth_tracker": lambda f, v: _int(f, v, 0), "hysteresis_tracker": _int}

    def __init__(self, initial_scale: float = 2.0**32, min_scale: float = 1.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2) -> None:
        self._scale = _positive_fp32("initial_scale", initial_scale)
        self.min_scale = _positive_fp32("min_scale", min_scale)
        if min_scale > initial_scale:
            raise ValueError(f"min_scale must be <= initial_scale, got {min_scale} > {initial_scale}")
        self.growth_factor = _fp32(_number("growth_factor", growth_factor, lo=1.0))
        self.backoff_factor = _fp32(_number("backoff_factor", backoff_factor, hi=1.0))
        self.growth_interval = _int("growth_interval", growth_interval, 1)
        self.hysteresis = _int("hysteresis", hysteresis, 1)
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def __repr__(self) -> str:
        return (f"DynamicScaler(scale={self._scale}, growth_tracker={self._growth_tracker}, "
                f"hysteresis_tracker={self._hysteresis_tracker})")

    @property
    def growth_tracker(self) -> int:
        """Consecutive clean steps since the last overflow or growth."""
        return self._growth_tracker

    @property
    def hysteresis_tracker(self) -> int:
        """Overflows still tolerated before the next backoff (<= 0: back off on the next overflow)."""
        return self._hysteresis_tracker

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(_fp32(self._scale * self.backoff_factor), self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = _fp32(self._scale * self.growth_factor)


def make_scaler(mode: Literal["none", "constant", "dynamic"], **kwargs: Any) -> LossScaler:
    """Build a loss scaler by mode: ``"none"`` (no arguments), ``"constant"`` (``scale=``) or ``"dynamic"``
    (the keyword arguments of ``DynamicScaler``)."""
    classes: dict[str, type[LossScaler]] = {"none": NoScaler, "constant": ConstantScaler, "dynamic": DynamicScaler}
    if mode not in classes:
        raise ValueError(f"loss scale mode must be one of {sorted(classes)}, got {mode!r}")
    try:
        return classes[mode](**kwargs)
    except TypeError as exc:  # an unknown or missing keyword: say which mode takes what
        raise ValueError(f"bad arguments for a {mode!r} loss scaler {sorted(kwargs)}: {exc}") from exc
