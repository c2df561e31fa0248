"""shm://'s receive side: records from the peer's ring, messages over the peer's slots.

A mixin of :class:`transport.shm.ShmConnection` (its state is the connection's): waiting
for a record (a short spin, then the doorbell, bounded), decoding it into a message whose
buffers are read-only views of the sender's slots, and giving slots back on release.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

from .base import BROKEN, Deadline, Message
from .errors import ProtocolError, Timeout
from .framing import CLOSE as _CLOSE
from .framing import MAX_FAST_RECORD, parse_fast_record, parse_record, parse_slot_record
from .pool import Slot
from .shm_wire import MAX_RECORD, SPIN, SPIN_MIN, _pack
from .shmring import (REC_HDR, W_ARMED_DATA, W_ARMED_SPACE, W_OUT_HEAD, W_OUT_TAIL, W_RET_HEAD, W_RET_TAIL,
                      W_RUNG, W_RUNG_AT)

try:  # the compiled release of a one-slot message (transport/_shmfast.c)
    from . import _shmfast
except ImportError:
    _shmfast = None

if TYPE_CHECKING:
    from .shm import ShmConnection

__all__ = ["ShmRecvPath"]


# -- the connection -----------------------------------------------------------------
class _SlotMessage(Message):
    """A one-slot message (the fast record, or the fixed-tail one): its token is the slot id,
    and releasing it returns that slot straight into the peer's return ring."""

    __slots__ = ()

    def __init__(self, header: Any, buffers: list, conn: "ShmConnection", slot: int):
        self.header = header
        self.buffers = buffers
        self.released = False
        self._conn = conn
        self._token = slot

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        bufs = self.buffers
        self.buffers = []
        for b in bufs:
            b.release()
        conn = self._conn
        self._conn = None
        if conn is None or conn._state >= BROKEN:
            return
        link = conn._link
        if link is not None:  # compiled: the same push and wake-up check
            if link.give_back(self._token):
                conn._release_failed(ProtocolError("more slots returned than the peer has"))
            return
        # the slot goes back: ReturnWriter.push_one and the wake-up check inlined (a
        # corrupted return ring makes the connection BROKEN; release never raises)
        gb, pw, cur = conn._give_back, conn._pw, conn._cur
        tail = cur.ret_tail
        if tail - pw[W_RET_HEAD] >= gb.cap:
            conn._release_failed(ProtocolError("more slots returned than the peer has"))
            return
        gb.ids[tail & gb.mask] = self._token
        cur.ret_tail = tail = tail + 1
        pw[W_RET_TAIL] = tail
        conn._acq()  # full fence: the return published (store) before "armed" is read (load)
        conn._rel()
        if pw[W_ARMED_SPACE]:
            conn._ring()


class _NativeSlotMessage(_SlotMessage):
    """A one-slot message the compiled path made: the same fields, and its ``release`` is
    the compiled version of _SlotMessage.release (installed below when the module is built)."""

    __slots__ = ()


if _shmfast is not None:
    _NativeSlotMessage.release = _shmfast.bind(_NativeSlotMessage, ProtocolError, BROKEN, Slot, _pack)



