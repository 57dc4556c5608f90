"""CPU offload (optstack.offload): the hybrid host/device optimizer equals the plain one, in one process.

On this CPU-only machine the "device" is the CPU: the host copies are still separate tensors, so the split,
the transfers, the hyperparameter sync and the state mapping all run; only the CUDA streams do not.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from optstack.algorithms import SGD, AdamW
from optstack.config import AdamConfig, DistributedConfig, LossScaleConfig, OffloadConfig, OptimizerConfig
from optstack.factory import build_optimizer
from optstack.offload import HybridDeviceOptimizer, offloaded, plan_offload
from optstack.offload.states import HostCopy, scratch_of
from optstack.protocol import algorithm_name
from optstack.schedule import LRSchedule, WDSchedule
from optstack.stage import replicated_stage

# the replicated stage with and without fp32 masters (the names of optstack 0.1)
FP32Stage = functools.partial(replicated_stage, masters=False)
MixedPrecisionStage = replicated_stage

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.LayerNorm(12), nn.Linear(12, 3)).to(dtype)


def _batches(n: int, dtype: torch.dtype, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 6, generator=g).to(dtype) for _ in range(n)]


def _config(algorithm: str, precision: str, offload: OffloadConfig | None, **extra) -> OptimizerConfig:
    return OptimizerConfig(algorithm=algorithm, lr=1e-2, min_lr=1e-3, precision=precision,
                           offload=offload or OffloadConfig(), **extra)


def _build(cfg: OptimizerConfig, model: nn.Module):
    # Warmup from 0, then cosine decay; weight decay ramps up: lr and wd change on every step.
    return build_optimizer(
        cfg, model,
        lr_schedule=LRSchedule(init_lr=0.0, max_lr=1e-2, min_lr=1e-3, warmup_steps=2, decay_steps=8,
                               style="cosine"),
        wd_schedule=WDSchedule(start_wd=0.0, end_wd=0.1, incr_steps=6, style="linear"))


def _train(model: nn.Module, built, batches: list[torch.Tensor]) -> None:
    for x in batches:
        built.optimizer.zero_grad()
        model(x).float().pow(2).mean().backward()
        built.optimizer.step()
        assert built.optimizer.last_result.applied
        built.scheduler.step()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def _masters(built) -> torch.Tensor:
    """Every stepped fp32 value (masters, or fp32 parameters), by parameter name."""
    shards = {n: s for stage in built.optimizer.stages for n, s in stage.param_shards().items()}
    return torch.cat([shards[n].tensors["param"].flatten() for n in sorted(shards)])


def assert_round_off(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    """Equal to round-off. Not bitwise in general: the host copies lie back to back, so torch's fused CPU
    kernels step them as one flat tensor, and a tensor's tail elements then take the vectorized path instead
    of the scalar one (a last-bit difference)."""
    rtol, atol = (1e-6, 1e-7) if dtype == torch.float32 else (2.0**-7, 1e-6)  # bf16: one rounding apart
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def _run(algorithm: str, precision: str, offload: OffloadConfig | None, steps: int = 5
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(model parameters, fp32 masters) after ``steps`` steps."""
    model = _model(PRECISIONS[precision])
    built = _build(_config(algorithm, precision, offload), model)
    _train(model, built, _batches(steps, PRECISIONS[precision]))
    return _flat(model), _masters(built)


# -- the plan ------------------------------------------------------------------------------------------
def test_plan_takes_the_longest_prefix_within_the_fraction() -> None:
    numels = [40, 10, 30, 20]
    assert [plan_offload(numels, f) for f in (0.0, 0.39, 0.4, 0.5, 0.79, 0.8, 1.0)] == [0, 0, 1, 2, 2, 3, 4]
    assert plan_offload([], 1.0) == 0
    for bad in (-0.1, 1.5, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match=r"fraction must be a number in \[0, 1\]"):
            plan_offload(numels, bad)  # type: ignore[arg-type]


# -- equality with the plain optimizer -----------------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("algorithm", ["adamw", "sgd"])
def test_offloaded_run_equals_plain_run(algorithm: str, precision: str) -> None:
    want, want_masters = _run(algorithm, precision, None)
    assert not torch.equal(want, _flat(_model(PRECISIONS[precision]))), "the run must move the parameters"
    for fraction in (0.0, 0.5, 1.0):
        got, got_masters = _run(algorithm, precision,
                                OffloadConfig(enabled=True, fraction=fraction, overlap_transfers=True))
        assert_round_off(got_masters, want_masters)
        assert_round_off(got, want, PRECISIONS[precision])


