"""Dense Llama-architecture targets: ``llama`` (Llama 2/3, optionally Llama-3.1 RoPE
scaling), ``qwen2`` (bias on q/k/v) and ``qwen3`` (per-head q/k RMSNorm)."""

from __future__ import annotations

from ..errors import DFlashError
from .attention import Attention
from .config import TargetConfig, base_target_fields, bool_field, refuse_partial_rotary, refuse_sliding_layers
from .layers import MLP, RMSNorm
from .target import DecoderLayer, TargetModel

QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "modelopt")  # dequantized when loading (fp8, packed_int, nvfp4)


def parse_config(cfg: dict) -> TargetConfig:
    """A ``qwen3`` / ``llama`` / ``qwen2`` ``config.json`` -> :class:`TargetConfig`.

    Raises:
        DFlashError: missing keys, MLP biases, sliding layers (qwen2 / qwen3:
            :func:`~dflash_torch.models.config.refuse_sliding_layers`) or partial rotary
            (not supported); a ``layer_types`` that is not a list of names (llama too).
    """
    model_type = cfg["model_type"]
    if "intermediate_size" not in cfg:
        raise DFlashError("target config.json lacks intermediate_size")
    if bool_field(cfg, "mlp_bias", "target", False):
        raise DFlashError("target configs with mlp_bias=true are not supported")
    refuse_sliding_layers(cfg, model_type)
    # (llama reads no layer_types, but transformers' config class iterates it where AutoTokenizer reads config.json)
    types = cfg.get("layer_types")
    if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
        raise DFlashError(f"target config.json layer_types must be a list of layer type names, got {types!r}")
    fields = base_target_fields(cfg, model_type)
    refuse_partial_rotary(fields, model_type)
    fields.update(
        tie_word_embeddings=bool_field(cfg, "tie_word_embeddings", "target", False),  # (transformers' default)
        # Qwen2 always has q/k/v biases (transformers' Qwen2Config saves attention_bias: null)
        attention_bias=model_type == "qwen2" or bool_field(cfg, "attention_bias", "target", False),
        qk_norm=model_type == "qwen3",
    )
    return TargetConfig(**fields)


class Model(TargetModel):
    """Pre-norm decoder layers: causal self-attention then a SwiGLU MLP."""

    def make_layer(self, index: int, kind: str, slot: int) -> DecoderLayer:
        cfg = self.config
        attn = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         cfg.attention_bias, cfg.qk_norm, cfg.rms_norm_eps,
                         o_bias=cfg.attention_bias and cfg.model_type != "qwen2")  # (Qwen2's o_proj has none)
        return DecoderLayer(kind, attn, MLP(cfg.hidden_size, cfg.intermediate_size),
                            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), slot)
