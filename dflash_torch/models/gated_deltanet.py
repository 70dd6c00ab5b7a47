"""Gated DeltaNet linear attention (the recurrent layers of Qwen3.5 / Qwen3.6 / Qwen3-Next)
and its exact rollback for speculative decoding.

Math: the gated delta rule of Yang, Kautz and Hatamizadeh, "Gated Delta Networks:
Improving Mamba2 with Delta Rule" (ICLR 2025), in the chunked (WY / UT transform) form
of Yang et al., "Parallelizing Linear Transformers with the Delta Rule over Sequence
Length" (NeurIPS 2024); layer layout as in transformers' ``Qwen3_5GatedDeltaNet``.

Per value head, with a state ``S`` of shape ``[d_k, d_v]`` (float32) and for each token
``t`` (``q_t``, ``k_t`` L2-normalised, ``q_t`` scaled by ``d_k ** -0.5``)::

    S'_t = exp(g_t) * S_{t-1}                            (gated decay, g_t <= 0)
    u_t  = beta_t * (v_t - S'_t^T k_t)                   (delta-rule correction)
    S_t  = S'_t + k_t u_t^T,     o_t = S_t^T q_t

For a chunk of T tokens with G = cumsum(g), the corrections solve one unit lower
triangular system, ``(I + L) u = beta*v - (beta*k*exp(G)) S_0`` with
``L[t, j] = beta_t (k_t . k_j) exp(G_t - G_j)`` for ``j < t``, and the state after the
first ``n`` tokens is, in closed form::

    S_n = exp(G_{n-1}) S_0 + sum_{j < n} exp(G_{n-1} - G_j) k_j u_j^T

Since ``u_j`` depends only on tokens ``<= j``, a verify of B tokens can keep ``S_0``,
``k``, ``u`` and ``G`` and later move the state to "after the accepted prefix" exactly:
that is the rollback (:meth:`GatedDeltaNet.commit`). The short causal convolution's
state (the last ``kernel - 1`` projected inputs) rolls back by taking the window that
ends at the last accepted token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import RecurrentState
from .layers import fused_linear

CHUNK = 64  # tokens per chunk of the chunked form (the exponent differences stay well conditioned)


class GatedRMSNorm(nn.Module):
    """RMSNorm of the linear-attention output, then gated by ``silu(z)``:
    ``(weight * norm(x)) * silu(z)`` with the norm and the gate in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * x32.to(dtype)) * F.silu(z.float())).to(dtype)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def delta_rule_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of the gated delta rule (all float32), for any leading dims ``...``
    (the sequences of a batch: ``[N]``).

    Args:
        q, k: ``[..., H, T, d_k]`` (L2-normalised; q also scaled by ``d_k ** -0.5``).
        v: ``[..., H, T, d_v]``.
        g: ``[..., H, T]`` log decays (<= 0); beta: ``[..., H, T]`` in [0, 1].
        state: ``[..., H, d_k, d_v]``, the state before the chunk.

    Returns:
        outputs ``[..., H, T, d_v]``, the corrections ``u`` ``[..., H, T, d_v]`` and
        ``G = cumsum(g)`` ``[..., H, T]`` (what :func:`state_after` needs).
    """
    T = q.shape[-2]
    G = g.cumsum(-1)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [..., H, T, T], exp(G_t - G_j), j <= t
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its strictly lower part is L (the solve assumes a unit diagonal)
    rhs = torch.cat([v * beta[..., None], k_beta * G.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u = solved[..., : v.shape[-1]] - solved[..., v.shape[-1]:] @ state
    out = (q * G.exp()[..., None]) @ state + ((q @ k.transpose(-1, -2)) * decay) @ u
    return out, u, G


def state_after(state: torch.Tensor, k: torch.Tensor, u: torch.Tensor, G: torch.Tensor, n) -> torch.Tensor:
    """The state after the first ``n`` tokens of a chunk (closed form, see the module doc),
    per sequence.

    Args:
        state: ``[N, H, d_k, d_v]`` before the chunk; k ``[N, H, T, d_k]``, u ``[N, H, T, d_v]``,
            G ``[N, H, T]`` from :func:`delta_rule_chunk` (one log decay per head and token), or
            ``[N, H, T, d_k]`` (one per key channel: Kimi Delta Attention, :mod:`.kda`, where
            ``S_n = diag(exp(G_{n-1})) S_0 + sum_{j < n} (exp(G_{n-1} - G_j) * k_j) u_j^T``).
        n: tokens to keep: an int or a 0-dim int64 tensor in ``[1, T]`` for every sequence,
            or an int64 tensor ``[N]`` in ``[0, T]`` per sequence (0: the state before the chunk).

    Returns:
        ``[N, H, d_k, d_v]`` float32.
    """
    T = k.shape[-2]
    G = G if G.dim() == k.dim() else G[..., None]  # [N, H, T, c]: c = d_k (per channel) or 1 (per head)
    if isinstance(n, int) and n == T:
        g_end = G[..., -1:, :]  # [N, H, 1, c]
        weights = (g_end - G).exp()
    elif not torch.is_tensor(n) or n.dim() == 0:  # one count for every sequence (the single-sequence commit)
        last = (n - 1).view(1) if torch.is_tensor(n) else torch.tensor([n - 1], device=G.device)
        g_end = G.index_select(-2, last)
        keep = (torch.arange(T, device=G.device) < n)[:, None]  # [T, 1]
        weights = (g_end - G).masked_fill(~keep, float("-inf")).exp()
    else:  # a count per sequence, [N] -> [N, 1, 1, 1]
        n = n.view(-1, 1, 1, 1)
        g_end = G.gather(-2, (n - 1).clamp(min=0).expand(*G.shape[:-2], 1, G.shape[-1])).masked_fill(n < 1, 0.0)
        keep = torch.arange(T, device=G.device)[:, None] < n  # [N, 1, T, 1]
        weights = (g_end - G).masked_fill(~keep, float("-inf")).exp()
    return state * g_end.exp().transpose(-1, -2) + (k * weights).transpose(-1, -2) @ u


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet token mixer over N sequences at once (N = 1 for one sequence).

    Hugging Face parameter names (Qwen3.5 layout): ``in_proj_qkv``, ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a`` (joined into ``in_proj`` by :meth:`fuse`), ``conv1d`` (depthwise, no bias), ``dt_bias``, ``A_log``,
    ``norm`` (:class:`GatedRMSNorm`), ``out_proj``. Qwen3-Next's fused ``in_proj_qkvz`` /
    ``in_proj_ba`` are rearranged into this layout when loaded.

    Args:
        hidden: model width H.
        num_key_heads, num_value_heads: heads of q/k and of v (a multiple of the former;
            each q/k head serves ``num_value_heads // num_key_heads`` consecutive v heads).
        key_head_dim, value_head_dim: ``d_k``, ``d_v``.
        conv_kernel: taps of the causal depthwise convolution of q/k/v.
        eps: epsilon of the output norm.
    """

    def __init__(self, hidden: int, num_key_heads: int, num_value_heads: int, key_head_dim: int,
                 value_head_dim: int, conv_kernel: int, eps: float):
        super().__init__()
        self.nk, self.nv, self.dk, self.dv = num_key_heads, num_value_heads, key_head_dim, value_head_dim
        self.kernel = conv_kernel
        key_dim, value_dim = num_key_heads * key_head_dim, num_value_heads * value_head_dim
        self.conv_dim = 2 * key_dim + value_dim
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(num_value_heads))
        self.norm = GatedRMSNorm(value_head_dim, eps)
        self.out_proj = nn.Linear(value_dim, hidden, bias=False)
        self.in_proj = None  # set by fuse()

    def fuse(self) -> None:
        """Join the four input projections (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
        ``in_proj_a``: all read the same rows) into one linear ``in_proj`` (in place, for
        inference: the same outputs from one matmul; the state dict's names change; see
        :mod:`dflash_torch.models.fusing`)."""
        if self.in_proj is None:
            self.in_proj = fused_linear([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])
            del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a

    def _inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[R, H]`` -> the projections ``qkv`` ``[R, conv_dim]``, ``z`` ``[R, nv * dv]``,
        ``b`` and ``a`` ``[R, nv]``."""
        if self.in_proj is None:
            return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        return self.in_proj(x).split([self.conv_dim, self.nv * self.dv, self.nv, self.nv], dim=-1)

    def new_state(self, state: RecurrentState) -> int:
        """Register this layer's state in ``state``; returns its slot."""
        return state.add_layer(self.kernel - 1, self.conv_dim, self.nv, self.dk, self.dv)

    def forward(self, x: torch.Tensor, state: RecurrentState, slot: int, commit=None, defer: bool = False) -> torch.Tensor:
        """Mix ``x`` ``[N * T, H]`` (already normed; the rows of N = ``state.sequences``
        sequences, T each, in order) -> ``[N * T, H]``, sequence ``i`` reading (and writing)
        row ``i`` of ``state``'s layer ``slot``.

        Args:
            commit: None to advance the states over all T rows; ``n`` (int, 0-dim or
                ``[N]`` int64 tensor) to advance them over the first n rows only (padded chunks).
            defer: leave the states as they are and record what :meth:`commit` needs to
                advance them later over each sequence's accepted prefix (a verify; T <= 64).
        """
        N = state.sequences
        T = x.shape[0] // N
        dtype = x.dtype
        qkv, z, b, a = self._inputs(x)
        conv_in = torch.cat([state.conv[slot], qkv.reshape(N, T, -1)], dim=1)  # [N, K-1+T, C]: the inputs before the block, then the block's
        mixed = F.conv1d(conv_in.transpose(1, 2), self.conv1d.weight, groups=self.conv_dim)  # [N, C, T]
        mixed = F.silu(mixed).transpose(1, 2)  # [N, T, C]
        key_dim = self.nk * self.dk
        q = mixed[..., :key_dim].reshape(N, T, self.nk, self.dk)
        k = mixed[..., key_dim: 2 * key_dim].reshape(N, T, self.nk, self.dk)
        v = mixed[..., 2 * key_dim:].reshape(N, T, self.nv, self.dv)
        beta = torch.sigmoid(b).float().reshape(N, T, -1).transpose(1, 2)  # [N, nv, T]
        g = (-self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)).reshape(N, T, -1).transpose(1, 2)
        groups = self.nv // self.nk
        q = _l2norm(q.float()).transpose(1, 2) * self.dk ** -0.5  # [N, nk, T, dk]
        k = _l2norm(k.float()).transpose(1, 2)
        if groups > 1:
            q, k = q.repeat_interleave(groups, 1), k.repeat_interleave(groups, 1)
        v = v.float().transpose(1, 2)  # [N, nv, T, dv]
        out = run_chunks(delta_rule_chunk, q, k, v, g, beta, state, slot, conv_in, self.kernel - 1, commit, defer)
        out = self.norm(out.transpose(1, 2).to(dtype), z.reshape(N, T, self.nv, self.dv))
        return self.out_proj(out.reshape(N * T, self.nv * self.dv))

    def commit(self, state: RecurrentState, slot: int, n) -> None:
        """Advance the states of layer ``slot`` over the first ``n`` rows of the last deferred
        block: the rollback of a verify.

        Args:
            n: rows to keep: an int or a 0-dim int64 tensor in ``[1, T]`` for every
                sequence, or ``[N]`` int64 in ``[0, T]`` per sequence (0: that state stays).
        """
        commit_stashed(state, slot, n, self.kernel - 1)


