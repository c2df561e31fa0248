"""The shared handshake (transport/handshake.py): the sans-IO exchange, limits a peer cannot
raise, mutual authentication, non-blocking accepts, and shm peer credentials."""
from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest
from hypothesis import given, settings, strategies as st

import transport
from transport import framing, handshake as hs
from transport.errors import AuthenticationError, ConnectionClosed, ProtocolError, Refused, Timeout
from transport.poller import Poller

LIMITS = hs.Limits(max_slot_size=1 << 20, max_nslots=16)


def _pair(client_kw=None, server_kw=None):
    c = hs.HelloExchange("client", "tcp", {"slot_size": 4096, "nslots": 4}, limits=LIMITS, **(client_kw or {}))
    s = hs.HelloExchange("server", "tcp", {"slot_size": 4096, "nslots": 4}, limits=LIMITS, **(server_kw or {}))
    return c, s


def _run(c, s):
    """Shuttle bytes between two exchanges until both are done (or one raises)."""
    wires = {id(c): bytearray(), id(s): bytearray()}  # bytes waiting for each side
    for _ in range(10):
        for a, b in ((c, s), (s, c)):
            wires[id(b)] += a.data_to_send()
        for x in (c, s):
            buf = wires[id(x)]
            while not x.done and len(buf) >= x.need:
                chunk, buf[:] = bytes(buf[:x.need]), buf[x.need:]
                x.receive(chunk)
        if c.done and s.done:
            return
    raise AssertionError("exchange did not finish")


def test_plain_exchange_carries_the_parameters():
    c, s = _pair()
    _run(c, s)
    assert c.peer["slot_size"] == 4096 and s.peer["nslots"] == 4
    assert not c.authenticated and not s.authenticated


def test_same_secret_authenticates_both_ways():
    c, s = _pair({"secret": b"k" * 32}, {"secret": b"k" * 32})
    _run(c, s)
    assert c.authenticated and s.authenticated


@pytest.mark.parametrize("cs,ss,who", [(b"a" * 16, b"b" * 16, "proves"), (None, b"b" * 16, "requires"),
                                       (b"a" * 16, None, "requires")])
def test_authentication_failures_are_clear(cs, ss, who):
    c, s = _pair({"secret": cs}, {"secret": ss})
    with pytest.raises(AuthenticationError) as e:
        _run(c, s)
    assert ("secret" in str(e.value))


@pytest.mark.parametrize("cs,ss,client_why,server_why", [
    (b"a" * 16, b"b" * 16, "mismatch", "mismatch"),
    (None, b"b" * 16, "this_has_none", "peer_has_none"),
    (b"a" * 16, None, "peer_has_none", "this_has_none")])
def test_each_side_knows_which_side_has_the_secret(cs, ss, client_why, server_why):
    """Whichever side fails first, each reads the failure from its own point of view: the
    refusal frame says the kind from the refuser's, and the receiver turns it round."""
    c, s = _pair({"secret": cs}, {"secret": ss})
    with pytest.raises(AuthenticationError) as e:
        _run(c, s)
    failed, other = (c, s) if e.value is not None and c.refusal is not None else (s, c)
    why = {c: client_why, s: server_why}
    assert e.value.why == why[failed]
    # the side that refused sent a frame; the other side reads it as its own kind of failure
    refused = hs.refusal_error(hs.framing.decode_hello(failed.refusal[framing.PREFIX_SIZE:]))
    assert isinstance(refused, AuthenticationError) and refused.why == why[other], (refused, refused.why)
    assert "secret" in str(refused) and str(refused).startswith("peer refused the connection: ")


def test_a_proof_from_another_session_is_refused():
    """Fresh nonces on both sides: a recorded AUTH frame does not open a new session."""
    c1, s1 = _pair({"secret": b"k" * 16}, {"secret": b"k" * 16})
    c1_hello = c1.data_to_send()
    s1_hello = s1.data_to_send()
    c1.receive(s1_hello[:16]); c1.receive(s1_hello[16:])
    recorded_auth = c1.data_to_send()
    _, s2 = _pair(None, {"secret": b"k" * 16})
    s2.data_to_send()
    s2.receive(c1_hello[:16]); s2.receive(c1_hello[16:])  # replay the client's hello...
    s2.receive(recorded_auth[:16])
    with pytest.raises(AuthenticationError):
        s2.receive(recorded_auth[16:])  # ...and its proof: bound to s1's nonce, not s2's
    assert s2.refusal is not None


@pytest.mark.parametrize("field,value", [("slot_size", 1 << 40), ("nslots", 1_000_000), ("slot_size", 0),
                                         ("nslots", "many")])
