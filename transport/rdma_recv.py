"""rdma://'s receive side in Python: receive completions into messages (small SENDs,
WRITEs WITH IMMEDIATE into a slot, credit messages) and the blocking receive.

A mixin of :class:`transport.rdma_conn.RdmaConnection` (its state is the connection's); the
compiled path takes fast SENDs itself and hands every other completion to
``_on_completions``, in order.
"""
from __future__ import annotations

import socket
from typing import Optional

from . import framing
from .base import BROKEN, Deadline, Message
from .errors import ProtocolError
from .framing import CLOSE as _CLOSE
from .rdma_credits import CTRL_IMM
from .rdma_verbs import E, wc_status_name

__all__ = ["RdmaRecvPath"]


class RdmaRecvPath:
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
                    self._fail(f"receive failed: {wc_status_name(status)}")
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
