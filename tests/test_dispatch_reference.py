import numpy as np
import pytest

from gateway.dispatch import DispatchPlan, split_over_replicas
from gateway.reference import ReferenceMoE
from gateway.router import Router
from workers.expert import SwiGLUExpert

D, F, E, T = 32, 48, 8, 96
TOL = dict(rtol=1e-4, atol=2e-5)


def skew(kind):
    b = np.zeros(E, np.float32)
    if kind == "hot":
        b[3] = 4.0
    elif kind == "zipf":
        b = (-1.2 * np.log1p(np.arange(E))).astype(np.float32)
    return b


def make_moe(k, kind="uniform", **kw):
    router = Router(D, E, k, seed=1, bias=skew(kind), **kw)
    experts = [SwiGLUExpert.from_seed(e, D, F, seed=1, max_tokens=16) for e in range(E)]
    return ReferenceMoE(router, experts)


def tokens(n=T, seed=0):
    return np.random.default_rng(seed).standard_normal((n, D)).astype(np.float32)


def run_distributed(plan, x, experts):
    """What gateway + workers do, minus the sockets: gather into a send slot,
    run each expert group into the worker's output slot, combine into `out`."""
    outputs = []
    for w in range(plan.n_workers):
        n = plan.worker_tokens(w)
        send = np.frombuffer(bytearray(max(n, 1) * D * 4), np.float32)[: n * D].reshape(n, D)
        assert plan.gather_into(x, w, send) is send
        recv = np.frombuffer(bytearray(max(n, 1) * D * 4), np.float32)[: n * D].reshape(n, D)
        for e, start, count in plan.groups(w):
            experts[e].forward(send[start:start + count], recv[start:start + count])
        outputs.append(recv if n else None)
    out = np.full_like(x, np.nan)  # combine must overwrite everything
    assert plan.combine(outputs, out) is out
    return out


def brute_moe(x, routing, experts):
    """Token-by-token definition of the MoE layer."""
    y = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for e, w in zip(routing.topk_idx[t], routing.topk_weights[t]):
            if e >= 0:
                y[t] += w * experts[e](x[t:t + 1])[0]
    return y


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("kind", ["uniform", "hot", "zipf"])
def test_reference_matches_token_by_token_definition(k, kind):
    moe = make_moe(k, kind, capacity_factor=1.0)
    x = tokens()
    y, routing = moe.forward(x)
    assert y.dtype == np.float32 and y.shape == x.shape
    np.testing.assert_allclose(y, brute_moe(x, routing, moe.experts), **TOL)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("kind", ["uniform", "hot", "zipf"])
@pytest.mark.parametrize("n_workers", [1, 2, 3])
def test_plan_equals_reference(k, kind, n_workers):
    moe = make_moe(k, kind)
    x = tokens()
    y_ref, routing = moe.forward(x)
    placement = [e % n_workers for e in range(E)]
    plan = DispatchPlan.build(routing.topk_idx, routing.topk_weights, placement, n_workers)
    np.testing.assert_array_equal(plan.expert_counts, routing.expert_counts)
    assert sum(plan.worker_tokens(w) for w in range(n_workers)) == T * k
    np.testing.assert_allclose(run_distributed(plan, x, moe.experts), y_ref, **TOL)


@pytest.mark.parametrize("policy", ["drop", "spill"])
@pytest.mark.parametrize("kind", ["hot", "zipf"])
def test_plan_equals_reference_with_capacity(policy, kind):
    moe = make_moe(2, kind, capacity_factor=1.0, overflow=policy)
    x = tokens()
    y_ref, routing = moe.forward(x)
    assert routing.overflow > 0
    if policy == "drop":
        assert routing.dropped > 0
    plan = DispatchPlan.build(routing.topk_idx, routing.topk_weights, {e: e % 2 for e in range(E)}, 2)
    assert sum(plan.worker_tokens(w) for w in range(2)) == T * 2 - routing.dropped
    np.testing.assert_allclose(run_distributed(plan, x, moe.experts), y_ref, **TOL)


def test_fully_dropped_tokens_come_out_zero():
    moe = make_moe(1, "hot", capacity_factor=0.25)  # capacity 3 of 96: most tokens dropped
    x = tokens()
    y_ref, routing = moe.forward(x)
    gone = np.all(routing.topk_idx < 0, axis=1)
    assert gone.sum() > T // 2
    plan = DispatchPlan.build(routing.topk_idx, routing.topk_weights, [0] * E, 1)
    y = run_distributed(plan, x, moe.experts)
    assert np.all(y[gone] == 0) and np.all(y_ref[gone] == 0)
    np.testing.assert_allclose(y, y_ref, **TOL)


