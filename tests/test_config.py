"""Config validation: every bad value is a ValueError naming the field."""

from __future__ import annotations

import math

import pytest
import torch

from optstack.config import (
    AdamConfig,
    DistributedConfig,
    LionConfig,
    LossScaleConfig,
    MuonConfig,
    OffloadConfig,
    OptimizerConfig,
    SGDConfig,
    check_combination,
    dtype_from_name,
)
from optstack.offload import HybridDeviceOptimizer
from optstack.precision.scaler import ConstantScaler, DynamicScaler, NoScaler


def test_defaults_are_valid_and_frozen():
    cfg = OptimizerConfig()
    assert cfg.algorithm == "adamw" and cfg.precision == "fp32" and cfg.param_dtype == torch.float32
    assert cfg.clip_grad == 0.0  # as torch's AdamW: no clipping unless asked
    with pytest.raises(AttributeError):
        cfg.lr = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: OptimizerConfig(lr=-1.0), "lr"),
        (lambda: OptimizerConfig(lr=math.nan), "lr"),
        (lambda: OptimizerConfig(lr=1e-3, min_lr=1e-2), "min_lr"),
        (lambda: OptimizerConfig(weight_decay=-0.1), "weight_decay"),
        (lambda: OptimizerConfig(decoupled_min_lr=1e-4), "decoupled_min_lr"),
        (lambda: OptimizerConfig(decoupled_lr=1e-4, decoupled_min_lr=1e-3), "decoupled_min_lr"),
        (lambda: OptimizerConfig(mup_width_mult=0.0), "mup_width_mult"),
        (lambda: OptimizerConfig(precision="fp8"), "precision"),  # type: ignore[arg-type]
        (lambda: OptimizerConfig(clip_grad=-1.0), "clip_grad"),
        (lambda: OptimizerConfig(grad_norm_skip_threshold=0.0), "grad_norm_skip_threshold"),
        (lambda: OptimizerConfig(algorithm="muon", precision="fp16"), "fp16"),
        (lambda: OptimizerConfig(loss_scale=LossScaleConfig(mode="dynamic")), "loss_scale.mode"),
        (lambda: OptimizerConfig(algorithm=""), "algorithm"),
        (lambda: AdamConfig(beta1=1.0), "adam.beta1"),
        (lambda: AdamConfig(eps=-1.0), "adam.eps"),
        (lambda: AdamConfig(exp_avg_dtype="int8"), "adam.exp_avg_dtype"),  # type: ignore[arg-type]
        (lambda: SGDConfig(momentum=-0.1), "sgd.momentum"),
        (lambda: SGDConfig(momentum=0.0, nesterov=True), "sgd.nesterov"),
        (lambda: LionConfig(beta2=1.5), "lion.beta2"),
        (lambda: MuonConfig(ns_steps=0), "muon.ns_steps"),
        (lambda: MuonConfig(coefficients="cubic"), "muon.coefficients"),
        (lambda: MuonConfig(scale_mode="rms"), "muon.scale_mode"),  # type: ignore[arg-type]
        (lambda: MuonConfig(scalar_algorithm="muon"), "muon.scalar_algorithm"),
        (lambda: LossScaleConfig(initial=0.0), "loss_scale.initial"),
        (lambda: LossScaleConfig(min_scale=8.0, initial=4.0), "loss_scale.min_scale"),
        (lambda: LossScaleConfig(window=0), "loss_scale.window"),
        (lambda: LossScaleConfig(hysteresis=0), "loss_scale.hysteresis"),
        (lambda: LossScaleConfig(backoff_factor=1.0), "loss_scale.backoff_factor"),
        (lambda: DistributedConfig(sharding="zero3"), "distributed.sharding"),  # type: ignore[arg-type]
        (lambda: DistributedConfig(bucket_size=0), "distributed.bucket_size"),
        (lambda: OptimizerConfig(distributed=DistributedConfig(overlap_param_gather=True)), "overlap_param_gather"),
        (lambda: OffloadConfig(fraction=1.5), "offload.fraction"),
    ],
)
def test_bad_values_name_the_field(make, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        make()


def test_loss_scale_default_mode_follows_precision():
    ls = LossScaleConfig()
    assert ls.resolved_mode("fp16") == "dynamic"
    assert ls.resolved_mode("bf16") == "none"
    assert LossScaleConfig(mode="constant").resolved_mode("bf16") == "constant"


def test_with_changes_validates_and_rejects_unknown_fields():
    cfg = OptimizerConfig().with_changes(lr=3e-4)
    assert cfg.lr == 3e-4
    with pytest.raises(ValueError, match="no field"):
        OptimizerConfig().with_changes(learning_rate=1.0)
    with pytest.raises(ValueError, match="lr"):
        OptimizerConfig().with_changes(lr=-2.0)


def test_dtype_from_name():
    assert dtype_from_name("bf16") == torch.bfloat16
    with pytest.raises(ValueError, match="my_field"):
        dtype_from_name("float32", "my_field")


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: SGDConfig(nesterov="false"), "sgd.nesterov must be a bool"),  # type: ignore[arg-type]
        (lambda: MuonConfig(nesterov=1), "muon.nesterov must be a bool"),  # type: ignore[arg-type]
        (lambda: MuonConfig(split_qkv="yes"), "muon.split_qkv must be a bool"),  # type: ignore[arg-type]
        (lambda: MuonConfig(scalar_algorithm=None), "muon.scalar_algorithm"),  # type: ignore[arg-type]
        (lambda: DistributedConfig(overlap_grad_reduce="no"), "distributed.overlap_grad_reduce must be a bool"),  # type: ignore[arg-type]
        (lambda: DistributedConfig(average_in_collective=0), "distributed.average_in_collective must be a bool"),  # type: ignore[arg-type]
        (lambda: DistributedConfig(bucket_size=True), "distributed.bucket_size"),
        (lambda: OptimizerConfig(log_num_zeros_in_grad="true"), "log_num_zeros_in_grad must be a bool"),  # type: ignore[arg-type]
        (lambda: OptimizerConfig(apply_wd_to_qk_layernorm=1), "apply_wd_to_qk_layernorm must be a bool"),  # type: ignore[arg-type]
    ],
)
def test_flags_must_be_real_bools(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"adam": None}, r"adam must be of type AdamConfig, got NoneType None; pass adam=AdamConfig\(\.\.\.\)"),
        ({"distributed": {}}, r"distributed must be of type DistributedConfig, got dict \{\}"),
        ({"offload": {"enabled": True}}, r"offload must be of type OffloadConfig, got dict"),
        ({"loss_scale": {}}, r"loss_scale must be of type LossScaleConfig"),
        ({"muon": SGDConfig()}, r"muon must be of type MuonConfig, got SGDConfig"),
        ({"precision": ["bf16"]}, r"precision must be one of \['bf16', 'fp16', 'fp32'\], got \['bf16'\]"),
    ],
)
def test_sections_and_precision_of_the_wrong_type_name_the_field(changes, match):
    with pytest.raises(ValueError, match=match):
        OptimizerConfig(**changes)


