"""Config fuzz: every field of every config dataclass (core and Megatron face), introspected, given values of
every kind. A value not of the field's annotated type must be refused with a ``ValueError`` naming the field
(never accepted: ``bool("false")`` is True; never a crash elsewhere); a value of the right type is accepted or
refused with a ``ValueError``, nothing else."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from typing import Any

import pytest
import torch

from optstack import config as core
from optstack.megatron import config as mcfg

CORE_CLASSES = [core.LossScaleConfig, core.AdamConfig, core.SGDConfig, core.LionConfig, core.MuonConfig,
                core.DistributedConfig, core.OffloadConfig, core.OptimizerConfig]
# (AdamOptimizerConfig and SGDOptimizerConfig only change the default of `optimizer`.)
MEGATRON_CLASSES = [mcfg.OptimizerConfig]
# The section prefix the core's errors use for a field of each class ("sgd.nesterov").
PREFIX = {core.LossScaleConfig: "loss_scale.", core.AdamConfig: "adam.", core.SGDConfig: "sgd.",
          core.LionConfig: "lion.", core.MuonConfig: "muon.", core.DistributedConfig: "distributed.",
          core.OffloadConfig: "offload.", core.OptimizerConfig: ""}


def _values() -> list[Any]:
    """One of every kind a config file or a typo produces."""
    return [None, True, False, 0, 1, -1, 3, 0.5, 2.5, 1e9, math.nan, math.inf, -math.inf, "", "false", "true", "1",
            "bf16", "fp16", "adamw", "quintic", "zero1", "dynamic", [], ["bf16"], {}, {"enabled": True}, (1,),
            object(), torch.float32, torch.bfloat16, torch.int32, core.AdamConfig(), core.SGDConfig(), print]


def _conforms(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of the annotated type ``hint`` (an independent reading of the annotations)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, arg) for arg in typing.get_args(hint))
    if origin is typing.Literal:
        return any(value == arg and type(value) is type(arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return type(value) is bool
    if hint is int:
        return type(value) is int
    if hint is float:
        return type(value) in (int, float)  # finiteness is a range check: refused or accepted, both fine here
    if hint is Callable or origin is Callable or hint is typing.Callable:
        return callable(value)
    if isinstance(hint, type):
        return isinstance(value, hint)
    raise AssertionError(f"the fuzz does not know the annotation {hint!r}")


def _fields(classes: list[type]) -> list[tuple[type, str, Any]]:
    out = []
    for cls in classes:
        hints = typing.get_type_hints(cls, vars(core) | vars(mcfg))
        out += [(cls, f.name, hints[f.name]) for f in dataclasses.fields(cls)]
    return out


def _id(case: tuple[type, str, Any]) -> str:
    cls, name, _ = case
    return f"{cls.__module__.split('.')[-1]}.{cls.__name__}.{name}"


def _problem(build: Callable[[], Any], field_name: str, hint: Any, value: Any) -> str | None:
    """What is wrong with how ``build`` (setting the field to ``value``) reacts, or None."""
    try:
        build()
    except ValueError as exc:
        if not _conforms(value, hint) and field_name not in str(exc):
            return f"{value!r}: the error does not name {field_name!r}: {exc}"
        return None  # a value of the right type may be out of range or refused in combination
    except Exception as exc:  # noqa: BLE001 - any other exception is a crash the user cannot place
        return f"{value!r}: crashed with {type(exc).__name__}: {exc}"
    return None if _conforms(value, hint) else f"{value!r}: silently accepted for a field of type {hint}"


@pytest.mark.parametrize("case", _fields(CORE_CLASSES), ids=_id)
def test_core_field_refuses_wrong_types_naming_the_field(case):
    cls, name, hint = case
    problems = [_problem(lambda v=value: cls(**{name: v}), PREFIX[cls] + name, hint, value) for value in _values()]
    assert [p for p in problems if p] == []


@pytest.mark.parametrize("case", _fields(MEGATRON_CLASSES), ids=_id)
def test_megatron_field_refuses_wrong_types_naming_the_field(case):
    cls, name, hint = case
    base = {"lr": 1e-3} if name != "lr" else {}
    # to_core too: Megatron code sets fields after construction, and the translation must not crash either.
    problems = [_problem(lambda v=value: mcfg.to_core(cls(**base, **{name: v})), name, hint, value)
                for value in _values()]
    assert [p for p in problems if p] == []


def test_megatron_fields_set_after_construction_are_checked_by_to_core():
    config = mcfg.OptimizerConfig(lr=1e-3)
    config.bf16 = "false"  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"OptimizerConfig\.bf16 must be a bool"):
        mcfg.to_core(config)


@pytest.mark.parametrize(("make", "field_name"), [
    (lambda: core.SGDConfig(nesterov="false"), "sgd.nesterov"),
    (lambda: core.DistributedConfig(bucket_size=True), "distributed.bucket_size"),
    (lambda: core.OptimizerConfig(adam=None), "adam"),
    (lambda: core.OptimizerConfig(distributed={"sharding": "zero1"}), "distributed"),
    (lambda: core.OptimizerConfig(offload={"enabled": True}), "offload"),
    (lambda: core.OptimizerConfig(loss_scale={}), "loss_scale"),
    (lambda: core.OptimizerConfig(precision=["bf16"]), "precision"),
    (lambda: core.OptimizerConfig(norm_type=0.01), "norm_type"),
    (lambda: core.OptimizerConfig(norm_type=1000), "norm_type"),
    (lambda: core.OptimizerConfig(algorithm="adamw", distributed=core.DistributedConfig(sharding="layerwise")),
     "sharding"),
    (lambda: mcfg.OptimizerConfig(lr=1e-3, bf16="false"), "bf16"),
    (lambda: mcfg.OptimizerConfig(lr=1e-3, initial_loss_scale=None), "initial_loss_scale"),
    (lambda: mcfg.OptimizerConfig(lr=1e-3, loss_scale_window=math.inf), "loss_scale_window"),
])
def test_the_reported_cases_are_refused_naming_the_field(make, field_name):
    with pytest.raises(ValueError, match=field_name):
        make()


@pytest.mark.parametrize("norm_type", [1, 1.5, 2.0, 3, 4.0, math.inf])
def test_numerically_sound_norm_types_are_accepted(norm_type):
    assert core.OptimizerConfig(norm_type=norm_type).norm_type == norm_type
