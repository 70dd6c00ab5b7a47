"""MiMo-V2-Flash targets (``mimo_v2_flash``, ``MiMoV2FlashForCausalLM``: Xiaomi's MiMo-V2-Flash, a
309B-A15B mixture of experts), as transformers' ``modeling_mimo_v2_flash.py`` (5.x) computes them.

* **Hybrid attention.** ``layer_types`` (default: the first layer and every sixth full
  attention, the rest sliding) picks per layer causal attention over every position
  (``"full_attention"``) or over the last ``sliding_window`` positions, the query's own included
  (``"sliding_attention"``). transformers derives ``sliding_window`` from a config's
  ``sliding_window_size`` when one is given: ``sliding_window_size + 1`` (SGLang's reference
  attends to that many previous tokens plus the query), so the published config's 128 means
  windows of 129 positions; otherwise ``sliding_window`` (default 129).
* **Attention.** Queries and keys have ``head_dim`` (192) channels per head, values
  ``v_head_dim`` (128); sliding layers have twice the ``num_key_value_heads`` key/value heads of
  the full ones, and a learned *sink* logit per query head (one more logit in the softmax
  whose share is dropped, transformers' eager semantics, as gpt-oss's). RoPE per layer type
  (``rope_parameters[layer type]``: default 5,000,000 on full layers, 10,000 on sliding ones),
  rotate-half over the first ``int(head_dim * partial_rotary_factor)`` channels (0.334: 64 of
  192), the rest passed through. Values are multiplied by ``attention_value_scale`` (default
  0.707; null: 1) before they are cached; the softmax scale is ``head_dim ** -0.5``; ``o_proj``
  has no bias (q/k/v have one with ``attention_bias``).
* **Mixture of experts** on the ``"sparse"`` layers of ``mlp_layer_types`` (default: all but
  the first, a SwiGLU MLP of ``intermediate_size``): DeepSeek-V3's router
  (:class:`~dflash_torch.models.deepseek_v3.TopkRouter`: sigmoid scores in float32, experts chosen
  on scores + ``e_score_correction_bias`` within the ``topk_group`` best of ``n_group`` groups,
  weighted by their plain scores renormalised when ``norm_topk_prob``, times
  ``routed_scaling_factor``; null: 1) and no shared expert. The router's weight and bias are
  held in float32 (transformers' ``_keep_in_fp32_modules_strict``).

**The KV cache.** A key row is ``head_dim`` wide and a value row ``v_head_dim``; the engine's
caches hold a key and a value buffer of one shape per layer. Each key/value head's token row
``[key (head_dim), value (v_head_dim)]`` is stored split in two equal halves
(``ceil((head_dim + v_head_dim) / 2)``: 160 values for MiMo-V2-Flash), the first in the key
buffer and the second in the value buffer (as :mod:`.deepseek_v3` stores its latent): the caches,
their memory accounting (:func:`~dflash_torch.cache.cache_bytes`), slots, rings, prefix reuse and
compiled rounds work as they are, with exactly the bytes of the keys and values
(MiMo-V2-Flash: 9 full layers x 4 heads + 39 sliding layers x 8 heads, 320 values each:
222,720 bytes a token in bfloat16 with every position kept; with the decoders' rings only the
full layers grow, 23,040 bytes a token, each sliding layer keeping ``129 + max_rows - 1`` rows).
Attention reads the halves in place: each query's logits are the
products with the key parts of both halves, the values are read from where they lie.

**Configs.** Keys left out take the defaults of transformers' ``MiMoV2FlashConfig`` (the
published shapes). The published ``config.json`` also carries the keys of Xiaomi's own code,
which transformers' class does not read (``hybrid_layer_pattern``, ``moe_layer_freq``,
``rope_theta``, ``swa_rope_theta``, ``partial_rotary_factor``, ``layernorm_epsilon``, ``swa_*``
shapes, ``add_*_attention_sink_bias``, ``n_shared_experts``, ``scoring_func``, ``topk_method``):
each must describe the model transformers builds (as the published values do); one that does
not is refused, since transformers and the reference engines would then run different models.

**Checkpoints.** transformers' names (``self_attn.attention_sink_bias`` as saved,
``self_attn.sinks`` as held in memory), per-expert weights stacked (or already stacked).
The multi-token-prediction layers, which the published checkpoint stores under ``model.mtp.``
(transformers' class ignores that prefix by name), are not read; any other unknown weight is
refused. Fine-grained FP8 (the published format: ``quant_method: "fp8"``, blocks of 128 x 128)
loads through :mod:`.fp8`, dequantized or kept packed; a weight whose scales do not tile it in
``weight_block_size`` blocks is refused (see :func:`~dflash_torch.models.fp8.check_pair`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import DFlashError
from .config import (MoEConfig, TargetConfig, base_target_fields, bool_field, check_int, check_layer_types,
                     number_field)
from .deepseek_v3 import TopkRouter, check_expert_groups
from .layers import MLP, RMSNorm
from .moe import Experts, dispatch_experts, fuse_expert_weights
from .rope import Rotary, apply_rope
from .target import DecoderLayer, TargetModel

QUANTIZATION_METHODS = ("fp8",)  # fine-grained FP8 (the published checkpoint's format, fp8.py)
LAYER_TYPES = ("full_attention", "sliding_attention")
MLP_TYPES = ("dense", "sparse")
# transformers' MiMoV2FlashConfig defaults, for keys a config.json leaves out
DEFAULTS = dict(vocab_size=152576, hidden_size=4096, intermediate_size=16384, num_hidden_layers=48,
                num_attention_heads=64, num_key_value_heads=4, hidden_act="silu", max_position_embeddings=131072,
                rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, moe_intermediate_size=2048,
                num_experts_per_tok=8, n_routed_experts=256, routed_scaling_factor=1.0, n_group=1, topk_group=1,
                norm_topk_prob=True, bos_token_id=1, head_dim=192, v_head_dim=128, sliding_window=129,
                attention_value_scale=0.707)
DEFAULT_PARTIAL_ROTARY = 0.334  # transformers' default factor where a layer type's rope_parameters leave it out
DEFAULT_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.334},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.334}}
MTP_PREFIX = "model.mtp."  # the multi-token-prediction layers (not read; transformers ignores them by name)
SINK_NAMES = (".self_attn.attention_sink_bias", ".self_attn.sinks")  # (as saved, as held in memory)
_SCORES_PER_CHUNK = 1 << 25  # attention logits held at once (query rows are taken in chunks)


@dataclass
class MiMoV2FlashConfig(TargetConfig):
    """:class:`TargetConfig` plus MiMo-V2-Flash's fields. ``num_key_value_heads`` is the full
    layers' (sliding layers have twice as many); ``head_dim`` the query/key head size,
    ``v_head_dim`` the value head size; ``sliding_window`` the positions a sliding layer's
    query sees (itself included); ``rope`` per layer type ``(rope_theta, partial_rotary_factor)``
    (plain RoPE); ``n_group`` / ``topk_group`` / ``routed_scaling_factor`` the router's."""

    v_head_dim: int = 128
    sliding_window: int = 129
    attention_value_scale: float = 0.707
    rope: dict = field(default_factory=dict)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0


