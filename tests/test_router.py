import math

import numpy as np
import pytest

from gateway.router import Router

D, E = 16, 8


def brute_topk(z, k):
    """Per-token reference: full softmax, the k largest (ties to the lower id), renormalised."""
    z = np.asarray(z, dtype=np.float64)
    idx = np.empty((z.shape[0], k), dtype=np.int64)
    w = np.empty((z.shape[0], k))
    for t, row in enumerate(z):
        p = np.exp(row - row.max())
        p /= p.sum()
        best = sorted(range(len(row)), key=lambda e: (-row[e], e))[:k]
        idx[t] = best
        w[t] = p[best] / p[best].sum()
    return idx, w


def tokens(T, d=D, seed=0):
    return np.random.default_rng(seed).standard_normal((T, d)).astype(np.float32)


def hand_router(n_experts, top_k, **kw):
    """A router whose logits are x itself, for hand-built cases."""
    return Router(n_experts, n_experts, top_k, w_gate=np.eye(n_experts), **kw)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_topk_matches_brute_force(k):
    r = Router(D, E, k, seed=3)
    x = tokens(200)
    z = x.astype(np.float64) @ r.w_gate.astype(np.float64)
    np.testing.assert_allclose(r.logits(x), z, rtol=1e-5, atol=1e-5)
    got = r.route(x)
    want_idx, want_w = brute_topk(r.logits(x), k)
    assert got.topk_idx.dtype == np.int32 and got.topk_weights.dtype == np.float32
    np.testing.assert_array_equal(got.topk_idx, want_idx)
    np.testing.assert_allclose(got.topk_weights, want_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.topk_weights.sum(axis=1), 1.0, rtol=1e-5)
    assert np.all(np.diff(got.topk_weights, axis=1) <= 0)  # slot 0 is the best
    assert got.overflow == got.dropped == 0 and got.capacity is None
    np.testing.assert_array_equal(got.expert_counts, np.bincount(want_idx.ravel(), minlength=E))


def test_bias_shifts_logits():
    bias = np.arange(E, dtype=np.float32)
    r = Router(D, E, 2, seed=1, bias=bias)
    x = tokens(10)
    np.testing.assert_allclose(r.logits(x), x @ r.w_gate + bias, rtol=1e-6)


def test_ties_go_to_lower_expert_id():
    r = Router(D, E, 3, w_gate=np.zeros((D, E)))
    got = r.route(tokens(5))
    np.testing.assert_array_equal(got.topk_idx, np.tile([0, 1, 2], (5, 1)))
    np.testing.assert_allclose(got.topk_weights, 1 / 3, rtol=1e-6)


def test_no_duplicate_experts_per_token():
    got = Router(D, E, 4, seed=2).route(tokens(300))
    assert all(len(set(row)) == 4 for row in got.topk_idx.tolist())


def test_noisy_topk_follows_shazeer_and_is_reproducible():
    r = Router(D, E, 2, seed=5, noisy=True, noise_std=2.0)
    x = tokens(256, seed=1)
    a, b = r.route(x, rng=np.random.default_rng(42)), r.route(x, rng=np.random.default_rng(42))
    np.testing.assert_array_equal(a.topk_idx, b.topk_idx)
    np.testing.assert_array_equal(a.topk_weights, b.topk_weights)
    c = r.route(x, rng=43)
    assert not np.array_equal(a.topk_idx, c.topk_idx)
    clean = Router(D, E, 2, seed=5).route(x)
    changed = np.any(a.topk_idx != clean.topk_idx, axis=1).mean()
    assert changed > 0.2, changed  # noise of std 2 on O(1) logits reorders many tokens
    # Softmax(KeepTopK(H)) with H = logits + N(0,1) * noise_std.
    h = r.logits(x) + (np.random.default_rng(42).standard_normal((256, E)) * 2.0).astype(np.float32)
    want_idx, want_w = brute_topk(h, 2)
    np.testing.assert_array_equal(a.topk_idx, want_idx)
    np.testing.assert_allclose(a.topk_weights, want_w, rtol=1e-5, atol=1e-6)


def test_noisy_default_rng_is_seeded_per_router():
    x = tokens(64)
    r1 = Router(D, E, 2, seed=5, noisy=True)
    r2 = Router(D, E, 2, seed=5, noisy=True)
    first = r1.route(x)
    np.testing.assert_array_equal(first.topk_idx, r2.route(x).topk_idx)
    assert not np.array_equal(first.topk_idx, r1.route(x).topk_idx)  # the stream advances


