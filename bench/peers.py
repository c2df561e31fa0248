"""The mechanisms a user would otherwise pick, and ours, behind one ping/stream interface.

Every implementation runs its server half in a forked child process driven over a control
pipe: ``("ping", size, n)`` echoes n messages of ``size`` bytes, ``("stream", size, n)``
sinks n messages then acknowledges with one small message. The client half is timed in
the parent. Same sizes, same counts, same processes for every implementation.
"""
from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import socket
import tempfile
from typing import Any, Optional

_CTX = mp.get_context("fork")  # the shm floor's anonymous shared mapping must be inherited
CTRL_TIMEOUT = 120.0


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, view.nbytes
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed")
        got += k


class Peer:
    """One implementation: ``start()`` forks the server, ``ping``/``stream`` are timed."""

    impl = "?"
    backend = "?"

    def __init__(self, max_size: int, **options: Any):
        self.max_size = max(max_size, 64)
        self.options = options
        self._proc: Optional[mp.Process] = None

    # server side, in the child ------------------------------------------------------
    def serve_setup(self) -> Any:
        return None

    def serve_connect(self, info: Any) -> None:
        raise NotImplementedError

    def serve_echo(self, size: int, n: int) -> None:
        raise NotImplementedError

    def serve_sink(self, size: int, n: int) -> None:
        raise NotImplementedError

    def _child(self, ctrl) -> None:
        try:
            ctrl.send(("ready", self.serve_setup()))
            while True:
                cmd = ctrl.recv()
                if cmd[0] == "quit":
                    break
                op, size, n = cmd
                if op == "connect":  # size carries the client's connection details
                    self.serve_connect(size)
                else:
                    (self.serve_echo if op == "ping" else self.serve_sink)(size, n)
                ctrl.send(("done", None))
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

    def send_one(self, size: int) -> None:
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

    def command(self, op: str, size: int, n: int) -> None:
        self._ctrl.send((op, size, n))

    def finish(self) -> None:
        self._reply("done")

    def stop(self) -> None:
        if self._proc is not None:
            try:
                self._ctrl.send(("quit", 0, 0))
            except Exception:
                pass
            self._proc.join(5)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)
            self._proc = None
        self.client_close()

    def client_close(self) -> None:
        pass


class MoeTransportPeer(Peer):
    impl = "moe-transport"

    def __init__(self, max_size: int, url: str, nslots: int = 8, **options: Any):
        super().__init__(max_size, **options)
        self.url = url
        self.backend = url.split("://", 1)[0]
        self.nslots = nslots

    def serve_setup(self):
        import transport
        lst = transport.listen(self.url, slot_size=self.max_size, nslots=self.nslots, timeout=60)
        self._ctrl_url = lst.url
        # accept in the loop below, after the parent learned the URL
        self._listener = lst
        return lst.url

    def _server_conn(self):
        if not hasattr(self, "_sconn"):
            self._sconn = self._listener.accept(timeout=60)
        return self._sconn

    def serve_echo(self, size, n):
        c = self._server_conn()
        for _ in range(n):
            c.recv().release()
            c.send({}, [c.alloc(size)])

    def serve_sink(self, size, n):
        c = self._server_conn()
        for _ in range(n):
            c.recv().release()
        c.send({}, [c.alloc(0)])

    def client_setup(self, url):
        import threading
        import transport
        box: dict = {}
        # the server accepts lazily on its first command: connect while it does
        t = threading.Thread(target=lambda: box.update(c=transport.connect(url, slot_size=self.max_size, nslots=self.nslots, timeout=60)))
        t.start()
        self._ctrl.send(("ping", 0, 0))
        t.join(60)
        self.conn = box["c"]
        self._reply("done")

    def ping(self, size):
        c = self.conn
        c.send({}, [c.alloc(size)])
        c.recv().release()

    def send_one(self, size):
        c = self.conn
        c.send({}, [c.alloc(size)])

    def wait_ack(self):
        self.conn.recv().release()

    def client_close(self):
        if hasattr(self, "conn"):
            self.conn.close()


