"""The wire rules of moe-transport, with no I/O in them (in the style of h11).

Every receive path parses what a peer wrote with the functions of this module, in place
(memoryviews and offsets, no copies), so what its tests and fuzzers cover is what runs:

==========================  ==========================================================
tcp  (transport/stream.py)  :func:`next_frame` on the connection's read buffer
shm  (transport/shm.py)     :func:`parse_fast_record` (negotiated), :func:`parse_slot_record`,
                            then :func:`parse_record`
rdma (transport/rdma_conn)  :func:`parse_rdma_fast` (negotiated), :func:`decode_in_buffer`
                            (a SEND), :func:`decode_in_slot`
                            (a WRITE WITH IMMEDIATE), :func:`decode_credit_message`
handshakes                  :func:`decode_prefix`, :func:`decode_hello`
==========================  ==========================================================

A frame is::

    prefix  16 bytes  b"MT" | version u8 | kind u8 | header_len u32 | payload_len u64
    header  msgpack   [user_header, [len_0, len_1, ...], extra]   (DATA frames)
                      {handshake parameters}                      (HELLO frames)
    payload           the buffers back to back, sum(len_i) == payload_len

CREDIT frames carry no header and no payload: payload_len is the number of credits
returned. CLOSE frames say goodbye. Every length is checked against hard limits before
anything is read past the prefix, and nothing is ever allocated from a size a peer
announced: a hostile peer can make a parser raise ProtocolError, nothing else.

``extra`` is the backend's: piggybacked credits on tcp, slot descriptors
``[slot, offset, ...]`` on shm, a credit return ``[credits, acks, [slot, ...]]`` on rdma.

Two fast paths are deliberate and live here so that they are tested and fuzzed with the
rest: tcp checks magic, version and kind of a DATA prefix as one u32 compare
(:data:`TAG_DATA`), and shm's one-slot record has a fixed-width msgpack tail
(:data:`SLOT_TAIL`) that the receiver recognises with two struct unpacks. Anything that
is not in the fast form falls through to the full validation, which explains the error.
Peers that negotiate :data:`CAP_SHM_FAST` in the hello use a fixed-width record instead
(:func:`pack_fast_record`, :func:`parse_fast_record`): no msgpack for the usual header.

:class:`FrameParser` (feed it chunks of bytes, get :class:`Frame` objects) is a test and
benchmark convenience driving :func:`next_frame`, the tcp parser.
"""
from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import msgpack

from .errors import ProtocolError

MAGIC = b"MT"
VERSION = 2  # 2: the shared handshake (transport/handshake.py)
PREFIX = struct.Struct("<2sBBIQ")
PREFIX_SIZE = PREFIX.size  # 16
MAX_HEADER = 64 * 1024
MAX_BUFFERS = 64
MAX_PAYLOAD = 1 << 40  # absolute ceiling; connections negotiate a far smaller one


class Kind(enum.IntEnum):
    HELLO = 1
    DATA = 2
    CREDIT = 3
    CLOSE = 4


HELLO, DATA, CREDIT, CLOSE = int(Kind.HELLO), int(Kind.DATA), int(Kind.CREDIT), int(Kind.CLOSE)
_KINDS = frozenset(int(k) for k in Kind)
_packer = msgpack.Packer(use_bin_type=True)
_unpackb = msgpack.unpackb
_EMPTY_HEADER = _packer.pack([{}, [], None])

#: the prefix read as (magic|version|kind as one little-endian u32, header_len, payload_len)
TAGGED = struct.Struct("<IIQ")
TAG_DATA = struct.unpack("<I", PREFIX.pack(MAGIC, VERSION, DATA, 0, 0)[:4])[0]
TAG_CREDIT = struct.unpack("<I", PREFIX.pack(MAGIC, VERSION, CREDIT, 0, 0)[:4])[0]


# -- prefix and header -----------------------------------------------------------------
def encode_prefix(kind: int, header_len: int, payload_len: int) -> bytes:
    return PREFIX.pack(MAGIC, VERSION, kind, header_len, payload_len)


