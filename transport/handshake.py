"""The connection handshake every backend shares: what two peers say before the first message.

Phase 1 runs on a byte stream (the tcp socket, the shm Unix socket, the rdma side channel)
and is the same for every backend. It is sans-IO (:class:`HelloExchange`: bytes in, bytes
out, validated results), in the style of h11::

    both   HELLO {transport, version, backend, role, nonce, auth, caps, <backend parameters>}
    both   check the peer's HELLO: identity, backend, and every size it announces against
           this side's own :class:`Limits` -- nothing is allocated on a peer's say-so
    both   ACCEPT {auth: proof or nil}, proof = HMAC-SHA256(secret, label(role) |
           SHA-256(client HELLO) | SHA-256(server HELLO)) with a shared secret, compared in
           constant time; a side is done only once it has the peer's ACCEPT
    either REFUSED {reason, code} instead: why it hangs up (limits, authentication)

Fresh nonces in both HELLOs make every proof single-use; the role label stops a proof from
being reflected back; hashing both HELLOs binds the announced parameters to the secret.

``caps`` lists optional wire features a side can receive (framing.CAP_SHM_FAST, say); a
feature is used only when both HELLOs list it (:attr:`HelloExchange.shared_caps`), so a
peer that predates it, and sends no ``caps``, keeps the format every version speaks.

Authentication policy (mutual): a side with a secret accepts only a peer that proves the
same secret, and a side without one refuses a peer that asks for it, so neither end can be
fooled into talking to a stranger. Without secrets on both ends the connection is
unauthenticated (``authenticated`` is False) and control operations above the transport
can refuse it.

Phase 2 is the backend's own (shm: segment file descriptors; rdma: queue pair numbers and
the READY barrier) and starts only after phase 1 succeeded, so a stranger never makes us
map memory or create verbs objects.

I/O: a backend writes its handshake as a generator that yields :data:`READ` or
:data:`WRITE` when it would block (or a :class:`Rearm` to move its deadline), using
:func:`send_all`, :func:`recv_exact` and :func:`exchange` below. :func:`run` drives one
to the end with a deadline (``connect``, ``Listener.accept``); :class:`Pending` lets a serve
loop drive many at once from one poller, each with its own deadline, so a client that never
finishes its handshake costs the loop nothing but a file descriptor.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import select
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, Optional, Sequence

from . import framing
from .base import DEFAULT_SLOT_SIZE, Deadline
from .errors import AcceptFailed, AuthenticationError, ConnectionClosed, ProtocolError, Refused
from .framing import Kind
from .timing import HELLO_TIMEOUT  # noqa: F401  (re-exported: the listeners' handshake bound)

#: the longest a HELLO may be (well below framing.MAX_HEADER: no backend needs more)
MAX_HELLO = 4096
#: a peer's capability list is at most this long, each name at most MAX_CAP_NAME characters
MAX_CAPS, MAX_CAP_NAME = 32, 64
NONCE_BYTES = 32
AUTH_SCHEME = "hmac-sha256"
_AUTH_LABEL = b"moe-transport/auth/v1\0"

# what a generator yields when it would block
READ = "read"
WRITE = "write"


@dataclass(frozen=True)
class Rearm:
    """Yielded by a handshake generator to give itself at least ``seconds`` from now (slow
    local set-up, such as registering memory under emulation, is not the peer's fault)."""

    seconds: float


HandshakeGen = Generator[Any, None, Any]


# -- limits ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Limits:
    """What a peer may make this side allocate: its announced slot size (the largest message
    we may send it, i.e. our send slots) and slot count (our send slots, its credits)."""

    max_slot_size: int
    max_nslots: int

    @classmethod
    def for_endpoint(cls, slot_size: int, nslots: int, *, max_slot_size: Optional[int] = None,
                     max_nslots: Optional[int] = None) -> "Limits":
        """Defaults derived from this side's own configuration: a peer may use slots as large
        as ours or the default 4 MiB, whichever is larger, and up to 64 of them."""
        return cls(max_slot_size if max_slot_size is not None else max(slot_size, DEFAULT_SLOT_SIZE),
                   max_nslots if max_nslots is not None else max(nslots, 64))

    def check(self, peer: dict) -> None:
        """``peer['slot_size']`` and ``peer['nslots']`` are ints within these limits, or
        ProtocolError saying which limit and how to raise it."""
        for key, limit, option in (("slot_size", self.max_slot_size, "max_peer_slot_size"),
                                   ("nslots", self.max_nslots, "max_peer_nslots")):
            v = peer.get(key)
            if type(v) is not int or v <= 0:
                raise ProtocolError(f"handshake field {key}={v!r} is invalid")
            if v > limit:
                raise ProtocolError(f"peer announced {key}={v}, above this side's limit of {limit} "
                                    f"(raise it with the {option} option)")


def peer_caps(peer: dict) -> frozenset:
    """The capabilities a peer's HELLO lists (none if it has no ``caps``: an older
    version); ProtocolError if the list is malformed or longer than MAX_CAPS."""
    caps = peer.get("caps", [])
    if type(caps) is not list or len(caps) > MAX_CAPS \
            or any(type(c) is not str or len(c) > MAX_CAP_NAME for c in caps):
        raise ProtocolError(f"handshake field caps={caps!r:.100} is invalid")
    return frozenset(caps)


# -- secrets -----------------------------------------------------------------------------
def as_secret(secret: Any) -> Optional[bytes]:
    """A secret option as bytes (None stays None); an empty secret is refused, since it
    would authenticate anyone who guesses that it is empty."""
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"secret must be bytes or str, got {type(secret).__name__}")
    if not secret.strip():
        raise ValueError("an empty secret authenticates nobody: give a real one or none")
    return bytes(secret)


