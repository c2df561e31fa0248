"""The message schema spoken over moe-transport connections, on both hops:

    client --(forward, ping)--> gateway --(info, ping, forward)--> worker

One module owns it so that the worker, the gateway's pool, its server and the client
build and validate headers the same way. A header is a msgpack map with an ``op`` and,
for requests, an ``id`` the reply echoes. Token data travels as one buffer (a transport
slot) described by ``dtype`` and ``shape``; it is never in the header.

Requests and their replies::

    info     {op, id}                               -> info  {experts, versions, d_model,
                                                              d_ff, dtype, max_tokens, pid}
    ping     {op, id}                               -> pong  {experts, versions, in_flight,
                                                              draining, counters}
    forward  {op, id, dtype, shape, groups?}  [x]   -> result {id, dtype, shape, compute_s,
                                                               timing?, versions?}  [y]
    load     {op, id, expert, version, weights | seed}  -> loaded  {id, expert, version}
    retire   {op, id, expert, version}              -> retired {id, expert, version, active}
    update   {op, id, action, ...}  (gateway only)  -> update  {id, status}
    any bad request                                 -> error {id, code, message}

``groups`` ([[expert_id, start, count], ...], tiling the rows in order) is what a worker
needs; a client sending to the gateway leaves it out (the gateway routes). A group may name
the weights version as a fourth element ([expert_id, start, count, version]); without it
the worker uses the expert's active version. ``load`` stages a version beside the active
one (a worker keeps serving while it loads, then holds both: the double buffer); ``retire``
drops a version, and retiring the active one makes the other the active one. ``versions``
in a result ([[expert, version], ...]) says which version served a pinned expert. A worker
that starts draining (SIGTERM) sends an unsolicited ``{op: "draining"}`` on every
connection. ``versions`` in info and pong is [[expert, active, [held, ...]], ...].
Header values are plain ints, floats, strings and lists (no int-keyed maps), so any
msgpack implementation on any backend decodes them alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

# ops
INFO = "info"
PING = "ping"
PONG = "pong"
FORWARD = "forward"
RESULT = "result"
ERROR = "error"
DRAINING = "draining"
LOAD = "load"
LOADED = "loaded"
RETIRE = "retire"
RETIRED = "retired"
UPDATE = "update"
REQUEST_OPS = (INFO, PING, FORWARD, LOAD, RETIRE)

# error codes (the ``code`` field of an error reply)
BAD_REQUEST = "bad_request"  # not a map, no op, bad id, unknown op
BAD_DTYPE = "bad_dtype"
BAD_SHAPE = "bad_shape"  # shape malformed, wrong d_model, or payload size mismatch
BAD_GROUPS = "bad_groups"  # groups do not tile the rows
UNKNOWN_EXPERT = "unknown_expert"
UNKNOWN_VERSION = "unknown_version"  # a forward or retire names a version not held here
LOAD_FAILED = "load_failed"  # the weights of a load could not be read or do not fit
OVERSIZED = "oversized"  # more rows than the peer accepts in one batch
WORKER_FAILED = "worker_failed"  # gateway: a worker died, timed out or replied an error
UNAVAILABLE = "unavailable"  # gateway: no healthy worker hosts an expert the batch needs
UNAUTHORIZED = "unauthorized"  # a control operation on a connection that did not prove the secret
INTERNAL = "internal"

DTYPES = ("float32", "float64", "float16")
MAX_GROUPS = 8192  # bounds the header (the transport caps headers at 64 KiB)


class RequestError(Exception):
    """A request broke the schema; ``code`` is one of the error codes above."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class RemoteError(RuntimeError):
    """The peer replied ``error``: raised by the client and the pool for that request."""

    def __init__(self, code: str, message: str, peer: str = ""):
        super().__init__(f"{peer + ': ' if peer else ''}{code}: {message}")
        self.code = code
        self.message = message
        self.peer = peer


# -- building headers ----------------------------------------------------------

def request(op: str, request_id: int, **fields: Any) -> dict:
    return {"op": op, "id": int(request_id), **fields}


def forward_request(request_id: int, array_shape: Sequence[int], dtype: Any,
                    groups: Optional[Sequence[Sequence[int]]] = None) -> dict:
    h = request(FORWARD, request_id, dtype=np.dtype(dtype).name, shape=[int(n) for n in array_shape])
    if groups is not None:
        h["groups"] = [[int(v) for v in g] for g in groups]  # [expert, start, count(, version)]
    return h


def result_reply(request_id: int, array_shape: Sequence[int], dtype: Any, **fields: Any) -> dict:
    return {"op": RESULT, "id": int(request_id), "dtype": np.dtype(dtype).name,
            "shape": [int(n) for n in array_shape], **fields}


def error_reply(request_id: Optional[int], code: str, message: str) -> dict:
    return {"op": ERROR, "id": request_id, "code": code, "message": message}


def raise_if_error(header: Any, peer: str = "") -> None:
    if isinstance(header, dict) and header.get("op") == ERROR:
        raise RemoteError(str(header.get("code", INTERNAL)), str(header.get("message", "")), peer)


# -- validating requests -------------------------------------------------------

def request_id_of(header: Any) -> Optional[int]:
    """The id to echo in a reply, or None when the header has no usable one."""
    if isinstance(header, dict):
        rid = header.get("id")
        if isinstance(rid, int) and not isinstance(rid, bool):
            return rid
    return None