def test_fp16_loss_scaling_and_a_skipped_step_match_plain() -> None:
    def run(offload: OffloadConfig | None) -> tuple[torch.Tensor, list[bool]]:
        model = _model(torch.float16)
        built = _build(_config("adamw", "fp16", offload,
                               loss_scale=LossScaleConfig(mode="dynamic", initial=256.0)), model)
        applied = []
        for i, x in enumerate(_batches(4, torch.float16)):
            built.optimizer.zero_grad()
            loss = model(x).float().pow(2).mean() * (float("inf") if i == 1 else 1.0)
            built.optimizer.scale_loss(loss).backward()
            built.optimizer.step()
            applied.append(built.optimizer.last_result.applied)
            built.scheduler.step()
        return _flat(model), applied

    want, want_applied = run(None)
    got, got_applied = run(OffloadConfig(enabled=True, fraction=0.5))
    assert want_applied == got_applied == [True, False, True, True]
    assert_round_off(got, want, torch.bfloat16)  # fp16 params: about as far apart as bf16 ones at worst


def test_low_precision_adam_state_offloads_too() -> None:
    def run(offload: OffloadConfig | None) -> torch.Tensor:
        model = _model(torch.bfloat16)
        cfg = _config("adamw", "bf16", offload, adam=AdamConfig(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"))
        built = _build(cfg, model)
        _train(model, built, _batches(4, torch.bfloat16))
        return _flat(model)

    assert_round_off(run(OffloadConfig(enabled=True, fraction=1.0)), run(None), torch.bfloat16)


# -- the hybrid itself ---------------------------------------------------------------------------------
def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for shape in ((5, 4), (7,), (3, 3), (11,), (2, 6))]


def _groups(params: list[torch.Tensor]) -> list[dict]:
    return [{"params": params[:3], "param_names": ["a", "b", "c"], "lr": 0.1, "max_lr": 0.1},
            {"params": params[3:], "param_names": ["d", "e"], "weight_decay": 0.0, "max_lr": 0.2}]


def _grads(params: list[torch.Tensor], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


@pytest.mark.parametrize("make", [lambda gs: AdamW(gs, lr=0.01, weight_decay=0.1),
                                  lambda gs: SGD(gs, lr=0.01, momentum=0.9, weight_decay=0.1)],
                         ids=["adamw", "sgd"])
def test_hybrid_in_chunks_equals_plain_with_changing_hyperparameters(make) -> None:
    plain_params, hybrid_params = _params(), _params()
    plain = make(_groups(plain_params))
    hybrid = HybridDeviceOptimizer(make(_groups(hybrid_params)), make, fraction=0.8, overlap_transfers=True,
                                   chunk_numel=15)
    assert len(hybrid.sub_optimizers) == 4  # the device part and three host chunks: [20], [7, 9], [11]
    assert [t.shape for t in hybrid.offloaded] == [(5, 4), (7,), (3, 3), (11,)]
    for step in range(4):
        for opt, params in ((plain, plain_params), (hybrid, hybrid_params)):
            opt.param_groups[0]["lr"] = 0.1 / (step + 1)  # what a scheduler does, every step
            opt.param_groups[1]["weight_decay"] = 0.05 * step
            _grads(params, step)
            opt.step()
    for got, want in zip(hybrid_params, plain_params, strict=True):
        assert_round_off(got, want)
    for sub in hybrid.sub_optimizers:  # every part saw the last settings
        assert [g["lr"] for g in sub.param_groups] == [0.1 / 4, hybrid.param_groups[1]["lr"]]
        assert sub.param_groups[1]["weight_decay"] == hybrid.param_groups[1]["weight_decay"] == 0.05 * 3


def test_host_copies_are_separate_tensors_holding_the_state() -> None:
    params = _params()
    hybrid = HybridDeviceOptimizer(AdamW(_groups(params)), AdamW, fraction=0.5)
    _grads(params, 0)
    hybrid.step()
    assert len(hybrid.offloaded) == 2 and hybrid.offloaded[0] is params[0]
    for device, host in zip(hybrid.offloaded, hybrid.host_tensors, strict=True):
        assert host.data_ptr() != device.data_ptr() and torch.equal(host, device)
        state = hybrid.state[device]
        assert state["exp_avg"].data_ptr() != device.data_ptr()
        assert state is hybrid.sub_optimizers[1].state[host]  # the host optimizer's state, seen by device tensor
    assert len(hybrid.state) == len(params) and list(hybrid.state) == params
    assert hybrid.state.get(torch.zeros(1)) is None


def test_host_copy_moves_state_and_frees_scratch() -> None:
    state, scratch = torch.arange(6.0), torch.full((4,), 7.0)
    view, both = state[2:], torch.ones(3)
    copy = HostCopy([state, view, both], torch.device("cpu"), scratch=[scratch, both])
    assert copy.nbytes == 6 * 4 + 3 * 4 and copy.freed_nbytes == 4 * 4  # a view moves with its storage once
    assert all(t.untyped_storage().nbytes() == 0 for t in (state, view, both, scratch))
    copy.reload()
    assert torch.equal(view, torch.arange(2.0, 6.0)) and torch.equal(both, torch.ones(3))  # moved: the values
    assert torch.equal(scratch, torch.zeros(4))  # freed: regrown zero-filled, as allocated


def test_hybrid_names_its_sub_optimizers_scratch() -> None:
    params = [p.bfloat16() for p in _params()]
    hybrid = HybridDeviceOptimizer(AdamW(_groups(params)), AdamW, fraction=0.5)
    for p in params:
        p.grad = torch.ones_like(p)
    hybrid.step()
    assert len(scratch_of(hybrid)) == 2  # the device and the host AdamW each stage bf16 through fp32 scratch
    assert scratch_of(torch.optim.SGD(params, lr=0.1)) == []  # torch's optimizers keep none


def test_parameters_without_gradients_are_skipped_and_kept() -> None:
    plain_params, hybrid_params = _params(), _params()
    plain = AdamW(_groups(plain_params))
    hybrid = HybridDeviceOptimizer(AdamW(_groups(hybrid_params)), AdamW, fraction=1.0)
    for step in range(3):
        for opt, params in ((plain, plain_params), (hybrid, hybrid_params)):
            _grads(params, step)
            params[step].grad = None
            opt.step()
    for got, want in zip(hybrid_params, plain_params, strict=True):
        assert_round_off(got, want)


def _step_with_unit_grad_on_first(hybrid: HybridDeviceOptimizer, params: list[torch.Tensor]) -> None:
    for p in params:
        p.grad = torch.zeros_like(p)
    params[0].grad.fill_(1.0)
    hybrid.step()


def test_writes_to_device_tensors_reach_their_host_copies() -> None:
    params = _params()
    make = lambda gs: SGD(gs, lr=0.5, momentum=0.0)  # noqa: E731  (group 0 says lr=0.1)
    hybrid = HybridDeviceOptimizer(make(_groups(params)), make, fraction=1.0)
    _step_with_unit_grad_on_first(hybrid, params)
    with torch.no_grad():
        params[0].fill_(3.0)  # a visible write (version counter), e.g. a stage loading its masters
    _step_with_unit_grad_on_first(hybrid, params)
    assert torch.equal(params[0], torch.full_like(params[0], 3.0 - 0.1))
    # A write the version counter does not see (through an alias: here .data; under ZeRO-1 a DDP-held fp32
    # parameter loaded by model.load_state_dict) is read on the first step after an optimizer load.
    params[0].data.fill_(5.0)
    hybrid.load_state_dict(hybrid.state_dict())
    _step_with_unit_grad_on_first(hybrid, params)
    assert torch.equal(params[0], torch.full_like(params[0], 5.0 - 0.1))


def test_state_dict_has_the_plain_form_and_loads_both_ways() -> None:
    plain_params, hybrid_params = _params(), _params()
    plain = AdamW(_groups(plain_params))
    hybrid = HybridDeviceOptimizer(AdamW(_groups(hybrid_params)), AdamW, fraction=0.6, chunk_numel=8)
    assert algorithm_name(hybrid) == "AdamW" == algorithm_name(plain)  # what checkpoints identify it by
    for step in range(2):
        for opt, params in ((plain, plain_params), (hybrid, hybrid_params)):
            _grads(params, step)
            opt.step()
    ours, theirs = hybrid.state_dict(), plain.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for index, entry in theirs["state"].items():
        assert ours["state"][index].keys() == entry.keys()
        for key, value in entry.items():
            assert_round_off(ours["state"][index][key], value)
    # plain -> fresh hybrid and hybrid -> fresh plain, then one more step each: all equal
    into_hybrid = HybridDeviceOptimizer(AdamW(_groups(q := _params())), AdamW, fraction=0.3)
    into_hybrid.load_state_dict(copy.deepcopy(theirs))
    into_plain = AdamW(_groups(r := _params()))
    into_plain.load_state_dict(copy.deepcopy(ours))
    with torch.no_grad():
        for a, b, c in zip(q, r, plain_params, strict=True):
            a.copy_(c)
            b.copy_(c)
    for opt, params in ((plain, plain_params), (into_hybrid, q), (into_plain, r)):
        _grads(params, 5)
        opt.step()
    for a, b, c in zip(q, r, plain_params, strict=True):
        assert_round_off(a, c)
        assert_round_off(b, c)


def test_wrapping_an_optimizer_with_state_carries_it_over() -> None:
    plain_params, hybrid_params = _params(), _params()
    plain, started = AdamW(_groups(plain_params)), AdamW(_groups(hybrid_params))
    for opt, params in ((plain, plain_params), (started, hybrid_params)):
        _grads(params, 0)
        opt.step()
    hybrid = HybridDeviceOptimizer(started, AdamW, fraction=0.5)
    for opt, params in ((plain, plain_params), (hybrid, hybrid_params)):
        _grads(params, 1)
        opt.step()
    for got, want in zip(hybrid_params, plain_params, strict=True):
        assert_round_off(got, want)


def test_bad_arguments_are_refused() -> None:
    params = _params()
    with pytest.raises(ValueError, match="inner must be a torch.optim.Optimizer"):
        HybridDeviceOptimizer(params, AdamW, fraction=0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fraction"):
        offloaded(AdamW, fraction=2.0)
    with pytest.raises(ValueError, match="chunk_numel"):
        HybridDeviceOptimizer(AdamW(_groups(params)), AdamW, fraction=0.5, chunk_numel=0)
    with pytest.raises(ValueError, match="exactly the groups given"):
        HybridDeviceOptimizer(AdamW(_groups(params)), lambda gs: AdamW(gs[:1]), fraction=0.5)
    hybrid = HybridDeviceOptimizer(AdamW(_groups(params)), AdamW, fraction=0.5)
    with pytest.raises(ValueError, match="fixed at construction"):
        hybrid.add_param_group({"params": [torch.zeros(2)]})
    saved = hybrid.state_dict()
    saved["param_groups"][0]["params"] = saved["param_groups"][0]["params"][:2]
    with pytest.raises(ValueError, match=r"hold \[2, 2\] parameters, this optimizer's \[3, 2\]"):
        hybrid.load_state_dict(saved)


# -- inside the stages, and checkpoints across offload ---------------------------------------------------
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stage_checkpoints_move_between_offloaded_and_plain(precision: str) -> None:
    dtype = PRECISIONS[precision]
    batches = _batches(6, dtype)
    offload = OffloadConfig(enabled=True, fraction=0.5)

    def build(offloaded: bool):
        model = _model(dtype)
        return model, _build(_config("adamw", precision, offload if offloaded else None), model)

    reference_model, reference = build(False)
    _train(reference_model, reference, batches)
    for saved_offloaded in (True, False):
        first_model, first = build(saved_offloaded)
        _train(first_model, first, batches[:3])
        saved = copy.deepcopy((first_model.state_dict(), first.optimizer.state_dict(),
                               first.scheduler.state_dict()))
        second_model, second = build(not saved_offloaded)
        second_model.load_state_dict(saved[0])
        second.optimizer.load_state_dict(saved[1])
        second.scheduler.load_state_dict(saved[2])
        _train(second_model, second, batches[3:])
        assert_round_off(_flat(second_model), _flat(reference_model), dtype)


def test_name_keyed_shards_move_between_offloaded_and_plain() -> None:
    def stage(params: list[torch.Tensor], make) -> MixedPrecisionStage:
        return replicated_stage(_groups(params), make)

    plain_params = [p.to(torch.bfloat16) for p in _params()]
    hybrid_params = [p.to(torch.bfloat16) for p in _params()]
    plain = stage(plain_params, AdamW)
    hybrid = stage(hybrid_params, offloaded(AdamW, fraction=0.5))
    for s, params in ((plain, plain_params), (hybrid, hybrid_params)):
        _grads(params, 0)
        s.grad_stats(2.0)
        s.step()
    ours, theirs = hybrid.param_shards(), plain.param_shards()
    assert ours.keys() == theirs.keys()
    for name, shard in theirs.items():
        assert ours[name].algorithm == shard.algorithm == "AdamW"
        assert ours[name].tensors.keys() == shard.tensors.keys()
        for key, value in shard.tensors.items():
            assert_round_off(ours[name].tensors[key].float(), value.float())
    fresh_hybrid = stage([p.to(torch.bfloat16) for p in _params(7)], offloaded(AdamW, fraction=1.0))
    fresh_hybrid.load_param_shards(copy.deepcopy(theirs))
    fresh_plain = FP32Stage(_groups(_params(7)), AdamW)
    fresh_plain.load_param_shards(copy.deepcopy(ours))
    for name, shard in theirs.items():
        for s in (fresh_hybrid, fresh_plain):
            assert torch.equal(s.param_shards()[name].tensors["param"], shard.tensors["param"])


# -- bad configurations --------------------------------------------------------------------------------
def test_offload_config_is_validated() -> None:
    with pytest.raises(ValueError, match=r"offload.fraction must be in \[0, 1\]"):
        OffloadConfig(enabled=True, fraction=1.5)
    with pytest.raises(ValueError, match="offload.fraction must be a finite number"):
        OffloadConfig(enabled=True, fraction=float("nan"))
    with pytest.raises(ValueError, match="offload.enabled must be a bool"):
        OffloadConfig(enabled=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="offload.overlap_transfers must be a bool"):
        OffloadConfig(enabled=True, overlap_transfers="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("algorithm", ["lion", "muon", "torch.optim.RMSprop"])
def test_offload_needs_an_algorithm_with_a_host_kernel(algorithm: str) -> None:
    with pytest.raises(ValueError, match=r"offload.enabled=True needs an algorithm with a host kernel.*"
                                         r"offloadable algorithms: adam, adamw, sgd"):
        _config(algorithm, "fp32", OffloadConfig(enabled=True, fraction=0.5), clip_grad=0.0)  # refused when made


def test_offload_needs_a_host_kernel_for_every_algorithm_rules_route_to() -> None:
    from optstack.rules import Name, Rule

    cfg = _config("adamw", "fp32", OffloadConfig(enabled=True, fraction=0.5), clip_grad=0.0)
    with pytest.raises(ValueError, match=r"offload.enabled=True needs an algorithm with a host kernel, but 'lion'"):
        build_optimizer(cfg, _model(), rules=[Rule(Name("*"), algorithm="lion")])


def test_offload_with_layerwise_sharding_is_refused() -> None:
    with pytest.raises(ValueError, match="distributed.sharding='layerwise'"):
        _config("adamw", "fp32", OffloadConfig(enabled=True, fraction=0.5),
                distributed=DistributedConfig(sharding="layerwise"))


def test_name_keyed_checkpoint_files_move_between_offloaded_and_plain(tmp_path) -> None:
    from optstack.checkpoint import load_checkpoint, save_checkpoint

    batches = _batches(4, torch.bfloat16)
    reference_model = _model(torch.bfloat16)
    reference = _build(_config("adamw", "bf16", None), reference_model)
    _train(reference_model, reference, batches)
    offload = OffloadConfig(enabled=True, fraction=0.5)
    for saved, loaded in ((offload, None), (None, offload)):
        model = _model(torch.bfloat16)
        built = _build(_config("adamw", "bf16", saved), model)
        _train(model, built, batches[:2])
        path = tmp_path / f"saved_offloaded_{saved is not None}"
        save_checkpoint(path, built.optimizer, step=2, scheduler=built.scheduler, model=model)
        model = _model(torch.bfloat16)
        built = _build(_config("adamw", "bf16", loaded), model)
        load_checkpoint(path, built.optimizer, scheduler=built.scheduler, model=model)  # groups match by algorithm
        _train(model, built, batches[2:])
        assert_round_off(_flat(model), _flat(reference_model), torch.bfloat16)
