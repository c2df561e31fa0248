"""A raw-socket fuzzer against live moe-worker and moe-gateway processes.

Hypothesis generates (and mutates) byte streams and sends them over a plain socket to where a
live service handshakes (the tcp port, the shm listener's Unix socket): random bytes, valid
prefixes with bad lengths, valid hellos with hostile fields, truncations of a valid stream,
and -- over tcp, after a real authenticated handshake -- frames with garbage headers, lying
lengths, hostile protocol headers and floods. (The parsers themselves are fuzzed in process
by the transport's own suite; this is the whole process under fire.)

After every test: the process is alive, a well-behaved client still gets correct answers,
and its RSS and open descriptors are bounded (back near the baseline once our sockets are
closed). ``MOE_FUZZ_LIVE_EXAMPLES`` sets the examples per strategy (default 20: about a
minute in all); raise it for long runs.
"""
from __future__ import annotations

import os
import socket
import struct

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import transport.handshake as hs
from gateway.client import GatewayClient
from gateway.reference import ReferenceMoE
from tests.helpers_fault import fd_count, hello_fields, raw_connect, rss_kb
from tests.helpers_procs import BACKENDS, Services, backend_problem, secret, wait_until
from transport import framing

D, F, E, K, SEED = 16, 32, 8, 2, 6
MAX_BATCH = 64
EXAMPLES = int(os.environ.get("MOE_FUZZ_LIVE_EXAMPLES", "20"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=False, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
RSS_BOUND_KB = 64 * 1024
FD_SLACK = 8

pytestmark = pytest.mark.timeout(300)


class Target:
    def __init__(self, services: Services, backend: str):
        self.backend = backend
        self.workers = [services.worker(backend, ex, d_model=D, d_ff=F, seed=SEED, max_tokens=MAX_BATCH * K)
                        for ex in ([0, 1, 2, 3], [4, 5, 6, 7])]
        self.gateway = services.gateway(backend, workers=[w.url for w in self.workers], d_model=D, d_ff=F,
                                        n_experts=E, top_k=K, seed=SEED, max_batch_tokens=MAX_BATCH,
                                        max_wait_ms=0)
        self.ref = ReferenceMoE.from_seed(D, F, E, K, seed=SEED)
        self.x = np.random.default_rng(0).standard_normal((12, D)).astype(np.float32)
        self.y = self.ref.forward(self.x)[0]
        self.served_ok()  # warm, then the baseline
        self.baseline = {s.pid: (rss_kb(s.pid), fd_count(s.pid)) for s in self.services()}

    def services(self):
        return [self.gateway, *self.workers]

    def service(self, role: str):
        return self.gateway if role == "gateway" else self.workers[0]

    def served_ok(self) -> bool:
        with GatewayClient(self.gateway.url, timeout=10.0) as c:
            return bool(np.allclose(c.forward(self.x), self.y, rtol=1e-4, atol=1e-5))

    def check(self, fds: bool = False) -> None:
        """Alive, serving correctly, RSS bounded; with ``fds``, descriptors back near the
        baseline too (waits out the handshake deadline of any half-open one)."""
        for s in self.services():
            assert s.alive(), f"{s.argv[2]} died"
        assert self.served_ok()
        for s in self.services():
            rss0, fds0 = self.baseline[s.pid]
            assert rss_kb(s.pid) - rss0 < RSS_BOUND_KB, (s.argv[:3], rss0, rss_kb(s.pid))
            if not fds:
                continue
            # our sockets are closed: the service lets go of them (half-open ones at their deadline)
            assert wait_until(lambda: fd_count(s.pid) <= fds0 + FD_SLACK, timeout=hs.HELLO_TIMEOUT + 5), \
                (s.argv[:3], fds0, fd_count(s.pid))


@pytest.fixture(scope="module", params=BACKENDS)
def target(request):
    problem = backend_problem(request.param)
    if problem:
        pytest.fail(problem)
    with Services() as services:
        t = Target(services, request.param)
        yield t
        t.check(fds=True)


@pytest.fixture(scope="module")
def tcp_target():
    with Services() as services:
        t = Target(services, "tcp")
        yield t
        t.check(fds=True)


def _send(url: str, data: bytes, linger: float = 0.0) -> None:
    """Connect, send ``data`` (as much as the server takes), maybe read briefly, close."""
    try:
        s = raw_connect(url)
    except OSError:
        return  # refused at the cap or the backlog: nothing reached it
    try:
        s.settimeout(2.0)
        try:
            s.sendall(data)
            if linger:
                s.settimeout(linger)
                s.recv(65536)
        except OSError:  # it hung up on us: a fine answer to garbage
            pass
    finally:
        s.close()


# -- strategies ----------------------------------------------------------------------------------
values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=True)
    | st.text(max_size=20) | st.binary(max_size=40),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=12)
