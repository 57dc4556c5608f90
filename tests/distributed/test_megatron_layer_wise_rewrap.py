"""Megatron's way to build the layer-wise optimizer: wrap get_megatron_optimizer's replicated optimizers."""

from __future__ import annotations


def _rewrapped(steps: int) -> tuple[list[float], int, int]:
    import torch
    import torch.distributed as dist
    from torch import nn

    from optstack.megatron import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        LayerWiseDistributedOptimizer,
        OptimizerConfig,
        get_megatron_optimizer,
    )

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4))
    model = DistributedDataParallel(None, DistributedDataParallelConfig(), module)
    config = OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.3)
    optimizer = LayerWiseDistributedOptimizer(get_megatron_optimizer(config, [model]).chained_optimizers, config)
    owned = sum(p.numel() for p in optimizer.get_parameters())
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(4 * world, 6, generator=g), torch.randn(4 * world, 4, generator=g)
    for _ in range(steps):
        model.zero_grad_buffer()
        nn.functional.mse_loss(module(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        model.finish_grad_sync()
        assert optimizer.step()[0] is True
    return torch.cat([p.detach().flatten() for p in module.parameters()]).tolist(), owned, rank


def test_wrapped_replicated_optimizers_step_layer_wise_as_one_process(world2):
    import torch
    from torch import nn

    from optstack.megatron import OptimizerConfig, get_megatron_optimizer

    results = world2.run(_rewrapped, 3)
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4))
    reference = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.3), [module])
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)
    for _ in range(3):
        reference.zero_grad()
        nn.functional.mse_loss(module(x), y).backward()
        reference.step()
    total = sum(p.numel() for p in module.parameters())
    (first, owned0, _), (second, owned1, _) = results
    assert first == second and 0 < owned0 < total and owned0 + owned1 == total  # each rank steps its own layers
    torch.testing.assert_close(torch.tensor(first), torch.cat([p.detach().flatten() for p in module.parameters()]),
                               rtol=1e-5, atol=1e-6)