def decode_prefix(buf, *, max_header: int = MAX_HEADER, max_payload: int = MAX_PAYLOAD) -> tuple[int, int, int]:
    """Validate a 16-byte prefix; return (kind, header_len, payload_len)."""
    if len(buf) != PREFIX_SIZE:
        raise ProtocolError(f"prefix must be {PREFIX_SIZE} bytes, got {len(buf)}")
    magic, version, kind, hlen, plen = PREFIX.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}: not a moe-transport peer")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (we speak {VERSION})")
    if kind not in _KINDS:
        raise ProtocolError(f"unknown frame kind {kind}")
    if hlen > max_header:
        raise ProtocolError(f"header of {hlen} bytes exceeds the limit of {max_header}")
    if kind == CREDIT:
        if hlen:
            raise ProtocolError("CREDIT frame with a header")
        return kind, hlen, plen  # plen is the credit count, not bytes on the wire
    if kind == DATA and hlen == 0:
        raise ProtocolError("DATA frame without a header")
    if kind != DATA and plen:
        raise ProtocolError(f"{Kind(kind).name} frame with a payload")
    if plen > max_payload:
        raise ProtocolError(f"payload of {plen} bytes exceeds the limit of {max_payload}")
    return kind, hlen, plen


def encode_header(user_header: Any, lens: Sequence[int], extra: Any = None) -> bytes:
    """The msgpack DATA header. ``user_header`` round-trips exactly (None, 0, "" included)."""
    if type(user_header) is dict and not user_header and not lens and extra is None:
        return _EMPTY_HEADER
    try:
        return _packer.pack([user_header, lens if type(lens) is list else list(lens), extra])
    except (TypeError, ValueError, OverflowError) as e:
        raise TypeError(f"header is not msgpack-serialisable: {e}") from None


