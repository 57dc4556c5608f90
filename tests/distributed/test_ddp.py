"""The data-parallel wrapper: real gloo ranks against a single-process reference on the same global batch."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from optstack.distributed.ddp import DataParallel

GLOBAL_BATCH = 12  # divisible by 2 and 3 ranks and by 2 micro-batches


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.never = nn.Linear(8, 8)  # never used: no gradient; registered first, so its bucket is the last
        self.inp = nn.Linear(6, 8)
        self.hidden = nn.Linear(8, 8)
        self.sometimes = nn.Linear(8, 8)  # used only when asked (data-dependent use)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use_sometimes: bool = True) -> torch.Tensor:
        h = torch.tanh(self.hidden(torch.tanh(self.inp(x))))
        if use_sometimes:
            h = h + torch.tanh(self.sometimes(h))
        return self.out(h)


def _data(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 2, generator=g)
    return x.to(dtype), y.to(dtype)


def _pieces(x: torch.Tensor, y: torch.Tensor, size: int, micro: int) -> list[list[tuple[torch.Tensor, ...]]]:
    """pieces[rank][micro_batch] = (x, y): each rank's equal share, cut into micro-batches."""
    return [list(zip(xr.chunk(micro), yr.chunk(micro), strict=True))
            for xr, yr in zip(x.chunk(size), y.chunk(size), strict=True)]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro: int, use: bool) -> torch.Tensor:
    return nn.functional.mse_loss(model(x, use_sometimes=use), y) / micro


def _ddp_vs_reference(*, overlap: bool = True, shard: bool = False, sharded_reduction: str = "auto",
                      bf16: bool = False, micro: int = 1, rank0_only_uses_sometimes: bool = False,
                      stale: bool = False) -> dict:
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if bf16 else torch.float32
    torch.manual_seed(0)
    model = _Net().to(dtype)
    ref = copy.deepcopy(model)
    ddp = DataParallel(model, bucket_size=100, overlap_grad_reduce=overlap, shard_grads=shard,
                       sharded_reduction=sharded_reduction, grad_dtype=torch.float32 if bf16 else None,
                       shard_align=4, param_align=4)
    pieces = _pieces(*_data(dtype), size, micro)
    if stale:  # a previous step's leftovers (NaN: any that leaked would show) that zero_grad_buffer drops
        for p in model.parameters():
            ddp.main_grad(p).fill_(float("nan"))
        ddp.zero_grad_buffer()

    def uses(r: int) -> bool:
        return r == 0 if rank0_only_uses_sometimes else True

    launched = []
    for m, (xm, ym) in enumerate(pieces[rank]):
        with ddp.no_sync() if m < micro - 1 else contextlib.nullcontext():
            _loss(ddp, xm, ym, micro, uses(rank)).backward()
        launched.append(ddp.launched_buckets)
    assert all(p.grad is None for p in model.parameters()), "hooks must free .grad"
    ddp.finish_grad_sync()

    # Reference: one process, the whole global batch (every rank's micro-batches), average over ranks.
    if bf16:  # bf16 gradients are computed per micro-batch and accumulated in fp32, as the wrapper does
        expected = {n: torch.zeros(p.shape) for n, p in ref.named_parameters()}
        for r in range(size):
            for xm, ym in pieces[r]:
                ref.zero_grad()
                _loss(ref, xm, ym, micro, uses(r)).backward()
                for n, p in ref.named_parameters():
                    if p.grad is not None:
                        expected[n] += p.grad.float() / size
    else:
        total = sum(_loss(ref, xm, ym, micro, uses(r)) for r in range(size) for xm, ym in pieces[r])
        total.div(size).backward()
        expected = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in ref.named_parameters()}

    # Compare everything, or with shard_grads only the slices this rank owns (the range plan).
    worst = 0.0
    for buf in ddp.param_and_grad_buffers:
        comm = ddp.reduce_comm(buf)
        for bucket in buf.buckets:
            if shard:
                owned = buf.layout.owned_slices(bucket.index, comm.rank)
                pairs = [(buf.param_of(s.name), s.name, s.param_start, s.param_end) for s in owned]
            else:
                pairs = [(p, buf.name_of(p), 0, p.numel()) for p in bucket.params]
            for p, name, lo, hi in pairs:
                got = ddp.main_grad(p).reshape(-1)[lo:hi]
                want = expected[name].reshape(-1)[lo:hi].float()
                worst = max(worst, ((got - want).abs().max() / (want.abs().max() + 1e-12)).item())
    return {"worst": worst, "launched": launched,
            "buckets": sum(len(b.buckets) for b in ddp.param_and_grad_buffers),
            "grad_dtype": str(ddp.main_grad(model.inp.weight).dtype),
            "never": ddp.main_grad(model.never.weight).abs().max().item()}


