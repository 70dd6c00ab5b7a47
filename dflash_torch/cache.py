"""Per-sequence caches: a static, preallocated KV cache (attention layers of the target
and the drafter) and the recurrent state of linear-attention layers (Gated DeltaNet,
Mamba-2, Kimi Delta Attention).

Both the target and the drafter keep a KV cache. Entries are written at absolute
positions by index assignment (so positions may be a device tensor and shapes never
depend on the sequence length); ``length`` says how many positions are committed.
Rollback is just moving ``length``: entries past it are stale and are overwritten
before they can be read.

Sliding-window layers (a target's, a drafter's) keep a *ring* instead, when the decoder
says how many rows one forward writes at most (``max_rows``): ``window + max_rows - 1``
rows whatever the context length, position ``p`` in row ``p % rows`` (:func:`ring_positions`
says which position each row holds). Rollback stays a move of ``length``: a forward from
committed length ``L`` writes positions below ``L + max_rows``, and the positions those
writes displace (``rows`` or more earlier, so ``<= L - window``) are out of every later
query's window (a query at ``q >= L`` sees itself and the ``window - 1`` positions before
it); so are the stale rows a rejected block leaves behind. (A drafter's injection writes
committed positions below ``L``: they displace only older ones; ``max_rows`` also bounds
one write, whose positions must fall in distinct rows.) A sequence whose length goes back
(a reused prompt prefix) can only resume where the ring was last written (see
:class:`~dflash_torch.batch.BatchDecoder`'s prefix reuse).

Every buffer a compiled step writes in place is marked as a static address for
``torch.compile`` (:func:`static_buffer`). Without that, inductor sees a graph input
that is mutated and, on CUDA, skips CUDA graphs for the whole graph ("skipping
cudagraphs due to mutated inputs"), so ``--compile`` ran without graphs.
"""

from __future__ import annotations

import torch


