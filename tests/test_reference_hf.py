"""gateway.reference.CheckpointMoE equals transformers' own sparse MoE block, per family:
the block's output for random hidden states vs our layer loaded from save_pretrained's
checkpoint (fp32: max error <= 1e-5 of the output's largest magnitude; bf16: <= 2e-2)."""
import numpy as np
import pytest

from tests.torch_extra import require_torch_extra

torch, transformers = require_torch_extra()

import ml_dtypes  # noqa: E402

from gateway.reference import CheckpointMoE  # noqa: E402
from tests import hf_models as hm  # noqa: E402
from workers.checkpoint import Checkpoint  # noqa: E402

torch.set_num_threads(1)


def block_output(blk, x):
    with torch.no_grad():
        y = blk(x)
    assert isinstance(y, torch.Tensor)  # transformers 5 blocks return the hidden states alone
    return y[0].float().numpy()


def tie_tokens(blk, x, k):
    """Tokens whose k-th and (k+1)-th gate logits tie exactly (bf16): the model's choice
    there is torch.topk's unspecified order, so they are not compared."""
    with torch.no_grad():
        logits = blk.gate(x[0])[0].float().numpy()
    s = -np.sort(-logits, axis=1)
    return s[:, k - 1] == s[:, k] if k < s.shape[1] else np.zeros(len(s), bool)


def compare(m, d, *, kernel, dtype, T=64):
    """Max error / max |output| over every MoE layer of the model, tie tokens excluded."""
    ck = Checkpoint(d)
    worst = 0.0
    tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    for L, blk in hm.moe_blocks(m).items():
        x = hm.hidden(T, seed=10 + L, dtype=tdt)
        y = block_output(blk, x)
        ref = CheckpointMoE.from_checkpoint(ck, L, kernel=kernel, dtype=dtype if kernel == "torch" else "float32")
        xn = x[0].float().numpy()
        if dtype == "bfloat16":
            xn = xn.astype(ml_dtypes.bfloat16)
        out, routing = ref.forward(xn)
        assert out.dtype == xn.dtype and out.shape == xn.shape
        keep = ~tie_tokens(blk, x, ref.router.top_k)
        assert keep.mean() > 0.9
        worst = max(worst, np.abs(out.astype(np.float32)[keep] - y[keep]).max() / np.abs(y).max())
    return worst


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache = {}

    def get(family, dtype="float32", **save_kw):
        key = (family, dtype, tuple(sorted(save_kw.items())))
        if key not in cache:
            m = hm.model(family, dtype=getattr(torch, dtype))
            d = str(tmp_path_factory.mktemp(family))
            m.save_pretrained(d, **save_kw)
            cache[key] = (m, d)
        return cache[key]
    return get


@pytest.mark.parametrize("family", hm.FAMILIES)
def test_numpy_fp32_equals_transformers(saved, family):
    m, d = saved(family)
    assert compare(m, d, kernel="numpy", dtype="float32") <= 1e-5


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"])
def test_torch_fp32_equals_transformers(saved, family):
    m, d = saved(family)
    assert compare(m, d, kernel="torch", dtype="float32") <= 1e-5


@pytest.mark.parametrize("family", hm.FAMILIES)
def test_torch_bf16_equals_transformers_bf16(saved, family):
    m, d = saved(family, "bfloat16")
    assert compare(m, d, kernel="torch", dtype="bfloat16") <= 2e-2


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_numpy_kernel_on_a_bf16_model(saved, family):
    """bf16 weights and activations, computed in float32 by the numpy kernel (the guest's path)."""
    m, d = saved(family, "bfloat16")
    assert compare(m, d, kernel="numpy", dtype="bfloat16") <= 2e-2


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_fused_multi_shard_checkpoint(saved, family):
    """transformers 5's fused 3-D layout (save_original_format=False), in several shards
    with model.safetensors.index.json."""
    m, d = saved(family, save_original_format=False, max_shard_size="40KB")
    assert len(Checkpoint(d).shards) > 2 and Checkpoint(d).info(
        f"model.layers.{max(hm.moe_blocks(m))}.mlp.experts.gate_up_proj").shape[0] > 1
    assert compare(m, d, kernel="numpy", dtype="float32") <= 1e-5


def test_per_expert_multi_shard_checkpoint(saved):
    m, d = saved("qwen3_moe", max_shard_size="30KB")
    assert len(Checkpoint(d).shards) > 2
    assert compare(m, d, kernel="numpy", dtype="float32") <= 1e-5


def test_a_wrong_layer_is_caught(saved):
    """The comparison can fail: layer 1's experts with layer 0's input are far off."""
    m, d = saved("mixtral")
    blk = hm.moe_blocks(m)[0]
    x = hm.hidden(32, seed=3)
    y = block_output(blk, x)
    out, _ = CheckpointMoE.from_checkpoint(d, 1).forward(x[0].numpy())
    assert np.abs(out - y).max() / np.abs(y).max() > 0.05
