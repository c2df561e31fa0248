"""The two-host harness itself: what a host can reach and where its packets go."""
from __future__ import annotations

import subprocess
import time

import pytest

from tests.rxe.hosts import sh

pytestmark = [pytest.mark.rdma, pytest.mark.timeout(120)]


def test_each_host_reaches_the_others_through_its_own_cable_and_nothing_else(hosts):
    a, b, c = hosts.hosts
    for h in (a, b, c):
        for o in (a, b, c):
            if o is h:
                continue
            route = sh("ip", "route", "get", o.ip, "uid", str(h.uid))
            assert f"dev {h.netdev}" in route and f"src {h.ip}" in route, route
        # no default route: an address off the link is unreachable from a host
        r = sh("ip", "route", "get", "192.0.2.1", "uid", str(h.uid), check=False)
        assert f"dev {h.netdev}" not in r
        assert h.gid_index() is not None and h.port_state() == "ACTIVE"


def test_a_host_user_s_tcp_and_rdma_cross_the_bridge(hosts):
    """ib_send_lat from host B to host A (perftest's own TCP exchange as B's user), counted
    on A's veth; the TCP side channel and the RoCE datagrams both come in through it."""
    a, b = hosts["a"], hosts["b"]
    before = hosts.counters(a)
    srv = a.popen(["ib_send_lat", "-d", a.device, "-x", str(a.gid_index()), "-n", "200", "-F"],
                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = ""
        for _ in range(20):
            r = b.run(["ib_send_lat", "-d", b.device, "-x", str(b.gid_index()), "-n", "200", "-F", a.ip], timeout=60)
            out = r.stdout + r.stderr
            if r.returncode == 0:
                break
            time.sleep(0.5)  # the server is not listening yet
        assert r.returncode == 0, out
    finally:
        srv.kill()
        srv.wait(10)
    assert "Failed" not in out and " 2 " in out
    got = hosts.counters(a)
    assert got["rx_packets"] - before["rx_packets"] >= 200 and got["tx_packets"] - before["tx_packets"] >= 200
