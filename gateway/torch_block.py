"""A drop-in PyTorch module: every sparse MoE block of a transformers model served remotely.

    from gateway.torch_block import replace_moe_blocks
    replace_moe_blocks(model, "tcp://127.0.0.1:7000")   # a moe-gateway serving the checkpoint
    model.generate(...)                       # every MoE layer now goes to the gateway
    replace_moe_blocks(model, client)        # or any LayerClient (see below)

Blocks are found by what they are, not where they sit: an instance of one of
transformers' MoE block classes of a supported family (`MOE_BLOCK_CLASSES`), wherever the
model keeps it (``mlp`` in transformers 5, ``block_sparse_moe`` in older Mixtral code,
anything else in another model). A module that looks like a MoE block (a ``gate`` and
``experts`` child) but is of another class is refused, not left silently local. The layer
index sent with each request is the block's position in the model's decoder-layer
``ModuleList``, which is the ``L`` of the checkpoint's ``model.layers.L.*`` tensors.

Zero copy both ways: the hidden states go to the client as a numpy array over the
tensor's own memory (a view; bf16 as its uint16 bits or ml_dtypes.bfloat16), and the
block returns a tensor made over the reply's memory (``torch.from_numpy``), not a copy.
The reply is released when the last tensor viewing it is gone (``weakref.finalize`` on the
array the tensor was made from: torch holds that array until the tensor's storage dies).

Output signature: in transformers 5 the MoE blocks of every supported family return the
hidden states alone (router logits are not returned by the block: the models record them
with an output hook on the router submodule, for ``output_router_logits=True``), so the
replacement returns a tensor of the input's shape and dtype, like the block it replaces.
A remote block has no router submodule, so ``output_router_logits=True`` is refused with
an error rather than returning an auxiliary loss computed without the MoE layers.

Inference only: the remote layer is not differentiable (a tensor that requires grad is
refused).
"""
from __future__ import annotations

import importlib
import os
import threading
import warnings
import weakref
from typing import Any, Callable, Iterable, Mapping, Protocol

import numpy as np

from gateway.reference import CheckpointMoE
from workers import bf16
from workers.checkpoint import Checkpoint, model_spec

try:
    import torch
except ImportError:
    raise ImportError("gateway.torch_block needs PyTorch and transformers: pip install 'moe-transport[torch]'"
                      ) from None

__all__ = ["LayerClient", "RemoteMoEBlock", "replace_moe_blocks", "find_moe_blocks", "InProcessLayerClient",
           "MOE_BLOCK_CLASSES"]

# family -> (module, class) of its sparse MoE block in transformers 5
MOE_BLOCK_CLASSES: dict[str, tuple[str, str]] = {
    "mixtral": ("transformers.models.mixtral.modeling_mixtral", "MixtralSparseMoeBlock"),
    "minimax": ("transformers.models.minimax.modeling_minimax", "MiniMaxSparseMoeBlock"),
    "qwen2_moe": ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock"),
    "qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    "olmoe": ("transformers.models.olmoe.modeling_olmoe", "OlmoeSparseMoeBlock"),
    "flex_olmo": ("transformers.models.flex_olmo.modeling_flex_olmo", "FlexOlmoSparseMoeBlock"),
    "deepseek_v3": ("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE"),
    "glm4_moe": ("transformers.models.glm4_moe.modeling_glm4_moe", "Glm4MoeMoE"),
    "dots1": ("transformers.models.dots1.modeling_dots1", "Dots1MoE"),
}


class LayerClient(Protocol):
    """What a remote block needs from the network: one call per block forward.

    ``send(layer, hidden)``: ``hidden`` is (T, d_model), float32/float16 or bf16 (uint16 bits
    or ml_dtypes.bfloat16), a view of the caller's tensor, valid only during the call (copy
    it into a send slot, do not keep it). Returns ``(reply, release)``: the layer's output,
    (T, d_model) in hidden's dtype, viewing the reply message's memory, and the callable
    that gives that memory back. ``release`` is called from a finalizer (during garbage
    collection, on whatever thread drops the last tensor): it must only mark the reply as
    done and free it later (e.g. at the client's next call), never block or raise.
    """

    def send(self, layer: int, hidden: np.ndarray) -> tuple[np.ndarray, Callable[[], None]]: ...


def _block_classes() -> dict[type, str]:
    """The MoE block classes of the installed transformers (families it lacks are skipped)."""
    out = {}
    for fam, (mod, cls) in MOE_BLOCK_CLASSES.items():
        try:
            out[getattr(importlib.import_module(mod), cls)] = fam
        except (ImportError, AttributeError):
            continue
    return out


