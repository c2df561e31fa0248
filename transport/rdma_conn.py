"""An established rdma:// connection: set-up, the message path, credits, completions and waits.

This module holds the set-up, waits and teardown; the Python send side is in rdma_send.py,
the receive side in rdma_recv.py, the credits in rdma_credits.py (mixins of one class).

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
from typing import Optional

import msgpack

from . import framing
from .base import BROKEN, CompiledPath, Connection, ConnectionStats, Deadline, Message
from .errors import ProtocolError, TransportError
from .pool import BufferPool, round_up
from . import rdma_handshake as hs
from .rdma_device import DeviceChoice, pick_device
from .rdma_verbs import E, PyverbsError, Verbs
from .rdma_credits import RdmaCredits
from .rdma_pools import Counters
from .rdma_pools import RoomPool as _RoomPool
from .rdma_pools import RoomSlot as _RoomSlot
from .rdma_recv import RdmaRecvPath
from .rdma_send import RdmaSendPath
from .rdma_watch import DeviceWatch
from .timing import RDMA_CLOSE_LINGER

try:  # the compiled fast path (setup.py builds it where verbs.h is installed)
    from . import _rdmafast
    NATIVE_ERROR: Optional[str] = None
except ImportError as exc:
    _rdmafast = None  # type: ignore[assignment]
    NATIVE_ERROR = str(exc)

PREFIX_SIZE = framing.PREFIX_SIZE
ROOM = round_up(PREFIX_SIZE + framing.MAX_HEADER)  # registered bytes before each send slot
NCTRL = 8  # receives each side posts for the peer's credit messages
CLOSE_LINGER = RDMA_CLOSE_LINGER  # close() waits at most this long for its sends to complete
_packb = msgpack.Packer(use_bin_type=True).pack


class _FastMessage(Message):
    """A message the compiled path made (its ``release`` is the extension's)."""

    __slots__ = ()


class RdmaConnection(RdmaRecvPath, RdmaSendPath, RdmaCredits, CompiledPath, Connection):
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

    # the Python methods are the public ones where the compiled path is not built (below)
    recv, alloc, send = RdmaRecvPath._recv_py, RdmaSendPath._alloc_py, RdmaSendPath._send_py

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
