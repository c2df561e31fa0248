"""Chunked rounds without sockets: the chunk-size rule, how groups are cut at chunk
boundaries, and the combine done chunk by chunk as replies land, against the whole-block
combine and the formulas."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.chunking import (MIN_CHUNK, MSG_COST_RATIO, ChunkCosts, choose_chunk_rows, chunk_groups,
                              parse_chunk_rows)
from gateway.dispatch import DispatchPlan
from workers import bf16


@pytest.mark.parametrize("value,expect", [("auto", "auto"), ("AUTO", "auto"), ("off", 0), ("0", 0), ("64", 64),
                                          (0, 0), (128, 128)])
def test_parse_chunk_rows(value, expect):
    assert parse_chunk_rows(value) == expect


@pytest.mark.parametrize("value", ["-1", "many", -3, 1.5, True, None])
def test_parse_chunk_rows_refuses(value):
    with pytest.raises(ValueError, match="chunk rows"):
        parse_chunk_rows(value)


def test_fixed_sizes():
    assert choose_chunk_rows(100, 0, None) == 100  # off: one message
    assert choose_chunk_rows(100, 7, None) == 7
    assert choose_chunk_rows(100, 100, None) == 100
    assert choose_chunk_rows(100, 500, None) == 100
    assert choose_chunk_rows(1, 7, None) == 1
    assert choose_chunk_rows(0, 7, None) == 0


def _costs(msg_s, per_row: dict) -> ChunkCosts:
    c = ChunkCosts()
    c.record_send(msg_s / 2)
    c.record_serve(msg_s / 2)
    for rows, spr in per_row.items():
        c.record_compute(rows, rows * spr)
    return c


def test_auto_needs_measurements():
    assert choose_chunk_rows(1024, "auto", None) == 1024
    assert choose_chunk_rows(1024, "auto", ChunkCosts()) == 1024
    c = ChunkCosts()
    c.record_compute(1024, 0.1)  # a compute rate but no message cost yet
    assert choose_chunk_rows(1024, "auto", c) == 1024


def test_auto_smallest_size_that_pays():
    # 1 ms a row, 50 us a message: 32 rows compute 32 ms >= 20 x 50 us
    assert choose_chunk_rows(1024, "auto", _costs(50e-6, {1024: 1e-3})) == MIN_CHUNK
    # a message as dear as 3 rows of compute: chunks of >= 60 rows -> 64
    assert choose_chunk_rows(1024, "auto", _costs(3e-3, {1024: 1e-3})) == 64
    # never fewer than two chunks
    assert choose_chunk_rows(100, "auto", _costs(3e-3, {100: 1e-3})) == 100  # 64 * 2 > 100


def test_auto_cheap_compute_is_never_chunked():
    # tiny experts: a row computes in 1 us, a message costs 200 us: even half the block
    # (2 ms) is under 20 messages' cost
    assert choose_chunk_rows(4096, "auto", _costs(200e-6, {4096: 1e-6})) == 4096
    assert choose_chunk_rows(4096, "auto", _costs(100e-6, {4096: 1e-6})) == 2048  # just pays


def test_auto_avoids_sizes_measured_slower_per_row():
    # small products measured 30% slower per row (kernel efficiency): 32 and 64 are out
    costs = _costs(1e-6, {1024: 1e-3, 32: 1.3e-3, 64: 1.3e-3, 128: 1.05e-3})
    assert choose_chunk_rows(1024, "auto", costs) == 128
    # and if every smaller size is slower, one message
    costs = _costs(1e-6, {1024: 1e-3, 32: 2e-3, 64: 2e-3, 128: 2e-3, 256: 2e-3, 512: 2e-3})
    assert choose_chunk_rows(1024, "auto", costs) == 1024


def test_costs_decay_toward_new_measurements():
    c = ChunkCosts()
    for _ in range(100):
        c.record_send(1.0)
        c.record_serve(1.0)
    for _ in range(100):
        c.record_send(0.1)
        c.record_serve(0.1)
    assert c.msg_s == pytest.approx(0.2, rel=1e-3)
    c.record_send(-5.0)  # a clock that went backwards is ignored
    assert c.msg_s == pytest.approx(0.2, rel=1e-3)
    assert MSG_COST_RATIO > 1


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(1, 9), min_size=1, max_size=6), size=st.integers(1, 20),
       versioned=st.booleans())
def test_chunk_groups_tile_the_block(counts, size, versioned):
    groups, start = [], 0
    for e, n in enumerate(counts):
        groups.append((e, start, n, 3) if versioned else (e, start, n))
        start += n
    rows = start
    seen = []  # (expert, absolute row) in order, rebuilt from the chunks
    for lo in range(0, rows, size):
        hi = min(lo + size, rows)
        cg = chunk_groups(groups, lo, hi)
        at = 0
        for g in cg:
            assert g[1] == at and g[2] > 0  # rebased, contiguous, tiling the chunk
            assert (len(g) == 4) == versioned and (not versioned or g[3] == 3)
            seen.extend((g[0], lo + g[1] + i) for i in range(g[2]))
            at += g[2]
        assert at == hi - lo
    assert seen == [(g[0], g[1] + i) for g in groups for i in range(g[2])]


def _plan(T=23, k=3, n_workers=3, n_experts=6, seed=0):
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.permutation(n_experts)[:k] for _ in range(T)])
    idx[rng.random(idx.shape) < 0.15] = -1  # dropped slots
    idx[0] = -1  # a token whose every slot was dropped
    wts = rng.random(idx.shape).astype(np.float32)
    return DispatchPlan.build(idx, wts, [e % n_workers for e in range(n_experts)], n_workers), rng


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("size", [1, 4, 7, 1000])
def test_accumulate_chunk_by_chunk_equals_the_whole_combine(dtype, size):
    plan, rng = _plan()
    d = 16
    wire = np.dtype(np.float32) if dtype == "float32" else bf16.wire_dtype("bfloat16")
    outputs = [bf16.from_float32(rng.standard_normal((plan.worker_tokens(w), d)).astype(np.float32))
               if dtype == "bfloat16" else rng.standard_normal((plan.worker_tokens(w), d)).astype(np.float32)
               for w in range(plan.n_workers)]
    whole = plan.combine(outputs, np.empty((plan.num_tokens, d), wire))
    acc = plan.accumulator(d)
    chunks = [(w, lo) for w in range(plan.n_workers) for lo in range(0, plan.worker_tokens(w), size)]
    for i in rng.permutation(len(chunks)):  # in any order replies may land
        w, lo = chunks[i]
        hi = min(lo + size, plan.worker_tokens(w))
        plan.accumulate(w, lo, hi, outputs[w][lo:hi], acc)
    got = plan.finish(acc, np.empty((plan.num_tokens, d), wire))
    assert not np.any(bf16.to_float32(got)[0] if dtype == "bfloat16" else got[0])  # all slots dropped: 0
    if dtype == "float32":
        np.testing.assert_allclose(got, whole, rtol=1e-6, atol=1e-6)
    else:  # both sum in float32 and round once; the order of a token's terms may differ
        np.testing.assert_allclose(bf16.to_float32(got), bf16.to_float32(whole), rtol=1e-2, atol=1e-2)


def test_gather_into_a_range_of_rows():
    plan, rng = _plan()
    x = rng.standard_normal((plan.num_tokens, 5)).astype(np.float32)
    w = 1
    whole = plan.gather(x, w)
    n = plan.worker_tokens(w)
    out = np.empty((n - 3, 5), np.float32)
    plan.gather_into(x, w, out, rows=(2, n - 1))
    np.testing.assert_array_equal(out, whole[2:n - 1])
    with pytest.raises(ValueError, match="outside"):
        plan.gather_into(x, w, out, rows=(2, n + 1))
