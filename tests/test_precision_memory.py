"""Precision-aware optimizer state (issue 13), single process: fp32 masters held as bf16 parameter + int16
remainder step bit for bit like whole fp32 masters; bf16 masters (stochastic rounding) and low-precision
moments; checkpoints across state precisions; ``offload_states`` / ``reload_states``; bad input.
(ZeRO-1 and layer-wise: ``tests/distributed/test_precision_memory.py``.)"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from optstack.algorithms._staging import round_stochastic_
from optstack.algorithms.adamw import AdamW
from optstack.checkpoint import load_checkpoint, save_checkpoint
from optstack.config import AdamConfig, MastersConfig, OffloadConfig, OptimizerConfig
from optstack.factory import BuiltOptimizer, build_optimizer
from optstack.megatron.config import OptimizerConfig as MegatronConfig
from optstack.megatron.config import to_core
from optstack.offload.states import scratch_of
from optstack.stage import Masters, Remainders, Stage
from optstack.stage.precision import join_remainder, round_bf16_ties_away, split_remainder

STEPS = 6


def _model(dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 5)).to(dtype)


def _build(model: nn.Module, *, precision: str = "bf16", **changes: Any) -> BuiltOptimizer:
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, precision=precision, clip_grad=1.0, **changes)
    return build_optimizer(config, model)


def _train(model: nn.Module, built: BuiltOptimizer, steps: range) -> list[float]:
    losses = []
    dtype = next(model.parameters()).dtype
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, 12, generator=gen), torch.randn(32, 5, generator=gen)
        loss = ((model(x.to(dtype)).float() - y) ** 2).mean()
        loss.backward()
        built.optimizer.step()
        built.optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _stage(built: BuiltOptimizer) -> Stage:
    [stage] = built.optimizer.stages
    return stage


def _device_storages(root: object, model: nn.Module, host: list[torch.Tensor] = ()) -> dict[int, int]:
    """Bytes by storage of every tensor reachable from ``root`` (attributes, containers, closures) that is
    neither the model's (parameters, their gradients) nor in ``host`` (memory meant to be host memory)."""
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *host]}
    skip |= {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    seen, found, todo = set(), {}, [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, type | type(torch) | nn.Module | str | bytes):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in skip and obj.device.type != "meta":
                found[id(storage) if storage.nbytes() == 0 else storage.data_ptr()] = storage.nbytes()
            continue
        if callable(obj) and hasattr(obj, "__code__"):  # a function: only its closure, not its module globals
            todo += [c.cell_contents for c in obj.__closure__ or ()]
            continue
        todo += gc.get_referents(obj)
    return found


def _live_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


# -- remainders ---------------------------------------------------------------------------------------
def test_split_and_join_are_exact_and_round_like_megatron() -> None:
    torch.manual_seed(0)
    master = torch.randn(100_000) * torch.logspace(-20, 20, 100_000)
    tie = torch.tensor([1.0, -3.0, 5.0]).view(torch.int32).add(0x8000).view(torch.float32)  # exact halfway
    master = torch.cat([master, tie, torch.tensor([0.0, -0.0, 3.4e38])])
    param, rem = torch.empty(master.shape, dtype=torch.bfloat16), torch.empty(master.shape, dtype=torch.int16)
    split_remainder(master.clone(), param, rem)  # the master is its scratch
    assert torch.equal(join_remainder(param, rem).view(torch.int32), master.view(torch.int32))
    nearest = master.to(torch.bfloat16)
    differ = (param.view(torch.int16) != nearest.view(torch.int16)).nonzero().flatten().tolist()
    # only exact ties differ from round-to-nearest-even: there the remainder's sign bit rounds away from zero
    ties = ((master.view(torch.int32) & 0xFFFF) == 0x8000).nonzero().flatten().tolist()
    assert set(differ) <= set(ties) and {100_000, 100_001} <= set(differ)
    assert param[100_000].item() > 1.0 and param[100_001].item() == -3.0 - 2**-6  # away from zero, not to even


def test_remainders_step_bit_for_bit_like_fp32_masters() -> None:
    runs = {}
    for remainders in (False, True):
        model = _model()
        built = _build(model, masters=MastersConfig(store_remainders=remainders))
        runs[remainders] = (_train(model, built, range(STEPS)), model, built)
    (loss_a, model_a, built_a), (loss_b, model_b, built_b) = runs[False], runs[True]
    a, b = _stage(built_a), _stage(built_b)
    assert b.kind == "whole+remainders" and a.kind == "whole+masters"
    assert loss_a == loss_b
    for x, y in zip(a.master_params, b.master_params, strict=True):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32))
    for x, y in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(x, y)
    # between steps the master costs 2 B per element: the int16 remainders; the fp32 workspace is freed
    numel = sum(p.numel() for p in model_b.parameters())
    assert _live_bytes(b.precision.held()) == 2 * numel
    assert _live_bytes(a.precision.held()) == 4 * numel
    # torch's state dict holds whole fp32 masters ("master"), equal to the fp32-master run's; it loads into a
    # fresh remainder stack exactly
    saved, reference = built_b.optimizer.state_dict(), built_a.optimizer.state_dict()
    assert all(torch.equal(saved["state"][i]["master"], reference["state"][i]["master"]) for i in reference["state"])
    fresh_model = _model(seed=1)
    fresh = _build(fresh_model, masters=MastersConfig(store_remainders=True))
    fresh.optimizer.load_state_dict(saved)
    for x, y in zip(b.master_params, _stage(fresh).master_params, strict=True):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32))
    assert all(torch.equal(x, y) for x, y in zip(model_b.parameters(), fresh_model.parameters(), strict=True))


