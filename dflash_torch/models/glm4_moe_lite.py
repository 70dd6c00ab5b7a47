"""GLM-4-MoE-Lite targets (``glm4_moe_lite``, ``Glm4MoeLiteForCausalLM``: GLM-4.7-Flash, a
30B-A3B mixture of experts), run by :mod:`.deepseek_v3`'s model.

transformers builds ``Glm4MoeLiteForCausalLM`` from DeepSeek-V3's parts: its attention is
``DeepseekV3Attention`` (multi-head latent attention, the same low-rank norms of eps 1e-6,
``rope_interleave``, the softmax scale times DeepSeek's YaRN ``mscale_all_dim`` factor), its
router and experts GLM-4-MoE's, which compute what DeepSeek-V3's do (``sigmoid`` scores, experts
chosen on ``scores + e_score_correction_bias`` within the ``topk_group`` best of ``n_group``
groups, weighted by their plain scores, renormalised when ``norm_topk_prob`` and times
``routed_scaling_factor``; ``n_shared_experts`` shared experts; the router's weight and bias
float32 in every dtype). Its RoPE tables are ``qk_rope_head_dim`` wide (``head_dim`` is an
alias of it). So a ``glm4_moe_lite`` config is parsed into a
:class:`~dflash_torch.models.deepseek_v3.DeepseekV3Config` and run, cached (the latent row:
``kv_lora_rank + qk_rope_head_dim`` = 576 values a token and layer for GLM-4.7-Flash) and loaded
(FP8 blocks and compressed-tensors integers as there) by that module's model. What differs:

* **Which layers are experts**: ``mlp_layer_types``, one ``"dense"`` (a SwiGLU MLP of
  ``intermediate_size``) or ``"sparse"`` (the mixture) per layer, default the first dense and
  the rest sparse (transformers' default) instead of ``first_k_dense_replace``. A config that
  also gives ``first_k_dense_replace`` (as the published one does, for other engines) must name
  the same layers: where they disagree transformers and those engines would build different
  models, so it is refused.
* **Defaults**: transformers' ``Glm4MoeLiteConfig``'s (GLM-4.7-Flash's shapes).
* **The multi-token-prediction layer**: stored as ``model.layers.{num_hidden_layers + i}.*``
  (layer 47 of GLM-4.7-Flash, which transformers' class ignores by that name), announced by
  ``num_nextn_predict_layers`` (default 0: transformers' config has no such key); those layers
  are not read, and any other unknown weight is refused.
"""

from __future__ import annotations

from ..errors import DFlashError
from . import deepseek_v3
from .config import check_int

QUANTIZATION_METHODS = deepseek_v3.QUANTIZATION_METHODS
MLP_TYPES = ("dense", "sparse")
# transformers' Glm4MoeLiteConfig defaults, for keys a config.json leaves out (an explicit null stays null)
DEFAULTS = dict(vocab_size=154880, hidden_size=2048, intermediate_size=10240, moe_intermediate_size=1536,
                num_hidden_layers=47, num_attention_heads=20, num_key_value_heads=20, n_shared_experts=1,
                n_routed_experts=64, routed_scaling_factor=1.8, kv_lora_rank=512, q_lora_rank=768, qk_rope_head_dim=64,
                v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1, num_experts_per_tok=4,
                norm_topk_prob=True, max_position_embeddings=202752, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1,
                tie_word_embeddings=False, rope_interleave=True, attention_bias=False, num_nextn_predict_layers=0)


def mlp_layer_types(cfg: dict) -> list[bool]:
    """Which layers are a mixture of experts, from ``mlp_layer_types`` (default: all but the
    first) and, when given, ``first_k_dense_replace`` (``cfg``: with :data:`DEFAULTS` filled in).

    Raises:
        DFlashError: one line: ``mlp_layer_types`` not a list of ``num_hidden_layers`` values
            of ``"dense"`` / ``"sparse"``; a ``first_k_dense_replace`` naming other dense layers.
    """
    layers = cfg["num_hidden_layers"]
    types = cfg.get("mlp_layer_types")
    if types is None:
        types = ["dense"] + ["sparse"] * (layers - 1)
    if not isinstance(types, list) or len(types) != layers or any(t not in MLP_TYPES for t in types):
        raise DFlashError(f"target config.json mlp_layer_types must list 'dense' or 'sparse' for each of the "
                          f"{layers} layers, got {types!r}")
    sparse = [t == "sparse" for t in types]
    first_dense = check_int(cfg, "first_k_dense_replace", "target", minimum=0)
    if first_dense is not None and sparse != [i >= first_dense for i in range(layers)]:
        raise DFlashError(f"target config.json first_k_dense_replace {first_dense} disagrees with mlp_layer_types "
                          f"(dense layers {[i for i, s in enumerate(sparse) if not s]}; transformers' glm4_moe_lite "
                          "builds those of mlp_layer_types, default the first dense)")
    return sparse


def parse_config(cfg: dict) -> deepseek_v3.DeepseekV3Config:
    """A ``glm4_moe_lite`` ``config.json`` -> :class:`~dflash_torch.models.deepseek_v3.DeepseekV3Config`
    (``model_type`` ``glm4_moe_lite``; keys left out take transformers' ``Glm4MoeLiteConfig``
    defaults).

    Raises:
        DFlashError: one line: those of :func:`mlp_layer_types`; a ``head_dim`` other than
            ``qk_rope_head_dim`` (transformers reads ``head_dim`` as that key); and those of
            :func:`deepseek_v3.parse_config <dflash_torch.models.deepseek_v3.parse_config>`
            (routing, shapes, partial rotary factor, ...).
    """
    text = {**DEFAULTS, **cfg}
    check_int(text, "num_hidden_layers", "target")
    if text.get("head_dim") is not None and text["head_dim"] != text.get("qk_rope_head_dim"):
        raise DFlashError(f"target config.json head_dim {text['head_dim']!r} != qk_rope_head_dim "
                          f"{text.get('qk_rope_head_dim')!r} (transformers' glm4_moe_lite reads head_dim as qk_rope_head_dim)")
    sparse = mlp_layer_types(text)
    # first_k_dense_replace only to satisfy deepseek_v3's parse: the layers are set from mlp_layer_types below
    text = {k: v for k, v in text.items() if k != "mlp_layer_types"} | {"first_k_dense_replace": 0}
    config = deepseek_v3.parse_config(text)
    config.moe_layers = sparse
    return config


class Model(deepseek_v3.Model):
    """GLM-4-MoE-Lite: DeepSeek-V3's decoder layers (latent attention, then a dense MLP or the
    mixture of experts, as ``mlp_layer_types`` says), checkpoint names and loading."""
