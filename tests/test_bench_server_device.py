"""`moe-bench transport --server-device`: the echo side runs with another RDMA device (two
hosts across a link), the timed side keeps its own; perftest's server and client likewise.
Checked without a device: the server environment reaches the forked echo side, and
perftest's command lines name each side's device and the server's address."""
from __future__ import annotations

import os

from bench import peers, perftest, transport_bench
from transport.rdma_device import DeviceChoice


class _EnvPeer(peers.Peer):
    impl, backend, label = "env", "test", "env"

    def serve_setup(self):
        return os.environ.get("MOE_RDMA_DEVICE")

    def client_setup(self, server_info):
        self.seen = server_info


def test_the_echo_side_runs_with_the_server_environment_and_the_timed_side_does_not(monkeypatch):
    monkeypatch.setenv("MOE_RDMA_DEVICE", "rxa")
    p = _EnvPeer(64)
    p.server_env = {"MOE_RDMA_DEVICE": "rxb"}
    try:
        p.start()
        assert p.seen == "rxb"
    finally:
        p.stop()
    assert os.environ["MOE_RDMA_DEVICE"] == "rxa"
    assert peers.Peer.server_env == {}  # a class default nobody shares by accident


def test_server_device_only_applies_to_rdma():
    ps = transport_bench.make_peers("tcp", 4096, False, server_device="rxb")
    assert [p.server_env for p in ps] == [{}]


def test_perftest_runs_its_server_on_the_server_device_and_connects_to_its_address(monkeypatch):
    a = DeviceChoice("rxa", 1, 1, "0000:0000:0000:0000:0000:ffff:c612:0001", "198.18.0.1", True)
    b = DeviceChoice("rxb", 1, 3, "0000:0000:0000:0000:0000:ffff:c612:0002", "198.18.0.2", True)
    calls = []

    class _Proc:
        def __init__(self, args, **kw):
            calls.append(("server", args))
            self.returncode = 0

        def poll(self):
            return 0

        def wait(self, *a):
            return 0

    class _Done:
        returncode, stdout, stderr = 0, "out", ""

    monkeypatch.setattr(perftest.subprocess, "Popen", _Proc)
    monkeypatch.setattr(perftest.subprocess, "run", lambda args, **kw: calls.append(("client", args)) or _Done())
    monkeypatch.setattr(perftest.time, "sleep", lambda s: None)
    assert perftest.run_tool("ib_send_lat", 64, 10, a, server=b) == "out"
    (_, srv), (_, cli) = calls
    assert srv[srv.index("-d") + 1] == "rxb" and srv[srv.index("-x") + 1] == "3"
    assert cli[cli.index("-d") + 1] == "rxa" and cli[cli.index("-x") + 1] == "1" and cli[-1] == "198.18.0.2"


def test_perftest_latency_parses_a_nan_stdev():
    """ib_send_lat prints t_stdev "-nan" at times (a 1 MiB run across the two-host link did):
    the row is still read, the other columns intact."""
    out = (" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]"
           "   99% percentile[usec]   99.9% percentile[usec] \n"
           " 1048576 62          70119.35        391112.92      166568.54  \t       173669.23     \t-nan   "
           "\t\t391112.92 \t\t391112.92\n")
    assert perftest.parse_lat(out) == {"min": 70119.35, "p50": 166568.54, "avg": 173669.23, "p99": 391112.92,
                                       "p999": 391112.92}
    ok = out.replace("-nan", "12.5")
    assert perftest.parse_lat(ok)["p50"] == 166568.54


def test_a_perftest_pair_that_failed_to_meet_is_run_once_more(monkeypatch):
    """A server that gave up before its client connected costs one retry, not the row."""
    a = DeviceChoice("rxa", 1, 1, "0000:0000:0000:0000:0000:ffff:c612:0001", "198.18.0.1", True)
    tries = []
    lat = (" 64 1000 1.0 9.0 2.0 2.5 0.5 8.0 9.0\n")
    bw = (" 64 1000 10.0 9.0 0.15\n")

    def fake(tool, size, iters, choice, timeout=300, server=None):
        tries.append(tool)
        if len(tries) == 1:
            raise perftest.PerftestError("Couldn't connect")
        return lat if tool == "ib_send_lat" else bw

    monkeypatch.setattr(perftest, "run_tool", fake)
    row = perftest.measure(64, 1000, 1000, a)
    assert tries == ["ib_send_lat", "ib_send_lat", "ib_send_bw", "ib_write_bw"]
    assert row["lat_us"]["p50"] == 2.0 and row["write_bw_gbps"] > 0
    tries.clear()
    monkeypatch.setattr(perftest, "run_tool", lambda *a, **k: (_ for _ in ()).throw(perftest.PerftestError("no")))
    try:
        perftest.measure(64, 10, 10, a)
    except perftest.PerftestError:
        pass
    else:
        raise AssertionError("two failures must raise")
