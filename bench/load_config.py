"""What `moe-bench load`'s flags default to and may name, and the error for flags that
contradict each other (bench.load resolves them)."""
from __future__ import annotations

import argparse


DEMO = dict(d_model=256, d_ff=512, prefill=64, decode=8)
FULL = dict(d_model=1024, d_ff=2048, prefill=256, decode=32)
LAYER_DEFAULTS = dict(n_experts=8, top_k=2, dtype="float32")
STARTED_DEFAULTS = dict(local_workers=2, max_wait_ms=1.0, max_inflight_rounds=2)
# the started gateway's routing and policies (moe-gateway's defaults)
GATEWAY_DEFAULTS = dict(replicas=1, overflow="drop", noisy=False, noise_std=1.0, batching="fifo",
                        balancing="load-aware", chunk_rows="auto")
# --sweep KEY: the layer's shape; --compare KEY: a gateway policy (aliases -> the flag's dest)
SWEEP_KEYS = {"n_experts": int, "top_k": int, "d_model": int}
COMPARE_KEYS = {"batching": str, "balancing": str, "max_inflight_rounds": int, "chunk_rows": str, "placement": str}
KEY_ALIASES = {"experts": "n_experts", "k": "top_k", "inflight": "max_inflight_rounds",
               "pipelining": "max_inflight_rounds", "rounds_in_flight": "max_inflight_rounds",
               "chunks": "chunk_rows"}
MIXED_BURSTINESS = 0.25  # mixed mode's default gamma shape: gaps with a CV of 2
# peers go after ours, the reference last: its two BLAS threads spin after their work
ORDER = {"moe-transport": 0, "multiprocessing": 1, "ray": 2, "reference": 3}


class ConfigError(Exception):
    """The flags contradict each other or the running gateway: refused before any load."""


def seconds_to_ms(args: argparse.Namespace) -> None:
    """The flags in seconds as the milliseconds the load tool and its JSON keep."""
    wait = getattr(args, "max_wait", None)
    args.max_wait_ms = None if wait is None else wait * 1e3
    for key, default in (("slo_tpot", 0.1), ("slo_ttft", 2.0)):
        v = getattr(args, key, None)
        setattr(args, f"{key}_ms", (default if v is None else v) * 1e3)
