"""Stable, bounded names for a service's connections, for its metrics.

A connection is labelled ``<role>-<slot>``: the gateway's worker links by the worker's
index, served connections (a gateway's clients, a worker's gateways) by the lowest slot
free when they opened. A reconnect therefore reuses its series instead of minting a new
one (a Python id or a peer's ephemeral port would), and the number of series is bounded
by the most connections ever open at once. When a connection closes its counts are folded
into its slot, so every exported counter only grows, across reconnects too.

Plain book-keeping, no prometheus_client: the services keep one whether or not metrics are
served (two dict operations per connection opened or closed).
"""
from __future__ import annotations

import heapq
from typing import Any, Iterator, Optional

#: the ConnectionStats counters the metrics export (transport/base.py)
COUNTED = ("bytes_sent", "bytes_received", "messages_sent", "messages_received", "copies", "credit_stalls")


def backend_of(conn: Any) -> str:
    url = getattr(conn, "url", "") or ""
    return url.split("://", 1)[0] if "://" in url else type(conn).__module__.rsplit(".", 1)[-1]


class ConnectionBook:
    """The connections of one ``role`` ("client", "gateway", "worker"), each in a slot."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._live: dict[Any, tuple[int, str]] = {}  # conn -> (slot, backend)
        self._base: dict[tuple[int, str], list] = {}  # (slot, backend) -> counts of closed connections
        self._free: list[int] = []  # released slots (a heap: the lowest is reused first)
        self._next = 0

    def opened(self, conn: Any, slot: Optional[int] = None) -> int:
        """Give ``conn`` a slot: ``slot`` when the owner has a stable index (a worker's),
        else the lowest free one."""
        if conn in self._live:
            return self._live[conn][0]
        if slot is None:
            if self._free:
                slot = heapq.heappop(self._free)
            else:
                slot, self._next = self._next, self._next + 1
        self._live[conn] = (slot, backend_of(conn))
        return slot

    def closed(self, conn: Any) -> None:
        """Fold ``conn``'s final counts into its slot and free the slot."""
        entry = self._live.pop(conn, None)
        if entry is None:
            return
        st = getattr(conn, "stats", None)
        if st is not None:
            base = self._base.setdefault(entry, [0] * len(COUNTED))
            for i, f in enumerate(COUNTED):
                base[i] += getattr(st, f, 0)
        slot = entry[0]
        if slot < self._next and slot not in self._free and all(s != slot for s, _ in self._live.values()):
            heapq.heappush(self._free, slot)

    def name(self, slot: int) -> str:
        return f"{self.role}-{slot}"

    def samples(self) -> Iterator[tuple[str, str, list]]:
        """(connection name, backend, counts in COUNTED order) per slot ever used: closed
        connections' totals plus the open one's current counts."""
        out: dict[tuple[int, str], list] = {k: list(v) for k, v in list(self._base.items())}
        for conn, key in list(self._live.items()):
            st = getattr(conn, "stats", None)
            if st is None:
                continue
            acc = out.setdefault(key, [0] * len(COUNTED))
            for i, f in enumerate(COUNTED):
                acc[i] += getattr(st, f, 0)
        for (slot, backend), counts in sorted(out.items()):
            yield self.name(slot), backend, counts

    def __len__(self) -> int:
        return len(self._live)
