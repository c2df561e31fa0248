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
from workers.cli import worker_argv

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