def run_chunks(chunk_fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: RecurrentState, slot: int, conv_in: torch.Tensor, width: int, commit=None,
               defer: bool = False) -> torch.Tensor:
    """The delta rule over T rows of N sequences, ``CHUNK`` rows at a time, for Gated DeltaNet
    and Kimi Delta Attention (``chunk_fn``: :func:`delta_rule_chunk` or KDA's, same signature):
    q, k ``[N, H, T, dk]``, v ``[N, H, T, dv]`` (float32), the log decays ``g`` ``[N, H, T]``
    (per head) or ``[N, H, T, dk]`` (per key channel), ``beta`` ``[N, H, T]``. Returns the
    outputs ``[N, H, T, dv]`` (float32) and advances layer ``slot`` of ``state`` (its conv
    state from ``conv_in``, whose last ``width`` rows it keeps) over all rows, or the first
    ``commit`` (an int, 0-dim or ``[N]`` int64 tensor); with ``defer`` it leaves the states
    as they are and stashes what :func:`commit_stashed` needs (a verify).

    Raises:
        ValueError: a deferred block of more than ``CHUNK`` rows.
    """
    T = q.shape[2]
    s0 = state.ssm[slot]
    if defer:
        if T > CHUNK:
            raise ValueError(f"a deferred (verify) block holds at most {CHUNK} tokens, got {T}")
        out, u, G = chunk_fn(q, k, v, g, beta, s0)
        state.stash(slot, conv_in, k, u, G)
        return out
    if commit is not None:  # rows past the committed ones leave the state unchanged (g = 0, beta = 0)
        keep = torch.arange(T, device=q.device) < (commit if isinstance(commit, int) else commit.view(-1, 1, 1))
        g, beta = g * (keep[..., None] if g.dim() == 4 else keep), beta * keep
    outs = []
    for c0 in range(0, T, CHUNK):
        c = slice(c0, min(c0 + CHUNK, T))
        out_c, u, G = chunk_fn(q[:, :, c], k[:, :, c], v[:, :, c], g[:, :, c], beta[:, :, c], s0)
        s0 = state_after(s0, k[:, :, c], u, G, c.stop - c.start)
        outs.append(out_c)
    state.ssm[slot].copy_(s0)
    state.conv[slot].copy_(_window(conv_in, T if commit is None else commit, width))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


