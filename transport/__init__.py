"""moe-transport's data plane: registered buffers over tcp://, shm:// and rdma://.

    from transport import listen, connect
    conn = connect("tcp://127.0.0.1:5555")
    slot = conn.alloc(4096); slot.buf[:] = ...; conn.send({"op": "x"}, [slot])
    with conn.recv(timeout=1.0) as msg: use(msg.buffers)
"""
from .base import Connection, ConnectionStats, Deadline, Listener, Message
from .errors import (AcceptFailed, AuthenticationError, ConnectionClosed, PoolExhausted, ProtocolError, Refused, Timeout,
                     TransportError)
from .pool import BufferPool, Slot
from .registry import available_backends, caller_moves_bytes, connect, listen, register_backend

__all__ = [
    "AcceptFailed", "AuthenticationError", "Refused", "BufferPool", "Connection", "ConnectionClosed", "ConnectionStats", "Deadline", "Listener",
    "Message", "PoolExhausted", "ProtocolError", "Slot", "Timeout", "TransportError",
    "available_backends", "caller_moves_bytes", "connect", "listen", "register_backend",
]
