"""Every protocol timeout, linger and polling interval of the transport, in one place.

All in seconds. A backend imports what it needs from here (and may re-export it under
its historical name), so that no wait in a code path is a bare number.
"""

#: a connection's default for every blocking call whose ``timeout`` is None (never forever)
DEFAULT_TIMEOUT = 30.0

# -- handshakes (transport/handshake.py, the listeners) -------------------------------------
#: how long a server waits for a client to complete phase 1: a silent client must not hold
#: a listener's resources for long
HELLO_TIMEOUT = 5.0
#: Listener.accept: a handshake that started when the caller's own deadline had run out
#: still gets this long (it is already under way; HELLO_TIMEOUT bounds it from above)
ACCEPT_GRACE = 1.0
#: rdma: verbs set-up (registration is slow under emulation) gets at least this long,
#: whatever was left of the caller's timeout: it is local work, not the peer's
RDMA_SETUP_TIMEOUT = 5.0

# -- tcp (transport/stream.py) ------------------------------------------------------------
#: a blocked send drains the peer this often (no mutual blocking of two full sockets)
TCP_SEND_SLICE = 0.05
#: close(): the longest wait for the kernel to hand our last bytes to the peer
TCP_LINGER = 2.0
#: close(): how often the linger loop looks again at the kernel's send queue
TCP_LINGER_POLL = 0.005

# -- serve loop (transport/service/loop.py) ------------------------------------------------
#: a spin window that opens sooner than this is spun from now: a shorter sleep costs a
#: wake-up (see docs/performance.md#reply-spin), and the message may come during it
SPIN_SLEEP_MIN = 0.5e-3

# -- shm (transport/shm.py) ---------------------------------------------------------------
#: busy-poll this long before sleeping on the doorbell: on 2 cores a longer spin steals a core
SHM_SPIN = 50e-6
#: an idle connection's spin shrinks to this
SHM_SPIN_MIN = 5e-6
#: the longest sleep between re-checks of the ring: the safety net under the fence
SHM_NAP = 0.005

# -- rdma (transport/rdma_conn.py, transport/rdma.py) -------------------------------------------
#: a wait busy-polls the CQ this long before it sleeps on the completion channel
RDMA_SPIN = 100e-6
#: close() waits at most this long for its sends to complete
RDMA_CLOSE_LINGER = 5.0
