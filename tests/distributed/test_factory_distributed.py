"""build_optimizer over a wrap_data_parallel model on real gloo ranks equals the single-process stack."""

from __future__ import annotations

import pytest


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.ReLU(), nn.Linear(13, 5))


def _data(steps: int, world: int):
    import torch

    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4 * world, 7, generator=g), torch.randn(4 * world, 5, generator=g)) for _ in range(steps)]


def _train(config_kwargs: dict, steps: int, distributed: bool) -> list[list[float]]:
    """Train ``steps`` steps; returns the flattened parameters after each step (rank-local view)."""
    import torch
    import torch.distributed as dist

    from optstack.config import DistributedConfig, OptimizerConfig
    from optstack.factory import build_optimizer, wrap_data_parallel

    _sections(config_kwargs)
    sharding = config_kwargs.pop("sharding", "replicated")
    overlap = config_kwargs.pop("overlap_param_gather", False)
    cfg = OptimizerConfig(
        **config_kwargs,
        distributed=DistributedConfig(sharding=sharding, overlap_param_gather=overlap, bucket_size=100),
    )
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    model = _model()
    wrapped = wrap_data_parallel(cfg, model) if distributed else model
    opt = build_optimizer(cfg, wrapped).optimizer
    history = []
    for x, y in _data(steps, world if distributed else int(config_kwargs.get("_world", 1))):
        if distributed:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        opt.zero_grad()
        torch.nn.functional.mse_loss(wrapped(x), y).backward()
        opt.step()
        result = opt.last_result  # finishes the gradient sync itself
        assert result.applied
        opt.finish_param_sync()  # with overlapped gathers the params are current only after this
        history.append(torch.cat([p.detach().flatten() for p in model.parameters()]).tolist())
    return history


def _reference(config_kwargs: dict, steps: int, world: int) -> list[list[float]]:
    import torch

    from optstack.config import OptimizerConfig
    from optstack.factory import build_optimizer

    config_kwargs = {k: v for k, v in config_kwargs.items() if k not in ("sharding", "overlap_param_gather")}
    _sections(config_kwargs)
    model = _model()
    opt = build_optimizer(OptimizerConfig(**config_kwargs), model).optimizer
    history = []
    for x, y in _data(steps, world):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        history.append(torch.cat([p.detach().flatten() for p in model.parameters()]).tolist())
    return history


def _sections(config_kwargs: dict) -> None:
    """A case's ``"soap": "field=value"`` as ``soap=SOAPConfig(...)`` (cases are plain data; ids print them)."""
    from optstack.config import SOAPConfig

    if "soap" in config_kwargs:
        field, _, value = config_kwargs["soap"].partition("=")
        config_kwargs["soap"] = SOAPConfig(**{field: int(value)}, precondition_frequency=2)


def _run_distributed(config_kwargs: dict, steps: int) -> list[list[float]]:
    return _train(dict(config_kwargs), steps, distributed=True)


CASES = [
    {"algorithm": "adamw", "lr": 1e-2, "sharding": "replicated"},
    {"algorithm": "adamw", "lr": 1e-2, "sharding": "zero1"},
    {"algorithm": "adamw", "lr": 1e-2, "sharding": "zero1", "overlap_param_gather": True},
    {"algorithm": "sgd", "lr": 1e-2, "sharding": "zero1"},
    {"algorithm": "muon", "lr": 1e-2, "sharding": "layerwise", "clip_grad": 0.0},
    # the adaptive Muons need whole matrices (their capabilities): owners under ZeRO-1, layer-wise
    *({"algorithm": name, "lr": 1e-2, "sharding": sharding, "clip_grad": 0.0}
      for name in ("normuon", "adamuon") for sharding in ("zero1", "layerwise")),
    # SOAP: whole matrices too; each factor of full rank (a rectangle's long side above max_precond_dim: a
    # rank-deficient factor's null space has no preferred basis, see algorithms/soap.py), refreshed twice
    *({"algorithm": "soap", "lr": 1e-2, "sharding": sharding, "clip_grad": 0.0, "soap": "max_precond_dim=7"}
      for sharding in ("zero1", "layerwise")),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['algorithm']}-{c['sharding']}"
                         + ("-overlap" if c.get("overlap_param_gather") else ""))
def test_factory_stack_matches_single_process(world2, case):
    import torch

    steps = 6
    ranks = world2.run(_run_distributed, case, steps)
    ref = _reference(dict(case), steps, world=2)
    assert ranks[0] == ranks[1], "replicas diverged"
    for step, (got, want) in enumerate(zip(ranks[0], ref, strict=True)):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6,
                                   msg=f"step {step}")


def test_zero1_without_wrapper_is_a_clear_error():
    from optstack.config import DistributedConfig, OptimizerConfig
    from optstack.factory import build_optimizer

    with pytest.raises(ValueError, match="wrap_data_parallel"):
        build_optimizer(OptimizerConfig(distributed=DistributedConfig(sharding="zero1")), _model())


def test_single_process_wrapper_works_without_a_process_group():
    import torch

    from optstack.config import DistributedConfig, OptimizerConfig
    from optstack.factory import build_optimizer, wrap_data_parallel

    cfg = OptimizerConfig(lr=1e-2, distributed=DistributedConfig(sharding="zero1"))
    model = wrap_data_parallel(cfg, _model())
    opt = build_optimizer(cfg, model).optimizer
    ref_model = _model()
    ref = build_optimizer(OptimizerConfig(lr=1e-2), ref_model).optimizer
    for x, y in _data(3, 1):
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
    for p, q in zip(model.module.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def _grad_norms(placements: list[tuple[str, str]], steps: int) -> dict[str, list[float]]:
    """Per (sharding, whole_matrices): the grad norm each step reports, for Muon over bias-free matrices."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from optstack.config import DistributedConfig, OptimizerConfig
    from optstack.factory import build_optimizer, wrap_data_parallel

    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for sharding, whole in placements:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(n, m, bias=False) for n, m in ((7, 13), (13, 11), (11, 9), (9, 8),
                                                                         (8, 6), (6, 5))))
        cfg = OptimizerConfig(algorithm="muon", lr=1e-2, clip_grad=0.5, distributed=DistributedConfig(
            sharding=sharding, whole_matrices=whole, bucket_size=100))
        wrapped = wrap_data_parallel(cfg, model)
        opt = build_optimizer(cfg, wrapped).optimizer
        norms = []
        for x, y in _data(steps, world):
            opt.zero_grad()
            torch.nn.functional.mse_loss(wrapped(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
            opt.step()
            norms.append(opt.last_result.grad_norm)
            opt.finish_param_sync()
        out[f"{sharding}/{whole}"] = norms
    return out


def test_the_grad_norm_is_bitwise_the_same_however_the_matrices_are_placed(world2):
    # each matrix's term is computed whole on one rank in every placement; the norm sums the terms in one
    # order on every rank, so the clip factor (and so the step) does not depend on the split
    placements = [("replicated", "auto"), ("zero1", "whole_shards"), ("zero1", "gather"), ("layerwise", "auto")]
    ranks = world2.run(_grad_norms, placements, 4)
    assert ranks[0] == ranks[1]
    (first, *others) = ranks[0].items()
    for name, norms in others:
        assert norms == first[1], f"{name} vs {first[0]}: {norms} != {first[1]}"
