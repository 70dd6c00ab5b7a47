"""GLM-5.3-Flash targets (``glm5_next``: ``Glm5NextForConditionalGeneration``, a multimodal
wrapper whose ``text_config`` is a ``glm5_next_text`` decoder; ``glm5_next_text`` itself),
decoded as text: the vision tower (``model.visual.*``) is not read. The function is
transformers' ``modeling_glm5_next.py`` (the reference in the tests); built from parts of
other families:

* **Hyper-connections (mHC)**, as DeepSeek-V4's (:class:`~dflash_torch.models.deepseek_v4.HyperConnection`,
  the same function): ``hc_mult`` residual streams per token (the embedding copied into
  each), collapsed before each sublayer (``pre``), expanded after it (``post``) and mixed by a
  doubly-stochastic ``comb`` (softmax then ``hc_sinkhorn_iters`` Sinkhorn steps). Unlike
  DeepSeek-V4, the head collapses the streams by their plain mean (no ``hc_head`` weights)
  before the final norm and the LM head.
* **Layers** per ``layer_types``: ``"linear_attention"`` is Kimi Delta Attention
  (:mod:`.kda`: per-channel forget gate, short convolution, L2-normed q/k, delta rule,
  sigmoid-gated RMSNorm; its recurrent state rolled back exactly after a verify);
  ``"indexed_attention"`` (``"full_attention"`` reads as it, as in transformers) is
  DeepSeek-V3's multi-head latent attention (:class:`~dflash_torch.models.deepseek_v3.LatentAttention`,
  absorbed over a latent row cache) **without any position encoding** (``qk_rope_head_dim``
  must be 0: NoPE; softmax scale ``qk_nope_head_dim ** -0.5``; the two low-rank norms use
  ``rms_norm_eps``, not DeepSeek-V3's 1e-6), with a **pooled sparse-attention indexer**.
  Default: every fourth layer (``i % 4 == 3``) indexed, the others KDA.
* **The pooled indexer** (Hugging Face ``self_attn.indexer.*``: ``wq_b``, ``wk``, ``k_norm``
  (LayerNorm with bias, eps 1e-6), ``weights_proj``, ``index_kpool_compress_ape``
  ``[kpool, D]``, ``index_kpool_compress_gate`` ``[D, hidden]``). Each token ``j`` has an index
  key ``k_j = k_norm(wk(x_j))`` and gate logits ``a_j = index_kpool_compress_gate x_j``
  (``D = index_head_dim`` each, no RoPE). The tokens are grouped in pools of ``index_kpool``
  from position 0; a complete pool ``p`` has the key ``K_p = sum_i softmax_i(a_i + ape_i) *
  k_i`` (softmax over the pool's tokens, per channel). A query scores a pool as DeepSeek's
  lightning indexer scores a token, ``sum_h w_h relu(q_h . K_p) / sqrt(D)`` in float32
  (``q = wq_b(q_resid)``, ``w = weights_proj(x) / sqrt(index_n_heads)``), among the pools
  whose last token it sees, and keeps the ``index_topk / index_kpool`` best (all of them
  while it sees no more); it attends to the tokens of the chosen pools plus its own
  incomplete pool (the "tail": ``index_kpool_always_select_tail``, which must be true). Equal
  scores are kept lowest pool first (a stable sort, as :mod:`.deepseek_v32` does: the choice
  depends only on the query's causal prefix, so a verify block chooses what one token at a
  time would); transformers' ``topk`` picks among exact ties as it happens to.
* **Shared layers**: ``indexer_types`` per layer, ``"full"`` (an indexed layer runs its
  indexer) or ``"shared"`` (it reuses the choice of the indexed layer just before it; that
  layer must be a full indexed layer, as transformers passes the choice from one layer to
  the next only). Default, as transformers' config derives it: ``index_topk_pattern`` (``F`` /
  ``S`` letters, or a list), else ``index_topk_freq`` / ``index_skip_topk_offset`` (every layer
  full by default).
* **MLP** per ``mlp_layer_types`` (default: the first three layers dense): a SwiGLU MLP of
  ``intermediate_size`` or DeepSeek-V3's routed experts (its router,
  :class:`~dflash_torch.models.deepseek_v3.TopkRouter`: sigmoid scores, groups, score correction
  bias, ``routed_scaling_factor``) plus ``n_shared_experts`` shared experts; every SwiGLU here
  (dense, routed, shared) clamps at ``swiglu_limit`` (gate at most, up both sides), as
  DeepSeek-V4's (:class:`~dflash_torch.models.deepseek_v4.ClampedMLP`).
* The router's weight and bias, KDA's ``conv1d``, ``dt_bias`` and ``A_log`` and the
  hyper-connections' ``base`` and ``scale`` are held in float32 in every dtype (transformers'
  ``_keep_in_fp32_modules_strict``).

**Cache.** An indexed layer caches one latent row per token, ``[c, index_k, a]`` with a full
indexer (``kv_lora_rank + 2 * index_head_dim`` = 768 values for GLM-5.3-Flash) or ``[c]``
(512) on a shared layer, split into the engine's key and value buffers as
:mod:`.deepseek_v3` splits its rows (so batching, fixed shapes, prefix reuse, compiled rounds
and the memory accounting work as they are; rollback by length: a query only ever reads pools
whose tokens precede it). Each KDA layer keeps ``[heads, d, d]`` float32 plus ``kernel - 1``
convolution inputs per sequence (:class:`~dflash_torch.cache.RecurrentState`).

**Context features for drafters**: as DeepSeek-V4's, layer ``l``'s feature row is its
``hc_mult`` output streams one after another (``hc_mult * hidden_size`` values: transformers'
``hidden_states[l + 1]`` flattened); ``num_hidden_layers`` is the last layer's streams,
:data:`~dflash_torch.models.target.EMBEDDING_OUTPUT` the embedding in each stream.

**Checkpoints**: the decoder under ``model.language_model.`` (transformers' layout; ``model.``
read too with a ``glm5_next_text`` config: a ``glm5_next`` one, as transformers' wrapper, reads
only the former), ``lm_head.weight``; per-expert weights are stacked when loading; the
multi-token-prediction layers ``model.language_model.layers.{num_hidden_layers + i}.*`` (``i <
num_nextn_predict_layers``, default 1: transformers skips layer 45 of the published model)
and a shared layer's indexer weights are not read; any other unknown weight is refused.
Fine-grained FP8 (DeepSeek's format: ``weight_scale_inv`` per block) loads through :mod:`.fp8`,
dequantized when loading or, with ``--fp8 packed``, kept FP8 (every decoder linear, KDA's and the
indexer's included, as an :class:`~dflash_torch.models.fp8.Fp8Linear`; the experts as stored;
``kv_b_proj``, which the absorbed attention reads per head, dequantized when loading); other
quantized checkpoints are refused in one line.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import KVCache
from ..errors import DFlashError
from . import deepseek_v3, deepseek_v32, kda
from .config import MoEConfig, base_target_fields, bool_field, check_int, number_field
from .deepseek_v4 import ClampedMLP, HyperConnection, mix_streams
from .kda import KimiDeltaAttention
from .layers import RMSNorm, attention_bias
from .moe import Experts, dispatch_experts, fuse_expert_weights
from .multimodal import INNER, text_config, unwrap_language_model
from .target import EMBEDDING_OUTPUT, DecoderLayer, _Step, visible_rows

QUANTIZATION_METHODS = ("fp8",)  # fine-grained FP8 (fp8.py); any other quantized checkpoint is refused in one line
WRAPPERS = ("glm5_next",)
TEXT_MODEL_TYPE = "glm5_next_text"
TOWERS = ("model.visual.",)
LAYER_TYPES = ("linear_attention", "indexed_attention")
_SCORES_PER_CHUNK = 1 << 25  # indexer scores held at once (query rows are taken in chunks)
# transformers' Glm5NextTextConfig defaults (GLM-5.3-Flash's shapes), for keys a config.json leaves out
DEFAULTS = dict(vocab_size=154880, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=2048,
                num_hidden_layers=45, num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1,
                n_routed_experts=288, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                qk_rope_head_dim=0, v_head_dim=256, qk_nope_head_dim=256, n_group=1, topk_group=1,
                num_experts_per_tok=8, norm_topk_prob=True, hidden_act="silu", max_position_embeddings=1048576,
                rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, index_topk=2048,
                index_head_dim=128, index_n_heads=32, swiglu_limit=10.0, linear_head_dim=128, linear_num_heads=64,
                linear_conv_kernel_dim=4, linear_lower_bound=-5.0, hc_mult=4, hc_eps=1e-6, hc_sinkhorn_iters=20,
                index_kpool=16, index_kpool_always_select_tail=True, num_nextn_predict_layers=1)
FLOAT32_SUFFIXES = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias", "conv1d.weight", ".dt_bias", ".A_log",
                    "_hc.base", "_hc.scale", ".hc_attn_base", ".hc_attn_scale", ".hc_ffn_base", ".hc_ffn_scale")
# the published checkpoint's names (what save_pretrained writes) of a layer's parameters -> transformers' in-memory ones
HC_NAMES = {f"hc_{part}_{w}": f"{part}_hc.{w}" for part in ("attn", "ffn") for w in ("fn", "base", "scale")}


@dataclasses.dataclass
class Glm5NextConfig(deepseek_v32.DsaConfig):
    """:class:`~dflash_torch.models.deepseek_v32.DsaConfig` (MLA shapes, router, indexer sizes,
    ``indexer_full``) plus GLM-5.3-Flash's: KDA shapes, the indexer's pools, hyper-connections,
    the SwiGLU clamp. ``layer_types`` holds ``"linear_attention"`` or ``"full_attention"`` (an
    indexed layer) per layer; ``wrapped``: a ``glm5_next`` (multimodal) config."""

    linear_num_heads: int = 64
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    index_kpool: int = 16
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    swiglu_limit: float = 10.0
    published_names: bool = False  # the checkpoint uses the published names (hc_attn_fn ...; set when loading)

    @property
    def feature_size(self) -> int:
        """A layer's feature row: its ``hc_mult`` output streams, ``hc_mult * hidden_size`` values."""
        return self.hc_mult * self.hidden_size