def _looks_like_moe_block(m: Any) -> bool:
    """A structural test for blocks of classes we do not know: a router ``gate`` with a 2-D
    weight and an ``experts`` child."""
    gate, experts = getattr(m, "gate", None), getattr(m, "experts", None)
    w = getattr(gate, "weight", None)
    return experts is not None and w is not None and getattr(w, "ndim", 0) == 2


def find_moe_blocks(model: Any, *, strict: bool = True) -> list[tuple[Any, str, Any, int, str]]:
    """Every MoE block of ``model`` as (parent, attribute, block, layer index, family).

    With ``strict``, a module that looks like a MoE block but is of an unsupported class
    raises ValueError (serving the rest remotely and it locally would be a half-remote model).
    """
    classes = _block_classes()
    layer_of: dict[int, int] = {}
    for ml in model.modules():
        if isinstance(ml, torch.nn.ModuleList):
            for i, child in enumerate(ml):
                for sub in child.modules():
                    layer_of[id(sub)] = i  # inner lists come later in modules(): innermost wins
    found, unknown = [], []
    for pname, parent in model.named_modules():
        for attr, child in parent.named_children():
            fam = next((f for c, f in classes.items() if isinstance(child, c)), None)
            if fam is None:
                if _looks_like_moe_block(child):
                    unknown.append(f"{pname + '.' if pname else ''}{attr} ({type(child).__name__})")
                continue
            if id(child) not in layer_of:
                raise ValueError(f"MoE block {pname}.{attr} is not inside a ModuleList of layers: "
                                 f"no layer index to serve it by")
            found.append((parent, attr, child, layer_of[id(child)], fam))
    if strict and unknown:
        raise ValueError(f"MoE blocks of unsupported classes: {', '.join(unknown)}; supported: "
                         f"{', '.join(c for _, c in MOE_BLOCK_CLASSES.values())}")
    return found


def _numpy_view(h: "torch.Tensor") -> np.ndarray:
    """A numpy array over the tensor's memory (no copy)."""
    if h.dtype == torch.bfloat16:
        return h.view(torch.int16).numpy().view(bf16.wire_dtype("bfloat16"))
    if h.dtype in (torch.float32, torch.float16):
        return h.numpy()
    raise TypeError(f"remote MoE blocks carry float32, float16 or bfloat16 activations, not {h.dtype}")


def _tensor_over(reply: np.ndarray, release: Callable[[], None], dtype: "torch.dtype") -> "torch.Tensor":
    """A tensor over the reply's memory; ``release`` runs when its storage is freed."""
    is_bf = dtype == torch.bfloat16
    arr = reply.view(np.uint16) if is_bf else reply.view()  # a fresh ndarray object for the finalizer
    if arr.flags.writeable:
        t = torch.from_numpy(arr)
    else:
        with warnings.catch_warnings():  # a received buffer may be read-only; nothing writes to it here
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(arr)
    weakref.finalize(arr, release)  # torch holds arr until the last view of its storage is gone
    return t.view(torch.bfloat16) if is_bf else t


class RemoteMoEBlock(torch.nn.Module):
    """Stands in for one sparse MoE block: sends its hidden states to a LayerClient and
    returns a tensor over the reply (same shape and dtype as its input)."""

    def __init__(self, client: LayerClient, layer: int, *, family: str, d_model: int, replaces: str = "") -> None:
        super().__init__()
        self.client, self.layer, self.family, self.d_model = client, int(layer), family, int(d_model)
        self.replaces = replaces

    def extra_repr(self) -> str:
        return f"layer={self.layer}, family={self.family}, d_model={self.d_model}, replaces={self.replaces}"

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.requires_grad and torch.is_grad_enabled():
            raise RuntimeError("remote MoE blocks are inference-only: run under torch.no_grad()")
        if hidden_states.device.type != "cpu":
            raise RuntimeError(f"remote MoE blocks take CPU tensors, got {hidden_states.device}")
        shape = hidden_states.shape
        if shape[-1] != self.d_model:
            raise ValueError(f"layer {self.layer}: hidden size {shape[-1]}, expected {self.d_model}")
        flat = hidden_states.detach().reshape(-1, self.d_model)
        if not flat.is_contiguous():
            flat = flat.contiguous()  # only for a strided input: the one copy this path may make
        x = _numpy_view(flat)
        reply, release = self.client.send(self.layer, x)
        if reply.shape != x.shape or bf16.dtype_name(reply.dtype) != bf16.dtype_name(x.dtype):
            release()
            raise RuntimeError(f"layer {self.layer}: reply is {bf16.dtype_name(reply.dtype)} {reply.shape}, "
                               f"sent {bf16.dtype_name(x.dtype)} {x.shape}")
        return _tensor_over(reply, release, flat.dtype).view(shape)


