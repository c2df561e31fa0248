"""``make run``: a gateway with local workers, a short load, and the numbers.

    python -m gateway.demo --backend shm          # small config, ~20 s on 2 cores
    python -m gateway.demo --backend tcp --full   # a full-size layer: d_model 1024, d_ff 2048, 256-token batches

Starts ``moe-gateway`` (which spawns and owns its workers) over the chosen backend, checks
one output against the in-process ReferenceMoE, drives a few concurrent clients for a few
seconds, prints throughput and latency percentiles, and stops everything (it checks that
no process and no /dev/shm segment is left behind).
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Optional, Sequence

import numpy as np

from transport.service.launch import blas_env, spawn_service, stop_process
from gateway.chunking import chunk_rows_flag

FULL = dict(d_model=1024, d_ff=2048, batch_min=256, batch_max=256)


def build_parser() -> argparse.ArgumentParser:
    from transport.service import options

    p = options.Parser(prog="python -m gateway.demo", description=__doc__.split("\n\n")[0],
                       epilog=options.examples("python -m gateway.demo --backend shm",
                                               "python -m gateway.demo --backend tcp --full --duration 10"))
    p.add_argument("--version", action="version", version=f"gateway.demo {options.version()}")
    p.add_argument("--backend", default=os.environ.get("BACKEND", "shm"), choices=["shm", "tcp", "rdma"],
                   help="the local workers' transport (env BACKEND)")
    p.add_argument("--full", action="store_true",
                   help="a full-size layer: d_model 1024, d_ff 2048, 256-token requests")
    p.add_argument("--local-workers", type=options.positive, default=2, help="worker processes the gateway starts")
    p.add_argument("--n-experts", type=options.positive, default=8, help="routed experts in the layer")
    p.add_argument("--top-k", type=options.positive, default=2, help="experts per token")
    p.add_argument("--d-model", type=options.positive, default=256, help="model width")
    p.add_argument("--d-ff", type=options.positive, default=512, help="expert hidden width")
    p.add_argument("--batch-min", type=options.positive, default=64, help="tokens per request, drawn in [min, max]")
    p.add_argument("--batch-max", type=options.positive, default=256, help="tokens per request at most")
    p.add_argument("--concurrency", type=options.positive, default=3, help="concurrent clients (one thread each)")
    p.add_argument("--duration", type=options.positive_seconds, default=5.0, help="seconds of load")
    p.add_argument("--max-wait", type=options.seconds, default=0.001,
                   help="the gateway's batching wait (moe-gateway --max-wait)")
    options.alias(p, "--max-wait-ms", "--max-wait", type=options.milliseconds_as_seconds)
    p.add_argument("--max-batch-tokens", type=options.positive, default=None,
                   help="the gateway's tokens per round (default: concurrency x batch-max)")
    p.add_argument("--chunk-rows", type=chunk_rows_flag, default="auto", metavar="auto|off|ROWS",
                   help="the gateway's pipelined rounds (moe-gateway --chunk-rows)")
    p.add_argument("--seed", type=options.count, default=0, help="router, weights and request sizes")
    return p


def _shm_entries() -> set:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _listen_url(backend: str) -> str:
    return {"shm": f"shm://moe-demo-{os.getpid()}", "tcp": "tcp://127.0.0.1:0",
            "rdma": "rdma://127.0.0.1:0"}[backend]


def _drive(url: str, args, deadline: float, seed: int, latencies: list, errors: list, counts: list) -> None:
    from gateway.client import GatewayClient

    rng = np.random.default_rng(seed)
    pool = [rng.standard_normal((args.batch_max, args.d_model)).astype(np.float32) for _ in range(4)]
    try:
        with GatewayClient(url, timeout=30.0) as c:
            i = 0
            while time.monotonic() < deadline:
                n = int(rng.integers(args.batch_min, args.batch_max + 1))
                x = pool[i % len(pool)][:n]
                t = time.perf_counter()
                c.forward(x)
                latencies.append(time.perf_counter() - t)
                counts.append(n)
                i += 1
    except Exception as e:  # reported, and the demo fails
        errors.append(f"client {seed}: {type(e).__name__}: {e}")


def run(args) -> int:
    from gateway.client import GatewayClient
    from gateway.reference import ReferenceMoE

    if args.full:
        for k, v in FULL.items():
            setattr(args, k, v)
    max_batch = args.max_batch_tokens or args.concurrency * args.batch_max
    shm_before = _shm_entries()
    argv = [sys.executable, "-m", "gateway.cli", "--listen", _listen_url(args.backend),
            "--local-workers", str(args.local_workers), "--backend", args.backend,
            "--n-experts", str(args.n_experts), "--top-k", str(args.top_k),
            "--d-model", str(args.d_model), "--d-ff", str(args.d_ff), "--seed", str(args.seed),
            "--max-batch-tokens", str(max_batch), "--max-wait", str(args.max_wait),
            "--chunk-rows", args.chunk_rows]
    print(f"moe-transport demo: backend={args.backend}  {args.local_workers} workers, {args.n_experts} experts, "
          f"top-{args.top_k}, d_model={args.d_model}, d_ff={args.d_ff}, batches of "
          f"{args.batch_min}-{args.batch_max} tokens, {args.concurrency} clients for {args.duration:.0f} s")
    t0 = time.monotonic()
    proc, url = spawn_service(argv, timeout=60.0, env=blas_env(1))
    ok = True
    try:
        print(f"gateway at {url} (started in {time.monotonic() - t0:.1f} s)")
        ref = ReferenceMoE.from_seed(args.d_model, args.d_ff, args.n_experts, args.top_k, seed=args.seed)
        x = np.random.default_rng(12345).standard_normal((args.batch_max, args.d_model)).astype(np.float32)
        with GatewayClient(url, timeout=30.0) as c:
            y = c.forward(x)
            y_ref, _ = ref.forward(x)
            err = float(np.max(np.abs(y - y_ref)))
            scale = float(np.max(np.abs(y_ref))) or 1.0
            verified = np.allclose(y, y_ref, rtol=1e-4, atol=1e-4 * scale)
            print(f"verify: max |distributed - reference| = {err:.3g} (outputs up to {scale:.3g}): "
                  f"{'OK' if verified else 'MISMATCH'}")
            ok &= bool(verified)
            before = c.ping()["gateway"]

            latencies: list = []
            errors: list = []
            counts: list = []
            deadline = time.monotonic() + args.duration
            threads = [threading.Thread(target=_drive, args=(url, args, deadline, s, latencies, errors, counts),
                                        daemon=True) for s in range(args.concurrency)]
            t = time.perf_counter()
            for th in threads:
                th.start()
            for th in threads:
                th.join(timeout=args.duration + 60.0)
            elapsed = time.perf_counter() - t
            after = c.ping()["gateway"]
        for e in errors:
            print(f"error: {e}")
        ok &= not errors and bool(latencies)
        _report(latencies, counts, elapsed, before, after)
    finally:
        rc = stop_process(proc, timeout=15.0)
    leaked = sorted(_shm_entries() - shm_before)
    print(f"stopped: gateway exit code {rc}; /dev/shm left behind: {leaked or 'nothing'}")
    ok &= rc == 0 and not leaked
    return 0 if ok else 1


def _report(latencies: list, counts: list, elapsed: float, before: dict, after: dict) -> None:
    if not latencies:
        return
    lat = np.asarray(latencies) * 1000.0
    tokens = int(np.sum(counts))
    p50, p95, p99 = np.percentile(lat, [50, 95, 99])
    rounds = after["rounds"] - before["rounds"]
    reqs = after["requests"] - before["requests"]
    print(f"throughput: {tokens / elapsed:,.0f} tokens/s  ({len(lat) / elapsed:,.1f} requests/s, "
          f"{tokens} tokens in {elapsed:.1f} s)")
    print(f"latency ms: p50 {p50:.2f}  p95 {p95:.2f}  p99 {p99:.2f}  max {lat.max():.2f}  (n={len(lat)})")
    if rounds:
        stages = {k: (after["stage_seconds"][k] - before["stage_seconds"][k]) / rounds * 1000.0
                  for k in after["stage_seconds"]}
        msgs = after.get("messages", 0) - before.get("messages", 0)
        print(f"gateway: {rounds} rounds for {reqs} requests ({reqs / rounds:.2f} requests/round, "
              f"{msgs / rounds:.2f} messages/round); "
              "mean per round ms: " + "  ".join(f"{k} {v:.2f}" for k, v in stages.items()))


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
