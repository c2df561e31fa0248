"""gateway/_combine.c against the numpy code it replaces: the combine's bits, whole and in
chunks, the gather's rows, the plan's sort; nothing written when an index is out of range."""
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway import dispatch
from gateway.dispatch import DispatchPlan
from workers import bf16

REQUIRED = os.environ.get("MOE_REQUIRE_NATIVE") == "1"
needs_native = pytest.mark.skipif(not dispatch.NATIVE_COMBINE and not REQUIRED,
                                  reason="gateway/_combine.c is not built here (make deps builds it)")
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_the_compiled_combine_is_built_where_it_is_required():
    if REQUIRED:
        assert dispatch.NATIVE_COMBINE, "gateway/_combine.c was not built (make deps: gcc, python3-dev)"


def random_plan(rng, T, k, E, W, drop):
    idx = np.stack([rng.permutation(E)[:k] for _ in range(T)]) if T else np.zeros((0, k), np.int64)
    if drop and T:
        idx[rng.random(idx.shape) < drop] = -1
    wts = rng.random((T, k)).astype(np.float32)
    assign = np.where(idx >= 0, rng.integers(0, W, idx.shape), -1)
    return DispatchPlan.from_assignment(idx, wts, assign, W, n_experts=E)


def outputs_of(rng, plan, d):
    return [rng.standard_normal((plan.worker_tokens(w), d)).astype(np.float32) for w in range(plan.n_workers)]


def numpy_only(fn, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(dispatch, "_native", None)
        return fn()


def sum_in_chunks(plan, ys, cuts, acc):
    """Each worker's replies into ``acc`` as chunks of the sizes in ``cuts``, in turn."""
    for w in range(plan.n_workers):
        n, lo, i = plan.worker_tokens(w), 0, 0
        while lo < n:
            hi = min(n, lo + cuts[i % len(cuts)])
            plan.accumulate(w, lo, hi, ys[w][lo:hi], acc)
            lo, i = hi, i + 1


def numpys(fn):
    """``fn()`` with the compiled combine switched off, for hypothesis tests (which cannot
    take the function-scoped monkeypatch fixture)."""
    mp = pytest.MonkeyPatch()
    try:
        return numpy_only(fn, mp)
    finally:
        mp.undo()


@needs_native
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), T=st.integers(0, 40), k=st.integers(1, 3), W=st.integers(1, 3),
       d=st.sampled_from([1, 3, 8, 33]), drop=st.sampled_from([0.0, 0.3, 1.0]))
def test_the_compiled_combine_gives_numpys_bits(seed, T, k, W, d, drop):
    rng = np.random.default_rng(seed)
    plan = random_plan(rng, T, k, 5, W, drop)
    ys = outputs_of(rng, plan, d)
    native = plan.combine(ys, np.full((T, d), np.nan, np.float32))
    reference = numpys(lambda: plan.combine(ys, np.full((T, d), np.nan, np.float32)))
    assert native.tobytes() == reference.tobytes()


@needs_native
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), T=st.integers(1, 40), k=st.integers(1, 3), W=st.integers(1, 2),
       cuts=st.lists(st.integers(1, 7), min_size=1, max_size=6))
def test_chunks_summed_as_they_land_give_numpys_bits(seed, T, k, W, cuts):
    rng = np.random.default_rng(seed)
    d = 5
    plan = random_plan(rng, T, k, 4, W, 0.2)
    ys = outputs_of(rng, plan, d)

    def summed():  # into an output full of NaN: no row is read before it is written
        acc = plan.accumulator(d, into=np.full((T, d), np.nan, np.float32))
        sum_in_chunks(plan, ys, cuts, acc)
        return acc.array

    native = summed()
    reference = numpys(summed)
    assert native.tobytes() == reference.tobytes()
    # and the sum in chunks is the combine sent whole
    assert np.allclose(native, plan.combine(ys, np.empty((T, d), np.float32)), rtol=1e-6, atol=1e-6)


