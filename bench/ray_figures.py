"""The Ray placement's figures: the same layer placed by Ray (``--placement ray``) and started
with ``--local-workers``, same backend, on a local three-node Ray cluster (each node a network
namespace of its own: bench/netns_cluster.py), Ray running (dashboard off) in both arms, the
arms interleaved (A B B A ...) so the shared machine's drift hits both alike:

- tokens/s and p99 TPOT / ITL under a saturating closed loop (``moe-bench load --gateway``,
  C client threads, more requests scheduled than they can carry);
- start-up time: from starting the gateway to its first answer;
- recovery time: from SIGKILLing worker 1's process to the first answer that needed its
  experts (Ray restarts the actor; --local-workers respawns the process).

    sudo .venv/bin/python -m bench.ray_figures --rounds 3 --json bench-results/ray-figures.json

A benchmark, not a test: it asserts nothing about speed. Needs root (namespaces) and Ray.
Everything but the namespaces' set-up runs inside the head node's namespace.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

from bench.netns_cluster import NetnsLan, RayCluster

LAYER = dict(n_experts=8, top_k=2, d_model=256, d_ff=512, seed=0)
WORKERS = 3


def gateway_argv(arm: str, backend: str, listen: str, ray_address: str) -> list[str]:
    base = [sys.executable, "-m", "gateway.cli", "--listen", listen, "--n-experts", str(LAYER["n_experts"]),
            "--top-k", str(LAYER["top_k"]), "--d-model", str(LAYER["d_model"]), "--d-ff", str(LAYER["d_ff"]),
            "--seed", str(LAYER["seed"]), "--max-batch-tokens", "1024", "--max-wait", "0.001", "--worker-timeout", "5"]
    if arm == "local":
        return base + ["--local-workers", str(WORKERS), "--backend", backend]
    if backend == "shm":  # the gateway's node only: 3 workers there
        ray = ["--ray-transport", "shm", "--ray-workers-per-node", str(WORKERS), "--ray-cpus-per-worker", "0.5"]
    else:  # one worker per node, every one over tcp (the head's too)
        ray = ["--ray-transport", backend, "--ray-workers-per-node", "1", "--ray-cpus-per-worker", "1"]
    return base + ["--placement", "ray", "--ray-address", ray_address, *ray]


def first_answer(url: str, deadline: float):
    """Block until the gateway answers a forward that needs every expert (routing all)."""
    import numpy as np

    from gateway.client import GatewayClient
    from workers.protocol import RemoteError

    x = np.random.default_rng(0).standard_normal((64, LAYER["d_model"])).astype(np.float32)
    client = None
    while time.monotonic() < deadline:
        try:
            if client is None:
                client = GatewayClient(url, timeout=10.0)
            client.forward(x, timeout=10.0)
            return client
        except RemoteError:
            time.sleep(0.005)
        except Exception:
            if client is not None:
                client.close()
            client = None
            time.sleep(0.02)
    raise TimeoutError(f"{url}: no answer in time")


def run_arm(arm: str, backend: str, ray_address: str, head_ip: str, load_args: list[str], out_dir: str,
            tag: str) -> dict:
    from transport.service.launch import blas_env, spawn_service, stop_process

    listen = f"shm://moe-fig-{os.getpid()}-{tag}" if backend == "shm" else f"tcp://{head_ip}:0"
    argv = gateway_argv(arm, backend, listen, ray_address)
    t0 = time.monotonic()
    proc, url = spawn_service(argv, timeout=300.0, env=blas_env(1))
    rec: dict = {"arm": arm, "backend": backend, "gateway": shlex.join(argv)}
    try:
        client = first_answer(url, time.monotonic() + 300)
        rec["startup_s"] = time.monotonic() - t0
        out = os.path.join(out_dir, f"load-{tag}.json")
        load = [sys.executable, "-m", "bench.cli", "load", "--gateway", url, *load_args, "--json", out,
                "--progress", "none"]
        rec["load"] = shlex.join(load)
        r = subprocess.run(load, capture_output=True, text=True, timeout=900)
        if r.returncode:
            raise RuntimeError(f"moe-bench load failed: {r.stderr[-2000:]}")
        (res,) = json.load(open(out))["results"]
        rec.update(tokens_per_s=res["tokens_per_s"], p99_tpot_ms=res["tpot_ms"]["p99"],
                   p50_tpot_ms=res["tpot_ms"]["p50"], p99_itl_ms=res["itl_ms"]["p99"], completed=res["completed"],
                   failed=res["failed"])
        # recovery: worker 1's process SIGKILLed; until an answer that needs every expert again
        victim = client.ping()["workers"][1]
        t_kill = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        client.close()
        first_answer(url, time.monotonic() + 300).close()
        rec["recovery_s"] = time.monotonic() - t_kill
    finally:
        rec["gateway_rc"] = stop_process(proc, timeout=60.0)
    return rec


def inner(args) -> int:
    """In the head's namespace: the arms, interleaved."""
    load_args = ["--mode", "fixed-rate", "--rate", "1000", "--max-requests", str(args.requests), "--warmup",
                 str(args.warmup), "--concurrency", str(args.concurrency), "--prefill", "64", "--decode", "8"]
    arms = [(a, b) for b in args.backend for a in ("local", "ray")]
    out_dir = tempfile.mkdtemp(prefix="moe-fig-")
    records = []
    try:
        for rnd in range(args.rounds):
            order = arms if rnd % 2 == 0 else list(reversed(arms))
            for arm, backend in order:
                rec = run_arm(arm, backend, args.ray_address, args.head_ip, load_args, out_dir,
                              f"{rnd}-{arm}-{backend}")
                rec["round"] = rnd
                records.append(rec)
                print(json.dumps(rec), flush=True)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    print("RESULT " + json.dumps({"records": records, "load_args": load_args}), flush=True)
    return 0


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


