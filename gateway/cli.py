"""``moe-gateway``: the client-facing MoE layer over a pool of expert workers.

    moe-gateway --listen tcp://127.0.0.1:7000 --workers tcp://10.0.0.2:5000,tcp://10.0.0.3:5000
    moe-gateway --listen shm://gw --local-workers 2 --backend shm      # spawns, supervises and owns them
    moe-gateway --listen tcp://127.0.0.1:7000 --checkpoint /models/mixtral --layers 0-31 \
                --local-workers 2 --compute torch --dtype bfloat16   # a real model's MoE layers
    moe-gateway --listen tcp://10.0.0.1:7000 --placement ray --ray-address 10.0.0.1:6379   # Ray places them
    moe-gateway update --gateway tcp://127.0.0.1:7000 start --experts 0-7 --new-version 1 \
                --checkpoint /updates/mixtral-ft --layer 3 --wait
    moe-gateway update --gateway tcp://127.0.0.1:7000 start --experts 3 --new-version 1 --seed 7 --wait
    moe-gateway update --gateway tcp://127.0.0.1:7000 advance       # 1% -> 5% -> 25% -> 50% -> 100%
    moe-gateway update finish --gateway tcp://127.0.0.1:7000        # (or rollback; flags before or after)
    moe-gateway update --gateway tcp://127.0.0.1:7000 served        # every expert's served version
    moe-gateway update --gateway tcp://127.0.0.1:7000 settle --experts 2 --serve-version 1   # workers disagreed

Prints ``LISTENING <url>`` as its first stdout line. SIGTERM: stop accepting, answer what
is queued and in flight, stop the local workers, exit 0. A usage error exits 2, a failure
at run time 1, each with one line on stderr.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Optional, Sequence

from gateway import placement_cli
from gateway.chunking import chunk_rows_flag
from gateway.config import parse_floats
from gateway.update_cli import UPDATE_TIMEOUT, add_update_parser, update_main
from transport.service import options
from transport.service.launch import LISTENING
from transport.service.options import UsageError
from workers.flags import check_selection

log = logging.getLogger("moe.gateway")
PROG = "moe-gateway"  # (gateway.update_cli's too)
EXAMPLES = options.examples(
    "moe-gateway --listen tcp://127.0.0.1:7000 --local-workers 2 --backend shm",
    "moe-gateway --listen tcp://127.0.0.1:7000 --workers tcp://10.0.0.2:5000,tcp://10.0.0.3:5000 \\\n"
    "      --secret-file /etc/moe/secret",
    "moe-gateway --listen tcp://127.0.0.1:7000 --checkpoint /models/mixtral --layers 0-31 --compute torch",
    "moe-gateway update status --gateway tcp://127.0.0.1:7000     (see moe-gateway update --help)")


def build_parser() -> argparse.ArgumentParser:
    p = options.Parser(prog=PROG, epilog=EXAMPLES,
                       description="Serve a distributed MoE layer over expert workers it starts (--local-workers, "
                                   "--placement ray) or finds running (--workers). The commands below drive a running "
                                   "gateway: hot updates (update), the expert placement (placement), its workers "
                                   "(workers).")
    p.add_argument("--listen", default="tcp://127.0.0.1:0", type=options.url,
                   help="client-facing transport URL: tcp://HOST:PORT (port 0: any free one), shm://NAME, "
                        "rdma://IP:PORT")
    src = p.add_argument_group("workers")
    src.add_argument("--workers", default=None, type=options.url_list,
                     help="comma-separated URLs of running moe-worker daemons (default: start --local-workers)")
    src.add_argument("--placement", default="local", choices=["local", "ray"],
                     help="without --workers, who starts the workers: this gateway (--local-workers) or Ray "
                          "(--ray-*: actors on a Ray cluster, the data plane still ours)")
    src.add_argument("--local-workers", type=options.positive, default=2, metavar="N",
                     help="without --workers: start, supervise and own N worker processes")
    src.add_argument("--backend", default="shm", choices=["shm", "tcp", "rdma"], help="local workers' transport")
    src.add_argument("--replicas", type=options.positive, default=1, help="local or Ray workers: copies of each expert")
    src.add_argument("--worker-blas-threads", type=options.positive, default=1,
                     help="local or Ray workers: BLAS threads each (moe-worker --blas-threads)")
    options.alias(src, "--worker-threads", "--worker-blas-threads", type=options.positive)
    src.add_argument("--worker-cpus", default=None, type=options.cpu_list,
                     help="local or Ray workers: pin worker i to the i-th CPU of this list (modulo), e.g. 0,1 "
                          "(moe-worker --cpus)")
    src.add_argument("--rdma-ip", default=os.environ.get("MOE_RDMA_IP", "127.0.0.1"), type=options.host,
                     metavar="IP", help="local workers on rdma: the address to bind (env MOE_RDMA_IP)")
    src.add_argument("--update-dir", default=None, type=options.directory,
                     help="local workers: the directory hot updates may read weight files from")
    src.add_argument("--worker-metrics", action="store_true",
                     help="local workers: each serves /metrics on a free port of --metrics-addr "
                          "(their 'METRICS <url>' lines go to stderr)")
    src.add_argument("--worker-timeout", type=options.positive_seconds, default=10.0,
                     help="a worker's part of a round fails after this long (its requests are retried on a "
                          "replica or fail)")
    src.add_argument("--update-ack-timeout", type=options.positive_seconds, default=30.0,
                     help="a hot update gives up on a worker that does not acknowledge a load or retire this "
                          "long (so finishing and rolling back always end)")
    src.add_argument("--connect-timeout", type=options.positive_seconds, default=30.0,
                     help="how long the first connection to each worker is retried")
    ck = p.add_argument_group("checkpoint (a real model's MoE layers)")
    ck.add_argument("--checkpoint", default=None, type=options.directory,
                    help="serve the MoE layers of this Hugging Face checkpoint: the gateway reads only their "
                         "routers (family routing rules from config.json); workers must read the same "
                         "checkpoint and layers (checked by fingerprint at every connect)")
    ck.add_argument("--layers", default=None, type=options.int_list,
                    help="with --checkpoint: MoE layers to serve, e.g. 0-23 (default: every MoE layer); a "
                         "request names its layer, or gets layer 0, or the one layer served")
    ck.add_argument("--compute", default="numpy", choices=["numpy", "torch"],
                    help="local workers: expert kernel (torch: bf16 where the CPU has bf16 matrix units, "
                         "else float32)")
    ray = p.add_argument_group("Ray placement (--placement ray; pip install 'moe-transport[ray]')")
    ray.add_argument("--ray-address", default=None, metavar="HOST:PORT",
                     help="the Ray cluster to join (host:port, or auto); default: $RAY_ADDRESS, else Ray's own default")
    ray.add_argument("--ray-workers-per-node", type=options.positive, default=1,
                     help="workers on every node that can hold them (the gateway's node first)")
    ray.add_argument("--ray-cpus-per-worker", type=options.positive_number, default=1.0,
                     help="Ray CPUs each worker actor reserves")
    ray.add_argument("--ray-strategy", default="spread", choices=["spread", "pack"],
                     help="worker i to node: round-robin (a block's replicas on different nodes), or fill a "
                          "node first")
    ray.add_argument("--ray-transport", default="auto", choices=["auto", "tcp", "shm", "rdma"],
                     help="auto: shm on the gateway's own host, rdma where the node has a device, else tcp")
    ray.add_argument("--ray-start-timeout", type=options.positive_seconds, default=120.0,
                     help="how long every worker actor may take to start")
    add_layer_flags(p)
    add_batching_flags(p)
    srv = p.add_argument_group("service")
    srv.add_argument("--max-connections", type=options.positive, default=1024,
                     help="client connections at once (more are refused)")
    srv.add_argument("--idle-timeout", type=options.seconds, default=300.0,
                     help="close a client connection idle this long (0: never)")
    srv.add_argument("--blas-threads", type=options.positive, default=1,
                     help="the gateway's own BLAS threads (its gate matmul)")
    options.alias(srv, "--threads", "--blas-threads", type=options.positive)
    srv.add_argument("--exit-with-parent", action="store_true",
                     help="drain and exit when the parent process dies (a gateway a tool started)")
    options.add_security(srv, service=True)
    placement_cli.add_flags(p)
    options.add_common(p, PROG)
    from transport.service.metrics import add_flags

    add_flags(p)
    return p


def add_layer_flags(p: argparse.ArgumentParser) -> None:
    moe = p.add_argument_group("MoE layer")
    moe.add_argument("--n-experts", type=options.positive, default=8, help="routed experts in the layer")
    moe.add_argument("--top-k", type=options.positive, default=2, help="experts per token")
    moe.add_argument("--d-model", type=options.positive, default=None,
                     help="model width (default: what the workers serve with --workers, else 256)")
    moe.add_argument("--d-ff", type=options.positive, default=512, help="local workers: expert hidden width")
    moe.add_argument("--dtype", default=None, choices=["float32", "float64", "float16", "bfloat16"],
                     help="activation dtype on the wire (default: the workers' when --d-model is not given "
                          "either, else float32); bfloat16: 2 bytes a value, combined in float32 at the gateway")
    moe.add_argument("--seed", type=options.count, default=0, help="seed of the router and of the local workers' weights")
    moe.add_argument("--capacity-factor", type=options.positive_number, default=None, metavar="FACTOR",
                     help="tokens per expert at most: factor x tokens x top_k / experts (default: no limit)")
    moe.add_argument("--overflow", default="drop", choices=["drop", "spill"],
                     help="over capacity: drop the assignment, or spill it to the next-best expert")
    moe.add_argument("--gate-bias", default=None, type=options.floats,
                     help="comma-separated per-expert gate bias, one per expert (skewed routing)")
    moe.add_argument("--noisy", action="store_true", help="noisy top-k gating")
    moe.add_argument("--noise-std", type=options.nonnegative, default=1.0, help="noisy top-k: noise scale")


def add_batching_flags(p: argparse.ArgumentParser) -> None:
    bat = p.add_argument_group("batching")
    bat.add_argument("--max-batch-tokens", type=options.positive, default=1024, help="tokens per dispatch round at most")
    bat.add_argument("--max-wait", type=options.seconds, default=0.001,
                     help="longest a request waits for others to share its round (0: dispatch at once)")
    options.alias(bat, "--max-wait-ms", "--max-wait", type=options.milliseconds_as_seconds)
    bat.add_argument("--max-inflight-rounds", type=options.positive, default=2, help="rounds out at the workers at once")
    bat.add_argument("--max-batch-requests", type=options.positive, default=256, help="requests per round at most")
    bat.add_argument("--chunk-rows", type=chunk_rows_flag, default="auto", metavar="auto|off|ROWS",
                     help="pipelined rounds: a worker's part goes as messages of at most this many rows, cut between "
                          "expert groups where it can (a cut group is two slower products), so it computes "
                          "the first while the next is in flight and replies are combined as they land; auto "
                          "(the default) sizes them from each worker's measured per-message cost and compute "
                          "rate, and sends one message where chunks would not pay")
    bat.add_argument("--reply-spin", default="on", choices=["on", "off"],
                     help="busy-poll for each worker's last outstanding reply around when its measured costs "
                          "say it is due, while fewer workers have work than this process has processors (a "
                          "wake-up from a sleep costs 0.15-0.3 ms in a VM); off: always sleep")
    bat.add_argument("--no-split", action="store_true", help="never split one expert's tokens over replicas")
    bat.add_argument("--batching", default="fifo", choices=["fifo", "expert-aware"],
                     help="which queued requests a round takes: the oldest first, or those sharing the round's "
                          "experts (the oldest, and any that waited --max-wait, always go)")
    bat.add_argument("--balancing", default="load-aware", choices=["load-aware", "least-loaded"],
                     help="replicated experts: the replica with the fewest outstanding rows (a big expert split "
                          "over replicas), or each expert whole to the replica with the least outstanding work "
                          "in measured seconds")


def validate(args: argparse.Namespace) -> None:
    """Flags that contradict each other: UsageError before anything starts."""
    if args.workers and args.placement == "ray":
        raise UsageError("--placement ray starts its own workers: give it no --workers")
    if args.layers and not args.checkpoint:
        raise UsageError("--layers needs --checkpoint (demo weights are one layer)")
    if args.checkpoint and args.layers:

        check_selection(args.checkpoint, args.layers, None)
    if not args.checkpoint:
        if args.top_k > args.n_experts:
            raise UsageError(f"--top-k {args.top_k} is more than --n-experts {args.n_experts}")
        bias = parse_floats(args.gate_bias)
        if bias is not None and len(bias) != args.n_experts:
            raise UsageError(f"--gate-bias needs {args.n_experts} values (one per expert), got {len(bias)}")


def auth_failure(e: Exception, peer: str, secret_path: Optional[str], secret_file: Optional[str]) -> Exception:
    """A worker refused our secret (or we its): the same error, saying which side has which
    secret and how to match them."""
    from transport.service import secrets

    from transport import AuthenticationError

    return AuthenticationError(secrets.advice(e, this="this gateway", peer=peer, path=secret_path,
                                              source=secrets.whence(secret_file, secret_path)),
                               getattr(e, "why", None))


def start(args):
    """The GatewayServer these flags describe, its workers connected (server.local: the
    workers it started, if any); everything it started is stopped when it fails."""
    import transport
    from gateway.config import resolve_layer
    from gateway.placement import start_fleet
    from gateway.pool import WorkerPool
    from gateway.server import GatewayServer
    from transport.service import secrets

    fleet = pool = None
    # secure by default: without a secret the gateway makes one (0600) that local clients,
    # the update command and its local workers find; --insecure uses only a named one
    secret, secret_path = secrets.for_service(args.secret_file, insecure=args.insecure)
    options.check_exposure(args.listen, secret, args.insecure, PROG)
    urls = [u.strip() for u in args.workers.split(",") if u.strip()] if args.workers else None
    try:
        layer = resolve_layer(args, secret, urls)
        fleet = start_fleet(args, secret, secret_path, layer.layers)
        pool = WorkerPool(urls or fleet.urls, layer.router, dtype=args.dtype, max_batch_tokens=args.max_batch_tokens,
                          timeout=args.worker_timeout, connect_timeout=args.connect_timeout,
                          split_replicas=not args.no_split, secret=secret, balancing=args.balancing,
                          ack_timeout=args.update_ack_timeout, fingerprints=layer.fingerprints,
                          chunk_rows=args.chunk_rows, reply_spin=args.reply_spin == "on",
                          **placement_cli.pool_options(args))
        if fleet is not None:
            fleet.attach(pool)
            pool.live.fleet = fleet
        if args.placement_file:
            with open(args.placement_file) as f:
                pool.live.load(json.load(f))
        server = GatewayServer(pool, args.listen, max_batch_tokens=args.max_batch_tokens,
                               max_wait_ms=args.max_wait * 1e3, max_inflight_rounds=args.max_inflight_rounds,
                               max_batch_requests=args.max_batch_requests, secret=secret,
                               max_connections=args.max_connections, idle_timeout=args.idle_timeout or None,
                               batching=args.batching)
        server.local = fleet
        return server
    except BaseException as e:
        if pool is not None:
            pool.close()
        if fleet is not None:
            fleet.close()
        if isinstance(e, transport.AuthenticationError):
            raise auth_failure(e, f"the worker at {getattr(e, 'peer', None) or 'one of --workers'}", secret_path,
                               args.secret_file) from None
        raise


def serve_main(args) -> int:
    options.setup_logging(args.log_level, PROG)
    from threadpoolctl import threadpool_limits

    from gateway.server import install_signal_handlers, stop_with_parent

    parent = os.getppid()
    limits = threadpool_limits(limits=args.blas_threads)  # noqa: F841 (kept for the process's life)
    options.raise_fd_limit()
    server = start(args)
    try:
        if args.exit_with_parent:
            stop_with_parent(server, parent)
        if args.metrics_port is not None:
            from gateway.metrics import GatewayMetrics
            from transport.service.metrics import serve

            gm = GatewayMetrics(server).attach()
            try:
                serve(gm.registry, args.metrics_port, args.metrics_addr, health=gm.health())
            except OSError as e:
                raise RuntimeError(f"metrics: cannot serve on {args.metrics_addr}:{args.metrics_port}: "
                                   f"{e.strerror or e}") from None
        install_signal_handlers(server)
        print(f"{LISTENING} {server.url}", flush=True)
        return server.serve()
    finally:
        server.pool.close()
        if server.local is not None:
            server.local.close()


def subparsers(p: argparse.ArgumentParser) -> dict:
    """{command: parser} of ``p``'s subcommands."""
    return next((dict(a.choices) for a in p._actions if isinstance(a, argparse._SubParsersAction)), {})


