"""rdma://'s compiled fast-SEND parser (transport/_rdmafast.c) against framing's, without a
device: what the receive path makes of the bytes a SEND left in a receive buffer."""
from __future__ import annotations

from .. import framing
from ..errors import ProtocolError
from ..rdma_conn import _rdmafast


def check_parse(data: bytes, length: int, max_payload: int, slot: bool = False) -> None:
    """For a SEND of ``length`` bytes (at most ``len(data)``: the device never completes more
    than the buffer holds), or with ``slot`` a WRITE WITH IMMEDIATE into a slot of ``length``
    bytes: the compiled parser takes exactly what framing.parse_rdma_fast (_slot) takes, with
    the same result, and declines everything else (which the Python path then reads, and
    raises for if it is malformed)."""
    assert 0 <= length <= len(data)
    parse = framing.parse_rdma_fast_slot if slot else framing.parse_rdma_fast
    try:
        want = parse(data, 0, length, max_payload)
    except ProtocolError:
        want = None
    if want is not None:
        _, ret, start, k = want
        framing.check_credit_return(ret)  # the form every credit return has
        assert framing.RFAST_SIZE <= start and k <= max_payload
        assert start + k <= length if slot else start + k == length
    if _rdmafast is None:
        return
    got = _rdmafast.parse(data, length, max_payload, slot)
    assert got == want, (got, want)
