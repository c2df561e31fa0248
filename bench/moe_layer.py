"""The distributed MoE layer beside its peers, measured: the library `moe-bench moe`
(bench/moe_bench.py) drives.

Systems, same weights and router, same batches, interleaved round by round:
- reference-1t / reference-2t: the in-process ReferenceMoE with one and two BLAS threads
  (the compute floor; the 2-core ceiling is twice the one-thread rate), each in a forked
  child: two OpenBLAS threads in the measuring process keep spinning after their work and
  would slow every system measured after them on 2 cores;
- multiprocessing: two worker processes fed through multiprocessing pipes (the peer a
  user would write first); pyzmq: the same over pyzmq tcp sockets (where it is installed);
- moe-transport: real `moe-worker` processes driven by the gateway's WorkerPool, per backend,
  with each worker's part sent whole (one message) and, as moe-transport+chunks, in chunks
  (pipelined rounds, gateway/chunking.py): per round, the busiest worker's time with no
  token to compute bounds what chunking can gain, and the report sets the gain beside it.
  The two run on the same worker processes and pool, their forwards in turn one by one:
  the gain is then the chunks' alone, not one set of processes' or one slow spell's.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import time
import uuid
from typing import Any, Callable, Optional

import numpy as np

from bench.systems import Multiprocessing, Zmq
from workers.flags import worker_argv

FULL = dict(d_model=1024, d_ff=2048, batch=256)
QUICK = dict(d_model=256, d_ff=512, batch=128)


# -- the reference, in a child of its own ------------------------------------------------
def _reference_child(conn, threads: int, d: int, dff: int, n_experts: int, top_k: int, seed: int) -> None:
    from threadpoolctl import threadpool_limits

    from gateway.reference import ReferenceMoE
    threadpool_limits(threads)
    ref = ReferenceMoE.from_seed(d, dff, n_experts, top_k, seed=seed)
    while True:
        xs = conn.recv()
        if xs is None:
            return
        times = []
        for x in xs:
            t0 = time.perf_counter()
            ref.forward(x)
            times.append(time.perf_counter() - t0)
        conn.send(times)


class ReferenceChild:
    def __init__(self, threads: int, d: int, dff: int, n_experts: int, top_k: int, seed: int):
        import multiprocessing as mp
        self.conn, child = mp.get_context("fork").Pipe()
        self.proc = mp.get_context("fork").Process(target=_reference_child, daemon=True,
                                                   args=(child, threads, d, dff, n_experts, top_k, seed))
        self.proc.start()
        child.close()

    def run(self, xs: list) -> list:
        self.conn.send(xs)
        if not self.conn.poll(600):
            raise TimeoutError("reference child did not answer")
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(10)


# -- moe-transport: real worker processes ---------------------------------------------
class TransportSystem:
    """Real worker processes behind a WorkerPool, each worker's part of a round cut as
    ``chunk_rows`` says. :meth:`same_workers` makes a second system on the same processes
    and pool that cuts parts another way: the two then differ in nothing else (two sets of
    processes differ in where their memory landed, and in what else ran beside each)."""

    def __init__(self, backend: str, router, n_workers: int, d_model: int, d_ff: int, seed: int, batch: int,
                 dtype: str = "float32", extra: tuple = (), chunk_rows="auto"):
        from gateway.pool import WorkerPool
        from transport.service import secrets
        from transport.service.launch import blas_env, spawn_service
        n_exp = router.n_experts
        self.procs: list = []
        self.pool = None
        self.owner = True  # closes the pool and stops the workers
        self.chunk_rows = chunk_rows
        self.stages: list[dict] = []
        # one secret for the pool and its workers, found or made as the services do: looking
        # only for an existing file left the pool with none on a fresh machine while each
        # worker made and required one
        try:
            secret, secret_path = secrets.for_service()
            extra = (*extra, "--secret-file", secret_path)
        except OSError:  # no writable home: the workers cannot make one either
            secret = None
        # --exit-with-parent: a benchmark killed mid-run leaves no worker behind (holding our
        # stdout, orphans kept a caller's pipe open after we died)
        extra = (*extra, "--exit-with-parent")
        urls = []
        try:
            for w in range(n_workers):
                listen = {"shm": f"shm://moe-bench-{uuid.uuid4().hex[:8]}", "tcp": "tcp://127.0.0.1:0",
                          "rdma": f"rdma://{os.environ.get('MOE_RDMA_IP', '10.0.2.15')}:0"}[backend]
                experts = [e for e in range(n_exp) if e * n_workers // n_exp == w]
                proc, url = spawn_service(worker_argv(listen, experts, d_model=d_model, d_ff=d_ff, seed=seed,
                                                      max_tokens=batch * router.top_k, dtype=dtype, extra=extra),
                                          env=blas_env(1), timeout=60)
                self.procs.append(proc)
                urls.append(url)
            self.pool = WorkerPool(urls, router, max_batch_tokens=batch, timeout=60, dtype=dtype, secret=secret,
                                   chunk_rows=chunk_rows)
        except BaseException:  # the workers started so far go with the failed start
            self._stop_workers()
            raise

    def same_workers(self, chunk_rows) -> "TransportSystem":
        """A system on these worker processes and this pool whose forwards cut parts as
        ``chunk_rows`` says; closing it leaves them to this one."""
        other = copy.copy(self)  # the processes and the pool are the same objects
        other.owner, other.chunk_rows, other.stages = False, chunk_rows, []
        return other

    def chunk_choice(self) -> Optional[dict]:
        """Auto's whole-or-chunked choice as it stands (None without auto)."""
        return self.pool.chunk_choice() if self.pool is not None and self.chunk_rows == "auto" else None

    def forward(self, x: np.ndarray) -> np.ndarray:
        self.pool.chunk_rows = self.chunk_rows  # a system sharing the pool may have set another
        t0, c0 = time.perf_counter(), time.process_time()
        y, st = self.pool.forward(x)
        self.stages.append({**st.as_dict(), "forward_s": time.perf_counter() - t0,
                            "gateway_cpu_s": time.process_time() - c0})
        return y

    def close(self) -> None:
        if not self.owner:
            return
        if self.pool is not None:
            self.pool.close()
        self._stop_workers()

    def _stop_workers(self) -> None:
        from transport.service.launch import stop_process
        for p in self.procs:
            stop_process(p)


