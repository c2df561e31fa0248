"""FamilyRouter (loaded from a saved checkpoint) against transformers' own router modules
on random inputs: the same experts and the same weights."""
import numpy as np
import pytest

from tests.torch_extra import require_torch_extra

torch, transformers = require_torch_extra()

import ml_dtypes  # noqa: E402

from gateway.layer import load_gateway_layers  # noqa: E402
from tests import hf_models as hm  # noqa: E402


def boundary_ties(logits: np.ndarray, k: int) -> np.ndarray:
    """Tokens whose k-th and (k+1)-th best logits are exactly equal: there the model's own
    choice is torch.topk's unspecified order (common with bf16 logits)."""
    s = -np.sort(-logits, axis=1)
    return s[:, k - 1] == s[:, k] if k < s.shape[1] else np.zeros(len(s), bool)


def by_expert(idx: np.ndarray, w: np.ndarray, n: int) -> np.ndarray:
    """(T, n) dense weights per expert id: compares routings whatever their slot order."""
    out = np.zeros((idx.shape[0], n))
    np.put_along_axis(out, idx.astype(np.int64), w.astype(np.float64), axis=1)
    return out


def spec_in_fp32(layer) -> bool:
    return not layer.spec.routing.logits_in_model_dtype  # DeepSeek's gate runs in float32


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", hm.FAMILIES)
def test_router_equals_transformers_router(tmp_path, family, dtype):
    tdt = getattr(torch, dtype)
    m = hm.model(family, dtype=tdt)
    m.save_pretrained(str(tmp_path))
    layers = load_gateway_layers(str(tmp_path))
    assert sorted(layers) == sorted(hm.moe_blocks(m))
    for L, blk in hm.moe_blocks(m).items():
        x = hm.hidden(200, seed=L, dtype=tdt)[0]
        with torch.no_grad():
            logits, w, idx = blk.gate(x)
        r = layers[L].router
        k, E = r.top_k, r.n_experts
        xn = x.float().numpy()
        if dtype == "bfloat16":
            xn = xn.astype(ml_dtypes.bfloat16)
        rt = r.route(xn)
        want = logits.float().numpy()
        # bf16 logits: equal up to one bf16 rounding (fp32 sums in another order can round
        # the other way), measured at the logits' scale
        atol = 1e-6 if dtype == "float32" or spec_in_fp32(layers[L]) else 2 ** -8 * np.abs(want).max()
        np.testing.assert_allclose(r.logits(xn), want, rtol=1e-5, atol=atol)
        ties = boundary_ties(logits.float().numpy(), k)
        assert ties.mean() < 0.1  # a few at most, and only in bf16
        if dtype == "float32":
            assert not ties.any()
        keep = ~ties
        ours = by_expert(rt.topk_idx[:, :k], rt.topk_weights[:, :k], E)[keep]
        theirs = by_expert(idx.numpy(), w.float().numpy(), E)[keep]
        assert np.array_equal(ours > 0, theirs > 0), "different experts selected"
        tol = 1e-6 if dtype == "float32" else 1e-2
        np.testing.assert_allclose(ours, theirs, rtol=tol, atol=tol)
        # shared experts: every token, weight 1 (DeepSeek family) or sigmoid(shared_expert_gate x)
        spec = layers[L].spec
        if spec.n_shared:
            assert np.all(rt.topk_idx[:, k:] == np.arange(E, E + spec.n_shared))
            if spec.shared.gate_weight:
                with torch.no_grad():
                    sg = torch.sigmoid(blk.shared_expert_gate(x)).float().numpy()
                np.testing.assert_allclose(rt.topk_weights[:, k:], np.repeat(sg, spec.n_shared, 1),
                                           rtol=tol, atol=tol)
            else:
                assert np.all(rt.topk_weights[:, k:] == 1.0)
