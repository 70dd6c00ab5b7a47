"""DeepSeek-V4 targets (``deepseek_v4``: DeepSeek-V4-Flash, DeepSeek-V4-Pro), decoded as text.
The function is transformers' ``modeling_deepseek_v4.py`` (the reference in the tests):

* **Hyper-connections (mHC).** The residual is ``hc_mult`` streams per token (``[T, hc, H]``;
  the embedding copied into each). Before each sublayer a small float32 projection of the
  (unweighted-RMS-normed, flattened) streams gives ``pre`` (collapse weights), ``post``
  (expansion weights) and ``comb`` (a doubly-stochastic stream mix: softmax then Sinkhorn
  iterations); the sublayer reads ``sum_j pre_j * stream_j``, and the new streams are
  ``post_k * out + sum_j comb[j, k] * stream_j``. The head collapses the streams once more
  (``hc_head``) before the final norm and the LM head.
* **Attention.** Queries through a low rank (``q_a_proj``, ``q_a_norm``, ``q_b_proj``) and an
  unweighted RMS norm per head; one key/value head shared by all query heads, whose key *is*
  its value (``kv_norm(kv_proj(x))``); interleaved RoPE on each head's trailing
  ``qk_rope_head_dim`` channels, undone on the output's rope channels (RoPE at minus the
  query's position); a learned sink logit per head in the softmax; a grouped low-rank
  output projection (``o_a_proj``: ``o_groups`` blocks, then ``o_b_proj``). Every layer
  sees a sliding window of ``sliding_window`` positions (itself included). Layer types:
  ``sliding_attention`` (window only, the "main" RoPE), and two with compressed entries
  added to the window's keys, both on the "compress" RoPE (``compress_rope_theta``, YaRN
  with attention factor 1): ``heavily_compressed_attention`` (HCA: each window of
  ``ratio`` positions pooled into one entry by a softmax gate over its tokens, every entry
  attended) and ``compressed_sparse_attention`` (CSA: overlapping windows, entry ``w`` pools
  the "a" half of window ``w - 1`` with the "b" half of window ``w``; a Lightning indexer,
  with compressed keys of its own, scores entries per query, ``sum_h w_h relu(q_h . k)``,
  and only the ``index_topk`` best are attended). Entry ``w`` is visible to the query at
  ``p`` once its window is complete, ``(w + 1) * ratio - 1 <= p``; its RoPE position is
  ``w * ratio``.
* **Mixture of experts** on every layer: ``hash_moe`` layers choose experts by token id
  (``tid2eid[input_ids]``), the others the top-k of ``score + e_score_correction_bias``;
  scores ``sqrtsoftplus`` or ``sigmoid`` of the router logits (computed in float32 here),
  the chosen renormalised to sum to 1 and times ``routed_scaling_factor``. Routed and
  shared experts are a SwiGLU clamped at ``swiglu_limit`` (gate at most, up both sides).
* Hyper-connection parameters, norms, sinks, the compressors' ``position_bias`` and the
  score correction bias are held in float32 in every dtype (transformers'
  ``_keep_in_fp32_modules_strict``); norms multiply in float32 and cast once.

**What the cache holds** (in the engine's KV cache, so batching, fixed shapes, prefix reuse and
the memory accounting work unchanged; rollback-safe by construction): see
:mod:`.deepseek_v4_attention`, which holds the attention.

**Context features for drafters.** Layer ``l``'s feature row is its ``hc_mult`` output
streams one after another (``hc_mult * hidden_size`` values, the target's ``feature_size``):
the published drafter RedHatAI/DeepSeek-V4-Flash-speculator.dflash "consumes multi-stream
hidden states from the base model (hc_mult=4)", "target hidden width 4 x 4096 = 16384" (its
model card), captured by vLLM. ``num_hidden_layers`` is the last layer's output streams (before
``hc_head`` and the final norm; so is ``num_hidden_layers - 1``: there is no per-layer normed
output here); :data:`~dflash_torch.models.target.EMBEDDING_OUTPUT` the embedding copied into
each stream (the first layer's input streams).

**Checkpoints.** DeepSeek's own tensor names are read, at the top level (the published
checkpoints: ``embed.weight``, ``layers.{i}.attn.wq_a.weight``, ``layers.{i}.ffn.experts.{e}.w1.weight``,
``hc_head_fn``, ``head.weight`` ...) or under ``model.`` (what transformers' ``save_pretrained``
writes), and transformers' in-memory names; per-expert weights are stacked when loading;
the multi-token-prediction layers (``mtp.*``) are not read; any other unknown tensor is
refused. The published quantized checkpoints load (:mod:`.fp8`, :mod:`.mxfp4`): FP8 linears
with ue8m0 block scales named ``X.scale`` and, with ``expert_dtype: "fp4"``, FP4 routed
experts; dequantized when loading, bit for bit as transformers loads them, or kept packed
(``fp8="packed"``: FP8 linears as :class:`~dflash_torch.models.fp8.Fp8Linear`;
``mxfp4="packed"``: the experts as MXFP4 blocks), except ``o_a_proj``, which the grouped
output projection reads as a matrix: dequantized when loading (:class:`~.deepseek_v4_attention.GroupedProjection`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import DFlashError
from .config import MoEConfig, TargetConfig, base_target_fields, bool_field, check_int, number_field
from .deepseek_v4_attention import CSA, HCA, SLIDING, Attention, Norm, Step, _bias, unit_norm
from .fp8 import ROW_SCALE_SUFFIX
from .moe import Experts, dispatch_experts, fuse_expert_weights
from .rope import Rotary, rotary_dim
from .target import EMBEDDING_OUTPUT, TargetModel, visible_rows

# the published weights: fine-grained FP8 (ue8m0 scales named X.scale, fp8.py) with FP4 routed experts (mxfp4.py)
QUANTIZATION_METHODS = ("fp8",)
FP4_EXPERTS = True  # expert_dtype "fp4" is read for this family (checkpoint.load_state_dict's fp4)

LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}  # transformers' reading of the legacy compress_ratios
SCORING = ("sqrtsoftplus", "sigmoid")
# transformers' DeepseekV4Config defaults, for keys a config.json leaves out
DEFAULTS = dict(vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43,
                num_attention_heads=64, num_key_value_heads=1, head_dim=512, q_lora_rank=1024, num_experts_per_tok=6,
                n_routed_experts=256, n_shared_experts=1, scoring_func="sqrtsoftplus", norm_topk_prob=True,
                routed_scaling_factor=1.5, max_position_embeddings=1048576, rope_theta=10000.0,
                compress_rope_theta=160000.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0,
                sliding_window=128, o_groups=8, o_lora_rank=1024, index_n_heads=64, index_head_dim=128,
                index_topk=512, num_nextn_predict_layers=1, hidden_act="silu", rms_norm_eps=1e-6, eos_token_id=1,
                bos_token_id=0, tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
DEFAULT_HASH_LAYERS = 3
DEFAULT_ROPE_FRACTION = 64 / 512


@dataclass
class DeepseekV4Config(TargetConfig):
    """:class:`TargetConfig` plus DeepSeek-V4's shapes (``layer_types`` holds the three
    attention types; ``rope_theta`` / ``rope_scaling`` are the "main" RoPE's, ``compress_*``
    the "compress" RoPE's; ``rope_dim`` = ``qk_rope_head_dim``)."""

    q_lora_rank: int = 1024
    rope_dim: int = 64
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    compress_rates: dict = field(default_factory=dict)
    mlp_layer_types: list = field(default_factory=list)
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    compress_rope_theta: float = 160000.0
    compress_rope_scaling: dict | None = None
    num_nextn_predict_layers: int = 0
    names: dict = field(default_factory=dict)  # our parameter name -> its name in the checkpoint (set when loading)

    @property
    def feature_size(self) -> int:
        """A layer's feature row: its ``hc_mult`` output streams, ``hc_mult * hidden_size`` values."""
        return self.hc_mult * self.hidden_size


