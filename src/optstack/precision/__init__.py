"""optstack.precision: the loss scalers (the stage's precisions are ``optstack.stage.precision``)."""

from optstack.precision.scaler import ConstantScaler, DynamicScaler, LossScaler, NoScaler, make_scaler

__all__ = ["ConstantScaler", "DynamicScaler", "LossScaler", "NoScaler", "make_scaler"]
