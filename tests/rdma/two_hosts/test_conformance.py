"""The conformance kit across the link: the listener on host A's device (rxa, chosen by its
address), every client on host B's (rxb): in-process clients by ``device=``, the kit's peer
processes as host B's user with B's environment. Every message crosses both veths and the
bridge (RoCE v2 and the TCP side channel of the peer processes)."""
from __future__ import annotations

import numpy as np
import pytest

from transport.testing import conformance

pytestmark = [pytest.mark.rdma, pytest.mark.timeout(240)]


class TwoHostEnv(conformance.PairEnv):
    def __init__(self, server, client, **kw):
        self.server_host, self.client_host = server, client
        super().__init__(lambda: f"rdma://{server.ip}:0", name="rdma-two-hosts", **kw)

    def conn_options(self, **overrides):
        return {**self.options, "device": self.client_host.device, **overrides}

    def listen(self, url=None, **options):
        options.setdefault("device", self.server_host.device)
        return super().listen(url, **options)


@pytest.fixture
def env(hosts):
    a, b = hosts["a"], hosts["b"]
    with TwoHostEnv(a, b, slack=3.0, peer_python=b.python, peer_env=b.env()) as env:
        yield env


def test_a_pair_really_spans_the_two_devices(env, hosts):
    """What the kit's pairs are: server on rxa, client on rxb, and the bytes cross A's veth."""
    before = hosts.counters(hosts["a"])
    client, server = env.pair()
    assert client.device.device == "rxb" and server.device.device == "rxa"
    assert client.device.ipv4 == hosts["b"].ip and server.device.ipv4 == hosts["a"].ip
    s = client.alloc(1 << 20)
    np.frombuffer(s.buf, np.uint8)[:] = 0x5A
    client.send({"n": 1}, [s])
    m = server.recv(timeout=30)
    assert bytes(m.buffers[0]) == b"\x5a" * (1 << 20)
    m.release()
    after = hosts.counters(hosts["a"])
    assert after["rx_bytes"] - before["rx_bytes"] >= 1 << 20


@pytest.mark.parametrize("check", conformance.CHECKS, ids=conformance.check_ids())
def test_conformance_across_the_link(env, check):
    check(env)
