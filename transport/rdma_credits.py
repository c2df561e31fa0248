"""rdma://'s credits: what a receiver owes back for released messages, the credit
messages that carry it when no DATA frame does, and the checks on what the peer returns.

A mixin of :class:`transport.rdma_conn.RdmaConnection` (its state is the connection's; the
credit scheme is described there).
"""
from __future__ import annotations

import socket

import msgpack

from .base import BROKEN
from .errors import ProtocolError
from .rdma_verbs import E, PyverbsError

__all__ = ["RdmaCredits", "CTRL_IMM"]

CTRL_IMM = 0x4D54_4352  # "MTCR": the immediate that marks a credit message
_packb = msgpack.Packer(use_bin_type=True).pack


class RdmaCredits:
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