def static_buffer(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` as a static address for ``torch.compile`` (its storage stays at one place
    for its whole life, so a CUDA graph may write it in place) and return it.

    Source: ``torch._dynamo.mark_static_address(t)``, unguarded (a graph is not rebuilt
    for another buffer of the same shape, it reads whichever buffer it is given), whose
    whole effect is the attribute set here: calling it would import ``torch._dynamo``,
    about half a second and 70 MB of every command's start, compiled or not
    (tests/test_cuda.py checks that the two mark a tensor alike).
    """
    t._dynamo_static_input_type = "unguarded"
    return t


def layer_shapes(num_layers: int, num_kv_heads, head_dim) -> list[tuple[int, int]]:
    """``(kv_heads, head_dim)`` of each of ``num_layers`` layers; ``num_kv_heads`` and
    ``head_dim`` are one int for all layers or a sequence with one per layer (Gemma 4's
    full-attention layers have heads of their own size)."""
    heads = [num_kv_heads] * num_layers if isinstance(num_kv_heads, int) else list(num_kv_heads)
    dims = [head_dim] * num_layers if isinstance(head_dim, int) else list(head_dim)
    if len(heads) != num_layers or len(dims) != num_layers:
        raise ValueError(f"{num_layers} layers but {len(heads)} head counts and {len(dims)} head sizes")
    return list(zip(heads, dims))


def ring_sizes(windows: list[int | None], max_rows: int | None) -> list[int | None]:
    """The ring size of each layer: ``window + max_rows - 1`` rows for a layer with a
    sliding ``window`` (tokens), None (every position kept) for the others, or for all
    when ``max_rows`` (the most rows one forward writes) is None."""
    return [None if not w or max_rows is None else w + max_rows - 1 for w in windows]


def buffer_rows(rings: list[int | None], capacity: int) -> list[int]:
    """The rows each layer's buffer takes: ``capacity``, or its ring size (``rings``, None:
    every position kept) when that is smaller (positions never wrap then)."""
    return [capacity if r is None else min(r, capacity) for r in rings]


class RingLayers:
    """What a cache of per-layer buffers ``k[layer]`` (rows on dimension -2) says about
    its rings (:class:`KVCache` and :class:`~dflash_torch.batch.SlotKVCache` alike), from
    ``windows`` (per layer, its sliding window or None), ``rings`` (per layer, its ring
    size or None: every position kept) and its capacity."""

    windows: list[int | None]
    rings: list[int | None]
    k: list[torch.Tensor]
    _capacity: int

    @property
    def capacity(self) -> int:
        """Positions that fit (tokens)."""
        return self._capacity

    def layer_ring(self, layer: int) -> int | None:
        """Rows of ``layer``'s ring, or None where it keeps every position."""
        return None if self.rings[layer] is None else self.k[layer].shape[-2]

    def ring_rows(self, window: int) -> int | None:
        """Rows of the rings of the layers with sliding window ``window`` (tokens), or None
        where they keep every position."""
        return next((self.layer_ring(i) for i, w in enumerate(self.windows) if w == window), None)


def ring_positions(positions: torch.Tensor, rows: int, span: int) -> torch.Tensor:
    """Which position each of the first ``span`` rows of a ring of ``rows`` rows holds
    while a forward at ``positions`` runs (its own rows written): the latest position
    ``p <= positions[..., -1]`` with ``p % rows`` that row; negative where no such position
    exists yet.

    Args:
        positions: int64 ``[T]`` (or ``[N, T]``: N sequences), consecutive positions.

    Returns:
        int64 ``[span]`` (or ``[N, span]``).
    """
    last = positions[..., -1:]
    return last - torch.remainder(last - torch.arange(span, device=positions.device), rows)


class KVCache(RingLayers):
    """Keys and values: ``k[layer]``/``v[layer]`` of shape ``[kv_heads, rows, head_dim]``
    (the layer's own ``kv_heads`` and ``head_dim``; ``rows`` the capacity, or a
    sliding-window layer's ring size).

    One tensor per layer (not views of one stacked tensor): torch.compile then writes
    new entries in place instead of copying the whole buffer on every write.

    Args:
        num_kv_heads, head_dim: one value for every layer, or one per layer (:func:`layer_shapes`).
        windows: per layer, its sliding window (tokens) or None; default: none.
        max_rows: the most rows one forward writes (tokens), or None (default): every layer
            keeps every position. Given, a layer with a sliding window keeps a ring of
            ``window + max_rows - 1`` rows (see the module docstring), never more rows than
            the capacity (positions never wrap then).

    Attributes:
        length: number of committed positions ``[0, length)`` (tokens).
        shapes: ``(kv_heads, head_dim)`` per layer.
        rings: per layer, its ring size (None: every position kept).
    """

    def __init__(self, num_layers: int, num_kv_heads, head_dim, dtype: torch.dtype, device: torch.device | str,
                 windows: list[int | None] | None = None, max_rows: int | None = None):
        self.shapes = layer_shapes(num_layers, num_kv_heads, head_dim)
        self.windows = [None] * num_layers if windows is None else list(windows)
        self.rings = ring_sizes(self.windows, max_rows)
        self.dtype, self.device = dtype, torch.device(device)
        self.k = self.v = []
        self._capacity = 0
        self._allocate(0)
        self.length = 0

    def _allocate(self, capacity: int) -> None:
        new = lambda heads, n, hd: static_buffer(torch.zeros(heads, n, hd, dtype=self.dtype, device=self.device))  # noqa: E731
        rows = buffer_rows(self.rings, capacity)
        self.k = [new(heads, n, hd) for (heads, hd), n in zip(self.shapes, rows)]
        self.v = [new(heads, n, hd) for (heads, hd), n in zip(self.shapes, rows)]
        self._capacity = capacity

    @classmethod
    def of(cls, k: list[torch.Tensor], v: list[torch.Tensor], windows: list[int | None], rings: list[int | None],
           capacity: int, dtype: torch.dtype, device: torch.device | str) -> "KVCache":
        """A cache over existing buffers ``[kv_heads, rows, head_dim]`` per layer (e.g. views
        of a slot of a :class:`~dflash_torch.batch.SlotKVCache`: writes land there), with
        these windows, ring sizes, capacity (positions), dtype and device (those of the
        buffers; given apart, as a target with no attention layer has no buffer)."""
        kv = cls(len(k), [t.shape[0] for t in k], [t.shape[2] for t in k], dtype, device, windows)
        kv.rings, kv._capacity, kv.k, kv.v = list(rings), capacity, list(k), list(v)
        return kv

    def reset(self, capacity: int) -> None:
        """Start a new sequence: length 0, room for at least ``capacity`` positions.

        The buffers are reallocated only when they must grow (to a multiple of 256).
        """
        if capacity > self.capacity:
            self._allocate(allocated(capacity))
        self.length = 0

    def resume(self, capacity: int, length: int) -> None:
        """Go on from the first ``length`` positions written (prefix reuse); room for at least
        ``capacity`` positions. Growing buffers (to a multiple of 256) copy those rows over: a
        position's row index does not change (a ring's rows, once wrapped, stay as many)."""
        if capacity > self.capacity:
            old = self.k + self.v
            self._allocate(allocated(capacity))
            for new, rows in zip(self.k + self.v, old):
                n = min(length, rows.shape[1])
                new[:, :n] = rows[:, :n]
        self.length = length

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[kv_heads, T, head_dim]`` at int64 ``positions`` ``[T]`` (in a
        ring: at ``positions % rows``)."""
        index = positions if self.rings[layer] is None else torch.remainder(positions, self.k[layer].shape[1])
        self.k[layer][:, index] = k
        self.v[layer][:, index] = v

    def view(self, layer: int, end: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``[0, end)`` (``end=None``: the whole buffer); of a
        ring, its first ``min(end, rows)`` rows (:func:`ring_positions`)."""
        if end is None:
            return self.k[layer], self.v[layer]
        return self.k[layer][:, :end], self.v[layer][:, :end]


class RecurrentState:
    """The state of a target's linear-attention (Gated DeltaNet, Mamba-2, KDA) layers for ``sequences``
    sequences (1 for :class:`~dflash_torch.decoding.SpeculativeDecoder`; a batch decoder's
    slots otherwise), with a leading sequence dimension N throughout.

    For each layer (a *slot*): ``conv[slot]`` ``[N, kernel - 1, conv_dim]`` (model dtype),
    the last projected inputs of the causal convolution, and ``ssm[slot]``
    ``[N, heads, d_k, d_v]`` (float32), the recurrent state. Both always describe the
    committed tokens only: a verify block leaves them unchanged and records (``stash``)
    what its layer needs to advance them over each sequence's accepted prefix afterwards.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device | str, sequences: int = 1):
        self.dtype, self.device, self.sequences = dtype, torch.device(device), sequences
        self.conv: list[torch.Tensor] = []
        self.ssm: list[torch.Tensor] = []
        self._stash: list[tuple | None] = []

    def add_layer(self, width: int, conv_dim: int, heads: int, key_dim: int, value_dim: int) -> int:
        """Allocate one layer's (zero) state; returns its slot."""
        n = self.sequences
        self.conv.append(static_buffer(torch.zeros(n, width, conv_dim, dtype=self.dtype, device=self.device)))
        self.ssm.append(static_buffer(torch.zeros(n, heads, key_dim, value_dim, dtype=torch.float32, device=self.device)))
        self._stash.append(None)
        return len(self.conv) - 1

    def rows(self, start: int, stop: int) -> "RecurrentState":
        """Sequences ``[start, stop)`` as a state of their own: views of these buffers (the
        layers write them in place), marked static too; its stash is its own."""
        part = RecurrentState(self.dtype, self.device, stop - start)
        part.conv = [static_buffer(t[start:stop]) for t in self.conv]
        part.ssm = [static_buffer(t[start:stop]) for t in self.ssm]
        part._stash = [None] * len(self.conv)
        return part

    def clear(self) -> None:
        """Back to the state before any token (in place: the buffers keep their addresses)."""
        for t in self.conv + self.ssm:
            t.zero_()
        self._stash = [None] * len(self._stash)

    def stash(self, slot: int, *tensors: torch.Tensor) -> None:
        """Record a deferred block's tensors for ``slot`` (see ``GatedDeltaNet.commit``)."""
        self._stash[slot] = tensors

    def copy_stash(self) -> None:
        """Replace every stashed tensor by a copy (see ``SpeculativeDecoder._carry``)."""
        self._stash = [None if t is None else tuple(x.clone() for x in t) for t in self._stash]

    def stashed(self, slot: int) -> tuple:
        """The tensors of the last deferred block of ``slot``.

        Raises:
            RuntimeError: no block was deferred since the last commit.
        """
        if self._stash[slot] is None:
            raise RuntimeError("commit without a deferred verify block")
        return self._stash[slot]


class TargetCache:
    """Everything a target keeps per sequence: a :class:`KVCache` over its attention
    layers and, for hybrid targets, a :class:`RecurrentState` over its linear-attention
    layers (None for pure-attention targets).

    ``length``, ``capacity`` and ``reset`` are those of the KV cache; ``reset`` also clears
    the recurrent state.
    """

    def __init__(self, kv: KVCache, recurrent: RecurrentState | None = None):
        self.kv, self.recurrent = kv, recurrent

    @property
    def length(self) -> int:
        return self.kv.length

    @length.setter
    def length(self, value: int) -> None:
        self.kv.length = value

    @property
    def capacity(self) -> int:
        return self.kv.capacity

    def reset(self, capacity: int) -> None:
        """Start a new sequence (see :meth:`KVCache.reset`); the recurrent state is zeroed."""
        self.kv.reset(capacity)
        if self.recurrent is not None:
            self.recurrent.clear()

    def resume(self, capacity: int, length: int) -> None:
        """Go on from the first ``length`` positions (:meth:`KVCache.resume`); the recurrent
        state stays as it is (it must be that of those positions)."""
        self.kv.resume(capacity, length)


def recurrent_bytes(target) -> int:
    """Bytes of one sequence's recurrent state of ``target`` (a
    :class:`~dflash_torch.models.target.TargetModel`; 0 for pure-attention targets)."""
    size = target.model.embed_tokens.weight.element_size()
    total = 0
    for layer in target.model.layers:
        if layer.kind == "linear_attention":
            m = layer.linear_attn
            total += (m.kernel - 1) * m.conv_dim * size + m.nv * m.dk * m.dv * 4
    return total


def cache_bytes(target, drafter, slots: int, capacity: int,
                max_rows: int | None = None, checkpoints: bool = False, draft_rows: int | None = None,
                snapshots: int = 0) -> int:
    """Bytes of the K/V caches of ``slots`` sequences of ``capacity`` positions of ``target``
    (a :class:`~dflash_torch.models.target.TargetModel`) and ``drafter`` (a
    :class:`~dflash_torch.models.drafter.DFlashDrafter`, or None: no drafter context;
    sliding-window layers keep rings when ``max_rows`` (the target's) or
    ``draft_rows`` (the drafter's) is given, see :class:`~dflash_torch.cache.KVCache`), plus a
    hybrid target's recurrent state per sequence; with ``checkpoints``, a second copy of
    each sequence's recurrent state and rings; and ``snapshots`` more copies of one
    sequence's recurrent state and rings (the batch decoder's snapshots of shared prompt
    starts, counted as the checkpoints are)."""
    def one(copies: int) -> int:  # one sequence's bytes, rings and recurrent state in ``copies``
        total = _kv_bytes(target.kv_shapes(), target.kv_windows(), max_rows, capacity, copies,
                          target.model.embed_tokens.weight.element_size()) + copies * recurrent_bytes(target)
        if drafter is not None:
            d = drafter.config
            total += _kv_bytes([(d.num_key_value_heads, d.head_dim)] * d.num_hidden_layers, drafter.kv_windows(),
                               draft_rows, capacity, copies, drafter.fc.weight.element_size())
        return total

    plain = one(1)
    copy = one(2) - plain if checkpoints or snapshots else 0  # (one copy of the rings and recurrent state)
    return slots * (plain + (copy if checkpoints else 0)) + snapshots * copy


def allocated(capacity: int) -> int:
    """Positions a growing cache allocates for room for ``capacity``: a multiple of 256
    (:meth:`KVCache.reset`, :meth:`KVCache.resume`), so that it is reallocated seldom."""
    return -(-capacity // 256) * 256


def common_start(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` share from their start (prefix reuse)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


FIT_MARGIN = 0.98  # (of the room a refusal's "at most" figure fills: free memory moves a little before it is given back)


def most_that_fits(need, most: int, room: float) -> int:
    """The largest ``n`` in ``[0, most]`` with ``need(n) <= FIT_MARGIN * room`` (``need``: bytes,
    growing with ``n``, e.g. of :func:`cache_bytes`), or 0 where none is: what a refusal of caches
    too large names as the most that fits, a little below the line so that the figure still
    fits when the free memory has moved by the time it is passed back (an address-space limit
    moves with the process's mappings; bisection: ``log2(most)`` calls)."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid) <= FIT_MARGIN * room else (lo, mid - 1)
    return lo


def _kv_bytes(shapes: list[tuple[int, int]], windows: list[int | None], max_rows: int | None, capacity: int,
              copies: int, size: int) -> int:
    """Bytes of one sequence's keys and values of layers of ``shapes`` (kv heads, head size)
    and ``windows``: ``capacity`` rows each, a ring's (``max_rows``) in ``copies``."""
    rings = ring_sizes(windows, max_rows)
    rows = [n if r is None else n * copies for r, n in zip(rings, buffer_rows(rings, capacity))]
    return sum(heads * hd * 2 * n for (heads, hd), n in zip(shapes, rows)) * size
