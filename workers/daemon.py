"""The expert worker: a serve loop (transport/service) answering forward batches in place.

A forward batch is read where it landed (``msg.array``: the receive slot on tcp, the
sender's slot on shm); each expert group runs straight into a send slot of that connection,
and the slot is the reply. Expert scratch is sized at start for ``max_tokens`` rows, so the
steady state allocates nothing big. A gateway that does not take its replies gets them
held (bounded) by the serve loop, never blocks it.

SIGTERM (or :meth:`WorkerDaemon.request_stop`) drains: the listener closes, every peer is
told ``draining``, batches already sent to us are still answered, and the loop ends once
the connections have been quiet for ``drain_idle`` seconds (at most ``drain_timeout``).

Control operations (load, retire: workers/versions.py) are accepted only on a connection
that proved the shared secret (its gateway), and new weights only from ``update_dir``.

Where the transport moves bytes on the caller's thread (tcp: the socket copies), the
experts compute on a thread of their own (workers/compute.py), so the loop keeps reading the
next batch into its slots and writing replies while one computes; batches are still computed
one at a time, in the order they came. Elsewhere (shm, rdma: the bytes are already where
they land) the loop computes itself, without a hand-off per batch, and reads the forwards
already waiting behind the one it takes before computing it (a chunked round's next chunks):
the Python between two products runs cold, and less of it runs there.

Experts are keyed by (layer, id) (workers/loading.py builds them from a checkpoint or demo
weights); a forward names its layer (absent: layer 0). ``info`` tells the gateway what this
worker serves: the layers with their ids and fingerprints, the wire dtype, the kernel.
"""
from __future__ import annotations

import bisect
from collections import deque
import logging
import os
import resource
import time
from dataclasses import dataclass, field, fields
from typing import Mapping, Optional

import numpy as np

import transport
from transport.service.connbook import ConnectionBook
from transport.service.loop import ServeLoop, buffer_view
from workers.compute import ComputeThread
from workers import protocol as P
from workers.loading import describe_expert, layer_table
from workers.versions import MAX_VERSIONS, Versions

log = logging.getLogger("moe.worker")

MIN_SLOT_SIZE = 64 << 10
PEER_NSLOTS = 64  # the most slots (credits) a gateway may make us keep for it
PREPARED = 2  # forwards at the compute thread at once: one computing, the next one ready
PREPARE_AHEAD = 8  # messages already waiting that are taken with a forward (no compute thread)
__all__ = ["WorkerDaemon", "WorkerStats", "ExpertCounters", "slot_size_for", "MAX_VERSIONS"]


# upper bounds (seconds) of the per-expert compute histogram's buckets (the last is +Inf)
COMPUTE_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                   0.5, 1.0, 2.5)


@dataclass
class ExpertCounters:
    """Per-expert counters; plain numbers so an exporter can read them as they are.
    ``compute_buckets[i]`` counts expert groups whose compute took <= COMPUTE_BUCKETS[i]
    and more than the bound before (the last: more than every bound), so the exporter can
    publish a histogram that aggregates across workers (a summary cannot)."""

    tokens: int = 0
    batches: int = 0
    compute_seconds: float = 0.0
    errors: int = 0
    compute_buckets: list = field(default_factory=lambda: [0] * (len(COMPUTE_BUCKETS) + 1))

    def observe(self, seconds: float) -> None:
        """One expert group's compute time (one bisect on 17 floats: cheap per group)."""
        self.compute_seconds += seconds
        self.compute_buckets[bisect.bisect_left(COMPUTE_BUCKETS, seconds)] += 1

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "compute_buckets"}


@dataclass
class WorkerStats:
    experts: dict = field(default_factory=dict)  # (layer, expert_id) -> ExpertCounters
    requests: int = 0
    batches: int = 0
    serve_seconds: float = 0.0  # forward batches, from the message handed to us to its reply sent
    errors: dict = field(default_factory=dict)  # error code -> count
    connections_accepted: int = 0
    connections_open: int = 0

    def error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1

    def as_dict(self) -> dict:
        return {"requests": self.requests, "batches": self.batches, "serve_seconds": self.serve_seconds,
                "errors": dict(self.errors),
                "connections_accepted": self.connections_accepted,
                "connections_open": self.connections_open,
                "experts": [P.with_layer([e, c.as_dict()], L) for (L, e), c in sorted(self.experts.items())]}


