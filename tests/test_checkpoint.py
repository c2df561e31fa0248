"""The checkpoint reader, family specs, loaders and fingerprints, with numpy alone (these
tests need neither torch nor safetensors: they also run in the rxe guest). What
transformers itself writes is checked in test_checkpoint_hf.py."""
import json
import os

import numpy as np
import pytest

from tests.ckpt_helpers import H, I, E, K, tiny_checkpoint, write_checkpoint, write_safetensors
from workers import bf16
from workers.checkpoint import (Checkpoint, CheckpointError, SafetensorsError, SafetensorsFile, layer_fingerprint,
                                checkpoint_fingerprint, load_experts, load_router, model_spec)


# -- bf16 -----------------------------------------------------------------------------

def test_bf16_round_trip_is_exact_and_rounds_to_nearest_even():
    bits = np.arange(0, 1 << 16, dtype=np.uint16)
    f = bf16.to_float32(bits)
    finite = np.isfinite(f)
    assert np.array_equal(bf16.from_float32(f[finite]), bits[finite])  # every bf16 survives a round trip
    # halfway cases: 1 + 2^-8 is exactly between 1 and 1 + 2^-7 -> the even one (1.0)
    halfway = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8)], np.float32)
    assert bf16.to_float32(bf16.from_float32(halfway)).tolist() == [1.0, 1 + 2 ** -6, -1.0]
    above = np.array([1 + 2 ** -8 + 2 ** -20], np.float32)  # just above halfway -> up
    assert bf16.to_float32(bf16.from_float32(above)).tolist() == [1 + 2 ** -7]
    special = np.array([np.inf, -np.inf, np.nan, 3.4e38], np.float32)
    back = bf16.to_float32(bf16.from_float32(special))
    assert back[0] == np.inf and back[1] == -np.inf and np.isnan(back[2]) and back[3] == np.inf


def test_bf16_into_preallocated_buffers():
    x = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    out, scratch = np.empty((3, 4), np.uint16), np.empty(64, np.uint32)
    assert bf16.from_float32(x, out=out, scratch=scratch) is out
    f = np.empty((3, 4), np.float32)
    assert bf16.to_float32(out, out=f) is f
    assert np.max(np.abs(f - x)) <= 2 ** -8 * 3
    with pytest.raises(ValueError):
        bf16.from_float32(x, out=out, scratch=np.empty(5, np.uint32))


def test_wire_dtype_names():
    assert bf16.dtype_name(np.uint16) == "bfloat16"
    assert bf16.dtype_name(np.float32) == "float32"
    assert bf16.is_bf16(bf16.wire_dtype("bfloat16"))
    assert bf16.wire_dtype("float32") == np.float32


# -- safetensors -----------------------------------------------------------------------

def test_safetensors_reads_each_dtype(tmp_path):
    rng = np.random.default_rng(0)
    a32 = rng.standard_normal((3, 5)).astype(np.float32)
    a16 = rng.standard_normal((4,)).astype(np.float16)
    ab = rng.standard_normal((2, 3, 4)).astype(np.float32)
    p = str(tmp_path / "x.safetensors")
    write_safetensors(p, {"a": ("F32", a32), "h": ("F16", a16), "b": ("BF16", ab), "empty": ("F32", np.zeros((0, 3), np.float32))},
                      metadata={"format": "pt", "k": "v"})
    f = SafetensorsFile(p)
    assert sorted(f.keys()) == ["a", "b", "empty", "h"] and f.metadata == {"format": "pt", "k": "v"}
    assert np.array_equal(f.tensor("a"), a32) and np.array_equal(f.tensor("h"), a16)
    b = f.tensor("b")
    assert b.dtype == np.uint16 and b.shape == (2, 3, 4) and f.info("b").dtype_name == "bfloat16"
    assert np.array_equal(bf16.to_float32(b), bf16.to_float32(bf16.from_float32(ab)))
    assert f.tensor("empty").shape == (0, 3)
    assert not f.tensor("a").flags.writeable  # a view of the read-only map, not a copy


@pytest.mark.parametrize("mutate, match", [
    (lambda h, n: (b"\xff" * 8, b""), "header length"),
    (lambda h, n: (len(b"[1]").to_bytes(8, "little"), b"[1]"), "not a JSON object"),
    (lambda h, n: (len(b"{x").to_bytes(8, "little"), b"{x"), "not JSON"),
])
def test_safetensors_rejects_bad_headers(tmp_path, mutate, match):
    p = str(tmp_path / "bad.safetensors")
    n, h = mutate(None, None)
    with open(p, "wb") as f:
        f.write(n + h)
    with pytest.raises(SafetensorsError, match=match):
        SafetensorsFile(p)


