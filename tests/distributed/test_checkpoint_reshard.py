"""Checkpoints across data-parallel sizes and layouts on real gloo ranks.

Each case trains K steps at one size and layout and saves; the uninterrupted run trains 5 more steps and
saves again. Resumed runs load the step-K checkpoint at other sizes and layouts (ZeRO-1 at 3, replicated in
this process, ...), train the same 5 steps and save. Their final checkpoints must equal the uninterrupted
one's: element-wise state and masters to fp32 round-off, steps, loss scaler and scheduler exactly.

Every rank trains on the same whole batch, so the averaged gradient is the same at every size (to fp32
round-off: ``g / 3 * 3``): the checkpoint, not the data split, is what is tested.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from optstack.algorithms.registry import get_algorithm
from optstack.checkpoint import load_checkpoint, save_checkpoint
from optstack.checkpoint.load import Saved, read_manifest, read_model, read_ranges
from optstack.config import DistributedConfig, LossScaleConfig, OptimizerConfig, SOAPConfig
from optstack.distributed.comm import world_comm
from optstack.factory import build_optimizer, wrap_data_parallel
from optstack.schedule import LRSchedule

K, MORE = 3, 5
CASES: dict[str, dict[str, Any]] = {
    "zero1-adamw-bf16": {"model": "mlp", "dtype": torch.bfloat16, "algorithm": "adamw", "sharding": "zero1",
                         "overlap": True},
    "layerwise-muon": {"model": "mlp", "dtype": torch.float32, "algorithm": "muon", "sharding": "layerwise"},
    # Muon's matrices whole in their owners' reduce-scatter shards (whole-shard buffers), gathered overlapped
    "zero1-muon-bf16": {"model": "mlp", "dtype": torch.bfloat16, "algorithm": "muon", "sharding": "zero1",
                        "overlap": True},
    "moe-chained-zero1": {"model": "moe", "dtype": torch.bfloat16, "algorithm": "adamw", "sharding": "zero1"},
    # dense and expert Muon stages over whole-shard buffers (the experts' over expert data-parallel)
    "moe-zero1-muon": {"model": "moe", "dtype": torch.bfloat16, "algorithm": "muon", "sharding": "zero1"},
    # the adaptive Muons: NorMuon's per-row second moment travels in its element-wise (exported) form
    "zero1-normuon": {"model": "mlp", "dtype": torch.float32, "algorithm": "normuon", "sharding": "zero1"},
    "layerwise-adamuon": {"model": "mlp", "dtype": torch.float32, "algorithm": "adamuon", "sharding": "layerwise"},
    # SOAP's square factors and eigenbases travel as parameter-shaped pages; refreshed at steps 2, 4 and 6, across
    # the save at K. max_precond_dim 6: the factors of full rank (the (12, 6) and (3, 12) matrices' short sides)
    "zero1-soap": {"model": "mlp", "dtype": torch.float32, "algorithm": "soap", "sharding": "zero1",
                   "soap": {"max_precond_dim": 6, "precondition_frequency": 2}},
    "layerwise-soap": {"model": "mlp", "dtype": torch.float32, "algorithm": "soap", "sharding": "layerwise",
                       "soap": {"max_precond_dim": 6, "precondition_frequency": 2}},
}


class _MoE(nn.Module):
    """Dense in, two experts (Megatron's ``allreduce = False`` mark), dense out: a dense and an expert stage."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 32)  # wide enough that ZeRO-1's 128-element shard alignment splits it
        self.experts = nn.ModuleList([nn.Linear(32, 32) for _ in range(2)])
        for p in self.experts.parameters():
            p.allreduce = False
        self.out = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(sum(torch.tanh(e(h)) for e in self.experts))


def _model(case: dict[str, Any], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if case["model"] == "moe":
        model: nn.Module = _MoE()
    else:
        model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3))
    return model.to(case["dtype"])


def _stack(case: dict[str, Any], sharding: str, seed: int) -> tuple[nn.Module, nn.Module, Any]:
    low = case["dtype"] != torch.float32
    config = OptimizerConfig(
        algorithm=case["algorithm"], lr=1e-2, weight_decay=0.1, clip_grad=1.0,
        precision="bf16" if low else "fp32",
        loss_scale=LossScaleConfig(mode="dynamic", initial=2.0**10, window=2) if low else LossScaleConfig(),
        distributed=DistributedConfig(sharding=sharding, bucket_size=50, grad_dtype="fp32",
                                      overlap_param_gather=sharding == "zero1" and case.get("overlap", False)),
        soap=SOAPConfig(**case.get("soap", {})),
    )
    model = _model(case, seed)
    wrapped = wrap_data_parallel(config, model)
    # Mid-warmup all along: the lr changes every step, so a lost scheduler or lr shows.
    schedule = LRSchedule(init_lr=1e-3, max_lr=1e-2, warmup_steps=20, decay_steps=100, style="cosine")
    return model, wrapped, build_optimizer(config, wrapped, lr_schedule=schedule)