def test_remainders_keep_fp32_params_whole_and_refuse_fp16() -> None:
    torch.manual_seed(0)
    low, high = torch.randn(6, 4).bfloat16(), torch.randn(5)  # an fp32 parameter beside a bf16 one: stepped as is
    stage = Stage([{"params": [low, high], "param_names": ["w", "norm"], "lr": 0.1}], lambda g: AdamW(g),
                  precision=Remainders())
    before = high.clone()
    low.grad, high.grad = torch.randn(6, 4).bfloat16(), torch.randn(5)
    stage.grad_stats(2.0)
    stage.step()
    [master] = stage.master_params
    assert master.shape == low.shape and not torch.equal(high, before) and stage.optimizer.state[high]
    fp16 = _model(torch.float16)
    with pytest.raises(ValueError, match=r"store_remainders.*'0.weight' is torch.float16"):
        Stage([{"params": list(fp16.parameters()), "param_names": ["0.weight", "0.bias", "2.weight", "2.bias"]}],
              lambda g: AdamW(g), precision=Remainders())


def test_a_skipped_step_leaves_remainders_untouched() -> None:
    model = _model()
    built = _build(model, masters=MastersConfig(store_remainders=True))
    _train(model, built, range(2))
    before = [p.clone() for p in model.parameters()], [r.clone() for r in _stage(built).precision.held()]
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    built.optimizer.step()
    assert not built.optimizer.last_result.applied
    built.optimizer.zero_grad()
    after = list(model.parameters()), _stage(built).precision.held()
    assert all(torch.equal(x, y) for x, y in zip(before[0] + before[1], after[0] + after[1], strict=True))