def proof(secret: bytes, role: str, client_hello: bytes, server_hello: bytes) -> bytes:
    msg = (_AUTH_LABEL + role.encode() + b"\0" + hashlib.sha256(client_hello).digest()
           + hashlib.sha256(server_hello).digest())
    return hmac.new(secret, msg, hashlib.sha256).digest()


# -- phase 1, sans-IO --------------------------------------------------------------------
def _frame(obj: dict) -> bytes:
    return b"".join(framing.encode_hello(obj))


class HelloExchange:
    """Phase 1 of the handshake with no I/O: feed it exactly :attr:`need` bytes at a time
    with :meth:`receive`, send what :meth:`data_to_send` returns, until :attr:`done`.

    ``params`` are this side's backend parameters (they go into our HELLO); ``validate``
    checks the peer's (its own fields; ``limits`` are applied to slot_size/nslots first).
    Raises ProtocolError (bad bytes, a limit), AuthenticationError or Refused; after a
    failure :attr:`refusal` holds the REFUSED frame to send, if we refused.
    """

    def __init__(self, role: str, backend: str, params: dict, *, limits: Limits,
                 secret: Optional[bytes] = None,
                 validate: Optional[Callable[[dict], None]] = None,
                 caps: Sequence[str] = ()) -> None:
        if role not in ("client", "server"):
            raise ValueError(f"role must be client or server, got {role!r}")
        self.role = role
        self.backend = backend
        self.limits = limits
        self.secret = secret
        self._validate = validate
        hello = {"transport": "moe-transport", "version": framing.VERSION, "backend": backend,
                 "role": role, "nonce": os.urandom(NONCE_BYTES),
                 "auth": AUTH_SCHEME if secret is not None else None, **params}
        self.caps = frozenset(caps)
        if caps:  # no key at all without capabilities: the HELLO an old version sends
            hello["caps"] = sorted(self.caps)
        #: the capabilities both HELLOs list (set once the peer's HELLO is checked)
        self.shared_caps: frozenset = frozenset()
        self._ours = _frame(hello)
        self._out = bytearray(self._ours)
        self._theirs = b""
        self.state = "hello-prefix"
        self.need = framing.PREFIX_SIZE
        self._kind = 0
        self.peer: dict = {}
        self.authenticated = False
        self.refusal: Optional[bytes] = None

    @property
    def done(self) -> bool:
        return self.state == "done"

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    def refuse(self, reason: str, code: str = "refused", why: Optional[str] = None) -> None:
        """Prepare a REFUSED frame for the peer (best effort: the caller sends it); ``why``:
        an authentication failure's kind, from this side's point of view."""
        body = {"refused": reason[:500], "code": code}
        if why is not None:
            body["why"] = why
        self.refusal = _frame(body)

    def receive(self, data: bytes) -> None:
        if len(data) != self.need:
            raise ValueError(f"handshake wants {self.need} bytes, got {len(data)}")
        self._receive(bytes(data))

    def _receive(self, data: bytes) -> None:
        state = self.state
        if state.endswith("prefix"):
            kind, hlen, plen = framing.decode_prefix(data, max_header=MAX_HELLO)
            if kind != Kind.HELLO:
                raise ProtocolError(f"expected a handshake, got a {Kind(kind).name} frame")
            if not hlen:
                raise ProtocolError("empty handshake frame")
            self._prefix = data
            self.state = state.replace("prefix", "body")
            self.need = hlen
            return
        body = framing.decode_hello(data)
        if "refused" in body:
            raise refusal_error(body)
        if state == "hello-body":
            self._theirs = self._prefix + data
            self._on_hello(body)
        elif state == "auth-body":
            self._on_auth(body)
        else:  # pragma: no cover - states are internal
            raise AssertionError(state)

    def _fail(self, exc: Exception, code: str = "refused") -> Exception:
        self.refuse(str(exc), code, getattr(exc, "why", None))
        return exc

    def _on_hello(self, peer: dict) -> None:
        if peer.get("transport") != "moe-transport":
            raise ProtocolError("peer is not a moe-transport endpoint")
        if peer.get("version") != framing.VERSION:
            raise self._fail(ProtocolError(f"peer speaks protocol version {peer.get('version')!r}, "
                                           f"we speak {framing.VERSION}"))
        if peer.get("backend") != self.backend:
            raise self._fail(ProtocolError(f"peer is a {peer.get('backend')!r} endpoint, not {self.backend!r}"))
        want = "server" if self.role == "client" else "client"
        if peer.get("role") != want:
            raise self._fail(ProtocolError(f"peer says it is a {peer.get('role')!r}, expected a {want}"))
        nonce = peer.get("nonce")
        if type(nonce) is not bytes or len(nonce) != NONCE_BYTES:
            raise self._fail(ProtocolError("handshake nonce is missing or malformed"))
        auth = peer.get("auth")
        if auth not in (None, AUTH_SCHEME):
            raise self._fail(AuthenticationError(f"peer wants authentication scheme {auth!r}; "
                                                 f"we know {AUTH_SCHEME!r}"), "auth")
        try:
            self.limits.check(peer)
            shared = self.caps & peer_caps(peer)
            if self._validate is not None:
                self._validate(peer)
        except ProtocolError as e:
            raise self._fail(e) from None
        if self.secret is not None and auth is None:
            raise self._fail(auth_error(AuthenticationError.PEER_HAS_NONE), "auth")
        if self.secret is None and auth is not None:
            raise self._fail(auth_error(AuthenticationError.THIS_HAS_NONE), "auth")
        self.peer = peer
        self.shared_caps = shared
        # the second frame says "accepted" (with our proof when there is a secret); nobody is
        # done before it has the peer's, so a refusal always reaches the side it refuses
        mine = None
        self._expect = None
        if self.secret is not None:
            client, server = (self._ours, self._theirs) if self.role == "client" else (self._theirs, self._ours)
            self._expect = proof(self.secret, want, client, server)
            mine = proof(self.secret, self.role, client, server)
        self._out += _frame({"auth": mine})
        self.state, self.need = "auth-prefix", framing.PREFIX_SIZE

    def _on_auth(self, body: dict) -> None:
        got = body.get("auth")
        if self._expect is None:
            if "auth" not in body or got is not None:
                raise self._fail(ProtocolError("expected the peer's plain acceptance"))
        elif type(got) is not bytes or not hmac.compare_digest(got, self._expect):
            raise self._fail(auth_error(AuthenticationError.MISMATCH), "auth")
        self.authenticated = self._expect is not None
        self.state, self.need = "done", 0