def _train(wrapped: nn.Module, built: Any, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(12, 6, generator=gen), torch.randn(12, 3, generator=gen)
        dtype = next(wrapped.parameters()).dtype
        loss = ((wrapped(x.to(dtype)).float() - y) ** 2).mean()
        built.optimizer.scale_loss(loss).backward()
        built.optimizer.step()
        assert built.optimizer.last_result.applied
        built.optimizer.zero_grad()
        built.scheduler.step()


def run(root: str, name: str, sharding: str, source: str | None, tag: str) -> int:
    """On every rank: train K steps and save ``tag``-K (``source`` None), or load ``source``; then train
    MORE steps and save ``tag``-end. Returns the data-parallel size."""
    case = CASES[name]
    model, wrapped, built = _stack(case, sharding, seed=0 if source is None else 7)
    if source is None:
        _train(wrapped, built, range(K))
        save_checkpoint(Path(root) / f"{tag}-K", built.optimizer, step=K, scheduler=built.scheduler, model=model)
    else:
        info = load_checkpoint(Path(root) / source, built.optimizer, scheduler=built.scheduler, model=model)
        assert info.step == K
    _train(wrapped, built, range(K, K + MORE))
    save_checkpoint(Path(root) / f"{tag}-end", built.optimizer, step=K + MORE, scheduler=built.scheduler,
                    model=model)
    return world_comm().size


def load_without_model(root: str, name: str, dtype: torch.dtype) -> dict[str, bool]:
    """On every rank: train K steps and save without the model; load into a stack with other weights, again
    without ``model=``. Its trainable parameters must then be the checkpoint's masters (rounded to their dtype)
    on every rank: under ZeRO-1 each rank loads only its range, so this needs the parameter gather."""
    case = {**CASES[name], "dtype": dtype}
    _, wrapped, built = _stack(case, case["sharding"], seed=0)
    _train(wrapped, built, range(K))
    save_checkpoint(Path(root), built.optimizer, step=K)
    model, _, fresh = _stack(case, case["sharding"], seed=7)
    directory, manifest = read_manifest(root)
    whole = {n: (0, torch.Size(p["shape"]).numel()) for n, p in manifest["params"].items()}
    masters = {n: s["param"] for n, s in read_ranges(directory, manifest, whole, {n: ["param"] for n in whole}).items()}
    named = dict(model.named_parameters())

    def matches() -> bool:
        return all(torch.equal(p, masters[n].view(p.shape).to(p.dtype)) for n, p in named.items())

    before = matches()
    load_checkpoint(Path(root), fresh.optimizer)  # with overlap_param_gather too: no gather left in flight
    return {"names": sorted(named) == sorted(masters), "before": before, "after": matches()}


@pytest.mark.parametrize("name, dtype", [("zero1-adamw-bf16", torch.bfloat16), ("zero1-adamw-bf16", torch.float32),
                                         ("layerwise-muon", torch.float32), ("zero1-muon-bf16", torch.bfloat16)])
def test_load_without_model_gives_every_rank_the_masters(world2, tmp_path: Path, name: str,
                                                          dtype: torch.dtype) -> None:
    for out in world2.run(load_without_model, str(tmp_path), name, dtype):
        assert out == {"names": True, "before": False, "after": True}


def _everything(root: Path) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor],
                                     dict[str, dict[str, Any]]]:
    """(manifest, every parameter's whole element-wise state, the model tensors, every parameter's dtypes and
    scalars from its writers' parts) of a checkpoint root."""
    directory, manifest = read_manifest(root)
    full = {n: (0, torch.Size(p["shape"]).numel()) for n, p in manifest["params"].items()}
    saved = Saved(directory, manifest)
    return (manifest, read_ranges(directory, manifest, full), read_model(directory, manifest, list(manifest["model"])),
            {n: saved.state(n, *r) for n, r in full.items()})