@pytest.mark.parametrize("entry, match", [
    ({"dtype": "Q4", "shape": [1], "data_offsets": [0, 4]}, "unknown dtype"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}, "4 bytes for shape"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "past the end"),
    ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "bad shape"),
])
def test_safetensors_rejects_bad_entries(tmp_path, entry, match):
    h = json.dumps({"t": entry}).encode()
    p = str(tmp_path / "bad.safetensors")
    with open(p, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h + b"\0" * 4)
    with pytest.raises(SafetensorsError, match=match):
        SafetensorsFile(p)


# -- checkpoint directory -----------------------------------------------------------------

def test_sharded_checkpoint_maps_only_the_shards_it_reads(tmp_path):
    d, cfg, t = tiny_checkpoint(str(tmp_path / "m"), "mixtral", shards=4)
    ck = Checkpoint(d)
    assert len(ck.shards) == 4 and ck.mapped_shards == []
    name = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    assert np.array_equal(ck.array(name), t[name])
    assert ck.mapped_shards == [ck.shard_of(name)]


def test_checkpoint_errors_are_clear(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        Checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="neither model.safetensors.index.json nor model.safetensors"):
        Checkpoint(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../x.safetensors"}}))
    with pytest.raises(CheckpointError, match="not a file of the directory"):
        Checkpoint(str(tmp_path))


def test_index_naming_a_tensor_its_shard_lacks(tmp_path):
    d = write_checkpoint(str(tmp_path / "m"), {}, {"a": np.zeros(2, np.float32), "b": np.ones(2, np.float32)},
                         shards=2)
    idx = json.loads(open(os.path.join(d, "model.safetensors.index.json")).read())
    idx["weight_map"]["a"] = idx["weight_map"]["b"]
    open(os.path.join(d, "model.safetensors.index.json"), "w").write(json.dumps(idx))
    with pytest.raises(SafetensorsError, match="index says it holds 'a'"):
        Checkpoint(d).raw("a")


# -- family specs ----------------------------------------------------------------------------

def patch_config(d, **kv):
    c = json.load(open(os.path.join(d, "config.json")))
    c.update(kv)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(c, f)
    return d


def test_mixtral_spec(tmp_path):
    d, cfg, t = tiny_checkpoint(str(tmp_path / "m"), "mixtral")
    spec = model_spec(Checkpoint(d))
    assert (spec.family, spec.moe_layers, spec.d_model) == ("mixtral", [0, 1], H)
    L = spec.layer(1)
    assert (L.n_experts, L.d_ff, L.d_model, L.routing.top_k, L.n_shared, L.n_ids) == (E, I, H, K, 0, E)
    assert (L.routing.scoring, L.routing.renormalize, L.routing.scale) == ("softmax", True, 1.0)
    assert L.experts.kind == "per_expert" and L.prefix == "model.layers.1.block_sparse_moe"
    assert L.experts.names(3) == [f"model.layers.1.block_sparse_moe.experts.3.{w}.weight" for w in ("w1", "w3", "w2")]


def test_qwen2_spec_sparse_step_mlp_only_and_shared_expert(tmp_path):
    d, cfg, t = tiny_checkpoint(str(tmp_path / "q"), "qwen2_moe", n_layers=4, mlp_only_layers=[2],
                                norm_topk_prob=True)
    spec = model_spec(Checkpoint(d))
    assert spec.moe_layers == [0, 1, 3]
    L = spec.layer(3)
    assert L.routing.renormalize is True and L.routing.weights_in_model_dtype
    assert L.shared is not None and L.shared.pieces == 2 and L.shared.piece_d_ff == I
    assert L.shared.gate_weight == "model.layers.3.mlp.shared_expert_gate.weight"
    assert (L.n_ids, L.is_shared(E), L.is_shared(E - 1)) == (E + 2, True, False)
    with pytest.raises(CheckpointError, match="layer 2 is not a MoE layer"):
        spec.layer(2)


def test_qwen2_config_disagreeing_with_tensors_is_refused(tmp_path):
    d, cfg, t = tiny_checkpoint(str(tmp_path / "q"), "qwen2_moe", n_layers=4, decoder_sparse_step=2)
    with pytest.raises(CheckpointError, match=r"makes layers 1,3 MoE layers, the tensors have routers in layers 0-3"):
        model_spec(Checkpoint(d))


def test_deepseek_spec(tmp_path):
    d, cfg, t = tiny_checkpoint(str(tmp_path / "ds"), "deepseek_v3", n_layers=3)
    spec = model_spec(Checkpoint(d))
    assert spec.moe_layers == [1, 2]
    r = spec.layer(1).routing
    assert (r.scoring, r.renormalize, r.scale, r.n_group, r.topk_group) == ("sigmoid", True, 2.5, 2, 1)
    assert r.bias == "model.layers.1.mlp.gate.e_score_correction_bias" and not r.logits_in_model_dtype
    sh = spec.layer(1).shared
    assert sh is not None and sh.gate_weight is None and sh.pieces == 1


def test_deepseek_moe_layer_freq(tmp_path):
    """DeepSeek's own config field (transformers' V3 code only reads first_k_dense_replace;
    with moe_layer_freq 1, the Hub's value, both agree)."""
    d, _, _ = tiny_checkpoint(str(tmp_path / "ds"), "deepseek_v3", n_layers=6, moe_layer_freq=2)
    assert model_spec(Checkpoint(d)).moe_layers == [2, 4]
    d = patch_config(d, moe_layer_freq=1)
    with pytest.raises(CheckpointError, match="makes layers 1-5 MoE layers, the tensors have routers in layers 2,4"):
        model_spec(Checkpoint(d))


def test_unknown_family_needs_a_routing_rule_in_its_config(tmp_path):
    d, _, t = tiny_checkpoint(str(tmp_path / "a"), "mixtral")
    patch_config(d, model_type="my_moe")
    with pytest.raises(CheckpointError, match="'my_moe' is not a known family.*norm_topk_prob"):
        model_spec(Checkpoint(d))
    patch_config(d, norm_topk_prob=True)
    spec = model_spec(Checkpoint(d))
    assert spec.family == "my_moe" and spec.layer(0).routing.renormalize and spec.layer(0).routing.scoring == "softmax"


def test_unknown_family_with_sigmoid_scoring(tmp_path):
    d, _, _ = tiny_checkpoint(str(tmp_path / "a"), "deepseek_v3", n_layers=3)
    patch_config(d, model_type="other_ds", scoring_func="sigmoid")
    spec = model_spec(Checkpoint(d))
    assert spec.moe_layers == [1, 2] and spec.layer(2).routing.scoring == "sigmoid"
    assert spec.layer(2).routing.n_group == 2 and spec.layer(2).routing.scale == 2.5


def test_bad_sizes_are_refused(tmp_path):
    d = patch_config(tiny_checkpoint(str(tmp_path / "a"), "mixtral")[0], num_local_experts=5)
    with pytest.raises(CheckpointError, match="config says 5 experts, router has 4"):
        model_spec(Checkpoint(d))
    d, _, _ = tiny_checkpoint(str(tmp_path / "b"), "mixtral", hidden_act="gelu")
    with pytest.raises(CheckpointError, match="activation 'gelu'"):
        model_spec(Checkpoint(d))
    d, _, _ = tiny_checkpoint(str(tmp_path / "c"), "deepseek_v3", n_group=3)
    with pytest.raises(CheckpointError, match="n_group 3"):
        model_spec(Checkpoint(d))
    d = patch_config(tiny_checkpoint(str(tmp_path / "d"), "qwen2_moe")[0], moe_intermediate_size=I + 1)
    with pytest.raises(CheckpointError, match=f"config says expert width {I + 1}, tensors have {I}"):
        model_spec(Checkpoint(d))
    d = patch_config(tiny_checkpoint(str(tmp_path / "e"), "deepseek_v3")[0], n_shared_experts=2)
    with pytest.raises(CheckpointError, match=f"shared experts are {I} wide, config says 2 x {I}"):
        model_spec(Checkpoint(d))


# -- loaders -------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_fused_and_per_expert_layouts_load_the_same_weights(tmp_path, family):
    a, _, t = tiny_checkpoint(str(tmp_path / "a"), family, seed=3)
    b, _, _ = tiny_checkpoint(str(tmp_path / "b"), family, seed=3, fused=True, shards=3)
    ca, cb = Checkpoint(a), Checkpoint(b)
    sa, sb = model_spec(ca).layer(1), model_spec(cb).layer(1)
    assert (sa.experts.kind, sb.experts.kind) == ("per_expert", "fused")
    wa, wb = load_experts(ca, sa, range(sa.n_ids)), load_experts(cb, sb, range(sb.n_ids))
    for e in range(sa.n_ids):
        for m in ("w_gate", "w_up", "w_down"):
            assert np.array_equal(getattr(wa[e], m), getattr(wb[e], m)), (e, m)
    # routed expert 1 is exactly what the checkpoint holds under its per-expert names
    assert np.array_equal(wa[1].w_gate, t[sa.experts.gate.format(e=1)])
    assert layer_fingerprint(ca, sa) == layer_fingerprint(cb, sb)
    assert checkpoint_fingerprint(ca) != checkpoint_fingerprint(cb)  # different files


def test_shared_pieces_add_up_to_the_shared_mlp(tmp_path):
    d, _, t = tiny_checkpoint(str(tmp_path / "q"), "qwen2_moe")
    ck = Checkpoint(d)
    L = model_spec(ck).layer(0)
    x = np.random.default_rng(1).standard_normal((5, H))

    def swiglu(g, u, dn):
        a, b = x @ g.T, x @ u.T
        return (a / (1 + np.exp(-a)) * b) @ dn.T

    p = "model.layers.0.mlp.shared_expert"
    whole = swiglu(t[f"{p}.gate_proj.weight"], t[f"{p}.up_proj.weight"], t[f"{p}.down_proj.weight"])
    pieces = load_experts(ck, L, range(E, L.n_ids))
    assert sorted(pieces) == [E, E + 1] and all(w.d_ff == I for w in pieces.values())
    total = sum(swiglu(w.w_gate, w.w_up, w.w_down) for w in pieces.values())
    np.testing.assert_allclose(total, whole, rtol=1e-6, atol=1e-6)


def test_worker_reads_only_its_experts_shards(tmp_path):
    d, _, t = tiny_checkpoint(str(tmp_path / "m"), "mixtral", shards=24)
    ck = Checkpoint(d)
    L = model_spec(ck).layer(1)
    before = set(ck.mapped_shards)
    ws = load_experts(ck, L, [2])
    wanted = {ck.shard_of(n) for n in L.experts.names(2)}
    assert set(ck.mapped_shards) <= before | wanted
    assert np.array_equal(ws[2].w_down, t[L.experts.down.format(e=2)])
    with pytest.raises(ValueError, match="expert ids 0..3"):
        load_experts(ck, L, [4])


def test_bf16_checkpoint(tmp_path):
    d, _, t = tiny_checkpoint(str(tmp_path / "b"), "deepseek_v3", code="BF16")
    ck = Checkpoint(d)
    L = model_spec(ck).layer(1)
    assert L.dtype == "bfloat16"
    w = load_experts(ck, L, [0])[0]
    assert w.dtype == "bfloat16" and w.w_gate.dtype == np.uint16  # raw bits, not converted
    ref = bf16.to_float32(bf16.from_float32(t[L.experts.gate.format(e=0)]))
    assert np.array_equal(w.float32().w_gate, ref)
    r = load_router(ck, L)
    assert r.weight.dtype == np.float32 and np.array_equal(r.weight, t[L.router])  # the gate stayed float32
    assert r.bias is not None and r.shared_gate is None


def test_router_weights_for_the_gateway(tmp_path):
    d, _, t = tiny_checkpoint(str(tmp_path / "q"), "qwen2_moe", shards=16)
    L = model_spec(Checkpoint(d)).layer(1)
    ck = Checkpoint(d)  # a fresh one: what the gateway maps for the router alone
    r = load_router(ck, L)
    assert np.array_equal(r.weight, t["model.layers.1.mlp.gate.weight"]) and r.bias is None
    assert np.array_equal(r.shared_gate, t["model.layers.1.mlp.shared_expert_gate.weight"])
    assert set(ck.mapped_shards) == {ck.shard_of(L.router), ck.shard_of(L.shared.gate_weight)}


def test_fingerprint_changes_with_the_weights(tmp_path):
    a, _, t = tiny_checkpoint(str(tmp_path / "a"), "mixtral", seed=1)
    base = layer_fingerprint(Checkpoint(a), model_spec(Checkpoint(a)).layer(0))
    assert base == layer_fingerprint(Checkpoint(a), model_spec(Checkpoint(a)).layer(0))  # stable
    assert base != layer_fingerprint(Checkpoint(a), model_spec(Checkpoint(a)).layer(1))  # layer-specific
    cfg = json.load(open(os.path.join(a, "config.json")))
    for name in ("model.layers.0.block_sparse_moe.gate.weight", "model.layers.0.block_sparse_moe.experts.3.w2.weight"):
        t2 = dict(t)
        t2[name] = t[name].copy()
        t2[name][0, 0] += 1.0
        b = write_checkpoint(str(tmp_path / name), cfg, t2)
        assert layer_fingerprint(Checkpoint(b), model_spec(Checkpoint(b)).layer(0)) != base, name
    c, _, _ = tiny_checkpoint(str(tmp_path / "c"), "mixtral", seed=1, num_experts_per_tok=1)
    assert layer_fingerprint(Checkpoint(c), model_spec(Checkpoint(c)).layer(0)) != base  # routing rule
