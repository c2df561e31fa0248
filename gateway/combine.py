"""The weighted combine of a request's expert outputs: the one home for it, whole or chunked.

A part sent whole is combined once its reply is in (:func:`combine_request`, straight from
the reply where it landed into the caller's output). A part sent in chunks is summed as each
chunk lands (:func:`add_chunk`, into the float32 sum :func:`start_sums` made once the round's
messages went), so its worker's credit returns at once; :func:`combine_request` then only
finishes that sum into the output (rounding bf16 once).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from gateway.dispatch import SumBuffers
    from gateway.requests import Request, Round


def combine_request(req: "Request", out: np.ndarray) -> np.ndarray:
    """``req``'s output into ``out`` (T, d), from its round's replies where they landed."""
    if req.error is not None:
        raise req.error
    rnd = req.round
    t, cpu0 = time.perf_counter(), time.thread_time()
    if req.acc is not None:  # a chunked round: summed as the chunks landed
        req.plan.finish(req.acc, out)
        req.drop_sum()
    else:
        outputs = []
        for w in range(req.plan.n_workers):
            n = req.plan.worker_tokens(w)
            if n == 0:
                outputs.append(None)
            else:
                base = req.bases[w]
                outputs.append(rnd.replies[w][0][1][base:base + n])
        req.plan.combine(outputs, out, sums=rnd.sums)
    rnd.stats.combine_s += time.perf_counter() - t
    rnd.stats.own_cpu_s += time.thread_time() - cpu0
    rnd.combined()
    return out


def start_sums(rnd: "Round", d_model: int, sums: "SumBuffers") -> None:
    """A chunked round's sums, made after its messages went (the first reply can only be
    read after this returns): off the path to the first worker's start."""
    if rnd.chunked:
        for r in rnd.requests:
            if r.round is rnd and r.waiting and r.acc is None:
                r.acc = r.plan.accumulator(d_model, into=r.out, sums=sums)


def add_chunk(rnd: "Round", w_index: int, lo: int, hi: int, users: list, y: np.ndarray) -> None:
    """Add worker ``w_index``'s reply ``y`` (rows [lo, hi) of its part) into the sums of the
    requests ``users`` whose rows it holds."""
    t, cpu0 = time.perf_counter(), time.thread_time()
    for r in users:
        base = r.bases[w_index]
        a, b = max(lo, base), min(hi, base + r.plan.worker_tokens(w_index))
        r.plan.accumulate(w_index, a - base, b - base, y[a - lo:b - lo], r.acc)
    rnd.stats.combine_s += time.perf_counter() - t
    rnd.stats.own_cpu_s += time.thread_time() - cpu0
