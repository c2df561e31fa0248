"""Chunked rounds' combine without sockets: sums made chunk by chunk as replies land equal
the whole-block combine, sum buffers are reused, and gathers take ranges of rows."""
from __future__ import annotations

import numpy as np
import pytest

from gateway.dispatch import DispatchPlan, SumBuffers
from workers import bf16


def test_accumulator_sums_into_a_float32_output():
    plan, rng = _plan()
    out = np.full((plan.num_tokens, 4), 7.0, np.float32)
    acc = plan.accumulator(4, into=out)
    assert acc.array is out  # summed in place
    assert not out[0].any() and (out[1:] == 7).all()  # only the token nobody computes is zeroed
    assert not acc.seen.any()
    assert plan.accumulator(4, into=np.empty((plan.num_tokens, 5), np.float32)).array.shape == (plan.num_tokens, 4)
    half = np.empty((plan.num_tokens, 4), bf16.wire_dtype("bfloat16"))
    acc = plan.accumulator(4, into=half)  # a narrow output is summed in float32 and rounded once
    assert acc.array is not half and acc.array.dtype == np.float32


def test_sum_buffers_hand_the_same_memory_back_and_keep_the_largest():
    sums = SumBuffers(keep=2)
    a = sums.take((4, 3))
    assert a.shape == (4, 3) and a.dtype == np.float32 and len(sums) == 0
    sums.give(a)
    b = sums.take((2, 5))  # smaller: the same memory, reshaped
    assert len(sums) == 0 and np.shares_memory(a, b) and b.shape == (2, 5)
    c = sums.take((5, 3))  # none free: a new one
    assert not np.shares_memory(b, c)
    sums.give(b)
    with pytest.raises(RuntimeError, match="twice"):
        sums.give(b)
    sums.give(c)
    big = sums.take((10, 10))  # larger than both: new; given back, it replaces the smallest
    sums.give(big)
    assert len(sums) == 2 and np.shares_memory(sums.take((10, 10)), big) and np.shares_memory(sums.take((5, 3)), c)
    sums.give(np.zeros((4, 3), np.float32))  # a caller's own array (no 1-D base): never kept
    sums.give(np.zeros(12, np.float64)[:6])
    assert len(sums) == 0


def test_a_combine_takes_its_float32_sum_from_sum_buffers_and_gives_it_back():
    plan, rng = _plan()
    d = 8
    ys = [bf16.from_float32(rng.standard_normal((plan.worker_tokens(w), d)).astype(np.float32))
          for w in range(plan.n_workers)]
    want = plan.combine(ys, np.empty((plan.num_tokens, d), np.uint16))
    sums = SumBuffers()
    stale = sums.take((plan.num_tokens, d))
    stale[:] = np.nan  # what the last request left there is never read
    sums.give(stale)
    assert plan.combine(ys, np.empty((plan.num_tokens, d), np.uint16), sums=sums).tobytes() == want.tobytes()
    assert len(sums) == 1
    acc = plan.accumulator(d, into=np.empty((plan.num_tokens, d), np.uint16), sums=sums)
    assert len(sums) == 0 and np.shares_memory(acc.array, stale)
    for w in range(plan.n_workers):
        plan.accumulate(w, 0, plan.worker_tokens(w), ys[w], acc)
    assert plan.finish(acc, np.empty((plan.num_tokens, d), np.uint16)).tobytes() == want.tobytes()
    acc.release()
    acc.release()  # once given back, never again
    assert len(sums) == 1
    own = np.empty((plan.num_tokens, d), np.float32)  # a float32 output is summed in place: not the sums'
    acc = plan.accumulator(d, into=own, sums=sums)
    assert acc.array is own and len(sums) == 1
    acc.release()
    assert len(sums) == 1 and not np.shares_memory(sums.take((plan.num_tokens, d)), own)


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
    acc = plan.accumulator(d, into=np.full((plan.num_tokens, d), np.nan, np.float32))  # none of it read
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
