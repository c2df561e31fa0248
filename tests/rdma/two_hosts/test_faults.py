"""The link misbehaving between the gateway's host and its workers' hosts (tc netem and the
switch port on the bridge, tests/rxe/hosts.py), every answer checked against the reference:
loss/reorder/delay, a 1 s flap, a cut longer than the queue pairs' retry budget, an MTU
mismatch, and a worker host's rxe device removed while it serves. The figures each test
measures go to ``$MOE_JOB_OUT/two_hosts.jsonl`` (build/rdma/ on the host)."""
from __future__ import annotations

import json
import math
import os
import threading
import time

import numpy as np
import pytest

from gateway.client import GatewayClient
from tests.helpers_procs import wait_until
from tests.rdma.two_hosts.conftest import verbs_contexts
from tests.test_fault_workers import D, TOL, _answers, reference, steered  # noqa: F401
from workers import protocol as P

pytestmark = [pytest.mark.rdma, pytest.mark.timeout(600)]
IBV_MTU_1024, IBV_MTU_4096 = 3, 5


def record(test: str, **figures) -> None:
    line = json.dumps({"test": test, **figures})
    print(line)
    out = os.environ.get("MOE_JOB_OUT")
    if out:
        with open(os.path.join(out, "two_hosts.jsonl"), "a") as f:
            f.write(line + "\n")


class Stream:
    """Requests back to back from a thread, alternating tokens only B serves ("low") and
    tokens that need C ("high"); every outcome recorded: ok, wrong, or the error code."""

    def __init__(self, url: str, steered, timeout: float):
        (self.low, self.y_low), (self.high, self.y_high) = steered
        self.url, self.timeout = url, timeout
        self.log: list = []  # (kind, start, seconds, outcome)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Stream":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(self.timeout + 30)
        assert not self._t.is_alive(), "a request never came back"

    def _run(self) -> None:
        with GatewayClient(self.url, timeout=self.timeout + 20) as c:
            i = 0
            while not self._stop.is_set():
                kind = "high" if i % 2 else "low"
                x, y = (self.high, self.y_high) if i % 2 else (self.low, self.y_low)
                t = time.monotonic()
                try:
                    got = c.forward(x, timeout=self.timeout + 10)
                    outcome = "ok" if np.allclose(got, y, **TOL) else "wrong"
                except P.RemoteError as e:
                    outcome = e.code
                self.log.append((kind, t, time.monotonic() - t, outcome))
                i += 1

    def wrong(self) -> list:
        return [e for e in self.log if e[3] == "wrong"]

    def first_ok(self, kind: str, after: float) -> float:
        """The first right answer to a request of ``kind`` that came at or after ``after``
        (NaN: none yet)."""
        return min((t + d for k, t, d, o in self.log if k == kind and o == "ok" and t + d >= after),
                   default=math.nan)

    def served(self, kind: str, after: float) -> bool:
        return not math.isnan(self.first_ok(kind, after))


def _rounds(cl, x, y, n: int) -> tuple[float, list]:
    lat = []
    t0 = time.monotonic()
    for _ in range(n):
        t = time.monotonic()
        np.testing.assert_allclose(cl.forward(x), y, **TOL)
        lat.append(time.monotonic() - t)
    return time.monotonic() - t0, lat


def test_loss_reorder_and_delay_keep_every_answer_correct(served, hosts, reference):
    """1% loss, 0.1% reorder, 2 ms delay each way on the gateway host's cable: RC
    retransmits, every answer equals the reference; tokens/s and p99 beside the clean link."""
    gw = served.gw
    x = np.random.default_rng(3).standard_normal((64, D)).astype(np.float32)
    y = reference.forward(x)[0]
    n = 40
    with GatewayClient(gw.url, timeout=60.0) as cl:
        _rounds(cl, x, y, 3)  # warm
        clean_s, clean = _rounds(cl, x, y, n)
        hosts.netem(hosts["a"], "delay 2ms reorder 0.1% loss 1%")
        lossy_s, lossy = _rounds(cl, x, y, n)  # every answer asserted equal
        hosts.clear(hosts["a"])
        assert all(w["healthy"] for w in cl.ping()["workers"])
    record("loss_reorder_delay", requests=n, tokens=64, correct=1.0,
           clean_tok_s=round(n * 64 / clean_s, 1), lossy_tok_s=round(n * 64 / lossy_s, 1),
           ratio=round(clean_s / lossy_s, 3), clean_p99_ms=round(1e3 * float(np.percentile(clean, 99)), 1),
           lossy_p99_ms=round(1e3 * float(np.percentile(lossy, 99)), 1))


def test_a_one_second_flap_loses_nothing_and_the_worker_comes_back(served, hosts, steered):
    """C's cable out for 1 s under load: nothing wrong, every request answered or refused
    within --worker-timeout, C serving again soon after, no verbs context left behind."""
    timeout = served.WORKER_TIMEOUT
    wc, gw = served.wc, served.gw
    c = hosts["c"]
    with GatewayClient(gw.url, timeout=30.0) as cl:
        assert _answers(cl, steered[1][0], steered[1][1])
    with Stream(gw.url, steered, timeout) as s:
        time.sleep(1.0)
        hosts.cut(c)
        time.sleep(1.0)
        hosts.mend(c, wait=False)
        up = time.monotonic()
        assert wait_until(lambda: s.served("high", up), timeout=30, interval=0.05)
        time.sleep(0.5)
    back = s.first_ok("high", up) - up
    assert not s.wrong(), s.wrong()
    assert all(d < timeout + 3.0 for _, _, d, _ in s.log), max(d for _, _, d, _ in s.log)
    assert all(o in ("ok", P.UNAVAILABLE, P.WORKER_FAILED) for *_, o in s.log), s.log
    with GatewayClient(gw.url, timeout=30.0) as cl:
        assert all(w["healthy"] for w in cl.ping()["workers"])
    assert wait_until(lambda: verbs_contexts(gw.pid) == 2, timeout=20)
    assert wait_until(lambda: verbs_contexts(wc.pid) == 1, timeout=20)
    record("flap_1s", requests=len(s.log), wrong=0, refused=sum(o != "ok" for *_, o in s.log),
           link_up_to_serving_s=round(back, 3), worst_s=round(max(d for _, _, d, _ in s.log), 3))


