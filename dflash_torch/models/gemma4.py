"""Gemma 4 targets (``gemma4``: ``Gemma4ForConditionalGeneration``, the published
multimodal checkpoints such as gemma-4-31B-it and gemma-4-26B-A4B-it, decoded as text;
``gemma4_text``: ``Gemma4ForCausalLM``; ``gemma4_unified`` / ``gemma4_unified_text``: the
encoder-free gemma-4-12B, whose decoder is the same without the mixture of experts and the
per-layer embeddings, and whose defaults differ: a window of 1,024, a context of 262,144).
Layout as in transformers' ``modeling_gemma4.py``:

* the token embedding is scaled by ``sqrt(hidden_size)`` (rounded to the model dtype);
  DFlash drafters embed their block with the same scaled embedding (the embedding module
  of transformers' Gemma 4 scales, and dflash-mlx scales its drafts alike);
* each layer is "sandwiched" (:class:`~dflash_torch.models.target.SandwichDecoderLayer`):
  ``x + post_attention_layernorm(attn(input_layernorm(x)))``, then
  ``x + post_feedforward_layernorm(ffn(pre_feedforward_layernorm(x)))``, and the layer's
  output times its ``layer_scalar``; every norm scales by ``weight`` in float32;
* attention: ``"sliding_attention"`` layers see the last ``sliding_window`` positions with
  ``head_dim`` and ``num_key_value_heads``; ``"full_attention"`` layers see all positions
  with their own head size (``global_head_dim``) and, with ``attention_k_eq_v``, their own
  number of key/value heads (``num_global_key_value_heads``) and no ``v_proj``: the values
  are the keys' projection before the key norm (``per_layer_config`` overrides either, as
  transformers writes it). Queries and keys get an RMSNorm with weight, values one
  without; attention scores are not scaled (scale 1, the norms set their size); each layer
  type has its own RoPE (``rope_parameters`` keyed by layer type): by default plain RoPE
  (base 10,000) on sliding layers and "proportional" RoPE on full layers (base 10**6, the
  first quarter of each half of a head rotated, the rest with frequency 0);
* the MLP is ``down(gelu_tanh(gate(x)) * up(x))``; with ``enable_moe_block`` (26B-A4B) a
  mixture of experts runs beside it on the layer's un-normed input: a router (weightless
  RMSNorm, times ``scale / sqrt(hidden)``, a linear, softmax, top-k renormalised, times a
  per-expert scale) picks ``top_k_experts`` GELU-tanh experts, and the two branches are
  added after norms of their own (``post_feedforward_layernorm_1`` / ``_2``);
* the logits are ``cap * tanh(lm_head(h) / cap)`` (``final_logit_softcapping`` = cap).

A multimodal checkpoint's decoder weights are under ``model.language_model.``; its vision
and audio towers and their projections (``model.vision_tower.``, ``model.embed_vision.``,
``model.audio_tower.``, ``model.embed_audio.``; the 12B has embedders only, ``model.embed_vision.``,
``model.vision_embedder.``, ``model.embed_audio.``) are not read. Refused in one line: the
per-layer input embeddings and shared key/value layers of the small on-device models
(``hidden_size_per_layer_input`` > 0, ``num_kv_shared_layers`` > 0: gemma-4-E2B / E4B),
bidirectional text attention, RoPE types other than default and proportional, a flat ``rope_scaling``
rule (transformers' Gemma 4 refuses it too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import DFlashError
from . import layers
from .attention import Attention
from .config import MoEConfig, TargetConfig, base_target_fields, bool_field, check_int, check_layer_types, number_field
from .layers import MLP, ScaledRMSNorm, UnitRMSNorm
from .moe import Experts, dispatch_experts
from .multimodal import INNER, text_config, unwrap_language_model
from .rope import Rotary, apply_rope
from .target import SandwichDecoderLayer, TargetModel

WRAPPERS = {"gemma4": "gemma4_text", "gemma4_unified": "gemma4_unified_text"}
UNIFIED = "gemma4_unified_text"  # (no mixture of experts or per-layer embeddings; other defaults)
LAYER_TYPES = ("sliding_attention", "full_attention")
TOWER_PREFIXES = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.",
                  "model.vision_embedder.")
GELU_NAMES = ("gelu_pytorch_tanh", "gelu_tanh")  # transformers' names of GELU with the tanh approximation
# transformers' Gemma4TextConfig rope when a config has none
DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}}
ROPE_TYPES = ("default", "proportional")
PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")  # the per_layer_config overrides a Gemma 4 layer reads


@dataclass
class Gemma4Config(TargetConfig):
    """:class:`TargetConfig` plus Gemma 4's ``sliding_window``, ``final_logit_softcapping``
    (None: no cap), the per-layer attention shapes (``layer_head_dims``,
    ``layer_kv_heads``), ``attention_k_eq_v``, the RoPE of each layer type (``rope``:
    type -> ``(theta, scaling dict or None)``) and, for the mixture of experts, ``moe``."""

    sliding_window: int = 512
    final_logit_softcapping: float | None = None
    layer_head_dims: list[int] = field(default_factory=list)
    layer_kv_heads: list[int] = field(default_factory=list)
    attention_k_eq_v: bool = False
    rope: dict[str, tuple[float, dict | None]] = field(default_factory=dict)


def _rope(text: dict, types: list[str]) -> dict[str, tuple[float, dict | None]]:
    """The RoPE of each layer type in ``types`` from ``rope_parameters`` (keyed by layer
    type; transformers' default when absent). A ``rope_scaling`` keyed by layer type is read
    in its place, as transformers does.

    Raises:
        DFlashError: a layer type without one, a type other than default / proportional, a
            theta, factor or partial_rotary_factor out of range; any other ``rope_scaling``
            (a flat rule such as ``{"rope_type": "linear", "factor": 8.0}``, which
            transformers' Gemma 4 cannot run either).
    """
    scaling = text.get("rope_scaling")
    if scaling and not (isinstance(scaling, dict) and any(k in LAYER_TYPES for k in scaling)):
        raise DFlashError(f"target config.json rope_scaling {scaling!r} is not supported by Gemma 4 (RoPE per "
                          "layer type from rope_parameters)")
    key = "rope_scaling" if scaling else "rope_parameters"  # (the field read, for messages)
    params = scaling or text.get("rope_parameters")
    if params is None:
        params = DEFAULT_ROPE
    if not isinstance(params, dict):
        raise DFlashError(f"target config.json {key} must be an object keyed by layer type, got {params!r}")
    out = {}
    for kind in sorted(set(types)):
        p = params.get(kind)
        if not isinstance(p, dict):
            raise DFlashError(f"target config.json {key} has no object for {kind} layers "
                              f"(Gemma 4 keys them by layer type), got {p!r}")
        rope_type = p.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise DFlashError(f"target {key}.{kind}.rope_type {rope_type!r} is not supported for Gemma 4 "
                              f"({', '.join(ROPE_TYPES)})")
        if p.get("rope_theta") is None:
            raise DFlashError(f"target config.json {key}.{kind} lacks rope_theta")
        theta = _number(p, "rope_theta", kind, 10000.0)
        if rope_type == "default":
            out[kind] = (theta, None)
            continue
        fraction = _number(p, "partial_rotary_factor", kind, 1.0)
        if fraction > 1:
            raise DFlashError(f"target config.json {key}.{kind}.partial_rotary_factor must be in (0, 1], "
                              f"got {fraction!r}")
        out[kind] = (theta, {"rope_type": "proportional", "partial_rotary_factor": fraction,
                             "factor": _number(p, "factor", kind, 1.0)})
    return out


def _number(params: dict, key: str, kind: str, default: float) -> float:
    """``params[key]`` of ``rope_parameters.{kind}`` (:func:`number_field`, the message naming where)."""
    try:
        return number_field(params, key, "target", default)
    except DFlashError:
        raise DFlashError(f"target config.json rope_parameters.{kind}.{key} must be a number > 0, "
                          f"got {params[key]!r}") from None


def _layer_shapes(text: dict, types: list[str], heads_kv: int, head_dim: int, k_eq_v: bool) -> tuple[list[int], list[int]]:
    """Per-layer ``(head_dims, kv_heads)``: sliding layers ``head_dim`` / ``num_key_value_heads``;
    full layers ``global_head_dim`` (default 512) and, with ``attention_k_eq_v``,
    ``num_global_key_value_heads`` when set; ``per_layer_config`` (layer index -> overrides),
    when the config has one, instead of those two keys, as transformers reads it.

    Raises:
        DFlashError: a malformed ``per_layer_config`` or one overriding another key, a
            layer index outside the model, layers of one type with different head sizes.
    """
    n = len(types)
    dims, kv = [head_dim] * n, [heads_kv] * n
    per_layer = text.get("per_layer_config")
    if per_layer is None:
        global_dim = check_int(text, "global_head_dim", "target") or 512
        global_kv = check_int(text, "num_global_key_value_heads", "target") if k_eq_v else None
        per_layer = {i: {"head_dim": global_dim, **({"num_key_value_heads": global_kv} if global_kv else {})}
                     for i, t in enumerate(types) if t == "full_attention"}
    if not isinstance(per_layer, dict):
        raise DFlashError(f"target config.json per_layer_config must be an object of layer index -> overrides, "
                          f"got {per_layer!r}")
    for index, overrides in per_layer.items():
        i = int(index) if isinstance(index, str) and index.isdigit() else index
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
            raise DFlashError(f"target config.json per_layer_config key {index!r} is not a layer index in [0, {n})")
        if not isinstance(overrides, dict):
            raise DFlashError(f"target config.json per_layer_config.{index} must be an object, got {overrides!r}")
        unknown = sorted(set(overrides) - set(PER_LAYER_KEYS))
        if unknown:
            raise DFlashError(f"target config.json per_layer_config.{index} overrides {unknown}; a Gemma 4 layer "
                              f"reads only {', '.join(PER_LAYER_KEYS)} from it")
        for key, values in (("head_dim", dims), ("num_key_value_heads", kv)):
            value = overrides.get(key)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise DFlashError(f"target config.json per_layer_config.{index}.{key} must be an integer >= 1, "
                                      f"got {value!r}")
                values[i] = value
    for kind in set(types):
        sizes = sorted({dims[i] for i in range(n) if types[i] == kind})
        if len(sizes) > 1:
            raise DFlashError(f"target {kind} layers have head sizes {sizes}; transformers' Gemma 4 rotates every layer "
                              "of a type alike, so they must be equal")
    return dims, kv


def parse_config(cfg: dict) -> Gemma4Config:
    """A ``gemma4`` / ``gemma4_text`` / ``gemma4_unified`` / ``gemma4_unified_text``
    ``config.json`` -> :class:`Gemma4Config` (absent keys take the defaults of transformers'
    ``Gemma4TextConfig`` / ``Gemma4UnifiedTextConfig``).

    Raises:
        DFlashError: missing keys; an activation other than GELU-tanh; per-layer input
            embeddings (``hidden_size_per_layer_input``, whose default is 256: a config
            must set it to 0), shared key/value layers, bidirectional attention, a
            ``layer_types`` of the wrong length or with other entries, a bad
            ``rope_parameters`` or ``per_layer_config`` (see :func:`_rope`,
            :func:`_layer_shapes`), a mixture of experts without its sizes.
    """
    text = text_config(cfg, WRAPPERS, inherit=("eos_token_id",))
    wrapper = cfg.get("model_type") in WRAPPERS
    model_type = WRAPPERS.get(cfg["model_type"], cfg["model_type"])
    act = text.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in GELU_NAMES:
        raise DFlashError(f"target config.json hidden_activation {act!r} is not supported for Gemma 4 "
                          f"({', '.join(GELU_NAMES)})")
    ple = check_int(text, "hidden_size_per_layer_input", "target", minimum=0)
    if ple is None and model_type != UNIFIED:
        ple = 256  # (transformers' default, taken for null too; the unified model has none)
    if ple and model_type != UNIFIED:
        raise DFlashError(f"target hidden_size_per_layer_input {ple}: Gemma 4 per-layer input embeddings (the "
                          "on-device E2B / E4B models) are not supported")
    if check_int(text, "num_kv_shared_layers", "target", minimum=0):
        raise DFlashError("target num_kv_shared_layers > 0: Gemma 4 layers that share another layer's keys and "
                          "values (the on-device E2B / E4B models) are not supported")
    if text.get("use_bidirectional_attention") not in (None, "vision"):
        raise DFlashError(f"target use_bidirectional_attention {text['use_bidirectional_attention']!r} is not "
                          "supported (text attends causally: null or \"vision\")")
    base = {k: v for k, v in text.items() if k not in ("hidden_act", "rope_parameters", "rope_scaling")}
    for key, default in (("head_dim", 256), ("num_key_value_heads", 4)):  # (transformers' defaults: not derived)
        if base.get(key) is None:
            base[key] = default
    fields = base_target_fields(base, model_type)
    if text.get("max_position_embeddings") is None:
        fields["max_position_embeddings"] = 262144 if model_type == UNIFIED else 131072  # (transformers' defaults)
    if not fields["intermediate_size"]:
        raise DFlashError("target config.json lacks intermediate_size")
    n = fields["num_hidden_layers"]
    types = text.get("layer_types")
    if types is None:  # transformers' default: every 6th layer full attention, and the last one
        types = ["full_attention" if (i + 1) % 6 == 0 or i == n - 1 else "sliding_attention" for i in range(n)]
    types = check_layer_types(types, n, LAYER_TYPES, "gemma4")
    if types[-1] != "full_attention":
        raise DFlashError("target layer_types must end with full_attention (transformers' Gemma 4 forces its last "
                          "layer to full attention)")
    window = check_int(text, "sliding_window", "target") or (1024 if model_type == UNIFIED else 512)
    k_eq_v = bool_field(text, "attention_k_eq_v", "target", False)
    dims, kv = _layer_shapes(text, types, fields["num_key_value_heads"], fields["head_dim"], k_eq_v)
    bad = [i for i in range(n) if fields["num_attention_heads"] % kv[i]]
    if bad:
        raise DFlashError(f"target layer {bad[0]}: num_attention_heads {fields['num_attention_heads']} is not a "
                          f"multiple of its {kv[bad[0]]} key/value heads")
    cap = text.get("final_logit_softcapping")
    fields.update(
        layer_types=types,
        # (a wrapper's own flag ties its lm_head, as transformers' Gemma4ForConditionalGeneration reads it)
        tie_word_embeddings=bool_field(cfg if wrapper else text, "tie_word_embeddings", "target", True),
        qk_norm=True,
        checkpoint_prefix=INNER if wrapper else "model.",
        sliding_window=window,
        final_logit_softcapping=None if cap is None else number_field(text, "final_logit_softcapping", "target", 0.0),
        layer_head_dims=dims,
        layer_kv_heads=kv,
        attention_k_eq_v=k_eq_v,
        rope=_rope(text, types),
    )
    if model_type != UNIFIED and bool_field(text, "enable_moe_block", "target", False):
        sizes = {k: check_int(text, k, "target") for k in ("num_experts", "top_k_experts", "moe_intermediate_size")}
        missing = [k for k, v in sizes.items() if v is None]
        if missing:
            raise DFlashError(f"target config.json sets enable_moe_block but lacks {', '.join(missing)}")
        if sizes["top_k_experts"] > sizes["num_experts"]:
            raise DFlashError(f"target top_k_experts {sizes['top_k_experts']} must be in [1, num_experts="
                              f"{sizes['num_experts']}]")
        fields["moe"] = MoEConfig(sizes["num_experts"], sizes["top_k_experts"], sizes["moe_intermediate_size"],
                                  norm_topk_prob=True)
    return Gemma4Config(**fields)


class Gemma4Attention(Attention):
    """Gemma 4 attention (see the module docstring): q/k norms with weight, a weightless
    value norm, scale 1, and with ``k_eq_v`` no ``v_proj``: values from ``k_proj``."""

    def __init__(self, cfg: Gemma4Config, kind: str, kv_heads: int, head_dim: int):
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, kv_heads, head_dim, cfg.attention_bias, True,
                         cfg.rms_norm_eps, o_bias=cfg.attention_bias, norm=ScaledRMSNorm)
        self.k_eq_v = cfg.attention_k_eq_v and kind == "full_attention"
        if self.k_eq_v:
            del self.v_proj
            self.v_proj = None
        self.v_norm = UnitRMSNorm(cfg.rms_norm_eps)

    def fuse(self, query: bool) -> None:
        """As :meth:`Attention.fuse`; with ``k_eq_v`` the joined projection has no value part."""
        if not self.k_eq_v:
            return super().fuse(query)
        if self.qkv_proj is None and self.kv_proj is None and query:
            self.qkv_proj = layers.fused_linear([self.q_proj, self.k_proj])
            del self.q_proj, self.k_proj

    def project(self, x, cos, sin):
        if self.qkv_proj is None:
            return (*self.query_gate(x, cos, sin), *self.key_value(x, cos, sin))
        kv = self.kv_heads * self.head_dim
        parts = [self.heads * self.head_dim, kv] + ([] if self.k_eq_v else [kv])
        q, k, *v = self.qkv_proj(x).split(parts, dim=-1)
        return (*self._queries(q, cos, sin), *self._keys_values(k, v[0] if v else None, cos, sin))

    def key_value(self, x, cos, sin):
        if self.kv_proj is not None:
            return self._keys_values(*self.kv_proj(x).chunk(2, dim=-1), cos, sin)
        return self._keys_values(self.k_proj(x), None if self.k_eq_v else self.v_proj(x), cos, sin)

    def _keys_values(self, k, v, cos, sin):
        """Keys: k_norm, then RoPE; values (``v`` None: the keys' projection): the weightless norm."""
        t = k.shape[0]
        k = k.reshape(t, self.kv_heads, self.head_dim)
        v = k if v is None else v.reshape(t, self.kv_heads, self.head_dim)
        k = self.k_norm(k).transpose(0, 1)
        return (apply_rope(k, cos, sin) if self.rope else k), self.v_norm(v).transpose(0, 1)

    def attend(self, q, k, v, bias):
        """Attention with scale 1 (the q/k norms set the scores' size)."""
        return layers.attend(q, k, v, bias, scale=1.0)


class Router(nn.Module):
    """The router of a Gemma 4 mixture of experts: ``proj.weight`` ``[E, H]``, ``scale``
    ``[H]``, ``per_expert_scale`` ``[E]`` (Hugging Face names under ``router.``)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, eps: float):
        super().__init__()
        self.top_k = top_k
        self.norm = UnitRMSNorm(eps)
        self.proj = nn.Linear(hidden, num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))
        self.root = hidden ** -0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[T, H]`` -> (float32 weights ``[T, k]``, int64 expert ids ``[T, k]``):
        softmax in float32 over all experts, the top k renormalised to sum to 1, each then
        times its expert's ``per_expert_scale``."""
        scores = self.proj(self.norm(x) * self.scale * self.root)
        weights, experts = torch.topk(torch.softmax(scores, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts


class Gemma4Layer(SandwichDecoderLayer):
    """A Gemma 4 decoder layer: a sandwiched attention and feed-forward (with the mixture of
    experts beside the MLP when ``moe``), the output times ``layer_scalar`` ``[1]``."""

    def __init__(self, cfg: Gemma4Config, index: int, kind: str, slot: int):
        norm = lambda: ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # noqa: E731
        attn = Gemma4Attention(cfg, kind, cfg.layer_kv_heads[index], cfg.layer_head_dims[index])
        super().__init__(kind, attn, MLP(cfg.hidden_size, cfg.intermediate_size, activation="gelu_tanh"), norm(), norm(),
                         norm(), norm(), slot, sliding_window=cfg.sliding_window if kind == "sliding_attention" else None)
        self.rope_key = kind
        self.register_buffer("layer_scalar", torch.ones(1))
        self.router = self.experts = None
        if cfg.moe is not None:
            m = cfg.moe
            self.router = Router(cfg.hidden_size, m.num_experts, m.top_k, cfg.rms_norm_eps)
            self.experts = Experts(m.num_experts, cfg.hidden_size, m.intermediate_size)
            self.pre_feedforward_layernorm_2 = norm()
            self.post_feedforward_layernorm_1 = norm()
            self.post_feedforward_layernorm_2 = norm()

    def add_mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.router is not None:
            weights, experts = self.router(x)
            e = self.experts
            moe = dispatch_experts(self.pre_feedforward_layernorm_2(x), experts, weights, e.gate_up_proj, e.down_proj,
                                   gelu_tanh=True, **e.quantization())
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(moe)
        return (x + self.post_feedforward_layernorm(h)) * self.layer_scalar


class Model(TargetModel):
    """A Gemma 4 decoder (see the module docstring)."""

    norm_class = ScaledRMSNorm

    def make_layer(self, index: int, kind: str, slot: int) -> Gemma4Layer:
        return Gemma4Layer(self.config, index, kind, slot)

    def make_rotary(self) -> nn.ModuleDict:
        """One :class:`Rotary` per layer type (its layers' head size and ``rope_parameters``)."""
        cfg = self.config
        dims = {kind: cfg.layer_head_dims[i] for i, kind in enumerate(cfg.layer_types)}
        return nn.ModuleDict({kind: Rotary(dims[kind], theta, scaling, max_position_embeddings=cfg.max_position_embeddings)
                              for kind, (theta, scaling) in cfg.rope.items()})

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows times ``sqrt(hidden_size)`` rounded to the model dtype (what the
        decoder reads, and drafters embed their block with)."""
        rows = self.model.embed_tokens(input_ids)
        scale = torch.tensor(self.config.hidden_size ** 0.5, dtype=torch.float32, device=rows.device)
        return rows * scale.to(rows.dtype)  # (a 0-dim tensor, not .item(): that breaks a compiled graph)

    def embed_inputs(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``cap * tanh(lm_head(hidden) / cap)`` (in the model dtype, as transformers computes it)."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @classmethod
    def checkpoint_keys(cls, cfg: TargetConfig, key: str) -> bool:
        """A wrapper's vision and audio towers and their projections are not read."""
        return not (cfg.checkpoint_prefix == INNER and key.startswith(TOWER_PREFIXES))

    @classmethod
    def convert_checkpoint(cls, cfg: TargetConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The decoder's weights under ``model.`` (see
        :func:`~dflash_torch.models.multimodal.unwrap_language_model`)."""
        return unwrap_language_model(cfg, state, TOWER_PREFIXES, "vision or audio tower", "Gemma 4",
                                     "gemma4" if cfg.model_type == "gemma4_text" else "gemma4_unified")
