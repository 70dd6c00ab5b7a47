"""Batched speculative decoding: many sequences per round.

:class:`BatchDecoder` keeps up to ``max_batch_size`` sequences, each in a *slot* of
preallocated caches. One :meth:`~BatchDecoder.step` runs one round for all of them at
once: one drafter forward over the N blocks ``[N, B]`` (which also injects each
sequence's last verify features into its own drafter cache region), one target verify
over the N blocks, then acceptance, rollback and the choice of the next block per
sequence, each with its own committed length, positions and random generator.
Sequences join with :meth:`~BatchDecoder.join` (chunked prefill: their prompt is read
a bounded number of tokens per :meth:`~BatchDecoder.step`, between rounds, so the
sequences already decoding never wait for a whole long prompt) or
:meth:`~BatchDecoder.add` (the whole prefill now, alone), and leave with
:meth:`~BatchDecoder.remove` (their slot is free at once), all between rounds; what
stops a sequence (EOS, stop strings, its token budget) is the caller's decision, as with
:class:`~dflash_torch.decoding.SpeculativeDecoder`.

How the models run N sequences: every projection, MLP and LM head sees the N blocks as
``N * B`` rows (that is where batching pays); attention reads each sequence's own keys
(:class:`SlotKVCache`, ``[slots, kv_heads, capacity, head_dim]`` per layer) under a
mask of its own length, with its own rotary positions. Live sequences always occupy the
first slots: a sequence that leaves is replaced by the last one (its cache rows are
moved), so a round reads slots ``[0, N)`` as plain views. Joining sequences wait in a
FIFO queue: only its head is ever partly prefilled, in slot ``N`` (it moves with the
decoding sequences when one leaves), and it becomes slot ``N`` of the round after its
last chunk.

A sequence that joins with the same prompt as one still waiting or being prefilled (the
``n`` choices of one request) shares that prefill: it waits with it, takes no turn of its
own, and when the last chunk is read the prompt's slot (target K/V rows, drafter context
rows, recurrent state) is copied into the next slot for it; it samples its own first token
from the same last-row logits with its own generator. Its output is exactly what a prefill
of its own gives. If the sequence being prefilled leaves first, the next sharer takes over
its place and the part of the prompt already read.

Hybrid targets (Gated DeltaNet layers) keep each sequence's recurrent state in its slot
(:class:`SlotRecurrentState`); a linear-attention layer runs the N sequences at once
(projections over the ``N * B`` rows, the convolution and the delta rule with a leading
sequence dimension), a verify leaves every state as it was and one commit after
acceptance advances each sequence's state over its own accepted prefix (the rollback,
run eagerly after the verify, also when the verify is compiled).

Prompt-prefix reuse (``reuse_prefix``, default on): a multi-turn conversation sends the
whole history again with every turn. When a decoding sequence leaves, its slot's rows are
kept as a *retained prefix* in a free slot, with the token ids of its valid positions
``[0, s)`` (``s``: its committed length; the last verify's accepted feature rows, which
the next propose would have injected, are injected into its drafter context first, so
target K/V rows, drafter context rows and a hybrid target's recurrent state are all valid
up to ``s``). A prompt whose prefill starts (:meth:`~BatchDecoder.join` or
:meth:`~BatchDecoder.add`) and which begins with the ids of a retained prefix takes the
rows of the longest match (a copy into its slot, or in place when that prefix lies in its
slot) and reads only the rest; the last prompt token is read (its logits give the first
token), except when the prompt is the very prompt the retained prefix began with (a
regenerated reply, a retried request, the ``n`` choices of a prompt in scarce slots):
each sequence keeps its prompt's last logits ``[V]``, so that prompt is not read at all.
Where they give more, a prompt takes instead the rows of the start it shares with a
decoding sequence's prompt (a copy from that sequence's slot, which goes on decoding: a
prompt's rows are written by its prefill, and no round rewrites them), short of its last
token, so that prompts arriving together with one system prompt read it once; a hybrid or
sliding-window model (whose state and rings in that slot are those of its last position)
only up to a shared start whose snapshot is kept (below).
A hybrid target's recurrent state cannot be rolled back to an earlier
position, nor can the rings of a target's sliding-window layers (they hold the last
``window + max(B, prefill_chunk) - 1`` positions written, see :mod:`~dflash_torch.cache`),
so each slot also keeps a checkpoint of them, saved at the end of its prompt's
prefill, or where the prefill passes the ``checkpoint`` the caller gives (where a chat's
messages end, before the template's opening of the reply): such a retained prefix serves
a prompt that extends its ids exactly (the state at its end), else one that starts with
the ids up to its checkpoint (the next turn of a chat whose template renders the last
reply differently from the tokens generated, e.g. without its thinking, given that
position as ``checkpoint``; a reply cut by a stop string or ``max_tokens``; that prompt
itself, with its kept logits where the checkpoint is its end), else only a shared start
whose snapshot the decoder keeps: a prompt given with ``shared_end`` (where its chat's
leading system messages end, a start other conversations with that system prompt and tools
share) has its prefill end a chunk there and keep a snapshot of the state and rings at
that position, keyed by the token ids before it, in a small pool (``shared_starts``
snapshots, :data:`SHARED_STARTS` by default, the least recently used dropped); a later
prompt that starts with those ids copies their rows from a retained prefix that holds
them (another conversation's, which stays retained), takes the snapshot's state and
rings, and reads only the rest (one whose snapshot was dropped reads them all, as does
one that shares fewer tokens; with ``shared_starts=0`` none is kept).
Outputs are those of a prefill of the whole prompt (float32 greedy: the same
tokens; seeded sampling: the same tokens). ``reused_prefill_tokens`` counts the prompt
tokens taken this way.

The policy (a least-recently-used set over the free slots): retained prefixes live only
in slots no sequence uses (the free ones, and the ``prefix_slots`` past ``max_batch_size``,
which only ever hold retained prefixes). A leaver's rows go to the highest such slot that holds no
retained prefix, else stay in its own slot when nothing moves into it, else it trades
slots with the last decoding sequence (rows and states exchanged) and keeps them in the
slot it then frees, so no retained prefix is dropped (as many conversations as slots each
find theirs); only where a partly prefilled joiner is to move into that slot does the
least recently used prefix give way. When a prompt's prefill starts in a slot that holds a
retained prefix it does not take, that prefix moves to a higher free slot: an empty one,
else the slot of the prefix the prompt takes (the two trade slots), else the least
recently used prefix's if that one is older (else it is dropped). Any other
write drops a retained prefix in its slot (a shared prefill's copies when the batch grows
into it, :meth:`~BatchDecoder.warmup`). A fixed-shape round's padding row in such a slot
runs past the retained length when that fits the round's length bucket, else the prefix
is dropped (never a longer bucket, so no new graph). A sequence held past its budget (run
as padding) keeps nothing. A joining sequence that leaves while its prompt is partly read
(a server's request that went away in its prefill) keeps the rows of the whole chunks read
(and those it reused) in its slot as a retained prefix, without logits (a retry, or a prompt
that extends them, reads only the rest; the same prompt reads its last token), where the
caches can go back (not on a hybrid or sliding-window target, as
:class:`~dflash_torch.decoding.SpeculativeDecoder`); one whose prefill others share hands
it to the next of them instead.

Prompt logprobs (``prompt_logprobs=k`` of :meth:`~BatchDecoder.add` / :meth:`~BatchDecoder.join`)
come from the logits each prefill chunk computes anyway (its valid rows,
:func:`~dflash_torch.decoding.prompt_chunk_logprobs`), so every prompt token must be read:
such a sequence takes no retained prefix (its prompt is read whole; a retained prefix in its
slot moves up as for any prompt that does not take it), and shares a prefill only with
sequences that ask for the same ``k`` (the ``n`` choices of one request do: the scores are
computed once, for all of them). When it leaves, its rows are retained as any sequence's,
for later prompts. Sequences that do not ask are unchanged.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch

from . import compute
from .cache import (KVCache, RecurrentState, RingLayers, TargetCache, buffer_rows, cache_bytes, layer_shapes,
                    common_start, most_that_fits, ring_sizes, static_buffer)
from .checkpoint import available_memory, memory_text
from .decoding import (Round, check_models, compile_step, context_caches, kv_bucket, length_buckets, prompt_chunk_logprobs,
                       reserve_graphs, without_shape_plans)
from .draft_policy import DraftPolicy
from .errors import DFlashError, OptionError, shown
from .models.drafter import DFlashDrafter, InjectedContext
from .models.gated_deltanet import CHUNK
from .models.target import TargetModel
from .options import (check_block_size, check_count, check_flag, check_max_context, check_max_new_tokens, check_prompt_ids,
                      check_prompt_logprobs, check_prompt_position, context_limit, plain)
from .sampling import (LogitsProcessor, SamplingParams, accept_greedy, accept_sampling, choose, first_logprobs,
                       first_token, probabilities, token_logprobs)


BACKLOG_ROWS = 64  # a sequence's feature rows of target-only rounds injected at once (at most; see BatchDecoder)
SHARED_STARTS = 2  # snapshots of shared prompt starts a hybrid / ring BatchDecoder keeps by default (see shared_starts)


def _copy_slot(tensors: list[torch.Tensor], slot: int, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Slot ``slot`` of each of ``tensors`` (``[slots, ...]``) copied, into ``out`` (tensors of
    those shapes, reused) where given -> the copies (the snapshots of shared prompt starts)."""
    if out is None:
        return [t[slot].clone() for t in tensors]
    for t, c in zip(tensors, out):
        c.copy_(t[slot])
    return out


def _load_slot(tensors: list[torch.Tensor], slot: int, copies: list[torch.Tensor]) -> None:
    """Copy ``copies`` (:func:`_copy_slot`'s) back into slot ``slot`` of each of ``tensors``."""
    for t, c in zip(tensors, copies):
        t[slot].copy_(c)


def cache_sizes(max_context: int, prefill_chunk: int, block_size: int) -> tuple[int, int, int]:
    """A :class:`BatchDecoder`'s cache sizes per slot for ``max_context`` tokens, reading
    prompts ``prefill_chunk`` tokens at a time (at most ``max_context``), blocks of
    ``block_size``: (positions, a finished sequence still held running one block past its
    budget; the most rows one forward writes to the target's caches; the drafter's, whose
    context also takes a backlog of injections at once). Rows decide the rings of
    sliding-window layers (see cache.py)."""
    B, chunk = block_size, min(prefill_chunk, max_context)
    return max_context + max(2 * B, chunk) + 1, max(B, chunk), max(B, chunk, BACKLOG_ROWS + B)


def check_draft_max_batch_size(value, *, drafter: bool = True, draft_mode: str = "inject",
                               block_size: int | None = None) -> int | str | None:
    """Validate ``draft_max_batch_size``: None (always draft), an integer >= 1, or
    ``"auto"`` (:class:`~dflash_torch.draft_policy.DraftPolicy`), for a decoder with a
    drafter or not (``drafter``; False: target-only decoding, ``no_draft``), its
    ``draft_mode`` and ``block_size`` (None: the drafter's). A limit other than None
    where no batched round drafts (no drafter, ``draft_mode="recompute"``, which decodes
    one sequence at a time, or block size 1) would have no effect, so it is refused.

    Raises:
        OptionError: anything else, or a limit where no batched round drafts.
    """
    value = plain(value, "draft_max_batch_size")
    if value is None:
        return value
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise OptionError(f"draft_max_batch_size must be an integer >= 1 or 'auto', got {shown(value)}",
                          "draft_max_batch_size")
    if not drafter:
        raise OptionError("draft_max_batch_size has no effect without a drafter (no_draft: every round is "
                          "target-only); drop it", "draft_max_batch_size", "no_draft")
    if draft_mode == "recompute":
        raise OptionError("draft_max_batch_size has no effect with draft_mode 'recompute' (it decodes one sequence "
                          "at a time); drop it", "draft_max_batch_size", "draft_mode")
    if block_size == 1:
        raise OptionError("draft_max_batch_size has no effect with block size 1 (every round is target-only); "
                          "drop it", "draft_max_batch_size", "block size")
    return value