def test_a_cut_longer_than_the_retry_budget_reports_the_worker_down(served, hosts, steered):
    """C's cable out for 8 s: C is reported down, what B holds is served all along, and C is
    taken back once the cable is in."""
    timeout = served.WORKER_TIMEOUT
    (low, y_low), (high, y_high) = steered
    gw = served.gw
    c = hosts["c"]
    with GatewayClient(gw.url, timeout=30.0) as cl:
        assert _answers(cl, high, y_high)
        hosts.cut(c)
        t0 = time.monotonic()
        with pytest.raises(P.RemoteError) as info:
            cl.forward(high, timeout=timeout + 10)
        assert info.value.code in (P.UNAVAILABLE, P.WORKER_FAILED)
        assert wait_until(lambda: not cl.ping()["workers"][1]["healthy"], timeout=10, interval=0.1)
        down = time.monotonic() - t0
        while time.monotonic() - t0 < 8.0:
            np.testing.assert_allclose(cl.forward(low), y_low, **TOL)
        hosts.mend(c)
        up = time.monotonic()
        assert wait_until(lambda: _answers(cl, high, y_high), timeout=30, interval=0.1)
        back = time.monotonic() - up
        w = cl.ping()["workers"][1]
        assert w["healthy"] and w["reconnects"] >= 1
    assert wait_until(lambda: verbs_contexts(gw.pid) == 2, timeout=20)
    record("cut_8s", reported_down_after_s=round(down, 2), link_up_to_serving_s=round(back, 2))


def test_an_mtu_mismatch_is_negotiated_down_and_nothing_is_truncated(hosts, make_pair_on):
    """A at MTU 9000 (rxe path MTU 4096), B at 1500 (1024), C at 9000: A-B runs at 1024,
    A-C at 4096, and messages of every size arrive whole both ways."""
    a, b, c = hosts.hosts
    hosts.set_mtu(a, 9000)
    hosts.set_mtu(c, 9000)
    hosts.wait_ready()
    for peer, want in ((b, IBV_MTU_1024), (c, IBV_MTU_4096)):
        client, server = make_pair_on(a, peer)
        assert client.path_mtu == server.path_mtu == want
        for n in (1, 1000, 1100, 4096, 5000, 65536, 1 << 20):
            for src, dst in ((client, server), (server, client)):
                s = src.alloc(n)
                np.frombuffer(s.buf, np.uint8)[:] = np.arange(n) % 251
                src.send({"n": n}, [s])
                m = dst.recv(timeout=30)
                assert m.header == {"n": n} and bytes(m.buffers[0]) == (np.arange(n) % 251).astype(np.uint8).tobytes()
                m.release()


@pytest.fixture
def make_pair_on():
    """make_pair_on(client_host, server_host) -> (client, server): in this process, the
    listener on the server host's address and device, the client on the client host's."""
    import transport
    made = []

    def make(ch, sh):
        lst = transport.listen(f"rdma://{sh.ip}:0", device=sh.device, timeout=30)
        made.append(lst)
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("c", transport.connect(lst.url, device=ch.device, timeout=30)))
        t.start()
        s = lst.accept(timeout=60)
        t.join(60)
        made.extend([box["c"], s])
        assert box["c"].device.device == ch.device and s.device.device == sh.device
        return box["c"], s

    yield make
    from transport.rdma import live_resources
    for x in reversed(made):
        x.close()
    assert live_resources() == {}


def test_a_worker_host_s_device_removed_while_serving(served, hosts, steered):
    """``rdma link delete`` of C's device under load: C's worker gives the device up at once
    (the removal completes, which it cannot while a process holds the device), the gateway
    loses C and refuses what needs it, B serves on; the device re-added, C is taken back."""
    timeout = served.WORKER_TIMEOUT
    wc, gw = served.wc, served.gw
    c = hosts["c"]
    with Stream(gw.url, steered, timeout) as s:
        time.sleep(1.0)
        t0 = time.monotonic()
        p = hosts.delete_device(c)
        try:
            rc = p.wait(20)
        except Exception:
            p.kill()
            raise AssertionError("rdma link delete still waiting after 20 s: the worker kept the device")
        removed = time.monotonic() - t0
        assert rc == 0, p.stdout.read()
        time.sleep(1.0)
        hosts.add_device(c)
        up = time.monotonic()
        assert wait_until(lambda: s.served("high", up), timeout=30, interval=0.05)
    back = s.first_ok("high", up) - up
    assert wc.alive() and gw.alive()
    assert not s.wrong(), s.wrong()
    assert any(k == "high" and o != "ok" for k, _, _, o in s.log)  # C was really gone for a while
    assert all(o == "ok" for k, _, _, o in s.log if k == "low")
    with GatewayClient(gw.url, timeout=30.0) as cl:
        w = cl.ping()["workers"][1]
        assert w["healthy"] and w["reconnects"] >= 1
    assert wait_until(lambda: verbs_contexts(wc.pid) == 1, timeout=20)
    record("device_removed", removal_done_s=round(removed, 2), device_back_to_serving_s=round(back, 2))
