"""Requests and rounds as data: what a token batch is inside the gateway across its
attempts, and what one dispatch round carries, was sent and got back.

The round book (gateway/rounds.py) owns their life cycle; the combine (gateway/combine.py)
reads their replies; nothing here sends or decides.
"""
from __future__ import annotations

import resource
import time
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

import numpy as np

from gateway.dispatch import ChunkSum, DispatchPlan, SumBuffers
from gateway.router import Routing
from workers import protocol as P

__all__ = ["WorkerError", "NoHealthyWorker", "BatchStats", "Request", "Round", "n_ids", "slots_per_token",
           "minor_faults"]


class WorkerError(RuntimeError):
    """A request failed because of a worker (closed, timed out, error reply, bad reply)."""

    code = P.WORKER_FAILED


class NoHealthyWorker(WorkerError):
    """No healthy worker hosts an expert the request needs."""

    code = P.UNAVAILABLE



@dataclass
class BatchStats:
    """Per-round timing (seconds) and sizes. ``compute_s`` is the slowest worker's own
    measurement (the critical path); ``wait_s`` is from the last send to the last reply,
    so ``wait_s - compute_s`` is roughly what the transport and queueing cost."""

    requests: int = 0
    tokens: int = 0
    rows: int = 0
    workers: int = 0
    dropped: int = 0
    overflow: int = 0
    retried: int = 0
    queue_s: float = 0.0  # the longest a request of this round waited to be dispatched
    route_s: float = 0.0
    dispatch_s: float = 0.0
    gather_s: float = 0.0  # the part of dispatch_s that copies tokens into the send slots
    compute_s: float = 0.0
    compute_total_s: float = 0.0
    wait_s: float = 0.0
    combine_s: float = 0.0
    # the gateway thread's CPU time in route, dispatch and combine: the wall-clock stages also
    # count the time it was preempted, by workers sharing its cores say
    own_cpu_s: float = 0.0
    total_s: float = 0.0
    messages: int = 0  # messages sent (more than ``workers`` when parts went in chunks)
    busiest_s: float = 0.0  # the busiest worker's time handling this round's messages (its
    # own receive-to-reply clocks), so total_s - busiest_s is its time with no token to compute

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}



class Request:
    """One token batch inside the gateway, across its attempts."""

    __slots__ = ("x", "tag", "layer", "routing", "plan", "pins", "error", "attempts", "round", "bases", "waiting",
                 "finished", "arrived", "acc", "out", "used", "served")

    def __init__(self, x: np.ndarray, tag: Any = None, layer: int = P.DEFAULT_LAYER,
                 out: Optional[np.ndarray] = None):
        self.x: Optional[np.ndarray] = x
        self.tag = tag  # the caller's (the server keeps the client connection and message there)
        self.layer = layer
        self.routing: Optional[Routing] = None
        self.plan: Optional[DispatchPlan] = None
        self.pins: dict = {}  # expert -> the weights version a hot update decided for this request
        self.used: dict = {}  # expert -> the version every group of its rows was pinned to (the answer's)
        self.served: Optional[int] = None  # the served set's generation when it was routed
        self.error: Optional[Exception] = None
        self.attempts = 0
        self.round: Optional["Round"] = None
        self.bases: dict = {}  # worker -> first row of this request in the worker's block
        self.waiting: set = set()  # workers whose reply this request still needs
        self.finished = False
        self.arrived = time.perf_counter()
        self.acc: Optional[ChunkSum] = None  # float32 sum of a chunked round's replies so far
        # where the caller wants the output, if known when it is dispatched: a float32 one is
        # a chunked round's sum itself, so nothing is copied once the last chunk is in
        self.out = out

    @property
    def num_tokens(self) -> int:
        return 0 if self.x is None else int(self.x.shape[0])

    def versions(self) -> list:
        """[[expert, version], ...] pinned for this request (during a hot update)."""
        return [[e, v] for e, v in sorted(self.pins.items())]

    def expert_versions(self) -> list:
        """[[expert, version], ...] of every expert that computed rows of this request."""
        return [[e, v] for e, v in sorted(self.used.items())]

    def drop_sum(self) -> None:
        """Its chunked sum is done with (combined, or its round given up)."""
        acc, self.acc = self.acc, None
        if acc is not None:
            acc.release()

    def release(self) -> None:
        """Done with this request's outputs: its share of the replies goes back."""
        rnd, self.round = self.round, None
        if rnd is not None:
            rnd.detach(self)
        self.drop_sum()
        self.x = self.out = None



