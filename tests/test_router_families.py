"""Routing rules of real model families (gateway.router.RoutingRule / FamilyRouter), checked
against hand-written per-token formulas here, and against transformers' own router
modules in test_router_families_hf.py."""
import numpy as np
import pytest

from gateway.router import FamilyRouter, RoutingRule, select_experts
from workers import bf16


def rand(shape, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def ref_softmax(z, k, renorm):
    """One token at a time, in float64: p = softmax(z), the k best, optionally renormalised."""
    idx, w = [], []
    for row in z.astype(np.float64):
        p = np.exp(row - row.max())
        p /= p.sum()
        best = sorted(range(len(row)), key=lambda e: (-p[e], e))[:k]
        ww = p[best]
        idx.append(best)
        w.append(ww / ww.sum() if renorm else ww)
    return np.array(idx), np.array(w)


def ref_deepseek(z, bias, k, n_group, topk_group, renorm, scale):
    """DeepSeek-V3's rule for one token at a time, in float64."""
    idx, w = [], []
    E = z.shape[1]
    per = E // n_group
    for row in z.astype(np.float64):
        s = 1 / (1 + np.exp(-row))
        c = s + bias
        gscore = [sum(sorted(c[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: (-gscore[g], g))[:topk_group]
        allowed = [e for e in range(E) if e // per in groups]
        best = sorted(allowed, key=lambda e: (-c[e], e))[:k]
        ww = s[best]
        if renorm:
            ww = ww / (ww.sum() + 1e-20)
        idx.append(best)
        w.append(ww * scale)
    return np.array(idx), np.array(w)


@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("E, k", [(8, 2), (6, 3), (4, 4), (5, 1)])
def test_softmax_topk(renorm, E, k):
    z = rand((50, E), seed=E * 10 + k)
    idx, w = select_experts(z, k, RoutingRule("softmax", renormalize=renorm))
    ri, rw = ref_softmax(z, k, renorm)
    assert idx.dtype == np.int32 and w.dtype == np.float32
    assert np.array_equal(idx, ri)
    np.testing.assert_allclose(w, rw, rtol=2e-6, atol=1e-7)
    if renorm:
        np.testing.assert_allclose(w.sum(1), 1, rtol=1e-6)
    else:
        assert np.all(w.sum(1) < 1 + 1e-6) and (k == E or np.all(w.sum(1) < 1 - 1e-6))


@pytest.mark.parametrize("n_group, topk_group, k", [(1, 1, 2), (4, 2, 3), (4, 1, 2), (8, 3, 3), (2, 2, 8)])
@pytest.mark.parametrize("renorm, scale", [(True, 2.5), (False, 1.0)])
def test_deepseek_sigmoid_group_limited(n_group, topk_group, k, renorm, scale):
    E = 16 if n_group == 8 else 8
    z = rand((60, E), seed=n_group * 7 + k)
    bias = rand((E,), seed=99, scale=0.3)
    rule = RoutingRule("sigmoid", renormalize=renorm, scale=scale, n_group=n_group, topk_group=topk_group)
    idx, w = select_experts(z, k, rule, bias)
    ri, rw = ref_deepseek(z, bias.astype(np.float64), k, n_group, topk_group, renorm, scale)
    assert np.array_equal(idx, ri)
    np.testing.assert_allclose(w, rw, rtol=2e-6, atol=1e-7)


def test_bias_selects_but_does_not_weigh():
    z = np.zeros((1, 4), np.float32)
    z[0] = [2.0, 1.0, 0.0, -1.0]
    bias = np.array([0, 0, 0, 10], np.float32)  # expert 3 wins selection by its bias alone
    idx, w = select_experts(z, 2, RoutingRule("sigmoid", renormalize=False), bias)
    assert idx.tolist() == [[3, 0]]
    np.testing.assert_allclose(w[0], 1 / (1 + np.exp(-np.array([-1.0, 2.0]))), rtol=1e-6)


def test_group_limit_excludes_experts_outside_the_chosen_groups():
    # groups {0,1} and {2,3}: group 1 holds the single best expert (3), group 0 the two
    # next best; group scores 0.9+0.8 > 0.95+0.1, so expert 3 is excluded with topk_group=1.
    s = np.array([[0.9, 0.8, 0.1, 0.95]], np.float32)
    z = np.log(s / (1 - s))
    rule = RoutingRule("sigmoid", renormalize=False, n_group=2, topk_group=1)
    idx, _ = select_experts(z, 2, rule)
    assert idx.tolist() == [[0, 1]]
    idx, _ = select_experts(z, 2, RoutingRule("sigmoid", renormalize=False))
    assert idx.tolist() == [[3, 0]]


def test_rule_validation():
    with pytest.raises(ValueError, match="scoring"):
        RoutingRule("relu")
    with pytest.raises(ValueError, match="topk_group"):
        RoutingRule("sigmoid", n_group=2, topk_group=3)
    with pytest.raises(ValueError, match="sigmoid scoring only"):
        RoutingRule("softmax", n_group=2)
    with pytest.raises(ValueError, match="top_k 5 > topk_group"):
        select_experts(rand((2, 8)), 5, RoutingRule("sigmoid", n_group=4, topk_group=2))
    with pytest.raises(ValueError, match="sigmoid scoring only"):
        select_experts(rand((2, 8)), 2, RoutingRule(), bias=np.zeros(8, np.float32))


def test_family_router_qwen2_shared_expert_gate():
    D, E = 12, 6
    w, sg = rand((E, D), 1), rand((1, D), 2)
    x = rand((9, D), 3)
    r = FamilyRouter(w, 2, RoutingRule("softmax", renormalize=False), n_shared=3, shared_gate=sg)
    rt = r.route(x)
    assert rt.topk_idx.shape == (9, 5) and rt.top_k == 5 and r.n_ids == 9
    ri, rw = ref_softmax(x.astype(np.float64) @ w.T.astype(np.float64), 2, False)
    assert np.array_equal(rt.topk_idx[:, :2], ri)
    np.testing.assert_allclose(rt.topk_weights[:, :2], rw, rtol=1e-5)
    assert np.array_equal(rt.topk_idx[:, 2:], np.tile([6, 7, 8], (9, 1)))
    gate = 1 / (1 + np.exp(-(x.astype(np.float64) @ sg.T.astype(np.float64))))
    np.testing.assert_allclose(rt.topk_weights[:, 2:], np.repeat(gate, 3, axis=1), rtol=1e-5)
    assert rt.expert_counts[6:].tolist() == [9, 9, 9] and rt.expert_counts.sum() == 9 * 5
    assert rt.dropped == 0 and rt.capacity is None


def test_family_router_deepseek_shared_weight_one():
    D, E = 12, 8
    w, b = rand((E, D), 1), rand((E,), 4, 0.2)
    x = rand((7, D), 5)
    rule = RoutingRule("sigmoid", renormalize=True, scale=2.5, n_group=4, topk_group=2)
    rt = FamilyRouter(w, 3, rule, bias=b, n_shared=1).route(x)
    ri, rw = ref_deepseek(x.astype(np.float64) @ w.T.astype(np.float64), b.astype(np.float64), 3, 4, 2, True, 2.5)
    assert np.array_equal(rt.topk_idx[:, :3], ri)
    np.testing.assert_allclose(rt.topk_weights[:, :3], rw, rtol=1e-5)
    assert np.all(rt.topk_idx[:, 3] == 8) and np.all(rt.topk_weights[:, 3] == 1.0)


def test_family_router_bf16_rounds_logits_and_weights_as_the_model_does():
    D, E = 16, 8
    w = rand((E, D), 1)
    x32 = rand((40, D), 2)
    xb = bf16.from_float32(x32)  # uint16 bits: the numpy-only bf16 representation
    xr = bf16.to_float32(xb)
    rule = RoutingRule("softmax", renormalize=False, logits_in_activation_dtype=True, weights_in_activation_dtype=True)
    r = FamilyRouter(w, 2, rule)
    z = r.logits(xb)
    assert np.array_equal(z, bf16.to_float32(bf16.from_float32(xr @ w.T)))  # rounded to bf16
    rt = r.route(xb)
    assert np.array_equal(rt.topk_weights, bf16.to_float32(bf16.from_float32(rt.topk_weights)))
    # float32 activations: nothing is rounded
    rt32 = FamilyRouter(w, 2, rule).route(xr)
    assert not np.array_equal(rt32.topk_weights, bf16.to_float32(bf16.from_float32(rt32.topk_weights)))


def test_family_router_validation():
    w = rand((4, 8))
    with pytest.raises(ValueError, match="top_k"):
        FamilyRouter(w, 5, RoutingRule())
    with pytest.raises(ValueError, match="bias must have shape"):
        FamilyRouter(w, 2, RoutingRule("sigmoid"), bias=np.zeros(3))
    with pytest.raises(ValueError, match="shared_gate given without shared experts"):
        FamilyRouter(w, 2, RoutingRule(), shared_gate=np.zeros((1, 8)))
    with pytest.raises(ValueError, match=r"x must have shape \(T, 8\)"):
        FamilyRouter(w, 2, RoutingRule()).route(np.zeros((3, 7), np.float32))


def test_family_router_empty_batch():
    rt = FamilyRouter(rand((4, 8)), 2, RoutingRule(), n_shared=1).route(np.zeros((0, 8), np.float32))
    assert rt.topk_idx.shape == (0, 3) and rt.expert_counts.tolist() == [0] * 5