def _one_line(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _layer_types(cfg: dict, n: int) -> list[str]:
    """``layer_types`` (default transformers': full on layer 0 and every sixth, sliding
    elsewhere), checked against a legacy ``hybrid_layer_pattern`` (0 full, 1 sliding)."""
    types = cfg.get("layer_types")
    if types is None:
        types = ["full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
    types = check_layer_types(types, n, LAYER_TYPES, "mimo_v2_flash")
    pattern = cfg.get("hybrid_layer_pattern")
    if pattern is not None:
        if not isinstance(pattern, list) or len(pattern) != n or any(p not in (0, 1) or isinstance(p, bool)
                                                                     for p in pattern):
            raise DFlashError(f"target config.json hybrid_layer_pattern must list 0 (full) or 1 (sliding) for each of "
                              f"the {n} layers, got {_one_line(pattern)}")
        if [LAYER_TYPES[p] for p in pattern] != types:
            raise DFlashError(f"target config.json hybrid_layer_pattern {_one_line(pattern)} disagrees with the "
                              f"layer_types transformers' mimo_v2_flash reads ({_one_line(types)}; its default without "
                              "layer_types: full on layer 0 and every sixth layer); keep one")
    return types


def _mlp_types(cfg: dict, n: int) -> list[bool]:
    """Which layers are a mixture of experts: ``mlp_layer_types`` (default all but the first),
    checked against a legacy ``moe_layer_freq`` (0 dense, 1 experts)."""
    types = cfg.get("mlp_layer_types")
    if types is None:
        types = ["dense"] + ["sparse"] * (n - 1)
    if not isinstance(types, list) or len(types) != n or any(t not in MLP_TYPES for t in types):
        raise DFlashError(f"target config.json mlp_layer_types must list 'dense' or 'sparse' for each of the {n} "
                          f"layers, got {_one_line(types)}")
    sparse = [t == "sparse" for t in types]
    freq = cfg.get("moe_layer_freq")
    if freq is not None:
        if not isinstance(freq, list) or len(freq) != n or any(f not in (0, 1) or isinstance(f, bool) for f in freq):
            raise DFlashError(f"target config.json moe_layer_freq must list 0 (dense) or 1 (experts) for each of the "
                              f"{n} layers, got {_one_line(freq)}")
        if [bool(f) for f in freq] != sparse:
            raise DFlashError(f"target config.json moe_layer_freq {_one_line(freq)} disagrees with the mlp_layer_types "
                              f"transformers' mimo_v2_flash reads ({_one_line(types)}; default: the first layer "
                              "dense); keep one")
    return sparse


def _rope(cfg: dict, types: list[str]) -> dict[str, tuple[float, float]]:
    """``(rope_theta, partial_rotary_factor)`` per layer type in use, from ``rope_parameters``
    (an object per layer type; default transformers'), checked against the legacy
    ``rope_theta`` (full layers), ``swa_rope_theta`` (sliding layers) and
    ``partial_rotary_factor`` (both)."""
    params = cfg.get("rope_parameters")
    if params is None:
        params = DEFAULT_ROPE
    if not isinstance(params, dict):
        raise DFlashError(f"target config.json rope_parameters must be an object per layer type, got {_one_line(params)}")
    rope = {}
    for kind in sorted(set(types)):
        p = params.get(kind)
        if not isinstance(p, dict):
            raise DFlashError(f"target config.json rope_parameters has no object for {kind} layers (transformers' "
                              "mimo_v2_flash reads one per layer type)")
        if p.get("rope_type", "default") != "default":
            raise DFlashError(f"target config.json rope_parameters.{kind}.rope_type {p['rope_type']!r} is not supported "
                              "for mimo_v2_flash (only 'default': plain RoPE)")
        theta = p.get("rope_theta")
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
            raise DFlashError(f"target config.json rope_parameters.{kind} lacks rope_theta (a positive number), got "
                              f"{theta!r}")
        partial = p.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY)
        if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
            raise DFlashError(f"target config.json rope_parameters.{kind}.partial_rotary_factor must be a number in "
                              f"(0, 1], got {partial!r}")
        rope[kind] = (float(theta), float(partial))
    for key, kinds, i in (("rope_theta", ("full_attention",), 0), ("swa_rope_theta", ("sliding_attention",), 0),
                          ("partial_rotary_factor", LAYER_TYPES, 1)):
        legacy = cfg.get(key)
        for kind in kinds:
            if legacy is not None and kind in rope and legacy != rope[kind][i]:
                name = ("rope_theta", "partial_rotary_factor")[i]
                raise DFlashError(f"target config.json {key} {legacy!r} disagrees with the {kind} layers' {name} "
                                  f"{rope[kind][i]!r} that transformers' mimo_v2_flash reads (rope_parameters, "
                                  "default 5e6 / 1e4 with factor 0.334); keep one")
    return rope


def _refuse_variants(cfg: dict) -> None:
    """The published config's keys that transformers' class does not read, where they would
    describe another model than the one it builds."""
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for key, expected, what in (("swa_num_attention_heads", heads, "num_attention_heads"),
                                ("swa_num_key_value_heads", 2 * kv if isinstance(kv, int) else kv,
                                 "twice num_key_value_heads"),
                                ("swa_head_dim", cfg["head_dim"], "head_dim"),
                                ("swa_v_head_dim", cfg["v_head_dim"], "v_head_dim"),
                                ("layernorm_epsilon", cfg["rms_norm_eps"], "rms_norm_eps")):
        if cfg.get(key) is not None and cfg[key] != expected:
            raise DFlashError(f"target config.json {key} {cfg[key]!r} differs from {what} ({expected!r}), which "
                              "transformers' mimo_v2_flash builds the sliding layers with; not supported")
    if not bool_field(cfg, "add_swa_attention_sink_bias", "target", True):
        raise DFlashError("target config.json sets add_swa_attention_sink_bias false; transformers' mimo_v2_flash "
                          "always gives sliding layers attention sinks (they would not be loaded): not supported")
    if bool_field(cfg, "add_full_attention_sink_bias", "target", False):
        raise DFlashError("target config.json sets add_full_attention_sink_bias true; transformers' mimo_v2_flash "
                          "has no sinks on full-attention layers: not supported")
    if cfg.get("n_shared_experts") not in (None, 0):
        raise DFlashError(f"target config.json n_shared_experts {cfg['n_shared_experts']!r}: MiMo-V2-Flash's mixture "
                          "of experts has no shared expert (transformers' mimo_v2_flash builds none)")
    for key, supported in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if cfg.get(key) not in (None, supported):
            raise DFlashError(f"target config.json {key} {cfg[key]!r} is not supported for mimo_v2_flash (only "
                              f"{supported!r}, as transformers' router computes)")


def parse_config(cfg: dict) -> MiMoV2FlashConfig:
    """A ``mimo_v2_flash`` ``config.json`` -> :class:`MiMoV2FlashConfig` (absent keys take the
    defaults of transformers' ``MiMoV2FlashConfig``; ``sliding_window`` derived from
    ``sliding_window_size`` as it derives it; null ``routed_scaling_factor`` /
    ``attention_value_scale`` read as 1, as it reads them).

    Raises:
        DFlashError: one line: lists of the wrong length or with unknown entries
            (``layer_types``, ``mlp_layer_types``, ``hybrid_layer_pattern``, ``moe_layer_freq``),
            query heads not a multiple of the sliding layers' key/value heads, a RoPE other than
            plain RoPE per layer type, routing groups that do not fit, a legacy key that
            disagrees with what transformers reads, the variants the module docstring lists.
    """
    text = dict(cfg)
    if text.get("n_routed_experts") is None and text.get("num_local_experts") is not None:
        text["n_routed_experts"] = text["num_local_experts"]  # (transformers' attribute_map alias)
    for key, default in DEFAULTS.items():
        if key not in text:
            text[key] = default
    for key in ("routed_scaling_factor", "attention_value_scale"):
        if text[key] is None:
            text[key] = 1.0
    for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "v_head_dim",
                "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group"):
        if check_int(text, key, "target") is None:
            raise DFlashError(f"target config.json {key} must be an integer >= 1, got null")
    n = text["num_hidden_layers"]
    types = _layer_types(text, n)
    sparse = _mlp_types(text, n)
    rope = _rope(text, types)
    _refuse_variants(text)
    heads, kv = text["num_attention_heads"], text["num_key_value_heads"]
    for kind, kv_heads in (("full_attention", kv), ("sliding_attention", 2 * kv)):
        if kind in types and heads % kv_heads:
            raise DFlashError(f"target num_attention_heads {heads} is not a multiple of the {kind} layers' "
                              f"{kv_heads} key/value heads")
    window = check_int(text, "sliding_window", "target")
    size = check_int(text, "sliding_window_size", "target", minimum=0)
    if size is not None:
        window = size + 1  # (transformers' MiMoV2FlashConfig: the reference attends to size previous tokens + itself)
    if window is None and "sliding_attention" in types:
        raise DFlashError("target config.json has sliding_attention layers but no sliding_window")
    experts, _, top_k = check_expert_groups(text)
    if top_k > experts:
        raise DFlashError(f"target num_experts_per_tok {top_k} must be in [1, n_routed_experts={experts}]")
    if not all(sparse) and check_int(text, "intermediate_size", "target") is None:
        raise DFlashError("target config.json has dense layers (mlp_layer_types) but intermediate_size is null")
    if text.get("rope_scaling"):  # (transformers' mimo_v2_flash reads no scaling: a KeyError there)
        raise DFlashError(f"target config.json rope_scaling {text['rope_scaling']!r} is not supported by "
                          "mimo_v2_flash (RoPE per layer type from rope_parameters, unscaled)")
    legacy_rope = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor")  # (read by _rope)
    fields = base_target_fields({k: v for k, v in text.items() if k not in legacy_rope}, "mimo_v2_flash")
    full = rope.get("full_attention", rope.get("sliding_attention"))
    fields.update(
        rope_theta=full[0],  # (the full layers' RoPE, for what reads one; the layers read rope)
        rope_scaling=None,
        partial_rotary_factor=full[1],
        rms_norm_eps=number_field(text, "rms_norm_eps", "target", 1e-5),
        layer_types=types,
        moe=MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=text["moe_intermediate_size"],
                      norm_topk_prob=bool_field(text, "norm_topk_prob", "target", True)),
        moe_layers=sparse,
        v_head_dim=text["v_head_dim"],
        sliding_window=window or 0,
        attention_value_scale=number_field(text, "attention_value_scale", "target", 0.707),
        rope=rope,
        n_group=text["n_group"],
        topk_group=text["topk_group"],
        routed_scaling_factor=number_field(text, "routed_scaling_factor", "target", 1.0),
    )
    return MiMoV2FlashConfig(**fields)


