"""The message schema spoken over moe-transport connections, on both hops:

    client --(forward, ping)--> gateway --(info, ping, forward)--> worker

One module owns it so that the worker, the gateway's pool, its server and the client
build and validate headers the same way. A header is a msgpack map with an ``op`` and,
for requests, an ``id`` the reply echoes. Token data travels as one buffer (a transport
slot) described by ``dtype`` and ``shape``; it is never in the header.

Requests and their replies::

    info     {op, id}                               -> info  {experts, layers, versions, d_model,
                                                              d_ff, dtype, max_tokens, pid, kernel,
                                                              checkpoint?}
    ping     {op, id}                               -> pong  {experts, versions, in_flight,
                                                              draining, counters}
    forward  {op, id, dtype, shape, layer?, groups?}  [x]   -> result {id, dtype, shape, compute_s,
                                                               t_in?, t_out?, t_rx?, flt?, timing?,
                                                               versions?}  [y]
    load     {op, id, expert, version, layer?, weights | seed | checkpoint, fingerprint?}
                                                    -> loaded  {id, expert, version, layer?}
    retire   {op, id, expert, version, layer?}      -> retired {id, expert, version, active, layer?}
    unhost   {op, id, expert, layer?}               -> unhosted {id, expert, layer?}
    weights  {op, id, start?}                       -> weights {id, entries, sources, next}
    update   {op, id, action, ...}  (gateway only)  -> update  {id, status}
    placement {op, id, action, ...} (gateway only)  -> placement {id, status}
    workers  {op, id, action, ...}  (gateway only)  -> workers {id, status}
    any bad request                                 -> error {id, code, message}

``groups`` ([[expert_id, start, count], ...], tiling the rows in order) is what a worker
needs; a client sending to the gateway leaves it out (the gateway routes). A group may name
the weights version as a fourth element ([expert_id, start, count, version]); without it
the worker uses the expert's active version. ``load`` stages a version beside the active
one (a worker keeps serving while it loads, then holds both: the double buffer); ``retire``
drops a version, and retiring the active one makes the other the active one. A ``load`` of
an expert the worker does not host adds a physical copy of it (room permitting: ``max_experts``
in info), active at that version; ``unhost`` drops an expert with every version it holds
(never the worker's last one); both change ``experts`` and ``layers`` in info. ``versions``
in a result ([[expert, version], ...]) says which version served a pinned expert. A worker
that starts draining (SIGTERM) sends an unsolicited ``{op: "draining"}`` on every
connection. ``versions`` in info and pong is [[expert, active, [held, ...]], ...].
``t_in``/``t_out`` in a result are the worker's clock (seconds) when it took the request up
(its compute thread, if it has one: not while it queued behind another) and when its output
was ready: the gateway reads their difference, the worker's busy time per message. ``t_rx``,
only from a worker with a compute thread: when its loop read the request, as it arrived.
Only for a worker on its own machine (shm, a loopback address: the clock is the same) does
the gateway compare ``t_out`` and ``t_rx`` with its own clock, to time a chunk's way back
and way in (gateway/chunking.py, ChunkCosts). ``flt`` is the minor page faults the worker process has
taken so far (a count that only grows while it runs): the gateway takes the difference
between two replies to tell a round that wrote fresh memory, whose time is a start-up cost,
from the steady state (gateway/chunking.py, ChunkMode).
Weights identity: every version a worker holds has a fingerprint (workers/fingerprint.py: a
hash of its weights as their source holds them) and a source, the fields a ``load`` would
name to re-create it ({"seed": 7}, {"weights": path}, {"checkpoint": dir, "fingerprint":
the layer's}). ``loaded`` carries both for the version it loaded; ``weights`` lists them for
every held version, a page at a time (``entries`` [[layer, expert, version, fingerprint,
source index], ...] into the page's ``sources``; ``next``: the ``start`` of the next page,
or None), so a gateway can tell a returning worker's weights from the ones it serves
(gateway/served.py) however many experts and layers the worker holds.
Header values are plain ints, floats, strings and lists (no int-keyed maps), so any
msgpack implementation on any backend decodes them alike.

Layers: a worker or gateway serving a checkpoint serves several MoE layers of one model;
experts are keyed by (layer, id) and ``layer`` travels in forward, load and retire (absent:
``DEFAULT_LAYER``, 0, the one layer of the demo mode). Shared-expert pieces are ids like any
other (n_experts ..). ``layers`` in info is [[layer, [ids], fingerprint or None], ...] (the
fingerprint: workers.checkpoint.layer_fingerprint of the layer the worker read, None for demo
weights); ``experts`` is the union of the ids over layers. Entries of ``versions`` (info and
pong) and of ``counters.experts`` carry their layer as a trailing element when it is not 0:
[expert, active, [held], layer]. ``kernel`` in info is the experts' kernel as
``Kernel.describe()`` reports it, with ``wire_dtype``.

dtypes: float32, float64, float16 and bfloat16 (activations as bf16 on the wire: 2 bytes a
value; in numpy an ml_dtypes.bfloat16 array, or uint16 bits where ml_dtypes is absent; the
header says "bfloat16" either way, see :func:`dtype_name`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Mapping, Optional, Sequence

import numpy as np

from workers import bf16

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
WEIGHTS = "weights"
UNHOST = "unhost"
UNHOSTED = "unhosted"
PLACEMENT = "placement"  # gateway only: show or load the expert placement
WORKERS = "workers"  # gateway only: list, add, drain, remove, scale workers
REQUEST_OPS = (INFO, PING, FORWARD, LOAD, RETIRE, WEIGHTS, UNHOST)

# error codes (the ``code`` field of an error reply)
BAD_REQUEST = "bad_request"  # not a map, no op, bad id, unknown op
BAD_DTYPE = "bad_dtype"
BAD_SHAPE = "bad_shape"  # shape malformed, wrong d_model, or payload size mismatch
BAD_GROUPS = "bad_groups"  # groups do not tile the rows
UNKNOWN_EXPERT = "unknown_expert"
UNKNOWN_LAYER = "unknown_layer"  # a request names a layer not served here
UNKNOWN_VERSION = "unknown_version"  # a forward or retire names a version not held here
LOAD_FAILED = "load_failed"  # the weights of a load could not be read or do not fit
OVERSIZED = "oversized"  # more rows than the peer accepts in one batch
WORKER_FAILED = "worker_failed"  # gateway: a worker died, timed out or replied an error
UNAVAILABLE = "unavailable"  # gateway: no healthy worker hosts an expert the batch needs
UNAUTHORIZED = "unauthorized"  # a control operation on a connection that did not prove the secret
INTERNAL = "internal"
#: every code above: the services export a counter for each from the start (at 0)
ERROR_CODES = (BAD_REQUEST, BAD_DTYPE, BAD_SHAPE, BAD_GROUPS, UNKNOWN_EXPERT, UNKNOWN_LAYER, UNKNOWN_VERSION,
               LOAD_FAILED, OVERSIZED, WORKER_FAILED, UNAVAILABLE, UNAUTHORIZED, INTERNAL)

DTYPES = ("float32", "float64", "float16", bf16.BF16_NAME)
DEFAULT_LAYER = 0  # the layer of a request that names none (the demo mode's one layer)
MAX_GROUPS = 8192  # bounds the header (the transport caps headers at 64 KiB)
MAX_VERSIONS = 2  # versions a worker holds per expert: the active one and one being rolled out
MAX_EXPERT_ID = 1 << 16  # expert ids a load may name for an expert a worker does not host yet
WEIGHTS_PAGE_BYTES = 32 << 10  # a weights page's entries and sources, roughly (headers cap at 64 KiB)
MAX_SOURCE_PATH = 4096  # the longest path a weights source may name
SOURCE_KINDS = ("seed", "weights", "checkpoint")


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


def dtype_name(dtype: Any) -> str:
    """The header's name of an activation dtype: "bfloat16" for either numpy
    representation of bf16 (a uint16 array's numpy name is "uint16"), else numpy's name."""
    return bf16.dtype_name(dtype)


def wire_dtype(name: str) -> np.dtype:
    """The numpy dtype activations named ``name`` are viewed as (bf16: ml_dtypes.bfloat16,
    or uint16 bits without ml_dtypes)."""
    return bf16.wire_dtype(name)


def with_layer(entry: list, layer: int) -> list:
    """A versions/counters entry, its layer appended when it is not the default one."""
    return entry + [int(layer)] if layer != DEFAULT_LAYER else entry


def entry_layer(entry: Sequence, n: int) -> int:
    """The layer of an entry of ``n`` fields written by :func:`with_layer`."""
    return int(entry[n]) if len(entry) > n else DEFAULT_LAYER


# -- building headers ----------------------------------------------------------

def request(op: str, request_id: int, **fields: Any) -> dict:
    return {"op": op, "id": int(request_id), **fields}


def forward_request(request_id: int, array_shape: Sequence[int], dtype: Any,
                    groups: Optional[Sequence[Sequence[int]]] = None, layer: Optional[int] = None) -> dict:
    h = request(FORWARD, request_id, dtype=dtype_name(dtype), shape=[int(n) for n in array_shape])
    if layer is not None and layer != DEFAULT_LAYER:
        h["layer"] = int(layer)
    if groups is not None:
        h["groups"] = [[int(v) for v in g] for g in groups]  # [expert, start, count(, version)]
    return h


def result_reply(request_id: int, array_shape: Sequence[int], dtype: Any, **fields: Any) -> dict:
    return {"op": RESULT, "id": int(request_id), "dtype": dtype_name(dtype),
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
    layer: int = DEFAULT_LAYER

    @property
    def nbytes(self) -> int:
        return self.rows * self.d_model * self.dtype.itemsize


def parse_forward(header: dict, buffer_sizes: Sequence[int], *, dtype: np.dtype, d_model: int,
                  max_rows: int, experts: Optional[Sequence[int]] = None,
                  need_groups: bool = False,
                  layers: Optional[Collection[int] | Mapping[int, Collection[int]]] = None) -> ForwardBatch:
    """Check a forward request against what this endpoint serves, or raise RequestError.

    ``buffer_sizes`` are the byte sizes of the message's buffers (exactly one expected);
    ``experts`` (workers) are the expert ids hosted here; ``max_rows`` the largest batch;
    ``layers`` (when given) the layers served here (a gateway), or each mapped to its hosted
    expert ids (a worker): the request's layer must be one of them; a request that names
    none gets DEFAULT_LAYER, or the one layer served when that is another.
    """
    rid = request_id_of(header)
    name = header.get("dtype")
    if name not in DTYPES or name != dtype_name(dtype):
        raise RequestError(BAD_DTYPE, f"dtype {name!r} is not served here; send {dtype_name(dtype)}")
    layer = header.get("layer", DEFAULT_LAYER)
    if "layer" not in header and layers is not None and DEFAULT_LAYER not in layers and len(layers) == 1:
        layer = next(iter(layers))  # one layer served: the default is that one
    if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
        raise RequestError(BAD_REQUEST, f"layer must be an integer >= 0, got {layer!r}")
    if layers is not None:
        if layer not in layers and "layer" not in header:
            raise RequestError(UNKNOWN_LAYER, f"the request names no layer, and layer {layer} is not served here: "
                                              f"name one of {sorted(layers)}")
        if layer not in layers:
            raise RequestError(UNKNOWN_LAYER, f"layer {layer} is not served here (layers: {sorted(layers)})")
        if experts is None and isinstance(layers, Mapping):
            experts = layers[layer]
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
        raise RequestError(BAD_SHAPE, f"shape {shape} of {dtype_name(dtype)} needs one buffer of {want} bytes, "
                                      f"got {list(buffer_sizes)}")
    groups = None
    if need_groups or "groups" in header:
        groups = _parse_groups(header.get("groups"), rows, experts)
    return ForwardBatch(rid, dtype, rows, d, groups, layer)


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
    """Stage ``version`` of expert ``expert`` of ``layer`` from an .npz file (``weights``), a
    seed, or a checkpoint directory (``checkpoint``: that expert id of that layer, whose
    layer fingerprint must equal ``fingerprint`` when one is given)."""

    request_id: int
    expert: int
    version: int
    weights: Optional[str]
    seed: Optional[int]
    layer: int = DEFAULT_LAYER
    checkpoint: Optional[str] = None
    fingerprint: Optional[str] = None


def _hosted(layers: Any) -> Mapping[int, Collection[int]]:
    """``layers``: {layer: expert ids}, or a plain list of ids (the default layer's)."""
    return layers if isinstance(layers, Mapping) else {DEFAULT_LAYER: list(layers)}


def _layer_expert(header: dict, layers: Any, new: bool = False) -> tuple[int, int]:
    """(layer, expert) a control request names; ``new``: the expert may be one the worker does
    not host yet (a load that adds a physical copy), any id below MAX_EXPERT_ID."""
    hosted = _hosted(layers)
    layer = header.get("layer", DEFAULT_LAYER)
    if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
        raise RequestError(BAD_REQUEST, f"{header.get('op')} needs an integer layer >= 0, got {layer!r}")
    if layer not in hosted:
        raise RequestError(UNKNOWN_LAYER, f"layer {layer} is not served here (layers: {sorted(hosted)})")
    e = _int_field(header, "expert")
    if new and e < MAX_EXPERT_ID:
        return layer, e
    if e not in hosted[layer]:
        raise RequestError(UNKNOWN_EXPERT, f"expert {e} of layer {layer} is not hosted here "
                                           f"(hosted: {sorted(hosted[layer])})")
    return layer, e


def parse_load(header: dict, layers: Any) -> LoadRequest:
    """``layers``: {layer: hosted expert ids} (or the default layer's ids as a list)."""
    layer, e = _layer_expert(header, layers, new=True)
    version = _int_field(header, "version")
    weights, seed, ckpt = header.get("weights"), header.get("seed"), header.get("checkpoint")
    if sum(v is not None for v in (weights, seed, ckpt)) != 1:
        raise RequestError(BAD_REQUEST, "load needs exactly one of weights (an .npz path), seed or checkpoint "
                                        "(a checkpoint directory)")
    for name, v in (("weights", weights), ("checkpoint", ckpt)):
        if v is not None and not (isinstance(v, str) and v):
            raise RequestError(BAD_REQUEST, f"{name} must be a path, got {v!r}")
    if seed is not None:
        seed = _int_field(header, "seed")
    fp = header.get("fingerprint")
    if fp is not None and not isinstance(fp, str):
        raise RequestError(BAD_REQUEST, f"fingerprint must be a string, got {fp!r}")
    return LoadRequest(request_id_of(header), e, version, weights, seed, layer, ckpt, fp)


def parse_retire(header: dict, layers: Any) -> tuple[int, int, int]:
    """(expert, version, layer) of a retire request."""
    layer, e = _layer_expert(header, layers)
    return e, _int_field(header, "version"), layer


def parse_unhost(header: dict, layers: Any) -> tuple[int, int]:
    """(expert, layer) of an unhost request."""
    layer, e = _layer_expert(header, layers)
    return e, layer


# -- weights identity ------------------------------------------------------------

def weights_entry(layer: int, expert: int, version: int, fingerprint: str, source: Optional[dict]) -> list:
    return [int(layer), int(expert), int(version), str(fingerprint), source]


def check_source(source: Any) -> dict:
    """A weights source as a load names it, or RequestError: exactly one of ``seed`` (an
    int >= 0), ``weights`` (an .npz path) or ``checkpoint`` (a directory, with the layer's
    ``fingerprint`` the gateway read, optional)."""
    if not isinstance(source, dict) or not source:
        raise RequestError(BAD_REQUEST, f"a weights source is a map, got {source!r:.80}")
    kinds = [k for k in SOURCE_KINDS if k in source]
    extra = set(source) - set(SOURCE_KINDS) - {"fingerprint"}
    if len(kinds) != 1 or extra or ("fingerprint" in source and kinds != ["checkpoint"]):
        raise RequestError(BAD_REQUEST, f"a weights source names exactly one of {list(SOURCE_KINDS)} "
                                        f"(a checkpoint may add its fingerprint), got {sorted(source)}")
    v = source[kinds[0]]
    if kinds[0] == "seed":
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise RequestError(BAD_REQUEST, f"seed must be an integer >= 0, got {v!r}")
    elif not (isinstance(v, str) and 0 < len(v) <= MAX_SOURCE_PATH and "\0" not in v):
        raise RequestError(BAD_REQUEST, f"{kinds[0]} must be a path of at most {MAX_SOURCE_PATH} characters")
    fp = source.get("fingerprint")
    if fp is not None and not (isinstance(fp, str) and 0 < len(fp) <= 128):
        raise RequestError(BAD_REQUEST, f"fingerprint must be a string, got {fp!r:.80}")
    return dict(source)


def weights_page(entries: Sequence[list], start: int, request_id: Optional[int]) -> dict:
    """The ``weights`` reply holding ``entries[start:]`` up to about WEIGHTS_PAGE_BYTES."""
    out, sources, index = [], [], {}
    size, i = 0, start
    while i < len(entries) and size < WEIGHTS_PAGE_BYTES:
        L, e, v, fp, src = entries[i]
        key = repr(sorted((src or {}).items()))
        if key not in index:
            index[key] = len(sources)
            sources.append(src)
            size += len(key)
        out.append([L, e, v, fp, index[key]])
        size += 32 + len(fp)
        i += 1
    return {"op": WEIGHTS, "id": request_id, "entries": out, "sources": sources,
            "next": i if i < len(entries) else None}


def parse_weights_page(h: Any, limit: int) -> tuple[list, Optional[int]]:
    """(entries [(layer, expert, version, fingerprint, source or None)], next start) of a
    ``weights`` reply, or ValueError. ``limit``: the most entries this page may hold."""
    if not isinstance(h, dict) or h.get("op") != WEIGHTS:
        raise ValueError(f"expected a weights reply, got {str(h)[:120]}")
    entries, sources, nxt = h.get("entries"), h.get("sources"), h.get("next")
    if not isinstance(entries, list) or not isinstance(sources, list) or len(entries) > limit \
            or len(sources) > len(entries) or not (nxt is None or (isinstance(nxt, int) and nxt > 0)):
        raise ValueError("malformed weights reply")
    srcs = []
    for src in sources:
        try:
            srcs.append(None if src is None else check_source(src))
        except RequestError as e:
            raise ValueError(f"weights reply: {e.message}") from None
    out = []
    for ent in entries:
        if not (isinstance(ent, list) and len(ent) == 5 and all(isinstance(v, int) and not isinstance(v, bool)
                                                                 and v >= 0 for v in (ent[0], ent[1], ent[2], ent[4]))
                and isinstance(ent[3], str) and 0 < len(ent[3]) <= 128 and ent[4] < len(srcs)):
            raise ValueError(f"malformed weights entry {str(ent)[:120]}")
        out.append((ent[0], ent[1], ent[2], ent[3], srcs[ent[4]]))
    return out, nxt