CASES = {
    "overlap": dict(overlap=True),
    "no-overlap": dict(overlap=False),
    "shard-reduce-scatter": dict(shard=True, sharded_reduction="reduce_scatter"),
    "shard-auto": dict(shard=True),
    "bf16-fp32-grads": dict(bf16=True),
    "no-sync-2-micro": dict(micro=2),
    "unused-on-one-rank": dict(rank0_only_uses_sometimes=True, micro=2),
    # after zero_grad_buffer: first gradients are copied (and scaled) into stale views, unused ones zeroed
    "stale-overlap": dict(stale=True),
    "stale-no-sync-2-micro": dict(stale=True, micro=2),
    "stale-unused-on-one-rank": dict(stale=True, rank0_only_uses_sometimes=True, micro=2),
    "stale-shard-bf16-fp32-grads": dict(stale=True, shard=True, bf16=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_grads_equal_single_process_full_batch_at_size_2(world2, case):
    for out in world2.run(_ddp_vs_reference, **CASES[case]):
        assert out["worst"] < 1e-5, out
        assert out["never"] == 0.0  # a never-used parameter: zero, and finish_grad_sync did not hang
        assert out["buckets"] >= 3
        if CASES[case].get("overlap", True) and not CASES[case].get("rank0_only_uses_sometimes"):
            # buckets started during backward, except the last ones, held back by the never-used parameter
            assert 0 < out["launched"][-1] < out["buckets"], out
        if not CASES[case].get("overlap", True):
            assert out["launched"][-1] == 0
        if CASES[case].get("bf16"):
            assert out["grad_dtype"] == "torch.float32"


@pytest.mark.parametrize("case", ["overlap", "shard-reduce-scatter", "no-sync-2-micro", "stale-overlap"])
def test_grads_equal_single_process_full_batch_at_size_3(world3, case):
    for out in world3.run(_ddp_vs_reference, **CASES[case]):
        assert out["worst"] < 1e-5, out


def _expert_params_use_their_group() -> dict:
    import torch.distributed as dist

    from optstack.distributed.parallel import ParallelGroups

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _Net()
    model.out.weight.allreduce = False  # Megatron's flag for expert (MoE) parameters
    ref = copy.deepcopy(model)
    ddp = DataParallel(model, groups=ParallelGroups.from_world(ep=2), bucket_size=None, shard_align=1)
    x, y = _data(torch.float32)
    _loss(ddp, x.chunk(2)[rank], y.chunk(2)[rank], 1, True).backward()
    ddp.finish_grad_sync()
    # expert-data-parallel size is 1 here: the expert grad is this rank's own, scaled by 1 / dp size
    _loss(ref, x.chunk(2)[rank], y.chunk(2)[rank], 1, True).backward()
    local = ref.out.weight.grad / 2
    experts = [b for b in ddp.param_and_grad_buffers if b.key.is_expert]
    return {"expert_err": (ddp.main_grad(model.out.weight) - local).abs().max().item(),
            "expert_buffers": [(b.names, b.layout.dp_size) for b in experts],
            "dense_same": ddp.main_grad(model.inp.weight).tolist()}


def test_expert_params_are_reduced_over_the_expert_data_parallel_group(world2):
    r0, r1 = world2.run(_expert_params_use_their_group)
    for out in (r0, r1):
        assert out["expert_err"] < 1e-7 and out["expert_buffers"] == [(("out.weight",), 1)]
    assert r0["dense_same"] == r1["dense_same"]  # dense params were all-reduced over both ranks


def _mismatched_models() -> str:
    import torch.distributed as dist

    model = _Net()
    if dist.get_rank() == 1:
        model.hidden = nn.Linear(8, 7)
    try:
        DataParallel(model)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_mismatched_param_sets_across_ranks_are_a_clear_error(world2):
    for msg in world2.run(_mismatched_models):
        assert "the data-parallel ranks wrap different dense parameters" in msg
        assert "rank 0 has ('hidden.weight', (8, 8), 'float32') but rank 1 has ('hidden.weight', (7, 8)" \
            in msg


# -- single process (NullComm) -----------------------------------------------------------------------
def test_single_process_params_keep_values_and_grads_match():
    torch.manual_seed(0)
    model = _Net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref = copy.deepcopy(model)
    ddp = DataParallel(model, bucket_size=50)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
    x, y = _data(torch.float32)
    with ddp.no_sync():
        _loss(ddp, x[:6], y[:6], 2, True).backward()
    assert ddp.launched_buckets == 0
    _loss(ddp, x[6:], y[6:], 2, True).backward()
    ddp.finish_grad_sync()
    _loss(ref, x[:6], y[:6], 2, True).add(_loss(ref, x[6:], y[6:], 2, True)).backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        want = q.grad if q.grad is not None else torch.zeros_like(q)
        torch.testing.assert_close(ddp.main_grad(p), want, msg=n)
    ddp.zero_grad_buffer()  # lazy: main_grad reads zero at once, the whole buffer after finish_grad_sync
    assert all(ddp.main_grad(p).abs().sum() == 0 for p in model.parameters())
    ddp.finish_grad_sync()
    assert all(b.grad_data.abs().sum() == 0 for b in ddp.param_and_grad_buffers)


def test_lazy_zeroing_keeps_gradients_exact_across_steps():
    """Steps after zero_grad_buffer write first gradients over stale values (unused ones are zeroed), and
    accumulating without zero_grad_buffer still adds to the previous step's gradients."""
    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    ddp = DataParallel(model, bucket_size=50)
    x, y = _data(torch.float32)
    for step, use in enumerate([True, False, True]):
        ddp.zero_grad_buffer()
        ref.zero_grad()
        with ddp.no_sync():
            _loss(ddp, x[:6], y[:6], 2, use).backward()
        _loss(ddp, x[6:], y[6:], 2, step != 1).backward()
        ddp.finish_grad_sync()
        _loss(ref, x[:6], y[:6], 2, use).add(_loss(ref, x[6:], y[6:], 2, step != 1)).backward()
        for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            want = q.grad if q.grad is not None else torch.zeros_like(q)
            torch.testing.assert_close(ddp.main_grad(p), want, msg=f"step {step}, {n}")
    _loss(ddp, x[:6], y[:6], 1, True).backward()  # no zero_grad_buffer: adds to the last step's
    ddp.finish_grad_sync()
    _loss(ref, x[:6], y[:6], 1, True).backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        want = q.grad if q.grad is not None else torch.zeros_like(q)
        torch.testing.assert_close(ddp.main_grad(p), want, msg=n)


def test_second_gradient_without_sync_is_an_error():
    ddp = DataParallel(nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2)), bucket_size=1)
    ddp(torch.ones(1, 3)).sum().backward()
    assert ddp.launched_buckets == 4  # with every parameter used, each bucket starts during backward
    with pytest.raises(RuntimeError, match="got a second gradient before finish_grad_sync"):
        ddp(torch.ones(1, 3)).sum().backward()