def make_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """(moe-gateway's parser, its `update` subcommand's)."""
    p = build_parser()
    sub = p.add_subparsers(dest="command", metavar="COMMAND", title="commands",
                           description="without one, serve the layer")
    update = add_update_parser(sub)
    placement_cli.add_parsers(sub)
    return p, update


def parse_args(argv: Optional[Sequence[str]] = None, parsers=None) -> argparse.Namespace:
    """The command line parsed, and checked as far as it can be without starting anything
    (exit 2 with one line on a mistake); ``parsers``: make_parser()'s, to reuse them."""
    p, update = parsers or make_parser()
    args = p.parse_args(argv)
    at = update if args.command == "update" else subparsers(p).get(args.command, p)
    try:
        options.check_paths(args, at)
        if args.command not in ("update", "placement", "workers"):
            validate(args)
        elif getattr(args, "gateway", None) is None:
            raise UsageError("--gateway URL is required: the running gateway's client URL, e.g. tcp://127.0.0.1:7000")
    except UsageError as e:
        at.error(str(e))
    if args.command in ("update", "placement", "workers"):
        args.timeout = getattr(args, "timeout", UPDATE_TIMEOUT)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.command == "update":
        return options.run_main(f"{PROG} update", lambda: update_main(args))
    if args.command in ("placement", "workers"):
        return options.run_main(f"{PROG} {args.command}", lambda: placement_cli.run(args))
    return options.run_main(PROG, lambda: serve_main(args))


if __name__ == "__main__":
    sys.exit(main())
