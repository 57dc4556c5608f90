"""optstack.megatron.DistributedDataParallel(Config): Megatron's names and defaults, validation, one process."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from optstack.megatron import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    OptimizerConfig,
    get_megatron_optimizer,
)

# Megatron Core's DistributedDataParallelConfig, field by field, in its order.
MEGATRON_DEFAULTS = {
    "grad_reduce_in_fp32": False, "overlap_grad_reduce": False, "overlap_param_gather": False,
    "align_param_gather": False, "use_distributed_optimizer": False, "num_distributed_optimizer_instances": 1,
    "check_for_nan_in_grad": False, "check_for_large_grads": False, "bucket_size": None, "num_buckets": None,
    "pad_buckets_for_high_nccl_busbw": False, "reduce_scatter_with_fp32_accumulation": False,
    "param_name_patterns_for_fp32_local_accumulation": (), "average_in_collective": False,
    "fp8_param_gather": False, "fp4_param_gather": False,
    "reuse_grad_buf_for_mxfp8_param_ag": False, "use_megatron_fsdp": False, "use_custom_fsdp": False,
    "data_parallel_sharding_strategy": "no_shard", "gradient_reduce_div_fusion": True,
    "suggested_communication_unit_size": None, "preserve_fp32_weights": True, "keep_fp8_transpose_cache": False,
    "nccl_ub": False, "fsdp_double_buffer": False, "outer_dp_sharding_strategy": "no_shard",
    "disable_symmetric_registration": False, "delay_wgrad_compute": False,
}


def model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.LayerNorm(10), nn.ReLU(), nn.Linear(10, 4)).to(dtype)


def wrap(module: nn.Module | None = None, config: object = None, **ddp: object) -> DistributedDataParallel:
    return DistributedDataParallel(config, DistributedDataParallelConfig(**ddp), module or model())


X = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
Y = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))


def loss_of(m: nn.Module, x: torch.Tensor = X, y: torch.Tensor = Y) -> torch.Tensor:
    return nn.functional.mse_loss(m(x).float(), y)


def test_defaults_and_field_order_are_megatrons() -> None:
    config = DistributedDataParallelConfig()
    assert [f.name for f in dataclasses.fields(config)] == list(MEGATRON_DEFAULTS)
    assert dataclasses.asdict(config) == MEGATRON_DEFAULTS


@pytest.mark.parametrize(
    ("field", "value"),
    [("align_param_gather", True), ("check_for_large_grads", True),
     ("reduce_scatter_with_fp32_accumulation", True),
     ("fp8_param_gather", True), ("fp4_param_gather", True), ("reuse_grad_buf_for_mxfp8_param_ag", True),
     ("use_custom_fsdp", True), ("nccl_ub", True), ("delay_wgrad_compute", True)],
)
def test_unsupported_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"DistributedDataParallelConfig\.{field}={value!r} is not supported"):
        DistributedDataParallelConfig(**{field: value})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bucket_size": 0}, "bucket_size must be None"),
        ({"bucket_size": 2.5}, "bucket_size must be None"),
        ({"bucket_size": True}, "bucket_size must be None"),
        ({"grad_reduce_in_fp32": "yes"}, "grad_reduce_in_fp32 must be True or False"),
        ({"data_parallel_sharding_strategy": "full"}, "data_parallel_sharding_strategy='full'; allowed"),
        ({"num_buckets": 4, "bucket_size": 10}, "cannot specify both num_buckets and bucket_size"),
        ({"num_buckets": 0}, "num_buckets must be an int greater than 0"),
        ({"num_distributed_optimizer_instances": 2}, "needs use_distributed_optimizer=True"),
        ({"num_distributed_optimizer_instances": 0}, "must be an int >= 1"),
        ({"param_name_patterns_for_fp32_local_accumulation": ("all",), "grad_reduce_in_fp32": True},
         "only needed when grad_reduce_in_fp32 is False"),
    ],
)
def test_invalid_values(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DistributedDataParallelConfig(**kwargs)


def test_fsdp_only_fields_are_accepted() -> None:
    DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params", preserve_fp32_weights=False,
                                  gradient_reduce_div_fusion=False, suggested_communication_unit_size=1000)


def test_config_is_checked_again_when_wrapping_and_not_modified() -> None:
    config = DistributedDataParallelConfig(overlap_grad_reduce=True)
    config.fp8_param_gather = True  # Megatron code mutates configs after construction
    with pytest.raises(ValueError, match="fp8_param_gather"):
        DistributedDataParallel(None, config, model())
    config.fp8_param_gather = False
    ddp = DistributedDataParallel(None, config, model())
    assert config.bucket_size is None  # Megatron writes its default back into the caller's config; we don't
    assert ddp.ddp_config == config and ddp.ddp_config is not config
    assert ddp.bucket_size == 40_000_000


def test_bucket_size_follows_megatron() -> None:
    assert wrap(bucket_size=50).bucket_size is None  # no overlap: one bucket per buffer
    several = wrap(overlap_grad_reduce=True, bucket_size=50)
    assert several.bucket_size == 50 and len(several.param_and_grad_buffers[0].buckets) > 1
    single = DistributedDataParallel(None, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=50),
                                     model(), disable_bucketing=True)
    assert single.bucket_size is None and len(single.param_and_grad_buffers[0].buckets) == 1


def test_translation_to_the_core_wrapper() -> None:
    ddp = wrap(model(torch.bfloat16), grad_reduce_in_fp32=True, use_distributed_optimizer=True,
               check_for_nan_in_grad=True)
    assert ddp.shard_grads and ddp.check_for_nan and ddp.average and not ddp.overlap_grad_reduce
    assert {b.grad_data.dtype for b in ddp.param_and_grad_buffers} == {torch.float32}
    assert {b.grad_data.dtype for b in wrap(model(torch.bfloat16)).param_and_grad_buffers} == {torch.bfloat16}
    assert not wrap(config=SimpleNamespace(calculate_per_token_loss=True)).average  # per-token: sum


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ddp_config": {"overlap_grad_reduce": True}}, "ddp_config must be an optstack.megatron"),
        ({"module": "model"}, "module must be an nn.Module"),
        ({"pg_collection": object()}, "pg_collection must be None .* or an optstack ParallelGroups"),
        ({"config": SimpleNamespace(calculate_per_token_loss=True),
          "ddp_config": DistributedDataParallelConfig(average_in_collective=True)}, "calculate_per_token_loss"),
    ],
)
def test_bad_wrapper_arguments(kwargs: dict, match: str) -> None:
    args = {"config": None, "ddp_config": DistributedDataParallelConfig(), "module": model()} | kwargs
    with pytest.raises(ValueError, match=match):
        DistributedDataParallel(**args)


def test_module_forward_no_sync_scale_and_state_dict() -> None:
    inner = model()
    ddp = wrap(inner, overlap_grad_reduce=True, bucket_size=30)
    assert ddp.module is inner
    torch.testing.assert_close(ddp(X), inner(X))
    with ddp.no_sync():
        loss_of(ddp, X[:4], Y[:4]).backward()
    loss_of(ddp, X[4:], Y[4:]).backward()
    ddp.finish_grad_sync()
    reference = model()
    (loss_of(reference, X[:4], Y[:4]) + loss_of(reference, X[4:], Y[4:])).backward()
    for p, q in zip(inner.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ddp.main_grad(p), q.grad)
    ddp.scale_gradients(0.5)
    torch.testing.assert_close(ddp.main_grad(inner[0].weight), reference[0].weight.grad * 0.5)
    ddp.zero_grad_buffer()
    assert all(not ddp.main_grad(p).any() for p in inner.parameters())

    assert set(ddp.state_dict()) == set(inner.state_dict())  # no "module." prefix, as in Megatron
    ddp.load_state_dict({k: torch.zeros_like(v) for k, v in ddp.state_dict().items()})
    assert not inner[0].weight.any()
    ddp(X)  # parameters were copied into place: still in the buffers
    ddp.broadcast_params()  # one process: nothing to do


def test_check_for_nan_in_grad_raises_in_finish_grad_sync() -> None:
    ddp = wrap(check_for_nan_in_grad=True)
    (ddp(X).sum() * float("nan")).backward()
    with pytest.raises(RuntimeError, match="non-finite"):
        ddp.finish_grad_sync()


@pytest.mark.parametrize(
    ("ddp", "optimizer", "match"),
    [  # (a non-distributed optimizer over a sharding wrapper builds, at dp > 1 too: tests/distributed)
        ({}, {"use_distributed_optimizer": True}, r"OptimizerConfig\.use_distributed_optimizer=True but"),
        ({"use_distributed_optimizer": True}, {"optimizer": "muon", "use_layer_wise_distributed_optimizer": True},
         "layer-wise optimizer needs whole reduced gradients"),
        ({"use_distributed_optimizer": True, "overlap_param_gather": True}, {"use_distributed_optimizer": True},
         r"OptimizerConfig\.overlap_param_gather=False but the model's "
         r"DistributedDataParallelConfig\.overlap_param_gather=True"),
    ],
)
def test_optimizer_config_must_agree_with_the_wrapper(ddp: dict, optimizer: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        get_megatron_optimizer(OptimizerConfig(lr=1e-2, **optimizer), [wrap(**ddp)])


@pytest.mark.parametrize("flags", [{"use_distributed_optimizer": True},
                                   {"optimizer": "muon", "use_layer_wise_distributed_optimizer": True}])
def test_distributed_optimizer_without_a_wrapper_says_how_to_wrap(flags: dict) -> None:
    with pytest.raises(ValueError, match=r"needs the model wrapped .* optstack\.megatron\.DistributedDataParallel"):
        get_megatron_optimizer(OptimizerConfig(lr=1e-2, **flags), [model()])


def test_pg_collection_must_be_the_wrappers_groups() -> None:
    ddp = wrap()
    get_megatron_optimizer(OptimizerConfig(lr=1e-2), [ddp], pg_collection=ddp.groups)
    with pytest.raises(ValueError, match="pg_collection"):
        get_megatron_optimizer(OptimizerConfig(lr=1e-2), [wrap()], pg_collection=ddp.groups)


@pytest.mark.parametrize(("wrapper_shards", "distributed"), [(False, False), (True, True), (True, False)])
def test_one_process_megatron_loop_equals_the_unwrapped_model(wrapper_shards: bool, distributed: bool) -> None:
    """(True, False): the wrapper built for the distributed optimizer reduces whole gradients over one rank, so
    Megatron's non-distributed optimizer over it steps exactly as over the unwrapped model."""
    inner = model()
    ddp = wrap(inner, overlap_grad_reduce=True, bucket_size=40, use_distributed_optimizer=wrapper_shards)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, use_distributed_optimizer=distributed), [ddp])
    reference = model()
    ref_opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [reference])
    assert {s.kind for s in opt.built.optimizer.stages} == {"zero1+masters" if distributed else "whole+direct"}
    for _ in range(3):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss_of(ddp).backward()
        ddp.finish_grad_sync()
        got = opt.step()
        ref_opt.zero_grad()
        loss_of(reference).backward()
        want = ref_opt.step()
        assert got[0] and got[1] == pytest.approx(want[1], rel=1e-6)
    for p, q in zip(inner.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_the_wrapper_is_laid_out_by_a_plan_of_its_config(distributed_optimizer: bool) -> None:
    """The face translates ddp_config into the core's ParamPlan and the wrapper's buffers are the plan's: matrices
    tagged for the layer-wise optimizer in whole-shard buffers of their own under the distributed optimizer only,
    grad_reduce_in_fp32 as the buffers' dtype, Megatron's bucket size."""
    module = model()
    module[3].weight.is_managed_by_layer_wise_optimizer = True
    ddp = wrap(module, use_distributed_optimizer=distributed_optimizer, grad_reduce_in_fp32=True,
               overlap_grad_reduce=True, bucket_size=40)
    plan = ddp.plan
    assert plan is not None and plan.bucket_size == 40
    assert [b.layout for b in plan.buffers] == [b.layout for b in ddp.param_and_grad_buffers]
    assert {b.grad_dtype for b in plan.buffers} == {torch.float32}
    assert plan.whole_shard_names() == (frozenset({"3.weight"}) if distributed_optimizer else frozenset())
    assert plan.sharding == ("zero1" if distributed_optimizer else "replicated")


def test_a_discarded_wrapper_is_freed() -> None:
    """The gradient hooks on the parameters hold the wrapper weakly: a wrapper (its buffers, its process groups)
    dropped by its user is collected, not kept alive by the cycle through C++-held tensor hooks."""
    import gc
    import weakref

    ddp = wrap(model(), overlap_grad_reduce=True, bucket_size=30)
    loss_of(ddp, X, Y).backward()  # the hooks run (and reach the wrapper) while it lives
    ddp.finish_grad_sync()
    assert ddp.main_grad(ddp.module[0].weight).any()
    ref = weakref.ref(ddp)
    del ddp
    gc.collect()
    assert ref() is None
