"""The mechanisms a user would otherwise pick, and ours, behind one ping/stream interface.

Every implementation runs its server half in a forked child process driven over a control
pipe: ``("ping", size, n, data)`` echoes n messages of ``size`` bytes, ``("stream", size,
n, data)`` sinks n messages then acknowledges with one small message. The client half is
timed in the parent. Same sizes, same counts, same processes for every implementation.

Two figures (``data``):

- descriptor (``data=False``): a message is passed and its payload never touched (on shared
  memory this is a slot index whatever the size);
- data (``data=True``): the sender writes every payload byte before sending, the receiver
  reads (and checks) every payload byte on receipt, both ways of a round trip, with the
  same functions (:mod:`bench.payload`) for every implementation.

``max_message`` is the largest message an implementation carries (None: no limit); the
benchmark reports a larger size as not carried instead of sending it. The shm and rdma
floors (the bare slot handoff, the bare pyverbs loop) are in bench/floors.py.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import struct
import tempfile
from typing import Any, Optional

from . import payload as PL

_CTX = mp.get_context("fork")  # the shm floor's anonymous shared mapping must be inherited
CTRL_TIMEOUT = 120.0


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    """``view`` filled from ``sock``: one MSG_WAITALL read, more only if a signal cut it."""
    got, n = 0, view.nbytes
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise ConnectionError("peer closed")
        got += k


def _raw_socket(sock: socket.socket) -> socket.socket:
    """A raw socket tuned as well as ours: TCP_NODELAY, the socket options moe-transport's tcp
    sets (transport.stream.tune_socket: no pacing to a peer on this machine), blocking with
    the kernel's timeouts (a socket timeout would poll before every call)."""
    from transport.stream import peer_is_here, tune_socket
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    tune_socket(sock, peer_is_here(sock))
    sock.settimeout(None)
    t = struct.pack("ll", int(CTRL_TIMEOUT), 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, t)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, t)
    return sock


def _check_echo(got: int, sent: int) -> None:
    if got != PL.next_byte(sent):
        raise AssertionError(f"the echo carried the value {got}, expected {PL.next_byte(sent)}: stale data")


class Peer:
    """One implementation: ``start()`` forks the server, ``ping``/``stream`` are timed."""

    impl = "?"
    backend = "?"
    label = "?"  # how the report names it
    #: whether a message's bytes travel at all in the descriptor figure (a socket's kernel
    #: copies them; a shared-memory slot index carries none): if not, no bandwidth is claimed
    descriptor_moves_bytes = True

    def __init__(self, max_size: int, *, server_cpu: Optional[int] = None, **options: Any):
        self.max_size = max(max_size, 64)
        self.server_cpu = server_cpu
        self.options = options
        self.max_message: Optional[int] = None
        self._proc: Optional[mp.Process] = None
        self._value = 0  # the data figure's counter byte (client side)

    def carries(self, size: int) -> bool:
        return self.max_message is None or size <= self.max_message

    # server side, in the child ------------------------------------------------------
    def serve_setup(self) -> Any:
        return None

    def serve_connect(self, info: Any) -> Any:
        raise NotImplementedError

    def serve_echo(self, size: int, n: int, data: bool) -> None:
        raise NotImplementedError

    def serve_sink(self, size: int, n: int, data: bool) -> None:
        raise NotImplementedError

    #: environment the server side runs with (e.g. another RDMA device: ``--server-device``)
    server_env: dict = {}

    def _child(self, ctrl) -> None:
        try:
            os.environ.update(self.server_env)
            if self.server_cpu is not None:
                os.sched_setaffinity(0, {self.server_cpu})
            ctrl.send(("ready", self.serve_setup()))
            while True:
                cmd = ctrl.recv()
                if cmd[0] == "quit":
                    break
                op, size, n, data = cmd
                if op == "connect":  # size carries the client's connection details
                    val = self.serve_connect(size)
                elif op == "ping":
                    val = self.serve_echo(size, n, data)
                else:
                    val = self.serve_sink(size, n, data)
                ctrl.send(("done", val))
        except Exception as e:  # surfaced to the parent instead of a silent hang
            try:
                ctrl.send(("error", f"{type(e).__name__}: {e}"))
            except Exception:
                pass
        finally:
            os._exit(0)

    # client side, in the parent -----------------------------------------------------
    def client_setup(self, server_info: Any) -> None:
        pass

    def ping(self, size: int) -> None:
        raise NotImplementedError

    def ping_data(self, size: int) -> None:
        raise NotImplementedError

    def send_one(self, size: int) -> None:
        raise NotImplementedError

    def send_one_data(self, size: int) -> None:
        raise NotImplementedError

    def wait_ack(self) -> None:
        raise NotImplementedError

    def prepare(self) -> None:
        """Parent-side set-up that the child must inherit (runs before fork)."""

    def start(self) -> "Peer":
        self.prepare()
        self._ctrl, child = _CTX.Pipe()
        self._proc = _CTX.Process(target=self._child, args=(child,), daemon=True)
        self._proc.start()
        child.close()
        self.client_setup(self._reply("ready"))
        return self

    def _reply(self, want: str) -> Any:
        if not self._ctrl.poll(CTRL_TIMEOUT):
            raise TimeoutError(f"{self.impl}/{self.backend} server did not answer")
        tag, val = self._ctrl.recv()
        if tag == "error":
            raise RuntimeError(f"{self.impl}/{self.backend} server failed: {val}")
        assert tag == want, (tag, want)
        return val

    def command(self, op: str, size: Any, n: int, data: bool = False) -> None:
        self._ctrl.send((op, size, n, data))

    def finish(self) -> Any:
        return self._reply("done")

    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def stop(self) -> None:
        """Stop the server (an idle one quits; one stuck mid-command, after a failure or an
        interrupt, sees its client close or is killed) and close the client. Idempotent."""
        if not getattr(self, "_closed", False):
            self._closed = True
            try:
                self.client_close()
            except Exception:
                pass
        if self._proc is not None:
            try:
                self._ctrl.send(("quit", 0, 0, False))
            except Exception:
                pass
            self._proc.join(3)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)
            self._proc = None
            self._ctrl.close()

    def client_close(self) -> None:
        pass