def _indexer_modes(text: dict, layers: int) -> list[str]:
    """``indexer_types`` as transformers' ``Glm5NextTextConfig`` derives it (see the module
    docstring), checked.

    Raises:
        DFlashError: one line: not ``num_hidden_layers`` values of ``"full"`` / ``"shared"``
            (a pattern: ``F`` / ``S``); a non-integer or non-positive ``index_topk_freq``.
    """
    types, where = text.get("indexer_types"), "indexer_types"
    if types is None and text.get("index_topk_pattern") is not None:
        pattern, where = text["index_topk_pattern"], "index_topk_pattern"
        if isinstance(pattern, str):
            if any(c not in deepseek_v32.PATTERN_LETTERS for c in pattern):
                raise DFlashError(f"target config.json index_topk_pattern must be a string of 'F' (full) and 'S' "
                                  f"(shared), got {pattern!r}")
            pattern = [deepseek_v32.PATTERN_LETTERS[c] for c in pattern]
        types = pattern
    elif types is None:
        freq = check_int(text, "index_topk_freq", "target")
        offset = check_int(text, "index_skip_topk_offset", "target", minimum=-(1 << 62))
        freq, offset = freq or 1, 2 if offset is None else offset
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
        where = f"index_topk_freq {freq} / index_skip_topk_offset {offset}"
    if not isinstance(types, list) or len(types) != layers or any(t not in deepseek_v32.INDEXER_TYPES for t in types):
        raise DFlashError(f"target config.json {where} must give 'full' or 'shared' for each of the {layers} layers, "
                          f"got {types!r}")
    return types