def test_a_peer_cannot_raise_our_limits(field, value):
    c = hs.HelloExchange("client", "tcp", {"slot_size": 4096, "nslots": 4, field: value}, limits=LIMITS)
    s = hs.HelloExchange("server", "tcp", {"slot_size": 4096, "nslots": 4}, limits=LIMITS)
    with pytest.raises(ProtocolError) as e:
        _run(c, s)
    assert field in str(e.value)
    # the refusing side tells the other why, and the other raises Refused with the reason
    refusal = s.refusal
    assert refusal is not None
    c2, _ = _pair()
    c2.data_to_send()
    c2.receive(refusal[:16])
    with pytest.raises(Refused, match=field):
        c2.receive(refusal[16:])


@pytest.mark.parametrize("change,match", [({"version": 1}, "version"), ({"backend": "shm"}, "shm"),
                                          ({"role": "server"}, "server"), ({"nonce": b"x"}, "nonce"),
                                          ({"transport": "other"}, "moe-transport"),
                                          ({"auth": "rot13"}, "scheme")])
def test_bad_hello_fields(change, match):
    s = hs.HelloExchange("server", "tcp", {"slot_size": 4096, "nslots": 4}, limits=LIMITS)
    hello = {"transport": "moe-transport", "version": framing.VERSION, "backend": "tcp", "role": "client",
             "nonce": os.urandom(32), "auth": None, "slot_size": 4096, "nslots": 4, **change}
    wire = b"".join(framing.encode_hello(hello))
    s.receive(wire[:16])
    with pytest.raises((ProtocolError, AuthenticationError), match=match):
        s.receive(wire[16:])


@pytest.mark.parametrize("ccaps,scaps,shared", [
    (("shm-fast-1",), ("shm-fast-1",), {"shm-fast-1"}),
    (("shm-fast-1", "x"), ("y", "shm-fast-1"), {"shm-fast-1"}),
    (("shm-fast-1",), (), set()),  # an old peer: no caps key at all, nothing shared
    ((), ("shm-fast-1",), set()),
])
def test_capabilities_are_used_only_when_both_list_them(ccaps, scaps, shared):
    c, s = _pair({"caps": ccaps}, {"caps": scaps})
    _run(c, s)
    assert c.shared_caps == s.shared_caps == shared
    assert ("caps" in c.peer) == bool(scaps) and ("caps" in s.peer) == bool(ccaps)


@pytest.mark.parametrize("caps", ["shm-fast-1", [1], ["x" * 65], ["c"] * 33, {"a": 1}])
def test_malformed_capabilities_are_refused(caps):
    s = hs.HelloExchange("server", "tcp", {"slot_size": 4096, "nslots": 4}, limits=LIMITS, caps=("shm-fast-1",))
    hello = {"transport": "moe-transport", "version": framing.VERSION, "backend": "tcp", "role": "client",
             "nonce": os.urandom(32), "auth": None, "slot_size": 4096, "nslots": 4, "caps": caps}
    wire = b"".join(framing.encode_hello(hello))
    s.receive(wire[:16])
    with pytest.raises(ProtocolError, match="caps"):
        s.receive(wire[16:])
    assert s.refusal is not None  # the peer is told why


def test_oversized_and_wrong_frames():
    s = hs.HelloExchange("server", "tcp", {"slot_size": 4096, "nslots": 4}, limits=LIMITS)
    with pytest.raises(ProtocolError, match="limit"):
        s.receive(framing.encode_prefix(framing.Kind.HELLO, hs.MAX_HELLO + 1, 0))
    s = hs.HelloExchange("server", "tcp", {"slot_size": 4096, "nslots": 4}, limits=LIMITS)
    with pytest.raises(ProtocolError, match="DATA"):
        s.receive(framing.encode_prefix(framing.Kind.DATA, 10, 0))
    with pytest.raises(ValueError):
        hs.HelloExchange("server", "tcp", {}, limits=LIMITS).receive(b"short")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(min_size=0, max_size=64), min_size=1, max_size=8), st.booleans())
def test_fuzz_exchange_never_fails_outside_its_errors(chunks, secret):
    """Whatever arrives, the exchange raises only its own errors (or finishes)."""
    s = hs.HelloExchange("server", "tcp", {"slot_size": 4096, "nslots": 4}, limits=LIMITS,
                         secret=b"k" * 8 if secret else None)
    data = b"".join(chunks)
    try:
        while not s.done and len(data) >= s.need:
            chunk, data = data[:s.need], data[s.need:]
            s.receive(chunk)
    except (ProtocolError, Refused):
        pass


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["transport", "version", "backend", "role", "nonce", "auth",
                                        "slot_size", "nslots", "refused", "code"]),
                       st.one_of(st.none(), st.integers(-2, 1 << 41), st.binary(max_size=40),
                                 st.text(max_size=20), st.booleans())))