def check_prefix_slots(value, reuse_prefix: bool = True, draft_mode: str = "inject") -> int:
    """Validate ``prefix_slots``: an integer >= 0, and 0 with ``reuse_prefix`` off or
    ``draft_mode="recompute"`` (which decodes one sequence at a time, keeping the last one's rows only).

    Raises:
        OptionError: any other value.
    """
    value = plain(value, "prefix_slots")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise OptionError(f"prefix_slots must be an integer >= 0, got {shown(value)}", "prefix_slots")
    if value and not reuse_prefix:
        raise OptionError("prefix_slots hold retained prefixes, which reuse_prefix off never keeps; drop it",
                          "prefix_slots", "reuse_prefix")
    if value and draft_mode == "recompute":
        raise OptionError("prefix_slots has no effect with draft_mode 'recompute' (it decodes one sequence at a time, "
                          "keeping the last one's rows only); drop it", "prefix_slots", "draft_mode")
    return value


def check_shared_starts(value, reuse_prefix: bool = True, draft_mode: str = "inject") -> int:
    """Validate ``shared_starts``: an integer >= 0 (0: no snapshots), and the default,
    :data:`SHARED_STARTS`, with ``reuse_prefix`` off or ``draft_mode="recompute"`` (which
    decodes one sequence at a time, keeping the last one's rows only), where it has no effect.

    Raises:
        OptionError: any other value.
    """
    value = plain(value, "shared_starts")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise OptionError(f"shared_starts must be an integer >= 0, got {shown(value)}", "shared_starts")
    if value != SHARED_STARTS and not reuse_prefix:
        raise OptionError("shared_starts has no effect with reuse_prefix off (its snapshots serve prefix reuse only); "
                          "drop it", "shared_starts", "reuse_prefix")
    if value != SHARED_STARTS and draft_mode == "recompute":
        raise OptionError("shared_starts has no effect with draft_mode 'recompute' (it decodes one sequence at a time, "
                          "keeping the last one's rows only); drop it", "shared_starts", "draft_mode")
    return value


