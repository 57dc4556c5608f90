"""Megatron's bucket boundaries (an option of the core's layout plan the face selects) and the wrapper's
Megatron surface, on one process."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from optstack.distributed.buffers import Bucketing, BufferLayout
from optstack.distributed.parallel import ParallelGroups
from optstack.megatron import DistributedDataParallel, DistributedDataParallelConfig
from optstack.megatron.ddp import GradSyncError


def megatron_gold(sizes: list[int], bucket_size: int | None, dp: int, distopt: bool, shared_last: bool
                  ) -> tuple[list[int], list[int]]:
    """Unpadded and padded bucket sizes as Megatron's unit test computes them (sizes in forward order)."""
    pad = (lambda n, d: math.ceil(n / d) * d) if distopt else (lambda n, d: n)
    unpadded, padded, current = [], [], 0
    rest = list(sizes)
    if shared_last and distopt:
        unpadded.append(rest[-1])
        padded.append(pad(rest[-1], math.lcm(dp, 128)))
        rest = rest[:-1]
    for size in reversed(rest):
        current = pad(current, 64) + size
        if bucket_size is not None and current >= bucket_size:
            unpadded.append(current)
            padded.append(pad(current, math.lcm(dp, 128)))
            current = 0
    if current:
        unpadded.append(current)
        padded.append(pad(current, math.lcm(dp, 128)))
    return unpadded, padded


@pytest.mark.parametrize("bucket_size", [None, 9000, 9025, 9050, 18050, 20000])
@pytest.mark.parametrize("distopt", [False, True])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("dp", [1, 3])
def test_megatron_rule_matches_megatrons_gold(bucket_size: int | None, distopt: bool, shared: bool, dp: int) -> None:
    sizes = [95 * 95, 95] * 5  # weights and biases, forward order
    names = [f"p{i}" for i in range(len(sizes))]
    rule = Bucketing(close="reach", pad="even" if distopt else "none", param_align=64 if distopt else 1,
                     alone=frozenset({names[-1]}) if shared and distopt else frozenset())
    layout = BufferLayout.plan(list(zip(reversed(names), [(s,) for s in reversed(sizes)], strict=True)),
                               dp_size=dp, bucket_size=bucket_size, bucketing=rule)
    unpadded, padded = megatron_gold(sizes, bucket_size, dp, distopt, shared)
    assert [b.numel_unpadded for b in layout.buckets] == unpadded
    assert [b.numel for b in layout.buckets] == padded
    if distopt:
        assert all(b.numel == b.shard_numel * dp for b in layout.buckets)


def test_core_default_closes_before_exceeding() -> None:
    params = [(f"p{i}", (95, 95)) for i in range(10)]
    fit = BufferLayout.plan(params, dp_size=1, bucket_size=18_050)
    reach = BufferLayout.plan(params, dp_size=1, bucket_size=18_050, bucketing=Bucketing(close="reach", pad="none",
                                                                                           param_align=1))
    assert len(fit.buckets) == 10  # 9025 + 64-aligned 9025 would exceed 18050
    assert [b.numel for b in reach.buckets] == [18_050] * 5
    with pytest.raises(ValueError, match="Bucketing.close"):
        Bucketing(close="never")  # type: ignore[arg-type]


class WithExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(6, 6)
        self.expert = nn.Linear(6, 6)
        for p in self.expert.parameters():
            p.allreduce = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.expert(torch.tanh(self.dense(x)))


def wrap(overlap: bool = True, distopt: bool = False, bucket_size: int | None = 5) -> DistributedDataParallel:
    config = DistributedDataParallelConfig(overlap_grad_reduce=overlap, use_distributed_optimizer=distopt,
                                           bucket_size=bucket_size)
    return DistributedDataParallel(None, config, WithExperts(), pg_collection=ParallelGroups.single())


def test_wrapper_surface() -> None:
    model = wrap()
    assert [len(b.params) for b in model.buffers] == [2]
    assert [len(b.params) for b in model.expert_parallel_buffers] == [2]
    assert len(model.bucket_groups) == 2 and len(model.expert_parallel_bucket_groups) == 2  # 6 >= 5: own buckets
    assert model.buffers[0].numel_unpadded == 42 == model.buffers[0].numel  # no padding without distopt
    assert list(model.buffers()) == []  # still nn.Module.buffers when called
    assert set(model.sharded_state_dict(prefix="m.")) == {f"m.{n}" for n in model.module.state_dict()}
    model(torch.ones(2, 6)).sum().backward()
    model.finish_grad_sync()
    before = model.main_grad(model.module.dense.weight).clone()
    model.scale_gradients(0.5)
    torch.testing.assert_close(model.main_grad(model.module.dense.weight), before * 0.5)
    model.zero_grad_buffer()
    assert torch.count_nonzero(model.main_grad(model.module.dense.weight)) == 0


def test_register_grad_ready_launches_the_bucket() -> None:
    model = wrap()
    groups = model.expert_parallel_bucket_groups + model.bucket_groups  # backward order: the launch order
    for group in groups:  # Megatron's first batch only records who registers; reset() ends it
        for param in group.params:
            group.register_grad_ready(param)
        group.reset()
    with pytest.raises(GradSyncError):
        groups[0].finish_grad_sync()  # nothing registered: Megatron asserts
    for param in groups[0].params:
        groups[0].register_grad_ready(param)
    groups[0].finish_grad_sync()
    with pytest.raises(GradSyncError):
        groups[1].finish_grad_sync()
    for group in groups[1:]:
        for param in group.params:
            model.register_grad_ready(param)
    for group in groups[1:]:
        group.finish_grad_sync()
    with pytest.raises(AssertionError):  # Megatron's callers catch AssertionError
        wrap(overlap=False).bucket_groups[0].register_grad_ready(model.module.dense.weight)
    with pytest.raises(ValueError, match="not in this bucket group"):
        model.bucket_groups[0].register_grad_ready(model.module.expert.weight)
