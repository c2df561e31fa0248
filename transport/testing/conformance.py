"""The conformance kit: one set of behavioural checks that every backend must pass.

In the style of trio's ``trio/testing/_check_streams.py``: the kit knows nothing about a
backend except how to make endpoints of it. A backend's test file hands it a URL factory
and some capability flags, and runs every check in :data:`CHECKS`::

    import pytest
    from transport.testing import conformance

    @pytest.fixture
    def env():
        with conformance.PairEnv(lambda: "tcp://127.0.0.1:0", name="tcp") as env:
            yield env

    @pytest.mark.parametrize("check", conformance.CHECKS, ids=conformance.check_ids())
    def test_conformance(env, check):
        check(env)

or, without pytest, ``conformance.run_check(check, url_factory, **conn_options)``.

The public API (stable; add to it, do not change it):

``CHECKS``
    list of check functions, each ``def check_xxx(env: PairEnv) -> None``; a check
    raises ``AssertionError`` (or the transport's own exception) when the backend fails.
``check_ids()``
    the checks' short names (``"order"`` for ``check_order``), for pytest ids.
``PairEnv(url_factory, *, name=..., options=..., shares_sender_memory=..., leak_dirs=...,
slack=..., peer_python=..., peer_env=...)``
    what a check may use; a context manager that cleans up everything it made.
``run_check(check, url_factory, *, <PairEnv keywords>, **conn_options)``
    run one check in a fresh ``PairEnv``.

What a backend must provide for the kit (the contract in transport/base.py, plus):

- ``listen(url, slot_size=, nslots=, timeout=)`` and ``connect(url, ...same...)``
  accept those three keywords; ``listener.url`` is a URL a client can connect to;
- a raw-frame sender in transport.testing.raw puts ``frame`` (a framing.py frame: prefix, header,
  payload back to back) on the wire/ring as if it were a frame, with no checks;
- ``conn.in_registered_memory(buf)``, ``conn.stats`` (ConnectionStats), ``conn.pending()``,
  ``conn.fileno()`` that polls readable when ``recv`` can make progress;
- a connection is used by one thread at a time (two connections, two threads is fine);
- ``send`` either delivers the message (it returned) or not at all (it raised Timeout or
  ValueError/TypeError, and the connection is still usable); if it raised ConnectionClosed
  the messages whose send returned before are still delivered, then ConnectionClosed.
  The slots passed to a ``send`` belong to the transport even when ``send`` raises.

Timing: every bound is ``expected + env.slack`` (0.5 s by default; raise it for a VM).
No check waits forever: every blocking call has a timeout and every helper thread is
joined with one.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

import transport
from transport import framing
from transport.errors import ConnectionClosed, ProtocolError, Timeout
from transport.framing import Kind
from transport.poller import Poller
from transport.testing import raw

__all__ = ["CHECKS", "PairEnv", "check_ids", "run_check", "pattern", "verify"]

#: connection options the kit uses unless the backend's wiring or a check overrides them:
#: slots big enough for the 1 MiB case, few enough to keep shared segments small.
DEFAULT_OPTIONS = {"slot_size": 2 << 20, "nslots": 8, "timeout": 10.0}


# ---------------------------------------------------------------------------------------
# the environment a check runs in
# ---------------------------------------------------------------------------------------
class PairEnv:
    """Everything a check may use: fresh URLs, endpoints, peer processes, cleanup.

    ``url_factory()``
        returns a fresh URL to listen on (``tcp://127.0.0.1:0``, ``shm://moe-test-<uuid>``,
        ``rdma://10.0.2.15:0``); called once per listener.
    ``options``
        connection options passed to every ``listen``/``connect`` (merged over
        :data:`DEFAULT_OPTIONS`); a check may override some per call.
    ``shares_sender_memory``
        True when a received buffer *is* the sender's slot (shm, in-process pairs too).
    ``leak_dirs``
        directories (``/dev/shm``) where an entry that appeared during the check and is
        still there after cleanup is a leak: the check fails.
    ``slack``
        seconds added to every time bound.
    ``peer_python``, ``peer_env``
        the interpreter and extra environment for :mod:`transport.testing.peer`.
    """

    def __init__(self, url_factory: Callable[[], str], *, name: Optional[str] = None,
                 options: Optional[dict] = None, shares_sender_memory: bool = False,
                 leak_dirs: tuple = (), slack: float = 0.5,
                 peer_python: Optional[str] = None, peer_env: Optional[dict] = None):
        self.url_factory = url_factory
        self.name = name or url_factory().split("://", 1)[0]
        self.options = {**DEFAULT_OPTIONS, **(options or {})}
        self.shares_sender_memory = shares_sender_memory
        self.leak_dirs = tuple(leak_dirs)
        self.slack = slack
        self.peer_python = peer_python or sys.executable
        self.peer_env = dict(peer_env or {})
        self._cleanups: list[Callable[[], None]] = []
        self._before = {d: _listdir(d) for d in self.leak_dirs}
        self._closed = False

    # -- endpoints ------------------------------------------------------------------
    def listen_url(self) -> str:
        """A fresh URL for this backend."""
        return self.url_factory()

    def conn_options(self, **overrides: Any) -> dict:
        return {**self.options, **overrides}

    def listen(self, url: Optional[str] = None, **options: Any):
        """A listener on a fresh URL (closed at cleanup)."""
        lst = transport.listen(url or self.listen_url(), **self.conn_options(**options))
        self.defer(lst.close)
        return lst

    def connect(self, url: str, **options: Any):
        """A client connection to ``url`` (closed at cleanup). Needs someone accepting."""
        conn = transport.connect(url, **self.conn_options(**options))
        self.defer(conn.close)
        return conn

    def accept_pair(self, listener, **options: Any):
        """Connect a new client to ``listener`` from a thread and accept it here:
        returns ``(client, server)``."""
        timeout = self.options["timeout"] + self.slack
        box = Worker(lambda: self.connect(listener.url, **options), name="connect")
        try:
            server = listener.accept(timeout=timeout)
        except BaseException:
            box.join(timeout, swallow=True)
            raise
        self.defer(server.close)
        client = box.join(timeout)
        return client, server

    def pair(self, **options: Any):
        """``(client, server)``: a fresh listener, one client connected to it, accepted.
        ``options`` go to both ends."""
        return self.accept_pair(self.listen(**options), **options)

    # -- peer processes -------------------------------------------------------------
    def spawn_peer(self, url: str, mode: str, **args: Any) -> "PeerProcess":
        """Start ``python -m transport.testing.peer URL --mode MODE`` connecting to ``url``;
        ``args`` become ``--key value`` (``options`` defaults to this env's options)."""
        argv = [self.peer_python, "-m", "transport.testing.peer", url, "--mode", mode,
                "--options", json.dumps(args.pop("options", self.options))]
        for k, v in args.items():
            argv += [f"--{k.replace('_', '-')}", str(v)]
        peer = PeerProcess(argv, {**os.environ, **self.peer_env})
        self.defer(peer.kill)
        return peer

    # -- cleanup --------------------------------------------------------------------
    def defer(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` at cleanup (last registered, first run)."""
        self._cleanups.append(fn)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        errors = []
        while self._cleanups:
            fn = self._cleanups.pop()
            try:
                fn()
            except Exception as e:  # cleanup must not hide the check's own failure
                errors.append(f"{fn!r}: {e!r}")
        leaked = self.leaks(wait=2.0 + self.slack)
        if leaked:
            raise AssertionError(f"left behind after the check: {leaked}")
        if errors:
            raise AssertionError(f"cleanup failed: {errors}")

    def leaks(self, wait: float = 0.0) -> list[str]:
        """Entries of ``leak_dirs`` that appeared since this env started (polls up to
        ``wait`` seconds for them to go)."""
        end = time.monotonic() + wait
        while True:
            new = [os.path.join(d, n) for d in self.leak_dirs
                   for n in sorted(_listdir(d) - self._before[d])]
            if not new or time.monotonic() >= end:
                return new
            time.sleep(0.05)

    def __enter__(self) -> "PairEnv":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except AssertionError:
                pass  # the check's failure is the one to report

    def __repr__(self) -> str:
        return f"<PairEnv {self.name} {self.options}>"


def run_check(check: Callable[[PairEnv], None], url_factory: Callable[[], str], *,
              name: Optional[str] = None, shares_sender_memory: bool = False,
              leak_dirs: tuple = (), slack: float = 0.5, peer_python: Optional[str] = None,
              peer_env: Optional[dict] = None, **conn_options: Any) -> None:
    """Run one check in a fresh :class:`PairEnv` (``conn_options`` go to listen/connect)."""
    with PairEnv(url_factory, name=name, options=conn_options,
                 shares_sender_memory=shares_sender_memory, leak_dirs=leak_dirs, slack=slack,
                 peer_python=peer_python, peer_env=peer_env) as env:
        check(env)


def check_ids() -> list[str]:
    return [c.__name__.removeprefix("check_") for c in CHECKS]


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------
def _listdir(d: str) -> set:
    try:
        return set(os.listdir(d))
    except FileNotFoundError:
        return set()


class Worker:
    """Run ``fn`` in a daemon thread; ``join`` returns its result or re-raises its error,
    and fails (instead of hanging) if it is still running after ``timeout``."""

    def __init__(self, fn: Callable[[], Any], name: str = "worker"):
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._result = fn()
        except BaseException as e:
            self._error = e

    def join(self, timeout: float, swallow: bool = False) -> Any:
        self._thread.join(timeout)
        if self._thread.is_alive():
            if swallow:
                return None
            raise AssertionError(f"thread {self._thread.name} still running after {timeout:.1f} s")
        if self._error is not None and not swallow:
            raise self._error
        return self._result


class PeerProcess:
    """A :mod:`transport.testing.peer` subprocess; its stderr is kept for diagnostics."""

    def __init__(self, argv: list, env: dict):
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=self._err, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_line(self, expect: str, timeout: float) -> str:
        """The next stdout line, which must start with ``expect`` (e.g. "ready")."""
        box: dict = {}
        t = threading.Thread(target=lambda: box.setdefault("line", self.proc.stdout.readline()),
                             daemon=True)
        t.start()
        t.join(timeout)
        line = box.get("line", b"").decode(errors="replace").strip()
        if not line.startswith(expect):
            raise AssertionError(f"peer said {line!r}, expected {expect!r}; stderr: {self.stderr()}")
        return line

    def stderr(self) -> str:
        self._err.seek(0)
        return self._err.read().decode(errors="replace")[-4000:]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
        try:
            self.proc.wait(10)
        finally:
            if self.proc.stdout:
                self.proc.stdout.close()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"peer still running after {timeout:.1f} s; stderr: {self.stderr()}")


def pattern(seq: int, n: int) -> np.ndarray:
    """``n`` deterministic bytes that depend on ``seq`` (cheap at any size)."""
    return ((np.arange(n, dtype=np.uint32) * 7 + seq * 13 + 1) % 251).astype(np.uint8)


def verify(buf, seq: int, n: Optional[int] = None, what: str = "buffer") -> None:
    """Assert that ``buf`` holds ``pattern(seq, n)``."""
    got = np.frombuffer(buf, dtype=np.uint8)
    if n is not None:
        assert got.size == n, f"{what}: {got.size} bytes, expected {n}"
    want = pattern(seq, got.size)
    if not np.array_equal(got, want):
        bad = int(np.argmax(got != want))
        raise AssertionError(f"{what} (seq {seq}, {got.size} B) differs at byte {bad}: "
                             f"{got[bad]} != {want[bad]}")


def filled_slot(conn, seq: int, n: int, timeout: Optional[float] = None):
    slot = conn.alloc(n, timeout=timeout)
    assert slot.nbytes == n, f"alloc({n}) gave a slot of nbytes={slot.nbytes}"
    if n:
        np.frombuffer(slot.buf, dtype=np.uint8)[:] = pattern(seq, n)
    return slot


def send_seq(conn, seq: int, n: int, timeout: Optional[float] = None, **extra) -> None:
    """Send message ``seq``: header {"seq": seq, **extra}, one slot of ``pattern(seq, n)``."""
    slot = filled_slot(conn, seq, n, timeout)
    conn.send({"seq": seq, "n": n, **extra}, [slot], timeout=timeout)


def recv_seq(conn, seq: int, n: Optional[int] = None, timeout: float = 5.0, hold: bool = False):
    """Receive message ``seq`` sent by :func:`send_seq`, verify it, release it (or return it
    unreleased with ``hold``)."""
    msg = conn.recv(timeout=timeout)
    try:
        assert isinstance(msg.header, dict) and msg.header.get("seq") == seq, \
            f"expected message {seq}, got header {msg.header!r}"
        assert len(msg.buffers) == 1, f"message {seq}: {len(msg.buffers)} buffers, expected 1"
        verify(msg.buffers[0], seq, msg.header["n"] if n is None else n, f"message {seq}")
    except BaseException:
        msg.release()
        raise
    if hold:
        return msg
    msg.release()
    return None


def transfer(a, b, seq: int, n: int, *, unregistered: bool = False, timeout: float = 10.0) -> None:
    """Message ``seq`` of ``n`` bytes from ``a`` to ``b``, verified. Large messages are sent
    from a helper thread: a byte-stream backend cannot buffer them all in the kernel while
    the receiving end (this thread) is not reading."""
    def go():
        if unregistered:
            a.send({"seq": seq, "n": n}, [pattern(seq, n).tobytes()], timeout=timeout)
        else:
            send_seq(a, seq, n, timeout)
    if n <= 64 << 10:
        go()
        recv_seq(b, seq, n, timeout)
        return
    w = Worker(go, "sender")
    try:
        recv_seq(b, seq, n, timeout)
    finally:
        w.join(timeout + 5)


def roundtrip(a, b, seq: int = 0, n: int = 64, timeout: float = 5.0) -> None:
    """a -> b and b -> a, content verified: the pair still works."""
    send_seq(a, seq, n, timeout)
    recv_seq(b, seq, n, timeout)
    send_seq(b, seq + 1, n, timeout)
    recv_seq(a, seq + 1, n, timeout)


def expect_nothing(conn, wait: float = 0.1) -> None:
    """Nothing arrives on ``conn`` within ``wait`` seconds."""
    try:
        msg = conn.recv(timeout=wait)
    except Timeout:
        return
    header = msg.header
    msg.release()
    raise AssertionError(f"unexpected message {header!r}")


def expect_closed(conn, within: float, what: str) -> float:
    """``conn.recv`` raises ConnectionClosed within ``within`` seconds (messages still
    queued are received and released first). Returns the time it took."""
    t0 = time.monotonic()
    end = t0 + within
    while True:
        left = end - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{what}: no ConnectionClosed within {within:.1f} s")
        try:
            conn.recv(timeout=left).release()
        except ConnectionClosed:
            return time.monotonic() - t0
        except Timeout:
            raise AssertionError(f"{what}: recv raised Timeout, not ConnectionClosed, "
                                 f"after {time.monotonic() - t0:.2f} s") from None


def raises(exc_type, fn: Callable[[], Any], what: str):
    try:
        fn()
    except exc_type as e:
        return e
    except BaseException as e:
        raise AssertionError(f"{what}: raised {type(e).__name__}: {e}, expected {exc_type.__name__}") from e
    raise AssertionError(f"{what}: did not raise {exc_type.__name__}")


def timed(fn: Callable[[], Any]) -> tuple[Optional[BaseException], float]:
    t0 = time.monotonic()
    try:
        fn()
    except BaseException as e:
        return e, time.monotonic() - t0
    return None, time.monotonic() - t0


# ---------------------------------------------------------------------------------------
# the checks
# ---------------------------------------------------------------------------------------
def check_roundtrip(env: PairEnv) -> None:
    """One message each way; the Message API (array, nbytes, context manager, release)."""
    client, server = env.pair()
    slot = client.alloc(16)
    arr = slot.array(np.float32, (2, 2))
    arr[:] = [[1, 2], [3, 4]]
    client.send({"op": "ping"}, [slot])
    with server.recv(timeout=5) as msg:
        assert msg.header == {"op": "ping"}, msg.header
        assert msg.nbytes == 16 and len(msg.buffers) == 1
        np.testing.assert_array_equal(msg.array(0, np.float32, (2, 2)), [[1, 2], [3, 4]])
    assert msg.released
    msg.release()  # idempotent
    roundtrip(server, client, 10, 1000)
    for c in (client, server):
        assert c.stats.messages_sent >= 1 and c.stats.messages_received >= 1, c.stats
        assert not c.closed


def check_order(env: PairEnv) -> None:
    """500 messages of varied sizes arrive in order with their contents, both directions."""
    client, server = env.pair()
    sizes = [0, 1, 7, 64, 4096, 100, 65536, 3]
    for a, b in ((client, server), (server, client)):
        n = 0
        for seq in range(500):
            send_seq(a, seq, sizes[seq % len(sizes)], timeout=5)
            # keep a few messages in flight, within the credits
            if seq - n >= 3:
                recv_seq(b, n, sizes[n % len(sizes)])
                n += 1
        while n < 500:
            recv_seq(b, n, sizes[n % len(sizes)])
            n += 1
        expect_nothing(b, 0.02)
    assert client.stats.messages_sent == 500 and server.stats.messages_received == 500


HEADERS = [
    None, 0, 1, -1, True, False, "", "x", [], {},
    2**63 - 1, -(2**63), 2**64 - 1, 1.5, -0.0, float("inf"),
    "ünïcødé ✓", b"", b"\x00\xff" * 100,
    {"op": "dispatch", "layer": 7, "experts": [1, 5, 9], "shape": [128, 4096], "dtype": "bf16"},
    {"nested": {"a": [1, [2, [3, [4, {"deep": True}]]]], "b": {"c": {"d": None}}}},
    {1: "int key", 2: [b"bin", "str", 3.25]},
    [[], {}, [[]], [{}], ""],
    {"big": list(range(2000)), "blob": b"\x01" * 20000},
]


def _deep(n: int):
    obj: Any = "leaf"
    for i in range(n):
        obj = {"level": i, "child": [obj]}
    return obj


def check_header_roundtrip(env: PairEnv) -> None:
    """Any msgpack object survives as the header, exactly (falsy values and None too)."""
    client, server = env.pair()
    cases = HEADERS + [_deep(40)]
    for i, h in enumerate(cases):
        client.send(h, [] if i % 2 else [client.alloc(8)])
        with server.recv(timeout=5) as msg:
            assert msg.header == h and type(msg.header) is type(h), \
                f"header {h!r:.80} came back as {msg.header!r:.80}"
            assert len(msg.buffers) == (0 if i % 2 else 1)
    # tuples come back as lists (msgpack has one array type)
    client.send({"t": (1, (2, 3))})
    with server.recv(timeout=5) as msg:
        assert msg.header == {"t": [1, [2, 3]]}, msg.header


def check_multi_buffer(env: PairEnv) -> None:
    """Messages of several buffers (zero-length ones included) keep each buffer's length,
    order and content; a message with no buffers has ``buffers == []``."""
    client, server = env.pair()
    layouts = [[], [0], [0, 0], [5, 0, 3], [4096, 1, 65536], [1] * 6, [1000, 2000, 3000, 4000]]
    for i, lens in enumerate(layouts):
        slots = [filled_slot(client, 100 * i + j, n) for j, n in enumerate(lens)]
        client.send({"i": i}, slots)
        with server.recv(timeout=5) as msg:
            assert msg.header == {"i": i}
            assert [b.nbytes for b in msg.buffers] == lens, ([b.nbytes for b in msg.buffers], lens)
            for j, (b, n) in enumerate(zip(msg.buffers, lens)):
                verify(b, 100 * i + j, n, f"layout {lens} buffer {j}")
            assert msg.nbytes == sum(lens)
    # unregistered buffers mixed with slots
    slot = filled_slot(client, 1, 300)
    client.send("mixed", [pattern(2, 10).tobytes(), slot, bytearray(pattern(3, 20).tobytes()),
                          pattern(4, 40)])
    with server.recv(timeout=5) as msg:
        assert [b.nbytes for b in msg.buffers] == [10, 300, 20, 40]
        for b, seq in zip(msg.buffers, (2, 1, 3, 4)):
            verify(b, seq)


def check_sizes(env: PairEnv) -> None:
    """0 B, 1 B, 4 KiB, 1 MiB and exactly ``max_message`` arrive intact, from a slot and
    from an unregistered buffer, both directions."""
    client, server = env.pair()
    for a, b in ((client, server), (server, client)):
        assert a.max_message >= 1 << 20, f"max_message {a.max_message} < 1 MiB with {env.options}"
        sizes = [0, 1, 4096, 1 << 20, a.max_message - 1, a.max_message]
        for seq, n in enumerate(sizes):
            transfer(a, b, seq, n)
            transfer(a, b, seq, n, unregistered=True)


def check_over_limit(env: PairEnv) -> None:
    """One byte over ``max_message`` is a ValueError before anything is sent (alloc, an
    unregistered buffer, several buffers adding up); the connection keeps working."""
    client, server = env.pair()
    m = client.max_message
    raises(ValueError, lambda: client.alloc(m + 1), "alloc(max_message + 1)")
    raises(ValueError, lambda: client.send("big", [bytes(m + 1)]), "send of max_message + 1 bytes")
    raises(ValueError, lambda: client.send("big", [np.zeros(m + 1, np.uint8)]), "send of a large array")
    half = m // 2 + 1
    raises(ValueError, lambda: client.send("sum", [client.alloc(half), client.alloc(half)]),
           "two slots adding up to more than max_message")
    raises(ValueError, lambda: client.send("sum", [bytes(half), bytes(half)]),
           "two buffers adding up to more than max_message")
    expect_nothing(server, 0.1)
    # every slot is usable again: nothing leaked by the refusals
    for seq in range(3 * env.options["nslots"]):
        send_seq(client, seq, 1000, timeout=5)
        recv_seq(server, seq, 1000)
    roundtrip(client, server, 100)
    assert client.stats.messages_sent == 3 * env.options["nslots"] + 1


def check_header_limits(env: PairEnv) -> None:
    """A header msgpack cannot encode is a TypeError, one over the header limit or more
    buffers than the limit a ValueError, all before anything is sent; the connection works."""
    client, server = env.pair(slot_size=1 << 16, nslots=framing.MAX_BUFFERS)
    raises(TypeError, lambda: client.send({"f": object()}), "unserialisable header")
    raises(TypeError, lambda: client.send({"s": {1, 2}}), "a set in the header")
    raises(ValueError, lambda: client.send({"pad": b"x" * (framing.MAX_HEADER + 1)}),
           "a header over the limit")
    raises(ValueError, lambda: client.send("many", [b"x"] * (framing.MAX_BUFFERS + 1)),
           "more buffers than the limit")
    expect_nothing(server, 0.1)
    # just under the limits works
    h = {"pad": b"x" * (framing.MAX_HEADER - 1000)}
    client.send(h, [filled_slot(client, i, 3) for i in range(framing.MAX_BUFFERS)])
    with server.recv(timeout=5) as msg:
        assert msg.header == h and len(msg.buffers) == framing.MAX_BUFFERS
        for i, b in enumerate(msg.buffers):
            verify(b, i, 3)
    roundtrip(client, server)


def check_many_in_flight(env: PairEnv) -> None:
    """5000 small messages from a sender thread to a receiver: every one, in order."""
    client, server = env.pair()
    count = 5000

    def sender():
        for seq in range(count):
            send_seq(client, seq, 8 + seq % 56, timeout=10)

    w = Worker(sender, "sender")
    for seq in range(count):
        recv_seq(server, seq, 8 + seq % 56, timeout=10)
    w.join(10 + env.slack)
    expect_nothing(server, 0.02)
    assert server.stats.messages_received == count
    roundtrip(client, server, count)


def check_full_duplex(env: PairEnv) -> None:
    """Both ends send large messages at once while draining what arrives (one thread per
    end): nothing deadlocks, everything arrives in order."""
    client, server = env.pair()
    count, n = 40, 512 << 10

    def run(conn):
        got = 0
        for seq in range(count):
            send_seq(conn, seq, n, timeout=10)
            while conn.pending() or got < seq - 1:
                recv_seq(conn, got, n, timeout=10)
                got += 1
        while got < count:
            recv_seq(conn, got, n, timeout=10)
            got += 1

    w = Worker(lambda: run(server), "server-end")
    run(client)
    w.join(20 + env.slack)
    roundtrip(client, server)


def check_credits(env: PairEnv) -> None:
    """The receiver holds every message: the sender's next alloc/send raises Timeout
    within its timeout; after the releases it continues and everything arrives."""
    nslots = 4
    client, server = env.pair(nslots=nslots)
    held = []
    seq = 0
    # the peer gives us `nslots` credits: that many messages go through unreleased
    for seq in range(nslots):
        send_seq(client, seq, 1024, timeout=5)
        held.append(recv_seq(server, seq, 1024, hold=True))
    stalls = client.stats.credit_stalls
    for attempt, timeout in enumerate((0.2, 0.0, 0.3)):
        err, dt = timed(lambda: send_seq(client, nslots, 1024, timeout=timeout))
        assert isinstance(err, Timeout), f"send with no credits left: {err!r} after {dt:.2f} s"
        assert isinstance(err, TimeoutError), "transport.Timeout must be a TimeoutError"
        assert dt <= timeout + env.slack, f"Timeout after {dt:.2f} s, asked for {timeout}"
        assert dt >= timeout * 0.8, f"Timeout after {dt:.3f} s, before the {timeout} s asked"
    assert client.stats.credit_stalls > stalls, "credit stalls not counted"
    expect_nothing(server, 0.05)
    # release: the sender resumes; the message that timed out was never sent
    for m in held:
        m.release()
    total = 4 * nslots
    w = Worker(lambda: [send_seq(client, s, 1024, timeout=5) for s in range(nslots, total)], "sender")
    for s in range(nslots, total):
        recv_seq(server, s, 1024, timeout=5)
    w.join(5 + env.slack)
    expect_nothing(server, 0.05)
    roundtrip(client, server, 1000)
    # and the other way round (a fresh pair: the credits of released messages may be
    # batched, so only a fresh window is exactly `nslots`)
    client, server = env.pair(nslots=nslots)
    for s in range(nslots):
        send_seq(server, s, 10, timeout=5)
    err, _ = timed(lambda: send_seq(server, nslots, 10, timeout=0.1))
    assert isinstance(err, Timeout), f"server side without credits: {err!r}"
    for s in range(nslots):
        recv_seq(client, s, 10)
    send_seq(server, nslots, 10, timeout=5)
    recv_seq(client, nslots, 10)


def check_send_ready(env: PairEnv) -> None:
    """send_ready() says whether a send would go without waiting: True on a fresh pair,
    False once the receiver holds every message, True again (after the sender looked at
    what came back: a recv(0)) once they are released."""
    nslots = 4
    client, server = env.pair(nslots=nslots)
    assert client.send_ready() and server.send_ready(), "a fresh connection is ready"
    held = []
    for seq in range(nslots):
        send_seq(client, seq, 1024, timeout=5)
        held.append(recv_seq(server, seq, 1024, hold=True))
    assert not client.send_ready(), "ready with every credit held by the receiver"
    err, _ = timed(lambda: send_seq(client, nslots, 10, timeout=0))
    assert isinstance(err, Timeout), f"send after send_ready() said no: {err!r}"
    for m in held:
        m.release()
    server.recv(timeout=0) if server.pending() else None
    end = time.monotonic() + 2 + env.slack
    while not client.send_ready():
        assert time.monotonic() < end, "not ready again after the receiver released everything"
        try:
            client.recv(timeout=0.01).release()
        except Timeout:
            pass
    send_seq(client, nslots, 10, timeout=0.5)
    recv_seq(server, nslots, 10)
    client.close()
    assert not client.send_ready(), "a closed connection is not ready"


def check_send_timeout_consistent(env: PairEnv) -> None:
    """Large sends with a short timeout to a receiver that is not reading: each send
    either returns (the message will arrive) or raises Timeout (it never will, and the
    connection still works) or ConnectionClosed (then everything sent before arrives and
    then ConnectionClosed). No message arrives corrupted or twice."""
    client, server = env.pair()
    n = client.max_message
    sent, outcome = 0, None
    for seq in range(env.options["nslots"] + 2):
        try:
            send_seq(client, seq, n, timeout=0.2)
            sent += 1
        except (Timeout, ConnectionClosed) as e:
            outcome = e
            break
    assert outcome is not None, "sent more messages than the receiver has credits for"
    for seq in range(sent):
        recv_seq(server, seq, n, timeout=5)
    if isinstance(outcome, Timeout):
        expect_nothing(server, 0.1)
        roundtrip(client, server, 1000)
    else:
        expect_closed(server, 5 + env.slack, "after the sender's ConnectionClosed")


def check_recv_timeout(env: PairEnv) -> None:
    """recv(timeout=0.05) with nothing sent raises transport.Timeout (a TimeoutError) in
    bounded time, recv(timeout=0) polls, and the connection stays usable."""
    client, server = env.pair()
    for conn in (server, client):
        for timeout in (0.05, 0.0, 0.2):
            err, dt = timed(lambda: conn.recv(timeout=timeout))
            assert isinstance(err, Timeout), f"recv({timeout}) on an idle connection: {err!r}"
            assert isinstance(err, TimeoutError)
            assert dt <= timeout + env.slack, f"recv({timeout}) took {dt:.2f} s"
            assert dt >= timeout * 0.8, f"recv({timeout}) gave up after {dt:.3f} s"
        assert not conn.closed
    roundtrip(client, server)
    # a message that is already there is returned by recv(timeout=0)
    send_seq(client, 7, 10)
    end = time.monotonic() + 5
    while True:
        try:
            recv_seq(server, 7, 10, timeout=0)
            break
        except Timeout:
            assert time.monotonic() < end, "recv(0) never returned the message"
            time.sleep(0.005)
    roundtrip(server, client, 20)


def _close_cases(env: PairEnv, closer_is_client: bool) -> None:
    client, server = env.pair()
    closer, survivor = (client, server) if closer_is_client else (server, client)
    roundtrip(closer, survivor)
    closer.close()
    assert closer.closed
    closer.close()  # idempotent
    expect_closed(survivor, 5 + env.slack, "the peer closed")
    raises(ConnectionClosed, lambda: survivor.recv(timeout=1), "recv again after ConnectionClosed")
    raises(ConnectionClosed, lambda: send_seq(survivor, 0, 10, timeout=1), "send to a closed peer")
    survivor.close()
    survivor.close()
    assert survivor.closed
    for conn in (closer, survivor):
        raises(ConnectionClosed, lambda: conn.recv(timeout=0.1), "recv on a closed connection")
        raises(ConnectionClosed, lambda: conn.send({"x": 1}, [b"abc"], timeout=0.1),
               "send on a closed connection")
        raises(ConnectionClosed, lambda: conn.alloc(10, timeout=0.1), "alloc on a closed connection")


def check_peer_close(env: PairEnv) -> None:
    """The peer closes: recv on the survivor raises ConnectionClosed (not a hang, not a
    Timeout), then send does too; close() is idempotent; every operation on a closed
    connection raises ConnectionClosed. Both ways round."""
    _close_cases(env, closer_is_client=True)
    _close_cases(env, closer_is_client=False)


def check_close_delivers(env: PairEnv) -> None:
    """Messages sent before close() are delivered, in order, before ConnectionClosed."""
    client, server = env.pair()
    sizes = [10, 1 << 20, 0, 4096, 1 << 20, 1]

    def sender():
        for seq, n in enumerate(sizes):
            send_seq(client, seq, n, timeout=10)
        client.close()

    w = Worker(sender, "sender")
    for seq, n in enumerate(sizes):
        recv_seq(server, seq, n, timeout=10)
    expect_closed(server, 5 + env.slack, "after the delivered messages")
    w.join(5 + env.slack)


def check_close_while_blocked(env: PairEnv) -> None:
    """A recv blocked on one end (long timeout) wakes with ConnectionClosed soon after the
    peer closes."""
    client, server = env.pair()
    w = Worker(lambda: timed(lambda: server.recv(timeout=20)), "blocked-recv")
    time.sleep(0.2)
    client.close()
    err, dt = w.join(5 + env.slack)
    assert isinstance(err, ConnectionClosed), f"blocked recv after the peer closed: {err!r}"
    assert dt < 0.2 + 5 + env.slack, dt


def check_peer_killed(env: PairEnv) -> None:
    """A peer process streaming to us is killed with SIGKILL: our recv raises
    ConnectionClosed within 5 s (never a hang or a Timeout), the message we still hold is
    readable until released, send raises ConnectionClosed, and nothing is left behind."""
    lst = env.listen()
    peer = env.spawn_peer(lst.url, "stream", size=4096)
    conn = lst.accept(timeout=20)
    env.defer(conn.close)
    peer.wait_line("ready", 20)
    held = None
    for seq in range(50):
        msg = conn.recv(timeout=5)
        assert msg.header.get("seq") == seq, msg.header
        verify(msg.buffers[0], seq, 4096)
        if held is not None:
            held.release()
        held = msg
    peer.kill(signal.SIGKILL)
    t0 = time.monotonic()
    end = t0 + 5 + env.slack
    n = 50
    while True:
        try:
            m = conn.recv(timeout=max(0.0, end - time.monotonic()))
        except ConnectionClosed:
            break
        except Timeout:
            raise AssertionError(f"Timeout instead of ConnectionClosed {time.monotonic() - t0:.2f} s "
                                 "after the peer was killed") from None
        assert m.header.get("seq") == n, (m.header, n)
        verify(m.buffers[0], n, 4096)
        n += 1
        m.release()
    verify(held.buffers[0], held.header["seq"], 4096, "the message held across the kill")
    held.release()
    raises(ConnectionClosed, lambda: conn.send({"x": 1}, [b"abc"], timeout=1), "send to a killed peer")
    conn.close()
    lst.close()


def check_peer_killed_while_we_wait_for_credits(env: PairEnv) -> None:
    """A peer process that holds everything we send (no credits back) is killed while our
    send waits for credits: the send raises ConnectionClosed, not Timeout, within 5 s."""
    nslots = 4
    lst = env.listen(nslots=nslots)
    peer = env.spawn_peer(lst.url, "hold", count=nslots, options=env.conn_options(nslots=nslots))
    conn = lst.accept(timeout=20)
    env.defer(conn.close)
    peer.wait_line("ready", 20)
    for seq in range(nslots):
        send_seq(conn, seq, 1000, timeout=5)
    peer.wait_line("held", 10)
    timer = threading.Timer(0.3, peer.kill)
    timer.start()
    try:
        err, dt = timed(lambda: send_seq(conn, nslots, 1000, timeout=10))
    finally:
        timer.cancel()
    assert isinstance(err, ConnectionClosed), f"send while the peer died: {err!r} after {dt:.2f} s"
    assert dt < 0.3 + 5 + env.slack, dt
    raises(ConnectionClosed, lambda: conn.recv(timeout=1), "recv after the peer died")


def check_cross_process(env: PairEnv) -> None:
    """Messages to a peer process and back (it echoes): sizes up to max_message, several
    buffers, headers; then it closes and we see ConnectionClosed."""
    lst = env.listen()
    peer = env.spawn_peer(lst.url, "echo")
    conn = lst.accept(timeout=20)
    env.defer(conn.close)
    peer.wait_line("ready", 20)
    sizes = [0, 1, 4096, 1 << 20, conn.max_message - 17, 12345]
    for seq, n in enumerate(sizes):
        slots = [filled_slot(conn, seq, n), filled_slot(conn, seq + 1000, 17)]
        conn.send({"seq": seq, "meta": {"n": n, "l": [1, 2.5, None]}}, slots, timeout=10)
        with conn.recv(timeout=10) as msg:
            assert msg.header == {"seq": seq, "meta": {"n": n, "l": [1, 2.5, None]}}, msg.header
            assert [b.nbytes for b in msg.buffers] == [n, 17]
            verify(msg.buffers[0], seq, n)
            verify(msg.buffers[1], seq + 1000, 17)
            for b in msg.buffers:
                assert conn.in_registered_memory(b)
    count, window, got = 300, 3, 0
    for s in range(count):  # pipelined, a few messages in flight (fewer than the credits)
        send_seq(conn, s, 100, timeout=10)
        if s - got >= window:
            recv_seq(conn, got, 100, timeout=10)
            got += 1
    while got < count:
        recv_seq(conn, got, 100, timeout=10)
        got += 1
    conn.send({"op": "exit"})
    expect_closed(conn, 5 + env.slack, "the echo peer exited")
    assert peer.wait(10) == 0, peer.stderr()


def check_cross_process_stream(env: PairEnv) -> None:
    """A peer process streams 2000 messages to us and closes: all arrive, in order."""
    lst = env.listen()
    peer = env.spawn_peer(lst.url, "stream", size=256, count=2000)
    conn = lst.accept(timeout=20)
    env.defer(conn.close)
    for seq in range(2000):
        recv_seq(conn, seq, 256, timeout=10)
    expect_closed(conn, 5 + env.slack, "the streaming peer finished")
    assert peer.wait(10) == 0, peer.stderr()


def _bad_frames(max_payload: int) -> list[tuple[str, bytes]]:
    P = framing.PREFIX
    good_head = framing.encode_header({"x": 1}, [4])
    prefix = framing.encode_prefix

    def data(head: bytes, payload: bytes = b"", plen: Optional[int] = None) -> bytes:
        return prefix(Kind.DATA, len(head), len(payload) if plen is None else plen) + head + payload

    return [
        ("bad magic", P.pack(b"XX", framing.VERSION, Kind.DATA, len(good_head), 4) + good_head + b"abcd"),
        ("bad version", P.pack(framing.MAGIC, 99, Kind.DATA, len(good_head), 4) + good_head + b"abcd"),
        ("bad kind", P.pack(framing.MAGIC, framing.VERSION, 99, len(good_head), 4) + good_head + b"abcd"),
        ("kind zero", P.pack(framing.MAGIC, framing.VERSION, 0, 0, 0)),
        ("header longer than the limit", prefix(Kind.DATA, framing.MAX_HEADER + 1, 0)),
        ("payload larger than the slot",
         data(framing.encode_header({}, [max_payload + 1]), plen=max_payload + 1)),
        ("garbage msgpack header", data(b"\xc1" * 12, b"abcd", plen=4)),
        ("truncated msgpack header", data(good_head[:-3], b"abcd", plen=4)),
        ("header is not a triple", data(framing._packer.pack({"x": 1}), b"abcd")),
        ("buffer lengths do not sum to payload_len",
         data(framing.encode_header({}, [3, 4]), b"0123456789")),
        ("negative buffer length", data(framing._packer.pack([{}, [-1, 5], None]), b"abcd")),
        ("too many buffers",
         data(framing.encode_header({}, [0] * (framing.MAX_BUFFERS + 1)))),
        ("DATA without a header", prefix(Kind.DATA, 0, 4) + b"abcd"),
        ("HELLO after the handshake", b"".join(framing.encode_hello({"transport": "moe-transport"}))),
    ]


def check_malformed_frames(env: PairEnv) -> None:
    """A malformed frame makes the receiver raise ProtocolError and close that connection
    (the sender then sees ConnectionClosed); the listener keeps serving good clients."""
    lst = env.listen()
    client, server = env.accept_pair(lst)
    cases = _bad_frames(client.max_message)
    for what, frame in cases:
        roundtrip(client, server)
        raw.send_raw(client, frame)
        err, dt = timed(lambda: server.recv(timeout=5))
        assert isinstance(err, ProtocolError), f"{what}: the receiver got {err!r} after {dt:.2f} s"
        assert server.closed, f"{what}: the connection was not closed after ProtocolError"
        raises(ConnectionClosed, lambda: server.recv(timeout=0.1), f"{what}: recv after ProtocolError")
        expect_closed(client, 5 + env.slack, f"{what}: the sender of the bad frame")
        # a new client on the same listener is served
        client, server = env.accept_pair(lst)
    roundtrip(client, server)


def check_zero_copy(env: PairEnv) -> None:
    """Received buffers lie in registered memory (on shm: in the sender's very slot);
    stats.copies stays 0 for slots from alloc(), and counts exactly one per unregistered
    buffer (bytes, bytearray, numpy array), which still arrive intact."""
    client, server = env.pair()
    assert not server.in_registered_memory(bytearray(4096)), "a fresh bytearray is not registered"
    for a, b in ((client, server), (server, client)):
        for seq, n in enumerate((1, 4096, 1 << 20)):
            slot = filled_slot(a, seq, n)
            sender_view = np.frombuffer(slot.buf, dtype=np.uint8)
            w = Worker(lambda: a.send({"seq": seq}, [slot], timeout=10), "sender")
            with b.recv(timeout=10) as msg:
                w.join(10)
                buf = msg.buffers[0]
                verify(buf, seq, n)
                assert b.in_registered_memory(buf), f"{n} B buffer outside registered memory"
                if env.shares_sender_memory:
                    assert np.shares_memory(np.frombuffer(buf, dtype=np.uint8), sender_view), \
                        "shm: the received buffer is not the sender's slot"
            del sender_view
    for c in (client, server):
        assert c.stats.copies == 0, f"copies={c.stats.copies} with registered slots only"
    client.send({"u": 1}, [pattern(1, 100).tobytes(), bytearray(pattern(2, 50).tobytes()),
                           pattern(3, 4096), client.alloc(0)])
    assert client.stats.copies == 3, f"3 unregistered buffers counted as {client.stats.copies} copies"
    with server.recv(timeout=5) as msg:
        for buf, (seq, n) in zip(msg.buffers, ((1, 100), (2, 50), (3, 4096), (0, 0))):
            verify(buf, seq, n)
            assert server.in_registered_memory(buf)
    assert server.stats.copies == 0, server.stats
    client.send({"f": 1}, [np.arange(10, dtype=np.float64)])
    with server.recv(timeout=5) as msg:
        np.testing.assert_array_equal(msg.array(0, np.float64), np.arange(10))
    assert client.stats.copies == 4


def _wait_ready(poller: Poller, timeout: float) -> list:
    return [o for o, _ in poller.poll(timeout)]


def check_poller(env: PairEnv) -> None:
    """A Poller over several connections wakes for the one with a message; a message
    already buffered in user space (pending()) is reported although the fd is quiet."""
    pairs = [env.pair(nslots=4) for _ in range(4)]
    poller = Poller()
    env.defer(poller.close)
    for i, (_, server) in enumerate(pairs):
        poller.register(server, i)
    t0 = time.monotonic()
    assert poller.poll(0.1) == [], "poll with nothing sent"
    assert time.monotonic() - t0 <= 0.1 + env.slack
    for target in (2, 0, 3):
        client, server = pairs[target]
        assert not server.pending()
        send_seq(client, target, 100)
        end = time.monotonic() + 5
        while True:
            ready = poller.poll(max(0.0, end - time.monotonic()))
            assert ready, f"the poller did not wake for connection {target}"
            # only the target has anything: a spurious wake-up of another is tolerated only
            # if its recv(0) then times out
            objs = [o for o, _ in ready]
            for o in objs:
                if o is not server:
                    raises(Timeout, lambda: o.recv(timeout=0), "spurious readiness")
            if server in objs:
                break
        assert [d for o, d in ready if o is server] == [target]
        try:
            recv_seq(server, target, 100, timeout=0)
        except Timeout:  # readable but not a whole message yet: allowed, then it comes
            recv_seq(server, target, 100, timeout=5)
    assert poller.poll(0.05) == []
    # pending(): two messages in a row; once the first is taken the second may be in user
    # space already, and the poller must still report the connection
    client, server = pairs[1]
    send_seq(client, 1, 10)
    send_seq(client, 2, 10)
    time.sleep(0.05)
    assert server in _wait_ready(poller, 5)
    recv_seq(server, 1, 10)
    if server.pending():
        assert server in _wait_ready(poller, 0), "pending() connection not reported by poll(0)"
        recv_seq(server, 2, 10, timeout=0)  # pending() means recv(0) succeeds
    else:
        assert server in _wait_ready(poller, 5)
        recv_seq(server, 2, 10)
    assert not server.pending()
    assert poller.poll(0.05) == []
    # a listener in a poller wakes when a client connects
    lst = env.listen()
    poller.register(lst, "listener")
    assert poller.poll(0.05) == []
    box = Worker(lambda: env.connect(lst.url), "connect")
    assert [d for _, d in poller.poll(5 + env.slack)] == ["listener"]
    server = lst.accept(timeout=5)
    env.defer(server.close)
    roundtrip(box.join(5), server)
    poller.unregister(lst)
    # a peer that closes wakes the poller too
    client, server = pairs[3]
    client.close()
    assert server in _wait_ready(poller, 5), "the peer's close did not wake the poller"
    expect_closed(server, 5, "closed peer in the poller")
    poller.unregister(server)


def check_many_clients(env: PairEnv) -> None:
    """8 clients on one listener, served by a single thread with a Poller (accepting and
    echoing); every client gets its own messages back, in order."""
    nclients, count = 8, 60
    lst = env.listen(nslots=4)
    stop = threading.Event()
    served = []

    def serve():
        poller = Poller()
        poller.register(lst, None)
        conns = 0
        finished = 0
        try:
            while finished < nclients and not stop.is_set():
                for obj, data in poller.poll(0.2):
                    if data is None:
                        conn = lst.accept(timeout=5)
                        conns += 1
                        poller.register(conn, conns)
                        continue
                    conn = obj
                    try:
                        while True:  # everything already there, without blocking
                            try:
                                msg = conn.recv(timeout=0)
                            except Timeout:
                                break
                            with msg:
                                conn.send({**msg.header, "by": data}, list(msg.buffers), timeout=5)
                            served.append(data)
                            if not conn.pending():
                                break
                    except ConnectionClosed:
                        poller.unregister(conn)
                        conn.close()
                        finished += 1
        finally:
            poller.close()

    server_thread = Worker(serve, "server")
    env.defer(stop.set)

    def client_run(k):
        conn = transport.connect(lst.url, **env.conn_options(nslots=4))
        try:
            by = None
            for seq in range(count):
                send_seq(conn, seq * 100 + k, 100 + k, timeout=10)
                msg = conn.recv(timeout=10)
                with msg:
                    assert msg.header["seq"] == seq * 100 + k, msg.header
                    by = msg.header["by"] if by is None else by
                    assert msg.header["by"] == by, "a reply came from another connection"
                    verify(msg.buffers[0], seq * 100 + k, 100 + k)
        finally:
            conn.close()

    clients = [Worker(lambda k=k: client_run(k), f"client-{k}") for k in range(nclients)]
    for c in clients:
        c.join(30 + env.slack)
    server_thread.join(10 + env.slack)
    assert len(served) == nclients * count, len(served)


def check_stats(env: PairEnv) -> None:
    """stats agree across the pair: messages and payload bytes sent by one end are the
    ones the other end received (headers and framing not counted)."""
    client, server = env.pair()
    sizes = [0, 1, 100, 4096, 70000, 3]
    for a, b in ((client, server), (server, client), (client, server)):
        for seq, n in enumerate(sizes):
            transfer(a, b, seq, n)
        b.send("ack", [b"12345"])
        with a.recv(timeout=5):
            pass
    for a, b in ((client, server), (server, client)):
        assert a.stats.messages_sent == b.stats.messages_received, (a.stats, b.stats)
        assert a.stats.bytes_sent == b.stats.bytes_received, (a.stats, b.stats)
    assert client.stats.messages_sent == 2 * len(sizes) + 1
    assert client.stats.bytes_sent == 2 * sum(sizes) + 5
    assert server.stats.bytes_sent == sum(sizes) + 2 * 5
    d = client.stats.as_dict()
    assert {"bytes_sent", "bytes_received", "messages_sent", "messages_received", "copies",
            "credit_stalls"} <= set(d)


def check_default_timeout(env: PairEnv) -> None:
    """With no timeout argument, recv and a credit-starved send give up after the
    connection's ``timeout`` option (never "forever")."""
    t = 0.3
    client, server = env.pair(timeout=t, nslots=2)
    assert client.default_timeout == t and server.default_timeout == t
    err, dt = timed(lambda: server.recv())
    assert isinstance(err, Timeout), f"recv() with nothing sent: {err!r}"
    assert t * 0.8 <= dt <= t + env.slack, dt
    held = []
    for seq in range(2):
        send_seq(client, seq, 10)
        held.append(recv_seq(server, seq, 10, hold=True))
    err, dt = timed(lambda: send_seq(client, 2, 10))
    assert isinstance(err, Timeout), f"send() without credits: {err!r}"
    assert dt <= t + env.slack, dt
    for m in held:
        m.release()
    send_seq(client, 2, 10)
    recv_seq(server, 2, 10)


def check_accept_and_connect_errors(env: PairEnv) -> None:
    """accept(timeout) with nobody connecting raises Timeout in bounded time and the
    listener still works; connecting where nobody listens raises a TransportError
    (ConnectionClosed or Timeout), never hangs."""
    lst = env.listen()
    err, dt = timed(lambda: lst.accept(timeout=0.1))
    assert isinstance(err, Timeout), f"accept with nobody connecting: {err!r}"
    assert dt <= 0.1 + env.slack, dt
    client, server = env.accept_pair(lst)
    roundtrip(client, server)
    gone = env.listen()
    url = gone.url
    gone.close()
    err, dt = timed(lambda: env.connect(url, timeout=2.0))
    assert isinstance(err, transport.TransportError), f"connect to a closed listener: {err!r}"
    assert dt <= 2.0 + env.slack, dt


def check_listener_close_keeps_connections(env: PairEnv) -> None:
    """Closing a listener (twice is fine) leaves the connections it accepted working."""
    lst = env.listen()
    client, server = env.accept_pair(lst)
    lst.close()
    lst.close()
    roundtrip(client, server)
    transfer(client, server, 5, 1 << 20)
    client.close()
    expect_closed(server, 5 + env.slack, "after the listener closed")


def check_alloc_when_all_slots_held(env: PairEnv) -> None:
    """Allocating while the caller holds every send slot raises Timeout within the
    timeout; giving one back (``slot.release()``) makes the next alloc work; slots
    released unsent are reusable and nothing leaks."""
    client, server = env.pair(nslots=4)
    held = []
    for _ in range(1000):
        err, dt = timed(lambda: held.append(client.alloc(100, timeout=0.1)))
        if err is not None:
            break
    assert isinstance(err, Timeout), f"alloc with every slot held: {err!r}"
    assert dt <= 0.1 + env.slack, dt
    assert 1 <= len(held) < 1000, len(held)
    held.pop().release()
    slot = client.alloc(100, timeout=1)
    np.frombuffer(slot.buf, np.uint8)[:] = pattern(1, 100)
    client.send({"seq": 1, "n": 100}, [slot])
    recv_seq(server, 1, 100)
    for s in held:
        s.release()
    for seq in range(3 * len(held) + 3):
        send_seq(client, seq, 100, timeout=5)
        recv_seq(server, seq, 100)
    assert client.stats.copies == 0


def check_held_messages_across_close(env: PairEnv) -> None:
    """A message held while the peer closes stays readable until released; releasing
    messages after our own close() is harmless."""
    client, server = env.pair()
    send_seq(client, 1, 4096)
    send_seq(client, 2, 100)
    m1 = recv_seq(server, 1, 4096, hold=True)
    client.close()
    m2 = recv_seq(server, 2, 100, hold=True)
    expect_closed(server, 5 + env.slack, "the peer closed")
    verify(m1.buffers[0], 1, 4096, "held across the peer's close")
    m1.release()
    server.close()
    m2.release()  # after our own close
    m2.release()
    c2, s2 = env.pair()
    send_seq(c2, 3, 10)
    m3 = recv_seq(s2, 3, 10, hold=True)
    s2.close()
    m3.release()


def _open_fds() -> Optional[int]:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def check_no_fd_leak(env: PairEnv) -> None:
    """Opening and closing 20 pairs (with traffic) leaves no file descriptors behind."""
    def cycle(k):
        lst = env.listen()
        client, server = env.accept_pair(lst)
        roundtrip(client, server, k)
        client.close()
        expect_closed(server, 5 + env.slack, "cycle")
        server.close()
        lst.close()
    cycle(0)  # first use may open lazily-created process-wide fds
    before = _open_fds()
    for k in range(20):
        cycle(k)
    after = _open_fds()
    if before is not None:
        assert after <= before + 2, f"{after - before} file descriptors leaked by 20 pairs"


def check_held_buffers_stay_intact(env: PairEnv) -> None:
    """Messages the receiver holds keep their bytes while many later messages arrive
    (no slot is reused under a held message); releasing in any order is fine."""
    import random
    nslots = 6
    client, server = env.pair(nslots=nslots)
    rng = random.Random(7)
    held: dict = {}
    seq, total = 0, 400

    def sender():
        for k in range(total):
            send_seq(client, k, 1 + (k * 37) % 5000, timeout=10)

    w = Worker(sender, "sender")
    for seq in range(total):
        n = 1 + (seq * 37) % 5000
        msg = recv_seq(server, seq, n, timeout=10, hold=True)
        held[seq] = msg
        if len(held) >= nslots - 1 or rng.random() < 0.3:  # release a random one, keep the rest
            k = rng.choice(sorted(held))
            m = held.pop(k)
            verify(m.buffers[0], k, 1 + (k * 37) % 5000, f"message {k} held while others arrived")
            m.release()
    for k, m in sorted(held.items()):
        verify(m.buffers[0], k, 1 + (k * 37) % 5000, f"message {k} held to the end")
        m.release()
    w.join(10 + env.slack)
    roundtrip(client, server)


def check_random_traffic(env: PairEnv) -> None:
    """Seeded random traffic both ways at once (a thread per end): random sizes up to
    max_message, 0-3 buffers mixing slots and plain bytes, random headers, a message
    sometimes held a while; everything arrives intact and in order.

    Bounds that any backend may rely on: at most 2 messages in flight per direction and
    1 held, each of at most 3 buffers, so even a backend whose every buffer occupies a
    sender slot until release (shm) needs at most 3 * 3 + 3 of its 16 slots."""
    import random
    client, server = env.pair(nslots=16)
    count, window = 150, 2
    consumed = {id(client): 0, id(server): 0}  # messages each end has received
    deadline = time.monotonic() + 30 + env.slack

    def plan(seed):
        rng = random.Random(seed)
        msgs = []
        for seq in range(count):
            nbuf = rng.choice([0, 1, 1, 1, 2, 3])
            cap = client.max_message // max(nbuf, 1)
            sizes = [rng.choice([0, 1, rng.randrange(1, 5000), rng.randrange(1, 200000), cap])
                     for _ in range(nbuf)]
            kinds = [rng.random() < 0.7 for _ in sizes]  # True: a slot, False: plain bytes
            header = {"seq": seq, "r": rng.choice([None, 1.5, "x" * rng.randrange(50), [1, {"a": b"b"}]])}
            msgs.append((header, sizes, kinds))
        return msgs

    def run(conn, peer, out_plan, in_plan, seed):
        rng = random.Random(seed)
        sent = got = 0
        held = None
        while sent < count or got < count:
            assert time.monotonic() < deadline, f"stuck at sent={sent} got={got}"
            if sent < count and sent - consumed[id(peer)] < window:
                header, sizes, kinds = out_plan[sent]
                bufs = [filled_slot(conn, sent * 10 + j, n, timeout=10) if is_slot
                        else pattern(sent * 10 + j, n).tobytes()
                        for j, (n, is_slot) in enumerate(zip(sizes, kinds))]
                conn.send(header, bufs, timeout=10)
                sent += 1
                continue
            if got >= count:
                time.sleep(0.001)
                continue
            try:
                msg = conn.recv(timeout=0.05)
            except Timeout:
                continue
            header, sizes, _ = in_plan[got]
            assert msg.header == header, (msg.header, header)
            assert [b.nbytes for b in msg.buffers] == sizes, ([b.nbytes for b in msg.buffers], sizes)
            for j, (b, n) in enumerate(zip(msg.buffers, sizes)):
                verify(b, got * 10 + j, n, f"message {got} buffer {j}")
            got += 1
            consumed[id(conn)] = got
            if held is not None:
                held.release()
                held = None
            if rng.random() < 0.3:
                held = msg
            else:
                msg.release()
        if held is not None:
            held.release()

    a_plan, b_plan = plan(1), plan(2)
    w = Worker(lambda: run(server, client, b_plan, a_plan, 3), "server-end")
    run(client, server, a_plan, b_plan, 4)
    w.join(30 + env.slack)
    roundtrip(client, server)

CHECKS: list[Callable[[PairEnv], None]] = [
    check_roundtrip,
    check_order,
    check_header_roundtrip,
    check_multi_buffer,
    check_sizes,
    check_over_limit,
    check_header_limits,
    check_many_in_flight,
    check_full_duplex,
    check_credits,
    check_send_ready,
    check_send_timeout_consistent,
    check_recv_timeout,
    check_peer_close,
    check_close_delivers,
    check_close_while_blocked,
    check_peer_killed,
    check_peer_killed_while_we_wait_for_credits,
    check_cross_process,
    check_cross_process_stream,
    check_malformed_frames,
    check_zero_copy,
    check_poller,
    check_many_clients,
    check_stats,
    check_default_timeout,
    check_accept_and_connect_errors,
    check_listener_close_keeps_connections,
    check_alloc_when_all_slots_held,
    check_held_messages_across_close,
    check_no_fd_leak,
    check_held_buffers_stay_intact,
    check_random_traffic,
]