def _rope_parts(text: dict, fraction: float) -> dict[str, dict]:
    """The "main" and "compress" RoPE parameter dicts, folded as transformers'
    ``DeepseekV4Config.__post_init__`` folds them (a nested ``rope_parameters`` as it is;
    else a flat ``rope_parameters`` / ``rope_scaling`` rule applies to "compress" only, with
    YaRN's attention factor 1 unless given; "main" is plain RoPE of ``rope_theta``; a nested
    part without a ``rope_theta`` takes the top-level ``rope_theta``, the compress part too). A
    ``rope_scaling`` is read in place of ``rope_parameters``, as transformers reads it.
    ``fraction``: the top-level ``partial_rotary_factor`` (given or derived).

    Raises:
        DFlashError: not an object, or a nested part's ``partial_rotary_factor`` that is not
            ``fraction`` (transformers rotates that part by its own; this engine by
            ``fraction``)."""
    key = "rope_scaling" if text.get("rope_scaling") else "rope_parameters"
    rp = text.get(key) or {}
    if not isinstance(rp, dict):
        raise DFlashError(f"target config.json {key} must be an object, got {rp!r}")
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        parts = {"main": dict(rp["main"]), "compress": dict(rp["compress"])}
        for name, part in parts.items():
            given = part.get("partial_rotary_factor", fraction)
            if isinstance(given, bool) or not isinstance(given, (int, float)) or given != fraction:
                raise DFlashError(f"target config.json {key}.{name}.partial_rotary_factor {given!r} disagrees with "
                                  f"the top-level partial_rotary_factor {fraction!r} (the one this engine rotates "
                                  "by and sizes qk_rope_head_dim with); make them equal")
            part.setdefault("rope_type", part.get("type", "default"))
            part.setdefault("rope_theta", text["rope_theta"])  # (both parts: transformers' fill, not compress_rope_theta)
        return parts
    flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    if "type" in flat and "rope_type" not in flat:  # (the legacy key, as transformers standardises it)
        flat["rope_type"] = flat.pop("type")
    main = {"rope_type": "default", "rope_theta": text["rope_theta"], "partial_rotary_factor": fraction}
    compress = {**flat, "rope_theta": text["compress_rope_theta"], "partial_rotary_factor": fraction}
    compress.setdefault("rope_type", "default")
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return {"main": main, "compress": compress}


