"""``GatewayClient``: submit token batches to a moe-gateway and get the MoE outputs.

    with GatewayClient("tcp://127.0.0.1:7000") as c:
        x = np.ones((16, c.d_model), c.dtype)  # the gateway's width and wire dtype
        y = c.forward(x, timeout=5.0)          # x: (T, d_model) float32
        y = c.forward(x, layer=3)              # a gateway serving a checkpoint: layer 3
        reply, release = c.send(3, x)          # zero copy: reply views the reply message

One connection per client object. The object is thread-safe (a lock guards the
connection, which the transport wants used by one thread at a time), but threads then
take turns; for concurrency make one client per thread. ``submit``/``result`` pipeline
several requests on one connection; results are matched by request id, so a late reply to
a request that timed out is discarded, never mistaken for another's.

``forward`` copies the input into a send slot and the output out of the reply (simple, and
the caller owns the result). ``send`` (gateway.torch_block's LayerClient protocol) copies
neither on its side: the input goes from the caller's own memory, which the transport sends
as it is where it can (tcp: one sendmsg straight from it, the kernel's socket copy the only
one) and stages into a send slot where it must (shm and rdma: peers read registered memory
only, so one copy into a slot, counted in ``conn.stats.copies``); the output is an array
over the reply message where it landed, held until ``release`` is called.
"""
from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

import transport
from transport import Timeout
from transport.service import secrets
from workers import bf16
from workers import protocol as P

DEFAULT_SLOT_SIZE = 4 << 20  # the largest reply this client can take: 1M float32 values


def gateway_slot_size(max_batch_tokens: int, d_model: int, dtype: Any = "float32") -> int:
    """The slot size a gateway with these settings announces to its clients (its largest
    request: a whole round's tokens)."""
    from gateway.server import client_slot_size
    itemsize = P.wire_dtype(dtype if isinstance(dtype, str) else P.dtype_name(dtype)).itemsize
    return client_slot_size(max_batch_tokens, int(d_model) * itemsize)


