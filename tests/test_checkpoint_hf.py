"""What transformers 5's save_pretrained really writes, read by workers.checkpoint: tensor
names and shapes per family, per-expert and fused layouts, shards, bf16."""
import json
import os

import numpy as np
import pytest

from tests.torch_extra import require_torch_extra

torch, transformers = require_torch_extra()

from tests import hf_models as hm  # noqa: E402
from workers.checkpoint import (Checkpoint, checkpoint_fingerprint, layer_fingerprint, load_experts,  # noqa: E402
                                load_router, model_spec)

# What save_pretrained (default: the Hub's original per-expert layout) writes for one MoE
# layer L of each family: the MoE block's prefix and its expert tensor names.
PER_EXPERT = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "minimax": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "olmoe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "flex_olmo": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "glm4_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "dots1": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}
SHARED = {"qwen2_moe": ("shared_expert", True), "deepseek_v3": ("shared_experts", False),
          "glm4_moe": ("shared_experts", False), "dots1": ("shared_experts", False)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache = {}

    def get(family, *, dtype=torch.float32, **save_kw):
        key = (family, dtype, tuple(sorted(save_kw.items())))
        if key not in cache:
            m = hm.model(family, dtype=dtype)
            d = str(tmp_path_factory.mktemp(family))
            m.save_pretrained(d, **save_kw)
            cache[key] = (m, d)
        return cache[key]
    return get


@pytest.mark.parametrize("family", hm.FAMILIES)
def test_names_and_shapes_save_pretrained_writes(saved, family):
    m, d = saved(family)
    ck = Checkpoint(d)
    spec = model_spec(ck)
    blocks = hm.moe_blocks(m)
    assert spec.family == family and spec.moe_layers == sorted(blocks)
    cfg = m.config
    for L, blk in blocks.items():
        ls = spec.layer(L)
        where, (g, u, dn) = PER_EXPERT[family]
        p = f"model.layers.{L}.{where}"
        E, Hd = blk.gate.weight.shape
        I = blk.experts.down_proj.shape[2]  # in memory transformers 5 fuses: down_proj (E, H, I)
        assert blk.experts.gate_up_proj.shape == (E, 2 * I, Hd)
        assert (ls.prefix, ls.n_experts, ls.d_model, ls.d_ff, ls.experts.kind) == (p, E, Hd, I, "per_expert")
        assert ls.routing.top_k == cfg.num_experts_per_tok
        assert ck.info(f"{p}.gate.weight").shape == (E, Hd)
        for e in (0, E - 1):
            assert ck.info(f"{p}.experts.{e}.{g}.weight").shape == (I, Hd)
            assert ck.info(f"{p}.experts.{e}.{u}.weight").shape == (I, Hd)
            assert ck.info(f"{p}.experts.{e}.{dn}.weight").shape == (Hd, I)
        if family in SHARED:
            name, gated = SHARED[family]
            S = ck.info(f"{p}.{name}.gate_proj.weight").shape[0]
            assert ck.info(f"{p}.{name}.down_proj.weight").shape == (Hd, S)
            assert (f"{p}.shared_expert_gate.weight" in ck) == gated
            assert ls.shared is not None and ls.shared.d_ff == S and ls.n_shared == S // I
        else:
            assert ls.shared is None
        if ls.routing.scoring == "sigmoid":
            assert ck.info(f"{p}.gate.e_score_correction_bias").shape == (E,)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_fused_sharded_checkpoint_as_transformers_writes_it(saved, family):
    """save_original_format=False writes transformers 5's in-memory layout: experts.gate_up_proj
    (E, 2*I, H), gate rows first, and experts.down_proj (E, H, I), under `mlp` for every
    family (Mixtral included); max_shard_size splits it with an index."""
    m, per = saved(family)
    _, fused = saved(family, save_original_format=False, max_shard_size="40KB")
    assert os.path.exists(os.path.join(fused, "model.safetensors.index.json"))
    ca, cb = Checkpoint(per), Checkpoint(fused)
    assert len(cb.shards) > 2
    for L, blk in hm.moe_blocks(m).items():
        sa, sb = model_spec(ca).layer(L), model_spec(cb).layer(L)
        assert sb.experts.kind == "fused" and sb.experts.gate == f"model.layers.{L}.mlp.experts.gate_up_proj"
        E, I = sb.n_experts, sb.d_ff
        assert cb.info(sb.experts.gate).shape == (E, 2 * I, sb.d_model)
        assert cb.info(sb.experts.down).shape == (E, sb.d_model, I)
        wa, wb = load_experts(ca, sa, range(sa.n_ids)), load_experts(cb, sb, range(sb.n_ids))
        for e in range(sa.n_ids):
            for k in ("w_gate", "w_up", "w_down"):
                assert np.array_equal(getattr(wa[e], k), getattr(wb[e], k))
        # and both are the module's own parameters
        gu = blk.experts.gate_up_proj.detach()[1].numpy()
        assert np.array_equal(wb[1].w_gate, gu[:I]) and np.array_equal(wb[1].w_up, gu[I:])
        assert np.array_equal(wa[1].w_down, blk.experts.down_proj.detach()[1].numpy())
        assert layer_fingerprint(ca, sa) == layer_fingerprint(cb, sb)
    assert checkpoint_fingerprint(ca) != checkpoint_fingerprint(cb)


def test_transformers_reloads_the_fused_layout(saved):
    m, fused = saved("mixtral", save_original_format=False, max_shard_size="40KB")
    m2 = transformers.AutoModelForCausalLM.from_pretrained(fused)
    for (k, a), (k2, b) in zip(sorted(m.state_dict().items()), sorted(m2.state_dict().items())):
        assert k == k2 and torch.equal(a, b)


def test_bf16_checkpoint_keeps_deepseek_gate_in_float32(saved):
    m, d = saved("deepseek_v3", dtype=torch.bfloat16)
    ck = Checkpoint(d)
    ls = model_spec(ck).layer(1)
    assert ls.dtype == "bfloat16"
    assert ck.info(ls.router).dtype == "F32" and ck.info(ls.routing.bias).dtype == "F32"
    w = load_experts(ck, ls, [3])[3]
    assert w.w_gate.dtype == np.uint16
    want = m.model.layers[1].mlp.experts.gate_up_proj.detach()[3, :ls.d_ff].view(torch.int16).numpy()
    assert np.array_equal(w.w_gate, want.view(np.uint16))  # the stored bits, untouched
    r = load_router(ck, ls)
    assert np.array_equal(r.weight, m.model.layers[1].mlp.gate.weight.detach().numpy())


def test_config_written_by_transformers_drives_the_spec(saved):
    m, d = saved("qwen2_moe")
    cfg = json.load(open(os.path.join(d, "config.json")))
    assert cfg["mlp_only_layers"] == [1] and cfg["norm_topk_prob"] is False
    spec = model_spec(Checkpoint(d))
    assert spec.moe_layers == [0, 2] and not spec.layer(0).routing.renormalize
