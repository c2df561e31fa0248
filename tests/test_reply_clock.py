"""The reply clock (gateway/reply_clock.py), without I/O: when each worker's last outstanding
message is due back, whether the loop may spend a processor on it, and how its windows
turned out."""
from __future__ import annotations

import pytest

from gateway.chunking import ChunkCosts
from gateway.reply_clock import COMPUTE_MAX, LEAD_MAX, LEAD_MIN, LEAD_SHARE, ReplyClock


def _costs(per_row: float, serve: float = 1e-4) -> ChunkCosts:
    c = ChunkCosts()
    c.record_serve(serve)
    c.record_compute(100, 100 * per_row)
    return c


def test_the_window_is_centred_on_the_measured_compute_after_the_send():
    clock, costs = ReplyClock(cpus=2), _costs(5e-6)
    clock.sent(0, "a", 100, now=10.0)
    opens, closes = clock.window(10.0, lambda w: costs)
    due = 10.0 + 1e-4 + 100 * 5e-6
    lead = min(LEAD_MAX, LEAD_MIN + LEAD_SHARE * 100 * 5e-6)
    assert (opens, closes) == pytest.approx((due - lead, due + lead))
    assert clock.windows == 1


def test_a_message_that_computes_long_gets_no_window():
    """Where a wake-up is a small share of the wait, spinning gained nothing measurable."""
    clock, costs = ReplyClock(cpus=2), _costs(5e-6)
    rows = int(COMPUTE_MAX / 5e-6) + 10
    clock.sent(0, "a", rows, now=0.0)
    assert clock.window(0.0, lambda w: costs) is None and clock.windows == 0


def test_no_measurement_no_window():
    clock = ReplyClock(cpus=2)
    clock.sent(0, "a", 100, now=1.0)
    assert clock.window(1.0, lambda w: None) is None
    assert clock.window(1.0, lambda w: ChunkCosts()) is None  # nothing computed yet
    assert clock.windows == 0


def test_only_a_workers_last_message_gets_one_and_it_starts_at_the_reply_before_it():
    clock, costs = ReplyClock(cpus=2), _costs(2e-6, serve=0.0)
    clock.sent(0, "a", 100, now=1.0)
    clock.sent(0, "b", 200, now=1.001)
    assert clock.window(1.002, lambda w: costs) is None  # two out: the worker is not waited for
    clock.replied(0, "a", now=1.05)  # it started on b when it answered a
    opens, closes = clock.window(1.05, lambda w: costs)
    assert (opens + closes) / 2 == pytest.approx(1.05 + 200 * 2e-6)


def test_no_window_unless_the_gateway_has_a_processor_no_local_worker_needs():
    costs = _costs(5e-6)
    for cpus, local, given in ((2, 0, True), (2, 1, True), (2, 2, False), (1, 0, True), (1, 1, False), (8, 7, True)):
        clock = ReplyClock(cpus=cpus, local_workers=local)
        clock.sent(0, "a", 100, now=1.0)
        assert (clock.window(1.0, lambda w: costs) is not None) == given, (cpus, local)


def test_the_earliest_window_still_open_is_given_and_a_closed_one_is_not():
    clock = ReplyClock(cpus=4)
    fast, slow = _costs(1e-7), _costs(9e-6, serve=2e-3)
    clock.sent(0, "a", 100, now=0.0)
    clock.sent(1, "b", 100, now=0.0)
    costs = {0: fast, 1: slow}.get
    first = clock.window(0.0, costs)
    assert first[1] < 0.001  # worker 0's (0.11 ms)
    second = clock.window(first[1] + 1e-6, costs)  # worker 0's closed, unanswered: worker 1's
    assert second[0] > first[1]
    assert clock.window(second[1] + 1e-6, costs) is None


def test_outcomes_are_counted_when_the_last_reply_lands_or_never_does():
    costs = _costs(5e-6, serve=0.0)  # due at 0.5 ms, +-0.425
    outcomes = {}
    for name, at in (("hits", 0.0006), ("early", 0.00005), ("late", 0.002)):
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
    clock.replied(0, 1, now=0.0005)  # a late reply to a forgotten message changes nothing
    assert (clock.hits, clock.early, clock.late) == (0, 0, 1)


def test_a_message_sent_behind_the_last_one_takes_its_window_away():
    clock, costs = ReplyClock(cpus=2), _costs(5e-6, serve=0.0)
    clock.sent(0, "a", 100, now=0.0)
    assert clock.window(0.0, lambda w: costs) is not None
    clock.sent(0, "b", 100, now=0.0001)  # the next round's part, queued behind it
    assert clock.window(0.0001, lambda w: costs) is None
    assert clock.windows == 0
    clock.replied(0, "a", now=0.0005)
    assert clock.window(0.0005, lambda w: costs) is not None  # b's, from a's reply
    clock.replied(0, "b", now=0.00101)
    assert (clock.windows, clock.hits) == (1, 1)


def test_disabled_gives_none_and_clear_forgets_everything():
    clock, costs = ReplyClock(cpus=2, enabled=False), _costs(5e-6)
    clock.sent(0, "a", 100, now=0.0)
    assert clock.window(0.0, lambda w: costs) is None
    clock.enabled = True
    assert clock.window(0.0, lambda w: costs) is not None
    clock.clear()
    assert clock.window(0.0, lambda w: costs) is None
    assert clock.snapshot() == {"enabled": True, "cpus": 2, "local_workers": 0, "windows": 1, "hits": 0, "early": 0,
                                "late": 1}


def test_windows_move_to_where_the_replies_have_been_landing():
    """A transport whose replies land 1 ms after the costs say (tcp's copy back, which they
    leave out): once a few did, the window is centred there and catches them."""
    clock, costs = ReplyClock(cpus=2), _costs(5e-6, serve=0.0)
    outcomes, t = [], 0.0
    for i in range(6):
        clock.sent(0, i, 100, now=t)
        opens, closes = clock.window(t, lambda w: costs)
        clock.replied(0, i, now=t + 100 * 5e-6 + 1e-3)
        outcomes.append(clock.late)
        t += 1.0
    assert outcomes[0] == 1  # the first window closed before it came
    assert (opens + closes) / 2 - (t - 1.0) == pytest.approx(100 * 5e-6 + 1e-3)
    assert clock.late == 1 and clock.hits == 5


def test_each_last_message_is_predicted_once_however_often_the_loop_asks():
    clock, costs, asked = ReplyClock(cpus=2), _costs(5e-6), []

    def costs_of(w):
        asked.append(w)
        return costs
    clock.sent(0, "a", 100, now=0.0)
    clock.sent(1, "b", 10_000, now=0.0)  # computes too long: predicted once, no window
    first = [clock.window(0.0001 * i, costs_of) for i in range(50)]
    assert asked == [0, 1] and first[0] is not None and len(set(first[:5])) == 1
    clock.replied(0, "a", now=0.0005)
    clock.sent(0, "c", 100, now=0.0006)
    for i in range(50):
        clock.window(0.0006, costs_of)
    assert asked == [0, 1, 0]
