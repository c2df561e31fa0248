"""`moe-bench chaos`: its flags, their check, the plan it prints first, and the run over
every configuration (one configuration is :class:`bench.chaos.Run`, where each flag's
meaning is)."""
from __future__ import annotations

import argparse
import os
import resource
import tempfile

from bench import chaos_eplb
from bench.chaos import Run
from bench.chaos_clients import Layer
from bench.chaos_report import plot, print_report
from bench.chaos_settings import D_FF, D_MODEL, MAX_BATCH, N_EXPERTS, TOP_K, log
from bench.provenance import provenance, write_json_atomic
from transport.service import options
from transport.service.secrets import read

SETUP_S = 15.0  # a configuration's start, settling and stop beyond its timed phases (measured: 10-20 s)


def _pair(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition(",")
    a = options.seconds(lo)
    b = options.seconds(hi) if hi.strip() else a
    if b < a:
        raise argparse.ArgumentTypeError(f"expected LO,HI seconds with LO <= HI, got {text!r}")
    return a, b


seconds_pair = options.named_type(_pair, "seconds_pair", "LO,HI")


def add_arguments(p: argparse.ArgumentParser) -> None:
    s, n = options.seconds, options.count
    p.add_argument("--backend", action="append", choices=["tcp", "shm"], help="repeatable (default: tcp and shm)")
    p.add_argument("--replicas", action="append", type=int, choices=[1, 2],
                   help="copies of each expert, repeatable (default: 1 and 2)")
    p.add_argument("--placement", dest="workers", action="append", choices=["external", "local"],
                   help="who starts the workers: this tool (external, restarted by it on the same URL) or the "
                        "gateway (its local workers, respawned by it); repeatable (default: external)")
    options.alias(p, "--workers", "--placement", dest="workers", action="append", choices=["external", "local"])
    p.add_argument("--duration", type=options.positive_seconds, default=180.0,
                   help="seconds of chaos per configuration")
    p.add_argument("--warmup", type=s, default=10.0, help="seconds of load before the baseline")
    p.add_argument("--concurrency", dest="clients", type=options.positive, default=2,
                   help="steady well-behaved clients, one thread each")
    options.alias(p, "--clients", "--concurrency", dest="clients", type=options.positive)
    p.add_argument("--pace", type=s, default=0.005, help="a steady client's pause between requests")
    p.add_argument("--deadline", type=options.positive_seconds, default=15.0,
                   help="a request unanswered this long is lost")
    p.add_argument("--worker-timeout", type=options.positive_seconds, default=3.0, help="the gateway's --worker-timeout")
    p.add_argument("--gap", type=seconds_pair, default=(0.5, 2.0), help="pause between chaos actions, drawn in [LO, HI]")
    p.add_argument("--down", type=seconds_pair, default=(0.5, 2.0),
                   help="how long a victim stays down, drawn in [LO, HI]")
    p.add_argument("--stop-fraction", type=options.fraction, default=0.25, help="share of actions that are SIGSTOP")
    p.add_argument("--max-connections", type=options.positive, default=2048, help="the gateway's connection cap")
    p.add_argument("--idle-timeout", type=s, default=60.0, help="the gateway's idle timeout")
    p.add_argument("--hostile-idle", type=n, default=1000, help="idle connections in the p99 comparison")
    p.add_argument("--hostile-half", type=n, default=100, help="half-open handshakes in the p99 comparison")
    p.add_argument("--p99-seconds", type=options.positive_seconds, default=10.0, help="each p99 window")
    p.add_argument("--bg-idle", type=n, default=50, help="idle connections during the chaos")
    p.add_argument("--bg-half", type=n, default=20, help="half-open handshakes during the chaos")
    p.add_argument("--bg-nonreaders", type=n, default=2, help="clients that never read, during the chaos")
    p.add_argument("--bg-garbage", type=n, default=4, help="connections sending garbage, during the chaos")
    p.add_argument("--updates", action="store_true",
                   help="also run hot updates at random (start, advance, finish, rollback) while workers are "
                        "killed and stopped; every answer is checked against the versions it names")
    p.add_argument("--update-gap", type=seconds_pair, default=(0.5, 2.0),
                   help="with --updates: pause between update commands, drawn in [LO, HI]")
    p.add_argument("--seed", type=n, default=0, help="layer weights, tokens and the chaos schedule")
    p.add_argument("--secret-file", default=None, type=options.file_path,
                   help="shared secret (default: a fresh 0600 temporary file)")
    p.add_argument("--log-dir", default=None, metavar="DIR", help="write the services' stderr here (default: discard)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the full report as JSON")
    p.add_argument("--plot", default=None, metavar="PATH", help="a timeline per configuration (PNG)")
    chaos_eplb.add_arguments(p)


def validate(args: argparse.Namespace) -> None:
    if args.deadline <= args.worker_timeout:
        raise options.UsageError(f"--deadline {args.deadline:g} must exceed --worker-timeout {args.worker_timeout:g}: "
                                 "a request the gateway retries would count as lost")


def configurations(args: argparse.Namespace) -> list[tuple[str, int, str]]:
    """(backend, replicas, workers) of every configuration, in the order they run."""
    return [(b, r, k) for b in args.backend or ["tcp", "shm"] for r in args.replicas or [1, 2]
            for k in args.workers or ["external"]]


def plan(args: argparse.Namespace) -> str:
    """What the run will do and about how long it takes, said before it starts."""
    configs = configurations(args)
    each = 3 * args.p99_seconds + args.warmup + args.duration + SETUP_S
    total = each * len(configs)
    names = "; ".join(f"{b} replicas={r} workers={k}" for b, r, k in configs)
    return (f"plan: {len(configs)} configuration(s) ({names}), each {3 * args.p99_seconds:g} s of p99 windows, "
            f"{args.warmup:g} s of warm-up and {args.duration:g} s of chaos: about {each / 60:.1f} min each, "
            f"{total / 60:.0f} min in all (fewer with --backend/--replicas/--placement, or a shorter --duration)")


def run(args) -> int:
    log(plan(args))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the crowd holds ~1100 connections
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    tmpdir = None
    if args.secret_file is None:
        tmpdir = tempfile.mkdtemp(prefix="moe-chaos-")
        args.secret_file = os.path.join(tmpdir, "secret")
        fd = os.open(args.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, os.urandom(16).hex().encode() + b"\n")
        os.close(fd)
    secret = read(args.secret_file)
    layer = Layer(args.seed)
    doc: dict = {"provenance": provenance(), "settings": {
        "duration": args.duration, "warmup": args.warmup, "clients": args.clients, "pace": args.pace,
        "deadline": args.deadline, "worker_timeout": args.worker_timeout, "gap": list(args.gap),
        "down": list(args.down), "stop_fraction": args.stop_fraction, "max_connections": args.max_connections,
        "idle_timeout": args.idle_timeout, "hostile_idle": args.hostile_idle, "hostile_half": args.hostile_half,
        "p99_seconds": args.p99_seconds, "seed": args.seed, "updates": args.updates, "eplb": args.eplb,
        "bg": {"idle": args.bg_idle, "half_open": args.bg_half, "nonreaders": args.bg_nonreaders,
               "garbage": args.bg_garbage},
        "layer": {"d_model": D_MODEL, "d_ff": D_FF, "n_experts": N_EXPERTS, "top_k": TOP_K,
                  "max_batch_tokens": MAX_BATCH}}, "configs": []}
    try:
        for backend, replicas, kind in configurations(args):
            try:
                r = Run(args, backend, replicas, kind, secret, args.secret_file, layer).execute()
            except Exception as e:
                log(f"{backend} r{replicas} {kind} failed: {type(e).__name__}: {e}")
                r = {"name": f"{backend} r{replicas} {kind}", "backend": backend, "replicas": replicas,
                     "workers": kind, "error": f"{type(e).__name__}: {e}"}
            doc["configs"].append(r)
            if args.json:  # after each configuration: a long run interrupted keeps what it measured
                write_json_atomic(args.json, doc)
    finally:
        if tmpdir:
            os.unlink(args.secret_file)
            os.rmdir(tmpdir)
    print_report(doc)
    if args.plot:
        plot(doc, args.plot)
    missed = [t for r in doc["configs"] for t in r.get("targets", []) if t["met"] is False]
    return 1 if missed or any("error" in r for r in doc["configs"]) else 0
