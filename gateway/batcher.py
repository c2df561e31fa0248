"""Dynamic batching policy (no I/O): when the queued requests go out as a round.

Work-conserving: with no round out the workers are idle, so whatever is queued goes at
once; while rounds are out, requests gather for the next round, which goes when the queue
holds ``max_batch_tokens``, when its oldest request has waited ``max_wait`` seconds (0: at
once), or when ``max_batch_requests`` are queued; at most ``max_inflight_rounds`` rounds are
out at a time (the next one fills while workers compute).
"""
from __future__ import annotations

import collections
from typing import Any, Callable, Optional


class Batcher:
    def __init__(self, *, max_batch_tokens: int, max_wait: float, max_inflight_rounds: int,
                 max_batch_requests: int) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.max_wait = max(0.0, max_wait)
        self.max_inflight_rounds = max(1, max_inflight_rounds)
        self.max_batch_requests = max(1, max_batch_requests)
        self.queue: collections.deque = collections.deque()  # (item, tokens, arrived)
        self.tokens = 0

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, item: Any, tokens: int, arrived: float) -> None:
        self.queue.append((item, tokens, arrived))
        self.tokens += tokens

    def due(self, now: float, in_flight: int, flush: bool = False) -> bool:
        if not self.queue or in_flight >= self.max_inflight_rounds:
            return False
        return (flush or self.max_wait == 0 or in_flight == 0 or self.tokens >= self.max_batch_tokens
                or len(self.queue) >= self.max_batch_requests or now >= self.queue[0][2] + self.max_wait)

    def take(self) -> list:
        """The next round's items (at least one: a request is never larger than a round)."""
        batch, tokens = [], 0
        q = self.queue
        while q and len(batch) < self.max_batch_requests and (not batch or tokens + q[0][1] <= self.max_batch_tokens):
            item, n, _ = q.popleft()
            batch.append(item)
            tokens += n
        self.tokens -= tokens
        return batch

    def next_due(self, in_flight: int) -> Optional[float]:
        """When the oldest request's wait ends (if a round could go then)."""
        if not self.queue or in_flight >= self.max_inflight_rounds:
            return None
        return self.queue[0][2] + self.max_wait

    def remove(self, keep: Callable[[Any], bool]) -> list:
        """Drop the items ``keep`` says no to (a client gone); returns them."""
        kept, dropped = collections.deque(), []
        for entry in self.queue:
            (kept if keep(entry[0]) else dropped).append(entry)
        self.queue = kept
        self.tokens = sum(e[1] for e in kept)
        return [e[0] for e in dropped]