class GatewayClient:
    def __init__(self, url: str, *, timeout: float = 30.0, slot_size: int = DEFAULT_SLOT_SIZE,
                 nslots: int = 8, connect_timeout: Optional[float] = None, secret: Any = secrets.FIND,
                 secret_file: Optional[str] = None, max_peer_slot_size: Optional[int] = None) -> None:
        """``secret`` (or ``secret_file``): the gateway's shared secret; by default (FIND) it
        is found as the services find it ($MOE_SECRET_FILE, else the per-user default
        file); None: connect without one. ``max_peer_slot_size``: the largest slot the
        gateway may announce (it sizes the shared memory this side maps for it; default the
        transport's, 4 MiB or our own slot size): a gateway with larger batches announces
        max_batch_tokens x d_model x the dtype's size (:func:`gateway_slot_size`)."""
        self.url = url
        self.timeout = timeout
        path, source = None, ""
        if secret is secrets.FIND:
            secret, path = secrets.resolve(secret_file)
            source = secrets.whence(secret_file, path)
        elif secret is not None:
            path = "the secret passed to GatewayClient"
        try:
            self.conn = transport.connect(url, slot_size=slot_size, nslots=nslots,
                                          timeout=connect_timeout or timeout, secret=secret,
                                          max_peer_slot_size=max_peer_slot_size)
        except transport.AuthenticationError as e:  # say which secret this side used, and whence
            raise transport.AuthenticationError(secrets.advice(e, this="this client", peer=f"the gateway at {url}",
                                                               path=path, source=source), e.why) from None
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._done: dict[int, Any] = {}  # request id -> (header, array copy or kept Message) or error
        self._waiting: set[int] = set()
        self._keep: set[int] = set()  # requests whose reply message is kept, not copied (send)
        self._released: list = []  # kept messages given back, to release on the connection's thread
        self._held = 0  # kept messages not yet released
        #: the gateway's timing of the round that served the last result (route_s, ...)
        self.last_timing: Optional[dict] = None
        self.last_round: Optional[int] = None
        self.last_versions: Optional[list] = None
        #: every expert that computed the last result, and the version it used: {expert: version}
        self.last_expert_versions: Optional[dict] = None
        #: the gateway's served set (its generation) the last result was routed under
        self.last_served_set: Optional[int] = None
        self._shape: Optional[dict] = None  # the gateway's d_model and dtype, asked once

    def forward(self, x: np.ndarray, *, timeout: Optional[float] = None,
                out: Optional[np.ndarray] = None, layer: Optional[int] = None) -> np.ndarray:
        """The MoE layer's output for ``x`` (T, d_model) (of MoE layer ``layer`` of a gateway
        serving a checkpoint; None: the default layer). Raises transport.Timeout when no
        reply comes in ``timeout`` seconds, RemoteError when the gateway refuses or fails it."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        rid = self.submit(x, timeout=max(0.0, deadline - time.monotonic()), layer=layer)
        return self.result(rid, timeout=max(0.0, deadline - time.monotonic()), out=out)

    def submit(self, x: np.ndarray, *, timeout: Optional[float] = None, layer: Optional[int] = None) -> int:
        """Send one request; returns its id (for :meth:`result`)."""
        x = np.asarray(x)
        if x.ndim != 2:
            raise ValueError(f"x must be 2-D (T, d_model), got shape {x.shape}")
        with self._lock:
            self._free_released()
            rid = next(self._ids)
            slot = self.conn.alloc(x.nbytes, timeout=timeout)
            dst = slot.array(x.dtype, x.shape)
            if bf16.is_bf16(x.dtype):  # copy the bits (ml_dtypes' copy is a conversion loop)
                dst, src = dst.view(np.uint16), x.view(np.uint16)
            else:
                src = x
            np.copyto(dst, src)  # into registered memory: the send is zero-copy
            h = P.forward_request(rid, x.shape, x.dtype, layer=layer)
            if layer is not None:  # named, even 0: a gateway serving one other layer defaults to that one
                h["layer"] = int(layer)
            self.conn.send(h, [slot], timeout=timeout)
            self._waiting.add(rid)
        return rid

    # -- the zero-copy path (gateway.torch_block.LayerClient) --------------------------------
    def send(self, layer: int, hidden: np.ndarray, *, timeout: Optional[float] = None
             ) -> tuple[np.ndarray, Callable[[], None]]:
        """MoE layer ``layer`` on ``hidden`` (T, d_model) without a copy on this side: the
        request goes from ``hidden``'s own memory (see the module docstring for what each
        backend does), the returned array views the reply message, which stays held until
        ``release()`` (safe from a finalizer on any thread: it only queues the message, the
        next call on this client releases it)."""
        hidden = np.asarray(hidden)
        if hidden.ndim != 2 or not hidden.flags.c_contiguous:
            raise ValueError(f"hidden must be a C-contiguous (T, d_model) array, got {hidden.shape}")
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        buf = hidden.view(np.uint16) if bf16.is_bf16(hidden.dtype) else hidden  # bf16: its bits export a buffer
        with self._lock:
            self._free_released()
            rid = next(self._ids)
            self._keep.add(rid)
            try:
                h = P.forward_request(rid, hidden.shape, hidden.dtype, layer=layer)
                h["layer"] = int(layer)  # named, even 0 (see submit)
                self.conn.send(h, [buf] if hidden.size else [], timeout=max(0.0, deadline - time.monotonic()))
            except BaseException:
                self._keep.discard(rid)
                raise
            self._waiting.add(rid)
        try:
            msg, reply = self.result(rid, timeout=max(0.0, deadline - time.monotonic()), keep=True)
        finally:
            self._keep.discard(rid)
        released = self._released
        done = [False]

        def release() -> None:
            if not done[0]:
                done[0] = True
                released.append(msg)  # list.append is atomic: safe from a finalizer, any thread

        return reply, release

    def _free_released(self) -> None:
        """Release the kept reply messages given back since the last call (under the lock:
        a connection's messages are released on the thread that uses it)."""
        while self._released:
            self._released.pop().release()
            self._held -= 1

    @property
    def held_replies(self) -> int:
        """Kept reply messages not yet released (those given back count until the next call)."""
        return self._held

    def result(self, request_id: int, *, timeout: Optional[float] = None,
               out: Optional[np.ndarray] = None, keep: bool = False) -> Any:
        """Wait for request ``request_id``'s output (copied out of the transport buffer,
        into ``out`` if given). On Timeout the request is abandoned."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        try:
            while True:
                with self._lock:
                    if request_id in self._done:
                        return self._take(request_id, out, keep)
                    if request_id not in self._waiting:
                        raise KeyError(f"no request {request_id} outstanding")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise Timeout(f"no reply to request {request_id} from {self.url} in time")
                    # short slices: other threads sharing this client get the lock between them
                    self._receive(min(left, 0.02))
                time.sleep(0)
        except Timeout:
            with self._lock:
                self._waiting.discard(request_id)
            raise

    def _receive(self, timeout: float) -> None:
        try:
            msg = self.conn.recv(timeout=timeout)
        except Timeout:
            return
        h = msg.header
        rid = P.request_id_of(h)
        op = h.get("op") if isinstance(h, dict) else None
        if op == P.RESULT and rid in self._waiting and rid in self._keep:
            self._done[rid] = (h, msg)  # kept where it landed: send() hands out a view of it
            self._held += 1
            self._waiting.discard(rid)
            return
        with msg:
            if rid not in self._waiting:
                return  # the reply to an abandoned (timed-out) request
            if op == P.RESULT:
                shape = tuple(h["shape"])
                dt = P.wire_dtype(h["dtype"])
                y = msg.array(0, dt, shape).copy() if shape[0] else np.empty(shape, dt)
                self._done[rid] = (h, y)
            elif op == P.ERROR:
                self._done[rid] = P.RemoteError(str(h.get("code")), str(h.get("message")), self.url)
            elif op in (P.PONG, P.UPDATE, P.PLACEMENT, P.WORKERS):
                self._done[rid] = (h, None)
            self._waiting.discard(rid)

    def _take(self, rid: int, out: Optional[np.ndarray], keep: bool = False):
        got = self._done.pop(rid)
        if isinstance(got, Exception):
            raise got
        h, y = got
        if y is None:
            return h
        self.last_timing = h.get("timing")
        self.last_round = h.get("round")
        self.last_versions = h.get("versions")  # [[expert, version]] pinned during a hot update
        ev = h.get("expert_versions")
        self.last_expert_versions = {int(e): int(v) for e, v in ev} if isinstance(ev, list) else None
        self.last_served_set = h.get("served_set")
        if keep:  # y is the kept Message: (message, a view of its payload)
            shape, dt = tuple(h["shape"]), P.wire_dtype(h["dtype"])
            return y, (y.array(0, dt, shape) if shape[0] else np.empty(shape, dt))
        if out is not None:
            np.copyto(out, y)
            return out
        return y

    def ping(self, timeout: Optional[float] = None) -> dict:
        """The gateway's pong: counters (requests, rounds, stage seconds), workers' health."""
        with self._lock:
            rid = next(self._ids)
            self.conn.send(P.request(P.PING, rid), timeout=timeout)
            self._waiting.add(rid)
        return self.result(rid, timeout=timeout)

    def info(self, timeout: Optional[float] = None) -> dict:
        """The gateway's configuration (its pong's ``config``): d_model, dtype, n_experts,
        top_k, layers, the batching and chunking settings and auto's chunk costs."""
        config = self.ping(timeout)["config"]
        self._shape = {"d_model": int(config["d_model"]), "dtype": str(config["dtype"])}
        return config

    def _layer_shape(self) -> dict:
        if self._shape is None:  # asked once: a gateway's width and dtype never change
            self.info()
        assert self._shape is not None
        return self._shape

    @property
    def d_model(self) -> int:
        """The width of the rows the gateway takes (``x`` is (T, d_model))."""
        return self._layer_shape()["d_model"]

    @property
    def dtype(self) -> np.dtype:
        """The activations' dtype on the wire (float32; bfloat16 as ml_dtypes' type, or uint16
        bits where ml_dtypes is absent): what ``forward`` takes and returns."""
        return P.wire_dtype(self._layer_shape()["dtype"])

    def update(self, action: str, *, timeout: Optional[float] = None, **fields: Any) -> dict:
        """A hot-update command (start, advance, finish, rollback, status): the update's
        status after it. ``start`` takes experts, version, weights or seed, steps,
        auto_interval; ``advance`` an optional fraction. Raises RemoteError if refused."""
        with self._lock:
            rid = next(self._ids)
            self.conn.send(P.request(P.UPDATE, rid, action=action, **fields), timeout=timeout)
            self._waiting.add(rid)
        return self.result(rid, timeout=timeout)["status"]

    def placement(self, action: str, *, timeout: Optional[float] = None, **fields: Any) -> dict:
        """The expert placement: ``show`` (JSON) or ``load`` (``placement=`` a saved one)."""
        return self._control(P.PLACEMENT, action, timeout, fields)

    def workers(self, action: str, *, timeout: Optional[float] = None, **fields: Any) -> dict:
        """Workers: ``list``, ``add`` (``urls=``), ``drain``/``remove`` (``worker=``), ``scale`` (``n=``)."""
        return self._control(P.WORKERS, action, timeout, fields)

    def _control(self, op: str, action: str, timeout: Optional[float], fields: dict) -> dict:
        with self._lock:
            rid = next(self._ids)
            self.conn.send(P.request(op, rid, action=action, **fields), timeout=timeout)
            self._waiting.add(rid)
        return self.result(rid, timeout=timeout)["status"]

    def close(self) -> None:
        with self._lock:
            self._free_released()
            for got in self._done.values():  # kept replies nobody took
                if isinstance(got, tuple) and hasattr(got[1], "release"):
                    got[1].release()
            self._done.clear()
            self.conn.close()

    def __enter__(self) -> "GatewayClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