def parse_op(header: Any, allowed: Sequence[str] = REQUEST_OPS) -> str:
    if not isinstance(header, dict):
        raise RequestError(BAD_REQUEST, f"header must be a map, got {type(header).__name__}")
    op = header.get("op")
    if op not in allowed:
        raise RequestError(BAD_REQUEST, f"unknown op {op!r}; expected one of {list(allowed)}")
    if request_id_of(header) is None:
        raise RequestError(BAD_REQUEST, f"{op} request needs an integer id")
    return op


@dataclass(frozen=True)
class ForwardBatch:
    """A validated forward request: ``rows`` tokens of ``d_model`` in ``dtype``."""

    request_id: int
    dtype: np.dtype
    rows: int
    d_model: int
    groups: Optional[list]  # [(expert_id, start, count)], workers only

    @property
    def nbytes(self) -> int:
        return self.rows * self.d_model * self.dtype.itemsize


def parse_forward(header: dict, buffer_sizes: Sequence[int], *, dtype: np.dtype, d_model: int,
                  max_rows: int, experts: Optional[Sequence[int]] = None,
                  need_groups: bool = False) -> ForwardBatch:
    """Check a forward request against what this endpoint serves, or raise RequestError.

    ``buffer_sizes`` are the byte sizes of the message's buffers (exactly one expected);
    ``experts`` (workers) are the expert ids hosted here; ``max_rows`` the largest batch.
    """
    rid = request_id_of(header)
    name = header.get("dtype")
    if name not in DTYPES or np.dtype(name) != dtype:
        raise RequestError(BAD_DTYPE, f"dtype {name!r} is not served here; send {dtype.name}")
    shape = header.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)):
        raise RequestError(BAD_SHAPE, f"shape must be [rows, d_model] of non-negative ints, got {shape!r}")
    rows, d = shape
    if d != d_model:
        raise RequestError(BAD_SHAPE, f"d_model is {d_model}, got rows of {d}")
    if rows > max_rows:
        raise RequestError(OVERSIZED, f"batch of {rows} rows exceeds the limit of {max_rows}")
    want = rows * d * dtype.itemsize
    got = sum(buffer_sizes)
    if len(buffer_sizes) > 1 or got != want:
        raise RequestError(BAD_SHAPE, f"shape {shape} of {dtype.name} needs one buffer of {want} bytes, "
                                      f"got {list(buffer_sizes)}")
    groups = None
    if need_groups or "groups" in header:
        groups = _parse_groups(header.get("groups"), rows, experts)
    return ForwardBatch(rid, dtype, rows, d, groups)


def _parse_groups(groups: Any, rows: int, experts: Optional[Sequence[int]]) -> list:
    """[(expert, start, count, version or None)], or RequestError."""
    if not isinstance(groups, list) or len(groups) > MAX_GROUPS:
        raise RequestError(BAD_GROUPS, f"groups must be a list of at most {MAX_GROUPS} [expert, start, count]")
    hosted = None if experts is None else set(experts)
    out, at = [], 0
    for g in groups:
        if not (isinstance(g, list) and len(g) in (3, 4)
                and all(isinstance(v, int) and not isinstance(v, bool) for v in g)):
            raise RequestError(BAD_GROUPS, f"group {g!r} is not [expert, start, count] or [expert, start, count, version]")
        e, start, count = g[:3]
        if start != at or count < 0:
            raise RequestError(BAD_GROUPS, f"group {g} does not continue at row {at}")
        if hosted is not None and e not in hosted:
            raise RequestError(UNKNOWN_EXPERT, f"expert {e} is not hosted here (hosted: {sorted(hosted)})")
        out.append((e, start, count, g[3] if len(g) == 4 else None))
        at += count
    if at != rows:
        raise RequestError(BAD_GROUPS, f"groups cover {at} rows of {rows}")
    return out


def _int_field(header: dict, key: str, minimum: int = 0) -> int:
    v = header.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise RequestError(BAD_REQUEST, f"{header.get('op')} needs an integer {key} >= {minimum}, got {v!r}")
    return v


@dataclass(frozen=True)
class LoadRequest:
    """Stage ``version`` of ``expert`` from an .npz file (``weights``) or a seed."""

    request_id: int
    expert: int
    version: int
    weights: Optional[str]
    seed: Optional[int]


def parse_load(header: dict, experts: Sequence[int]) -> LoadRequest:
    e = _int_field(header, "expert")
    if e not in experts:
        raise RequestError(UNKNOWN_EXPERT, f"expert {e} is not hosted here (hosted: {sorted(experts)})")
    version = _int_field(header, "version")
    weights, seed = header.get("weights"), header.get("seed")
    if (weights is None) == (seed is None):
        raise RequestError(BAD_REQUEST, "load needs exactly one of weights (an .npz path) or seed")
    if weights is not None and not (isinstance(weights, str) and weights):
        raise RequestError(BAD_REQUEST, f"weights must be a file path, got {weights!r}")
    if seed is not None:
        seed = _int_field(header, "seed")
    return LoadRequest(request_id_of(header), e, version, weights, seed)


def parse_retire(header: dict, experts: Sequence[int]) -> tuple[int, int]:
    e = _int_field(header, "expert")
    if e not in experts:
        raise RequestError(UNKNOWN_EXPERT, f"expert {e} is not hosted here (hosted: {sorted(experts)})")
    return e, _int_field(header, "version")