METRICS = (("tokens_per_s", "tokens/s", "{:.0f}"), ("p99_tpot_ms", "p99 TPOT ms", "{:.1f}"),
           ("p99_itl_ms", "p99 ITL ms", "{:.1f}"), ("startup_s", "start-up to first answer s", "{:.1f}"),
           ("recovery_s", "recovery after a worker kill s", "{:.1f}"))


def table(records: list) -> str:
    """Median [min-max] over the rounds per arm, and the median of the per-round ratios
    ray/local (each round's two arms ran back to back, so the machine's drift cancels)."""
    rows = ["| backend | arm | " + " | ".join(name for _, name, _ in METRICS) + " |",
            "|---|---|" + "---|" * len(METRICS)]
    for backend in sorted({r["backend"] for r in records}, reverse=True):
        by = {arm: {r["round"]: r for r in records if r["arm"] == arm and r["backend"] == backend}
              for arm in ("local", "ray")}
        for arm, label in (("local", "--local-workers 3"), ("ray", "--placement ray")):
            cells = []
            for key, _, fmt in METRICS:
                xs = [r[key] for r in by[arm].values()]
                cells.append(f"{fmt.format(median(xs))} [{fmt.format(min(xs))}-{fmt.format(max(xs))}]")
            rows.append(f"| {backend} | {label} | " + " | ".join(cells) + " |")
        rounds = sorted(set(by["local"]) & set(by["ray"]))
        cells = []
        for key, _, _ in METRICS:
            ratios = [by["ray"][n][key] / by["local"][n][key] for n in rounds]
            cells.append(f"{median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]")
        rows.append(f"| {backend} | ray / local, per round | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ray_figures", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every arm")
    p.add_argument("--backend", action="append", choices=["shm", "tcp"], help="default: shm and tcp")
    p.add_argument("--requests", type=int, default=240, help="measured requests per arm (64-token prefill, 8 decode)")
    p.add_argument("--concurrency", type=int, default=4, help="client threads")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--worker-niceness", type=int, default=None,
                   help="RAY_worker_niceness for the Ray nodes (Ray starts its workers at niceness 15 by "
                        "default; --local-workers run at the gateway's, 0); default: Ray's")
    p.add_argument("--json", default=None, help="write the records and the table here")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ray-address", default=None, help=argparse.SUPPRESS)
    p.add_argument("--head-ip", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.backend = args.backend or ["shm", "tcp"]
    if args.inner:
        return inner(args)

    lan = NetnsLan(3, tag=f"moef{os.getpid() % 100000}").open()
    extra = {} if args.worker_niceness is None else {"RAY_worker_niceness": str(args.worker_niceness)}
    ray = RayCluster(lan, cpus=[2, 1, 1], env=extra)
    # a secret of this run's own (not the per-user default file the gateways would create)
    fd, secret = tempfile.mkstemp(prefix="moe-fig-secret-")
    os.write(fd, os.urandom(16).hex().encode() + b"\n")
    os.close(fd)
    try:
        t = time.monotonic()
        ray.start()
        print(f"ray cluster of 3 nodes up in {time.monotonic() - t:.1f} s at {ray.address}", file=sys.stderr)
        cmd = lan.exec(0) + [sys.executable, "-m", "bench.ray_figures", "--inner", "--ray-address", ray.address,
                             "--head-ip", lan.ips[0], "--rounds", str(args.rounds), "--requests", str(args.requests),
                             "--concurrency", str(args.concurrency), "--warmup", str(args.warmup)]
        for b in args.backend:
            cmd += ["--backend", b]
        env = dict(ray.env, MOE_SECRET_FILE=secret)
        env.pop("RAY_TMPDIR", None)
        r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, timeout=7200)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        if r.returncode or not lines:
            print(r.stdout[-4000:], file=sys.stderr)
            return 1
        doc = json.loads(lines[-1][len("RESULT "):])
    finally:
        os.unlink(secret)
        ray.close()
        leaked = lan.close()
        ray.remove_temp()
        if leaked:
            print(f"left behind and killed: {leaked}", file=sys.stderr)
    doc["table"] = table(doc["records"])
    doc["command"] = shlex.join([sys.executable, "-m", "bench.ray_figures", *(argv or sys.argv[1:])])
    print(doc["table"])
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