class MoeTransportPeer(Peer):
    impl = "moe-transport"
    label = "moe-transport"

    def __init__(self, max_size: int, url: str, nslots: int = 8, slot_size: Optional[int] = None,
                 native: Optional[bool] = None, **options: Any):
        super().__init__(max_size, **options)
        self.url = url
        self.backend = url.split("://", 1)[0]
        # native=False is the Python path of the common message, a row of its own beside the
        # compiled one (transport/_shmfast.c, _rdmafast.c, _tcpfast.c), so the gain is a ratio
        # of one run
        self._conn_opts = {} if native is None else {"native": native}
        if native is False:
            self.impl, self.label = "moe-transport-py", "moe-transport, Python"
        self.descriptor_moves_bytes = self.backend != "shm"  # shm passes the slot, never its bytes
        self.nslots = nslots
        self.slot_size = slot_size or self.max_size

    def serve_setup(self):
        import transport
        self._listener = transport.listen(self.url, slot_size=self.slot_size, nslots=self.nslots, timeout=60,
                                          **self._conn_opts)
        return self._listener.url

    def serve_connect(self, _):
        """Accept the client (it connects while this waits); the largest message we may send."""
        self._sconn = self._listener.accept(timeout=60)
        return self._sconn.max_message

    def serve_echo(self, size, n, data):
        c = self._sconn
        if not data:
            for _ in range(n):
                c.recv().release()
                c.send({}, [c.alloc(size)])
            return
        for _ in range(n):
            m = c.recv()
            v = PL.verify(m.buffers[0] if m.buffers else b"", size)
            m.release()
            s = c.alloc(size)
            PL.fill(s.buf, PL.next_byte(v))
            c.send({}, [s])

    def serve_sink(self, size, n, data):
        c = self._sconn
        for _ in range(n):
            m = c.recv()
            if data:
                PL.verify(m.buffers[0] if m.buffers else b"", size)
            m.release()
        c.send({}, [c.alloc(0)])

    def client_setup(self, url):
        import threading
        import transport
        box: dict = {}

        def connect():
            try:
                box["c"] = transport.connect(url, slot_size=self.slot_size, nslots=self.nslots, timeout=60,
                                             **self._conn_opts)
            except BaseException as e:  # reported below, after the server's answer
                box["e"] = e
        # the server accepts on its "connect" command: connect while it does
        t = threading.Thread(target=connect)
        t.start()
        self.command("connect", None, 0)
        t.join(60)
        if "e" in box:
            raise box["e"]
        self.conn = box["c"]
        server_max = self._reply("done")
        self.max_message = min(self.conn.max_message, server_max)

    def ping(self, size):
        c = self.conn
        c.send({}, [c.alloc(size)])
        c.recv().release()

    def ping_data(self, size):
        c = self.conn
        self._value = v = PL.next_byte(self._value)
        s = c.alloc(size)
        PL.fill(s.buf, v)
        c.send({}, [s])
        m = c.recv()
        try:
            if size:
                _check_echo(PL.verify(m.buffers[0], size), v)
        finally:
            m.release()

    def send_one(self, size):
        c = self.conn
        c.send({}, [c.alloc(size)])

    def send_one_data(self, size):
        c = self.conn
        self._value = v = PL.next_byte(self._value)
        s = c.alloc(size)
        PL.fill(s.buf, v)
        c.send({}, [s])

    def wait_ack(self):
        self.conn.recv().release()

    def client_close(self):
        if hasattr(self, "conn"):
            self.conn.close()


