"""The Mamba-2 token mixer (the recurrent layers of Nemotron-H) and its exact rollback for
speculative decoding.

Math: the state space duality (SSD) layer of Dao and Gu, "Transformers are SSMs:
Generalized Models and Efficient Algorithms Through Structured State Space Duality" (ICML
2024, "Mamba-2"); layer layout as in transformers' ``NemotronHMamba2Mixer`` (its torch path).

One input projection gives the gate ``z`` (``heads * head_dim``), the convolution's input
``xBC`` and ``dt`` (one per head). ``xBC`` goes through a causal depthwise convolution
(``conv_kernel`` taps, with bias) and SiLU, then splits into ``x`` (``[heads, head_dim]``),
``B`` and ``C`` (``[groups, state_size]``, each group shared by ``heads / groups``
consecutive heads). Per head, with a scalar ``A = -exp(A_log)`` and
``dt_t = softplus(dt_t + dt_bias)``, the state ``S`` (``[state_size,
head_dim]``, float32; transformers holds its transpose) and the output::

    S_t = exp(dt_t A) S_{t-1} + B_t (dt_t x_t)^T,     y_t = S_t^T C_t + D x_t

For a chunk of T tokens with ``G = cumsum(dt A)`` (``G_t <= G_j`` for ``j <= t``)::

    y_t = exp(G_t) S_0^T C_t + sum_{j <= t} exp(G_t - G_j) (C_t . B_j) dt_j x_j + D x_t
    S_n = exp(G_{n-1}) S_0 + sum_{j < n} exp(G_{n-1} - G_j) B_j (dt_j x_j)^T

so the state after the first ``n`` tokens of a verify block has a closed form from the
state before it and the block's ``B``, ``dt x`` and ``G``: the same form as Gated DeltaNet's
(:func:`~dflash_torch.models.gated_deltanet.state_after`, with keys ``B`` and corrections
``dt x``), which the rollback (:meth:`Mamba2Mixer.commit`) reuses, as it reuses the
convolution state's window. The output ``y`` is multiplied by ``silu(z)``, normalised per
group of ``heads * head_dim / groups`` channels (RMS, float32) and scaled by ``norm.weight``
before ``out_proj``.

``dt`` is not clamped: the time-step limit is ``[0, inf)`` (``time_step_limit``, the only one
:mod:`.nemotron_h` accepts), as NVIDIA's reference code (mamba_ssm's ``dt_limit``), vLLM and
transformers' one-token path compute it. transformers' chunked (prompt) path alone raises
``dt`` to ``time_step_min`` (an initialisation bound of ``dt_bias``; its
``time_step_limit = (time_step_min, inf)``), so it disagrees with its own token-by-token
decoding wherever ``softplus(dt + dt_bias) < time_step_min``; dflash-torch decodes one way
throughout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import RecurrentState
from .gated_deltanet import CHUNK, _window, commit_stashed, state_after


class GroupedGatedRMSNorm(nn.Module):
    """Nemotron-H's gated norm of the SSM output: ``weight * rmsnorm_g(y * silu(z))``, the
    gate applied *before* the norm and the RMS taken per group of ``group_size`` channels,
    all in float32 (transformers' ``NemotronHRMSNormGated`` on its float32 chunked output).
    The result is float32 (the caller casts it to the model dtype)."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``y`` ``[..., dim]`` (float32), ``z`` ``[..., dim]`` -> ``[..., dim]`` float32."""
        h = y.float() * F.silu(z.float())
        g = h.unflatten(-1, (-1, self.group_size))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.float() * g.flatten(-2)


def ssd_chunk(x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, a: torch.Tensor, state: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of the SSD recurrence (float32) for any leading dims ``...`` (the sequences).

    Args:
        x: ``[..., H, T, head_dim]``, the inputs already times ``dt`` (``dt_t x_t``).
        B, C: ``[..., H, T, state_size]`` (per head: a group's rows repeated).
        a: ``[..., H, T]``, ``dt_t * A`` (<= 0).
        state: ``[..., H, state_size, head_dim]`` before the chunk.

    Returns:
        ``y - D x`` ``[..., H, T, head_dim]`` and ``G = cumsum(a)`` ``[..., H, T]`` (what
        :func:`~dflash_torch.models.gated_deltanet.state_after` needs, with ``k = B``, ``u = x``).
    """
    T = x.shape[-2]
    G = a.cumsum(-1)
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # exp(G_t - G_j), j <= t
    out = (C * G.exp()[..., None]) @ state + ((C @ B.transpose(-1, -2)) * decay) @ x
    return out, G


class Mamba2Mixer(nn.Module):
    """A Mamba-2 token mixer over N sequences at once (N = 1 for one sequence), on the
    shared :class:`~dflash_torch.cache.RecurrentState` (conv ``[N, kernel - 1, conv_dim]`` in
    the model dtype, ssm ``[N, heads, state_size, head_dim]`` float32).

    Hugging Face parameter names: ``in_proj``, ``conv1d`` (depthwise, bias with
    ``conv_bias``), ``dt_bias``, ``A_log``, ``D`` (``[heads]``), ``norm``
    (:class:`GroupedGatedRMSNorm`), ``out_proj``.

    Attributes ``kernel``, ``conv_dim``, ``nv`` (heads), ``dk`` (state size), ``dv`` (head
    size) give the state's shape (:func:`~dflash_torch.cache.recurrent_bytes`).

    Args:
        hidden: model width.
        heads, head_dim: ``mamba_num_heads``, ``mamba_head_dim``.
        groups: ``n_groups`` (divides ``heads``).
        state_size: ``ssm_state_size``.
        conv_kernel: taps of the convolution.
        eps: the gated norm's epsilon.
        proj_bias: biases on ``in_proj`` and ``out_proj`` (``use_bias``).
        conv_bias: a bias on the convolution (``use_conv_bias``).
    """

    def __init__(self, hidden: int, heads: int, head_dim: int, groups: int, state_size: int, conv_kernel: int,
                 eps: float, proj_bias: bool = False, conv_bias: bool = True):
        super().__init__()
        self.heads, self.head_dim, self.groups, self.state_size = heads, head_dim, groups, state_size
        self.kernel = conv_kernel
        self.inner = heads * head_dim
        self.conv_dim = self.inner + 2 * groups * state_size
        self.nv, self.dk, self.dv = heads, state_size, head_dim
        self.in_proj = nn.Linear(hidden, self.inner + self.conv_dim + heads, bias=proj_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.D = nn.Parameter(torch.ones(heads))
        self.norm = GroupedGatedRMSNorm(self.inner, self.inner // groups, eps)
        self.out_proj = nn.Linear(self.inner, hidden, bias=proj_bias)

    def new_state(self, state: RecurrentState) -> int:
        """Register this layer's state in ``state``; returns its slot."""
        return state.add_layer(self.kernel - 1, self.conv_dim, self.heads, self.state_size, self.head_dim)

    def forward(self, h: torch.Tensor, state: RecurrentState, slot: int, commit=None, defer: bool = False) -> torch.Tensor:
        """Mix ``h`` ``[N * T, hidden]`` (already normed; the rows of N = ``state.sequences``
        sequences, T each, in order) -> ``[N * T, hidden]`` in ``h.dtype``, sequence ``i``
        reading (and writing) row ``i`` of ``state``'s layer ``slot``.

        Args:
            commit: None to advance the states over all T rows; ``n`` (int, 0-dim or ``[N]``
                int64 tensor) to advance them over the first n rows only (padded chunks).
            defer: leave the states as they are and record what :meth:`commit` needs to
                advance them later over each sequence's accepted prefix (a verify; T <= 64).

        Raises:
            ValueError: a deferred block of more than 64 rows.
        """
        N = state.sequences
        T = h.shape[0] // N
        dtype = h.dtype
        z, xbc, dt = self.in_proj(h).split([self.inner, self.conv_dim, self.heads], dim=-1)
        conv_in = torch.cat([state.conv[slot], xbc.reshape(N, T, -1)], dim=1)  # [N, K-1+T, C]
        mixed = F.conv1d(conv_in.transpose(1, 2), self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim)
        mixed = F.silu(mixed).transpose(1, 2)  # [N, T, C]
        x, B, C = mixed.split([self.inner, self.groups * self.state_size, self.groups * self.state_size], dim=-1)
        x = x.float().reshape(N, T, self.heads, self.head_dim).transpose(1, 2)  # [N, H, T, P]
        per_group = self.heads // self.groups

        def by_head(t):  # [N, T, groups * S] -> [N, H, T, S]
            return t.float().reshape(N, T, self.groups, self.state_size).transpose(1, 2).repeat_interleave(per_group, 1)

        B, C = by_head(B), by_head(C)
        dt = F.softplus(dt.float() + self.dt_bias.float())  # [N * T, H] (no clamp: the module docstring)
        dt = dt.reshape(N, T, self.heads).transpose(1, 2)  # [N, H, T]
        a = dt * -self.A_log.float().exp()[:, None]
        u = x * dt[..., None]
        s0 = state.ssm[slot]
        if defer:
            if T > CHUNK:
                raise ValueError(f"a deferred (verify) block holds at most {CHUNK} tokens, got {T}")
            y, G = ssd_chunk(u, B, C, a, s0)
            state.stash(slot, conv_in, B, u, G)
        else:
            if commit is not None:  # rows past the committed ones leave the state unchanged (a = 0, u = 0)
                keep = torch.arange(T, device=h.device) < (commit if isinstance(commit, int) else commit.view(-1, 1, 1))
                a, u_state = a * keep, u * keep[..., None]
            else:
                u_state = u
            outs = []
            for c0 in range(0, T, CHUNK):
                c1 = min(c0 + CHUNK, T)
                part = slice(c0, c1)
                # (the output of a row past the committed ones is not used: computed from the masked inputs)
                y_c, G = ssd_chunk(u_state[..., part, :], B[..., part, :], C[..., part, :], a[..., part], s0)
                s0 = state_after(s0, B[..., part, :], u_state[..., part, :], G, c1 - c0)
                outs.append(y_c)
            y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
            state.ssm[slot].copy_(s0)
            state.conv[slot].copy_(_window(conv_in, T if commit is None else commit, self.kernel - 1))
        y = y + x * self.D.float()[:, None, None]
        y = y.transpose(1, 2).reshape(N * T, self.inner)
        return self.out_proj(self.norm(y, z).to(dtype))

    def commit(self, state: RecurrentState, slot: int, n) -> None:
        """Advance the states of layer ``slot`` over the first ``n`` rows of the last deferred
        block: the rollback of a verify.

        Args:
            n: rows to keep: an int or a 0-dim int64 tensor in ``[1, T]`` for every
                sequence, or ``[N]`` int64 in ``[0, T]`` per sequence (0: that state stays).
        """
        commit_stashed(state, slot, n, self.kernel - 1)  # (the stash: conv inputs, B as keys, dt x, G)