sizes = st.sampled_from([0, -1, 1, 2**31, 2**32 - 1, 2**40, 2**63 - 1, 2**64 - 1]) | st.integers(-10, 10**12)
HELLO_KEYS = ["transport", "version", "backend", "role", "nonce", "auth", "slot_size", "nslots", "ring_bytes"]


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _prefix(kind: int, hlen: int, plen: int, magic: bytes = framing.MAGIC, version: int = framing.VERSION) -> bytes:
    return struct.pack("<2sBBIQ", magic, version & 0xFF, kind & 0xFF, hlen & 0xFFFFFFFF, plen & (2**64 - 1))


@st.composite
def hostile_hellos(draw, backend: str) -> bytes:
    h = hello_fields(backend)
    for key in draw(st.lists(st.sampled_from(HELLO_KEYS), max_size=4, unique=True)):
        if draw(st.booleans()):
            h[key] = draw(sizes) if key in ("slot_size", "nslots", "ring_bytes", "version") else draw(values)
        else:
            h.pop(key, None)
    for k, v in draw(st.dictionaries(st.text(max_size=10), values, max_size=3)).items():
        h[k] = v
    body = _pack(h)
    hlen = draw(st.sampled_from([len(body), len(body), 0, len(body) + 1, len(body) - 1, hs.MAX_HELLO + 1, 2**32 - 1]))
    return _prefix(framing.Kind.HELLO, hlen, draw(st.sampled_from([0, 0, 1, 2**64 - 1])), ) + body


@st.composite
def prefixes(draw) -> bytes:
    magic = draw(st.sampled_from([framing.MAGIC, framing.MAGIC, b"XX", b"\0\0"]))
    version = draw(st.sampled_from([framing.VERSION, framing.VERSION, 0, 1, 255]))
    kind = draw(st.integers(0, 255))
    return _prefix(kind, draw(sizes), draw(sizes), magic, version) + draw(st.binary(max_size=256))


@st.composite
def hostile_frames(draw) -> bytes:
    """What an authenticated peer could send after the handshake."""
    choice = draw(st.integers(0, 6))
    if choice == 0:  # a DATA frame whose header is not [user, lens, extra]
        header = _pack(draw(values))
        return _prefix(framing.Kind.DATA, len(header), 0) + header
    if choice == 1:  # buffer lengths that do not add up to the payload
        lens = draw(st.lists(st.integers(0, 2**40), max_size=6))
        header = _pack([{"op": "forward", "id": 1}, lens, None])
        plen = draw(sizes)
        return _prefix(framing.Kind.DATA, len(header), plen) + header + draw(st.binary(max_size=512))
    if choice == 2:  # hostile protocol headers in a well-formed frame
        payload = draw(st.binary(max_size=2048))
        user = draw(st.fixed_dictionaries({"op": st.sampled_from(["forward", "ping", "info", "load", "retire",
                                                                   "update", "nope"])},
                                          optional={"id": values, "shape": values, "dtype": values,
                                                    "groups": values, "expert": values, "version": values,
                                                    "weights": values, "seed": values, "action": values,
                                                    "experts": values}))
        return b"".join(bytes(p) for p in framing.frame_data(user, [payload]))
    if choice == 3:  # credits the server never gave
        return _prefix(framing.Kind.CREDIT, 0, draw(sizes))
    if choice == 4:  # a forward whose shape claims far more than it carries
        rows = draw(st.sampled_from([2**20, 2**31, 10**9, -5]))
        payload = bytes(64)
        return b"".join(bytes(p) for p in framing.frame_data(
            {"op": "forward", "id": 1, "dtype": "float32", "shape": [rows, D]}, [payload]))
    if choice == 5:  # an unknown kind or a second HELLO mid-stream
        return _prefix(draw(st.sampled_from([0, framing.Kind.HELLO, 9, 255])), 8, 0) + bytes(8)
    return draw(st.binary(min_size=1, max_size=1024))


