"""transport/base.py's lifecycle and Message.release, without a backend."""
import pytest

from transport import base
from transport.base import Connection, Message
from transport.errors import ConnectionClosed, ProtocolError


class Fake(Connection):
    """The smallest Connection: records what its release hook saw."""

    url = "fake://x"

    def __init__(self, fail: bool = False):
        self.released = []
        self.fail = fail

    def _release_message(self, token):
        if self.fail:
            raise ProtocolError("peer corrupted its return ring")
        self.released.append(token)

    def alloc(self, nbytes, timeout=None): ...
    def send(self, header, buffers=(), timeout=None): ...
    def fileno(self): return -1
    def close(self): self._to_closed()
    def send_ready(self): return not self._state

    def recv(self, timeout=None):
        if self._state:
            raise self._closed_error()
        raise AssertionError("not reached")


def test_states_and_transitions():
    c = Fake()
    assert c.state == "OPEN" and not c.closed and c.send_ready()
    c._to_peer_gone("peer closed")
    assert c.state == "PEER_GONE" and not c.closed and not c.send_ready()
    c._to_peer_gone("again")  # only from OPEN: the first reason stays
    with pytest.raises(ConnectionClosed, match="peer closed"):
        c.recv()
    c._to_broken("protocol error: x")
    assert c.state == "BROKEN" and c.closed
    c.close()
    c.close()
    assert c.state == "CLOSED" and c.closed
    c._to_broken("late")  # nothing leaves CLOSED
    assert c.state == "CLOSED"
    with pytest.raises(ConnectionClosed, match="is closed"):
        c.recv()


def test_release_calls_the_hook_once():
    c = Fake()
    m = Message({"h": 1}, [memoryview(b"abc")], None, c, 7)
    with m:
        assert bytes(m.buffers[0]) == b"abc"
    m.release()
    assert c.released == [7] and m.released and m.buffers == []


def test_release_with_a_plain_callback():
    seen = []
    Message(None, [], lambda: seen.append(1)).release()
    assert seen == [1]


def test_a_protocol_error_on_release_is_raised_by_that_connection_not_by_release():
    c = Fake(fail=True)
    Message("x", [], None, c, 1).release()  # must not raise
    assert c.state == "BROKEN"
    with pytest.raises(ProtocolError, match="return ring"):
        c.recv()
    with pytest.raises(ConnectionClosed):  # raised once; then the connection is just closed
        c.recv()


def test_state_names_are_the_table():
    assert base.STATE_NAMES == ("OPEN", "PEER_GONE", "BROKEN", "CLOSED")
    assert (base.OPEN, base.PEER_GONE, base.BROKEN, base.CLOSED) == (0, 1, 2, 3)
