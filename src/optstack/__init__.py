"""optstack: the optimizer layer for large-model training in PyTorch.

The public API is re-exported here; see README.md for a tour and ``optstack.megatron`` for the
Megatron-compatible face.
"""

from optstack.config import (
    AdamConfig,
    DistributedConfig,
    LionConfig,
    LossScaleConfig,
    MuonConfig,
    OffloadConfig,
    OptimizerConfig,
    SGDConfig,
)
from optstack.factory import BuiltOptimizer, build_optimizer, default_rules, wrap_data_parallel
from optstack.optimizer import ChainedOptimizer
from optstack.protocol import StepResult, set_phase_hook
from optstack.rules import Rule, explain, format_explain, mup_rules, resolve, standard_rules
from optstack.schedule import LRSchedule, Scheduler, WDSchedule

__version__ = "0.1.0"
__all__ = [
    "AdamConfig",
    "BuiltOptimizer",
    "ChainedOptimizer",
    "DistributedConfig",
    "LRSchedule",
    "LionConfig",
    "LossScaleConfig",
    "MuonConfig",
    "OffloadConfig",
    "OptimizerConfig",
    "Rule",
    "SGDConfig",
    "Scheduler",
    "StepResult",
    "WDSchedule",
    "__version__",
    "build_optimizer",
    "default_rules",
    "explain",
    "format_explain",
    "mup_rules",
    "resolve",
    "set_phase_hook",
    "standard_rules",
    "wrap_data_parallel",
]
