"""The load tool's pure parts: routing scenarios, the steered token bank, the trace
replay, the communication-volume model and the LRU expert-cache simulation."""
from __future__ import annotations

import numpy as np
import pytest

from bench import models as M
from bench.scenarios import Scenario, TokenBank
from gateway.router import Router


def test_popularity_of_each_scenario():
    u = Scenario("uniform", 8).popularity()
    assert np.allclose(u, 1 / 8)
    z = Scenario("zipf", 8, zipf_s=1.0).popularity()
    assert z.sum() == pytest.approx(1) and np.all(np.diff(z) < 0) and z[0] / z[1] == pytest.approx(2)
    h = Scenario("hot", 8, hot_expert=5, hot_share=0.6).popularity()
    assert h[5] == pytest.approx(0.6) and np.allclose(np.delete(h, 5), 0.4 / 7)
    d = Scenario("drift", 8, zipf_s=1.0, drift_period=2.0)
    assert np.argmax(d.popularity(0.0)) == 0 and np.argmax(d.popularity(2.5)) == 1
    assert np.argmax(d.popularity(2.0 * 8 + 0.1)) == 0  # a full turn
    assert np.allclose(np.sort(d.popularity(7.0)), np.sort(z))
    for bad in (dict(kind="nope"), dict(kind="hot", hot_expert=8), dict(kind="hot", hot_share=0.0),
                dict(kind="drift", drift_period=0)):
        with pytest.raises(ValueError):
            Scenario(n_experts=8, **bad)


def test_bank_tokens_route_first_to_their_expert_and_draws_follow_the_scenario():
    router = Router(32, 8, 2, seed=4)
    bank = TokenBank(router, per_expert=64, seed=1)
    assert bank.tokens.shape == (8 * 64, 32)
    first = np.argmax(router.logits(bank.tokens), axis=1)
    assert np.array_equal(first, np.repeat(np.arange(8), 64))  # every token, by construction
    rng = np.random.default_rng(0)
    pop = Scenario("hot", 8, hot_expert=3, hot_share=0.7).popularity()
    idx = bank.draw(20_000, pop, rng)
    r = router.route(bank.rows(idx))
    share = np.bincount(r.topk_idx[:, 0], minlength=8) / len(idx)
    assert share[3] == pytest.approx(0.7, abs=0.02)  # the real router's first choices follow it


def _trace():
    # 3 passes over 4 experts: rows per expert
    return [M.Step(0.2, np.array([2, 0, 1, 0]), 3), M.Step(1.5, np.array([0, 1, 1, 0]), 1, dropped=1, overflow=2),
            M.Step(1.7, np.array([1, 0, 0, 3]), 2)]


def test_comm_volume_counts_dispatch_and_combine_per_expert_and_worker():
    cv = M.comm_volume(_trace(), row_bytes=16, placement=[[0, 1], [2, 3], [3]], wall_s=2.0)
    assert cv["assignments"] == 9 and cv["tokens"] == 6
    assert cv["dispatch_bytes"] == cv["combine_bytes"] == 9 * 16 and cv["total_bytes"] == 288
    assert cv["per_expert_bytes"] == [3 * 32, 1 * 32, 2 * 32, 3 * 32]
    # expert 3 has two hosts: its rows are split between them
    assert cv["per_worker_bytes"] == [4 * 32, 2 * 32 + 1.5 * 32, 1.5 * 32]
    assert cv["gbps"] == pytest.approx(288 / 2.0 / 1e9)
    assert M.comm_volume([], 16)["total_bytes"] == 0


def test_lru_hit_rates_on_a_known_sequence():
    # uses: {0,2}, {1,2}, {0,3}
    rates = M.lru_hit_rates(_trace(), 4)
    # c=1: 0 2 | 1 2 | 0 3 -> no repeat right after itself: 0 hits
    # c=2: [0,2] -> 1 miss, 2 hit -> [2,1]; 0 miss, 3 miss: 1 hit of 6
    # c=3: 0 2 | 1 2(hit) | 0(hit) 3: 2 hits; c=4: same (4 distinct experts, first uses miss)
    assert rates == [0.0, 1 / 6, 2 / 6, 2 / 6]
    assert M.lru_hit_rates([], 4) == [0.0] * 4


def test_expert_load_bins_and_replay_matches_the_router():
    load = M.expert_load(_trace(), 4, bin_s=1.0)
    assert load["bins"] == [[2, 0, 1, 0], [1, 1, 1, 3]] and load["bins_t"] == [0.0, 1.0]
    assert load["share"] == pytest.approx([3 / 9, 1 / 9, 2 / 9, 3 / 9])
    assert (load["dropped"], load["overflow"]) == (1, 2)
    router = Router(16, 4, 2, seed=2, capacity_factor=0.5)
    bank = TokenBank(router, per_expert=16, seed=3)
    passes = [(0.1, np.array([0, 1, 17, 33, 50, 63])), (0.4, np.array([5]))]
    trace = M.replay(router, passes, bank)
    for (t, idx), st in zip(passes, trace):
        r = router.route(bank.rows(idx))
        assert st.t == t and st.tokens == len(idx) and np.array_equal(st.rows, r.expert_counts)
        assert st.dropped == r.dropped
    assert trace[0].dropped > 0  # capacity 0.5 really drops here
