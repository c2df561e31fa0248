"""The gateway's selectable policies: expert-aware batching (gateway/batcher.py) and
least-loaded replica balancing (gateway/replicas.py), each unit-tested, then both at once
in a real gateway whose answers must still equal the reference layer's."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from gateway.batcher import Batcher
from gateway.replicas import choose_least_loaded

D, F, E, K, SEED = 16, 32, 8, 2, 4


def batcher(policy: str, **kw) -> Batcher:
    args = dict(max_batch_tokens=100, max_wait=1.0, max_inflight_rounds=2, max_batch_requests=8)
    args.update(kw)
    return Batcher(policy=policy, **args)


def fill(b: Batcher, entries, now: float = 10.0) -> None:
    """entries: (name, tokens, waited seconds, experts)"""
    for name, n, waited, ex in entries:
        b.add(name, n, now - waited, frozenset(ex))


QUEUE = [("a", 10, 0.5, {0, 1}), ("b", 10, 0.4, {5, 6}), ("c", 10, 0.3, {1, 2}), ("d", 10, 0.2, {0, 1}),
         ("e", 10, 0.1, {6, 7})]


def test_fifo_takes_the_oldest_first_as_before():
    b = batcher("fifo", max_batch_requests=3)
    fill(b, QUEUE)
    assert b.take(10.0) == ["a", "b", "c"]
    assert b.tokens == 20 and len(b) == 2


def test_expert_aware_takes_the_head_then_requests_sharing_its_experts():
    b = batcher("expert-aware")
    fill(b, QUEUE)
    # a brings {0, 1}; d adds nothing new, c adds one expert; b and e share none: a later round
    assert b.take(10.0) == ["a", "c", "d"]
    assert [e[0] for e in b.queue] == ["b", "e"] and b.tokens == 20
    assert b.take(10.0) == ["b", "e"]  # b brings {5, 6}; e shares 6
    assert len(b) == 0 and b.tokens == 0


def test_expert_aware_never_passes_a_request_over_for_longer_than_max_wait():
    b = batcher("expert-aware")
    fill(b, QUEUE)
    b.queue[1] = ("b", 10, 10.0 - 1.2, frozenset({5, 6}))  # b has waited past max_wait (1 s)
    got = b.take(10.0)
    assert got[:2] == ["a", "b"], got  # overdue requests go with the head, in arrival order
    assert "e" in got  # and now shares 6 with b


def test_expert_aware_keeps_to_the_round_budget():
    b = batcher("expert-aware", max_batch_tokens=25)
    fill(b, [("a", 10, 0.5, {0}), ("big", 20, 0.4, {0}), ("c", 10, 0.3, {0})])
    assert b.take(10.0) == ["a", "c"]  # big does not fit beside a; c does
    assert b.take(10.0) == ["big"]
    one = batcher("expert-aware", max_batch_requests=1)
    fill(one, QUEUE)
    assert one.take(10.0) == ["a"]


def test_unknown_batching_policy_is_refused():
    with pytest.raises(ValueError, match="batching policy"):
        batcher("random")


def test_least_loaded_puts_each_expert_whole_on_the_least_working_replica():
    counts = np.array([40, 30, 20, 10])
    hosts = {e: [0, 1] for e in range(4)}
    load = np.zeros(2)
    replicas, shares = choose_least_loaded(counts, hosts, load, np.array([1e-3, 1e-3]))
    assert all(len(ws) == 1 and shares[e] == [1.0] for e, ws in replicas.items())  # never split
    # LPT: 40 -> w0, 30 -> w1, 20 -> w1 (30+20 < 40+20), 10 -> w0
    assert [replicas[e][0] for e in range(4)] == [0, 1, 1, 0]
    assert list(load) == [50.0, 50.0]


def test_least_loaded_weighs_rows_by_the_workers_measured_speed():
    counts = np.array([30, 30, 30, 30])
    hosts = {e: [0, 1] for e in range(4)}
    # worker 1 is three times slower per row: it gets one expert of four
    replicas, _ = choose_least_loaded(counts, hosts, np.zeros(2), np.array([1e-4, 3e-4]))
    assert sorted(replicas[e][0] for e in range(4)) == [0, 0, 0, 1]
    # outstanding rows from earlier rounds count: a busy worker 0 gets less
    replicas, _ = choose_least_loaded(counts, hosts, np.array([70.0, 0.0]), np.array([np.nan, np.nan]))
    assert sorted(replicas[e][0] for e in range(4)) == [0, 1, 1, 1]
    # an expert with one host has no choice
    replicas, _ = choose_least_loaded(np.array([5, 0]), {0: [1]}, np.zeros(2))
    assert replicas == {0: [1]}


def test_a_workers_speed_is_weighed_by_rows_not_by_replies():
    from gateway.worker_link import WorkerLink

    w = WorkerLink(0, "tcp://127.0.0.1:1")
    w.record_compute(1000 * 1e-6, 1000)  # a big block at 1 us per row
    for _ in range(5):
        w.record_compute(50e-6, 1)  # one-row replies: mostly fixed cost
    # a mean of ratios would say ~40 us per row; rows weigh: still a few us
    assert w.seconds_per_row < 1e-5
    w.record_compute(0.0, 0)  # an empty reply changes nothing
    assert w.cost_rows > 0 and w.as_dict()["seconds_per_row"] == w.seconds_per_row


@pytest.mark.timeout(120)
def test_a_gateway_with_both_policies_answers_as_the_reference():
    from gateway.client import GatewayClient
    from gateway.reference import ReferenceMoE
    from tests.helpers_procs import Services

    ref = ReferenceMoE.from_seed(D, F, E, K, seed=SEED)
    with Services() as services:
        gw = services.gateway("tcp", local_workers=2, replicas=2, d_model=D, d_ff=F, n_experts=E, top_k=K,
                              seed=SEED, max_batch_tokens=64, max_wait_ms=20, batching="expert-aware",
                              balancing="least-loaded")
        xs = [np.random.default_rng(i).standard_normal((1 + i % 5, D)).astype(np.float32) for i in range(48)]
        ys: list = [None] * len(xs)
        errors: list = []

        def client(k: int) -> None:
            try:
                with GatewayClient(gw.url, timeout=30.0) as c:
                    for i in range(k, len(xs), 6):
                        ys[i] = c.forward(xs[i])
            except Exception as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        for x, y in zip(xs, ys):
            np.testing.assert_allclose(y, ref.forward(x)[0], rtol=1e-4, atol=1e-5)
        with GatewayClient(gw.url, timeout=30.0) as c:
            pong = c.ping()
        cfg = pong["config"]
        assert (cfg["batching"], cfg["balancing"], cfg["replicas"]) == ("expert-aware", "least-loaded", 2)
        assert pong["gateway"]["replies"] == len(xs) and pong["gateway"]["failed_requests"] == 0
        assert all(w["rows_sent"] > 0 for w in pong["workers"])  # both replicas took work
        assert all(w["seconds_per_row"] > 0 for w in pong["workers"])  # their speed, measured
