"""optstack: the optimizer layer for large-model training in PyTorch."""

from optstack.protocol import StepResult

__version__ = "0.1.0"
__all__ = ["StepResult", "__version__"]
