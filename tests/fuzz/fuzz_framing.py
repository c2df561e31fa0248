"""Coverage-guided fuzzing (atheris) of the parsers every receive path runs (transport/framing.py).

    python tests/fuzz/fuzz_framing.py -atheris_runs=100000        # or any libFuzzer flag
    python tests/fuzz/fuzz_framing.py CORPUS_DIR -max_total_time=600

The first input byte picks the target -- tcp's next_frame walk, shm's record parsers
(fast and full, which must agree), rdma's receive-buffer, slot and credit-message
decoders, the handshake's HELLO, shm's negotiated fast record, and that record through
the compiled path (transport/_shmfast.c) against the Python one, rdma's fast SEND through
framing and the compiled parser (transport/_rdmafast.c) -- and the rest is what a
peer wrote. Any exception other than ProtocolError, any result that points outside the
input, or a fast path that disagrees with the full validation, is a crash (atheris saves
the input).
tests/test_fuzz_parsers.py holds the hypothesis properties of the same targets.
"""
from __future__ import annotations

import os
import sys

import atheris

with atheris.instrument_imports():
    from transport import framing, shm
    from transport.errors import ProtocolError
    from transport.testing import rdmalink, shmlink

MAX_HEADER, MAX_PAYLOAD = 4096, 1 << 16
SLOT_SIZE, NSLOTS = 4096, 8
SMALL = 512


def _next_frame(data: bytes) -> None:
    view = memoryview(data)
    pos, end = 0, len(data)
    while True:
        f = framing.next_frame(view, pos, end, MAX_HEADER, MAX_PAYLOAD)
        if f is None:
            return
        kind, nxt, _, lens, _, n = f
        assert pos < nxt <= end
        if kind == framing.DATA:
            assert sum(lens) == n <= MAX_PAYLOAD and len(lens) <= framing.MAX_BUFFERS
            if nxt + n > end:
                return
            pos = nxt + n
        else:
            pos = nxt


def _records(data: bytes) -> None:
    fast = framing.parse_slot_record(data, 0, len(data), SLOT_SIZE, NSLOTS)
    try:
        full = framing.parse_record(data, 0, len(data), SLOT_SIZE, NSLOTS)
    except ProtocolError:
        assert fast is None, "the fast path accepted a record the full validation refuses"
        return
    if fast is not None:
        user, s, k = fast
        assert full == (framing.DATA, user, [k], [s, 0], k)
    if full[0] == framing.DATA:
        _, _, lens, extra, plen = full
        assert sum(lens) == plen <= SLOT_SIZE
        for i, k in enumerate(lens):
            assert 0 <= extra[2 * i] < NSLOTS and 0 <= extra[2 * i + 1] <= SLOT_SIZE - k


def _fast_record(data: bytes) -> None:
    got = framing.parse_fast_record(data, 0, len(data), SLOT_SIZE, NSLOTS)
    if got is not None:  # a fast record is a descriptor inside the pool and nothing else
        _, s, k = got
        assert 0 <= s < NSLOTS and 0 <= k <= SLOT_SIZE and len(data) <= framing.MAX_FAST_RECORD
        assert framing.parse_slot_record(data, 0, len(data), SLOT_SIZE, NSLOTS) is None
        try:
            framing.parse_record(data, 0, len(data), SLOT_SIZE, NSLOTS)
        except ProtocolError:
            return
        raise AssertionError("the full validation accepted a fast record")


def _in_buffer(data: bytes) -> None:
    got = framing.decode_in_buffer(data, 0, len(data), max(SMALL, len(data)), MAX_PAYLOAD)
    if got[0] == framing.DATA:
        assert 16 <= got[4] and got[4] + sum(got[2]) <= len(data)


def _in_slot(data: bytes) -> None:
    got = framing.decode_in_slot(data, 0, len(data), MAX_PAYLOAD)
    assert got[4] + sum(got[2]) <= len(data)


def _credits(data: bytes) -> None:
    credits, acks, slots = framing.decode_credit_message(data)
    assert credits >= 0 and acks >= 0 and all(s >= 0 for s in slots)


