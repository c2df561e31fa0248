"""Live placement in one process: a real WorkerPool and GatewayServer, fake workers with real
connections. Copies move while clients send (placement load), workers are drained, removed
and added, and a worker that returns after moves is given its placement. Every answer is
checked (fake workers compute x * scale(expert, version)), and none may fail."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from gateway.client import GatewayClient
from gateway.expert_placement import ExpertPlacement, PlacementError
from tests.helpers_procs import wait_until
from tests.test_gateway_inprocess import D, Stack, tokens
from workers import protocol as P
from workers.testing import FakeWorker

pytestmark = pytest.mark.timeout(60)


class Clients:
    """Threads sending requests until stopped; every answer checked, errors kept."""

    def __init__(self, s: Stack, n: int = 2):
        self.s, self.ok, self.bad, self.errors = s, 0, [], []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, i):
        rng = np.random.default_rng(i)
        with GatewayClient(self.s.server.url, timeout=10.0, secret=self.s.pool.workers.secret) as c:
            while not self.stop.is_set():
                x = tokens(int(rng.integers(1, 12)), seed=int(rng.integers(1 << 30)))
                try:
                    y = c.forward(x)
                except P.RemoteError as e:
                    self.errors.append(str(e))
                    continue
                if np.allclose(y, self.s.expected(x), rtol=1e-5):
                    self.ok += 1
                else:
                    self.bad.append(x)

    def close(self, at_least: int = 20):
        wait_until(lambda: self.ok >= at_least or self.errors or self.bad, timeout=10)
        self.stop.set()
        for t in self.threads:
            t.join(10)
        assert not self.bad and not self.errors, (len(self.bad), self.errors[:3])
        assert self.ok >= at_least


def _control(s: Stack):
    return GatewayClient(s.server.url, timeout=10.0, secret=s.pool.workers.secret)


def _settled(s: Stack, version: int, timeout: float = 10.0) -> bool:
    def done():
        mv = s.pool.rebalancer.move
        return s.pool.rounds.planner.placement.version >= version and (mv is None or mv.state in ("done", "abandoned"))
    return wait_until(done, timeout=timeout)


def test_show_gives_per_layer_version_balancedness_and_copies():
    s = Stack([[0, 1], [2, 3]])
    try:
        with _control(s) as c:
            c.forward(tokens(64))
            doc = c.placement("show")
        layer = doc["layers"]["0"]
        assert layer["version"] == doc["version"] == 1
        assert layer["copies"] == {"0": [0], "1": [0], "2": [1], "3": [1]}
        assert 0 < layer["balancedness"] <= 1.0 and sum(layer["load"]) == 64 * 2
        assert [w["slots"] for w in doc["workers"]] == [4, 4] and doc["redundant"] == 0
    finally:
        s.close()


def test_a_copy_moves_under_load_without_a_failed_or_wrong_answer():
    """Expert 1 from worker 0 to worker 1 (and a redundant copy of 3 on worker 0): loaded,
    switched at a round boundary, the old copy unhosted once no round uses it."""
    s = Stack([[0, 1], [2, 3]])
    try:
        load = Clients(s)
        time.sleep(0.2)
        target = {"version": 1, "layers": {"0": {"copies": {"0": [0], "1": [1], "2": [1], "3": [0, 1]}}}}
        with _control(s) as c:
            st = c.placement("load", placement=target)
            assert st["state"] in ("loading", "switched", "retiring", "done"), st
            assert _settled(s, 2)
            time.sleep(0.2)
            doc = c.placement("show")
        load.close()
        assert doc["version"] == 2 and doc["layers"]["0"]["copies"] == target["layers"]["0"]["copies"]
        assert s.workers[0].experts == [0, 3] and s.workers[1].experts == [1, 2, 3]
        assert s.pool.rebalancer.stats.done == 1 and s.pool.rebalancer.stats.loads == 2
        from prometheus_client import generate_latest

        from gateway.metrics import GatewayMetrics
        text = generate_latest(GatewayMetrics(s.server).registry).decode()
        assert "moe_gateway_placement_version 2.0" in text
        assert 'moe_gateway_placement_copies{expert="3",layer="0"} 2.0' in text
        assert 'moe_gateway_placement_moves_total{outcome="done"} 1.0' in text
        assert 'moe_gateway_placement_balancedness{layer="0"}' in text and "moe_gateway_worker_load_share" in text
    finally:
        s.close()


def test_a_move_a_worker_cannot_take_is_abandoned_and_the_placement_stays():
    s = Stack([[0, 1], [2, 3]])
    try:
        s.workers[1].max_experts = 2  # it says 4 in its info, but refuses a third copy
        with _control(s) as c:
            c.placement("load", placement={"layers": {"0": {"copies": {"0": [0], "1": [1], "2": [1], "3": [1]}}}})
            assert wait_until(lambda: s.pool.rebalancer.move.state == "abandoned", timeout=10)
            assert s.pool.rounds.planner.placement.version == 1
            x = tokens(40)
            np.testing.assert_allclose(c.forward(x), s.expected(x), rtol=1e-5)
        assert "at most 2" in s.pool.rebalancer.move.error
    finally:
        s.close()


def test_a_drained_worker_hands_its_copies_over_then_is_removed_and_nothing_fails():
    s = Stack([[0, 1], [2, 3]])
    try:
        load = Clients(s)
        with _control(s) as c:
            st = c.workers("remove", worker=0)
            assert st["state"] == "draining"
            assert wait_until(lambda: s.pool.workers[0].state.value == "removed", timeout=15)
            doc = c.placement("show")
        load.close()
        assert doc["layers"]["0"]["copies"] == {"0": [1], "1": [1], "2": [1], "3": [1]}
        assert doc["workers"][0]["state"] == "removed"
    finally:
        s.close()


def test_a_drain_the_others_cannot_absorb_is_refused():
    s = Stack([[0, 1], [2, 3]])
    try:
        s.pool.workers[1].max_experts = 3
        with _control(s) as c:
            with pytest.raises(P.RemoteError, match="free slots: add workers first"):
                c.workers("drain", worker=0)
        assert not s.pool.workers[0].parked
    finally:
        s.close()


def test_an_added_worker_is_given_copies_by_the_algorithm_then_takes_traffic():
    s = Stack([[0, 1, 2, 3]])
    extra = FakeWorker([0], d_model=D, secret=s.pool.workers.secret)
    try:
        with _control(s) as c:
            assert c.workers("add", urls=[extra.url])["added"] == [1]
            assert _settled(s, 2)  # admitted, then half the experts moved onto it
            doc = c.placement("show")
            assert doc["workers"][1]["copies"] == 2 and doc["workers"][0]["copies"] == 2, doc["workers"]
            x = tokens(64, seed=5)
            np.testing.assert_allclose(c.forward(x), s.expected(x), rtol=1e-5)
            assert extra.forwards > 0 and len(extra.experts) == 2
            with pytest.raises(P.RemoteError, match="URLs"):
                c.workers("add", urls=["127.0.0.1:5"])
    finally:
        s.close()
        extra.close()


def test_a_worker_returning_after_moves_is_given_its_placement():
    """Worker 0 crashes after expert 1 moved to worker 1 and 3 got a copy on worker 0; back
    on its URL with its start-up experts (0, 1), it unhosts 1 and loads 3 before it serves."""
    s = Stack([[0, 1], [2, 3]])
    try:
        with _control(s) as c:
            c.placement("load", placement={"layers": {"0": {"copies": {"0": [0], "1": [1], "2": [1], "3": [0, 1]}}}})
            assert _settled(s, 2)
            url = s.workers[0].url
            s.workers[0].crash()
            s.workers[0].close()
            # the pool must have seen the crash, or "healthy" below could still be the old link's
            assert wait_until(lambda: s.pool.workers[0].state.value != "healthy", timeout=15)
            s.workers[0] = FakeWorker([0, 1], d_model=D, url=url, secret=s.pool.workers.secret)
            assert wait_until(lambda: s.pool.workers[0].state.value == "healthy", timeout=15)
            assert s.workers[0].experts == [0, 3]
            x = tokens(64, seed=2)
            np.testing.assert_allclose(c.forward(x), s.expected(x), rtol=1e-5)
    finally:
        s.close()


def test_placement_rules_are_checked():
    p = ExpertPlacement.from_hosting({0: {0: [0, 1]}, 1: {0: [2, 3]}}, {0: 4})
    assert p.of(0, 1) == (0,) and p.on(1) == [(0, 2), (0, 3)] and p.version == 1
    with pytest.raises(PlacementError, match="no copy"):
        p.changed(removes=[(0, 1, 0)])
    q = p.changed(adds=[(0, 1, 1)], removes=[(0, 1, 0)])
    assert q.version == 2 and q.of(0, 1) == (1,) and p.diff(q) == ([(0, 1, 1)], [(0, 1, 0)])
    with pytest.raises(PlacementError, match="does not exist"):
        p.changed(adds=[(0, 0, 7)]).check(n_workers=2)
    with pytest.raises(PlacementError, match="ids 0-3"):
        ExpertPlacement.from_dict({"layers": {"0": {"copies": {"0": [0]}}}}, {0: 4})
    assert ExpertPlacement.from_dict(q.as_dict(), {0: 4}) == q
