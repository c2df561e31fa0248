"""The reply clock (gateway/reply_clock.py), without I/O: when each worker's last outstanding
message is due back, whether the loop may spend a processor on it, and how its windows
turned out."""
from __future__ import annotations

import pytest

from gateway.chunking import ChunkCosts
from gateway.reply_clock import LEAD_MAX, LEAD_MIN, LEAD_SHARE, ReplyClock


def _costs(per_row: float, serve: float = 1e-4) -> ChunkCosts:
    c = ChunkCosts()
    c.record_serve(serve)
    c.record_compute(100, 100 * per_row)
    return c


def test_the_window_is_centred_on_the_measured_compute_after_the_send():
    clock, costs = ReplyClock(cpus=2), _costs(1e-4)
    clock.sent(0, "a", 100, now=10.0)
    opens, closes = clock.window(10.0, lambda w: costs)
    due = 10.0 + 1e-4 + 100 * 1e-4
    lead = min(LEAD_MAX, LEAD_MIN + LEAD_SHARE * 100 * 1e-4)
    assert (opens, closes) == pytest.approx((due - lead, due + lead))
    assert clock.windows == 1


def test_no_measurement_no_window():
    clock = ReplyClock(cpus=2)
    clock.sent(0, "a", 100, now=1.0)
    assert clock.window(1.0, lambda w: None) is None
    assert clock.window(1.0, lambda w: ChunkCosts()) is None  # nothing computed yet
    assert clock.windows == 0


def test_only_a_workers_last_message_gets_one_and_it_starts_at_the_reply_before_it():
    clock, costs = ReplyClock(cpus=2), _costs(1e-4, serve=0.0)
    clock.sent(0, "a", 100, now=1.0)
    clock.sent(0, "b", 200, now=1.001)
    assert clock.window(1.002, lambda w: costs) is None  # two out: the worker is not waited for
    clock.replied(0, "a", now=1.05)  # it started on b when it answered a
    opens, closes = clock.window(1.05, lambda w: costs)
    assert (opens + closes) / 2 == pytest.approx(1.05 + 200 * 1e-4)


def test_no_window_while_every_processor_has_a_busy_worker():
    clock, costs = ReplyClock(cpus=2), _costs(1e-4)
    clock.sent(0, "a", 100, now=1.0)
    clock.sent(1, "b", 300, now=1.0)
    assert clock.window(1.0, lambda w: costs) is None  # two workers on two processors
    clock.replied(1, "b", now=1.005)  # early, but worker 1 is idle now
    assert clock.window(1.005, lambda w: costs) is not None  # one left: a processor is free
    one = ReplyClock(cpus=1)
    one.sent(0, "a", 100, now=1.0)
    assert one.window(1.0, lambda w: costs) is None


def test_the_earliest_window_still_open_is_given_and_a_closed_one_is_not():
    clock = ReplyClock(cpus=4)
    fast, slow = _costs(1e-5), _costs(1e-3)
    clock.sent(0, "a", 100, now=0.0)
    clock.sent(1, "b", 100, now=0.0)
    costs = {0: fast, 1: slow}.get
    first = clock.window(0.0, costs)
    assert first[0] < 0.002  # worker 0's (about 1 ms)
    second = clock.window(first[1] + 1e-6, costs)  # worker 0's closed, unanswered: worker 1's
    assert second[0] > first[1]
    assert clock.window(second[1] + 1e-6, costs) is None


def test_outcomes_are_counted_when_the_last_reply_lands_or_never_does():
    costs = _costs(1e-4, serve=0.0)
    outcomes = {}
    for name, at in (("hits", 0.01), ("early", 0.001), ("late", 0.1)):
        clock = ReplyClock(cpus=2)
        clock.sent(0, 1, 100, now=0.0)
        assert clock.window(0.0, lambda w: costs) is not None
        clock.replied(0, 1, now=at)
        outcomes[name] = (clock.hits, clock.early, clock.late)
    assert outcomes == {"hits": (1, 0, 0), "early": (0, 1, 0), "late": (0, 0, 1)}
    clock = ReplyClock(cpus=2)
    clock.sent(0, 1, 100, now=0.0)
    clock.window(0.0, lambda w: costs)
    clock.forget(0, [1])  # the part failed: never answered
    assert (clock.hits, clock.early, clock.late) == (0, 0, 1)
    clock.replied(0, 1, now=0.01)  # a late reply to a forgotten message changes nothing
    assert (clock.hits, clock.early, clock.late) == (0, 0, 1)


def test_a_message_sent_behind_the_last_one_takes_its_window_away():
    clock, costs = ReplyClock(cpus=2), _costs(1e-4)
    clock.sent(0, "a", 100, now=0.0)
    assert clock.window(0.0, lambda w: costs) is not None
    clock.sent(0, "b", 100, now=0.001)  # the next round's part, queued behind it
    assert clock.window(0.001, lambda w: costs) is None
    assert clock.windows == 0
    clock.replied(0, "a", now=0.01)
    assert clock.window(0.01, lambda w: costs) is not None  # b's, from a's reply
    clock.replied(0, "b", now=0.0201)
    assert (clock.windows, clock.hits) == (1, 1)


def test_disabled_gives_none_and_clear_forgets_everything():
    clock, costs = ReplyClock(cpus=2, enabled=False), _costs(1e-4)
    clock.sent(0, "a", 100, now=0.0)
    assert clock.window(0.0, lambda w: costs) is None
    clock.enabled = True
    assert clock.window(0.0, lambda w: costs) is not None
    clock.clear()
    assert clock.busy() == 0 and clock.window(0.0, lambda w: costs) is None
    assert clock.snapshot() == {"enabled": True, "cpus": 2, "windows": 1, "hits": 0, "early": 0, "late": 1}