def _hello(data: bytes) -> None:
    if len(data) >= framing.PREFIX_SIZE:
        framing.decode_prefix(data[:framing.PREFIX_SIZE], max_header=MAX_HEADER)
    assert isinstance(framing.decode_hello(data[framing.PREFIX_SIZE:]), dict)


def _native_record(data: bytes) -> None:
    """The first 2 bytes place the record in the ring (near its end: padding, a cut-off
    record), the next 4 are the length it announces, the rest is the record."""
    if not shm.NATIVE_AVAILABLE or len(data) < 6:
        return
    head = int.from_bytes(data[:2], "little") % (2 * shmlink.RING)
    n = int.from_bytes(data[2:6], "little")
    rec = data[6:]
    shmlink.check_recv(rec, head, n, head + ((min(n, 1 << 20) + 15) & ~7))


def _rdma_fast(data: bytes) -> None:
    """The first 2 bytes cut the SEND's length short of the buffer (a completion never says
    more than the buffer holds) and pick the payload limit and SEND or slot, the rest is what
    the peer wrote: rdma's fast frame through framing and through the compiled parser
    (transport/_rdmafast.c), which must agree."""
    if len(data) < 2:
        return
    buf = data[2:]
    rdmalink.check_parse(buf, max(0, len(buf) - data[0] % 65), MAX_PAYLOAD if data[1] & 1 else SMALL,
                         slot=bool(data[1] & 2))


TARGETS = [_next_frame, _records, _in_buffer, _in_slot, _credits, _hello, _fast_record, _native_record, _rdma_fast]


def test_one_input(data: bytes) -> None:
    if not data:
        return
    target = TARGETS[data[0] % len(TARGETS)]
    try:
        target(data[1:])
    except ProtocolError:
        pass


def _seeds() -> list[bytes]:
    """Valid inputs for every target, so the fuzzer starts past the magic numbers."""
    data = b"".join(bytes(memoryview(p)) for p in framing.frame_data({"op": "x", "n": [1, 2]}, [b"abc", b"de"], 3))
    rec = bytearray(framing.SLOT_OVERHEAD + 4)
    framing.pack_slot_frame(rec, 0, b"\x81\xa1k\x01", 100, 2)  # user header {"k": 1}
    head = framing.encode_header({"a": 1}, [4], [1, 0, [2]])
    send = framing.encode_prefix(framing.DATA, len(head), 4) + head + b"\0" * (-(16 + len(head)) % 64) + b"wxyz"
    slot = (framing.encode_prefix(framing.DATA, len(head), 4) + head).ljust(framing.payload_offset(len(head)), b"\0")
    return [bytes([0]) + data + framing.frame_credit(2) + framing.frame_close(), bytes([1]) + bytes(rec),
            bytes([2]) + send, bytes([3]) + slot + b"wxyz", bytes([4]) + b"\x93\x01\x00\x91\x02",
            bytes([5]) + b"".join(framing.encode_hello({"slot_size": 4096, "nslots": 4})),
            bytes([6]) + framing.FAST_HEAD.pack(framing.TAG_FAST, 2, 100) + b"\x81\xa1k\x01",
            bytes([7]) + (4000).to_bytes(2, "little") + (20).to_bytes(4, "little")
            + framing.FAST_HEAD.pack(framing.TAG_FAST, 2, 100) + b"\x81\xa1k\x01",
            bytes([8, 0, 1]) + framing.RFAST_HEAD.pack(framing.TAG_RFAST, 4, 1, 0, 4, 3) + b"\x81\xa1k\x01"
            + b"\0" * 44 + b"wxyz"]


def main(argv: list[str]) -> None:
    argv = list(argv)
    if not any(not a.startswith("-") for a in argv[1:]):  # no corpus dir given: seed one
        import tempfile
        corpus = tempfile.mkdtemp(prefix="fuzz-framing-")
        for i, seed in enumerate(_seeds()):
            with open(os.path.join(corpus, f"seed-{i}"), "wb") as f:
                f.write(seed)
        argv.append(corpus)
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
