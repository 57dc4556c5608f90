"""The face's layer-wise buffer layout (Megatron's current main): which parameters the layer-wise optimizer
manages, their tags, Megatron's ``param_layout`` names, and ``LayerWiseDistributedOptimizer.compute_full_param_layout``
(each managed matrix whole inside one rank's shard), on one process."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from optstack.megatron import DistributedDataParallelConfig, DistributedOptimizer, LayerWiseDistributedOptimizer
from optstack.megatron.layer_wise import is_managed_by_layer_wise_optimizer, tag_params_for_buffer_routing
from optstack.megatron.param_and_grad_buffer import (
    BufferKey,
    bucket_end_divisor,
    group_params_for_buffers,
    pad_bucket_end,
    pad_param_start,
    pad_to_divisor,
)


class Net(nn.Module):
    """Matrices of several sizes, biases, an embedding-like matrix and one excluded from Muon."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 12, bias=False)
        self.embed.weight.is_embedding_or_output_parameter = True
        self.a = nn.Linear(12, 40)
        self.b = nn.Linear(40, 24)
        self.c = nn.Linear(24, 8)
        self.c.weight.use_muon = False


def test_managed_are_muons_matrices_and_tags_follow() -> None:
    net = Net()
    assert [n for n, p in net.named_parameters() if is_managed_by_layer_wise_optimizer(p)] == ["a.weight", "b.weight"]
    frozen = nn.Parameter(torch.zeros(3, 3), requires_grad=False)
    net.frozen = frozen
    tag_params_for_buffer_routing([net])
    assert {n: p.is_managed_by_layer_wise_optimizer for n, p in net.named_parameters() if p.requires_grad} == {
        "embed.weight": False, "a.weight": True, "a.bias": False, "b.weight": True, "b.bias": False,
        "c.weight": False, "c.bias": False}
    assert not hasattr(frozen, "is_managed_by_layer_wise_optimizer")  # only trainable parameters are tagged


def test_megatron_padding_helpers() -> None:
    assert [pad_to_divisor(v, 64) for v in (0, 1, 64, 65)] == [0, 64, 64, 128]
    assert [pad_param_start(v) for v in (0, 1, 63, 64, 65)] == [0, 64, 64, 64, 128]
    assert bucket_end_divisor(4, False) == 128 and bucket_end_divisor(3, False) == 384
    assert bucket_end_divisor(4, True) == 2**16
    assert pad_bucket_end(1, 3, False) == 384 and pad_bucket_end(384, 3, False) == 384


def test_group_params_for_buffers_splits_by_dtype_expert_and_tag() -> None:
    dense, expert, fp32 = (nn.Parameter(torch.zeros(2, 2, dtype=torch.bfloat16)) for _ in range(3))
    managed = nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))
    expert.allreduce = False
    fp32.data = fp32.data.float()
    managed.is_managed_by_layer_wise_optimizer = True
    second = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    groups = group_params_for_buffers([dense, managed, expert, fp32, second], grad_reduce_in_fp32=True)
    bf16, f32 = torch.bfloat16, torch.float32
    assert list(groups) == [BufferKey(bf16, f32, False), BufferKey(bf16, f32, False, True),
                            BufferKey(bf16, f32, True), BufferKey(f32, f32, False)]
    assert groups[BufferKey(bf16, f32, False)] == ([dense, second], [0, 1])
    plain = group_params_for_buffers([dense], grad_reduce_in_fp32=False)
    assert plain == {BufferKey(bf16, bf16, False): ([dense], [0])}
    with pytest.raises(ValueError, match="does not require gradients"):
        group_params_for_buffers([nn.Parameter(torch.zeros(2), requires_grad=False)], False)


def _shard_of(layout, param) -> tuple[int, int]:
    """(shard of its start, shard of its last element), as Megatron's LayerWiseDistributedOptimizer reads them."""
    start, end, bucket = layout.param_index_map[param]
    lo, hi = layout.bucket_indices[bucket]
    shard = (hi - lo) // layout.num_optimizer_shards
    return (start - lo) // shard, (end - 1 - lo) // shard


