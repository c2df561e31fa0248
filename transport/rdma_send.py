"""rdma://'s send side in Python: staging, posting a message's work requests, the send
completions, and the bounded waits for a slot or send queue room.

A mixin of :class:`transport.rdma_conn.RdmaConnection` (its state is the connection's; the
message path is described there). The compiled path hands these methods every message it
does not take itself.
"""
from __future__ import annotations

import socket
from typing import Any, Optional, Sequence

from . import framing
from .base import Deadline
from .errors import Timeout
from .framing import MAX_HEADER, PREFIX, PREFIX_SIZE
from .pool import Slot, round_up
from .rdma_pools import RoomSlot as _RoomSlot
from .rdma_verbs import E, PyverbsError, wc_status_name

__all__ = ["RdmaSendPath"]

_MAGIC, _VERSION, _DATA = framing.MAGIC, framing.VERSION, framing.DATA


class RdmaSendPath:
    def _alloc_py(self, nbytes: int, timeout: Optional[float] = None) -> Slot:
        if self._state:
            raise self._closed_error()
        if not 0 <= nbytes <= self.max_message:
            raise ValueError(f"{nbytes} bytes exceed the peer's largest message ({self.max_message})")
        slot = self.send_pool.try_alloc()
        if slot is None:
            slot = self._wait_slot(Deadline(timeout, self.default_timeout))
            if self._fd_used:
                self._quiesce()
        return slot.resize(nbytes)

    def _send_py(self, header: Any, buffers: Sequence = (), timeout: Optional[float] = None) -> None:
        pool = self.send_pool if not self._torn else None
        own: list = []  # our send slots: they belong to the transport from here on
        try:
            segs, lens, total = self._segments(buffers, pool, own)
            if self._state:
                raise self._closed_error()
            if total > self.max_message:
                raise ValueError(f"message of {total} bytes exceeds the peer's limit of {self.max_message}")
            head = framing.encode_header(header, lens)  # TypeError before anything is sent
            if len(head) > MAX_HEADER:
                raise ValueError(f"header of {len(head)} bytes exceeds the limit of {MAX_HEADER}")
            deadline = None
            if self._c.tx_credits <= 0:
                deadline = Deadline(timeout, self.default_timeout)
                self._stats.credit_stalls += 1
                while self._c.tx_credits <= 0:
                    if self._state:
                        raise self._closed_error()
                    self._wait(deadline, "waiting for credits")
            if segs and segs[-1] is None:  # unregistered buffers: one copy into one slot
                deadline = deadline or Deadline(timeout, self.default_timeout)
                segs = self._stage(buffers, segs, own, deadline)
            self._post_data(header, head, lens, segs, total, own, timeout, deadline)
            own = []
        finally:
            for s in own:
                s.release()
        if self._fd_used:
            self._quiesce()

    def _segments(self, buffers: Sequence, pool, own: list):
        """The message's non-empty segments in order: (addr, len) for our slots, None for
        buffers still to be staged; the header's buffer lengths; the total."""
        if len(buffers) > framing.MAX_BUFFERS:
            for b in buffers:
                if isinstance(b, _RoomSlot) and b.pool is pool:
                    own.append(b)
            raise ValueError(f"{len(buffers)} buffers exceed the limit of {framing.MAX_BUFFERS}")
        segs: list = []
        lens: list = []
        total = 0
        staged = False
        for b in buffers:
            if type(b) is _RoomSlot and b.pool is pool:
                if b in own:
                    raise ValueError("the same slot appears twice in one message")
                own.append(b)
                n = b.nbytes
                if n:
                    segs.append((pool.address + b.offset, n))
            else:
                n = memoryview(b).nbytes
                if n:
                    segs.append(None)
                    staged = True
            lens.append(n)
            total += n
        if staged:
            segs.append(None)  # marker: _stage() must run
        return segs, lens, total

    def _stage(self, buffers: Sequence, segs: list, own: list, deadline: Deadline) -> list:
        slot = self._wait_slot(deadline)
        own.append(slot)
        pool = self.send_pool
        base = pool.address + slot.offset
        mem = slot.whole
        out, off, i = [], 0, 0
        for b in buffers:
            if type(b) is _RoomSlot and b.pool is pool:
                if b.nbytes:
                    out.append(segs[i])
                    i += 1
                continue
            mv = memoryview(b)
            n = mv.nbytes
            if not n:
                continue
            if mv.ndim != 1 or mv.format != "B":
                mv = mv.cast("B") if mv.c_contiguous else memoryview(mv.tobytes())
            mem[off:off + n] = mv
            self._stats.copies += 1
            if out and out[-1][0] + out[-1][1] == base + off:
                out[-1] = (out[-1][0], out[-1][1] + n)  # adjacent staged buffers: one segment
            else:
                out.append((base + off, n))
            off += n
            i += 1
        return out

    def _post_data(self, user, head, lens, segs, total, own, timeout, deadline) -> None:
        hdr = None
        try:
            if not segs:  # header only: it needs registered memory of its own
                deadline = deadline or Deadline(timeout, self.default_timeout)
                hdr = self._wait_hdr(deadline)
            if self._c.sq_used + max(1, len(segs)) > self._verbs.sq_depth:
                deadline = deadline or Deadline(timeout, self.default_timeout)
                self._ensure_sq(max(1, len(segs)), deadline)
        except BaseException:
            if hdr is not None:
                hdr.release()
            raise
        # from here on nothing waits (so the credits owed cannot change under us): the
        # message is posted or the connection is dead
        extra = self._take_owed(peek=True)
        if extra is not None:
            h2 = framing.encode_header(user, lens, extra)
            if len(h2) <= MAX_HEADER:
                head = h2
            else:
                extra = None  # no room to piggyback: the credits go in a credit message
        hl = len(head)
        off = round_up(PREFIX_SIZE + hl)
        small = len(segs) <= 1 and off + total <= self._peer_small
        if hdr is not None:
            mem, pos = self._hdr.memory, hdr.offset
            sges = [(self._hdr.address + pos, PREFIX_SIZE + hl, self._hdr_lkey)]
        else:
            a, n = segs[0]
            pool = self.send_pool
            pos = a - off - pool.address
            mem = pool.memory
            sges = [(a - off, off + n, self._send_lkey)]
            sges.extend((sa, sn, self._send_lkey) for sa, sn in segs[1:])
        PREFIX.pack_into(mem, pos, _MAGIC, _VERSION, _DATA, hl, total)
        mem[pos + PREFIX_SIZE:pos + PREFIX_SIZE + hl] = head
        if extra is not None:
            self._take_owed()
        self._c.tx_credits -= 1
        if small:
            self._post_chain(sges, E.IBV_WR_SEND, 0, None, own, hdr)
        else:
            s = self._tx_slots.popleft()
            self._tx_free[s] = 0
            self._post_chain(sges, E.IBV_WR_RDMA_WRITE_WITH_IMM, socket.htonl(s),
                             self._raddr + s * self._rstride, own, hdr)
        self._stats.messages_sent += 1
        self._stats.bytes_sent += total

    def _post_chain(self, sges, opcode, imm, raddr, slots, hdr) -> None:
        """Post one message: one WR per scatter entry (WRITEs to consecutive offsets of the
        remote slot, then the final ``opcode``), the last one signaled if it is due."""
        wr, sge = self._wr, self._sge
        self._c.wr_seq += 1
        wid = self._c.wr_seq
        signaled = self._c.unsig + 1 >= self._sig_every or self.send_pool.available <= self._sig_every
        self._c.unsig = 0 if signaled else self._c.unsig + 1
        last = len(sges) - 1
        # one small SEND goes inline: its bytes are in the work request once posted
        inline = self._max_inline and not last and opcode != E.IBV_WR_RDMA_WRITE and sges[0][1] <= self._max_inline
        roff = 0
        try:
            for i, (addr, length, lkey) in enumerate(sges):
                sge.addr = addr
                sge.length = length
                sge.lkey = lkey
                wr.wr_id = wid
                if i < last:
                    wr.opcode = E.IBV_WR_RDMA_WRITE
                    wr.send_flags = 0
                else:
                    wr.opcode = opcode
                    wr.send_flags = (E.IBV_SEND_SIGNALED if signaled else 0) | (E.IBV_SEND_INLINE if inline else 0)
                    wr.imm_data = imm
                if raddr is not None:
                    wr.set_wr_rdma(self._rkey, raddr + roff)
                    roff += length
                self._qp.post_send(wr)
        except PyverbsError as exc:
            self._fail(f"posting a send failed: {exc}")  # the caller frees the slots
            raise self._closed_error() from None
        self._c.sq_used += len(sges)
        if inline:  # the slots were read when posted: they are ours again
            for s in slots:
                s.release()
            if hdr is not None:
                hdr.release()
            slots, hdr = (), None
            self._c.inline_sends += 1
        self._inflight.append([wid, len(sges), slots, hdr])

    def _fence(self) -> None:
        """A signaled zero-byte WRITE: completes every unsignaled send before it, so their
        slots come back when nothing else would be signaled."""
        if self._c.sq_used + 1 > self._verbs.sq_depth:
            return
        self._c.unsig = self._sig_every  # force the signal
        self._post_chain([(self._hdr.address, 0, self._hdr_lkey)], E.IBV_WR_RDMA_WRITE, 0,
                         self._raddr, [], None)

    def _reclaim(self) -> int:
        n = self._poll_send() if self._c.sq_used else 0
        if not n and self._c.unsig and self._inflight and not self._qp_error:
            self._fence()
        return n

    def _wait_slot(self, deadline: Deadline) -> Slot:
        pool = self.send_pool
        while True:
            s = pool.try_alloc()
            if s is not None:
                return s
            self._check_usable()
            if not self._inflight:  # every slot is held by the caller: nothing will free one
                raise Timeout(f"all {pool.nslots} send slots are held by the caller")
            if not self._reclaim():
                self._wait(deadline, "waiting for a send slot", send=True)

    def _wait_hdr(self, deadline: Deadline) -> Slot:
        while True:
            h = self._hdr.try_alloc()
            if h is not None:
                return h
            self._check_usable()
            if not self._reclaim():
                self._wait(deadline, "waiting for the send queue", send=True)

    def _ensure_sq(self, nwr: int, deadline: Deadline) -> None:
        while self._c.sq_used + nwr > self._verbs.sq_depth:
            self._check_usable()
            if not self._reclaim():
                self._wait(deadline, "waiting for the send queue", send=True)

    def _poll_send(self) -> int:
        """One poll of the send CQ, the in-flight records up to each completion retired (in C
        where the compiled path runs); after a QP error, all of them."""
        inflight = self._inflight
        if self._link is not None:
            n = self._link.poll_send(self)
        else:
            n, wcs = self._send_cq.poll(16)
            for wc in wcs:
                if wc.status != E.IBV_WC_SUCCESS:
                    self._send_failed(wc.status)
                while inflight:
                    rec = inflight.popleft()
                    self._retire(rec)
                    if rec[0] == wc.wr_id:
                        break
        if self._qp_error:  # flushed or not, nothing in flight will complete any more
            while inflight:
                self._retire(inflight.popleft())
            self._c.sq_used = 0
        return n

    def _retire(self, rec: list) -> None:
        """A completed in-flight record: its send queue entries and slots come back."""
        self._c.sq_used -= rec[1]
        for s in rec[2]:
            s.release()
        if rec[3] is not None:
            rec[3].release()

    def _send_failed(self, status: int) -> None:
        self._fail(f"send failed: {wc_status_name(status)}")
