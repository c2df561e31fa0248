"""workers.kernels: the numpy kernel (numpy alone) and the torch kernel (the [torch] extra)."""
import sys
import tracemalloc

import numpy as np
import pytest

from workers import bf16
from workers import kernels
from workers.kernels import NumpySwiGLU, make_kernel, torch_compute_dtype

D, F = 24, 40


def weights(seed=0, d=D, f=F):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32) for s in ((f, d), (f, d), (d, f))]


def swiglu64(x, wg, wu, wd):
    """The formula, float64, (out, in) weights."""
    x = np.asarray(x, np.float64)
    g, u = x @ wg.T.astype(np.float64), x @ wu.T.astype(np.float64)
    return (g / (1 + np.exp(-g)) * u) @ wd.T.astype(np.float64)


def tokens(n, seed=1):
    return np.random.default_rng(seed).standard_normal((n, D)).astype(np.float32)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / np.abs(b).max()


# -- numpy ---------------------------------------------------------------------------

def test_numpy_kernel_matches_formula():
    w = weights()
    k = make_kernel("numpy", *w, max_tokens=16, threads=None)
    x = tokens(11)
    out = np.empty_like(x)
    assert k.forward(x, out) is out
    assert rel_err(out, swiglu64(x, *w)) < 1e-6
    assert k.describe() == {"kernel": "numpy", "dtype": "float32", "threads": None, "d_model": D, "d_ff": F,
                            "max_tokens": 16}


def test_numpy_kernel_takes_bf16_and_fp16_weights():
    w = weights(2)
    wb = [bf16.from_float32(a) for a in w]  # uint16 bits, as the checkpoint reader returns them
    exact = [bf16.to_float32(a) for a in wb]
    x = tokens(5)
    out = np.empty_like(x)
    make_kernel("numpy", *wb, threads=None).forward(x, out)
    assert rel_err(out, swiglu64(x, *exact)) < 1e-6
    make_kernel("numpy", *(a.astype(np.float16) for a in w), threads=None).forward(x, out)
    assert rel_err(out, swiglu64(x, *(a.astype(np.float16) for a in w))) < 1e-6


def test_numpy_kernel_bf16_activations_in_and_out():
    w = weights(3)
    k = make_kernel("numpy", *w, threads=None)
    xb = bf16.from_float32(tokens(9))  # bf16 on the wire, numpy-only representation
    out = np.empty_like(xb)
    k.forward(xb, out)
    assert out.dtype == np.uint16
    want = swiglu64(bf16.to_float32(xb), *w).astype(np.float32)
    assert rel_err(bf16.to_float32(out), want) < 2 ** -8  # fp32 compute, one bf16 rounding


def test_numpy_kernel_in_place_and_growth():
    w = weights(4)
    k = NumpySwiGLU(*w, max_tokens=4)
    x = tokens(10)
    want = swiglu64(x, *w)
    y = x.copy()
    k.forward(y, y)  # out may be x itself (a worker computes in its receive slot)
    assert rel_err(y, want) < 1e-6 and k.max_tokens == 10


def test_numpy_kernel_does_not_allocate():
    k = make_kernel("numpy", *weights(5), max_tokens=64, threads=None)
    x, out = tokens(64), np.empty((64, D), np.float32)
    xb, outb = bf16.from_float32(x), np.empty((64, D), np.uint16)
    k.forward(x, out)
    k.forward(xb, outb)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(5):
            k.forward(x[:50], out[:50])
            k.forward(xb[:33], outb[:33])
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename") if s.size_diff > 0)
    assert grown < 4096, grown  # bookkeeping only, no array of n x d


@pytest.mark.parametrize("bad, match", [
    (lambda x, o: (x[:, :5], o), r"x must have shape \(n, 24\)"),
    (lambda x, o: (x, o[:3]), "out must have shape"),
    (lambda x, o: (x, np.asfortranarray(o)), "C-contiguous"),
])
def test_kernel_input_checks(bad, match):
    k = make_kernel("numpy", *weights(), threads=None)
    x = tokens(4)
    with pytest.raises(ValueError, match=match):
        k.forward(*bad(x, np.empty_like(x)))
    ro = np.empty_like(x)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        k.forward(x, ro)


def test_make_kernel_validation():
    w = weights()
    with pytest.raises(ValueError, match="unknown kernel kind"):
        make_kernel("cuda", *w)
    with pytest.raises(ValueError, match="activation 'gelu'"):
        make_kernel("numpy", *w, activation="gelu")
    with pytest.raises(ValueError, match="float32 or float64, not bfloat16"):
        make_kernel("numpy", *w, dtype=np.uint16)
    with pytest.raises(ValueError, match="w_down must have shape"):
        make_kernel("numpy", w[0], w[1], w[0])


