"""Muse Glimmer targets (``muse_glimmer``: ``MuseGlimmerForConditionalGeneration``, the
published multimodal checkpoints, decoded as text; ``muse_glimmer_text``: its decoder's
config alone). Layout as in transformers' ``modeling_muse_glimmer.py``:

* the token embedding is followed by a weightless RMSNorm (``embed_norm``). DFlash
  drafters embed their block *without* it (transformers' ``DFlashTokenCandidateGenerator``
  bypasses it), so :meth:`Model.embed` is the plain lookup and :meth:`Model.embed_inputs`,
  what the decoder reads, adds the norm;
* each layer is "sandwiched" (:class:`~dflash_torch.models.target.SandwichDecoderLayer`):
  ``x + post_attention_layernorm(attn(input_layernorm(x)))``, then
  ``x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))``; these four norms
  scale by ``1 + weight`` (the two after a sublayer use ``post_norm_eps``), the final norm
  by ``weight``;
* attention: a weightless RMSNorm on each query and key head (queries then times
  ``qk_scale_factor``, on top of the usual ``1 / sqrt(head_dim)``), RoPE except on the
  layers whose ``layer_rope_theta`` is 0 (no position embedding, "NoPE": by default every
  4th layer counted back from the last, the full-attention ones), a window of
  ``sliding_window`` positions on ``"sliding_attention"`` layers, and the output gated by
  ``sigmoid(gate_proj(h))`` of the layer's normed input ``h`` before ``o_proj``;
* the logits are ``cap * tanh(lm_head(h) * output_multiplier / cap)``
  (``final_logit_softcapping`` = cap). Drafts read the plain ``lm_head`` (:meth:`Model.logits`);
  a drafter whose config leaves the scale at its defaults drafts on the target's scale
  (:meth:`Model.output_logits`), as the DFlash reference's drafters do.

A multimodal checkpoint's decoder weights are under ``model.language_model.``; its vision
tower, adapter and projection (``model.vision_tower.``, ``model.vision_adapter.``,
``model.vision_projection.``) are not read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import DFlashError
from .attention import Attention
from .config import (SILU_NAMES, TargetConfig, base_target_fields, bool_field, check_int, check_layer_types, number_field,
                     rotary_fraction)
from .layers import MLP, ScaledRMSNorm, UnitRMSNorm, ZeroCenteredRMSNorm
from .multimodal import INNER, text_config, unwrap_language_model
from .target import SandwichDecoderLayer, TargetModel

WRAPPERS = {"muse_glimmer": "muse_glimmer_text"}
LAYER_TYPES = ("sliding_attention", "full_attention")
VISION_PREFIXES = ("model.vision_tower.", "model.vision_adapter.", "model.vision_projection.")


@dataclass
class MuseGlimmerConfig(TargetConfig):
    """:class:`TargetConfig` plus Muse Glimmer's ``sliding_window``, ``qk_scale_factor``,
    ``output_multiplier``, ``final_logit_softcapping``, ``post_norm_eps`` and which layers
    have no RoPE (``nope_layers``, from ``layer_rope_theta``)."""

    sliding_window: int = 2048
    qk_scale_factor: float = 3.87
    output_multiplier: float = 0.19611613513818404
    final_logit_softcapping: float = 20.0
    post_norm_eps: float = 1e-8
    nope_layers: list[bool] = field(default_factory=list)


def parse_config(cfg: dict) -> MuseGlimmerConfig:
    """A ``muse_glimmer`` / ``muse_glimmer_text`` ``config.json`` -> :class:`MuseGlimmerConfig`
    (keys left out take transformers' ``MuseGlimmerTextConfig`` defaults, except the shapes
    ``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads`` and
    ``intermediate_size``, which must be given). A wrapper's own ``tie_word_embeddings``
    (default false) governs its lm_head, as transformers' ``MuseGlimmerForConditionalGeneration``
    reads it; its ``text_config``'s is not read.

    Raises:
        DFlashError: missing keys; an activation other than SiLU; a ``layer_types`` or
            ``layer_rope_theta`` of the wrong length or with other entries (a per-layer
            RoPE base other than 0 or the model's ``rope_theta``: transformers reads only
            whether it is 0); partial rotary; sliding layers without ``sliding_window``;
            a number field (e.g. the soft cap) that is not a number > 0.
    """
    wrapper = cfg.get("model_type") in WRAPPERS
    text = dict(text_config(cfg, WRAPPERS))
    for key, default in (("head_dim", 128), ("num_key_value_heads", 2), ("rms_norm_eps", 1e-5)):
        if text.get(key) is None:  # (transformers' defaults, not derived from the other shapes)
            text[key] = default
    act = text.get("hidden_activation", text.get("hidden_act"))
    if act is not None and act not in SILU_NAMES:
        raise DFlashError(f"target config.json hidden_activation {act!r} is not supported (only silu)")
    fields = base_target_fields(text, "muse_glimmer_text")
    if not fields["intermediate_size"]:
        raise DFlashError("target config.json lacks intermediate_size")
    if rotary_fraction(text) != 1.0:
        raise DFlashError("target config.json sets partial_rotary_factor; Muse Glimmer rotates whole heads")
    n = fields["num_hidden_layers"]
    types = text.get("layer_types")
    if types is None:  # transformers' default: every 4th layer counted back from the last is full attention
        types = ["full_attention" if (n - 1 - i) % 4 == 0 else "sliding_attention" for i in range(n)]
    types = check_layer_types(types, n, LAYER_TYPES, "muse_glimmer")
    thetas = text.get("layer_rope_theta")
    if thetas is None:
        nope = [(n - 1 - i) % 4 == 0 for i in range(n)]
    else:
        if not isinstance(thetas, list) or len(thetas) != n or not all(
                isinstance(t, (int, float)) and not isinstance(t, bool) for t in thetas):
            raise DFlashError(f"target layer_rope_theta must be a list of {n} numbers (num_hidden_layers), got {thetas!r}")
        other = sorted({t for t in thetas if t != 0 and t != fields["rope_theta"]})
        if other:
            raise DFlashError(f"target layer_rope_theta holds {other}, neither 0 (no RoPE) nor rope_theta "
                              f"{fields['rope_theta']}: per-layer RoPE bases are not supported")
        nope = [t == 0 for t in thetas]
    window = check_int(text, "sliding_window", "target")
    if window is None and "sliding_attention" in types and "sliding_window" in text:
        raise DFlashError("target config.json has sliding_attention layers but sliding_window is null")
    cap = number_field(text, "final_logit_softcapping", "target", 20.0)
    fields.update(
        layer_types=list(types),
        tie_word_embeddings=bool_field(cfg if wrapper else text, "tie_word_embeddings", "target", False),
        qk_norm=True,
        attention_output_gate=True,
        checkpoint_prefix=INNER if wrapper else "model.",
        sliding_window=2048 if window is None else window,
        qk_scale_factor=number_field(text, "qk_scale_factor", "target", 3.87),
        output_multiplier=number_field(text, "output_multiplier", "target", 0.19611613513818404),
        final_logit_softcapping=cap,
        post_norm_eps=number_field(text, "post_norm_eps", "target", 1e-8),
        nope_layers=nope,
    )
    return MuseGlimmerConfig(**fields)


class GatedAttention(Attention):
    """Muse Glimmer attention: weightless q/k head norms (queries times ``qk_scale``),
    optional RoPE, and an output gate from its own projection ``gate_proj`` of the layer's
    input (not from ``q_proj``, as in Qwen3.5)."""

    def __init__(self, cfg: MuseGlimmerConfig, rope: bool):
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         cfg.attention_bias, False, cfg.rms_norm_eps, o_bias=cfg.attention_bias)
        self.q_norm = UnitRMSNorm(cfg.rms_norm_eps, cfg.qk_scale_factor)
        self.k_norm = UnitRMSNorm(cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.rope = rope

    def project(self, x, cos, sin):
        """As :meth:`Attention.project`, the gate from ``gate_proj(x)``."""
        q, _, k, v = super().project(x, cos, sin)
        return q, self.gate_proj(x), k, v

    def query_gate(self, x, cos, sin):
        return super().query_gate(x, cos, sin)[0], self.gate_proj(x)


class Model(TargetModel):
    """A Muse Glimmer decoder (see the module docstring)."""

    norm_class = ScaledRMSNorm

    def __init__(self, cfg: MuseGlimmerConfig):
        super().__init__(cfg)
        self.embed_norm = UnitRMSNorm(cfg.rms_norm_eps)

    def make_layer(self, index: int, kind: str, slot: int) -> SandwichDecoderLayer:
        cfg = self.config
        norm = lambda eps: ZeroCenteredRMSNorm(cfg.hidden_size, eps)  # noqa: E731
        window = cfg.sliding_window if kind == "sliding_attention" else None
        return SandwichDecoderLayer(kind, GatedAttention(cfg, rope=not cfg.nope_layers[index]),
                                    MLP(cfg.hidden_size, cfg.intermediate_size),
                                    norm(cfg.rms_norm_eps), norm(cfg.post_norm_eps), norm(cfg.rms_norm_eps),
                                    norm(cfg.post_norm_eps), slot, sliding_window=window)

    def embed_inputs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The decoder's input rows: the embedding, then the weightless ``embed_norm``."""
        return self.embed_norm(self.model.embed_tokens(input_ids))

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``cap * tanh(lm_head(hidden) * output_multiplier / cap)`` (in the model dtype, as
        transformers computes it)."""
        cfg = self.config
        logits = self.lm_head(hidden) * cfg.output_multiplier
        return torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping

    @classmethod
    def checkpoint_keys(cls, cfg: TargetConfig, key: str) -> bool:
        """A wrapper's vision tower, adapter and projection are not read."""
        return not (cfg.checkpoint_prefix == INNER and key.startswith(VISION_PREFIXES))

    @classmethod
    def convert_checkpoint(cls, cfg: TargetConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The decoder's weights under ``model.``: ``model.language_model.X`` becomes
        ``model.X`` (for a text config too, whose weights may keep the wrapper's layout;
        ``cfg.checkpoint_prefix`` then names it, for messages).

        Raises:
            DFlashError: a checkpoint holding both layouts, or a text config over a
                checkpoint with a vision tower.
        """
        return unwrap_language_model(cfg, state, VISION_PREFIXES, "vision tower", "Muse Glimmer", "muse_glimmer")