@needs_native
@pytest.mark.parametrize("d", [1024, 1020, 1022])
def test_a_combine_of_megabytes_streamed_past_the_cache_gives_numpys_bits(d):
    """A whole part's combine of a megabyte or more writes first contributions with
    non-temporal stores (rows of whole 16 bytes: d 1024 and 1020); d 1022 cannot, and
    writes as before. Both give numpy's bits, and so do the same replies summed in chunks."""
    rng = np.random.default_rng(d)
    plan = random_plan(rng, 700, 2, 8, 2, 0.1)
    ys = outputs_of(rng, plan, d)
    native = plan.combine(ys, np.full((700, d), np.nan, np.float32))
    reference = numpys(lambda: plan.combine(ys, np.full((700, d), np.nan, np.float32)))
    assert native.tobytes() == reference.tobytes()
    acc = plan.accumulator(d, into=np.full((700, d), np.nan, np.float32))
    for w in range(2):
        plan.accumulate(w, 0, plan.worker_tokens(w), ys[w], acc)
    assert acc.array.tobytes() == reference.tobytes()


def bf16_outputs(rng, plan, d, representation):
    """Replies in bf16, as a worker computing in bf16 sends them: uint16 bits or ml_dtypes'
    bfloat16, with a few infinities and NaNs among them."""
    from workers import bf16
    ys = []
    for y in outputs_of(rng, plan, d):
        y[rng.random(y.shape) < 0.01] = np.inf
        y[rng.random(y.shape) < 0.01] = np.nan
        bits = bf16.from_float32(y * 100)
        ys.append(bits if representation == "uint16" else bits.view(bf16.bfloat16_dtype()))
    return ys


REPRESENTATIONS = ["uint16"] + (["ml_dtypes"] if __import__("workers.bf16").bf16.bfloat16_dtype() else [])


@needs_native
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), T=st.integers(0, 40), k=st.integers(1, 3), W=st.integers(1, 3),
       d=st.sampled_from([1, 3, 8, 33]), drop=st.sampled_from([0.0, 0.3, 1.0]),
       representation=st.sampled_from(REPRESENTATIONS), out_dtype=st.sampled_from(["bf16", "float32"]))
def test_bf16_replies_combine_to_numpys_bits(seed, T, k, W, d, drop, representation, out_dtype):
    """bf16 replies widened as each row is read, summed in float32 and (into a bf16 output)
    rounded in one compiled pass: numpy's bits, NaN and infinity included."""
    rng = np.random.default_rng(seed)
    plan = random_plan(rng, T, k, 5, W, drop)
    ys = bf16_outputs(rng, plan, d, representation)
    dtype = ys[0].dtype if out_dtype == "bf16" else np.float32

    def combined():
        # NaN everywhere (0x7FC1: a bf16 NaN's bits): no row of it is read before it is written
        if out_dtype == "bf16":
            return plan.combine(ys, np.full((T, d), 0x7FC1, np.uint16).view(dtype))
        return plan.combine(ys, np.full((T, d), np.nan, np.float32))

    native = combined()
    reference = numpys(combined)
    assert native.dtype == reference.dtype and native.tobytes() == reference.tobytes()


@needs_native
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), T=st.integers(1, 40), k=st.integers(1, 3), W=st.integers(1, 2),
       cuts=st.lists(st.integers(1, 7), min_size=1, max_size=6), representation=st.sampled_from(REPRESENTATIONS))