def test_changed_params_after_wrapping_are_named():
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    ddp = DataParallel(model)
    model[1].weight = nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(RuntimeError, match="parameter '1.weight' was replaced by a new tensor"):
        ddp(torch.ones(1, 3))
    model2 = nn.Linear(3, 2)
    ddp2 = DataParallel(model2)
    model2.weight.data = torch.zeros(2, 3)
    with pytest.raises(RuntimeError, match="parameter 'weight' no longer lives in the DataParallel buffer"):
        ddp2.finish_grad_sync()
    ddp3 = DataParallel(model3 := nn.Sequential(nn.Linear(3, 2)))
    model3.append(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="'1.weight' is new"):
        ddp3(torch.ones(1, 3))


def test_check_for_nan_names_the_parameter_and_bad_arguments_are_errors():
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    ddp = DataParallel(model, check_for_nan=True)
    model[0].bias.register_hook(lambda g: g * float("nan"))
    ddp(torch.ones(1, 3)).sum().backward()
    with pytest.raises(RuntimeError, match=r"non-finite local gradient .* in \['0.bias'\]"):
        ddp.finish_grad_sync()
    with pytest.raises(ValueError, match="bucket_size must be a positive element count or None, got 0"):
        DataParallel(nn.Linear(2, 2), bucket_size=0)
    with pytest.raises(ValueError, match="is not a trainable parameter of the wrapped module"):
        ddp.main_grad(nn.Parameter(torch.zeros(1)))
