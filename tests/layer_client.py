"""A load client that checks every answer, for runs inside a network namespace:

    python -m tests.layer_client URL --d-model D --d-ff F --n-experts E --top-k K --seed S [--concurrency C]

Each of C threads sends requests of 1..max-tokens tokens back to back until stdin closes (the
test's stop signal) and records each one: its outcome (``ok`` when the output equals the
in-process ReferenceMoE of the same seed and config, ``wrong`` when it does not, the error
code the gateway answered, or ``lost`` when no answer came within the timeout), the experts
its tokens routed to, and its start and end on CLOCK_MONOTONIC (the same clock the test
reads: namespaces do not change it). Prints ``GOING`` once ``--mark-after`` answers came
back, then one JSON document with every record when it stops.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--d-model", type=int, required=True)
    p.add_argument("--d-ff", type=int, required=True)
    p.add_argument("--n-experts", type=int, required=True)
    p.add_argument("--top-k", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--mark-after", type=int, default=10)
    p.add_argument("--max-requests", type=int, default=0, help="stop after this many in all (0: when stdin closes)")
    args = p.parse_args(argv)

    from gateway.client import GatewayClient
    from gateway.reference import ReferenceMoE
    from transport import Timeout, TransportError
    from workers.protocol import RemoteError

    lock = threading.Lock()
    records: list = []
    stop = threading.Event()
    marked = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.buffer.read()
        stop.set()

    def run(t: int) -> None:
        rng = np.random.default_rng(1000 + t)
        # one reference per thread: an expert's scratch buffers are not to be shared between
        # threads (numpy releases the GIL in matmul, and two threads would write one scratch)
        ref = ReferenceMoE.from_seed(args.d_model, args.d_ff, args.n_experts, args.top_k, seed=args.seed)
        client = GatewayClient(args.url, timeout=args.timeout)
        try:
            while not stop.is_set():
                x = rng.standard_normal((int(rng.integers(1, args.max_tokens + 1)), args.d_model)).astype(np.float32)
                y_ref, routing = ref.forward(x)
                experts = sorted(int(e) for e in np.unique(routing.topk_idx) if e >= 0)
                t0 = time.monotonic()
                detail = None
                try:
                    y = client.forward(x, timeout=args.timeout)
                    outcome = "ok" if np.allclose(y, y_ref, rtol=1e-4, atol=2e-5) else "wrong"
                    if outcome == "wrong":  # which rows, and the experts those rows routed to
                        bad = np.flatnonzero(~np.isclose(y, y_ref, rtol=1e-4, atol=2e-5).all(axis=1))
                        detail = {"rows": bad.tolist(), "row_experts": routing.topk_idx[bad].tolist(),
                                  "max_err": float(np.abs(y - y_ref).max()), "finite": bool(np.isfinite(y).all()),
                                  "zero_rows": int((np.abs(y[bad]).max(axis=1) == 0).sum())}
                except RemoteError as e:
                    outcome = e.code
                except Timeout:
                    outcome = "lost"
                except TransportError as e:  # the connection itself failed: reconnect, count it
                    outcome = f"transport:{type(e).__name__}"
                    client.close()
                    client = GatewayClient(args.url, timeout=args.timeout)
                with lock:
                    records.append({"outcome": outcome, "experts": experts, "t0": t0, "t1": time.monotonic(),
                                    "tokens": len(x), **({"detail": detail} if detail else {})})
                    if len(records) >= args.mark_after and not marked.is_set():
                        marked.set()
                        print("GOING", flush=True)
                    if args.max_requests and len(records) >= args.max_requests:
                        stop.set()
        finally:
            client.close()

    if not args.max_requests:
        threading.Thread(target=watch_stdin, daemon=True).start()
    threads = [threading.Thread(target=run, args=(t,)) for t in range(args.concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    print(json.dumps({"records": records}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
