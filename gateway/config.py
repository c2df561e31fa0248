"""The layer a gateway serves, from its flags: a demo router, or a checkpoint's MoE layers
(routers and fingerprints), with the width and the wire dtype (asking the first worker
what neither the flags nor the checkpoint say)."""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any, Optional

from transport.service.options import UsageError

PROBE_MAX_PEER_SLOT = 1 << 30  # the probe sends one small INFO; the bound only stops an absurd peer


@dataclass
class Layer:
    """What a WorkerPool takes: ``router`` (one, or {layer: router}), ``fingerprints``
    ({layer: fingerprint} of a checkpoint, None for demo weights), and the checkpoint's
    layers themselves (None for demo weights)."""

    router: Any
    fingerprints: Optional[dict]
    layers: Optional[dict]


def parse_floats(text: Any) -> Optional[list]:
    """Comma-separated numbers (an already parsed list passes through)."""
    if text is None or isinstance(text, list):
        return text
    return [float(v) for v in text.split(",") if v.strip()] or None


def make_router(args: argparse.Namespace):
    """The demo layer's router: --d-model, --n-experts, --top-k, noisy top-k, capacity,
    overflow, --seed and --gate-bias."""
    import numpy as np

    from gateway.router import Router

    bias = parse_floats(args.gate_bias)
    if bias is not None and len(bias) != args.n_experts:
        raise UsageError(f"--gate-bias needs {args.n_experts} values (one per expert), got {len(bias)}")
    return Router(args.d_model, args.n_experts, args.top_k, noisy=args.noisy, noise_std=args.noise_std,
                  capacity_factor=args.capacity_factor, overflow=args.overflow, seed=args.seed,
                  bias=None if bias is None else np.asarray(bias, np.float32))


def checkpoint_layers(args: argparse.Namespace) -> dict:
    """{layer: GatewayLayer} of --checkpoint (routers and fingerprints); sets args.d_model."""
    from gateway.layer import load_gateway_layers

    layers = load_gateway_layers(args.checkpoint, args.layers)
    if not layers:
        raise UsageError(f"{args.checkpoint}: no MoE layer to serve")
    specs = [gl.spec for gl in layers.values()]
    if args.d_model is not None and args.d_model != specs[0].d_model:
        raise UsageError(f"--d-model {args.d_model}, but the checkpoint's hidden_size is {specs[0].d_model}: "
                         "drop --d-model")
    args.d_model = specs[0].d_model
    return layers


def probe_layer(url: str, secret: Optional[bytes], timeout: float) -> dict:
    """The first worker's info (d_model, dtype) when the user did not say."""
    import transport
    from transport.service.backoff import Backoff
    from workers import protocol as P

    deadline = time.monotonic() + timeout
    wait = Backoff(0.05, 0.5)
    while True:
        try:
            # the worker's slots are sized for its --max-tokens rows of ITS d_model, which is what
            # we are asking: accept any size here (the default limit is too small for a wide layer)
            conn = transport.connect(url, slot_size=1 << 16, nslots=2, timeout=min(5.0, timeout), secret=secret,
                                     max_peer_slot_size=PROBE_MAX_PEER_SLOT)
            break
        except transport.Refused as e:
            e.peer = url
            raise
        except transport.TransportError as e:
            if time.monotonic() > deadline:
                raise transport.ConnectionClosed(f"worker {url} did not answer within {timeout:g} s: {e}") from None
            time.sleep(wait.next())
    try:
        conn.send(P.request(P.INFO, 0), timeout=5.0)
        while True:
            msg = conn.recv(timeout=5.0)
            h = msg.header
            msg.release()
            if isinstance(h, dict) and h.get("op") == P.INFO:
                return h
    finally:
        conn.close()


def resolve_layer(args: argparse.Namespace, secret: Optional[bytes], urls: Optional[list]) -> Layer:
    """The layer the flags describe; fills args.d_model and args.dtype (from the checkpoint,
    the first of ``urls``' info when neither says, else 256 and float32)."""
    layers = checkpoint_layers(args) if args.checkpoint else None
    # ask the first worker (one extra connection) only what neither the user nor the
    # checkpoint said: the width, and with a checkpoint the workers' wire dtype
    if urls and (args.d_model is None or (layers and args.dtype is None)):
        info = probe_layer(urls[0], secret, args.connect_timeout)
        args.d_model = args.d_model or int(info["d_model"])
        args.dtype = args.dtype or str(info["dtype"])
    args.d_model = args.d_model or 256
    args.dtype = args.dtype or "float32"
    if layers:
        return Layer({L: gl.router for L, gl in layers.items()}, {L: gl.fingerprint for L, gl in layers.items()},
                     layers)
    return Layer(make_router(args), None, None)


def served_ids(args: argparse.Namespace, layers: Optional[dict] = None) -> tuple[int, int, int]:
    """(routed experts, shared pieces, rows per token) the workers a gateway starts must
    host: the demo layer's from the flags, else the checkpoint layers' (the same ids in
    every layer, so one placement serves them all)."""
    from gateway.requests import slots_per_token

    if not layers:
        return args.n_experts, 0, args.top_k
    sizes = {(gl.spec.n_experts, gl.spec.n_shared) for gl in layers.values()}
    if len(sizes) != 1:
        raise UsageError(f"workers a gateway starts host the same ids in every layer; these layers differ in "
                         f"experts (routed, shared pieces): {sorted(sizes)}; start workers yourself (--workers)")
    n_experts, n_shared = sizes.pop()
    return n_experts, n_shared, max(slots_per_token(gl.router) for gl in layers.values())
