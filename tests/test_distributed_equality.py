"""The distributed MoE layer (real worker processes, a real gateway process, the real
transport) equals the in-process ReferenceMoE within float32 tolerance, on tcp and shm:
uniform and skewed routing, top-1/2/4, replicas, capacity overflow with drop and spill.

Workers start once per backend and are shared by every configuration (a gateway per
configuration, started on first use). shm cases FAIL while transport.shm does not import.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from gateway.client import GatewayClient
from gateway.pool import WorkerPool
from gateway.reference import ReferenceMoE
from gateway.router import Router
from tests.helpers_procs import BACKENDS, Services, backend_problem
from workers.expert import SwiGLUExpert

D, F, E, SEED = 24, 40, 8, 5
MAX_BATCH = 96
TOL = dict(rtol=1e-4, atol=2e-5)
# w2 holds replicas of experts 0 and 4 (the hot ones below), so replicas serve real load
LAYOUT = ([0, 1, 2, 3], [4, 5, 6, 7], [0, 4])

pytestmark = pytest.mark.timeout(180)


def zipf_bias(hot: int, s: float = 1.5) -> np.ndarray:
    """Zipf-like gate bias: expert ``hot`` first, the others falling off as -s*log(rank)."""
    ranks = (np.arange(E) - hot) % E
    return (-s * np.log1p(ranks)).astype(np.float32)


def one_hot_bias(hot: int, b: float = 4.0) -> np.ndarray:
    bias = np.zeros(E, np.float32)
    bias[hot] = b
    return bias


# name -> Router keywords (top_k included)
CONFIGS = {
    "top1": dict(top_k=1),
    "top2": dict(top_k=2),
    "top4": dict(top_k=4),
    "top2-zipf-replicated-hot": dict(top_k=2, bias=zipf_bias(0)),
    "top2-one-hot-unreplicated": dict(top_k=2, bias=one_hot_bias(5)),
    "top2-one-hot-replicated": dict(top_k=2, bias=one_hot_bias(0)),
    "top1-zipf-hot-replica": dict(top_k=1, bias=zipf_bias(4)),
    "top2-capacity-drop": dict(top_k=2, capacity_factor=0.5, overflow="drop"),
    "top2-capacity-spill": dict(top_k=2, capacity_factor=0.5, overflow="spill"),
    "top4-skewed-capacity-spill": dict(top_k=4, capacity_factor=0.75, overflow="spill", bias=zipf_bias(0)),
    "top1-skewed-capacity-drop": dict(top_k=1, capacity_factor=0.8, overflow="drop", bias=one_hot_bias(4)),
}


def reference_for(config: dict) -> ReferenceMoE:
    kw = dict(config)
    router = Router(D, E, kw.pop("top_k"), seed=SEED, **kw)
    experts = [SwiGLUExpert.from_seed(e, D, F, seed=SEED) for e in range(E)]
    return ReferenceMoE(router, experts)


def gateway_flags(config: dict) -> dict:
    kw = dict(config)
    flags = dict(top_k=kw.pop("top_k"), capacity_factor=kw.pop("capacity_factor", None),
                 overflow=kw.pop("overflow", None), gate_bias=kw.pop("bias", None))
    assert not kw, f"no gateway flag for {sorted(kw)}"
    return flags


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, D)).astype(np.float32)


class Backend:
    """The workers of one backend, and a gateway per configuration (lazily)."""

    def __init__(self, services: Services, backend: str):
        self.services, self.backend = services, backend
        self.workers = [services.worker(backend, ex, d_model=D, d_ff=F, seed=SEED, max_tokens=MAX_BATCH * 4)
                        for ex in LAYOUT]
        self.gateways: dict = {}

    @property
    def urls(self) -> list:
        return [w.url for w in self.workers]

    def gateway(self, name: str, chunk_rows: str = "auto"):
        if (name, chunk_rows) not in self.gateways:
            self.gateways[(name, chunk_rows)] = self.services.gateway(
                self.backend, workers=self.urls, d_model=D, d_ff=F, n_experts=E, seed=SEED,
                max_batch_tokens=MAX_BATCH, max_wait_ms=20, chunk_rows=chunk_rows, **gateway_flags(CONFIGS[name]))
        return self.gateways[(name, chunk_rows)]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    problem = backend_problem(request.param)
    if problem:
        yield problem
        return
    with Services() as services:
        yield Backend(services, request.param)


def _backend(b) -> Backend:
    if isinstance(b, str):
        pytest.fail(b)
    return b


# "auto" is the default, and with these tiny experts it sends each part whole (a chunk would
# cost more than its compute); 7 rows cuts every part into chunks (expert groups and
# requests split across them), so outputs are checked with pipelined rounds too
CHUNKS = ["auto", "7"]


@pytest.mark.parametrize("chunk_rows", CHUNKS, ids=["whole", "chunks-7"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gateway_equals_reference(backend, name, chunk_rows):
    b = _backend(backend)
    ref = reference_for(CONFIGS[name])
    gw = b.gateway(name, chunk_rows)
    with GatewayClient(gw.url, timeout=20.0) as client:
        for n, seed in ((1, 1), (17, 2), (MAX_BATCH, 3)):
            x = tokens(n, seed)
            y_ref, routing = ref.forward(x)
            np.testing.assert_allclose(client.forward(x), y_ref, **TOL, err_msg=f"{name}, {n} tokens")
        if CONFIGS[name].get("capacity_factor"):
            assert routing.overflow > 0  # the case really exercises overflow


@pytest.mark.parametrize("chunk_rows", CHUNKS, ids=["whole", "chunks-7"])
@pytest.mark.parametrize("name", ["top2", "top2-zipf-replicated-hot", "top2-capacity-spill"])
def test_requests_batched_together_each_equal_the_reference(backend, name, chunk_rows):
    """Several clients in one round: each output is its own request's layer output
    (routing, and capacity, are per request); in chunks, a request may finish before the
    round's last chunk is in."""
    b = _backend(backend)
    ref = reference_for(CONFIGS[name])
    gw = b.gateway(name, chunk_rows)
    xs = [tokens(8 + 7 * i, 100 + i) for i in range(4)]
    # the first request of a burst goes at once (nothing in flight) and these rounds take a
    # millisecond, so on a busy machine the others can each come after the one before it
    # finished: up to three bursts, every output checked in each, until two shared a round
    for _ in range(3):
        rounds = _burst(gw.url, xs, ref)
        if len(rounds) < len(xs):
            break
    assert len(rounds) < len(xs)  # at least two of them shared a round