@example(seed=1, T=35, k=3, W=2, cuts=[1], representation="uint16")  # three contributions, in another order
def test_bf16_chunks_summed_as_they_land_give_numpys_bits(seed, T, k, W, cuts, representation):
    rng = np.random.default_rng(seed)
    d = 5
    plan = random_plan(rng, T, k, 4, W, 0.2)
    ys = bf16_outputs(rng, plan, d, representation)

    def summed():
        acc = plan.accumulator(d)
        sum_in_chunks(plan, ys, cuts, acc)
        return acc.array.copy(), plan.finish(acc, np.zeros((T, d), ys[0].dtype))

    native_sum, native = summed()
    reference_sum, reference = numpys(summed)
    # the float32 sums (rounding to bf16 would hide a last-bit difference in them), then bf16
    assert native_sum.tobytes() == reference_sum.tobytes() and native.tobytes() == reference.tobytes()
    # and the sum in chunks is the combine sent whole (one float32 sum, rounded once)
    assert_is_the_whole_combine(native, plan.combine(ys, np.empty((T, d), ys[0].dtype)), k)


def assert_is_the_whole_combine(chunked: np.ndarray, whole: np.ndarray, k: int) -> None:
    """bf16 outputs summed in chunks against the combine sent whole. Bit for bit while a token
    has at most two contributions (a + b == b + a). With three, the whole combine adds them
    slot by slot and chunks as they land: (a + b) + c against (c + a) + b can differ in
    float32's last bit, which rounding can carry into bf16's (hypothesis found seed=1, T=35,
    k=3, W=2, cuts=[1]): one bf16 step at most."""
    if k <= 2:
        assert chunked.tobytes() == whole.tobytes()
        return
    a, b = bf16.to_float32(chunked), bf16.to_float32(whole)
    same = (bf16.bits(chunked) == bf16.bits(whole)) | (np.isnan(a) & np.isnan(b))  # (which NaN: the order's)
    with np.errstate(invalid="ignore"):
        step = np.spacing(np.maximum(np.abs(a), np.abs(b))) * 2.0 ** 16  # bf16 keeps float32's top 16 bits
        near = np.isfinite(a) & np.isfinite(b) & (np.abs(a - b) <= step)
    assert np.all(same | near)


@needs_native
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), T=st.integers(1, 40), k=st.integers(1, 3), W=st.integers(1, 2),
       cuts=st.lists(st.integers(1, 7), min_size=1, max_size=6), representation=st.sampled_from(REPRESENTATIONS),
       compiled_add=st.booleans())
@example(seed=1, T=35, k=3, W=2, cuts=[1], representation="uint16", compiled_add=False)  # as above
@example(seed=1, T=35, k=3, W=2, cuts=[1], representation="uint16", compiled_add=True)
def test_bf16_tokens_rounded_as_their_last_chunk_lands_give_numpys_bits(seed, T, k, W, cuts, representation,
                                                                        compiled_add):
    """Summed into a bf16 output known up front, each token's sum is rounded into it when its
    last contribution lands, not in a pass after the last chunk: the bits numpy gives by
    summing everything and rounding once; the combine sent whole's too, up to two
    contributions a token (:func:`assert_is_the_whole_combine`). ``compiled_add``
    False: the replies are added by numpy's path, which rounds finished tokens the same way."""
    rng = np.random.default_rng(seed)
    d = 5
    plan = random_plan(rng, T, k, 4, W, 0.2)
    ys = bf16_outputs(rng, plan, d, representation)

    def summed(out):
        acc = plan.accumulator(d, into=out)
        sum_in_chunks(plan, ys, cuts, acc)
        return acc, plan.finish(acc, out)

    def nans():  # no row of it is read, and every row is written
        return np.full((T, d), 0x7FC1, np.uint16).view(ys[0].dtype)

    mp = pytest.MonkeyPatch()
    try:
        if not compiled_add:
            mp.setattr(dispatch, "_native_ok", lambda y, out: False)
        out = nans()
        acc, native = summed(out)
    finally:
        mp.undo()
    assert native is out and acc.fin is not None and not acc.fin.left.any()
    reference = numpys(lambda: summed(np.zeros((T, d), ys[0].dtype))[1])
    assert native.tobytes() == reference.tobytes()
    assert_is_the_whole_combine(native, plan.combine(ys, np.empty((T, d), ys[0].dtype)), k)
    # finished into another output than the one it was rounded into: the same bits, copied
    assert plan.finish(acc, nans()).tobytes() == reference.tobytes()