def _pct(a: list[float]) -> tuple[float, float]:
    arr = np.asarray(a) * 1e3
    return float(np.percentile(arr, 50)), float(np.percentile(arr, 99))


def per_row_line(snap: dict) -> str:
    """What auto's whole-or-chunked choice stands on (ChunkMode.snapshot), for the warm-up
    line: a run that sent its parts whole shows whether its chunked probes measured dearer."""
    w, c = snap.get("whole_s_per_row"), snap.get("chunked_s_per_row")
    if w is None or c is None:
        return ""
    if snap.get("chunks_cheaper"):
        verdict = "chunks measured cheaper"
    elif snap.get("chunks_kept"):
        verdict = "chunks kept, not dearer"
    else:
        verdict = "whole parts measured cheaper" if w <= c else "chunks not cheaper by the margin: parts whole"
    return f"; per row, whole {w * 1e6:.2f} us, chunked {c * 1e6:.2f} us (lower quartiles): {verdict}"


def no_token_s(st: dict) -> float:
    """The busiest worker's time with no token to compute in one forward (a stage dict of
    TransportSystem): the forward less its routing and that worker's receive-to-reply time.
    The gather, the messages' flight and the combine count (chunks can hide them); routing
    does not: it precedes the round and needs the whole batch (capacity is per batch).
    The round's own clock (``total_s``) stops at the last reply and would leave out the
    combine of a part sent whole, which chunks do hide: the gain would pass the bound."""
    return max(0.0, st["forward_s"] - st["route_s"] - st["busiest_s"])


