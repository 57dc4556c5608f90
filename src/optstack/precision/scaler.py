"""Loss scalers: none, constant and dynamic (Megatron's hysteresis semantics).

A loss scaler multiplies the loss before backward so that small fp16 gradients do not flush to zero, and
hands the optimizer ``inv_scale`` to undo it. The chained optimizer owns the one scaler of a training run and
calls ``update(found_inf)`` once per step, after every stage has checked its gradients.

The scale is kept as a Python float rounded to fp32, the precision of Megatron's scale tensor, so a run
reproduces Megatron's scale sequence exactly even for non-power-of-two factors; ``inv_scale`` is the
reciprocal taken in double and rounded to fp32, as Megatron does.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, Literal

import torch

__all__ = ["LossScaler", "NoScaler", "ConstantScaler", "DynamicScaler", "make_scaler"]


def _fp32(x: float) -> float:
    """``x`` rounded to the nearest fp32 value (Megatron keeps its scale in an fp32 tensor)."""
    return torch.tensor(x, dtype=torch.float32).item()


def _check_positive_finite(field: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{field} must be a finite number > 0, got {value!r}")


class LossScaler(ABC):
    """What the chained optimizer needs from a loss scaler."""

    kind: str = "abstract"

    @property
    @abstractmethod
    def scale(self) -> float:
        """The factor the loss is multiplied by before backward."""

    @property
    def inv_scale(self) -> float:
        """``1 / scale``, computed in double and rounded to fp32 (the factor gradients are multiplied by)."""
        return _fp32(1.0 / self.scale)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (the loss itself when the scale is 1), to call ``backward()`` on."""
        scale = self.scale
        return loss if scale == 1.0 else loss * scale

    @abstractmethod
    def update(self, found_inf: bool) -> None:
        """Advance by one optimizer step; ``found_inf`` says whether any gradient was non-finite."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    def validate_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raise ``ValueError`` when ``state_dict`` cannot be loaded into this scaler; change nothing."""
        if not isinstance(state_dict, dict):
            raise ValueError(f"loss scaler state must be a dict, got {type(state_dict).__name__}")
        kind = state_dict.get("kind")
        if kind != self.kind:
            raise ValueError(
                f"loss scaler state is for a {kind!r} scaler but this optimizer has a {self.kind!r} scaler; "
                "build the optimizer with the same loss-scale mode as the checkpoint"
            )

    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class NoScaler(LossScaler):
    """No loss scaling (fp32 and bf16 training): the scale is always 1."""

    kind = "none"

    @property
    def scale(self) -> float:
        return 1.0

    def update(self, found_inf: bool) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.validate_state_dict(state_dict)


class ConstantScaler(LossScaler):
    """A fixed loss scale, never adjusted (a non-finite step is still skipped by the optimizer).

    Args:
        scale: the loss scale, a finite number > 0.
    """

    kind = "constant"

    def __init__(self, scale: float) -> None:
        _check_positive_finite("scale", scale)
        self._scale = _fp32(float(scale))

    @property
    def scale(self) -> float:
        return self._scale

    def update(self, found_inf: bool) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "scale": self._scale}

    def validate_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().validate_state_dict(state_dict)
        _check_positive_finite("loss scaler state 'scale'", state_dict.get("scale"))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.validate_state_dict(state_dict)
        self._scale = _fp32(float(state_dict["scale"]))


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

    def __init__(
        self,
        initial_scale: float = 2.0**32,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ) -> None:
        _check_positive_finite("initial_scale", initial_scale)
        _check_positive_finite("min_scale", min_scale)
        if min_scale > initial_scale:
            raise ValueError(f"min_scale must be <= initial_scale, got {min_scale} > {initial_scale}")
        if not (
            isinstance(growth_factor, (int, float)) and math.isfinite(growth_factor) and growth_factor > 1
        ):
            raise ValueError(f"growth_factor must be a finite number > 1, got {growth_factor!r}")
        if not (isinstance(backoff_factor, (int, float)) and 0 < backoff_factor < 1):
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        for field, value in (("growth_interval", growth_interval), ("hysteresis", hysteresis)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{field} must be an int > 0, got {value!r}")
        self.min_scale = _fp32(float(min_scale))
        self.growth_factor = _fp32(float(growth_factor))
        self.backoff_factor = _fp32(float(backoff_factor))
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._scale = _fp32(float(initial_scale))
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def __repr__(self) -> str:
        return (
            f"DynamicScaler(scale={self._scale}, growth_tracker={self._growth_tracker}, "
            f"hysteresis_tracker={self._hysteresis_tracker})"
        )

    @property
    def scale(self) -> float:
        return self._scale

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

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def validate_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().validate_state_dict(state_dict)
        _check_positive_finite("loss scaler state 'scale'", state_dict.get("scale"))
        for key in ("growth_tracker", "hysteresis_tracker"):
            value = state_dict.get(key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"loss scaler state {key!r} must be an int, got {value!r}")
        if state_dict["growth_tracker"] < 0:
            raise ValueError(
                f"loss scaler state 'growth_tracker' must be >= 0, got {state_dict['growth_tracker']}"
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.validate_state_dict(state_dict)
        self._scale = _fp32(float(state_dict["scale"]))
        self._growth_tracker = state_dict["growth_tracker"]
        self._hysteresis_tracker = state_dict["hysteresis_tracker"]


def make_scaler(mode: Literal["none", "constant", "dynamic"], **kwargs: Any) -> LossScaler:
    """Build a loss scaler by mode: ``"none"`` (no arguments), ``"constant"`` (``scale=``) or ``"dynamic"``
    (the keyword arguments of ``DynamicScaler``)."""
    classes: dict[str, type[LossScaler]] = {
        "none": NoScaler,
        "constant": ConstantScaler,
        "dynamic": DynamicScaler,
    }
    if mode not in classes:
        raise ValueError(f"loss scale mode must be one of {sorted(classes)}, got {mode!r}")
    try:
        return classes[mode](**kwargs)
    except TypeError as exc:  # an unknown or missing keyword: say which mode takes what
        raise ValueError(f"bad arguments for a {mode!r} loss scaler {sorted(kwargs)}: {exc}") from exc
