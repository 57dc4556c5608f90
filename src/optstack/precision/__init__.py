"""optstack.precision: loss scalers and the FP32 / mixed-precision (fp32 master weights) stages."""

from optstack.precision.scaler import ConstantScaler, DynamicScaler, LossScaler, NoScaler, make_scaler
from optstack.precision.stages import FP32Stage, MixedPrecisionStage

__all__ = [
    "ConstantScaler",
    "DynamicScaler",
    "FP32Stage",
    "LossScaler",
    "MixedPrecisionStage",
    "NoScaler",
    "make_scaler",
]
