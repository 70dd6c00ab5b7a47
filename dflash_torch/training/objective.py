"""The DFlash training objective (DFlash paper, arXiv 2602.06036, sec. 4.2).

Per sequence, ``n`` random **anchor** positions are drawn. Anchor ``a`` starts a block
``[token at a, mask x (B - 1)]`` at positions ``[a, a + B)``. Its context is the target
features of every position strictly before ``a`` (the tokens the target would have
committed when the drafter proposes at ``a``). All blocks of a sequence go through
*one* drafter forward under the **block attention mask**:

* keys ``[0, T)`` are the context rows, projected by ``drafter.context_kv`` exactly as
  at inference (RoPE at their absolute positions);
* keys ``[T, T + n * B)`` are the block rows (RoPE at ``a .. a + B - 1``);
* a row of block ``i`` sees the context keys at positions ``< a_i`` and all ``B`` keys of
  its own block (non-causal), nothing of another block; in a drafter layer with a sliding
  window only the keys within the window of the row's position, in a causal layer only its
  own block's keys up to itself (:func:`layer_masks`: the rules inference applies).

Slot ``k`` (``1 <= k < B``) of a block goes through the drafter's final norm and the
target's frozen LM head and predicts the token at ``a + k`` (no shift); its
cross-entropy is weighted by ``exp(-(k - 1) / gamma)`` (early slots matter most: a miss
there ends the accepted prefix).

A DFlash 2 drafter runs its convolutions inside the same forward (they act within each
block) and adds the **selector loss** (:func:`selector_loss`): for each slot whose true
token is among the slot's top-K candidates, the cross-entropy of the edge scores from the
true predecessor against the true token, with the same slot weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models.attention import Attention
from ..models.dflash2 import GroupedDynamicConv
from ..models.drafter import DFlashDrafter
from ..models.layers import RMSNorm, ZeroCenteredRMSNorm
from ..models.target import TargetModel
from ..sampling import SamplingParams

GREEDY = SamplingParams()


def default_gamma(block_size: int) -> float:
    """Loss decay: 7 for B = 16 (the paper's value), scaled linearly with B otherwise."""
    return 7.0 * block_size / 16.0


def sample_anchors(lengths: torch.Tensor, loss_mask: torch.Tensor, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``n`` distinct anchors per sequence.

    A position ``a`` may anchor a block when it has context (``a >= 1``) and its first
    label ``a + 1`` lies in the sequence and carries loss.

    Returns:
        anchors int64 ``[b, n]`` (sorted; unusable slots hold 0) and ``valid`` bool ``[b, n]``
        (False where a sequence has fewer than ``n`` possible anchors).
    """
    b, T = loss_mask.shape
    pos = torch.arange(T)
    nxt = torch.zeros_like(loss_mask)
    nxt[:, :-1] = loss_mask[:, 1:]
    ok = (pos[None, :] >= 1) & (pos[None, :] + 1 < lengths[:, None]) & nxt
    score = torch.rand(b, T, generator=gen).masked_fill(~ok, 2.0)
    n = min(n, T)
    picked = score.topk(n, dim=1, largest=False).indices
    valid = ok.gather(1, picked)
    anchors = torch.where(valid, picked, torch.zeros_like(picked))
    anchors, order = anchors.sort(dim=1)
    return anchors, valid.gather(1, order)


def context_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Bool ``[b, n * B, context_len]``: block row of anchor ``a`` sees context positions ``< a``."""
    row_anchor = anchors.repeat_interleave(block_size, dim=1)  # [b, nB]
    return torch.arange(context_len, device=anchors.device)[None, None, :] < row_anchor[:, :, None]


def block_attention_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """The dense mask, bool ``[b, n * B, context_len + n * B]`` (True = may attend): context
    keys first, then every block's keys; see the module docstring."""
    b, n = anchors.shape
    blk_id = torch.arange(n * block_size, device=anchors.device) // block_size
    own = (blk_id[:, None] == blk_id[None, :]).expand(b, n * block_size, n * block_size)
    return torch.cat([context_mask(anchors, context_len, block_size), own], dim=2)


def block_inputs(ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block token ids ``[b, n, B]`` (``[token at a, mask, ...]``) and positions ``[b, n, B]``."""
    positions = anchors[..., None] + torch.arange(block_size, device=anchors.device)
    tokens = torch.full_like(positions, mask_token_id)
    tokens[..., 0] = ids.gather(1, anchors)
    return tokens, positions


def layer_masks(ctx_mask: torch.Tensor, row_positions: torch.Tensor, window: int | None, causal: bool, B: int
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What one drafter layer's block rows see, as inference has it (the drafter's
    ``_visible``: a sliding window counted from each row's position, a causal block):

    * context keys: ``ctx_mask`` ``[b, n * B, T]``, and where the layer has a window, only
      positions ``> p - window`` for the row at position ``p`` (``row_positions``
      ``[b, n * B]``);
    * its own block's ``B`` keys: all of them (None), or the bool ``[B, B]`` rule of
      :func:`_block_rule` (row ``r`` sees key ``k``).
    """
    ctx = ctx_mask
    if window is not None:
        T = ctx_mask.shape[2]
        ctx = ctx & (torch.arange(T, device=ctx.device)[None, None, :] > row_positions[:, :, None] - window)
    rule = None if window is None and not causal else _block_rule(window, causal, B, ctx_mask.device)
    return ctx, rule


def _block_rule(window: int | None, causal: bool, B: int, device) -> torch.Tensor:
    """Bool ``[B, B]``: block row ``r`` sees block key ``k`` (``k <= r`` when ``causal``;
    ``k > r - window`` when the layer has a window)."""
    r = torch.arange(B, device=device)[:, None]
    k = torch.arange(B, device=device)[None, :]
    rule = torch.ones(B, B, dtype=torch.bool, device=device)
    if causal:
        rule = rule & (k <= r)
    if window is not None:
        rule = rule & (k > r - window)
    return rule


def _block_attention(q, kc, vc, kb, vb, ctx_mask: torch.Tensor, n: int, B: int,
                     blk_rule: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of block rows over context keys (under ``ctx_mask``) and their own block
    (every key, or those ``blk_rule`` ``[B, B]`` allows).

    The dense mask is block diagonal over the block keys, so each row's scores are
    ``[context (T) | own block (B)]``: a joint softmax over ``T + B`` keys instead of
    ``T + n * B``. ``q`` ``[b, h, nB, d]``; ``kc``/``vc`` ``[b, h, T, d]``;
    ``kb``/``vb`` ``[b, h, nB, d]``; returns ``[b, h, nB, d]``.
    """
    b, h, rows, d = q.shape
    T = kc.shape[2]
    scale = d ** -0.5
    s_ctx = torch.matmul(q, kc.transpose(-1, -2)).view(b, h, n, B, T)
    qb = q.view(b, h, n, B, d)
    s_blk = torch.matmul(qb, kb.view(b, h, n, B, d).transpose(-1, -2))  # [b, h, n, B, B]
    scores = torch.cat([s_ctx, s_blk], dim=-1).float() * scale
    own = ctx_mask.new_ones(b, 1, n, B, B) if blk_rule is None else blk_rule.expand(b, 1, n, B, B)
    keep = torch.cat([ctx_mask.view(b, 1, n, B, T), own], dim=-1)
    p = scores.masked_fill(~keep, float("-inf")).softmax(dim=-1).to(q.dtype)
    out = torch.matmul(p[..., :T].reshape(b, h, rows, T), vc)
    return out + torch.matmul(p[..., T:], vb.view(b, h, n, B, d)).view(b, h, rows, d)


def drafter_blocks_forward(drafter: DFlashDrafter, target: TargetModel, features: torch.Tensor,
                           block_tokens: torch.Tensor, block_positions: torch.Tensor,
                           mask: torch.Tensor | None = None) -> torch.Tensor:
    """All blocks of a batch of sequences in one drafter forward.

    Args:
        features: target features ``[b, T, k * H]`` of every position.
        block_tokens, block_positions: ``[b, n, B]`` from :func:`block_inputs`.
        mask: the dense ``[b, n * B, T + n * B]`` mask of :func:`block_attention_mask`
            (plain SDPA over all keys: the reference), or None for the equivalent
            block-structured attention that skips the other blocks' keys (training). Either
            way each layer's sliding window and causal block (:func:`layer_masks`) narrow it,
            as at inference.

    Returns:
        final-normed drafter hidden states ``[b, n, B, H]``.
    """
    b, T, _ = features.shape
    _, n, B = block_tokens.shape
    rows = n * B
    # context K/V of all positions, per layer, exactly as injected at inference: [b, kv_heads, T, head_dim]
    ctx_pos = torch.arange(T, device=features.device).repeat(b)
    ctx_kv = [
        (k.view(k.shape[0], b, T, -1).transpose(0, 1), v.view(v.shape[0], b, T, -1).transpose(0, 1))
        for k, v in drafter.context_kv(features.reshape(b * T, -1), ctx_pos)
    ]
    ctx_mask = context_mask(block_positions[:, :, 0], T, B) if mask is None else mask[..., :T]
    row_positions = block_positions.reshape(b, rows)
    kinds = {}  # (sliding window, causal) -> that layer kind's (context mask, block rule)
    for layer in drafter.layers:
        kind = (layer.sliding_window, layer.causal)
        if kind not in kinds:
            kinds[kind] = layer_masks(ctx_mask, row_positions, *kind, B)
    x = drafter.block_input(drafter.embed(target, block_tokens.reshape(-1)))  # [b * rows, H]
    cos, sin = drafter.rotary.cos_sin(block_positions.reshape(-1), x.dtype)
    for i, layer in enumerate(drafter.layers):
        attn = layer.self_attn
        h, state = layer.attention_input(x, B)
        q = attn.query(h, cos, sin)  # [heads, b * rows, hd]
        kb, vb = attn.key_value(h, cos, sin)  # [kv_heads, b * rows, hd]
        q = q.view(q.shape[0], b, rows, -1).transpose(0, 1)
        kb = kb.view(kb.shape[0], b, rows, -1).transpose(0, 1)
        vb = vb.view(vb.shape[0], b, rows, -1).transpose(0, 1)
        kc, vc = ctx_kv[i]
        groups = q.shape[1] // kb.shape[1]
        kc, vc, kb, vb = (t.to(q.dtype).repeat_interleave(groups, dim=1) if groups > 1 else t.to(q.dtype)
                          for t in (kc, vc, kb, vb))
        layer_ctx, rule = kinds[layer.sliding_window, layer.causal]
        if mask is None:
            out = _block_attention(q, kc, vc, kb, vb, layer_ctx, n, B, rule)
        else:
            blocks = mask[..., T:] if rule is None else mask[..., T:] & rule.repeat(n, n)
            k, v = torch.cat([kc, kb], dim=2), torch.cat([vc, vb], dim=2)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.cat([layer_ctx, blocks], dim=2)[:, None])
        out = out.transpose(1, 2).reshape(b * rows, -1)
        x = x + layer.attention_output(out, state, B)
        x = x + layer.mlp_output(x, B)
    return drafter.norm(x).view(b, n, B, -1)


@dataclass
class BlockLoss:
    """The weighted loss of a batch of blocks and its diagnostics.

    ``loss`` (with grad) is the weighted mean cross-entropy over valid slots (plus, for
    a DFlash 2 drafter, the weighted selector loss, whose value is ``selector_loss``: None
    where no slot's label is among its candidates, and ``selector_weight_sum`` its weight);
    ``accepted`` ``[blocks]`` counts the leading slots whose greedy draft (argmax, or the
    DFlash 2 walk) equals the label, for blocks whose ``B - 1`` labels are all valid;
    ``tau`` estimates the acceptance length as ``1 + mean(accepted)`` (teacher-forced:
    exact when the labels are the target's greedy output).
    """

    loss: torch.Tensor
    ce_sum: float
    weight_sum: float
    accepted: torch.Tensor
    slot_correct: torch.Tensor
    slot_count: torch.Tensor
    selector_loss: float | None = None
    selector_weight_sum: float = 0.0

    @property
    def tau(self) -> float:
        return 1.0 + float(self.accepted.float().mean()) if self.accepted.numel() else float("nan")


def block_labels(ids: torch.Tensor, lengths: torch.Tensor, loss_mask: torch.Tensor, block_positions: torch.Tensor,
                 valid_anchor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels ``[b, n, B - 1]`` (token at ``a + k``) and their validity."""
    b, n, B = block_positions.shape
    T = ids.shape[1]
    pos = block_positions[..., 1:]
    inside = pos < lengths[:, None, None]
    flat = pos.clamp(max=T - 1).reshape(b, -1)
    labels = ids.gather(1, flat).view(b, n, B - 1)
    carries = loss_mask.gather(1, flat).view(b, n, B - 1)
    return labels, inside & carries & valid_anchor[..., None]


def slot_weights(slots: int, gamma: float, device=None) -> torch.Tensor:
    """``exp(-(k - 1) / gamma)`` for slots ``k = 1 .. slots`` -> float32 ``[slots]``."""
    return torch.exp(-torch.arange(slots, dtype=torch.float32, device=device) / gamma)


def weighted_block_loss(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, gamma: float,
                        stats: bool = True, drafts: torch.Tensor | None = None) -> BlockLoss:
    """Decay-weighted cross-entropy of draft slots. ``logits`` ``[b, n, B - 1, V]``.
    ``stats=False`` skips the acceptance diagnostics; they compare ``drafts``
    ``[b, n, B - 1]`` (default: the argmax of ``logits``) with the labels."""
    weights = slot_weights(logits.shape[2], gamma, logits.device) * valid.float()
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view(labels.shape)
    wsum = weights.sum()
    loss = (ce * weights).sum() / wsum.clamp(min=1e-9)
    if not stats:
        empty = torch.zeros(0, dtype=torch.long)
        return BlockLoss(loss, float((ce.detach() * weights).sum()), float(wsum), empty, empty, empty)
    with torch.no_grad():
        correct = ((logits.argmax(-1) if drafts is None else drafts) == labels) & valid
        full = valid.all(dim=-1)
        accepted = correct.long().cumprod(dim=-1).sum(dim=-1)[full]
        slot_correct = correct.sum(dim=(0, 1))
        slot_count = valid.sum(dim=(0, 1))
    return BlockLoss(loss, float((ce.detach() * weights).sum()), float(wsum), accepted, slot_correct, slot_count)


@torch.no_grad()
@torch.autocast("cpu", enabled=False)
def target_features(target: TargetModel, ids: torch.Tensor, lengths: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """Target features ``[b, T, k * H]`` of every position (padding rows are zero).

    Computed with the inference path's own :class:`TargetModel` forward, in the
    target's dtype (autocast off), one sequence at a time."""
    b, T = ids.shape
    out = None
    for i in range(b):
        L = int(lengths[i])
        cache = target.new_cache()
        cache.reset(L)
        _, feats = target(ids[i, :L], torch.arange(L, device=ids.device), cache, L, layer_ids, logits_from=L)
        if out is None:
            out = torch.zeros(b, T, feats.shape[-1], dtype=feats.dtype, device=feats.device)
        out[i, :L] = feats
    return out


def selector_loss(drafter, hidden: torch.Tensor, unary: torch.Tensor, anchor_tokens: torch.Tensor,
                  labels: torch.Tensor, valid: torch.Tensor, gamma: float) -> torch.Tensor:
    """The DFlash 2 selector loss of a batch of blocks.

    For each valid slot whose label is among the slot's top-K candidates (of ``unary``),
    the cross-entropy over the K candidates of the edge scores from the *true*
    predecessor (the anchor token for slot 1, else the previous label) against the
    label; weighted by :func:`slot_weights` and averaged (0 when no slot qualifies).

    Args:
        hidden: final hidden rows of the draft slots ``[b, n, B - 1, H]``.
        unary: their unary scores ``[b, n, B - 1, V]`` (float32).
        anchor_tokens: int64 ``[b, n]``; labels, valid: ``[b, n, B - 1]``.

    Returns:
        (the loss, a 0-dim float32 tensor with grad; the sum of the qualifying slots'
        weights, a float: 0.0 where no slot qualifies and the loss is no measurement).
    """
    sel = drafter.candidate_selector
    values, ids = sel.candidates(unary)
    predecessors = torch.cat([anchor_tokens[..., None], labels[..., :-1]], dim=-1)
    scores = values + sel.pair_term(hidden, predecessors[..., None], ids)[..., 0, :]  # [b, n, B - 1, K]
    hit = ids == labels[..., None]
    weights = slot_weights(labels.shape[-1], gamma, labels.device) * (hit.any(-1) & valid).float()
    ce = F.cross_entropy(scores.reshape(-1, scores.shape[-1]), hit.float().argmax(-1).reshape(-1), reduction="none")
    total = weights.sum()
    return (ce.view(labels.shape) * weights).sum() / total.clamp(min=1e-9), float(total)


def batch_loss(drafter: DFlashDrafter, target: TargetModel, ids: torch.Tensor, lengths: torch.Tensor, loss_mask: torch.Tensor,
               anchors: torch.Tensor, valid_anchor: torch.Tensor, gamma: float,
               features: torch.Tensor | None = None, stats: bool = True, selector_weight: float = 1.0) -> BlockLoss:
    """Target features (no grad) -> all blocks in one drafter forward -> weighted loss
    (plus ``selector_weight`` times :func:`selector_loss` for a DFlash 2 drafter, whose
    cross-entropy is on its unary scores: the logits after ``output_multiplier`` and the
    soft cap)."""
    cfg = drafter.config
    B = cfg.block_size
    if features is None:
        features = target_features(target, ids, lengths, cfg.target_layer_ids)
    tokens, positions = block_inputs(ids, anchors, B, cfg.mask_token_id)
    hidden = drafter_blocks_forward(drafter, target, features, tokens, positions)
    logits = drafter.draft_logits(target, hidden[:, :, 1:])
    labels, valid = block_labels(ids, lengths, loss_mask, positions, valid_anchor)
    drafts = None
    if stats and cfg.dflash2 is not None:
        with torch.no_grad():
            drafts, _ = drafter.choose_draft(drafter.draft_scores(hidden, tokens[..., 0], target), GREEDY, None)
    out = weighted_block_loss(logits, labels, valid, gamma, stats, drafts)
    if cfg.dflash2 is not None:
        sel, out.selector_weight_sum = selector_loss(drafter, hidden[:, :, 1:], logits, tokens[..., 0], labels, valid, gamma)
        out.selector_loss = float(sel.detach()) if out.selector_weight_sum else None
        if selector_weight:
            out.loss = out.loss + selector_weight * sel
    return out


def init_drafter_weights(drafter: DFlashDrafter, std: float = 0.02) -> None:
    """Normal(0, std) linear weights (output projections scaled by 1/sqrt(2N)), zero biases,
    unit norms; DFlash 2: identity convolutions (:meth:`GroupedDynamicConv.reset_to_identity`)
    and small random selector codebooks and projection (Normal(0, std))."""
    scaled = std / math.sqrt(2 * len(drafter.layers))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 2:
                p.normal_(0.0, scaled if name.endswith(("o_proj.weight", "down_proj.weight")) else std)
            else:
                p.zero_()
    for m in drafter.modules():
        if isinstance(m, GroupedDynamicConv):
            m.reset_to_identity()


@torch.no_grad()
def copy_target_layers(drafter: DFlashDrafter, target: TargetModel) -> list[tuple[int, int, str | None]]:
    """Start the drafter from the target's last N decoder layers and its final norm.

    Drafter layer i takes the weights of target layer ``l0 + i`` with ``l0 = L - N`` (the
    shapes match: the drafter is shaped like the target's layers). When the features
    include layer ``l0 - 1`` (the input of layer ``l0``), ``fc`` starts as the selection
    of that feature slice and ``hidden_norm`` as layer ``l0``'s input norm, so the first
    drafter layer's context keys/values start equal to the target layer's own (its
    attention over the context, induction heads included, works from step 0);
    otherwise ``fc`` and ``hidden_norm`` keep their fresh initialisation (``hidden_norm``
    also where layer ``l0`` has no input norm: a Nemotron-H MLP or MoE block). Layers of
    another kind (linear attention, gated attention, mixture of experts, norms other than
    a plain RMSNorm: hybrid, MoE and Gemma targets) or shape are left as they are; norms
    are copied as the scale they apply. A DFlash 2 drafter's convolutions and selector are
    left as they are.

    Returns:
        ``(drafter layer, target layer, why not)`` for each drafter layer: ``why not`` is
        None where the layer was copied, else what keeps the target layer from it.
    """
    n, layers = len(drafter.layers), target.model.layers
    l0 = len(layers) - n
    copied = []
    for i, d_layer in enumerate(drafter.layers):
        src_layer = layers[l0 + i]
        dst = {k: v for k, v in d_layer.state_dict().items() if not k.startswith(("attention_conv.", "mlp_conv."))}
        why = _uncopyable(src_layer, dst)
        if why is None:
            src = src_layer.state_dict()
            d_layer.load_state_dict({k: src[k].to(v.dtype) for k, v in dst.items()}, strict=False)
        copied.append((i, l0 + i, why))
    drafter.norm.weight.copy_(norm_scale(target.model.norm))
    ids = drafter.config.target_layer_ids
    H = drafter.config.hidden_size
    if l0 >= 1 and (l0 - 1) in ids and drafter.fc.weight.shape == (H, len(ids) * H):
        j = ids.index(l0 - 1)
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, j * H:(j + 1) * H] = torch.eye(H)
        norm = getattr(layers[l0], "input_layernorm", None)  # (none before a Nemotron-H MLP / MoE block's mixer)
        if isinstance(norm, (RMSNorm, ZeroCenteredRMSNorm)) and norm.weight.shape == drafter.hidden_norm.weight.shape:
            drafter.hidden_norm.weight.copy_(norm_scale(norm))
    return copied


def _uncopyable(src_layer: torch.nn.Module, dst: dict[str, torch.Tensor]) -> str | None:
    """Why target layer ``src_layer`` cannot start a drafter layer whose weights are ``dst``
    (None when it can: plain softmax attention, plain RMSNorms, every weight of ``dst``'s
    shape)."""
    attn = getattr(src_layer, "self_attn", None)
    src = src_layer.state_dict()
    why = []
    if attn is None:  # (a linear-attention, Mamba or MLP block)
        why.append("no softmax attention")
    elif not isinstance(attn, Attention):  # (e.g. multi-head latent attention)
        why.append("attention of another kind")
    elif attn.output_gate:
        why.append("gated attention")
    if type(getattr(src_layer, "input_layernorm", None)) is not RMSNorm:
        why.append("norms other than a plain RMSNorm")
    missing = [k.removesuffix(".weight") for k in dst if k not in src]
    other = [k.removesuffix(".weight") for k, v in dst.items() if k in src and src[k].shape != v.shape]
    if any(k.startswith("mlp.") for k in missing):
        why.append("no dense MLP")
    elif any(k.startswith("mlp.") for k in other):
        why.append("an MLP of another width")
    misfit = [k for k in missing + other if not k.startswith("mlp.")]
    if isinstance(attn, Attention) and misfit:  # (the drafter's attention has q/k norms: a Llama target's has none)
        qk_norms = not other and set(misfit) <= {"self_attn.q_norm", "self_attn.k_norm"}
        why.append("no q/k norms" if qk_norms else "attention weights of another shape")
    return ", ".join(why) or None


def norm_scale(norm: torch.nn.Module) -> torch.Tensor:
    """The per-channel scale an RMSNorm applies: ``weight``, or ``1 + weight`` for a
    :class:`ZeroCenteredRMSNorm` (as the drafter's plain RMSNorm weight)."""
    return 1.0 + norm.weight if isinstance(norm, ZeroCenteredRMSNorm) else norm.weight


@torch.autocast("cpu", enabled=False)
def target_greedy_tokens(target: TargetModel, ids: torch.Tensor, start: int,
                         layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's greedy choices along a sequence, teacher-forced, and its features.

    Args:
        ids: int64 ``[T]``; start: the first position whose choice is wanted (>= 1).
    Returns:
        ``(greedy, features)``: int64 ``[T]``, ``greedy[p]`` the target's argmax for
        position ``p`` given ``ids[:p]`` (-1 before ``start``), and the features
        ``[1, T, k * H]`` of :func:`target_features` (one forward gives both).
    """
    T = ids.shape[0]
    cache = target.new_cache()
    cache.reset(T)
    logits, features = target(ids, torch.arange(T, device=ids.device), cache, T, layer_ids, logits_from=start - 1)
    greedy = torch.full((T,), -1, dtype=torch.long, device=ids.device)
    greedy[start:] = logits[:-1].argmax(dim=-1)
    return greedy, features[None]


@torch.no_grad()
def greedy_walk(drafter: DFlashDrafter, target: TargetModel, ids: torch.Tensor, start: int,
                chunk: int = 128) -> list[int]:
    """Acceptance lengths of greedy speculative decoding replayed along a known sequence.

    The rounds of decoding ``ids[start:]`` after ``ids[:start]``: propose the block at
    ``s`` (first ``s = start``), accept the leading draft tokens that equal
    ``ids[s + 1 ...]`` and are the target's greedy choices there
    (:func:`target_greedy_tokens`), commit ``tau`` tokens, ``s += tau``. The drafter is
    run at every position (teacher forcing, the same context features the engine would
    hold; its greedy drafts are those of the engine:
    :meth:`~dflash_torch.models.drafter.DFlashDrafter.choose_draft`) and the walk is
    replayed; it stops when a block would run past the sequence. Returns the tau of each
    round. Where ``ids[start:]`` is the target's own greedy continuation (self-distilled
    rows) these are the engine's rounds exactly; on other text (a corpus, a chat's
    replies) each round's tau is a lower bound of what the engine would accept after the
    same context (a draft the target would take that differs from the text is counted
    rejected), and the walk follows the text, not the target's own continuation.
    """
    B = drafter.config.block_size
    T = ids.shape[0]
    if T - start < B:
        return []
    greedy, features = target_greedy_tokens(target, ids, start, drafter.config.target_layer_ids)
    agrees = ids == greedy  # the text's token is the target's greedy choice
    accepted = torch.zeros(T, dtype=torch.long)
    positions_all = torch.arange(start, T - B + 1)
    for c in range(0, positions_all.numel(), chunk):
        anchors = positions_all[c:c + chunk][None]
        tokens, positions = block_inputs(ids[None], anchors, B, drafter.config.mask_token_id)
        hidden = drafter_blocks_forward(drafter, target, features, tokens, positions)
        pred = drafter.choose_draft(drafter.draft_scores(hidden, tokens[..., 0], target), GREEDY, None)[0][0]  # [n, B - 1]
        slots = positions[0, :, 1:]
        accepted[anchors[0]] = ((pred == ids[slots]) & agrees[slots]).long().cumprod(dim=-1).sum(dim=-1)
    taus, s = [], start
    while s + B <= T:
        tau = 1 + int(accepted[s])
        taus.append(tau)
        s += tau
    return taus
