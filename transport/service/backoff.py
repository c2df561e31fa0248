"""Pacing what repeats: exponential back-off with jitter, the one pause every retry loop of
the services takes (a gateway reconnecting to a worker, respawning a local one, asking a Ray
actor again, a listener out of file descriptors); and a rate limit for repeated log lines.

The pause doubles from ``first`` up to ``longest``; each pause is drawn in
``[(1 - jitter) x base, base]`` ("equal jitter" for jitter 0.5), so many retriers that
failed together -- the gateways of one worker that died -- do not come back in lockstep,
and no pause exceeds ``longest``.
"""
from __future__ import annotations

import random
from typing import Optional


class Backoff:
    """One retried thing's back-off: :meth:`next` gives the next pause (seconds),
    :meth:`reset` starts over after a success."""

    def __init__(self, first: float, longest: float, *, factor: float = 2.0, jitter: float = 0.5,
                 rng: Optional[random.Random] = None) -> None:
        if not 0 < first <= longest or factor < 1 or not 0 <= jitter < 1:
            raise ValueError(f"back-off needs 0 < first <= longest, factor >= 1, 0 <= jitter < 1; got "
                             f"{first}, {longest}, {factor}, {jitter}")
        self.first, self.longest, self.factor, self.jitter = first, longest, factor, jitter
        self.base = 0.0  # the un-jittered pause of the last next() (0: none since the reset)
        self._rng = rng or random.Random()

    def next(self) -> float:
        self.base = min(self.longest, max(self.first, self.base * self.factor))
        return self.base * (1.0 - self.jitter * self._rng.random())

    def reset(self) -> None:
        self.base = 0.0

    def restart(self) -> float:
        """reset() and the first pause."""
        self.reset()
        return self.next()

    def __repr__(self) -> str:
        return f"Backoff({self.first:g}..{self.longest:g} s, now {self.base:g})"


class RateLimit:
    """At most ``burst`` events let through per ``interval`` seconds; :meth:`take` says
    whether this one is, and how many were held back since the last one let through."""

    def __init__(self, burst: int, interval: float) -> None:
        self.burst, self.interval = burst, interval
        self._window, self._used, self._skipped = float("-inf"), 0, 0

    def take(self, now: float) -> tuple[bool, int]:
        if now - self._window >= self.interval:
            self._window, self._used = now, 0
        if self._used < self.burst:
            self._used += 1
            skipped, self._skipped = self._skipped, 0
            return True, skipped
        self._skipped += 1
        return False, 0