@pytest.mark.parametrize("dp", [2, 3, 4])
@pytest.mark.parametrize("bucket_size", [None, 500])
def test_layer_wise_layout_keeps_each_managed_matrix_in_one_shard(dp: int, bucket_size: int | None) -> None:
    net = Net().bfloat16()
    tag_params_for_buffer_routing([net])
    config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    params = list(net.parameters())
    full = LayerWiseDistributedOptimizer.compute_full_param_layout(params, bucket_size, dp, config)
    bf16 = torch.bfloat16
    managed, rest = full.layouts[BufferKey(bf16, bf16, False, True)], full.layouts[BufferKey(bf16, bf16, False)]
    assert set(managed.param_index_map) == {net.a.weight, net.b.weight}
    owners = set()
    for param in managed.param_index_map:
        first, last = _shard_of(managed, param)
        assert first == last  # whole inside one shard
        owners.add(first)
    assert len(owners) == 2  # two matrices of similar size: one per rank
    for lo, hi in managed.bucket_indices:
        assert (hi - lo) % math.lcm(dp, 128) == 0 and (hi - lo) // dp % 64 == 0
    # the rest: the distributed optimizer's layout of those parameters (ranges cut across parameters)
    others = [p for p in params if not p.is_managed_by_layer_wise_optimizer]
    plain = DistributedOptimizer.compute_full_param_layout(others, bucket_size, dp, config)
    (only,) = plain.layouts.values()
    assert rest.param_index_map == only.param_index_map and rest.bucket_indices == only.bucket_indices
    # the distributed optimizer's keeps the tagged parameters apart too, laid out as the wrapper lays them out
    # (both are views of the wrapper's plan)
    distopt = DistributedOptimizer.compute_full_param_layout(params, bucket_size, dp, config)
    assert set(distopt.layouts) == set(full.layouts)
    assert distopt.layouts[BufferKey(bf16, bf16, False, True)].param_index_map == managed.param_index_map


def test_expert_layouts_are_split_over_the_expert_data_parallel_size() -> None:
    dense, expert = nn.Parameter(torch.zeros(1000)), nn.Parameter(torch.zeros(1000))
    expert.allreduce = False
    config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    full = DistributedOptimizer.compute_full_param_layout([dense, expert], None, 3, config, 256)
    f32 = torch.float32
    for key, divisor in ((BufferKey(f32, f32, False), math.lcm(3, 128)), (BufferKey(f32, f32, True), 256)):
        layout = full.layouts[key]
        assert layout.num_optimizer_shards == (256 if key.is_expert_parallel else 3)
        assert [end % divisor for _, end in layout.bucket_indices] == [0]


def test_wrap_model_chunks_with_ddp_lays_out_what_the_optimizer_needs() -> None:
    from optstack.distributed.parallel import ParallelGroups
    from optstack.megatron.training import wrap_model_chunks_with_ddp

    one = ParallelGroups.single()
    config = DistributedDataParallelConfig()
    (model,) = wrap_model_chunks_with_ddp([Net()], None, config, use_layer_wise_distributed_optimizer=True,
                                          pg_collection=one)
    assert config.use_distributed_optimizer  # Megatron's: set on the caller's config
    keys = set(model.full_param_layout.layouts)
    assert {k.is_managed_by_layer_wise_optimizer for k in keys} == {True, False}
    whole = [b for b in model.param_and_grad_buffers if b.key.whole]
    assert [set(b.params) for b in whole] == [{model.module.a.weight, model.module.b.weight}]
    # the distributed optimizer alone: its own layout, nothing tagged
    (plain,) = wrap_model_chunks_with_ddp([Net()], None, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                          pg_collection=one)
    assert plain.full_param_layout is not None and not any(b.key.whole for b in plain.param_and_grad_buffers)
    assert not hasattr(plain.module.a.weight, "is_managed_by_layer_wise_optimizer")
    # neither (or the layer-wise optimizer without its layout): no layout, the config untouched
    for layer_wise in (False, True):
        config = DistributedDataParallelConfig()
        (bare,) = wrap_model_chunks_with_ddp([Net()], None, config, use_layer_wise_distributed_optimizer=layer_wise,
                                             use_layer_wise_param_layout=False, pg_collection=one)
        assert bare.full_param_layout is None and not config.use_distributed_optimizer
    with pytest.raises(ValueError, match="bucket_sizes has 2 entries for 1 model chunks"):
        wrap_model_chunks_with_ddp([Net()], None, DistributedDataParallelConfig(), bucket_sizes=[None, None])


