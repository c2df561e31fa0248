"""The conformance kit (transport/testing/conformance/) on the in-host backends and the
inproc:// test double.

Every check runs on every backend. A backend whose module cannot be imported FAILS its
cases (it is part of the product), it is never skipped. A check that needs a capability
a backend states it lacks (inproc cannot reach another process) is reported by the kit
itself as not applicable, and only such a check may be. The rdma backend runs the same kit
from tests/rdma/ inside the rxe VM.
"""
import uuid

import pytest

import transport
from transport import registry
from transport.testing import conformance
from transport.testing import inproc

BACKENDS = {
    "tcp": dict(url_factory=lambda: "tcp://127.0.0.1:0"),
    # tcp's Python path ("tcp" takes the compiled one, transport/_tcpfast.c, where it is built)
    "tcp-python": dict(url_factory=lambda: "tcp://127.0.0.1:0", backend="tcp", options={"native": False}),
    "shm": dict(url_factory=lambda: f"shm://moe-test-{uuid.uuid4().hex[:12]}",
                shares_sender_memory=True, leak_dirs=("/dev/shm",)),
    "inproc": dict(url_factory=lambda: f"inproc://moe-test-{uuid.uuid4().hex[:12]}",
                   shares_sender_memory=True, capabilities=inproc.CAPABILITIES),
    # shm's Python path for the fast record ("shm" takes the compiled one, transport/_shmfast.c,
    # where it is built: `make test` requires that)
    "shm-python": dict(url_factory=lambda: f"shm://moe-test-{uuid.uuid4().hex[:12]}", backend="shm",
                       options={"native": False}, shares_sender_memory=True, leak_dirs=("/dev/shm",)),
    # shm with the fixed-width fast record turned off on both ends: the msgpack records an
    # older peer sends (and expects) keep passing the whole kit
    "shm-msgpack": dict(url_factory=lambda: f"shm://moe-test-{uuid.uuid4().hex[:12]}", backend="shm",
                        options={"fast": False}, shares_sender_memory=True, leak_dirs=("/dev/shm",)),
}


@pytest.fixture(params=list(BACKENDS))
def env(request):
    opts = dict(BACKENDS[request.param])
    name = opts.pop("backend", request.param)
    registry.backend(name)  # ImportError -> the case fails, loudly
    with conformance.PairEnv(name=name, **opts) as env:
        yield env


@pytest.mark.timeout(60)
@pytest.mark.parametrize("check", conformance.CHECKS, ids=conformance.check_ids())
def test_conformance(env, check):
    result = check(env)
    if result is conformance.NOT_APPLICABLE:
        lacking = {c for c, ok in env.capabilities.items() if not ok}
        assert check.requires & lacking, f"{check.__name__} said not applicable without a reason"
        assert env.not_applicable == [(check.__name__, sorted(check.requires & lacking))]
    else:
        assert result is None
        assert not check.requires & {c for c, ok in env.capabilities.items() if not ok}


def test_kit_api_is_stable():
    """What tests/rdma and transport/shm's author rely on."""
    assert callable(conformance.run_check)
    assert len(conformance.CHECKS) == len(set(conformance.check_ids()))
    for c in conformance.CHECKS:
        assert c.__name__.startswith("check_") and c.__doc__
    assert set(conformance.requirements()) == set(conformance.check_ids())


def test_inproc_lacks_only_a_second_process():
    """The checks inproc:// cannot run are exactly those that spawn a peer process."""
    needs_process = {k for k, req in conformance.requirements().items() if "cross_process" in req}
    assert needs_process == {"peer_killed", "peer_killed_while_we_wait_for_credits", "cross_process",
                             "cross_process_stream"}
    assert inproc.CAPABILITIES == {"cross_process": False}
    assert "inproc" not in registry.available_backends()
    assert "inproc" in registry.available_backends(include_test_doubles=True)


def test_unknown_capability_is_refused():
    with pytest.raises(ValueError):
        conformance.PairEnv(lambda: "inproc://x", capabilities={"telepathy": False})


def test_inproc_pending_behaves_like_a_handshake_in_a_serve_loop():
    """accept_pending() gives what a serve loop drives (transport/handshake.py's Pending):
    fileno, events, deadline, step() -> the connection; refusing one closes it."""
    url = f"inproc://moe-test-{uuid.uuid4().hex[:12]}"
    with registry.listen(url, slot_size=4096, nslots=2, timeout=2) as lst:
        assert lst.accept_pending() is None
        client = registry.connect(url, slot_size=4096, nslots=2, timeout=2)
        p = lst.accept_pending()
        assert p.fileno() >= 0 and p.events == "read" and p.deadline > 0
        server = p.step()
        assert server.state == "OPEN" and client.send_ready()
        client.send({"a": 1})
        with server.recv(timeout=1) as m:
            assert m.header == {"a": 1}
        other = registry.connect(url, slot_size=4096, nslots=2, timeout=2)
        refused = lst.accept_pending()
        refused.sock.send(b"REFUSED")  # what a loop at its connection cap does, then close()
        refused.close()
        with pytest.raises(transport.ConnectionClosed):
            other.recv(timeout=1)
        for c in (client, server, other):
            c.close()
