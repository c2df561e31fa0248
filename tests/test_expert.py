import subprocess
import sys
import tracemalloc
import warnings

import numpy as np
import pytest

from workers.expert import SwiGLUExpert, npz_expert_ids

D, F = 32, 64


def plain_swiglu(x, e):
    x = x.astype(np.float64)
    g = x @ e.w_gate.astype(np.float64)
    u = x @ e.w_up.astype(np.float64)
    with np.errstate(over="ignore"):  # exp(-g) -> inf is the right limit
        return ((g / (1 + np.exp(-g))) * u) @ e.w_down.astype(np.float64)


@pytest.fixture
def x():
    return np.random.default_rng(123).standard_normal((20, D)).astype(np.float32)


def test_forward_matches_plain_formula(x):
    e = SwiGLUExpert.from_seed(3, D, F, seed=7)
    out = np.empty_like(x)
    y = e.forward(x, out)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, plain_swiglu(x, e), rtol=1e-4, atol=1e-5)


def test_forward_float64(x):
    e = SwiGLUExpert.from_seed(3, D, F, seed=7, dtype=np.float64)
    x64 = x.astype(np.float64)
    y = e.forward(x64, np.empty_like(x64))
    np.testing.assert_allclose(y, plain_swiglu(x64, e), rtol=1e-12, atol=1e-12)
    e32 = SwiGLUExpert.from_seed(3, D, F, seed=7)
    np.testing.assert_allclose(e.w_up, e32.w_up, rtol=1e-6)


def test_forward_writes_into_out_view_of_a_buffer(x):
    e = SwiGLUExpert.from_seed(0, D, F)
    slot = bytearray(x.nbytes + 64)  # stands in for a transport slot
    out = np.frombuffer(slot, dtype=np.float32, count=x.size, offset=64).reshape(x.shape)
    y = e.forward(x, out)
    assert y is out
    assert np.shares_memory(y, out)
    got = np.frombuffer(bytes(slot), dtype=np.float32, count=x.size, offset=64).reshape(x.shape)
    np.testing.assert_array_equal(got, y)
    np.testing.assert_allclose(got, plain_swiglu(x, e), rtol=1e-4, atol=1e-5)


def test_forward_in_place(x):
    e = SwiGLUExpert.from_seed(0, D, F)
    want = plain_swiglu(x, e)
    buf = x.copy()
    assert e.forward(buf, buf) is buf
    np.testing.assert_allclose(buf, want, rtol=1e-4, atol=1e-5)


def test_forward_into_strided_out(x):
    e = SwiGLUExpert.from_seed(0, D, F)
    big = np.zeros((x.shape[0], 2 * D), dtype=np.float32)
    out = big[:, :D]
    assert e.forward(x, out) is out
    np.testing.assert_allclose(big[:, :D], plain_swiglu(x, e), rtol=1e-4, atol=1e-5)
    assert not big[:, D:].any()


def test_steady_state_does_not_allocate():
    d, f, n = 128, 256, 64
    e = SwiGLUExpert.from_seed(1, d, f, max_tokens=n)
    x = np.random.default_rng(0).standard_normal((n, d)).astype(np.float32)
    out = np.empty_like(x)
    scratch = (e._h_gate, e._h_up)
    e.forward(x, out)  # warm up (BLAS may set itself up once)
    tracemalloc.start()
    try:
        for _ in range(3):
            e.forward(x, out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # One (n, d_ff) float32 intermediate would be 64 KiB; allow only small change.
    assert peak < 8 * 1024, peak
    assert (e._h_gate, e._h_up) == scratch  # the very same buffers


def test_scratch_grows_only_when_exceeded():
    e = SwiGLUExpert.from_seed(1, D, F, max_tokens=8)
    before = e._h_gate
    x = np.ones((8, D), np.float32)
    e.forward(x, np.empty_like(x))
    assert e._h_gate is before
    x = np.random.default_rng(1).standard_normal((30, D)).astype(np.float32)
    y = e.forward(x, np.empty_like(x))
    assert e.max_tokens == 30 and e._h_gate is not before
    np.testing.assert_allclose(y, plain_swiglu(x, e), rtol=1e-4, atol=1e-5)
    small = x[:5]
    np.testing.assert_allclose(e.forward(small, np.empty_like(small)), plain_swiglu(small, e),
                               rtol=1e-4, atol=1e-5)


def test_zero_tokens():
    e = SwiGLUExpert.from_seed(1, D, F)
    x = np.empty((0, D), np.float32)
    out = np.empty((0, D), np.float32)
    assert e.forward(x, out) is out


def test_extreme_preactivations_stay_finite():
    e = SwiGLUExpert.from_seed(2, D, F)
    x = np.random.default_rng(5).standard_normal((4, D)).astype(np.float32) * 1e3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = e.forward(x, np.empty_like(x))
    assert np.all(np.isfinite(y))
    np.testing.assert_allclose(y, plain_swiglu(x, e), rtol=1e-3, atol=1e-2)


def test_output_scale_is_order_one():
    d, f = 256, 512
    e = SwiGLUExpert.from_seed(0, d, f)
    x = np.random.default_rng(0).standard_normal((64, d)).astype(np.float32)
    std = float(e(x).std())
    assert 0.1 < std < 3.0, std


def test_same_seed_same_weights_different_ids_differ():
    a = SwiGLUExpert.from_seed(5, D, F, seed=11)
    b = SwiGLUExpert.from_seed(5, D, F, seed=11)
    for k in ("w_gate", "w_up", "w_down"):
        np.testing.assert_array_equal(getattr(a, k), getattr(b, k))
    assert not np.array_equal(a.w_gate, SwiGLUExpert.from_seed(6, D, F, seed=11).w_gate)
    assert not np.array_equal(a.w_gate, SwiGLUExpert.from_seed(5, D, F, seed=12).w_gate)
    assert not np.array_equal(a.w_gate, a.w_up)


def test_same_seed_same_weights_in_another_process():
    e = SwiGLUExpert.from_seed(4, D, F, seed=9)
    code = ("import sys; from workers.expert import SwiGLUExpert as S;"
            f"e = S.from_seed(4, {D}, {F}, seed=9);"
            "sys.stdout.buffer.write(e.w_gate.tobytes() + e.w_up.tobytes() + e.w_down.tobytes())")
    raw = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True).stdout
    assert raw == e.w_gate.tobytes() + e.w_up.tobytes() + e.w_down.tobytes()


