"""Megatron's param.main_grad on the face's DistributedDataParallel, prepare_grads, and the layer-wise
optimizer's wrapping rules (one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optstack.megatron import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    LayerWiseDistributedOptimizer,
    OptimizerConfig,
    get_megatron_optimizer,
)


def mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def backward(model: nn.Module) -> None:
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1)).to(next(model.parameters()).dtype)
    model(x).square().sum().backward()


def test_main_grad_is_the_buffer_view_and_reads_zero_after_zero_grad_buffer() -> None:
    model = DistributedDataParallel(None, DistributedDataParallelConfig(), mlp())
    backward(model)
    model.finish_grad_sync()
    for p in model.module.parameters():
        assert p.main_grad.data_ptr() == model.main_grad(p).data_ptr() and p.main_grad.any()
    model.zero_grad_buffer()
    assert all(not p.main_grad.any() for p in model.module.parameters())  # zeroed now, not lazily


@pytest.mark.parametrize("distributed", [False, True])
def test_an_assigned_main_grad_is_what_the_step_uses(distributed: bool) -> None:
    model = DistributedDataParallel(None, DistributedDataParallelConfig(use_distributed_optimizer=distributed), mlp())
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.5, weight_decay=0.0, sgd_momentum=0.0,
                                                 clip_grad=0.0, use_distributed_optimizer=distributed), [model])
    backward(model)  # overwritten by the assigned gradients, as Megatron's optimizers read param.main_grad
    given = {p: torch.full_like(p, 0.25) for p in model.module.parameters()}
    before = {p: p.detach().clone() for p in given}
    for p, g in given.items():
        p.main_grad = g
    assert opt.step()[0] is True
    for p, g in given.items():
        torch.testing.assert_close(p.detach(), before[p] - 0.5 * g)
        assert p.main_grad.data_ptr() == model.main_grad(p).data_ptr()  # the buffer view again

    model.module[0].weight.main_grad = torch.zeros(3)
    with pytest.raises(ValueError, match=r"0\.weight\.main_grad must be a tensor of 48 elements"):
        opt.step()


def test_prepare_grads_readies_the_gradients_get_grad_norm_reads() -> None:
    model = DistributedDataParallel(None, DistributedDataParallelConfig(), mlp(torch.bfloat16))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True), [model])
    grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, p in
             enumerate(model.module.parameters())]
    for p, g in zip(model.module.parameters(), grads, strict=True):
        p.main_grad = g
    assert opt.prepare_grads() is False
    expected = torch.cat([g.to(torch.bfloat16).float().flatten() for g in grads]).norm().item()
    assert opt.get_grad_norm() == pytest.approx(expected, rel=1e-6)
    for p in model.module.parameters():
        p.main_grad = torch.full_like(p, float("nan"), dtype=torch.float32)
    assert opt.prepare_grads() is True


def test_layer_wise_wraps_torch_and_fp32_optimizers_for_bf16_and_refuses_float16_ones() -> None:
    model = DistributedDataParallel(None, DistributedDataParallelConfig(), mlp(torch.bfloat16))
    params = list(model.module.parameters())
    config = OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True)
    plain = torch.optim.Adam(params[:2], lr=1e-2)
    fp32 = FP32Optimizer(torch.optim.Adam(params[2:], lr=1e-2), config)  # megatron-core 0.16 unwraps these
    opt = LayerWiseDistributedOptimizer([plain, fp32], config)
    assert [type(o) for o in opt.chained_optimizers] == [Float16OptimizerWithFloat16Params] * 2
    assert all(p.dtype == torch.float32 for p in opt.get_parameters())  # masters
    for p in params:
        p.main_grad = torch.ones_like(p, dtype=torch.float32)
    before = [p.detach().clone() for p in params]
    assert opt.step()[0] is True
    assert all(not torch.equal(p, b) for p, b in zip(params, before, strict=True))

    wrapped = Float16OptimizerWithFloat16Params(torch.optim.Adam(params, lr=1e-2), config, None)
    with pytest.raises(TypeError, match="LayerWiseDistributedOptimizer expects base torch optimizers"):
        LayerWiseDistributedOptimizer([wrapped], config)
    # optstack's Float16 over bf16 parameters built for bf16=False is Megatron's FP32Optimizer there: re-wrapped
    built = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2), [model]).chained_optimizers
    assert isinstance(built[0], Float16OptimizerWithFloat16Params)
    assert isinstance(LayerWiseDistributedOptimizer(built, config).chained_optimizers[0],
                      Float16OptimizerWithFloat16Params)
