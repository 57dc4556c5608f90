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
    dtype_from_name,
)


def test_defaults_are_valid_and_frozen():
    cfg = OptimizerConfig()
    assert cfg.algorithm == "adamw" and cfg.precision == "fp32" and cfg.param_dtype == torch.float32
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
        (lambda: DistributedConfig(overlap_param_gather=True), "overlap_param_gather"),
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
