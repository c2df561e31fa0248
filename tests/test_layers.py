"""Checkpoint layers in the services, numpy alone (no torch: these also hold where the
[torch] extra is absent): the protocol's layer and bf16 fields, shared-expert placement,
the bf16 combine, and real WorkerDaemons (in threads) behind a multi-layer WorkerPool equal
to the in-process CheckpointMoE, fp32 and bf16, with layers mixed in one dispatch."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from gateway.combine import combine_request
from gateway.dispatch import DispatchPlan
from gateway.layer import load_gateway_layers
from gateway.pool import WorkerPool
from gateway.reference import CheckpointMoE
from gateway.requests import Request
from gateway.router import Router
from gateway.supervisor import placement
from gateway.worker_link import LayerShape, check_layers
from tests.ckpt_helpers import tiny_checkpoint
from workers import bf16
from workers import protocol as P
from workers.daemon import WorkerDaemon
from workers.loading import checkpoint_experts

D = 16
U16 = np.dtype(np.uint16)


# -- protocol --------------------------------------------------------------------------------
def test_forward_names_its_layer_and_bf16():
    x = np.zeros((3, D), np.uint16)  # bf16 bits: the header says bfloat16, not uint16
    h = P.forward_request(1, x.shape, x.dtype, [[0, 0, 3]], layer=5)
    assert h["dtype"] == "bfloat16" and h["layer"] == 5
    assert "layer" not in P.forward_request(1, x.shape, x.dtype, layer=P.DEFAULT_LAYER)  # as before
    b = P.parse_forward(h, [x.nbytes], dtype=U16, d_model=D, max_rows=8, layers={5: [0, 1]}, need_groups=True)
    assert (b.layer, b.rows, b.groups) == (5, 3, [(0, 0, 3, None)])
    with pytest.raises(P.RequestError) as e:
        P.parse_forward(h, [x.nbytes], dtype=U16, d_model=D, max_rows=8, layers={4: [0]})
    assert e.value.code == P.UNKNOWN_LAYER
    with pytest.raises(P.RequestError) as e:  # the layer's own ids, not another layer's
        P.parse_forward(h, [x.nbytes], dtype=U16, d_model=D, max_rows=8, layers={5: [1]}, need_groups=True)
    assert e.value.code == P.UNKNOWN_EXPERT
    with pytest.raises(P.RequestError) as e:  # a float16 gateway does not take bf16
        P.parse_forward(h, [x.nbytes], dtype=np.dtype(np.float16), d_model=D, max_rows=8)
    assert e.value.code == P.BAD_DTYPE


def test_load_and_retire_carry_a_layer_and_a_checkpoint_source():
    h = P.request(P.LOAD, 3, expert=2, layer=7, version=1, checkpoint="ft", fingerprint="ab")
    r = P.parse_load(h, {7: [2]})
    assert (r.layer, r.expert, r.checkpoint, r.fingerprint, r.weights, r.seed) == (7, 2, "ft", "ab", None, None)
    with pytest.raises(P.RequestError, match="exactly one of"):
        P.parse_load({**h, "seed": 1}, {7: [2]})
    assert P.parse_load(P.request(P.LOAD, 3, expert=2, version=1, seed=4), [2]).layer == P.DEFAULT_LAYER
    assert P.parse_retire(P.request(P.RETIRE, 4, expert=2, layer=7, version=1), {7: [2]}) == (2, 1, 7)
    with pytest.raises(P.RequestError) as e:
        P.parse_retire(P.request(P.RETIRE, 4, expert=2, layer=6, version=1), {7: [2]})
    assert e.value.code == P.UNKNOWN_LAYER


def test_entries_carry_a_layer_only_when_it_is_not_the_default():
    assert P.with_layer([3, 1, [1]], 0) == [3, 1, [1]] and P.entry_layer([3, 1, [1]], 3) == 0
    assert P.with_layer([3, 1, [1]], 4) == [3, 1, [1], 4] and P.entry_layer([3, 1, [1], 4], 3) == 4


# -- placement, combine, router -----------------------------------------------------------------
def test_shared_pieces_are_spread_or_replicated_everywhere():
    assert placement(4, 2, 1, n_shared=0) == [[0, 1], [2, 3]]
    assert placement(4, 2, 1, n_shared=3) == [[0, 1, 4, 6], [2, 3, 5]]  # one copy each, spread
    assert placement(4, 3, 2, n_shared=1) == [[0, 1, 3, 4], [0, 1, 2, 4], [2, 3, 4]]  # hot: on every worker


def test_bf16_combine_sums_in_float32_and_rounds_once():
    rng = np.random.default_rng(0)
    T, k = 64, 3
    idx = np.stack([rng.permutation(4)[:k] for _ in range(T)]).astype(np.int32)
    w = rng.random((T, k)).astype(np.float32)
    plan = DispatchPlan.build(idx, w, [0, 0, 1, 1], 2)
    outs = [bf16.from_float32(rng.standard_normal((plan.worker_tokens(i), D)).astype(np.float32))
            for i in range(2)]
    got = plan.combine(outs, np.empty((T, D), np.uint16))
    want = plan.combine([bf16.to_float32(o).astype(np.float64) for o in outs], np.empty((T, D), np.float64))
    # one rounding of a float32 sum: within half a bf16 ulp (2^-8 relative) plus float32 noise
    np.testing.assert_allclose(bf16.to_float32(got), want, rtol=2 ** -8 + 1e-6, atol=1e-30)
    assert got.dtype == np.uint16


def test_router_takes_bf16_as_its_float32_values():
    r = Router(D, 8, 2, seed=3)
    x = bf16.from_float32(np.random.default_rng(1).standard_normal((32, D)).astype(np.float32))
    a, b = r.route(x), r.route(bf16.to_float32(x))
    assert np.array_equal(a.topk_idx, b.topk_idx) and np.array_equal(a.topk_weights, b.topk_weights)


def test_check_layers_says_what_differs():
    shape = LayerShape(D, np.dtype(np.float32), 64, 4, {1: 5, 2: 5}, {1: "a" * 64, 2: "b" * 64})
    ok = {"layers": [[1, [0, 4], "a" * 64]]}
    assert check_layers(ok, shape, "w") == {1: ([0, 4], "a" * 64)}
    cases = [({"layers": [[1, [0], "c" * 64]]}, "do not read the same checkpoint"),
             ({"layers": [[1, [0], None]]}, "serves demo weights"),
             ({"layers": [[3, [0], "a" * 64]]}, "layers [3], which this gateway does not serve"),
             ({"experts": [0, 1]}, "layers [0], which this gateway does not serve")]
    for info, why in cases:
        with pytest.raises(ValueError, match=why.replace("[", r"\[").replace("]", r"\]")):
            check_layers(info, shape, "w")
    demo = LayerShape(D, np.dtype(np.float32), 64, 4)
    with pytest.raises(ValueError, match="start the gateway with --checkpoint"):
        check_layers({"layers": [[0, [0], "a" * 64]]}, demo, "w")


# -- real daemons, in threads -----------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d, _, _ = tiny_checkpoint(str(tmp_path_factory.mktemp("ds")), "deepseek_v3", n_layers=3)
    return d  # DeepSeek-V3 layout: layers 1 and 2 are MoE, 4 routed + 1 shared piece


class Daemons:
    """WorkerDaemons serving ``ids`` of every layer of ``ckpt``, each on a thread."""

    def __init__(self, ckpt: str, placements, wire: str, secret: bytes) -> None:
        self.daemons, self.threads = [], []
        for ids in placements:
            s = checkpoint_experts(ckpt, None, ids, kind="numpy", wire=wire, max_tokens=64)
            d = WorkerDaemon(s.experts, "tcp://127.0.0.1:0", fingerprints=s.fingerprints, checkpoint=s.checkpoint,
                             secret=secret, max_tokens=256)
            t = threading.Thread(target=d.serve, daemon=True)
            t.start()
            self.daemons.append(d)
            self.threads.append(t)

    @property
    def urls(self) -> list:
        return [d.url for d in self.daemons]

    def close(self) -> None:
        for d in self.daemons:
            d.request_stop()
        for t in self.threads:
            t.join(15)
        assert not any(t.is_alive() for t in self.threads)


@pytest.mark.parametrize("chunk_rows", ["auto", 3], ids=["whole", "chunks-3"])
@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_pool_over_daemons_equals_checkpoint_moe(ckpt, wire, chunk_rows, shared_secret):
    """Chunks of 3 rows: a forward's bf16 output is rounded token by token as each token's
    last chunk lands; the mixed-layer requests, dispatched with no output, are rounded once
    all is in."""
    layers = load_gateway_layers(ckpt)
    assert sorted(layers) == [1, 2]
    dt = bf16.wire_dtype(wire)
    ds = Daemons(ckpt, placement(4, 2, 1, 1), wire, shared_secret)
    # each daemon's kernels share one scratch; two daemons (two serve loops) never share one
    assert [len({id(ex.scratch) for ex in d.experts.values()}) for d in ds.daemons] == [1, 1]
    assert len({id(next(iter(d.experts.values())).scratch) for d in ds.daemons}) == 2
    try:
        with WorkerPool(ds.urls, {L: g.router for L, g in layers.items()}, dtype=wire, max_batch_tokens=64,
                        secret=shared_secret, chunk_rows=chunk_rows, fingerprints={L: g.fingerprint for L, g in layers.items()}) as pool:
            rng = np.random.default_rng(5)
            xs = {L: rng.standard_normal((40, D)).astype(np.float32) for L in layers}
            if wire == "bfloat16":
                xs = {L: bf16.from_float32(x, out=np.empty(x.shape, dt)) for L, x in xs.items()}
            refs = {L: CheckpointMoE.from_checkpoint(ckpt, L).forward(xs[L])[0] for L in layers}
            tol = 1e-6 if wire == "float32" else 2 ** -7

            def err(got, want):
                got, want = (bf16.to_float32(a) if bf16.is_bf16(a.dtype) else a for a in (got, want))
                return np.abs(got - want).max() / np.abs(want).max()

            for L in list(layers) * 2:  # one at a time; the second time in sums the first left
                y, _ = pool.forward(xs[L], layer=L)
                assert P.dtype_name(y.dtype) == wire and err(y, refs[L]) <= tol
            # a bf16 forward's float32 sum went back for the next one (a float32 one sums in y)
            assert len(pool.rounds.sums) == (1 if wire == "bfloat16" else 0)
            # layers mixed in one dispatch: one round per layer, each request its own answer
            reqs = [Request(xs[L], layer=L) for L in (2, 1, 2)]
            pool.rounds.dispatch(reqs)
            while not all(r.finished for r in reqs):
                pool.loop.run_once(0.05)
            pool.rounds.take_finished()
            assert len({r.round.id for r in reqs}) == 2 and all(r.error is None for r in reqs)
            for r in reqs:
                out = combine_request(r, np.empty(r.x.shape, dt))
                assert err(out, refs[r.layer]) <= tol
                r.release()
            # every worker hosts its ids in both layers; rows went to layer-keyed experts
            st = pool.stats()
            assert all(sorted(L for L, _ in w["layers"]) == [1, 2] for w in st)
            with pytest.raises(Exception, match="layer 0 is not served"):
                pool.forward(xs[1], layer=0)
        rows = {k: c.tokens for d in ds.daemons for k, c in d.stats.experts.items()}
        assert sorted({L for L, _ in rows}) == [1, 2] and all(n > 0 for n in rows.values())
        assert all(rows[(L, 4)] >= 40 for L in (1, 2))  # the shared piece saw every token
    finally:
        ds.close()


def test_kernels_sharing_scratch_compute_what_they_compute_alone():
    """A worker's kernels share one set of intermediates (workers.kernels.Scratch): the
    outputs are the unshared kernels', and the arena holds one set, not one per kernel."""
    from workers.kernels import Scratch, make_kernel
    rng = np.random.default_rng(2)
    ws = [[rng.standard_normal(s).astype(np.float32) for s in ((24, D), (24, D), (D, 24))] for _ in range(3)]
    arena = Scratch()
    shared = [make_kernel("numpy", *w, max_tokens=32, scratch=arena) for w in ws]
    alone = [make_kernel("numpy", *w, max_tokens=32) for w in ws]
    one_set = arena.nbytes
    assert one_set > 0 and all(not hasattr(k, "_h") for k in shared)
    for wire in (np.float32, U16):
        x = rng.standard_normal((20, D)).astype(np.float32)
        x = bf16.from_float32(x) if wire == U16 else x
        for a, b in zip(shared, alone):
            ya, yb = a.forward(x, np.empty(x.shape, wire)), b.forward(x, np.empty(x.shape, wire))
            assert np.array_equal(ya, yb)
    big = rng.standard_normal((50, D)).astype(np.float32)  # more rows than reserved: grows once
    assert np.array_equal(shared[0].forward(big, np.empty_like(big)), alone[0].forward(big, np.empty_like(big)))
    assert arena.nbytes > one_set


def test_scratch_buffers_are_64_byte_aligned():
    """oneDNN runs ~30% slower into 16-byte-aligned buffers (numpy's large arrays); torch's
    own tensors are 64-byte aligned, and so is the shared scratch."""
    from workers.kernels import Scratch
    s = Scratch()
    for i, n in enumerate((10, 4096, 1 << 20, 3 * (1 << 20) + 7)):
        assert s.raw(("k", i), n).ctypes.data % 64 == 0
    assert s.array("a", (5, 7), np.float32).ctypes.data % 64 == 0