# -- authentication failures, told from this side --------------------------------------------
_AUTH_TEXT = {
    AuthenticationError.MISMATCH: "the peer holds a different shared secret (its proof does not match this side's)",
    AuthenticationError.PEER_HAS_NONE: "the peer has no shared secret and this side has one (authentication is "
                                       "mutual: both ends need the same secret, or neither)",
    AuthenticationError.THIS_HAS_NONE: "the peer requires a shared secret and this side has none "
                                       "(--secret-file or MOE_SECRET_FILE)",
}
#: a refusal's ``why`` is the refusing side's view: the same failure seen from here
_SEEN_FROM_HERE = {AuthenticationError.MISMATCH: AuthenticationError.MISMATCH,
                   AuthenticationError.PEER_HAS_NONE: AuthenticationError.THIS_HAS_NONE,
                   AuthenticationError.THIS_HAS_NONE: AuthenticationError.PEER_HAS_NONE}


def auth_error(why: str) -> AuthenticationError:
    return AuthenticationError(_AUTH_TEXT[why], why)


def refusal_error(body: dict) -> Refused:
    """The error a peer's REFUSED frame means here (an authentication failure said from
    this side's point of view when the peer says which kind it was)."""
    reason = str(body.get("refused"))[:500]
    if body.get("code") != "auth":
        return Refused(f"peer refused the connection: {reason}")
    why = _SEEN_FROM_HERE.get(body.get("why"))  # type: ignore[arg-type]
    if why is None:  # a peer that does not say which kind
        return AuthenticationError(f"peer refused the connection: {reason}")
    return AuthenticationError(f"peer refused the connection: {_AUTH_TEXT[why]}", why)


