"""An established rdma:// connection: the message path, credits, completions and waits.

Message path (every message is one framing.py DATA frame: prefix, msgpack header, then the
payload at the next 64-byte boundary; or, to a peer whose QP HELLO lists CAP_RDMA_FAST, the
common small message as a fixed-width fast SEND, framing.pack_rdma_fast):
- The sender's slots have ``ROOM`` registered bytes in front of them; the prefix and header
  are written there, so one scatter entry covers header and payload and the payload is
  never copied (unregistered buffers are copied into a slot once, and counted).
- small: a frame that fits the peer's receive buffers (``small_size``) and has at most one
  payload segment goes by SEND into a pre-posted receive; the message's buffers are views
  of that receive buffer, which is re-posted when the message is released. A frame that
  fits the QP's inline size (``Verbs.max_inline``) is copied into the work request as it
  is posted, and its slot is free again at once.
- large: RDMA WRITE WITH IMMEDIATE into a receive slot the peer advertised in the
  handshake (the immediate is the slot index); extra segments go first as plain WRITEs
  to the following offsets of the same slot. The frame lands at the slot's start, the
  payload ``round_up(16 + header_len, 64)`` bytes in.

Credits: the receiver's ``nslots`` is the number of messages the sender may have unreleased
(each message takes a receive; a large one also a slot, and there are as many slots as
credits, so a sender with a credit always has a free slot). Releasing a message returns
its credit (and slot index), piggybacked on the next DATA frame's ``extra`` field or in a
credit message: a SEND WITH IMMEDIATE (``CTRL_IMM``) carrying msgpack
``[credits, ctrl_acks, [slot, ...]]`` into one of ``nctrl`` receives reserved for them.
Credit messages have their own budget (``nctrl``), acknowledged the same way; the last unit
of budget is kept for a message that carries acks, so the two sides can never both hold
credits back for want of budget.

The compiled path (transport/_rdmafast.c, where it is built; ``native=``): the public alloc,
send and recv are its methods. It posts the fast SEND for a one-slot message that fits a
receive buffer and returns no large-message slot, polls both CQs without pyverbs objects,
makes a message of every fast SEND it receives (and posts the receive again on release),
and spins for a message before the Python wait sleeps; everything else it hands to the
Python methods below (``_send_py``, ``_on_completions``...), untouched and in order. Both
paths share the counters (``self._c``: :class:`Counters`, or the extension's Link), so
either can take the next message; pyverbs keeps the device, PD, MRs, CQs and QP set-up.

Completions: two CQs, each with a completion channel. Waits busy-poll for ``spin``
seconds, then arm the CQ (req_notify), re-poll (a completion may have raced the arming),
and sleep in epoll on the channel fds and the side-channel socket, so a dead peer (EOF)
wakes the waiter at once. ``fileno()`` is an epoll fd over the receive channel and the
socket; a connection whose fd is used keeps its CQ armed and its channel drained between
calls, so the fd is readable only when something new arrived.
"""
from __future__ import annotations

import collections
import os
import select
import socket
import time
from typing import Any, Optional, Sequence

import msgpack

from . import framing
from .base import BROKEN, CompiledPath, Connection, ConnectionStats, Deadline, Message
from .errors import ProtocolError, Timeout, TransportError
from .framing import CLOSE as _CLOSE
from .pool import BufferPool, Slot, round_up
from . import rdma_handshake as hs
from .rdma_device import DeviceChoice, pick_device
from .rdma_verbs import E, PyverbsError, Verbs
from .rdma_pools import Counters
from .rdma_pools import RoomPool as _RoomPool
from .rdma_pools import RoomSlot as _RoomSlot
from .rdma_watch import DeviceWatch
from .timing import RDMA_CLOSE_LINGER

try:  # the compiled fast path (setup.py builds it where verbs.h is installed)
    from . import _rdmafast
    NATIVE_ERROR: Optional[str] = None