@needs_native
def test_a_bf16_sum_finished_before_its_last_chunk_is_refused():
    rng = np.random.default_rng(5)
    plan = random_plan(rng, 30, 2, 4, 2, 0.0)
    ys = bf16_outputs(rng, plan, 4, "uint16")
    out = np.zeros((30, 4), np.uint16)
    acc = plan.accumulator(4, into=out)
    plan.accumulate(0, 0, plan.worker_tokens(0), ys[0], acc)
    with pytest.raises(RuntimeError, match="still await"):
        plan.finish(acc, out)


@needs_native
def test_finishing_a_token_rounds_its_sum_into_fin_and_refuses_miscounts_writing_nothing():
    from gateway import _combine
    out = np.zeros((3, 2), np.float32)
    fin = np.zeros((3, 2), np.uint16)
    seen = np.zeros(3, np.uint8)
    left = np.array([2, 1, 0], np.uint8)
    y = np.float32([[1.0, 2.0], [3.0, 1.0 + 3 * 2.0 ** -9]])  # the last: past halfway to 1 + 2^-7
    w = np.float32([1, 1])
    rows, toks = np.array([0, 1], np.int64), np.array([0, 1], np.int64)
    _combine.scatter(out, y, rows, toks, w, 0, seen, left, fin)
    assert left.tolist() == [1, 0, 0] and seen.tolist() == [1, 1, 0]
    assert out.tolist() == [[1, 2], [0, 0]] + [[0, 0]]  # token 1 finished: its sum row untouched
    assert fin[1].tolist() == [0x4040, 0x3F81] and not fin[0].any()  # 3.0, and 1 + 2^-7
    _combine.scatter(out, y, np.array([1], np.int64), np.array([0], np.int64), np.float32([2]), 0, seen, left, fin)
    assert left.tolist() == [0, 0, 0] and fin[0].tolist() == [0x40E0, 0x4080]  # 1 + 2 * 3, 2 + 2 * 1.006 to 4
    before = [a.copy() for a in (out, fin, seen)]
    left[:] = [1, 1, 0]
    for named, why in (([0, 2], "awaits no contribution"), ([1, 1], "twice")):
        with pytest.raises(ValueError, match=why):
            _combine.scatter(out, y, rows, np.array(named, np.int64), w, 0, seen, left, fin)
        assert left.tolist() == [1, 1, 0]  # the counts as they were
        assert all((a == b).all() for a, b in zip((out, fin, seen), before))
    for bad_left, bad_fin in ((np.zeros(2, np.uint8), fin), (left, np.zeros((3, 3), np.uint16)),
                              (left, np.zeros((3, 2), np.float32))):
        with pytest.raises(ValueError, match="left must hold"):
            _combine.scatter(out, y, rows, toks, w, 0, seen, bad_left, bad_fin)
    with pytest.raises(TypeError):
        _combine.scatter(out, y, rows, toks, w, 0, seen, left)


@needs_native
def test_a_bf16_combine_of_megabytes_streamed_past_the_cache_gives_numpys_bits():
    """First contributions of a megabyte or more are widened and streamed four lanes at a
    time: numpy's bits."""
    rng = np.random.default_rng(3)
    plan = random_plan(rng, 700, 2, 8, 2, 0.1)
    ys = bf16_outputs(rng, plan, 1024, "uint16")
    native = plan.combine(ys, np.empty((700, 1024), np.uint16))
    reference = numpys(lambda: plan.combine(ys, np.empty((700, 1024), np.uint16)))
    assert native.tobytes() == reference.tobytes()


@needs_native
@SETTINGS
@given(words=st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=64),
       special=st.sampled_from([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001,
                                0xFFFFFFFF, 0x7F7FFFFF, 0x3F808000, 0x3F818000, 0x00008000, 0x7F7F8000]))