def _layer_types(text: dict, n: int, rates: dict) -> list[str]:
    types = text.get("layer_types")
    ratios = text.get("compress_ratios")
    if types is None and ratios is not None:
        if not isinstance(ratios, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ratios):
            raise DFlashError(f"target config.json compress_ratios must be a list of integers, got {ratios!r}")
        unknown = sorted({r for r in ratios[:n] if r not in RATIO_TO_TYPE})
        if unknown:
            raise DFlashError(f"target config.json compress_ratios {unknown} are not supported (0, 4 or 128, as "
                              "transformers' DeepSeek-V4 reads them)")
        types = [RATIO_TO_TYPE[r] for r in ratios]
        bad = sorted({(RATIO_TO_TYPE[r], r) for r in ratios[:n] if r and rates[RATIO_TO_TYPE[r]] != r})
        if bad:
            raise DFlashError(f"target config.json compress_ratios {bad[0][1]} disagrees with the {bad[0][0]} "
                              f"compress rate {rates[bad[0][0]]}")
    if types is None:
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise DFlashError(f"target config.json layer_types must be a list of layer type names, got {types!r}")
    if len(types) < n:
        raise DFlashError(f"target config.json layer_types has {len(types)} entries but num_hidden_layers is {n}")
    types = list(types[:n])
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise DFlashError(f"target layer_types {unknown} are not supported by deepseek_v4 ({', '.join(LAYER_TYPES)})")
    return types


