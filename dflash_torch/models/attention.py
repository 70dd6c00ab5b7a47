"""The attention projections shared by target and drafter layers (Llama, Qwen2, Qwen3,
and the gated attention of Qwen3-Next / Qwen3.5)."""

from __future__ import annotations

import torch
from torch import nn

from . import layers
from .layers import RMSNorm, fused_linear
from .rope import apply_rope


class Attention(nn.Module):
    """q/k/v/o projections, optional per-head q/k norm (Qwen3 and later), q/k/v bias
    (Qwen2), o bias (Llama, Qwen3 and the DFlash drafter with ``attention_bias``; not Qwen2) and an
    optional output gate.

    With ``output_gate`` (Qwen3-Next, Qwen3.5), ``q_proj`` also produces a gate per
    query channel, interleaved per head as ``[query (head_dim), gate (head_dim)]``, and
    the attention output is multiplied by ``sigmoid(gate)`` before ``o_proj``.

    Hugging Face parameter names: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
    ``q_norm``, ``k_norm``. After :meth:`fuse` (inference only), ``qkv_proj`` or
    ``kv_proj`` replaces the projections it joins.

    Args:
        norm: the class of the q/k norms (``RMSNorm`` or ``ZeroCenteredRMSNorm``).
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool, qk_norm: bool, eps: float,
                 o_bias: bool = False, output_gate: bool = False, norm: type[nn.Module] = RMSNorm):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.output_gate = output_gate
        self.q_proj = nn.Linear(hidden, heads * head_dim * (2 if output_gate else 1), bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias)
        self.q_norm = norm(head_dim, eps) if qk_norm else None
        self.k_norm = norm(head_dim, eps) if qk_norm else None
        self.qkv_proj = self.kv_proj = None  # set by fuse()
        self.rope = True  # False: no position embedding (a NoPE layer)

    def fuse(self, query: bool) -> None:
        """Join projections that read the same rows into one linear (in place; the outputs
        are the same columns, computed by one matmul instead of several: on a GPU, one
        kernel that reads all the weights instead of three small ones).

        Args:
            query: True: ``q_proj``, ``k_proj``, ``v_proj`` -> ``qkv_proj`` (a target layer,
                whose queries, keys and values all come from the same rows; use
                :meth:`project`); False: ``k_proj``, ``v_proj`` -> ``kv_proj`` (a drafter
                layer, whose injected context rows need keys and values only).

        The joined parameters replace the separate ones (no second copy of the weights),
        so the state dict's names change: fuse a model loaded for inference only.
        """
        if self.qkv_proj is not None or self.kv_proj is not None:
            return
        if query:
            self.qkv_proj = fused_linear([self.q_proj, self.k_proj, self.v_proj])
            del self.q_proj
        else:
            self.kv_proj = fused_linear([self.k_proj, self.v_proj])
        del self.k_proj, self.v_proj

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """``x`` ``[T, hidden]`` -> rotated queries ``[heads, T, head_dim]``, the output gate
        (as :meth:`query_gate`), rotated keys and values ``[kv_heads, T, head_dim]``: one
        matmul after ``fuse(query=True)``, else three."""
        if self.qkv_proj is None:
            return (*self.query_gate(x, cos, sin), *self.key_value(x, cos, sin))
        kv = self.kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([self.qkv_proj.out_features - 2 * kv, kv, kv], dim=-1)
        return (*self._queries(q, cos, sin), *self._keys_values(k, v, cos, sin))

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, hidden]`` -> rotated queries ``[heads, T, head_dim]`` (no output gate)."""
        return self.query_gate(x, cos, sin)[0]

    def query_gate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` ``[T, hidden]`` -> rotated queries ``[heads, T, head_dim]`` and the output
        gate ``[T, heads * head_dim]`` (None without ``output_gate``). Not after
        ``fuse(query=True)`` (use :meth:`project`)."""
        return self._queries(self.q_proj(x), cos, sin)

    def _queries(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = q.shape[0]
        gate = None
        if self.output_gate:
            q = q.reshape(t, self.heads, 2 * self.head_dim)
            q, gate = q[..., : self.head_dim], q[..., self.head_dim:].reshape(t, self.heads * self.head_dim)
        q = self.norm_queries(q.reshape(t, self.heads, self.head_dim)).transpose(0, 1)
        return (apply_rope(q, cos, sin) if self.rope else q), gate

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[T, hidden]`` -> rotated keys and values, each ``[kv_heads, T, head_dim]``.
        Not after ``fuse(query=True)`` (use :meth:`project`)."""
        if self.kv_proj is not None:
            return self._keys_values(*self.kv_proj(x).chunk(2, dim=-1), cos, sin)
        return self._keys_values(self.k_proj(x), self.v_proj(x), cos, sin)

    def _keys_values(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        t = k.shape[0]
        k = self.norm_keys(k.reshape(t, self.kv_heads, self.head_dim)).transpose(0, 1)
        v = v.reshape(t, self.kv_heads, self.head_dim)
        return (apply_rope(k, cos, sin) if self.rope else k), v.transpose(0, 1)

    def norm_queries(self, q: torch.Tensor) -> torch.Tensor:
        """The q norm of queries ``[T, heads, head_dim]`` (same shape), before RoPE: each
        head's channels normalised on their own (Qwen3); identity without ``q_norm``. A
        family that normalises otherwise overrides it (and :meth:`norm_keys`)."""
        return q if self.q_norm is None else self.q_norm(q)

    def norm_keys(self, k: torch.Tensor) -> torch.Tensor:
        """The k norm of keys ``[T, kv_heads, head_dim]`` (as :meth:`norm_queries`)."""
        return k if self.k_norm is None else self.k_norm(k)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Attention of queries over cached keys/values: :func:`~dflash_torch.models.layers.attend`
        (same arguments and result); a family whose softmax differs overrides it."""
        return layers.attend(q, k, v, bias)

    def output(self, attended: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """``o_proj`` of the attention output ``[T, heads * head_dim]``, gated when ``gate`` is given."""
        if gate is not None:
            attended = attended * torch.sigmoid(gate)
        return self.o_proj(attended)
