"""The conformance kit: one set of behavioural checks that every backend must pass.

In the style of trio's ``trio/testing/_check_streams.py``: the kit knows nothing about a
backend except how to make endpoints of it. A backend's test file hands it a URL factory
and some capability flags, and runs every check in :data:`CHECKS`::

    import pytest
    from transport.testing import conformance

    @pytest.fixture
    def env():
        with conformance.PairEnv(lambda: "tcp://127.0.0.1:0", name="tcp") as env:
            yield env

    @pytest.mark.parametrize("check", conformance.CHECKS, ids=conformance.check_ids())
    def test_conformance(env, check):
        check(env)

or, without pytest, ``conformance.run_check(check, url_factory, **conn_options)``.

The public API (stable; add to it, do not change it):

``CHECKS``
    list of check functions, each ``def check_xxx(env: PairEnv) -> None``; a check
    raises ``AssertionError`` (or the transport's own exception) when the backend fails,
    and returns :data:`NOT_APPLICABLE` (without running) when the env lacks a capability
    it requires (``check.requires``; :func:`requirements` lists them all).
``check_ids()``
    the checks' short names (``"order"`` for ``check_order``), for pytest ids.
``PairEnv(url_factory, *, name=..., options=..., shares_sender_memory=..., leak_dirs=...,
slack=..., peer_python=..., peer_env=..., capabilities=...)``
    what a check may use; a context manager that cleans up everything it made.
    ``capabilities`` states what the backend cannot do (``{"cross_process": False}`` for
    the in-process test double): see :data:`CAPABILITIES`.
``run_check(check, url_factory, *, <PairEnv keywords>, **conn_options)``
    run one check in a fresh ``PairEnv``; returns what the check returned.

What a backend must provide for the kit (the contract in transport/base.py, plus):

- ``listen(url, slot_size=, nslots=, timeout=)`` and ``connect(url, ...same...)``
  accept those three keywords; ``listener.url`` is a URL a client can connect to;
- a raw-frame sender registered in :mod:`transport.testing.raw` (puts a framing.py frame
  on the wire/ring as if it were a frame, with no checks), for the malformed-frame check;
- ``conn.in_registered_memory(buf)``, ``conn.stats`` (ConnectionStats), ``conn.pending()``,
  ``conn.fileno()`` that polls readable when ``recv`` can make progress, ``conn.state``;
- a connection is used by one thread at a time (two connections, two threads is fine);
- ``send`` either delivers the message (it returned) or not at all (it raised Timeout or
  ValueError/TypeError, and the connection is still usable); if it raised ConnectionClosed
  the messages whose send returned before are still delivered, then ConnectionClosed.
  The slots passed to a ``send`` belong to the transport even when ``send`` raises.

Modules: :mod:`.env` (PairEnv, peer processes, capabilities), :mod:`.helpers`
(payloads, send/receive/verify), and the checks by theme: :mod:`.data`,
:mod:`.credits`, :mod:`.lifecycle`, :mod:`.limits`, :mod:`.poller`, :mod:`.memory`.

Timing: every bound is ``expected + env.slack`` (0.5 s by default; raise it for a VM).
No check waits forever: every blocking call has a timeout and every helper thread is
joined with one.
"""
from __future__ import annotations

from typing import Callable

from .credits import (check_alloc_when_all_slots_held, check_credits, check_default_timeout,
                      check_nonblocking_send, check_recv_timeout, check_send_ready,
                      check_send_timeout_consistent)
from .data import (HEADERS, check_full_duplex, check_header_roundtrip, check_held_buffers_stay_intact,
                   check_many_in_flight, check_multi_buffer, check_order, check_random_traffic, check_roundtrip,
                   check_sizes, check_stats)
from .env import (CAPABILITIES, DEFAULT_OPTIONS, NOT_APPLICABLE, PairEnv, PeerProcess, Worker, requires,
                  run_check)
from .helpers import (expect_closed, expect_nothing, filled_slot, pattern, raises, recv_seq, roundtrip,
                      send_seq, timed, transfer, verify)
from .lifecycle import (check_accept_and_connect_errors, check_close_delivers, check_close_while_blocked,
                        check_cross_process, check_cross_process_stream, check_held_messages_across_close,
                        check_listener_close_keeps_connections, check_no_fd_leak, check_peer_close,
                        check_peer_killed, check_peer_killed_while_we_wait_for_credits)
from .limits import check_header_limits, check_malformed_frames, check_over_limit
from .memory import check_zero_copy
from .poller import check_many_clients, check_poller

__all__ = ["CAPABILITIES", "CHECKS", "NOT_APPLICABLE", "PairEnv", "check_ids", "requirements", "run_check",
           "pattern", "verify"]

CHECKS: list[Callable[[PairEnv], None]] = [
    check_roundtrip,
    check_order,
    check_header_roundtrip,
    check_multi_buffer,
    check_sizes,
    check_over_limit,
    check_header_limits,
    check_many_in_flight,
    check_full_duplex,
    check_credits,
    check_send_ready,
    check_send_timeout_consistent,
    check_recv_timeout,
    check_peer_close,
    check_close_delivers,
    check_close_while_blocked,
    check_peer_killed,
    check_peer_killed_while_we_wait_for_credits,
    check_cross_process,
    check_cross_process_stream,
    check_malformed_frames,
    check_zero_copy,
    check_poller,
    check_many_clients,
    check_stats,
    check_default_timeout,
    check_accept_and_connect_errors,
    check_listener_close_keeps_connections,
    check_alloc_when_all_slots_held,
    check_held_messages_across_close,
    check_no_fd_leak,
    check_held_buffers_stay_intact,
    check_random_traffic,
    check_nonblocking_send,
]

for _check in CHECKS:  # every check states what it requires (most: nothing)
    if not hasattr(_check, "requires"):
        _check.requires = frozenset()


def check_ids() -> list[str]:
    return [c.__name__.removeprefix("check_") for c in CHECKS]


def requirements() -> dict[str, frozenset]:
    """The capabilities each check needs, by check id (empty: every backend runs it)."""
    return {c.__name__.removeprefix("check_"): c.requires for c in CHECKS}
