"""The gateway's side of a checkpoint's MoE layers: each layer's router and identity.

    layers = load_gateway_layers("/models/DeepSeek-V3-tiny", [3, 4])
    routing = layers[3].router.route(x)      # Routing with k routed + shared slots
    layers[3].fingerprint                     # compared with every worker's at handshake

The gateway loads only the router tensors (gate, selection bias, shared expert gate); the
experts, shared ones included, are the workers'. (The fingerprint reads the first and last
few hundred bytes of each expert matrix: a couple of pages per expert, not its weights.)

Design note: where shared experts run
-------------------------------------
Qwen2-MoE's ``shared_expert`` (times sigmoid(``shared_expert_gate`` x)) and DeepSeek's
``shared_experts`` (times 1) are computed for every token. They run on the workers, as
extra expert ids ``n_experts .. n_experts + pieces - 1`` that every token is routed to,
not on the gateway:

- the gateway's route, gather and combine must stay a small share of a round (< 10% with
  fast bf16 compute); a shared MLP is one to several routed experts' worth of FLOPs for
  every token (DeepSeek-V3: as much as one routed expert, Qwen1.5-MoE: four), so on the
  gateway it would be the longest stage of every round, serialised with routing, and the
  gateway would need its own compute kernel and weights;
- as expert ids they reuse what workers already do: kernels (bf16 on the matrix units),
  reply slots, replicas over workers with load-aware splitting, hot update, metrics;
- a shared MLP wider than the routed experts is cut into routed-width pieces (a SwiGLU
  splits exactly along its hidden dimension), so its work spreads over workers like any
  expert's and every kernel of a layer has one shape;
- the gateway's cost is one more column per piece in the routing and the combine (the
  weight: 1, or the sigmoid of one dot product per token), and the dispatch plan needs no
  change: a shared piece is an expert every token picks.

The price: a shared piece is the hottest expert by construction (T rows per round), so
placement should give shared pieces their own replicas; and their output travels back
over the transport like any expert's.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable

from gateway.router import FamilyRouter, RoutingRule
from workers.checkpoint import (Checkpoint, LayerSpec, RoutingSpec, layer_fingerprint, load_router,
                                model_spec)

__all__ = ["routing_rule", "load_layer_router", "GatewayLayer", "load_gateway_layers"]


def routing_rule(r: RoutingSpec) -> RoutingRule:
    """The router's rule for a checkpoint layer's routing spec."""
    return RoutingRule(scoring=r.scoring, renormalize=r.renormalize, scale=r.scale, n_group=r.n_group,
                       topk_group=r.topk_group, logits_in_activation_dtype=r.logits_in_model_dtype,
                       weights_in_activation_dtype=r.weights_in_model_dtype)


def load_layer_router(ckpt: Checkpoint, spec: LayerSpec) -> FamilyRouter:
    """The layer's router, its shared experts as extra expert ids (reads router tensors only)."""
    w = load_router(ckpt, spec)
    return FamilyRouter(w.weight, spec.routing.top_k, routing_rule(spec.routing), bias=w.bias,
                        n_shared=spec.n_shared, shared_gate=w.shared_gate)


@dataclass(frozen=True)
class GatewayLayer:
    spec: LayerSpec
    router: FamilyRouter
    fingerprint: str


def load_gateway_layers(checkpoint: str | os.PathLike | Checkpoint, layers: Iterable[int] | None = None
                        ) -> dict[int, GatewayLayer]:
    """Router and fingerprint of each listed MoE layer (all of them when None)."""
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
    ms = model_spec(ckpt)
    out = {}
    for L in (ms.moe_layers if layers is None else layers):
        spec = ms.layer(int(L))
        out[spec.layer] = GatewayLayer(spec, load_layer_router(ckpt, spec), layer_fingerprint(ckpt, spec))
    return out