def test_the_compiled_bf16_rounding_gives_from_float32s_bits(words, special):
    """Random float32 bit patterns beside one special each time (ties rounding both ways to
    even, the largest finite value that rounds to infinity, a subnormal tie, signalling and
    quiet NaNs, infinities, zeros): the same bf16 bits as workers/bf16.py's six numpy passes."""
    from workers import bf16
    a = np.array(words + [special], np.uint32).view(np.float32)
    got = np.full(a.size, 0xABCD, np.uint16)
    dispatch._native.to_bf16(got, a)
    with np.errstate(invalid="ignore"):
        want = bf16.from_float32(a)
    assert got.tobytes() == want.tobytes()


@needs_native
def test_the_compiled_bf16_rounding_refuses_arrays_of_the_wrong_kind():
    a = np.ones(4, np.float32)
    for out, src in ((np.zeros(4, np.int16), a), (np.zeros(3, np.uint16), a), (np.zeros(4, np.uint16), a[::2]),
                     (np.zeros(4, np.uint16), a.astype(np.float64)), (np.zeros(8, np.uint8), a)):
        with pytest.raises((ValueError, BufferError)):
            dispatch._native.to_bf16(out, src)
    ro = np.zeros(4, np.uint16)
    ro.flags.writeable = False
    with pytest.raises((ValueError, BufferError)):
        dispatch._native.to_bf16(ro, a)
    assert not ro.any()
    with pytest.raises(TypeError):
        dispatch._native.to_bf16(np.zeros(4, np.uint16))


@needs_native
def test_an_index_out_of_range_writes_nothing():
    from gateway import _combine
    out = np.zeros((4, 3), np.float32)
    y = np.ones((2, 3), np.float32)
    w = np.ones(2, np.float32)
    for rows, toks, row0 in (([0, 2], [0, 1], 0),  # row 2 of 2
                             ([0, 1], [0, 4], 0),  # token 4 of 4
                             ([0, 1], [-1, 0], 0),
                             ([5, 6], [0, 1], 6)):  # row 5 below row0
        with pytest.raises(ValueError, match="entry"):
            _combine.scatter(out, y, np.array(rows, np.int64), np.array(toks, np.int64), w, row0, False)
        assert not out.any()
    _combine.scatter(out, y, np.array([5, 6], np.int64), np.array([3, 1], np.int64), np.float32([2, 3]), 5, True)
    assert out.tolist() == [[0] * 3, [3] * 3, [0] * 3, [2] * 3]
    # with a token's flags: the out-of-range check comes before any flag or row is written
    seen = np.zeros(4, np.uint8)
    with pytest.raises(ValueError, match="entry 1"):
        _combine.scatter(out, y, np.array([0, 1], np.int64), np.array([0, 9], np.int64), w, 0, seen)
    assert not seen.any() and out.tolist() == [[0] * 3, [3] * 3, [0] * 3, [2] * 3]
    seen[1] = 1
    _combine.scatter(out, y, np.array([0, 1], np.int64), np.array([0, 1], np.int64), np.float32([5, 7]), 0, seen)
    assert seen.tolist() == [1, 1, 0, 0]
    assert out.tolist() == [[5] * 3, [10] * 3, [0] * 3, [2] * 3]  # token 0 written, token 1 added to