def parse_config(cfg: dict) -> DeepseekV4Config:
    """A ``deepseek_v4`` ``config.json`` -> :class:`DeepseekV4Config`, with the legacy keys
    of the published configs folded as transformers' ``DeepseekV4Config`` folds them
    (``compress_ratios`` per layer, ``compress_rate_csa`` / ``compress_rate_hca``,
    ``num_hash_layers``, ``qk_rope_head_dim``, a flat ``rope_scaling``); keys left out take
    transformers' defaults.

    Raises:
        DFlashError: one line, for anything this module would not run as transformers does:
            an unknown layer type or compress ratio, a ratio that disagrees with
            ``compress_rates``, a scoring function other than sqrtsoftplus / sigmoid
            (transformers cannot build ``softmax``), ``hidden_act`` other than silu, biases,
            ``num_key_value_heads`` other than 1, ``n_shared_experts`` other than 1,
            ``norm_topk_prob`` false (transformers renormalises anyway), ``swiglu_limit``
            <= 0, shapes that do not divide, a key of the wrong type.
    """
    text = {**DEFAULTS, **{k: v for k, v in cfg.items() if v is not None or k in ("eos_token_id",)}}
    n = check_int(text, "num_hidden_layers", "target")
    ints = ("hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "moe_intermediate_size",
            "n_routed_experts", "num_experts_per_tok", "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim",
            "index_topk", "sliding_window", "hc_mult", "hc_sinkhorn_iters", "vocab_size")
    for key in ints:
        check_int(text, key, "target")
    check_int(text, "num_nextn_predict_layers", "target", minimum=0)
    for key, want in (("num_key_value_heads", 1), ("n_shared_experts", 1)):
        if text[key] != want:
            raise DFlashError(f"target config.json {key} {text[key]!r} is not supported (transformers' DeepSeek-V4 "
                              f"runs {want})")
    for key in ("attention_bias", "mlp_bias"):
        if bool_field(text, key, "target", False):
            raise DFlashError(f"target config.json {key} true is not supported (DeepSeek-V4 has no biases)")
    if not bool_field(text, "norm_topk_prob", "target", True):
        raise DFlashError("target config.json norm_topk_prob false is not supported (transformers' DeepSeek-V4 always "
                          "renormalises the chosen experts' weights)")
    if text["scoring_func"] not in SCORING:
        raise DFlashError(f"target config.json scoring_func {text['scoring_func']!r} is not supported "
                          f"({', '.join(SCORING)}; transformers' DeepSeek-V4 builds no other)")
    if text["hidden_act"] not in ("silu", "swish"):
        raise DFlashError(f"target config.json hidden_act {text['hidden_act']!r} is not supported (only silu)")
    limit = number_field(text, "swiglu_limit", "target", 10.0)
    if not limit > 0:
        raise DFlashError(f"target config.json swiglu_limit {limit!r} must be > 0 (transformers clamps at it)")
    rates = text.get("compress_rates")
    rates = dict(DEFAULT_COMPRESS_RATES) if rates is None else dict(rates) if isinstance(rates, dict) else rates
    if not isinstance(rates, dict):
        raise DFlashError(f"target config.json compress_rates must be an object, got {rates!r}")
    if text.get("compress_rate_csa") is not None:
        rates[CSA] = text["compress_rate_csa"]
    if text.get("compress_rate_hca") is not None:
        rates[HCA] = text["compress_rate_hca"]
    for kind in (CSA, HCA):
        r = rates.get(kind)
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise DFlashError(f"target config.json compress rate of {kind} must be a positive integer, got {r!r}")
    types = _layer_types(text, n, rates)
    mlp = text.get("mlp_layer_types")
    if mlp is None:
        hashed = text.get("num_hash_layers")
        hashed = DEFAULT_HASH_LAYERS if hashed is None else check_int(text, "num_hash_layers", "target", minimum=0)
        mlp = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    if not isinstance(mlp, list) or len(mlp) < n or not all(t in MLP_TYPES for t in mlp[:n]):
        raise DFlashError(f"target config.json mlp_layer_types must list {n} of {', '.join(MLP_TYPES)}, got {mlp!r}")
    mlp = list(mlp[:n])
    head_dim = text["head_dim"]
    fraction = text.get("partial_rotary_factor")
    if fraction is None:
        legacy = text.get("qk_rope_head_dim")
        fraction = legacy / head_dim if legacy is not None else DEFAULT_ROPE_FRACTION
    rope_dim = rotary_dim(head_dim, fraction)
    if rope_dim > text["index_head_dim"]:
        raise DFlashError(f"target qk_rope_head_dim {rope_dim} exceeds index_head_dim {text['index_head_dim']}")
    heads = text["num_attention_heads"]
    if heads * head_dim % text["o_groups"]:
        raise DFlashError(f"target o_groups {text['o_groups']} must divide num_attention_heads * head_dim")
    rope = _rope_parts(text, fraction)
    for part in rope.values():
        if part.get("rope_type") not in ("default", "yarn", "linear", "llama3"):
            raise DFlashError(f"target rope type {part.get('rope_type')!r} is not supported for deepseek_v4")
    plain = {k: v for k, v in text.items() if k not in ("rope_parameters", "rope_scaling", "partial_rotary_factor",
                                                        "head_dim", "intermediate_size")}
    plain["rope_theta"] = rope["main"]["rope_theta"]
    fields = base_target_fields(plain, "deepseek_v4")

    def scaling(part: dict) -> dict | None:
        rule = {k: v for k, v in part.items() if k not in ("rope_theta", "partial_rotary_factor")}
        return None if rule.get("rope_type") == "default" else rule

    top_k = text["num_experts_per_tok"]
    if top_k > text["n_routed_experts"]:
        raise DFlashError(f"target num_experts_per_tok {top_k} exceeds n_routed_experts {text['n_routed_experts']}")
    fields.update(
        num_key_value_heads=1,
        head_dim=head_dim,
        intermediate_size=text["moe_intermediate_size"],
        rope_theta=float(rope["main"]["rope_theta"]),
        rope_scaling=scaling(rope["main"]),
        partial_rotary_factor=fraction,
        layer_types=types,
        moe=MoEConfig(num_experts=text["n_routed_experts"], top_k=top_k,
                      intermediate_size=text["moe_intermediate_size"], norm_topk_prob=True,
                      shared_expert_intermediate_size=text["moe_intermediate_size"]),
        moe_layers=[True] * n,
        q_lora_rank=text["q_lora_rank"],
        rope_dim=rope_dim,
        o_groups=text["o_groups"],
        o_lora_rank=text["o_lora_rank"],
        sliding_window=text["sliding_window"],
        compress_rates={CSA: rates[CSA], HCA: rates[HCA]},
        mlp_layer_types=mlp,
        hc_mult=text["hc_mult"],
        hc_sinkhorn_iters=text["hc_sinkhorn_iters"],
        hc_eps=number_field(text, "hc_eps", "target", 1e-6),
        swiglu_limit=float(limit),
        scoring_func=text["scoring_func"],
        routed_scaling_factor=number_field(text, "routed_scaling_factor", "target", 1.5),
        index_n_heads=text["index_n_heads"],
        index_head_dim=text["index_head_dim"],
        index_topk=text["index_topk"],
        compress_rope_theta=float(rope["compress"]["rope_theta"]),
        compress_rope_scaling=scaling(rope["compress"]),
        num_nextn_predict_layers=text["num_nextn_predict_layers"],
    )
    return DeepseekV4Config(**fields)


