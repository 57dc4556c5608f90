"""Local fp32 gradient accumulation over 2 gloo ranks against a single-process reference: each rank's micro-batch
gradients summed in fp32, rounded once to bf16, averaged by a bf16 all-reduce and copied back."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from optstack.distributed.ddp import DataParallel

MICRO = 8
LOCAL = ("0.weight", "2.bias")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)).to(torch.bfloat16)


def _loss(model: nn.Module, rank: int, k: int) -> torch.Tensor:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1000 * rank + k)).to(torch.bfloat16)
    return model(x).float().pow(2).sum()


def _ranks_grads(overlap: bool) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    model = _net()
    ddp = DataParallel(model, bucket_size=200, overlap_grad_reduce=overlap,
                       local_grad_dtypes=dict.fromkeys(LOCAL, torch.float32))
    ddp.zero_grad_buffer()
    for k in range(MICRO):
        with ddp.no_sync() if k < MICRO - 1 else contextlib.nullcontext():
            _loss(ddp, dist.get_rank(), k).backward()
    ddp.finish_grad_sync()
    return {name: ddp.main_grad(p).clone() for name, p in model.named_parameters()}


def _reference(size: int) -> tuple[dict[str, torch.Tensor], bool]:
    """Per parameter the reduced gradient; and whether fp32 accumulation changed any listed one."""
    per_rank: list[dict[str, torch.Tensor]] = []
    differs = False
    for rank in range(size):
        model, sums = _net(), {}
        for k in range(MICRO):
            model.zero_grad(set_to_none=True)
            _loss(model, rank, k).backward()
            for name, p in model.named_parameters():
                g = p.grad
                if name in LOCAL:  # fp32 accumulator, and what a bf16 one would have held
                    fp32, bf16 = sums.get(name, (0.0, None))
                    sums[name] = (fp32 + g.float(), g.clone() if bf16 is None else bf16 + g)
                else:
                    sums[name] = g.clone() if name not in sums else sums[name] + g
        rounded = {}
        for name, value in sums.items():
            if name in LOCAL:
                rounded[name] = value[0].to(torch.bfloat16)
                differs |= not torch.equal(rounded[name], value[1])
            else:
                rounded[name] = value
        per_rank.append({n: (v * (1.0 / size)).to(torch.bfloat16) for n, v in rounded.items()})
    reduced = {n: sum(r[n].float() for r in per_rank).to(torch.bfloat16) for n in per_rank[0]}
    return reduced, differs


@pytest.mark.parametrize("overlap", [False, True])
def test_fp32_local_accumulation_matches_reference(world2, overlap: bool) -> None:
    results = world2.run(_ranks_grads, overlap)
    want, differs = _reference(2)
    assert differs, "the case must be one where fp32 accumulation gives other gradients than bf16 accumulation"
    for name, value in want.items():
        for rank, got in enumerate(results):
            assert got[name].dtype == (torch.float32 if name in LOCAL else torch.bfloat16), name
            torch.testing.assert_close(got[name], value.to(got[name].dtype), rtol=0, atol=0,
                                       msg=f"{name} on rank {rank}")