def _assert_same_run(root: Path, got: str, want: str) -> None:
    m_got, state_got, model_got, saved_got = _everything(root / got)
    m_want, state_want, model_want, saved_want = _everything(root / want)
    assert m_got["scaler"] == m_want["scaler"] and m_got["scheduler"] == m_want["scheduler"]
    assert m_got["groups"] == m_want["groups"]  # settings, lr and weight decay included
    for name, entry in saved_want.items():
        assert saved_got[name]["scalars"] == entry["scalars"], name  # step counts
        assert saved_got[name]["dtypes"] == entry["dtypes"], name
        for key, want_tensor in state_want[name].items():
            torch.testing.assert_close(state_got[name][key], want_tensor, rtol=2e-5, atol=1e-6,
                                       msg=lambda m, n=name, k=key: f"{got} vs {want}: {n}.{k}: {m}")
    for key, want_tensor in model_want.items():  # bf16 weights: a master near a tie may round the other way
        torch.testing.assert_close(model_got[key].float(), want_tensor.float(), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("name", list(CASES))
def test_save_at_2_resume_at_3_and_1(world2, world3, tmp_path: Path, name: str) -> None:
    sharding = CASES[name]["sharding"]
    assert world2.run(run, str(tmp_path), name, sharding, None, "dp2") == [2, 2]
    assert world3.run(run, str(tmp_path), name, sharding, "dp2-K", "dp3") == [3, 3, 3]
    assert run(str(tmp_path), name, "replicated", "dp2-K", "dp1") == 1  # this process: no process group
    manifest = read_manifest(tmp_path / "dp2-K")[1]
    assert manifest["world_size"] == 2
    chunks = [p["chunks"] for p in manifest["params"].values()]
    assert {rank for c in chunks for rank, _, _ in c} == {0, 1}  # both ranks wrote their parts
    # ZeRO-1 ranges cut parameters, but not Muon's matrices (nor, here, the biases beside them)
    whole = get_algorithm(CASES[name]["algorithm"]).capabilities.whole_matrices
    assert any(len(c) == 2 for c in chunks) == (sharding == "zero1" and not whole)
    for got in ("dp3-end", "dp1-end"):
        _assert_same_run(tmp_path, got, "dp2-end")


def test_replicated_single_process_resumes_as_zero1_at_3(world3, tmp_path: Path) -> None:
    name = "zero1-adamw-bf16"
    run(str(tmp_path), name, "replicated", None, "dp1")
    world3.run(run, str(tmp_path), name, "zero1", "dp1-K", "dp3")
    _assert_same_run(tmp_path, "dp3-end", "dp1-end")


def exchanged(root: str, name: str) -> dict[str, Any]:
    """On every rank: save and load with the plan-derived manifest, and the state DCP saves; returns the
    largest object any gather sent (the ranks exchange fixed-size agreements, their files' checksums, their
    state's keys), and fails if the tables' path of the save ran."""
    from unittest import mock

    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from optstack.checkpoint import save as save_module
    from optstack.distributed.comm import Comm
    from optstack.stage import sharded

    case = CASES[name]
    model, wrapped, built = _stack(case, case["sharding"], seed=0)
    _train(wrapped, built, range(K))
    sizes: list[int] = []
    gather, build = Comm.all_gather_object, sharded._derived

    def counted(self: Comm, obj: Any) -> list[Any]:
        sizes.append(len(pickle.dumps(obj)))
        return gather(self, obj)

    with mock.patch.object(Comm, "all_gather_object", counted), \
            mock.patch.object(save_module, "plan_save", side_effect=AssertionError("the tables' path ran")):
        save_checkpoint(Path(root), built.optimizer, step=K, scheduler=built.scheduler, model=model)
        load_checkpoint(Path(root), built.optimizer, scheduler=built.scheduler, model=model)
        derived: list[bool] = []

        def recorded(*args: Any) -> Any:
            tables = build(*args)
            derived.append(tables is not None)
            return tables

        with mock.patch.object(sharded, "_derived", recorded):
            get_optimizer_state_dict(wrapped, built.optimizer)  # DCP's ShardedTensors, from the holdings
    return {"largest": max(sizes), "derived": bool(derived) and all(derived)}


@pytest.mark.parametrize("name", list(CASES))
def test_ranks_exchange_no_tables(world2, tmp_path: Path, name: str) -> None:
    # SOAP's state pages differ in keys from matrix to matrix (a side over max_precond_dim has no factor): DCP's
    # metadata, which needs one key set per stage, falls back to the tables; optstack's own save and load do not
    derived = CASES[name]["algorithm"] != "soap"
    for out in world2.run(exchanged, str(tmp_path), name):
        assert out == {"largest": out["largest"], "derived": derived}
        if derived:
            assert out["largest"] < 700, out  # a table of this model's parameters pickles to several KB


def one_rank_without_a_view(root: str) -> dict[str, Any]:
    """On every rank: rank 1 cannot compute the view (as for a stage whose placement cannot tell): every rank
    falls back to exchanging tables, together, and the checkpoint saves and loads as before."""
    from unittest import mock

    from optstack.checkpoint import load as load_module
    from optstack.checkpoint import save as save_module
    from optstack.checkpoint.state import plan_save

    case = CASES["zero1-adamw-bf16"]
    model, wrapped, built = _stack(case, case["sharding"], seed=0)
    _train(wrapped, built, range(K))
    rank = world_comm().rank
    planned: list[bool] = []
    with mock.patch.object(save_module, "view_of", (lambda *a: None) if rank == 1 else save_module.view_of), \
            mock.patch.object(load_module, "view_of", (lambda *a: None) if rank == 1 else load_module.view_of), \
            mock.patch.object(save_module, "plan_save", lambda *a: planned.append(True) or plan_save(*a)):
        save_checkpoint(Path(root), built.optimizer, step=K, scheduler=built.scheduler, model=model)
        model2, wrapped2, fresh = _stack(case, case["sharding"], seed=7)
        load_checkpoint(Path(root), fresh.optimizer, scheduler=fresh.scheduler, model=model2)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values(),
                                                  strict=True))
    return {"tables": planned == [True], "same": same}


def test_ranks_whose_views_differ_exchange_tables(world2, tmp_path: Path) -> None:
    assert world2.run(one_rank_without_a_view, str(tmp_path)) == [{"tables": True, "same": True}] * 2