@needs_native
def test_arrays_of_the_wrong_kind_are_refused():
    from gateway import _combine
    out = np.zeros((4, 3), np.float32)
    y = np.ones((2, 3), np.float32)
    r, t, w = np.array([0, 1], np.int64), np.array([0, 1], np.int64), np.ones(2, np.float32)
    bad = [
        (out.astype(np.float64), y, r, t, w),  # float64 out
        (out, y.astype(np.float16), r, t, w),
        (out, np.ones((2, 4), np.float32), r, t, w),  # columns differ
        (out, y, r.astype(np.int32), t, w),
        (out, y, r, t[:1], w),  # fewer tokens than rows
        (out, y, r, t, np.ones(3, np.float32)),
        (out[:, ::2], np.ones((2, 2), np.float32), r, t, w),  # not contiguous
        (out.ravel(), y, r, t, w),  # 1-D
    ]
    for args in bad:
        with pytest.raises((ValueError, BufferError)):
            _combine.scatter(*args, 0, False)
    ro = np.zeros((4, 3), np.float32)
    ro.flags.writeable = False
    with pytest.raises((ValueError, BufferError)):
        _combine.scatter(ro, y, r, t, w, 0, False)
    with pytest.raises(TypeError):
        _combine.scatter(out, y, r, t, w, 0)
    for flags in (np.zeros(3, np.uint8), np.zeros(4, np.int64), np.zeros(4, np.uint8)[::-1]):
        with pytest.raises((ValueError, BufferError)):  # not one contiguous byte per token
            _combine.scatter(out, y, r, t, w, 0, flags)
    ro = np.zeros(4, np.uint8)
    ro.flags.writeable = False
    with pytest.raises((ValueError, BufferError)):
        _combine.scatter(out, y, r, t, w, 0, ro)
    assert not out.any()


@needs_native
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), T=st.integers(1, 300), rows=st.integers(0, 600),
       d=st.sampled_from([1, 3, 4, 8, 100, 256, 1024]), dtype=st.sampled_from(["float32", "uint16", "float64"]),
       offset=st.sampled_from([0, 1]))
