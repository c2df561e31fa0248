"""Tiny checkpoints for tests, written with numpy alone (so the checkpoint tests also run
in the rxe guest, where neither torch nor safetensors is installed).

``write_safetensors`` writes the format by hand: u64 header length, JSON header, bytes.
``tiny_checkpoint`` builds a random MoE checkpoint directory in one of the supported
families' tensor layouts, per-expert or fused, in one file or sharded with an index.
"""
from __future__ import annotations

import json
import os
from typing import Mapping

import numpy as np

from workers import bf16

def write_safetensors(path: str, tensors: Mapping[str, tuple[str, np.ndarray]], metadata: dict | None = None
                      ) -> None:
    """tensors: name -> (code, array), the array cast to the code's dtype (for "BF16": rounded
    from float32)."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    blobs, off = [], 0
    for name, (code, a) in tensors.items():
        if code == "BF16":
            data = bf16.from_float32(np.ascontiguousarray(a, np.float32)).tobytes()
        else:
            dt = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I64": "<i8", "U8": "u1"}[code]
            data = np.ascontiguousarray(a, dtype=dt).tobytes()
        header[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)  # the reference writer pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for b in blobs:
            f.write(b)


def write_checkpoint(d: str, config: dict, tensors: Mapping[str, np.ndarray], *, code: str = "F32",
                     shards: int = 1, keep_f32: tuple[str, ...] = ()) -> str:
    """A checkpoint directory: config.json and the tensors in ``shards`` files (with a
    model.safetensors.index.json when more than one). Tensors whose name ends with one of
    ``keep_f32`` stay float32 whatever ``code`` is (as DeepSeek's gate does)."""
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    names = list(tensors)
    groups = [names[i::shards] for i in range(shards)]
    wm = {}
    for i, g in enumerate(groups):
        fname = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(os.path.join(d, fname),
                          {n: ("F32" if n.endswith(keep_f32) else code, tensors[n]) for n in g})
        wm.update({n: fname for n in g})
    if shards > 1:
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": wm}, f)
    return d


# -- tiny random MoE checkpoints in each family's layout ----------------------------------

H, I, E, K = 16, 8, 4, 2


def family_config(family: str, *, n_layers: int = 2, **over) -> dict:
    base = {"hidden_size": H, "num_hidden_layers": n_layers, "num_experts_per_tok": K, "hidden_act": "silu"}
    if family == "mixtral":
        cfg = {"model_type": "mixtral", "num_local_experts": E, "intermediate_size": I}
    elif family == "qwen2_moe":
        cfg = {"model_type": "qwen2_moe", "num_experts": E, "moe_intermediate_size": I,
               "shared_expert_intermediate_size": 2 * I, "norm_topk_prob": False, "decoder_sparse_step": 1,
               "mlp_only_layers": []}
    elif family == "deepseek_v3":
        cfg = {"model_type": "deepseek_v3", "n_routed_experts": E, "moe_intermediate_size": I, "n_group": 2,
               "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
               "routed_scaling_factor": 2.5}
    else:
        raise ValueError(family)
    return {**base, **cfg, **over}


def family_tensors(family: str, cfg: dict, *, fused: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def r(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": r(10, H)}
    n_e = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    for L in range(cfg["num_hidden_layers"]):
        moe = family != "deepseek_v3" or (L >= cfg["first_k_dense_replace"] and L % cfg.get("moe_layer_freq", 1) == 0)
        if family == "qwen2_moe" and L in cfg.get("mlp_only_layers", []):
            moe = False
        p = f"model.layers.{L}.{'block_sparse_moe' if family == 'mixtral' and not fused else 'mlp'}"
        t[f"model.layers.{L}.input_layernorm.weight"] = np.ones(H, np.float32)
        if not moe:
            for n, s in (("gate_proj", (4 * I, H)), ("up_proj", (4 * I, H)), ("down_proj", (H, 4 * I))):
                t[f"{p}.{n}.weight"] = r(*s)
            continue
        t[f"{p}.gate.weight"] = r(n_e, H)
        g, u, d = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        ws = [(r(I, H), r(I, H), r(H, I)) for _ in range(n_e)]
        if fused:
            t[f"{p}.experts.gate_up_proj"] = np.stack([np.concatenate([a, b]) for a, b, _ in ws])
            t[f"{p}.experts.down_proj"] = np.stack([c for _, _, c in ws])
        else:
            for e, (a, b, c) in enumerate(ws):
                t[f"{p}.experts.{e}.{g}.weight"], t[f"{p}.experts.{e}.{u}.weight"] = a, b
                t[f"{p}.experts.{e}.{d}.weight"] = c
        if family == "qwen2_moe":
            S = cfg["shared_expert_intermediate_size"]
            t[f"{p}.shared_expert.gate_proj.weight"], t[f"{p}.shared_expert.up_proj.weight"] = r(S, H), r(S, H)
            t[f"{p}.shared_expert.down_proj.weight"] = r(H, S)
            t[f"{p}.shared_expert_gate.weight"] = r(1, H)
        if family == "deepseek_v3":
            S = cfg["n_shared_experts"] * I
            t[f"{p}.gate.e_score_correction_bias"] = (rng.standard_normal(n_e) * 0.1).astype(np.float32)
            t[f"{p}.shared_experts.gate_proj.weight"], t[f"{p}.shared_experts.up_proj.weight"] = r(S, H), r(S, H)
            t[f"{p}.shared_experts.down_proj.weight"] = r(H, S)
    return t


def tiny_checkpoint(d: str, family: str, *, fused: bool = False, shards: int = 1, code: str = "F32",
                    seed: int = 0, **cfg_over) -> tuple[str, dict, dict[str, np.ndarray]]:
    cfg = family_config(family, **cfg_over)
    t = family_tensors(family, cfg, fused=fused, seed=seed)
    # DeepSeek keeps its gate in float32 whatever the model's dtype (transformers does too)
    keep = (".gate.weight", "e_score_correction_bias") if family == "deepseek_v3" else ()
    write_checkpoint(d, cfg, t, code=code, shards=shards, keep_f32=keep)
    return d, cfg, t
