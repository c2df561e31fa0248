"""CheckpointMoE with numpy alone (the rxe guest's path: numpy kernel, no torch), checked
against the layer written out token by token from the raw tensors: routing formula, each
chosen expert's SwiGLU, the shared MLP whole (not in pieces) with its gate. Against
transformers itself: test_reference_hf.py."""
import numpy as np
import pytest

from gateway.layer import load_gateway_layers
from gateway.reference import CheckpointMoE
from tests.ckpt_helpers import H, K, family_tensors, tiny_checkpoint
from workers import bf16
from workers.checkpoint import Checkpoint, model_spec


def silu(a):
    return a / (1 + np.exp(-a))


def mlp(x, g, u, d):
    return (silu(x @ g.T) * (x @ u.T)) @ d.T


def by_hand(family, t, cfg, L, x):
    """The MoE layer L for tokens x, one token at a time, float64."""
    p = f"model.layers.{L}.{'block_sparse_moe' if family == 'mixtral' else 'mlp'}"
    W = {k: v.astype(np.float64) for k, v in t.items() if k.startswith(p + ".")}
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    E = W[f"{p}.gate.weight"].shape[0]
    out = np.zeros_like(x, dtype=np.float64)
    for i, xt in enumerate(x.astype(np.float64)):
        z = W[f"{p}.gate.weight"] @ xt
        if family == "deepseek_v3":
            s = 1 / (1 + np.exp(-z))
            c = s + W[f"{p}.gate.e_score_correction_bias"]
            per = E // cfg["n_group"]
            gs = [np.sort(c[j * per:(j + 1) * per])[-2:].sum() for j in range(cfg["n_group"])]
            groups = np.argsort(gs)[::-1][:cfg["topk_group"]]
            c = np.where(np.isin(np.arange(E) // per, groups), c, -np.inf)
            chosen = np.argsort(c)[::-1][:K]
            w = s[chosen] / s[chosen].sum() * cfg["routed_scaling_factor"]
        else:
            pr = np.exp(z - z.max())
            pr /= pr.sum()
            chosen = np.argsort(pr)[::-1][:K]
            w = pr[chosen] / pr[chosen].sum() if family == "mixtral" or cfg.get("norm_topk_prob") else pr[chosen]
        for e, we in zip(chosen, w):
            out[i] += we * mlp(xt, *(W[f"{p}.experts.{e}.{n}.weight"] for n in names))
        if family == "qwen2_moe":
            gate = 1 / (1 + np.exp(-(W[f"{p}.shared_expert_gate.weight"] @ xt)[0]))
            out[i] += gate * mlp(xt, *(W[f"{p}.shared_expert.{n}.weight"] for n in names))
        if family == "deepseek_v3":
            out[i] += mlp(xt, *(W[f"{p}.shared_experts.{n}.weight"] for n in names))
    return out


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_checkpoint_layer_equals_the_layer_by_hand(tmp_path, family, fused):
    d, cfg, _ = tiny_checkpoint(str(tmp_path / "m"), family, n_layers=3, fused=fused, shards=2 if fused else 1)
    t = family_tensors(family, cfg, fused=False)  # the same weights under their per-expert names
    x = np.random.default_rng(7).standard_normal((30, H)).astype(np.float32)
    ck = Checkpoint(d)
    for L in model_spec(ck).moe_layers:
        y, routing = CheckpointMoE.from_checkpoint(ck, L).forward(x)
        want = by_hand(family, t, cfg, L, x)
        assert y.dtype == np.float32
        assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()


def test_bf16_and_fp16_checkpoints_through_the_numpy_kernel(tmp_path):
    for code, rtol in (("BF16", 2e-2), ("F16", 2e-3)):
        d, cfg, t = tiny_checkpoint(str(tmp_path / code), "qwen2_moe", code=code)
        ck = Checkpoint(d)
        assert model_spec(ck).layer(1).dtype == {"BF16": "bfloat16", "F16": "float16"}[code]
        x = np.random.default_rng(8).standard_normal((20, H)).astype(np.float32)
        y, _ = CheckpointMoE.from_checkpoint(ck, 1).forward(bf16.from_float32(x) if code == "BF16" else x)
        y = bf16.to_float32(y) if code == "BF16" else y
        want = by_hand("qwen2_moe", t, cfg, 1, bf16.to_float32(bf16.from_float32(x)) if code == "BF16" else x)
        assert np.abs(y - want).max() <= rtol * np.abs(want).max()


def test_gateway_layers_carry_router_and_fingerprint(tmp_path):
    d, cfg, t = tiny_checkpoint(str(tmp_path / "ds"), "deepseek_v3", n_layers=3)
    layers = load_gateway_layers(d)
    assert sorted(layers) == [1, 2]
    r = layers[1].router
    assert (r.n_experts, r.n_shared, r.n_ids, r.top_k) == (4, 1, 5, K)
    assert r.rule.scoring == "sigmoid" and r.rule.scale == 2.5 and r.bias is not None
    assert layers[1].fingerprint != layers[2].fingerprint
    assert load_gateway_layers(d, [2])[2].fingerprint == layers[2].fingerprint
