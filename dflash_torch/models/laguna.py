"""poolside's Laguna targets (``laguna``: Laguna-XS.2, Laguna-XS-2.1, Laguna-S-2.1,
Laguna-M.1). Layout as in transformers' ``modeling_laguna.py`` (the oracle of the tests):

* pre-norm decoder layers (:class:`~dflash_torch.models.target.DecoderLayer`): attention,
  then a dense SwiGLU MLP or a mixture of experts, both residual;
* attention: per layer ``"full_attention"`` or ``"sliding_attention"`` (``layer_types``; the
  last ``sliding_window`` positions), with its own number of query heads
  (``num_attention_heads_per_layer``, e.g. Laguna-S-2.1: 48 on full layers, 72 on sliding
  ones) over ``num_key_value_heads`` key/value heads of ``head_dim`` everywhere; an RMSNorm
  on each query and key head, then RoPE of the layer's type (``rope_parameters`` keyed by
  layer type; transformers' default when absent: full layers base 500,000 rotating the
  first half of each head, sliding layers base 10,000 rotating all of it; the published
  full layers use YaRN); q/k/v/o biases with ``attention_bias``. The attention output is
  multiplied by ``softplus(g_proj(h))`` (computed in float32, cast back) of the layer's
  normed input ``h`` before ``o_proj``: one gate per head broadcast over ``head_dim``
  (``gating`` true or ``"per-head"``), or one per channel (``"per-element"``);
* ``mlp_layer_types`` (default: the first layer ``"dense"``, the rest ``"sparse"``): a dense
  layer is a SwiGLU MLP of ``intermediate_size``; a sparse one a router ``gate`` whose float32
  logits are optionally soft-capped (``cap * tanh(logits / cap)``,
  ``moe_router_logit_softcapping``), scored by ``sigmoid``; the top ``num_experts_per_tok``
  experts are *chosen* by score plus ``e_score_correction_bias`` and weighted by their scores
  (without the bias) renormalised to sum to 1, cast to the activation dtype; SwiGLU experts
  of ``moe_intermediate_size``; their sum times ``moe_routed_scaling_factor``, plus an
  always-on shared expert (``shared_expert_intermediate_size``, no gate).

Checkpoints (as transformers' ``save_pretrained`` writes them, and the published ones):
experts per expert (``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``) or stacked
(``mlp.experts.gate_up_proj`` / ``down_proj``), the routing bias under
``mlp.experts.e_score_correction_bias`` (or ``mlp.gate.e_score_correction_bias``), the shared
expert under ``mlp.shared_expert.`` (or ``mlp.shared_experts.``).

Older published configs are written in vLLM's flat schema (its ``LagunaConfig``), which
transformers' class does not read (it would decode them with its default RoPE); they are
folded as vLLM reads them: ``rope_theta`` (default 500,000) with ``rope_scaling`` (or a flat
``rope_parameters``) and ``partial_rotary_factor`` (default 1) for the full layers;
``swa_rope_parameters`` for the sliding layers (its own ``partial_rotary_factor``, else the
top-level one), or, without it, the full layers' RoPE (as vLLM does); ``mlp_only_layers``
(default ``[0]``) and ``decoder_sparse_step`` (default 1) for the dense layers; ``qkv_bias``
for the q/k/v biases (``attention_bias`` then only the output's). A config holding both a
nested ``rope_parameters`` and legacy keys that disagree with it is refused. Refused in one
line too: ``gating`` false (transformers reads it as per-element gates, vLLM as none) or
another string, ``moe_apply_router_weight_on_input``, ``swa_attention_sink_enabled`` (attention
sinks), ``norm_topk_prob`` false (transformers always renormalises), a router score other
than sigmoid, RoPE types other than default / linear / llama3 / yarn.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import DFlashError
from .attention import Attention
from .config import (ROPE_SCALING_KEYS, MoEConfig, TargetConfig, _rope, base_target_fields, bool_field, check_int,
                     check_layer_types, number_field)
from .layers import MLP, RMSNorm
from .minimax_m2 import SigmoidRoutedMoE
from .moe import fuse_expert_weights
from .rope import Rotary
from .target import DecoderLayer, TargetModel

QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "modelopt")  # dequantized when loading (fp8, packed_int, nvfp4)
LAYER_TYPES = ("full_attention", "sliding_attention")
MLP_TYPES = ("dense", "sparse")
# transformers' LagunaConfig defaults (for keys a config leaves out)
DEFAULTS = dict(head_dim=128, num_key_value_heads=8, intermediate_size=8192, max_position_embeddings=131072,
                num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512)
DEFAULT_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}
LEGACY_THETA = 500000.0  # vLLM's LagunaConfig default rope_theta (flat schema)
LEGACY_ROPE_KEYS = ("rope_theta", "rope_scaling", "partial_rotary_factor", "swa_rope_parameters")

Rope = tuple[float, "dict | None", float]  # (theta, scaling rule or None, partial_rotary_factor)


@dataclass
class LagunaConfig(TargetConfig):
    """:class:`TargetConfig` plus Laguna's ``sliding_window`` (None: no sliding layers), the
    query heads of each layer (``layer_heads``), ``gate_per_head`` (False: one gate per
    channel), ``qkv_bias`` (the q/k/v projections' biases; ``attention_bias``: ``o_proj``'s),
    the RoPE of each layer type (``rope``: type -> ``(theta, scaling or None,
    partial_rotary_factor)``), ``routed_scaling_factor`` and ``router_softcap`` (0: none)."""

    sliding_window: int | None = None
    layer_heads: list[int] = field(default_factory=list)
    gate_per_head: bool = True
    qkv_bias: bool = False
    rope: dict[str, Rope] = field(default_factory=dict)
    routed_scaling_factor: float = 1.0
    router_softcap: float = 0.0


def _given(cfg: dict, key: str) -> bool:
    return cfg.get(key) is not None


def _nested(params) -> bool:
    """Whether a ``rope_parameters`` value is keyed by layer type (transformers' Laguna schema)."""
    return isinstance(params, dict) and any(isinstance(v, dict) for v in params.values())


def _fraction(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise DFlashError(f"target config.json {where} must be a number in (0, 1], got {value!r}")
    return float(value)


def _one_rope(params: dict, where: str, theta_default: float | None, partial_default: float,
              max_positions: int, original: int | None = None) -> Rope:
    """One RoPE dict (``rope_type``, ``rope_theta``, the rule's keys, ``partial_rotary_factor``)
    -> ``(theta, scaling, partial)`` (``theta_default`` None: ``rope_theta`` is required)."""
    if not isinstance(params, dict):
        raise DFlashError(f"target config.json {where} must be an object, got {params!r}")
    if theta_default is None and params.get("rope_theta") is None:
        raise DFlashError(f"target config.json {where} lacks rope_theta")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", *ROPE_SCALING_KEYS):
        raise DFlashError(f"target config.json {where}.rope_type {kind!r} is not supported for laguna "
                          f"(default, {', '.join(ROPE_SCALING_KEYS)})")
    if params.get("truncate") is False:  # (transformers' Laguna reads truncate from the outer dict: always on)
        raise DFlashError(f"target config.json {where}.truncate false is not supported (transformers' Laguna "
                          "truncates the YaRN ramp)")
    outer = {"rope_parameters": {k: v for k, v in params.items() if k != "partial_rotary_factor"},
             "rope_theta": theta_default, "max_position_embeddings": max_positions}
    if original is not None:
        outer["original_max_position_embeddings"] = original
    try:
        theta, scaling = _rope(outer, "target")
    except DFlashError as e:
        raise DFlashError(f"{e} (target config.json {where})") from None
    partial = params.get("partial_rotary_factor")
    partial = partial_default if partial is None else _fraction(partial, f"{where}.partial_rotary_factor")
    return theta, scaling, partial


def _rope_of_types(cfg: dict, types: list[str], max_positions: int) -> dict[str, Rope]:
    """The RoPE of each layer type in ``types``: the nested ``rope_parameters`` (transformers'
    default when no RoPE key at all), or the flat (vLLM) schema folded; both checked to agree
    when a config has both.

    Raises:
        DFlashError: a layer type without its RoPE, a malformed or unsupported one, or legacy
            keys that disagree with the nested ``rope_parameters``.
    """
    params = cfg.get("rope_parameters")
    legacy = [k for k in LEGACY_ROPE_KEYS if _given(cfg, k)] + (
        ["rope_parameters"] if params is not None and not _nested(params) else [])
    if params is not None and not isinstance(params, dict):
        raise DFlashError(f"target config.json rope_parameters must be an object, got {params!r}")
    if not _nested(params) and legacy:
        return _legacy_rope(cfg, types, max_positions)
    nested = params if _nested(params) else DEFAULT_ROPE
    out = {}
    for kind in sorted(set(types)):
        if not isinstance(nested.get(kind), dict):
            raise DFlashError(f"target config.json rope_parameters has no object for {kind} layers (Laguna keys "
                              f"them by layer type), got {nested.get(kind)!r}")
        out[kind] = _one_rope(nested[kind], f"rope_parameters.{kind}", None, 1.0, max_positions)
    if legacy:
        _check_legacy_agrees(cfg, types, out, max_positions)
    return out


def _legacy_rope(cfg: dict, types: list[str], max_positions: int) -> dict[str, Rope]:
    """vLLM's reading of the flat schema (see the module docstring)."""
    top_theta = number_field(cfg, "rope_theta", "target", LEGACY_THETA)
    top_partial = 1.0 if not _given(cfg, "partial_rotary_factor") else _fraction(cfg["partial_rotary_factor"],
                                                                                 "partial_rotary_factor")
    flat = cfg.get("rope_scaling") if _given(cfg, "rope_scaling") else cfg.get("rope_parameters") or {}
    where = "rope_scaling" if _given(cfg, "rope_scaling") else "rope_parameters"
    original = check_int(cfg, "original_max_position_embeddings", "target")
    full = _one_rope(flat, where, top_theta, top_partial, max_positions, original)
    swa = cfg.get("swa_rope_parameters")
    sliding = full if swa is None else _one_rope(swa, "swa_rope_parameters", None, top_partial, max_positions)
    return {kind: full if kind == "full_attention" else sliding for kind in set(types)}


def _check_legacy_agrees(cfg: dict, types: list[str], nested: dict[str, Rope], max_positions: int) -> None:
    """Each legacy RoPE key a config holds beside a nested ``rope_parameters`` says what the
    nested one says (the fields it determines), else one line naming both."""
    folded = _legacy_rope(cfg, types, max_positions)
    claims = []  # (layer type, field index, the legacy key that sets it)
    if _given(cfg, "rope_theta") or (isinstance(cfg.get("rope_scaling"), dict) and "rope_theta" in cfg["rope_scaling"]):
        claims.append(("full_attention", 0, "rope_theta"))
    if _given(cfg, "rope_scaling"):
        claims.append(("full_attention", 1, "rope_scaling"))
    if _given(cfg, "partial_rotary_factor"):
        claims.append(("full_attention", 2, "partial_rotary_factor"))
    if _given(cfg, "swa_rope_parameters"):
        claims += [("sliding_attention", i, "swa_rope_parameters") for i in range(3)]
    names = ("rope_theta", "scaling", "partial_rotary_factor")
    for kind, i, key in claims:
        if kind in nested and folded[kind][i] != nested[kind][i]:
            raise DFlashError(f"target config.json has both a nested rope_parameters and the legacy {key}, which "
                              f"disagree on the {kind} layers' {names[i]}: {nested[kind][i]!r} against "
                              f"{folded[kind][i]!r}; keep one")


def _mlp_types(cfg: dict, n: int, num_experts: int) -> list[str]:
    """``mlp_layer_types``; else vLLM's ``mlp_only_layers`` / ``decoder_sparse_step`` rule when
    a config has those keys; else transformers' default (first dense, rest sparse)."""
    legacy = None
    if _given(cfg, "mlp_only_layers") or _given(cfg, "decoder_sparse_step"):
        only = cfg.get("mlp_only_layers")
        only = [0] if only is None else only
        if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
            raise DFlashError(f"target config.json mlp_only_layers must be a list of layer ids, got {only!r}")
        step = check_int(cfg, "decoder_sparse_step", "target") or 1
        legacy = ["sparse" if i not in only and num_experts > 0 and (i + 1) % step == 0 else "dense" for i in range(n)]
    given = cfg.get("mlp_layer_types")
    if given is None:
        return legacy if legacy is not None else ["dense"] + ["sparse"] * (n - 1)
    if not isinstance(given, list) or not all(isinstance(t, str) for t in given) or len(given) != n:
        raise DFlashError(f"target config.json mlp_layer_types must list dense or sparse for each of the {n} layers "
                          f"(num_hidden_layers), got {given!r}")
    unknown = sorted(set(given) - set(MLP_TYPES))
    if unknown:
        raise DFlashError(f"target config.json mlp_layer_types {unknown} are not supported (dense, sparse)")
    if legacy is not None and legacy != given:
        raise DFlashError(f"target config.json mlp_layer_types {given} disagrees with its legacy mlp_only_layers / "
                          f"decoder_sparse_step ({legacy}); keep one")
    return list(given)


def _refuse_variants(cfg: dict) -> None:
    if bool_field(cfg, "moe_apply_router_weight_on_input", "target", False):
        raise DFlashError("target config.json sets moe_apply_router_weight_on_input: routing weights applied to the "
                          "experts' input are not supported (nor by transformers' Laguna)")
    if bool_field(cfg, "swa_attention_sink_enabled", "target", False):
        raise DFlashError("target config.json sets swa_attention_sink_enabled: Laguna attention sinks are not "
                          "supported")
    if not bool_field(cfg, "norm_topk_prob", "target", True):
        raise DFlashError("target config.json sets norm_topk_prob false; transformers' Laguna always renormalises "
                          "the chosen experts' weights")
    if not bool_field(cfg, "moe_router_use_sigmoid", "target", True):
        raise DFlashError("target config.json sets moe_router_use_sigmoid false; Laguna routers score with sigmoid")
    for key, supported in (("moe_router_score_func", "sigmoid"), ("rope_style", "rotate-half")):
        if cfg.get(key, supported) not in (None, supported):
            raise DFlashError(f"target config.json {key} {cfg[key]!r} is not supported for laguna (only {supported!r})")
    if cfg.get("gating_types") is not None:
        raise DFlashError("target config.json has gating_types (per-layer gating); neither transformers' nor vLLM's "
                          "Laguna reads it, so it is not supported")


def _gate_per_head(cfg: dict) -> bool:
    gating = cfg.get("gating", True)
    if gating is True or gating == "per-head":
        return True
    if gating == "per-element":
        return False
    if gating is False:
        raise DFlashError("target config.json gating false is ambiguous (transformers' Laguna reads it as one gate "
                          "per channel, vLLM's as no gate); write \"per-element\" or \"per-head\"")
    raise DFlashError(f"target config.json gating {gating!r} is not supported (true, \"per-head\" or \"per-element\")")


def parse_config(cfg: dict) -> LagunaConfig:
    """A ``laguna`` ``config.json`` -> :class:`LagunaConfig` (absent keys take the defaults of
    transformers' ``LagunaConfig``; the flat vLLM schema folded, see the module docstring).

    Raises:
        DFlashError: one line for a list of the wrong length or with unknown entries
            (``layer_types``, ``mlp_layer_types``, ``num_attention_heads_per_layer``), a
            layer's query heads not a multiple of ``num_key_value_heads``, sliding layers
            without ``sliding_window``, an unknown ``gating``, a bad RoPE, the variants the
            module docstring lists.
    """
    _refuse_variants(cfg)
    gate_per_head = _gate_per_head(cfg)
    base = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling", "partial_rotary_factor")}
    for key, default in DEFAULTS.items():
        if base.get(key) is None:
            base[key] = default
    fields = base_target_fields(base, "laguna")
    n, kv = fields["num_hidden_layers"], fields["num_key_value_heads"]
    types = cfg.get("layer_types")
    types = check_layer_types(["full_attention"] * n if types is None else types, n, LAYER_TYPES, "laguna")
    heads = cfg.get("num_attention_heads_per_layer")
    heads = [fields["num_attention_heads"]] * n if heads is None else heads
    if not isinstance(heads, list) or len(heads) != n or not all(
            isinstance(h, int) and not isinstance(h, bool) and h >= 1 for h in heads):
        raise DFlashError(f"target config.json num_attention_heads_per_layer must list an integer >= 1 for each of the "
                          f"{n} layers (num_hidden_layers), got {heads!r}")
    bad = [i for i, h in enumerate(heads) if h % kv]
    if bad:
        raise DFlashError(f"target layer {bad[0]}: {heads[bad[0]]} query heads are not a multiple of the "
                          f"{kv} key/value heads (num_key_value_heads)")
    window = check_int(cfg, "sliding_window", "target")
    if window is None and "sliding_attention" in types:
        raise DFlashError("target config.json has sliding_attention layers but no sliding_window")
    num_experts = check_int(base, "num_experts", "target", minimum=0)
    mlp_types = _mlp_types(cfg, n, num_experts)
    moe = None
    if "sparse" in mlp_types:
        top_k = check_int(base, "num_experts_per_tok", "target")
        if not 1 <= top_k <= num_experts:
            raise DFlashError(f"target num_experts_per_tok {top_k} must be in [1, num_experts={num_experts}]")
        moe = MoEConfig(num_experts=num_experts, top_k=top_k,
                        intermediate_size=check_int(base, "moe_intermediate_size", "target"), norm_topk_prob=True,
                        shared_expert_intermediate_size=check_int(base, "shared_expert_intermediate_size", "target",
                                                                  minimum=0))
    cap = cfg.get("moe_router_logit_softcapping")
    attention_bias = bool_field(cfg, "attention_bias", "target", False)
    qkv_bias = bool_field(cfg, "qkv_bias", "target", attention_bias)
    if attention_bias and not qkv_bias:
        raise DFlashError("target config.json sets attention_bias true and qkv_bias false: transformers' Laguna "
                          "reads biases on q/k/v/o, vLLM's on o_proj only; ambiguous")
    rope = _rope_of_types(cfg, types, fields["max_position_embeddings"])
    theta, scaling, partial = rope.get("full_attention", rope.get("sliding_attention"))
    fields.update(
        rope_theta=theta,  # (the full layers' RoPE, for what reads one; the layers read rope)
        rope_scaling=scaling,
        partial_rotary_factor=partial,
        layer_types=types,
        moe=moe,
        moe_layers=[t == "sparse" for t in mlp_types],
        qk_norm=True,
        attention_output_gate=True,
        attention_bias=attention_bias,
        sliding_window=window,
        layer_heads=list(heads),
        gate_per_head=gate_per_head,
        qkv_bias=qkv_bias,
        rope=rope,
        routed_scaling_factor=number_field(cfg, "moe_routed_scaling_factor", "target", 1.0),
        router_softcap=0.0 if cap in (None, 0, 0.0) else number_field(cfg, "moe_router_logit_softcapping", "target", 0.0),
    )
    return LagunaConfig(**fields)


def softplus_gated(attended: torch.Tensor, gate: torch.Tensor, heads: int, per_head: bool) -> torch.Tensor:
    """Laguna's output gate: ``attended`` ``[T, heads * head_dim]`` times ``softplus(gate)``
    (computed in float32, cast to ``attended``'s dtype); ``gate`` ``[T, heads]`` broadcast over
    each head's channels (``per_head``) or ``[T, heads * head_dim]``. (The target's attention and
    the Laguna DFlash drafter's layers share it.)"""
    g = F.softplus(gate.float()).to(attended.dtype)
    if not per_head:
        return attended * g
    t = attended.shape[0]
    return (attended.view(t, heads, -1) * g[..., None]).view(t, -1)


class LagunaAttention(Attention):
    """Laguna attention (see the module docstring): per-head q/k RMSNorm, RoPE, and the
    output times ``softplus(g_proj(h))``; ``g_proj.weight`` ``[heads, hidden]`` (a gate per
    head) or ``[heads * head_dim, hidden]`` (per channel)."""

    def __init__(self, cfg: LagunaConfig, heads: int):
        super().__init__(cfg.hidden_size, heads, cfg.num_key_value_heads, cfg.head_dim, cfg.qkv_bias, True,
                         cfg.rms_norm_eps, o_bias=cfg.attention_bias)
        self.gate_per_head = cfg.gate_per_head
        self.g_proj = nn.Linear(cfg.hidden_size, heads if cfg.gate_per_head else heads * cfg.head_dim, bias=False)

    def project(self, x, cos, sin):
        """As :meth:`Attention.project`; the gate is ``g_proj(x)`` ``[T, heads]`` or ``[T, heads * head_dim]``."""
        q, _, k, v = super().project(x, cos, sin)
        return q, self.g_proj(x), k, v

    def query_gate(self, x, cos, sin):
        return super().query_gate(x, cos, sin)[0], self.g_proj(x)

    def output(self, attended: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """``o_proj`` of ``attended`` ``[T, heads * head_dim]`` gated by :func:`softplus_gated`."""
        return self.o_proj(softplus_gated(attended, gate, self.heads, self.gate_per_head))


class LagunaMoE(SigmoidRoutedMoE):
    """A Laguna mixture of experts (see the module docstring). Parameters: ``gate.weight``
    ``[E, H]``, ``e_score_correction_bias`` ``[E]``, ``experts.gate_up_proj`` ``[E, 2I, H]``,
    ``experts.down_proj`` ``[E, H, I]``, and with a shared expert ``shared_experts.*`` (a
    SwiGLU :class:`~dflash_torch.models.layers.MLP`)."""

    def __init__(self, hidden: int, moe: MoEConfig, routed_scaling_factor: float, softcap: float):
        super().__init__(hidden, moe.num_experts, moe.top_k, moe.intermediate_size)
        self.routed_scaling_factor, self.softcap = routed_scaling_factor, softcap
        shared = moe.shared_expert_intermediate_size
        self.shared_experts = MLP(hidden, shared) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router: ``x`` ``[T, H]`` -> (weights ``[T, k]`` in ``x.dtype``, summing to 1 per row
        before the cast; int64 expert ids ``[T, k]``, highest biased score first)."""
        logits = self.gate(x).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        scores = torch.sigmoid(logits)
        experts = torch.topk(scores + self.e_score_correction_bias.float(), self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        return (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]`` -> ``experts(x) * routed_scaling_factor + shared_experts(x)`` ``[T, H]``
        (``x.dtype``)."""
        out = super().forward(x) * self.routed_scaling_factor  # (the routed experts: no shared expert there)
        return out if self.shared_experts is None else out + self.shared_experts(x)


# checkpoint name -> ours, within a layer's mlp (transformers' load-time renames)
_RENAMES = {".mlp.experts.e_score_correction_bias": ".mlp.e_score_correction_bias",
            ".mlp.gate.e_score_correction_bias": ".mlp.e_score_correction_bias",
            ".mlp.shared_expert.": ".mlp.shared_experts."}


class Model(TargetModel):
    """A Laguna decoder (see the module docstring)."""

    def make_layer(self, index: int, kind: str, slot: int) -> DecoderLayer:
        cfg = self.config
        attn = LagunaAttention(cfg, cfg.layer_heads[index])
        if cfg.moe_layers[index]:
            mlp = LagunaMoE(cfg.hidden_size, cfg.moe, cfg.routed_scaling_factor, cfg.router_softcap)
        else:
            mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        layer = DecoderLayer(kind, attn, mlp, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
                             RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), slot,
                             sliding_window=cfg.sliding_window if kind == "sliding_attention" else None)
        layer.rope_key = kind
        return layer

    def make_rotary(self) -> nn.ModuleDict:
        """One :class:`Rotary` per layer type (``cfg.rope``)."""
        cfg = self.config
        return nn.ModuleDict({kind: Rotary(cfg.head_dim, theta, scaling, partial_rotary_factor=partial,
                                           max_position_embeddings=cfg.max_position_embeddings)
                              for kind, (theta, scaling, partial) in cfg.rope.items()})

    @classmethod
    def convert_checkpoint(cls, cfg: TargetConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The routing bias (``mlp.experts.e_score_correction_bias`` or
        ``mlp.gate.e_score_correction_bias``) -> ``mlp.e_score_correction_bias``, the shared
        expert ``mlp.shared_expert.`` -> ``mlp.shared_experts.``, per-expert weights stacked
        (:func:`~dflash_torch.models.moe.fuse_expert_weights`; stacked ones kept).

        Raises:
            DFlashError: a weight stored under two of these names.
        """
        origin = {}
        for key in list(state):
            theirs = next((t for t in _RENAMES if t in key), None)
            if theirs is None:
                continue
            new = key.replace(theirs, _RENAMES[theirs])
            if new in state:
                raise DFlashError(f"target checkpoint holds both {key} and {origin.get(new, new)}: the same weight "
                                  "under two names")
            state[new], origin[new] = state.pop(key), key
        if cfg.moe is None:
            return state
        return fuse_expert_weights(state, cfg.moe.num_experts)

    @classmethod
    def checkpoint_name(cls, cfg: TargetConfig, key: str) -> str:
        """As transformers' ``save_pretrained`` names it."""
        return key.replace(".mlp.e_score_correction_bias", ".mlp.experts.e_score_correction_bias").replace(
            ".mlp.shared_experts.", ".mlp.shared_expert.")