def test_fuzz_hello_maps(fields):
    s = hs.HelloExchange("server", "tcp", {"slot_size": 4096, "nslots": 4}, limits=LIMITS)
    wire = b"".join(framing.encode_hello(fields))
    try:
        s.receive(wire[:16])
        s.receive(wire[16:])
    except (ProtocolError, Refused):
        return
    assert s.done and LIMITS.max_slot_size >= s.peer["slot_size"] > 0 and 16 >= s.peer["nslots"] > 0


def test_secret_option_checks():
    assert hs.as_secret("abc") == b"abc"
    assert hs.as_secret(None) is None
    with pytest.raises(ValueError):
        hs.as_secret("  ")
    with pytest.raises(TypeError):
        hs.as_secret(42)


# -- live, over real sockets ------------------------------------------------------------------
def _url(backend):
    return "tcp://127.0.0.1:0" if backend == "tcp" else f"shm://moe-test-{uuid.uuid4().hex[:12]}"


def _connect_in_thread(url, **kw):
    box = {}

    def go():
        try:
            box["conn"] = transport.connect(url, **kw)
        except BaseException as e:  # reported to the test
            box["err"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, box


@pytest.mark.parametrize("backend", ["tcp", "shm"])
@pytest.mark.parametrize("cs,ss,ok", [(b"s3cret", b"s3cret", True), (None, b"s3cret", False),
                                      (b"s3cret", None, False), (b"other", b"s3cret", False)])
def test_live_authentication(backend, cs, ss, ok):
    with transport.listen(_url(backend), slot_size=4096, nslots=2, timeout=5, secret=ss) as lst:
        t, box = _connect_in_thread(lst.url, slot_size=4096, nslots=2, timeout=5, secret=cs)
        if ok:
            srv = lst.accept(timeout=5)
            t.join(5)
            cli = box["conn"]
            assert srv.authenticated and cli.authenticated
            slot = cli.alloc(3)
            slot.buf[:] = b"abc"
            cli.send({"k": 1}, [slot])
            with srv.recv(timeout=5) as m:
                assert bytes(m.buffers[0]) == b"abc"
            cli.close()
            srv.close()
        else:
            with pytest.raises(AuthenticationError):
                lst.accept(timeout=5)
            t.join(5)
            assert isinstance(box.get("err"), AuthenticationError), box


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_unauthenticated_peers_are_marked(backend):
    with transport.listen(_url(backend), slot_size=4096, nslots=2, timeout=5) as lst:
        t, box = _connect_in_thread(lst.url, slot_size=4096, nslots=2, timeout=5)
        srv = lst.accept(timeout=5)
        t.join(5)
        assert not srv.authenticated and not box["conn"].authenticated
        box["conn"].close()
        srv.close()


def _raw_hello(**fields):
    hello = {"transport": "moe-transport", "version": framing.VERSION, "backend": "tcp", "role": "client",
             "nonce": os.urandom(32), "auth": None, "slot_size": 4096, "nslots": 2, **fields}
    return b"".join(framing.encode_hello(hello))


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("fields", [{"slot_size": 1 << 44}, {"nslots": 1_000_000}])
def test_live_huge_hello_is_refused_and_allocates_nothing(fields):
    """The ENOMEM / 1 GB-per-hello bugs: refused with a clear error, memory unchanged, and
    the raw client is told why."""
    with transport.listen("tcp://127.0.0.1:0", slot_size=4096, nslots=2, timeout=5) as lst:
        port = int(lst.url.rsplit(":", 1)[1])
        before = _rss_mb()
        for _ in range(3):
            g = socket.create_connection(("127.0.0.1", port))
            g.sendall(_raw_hello(**fields))
            with pytest.raises(ProtocolError, match="limit"):
                lst.accept(timeout=5)
            g.settimeout(5)
            got = b""
            while True:
                chunk = g.recv(4096)
                if not chunk:
                    break
                got += chunk
            g.close()
            assert b"refused" in got and b"limit" in got
        assert _rss_mb() - before < 50
        t, box = _connect_in_thread(lst.url, slot_size=4096, nslots=2, timeout=5)
        srv = lst.accept(timeout=5)
        t.join(5)
        box["conn"].close()
        srv.close()


def test_client_refuses_a_server_that_announces_too_much():
    with transport.listen("tcp://127.0.0.1:0", slot_size=64 << 20, nslots=2, timeout=5) as lst:
        t, box = _connect_in_thread(lst.url, slot_size=4096, nslots=2, timeout=5, max_peer_slot_size=1 << 20)
        with pytest.raises(Refused):
            lst.accept(timeout=5)
        t.join(5)
        assert isinstance(box.get("err"), ProtocolError) and "limit" in str(box["err"])


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_silent_clients_do_not_delay_a_real_one(backend):
    """accept_pending + Pending.step from one poller: twenty clients that never say hello
    cost nothing; a real client completes at once; the silent ones expire at their deadline."""
    url = _url(backend)
    with transport.listen(url, slot_size=4096, nslots=2, timeout=5) as lst:
        silent = []
        for _ in range(20):
            if backend == "tcp":
                s = socket.create_connection(("127.0.0.1", int(lst.url.rsplit(":", 1)[1])))
            else:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect("\0moe-transport/shm/" + lst.url.split("://")[1])
            silent.append(s)
        poller = Poller()
        poller.register(lst, "listener")
        pendings: list = []
        conns = []
        t0 = time.monotonic()
        t, box = None, None
        try:
            while time.monotonic() - t0 < 10:
                if t is None and len(pendings) >= 20:  # all silent ones are in: now the real one
                    t, box = _connect_in_thread(lst.url, slot_size=4096, nslots=2, timeout=5)
                    t_real = time.monotonic()
                for obj, role in poller.poll(0.05):
                    if role == "listener":
                        while (p := lst.accept_pending()) is not None:
                            for q in pendings:
                                q.deadline = min(q.deadline, time.monotonic() + 1.5)
                            p.deadline = time.monotonic() + 1.5
                            pendings.append(p)
                            poller.register(p, "pending")
                    else:
                        try:
                            conn = obj.step()
                        except transport.TransportError:
                            poller.unregister(obj)
                            pendings.remove(obj)
                            continue
                        if conn is not None:
                            poller.unregister(obj)
                            pendings.remove(obj)
                            conns.append((conn, time.monotonic()))
                        elif obj.events == hs.WRITE:
                            poller.modify(obj, write=True)
                now = time.monotonic()
                for p in [p for p in pendings if p.expired(now)]:
                    poller.unregister(p)
                    p.close()
                    pendings.remove(p)
                if conns and not pendings:
                    break
            assert len(conns) == 1, conns
            assert conns[0][1] - t_real < 1.0  # not behind the silent ones
            assert not pendings  # every silent one expired and was closed
            t.join(5)
            box["conn"].close()
            conns[0][0].close()
        finally:
            poller.close()
            for s in silent:
                s.close()


def test_shm_refuses_another_user():
    """A second local user (nobody) cannot connect to our shm listener: SO_PEERCRED."""
    if os.getuid() != 0:
        pytest.skip("needs root to run a client as another user")
    url = _url("shm")
    code = ("import os, sys, transport, transport.shm\n"
            "os.setgid(65534); os.setuid(65534)  # after the imports: nobody cannot read root's venv\n"
            "try:\n"
            f"    transport.connect({url!r}, slot_size=4096, nslots=2, timeout=5)\n"
            "except transport.Refused as e:\n"
            "    print('REFUSED', e); sys.exit(3)\n")
    with transport.listen(url, slot_size=4096, nslots=2, timeout=5) as lst:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(__file__)),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))})
        with pytest.raises(Refused, match="uid 65534"):
            lst.accept(timeout=5)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 3, (out, err)
        assert b"REFUSED" in out and b"not this user" in out


