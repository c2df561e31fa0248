"""The floors of moe-bench transport's shm and rdma tables: the bare shared-memory slot handoff
and the bare pyverbs loop, behind bench.peers' ping/stream interface (nothing built on
shared memory, or on pyverbs, in Python goes faster)."""
from __future__ import annotations

import mmap

from . import payload as PL
from .peers import Peer, _check_echo


class ShmFloorPeer(Peer):
    """The bare shared-memory floor: a slot index through a busy-polled ring, no framing,
    no header. Nothing built on shared memory in Python can beat it.

    Descriptor figure: the slot index alone, no payload touched. Data figure: the client
    writes slot ``head % RING`` of the shared mapping, the server reads it (and, echoing,
    writes the reply area, which the client reads)."""

    impl, backend, label = "raw", "shm", "bare slot handoff"
    descriptor_moves_bytes = False
    RING = 8
    CTRL = 4096

    def prepare(self):
        # MAP_SHARED|MAP_ANONYMOUS, inherited by the fork; pages are only allocated when
        # touched, so the descriptor figure costs no memory
        self._map = mmap.mmap(-1, self.CTRL + (self.RING + 1) * self.max_size)
        self.words = memoryview(self._map)[:64].cast("Q")  # 0: head (client), 1: tail (server), 2: acks
        mem = memoryview(self._map)
        self.slots = [mem[self.CTRL + i * self.max_size: self.CTRL + (i + 1) * self.max_size]
                      for i in range(self.RING)]
        self.reply = mem[self.CTRL + self.RING * self.max_size:]

    def serve_setup(self):
        return None

    def serve_echo(self, size, n, data):
        w = self.words
        for _ in range(n):
            want = w[1] + 1
            while w[0] < want:
                pass
            if data and size:
                v = PL.verify(self.slots[(want - 1) % self.RING][:size], size)
                PL.fill(self.reply[:size], PL.next_byte(v))
            w[1] = want

    def serve_sink(self, size, n, data):
        w = self.words
        for _ in range(n):
            want = w[1] + 1
            while w[0] < want:
                pass
            if data and size:
                PL.verify(self.slots[(want - 1) % self.RING][:size], size)
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

    def ping_data(self, size):
        w = self.words
        want = w[0] + 1
        self._value = b = PL.next_byte(self._value)
        if size:
            PL.fill(self.slots[(want - 1) % self.RING][:size], b)
        w[0] = want
        while w[1] < want:
            pass
        if size:
            _check_echo(PL.verify(self.reply[:size], size), b)

    def send_one(self, size):
        w = self.words
        while w[0] - w[1] >= self.RING:  # ring full: wait for the consumer
            pass
        w[0] = w[0] + 1

    def send_one_data(self, size):
        w = self.words
        while w[0] - w[1] >= self.RING:
            pass
        head = w[0]
        self._value = b = PL.next_byte(self._value)
        if size:
            PL.fill(self.slots[head % self.RING][:size], b)
        w[0] = head + 1

    def wait_ack(self):
        w = self.words
        while w[2] == self.acks:
            pass
        self.acks = w[2]

    def client_close(self):
        self.words.release()
        for s in self.slots:
            s.release()
        self.reply.release()
        self._map.close()


class RdmaFloorPeer(Peer):
    """The bare pyverbs floor: SENDs between two RC QPs driven from Python, busy-polled
    CQs, one work request built once, no framing, no header, a minimal credit window.
    Nothing in Python over pyverbs can beat it; perftest (C, same device) shows what the
    device itself does, so ours/raw is the protocol's cost and raw/perftest Python's.
    Data figure: the send buffer is written before each SEND and a receive buffer read
    before its receive is posted again."""

    impl, backend, label = "raw", "rdma", "bare pyverbs loop"
    NRECV = 16  # receives posted: the sender's window
    ACK_EVERY = NRECV // 2

    def _open(self) -> dict:
        import numpy as np
        from transport.rdma_verbs import require_pyverbs
        require_pyverbs()  # the install hint, not "cannot import name 'E'"
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
        self._stride = stride
        self._sendbuf = memoryview(buf[self.NRECV * stride:])
        self._qp, self._rcq, self._scq = v.qp, v.recv_cq, v.send_cq
        return {"gid": v.gid, "qpn": v.qpn, "mtu": v.active_mtu, "max_msg": v.max_msg}

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

    def _recv(self, size: int = -1) -> int:
        """Wait for one receive; with ``size`` >= 0 read (verify) its payload before the
        buffer is posted again. Returns the payload's value (data) or 0."""
        rcq = self._rcq
        while True:
            n, wcs = rcq.poll(1)
            if n:
                wc = wcs[0]
                if wc.status:
                    raise ConnectionError(f"receive failed: status {wc.status}")
                v = 0
                if size > 0:
                    off = wc.wr_id * self._stride
                    v = PL.verify(memoryview(self._buf[off:off + wc.byte_len]), size)
                self._qp.post_recv(self._rwrs[wc.wr_id])
                return v

    # server (child)
    def serve_setup(self):
        return self._open()

    def serve_connect(self, info):
        self._connect(info)

    def serve_echo(self, size, n, data):
        for _ in range(n):
            if data:
                v = self._recv(size)
                if size:
                    PL.fill(self._sendbuf[:size], PL.next_byte(v))
            else:
                self._recv()
            self._send(size)

    def serve_sink(self, size, n, data):
        for i in range(1, n + 1):
            self._recv(size if data else -1)
            if i % self.ACK_EVERY == 0 or i == n:
                self._send(0)  # credits back (the last one is the stream's ack)

    # client (parent)
    def client_setup(self, info):
        mine = self._open()
        self._connect(info)
        self.command("connect", mine, 0)
        self._reply("done")
        self.max_message = min(mine["max_msg"], info["max_msg"], self.max_size)

    def ping(self, size):
        self._send(size)
        self._recv()

    def ping_data(self, size):
        self._value = b = PL.next_byte(self._value)
        if size:
            PL.fill(self._sendbuf[:size], b)
        self._send(size)
        got = self._recv(size)
        if size:
            _check_echo(got, b)

    def command(self, op, size, n, data=False):
        super().command(op, size, n, data)
        self._credits, self._n, self._acks = self.NRECV, n, 0

    def send_one(self, size):
        if self._credits == 0:  # the sink re-posted ACK_EVERY receives and said so
            self._recv()
            self._acks += 1
            self._credits += self.ACK_EVERY
        self._send(size)
        self._credits -= 1

    def send_one_data(self, size):
        self._value = b = PL.next_byte(self._value)
        if self._credits == 0:
            self._recv()
            self._acks += 1
            self._credits += self.ACK_EVERY
        if size:
            PL.fill(self._sendbuf[:size], b)
        self._send(size)
        self._credits -= 1

    def wait_ack(self):
        for _ in range(-(-self._n // self.ACK_EVERY) - self._acks):  # the sink acks ceil(n / ACK_EVERY) times
            self._recv()

    def client_close(self):
        if hasattr(self, "_v"):
            self._v.close()