except ImportError as exc:
    _rdmafast = None  # type: ignore[assignment]
    NATIVE_ERROR = str(exc)

PREFIX = framing.PREFIX
PREFIX_SIZE = framing.PREFIX_SIZE
MAX_HEADER = framing.MAX_HEADER
ROOM = round_up(PREFIX_SIZE + MAX_HEADER)  # registered bytes before each send slot
CTRL_IMM = 0x4D54_4352  # "MTCR": the immediate that marks a credit message
NCTRL = 8  # receives each side posts for the peer's credit messages
CLOSE_LINGER = RDMA_CLOSE_LINGER  # close() waits at most this long for its sends to complete
_MAGIC, _VERSION, _DATA = framing.MAGIC, framing.VERSION, framing.DATA
_packb = msgpack.Packer(use_bin_type=True).pack


class _FastMessage(Message):
    """A message the compiled path made (its ``release`` is the extension's)."""

    __slots__ = ()


def _wc_status(status: int) -> str:
    for name in dir(E):
        if name.startswith("IBV_WC_") and getattr(E, name) == status and "SUCCESS" not in name:
            return name
    return str(status)


class RdmaConnection(CompiledPath, Connection):
    """One RC queue pair and its registered pools (see the module docstring)."""

    def __init__(self, sock: socket.socket, url: str, *, slot_size: int, nslots: int,
                 timeout: float, device: Optional[str] = None,
                 gid_index: Optional[int] = None, ib_port: Optional[int] = None,
                 small_size: int, spin: float, choice: Optional[DeviceChoice] = None,
                 native: Optional[bool] = None):
        """Local set-up only (device, verbs objects, pools, posted receives): no I/O. The
        handshake (transport/rdma.py) then exchanges :meth:`local_hello` with the peer's,
        calls :meth:`connect_peer` with it, and :meth:`start` after the READY barrier.
        ``native``: None uses the compiled path where it is built, True requires it, False
        is the Python path (the bytes on the wire are the same kinds either way)."""
        if native and _rdmafast is None:
            raise TransportError(f"rdma://'s compiled path is not built ({NATIVE_ERROR}); `make native` builds it")
        self.url = url
        self.sock = sock
        self.default_timeout = timeout
        self._stats = ConnectionStats()
        self.max_message = 0
        self._spin = spin
        self._torn = False  # verbs objects, pools and the side channel released
        self._qp_error: Optional[str] = None  # a QP/work-completion error: do not touch the QP
        self._side_done = False  # the side channel said goodbye (EOF or CLOSE)
        self._inbox: collections.deque = collections.deque()
        self._verbs: Optional[Verbs] = None
        self._pools: list = []
        self._ep = self._pub = None
        self._watch: Optional[DeviceWatch] = None  # wakes us when the device is being removed
        self._fd_used = False
        self._armed_recv = self._armed_send = False
        # per-message counters: a Counters here, the compiled Link from start() where it runs
        self._c = Counters()
        self._link = None
        self._native = native
        self._peer_fast = False
        # sender state
        self._tx_slots: collections.deque = collections.deque()
        self._tx_free = bytearray()
        self._inflight: collections.deque = collections.deque()  # [wr_id, nwr, slots, hdr]
        # receiver state
        self._owed_slots: list = []  # mutated in place: the Link holds it
        try:
            self._setup_local(slot_size, nslots, device, gid_index, ib_port, small_size, choice)
        except BaseException:
            self._teardown()
            raise

    # ------------------------------------------------------------------ set-up
    def _setup_local(self, slot_size, nslots, device, gid_index, ib_port, small_size, choice):
        if not 1 <= nslots <= hs.MAX_NSLOTS:
            raise ValueError(f"nslots must be in 1..{hs.MAX_NSLOTS}, got {nslots}")
        if slot_size <= 0:
            raise ValueError(f"slot_size must be positive, got {slot_size}")
        if small_size < 32 + 3 * nslots or small_size < 256:
            raise ValueError(f"small_size={small_size} is too small for nslots={nslots} "
                             f"(needs {max(256, 32 + 3 * nslots)})")
        if choice is None:
            choice = pick_device(hs.local_ip(self.sock), device=device, gid_index=gid_index, port=ib_port)
        nrecv = nslots + NCTRL
        v = self._verbs = Verbs(choice, nrecv=nrecv, sq_depth=max(128, 4 * nslots + 4 * NCTRL))
        self.recv_pool = BufferPool(ROOM + slot_size, nslots, name=f"recv:{self.url}")
        self._pools.append(self.recv_pool)
        self._rbuf = BufferPool(small_size, nrecv, name=f"recv-small:{self.url}")
        self._pools.append(self._rbuf)
        self._recv_max = slot_size
        self._recv_nslots = nslots
        rw = E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_WRITE
        recv_mr = v.register(self.recv_pool.address, self.recv_pool.length, rw)
        rbuf_mr = v.register(self._rbuf.address, self._rbuf.length, E.IBV_ACCESS_LOCAL_WRITE)
        self._rbuf_lkey = rbuf_mr.lkey
        v.to_init()
        rb = self._rbuf
        self._rwrs = [v.recv_wr(i, rb.address + i * rb.stride, small_size, rbuf_mr.lkey)
                      for i in range(nrecv)]
        for wr in self._rwrs:  # receives may be posted in INIT, before the peer can send
            v.qp.post_recv(wr)
        self._psn = int.from_bytes(os.urandom(3), "little")
        self._ours = hs.params(gid=v.gid, qpn=v.qpn, psn=self._psn, mtu=v.active_mtu, max_msg=v.max_msg,
                               addr=self.recv_pool.address, rkey=recv_mr.rkey, slot_size=slot_size,
                               room=ROOM, stride=self.recv_pool.stride, nslots=nslots,
                               small_size=small_size, nctrl=NCTRL, caps=[framing.CAP_RDMA_FAST])

    def local_hello(self) -> dict:
        """Our queue pair and receive slots, for the peer (rdma_handshake.py's fields)."""
        return self._ours

    def connect_peer(self, peer: dict) -> None:
        """Given the peer's validated QP HELLO: size the send side and move the QP to RTS.
        No I/O; nobody sends on the QP before the READY barrier that follows."""
        v = self._verbs
        nslots = self._recv_nslots
        self.peer = peer
        if peer["small_size"] < 32 + 3 * nslots:
            raise ProtocolError(f"the peer's receive buffers ({peer['small_size']} B) cannot hold a "
                                f"credit message for our {nslots} slots")
        max_msg = min(v.max_msg, peer["max_msg"])
        self.max_message = min(peer["slot_size"], max_msg - peer["room"])
        if self.max_message <= 0:
            raise ProtocolError(f"no room for a message: max_msg {max_msg}, header room {peer['room']}")
        self._peer_small = peer["small_size"]
        self._peer_fast = framing.CAP_RDMA_FAST in peer.get("caps", ())
        self._peer_nslots = peer["nslots"]
        self._peer_nctrl = peer["nctrl"]
        self._raddr, self._rkey, self._rstride = peer["addr"], peer["rkey"], peer["stride"]
        self.send_pool = _RoomPool(ROOM, self.max_message, peer["nslots"], name=f"send:{self.url}")
        self._pools.append(self.send_pool)
        self._send_lkey = v.register(self.send_pool.address, self.send_pool.length, 0).lkey
        self._hdr = BufferPool(ROOM, 2 * NCTRL, name=f"send-hdr:{self.url}")
        self._pools.append(self._hdr)
        self._hdr_lkey = v.register(self._hdr.address, self._hdr.length, 0).lkey
        self._c.tx_credits = peer["nslots"]
        self._tx_slots.extend(range(peer["nslots"]))
        self._tx_free = bytearray(b"\x01") * peer["nslots"]
        self._c.ctrl_budget = peer["nctrl"]
        # signal one send in `_sig_every`: each completion costs a pyverbs WC object
        self._sig_every = max(1, min(16, peer["nslots"] // 4))
        self._flush_at = max(1, nslots // 2)
        self._ack_at = max(1, NCTRL // 2)
        self.path_mtu = min(v.active_mtu, peer["mtu"])
        v.to_rts(dest_qpn=peer["qpn"], dest_psn=peer["psn"], dgid=peer["gid"], mtu=self.path_mtu,
                 sq_psn=self._psn)

    def start(self) -> None:
        """After the READY barrier: the reusable send WR and the waiting machinery."""
        v = self._verbs
        self._wr, self._sge = v.send_wr()
        self._qp = v.qp
        self._max_inline = v.max_inline
        self._recv_cq, self._send_cq = v.recv_cq, v.send_cq
        self._recv_poll = select.poll()
        self._recv_poll.register(v.recv_fd, select.POLLIN)
        self._send_poll = select.poll()
        self._send_poll.register(v.send_fd, select.POLLIN)
        self._ep = select.epoll()
        self._pub = select.epoll()
        for ep in (self._ep, self._pub):
            ep.register(v.recv_fd, select.EPOLLIN)
            ep.register(self.sock.fileno(), select.EPOLLIN | select.EPOLLRDHUP)
        self._ep.register(v.send_fd, select.EPOLLIN)
        self._watch = DeviceWatch.open(v.choice.device)
        if self._watch is not None:
            for ep in (self._ep, self._pub):
                ep.register(self._watch.fd, select.EPOLLIN)
        if self._native is not False and _rdmafast is not None:
            self._start_link()

    def _start_link(self) -> None:
        """The compiled path (transport/_rdmafast.c) on pyverbs' QP and CQs, taking over the
        counters; without it (pyverbs' objects not recognised) the Python path runs."""
        v, rb, sp, rp = self._verbs, self._rbuf, self.send_pool, self.recv_pool
        try:
            link = _rdmafast.Link(
                qp=v.qp, qpn=v.qpn, recv_cq=v.recv_cq, send_cq=v.send_cq, rb_addr=rb.address,
                rb_stride=rb.stride, rb_size=rb.slot_size, rb_lkey=self._rbuf_lkey, nrecv=len(self._rwrs),
                rb_mem=rb.memory, recv_max=self._recv_max, recv_nslots=self._recv_nslots, pool=sp,
                free=sp._free, in_use=sp._in_use, slots=sp._slots, sp_addr=sp.address, sp_stride=sp.stride,
                room=sp.room, sp_lkey=self._send_lkey, max_message=self.max_message,
                peer_small=self._peer_small, max_inline=self._max_inline, sq_depth=v.sq_depth,
                sig_every=self._sig_every, flush_at=self._flush_at, ack_at=self._ack_at,
                peer_nslots=self._peer_nslots, peer_nctrl=self._peer_nctrl, peer_fast=self._peer_fast,
                spin=self._spin, inbox=self._inbox, inflight=self._inflight, owed_slots=self._owed_slots,
                tx_slots=self._tx_slots, tx_free=self._tx_free, raddr=self._raddr, rkey=self._rkey,
                rstride=self._rstride, rp_mem=rp.memory, rp_addr=rp.address, rp_stride=rp.stride,
                rp_size=rp.slot_size, rp_free=rp._free, rp_in_use=rp._in_use)
        except LookupError:
            if self._native:
                raise TransportError("rdma://'s compiled path does not recognise this pyverbs' QP objects") from None
            return
        for name in Counters.__slots__:
            setattr(link, name, getattr(self._c, name))
        self._c = self._link = link

    @property
    def device(self) -> DeviceChoice:
        """The device, port and GID this connection's queue pair uses."""
        return self._verbs.choice

    @property
    def inline_sends(self) -> int:
        """Messages whose bytes went in the work request (tests read it)."""
        return self._c.inline_sends

    # ------------------------------------------------------------------ public API
    def fileno(self) -> int:
        if self._torn:
            return -1
        self._fd_used = True
        self._quiesce()
        return self._pub.fileno()

    def pending(self) -> bool:
        return bool(self._inbox)

    def send_ready(self) -> bool:
        if self._state:
            return False
        if self._c.tx_credits <= 0:
            try:
                self._poll_recv()  # credits come back as completions: look without waiting
            except TransportError:
                return False
        return self._c.tx_credits > 0 and self._c.sq_used + 2 <= self._verbs.sq_depth

    def in_registered_memory(self, buf) -> bool:
        return self.recv_pool.contains(buf) or self._rbuf.contains(buf)

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

    def _recv_py(self, timeout: Optional[float] = None) -> Message:
        inbox = self._inbox
        if inbox:
            return inbox.popleft()
        if self._state >= BROKEN:
            raise self._closed_error()
        deadline = None
        while True:
            if self._c.sq_used > self._verbs.sq_depth // 2:
                self._poll_send()
            self._poll_recv()
            if inbox:
                if self._fd_used:
                    self._quiesce()
                return inbox.popleft()
            if self._state:
                raise self._closed_error()
            if deadline is None:
                deadline = Deadline(timeout, self.default_timeout)
            self._wait(deadline, "waiting for a message")

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

    # the Python methods are the public ones where the compiled path is not built (below)
    recv, alloc, send = _recv_py, _alloc_py, _send_py

    # ------------------------------------------------------------------ sending
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

    # ------------------------------------------------------------------ credits
    def _take_owed(self, peek: bool = False):
        if not (self._c.owed_credits or self._c.owed_acks):
            return None
        extra = [self._c.owed_credits, self._c.owed_acks, list(self._owed_slots)]
        if not peek:
            self._c.unreturned -= self._c.owed_credits
            self._c.owed_credits = self._c.owed_acks = 0
            self._owed_slots.clear()
        return extra

    def _release_message(self, token: int) -> None:
        """A message was released: token >= 0 is a receive buffer, -1 - slot a slot."""
        if token >= 0:
            self._release(token, False)
        else:
            self._release(-1 - token, True)

    def _release(self, index: int, large: bool) -> None:
        if self._state >= BROKEN or self._qp_error:
            return
        if large:
            self.recv_pool.free(index)
            self._owed_slots.append(index)
        else:
            try:
                self._qp.post_recv(self._rwrs[index])
            except PyverbsError as exc:
                self._fail(f"re-posting a receive failed: {exc}")
                return
        self._c.owed_credits += 1
        # batch credit returns, except when the sender has none left (it is waiting)
        if self._c.owed_credits >= self._flush_at or self._c.unreturned >= self._recv_nslots:
            self._flush(force=True)

    def _flush(self, force: bool = False) -> None:
        """Send a credit message when credits or acks are due (``force``: we are about to
        sleep, so return any credit at all: the peer may be waiting for it)."""
        oc, oa = self._c.owed_credits, self._c.owed_acks
        if not (oc >= self._flush_at or oa >= self._ack_at or (force and oc)):
            return
        if self._state:
            return
        budget = self._c.ctrl_budget
        if budget < 1 or (budget == 1 and not oa):  # the last one is kept for acks
            return
        if self._c.sq_used + 1 > self._verbs.sq_depth:
            self._reclaim()
            if self._c.sq_used + 1 > self._verbs.sq_depth:
                return
        hdr = self._hdr.try_alloc()
        if hdr is None:
            self._reclaim()
            hdr = self._hdr.try_alloc()
            if hdr is None:
                return  # retried at the next wait
        body = _packb(self._take_owed())
        hdr.whole[:len(body)] = body
        self._c.ctrl_budget -= 1
        self._post_chain([(self._hdr.address + hdr.offset, len(body), self._hdr_lkey)],
                         E.IBV_WR_SEND_WITH_IMM, socket.htonl(CTRL_IMM), None, [], hdr)

    def _apply(self, credits: int, acks: int, slots: list) -> None:
        """Credits, acks and slot indexes the peer returned (framing.check_credit_return
        checked their form; here: a peer cannot hand us credits it never had)."""
        free = self._tx_free
        for s in slots:
            if not s < self._peer_nslots or free[s]:
                raise ProtocolError(f"credit for slot {s!r}, which we do not hold")
            free[s] = 1
        self._tx_slots.extend(slots)
        self._c.tx_credits += credits
        self._c.ctrl_budget += acks
        if (self._c.tx_credits > self._peer_nslots or self._c.ctrl_budget > self._peer_nctrl
                or len(self._tx_slots) < self._c.tx_credits):
            raise ProtocolError("the peer returned more credits than it was given")

    # ------------------------------------------------------------------ completions
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
        self._fail(f"send failed: {_wc_status(status)}")

    def _poll_recv(self) -> int:
        """One poll of the receive CQ, processed; the number of completions."""
        if self._link is not None:
            return self._link.poll(self)  # fast SENDs in C, the rest through _on_completions
        n, wcs = self._recv_cq.poll(16)
        if n:
            self._on_completions([(wc.wr_id, wc.status, wc.opcode, wc.wc_flags, wc.byte_len, wc.imm_data)
                                  for wc in wcs])
        return n

    def _on_completions(self, wcs: list) -> None:
        """Receive completions ``(wr_id, status, opcode, wc_flags, byte_len, imm_data)``, in
        the order polled; a protocol error tears the connection down and raises."""
        try:
            for wr_id, status, op, flags, length, imm in wcs:
                if status != E.IBV_WC_SUCCESS:
                    self._fail(f"receive failed: {_wc_status(status)}")
                    continue
                if op == E.IBV_WC_RECV:
                    if flags & E.IBV_WC_WITH_IMM:
                        self._on_ctrl(wr_id, length, imm)
                    else:
                        self._on_small(wr_id, length)
                elif op == E.IBV_WC_RECV_RDMA_WITH_IMM:
                    self._on_large(wr_id, imm)
                else:
                    raise ProtocolError(f"unexpected receive completion opcode {op}")
        except (ProtocolError, ValueError) as exc:
            err = exc if isinstance(exc, ProtocolError) else ProtocolError(str(exc))
            self._abort(f"protocol error: {err}")
            raise err from None
        if self._c.owed_acks >= self._ack_at or self._c.owed_credits >= self._flush_at:
            self._flush()

    def _message(self, user, lens, extra, mem, p: int, token: int) -> None:
        """A decoded DATA frame whose payload starts at ``mem[p]``: apply the credits it
        carries, queue it as a message."""
        if extra is not None:
            self._apply(*framing.check_credit_return(extra))
        bufs = []
        start = p
        for n in lens:
            bufs.append(mem[p:p + n])
            p += n
        st = self._stats
        st.messages_received += 1
        st.bytes_received += p - start
        self._c.unreturned += 1
        self._inbox.append(Message(user, bufs, None, self, token))

    def _on_small(self, i: int, length: int) -> None:
        if not 0 <= i < len(self._rwrs):
            raise ProtocolError(f"a receive completion for buffer {i}, which we never posted")
        rb = self._rbuf
        fast = framing.parse_rdma_fast(rb.memory, i * rb.stride, length, self._recv_max)
        if fast is not None:  # the compiled sender's fixed-width form (we announced CAP_RDMA_FAST)
            user, ret, p, k = fast
            self._message(user, (k,), ret, rb.memory, p, i)
            return
        kind, user, lens, extra, p = framing.decode_in_buffer(rb.memory, i * rb.stride, length, rb.slot_size,
                                                              self._recv_max)
        if kind == _CLOSE:  # the peer says goodbye
            self._qp.post_recv(self._rwrs[i])
            self._to_peer_gone("peer closed the connection")
            return
        self._message(user, lens, extra, rb.memory, p, i)

    def _on_large(self, i: int, imm: int) -> None:
        self._qp.post_recv(self._rwrs[i])  # a WRITE WITH IMMEDIATE leaves the buffer unused
        s = socket.ntohl(imm)
        if s >= self._recv_nslots:
            raise ProtocolError(f"WRITE into slot {s}, we have {self._recv_nslots}")
        pool = self.recv_pool
        try:
            pool.take(s)
        except ValueError:
            raise ProtocolError(f"the peer wrote into slot {s}, which a message still holds") from None
        fast = framing.parse_rdma_fast_slot(pool.memory, s * pool.stride, pool.slot_size, self._recv_max)
        if fast is not None:  # the compiled sender's fixed-width form
            user, ret, p, k = fast
            self._message(user, (k,), ret, pool.memory, p, -1 - s)
            return
        kind, user, lens, extra, p = framing.decode_in_slot(pool.memory, s * pool.stride, pool.slot_size,
                                                            self._recv_max)
        self._message(user, lens, extra, pool.memory, p, -1 - s)

    def _on_ctrl(self, i: int, length: int, imm: int) -> None:
        if socket.ntohl(imm) != CTRL_IMM:
            raise ProtocolError(f"SEND with unknown immediate {socket.ntohl(imm):#x}")
        if not 0 <= i < len(self._rwrs) or length > self._rbuf.slot_size:
            raise ProtocolError(f"a credit message of {length} bytes in buffer {i}")
        base = i * self._rbuf.stride
        returned = framing.decode_credit_message(self._rbuf.memory[base:base + length])
        self._qp.post_recv(self._rwrs[i])
        self._c.owed_acks += 1
        self._apply(*returned)

    # ------------------------------------------------------------------ waiting
    def _wait(self, deadline: Deadline, what: str, send: bool = False) -> None:
        """Wait until a completion or the side channel may have made progress (or raise
        Timeout at the deadline): busy-poll for ``spin``, then arm and sleep in epoll.
        With sends in flight the send CQ is watched too, whatever we wait for: a send that
        fails (the peer's QP is gone) is how a waiter for credits learns the QP is dead."""
        send = send or bool(self._inflight)
        left = deadline.remaining()
        spin = self._spin
        if self._link is not None and self._link.skip_spin:  # the compiled recv spun already
            self._link.skip_spin = 0
            spin = 0
        if left > 0 and spin > 0:
            now = time.monotonic
            end = now() + min(spin, left)
            while True:
                if self._poll_recv() or (send and self._poll_send()):
                    return
                if now() >= end:
                    break
        self._flush(force=True)
        if not self._armed_recv:
            self._recv_cq.req_notify()
            self._armed_recv = True
        if send and not self._armed_send:
            self._send_cq.req_notify()
            self._armed_send = True
        # a completion that came before the arming raises no event: look once more
        if self._poll_recv() or (send and self._poll_send()):
            return
        if self._state:
            return
        events = self._ep.poll(deadline.remaining())
        if not events:
            deadline.check(what)
            return
        v = self._verbs
        for fd, _ in events:
            if fd == v.recv_fd:
                self._consume(True)
            elif fd == v.send_fd:
                self._consume(False)
            elif self._watch is not None and fd == self._watch.fd:
                self._check_device()
            else:
                self._check_side()

    def _consume(self, recv: bool) -> None:
        v = self._verbs
        cc, cq = (v.recv_cc, v.recv_cq) if recv else (v.send_cc, v.send_cq)
        try:
            cc.get_cq_event(cq)
        except PyverbsError:
            return  # nothing there (the fd is non-blocking)
        cq.ack_events(1)
        if recv:
            self._armed_recv = False
        else:
            self._armed_send = False

    def _quiesce(self) -> None:
        """For fd users: leave the receive CQ armed with no event pending and nothing
        unprocessed, so the fd polls readable only for something new."""
        if self._torn or self._qp_error:
            return
        while True:
            if self._armed_recv:
                if not self._recv_poll.poll(0):
                    return
                self._consume(True)
            self._recv_cq.req_notify()
            self._armed_recv = True
            if not self._poll_recv():
                return

    def _check_side(self) -> None:
        """The side channel is readable: the peer closed (CLOSE frame, EOF) or died."""
        if self._side_done:
            return
        try:
            data = self.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            why = f"peer vanished ({exc})"
        else:
            close = framing.frame_close()
            if data and not close.startswith(data[:PREFIX_SIZE]):
                self._abort("protocol error: unexpected bytes on the side channel")
                raise ProtocolError("unexpected bytes on the rdma side channel")
            why = "peer closed the connection" if data else "peer vanished (side channel EOF)"
        # everything the peer sent before it went is in our CQ already: deliver it first
        while self._poll_recv():
            pass
        self._side_done = True
        self._to_peer_gone(why)
        try:  # the fd stays readable (EOF): only the public fd keeps watching it
            self._ep.unregister(self.sock.fileno())
        except (OSError, ValueError):
            pass

    def _check_device(self) -> None:
        """The device watch fired: if our device is being removed, fail (closing lets the
        removal finish; see transport/rdma_watch.py)."""
        if self._watch.removed() and not self._qp_error:
            for ep in (self._ep, self._pub):
                ep.unregister(self._watch.fd)
            self._fail(f"RDMA device {self._verbs.choice.device} is being removed")

    def _fail(self, why: str) -> None:
        """The QP failed: the peer is out of reach (what arrived is still delivered)."""
        if self._qp_error is None:
            self._qp_error = why
        self._to_peer_gone(why)

    def _check_usable(self) -> None:
        """ConnectionClosed where a wait for our own sends cannot end (torn down, QP failed)."""
        if self._state >= BROKEN or self._qp_error:
            raise self._closed_error()

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        if self._torn:
            self._to_closed()
            return
        try:
            if self._verbs is not None and self.max_message and not self._state:
                self._linger()
            if self.max_message and not self._side_done:
                try:
                    self.sock.send(framing.frame_close(), socket.MSG_DONTWAIT)
                except OSError:
                    pass
        finally:
            self._to_closed()
            self._teardown()

    def _abort(self, why: str) -> None:
        """BROKEN (a protocol error): torn down at once, nothing more is delivered."""
        self._to_broken(why)
        if not self._torn:
            self._teardown()

    def abort(self) -> None:
        """Tear down at once, saying nothing to the peer (a failed handshake)."""
        if not self._torn:
            self._to_closed()
            self._teardown()

    def _linger(self) -> None:
        """Wait (bounded) until what we sent has completed, so it is delivered."""
        deadline = Deadline(min(self.default_timeout, CLOSE_LINGER))
        try:
            while self._inflight and not self._state:
                if not self._reclaim():
                    self._wait(deadline, "closing", send=True)
        except TransportError:
            pass

    def _teardown(self) -> None:
        self._torn = True
        if self._link is not None:
            self._link.close()  # before pyverbs destroys the QP it points at
        for m in self._inbox:
            m._conn = None
        self._inbox.clear()
        for rec in self._inflight:
            for s in rec[2]:
                try:
                    s.release()
                except ValueError:
                    pass
        self._inflight.clear()
        if self._verbs is not None:
            self._verbs.close()
        for ep in (self._ep, self._pub):
            if ep is not None:
                ep.close()
        if self._watch is not None:
            self._watch.close()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        for p in self._pools:
            p.close()
        self._pools = []


if _rdmafast is not None:
    # the compiled release, then alloc/send/recv: each takes the common message in C and
    # hands anything else to the Python method of the same name with "_py"
    _FastMessage.release = _rdmafast.bind(_FastMessage, _RoomSlot, _packb, framing.unpack_fast_user,  # type: ignore[method-assign]
                                          TransportError, BROKEN, framing.TAG_RFAST, framing.MAX_FAST_USER)
    RdmaConnection.alloc, RdmaConnection.send, RdmaConnection.recv = _rdmafast.connection_methods(RdmaConnection)
