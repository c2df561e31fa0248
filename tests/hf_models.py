"""Tiny random transformers models of each supported family, built in-process (no download).

Import only after tests.torch_extra.require_torch_extra(): this module imports torch and
transformers at the top.
"""
from __future__ import annotations

import math

import torch
import transformers as tf

H = 32
COMMON = dict(hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, initializer_range=0.1,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
_DS = dict(moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
           first_k_dense_replace=1, num_hidden_layers=3)


def config(family: str, **over) -> "tf.PretrainedConfig":
    c = dict(COMMON)
    if family == "mixtral":
        c.update(num_local_experts=4, num_experts_per_tok=2)
        cls = tf.MixtralConfig
    elif family == "minimax":
        c.update(num_local_experts=4, num_experts_per_tok=2, head_dim=8)
        cls = tf.MiniMaxConfig
    elif family == "qwen2_moe":
        c.update(moe_intermediate_size=16, shared_expert_intermediate_size=48, num_experts=6,
                 num_experts_per_tok=2, norm_topk_prob=False, num_hidden_layers=3, decoder_sparse_step=1,
                 mlp_only_layers=[1])
        cls = tf.Qwen2MoeConfig
    elif family == "qwen3_moe":
        c.update(moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, head_dim=8)
        cls = tf.Qwen3MoeConfig
    elif family == "olmoe":
        c.update(num_experts=6, num_experts_per_tok=3, norm_topk_prob=False)
        cls = tf.OlmoeConfig
    elif family == "flex_olmo":
        c.update(num_experts=5, num_experts_per_tok=2, norm_topk_prob=True)
        cls = tf.FlexOlmoConfig
    elif family == "deepseek_v3":
        c.update(_DS, n_shared_experts=2, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
                 v_head_dim=8, routed_scaling_factor=2.5, norm_topk_prob=True)
        cls = tf.DeepseekV3Config
    elif family == "glm4_moe":
        c.update(_DS, n_shared_experts=1, head_dim=8, routed_scaling_factor=1.5, norm_topk_prob=False)
        cls = tf.Glm4MoeConfig
    elif family == "dots1":
        c.update(_DS, n_shared_experts=1, head_dim=8, routed_scaling_factor=1.0, norm_topk_prob=True)
        cls = tf.Dots1Config
    else:
        raise ValueError(family)
    c.update(over)
    return cls(**c)


FAMILIES = ("mixtral", "minimax", "qwen2_moe", "qwen3_moe", "olmoe", "flex_olmo", "deepseek_v3", "glm4_moe",
            "dots1")


def model(family: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **over) -> "tf.PreTrainedModel":
    """A causal LM with random weights in ``dtype`` (built as transformers builds it, so its
    keep-in-float32 rules apply: DeepSeek's gate stays float32 in a bf16 model); selection
    biases (DeepSeek's e_score_correction_bias, zero at init) made random so that they matter."""
    torch.manual_seed(seed)
    m = tf.AutoModelForCausalLM.from_config(config(family, **over), dtype=dtype)
    with torch.no_grad():
        for name, buf in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.1)
    return m.eval()


def moe_blocks(m: "tf.PreTrainedModel") -> dict[int, torch.nn.Module]:
    """{layer index: the decoder layer's MoE block} (blocks recognised by having a router
    `gate` and `experts`; dense MLP layers skipped)."""
    out = {}
    for i, layer in enumerate(m.model.layers):
        mlp = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
        if hasattr(mlp, "experts") and hasattr(mlp, "gate"):
            out[i] = mlp
    return out


def hidden(T: int, *, seed: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, T, H, generator=g) * math.sqrt(1.0)).to(dtype)