# --- building blocks (the attention's: deepseek_v4_attention.py) ---
class HyperConnection(nn.Module):
    """Hyper-connection weights of one sublayer (Hugging Face ``attn_hc`` / ``ffn_hc``:
    ``fn`` ``[(2 + hc) * hc, hc * H]``, ``base``, ``scale`` ``[3]``, float32)."""

    def __init__(self, hc: int, hidden: int, iters: int, eps: float, norm_eps: float):
        super().__init__()
        self.hc, self.iters, self.eps, self.norm_eps = hc, iters, eps, norm_eps
        self.fn = nn.Parameter(torch.empty((2 + hc) * hc, hc * hidden))
        self.base = nn.Parameter(torch.empty((2 + hc) * hc))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams`` ``[R, hc, H]`` -> ``post`` ``[R, hc]``, ``comb`` ``[R, hc, hc]`` (float32)
        and the collapsed sublayer input ``[R, H]`` (``streams.dtype``)."""
        hc = self.hc
        mixes = F.linear(unit_norm(streams.flatten(1).float(), self.norm_eps), self.fn.float())
        pre, post, comb = mixes.split([hc, hc, hc * hc], dim=-1)
        b_pre, b_post, b_comb = self.base.float().split([hc, hc, hc * hc])
        s = self.scale.float()
        pre = torch.sigmoid(pre * s[0] + b_pre) + self.eps
        post = 2 * torch.sigmoid(post * s[1] + b_post)
        comb = torch.softmax(comb.view(-1, hc, hc) * s[2] + b_comb.view(hc, hc), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def mix_streams(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The streams after a sublayer: ``post_k * out + sum_j comb[j, k] * stream_j``."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """The final collapse of the streams (Hugging Face ``hc_head``: ``hc_fn``, ``hc_base``,
    ``hc_scale``, float32)."""

    def __init__(self, hc: int, hidden: int, eps: float, norm_eps: float):
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc, hc * hidden))
        self.hc_base = nn.Parameter(torch.empty(hc))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unit_norm(streams.flatten(1).float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class ClampedMLP(nn.Module):
    """The shared expert: SwiGLU with the gate clamped at most ``limit``, up to ``[-limit, limit]``."""

    def __init__(self, hidden: int, intermediate: int, limit: float):
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj(F.silu(gate) * up)


class Router(nn.Module):
    """``gate.weight`` ``[E, H]``; top-k layers also ``gate.e_score_correction_bias`` (float32),
    hash layers ``gate.tid2eid`` (int64 ``[vocab, k]``)."""

    def __init__(self, cfg: DeepseekV4Config, hashed: bool):
        super().__init__()
        m = cfg.moe
        self.top_k, self.hashed, self.scaling, self.scoring = m.top_k, hashed, cfg.routed_scaling_factor, cfg.scoring_func
        self.weight = nn.Parameter(torch.empty(m.num_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, m.top_k, dtype=torch.long))
        else:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(m.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 weights ``[R, k]``, int64 experts ``[R, k]``)."""
        logits = F.linear(x.float(), self.weight.float())
        scores = F.softplus(logits).sqrt() if self.scoring == "sqrtsoftplus" else logits.sigmoid()
        if self.hashed:
            experts = self.tid2eid[input_ids]
        else:
            experts = torch.topk(scores + self.e_score_correction_bias.float(), self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, experts


class MoE(nn.Module):
    """Routed experts (stacked :class:`~dflash_torch.models.moe.Experts`, clamped SwiGLU) plus
    the shared expert. Hugging Face names ``gate.*``, ``experts.*``, ``shared_experts.*``."""

    def __init__(self, cfg: DeepseekV4Config, hashed: bool):
        super().__init__()
        m = cfg.moe
        self.limit = cfg.swiglu_limit
        self.gate = Router(cfg, hashed)
        self.experts = Experts(m.num_experts, cfg.hidden_size, m.intermediate_size)
        self.shared_experts = ClampedMLP(cfg.hidden_size, m.intermediate_size, cfg.swiglu_limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x, input_ids)
        e = self.experts
        routed = dispatch_experts(x, experts, weights, e.gate_up_proj, e.down_proj, swiglu_limit=self.limit,
                                  swiglu_offset=0.0, **e.quantization())
        return routed + self.shared_experts(x)


class Layer(nn.Module):
    """One DeepSeek-V4 decoder layer (Hugging Face names ``self_attn``, ``mlp``,
    ``input_layernorm``, ``post_attention_layernorm``, ``attn_hc``, ``ffn_hc``)."""

    def __init__(self, cfg: DeepseekV4Config, index: int, slots: tuple):
        super().__init__()
        self.kind = cfg.layer_types[index]
        self.slot, self.sliding_window = slots[0], cfg.sliding_window
        self.self_attn = Attention(cfg, self.kind, slots)
        self.mlp = MoE(cfg, cfg.mlp_layer_types[index] == "hash_moe")
        self.input_layernorm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        hc = (cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.attn_hc, self.ffn_hc = HyperConnection(*hc), HyperConnection(*hc)


def slots_per_layer(kind: str) -> int:
    return 1 if kind == SLIDING else 3


class Model(TargetModel):
    """DeepSeek-V4 decoder (see the module docstring)."""

    def __init__(self, cfg: DeepseekV4Config):
        super().__init__(cfg)
        self.num_kv_layers = sum(slots_per_layer(k) for k in cfg.layer_types)
        self.attention_masks = ()
        self.model.hc_head = HyperHead(cfg.hc_mult, cfg.hidden_size, cfg.hc_eps, cfg.rms_norm_eps)
        self.model.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_layer(self, index: int, kind: str, slot: int) -> Layer:
        cfg = self.config
        first = sum(slots_per_layer(k) for k in cfg.layer_types[:index])
        slots = (first, None, None) if kind == SLIDING else (first, first + 1, first + 2)
        return Layer(cfg, index, slots)

    def make_rotary(self) -> nn.Module:
        cfg = self.config
        return nn.ModuleDict({
            "main": Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.partial_rotary_factor,
                           cfg.max_position_embeddings),
            "compress": Rotary(cfg.head_dim, cfg.compress_rope_theta, cfg.compress_rope_scaling,
                               cfg.partial_rotary_factor, cfg.max_position_embeddings)})

    def kv_shapes(self) -> list[tuple[int, int]]:
        return [shape for layer in self.model.layers for shape, _ in layer.self_attn.shapes()]

    def kv_windows(self) -> list[int | None]:
        return [self.config.sliding_window if i == 0 else window for layer in self.model.layers
                for i, (_, window) in enumerate(layer.self_attn.shapes())]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, kv_len: int | None,
                feature_layers: list[int] | None = None, logits_from: int = 0, commit=None,
                defer_commit: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As :meth:`TargetModel.forward` (``commit`` / ``defer_commit`` are for recurrent
        layers: none here). Feature ``l``: layer ``l``'s output streams ``[T, hc_mult *
        hidden]`` (``num_hidden_layers``: the last layer's); ``EMBEDDING_OUTPUT``: the
        embedding in each stream."""
        cfg = self.config
        x = self.model.embed_tokens(input_ids)
        pos = positions if positions.dim() == 2 else positions[None]
        flat = pos.reshape(-1)
        rope = {key: rot.pair_cos_sin(flat, x.dtype) for key, rot in self.rotary.items()}
        kvc = cache.kv
        span = kvc.capacity if kv_len is None else kv_len
        visible = visible_rows(pos, span, cfg.sliding_window, kvc.layer_ring(self.model.layers[0].slot))
        compress = self.rotary["compress"]
        step = Step(pos, positions, kv_len, rope, _bias(visible, x.dtype), lambda p: compress.pair_cos_sin(p, x.dtype))
        wanted = set(feature_layers or ())
        streams = x[:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()
        captured = {EMBEDDING_OUTPUT: streams.flatten(1)} if EMBEDDING_OUTPUT in wanted else {}
        for i, layer in enumerate(self.model.layers):
            post, comb, collapsed = layer.attn_hc(streams)
            out = layer.self_attn(layer.input_layernorm(collapsed), input_ids, kvc, step)
            streams = mix_streams(streams, out, post, comb)
            post, comb, collapsed = layer.ffn_hc(streams)
            out = layer.mlp(layer.post_attention_layernorm(collapsed), input_ids)
            streams = mix_streams(streams, out, post, comb)
            if i in wanted or (i == len(self.model.layers) - 1 and i + 1 in wanted):
                captured[i] = captured[i + 1] = streams.flatten(1)
        hidden = self.model.norm(self.model.hc_head(streams[logits_from:]))
        features = torch.cat([captured[i] for i in feature_layers], dim=-1) if feature_layers else None
        return self.output_logits(hidden), features

    # --- loading ---

    @classmethod
    def checkpoint_keys(cls, cfg: DeepseekV4Config, key: str) -> bool:
        """The multi-token-prediction layers (``mtp.*``, ``model.mtp.*``) are not read."""
        return not key.startswith(("mtp.", "model.mtp."))

    @classmethod
    def convert_checkpoint(cls, cfg: DeepseekV4Config, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """DeepSeek's names -> ours (:func:`our_name`); ``tid2eid`` as int64; per-expert
        weights stacked.

        Raises:
            DFlashError: a tensor under two names; a ``tid2eid`` that is not integer or names
                an expert out of range.
        """
        renamed = {}
        for key in list(state):
            name = our_name(key)
            if name in renamed:
                raise DFlashError(f"the target checkpoint holds {name} twice (as {renamed[name][0]} and {key})")
            renamed[name] = (key, state.pop(key))
        for name, (key, t) in renamed.items():
            state[name] = t
            cfg.names[name] = key
            if name.endswith(".gate.tid2eid"):
                if t.is_floating_point() or t.dtype == torch.bool:
                    raise DFlashError(f"target weight {key} has dtype {str(t.dtype).removeprefix('torch.')}; "
                                      "expected integer expert ids")
                if t.numel() and (int(t.min()) < 0 or int(t.max()) >= cfg.moe.num_experts):
                    raise DFlashError(f"target weight {key} names experts outside [0, {cfg.moe.num_experts})")
                state[name] = t.long()
        return fuse_expert_weights(state, cfg.moe.num_experts)

    @classmethod
    def checkpoint_name(cls, cfg: DeepseekV4Config, key: str) -> str:
        return cfg.names.get(key, key)

    @classmethod
    def dequantized_keys(cls, cfg: DeepseekV4Config, key: str) -> bool:
        """``o_a_proj`` (DeepSeek's ``attn.wo_a``), which the grouped output projection reads as
        a matrix, is dequantized when loading even where the other weights are kept packed
        (:class:`~.deepseek_v4_attention.GroupedProjection`); so is a quantized weight outside the decoder layers'
        linears (the embeddings, the head, a router's ``gate.weight``: not published
        quantized, dequantized if they are, as :func:`~dflash_torch.models.target._keep_quantized` does)."""
        name = our_name(key)
        return (name.endswith((".self_attn.o_a_proj.weight", ".mlp.gate.weight"))
                or not name.startswith("model.layers."))

    @classmethod
    def float32_keys(cls, cfg: DeepseekV4Config, key: str) -> bool:
        """Hyper-connections, norms, sinks, ``position_bias`` and the score correction bias
        stay float32 (transformers' ``_keep_in_fp32_modules_strict``)."""
        name = our_name(key)
        leaf = name.rsplit(".", 2)
        return (name.endswith(("_hc.fn", "_hc.base", "_hc.scale", ".sinks", ".position_bias",
                               ".e_score_correction_bias", "norm.weight"))
                or ".hc_head." in name or leaf[-1] in ("hc_fn", "hc_base", "hc_scale"))


# DeepSeek's names (a layer's rest after "layers.{i}.") -> transformers' in-memory names
_LAYER_RENAMES = [
    (r"^attn_norm\.", "input_layernorm."),
    (r"^ffn_norm\.", "post_attention_layernorm."),
    (r"^hc_attn_(fn|base|scale)$", r"attn_hc.\1"),
    (r"^hc_ffn_(fn|base|scale)$", r"ffn_hc.\1"),
    (r"^attn\.attn_sink$", "self_attn.sinks"),
    (r"^attn\.wq_a\.", "self_attn.q_a_proj."),
    (r"^attn\.q_norm\.", "self_attn.q_a_norm."),
    (r"^attn\.wq_b\.", "self_attn.q_b_proj."),
    (r"^attn\.wkv\.", "self_attn.kv_proj."),
    (r"^attn\.norm\.", "self_attn.kv_norm."),
    (r"^attn\.wo_a\.", "self_attn.o_a_proj."),
    (r"^attn\.wo_b\.", "self_attn.o_b_proj."),
    (r"^attn\.compressor\.wkv\.", "self_attn.compressor.kv_proj."),
    (r"^attn\.compressor\.wgate\.", "self_attn.compressor.gate_proj."),
    (r"^attn\.compressor\.norm\.", "self_attn.compressor.kv_norm."),
    (r"^attn\.compressor\.ape$", "self_attn.compressor.position_bias"),
    (r"^attn\.indexer\.compressor\.wkv\.", "self_attn.compressor.indexer.kv_proj."),
    (r"^attn\.indexer\.compressor\.wgate\.", "self_attn.compressor.indexer.gate_proj."),
    (r"^attn\.indexer\.compressor\.norm\.", "self_attn.compressor.indexer.kv_norm."),
    (r"^attn\.indexer\.compressor\.ape$", "self_attn.compressor.indexer.position_bias"),
    (r"^attn\.indexer\.wq_b\.", "self_attn.compressor.indexer.q_b_proj."),
    (r"^attn\.indexer\.weights_proj\.", "self_attn.compressor.indexer.scorer.weights_proj."),
    (r"^ffn\.gate\.bias$", "mlp.gate.e_score_correction_bias"),
    (r"^ffn\.gate\.(weight|tid2eid)$", r"mlp.gate.\1"),
    (r"^ffn\.shared_experts\.w1\.", "mlp.shared_experts.gate_proj."),
    (r"^ffn\.shared_experts\.w2\.", "mlp.shared_experts.down_proj."),
    (r"^ffn\.shared_experts\.w3\.", "mlp.shared_experts.up_proj."),
    (r"^ffn\.experts\.(\d+)\.w1\.", r"mlp.experts.\1.gate_proj."),
    (r"^ffn\.experts\.(\d+)\.w2\.", r"mlp.experts.\1.down_proj."),
    (r"^ffn\.experts\.(\d+)\.w3\.", r"mlp.experts.\1.up_proj."),
]
_TOP_RENAMES = {"embed.weight": "model.embed_tokens.weight", "embed_tokens.weight": "model.embed_tokens.weight",
                "head.weight": "lm_head.weight", "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
                "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale",
                "hc_head.hc_fn": "model.hc_head.hc_fn", "hc_head.hc_base": "model.hc_head.hc_base",
                "hc_head.hc_scale": "model.hc_head.hc_scale"}
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.*)$")


def our_name(key: str) -> str:
    """A checkpoint tensor's name as this model names it: DeepSeek's names (top level, as
    published, or under ``model.``, as transformers saves them) renamed as transformers'
    conversion mapping does; transformers' in-memory names kept; anything else unchanged
    (then refused as unknown). The row scales of a weight kept FP8 (``X.weight_scale``,
    :data:`~dflash_torch.models.fp8.ROW_SCALE_SUFFIX`) follow their weight's name (e.g.
    ``head.weight_scale`` -> ``lm_head.weight_scale``, ``layers.1.ffn.gate.weight_scale`` ->
    ``model.layers.1.mlp.gate.weight_scale``)."""
    if key.endswith(".weight" + ROW_SCALE_SUFFIX):
        return our_name(key.removesuffix(ROW_SCALE_SUFFIX)) + ROW_SCALE_SUFFIX
    if key in ("lm_head.weight",) or key.startswith("model.") and not _LAYER.match(key):
        rest = key.removeprefix("model.")
        return _TOP_RENAMES.get(rest, key)
    m = _LAYER.match(key)
    if m:
        rest = m[2]
        for pattern, repl in _LAYER_RENAMES:
            new, hits = re.subn(pattern, repl, rest)
            if hits:
                return f"model.layers.{m[1]}.{new}"
        return f"model.layers.{m[1]}.{rest}"
    return _TOP_RENAMES.get(key, key)