def split_row_attend(q: torch.Tensor, first: torch.Tensor, second: torch.Tensor, bias: torch.Tensor | None,
                     sinks: torch.Tensor | None, key_dim: int, value_dim: int, scale: float) -> torch.Tensor:
    """Attention over cached rows ``[key (key_dim), value (value_dim)]`` stored split in two
    equal halves (``first``, ``second``; the second padded when the row is odd), read in place:
    the logits sum the products with the key channels of each half, the values are read from
    where they lie. With ``sinks``, one more logit per query head joins the softmax and its
    share is dropped (transformers' eager attention of MiMo-V2-Flash / gpt-oss). The softmax
    runs in float32, its probabilities are rounded to the cache's dtype; long query blocks go
    in chunks of rows (about 2**25 logits held at once).

    Args:
        q: ``[heads, Tq, key_dim]`` (N sequences: ``[heads, N * Tq, key_dim]``, their rows one
            after another).
        first, second: ``[kv_heads, Tk, half]`` (N sequences: ``[N, kv_heads, Tk, half]``),
            ``half = ceil((key_dim + value_dim) / 2)``.
        bias: additive mask ``[groups * Tq, Tk]`` (N sequences: ``[N, groups * Tq, Tk]``) from
            :func:`~dflash_torch.models.layers.attention_bias`, or None.
        sinks: ``[heads]`` logits, or None.
        scale: the factor on the dot products.

    Returns:
        ``[Tq, heads * value_dim]`` (N sequences: ``[N * Tq, heads * value_dim]``) in ``second.dtype``.
    """
    if first.dim() == 3:
        first, second = first[None], second[None]
        bias = None if bias is None else bias[None]
    heads, rows, _ = q.shape
    n, kv_heads, tk, half = first.shape
    tq, groups = rows // n, heads // kv_heads
    q = q.view(heads, n, tq, key_dim).transpose(0, 1).reshape(n, kv_heads, groups, tq, key_dim)
    # (query part, key part) pairs and value parts, as views of the two halves
    if key_dim <= half:
        keys = [(slice(0, key_dim), first[..., :key_dim])]
    else:
        keys = [(slice(0, half), first), (slice(half, key_dim), second[..., :key_dim - half])]
    values = [part for part in (first[..., key_dim:], second[..., max(key_dim - half, 0):key_dim + value_dim - half])
              if part.shape[-1]]
    keys = [(cols, k[:, :, None].transpose(-1, -2)) for cols, k in keys]  # [n, kv, 1, d, Tk]
    if bias is not None:
        bias = bias.view(n, 1, groups, tq, tk)
    sink = None if sinks is None else sinks.float().view(1, kv_heads, groups, 1, 1)
    step = max(1, _SCORES_PER_CHUNK // (n * heads * tk))
    outs = []
    for start in range(0, tq, step):
        rows_q = q[..., start:start + step, :]
        logits = sum(torch.matmul(rows_q[..., cols], k).float() for cols, k in keys) * scale
        if bias is not None:
            logits = logits + bias[..., start:start + step, :]
        if sink is not None:
            logits = torch.cat([logits, sink.expand(*logits.shape[:-1], 1)], dim=-1)
        probs = torch.softmax(logits, dim=-1)
        probs = (probs[..., :-1] if sink is not None else probs).to(second.dtype)
        parts = [torch.matmul(probs, v[:, :, None]) for v in values]  # [n, kv, groups, chunk, part]
        outs.append(torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0])
    out = torch.cat(outs, dim=-2) if len(outs) > 1 else outs[0]
    return out.reshape(n, heads, tq, value_dim).transpose(1, 2).reshape(n * tq, heads * value_dim)