@pytest.mark.parametrize("norm_type", [0.01, 0.5, 0.0, -1.0, math.nan, True])
def test_norm_type_below_one_is_refused(norm_type):
    with pytest.raises(ValueError, match=r"norm_type must be a number >= 1"):
        OptimizerConfig(norm_type=norm_type)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3, math.inf])
def test_norm_types_allowed(norm_type):
    assert OptimizerConfig(norm_type=norm_type).norm_type == norm_type


# -- check_combination: one decision point, one error per refused combination --------------------------
@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"algorithm": "muon", "precision": "fp16"}, r"precision='fp16' is not supported with algorithm='muon'"),
        ({"loss_scale": LossScaleConfig(mode="constant")}, r"loss_scale.mode='constant' needs precision"),
        ({"distributed": DistributedConfig(sharding="layerwise", overlap_param_gather=True), "algorithm": "muon"},
         r"distributed.overlap_param_gather needs distributed.sharding='zero1'.*got sharding='layerwise'"),
        ({"algorithm": "lion", "offload": OffloadConfig(enabled=True)},
         r"offload.enabled=True needs an algorithm with a host kernel, but 'lion' has none"),
        ({"offload": OffloadConfig(enabled=True), "distributed": DistributedConfig(sharding="layerwise")},
         r"offload.enabled=True cannot be combined with distributed.sharding='layerwise'"),
        ({"algorithm": "adamw", "distributed": DistributedConfig(sharding="layerwise")},
         r"distributed.sharding='layerwise' needs a Muon-family algorithm.*algorithm='adamw'.*sharding='zero1'"),
        ({"algorithm": "torch.optim.RMSprop", "distributed": DistributedConfig(sharding="layerwise")},
         r"needs a Muon-family algorithm.*'torch.optim.RMSprop'"),
    ],
)
def test_refused_combinations_fail_at_construction(changes, match):
    with pytest.raises(ValueError, match=match):
        OptimizerConfig(**changes)


def test_allowed_combinations():
    OptimizerConfig(algorithm="muon", distributed=DistributedConfig(sharding="layerwise"))
    OptimizerConfig(distributed=DistributedConfig(sharding="zero1", overlap_param_gather=True),
                    offload=OffloadConfig(enabled=True, fraction=0.5))
    OptimizerConfig(precision="bf16", loss_scale=LossScaleConfig(mode="constant"))
    # Offload is off: its algorithm and sharding are not in question.
    OptimizerConfig(algorithm="lion", offload=OffloadConfig(enabled=False, fraction=1.0))


def test_check_combination_asks_spec_of_only_for_rules_that_need_the_algorithm():
    asked: list[str] = []

    def spec_of(name: str):
        asked.append(name)
        from optstack.algorithms import get_algorithm

        return get_algorithm("muon")

    check_combination(OptimizerConfig(algorithm="adamw"), spec_of=spec_of)
    assert asked == []
    cfg = OptimizerConfig(algorithm="muon", distributed=DistributedConfig(sharding="layerwise"))
    check_combination(cfg, spec_of=spec_of)
    assert asked == ["muon"]


# -- sections build their objects ---------------------------------------------------------------------
def test_loss_scale_builds_its_scaler():
    assert isinstance(LossScaleConfig().build("bf16"), NoScaler)
    constant = LossScaleConfig(mode="constant", initial=128.0).build("bf16")
    assert isinstance(constant, ConstantScaler) and constant.scale == 128.0
    dynamic = LossScaleConfig(initial=2.0**16, min_scale=2.0, window=10, hysteresis=3).build("fp16")
    assert isinstance(dynamic, DynamicScaler) and dynamic.scale == 2.0**16


def test_offload_wraps_the_optimizer_maker():
    from optstack.algorithms import AdamW, get_algorithm

    def make(groups):
        return AdamW(groups, lr=0.1)

    assert OffloadConfig().wrap(make, get_algorithm("adamw")) is make
    wrapped = OffloadConfig(enabled=True, fraction=1.0).wrap(make, get_algorithm("adamw"))
    p = torch.zeros(4, requires_grad=True)
    assert isinstance(wrapped([{"params": [p]}]), HybridDeviceOptimizer)
    with pytest.raises(ValueError, match="'lion' has none; offloadable algorithms: adam, adamw, sgd"):
        OffloadConfig(enabled=True).wrap(make, get_algorithm("lion"))
