"""`moe-bench transport`: perftest-style latency and bandwidth, ours beside the raw peers.

Latency is half the round trip (ping-pong against an echo server in another process);
bandwidth streams a window of messages one way until the receiver acknowledges the last.
Implementations are interleaved per size so machine noise hits them alike.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
import uuid

import numpy as np

from . import peers, report

DEFAULT_SIZES = [64, 256, 1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
QUICK_SIZES = [64, 4 << 10, 1 << 20]


def parse_size(s: str) -> int:
    s = s.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(s[:-1] if mult > 1 else s) * mult


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", action="append", choices=["tcp", "shm", "rdma"],
                   help="repeatable; default tcp and shm")
    p.add_argument("--sizes", type=lambda s: [parse_size(x) for x in s.split(",")],
                   help="comma-separated, e.g. 64,4K,1M (default 64 B .. 16 MiB)")
    p.add_argument("--iters", type=int, default=2000, help="round trips per small size")
    p.add_argument("--no-peers", action="store_true", help="measure moe-transport only")
    p.add_argument("--quick", action="store_true", help="a short sweep for smoke runs")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of latency and bandwidth vs size")


def _iters(size: int, iters: int) -> int:
    return max(20, min(iters, iters * (64 << 10) // max(size, 1)))


def _count(size: int) -> int:
    return max(50, min(5000, (64 << 20) // max(size, 1)))


def lat_stats(samples_us: np.ndarray) -> dict:
    p = np.percentile(samples_us, [50, 99, 99.9])
    return {"min": float(samples_us.min()), "p50": float(p[0]), "avg": float(samples_us.mean()),
            "p99": float(p[1]), "p999": float(p[2])}


def measure(peer: peers.Peer, size: int, iters: int) -> dict:
    warm = max(10, iters // 10)
    n = _iters(size, iters)
    peer.command("ping", size, warm + n)
    for _ in range(warm):
        peer.ping(size)
    samples = np.empty(n)
    clock = time.perf_counter
    for i in range(n):
        t0 = clock()
        peer.ping(size)
        samples[i] = clock() - t0
    peer.finish()
    lat = lat_stats(samples * 1e6 / 2.0)  # perftest convention: half the round trip

    count = _count(size)
    rates = []
    for _ in range(3):
        peer.command("stream", size, count)
        t0 = clock()
        for _ in range(count):
            peer.send_one(size)
        peer.wait_ack()
        dt = clock() - t0
        peer.finish()
        rates.append(dt)
    dts = np.array(rates)
    return {"impl": peer.impl, "backend": peer.backend, "size": size, "lat_us": lat,
            "bw_gbps": float(size * count / dts.mean() / 1e9),
            "bw_peak_gbps": float(size * count / dts.min() / 1e9),
            "msg_rate": float(count / dts.mean()), "iters": n, "stream_count": count}


def _url(backend: str) -> str:
    if backend == "tcp":
        return "tcp://127.0.0.1:0"
    if backend == "shm":
        return f"shm://moe-bench-{uuid.uuid4().hex[:8]}"
    ip = os.environ.get("MOE_RDMA_IP")
    if not ip:  # the IPv4 of the RoCE v2 GID rdma:// would pick (10.0.2.15 in the rxe guest)
        from transport.rdma_device import pick_device
        ip = pick_device().ipv4
    return f"rdma://{ip}:0"


def make_peers(backend: str, max_size: int, with_peers: bool) -> list[peers.Peer]:
    ours: list[peers.Peer] = [peers.MoeTransportPeer(max_size, _url(backend))]
    if not with_peers:
        return ours
    others: list[peers.Peer] = []
    if backend == "tcp":
        others.append(peers.RawTcpPeer(max_size))
    elif backend == "shm":
        others.append(peers.ShmFloorPeer(max_size))
    elif backend == "rdma":
        others.append(peers.RdmaFloorPeer(max_size))
    try:
        import zmq  # noqa: F401
        others.append(peers.ZmqPeer(max_size))
    except ImportError:
        print("note: pyzmq is not installed here; its rows are left out")
    others.append(peers.PipePeer(max_size))
    return ours + others


def _perftest_row(size: int, iters: int) -> dict:
    """perftest on the same device, same size, comparable counts (rdma only)."""
    from . import perftest
    if not perftest.available():
        raise SystemExit("moe-bench transport --backend rdma: perftest (ib_send_lat, ib_send_bw, "
                         "ib_write_bw) is not installed; apt-get install perftest, or pass --no-peers")
    return perftest.measure(size, _iters(size, iters), _count(size))


def run(args: argparse.Namespace) -> int:
    backends = args.backend or ["tcp", "shm"]
    sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    iters = min(args.iters, 300) if args.quick else args.iters
    max_size = max(sizes)
    results: list[dict] = []
    progress = report.Progress(total=len(backends) * len(sizes))
    shared_peers: dict[str, dict] = {}  # pipe/pyzmq measured once, shown beside every backend
    for backend in backends:
        ps = make_peers(backend, max_size, not args.no_peers)
        started = []
        try:
            for p in ps:
                started.append(p.start())
            for size in sizes:
                for p in started:
                    key = f"{p.impl}/{p.backend}/{size}"
                    if p.impl in ("pipe", "pyzmq") and key in shared_peers:
                        continue
                    rec = measure(p, size, iters)
                    results.append(rec)
                    if p.impl in ("pipe", "pyzmq"):
                        shared_peers[key] = rec
                if backend == "rdma" and not args.no_peers:
                    results.append(_perftest_row(size, iters))
                progress.advance(f"{backend} {report.human(size)}")
        finally:
            for p in started:
                p.stop()
    progress.close()
    ratios = report.ratios(results)
    out = {"meta": {"host": platform.node(), "python": platform.python_version(),
                    "cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "iters": iters, "sizes": sizes, "backends": backends},
           "results": results, "ratios": ratios}
    report.print_transport(results, ratios)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        report.plot_transport(results, args.plot)
    return 0
