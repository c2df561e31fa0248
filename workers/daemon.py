"""The expert worker's serve loop: one thread, one Poller over the listener and every
connection, compute in place.

A forward batch is read where it landed (``msg.array``: the receive slot on tcp, the
sender's slot on shm), each expert group runs straight into a slot of this connection's
send pool (``conn.alloc``), and that slot is the reply. Expert scratch is sized at start
for ``max_tokens`` rows, so the steady state allocates nothing big.

SIGTERM (or :meth:`WorkerDaemon.request_stop`) drains: the listener closes, every peer is
told ``draining``, batches already sent to us are still answered, and the loop ends once
the connections have been quiet for ``drain_idle`` seconds (at most ``drain_timeout``).

Hot update (the double buffer): ``load`` reads a new version of an expert in a background
thread while the loop keeps serving, then holds it beside the active one (at most
``MAX_VERSIONS`` per expert); a forward group may pin either version; ``retire`` drops one.
The loop never waits for a load: the loader wakes it through the wake pipe when done.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Mapping, Optional

import numpy as np

import transport
from transport import ConnectionClosed, ProtocolError, Timeout, TransportError
from transport.poller import Poller
from workers import protocol as P
from workers.expert import SwiGLUExpert

log = logging.getLogger("moe.worker")

MIN_SLOT_SIZE = 64 << 10
POLL_TICK = 0.5  # the longest the loop sleeps: bounds how late a parent's death is noticed
MAX_VERSIONS = 2  # versions held per expert: the active one and one being rolled out


@dataclass
class ExpertCounters:
    """Per-expert counters; plain numbers so an exporter can read them as they are."""

    tokens: int = 0
    batches: int = 0
    compute_seconds: float = 0.0
    errors: int = 0

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class WorkerStats:
    experts: dict = field(default_factory=dict)  # expert_id -> ExpertCounters
    requests: int = 0
    batches: int = 0
    errors: dict = field(default_factory=dict)  # error code -> count
    connections_accepted: int = 0
    connections_open: int = 0

    def error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1

    def as_dict(self) -> dict:
        return {"requests": self.requests, "batches": self.batches, "errors": dict(self.errors),
                "connections_accepted": self.connections_accepted,
                "connections_open": self.connections_open,
                "experts": [[e, c.as_dict()] for e, c in sorted(self.experts.items())]}


class WakePipe:
    """A pipe the Poller watches, so a signal handler can wake the loop at once."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        os.set_blocking(self.w, False)

    def fileno(self) -> int:
        return self.r

    def wake(self) -> None:
        try:
            os.write(self.w, b"x")
        except (BlockingIOError, OSError):
            pass  # already awake (pipe full) or closing

    def drain(self) -> None:
        try:
            while os.read(self.r, 512):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        for fd in (self.r, self.w):
            try:
                os.close(fd)
            except OSError:
                pass


def slot_size_for(max_tokens: int, d_model: int, dtype) -> int:
    """A slot that holds the largest batch (at least 64 KiB, so small configs still get
    room to reject an oversized batch with an error instead of a transport failure)."""
    return max(MIN_SLOT_SIZE, max_tokens * d_model * np.dtype(dtype).itemsize)


