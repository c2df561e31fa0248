"""ServeLoop: one thread, one poller, everything a service serves.

It owns the listeners, the handshakes in progress (``handshake.Pending``, each with its own
deadline, so a client that never finishes one costs nothing but a file descriptor), the
served connections, other pollables the service registers (the gateway's worker
connections), timers (``tick`` callbacks that return their next deadline) and a wake pipe
(signal handlers and threads hand work to the loop with :meth:`call_soon_threadsafe`).

What no peer may do to a service, and how the loop prevents it:

- hold its loop: handshakes never block it; one connection is served at most ``batch``
  messages per wake-up; a reply to a connection that cannot take it now (the peer does not
  read, or holds every slot) goes into that connection's outbox instead of waiting, within
  ``max_outbox`` messages and ``outbox_timeout`` seconds, past which the connection is
  dropped and counted;
- exhaust it: a per-listener connection cap (handshakes in progress count), an idle
  timeout, and when the process is out of file descriptors the listener is set aside for a
  growing back-off (logged once per interval) instead of being polled in a tight loop.

Taking connections (sites, handshakes, refusals) is in accepting.py, a mixin of the loop.
Messages are handed to the listener's ``on_message(conn, msg)``; the handler owns the
message (releases it). ``on_close(conn, why)`` follows every served connection's end.
"""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional, Sequence

from .. import handshake as hs
from ..errors import ConnectionClosed, ProtocolError, Timeout, TransportError
from ..poller import Poller
from ..timing import SPIN_SLEEP_MIN
from .accepting import Accepting, Served, Site
from .wake import WakePipe

log = logging.getLogger("moe.serve")

POLL_TICK = 0.5  # the longest the loop sleeps with nothing due (bounds how late a tick runs)
BATCH = 64  # messages served from one connection per wake-up: nobody starves the others
MAX_CONNECTIONS = 1024  # per listener, handshakes in progress included
IDLE_TIMEOUT = 300.0  # a served connection with no message for this long is closed
MAX_OUTBOX = 64  # replies held for one connection that cannot take them now
OUTBOX_TIMEOUT = 10.0  # the oldest held reply's age at which its connection is dropped
OUTBOX_RETRY = 0.005  # how often held replies are retried (shm returns credits without a wake-up)


