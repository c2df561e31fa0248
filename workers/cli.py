"""``moe-worker``: host experts behind a transport listener.

    moe-worker --listen tcp://127.0.0.1:0 --experts 0,1,2,3 --d-model 256 --d-ff 512

The first stdout line is ``LISTENING <url>`` (the bound URL: a port of 0 replaced), so a
parent learns where to connect; logs go to stderr. SIGTERM drains and exits 0.

This module also has the small launcher the gateway, the demo and the tests share
(:func:`spawn_service`, :func:`stop_process`): start a service as a child process, wait
(bounded) for its LISTENING line, and stop it for sure.
"""
from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import subprocess
import sys
import time
from typing import Optional, Sequence

from workers.protocol import LISTENING

BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def parse_int_list(text: str) -> list[int]:
    """'0,1,2' or '0-3' or '0-3,6' -> [0, 1, 2, 3, 6]."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-worker", description="Serve MoE experts over moe-transport.")
    p.add_argument("--listen", default="tcp://127.0.0.1:0",
                   help="transport URL to listen on: tcp://host:port (port 0: any), shm://name, rdma://ip:port")
    p.add_argument("--experts", default=None,
                   help="expert ids to host, e.g. 0,1,2,3 or 0-3 (default: all in --weights, else 0)")
    p.add_argument("--weights", default=None, help=".npz written by SwiGLUExpert.save_many (else demo weights)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-ff", type=int, default=512)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--seed", type=int, default=0, help="seed of the demo weights (SwiGLUExpert.from_seed)")
    p.add_argument("--max-tokens", type=int, default=1024,
                   help="largest batch (rows) accepted; scratch and slots are sized for it at start")
    p.add_argument("--slot-size", type=int, default=None, help="receive slot bytes (default: fits --max-tokens)")
    p.add_argument("--nslots", type=int, default=8, help="receive slots (credits) per connection")
    p.add_argument("--threads", type=int, default=1, help="BLAS threads (1: the stable choice on few cores)")
    p.add_argument("--cpu", default=None, help="pin to these CPUs, e.g. 0 or 0,1")
    p.add_argument("--io-timeout", type=float, default=10.0, help="bound on every send/alloc, seconds")
    p.add_argument("--drain-timeout", type=float, default=10.0, help="longest SIGTERM drain, seconds")
    p.add_argument("--drain-idle", type=float, default=0.2,
                   help="while draining, exit once connections were quiet this long, seconds")
    p.add_argument("--exit-with-parent", action="store_true", help="drain and exit when the parent dies")
    p.add_argument("--log-level", default="WARNING")
    from workers.metrics import add_flags

    add_flags(p)
    return p


def load_experts(args) -> dict:
    import numpy as np
    from workers.expert import SwiGLUExpert, npz_expert_ids

    dtype = np.dtype(args.dtype)
    if args.weights:
        ids = parse_int_list(args.experts) if args.experts else npz_expert_ids(args.weights)
        return {e: SwiGLUExpert.from_npz(args.weights, e, max_tokens=args.max_tokens, dtype=dtype) for e in ids}
    ids = parse_int_list(args.experts) if args.experts else [0]
    return {e: SwiGLUExpert.from_seed(e, args.d_model, args.d_ff, seed=args.seed, dtype=dtype,
                                      max_tokens=args.max_tokens) for e in ids}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"moe-worker[{os.getpid()}] %(levelname)s %(message)s")
    if args.cpu:
        os.sched_setaffinity(0, parse_int_list(args.cpu))
    from threadpoolctl import threadpool_limits

    from workers.daemon import WorkerDaemon

    limits = threadpool_limits(limits=args.threads)  # noqa: F841 (kept for the process's life)
    try:
        experts = load_experts(args)
        daemon = WorkerDaemon(experts, args.listen, max_tokens=args.max_tokens, slot_size=args.slot_size,
                              nslots=args.nslots, io_timeout=args.io_timeout,
                              drain_timeout=args.drain_timeout, drain_idle=args.drain_idle,
                              watch_parent=os.getppid() if args.exit_with_parent else None)
    except Exception as e:
        print(f"moe-worker: {e}", file=sys.stderr)
        return 2
    try:
        from workers.metrics import maybe_serve, worker_registry

        maybe_serve(lambda: worker_registry(daemon), args)
    except Exception as e:
        print(f"moe-worker: metrics: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: daemon.request_stop())
    signal.signal(signal.SIGINT, lambda *_: daemon.request_stop())
    print(f"{LISTENING} {daemon.url}", flush=True)
    return daemon.serve()


# -- launching services as child processes ---------------------------------------

class ServiceError(RuntimeError):
    """A child service did not start (its stderr tail is in the message)."""


def blas_env(threads: int = 1, base: Optional[dict] = None) -> dict:
    env = dict(os.environ if base is None else base)
    for k in BLAS_ENV:
        env[k] = str(threads)
    return env


def spawn_service(argv: Sequence[str], *, timeout: float = 30.0, env: Optional[dict] = None,
                  stderr=None) -> tuple[subprocess.Popen, str]:
    """Start ``argv`` and wait (bounded) for its ``LISTENING <url>`` line.

    Returns (process, url). On failure the process is killed and ServiceError raised.
    ``stderr`` defaults to inheriting ours (so a service's logs show up beside ours).
    """
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=stderr, env=env,
                            stdin=subprocess.DEVNULL)
    try:
        url = _read_listening(proc, timeout)
    except BaseException:
        stop_process(proc, timeout=2.0)
        raise
    return proc, url


def _read_listening(proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    fd = proc.stdout.fileno()
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise ServiceError(f"{proc.args!r} printed no {LISTENING} line within {timeout:.0f} s")
        r, _, _ = select.select([fd], [], [], left)
        if not r:
            continue
        chunk = os.read(fd, 1)  # one byte at a time: nothing beyond the line is consumed
        if not chunk:
            rc = proc.wait(timeout=5)
            raise ServiceError(f"{' '.join(map(str, proc.args))} exited with {rc} before listening")
        line += chunk
    text = line.decode().strip()
    word, _, url = text.partition(" ")
    if word != LISTENING or not url:
        raise ServiceError(f"expected '{LISTENING} <url>', got {text!r}")
    return url


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> Optional[int]:
    """SIGTERM (graceful drain), then SIGKILL after ``timeout``; returns the exit code."""
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    if proc.stdout is not None:
        proc.stdout.close()
    return proc.returncode


def worker_argv(listen: str, experts: Sequence[int], *, d_model: int, d_ff: int, seed: int = 0,
                dtype: str = "float32", max_tokens: int = 1024, extra: Sequence[str] = (),
                python: str = sys.executable) -> list[str]:
    return [python, "-m", "workers.cli", "--listen", listen, "--experts", ",".join(map(str, experts)),
            "--d-model", str(d_model), "--d-ff", str(d_ff), "--seed", str(seed), "--dtype", dtype,
            "--max-tokens", str(max_tokens), *extra]


if __name__ == "__main__":
    sys.exit(main())
