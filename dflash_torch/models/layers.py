"""Building blocks shared by the target and the drafter: RMSNorm, rotary position
embedding (RoPE, with Llama-3 and linear scaling), the SwiGLU MLP and attention.

All tensors are for a single sequence (batch size 1): hidden states are ``[T, H]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


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


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse RoPE frequencies, ``[head_dim // 2]`` float32.

    ``scaling`` may be ``{"rope_type": "linear", "factor"}`` or the Llama-3.1 rule
    ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}`` (Meta's Llama 3.1 release).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        factor = float(scaling["factor"])
        if kind == "linear":
            inv_freq = inv_freq / factor
        elif kind == "llama3":
            low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
            old_len = float(scaling["original_max_position_embeddings"])
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
            inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq.float()


class Rotary(nn.Module):
    """Rotary position embedding in the "rotate half" layout used by Llama/Qwen."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin tables ``[T, head_dim]`` in ``dtype`` for int64 ``positions`` ``[T]``."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[heads, T, head_dim]`` by per-position ``cos``/``sin`` ``[T, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attention_bias(visible: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask for :func:`attend`, built once per forward and shared by
    all layers: 0 where ``visible`` (bool ``[Tq, Tk]``) is True, -inf elsewhere, rows
    repeated for the ``groups`` query heads of a key/value head -> ``[groups * Tq, Tk]``
    in ``dtype``. (On CPU, SDPA converts a bool mask to this form on every call; doing it
    once saves about a third of a small attention's time.)"""
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))
    return bias.repeat(groups, 1) if groups > 1 else bias


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads.

    Query head ``h`` reads key/value head ``h // (n_heads // n_kv_heads)``. The query
    heads of one group are folded into the row axis (``[n_kv, groups * Tq, d]``), so
    the keys and values are read in place, never repeated per query head.

    Args:
        q: ``[n_heads, Tq, head_dim]``.
        k, v: ``[n_kv_heads, Tk, head_dim]``; ``n_heads`` is a multiple of ``n_kv_heads``.
        bias: additive mask ``[groups * Tq, Tk]`` from :func:`attention_bias`, or None
            for full attention.

    Returns:
        ``[Tq, n_heads * head_dim]``.
    """
    heads, tq, d = q.shape
    groups = heads // k.shape[0]
    if groups > 1:
        q = q.reshape(k.shape[0], groups * tq, d)
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=bias)
    return out[0].reshape(heads, tq, d).transpose(0, 1).reshape(tq, heads * d)
