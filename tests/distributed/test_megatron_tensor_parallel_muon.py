"""Megatron's TensorParallelMuon / TensorParallelAdaptiveMuon with a tensor-parallel group of 2 gloo ranks
(Megatron's plain-tensor TP: each rank holds a shard along ``partition_dim``) equal one process: ``duplicated`` and
``distributed`` one process holding the whole matrices, ``blockwise`` one process stepping the blocks as matrices."""

from __future__ import annotations

import pytest
import torch

# full shape, partition_dim; the last is a fused QKV weight (4 groups of q=2, k=1, v=1 rows)
_MATRICES = (((12, 8), 0), ((12, 8), 1), ((8, 12), 0), ((16, 6), 0))
_QKV = (2, 1, 1)
_STEPS = 3


def _full_values(step: int | None) -> list[torch.Tensor]:
    """The whole matrices' start values (``step`` None) or their gradients at ``step``."""
    g = torch.Generator().manual_seed(100 if step is None else step)
    return [torch.randn(*shape, generator=g) for shape, _ in _MATRICES]


def _build(cls_name: str, params: list[torch.Tensor], mode: str, pg_collection, **kwargs):
    from optstack.megatron import emerging_optimizers as eo

    cls = getattr(eo, cls_name)
    return cls(params, lr=0.05, momentum=0.9, weight_decay=0.1, split_qkv=True,
               is_qkv_fn=lambda p: p.shape[1] == 6, qkv_split_shapes=list(_QKV), fp32_matmul_prec="highest",
               pg_collection=pg_collection, tp_mode=mode, **kwargs)


def _run_ranks(cls_name: str, mode: str, kwargs: dict) -> list[list[float]]:
    """On each rank: its shards of the matrices, stepped through the tensor-parallel group."""
    import torch.distributed as dist

    from optstack.megatron import ProcessGroupCollection

    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    params = []
    for (_, dim), full in zip(_MATRICES, _full_values(None), strict=True):
        p = torch.nn.Parameter(full.chunk(world, dim)[rank].clone())
        p.partition_dim = dim  # Megatron's tensor_model_parallel attribute
        params.append(p)
    opt = _build(cls_name, params, mode, ProcessGroupCollection(tp=dist.group.WORLD), **kwargs)
    for step in range(_STEPS):
        for p, (_, dim), grad in zip(params, _MATRICES, _full_values(step), strict=True):
            p.grad = grad.chunk(world, dim)[rank].clone()
        opt.step()
    return [p.detach().flatten().tolist() for p in params]


def _one_process(cls_name: str, mode: str, kwargs: dict, world: int) -> list[list[torch.Tensor]]:
    """Each rank's shards as one process computes them: whole matrices, or the blocks as matrices (blockwise)."""
    blocks = mode == "blockwise"
    starts = _full_values(None)
    if blocks:
        params = [torch.nn.Parameter(b.clone()) for (_, dim), f in zip(_MATRICES, starts, strict=True)
                  for b in f.chunk(world, dim)]
    else:
        params = [torch.nn.Parameter(f.clone()) for f in starts]
    opt = _build(cls_name, params, "duplicated", None, **kwargs)
    for step in range(_STEPS):
        grads = _full_values(step)
        if blocks:
            grads = [b for (_, dim), g in zip(_MATRICES, grads, strict=True) for b in g.chunk(world, dim)]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
    if blocks:
        return [[params[i * world + r].detach() for i in range(len(_MATRICES))] for r in range(world)]
    return [[p.detach().chunk(world, dim)[r] for p, (_, dim) in zip(params, _MATRICES, strict=True)]
            for r in range(world)]


@pytest.mark.parametrize("mode", ["duplicated", "distributed", "blockwise"])
@pytest.mark.parametrize(("cls_name", "kwargs"), [
    ("TensorParallelMuon", {}),
    ("TensorParallelAdaptiveMuon", {"moment2_method": "adamuon"}),
    ("TensorParallelAdaptiveMuon", {"moment2_method": "normuon"}),
], ids=["muon", "adamuon", "normuon"])
def test_tensor_parallel_muon_equals_one_process(world2, cls_name: str, kwargs: dict, mode: str) -> None:
    got = world2.run(_run_ranks, cls_name, mode, kwargs, timeout_s=60)
    want = _one_process(cls_name, mode, kwargs, world=2)
    # fp32 round-off: distributed sums the Gram products across the ranks; duplicated / blockwise orthogonalise the
    # same matrices from other memory layouts (the gathered q / k / v rows), which the second moment's division
    # amplifies a little
    tol = dict(rtol=1e-5, atol=1e-6)
    for rank in range(2):
        for i, expected in enumerate(want[rank]):
            torch.testing.assert_close(torch.tensor(got[rank][i]).view_as(expected), expected, **tol,
                                       msg=lambda m, r=rank, i=i: f"rank {r} matrix {_MATRICES[i]}: {m}")


def _modes_differ() -> list[float]:
    """blockwise orthogonalises each shard on its own: a different update than the whole matrix's."""
    import torch.distributed as dist

    from optstack.megatron import ProcessGroupCollection

    out = []
    for mode in ("duplicated", "blockwise"):
        full = _full_values(None)[0]
        p = torch.nn.Parameter(full.chunk(2, 0)[dist.get_rank()].clone())
        p.partition_dim = 0
        opt = _build("TensorParallelMuon", [p], mode, ProcessGroupCollection(tp=dist.group.WORLD))
        p.grad = _full_values(0)[0].chunk(2, 0)[dist.get_rank()].clone()
        opt.step()
        out.append(p.detach().flatten())
    return [float((out[0] - out[1]).abs().max())]


def test_blockwise_differs_from_whole_matrix(world2) -> None:
    assert all(d[0] > 1e-4 for d in world2.run(_modes_differ, timeout_s=60))
