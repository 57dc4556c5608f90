"""The update algorithms (one module each: a ``torch.optim.Optimizer`` with a single-tensor reference kernel,
the test oracle, and a fast multi-tensor path) and the registry that names them. ``Muon`` is imported on first
use (``optstack.algorithms.Muon`` or ``get_algorithm("muon")``), so this package does not pull in Newton-Schulz.
"""

from __future__ import annotations

from typing import Any

from optstack.algorithms.adamw import AdamW, adamw_reference
from optstack.algorithms.lion import Lion, lion_reference
from optstack.algorithms.registry import AlgorithmSpec, Family, algorithm_names, get_algorithm, register
from optstack.algorithms.sgd import SGD, sgd_reference

__all__ = ["SGD", "AdamW", "AlgorithmSpec", "Family", "Lion", "Muon", "adamw_reference", "algorithm_names",
           "get_algorithm", "lion_reference", "register", "sgd_reference"]


def __getattr__(name: str) -> Any:
    if name == "Muon":
        from optstack.algorithms.muon import Muon

        return Muon
    raise AttributeError(f"module 'optstack.algorithms' has no attribute {name!r}")