def parse_config(cfg: dict) -> Glm5NextConfig:
    """A ``glm5_next`` (its ``text_config``; a config without one keeps the text keys at the top
    level, as transformers reads it) or ``glm5_next_text`` ``config.json`` ->
    :class:`Glm5NextConfig` (keys left out take transformers' defaults, GLM-5.3-Flash's shapes;
    the wrapper's ``tie_word_embeddings`` governs the head, its ``eos_token_id`` serves where the
    text config has none; ``linear_attn_config`` is read as transformers reads it).

    Raises:
        DFlashError: one line: a ``glm5_next`` config with neither a ``text_config`` nor text
            keys at the top level; a ``text_config`` of another model type; a key of the wrong
            type or out of range; ``qk_rope_head_dim`` other than 0 (transformers' GLM-5.3-Flash
            attention is NoPE); a null ``q_lora_rank``; ``num_key_value_heads`` other than the
            heads; ``index_topk`` not a multiple of ``index_kpool``;
            ``index_kpool_always_select_tail`` false; ``hidden_act`` other than silu;
            ``layer_types`` / ``mlp_layer_types`` / ``indexer_types`` not one known value per
            layer; a shared indexed layer not right after a full indexed layer (transformers
            cannot run it); expert groups that do not fit (see
            :func:`~dflash_torch.models.deepseek_v3.check_expert_groups`).
    """
    wrapped = cfg.get("model_type") in WRAPPERS
    if wrapped and cfg.get("text_config") is None:  # (a flat config: the text keys at the top level)
        if not any(k in cfg for k in DEFAULTS if k != "tie_word_embeddings"):  # (the wrapper's own key)
            raise DFlashError("target config.json of model_type 'glm5_next' lacks text_config (and keeps no text "
                              "keys, such as hidden_size, at the top level)")
        text = {k: v for k, v in cfg.items() if k not in ("vision_config", "model_type", "architectures")}
    else:
        text = text_config(cfg, WRAPPERS, inherit=("eos_token_id",))
        if wrapped and text.get("model_type", TEXT_MODEL_TYPE) != TEXT_MODEL_TYPE:
            raise DFlashError(f"target config.json of model_type 'glm5_next' has a text_config of model_type "
                              f"{text.get('model_type')!r}; expected {TEXT_MODEL_TYPE}")
    text = {**DEFAULTS, **text}
    linear = text.get("linear_attn_config")
    if isinstance(linear, dict):  # (transformers' reading of the original checkpoint's dict)
        for ours, theirs in (("linear_head_dim", "head_dim"), ("linear_num_heads", "num_heads"),
                             ("linear_conv_kernel_dim", "short_conv_kernel_size"),
                             ("linear_lower_bound", "gate_lower_bound")):
            text[ours] = linear.get(theirs, text[ours])
        if linear.get("safe_gate", True) and text["linear_lower_bound"] is None:
            text["linear_lower_bound"] = -5.0
    ints = ("num_hidden_layers", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim", "n_routed_experts",
            "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group", "n_shared_experts",
            "intermediate_size", "index_topk", "index_head_dim", "index_n_heads", "index_kpool", "linear_head_dim",
            "linear_num_heads", "linear_conv_kernel_dim", "hc_mult", "hc_sinkhorn_iters")
    missing = [k for k in ints if text.get(k) is None]
    if missing:
        raise DFlashError(f"target config.json has null {', '.join(missing)}")
    for key in ints:
        check_int(text, key, "target")
    check_int(text, "num_nextn_predict_layers", "target", minimum=0)
    rope = text.get("qk_rope_head_dim")
    if rope != 0:
        raise DFlashError(f"target config.json qk_rope_head_dim {rope!r} is not supported: transformers' glm5_next "
                          "attention has no position encoding (it must be 0)")
    heads = check_int(text, "num_attention_heads", "target")
    kv_heads = check_int(text, "num_key_value_heads", "target")
    if kv_heads is not None and kv_heads != heads:
        raise DFlashError(f"target num_key_value_heads {kv_heads} != num_attention_heads {heads}: multi-head latent "
                          "attention expands its latent to every head")
    if text["index_topk"] % text["index_kpool"]:
        raise DFlashError(f"target index_topk {text['index_topk']} must be a multiple of index_kpool "
                          f"{text['index_kpool']} (the indexer keeps index_topk / index_kpool pools)")
    if not bool_field(text, "index_kpool_always_select_tail", "target", True):
        raise DFlashError("target config.json index_kpool_always_select_tail false is not supported (a query would "
                          "not see its own incomplete pool, itself included)")
    if text.get("hidden_act") != "silu":
        raise DFlashError(f"target config.json hidden_act {text.get('hidden_act')!r} is not supported (only 'silu')")
    lower = text.get("linear_lower_bound")
    if lower is not None and (isinstance(lower, bool) or not isinstance(lower, (int, float)) or not lower < 0):
        raise DFlashError(f"target config.json linear_lower_bound must be a negative number or null (a decay; "
                          f"otherwise the KDA state grows without bound), got {lower!r}")
    layers = text["num_hidden_layers"]
    kinds = text.get("layer_types")
    if kinds is None:
        kinds = ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers:
        raise DFlashError(f"target config.json layer_types must give a type for each of the {layers} layers, "
                          f"got {kinds!r}")
    kinds = ["indexed_attention" if k == "full_attention" else k for k in kinds]
    if any(k not in LAYER_TYPES for k in kinds):
        raise DFlashError(f"target config.json layer_types must be 'linear_attention' or 'indexed_attention' per "
                          f"layer, got {kinds!r}")
    modes = _indexer_modes(text, layers)
    for i, (kind, mode) in enumerate(zip(kinds, modes)):
        if kind == "indexed_attention" and mode == "shared" and (
                i == 0 or kinds[i - 1] != "indexed_attention" or modes[i - 1] != "full"):
            raise DFlashError(f"target config.json indexer_types makes layer {i} a shared indexed layer, but layer "
                              f"{i - 1} is not a full indexed layer: transformers passes an indexer's choice to the "
                              "next layer only")
    if text.get("mlp_layer_types") is None:
        text["mlp_layer_types"] = ["dense"] * min(3, layers) + ["sparse"] * (layers - 3)
    # (transformers' glm5_next builds the layers of mlp_layer_types and never reads first_k_dense_replace)
    sparse = deepseek_v32.glm4_moe_lite.mlp_layer_types({k: v for k, v in text.items() if k != "first_k_dense_replace"})
    experts, groups, top_k = deepseek_v3.check_expert_groups(text)
    base = {k: v for k, v in text.items() if k not in ("head_dim", "rope_parameters", "rope_scaling", "rope_theta",
                                                        "partial_rotary_factor")}
    fields = base_target_fields(base, TEXT_MODEL_TYPE if not wrapped else "glm5_next")
    fields.update(
        head_dim=0,  # (transformers' convention: the RoPE size, none here)
        num_key_value_heads=heads,
        intermediate_size=text["intermediate_size"],
        tie_word_embeddings=bool_field(cfg if wrapped else text, "tie_word_embeddings", "target", False),
        layer_types=["linear_attention" if k == "linear_attention" else "full_attention" for k in kinds],
        moe=MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=text["moe_intermediate_size"],
                      norm_topk_prob=bool_field(text, "norm_topk_prob", "target", True),
                      shared_expert_intermediate_size=text["moe_intermediate_size"] * text["n_shared_experts"]),
        moe_layers=sparse,
        q_lora_rank=text["q_lora_rank"],
        kv_lora_rank=text["kv_lora_rank"],
        qk_nope_head_dim=text["qk_nope_head_dim"],
        qk_rope_head_dim=0,
        v_head_dim=text["v_head_dim"],
        rope_interleave=False,
        softmax_scale=text["qk_nope_head_dim"] ** -0.5,
        n_group=groups,
        topk_group=text["topk_group"],
        routed_scaling_factor=number_field(text, "routed_scaling_factor", "target", 2.5),
        num_nextn_predict_layers=text["num_nextn_predict_layers"],
        wrapped=wrapped,
        checkpoint_prefix=INNER if wrapped else "model.",
        index_topk=text["index_topk"],
        index_head_dim=text["index_head_dim"],
        index_n_heads=text["index_n_heads"],
        indexer_full=[k == "indexed_attention" and m == "full" for k, m in zip(kinds, modes)],
        linear_num_heads=text["linear_num_heads"],
        linear_head_dim=text["linear_head_dim"],
        linear_conv_kernel_dim=text["linear_conv_kernel_dim"],
        linear_lower_bound=None if lower is None else float(lower),
        index_kpool=text["index_kpool"],
        hc_mult=text["hc_mult"],
        hc_eps=number_field(text, "hc_eps", "target", 1e-6),
        hc_sinkhorn_iters=text["hc_sinkhorn_iters"],
        swiglu_limit=number_field(text, "swiglu_limit", "target", 10.0),
    )
    return Glm5NextConfig(**fields)


