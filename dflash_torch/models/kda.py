"""Kimi Delta Attention (KDA): the linear-attention layers of Kimi Linear (``kimi_linear``)
and GLM-5.3-Flash (``glm5_next``), with the exact rollback speculative decoding needs.

Math: the gated delta rule with a *per key channel* forget gate, from Kimi Team, "Kimi
Linear: An Expressive, Efficient Attention Architecture" (arXiv 2510.26692), built on the
delta rule of Yang et al. (NeurIPS 2024; ICLR 2025; see :mod:`.gated_deltanet`). Layer
layout as in transformers' ``KimiLinearDeltaAttention`` (``modeling_kimi_linear.py``) and
``Glm5NextTextLinearAttention`` (``modeling_glm5_next.py``): the same parameters and function,
except that GLM-5.3-Flash's forget gate is by default a bounded sigmoid ("safe gate") where
Kimi Linear's is the softplus one (:class:`ForgetGate`'s ``lower_bound`` None).

Checkpoints (both families): a KDA layer's weights lie under ``model.layers.{i}.self_attn.``;
the published ones keep the forget gate's ``f_a_proj`` / ``f_b_proj`` / ``dt_bias`` / ``A_log``
flat there and the convolution split into ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``
(:func:`convert_layer` joins and renames them; :func:`checkpoint_name` names them back).

Per head, with a float32 state ``S`` ``[d_k, d_v]`` and, for each token ``t``, ``q_t`` and
``k_t`` L2-normalised (``q_t`` also scaled by ``d_k ** -0.5``), ``g_t`` a log decay per key
channel (``[d_k]``, <= 0) and ``beta_t`` in [0, 1]::

    S'_t = diag(exp(g_t)) S_{t-1}                     (each key channel decays on its own)
    u_t  = beta_t * (v_t - S'_t^T k_t)                (delta-rule correction)
    S_t  = S'_t + k_t u_t^T,     o_t = S_t^T q_t

Gated DeltaNet is the case where every channel of a head shares ``g_t``. For a chunk of T
tokens with ``G = cumsum(g)`` (per channel, ``[T, d_k]``), the corrections solve one unit lower
triangular system ``(I + L) u = beta*v - (beta * k * exp(G)) S_0`` with
``L[t, j] = beta_t sum_c k_t[c] k_j[c] exp(G_t[c] - G_j[c])`` (``j < t``; only differences
``G_t - G_j <= 0`` are exponentiated, so nothing overflows however strong the decay), the
outputs are ``o_t = S_0^T (exp(G_t) * q_t) + sum_{j <= t} (sum_c q_t[c] k_j[c] exp(G_t[c] -
G_j[c])) u_j``, and the state after the first ``n`` tokens is, in closed form::

    S_n = diag(exp(G_{n-1})) S_0 + sum_{j < n} (exp(G_{n-1} - G_j) * k_j) u_j^T

**Rollback.** ``u_j`` depends only on tokens ``<= j``, so a verify block keeps ``S_0``, ``k``,
``u`` and the per-channel ``G`` and, once acceptance is known, moves the state to "after the
accepted prefix" with that closed form (:func:`~dflash_torch.models.gated_deltanet.state_after`,
which takes a per-channel ``G``; :func:`~dflash_torch.models.gated_deltanet.commit_stashed`);
the short causal convolution's state (the last ``kernel - 1`` projected inputs) rolls back by
taking the window that ends at the last accepted token. The recurrent state lives in the
shared :class:`~dflash_torch.cache.RecurrentState` (``[N, heads, d_k, d_v]`` float32 per layer),
as Gated DeltaNet's and Mamba-2's do, so batching, fixed shapes and compiled rounds run it
unchanged.

Memory: a chunk holds the pairwise decays ``[N, heads, T, T, d_k]`` in float32 (T <= 64;
134 MB for one sequence of GLM-5.3-Flash's 64 heads of 128 at T = 64, 8 MB for a verify
block of 16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import RecurrentState
from ..errors import DFlashError
from .gated_deltanet import _l2norm, commit_stashed, run_chunks

GATE_NAMES = ("f_a_proj.", "f_b_proj.", "dt_bias", "A_log")  # the forget gate's, flat under self_attn. when published
CONV_PARTS = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")  # the convolution, split when published


class KdaGatedNorm(nn.Module):
    """KDA's output norm (Hugging Face ``o_norm``): per head an RMSNorm then a sigmoid gate,
    ``weight * norm(x) * sigmoid(gate)`` all in float32 (the weight too), rounded to ``x.dtype``
    once (transformers' ``Glm5NextTextRMSNormGated``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``x``, ``gate`` ``[..., dim]`` -> ``[..., dim]`` in ``x.dtype``."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32 * torch.sigmoid(gate.float())).to(x.dtype)


class ForgetGate(nn.Module):
    """KDA's per-channel forget gate (Hugging Face ``forget_gate``: ``f_a_proj`` ``[d_k, hidden]``,
    ``f_b_proj`` ``[heads * d_k, d_k]``, ``dt_bias`` ``[heads * d_k]``, ``A_log`` ``[heads]``; the
    last two float32). With ``f = f_b_proj(f_a_proj(x)) + dt_bias`` (float32) and
    ``A = exp(A_log)`` per head, the log decay is ``lower_bound * sigmoid(A * f)`` (a "safe gate":
    in ``(lower_bound, 0)``) or, when ``lower_bound`` is None, ``-A * softplus(f)``."""

    def __init__(self, hidden: int, heads: int, head_dim: int, lower_bound: float | None):
        super().__init__()
        self.heads, self.head_dim, self.lower_bound = heads, head_dim, lower_bound
        self.f_a_proj = nn.Linear(hidden, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, heads * head_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(heads * head_dim))
        self.A_log = nn.Parameter(torch.zeros(heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[R, hidden]`` -> float32 log decays ``[R, heads, d_k]`` (<= 0)."""
        f = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(-1, self.heads, self.head_dim)
        rate = self.A_log.float().exp()[:, None]  # [heads, 1]
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * f)
        return -rate * F.softplus(f)


def kda_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of Kimi Delta Attention (all float32; see the module docstring), for any
    leading dims ``...`` (the sequences of a batch: ``[N]``).

    Args:
        q, k: ``[..., H, T, d_k]`` (L2-normalised; q also scaled by ``d_k ** -0.5``).
        v: ``[..., H, T, d_v]``.
        g: ``[..., H, T, d_k]`` log decays per key channel (<= 0); beta: ``[..., H, T]`` in [0, 1].
        state: ``[..., H, d_k, d_v]``, the state before the chunk.

    Returns:
        outputs ``[..., H, T, d_v]``, the corrections ``u`` ``[..., H, T, d_v]`` and
        ``G = cumsum(g)`` ``[..., H, T, d_k]`` (what
        :func:`~dflash_torch.models.gated_deltanet.state_after` needs).
    """
    T = q.shape[-2]
    G = g.cumsum(-2)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    # exp(G_t - G_j) per channel for j <= t, 0 above the diagonal: [..., H, T, T, d_k]
    decay = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~causal[..., None], float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta[..., :, None, :] * k[..., None, :, :] * decay).sum(-1)  # its strictly lower part is L
    rhs = torch.cat([v * beta[..., None], k_beta * G.exp()], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u = solved[..., : v.shape[-1]] - solved[..., v.shape[-1]:] @ state
    scores = (q[..., :, None, :] * k[..., None, :, :] * decay).sum(-1)  # [..., H, T, T], zero above the diagonal
    out = (q * G.exp()) @ state + scores @ u
    return out, u, G


class KimiDeltaAttention(nn.Module):
    """A KDA token mixer over N sequences at once (N = 1 for one sequence).

    Hugging Face parameter names (``KimiLinearDeltaAttention``, ``Glm5NextTextLinearAttention``;
    under a layer's ``self_attn.`` in the checkpoint, see :func:`convert_layer`): ``q_proj``, ``k_proj``, ``v_proj`` (``[heads * d, hidden]`` each),
    ``conv1d`` (depthwise over ``[q, k, v]``, no bias, float32), ``forget_gate.*``
    (:class:`ForgetGate`), ``b_proj`` (``[heads, hidden]``: ``beta = sigmoid(b_proj(x))``),
    ``g_a_proj`` / ``g_b_proj`` (the output gate's low rank), ``o_norm`` (:class:`KdaGatedNorm`),
    ``o_proj``. The convolution runs in float32 (its weight's dtype in transformers) and is
    followed by SiLU; q, k and v have ``heads`` heads of ``d`` (= ``d_k`` = ``d_v``) each.

    Args:
        hidden: model width.
        heads, head_dim: ``linear_num_heads``, ``linear_head_dim``.
        conv_kernel: taps of the causal convolution (``linear_conv_kernel_dim``).
        eps: epsilon of ``o_norm`` (``rms_norm_eps``).
        lower_bound: the forget gate's ``linear_lower_bound`` (None: the softplus gate).

    Attributes (what :class:`~dflash_torch.cache.RecurrentState` and the memory accounting
    read): ``kernel``, ``conv_dim`` (``3 * heads * d``), ``nv`` (heads), ``dk``, ``dv``.
    """

    def __init__(self, hidden: int, heads: int, head_dim: int, conv_kernel: int, eps: float,
                 lower_bound: float | None):
        super().__init__()
        self.nv, self.dk, self.dv, self.kernel = heads, head_dim, head_dim, conv_kernel
        width = heads * head_dim
        self.conv_dim = 3 * width
        self.q_proj = nn.Linear(hidden, width, bias=False)
        self.k_proj = nn.Linear(hidden, width, bias=False)
        self.v_proj = nn.Linear(hidden, width, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        self.forget_gate = ForgetGate(hidden, heads, head_dim, lower_bound)
        self.b_proj = nn.Linear(hidden, heads, bias=False)
        self.g_a_proj = nn.Linear(hidden, head_dim, bias=False)
        self.g_b_proj = nn.Linear(head_dim, width, bias=False)
        self.o_norm = KdaGatedNorm(head_dim, eps)
        self.o_proj = nn.Linear(width, hidden, bias=False)

    def new_state(self, state: RecurrentState) -> int:
        """Register this layer's state in ``state``; returns its slot."""
        return state.add_layer(self.kernel - 1, self.conv_dim, self.nv, self.dk, self.dv)

    def forward(self, x: torch.Tensor, state: RecurrentState, slot: int, commit=None, defer: bool = False) -> torch.Tensor:
        """Mix ``x`` ``[N * T, hidden]`` (already normed; the rows of N = ``state.sequences``
        sequences, T each, in order) -> ``[N * T, hidden]`` in ``x.dtype``, sequence ``i``
        reading (and writing) row ``i`` of ``state``'s layer ``slot``.

        Args:
            commit: None to advance the states over all T rows; ``n`` (int, 0-dim or ``[N]``
                int64 tensor) to advance them over the first n rows only (padded chunks).
            defer: leave the states as they are and record what :meth:`commit` needs to
                advance them later over each sequence's accepted prefix (a verify).

        Raises:
            ValueError: a deferred block of more than 64 rows.
        """
        N = state.sequences
        T = x.shape[0] // N
        dtype, H, d = x.dtype, self.nv, self.dk
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        conv_in = torch.cat([state.conv[slot], qkv.reshape(N, T, -1)], dim=1)  # [N, K-1+T, C]
        w = self.conv1d.weight
        mixed = F.conv1d(conv_in.transpose(1, 2).to(w.dtype), w, groups=self.conv_dim)  # [N, C, T]
        mixed = F.silu(mixed).to(dtype).transpose(1, 2)  # [N, T, C]
        q, k, v = mixed.reshape(N, T, 3, H, d).unbind(2)  # [N, T, H, d] each
        q = _l2norm(q.float()).transpose(1, 2) * d ** -0.5  # [N, H, T, d]
        k = _l2norm(k.float()).transpose(1, 2)
        v = v.float().transpose(1, 2)
        g = self.forget_gate(x).view(N, T, H, d).transpose(1, 2)  # [N, H, T, d]
        beta = torch.sigmoid(self.b_proj(x)).float().view(N, T, H).transpose(1, 2)  # [N, H, T]
        out = run_chunks(kda_chunk, q, k, v, g, beta, state, slot, conv_in, self.kernel - 1, commit, defer)
        gate = self.g_b_proj(self.g_a_proj(x)).view(N, T, H, d)
        out = self.o_norm(out.transpose(1, 2).to(dtype), gate)
        return self.o_proj(out.reshape(N * T, H * d))

    def commit(self, state: RecurrentState, slot: int, n) -> None:
        """Advance the states of layer ``slot`` over the first ``n`` rows of the last deferred
        block: the rollback of a verify (``n``: an int or a 0-dim int64 tensor in ``[1, T]``
        for every sequence, or ``[N]`` int64 in ``[0, T]`` per sequence, 0: that state stays)."""
        commit_stashed(state, slot, n, self.kernel - 1)


def rename_weight(state: dict[str, torch.Tensor], old: str, new: str) -> None:
    """Move ``state[old]`` to ``state[new]`` (nothing when ``old`` is absent).

    Raises:
        DFlashError: the checkpoint holds the weight under both names.
    """
    if old in state:
        if new in state:
            raise DFlashError(f"the target checkpoint holds {new} twice (as {old} too)")
        state[new] = state.pop(old)


def convert_layer(state: dict[str, torch.Tensor], layer: str, index: int) -> None:
    """Rename, in place, one KDA layer's checkpoint weights ``{layer}self_attn.*`` (``layer``:
    e.g. ``"model.layers.3."``; transformers' in-memory names or the published ones, see the
    module docstring) to :class:`KimiDeltaAttention`'s under ``{layer}linear_attn.``, the split
    convolution ``[q_conv1d; k_conv1d; v_conv1d]`` joined into ``conv1d.weight`` ``[3 * heads *
    d, 1, kernel]``.

    Raises:
        DFlashError: one line: a part of the split convolution without the others or beside a
            joined ``conv1d.weight``; a weight held under both of its names (:func:`rename_weight`).
    """
    attn = layer + "self_attn."
    parts = [attn + p for p in CONV_PARTS]
    if any(p in state for p in parts):
        if not all(p in state for p in parts) or attn + "conv1d.weight" in state:
            raise DFlashError(f"the target checkpoint's layer {index} holds a part of its split convolution "
                              f"({', '.join(CONV_PARTS)}) but not all of them, or next to conv1d.weight")
        state[attn + "conv1d.weight"] = torch.cat([state.pop(p) for p in parts])
    for key in [k for k in state if k.startswith(attn)]:
        rest = key[len(attn):]
        if rest.startswith(GATE_NAMES):
            rest = "forget_gate." + rest
        rename_weight(state, key, layer + "linear_attn." + rest)


def checkpoint_name(key: str, published: bool) -> str:
    """The checkpoint's name of a parameter ``key`` of a KDA layer (``...linear_attn.X``; other
    keys unchanged): under ``self_attn.``, as :func:`convert_layer` found it (``published``: the
    forget gate flat, the convolution as its first part, ``q_conv1d``)."""
    key = key.replace(".linear_attn.", ".self_attn.")
    if published:
        key = key.replace(".self_attn.forget_gate.", ".self_attn.")
        key = key.replace(".self_attn.conv1d.weight", ".self_attn.q_conv1d.weight")
    return key