class Round:
    def __init__(self, rid: int, requests: list, deadline: float, layer: int = P.DEFAULT_LAYER,
                 sums: Optional[SumBuffers] = None):
        self.id = rid
        self.sums = sums  # where its requests' float32 sums are taken from
        self.placement_version = 0  # the expert placement it was planned under
        self.layer = layer
        self.requests = requests
        self.deadline = deadline
        self.rows: dict = {}  # worker -> rows of its part
        self.bounds: dict = {}  # worker -> its part's chunk offsets [0, ..., rows] ([0, rows]: one message)
        self.groups: dict = {}  # worker -> its part's groups (expert, start, count[, version])
        self.replies: dict = {}  # worker -> per chunk: (Message, (rows, d) view), or None
        self.nchunks: dict = {}  # worker -> messages its part goes in
        self.left: dict = {}  # worker -> chunks not answered yet
        self.left_rows: dict = {}  # worker -> rows not answered yet (they count as its load)
        self.sent: dict = {}  # worker -> chunks sent
        self.last_reply: dict = {}  # worker -> (its reply clock t_out, our receive time) of its last chunk
        self.sent_t: dict = {}  # (worker, chunk) -> when we sent it (chunked parts only)
        self.gather_t: dict = {}  # (worker, chunk) -> when we began its gather (chunks after the first)
        self.answered: set = set()  # (worker, chunk) answered
        self.busy: dict = {}  # worker -> its seconds handling our messages (receive to reply)
        self.compute: dict = {}  # worker -> its compute seconds
        self.msg_ids: list = []  # (worker, message id) of its chunks (the book maps them back)
        self.outstanding: set = set()  # workers whose part has not been answered (nor failed)
        self.alone = True  # no other round was out during its life (its idle times are its own)
        self.eligible = False  # auto, and the size model would chunk it (ChunkMode measures these)
        self.users: dict = {}  # worker -> requests of this round still using its reply
        # a round timed for the chunk choice: called with its seconds from its plan to its
        # last request's combine, once that is done (to_combine: requests still to combine)
        self.on_combined: Optional[Callable[["Round", float], None]] = None
        self.to_combine = 0
        self.stats = BatchStats(requests=len(requests))
        self.worker_faults = 0  # minor page faults its workers' replies said they took
        self._faults0 = minor_faults()
        self._t0 = time.perf_counter()
        self.sent_at = self._t0
        self.started = time.monotonic()

    def combined(self) -> None:
        """One of its requests was combined: the last one ends a timed round's clock."""
        if self.on_combined is not None:
            self.to_combine -= 1
            if self.to_combine <= 0:
                done, self.on_combined = self.on_combined, None
                done(self, time.perf_counter() - self._t0)

    @property
    def faults(self) -> int:
        """Minor page faults taken while it was out, here and (as their replies said) on its
        workers: a round that wrote fresh memory (a new slot's pages, a first large batch)
        pays for it, once, in its time."""
        return max(0, minor_faults() - self._faults0) + self.worker_faults  # (0 if read on another thread)

    def detach(self, req: Request) -> None:
        for w in req.bases:
            n = self.users.get(w, 0) - 1
            self.users[w] = n
            if n <= 0 and w in self.replies:
                self.release_replies(w)

    def release_replies(self, w: int) -> None:
        for got in self.replies.pop(w, ()):
            if got is not None:
                got[0].release()

    @property
    def chunked(self) -> bool:
        return any(len(b) > 2 for b in self.bounds.values())

    def chunks_of(self, req: Request, w: int) -> range:
        """The chunks of worker ``w``'s part that hold ``req``'s rows."""
        base, b = req.bases[w], self.bounds[w]
        return range(bisect_right(b, base) - 1, bisect_left(b, base + req.plan.worker_tokens(w)))

    def chunk_bounds(self, w: int, c: int) -> tuple[int, int]:
        b = self.bounds[w]
        return b[c], b[c + 1]

    @property
    def settled(self) -> bool:
        """Every part answered or failed, and no request uses a reply any more."""
        return not self.outstanding and not self.replies



def n_ids(router) -> int:
    """Expert ids a router routes to: a FamilyRouter's shared pieces included."""
    return int(getattr(router, "n_ids", router.n_experts))


def slots_per_token(router) -> int:
    """Rows one token may occupy: top-k, plus a FamilyRouter's shared pieces."""
    return int(router.top_k + getattr(router, "n_shared", 0))



# the serve loop's own thread: it writes the gateway's fresh memory (gathers, combines), and
# asking for one thread is cheaper than summing every thread of the process
_RUSAGE = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


def minor_faults() -> int:
    """Minor page faults so far of the calling thread (of the process where threads cannot be asked)."""
    return resource.getrusage(_RUSAGE).ru_minflt


