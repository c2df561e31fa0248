"""gateway/served.py without sockets: what the gateway serves, and the steps that bring a
worker there (a simulated worker that keeps the protocol's rules: at most MAX_VERSIONS per
expert, never retiring its last one, a load of a held version a no-op)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from gateway.served import ServedSet, Weights, next_step
from gateway.update import State
from workers.protocol import MAX_VERSIONS

K = (0, 3)


def w(v, fp=None, src=None):
    return Weights(v, fp if fp is not None else f"fp{v}", src or {"seed": v})


def apply(held: dict, step) -> dict:
    """What a worker that obeys the rules does with a step (each load loads the weights it
    names: its fingerprint is the wanted one)."""
    held = {k: dict(v) for k, v in held.items()}
    for key, v in step.retires:
        h = held[key]
        assert v in h and len(h) > 1, f"a retire the worker refuses: {v} of {h}"
        del h[v]
    for key, want in step.loads:
        h = held.setdefault(key, {})
        assert want.version not in h, "a load of a held version changes nothing: it must not be planned"
        h[want.version] = (want.fingerprint, want.source)
        assert len(h) <= MAX_VERSIONS
    return held


def converge(held: dict, wanted: dict, limit: int = 10):
    for _ in range(limit):
        step = next_step(held, wanted, MAX_VERSIONS)
        if step.refuse is not None or step.done:
            return held, step
        held = apply(held, step)
    raise AssertionError("did not converge")


def test_a_worker_restarted_at_version_0_loads_the_served_version_then_retires_its_own():
    held = {K: {0: ("fp0", {"seed": 0})}}
    wanted = {K: {2: w(2, src={"seed": 7})}}
    step = next_step(held, wanted, MAX_VERSIONS)
    assert [(k, x.version, x.source) for k, x in step.loads] == [(K, 2, {"seed": 7})] and not step.retires
    held = apply(held, step)
    step = next_step(held, wanted, MAX_VERSIONS)
    assert step.retires == [(K, 0)] and not step.loads
    held = apply(held, step)
    assert next_step(held, wanted, MAX_VERSIONS).done and set(held[K]) == {2}


def test_a_served_version_number_held_with_other_weights_is_refused_not_served():
    held = {K: {0: ("other", {"seed": 9})}}
    step = next_step(held, {K: {0: w(0)}}, MAX_VERSIONS)
    assert step.refuse is not None and "other weights" in step.refuse and "expert 3" in step.refuse


def test_wrong_weights_are_replaced_when_another_version_is_wanted_too():
    # mid-update: both 0 and 5 wanted; the worker's 0 is not the served 0
    held, step = converge({K: {0: ("bad", {"seed": 1})}}, {K: {0: w(0), 5: w(5)}})
    assert step.done and held[K] == {0: ("fp0", {"seed": 0}), 5: ("fp5", {"seed": 5})}


def test_an_unknown_source_is_a_refusal():
    step = next_step({K: {0: ("fp0", None)}}, {K: {4: Weights(4, "fp4", None)}}, MAX_VERSIONS)
    assert step.refuse is not None and "does not know where" in step.refuse


def test_an_unknown_fingerprint_accepts_what_is_held():
    assert next_step({K: {1: ("x", {"seed": 1})}}, {K: {1: Weights(1, None, {"seed": 1})}}, MAX_VERSIONS).done


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.integers(0, 3), st.dictionaries(st.integers(0, 3), st.booleans(), min_size=1,
                                                          max_size=MAX_VERSIONS), min_size=1, max_size=3),
       st.dictionaries(st.integers(0, 3), st.sets(st.integers(0, 3), min_size=1, max_size=MAX_VERSIONS),
                       min_size=1, max_size=3))
def test_steps_reach_the_wanted_weights_or_refuse_and_never_break_the_rules(held_spec, wanted_spec):
    # held: expert -> {version: right weights?}; wanted: expert -> versions
    held = {(0, e): {v: (f"fp{v}" if ok else f"bad{v}", {"seed": v}) for v, ok in vs.items()}
            for e, vs in held_spec.items()}
    wanted = {(0, e): {v: w(v) for v in vs} for e, vs in wanted_spec.items()}
    final, step = converge(held, wanted)  # apply() asserts every step obeys the worker's rules
    if step.refuse is None:
        for key, want in wanted.items():
            assert {v: fp for v, (fp, _) in final[key].items()} == {v: x.fingerprint for v, x in want.items()}
    else:  # refused only where a wanted version is held with other weights and cannot be swapped
        assert "other weights" in step.refuse or "cannot make room" in step.refuse


def test_agreement_serves_disagreement_blocks_and_another_version_is_adopted_and_reported():
    s = ServedSet({0: 4})
    assert s.agree((0, 0), {"a": (0, "x", {"seed": 1}), "b": (0, "x", {"seed": 1})}) is None
    note = s.agree((0, 1), {"a": (0, "x", None), "b": (2, "y", {"seed": 7})})
    assert note is not None and "disagree" in note and s.why_blocked((0, 1)) == note
    note = s.agree((0, 2), {"a": (2, "y", {"seed": 7}), "b": (2, "y", {"seed": 7})})
    assert note is not None and "not the start-up version 0" in note
    s.serve({k: s.active[k] for k in ((0, 0), (0, 2))})
    assert s.versions(0) == [0, -1, 2, -1] and s.generation == 1
    assert s.status()["adopted"] == [[0, 2, 2]] and s.status()["blocked"][0][:2] == [0, 1]
    s.serve({(0, 1): w(2)})  # settled by hand
    assert s.versions(0)[1] == 2 and s.why_blocked((0, 1)) is None and s.generation == 2


@pytest.mark.parametrize("state,expect", [(State.SHIFTING, {0, 5}), (State.LOADING, {0, 5}),
                                          (State.FINISHING, None), (State.ROLLING_BACK, None),
                                          (State.DONE, {0})])
def test_wanted_follows_an_update(state, expect):
    s = ServedSet({0: 4})
    s.serve({K: w(0)})
    up = SimpleNamespace(layer=0, experts=(3,), new=5, state=state, fingerprints={}, source={"seed": 9})
    got = s.wanted([K, (0, 1)], up if state.active else None)
    if expect is None:
        assert got is None
    else:
        assert set(got[K]) == expect and (0, 1) not in got  # an expert not served is left out
