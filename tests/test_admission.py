"""A worker that comes back never serves other weights than the gateway serves: real
moe-gateway and moe-worker processes over tcp and shm, hot updates, SIGKILLs and restarts.

Every answer is checked against the reference layer at exactly the versions the answer says
computed it (bench/versioned.py), and those versions against what the gateway served.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

from bench.versioned import VersionedReference
from gateway.client import GatewayClient
from tests.helpers_fault import steered_tokens
from tests.helpers_procs import BACKENDS, Service, Services, backend_problem, wait_until
from transport.service.launch import ServiceError, blas_env, spawn_service
from workers import protocol as P
from workers.expert import SwiGLUExpert

D, F, E, K, SEED, NEW_SEED = 16, 32, 8, 2, 3, 77
MAX_BATCH = 64
TOL = dict(rtol=1e-4, atol=1e-5)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def ref():
    return VersionedReference(D, F, E, K, seed=SEED, seeds={2: NEW_SEED, 1: NEW_SEED})


def _require(backend):
    problem = backend_problem(backend)
    if problem:
        pytest.fail(problem)


def cli(url, *args, ok=True) -> dict:
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "update", "--gateway", url, *args],
                       capture_output=True, text=True, timeout=90)
    if ok:
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1])
    return {"rc": r.returncode, "stderr": r.stderr}


def answer(c, ref, x, expect: dict):
    """Forward ``x``; the answer must say it was computed at ``expect`` (expert -> version)
    for the experts it used, and equal the reference at those versions."""
    y = c.forward(x, timeout=10.0)
    got = c.last_expert_versions
    used = ref.used(x)
    assert got is not None and sorted(got) == used, (got, used)
    assert {e: got[e] for e in used} == {e: expect.get(e, 0) for e in used}, got
    assert ref.matches(x, y, got, **TOL), f"the answer is not the layer at versions {got}"
    return got


class Load:
    """Client threads sending all along; every answer is checked against the reference at the
    versions it names (``wrong`` counts those that are not), errors are kept by code."""

    def __init__(self, url, ref, n=2):
        self.ref, self.ok, self.wrong, self.errors = ref, 0, [], {}
        self.versions: list = []  # (t, {expert: version}) of each right answer
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(url, i), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, url, i):
        rng = np.random.default_rng(100 + i)
        with GatewayClient(url, timeout=20.0) as c:
            while not self.stop.is_set():
                x = rng.standard_normal((int(rng.integers(4, 24)), D)).astype(np.float32)
                try:
                    y = c.forward(x, timeout=20.0)
                except P.RemoteError as e:
                    with self.lock:
                        self.errors[e.code] = self.errors.get(e.code, 0) + 1
                    time.sleep(0.01)
                    continue
                got = c.last_expert_versions or {}
                with self.lock:
                    if self.ref.matches(x, y, got, **TOL):
                        self.ok += 1
                        self.versions.append((time.monotonic(), dict(got)))
                    else:
                        self.wrong.append(got)

    def close(self):
        self.stop.set()
        for t in self.threads:
            t.join(60)


def _worker_of(c, expert) -> int:
    return next(i for i, w in enumerate(c.ping()["workers"]) if expert in w["experts"])


def _healthy_again(c, i, old_pid, timeout=60.0) -> bool:
    def back():
        w = c.ping()["workers"][i]
        return w["state"] == "healthy" and w["pid"] not in (None, old_pid)
    return wait_until(back, timeout=timeout, interval=0.1)


def _update_to_2(url):
    st = cli(url, "start", "--experts", "3,4", "--new-version", "2", "--seed", str(NEW_SEED), "--wait")
    assert st["state"] == "shifting", st
    cli(url, "advance", "--fraction", "1")
    st = cli(url, "finish", "--wait")
    assert st["state"] == "done", st


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_respawned_local_worker_serves_the_finished_update_not_its_start_up_weights(backend, ref):
    """The issue's report: update experts 3 and 4 to version 2, SIGKILL the worker hosting
    0-3; the respawned worker started from its start-up weights (expert 3 at version 0). It
    must not take traffic until it holds version 2 of expert 3; no answer is ever wrong."""
    _require(backend)
    updated = {3: 2, 4: 2}
    x3 = steered_tokens(ref.router, 10, touching=[3], seed=5)
    with Services() as s:
        gw = s.gateway(backend, local_workers=2, d_model=D, d_ff=F, n_experts=E, top_k=K, seed=SEED,
                       max_batch_tokens=MAX_BATCH, max_wait_ms=0, worker_timeout=3, timeout=60)
        _update_to_2(gw.url)
        with GatewayClient(gw.url, timeout=20.0) as c:
            answer(c, ref, x3, updated)
            i = _worker_of(c, 3)
            pid = c.ping()["workers"][i]["pid"]
            load = Load(gw.url, ref)
            try:
                time.sleep(0.3)
                os.kill(pid, signal.SIGKILL)
                assert _healthy_again(c, i, pid)
                for k in range(6):
                    answer(c, ref, x3[k:k + 4], updated)
                time.sleep(0.3)
            finally:
                load.close()
            pong = c.ping()
        w = pong["workers"][i]
        assert [3, 2, [2]] in w["versions"] and [0, 0, [0]] in w["versions"], w["versions"]
        assert pong["admission"]["synced"] >= 1 and pong["served"]["generation"] == 2
        assert not load.wrong, load.wrong[:3]
        assert load.ok > 20 and set(load.errors) <= {P.UNAVAILABLE, P.WORKER_FAILED}, (load.ok, load.errors)
        # and no answer after the update claimed another version of 3 or 4
        assert all(v.get(e, 2) == 2 for _, v in load.versions for e in (3, 4))


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_external_worker_restarted_with_its_original_flags_is_brought_to_the_served_version(backend, ref):
    _require(backend)
    updated = {3: 2, 4: 2}
    x3 = steered_tokens(ref.router, 8, touching=[3], seed=6)
    with Services() as s:
        workers = [s.worker(backend, ex, d_model=D, d_ff=F, seed=SEED, max_tokens=MAX_BATCH * K)
                   for ex in ([0, 1, 2, 3], [4, 5, 6, 7])]
        gw = s.gateway(backend, workers=[w.url for w in workers], d_model=D, d_ff=F, n_experts=E, top_k=K,
                       seed=SEED, max_batch_tokens=MAX_BATCH, max_wait_ms=0, worker_timeout=3)
        _update_to_2(gw.url)
        with GatewayClient(gw.url, timeout=20.0) as c:
            answer(c, ref, x3, updated)
            workers[0].kill()
            restarted = restart(s, workers[0])  # what systemd does: the same command line
            assert restarted.url == workers[0].url
            assert _healthy_again(c, 0, workers[0].pid)
            answer(c, ref, x3, updated)
            pong = c.ping()
        assert [3, 2, [2]] in pong["workers"][0]["versions"]
        assert pong["workers"][0]["reconnects"] == 1 and pong["admission"]["synced"] == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_worker_returning_mid_update_holds_both_versions_and_the_update_still_ends(backend, ref):
    """Experts 2 and 5 are replicated; while the update shifts traffic the replica worker
    is killed and restarted: it is admitted holding both versions, answers are never a mix,
    and finishing retires the old version on it too."""
    _require(backend)
    layout = ([0, 1, 2, 3], [4, 5, 6, 7], [2, 5])
    with Services() as s:
        workers = [s.worker(backend, ex, d_model=D, d_ff=F, seed=SEED, max_tokens=MAX_BATCH * K) for ex in layout]
        gw = s.gateway(backend, workers=[w.url for w in workers], d_model=D, d_ff=F, n_experts=E, top_k=K,
                       seed=SEED, max_batch_tokens=MAX_BATCH, max_wait_ms=0, worker_timeout=3)
        load = Load(gw.url, ref)
        try:
            st = cli(gw.url, "start", "--experts", "2,5", "--new-version", "1", "--seed", str(NEW_SEED),
                     "--steps", "0.5", "--wait")
            assert st["state"] == "shifting"
            with GatewayClient(gw.url, timeout=20.0) as c:
                workers[2].kill()
                back = restart(s, workers[2])
                assert _healthy_again(c, 2, workers[2].pid)
                w = c.ping()["workers"][2]
                assert sorted(w["versions"]) == [[2, 0, [0, 1]], [5, 0, [0, 1]]], w["versions"]
                assert back.url == workers[2].url
                time.sleep(0.5)
                st = cli(gw.url, "finish", "--wait")
                assert st["state"] == "done", st
                time.sleep(0.3)
                pong = c.ping()
        finally:
            load.close()
        for w in pong["workers"]:
            for e, active, held in w["versions"]:
                assert (active, held) == ((1, [1]) if e in (2, 5) else (0, [0])), w["versions"]
        assert not load.wrong, load.wrong[:3]
        # never a mix: an answer used 2 and 5 at one version
        assert all(len({v[e] for e in (2, 5) if e in v}) <= 1 for _, v in load.versions)
        assert load.ok > 20 and not load.errors, (load.ok, load.errors)


def test_finishing_while_the_only_host_is_away_ends_at_once_and_the_host_returns_at_the_new_version(ref):
    """Expert 3 has one host. It is killed while the update shifts; ``finish`` has no retire
    to wait for, so the update is done at once (not when some other worker next drops), and
    the host, restarted from its start-up weights, is admitted holding version 2 only."""
    _require("tcp")
    x3 = steered_tokens(ref.router, 8, touching=[3], seed=7)
    with Services() as s:
        workers = [s.worker("tcp", ex, d_model=D, d_ff=F, seed=SEED, max_tokens=MAX_BATCH * K)
                   for ex in ([0, 1, 2, 3], [4, 5, 6, 7])]
        gw = s.gateway("tcp", workers=[w.url for w in workers], d_model=D, d_ff=F, n_experts=E, top_k=K,
                       seed=SEED, max_batch_tokens=MAX_BATCH, max_wait_ms=0, worker_timeout=3)
        st = cli(gw.url, "start", "--experts", "3", "--new-version", "2", "--seed", str(NEW_SEED), "--wait")
        assert st["state"] == "shifting", st
        with GatewayClient(gw.url, timeout=20.0) as c:
            workers[0].kill()
            assert wait_until(lambda: c.ping()["workers"][0]["state"] != "healthy", timeout=30, interval=0.05)
            t0 = time.monotonic()
            st = cli(gw.url, "finish", "--wait", "--timeout", "20")
            assert st["state"] == "done" and time.monotonic() - t0 < 15, st
            restarted = restart(s, workers[0])
            assert restarted.url == workers[0].url
            assert _healthy_again(c, 0, workers[0].pid)
            answer(c, ref, x3, {3: 2})
            pong = c.ping()
        assert [3, 2, [2]] in pong["workers"][0]["versions"], pong["workers"][0]["versions"]
        assert pong["admission"]["synced"] == 1 and pong["served"]["generation"] >= 1


def test_a_worker_whose_update_source_is_unreadable_is_refused_and_its_experts_never_served_stale(ref, tmp_path):
    """Expert 4 was updated from an .npz in the workers' update directory; the file is gone
    when its worker restarts: the worker is refused (the reason in ping and /metrics), its
    experts are answered `unavailable`, never from its start-up weights; once the file is
    back, the next attempt admits it."""
    updates = tmp_path / "updates"
    updates.mkdir()
    new = SwiGLUExpert.from_seed(4, D, F, seed=NEW_SEED)
    new.expert_id = 4
    SwiGLUExpert.save_many(updates / "e4.npz", [new])
    x4 = steered_tokens(ref.router, 8, touching=[4], seed=7)
    x_low = steered_tokens(ref.router, 8, within=[0, 1, 2, 3], seed=8)
    with Services() as s:
        extra = ["--update-dir", str(updates)]
        workers = [s.worker("tcp", ex, d_model=D, d_ff=F, seed=SEED, max_tokens=MAX_BATCH * K, extra=extra)
                   for ex in ([0, 1, 2, 3], [4, 5, 6, 7])]
        gw, metrics_url = gateway_with_metrics(s, tmp_path, workers)
        st = cli(gw.url, "start", "--experts", "4", "--new-version", "1", "--weights", str(updates / "e4.npz"),
                 "--wait")
        assert st["state"] == "shifting", st
        cli(gw.url, "advance", "--fraction", "1")
        assert cli(gw.url, "finish", "--wait")["state"] == "done"
        with GatewayClient(gw.url, timeout=20.0) as c:
            answer(c, ref, x4, {4: 1})
            os.unlink(updates / "e4.npz")
            workers[1].kill()
            restart(s, workers[1])
            assert wait_until(lambda: c.ping()["workers"][1]["state"] == "refused", timeout=30)
            w = c.ping()["workers"][1]
            assert "e4.npz" in w["why"] and "version 1 of expert 4" in w["why"], w["why"]
            for _ in range(3):
                with pytest.raises(P.RemoteError) as info:
                    c.forward(x4, timeout=10.0)
                assert info.value.code == P.UNAVAILABLE
            answer(c, ref, x_low, {})
            with urllib.request.urlopen(metrics_url, timeout=10) as r:
                metrics = r.read().decode()
            assert 'moe_gateway_worker_state{state="refused",worker="1"} 1.0' in metrics
            assert _metric(metrics, "moe_gateway_worker_admissions_total", outcome="refused") >= 1
            SwiGLUExpert.save_many(updates / "e4.npz", [new])  # the file is back: admitted at the next try
            assert wait_until(lambda: c.ping()["workers"][1]["state"] == "healthy", timeout=30)
            answer(c, ref, x4, {4: 1})


def test_a_restarted_gateway_refuses_experts_its_workers_disagree_on_until_settled(ref):
    """Gateway 1 updated expert 2 (on two workers) to version 1 and went away; one of its
    workers restarted at version 0. Gateway 2 serves every other expert but refuses expert 2
    with the reason, until `moe-gateway update settle` picks version 1: the restarted worker
    loads it (the source the other worker reports) and expert 2 is served again. A third
    gateway finds the workers agreeing on version 1: it serves it and reports it as adopted."""
    layout = ([0, 1, 2, 3], [4, 5, 6, 7], [2, 5])
    x2 = steered_tokens(ref.router, 8, touching=[2], seed=9)
    x_other = steered_tokens(ref.router, 8, within=[0, 1, 3, 4, 6, 7], seed=10)
    flags = dict(d_model=D, d_ff=F, n_experts=E, top_k=K, seed=SEED, max_batch_tokens=MAX_BATCH, max_wait_ms=0,
                 worker_timeout=3)
    with Services() as s:
        workers = [s.worker("tcp", ex, d_model=D, d_ff=F, seed=SEED, max_tokens=MAX_BATCH * K) for ex in layout]
        urls = [w.url for w in workers]
        gw1 = s.gateway("tcp", workers=urls, **flags)
        cli(gw1.url, "start", "--experts", "2", "--new-version", "1", "--seed", str(NEW_SEED), "--wait")
        cli(gw1.url, "advance", "--fraction", "1")
        assert cli(gw1.url, "finish", "--wait")["state"] == "done"
        gw1.stop()
        workers[2].kill()
        restart(s, workers[2])  # back at version 0 of expert 2 (and 5)
        gw2 = s.gateway("tcp", workers=urls, **flags)
        with GatewayClient(gw2.url, timeout=20.0) as c:
            with pytest.raises(P.RemoteError) as info:
                c.forward(x2)
            assert info.value.code == P.UNAVAILABLE and "disagree" in info.value.message, info.value
            answer(c, ref, x_other, {})
            served = cli(gw2.url, "served")
            assert [b[:2] for b in served["blocked"]] == [[0, 2]]
            bad = cli(gw2.url, "settle", "--experts", "2", "--serve-version", "9", ok=False)
            assert bad["rc"] == 2 and "no connected worker holds version 9" in bad["stderr"]
            st = cli(gw2.url, "settle", "--experts", "2", "--serve-version", "1")
            assert st["state"] == "settled" and st["generation"] == 2
            assert wait_until(lambda: _answers(c, ref, x2, {2: 1}), timeout=30)
            assert [2, 1, [1]] in c.ping()["workers"][2]["versions"]
        gw2.stop()
        gw3 = s.gateway("tcp", workers=urls, **flags)
        with GatewayClient(gw3.url, timeout=20.0) as c:
            answer(c, ref, x2, {2: 1})
            served = cli(gw3.url, "served")
            assert served["adopted"] == [[0, 2, 1]] and served["blocked"] == []


def _answers(c, ref, x, expect) -> bool:
    try:
        answer(c, ref, x, expect)
        return True
    except (P.RemoteError, AssertionError):
        return False


def restart(s: Services, svc):
    """``svc`` again with its command line, on the URL it had (a tcp port may take a moment)."""
    argv = list(svc.argv)
    argv[argv.index("--listen") + 1] = svc.url
    for attempt in range(50):
        try:
            return s.start(argv)
        except ServiceError:
            if attempt == 49:
                raise
            time.sleep(0.1)


def gateway_with_metrics(s: Services, tmp_path, workers):
    """A tcp gateway over ``workers`` serving /metrics; (service, metrics URL)."""
    err = open(tmp_path / "gateway.stderr", "w+")
    argv = [sys.executable, "-m", "gateway.cli", "--listen", "tcp://127.0.0.1:0", "--workers",
            ",".join(w.url for w in workers), "--d-model", str(D), "--d-ff", str(F), "--n-experts", str(E),
            "--top-k", str(K), "--seed", str(SEED), "--max-batch-tokens", str(MAX_BATCH), "--max-wait-ms", "0",
            "--worker-timeout", "3", "--metrics-port", "0"]
    proc, url = spawn_service(argv, env=blas_env(1), stderr=err)
    svc = Service(proc, url, argv)
    s.services.append(svc)
    metrics = re.findall(r"^METRICS (\S+)$", (tmp_path / "gateway.stderr").read_text(), re.M)
    assert metrics, (tmp_path / "gateway.stderr").read_text()
    return svc, metrics[-1]


def _metric(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} {labels} in the scrape")
