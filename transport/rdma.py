"""rdma://ip:port — RC queue pairs over pyverbs (soft-RoCE tested).

Set-up runs over a TCP side channel (the listener is a TCP server on ip:port): both
sides exchange a msgpack HELLO (GID, QP number, PSN, active MTU, receive region address,
rkey, slot_size, nslots, control buffer size). Each side owns one PD, one CQ bound to a
CompChannel, one RC QP, one MR over its receive pool, one over its send pool and one over
its control receive buffers — all registered once at connect.

Data: for a message the sender picks a free receiver slot (the receiver's slots are its
credits), RDMA-WRITEs each payload buffer from its send slot into that slot, then SENDs
prefix+header (extra = receiver slot index) into a pre-posted control receive buffer. RC
ordering makes the writes visible before the SEND completes at the receiver. Releasing a
Message SENDs a CREDIT frame back whose payload_len names the freed slot. The side channel
stays open only to detect a dead peer (EOF/reset => ConnectionClosed).
"""
from __future__ import annotations

import collections
import mmap
import os
import select
import socket
import time
from typing import Any, Optional, Sequence

from . import framing
from .base import (DEFAULT_NSLOTS, DEFAULT_SLOT_SIZE, DEFAULT_TIMEOUT, Connection, ConnectionStats,
                   Deadline, Listener, Message, closed_error)
from .errors import ConnectionClosed, ProtocolError, Timeout, TransportError
from .framing import Kind
from .pool import BufferPool, Slot
from .stream import sendmsg_all, wait_fd

IB_SYSFS = "/sys/class/infiniband"
IPV4_MAPPED_PREFIX = "0000:0000:0000:0000:0000:ffff:"
CTRL_SIZE = framing.PREFIX_SIZE + 16 * 1024  # one control receive buffer (prefix + header)
SPIN = 200  # CQ polls before arming the completion channel