def test_noise_std_zero_and_learned_noise():
    x = tokens(128)
    clean = Router(D, E, 2, seed=5).route(x)
    zero = Router(D, E, 2, seed=5, noisy=True, noise_std=0.0).route(x, rng=1)
    np.testing.assert_array_equal(zero.topk_idx, clean.topk_idx)
    # softplus(x @ w_noise) ~ 0 when w_noise is hugely negative for these inputs ...
    x_pos = np.abs(x)
    quiet = Router(D, E, 2, seed=5, noisy=True, w_noise=np.full((D, E), -50.0))
    np.testing.assert_array_equal(quiet.route(x_pos, rng=1).topk_idx, Router(D, E, 2, seed=5).route(x_pos).topk_idx)
    # ... and large when it is positive.
    loud = Router(D, E, 2, seed=5, noisy=True, w_noise=np.full((D, E), 5.0))
    assert np.any(loud.route(x_pos, rng=1).topk_idx != Router(D, E, 2, seed=5).route(x_pos).topk_idx)


def test_capacity_formula():
    assert Router(D, E, 2, capacity_factor=1.25).capacity(256) == 80
    assert Router(D, E, 2, capacity_factor=1.0).capacity(100) == 25
    assert Router(D, E, 1, capacity_factor=1.0).capacity(9) == 2  # ceil(9/8)
    assert Router(D, 1, 1, capacity_factor=1.1).capacity(10) == 11  # not 12 from 11.000000000000002
    assert Router(D, E, 2).capacity(256) is None
    assert Router(D, E, 2, capacity_factor=1.0).capacity(0) == 0