class RawTcpPeer(Peer):
    """A plain socket with TCP_NODELAY; recv_into a preallocated buffer."""

    impl, backend = "raw", "tcp"

    def prepare(self):
        self._lsock = socket.create_server(("127.0.0.1", 0))

    def serve_setup(self):
        self._buf = memoryview(bytearray(self.max_size))
        return self._lsock.getsockname()[1]

    def _s(self):
        if not hasattr(self, "_sock"):
            self._sock, _ = self._lsock.accept()
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self._sock

    def serve_echo(self, size, n):
        s, v = self._s(), self._buf[:size]
        for _ in range(n):
            _recv_exact(s, v)
            s.sendall(v)

    def serve_sink(self, size, n):
        s = self._s()
        left = size * n
        while left:
            k = s.recv_into(self._buf, min(left, self.max_size))
            if k == 0:
                raise ConnectionError("peer closed")
            left -= k
        s.sendall(b"k")

    def client_setup(self, port):
        self._lsock.close()
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = memoryview(bytearray(self.max_size))

    def ping(self, size):
        v = self.buf[:size]
        self.sock.sendall(v)
        _recv_exact(self.sock, v)

    def send_one(self, size):
        self.sock.sendall(self.buf[:size])

    def wait_ack(self):
        _recv_exact(self.sock, self.buf[:1])

    def client_close(self):
        if hasattr(self, "sock"):
            self.sock.close()


class PipePeer(Peer):
    impl, backend = "pipe", "pipe"

    def prepare(self):
        self.conn, self._child_conn = _CTX.Pipe()

    def serve_setup(self):
        self._buf = bytearray(self.max_size)
        return None

    def serve_echo(self, size, n):
        c, b = self._child_conn, self._buf
        for _ in range(n):
            k = c.recv_bytes_into(b)
            c.send_bytes(b, 0, k)

    def serve_sink(self, size, n):
        for _ in range(n):
            self._child_conn.recv_bytes_into(self._buf)
        self._child_conn.send_bytes(b"k")

    def client_setup(self, _):
        self.buf = bytearray(self.max_size)

    def ping(self, size):
        self.conn.send_bytes(self.buf, 0, size)
        self.conn.recv_bytes_into(self.buf)

    def send_one(self, size):
        self.conn.send_bytes(self.buf, 0, size)

    def wait_ack(self):
        self.conn.recv_bytes_into(self.buf)


class ZmqPeer(Peer):
    """pyzmq PAIR over ipc:// with copy=False on both sides."""

    impl, backend = "pyzmq", "ipc"

    def prepare(self):
        self.path = os.path.join(tempfile.gettempdir(), f"moe-bench-zmq-{os.getpid()}-{id(self)}.sock")

    def serve_setup(self):
        import zmq
        self._zctx = zmq.Context()
        self._zs = self._zctx.socket(zmq.PAIR)
        self._zs.bind(f"ipc://{self.path}")
        return None

    def serve_echo(self, size, n):
        s = self._zs
        for _ in range(n):
            s.send(s.recv(copy=False), copy=False)

    def serve_sink(self, size, n):
        for _ in range(n):
            self._zs.recv(copy=False)
        self._zs.send(b"k")

    def client_setup(self, _):
        import zmq
        self.zctx = zmq.Context()
        self.zs = self.zctx.socket(zmq.PAIR)
        self.zs.connect(f"ipc://{self.path}")
        self.buf = memoryview(bytearray(self.max_size))

    def ping(self, size):
        self.zs.send(self.buf[:size], copy=False)
        self.zs.recv(copy=False)

    def send_one(self, size):
        self.zs.send(self.buf[:size], copy=False)

    def wait_ack(self):
        self.zs.recv(copy=False)

    def client_close(self):
        if hasattr(self, "zs"):
            self.zs.close(linger=0)
            self.zctx.term()
        try:
            os.unlink(self.path)
        except OSError:
            pass


class ShmFloorPeer(Peer):
    """The bare shared-memory floor: a slot index through a busy-polled ring, no framing,
    no payload touched. Nothing built on shared memory in Python can beat it."""

    impl, backend = "raw", "shm"
    RING = 8

    def prepare(self):
        self._map = mmap.mmap(-1, 4096)  # MAP_SHARED|MAP_ANONYMOUS: inherited by the fork
        self.words = memoryview(self._map).cast("Q")  # 0: head (client), 1: tail (server)

    def serve_setup(self):
        return None

    def serve_echo(self, size, n):
        w = self.words
        for _ in range(n):
            want = w[1] + 1
            while w[0] < want:
                pass
            w[1] = want

    def serve_sink(self, size, n):
        w = self.words
        for _ in range(n):
            want = w[1] + 1
            while w[0] < want:
                pass
            w[1] = want
        w[2] = w[2] + 1  # the ack

    def client_setup(self, _):
        self.acks = self.words[2]

    def ping(self, size):
        w = self.words
        want = w[0] + 1
        w[0] = want
        while w[1] < want:
            pass

    def send_one(self, size):
        w = self.words
        while w[0] - w[1] >= self.RING:  # ring full: wait for the consumer
            pass
        w[0] = w[0] + 1

    def wait_ack(self):
        w = self.words
        while w[2] == self.acks:
            pass
        self.acks = w[2]

    def client_close(self):
        self.words.release()
        self._map.close()


