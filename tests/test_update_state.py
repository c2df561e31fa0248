"""The hot-update state machine (gateway/update.py), without I/O: the traffic split, every
transition, failures and lost workers, the automatic schedule on a fake clock."""
from __future__ import annotations

import pytest

from gateway.update import DEFAULT_STEPS, State, Update, UpdateError, check_steps


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def make(**kw):
    kw.setdefault("experts", (2, 5))
    kw.setdefault("old", {2: 0, 5: 3})
    kw.setdefault("new", 7)
    up = Update(**kw)
    up.waiting = {(0, 2), (1, 2), (1, 5)}
    return up


def loaded(up):
    for w, e in sorted(up.waiting):
        up.on_loaded(w, e)


def test_loading_pins_every_request_to_the_old_versions():
    up = make()
    assert up.state == State.LOADING and up.fraction == 0.0
    assert [up.decide() for _ in range(3)] == [{2: 0, 5: 3}] * 3
    up.on_loaded(0, 2)
    up.on_loaded(1, 2)
    assert up.state == State.LOADING  # (1, 5) still loading
    up.on_loaded(1, 5)
    assert up.state == State.SHIFTING and up.fraction == DEFAULT_STEPS[0]


@pytest.mark.parametrize("fraction", [0.01, 0.05, 0.25, 0.5, 1.0])
def test_split_is_exact_and_whole(fraction):
    """After n requests, exactly floor(n * f) got the new version, each one ALL of it."""
    up = make(steps=(fraction,))
    loaded(up)
    news = 0
    for n in range(1, 1001):
        pins = up.decide()
        assert set(pins.values()) in ({7}, {0, 3})  # never a mix
        news += pins[2] == 7
        assert news == int(n * fraction + 1e-9)
    assert (up.served["new"], up.served["old"]) == (news, 1000 - news)


def test_advance_through_the_steps_then_finish_then_done():
    up = make()
    loaded(up)
    seen = [up.fraction]
    for _ in range(len(DEFAULT_STEPS) + 2):  # advancing past the last step stays there
        up.advance()
        seen.append(up.fraction)
    assert seen[:len(DEFAULT_STEPS)] == list(DEFAULT_STEPS) and seen[-1] == 1.0
    up.advance(fraction=0.2)  # jump to the first step >= 0.2
    assert up.fraction == 0.25
    retires = up.finish({2: [0, 1], 5: [1]})
    assert retires == [(0, 2), (1, 2), (1, 5)]
    assert up.state == State.FINISHING and up.decide() == {2: 7, 5: 7}
    for w, e in retires:
        assert up.pinning
        up.on_retired(w, e)
    assert up.state == State.DONE and not up.pinning and up.decide() == {} and up.fraction == 1.0
    assert [t[1] for t in up.timeline] == ["start", "loaded"] + ["advance"] * 8 + ["finish", "done"]
    with pytest.raises(UpdateError):
        up.advance()


def test_rollback_while_loading_retires_late_loads_too():
    up = make()
    up.on_loaded(0, 2)
    assert up.rollback() == [(0, 2)]  # retire what is loaded now
    assert up.state == State.ROLLING_BACK and up.decide() == {2: 0, 5: 3}
    assert up.on_loaded(1, 2) is True  # landed after the rollback: retire it as well
    up.on_load_failed(1, 5, "disk")
    up.on_retired(0, 2)
    assert up.state == State.ROLLING_BACK
    up.on_retired(1, 2)
    assert up.state == State.ROLLED_BACK and up.decide() == {}


def test_rollback_while_shifting_and_not_after_finishing():
    up = make()
    loaded(up)
    up.advance()
    assert sorted(up.rollback()) == [(0, 2), (1, 2), (1, 5)]
    assert up.fraction == 0.0
    for w, e in [(0, 2), (1, 2), (1, 5)]:
        up.on_retired(w, e)
    assert up.state == State.ROLLED_BACK
    up2 = make()
    loaded(up2)
    up2.finish({2: [0, 1], 5: [1]})
    with pytest.raises(UpdateError, match="finishing"):
        up2.rollback()


def test_a_failed_load_rolls_back_and_ends_failed():
    up = make()
    up.on_loaded(0, 2)
    assert up.on_load_failed(1, 5, "no such file") == [(0, 2)]
    assert up.state == State.ROLLING_BACK and "no such file" in up.error
    up.on_loaded(1, 2)  # the last pending load lands: it is retired too
    up.on_retired(0, 2)
    up.on_retired(1, 2)
    assert up.state == State.FAILED and up.decide() == {}


def test_every_load_failing_ends_failed():
    up = make()
    assert up.on_load_failed(0, 2, "a") == []
    assert up.on_load_failed(1, 2, "b") == []
    assert up.state == State.ROLLING_BACK
    up.on_load_failed(1, 5, "c")
    assert up.state == State.FAILED and up.error.endswith("a")


def test_a_lost_worker_acknowledges_nothing_but_blocks_nothing():
    up = make()
    up.on_loaded(0, 2)
    up.on_worker_lost(1)
    assert up.state == State.SHIFTING
    up.finish({2: [0], 5: []})
    up.on_worker_lost(0)
    assert up.state == State.DONE


def test_automatic_schedule_on_a_fake_clock():
    clock = Clock()
    up = make(steps=(0.1, 0.5), auto_interval=2.0, clock=clock)
    assert up.due() is None
    loaded(up)
    clock.t += 1.9
    assert up.due() is None
    clock.t += 0.2
    assert up.due() == "advance"
    up.advance()
    clock.t += 2.0
    assert up.due() == "advance"  # 0.5 -> 1.0 (appended)
    up.advance()
    clock.t += 2.0
    assert up.due() == "finish"


@pytest.mark.parametrize("bad", [[], [0.5, 0.1], [0.0, 1.0], [1.5]])
def test_bad_steps(bad):
    with pytest.raises(UpdateError):
        check_steps(bad)


def test_steps_end_at_one_and_same_version_is_refused():
    assert check_steps([0.1, 0.3]) == (0.1, 0.3, 1.0)
    with pytest.raises(UpdateError, match="already active"):
        Update(experts=(1,), old={1: 4}, new=4)


def test_finishing_with_no_host_left_is_done_at_once():
    """Every host of the experts is away (lost, or reconnecting and not admitted yet): there is
    nothing to retire, so the update does not wait for some later event to end."""
    up = make()
    loaded(up)
    up.on_worker_lost(0)
    up.on_worker_lost(1)
    assert up.state == State.SHIFTING
    assert up.finish({2: [], 5: []}) == []
    assert up.state == State.DONE and not up.pinning
    assert [t[1] for t in up.timeline][-2:] == ["finish", "done"]
