"""DeepSeek-V4's attention (:mod:`.deepseek_v4`) over the engine's KV cache: a sliding window
of keys (= values) plus, for CSA / HCA layers, compressed entries (CSA: those its Lightning
indexer picks), with per-head sinks and a grouped low-rank output projection; and the
building blocks the decoder shares with it (float32-weight RMSNorm, interleaved RoPE on a
head's trailing channels, its tables :meth:`~dflash_torch.models.rope.Rotary.pair_cos_sin`).

**What the cache holds (all in the engine's KV cache, so batching, fixed shapes, prefix
reuse and the memory accounting work unchanged).** Each layer owns one to three cache slots
(:meth:`.deepseek_v4.Model.kv_shapes`), each a key and a value buffer that hold one row of a token split in
halves (as ``deepseek_v3.py`` holds MLA's latent):

1. the window: the token's key (= value) row, ``head_dim`` values; window
   ``sliding_window`` (a ring with fixed shapes);
2. CSA / HCA: the compressor's per-token inputs (its ``kv_proj`` and ``gate_proj`` outputs,
   for CSA also the indexer's), window ``2 * ratio`` (CSA) or ``ratio`` (HCA): a ring keeps
   every position a later window reads;
3. CSA / HCA: the compressed entries (CSA: with the indexer's compressed keys), every position
   kept, entry ``w`` spread over the rows of its own window, ``w * ratio .. (w + 1) * ratio - 1``,
   ``ceil(entry / ratio)`` values a row: the compressed cache's own size, ``entry / ratio``
   values a token (DeepSeek-V4-Flash: 160 a token for a CSA layer, 4 for an HCA layer).

A forward over positions ``[s, s + T)`` writes its tokens' rows in the first two and, for every
window that ends in it, computes that entry from the inputs slot (the window's earlier tokens
there, written by earlier forwards) and writes all of its rows (rows before ``s`` included);
it reads only complete entries, visible to the query at ``p`` when ``(w + 1) * ratio - 1 <= p``.
Every value a forward writes is a function of positions up to the row's window end, and a row
of an entry is only read once the forward holding that window's end has (re)written it: a
rejected draft block needs no rollback beyond the length, the next forward over those
positions rewrites what it wrote. Fixed shapes: a block of T rows computes the ``ceil(T /
ratio)`` windows that end first at or after ``s`` (every window ending in it, and at most one
that does not, which starts inside the block: that one rewrites its rows up to the block's last
with the values they hold, its rows past the block redirected to the block's last row, so no
write leaves the buffer and no two writes of one row differ); the indexer takes the top-k over
every complete entry of the attended span with the invisible ones at ``-inf`` and masks the
invisible picks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import KVCache
from .layers import Float32WeightRMSNorm

if TYPE_CHECKING:
    from .deepseek_v4 import DeepseekV4Config

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_SCORES_PER_CHUNK = 1 << 25  # scores held at once (query rows are taken in chunks)


Norm = Float32WeightRMSNorm  # (transformers' DeepseekV4RMSNorm)


def unit_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm without a weight, its factor computed in float32 and rounded to ``x.dtype``."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE (pairs ``(2i, 2i + 1)`` turn by frequency ``i``) of the trailing
    ``2 * cos.shape[-1]`` channels of ``x``, in float32; ``cos`` / ``sin`` broadcast against
    ``x[..., :half]``; the leading channels pass through."""
    d = 2 * cos.shape[-1]
    rope = x[..., -d:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    turned = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-d], turned], dim=-1)


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The attention output's RoPE at minus the query's position (K = V carried the keys'
    rotation into the values)."""
    return rope_tail(x, cos, -sin)


class Compressor(nn.Module):
    """Pools windows of ``ratio`` tokens into entries of ``head`` values (Hugging Face
    ``compressor.*`` / ``compressor.indexer.*``: ``kv_proj``, ``gate_proj``, ``position_bias``
    ``[ratio, c * head]`` (float32), ``kv_norm``; ``c`` = 2 with ``overlap`` (CSA: entry ``w``
    pools the first half of the channels of window ``w - 1``'s tokens with the second half of
    window ``w``'s), else 1)."""

    def __init__(self, hidden: int, head: int, ratio: int, overlap: bool, eps: float):
        super().__init__()
        self.head, self.ratio, self.c = head, ratio, 2 if overlap else 1
        self.kv_proj = nn.Linear(hidden, self.c * head, bias=False)
        self.gate_proj = nn.Linear(hidden, self.c * head, bias=False)
        self.position_bias = nn.Parameter(torch.empty(ratio, self.c * head))
        self.kv_norm = Norm(head, eps)

    @property
    def width(self) -> int:
        """Per-token inputs cached: ``kv_proj`` then ``gate_proj`` outputs."""
        return 2 * self.c * self.head

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.kv_proj(x), self.gate_proj(x)], dim=-1)

    def pool(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Entries ``[..., head]`` (before RoPE) of windows whose ``c * ratio`` tokens' inputs
        are ``tokens`` ``[..., c * ratio, width]`` (``valid``: bool ``[..., c * ratio]``, False for
        positions before 0: zero weight)."""
        h, r, c = self.head, self.ratio, self.c
        kv, gate = tokens[..., :c * h], tokens[..., c * h:]
        gate = gate + self.position_bias.repeat(c, 1)  # (float32)
        if c == 2:
            first = torch.arange(2 * r, device=tokens.device) < r  # window w - 1: its first half of the channels
            kv = torch.where(first[:, None], kv[..., :h], kv[..., h:])
            gate = torch.where(first[:, None], gate[..., :h], gate[..., h:])
        kv = kv.masked_fill(~valid[..., None], 0)
        gate = gate.masked_fill(~valid[..., None], float("-inf"))
        pooled = (kv * gate.softmax(dim=-2, dtype=torch.float32).to(kv.dtype)).sum(dim=-2)
        return self.kv_norm(pooled)


class Indexer(Compressor):
    """The Lightning indexer of a CSA layer: a compressor of its own (``index_head_dim``) plus
    ``q_b_proj`` and ``scorer.weights_proj`` (Hugging Face ``compressor.indexer.*``)."""

    def __init__(self, cfg: DeepseekV4Config, ratio: int):
        super().__init__(cfg.hidden_size, cfg.index_head_dim, ratio, True, cfg.rms_norm_eps)
        self.heads, self.top_k = cfg.index_n_heads, cfg.index_topk
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.scorer = nn.Module()
        self.scorer.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)


class CompressedKV(Compressor):
    """A CSA / HCA layer's compressor (Hugging Face ``self_attn.compressor``), with its
    indexer for CSA."""

    def __init__(self, cfg: DeepseekV4Config, kind: str):
        ratio = cfg.compress_rates[kind]
        super().__init__(cfg.hidden_size, cfg.head_dim, ratio, kind == CSA, cfg.rms_norm_eps)
        self.indexer = Indexer(cfg, ratio) if kind == CSA else None


def _halves(width: int) -> int:
    return -(-width // 2)


class GroupedProjection(nn.Linear):
    """``o_a_proj``, whose matrix the grouped output projection reads per group rather than
    applying it to rows. A subclass, so that a checkpoint loaded ``fp8="packed"`` dequantizes
    it when loading (only a decoder layer's plain ``nn.Linear`` becomes an
    :class:`~dflash_torch.models.fp8.Fp8Linear`); :meth:`Model.dequantized_keys` counts it
    dequantized in the memory check."""


class Attention(nn.Module):
    """DeepSeek-V4 attention of one layer (see the module docstring). Hugging Face names:
    ``q_a_proj``, ``q_a_norm``, ``q_b_proj``, ``kv_proj``, ``kv_norm``, ``o_a_proj``,
    ``o_b_proj``, ``sinks``, ``compressor.*``.

    Attributes:
        slots: the cache slots of the window, the compressor's inputs and the entries
            (the last two None for a sliding layer).
    """

    def __init__(self, cfg: DeepseekV4Config, kind: str, slots: tuple):
        super().__init__()
        hidden, h, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.kind, self.slots, self.eps = kind, slots, cfg.rms_norm_eps
        self.heads, self.kv_heads, self.head_dim = h, 1, d
        self.groups, self.scale = cfg.o_groups, d ** -0.5
        self.rope_key = "main" if kind == SLIDING else "compress"
        self.q_a_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=False)
        self.q_a_norm = Norm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * d, bias=False)
        self.kv_proj = nn.Linear(hidden, d, bias=False)
        self.kv_norm = Norm(d, cfg.rms_norm_eps)
        self.o_a_proj = GroupedProjection(h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(cfg.o_groups * cfg.o_lora_rank, hidden, bias=False)
        self.sinks = nn.Parameter(torch.empty(h))
        self.compressor = None if kind == SLIDING else CompressedKV(cfg, kind)

    def entry_width(self) -> int:
        """Values of one compressed entry: the compressor's, then (CSA) the indexer's key."""
        c = self.compressor
        return c.head + (c.indexer.head if c.indexer is not None else 0)

    def chunk(self) -> int:
        """Values of an entry each of its window's ``ratio`` rows holds (the last padded)."""
        return -(-self.entry_width() // self.compressor.ratio)

    def shapes(self) -> list[tuple[tuple[int, int], int | None]]:
        """((kv_heads, head_dim), window) of each of this layer's cache slots."""
        out = [((1, _halves(self.head_dim)), None)]
        c = self.compressor
        if c is not None:
            width = c.width + (c.indexer.width if c.indexer is not None else 0)
            out += [((1, _halves(width)), c.c * c.ratio), ((1, _halves(self.chunk())), None)]
        return out

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor, kv: KVCache, step: "Step") -> torch.Tensor:
        """``h`` ``[R, hidden]`` (the layer's normed input; N sequences' rows one after another)
        -> ``[R, hidden]``, writing this layer's cache rows. Queries run in chunks of rows
        (about 2**25 scores held at once: the indexer's per head, the attention's)."""
        n, t = step.pos.shape
        hd, heads = self.head_dim, self.heads
        cos, sin = step.rope[self.rope_key]
        q_res = self.q_a_norm(self.q_a_proj(h))
        q = unit_norm(self.q_b_proj(q_res).view(-1, heads, hd), self.eps)
        q = rope_tail(q, cos[:, None], sin[:, None]).view(n, t, heads, hd)
        key = rope_tail(self.kv_norm(self.kv_proj(h)), cos, sin)
        _write(kv, self.slots[0], step.positions, key)
        keys = _rows(kv, self.slots[0], step.kv_len, hd)  # [N, Tk, hd]
        c = self.compressor
        store = entries = index_keys = visible = None
        if c is not None:
            store, visible = self._entries(h, kv, step)
        per_row = heads * keys.shape[1]
        if store is not None:
            e = store.count
            if c.indexer is None:  # (every entry attended: read them all once)
                entries = store.values(0, c.head)
                per_row += heads * e
            else:  # (the indexer's keys of every entry; the picked entries' values per chunk of queries)
                entries, index_keys = store, store.values(c.head, self.entry_width())
                k = min(c.indexer.top_k, e)
                per_row = max(per_row + heads * k, c.indexer.heads * e, k * hd)
        rows = max(1, _SCORES_PER_CHUNK // (n * per_row))
        h3, r3 = h.view(n, t, -1), q_res.view(n, t, -1)
        outs = []
        for a in range(0, t, rows):
            part = slice(a, a + rows)
            outs.append(self._attend(q[:, part], keys, step.window_bias[:, part], entries, index_keys,
                                     None if visible is None else visible[:, part], h3[:, part], r3[:, part],
                                     [x.view(n, t, -1)[:, part] for x in step.rope["compress"]]))
        out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        out = unrotate(out.reshape(n * t, heads, hd), cos[:, None], sin[:, None])
        grouped = out.reshape(n * t, self.groups, heads * hd // self.groups)
        w = self.o_a_proj.weight.view(self.groups, -1, grouped.shape[-1])
        return self.o_b_proj(torch.einsum("rgi,goi->rgo", grouped, w).flatten(1))

    def _attend(self, q, keys, window_bias, entries, index_keys, visible, h, q_res, compress_rope) -> torch.Tensor:
        """Attention of the query rows ``q`` ``[N, Tq, H, hd]`` over the window's ``keys``
        ``[N, Tk, hd]`` (mask ``window_bias`` ``[N, Tq, Tk]``) and the entries (HCA: all,
        ``[N, E, hd]``; CSA: those the indexer picks, read from ``entries``, an
        :class:`_Entries`; ``visible`` ``[N, Tq, E]``), with the sinks: softmax in float32 (the
        sinks float32), -> ``[N, Tq, H, hd]``."""
        n, tq, heads, _ = q.shape
        logits = [torch.einsum("nthd,nkd->nhtk", q, keys) * self.scale + window_bias[:, None]]
        values = [keys]
        if entries is not None:
            if index_keys is None:  # HCA: every visible entry
                logits.append(torch.einsum("nthd,ned->nhte", q, entries) * self.scale + _bias(visible, q.dtype)[:, None])
                values.append(entries)
            else:  # CSA: the indexer's top-k of the visible entries
                picks, valid = self._select(h, q_res, index_keys, visible, compress_rope)
                chosen = entries.values(0, self.head_dim, picks)
                logits.append(torch.einsum("nthd,ntkd->nhtk", q, chosen) * self.scale + _bias(valid, q.dtype)[:, None])
                values.append(chosen)
        sinks = self.sinks.float().view(1, heads, 1, 1).expand(n, heads, tq, 1)
        probs = torch.softmax(torch.cat([x.float() for x in logits] + [sinks], dim=-1), dim=-1).to(q.dtype)
        out, start = 0, 0
        for part, vals in zip(logits, values):
            p = probs[..., start:start + part.shape[-1]]
            start += part.shape[-1]
            spec = "nhtk,nkd->nthd" if vals.dim() == 3 else "nhtk,ntkd->nthd"
            out = out + torch.einsum(spec, p, vals)
        return out

    def _entries(self, h: torch.Tensor, kv: KVCache, step: "Step"):
        """Write this block's compressor inputs and the entries of the windows that end in
        it: (the complete entries of the attended span, an :class:`_Entries`, and visible bool
        ``[N, T, E]``), both None when the span holds no whole window.

        Entry ``w`` lies in the entries slot spread over its window's rows ``w * ratio ..
        (w + 1) * ratio - 1``, :meth:`chunk` values each. A block of T rows computes the
        ``ceil(T / ratio)`` windows ending first at or after its first position; those that
        end in the block are written whole (rows before the block included), the last one
        if it does not (it then starts inside the block) rewrites its rows up to the
        block's last with the values they hold (its rows past it redirected there)."""
        c, idx = self.compressor, self.compressor.indexer
        _, slot_in, slot_e = self.slots
        n, t = step.pos.shape
        r, cr = c.ratio, c.c * c.ratio
        dev = h.device
        rows = c.inputs(h) if idx is None else torch.cat([c.inputs(h), idx.inputs(h)], dim=-1)
        _write(kv, slot_in, step.positions, rows)
        width = rows.shape[-1]
        plan = step.windows(r, c.c, kv.layer_ring(slot_in), kv.view(slot_in, None)[0].shape[-2])
        k = plan.ends.shape[-1]
        gathered = _gather_rows(kv, slot_in, plan.index.reshape(n, -1), width).view(n, k, cr, width)
        valid, (cos, sin) = plan.valid, plan.rope
        entry = rope_tail(c.pool(gathered[..., :c.width], valid).reshape(n * k, -1), cos, sin)
        if idx is not None:
            ikey = rope_tail(idx.pool(gathered[..., c.width:], valid).reshape(n * k, -1), cos, sin)
            entry = torch.cat([entry, ikey], dim=-1)
        ew, cw = self.entry_width(), self.chunk()
        entry = F.pad(entry, (0, r * cw - ew)).view(n, k, r, cw)
        target = plan.target
        held = _gather_rows(kv, slot_e, target.reshape(n, -1), cw).view(n, k, r, cw)
        values = torch.where(plan.complete[..., None, None], entry, held)
        _write(kv, slot_e, target.reshape(-1) if step.positions.dim() == 1 else target.reshape(n, -1),
               values.reshape(-1, cw))
        store = _Entries(*kv.view(slot_e, step.kv_len), r, cw)
        if store.count == 0:
            return None, None
        visible = (torch.arange(store.count, device=dev) + 1) * r - 1 <= step.pos[..., None]  # [N, T, E]
        return store, visible

    def _select(self, h, q_res, index_keys, visible, compress_rope):
        """The indexer's picks for query rows (``h`` ``[N, Tq, hidden]``, ``q_res`` their
        query latent, ``compress_rope`` their compress cos / sin ``[N, Tq, rope_dim / 2]``):
        int64 ``[N, Tq, k]`` entry indices and bool ``[N, Tq, k]`` (False: an invisible pick,
        masked). Scores ``sum_h w_h relu(q_h . k) / sqrt(index_head_dim)`` in float32, ``w`` =
        ``weights_proj(h) / sqrt(index_n_heads)``. Equal scores (the ReLU makes exact zeros
        common) are picked lowest entry first: a stable sort, not ``topk``, whose choice among
        ties depends on the shape it runs on (a verify block and the same rows one at a time
        would attend to different entries); transformers' ``topk`` picks among them as it
        happens to, so only there can the two differ."""
        idx = self.compressor.indexer
        cos, sin = compress_rope
        q = rope_tail(idx.q_b_proj(q_res).view(*q_res.shape[:2], idx.heads, idx.head), cos[:, :, None], sin[:, :, None])
        scores = F.relu(torch.einsum("ntai,nei->ntae", q.float(), index_keys.float())) * idx.head ** -0.5
        weights = idx.scorer.weights_proj(h).float() * idx.heads ** -0.5
        scores = (scores * weights[..., None]).sum(dim=2).masked_fill(~visible, float("-inf"))
        picks = scores.sort(dim=-1, descending=True, stable=True).indices[..., :min(idx.top_k, scores.shape[-1])]
        return picks, torch.gather(visible, 2, picks)


def _bias(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))


def _rows(kv, slot: int, end: int | None, width: int) -> torch.Tensor:
    """A slot's rows ``[N, rows, width]`` (the key half then the value half; one sequence: N = 1)."""
    k, v = kv.view(slot, end)
    if k.dim() == 3:
        k, v = k[None], v[None]
    return torch.cat([k[:, 0], v[:, 0]], dim=-1)[..., :width]


def _gather_rows(kv, slot: int, index: torch.Tensor, width: int) -> torch.Tensor:
    """A slot's rows ``index`` (int64 ``[N, M]``, rows of its buffers) -> ``[N, M, width]``."""
    k, v = kv.view(slot, None)
    if k.dim() == 3:
        k, v = k[None], v[None]
    at = index[..., None]
    return torch.cat([torch.gather(k[:, 0], 1, at.expand(-1, -1, k.shape[-1])),
                      torch.gather(v[:, 0], 1, at.expand(-1, -1, v.shape[-1]))], dim=-1)[..., :width]


class _Entries:
    """The complete entries of an entries slot's first ``Tk`` rows, read in place from its
    key and value buffers (``[N, 1, Tk, half]``; one sequence: ``[1, Tk, half]``): entry ``w``
    is rows ``w * ratio ..``, each ``cw`` values split in the two halves."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, ratio: int, cw: int):
        if k.dim() == 3:
            k, v = k[None], v[None]
        n, _, tk, half = k.shape
        self.count, self.ratio, self.cw = tk // ratio, ratio, cw
        rows = self.count * ratio
        self.k = k[:, 0, :rows].reshape(n, self.count, ratio, half)
        self.v = v[:, 0, :rows].reshape(n, self.count, ratio, half)

    def values(self, lo: int, hi: int, picks: torch.Tensor | None = None) -> torch.Tensor:
        """Values ``[lo, hi)`` of every entry, ``[N, E, hi - lo]``, or of the entries ``picks``
        (int64 ``[N, Tq, k]``) -> ``[N, Tq, k, hi - lo]``; only the rows holding them are read."""
        first, end = lo // self.cw, -(-hi // self.cw)
        k, v = self.k[:, :, first:end], self.v[:, :, first:end]
        if picks is not None:
            n, tq, _ = picks.shape
            take = lambda x: torch.gather(  # noqa: E731
                x.flatten(2)[:, None].expand(n, tq, -1, -1), 2,
                picks[..., None].expand(-1, -1, -1, x.shape[2] * x.shape[3])).unflatten(-1, x.shape[2:])
            k, v = take(k), take(v)
        rows = torch.cat([k, v], dim=-1)[..., :self.cw].flatten(-2)
        return rows[..., lo - first * self.cw:hi - first * self.cw]


def _write(kv, slot: int, positions: torch.Tensor, rows: torch.Tensor) -> None:
    """Store ``rows`` ``[R, width]`` at ``positions`` (split in the key and value halves)."""
    half = _halves(rows.shape[-1])
    if rows.shape[-1] < 2 * half:
        rows = F.pad(rows, (0, 2 * half - rows.shape[-1]))
    kv.write(slot, positions, rows[None, :, :half], rows[None, :, half:])


@dataclass
class Windows:
    """Which compressed windows a block computes, the same for every layer of one ratio
    (:meth:`Step.windows`): ``ends`` ``[N, K]`` their last positions, ``index`` ``[N, K, c *
    ratio]`` the inputs slot's rows of their tokens (``valid``: those at positions >= 0),
    ``rope`` the compress cos / sin at their first positions, ``target`` ``[N, K, ratio]`` the
    entries slot's rows each writes (past the block's last position redirected to it) and
    ``complete`` ``[N, K]`` whether the window ends in the block."""

    ends: torch.Tensor
    index: torch.Tensor
    valid: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]
    target: torch.Tensor
    complete: torch.Tensor


@dataclass
class Step:
    """What every layer of one forward shares: ``pos`` ``[N, T]``, the caller's ``positions``,
    ``kv_len``, the RoPE tables of the block's positions per key, the window mask ``[N, T, Tk]``
    and the compress RoPE (a callable on positions)."""

    pos: torch.Tensor
    positions: torch.Tensor
    kv_len: int | None
    rope: dict
    window_bias: torch.Tensor
    compress_rope: object
    _windows: dict = field(default_factory=dict)

    def windows(self, ratio: int, c: int, ring: int | None, held_rows: int) -> Windows:
        """The :class:`Windows` of this block for compressors of ``ratio`` (``c`` = 2: CSA's
        overlapping windows) whose inputs slot is a ring of ``ring`` rows (None: ``held_rows``
        rows, every position), computed once per forward and shared by those layers: the
        ``ceil(T / ratio)`` windows ending first at or after the block's first position."""
        key = (ratio, c, ring, held_rows)
        if key not in self._windows:
            dev, r = self.pos.device, ratio
            k = -(-self.pos.shape[1] // r)
            first, last = self.pos[:, :1], self.pos[:, -1:]
            ends = first + torch.remainder(r - 1 - first, r) + r * torch.arange(k, device=dev)  # [N, K]
            windows = ends // r
            tok = (windows - (c - 1))[..., None] * r + torch.arange(c * r, device=dev)  # [N, K, c * r] positions
            index = torch.remainder(tok, ring) if ring is not None else tok.clamp(0, held_rows - 1)
            target = torch.minimum(windows[..., None] * r + torch.arange(r, device=dev), last[..., None])
            self._windows[key] = Windows(ends, index, tok >= 0, self.compress_rope((windows * r).reshape(-1)), target,
                                         ends <= last)
        return self._windows[key]
