"""Qwen3.5 / Qwen3.6 targets: hybrid stacks of Gated DeltaNet (linear attention) and
gated full-attention layers, dense (``qwen3_5_text``) or with a mixture-of-experts MLP
and a shared expert (``qwen3_5_moe_text``), and the published multimodal wrappers
``qwen3_5`` / ``qwen3_5_moe`` (``Qwen3_5ForConditionalGeneration``: config under
``text_config``, decoder weights under ``model.language_model.``), decoded as text only.

Layout as in transformers' ``modeling_qwen3_5.py`` / ``modeling_qwen3_5_moe.py``: every
norm scales by ``(1 + weight)``, attention layers gate their output with
``sigmoid(gate)`` (the gate comes from ``q_proj``) and rotate only the first
``partial_rotary_factor`` of each head. The multimodal RoPE (``mrope_section``) gives the
same angle to the temporal, height and width sections when all three positions are
equal, as they are for text, so text decoding uses plain (partial) RoPE. A wrapper's vision
tower (``model.visual.``) and the multi-token-prediction head (``mtp.``) are not read.
"""

from __future__ import annotations

import torch

from ..errors import DFlashError
from .attention import Attention
from .config import (TargetConfig, base_target_fields, bool_field, layer_types, linear_attention_config, moe_config,
                     rotary_fraction)
from .layers import MLP, ZeroCenteredRMSNorm
from .moe import fuse_expert_weights
from .multimodal import text_config, unwrap_language_model
from .target import DecoderLayer, TargetModel, gated_deltanet, sparse_moe

QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "modelopt")  # dequantized when loading (fp8, packed_int, nvfp4)

WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
IGNORED_PREFIXES = ("mtp.", "model.mtp.")
VISION_PREFIX = "model.visual."  # only the multimodal wrappers have a vision tower


def wrapped_config(cfg: dict) -> tuple[dict, bool | None]:
    """The decoder's config dict of a wrapper or text config
    (:func:`~dflash_torch.models.multimodal.text_config`; ``eos_token_id`` and
    ``max_position_embeddings`` from the wrapper where the text config has none), and the
    wrapper's own ``tie_word_embeddings`` (which governs the wrapper's lm_head; None for a
    text config).

    Raises:
        DFlashError: a wrapper config without ``text_config``.
    """
    text = text_config(cfg, WRAPPERS, inherit=("eos_token_id", "max_position_embeddings"))
    if cfg.get("model_type") not in WRAPPERS:
        return text, None
    return text, bool_field(cfg, "tie_word_embeddings", "target", False)


def parse_config(cfg: dict) -> TargetConfig:
    """A Qwen3.5 (text, MoE or multimodal wrapper) ``config.json`` -> :class:`TargetConfig`."""
    text, wrapper_tie = wrapped_config(cfg)
    model_type = WRAPPERS.get(cfg["model_type"], cfg["model_type"])
    fields = base_target_fields(text, model_type)
    fields.update(
        qk_norm=True,
        attention_output_gate=bool_field(text, "attn_output_gate", "target", True),  # published configs say true
        layer_types=layer_types(text),
        linear_attention=linear_attention_config(text),
        tie_word_embeddings=bool_field(text, "tie_word_embeddings", "target", False) if wrapper_tie is None else wrapper_tie,
        partial_rotary_factor=rotary_fraction(text, default=0.25),  # transformers' default for Qwen3.5
        checkpoint_prefix="model.language_model." if cfg["model_type"] in WRAPPERS else "model.",
    )
    if model_type == "qwen3_5_moe_text":  # every layer is sparse; the top-k weights are always renormalised
        fields["moe"] = moe_config(text, norm_topk_prob=True, shared_expert=True)
    elif "intermediate_size" not in text:
        raise DFlashError("target config.json lacks intermediate_size")
    return TargetConfig(**fields)


class Model(TargetModel):
    """A Qwen3.5 hybrid decoder (dense or mixture of experts)."""

    norm_class = ZeroCenteredRMSNorm

    def make_layer(self, index: int, kind: str, slot: int) -> DecoderLayer:
        cfg = self.config
        if kind == "linear_attention":
            mixer = gated_deltanet(cfg)
        else:
            mixer = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                              cfg.attention_bias, True, cfg.rms_norm_eps, o_bias=cfg.attention_bias,
                              output_gate=cfg.attention_output_gate, norm=ZeroCenteredRMSNorm)
        mlp = sparse_moe(cfg) if cfg.moe_layers[index] else MLP(cfg.hidden_size, cfg.intermediate_size)
        norm = ZeroCenteredRMSNorm
        return DecoderLayer(kind, mixer, mlp, norm(cfg.hidden_size, cfg.rms_norm_eps), norm(cfg.hidden_size, cfg.rms_norm_eps), slot)

    @classmethod
    def checkpoint_keys(cls, cfg: TargetConfig, key: str) -> bool:
        """Skip the multi-token-prediction head, and a wrapper's vision tower (in a text
        checkpoint, which has none, such weights are unknown and refused)."""
        if cfg.checkpoint_prefix == "model.language_model." and key.startswith(VISION_PREFIX):
            return False
        return not key.startswith(IGNORED_PREFIXES)

    @classmethod
    def convert_checkpoint(cls, cfg: TargetConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The decoder's weights under ``model.``: a wrapper's ``model.language_model.X``
        become ``model.X`` (a text checkpoint whose weights are stored that way too, as
        transformers reads it; ``cfg.checkpoint_prefix`` is then set to it, for messages).

        Raises:
            DFlashError: see :func:`~dflash_torch.models.multimodal.unwrap_language_model`
                (a text config over a checkpoint with the vision tower; a ``model.X`` outside
                the language model and the vision tower: a tensor no format has).
        """
        state = unwrap_language_model(cfg, state, (VISION_PREFIX,), "vision tower", "Qwen3.5", "qwen3_5 or qwen3_5_moe")
        if cfg.moe is not None:
            state = fuse_expert_weights(state, cfg.moe.num_experts)
        return state