# -- bf16 masters, low-precision moments --------------------------------------------------------------
def test_stochastic_rounding_is_unbiased_and_bf16_masters_step_the_params() -> None:
    torch.manual_seed(0)
    value = torch.full((200_000,), 1.0 + 2**-9)  # a quarter of a bf16 ulp (2**-7) above 1
    out = torch.empty(value.shape, dtype=torch.bfloat16)
    round_stochastic_(out, value.clone())
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(out.float().mean().item() - (1.0 + 2**-9)) < 2e-5  # nearest rounding would give exactly 1.0

    model = _model()
    built = _build(model, masters=MastersConfig(dtype="bf16", stochastic_rounding=True),
                   adam=AdamConfig(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"))
    losses = _train(model, built, range(STEPS))
    stage = _stage(built)
    assert stage.kind == "whole+direct" and stage.master_params == [] and losses[-1] < losses[0]
    assert stage.optimizer.stochastic_rounding
    assert {s["exp_avg"].dtype for s in stage.optimizer.state.values()} == {torch.bfloat16}


def test_bf16_grads_are_read_without_an_fp32_copy() -> None:
    model = _model()
    built = _build(model, masters=MastersConfig(grad_dtype="bf16", store_remainders=True))
    reference_model = _model()
    reference = _build(reference_model, masters=MastersConfig(store_remainders=True))
    assert _train(model, built, range(3)) == _train(reference_model, reference, range(3))
    assert _stage(built).precision._copy_to == [] and len(_stage(reference).precision._copy_to) == 4


# -- checkpoints across precisions ----------------------------------------------------------------------
@pytest.mark.parametrize("saved, loaded", [("remainders", "masters"), ("masters", "remainders"),
                                           ("bf16_moments", "masters"), ("masters", "fp16_moments")])
def test_checkpoints_load_across_state_precisions(tmp_path: Path, saved: str, loaded: str) -> None:
    settings = {"remainders": {"masters": MastersConfig(store_remainders=True)}, "masters": {},
                "bf16_moments": {"adam": AdamConfig(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")},
                "fp16_moments": {"adam": AdamConfig(exp_avg_dtype="fp16", exp_avg_sq_dtype="fp16")}}
    model = _model()
    built = _build(model, **settings[saved])
    _train(model, built, range(3))
    save_checkpoint(tmp_path, built.optimizer, step=3, model=model)
    saved_masters = [m.clone() for m in _stage(built).master_params]
    fresh_model = _model(seed=1)
    fresh = _build(fresh_model, **settings[loaded])
    load_checkpoint(tmp_path, fresh.optimizer, model=fresh_model)
    for x, y in zip(saved_masters, _stage(fresh).master_params, strict=True):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32))  # masters exact across precisions
    state = next(iter(_stage(fresh).optimizer.state.values()))
    assert state["exp_avg"].dtype == (torch.float16 if loaded == "fp16_moments" else torch.float32)
    if {saved, loaded} == {"masters", "remainders"}:  # and the next steps are the same too
        assert _train(fresh_model, fresh, range(3, 6)) == _train(model, built, range(3, 6))
    else:
        assert _train(fresh_model, fresh, range(3, 5))[-1] < 10


# -- offload_states / reload_states --------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["masters", "remainders", "fp32", "hybrid", "hybrid_remainders", "bf16_state"])
def test_offload_then_reload_gives_the_same_next_step(kind: str) -> None:
    settings: dict[str, Any] = {"masters": {}, "remainders": {"masters": MastersConfig(store_remainders=True)},
                                "fp32": {"precision": "fp32"},
                                "hybrid": {"offload": OffloadConfig(enabled=True, fraction=0.5)},
                                "hybrid_remainders": {"offload": OffloadConfig(enabled=True, fraction=0.8),
                                                      "masters": MastersConfig(store_remainders=True)},
                                # no masters, bf16 moments: AdamW's staging scratch is the only buffer besides
                                "bf16_state": {"masters": MastersConfig(dtype="bf16", stochastic_rounding=True),
                                               "adam": AdamConfig(exp_avg_dtype="bf16")}}[kind]
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    runs = []
    for offload in (False, True):
        model = _model(dtype)
        built = _build(model, **settings)
        _train(model, built, range(3))
        stage = _stage(built)
        if offload:
            state = {k: v for s in stage.optimizer.state.values() for k, v in s.items()}
            ids = [id(t) for s in stage.optimizer.state.values() for t in s.values()]
            moved = built.optimizer.offload_states()
            numel = sum(p.numel() for p in model.parameters())
            assert moved >= (6 if kind == "bf16_state" else 8) * numel  # at least both moments
            assert state["exp_avg"].untyped_storage().nbytes() == 0  # the memory is really given up
            assert all(t.untyped_storage().nbytes() == 0 for t in stage.precision.held())
            assert built.optimizer.offload_states() == moved  # twice is once
            # nothing the optimizer holds keeps device memory: masters, moments, gradient copies, scratch
            host = [h for s in built.optimizer.stages for _, h in s._host._moved]  # the copies themselves
            host += stage.optimizer.host_tensors if kind.startswith("hybrid") else []
            host += [g for t in host if (g := t.grad) is not None] + [c.grads[0] for c in getattr(
                stage.optimizer, "_chunks", [])]
            held = _device_storages(built.optimizer, model, host)
            assert len(held) >= 3 and sum(held.values()) == 0, held
            if kind not in ("fp32", "bf16_state"):
                assert stage.precision.scratch()  # the fp32 gradient copies were there, and are freed
            if kind == "bf16_state":
                assert scratch_of(stage.optimizer)  # AdamW's staging scratch was there, and is freed
            built.optimizer.reload_states()
            assert ids == [id(t) for s in stage.optimizer.state.values() for t in s.values()]  # same objects
        runs.append((_train(model, built, range(3, 5)), [p.clone() for p in model.parameters()],
                     [m.clone() for m in stage.master_params]))
    (loss_a, params_a, masters_a), (loss_b, params_b, masters_b) = runs
    assert loss_a == loss_b
    assert all(torch.equal(x, y) for x, y in zip(params_a + masters_a, params_b + masters_b, strict=True))


def test_zero_grad_while_offloaded_leaves_the_freed_gradient_copies_alone() -> None:
    runs = []
    for offload in (False, True):
        model = _model()
        built = _build(model)
        x = torch.randn(8, 12, generator=torch.Generator().manual_seed(0)).bfloat16()
        model(x).float().square().mean().backward()
        built.optimizer.step()  # the masters' .grad are the fp32 gradient copies now
        if offload:
            built.optimizer.offload_states()
        built.optimizer.zero_grad(set_to_none=False)  # zeroing a freed copy would fail: it comes back zeroed
        built.optimizer.reload_states()
        assert all(m.grad is None or not m.grad.any() for m in _stage(built).master_params)
        runs.append(_train(model, built, range(2)))
    assert runs[0] == runs[1]


def test_reading_state_while_offloaded_reloads_it_first() -> None:
    model = _model()
    built = _build(model, masters=MastersConfig(store_remainders=True))
    _train(model, built, range(2))
    expected = {k: v.clone() for k, v in built.optimizer.state_dict()["state"][0].items()}
    built.optimizer.offload_states()
    got = built.optimizer.state_dict()["state"][0]  # reloads: reading an emptied storage would crash
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


# -- bad input ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, match", [
    ({"precision": "fp32", "masters": MastersConfig(store_remainders=True)},
     r"masters.store_remainders=True needs precision='bf16', got precision='fp32'"),
    ({"precision": "fp16", "masters": MastersConfig(dtype="bf16")}, r"masters.dtype='bf16' needs precision='bf16'"),
    ({"algorithm": "sgd", "precision": "bf16", "masters": MastersConfig(dtype="bf16", stochastic_rounding=True)},
     r"masters.stochastic_rounding needs an Adam-family algorithm"),
])
def test_combinations_that_cannot_be_honoured_are_named(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OptimizerConfig(**changes)


@pytest.mark.parametrize("fields, match", [
    ({"store_remainders": True, "dtype": "bf16"}, r"masters.store_remainders=True needs masters.dtype='fp32'"),
    ({"stochastic_rounding": True}, r"masters.stochastic_rounding=True needs masters.dtype='bf16'"),
    ({"dtype": "fp8"}, r"masters.dtype must be one of"),
    ({"store_remainders": 1}, r"masters.store_remainders must be a bool"),
])
def test_masters_config_checks_its_fields(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MastersConfig(**fields)


def test_masters_is_a_stage_precision_for_every_combination() -> None:
    assert Masters().kind == "masters" and Remainders().kind == "remainders"


# -- the Megatron face ---------------------------------------------------------------------------------
def test_megatron_precision_aware_fields_translate() -> None:
    base = {"lr": 1e-3, "bf16": True, "params_dtype": torch.bfloat16}
    core = to_core(MegatronConfig(**base, use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16,
                                  exp_avg_sq_dtype=torch.bfloat16))
    assert core.masters == MastersConfig(store_remainders=True)  # Megatron's default store_param_remainders=True
    assert core.adam.exp_avg_dtype == "bf16"
    core = to_core(MegatronConfig(**base, use_precision_aware_optimizer=True, main_params_dtype=torch.bfloat16,
                                  main_grads_dtype=torch.bfloat16))
    assert core.masters == MastersConfig(dtype="bf16", grad_dtype="bf16")
    assert to_core(MegatronConfig(**base)).masters == MastersConfig()  # not precision-aware: whole fp32 masters
    assert to_core(MegatronConfig(lr=1e-3, use_precision_aware_optimizer=True)).masters == MastersConfig()
    with pytest.raises(ValueError, match=r"main_params_dtype=torch.bfloat16 needs use_precision_aware_optimizer"):
        MegatronConfig(**base, main_params_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"main_params_dtype"):
        MegatronConfig(**base, use_precision_aware_optimizer=True, main_params_dtype=torch.int8)


def test_offloaded_elements_keep_their_masters_in_host_memory() -> None:
    model = _model()
    built = _build(model, offload=OffloadConfig(enabled=True, fraction=0.8))  # the first weight: 288 of 437
    reference_model = _model()
    reference = _build(reference_model)
    assert _train(model, built, range(3)) == _train(reference_model, reference, range(3))
    stage = _stage(built)
    hybrid = stage.optimizer
    offloaded = {id(t) for t in hybrid.offloaded}
    masters = stage.master_params
    assert 0 < len(offloaded) < len(masters)
    # the offloaded masters are an allocation of their own in host memory: the device flats hold only the rest
    host = {m.untyped_storage().data_ptr() for m in masters if id(m) in offloaded}
    device = {m.untyped_storage().data_ptr(): m.untyped_storage().nbytes() for m in masters if id(m) not in offloaded}
    assert len(host) == 1 and host.isdisjoint(device)
    assert all(m.device.type == "cpu" for m in masters if id(m) in offloaded)
    assert sum(device.values()) == sum(m.numel() * 4 for m in masters if id(m) not in offloaded)


def test_add_param_group_under_remainders_steps_like_masters() -> None:
    results = []
    for precision in (Masters(), Remainders()):
        torch.manual_seed(0)
        first, second = torch.randn(8, 3).bfloat16(), torch.randn(5).bfloat16()
        stage = Stage([{"params": [first], "lr": 0.1}], lambda g: AdamW(g), precision=precision)
        gen = torch.Generator().manual_seed(0)
        for step in range(3):
            if step == 1:
                stage.add_param_group({"params": [second], "lr": 0.05})
            for p in (first, second):
                p.grad = torch.randn(p.shape, generator=gen).bfloat16()
            stage.grad_stats(2.0)
            stage.step()
            stage.zero_grad()
        results.append([t.view(torch.int32) for t in stage.master_params] + [first, second])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_masters_round_bf16_ties_as_remainders_do_so_the_runs_are_bitwise_equal() -> None:
    gen = torch.Generator().manual_seed(3)
    master = torch.randn(4096, generator=gen) * 10.0 ** torch.randint(-6, 6, (4096,), generator=gen)
    bits = master.view(torch.int32)
    bits[::7] = (bits[::7] & ~0xFFFF) | 0x8000  # exact ties, both signs, odd and even high halves
    ours = torch.empty(4096, dtype=torch.bfloat16)
    round_bf16_ties_away(master, ours)
    param, rem = torch.empty(4096, dtype=torch.bfloat16), torch.empty(4096, dtype=torch.int16)
    split_remainder(master.clone(), param, rem)
    assert torch.equal(ours.view(torch.int16), param.view(torch.int16))
    tie = (bits & 0xFFFF) == 0x8000
    assert torch.equal(ours[~tie], master[~tie].to(torch.bfloat16))
    assert not torch.equal(ours[tie], master[tie].to(torch.bfloat16))  # torch rounds half of them to even
    strided = torch.zeros(4096, 2, dtype=torch.bfloat16)[:, 0]
    round_bf16_ties_away(master, strided)
    assert torch.equal(strided, ours)

    def run(remainders: bool) -> nn.Module:  # a million elements: about 45 ties a step
        torch.manual_seed(0)
        model = nn.Linear(1000, 1000, bias=False).to(torch.bfloat16)
        built = build_optimizer(OptimizerConfig(lr=1e-3, weight_decay=0.1, precision="bf16", clip_grad=0.0,
                                                masters=MastersConfig(store_remainders=remainders)), model)
        grads = torch.Generator().manual_seed(1)
        for _ in range(3):
            model.weight.grad = torch.randn(1000, 1000, generator=grads).to(torch.bfloat16)
            built.optimizer.step()
        return model

    assert torch.equal(run(True).weight, run(False).weight)
