"""optstack.names: one stable name per parameter through wrappers, torch.compile, chunks and bare parameters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from optstack.checkpoint import load_checkpoint, save_checkpoint
from optstack.config import OptimizerConfig
from optstack.distributed.ddp import DataParallel
from optstack.distributed.parallel import ParallelGroups
from optstack.factory import build_optimizer
from optstack.megatron import DistributedDataParallel, DistributedDataParallelConfig
from optstack.names import look_through, model_state, named_parameters


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def _names(source) -> list[str]:
    return [n for n, _ in named_parameters(source)]


PLAIN = ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]


class _Wrapper(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


# -- torch.compile ----------------------------------------------------------------------------------------
def test_compiled_model_has_the_plain_models_names_and_tensors():
    model = _model()
    compiled = torch.compile(model, backend="eager")  # an OptimizedModule; never called, so nothing compiles
    assert type(compiled).__name__ == "OptimizedModule" and next(iter(compiled.state_dict())).startswith("_orig_mod.")
    assert named_parameters(compiled) == named_parameters(model) and _names(model) == PLAIN
    assert look_through(compiled) is model
    assert model_state(compiled).keys() == model.state_dict().keys()
    # A compiled submodule puts `_orig_mod` in the middle of names; it is dropped there too.
    model[2] = torch.compile(model[2], backend="eager")
    assert _names(model) == PLAIN and list(model_state(model)) == list(_model().state_dict())
    # ... and from given pairs.
    assert _names(list(compiled.named_parameters())) == PLAIN


def test_a_checkpoint_of_the_compiled_model_loads_into_the_plain_one(tmp_path: Path):
    model = _model()
    compiled = torch.compile(model, backend="eager")
    built = build_optimizer(OptimizerConfig(lr=1e-2), compiled)
    assert [n for g in built.param_groups for n in g["param_names"]] == [
        n for g in build_optimizer(OptimizerConfig(lr=1e-2), _model()).param_groups for n in g["param_names"]]
    model(torch.randn(5, 4)).square().mean().backward()  # the plain forward: same parameters, no compile
    built.optimizer.step()
    save_checkpoint(tmp_path, built.optimizer, step=1, model=compiled)
    plain = _model(seed=1)
    load_checkpoint(tmp_path, build_optimizer(OptimizerConfig(lr=1e-2), plain).optimizer, model=plain)
    for (name, a), b in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


# -- wrappers ---------------------------------------------------------------------------------------------
def test_data_parallel_wrappers_are_looked_through():
    single = ParallelGroups.single()
    wrapped = [
        DataParallel(_model(), groups=single),
        DistributedDataParallel(None, DistributedDataParallelConfig(), _model(), pg_collection=single),
        _Wrapper(_Wrapper(_model())),  # any stack of plain `.module` holders
        torch.compile(DataParallel(_model(), groups=single), backend="eager"),
    ]
    for w in wrapped:
        assert next(n for n, _ in w.named_parameters()) != "0.weight"  # the wrapper's own names differ
        assert _names(w) == PLAIN, type(w).__name__
        assert list(model_state(w)) == list(_model().state_dict()), type(w).__name__


def test_a_module_attribute_next_to_other_state_is_not_a_wrapper():
    holder = _Wrapper(nn.Linear(2, 2))
    holder.scale = nn.Parameter(torch.ones(1))
    assert _names(holder) == ["scale", "module.weight", "module.bias"]
    holder = _Wrapper(nn.Linear(2, 2))
    holder.head = nn.Linear(2, 1)
    assert _names(holder) == ["module.weight", "module.bias", "head.weight", "head.bias"]


# -- bare parameters and pairs ----------------------------------------------------------------------------
def test_bare_parameters_are_named_by_position():
    model = _model()
    model[0].bias.requires_grad_(False)
    named = named_parameters(model.parameters())
    assert [n for n, _ in named] == ["param.0", "param.2", "param.3", "param.4", "param.5"]  # frozen keeps its number
    assert [p for _, p in named] == [p for p in model.parameters() if p.requires_grad]
    assert len(named_parameters(model.parameters(), trainable_only=False)) == 6
    assert named_parameters([]) == []


def test_build_optimizer_takes_parameters_and_pairs():
    model = _model()
    built = build_optimizer(OptimizerConfig(lr=1e-2), model.parameters())  # a generator: read once
    assert sorted(built.group_of()) == [f"param.{i}" for i in range(6)]
    model(torch.randn(5, 4)).square().mean().backward()
    built.optimizer.step()
    assert built.optimizer.last_result.applied
    pairs = build_optimizer(OptimizerConfig(lr=1e-2), model.named_parameters())
    assert sorted(pairs.group_of()) == sorted(PLAIN)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(OptimizerConfig(lr=1e-2), iter([]))


def test_pairs_ties_and_bad_items():
    w = nn.Parameter(torch.ones(2))
    assert _names([("emb", w), ("out", w)]) == ["emb"]  # a tied tensor is kept once, under its first name
    with pytest.raises(ValueError, match="two different tensors are named 'x'"):
        named_parameters([("x", nn.Parameter(torch.ones(1))), ("x", nn.Parameter(torch.ones(1)))])
    with pytest.raises(ValueError, match=r"\(name, tensor\) pairs or tensors"):
        named_parameters([("x", w), w])
    with pytest.raises(ValueError, match="must be an nn.Module"):
        model_state([w])  # type: ignore[arg-type]


# -- chunks -----------------------------------------------------------------------------------------------
def test_chunks_keep_megatrons_naming_and_are_each_looked_through():
    a, b = _model(), _model()
    prefixed = [f"chunk{i}.{n}" for i in range(2) for n in PLAIN]
    assert _names([a, b]) == prefixed
    assert _names([DataParallel(a, groups=ParallelGroups.single()), torch.compile(b, backend="eager")]) == prefixed
    c, d = nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Identity(), nn.Linear(2, 2))
    assert _names([c, _Wrapper(d)]) == ["0.weight", "0.bias", "1.weight", "1.bias"]  # unique: kept as they are
    shared = nn.Linear(2, 2)
    assert _names([nn.Sequential(shared), nn.Sequential(nn.Identity(), shared)]) == ["0.weight", "0.bias"]
