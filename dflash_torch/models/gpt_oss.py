"""gpt-oss targets (``gpt_oss``: gpt-oss-20b, gpt-oss-120b; transformers'
``modeling_gpt_oss.py``, OpenAI's gpt-oss model card).

Each layer: attention with q/k/v/o biases and a learned *attention sink* per query head
(one more logit in the softmax whose value is dropped: a head may attend to nothing),
banded to the last ``sliding_window`` positions on ``"sliding_attention"`` layers (every
other layer) and causal over all positions on the others; then a mixture of experts
whose router (a linear with bias) takes the top-k logits and softmaxes them, and whose
experts (with biases) apply a clamped SwiGLU (:func:`~dflash_torch.models.moe.expert_activation`).

Checkpoints: the published ones store the expert matrices in MXFP4
(``quantization_config.quant_method: "mxfp4"``, :mod:`.mxfp4`); they are dequantized
once, when loading, to the dtype the model runs in (gpt-oss-20b: about 42 GB in
bfloat16), or kept packed (``TargetConfig.keep_mxfp4``: each forward dequantizes the
experts it runs). Unquantized checkpoints (transformers' ``save_pretrained``) load as they are.
Experts are stored ``gate_up_proj`` ``[E, H, 2I]`` with gate and up columns interleaved
(MXFP4: ``[E, 2I, H]`` rows) and ``down_proj`` ``[E, I, H]`` (MXFP4: ``[E, H, I]``);
:meth:`Model.convert_checkpoint` rewrites them into the stacked layout of :mod:`.moe`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import DFlashError
from . import mxfp4
from .attention import Attention
from .layers import RMSNorm
from .config import (MoEConfig, TargetConfig, base_target_fields, bool_field, check_int, check_layer_types,
                     number_field, refuse_partial_rotary)
from .moe import dispatch_experts
from .target import DecoderLayer, TargetModel

QUANTIZATION_METHODS = ("mxfp4",)  # the quant_method values this family reads (see mxfp4.py)
LAYER_TYPES = ("sliding_attention", "full_attention")
# transformers' GptOssConfig rope when a config has none (that of the published checkpoints); where no
# rope_theta is given, GptOssConfig's default_theta (150000) applies (config.base_target_fields)
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
_SCORES_PER_CHUNK = 1 << 25  # attention logits held at once (query rows are taken in chunks)


@dataclass
class GptOssConfig(TargetConfig):
    """:class:`TargetConfig` plus gpt-oss's ``sliding_window`` (positions a
    ``"sliding_attention"`` layer sees) and its experts' ``swiglu_limit`` / ``swiglu_alpha``."""

    sliding_window: int = 128
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702


def parse_config(cfg: dict) -> GptOssConfig:
    """A ``gpt_oss`` ``config.json`` -> :class:`GptOssConfig`.

    Raises:
        DFlashError: missing keys, a ``layer_types`` that is not a list of names, of the
            wrong length or with another type, sliding layers without ``sliding_window``,
            top-k outside the experts.
    """
    if not cfg.get("rope_parameters") and not cfg.get("rope_scaling"):  # transformers' GptOssConfig default
        cfg = dict(cfg, rope_parameters=dict(DEFAULT_ROPE))  # (its rope_theta: the top level's, else 150000)
    fields = base_target_fields(cfg, "gpt_oss")
    refuse_partial_rotary(fields, "gpt_oss")
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        types = [LAYER_TYPES[i % 2] for i in range(n)]  # transformers' default
    types = check_layer_types(types, n, LAYER_TYPES, "gpt_oss")
    window = check_int(cfg, "sliding_window", "target")
    if window is None and "sliding_attention" in types:
        raise DFlashError("target config.json has sliding_attention layers but no sliding_window")
    experts = check_int(cfg, "num_local_experts", "target")
    top_k = check_int(cfg, "num_experts_per_tok", "target") or check_int(cfg, "experts_per_token", "target")
    if experts is None or top_k is None or not fields["intermediate_size"]:
        raise DFlashError("target config.json lacks num_local_experts, num_experts_per_tok or intermediate_size")
    if not 1 <= top_k <= experts:
        raise DFlashError(f"target num_experts_per_tok {top_k} must be in [1, num_local_experts={experts}]")
    quant = cfg.get("quantization_config") or {}
    fields.update(
        mxfp4=isinstance(quant, dict) and quant.get("quant_method") == "mxfp4",
        layer_types=list(types),
        attention_bias=bool_field(cfg, "attention_bias", "target", True),
        moe=MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=fields["intermediate_size"], norm_topk_prob=True),
        sliding_window=window or 0,
        swiglu_limit=number_field(cfg, "swiglu_limit", "target", 7.0),
        swiglu_alpha=number_field(cfg, "swiglu_alpha", "target", 1.702),
    )
    return GptOssConfig(**fields)