def replace_moe_blocks(model: Any, gateway: "str | LayerClient", *, strict: bool = True, **client_opts: Any
                       ) -> dict[int, Any]:
    """Replace every sparse MoE block of a transformers ``model`` in place by a
    RemoteMoEBlock sending to ``gateway``: a gateway URL (a gateway.client.GatewayClient is
    connected, with ``client_opts`` such as timeout or secret_file; it is ``model.moe_client``,
    close it when done), or any LayerClient. Returns {layer index: new module}."""
    client = _connect(gateway, **client_opts) if isinstance(gateway, str) else gateway
    if client_opts and not isinstance(gateway, str):
        raise TypeError(f"client options {sorted(client_opts)} need a gateway URL, not a client")
    d_model = int(getattr(getattr(model, "config", None), "hidden_size", 0) or 0)
    out = {}
    for parent, attr, block, layer, fam in find_moe_blocks(model, strict=strict):
        d = d_model or int(block.gate.weight.shape[1])
        new = RemoteMoEBlock(client, layer, family=fam, d_model=d, replaces=type(block).__name__)
        setattr(parent, attr, new)
        out[layer] = new
    if not out:
        if isinstance(gateway, str):
            client.close()
        raise ValueError(f"no sparse MoE block of a supported family in {type(model).__name__}")
    if isinstance(gateway, str):
        model.moe_client = client
    _guard_router_logits(model)
    return out


def _guard_router_logits(model: Any) -> None:
    """Refuse ``output_router_logits=True`` at call time: transformers would otherwise
    compute an auxiliary loss from no router at all, silently."""
    def pre_hook(module: Any, args: Any, kwargs: dict) -> None:
        want = kwargs.get("output_router_logits")
        if want is None:
            want = getattr(getattr(module, "config", None), "output_router_logits", False)
        if want:
            raise ValueError("output_router_logits=True: the MoE blocks are remote, they have no router "
                             "submodule to record router logits from")
    if not getattr(model, "_moe_remote_guard", False):
        model.register_forward_pre_hook(pre_hook, with_kwargs=True)
        model._moe_remote_guard = True


def _connect(url: str, **opts: Any) -> LayerClient:
    """A GatewayClient (its ``send`` is the LayerClient protocol: zero copy both ways)."""
    from gateway.client import GatewayClient

    return GatewayClient(url, **opts)


class InProcessLayerClient:
    """A LayerClient that runs the layers in process (gateway.reference.CheckpointMoE):
    the stand-in for the network in tests, and a local check of a checkpoint.

    Replies live in their own buffers until released, as transport replies do; ``release``
    only queues them (it may run in a finalizer) and the next ``send`` frees them."""

    def __init__(self, layers: Mapping[int, CheckpointMoE]) -> None:
        self.layers = dict(layers)
        self._lock = threading.Lock()
        self._live: dict[int, np.ndarray] = {}
        self._done: list[int] = []  # released, to free at the next call (appended from finalizers)
        self._next = 0
        self.sent = 0

    @classmethod
    def from_checkpoint(cls, checkpoint: str | os.PathLike | Checkpoint, layers: Iterable[int] | None = None, *,
                        kernel: str = "numpy", dtype: object = "float32") -> "InProcessLayerClient":
        ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
        ids = model_spec(ckpt).moe_layers if layers is None else layers
        return cls({L: CheckpointMoE.from_checkpoint(ckpt, L, kernel=kernel, dtype=dtype) for L in ids})

    @property
    def outstanding(self) -> int:
        """Replies sent and not yet freed (released-but-queued ones count until the next send)."""
        with self._lock:
            return len(self._live)

    def free_released(self) -> None:
        """Free the replies released since the last call (send and close call it)."""
        with self._lock:
            while self._done:
                self._live.pop(self._done.pop(), None)

    def send(self, layer: int, hidden: np.ndarray) -> tuple[np.ndarray, Callable[[], None]]:
        self.free_released()
        if layer not in self.layers:
            raise KeyError(f"layer {layer} is not served here; layers: {sorted(self.layers)}")
        y, _ = self.layers[layer].forward(hidden)
        with self._lock:
            rid = self._next
            self._next += 1
            self._live[rid] = y
            self.sent += 1
        done = self._done

        def release() -> None:
            done.append(rid)  # list.append is atomic (GIL): safe from a finalizer on any thread

        return y, release

    def close(self) -> None:
        self.free_released()
