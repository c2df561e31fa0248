"""The load tool's two models, computed from a run's routing trace (no I/O):

- all-to-all communication volume: what expert parallelism moves for the run — each kept
  (token, expert) assignment sends the token's row to the expert's worker (dispatch) and
  its output row back (combine); per worker when the placement is known. The transport's
  own byte counters, read from the gateway, check the model.
- an LRU expert cache: if only ``c`` experts could be resident (the rest paged in on
  demand), the share of expert uses that find theirs resident, for every ``c``.

A trace is a list of :class:`Step` (one forward pass: time, the experts its tokens use and
how many rows each), in the order the passes ran.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class Step:
    t: float  # seconds since the run started
    rows: np.ndarray  # (n_experts,) kept assignments per expert in this pass
    tokens: int
    dropped: int = 0
    overflow: int = 0


def replay(router, passes: Sequence[tuple[float, np.ndarray]], bank) -> list[Step]:
    """Route every recorded pass again (its tokens are ``bank.rows(idx)``): the trace for
    the time-resolved models (LRU cache, volume over time). A noisy router is replayed
    noisy, from a fresh copy's own seeded noise stream: the same noise distribution, not the
    gateway's draws (those depend on how its rounds interleaved the requests, which no
    replay reproduces); what the gateway really routed comes from its own counters
    (``gateway_expert_rows`` of each record)."""
    if router.noisy:
        from gateway.router import Router
        router = Router.from_description(router.describe())
    out = []
    for t, idx in passes:
        r = router.route(bank.rows(idx))
        out.append(Step(t, np.asarray(r.expert_counts, np.int64), r.num_tokens, r.dropped, r.overflow))
    return out


def gateway_routing(records: Sequence[dict], n_experts: int) -> Optional[dict]:
    """The routing a moe-transport gateway really did over ``records`` (ramp steps), from
    its own counters: rows sent per expert (after capacity), assignments dropped and over
    capacity. None when the records carry no gateway counters."""
    rows = np.zeros(n_experts, np.int64)
    seen = False
    dropped = overflow = 0
    for rec in records:
        if "gateway_expert_rows" not in rec:
            continue
        seen = True
        r = np.asarray(rec["gateway_expert_rows"], np.int64)[:n_experts]
        rows[:len(r)] += r
        dropped += int(rec.get("gateway_dropped", 0))
        overflow += int(rec.get("gateway_overflow", 0))
    if not seen:
        return None
    total = int(rows.sum())
    share = (rows / total).tolist() if total else [0.0] * n_experts
    return {"rows": rows.tolist(), "share": share, "dropped": dropped, "overflow": overflow,
            "max_over_mean": float(rows.max() / rows.mean()) if total else None}


def comm_volume(trace: Sequence[Step], row_bytes: int, placement: Optional[Sequence[Sequence[int]]] = None,
                wall_s: Optional[float] = None) -> dict:
    """Bytes dispatched to and combined from the experts over the run."""
    if not trace:
        return {"dispatch_bytes": 0, "combine_bytes": 0, "total_bytes": 0, "bytes_per_token": 0.0}
    rows = np.sum([s.rows for s in trace], axis=0)
    tokens = sum(s.tokens for s in trace)
    dispatch = int(rows.sum()) * row_bytes
    out = {"dispatch_bytes": dispatch, "combine_bytes": dispatch, "total_bytes": 2 * dispatch,
           "tokens": tokens, "assignments": int(rows.sum()), "row_bytes": row_bytes,
           "bytes_per_token": 2 * dispatch / tokens if tokens else 0.0,
           "per_expert_bytes": [int(r) * row_bytes * 2 for r in rows]}
    if placement is not None:
        # rows of an expert with several hosts are split between them: count its share evenly
        per_worker = np.zeros(len(placement))
        for e, n in enumerate(rows):
            hosts = [w for w, ex in enumerate(placement) if e in ex]
            for w in hosts:
                per_worker[w] += 2.0 * n * row_bytes / len(hosts)
        out["per_worker_bytes"] = [float(b) for b in per_worker]
    if wall_s:
        out["gbps"] = 2 * dispatch / wall_s / 1e9
    return out


def lru_hit_rates(trace: Sequence[Step], n_experts: int) -> list[float]:
    """hit_rates[c - 1]: share of expert uses that find the expert resident in an LRU cache
    of c experts (c = 1 .. n_experts; c = n_experts only misses the first use of each)."""
    seq = [np.flatnonzero(s.rows).tolist() for s in trace]
    accesses = sum(len(x) for x in seq)
    if not accesses:
        return [0.0] * n_experts
    rates = []
    for c in range(1, n_experts + 1):
        cache: OrderedDict = OrderedDict()
        hits = 0
        for used in seq:
            for e in used:
                if e in cache:
                    hits += 1
                    cache.move_to_end(e)
                else:
                    cache[e] = True
                    if len(cache) > c:
                        cache.popitem(last=False)
        rates.append(hits / accesses)
    return rates


def expert_load(trace: Sequence[Step], n_experts: int, bin_s: float = 1.0) -> dict:
    """Per-expert share of the run's rows, and rows per expert per time bin (for a plot)."""
    if not trace:  # nothing completed (e.g. every request refused): an empty load, not a crash
        return {"share": [0.0] * n_experts, "bins_t": [], "bins": [], "bin_s": bin_s, "dropped": 0, "overflow": 0}
    rows = np.sum([s.rows for s in trace], axis=0).astype(np.float64)
    t_end = max(s.t for s in trace)
    nb = int(t_end // bin_s) + 1
    bins = np.zeros((nb, n_experts))
    for s in trace:
        bins[int(s.t // bin_s)] += s.rows
    return {"share": (rows / rows.sum()).tolist() if rows.sum() else [0.0] * n_experts,
            "bins_t": [i * bin_s for i in range(nb)], "bins": bins.tolist(), "bin_s": bin_s,
            "dropped": sum(s.dropped for s in trace), "overflow": sum(s.overflow for s in trace)}