class PooledIndexer(deepseek_v32.Indexer):
    """The pooled sparse-attention indexer (see the module docstring). Hugging Face names:
    DeepSeek's ``wq_b``, ``wk``, ``k_norm``, ``weights_proj`` plus ``index_kpool_compress_ape``
    ``[kpool, D]`` and ``index_kpool_compress_gate`` ``[D, hidden]``."""

    def __init__(self, cfg: Glm5NextConfig):
        super().__init__(cfg)
        self.pool = cfg.index_kpool
        self.pools_kept = cfg.index_topk // cfg.index_kpool
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(self.pool, self.head_dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(self.head_dim, cfg.hidden_size))

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, hidden]`` -> what the cache keeps per token: ``[k, a]`` ``[T, 2 * D]``
        (``x.dtype``): the index key and the pool gate logits."""
        return torch.cat([self.k_norm(self.wk(x)), F.linear(x, self.index_kpool_compress_gate)], dim=-1)

    def pool_bias(self, x: torch.Tensor, q_resid: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
        """The attention's mask with the tokens of the pools this indexer does not choose masked.

        Args:
            x: the layer's normed input rows ``[rows, hidden]`` (N sequences: theirs one after another).
            q_resid: ``q_a_layernorm(q_a_proj(x))`` ``[rows, q_lora_rank]``.
            rows: :meth:`rows` of the viewed cache rows ``[N, Tk, 2 * D]``.
            bias: the causal additive mask ``[rows, Tk]`` (N sequences: ``[N, rows / N, Tk]``).
            positions: int64 ``[rows]`` (``[N, rows / N]``), the rows' positions.

        Returns:
            ``bias``'s shape and dtype, -inf also at the tokens of the complete pools a query
            sees but does not choose (``bias`` itself when no more than ``index_topk /
            index_kpool`` pools fit in the viewed rows: every pool kept).
        """
        n, tk, d = rows.shape[0], rows.shape[1], self.head_dim
        pools = tk // self.pool
        if pools <= self.pools_kept:
            return bias
        mask = bias if bias.dim() == 3 else bias[None]
        tq = x.shape[0] // n
        pos = positions.reshape(n, tq)
        grouped = rows[:, :pools * self.pool].reshape(n, pools, self.pool, 2 * d)
        keys, gates = grouped[..., :d], grouped[..., d:]
        share = (gates.float() + self.index_kpool_compress_ape.float()).softmax(dim=2).to(keys.dtype)
        pool_keys = (share * keys).sum(dim=2).float().transpose(-1, -2)[:, None]  # [N, 1, D, P]
        q = self.wq_b(q_resid).float().view(n, tq, self.heads, d)
        weights = (self.weights_proj(x).float() * self.heads ** -0.5).view(n, tq, 1, self.heads)
        pool_end = torch.arange(pools, device=x.device) * self.pool + self.pool - 1  # [P]
        token_end = pool_end.repeat_interleave(self.pool)  # [P * kpool]: each token's pool's last position
        step = max(1, _SCORES_PER_CHUNK // (n * self.heads * pools))
        scale = d ** -0.5
        outs = []
        for start in range(0, tq, step):
            part = slice(start, start + step)
            scores = F.relu(torch.matmul(q[:, part], pool_keys) * scale)  # [N, chunk, Hi, P]
            index = torch.matmul(weights[:, part], scores).squeeze(-2)  # [N, chunk, P]
            seen = pool_end <= pos[:, part, None]  # [N, chunk, P]: complete pools the query sees
            index = index.masked_fill(~seen, float("-inf"))
            picks = index.sort(dim=-1, descending=True, stable=True).indices[..., :self.pools_kept]
            chosen = torch.zeros_like(seen).scatter_(-1, picks, True) & seen
            keep = chosen.repeat_interleave(self.pool, dim=-1) | (token_end > pos[:, part, None])  # (the tail)
            keep = F.pad(keep, (0, tk - pools * self.pool), value=True)
            outs.append(mask[:, part].masked_fill(~keep, float("-inf")))
        out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        return out if bias.dim() == 3 else out[0]


class PooledLatentAttention(deepseek_v3.LatentAttention):
    """DeepSeek-V3's latent attention without RoPE, plus the pooled indexer (``indexer``; None
    on a shared layer). Cache rows ``[c, index_k, a]`` (``[c]`` without an indexer), their two
    halves in ``head_dim`` values each."""

    def __init__(self, cfg: Glm5NextConfig, full: bool):
        super().__init__(cfg)
        self.q_a_layernorm.eps = self.kv_a_layernorm.eps = cfg.rms_norm_eps
        self.indexer = PooledIndexer(cfg) if full else None
        self.row_dim = self.latent_dim + (2 * cfg.index_head_dim if full else 0)
        self.head_dim = -(-self.row_dim // 2)

    def index_rows(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The indexer's part of viewed cache rows (``k``, ``v``: the halves, ``[1, Tk, head_dim]``
        or ``[N, 1, Tk, head_dim]``) -> ``[N, Tk, 2 * index_head_dim]``."""
        if k.dim() == 3:
            k, v = k[None], v[None]
        return torch.cat([k[:, 0], v[:, 0]], dim=-1)[..., self.latent_dim:self.row_dim]


