"""shm://'s send side: slots from our pool, records into our ring, the peer's doorbell.

A mixin of :class:`transport.shm.ShmConnection` (its state is the connection's): taking the
slots the peer gave back, waiting (bounded) for a slot or ring room, and writing each kind
of record (the fast one-slot record, the fixed-tail one-slot frame, the general frame).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from . import framing
from .base import Deadline
from .errors import ProtocolError, Timeout
from .framing import DATA as _DATA
from .framing import FAST_HEAD, FAST_SIZE, MAX_FAST_RECORD, SLOT_OVERHEAD, TAG_FAST, pack_slot_frame, slot_header
from .pool import Slot, describe_buffers, stage_buffers
from .shm_wire import _FAST_OFF, _FAST_REC, _MAX_BUFFERS, _MAX_HEADER, _MAX_RECORD_LEN, _REC_LEN, _pack
from .shmring import REC_HDR, W_ARMED_DATA, W_ARMED_SPACE, W_OUT_HEAD, W_OUT_TAIL, W_RET_TAIL

__all__ = ["ShmSendPath"]


class ShmSendPath:
    def _take_returns(self) -> bool:
        """Our slots the peer gave back, into the pool: ProtocolError (and BROKEN) for ids
        it never had, ids returned twice, or a corrupted return ring."""
        try:
            ids = self._returns.drain()
        except ProtocolError as e:
            self._abort(f"protocol error: {e}")
            raise
        if not ids:
            return False
        free, in_use, nslots = self._free, self._in_use, len(self._in_use)
        for i in ids:  # BufferPool.free inlined, same checks
            if i < nslots and in_use[i]:
                in_use[i] = False
                free.append(i)
            else:
                why = f"slot {i} out of range 0..{nslots - 1}" if i >= nslots else f"slot {i} freed twice"
                self._abort(f"protocol error: peer returned a slot it did not have: {why}")
                raise ProtocolError(f"peer returned a slot it did not have: {why}")
        return True

    def _wait_space(self, ready, deadline: Deadline, what: str) -> None:
        """Wait (bounded) until ``ready()``; the peer rings us while W_ARMED_SPACE is set."""
        w = self._w
        w[W_ARMED_SPACE] = 1
        try:
            while True:
                self._acq()  # full fence: "armed" (store) before the re-check (loads)
                self._rel()
                if ready():
                    return
                if self._state:
                    raise self._closed_error()
                if deadline.expired():
                    self._bell.wait(0) and self._check_socket()
                    if self._state:
                        continue
                    raise Timeout(f"timed out {what}")
                self._sleep(deadline)
        finally:
            w[W_ARMED_SPACE] = 0

    def _alloc_slot(self, deadline: Deadline) -> Slot:
        pool = self.send_pool
        slot = pool.try_alloc()
        if slot is None:
            if not self._take_returns() or (slot := pool.try_alloc()) is None:
                self._stats.credit_stalls += 1
                self._wait_space(lambda: self._take_returns() and pool.available > 0, deadline,
                                 "waiting for the peer to release a slot")
                slot = pool.try_alloc()
        return slot

    def _alloc_py(self, nbytes: int, timeout: Optional[float] = None) -> Slot:
        link = self._link
        if link is not None:  # compiled: returns taken, the last freed slot (None: wait or raise below)
            slot = link.alloc(self, nbytes)
            if slot is not None:
                return slot
        free = self._free
        # returns first, so the slot given back last is the one reused: the slots in flight
        # stay the working set (taken only when the pool ran dry, a sender would write every
        # slot once, faulting each one in, before it came back to the first; see
        # docs/design.md#the-last-slot-returned-is-the-next-one-written)
        if not self._state and self._w[W_RET_TAIL] != self._cur.ret_head:
            self._take_returns()
        if free and not self._state and 0 <= nbytes <= self.max_message:
            i = free.pop()  # BufferPool.try_alloc inlined: last freed, first reused
            self._in_use[i] = True
            slot = self._slots[i]
            slot.nbytes = nbytes
            return slot
        if self._state:
            raise self._closed_error()
        if not 0 <= nbytes <= self.max_message:
            raise ValueError(f"{nbytes} bytes exceed the peer's largest message ({self.max_message})")
        slot = self.send_pool.try_alloc(nbytes)
        if slot is None:
            slot = self._alloc_slot(Deadline(timeout, self.default_timeout))
            slot.nbytes = nbytes
        return slot

    def _send_py(self, header: Any, buffers: Sequence = (), timeout: Optional[float] = None) -> None:
        link = self._link  # (a call with keywords comes here first: the compiled path takes it too)
        if link is not None and not link.send_message(self, header, buffers):
            return  # compiled: a one-slot message as a fast record (-1: the paths below)
        if len(buffers) == 1:
            b = buffers[0]
            if b.__class__ is Slot and b.pool is self.send_pool and not self._state:
                # the hot path: one slot from alloc(), packed straight into the ring
                if self._fast:
                    if header.__class__ is dict and not header:
                        uh = b""  # the fast record's {}: no header bytes at all
                        n = FAST_SIZE
                    else:
                        try:
                            uh = _pack(header)
                        except Exception as e:
                            b.release()  # the slot belongs to the transport even when send raises
                            raise TypeError(f"header is not msgpack-serialisable: {e}") from None
                        n = FAST_SIZE + len(uh)
                        if n > MAX_FAST_RECORD:
                            self._send_slot(uh, b, timeout)
                            return
                    # RecordWriter.reserve and commit inlined for a record that fits
                    # without padding (nearly always); anything else goes the long way
                    out = self._out
                    need = (n + 15) & ~7  # REC_HDR + n rounded up to 8
                    cur = self._cur
                    old = cur.out_tail
                    pos = old & out.mask
                    w = self._w
                    if pos + need > out.cap or not 0 <= old - w[W_OUT_HEAD] <= out.cap - need:
                        self._send_fast_slow(uh, n, b, timeout)
                        return
                    cur.out_tail = new = old + need
                    k = b.nbytes
                    data = out.data
                    _FAST_REC.pack_into(data, pos, n, 0, TAG_FAST, b.index, k)
                    if uh:
                        data[pos + _FAST_OFF : pos + REC_HDR + n] = uh
                    w[W_OUT_TAIL] = new  # publish: x86-TSO orders it after the record's bytes
                    self._acq()  # full fence: the tail (store) before "armed", head (loads)
                    self._rel()
                    if self._pw[W_ARMED_DATA] and w[W_OUT_HEAD] == old:
                        self._ring()  # armed, and it had taken all but our record
                    st = self._stats
                    st.messages_sent += 1
                    st.bytes_sent += k
                    return
                try:
                    uh = _pack(header)
                except Exception as e:
                    b.release()
                    raise TypeError(f"header is not msgpack-serialisable: {e}") from None
                self._send_slot(uh, b, timeout)
                return
        self._send_general(header, buffers, timeout)

    def _send_fast_slow(self, uh: bytes, n: int, b: Slot, timeout: Optional[float]) -> None:
        """The fast record when the ring needs padding first, or is full (then wait for room)."""
        out = self._out
        k = b.nbytes
        try:
            pos = out.reserve((n + 15) & ~7)
        except ProtocolError as e:  # the peer corrupted the ring's head
            self._abort(f"protocol error: {e}")
            raise
        if pos < 0:  # the ring is full: wait for room like any record
            self._send_record(FAST_HEAD.pack(TAG_FAST, b.index, k), uh, k, [b], timeout, None)
            return
        data = out.data
        _FAST_REC.pack_into(data, pos, n, 0, TAG_FAST, b.index, k)
        if uh:
            data[pos + _FAST_OFF : pos + REC_HDR + n] = uh
        old = out.commit()
        self._acq()  # full fence: the tail (store) before "armed", head (loads)
        self._rel()
        if self._pw[W_ARMED_DATA] and out.words[W_OUT_HEAD] == old:
            self._ring()
        st = self._stats
        st.messages_sent += 1
        st.bytes_sent += k

    def _send_slot(self, uh: bytes, b: Slot, timeout: Optional[float]) -> None:
        """The fixed-tail msgpack record for slot ``b`` (a peer without the fast record)."""
        k = b.nbytes
        out = self._out
        reclen = SLOT_OVERHEAD + len(uh)
        try:
            pos = out.reserve(REC_HDR + ((reclen + 7) & ~7)) if reclen <= _MAX_RECORD_LEN else -1
        except ProtocolError as e:  # the peer corrupted the ring's head
            self._abort(f"protocol error: {e}")
            raise
        if pos < 0:
            self._send_head(slot_header(uh, k, b.index), k, [b], timeout, None)
            return
        data = out.data
        _REC_LEN.pack_into(data, pos, reclen)
        pack_slot_frame(data, pos + REC_HDR, uh, k, b.index)
        old = out.commit()
        self._acq()  # full fence: the tail (store) before "armed", head (loads)
        self._rel()
        if self._pw[W_ARMED_DATA] and out.words[W_OUT_HEAD] == old:
            self._ring()  # armed, and it had taken all but our record
        st = self._stats
        st.messages_sent += 1
        st.bytes_sent += k

    def _send_general(self, header: Any, buffers: Sequence, timeout: Optional[float]) -> None:
        pool = self.send_pool
        owned = [b for b in buffers if type(b) is Slot and b.pool is pool]
        try:
            if self._state:
                raise self._closed_error()
            deadline = Deadline(timeout, self.default_timeout)
            lens, extra, total = self._describe(buffers, owned, deadline)
            try:  # not framing.encode_header: it turns a None header into {}
                head = _pack([header, lens, extra])
            except Exception as e:
                raise TypeError(f"header is not msgpack-serialisable: {e}") from None
        except BaseException:
            for s in owned:  # the slots belong to the transport even when send raises
                s.release()
            raise
        self._send_head(head, total, owned, timeout, deadline)

    def _send_head(self, head: bytes, total: int, owned: list, timeout: Optional[float],
                   deadline: Optional[Deadline]) -> None:
        """Write the record prefix + ``head``, waiting (bounded) for ring space."""
        hlen = len(head)
        if hlen > _MAX_HEADER:
            for s in owned:
                s.release()
            raise ValueError(f"header of {hlen} bytes exceeds the limit of {_MAX_HEADER}")
        self._send_record(framing.encode_prefix(_DATA, hlen, total), head, total, owned, timeout, deadline)

    def _send_record(self, prefix: bytes, head: bytes, total: int, owned: list, timeout: Optional[float],
                     deadline: Optional[Deadline]) -> None:
        """Write the record ``prefix + head``, waiting (bounded) for ring space."""
        out = self._out
        try:
            if self._state:
                raise self._closed_error()
            old = out.push(prefix, head)
            if old is None:
                self._wait_space(lambda: not self._state and out.push(prefix, head) is not None,
                                 deadline or Deadline(timeout, self.default_timeout),
                                 "waiting for ring space")
                old = -1  # the ring was full, so the peer is busy: no need to ring
        except ProtocolError as e:  # the peer corrupted the ring's head
            self._abort(f"protocol error: {e}")
            raise
        except BaseException:
            for s in owned:
                s.release()
            raise
        self._acq()  # full fence: the tail (store) before "armed" and the head (loads)
        self._rel()
        if self._pw[W_ARMED_DATA] and old >= 0 and out.empty_for_peer(old):
            self._ring()
        st = self._stats
        st.messages_sent += 1
        st.bytes_sent += total

    def _describe(self, buffers: Sequence, owned: list, deadline: Deadline) -> tuple:
        """lens and slot descriptors of a general message, unregistered buffers staged."""
        lens, extra, others, total = describe_buffers(buffers, self.send_pool, self.max_message, _MAX_BUFFERS)
        if others:
            self._stats.copies += stage_buffers(others, extra, lambda: self._alloc_slot(deadline),
                                               self.max_message, owned)
        return lens, extra, total