class MiMoAttention(nn.Module):
    """MiMo-V2-Flash attention (see the module docstring). Hugging Face names: ``q_proj``,
    ``k_proj``, ``v_proj``, ``o_proj`` and, on sliding layers, ``sinks`` ``[heads]``.

    Attributes:
        heads, kv_heads: query heads and key/value heads (sliding layers: twice the full ones').
        key_dim, value_dim: channels of a query/key head and of a value head.
        head_dim: the cache's row per key/value head in each of its two buffers,
            ``ceil((key_dim + value_dim) / 2)`` (the halves of ``[key, value]``).
    """

    def __init__(self, cfg: MiMoV2FlashConfig, sliding: bool):
        super().__init__()
        hidden, self.heads = cfg.hidden_size, cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads * (2 if sliding else 1)
        self.key_dim, self.value_dim = cfg.head_dim, cfg.v_head_dim
        self.head_dim = -(-(self.key_dim + self.value_dim) // 2)
        self.scale, self.value_scale = self.key_dim ** -0.5, cfg.attention_value_scale
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(hidden, self.heads * self.key_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.key_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.value_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.value_dim, hidden, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.heads)) if sliding else None

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, None, torch.Tensor, torch.Tensor]:
        """``x`` ``[T, hidden]`` -> rotated queries ``[heads, T, key_dim]``, no output gate, and
        what the cache's key and value buffers hold: the two halves of each key/value head's
        row ``[rotated key, value * attention_value_scale]``, ``[kv_heads, T, head_dim]`` each
        (the second padded with a zero column when the row is odd)."""
        t = x.shape[0]
        q = apply_rope(self.q_proj(x).view(t, self.heads, self.key_dim).transpose(0, 1), cos, sin)
        k = apply_rope(self.k_proj(x).view(t, self.kv_heads, self.key_dim).transpose(0, 1), cos, sin)
        v = (self.v_proj(x) * self.value_scale).view(t, self.kv_heads, self.value_dim).transpose(0, 1)
        row = torch.cat([k, v], dim=-1)
        if row.shape[-1] < 2 * self.head_dim:
            row = F.pad(row, (0, 2 * self.head_dim - row.shape[-1]))
        return q, None, row[..., :self.head_dim], row[..., self.head_dim:]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """:func:`split_row_attend` of queries over the cache's two halves ``k``, ``v`` (with
        this layer's sinks, if any): ``[rows, heads * value_dim]``."""
        return split_row_attend(q, k, v, bias, self.sinks, self.key_dim, self.value_dim, self.scale)

    def output(self, attended: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """``o_proj`` of ``attended`` ``[T, heads * value_dim]`` -> ``[T, hidden]``."""
        return self.o_proj(attended)


class MiMoMoE(nn.Module):
    """Routed experts (stacked, :class:`~dflash_torch.models.moe.Experts`) behind DeepSeek-V3's
    router, no shared expert. Hugging Face names: ``gate.weight``, ``gate.e_score_correction_bias``,
    ``experts.*``."""

    def __init__(self, cfg: MiMoV2FlashConfig):
        super().__init__()
        m = cfg.moe
        self.gate = TopkRouter(cfg)
        self.experts = Experts(m.num_experts, cfg.hidden_size, m.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]`` -> ``[T, H]`` in ``x.dtype`` (each expert's output times its float32
        weight, rounded to ``x.dtype`` once, summed in expert order)."""
        weights, experts = self.gate(x)
        e = self.experts
        return dispatch_experts(x, experts, weights, e.gate_up_proj, e.down_proj, **e.quantization())


_MTP_LAYER = re.compile(r"model\.mtp\.layers\.(\d+)\.")


class Model(TargetModel):
    """MiMo-V2-Flash decoder layers: attention (sinks and windows on sliding layers), then a
    dense MLP or the mixture of experts."""

    def make_layer(self, index: int, kind: str, slot: int) -> DecoderLayer:
        cfg = self.config
        sliding = kind == "sliding_attention"
        mlp = MiMoMoE(cfg) if cfg.moe_layers[index] else MLP(cfg.hidden_size, cfg.intermediate_size)
        layer = DecoderLayer(kind, MiMoAttention(cfg, sliding), mlp, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
                             RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), slot,
                             sliding_window=cfg.sliding_window if sliding else None)
        layer.rope_key = kind
        return layer

    def make_rotary(self) -> nn.ModuleDict:
        """One :class:`Rotary` per layer type (``cfg.rope``), over ``head_dim``."""
        cfg = self.config
        return nn.ModuleDict({kind: Rotary(cfg.head_dim, theta, None, partial_rotary_factor=partial,
                                           max_position_embeddings=cfg.max_position_embeddings)
                              for kind, (theta, partial) in cfg.rope.items()})

    # --- loading ---

    @classmethod
    def checkpoint_keys(cls, cfg: MiMoV2FlashConfig, key: str) -> bool:
        """Skip the multi-token-prediction layers (``model.mtp.``)."""
        return not key.startswith(MTP_PREFIX)

    @classmethod
    def check_skipped(cls, cfg: MiMoV2FlashConfig, skipped: set[str], model_dir) -> None:
        """What is skipped are multi-token-prediction layers: ``model.mtp.layers.{i}.*``, each
        holding ``eh_proj.weight`` (what makes one).

        Raises:
            DFlashError: a skipped tensor outside those layers, or a layer without ``eh_proj.weight``.
        """
        layers: dict[int, set[str]] = {}
        for key in sorted(skipped):
            m = _MTP_LAYER.match(key)
            if m is None:
                raise DFlashError(f"target checkpoint {model_dir} has {key} under {MTP_PREFIX} but outside its "
                                  "multi-token-prediction layers (model.mtp.layers.N.): an unsupported variant?")
            layers.setdefault(int(m[1]), set()).add(key)
        for i, names in sorted(layers.items()):
            if f"model.mtp.layers.{i}.eh_proj.weight" not in names:
                raise DFlashError(f"target checkpoint {model_dir}: model.mtp.layers.{i} has no eh_proj.weight: not a "
                                  "multi-token-prediction layer (an unsupported variant?)")

    @classmethod
    def convert_checkpoint(cls, cfg: MiMoV2FlashConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The sinks as saved (``self_attn.attention_sink_bias``) -> ``self_attn.sinks``; per-expert
        weights stacked (:func:`~dflash_torch.models.moe.fuse_expert_weights`; stacked ones kept).

        Raises:
            DFlashError: a layer's sinks under both names; see
                :func:`~dflash_torch.models.moe.fuse_expert_weights`.
        """
        for key in [k for k in state if k.endswith(SINK_NAMES[0])]:
            new = key[: -len(SINK_NAMES[0])] + SINK_NAMES[1]
            if new in state:
                raise DFlashError(f"target checkpoint holds both {key} and {new}: the same weight under two names")
            state[new] = state.pop(key)
        return fuse_expert_weights(state, cfg.moe.num_experts)

    @classmethod
    def checkpoint_name(cls, cfg: MiMoV2FlashConfig, key: str) -> str:
        """As transformers' ``save_pretrained`` names it."""
        return key[: -len(SINK_NAMES[1])] + SINK_NAMES[0] if key.endswith(SINK_NAMES[1]) else key

    @classmethod
    def float32_keys(cls, cfg: MiMoV2FlashConfig, key: str) -> bool:
        """The router's weight and score correction bias stay float32 (as in transformers)."""
        return key.endswith((".mlp.gate.weight", ".mlp.gate.e_score_correction_bias"))