class RawTcpPeer(Peer):
    """A plain socket, the best a Python program does with one (:func:`_raw_socket`): one
    ``sendall`` and one ``recv_into(MSG_WAITALL)`` per message, into a preallocated buffer."""

    impl, backend, label = "raw", "tcp", "raw socket"

    def prepare(self):
        self._lsock = socket.create_server(("127.0.0.1", 0))

    def serve_setup(self):
        self._buf = memoryview(bytearray(self.max_size))
        return self._lsock.getsockname()[1]

    def _s(self):
        if not hasattr(self, "_sock"):
            sock, _ = self._lsock.accept()
            self._sock = _raw_socket(sock)
        return self._sock

    def serve_echo(self, size, n, data):
        s, v = self._s(), self._buf[:size]
        for _ in range(n):
            _recv_exact(s, v)
            if data and size:
                PL.fill(v, PL.next_byte(PL.verify(v, size)))
            s.sendall(v)

    def serve_sink(self, size, n, data):
        s = self._s()
        if data:  # message by message: each one read and checked whole
            v = self._buf[:size]
            for _ in range(n):
                _recv_exact(s, v)
                if size:
                    PL.verify(v, size)
        else:
            left = size * n
            while left:
                k = min(left, self.max_size)
                _recv_exact(s, self._buf[:k])
                left -= k
        s.sendall(b"k")

    def client_setup(self, port):
        self._lsock.close()
        self.sock = _raw_socket(socket.create_connection(("127.0.0.1", port), timeout=60))
        self.buf = memoryview(bytearray(self.max_size))

    def ping(self, size):
        v = self.buf[:size]
        self.sock.sendall(v)
        _recv_exact(self.sock, v)

    def ping_data(self, size):
        v = self.buf[:size]
        self._value = b = PL.next_byte(self._value)
        PL.fill(v, b)
        self.sock.sendall(v)
        _recv_exact(self.sock, v)
        if size:
            _check_echo(PL.verify(v, size), b)

    def send_one(self, size):
        self.sock.sendall(self.buf[:size])

    def send_one_data(self, size):
        v = self.buf[:size]
        self._value = b = PL.next_byte(self._value)
        PL.fill(v, b)
        self.sock.sendall(v)

    def wait_ack(self):
        _recv_exact(self.sock, self.buf[:1])

    def client_close(self):
        if hasattr(self, "sock"):
            self.sock.close()