def test_shm_credentials_policy():
    from transport.shm import check_credentials

    me = (1, os.getuid(), os.getgid())
    check_credentials(me, ())
    check_credentials((1, 0, 0), ())  # root may
    with pytest.raises(Refused):
        check_credentials((1, 4242, 4242), ())
    check_credentials((1, 4242, 4242), (4242,))  # an allowed group


def test_shm_peer_credentials_are_reported():
    url = _url("shm")
    with transport.listen(url, slot_size=4096, nslots=2, timeout=5) as lst:
        t, box = _connect_in_thread(url, slot_size=4096, nslots=2, timeout=5)
        srv = lst.accept(timeout=5)
        t.join(5)
        assert srv.peer_credentials == (os.getpid(), os.getuid(), os.getgid())
        box["conn"].close()
        srv.close()


def test_tcp_sockets_send_small_messages_at_once_on_both_ends():
    """TCP_NODELAY on the accepted and the connecting socket: without it a small message
    waits for the previous one's ack (Nagle), 40 ms on Linux with delayed acks."""
    with transport.listen("tcp://127.0.0.1:0", slot_size=4096, nslots=2, timeout=5) as lst:
        t, box = _connect_in_thread(lst.url, slot_size=4096, nslots=2, timeout=5)
        server = lst.accept(timeout=5)
        t.join(5)
        client = box["conn"]
        try:
            for conn in (server, client):
                assert conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            assert server.url.startswith("tcp://127.0.0.1:")  # named after its peer
            assert int(server.url.rsplit(":", 1)[1]) == client.sock.getsockname()[1]
        finally:
            client.close()
            server.close()


def test_a_stream_accept_with_nothing_waiting_returns_none():
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.setblocking(False)
    try:
        assert hs.accept_stream(lsock, "tcp://test", "tcp") is None
    finally:
        lsock.close()
