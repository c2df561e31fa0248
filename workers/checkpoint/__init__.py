"""Hugging Face-format MoE checkpoints, read with numpy alone (it also runs in the rxe
guest): a memory-mapped safetensors reader, the per-layer spec of each supported family
chosen from config.json, loaders for a worker's experts and the gateway's routers, and the
fingerprint both sides compare at handshake.

    ckpt = Checkpoint("/models/Qwen1.5-MoE-A2.7B")
    spec = model_spec(ckpt)                       # ModelSpec: family, MoE layers
    layer = spec.layer(3)                         # LayerSpec: sizes, routing, shared experts
    experts = load_experts(ckpt, layer, [0, 1])   # {id: ExpertWeights} (mapped, not copied)
    router = load_router(ckpt, layer)             # RouterWeights in float32
    fp = layer_fingerprint(ckpt, layer)
"""
from workers.checkpoint.load import (ExpertWeights, RouterWeights, checkpoint_fingerprint, layer_fingerprint,
                                     load_experts, load_router)
from workers.checkpoint.safetensors import SafetensorsError, SafetensorsFile, TensorInfo
from workers.checkpoint.spec import ExpertLayout, LayerSpec, ModelSpec, RoutingSpec, SharedSpec, model_spec
from workers.checkpoint.store import Checkpoint, CheckpointError

__all__ = ["Checkpoint", "CheckpointError", "SafetensorsFile", "SafetensorsError", "TensorInfo", "model_spec",
           "ModelSpec", "LayerSpec", "RoutingSpec", "ExpertLayout", "SharedSpec", "ExpertWeights",
           "RouterWeights", "load_experts", "load_router", "layer_fingerprint", "checkpoint_fingerprint"]