class Glm5MoE(nn.Module):
    """Routed experts (stacked :class:`~dflash_torch.models.moe.Experts`, clamped SwiGLU) with
    DeepSeek-V3's router, plus the shared experts (one clamped SwiGLU MLP). Hugging Face names
    ``gate.*``, ``experts.*``, ``shared_experts.*``."""

    def __init__(self, cfg: Glm5NextConfig):
        super().__init__()
        m = cfg.moe
        self.limit = cfg.swiglu_limit
        self.gate = deepseek_v3.TopkRouter(cfg)
        self.experts = Experts(m.num_experts, cfg.hidden_size, m.intermediate_size)
        self.shared_experts = ClampedMLP(cfg.hidden_size, m.shared_expert_intermediate_size, cfg.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]`` -> ``[T, H]`` in ``x.dtype``."""
        weights, experts = self.gate(x)
        e = self.experts
        routed = dispatch_experts(x, experts, weights, e.gate_up_proj, e.down_proj, swiglu_limit=self.limit,
                                  swiglu_offset=0.0, **e.quantization())
        return routed + self.shared_experts(x)


class Model(deepseek_v32.Model):
    """GLM-5.3-Flash's decoder (see the module docstring): KDA or indexed latent attention, then
    a dense MLP or the mixture of experts, each sublayer between hyper-connections."""

    def make_layer(self, index: int, kind: str, slot: int) -> DecoderLayer:
        cfg = self.config
        if kind == "linear_attention":
            mixer = KimiDeltaAttention(cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim,
                                       cfg.linear_conv_kernel_dim, cfg.rms_norm_eps, cfg.linear_lower_bound)
        else:
            mixer = PooledLatentAttention(cfg, cfg.indexer_full[index])
        mlp = Glm5MoE(cfg) if cfg.moe_layers[index] else ClampedMLP(cfg.hidden_size, cfg.intermediate_size,
                                                                    cfg.swiglu_limit)
        layer = DecoderLayer(kind, mixer, mlp, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
                             RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), slot)
        hc = (cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        layer.attn_hc, layer.ffn_hc = HyperConnection(*hc), HyperConnection(*hc)
        return layer

    def make_rotary(self) -> nn.Module:
        return nn.Module()  # (no position encoding anywhere)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, kv_len: int | None,
                feature_layers: list[int] | None = None, logits_from: int = 0, commit=None,
                defer_commit: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As :meth:`~dflash_torch.models.target.TargetModel.forward`. Feature ``l``: layer ``l``'s
        output streams ``[T, hc_mult * hidden]`` (``num_hidden_layers``: the last layer's);
        ``EMBEDDING_OUTPUT``: the embedding in each stream."""
        cfg = self.config
        x = self.model.embed_tokens(input_ids)
        biases = {}
        if self.num_kv_layers:
            span = cache.capacity if kv_len is None else kv_len
            biases[None, 1] = attention_bias(visible_rows(positions, span, None, None), 1, x.dtype)
        step = _Step(positions, {}, biases, kv_len)
        wanted = set(feature_layers or ())
        streams = x[:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()
        captured = {EMBEDDING_OUTPUT: streams.flatten(1)} if EMBEDDING_OUTPUT in wanted else {}
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            post, comb, collapsed = layer.attn_hc(streams)
            h = layer.input_layernorm(collapsed)
            if layer.kind == "linear_attention":
                out = layer.linear_attn(h, cache.recurrent, layer.slot, commit, defer_commit)
            else:
                out = self._self_attention(layer, h, cache.kv, step)
            streams = mix_streams(streams, out, post, comb)
            post, comb, collapsed = layer.ffn_hc(streams)
            streams = mix_streams(streams, layer.mlp(layer.post_attention_layernorm(collapsed)), post, comb)
            if i in wanted or (i == last and i + 1 in wanted):
                captured[i] = captured[i + 1] = streams.flatten(1)
        hidden = self.model.norm(streams[logits_from:].mean(dim=1))
        features = torch.cat([captured[i] for i in feature_layers], dim=-1) if feature_layers else None
        return self.output_logits(hidden), features

    @staticmethod
    def _self_attention(layer: DecoderLayer, h: torch.Tensor, kv: KVCache, step: _Step) -> torch.Tensor:
        attn = layer.self_attn
        none = h.new_zeros(h.shape[0], 0)  # (cos / sin of a zero-width rotation: no RoPE)
        q_resid = attn.q_a_layernorm(attn.q_a_proj(h))
        q, latent = attn.project(h, none, none, q_resid)
        if attn.indexer is not None:
            latent = torch.cat([latent, attn.indexer.rows(h)], dim=-1)
        kv.write(layer.slot, step.positions, *attn.halves(latent))
        k, v = kv.view(layer.slot, step.kv_len)
        if attn.indexer is not None:
            bias = attn.indexer.pool_bias(h, q_resid, attn.index_rows(k, v), step.biases[None, 1], step.positions)
            step.carried["pooled_bias"] = bias
        else:
            bias = step.carried["pooled_bias"]
        return attn.output(attn.attend(q, k, v, bias))

    # --- loading ---

    @staticmethod
    def _text_name(key: str) -> str:
        """A checkpoint name with the decoder under ``model.`` (``model.language_model.X`` -> ``model.X``)."""
        return "model." + key[len(INNER):] if key.startswith(INNER) else key

    @classmethod
    def _decoder_key(cls, cfg: Glm5NextConfig, key: str) -> str | None:
        """A checkpoint name as this model names it (:meth:`_text_name`), or None for a
        wrapper's vision tower."""
        return None if cfg.wrapped and key.startswith(TOWERS) else cls._text_name(key)

    @staticmethod
    def _shared_indexer(cfg: Glm5NextConfig, key: str) -> bool:
        """Whether ``key`` is an indexer weight of a *shared indexed* layer (which runs none; a
        KDA layer's "indexer weights" are nothing GLM-5.3-Flash has: refused as unknown)."""
        if not deepseek_v32.Model._shared_indexer(cfg, key):
            return False
        return cfg.layer_types[int(key.split(".")[2])] == "full_attention"

    @classmethod
    def checkpoint_keys(cls, cfg: Glm5NextConfig, key: str) -> bool:
        """Skip a wrapper's vision tower, the multi-token-prediction layers and the shared
        layers' indexer weights (:class:`~dflash_torch.models.deepseek_v32.Model`'s rules)."""
        if cfg.wrapped and key.startswith(TOWERS):
            return False
        return super().checkpoint_keys(cfg, cls._text_name(key))

    @classmethod
    def check_skipped(cls, cfg: Glm5NextConfig, skipped: set[str], model_dir) -> None:
        """:class:`~dflash_torch.models.deepseek_v32.Model`'s check of the skipped
        multi-token-prediction layers, on the decoder's names."""
        super().check_skipped(cfg, {cls._text_name(k) for k in skipped if not k.startswith(TOWERS)}, model_dir)

    @classmethod
    def convert_checkpoint(cls, cfg: Glm5NextConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The decoder's weights moved under ``model.``
        (:func:`~dflash_torch.models.multimodal.unwrap_language_model`), per-expert weights
        stacked, and a KDA layer's ``self_attn.*`` named ``linear_attn.*`` as this model names it.

        Raises:
            DFlashError: see :func:`~dflash_torch.models.multimodal.unwrap_language_model` (a
                text config over a checkpoint with the vision tower; weights outside the
                decoder) and :func:`~dflash_torch.models.moe.fuse_expert_weights`.
        """
        state = unwrap_language_model(cfg, state, TOWERS, "vision tower", "GLM-5.3-Flash", "glm5_next")
        cfg.published_names = any(k.endswith(tuple(HC_NAMES)) for k in state)
        state = fuse_expert_weights(state, cfg.moe.num_experts)
        for i, kind in enumerate(cfg.layer_types):
            layer = f"model.layers.{i}."
            for theirs, ours in HC_NAMES.items():
                kda.rename_weight(state, layer + theirs, layer + ours)
            if kind != "linear_attention":
                continue
            kda.convert_layer(state, layer, i)
        return state

    @classmethod
    def checkpoint_name(cls, cfg: Glm5NextConfig, key: str) -> str:
        """The checkpoint's name of our parameter ``key``: transformers' in-memory name, or the
        published one (what ``save_pretrained`` writes) where the checkpoint uses those, under
        ``model.language_model.`` where the checkpoint keeps the decoder there."""
        key = kda.checkpoint_name(key, cfg.published_names)
        if cfg.published_names:
            for theirs, ours in HC_NAMES.items():
                key = key.replace("." + ours, "." + theirs)
        if cfg.checkpoint_prefix != "model." and key.startswith("model."):
            return cfg.checkpoint_prefix + key[len("model."):]
        return key

    @classmethod
    def float32_keys(cls, cfg: Glm5NextConfig, key: str) -> bool:
        """The router's weight and score correction bias, KDA's ``conv1d``, ``dt_bias`` and
        ``A_log``, the hyper-connections' ``base`` and ``scale`` stay float32 (as in transformers)."""
        return key.endswith(FLOAT32_SUFFIXES)