def _burst(url: str, xs: list, ref: ReferenceMoE) -> set:
    """Send ``xs`` from one client each, released together; check each output against the
    reference; the rounds that carried them."""
    ys, errors = [None] * len(xs), []
    clients = [GatewayClient(url, timeout=20.0) for _ in xs]
    barrier = threading.Barrier(len(xs))

    def run(i):
        try:
            barrier.wait(timeout=10)
            ys[i] = clients[i].forward(xs[i])
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    rounds = {c.last_round for c in clients}
    for c in clients:
        c.close()
    assert not errors
    for x, y in zip(xs, ys):
        np.testing.assert_allclose(y, ref.forward(x)[0], **TOL)
    return rounds


def test_a_hot_replicated_expert_is_split_over_its_replicas(backend):
    b = _backend(backend)
    name = "top2-one-hot-replicated"  # nearly every token picks expert 0 (on w0 and w2)
    ref = reference_for(CONFIGS[name])
    with GatewayClient(b.gateway(name).url, timeout=20.0) as client:
        before = client.ping()["workers"]
        x = tokens(MAX_BATCH, 7)
        np.testing.assert_allclose(client.forward(x), ref.forward(x)[0], **TOL)
        after = client.ping()["workers"]

    def rows(w, e):
        return dict(after[w]["expert_rows"]).get(e, 0) - dict(before[w]["expert_rows"]).get(e, 0)
    hot = int((ref.router.route(x).topk_idx == 0).sum())
    assert rows(0, 0) > 0 and rows(2, 0) > 0 and rows(0, 0) + rows(2, 0) == hot
    # the split evens the load: the idle replica w2 took the larger share
    assert rows(2, 0) > rows(0, 0)


NOISY = dict(top_k=2, noisy=True, noise_std=0.5)


def test_round_timed_to_its_last_combine(backend):
    """What auto's chunk choice stands on: a part sent whole leaves its worker idle while the
    gateway combines after the last reply, so a timed round runs from its plan to its last
    combine -- the worker's recorded no-token time holds that combine (it left it out, and
    chunks, which combine as replies land, were measured against a flattered whole)."""
    b = _backend(backend)
    router = Router(D, E, 2, seed=SEED)
    with WorkerPool(b.urls, router, max_batch_tokens=MAX_BATCH, chunk_rows="auto") as pool:
        _, stats = pool.forward(tokens(MAX_BATCH, 3))
        assert stats.messages == stats.workers  # auto's first rounds go whole (and are timed)
        timed = [w.chunk_costs.idle_s for w in pool.workers if w.chunk_costs.idle_s is not None]
        assert len(timed) == stats.workers and all(idle >= stats.combine_s > 0 for idle in timed)
        # a round not combined yet is not timed yet
        from gateway.combine import combine_request
        from gateway.requests import Request
        before = [len(w.chunk_costs.idle) for w in pool.workers]  # samples taken
        req = Request(tokens(MAX_BATCH, 4))
        pool.rounds.dispatch([req])
        deadline = time.monotonic() + 30
        while not req.finished and time.monotonic() < deadline:
            pool.loop.run_once(timeout=0.05)
        assert req.finished and [len(w.chunk_costs.idle) for w in pool.workers] == before
        combine_request(req, np.empty((MAX_BATCH, D), np.float32))
        req.release()
        assert [len(w.chunk_costs.idle) for w in pool.workers] == [n + 1 for n in before]


