"""The sparse mixture-of-experts MLP of Qwen3-MoE, Qwen3-Next and Qwen3.5-MoE, the expert
dispatch it shares with gpt-oss (:mod:`.gpt_oss`), and the conversion of per-expert
checkpoint weights to the stacked layout it holds.

A router (``gate``, Linear hidden -> num_experts) scores every expert; softmax in float32,
the top-k experts per token, optionally renormalised to sum to 1 (``norm_topk_prob``;
Qwen3.5-MoE always renormalises), weights cast back to the activation dtype. Each chosen
expert is a SwiGLU MLP; its output, scaled by the routing weight, is summed per token in
increasing expert order (the order transformers' eager expert loop adds them in). Qwen3-Next
and Qwen3.5-MoE add a shared expert (a SwiGLU MLP every token goes through) scaled by
``sigmoid(shared_expert_gate(x))``.

Experts are held stacked, as transformers 5 holds them in memory:
``experts.gate_up_proj`` ``[E, 2 * I, H]`` (the gate rows, then the up rows) and
``experts.down_proj`` ``[E, H, I]``. Published checkpoints store them per expert
(``...experts.{e}.gate_proj.weight`` ``[I, H]``, ``up_proj`` ``[I, H]``, ``down_proj``
``[H, I]``): :func:`fuse_expert_weights` rewrites those into the stacked keys.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import DFlashError
from .layers import ACTIVATIONS, MLP
from . import fp8
from .mxfp4 import dequantize
from .packed_int import dequantize_groups

_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight"
                         r"(?P<scale>_scale)?$")
_PROJS = ("gate_proj", "up_proj", "down_proj")


class Experts(nn.Module):
    """Stacked SwiGLU expert weights (uninitialised: loaded from a checkpoint).

    Parameters: ``gate_up_proj`` ``[num_experts, 2 * intermediate, hidden]`` (with
    ``gated=False``: non-gated experts, Nemotron-H's, ``[num_experts, intermediate, hidden]``,
    the up rows only; run them with :func:`dispatch_experts`'s ``relu2``) and
    ``down_proj`` ``[num_experts, hidden, intermediate]``; after :meth:`keep_fp8`, those in
    ``float8_e4m3fn`` and their row scales ``gate_up_proj_scale``, ``down_proj_scale``.
    """

    custom_op = True  # run by a torch.library custom operator (see TargetModel.from_pretrained)
    fp8_block_cols = 0  # > 0: the matrices stay FP8, in blocks of this many columns
    int_bits = int_group = 0  # int_bits > 0: the matrices stay packed integers (group 0: per output channel)
    mxfp4 = False  # the matrices stay MXFP4 (DeepSeek-V4's FP4 experts, :meth:`keep_mxfp4`)
    nvfp4_kind = 0  # > 0: the matrices stay NVFP4 (:meth:`keep_nvfp4`; the kind, nvfp4.CT or nvfp4.MODELOPT_NVFP4)

    def __init__(self, num_experts: int, hidden: int, intermediate: int, gated: bool = True):
        super().__init__()
        self.gated = gated
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, (2 if gated else 1) * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.gate_up_proj_scale = self.down_proj_scale = None
        self.gate_up_proj_scale_2 = self.down_proj_scale_2 = None

    def keep_fp8(self, block_cols: int) -> None:
        """Hold the matrices FP8 (meta, to load into; :mod:`~dflash_torch.models.fp8`): each
        forward dequantizes the experts it runs."""
        self.fp8_block_cols = block_cols
        with torch.device("meta"):
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(self, name)
                setattr(self, name, nn.Parameter(torch.empty(w.shape, dtype=fp8.FORMAT), requires_grad=False))
                scales = torch.empty(*w.shape[:-1], -(-w.shape[-1] // block_cols))
                setattr(self, name + "_scale", nn.Parameter(scales, requires_grad=False))

    def keep_mxfp4(self) -> None:
        """Hold the matrices as MXFP4 (meta, to load into; :mod:`~dflash_torch.models.mxfp4`):
        uint8 blocks ``[E, rows, cols / 32, 16]`` and exponents ``[E, rows, cols / 32]``, the
        bytes of DeepSeek-V4's FP4 experts (:func:`~dflash_torch.models.mxfp4.fp4_as_blocks`);
        each forward dequantizes the experts it runs."""
        from .mxfp4 import BLOCK

        self.mxfp4 = True
        with torch.device("meta"):
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(self, name)
                blocks = torch.empty(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK // 2, dtype=torch.uint8)
                setattr(self, name, nn.Parameter(blocks, requires_grad=False))
                scales = torch.empty(*w.shape[:-1], w.shape[-1] // BLOCK, dtype=torch.uint8)
                setattr(self, name + "_scale", nn.Parameter(scales, requires_grad=False))

    def keep_int(self, bits: int, group: int | None, scale_dtype: torch.dtype = torch.float32) -> None:
        """Hold the matrices as packed integers (meta, to load into;
        :mod:`~dflash_torch.models.packed_int`): int32 words ``[E, rows, cols * bits / 32]``
        and scales ``[E, rows, cols / group or 1]`` in ``scale_dtype``; each forward
        dequantizes the experts it runs."""
        from .packed_int import words

        self.int_bits, self.int_group = bits, group or 0
        with torch.device("meta"):
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(self, name)
                packed = torch.empty(*w.shape[:-1], words(w.shape[-1], bits), dtype=torch.int32)
                setattr(self, name, nn.Parameter(packed, requires_grad=False))
                scales = torch.empty(*w.shape[:-1], w.shape[-1] // group if group else 1, dtype=scale_dtype)
                setattr(self, name + "_scale", nn.Parameter(scales, requires_grad=False))

    def keep_nvfp4(self, kind: int) -> None:
        """Hold the matrices as NVFP4 (meta, to load into; :mod:`~dflash_torch.models.nvfp4`):
        uint8 bytes ``[E, rows, cols / 2]``, float8_e4m3fn group scales ``[E, rows, cols / 16]``
        and float32 per-tensor scales ``[E, rows]`` (one per row: gate and up rows may differ)
        applied as ``kind`` says (:data:`~dflash_torch.models.nvfp4.CT` or
        :data:`~dflash_torch.models.nvfp4.MODELOPT_NVFP4`); once loaded, :meth:`build_tables`
        builds their dequantization tables, and each forward dequantizes the experts it runs by
        reading them (the loader's values)."""
        from .nvfp4 import FP8, GROUP

        self.nvfp4_kind = kind
        for name in ("gate_up_proj", "down_proj"):
            self.register_buffer(name + "_table", None, persistent=False)
            self.register_buffer(name + "_rows", None, persistent=False)
        with torch.device("meta"):
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(self, name)
                setattr(self, name, nn.Parameter(torch.empty(*w.shape[:-1], w.shape[-1] // 2, dtype=torch.uint8),
                                                 requires_grad=False))
                setattr(self, name + "_scale", nn.Parameter(torch.empty(*w.shape[:-1], w.shape[-1] // GROUP,
                                                                        dtype=FP8), requires_grad=False))
                setattr(self, name + "_scale_2", nn.Parameter(torch.empty(w.shape[:-1]), requires_grad=False))

    def build_tables(self, dtype: torch.dtype) -> None:
        """NVFP4 experts (loaded): build ``gate_up_proj_table`` / ``down_proj_table`` ``[T,
        4096]`` in ``dtype`` and ``gate_up_proj_rows`` / ``down_proj_rows`` int32 ``[E, rows]``
        (:func:`~dflash_torch.models.nvfp4.tables`: one table per distinct per-tensor scale of
        the stack, each expert row's index), on the matrices' device."""
        from .nvfp4 import tables

        for name in ("gate_up_proj", "down_proj"):
            table, rows = tables(getattr(self, name + "_scale_2"), self.nvfp4_kind, dtype)
            setattr(self, name + "_table", table)
            setattr(self, name + "_rows", rows)

    def quantization(self) -> dict:
        """The keyword arguments of :func:`dispatch_experts` that say how the matrices are held
        (scales, FP8 block columns, packed integer scheme, NVFP4 tables).

        Raises:
            DFlashError: NVFP4 experts whose tables are not built (:meth:`build_tables`)."""
        if self.nvfp4_kind and self.gate_up_proj_table is None:
            raise DFlashError("NVFP4 experts ran before their tables were built (Experts.build_tables(dtype) builds "
                              "them for the model's dtype)")
        nvfp4 = dict(gate_up_table=self.gate_up_proj_table, gate_up_rows=self.gate_up_proj_rows,
                     down_table=self.down_proj_table, down_rows=self.down_proj_rows) if self.nvfp4_kind else {}
        return dict(gate_up_scales=self.gate_up_proj_scale, down_scales=self.down_proj_scale,
                    fp8_block_cols=self.fp8_block_cols, int_bits=self.int_bits, int_group=self.int_group, **nvfp4)


def expert_activation(gate: torch.Tensor, up: torch.Tensor, swiglu_limit: float, swiglu_alpha: float,
                      gelu_tanh: bool = False, swiglu_offset: float = 1.0) -> torch.Tensor:
    """An expert's gated activation of its ``gate`` and ``up`` projections (same shape).

    ``gelu_tanh``: GeGLU, ``gelu_tanh(gate) * up`` (Gemma 4). Else ``swiglu_limit == 0``:
    SwiGLU, ``silu(gate) * up`` (Qwen MoE); ``swiglu_limit > 0``: gpt-oss's clamped variant
    (transformers' ``GptOssExperts``): ``gate`` clamped to at most the limit, ``up`` to
    ``[-limit, limit]``, then ``gate * sigmoid(alpha * gate) * (up + 1)``; with
    ``swiglu_offset`` 0 (DeepSeek-V4's clamped SwiGLU, transformers' ``DeepseekV4Experts``):
    the same clamps, then ``silu(gate) * up``.
    """
    if gelu_tanh:
        return ACTIVATIONS["gelu_tanh"](gate) * up
    if swiglu_limit == 0:
        return F.silu(gate) * up
    gate = gate.clamp(max=swiglu_limit)
    up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    if swiglu_offset == 0:
        return F.silu(gate) * up
    return gate * torch.sigmoid(gate * swiglu_alpha) * (up + swiglu_offset)


@torch.library.custom_op("dflash_torch::dispatch_experts", mutates_args=())
def dispatch_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up_proj: torch.Tensor,
                     down_proj: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
                     down_bias: torch.Tensor | None = None, swiglu_limit: float = 0.0,
                     swiglu_alpha: float = 1.0, gate_up_scales: torch.Tensor | None = None,
                     down_scales: torch.Tensor | None = None, fp8_block_cols: int = 0,
                     gelu_tanh: bool = False, int_bits: int = 0, int_group: int = 0,
                     swiglu_offset: float = 1.0, relu2: bool = False, gate_up_table: torch.Tensor | None = None,
                     gate_up_rows: torch.Tensor | None = None, down_table: torch.Tensor | None = None,
                     down_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Run each token through its chosen experts and sum the weighted outputs.

    Only the experts that some token chose are computed: the ``T * k`` (token, expert)
    pairs are sorted by expert, their per-expert counts are read to the host once, and
    each hit expert runs on the rows that chose it. That loop depends on the data, so
    this function is a custom operator (``torch.library.custom_op``) that
    ``torch.compile`` keeps as one opaque node of fixed output shape: the compiled graph
    around it neither breaks nor is re-traced when the routing changes.

    Args:
        x: ``[T, hidden]`` activations.
        experts: int64 ``[T, k]`` expert ids (distinct per row).
        weights: ``[T, k]`` routing weights in ``x.dtype`` or float32 (Gemma 4: each
            expert's output times its weight is then rounded to ``x.dtype`` once).
        gate_up_proj: ``[E, 2 * I, hidden]`` (each expert's gate rows, then its up rows);
            down_proj: ``[E, hidden, I]``.
        gate_up_bias: ``[E, 2 * I]`` or None; down_bias: ``[E, hidden]`` or None (gpt-oss).
        swiglu_limit, swiglu_alpha, gelu_tanh, swiglu_offset: the activation
            (:func:`expert_activation`; 0, False: SwiGLU).
        relu2: non-gated experts (Nemotron-H): ``gate_up_proj`` ``[E, I, hidden]`` holds the
            up rows only and an expert computes ``down(relu(up(x)) ** 2)``.
        gate_up_scales, down_scales: None, or the matrices are MXFP4 (uint8 blocks
            ``[E, rows, cols / 32, 16]``, scales ``[E, rows, cols / 32]``,
            :mod:`~dflash_torch.models.mxfp4`), or FP8 (``float8_e4m3fn`` matrices, float32
            row scales ``[E, rows, ceil(cols / fp8_block_cols)]``, :mod:`~dflash_torch.models.fp8`):
            each expert run is dequantized to ``x.dtype``.
        fp8_block_cols: the block width of FP8 matrices (0 otherwise).
        int_bits, int_group: > 0: the matrices are packed integers (int32 words
            ``[E, rows, cols * int_bits / 32]``, scales ``[E, rows, cols / int_group]``,
            or ``[E, rows, 1]`` when ``int_group`` is 0; :mod:`~dflash_torch.models.packed_int`).
        gate_up_table, gate_up_rows, down_table, down_rows: tables given: the matrices are NVFP4
            (uint8 bytes ``[E, rows, cols / 2]``, float8_e4m3fn group scales ``[E, rows, cols /
            16]`` in ``gate_up_scales`` / ``down_scales``) read from their tables (``[T, 4096]``
            in ``x.dtype``, each row's int32 ``[E, rows]``: :func:`~dflash_torch.models.nvfp4.lookup`).

    While a CUDA graph is being captured (``--compile`` on CUDA), where nothing may be
    read to the host, it runs :func:`gathered_experts` instead, which the graph's replays
    then run.

    Returns:
        ``[T, hidden]`` in ``x.dtype``.
    """
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return gathered_experts(x, experts, weights, gate_up_proj, down_proj, gate_up_bias, down_bias,
                                swiglu_limit, swiglu_alpha, gate_up_scales, down_scales, fp8_block_cols, gelu_tanh,
                                int_bits, int_group, swiglu_offset, relu2, gate_up_table, gate_up_rows, down_table,
                                down_rows)
    t, k = experts.shape
    quant, inter = (int_bits, int_group), gate_up_proj.shape[1] // (1 if relu2 else 2)  # (the down matrices' columns)
    up_nvfp4, down_nvfp4 = _nvfp4(gate_up_table, gate_up_rows), _nvfp4(down_table, down_rows)
    out = torch.zeros_like(x)
    # pairs in (slot, token) order, grouped by expert (stable sort): the row order of
    # transformers' eager loop, so each expert's matmul sees the same rows
    by_slot = experts.t().reshape(-1)
    order = torch.argsort(by_slot, stable=True)
    counts = torch.bincount(by_slot, minlength=gate_up_proj.shape[0]).tolist()
    pair_weights = weights.t().reshape(-1)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        tokens = pairs % t
        gate_up_w = _expert(gate_up_proj, gate_up_scales, e, x.dtype, fp8_block_cols, quant, x.shape[-1], up_nvfp4)
        down_w = _expert(down_proj, down_scales, e, x.dtype, fp8_block_cols, quant, inter, down_nvfp4)
        gate_up = F.linear(x[tokens], gate_up_w, None if gate_up_bias is None else gate_up_bias[e])
        act = F.relu(gate_up).square() if relu2 else expert_activation(
            *gate_up.chunk(2, dim=-1), swiglu_limit, swiglu_alpha, gelu_tanh, swiglu_offset)
        h = F.linear(act, down_w, None if down_bias is None else down_bias[e])
        out.index_add_(0, tokens, (h * pair_weights[pairs, None]).to(out.dtype))
    return out


def _nvfp4(table: torch.Tensor | None, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    return None if table is None else (table, rows)


def _expert(weight: torch.Tensor, scales: torch.Tensor | None, e, dtype: torch.dtype, fp8_block_cols: int = 0,
            quant: tuple[int, int] = (0, 0), cols: int = 0,
            nvfp4: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Expert ``e``'s matrix (``e`` a slice or an index tensor: those experts' matrices) in
    ``dtype``, dequantized when MXFP4, FP8, packed integers (``quant``: bits and group;
    ``cols``: the matrix's columns) or NVFP4 (``nvfp4``: the stack's table ``[T, 4096]`` in
    ``dtype`` and its rows' tables, int32 ``[E, rows]``; only expert ``e``'s rows are read)."""
    if scales is None:
        return weight[e]
    if nvfp4 is not None:
        from .nvfp4 import lookup

        table, rows = nvfp4
        return lookup(weight[e], scales[e], table, rows[e])
    if weight.dtype == fp8.FORMAT:
        return fp8.dequantize_rows(weight[e], scales[e], fp8_block_cols, dtype)
    if weight.dtype == torch.int32:
        return dequantize_groups(weight[e], scales[e], quant[0], quant[1] or None, cols, dtype)
    return dequantize(weight[e], scales[e], dtype)


def gathered_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up_proj: torch.Tensor,
                     down_proj: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
                     down_bias: torch.Tensor | None = None, swiglu_limit: float = 0.0,
                     swiglu_alpha: float = 1.0, gate_up_scales: torch.Tensor | None = None,
                     down_scales: torch.Tensor | None = None, fp8_block_cols: int = 0,
                     gelu_tanh: bool = False, int_bits: int = 0, int_group: int = 0,
                     swiglu_offset: float = 1.0, relu2: bool = False, gate_up_table: torch.Tensor | None = None,
                     gate_up_rows: torch.Tensor | None = None, down_table: torch.Tensor | None = None,
                     down_rows: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`dispatch_experts` (same arguments and result) with no data-dependent shape
    and no host read, so that a CUDA graph can capture it: every (token, expert) pair
    gathers its expert's weights and the ``T * k`` pairs run as two batched matmuls. It
    reads an expert's weights once per pair that chose it (``T * k`` expert reads against
    the distinct experts hit), and sums a token's ``k`` outputs in slot order. MXFP4
    and FP8 matrices are dequantized per pair when there are fewer pairs than experts,
    else whole (all E experts) and then gathered.
    """
    t, k = experts.shape
    ids = experts.reshape(-1)  # token-major pairs
    quant = (int_bits, int_group)

    def per_pair(weight: torch.Tensor, scales: torch.Tensor | None, cols: int,
                 nvfp4: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:  # [T * k, rows, cols]
        if scales is not None and ids.numel() < weight.shape[0]:
            return _expert(weight, scales, ids, x.dtype, fp8_block_cols, quant, cols, nvfp4)
        return _expert(weight, scales, slice(None), x.dtype, fp8_block_cols, quant, cols, nvfp4)[ids]

    rows = x.repeat_interleave(k, dim=0)[:, :, None]  # [T * k, hidden, 1]
    gate_up = torch.bmm(per_pair(gate_up_proj, gate_up_scales, x.shape[-1], _nvfp4(gate_up_table, gate_up_rows)),
                        rows)[..., 0]
    if gate_up_bias is not None:
        gate_up = gate_up + gate_up_bias[ids]
    act = F.relu(gate_up).square() if relu2 else expert_activation(
        *gate_up.chunk(2, dim=-1), swiglu_limit, swiglu_alpha, gelu_tanh, swiglu_offset)
    h = torch.bmm(per_pair(down_proj, down_scales, gate_up_proj.shape[1] // (1 if relu2 else 2),
                           _nvfp4(down_table, down_rows)),
                  act[:, :, None])[..., 0]
    if down_bias is not None:
        h = h + down_bias[ids]  # [T * k, hidden]
    return (h * weights.reshape(-1, 1)).to(x.dtype).view(t, k, -1).sum(dim=1)


@dispatch_experts.register_fake
def _(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up_proj: torch.Tensor,
      down_proj: torch.Tensor, gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
      swiglu_limit: float = 0.0, swiglu_alpha: float = 1.0, gate_up_scales: torch.Tensor | None = None,
      down_scales: torch.Tensor | None = None, fp8_block_cols: int = 0, gelu_tanh: bool = False, int_bits: int = 0,
      int_group: int = 0, swiglu_offset: float = 1.0, relu2: bool = False, gate_up_table: torch.Tensor | None = None,
      gate_up_rows: torch.Tensor | None = None, down_table: torch.Tensor | None = None,
      down_rows: torch.Tensor | None = None) -> torch.Tensor:
    return torch.empty_like(x)


class SparseMoE(nn.Module):
    """Top-k routed mixture of SwiGLU experts, with an optional gated shared expert.

    Hugging Face parameter names: ``gate.weight`` ``[E, H]`` (the router),
    ``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``, and with a
    shared expert ``shared_expert.{gate,up,down}_proj.weight`` and
    ``shared_expert_gate.weight`` ``[1, H]``.

    Args:
        hidden: hidden size H.
        num_experts: E.
        top_k: experts per token (``num_experts_per_tok``), 1 <= top_k <= E.
        intermediate: per-expert intermediate size I (``moe_intermediate_size``).
        norm_topk_prob: renormalise the top-k probabilities to sum to 1.
        shared_intermediate: intermediate size of the shared expert
            (``shared_expert_intermediate_size``), or None for none (Qwen3-MoE).

    Raises:
        DFlashError: ``top_k`` outside ``[1, num_experts]``.
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, norm_topk_prob: bool,
                 shared_intermediate: int | None = None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise DFlashError(f"num_experts_per_tok {top_k} must be between 1 and num_experts {num_experts}")
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, intermediate)
        self.shared_expert = MLP(hidden, shared_intermediate) if shared_intermediate else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_intermediate else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router: ``x`` ``[T, H]`` -> (weights ``[T, k]`` in ``x.dtype``, int64 expert ids
        ``[T, k]``, highest probability first). Softmax and renormalisation in float32."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]`` -> ``[T, H]`` in ``x.dtype``."""
        weights, experts = self.route(x)
        e = self.experts
        out = dispatch_experts(x, experts, weights, e.gate_up_proj, e.down_proj, **e.quantization())
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def fuse_expert_weights(state: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Rewrite per-expert checkpoint weights into the stacked layout of :class:`Experts`.

    Every group ``P.{e}.gate_proj.weight`` ``[I, H]``, ``P.{e}.up_proj.weight`` ``[I, H]``,
    ``P.{e}.down_proj.weight`` ``[H, I]`` (``P`` ending in ``.experts``, ``e`` in
    ``0..num_experts-1``) becomes ``P.gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up
    rows) and ``P.down_proj`` ``[E, H, I]``; FP8 weights kept as stored come with their row
    scales (``...weight_scale``, :mod:`~dflash_torch.models.fp8`), stacked alike into
    ``P.gate_up_proj_scale`` and ``P.down_proj_scale``. Already stacked keys and all other
    keys are left as they are. Works layer by layer, in place: each layer's per-expert
    entries are dropped from ``state`` as soon as its stacked tensors are built, so at most
    one layer is held twice.

    Args:
        state: name -> tensor; modified in place.
        num_experts: E.

    Returns:
        ``state``.

    Raises:
        DFlashError: one line naming the layer's prefix: an expert missing or missing a
            matrix, an expert id >= E, inconsistent shapes or dtypes, scales for some
            experts' matrices only, or a layer holding both the per-expert and the stacked
            layout.
    """
    groups: dict[str, dict[int, dict[str, str]]] = {}
    for key in state:
        m = _PER_EXPERT.match(key)
        if m:
            groups.setdefault(m["prefix"], {}).setdefault(int(m["expert"]), {})[m["proj"] + (m["scale"] or "")] = key
    for prefix, experts in groups.items():
        keys = _check_expert_group(state, prefix, experts, num_experts)
        for suffix in ("", "_scale") if "gate_proj_scale" in keys[0] else ("",):
            gate0 = state[keys[0]["gate_proj" + suffix]]
            inter = gate0.shape[0]
            gate_up = gate0.new_empty(num_experts, 2 * inter, gate0.shape[1])
            down = gate0.new_empty(num_experts, *state[keys[0]["down_proj" + suffix]].shape)
            for e in range(num_experts):
                gate_up[e, :inter] = state.pop(keys[e]["gate_proj" + suffix])
                gate_up[e, inter:] = state.pop(keys[e]["up_proj" + suffix])
                down[e] = state.pop(keys[e]["down_proj" + suffix])
            state[f"{prefix}.gate_up_proj{suffix}"] = gate_up
            state[f"{prefix}.down_proj{suffix}"] = down
    return state


def _check_expert_group(state: dict[str, torch.Tensor], prefix: str, experts: dict[int, dict[str, str]],
                        num_experts: int) -> list[dict[str, str]]:
    """The keys of experts ``0..E-1`` of one layer, after checking they are complete and consistent."""
    where = f"expert weights of {prefix}"
    extra = sorted(e for e in experts if e >= num_experts)
    if extra:
        raise DFlashError(f"{where}: expert ids {extra} are outside num_experts {num_experts}")
    absent = [e for e in range(num_experts) if e not in experts]
    if absent:
        raise DFlashError(f"{where}: experts {_ids(absent)} are missing (num_experts {num_experts})")
    for e in range(num_experts):
        lacking = [p for p in _PROJS if p not in experts[e]]
        if lacking:
            raise DFlashError(f"{where}: expert {e} lacks {', '.join(p + '.weight' for p in lacking)}")
    for stacked in ("gate_up_proj", "down_proj"):
        if f"{prefix}.{stacked}" in state:
            raise DFlashError(f"{where}: both per-expert weights and the stacked {prefix}.{stacked}")
    scaled = {p + "_scale" in experts[e] for e in range(num_experts) for p in _PROJS}
    if len(scaled) > 1:  # (an FP8 checkpoint quantizes all of a layer's experts or none)
        raise DFlashError(f"{where}: some experts' matrices are kept quantized (with scales) and others not; "
                          "load the checkpoint dequantized (--fp8 / --int-weights dequantize)")
    gate0, down0 = state[experts[0]["gate_proj"]], state[experts[0]["down_proj"]]
    # (packed integers, kept as int32 words, or FP4 bytes kept as uint8: a row holds several columns, so down is not
    # gate's transpose)
    down_shape = tuple(down0.shape) if gate0.dtype in (torch.int32, torch.uint8) else tuple(gate0.shape[::-1])
    expected = {"gate_proj": tuple(gate0.shape), "up_proj": tuple(gate0.shape), "down_proj": down_shape}
    if gate0.dim() != 2 or tuple(down0.shape) != expected["down_proj"]:
        raise DFlashError(f"{where}: expert 0 has gate_proj {tuple(gate0.shape)} and down_proj {tuple(down0.shape)}, "
                          "expected [I, H] and [H, I]")
    for e in range(num_experts):
        for p in _PROJS:
            t = state[experts[e][p]]
            if tuple(t.shape) != expected[p] or t.dtype != gate0.dtype:
                raise DFlashError(f"{where}: expert {e} {p}.weight is {tuple(t.shape)} {t.dtype}, "
                                  f"expected {expected[p]} {gate0.dtype} like expert 0")
    if scaled == {True}:  # FP8 row scales: gate and up alike, each like expert 0's
        gate_s, down_s = state[experts[0]["gate_proj_scale"]], state[experts[0]["down_proj_scale"]]
        want = {"gate_proj": gate_s.shape, "up_proj": gate_s.shape, "down_proj": down_s.shape}
        for e in range(num_experts):
            for p, shape in want.items():
                t = state[experts[e][p + "_scale"]]
                if t.shape != shape or t.dtype != gate_s.dtype:
                    raise DFlashError(f"{where}: expert {e} {p}.weight_scale is {tuple(t.shape)} {t.dtype}, "
                                      f"expected {tuple(shape)} {gate_s.dtype} like expert 0")
    return [experts[e] for e in range(num_experts)]


def _ids(ids: list[int]) -> str:
    return ", ".join(map(str, ids[:8])) + (" ..." if len(ids) > 8 else "")
