"""shm://'s record sizes and layouts, shared by its connection's send and receive sides
(transport/shm.py, shm_send.py, shm_recv.py)."""
from __future__ import annotations

import struct

import msgpack

from . import framing
from .framing import FAST_HEAD, FAST_SIZE
from .shmring import REC_HDR, pow2
from .timing import SHM_NAP, SHM_SPIN, SHM_SPIN_MIN

# a record holds at most a prefix and a MAX_HEADER header; twice that always fits the ring
MAX_RECORD = framing.PREFIX_SIZE + framing.MAX_HEADER + 64
RING_BYTES = pow2(2 * MAX_RECORD + 64)  # 256 KiB
MAX_RING = 64 << 20
SPIN, SPIN_MIN, NAP = SHM_SPIN, SHM_SPIN_MIN, SHM_NAP  # the historical names
_pack = msgpack.Packer(use_bin_type=True).pack
_REC_LEN = struct.Struct("<I")  # the ring's record length word (transport/shmring.py)
_MAX_HEADER, _MAX_BUFFERS = framing.MAX_HEADER, framing.MAX_BUFFERS
_MAX_RECORD_LEN = framing.PREFIX_SIZE + _MAX_HEADER  # the longest one-slot record the fast path writes
# the ring's record header (u32 length, u32 spare) and framing's fast record, packed in one go
_FAST_REC = struct.Struct("<II" + FAST_HEAD.format.lstrip("<"))
_FAST_OFF = REC_HDR + FAST_SIZE  # where the user header starts, from the record header