def test_plan_layout():
    moe = make_moe(2, "zipf")
    x = tokens()
    _, routing = moe.forward(x)
    placement = {0: 1, 1: 0, 2: 1, 3: 0, 4: 1, 5: 0, 6: 1, 7: 0}
    plan = DispatchPlan.build(routing.topk_idx, routing.topk_weights, placement, 2)
    for w in range(2):
        groups = plan.groups(w)
        toks = plan.token_indices(w)
        assert [g[0] for g in groups] == sorted(g[0] for g in groups)  # sorted by expert
        assert all(placement[e] == w for e, _, _ in groups)
        pos = 0
        for e, start, count in groups:
            assert start == pos and count > 0
            pos += count
            seg = toks[start:start + count]
            assert np.all(np.diff(seg) > 0)  # token order, no repeats within an expert
            np.testing.assert_array_equal(seg, np.flatnonzero(np.any(routing.topk_idx == e, axis=1)))
            assert count == routing.expert_counts[e]
        assert pos == plan.worker_tokens(w)
        np.testing.assert_array_equal(plan.gather(x, w), x[toks])


def test_sending_needs_no_combine_tables():
    """A plan's combine tables are made when combining first needs them: building the plan
    and gathering every worker's rows (what goes before a round's first message) does not
    make them, and the combine made after that equals the reference."""
    moe = make_moe(2, "zipf")
    x = tokens()
    y_ref, routing = moe.forward(x)
    plan = DispatchPlan.build(routing.topk_idx, routing.topk_weights, [0, 1] * 4, 2)
    ys = []
    for w in range(2):
        xs = plan.gather(x, w)
        ys.append(np.empty_like(xs))
        for e, start, count in plan.groups(w):
            moe.experts[e].forward(xs[start:start + count], ys[w][start:start + count])
    assert plan._tables is None
    np.testing.assert_allclose(plan.combine(ys, np.full_like(x, np.nan)), y_ref, **TOL)
    assert plan._tables is not None


def test_gather_into_writes_the_callers_buffer():
    moe = make_moe(2)
    x = tokens()
    _, routing = moe.forward(x)
    plan = DispatchPlan.build(routing.topk_idx, routing.topk_weights, [0, 1] * 4, 2)
    n = plan.worker_tokens(1)
    slot = bytearray(n * D * 4 + 128)
    view = np.frombuffer(slot, np.float32, count=n * D, offset=128).reshape(n, D)
    plan.gather_into(x, 1, view)
    assert np.shares_memory(view, np.frombuffer(slot, np.uint8))
    got = np.frombuffer(bytes(slot), np.float32, count=n * D, offset=128).reshape(n, D)
    np.testing.assert_array_equal(got, x[plan.token_indices(1)])


def test_combine_with_duplicate_tokens_on_one_worker():
    # Every token's k experts all live on worker 0: each token appears k times in one block.
    moe = make_moe(4)
    x = tokens()
    y_ref, routing = moe.forward(x)
    plan = DispatchPlan.build(routing.topk_idx, routing.topk_weights, [0] * E, 1)
    toks = plan.token_indices(0)
    assert len(toks) == 4 * T and len(np.unique(toks)) == T
    np.testing.assert_allclose(run_distributed(plan, x, moe.experts), y_ref, **TOL)
    # Against an np.add.at combine of arbitrary per-row outputs.
    rows = np.random.default_rng(3).standard_normal((len(toks), D)).astype(np.float32)
    want = np.zeros_like(x)
    wt = np.array([routing.topk_weights[t][list(routing.topk_idx[t]).index(e)]
                   for e, s, c in plan.groups(0) for t in toks[s:s + c]], np.float32)
    np.add.at(want, toks, wt[:, None] * rows)
    np.testing.assert_allclose(plan.combine([rows], np.empty_like(x)), want, **TOL)