def test_the_compiled_gather_copies_numpys_take(seed, T, rows, d, dtype, offset):
    """Row by row (small), with non-temporal stores (a megabyte or more, rows of 16-byte
    multiples, out aligned) or not (out one item off its alignment, odd rows): np.take's bytes."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((T, d)) * 1000).astype(dtype)
    idx = rng.integers(0, T, rows).astype(np.int64)
    buf = np.zeros(rows * d + offset, dtype)
    out = buf[offset:].reshape(rows, d)
    dispatch._native.gather(out, x, idx)
    np.testing.assert_array_equal(out, np.take(x, idx, axis=0))


@needs_native
def test_a_gather_of_megabytes_with_non_temporal_stores_copies_every_row():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4096, 1024)).astype(np.float32)
    idx = rng.integers(0, 4096, 8192).astype(np.int64)  # 32 MiB
    for out in (np.empty((8192, 1024), np.float32), np.empty(8192 * 1024 + 1, np.float32)[1:].reshape(8192, 1024)):
        dispatch._native.gather(out, x, idx)
        np.testing.assert_array_equal(out, x[idx])


@needs_native
def test_a_gather_index_out_of_range_or_a_mismatch_writes_nothing():
    x = np.arange(40, dtype=np.float32).reshape(10, 4)
    out = np.full((3, 4), -1.0, np.float32)
    for idx in ([0, 10, 1], [0, -1, 2]):
        with pytest.raises(ValueError, match="row"):
            dispatch._native.gather(out, x, np.array(idx, np.int64))
        assert (out == -1).all()
    for bad_out, bad_idx in ((np.empty((3, 5), np.float32), [0, 1, 2]), (np.empty((3, 4), np.float64), [0, 1, 2]),
                             (out, [0, 1]), (out, np.array([0, 1, 2], np.int32))):
        with pytest.raises(ValueError):
            dispatch._native.gather(bad_out, x, np.asarray(bad_idx))
    with pytest.raises(TypeError):
        dispatch._native.gather(out, x)


def test_gather_into_gives_numpys_rows_with_or_without_the_compiled_gather(monkeypatch):
    rng = np.random.default_rng(1)
    plan = random_plan(rng, 500, 2, 8, 3, drop=0.1)
    x = rng.standard_normal((500, 64)).astype(np.float32)
    for w in range(3):
        n = plan.worker_tokens(w)
        got = plan.gather_into(x, w, np.empty((n, 64), np.float32))
        want = numpy_only(lambda: plan.gather_into(x, w, np.empty((n, 64), np.float32)), monkeypatch)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got, x[plan.token_indices(w)])


def plan_arrays(plan: DispatchPlan) -> list:
    return ([plan._tokens, plan._slots, plan._weights, plan._offsets, plan.expert_counts]
            + [plan.groups(w) for w in range(plan.n_workers)])


@needs_native
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), T=st.integers(0, 60), k=st.integers(1, 4), W=st.integers(1, 4),
       E=st.integers(4, 9), drop=st.sampled_from([0.0, 0.3, 1.0]),
       dtypes=st.sampled_from([(np.int64, np.float32), (np.int32, np.float64), (np.int16, np.float32)]))
def test_the_compiled_plan_sort_gives_numpys_plan(seed, T, k, W, E, drop, dtypes):
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.permutation(E)[:k] for _ in range(T)]) if T else np.zeros((0, k), np.int64)
    if drop and T:
        idx[rng.random(idx.shape) < drop] = -1
    idx = idx.astype(dtypes[0])
    wts = rng.random((T, k)).astype(dtypes[1])
    assign = np.where(idx >= 0, rng.integers(0, W, idx.shape), -1).astype(dtypes[0])
    native = DispatchPlan.from_assignment(idx, wts, assign, W, n_experts=E)
    reference = numpys(lambda: DispatchPlan.from_assignment(idx, wts, assign, W, n_experts=E))
    for a, b in zip(plan_arrays(native), plan_arrays(reference), strict=True):
        if isinstance(a, list):
            assert a == b
        else:
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    # the plans behave the same: one gather and combine through each
    x = rng.standard_normal((T, 8)).astype(np.float32)
    assert all(np.array_equal(native.gather(x, w), reference.gather(x, w)) for w in range(W))


@needs_native
def test_the_compiled_plan_sort_refuses_what_it_cannot_place_and_writes_nothing():
    idx = np.array([[0, 1], [2, 7]], np.int64)
    assign = np.zeros_like(idx)
    wts = np.ones((2, 2), np.float32)
    with pytest.raises(ValueError, match="out of range"):
        DispatchPlan.from_assignment(idx, wts, assign, 1, n_experts=4)  # expert 7 of 4
    with pytest.raises(ValueError, match="out of range"):
        DispatchPlan.from_assignment(idx.clip(0, 3), wts, assign + 1, 1, n_experts=4)  # worker 1 of 1
    outs = [np.full(4, -5, np.int64) for _ in range(2)]
    weights, counts = np.full(4, -5, np.float32), np.full(4, -5, np.int64)
    args = (idx.reshape(-1), assign.reshape(-1), wts.reshape(-1), 2, 1, 4, *outs, weights, counts)
    with pytest.raises(ValueError, match="out of range"):
        dispatch._native.sort_plan(*args)
    assert all((o == -5).all() for o in outs) and (weights == -5).all() and (counts == -5).all()
    with pytest.raises(ValueError, match="multiple of k"):
        dispatch._native.sort_plan(idx.reshape(-1)[:3], assign.reshape(-1)[:3], wts.reshape(-1)[:3], 2, 1, 4,
                                   *outs, weights, counts)
    with pytest.raises(ValueError, match="counts"):
        dispatch._native.sort_plan(idx.reshape(-1).clip(0, 3), assign.reshape(-1), wts.reshape(-1), 2, 1, 4,
                                   *outs, weights, counts[:3])
    with pytest.raises(ValueError, match="tokens"):
        dispatch._native.sort_plan(idx.reshape(-1).clip(0, 3), assign.reshape(-1), wts.reshape(-1), 2, 1, 4,
                                   outs[0][:3], outs[1], weights, counts)
    n = dispatch._native.sort_plan(idx.reshape(-1).clip(0, 3), assign.reshape(-1), wts.reshape(-1), 2, 1, 4,
                                   *outs, weights, counts)
    assert n == 4 and counts.tolist() == [1, 1, 1, 1] and outs[0].tolist() == [0, 0, 1, 1]
