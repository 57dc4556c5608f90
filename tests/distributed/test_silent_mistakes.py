"""Mistakes that used to pass silently around the data-parallel wrapper (issue 15, item 5): a launched world
without ``init_process_group``, ``clip_grad_norm_`` on a wrapped model, a ``state_dict`` read right after an
overlapped step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optstack.config import DistributedConfig, OptimizerConfig
from optstack.factory import build_optimizer, wrap_data_parallel


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.ReLU(), nn.Linear(13, 5))


def test_a_launched_world_without_init_process_group_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = OptimizerConfig()
    with pytest.raises(RuntimeError, match=r"wrap_data_parallel: WORLD_SIZE=2 .*init_process_group"):
        wrap_data_parallel(config, _model())
    with pytest.raises(RuntimeError, match=r"build_optimizer: WORLD_SIZE=2 .*unset WORLD_SIZE"):
        build_optimizer(config, _model())
    monkeypatch.setenv("WORLD_SIZE", "1")
    build_optimizer(config, _model())


def test_clip_grad_norm_on_a_wrapped_model_sees_and_clips_the_reduced_gradients():
    config = OptimizerConfig(algorithm="sgd", lr=0.1, weight_decay=0.0)
    model = _model()
    ddp = wrap_data_parallel(config, model)
    opt = build_optimizer(config, ddp).optimizer
    x, y = torch.randn(8, 7), torch.randn(8, 5)
    nn.functional.mse_loss(ddp(x), y).backward()
    ddp.finish_grad_sync()
    expected = torch.cat([ddp.main_grad(p).flatten() for p in model.parameters()]).norm().item()
    assert expected > 0
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=expected / 2)
    assert norm.item() == pytest.approx(expected, rel=1e-5)
    clipped = torch.cat([ddp.main_grad(p).flatten() for p in model.parameters()]).norm().item()
    assert clipped == pytest.approx(expected / 2, rel=1e-4)  # the buffer the optimizer steps was clipped
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert opt.last_result.grad_norm == pytest.approx(expected / 2, rel=1e-4)
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.allclose(p, b - 0.1 * ddp.main_grad(p))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_backward_into_last_steps_reduced_gradients_is_an_error():
    config = OptimizerConfig()
    model = _model()
    ddp = wrap_data_parallel(config, model)
    x, y = torch.randn(8, 7), torch.randn(8, 5)
    nn.functional.mse_loss(ddp(x), y).backward()
    ddp.finish_grad_sync()
    with pytest.raises(RuntimeError, match=r"reduced gradient .*zero_grad"):
        nn.functional.mse_loss(model(x), y).backward()  # around the wrapper: p.grad would be added to in place
    ddp.zero_grad_buffer()
    nn.functional.mse_loss(ddp(x), y).backward()  # through the wrapper: p.grad is dropped first
    ddp.finish_grad_sync()


def _state_right_after_an_overlapped_step() -> list[list[float]]:
    import torch.distributed as dist

    config = OptimizerConfig(lr=0.1, distributed=DistributedConfig(sharding="zero1", overlap_param_gather=True,
                                                                    bucket_size=100))
    model = _model()
    ddp = wrap_data_parallel(config, model)
    opt = build_optimizer(config, ddp).optimizer
    g = torch.Generator().manual_seed(dist.get_rank())
    nn.functional.mse_loss(ddp(torch.randn(4, 7, generator=g)), torch.randn(4, 5, generator=g)).backward()
    opt.step()
    assert opt.last_result.applied
    # no finish_param_sync(): the gathers are in flight; state_dict must wait for them
    return [v.flatten().tolist() for v in model.state_dict().values()]


def test_state_dict_right_after_an_overlapped_step_is_the_same_on_every_rank(world2):
    rank0, rank1 = world2.run(_state_right_after_an_overlapped_step)
    assert rank0 == rank1
    assert rank0 != [v.flatten().tolist() for v in _model().state_dict().values()]  # the step changed them
