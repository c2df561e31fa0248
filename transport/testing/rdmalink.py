"""rdma://'s compiled fast-SEND parser (transport/_rdmafast.c) against framing's, without a
device: what the receive path makes of the bytes a SEND left in a receive buffer."""
from __future__ import annotations

from .. import framing
from ..errors import ProtocolError
from ..rdma_conn import _rdmafast


def check_parse(data: bytes, length: int, max_payload: int) -> None:
    """For a SEND of ``length`` bytes (at most ``len(data)``: the device never completes more
    than the buffer holds): the compiled parser takes exactly what framing.parse_rdma_fast
    takes, with the same result, and declines everything else (which the Python path then
    reads, and raises for if it is a malformed fast SEND)."""
    assert 0 <= length <= len(data)
    try:
        want = framing.parse_rdma_fast(data, 0, length, max_payload)
    except ProtocolError:
        want = None
    if want is not None:
        _, _, _, start, k = want
        assert framing.RFAST_SIZE <= start and start + k == length and k <= max_payload
    if _rdmafast is None:
        return
    got = _rdmafast.parse(data, length, max_payload)
    assert got == want, (got, want)