class PipePeer(Peer):
    impl, backend, label = "pipe", "pipe", "multiprocessing.Pipe"

    def prepare(self):
        self.conn, self._child_conn = _CTX.Pipe()

    def serve_setup(self):
        self._buf = bytearray(max(self.max_size, 1))
        return None

    def serve_echo(self, size, n, data):
        c, b = self._child_conn, self._buf
        v = memoryview(b)
        for _ in range(n):
            k = c.recv_bytes_into(b)
            if data and size:
                PL.fill(v[:k], PL.next_byte(PL.verify(v[:k], size)))
            c.send_bytes(b, 0, k)

    def serve_sink(self, size, n, data):
        c, b = self._child_conn, self._buf
        v = memoryview(b)
        for _ in range(n):
            k = c.recv_bytes_into(b)
            if data and size:
                PL.verify(v[:k], size)
        c.send_bytes(b"k")

    def client_setup(self, _):
        self.buf = bytearray(max(self.max_size, 1))
        self.view = memoryview(self.buf)

    def ping(self, size):
        self.conn.send_bytes(self.buf, 0, size)
        self.conn.recv_bytes_into(self.buf)

    def ping_data(self, size):
        self._value = b = PL.next_byte(self._value)
        PL.fill(self.view[:size], b)
        self.conn.send_bytes(self.buf, 0, size)
        k = self.conn.recv_bytes_into(self.buf)
        if size:
            _check_echo(PL.verify(self.view[:k], size), b)

    def send_one(self, size):
        self.conn.send_bytes(self.buf, 0, size)

    def send_one_data(self, size):
        self._value = b = PL.next_byte(self._value)
        PL.fill(self.view[:size], b)
        self.conn.send_bytes(self.buf, 0, size)

    def wait_ack(self):
        self.conn.recv_bytes_into(self.buf)


class ZmqPeer(Peer):
    """pyzmq PAIR over ``ipc://`` or ``tcp://`` (loopback), copy=False on both sides.

    Streaming in the data figure sends with copy=True: a zero-copy send keeps a reference
    to the buffer until zmq's I/O thread has sent it, so refilling one buffer while earlier
    sends are in flight would corrupt them (a ping-pong is safe: the reply proves receipt)."""

    impl = "pyzmq"

    def __init__(self, max_size: int, transport: str = "ipc", **options: Any):
        super().__init__(max_size, **options)
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"pyzmq peer over {transport!r}: ipc or tcp")
        self.backend = transport
        self.label = f"pyzmq {transport}"

    def prepare(self):
        if self.backend == "ipc":
            self.path = os.path.join(tempfile.gettempdir(), f"moe-bench-zmq-{os.getpid()}-{id(self)}.sock")

    def serve_setup(self):
        import zmq
        self._zctx = zmq.Context()
        self._zs = self._zctx.socket(zmq.PAIR)
        if self.backend == "ipc":
            self._zs.bind(f"ipc://{self.path}")
            return None
        port = self._zs.bind_to_random_port("tcp://127.0.0.1")
        return port

    def serve_echo(self, size, n, data):
        s = self._zs
        if not data:
            for _ in range(n):
                s.send(s.recv(copy=False), copy=False)
            return
        buf = memoryview(bytearray(max(self.max_size, 1)))
        for _ in range(n):
            f = s.recv(copy=False)
            v = PL.verify(f.buffer, size) if size else 0
            out = buf[:size]
            if size:
                PL.fill(out, PL.next_byte(v))
            s.send(out, copy=False)

    def serve_sink(self, size, n, data):
        for _ in range(n):
            f = self._zs.recv(copy=False)
            if data and size:
                PL.verify(f.buffer, size)
        self._zs.send(b"k")

    def client_setup(self, port):
        import zmq
        self.zctx = zmq.Context()
        self.zs = self.zctx.socket(zmq.PAIR)
        self.zs.connect(f"ipc://{self.path}" if self.backend == "ipc" else f"tcp://127.0.0.1:{port}")
        self.buf = memoryview(bytearray(max(self.max_size, 1)))

    def ping(self, size):
        self.zs.send(self.buf[:size], copy=False)
        self.zs.recv(copy=False)

    def ping_data(self, size):
        v = self.buf[:size]
        self._value = b = PL.next_byte(self._value)
        PL.fill(v, b)
        self.zs.send(v, copy=False)
        f = self.zs.recv(copy=False)
        if size:
            _check_echo(PL.verify(f.buffer, size), b)

    def send_one(self, size):
        self.zs.send(self.buf[:size], copy=False)

    def send_one_data(self, size):
        v = self.buf[:size]
        self._value = b = PL.next_byte(self._value)
        PL.fill(v, b)
        self.zs.send(v, copy=True)

    def wait_ack(self):
        self.zs.recv(copy=False)

    def client_close(self):
        if hasattr(self, "zs"):
            self.zs.close(linger=0)
            self.zctx.term()
        if self.backend == "ipc":
            try:
                os.unlink(self.path)
            except OSError:
                pass
