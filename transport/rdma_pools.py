"""rdma://'s send pool (header room in front of each slot, so one scatter entry covers a
frame's header and payload) and the per-message counters of the Python path
(transport/rdma_conn.py's RdmaConnection uses them)."""
from __future__ import annotations

from .pool import BufferPool, Slot


class RoomSlot(Slot):
    """A send slot that starts ``room`` bytes into its stride."""

    __slots__ = ()

    def __init__(self, pool: "RoomPool", index: int):
        self.pool = pool
        self.index = index
        self.offset = index * pool.stride + pool.room
        self.capacity = self.nbytes = pool.slot_size
        self.mem = pool.memory[self.offset:self.offset + self.capacity]


class RoomPool(BufferPool):
    """The send pool: like BufferPool, with ``room`` bytes of header space before each slot,
    so that one scatter entry covers the frame's header and the payload."""

    def __init__(self, room: int, slot_size: int, nslots: int, name: str):
        super().__init__(room + slot_size, nslots, name=name)
        self.room = room
        self.slot_size = slot_size  # what a caller's slot holds (try_alloc sizes by it)
        self._slots = [RoomSlot(self, i) for i in range(nslots)]


class Counters:
    """The per-message counters of one connection, where the compiled path does not run;
    transport/_rdmafast.c's Link has the same members, so either path can take the next
    message."""

    __slots__ = ("tx_credits", "ctrl_budget", "sq_used", "unsig", "wr_seq", "owed_credits", "owed_acks",
                 "unreturned", "inline_sends")

    def __init__(self) -> None:
        self.tx_credits = 0  # messages we may send: the peer's free receives
        self.ctrl_budget = 0  # credit messages we may send
        self.sq_used = 0  # send queue entries not completed
        self.unsig = 0  # records posted since the last signaled one
        self.wr_seq = 0
        self.owed_credits = 0  # released messages whose credit has not gone back
        self.owed_acks = 0  # credit messages received and not acknowledged
        self.unreturned = 0  # data messages received whose credit has not gone back yet
        self.inline_sends = 0  # messages whose bytes went in the work request
