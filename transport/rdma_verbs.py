"""One rdma:// connection's verbs objects: context, PD, two CQs with completion channels,
an RC QP, memory regions and reusable work requests; created once, destroyed in order.

pyverbs costs that shape this module (rdma-core 44):
- every pyverbs object's constructor is slow (a logger lookup, keyword parsing), so work
  requests are built once and mutated for each post instead of being built per message;
- ``SGE``/``SendWR``/``RecvWR`` malloc their scatter lists and free them only in an
  explicit ``close()`` (there is no ``__dealloc__``, and a second ``close()`` double-frees),
  so each is closed exactly once here;
- ``CompChannel`` exposes no fd, so the fd is found as the one new
  ``anon_inode:[infinibandevent]`` in /proc/self/fd (under a lock, see ``_new_event_fd``).
"""
from __future__ import annotations

import collections
import fcntl
import os
from typing import Optional

from .errors import TransportError
from .rdma_device import OPEN_LOCK, DeviceChoice

try:  # pyverbs is Debian's python3-pyverbs, not on PyPI: importing this module must not need it
    import pyverbs.enums as E
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.cq import CQ, CompChannel
    from pyverbs.device import Context
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.pyverbs_error import PyverbsError
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, RecvWR, SendWR
    IMPORT_ERROR: Optional[ImportError] = None
except ImportError as exc:  # exercised where pyverbs is missing (tests hide it)
    IMPORT_ERROR = exc

    class PyverbsError(Exception):  # type: ignore[no-redef]
        pass

    class _Missing:
        """Stands in for ``pyverbs.enums`` so that modules importing ``E`` from here still
        import; any use of it raises the install hint (never "cannot import name 'E'")."""

        def __getattr__(self, name: str):
            require_pyverbs()

    E = _Missing()  # type: ignore[assignment]

INSTALL_HINT = ("rdma:// needs pyverbs, which is not on PyPI: on Debian/Ubuntu `apt-get install "
                "python3-pyverbs rdma-core ibverbs-providers`, then make it visible to this Python (a venv: "
                "`make deps` links /usr/lib/python3/dist-packages/pyverbs into it, or create the venv with "
                "--system-site-packages)")

#: verbs objects created by this module and not destroyed yet, by kind (tests read it)
LIVE: collections.Counter = collections.Counter()

# QP timing: 4.096 us * 2**16 = 268 ms per try, 6 retries: a silent peer is an error in ~2 s
# (TCG guests stall for tens of ms; shorter timeouts retry needlessly). Not 7: rxe (and
# some NICs) read a retry count of 7 as "retry forever", and the QP would never fail.
ACK_TIMEOUT = 16
RETRY_CNT = 6
# Credits make "receiver not ready" impossible; a few retries absorb nothing but a bug,
# which then surfaces as a QP error (ConnectionClosed) instead of a silent stall.
RNR_RETRY = 3
# Inline sends: the data is copied into the work request when it is posted, so a small
# message's slot is free again at once and the device reads no registered memory for it
INLINE_SIZES = (256, 128, 64, 0)
MIN_RNR_TIMER = 12  # 0.64 ms


def wc_status_name(status: int) -> str:
    """The name of a work completion's error status (IBV_WC_...), for messages."""
    for name in dir(E):
        if name.startswith("IBV_WC_") and getattr(E, name) == status and "SUCCESS" not in name:
            return name
    return str(status)


def require_pyverbs() -> None:
    """TransportError with the install hint when pyverbs did not import."""
    if IMPORT_ERROR is not None:
        raise TransportError(f"{INSTALL_HINT} ({type(IMPORT_ERROR).__name__}: {IMPORT_ERROR})")


def _event_fds() -> set:
    out = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").endswith("[infinibandevent]"):
                out.add(int(name))
        except OSError:
            pass
    return out


def _close(obj) -> None:
    try:
        obj.close()
    except Exception:
        pass


