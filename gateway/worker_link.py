"""What the gateway knows about one worker: its link (URL, connection, what it hosts and
holds, counters, health), and the shape every worker of a gateway must serve.

gateway/workers.py connects, watches and reconnects the links; the round book, admission
and the hot update read and update them.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from gateway.chunking import ChunkCosts, ChunkSizer
from transport.service.backoff import Backoff
from transport.service.secrets import is_loopback
from workers import protocol as P

__all__ = ["Health", "LayerShape", "WorkerLink", "worker_layers", "check_layers"]


RECONNECT_BACKOFF = (0.05, 0.5)  # first and longest wait between reconnection attempts

class Health(str, enum.Enum):
    ADMITTING = "admitting"  # connected, being brought to the served weights (gateway/admission.py)
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"
    LOST = "lost"
    REFUSED = "refused"
    REMOVED = "removed"  # taken out of the gateway (moe-gateway workers remove): never reconnected


@dataclass(frozen=True)
class LayerShape:
    """What every worker must serve for this gateway (checked at every (re)connect).

    ``layers``: {layer: expert ids it has (routed + shared pieces)}, default {0: n_experts};
    ``fingerprints``: {layer: the fingerprint of the checkpoint layer the gateway read}, None
    (or a layer missing) for demo weights. A worker must serve only these layers, with the
    same fingerprints."""

    d_model: int
    dtype: np.dtype
    max_rows: int  # the most rows one round may send one worker
    n_experts: int
    layers: Optional[dict] = None
    fingerprints: Optional[dict] = None

    @property
    def row_bytes(self) -> int:
        return self.d_model * self.dtype.itemsize

    @property
    def n_ids(self) -> dict:
        """{layer: expert ids}"""
        return dict(self.layers) if self.layers else {P.DEFAULT_LAYER: self.n_experts}

    def fingerprint(self, layer: int) -> Optional[str]:
        return (self.fingerprints or {}).get(layer)


def worker_layers(info: dict) -> dict:
    """{layer: (sorted ids, fingerprint or None)} from a worker's info (``layers``, or the
    ``experts`` of layer 0 from a worker that does not list layers)."""
    if "layers" in info:
        return {int(L): (sorted(int(e) for e in ids), fp) for L, ids, fp in info["layers"]}
    return {P.DEFAULT_LAYER: (sorted(int(e) for e in info.get("experts", [])), None)}


def check_layers(info: dict, shape: LayerShape, url: str) -> dict:
    """The worker's layers, or ValueError when it serves another checkpoint (or layers, or
    demo weights where the gateway serves a checkpoint, or the reverse)."""
    got = worker_layers(info)
    want = shape.n_ids
    extra = sorted(set(got) - set(want))
    if extra:
        raise ValueError(f"worker {url} serves layers {extra}, which this gateway does not serve "
                         f"(layers {sorted(want)}): start both with the same --layers")
    for L, (_, fp) in got.items():
        mine = shape.fingerprint(L)
        if fp == mine:
            continue
        if mine is None:
            raise ValueError(f"worker {url} serves layer {L} of a checkpoint (fingerprint {fp[:12]}), this "
                             f"gateway serves demo weights: start the gateway with --checkpoint")
        if fp is None:
            raise ValueError(f"worker {url} serves demo weights, this gateway serves layer {L} of a "
                             f"checkpoint (fingerprint {mine[:12]}): start the worker with --checkpoint")
        raise ValueError(f"worker {url} read layer {L} with fingerprint {fp[:12]}, this gateway read "
                         f"{mine[:12]}: they do not read the same checkpoint")
    return got


@dataclass
class WorkerLink:
    """What the gateway knows about one worker (index = its column in dispatch plans)."""

    index: int
    url: str
    conn: Any = None
    experts: list = field(default_factory=list)  # every id it hosts, over all layers
    layers: dict = field(default_factory=dict)  # layer -> frozenset of the ids it hosts there
    versions: dict = field(default_factory=dict)  # (layer, expert) -> active version
    held: dict = field(default_factory=dict)  # (layer, expert) -> versions the worker holds
    weights: dict = field(default_factory=dict)  # (layer, expert) -> {version: (fingerprint, source)}
    admitted_at: Optional[float] = None  # when it was last made healthy after connecting
    max_experts: int = 0  # physical copies it may host (its info's max_experts)
    parked: bool = False  # drained by the gateway: no copy is placed on it
    kernel: dict = field(default_factory=dict)  # its kernel as it describes it (kind, dtype, threads)
    max_tokens: int = 0
    d_ff: Optional[int] = None  # as its info said (reported, not needed by the gateway)
    state: Health = Health.LOST
    why: str = ""  # the last failure, for error messages
    outstanding_rows: int = 0
    rows_sent: int = 0
    batches_sent: int = 0
    failures: int = 0
    reconnects: int = 0
    refusals: int = 0
    compute_seconds: float = 0.0
    expert_rows: dict = field(default_factory=dict)  # (layer, expert_id) -> rows sent
    cpu_s: float = 0.0  # the worker process's CPU seconds, as its last reply said
    faults: Optional[int] = None  # the worker process's minor page faults, as its last reply said
    seconds_per_row: Optional[float] = None  # its compute per row (cost_seconds / cost_rows)
    cost_seconds: float = 0.0  # decayed sums of the compute its replies reported ...
    cost_rows: float = 0.0  # ... and of their rows
    chunk_costs: ChunkCosts = field(default_factory=ChunkCosts)  # what sizes its chunks (gateway/chunking.py)
    chunk_sizer: ChunkSizer = field(default_factory=ChunkSizer)  # the size, from those costs
    pid: Optional[int] = None
    last_heard: float = 0.0
    ping_sent: Optional[float] = None
    next_attempt: float = 0.0
    backoff: Backoff = field(default_factory=lambda: Backoff(*RECONNECT_BACKOFF))
    connecting: bool = False
    control_queue: list = field(default_factory=list)  # control headers waiting for a busy connection

    @property
    def usable(self) -> bool:
        return self.state == Health.HEALTHY

    @property
    def admitted(self) -> bool:
        """Connected and past admission (healthy, unhealthy or draining)."""
        return self.conn is not None and self.state in (Health.HEALTHY, Health.UNHEALTHY, Health.DRAINING)

    def loaded(self, key: tuple, version: int, fingerprint: str, source: Any) -> None:
        """It acknowledged loading ``version`` of ``key`` (a key it did not host: a new copy,
        active at that version)."""
        self.weights.setdefault(key, {})[version] = (fingerprint, source)
        self.held.setdefault(key, set()).add(version)
        if not self.hosts(key[1], key[0]):
            self.layers = {**self.layers, key[0]: self.layers.get(key[0], frozenset()) | {key[1]}}
            self.experts = sorted({e for ids in self.layers.values() for e in ids})
            self.versions[key] = version

    def unhosted(self, key: tuple) -> None:
        """It acknowledged dropping its copy of ``key``."""
        self.weights.pop(key, None)
        self.held.pop(key, None)
        self.versions.pop(key, None)
        L, e = key
        if e in self.layers.get(L, ()):
            self.layers = {**self.layers, L: self.layers[L] - {e}}
            self.experts = sorted({x for ids in self.layers.values() for x in ids})

    def retired(self, key: tuple, version: int, active: int) -> None:
        """It acknowledged retiring ``version`` of ``key``; ``active`` is active now."""
        self.weights.get(key, {}).pop(version, None)
        self.held.get(key, set()).discard(version)
        self.versions[key] = active

    @property
    def local(self) -> bool:
        """On this machine (shm://, a loopback address): the times its replies carry are on
        our clock. (A worker in a network namespace here is too, but cannot be told apart
        from one elsewhere by its URL.)"""
        return is_loopback(self.url)

    def record_compute(self, seconds: float, rows: int) -> None:
        """A reply's compute time for ``rows`` rows: the worker's speed for least-loaded
        balancing, as a ratio of decayed sums, so blocks weigh by their rows (a mean of
        per-reply ratios would let one-row replies, nearly all fixed cost, make it look slow)."""
        if rows <= 0:
            return
        self.cost_seconds = 0.9 * self.cost_seconds + seconds
        self.cost_rows = 0.9 * self.cost_rows + rows
        self.seconds_per_row = self.cost_seconds / self.cost_rows

    def faults_since(self, flt: Any) -> int:
        """The minor page faults the worker took since its last reply, from a reply's
        ``flt`` (its count so far); 0 when the reply does not say. A count below the last
        one is a restarted worker's: it counts from zero. The first reply counts all of it
        (a worker's first rounds are its start-up)."""
        if not isinstance(flt, int) or isinstance(flt, bool) or flt < 0:
            return 0
        last, self.faults = self.faults, flt
        return flt if last is None or flt < last else flt - last

    def hosts(self, expert: int, layer: int = P.DEFAULT_LAYER) -> bool:
        ids = self.layers.get(layer)
        return ids is not None and expert in ids

    @property
    def connected(self) -> bool:
        return self.conn is not None

    # boolean views of ``state``, for the metrics and tests that read them
    @property
    def healthy(self) -> bool:
        return self.state in (Health.HEALTHY, Health.DRAINING)

    @property
    def draining(self) -> bool:
        return self.state == Health.DRAINING

    @property
    def closed(self) -> bool:
        return self.conn is None

    def describe(self) -> str:
        s = self.state.value
        return f"{self.url} [{s}{': ' + self.why if self.why and s != 'healthy' else ''}]"

    def as_dict(self) -> dict:
        return {"url": self.url, "state": self.state.value, "experts": list(self.experts), "d_ff": self.d_ff,
                "healthy": self.usable, "draining": self.draining, "closed": self.closed, "why": self.why,
                "outstanding_rows": self.outstanding_rows, "rows_sent": self.rows_sent,
                "batches_sent": self.batches_sent, "failures": self.failures, "reconnects": self.reconnects,
                "compute_seconds": self.compute_seconds, "cpu_s": self.cpu_s, "pid": self.pid,
                "seconds_per_row": self.seconds_per_row,
                "message_s": self.chunk_costs.msg_s, "chunk_reprobes": self.chunk_sizer.reprobes,
                "layers": [[L, sorted(ids)] for L, ids in sorted(self.layers.items())], "kernel": dict(self.kernel),
                "versions": [P.with_layer([e, v, sorted(self.held.get((L, e), {v}))], L)
                             for (L, e), v in sorted(self.versions.items())],
                "expert_rows": [P.with_layer([e, n], L) for (L, e), n in sorted(self.expert_rows.items())],
                "transport": self.conn.stats.as_dict() if self.conn is not None else {}}
