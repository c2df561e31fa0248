"""Dynamic batching policy (no I/O): when the queued requests go out as a round.

Work-conserving: with no round out the workers are idle, so whatever is queued goes at
once; while rounds are out, requests gather for the next round, which goes when the queue
holds ``max_batch_tokens``, when its oldest request has waited ``max_wait`` seconds (0: at
once), or when ``max_batch_requests`` are queued; at most ``max_inflight_rounds`` rounds are
out at a time (the next one fills while workers compute).

Which requests a round takes is the policy (``--batching``):

- ``fifo`` (the default): the oldest first, up to the round's budget.
- ``expert-aware``: rounds formed to share experts, so a round touches fewer experts (and
  so fewer workers: fewer messages, and rounds on disjoint workers overlap). The oldest
  request and every request that has waited ``max_wait`` or longer go first, in arrival
  order (so nothing starves: a request is passed over for at most ``max_wait``); the rest
  of the budget goes to queued requests that add no expert the round does not have yet,
  then to those sharing at least one, fewest new experts first. Requests sharing none wait
  for a later round. The policy needs each request's experts at arrival, so the server
  routes a request as it lands instead of at dispatch (same cost, moved out of the round).
"""
from __future__ import annotations

import collections
import time
from typing import Any, Callable, Optional


POLICIES = ("fifo", "expert-aware")


class Batcher:
    def __init__(self, *, max_batch_tokens: int, max_wait: float, max_inflight_rounds: int,
                 max_batch_requests: int, policy: str = "fifo") -> None:
        if policy not in POLICIES:
            raise ValueError(f"batching policy must be one of {POLICIES}, got {policy!r}")
        self.max_batch_tokens = max_batch_tokens
        self.max_wait = max(0.0, max_wait)
        self.max_inflight_rounds = max(1, max_inflight_rounds)
        self.max_batch_requests = max(1, max_batch_requests)
        self.policy = policy
        self.queue: collections.deque = collections.deque()  # (item, tokens, arrived, experts or None)
        self.tokens = 0

    @property
    def needs_experts(self) -> bool:
        """Whether :meth:`add` should be given each request's experts."""
        return self.policy == "expert-aware"

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, item: Any, tokens: int, arrived: float, experts: Optional[frozenset] = None) -> None:
        self.queue.append((item, tokens, arrived, experts))
        self.tokens += tokens

    def due(self, now: float, in_flight: int, flush: bool = False) -> bool:
        if not self.queue or in_flight >= self.max_inflight_rounds:
            return False
        return (flush or self.max_wait == 0 or in_flight == 0 or self.tokens >= self.max_batch_tokens
                or len(self.queue) >= self.max_batch_requests or now >= self.queue[0][2] + self.max_wait)

    def take(self, now: Optional[float] = None) -> list:
        """The next round's items (at least one: a request is never larger than a round)."""
        if self.policy == "expert-aware" and len(self.queue) > 1:
            return self._take_sharing(time.monotonic() if now is None else now)
        batch, tokens = [], 0
        q = self.queue
        while q and len(batch) < self.max_batch_requests and (not batch or tokens + q[0][1] <= self.max_batch_tokens):
            item, n, _, _ = q.popleft()
            batch.append(item)
            tokens += n
        self.tokens -= tokens
        return batch

    def _take_sharing(self, now: float) -> list:
        """expert-aware: the head and the overdue first, then the requests that share the
        round's experts (one pass: the candidates are ranked once against the experts the
        must-go requests bring)."""
        q = list(self.queue)
        chosen: list[int] = []
        tokens = 0
        union: set = set()
        limit_n, limit_t = self.max_batch_requests, self.max_batch_tokens
        for i, (_, n, arrived, ex) in enumerate(q):
            if i and now - arrived < self.max_wait:
                continue
            if len(chosen) >= limit_n or (chosen and tokens + n > limit_t):
                break
            chosen.append(i)
            tokens += n
            union |= ex or ()
        taken = set(chosen)
        ranked = []
        for i, (_, n, _, ex) in enumerate(q):
            if i in taken:
                continue
            ex = ex or frozenset()
            new = len(ex - union)
            if ex and new == len(ex):
                continue  # shares no expert: a later round
            ranked.append((new, i))
        ranked.sort()
        for new, i in ranked:
            if len(chosen) >= limit_n:
                break
            n = q[i][1]
            if tokens + n > limit_t:
                continue
            chosen.append(i)
            tokens += n
            union |= q[i][3] or ()
        keep = set(chosen)
        self.queue = collections.deque(e for i, e in enumerate(q) if i not in keep)
        self.tokens -= tokens
        return [q[i][0] for i in sorted(chosen)]

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