def test_torch_compute_dtype_follows_the_cpu(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_bf16_matmul", lambda: True)
    assert torch_compute_dtype("bfloat16") == "bfloat16"
    monkeypatch.setattr(kernels, "cpu_bf16_matmul", lambda: False)
    assert torch_compute_dtype("bfloat16") == "float32"
    assert torch_compute_dtype("float32") == "float32"


def test_kernel_bench_runs(tmp_path):
    import argparse
    import json
    from bench import kernel_bench
    p = argparse.ArgumentParser()
    kernel_bench.add_arguments(p)
    out = tmp_path / "k.json"
    args = p.parse_args(["--d-model", "16", "--d-ff", "32", "--tokens", "2,4", "--kernels", "numpy:float32",
                         "--reps", "1", "--min-time", "0.001", "--json", str(out)])
    assert kernel_bench.run(args) == 0
    res = json.loads(out.read_text())["results"]
    assert [(r["kernel"], r["tokens"]) for r in res] == [("numpy", 2), ("numpy", 4)]
    assert all(r["gflops"] > 0 for r in res)


def test_torch_kernel_says_how_to_get_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'moe-transport\[torch\]'.*--compute numpy"):
        make_kernel("torch", *weights(), dtype="bfloat16")


# -- torch ---------------------------------------------------------------------------

@pytest.fixture
def torch():
    from tests.torch_extra import require_torch_extra
    t, _ = require_torch_extra()
    return t


def test_torch_kernel_float32_matches_formula(torch):
    w = weights(6)
    k = make_kernel("torch", *w, dtype="float32", max_tokens=8, threads=1)
    assert torch.get_num_threads() == 1
    x = tokens(20)
    out = np.empty_like(x)
    k.forward(x, out)
    assert rel_err(out, swiglu64(x, *w)) < 1e-5
    d = k.describe()
    assert (d["kernel"], d["dtype"], d["threads"], d["max_tokens"]) == ("torch", "float32", 1, 20)
    assert isinstance(d["cpu_bf16_matmul"], bool)


def test_torch_kernel_bf16_equals_torch_bf16_ffn(torch):
    import ml_dtypes
    w = weights(7)
    wb = [bf16.from_float32(a) for a in w]  # bf16 checkpoint weights, as bits
    k = make_kernel("torch", *wb, dtype="bfloat16", threads=1)
    x = tokens(16).astype(ml_dtypes.bfloat16)
    out = np.empty_like(x)
    k._y.fill_(float("nan"))  # the conversion scratch: must stay untouched when in/out are bf16
    k.forward(x, out)
    assert torch.isnan(k._y).all()
    tw = [torch.from_numpy(a.astype(np.int16)).view(torch.bfloat16) for a in wb]
    tx = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    F_ = torch.nn.functional
    want = F_.linear(F_.silu(F_.linear(tx, tw[0])) * F_.linear(tx, tw[1]), tw[2]).float().numpy()
    got = out.astype(np.float32)
    assert rel_err(got, want) < 2e-2
    # the numpy-only bf16 representation (uint16 bits) gives the same result
    outu = np.empty((16, D), np.uint16)
    k.forward(x.view(np.uint16), outu)
    assert np.array_equal(outu, out.view(np.uint16))


def test_torch_kernel_writes_into_the_callers_memory(torch):
    k = make_kernel("torch", *weights(8), dtype="float32", threads=1)
    slot = np.zeros(4 * 6 * D, np.uint8)  # a transport slot's bytes
    y = np.frombuffer(slot, np.float32).reshape(6, D)
    x = tokens(6)
    x.flags.writeable = False  # a received buffer: read-only, no warning, no copy needed
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        k.forward(x, y)
    assert np.abs(np.frombuffer(slot, np.float32)).sum() > 0
    assert rel_err(y, swiglu64(x, *weights(8))) < 1e-5


def test_torch_kernel_converts_when_wire_and_compute_dtypes_differ(torch):
    w = weights(9)
    k = make_kernel("torch", *w, dtype="bfloat16", threads=1)
    x = tokens(7)
    out = np.empty_like(x)  # float32 on the wire, bf16 compute
    k.forward(x, out)
    assert rel_err(out, swiglu64(x, *w)) < 3e-2
