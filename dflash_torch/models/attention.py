"""The attention projections shared by target and drafter layers (Llama/Qwen2/Qwen3)."""

from __future__ import annotations

import torch
from torch import nn

from .layers import RMSNorm
from .rope import apply_rope


class Attention(nn.Module):
    """q/k/v/o projections, optional per-head q/k RMSNorm (Qwen3), q/k/v bias (Qwen2) and
    o bias (Llama with ``attention_bias``).

    Hugging Face parameter names: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
    ``q_norm``, ``k_norm``.
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool, qk_norm: bool, eps: float,
                 o_bias: bool = False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, hidden]`` -> rotated queries ``[heads, T, head_dim]``."""
        q = self.q_proj(x).view(x.shape[0], self.heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q.transpose(0, 1), cos, sin)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[T, hidden]`` -> rotated keys and values, each ``[kv_heads, T, head_dim]``."""
        t = x.shape[0]
        k = self.k_proj(x).view(t, self.kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        return apply_rope(k.transpose(0, 1), cos, sin), v.transpose(0, 1)