@dataclass
class ServeStats:
    """What the loop refused or dropped, and why, and the time it busy-polled (exported as
    metrics by the services)."""

    accepted: int = 0  # handshakes completed
    open: int = 0  # served connections now
    pending: int = 0  # handshakes in progress now
    refused_cap: int = 0  # turned away at the connection cap
    refused_auth: int = 0  # failed authentication (either way)
    refused_other: int = 0  # refused in the handshake: limits, version, credentials
    bad_handshakes: int = 0  # garbage or a broken peer during the handshake
    handshake_timeouts: int = 0  # did not finish the handshake in time
    idle_closed: int = 0  # closed by the idle timeout
    slow_dropped: int = 0  # dropped because they did not take their replies
    protocol_errors: int = 0  # served connections closed after a protocol error
    accept_backoffs: int = 0  # times a listener was set aside (out of file descriptors)
    held_replies: int = 0  # replies that had to wait in an outbox
    spin_s: float = 0.0  # seconds busy-polled inside spin windows (add_spin) instead of sleeping

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class ServeLoop(Accepting):
    def __init__(self, *, batch: int = BATCH, poll_tick: float = POLL_TICK, max_outbox: int = MAX_OUTBOX,
                 outbox_timeout: float = OUTBOX_TIMEOUT) -> None:
        self.batch = batch
        self.poll_tick = poll_tick
        self.max_outbox = max_outbox
        self.outbox_timeout = outbox_timeout
        self.stats = ServeStats()
        self._poller = Poller()
        self._wake = WakePipe()
        self._poller.register(self._wake, ("wake", None))
        self._sites: list[Site] = []
        self._served: dict[Any, Served] = {}  # connection -> book-keeping
        self._ticks: list[Callable[[float], Optional[float]]] = []
        self._spins: list[Callable[[float], Optional[tuple[float, float]]]] = []
        self._soon: collections.deque = collections.deque()
        self._held: set = set()  # served connections with a non-empty outbox
        self._writing: set = set()  # served connections and watched objects also woken for room to write
        self._stop = False
        self._closed = False
        self._next_sweep = 0.0

    # -- what the service registers ------------------------------------------------------
    def add_listener(self, listener, on_message: Callable[[Any, Any], None], *,
                     on_open: Optional[Callable[[Any], None]] = None,
                     on_close: Optional[Callable[[Any, Optional[str]], None]] = None,
                     max_connections: int = MAX_CONNECTIONS, idle_timeout: Optional[float] = IDLE_TIMEOUT,
                     name: str = "clients", handshake_timeout: float = hs.HELLO_TIMEOUT) -> None:
        site = Site(listener, on_message, on_open, on_close, max(1, max_connections), idle_timeout, name,
                     handshake_timeout)
        self._sites.append(site)
        self._poller.register(listener, ("listener", site))

    def watch(self, obj, on_ready: Callable[[], None]) -> None:
        """Call ``on_ready()`` when ``obj`` (anything with fileno(), and pending() if it
        buffers) is readable. The service reads it itself (e.g. its own client connections)."""
        self._poller.register(obj, ("watch", on_ready))

    def unwatch(self, obj) -> None:
        self._writing.discard(obj)
        self._poller.unregister(obj)

    def watch_write(self, obj, on: bool) -> None:
        """While ``on``, a watched ``obj`` (or a served connection) is also reported when
        its kernel buffer has room: a large frame is written as the peer reads it, not at
        a timer's pace (see docs/design.md#tcp-the-serve-loop-finishes-frames-as-the-kernel-takes-them).
        A watched object's ``on_ready`` tells the two apart itself (flush while it has
        bytes left, read always: a read of nothing returns at once)."""
        if on == (obj in self._writing):
            return
        try:
            self._poller.modify(obj, write=on, read=True)
        except (KeyError, ValueError, OSError):
            return  # not registered (being closed): nothing to wake for
        if on:
            self._writing.add(obj)
        else:
            self._writing.discard(obj)

    def watching_write(self, obj) -> bool:
        return obj in self._writing

    def add_tick(self, fn: Callable[[float], Optional[float]]) -> None:
        """``fn(now)`` runs every iteration and returns when it next wants to run
        (time.monotonic), or None; the loop sleeps no longer than that."""
        self._ticks.append(fn)

    def add_spin(self, fn: Callable[[float], Optional[tuple[float, float]]]) -> None:
        """``fn(now)`` returns a window (opens, closes), time.monotonic, in which the service
        expects a message, or None. Inside it the loop busy-polls instead of sleeping: a
        wake-up from a sleep is dear in a VM (see docs/performance.md#reply-spin). The service decides when a core
        may be spent on it."""
        self._spins.append(fn)

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop's thread at its next iteration (from any thread)."""
        self._soon.append(fn)
        self._wake.wake()

    def wake(self) -> None:
        self._wake.wake()

    # -- served connections --------------------------------------------------------------
    def connections(self, name: Optional[str] = None) -> list:
        return [c for c, s in self._served.items() if name is None or s.site.name == name]

    def close_connection(self, conn, why: Optional[str] = None, *, abort: bool = True) -> None:
        """Stop serving ``conn`` and close it (its outbox is discarded). ``abort`` (the
        default: the loop drops a peer for a reason) closes without waiting for the peer to
        take what was sent; only a graceful shutdown waits (bounded)."""
        served = self._served.pop(conn, None)
        if served is None:
            return
        if why:
            log.info("%s %s: %s", served.site.name, conn.url, why)
        self._held.discard(conn)
        self._writing.discard(conn)
        for _, bufs, _ in served.outbox:
            _release(bufs)
        served.outbox.clear()
        served.site.served.discard(conn)
        self._poller.unregister(conn)  # before close: its fd number may be reused at once
        try:
            conn.abort() if abort else conn.close()
        except TransportError:
            pass
        self.stats.open = len(self._served)
        if served.site.on_close is not None:
            served.site.on_close(conn, why)

    def send(self, conn, header: Any, buffers: Sequence = ()) -> bool:
        """Send now if ``conn`` can take it without waiting, else hold it in the connection's
        outbox (bounded: past the bound the connection is dropped). The buffers belong to
        the loop from here on. Returns False if the connection is gone."""
        served = self._served.get(conn)
        if served is None:
            _release(buffers)
            return False
        self._poller.mark(conn)  # sending may read ahead a message the fd will not announce
        if not served.outbox and conn.send_ready():
            try:
                # timeout 0: what the kernel does not take at once stays with the connection
                # (wants_write), finished by flush() below, never waited for here
                conn.send(header, buffers, timeout=0)
                if conn.wants_write():
                    self._held.add(conn)
                    self.watch_write(conn, True)  # a large reply: written as the peer reads it
                return True
            except (ConnectionClosed, ProtocolError) as e:
                self.close_connection(conn, f"send failed: {e}")
                return False
            except Timeout:  # it said ready, then waited: a peer not taking what it asked for
                self.stats.slow_dropped += 1
                self.close_connection(conn, "send timed out although the connection was ready")
                return False
        self._hold(served, header, list(buffers))
        return conn in self._served

    def reply(self, conn, nbytes: int, fill: Callable[[memoryview], Any]) -> bool:
        """Send a ``nbytes`` payload that ``header = fill(view)`` writes: into a send slot of
        ``conn`` (zero copy) when one is free, else into a private buffer (the slow path of
        a peer that holds every slot: one copy, bounded by the outbox). If ``fill`` raises,
        nothing is sent and the exception propagates."""
        buf = self.reply_buffer(conn, nbytes)
        if buf is None:
            return False
        try:
            header = fill(buffer_view(buf))
        except BaseException:
            _release([buf])
            raise
        return self.send(conn, header, [buf])

    def reply_buffer(self, conn, nbytes: int) -> Any:
        """Where a ``nbytes`` reply to ``conn`` is written (``buffer_view`` of it), to be
        given to :meth:`send` or :meth:`discard`: a send slot of ``conn`` when one is free,
        else a private buffer (see :meth:`reply`). None if the connection is gone."""
        served = self._served.get(conn)
        if served is None:
            return None
        self._poller.mark(conn)
        if not served.outbox:
            try:
                slot = conn.alloc(nbytes, timeout=0)
            except Timeout:
                slot = None
            except ConnectionClosed as e:
                self.close_connection(conn, f"alloc failed: {e}")
                return None
            if slot is not None:
                return slot
        return bytearray(nbytes)

    @staticmethod
    def discard(buffers: Sequence) -> None:
        """Give back buffers from :meth:`reply_buffer` that will not be sent."""
        _release(buffers)

    def _hold(self, served: Served, header: Any, buffers: list) -> None:
        served.outbox.append((header, buffers, time.monotonic()))
        self.stats.held_replies += 1
        self._held.add(served.conn)
        if len(served.outbox) > self.max_outbox:
            self.stats.slow_dropped += 1
            self.close_connection(served.conn, f"does not take its replies ({len(served.outbox)} held)")

    def _flush(self, now: float) -> None:
        for conn in list(self._held):
            served = self._served.get(conn)
            if served is None:
                self._held.discard(conn)
                continue
            box = served.outbox
            self._poller.mark(conn)
            try:
                if conn.wants_write():
                    conn.flush()
            except (ConnectionClosed, ProtocolError) as e:
                self.close_connection(conn, f"send failed: {e}")
                continue
            while box and conn.send_ready():
                header, bufs, _ = box.popleft()
                try:
                    conn.send(header, bufs, timeout=0)
                except Timeout:
                    self.stats.slow_dropped += 1
                    self.close_connection(conn, "send timed out although the connection was ready")
                    break
                except (ConnectionClosed, ProtocolError) as e:
                    self.close_connection(conn, f"send failed: {e}")
                    break
            if conn not in self._served:
                continue
            self.watch_write(conn, conn.wants_write())
            if not box and not conn.wants_write():
                self._held.discard(conn)
            elif box and now - box[0][2] > self.outbox_timeout:
                self.stats.slow_dropped += 1
                self.close_connection(conn, f"held replies for {now - box[0][2]:.1f} s: it does not read")

    # -- the loop --------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Make :meth:`run` return at its next iteration (signal-handler safe)."""
        self._stop = True
        self._wake.wake()

    def stop_accepting(self) -> None:
        """Close every listener and abandon the handshakes in progress (graceful drain)."""
        for site in self._sites:
            for p in list(site.pending):
                self._drop_pending(site, p)
            if site.watching:
                self._poller.unregister(site.listener)
                site.watching = False
            site.listener.close()
        self._sites = []

    def run(self, until: Optional[Callable[[], bool]] = None) -> None:
        """Serve until :meth:`request_stop` or ``until()`` is true (checked every iteration)."""
        self._stop = False
        while not self._stop and not (until is not None and until()):
            self.run_once()

    def run_once(self, timeout: Optional[float] = None) -> None:
        now = time.monotonic()
        due = now + (self.poll_tick if timeout is None else timeout)
        for fn in self._ticks:
            try:
                t = fn(now)
            except Exception:  # a bug in one timer must not take the service down
                log.exception("tick %r failed", fn)
                t = None
            if t is not None and t < due:
                due = t
        if self._held:
            due = min(due, now + OUTBOX_RETRY)
        for site in self._sites:
            if site.pending:
                due = min(due, min(p.deadline for p in site.pending))
            if not site.watching:
                due = min(due, site.paused_until)
        if self._soon:
            due = now
        for obj, (role, data) in self._wait(due):
            if role == "served":
                self._serve(obj, data)
            elif role == "watch":
                try:
                    data()
                except Exception:
                    log.exception("a watched object's handler failed")
            elif role == "pending":
                self._step(data, obj)
            elif role == "listener":
                self._accept(data)
            else:
                self._wake.drain()
        while self._soon:
            self._soon.popleft()()
        now = time.monotonic()
        if self._held:
            self._flush(now)
        self._sweep(now)

    def _wait(self, due: float) -> list:
        """What is ready by ``due``: a sleep in the poller, but a busy-poll inside the
        earliest spin window that opens before ``due``."""
        poll = self._poller.poll
        now = time.monotonic()
        window = self._spin_window(now, due)
        if window is None:
            return poll(max(0.0, due - now))
        opens, closes = window
        if opens - now > SPIN_SLEEP_MIN:
            ready = poll(opens - now)
            if ready:
                return ready
        end = min(closes, due)
        start = now = time.monotonic()
        try:
            while now < end:
                ready = poll(0)
                if ready:
                    return ready
                now = time.monotonic()
        finally:
            self.stats.spin_s += time.monotonic() - start
        return poll(max(0.0, due - now))

    def _spin_window(self, now: float, due: float) -> Optional[tuple[float, float]]:
        best = None
        for fn in self._spins:
            try:
                w = fn(now)
            except Exception:  # a bug in a spin hint costs a wake-up, not the service
                log.exception("spin window %r failed", fn)
                continue
            if w is not None and w[1] > now and w[0] < due and (best is None or w[0] < best[0]):
                best = w
        return best

    def _serve(self, conn, served: Served) -> None:
        handle = served.site.on_message
        for _ in range(self.batch):
            msg = self.take_waiting(conn)
            if msg is None:
                return
            try:
                handle(conn, msg)
            except Exception as e:  # a bug handling one peer's message costs that peer only
                log.exception("handling a message from %s failed", conn.url)
                msg.release()
                self.close_connection(conn, f"internal error: {type(e).__name__}: {e}")
                return

    def take_waiting(self, conn) -> Optional[Any]:
        """The next message ``conn`` holds, taken without waiting, or None: nothing is there,
        or the connection failed (then closed here, and counted as :meth:`run_once` would).
        A handler may take what waits behind the message it handles (a worker parses the
        forwards queued behind one before it computes)."""
        served = self._served.get(conn)
        if served is None:
            return None
        try:
            msg = conn.recv(timeout=0)
        except Timeout:
            return None
        except ProtocolError as e:
            self.stats.protocol_errors += 1
            self.close_connection(conn, f"protocol error: {e}")
            return None
        except ConnectionClosed as e:
            self.close_connection(conn, str(e))
            return None
        served.last = time.monotonic()
        return msg

    def _sweep(self, now: float) -> None:
        for site in self._sites:
            for p in [p for p in site.pending if p.expired(now)]:
                self.stats.handshake_timeouts += 1
                self._drop_pending(site, p)
            if not site.watching and now >= site.paused_until:
                self._poller.register(site.listener, ("listener", site))
                site.watching = True
        if now < self._next_sweep:
            return
        self._next_sweep = now + 1.0
        for conn, served in list(self._served.items()):
            idle = served.site.idle_timeout
            if idle is not None and now - served.last > idle and not served.outbox:
                self.stats.idle_closed += 1
                self.close_connection(conn, f"idle for {now - served.last:.0f} s")

    def close(self) -> None:
        """Close everything the loop owns (listeners, handshakes, served connections)."""
        if self._closed:
            return
        self._closed = True
        self.stop_accepting()
        for conn in list(self._served):
            self.close_connection(conn, None, abort=False)
        self._poller.close()
        self._wake.close()

    def __enter__(self) -> "ServeLoop":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def buffer_view(buf) -> memoryview:
    """The writable bytes of a buffer from :meth:`ServeLoop.reply_buffer`."""
    return buf.buf if hasattr(buf, "pool") else memoryview(buf)


def _release(buffers) -> None:
    for b in buffers:
        release = getattr(b, "release", None)
        if release is not None and hasattr(b, "pool"):
            try:
                release()
            except ValueError:
                pass