def slot_size_for(max_tokens: int, d_model: int, dtype) -> int:
    """A slot that holds the largest batch (at least 64 KiB, so small configs still get
    room to reject an oversized batch with an error instead of a transport failure)."""
    return max(MIN_SLOT_SIZE, max_tokens * d_model * np.dtype(dtype).itemsize)


def _key(k) -> tuple:
    """An experts key: (layer, id), or a plain id (layer 0)."""
    return (P.DEFAULT_LAYER, int(k)) if isinstance(k, (int, np.integer)) else (int(k[0]), int(k[1]))


class WorkerDaemon:
    """Serves ``experts`` ((layer, id) or a plain id of layer 0 -> an expert: a demo
    SwiGLUExpert or a workers.loading.KernelExpert; all with one d_model and wire dtype).

    ``fingerprints``: {layer: the layer's fingerprint} for checkpoint layers (reported in
    info, checked by the gateway); ``checkpoint``: the checkpoint's own fingerprint."""

    def __init__(self, experts: Mapping, listen_url: str, *, max_tokens: int = 1024,
                 slot_size: Optional[int] = None, nslots: int = 8, io_timeout: float = 10.0,
                 drain_timeout: float = 10.0, drain_idle: float = 0.2,
                 watch_parent: Optional[int] = None, secret: Optional[bytes] = None,
                 update_dir: Optional[str] = None, max_connections: int = 64,
                 idle_timeout: Optional[float] = None, fingerprints: Optional[Mapping[int, Optional[str]]] = None,
                 checkpoint: Optional[str] = None, compute_thread: Optional[bool] = None,
                 max_experts: Optional[int] = None) -> None:
        if not experts:
            raise ValueError("a worker needs at least one expert")
        experts = {_key(k): ex for k, ex in experts.items()}
        first = next(iter(experts.values()))
        for e, ex in experts.items():
            # d_ff may differ (a shared expert cut in one piece wider than the routed ones)
            if (ex.d_model, ex.dtype) != (first.d_model, first.dtype):
                raise ValueError(f"expert {e} has (d_model, dtype) {(ex.d_model, ex.dtype)}, "
                                 f"expert {first.expert_id} {(first.d_model, first.dtype)}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.d_model, self.d_ff, self.dtype = first.d_model, first.d_ff, first.dtype
        self.layers = layer_table(experts)  # layer -> hosted ids
        self.fingerprints = {L: (fingerprints or {}).get(L) for L in self.layers}
        self.checkpoint = checkpoint
        self.kernel = describe_expert(first)
        self.max_tokens = int(max_tokens)
        self.io_timeout = io_timeout
        self.drain_timeout, self.drain_idle = drain_timeout, drain_idle
        self.watch_parent = watch_parent
        self.stats = WorkerStats(experts={e: ExpertCounters() for e in experts})
        self.loop = ServeLoop()
        self.versions = Versions(experts, max_tokens=self.max_tokens, dtype=self.dtype, update_dir=update_dir,
                                 post=self.loop.call_soon_threadsafe, reply=self._control_reply,
                                 max_experts=max_experts, on_hosting=self._hosting_changed)
        size = slot_size or slot_size_for(self.max_tokens, self.d_model, self.dtype)
        self.listener = transport.listen(listen_url, slot_size=size, nslots=nslots, timeout=io_timeout,
                                         secret=secret, max_peer_nslots=PEER_NSLOTS)
        self.url = self.listener.url
        self.loop.add_listener(self.listener, self._handle, on_open=self._opened, on_close=self._closed,
                               max_connections=max_connections, idle_timeout=idle_timeout, name="gateway")
        self._stop = False
        self._draining = False
        self.in_flight = 0  # batches received and not yet answered
        self.conn_book = ConnectionBook("gateway")  # stable connection names for the metrics
        if compute_thread is None:  # see workers/compute.py: it pays where the transport copies
            compute_thread = transport.caller_moves_bytes(self.url)
        self._compute = ComputeThread(self.loop.call_soon_threadsafe) if compute_thread else None
        self._queued: deque = deque()  # forwards taken, not yet handed to the compute thread
        self._ahead: Optional[list] = None  # forwards parsed ahead, while one is being taken (_take_waiting)

    # -- what others read ------------------------------------------------------
    @property
    def experts(self) -> dict:
        """(layer, expert id) -> the active version's expert"""
        return self.versions.active

    @property
    def held(self) -> dict:
        """(layer, expert id) -> {version: expert}"""
        return self.versions.held

    def expert_ids(self) -> list:
        """Every hosted id, over all layers."""
        return sorted({e for ids in self.layers.values() for e in ids})

    @property
    def queue_depth(self) -> int:
        """Batches received whose compute has not started (with the compute thread: those
        queued behind the one it computes)."""
        return max(0, self.in_flight - 1)

    @property
    def draining(self) -> bool:
        return self._draining

    def connections(self) -> list:
        return self.loop.connections()

    # -- lifecycle -------------------------------------------------------------
    def request_stop(self) -> None:
        """Begin the graceful drain (safe to call from a signal handler or a thread)."""
        self._stop = True
        self.loop.wake()

    def serve(self) -> int:
        """Run until drained; returns the process exit code (0 after a clean drain)."""
        self.loop.add_tick(self._tick)
        try:
            self.loop.run(until=self._drained)
        finally:
            if self._compute is not None:
                self._compute.stop(self.io_timeout)
            self.loop.close()
        return 0

    def _tick(self, now: float) -> Optional[float]:
        if self.watch_parent is not None and os.getppid() != self.watch_parent and not self._stop:
            log.warning("parent %d is gone: stopping", self.watch_parent)
            self._stop = True
        if self._stop and not self._draining:
            self._begin_drain(now)
        return None

    def _begin_drain(self, now: float) -> None:
        self._draining = True
        self._drain_deadline = now + self.drain_timeout
        self._last_activity = now
        conns = self.loop.connections()
        log.info("draining: %d connection(s) open", len(conns))
        self.loop.stop_accepting()
        for conn in conns:  # route elsewhere; what the gateway already sent is answered
            self.loop.send(conn, {"op": P.DRAINING})

    def _drained(self) -> bool:
        if not self._draining:
            return False
        now = time.monotonic()
        if now >= self._drain_deadline:
            return True
        if self.in_flight:
            return False  # batches already taken are answered
        return not self.loop.connections() or now - self._last_activity >= self.drain_idle

    def _opened(self, conn) -> None:
        self.stats.connections_accepted += 1
        self.stats.connections_open = len(self.loop.connections())
        self.conn_book.opened(conn)

    def _closed(self, conn, why: Optional[str]) -> None:
        self.stats.connections_open = len(self.loop.connections())
        self.conn_book.closed(conn)
        self.versions.forget(conn)

    # -- requests --------------------------------------------------------------
    def _handle(self, conn, msg) -> None:
        if self._draining:
            self._last_activity = time.monotonic()
        header = msg.header
        rid = P.request_id_of(header)
        self.stats.requests += 1
        try:
            op = P.parse_op(header)
            if op == P.FORWARD:
                self._forward(conn, msg)  # releases msg itself, as early as it can
                return
            msg.release()
            if op == P.PING:
                self.loop.send(conn, self.pong(rid))
            elif op == P.WEIGHTS:
                start = header.get("start", 0)
                if not isinstance(start, int) or isinstance(start, bool) or start < 0:
                    raise P.RequestError(P.BAD_REQUEST, f"weights needs an integer start >= 0, got {start!r}")
                self.loop.send(conn, P.weights_page(self.versions.weights(), start, rid))
            elif op in (P.LOAD, P.RETIRE, P.UNHOST):
                if not conn.authenticated:
                    raise P.RequestError(P.UNAUTHORIZED, f"{op} is a control operation: it needs a connection "
                                                         "that proved the shared secret (--secret-file)")
                if op == P.LOAD:
                    done = self.versions.start_load(conn, P.parse_load(header, self.layers))
                    if done is not None:
                        self._control_reply(conn, done)
                elif op == P.RETIRE:
                    self.loop.send(conn, self.versions.retire(rid, *P.parse_retire(header, self.layers)))
                else:
                    self.loop.send(conn, self.versions.unhost(rid, *P.parse_unhost(header, self.layers)))
            else:
                self.loop.send(conn, self.info(rid))
        except P.RequestError as e:
            self._reply_error(conn, msg, rid, e.code, e.message)
        except Exception as e:  # a bug must cost one request, never the worker
            log.exception("request %r failed", rid)
            self._reply_error(conn, msg, rid, P.INTERNAL, f"{type(e).__name__}: {e}")

    def _hosting_changed(self) -> None:
        """A physical copy was added or dropped: what forwards may name, and its counters."""
        self.layers = layer_table(self.versions.active)
        for key in self.versions.active:
            self.stats.experts.setdefault(key, ExpertCounters())

    def _control_reply(self, conn, reply: dict) -> None:
        if reply.get("op") == P.ERROR:
            self.stats.error(reply["code"])
        self.loop.send(conn, reply)

    def _reply_error(self, conn, msg, rid: Optional[int], code: str, message: str) -> None:
        msg.release()
        self.stats.error(code)
        self.loop.send(conn, P.error_reply(rid, code, message))

    def _forward(self, conn, msg) -> None:
        job = self._prepare(conn, msg)  # a RequestError is the caller's to answer (_handle)
        if self._compute is not None:
            self._queued.append((conn, job))
            self._start_queued()
            return
        if self._ahead is not None:  # taken by _take_waiting, behind another forward
            self._ahead.append(job)
            return
        self._ahead = [job]
        try:
            self._take_waiting(conn)
        finally:
            jobs, self._ahead = self._ahead, None
            for i, j in enumerate(jobs):
                self._answer(conn, j, first=i == 0)

    def _take_waiting(self, conn) -> None:
        """Parse the forwards already waiting behind the one taken, before it computes.

        Between two computes the worker runs cold: a matrix product evicts the interpreter's
        code and data, and the first Python after one runs many times slower than warm (see
        docs/design.md#read-ahead-before-computing). Each message read and checked
        in that gap is dear: a chunked round's next chunks are in by then, so they are read
        now, warm, and the gap is the reply's send and the next product's start. Anything
        else that waits (a ping, a load) is answered now, ahead of those replies: replies
        carry their request's id, not their place. At most PREPARE_AHEAD messages of any
        kind: a peer whose pings return their credits at once must not keep the worker here."""
        for _ in range(PREPARE_AHEAD):
            msg = self.loop.take_waiting(conn)
            if msg is None:
                return
            self._handle(conn, msg)

    def _prepare(self, conn, msg) -> "_Forward":
        """Check one forward and bind its experts (a version it pins is looked up now: a
        retire that comes after it does not pull the weights from under it)."""
        t_in = time.perf_counter()
        batch = P.parse_forward(msg.header, [b.nbytes for b in msg.buffers], dtype=self.dtype,
                                d_model=self.d_model, max_rows=self.max_tokens,
                                layers=self.layers, need_groups=True)
        shape = (batch.rows, self.d_model)
        if batch.nbytes > conn.max_message:
            raise P.RequestError(P.OVERSIZED, f"the reply ({batch.nbytes} bytes) exceeds this "
                                              f"connection's slot size ({conn.max_message})")
        x = msg.array(0, self.dtype, shape) if batch.rows else np.empty(shape, self.dtype)
        kernels = self.versions.pick(batch.layer, batch.groups)  # RequestError for a version not held
        reply = P.result_reply(batch.request_id, shape, self.dtype)  # built warm; timings filled in after
        pinned = sorted({(e, v) for e, _, n, v in batch.groups if v is not None and n})
        if pinned:
            reply["versions"] = [[e, v] for e, v in pinned]
        counters = [self.stats.experts[(batch.layer, e)] for e, _, _, _ in batch.groups]
        self.in_flight += 1
        return _Forward(msg, batch, x, kernels, counters, reply, t_in)

    def _answer(self, conn, job: "_Forward", first: bool = True) -> None:
        """Compute one prepared forward into a send slot and send it (or its error)."""
        # t_in: when it was taken up; a forward parsed ahead is taken up only now
        took = job.t_in if first else time.perf_counter()

        def fill(view: memoryview) -> dict:
            reply = job.compute(view, took)
            job.msg.release()  # inputs consumed: give the sender its slot back before we reply
            return reply

        try:
            if self.loop.reply(conn, job.batch.nbytes, fill):
                self._served_batch(took)
        except P.RequestError as e:
            self._reply_error(conn, job.msg, job.batch.request_id, e.code, e.message)
        except Exception as e:  # a bug must cost one request, never the worker
            log.exception("request %r failed", job.batch.request_id)
            self._reply_error(conn, job.msg, job.batch.request_id, P.INTERNAL, f"{type(e).__name__}: {e}")
        finally:
            job.msg.release()
            self.in_flight -= 1

    def _served_batch(self, t_in: float) -> None:
        self.stats.batches += 1
        self.stats.serve_seconds += time.perf_counter() - t_in

    def _start_queued(self) -> None:
        """Hand queued forwards to the compute thread, keeping at most PREPARED there: each
        holds a send slot for its reply from the moment it is handed over, and a connection
        whose send slots are all held that way could not send the replies that free them.
        The rest wait here, in their receive slots (the peer's credits bound them)."""
        while self._queued and self._compute.queued < PREPARED:
            self._submit(*self._queued.popleft())

    def _submit(self, conn, job: "_Forward") -> None:
        """Hand one parsed forward to the compute thread, with its reply's buffer (taken
        here: the connection is the loop thread's)."""
        msg = job.msg
        buf = self.loop.reply_buffer(conn, job.batch.nbytes)
        if buf is None:  # the connection is gone: nobody to answer
            msg.release()
            self.in_flight -= 1
            return
        view = buffer_view(buf)

        def run() -> dict:
            # t_in is when the compute thread took it: the gateway reads t_out - t_in as the
            # worker's busy time, and time spent queued behind another batch is not that.
            # t_rx: when the loop's thread read it, as it arrived (the loop is not computing)
            reply = job.compute(view, time.perf_counter())
            reply["t_rx"] = job.t_in
            return reply

        def done(reply, err) -> None:
            msg.release()  # inputs consumed: give the sender its slot back before we reply
            self.in_flight -= 1
            if err is None:
                self.loop.send(conn, reply, [buf])
                self._served_batch(job.t_in)
            else:
                self.loop.discard([buf])
                rid = job.batch.request_id
                if isinstance(err, P.RequestError):
                    self._reply_error(conn, msg, rid, err.code, err.message)
                else:  # a bug must cost one request, never the worker
                    log.error("request %r failed", rid, exc_info=err)
                    self._reply_error(conn, msg, rid, P.INTERNAL, f"{type(err).__name__}: {err}")
            self._start_queued()

        self._compute.submit(run, done)

    def info(self, rid: Optional[int]) -> dict:
        h = {"op": P.INFO, "id": rid, "experts": self.expert_ids(), "versions": self.versions.table(),
             "layers": [[L, ids, self.fingerprints.get(L)] for L, ids in self.layers.items()],
             "d_model": self.d_model, "d_ff": self.d_ff, "dtype": P.dtype_name(self.dtype),
             "max_tokens": self.max_tokens, "pid": os.getpid(), "url": self.url, "kernel": self.kernel,
             "max_experts": self.versions.max_experts}
        if self.checkpoint is not None:
            h["checkpoint"] = self.checkpoint
        return h

    def pong(self, rid: Optional[int]) -> dict:
        return {"op": P.PONG, "id": rid, "experts": self.expert_ids(), "versions": self.versions.table(),
                "in_flight": self.in_flight, "draining": self._draining, "counters": self.stats.as_dict(),
                "cpu_s": time.process_time(), "pid": os.getpid()}


class _Forward:
    """One checked forward: its input where it landed, its experts, its reply's header."""

    __slots__ = ("msg", "batch", "x", "kernels", "counters", "reply", "t_in")

    def __init__(self, msg, batch: P.ForwardBatch, x: np.ndarray, kernels: list, counters: list,
                 reply: dict, t_in: float) -> None:
        self.msg, self.batch, self.x, self.kernels = msg, batch, x, kernels
        self.counters, self.reply, self.t_in = counters, reply, t_in

    def compute(self, view: memoryview, took: float) -> dict:
        """Run every expert group into ``view``; the reply header (``took``: when it was
        taken up, the worker's clock)."""
        batch, x = self.batch, self.x
        y = np.frombuffer(view, dtype=x.dtype, count=x.size).reshape(x.shape)
        t0 = time.perf_counter()
        per_expert = []
        for (e, start, count, _), ex, c in zip(batch.groups, self.kernels, self.counters):
            if count == 0:
                continue
            t = time.perf_counter()
            try:
                ex.forward(x[start:start + count], y[start:start + count])
            except Exception as err:  # a compute failure is this request's, not the worker's
                c.errors += 1
                raise P.RequestError(P.INTERNAL, f"expert {e} failed: {err}") from None
            dt = time.perf_counter() - t
            c.tokens += count
            c.batches += 1
            c.observe(dt)
            per_expert.append([e, count, dt])
        reply = self.reply
        reply["compute_s"] = time.perf_counter() - t0
        reply["experts"] = per_expert
        reply["cpu_s"] = time.process_time()
        reply["flt"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        reply["t_in"] = took
        reply["t_out"] = time.perf_counter()
        return reply
