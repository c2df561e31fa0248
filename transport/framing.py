"""Wire framing with no I/O in it (in the style of h11): bytes in, validated parts out.

A frame is::

    prefix  16 bytes  b"MT" | version u8 | kind u8 | header_len u32 | payload_len u64
    header  msgpack   [user_header, [len_0, len_1, ...], extra]   (DATA frames)
                      {handshake parameters}                      (HELLO frames)
    payload           the buffers back to back, sum(len_i) == payload_len

CREDIT frames carry no header and no payload: payload_len is the number of credits
returned. CLOSE frames say goodbye. Every length is checked against hard limits before
anything is allocated or read, so a hostile peer cannot make us reserve memory.

Byte-stream backends (tcp) drive :class:`FrameDecoder` themselves so that the payload
goes straight from the socket into a pool slot; :class:`FrameParser` is the same state
machine fed with plain bytes, for tests and for anything that is not zero-copy.
"""
from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field
from typing import Any, Sequence

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


_KINDS = frozenset(int(k) for k in Kind)
_packer = msgpack.Packer(use_bin_type=True)
_EMPTY_HEADER = _packer.pack([{}, [], None])


def encode_prefix(kind: int, header_len: int, payload_len: int) -> bytes:
    return PREFIX.pack(MAGIC, VERSION, kind, header_len, payload_len)


def decode_prefix(
    buf, *, max_header: int = MAX_HEADER, max_payload: int = MAX_PAYLOAD
) -> tuple[int, int, int]:
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
    if kind == Kind.CREDIT:
        if hlen:
            raise ProtocolError("CREDIT frame with a header")
        return kind, hlen, plen  # plen is the credit count, not bytes on the wire
    if kind == Kind.DATA and hlen == 0:
        raise ProtocolError("DATA frame without a header")
    if kind != Kind.DATA and plen:
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
        obj = msgpack.unpackb(buf, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable header: {e}") from None
    if not (isinstance(obj, list) and len(obj) == 3 and isinstance(obj[1], list)):
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
    return [encode_prefix(Kind.HELLO, len(body), 0), body]


def decode_hello(buf) -> dict:
    try:
        obj = msgpack.unpackb(buf, raw=False)
    except Exception as e:
        raise ProtocolError(f"undecodable handshake: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("handshake is not a map")
    return obj


def frame_data(user_header: Any, payloads: Sequence, extra: Any = None) -> list:
    """The gather list [prefix, header, *payloads] for one DATA frame (no copies)."""
    lens = [memoryview(p).nbytes for p in payloads]
    head = encode_header(user_header, lens, extra)
    return [encode_prefix(Kind.DATA, len(head), sum(lens)), head, *payloads]


def frame_credit(count: int) -> bytes:
    return encode_prefix(Kind.CREDIT, 0, count)


def frame_close() -> bytes:
    return encode_prefix(Kind.CLOSE, 0, 0)


@dataclass
class Frame:
    kind: int
    header: Any = None  # user header (DATA) or parameters (HELLO)
    lens: list = field(default_factory=list)
    extra: Any = None
    payload: memoryview | None = None
    credits: int = 0


class FrameDecoder:
    """The receive state machine: says what it needs next, validates what it gets.

    states: "prefix" -> ("header" -> "payload"?) -> back to "prefix".
    The caller reads exactly ``need`` bytes for the current state into a buffer of its
    choice (the payload into a pool slot) and hands them over.
    """

    def __init__(self, *, max_header: int = MAX_HEADER, max_payload: int = MAX_PAYLOAD):
        self.max_header = max_header
        self.max_payload = max_payload
        self.state = "prefix"
        self.need = PREFIX_SIZE
        self.kind = 0
        self.header_len = 0
        self.payload_len = 0
        self.header: Any = None
        self.lens: list = []
        self.extra: Any = None

    def prefix(self, buf) -> None:
        assert self.state == "prefix"
        self.kind, self.header_len, self.payload_len = decode_prefix(
            buf, max_header=self.max_header, max_payload=self.max_payload
        )
        self.header, self.lens, self.extra = None, [], None
        if self.header_len:
            self.state, self.need = "header", self.header_len
        else:
            self.state, self.need = "done", 0

    def header_bytes(self, buf) -> None:
        assert self.state == "header"
        if self.kind == Kind.DATA:
            self.header, self.lens, self.extra = decode_header(buf, self.payload_len)
        else:
            self.header = decode_hello(buf)
        if self.kind == Kind.DATA and self.payload_len:
            self.state, self.need = "payload", self.payload_len
        else:
            self.state, self.need = "done", 0

    def payload(self) -> None:
        assert self.state == "payload"
        self.state, self.need = "done", 0

    def reset(self) -> None:
        self.state, self.need = "prefix", PREFIX_SIZE


class FrameParser:
    """FrameDecoder fed with arbitrary chunks of bytes; yields complete :class:`Frame`s."""

    def __init__(self, **limits):
        self._dec = FrameDecoder(**limits)
        self._buf = bytearray()

    def feed(self, data) -> list[Frame]:
        self._buf += data
        frames: list[Frame] = []
        dec = self._dec
        payload = b""
        while len(self._buf) >= dec.need:
            n = dec.need
            chunk = bytes(self._buf[:n])
            del self._buf[:n]
            if dec.state == "prefix":
                dec.prefix(chunk)
            elif dec.state == "header":
                dec.header_bytes(chunk)
            else:
                payload = chunk
                dec.payload()
            if dec.state == "done":
                f = Frame(dec.kind, dec.header, dec.lens, dec.extra)
                if dec.kind == Kind.CREDIT:
                    f.credits = dec.payload_len
                elif dec.kind == Kind.DATA:
                    f.payload = memoryview(payload)
                frames.append(f)
                dec.reset()
                payload = b""
        return frames
