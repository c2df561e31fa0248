"""The transport's exception hierarchy: every failure a caller can act on has one name."""


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