def test_empty_workers():
    moe = make_moe(2, "hot")
    x = tokens()
    y_ref, routing = moe.forward(x)
    plan = DispatchPlan.build(routing.topk_idx, routing.topk_weights, [0, 2, 0, 2, 0, 2, 0, 2], 4)
    for w in (1, 3):
        assert plan.worker_tokens(w) == 0 and plan.groups(w) == []
        out = np.empty((0, D), np.float32)
        assert plan.gather_into(x, w, out) is out
    np.testing.assert_allclose(run_distributed(plan, x, moe.experts), y_ref, **TOL)
    # A (0, d) array is as good as None for an empty worker.
    outs = [np.zeros((plan.worker_tokens(w), D), np.float32) for w in range(4)]
    assert not plan.combine(outs, np.ones_like(x)).any()


def test_empty_batch_plan():
    idx = np.empty((0, 2), np.int32)
    plan = DispatchPlan.build(idx, np.empty((0, 2), np.float32), [0] * E, 2)
    assert plan.worker_tokens(0) == plan.worker_tokens(1) == 0
    assert plan.combine([None, None], np.empty((0, D), np.float32)).shape == (0, D)


@pytest.mark.parametrize("k", [1, 2])
def test_replicas_via_from_assignment(k):
    # Hot expert 3 replicated on all three workers, with unequal shares; the rest pinned.
    moe = make_moe(k, "hot")
    x = tokens()
    y_ref, routing = moe.forward(x)
    replicas = {e: [e % 3] for e in range(E)}
    replicas[3] = [0, 1, 2]
    assign = split_over_replicas(routing.topk_idx, replicas, shares={3: [1.0, 2.0, 1.0]})
    plan = DispatchPlan.from_assignment(routing.topk_idx, routing.topk_weights, assign, 3, n_experts=E)
    hot = [(w, c) for w in range(3) for e, s, c in plan.groups(w) if e == 3]
    assert [w for w, _ in hot] == [0, 1, 2]
    counts = [c for _, c in hot]
    assert sum(counts) == routing.expert_counts[3]
    assert abs(counts[1] - sum(counts) / 2) <= 1
    np.testing.assert_array_equal(plan.expert_counts, routing.expert_counts)
    np.testing.assert_allclose(run_distributed(plan, x, moe.experts), y_ref, **TOL)


def test_from_assignment_arbitrary_split_and_drops():
    moe = make_moe(2, "zipf", capacity_factor=1.0)
    x = tokens()
    y_ref, routing = moe.forward(x)
    assert routing.dropped > 0
    assign = np.random.default_rng(7).integers(0, 3, size=routing.topk_idx.shape)
    plan = DispatchPlan.from_assignment(routing.topk_idx, routing.topk_weights, assign, 3)
    np.testing.assert_allclose(run_distributed(plan, x, moe.experts), y_ref, **TOL)


def test_validation_errors():
    moe = make_moe(2)
    x = tokens()
    _, r = moe.forward(x)
    with pytest.raises(ValueError, match="no worker"):
        DispatchPlan.build(r.topk_idx, r.topk_weights, {e: 0 for e in range(E - 1)}, 1)
    with pytest.raises(ValueError, match="no worker"):
        DispatchPlan.build(r.topk_idx, r.topk_weights, [0] * (E - 1), 1)
    with pytest.raises(ValueError, match="out of range"):
        DispatchPlan.build(r.topk_idx, r.topk_weights, [0, 1] * 4, 1)
    with pytest.raises(ValueError, match="shape"):
        DispatchPlan.build(r.topk_idx, r.topk_weights[:, :1], [0] * E, 1)
    with pytest.raises(ValueError, match="shape"):
        DispatchPlan.from_assignment(r.topk_idx, r.topk_weights, np.zeros((T, 1), int), 1)
    plan = DispatchPlan.build(r.topk_idx, r.topk_weights, [0, 1] * 4, 2)
    with pytest.raises(ValueError, match="out must have shape"):
        plan.gather_into(x, 0, np.empty((plan.worker_tokens(0) + 1, D), np.float32))
    with pytest.raises(ValueError, match="dtype"):
        plan.gather_into(x, 0, np.empty((plan.worker_tokens(0), D), np.float64))
    with pytest.raises(ValueError, match="x must have shape"):
        plan.gather_into(x[:-1], 0, np.empty((plan.worker_tokens(0), D), np.float32))
    with pytest.raises(ValueError, match="expected 2 outputs"):
        plan.combine([None], np.empty_like(x))
    with pytest.raises(ValueError, match="output of worker 1"):
        plan.combine([np.zeros((plan.worker_tokens(0), D), np.float32), None], np.empty_like(x))
    with pytest.raises(ValueError, match="router has"):
        ReferenceMoE(moe.router, moe.experts[:-1])