def test_drop_hand_built():
    # Every token prefers expert 0, then 1, 2, 3; capacity ceil(1.0 * 8 * 1 / 4) = 2.
    r = hand_router(4, 1, capacity_factor=1.0, overflow="drop")
    x = np.tile(np.array([3.0, 2.0, 1.0, 0.0], np.float32), (8, 1))
    got = r.route(x)
    assert got.capacity == 2 and got.overflow == 6 and got.dropped == 6
    np.testing.assert_array_equal(got.topk_idx[:, 0], [0, 0, -1, -1, -1, -1, -1, -1])  # first come first served
    np.testing.assert_array_equal(got.topk_weights[:, 0], [1, 1, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(got.expert_counts, [2, 0, 0, 0])


def test_spill_hand_built():
    r = hand_router(4, 1, capacity_factor=1.0, overflow="spill")
    x = np.tile(np.array([3.0, 2.0, 1.0, 0.0], np.float32), (8, 1))
    got = r.route(x)
    assert got.overflow == 6 and got.dropped == 0
    np.testing.assert_array_equal(got.topk_idx[:, 0], [0, 0, 1, 1, 2, 2, 3, 3])
    np.testing.assert_array_equal(got.topk_weights[:, 0], 1.0)
    np.testing.assert_array_equal(got.expert_counts, [2, 2, 2, 2])


def test_spill_drops_only_when_nothing_has_room():
    r = hand_router(4, 1, capacity_factor=0.5, overflow="spill")  # capacity 1, room for 4 of 8
    x = np.tile(np.array([3.0, 2.0, 1.0, 0.0], np.float32), (8, 1))
    got = r.route(x)
    assert got.capacity == 1 and got.overflow == 7 and got.dropped == 4
    np.testing.assert_array_equal(got.topk_idx[:, 0], [0, 1, 2, 3, -1, -1, -1, -1])


def test_spill_skips_the_tokens_own_experts_and_keeps_slot_weight():
    # E=3, k=2, capacity ceil(3 * 2 / 3) = 2. Token 2 overflows on both slots: slot 0 spills to
    # expert 2, slot 1 then has only expert 2 left, which the token already uses -> dropped.
    r = hand_router(3, 2, capacity_factor=1.0, overflow="spill")
    x = np.tile(np.array([3.0, 2.0, 1.0], np.float32), (3, 1))
    got = r.route(x)
    np.testing.assert_array_equal(got.topk_idx, [[0, 1], [0, 1], [2, -1]])
    assert got.overflow == 2 and got.dropped == 1
    w0 = 1 / (1 + math.exp(-1.0))  # softmax of (3, 2), slot 0
    np.testing.assert_allclose(got.topk_weights, [[w0, 1 - w0], [w0, 1 - w0], [w0, 0]], rtol=1e-6)
    np.testing.assert_array_equal(got.expert_counts, [2, 2, 1])


def test_first_choices_placed_before_spills():
    # Capacity 1 each. Token 1 overflows expert 0; its next best is expert 1, but that is
    # token 2's first choice, and first choices are placed before any spill, even a later token's.
    r = hand_router(3, 1, capacity_factor=1.0, overflow="spill")
    x = np.array([[3, 2, 1], [3, 2, 1], [1, 3, 2]], np.float32)
    got = r.route(x)
    np.testing.assert_array_equal(got.topk_idx[:, 0], [0, 2, 1])
    assert got.overflow == 1 and got.dropped == 0


def test_drop_does_not_renormalise():
    x = tokens(256, seed=4)
    bias = np.zeros(E, np.float32)
    bias[0] = 3.0
    free = Router(D, E, 2, seed=1, bias=bias).route(x)
    capped = Router(D, E, 2, seed=1, bias=bias, capacity_factor=1.0).route(x)
    kept = capped.topk_idx >= 0
    assert capped.dropped > 0
    np.testing.assert_array_equal(capped.topk_idx[kept], free.topk_idx[kept])
    np.testing.assert_array_equal(capped.topk_weights[kept], free.topk_weights[kept])
    assert np.all(capped.topk_weights[~kept] == 0)
    partial = kept.any(axis=1) & ~kept.all(axis=1)
    assert partial.any() and np.all(capped.topk_weights[partial].sum(axis=1) < 1 - 1e-6)


def skewed_bias(kind, n_experts):
    if kind == "hot":
        b = np.zeros(n_experts, np.float32)
        b[n_experts // 2] = 4.0
        return b
    # Zipf-like: softmax(bias) proportional to 1 / (rank + 1)^1.2
    return (-1.2 * np.log1p(np.arange(n_experts))).astype(np.float32)


@pytest.mark.parametrize("kind", ["hot", "zipf"])
@pytest.mark.parametrize("policy", ["drop", "spill"])
@pytest.mark.parametrize("k", [1, 2])
def test_skewed_routing_respects_capacity(kind, policy, k):
    n_experts, T = 16, 256
    bias = skewed_bias(kind, n_experts)
    x = tokens(T, seed=9)
    free = Router(D, n_experts, k, seed=2, bias=bias).route(x)
    cf = 1.25
    r = Router(D, n_experts, k, seed=2, bias=bias, capacity_factor=cf, overflow=policy)
    got = r.route(x)
    cap = math.ceil(cf * T * k / n_experts)
    assert got.capacity == cap
    assert free.expert_counts.max() > cap  # the skew really overflows
    assert got.expert_counts.max() <= cap
    np.testing.assert_array_equal(got.expert_counts, np.bincount(got.topk_idx[got.topk_idx >= 0], minlength=n_experts))
    assert got.expert_counts.sum() + got.dropped == T * k
    assert got.overflow == int(np.maximum(free.expert_counts - cap, 0).sum())
    assert all(len(set(row) - {-1}) == len([e for e in row if e >= 0]) for row in got.topk_idx.tolist())
    if policy == "drop":
        assert got.dropped == got.overflow
    else:
        assert got.dropped < got.overflow
        # Every spilled assignment went to its token's best expert that was not full:
        # all experts it prefers (and does not already use) ended up at capacity.
        z = r.logits(x)
        moved = (got.topk_idx != free.topk_idx) & (got.topk_idx >= 0)
        assert moved.any()
        for t, j in zip(*np.nonzero(moved)):
            e = got.topk_idx[t, j]
            better = [b for b in range(n_experts) if z[t, b] > z[t, e] and b not in got.topk_idx[t]]
            assert all(got.expert_counts[b] == cap for b in better)


def test_empty_batch():
    got = Router(D, E, 2, capacity_factor=1.0).route(np.empty((0, D), np.float32))
    assert got.topk_idx.shape == (0, 2) and got.topk_weights.shape == (0, 2)
    assert got.expert_counts.shape == (E,) and got.expert_counts.sum() == 0


def test_bad_config_and_inputs():
    with pytest.raises(ValueError, match="top_k"):
        Router(D, 4, 5)
    with pytest.raises(ValueError, match="top_k"):
        Router(D, 4, 0)
    with pytest.raises(ValueError, match="overflow policy"):
        Router(D, 4, 1, overflow="reroute")
    with pytest.raises(ValueError, match="capacity_factor"):
        Router(D, 4, 1, capacity_factor=0)
    with pytest.raises(ValueError, match="capacity_factor"):
        Router(D, 4, 1, capacity_factor=-1.0)
    with pytest.raises(ValueError, match="noise_std"):
        Router(D, 4, 1, noise_std=-1.0)
    with pytest.raises(ValueError, match="w_gate"):
        Router(D, 4, 1, w_gate=np.zeros((D, 5)))
    with pytest.raises(ValueError, match="bias"):
        Router(D, 4, 1, bias=np.zeros(3))
    with pytest.raises(ValueError, match="n_experts"):
        Router(D, 0, 1)
    r = Router(D, 4, 1)
    with pytest.raises(ValueError, match="shape"):
        r.route(np.zeros((3, D + 1), np.float32))
    with pytest.raises(ValueError, match="shape"):
        r.route(np.zeros(D, np.float32))
    bad = np.zeros((2, D), np.float32)
    bad[1, 0] = np.nan
    with pytest.raises(ValueError, match="finite"):
        r.route(bad)
