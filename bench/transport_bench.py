"""`moe-bench transport`: perftest-style latency and bandwidth, ours beside the raw peers.

Latency is half the round trip (ping-pong against an echo server in another process,
perftest's convention), reported as perftest does: iterations, t_min, t_typical (the
median), t_avg, t_max, t_stdev, 99% and 99.9% percentiles, in usec. Bandwidth streams a
window of messages one way until the receiver acknowledges the last.

Two figures per size for every implementation:

- descriptor: the message is passed and its payload never touched (on shared memory, a
  slot index: the same at 64 B as at 16 MiB);
- data: the sender writes every payload byte and the receiver reads (and checks) every
  payload byte, both ways, with the same code for every implementation (bench.payload).

Implementations are interleaved per size so machine noise hits them alike. A size larger
than an implementation's largest message is reported as not carried and the run goes on;
the JSON (with provenance) is rewritten after every size, so an interrupted run keeps
what it measured. Progress goes to stderr, the report to stdout.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from typing import Optional

import numpy as np

from . import floors, peers, perftest, report
from .provenance import provenance, write_json_atomic
from .stats import min_samples

DEFAULT_SIZES = [64, 256, 1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
QUICK_SIZES = [64, 4 << 10, 1 << 20]
FIGURES = ("descriptor", "data")
BURSTS = 3
BURST_BYTES = 64 << 20
SHARED = ("pipe", "pyzmq")  # peers measured once per medium and shown beside every backend


def parse_size(s: str) -> int:
    s = s.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    n = int(s[:-1] if mult > 1 else s) * mult
    if n < 0:
        raise argparse.ArgumentTypeError(f"a size is >= 0 bytes, got {s}")
    return n


def _sizes(s: str) -> list[int]:
    """Sizes in the order given (the run measures them so), each once."""
    try:
        sizes = list(dict.fromkeys(parse_size(x) for x in s.split(",") if x.strip()))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"sizes like 64,4K,1M: {e}") from None
    if not sizes:
        raise argparse.ArgumentTypeError(f"sizes like 64,4K,1M, got {s!r}")
    return sizes


def _figures(s: str) -> list[str]:
    out = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in out if x not in FIGURES]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"figures: a comma-separated subset of {','.join(FIGURES)}")
    return [f for f in FIGURES if f in out]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from transport.service import options

    p.add_argument("--backend", action="append", choices=["tcp", "shm", "rdma"],
                   help="repeatable; default tcp and shm")
    p.add_argument("--sizes", type=_sizes, metavar="SIZES",
                   help="message sizes in bytes, comma-separated, K/M suffixes: e.g. 64,4K,1M "
                        "(default 64 B .. 16 MiB; --quick: 64,4K,1M)")
    p.add_argument("--iters", type=options.positive, default=2000,
                   help="round trips per size up to 64 KiB, scaled down above (at least 20); --quick at most 300")
    p.add_argument("--warmup-iters", type=options.count, default=None, metavar="N",
                   help="untimed round trips before each size (default: 10%% of its iterations, at least 5); "
                        "a count, where moe-bench load's --warmup is seconds")
    p.add_argument("--figures", type=_figures, default=list(FIGURES), metavar="descriptor,data",
                   help="descriptor (payload not touched), data (every payload byte written and read), "
                        "or both")
    p.add_argument("--stream-count", type=options.positive, default=None, metavar="N",
                   help="messages per streaming burst (default: 64 MiB / size, 50 .. 5000)")
    p.add_argument("--slot-size", type=parse_size, default=None, metavar="BYTES",
                   help="moe-transport's slot size in bytes, i.e. its largest message (default: the largest "
                        "size measured); larger sizes are reported as not carried")
    p.add_argument("--repeat", type=options.positive, default=None, metavar="N",
                   help="measure every size N times, interleaved; tables and targets use the median repeat, "
                        "and a row whose repeats disagree is flagged noisy instead of judged (default: 3 "
                        "with --quick, else 1)")
    p.add_argument("--cpus", type=options.cpu_list, default=None, metavar="CLIENT,SERVER",
                   help="pin the timed client to the first CPU and every echo server to the second "
                        "(default: no pinning)")
    options.alias(p, "--pin", "--cpus", type=options.cpu_list)
    p.add_argument("--server-device", metavar="DEV", default=None,
                   help="rdma: the echo side's device (its address is the URL's), the timed side keeps its own "
                        "(MOE_RDMA_DEVICE or found): two hosts across a link; perftest runs the same way")
    p.add_argument("--no-peers", action="store_true", help="measure moe-transport only")
    p.add_argument("--quick", action="store_true", help="a short sweep for smoke runs")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON (rewritten after every size)")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of latency and bandwidth vs size, both figures")


def validate(args: argparse.Namespace) -> None:
    """--cpus names two CPUs this process may use (args.pin: (client, server) or None);
    --repeat's default."""
    from transport.service.options import UsageError

    args.pin = None
    if args.cpus is not None:
        if len(args.cpus) != 2:
            raise UsageError(f"--cpus takes two CPUs, the client's and the echo servers', e.g. 0,1; got "
                             f"{','.join(map(str, args.cpus))}")
        have = os.sched_getaffinity(0)
        bad = [c for c in args.cpus if c not in have]
        if bad:
            raise UsageError(f"--cpus {','.join(map(str, bad))}: this process may run on CPUs "
                             f"{','.join(map(str, sorted(have)))} only")
        args.pin = (args.cpus[0], args.cpus[1])
    if args.repeat is None:
        args.repeat = 3 if args.quick else 1