# -- I/O for handshake generators ----------------------------------------------------------
def send_all(sock: socket.socket, data: bytes) -> HandshakeGen:
    """Send ``data`` on a non-blocking socket, yielding WRITE while the kernel is full."""
    view = memoryview(data)
    while view:
        try:
            n = sock.send(view, socket.MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            yield WRITE
            continue
        except OSError as e:
            raise ConnectionClosed(f"handshake failed: {e}") from None
        view = view[n:]


def recv_exact(sock: socket.socket, n: int) -> HandshakeGen:
    """Exactly ``n`` bytes (never more: what follows belongs to phase 2 or the data path)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except (BlockingIOError, InterruptedError):
            yield READ
            continue
        except OSError as e:
            raise ConnectionClosed(f"handshake failed: {e}") from None
        if k == 0:
            raise ConnectionClosed("peer closed during the handshake")
        got += k
    return bytes(buf)


def exchange(sock: socket.socket, ex: HelloExchange) -> HandshakeGen:
    """Drive phase 1 over ``sock``; on failure send our refusal (best effort) and re-raise."""
    try:
        while True:
            out = ex.data_to_send()
            if out:
                try:
                    yield from send_all(sock, out)
                except ConnectionClosed:
                    _raise_refusal(sock)  # the peer hung up on us: say why, if it said
                    raise
            if ex.done:
                return ex
            ex.receive((yield from recv_exact(sock, ex.need)))
    except (ProtocolError, AuthenticationError):
        if ex.refusal is not None:
            try:
                sock.send(ex.refusal, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            except OSError:
                pass
        raise


def _raise_refusal(sock: socket.socket) -> None:
    """If a REFUSED frame is waiting on ``sock``, raise it as Refused/AuthenticationError."""
    try:
        data = sock.recv(framing.PREFIX_SIZE + MAX_HELLO, socket.MSG_DONTWAIT | socket.MSG_PEEK)
    except OSError:
        return
    if len(data) < framing.PREFIX_SIZE:
        return
    try:
        kind, hlen, _ = framing.decode_prefix(data[:framing.PREFIX_SIZE], max_header=MAX_HELLO)
        body = framing.decode_hello(data[framing.PREFIX_SIZE:framing.PREFIX_SIZE + hlen])
    except ProtocolError:
        return
    if kind == Kind.HELLO and "refused" in body:
        raise refusal_error(body)


def frame_exchange(sock: socket.socket, ours: dict, validate: Callable[[dict], dict]) -> HandshakeGen:
    """Phase-2 helper: send one HELLO frame, read the peer's, return ``validate(peer)``."""
    yield from send_all(sock, _frame(ours))
    kind, hlen, _ = framing.decode_prefix((yield from recv_exact(sock, framing.PREFIX_SIZE)),
                                          max_header=MAX_HELLO)
    if kind != Kind.HELLO:
        raise ProtocolError(f"expected a handshake, got a {Kind(kind).name} frame")
    body = framing.decode_hello((yield from recv_exact(sock, hlen)))
    if "refused" in body:
        raise Refused(f"peer refused the connection: {str(body.get('refused'))[:500]}")
    return validate(body)


# -- drivers ---------------------------------------------------------------------------------
_EVENTS = {READ: select.POLLIN, WRITE: select.POLLOUT}


def run(gen: HandshakeGen, fd: int, deadline: Deadline, what: str = "in the handshake") -> Any:
    """Drive a handshake generator to its result, blocking in poll until ``deadline``
    (Timeout after it); the generator is closed on any failure."""
    p = select.poll()
    registered = 0
    try:
        ev = next(gen)
        while True:
            if isinstance(ev, Rearm):
                deadline = Deadline(max(deadline.remaining(), ev.seconds))
                ev = gen.send(None)
                continue
            mask = _EVENTS[ev]
            if mask != registered:
                if registered:
                    p.modify(fd, mask)
                else:
                    p.register(fd, mask)
                registered = mask
            left = deadline.check(what)
            if p.poll(left * 1000.0 + 0.5):
                ev = gen.send(None)
    except StopIteration as stop:
        return stop.value
    finally:
        gen.close()


class Pending:
    """A connection whose handshake is in progress, driven by a serve loop's poller.

    ``fileno()`` and :attr:`events` (READ or WRITE) say what to wait for; :meth:`step`
    advances it once the fd is ready and returns the connection when the handshake is
    complete (None while it is not), or raises (TransportError) after closing everything;
    :attr:`deadline` (time.monotonic) is when the loop should :meth:`close` it instead.
    """

    def __init__(self, gen: HandshakeGen, sock: socket.socket, peer: str, timeout: float = HELLO_TIMEOUT):
        self._gen = gen
        self.sock = sock
        self.peer = peer  # the remote address, for logs
        self.deadline = time.monotonic() + timeout
        self.events = READ
        self._fd = sock.fileno()
        self._started = False
        self.closed = False

    def fileno(self) -> int:
        return self._fd

    def expired(self, now: Optional[float] = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.deadline

    def step(self) -> Any:
        if self.closed:
            raise ConnectionClosed("handshake abandoned")
        try:
            ev = next(self._gen) if not self._started else self._gen.send(None)
            self._started = True
            while isinstance(ev, Rearm):
                self.deadline = max(self.deadline, time.monotonic() + ev.seconds)
                ev = self._gen.send(None)
            self.events = ev
            return None
        except StopIteration as stop:
            self.closed = True
            self._gen = None  # done: the socket now belongs to the connection
            return stop.value
        except BaseException:
            self.close()
            raise

    def wait(self, deadline: Deadline) -> Any:
        """Drive the handshake to its end, blocking (``Listener.accept``)."""
        gen, self._gen = self._gen, None
        if gen is None or self._started:
            raise RuntimeError("wait() drives a handshake that has not been stepped")
        try:
            conn = run(gen, self._fd, deadline, "in the handshake")
        except BaseException:
            self.closed = True
            self.sock.close()
            raise
        self.closed = True
        return conn

    def close(self) -> None:
        """Abandon the handshake (deadline passed, loop closing); closes the socket."""
        gen, self._gen = self._gen, None
        if gen is None:
            return
        self.closed = True
        if gen is not None:
            gen.close()  # the generator's own cleanup (phase-2 resources) runs here
        try:
            self.sock.close()
        except OSError:
            pass

    def __repr__(self) -> str:
        return f"<Pending handshake from {self.peer}>"


def accept_socket(lsock: socket.socket, url: str) -> Optional[tuple[socket.socket, Any]]:
    """One connection from a non-blocking listening socket, or None if none is waiting.
    Errors other than "nothing there" (out of file descriptors, ...) raise AcceptFailed
    (naming ``url``, the listener's), for the serve loop to back off."""
    try:
        sock, addr = lsock.accept()
    except (BlockingIOError, InterruptedError):
        return None
    except ConnectionAbortedError:
        return None  # the client gave up before we took it
    except OSError as e:
        raise AcceptFailed(f"{url}: accept failed: {e}", e.errno) from None
    sock.setblocking(False)
    return sock, addr


def tune_stream(sock: socket.socket) -> None:
    """A tcp or rdma control socket as both ends use it: TCP_NODELAY (a small message goes
    at once, not after the previous one's ack) and non-blocking."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)


def accept_stream(lsock: socket.socket, url: str, scheme: str) -> Optional[tuple[socket.socket, str]]:
    """:func:`accept_socket` for a TCP listener: the connection tuned (:func:`tune_stream`)
    and named ``scheme://host:port`` after its peer; None when nothing waits, or when it was
    reset before we looked at it."""
    got = accept_socket(lsock, url)
    if got is None:
        return None
    sock, addr = got
    try:
        tune_stream(sock)
    except OSError:
        sock.close()
        return None
    return sock, f"{scheme}://{addr[0]}:{addr[1]}"
