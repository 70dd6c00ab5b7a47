"""DFlash 2 drafters: the DFlash backbone plus two modules that act on the block rows
only (the context path and KV injection are the DFlash drafter's, unchanged).

* :class:`GroupedDynamicConv`, one around each attention sublayer (``attention_conv``)
  and one around each MLP (``mlp_conv``): a depthwise convolution over the rows of the
  block, causal inside the block and zero across its start, whose per-channel tap
  weights ``base_kernel`` get a per-row, per-group dynamic offset from
  ``kernel_projection``.
* :class:`CandidateSelector` (``candidate_selector``): keeps the top-K tokens of every
  draft slot and walks a path from the anchor token, scoring each step with the slot's
  logit plus a low-rank pairwise term between the previous token and the candidate.

Checkpoint format (``config.json``: ``architectures: ["DFlash2DraftModel"]``, the
settings in :class:`~dflash_torch.models.drafter_config.DFlash2Settings`) and parameter names:
``layers.N.attention_conv.base_kernel`` ``[2, taps, hidden]``,
``layers.N.attention_conv.kernel_projection.weight`` ``[2 * taps * groups, hidden]``,
the same under ``layers.N.mlp_conv``, ``candidate_selector.predecessor_codebook`` and
``candidate_selector.successor_codebook`` ``[vocab, rank]``,
``candidate_selector.hidden_projection.weight`` ``[rank, hidden]``.

Where the DFlash 2 description leaves details open, the choices below follow the public
DFlash 2 ports (read for facts only: a PyTorch port in Qualcomm's efficient-transformers
that mirrors the upstream ``select``, an MLX Swift port, an ONNX export frontend):

* tap ``t`` multiplies row ``i - t`` (tap 0 is the row itself); taps that reach before
  the block's first row read zeros; ``kernel_projection``'s output is laid out
  ``[side (prepare, finish), tap, group]`` and both sides are computed from the
  sublayer's *normed input*, the finish side then applied to the sublayer's output
  (after ``o_proj`` for attention);
* the selector reads the final-normed hidden rows of the B-1 draft slots (not the
  anchor's row); the unary scores are the target LM head's logits in float32, times
  ``output_multiplier``, then soft-capped, and the top-K is taken of those;
* the candidates of a slot are ranked by unary score, ties in score to the lower token
  id (the order of an argmax); at a tie in edge score the walk takes the lower rank
  (the first maximum, as ``argmax`` does). With zero codebooks the walk therefore
  proposes exactly the argmax of every slot, as a DFlash drafter would;
* block attention stays non-causal in every layer, sliding-window ones included
  (``is_causal: false``; a config asking for causal block attention, ``is_causal`` or
  ``dflash_config.causal`` true, is refused).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..sampling import SamplingParams, probabilities, sample
from ..structured import GrammarState
from .drafter_config import DrafterConfig
from .drafter import DFlashDrafter, DraftLayer


class GroupedDynamicConv(nn.Module):
    """Grouped dynamic depthwise convolution over the rows of each block.

    For rows ``x`` ``[T, hidden]`` (whole blocks of ``block_len`` rows) and the dynamic
    taps ``delta = kernel_projection(x)`` viewed ``[T, 2, taps, groups]``, side ``s``
    (0: :meth:`prepare`, 1: :meth:`finish`) computes

        ``y[i, c] = sum_t (base_kernel[s, t, c] + delta[i, s, t, c // group_size]) * x[i - t, c]``

    where ``x[i - t]`` is zero when row ``i - t`` lies before the start of row ``i``'s block.
    A ``base_kernel`` of ``[1, 0, ...]`` per side and a zero ``kernel_projection`` make
    it the identity.

    Args:
        hidden: channels (``hidden_size``).
        taps: kernel size.
        group_size: channels per group (one dynamic offset per group and tap);
            divides ``hidden``.
    """

    def __init__(self, hidden: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.group_size, self.groups = taps, group_size, hidden // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)
        self.reset_to_identity()

    def prepare(self, x: torch.Tensor, block_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolution of the sublayer's input ``x`` ``[T, hidden]`` (side 0) and the
        dynamic taps of side 1 ``[T, taps, groups]``, for :meth:`finish`."""
        delta = self.kernel_projection(x).view(x.shape[0], 2, self.taps, self.groups)
        return self.convolve(x, 0, delta[:, 0], block_len), delta[:, 1]

    def finish(self, y: torch.Tensor, delta: torch.Tensor, block_len: int) -> torch.Tensor:
        """The convolution of the sublayer's output ``y`` ``[T, hidden]`` (side 1) with the
        dynamic taps ``delta`` from :meth:`prepare`."""
        return self.convolve(y, 1, delta, block_len)

    def convolve(self, x: torch.Tensor, side: int, delta: torch.Tensor, block_len: int) -> torch.Tensor:
        """Side ``side`` of the convolution of ``x`` ``[T, hidden]`` with dynamic taps
        ``delta`` ``[T, taps, groups]``; ``T`` is a multiple of ``block_len``."""
        T, hidden = x.shape
        n, L, G = T // block_len, block_len, self.groups
        rows = x.view(n, L, G, self.group_size)
        dyn = delta.reshape(n, L, self.taps, G, 1)
        out = None
        for t in range(min(self.taps, L)):  # a tap reaching past the whole block reads only zeros
            shifted = rows if t == 0 else F.pad(rows[:, :L - t], (0, 0, 0, 0, t, 0))
            term = (self.base_kernel[side, t].view(G, self.group_size) + dyn[:, :, t]) * shifted
            out = term if out is None else out + term
        return out.reshape(T, hidden)

    @torch.no_grad()
    def reset_to_identity(self) -> None:
        """``base_kernel`` = the identity tap on both sides, ``kernel_projection`` = 0."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()


class DFlash2Layer(DraftLayer):
    """A DFlash drafter layer with the grouped dynamic convolutions: norm -> prepare ->
    attention (``o_proj`` included) -> finish -> residual add, and norm -> prepare ->
    MLP -> finish -> residual add."""

    def __init__(self, cfg: DrafterConfig, sliding_window: int | None):
        super().__init__(cfg, sliding_window)
        s = cfg.dflash2
        self.attention_conv = GroupedDynamicConv(cfg.hidden_size, s.conv_kernel_size, s.conv_group_size)
        self.mlp_conv = GroupedDynamicConv(cfg.hidden_size, s.conv_kernel_size, s.conv_group_size)

    def attention_input(self, x, block_len):
        return self.attention_conv.prepare(self.input_layernorm(x), block_len)

    def attention_output(self, attended, state, block_len):
        return self.attention_conv.finish(self.self_attn.o_proj(attended), state, block_len)

    def mlp_output(self, x, block_len):
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x), block_len)
        return self.mlp_conv.finish(self.mlp(h), delta, block_len)


class CandidateSelector(nn.Module):
    """Top-K candidates per draft slot and pairwise edge scores between consecutive slots.

    The edge score from predecessor token ``p`` to candidate ``c`` of slot ``l`` is
    ``unary[l, c] + sum_r P[p, r] * h[l, r] * S[c, r]`` with ``P``/``S`` the
    predecessor/successor codebooks ``[vocab, rank]`` and ``h = hidden_projection`` of
    the slot's final hidden row. Scores are computed in float32.
    """

    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def candidates(self, unary: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-K of ``unary`` ``[..., V]`` -> ``(values, ids)`` ``[..., K]``, ranked by
        value, equal values by lower token id (among the K that ``topk`` keeps)."""
        values, ids = unary.topk(self.top_k, dim=-1)
        ids, order = ids.sort(dim=-1)
        values, order = values.gather(-1, order).sort(dim=-1, descending=True, stable=True)
        return values, ids.gather(-1, order)

    def pair_term(self, hidden: torch.Tensor, predecessors: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``sum_r P[p, r] * h[r] * S[c, r]`` for each predecessor and candidate.

        Args:
            hidden: final hidden rows ``[..., hidden]``.
            predecessors: int64 ``[..., M]`` predecessor tokens per row.
            ids: int64 ``[..., K]`` candidate tokens per row.

        Returns:
            float32 ``[..., M, K]``.
        """
        h = self.hidden_projection(hidden).float()
        # row gathers with F.embedding: the same rows as codebook[index], ~5x faster on CPU
        pred = F.embedding(predecessors, self.predecessor_codebook).float() * h.unsqueeze(-2)
        return pred @ F.embedding(ids, self.successor_codebook).float().transpose(-1, -2)

    def lattice(self, hidden: torch.Tensor, unary: torch.Tensor, anchor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Candidates and all edge scores of a block's draft slots.

        Args:
            hidden: final hidden rows of the draft slots ``[..., S, hidden]``.
            unary: their unary scores ``[..., S, V]`` (float32).
            anchor: int64 ``[...]``, the block's first token (the predecessor of slot 0).

        Returns:
            ``(ids, scores)``: candidate tokens int64 ``[..., S, K]`` and float32
            ``[..., S, K, K]`` where ``scores[l, i, j]`` is the edge score from
            candidate ``i`` of slot ``l - 1`` to candidate ``j`` of slot ``l`` (for slot 0
            every row ``i`` holds the scores from the anchor).
        """
        values, ids = self.candidates(unary)
        K = ids.shape[-1]
        first = anchor[..., None, None].expand(*ids.shape[:-2], 1, K)  # slot 0: the anchor, K times
        predecessors = torch.cat([first, ids[..., :-1, :]], dim=-2)
        return ids, values.unsqueeze(-2) + self.pair_term(hidden, predecessors, ids)


def walk(choice: torch.Tensor) -> torch.Tensor:
    """The path through a lattice, given the choice at every node.

    Args:
        choice: int64 ``[..., S, K]``: ``choice[l, i]`` is the candidate rank taken at slot
            ``l`` when slot ``l - 1`` took rank ``i`` (slot 0: row 0 is used).

    Returns:
        int64 ``[..., S]``: the rank taken at every slot.
    """
    rank = choice[..., 0, 0]
    path = [rank]
    for l in range(1, choice.shape[-2]):
        rank = choice[..., l, :].gather(-1, rank.unsqueeze(-1)).squeeze(-1)
        path.append(rank)
    return torch.stack(path, dim=-1)


class DFlash2Drafter(DFlashDrafter):
    """DFlash 2 draft model: the DFlash backbone (same attention, context projection and
    KV injection) with :class:`DFlash2Layer` layers, the block embeddings scaled by
    ``input_embedding_scale``, and a :class:`CandidateSelector` that chooses the draft.
    """

    layer_class = DFlash2Layer

    def __init__(self, cfg: DrafterConfig):
        if cfg.dflash2 is None:
            raise ValueError("DFlash2Drafter needs a DFlash 2 config (DrafterConfig.dflash2)")
        super().__init__(cfg)
        s = cfg.dflash2
        self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, s.selector_rank, s.selector_top_k)

    def draft_scores(self, hidden, anchor, target):
        """The lattice of :meth:`CandidateSelector.lattice` for the draft slots: candidate
        ids int64 ``[..., B-1, K]`` and edge scores float32 ``[..., B-1, K, K]``. With a
        ``selector_vocab_size``, the ids at or past it are never candidates."""
        slots = hidden[..., 1:, :]
        unary = self.draft_logits(target, slots)
        limit = self.config.dflash2.selector_vocab_size
        if limit is not None and limit < unary.shape[-1]:
            unary = torch.cat([unary[..., :limit], unary.new_full((*unary.shape[:-1], unary.shape[-1] - limit),
                                                                  float("-inf"))], dim=-1)
        return self.candidate_selector.lattice(slots, unary, anchor)

    def draft_logits(self, target, slots):
        """The unary scores (float32 ``[..., V]``) of final hidden rows ``slots``: the DFlash
        drafter's draft logits (:meth:`~dflash_torch.models.drafter.DFlashDrafter.draft_logits`:
        the target's LM head through :meth:`unary_scores`, or, a config that leaves
        ``output_multiplier`` at 1 and no soft cap, the target's own output scale,
        :meth:`TargetModel.output_logits`, as the DFlash reference does; with an LM head of its
        own, that head's logits through :meth:`unary_scores`) in float32."""
        return super().draft_logits(target, slots).float()

    def choose_draft(self, scores, params: SamplingParams, generator: torch.Generator | None,
                     guide: GrammarState | None = None):
        """The walk from the anchor through the lattice.

        Greedy: at every slot the candidate with the best edge score from the candidate
        chosen before it (ties to the lower rank). Sampling: the candidate is drawn from
        :func:`~dflash_torch.sampling.probabilities` of the edge scores from the chosen
        predecessor (temperature, then the request's top-k / top-p over the K candidates);
        one draw is made for every (slot, predecessor) row at once, independently, and
        the walk follows the draws of the rows it reaches, so each step is an exact
        sample of its row.

        With a ``guide`` (a structured-output constraint, one block only) the walk goes slot
        by slot, each step among the candidates the guide allows after the path so far;
        where it allows none of the K candidates, the step is taken unguided (the target
        then rejects it) and the rest of the walk is plain.

        Returns:
            ``(tokens, q)``: int64 ``[B-1]``, and when sampling the float32 ``[B-1, V]``
            distribution of each step (zero outside the slot's K candidates), the q of
            the lossless acceptance rule; None for greedy decoding (which, unguided, also
            takes leading block dimensions: ``[..., B-1]`` tokens).
        """
        ids, edges = scores
        if guide is not None:
            return self._guided_walk(ids, edges, params, generator, guide)
        if params.greedy:
            ranks = walk(edges.argmax(dim=-1))
            return ids.gather(-1, ranks.unsqueeze(-1)).squeeze(-1), None
        S, K = ids.shape
        probs = probabilities(edges.reshape(S * K, K), params).view(S, K, K)
        ranks = walk(sample(probs.view(S * K, K), generator).view(S, K))
        tokens = ids.gather(-1, ranks.unsqueeze(-1)).squeeze(-1)
        previous = torch.cat([ranks.new_zeros(1), ranks[:-1]])
        rows = probs[torch.arange(S, device=ids.device), previous]  # [S, K]
        q = rows.new_zeros(S, self.candidate_selector.predecessor_codebook.shape[0])
        return tokens, q.scatter_(1, ids, rows)

    def _guided_walk(self, ids: torch.Tensor, edges: torch.Tensor, params: SamplingParams,
                     generator: torch.Generator | None, guide: GrammarState):
        """:meth:`choose_draft` with a guide: one step per slot (``ids`` ``[S, K]``, ``edges`` ``[S, K, K]``)."""
        S, K = ids.shape
        V = self.candidate_selector.predecessor_codebook.shape[0]
        tokens, q = [], None if params.greedy else edges.new_zeros(S, V, dtype=torch.float32)
        previous = 0
        for slot in range(S):
            row = edges[slot, previous].float()[None]  # [1, K]: scores of the candidates after the path's last step
            if params.greedy:  # the best candidate, or the best allowed one
                rank = int(row.argmax())
                if guide.advance(int(ids[slot, rank])):
                    tokens.append(int(ids[slot, rank]))
                    previous = rank
                    continue
            allowed = guide.next_allowed()
            if allowed is not None:
                ok = allowed[ids[slot]]
                if bool(ok.any()):
                    row = row.masked_fill(~ok, float("-inf"))
            if params.greedy:
                rank = int(row.argmax())
            else:
                p = probabilities(row, params)
                rank = int(sample(p, generator))
                q[slot].scatter_(0, ids[slot], p[0])
            token = int(ids[slot, rank])
            tokens.append(token)
            guide.advance(token)
            previous = rank
        return torch.tensor(tokens, dtype=torch.long, device=ids.device), q
