"""Scaffolding shared by the algorithm tests (AdamW, SGD, Lion): a tiny seeded model and data, a training
loop that records the trajectory, a relative-difference measure and back-to-back flat views."""

from __future__ import annotations

import torch
from torch import nn

IMPLS = ["auto", "fused", "foreach", "reference"]


def make_model() -> nn.Module:
    """A seeded two-layer MLP (6 -> 12 -> 3)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` seeded (input, target) pairs for ``make_model``."""
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 6, generator=gen), torch.randn(16, 3, generator=gen)) for _ in range(steps)]


def train(model: nn.Module, opt: torch.optim.Optimizer, data) -> list[list[torch.Tensor]]:
    """Run the steps; return the parameters after every step."""
    trajectory = []
    for x, y in data:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        trajectory.append([p.detach().clone() for p in model.parameters()])
    return trajectory


def max_rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest ``max|x - y| / max|y|`` over pairs."""
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b, strict=True))


def flat_views(numels: list[int], seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Tensors that are back-to-back views of one flat buffer, with grads that are views of another."""
    gen = torch.Generator().manual_seed(seed)
    flat, flat_grad = torch.randn(sum(numels), generator=gen), torch.randn(sum(numels), generator=gen)
    views = list(flat.split(numels))
    for view, grad in zip(views, flat_grad.split(numels), strict=True):
        view.grad = grad
    return flat, views


def clones_with_grads(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Separate copies of ``tensors`` and of their grads."""
    clones = [t.detach().clone() for t in tensors]
    for clone, t in zip(clones, tensors, strict=True):
        clone.grad = t.grad.clone()
    return clones


def shard_numbers(optimizer, model: nn.Module | None = None, *, scalars: bool = True) -> dict[str, torch.Tensor]:
    """Copies of every stage's parameter shards (this rank's), keyed ``<param>.<key>``; with ``model`` also its
    state dict as ``model.<name>``; ``scalars`` adds each shard's scalars as 0-d tensors."""
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()} if model is not None else {}
    for stage in optimizer.stages:
        for name, shard in stage.param_shards().items():
            out |= {f"{name}.{k}": t.clone() for k, t in shard.tensors.items()}
            if scalars:
                out |= {f"{name}.{k}": torch.tensor(float(v)) for k, v in shard.scalars.items()}
    return out


def stack_state(model: nn.Module, built) -> dict[str, torch.Tensor | float]:
    """Every number of a built stack (model, each stage's shards, lrs, loss scale, scheduler step), copied:
    what a failed load must leave unchanged. Keys: ``model.<name>``, ``<stage>.<param>.<key>``, ``lr<i>``."""
    out: dict[str, torch.Tensor | float] = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, stage in enumerate(built.optimizer.stages):
        for name, shard in stage.param_shards().items():
            out |= {f"{i}.{name}.{k}": t.clone() for k, t in shard.tensors.items()}
            out |= {f"{i}.{name}.{k}": float(v) for k, v in shard.scalars.items()}
    out |= {f"lr{i}": float(g["lr"]) for i, g in enumerate(built.optimizer.param_groups)}
    assert built.scheduler is not None
    return out | {"scale": built.optimizer.loss_scale, "sched": float(built.scheduler.num_steps)}
