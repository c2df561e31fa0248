"""The layer served across the link: a moe-gateway on host A, moe-workers on hosts B and C,
over rdma:// (each worker's queue pairs on its own host's device, every round crossing the
bridge), equal to the in-process reference; a Hugging Face checkpoint equal to
transformers; a worker on another host SIGKILLed or SIGSTOPped."""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from gateway.client import GatewayClient
from tests import models_fixture as mf
from tests.helpers_procs import wait_until
from tests.rdma.two_hosts.conftest import verbs_contexts
from tests.test_fault_workers import D, TOL, _answers, reference, steered  # noqa: F401
from workers import protocol as P

pytestmark = [pytest.mark.rdma, pytest.mark.timeout(600)]
CASE = "deepseek_v3-float32"  # strict float32 tolerance; the other family runs on one device


def test_a_gateway_on_a_serves_workers_on_b_and_c_equal_to_the_reference(served, hosts, reference):
    wb, wc, gw = served.wb, served.wc, served.gw
    a, b, c = hosts.hosts
    assert wb.url.startswith(f"rdma://{b.ip}:") and wc.url.startswith(f"rdma://{c.ip}:")
    before = hosts.counters(a)
    rng = np.random.default_rng(7)
    with GatewayClient(gw.url, timeout=60.0) as cl:
        for n in (1, 5, 32, 64):
            x = rng.standard_normal((n, D)).astype(np.float32)
            np.testing.assert_allclose(cl.forward(x), reference.forward(x)[0], **TOL)
        workers = cl.ping()["workers"]
    assert [w["url"] for w in workers] == [wb.url, wc.url]
    assert all(w["healthy"] for w in workers)
    assert verbs_contexts(gw.pid) == 2  # one queue pair (and device context) per worker
    got = hosts.counters(a)
    assert got["tx_bytes"] - before["tx_bytes"] > 102 * D * 4  # the tokens went out over A's cable


def test_a_checkpoint_served_across_the_link_equals_transformers(on_hosts, hosts):
    d = mf.fixture_dir() / CASE
    if not (d / "case.json").exists():
        pytest.fail(f"no fixture at {d}: run `python -m tests.models_fixture` on the host first", pytrace=False)
    import json

    from gateway.supervisor import placement
    from workers.checkpoint import Checkpoint, model_spec
    meta = json.loads((d / "case.json").read_text())
    ckpt = str(d / "checkpoint")
    spec = model_spec(Checkpoint(ckpt)).layer(meta["layers"][0])
    a, b, c = hosts.hosts
    urls = []
    for host, ids in zip((b, c), placement(spec.n_experts, 2, 1, spec.n_shared)):
        w = on_hosts.worker(host, ids, d_model=spec.d_model, d_ff=spec.d_ff, dtype=meta["dtype"],
                            max_tokens=64 * (spec.routing.top_k + spec.n_shared),
                            extra=["--checkpoint", ckpt, "--compute", "numpy"])
        urls.append(w.url)
    gw = on_hosts.gateway(a, urls, checkpoint=ckpt, dtype=meta["dtype"], max_batch_tokens=64,
                          connect_timeout=120)
    worst, workers = mf.compare_layers(gw.url, d, timeout=120)
    assert [w["url"] for w in workers] == urls
    assert worst <= mf.TOL[meta["dtype"]]


def test_a_worker_on_another_host_sigkilled_and_restarted_is_taken_back(served, steered):
    (low, y_low), (high, y_high) = steered
    wc, gw = served.wc, served.gw
    with GatewayClient(gw.url, timeout=30.0) as cl:
        assert _answers(cl, low, y_low) and _answers(cl, high, y_high)
        wc.kill()
        for _ in range(3):
            np.testing.assert_allclose(cl.forward(low), y_low, **TOL)
            t = time.monotonic()
            with pytest.raises(P.RemoteError) as info:
                cl.forward(high)
            assert info.value.code in (P.UNAVAILABLE, P.WORKER_FAILED)
            assert time.monotonic() - t < 5.0  # fails fast, not at a deadline
        wc = served.restart_c()
        back = time.monotonic()
        assert wait_until(lambda: _answers(cl, high, y_high), timeout=20.0, interval=0.05)
        took = time.monotonic() - back
        link = cl.ping()["workers"][1]
        assert link["healthy"] and link["pid"] == wc.pid and link["reconnects"] >= 1
        np.testing.assert_allclose(cl.forward(low), y_low, **TOL)
    print(f"worker on C back in service {took:.2f} s after its restart printed LISTENING")


def test_a_worker_on_another_host_sigstopped_delays_only_what_needs_it(served, steered):
    (low, y_low), (high, y_high) = steered
    timeout = served.WORKER_TIMEOUT
    wc, gw = served.wc, served.gw
    with GatewayClient(gw.url, timeout=30.0) as cl:
        assert _answers(cl, high, y_high)
        os.kill(wc.pid, signal.SIGSTOP)
        try:
            stuck: list = []

            def need_it():
                with GatewayClient(gw.url, timeout=30.0) as cs:
                    t = time.monotonic()
                    try:
                        cs.forward(high)
                        stuck.append(("answered", time.monotonic() - t))
                    except P.RemoteError as e:
                        stuck.append((e.code, time.monotonic() - t))
            threads = [threading.Thread(target=need_it) for _ in range(2)]
            for t in threads:
                t.start()
            time.sleep(0.5)
            worst = 0.0
            for _ in range(10):
                t0 = time.monotonic()
                np.testing.assert_allclose(cl.forward(low), y_low, **TOL)
                worst = max(worst, time.monotonic() - t0)
            for t in threads:
                t.join(40)
            assert worst < timeout / 2, worst
            assert [s[0] for s in stuck] == [P.UNAVAILABLE] * 2, stuck
            assert all(s[1] < timeout + 5.0 for s in stuck), stuck
        finally:
            os.kill(wc.pid, signal.SIGCONT)
        assert wait_until(lambda: _answers(cl, high, y_high), timeout=30.0, interval=0.1)