def decode_header(buf, payload_len: int) -> tuple[Any, list[int], Any]:
    """Validate a DATA header; return (user_header, buffer lengths, backend extra)."""
    try:
        obj = _unpackb(buf, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable header: {e}") from None
    if not (type(obj) is list and len(obj) == 3 and type(obj[1]) is list):
        raise ProtocolError("header is not [user_header, lengths, extra]")
    user, lens, extra = obj
    if len(lens) > MAX_BUFFERS:
        raise ProtocolError(f"{len(lens)} buffers exceed the limit of {MAX_BUFFERS}")
    total = 0
    for n in lens:
        if type(n) is not int or n < 0:  # bool is an int subclass: not a length
            raise ProtocolError(f"bad buffer length {n!r}")
        total += n
    if total != payload_len:
        raise ProtocolError(f"buffer lengths sum to {total}, prefix says {payload_len}")
    return user, lens, extra


def encode_hello(params: dict) -> list[bytes]:
    body = _packer.pack(params)
    return [encode_prefix(HELLO, len(body), 0), body]


def decode_hello(buf) -> dict:
    try:
        obj = _unpackb(buf, raw=False)
    except Exception as e:
        raise ProtocolError(f"undecodable handshake: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("handshake is not a map")
    return obj


def frame_data(user_header: Any, payloads: Sequence, extra: Any = None) -> list:
    """The gather list [prefix, header, *payloads] for one DATA frame (no copies)."""
    lens = [memoryview(p).nbytes for p in payloads]
    head = encode_header(user_header, lens, extra)
    return [encode_prefix(DATA, len(head), sum(lens)), head, *payloads]


def frame_credit(count: int) -> bytes:
    return encode_prefix(CREDIT, 0, count)


#: tcp: a DATA frame with at least this much payload is written padded (padded_frame_head)
PAD_MIN = 1 << 20


def padded_frame_head(user: bytes, lens: list, total: int, credits: int, src: int) -> tuple[bytes, bytes]:
    """``(lead, header)`` that go before a payload of ``total`` bytes at address ``src`` in
    one write: ``lead`` a CREDIT frame for ``credits`` (if any) and the DATA prefix, the
    header ``[user_header, lens, padding]`` (``user`` packed) with a bin ``extra`` (no
    credits to any receiver) of the length that puts the payload at ``src``'s offset modulo
    64 in the write and not at it modulo 4 KiB. The kernel copies a payload into its socket
    buffer -- 4 KiB pages, filled from the write's first byte -- at a fraction of its speed
    when it lands up to a few dozen bytes past its source's offset in a page (measured here:
    4 MiB took 2.3 ms at 25 bytes past, 1.1-1.5 ms at 64 or 128)."""
    lead = frame_credit(credits) if credits else b""
    body = b"\x93" + user + _packer.pack(lens)
    base = len(lead) + PREFIX_SIZE + len(body) + 1  # with a nil extra
    r = src % 4096
    off = base + (r - base) % 64
    if (off - r) % 4096 == 0:
        off += 64
    d = off - base  # 0..127: nil, or a bin8 of d - 1 bytes
    header = body + (b"\xc0" if not d else b"\xc4" + bytes([d - 1]) + bytes(d - 1))
    return lead + encode_prefix(DATA, len(header), total), header


def frame_close() -> bytes:
    return encode_prefix(CLOSE, 0, 0)


# -- byte streams (tcp) ----------------------------------------------------------------
def next_frame(buf: memoryview, pos: int, end: int, max_header: int, max_payload: int) -> Optional[tuple]:
    """Parse the frame that starts at ``buf[pos]``, of which ``buf[pos:end]`` has arrived.

    None while its prefix or header is incomplete. Otherwise ``(kind, next, header, lens,
    extra, n)``: for DATA, the payload is ``buf[next:next + n]`` (the caller decides where
    it goes: it may not all have arrived); for CREDIT, ``n`` is the credit count; HELLO has
    its parameters in ``header``; ``next`` is where the following bytes start. Raises
    ProtocolError for anything malformed. Reads nothing outside ``buf[pos:end]``.
    """
    if end - pos < PREFIX_SIZE:
        return None
    # magic, version and kind in one compare: "MT", VERSION, DATA as a u32
    tag, hlen, plen = TAGGED.unpack_from(buf, pos)
    if tag == TAG_DATA and 0 < hlen <= max_header and plen <= max_payload:
        pstart = pos + PREFIX_SIZE + hlen
        if end < pstart:
            return None
        view = buf[pos + PREFIX_SIZE:pstart]
        try:  # the one-buffer header of nearly every message, checked inline
            header, lens, extra = _unpackb(view, strict_map_key=False)
            if lens.__class__ is list and len(lens) == 1 and lens[0] == plen and lens[0].__class__ is int:
                return DATA, pstart, header, lens, extra, plen
        except Exception:
            pass
        header, lens, extra = decode_header(view, plen)
        return DATA, pstart, header, lens, extra, plen
    if tag == TAG_CREDIT and not hlen:
        return CREDIT, pos + PREFIX_SIZE, None, None, None, plen
    kind, hlen, plen = decode_prefix(buf[pos:pos + PREFIX_SIZE], max_header=max_header, max_payload=max_payload)
    if kind == CLOSE:
        return CLOSE, pos + PREFIX_SIZE, None, None, None, 0
    # a DATA prefix that passes decode_prefix passed the fast check above: this is HELLO
    pstart = pos + PREFIX_SIZE + hlen
    if end < pstart:
        return None
    return HELLO, pstart, decode_hello(buf[pos + PREFIX_SIZE:pstart]), None, None, 0


# -- shared-memory records (shm) -------------------------------------------------------
# The one-slot record send() writes: the prefix, then the msgpack header
# [user, [len], [slot, 0]] as fixarray(3) + the packed user header + a fixed-width tail
# (fixarray(1), uint64 len, fixarray(2), uint32 slot, 0): valid msgpack that any decoder
# reads, and that the receiver recognises with two struct unpacks.
SLOT_HEAD = struct.Struct("<2sBBIQB")  # the prefix and the fixarray(3) marker: 17 bytes
_SLOT_HEAD_TAGGED = struct.Struct("<IIQB")  # the same, magic|version|kind as one u32
SLOT_TAIL = struct.Struct(">HQHIB")  # msgpack is big-endian
SLOT_TAIL_SIZE = SLOT_TAIL.size  # 17
SLOT_OVERHEAD = SLOT_HEAD.size + SLOT_TAIL_SIZE  # a one-slot frame is this + the user header
_FIXARRAY3 = 0x93
_T1, _T2 = 0x91CF, 0x92CE  # fixarray(1) uint64, fixarray(2) uint32
_SLOT_MIN = SLOT_OVERHEAD + 1  # the smallest user header is one byte


def pack_slot_frame(data, pos: int, user: bytes, nbytes: int, slot: int) -> int:
    """Write the one-slot frame for packed user header ``user`` at ``data[pos]``; its length."""
    lu = len(user)
    hlen = lu + 1 + SLOT_TAIL_SIZE
    SLOT_HEAD.pack_into(data, pos, MAGIC, VERSION, DATA, hlen, nbytes, _FIXARRAY3)
    q = pos + SLOT_HEAD.size
    data[q:q + lu] = user
    SLOT_TAIL.pack_into(data, q + lu, _T1, nbytes, _T2, slot, 0)
    return PREFIX_SIZE + hlen


def slot_header(user: bytes, nbytes: int, slot: int) -> bytes:
    """The header of a one-slot frame as bytes (for a record that goes the slow way)."""
    return b"\x93" + user + SLOT_TAIL.pack(_T1, nbytes, _T2, slot, 0)


def parse_slot_record(data, p: int, n: int, slot_size: int, nslots: int) -> Optional[tuple]:
    """The record ``data[p:p+n]`` if it is the fixed one-slot form: ``(user, slot,
    nbytes)`` with the slot and its bytes inside the sender's pool; None for any other
    record (then :func:`parse_record` validates it and says what is wrong)."""
    if n < _SLOT_MIN:
        return None
    tag, hlen, plen, arr = _SLOT_HEAD_TAGGED.unpack_from(data, p)
    if tag != TAG_DATA or arr != _FIXARRAY3 or n != PREFIX_SIZE + hlen or hlen > MAX_HEADER:
        return None
    q = p + n - SLOT_TAIL_SIZE
    t1, k, t2, s, z = SLOT_TAIL.unpack_from(data, q)
    if t1 != _T1 or t2 != _T2 or z != 0 or k != plen or k > slot_size or s >= nslots:
        return None
    try:
        user = _unpackb(data[p + SLOT_HEAD.size:q], strict_map_key=False)
    except Exception:
        return None  # not exactly one object: the general path says why
    return user, s, k


def parse_record(data, p: int, n: int, slot_size: int, nslots: int) -> tuple:
    """Any record ``data[p:p+n]`` of an shm ring, fully validated: ``(DATA, user, lens,
    extra, payload_len)`` where buffer ``i`` is ``lens[i]`` bytes at offset ``extra[2i+1]``
    of slot ``extra[2i]``, inside a pool of ``nslots`` slots of ``slot_size`` bytes; or
    ``(CLOSE, None, None, None, 0)``. ProtocolError for anything else."""
    if n < PREFIX_SIZE:
        raise ProtocolError(f"ring record of {n} bytes is shorter than a prefix")
    magic, ver, kind, hlen, plen = PREFIX.unpack_from(data, p)
    if magic != MAGIC or ver != VERSION or kind != DATA or not 0 < hlen <= MAX_HEADER \
            or plen > slot_size or n != PREFIX_SIZE + hlen:
        kind, hlen, _ = decode_prefix(data[p:p + PREFIX_SIZE], max_payload=slot_size)
        if kind == CLOSE:
            return CLOSE, None, None, None, 0
        if kind == DATA:
            raise ProtocolError(f"shm DATA record of {n} bytes for a {hlen}-byte header")
        raise ProtocolError(f"unexpected {Kind(kind).name} frame on an shm ring")
    try:
        obj = _unpackb(data[p + PREFIX_SIZE:p + n], strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable header: {e}") from None
    if type(obj) is not list or len(obj) != 3:
        raise ProtocolError("header is not [user_header, lengths, extra]")
    user, lens, extra = obj
    if type(lens) is not list or type(extra) is not list or len(extra) != 2 * len(lens):
        raise ProtocolError("shm DATA record without slot descriptors")
    if len(lens) > MAX_BUFFERS:
        raise ProtocolError(f"{len(lens)} buffers exceed the limit of {MAX_BUFFERS}")
    total = 0
    for i, k in enumerate(lens):
        s, off = extra[2 * i], extra[2 * i + 1]
        if type(k) is not int or type(s) is not int or type(off) is not int or k < 0 \
                or not 0 <= s < nslots or not 0 <= off <= slot_size - k:
            raise ProtocolError(f"buffer {i} ({k!r} B) outside the peer's slots: slot {s!r} offset {off!r}")
        total += k
    if total != plen:
        raise ProtocolError(f"buffer lengths sum to {total}, prefix says {plen}")
    return DATA, user, lens, extra, plen


# -- the negotiated fast record (shm) ----------------------------------------------------
# Between peers that both announce CAP_SHM_FAST in their HELLO, the common message (one
# slot, a small header) is a fixed-width record instead of a msgpack frame: it is written
# with one struct pack and read with one struct unpack, and the usual header {} costs no
# bytes at all. An old peer never announces the capability and keeps the msgpack form.
#
#     tag    u32  b"MT" | VERSION | FAST_DATA, as one little-endian u32
#     slot   u32  the sender's slot holding the payload (at offset 0)
#     nbytes u64  payload length
#     user        msgpack user header, 0..MAX_FAST_USER bytes; none at all means {}
CAP_SHM_FAST = "shm-fast-1"
FAST_DATA = 5  # a record kind of shm rings only, never a Kind: tcp's decode_prefix refuses it
FAST_HEAD = struct.Struct("<IIQ")
FAST_SIZE = FAST_HEAD.size  # 16
MAX_FAST_USER = 512  # a header that packs larger takes the msgpack form
MAX_FAST_RECORD = FAST_SIZE + MAX_FAST_USER
TAG_FAST = struct.unpack("<I", PREFIX.pack(MAGIC, VERSION, FAST_DATA, 0, 0)[:4])[0]


def unpack_fast_user(raw: bytes) -> Any:
    """A fast record's user header bytes as parse_fast_record reads them (any exception:
    undecodable); transport/_shmfast.c calls this so both paths decode alike."""
    return _unpackb(raw, strict_map_key=False)


def pack_fast_record(data, pos: int, user: bytes, slot: int, nbytes: int) -> int:
    """Write the fast record for packed user header ``user`` (b"" for {}) at ``data[pos]``;
    its length. The caller checked ``len(user) <= MAX_FAST_USER``."""
    FAST_HEAD.pack_into(data, pos, TAG_FAST, slot, nbytes)
    if user:
        q = pos + FAST_SIZE
        data[q:q + len(user)] = user
    return FAST_SIZE + len(user)


def parse_fast_record(data, p: int, n: int, slot_size: int, nslots: int) -> Optional[tuple]:
    """The record ``data[p:p+n]`` if it is a fast record: ``(user, slot, nbytes)``, with the
    slot and its bytes inside the sender's pool of ``nslots`` slots of ``slot_size`` bytes.
    None if its tag says it is something else (:func:`parse_record` handles those);
    ProtocolError if it is a malformed fast record. Reads nothing outside ``data[p:p+n]``."""
    if n < FAST_SIZE:
        return None  # shorter than any fast record: parse_record says what it is
    tag, s, k = FAST_HEAD.unpack_from(data, p)
    if tag != TAG_FAST:
        return None
    if n > MAX_FAST_RECORD:
        raise ProtocolError(f"fast record of {n} bytes exceeds the limit of {MAX_FAST_RECORD}")
    if s >= nslots or k > slot_size:
        raise ProtocolError(f"fast record: {k} B in slot {s}, outside the peer's {nslots} slots of {slot_size} B")
    if n == FAST_SIZE:
        return {}, s, k
    try:  # exactly one object: trailing bytes raise ExtraData
        user = unpack_fast_user(data[p + FAST_SIZE:p + n])
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"fast record: undecodable header: {e}") from None
    return user, s, k


# -- the negotiated fast SEND (rdma) ---------------------------------------------------
# A receiver that announces CAP_RDMA_FAST in its QP HELLO also reads the common small
# message (one buffer, a small header, credits that are counts only) in a fixed-width form,
# which transport/_rdmafast.c writes and reads without msgpack. The payload follows the
# head and the user header at the next ALIGN boundary, as in a DATA frame; a large message
# (WRITE WITH IMMEDIATE into a slot) takes the same form at the slot's start. A message
# that returns more than one slot, or a sender without the compiled path, uses DATA frames.
#
#     tag     u32  b"MT" | VERSION | RFAST_DATA, as one little-endian u32
#     nbytes  u32  payload length
#     credits u16  receive credits returned (small messages the sender released)
#     acks    u16  credit messages acknowledged
#     ulen    u16  length of the msgpack user header that follows; 0 means {}
#     slot    u16  a large-message slot returned, plus one; 0: none
CAP_RDMA_FAST = "rdma-fast-1"
RFAST_DATA = 6  # a SEND of rdma:// only, never a Kind: decode_prefix refuses it
RFAST_HEAD = struct.Struct("<IIHHHH")
RFAST_SIZE = RFAST_HEAD.size  # 16
RFAST_ALIGN = 64
TAG_RFAST = struct.unpack("<I", PREFIX.pack(MAGIC, VERSION, RFAST_DATA, 0, 0)[:4])[0]
MAX_RFAST_COUNT = 0xFFFF  # credits and acks each fit a u16 (nslots <= 4096, nctrl <= 256)


def rfast_offset(ulen: int) -> int:
    """Where a fast SEND's payload starts, for a user header of ``ulen`` bytes."""
    return (RFAST_SIZE + ulen + RFAST_ALIGN - 1) // RFAST_ALIGN * RFAST_ALIGN


def pack_rdma_fast(data, pos: int, user: bytes, nbytes: int, credits: int, acks: int,
                   slot: Optional[int] = None) -> int:
    """Write a fast SEND's head and user header (b"" for {}) at ``data[pos]``, returning
    ``slot`` if given; the payload's offset from ``pos``. The caller checked ``len(user) <=
    MAX_FAST_USER``, the counts and the slot."""
    RFAST_HEAD.pack_into(data, pos, TAG_RFAST, nbytes, credits, acks, len(user), 0 if slot is None else slot + 1)
    if user:
        q = pos + RFAST_SIZE
        data[q:q + len(user)] = user
    return rfast_offset(len(user))


def parse_rdma_fast(mem, base: int, length: int, max_payload: int) -> Optional[tuple]:
    """The SEND of ``length`` bytes at ``mem[base]`` if it is a fast SEND: ``(user, [credits,
    acks, [slot, ...]], payload_start, nbytes)`` (the credit return as check_credit_return
    reads it); None if its tag says it is something else
    (:func:`decode_in_buffer` reads those); ProtocolError if it is a malformed fast SEND.
    Reads nothing outside ``mem[base:base+length]``."""
    return _parse_rfast(mem, base, length, max_payload, True)


def parse_rdma_fast_slot(mem, base: int, size: int, max_payload: int) -> Optional[tuple]:
    """The same for a WRITE WITH IMMEDIATE into the slot ``mem[base:base+size]`` (the
    completion says no length: the frame must fit the slot): the fast form of a large
    message; None if it is a DATA frame (:func:`decode_in_slot` reads those)."""
    return _parse_rfast(mem, base, size, max_payload, False)


def _parse_rfast(mem, base: int, length: int, max_payload: int, exact: bool) -> Optional[tuple]:
    if length < RFAST_SIZE:
        return None
    tag, k, credits, acks, ulen, slot = RFAST_HEAD.unpack_from(mem, base)
    if tag != TAG_RFAST:
        return None
    ret = [credits, acks, [slot - 1] if slot else []]
    if ulen > MAX_FAST_USER:
        raise ProtocolError(f"fast SEND: a {ulen}-byte header exceeds the limit of {MAX_FAST_USER}")
    off = rfast_offset(ulen)
    if k > max_payload or (off + k != length if exact else off + k > length):
        raise ProtocolError(f"fast SEND of {length} bytes: {ulen} B of header and {k} B of payload "
                            f"(limit {max_payload})")
    if not ulen:
        return {}, ret, base + off, k
    try:
        user = unpack_fast_user(mem[base + RFAST_SIZE:base + RFAST_SIZE + ulen])
    except Exception as e:
        raise ProtocolError(f"fast SEND: undecodable header: {e}") from None
    return user, ret, base + off, k


# -- registered buffers (rdma) ---------------------------------------------------------
def payload_offset(header_len: int) -> int:
    """Where the payload starts in an rdma slot: the next 64-byte boundary after the header."""
    return (PREFIX_SIZE + header_len + 63) & ~63


def _decode_at(mem, base: int, size: int, max_payload: int) -> tuple[int, int, int]:
    if size < PREFIX_SIZE:
        raise ProtocolError(f"a {size}-byte buffer cannot hold a frame")
    kind, hlen, plen = decode_prefix(mem[base:base + PREFIX_SIZE], max_payload=max_payload)
    if PREFIX_SIZE + hlen > size:
        raise ProtocolError(f"a {hlen}-byte header overruns its {size}-byte buffer")
    return kind, hlen, plen


def decode_in_buffer(mem, base: int, length: int, size: int, max_payload: int) -> tuple:
    """A frame that arrived by SEND: ``length`` bytes at ``mem[base]`` in a receive buffer of
    ``size`` bytes (header, then the payload right after the header's padding).
    ``(DATA, user, lens, extra, payload_start)`` or ``(CLOSE, None, None, None, 0)``."""
    if not PREFIX_SIZE <= length <= size:
        raise ProtocolError(f"a {length}-byte SEND is not a frame")
    kind, hlen, plen = _decode_at(mem, base, length, max_payload)
    if kind != DATA:
        if kind == CLOSE:
            return CLOSE, None, None, None, 0
        raise ProtocolError(f"unexpected {Kind(kind).name} frame")
    off = length - plen
    if off < PREFIX_SIZE + hlen:
        raise ProtocolError(f"a frame of {length} bytes is shorter than its prefix says")
    user, lens, extra = decode_header(mem[base + PREFIX_SIZE:base + PREFIX_SIZE + hlen], plen)
    return DATA, user, lens, extra, base + off


def decode_in_slot(mem, base: int, size: int, max_payload: int) -> tuple:
    """A frame that arrived by WRITE WITH IMMEDIATE into the slot ``mem[base:base+size]``:
    header first, payload at :func:`payload_offset`. ``(DATA, user, lens, extra,
    payload_start)``; anything else (CLOSE included: it never comes this way) raises."""
    kind, hlen, plen = _decode_at(mem, base, size, max_payload)
    if kind != DATA:
        raise ProtocolError(f"a {Kind(kind).name} frame in a slot")
    off = payload_offset(hlen)
    if off + plen > size:
        raise ProtocolError(f"a {plen}-byte payload overruns its slot")
    user, lens, extra = decode_header(mem[base + PREFIX_SIZE:base + PREFIX_SIZE + hlen], plen)
    return DATA, user, lens, extra, base + off


def check_credit_return(obj: Any) -> tuple[int, int, list]:
    """An rdma credit return ``[credits, acks, [slot, ...]]`` (a DATA frame's ``extra`` or a
    credit message), structurally valid; whether the peer may return them is the
    connection's to check."""
    if (type(obj) is not list or len(obj) != 3 or type(obj[0]) is not int or type(obj[1]) is not int
            or type(obj[2]) is not list or obj[0] < 0 or obj[1] < 0
            or any(type(s) is not int or s < 0 for s in obj[2])):
        raise ProtocolError(f"bad credit return {obj!r:.80}")
    return obj[0], obj[1], obj[2]


def decode_credit_message(buf) -> tuple[int, int, list]:
    """The body of an rdma credit message (a SEND WITH IMMEDIATE): msgpack credit return."""
    try:
        obj = _unpackb(buf, raw=False)
    except Exception as e:
        raise ProtocolError(f"undecodable credit message: {e}") from None
    return check_credit_return(obj)


# -- a convenience for tests and benchmarks ----------------------------------------------
@dataclass
class Frame:
    kind: int
    header: Any = None  # user header (DATA) or parameters (HELLO)
    lens: list = field(default_factory=list)
    extra: Any = None
    payload: Optional[memoryview] = None
    credits: int = 0


class FrameParser:
    """:func:`next_frame` fed with arbitrary chunks of bytes; yields complete :class:`Frame`s
    (payloads copied out: this is for tests and benchmarks, not the zero-copy path)."""

    def __init__(self, *, max_header: int = MAX_HEADER, max_payload: int = MAX_PAYLOAD):
        self.max_header = max_header
        self.max_payload = max_payload
        self._buf = bytearray()
        self._cur: Optional[tuple] = None  # a DATA frame whose payload is not all here

    def feed(self, data) -> list[Frame]:
        self._buf += data
        frames: list[Frame] = []
        view = memoryview(bytes(self._buf))  # a snapshot: an error's traceback may hold views
        pos, end = 0, len(view)
        try:
            while True:
                cur = self._cur
                if cur is None:
                    cur = next_frame(view, pos, end, self.max_header, self.max_payload)
                    if cur is None:
                        break
                    pos = cur[1]
                kind, _, header, lens, extra, n = cur
                if kind == DATA:
                    if end - pos < n:
                        self._cur = cur  # its header is consumed; wait for the payload
                        break
                    frames.append(Frame(kind, header, lens, extra, memoryview(bytes(view[pos:pos + n]))))
                    pos += n
                elif kind == CREDIT:
                    frames.append(Frame(kind, credits=n))
                else:
                    frames.append(Frame(kind, header))
                self._cur = None
        finally:
            del self._buf[:pos]
        return frames