def pipelining_gain(whole: dict, chunked: dict) -> dict:
    """Chunked beside whole parts, from one run: the gain, and its bound. With the busiest
    worker never idle, a forward would take its time less that worker's time with no token
    to compute (:func:`no_token_s`): bound = forward / (forward - no_token), from medians.
    ``gain``: tokens/s (a mean over the forwards); ``p50_gain``: the median forwards'
    ratio, the one set against the bound (``of_bound``, the share of the possible gain
    realized: (p50_gain - 1) / (bound - 1)) -- a mean takes in one slow forward whole,
    which the medians the bound is made of do not.

    ``cpu_bound``: what the processors allow besides. A forward cannot take less than the
    CPU work in it (the gateway's, and every worker's compute) spread over the cores -- with
    more busy processes than cores, overlap hands a core from one to another -- nor less
    than the gateway's own work, done on its one thread: where the gateway is the slowest
    part, the worker waits for it whatever the chunks. ``of_cpu_bound``: the share of the
    gain the tighter of the two bounds leaves."""
    st = whole["stage_ms"]
    round_ms, idle = st["forward"], st["no_token"]
    p50_gain = whole["p50_ms"] / chunked["p50_ms"]
    b = gain_bounds(round_ms, idle, st["gateway_cpu"], st["compute_total"], p50_gain)
    return {"gain": chunked["tokens_per_s"] / whole["tokens_per_s"], "p50_gain": p50_gain, **b,
            "gateway_cpu_ms": st["gateway_cpu"],
            "round_ms": round_ms, "no_token_ms": idle, "chunked_no_token_ms": chunked["stage_ms"]["no_token"],
            "p99_ratio": chunked["p99_ms"] / whole["p99_ms"], "messages": chunked["stage_ms"]["messages"],
            "shortfall": shortfall(st, chunked["stage_ms"], b["of_bound"])}


#: the parts of :func:`shortfall`, in the order reports give them
SHORTFALL_PARTS = ("own_no_token", "busier", "routing", "rest")


def shortfall(whole_ms: dict, chunked_ms: dict, of_bound: float) -> dict:
    """Where the share of the bound a run did not realize went, in points of the bound
    (``100 * (1 - of_bound)`` in all), from the two systems' per-forward medians in ms
    (``no_token``, ``busiest``, ``route``). With the busiest worker ``I`` ms of a whole
    forward ``F`` without a token, a chunked forward ``S`` ms over the bound's ``F - I``
    realizes about ``1 - S / I`` of it (S and I small against F): each ms of S costs
    ``100 / I`` points.

    ``own_no_token``: the chunked round's own no-token time (the plan and the first chunk's
    gather before the worker starts, the last reply's sum after it ends, the worker's gaps
    between chunks); ``busier``: the busiest worker's receive-to-reply time past a whole
    part's (its compute beside the gateway's work on the replies, each message's own
    handling); ``routing``: routing's difference (the bound leaves routing aside, both
    ways route alike); ``rest``: what the medians leave unattributed (they do not add up
    exactly, and the share is taken from wall-clock forwards)."""
    idle = whole_ms["no_token"]
    missing = 100.0 * (1.0 - of_bound)
    if not idle > 0 or not math.isfinite(missing):
        return {k: float("nan") for k in ("missing", *SHORTFALL_PARTS)}
    pts = {"own_no_token": 100.0 * chunked_ms["no_token"] / idle,
           "busier": 100.0 * (chunked_ms["busiest"] - whole_ms["busiest"]) / idle,
           "routing": 100.0 * (chunked_ms["route"] - whole_ms["route"]) / idle}
    pts["rest"] = missing - sum(pts.values())
    return {"missing": missing, **pts}


def shortfall_medians(stages: list) -> dict:
    """The per-forward medians (ms) :func:`shortfall` takes, from TransportSystem's stage dicts."""
    return {"no_token": float(np.median([no_token_s(s) for s in stages])) * 1e3,
            "busiest": float(np.median([s["busiest_s"] for s in stages])) * 1e3,
            "route": float(np.median([s["route_s"] for s in stages])) * 1e3}


def shortfall_line(sf: dict) -> str:
    """One line: the missing points and their parts."""
    if not math.isfinite(sf.get("missing", float("nan"))):
        return ""
    names = {"own_no_token": "its own no-token time", "busier": "the busiest worker busier",
             "routing": "routing", "rest": "the rest"}
    return (f"{sf['missing']:.0f} points of the bound missing: " +
            ", ".join(f"{names[k]} {sf[k]:+.0f}" for k in SHORTFALL_PARTS))