def check_max_batch_size(value, name: str = "max_batch_size") -> int:
    """Sequences decoded together: an integer >= 1.

    Raises:
        OptionError: anything else.
    """
    value = plain(value, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OptionError(f"{name} must be an integer >= 1, got {shown(value)}", name)
    return value


DEFAULT_MAX_BATCH_SIZE = 8  # an engine's slots where none are given (and a server's)


def check_engine_max_batch_size(value, *, drafter: bool = True, draft_mode: str = "inject") -> int:
    """An engine's ``max_batch_size`` (:func:`check_max_batch_size`), for a decoder with a
    drafter or not (``drafter``) and its ``draft_mode``. None: the default,
    :data:`DEFAULT_MAX_BATCH_SIZE`, but 1 with ``draft_mode="recompute"`` (with a drafter),
    which decodes one sequence at a time; there a larger value would have no effect, so it
    is refused.

    Raises:
        OptionError: not an integer >= 1, or > 1 with ``draft_mode="recompute"``.
    """
    serial = drafter and draft_mode == "recompute"
    if plain(value, "max_batch_size") is None:
        return 1 if serial else DEFAULT_MAX_BATCH_SIZE
    value = check_max_batch_size(value)
    if value > 1 and serial:
        raise OptionError("max_batch_size has no effect with draft_mode 'recompute' (it decodes one sequence at a "
                          "time); drop it", "max_batch_size", "draft_mode")
    return value


class SlotKVCache(RingLayers):
    """Keys and values of many sequences: ``k[layer]``/``v[layer]`` of shape
    ``[slots, kv_heads, rows, head_dim]``, one slot per sequence (``rows``: the capacity,
    or a sliding-window layer's ring size, as in :class:`~dflash_torch.cache.KVCache`).

    :meth:`first` gives a view of slots ``[0, n)`` that the models use as their cache in a
    batched forward (positions ``[n, T]``); :meth:`slot` gives one slot as a
    :class:`~dflash_torch.cache.KVCache` (a prefill runs on it as on a single sequence).

    With ``checkpoints``, each ring also has a second copy per slot, written by :meth:`save`
    and read back by :meth:`restore` (the ring at a prompt's end, for prefix reuse);
    :meth:`move` and :meth:`swap` carry them.

    ``slots``, ``dtype`` and ``device`` are given apart from the buffers: a target with no
    attention layer (all recurrent) has none.
    """

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], windows: list[int | None],
                 rings: list[int | None], capacity: int, slots: int, dtype: torch.dtype, device: torch.device,
                 saved: list[torch.Tensor] | None = None):
        self.k, self.v = [static_buffer(t) for t in k], [static_buffer(t) for t in v]  # (views too: see cache.py)
        self.windows, self.rings, self._capacity = windows, rings, capacity
        self.dtype, self.device = dtype, torch.device(device)
        self._saved = saved or []  # ring checkpoints: per ring layer, its keys then its values
        self._rows = torch.arange(slots, device=self.device)
        self._views: dict[int, SlotKVCache] = {}

    @classmethod
    def allocate(cls, num_layers: int, slots: int, kv_heads, capacity: int, head_dim, dtype: torch.dtype,
                 device: torch.device, windows: list[int | None] | None = None, max_rows: int | None = None,
                 checkpoints: bool = False) -> "SlotKVCache":
        """Zeroed caches; ``kv_heads`` and ``head_dim`` one value or one per layer
        (:func:`~dflash_torch.cache.layer_shapes`); ``windows`` and ``max_rows`` as for
        :class:`~dflash_torch.cache.KVCache` (rings for sliding-window layers), with
        ``checkpoints`` a saved copy of each ring per slot."""
        windows = [None] * num_layers if windows is None else list(windows)
        rings = ring_sizes(windows, max_rows)
        k = [torch.zeros(slots, heads, n, hd, dtype=dtype, device=device)
             for (heads, hd), n in zip(layer_shapes(num_layers, kv_heads, head_dim), buffer_rows(rings, capacity))]
        v = [torch.zeros_like(t) for t in k]
        saved = [torch.zeros_like(t) for t, r in zip(k + v, rings + rings) if r is not None] if checkpoints else None
        return cls(k, v, windows, rings, capacity, slots, dtype, device, saved)

    def first(self, n: int) -> "SlotKVCache":
        """A view of slots ``[0, n)`` (the same object for the same ``n``)."""
        if n not in self._views:
            self._views[n] = SlotKVCache([t[:n] for t in self.k], [t[:n] for t in self.v], self.windows, self.rings,
                                         self._capacity, n, self.dtype, self.device)
        return self._views[n]

    def slot(self, i: int) -> KVCache:
        """Slot ``i`` as a single-sequence :class:`KVCache` (views: writes land in this cache)."""
        return KVCache.of([t[i] for t in self.k], [t[i] for t in self.v], self.windows, self.rings, self._capacity,
                          self.dtype, self.device)

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[kv_heads, n * T, head_dim]`` (the rows of n sequences in
        order) at int64 ``positions`` ``[n, T]`` of slots ``[0, n)`` (in a ring: at
        ``positions % rows``)."""
        n, t = positions.shape
        if self.rings[layer] is not None:
            positions = torch.remainder(positions, self.k[layer].shape[2])
        index = (self._rows[:n, None], slice(None), positions)
        heads, _, hd = k.shape
        self.k[layer][index] = k.view(heads, n, t, hd).permute(1, 2, 0, 3)
        self.v[layer][index] = v.view(heads, n, t, hd).permute(1, 2, 0, 3)

    def view(self, layer: int, end: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[slots, kv_heads, end, head_dim]`` of positions ``[0, end)``; of a
        ring, its first ``min(end, rows)`` rows."""
        if end is None:
            return self.k[layer], self.v[layer]
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def _parts(self, end: int) -> list[tuple[torch.Tensor, slice]]:
        """Every buffer with the rows a slot's first ``end`` positions occupy (a ring's: all)."""
        rings = self.rings + self.rings
        parts = [(t, slice(None) if r is not None else slice(0, end)) for t, r in zip(self.k + self.v, rings)]
        return parts + [(t, slice(None)) for t in self._saved]

    def move(self, src: int, dst: int, end: int) -> None:
        """Copy positions ``[0, end)`` of slot ``src`` into slot ``dst`` (whole rings, and
        their checkpoints)."""
        for t, rows in self._parts(end):
            t[dst, :, rows] = t[src, :, rows]

    def swap(self, a: int, b: int, end: int) -> None:
        """Exchange positions ``[0, end)`` of slots ``a`` and ``b`` (whole rings, and their
        checkpoints)."""
        for t, rows in self._parts(end):
            t[[a, b], :, rows] = t[[b, a], :, rows]

    def save(self, slot: int) -> None:
        """Copy slot ``slot``'s rings into their checkpoints (nothing without rings or checkpoints)."""
        for t, c in zip(self._ringed(), self._saved):
            c[slot].copy_(t[slot])

    def restore(self, slot: int) -> None:
        """Copy slot ``slot``'s ring checkpoints back into its rings."""
        for t, c in zip(self._ringed(), self._saved):
            t[slot].copy_(c[slot])

    def snapshot(self, slot: int, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """A copy of slot ``slot``'s rings (what :meth:`save` copies: per ring layer, its keys
        ``[kv_heads, rows, head_dim]``, then its values), into ``out`` (a former snapshot's
        tensors, reused) where given -> the copies (empty without rings)."""
        return _copy_slot(self._ringed(), slot, out)

    def load(self, slot: int, tensors: list[torch.Tensor]) -> None:
        """Copy a :meth:`snapshot` back into slot ``slot``'s rings."""
        _load_slot(self._ringed(), slot, tensors)

    def _ringed(self) -> list[torch.Tensor]:
        return [t for t, r in zip(self.k + self.v, self.rings + self.rings) if r is not None]


class SlotRecurrentState:
    """The recurrent states of many sequences (hybrid targets): one
    :class:`~dflash_torch.cache.RecurrentState` of ``slots`` sequences, whose per-layer
    buffers ``conv[layer]`` ``[slots, kernel - 1, conv_dim]`` (model dtype) and
    ``ssm[layer]`` ``[slots, heads, d_k, d_v]`` (float32) hold one sequence per slot.

    :meth:`first` gives slots ``[0, n)`` as a state of n sequences (views), which a batched
    forward takes as its recurrent state: every linear-attention layer runs the n
    sequences at once, a verify stashes their block in it and the commit advances each
    over its own accepted rows. :meth:`slot` gives one slot as a state of one sequence
    (a prefill runs on it as on a single sequence).

    With ``checkpoints``, each slot also has a second copy of its state, written by
    :meth:`save` (the batch decoder saves a sequence's state at the end of its prompt) and
    read back by :meth:`restore`; :meth:`move` carries both.
    """

    def __init__(self, states: RecurrentState, checkpoints: RecurrentState | None = None):
        self.states, self.checkpoints = states, checkpoints
        self._first: dict[int, RecurrentState] = {}
        self._slots: dict[int, RecurrentState] = {}

    @classmethod
    def allocate(cls, target: TargetModel, slots: int, checkpoints: bool = False) -> "SlotRecurrentState":
        """Zero states of ``slots`` sequences for every linear-attention layer of ``target``
        (and as many checkpoint states, with ``checkpoints``)."""
        w = target.model.embed_tokens.weight
        banks = []
        for _ in range(2 if checkpoints else 1):
            states = RecurrentState(w.dtype, w.device, slots)
            for layer in target.model.layers:  # layer slots are handed out in layer order, as in new_cache
                if layer.kind == "linear_attention":
                    layer.linear_attn.new_state(states)
            banks.append(states)
        return cls(*banks)

    @property
    def conv(self) -> list[torch.Tensor]:
        return self.states.conv

    @property
    def ssm(self) -> list[torch.Tensor]:
        return self.states.ssm

    def slot(self, i: int) -> RecurrentState:
        """Slot ``i`` as a state of one sequence (views; the same object every call)."""
        if i not in self._slots:
            self._slots[i] = self.states.rows(i, i + 1)
        return self._slots[i]

    def first(self, n: int) -> RecurrentState:
        """Slots ``[0, n)`` as a state of n sequences (views; the same object for the same n)."""
        if n not in self._first:
            self._first[n] = self.states.rows(0, n)
        return self._first[n]

    def _tensors(self) -> list[torch.Tensor]:
        """Every per-slot buffer: the states', then the checkpoints'."""
        tensors = self.conv + self.ssm
        if self.checkpoints is not None:
            tensors += self.checkpoints.conv + self.checkpoints.ssm
        return tensors

    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src``'s states (and checkpoint) into slot ``dst`` (in place)."""
        for t in self._tensors():
            t[dst].copy_(t[src])

    def swap(self, a: int, b: int) -> None:
        """Exchange slots ``a`` and ``b``'s states (and checkpoints), in place."""
        for t in self._tensors():
            t[[a, b]] = t[[b, a]]

    def save(self, slot: int) -> None:
        """Copy slot ``slot``'s state into its checkpoint."""
        for t, c in zip(self.conv + self.ssm, self.checkpoints.conv + self.checkpoints.ssm):
            c[slot].copy_(t[slot])

    def restore(self, slot: int) -> None:
        """Copy slot ``slot``'s checkpoint back into its state."""
        for t, c in zip(self.conv + self.ssm, self.checkpoints.conv + self.checkpoints.ssm):
            t[slot].copy_(c[slot])

    def snapshot(self, slot: int, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """A copy of slot ``slot``'s state (what :meth:`save` copies: every layer's ``conv``
        ``[kernel - 1, conv_dim]``, then its ``ssm`` ``[heads, d_k, d_v]``), into ``out`` (a
        former snapshot's tensors, reused) where given -> the copies."""
        return _copy_slot(self.conv + self.ssm, slot, out)

    def load(self, slot: int, tensors: list[torch.Tensor]) -> None:
        """Copy a :meth:`snapshot` back into slot ``slot``'s state."""
        _load_slot(self.conv + self.ssm, slot, tensors)


@dataclass(frozen=True)
class RoundShape:
    """The shape of a decoding round (:attr:`BatchDecoder.last_round`), what a compiled
    round's graphs are built for: ``rows`` (the batch bucket) x ``block`` x ``keys``."""

    sequences: int  # sequences that decoded in it
    rows: int  # its rows: the batch bucket of ``sequences`` (fixed shapes), padding rows included
    block: int  # its block size: ``block_size``, or 1 in a target-only round
    keys: int  # the keys it attended over: the length bucket (fixed shapes)


@dataclass
class _Sequence:
    """One live sequence (its slot is its index in ``BatchDecoder._seqs``)."""

    seq_id: Hashable
    params: SamplingParams
    generator: torch.Generator | None
    max_new_tokens: int
    s: int  # position of ``token``: committed, its features not yet known
    token: torch.Tensor  # 0-dim int64
    committed: int
    pending: torch.Tensor | None = None  # the last verify's B feature rows (inject at the next propose)
    pending_start: int = 0  # position of pending row 0
    pending_rows: int = 0  # rows of ``pending`` that were accepted (tau)
    backlog: list[torch.Tensor] = field(default_factory=list)  # target-only rounds' feature rows, not yet injected
    backlog_start: int = 0  # position of the backlog's first row
    ids: list[int] = field(default_factory=list)  # prompt + committed tokens (ids[s] is ``token``)
    prompt_len: int = 0  # tokens of its prompt
    saved_at: int = 0  # a hybrid / ring target's slot checkpoint holds its recurrent state / rings at this position
    prompt_logits: torch.Tensor | None = None  # [V] its prompt's last logits (reuse_prefix: an identical prompt reuses them)
    padded: bool = False  # ran a round past its budget (as padding): its slot is not retained
    processor: LogitsProcessor | None = None  # what processes its logits (bias, penalties, min_tokens), if anything

    @property
    def done(self) -> bool:
        return self.committed >= self.max_new_tokens


@dataclass
class _Retained:
    """A retained prefix (prompt-prefix reuse): its slot's rows of positions ``[0, len(ids))``
    are valid for the token ids ``ids``. Those of a prefill left midway
    (:meth:`BatchDecoder._retain_read`) have ``prompt_len == saved_at == len(ids)`` and no
    ``prompt_logits`` (so they are never "the same prompt again")."""

    ids: list[int]
    used: int  # when it was made or last reused (BatchDecoder._tick): the least recent is dropped first
    prompt_len: int = 0  # tokens of the prompt the rows began with
    prompt_logits: torch.Tensor | None = None  # [V] the target's logits at the end of that prompt (None: never read)
    saved_at: int = 0  # hybrid / ring targets: the slot's checkpoint holds the state / rings at this position


@dataclass
class _Joining:
    """A sequence whose prompt is being prefilled between rounds (:meth:`BatchDecoder.join`)."""

    seq_id: Hashable
    params: SamplingParams
    generator: torch.Generator | None
    max_new_tokens: int
    ids: torch.Tensor  # the prompt, int64 [P]
    prompt: list[int]  # the same, as given (to find sharers)
    prefilled: int = 0  # prompt tokens read so far (in the slot after the decoding sequences)
    reused: int = 0  # of which taken from a retained prefix
    prefill_time: float = 0.0  # seconds of its chunks so far
    sharers: list[_Joining] = field(default_factory=list)  # same prompt: copies of its prefill
    prompt_logprobs: int | None = None  # alternatives per prompt token to report (None: none)
    scored: list | None = None  # with prompt_logprobs: the prompt logprobs of the chunks read so far
    checkpoint: int | None = None  # where its slot's checkpoint is to be taken (see BatchDecoder.add)
    saved_at: int = 0  # where it is taken (set when its prefill starts)
    shared_end: int | None = None  # where its shared start ends (see BatchDecoder.add)
    snap_at: int | None = None  # where its prefill snapshots that start (set when its prefill starts; None: nowhere)

    @property
    def slots(self) -> int:
        """Slots it holds: its own and its sharers'."""
        return 1 + len(self.sharers)


def _exclusive(method):
    """A public step of :class:`BatchDecoder` (``add``, ``join``, ``remove``, ``step``), one at a
    time: refused from another thread while the compute thread runs an engine call
    (:func:`~dflash_torch.compute.check_caller`), and while another thread is inside a step of
    the same decoder (two steps at once changed each other's caches: an engine's
    ``generate_batch`` started during a prefill driven from another thread died with a bare
    ``KeyError``)."""
    name = f"BatchDecoder.{method.__name__}"

    @functools.wraps(method)
    def one_at_a_time(self, *args, **kwargs):
        compute.check_caller(name)
        if not self._stepping.acquire(blocking=False):
            raise DFlashError(f"{name} was called while another thread is inside a call of this BatchDecoder, which "
                              "decodes one call at a time: drive every call of it through dflash_torch.compute.run (the "
                              "other thread's too), which runs them in turn")
        try:
            return method(self, *args, **kwargs)
        finally:
            self._stepping.release()

    return one_at_a_time


class BatchDecoder:
    """DFlash speculative decoding of up to ``max_batch_size`` sequences per round.

    Args:
        target: the target model (pure attention or hybrid).
        drafter: a DFlash (or DFlash 2) drafter, or None for batched target-only decoding.
        block_size: tokens per block B (default: the drafter's); 1 = target-only.
        max_batch_size: sequences held at once (slots).
        max_context: longest prompt + generation per sequence (tokens); default: the
            target's context (:func:`~dflash_torch.options.target_context`).
        prefill_chunk: prompt tokens per prefill forward (one above ``max_context`` is taken
            as ``max_context``).
        prefill_budget: prompt tokens of joining sequences (:meth:`join`) prefilled per
            :meth:`step`, in whole chunks, at least one chunk per step (default
            ``prefill_chunk``): bounds what a joining prompt adds to a round's time.
        static: fixed-shape rounds: the N sequences run as a batch bucket (the smallest
            power of two >= N, capped at ``max_batch_size``; padding rows decode a
            dummy block in free slots, or past a joining sequence's partly read prompt,
            and are ignored) over a length bucket of keys
            (:meth:`kv_bucket`). Implied by ``compile``; prefills stay eager.
        compile: wrap propose and verify with ``torch.compile`` (one graph per batch
            bucket x length bucket, built the first time a round needs it; one that torch
            fails to build raises :class:`~dflash_torch.errors.CompileError`, as does, when the
            decoder is made, a compile cache directory torch cannot create).
        compile_backend: torch.compile backend (default "inductor").
        share_prefill: a sequence joining with the prompt of one still waiting or being
            prefilled shares its prefill (a copy of its slot) instead of reading the prompt
            again (default True; False: every sequence reads its own prompt).
        reuse_prefix: keep a leaving sequence's rows in a free slot and let a prompt that
            starts with its tokens reuse them (see the module docstring; default True;
            False: every prompt is read whole).
        prefix_slots: slots beyond ``max_batch_size`` that hold only retained prefixes (no
            sequence decodes there), so that more conversations than sequences held keep
            their rows (default 0: only the free slots keep them); each costs a slot's caches.
        shared_starts: the most snapshots of shared prompt starts kept (see :meth:`add`'s
            ``shared_end``; an integer >= 0, default :data:`SHARED_STARTS`; 0: none, so a
            prompt shares only a retained prefix's whole rows or its checkpoint's): with
            ``reuse_prefix`` on a hybrid or sliding-window model, each costs one slot's
            checkpoint (its recurrent state and rings), allocated when first taken; other
            models share any common start without snapshots, and ignore it.
        draft_max_batch_size: a round of more than this many sequences runs target-only: each
            sequence's block is its one committed token; ``"auto"``: each round drafts or
            not by the measured goodput of both kinds of rounds at its number of sequences
            (:class:`~dflash_torch.draft_policy.DraftPolicy`). The verified rows' features are
            kept per sequence and injected into its drafter context in one pass when it
            drafts again, leaves with its rows retained, or has :data:`BACKLOG_ROWS` of
            them, so drafting resumes, with a whole context, when fewer sequences are held. Where a verify's cost grows with its rows (a
            CPU, a large batch on a GPU), many sequences decode faster without drafts (as
            vLLM's ``speculative_disable_by_batch_size``). None (default): always draft.

    Attributes:
        prefill_tokens: prompt tokens read by the target so far (every prefill chunk's rows).
        reused_prefill_tokens: prompt tokens taken from retained prefixes instead (not read).
        target_only_rounds: rounds run without drafts (more than ``draft_max_batch_size``
            sequences decoded, or the ``"auto"`` policy chose so).
        policy: the :class:`~dflash_torch.draft_policy.DraftPolicy` of ``"auto"``, else None.
        last_round: the :class:`RoundShape` of the last decoding round (None before the first):
            what a round that built graphs (a compiled decoder past its warm-up) was built for.
        shared_starts: the most snapshots of shared prompt starts kept (the ``shared_starts``
            given with ``reuse_prefix`` on a hybrid or sliding-window model, else 0; see
            :meth:`add`'s ``shared_end``).

    The caches (``max_batch_size + prefix_slots`` slots of ``max_context + max(2 B,
    prefill_chunk) + 1`` positions, target and drafter) are allocated here, once. With
    ``reuse_prefix`` on a hybrid or sliding-window model, each slot also keeps a checkpoint
    of its recurrent state and rings, and the decoder up to :attr:`shared_starts` snapshots
    of them at shared prompt starts (``shared_end`` of :meth:`add`): the memory check counts
    both; the snapshots are allocated when first taken.

    Raises:
        DFlashError: a target or drafter that is not one, or a drafter in another dtype or on another
            device than the target (:func:`~dflash_torch.decoding.check_models`),
            invalid block size (above 64 for a hybrid target) / max_batch_size /
            max_context / prefill_budget / prefix_slots (nonzero with reuse_prefix off) /
            shared_starts (not an integer >= 0, or other than :data:`SHARED_STARTS` with
            reuse_prefix off) /
            draft_max_batch_size (any but None without a
            drafter or with block size 1: no round drafts), a flag that is not a bool, or
            caches that do not fit the device's free memory.
    """

    def __init__(self, target: TargetModel, drafter: DFlashDrafter | None = None, block_size: int | None = None,
                 max_batch_size: int = 8, max_context: int | None = None, prefill_chunk: int = 256,
                 static: bool = False, compile: bool = False, compile_backend: str = "inductor",
                 prefill_budget: int | None = None, share_prefill: bool = True, reuse_prefix: bool = True,
                 draft_max_batch_size: int | None = None, prefix_slots: int = 0,
                 shared_starts: int = SHARED_STARTS):
        check_models(target, drafter)
        self._stepping = threading.Lock()  # (held by the public step running: see _exclusive)
        trained = drafter.config.block_size if drafter is not None else None
        B = check_block_size(block_size, trained, context=context_limit(target.config)) or trained or 1
        # hybrid targets: a verify leaves the recurrent states as they were; each sequence's
        # accepted prefix is committed into its own state afterwards (their rollback)
        self.defer_commit = target.recurrent and B > 1
        if self.defer_commit and B > CHUNK:
            raise DFlashError(f"block size {B} exceeds {CHUNK}, the longest verify block of a hybrid target")
        self.target, self.drafter, self.block_size = target, drafter, B
        self.max_batch_size = check_max_batch_size(max_batch_size)
        self.max_context = check_max_context(max_context, target.config)
        self._context_given = max_context is not None  # (refusals name the target's context otherwise)
        given_chunk = check_count(prefill_chunk, "prefill_chunk")
        self.prefill_chunk = prefill_chunk = min(given_chunk, self.max_context)  # (as SpeculativeDecoder's)
        self.share_prefill = check_flag(share_prefill, "share_prefill")
        self.reuse_prefix = check_flag(reuse_prefix, "reuse_prefix")
        self.prefix_slots = check_prefix_slots(prefix_slots, self.reuse_prefix)
        shared_starts = check_shared_starts(shared_starts, self.reuse_prefix)
        self.slots = self.max_batch_size + self.prefix_slots  # (those past max_batch_size hold retained prefixes only)
        self.draft_max_batch_size = check_draft_max_batch_size(draft_max_batch_size, drafter=drafter is not None,
                                                               block_size=B)
        self.policy = DraftPolicy() if self.draft_max_batch_size == "auto" else None
        self.prefill_tokens = 0
        self.reused_prefill_tokens = 0
        self.target_only_rounds = 0
        self.last_round: RoundShape | None = None
        self.prefill_budget = prefill_chunk if prefill_budget is None else check_max_batch_size(prefill_budget,
                                                                                               "prefill_budget")
        self.device = target.model.embed_tokens.weight.device
        self.feature_layers = drafter.feature_layers(target) if drafter is not None and B > 1 else None
        capacity, max_rows, draft_rows = cache_sizes(self.max_context, prefill_chunk, B)
        drafts = drafter if self.feature_layers is not None else None
        # a hybrid target's recurrent state, and the rings of sliding-window layers, are known where last
        # written only: each slot keeps a copy of them at its prompt's end (prefix reuse)
        rings = any(ring_sizes(target.kv_windows(), max_rows))
        rings = rings or (drafts is not None and any(ring_sizes(drafts.kv_windows(), draft_rows)))
        self._resumable_only = target.recurrent or rings
        checkpoints = self._resumable_only and self.reuse_prefix
        # snapshots of shared prompt starts (key: their token ids): [target rings, drafter rings, recurrent state]
        self.shared_starts = shared_starts if checkpoints else 0
        self._starts: OrderedDict[tuple[int, ...], list[list[torch.Tensor]]] = OrderedDict()
        need = cache_bytes(target, drafts, self.slots, capacity, max_rows, checkpoints, draft_rows, self.shared_starts)
        free = available_memory(self.device)
        if free is not None and need > 0.9 * free:
            def need_of(context: int) -> int:  # (the caches of a max_context, sized as above)
                n, rows, drafts_rows = cache_sizes(context, given_chunk, B)
                return cache_bytes(target, drafts, self.slots, n, rows, checkpoints, drafts_rows, self.shared_starts)

            most = most_that_fits(need_of, self.max_context, 0.9 * free)
            raise self._caches_error("", f" need {memory_text(need, True)} but {self.device.type} has "
                                         f"{memory_text(free, True)} free", most)
        w = target.model.embed_tokens.weight
        heads, dims = zip(*target.kv_shapes()) if target.num_kv_layers else ((), ())
        try:
            self.target_kv = SlotKVCache.allocate(target.num_kv_layers, self.slots, heads, capacity, dims,
                                                  w.dtype, self.device, target.kv_windows(), max_rows, checkpoints)
            self.target_state = (SlotRecurrentState.allocate(target, self.slots, checkpoints)
                                 if target.recurrent else None)
            self.draft_kv = None
            if drafts is not None:
                d = drafter.config
                self.draft_kv = SlotKVCache.allocate(d.num_hidden_layers, self.slots, d.num_key_value_heads,
                                                     capacity, d.head_dim, drafter.fc.weight.dtype, self.device,
                                                     drafter.kv_windows(), draft_rows, checkpoints)
        except torch.OutOfMemoryError:
            raise self._caches_error("out of memory allocating ") from None
        self._seqs: list[_Sequence] = []  # decoding, slot = index
        self._joining: deque[_Joining] = deque()  # prefilling, FIFO; the head's slot is len(self._seqs)
        self._retained: dict[int, _Retained] = {}  # slot -> retained prefix (only in slots no sequence uses)
        self._tick = 0
        self._arange_block = torch.arange(B, device=self.device)
        self._arange_chunk = torch.arange(prefill_chunk, device=self.device)
        mask_id = drafter.config.mask_token_id if drafter is not None else 0
        self._mask_tail = torch.full((max(B - 1, 0),), mask_id, dtype=torch.long, device=self.device)
        self.static = static or compile
        self.graphed = compile and self.device.type == "cuda"  # mode "reduce-overhead": CUDA graphs
        # one cache view object per batch size (a compiled step sees the same objects every round)
        self._target_views: dict[int, TargetCache] = {}
        self._draft_views: dict[int, InjectedContext] = {}
        self._draft_fn, self._verify_fn = self._draft_step, self._verify_step
        if self.device.type == "cuda" and not compile:
            self._draft_fn, self._verify_fn = without_shape_plans(self._draft_step), without_shape_plans(self._verify_step)
        if compile:
            opts = dict(dynamic=False, backend=compile_backend)
            if self.device.type == "cuda":
                opts["mode"] = "reduce-overhead"
            reserve_graphs(sum(len(v) for v in self._round_buckets().values()) * length_buckets(capacity))
            self._draft_fn = compile_step(self._draft_step, **opts)
            self._verify_fn = compile_step(self._verify_step, **opts)

    def _caches_error(self, head: str, detail: str = "", most: int = 0) -> OptionError:
        """The refusal of caches too large for the device, naming the options that size them
        (and ``most``, where not 0: the largest max_context whose caches fit these slots);
        ``shared_starts`` too where it asks for more snapshots than :data:`SHARED_STARTS`."""
        slots = f"max_batch_size {self.max_batch_size}" + (f" + prefix_slots {self.prefix_slots}" if self.prefix_slots else "")
        names = ("max_batch_size", "prefix_slots", "max_context") if self.prefix_slots else ("max_batch_size", "max_context")
        caches = context_caches(self.max_context, self._context_given)
        snapshots = ""
        if self.shared_starts > SHARED_STARTS:
            snapshots, names = f" + shared_starts {self.shared_starts} snapshots", (*names, "shared_starts")
        return OptionError(f"{head}the caches of {slots} x {caches}{snapshots}{detail}; "
                           f"lower {'one of them' if len(names) > 2 else 'either'}"
                           + (f" (at most {most} tokens of context fit these slots in 90% of that)" if most else ""),
                           *names)

    def batch_bucket(self, n: int) -> int:
        """Rows of a round of ``n`` sequences: ``n``, or with fixed shapes the smallest
        power of two >= n, capped at ``max_batch_size``."""
        if not self.static:
            return n
        b = 1
        while b < n:
            b *= 2
        return min(b, self.max_batch_size)

    def round_block(self, n: int) -> int:
        """Block size of the next round of ``n`` sequences: ``block_size``, or 1
        (target-only) above a numeric ``draft_max_batch_size`` or where the ``"auto"``
        policy says so."""
        if self.policy is not None:
            return self.block_size if self.policy.draft(n) else 1
        return max(self._blocks(n))

    def _blocks(self, n: int) -> set[int]:
        """The block sizes rounds of ``n`` sequences may run."""
        d, B = self.draft_max_batch_size, self.block_size
        if d == "auto":
            return {B, 1}
        return {1} if d is not None and n > d else {B}

    def _round_buckets(self) -> dict[int, list[int]]:
        """Block size -> the batch buckets of the rounds that run it, increasing."""
        out: dict[int, set[int]] = {}
        for n in range(1, self.max_batch_size + 1):
            for b in self._blocks(n):
                out.setdefault(b, set()).add(self.batch_bucket(n))
        return {b: sorted(v) for b, v in out.items()}

    def kv_bucket(self, n: int) -> int:
        """Keys to attend over when ``n`` positions must be visible: ``n``, or with fixed
        shapes the smallest power of two >= max(n, 256), capped at the cache capacity."""
        return kv_bucket(n, self.target_kv.capacity) if self.static else n

    @torch.inference_mode()
    def warmup(self, context: int | None = None) -> int:
        """Run a dummy round at every batch bucket and every length bucket that the rounds
        of a sequence of up to ``context`` tokens (prompt + generated; default: the whole
        cache) reach, so that a compiled decoder builds those graphs now rather than in a
        request. A round reads a block past its start, so the last rounds of a 256-token
        sequence reach the 512-key bucket (as :meth:`SpeculativeDecoder.warmup
        <dflash_torch.decoding.SpeculativeDecoder.warmup>` counts them). Only while no
        sequence is held (it writes into every slot). An eager decoder (not fixed shapes)
        runs none: it has no shapes to prepare (each length is one of its own), and one
        round per length would take minutes.

        Args:
            context: tokens, capped at the cache's capacity; None: the whole cache.

        Returns:
            the rounds run (0 for an eager decoder).

        Raises:
            DFlashError: sequences are held.
        """
        if self._seqs or self._joining:
            raise DFlashError("warmup() needs an empty batch (it overwrites every slot)")
        if not self.static:
            return 0
        self._retained.clear()
        cap, runs = self.target_kv.capacity, 0
        for B, sizes in self._round_buckets().items():
            # a round of a sequence of up to `context` tokens starts at a position below it and
            # reads a block past it: up to context - 1 + B keys (as SpeculativeDecoder.warmup's)
            last = min((context or cap) - 1 + B, cap)
            lengths = sorted({self.kv_bucket(n) for n in range(B, last + 1)})
            for rows in sizes:
                for kv_len in lengths:
                    positions = (kv_len - B) + self._arange_block[:B].expand(rows, B)  # the last block that fits
                    tokens = torch.zeros(rows, dtype=torch.long, device=self.device)
                    block = torch.zeros(rows, B, dtype=torch.long, device=self.device)
                    if B > 1:
                        feats = self.drafter.fc.weight.new_zeros(rows * B, self.drafter.fc.in_features)
                        self._draft_fn(tokens, positions, feats, positions.clone(), kv_len, self._views(rows)[1])
                    live = (torch.ones(rows, dtype=torch.bool, device=self.device)
                            if self.target_state is not None else None)
                    self._verify(block, positions, kv_len, live)
                    runs += 1
        return runs

    def _views(self, n: int) -> tuple[TargetCache, InjectedContext | None]:
        if n not in self._target_views:
            state = self.target_state.first(n) if self.target_state is not None else None
            self._target_views[n] = TargetCache(self.target_kv.first(n), state)
            if self.draft_kv is not None:
                self._draft_views[n] = InjectedContext(self.drafter, self.draft_kv.first(n))
        return self._target_views[n], self._draft_views.get(n)

    # --- the step-level API ---

    @property
    def takes_checkpoint(self) -> bool:
        """Whether the ``checkpoint`` (and ``shared_end``) of :meth:`add` / :meth:`join` takes
        effect: prefix reuse on a hybrid or sliding-window model (whose slot checkpoints, and
        snapshots of shared starts, they place)."""
        return self.reuse_prefix and self._resumable_only

    @property
    def free_slots(self) -> int:
        """Sequences that can still be added or joined."""
        return self.max_batch_size - len(self._seqs) - sum(q.slots for q in self._joining)

    @property
    def seq_ids(self) -> list[Hashable]:
        """Ids of the sequences held: the decoding ones in slot order, then the joining ones
        in their prefill order (each followed by those sharing its prefill)."""
        return [q.seq_id for q in self._seqs] + [q.seq_id for q in self._joiners()]

    def __contains__(self, seq_id: Hashable) -> bool:
        return any(q.seq_id == seq_id for q in self._seqs) or any(q.seq_id == seq_id for q in self._joiners())

    def _joiners(self):
        """Every joining sequence: each in the queue, then those sharing its prefill."""
        for q in self._joining:
            yield q
            yield from q.sharers

    def _check_new(self, seq_id: Hashable, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
                   prompt_logprobs: int | None = None, checkpoint: int | None = None,
                   shared_end: int | None = None) -> int:
        """The checks of :meth:`add` / :meth:`join` -> the prompt's length."""
        check_prompt_logprobs(prompt_logprobs)
        check_prompt_position(checkpoint, len(prompt_ids), "checkpoint")
        check_prompt_position(shared_end, len(prompt_ids), "shared_end")
        if not isinstance(params, SamplingParams):
            raise DFlashError(f"params must be a SamplingParams, got {type(params).__name__}")
        try:
            hash(seq_id)
        except TypeError:  # (a round keys its results by it)
            raise DFlashError(f"seq_id must be hashable (e.g. an int or a str), got {type(seq_id).__name__}") from None
        if seq_id in self:
            raise DFlashError(f"sequence {seq_id!r} is already in the batch")
        if not self.free_slots:
            raise DFlashError(f"the batch is full ({self.max_batch_size} sequences)")
        check_max_new_tokens(max_new_tokens)
        params.check_vocab(self.target.config.vocab_size)
        return check_prompt_ids(prompt_ids, self.target.config, max_new_tokens, self.max_context)

    @_exclusive
    @torch.inference_mode()
    def add(self, seq_id: Hashable, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
            prompt_logprobs: int | None = None, checkpoint: int | None = None,
            shared_end: int | None = None) -> Round:
        """Take a sequence into a free slot and run its whole prefill (alone, now; ahead of
        any sequence still joining).

        Args:
            seq_id: any hashable id, unique among the sequences held.
            prompt_ids: the prompt's token ids (at least one).
            params: sampling parameters; a seed gives the same tokens as decoding alone.
            max_new_tokens: the sequence's token budget (>= 1); rounds stop decoding it
                once it has committed that many (the last round may commit more: the
                caller cuts, as with :meth:`SpeculativeDecoder.rounds`).
            prompt_logprobs: None (default) or k in [0, 20]: the prefill round's
                ``prompt_logprobs`` (every prompt token scored by the prefill's own logits;
                the prompt is then read whole, see the module docstring).
            checkpoint: None (default) or a position in ``(0, len(prompt_ids)]``: where a
                hybrid or sliding-window model (with ``reuse_prefix``) keeps its slot's
                checkpoint, instead of the prompt's end, when its prefill reads that position
                (as :meth:`SpeculativeDecoder.rounds`' ``checkpoint``): where a chat's
                messages end, before the template's opening of the reply, so that the next
                turn reuses the history even where the template renders the reply otherwise.
                No effect on other models, nor on the tokens.
            shared_end: None (default) or a position in ``(0, len(prompt_ids)]``: where a
                start that other prompts may share ends (a chat's leading system messages,
                tools rendered in them: :meth:`~dflash_torch.engine.DFlashEngine.shared_end`).
                A hybrid or sliding-window model (with ``reuse_prefix``) whose prefill reads
                that position (before the prompt's end) ends a chunk there and keeps a
                snapshot of its recurrent state and rings for those token ids, unless one is
                kept already (at most :attr:`shared_starts`, the least recently used
                dropped), so that a later prompt with that start, another conversation's,
                takes it from a retained prefix that holds it (see the module docstring).
                No effect on other models, nor on the tokens.

        Returns:
            the prefill's :class:`~dflash_torch.decoding.Round` (one committed token).

        Raises:
            DFlashError: ``params`` not a :class:`SamplingParams`, no free slot, a duplicate
                ``seq_id``, an empty prompt, token ids outside the vocabulary (``params``'
                min_tokens with min_tokens_ids that cover it all:
                :meth:`~dflash_torch.sampling.SamplingParams.check_vocab`), prompt +
                ``max_new_tokens`` beyond ``max_context``, or an invalid ``checkpoint`` or
                ``shared_end``; a call
                from another thread while the compute thread runs an engine call
                (:func:`~dflash_torch.compute.check_caller`: drive this decoder through
                :func:`~dflash_torch.compute.run`).
        """
        n_prompt = self._check_new(seq_id, prompt_ids, params, max_new_tokens, prompt_logprobs, checkpoint, shared_end)
        t0 = time.perf_counter()
        slot = len(self._seqs)
        head = self._joining[0] if self._joining else None
        if head is not None and head.prefilled:  # a partly prefilled joiner holds this slot: one up
            self._move(slot, slot + 1, head.prefilled)
        prompt = [int(t) for t in prompt_ids]
        scored = None if prompt_logprobs is None else []
        start, last = self._take_prefix(slot, prompt, reuse=scored is None)
        saved_at = self._saved_at(checkpoint, start, n_prompt) if last is None else n_prompt
        if last is None:
            ids, read = torch.tensor(prompt, dtype=torch.long, device=self.device), start
            snap_at = self._snap_at(shared_end, start, prompt)
            for stop in sorted({p for p in (saved_at, snap_at) if p is not None and p < n_prompt}):
                if read < stop:  # (a prefill ends a chunk at the checkpoint and at the shared start's end)
                    self._prefill(slot, ids[:stop], read, scored, prompt, prompt_logprobs or 0)
                    read = stop
                if stop == saved_at:
                    self._save(slot)
                if stop == snap_at:
                    self._snapshot(slot, prompt[:stop])
            last = self._prefill(slot, ids, read, scored, prompt, prompt_logprobs or 0)
        generator = params.generator(self.device)
        token, processor = first_token(last, prompt, params, generator)
        first = int(token)
        if saved_at == n_prompt:
            self._save(slot)  # (the state at the prompt's end: a later prompt may diverge after it)
        self._seqs.append(_Sequence(seq_id, params, generator, max_new_tokens, n_prompt, token, 1, ids=prompt + [first],
                                    prompt_len=n_prompt, prompt_logits=self._keep_logits(last), processor=processor,
                                    saved_at=saved_at))
        logprobs = first_logprobs(last, first, params)
        t1 = time.perf_counter()
        return Round([first], None, 0.0, t1 - t0, t1 - t0, cached_tokens=start, logprobs=logprobs,
                     prompt_logprobs=scored, **Round.processed(processor))

    @_exclusive
    def join(self, seq_id: Hashable, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
             prompt_logprobs: int | None = None, checkpoint: int | None = None,
             shared_end: int | None = None) -> None:
        """Take a sequence into a free slot; its prompt is prefilled by the next
        :meth:`step` s, in chunks, after their rounds: joining sequences take turns in
        arrival order, ``prefill_budget`` prompt tokens per step (a step without a round
        prefills the first of them to its end, unless its ``stop`` says otherwise). The step
        that reads the last chunk returns the sequence's prefill
        :class:`~dflash_torch.decoding.Round` (its first token; ``verify_time`` = its
        chunks' time), and the sequence decodes from the next step on.

        With ``share_prefill``, a prompt equal to that of a sequence still joining is not
        read again: the sequence shares that prefill (see the module docstring) and its
        prefill round comes in the same step as that sequence's (with ``prompt_logprobs``,
        only a sequence that asks for the same number shares).

        Args and raises: as :meth:`add`.
        """
        self._check_new(seq_id, prompt_ids, params, max_new_tokens, prompt_logprobs, checkpoint, shared_end)
        prompt = [int(t) for t in prompt_ids]
        leader = next((q for q in self._joining if q.prompt == prompt and q.prompt_logprobs == prompt_logprobs),
                      None) if self.share_prefill else None
        ids = leader.ids if leader is not None else torch.tensor(prompt, dtype=torch.long, device=self.device)
        q = _Joining(seq_id, params, params.generator(self.device), max_new_tokens, ids, prompt,
                     prompt_logprobs=prompt_logprobs, scored=None if prompt_logprobs is None else [],
                     checkpoint=checkpoint, shared_end=shared_end)
        if leader is not None:
            leader.sharers.append(q)
        else:
            self._joining.append(q)

    @_exclusive
    def remove(self, seq_id: Hashable) -> None:
        """Drop a sequence, decoding or joining; its slot is free at once (the last decoding
        slot's sequence moves into it, and a partly prefilled joiner into that one; a
        joiner whose prefill others share hands it, and the part read, to the next of them;
        with ``reuse_prefix``, a leaving sequence's rows, and a partly prefilled joiner's
        whole chunks read on a target whose caches can go back, stay as a retained prefix:
        see the module docstring).

        Raises:
            DFlashError: no such sequence; a call from another thread while the compute thread
                runs an engine call (as :meth:`add`).
        """
        if self._remove_joining(seq_id):
            return
        index = next((i for i, q in enumerate(self._seqs) if q.seq_id == seq_id), None)
        if index is None:
            raise DFlashError(f"sequence {seq_id!r} is not in the batch")
        if self.reuse_prefix:
            index = self._retain(index)
        last = len(self._seqs) - 1
        if index != last:
            moved = self._seqs[last]
            self._move(last, index, min(moved.s + self.block_size + 1, self.target_kv.capacity))
            self._seqs[index] = moved
        self._seqs.pop()
        if self._joining and self._joining[0].prefilled:
            self._move(last + 1, last, self._joining[0].prefilled)

    @torch.inference_mode()
    def _retain(self, index: int) -> int:
        """Keep the rows of the decoding sequence in slot ``index`` (about to leave) as a
        retained prefix -> the slot it now leaves from. Its last accepted feature rows are
        injected into its drafter context, then its slot is copied into a slot that stays
        unused once it has left (the highest without a retained prefix), or left in place
        when it is such a slot itself. Where every such slot holds a retained prefix, it
        trades slots with the last decoding sequence, whose slot is then the one left free
        and keeps it (no retained prefix is dropped); with a partly prefilled joiner to move
        there, the least recently used retained prefix gives way (none: nothing is kept)."""
        q = self._seqs[index]
        if q.padded:  # (its drafter rows may hold a stale injection)
            return index
        n, head = len(self._seqs), self._joining[0] if self._joining else None
        low = n + 1 if head is not None and head.prefilled else n  # slots from here on hold nothing live
        candidates = list(range(low, self.slots))
        empty = [i for i in candidates if i not in self._retained]
        if low == n and not empty:  # the last slot will be free: keep the rows there
            index = self._swap_last(index)
        if index == n - 1 and low == n:  # the last slot, which nothing moves into
            candidates.append(index)
            empty.append(index)
        if not candidates:
            return index
        dst = max(empty) if empty else min(candidates, key=lambda i: self._retained[i].used)
        self._park_pending(q, index)  # (what the next propose would have injected) ...
        self._flush(q, index)  # ... and what target-only rounds left
        if dst != index:
            self._move(index, dst, q.s)
        self._tick += 1
        self._retained[dst] = _Retained(q.ids[:q.s], self._tick, q.prompt_len, q.prompt_logits, q.saved_at)
        return index

    def _swap_last(self, index: int) -> int:
        """Exchange the decoding sequences of slot ``index`` and the last slot, with their
        rows (the last one's up to its round's end) and recurrent states -> the last slot."""
        last = len(self._seqs) - 1
        if index == last:
            return index
        q, moved = self._seqs[index], self._seqs[last]
        self._swap(index, last, min(max(q.s, moved.s + self.block_size + 1), self.target_kv.capacity))
        self._seqs[index], self._seqs[last] = moved, q
        return last

    def _take_prefix(self, slot: int, prompt: list[int], reuse: bool = True) -> tuple[int, torch.Tensor | None]:
        """Before a prompt's prefill in ``slot`` (the first slot no sequence uses): the rows
        of the retained prefix that match the most of ``prompt`` go into ``slot`` -> the
        prompt tokens they cover (0: none), counted in ``reused_prefill_tokens``, and when
        they cover it all (the same prompt again) the prompt's last logits ``[V]`` (else None).

        A prefix whose own prompt the prompt holds (the next turn of its conversation, a
        retry) is taken: kept in place, or copied (the copy left behind is not counted as
        used: the first to give way). One that shares less with it (another conversation's,
        sharing a system prompt; on a hybrid or sliding-window model, up to a shared start
        whose snapshot is kept, see :meth:`_usable`) is copied and stays retained, as used
        now. Where a decoding sequence's prompt shares more with it (:meth:`_live_usable`),
        those rows are copied from that sequence's slot instead (no retained prefix taken).
        A retained
        prefix that ``slot`` holds and that is not taken moves to a higher slot: an empty
        one, else it trades slots with a prefix taken (whose rows the prompt now holds), else
        it replaces the least recently used of the others (a prefix used in part too, by
        trading slots with it) if that one is older (else it is dropped). ``reuse`` False (a
        prompt whose every token must be read: prompt logprobs): no prefix is taken, a
        retained prefix in ``slot`` still moves up."""
        best, src = 0, None
        for i, r in (self._retained.items() if reuse else ()):
            n = self._usable(r, prompt)
            if n > best or (n == best and n and i == slot):
                best, src = n, i
        live, live_src = 0, None  # (a decoding sequence's prompt rows, if they give more)
        for i, q in enumerate(self._seqs if reuse and self.reuse_prefix else ()):
            n = self._live_usable(q, prompt)
            if n > max(best, live):
                live, live_src = n, i
        if live_src is not None:
            best, src = 0, None
        self._tick += 1
        kept = self._retained.get(src)
        taken = kept is not None and best >= min(kept.prompt_len, kept.saved_at)  # (the next turn, a retry)
        victim = self._retained.get(slot)  # (never where a partly read prompt was: add() moved it up one)
        if victim is not None and not (taken and src == slot):
            higher = [i for i in range(slot + 1, self.slots) if i != src]
            empty = [i for i in higher if i not in self._retained]
            if empty:
                dst = max(empty)
            elif taken:
                dst = src
            else:  # the least recently used of the others (the prefix used in part among them), if older
                others = higher + ([src] if kept is not None and src != slot else [])
                dst = min(others, key=lambda i: self._retained[i].used, default=None)
                dst = dst if dst is not None and self._retained[dst].used < victim.used else None
            if dst is not None and dst == src:  # the taken prefix's slot keeps the victim (and the prompt its rows)
                self._swap(slot, src, max(len(victim.ids), best))
                self._retained[src] = self._retained.pop(slot)
                src = slot
            elif dst is not None:
                self._move(slot, dst, len(victim.ids))
                self._retained[dst] = self._retained.pop(slot)
                src = dst if src == slot else src  # (a prefix used in part moves with its rows)
        if live_src is not None:
            self._move(live_src, slot, live)
            if self._resumable_only:
                self._load_start(slot, prompt[:live])
            self.reused_prefill_tokens += live
            return live, None
        if kept is None:
            return 0, None
        if not taken:
            kept.used = self._tick
        if src != slot:
            self._move(src, slot, best)  # (a copy: the prefix stays retained)
        else:
            self._retained.pop(slot, None)  # (its rows are the prompt's now)
        self._reuse(slot, kept, best, prompt)
        return best, kept.prompt_logits if best == len(prompt) else None

    def _saved_at(self, checkpoint: int | None, start: int, n_prompt: int) -> int:
        """Where a prompt of ``n_prompt`` tokens whose prefill starts at ``start`` (the rows
        reused) takes its slot's checkpoint: at ``checkpoint`` where one is given, the model
        takes checkpoints and the prefill reads that position, else at the prompt's end."""
        if self.takes_checkpoint and checkpoint is not None and start <= checkpoint:
            return checkpoint
        return n_prompt

    def _save(self, slot: int) -> None:
        """At the end of a prompt's prefill in ``slot``, with ``reuse_prefix``: keep a copy of
        what can only be resumed where it was last written (a hybrid target's recurrent
        state, a sliding-window target's rings), for a later prompt that diverges after it."""
        if self.reuse_prefix and self._resumable_only:
            for part in self._state_parts():
                if part is not None:
                    part.save(slot)

    def _snap_at(self, shared_end: int | None, start: int, prompt: list[int]) -> int | None:
        """Where a prompt whose prefill starts at ``start`` (the rows reused) snapshots its
        shared start (``shared_end``, see :meth:`add`): there, where the model keeps such
        snapshots, the prefill reads that position or starts there, before the prompt's end,
        and no snapshot of those token ids is kept yet; else None."""
        if (not self.shared_starts or shared_end is None or not start <= shared_end < len(prompt)
                or tuple(prompt[:shared_end]) in self._starts):
            return None
        return shared_end

    def _state_parts(self) -> list:
        """What a hybrid / ring target keeps only where last written: the target's rings, the
        drafter's rings, the target's recurrent state (each None where there is none)."""
        return [self.target_kv, self.draft_kv, self.target_state]

    def _snapshot(self, slot: int, ids: list[int]) -> None:
        """Keep a snapshot of ``slot``'s recurrent state and rings, which are those of the
        positions of the token ids ``ids``, for a later prompt that starts with them
        (:meth:`_usable`); the least recently used of :attr:`shared_starts` gives way (its
        tensors are reused)."""
        key = tuple(ids)
        if key in self._starts:
            self._starts.move_to_end(key)
            return
        out = None
        if len(self._starts) >= self.shared_starts:
            _, out = self._starts.popitem(last=False)
        self._starts[key] = [None if part is None else part.snapshot(slot, None if out is None else out[i])
                             for i, part in enumerate(self._state_parts())]

    def _reuse(self, slot: int, kept: _Retained, n: int, prompt: list[int]) -> None:
        """``slot`` holds the rows of retained prefix ``kept`` and ``prompt`` reuses the first
        ``n`` of them: where ``n`` is short of ``kept``'s length, a hybrid target's state and
        a sliding-window target's rings there go back to their checkpoint (``n`` is
        ``kept.saved_at``) or take the snapshot of ``prompt[:n]`` (a shared start, see
        :meth:`_usable`; as used now); counted."""
        if n < len(kept.ids) and self._resumable_only:
            if n == kept.saved_at:
                for part in self._state_parts():
                    if part is not None:
                        part.restore(slot)
            else:
                self._load_start(slot, prompt[:n])
        self.reused_prefill_tokens += n

    def _load_start(self, slot: int, ids: list[int]) -> None:
        """Load the kept snapshot of the shared start ``ids`` (:meth:`_snapshot`; as used now)
        into ``slot``'s recurrent state and rings (its attention rows of those positions are
        there already)."""
        key = tuple(ids)
        self._starts.move_to_end(key)
        for part, tensors in zip(self._state_parts(), self._starts[key]):
            if part is not None:
                part.load(slot, tensors)

    def _live_usable(self, q: _Sequence, prompt: list[int]) -> int:
        """Prompt tokens that decoding sequence ``q``'s slot can give ``prompt`` (a copy of
        its rows, the sequence going on): their common start within ``q``'s prompt (whose
        target K/V and drafter context rows its prefill wrote and no round rewrites), short
        of ``prompt``'s last token; on a hybrid or sliding-window model (whose state and rings
        in that slot are those of its last position) only up to the end of a shared start
        whose snapshot is kept, else 0. A sequence run as padding gives nothing."""
        if q.padded:
            return 0
        n = min(common_start(q.ids, prompt), q.prompt_len, len(prompt) - 1)
        return self._kept_start(prompt, n) if self._resumable_only else n

    def _usable(self, kept: _Retained, prompt: list[int]) -> int:
        """Prompt tokens that retained prefix ``kept`` can give ``prompt``: all of them when
        ``prompt`` is the prompt ``kept`` began with (its last logits were kept), else their
        common start, short of the prompt's last token. A hybrid target's recurrent state, and
        a sliding-window target's rings (which hold only the last positions written), are
        known at two positions only, the end of ``kept`` and ``kept.saved_at`` (its checkpoint:
        the end of the prompt it began with, or where that prompt's chat messages ended): the
        later of these that the common start reaches, or the end of a shared start whose
        snapshot is kept (:meth:`_snapshot`: the token ids of ``prompt[:p]``, which the
        common start covers) if later, or 0 (the same prompt again is reused whole only where
        one of the first two is its end)."""
        n = common_start(kept.ids, prompt)
        if (n == len(prompt) == kept.prompt_len and kept.prompt_logits is not None
                and (not self._resumable_only or n in (len(kept.ids), kept.saved_at))):
            return n  # the same prompt again: its last logits are kept too
        n = min(n, len(prompt) - 1)
        if self._resumable_only:
            m = next((m for m in (len(kept.ids), kept.saved_at) if m <= n), 0)
            return max(m, self._kept_start(prompt, n))
        return n

    def _kept_start(self, prompt: list[int], n: int) -> int:
        """The length of the longest shared start whose snapshot is kept (:meth:`_snapshot`)
        that ``prompt`` begins with, within its first ``n`` tokens; 0 where none is."""
        return max([0] + [len(key) for key in self._starts if len(key) <= n and key == tuple(prompt[:len(key)])])

    def _remove_joining(self, seq_id: Hashable) -> bool:
        """Drop a joining sequence, if ``seq_id`` is one -> whether it was. The first
        sequence sharing its prefill takes its place in the queue, with the part of the
        prompt already read in its slot; without one, the part read is kept there as a
        retained prefix (:meth:`_retain_read`), or else the slot's contents are dead (the
        next joiner starts from scratch there)."""
        for j, q in enumerate(self._joining):
            if q.seq_id == seq_id:
                if q.sharers:
                    heir = q.sharers.pop(0)
                    heir.sharers, heir.prefilled, heir.prefill_time = q.sharers, q.prefilled, q.prefill_time
                    heir.reused, heir.scored, heir.checkpoint, heir.saved_at = q.reused, q.scored, q.checkpoint, q.saved_at
                    heir.shared_end, heir.snap_at = q.shared_end, q.snap_at
                    self._joining[j] = heir
                else:
                    del self._joining[j]
                    if j == 0 and q.prefilled:  # (only the head is ever partly prefilled)
                        self._retain_read(q)
                return True
            for k, sharer in enumerate(q.sharers):
                if sharer.seq_id == seq_id:
                    del q.sharers[k]
                    return True
        return False

    def _retain_read(self, q: _Joining) -> None:
        """Keep the part of ``q``'s prompt that its slot (``len(self._seqs)``, the first slot
        no sequence uses) holds, ``q`` having left in its prefill (a server's request that
        went away), as a retained prefix there: the rows of its ``q.prefilled`` first
        positions (the whole chunks read, target K/V and drafter context both written, and
        the rows it reused), so that a retried request, or any prompt that starts with
        those tokens, reads only the rest. No logits come with them (the prompt's last one
        was never read), so the same prompt again still reads its last token. With
        ``reuse_prefix`` only, and only where the caches can go back (plain attention: a
        hybrid target's recurrent state and a sliding-window layer's rings are known where
        a prompt ended or was checkpointed only), as :class:`~dflash_torch.decoding.SpeculativeDecoder`
        keeps a prefill left midway. Where a retained prefix already holds these tokens
        (those the prompt reused), that one is kept (as used now) and nothing is added.
        The slot is where the next joiner's prefill starts: :meth:`_take_prefix` then takes
        these rows or moves them up as any retained prefix there; it holds no retained
        prefix before (a prefill's chunk or its taking one drops that), so none is dropped."""
        if not self.reuse_prefix or self._resumable_only:
            return
        ids = q.prompt[:q.prefilled]
        self._tick += 1
        held = next((r for r in self._retained.values() if r.ids[:len(ids)] == ids), None)
        if held is not None:
            held.used = self._tick
            return
        # (no prompt logits: never taken as "the same prompt again"; the prompt it began with is these
        # rows, so a prompt that holds them all takes them as a retry's, see _take_prefix)
        self._retained[len(self._seqs)] = _Retained(ids, self._tick, len(ids), None, len(ids))

    def _move(self, src: int, dst: int, end: int) -> None:
        """Copy slot ``src``'s positions ``[0, end)`` (and recurrent state) into slot ``dst``
        (a retained prefix there is dropped)."""
        self._retained.pop(dst, None)
        self.target_kv.move(src, dst, end)
        if self.draft_kv is not None:
            self.draft_kv.move(src, dst, end)
        if self.target_state is not None:
            self.target_state.move(src, dst)

    def _swap(self, a: int, b: int, end: int) -> None:
        """Exchange slots ``a`` and ``b``'s positions ``[0, end)`` (and recurrent states)."""
        self.target_kv.swap(a, b, end)
        if self.draft_kv is not None:
            self.draft_kv.swap(a, b, end)
        if self.target_state is not None:
            self.target_state.swap(a, b)

    @torch.inference_mode()
    @_exclusive
    def step(self, stop: Callable[[], bool] | None = None) -> dict[Hashable, Round]:
        """One decoding round for every decoding sequence whose budget is not used up,
        then the prefill of joining sequences (:meth:`join`) for at most ``prefill_budget``
        prompt tokens.

        Sequences that have used their budget and are still held run as padding (same
        positions every round, nothing committed) until the caller removes them.

        Args:
            stop: called between prefill chunks (after the first of the step): True ends the
                step's prefill there, and the next steps read the rest. A step without a
                round reads the first joining prompt to its end otherwise, so a caller that
                may want to remove it meanwhile (its client went away, Ctrl-C) says so here.

        Returns:
            ``{seq_id: Round}`` of the sequences decoded (``Round`` times are the whole
            batch's), and of the joining ones whose prefill ended (their first token); empty
            only when no sequence decodes or joins. One host sync per round.

        Raises:
            DFlashError: a call from another thread while the compute thread runs an engine
                call (as :meth:`add`).
        """
        rounds = self._round() if any(not q.done for q in self._seqs) else {}
        if self._joining:
            rounds.update(self._prefill_joining(bounded=bool(rounds), stop=stop))
        return rounds

    def _round(self) -> dict[Hashable, Round]:
        """The decoding round of :meth:`step`."""
        seqs = self._seqs
        n, dev = len(seqs), self.device
        B = self.round_block(n)  # (1: a target-only round)
        self.target_only_rounds += B < self.block_size
        rows = self.batch_bucket(n)  # rows past n: padding in free slots, at position 0 ...
        pad_starts = [0] * (rows - n)
        head = self._joining[0] if self._joining and self._joining[0].prefilled else None
        if head is not None and pad_starts:  # ... but slot n's past its partly read prompt (the next chunk overwrites it)
            pad_starts[0] = head.prefilled
        kv_len = self.kv_bucket(max([q.s for q in seqs] + pad_starts) + B)
        self.last_round = RoundShape(n, rows, B, kv_len)
        for j in range(len(pad_starts)):  # ... and a retained prefix's slot past its rows, if that fits kv_len
            kept = self._retained.get(n + j)
            if kept is not None:
                if len(kept.ids) + B <= kv_len:
                    pad_starts[j] = len(kept.ids)
                else:
                    del self._retained[n + j]
        t0 = time.perf_counter()
        live = None  # hybrid targets: the rows whose recurrent states move (padding rows' stay as they are)
        if self.target_state is not None:
            live = torch.tensor([not q.done for q in seqs] + [False] * (rows - n), device=dev)
        starts = torch.tensor([q.s for q in seqs] + pad_starts, device=dev)
        positions = starts[:, None] + self._arange_block[:B]  # [rows, B]
        tokens = torch.stack([q.token for q in seqs] + [self._arange_block[0]] * (rows - n))  # [rows]
        draft_probs = [None] * rows
        switch_time = 0.0  # seconds injecting what target-only rounds left (for the policy: a switch's cost)
        if B > 1:
            if any(q.backlog for q in seqs):
                t_flush = time.perf_counter()
                for i, q in enumerate(seqs):
                    self._flush(q, i)
                if self.policy is not None:
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)  # (rare: once per switch back to drafting)
                    switch_time = time.perf_counter() - t_flush
            drafts, draft_probs = self._propose(seqs, tokens, positions, kv_len, pad_starts)
            block = torch.cat([tokens[:, None], drafts], dim=1)  # [rows, B]
        else:
            block = tokens[:, None]
            for i, q in enumerate(seqs):
                self._park_pending(q, i)
        t1 = time.perf_counter()
        logits, feats = self._verify(block, positions, kv_len, live)
        accepted, bonus = self._accept(seqs, block, draft_probs, logits.view(rows, B, -1))
        if self.defer_commit and B > 1:
            if self.graphed:  # the stash out of the verify graph's pool (see SpeculativeDecoder._carry)
                self.target_state.first(rows).copy_stash()
            self._commit(live, accepted)
        out = torch.cat([accepted[:, None], block[:, 1:], bonus[:, None]], dim=1).tolist()  # the one host sync
        t2 = time.perf_counter()
        rounds = {}
        for i, q in enumerate(seqs):
            if q.done:  # padding: nothing moves
                q.padded = True
                continue
            a = out[i][0]
            if feats is not None and B == 1:
                self._park(q, i, feats[i:i + 1], q.s)
            elif feats is not None:
                q.pending, q.pending_start, q.pending_rows = feats[i * B:(i + 1) * B], q.s, a + 1
            q.s += a + 1
            q.committed += a + 1
            q.token = bonus[i]
            tokens = out[i][1:a + 1] + [out[i][-1]]
            q.ids += tokens
            logprobs = None
            if q.params.logprobs is not None:  # (its verify rows: the positions of its accepted and bonus tokens)
                logprobs = token_logprobs(logits[i * B:i * B + a + 1], tokens, q.params.logprobs)
            if q.processor is not None:
                q.processor.commit(tokens)
            rounds[q.seq_id] = Round(tokens, a + 1, t1 - t0, t2 - t1, 0.0, logprobs=logprobs,
                                     **Round.processed(q.processor))
        t3 = time.perf_counter()
        for r in rounds.values():
            r.total_time = t3 - t0
        if self.policy is not None:
            self.policy.record(n, B > 1, len(rounds), sum(r.acceptance_length for r in rounds.values()),
                               t3 - t0 - switch_time)
        return rounds

    def _prefill_joining(self, bounded: bool, stop: Callable[[], bool] | None = None) -> dict[Hashable, Round]:
        """Prefill joining sequences in order, whole chunks, while the step's budget lasts
        (``bounded``; else the first one to its end) and ``stop`` (see :meth:`step`) says
        nothing; each whose prompt is read joins the decoding sequences -> their prefill rounds."""
        rounds, used, C = {}, 0, self.prefill_chunk
        while self._joining:
            q, last, P = self._joining[0], None, self._joining[0].ids.shape[0]
            if not q.prefilled:
                if self._retained or self._seqs:
                    q.prefilled, last = self._take_prefix(len(self._seqs), q.prompt, reuse=q.scored is None)
                    q.reused = q.prefilled
                q.saved_at = self._saved_at(q.checkpoint, q.prefilled, P) if last is None else P
                q.snap_at = self._snap_at(q.shared_end, q.prefilled, q.prompt) if last is None else None
                if q.prefilled == q.saved_at < P:  # (reused up to the checkpoint)
                    self._save(len(self._seqs))
                if q.prefilled == q.snap_at:  # (reused up to the shared start's end)
                    self._snapshot(len(self._seqs), q.prompt[:q.snap_at])
            # (a chunk ends at the checkpoint, and at the shared start's end)
            end = min((p for p in (q.saved_at, q.snap_at) if p is not None and p > q.prefilled), default=P)
            n = min(C, end - q.prefilled)  # (0 when the prompt was reused whole)
            if n and used and (bounded or rounds) and used + n > self.prefill_budget:  # (a prompt reused whole reads 0)
                break
            if n and used and stop is not None and stop():
                break
            t0 = time.perf_counter()
            if last is None:
                logits = self._prefill_chunk(len(self._seqs), q.ids[:end], q.prefilled)
                if q.scored is not None:
                    q.scored += prompt_chunk_logprobs(logits, q.prompt, q.prefilled, q.prompt_logprobs)
                last = logits[-1]
            q.prefilled += n
            used += n
            if q.prefilled == q.saved_at < P:
                self._save(len(self._seqs))  # (see add; it moves with the slot)
            if n and q.prefilled == q.snap_at:
                self._snapshot(len(self._seqs), q.prompt[:q.snap_at])
            if q.prefilled < P:
                q.prefill_time += time.perf_counter() - t0
                continue
            self._joining.popleft()
            slot, kept_logits = len(self._seqs), self._keep_logits(last)
            if q.saved_at == P:
                self._save(slot)  # (see add; each sharer's slot gets a copy)
            for sharer in [q] + q.sharers:  # (slot's contents copied into each sharer's slot)
                if sharer is not q:
                    self._move(slot, len(self._seqs), q.prefilled)
                token, processor = first_token(last, q.prompt, sharer.params, sharer.generator)
                first = int(token)
                self._seqs.append(_Sequence(sharer.seq_id, sharer.params, sharer.generator, sharer.max_new_tokens,
                                            q.prefilled, token, 1, ids=q.prompt + [first], prompt_len=q.prefilled,
                                            prompt_logits=kept_logits, processor=processor, saved_at=q.saved_at))
                elapsed = q.prefill_time + time.perf_counter() - t0
                rounds[sharer.seq_id] = Round([first], None, 0.0, elapsed, elapsed, cached_tokens=q.reused,
                                              logprobs=first_logprobs(last, first, sharer.params),
                                              prompt_logprobs=None if q.scored is None else list(q.scored),
                                              **Round.processed(processor))
        return rounds

    # --- the parts of a round ---

    def _draft_step(self, tokens: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                    feature_positions: torch.Tensor, kv_len: int, context: InjectedContext):
        """propose: inject ``features`` ``[n * m, k * H]`` at ``feature_positions`` ``[n, m]`` (m <= B),
        then denoise the n blocks ``[token, mask, ...]`` at ``positions`` ``[n, B]`` -> the
        draft scores with a leading dimension n (no sampling parameter enters here)."""
        n, B = positions.shape
        block = torch.cat([tokens[:, None], self._mask_tail.expand(n, B - 1)], dim=1)
        # keys past a block's end are masked, except for one sequence in an eager round: it
        # sees every key (kv_len is its block's end), and attends without a mask, as alone
        mask_keys = self.static or n > 1
        hidden = self.drafter(self.drafter.embed(self.target, block.reshape(-1)), positions, context, kv_len, mask_keys=mask_keys,
                              inject=(features, feature_positions))
        return self.drafter.draft_scores(hidden.view(n, B, -1), tokens, self.target)

    def _verify(self, block: torch.Tensor, positions: torch.Tensor, kv_len: int, live: torch.Tensor | None):
        """The verify of a round's blocks ``[rows, B]``. ``live`` (bool ``[rows]``, hybrid
        targets): the rows whose recurrent states move; in a target-only round (no deferred
        commit) the others (finished sequences, padding, possibly in a joiner's slot)
        advance over 0 rows."""
        defer = self.defer_commit and block.shape[1] > 1
        commit = live.long() if live is not None and not defer else None
        return self._verify_fn(block.reshape(-1), positions, kv_len, self._views(positions.shape[0])[0], commit, defer)

    def _verify_step(self, block: torch.Tensor, positions: torch.Tensor, kv_len: int, cache: TargetCache,
                     commit: torch.Tensor | None, defer: bool):
        """verify: the target reads the n blocks -> logits ``[n * B, V]``, features ``[n * B, k * H]``."""
        return self.target(block, positions, cache, kv_len, self.feature_layers, commit=commit, defer_commit=defer)

    def _park(self, q: _Sequence, slot: int, rows: torch.Tensor, start: int) -> None:
        """Keep feature rows ``[m, k * H]`` of positions ``[start, start + m)`` (which follow
        the backlog's) for ``q``'s drafter context (in ``slot``): injected by :meth:`_flush`
        when it drafts again, or now when the backlog reaches :data:`BACKLOG_ROWS`. With
        CUDA graphs they are copied out of the graph pool (a later replay reuses it)."""
        if not q.backlog:
            q.backlog_start = start
        q.backlog.append(rows.clone() if self.graphed else rows)
        if start + rows.shape[0] - q.backlog_start >= BACKLOG_ROWS:  # (the rows' positions are consecutive)
            self._flush(q, slot)

    def _park_pending(self, q: _Sequence, slot: int) -> None:
        """Park the accepted rows of ``q``'s last drafting round (left for its next propose)."""
        if q.pending is not None:
            self._park(q, slot, q.pending[:q.pending_rows], q.pending_start)
            q.pending = None

    def _flush(self, q: _Sequence, slot: int) -> None:
        """Inject ``q``'s backlog (:meth:`_park`) into its drafter context in ``slot``, in one pass."""
        if not q.backlog:
            return
        feats = torch.cat(q.backlog)
        positions = q.backlog_start + torch.arange(feats.shape[0], device=self.device)
        InjectedContext(self.drafter, self.draft_kv.slot(slot)).inject(self.drafter, feats, positions)
        q.backlog = []

    def _commit(self, live: torch.Tensor, accepted: torch.Tensor) -> None:
        """Rollback of a hybrid target's recurrent layers, all sequences at once: advance
        each ``live`` row's state (bool ``[rows]``) over its own accepted rows + 1 of the
        verify (``accepted`` ``[rows]``, on the device); finished sequences held as
        padding and padding rows keep their state (0 rows)."""
        self.target.commit(TargetCache(None, self.target_state.first(live.shape[0])), (accepted + 1) * live)

    def _keep_logits(self, last: torch.Tensor) -> torch.Tensor | None:
        """A copy of a prompt's last logits ``[V]`` for a retained prefix (out of any graph's
        pool), with ``reuse_prefix``; else None."""
        return last.clone() if self.reuse_prefix else None

    def _prefill(self, slot: int, ids: torch.Tensor, start: int = 0, scored: list | None = None,
                 prompt: list[int] | None = None, top: int = 0) -> torch.Tensor:
        """The target reads the prompt ``ids[start:]`` (``ids`` ``[P]``; the rows before
        ``start`` already in ``slot``) into ``slot`` chunk by chunk. Returns the last row's
        logits ``[V]``. With ``scored`` (a list), each chunk's rows also score the prompt's
        tokens (``prompt``, ``top`` alternatives), appended to it."""
        for c0 in range(start, ids.shape[0], self.prefill_chunk):
            logits = self._prefill_chunk(slot, ids, c0)
            if scored is not None:
                scored += prompt_chunk_logprobs(logits, prompt, c0, top)
        return logits[-1]

    def _prefill_chunk(self, slot: int, ids: torch.Tensor, c0: int) -> torch.Tensor:
        """The target reads the prompt chunk ``ids[c0 : c0 + prefill_chunk]`` into ``slot``
        (chunk 0 from a zero recurrent state for a hybrid target); its rows' features are
        injected into the slot's drafter cache. Returns the chunk's logits ``[rows, V]``."""
        self._retained.pop(slot, None)
        state = None
        if self.target_state is not None:
            state = self.target_state.slot(slot)
            if c0 == 0:
                state.clear()
        cache = TargetCache(self.target_kv.slot(slot), state)
        c1 = min(c0 + self.prefill_chunk, ids.shape[0])
        self.prefill_tokens += c1 - c0
        positions = c0 + self._arange_chunk[: c1 - c0]
        logits, feats = self.target(ids[c0:c1], positions, cache, c1, self.feature_layers)
        if self.draft_kv is not None:
            InjectedContext(self.drafter, self.draft_kv.slot(slot)).inject(self.drafter, feats, positions)
        return logits

    def _propose(self, seqs: list[_Sequence], tokens: torch.Tensor, positions: torch.Tensor, kv_len: int,
                 pad_starts: list[int]):
        """The drafter over the n blocks ``[token, mask, ...]``, injecting each sequence's
        pending features first (padding rows: zero rows at their block's ``pad_starts``)
        -> draft tokens ``[n, B-1]`` and each sequence's q (None when greedy)."""
        rows, B = tokens.shape[0], self.block_size
        # each sequence injects the first m rows of its last verify: eager, m = the most any
        # sequence accepted (tau; a single sequence injects exactly its accepted rows, as
        # SpeculativeDecoder does); fixed shapes, m = B. Rows past a sequence's accepted ones
        # land inside its next block, whose K/V overwrite them in the same pass.
        m = B if self.static else max((q.pending_rows for q in seqs if q.pending is not None), default=B)
        zeros = self.drafter.fc.weight.new_zeros(m, self.drafter.fc.in_features)
        feats = torch.cat([q.pending[:m] if q.pending is not None else zeros for q in seqs] + [zeros] * (rows - len(seqs)))
        # a sequence without a verify yet (and a padding row) injects zero rows at its block's
        # own positions (the block's K/V overwrite them in the same pass)
        feat_starts = [q.pending_start if q.pending is not None else q.s for q in seqs] + pad_starts
        feat_positions = torch.tensor(feat_starts, device=self.device)[:, None] + self._arange_block[:m]
        scores = self._draft_fn(tokens, positions, feats, feat_positions, kv_len, self._views(rows)[1])
        greedy = SamplingParams()
        drafts, _ = self.drafter.choose_draft(scores, greedy, None)  # [n, B-1]: every plain greedy sequence's
        probs = [None] * rows
        # sampled sequences, and those whose processor changes the drafts (LogitsProcessor.choose_draft)
        own = [i for i, q in enumerate(seqs) if not q.done and
               (not q.params.greedy or (q.processor is not None and q.processor.adjusts_drafts))]
        if own:
            rows = list(drafts)
            for i in own:
                q = seqs[i]
                if q.processor is None:
                    rows[i], probs[i] = self.drafter.choose_draft(_row(scores, i), q.params, q.generator)
                else:
                    rows[i], probs[i] = q.processor.choose_draft(self.drafter, _row(scores, i), q.params, q.generator)
            drafts = torch.stack(rows)
        return drafts, probs

    def _accept(self, seqs: list[_Sequence], block: torch.Tensor, draft_probs: list, logits: torch.Tensor):
        """Acceptance of each sequence's block -> accepted counts ``[n]`` and the tokens that
        follow them ``[n]`` (int64, on the device). Greedy sequences without a
        :class:`~dflash_torch.sampling.LogitsProcessor` are decided all at once; the others
        one by one, on their own (processed) logits."""
        n, B = block.shape
        accepted, bonus = accept_greedy(block[:, 1:], logits)
        own = [i for i, q in enumerate(seqs) if not q.done and (not q.params.greedy or q.processor is not None)]
        if not own:
            return accepted, bonus
        a_rows, b_rows = list(accepted), list(bonus)
        for i in own:
            q = seqs[i]
            x = logits[i] if q.processor is None else q.processor.apply(logits[i], block[i, 1:])
            limit = q.processor.draft_limit if q.processor is not None else None
            if q.params.greedy:
                a_rows[i], b_rows[i] = accept_greedy(block[i, 1:], x, limit)
            elif B == 1:
                a_rows[i], b_rows[i] = accepted[i], choose(x, q.params, q.generator)[0]
            else:
                a_rows[i], b_rows[i] = accept_sampling(block[i, 1:], draft_probs[i], probabilities(x, q.params),
                                                       q.generator, limit)
        return torch.stack(a_rows).to(torch.long), torch.stack(b_rows)


def _row(scores, i: int):
    """Sequence ``i``'s part of the draft scores (a tensor, or a DFlash 2 lattice tuple)."""
    return tuple(t[i] for t in scores) if isinstance(scores, tuple) else scores[i]
