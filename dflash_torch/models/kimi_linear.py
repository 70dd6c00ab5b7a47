"""Kimi Linear targets (``kimi_linear``: ``KimiLinearForCausalLM``, Moonshot's
Kimi-Linear-48B-A3B), a hybrid of Kimi Delta Attention and multi-head latent attention over
DeepSeek-V3's mixture of experts (Kimi Team, "Kimi Linear: An Expressive, Efficient Attention
Architecture", arXiv 2510.26692). The function is transformers' ``modeling_kimi_linear.py``
(the reference in the tests), built from parts of other families:

* **Layers** per ``layer_types``: ``"linear_attention"`` is Kimi Delta Attention
  (:class:`~dflash_torch.models.kda.KimiDeltaAttention`: per-channel forget gate
  ``-exp(A_log) * softplus(f_b_proj(f_a_proj(x)) + dt_bias)`` (no lower bound), short SiLU
  convolution over ``[q, k, v]``, L2-normed q / k, beta ``sigmoid(b_proj(x))``, the delta rule,
  a sigmoid-gated RMSNorm of ``rms_norm_eps``; its recurrent state rolled back exactly after a
  verify); ``"full_attention"`` is DeepSeek-V3's multi-head latent attention
  (:class:`~dflash_torch.models.deepseek_v3.LatentAttention`, cached as its latent row,
  absorbed) **without any position encoding**: the ``qk_rope_head_dim`` channels of queries
  and of the shared key part are kept and dotted as they are, never rotated (transformers'
  ``KimiLinearAttention``; the published ``mla_use_nope: true``), the softmax scale is
  ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5`` and the low-rank norms have eps 1e-6.
  A config without ``layer_types`` takes them from ``linear_attn_config``'s ``full_attn_layers``
  / ``kda_layers`` (1-indexed, as published: Kimi-Linear-48B-A3B's full layers 4, 8, ..., 24
  and 27), else transformers' default (layers ``i > 0`` with ``i % 4 == 0`` full).
* **MLP** per ``mlp_layer_types``: ``"dense"`` a SwiGLU MLP of ``intermediate_size``,
  ``"sparse"`` DeepSeek-V3's mixture (:class:`~dflash_torch.models.deepseek_v3.DeepseekV3MoE`:
  sigmoid, group-limited router with a score correction bias, shared experts); default the
  first ``first_k_dense_replace`` (1) layers dense.
* **Config names**: the published config's keys (``num_experts``, ``num_experts_per_token``,
  ``num_expert_group``, ``num_shared_experts``, ``moe_renormalize``, ``model_max_length``,
  ``linear_attn_config``'s ``num_heads`` / ``head_dim`` / ``short_conv_kernel_size``) read as
  transformers reads them, as do its own (``num_local_experts``, ``num_experts_per_tok``,
  ``n_group``, ``n_shared_experts``, ``norm_topk_prob``, ``max_position_embeddings``,
  ``linear_num_heads``, ...); both names with different values are refused. What the published
  remote code would run differently from transformers' class is refused in one line
  (``mla_use_nope`` false, a ``gate_lower_bound``, routing other than sigmoid, ...).

**Checkpoints**: transformers' in-memory names, or the published ones (what ``save_pretrained``
writes): KDA's forget gate flat under ``self_attn.`` and its convolution split in three
(:func:`~dflash_torch.models.kda.convert_layer`), ``A_log`` ``[1, 1, heads, 1]`` (held as
``[heads]``), the MLP under ``block_sparse_moe.`` with per-expert ``w1`` (gate), ``w3`` (up),
``w2`` (down), stacked when loading. Multi-token-prediction layers that a
``num_nextn_predict_layers`` announces are not read (:mod:`.deepseek_v3`'s rule; Kimi Linear
has none); any other unknown weight is refused. Quantized checkpoints are refused.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from ..cache import KVCache
from ..errors import DFlashError
from . import deepseek_v3, kda
from .config import check_int
from .layers import MLP, RMSNorm
from .target import DecoderLayer, _Step

QUANTIZATION_METHODS = ()  # (none read: a quantized checkpoint is refused in one line)
LAYER_TYPES = ("full_attention", "linear_attention")
MLP_TYPES = ("dense", "sparse")
# transformers' KimiLinearConfig defaults (Kimi-Linear-48B-A3B's shapes), for keys a config.json leaves out
DEFAULTS = dict(vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024,
                num_hidden_layers=27, num_attention_heads=32, routed_scaling_factor=2.446, kv_lora_rank=512,
                q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_group=1,
                hidden_act="silu", rms_norm_eps=1e-5, eos_token_id=163586, tie_word_embeddings=False,
                attention_bias=False, linear_head_dim=128, linear_num_heads=32, linear_conv_kernel_dim=4,
                num_nextn_predict_layers=0)
# transformers' attribute -> the published config's key for it (KimiLinearConfig.attribute_map), and its default
ALIASES = {"num_local_experts": ("num_experts", 256), "n_group": ("num_expert_group", 1),
           "num_experts_per_tok": ("num_experts_per_token", 8), "n_shared_experts": ("num_shared_experts", 1),
           "norm_topk_prob": ("moe_renormalize", True), "max_position_embeddings": ("model_max_length", 1048576)}
# linear_attn_config's keys -> transformers' attributes
LINEAR_KEYS = {"head_dim": "linear_head_dim", "num_heads": "linear_num_heads",
               "short_conv_kernel_size": "linear_conv_kernel_dim"}
ROPE_KEYS = ("head_dim", "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor")  # (no RoPE here)
FLOAT32_SUFFIXES = (".gate.weight", ".gate.e_score_correction_bias", ".dt_bias")  # transformers' fp32 modules
_EXPERT = re.compile(r"\.experts\.(\d+)\.(w1|w2|w3)\.")
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@dataclasses.dataclass
class KimiLinearConfig(deepseek_v3.DeepseekV3Config):
    """:class:`~dflash_torch.models.deepseek_v3.DeepseekV3Config` (MLA shapes, router) plus the
    KDA layers' shapes; ``layer_types`` holds ``"linear_attention"`` or ``"full_attention"`` per
    layer. ``published_names``: the checkpoint uses the published names (set when loading)."""

    linear_num_heads: int = 32
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    published_names: bool = False


def _refuse(text: str) -> None:
    raise DFlashError(f"target config.json {text}")


def _aliased(cfg: dict) -> dict:
    """``cfg`` with each of transformers' attribute names of :data:`ALIASES` set from the
    published key (which wins, as transformers reads it) or its own, else the default.

    Raises:
        DFlashError: one line: both names given with different values.
    """
    out = dict(cfg)
    for ours, (published, default) in ALIASES.items():
        if published in cfg and ours in cfg and cfg[published] != cfg[ours]:
            _refuse(f"gives {published} {cfg[published]!r} and {ours} {cfg[ours]!r}: transformers reads them as "
                    "one setting")
        out[ours] = cfg[published] if published in cfg else cfg.get(ours, default)
    return out


def _layer_indices(linear: dict, key: str, layers: int) -> list[int]:
    value = linear[key]
    if not isinstance(value, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= layers
                                          for i in value):
        _refuse(f"linear_attn_config {key} must list layer numbers from 1 to num_hidden_layers {layers} "
                f"(1-indexed), got {value!r}")
    return value


def layer_types(text: dict, layers: int) -> list[str]:
    """``layer_types`` as transformers' ``KimiLinearConfig`` derives it: given, else from
    ``linear_attn_config``'s ``full_attn_layers`` and ``kda_layers`` (1-indexed; both needed),
    else layers ``i > 0`` with ``i % 4 == 0`` full attention.

    Raises:
        DFlashError: one line: not one known type per layer; a layer listed in neither or both
            lists, or a number outside ``1..num_hidden_layers``; lists that disagree with
            ``layer_types``.
    """
    linear = text.get("linear_attn_config") or {}
    listed = None
    if "full_attn_layers" in linear and "kda_layers" in linear:
        full, recurrent = (_layer_indices(linear, k, layers) for k in ("full_attn_layers", "kda_layers"))
        counts = [full.count(i + 1) + recurrent.count(i + 1) for i in range(layers)]
        if counts != [1] * layers:
            _refuse(f"linear_attn_config full_attn_layers {full} and kda_layers {recurrent} must name each of the "
                    f"{layers} layers (1-indexed) once")
        listed = ["full_attention" if i + 1 in full else "linear_attention" for i in range(layers)]
    types = text.get("layer_types")
    if types is None:
        types = listed or ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        _refuse(f"layer_types must give 'full_attention' or 'linear_attention' for each of the {layers} layers, "
                f"got {types!r}")
    if listed is not None and listed != types:
        _refuse("layer_types disagrees with linear_attn_config's full_attn_layers / kda_layers (1-indexed)")
    return types


def mlp_layers(text: dict, layers: int) -> list[bool]:
    """Which layers are a mixture of experts: ``mlp_layer_types`` (``"dense"`` / ``"sparse"``),
    else the layers from ``first_k_dense_replace`` (default 1) on, as transformers builds them.

    Raises:
        DFlashError: one line: not one known type per layer; a ``first_k_dense_replace`` that
            names other dense layers than ``mlp_layer_types``.
    """
    first = check_int(text, "first_k_dense_replace", "target", minimum=0)
    types = text.get("mlp_layer_types")
    if types is None:
        return [i >= (1 if first is None else first) for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in MLP_TYPES for t in types):
        _refuse(f"mlp_layer_types must list 'dense' or 'sparse' for each of the {layers} layers, got {types!r}")
    sparse = [t == "sparse" for t in types]
    if first is not None and sparse != [i >= first for i in range(layers)]:
        _refuse(f"first_k_dense_replace {first} disagrees with mlp_layer_types (dense layers "
                f"{[i for i, s in enumerate(sparse) if not s]}; transformers builds those of mlp_layer_types)")
    return sparse


def parse_config(cfg: dict) -> KimiLinearConfig:
    """A ``kimi_linear`` ``config.json`` -> :class:`KimiLinearConfig` (keys left out take
    transformers' ``KimiLinearConfig`` defaults; see the module docstring for the names read).

    Raises:
        DFlashError: one line: a key of the wrong type or out of range; both names of a setting
            with different values; ``mla_use_nope`` false (the remote code would rotate the
            latent attention's RoPE channels, transformers' class never does);
            ``linear_attn_config`` with a ``gate_lower_bound`` (transformers' forget gate has
            none); ``moe_router_activation_func`` other than sigmoid; ``use_grouped_topk`` false
            with fewer groups chosen than there are; ``num_key_value_heads`` other than the heads;
            ``moe_layer_freq`` other than 1; ``hidden_act`` other than silu; those of
            :func:`layer_types` and :func:`mlp_layers`; expert groups that do not fit
            (:func:`~dflash_torch.models.deepseek_v3.check_expert_groups`).
    """
    text = _aliased({**DEFAULTS, **cfg})
    linear = text.get("linear_attn_config")
    if linear is not None and not isinstance(linear, dict):
        _refuse(f"linear_attn_config must be an object, got {linear!r}")
    for theirs, ours in LINEAR_KEYS.items():  # (linear_attn_config wins, as transformers reads it)
        if linear and theirs in linear:
            text[ours] = linear[theirs]
    if linear and linear.get("gate_lower_bound") is not None:
        _refuse(f"linear_attn_config gate_lower_bound {linear['gate_lower_bound']!r} is not supported "
                "(transformers' kimi_linear forget gate is the unbounded softplus one)")
    if text.get("mla_use_nope", True) is not True:
        _refuse(f"mla_use_nope {text['mla_use_nope']!r} is not supported (transformers' kimi_linear latent "
                "attention has no position encoding: mla_use_nope true)")
    if text.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        _refuse(f"moe_router_activation_func {text['moe_router_activation_func']!r} is not supported (only sigmoid)")
    for key in ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "num_hidden_layers",
                "num_local_experts", "n_group", "num_experts_per_tok", "n_shared_experts", "topk_group"):
        if text.get(key) is None:
            _refuse(f"has null {key}")
        check_int(text, key, "target")
    if text.get("use_grouped_topk") is False and text["topk_group"] < text["n_group"]:
        _refuse(f"use_grouped_topk false with topk_group {text['topk_group']} < num_expert_group {text['n_group']} "
                "is not supported (transformers always limits the experts to the chosen groups)")
    layers = text["num_hidden_layers"]
    kinds = layer_types(text, layers)
    sparse = mlp_layers(text, layers)
    # DeepSeek-V3's parse for the latent attention and the router, with no RoPE and the layers set below
    ds = {k: v for k, v in text.items() if k not in ROPE_KEYS + ("first_k_dense_replace", "mlp_layer_types")}
    ds.update(n_routed_experts=text["num_local_experts"], first_k_dense_replace=0, rope_interleave=False)
    base = deepseek_v3.parse_config(ds)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    fields.update(
        head_dim=text["qk_rope_head_dim"],  # (transformers' convention; no RoPE table is built)
        softmax_scale=(text["qk_nope_head_dim"] + text["qk_rope_head_dim"]) ** -0.5,
        layer_types=kinds,
        moe_layers=sparse,
        linear_num_heads=text["linear_num_heads"],
        linear_head_dim=text["linear_head_dim"],
        linear_conv_kernel_dim=text["linear_conv_kernel_dim"],
    )
    return KimiLinearConfig(**fields)


class Model(deepseek_v3.Model):
    """Kimi Linear's decoder (see the module docstring): KDA or position-free latent attention,
    then a dense MLP or DeepSeek-V3's mixture of experts, each pre-norm and residual."""

    def make_layer(self, index: int, kind: str, slot: int) -> DecoderLayer:
        cfg = self.config
        if kind == "linear_attention":
            mixer = kda.KimiDeltaAttention(cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim,
                                           cfg.linear_conv_kernel_dim, cfg.rms_norm_eps, None)
        else:
            mixer = deepseek_v3.LatentAttention(cfg)
        mlp = deepseek_v3.DeepseekV3MoE(cfg) if cfg.moe_layers[index] else MLP(cfg.hidden_size, cfg.intermediate_size)
        return DecoderLayer(kind, mixer, mlp, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
                            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), slot)

    def make_rotary(self) -> nn.Module:
        return nn.ModuleDict()  # (no position encoding anywhere: no tables)

    @staticmethod
    def _self_attention(layer: DecoderLayer, h: torch.Tensor, kv: KVCache, step: _Step) -> torch.Tensor:
        attn = layer.self_attn
        cos, sin = h.new_ones(h.shape[0], attn.rope_dim), h.new_zeros(h.shape[0], attn.rope_dim)  # (the identity)
        q, latent = attn.project(h, cos, sin)
        kv.write(layer.slot, step.positions, *attn.halves(latent))
        return attn.output(attn.attend(q, *kv.view(layer.slot, step.kv_len), step.biases[None, 1]))

    # --- loading ---

    @classmethod
    def convert_checkpoint(cls, cfg: KimiLinearConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The published names to ours (see the module docstring): ``block_sparse_moe.`` ->
        ``mlp.``, experts' ``w1`` / ``w3`` / ``w2`` -> ``gate_proj`` / ``up_proj`` /
        ``down_proj``, a KDA layer's ``self_attn.*`` -> ``linear_attn.*``
        (:func:`~dflash_torch.models.kda.convert_layer`), ``A_log`` ``[1, 1, heads, 1]`` ->
        ``[heads]``; then per-expert weights stacked.

        Raises:
            DFlashError: a weight held under two of its names; see
                :func:`~dflash_torch.models.kda.convert_layer` and
                :func:`~dflash_torch.models.moe.fuse_expert_weights`.
        """
        cfg.published_names = any(".block_sparse_moe." in k or k.endswith(kda.CONV_PARTS) for k in state)
        for key in [k for k in state if ".block_sparse_moe." in k]:
            new = key.replace(".block_sparse_moe.", ".mlp.")
            kda.rename_weight(state, key, _EXPERT.sub(lambda m: f".experts.{m[1]}.{_PROJ[m[2]]}.", new))
        for i, kind in enumerate(cfg.layer_types):
            if kind == "linear_attention":
                layer = f"model.layers.{i}."
                kda.convert_layer(state, layer, i)
                a_log = state.get(layer + "linear_attn.forget_gate.A_log")
                if a_log is not None and tuple(a_log.shape) == (1, 1, cfg.linear_num_heads, 1):
                    state[layer + "linear_attn.forget_gate.A_log"] = a_log.reshape(-1)
        return super().convert_checkpoint(cfg, state)

    @classmethod
    def checkpoint_name(cls, cfg: KimiLinearConfig, key: str) -> str:
        """The checkpoint's name of our parameter ``key``: transformers' in-memory name, or the
        published one where the checkpoint uses those."""
        key = kda.checkpoint_name(key, cfg.published_names)
        m = re.match(r"^model\.layers\.(\d+)\.mlp\.", key)
        if cfg.published_names and m and cfg.moe_layers[int(m[1])]:
            last = cfg.moe.num_experts - 1
            key = key.replace(".mlp.experts.gate_up_proj", ".mlp.experts.{0..%d}.w1/w3" % last)
            key = key.replace(".mlp.experts.down_proj", ".mlp.experts.{0..%d}.w2" % last)
            key = key.replace(".mlp.", ".block_sparse_moe.")
        return key

    @classmethod
    def float32_keys(cls, cfg: KimiLinearConfig, key: str) -> bool:
        """The router's weight and score correction bias and KDA's ``dt_bias`` stay float32 (as
        in transformers; ``A_log`` and the convolution take the model's dtype there too)."""
        return key.endswith(FLOAT32_SUFFIXES)
