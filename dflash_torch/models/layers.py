"""Building blocks shared by the target and the drafter: RMSNorm, the SwiGLU MLP and
attention (rotary position embedding lives in :mod:`dflash_torch.models.rope`).

Hidden states are rows ``[T, H]``: one sequence, or the blocks of several sequences one
after another (batched decoding: :func:`attend` then takes per-sequence keys/values).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fp8 import Fp8Linear
from .nvfp4 import Nvfp4Linear
from .packed_int import IntLinear


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (computed in float32, as in Llama/Qwen)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose weight is stored as an offset from one (Qwen3-Next, Qwen3.5): the
    output is ``norm(x) * (1 + weight)``, scaled in float32 before the cast back (the
    order of transformers' ``Qwen3_5RMSNorm``, unlike :class:`RMSNorm`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class Float32WeightRMSNorm(nn.Module):
    """RMSNorm whose weight multiplies in float32 before the one cast back (transformers'
    ``DeepseekV4RMSNorm``, ``NemotronHRMSNorm``): ``(weight * x * rsqrt(mean(x**2) + eps)).to(x.dtype)``,
    unlike :class:`RMSNorm`, which casts first."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (self.weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


def embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """An ``nn.Embedding`` with a ``[num_embeddings, embedding_dim]`` weight in the default
    dtype and device; on the meta device (a model built before its checkpoint is loaded)
    its weight is not initialized (torch's normal initialization there imports
    ``torch._dynamo``, about a second of every command's start)."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))
    return nn.Embedding(num_embeddings, embedding_dim)


def fused_linear(parts: list[nn.Module]) -> nn.Module:
    """One layer whose output is the outputs of ``parts`` (linears over the same input
    width, all with a bias or all without) side by side, in order. ``nn.Linear`` parts: an
    ``nn.Linear`` whose weight is their weights stacked ``[sum(out_features), in_features]``,
    in their dtype and device; FP8 parts (:class:`~dflash_torch.models.fp8.Fp8Linear`, one
    block width): an ``Fp8Linear`` of their stacked weights and row scales; packed integer
    parts (:class:`~dflash_torch.models.packed_int.IntLinear`, one scheme): an ``IntLinear``
    of their stacked words and scales; NVFP4 parts (:class:`~dflash_torch.models.nvfp4.Nvfp4Linear`,
    one kind): an ``Nvfp4Linear`` of their stacked bytes and scales; a mix of kinds (a quantized checkpoint whose config
    keeps some of them unquantized): a :class:`JoinedLinear` that runs each part."""
    if all(type(p) is nn.Linear for p in parts):
        with torch.device("meta"):
            fused = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=parts[0].bias is not None)
        with torch.no_grad():
            fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
            if fused.bias is not None:
                fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
        return fused
    if all(isinstance(p, Fp8Linear) for p in parts) and len({p.fp8_block_cols for p in parts}) == 1:
        return Fp8Linear.joined(parts)
    if all(isinstance(p, IntLinear) for p in parts) and len({(p.int_bits, p.int_group) for p in parts}) == 1:
        return IntLinear.joined(parts)
    if all(isinstance(p, Nvfp4Linear) for p in parts) and len({p.nvfp4_kind for p in parts}) == 1:
        return Nvfp4Linear.joined(parts)
    return JoinedLinear(parts)


class JoinedLinear(nn.Module):
    """Linears of any kind over the same input, run one after another, their outputs
    concatenated on the last dimension (what :func:`fused_linear` gives for parts it cannot
    stack into one weight)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features, self.out_features = parts[0].in_features, sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def _normed32(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` in float32 times ``(mean(x**2) + eps) ** -0.5`` (``pow``, as transformers' Gemma norms)."""
    x32 = x.float()
    return x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + eps, -0.5)


class UnitRMSNorm(nn.Module):
    """RMSNorm without a weight (transformers' Gemma-style ``RMSNorm(with_scale=False)``:
    float32, ``x * (mean(x**2) + eps) ** -0.5``), times a constant ``scale`` in the input dtype."""

    def __init__(self, eps: float, scale: float = 1.0):
        super().__init__()
        self.eps, self.scale = eps, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _normed32(x, self.eps).to(x.dtype)
        return out * self.scale if self.scale != 1.0 else out


class ScaledRMSNorm(nn.Module):
    """:class:`UnitRMSNorm` times ``weight``, scaled in float32 before the cast back (the
    order of transformers' Gemma 4 / Muse Glimmer ``RMSNorm``, unlike :class:`RMSNorm`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_normed32(x, self.eps) * self.weight.float()).to(x.dtype)


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class MLP(nn.Module):
    """Gated feed-forward: ``down(act(gate(x)) * up(x))``, ``act`` SiLU (SwiGLU, the
    default) or GELU with the tanh approximation (``activation="gelu_tanh"``: GeGLU, Gemma).
    Parameter names ``gate_proj``, ``up_proj``, ``down_proj``; after :meth:`fuse`,
    ``gate_up_proj``."""

    def __init__(self, hidden: int, intermediate: int, activation: str = "silu"):
        super().__init__()
        self.act = ACTIVATIONS[activation]
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up_proj = None  # set by fuse()

    def fuse(self) -> None:
        """Join ``gate_proj`` and ``up_proj`` into one linear ``gate_up_proj`` (in place, for
        inference: same outputs from one matmul; the state dict's names change)."""
        if self.gate_up_proj is None:
            self.gate_up_proj = fused_linear([self.gate_proj, self.up_proj])
            del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, hidden]`` -> ``[T, hidden]``."""
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


def attention_bias(visible: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask for :func:`attend`, built once per forward and shared by
    all layers: 0 where ``visible`` (bool ``[..., Tq, Tk]``; a leading dimension is one
    per sequence of a batch) is True, -inf elsewhere, rows repeated for the ``groups``
    query heads of a key/value head -> ``[..., groups * Tq, Tk]`` in ``dtype``. (On CPU,
    SDPA converts a bool mask to this form on every call; doing it once saves about a
    third of a small attention's time.)"""
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))
    return bias.repeat(*([1] * (bias.dim() - 2)), groups, 1) if groups > 1 else bias


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
           scale: float | None = None) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads.

    Query head ``h`` reads key/value head ``h // (n_heads // n_kv_heads)``. The query
    heads of one group are folded into the row axis (``[n_kv, groups * Tq, d]``), so
    the keys and values are read in place, never repeated per query head.

    Args:
        q: ``[n_heads, Tq, head_dim]``.
        k, v: ``[n_kv_heads, Tk, head_dim]``; ``n_heads`` is a multiple of ``n_kv_heads``.
            Batched: ``[N, n_kv_heads, Tk, head_dim]``, the keys of N sequences, whose
            queries are the N consecutive groups of ``Tq / N`` rows of ``q``.
        bias: additive mask ``[groups * Tq, Tk]`` (batched: ``[N, groups * Tq / N, Tk]``)
            from :func:`attention_bias`, or None for full attention.
        scale: the factor on the scores; None: ``1 / sqrt(head_dim)``.

    Returns:
        ``[Tq, n_heads * head_dim]``.
    """
    if k.dim() == 4:
        return _attend_batched(q, k, v, bias, scale)
    heads, tq, d = q.shape
    groups = heads // k.shape[0]
    if groups > 1:
        q = q.reshape(k.shape[0], groups * tq, d)
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=bias, scale=scale)
    return out[0].reshape(heads, tq, d).transpose(0, 1).reshape(tq, heads * d)


def _attend_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                    scale: float | None = None) -> torch.Tensor:
    """:func:`attend` for N sequences: ``q`` ``[n_heads, N * Tq, d]``, ``k``/``v``
    ``[N, n_kv_heads, Tk, d]``, ``bias`` ``[N, groups * Tq, Tk]`` -> ``[N * Tq, n_heads * d]``."""
    heads, rows, d = q.shape
    n, kv_heads = k.shape[0], k.shape[1]
    tq, groups = rows // n, heads // kv_heads
    q = q.view(heads, n, tq, d).transpose(0, 1).reshape(n, kv_heads, groups * tq, d)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if bias is None else bias[:, None], scale=scale)
    return out.reshape(n, heads, tq, d).transpose(1, 2).reshape(rows, heads * d)