def _iters(size: int, iters: int) -> int:
    return max(20, min(iters, iters * (64 << 10) // max(size, 1)))


def _warmup(n: int, warmup: Optional[int]) -> int:
    return warmup if warmup is not None else max(5, n // 10)


def _count(size: int, count: Optional[int] = None) -> int:
    return count if count else max(50, min(5000, BURST_BYTES // max(size, 1)))


def lat_stats(samples_us: np.ndarray) -> dict:
    """perftest's latency columns from one-way samples (usec): t_min, t_typical (median,
    ``p50``), t_avg, t_max, t_stdev (sample standard deviation), 99% and 99.9%; with the
    sample count and whether it supports each tail percentile."""
    a = np.asarray(samples_us, float)
    n = len(a)
    if n == 0:
        raise ValueError("no samples")
    p = np.percentile(a, [50, 99, 99.9])
    return {"min": float(a.min()), "p50": float(p[0]), "avg": float(a.mean()), "max": float(a.max()),
            "stdev": float(a.std(ddof=1)) if n > 1 else 0.0, "p99": float(p[1]), "p999": float(p[2]),
            "samples": n, "reliable": {"p99": n >= min_samples(99), "p999": n >= min_samples(99.9)}}


def measure(peer: peers.Peer, size: int, iters: int, figure: str = "descriptor",
            warmup: Optional[int] = None, stream_count: Optional[int] = None) -> dict:
    data = figure == "data"
    # fewer round trips for large sizes bound the time spent moving bytes; a descriptor
    # figure that moves none (shm's slot index) costs the same at any size, and its
    # "size-independent" targets need as many samples at 16 MiB as at 64 B
    n = iters if not data and not peer.descriptor_moves_bytes else _iters(size, iters)
    warm = _warmup(n, warmup)
    ping = peer.ping_data if data else peer.ping
    send = peer.send_one_data if data else peer.send_one
    peer.command("ping", size, warm + n, data)
    for _ in range(warm):
        ping(size)
    samples = np.empty(n)
    clock = time.perf_counter
    for i in range(n):
        t0 = clock()
        ping(size)
        samples[i] = clock() - t0
    peer.finish()
    lat = lat_stats(samples * 1e6 / 2.0)  # perftest convention: half the round trip

    count = _count(size, stream_count)
    dts = []
    for _ in range(BURSTS):
        peer.command("stream", size, count, data)
        t0 = clock()
        for _ in range(count):
            send(size)
        peer.wait_ack()
        dts.append(clock() - t0)
        peer.finish()
    d = np.array(dts)
    rec = {"impl": peer.impl, "backend": peer.backend, "label": peer.label, "figure": figure, "size": size,
           "carried": True, "iters": n, "warmup": warm, "lat_us": lat,
           "bw_gbps": float(size * count / d.mean() / 1e9), "bw_peak_gbps": float(size * count / d.min() / 1e9),
           "msg_rate": float(count / d.mean()), "stream_count": count, "bursts": BURSTS}
    if not data and not peer.descriptor_moves_bytes:
        # a slot index passed around moves no payload: size x messages/s would be a bandwidth
        # nothing achieved; the message rate stands, the data figure has the GB/s
        rec.update(bw_gbps=None, bw_peak_gbps=None,
                   bw_note="no payload byte moves in the descriptor figure: see msg_rate, and the data figure")
    return rec


def _url(backend: str, server_device: Optional[str] = None) -> str:
    if backend == "tcp":
        return "tcp://127.0.0.1:0"
    if backend == "shm":
        return f"shm://moe-bench-{uuid.uuid4().hex[:8]}"
    if server_device:
        from transport.rdma_device import pick_device
        return f"rdma://{pick_device(device=server_device).ipv4}:0"
    ip = os.environ.get("MOE_RDMA_IP")
    if not ip:  # the IPv4 of the RoCE v2 GID rdma:// would pick (10.0.2.15 in the rxe guest)
        from transport.rdma_device import pick_device
        ip = pick_device().ipv4
    return f"rdma://{ip}:0"


def make_peers(backend: str, max_size: int, with_peers: bool, *, slot_size: Optional[int] = None,
               server_cpu: Optional[int] = None, server_device: Optional[str] = None) -> list[peers.Peer]:
    server_device = server_device if backend == "rdma" else None
    ps = _make_peers(backend, max_size, with_peers, slot_size, server_cpu, server_device)
    if server_device:
        for p in ps:
            p.server_env = {"MOE_RDMA_DEVICE": server_device}
    return ps


def _make_peers(backend, max_size, with_peers, slot_size, server_cpu, server_device) -> list[peers.Peer]:
    url = _url(backend, server_device)
    ours: list[peers.Peer] = [peers.MoeTransportPeer(max_size, url, slot_size=slot_size, server_cpu=server_cpu)]
    if not with_peers:
        return ours
    others: list[peers.Peer] = []
    if backend in ("shm", "rdma", "tcp"):
        from transport import rdma_conn, shm, stream
        built = {"shm": shm.NATIVE_AVAILABLE, "tcp": stream.NATIVE_AVAILABLE}.get(backend, rdma_conn._rdmafast is not None)
        if built:  # else both rows would be the Python path
            others.append(peers.MoeTransportPeer(max_size, _url(backend, server_device), slot_size=slot_size, native=False,
                                                 server_cpu=server_cpu))
    floor = {"tcp": peers.RawTcpPeer, "shm": floors.ShmFloorPeer, "rdma": floors.RdmaFloorPeer}[backend]
    others.append(floor(max_size, server_cpu=server_cpu))
    try:
        import zmq  # noqa: F401
        others.append(peers.ZmqPeer(max_size, transport=report.zmq_medium(backend), server_cpu=server_cpu))
    except ImportError:
        print("note: pyzmq is not installed here; its rows are left out (pip install 'moe-transport[bench]')",
              file=sys.stderr)
    others.append(peers.PipePeer(max_size, server_cpu=server_cpu))
    return ours + others


def spin_settings(backends: list[str]) -> dict:
    """How each implementation waits for a message (the figures depend on it)."""
    out = {}
    if "shm" in backends:
        try:
            from transport import shm
            out["shm"] = (f"moe-transport busy-polls {shm.SPIN * 1e6:g} us, then sleeps (the spin adapts "
                          f"down to {shm.SPIN_MIN * 1e6:g} us); the bare slot handoff busy-polls without limit")
        except Exception as e:  # pragma: no cover - shm always imports here
            out["shm"] = f"unknown ({type(e).__name__})"
    if "tcp" in backends:
        out["tcp"] = "blocking poll(2) (no spin) for moe-transport and the raw socket"
    if "rdma" in backends:
        try:
            from transport.rdma import DEFAULT_SPIN
            out["rdma"] = (f"moe-transport busy-polls the CQ {DEFAULT_SPIN * 1e6:g} us, then sleeps on the "
                           f"completion channel; the bare pyverbs loop busy-polls without limit")
        except Exception as e:
            out["rdma"] = f"unknown ({type(e).__name__}: {e})"
    out["peers"] = "pyzmq and multiprocessing.Pipe block in the kernel (no spin)"
    return out


def _perftest_row(size: int, iters: int, stream_count: Optional[int] = None,
                  server_device: Optional[str] = None) -> dict:
    """perftest on the same device(s), same size, comparable counts (rdma only)."""
    from transport.rdma_device import pick_device

    if not perftest.available():
        raise RuntimeError("perftest (ib_send_lat, ib_send_bw, ib_write_bw) is not installed; "
                           "apt-get install perftest, or pass --no-peers")
    server = pick_device(device=server_device) if server_device else None
    row = perftest.measure(size, _iters(size, iters), _count(size, stream_count), server=server)
    row.update(figure="descriptor", carried=True, label="perftest")
    return row


def not_carried(p: peers.Peer, figure: str, size: int) -> dict:
    return {"impl": p.impl, "backend": p.backend, "label": p.label, "figure": figure, "size": size,
            "carried": False, "max_message": p.max_message, "note": f"not carried (max {p.max_message} B)"}


def failed(impl: str, backend: str, label: str, figure: str, size: int, why: str) -> dict:
    return {"impl": impl, "backend": backend, "label": label, "figure": figure, "size": size, "error": why}


def settings_of(args, backends, sizes, iters, figures) -> dict:
    try:
        affinity = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return {"backends": backends, "sizes": sizes, "figures": figures, "iterations": iters,
            "iterations_rule": f"{iters} round trips per size up to 64 KiB, iters * 64 KiB / size above "
                               f"(at least 20); {iters} at every size where no payload byte moves "
                               f"(the shm descriptor figure)",
            "warmup": args.warmup_iters, "warmup_rule": (f"{args.warmup_iters} untimed round trips per size"
                                                  if args.warmup_iters is not None else
                                                  "10% of each size's iterations (at least 5), untimed"),
            "stream": {"bursts": BURSTS, "messages": (f"{args.stream_count}" if args.stream_count else
                                                      "64 MiB / size per burst, 50 .. 5000"),
                       "bandwidth": "mean over the bursts (bw_peak_gbps: the fastest burst)"},
            "slot_size": args.slot_size, "nslots": 8, "repeat": getattr(args, "repeat", 1),
            "pinning": None if args.pin is None else {"client_cpu": args.pin[0], "server_cpu": args.pin[1]},
            "affinity": affinity, "spin": spin_settings(backends), "peers": not args.no_peers,
            "server_device": getattr(args, "server_device", None),
            "latency": "one-way = half the round trip (perftest's convention), usec",
            "figure_meaning": {"descriptor": "the payload is never touched (a slot index on shm)",
                               "data": "the sender writes and the receiver reads every payload byte, both ways "
                                       "(bench.payload: the same work for every implementation)"}}


def run(args: argparse.Namespace) -> int:
    if not hasattr(args, "pin"):  # run without bench.cli's validation
        validate(args)
    backends = args.backend or ["tcp", "shm"]
    sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    iters = min(args.iters, 300) if args.quick else args.iters
    figures = list(args.figures)
    if not sizes:
        raise SystemExit("moe-bench transport: no sizes")
    max_size = max(sizes)
    doc: dict = {"provenance": provenance(), "settings": settings_of(args, backends, sizes, iters, figures),
                 "complete": False, "interrupted": False, "results": [], "ratios": {}, "targets": [],
                 "references": []}
    results: list[dict] = doc["results"]

    def save() -> None:
        if args.json:
            report.transport_summary(doc)
            write_json_atomic(args.json, doc)

    save()
    old_affinity = None
    if args.pin is not None:
        old_affinity = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {args.pin[0]})
    report.print_plan(backends, sizes, figures, args.repeat, iters)
    progress = report.Progress(total=len(backends) * len(sizes))
    measured: set = set()  # (impl, medium, figure, size) of the shared peers already measured
    try:
        for backend in backends:
            try:
                ps = make_peers(backend, max_size, not args.no_peers, slot_size=args.slot_size,
                                server_cpu=None if args.pin is None else args.pin[1],
                                server_device=args.server_device)
            except Exception as e:
                print(f"{backend}: cannot run here: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                for size in sizes:
                    for fig in figures:
                        results.append(failed("moe-transport", backend, "moe-transport", fig, size,
                                              f"{type(e).__name__}: {e}"))
                save()
                continue
            started: list[peers.Peer] = []
            dead: dict = {}
            try:
                for p in ps:
                    if p.impl in SHARED and all((p.impl, p.backend, f, s) in measured for f in figures for s in sizes):
                        continue  # measured beside an earlier backend: shown from there
                    try:
                        started.append(p.start())
                    except Exception as e:
                        why = f"{type(e).__name__}: {e}"
                        print(f"{p.label} ({p.backend}): could not start: {why}", file=sys.stderr, flush=True)
                        p.stop()
                        dead[id(p)] = why
                        started.append(p)
                def one(p: peers.Peer, size: int, fig: str) -> dict:
                    if id(p) in dead:
                        return failed(p.impl, p.backend, p.label, fig, size, dead[id(p)])
                    if not p.carries(size):
                        return not_carried(p, fig, size)
                    try:
                        return measure(p, size, iters, fig, args.warmup_iters, args.stream_count)
                    except (Exception) as e:  # the peer is unusable now: report, stop it, go on
                        why = f"{type(e).__name__}: {e}"
                        print(f"{p.label} ({p.backend}) {report.human(size)} {fig}: failed: {why}",
                              file=sys.stderr, flush=True)
                        dead[id(p)] = why
                        p.stop()
                        return failed(p.impl, p.backend, p.label, fig, size, why)

                for size in sizes:
                    for fig in figures:
                        todo = [p for p in started
                                if not (p.impl in SHARED and (p.impl, p.backend, fig, size) in measured)]
                        reps: dict = {id(p): [] for p in todo}
                        for _ in range(args.repeat):  # interleaved: the machine's noise hits every one alike
                            for p in todo:
                                reps[id(p)].append(one(p, size, fig))
                        for p in todo:
                            results.append(report.combine_repeats(reps[id(p)]))
                            if p.impl in SHARED:
                                measured.add((p.impl, p.backend, fig, size))
                        if backend == "rdma" and fig == "descriptor" and not args.no_peers:
                            # perftest carries what the device does: the bare loop learnt its max_msg_sz
                            floor = next((p for p in started if p.impl == "raw" and id(p) not in dead), None)
                            if floor is not None and not floor.carries(size):
                                results.append({"impl": "perftest", "backend": "rdma", "label": "perftest",
                                                "figure": fig, "size": size, "carried": False,
                                                "max_message": floor.max_message,
                                                "note": f"not carried (max {floor.max_message} B)"})
                            else:
                                try:
                                    results.append(_perftest_row(size, iters, args.stream_count,
                                                                 args.server_device))
                                except Exception as e:
                                    results.append(failed("perftest", "rdma", "perftest", fig, size,
                                                          f"{type(e).__name__}: {e}"))
                    progress.advance(f"{backend} {report.human(size)}")
                    save()
            finally:
                for p in started:
                    p.stop()
    except KeyboardInterrupt:
        doc["interrupted"] = True
        print("interrupted: reporting (and writing) what was measured so far", file=sys.stderr, flush=True)
    finally:
        progress.close()
        if old_affinity is not None:
            os.sched_setaffinity(0, old_affinity)
    doc["complete"] = not doc["interrupted"]
    report.transport_summary(doc)
    if args.json:
        write_json_atomic(args.json, doc)
        print(f"wrote {args.json}", file=sys.stderr)
    report.print_transport(doc)
    if args.plot:
        report.plot_transport(results, args.plot)
    if doc["interrupted"]:
        return 130
    return 1 if any("error" in r for r in results) else 0