def gain_bounds(forward_ms: float, no_token_ms: float, gateway_cpu_ms: float, compute_total_ms: float,
                gain: float) -> dict:
    """The two bounds of :func:`pipelining_gain`, from a whole-part forward's medians, and
    the share of each that ``gain`` realizes."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    bound = forward_ms / max(forward_ms - no_token_ms, 1e-9)
    work = max((gateway_cpu_ms + compute_total_ms) / cores, gateway_cpu_ms)
    cpu_bound = forward_ms / max(forward_ms - no_token_ms, work, 1e-9)
    return {"bound": bound, "cpu_bound": cpu_bound, "cores": cores,
            "of_bound": (gain - 1) / (bound - 1) if bound > 1 else float("nan"),
            "of_cpu_bound": (gain - 1) / (cpu_bound - 1) if cpu_bound > 1 else float("nan")}


def warmup_forwards(args: argparse.Namespace) -> int:
    """--warmup-forwards, else the rounds auto's chunk choice sends before it has measured both ways
    (WARMUP whole, then PROBES chunked every other round), and one more."""
    from gateway.chunking import PROBES, WARMUP
    w = getattr(args, "warmup_forwards", None)
    return WARMUP + 2 * PROBES + 1 if w is None else max(0, int(w))


#: without --warmup-forwards, a system whose auto choice still probes after the default
#: warm-up gets up to this many times as many again
WARMUP_EXTEND = 4


def warm_up(system: Any, forward: Callable[[int], Any], args: argparse.Namespace) -> int:
    """Untimed forwards (``forward(i)`` runs the i-th), as many as :func:`warmup_forwards`
    says; then, unless --warmup-forwards fixed the count, more while ``system``'s auto
    choice is still measuring both ways (and is asked about each forward). It leaves out
    rounds that faulted in fresh memory
    (gateway/chunking.py, ChunkMode), so a cold start takes more rounds than the default,
    and timing those would time the probing. Returns the forwards run."""
    n = warmup_forwards(args)
    for i in range(n):
        forward(i)
    choice = getattr(system, "chunk_choice", None)
    if getattr(args, "warmup_forwards", None) is not None or choice is None:
        return n
    from gateway.chunking import REPROBE_EVERY
    asked, quiet = None, 0
    for extra in range(WARMUP_EXTEND * n):
        snap = choice()
        if snap is None or not snap["asked"] or snap["settled"]:
            return n + extra
        # not asked about the last REPROBE_EVERY forwards: the size model sends this batch
        # whole, and more forwards would not settle anything. Not after one: a size model
        # that priced chunks out sends one round in REPROBE_EVERY in chunks again, and a
        # warm-up that stops at the first whole round leaves auto probing in the timed
        # forwards
        quiet = quiet + 1 if snap["asked"] == asked else 0
        if quiet >= REPROBE_EVERY:
            return n + extra
        asked = snap["asked"]
        forward(n + extra)
    return n + WARMUP_EXTEND * n



def measure(args: argparse.Namespace, dims: dict) -> dict:
    """One run at one batch size: every system started, checked against the reference,
    warmed up and timed; prints its report and returns its JSON document."""
    from threadpoolctl import threadpool_limits
    from gateway.reference import ReferenceMoE

    d, dff, batch = dims["d_model"], dims["d_ff"], dims["batch"]
    backends = args.backend or ["shm", "tcp"]
    ref = ReferenceMoE.from_seed(d, dff, args.n_experts, args.top_k, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    xs = [rng.standard_normal((batch, d)).astype(np.float32) for _ in range(args.batches)]
    print(f"config: {args.n_experts} experts, top-{args.top_k}, d_model {d}, d_ff {dff}, "
          f"{batch}-token batches, {args.local_workers} workers; {args.rounds} rounds x {args.batches} batches")

    # forked first, so they inherit none of the systems' connections
    refs = {f"reference-{t}t": ReferenceChild(t, d, dff, args.n_experts, args.top_k, args.seed) for t in (1, 2)}
    systems: dict[str, Any] = {}
    with threadpool_limits(1):  # the gateway side stays on one BLAS thread
        systems["multiprocessing"] = Multiprocessing(ref.router, args.local_workers, dff, args.seed, batch * args.top_k)
        try:
            systems["pyzmq/tcp"] = Zmq(ref.router, args.local_workers, dff, args.seed, batch * args.top_k)
        except ImportError:
            print("note: pyzmq is not installed here; its row is left out (pip install 'moe-transport[bench]')")
    from gateway.chunking import parse_chunk_rows
    chunk_rows = parse_chunk_rows(args.chunk_rows)
    twins: dict[str, list[str]] = {}  # whole parts' system -> those on its workers, timed in turn with it
    for b in backends:
        whole = systems[f"moe-transport/{b}"] = TransportSystem(b, ref.router, args.local_workers, d, dff,
                                                                args.seed, batch, chunk_rows=0)
        others = [("chunks", chunk_rows)] if chunk_rows != 0 else []
        others += [("control", 0)] if getattr(args, "control", False) else []
        for kind, rows_ in others:
            systems[f"moe-transport+{kind}/{b}"] = whole.same_workers(rows_)
            twins.setdefault(f"moe-transport/{b}", []).append(f"moe-transport+{kind}/{b}")
    timed_beside = {n for ns in twins.values() for n in ns}
    lat: dict[str, list[float]] = {"reference-1t": [], "reference-2t": [], **{k: [] for k in systems}}
    try:
        with threadpool_limits(1):
            expect = ref.forward(xs[0])[0]
        for name, sys_ in systems.items():  # every system computes the same layer
            got = sys_.forward(xs[0])
            err = float(np.max(np.abs(got - expect)))
            if err > 1e-3 * max(1.0, float(np.max(np.abs(expect)))):
                raise AssertionError(f"{name} disagrees with the reference (max abs err {err})")
        # untimed: first touches, and auto's choice measuring both ways (a start-up cost,
        # not the steady state the figures compare)
        for name, sys_ in systems.items():
            def one(i: int, sys_=sys_) -> None:
                with threadpool_limits(1):
                    sys_.forward(xs[i % len(xs)])
            n = warm_up(sys_, one, args)
            if isinstance(sys_, TransportSystem):
                del sys_.stages[:]
                snap = sys_.chunk_choice()
                if snap is not None and snap["asked"]:
                    print(f"{name}: {n} warm-up forwards; auto's choice measured {snap['measured']} rounds, "
                          f"left out {snap['cold']} that faulted in fresh memory"
                          + ("" if snap["settled"] else ", and has not measured both ways yet")
                          + per_row_line(snap), flush=True)
        for r in range(args.rounds):
            for name in list(systems) + list(refs):  # the references last, then a pause:
                if name in refs:  # OpenBLAS threads spin ~0.1 s after their work and would
                    lat[name].extend(refs[name].run(xs))  # steal a core from the next system
                    if name.endswith("2t"):
                        time.sleep(0.5)
                    continue
                if name in timed_beside:
                    continue  # timed beside its twin
                # a twin pair forward by forward: blocks of each in turn give one of them the
                # machine's slow spells of a few forwards (see
                # docs/design.md#compare-in-the-same-run-on-the-same-processes)
                for x in xs:
                    for one in (name, *twins.get(name, ())):
                        t0 = time.perf_counter()
                        with threadpool_limits(1):
                            systems[one].forward(x)
                        lat[one].append(time.perf_counter() - t0)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{n} {batch * args.batches / sum(v[-args.batches:]):.0f} tok/s" for n, v in lat.items()), flush=True)
        stage_ms = {}
        for name, s in systems.items():
            if isinstance(s, TransportSystem) and s.stages:
                keys = ("route_s", "dispatch_s", "gather_s", "compute_s", "wait_s", "combine_s", "total_s",
                        "forward_s", "gateway_cpu_s", "compute_total_s", "busiest_s")
                stage_ms[name] = {k[:-2]: float(np.median([st[k] for st in s.stages])) * 1e3 for k in keys}
                # the busiest worker's time with no token to compute, per forward
                stage_ms[name]["no_token"] = float(np.median([no_token_s(st) for st in s.stages])) * 1e3
                stage_ms[name]["messages"] = float(np.median([st["messages"] for st in s.stages]))
    finally:
        for s in list(systems.values()) + list(refs.values()):
            s.close()

    results = []
    for name, v in lat.items():
        p50, p99 = _pct(v)
        system, _, backend = name.partition("/")
        results.append({"system": system, "backend": backend or ("inproc" if system.startswith("reference") else "pipe"),
                        "tokens_per_s": batch * len(v) / sum(v), "p50_ms": p50, "p99_ms": p99,
                        "stage_ms": stage_ms.get(name, {}),
                        # which processes served it: a twin's are its whole-part system's
                        "worker_pids": [p.pid for p in getattr(systems.get(name), "procs", [])]})
    by = {(r["system"], r["backend"]): r for r in results}
    ceiling = 2 * by[("reference-1t", "inproc")]["tokens_per_s"]
    mpr = by[("multiprocessing", "pipe")]["tokens_per_s"]
    ratios = {}
    print(f"\n{'system':<21} {'backend':<8} {'tokens/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for r in results:
        print(f"{r['system']:<21} {r['backend']:<8} {r['tokens_per_s']:9.0f} {r['p50_ms']:8.1f} {r['p99_ms']:8.1f}")
    print(f"\n2-core ceiling (2 x reference-1t): {ceiling:.0f} tokens/s")
    for b in backends:
        r = by[("moe-transport", b)]
        st = {k: v for k, v in r["stage_ms"].items()
              if k not in ("no_token", "messages", "forward", "gateway_cpu", "compute_total", "busiest")}
        # the transport's share: sending (dispatch without the MoE gather) and the wait
        # beyond the slowest worker's compute; the gather and combine are MoE's own copies
        share = ((st["dispatch"] - st["gather"]) + max(0.0, st["wait"] - st["compute"])) / st["total"] \
            if st.get("total") else None
        ratios[b] = {"vs_ceiling": r["tokens_per_s"] / ceiling, "vs_multiprocessing": r["tokens_per_s"] / mpr,
                     "transport_share_of_p50": share}
        zq = by.get(("pyzmq", "tcp"))
        if zq is not None:
            ratios[b]["vs_pyzmq"] = r["tokens_per_s"] / zq["tokens_per_s"]
        print(f"{b}: {ratios[b]['vs_ceiling']:.2f}x the ceiling, {ratios[b]['vs_multiprocessing']:.2f}x multiprocessing"
              + (f", {ratios[b]['vs_pyzmq']:.2f}x pyzmq" if zq is not None else "") + "; "
              f"transport share of the batch {100 * share:.1f}%  stages(ms) " +
              " ".join(f"{k}={v:.2f}" for k, v in st.items()))
        chunked = by.get(("moe-transport+chunks", b))
        if chunked is not None:
            ratios[b]["chunks"] = pipelining_gain(r, chunked)
            g = ratios[b]["chunks"]
            print(f"{b} chunked rounds ({g['messages']:.0f} messages a round): {g['gain']:.2f}x tokens/s, "
                  f"{g['p50_gain']:.2f}x by the median forwards, p99 {g['p99_ratio']:.2f}x; bound {g['bound']:.2f}x (forward {g['round_ms']:.1f} ms, the busiest "
                  f"worker {g['no_token_ms']:.1f} ms of it with no token, routing aside; chunked "
                  f"{g['chunked_no_token_ms']:.1f} ms); {100 * g['of_bound']:.0f}% of the "
                  f"possible gain (target >= 80%); the processors allow {g['cpu_bound']:.2f}x (the "
                  f"gateway's own work {g['gateway_cpu_ms']:.1f} ms on its thread, all work over {g['cores']} "
                  f"cores), {100 * g['of_cpu_bound']:.0f}% of that")
            if shortfall_line(g["shortfall"]):
                print(f"{b} chunked rounds: {shortfall_line(g['shortfall'])}")
        control = by.get(("moe-transport+control", b))
        if control is not None:
            c = pipelining_gain(r, control)
            ratios[b]["control"] = {k: c[k] for k in ("of_bound", "p50_gain", "gain", "bound")}
            print(f"{b} control (whole parts against themselves, in turn): {c['p50_gain']:.3f}x by the median "
                  f"forwards, {100 * c['of_bound']:+.0f}% of the bound: the chunked share's noise")
    return {"meta": {"config": dims | {"n_experts": args.n_experts, "top_k": args.top_k,
                                       "local_workers": args.local_workers, "rounds": args.rounds}},
            "results": results, "ceiling_tokens_per_s": ceiling, "ratios": ratios}