class Verbs:
    """The verbs objects of one connection. ``close()`` destroys them in the order
    QP, CQs, completion channels, MRs, PD, context, and is idempotent."""

    def __init__(self, choice: DeviceChoice, *, nrecv: int, sq_depth: int):
        require_pyverbs()
        self.choice = choice
        self.port = choice.port
        self.gid_index = choice.gid_index
        self.ctx = self.pd = self.qp = None
        self.recv_cq = self.send_cq = self.recv_cc = self.send_cc = None
        self.mrs: list = []
        self._send_wrs: list = []  # every (SendWR, SGE) made, for close
        self._recv_wrs: list = []
        self._closed = False
        try:
            self._open(choice, nrecv, sq_depth)
        except BaseException:
            self.close()
            raise

    def _open(self, choice: DeviceChoice, nrecv: int, sq_depth: int) -> None:
        try:
            # the lock keeps a concurrent Context/CompChannel in another thread from
            # making the new-fd diff ambiguous
            with OPEN_LOCK:
                self.ctx = Context(name=choice.device)
                LIVE["context"] += 1
                self.recv_cc, self.recv_fd = self._channel()
                self.send_cc, self.send_fd = self._channel()
            dev = self.ctx.query_device()
            pattr = self.ctx.query_port(self.port)
            if pattr.state != E.IBV_PORT_ACTIVE:
                raise TransportError(f"{choice.device} port {self.port} is not active")
            self.active_mtu = int(pattr.active_mtu)
            self.max_msg = int(pattr.max_msg_sz)
            self.gid = str(self.ctx.query_gid(self.port, self.gid_index))
            sq_depth = max(8, min(sq_depth, dev.max_qp_wr, dev.max_cqe))
            nrecv = min(nrecv, dev.max_qp_wr, dev.max_cqe)
            self.pd = PD(self.ctx)
            LIVE["pd"] += 1
            self.recv_cq = CQ(self.ctx, nrecv, None, self.recv_cc, 0)
            LIVE["cq"] += 1
            self.send_cq = CQ(self.ctx, sq_depth, None, self.send_cc, 0)
            LIVE["cq"] += 1
            self.qp, self.max_inline = self._create_qp(sq_depth, nrecv)
            LIVE["qp"] += 1
            self.sq_depth = sq_depth
            self.nrecv = nrecv
            self.qpn = self.qp.qp_num
        except PyverbsError as exc:
            raise TransportError(f"rdma set-up on {choice.device} failed: {exc}") from None

    def _create_qp(self, sq_depth: int, nrecv: int):
        """An RC QP sending inline as large a message as the device takes of INLINE_SIZES
        (there is no verb that says: creation fails above its limit, so the sizes are tried
        largest first); (qp, max_inline)."""
        for inline in INLINE_SIZES:
            cap = QPCap(max_send_wr=sq_depth, max_recv_wr=nrecv, max_send_sge=1, max_recv_sge=1,
                        max_inline_data=inline)
            # sq_sig_all=0: the sender signals only some WRs (a completion costs a WC object)
            init = QPInitAttr(qp_type=E.IBV_QPT_RC, scq=self.send_cq, rcq=self.recv_cq, cap=cap,
                              sq_sig_all=0)
            try:
                return QP(self.pd, init), inline
            except PyverbsError:
                if inline == 0:
                    raise
        raise AssertionError("unreachable: INLINE_SIZES ends with 0")

    def _channel(self):
        before = _event_fds()
        cc = CompChannel(self.ctx)
        new = _event_fds() - before
        if len(new) != 1:
            _close(cc)
            raise TransportError(f"cannot find the completion channel's fd (new event fds: {new})")
        LIVE["channel"] += 1
        fd = new.pop()
        # never block inside get_cq_event (it holds the GIL): we poll the fd first
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
        return cc, fd

    # ---- memory
    def register(self, address: int, length: int, access: int):
        try:
            mr = MR(self.pd, length, access, address=address)
        except PyverbsError as exc:
            raise TransportError(f"registering {length} bytes failed ({exc}); a non-root user may "
                                 "need a larger `ulimit -l` (locked memory)") from None
        LIVE["mr"] += 1
        self.mrs.append(mr)
        return mr

    # ---- QP state machine: RESET -> INIT (receives may be posted) -> RTR -> RTS
    def to_init(self) -> None:
        a = QPAttr(qp_state=E.IBV_QPS_INIT, port_num=self.port)
        a.pkey_index = 0
        # REMOTE_WRITE is what lets the peer's WRITE WITH IMMEDIATE land in our slots
        a.qp_access_flags = E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_WRITE
        self.qp.to_init(a)

    def to_rts(self, *, dest_qpn: int, dest_psn: int, dgid: str, mtu: int, sq_psn: int,
               rnr_retry: int = RNR_RETRY) -> None:
        a = QPAttr(qp_state=E.IBV_QPS_RTR, port_num=self.port, path_mtu=mtu)
        a.dest_qp_num = dest_qpn
        a.rq_psn = dest_psn
        a.max_dest_rd_atomic = 1
        a.min_rnr_timer = MIN_RNR_TIMER
        a.ah_attr = AHAttr(port_num=self.port, is_global=1,
                           gr=GlobalRoute(dgid=GID(dgid), sgid_index=self.gid_index, hop_limit=64))
        self.qp.to_rtr(a)
        a = QPAttr(qp_state=E.IBV_QPS_RTS, port_num=self.port, path_mtu=mtu)
        a.timeout = ACK_TIMEOUT
        a.retry_cnt = RETRY_CNT
        a.rnr_retry = rnr_retry
        a.sq_psn = sq_psn
        a.max_rd_atomic = 1
        self.qp.to_rts(a)

    def qp_state(self) -> int:
        return self.qp.query(E.IBV_QP_STATE)[0].qp_state

    # ---- reusable work requests
    def send_wr(self):
        """A (SendWR, SGE) pair whose WR reads its one scatter entry from the SGE, so that
        both are mutated in place for every post."""
        sge = SGE(0, 0, 0)
        wr = SendWR(opcode=E.IBV_WR_SEND, num_sge=1, sg=[sge], send_flags=0)
        wr.close()  # frees the WR's own copy of the list ...
        wr.sg_list = sge  # ... which now is the SGE itself (freed by the SGE's close)
        pair = (wr, sge)
        self._send_wrs.append(pair)
        return pair

    def recv_wr(self, wr_id: int, addr: int, length: int, lkey: int):
        sge = SGE(addr, length, lkey)
        try:
            wr = RecvWR(wr_id=wr_id, num_sge=1, sg=[sge])  # copies the SGE
        finally:
            sge.close()
        self._recv_wrs.append(wr)
        return wr

    # ---- teardown
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.qp is not None:
            _close(self.qp)
            LIVE["qp"] -= 1
        for cq in (self.send_cq, self.recv_cq):
            if cq is not None:
                _close(cq)  # acks outstanding events first (pyverbs counts them)
                LIVE["cq"] -= 1
        for cc in (self.send_cc, self.recv_cc):
            if cc is not None:
                _close(cc)
                LIVE["channel"] -= 1
        for mr in reversed(self.mrs):
            _close(mr)
            LIVE["mr"] -= 1
        if self.pd is not None:
            _close(self.pd)
            LIVE["pd"] -= 1
        if self.ctx is not None:
            _close(self.ctx)
            LIVE["context"] -= 1
        for wr, sge in self._send_wrs:
            sge.close()
        for wr in self._recv_wrs:
            wr.close()
        self._send_wrs, self._recv_wrs, self.mrs = [], [], []
        self.qp = self.send_cq = self.recv_cq = self.send_cc = self.recv_cc = None
        self.pd = self.ctx = None


def live_resources() -> dict:
    """Verbs objects this process created through rdma:// and has not destroyed."""
    return {k: v for k, v in LIVE.items() if v}
