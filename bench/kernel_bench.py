"""One SwiGLU expert's compute alone, per kernel and token count, on one thread.

    python -m bench.kernel_bench                          # 1024x2048, tokens 8/64/256/1024
    python -m bench.kernel_bench --kernels numpy:float32,torch:bfloat16,torch:float32 --json out.json

GFLOP/s = 3 matmuls x 2 x n x d_model x d_ff per forward, over the median of ``--reps``
timed batches (each at least ``--min-time`` seconds). The kernels are the workers' own
(workers.kernels), writing into a preallocated output as a worker writes into its reply
slot. Exposes ``add_arguments``/``run`` like the ``moe-bench`` subcommands.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from workers.kernels import cpu_bf16_matmul, make_kernel


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--d-ff", type=int, default=2048)
    p.add_argument("--tokens", default="8,64,256,1024", help="comma-separated token counts")
    p.add_argument("--kernels", default="numpy:float32,torch:bfloat16,torch:float32",
                   help="comma-separated kind:dtype pairs")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--min-time", type=float, default=0.2, help="seconds per timed batch")
    p.add_argument("--json", help="write the results here")


def _activation(n: int, d: int, dtype: str, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((n, d)).astype(np.float32)
    if dtype == "bfloat16":
        import ml_dtypes
        return x.astype(ml_dtypes.bfloat16)
    return x.astype(dtype)


def measure(kind: str, dtype: str, n: int, d_model: int, d_ff: int, threads: int, reps: int, min_time: float
            ) -> float:
    rng = np.random.default_rng(0)
    ws = [(rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32)
          for s in ((d_ff, d_model), (d_ff, d_model), (d_model, d_ff))]
    # numpy: BLAS threads come from run()'s threadpool_limits; torch: set_num_threads
    k = make_kernel(kind, *ws, dtype=dtype, max_tokens=n, threads=threads if kind == "torch" else None)
    x = _activation(n, d_model, dtype, rng)
    out = np.empty_like(x)
    k.forward(x, out)  # warm up (oneDNN picks and JITs its kernel on first use)
    calls, t0 = 0, time.perf_counter()
    while calls < 2 or time.perf_counter() - t0 < min_time / 4:  # calibrate the batch size
        k.forward(x, out)
        calls += 1
    per = max(1, int(min_time * calls / (time.perf_counter() - t0)))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(per):
            k.forward(x, out)
        times.append((time.perf_counter() - t) / per)
    return 6.0 * n * d_model * d_ff / statistics.median(times) / 1e9


def run(args: argparse.Namespace) -> int:
    from threadpoolctl import threadpool_limits
    with threadpool_limits(args.threads):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    tokens = [int(t) for t in args.tokens.split(",")]
    kernels = [tuple(k.split(":")) for k in args.kernels.split(",")]
    rows = []
    print(f"SwiGLU {args.d_model}x{args.d_ff}, {args.threads} thread(s), cpu bf16 matmul units: {cpu_bf16_matmul()}")
    cols = [f"{k}:{d}" for k, d in kernels]
    print("tokens  " + "  ".join(cols) + "   (GFLOP/s)")
    for n in tokens:
        line = []
        for (kind, dtype), col in zip(kernels, cols):
            g = measure(kind, dtype, n, args.d_model, args.d_ff, args.threads, args.reps, args.min_time)
            rows.append({"kernel": kind, "dtype": dtype, "tokens": n, "gflops": float(f"{g:.3g}")})
            line.append(f"{g:.1f}".rjust(len(col)))
        print(f"{n:>6}  " + "  ".join(line), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"d_model": args.d_model, "d_ff": args.d_ff, "threads": args.threads,
                       "cpu_bf16_matmul": cpu_bf16_matmul(), "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m bench.kernel_bench", description=__doc__.split("\n")[0])
    add_arguments(ap)
    sys.exit(run(ap.parse_args()))