def test_npz_round_trip_several_experts(tmp_path, x):
    path = tmp_path / "experts.npz"
    es = [SwiGLUExpert.from_seed(i, D, F, seed=3) for i in (0, 2, 5)]
    es[1].version = 7
    SwiGLUExpert.save_many(path, es)
    assert npz_expert_ids(path) == [0, 2, 5]
    back = SwiGLUExpert.from_npz(path, 2)
    assert back.expert_id == 2 and back.version == 7 and back.dtype == np.float32
    for k in ("w_gate", "w_up", "w_down"):
        np.testing.assert_array_equal(getattr(back, k), getattr(es[1], k))
    np.testing.assert_array_equal(back(x), es[1](x))
    with pytest.raises(ValueError, match="no expert 3"):
        SwiGLUExpert.from_npz(path, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["experts.npz"]  # no temp file left


def test_save_npz_single(tmp_path):
    e = SwiGLUExpert.from_seed(9, D, F, version=3)
    p = tmp_path / "one.npz"
    e.save_npz(p)
    back = SwiGLUExpert.from_npz(p, 9)
    assert back.version == 3
    np.testing.assert_array_equal(back.w_down, e.w_down)
    with pytest.raises(ValueError, match="twice"):
        SwiGLUExpert.save_many(p, [e, e])


def test_nbytes():
    e = SwiGLUExpert.from_seed(0, D, F)
    assert e.nbytes == 3 * D * F * 4
    assert SwiGLUExpert.from_seed(0, D, F, dtype=np.float64).nbytes == 3 * D * F * 8


def test_validation_errors(x):
    e = SwiGLUExpert.from_seed(0, D, F)
    out = np.empty_like(x)
    with pytest.raises(ValueError, match="x must have shape"):
        e.forward(x[:, :-1], out)
    with pytest.raises(ValueError, match="out must have shape"):
        e.forward(x, out[:-1])
    with pytest.raises(ValueError, match="float32"):
        e.forward(x.astype(np.float64), out)
    with pytest.raises(ValueError, match="float32"):
        e.forward(x, out.astype(np.float64))
    ro = np.empty_like(x)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        e.forward(x, ro)
    with pytest.raises(ValueError, match="w_up"):
        SwiGLUExpert(e.w_gate, e.w_up.T, e.w_down)
    with pytest.raises(ValueError, match="w_down"):
        SwiGLUExpert(e.w_gate, e.w_up, e.w_gate)
    with pytest.raises(ValueError, match="floating"):
        SwiGLUExpert.from_seed(0, D, F, dtype=np.int32)


def test_silu_times_up_in_place_has_the_right_limits():
    """The numpy kernels' activation, shared by the demo expert and the checkpoint kernel:
    silu(g) * u with no temporary; very negative g gives 0 (exp(-g) overflows to inf), very
    positive g gives g * u, and no warning or nan on the way."""
    from workers.expert import silu_mul_
    g = np.array([-1e4, -50.0, -1.0, 0.0, 1.0, 50.0, 1e4], dtype=np.float32)
    u = np.array([3.0, 3.0, 2.0, 5.0, 2.0, 3.0, 3.0], dtype=np.float32)
    want = (g.astype(np.float64) / (1 + np.exp(-np.clip(g.astype(np.float64), -700, 700)))) * u
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = silu_mul_(g.copy(), u)
    assert got is u and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)
    assert got[0] == 0.0 and got[-1] == pytest.approx(3e4)
