"""CPU offload inside the ZeRO-1 optimizer on 2 gloo ranks: each rank offloads a fraction of its own shard,
and the run equals the non-offloaded ZeRO-1 run; checkpoints move between offloaded and plain."""

from __future__ import annotations

import pytest

STEPS = 4


def _model(precision: str):
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.ReLU(), nn.Linear(13, 5))
    return model.to(torch.bfloat16 if precision == "bf16" else torch.float32)


def _batches(steps: int, world: int, rank: int, precision: str):
    import torch

    g = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    out = []
    for _ in range(steps):
        x, y = torch.randn(4 * world, 7, generator=g), torch.randn(4 * world, 5, generator=g)
        out.append((x.chunk(world)[rank].to(dtype), y.chunk(world)[rank]))
    return out


def _build(algorithm: str, precision: str, fraction: float | None):
    """A ZeRO-1 stack (small buckets, so rank ranges cut across parameters) with lr and wd changing every
    step; ``fraction=None``: no offload."""
    from optstack.config import DistributedConfig, OffloadConfig, OptimizerConfig
    from optstack.factory import build_optimizer, wrap_data_parallel
    from optstack.schedule import LRSchedule, WDSchedule

    offload = OffloadConfig() if fraction is None else OffloadConfig(enabled=True, fraction=fraction,
                                                                     overlap_transfers=fraction == 0.5)
    cfg = OptimizerConfig(algorithm=algorithm, lr=1e-2, min_lr=1e-3, precision=precision, offload=offload,
                          distributed=DistributedConfig(sharding="zero1", bucket_size=100))
    model = _model(precision)
    wrapped = wrap_data_parallel(cfg, model)
    built = build_optimizer(
        cfg, wrapped,
        lr_schedule=LRSchedule(init_lr=0.0, max_lr=1e-2, min_lr=1e-3, warmup_steps=1, decay_steps=STEPS,
                               style="cosine"),
        wd_schedule=WDSchedule(start_wd=0.0, end_wd=0.1, incr_steps=STEPS, style="linear"))
    return model, wrapped, built


def _train(model, wrapped, built, batches) -> None:
    import torch

    for x, y in batches:
        built.optimizer.zero_grad()
        torch.nn.functional.mse_loss(wrapped(x).float(), y).backward()
        built.optimizer.step()
        assert built.optimizer.last_result.applied
        built.scheduler.step()


def _values(model, built) -> tuple[list[float], list[float]]:
    """(the model's parameters, this rank's fp32 masters / fp32 pieces and optimizer state), flat."""
    import torch

    state = []
    for stage in built.optimizer.stages:
        for _, shard in sorted(stage.param_shards().items()):
            entry = {**shard.tensors, **shard.scalars}
            for key in sorted(entry):
                state.append(torch.as_tensor(entry[key]).detach().float().flatten())
    params = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    return params.tolist(), (torch.cat(state) if state else torch.zeros(0)).tolist()


def _runs(cases: list[tuple[str, str, float | None]]) -> list[tuple[list[float], list[float]]]:
    import torch.distributed as dist

    out = []
    for algorithm, precision, fraction in cases:
        model, wrapped, built = _build(algorithm, precision, fraction)
        _train(model, wrapped, built, _batches(STEPS, dist.get_world_size(), dist.get_rank(), precision))
        out.append(_values(model, built))
    return out


FRACTIONS = [None, 0.0, 0.5, 1.0]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero1_with_offload_equals_zero1_without(world2, precision: str) -> None:
    import torch

    cases = [(algorithm, precision, f) for algorithm in ("adamw", "sgd") for f in FRACTIONS]
    ranks = world2.run(_runs, cases)
    assert ranks[0][0][0] == ranks[1][0][0], "replicas diverged"
    tol = {"rtol": 1e-6, "atol": 1e-7}  # round-off: host copies are stepped as flat runs (see test_offload.py)
    bf16_tol = {"rtol": 2.0**-7, "atol": 1e-6} if precision == "bf16" else tol
    for rank, results in enumerate(ranks):
        by_case = dict(zip(cases, results, strict=True))
        for algorithm, _, fraction in cases:
            params, state = by_case[(algorithm, precision, fraction)]
            want_params, want_state = by_case[(algorithm, precision, None)]
            where = f"rank {rank} {algorithm} fraction {fraction}"
            torch.testing.assert_close(torch.tensor(state), torch.tensor(want_state), **tol, msg=where)
            torch.testing.assert_close(torch.tensor(params), torch.tensor(want_params), **bf16_tol, msg=where)


def _round_trip(precision: str) -> list[list[float]]:
    """Per direction (saved offloaded / saved plain): the parameters after training 2 steps, saving model,
    optimizer and scheduler, loading them into the other kind, and training 2 more; then an uninterrupted
    plain run."""
    import copy

    import torch.distributed as dist

    batches = _batches(STEPS, dist.get_world_size(), dist.get_rank(), precision)
    out = []
    for saved_fraction, loaded_fraction in ((0.5, None), (None, 1.0)):
        model, wrapped, built = _build("adamw", precision, saved_fraction)
        _train(model, wrapped, built, batches[:2])
        saved = copy.deepcopy((model.state_dict(), built.optimizer.state_dict(), built.scheduler.state_dict()))
        model, wrapped, built = _build("adamw", precision, loaded_fraction)
        model.load_state_dict(saved[0])
        built.optimizer.load_state_dict(saved[1])
        built.scheduler.load_state_dict(saved[2])
        _train(model, wrapped, built, batches[2:])
        out.append(_values(model, built)[0])
    model, wrapped, built = _build("adamw", precision, None)
    _train(model, wrapped, built, batches)
    out.append(_values(model, built)[0])
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero1_checkpoints_move_between_offloaded_and_plain(world2, precision: str) -> None:
    import torch

    tol = {"rtol": 2.0**-7, "atol": 1e-6} if precision == "bf16" else {"rtol": 1e-6, "atol": 1e-7}
    for rank, (offloaded_to_plain, plain_to_offloaded, uninterrupted) in enumerate(world2.run(_round_trip,
                                                                                              precision)):
        for got, direction in ((offloaded_to_plain, "offloaded -> plain"), (plain_to_offloaded,
                                                                             "plain -> offloaded")):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(uninterrupted), **tol,
                                       msg=f"rank {rank}, {direction}")