def _parse(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"rdma address must be ip:port, got {address!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def _import_verbs():
    try:
        import pyverbs.enums as e  # noqa: F401
        return e
    except ImportError as exc:
        raise TransportError(f"rdma needs pyverbs (python3-pyverbs): {exc}") from None


def _gid_index(dev: str, port: int = 1) -> Optional[int]:
    pdir = os.path.join(IB_SYSFS, dev, "ports", str(port))
    try:
        names = sorted(os.listdir(os.path.join(pdir, "gids")), key=int)
    except OSError:
        return None
    for name in names:
        try:
            with open(os.path.join(pdir, "gids", name)) as f:
                gid = f.read().strip()
            with open(os.path.join(pdir, "gid_attrs", "types", name)) as f:
                typ = f.read().strip()
        except OSError:
            continue
        if gid.startswith(IPV4_MAPPED_PREFIX) and typ == "RoCE v2":
            return int(name)
    return None


def _port_active(dev: str, port: int = 1) -> bool:
    try:
        with open(os.path.join(IB_SYSFS, dev, "ports", str(port), "state")) as f:
            return "ACTIVE" in f.read()
    except OSError:
        return False


def pick_device(device: Optional[str] = None, gid_index: Optional[int] = None) -> tuple[str, int]:
    device = device or os.environ.get("MOE_RDMA_DEVICE") or os.environ.get("MOE_RXE_DEVICE")
    if gid_index is None:
        env = os.environ.get("MOE_RDMA_GID_INDEX") or os.environ.get("MOE_RXE_GID_INDEX")
        gid_index = int(env) if env else None
    try:
        devs = sorted(os.listdir(IB_SYSFS))
    except OSError:
        devs = []
    if device is None:
        for d in devs:
            if _port_active(d) and _gid_index(d) is not None:
                device = d
                break
    if device is None:
        raise TransportError("no RDMA device with an active port and a RoCE v2 IPv4 GID "
                             f"(found {devs or 'none'} in {IB_SYSFS})")
    if gid_index is None:
        gid_index = _gid_index(device)
        if gid_index is None:
            raise TransportError(f"RDMA device {device} has no RoCE v2 IPv4 GID")
    return device, gid_index


def _event_fds() -> set:
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if "infinibandevent" in os.readlink(f"/proc/self/fd/{name}"):
                out.add(int(name))
        except OSError:
            pass
    return out


def _read_exact(sock: socket.socket, n: int, deadline: Deadline) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except (BlockingIOError, InterruptedError):
            wait_fd(sock.fileno(), select.POLLIN, deadline, "in the rdma handshake")
            continue
        except OSError as exc:
            raise ConnectionClosed(f"rdma handshake failed: {exc}") from None
        if k == 0:
            raise ConnectionClosed("peer closed during the rdma handshake")
        got += k
    return bytes(buf)


_HELLO_INTS = ("qpn", "psn", "mtu", "addr", "rkey", "slot_size", "nslots", "nrecv", "ctrl_size")


def _hello(sock: socket.socket, ours: dict, deadline: Deadline) -> dict:
    sendmsg_all(sock, [memoryview(b) for b in framing.encode_hello(ours)], deadline)
    kind, hlen, _ = framing.decode_prefix(_read_exact(sock, framing.PREFIX_SIZE, deadline))
    if kind != Kind.HELLO:
        raise ProtocolError(f"expected a handshake, got frame kind {kind}")
    peer = framing.decode_hello(_read_exact(sock, hlen, deadline))
    if peer.get("transport") != "moe-transport-rdma":
        raise ProtocolError("peer is not a moe-transport rdma endpoint")
    for key in _HELLO_INTS:
        v = peer.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ProtocolError(f"handshake field {key}={v!r} is invalid")
    if peer["slot_size"] <= 0 or peer["nslots"] <= 0 or peer["ctrl_size"] < 64:
        raise ProtocolError("handshake announces an empty pool")
    if not isinstance(peer.get("gid"), str):
        raise ProtocolError("handshake without a GID")
    return peer


class RdmaConnection(Connection):
    def __init__(self, sock: socket.socket, url: str, *, slot_size: int = DEFAULT_SLOT_SIZE,
                 nslots: int = DEFAULT_NSLOTS, timeout: float = DEFAULT_TIMEOUT,
                 device: Optional[str] = None, gid_index: Optional[int] = None,
                 deadline: Optional[Deadline] = None):
        e = self._e = _import_verbs()
        from pyverbs.cq import CQ, CompChannel
        from pyverbs.device import Context
        from pyverbs.mr import MR
        from pyverbs.pd import PD
        from pyverbs.qp import QP, QPCap, QPInitAttr

        self.url = url
        self.default_timeout = timeout
        self.stats = ConnectionStats()
        self.sock = sock
        self._closed = False
        self._objs: list = []  # teardown order: QP, CQ, CompChannel, MRs, PD, Context
        self._ready: collections.deque = collections.deque()
        self._peer_free: collections.deque = collections.deque()
        self._inflight: dict = {}  # wr_id -> send slots to free on completion
        self._outstanding = 0
        self._wr = 1
        self._dead: Optional[str] = None
        self._unacked = 0
        self._armed = False
        deadline = deadline or Deadline(timeout)
        try:
            dev, gidx = pick_device(device, gid_index)
            self.ctx = Context(name=dev)
            self.port = 1
            pattr = self.ctx.query_port(self.port)
            if pattr.state != e.IBV_PORT_ACTIVE:
                raise TransportError(f"{dev} port 1 is not active")
            self.gid_index = gidx
            gid = self.ctx.query_gid(self.port, gidx)
            self.pd = PD(self.ctx)
            self.recv_pool = BufferPool(slot_size, nslots, name=f"recv:{url}")
            self.send_pool = BufferPool(slot_size, nslots, name=f"send:{url}")
            self.ctrl_n = 2 * nslots + 8  # re-sized after the handshake when the peer is bigger
            access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
            self.recv_mr = MR(self.pd, self.recv_pool.length, access, address=self.recv_pool.address)
            self.send_mr = MR(self.pd, self.send_pool.length, e.IBV_ACCESS_LOCAL_WRITE,
                              address=self.send_pool.address)
            before = _event_fds()
            self.channel = CompChannel(self.ctx)
            new = _event_fds() - before
            self.chan_fd = new.pop() if len(new) == 1 else None
            self._own_fd(device_ok=True)
            my = {"transport": "moe-transport-rdma", "version": framing.VERSION,
                  "gid": str(gid), "qpn": 0, "psn": 0, "mtu": int(pattr.active_mtu),
                  "addr": self.recv_pool.address, "rkey": self.recv_mr.rkey,
                  "slot_size": slot_size, "nslots": nslots, "nrecv": 0, "ctrl_size": CTRL_SIZE}
            # the QP needs its queue sizes first: size for the largest peer we accept
            self.sq_depth = nslots * (framing.MAX_BUFFERS + 1) + 64
            self.cq = CQ(self.ctx, 4 * self.sq_depth + 4096, None, self.channel, 0)
            cap = QPCap(max_send_wr=min(self.sq_depth, 4096), max_recv_wr=1024,
                        max_send_sge=1, max_recv_sge=1)
            self.sq_depth = cap.max_send_wr
            self.qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))
            my["qpn"] = self.qp.qp_num
            my["psn"] = int.from_bytes(os.urandom(3), "little")
            my["nrecv"] = self.ctrl_n
            self._my_psn = my["psn"]
            self._to_init()
            peer = _hello(sock, my, deadline)
            if peer["nslots"] + nslots + 8 > 1024:
                raise ProtocolError("too many slots for the receive queue")
            self.peer = peer
            self.max_message = peer["slot_size"]
            self._peer_free.extend(range(peer["nslots"]))
            # control receive buffers: enough for every SEND the peer can have in flight
            self.ctrl_n = peer["nslots"] + nslots + 8
            self.ctrl_mem = mmap.mmap(-1, self.ctrl_n * CTRL_SIZE)
            self.ctrl_view = memoryview(self.ctrl_mem)
            from .pool import buffer_address
            self.ctrl_addr = buffer_address(self.ctrl_view)
            self.ctrl_mr = MR(self.pd, self.ctrl_n * CTRL_SIZE, e.IBV_ACCESS_LOCAL_WRITE,
                              address=self.ctrl_addr)
            # outgoing control: one small buffer per send WR slot (header copies)
            self.out_n = self.sq_depth
            self.out_mem = mmap.mmap(-1, self.out_n * CTRL_SIZE)
            self.out_view = memoryview(self.out_mem)
            self.out_addr = buffer_address(self.out_view)
            self.out_mr = MR(self.pd, self.out_n * CTRL_SIZE, e.IBV_ACCESS_LOCAL_WRITE,
                             address=self.out_addr)
            self._out_free = collections.deque(range(self.out_n))
            for i in range(self.ctrl_n):
                self._post_recv(i)
            self._to_rts(peer, min(int(pattr.active_mtu), peer["mtu"]))
            # both QPs must be ready before either sends: a one-byte barrier
            sendmsg_all(sock, [memoryview(b"R")], deadline)
            if _read_exact(sock, 1, deadline) != b"R":
                raise ProtocolError("bad ready byte")
        except BaseException:
            self.close()
            raise

    def _own_fd(self, device_ok: bool) -> None:
        self.ep = select.epoll()
        if self.chan_fd is not None:
            self.ep.register(self.chan_fd, select.EPOLLIN)
        self.ep.register(self.sock.fileno(), select.EPOLLIN | select.EPOLLRDHUP)

    # ---- QP state machine
    def _to_init(self) -> None:
        from pyverbs.qp import QPAttr
        e = self._e
        a = QPAttr()
        a.qp_state = e.IBV_QPS_INIT
        a.pkey_index = 0
        a.port_num = self.port
        a.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        self.qp.modify(a, e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS)

    def _to_rts(self, peer: dict, mtu: int) -> None:
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr
        e = self._e
        a = QPAttr()
        a.qp_state = e.IBV_QPS_RTR
        a.path_mtu = mtu
        a.dest_qp_num = peer["qpn"]
        a.rq_psn = peer["psn"]
        a.max_dest_rd_atomic = 1
        a.min_rnr_timer = 12
        try:
            dgid = GID(peer["gid"])
        except Exception as exc:
            raise ProtocolError(f"bad GID {peer['gid']!r}: {exc}") from None
        a.ah_attr = AHAttr(port_num=self.port, is_global=1,
                           gr=GlobalRoute(dgid=dgid, sgid_index=self.gid_index, hop_limit=64))
        self.qp.modify(a, e.IBV_QP_STATE | e.IBV_QP_AV | e.IBV_QP_PATH_MTU | e.IBV_QP_DEST_QPN
                       | e.IBV_QP_RQ_PSN | e.IBV_QP_MAX_DEST_RD_ATOMIC | e.IBV_QP_MIN_RNR_TIMER)
        a = QPAttr()
        a.qp_state = e.IBV_QPS_RTS
        a.timeout = 14
        a.retry_cnt = 7
        a.rnr_retry = 7
        a.sq_psn = self._my_psn
        a.max_rd_atomic = 1
        self.qp.modify(a, e.IBV_QP_STATE | e.IBV_QP_TIMEOUT | e.IBV_QP_RETRY_CNT | e.IBV_QP_RNR_RETRY
                       | e.IBV_QP_SQ_PSN | e.IBV_QP_MAX_QP_RD_ATOMIC)

    # ---- work requests
    def _post_recv(self, i: int) -> None:
        from pyverbs.wr import SGE, RecvWR
        self.qp.post_recv(RecvWR(wr_id=i, num_sge=1,
                                 sg=[SGE(self.ctrl_addr + i * CTRL_SIZE, CTRL_SIZE, self.ctrl_mr.lkey)]))

    def _post_send(self, wr) -> None:
        self.qp.post_send(wr)
        self._outstanding += 1

    def _next_wr(self) -> int:
        self._wr += 1
        return self._wr

    def _send_ctrl(self, parts: Sequence, deadline: Deadline, slots=()) -> None:
        """SEND prefix+header bytes (copied into an outgoing control buffer)."""
        from pyverbs.wr import SGE, SendWR
        n = sum(len(p) for p in parts)
        if n > CTRL_SIZE or n > self.peer["ctrl_size"]:
            raise ValueError(f"header of {n} bytes exceeds the rdma control buffer ({CTRL_SIZE})")
        while not self._out_free or self._outstanding >= self.sq_depth:
            self._progress(deadline, "waiting for the send queue", want_send=True)
        j = self._out_free.popleft()
        off = j * CTRL_SIZE
        for p in parts:
            k = len(p)
            self.out_view[off:off + k] = p
            off += k
        wid = self._next_wr()
        self._inflight[wid] = (j, list(slots))
        e = self._e
        self._post_send(SendWR(wr_id=wid, opcode=e.IBV_WR_SEND, num_sge=1,
                               sg=[SGE(self.out_addr + j * CTRL_SIZE, n, self.out_mr.lkey)],
                               send_flags=e.IBV_SEND_SIGNALED))

    # ---- completions
    def _handle(self, wc) -> None:
        e = self._e
        if wc.status != e.IBV_WC_SUCCESS:
            self._dead = f"work completion failed (status {wc.status})"
            raise closed_error(self, self._dead)
        if wc.opcode & e.IBV_WC_RECV:
            i = wc.wr_id
            data = bytes(self.ctrl_view[i * CTRL_SIZE: i * CTRL_SIZE + wc.byte_len])
            self._post_recv(i)
            self._on_frame(data)
        else:
            self._outstanding -= 1
            item = self._inflight.pop(wc.wr_id, None)
            if item is not None:
                j, slots = item
                if j is not None:
                    self._out_free.append(j)
                for s in slots:
                    s.release()

    def _on_frame(self, data: bytes) -> None:
        try:
            if len(data) < framing.PREFIX_SIZE:
                raise ProtocolError(f"short control frame of {len(data)} bytes")
            kind, hlen, plen = framing.decode_prefix(data[:framing.PREFIX_SIZE],
                                                     max_payload=self.recv_pool.slot_size)
            if kind == Kind.CREDIT:
                if not 0 <= plen < self.peer["nslots"] or plen in self._peer_free:
                    raise ProtocolError(f"credit for bad slot {plen}")
                self._peer_free.append(plen)
                return
            if kind == Kind.CLOSE:
                self._dead = "peer closed the connection"
                return
            if kind != Kind.DATA:
                raise ProtocolError(f"unexpected frame kind {kind}")
            if framing.PREFIX_SIZE + hlen != len(data):
                raise ProtocolError("control frame length does not match its header")
            user, lens, extra = framing.decode_header(data[framing.PREFIX_SIZE:], plen)
            if not isinstance(extra, int) or not 0 <= extra < self.recv_pool.nslots:
                raise ProtocolError(f"bad slot index {extra!r}")
            self.recv_pool.take(extra)
        except ValueError as exc:  # ProtocolError included if it subclasses; take() double use
            if not isinstance(exc, ProtocolError):
                exc = ProtocolError(str(exc))
            self._protocol_failure(exc)
            raise exc
        except ProtocolError as exc:
            self._protocol_failure(exc)
            raise
        self.stats.messages_received += 1
        self.stats.bytes_received += plen
        bufs, off = [], 0
        for n in lens:
            bufs.append(self.recv_pool.view(extra, off, n))
            off += n
        self._ready.append(_RdmaMessage(user, bufs, self, extra))

    def _protocol_failure(self, exc) -> None:
        self._dead = f"protocol error: {exc}"
        self.close()

    def _drain(self) -> int:
        n, wcs = self.cq.poll(num_entries=64)
        for wc in wcs:
            self._handle(wc)
        return n

    def _check_side(self) -> None:
        try:
            d = self.sock.recv(64, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._dead = f"peer gone: {exc}"
            return
        if not d:
            self._dead = "peer closed the side channel"
        # bytes after set-up are ignored (none are sent)

    def _progress(self, deadline: Deadline, what: str, want_send: bool = False) -> None:
        """Make progress once: poll the CQ, else wait on the channel and the side socket."""
        if self._closed:
            raise closed_error(self, self._dead or "connection is closed")
        for _ in range(SPIN):
            if self._drain():
                return
        if self._dead:
            raise closed_error(self, self._dead)
        self._check_side()
        if self._dead:
            raise closed_error(self, self._dead)
        if self.chan_fd is None:
            left = deadline.check(what)
            time.sleep(min(left, 0.0005))
            return
        if not self._armed:
            self.cq.req_notify()
            self._armed = True
        if self._drain():  # a completion that raced the arming
            return
        left = deadline.check(what)
        events = self.ep.poll(min(left, 1.0))
        for fd, ev in events:
            if fd == self.chan_fd:
                self.channel.get_cq_event(self.cq)
                self._unacked += 1
                self._armed = False
                if self._unacked >= 64:
                    self.cq.ack_events(self._unacked)
                    self._unacked = 0
            else:
                self._check_side()
        self._drain()

    # ---- Connection API
    @property
    def closed(self) -> bool:
        return self._closed

    def fileno(self) -> int:
        if not self._armed and not self._closed and self.chan_fd is not None:
            self.cq.req_notify()
            self._armed = True
        return self.ep.fileno()

    def pending(self) -> bool:
        return bool(self._ready)

    def alloc(self, nbytes: int, timeout: Optional[float] = None) -> Slot:
        if nbytes > self.send_pool.slot_size:
            raise ValueError(f"{nbytes} bytes exceed the slot size {self.send_pool.slot_size}")
        deadline = Deadline(timeout, self.default_timeout)
        while True:
            if self._closed:
                raise closed_error(self, self._dead or "connection is closed")
            s = self.send_pool.try_alloc()
            if s is not None:
                return s.resize(nbytes)
            self._progress(deadline, "waiting for a send slot")

    def send(self, header: Any, buffers: Sequence = (), timeout: Optional[float] = None) -> None:
        from pyverbs.wr import SGE, SendWR
        if self._closed:
            raise closed_error(self, self._dead or "connection is closed")
        if len(buffers) > framing.MAX_BUFFERS:
            raise ValueError(f"{len(buffers)} buffers exceed the limit of {framing.MAX_BUFFERS}")
        deadline = Deadline(timeout, self.default_timeout)
        views, total = [], 0
        for b in buffers:
            if isinstance(b, Slot):
                if b.pool is not self.send_pool:
                    raise ValueError("slot belongs to another connection")
                views.append(b)
                total += b.nbytes
            else:
                mv = memoryview(b).cast("B") if not isinstance(b, memoryview) or b.format != "B" or b.ndim != 1 \
                    else b
                views.append(mv)
                total += mv.nbytes
        if total > self.max_message:
            raise ValueError(f"message of {total} bytes exceeds the peer's slot size {self.max_message}")
        lens = [v.nbytes for v in views]
        head = framing.encode_header(header, lens, 0)  # size check before taking credits
        if framing.PREFIX_SIZE + len(head) + 8 > min(CTRL_SIZE, self.peer["ctrl_size"]):
            raise ValueError(f"header of {len(head)} bytes exceeds the rdma control buffer")
        while not self._peer_free:
            if self._dead:
                raise closed_error(self, self._dead)
            self.stats.credit_stalls += 0  # counted once below
            try:
                self._progress(deadline, "waiting for credits")
            except Timeout:
                self.stats.credit_stalls += 1
                raise
        dst = self._peer_free.popleft()
        # stage unregistered buffers (one copy each) into a send slot; taking a slot waits
        slots, sges, off = [], [], 0
        try:
            staged = None
            for v in views:
                if isinstance(v, Slot):
                    slots.append(v)
                    if v.nbytes:
                        sges.append((self.send_pool.address + v.offset, v.nbytes, off))
                    off += v.nbytes
                elif v.nbytes:
                    if staged is None or staged[1] + v.nbytes > staged[0].capacity:
                        s = self.send_pool.try_alloc()
                        while s is None:
                            self._progress(deadline, "waiting for a staging slot")
                            s = self.send_pool.try_alloc()
                        staged = [s, 0]
                        slots.append(s)
                    s, used = staged
                    s.whole[used:used + v.nbytes] = v
                    self.stats.copies += 1
                    sges.append((self.send_pool.address + s.offset + used, v.nbytes, off))
                    staged[1] += v.nbytes
                    off += v.nbytes
        except BaseException:
            self._peer_free.appendleft(dst)
            for s in slots:
                if not isinstance(s, Slot) or s in [v for v in views if isinstance(v, Slot)]:
                    continue
                s.release()
            raise
        e = self._e
        raddr = self.peer["addr"] + dst * _round(self.peer["slot_size"])
        for addr, n, roff in sges:
            while self._outstanding >= self.sq_depth - 1:
                self._progress(deadline, "waiting for the send queue")
            wr = SendWR(wr_id=0, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1,
                        sg=[SGE(addr, n, self.send_mr.lkey)], send_flags=e.IBV_SEND_SIGNALED)
            wr.set_wr_rdma(self.peer["rkey"], raddr + roff)
            self._post_send(wr)
        head = framing.encode_header(header, lens, dst)
        self._send_ctrl([framing.encode_prefix(Kind.DATA, len(head), total), head], deadline, slots)
        self.stats.messages_sent += 1
        self.stats.bytes_sent += total

    def recv(self, timeout: Optional[float] = None) -> Message:
        deadline = Deadline(timeout, self.default_timeout)
        while not self._ready:
            if self._closed:
                raise closed_error(self, self._dead or "connection is closed")
            if self._dead:
                raise closed_error(self, self._dead)
            self._progress(deadline, "waiting for a message")
        return self._ready.popleft()

    def _release_slot(self, index: int) -> None:
        if self._closed:
            return
        self.recv_pool.free(index)
        try:
            self._send_ctrl([framing.frame_credit(index)], Deadline(self.default_timeout))
        except (ConnectionClosed, Timeout):
            pass

    def _send_raw(self, frame: bytes) -> None:
        self._send_ctrl([frame], Deadline(self.default_timeout))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if getattr(self, "qp", None) is not None and getattr(self, "peer", None) and not self._dead:
                try:
                    self._closed = False
                    self._send_ctrl([framing.frame_close()], Deadline(0.2))
                    end = Deadline(0.2)
                    while self._outstanding and not end.expired():
                        self._drain()
                except Exception:
                    pass
                finally:
                    self._closed = True
        finally:
            for m in self._ready:
                m.released = True
            self._ready.clear()
            if getattr(self, "_unacked", 0) and getattr(self, "cq", None) is not None:
                try:
                    self.cq.ack_events(self._unacked)
                except Exception:
                    pass
                self._unacked = 0
            for name in ("qp", "cq", "channel", "recv_mr", "send_mr", "ctrl_mr", "out_mr", "pd", "ctx"):
                o = getattr(self, name, None)
                if o is not None:
                    try:
                        o.close()
                    except Exception:
                        pass
                    setattr(self, name, None)
            if getattr(self, "ep", None) is not None:
                self.ep.close()
            try:
                self.sock.close()
            except OSError:
                pass


def _round(n: int) -> int:
    from .pool import round_up
    return round_up(n)


class _RdmaMessage(Message):
    __slots__ = ("_conn", "_slot")

    def __init__(self, header, buffers, conn, slot):
        super().__init__(header, buffers)
        self._conn, self._slot = conn, slot

    def release(self) -> None:
        if self.released:
            return
        super().release()
        self._conn._release_slot(self._slot)


class RdmaListener(Listener):
    def __init__(self, address: str, *, slot_size: int = DEFAULT_SLOT_SIZE, nslots: int = DEFAULT_NSLOTS,
                 timeout: float = DEFAULT_TIMEOUT, device: Optional[str] = None,
                 gid_index: Optional[int] = None, backlog: int = 128):
        _import_verbs()
        self.device, self.gid_index = pick_device(device, gid_index)
        host, port = _parse(address)
        self.sock = socket.create_server((host, port), backlog=backlog)
        self.sock.setblocking(False)
        self.opts = dict(slot_size=slot_size, nslots=nslots, timeout=timeout,
                         device=self.device, gid_index=self.gid_index)
        self.timeout = timeout
        b = self.sock.getsockname()
        self.url = f"rdma://{b[0]}:{b[1]}"

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self, timeout: Optional[float] = None) -> RdmaConnection:
        deadline = Deadline(timeout, self.timeout)
        while True:
            try:
                sock, addr = self.sock.accept()
                break
            except (BlockingIOError, InterruptedError):
                wait_fd(self.sock.fileno(), select.POLLIN, deadline, "waiting for a connection")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        return RdmaConnection(sock, f"rdma://{addr[0]}:{addr[1]}",
                              deadline=Deadline(min(deadline.remaining() or 1.0, 5.0)), **self.opts)

    def close(self) -> None:
        self.sock.close()


def listen(address: str, **options) -> RdmaListener:
    return RdmaListener(address, **options)


def connect(address: str, *, timeout: float = DEFAULT_TIMEOUT, **options) -> RdmaConnection:
    _import_verbs()
    host, port = _parse(address)
    deadline = Deadline(timeout)
    try:
        sock = socket.create_connection((host, port), timeout=deadline.remaining())
    except socket.timeout:
        raise Timeout(f"connecting to rdma://{address}") from None
    except OSError as exc:
        raise ConnectionClosed(f"cannot connect to rdma://{address}: {exc}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    return RdmaConnection(sock, f"rdma://{address}", timeout=timeout, deadline=deadline, **options)
