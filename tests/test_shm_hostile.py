"""An shm server survives any peer behaviour by dropping that peer's connection (issue 11).

The server runs in its own process (an echo loop on a Poller, as a gateway or worker
serves); this test process is the hostile peer: it connects through the real handshake and
then writes where it can -- its own segment (which the server maps), the words of the
server's segment that it owns, the return ring -- or offers a segment it could resize.
After every attack the server process must be alive, must have dropped exactly the hostile
connection with a ProtocolError from that connection's own recv/send (never from releasing
a message), and a well-behaved client must still be served.
"""
from __future__ import annotations

import os
import queue
import subprocess
import sys
import textwrap
import threading
import uuid

import numpy as np
import pytest

import transport
import transport.shm
from transport import shmring
from transport.errors import ConnectionClosed, TransportError
from transport.shmring import W_ARMED_DATA, W_ARMED_SPACE, W_OUT_HEAD, W_OUT_TAIL, W_RET_HEAD, W_RUNG, W_RUNG_AT

pytestmark = pytest.mark.timeout(120)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTS = dict(slot_size=4096, nslots=4, timeout=5)

SERVER = textwrap.dedent("""
    import os, sys
    import transport
    import transport.shm
    from transport.errors import Timeout, TransportError
    from transport.poller import Poller

    native = {"default": None, "python": False}[sys.argv[2]]
    lst = transport.listen(sys.argv[1], slot_size=4096, nslots=4, timeout=5, native=native)
    poller = Poller()
    poller.register(lst, "listener")

    class Stdin:
        def fileno(self):
            return 0

    poller.register(Stdin(), "stdin")
    print("ready", transport.shm.NATIVE_AVAILABLE and native is None, flush=True)

    def drop(conn, e):
        print("dropped", type(e).__name__, str(e)[:200].replace("\\n", " "), flush=True)
        poller.unregister(conn)
        conn.close()

    def serve(conn):
        for _ in range(64):
            try:
                msg = conn.recv(timeout=0)
            except Timeout:
                return
            except TransportError as e:
                return drop(conn, e)
            try:
                slots = []
                for b in msg.buffers:
                    s = conn.alloc(b.nbytes, timeout=1)
                    s.buf[:] = b
                    slots.append(s)
                conn.send(msg.header, slots, timeout=1)
            except TransportError as e:
                return drop(conn, e)
            finally:
                try:
                    msg.release()
                except BaseException as e:  # the bug this test exists for
                    print("RELEASE RAISED", repr(e), flush=True)
                    os._exit(3)
            if not conn.pending():
                return

    while True:
        for obj, role in poller.poll(1.0):
            if role == "stdin":
                if not os.read(0, 100):
                    print("bye", flush=True)
                    sys.exit(0)
            elif role == "listener":
                try:
                    conn = lst.accept(timeout=2)
                except TransportError as e:
                    print("refused", type(e).__name__, str(e)[:200], flush=True)
                    continue
                poller.register(conn, "conn")
            else:
                serve(obj)
""")


class Server:
    def __init__(self, mode: str) -> None:
        self.url = f"shm://moe-hostile-{uuid.uuid4().hex[:10]}"
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, self.url, mode], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": ROOT})
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        native = mode == "default" and transport.shm.NATIVE_AVAILABLE
        assert self.line(20) == f"ready {native}", self.stderr()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def line(self, timeout: float) -> str:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the server said nothing in {timeout} s; stderr: {self.stderr()}") from None

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return "(running)"
        return self.proc.stderr.read()[-3000:]

    def alive(self) -> None:
        assert self.proc.poll() is None, f"the server died ({self.proc.returncode}): {self.stderr()}"

    def expect_dropped(self, what: str, prefix: str = "dropped ProtocolError") -> str:
        """The next line about a hostile peer (graceful goodbyes of earlier peers skipped)."""
        while True:
            line = self.line(10)
            assert "RELEASE RAISED" not in line, f"{what}: {line}"
            if line.startswith("dropped ConnectionClosed"):
                continue
            assert line.startswith(prefix), f"{what}: {line!r}"
            return line

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)


# the server's fast records through the compiled path (the default where it is built) and
# through the Python one: a hostile peer gets the same treatment from both
@pytest.fixture(scope="module", params=["default", "python"])
def server(request):
    s = Server(request.param)
    good = transport.connect(s.url, **OPTS)
    s.good = good
    yield s
    good.close()
    s.stop()
    assert s.proc.returncode == 0, s.stderr()


def echo(conn, seq: int, n: int = 100, hold: bool = False):
    slot = conn.alloc(n, timeout=5)
    slot.array(np.uint8, n)[:] = seq % 251
    conn.send({"seq": seq}, [slot], timeout=5)
    msg = conn.recv(timeout=5)
    assert msg.header == {"seq": seq} and (np.frombuffer(msg.buffers[0], np.uint8) == seq % 251).all()
    if hold:
        return msg
    msg.release()
    return None


def still_serving(server, what: str) -> None:
    server.alive()
    for seq in range(3):
        echo(server.good, seq)
    server.alive()


def gone(conn, what: str) -> None:
    """The server dropped the hostile connection: it sees its peer gone."""
    with pytest.raises(ConnectionClosed):
        for _ in range(50):
            conn.recv(timeout=0.1).release()
    conn.close()


