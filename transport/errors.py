"""The transport's exception hierarchy: every failure a caller can act on has one name."""
from typing import Optional


class TransportError(Exception):
    """Base class of every error raised by moe-transport."""


class ConnectionClosed(TransportError):
    """The peer closed, died, or the connection was torn down after an error."""


class Timeout(TransportError, TimeoutError):
    """A blocking call reached its deadline. The connection is still usable."""


class ProtocolError(TransportError):
    """The peer sent bytes that break the protocol (bad magic, oversized length...).

    The connection that produced it is closed; listeners keep serving others.
    """


class PoolExhausted(TransportError):
    """No free slot in a buffer pool (non-blocking allocation)."""


class Refused(ConnectionClosed):
    """The handshake was refused (by the peer, or by this side): a limit, a version, a
    backend mismatch. The message says why; nothing was set up. ``peer``: the URL refused,
    where a caller that knows it filled it in."""

    peer: Optional[str] = None


class AuthenticationError(Refused):
    """The peer could not prove the shared secret, or one side has a secret and the other
    none (authentication is mutual: see transport/handshake.py). ``why``, from this side's
    point of view: MISMATCH (both have one, they differ), PEER_HAS_NONE (only this side
    has one), THIS_HAS_NONE (only the peer has one), or None (not known)."""

    MISMATCH, PEER_HAS_NONE, THIS_HAS_NONE = "mismatch", "peer_has_none", "this_has_none"

    def __init__(self, message: str = "", why: Optional[str] = None):
        super().__init__(message)
        self.why = why


class AcceptFailed(ConnectionClosed):
    """A listener could not take a connection (``errno`` says why: EMFILE when the process
    is out of file descriptors). The listener itself may still work: back off and retry."""

    def __init__(self, message: str, errno: Optional[int] = None):
        super().__init__(message)
        self.errno = errno