def commit_stashed(state: RecurrentState, slot: int, n, width: int) -> None:
    """Advance layer ``slot``'s states over the first ``n`` rows (as in :meth:`GatedDeltaNet.commit`)
    of the block it stashed as ``(conv_in, k, u, G)``: the SSM state by :func:`state_after`, the
    convolution's ``width`` inputs by :func:`_window` (Gated DeltaNet's and Mamba-2's rollback)."""
    conv_in, k, u, G = state.stashed(slot)
    state.ssm[slot].copy_(state_after(state.ssm[slot], k, u, G, n))
    state.conv[slot].copy_(_window(conv_in, n, width))


def _window(conv_in: torch.Tensor, n, width: int) -> torch.Tensor:
    """The ``width`` convolution inputs ending at block row ``n - 1`` of each sequence: rows
    ``[n, n + width)`` of ``conv_in`` ``[N, width + T, C]`` (which starts with the ``width``
    inputs before the block) -> ``[N, width, C]``. ``n``: an int or 0-dim int64 tensor for
    every sequence, or ``[N]`` int64 per sequence."""
    if isinstance(n, int):
        return conv_in[:, n: n + width]
    if n.dim() == 0:
        return conv_in.index_select(1, n + torch.arange(width, device=conv_in.device))
    index = n[:, None] + torch.arange(width, device=conv_in.device)  # [N, width]
    return conv_in.gather(1, index[..., None].expand(-1, width, conv_in.shape[2]))
