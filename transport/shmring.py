"""Shared-memory building blocks for shm://: the segment, SPSC rings and the doorbell.

A *segment* is one shared mapping created by one side of a connection. It holds (offsets
in :class:`Layout`): a header describing the layout, control words, the owner's outgoing
record ring, the ring that returns the owner's slots, and the owner's send pool.

Memory ordering. Every control word is a u64 written by exactly one side, with an aligned
8-byte store (``memoryview.cast('Q')`` item assignment compiles to one ``mov``), so a
reader never sees a torn value. We rely on x86-TSO: stores become visible in program
order, so a producer that fills a record and *then* publishes ``tail`` can never have the
consumer see the new tail before the record bytes (and the same for ``head`` freeing
space). The one reordering x86 does allow -- a load passing an earlier store (StoreLoad)
-- is what the sleep protocol must exclude, and :func:`Fence` does that with a locked
instruction.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import select
import struct
import threading
from typing import Optional

from .errors import ProtocolError

SEG_MAGIC = 0x314D48534D454F4D  # b"MOEMSHM1" little-endian
PAGE = 4096
REC_HDR = 8  # u32 record length + u32 spare, so records stay 8-byte aligned
PAD = 0xFFFFFFFF  # "skip to the start of the ring" marker
_U32 = struct.Struct("<I")

# header words (u64 indices): the layout, written once by the creator before the handshake
H_MAGIC, H_RING, H_RETCAP, H_SLOT, H_NSLOTS, H_STRIDE, H_TOTAL = range(7)
# control words, one per 64-byte line so the two writers never false-share. The comment
# says who writes each one (owner = the side that created the segment).
W_OUT_TAIL = 8 * 1     # owner: bytes published in the owner's record ring
W_OUT_HEAD = 8 * 2     # peer: bytes consumed from it
W_RET_TAIL = 8 * 3     # peer: slot ids returned to the owner
W_RET_HEAD = 8 * 4     # owner: returned ids taken back into the pool
W_ARMED_DATA = 8 * 5   # owner: 1 = "ring my bell when you publish a record"
W_ARMED_SPACE = 8 * 6  # owner: 1 = "ring my bell when you free ring space or return slots"
W_RUNG = 8 * 7         # peer: how many times it rang the owner's bell
W_RUNG_AT = W_RUNG + 1  # peer: CLOCK_MONOTONIC ns of its latest ring (0: an older peer that never says)
CTL_WORDS = 8 * 8
#: the seals every segment must carry before the other side maps it
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_sealed(fd: int) -> None:
    """ProtocolError unless ``fd`` is a memfd sealed against shrinking and growing."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:  # EINVAL: not a memfd (a file, a /dev/shm segment...)
        raise ProtocolError(f"peer segment is not a sealed memfd ({e.strerror})") from None
    if seals & SEALS != SEALS:
        raise ProtocolError("peer segment is not sealed against resizing (it could make us fault)")


class Fence:
    """A full memory barrier: acquiring and releasing an (uncontended) lock is a locked
    read-modify-write on x86, which orders the earlier stores before the later loads.

    The sleep protocol is Dekker's: the sleeper stores "asleep" then loads the ring; the
    producer stores the ring's tail then loads "asleep". Without a StoreLoad barrier on
    both sides each could miss the other's store and the sleeper would sleep through a
    message. A bounded poll timeout in the waiters is the safety net on top of this.
    """

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __call__(self) -> None:
        self._lock.acquire()
        self._lock.release()


class Layout:
    """Offsets of one segment (both sides compute it; the reader checks it)."""

    __slots__ = ("ring_bytes", "ret_cap", "slot_size", "nslots", "stride", "ring_off",
                 "ret_off", "pool_off", "total")

    def __init__(self, ring_bytes: int, ret_cap: int, slot_size: int, nslots: int, stride: int):
        self.ring_bytes, self.ret_cap = ring_bytes, ret_cap
        self.slot_size, self.nslots, self.stride = slot_size, nslots, stride
        self.ring_off = PAGE
        self.ret_off = self.ring_off + ring_bytes
        self.pool_off = round_up(self.ret_off + 4 * ret_cap, PAGE)
        self.total = round_up(self.pool_off + stride * nslots, PAGE)