def test_the_wrapper_refuses_a_layout_computed_before_tagging() -> None:
    from optstack.distributed.parallel import ParallelGroups
    from optstack.megatron import DistributedDataParallel

    net = Net()
    config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    untagged = DistributedOptimizer.compute_full_param_layout(list(net.parameters()), None, 1, config)
    tag_params_for_buffer_routing([net])
    with pytest.raises(ValueError, match="full_param_layout must be a FullParamLayout with a layout per buffer"):
        DistributedDataParallel(None, config, net, pg_collection=ParallelGroups.single(), full_param_layout=untagged)


def test_muon_leaves_what_layer_wise_does_not_manage_to_its_scalar_optimizer() -> None:
    from optstack.megatron import OptimizerConfig, get_megatron_optimizer

    net = Net()
    names = {id(p): n for n, p in net.named_parameters()}
    muon, scalar = get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=1e-2), [net]).chained_optimizers
    stepped = {type(m.optimizer).__name__: sorted(names[id(p)] for g in m._stage.param_groups for p in g["params"])
               for m in (muon, scalar)}
    # c.weight is a matrix excluded with use_muon=False (Megatron's rule), embed.weight an embedding
    assert stepped == {"Muon": ["a.weight", "b.weight"],
                       "AdamW": ["a.bias", "b.bias", "c.bias", "c.weight", "embed.weight"]}
    assert stepped["Muon"] == sorted(n for n, p in net.named_parameters() if is_managed_by_layer_wise_optimizer(p))


def _gtp(rows: int, cols: int, remat: int) -> nn.Parameter:
    param = nn.Parameter(torch.zeros(rows, cols, dtype=torch.bfloat16))
    param.is_gtp_weight_remat, param.gtp_remat_size = True, remat
    param.is_managed_by_layer_wise_optimizer = True
    return param


def _managed(*shape: int) -> nn.Parameter:
    param = nn.Parameter(torch.zeros(*shape, dtype=torch.bfloat16))
    param.is_managed_by_layer_wise_optimizer = True
    return param


def test_gtp_weights_are_packed_by_the_cost_of_the_matrix_they_are_gathered_into() -> None:
    # a GTP row shard is small but Newton-Schulz runs on the gathered matrix (64x its rows): packing by elements
    # would pile the three onto one shard, packing by cost spreads them (Megatron's current main)
    dp, config = 4, DistributedDataParallelConfig(use_distributed_optimizer=True)
    gtp = [_gtp(64, 256, 64) for _ in range(3)]
    params = [_managed(128, 1024), _managed(256, 256), _managed(256, 256), *gtp, _managed(64, 256)]
    per_buffer = LayerWiseDistributedOptimizer._compute_per_buffer_param_layout(params, None, dp, config)
    full = LayerWiseDistributedOptimizer.compute_full_param_layout(params, None, dp, config)
    bf16 = torch.bfloat16
    for layout in (per_buffer, full.layouts[BufferKey(bf16, bf16, False, True)]):
        shards = [_shard_of(layout, p) for p in gtp]
        assert all(first == last for first, last in shards)
        assert len({first for first, _ in shards}) == 3, shards
    # buckets do not reset the shards' cost: one GTP matrix per bucket still lands on a different shard each time
    params = [p for _ in range(4) for p in (_gtp(64, 256, 64), *(_managed(128, 128) for _ in range(3)))]
    layout = LayerWiseDistributedOptimizer._compute_per_buffer_param_layout(params, 4 * 16384, dp, config)
    assert len(layout.bucket_indices) == 4
    assert len({_shard_of(layout, p)[0] for p in params if hasattr(p, "gtp_remat_size")}) == 4
