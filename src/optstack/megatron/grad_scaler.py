"""Megatron's grad scalers (``megatron.core.optimizer.grad_scaler``): optstack's loss scalers under Megatron's names
and arguments."""

from __future__ import annotations

from optstack.precision.scaler import ConstantScaler, DynamicScaler, LossScaler

__all__ = ["ConstantGradScaler", "DynamicGradScaler", "MegatronGradScaler"]


#: Megatron's grad scalers are optstack's loss scalers (same arithmetic, same state).
MegatronGradScaler = LossScaler


def ConstantGradScaler(initial_scale: float) -> ConstantScaler:  # noqa: N802 (Megatron's class name)
    """Megatron's ``ConstantGradScaler``: optstack's ``ConstantScaler``."""
    return ConstantScaler(initial_scale)


def DynamicGradScaler(  # noqa: N802 (Megatron's class name)
    initial_scale: float, min_scale: float, growth_factor: float, backoff_factor: float,
    growth_interval: int, hysteresis: int,
) -> DynamicScaler:
    """Megatron's ``DynamicGradScaler`` (same arguments): optstack's ``DynamicScaler``."""
    return DynamicScaler(initial_scale=initial_scale, min_scale=min_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=int(growth_interval), hysteresis=hysteresis)