def sink_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                sinks: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product attention with one sink logit per query head: softmax over the
    keys' logits and ``sinks[h]``, the sink's share dropped (transformers'
    ``eager_attention_forward`` of gpt-oss). No fused kernel takes a sink, but one that
    returns each row's log-sum-exp ``L`` of the keys' logits does: the sink then scales a row
    of plain attention by ``exp(L) / (exp(L) + exp(sink)) = sigmoid(L - sink)``. On the CPU
    that is torch's flash-attention kernel (:func:`_sink_attend_flash`: 3.4x to 5.2x faster in
    four runs, bfloat16, 16 to 1,024 queries over 4,096 keys, gpt-oss-20b's 64 query and 8
    key/value heads of 64 dimensions, 1 thread; ``scripts/sink_attention_speed.py``), for
    blocks of at least :data:`FLASH_MIN_ROWS` queries a sequence: prefill chunks, which a
    speculative and a target-only run read alike. A verify block and a target-only step take
    the logits' path (:func:`_sink_attend_logits`), as elsewhere than the CPU: its rows do
    not depend on how many run at once, the flash kernel's do (in bfloat16 a tiny gpt-oss's
    speculative output left the target-only output on 19 of 30 prompts; trial-248).

    Args:
        q, k, v, bias: as :func:`~dflash_torch.models.layers.attend` (one sequence:
            ``q`` ``[heads, Tq, d]``, ``k``/``v`` ``[kv_heads, Tk, d]``, ``bias``
            ``[groups * Tq, Tk]``; N sequences: ``q`` ``[heads, N * Tq, d]``, ``k``/``v``
            ``[N, kv_heads, Tk, d]``, ``bias`` ``[N, groups * Tq, Tk]``).
        sinks: ``[heads]``, a logit per query head.

    Returns:
        ``[Tq, heads * d]`` (N sequences: ``[N * Tq, heads * d]``) in ``v.dtype``.
    """
    rows = q.shape[1] // (k.shape[0] if k.dim() == 4 else 1)  # (a sequence's)
    if q.device.type == "cpu" and _FLASH_CPU is not None and rows >= FLASH_MIN_ROWS:
        return _sink_attend_flash(q, k, v, bias, sinks)
    return _sink_attend_logits(q, k, v, bias, sinks)


FLASH_MIN_ROWS = 128
"""Query rows a sequence from which :func:`sink_attend` takes the flash kernel on the CPU:
above any verify block (drafters' blocks are 16 tokens or fewer), below the default prefill
chunk (256)."""


def _batched(k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None):
    """One sequence's ``k``, ``v`` (``[kv_heads, Tk, d]``) and ``bias`` as a batch of one
    (``[1, kv_heads, Tk, d]``, ``[1, groups * Tq, Tk]``); a batch's as they are."""
    if k.dim() == 4:
        return k, v, bias
    return k[None], v[None], None if bias is None else bias[None]


# (torch's CPU flash attention, which returns the rows' log-sum-exp; absent from a torch without it)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _sink_attend_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                       sinks: torch.Tensor) -> torch.Tensor:
    """:func:`sink_attend` by :data:`_FLASH_CPU` (blocked: no logits written out): plain
    attention and each row's log-sum-exp ``L`` (float32), the row scaled by
    ``sigmoid(L - sink)`` in float32. A row that sees no key is 0 (the kernel gives it output
    0 and ``L`` 0), as the sink taking everything makes it."""
    k, v, bias = _batched(k, v, bias)
    heads, rows, d = q.shape
    n, kv_heads = k.shape[0], k.shape[1]
    tq, groups = rows // n, heads // kv_heads
    q = q.view(heads, n, tq, d).transpose(0, 1).reshape(n, kv_heads, groups * tq, d)  # (as layers.attend folds)
    out, lse = _FLASH_CPU(q, k, v, 0.0, False, attn_mask=None if bias is None else bias[:, None])
    keep = torch.sigmoid(lse.view(n, kv_heads, groups, tq) - sinks.float().view(1, kv_heads, groups, 1))
    out = (out.view(n, kv_heads, groups, tq, d).float() * keep[..., None]).to(v.dtype)
    return out.reshape(n, heads, tq, d).transpose(1, 2).reshape(n * tq, heads * d)


def _sink_attend_logits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                        sinks: torch.Tensor) -> torch.Tensor:
    """:func:`sink_attend` with the logits written out: the softmax over them and the sink
    runs in float32; long query blocks go in chunks of rows, so at most about 2**25 logits
    are held at once (:data:`_SCORES_PER_CHUNK`)."""
    k, v, bias = _batched(k, v, bias)
    heads, rows, d = q.shape
    n, kv_heads, tk = k.shape[0], k.shape[1], k.shape[2]
    tq, groups = rows // n, heads // kv_heads
    q = q.view(heads, n, tq, d).transpose(0, 1).reshape(n, kv_heads, groups, tq, d)
    if bias is not None:
        bias = bias.view(n, 1, groups, tq, tk)
    sink = sinks.float().view(1, kv_heads, groups, 1, 1)
    keys = k[:, :, None].transpose(-1, -2)  # [n, kv_heads, 1, d, Tk]
    step = max(1, _SCORES_PER_CHUNK // (n * heads * tk))
    outs = []
    for start in range(0, tq, step):
        logits = torch.matmul(q[..., start:start + step, :], keys).float() * d ** -0.5
        if bias is not None:
            logits = logits + bias[..., start:start + step, :]
        logits = torch.cat([logits, sink.expand(*logits.shape[:-1], 1)], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :-1].to(v.dtype)
        outs.append(torch.matmul(probs, v[:, :, None]))  # [n, kv, groups, chunk, d]
    out = torch.cat(outs, dim=-2) if len(outs) > 1 else outs[0]
    return out.reshape(n, heads, tq, d).transpose(1, 2).reshape(n * tq, heads * d)


class SinkAttention(Attention):
    """gpt-oss attention: q/k/v/o with biases and a learned sink logit per query head
    (``sinks`` ``[heads]``, Hugging Face name ``self_attn.sinks``)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool, eps: float):
        super().__init__(hidden, heads, kv_heads, head_dim, bias, qk_norm=False, eps=eps, o_bias=bias)
        self.sinks = nn.Parameter(torch.zeros(heads))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return sink_attend(q, k, v, bias, self.sinks)


class GptOssExperts(nn.Module):
    """Stacked expert weights with biases (uninitialised: loaded from a checkpoint):
    ``gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up rows), ``gate_up_proj_bias``
    ``[E, 2I]``, ``down_proj`` ``[E, H, I]``, ``down_proj_bias`` ``[E, H]``.

    ``packed``: the two matrices stay MXFP4 as the checkpoint stores them (a quarter of
    bfloat16's memory): uint8 ``gate_up_proj_blocks`` ``[E, 2I, H / 32, 16]`` with
    ``gate_up_proj_scales`` ``[E, 2I, H / 32]`` (same row order) and ``down_proj_blocks``
    ``[E, H, I / 32, 16]`` with ``down_proj_scales`` ``[E, H, I / 32]``; each forward
    dequantizes the experts it runs (:func:`~dflash_torch.models.moe.dispatch_experts`).
    """

    custom_op = True  # run by a torch.library custom operator (see TargetModel.from_pretrained)

    def __init__(self, num_experts: int, hidden: int, intermediate: int, packed: bool = False):
        super().__init__()
        self.packed = packed
        if packed:
            if hidden % mxfp4.BLOCK or intermediate % mxfp4.BLOCK:
                raise DFlashError(f"MXFP4 experts need hidden_size and intermediate_size divisible by {mxfp4.BLOCK}, "
                                  f"got {hidden} and {intermediate}")
            for name, rows, cols in (("gate_up_proj", 2 * intermediate, hidden), ("down_proj", hidden, intermediate)):
                groups = cols // mxfp4.BLOCK
                blocks = torch.empty(num_experts, rows, groups, mxfp4.BLOCK // 2, dtype=torch.uint8)
                setattr(self, name + "_blocks", nn.Parameter(blocks, requires_grad=False))
                scales = torch.empty(num_experts, rows, groups, dtype=torch.uint8)
                setattr(self, name + "_scales", nn.Parameter(scales, requires_grad=False))
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
            self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))

    def matrices(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(gate_up, down, gate_up_scales, down_scales)`` as :func:`dispatch_experts`
        takes them: the float matrices and None, or the MXFP4 blocks and their scales."""
        if self.packed:
            return self.gate_up_proj_blocks, self.down_proj_blocks, self.gate_up_proj_scales, self.down_proj_scales
        return self.gate_up_proj, self.down_proj, None, None


class GptOssMoE(nn.Module):
    """The gpt-oss MLP: ``router`` (Linear H -> E with bias) picks the top-k experts by
    logit, their softmax weights them; each runs a clamped SwiGLU with biases.
    Hugging Face names: ``router.weight``, ``router.bias``, ``experts.*``."""

    def __init__(self, cfg: GptOssConfig):
        super().__init__()
        m = cfg.moe
        self.top_k, self.swiglu_limit, self.swiglu_alpha = m.top_k, cfg.swiglu_limit, cfg.swiglu_alpha
        self.router = nn.Linear(cfg.hidden_size, m.num_experts, bias=True)
        self.experts = GptOssExperts(m.num_experts, cfg.hidden_size, m.intermediate_size, packed=cfg.keep_mxfp4)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router: ``x`` ``[T, H]`` -> (weights ``[T, k]`` in ``x.dtype``, int64 expert ids
        ``[T, k]``, highest logit first): the softmax (float32) of the top-k logits."""
        top, experts = torch.topk(self.router(x), self.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=torch.float32).to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]`` -> ``[T, H]`` in ``x.dtype``."""
        weights, experts = self.route(x)
        gate_up, down, gate_up_scales, down_scales = self.experts.matrices()
        return dispatch_experts(x, experts, weights, gate_up, down, self.experts.gate_up_proj_bias,
                                self.experts.down_proj_bias, self.swiglu_limit, self.swiglu_alpha,
                                gate_up_scales, down_scales)


class GptOssRMSNorm(RMSNorm):
    """RMSNorm that scales in float32 before the cast back (transformers' ``GptOssRMSNorm``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


class Model(TargetModel):
    """gpt-oss decoder layers: sink attention (banded on sliding layers), then the MoE."""

    norm_class = GptOssRMSNorm

    def make_layer(self, index: int, kind: str, slot: int) -> DecoderLayer:
        cfg = self.config
        attn = SinkAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                             cfg.attention_bias, cfg.rms_norm_eps)
        window = cfg.sliding_window if kind == "sliding_attention" else None
        return DecoderLayer(kind, attn, GptOssMoE(cfg), GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
                            GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps), slot, sliding_window=window)

    @classmethod
    def convert_checkpoint(cls, cfg: GptOssConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rewrite every layer's experts into :class:`GptOssExperts`' layout: ``[out, in]``
        matrices (MXFP4: rows), gate rows before up rows; MXFP4 pairs are dequantized (into
        the dtype of the checkpoint's other weights, as loaded) unless ``cfg.keep_mxfp4``.

        Raises:
            DFlashError: an MXFP4 pair that does not match, packed blocks that are not finite
                (:func:`.mxfp4.check_finite`), an expert tensor with another number of
                dimensions than its layout's.
        """
        quantized = {k.removesuffix("_blocks") for k in state if k.endswith("_blocks")}
        if cfg.keep_mxfp4:  # (dequantized, the loader's finiteness check covers what check_finite does)
            for name in sorted(quantized):
                if name + "_scales" in state:
                    mxfp4.check_finite(state[name + "_blocks"], state[name + "_scales"], name)
        else:
            dtype = state["model.embed_tokens.weight"].dtype if "model.embed_tokens.weight" in state else torch.float32
            mxfp4.dequantize_state(state, dtype)
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}.mlp.experts."
            for name, dims in _EXPERT_DIMS.items():  # (what the rewrites below index)
                if p + name in state and state[p + name].dim() != dims:
                    raise DFlashError(f"target weight {p + name} has shape {tuple(state[p + name].shape)}; "
                                      f"expected {dims} dimensions")
            for key in (p + "gate_up_proj", p + "gate_up_proj_blocks", p + "gate_up_proj_scales"):
                if key in state:
                    w = state[key]
                    if key == p + "gate_up_proj" and key not in quantized:
                        w = w.transpose(1, 2)  # [E, H, 2I] -> [E, 2I, H]
                    state[key] = _gate_rows_first(w)
            if p + "gate_up_proj_bias" in state:
                state[p + "gate_up_proj_bias"] = _gate_rows_first(state[p + "gate_up_proj_bias"])
            if p + "down_proj" in state and p + "down_proj" not in quantized:
                state[p + "down_proj"] = state[p + "down_proj"].transpose(1, 2).contiguous()  # -> [E, H, I]
        return state


# dimensions of each expert tensor of a checkpoint ([E, ...]; MXFP4 pairs as stored, or dequantized)
_EXPERT_DIMS = {"gate_up_proj": 3, "down_proj": 3, "gate_up_proj_bias": 2, "down_proj_bias": 2,
                "gate_up_proj_blocks": 4, "gate_up_proj_scales": 3, "down_proj_blocks": 4, "down_proj_scales": 3}


def _gate_rows_first(w: torch.Tensor) -> torch.Tensor:
    """``[E, 2I, ...]`` with gate and up rows interleaved (gate, up, gate, ...) -> gate rows, then up rows."""
    return torch.cat([w[:, 0::2], w[:, 1::2]], dim=1).contiguous()
