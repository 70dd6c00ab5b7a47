"""Rings for sliding-window layers (dflash_torch.cache), the target's and the drafter's: a
decoder's cache keeps ``window + max_rows - 1`` rows for such a layer, position ``p`` in
row ``p % rows``, and masks each row by the position it holds (``ring_positions``).

* the invariant, against a simulated ring (every row's actual contents tracked through
  random forwards, rejected rows and rollbacks): each query sees exactly the positions of
  its window, each in the row the mask says; one row fewer breaks it (the test has power);
* what the decoders allocate: rings of that size per sliding layer (the full layers keep
  every position), and ``cache_bytes`` counts exactly the bytes allocated;
* lossless across many wraps: ``check_many_accepted_tokens_are_lossless`` (eager with
  small prefill chunks, fixed shapes, batched) for gpt-oss, Gemma 4, Muse Glimmer targets;
  batching and prefix reuse on a ring target and drafter in ``test_batch`` /
  ``test_prefix_reuse``; the drafter's logits with rings equal the recomputed context's
  round after round in ``test_drafter_context``.
"""

from __future__ import annotations

import random

import pytest
import torch

from test_batch import ring_models  # noqa: F401 (the fixture: a gpt-oss target, a drafter with a sliding layer)

from dflash_torch import SamplingParams
from dflash_torch.batch import BatchDecoder
from dflash_torch.cache import cache_bytes
from dflash_torch.cache import ring_positions
from dflash_torch.decoding import SpeculativeDecoder


def simulate(window: int, max_rows: int, rows: int, rounds: int, seed: int) -> list[str]:
    """Random forwards on a ring of ``rows`` rows (each of at most ``max_rows`` positions
    from the committed length, some rejected after, the length sometimes restarting at 0
    as a new sequence does); after each forward's writes, every query row's visible ring
    rows (the mask that ``TargetModel.forward`` builds from :func:`ring_positions`) are
    compared with what the ring actually holds. -> the violations found."""
    rnd = random.Random(seed)
    held = [-1] * rows  # the position each row actually holds (-1: never written)
    length, errors = 0, []
    for _ in range(rounds):
        if rnd.random() < 0.03:
            length = 0  # a new sequence: rows keep the old one's positions
        t = rnd.randint(1, max_rows)
        positions = torch.arange(length, length + t)
        for p in positions.tolist():
            held[p % rows] = p
        said = ring_positions(positions, rows, rows).tolist()
        for q in positions.tolist():
            visible = {j for j, p in enumerate(said) if q - window < p <= q and p >= 0}
            if any(said[j] != held[j] for j in visible):
                errors.append(f"query {q}: rows {sorted(visible)} said {[said[j] for j in sorted(visible)]}, "
                              f"hold {[held[j] for j in sorted(visible)]}")
            wanted = set(range(max(0, q - window + 1), q + 1))
            if {said[j] for j in visible} != wanted:
                errors.append(f"query {q}: sees {sorted(said[j] for j in visible)}, its window is {sorted(wanted)}")
        length += rnd.randint(1, t)  # the accepted rows (the rest rejected: stale)
    return errors


@pytest.mark.parametrize("window,max_rows", [(1, 1), (4, 1), (5, 4), (8, 16), (3, 9)])
def test_ring_masks_see_each_window_exactly(window, max_rows):
    rows = window + max_rows - 1
    assert simulate(window, max_rows, rows, 400, seed=window * 31 + max_rows) == []


@pytest.mark.parametrize("window,max_rows", [(5, 4), (8, 16), (3, 9)])
def test_a_ring_one_row_short_breaks_some_window(window, max_rows):
    """Guards the test above: with ``window + max_rows - 2`` rows some query's window has a
    position already overwritten."""
    assert simulate(window, max_rows, window + max_rows - 2, 400, seed=window * 31 + max_rows)




