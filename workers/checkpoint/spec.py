"""What a checkpoint's MoE layers are: the per-layer spec, chosen from config.json.

The family is chosen from ``config.json`` (``model_type`` and its fields), never from the
directory name; the tensor layout of each layer is read from the tensor names and shapes,
which are authoritative (a config value that disagrees with a tensor shape is an error).

Families, as transformers 5 computes them (checked against its modules in the tests):

- mixtral, minimax: softmax top-k, always renormalised; no shared expert; every layer.
- qwen2_moe: softmax top-k, renormalised iff ``norm_topk_prob``; ``shared_expert`` times
  sigmoid(``shared_expert_gate`` x); MoE layers: (L+1) % ``decoder_sparse_step`` == 0 and
  L not in ``mlp_only_layers``.
- qwen3_moe: as qwen2_moe without a shared expert.
- olmoe, flex_olmo: as qwen3_moe, every layer.
- deepseek_v3, glm4_moe, dots1: sigmoid scores; ``e_score_correction_bias`` added for the
  selection only; selection limited to the ``topk_group`` best of ``n_group`` groups (a
  group's score: the sum of its two best biased scores); weights from the unbiased
  scores, divided by (their sum + 1e-20) iff ``norm_topk_prob``, times
  ``routed_scaling_factor``; ``shared_experts`` (width n_shared_experts x
  moe_intermediate_size) with weight 1; MoE layers: L >= ``first_k_dense_replace`` (and
  L % ``moe_layer_freq`` == 0 where the config has it, as DeepSeek's own code reads it).

Another ``model_type`` is served when its tensors have one of these layouts and its config
says which rule applies: ``scoring_func: "sigmoid"`` (or an ``e_score_correction_bias``
tensor) selects the sigmoid rule, otherwise softmax with an explicit ``norm_topk_prob``;
without one of these the checkpoint is refused (guessing a routing rule would serve a
different model silently).

Tensor layouts (``P`` = ``model.layers.L.mlp``, or ``model.layers.L.block_sparse_moe`` in
Mixtral/MiniMax checkpoints; both are accepted for every family):

- router ``P.gate.weight`` (E, d_model); ``P.gate.e_score_correction_bias`` (E,)
- per-expert (the Hub's layout, what ``save_pretrained`` writes by default):
  ``P.experts.{e}.w1/w3/w2.weight`` (Mixtral) or ``P.experts.{e}.gate_proj/up_proj/
  down_proj.weight``: gate and up (d_ff, d_model), down (d_model, d_ff)
- fused (transformers 5's in-memory layout; ``save_pretrained(save_original_format=False)``):
  ``P.experts.gate_up_proj`` (E, 2*d_ff, d_model), gate rows first, and
  ``P.experts.down_proj`` (E, d_model, d_ff)
- shared: ``P.shared_expert.{gate,up,down}_proj.weight`` + ``P.shared_expert_gate.weight``
  (1, d_model), or ``P.shared_experts.{gate,up,down}_proj.weight``

Shared experts become extra expert ids ``n_experts .. n_experts + pieces - 1``: a shared
MLP of width S is cut into ``S // d_ff`` pieces of the routed experts' width when d_ff
divides S (a SwiGLU splits exactly along its hidden dimension), else one piece of width S.
Why they run on the workers is in ``gateway/layer.py``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from workers.checkpoint.store import Checkpoint, CheckpointError

__all__ = ["RoutingSpec", "ExpertLayout", "SharedSpec", "LayerSpec", "ModelSpec", "model_spec",
           "FAMILIES"]

ACTIVATIONS = {"silu": "silu", "swish": "silu"}


@dataclass(frozen=True)
class RoutingSpec:
    """How a layer picks experts and weighs them (plain values; the gateway's router
    turns them into its rule)."""

    scoring: str  # "softmax" | "sigmoid"
    top_k: int
    renormalize: bool
    scale: float = 1.0  # routed_scaling_factor
    n_group: int = 1
    topk_group: int = 1
    bias: str | None = None  # tensor name of the selection-only score bias
    # transformers computes the gate logits in the model's dtype for softmax families
    # (F.linear in bf16) but in float32 for the sigmoid ones; some cast the top-k weights
    # back to the model's dtype. With bf16 activations the gateway rounds alike.
    logits_in_model_dtype: bool = False
    weights_in_model_dtype: bool = False


@dataclass(frozen=True)
class ExpertLayout:
    """Names of the routed experts' tensors. ``per_expert``: templates with ``{e}``;
    ``fused``: gate_up (E, 2*d_ff, d_model) and down (E, d_model, d_ff)."""

    kind: str  # "per_expert" | "fused"
    gate: str
    up: str | None
    down: str

    def names(self, e: int) -> list[str]:
        if self.kind == "fused":
            return [self.gate, self.down]
        return [self.gate.format(e=e), str(self.up).format(e=e), self.down.format(e=e)]


@dataclass(frozen=True)
class SharedSpec:
    """The always-on shared MLP of a layer and how it is cut into expert-sized pieces."""

    gate: str
    up: str
    down: str
    d_ff: int  # total width S
    pieces: int  # ids n_experts .. n_experts + pieces - 1, each of width S // pieces
    gate_weight: str | None  # Qwen2's shared_expert_gate.weight: weight sigmoid(g x); None: 1

    @property
    def piece_d_ff(self) -> int:
        return self.d_ff // self.pieces


@dataclass(frozen=True)
class LayerSpec:
    """One MoE layer of a checkpoint: enough to load its router or any of its experts."""

    family: str
    model_type: str
    layer: int
    prefix: str  # "model.layers.3.mlp"
    d_model: int
    d_ff: int  # routed experts' hidden width
    n_experts: int  # routed experts
    activation: str  # "silu"
    routing: RoutingSpec
    router: str  # gate weight (n_experts, d_model)
    experts: ExpertLayout
    shared: SharedSpec | None
    dtype: str  # stored dtype of the routed experts: "bfloat16" | "float16" | "float32"

    @property
    def n_shared(self) -> int:
        """Extra expert ids the shared MLP occupies (0 without one)."""
        return self.shared.pieces if self.shared else 0

    @property
    def n_ids(self) -> int:
        """Expert ids a worker can be asked to host: routed, then shared pieces."""
        return self.n_experts + self.n_shared

    def is_shared(self, expert_id: int) -> bool:
        return self.n_experts <= expert_id < self.n_ids

    def expert_d_ff(self, expert_id: int) -> int:
        self._check_id(expert_id)
        return self.shared.piece_d_ff if self.shared and expert_id >= self.n_experts else self.d_ff

    def _check_id(self, expert_id: int) -> None:
        if not 0 <= expert_id < self.n_ids:
            raise ValueError(f"layer {self.layer} has expert ids 0..{self.n_ids - 1} "
                             f"({self.n_experts} routed + {self.n_shared} shared), not {expert_id}")


@dataclass(frozen=True)
class ModelSpec:
    family: str
    model_type: str
    d_model: int
    n_layers: int
    layers: dict[int, LayerSpec] = field(repr=False)

    @property
    def moe_layers(self) -> list[int]:
        return sorted(self.layers)

    def layer(self, index: int) -> LayerSpec:
        try:
            return self.layers[index]
        except KeyError:
            raise CheckpointError(f"layer {index} is not a MoE layer of this {self.model_type} checkpoint; "
                                  f"MoE layers: {_ranges(self.moe_layers)}") from None


# -- families -----------------------------------------------------------------

@dataclass(frozen=True)
class _Family:
    name: str
    n_experts: tuple[str, ...]  # config keys, first present wins
    d_ff: tuple[str, ...]
    scoring: str
    renormalize: bool | None  # fixed, or None: read norm_topk_prob (default below)
    defaults: dict[str, Any]  # transformers' defaults for fields a Hub config may omit
    moe_layers: Callable[[dict, int], list[int]] | None  # None: the layers that have a router
    logits_in_model_dtype: bool
    weights_in_model_dtype: bool


def _all_layers(cfg: dict, n: int) -> list[int]:
    return list(range(n))


def _sparse_step(cfg: dict, n: int) -> list[int]:
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    return [i for i in range(n) if i not in dense and (i + 1) % step == 0]


def _first_k_dense(default_k: int) -> Callable[[dict, int], list[int]]:
    def f(cfg: dict, n: int) -> list[int]:
        k = cfg.get("first_k_dense_replace")
        k = default_k if k is None else int(k)
        freq = int(cfg.get("moe_layer_freq", 1) or 1)
        return [i for i in range(n) if i >= k and i % freq == 0]
    return f


_SOFTMAX = dict(scoring="softmax", logits_in_model_dtype=True)
_SIGMOID = dict(scoring="sigmoid", renormalize=None, n_experts=("n_routed_experts", "num_local_experts"),
                d_ff=("moe_intermediate_size",), logits_in_model_dtype=False, weights_in_model_dtype=False)
FAMILIES: dict[str, _Family] = {f.name: f for f in [
    _Family("mixtral", ("num_local_experts", "num_experts"), ("intermediate_size",), renormalize=True,
            defaults={}, moe_layers=_all_layers, weights_in_model_dtype=False, **_SOFTMAX),
    _Family("minimax", ("num_local_experts", "num_experts"), ("intermediate_size",), renormalize=True,
            defaults={}, moe_layers=_all_layers, weights_in_model_dtype=False, **_SOFTMAX),
    _Family("qwen2_moe", ("num_experts", "num_local_experts"), ("moe_intermediate_size",), renormalize=None,
            defaults={"norm_topk_prob": False}, moe_layers=_sparse_step, weights_in_model_dtype=True, **_SOFTMAX),
    _Family("qwen3_moe", ("num_experts", "num_local_experts"), ("moe_intermediate_size",), renormalize=None,
            defaults={"norm_topk_prob": False}, moe_layers=_sparse_step, weights_in_model_dtype=True, **_SOFTMAX),
    _Family("olmoe", ("num_experts", "num_local_experts"), ("intermediate_size",), renormalize=None,
            defaults={"norm_topk_prob": False}, moe_layers=_all_layers, weights_in_model_dtype=True, **_SOFTMAX),
    _Family("flex_olmo", ("num_experts", "num_local_experts"), ("intermediate_size",), renormalize=None,
            defaults={"norm_topk_prob": False}, moe_layers=_all_layers, weights_in_model_dtype=True, **_SOFTMAX),
    _Family("deepseek_v3", defaults={"n_group": 8, "topk_group": 4, "norm_topk_prob": True,
                                     "routed_scaling_factor": 2.5}, moe_layers=_first_k_dense(3), **_SIGMOID),
    _Family("glm4_moe", defaults={"n_group": 1, "topk_group": 1, "norm_topk_prob": True,
                                  "routed_scaling_factor": 1.0}, moe_layers=_first_k_dense(1), **_SIGMOID),
    _Family("dots1", defaults={"n_group": 1, "topk_group": 1, "norm_topk_prob": False,
                               "routed_scaling_factor": 1.0}, moe_layers=_first_k_dense(0), **_SIGMOID),
]}

_ROUTER_RE = re.compile(r"^(.*?layers)\.(\d+)\.(mlp|block_sparse_moe)\.gate\.weight$")


def model_spec(ckpt: Checkpoint) -> ModelSpec:
    """The MoE layers of ``ckpt`` and how each is computed. Raises CheckpointError, with
    the reason, for a checkpoint this project cannot serve exactly."""
    cfg = ckpt.config
    model_type = str(cfg.get("model_type", ""))
    fam = FAMILIES.get(model_type) or _infer_family(ckpt, cfg, model_type)
    d_model = _int(cfg, "hidden_size", model_type)
    n_layers = _int(cfg, "num_hidden_layers", model_type)
    act = str(cfg.get("hidden_act", "silu"))
    if act not in ACTIVATIONS:
        raise CheckpointError(f"{model_type}: activation {act!r} is not supported (SwiGLU with silu only)")
    routers = _routers(ckpt)
    layers_prefix = _layers_prefix(routers, model_type)
    found = sorted(L for (p, L) in routers if p == layers_prefix and L < n_layers)
    moe = found if fam.moe_layers is None else fam.moe_layers(cfg, n_layers)
    if found != moe:
        raise CheckpointError(f"{model_type}: config.json makes layers {_ranges(moe)} MoE layers, "
                              f"the tensors have routers in layers {_ranges(found)}")
    layers = {L: _layer_spec(ckpt, cfg, fam, model_type, layers_prefix, routers[(layers_prefix, L)], L, d_model,
                             ACTIVATIONS[act]) for L in moe}
    return ModelSpec(fam.name, model_type, d_model, n_layers, layers)


def _infer_family(ckpt: Checkpoint, cfg: dict, model_type: str) -> _Family:
    """A family not in the table: the rule from its config fields (see module docstring)."""
    has_bias = any(k.endswith(".gate.e_score_correction_bias") for k in ckpt.keys())
    if cfg.get("scoring_func") == "sigmoid" or has_bias:
        return _Family(model_type, defaults={"n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0},
                       moe_layers=None, **_SIGMOID)
    if cfg.get("scoring_func", "softmax") != "softmax" or "norm_topk_prob" not in cfg:
        raise CheckpointError(
            f"model_type {model_type!r} is not a known family and its config.json does not say how it "
            f"routes (needs norm_topk_prob for softmax top-k, or scoring_func: sigmoid); known families: "
            f"{', '.join(sorted(FAMILIES))}")
    return _Family(model_type, ("num_experts", "num_local_experts", "n_routed_experts"),
                   ("moe_intermediate_size", "intermediate_size"), renormalize=None, defaults={},
                   moe_layers=None, weights_in_model_dtype=True, **_SOFTMAX)


def _routers(ckpt: Checkpoint) -> dict[tuple[str, int], str]:
    out: dict[tuple[str, int], str] = {}
    for k in ckpt.keys():
        m = _ROUTER_RE.match(k)
        if m:
            key = (m.group(1), int(m.group(2)))
            if key in out:
                raise CheckpointError(f"layer {key[1]} has two routers: {out[key]} and {k}")
            out[key] = k
    return out


def _layers_prefix(routers: dict[tuple[str, int], str], model_type: str) -> str:
    prefixes = sorted({p for p, _ in routers})
    if not prefixes:
        raise CheckpointError(f"{model_type}: no MoE router tensor (…layers.L.mlp.gate.weight) in the checkpoint")
    if len(prefixes) > 1:
        if "model.layers" in prefixes:
            return "model.layers"
        raise CheckpointError(f"{model_type}: routers under several layer stacks {prefixes}")
    return prefixes[0]


def _layer_spec(ckpt: Checkpoint, cfg: dict, fam: _Family, model_type: str, layers_prefix: str, router: str,
                L: int, d_model: int, act: str) -> LayerSpec:
    p = router[: -len(".gate.weight")]
    where = f"{model_type} layer {L} ({p})"
    E, Dr = _shape(ckpt, router, 2, where)
    n_cfg = _first(cfg, fam.n_experts)
    if n_cfg is not None and int(n_cfg) != E:
        raise CheckpointError(f"{where}: config says {n_cfg} experts, router has {E}")
    if Dr != d_model:
        raise CheckpointError(f"{where}: router is {E}x{Dr}, hidden_size is {d_model}")
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if not 1 <= top_k <= E:
        raise CheckpointError(f"{where}: num_experts_per_tok {top_k} not in 1..{E}")

    layout, d_ff, dtype = _expert_layout(ckpt, p, E, d_model, where)
    ff_cfg = _first(cfg, fam.d_ff)
    if ff_cfg is not None and int(ff_cfg) != d_ff:
        raise CheckpointError(f"{where}: config says expert width {ff_cfg}, tensors have {d_ff}")

    def get(key: str) -> Any:
        v = cfg.get(key)
        return fam.defaults.get(key) if v is None else v

    bias = f"{p}.gate.e_score_correction_bias"
    if fam.scoring == "sigmoid":
        n_group, topk_group = int(get("n_group") or 1), int(get("topk_group") or 1)
        if E % n_group or not 1 <= topk_group <= n_group or top_k > topk_group * (E // n_group):
            raise CheckpointError(f"{where}: n_group {n_group}, topk_group {topk_group} cannot pick "
                                  f"{top_k} of {E} experts")
        if bias in ckpt:
            _shape(ckpt, bias, 1, where, (E,))
        routing = RoutingSpec("sigmoid", top_k, bool(get("norm_topk_prob")), float(get("routed_scaling_factor")),
                              n_group, topk_group, bias if bias in ckpt else None,
                              fam.logits_in_model_dtype, fam.weights_in_model_dtype)
    else:
        renorm = fam.renormalize if fam.renormalize is not None else bool(get("norm_topk_prob"))
        routing = RoutingSpec("softmax", top_k, renorm, logits_in_model_dtype=fam.logits_in_model_dtype,
                              weights_in_model_dtype=fam.weights_in_model_dtype)
    shared = _shared(ckpt, p, d_model, d_ff, where)
    n_sh = cfg.get("n_shared_experts")
    if shared is not None and shared.gate_weight is None and n_sh and shared.d_ff != int(n_sh) * d_ff:
        raise CheckpointError(f"{where}: shared experts are {shared.d_ff} wide, config says "
                              f"{n_sh} x {d_ff}")
    return LayerSpec(fam.name, model_type, L, p, d_model, d_ff, E, act, routing, router, layout, shared, dtype)


def _expert_layout(ckpt: Checkpoint, p: str, E: int, d_model: int, where: str) -> tuple[ExpertLayout, int, str]:
    fused_gu, fused_d = f"{p}.experts.gate_up_proj", f"{p}.experts.down_proj"
    if fused_gu in ckpt:
        e1, two_ff, dm = _shape(ckpt, fused_gu, 3, where)
        if e1 != E or dm != d_model or two_ff % 2:
            raise CheckpointError(f"{where}: {fused_gu} has shape {(e1, two_ff, dm)}, expected "
                                  f"({E}, 2*d_ff, {d_model}) (transformers 5's orientation)")
        d_ff = two_ff // 2
        _shape(ckpt, fused_d, 3, where, (E, d_model, d_ff))
        dtype = _same_dtype(ckpt, [fused_gu, fused_d], where)
        return ExpertLayout("fused", fused_gu, None, fused_d), d_ff, dtype
    for g, u, d in (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj")):
        t = ExpertLayout("per_expert", f"{p}.experts.{{e}}.{g}.weight", f"{p}.experts.{{e}}.{u}.weight",
                         f"{p}.experts.{{e}}.{d}.weight")
        if t.gate.format(e=0) in ckpt:
            d_ff, dm = _shape(ckpt, t.gate.format(e=0), 2, where)
            if dm != d_model:
                raise CheckpointError(f"{where}: expert 0's {g} is {d_ff}x{dm}, hidden_size is {d_model}")
            # Every name must be in the index; shapes are checked here for expert 0 and by
            # the loader for each expert it loads (so the spec opens only the shards of
            # the routers and expert 0, not every shard of a 600 GB checkpoint).
            missing = [n for e in range(E) for n in t.names(e) if n not in ckpt]
            if missing:
                raise CheckpointError(f"{where}: {len(missing)} expert tensors missing, e.g. {missing[0]}")
            gn, un, dn = t.names(0)
            _shape(ckpt, un, 2, where, (d_ff, d_model))
            _shape(ckpt, dn, 2, where, (d_model, d_ff))
            return t, d_ff, _same_dtype(ckpt, [gn, un, dn], where)
    raise CheckpointError(f"{where}: no expert tensors in a known layout (experts.E.w1/w3/w2, "
                          f"experts.E.gate_proj/up_proj/down_proj, or fused experts.gate_up_proj/down_proj)")


def _shared(ckpt: Checkpoint, p: str, d_model: int, d_ff: int, where: str) -> SharedSpec | None:
    for name, gate in (("shared_expert", f"{p}.shared_expert_gate.weight"), ("shared_experts", None)):
        g, u, d = (f"{p}.{name}.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj"))
        if g not in ckpt:
            continue
        S, dm = _shape(ckpt, g, 2, where)
        if dm != d_model:
            raise CheckpointError(f"{where}: {g} is {S}x{dm}, hidden_size is {d_model}")
        _shape(ckpt, u, 2, where, (S, d_model))
        _shape(ckpt, d, 2, where, (d_model, S))
        if gate is not None:
            if gate not in ckpt:
                raise CheckpointError(f"{where}: {name} without its gate {gate}")
            _shape(ckpt, gate, 2, where, (1, d_model))
        pieces = S // d_ff if S % d_ff == 0 else 1
        return SharedSpec(g, u, d, S, pieces, gate)
    return None


# -- helpers -----------------------------------------------------------------

def _shape(ckpt: Checkpoint, name: str, ndim: int, where: str, want: tuple[int, ...] | None = None
           ) -> tuple[int, ...]:
    if name not in ckpt:
        raise CheckpointError(f"{where}: tensor {name} is missing")
    s = ckpt.info(name).shape
    if len(s) != ndim or (want is not None and s != want):
        raise CheckpointError(f"{where}: {name} has shape {s}, expected {want or f'{ndim}-D'}")
    return s


def _same_dtype(ckpt: Checkpoint, names: list[str], where: str) -> str:
    dts = {ckpt.info(n).dtype_name for n in names}
    if len(dts) != 1:
        raise CheckpointError(f"{where}: experts stored in mixed dtypes {sorted(dts)}")
    dt = dts.pop()
    if dt not in ("bfloat16", "float16", "float32"):
        raise CheckpointError(f"{where}: experts stored as {dt}; bfloat16, float16 or float32 only")
    return dt


def _first(cfg: dict, keys: tuple[str, ...]) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return None


def _int(cfg: dict, key: str, model_type: str) -> int:
    v = cfg.get(key)
    if not isinstance(v, int) or v < 1:
        raise CheckpointError(f"{model_type}: config.json has no valid {key} ({v!r})")
    return v


def _ranges(xs: list[int]) -> str:
    """[0,1,2,5] -> "0-2,5" (error messages stay short for 60-layer models)."""
    if not xs:
        return "none"
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:  # type: ignore[list-item]
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}-{prev}" if prev > start else f"{start}")
        if x is not None:
            start = prev = x
    return ",".join(out)