# -- the segment's size -------------------------------------------------------------------------
def test_a_peer_cannot_resize_its_segment(server, monkeypatch):
    fds = []
    create = shmring.Segment.create

    def spy(layout):
        seg, fd = create(layout)
        fds.append(os.dup(fd))
        return seg, fd

    monkeypatch.setattr(shmring.Segment, "create", spy)
    conn = transport.connect(server.url, **OPTS)
    try:
        echo(conn, 1)
        seals = __import__("fcntl").fcntl(fds[0], __import__("fcntl").F_GET_SEALS)
        assert seals & shmring.SEALS == shmring.SEALS
        for size in (0, 4096, os.fstat(fds[0]).st_size * 2):  # the SIGBUS of issue 11, and growing
            with pytest.raises(PermissionError):
                os.ftruncate(fds[0], size)
        echo(conn, 2)
    finally:
        conn.close()
        for fd in fds:
            os.close(fd)
    still_serving(server, "after resize attempts")


def test_an_unsealed_segment_is_refused_before_it_is_mapped(server, monkeypatch):
    """A peer whose segment carries no seals could truncate it under the server: refused in
    the handshake; truncating it afterwards then hurts nobody."""
    import fcntl as real_fcntl

    class NoSeals:
        def __getattr__(self, name):
            return getattr(real_fcntl, name)

        @staticmethod
        def fcntl(fd, cmd, arg=0):
            if cmd == real_fcntl.F_ADD_SEALS:
                return 0  # "forget" to seal
            return real_fcntl.fcntl(fd, cmd, arg)

    fds = []
    create = shmring.Segment.create

    def spy(layout):
        seg, fd = create(layout)
        fds.append(os.dup(fd))
        return seg, fd

    monkeypatch.setattr(shmring, "fcntl", NoSeals())
    monkeypatch.setattr(shmring.Segment, "create", spy)
    try:  # our side may complete (it got the server's sealed segment) before the refusal
        conn = transport.connect(server.url, **OPTS)
    except TransportError:
        conn = None
    line = server.expect_dropped("an unsealed segment", prefix="refused")
    assert "sealed" in line, line
    if conn is not None:
        gone(conn, "unsealed")  # and closed: we never touch our own segment again
    for fd in fds:
        os.ftruncate(fd, 0)  # would be a SIGBUS in the server had it mapped the segment
        os.close(fd)
    still_serving(server, "after an unsealed segment")


# -- slot returns --------------------------------------------------------------------------------
def test_forged_slot_return_drops_only_that_connection(server):
    conn = transport.connect(server.url, **OPTS)
    conn._give_back.push_one(99)  # a slot the server does not have
    slot = conn.alloc(10, timeout=5)
    conn.send({"seq": 0}, [slot], timeout=5)  # the server's reply alloc takes returns first: it reads the forgery
    server.expect_dropped("a forged slot return")
    gone(conn, "forged return")
    still_serving(server, "after a forged slot return")


def test_repeated_slot_return_drops_only_that_connection(server):
    conn = transport.connect(server.url, **OPTS)
    m = echo(conn, 0, hold=True)
    ids = m._token if isinstance(m._token, list) else [m._token]
    m.release()
    conn._give_back.push(ids)  # the same slot back a second time
    slot = conn.alloc(10, timeout=5)
    conn.send({"seq": 1}, [slot], timeout=5)  # the server takes both returns before its reply's slot
    server.expect_dropped("a repeated slot return")
    gone(conn, "repeated return")
    still_serving(server, "after a repeated slot return")


def test_corrupted_return_ring_is_raised_by_recv_not_by_release(server):
    """The server gives our slots back into the return ring of *our* segment, checking its
    head (which we own). A garbage head makes that give-back fail inside the server's
    Message.release: the server must not see it there, only from that connection's next
    recv/send."""
    conn = transport.connect(server.url, **OPTS)
    for seq in range(4):  # the server has given back 4 of our slots: its tail is at 4
        echo(conn, seq)
    slot = conn.alloc(10, timeout=5)  # drains the returns (our head goes to 4)...
    conn._w[W_RET_HEAD] = 0  # ...and then we claim to have taken none
    conn.send({"seq": 4}, [slot], timeout=5)
    server.expect_dropped("a corrupted return ring head")
    gone(conn, "return ring")
    still_serving(server, "after a corrupted return ring")


# -- ring words --------------------------------------------------------------------------------
@pytest.mark.parametrize("word,where", [(W_OUT_TAIL, "own"), (W_OUT_HEAD, "server")])
def test_garbage_ring_counters_drop_only_that_connection(server, word, where):
    conn = transport.connect(server.url, **OPTS)
    echo(conn, 0)
    words = conn._w if where == "own" else conn._pw
    words[word] = 2**63 + 12345
    if where == "own":
        conn._ring()  # wake the server: it reads our tail
    else:
        slot = conn.alloc(10, timeout=5)
        conn.send({"seq": 1}, [slot], timeout=5)  # its echo must reserve space in its ring
    server.expect_dropped(f"garbage {word} in the {where} segment")
    gone(conn, "ring counter")
    still_serving(server, "after a garbage ring counter")


def test_garbage_doorbell_words_are_harmless(server):
    conn = transport.connect(server.url, **OPTS)
    for words, w in ((conn._w, W_ARMED_DATA), (conn._w, W_ARMED_SPACE), (conn._pw, W_RUNG), (conn._w, W_RUNG),
                     (conn._pw, W_RUNG_AT)):
        words[w] = 2**64 - 1  # words the server reads (or that only we read)
        for seq in range(3):
            echo(conn, seq)
    conn.close()
    still_serving(server, "after garbage doorbell words")


def test_garbage_record_bytes_drop_only_that_connection(server):
    conn = transport.connect(server.url, **OPTS)
    echo(conn, 0)
    ring = conn._out
    pos = ring.reserve(64)
    ring.data[pos:pos + 64] = bytes([0xFF, 0xFF, 0x00, 0x00]) + os.urandom(60)  # a length past the ring
    ring.commit()
    conn._ring()
    server.expect_dropped("garbage in a ring record")
    gone(conn, "garbage record")
    still_serving(server, "after a garbage record")
