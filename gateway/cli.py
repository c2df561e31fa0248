"""``moe-gateway``: the client-facing MoE layer over a pool of expert workers.

    moe-gateway --listen tcp://127.0.0.1:7000 --workers tcp://10.0.0.2:5000,tcp://10.0.0.3:5000
    moe-gateway --listen shm://gw --local-workers 2 --backend shm      # spawns and owns them
    moe-gateway update --gateway tcp://127.0.0.1:7000 start --experts 3 --version 1 --weights e3v1.npz --wait
    moe-gateway update --gateway tcp://127.0.0.1:7000 advance       # 1% -> 5% -> 25% -> 50% -> 100%
    moe-gateway update --gateway tcp://127.0.0.1:7000 finish        # (or rollback)

Prints ``LISTENING <url>`` as its first stdout line. SIGTERM: stop accepting, answer what
is queued and in flight, stop the local workers, exit 0.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional, Sequence

from workers.cli import blas_env, parse_int_list, spawn_service, stop_process, worker_argv
from workers.protocol import LISTENING

log = logging.getLogger("moe.gateway")


def parse_floats(text: Optional[str]) -> Optional[list[float]]:
    return None if not text else [float(v) for v in text.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-gateway", description="Serve a distributed MoE layer.")
    p.add_argument("--listen", default="tcp://127.0.0.1:0", help="client-facing transport URL")
    src = p.add_argument_group("workers")
    src.add_argument("--workers", default=None, help="comma-separated URLs of running moe-worker daemons")
    src.add_argument("--local-workers", type=int, default=2, help="spawn and own N workers (without --workers)")
    src.add_argument("--backend", default="shm", choices=["shm", "tcp", "rdma"], help="local workers' transport")
    src.add_argument("--replicas", type=int, default=1, help="local workers: copies of each expert")
    src.add_argument("--worker-threads", type=int, default=1, help="local workers: BLAS threads each")
    src.add_argument("--worker-cpus", default=None, help="local workers: pin worker i to the i-th CPU listed")
    src.add_argument("--rdma-ip", default=os.environ.get("MOE_RDMA_IP", "127.0.0.1"),
                     help="local workers on rdma: the address to bind (env MOE_RDMA_IP)")
    moe = p.add_argument_group("MoE layer")
    moe.add_argument("--n-experts", type=int, default=8)
    moe.add_argument("--top-k", type=int, default=2)
    moe.add_argument("--d-model", type=int, default=256)
    moe.add_argument("--d-ff", type=int, default=512)
    moe.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    moe.add_argument("--seed", type=int, default=0, help="router and (local) expert weights")
    moe.add_argument("--capacity-factor", type=float, default=None)
    moe.add_argument("--overflow", default="drop", choices=["drop", "spill"])
    moe.add_argument("--gate-bias", default=None, help="comma-separated per-expert gate bias (skewed routing)")
    moe.add_argument("--noisy", action="store_true", help="noisy top-k gating")
    moe.add_argument("--noise-std", type=float, default=1.0)
    bat = p.add_argument_group("batching")
    bat.add_argument("--max-batch-tokens", type=int, default=1024, help="tokens per dispatch round at most")
    bat.add_argument("--max-wait-ms", type=float, default=1.0,
                     help="longest a request waits for others to share its round (0: dispatch at once)")
    bat.add_argument("--max-inflight-rounds", type=int, default=2)
    bat.add_argument("--max-batch-requests", type=int, default=256)
    bat.add_argument("--no-split", action="store_true", help="never split one expert's tokens over replicas")
    p.add_argument("--worker-timeout", type=float, default=10.0, help="a round fails after this, seconds")
    p.add_argument("--threads", type=int, default=1, help="the gateway's own BLAS threads (the gate matmul)")
    p.add_argument("--log-level", default="WARNING")
    from workers.metrics import add_flags

    add_flags(p)
    src.add_argument("--worker-metrics", action="store_true",
                     help="local workers: each serves /metrics on a free port of --metrics-addr "
                          "(their 'METRICS <url>' lines go to stderr)")
    return p


def placement(n_experts: int, n_workers: int, replicas: int = 1) -> list[list[int]]:
    """Contiguous blocks of experts per worker; with replicas > 1, worker i also hosts
    the blocks of workers i-1, ..., i-replicas+1 (so each expert lives on that many)."""
    if not 1 <= n_workers:
        raise ValueError("need at least one worker")
    replicas = max(1, min(replicas, n_workers))
    blocks = [[e for e in range(n_experts) if e * n_workers // n_experts == w] for w in range(n_workers)]
    return [sorted({e for r in range(replicas) for e in blocks[(w - r) % n_workers]}) for w in range(n_workers)]


class LocalWorkers:
    """N moe-worker child processes owned by this gateway (stopped for sure on close)."""

    def __init__(self, args) -> None:
        self.procs: list = []
        self.urls: list[str] = []
        cpus = parse_int_list(args.worker_cpus) if args.worker_cpus else []
        max_rows = args.max_batch_tokens * args.top_k
        env = blas_env(args.worker_threads)
        try:
            for i, experts in enumerate(placement(args.n_experts, args.local_workers, args.replicas)):
                extra = ["--threads", str(args.worker_threads), "--exit-with-parent", "--log-level", args.log_level]
                if cpus:
                    extra += ["--cpu", str(cpus[i % len(cpus)])]
                if args.worker_metrics:
                    extra += ["--metrics-port", "0", "--metrics-addr", args.metrics_addr]
                proc, url = spawn_service(worker_argv(self._url(args, i), experts, d_model=args.d_model,
                                                      d_ff=args.d_ff, seed=args.seed, dtype=args.dtype,
                                                      max_tokens=max_rows, extra=extra), env=env)
                self.procs.append(proc)
                self.urls.append(url)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _url(args, i: int) -> str:
        if args.backend == "shm":
            return f"shm://moe-{os.getpid()}-w{i}"
        if args.backend == "rdma":
            return f"rdma://{args.rdma_ip}:0"
        return "tcp://127.0.0.1:0"

    def close(self) -> None:
        for proc in self.procs:
            rc = stop_process(proc, timeout=10.0)
            if rc not in (0, None):
                log.warning("local worker %d exited with %s", proc.pid, rc)
        self.procs = []


def make_router(args):
    import numpy as np

    from gateway.router import Router

    bias = parse_floats(args.gate_bias)
    if bias is not None and len(bias) != args.n_experts:
        raise ValueError(f"--gate-bias needs {args.n_experts} values, got {len(bias)}")
    return Router(args.d_model, args.n_experts, args.top_k, noisy=args.noisy, noise_std=args.noise_std,
                  capacity_factor=args.capacity_factor, overflow=args.overflow, seed=args.seed,
                  bias=None if bias is None else np.asarray(bias, np.float32))


def build_update_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moe-gateway update", description="Hot-update experts of a running moe-gateway: load a new "
        "version on its workers (they keep serving), shift traffic to it in steps, finish or roll back.")
    p.add_argument("--gateway", required=True, help="the gateway's client URL")
    p.add_argument("--timeout", type=float, default=30.0)
    sub = p.add_subparsers(dest="action", required=True)
    st = sub.add_parser("start", help="load the new version everywhere; traffic starts at the first step")
    st.add_argument("--experts", required=True, help="e.g. 3 or 0-3 or 1,5")
    st.add_argument("--version", type=int, required=True)
    src = st.add_mutually_exclusive_group(required=True)
    src.add_argument("--weights", help=".npz (SwiGLUExpert.save_many) every worker can read")
    src.add_argument("--seed", type=int, help="demo weights from this seed")
    st.add_argument("--steps", default=None, help="traffic fractions, default 0.01,0.05,0.25,0.5,1")
    st.add_argument("--auto-interval", type=float, default=None,
                    help="advance every S seconds by itself, and finish after the last step")
    adv = sub.add_parser("advance", help="the next traffic step")
    adv.add_argument("--fraction", type=float, default=None, help="jump to the first step >= this")
    fin = sub.add_parser("finish", help="all traffic to the new version; retire the old one")
    rb = sub.add_parser("rollback", help="all traffic back to the old version; retire the new one")
    sub.add_parser("status")
    for q in (st, fin, rb):
        q.add_argument("--wait", action="store_true",
                       help="return once the workers acknowledged (loaded, or retired the other version)")
    return p


def update_main(argv: Sequence[str]) -> int:
    import json
    import time

    from gateway.client import GatewayClient
    from workers.protocol import RemoteError

    args = build_update_parser().parse_args(argv)
    fields: dict = {}
    if args.action == "start":
        fields = {"experts": parse_int_list(args.experts), "version": args.version,
                  "steps": parse_floats(args.steps), "auto_interval": args.auto_interval}
        fields.update({"weights": os.path.abspath(args.weights)} if args.weights else {"seed": args.seed})
    elif args.action == "advance" and args.fraction is not None:
        fields = {"fraction": args.fraction}
    try:
        with GatewayClient(args.gateway, timeout=args.timeout) as c:
            status = c.update(args.action, **{k: v for k, v in fields.items() if v is not None})
            deadline = time.monotonic() + args.timeout
            while getattr(args, "wait", False) and status["state"] in ("loading", "finishing", "rolling_back"):
                if time.monotonic() > deadline:
                    print(json.dumps(status))
                    print("moe-gateway update: timed out waiting", file=sys.stderr)
                    return 1
                time.sleep(0.1)
                status = c.update("status")
    except RemoteError as e:
        print(f"moe-gateway update: {e.message}", file=sys.stderr)
        return 2
    print(json.dumps(status))
    return 0 if status.get("state") != "failed" else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["update"]:
        return update_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"moe-gateway[{os.getpid()}] %(levelname)s %(message)s")
    from threadpoolctl import threadpool_limits

    from gateway.pool import WorkerPool
    from gateway.server import GatewayServer, install_signal_handlers

    limits = threadpool_limits(limits=args.threads)  # noqa: F841 (kept for the process's life)
    local = pool = server = None
    try:
        router = make_router(args)
        if args.workers:
            urls = [u.strip() for u in args.workers.split(",") if u.strip()]
        else:
            local = LocalWorkers(args)
            urls = local.urls
        pool = WorkerPool(urls, router, dtype=args.dtype, max_batch_tokens=args.max_batch_tokens,
                          timeout=args.worker_timeout, split_replicas=not args.no_split)
        server = GatewayServer(pool, args.listen, max_batch_tokens=args.max_batch_tokens,
                               max_wait_ms=args.max_wait_ms, max_inflight_rounds=args.max_inflight_rounds,
                               max_batch_requests=args.max_batch_requests)
    except Exception as e:
        print(f"moe-gateway: {e}", file=sys.stderr)
        if pool is not None:
            pool.close()
        if local is not None:
            local.close()
        return 2
    try:
        if args.metrics_port is not None:
            from gateway.metrics import GatewayMetrics
            from workers.metrics import serve

            try:
                serve(GatewayMetrics(server).attach().registry, args.metrics_port, args.metrics_addr)
            except Exception as e:
                print(f"moe-gateway: metrics: {e}", file=sys.stderr)
                return 2
        install_signal_handlers(server)
        print(f"{LISTENING} {server.url}", flush=True)
        return server.serve()
    finally:
        pool.close()
        if local is not None:
            local.close()


if __name__ == "__main__":
    sys.exit(main())
