"""Local gradient accumulation (``local_grad_dtypes``; Megatron's ``param_name_patterns_for_fp32_local_accumulation``)
in one process, against gradients accumulated by hand."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from optstack.distributed.buffers import build_buffers
from optstack.distributed.ddp import DataParallel
from optstack.megatron import DistributedDataParallel, DistributedDataParallelConfig

MICRO = 8  # enough bf16 additions for bf16 accumulation to lose bits that fp32 keeps


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)).to(torch.bfloat16)


def _input(k: int) -> torch.Tensor:
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(100 + k)).to(torch.bfloat16)


def _loss(model: nn.Module, k: int) -> torch.Tensor:
    return model(_input(k)).float().pow(2).sum()


def _micro_grads(micro: int) -> dict[str, list[torch.Tensor]]:
    """Each micro-batch's bf16 gradient, from an unwrapped copy of the model."""
    model, grads = _net(), {}
    for k in range(micro):
        model.zero_grad(set_to_none=True)
        _loss(model, k).backward()
        for name, p in model.named_parameters():
            grads.setdefault(name, []).append(p.grad.clone())
    return grads


def _accumulated(grads: list[torch.Tensor], *, fp32: bool) -> torch.Tensor:
    """The buffer's gradient after the micro-batches: summed in fp32 then rounded once, or summed in bf16."""
    if fp32:
        return torch.stack([g.float() for g in grads]).sum(0).to(torch.bfloat16)
    acc = grads[0].clone()
    for g in grads[1:]:
        acc = acc + g
    return acc


def _run(ddp: nn.Module, micro: int) -> None:
    ddp.zero_grad_buffer()
    for k in range(micro):
        with ddp.no_sync() if k < micro - 1 else contextlib.nullcontext():
            _loss(ddp, k).backward()
    ddp.finish_grad_sync()


@pytest.mark.parametrize("overlap", [False, True])
def test_listed_parameters_accumulate_in_fp32(overlap: bool) -> None:
    model = _net()
    ddp = DataParallel(model, bucket_size=200, overlap_grad_reduce=overlap,
                       local_grad_dtypes={"0.weight": torch.float32, "2.bias": torch.float32})
    _run(ddp, MICRO)
    grads = _micro_grads(MICRO)
    differs = False
    for name, p in model.named_parameters():
        local = name in ("0.weight", "2.bias")
        got = ddp.main_grad(p)
        assert got.dtype == (torch.float32 if local else torch.bfloat16), name
        want = _accumulated(grads[name], fp32=local)
        torch.testing.assert_close(got, want.to(got.dtype), rtol=0, atol=0, msg=name)
        differs |= local and not torch.equal(want, _accumulated(grads[name], fp32=False))
    assert differs, "the case must be one where fp32 accumulation gives other gradients than bf16 accumulation"

    _run(ddp, 2)  # the next step starts from zero (lazily zeroed accumulators)
    grads = _micro_grads(2)
    torch.testing.assert_close(ddp.main_grad(model[0].weight), _accumulated(grads["0.weight"], fp32=True).float(),
                               rtol=0, atol=0)


def test_buffer_scales_and_zeroes_its_local_accumulators() -> None:
    model = _net()
    (buffer,) = build_buffers(list(reversed(list(model.named_parameters()))), dp_size=1, expert_dp_size=1,
                              bucket_size=None, local_grad_dtypes={"2.weight": torch.float32})
    local = buffer.local_grad(model[2].weight)
    assert local is not None and local.dtype == torch.float32 and buffer.local_grad(model[0].weight) is None
    buffer.grad_data.fill_(2.0)
    local.fill_(3.0)
    buffer.scale_gradients(0.5)
    assert bool((buffer.grad_data == 1.0).all()) and bool((local == 1.5).all())
    buffer.stage_local_grads(0)
    assert bool((buffer.grad_view(model[2].weight) == 1.5).all()) and bool((buffer.grad_view(model[0].bias) == 1).all())
    buffer.grad_data.fill_(4.0)
    buffer.unstage_local_grads(0)
    assert bool((local == 4.0).all())
    buffer.zero_gradients()
    assert not buffer.grad_data.any() and not local.any()


@pytest.mark.parametrize(("dtypes", "match"), [
    ({"nope.weight": torch.float32}, "'nope.weight', which is not a trainable parameter"),
    ({"0.weight": torch.int32}, r"local_grad_dtypes\['0.weight'\] must be a floating-point"),
])
def test_bad_local_grad_dtypes(dtypes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DataParallel(_net(), local_grad_dtypes=dtypes)


def test_megatron_patterns_map_to_local_accumulators() -> None:
    model = _net()
    config = DistributedDataParallelConfig(param_name_patterns_for_fp32_local_accumulation=("*.weight",),
                                           bucket_size=200, overlap_grad_reduce=True)
    ddp = DistributedDataParallel(None, config, model)
    weights = {model[0].weight, model[2].weight}
    (buffer,) = ddp.buffers
    assert len(buffer.extra_main_grads) == 2 and buffer.grad_dtype == torch.bfloat16
    assert {p for b in buffer.buckets for p in b.params_with_extra_main_grads} == weights
    _run(ddp, MICRO)
    grads = _micro_grads(MICRO)
    for name, p in model.named_parameters():
        want = _accumulated(grads[name], fp32=p in weights)
        torch.testing.assert_close(ddp.main_grad(p), want.to(ddp.main_grad(p).dtype), rtol=0, atol=0, msg=name)
    ddp.scale_gradients(0.5)  # scales the local accumulators too
    torch.testing.assert_close(ddp.main_grad(model[0].weight),
                               _accumulated(grads["0.weight"], fp32=True).float() * 0.5, rtol=0, atol=0)
    buffer.reset()
    assert not any(g.any() for g in buffer.extra_main_grads) and not buffer.grad_data.any()

    every = DistributedDataParallel(None, DistributedDataParallelConfig(
        param_name_patterns_for_fp32_local_accumulation=("all",)), _net())
    assert len(every.buffers[0].extra_main_grads) == 4