class ShmRecvPath:
    def pending(self) -> bool:
        if self._state >= BROKEN:
            return self._error is not None  # a ProtocolError for recv to raise
        if self._in.ready():
            return True
        self._clear_bell()  # a stale ring would make the fd readable with nothing to read
        # look again: a record pushed after the first look may have rung the bell we just
        # cleared (the sender rings after pushing), and nobody would announce it again
        return self._in.ready()

    def send_ready(self) -> bool:
        if self._state:
            return False
        if not self.send_pool.available and not self._returns.ready():
            return False
        return self._out.room() >= 2 * (REC_HDR + MAX_RECORD)  # room for any record, padding included

    def _recv_py(self, timeout: Optional[float] = None) -> Message:
        if self._state >= BROKEN:
            raise self._closed_error()
        inr = self._in
        pw = self._pw
        try:
            link = self._link
            if link is not None:  # compiled: a fast record in one call (None: anything else)
                m = link.recv(self)
                if m is not None:
                    return m
                if pw[W_OUT_TAIL] == link.in_head:
                    self._wait_record(timeout)  # returns once a record is there
                    m = link.recv(self)
                    if m is not None:
                        return m
            cur = self._cur
            head = cur.in_head
            tail = pw[W_OUT_TAIL]
            if tail == head:
                self._wait_record(timeout)  # returns once a record is there
                tail = pw[W_OUT_TAIL]
            if self._fast:
                # the negotiated fixed-width record, read in place: the ring checks of
                # RecordReader.peek inlined for the one shape it can have (anything else,
                # padding included, takes the general path below, which says what is wrong)
                pos = head & inr.mask
                n = self._in32[pos >> 2]
                need = (n + 15) & ~7  # REC_HDR + n rounded up to 8
                cap = inr.cap
                if n <= MAX_FAST_RECORD and need <= tail - head <= cap and pos + need <= cap:
                    fast = parse_fast_record(inr.data, pos + REC_HDR, n, self._recv_slot_size, self._recv_nslots)
                    if fast is not None:
                        cur.in_head = inr.next_head = head = head + need
                        pw[W_OUT_HEAD] = head  # the record is parsed: its space goes back
                        w = self._w
                        w[W_ARMED_DATA] = 1  # re-armed only now (see below)
                        if pw[W_ARMED_SPACE]:
                            self._ring()
                        if w[W_RUNG] != self._cur.rung_seen:
                            self._clear_bell()
                        # _one_slot_message inlined: this is the hot path, a call costs here
                        user, s, k = fast
                        st = self._stats
                        st.messages_received += 1
                        st.bytes_received += k
                        base = s * self._recv_stride
                        return _SlotMessage(user, [self._recv_mem[base : base + k]], self, s)
            n = inr.peek()
            p = inr.pos
            try:
                # the one-slot msgpack record (framing's fixed-tail form, what a peer without
                # the fast capability sends); anything else takes the general path, same checks
                fast = parse_slot_record(inr.data, p, n, self._recv_slot_size, self._recv_nslots)
                if fast is None and self._fast:  # a fast record after ring padding
                    fast = parse_fast_record(inr.data, p, n, self._recv_slot_size, self._recv_nslots)
                if fast is not None:
                    return self._one_slot_message(*fast)
                return self._decode(p, n)
            finally:
                inr.advance()  # the record is parsed into Python objects: free its space
                # re-armed only now: a sender that saw us spinning, or saw the record
                # consumed already, does not ring (see send)
                self._w[W_ARMED_DATA] = 1
                if self._pw[W_ARMED_SPACE]:  # the peer waits for ring space
                    self._ring()
                if self._w[W_RUNG] != self._cur.rung_seen:  # we were rung for this record:
                    self._clear_bell()  # unread, the fd would stay readable for a Poller
        except ProtocolError as e:
            self._abort(f"protocol error: {e}")
            raise

    def _wait_record(self, timeout: Optional[float]) -> None:
        """Busy-poll briefly, then sleep on the doorbell, until a record is there.

        The spin adapts: it stays long while messages keep arriving within it, and halves
        (down to SPIN_MIN) each time a wait had to sleep for longer than the spin could
        have covered, so an idle connection costs little CPU; a wait whose record came soon
        after the spin would have caught it restores it. When the record came is the peer's
        ring time if it says (W_RUNG_AT): on a loaded machine the wake-up itself can take
        milliseconds, and counting those would keep the spin short exactly when every
        sleep is expensive."""
        inr, w, pw = self._in, self._w, self._pw
        if timeout != 0 and not self._state:
            head = inr.head
            clock = time.perf_counter
            start = clock()
            end = start + self._spin
            w[W_ARMED_DATA] = 0  # spinning: the peer need not ring
            # the clock is read once per 16 looks at the tail: a look costs a fraction of
            # a clock call, and how soon a record is seen is the latency
            spins = self._spins
            while True:
                for _ in spins:
                    if pw[W_OUT_TAIL] != head:
                        return  # recv reads it, and re-arms once it is consumed
                if clock() >= end:
                    break
            w[W_ARMED_DATA] = 1
        else:
            start = 0.0
        deadline = Deadline(timeout, self.default_timeout)
        while True:
            self._acq()  # full fence: "armed" (store) before the ring is re-read (load)
            self._rel()
            n = inr.peek()
            if n >= 0:
                if start:
                    now = time.perf_counter()  # CLOCK_MONOTONIC, like the peer's ring time
                    rung = w[W_RUNG_AT] * 1e-9
                    waited = (rung if start <= rung <= now else now) - start
                    self._spin = SPIN if waited < 4 * SPIN else max(SPIN_MIN, self._spin / 2)
                return
            if self._state:
                raise self._closed_error()
            if deadline.expired():
                self._bell.wait(0) and self._check_socket()
                if not self._state:
                    # Woken with nothing to read: the peer's eventfd write can reach us before
                    # its W_RUNG store (a 2-core scheduler may run us in between, for ms), so
                    # _clear_bell would not clear, and a level-triggered poller would spin on
                    # the fd. Clear it, then look once more: a record that raced in is returned
                    # (its ring may be the one just cleared), so no wake-up is lost.
                    self._bell.clear()
                    self._acq()
                    self._rel()
                    if inr.peek() >= 0:
                        continue
                    raise Timeout("timed out waiting for a message")
                continue
            self._sleep(deadline)

    def _one_slot_message(self, user: Any, s: int, k: int) -> Message:
        """The message of a one-slot record: ``k`` bytes of receive slot ``s``, where they landed."""
        st = self._stats
        st.messages_received += 1
        st.bytes_received += k
        base = s * self._recv_stride
        return _SlotMessage(user, [self._recv_mem[base : base + k]], self, s)

    def _decode(self, p: int, n: int) -> Message:
        """Any record at ``ring[p:p+n]`` (framing.parse_record checks it); views into the slots."""
        kind, user, lens, extra, plen = parse_record(self._in.data, p, n, self._recv_slot_size,
                                                     self._recv_nslots)
        if kind == _CLOSE:
            self._to_peer_gone("peer closed the connection")
            raise self._closed_error()
        mem, stride = self._recv_mem, self._recv_stride
        bufs, ids = [], []
        for i, k in enumerate(lens):
            s = extra[2 * i]
            base = s * stride + extra[2 * i + 1]
            bufs.append(mem[base : base + k])
            if s not in ids:
                ids.append(s)
        st = self._stats
        st.messages_received += 1
        st.bytes_received += plen
        return Message(user, bufs, None, self, ids)

    def _release_message(self, ids) -> None:
        """A message was released: its slots go back to the sender, which is the credit.
        A ProtocolError here (the peer corrupted its return ring's head) is turned by
        Message.release into BROKEN, raised by our next recv/send."""
        if self._state >= BROKEN:
            return
        if ids.__class__ is int:
            self._give_back.push_one(ids)
        elif ids:
            self._give_back.push(ids)
        else:
            return
        self._acq()  # full fence: returns published (store) before "armed" is read (load)
        self._rel()
        if self._pw[W_ARMED_SPACE]:
            self._ring()