class RdmaFloorPeer(Peer):
    """The bare pyverbs floor: SENDs between two RC QPs driven from Python, busy-polled
    CQs, one work request built once, no framing, no header, a minimal credit window.
    Nothing in Python over pyverbs can beat it; perftest (C, same device) shows what the
    device itself does, so ours/raw is the protocol's cost and raw/perftest Python's."""

    impl, backend = "raw", "rdma"
    NRECV = 16  # receives posted: the sender's window
    ACK_EVERY = NRECV // 2

    def _open(self) -> dict:
        import numpy as np
        from transport.rdma_device import pick_device
        from transport.rdma_verbs import E, Verbs
        v = Verbs(pick_device(), nrecv=self.NRECV, sq_depth=2 * self.NRECV)
        try:
            stride = self.max_size
            buf = np.zeros(stride * (self.NRECV + 1), np.uint8)  # receives, then the send buffer
            mr = v.register(buf.ctypes.data, buf.nbytes, E.IBV_ACCESS_LOCAL_WRITE)
            v.to_init()
            base = buf.ctypes.data
            self._rwrs = [v.recv_wr(i, base + i * stride, stride, mr.lkey) for i in range(self.NRECV)]
            for wr in self._rwrs:
                v.qp.post_recv(wr)
            wr, sge = v.send_wr()
            sge.addr, sge.lkey = base + self.NRECV * stride, mr.lkey
            wr.opcode, wr.send_flags = E.IBV_WR_SEND, E.IBV_SEND_SIGNALED
        except BaseException:
            v.close()
            raise
        self._v, self._buf, self._wr, self._sge = v, buf, wr, sge
        self._qp, self._rcq, self._scq = v.qp, v.recv_cq, v.send_cq
        return {"gid": v.gid, "qpn": v.qpn, "mtu": v.active_mtu}

    def _connect(self, peer: dict) -> None:
        # rnr_retry 7 (forever): a receive not re-posted yet is waited for, never an error
        self._v.to_rts(dest_qpn=peer["qpn"], dest_psn=0, dgid=peer["gid"],
                       mtu=min(self._v.active_mtu, peer["mtu"]), sq_psn=0, rnr_retry=7)

    def _send(self, size: int) -> None:
        self._sge.length = size
        self._qp.post_send(self._wr)
        scq = self._scq
        while True:
            n, wcs = scq.poll(1)
            if n:
                if wcs[0].status:
                    raise ConnectionError(f"send failed: status {wcs[0].status}")
                return

    def _recv(self) -> None:
        rcq = self._rcq
        while True:
            n, wcs = rcq.poll(1)
            if n:
                wc = wcs[0]
                if wc.status:
                    raise ConnectionError(f"receive failed: status {wc.status}")
                self._qp.post_recv(self._rwrs[wc.wr_id])
                return

    # server (child)
    def serve_setup(self):
        return self._open()

    def serve_connect(self, info):
        self._connect(info)

    def serve_echo(self, size, n):
        for _ in range(n):
            self._recv()
            self._send(size)

    def serve_sink(self, size, n):
        for i in range(1, n + 1):
            self._recv()
            if i % self.ACK_EVERY == 0 or i == n:
                self._send(0)  # credits back (the last one is the stream's ack)

    # client (parent)
    def client_setup(self, info):
        mine = self._open()
        self._connect(info)
        self._ctrl.send(("connect", mine, 0))
        self._reply("done")

    def ping(self, size):
        self._send(size)
        self._recv()

    def command(self, op, size, n):
        super().command(op, size, n)
        self._credits, self._n, self._acks = self.NRECV, n, 0

    def send_one(self, size):
        if self._credits == 0:  # the sink re-posted ACK_EVERY receives and said so
            self._recv()
            self._acks += 1
            self._credits += self.ACK_EVERY
        self._send(size)
        self._credits -= 1

    def wait_ack(self):
        for _ in range(-(-self._n // self.ACK_EVERY) - self._acks):  # the sink acks ceil(n / ACK_EVERY) times
            self._recv()

    def client_close(self):
        if hasattr(self, "_v"):
            self._v.close()
