"""The Megatron-compatible face of optstack: ``from megatron.core.optimizer import ...`` (and
``megatron.core.distributed``) becomes ``from optstack.megatron import ...``, with the same names, signatures and
defaults, translated to optstack's core, which never sees Megatron's names.
"""

from optstack.megatron.chained import ChainedOptimizer, ProxyDict
from optstack.megatron.config import AdamOptimizerConfig, OptimizerConfig, SGDOptimizerConfig, to_core
from optstack.megatron.ddp import DistributedDataParallel
from optstack.megatron.ddp_config import DistributedDataParallelConfig
from optstack.megatron.fsdp import FullyShardedDataParallel
from optstack.megatron.grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from optstack.megatron.groups import _get_param_groups, get_param_groups
from optstack.megatron.keys import (
    ParamGroupOverride,
    ParamKey,
    ParamPredicate,
    ParamWithNamePredicate,
    check_config_overrides_consistency,
    combine_param_group_overrides,
    get_mup_config_overrides,
    get_standard_config_overrides,
    param_group_override_to_tuple,
    to_rules,
)
from optstack.megatron.layer_wise_optimizer import LayerWiseDistributedOptimizer
from optstack.megatron.optimizer import get_megatron_muon_optimizer, get_megatron_optimizer
from optstack.megatron.optimizers import (
    DistributedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
    MixedPrecisionOptimizer,
    param_group_identifier_keys,
)
from optstack.megatron.process_groups import ProcessGroupCollection
from optstack.megatron.scheduler import OptimizerParamScheduler, get_canonical_lr_for_logging
from optstack.megatron.torch_optimizers import HybridDeviceOptimizer, TensorParallelMuon

__all__ = [
    "OptimizerConfig", "AdamOptimizerConfig", "SGDOptimizerConfig", "to_core",
    "ParamKey", "ParamPredicate", "ParamWithNamePredicate", "ParamGroupOverride",
    "combine_param_group_overrides", "param_group_override_to_tuple", "get_standard_config_overrides",
    "get_mup_config_overrides", "check_config_overrides_consistency", "to_rules", "get_param_groups",
    "OptimizerParamScheduler", "get_canonical_lr_for_logging",
    "MegatronOptimizer", "get_megatron_optimizer", "get_megatron_muon_optimizer",
    "ChainedOptimizer", "FP32Optimizer", "MixedPrecisionOptimizer", "Float16OptimizerWithFloat16Params",
    "DistributedOptimizer", "LayerWiseDistributedOptimizer", "ProxyDict",
    "ConstantGradScaler", "DynamicGradScaler", "MegatronGradScaler", "ProcessGroupCollection",
    "param_group_identifier_keys", "HybridDeviceOptimizer", "TensorParallelMuon", "_get_param_groups",
    "DistributedDataParallel", "DistributedDataParallelConfig", "FullyShardedDataParallel",
]
