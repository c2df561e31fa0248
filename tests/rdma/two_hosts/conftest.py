"""Two-host fixtures: hosts A, B and C in the soft-RoCE guest, each with its own rxe device,
address and user, joined by a bridge the tests can break (tests/rxe/hosts.py).

``link`` is made once per session (root only: it changes the guest's routing); after each
test ``hosts`` undoes whatever fault the test left (qdiscs, cut cables, MTUs, deleted
devices). ``on_hosts`` starts moe-worker / moe-gateway processes on a chosen host, as that
host's user, and stops them all at the end. Outside the guest (no device, not root) these
tests skip, and the guest's harness counts a skip as a failure.
"""
from __future__ import annotations

import os
import sys
from typing import Sequence

import pytest

from tests.helpers_procs import Service, Services
from transport.service.launch import blas_env, spawn_service
from workers.flags import worker_argv

START_TIMEOUT = 120.0  # a Python start costs seconds under TCG, more with three at once


@pytest.fixture(scope="session")
def link(rdma_device, shared_secret):
    if os.geteuid() != 0:
        pytest.skip("the two-host link changes the guest's routing: needs root (the rxe guest runs as root)")
    from tests.rxe.hosts import Link
    with Link(("a", "b", "c"), secret=shared_secret) as lk:
        yield lk


@pytest.fixture
def hosts(link):
    yield link
    link.restore()


class HostServices(Services):
    """:class:`tests.helpers_procs.Services` whose processes run on a chosen host."""

    def on(self, host, argv: Sequence[str], timeout: float = START_TIMEOUT) -> Service:
        proc, url = spawn_service(host.argv(argv), timeout=timeout, env=host.env(blas_env(1)))
        s = Service(proc, url, argv)
        self.services.append(s)
        return s

    def worker(self, host, experts, *, url: str = "", **kw) -> Service:  # type: ignore[override]
        kw.setdefault("python", sys.executable)
        return self.on(host, worker_argv(url or f"rdma://{host.ip}:0", experts, **kw))

    def gateway(self, host, workers: Sequence[str], **flags) -> Service:  # type: ignore[override]
        """A gateway on ``host`` over rdma:// to ``workers``; its clients reach it on tcp
        (the client path is not the link under test)."""
        argv = [sys.executable, "-m", "gateway.cli", "--listen", "tcp://127.0.0.1:0", "--workers", ",".join(workers)]
        for k, v in flags.items():
            if v is None or v is False:
                continue
            argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
        return self.on(host, argv)


@pytest.fixture
def on_hosts(hosts):
    with HostServices() as services:
        yield services


class Cluster:
    """A gateway on host A serving a worker on B (experts 0-3, "low") and one on C (4-7,
    "high"), random weights (tests/test_fault_workers.py's model), shared by a module's
    tests: every Python start costs seconds in the guest."""

    WORKER_TIMEOUT = 5.0

    def __init__(self, services: HostServices, link):
        from tests.test_fault_workers import D, E, F, HIGH, K, LOW, MAX_BATCH, ROWS, SEED
        self.services, self.link = services, link
        a, b, c = link.hosts
        self._worker_args = dict(d_model=D, d_ff=F, seed=SEED, max_tokens=ROWS)
        self.wb = services.worker(b, LOW, **self._worker_args)
        self.wc = services.worker(c, HIGH, **self._worker_args)
        self._high = HIGH
        self.gw = services.gateway(a, [self.wb.url, self.wc.url], d_model=D, d_ff=F, n_experts=E, top_k=K,
                                   seed=SEED, max_batch_tokens=MAX_BATCH, max_wait_ms=0,
                                   worker_timeout=self.WORKER_TIMEOUT, connect_timeout=60)

    def restart_c(self) -> Service:
        """C's worker again, on the same URL (after a test killed it)."""
        if self.wc.alive():
            self.wc.kill()
        self.services.services.remove(self.wc)
        self.wc = self.services.worker(self.link["c"], self._high, url=self.wc.url, **self._worker_args)
        return self.wc

    def ensure_healthy(self, timeout: float = 60.0) -> None:
        """Both workers alive and used by the gateway (a test may have left C dead or lost)."""
        from gateway.client import GatewayClient
        from tests.helpers_procs import wait_until
        assert self.gw.alive() and self.wb.alive()
        if not self.wc.alive():
            self.restart_c()
        with GatewayClient(self.gw.url, timeout=30.0) as cl:
            assert wait_until(lambda: all(w["healthy"] for w in cl.ping()["workers"]), timeout=timeout,
                              interval=0.1), cl.ping()["workers"]


@pytest.fixture(scope="module")
def cluster(link):
    with HostServices() as services:
        yield Cluster(services, link)


@pytest.fixture
def served(hosts, cluster):
    """The module's cluster, healthy, on a link with no fault (restored after the test)."""
    cluster.ensure_healthy()
    return cluster


def verbs_contexts(pid: int) -> int:
    """Open RDMA device contexts of ``pid`` (one per rdma:// connection): a leak check that
    needs nothing from the process itself."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/infiniband/uverbs"):
                n += 1
        except OSError:
            pass
    return n