def test_decoders_keep_rings_of_window_plus_rows_per_forward(ring_models):
    """Sliding layers hold ``window + max(B, prefill_chunk) - 1`` rows (never more than the
    capacity), full layers the whole capacity: one sequence eager (buffers grown per
    prompt) and fixed shapes, and the batch decoder's slots, of the target and of the
    drafter; without ``max_rows`` every layer keeps every position (a forward of any
    length, e.g. training)."""
    target, drafter = ring_models
    windows = target.kv_windows()
    assert windows == [8, None, 8, None]
    static = SpeculativeDecoder(target, drafter, static=True, max_context=1000, prefill_chunk=32)
    kv = static.target_cache.kv
    assert [t.shape[1] for t in kv.k] == [8 + 32 - 1, kv.capacity, 8 + 32 - 1, kv.capacity] and kv.capacity > 1000
    eager = SpeculativeDecoder(target, drafter)  # chunks of 256: rings of 263 rows, capped at the capacity
    list(eager.rounds([5, 6, 7], SamplingParams(), 4))
    kv = eager.target_cache.kv
    assert kv.capacity == 256 and [t.shape[1] for t in kv.k] == [256] * 4
    list(eager.rounds(list(range(2, 300)), SamplingParams(), 4))
    kv = eager.target_cache.kv
    assert kv.capacity == 512 and [t.shape[1] for t in kv.k] == [263, 512, 263, 512]
    assert drafter.kv_windows() == [8, None]
    assert [t.shape[1] for t in static.context.cache.k] == [8 + 32 - 1, static.target_cache.capacity]
    batch = BatchDecoder(target, drafter, max_batch_size=3, max_context=1000, prefill_chunk=8)
    assert [tuple(t.shape[::2]) for t in batch.target_kv.k] == [(3, 23), (3, 1000 + 32 + 1), (3, 23), (3, 1033)]
    # the drafter's context also takes a backlog of injections (BACKLOG_ROWS + B rows) in one write
    assert [tuple(t.shape[::2]) for t in batch.draft_kv.k] == [(3, 8 + 64 + 16 - 1), (3, 1033)]
    plain = target.new_cache()
    plain.reset(100)
    assert [t.shape[1] for t in plain.kv.k] == [256] * 4


@pytest.mark.parametrize("reuse", [True, False], ids=["reuse-prefix", "no-reuse"])
def test_cache_bytes_counts_the_rings_as_allocated(ring_models, reuse):
    """The memory check's estimate is what the batch decoder allocates (target rings and
    their prefix-reuse checkpoints, full layers, drafter context), and far less than
    keeping every position in the sliding layers."""
    target, drafter = ring_models
    batch = BatchDecoder(target, drafter, max_batch_size=2, max_context=4000, prefill_chunk=16, reuse_prefix=reuse)
    buffers = batch.target_kv.k + batch.target_kv.v + batch.target_kv._saved + batch.draft_kv.k + batch.draft_kv.v \
        + batch.draft_kv._saved
    allocated = sum(t.numel() * t.element_size() for t in buffers)
    capacity = batch.target_kv.capacity
    assert cache_bytes(target, drafter, 2, capacity, 16, reuse, 16 + 64) == allocated
    assert bool(batch.target_kv._saved) == reuse
    assert bool(batch.draft_kv._saved) == reuse
    every_position = cache_bytes(target, drafter, 2, capacity)
    assert allocated < 0.8 * every_position
    # (with reuse: the snapshot of a shared start, allocated when taken, is one copy of the rings)
    batch.add("a", list(range(11, 51)), SamplingParams(), 2, shared_end=20)
    snapshots = [t for part in batch._starts.values() for tensors in part if tensors is not None for t in tensors]
    assert len(batch._starts) == batch.shared_starts // 2 == int(reuse)
    assert sum(t.numel() * t.element_size() for t in snapshots) == cache_bytes(target, drafter, 0, capacity, 16, False,
                                                                                16 + 64, batch.shared_starts // 2)