def _authenticated(url: str) -> socket.socket:
    """A raw tcp socket that completed the real handshake (with the shared secret)."""
    s = raw_connect(url)
    s.settimeout(5.0)
    ex = hs.HelloExchange("client", "tcp", {"slot_size": 1 << 16, "nslots": 4},
                          limits=hs.Limits(1 << 30, 1024), secret=secret())
    s.sendall(ex.data_to_send())
    while not ex.done:
        buf = b""
        while len(buf) < ex.need:
            chunk = s.recv(ex.need - len(buf))
            if not chunk:
                raise ConnectionError("closed during the handshake")
            buf += chunk
        ex.receive(buf)
        out = ex.data_to_send()
        if out:
            s.sendall(out)
    return s


# -- the tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("role", ["worker", "gateway"])
def test_random_bytes(target, role):
    url = target.service(role).url

    @FUZZ
    @given(st.binary(max_size=4096))
    def run(data):
        _send(url, data)
    run()
    target.check()


@pytest.mark.parametrize("role", ["worker", "gateway"])
def test_prefixes_with_bad_lengths(target, role):
    url = target.service(role).url

    @FUZZ
    @given(prefixes())
    def run(data):
        _send(url, data, linger=0.01)
    run()
    target.check()


@pytest.mark.parametrize("role", ["worker", "gateway"])
def test_hellos_with_hostile_fields(target, role):
    url = target.service(role).url

    @FUZZ
    @given(hostile_hellos(target.backend))
    def run(data):
        _send(url, data, linger=0.02)
    run()
    target.check()


@pytest.mark.parametrize("role", ["worker", "gateway"])
def test_truncated_and_mutated_hellos(target, role):
    """A valid hello cut short, or with bytes flipped (mutation of a valid stream)."""
    url = target.service(role).url
    good = b"".join(framing.encode_hello(hello_fields(target.backend)))

    @FUZZ
    @given(st.integers(0, len(good)), st.lists(st.tuples(st.integers(0, len(good) - 1), st.integers(0, 255)),
                                              max_size=4))
    def run(cut, flips):
        data = bytearray(good)
        for i, b in flips:
            data[i] = b
        _send(url, bytes(data[:cut]))
    run()
    target.check()


@pytest.mark.parametrize("role", ["worker", "gateway"])
def test_frames_after_the_handshake(tcp_target, role):
    url = tcp_target.service(role).url

    @FUZZ
    @given(st.lists(hostile_frames(), min_size=1, max_size=4), st.booleans())
    def run(frames, truncate):
        s = _authenticated(url)
        try:
            data = b"".join(frames)
            if truncate and len(data) > 1:
                data = data[: len(data) // 2]
            try:
                s.sendall(data)
                s.settimeout(0.02)
                s.recv(65536)
            except OSError:
                pass
        finally:
            s.close()
    run()
    tcp_target.check()


@pytest.mark.parametrize("role", ["worker", "gateway"])
def test_floods(tcp_target, role):
    """Thousands of frames at once: credits, pings never read, garbage headers."""
    url = tcp_target.service(role).url
    ping = b"".join(bytes(p) for p in framing.frame_data({"op": "ping", "id": 7}, []))
    junk = _prefix(framing.Kind.DATA, 3, 0) + b"\xc1\xc1\xc1"
    for flood in (_prefix(framing.Kind.CREDIT, 0, 1) * 5000, ping * 3000, junk * 1000):
        s = _authenticated(url)
        try:
            s.settimeout(5.0)
            try:
                s.sendall(flood)
            except OSError:
                pass
        finally:
            s.close()
    # a flood of connections, each sending a partial hello and going away
    hello = b"".join(framing.encode_hello(hello_fields("tcp")))
    for i in range(200):
        _send(url, hello[: i % len(hello)])
    tcp_target.check()