class Segment:
    """A shared mapping: created here (``create``) or received from the peer (``attach``)."""

    def __init__(self, mm: mmap.mmap, layout: Layout, key: tuple, owned: bool):
        self.mm = mm
        self.layout = layout
        self.key = key  # (st_dev, st_ino): identifies the file across fds in this process
        self.owned = owned  # False when this object is another connection's mapping
        self.mem = memoryview(mm)
        self.words = self.mem[:PAGE].cast("Q")
        self.ring = self.mem[layout.ring_off : layout.ring_off + layout.ring_bytes]
        self.ret = self.mem[layout.ret_off : layout.ret_off + 4 * layout.ret_cap].cast("I")
        self.pool_mem = self.mem[layout.pool_off : layout.pool_off + layout.stride * layout.nslots]

    @classmethod
    def create(cls, layout: Layout) -> tuple["Segment", int]:
        """A fresh segment and its fd (the caller passes the fd to the peer, then closes it).

        A memfd: it never has a name (nothing can be left in /dev/shm, whatever crashes),
        mode 0600, and sealed against shrinking and growing (F_SEAL_SEAL too, so the seals
        stay): the peer that maps it cannot truncate it under us, so no access to it can
        fault with SIGBUS.
        """
        fd = os.memfd_create("moe-shm", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, layout.total)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)
            mm = mmap.mmap(fd, layout.total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        seg = cls(mm, layout, (st.st_dev, st.st_ino), owned=True)
        w = seg.words
        w[H_RING], w[H_RETCAP], w[H_SLOT] = layout.ring_bytes, layout.ret_cap, layout.slot_size
        w[H_NSLOTS], w[H_STRIDE], w[H_TOTAL] = layout.nslots, layout.stride, layout.total
        w[H_MAGIC] = SEG_MAGIC
        _REGISTRY[seg.key] = seg
        return seg, fd

    @classmethod
    def attach(cls, fd: int, *, slot_size: int, nslots: int, max_ring: int, min_ring: int) -> "Segment":
        """Map the peer's segment from ``fd`` (not closed here), checking its seals (a
        segment the peer could still resize is refused: it could make us fault) and its
        layout against what we told the peer; in this process already? then share that
        very mapping, so a received buffer *is* the sender's slot."""
        check_sealed(fd)
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        mine = _REGISTRY.get(key)
        if mine is not None:
            return cls(mine.mm, mine.layout, key, owned=False)
        if st.st_size < PAGE:
            raise ProtocolError(f"peer segment of {st.st_size} bytes is too small")
        head = mmap.mmap(fd, PAGE, mmap.MAP_SHARED, mmap.PROT_READ)
        try:
            w = struct.unpack_from("<7Q", head, 0)
        finally:
            head.close()
        if w[H_MAGIC] != SEG_MAGIC:
            raise ProtocolError("peer segment has a bad magic")
        ring, retcap, ssize, nsl, stride, total = w[1:7]
        if (ssize, nsl) != (slot_size, nslots):
            raise ProtocolError(f"peer pool {nsl}x{ssize} does not match ours {nslots}x{slot_size}")
        if ring & (ring - 1) or not min_ring <= ring <= max_ring or retcap & (retcap - 1) \
                or retcap < nslots or stride < ssize or stride % 64:
            raise ProtocolError("peer segment layout is invalid")
        layout = Layout(ring, retcap, ssize, nsl, stride)
        if layout.total != total or st.st_size < total:
            raise ProtocolError("peer segment size does not match its layout")
        mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return cls(mm, layout, key, owned=True)

    def close(self) -> None:
        """Unmap (if ours). A view still held elsewhere (a Message the application has not
        released, numpy arrays over it) keeps the mapping alive until it goes."""
        if _REGISTRY.get(self.key) is self:
            del _REGISTRY[self.key]
        for v in (self.words, self.ret, self.ring, self.pool_mem, self.mem):
            try:
                v.release()
            except (BufferError, ValueError):
                pass
        # also when the mapping is another in-process connection's (owned=False): while
        # that one is open its views make this a BufferError; if it closed first, its own
        # close failed on *our* views and we are the last user, so we unmap
        try:
            self.mm.close()
        except BufferError:
            pass  # exported views remain: the mapping goes with the last of them


# segments created by this process, by file identity, so an in-process peer maps nothing
_REGISTRY: dict = {}


class Cursors:
    """One side's own positions in a connection's rings and doorbell counts. The shared
    words mirror them for the peer, but these are the truth for us (the peer can rewrite
    the shared words at any time). transport/_shmfast.c's ``Link`` has the same fields, so
    the compiled fast path and the classes below move the same cursors."""

    __slots__ = ("out_tail", "in_head", "ret_tail", "ret_head", "rung_sent", "rung_seen")

    def __init__(self, out_tail: int = 0, in_head: int = 0, ret_tail: int = 0, rung_sent: int = 0,
                 rung_seen: int = 0, ret_head: int = 0):
        self.out_tail, self.in_head, self.ret_tail, self.ret_head = out_tail, in_head, ret_tail, ret_head
        self.rung_sent, self.rung_seen = rung_sent, rung_seen


class RecordWriter:
    """The producer end of a byte ring of length-prefixed records.

    Writing is ``pos = reserve(need)``, fill ``data[pos:pos+need]`` (the first u32 is the
    record's length), ``commit()``: the hot path packs straight into the ring, no bytes
    object in between. Nothing is visible to the consumer before ``commit``.
    """

    __slots__ = ("data", "words", "cur", "cap", "mask", "_next")

    def __init__(self, data: memoryview, words: memoryview, cur: Optional[Cursors] = None):
        self.data, self.words = data, words
        self.cap = len(data)
        self.mask = self.cap - 1
        # we are the only writer of the tail: ours is the truth, not the shared word
        self.cur = cur if cur is not None else Cursors(out_tail=words[W_OUT_TAIL])
        self._next = self.cur.out_tail

    @property
    def tail(self) -> int:
        return self.cur.out_tail

    @tail.setter
    def tail(self, value: int) -> None:
        self.cur.out_tail = value

    def room(self) -> int:
        """Free bytes in the ring (a record of up to half of them always fits: see reserve)."""
        return self.cap - (self.tail - self.words[W_OUT_HEAD])

    def reserve(self, need: int) -> int:
        """The ring offset of ``need`` contiguous bytes (``need`` a multiple of 8), or -1
        when there is no room now. Records never wrap: the rest of the ring is padded."""
        tail = self.tail
        cap = self.cap
        used = tail - self.words[W_OUT_HEAD]
        if not 0 <= used <= cap:
            raise ProtocolError("peer corrupted the ring's head")
        pos = tail & self.mask
        to_end = cap - pos
        if need > to_end:  # pad to the end and start over at 0
            if cap - used < to_end + need:
                return -1
            _U32.pack_into(self.data, pos, PAD)
            self._next = tail + to_end + need
            return 0
        if cap - used < need:
            return -1
        self._next = tail + need
        return pos

    def commit(self) -> int:
        """Publish the reserved record; return the tail before it (see empty_for_peer)."""
        old = self.tail
        self.tail = self._next
        self.words[W_OUT_TAIL] = self._next  # publish: x86-TSO orders it after the bytes
        return old

    def push(self, a, b=b"") -> Optional[int]:
        """Write record ``a + b`` (copies; for rare records); the old tail, or None if there
        is no room now."""
        n = len(a) + len(b)
        pos = self.reserve(REC_HDR + ((n + 7) & ~7))
        if pos < 0:
            return None
        data = self.data
        _U32.pack_into(data, pos, n)
        la = len(a)
        data[pos + REC_HDR : pos + REC_HDR + la] = a
        if b:
            data[pos + REC_HDR + la : pos + REC_HDR + n] = b
        return self.commit()

    def empty_for_peer(self, old_tail: int) -> bool:
        """Whether the consumer has taken everything before the record at ``old_tail`` and
        not that record itself (then it may be asleep waiting for it: ring). Further
        behind, it was rung for an earlier record; past it, it has seen ours."""
        return self.words[W_OUT_HEAD] == old_tail


class RecordReader:
    """The consumer end (the ring lives in the peer's segment; we write only its head).
    Everything the peer wrote is checked before use: a garbage record raises
    ProtocolError and is never read outside the ring."""

    __slots__ = ("data", "words", "cur", "cap", "mask", "pos", "next_head")

    def __init__(self, data: memoryview, words: memoryview, cur: Optional[Cursors] = None):
        self.data, self.words = data, words
        self.cap = len(data)
        self.mask = self.cap - 1
        self.cur = cur if cur is not None else Cursors(in_head=words[W_OUT_HEAD])
        self.pos = 0
        self.next_head = self.cur.in_head

    @property
    def head(self) -> int:
        return self.cur.in_head

    @head.setter
    def head(self, value: int) -> None:
        self.cur.in_head = value

    def ready(self) -> bool:
        return self.words[W_OUT_TAIL] != self.head

    def peek(self) -> int:
        """The length of the next record, which starts at ``data[pos]`` and stays valid
        until :meth:`advance`; -1 if there is none (so it is parsed in place, no copy)."""
        head = self.head
        avail = self.words[W_OUT_TAIL] - head
        if avail == 0:
            return -1
        if not 0 < avail <= self.cap:
            raise ProtocolError("peer corrupted the ring's tail")
        pos = head & self.mask
        n = _U32.unpack_from(self.data, pos)[0]
        if n == PAD:
            skip = self.cap - pos
            if avail <= skip:
                raise ProtocolError("ring padding with nothing after it")
            head += skip
            avail -= skip
            pos = 0
            n = _U32.unpack_from(self.data, 0)[0]
        need = REC_HDR + ((n + 7) & ~7)
        if need > avail or pos + need > self.cap:
            raise ProtocolError(f"ring record of {n} bytes overruns the ring")
        self.pos = pos + REC_HDR
        self.next_head = head + need
        return n

    def advance(self) -> None:
        """Give the space of the record :meth:`peek` returned back to the producer."""
        self.head = self.next_head
        self.words[W_OUT_HEAD] = self.head

    def pop(self) -> Optional[bytes]:
        """The next record (a copy: the ring space is given back at once), or None."""
        n = self.peek()  # the one parser of the peer's ring: its checks are written once
        if n < 0:
            return None
        rec = bytes(self.data[self.pos:self.pos + n])
        self.advance()
        return rec


class ReturnWriter:
    """We give the peer's slots back: push ids into the ring in the peer's segment."""

    __slots__ = ("ids", "words", "cur", "mask", "cap")

    def __init__(self, ids: memoryview, words: memoryview, cur: Optional[Cursors] = None):
        self.ids, self.words = ids, words
        self.cap = len(ids)
        self.mask = self.cap - 1
        self.cur = cur if cur is not None else Cursors(ret_tail=words[W_RET_TAIL])

    @property
    def tail(self) -> int:
        return self.cur.ret_tail

    @tail.setter
    def tail(self, value: int) -> None:
        self.cur.ret_tail = value

    def push_one(self, index: int) -> None:
        tail = self.tail
        if tail - self.words[W_RET_HEAD] >= len(self.ids):
            raise ProtocolError("more slots returned than the peer has")  # a peer bug
        self.ids[tail & self.mask] = index
        self.tail = tail + 1
        self.words[W_RET_TAIL] = tail + 1

    def push(self, indices) -> None:
        tail = self.tail
        if tail + len(indices) - self.words[W_RET_HEAD] > len(self.ids):
            raise ProtocolError("more slots returned than the peer has")  # a peer bug
        for i in indices:
            self.ids[tail & self.mask] = i
            tail += 1
        self.tail = tail
        self.words[W_RET_TAIL] = tail


class ReturnReader:
    """Our own slots coming back (the ring in our segment; the peer writes its tail)."""

    __slots__ = ("ids", "words", "cur", "mask")

    def __init__(self, ids: memoryview, words: memoryview, cur: Optional[Cursors] = None):
        self.ids, self.words = ids, words
        self.mask = len(ids) - 1
        # we are the only reader of the head: ours is the truth, not the shared word
        self.cur = cur if cur is not None else Cursors(ret_head=words[W_RET_HEAD])

    def ready(self) -> bool:
        return self.words[W_RET_TAIL] != self.cur.ret_head

    def drain(self) -> list:
        tail = self.words[W_RET_TAIL]
        head = self.cur.ret_head
        if tail == head:
            return []
        if not 0 < tail - head <= len(self.ids):
            raise ProtocolError("peer corrupted the return ring")
        out = [self.ids[h & self.mask] for h in range(head, tail)]
        self.cur.ret_head = tail
        self.words[W_RET_HEAD] = tail
        return out


class Doorbell:
    """An eventfd we sleep on (the peer writes it only when we say we are asleep) and an
    epoll fd over it and the handshake socket, whose HUP says the peer is gone."""

    def __init__(self, sock_fd: int):
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            self.ep = select.epoll()
            self.ep.register(self.fd, select.EPOLLIN)
            self.ep.register(sock_fd, select.EPOLLIN | select.EPOLLRDHUP)
        except BaseException:
            os.close(self.fd)
            raise
        self.sock_fd = sock_fd

    def wait(self, timeout: float) -> bool:
        """Sleep until rung or the socket stirs; True if the socket did (peer gone?)."""
        try:
            events = self.ep.poll(timeout)
        except InterruptedError:
            return False
        return any(fd == self.sock_fd for fd, _ in events)

    def clear(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except (BlockingIOError, InterruptedError):
            pass

    def close(self) -> None:
        self.ep.close()
        os.close(self.fd)


def ring_bell(fd: int) -> None:
    try:
        os.eventfd_write(fd, 1)
    except OSError:
        pass  # EAGAIN (counter saturated: it is rung anyway) or the peer is gone
