"""DeepSeek-V3-architecture targets: ``deepseek_v3`` (``DeepseekV3ForCausalLM``: DeepSeek-V3,
DeepSeek-R1, Kimi-K2) and ``kimi_k25`` (``Kimi_K25ForConditionalGeneration``: Kimi-K2.5, a
multimodal wrapper whose ``text_config`` is a ``deepseek_v3`` decoder), decoded as text; the
model also runs ``glm4_moe_lite`` (GLM-4.7-Flash, :mod:`.glm4_moe_lite`: its config parsed into this one's).
Layout as in transformers' ``modeling_deepseek_v3.py``:

* **Multi-head latent attention (MLA).** Queries: ``q_b_proj(q_a_layernorm(q_a_proj(x)))``
  (or ``q_proj(x)`` when ``q_lora_rank`` is null), per head ``qk_nope_head_dim`` channels
  without position and ``qk_rope_head_dim`` rotated ones. Keys and values come from one
  latent row per token: ``kv_a_proj_with_mqa(x)`` splits into ``c`` (``kv_lora_rank``
  channels, then ``kv_a_layernorm``) and ``k_pe`` (``qk_rope_head_dim`` channels, rotated,
  shared by every head); ``kv_b_proj(c)`` gives each head's key (``qk_nope_head_dim``) and
  value (``v_head_dim``) channels. RoPE with ``rope_interleave`` (the default) rotates the
  channel pairs ``(2i, 2i + 1)``, which is rotate-half RoPE of the channels reordered evens
  first (as transformers computes it; keys and queries alike, so the dot products are the
  same). The softmax scale is ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times
  ``m(factor, mscale_all_dim) ** 2`` (``m(s, k) = 0.1 k ln s + 1``) under a RoPE scaling
  rule with ``mscale_all_dim`` (YaRN; the YaRN attention factor on cos / sin as for any
  model, :func:`~dflash_torch.models.rope.rope_attention_factor`). The two low-rank norms
  have eps 1e-6, whatever ``rms_norm_eps`` says (transformers builds them so).
* **Mixture of experts** on layers ``>= first_k_dense_replace`` (a SwiGLU MLP of
  ``intermediate_size`` before). Router in float32: ``sigmoid(gate(x))`` scores; experts are
  *chosen* on ``scores + e_score_correction_bias``, first the ``topk_group`` best of
  ``n_group`` groups (a group's score: the sum of its two best), then the
  ``num_experts_per_tok`` best experts in those groups; they are *weighted* by their plain
  scores, renormalised to sum to 1 (``norm_topk_prob``, + 1e-20) and times
  ``routed_scaling_factor``. Plus ``n_shared_experts`` shared experts: one SwiGLU MLP of
  ``n_shared_experts * moe_intermediate_size`` every token goes through. The router's
  weight and bias are held in float32 in every dtype (transformers keeps them so:
  ``_keep_in_fp32_modules_strict``).

**The KV cache holds the latent, not per-head keys and values.** A token's cache row is
``[c, k_pe]`` (``kv_lora_rank + qk_rope_head_dim`` = 576 values for DeepSeek-V3 and
Kimi-K2.5, 61 layers: 70,272 bytes a token in bfloat16) instead of the expanded keys and
values (``heads * (qk_nope + qk_rope + v_head_dim)``: 40,960 values a layer for DeepSeek-V3,
71 times more; 20,480 for Kimi-K2.5's 64 heads, 36 times). Attention runs in the *absorbed*
form: each head's query is projected through the key half of ``kv_b_proj``,
``q_lat = q_nope @ W_uk`` (``[kv_lora_rank]`` per head), so that
``q_nope . (W_uk c) = q_lat . c``; the scores are ``[q_lat, q_pe] . [c, k_pe]`` against the
cached rows, the attention output is a mix of the cached ``c`` per head, and the value half
of ``kv_b_proj`` takes it to ``v_head_dim`` (``W_uv``) before ``o_proj``. The same function
as transformers' expanded form, rounded in another order (float32: logits within 1e-5).

The engine's caches hold, per layer, a key and a value buffer of one shape
(``[kv_heads, rows, head_dim]``, :class:`~dflash_torch.cache.KVCache`,
:class:`~dflash_torch.batch.SlotKVCache`). Here a layer has one "head" whose key buffer holds
the first half of the latent row and whose value buffer the second half (``head_dim`` =
``ceil(576 / 2)``; an odd row is padded with one zero): the caches, their memory accounting
(:func:`~dflash_torch.cache.cache_bytes`), slots, prefix reuse and compiled rounds work as
they are, with exactly the latent's bytes. Attention joins the two halves again.

Checkpoints: per-expert weights (``mlp.experts.{e}.gate_proj.weight`` ...) are stacked when
loading; the multi-token-prediction layers (``model.layers.{num_hidden_layers + i}.*``,
``i < num_nextn_predict_layers``) are not read, but checked to be ones (:meth:`Model.check_skipped`);
any other unknown weight is refused.
A ``kimi_k25`` checkpoint's decoder weights lie under ``language_model.model.`` with
``language_model.lm_head.weight`` (the published layout; ``model.language_model.`` and
``lm_head.`` are read too); its ``vision_tower.`` and ``mm_projector.`` are not read.
Fine-grained FP8 (DeepSeek-V3's official format) loads through :mod:`.fp8`; with
``--fp8 packed`` every FP8 linear stays FP8 except ``kv_b_proj``, whose matrix the absorbed
attention reads per head: it is dequantized when loading (``heads * (qk_nope + v_head_dim) *
kv_lora_rank`` values a layer, 33 MB in bfloat16 for DeepSeek-V3; the memory check counts it
dequantized). Compressed-tensors ``pack-quantized`` integers (Kimi-K2.5's published weights:
its routed experts INT4 in groups of 32, everything else bfloat16) load through
:mod:`.packed_int`, dequantized when loading or, ``int_weights="packed"``, kept packed: the
experts as int32 words, a quantized linear as an
:class:`~dflash_torch.models.packed_int.IntLinear`, and ``kv_b_proj`` again dequantized when
loading (its packed words and scales do not count as kept in the memory check).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import KVCache
from ..errors import DFlashError
from .config import (MoEConfig, TargetConfig, base_target_fields, bool_field, check_int, number_field,
                     refuse_partial_rotary)
from .layers import MLP, RMSNorm
from .moe import Experts, dispatch_experts, fuse_expert_weights
from .rope import Rotary, apply_rope
from .target import DecoderLayer, TargetModel, _Step, check_mtp_layers

# fine-grained FP8 (DeepSeek-V3's official format, fp8.py); compressed-tensors pack-quantized integers (Kimi-K2.5's
# INT4 experts, packed_int.py); NVFP4 (compressed-tensors or ModelOpt) and ModelOpt FP8, dequantized (nvfp4.py)
QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "modelopt")

WRAPPERS = {"kimi_k25": "deepseek_v3"}
TEXT_MODEL_TYPES = ("deepseek_v3", "kimi_k2")  # a kimi_k25 text_config's model_type ("kimi_k2": older configs)
# transformers' DeepseekV3Config defaults, for keys a config.json leaves out (an explicit null stays null)
DEFAULTS = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
                routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
                qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
                norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-6, eos_token_id=1,
                rope_interleave=True, attention_bias=False, num_nextn_predict_layers=1, tie_word_embeddings=False)
LOW_RANK_EPS = 1e-6  # eps of q_a_layernorm and kv_a_layernorm (transformers' RMSNorm default)
# a kimi_k25 checkpoint's decoder (as published, as transformers names it in memory) and parts not read
KIMI_DECODER = ("language_model.model.", "model.language_model.")
KIMI_HEADS = ("language_model.lm_head.", "lm_head.")
KIMI_TOWERS = ("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector.")
_SCORES_PER_CHUNK = 1 << 25  # attention logits held at once (query rows are taken in chunks)


@dataclass
class DeepseekV3Config(TargetConfig):
    """:class:`TargetConfig` plus MLA's shapes and DeepSeek-V3's router (field names as in
    ``config.json``). ``head_dim`` is ``qk_rope_head_dim``, as transformers sets it (the RoPE
    tables' size); ``softmax_scale`` is the attention's factor on the scores (see the module
    docstring); ``wrapped``: a ``kimi_k25`` checkpoint (decoder under ``language_model.model.``)."""

    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    softmax_scale: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_nextn_predict_layers: int = 0
    wrapped: bool = False


def parse_config(cfg: dict) -> DeepseekV3Config:
    """A ``deepseek_v3`` or ``kimi_k25`` ``config.json`` -> :class:`DeepseekV3Config` (keys left
    out take transformers' ``DeepseekV3Config`` defaults; a wrapper's ``tie_word_embeddings``
    governs its lm_head, default true as in ``Kimi_K25Config``, and its ``eos_token_id``
    serves where the text config has none).

    Raises:
        DFlashError: one line: a wrapper without a ``deepseek_v3`` ``text_config``; a key of
            the wrong type or out of range; ``num_key_value_heads`` other than the number of
            heads (transformers' MLA cannot run it); routing transformers does not do
            (``scoring_func`` other than sigmoid, ``topk_method`` other than noaux_tc,
            ``moe_layer_freq`` other than 1); groups that do not split the experts, groups
            of fewer than 2 experts, more experts per token than the chosen groups hold;
            a partial rotary factor.
    """
    wrapper = cfg.get("model_type") in WRAPPERS
    text = cfg
    if wrapper:
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise DFlashError(f"target config.json of model_type {cfg['model_type']!r} lacks text_config")
        if text.get("model_type", "deepseek_v3") not in TEXT_MODEL_TYPES:
            raise DFlashError(f"target config.json of model_type {cfg['model_type']!r} has a text_config of model_type "
                              f"{text.get('model_type')!r}; expected deepseek_v3")
        if text.get("eos_token_id") is None and cfg.get("eos_token_id") is not None:
            text = dict(text, eos_token_id=cfg["eos_token_id"])
    text = {**DEFAULTS, **text}
    for key in ("scoring_func", "topk_method"):  # (DeepSeek-V2's softmax / greedy routing: not what transformers runs)
        want = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}[key]
        if text.get(key) not in (None, want):
            raise DFlashError(f"target config.json {key} {text[key]!r} is not supported (DeepSeek-V3 routing: {want})")
    if text.get("moe_layer_freq") not in (None, 1):
        raise DFlashError(f"target config.json moe_layer_freq {text['moe_layer_freq']!r} is not supported (only 1: "
                          "every layer from first_k_dense_replace on is a mixture of experts)")
    ints = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok",
            "moe_intermediate_size", "n_group", "topk_group", "n_shared_experts", "intermediate_size")
    missing = [k for k in ints if text.get(k) is None]
    if missing:
        raise DFlashError(f"target config.json has null {', '.join(missing)}")
    for key in ints:
        check_int(text, key, "target")
    for key in ("first_k_dense_replace", "num_nextn_predict_layers"):
        if text.get(key) is None:
            raise DFlashError(f"target config.json has null {key}")
        check_int(text, key, "target", minimum=0)
    check_int(text, "q_lora_rank", "target")
    if text["qk_rope_head_dim"] % 2:
        raise DFlashError(f"target qk_rope_head_dim {text['qk_rope_head_dim']} must be even (RoPE rotates pairs)")
    heads = check_int(text, "num_attention_heads", "target")
    kv_heads = check_int(text, "num_key_value_heads", "target")
    if kv_heads is not None and kv_heads != heads:
        raise DFlashError(f"target num_key_value_heads {kv_heads} != num_attention_heads {heads}: multi-head latent "
                          "attention expands its latent to every head (transformers' DeepSeek-V3 runs only equal counts)")
    experts, groups, top_k = check_expert_groups(text)
    # (a text decoder of DeepSeek-V3's layout under another model_type, glm4_moe_lite, keeps its name)
    name = "deepseek_v3" if wrapper else cfg.get("model_type", "deepseek_v3")
    fields = base_target_fields({k: v for k, v in text.items() if k != "head_dim"}, name)
    refuse_partial_rotary(fields, name)
    scaling = fields["rope_scaling"]
    qk_head_dim = text["qk_nope_head_dim"] + text["qk_rope_head_dim"]
    scale = qk_head_dim ** -0.5
    if scaling is not None and scaling.get("mscale_all_dim"):
        factor = scaling.get("factor") or fields["max_position_embeddings"] / scaling.get(
            "original_max_position_embeddings", fields["max_position_embeddings"])
        m = 1.0 if factor <= 1 else 0.1 * scaling["mscale_all_dim"] * math.log(factor) + 1.0
        scale = scale * m * m
    first_dense = text["first_k_dense_replace"]
    fields.update(
        head_dim=text["qk_rope_head_dim"],
        num_key_value_heads=heads,
        intermediate_size=text["intermediate_size"],
        tie_word_embeddings=bool_field(cfg, "tie_word_embeddings", "target", True) if wrapper
        else bool_field(text, "tie_word_embeddings", "target", False),
        moe=MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=text["moe_intermediate_size"],
                      norm_topk_prob=bool_field(text, "norm_topk_prob", "target", True),
                      shared_expert_intermediate_size=text["moe_intermediate_size"] * text["n_shared_experts"]),
        moe_layers=[i >= first_dense for i in range(fields["num_hidden_layers"])],
        checkpoint_prefix=KIMI_DECODER[0] if wrapper else "model.",
        q_lora_rank=text["q_lora_rank"],
        kv_lora_rank=text["kv_lora_rank"],
        qk_nope_head_dim=text["qk_nope_head_dim"],
        qk_rope_head_dim=text["qk_rope_head_dim"],
        v_head_dim=text["v_head_dim"],
        rope_interleave=bool_field(text, "rope_interleave", "target", True),
        softmax_scale=scale,
        n_group=groups,
        topk_group=text["topk_group"],
        routed_scaling_factor=number_field(text, "routed_scaling_factor", "target", 2.5),
        num_nextn_predict_layers=text["num_nextn_predict_layers"],
        wrapped=wrapper,
    )
    return DeepseekV3Config(**fields)


def check_expert_groups(text: dict) -> tuple[int, int, int]:
    """``n_routed_experts``, ``n_group`` and ``num_experts_per_tok`` of a config with DeepSeek-V3's
    group-limited router (integers, checked by the caller), once they fit together.

    Raises:
        DFlashError: one line: groups that do not split the experts into groups of 2 or more;
            more experts per token than the ``topk_group`` chosen groups hold.
    """
    experts, groups, top_k = text["n_routed_experts"], text["n_group"], text["num_experts_per_tok"]
    if experts % groups or experts // groups < 2:
        raise DFlashError(f"target n_group {groups} must split n_routed_experts {experts} into groups of 2 or more "
                          "experts")
    if text["topk_group"] > groups or top_k > text["topk_group"] * (experts // groups):
        raise DFlashError(f"target num_experts_per_tok {top_k} and topk_group {text['topk_group']} must fit in "
                          f"n_group {groups} groups of {experts // groups} experts")
    return experts, groups, top_k


class _KvUpProjection(nn.Linear):
    """``kv_b_proj`` (``kv_lora_rank`` -> ``heads * (qk_nope_head_dim + v_head_dim)``), whose
    matrix the absorbed attention reads per head rather than applying it to rows. A subclass,
    so that a checkpoint loaded ``--fp8 packed`` / ``--int-weights packed`` dequantizes it when
    loading instead of making it an :class:`~dflash_torch.models.fp8.Fp8Linear` or
    :class:`~dflash_torch.models.packed_int.IntLinear` (which only apply their matrix)."""


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """RoPE of ``x`` ``[heads, T, qk_rope_head_dim]`` with ``cos``/``sin`` ``[T, qk_rope_head_dim]``:
    rotate-half RoPE (:func:`~dflash_torch.models.rope.apply_rope`), of the channels reordered
    evens then odds when ``interleave`` (pairs ``(2i, 2i + 1)`` turn by frequency ``i``; the
    result stays in that order, as transformers' ``apply_rotary_pos_emb_interleave`` leaves it)."""
    if interleave:
        x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    return apply_rope(x, cos, sin)


class LatentAttention(nn.Module):
    """Multi-head latent attention, absorbed (see the module docstring). Hugging Face
    parameter names: ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` (or ``q_proj``),
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``.

    Attributes:
        heads: query heads H.
        kv_heads, head_dim: the cache's shape per layer: 1 "head" of
            ``ceil((kv_lora_rank + qk_rope_head_dim) / 2)`` values in each of the key and
            value buffers (the two halves of a latent row).
    """

    def __init__(self, cfg: DeepseekV3Config):
        super().__init__()
        hidden, h = cfg.hidden_size, cfg.num_attention_heads
        self.heads, self.rank, self.rope_dim = h, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.nope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.v_head_dim
        self.latent_dim = self.rank + self.rope_dim
        self.kv_heads, self.head_dim = 1, -(-self.latent_dim // 2)
        self.interleave, self.scale = cfg.rope_interleave, cfg.softmax_scale
        q_dim = h * (self.nope_dim + self.rope_dim)
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_dim, bias=False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LOW_RANK_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, q_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.latent_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LOW_RANK_EPS)
        self.kv_b_proj = _KvUpProjection(self.rank, h * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, hidden, bias=cfg.attention_bias)

    def _up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_b_proj``'s matrix per head: the key half ``W_uk`` ``[H, qk_nope, rank]`` and the
        value half ``W_uv`` ``[H, v_head_dim, rank]`` (views)."""
        w = self.kv_b_proj.weight.view(self.heads, self.nope_dim + self.v_dim, self.rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                q_resid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[T, hidden]`` -> absorbed queries ``[H, T, kv_lora_rank + qk_rope_head_dim]``
        (``[q_nope @ W_uk, rotated q_pe]``) and the latent rows ``[T, kv_lora_rank +
        qk_rope_head_dim]`` (``[kv_a_layernorm(c), rotated k_pe]``), in ``x.dtype``.
        ``q_resid``: ``q_a_layernorm(q_a_proj(x))`` when the caller has it already (computed
        here otherwise)."""
        t = x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)) if q_resid is None else q_resid)
        q = q.view(t, self.heads, self.nope_dim + self.rope_dim).transpose(0, 1)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        w_uk, _ = self._up()
        q_lat = torch.matmul(q_nope, w_uk)  # [H, T, rank]
        q = torch.cat([q_lat, rotate(q_pe, cos, sin, self.interleave)], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c), rotate(k_pe[None], cos, sin, self.interleave)[0]], dim=-1)
        return q, latent

    def halves(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows ``[T, latent]`` -> what the cache's key and value buffers hold:
        ``[1, T, head_dim]`` each, the first and second half (the second padded with a
        zero column when the row is odd)."""
        first, second = latent[:, :self.head_dim], latent[:, self.head_dim:]
        if second.shape[-1] < self.head_dim:
            second = F.pad(second, (0, self.head_dim - second.shape[-1]))
        return first[None], second[None]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Softmax attention of absorbed queries over cached latent rows, per head a mix of
        the rows' ``c``.

        Args:
            q: ``[H, rows, latent]`` from :meth:`project` (N sequences: their rows one after another).
            k, v: the cache's two halves, ``[1, Tk, head_dim]`` (N sequences: ``[N, 1, Tk, head_dim]``).
            bias: additive mask ``[rows, Tk]`` (N sequences: ``[N, rows / N, Tk]``), shared by
                all heads, or None.

        Returns:
            ``[H, rows, kv_lora_rank]`` in ``q.dtype``; the softmax is taken in float32 and
            rounded to ``q.dtype`` (transformers' eager attention). Long blocks run in chunks
            of query rows (about 2**25 logits held at once).
        """
        if k.dim() == 3:
            k, v = k[None], v[None]
            bias = None if bias is None else bias[None]
        rows_k = torch.cat([k[:, 0], v[:, 0]], dim=-1)[..., :self.latent_dim]  # [N, Tk, latent]
        values = rows_k[..., :self.rank]
        n, tk = rows_k.shape[0], rows_k.shape[1]
        heads, rows, _ = q.shape
        tq = rows // n
        q = q.view(heads, n, tq, -1).transpose(0, 1)  # [N, H, Tq, latent]
        keys = rows_k.transpose(-1, -2)[:, None]  # [N, 1, latent, Tk]
        step = max(1, _SCORES_PER_CHUNK // (n * heads * tk))
        outs = []
        for start in range(0, tq, step):
            scores = torch.matmul(q[:, :, start:start + step], keys) * self.scale
            if bias is not None:
                scores = scores + bias[:, None, start:start + step]
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            outs.append(torch.matmul(probs, values[:, None]))  # [N, H, chunk, rank]
        out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
        return out.transpose(0, 1).reshape(heads, rows, self.rank)

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        """``[H, rows, kv_lora_rank]`` -> each head through ``W_uv`` (``[rows, H * v_head_dim]``),
        then ``o_proj`` -> ``[rows, hidden]``."""
        _, w_uv = self._up()
        heads, rows, _ = attended.shape
        out = torch.matmul(attended, w_uv.transpose(1, 2))  # [H, rows, v_head_dim]
        return self.o_proj(out.transpose(0, 1).reshape(rows, heads * self.v_dim))


class TopkRouter(nn.Module):
    """DeepSeek-V3's router (Hugging Face names ``gate.weight`` ``[E, H]``,
    ``gate.e_score_correction_bias`` ``[E]``, both held in float32): see the module docstring."""

    def __init__(self, cfg: DeepseekV3Config):
        super().__init__()
        m = cfg.moe
        self.top_k, self.norm_topk_prob = m.top_k, m.norm_topk_prob
        self.n_group, self.topk_group, self.scaling = cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(m.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(m.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[T, H]`` -> (float32 weights ``[T, k]``, int64 expert ids ``[T, k]``, in no
        particular order), computed in float32."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if self.topk_group < self.n_group:  # (all groups kept otherwise: the mask changes nothing)
            t, e = choice.shape
            grouped = choice.view(t, self.n_group, e // self.n_group)
            best = torch.topk(grouped.topk(2, dim=-1)[0].sum(dim=-1), self.topk_group, dim=-1, sorted=False)[1]
            kept = torch.zeros(t, self.n_group, dtype=torch.bool, device=x.device).scatter_(1, best, True)
            choice = choice.masked_fill(~kept.repeat_interleave(e // self.n_group, dim=1), float("-inf"))
        experts = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, experts


class DeepseekV3MoE(nn.Module):
    """Routed experts (stacked, :class:`~dflash_torch.models.moe.Experts`) plus the shared
    experts' MLP. Hugging Face names: ``gate.*``, ``experts.*``, ``shared_experts.*``."""

    def __init__(self, cfg: DeepseekV3Config):
        super().__init__()
        m = cfg.moe
        self.gate = TopkRouter(cfg)
        self.experts = Experts(m.num_experts, cfg.hidden_size, m.intermediate_size)
        self.shared_experts = MLP(cfg.hidden_size, m.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]`` -> ``[T, H]`` in ``x.dtype`` (each expert's output times its float32
        weight rounded to ``x.dtype`` once, summed in expert order, then the shared experts')."""
        weights, experts = self.gate(x)
        e = self.experts
        return dispatch_experts(x, experts, weights, e.gate_up_proj, e.down_proj, **e.quantization()) + self.shared_experts(x)


class Model(TargetModel):
    """DeepSeek-V3 decoder layers: latent attention, then a dense MLP (the first
    ``first_k_dense_replace`` layers) or the mixture of experts."""

    def __init__(self, cfg: DeepseekV3Config):
        super().__init__(cfg)
        # one causal mask [T, Tk] that every head of every layer reads (broadcast, never repeated per head)
        self.attention_masks = ((None, 1),)

    def make_layer(self, index: int, kind: str, slot: int) -> DecoderLayer:
        cfg = self.config
        mlp = DeepseekV3MoE(cfg) if cfg.moe_layers[index] else MLP(cfg.hidden_size, cfg.intermediate_size)
        return DecoderLayer(kind, LatentAttention(cfg), mlp, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
                            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), slot)

    def make_rotary(self) -> nn.Module:
        cfg = self.config
        return Rotary(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling,
                      max_position_embeddings=cfg.max_position_embeddings)

    @staticmethod
    def _self_attention(layer: DecoderLayer, h: torch.Tensor, kv: KVCache, step: _Step) -> torch.Tensor:
        attn = layer.self_attn
        q, latent = attn.project(h, *step.rope[None])
        kv.write(layer.slot, step.positions, *attn.halves(latent))
        return attn.output(attn.attend(q, *kv.view(layer.slot, step.kv_len), step.biases[None, 1]))

    # --- loading ---

    @classmethod
    def _decoder_key(cls, cfg: DeepseekV3Config, key: str) -> str | None:
        """A checkpoint name as this model names it (a wrapper's decoder under ``model.``, its
        head as ``lm_head.``), or None for a wrapper's tower."""
        if not cfg.wrapped:
            return key
        if key.startswith(KIMI_TOWERS):
            return None
        for prefix in KIMI_DECODER:
            if key.startswith(prefix):
                return "model." + key[len(prefix):]
        for prefix in KIMI_HEADS:
            if key.startswith(prefix):
                return "lm_head." + key[len(prefix):]
        return key

    @classmethod
    def checkpoint_keys(cls, cfg: DeepseekV3Config, key: str) -> bool:
        """Skip the multi-token-prediction layers (``model.layers.{L + i}.``, ``i <
        num_nextn_predict_layers``) and a wrapper's vision tower and projector."""
        name = cls._decoder_key(cfg, key)
        if name is None:
            return False
        if name.startswith("model.layers."):
            index = name.split(".")[2]
            if index.isdigit() and 0 <= int(index) - cfg.num_hidden_layers < cfg.num_nextn_predict_layers:
                return False
        return True

    @classmethod
    def check_skipped(cls, cfg: DeepseekV3Config, skipped: set[str], model_dir) -> None:
        """The multi-token-prediction layers skipped are ones
        (:func:`~dflash_torch.models.target.check_mtp_layers`): each holds ``eh_proj`` (what
        makes one: a layer in that range without it is a decoder layer that a wrong
        ``num_hidden_layers`` / ``num_nextn_predict_layers`` would silently drop), and besides
        its own parts (``eh_proj``, ``enorm``, ``hnorm``, ``shared_head.norm`` /
        ``shared_head.head``, ``embed_tokens``) only tensors of a decoder layer's modules.

        Raises:
            DFlashError: a skipped layer without ``eh_proj.weight``, or with a tensor an MTP layer
                does not hold.
        """
        names = (cls._decoder_key(cfg, key) for key in skipped)
        if any(name is not None and name.startswith("model.layers.") for name in names):
            check_mtp_layers(model_dir, cfg.num_hidden_layers, cfg.num_nextn_predict_layers,
                             "num_nextn_predict_layers", lambda key: cls._decoder_key(cfg, key))

    @classmethod
    def convert_checkpoint(cls, cfg: DeepseekV3Config, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A wrapper's decoder weights renamed under ``model.`` / ``lm_head.`` (and
        ``cfg.checkpoint_prefix`` set to the layout found, for messages); per-expert weights
        stacked (:func:`~dflash_torch.models.moe.fuse_expert_weights`).

        Raises:
            DFlashError: a wrapper checkpoint holding a weight twice (under both of its
                names); see :func:`~dflash_torch.models.moe.fuse_expert_weights`.
        """
        if cfg.wrapped:
            if any(k.startswith(KIMI_DECODER[1]) for k in state):  # (transformers' names: messages use them)
                cfg.checkpoint_prefix = KIMI_DECODER[1]
            renamed = {}
            for key in list(state):
                name = cls._decoder_key(cfg, key)
                if name in renamed:
                    raise DFlashError(f"the target checkpoint holds {name} twice (as {renamed[name][0]} and {key})")
                renamed[name] = (key, state.pop(key))
            state.update({name: t for name, (_, t) in renamed.items()})
        return fuse_expert_weights(state, cfg.moe.num_experts)

    @classmethod
    def checkpoint_name(cls, cfg: DeepseekV3Config, key: str) -> str:
        if cfg.checkpoint_prefix == KIMI_DECODER[0] and key.startswith("lm_head."):
            return "language_model." + key
        return super().checkpoint_name(cfg, key)

    @classmethod
    def dequantized_keys(cls, cfg: DeepseekV3Config, key: str) -> bool:
        """``kv_b_proj``, which the absorbed attention reads per head, is dequantized when
        loading even where the other weights are kept packed (:class:`_KvUpProjection`)."""
        return ".self_attn.kv_b_proj.weight" in key

    @classmethod
    def float32_keys(cls, cfg: DeepseekV3Config, key: str) -> bool:
        """The router's weight and score correction bias stay float32 (as in transformers)."""
        return key.endswith((".mlp.gate.weight", ".mlp.gate.e_score_correction_bias"))