class WorkerDaemon:
    """Serves ``experts`` (expert_id -> SwiGLUExpert, all with one d_model and dtype)."""

    def __init__(self, experts: Mapping[int, SwiGLUExpert], listen_url: str, *, max_tokens: int = 1024,
                 slot_size: Optional[int] = None, nslots: int = 8, io_timeout: float = 10.0,
                 drain_timeout: float = 10.0, drain_idle: float = 0.2,
                 watch_parent: Optional[int] = None) -> None:
        if not experts:
            raise ValueError("a worker needs at least one expert")
        first = next(iter(experts.values()))
        for e, ex in experts.items():
            if (ex.d_model, ex.d_ff, ex.dtype) != (first.d_model, first.d_ff, first.dtype):
                raise ValueError(f"expert {e} has (d_model, d_ff, dtype) {(ex.d_model, ex.d_ff, ex.dtype)}, "
                                 f"expert {first.expert_id} {(first.d_model, first.d_ff, first.dtype)}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.experts = dict(experts)  # expert id -> the active version
        self.held = {e: {ex.version: ex} for e, ex in self.experts.items()}  # id -> version -> expert
        self._loads: queue.SimpleQueue = queue.SimpleQueue()  # finished loads, for the loop
        self._loading: set = set()  # (expert, version) being read by a loader thread
        self.d_model, self.d_ff, self.dtype = first.d_model, first.d_ff, first.dtype
        self.max_tokens = int(max_tokens)
        self.io_timeout = io_timeout
        self.drain_timeout, self.drain_idle = drain_timeout, drain_idle
        self.watch_parent = watch_parent
        self.stats = WorkerStats(experts={e: ExpertCounters() for e in self.experts})
        size = slot_size or slot_size_for(self.max_tokens, self.d_model, self.dtype)
        self.listener = transport.listen(listen_url, slot_size=size, nslots=nslots, timeout=io_timeout)
        self.url = self.listener.url
        self._conns: list = []
        self._wake = WakePipe()
        self._stop = False
        self._draining = False
        self.in_flight = 0  # batches received and not yet answered

    # -- lifecycle -------------------------------------------------------------
    def request_stop(self) -> None:
        """Begin the graceful drain (safe to call from a signal handler or a thread)."""
        self._stop = True
        self._wake.wake()

    def serve(self) -> int:
        """Run until drained; returns the process exit code (0 after a clean drain)."""
        poller = Poller()
        poller.register(self._wake, "wake")
        poller.register(self.listener, "listener")
        drain_deadline = last_activity = 0.0
        try:
            while True:
                if self._stop and not self._draining:
                    self._begin_drain(poller)
                    drain_deadline = time.monotonic() + self.drain_timeout
                    last_activity = time.monotonic()
                if self._draining:
                    now = time.monotonic()
                    quiet = now - last_activity >= self.drain_idle
                    if not self._conns or quiet or now >= drain_deadline:
                        return 0
                    tick = min(self.drain_idle, max(0.0, drain_deadline - now))
                else:
                    tick = POLL_TICK
                if self.watch_parent is not None and os.getppid() != self.watch_parent:
                    log.warning("parent %d is gone: stopping", self.watch_parent)
                    self.request_stop()
                for obj, role in poller.poll(tick):
                    if role == "wake":
                        self._wake.drain()
                        self._finish_loads(poller)
                    elif role == "listener":
                        self._accept(poller)
                    else:
                        if self._serve_conn(obj, poller):
                            last_activity = time.monotonic()
        finally:
            self._close_all(poller)

    def _begin_drain(self, poller: Poller) -> None:
        self._draining = True
        log.info("draining: %d connection(s) open", len(self._conns))
        poller.unregister(self.listener)
        self.listener.close()
        for conn in list(self._conns):
            try:  # tell the gateway to route elsewhere; what it already sent is answered
                conn.send({"op": P.DRAINING}, timeout=1.0)
            except TransportError:
                self._drop(conn, poller, "cannot send the draining notice")

    def _close_all(self, poller: Poller) -> None:
        for conn in list(self._conns):
            self._drop(conn, poller, None)
        if not self._draining:
            self.listener.close()
        poller.close()
        self._wake.close()

    # -- connections -----------------------------------------------------------
    def _accept(self, poller: Poller) -> None:
        try:
            conn = self.listener.accept(timeout=1.0)
        except Timeout:
            return  # readable but nobody finished the handshake: not our problem
        except TransportError as e:
            log.warning("rejected a connection: %s", e)
            return
        self._conns.append(conn)
        poller.register(conn, "conn")
        self.stats.connections_accepted += 1
        self.stats.connections_open = len(self._conns)

    def _drop(self, conn, poller: Poller, why: Optional[str]) -> None:
        if why:
            log.info("closing %s: %s", conn.url, why)
        poller.unregister(conn)
        conn.close()
        if conn in self._conns:
            self._conns.remove(conn)
        self.stats.connections_open = len(self._conns)

    def _serve_conn(self, conn, poller: Poller) -> bool:
        """Handle every message already there; True if there was at least one."""
        served = False
        for _ in range(64):  # bounded, so one busy peer cannot starve the others
            if self._stop and not self._draining:
                break  # back to the loop: the draining notice goes out before more work
            try:
                msg = conn.recv(timeout=0)
            except Timeout:
                break
            except (ConnectionClosed, ProtocolError) as e:
                self._drop(conn, poller, str(e))
                break
            served = True
            try:
                self._handle(conn, msg)
            except TransportError as e:  # the reply could not go out: the peer is stuck or gone
                self._drop(conn, poller, f"reply failed: {e}")
                break
        return served

    # -- requests --------------------------------------------------------------
    def _handle(self, conn, msg) -> None:
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
                conn.send(self.pong(rid), timeout=self.io_timeout)
            elif op == P.LOAD:
                self._start_load(conn, P.parse_load(header, list(self.experts)))
            elif op == P.RETIRE:
                conn.send(self._retire(rid, *P.parse_retire(header, list(self.experts))),
                          timeout=self.io_timeout)
            else:
                conn.send(self.info(rid), timeout=self.io_timeout)
        except P.RequestError as e:
            self._reply_error(conn, msg, rid, e.code, e.message)
        except TransportError:
            raise
        except Exception as e:  # a bug must cost one request, never the worker
            log.exception("request %r failed", rid)
            self._reply_error(conn, msg, rid, P.INTERNAL, f"{type(e).__name__}: {e}")

    def _reply_error(self, conn, msg, rid: Optional[int], code: str, message: str) -> None:
        msg.release()
        self.stats.error(code)
        conn.send(P.error_reply(rid, code, message), timeout=self.io_timeout)

    def _forward(self, conn, msg) -> None:
        self.in_flight += 1
        try:
            batch = P.parse_forward(msg.header, [b.nbytes for b in msg.buffers], dtype=self.dtype,
                                    d_model=self.d_model, max_rows=self.max_tokens,
                                    experts=list(self.experts), need_groups=True)
            shape = (batch.rows, self.d_model)
            if batch.nbytes > conn.max_message:
                raise P.RequestError(P.OVERSIZED, f"the reply ({batch.nbytes} bytes) exceeds this "
                                                  f"connection's slot size ({conn.max_message})")
            x = msg.array(0, self.dtype, shape) if batch.rows else np.empty(shape, self.dtype)
            slot = conn.alloc(batch.nbytes, timeout=self.io_timeout)
            y = slot.array(self.dtype, shape)
            held = self.held
            pinned = {}
            for e, _, count, v in batch.groups:
                if v is not None and count:
                    if v not in held[e]:
                        slot.release()
                        raise P.RequestError(P.UNKNOWN_VERSION, f"expert {e} has no version {v} here "
                                                                f"(held: {sorted(held[e])})")
                    pinned[e] = v
            t0 = time.perf_counter()
            per_expert = []
            for e, start, count, v in batch.groups:
                if count == 0:
                    continue
                c = self.stats.experts[e]
                t = time.perf_counter()
                ex = self.experts[e] if v is None else held[e][v]
                try:
                    ex.forward(x[start:start + count], y[start:start + count])
                except Exception as ex:  # a compute failure is this request's, not the worker's
                    c.errors += 1
                    slot.release()
                    raise P.RequestError(P.INTERNAL, f"expert {e} failed: {ex}") from None
                dt = time.perf_counter() - t
                c.tokens += count
                c.batches += 1
                c.compute_seconds += dt
                per_expert.append([e, count, dt])
            compute_s = time.perf_counter() - t0
            msg.release()  # inputs consumed: give the sender its slot back before we reply
            reply = P.result_reply(batch.request_id, shape, self.dtype, compute_s=compute_s,
                                   experts=per_expert, cpu_s=time.process_time())
            if pinned:
                reply["versions"] = [[e, v] for e, v in sorted(pinned.items())]
            self.stats.batches += 1
            conn.send(reply, [slot], timeout=self.io_timeout)
        finally:
            msg.release()
            self.in_flight -= 1

    def versions(self) -> list:
        """[[expert, active version, [held versions]], ...]"""
        return [[e, ex.version, sorted(self.held[e])] for e, ex in sorted(self.experts.items())]

    # -- hot update ------------------------------------------------------------
    def _start_load(self, conn, req: "P.LoadRequest") -> None:
        held = self.held[req.expert]
        if req.version in held:  # idempotent: a retried load finds it done
            conn.send({"op": P.LOADED, "id": req.request_id, "expert": req.expert, "version": req.version},
                      timeout=self.io_timeout)
            return
        if (req.expert, req.version) in self._loading:
            raise P.RequestError(P.BAD_REQUEST, f"expert {req.expert} version {req.version} is already loading")
        if len(held) + sum(1 for e, _ in self._loading if e == req.expert) >= MAX_VERSIONS:
            raise P.RequestError(P.BAD_REQUEST, f"expert {req.expert} already holds versions {sorted(held)} "
                                                f"(at most {MAX_VERSIONS}): retire one first")
        self._loading.add((req.expert, req.version))
        threading.Thread(target=self._load, args=(conn, req), daemon=True,
                         name=f"load-e{req.expert}-v{req.version}").start()

    def _load(self, conn, req: "P.LoadRequest") -> None:
        """Loader thread: build the new version off the serve loop, hand it over, wake it."""
        try:
            ref = self.experts[req.expert]
            if req.weights is not None:
                ex = SwiGLUExpert.from_npz(req.weights, req.expert, max_tokens=self.max_tokens, dtype=self.dtype)
            else:
                ex = SwiGLUExpert.from_seed(req.expert, ref.d_model, ref.d_ff, seed=req.seed, dtype=self.dtype,
                                            max_tokens=self.max_tokens)
            if (ex.d_model, ex.d_ff) != (ref.d_model, ref.d_ff):
                raise ValueError(f"weights are ({ex.d_model}, {ex.d_ff}), this worker serves "
                                 f"({ref.d_model}, {ref.d_ff})")
            ex.version = req.version
            result = ex
        except Exception as e:  # reported to the requester; the worker keeps serving
            result = e
        self._loads.put((conn, req, result))
        self._wake.wake()

    def _finish_loads(self, poller: Poller) -> None:
        while True:
            try:
                conn, req, result = self._loads.get_nowait()
            except queue.Empty:
                return
            self._loading.discard((req.expert, req.version))
            if isinstance(result, Exception):
                self.stats.error(P.LOAD_FAILED)
                reply = P.error_reply(req.request_id, P.LOAD_FAILED,
                                      f"expert {req.expert} version {req.version}: {type(result).__name__}: {result}")
            else:
                self.held[req.expert][req.version] = result
                log.info("expert %d: version %d loaded (held %s)", req.expert, req.version,
                         sorted(self.held[req.expert]))
                reply = {"op": P.LOADED, "id": req.request_id, "expert": req.expert, "version": req.version}
            if conn in self._conns:
                try:
                    conn.send(reply, timeout=self.io_timeout)
                except TransportError as e:
                    self._drop(conn, poller, f"reply failed: {e}")

    def _retire(self, rid, expert: int, version: int) -> dict:
        held = self.held[expert]
        if version not in held:
            raise P.RequestError(P.UNKNOWN_VERSION, f"expert {expert} has no version {version} "
                                                    f"(held: {sorted(held)})")
        if len(held) == 1:
            raise P.RequestError(P.BAD_REQUEST, f"version {version} is expert {expert}'s only one")
        del held[version]
        if self.experts[expert].version == version:  # the other one becomes the active one
            self.experts[expert] = next(iter(held.values()))
        log.info("expert %d: version %d retired; active %d", expert, version, self.experts[expert].version)
        return {"op": P.RETIRED, "id": rid, "expert": expert, "version": version,
                "active": self.experts[expert].version}

    def info(self, rid: Optional[int]) -> dict:
        return {"op": P.INFO, "id": rid, "experts": sorted(self.experts), "versions": self.versions(),
                "d_model": self.d_model, "d_ff": self.d_ff, "dtype": self.dtype.name,
                "max_tokens": self.max_tokens, "pid": os.getpid(), "url": self.url}

    def pong(self, rid: Optional[int]) -> dict:
        return {"op": P.PONG, "id": rid, "experts": sorted(self.experts), "versions": self.versions(),
                "in_flight": self.in_flight, "draining": self._draining, "counters": self.stats.as_dict(),
                "cpu_s": time.process_time(), "pid": os.getpid()}
