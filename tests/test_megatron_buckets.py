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
from optstack.megatron.bucket_groups import GradSyncError


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


def test_first_batch_only_records_then_registration_launches() -> None:
    # Megatron's first batch: registering every parameter starts nothing; finish_grad_sync starts and waits
    model = wrap(bucket_size=None)  # a bucket of 2 parameters per buffer
    groups = model.expert_parallel_bucket_groups + model.bucket_groups
    for group in groups:
        for param in group.params:
            group.register_grad_ready(param)
    assert not any(model.bucket_launched(i) for i in range(len(model.bucket_order)))
    for group in groups:
        group.finish_grad_sync()  # first batch: starts the reduction here instead of asserting
        group.reset()
    group = groups[0]
    param = next(iter(group.params))
    group.register_grad_ready(param)
    with pytest.raises(GradSyncError, match="1 of 2 parameters"):
        group.finish_grad_sync()


def test_partition_buckets_groups_a_wrappers_buckets() -> None:
    from optstack.megatron.bucket_groups import partition_buckets

    model = wrap()
    each = partition_buckets(model.buffers + model.expert_parallel_buffers)
    assert [g.params for g in each] == [g.params for g in model.expert_parallel_bucket_groups + model.bucket_groups]
    (single,) = partition_buckets(model.buffers + model.expert_parallel_buffers, force_single_bucket_group=True)
    assert single.params == set(model.module.parameters()) and len(single.buckets) == 4
    with pytest.raises(ValueError, match="one DistributedDataParallel's buffers"):
        partition_buckets(model.buffers + wrap().buffers)


def test_num_buckets_sizes_buckets_from_the_parameter_count() -> None:
    config = DistributedDataParallelConfig(overlap_grad_reduce=True, num_buckets=3)
    module = nn.Sequential(*[nn.Linear(10, 10, bias=False) for _ in range(6)])  # 600 elements -> 200 per bucket
    model = DistributedDataParallel(None, config, module, pg_collection=ParallelGroups.single())
    assert model.bucket_size == 200 and [b.numel_unpadded for b in model.buffers[0].buckets] == [200] * 3
    no_overlap = DistributedDataParallelConfig(num_buckets=3)  # Megatron: one bucket without overlap
    assert DistributedDataParallel(None, no_overlap, module, pg_collection=ParallelGroups.single()).bucket_size is None


def test_megatron_buffer_names_and_layout() -> None:
    from optstack.megatron import DistributedOptimizer

    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # 16-element weights: 64-aligned starts pad
    config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    layout = DistributedOptimizer.compute_full_param_layout(list(module.parameters()), None, 1, config)
    model = DistributedDataParallel(None, config, module, pg_collection=ParallelGroups.single(),
                                    full_param_layout=layout)
    (buffer,) = model.buffers
    (bucket,) = buffer.buckets
    assert bucket.params_list == [module[1].bias, module[1].weight, module[0].bias, module[0].weight]
    assert buffer.param_index_map[module[1].weight] == (64, 80, 0) and bucket.offset == 0
    for param, (start, end) in bucket.param_to_index.items():
        assert torch.equal(bucket.param_data[start:end], param.detach().flatten())
    ranges = DistributedOptimizer._build_model_gbuf_range(buffer, 0)["param_map"]
    assert sum(r["param"].size for r in ranges.values()) == sum(p.numel() for p in module.parameters())
    assert buffer.extra_main_grads == [] and bucket.params_with_extra_main_grads == []
    other = DistributedOptimizer.compute_full_param_layout(list(module.parameters()), None, 4, config)
    with pytest.raises(ValueError, match="full_param_layout for buffer .* differs"):
        DistributedDataParallel(None, config, nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)),
                                pg_collection=ParallelGroups.single(), full_param_layout=other)


@pytest.mark.parametrize("layer_wise", [False, True])
def test_pad_buckets_for_high_nccl_busbw_pads_to_lcm_with_2_to_16(layer_wise: bool) -> None:
    from optstack.megatron import DistributedOptimizer, LayerWiseDistributedOptimizer
    from optstack.megatron.layer_wise import tag_params_for_buffer_routing

    module = nn.Sequential(nn.Linear(40, 30), nn.Linear(30, 3))
    if layer_wise:
        tag_params_for_buffer_routing([module])
    compute = (LayerWiseDistributedOptimizer if layer_wise else DistributedOptimizer).compute_full_param_layout
    sizes = {}
    for busbw in (False, True):
        config = DistributedDataParallelConfig(use_distributed_optimizer=True, pad_buckets_for_high_nccl_busbw=busbw)
        layout = compute(list(module.parameters()), 1000, 1, config)
        model = DistributedDataParallel(None, config, module, pg_collection=ParallelGroups.single(),
                                        full_param_layout=layout)  # the wrapper builds the same layout
        sizes[busbw] = [b.grad_data.numel() for buffer in model.buffers for b in buffer.buckets]
        for param in module.parameters():
            del param.main_grad
    assert all(n % 2**16 == 0 for n in sizes[True]) and not any(n % 2**16 == 0 for n in sizes[False])
    assert len(sizes[True]) == len(sizes[False])  # the same buckets, padded further


def test_free_overlap_buffers_waits_and_clears() -> None:
    class Handle:
        waited = 0

        def wait(self) -> None:
            Handle.waited += 1

    model = wrap(overlap=True)
    group = model.bucket_groups[0]
    group.param_gather_handle = Handle()
    group.buckets[0].layerwise_gather_list = [torch.empty(2)]
    model.free_overlap_buffers()
    assert Handle.waited == 1 and group.param_gather_handle is None
    assert group.buckets[0].layerwise_gather_list is None
    assert not group.param_gather_dispatched
    group.start_param_sync()
    assert group.param_gather_dispatched and group.intra_distributed_optimizer_instance_size == 1
