"""`moe-bench chaos`'s command line: its flags, their check, and the plan it prints first.

bench.chaos re-exports :func:`add_arguments` and :func:`validate` (the subcommand's
interface); what each flag does is bench.chaos's.
"""
from __future__ import annotations

import argparse

from transport.service import options

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
    from bench.chaos_eplb import add_arguments as eplb_arguments
    eplb_arguments(p)


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
