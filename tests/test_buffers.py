"""Buffer layouts, buckets and the range plan (pure), and the param/grad buffers (no processes)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from optstack.distributed.buffers import Bucketing, BufferLayout, ParamAndGradBuffer, build_buffers


def test_plan_example():
    params = [("c", (10,)), ("b", (6, 5)), ("a", (7,))]  # backward order
    layout = BufferLayout.plan(params, dp_size=2, bucket_size=40, shard_align=4, param_align=8)
    # "c" opens bucket 0; "b" would end at 16 + 30 = 46 > 40 elements (param_align 8 puts it at 16), so
    # bucket 0 closes, padded to 16 (a multiple of dp_size * shard_align = 8); "a" fits with "b"
    # (48 + 7 - 16 = 39 <= 40); bucket 1 is padded from 39 to 40.
    assert [(s.offset, s.numel, s.bucket) for s in layout.params] == [(0, 10, 0), (16, 30, 1), (48, 7, 1)]
    assert [(k.offset, k.numel, k.shard_numel, k.param_names) for k in layout.buckets] == [
        (0, 16, 8, ("c",)), (16, 40, 20, ("b", "a"))]
    assert layout.numel == 56
    assert layout.owned_range(1, 1) == (20, 40)
    # rank 0 owns buffer [16, 36) = b[0:20]; rank 1 owns [36, 56) = b[20:30], a gap, a[0:7], padding
    assert [(s.name, s.param_start, s.param_end, s.buffer_start, s.shard_start)
            for s in layout.owned_slices(1, 0)] == [("b", 0, 20, 16, 0)]
    assert [(s.name, s.param_start, s.param_end, s.buffer_start, s.shard_start)
            for s in layout.owned_slices(1, 1)] == [("b", 20, 30, 36, 0), ("a", 0, 7, 48, 12)]
    # a range cutting across two parameters
    two = BufferLayout.plan([("x", (5,)), ("y", (9,))], dp_size=2, bucket_size=None, shard_align=1,
                            param_align=1)
    assert [(s.name, s.param_start, s.param_end, s.buffer_start, s.shard_start)
            for s in two.owned_slices(0, 1)] == [("y", 2, 9, 7, 0)]
    assert [(s.name, s.param_start, s.param_end, s.shard_start) for s in two.owned_slices(0, 0)] == [
        ("x", 0, 5, 0), ("y", 0, 2, 5)]


def test_plan_single_large_param_gets_its_own_bucket_and_none_means_one_bucket():
    layout = BufferLayout.plan([("s", (3,)), ("big", (100,)), ("t", (2,))], dp_size=1, bucket_size=10,
                               shard_align=1, param_align=1)
    assert [k.param_names for k in layout.buckets] == [("s",), ("big",), ("t",)]
    one = BufferLayout.plan([("s", (3,)), ("big", (100,))], dp_size=3, bucket_size=None, shard_align=128)
    assert len(one.buckets) == 1 and one.numel % (3 * 128) == 0


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError, match="dp_size must be a positive integer, got 0"):
        BufferLayout.plan([("a", (2,))], dp_size=0, bucket_size=4)
    with pytest.raises(ValueError, match="'a' appears twice"):
        BufferLayout.plan([("a", (2,)), ("a", (3,))], dp_size=1, bucket_size=4)
    layout = BufferLayout.plan([("a", (2,))], dp_size=2, bucket_size=4)
    with pytest.raises(ValueError, match="rank must be in"):
        layout.owned_range(0, 2)
    with pytest.raises(ValueError, match="no parameter 'b'"):
        layout.slot("b")


shapes = st.lists(st.lists(st.integers(0, 12), min_size=0, max_size=3).map(tuple), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(shapes=shapes, dp_size=st.integers(1, 7), bucket_size=st.one_of(st.none(), st.integers(1, 200)),
       shard_align=st.sampled_from([1, 3, 8, 128]), param_align=st.sampled_from([1, 4, 64]))
def test_range_plan_every_element_owned_by_exactly_one_rank(shapes, dp_size, bucket_size, shard_align,
                                                             param_align):
    params = [(f"p{i}", s) for i, s in enumerate(shapes)]
    layout = BufferLayout.plan(params, dp_size=dp_size, bucket_size=bucket_size, shard_align=shard_align,
                               param_align=param_align)
    # buckets tile the buffer, each splits evenly and aligned across the ranks
    assert layout.buckets[0].offset == 0 and layout.buckets[-1].end == layout.numel
    for prev, nxt in zip(layout.buckets, layout.buckets[1:], strict=False):
        assert prev.end == nxt.offset
    bucket_owner = [0] * layout.numel
    param_cover = {s.name: [0] * s.numel for s in layout.params}
    for k in layout.buckets:
        assert k.numel == dp_size * k.shard_numel and k.shard_numel % shard_align == 0 and k.numel > 0
        for rank in range(dp_size):
            lo, hi = layout.owned_range(k.index, rank)
            for e in range(k.offset + lo, k.offset + hi):
                bucket_owner[e] += 1
            for piece in layout.owned_slices(k.index, rank):
                slot = layout.slot(piece.name)
                assert slot.bucket == k.index
                assert piece.buffer_start == slot.offset + piece.param_start
                assert piece.shard_start == piece.buffer_start - (k.offset + lo) and 0 <= piece.shard_start
                assert piece.shard_start + piece.numel <= k.shard_numel
                for e in range(piece.param_start, piece.param_end):
                    param_cover[piece.name][e] += 1
    assert all(c == 1 for c in bucket_owner)
    assert all(c == 1 for cover in param_cover.values() for c in cover)
    # params: aligned, inside their bucket, never overlapping, never split; buckets respect bucket_size
    taken = [False] * layout.numel
    for slot in layout.params:
        k = layout.buckets[slot.bucket]
        assert slot.offset % param_align == 0 and k.offset <= slot.offset and slot.end <= k.end
        assert slot.numel == math.prod(slot.shape)
        for e in range(slot.offset, slot.end):
            assert not taken[e]
            taken[e] = True
    for k in layout.buckets:
        members = [layout.slot(n) for n in k.param_names]
        if bucket_size is not None and len(members) > 1:
            assert members[-1].end - k.offset <= bucket_size
    assert [s.name for s in layout.params] == [n for n, _ in params]


def test_whole_plan_example():
    # backward order; dp 2; one bucket: "w1" (40) to shard 0, "w2" (30) and "w3" (8) to shard 1 (largest first,
    # each to the least-filled shard), "w3" after "w2" there (backward order); shards padded to 40
    params = [("w2", (5, 6)), ("w1", (8, 5)), ("w3", (8,))]
    layout = BufferLayout.plan(params, dp_size=2, bucket_size=None, shard_align=4, param_align=1, whole=True)
    assert [(s.name, s.offset, s.bucket) for s in layout.params] == [("w2", 40, 0), ("w1", 0, 0), ("w3", 70, 0)]
    (bucket,) = layout.buckets
    assert (bucket.numel, bucket.shard_numel, bucket.param_names) == (80, 40, ("w1", "w2", "w3"))
    assert layout.holds_whole and [layout.owner_of(n) for n in ("w1", "w2", "w3")] == [0, 1, 1]
    assert [(s.name, s.param_start, s.param_end) for s in layout.owned_slices(0, 1)] == [("w2", 0, 30),
                                                                                          ("w3", 0, 8)]
    # the default layout cuts "w1" across the two shards
    cut = BufferLayout.plan(params, dp_size=2, bucket_size=None, shard_align=4, param_align=1)
    assert not cut.holds_whole and cut.owner_of("w1") is None


def test_whole_plan_closes_a_bucket_once_each_shard_could_hold_its_largest_param():
    # bucket_size 10 alone would make a bucket per matrix, three of four shards padding; a bucket closes at
    # max(bucket_size, dp_size x largest) = 4 x 12 elements
    params = [(f"m{i}", (3, 4)) for i in range(6)]
    layout = BufferLayout.plan(params, dp_size=4, bucket_size=10, shard_align=1, param_align=1, whole=True)
    assert [len(b.param_names) for b in layout.buckets] == [4, 2]
    assert layout.buckets[0].numel == 48 and layout.buckets[0].shard_numel == 12
    # ... before the first parameter that does not fit in the padding: a, b, c (10 | 6 + 6) reach 2 x 10; d (2)
    # fills shard 0 up to 12, what it pads to anyway; e (5) would grow the shards and opens the next bucket
    absorbing = BufferLayout.plan([("a", (10,)), ("b", (6,)), ("c", (6,)), ("d", (2,)), ("e", (5,))], dp_size=2,
                                  bucket_size=1, shard_align=1, param_align=1, whole=True)
    assert [(b.param_names, b.numel) for b in absorbing.buckets] == [(("a", "d", "b", "c"), 24), (("e",), 10)]
    alone = BufferLayout.plan(params[:3], dp_size=2, bucket_size=None, param_align=1, whole=True,
                              bucketing=Bucketing(alone=frozenset({"m1"})))
    assert [b.param_names for b in alone.buckets] == [("m0",), ("m1",), ("m2",)]


@settings(max_examples=150, deadline=None)
@given(shapes=shapes, dp_size=st.integers(1, 7), bucket_size=st.one_of(st.none(), st.integers(1, 200)),
       shard_align=st.sampled_from([1, 3, 8, 128]), param_align=st.sampled_from([1, 4, 64]),
       pad=st.sampled_from(["aligned", "even", "none"]))
def test_whole_plan_puts_every_param_whole_in_one_shard(shapes, dp_size, bucket_size, shard_align, param_align,
                                                        pad):
    params = [(f"p{i}", s) for i, s in enumerate(shapes)]
    layout = BufferLayout.plan(params, dp_size=dp_size, bucket_size=bucket_size, shard_align=shard_align,
                               param_align=param_align, bucketing=Bucketing(pad=pad), whole=True)
    assert layout.holds_whole
    assert [s.name for s in layout.params] == [n for n, _ in params]
    assert layout.buckets[0].offset == 0 and layout.buckets[-1].end == layout.numel
    taken = [False] * layout.numel
    position = {n: i for i, (n, _) in enumerate(params)}
    for k in layout.buckets:
        assert k.numel == dp_size * k.shard_numel and k.shard_numel % param_align == 0 and k.shard_numel > 0
        for rank in range(dp_size):
            owned = layout.owned_slices(k.index, rank)
            # whole parameters, in backward order inside the shard
            assert all(piece.param_start == 0 and piece.param_end == layout.slot(piece.name).numel
                       for piece in owned if layout.slot(piece.name).numel)
            assert [position[p.name] for p in owned] == sorted(position[p.name] for p in owned)
            assert all(layout.owner_of(p.name) == rank for p in owned)
        # shards no larger than needed: the fullest shard, aligned
        loads = [sum(-(-layout.slot(n).numel // param_align) * param_align for n in k.param_names
                     if layout.owner_of(n) == r) for r in range(dp_size)]
        assert k.shard_numel < max(max(loads), 1) + math.lcm(shard_align, param_align) * dp_size
    for slot in layout.params:
        assert slot.offset % param_align == 0
        for e in range(slot.offset, slot.end):
            assert not taken[e]
            taken[e] = True


def test_buffer_makes_params_views_and_keeps_values():
    torch.manual_seed(0)
    lin = nn.Linear(3, 5).to(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in lin.named_parameters()}
    named = list(reversed(list(lin.named_parameters())))
    buf = ParamAndGradBuffer(named, dp_size=2, bucket_size=None, grad_dtype=torch.float32,
                             shard_align=4, param_align=4)
    for n, p in lin.named_parameters():
        assert torch.equal(p, before[n]) and p.untyped_storage().data_ptr() == buf.param_data.data_ptr()
        assert buf.grad_view(p).shape == p.shape and buf.grad_view(p).dtype == torch.float32
    assert buf.key.param_dtype == torch.bfloat16 and buf.key.grad_dtype == torch.float32
    # writing the buffer writes the parameter; padding is zero
    buf.param_data.add_(1)
    assert torch.equal(lin.bias, (before["bias"] + 1))
    # shard views: two equal halves of the bucket
    k = buf.buckets[0]
    assert buf.grad_shard_view(0, 1).data_ptr() == k.grad_data[k.slot.shard_numel:].data_ptr()
    assert buf.param_shard_view(0, 0).numel() == k.slot.shard_numel == k.slot.numel // 2
    with pytest.raises(ValueError, match="is not in this buffer"):
        buf.grad_view(nn.Parameter(torch.zeros(2)))


def test_build_buffers_groups_by_dtype_and_expert_flag():
    a = nn.Parameter(torch.zeros(4))
    b = nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    e = nn.Parameter(torch.zeros(4))
    bufs = build_buffers([("a", a), ("b", b), ("e", e)], dp_size=2, expert_dp_size=1, bucket_size=None,
                         is_expert=lambda p: p is e)
    keys = [(x.key.param_dtype, x.key.is_expert, x.layout.dp_size, x.names) for x in bufs]
    assert keys == [(torch.float32, False, 2, ("a",)), (torch.bfloat16, False, 2, ("b",)),
                    (torch.float32, True, 1, ("e",))]
    with pytest.raises(ValueError, match="one dtype on one device"):
        ParamAndGradBuffer([("a", a), ("b", b)], dp_size=1, bucket_size=None)
    # the chosen parameters get whole-shard buffers of their own
    m, n = nn.Parameter(torch.arange(12.0).view(3, 4)), nn.Parameter(torch.arange(6.0).view(2, 3))
    bufs = build_buffers([("a", a), ("m", m), ("n", n)], dp_size=2, expert_dp_size=1, bucket_size=None,
                         whole=lambda name, p: p.dim() == 2)
    assert [(x.key.whole, x.names, x.layout.holds_whole) for x in bufs] == [(False, ("a",), True),
                                                                          (True, ("m", "n"), True)]
    assert "whole" in repr(bufs[1]) and torch.equal(m, torch.arange(12.0).view(3, 4))  # values kept
    assert m.data_ptr() == bufs[1].param_shard_view(0, 0).data_ptr()  # shard 0 is "m", shard 1 "n"
    assert n.data_ptr() == bufs[1].param_shard_view(0, 1).data_ptr()


def test_whole_shard_packing_by_cost_spreads_the_dear_parameters_over_the_whole_buffer() -> None:
    # four buckets of one dear matrix and three cheap ones of the same size: by elements every bucket starts from
    # empty shards and sends its dear matrix to rank 0; by cost the shards' work carries over the buckets
    params = [(f"{b}.{i}", (128, 128)) for b in range(4) for i in range(4)]
    costs = [1000.0 if name.endswith(".0") else 1.0 for name, _ in params]
    by = {mode: BufferLayout.plan(params, dp_size=4, bucket_size=4 * 16384, whole=True, costs=costs,
                                  bucketing=Bucketing(whole_balance=mode)) for mode in ("elements", "cost")}
    dear = [name for name, _ in params if name.endswith(".0")]
    assert all(len(layout.buckets) == 4 and layout.holds_whole for layout in by.values())
    assert {by["elements"].owner_of(n) for n in dear} == {0}
    assert sorted(by["cost"].owner_of(n) for n in dear) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="costs has 1 entries for 16 parameters"):
        BufferLayout.plan(params, dp_size=4, bucket_size=None, whole=True, costs=[1.0])
    with pytest.raises(ValueError, match="whole_balance"):
        Bucketing(whole_balance="numel")  # type: ignore[arg-type]
