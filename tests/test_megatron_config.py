"""optstack.megatron.OptimizerConfig: Megatron's fields and defaults, its translation, unsupported values."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from optstack import config as core
from optstack.megatron import OptimizerConfig, to_core

# Megatron Core's defaults for the fields the face must carry.
MEGATRON_DEFAULTS = {
    "lr": None, "min_lr": None, "decoupled_lr": None, "decoupled_min_lr": None, "weight_decay": 0.01,
    "apply_wd_to_qk_layernorm": False, "fp16": False, "bf16": False, "params_dtype": torch.float32,
    "optimizer": "adam", "loss_scale": None, "initial_loss_scale": 2**32, "min_loss_scale": 1.0,
    "loss_scale_window": 1000, "hysteresis": 2, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-08,
    "decoupled_weight_decay": True, "sgd_momentum": 0.9, "lion_beta1": 0.95, "lion_beta2": 0.98,
    "muon_momentum": 0.95, "muon_split_qkv": True, "muon_nesterov": False, "muon_scale_mode": "spectral",
    "muon_fp32_matmul_prec": "medium", "muon_coefficient_type": "quintic", "muon_num_ns_steps": 5,
    "muon_tp_mode": "duplicated", "muon_extra_scale_factor": 1.0, "muon_scalar_optimizer": "adam",
    "use_distributed_optimizer": False, "overlap_param_gather": False,
    "overlap_param_gather_with_optimizer_step": False, "use_layer_wise_distributed_optimizer": False,
    "optimizer_cpu_offload": False, "optimizer_offload_fraction": 0.0, "clip_grad": 1.0,
    "grad_norm_skip_threshold": math.inf, "log_num_zeros_in_grad": False, "exp_avg_dtype": torch.float32,
    "exp_avg_sq_dtype": torch.float32, "main_params_dtype": torch.float32,
    "use_precision_aware_optimizer": False,
}


def test_fields_and_defaults_are_megatrons() -> None:
    cfg = OptimizerConfig()
    for name, value in MEGATRON_DEFAULTS.items():
        assert getattr(cfg, name) == value, name
    names = [f.name for f in dataclasses.fields(OptimizerConfig)]
    assert names.index("grad_norm_skip_threshold") == names.index("clip_grad") + 1
    cfg.lr = 0.5  # mutable, like Megatron's
    assert OptimizerConfig(0.1, 0.01).min_lr == 0.01  # positional, like Megatron's


def test_default_translation() -> None:
    got = to_core(OptimizerConfig(lr=3e-4))
    assert got == core.OptimizerConfig(
        algorithm="adamw", lr=3e-4, min_lr=0.0, weight_decay=0.01, clip_grad=1.0,
        loss_scale=core.LossScaleConfig(mode="none"),
        lion=core.LionConfig(beta1=0.95, beta2=0.98),
    )
    assert got.grad_norm_skip_threshold is None and got.distributed.sharding == "replicated"
    # Megatron clips at 1.0 by default; the core does not, so the face must carry it over explicitly.
    assert got.clip_grad == 1.0 and core.OptimizerConfig().clip_grad == 0.0


@pytest.mark.parametrize(
    ("changes", "algorithm"),
    [({}, "adamw"), ({"decoupled_weight_decay": False}, "adam"), ({"optimizer": "sgd"}, "sgd"),
     ({"optimizer": "lion"}, "lion"), ({"optimizer": "muon"}, "muon")],
)
def test_optimizer_names(changes: dict, algorithm: str) -> None:
    assert to_core(OptimizerConfig(lr=1e-3, **changes)).algorithm == algorithm


def test_every_hyperparameter_is_carried() -> None:
    cfg = OptimizerConfig(
        lr=1e-3, min_lr=1e-5, decoupled_lr=2e-3, decoupled_min_lr=2e-5, weight_decay=0.1,
        apply_wd_to_qk_layernorm=True, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6, sgd_momentum=0.5,
        lion_beta1=0.9, lion_beta2=0.99, muon_momentum=0.9, muon_nesterov=True, muon_num_ns_steps=3,
        muon_coefficient_type="simple", muon_scale_mode="unit_rms_norm", muon_extra_scale_factor=0.2,
        muon_split_qkv=False, muon_fp32_matmul_prec="highest", muon_scalar_optimizer="lion", clip_grad=0.5,
        grad_norm_skip_threshold=10.0, log_num_zeros_in_grad=True, use_distributed_optimizer=True,
        overlap_param_gather=True, optimizer_cpu_offload=True, optimizer_offload_fraction=0.25,
        overlap_cpu_optimizer_d2h_h2d=True,
    )
    got = to_core(cfg)
    assert (got.lr, got.min_lr, got.decoupled_lr, got.decoupled_min_lr, got.weight_decay) == (
        1e-3, 1e-5, 2e-3, 2e-5, 0.1)
    assert got.apply_wd_to_qk_layernorm and got.log_num_zeros_in_grad
    assert (got.clip_grad, got.grad_norm_skip_threshold) == (0.5, 10.0)
    assert (got.adam.beta1, got.adam.beta2, got.adam.eps) == (0.8, 0.95, 1e-6)
    assert got.sgd == core.SGDConfig(momentum=0.5, nesterov=False)
    assert (got.lion.beta1, got.lion.beta2) == (0.9, 0.99)
    assert got.muon == core.MuonConfig(
        momentum=0.9, nesterov=True, ns_steps=3, coefficients="simple", scale_mode="unit_rms_norm",
        extra_scale_factor=0.2, split_qkv=False, matmul_precision="highest", scalar_algorithm="lion",
    )
    assert got.distributed.sharding == "zero1" and got.distributed.overlap_param_gather
    assert got.offload == core.OffloadConfig(enabled=True, fraction=0.25, overlap_transfers=True)


def test_precision_and_loss_scaling() -> None:
    fp16 = to_core(OptimizerConfig(lr=1e-3, fp16=True, initial_loss_scale=2.0**16, min_loss_scale=2.0,
                                   loss_scale_window=500, hysteresis=3))
    assert fp16.precision == "fp16"
    assert fp16.loss_scale == core.LossScaleConfig(mode="dynamic", initial=2.0**16, min_scale=2.0, window=500,
                                                   hysteresis=3)
    bf16 = to_core(OptimizerConfig(lr=1e-3, bf16=True, params_dtype=torch.bfloat16))
    assert bf16.precision == "bf16" and bf16.loss_scale.resolved_mode("bf16") == "none"
    constant = to_core(OptimizerConfig(lr=1e-3, bf16=True, loss_scale=128.0))
    assert (constant.loss_scale.mode, constant.loss_scale.initial) == ("constant", 128.0)
    assert to_core(OptimizerConfig(lr=1e-3, fp16=True, loss_scale=0)).loss_scale.mode == "dynamic"  # falsy


def test_layer_wise_and_min_lr_and_offload_off() -> None:
    got = to_core(OptimizerConfig(lr=1e-3, optimizer="muon", use_layer_wise_distributed_optimizer=True,
                                  decoupled_min_lr=1e-5, optimizer_offload_fraction=0.5))
    assert got.distributed.sharding == "layerwise"
    assert got.decoupled_min_lr is None  # ignored without decoupled_lr, as in Megatron
    assert got.offload.fraction == 0.0  # ignored without optimizer_cpu_offload, as in Megatron
    assert got.muon.scalar_algorithm == "adamw"
    with pytest.warns(DeprecationWarning, match="dist_muon"):
        legacy = to_core(OptimizerConfig(lr=1e-3, optimizer="dist_muon"))
    assert (legacy.algorithm, legacy.distributed.sharding) == ("muon", "layerwise")


def test_precision_aware_state_dtypes() -> None:
    got = to_core(OptimizerConfig(lr=1e-3, bf16=True, use_precision_aware_optimizer=True,
                                  exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.float16))
    assert (got.adam.exp_avg_dtype, got.adam.exp_avg_sq_dtype) == ("bf16", "fp16")
    with pytest.raises(ValueError, match="exp_avg_dtype=torch.bfloat16 needs use_precision_aware_optimizer"):
        OptimizerConfig(exp_avg_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="exp_avg_sq_dtype=torch.int8"):
        OptimizerConfig(use_precision_aware_optimizer=True, exp_avg_sq_dtype=torch.int8)
    eight = to_core(OptimizerConfig(lr=1e-3, bf16=True, use_precision_aware_optimizer=True,
                                    exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8))
    assert (eight.adam.exp_avg_dtype, eight.adam.exp_avg_sq_dtype) == ("8bit", "8bit")
    with pytest.raises(ValueError, match="use_precision_aware_optimizer=True needs optimizer='adam'"):
        OptimizerConfig(use_precision_aware_optimizer=True, optimizer="sgd")


def test_lr_none_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"OptimizerConfig.lr is None.*lr=\.\.\."):
        to_core(OptimizerConfig())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("main_params_dtype", torch.float16),  # bf16 is honoured (issue 13); fp16 masters are not
        ("main_grads_dtype", torch.float16),
        ("fp8_recipe", "delayed"),
        ("reuse_grad_buf_for_mxfp8_param_ag", True),
        ("optimizer_cuda_graph", True),
        ("optimizer", "shampoo"),
        ("muon_tp_mode", "sideways"),
        ("muon_scalar_optimizer", "sgd"),
    ],
)
def test_unsupported_values_name_the_field_and_value(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=re.escape(f"OptimizerConfig.{field}={value!r} is not supported")):
        OptimizerConfig(lr=1e-3, **{field: value})
    cfg = OptimizerConfig(lr=1e-3)
    setattr(cfg, field, value)  # Megatron code mutates configs; to_core checks again
    with pytest.raises(ValueError, match=field):
        to_core(cfg)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"fp16": True, "bf16": True}, "fp16=True and bf16=True"),
        ({"params_dtype": torch.bfloat16}, "params_dtype=torch.bfloat16"),
        ({"params_dtype": torch.float64}, "params_dtype=torch.float64"),
        ({"use_distributed_optimizer": True, "use_layer_wise_distributed_optimizer": True}, "pick one"),
        ({"overlap_param_gather": True}, "overlap_param_gather=True needs use_distributed_optimizer"),
    ],
)
def test_inconsistent_combinations(changes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OptimizerConfig(lr=1e-3, **changes)


@pytest.mark.parametrize("optimizer", ["muon", "adaptive_muon", "soap"])
def test_emerging_optimizers_refuse_fp16_when_built(optimizer: str) -> None:
    cfg = OptimizerConfig(lr=1e-3, optimizer=optimizer, fp16=True)  # Megatron refuses it at build, not here
    with pytest.raises(ValueError, match="fp16=True is not supported"):
        to_core(cfg)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"adam_beta1": 1.5}, "adam_beta1 must be in"),
        ({"sgd_momentum": -0.1, "optimizer": "sgd"}, "sgd_momentum"),
        ({"muon_coefficient_type": "cubic"}, "muon_coefficient_type must be one of"),
        ({"muon_num_ns_steps": 0}, "muon_num_ns_steps"),
        ({"fp16": True, "hysteresis": 0}, "hysteresis"),
        ({"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.5}, "optimizer_offload_fraction"),
        ({"loss_scale": -2.0, "bf16": True}, "loss_scale must be None or a finite number > 0"),
        ({"loss_scale": 8.0}, "loss_scale=8.0 needs fp16=True or bf16=True"),
        ({"loss_scale_window": 10.5}, "loss_scale_window must be a whole number"),
        ({"min_lr": 1.0}, r"min_lr \(1.0\) must be <= lr"),
    ],
)
def test_core_validation_speaks_megatron_names(changes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        to_core(OptimizerConfig(lr=1e-3, **changes))


def test_ignored_fields_are_accepted() -> None:
    cfg = OptimizerConfig(lr=1e-3, store_param_remainders=False, pin_cpu_grads=False, timers=print,
                          barrier_with_L1_time=True, config_logger_dir="/tmp/x",
                          soap_shampoo_beta=0.5, adaptive_muon_eps=1e-6)
    assert to_core(cfg) == to_core(OptimizerConfig(lr=1e-3))
    with pytest.raises(ValueError, match="optstack.megatron.OptimizerConfig"):
        to_core(core.OptimizerConfig())  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["blockwise", "duplicated", "distributed"])
def test_muon_tp_mode_maps_to_muon_tp_mode(mode: str) -> None:
    assert to_core(OptimizerConfig(optimizer="muon", lr=0.02, muon_tp_mode=mode)).muon.tp_mode == mode


@pytest.mark.parametrize("field", ["muon_nesterov", "muon_use_nesterov"])
def test_either_spelling_of_muon_nesterov_turns_it_on(field: str) -> None:
    cfg = OptimizerConfig(optimizer="muon", lr=0.02, **{field: True})
    assert to_core(cfg).muon.nesterov


def test_core_combination_errors_speak_megatron_names() -> None:
    with pytest.raises(ValueError, match=r"OptimizerConfig: optimizer_cpu_offload=True needs an algorithm with a "
                                         r"host kernel, but 'lion' has none"):
        to_core(OptimizerConfig(lr=1e-3, optimizer="lion", optimizer_cpu_offload=True))
    with pytest.raises(ValueError, match=r"distributed.sharding='layerwise' needs a Muon-family algorithm"):
        to_core(OptimizerConfig(lr=1e-3, optimizer="adam", use_layer_wise_distributed_optimizer=True))


def test_overlap_flags_megatron_accepts() -> None:
    # The gathers already overlap the step (each stage launches them as it finishes); Megatron's preconditions hold.
    OptimizerConfig(lr=1.0, use_distributed_optimizer=True, overlap_param_gather=True,
                    overlap_param_gather_with_optimizer_step=True)
    with pytest.raises(ValueError, match="overlap_param_gather_with_optimizer_step=True needs"):
        OptimizerConfig(lr=1.0, overlap_param_gather_with_optimizer_step=True)
    # The layer-wise optimizer may ask for overlap_param_gather without the distributed optimizer (current main).
    core = to_core(OptimizerConfig(lr=1.0, optimizer="muon", use_layer_wise_distributed_optimizer=True,
                                   overlap_param_gather=True))
    assert core.distributed.sharding == "layerwise" and not core.distributed.overlap_param_gather
    with pytest.raises(ValueError, match="overlap_param_gather=True needs use_distributed_optimizer=True or"):
        OptimizerConfig(lr=1.0, overlap_param_gather=True)