@pytest.mark.parametrize("way", ["in", "back"])
def test_chunks_of_local_workers_time_each_way(backend, way, monkeypatch):
    """Chunks to and from a worker on this machine (its clock is ours) time each way. Back:
    a reply, from the time the worker says it replied to its rows summed here. In: a chunk
    after a part's first, from our gather to the time the worker says it read it (``t_rx``),
    which only a worker that reads while it computes says (tcp: a compute thread); a shm
    worker computes on its loop's thread and reads a chunk only between computes. A worker
    elsewhere measures neither way, and its ramps keep the whole round's growth."""
    import gateway.chunking as chunking
    from gateway.worker_link import WorkerLink
    b = _backend(backend)
    monkeypatch.setattr(chunking, "OUT_ROWS", 1)  # these workers take 96 rows at most
    samples, growth = {"in": ("into", "front_growth"), "back": ("out", "back_growth")}[way]
    measured = way == "back" or b.backend == "tcp"
    router = Router(D, E, 2, seed=SEED)
    x = tokens(MAX_BATCH, 6)
    want = reference_for(dict(top_k=2)).forward(x)[0]
    with WorkerPool(b.urls, router, max_batch_tokens=MAX_BATCH, chunk_rows=8) as pool:
        assert all(w.local for w in pool.workers)
        pool.forward(x)  # a worker's first replies may fault in fresh memory: not timed (cold)
        for w in pool.workers:
            getattr(w.chunk_costs, samples).clear()
        start = time.perf_counter()
        y, stats = pool.forward(x)
        took = time.perf_counter() - start
        np.testing.assert_allclose(y, want, **TOL)
        assert stats.messages > 2 * stats.workers  # chunks after each part's first
        for w in pool.workers:
            got = list(getattr(w.chunk_costs, samples))  # seconds a row, of chunks of 1-8 rows
            if measured:
                assert got and all(0.0 < per_row < took for per_row in got), (w.url, got, took)
            else:
                assert not got
                assert getattr(w.chunk_costs, growth)(MAX_BATCH) == w.chunk_costs.ramp_growth(MAX_BATCH)
        monkeypatch.setattr(WorkerLink, "local", property(lambda self: False))
        for w in pool.workers:
            getattr(w.chunk_costs, samples).clear()
        y, _ = pool.forward(x)
        np.testing.assert_allclose(y, want, **TOL)
        assert not any(getattr(w.chunk_costs, samples) for w in pool.workers)
        assert all(getattr(w.chunk_costs, growth)(MAX_BATCH) == w.chunk_costs.ramp_growth(MAX_BATCH)
                   for w in pool.workers)


def test_a_worker_is_local_by_its_url():
    from gateway.worker_link import WorkerLink
    assert WorkerLink(0, "shm:///moe-w0").local
    assert WorkerLink(0, "tcp://127.0.0.1:5000").local and WorkerLink(0, "rdma://[::1]:5000").local
    assert not WorkerLink(0, "tcp://192.0.2.7:5000").local  # (never connected to)


@pytest.mark.parametrize("chunk_rows", [0, 5], ids=["one-message", "chunks-5"])
@pytest.mark.parametrize("split", [True, False], ids=["split", "whole"])
def test_pool_in_process_equals_reference(backend, split, chunk_rows):
    """WorkerPool driven directly (no gateway process): the same numbers, including noisy
    top-k (both routers draw the same noise stream from the same seed)."""
    b = _backend(backend)
    for config in (CONFIGS["top2-zipf-replicated-hot"], CONFIGS["top4-skewed-capacity-spill"], NOISY):
        kw = dict(config)
        k = kw.pop("top_k")
        ref = ReferenceMoE(Router(D, E, k, seed=SEED, **kw),
                           [SwiGLUExpert.from_seed(e, D, F, seed=SEED) for e in range(E)])
        with WorkerPool(b.urls, Router(D, E, k, seed=SEED, **kw), max_batch_tokens=MAX_BATCH,
                        split_replicas=split, chunk_rows=chunk_rows) as pool:
            for n, seed in ((5, 11), (MAX_BATCH, 12)):
                x = tokens(n, seed)
                out = np.full((n, D), np.nan, np.float32)
                y, stats = pool.forward(x, out)
                assert y is out
                np.testing.assert_allclose(y, ref.forward(x)[0], **TOL)
                assert stats.tokens == n
                if not config.get("noisy"):  # (routing again would advance the noise stream)
                    assert stats.rows == int((ref.router.route(x).topk_idx >= 0).sum())
                assert min(stats.route_s, stats.dispatch_s, stats.wait_s, stats.combine_s) >= 0
                if chunk_rows:  # every part went in messages of at most 5 rows
                    assert stats.messages >= max(stats.workers, -(-stats.rows // chunk_rows))
                    assert n < MAX_BATCH or stats.messages > 2 * stats.workers
                else:
                    assert stats.messages == stats.workers
                # the workers' own clocks: each message's receive-to-reply time
                assert 0 < stats.busiest_s <= stats.total_s
            if chunk_rows:  # and, between chunks already waiting, each one's time from reply to next
                gaps = [w.chunk_costs.gap_s for w in pool.workers if w.chunk_costs.gap_s is not None]
                assert gaps and all(0 <= g < 0.5 for g in gaps)
