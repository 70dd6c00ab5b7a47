"""Prompt-prefix reuse across requests (dflash_torch.batch, ``reuse_prefix``): a sequence
that leaves keeps its slot's rows (target K/V, drafter context, recurrent state) as a
retained prefix in a free slot; a later prompt that starts with its tokens (the next turn
of a conversation) takes those rows and reads only the rest. Every turn decodes exactly as
with reuse off (tokens and acceptance lengths, greedy and seeded sampling) on attention
(DFlash and DFlash 2 drafters), mixture-of-experts, hybrid targets and targets whose
sliding-window layers keep rings (both reused by an exact extension, or up to the end of
the prompt the rows began with), eager, fixed shapes and compiled (no new graph), and through
``generate_batch``; ``reused_prefill_tokens`` counts exactly the rows taken."""

from __future__ import annotations

import pytest
import torch

from conftest import varied_prompts
from test_batch import CHUNK_TOKENS, agree_models, hybrid_models, qwen35_models, ring_models  # noqa: F401 (fixtures)

from dflash_torch import DFlashEngine, DFlashError, SamplingParams
from dflash_torch.batch import BatchDecoder, cache_sizes
from dflash_torch.cache import cache_bytes, ring_positions

C = CHUNK_TOKENS
GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.9, top_k=50, seed=17)
MORE = [7, 8, 9, 10]  # a user's next message (token ids outside the varied prompts' set)


class Turns:
    """Drives a :class:`BatchDecoder`: sequences join, step, and are removed once they have
    their budget; records every sequence's committed tokens (all of them, past the budget
    too), acceptance lengths, and its slot's rows right after its prefill (:func:`slot_rows`)."""

    def __init__(self, batch: BatchDecoder):
        self.batch, self.out, self.taus, self.budgets, self.prompts, self.rows = batch, {}, {}, {}, {}, {}
        self.cached = {}  # each sequence's prefill Round.cached_tokens

    @classmethod
    def of(cls, target, drafter, slots: int, reuse: bool, **kw) -> "Turns":
        """On a new decoder of ``slots`` slots (context 200, chunks of ``C``)."""
        return cls(BatchDecoder(target, drafter, max_batch_size=slots, max_context=200, prefill_chunk=C,
                                reuse_prefix=reuse, **kw))

    def join(self, sid, prompt, params, budget, **kw):
        self.budgets[sid], self.prompts[sid] = budget, prompt
        self.batch.join(sid, prompt, params, budget, **kw)

    def add(self, sid, prompt, params, budget, **kw):
        """As :meth:`join`, through :meth:`BatchDecoder.add` (its prefill now)."""
        self.budgets[sid], self.prompts[sid] = budget, prompt
        rnd = self.batch.add(sid, prompt, params, budget, **kw)
        self.out[sid], self.cached[sid] = rnd.tokens, rnd.cached_tokens
        self.rows[sid] = slot_rows(self.batch, self.batch.seq_ids.index(sid), len(prompt))

    def step(self):
        for sid, rnd in self.batch.step().items():
            if rnd.acceptance_length is None:
                self.rows[sid] = slot_rows(self.batch, self.batch.seq_ids.index(sid), len(self.prompts[sid]))
                self.cached[sid] = rnd.cached_tokens
            if rnd.acceptance_length is not None and len(self.out[sid]) < self.budgets[sid]:
                self.taus.setdefault(sid, []).append(rnd.acceptance_length)
            self.out.setdefault(sid, []).extend(rnd.tokens)
        for sid in self.batch.seq_ids:
            if len(self.out.get(sid, [])) >= self.budgets[sid]:
                self.batch.remove(sid)

    def until_gone(self, sid, steps: int = 300):
        for _ in range(steps):
            if sid not in self.batch:
                return self.out[sid][:self.budgets[sid]]
            self.step()
        raise AssertionError(f"{sid!r} did not finish")

    def valid(self, sid, prompt) -> list[int]:
        """The token ids of the rows ``sid`` left valid: its prompt and all its committed
        tokens but the last (whose K/V no verify wrote)."""
        return prompt + self.out[sid][:-1]

    def result(self, sid):
        return self.out[sid][:self.budgets[sid]], self.taus.get(sid, [])


def slot_rows(batch: BatchDecoder, slot: int, n: int, state: bool = True) -> torch.Tensor:
    """Everything a prefill of ``n`` prompt tokens leaves in ``slot``: target K/V and
    drafter context rows of positions ``[0, n)`` (a ring's: those of the last ``window``
    positions) and (``state``) recurrent states, flattened (float32)."""
    parts = []
    for kv in (batch.target_kv, batch.draft_kv):
        for t, window in zip(kv.k + kv.v, kv.windows + kv.windows) if kv is not None else ():
            rows = None if window is None else kv.ring_rows(window)
            if rows is None:
                parts.append(t[slot, :, :n])
            else:  # a ring: the rows of the positions the next query can see (the others are stale)
                held = ring_positions(torch.tensor([n - 1], device=t.device), rows, rows)
                parts.append(t[slot][:, (held > n - 1 - window) & (held >= 0)])
    if state and batch.target_state is not None:
        parts += [t[slot] for t in batch.target_state.conv + batch.target_state.ssm]
    return torch.cat([t.float().flatten() for t in parts])


def same_runs(on: Turns, off: Turns) -> None:
    """Every sequence: the same tokens and acceptance lengths with reuse on and off, and
    the same rows in its slot after its prefill (up to float rounding: reused rows were
    computed by verify blocks and injections, read ones by prefill chunks)."""
    assert set(on.out) == set(off.out)
    for sid in on.out:
        assert on.result(sid) == off.result(sid), sid
        torch.testing.assert_close(on.rows[sid], off.rows[sid], rtol=1e-4, atol=1e-4, msg=lambda m: f"{sid!r}: {m}")


def reuse_decodes_as_without(pair) -> tuple[list, list[int]]:
    """The :func:`conversation` on a (target dir, drafter dir) pair in float32, with prefix reuse
    on and off: every turn decodes the same (:func:`same_runs`). -> (the turns' prompts, the
    prompt rows reused per turn with reuse on), for the caller's own bounds."""
    from dflash_torch.models.drafter import DFlashDrafter
    from dflash_torch.models.target import TargetModel

    target, drafter = (TargetModel.from_pretrained(pair[0], torch.float32),
                       DFlashDrafter.from_pretrained(pair[1], torch.float32))
    on, prompts, reused = conversation(target, drafter, True, GREEDY)
    off, _, _ = conversation(target, drafter, False, GREEDY)
    same_runs(on, off)
    return prompts, reused


def conversation(target, drafter, reuse: bool, params: SamplingParams, **kw):
    """Three turns, each prompt = the last prompt + the reply the caller kept (its budget)
    + the next message, while another sequence decodes (joins first, leaves during turn 2 or
    3: the turns' slots move); before each next turn a short unrelated request passes
    through the slot the turn will take. -> the Turns, prompts, and prompt rows reused per turn."""
    t = Turns.of(target, drafter, 3, reuse, **kw)
    batch = t.batch
    t.join("o", varied_prompts(target, 1, seed=40, length=9)[0], GREEDY, 70)
    prompts, reused = [varied_prompts(target, 1, seed=41, length=2 * C + 3)[0]], []
    for k, budget in enumerate((20, 25, 15)):
        if k:
            prompts.append(prompts[-1] + t.out[k - 1][:t.budgets[k - 1]] + MORE)
            t.join(("z", k), [3] + varied_prompts(target, 1, seed=k, length=5)[0], GREEDY, 5)  # (other rows in the slot)
            t.until_gone(("z", k))
        before = batch.reused_prefill_tokens
        t.join(k, prompts[k], params, budget)
        t.until_gone(k)
        reused.append(batch.reused_prefill_tokens - before)
    t.until_gone("o")
    return t, prompts, reused


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampling"])
@pytest.mark.parametrize("models", ["agree_models", "dflash2_models", "moe_models"],
                         ids=["attention", "dflash2", "qwen3-moe"])
def test_multi_turn_conversation_reuses_its_history(request, models, params):
    """Turn k + 1's prompt starts with turn k's prompt and reply: it reuses the rows of
    turn k's prompt and of every reply token but the last committed one, reads the rest,
    and every turn (and the sequence decoding beside them) gets the tokens and acceptance
    lengths of reuse off (also true of the drafter context: wrong rows there lower tau)."""
    target, drafter = request.getfixturevalue(models)
    on, prompts, reused = conversation(target, drafter, True, params)
    off, prompts_off, reused_off = conversation(target, drafter, False, params)
    assert prompts == prompts_off and reused_off == [0, 0, 0]
    same_runs(on, off)
    for k in (1, 2):  # the rows of the last prompt and of the reply, up to the last token committed
        assert reused[k] == len(prompts[k - 1]) + min(on.budgets[k - 1], len(on.out[k - 1]) - 1), k
    assert reused[0] == 0
    assert on.batch.prefill_tokens + on.batch.reused_prefill_tokens == off.batch.prefill_tokens
    assert on.batch.free_slots == 3


@pytest.mark.parametrize("models", ["hybrid_models", "qwen35_models", "ring_models"],
                         ids=["qwen3-next-hybrid-moe", "qwen35-hybrid", "gpt-oss-rings"])
def test_hybrid_target_reuses_an_extension_or_the_prompt_it_began_with(request, models):
    """A hybrid target's recurrent state (a ring target's rings: the last positions written)
    is known at the end of the retained rows and at the end of the prompt they began with
    (the slot's checkpoint) only: a prompt that
    diverges inside the reply reuses that prompt's rows, one that extends the rows exactly
    reuses all of them, one that diverges inside the first prompt is read whole (here all
    in place: one slot). Each turn decodes as with reuse off. (The ring drafter's first reply
    is longer than its ring's slack, window + 79 rows: its checkpoint must be restored.)"""
    target, drafter = request.getfixturevalue(models)
    first = 100 if models == "ring_models" else 20
    runs = {}
    for reuse in (True, False):
        t, reused = Turns.of(target, drafter, 1, reuse), []
        batch = t.batch
        p0 = varied_prompts(target, 1, seed=43, length=C + 5)[0]
        p1 = None
        for k in range(4):
            if k == 1:
                assert len(t.out[0]) > 3
                p1 = p0 + t.out[0][:2] + MORE  # diverges inside the reply: the checkpoint (p0's end)
            prompt = [p0, p1, t.valid(1, p1) + MORE if k == 2 else None, p0[:5] + MORE][k]  # 2: extends exactly
            before = batch.reused_prefill_tokens
            t.join(k, prompt, SAMPLED if k == 1 else GREEDY, first if k == 0 else 20 if k < 2 else 15)
            t.until_gone(k)
            reused.append(batch.reused_prefill_tokens - before)
        runs[reuse] = t, reused, [len(p0), len(t.valid(1, p1))]
    (on, reused, (n0, valid_1)), (off, reused_off, _) = runs[True], runs[False]
    assert reused == [0, n0, valid_1, 0] and reused_off == [0, 0, 0, 0]
    same_runs(on, off)


@pytest.mark.parametrize("models", ["hybrid_models", "qwen35_models", "ring_models"],
                         ids=["qwen3-next-hybrid-moe", "qwen35-hybrid", "gpt-oss-rings"])
def test_hybrid_conversation_with_cut_replies_reuses_at_least_the_last_prompt(request, models):
    """The multi-turn conversation (three slots, another sequence decoding beside it, the
    turns' slots moving) on a hybrid target (or a ring target): each reply is cut at its budget, so turn k + 1
    extends turn k's rows exactly only when no round committed past the budget; else it
    reuses turn k's prompt (the checkpoint, carried along with the slot's moves). Every
    turn decodes as with reuse off."""
    target, drafter = request.getfixturevalue(models)
    on, prompts, reused = conversation(target, drafter, True, GREEDY)
    off, prompts_off, reused_off = conversation(target, drafter, False, GREEDY)
    assert prompts == prompts_off and reused_off == [0, 0, 0]
    same_runs(on, off)
    for k in (1, 2):
        extra = len(on.out[k - 1]) - 1  # committed tokens whose rows are valid, past turn k's prompt
        assert reused[k] == len(prompts[k - 1]) + (extra if extra <= on.budgets[k - 1] else 0), k
    assert reused[0] == 0 and reused[1] > 0


def test_a_full_batch_overwrites_a_retained_prefix(agree_models):  # noqa: F811 (the imported fixture)
    """Two slots: the first turn leaves its rows in slot 1; two other sequences then fill
    the batch (the second's prefill writes slot 1): the next turn finds nothing to reuse
    and still decodes exactly as with reuse off."""
    target, drafter = agree_models
    runs = {}
    for reuse in (True, False):
        t = Turns.of(target, drafter, 2, reuse)
        batch = t.batch
        p0 = varied_prompts(target, 1, seed=44, length=C + 5)[0]
        t.join(0, p0, GREEDY, 20)
        t.until_gone(0)
        kept = dict(batch._retained) if reuse else {}
        t.join("x", [3] + varied_prompts(target, 1, seed=45, length=C)[0], SAMPLED, 30)
        t.join("y", [4] + varied_prompts(target, 1, seed=46, length=9)[0], GREEDY, 25)
        t.step()
        t.step()
        assert "x" in t.out and "y" in t.out and batch.free_slots == 0
        gone = 1 not in batch._retained
        t.until_gone("x")
        t.until_gone("y")
        p1 = p0 + t.out[0][:20] + MORE
        before = batch.reused_prefill_tokens
        t.join(1, p1, GREEDY, 20)
        t.until_gone(1)
        runs[reuse] = t, list(kept), gone, batch.reused_prefill_tokens - before
    (on, kept, gone, reused), (off, _, _, _) = runs[True], runs[False]
    assert kept == [1] and gone and reused == 0
    same_runs(on, off)


@pytest.mark.parametrize("models", ["agree_models", "qwen35_models"], ids=["attention", "qwen35-hybrid"])
def test_a_full_batch_keeps_the_rows_of_a_sequence_leaving_a_middle_slot(request, models):
    """Two slots, both decoding: the turn in slot 0 leaves first (no free slot to copy its
    rows into): it trades slots with the sequence in slot 1, whose slot is then the free one,
    and keeps its rows there. Its next turn reuses them; every sequence decodes as with
    reuse off (the moved one too, rows and recurrent state exchanged)."""
    target, drafter = request.getfixturevalue(models)
    runs = {}
    for reuse in (True, False):
        t = Turns.of(target, drafter, 2, reuse)
        batch = t.batch
        p0 = varied_prompts(target, 1, seed=47, length=C + 5)[0]
        t.join(0, p0, GREEDY, 12)
        t.join("b", [5] + varied_prompts(target, 1, seed=48, length=C + 2)[0], SAMPLED, 60)
        t.step()
        t.step()
        assert batch.seq_ids == [0, "b"] and batch.free_slots == 0
        t.until_gone(0)
        kept = dict(batch._retained) if reuse else {}
        p1 = t.valid(0, p0) + MORE
        before = batch.reused_prefill_tokens
        t.join(1, p1, GREEDY, 15)
        t.until_gone(1)
        t.until_gone("b")
        runs[reuse] = t, list(kept), batch.reused_prefill_tokens - before, len(t.valid(0, p0))
    (on, kept, reused, n), (off, _, reused_off, _) = runs[True], runs[False]
    assert kept == [1] and reused == n and reused_off == 0
    same_runs(on, off)


def owner(batch: BatchDecoder, prompts: dict) -> dict:
    """Retained slot -> the sequence id whose prompt its rows begin with."""
    return {i: next(sid for sid, p in prompts.items() if r.ids[:len(p)] == p) for i, r in batch._retained.items()}


@pytest.mark.parametrize("models", ["agree_models", "qwen35_models", "ring_models"],
                         ids=["attention", "qwen35-hybrid", "gpt-oss-rings"])
def test_a_full_batch_keeps_every_leavers_rows(request, models):
    """Three slots, all decoding (as many conversations as slots): the turn in the last
    slot leaves, and keeps its rows there; then the turn in slot 0, which keeps its rows in
    the slot it frees, trading slots with the last decoding sequence (it used to drop the
    first's rows for them, the least recently used retained prefix then).
    Their next turns then join in the order that puts the first into the slot holding the
    other's rows: those trade slots with the rows it takes (they used to be dropped). Both
    next turns reuse all their rows, and every sequence decodes as with reuse off."""
    target, drafter = request.getfixturevalue(models)
    runs, order = {}, None
    for reuse in (True, False):
        t = Turns.of(target, drafter, 3, reuse)
        batch = t.batch
        first = {sid: [4 + k] + varied_prompts(target, 1, seed=70 + k, length=C + 3 * k)[0]
                 for k, sid in enumerate("ab")}
        for sid, prompt, params, budget in (("b", first["b"], GREEDY, 40),
                                            ("c", [3] + varied_prompts(target, 1, seed=72, length=8)[0], SAMPLED, 150),
                                            ("a", first["a"], GREEDY, 6)):
            t.add(sid, prompt, params, budget)  # (prefilled now, in slots 0, 1, 2: the batch is full)
        t.until_gone("a")
        t.until_gone("b")
        assert "c" in batch
        kept = owner(batch, first) if reuse else {}
        assert not reuse or sorted(kept) == [1, 2], kept
        order = order or [kept[2], kept[1]]  # (the rows in the higher slot join first)
        reused = {}
        for sid in order:
            before = batch.reused_prefill_tokens
            t.join(sid + "1", t.valid(sid, first[sid]) + MORE, GREEDY, 8)
            t.step()
            reused[sid] = batch.reused_prefill_tokens - before
        for sid in order:
            t.until_gone(sid + "1")
        t.until_gone("c")
        runs[reuse] = t, kept, reused
    (on, kept, reused), (off, _, reused_off) = runs[True], runs[False]
    assert sorted(kept.values()) == ["a", "b"]
    assert reused == {sid: len(on.valid(sid, on.prompts[sid])) for sid in "ab"} and set(reused_off.values()) == {0}
    same_runs(on, off)


@pytest.mark.parametrize("shared_end", [False, True], ids=["", "shared-end"])
@pytest.mark.parametrize("models", ["agree_models", "qwen35_models", "ring_models"],
                         ids=["attention", "qwen35-hybrid", "gpt-oss-rings"])
def test_a_prompt_sharing_only_a_start_copies_it_and_leaves_the_history(request, models, shared_end):
    """Two slots (one decoding all along) and a prefix slot, which a one-off request's rows
    fill: a conversation's turn then leaves its history in the free slot, where the next
    prompt, sharing only its first tokens (a system prompt), lands: that prompt copies those
    rows and the history moves to the prefix slot, in place of the older one-off rows (it
    used to be taken in place for its first tokens, and written over); the conversation's
    next turn reuses all of it. (A hybrid or ring target shares such a start only where the
    prompts give its end as ``shared_end``, whose prefill keeps a snapshot of the state and
    rings there: else its state is known only at the ends of a prefix and of its prompt; its
    history moves all the same.) Every sequence decodes as with reuse off."""
    target, drafter = request.getfixturevalue(models)
    runs = {}
    for reuse in (True, False):
        t = Turns.of(target, drafter, 2, reuse, prefix_slots=1 if reuse else 0)
        batch = t.batch
        system = [4] + varied_prompts(target, 1, seed=90, length=C)[0]
        given = {"shared_end": len(system)} if shared_end else {}
        t.add("o", [3] + varied_prompts(target, 1, seed=91, length=8)[0], SAMPLED, 150)
        t.join("z", [6] + varied_prompts(target, 1, seed=94, length=5)[0], GREEDY, 4)
        t.until_gone("z")
        p0 = system + varied_prompts(target, 1, seed=92, length=9)[0]
        t.join("a", p0, GREEDY, 10, **given)
        t.until_gone("a")
        kept = sorted(batch._retained)
        before = batch.reused_prefill_tokens
        t.join("other", system + [5] + varied_prompts(target, 1, seed=93, length=6)[0], GREEDY, 6, **given)
        t.until_gone("other")
        shared = batch.reused_prefill_tokens - before
        before = batch.reused_prefill_tokens
        t.join("a1", t.valid("a", p0) + MORE, GREEDY, 8)
        t.until_gone("a1")
        assert "o" in batch
        t.until_gone("o")
        runs[reuse] = t, kept, shared, batch.reused_prefill_tokens - before
    (on, kept, shared, reused), (off, _, shared_off, reused_off) = runs[True], runs[False]
    # (a hybrid / ring target's state is known only where a prefix or its prompt ends, and at a shared start's end)
    assert kept == [1, 2] and shared == (len(system) if shared_end or not on.batch.takes_checkpoint else 0)
    assert on.batch.shared_starts == (2 if on.batch.takes_checkpoint else 0)
    assert len(on.batch._starts) == (1 if shared_end and on.batch.takes_checkpoint else 0)
    assert reused == len(on.valid("a", on.prompts["a"]))
    assert shared_off == reused_off == 0
    same_runs(on, off)


def arriving_together(target, drafter, reuse: bool, shared_end: bool, add: bool, static: bool):
    """Three prompts with one system prompt (of ``C + 4`` tokens) and different user messages
    on a decoder of 4 slots with no retained prefix: "a" and "b" join together (before any
    step), then, while they decode, "c" joins (or, ``add``, is added: its prefill now); each
    given its system prompt's end as ``shared_end`` if asked; ``static``: fixed shapes. -> the
    Turns, the system prompt, and the prompt tokens the target read."""
    t = Turns.of(target, drafter, 4, reuse, static=static)
    system = [4] + varied_prompts(target, 1, seed=96, length=C + 3)[0]
    given = {"shared_end": len(system)} if shared_end else {}
    prompts = {sid: system + [first] + varied_prompts(target, 1, seed=97 + k, length=7)[0]
               for k, (sid, first) in enumerate((("a", 5), ("b", 6), ("c", 8)))}
    t.join("a", prompts["a"], GREEDY, 30, **given)
    t.join("b", prompts["b"], SAMPLED, 25, **given)
    t.step()
    t.step()
    assert {"a", "b"} <= set(t.batch.seq_ids)  # (both decode: "c" finds their rows live, none retained)
    assert not t.batch._retained
    (t.add if add else t.join)("c", prompts["c"], GREEDY, 12, **given)
    for sid in "abc":
        t.until_gone(sid)
    return t, system, t.batch.prefill_tokens


@pytest.mark.parametrize("static", [False, True], ids=["eager", "fixed-shapes"])
@pytest.mark.parametrize("add", [False, True], ids=["join", "add"])
@pytest.mark.parametrize("shared_end", [False, True], ids=["", "shared-end"])
@pytest.mark.parametrize("models", ["agree_models", "qwen35_models", "ring_models"],
                         ids=["attention", "qwen35-hybrid", "gpt-oss-rings"])
def test_prompts_arriving_together_share_their_common_start(request, models, shared_end, add, static):
    """Requests that arrive together with one system prompt (a server's users, before any
    conversation has ended to leave its rows retained) read it once: a prompt whose prefill
    starts while another sequence decodes copies the rows of their common start from that
    sequence's slot (its prompt rows, which no round rewrites; it goes on decoding) and reads
    only the rest. A hybrid or ring target does so up to a shared start whose snapshot the
    first prompt's prefill kept (given ``shared_end``), else reads it all. Every sequence
    decodes as with reuse off (tokens, acceptance lengths, its rows after the prefill), eager
    and with fixed shapes."""
    target, drafter = request.getfixturevalue(models)
    on, system, read = arriving_together(target, drafter, True, shared_end, add, static)
    off, _, read_off = arriving_together(target, drafter, False, shared_end, add, static)
    same_runs(on, off)
    assert set(off.cached.values()) == {0}
    shares = shared_end or not on.batch.takes_checkpoint
    expected = len(system) if shares else 0
    assert on.cached == {"a": 0, "b": expected, "c": expected}
    assert read == read_off - 2 * expected
    # (trial-311 noticed: requests arriving together each read their shared system prompt)


def shared_starts(target, drafter, reuse: bool, **kw):
    """Conversations with three system prompts (S0, S1, S2) on a decoder of 2 slots and 3
    prefix slots (every request's rows stay retained), each given its system prompt's end as
    ``shared_end``, through ``add``: S0's, a prompt sharing only part of S0, S1's, S2's (the
    third snapshot: with the default 2 kept, S0's gives way), S0's again, S2's again (``kw``:
    the decoder's other options). -> the Turns, the system prompts."""
    t = Turns.of(target, drafter, 2, reuse, prefix_slots=3 if reuse else 0, **kw)
    systems = [[7 + k, 4] + varied_prompts(target, 1, seed=95 + k, length=C + 3)[0] for k in range(3)]

    def user(seed):
        return [5] + varied_prompts(target, 1, seed=seed, length=6)[0]

    for sid, prompt, end in (("s0", systems[0] + user(1), len(systems[0])),
                             ("part", systems[0][:C - 6] + [6] + user(2), None),
                             ("s1", systems[1] + user(3), len(systems[1])),
                             ("s2", systems[2] + user(4), len(systems[2])),
                             ("s0-again", systems[0] + user(5), len(systems[0])),
                             ("s2-again", systems[2] + user(6), len(systems[2]))):
        t.add(sid, prompt, GREEDY, 6, shared_end=end)
        t.until_gone(sid)
    return t, systems


@pytest.mark.parametrize("models", ["agree_models", "qwen35_models", "ring_models"],
                         ids=["attention", "qwen35-hybrid", "gpt-oss-rings"])
def test_shared_starts_keep_a_few_snapshots(request, models):
    """A hybrid or ring target keeps ``shared_starts`` snapshots of shared starts
    (:data:`~dflash_torch.batch.SHARED_STARTS`, 2, by default): a prompt that shares fewer
    tokens than a snapshot's position takes nothing; one whose system prompt's snapshot gave
    way reads it all (though another conversation's rows hold it), and takes its snapshot
    again; one whose snapshot is kept reads only the rest. With ``shared_starts=3`` the three
    system prompts in rotation all keep theirs; with 0 none is kept, and nothing is shared.
    An attention target keeps none whatever the option, and shares any common start. Every
    sequence decodes as with reuse off."""
    target, drafter = request.getfixturevalue(models)
    on, systems = shared_starts(target, drafter, True)
    off, _ = shared_starts(target, drafter, False)
    same_runs(on, off)
    assert set(off.cached.values()) == {0}
    if not on.batch.takes_checkpoint:
        assert on.batch.shared_starts == 0 and not on.batch._starts
        cached = dict(on.cached)  # (the common start: the system prompt, the user's first token, and more by chance)
        assert cached.pop("s0-again") > len(systems[0]) and cached.pop("s2-again") > len(systems[2])
        assert cached == {"s0": 0, "part": C - 6, "s1": 0, "s2": 0}
        # (the option has no effect here: accepted, and no snapshot is kept)
        assert BatchDecoder(target, drafter, max_batch_size=1, max_context=64, shared_starts=3).shared_starts == 0
        return
    assert on.cached == {"s0": 0, "part": 0, "s1": 0, "s2": 0, "s0-again": 0, "s2-again": len(systems[2])}
    assert any(r.ids[:len(systems[0])] == systems[0] for r in on.batch._retained.values())  # (S0's rows were there)
    assert list(on.batch._starts) == [tuple(systems[0]), tuple(systems[2])]  # (S1's gave way to S0's; S2's used last)
    # (trial-315: the pool was fixed at 2, so three system prompts in rotation shared nothing after the first two)
    more, _ = shared_starts(target, drafter, True, shared_starts=3)
    none, _ = shared_starts(target, drafter, True, shared_starts=0)
    same_runs(more, off)
    same_runs(none, off)
    assert more.batch.shared_starts == 3 and none.batch.shared_starts == 0
    assert more.cached == {**on.cached, "s0-again": len(systems[0])}
    assert list(more.batch._starts) == [tuple(systems[1]), tuple(systems[0]), tuple(systems[2])]
    assert set(none.cached.values()) == {0} and not none.batch._starts
    # (the memory check counts N: more snapshots than the memory holds are refused, naming the option)
    with pytest.raises(DFlashError, match=r"^the caches of max_batch_size 1 x max_context 64 \+ shared_starts "
                                          r"1000000000000 snapshots need .*; lower one of them"):
        BatchDecoder(target, drafter, max_batch_size=1, max_context=64, shared_starts=10**12)
    # (the memory check counts them as the slots' checkpoints: one copy of the recurrent state and rings each)
    _, max_rows, draft_rows = cache_sizes(200, C, on.batch.block_size)
    for t, n in ((on, 2), (more, 3)):
        held = [x for part in t.batch._starts.values() for tensors in part if tensors is not None for x in tensors]
        assert sum(x.numel() * x.element_size() for x in held) == cache_bytes(
            target, drafter, 0, t.batch.target_kv.capacity, max_rows, False, draft_rows, n)


@pytest.mark.parametrize("models", ["agree_models", "qwen35_models", "ring_models"],
                         ids=["attention", "qwen35-hybrid", "gpt-oss-rings"])
def test_prefix_slots_keep_more_conversations_than_the_batch_holds(request, models):
    """Fixed shapes, two slots and three prefix slots: five conversations take a turn each
    (one at a time, beside another sequence decoding), then a second turn each, the most
    recent first: the four most recent find all their rows (one in the free slot, which
    padding rows run past, three in prefix slots, which no round touches), the first none;
    with no prefix slots only the last one's are kept (in the one free slot). Every turn
    decodes as with reuse off."""
    target, drafter = request.getfixturevalue(models)
    runs = {}
    for reuse, extra in ((True, 3), (True, 0), (False, 0)):
        t = Turns.of(target, drafter, 2, reuse, prefix_slots=extra, static=True)
        batch = t.batch
        assert batch.target_kv.k[0].shape[0] == 2 + extra
        t.join("o", [3] + varied_prompts(target, 1, seed=80, length=8)[0], SAMPLED, 150)
        first = {k: [4 + k] + varied_prompts(target, 1, seed=81 + k, length=C + 2 * k)[0] for k in range(5)}
        for k, p in first.items():
            t.join(k, p, GREEDY, 6 + k)
            t.until_gone(k)
        reused = [0] * 5
        for k in reversed(range(5)):  # (the most recent first: each miss replaces the least recently used rows)
            before = batch.reused_prefill_tokens
            t.join(("next", k), t.valid(k, first[k]) + MORE, GREEDY, 5)
            t.until_gone(("next", k))
            reused[k] = batch.reused_prefill_tokens - before
        assert "o" in batch
        t.until_gone("o")
        runs[reuse, extra] = t, reused
    (on, reused), (_, reused_few), (off, reused_off) = runs[True, 3], runs[True, 0], runs[False, 0]
    full = [len(on.valid(k, on.prompts[k])) for k in range(5)]
    assert reused == [0] + full[1:] and reused_few == [0] * 4 + full[4:] and reused_off == [0] * 5
    same_runs(on, off)
    same_runs(runs[True, 0][0], off)


def test_prefix_slots_are_checked(agree_models, tiny_pair, agree_hybrid_pair, tmp_path, capsys):  # noqa: F811
    """``prefix_slots`` and ``shared_starts`` (the batch decoder, the engine, ``serve``'s
    flags): integers >= 0, refused where they would have no effect (a value other than the
    default), and given to the batch decoder."""
    from dflash_torch import cli
    from dflash_torch.cli import main as cli_main
    from dflash_torch.errors import OptionError

    target, drafter = agree_models
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(OptionError, match=rf"^prefix_slots must be an integer >= 0, got {bad!r}$"):
            BatchDecoder(target, drafter, max_batch_size=1, max_context=64, prefix_slots=bad)
        with pytest.raises(OptionError, match=rf"^shared_starts must be an integer >= 0, got {bad!r}$"):
            BatchDecoder(target, drafter, max_batch_size=1, max_context=64, shared_starts=bad)
        with pytest.raises(OptionError, match=rf"^shared_starts must be an integer >= 0, got {bad!r}$"):
            DFlashEngine.from_pretrained(*tiny_pair, shared_starts=bad)
    for value in (0, 3):
        with pytest.raises(OptionError, match=r"^shared_starts has no effect with reuse_prefix off \(its snapshots "
                                              r"serve prefix reuse only\); drop it$"):
            BatchDecoder(target, drafter, max_batch_size=1, max_context=64, reuse_prefix=False, shared_starts=value)
        with pytest.raises(OptionError, match=r"^shared_starts has no effect with draft_mode 'recompute' "):
            DFlashEngine.from_pretrained(*tiny_pair, draft_mode="recompute", shared_starts=value)
    assert BatchDecoder(target, drafter, max_batch_size=1, max_context=64, reuse_prefix=False,
                        shared_starts=2).shared_starts == 0  # (the default: accepted)
    # (the engine's option, and serve's flag, reach a hybrid target's batch decoder)
    engine = DFlashEngine.from_pretrained(*agree_hybrid_pair, max_batch_size=1, max_context=64, shared_starts=3)
    assert engine.batch_decoder().shared_starts == 3
    for flags, n in (([], 2), (["--shared-starts", "0"], 0), (["--shared-starts", "5"], 5)):
        args = cli.build_parser().parse_args(["serve", "--target", str(agree_hybrid_pair[0]), "--draft",
                                              str(agree_hybrid_pair[1]), "--max-context", "64", *flags])
        assert cli.load_engine(args).batch_decoder().shared_starts == n
    with pytest.raises(OptionError, match="^prefix_slots hold retained prefixes, which reuse_prefix off never keeps; "
                                          "drop it$"):
        DFlashEngine.from_pretrained(*tiny_pair, reuse_prefix=False, prefix_slots=2)
    with pytest.raises(OptionError, match=r"^prefix_slots has no effect with draft_mode 'recompute' \(it decodes one "
                                          r"sequence at a time, keeping the last one's rows only\); drop it$"):
        DFlashEngine.from_pretrained(*tiny_pair, draft_mode="recompute", prefix_slots=2)
    loaded = DFlashEngine.from_pretrained(*tiny_pair, max_context=64)  # (the constructor refuses them too: trial-316 b)
    for option, value in (("prefix_slots", 2), ("shared_starts", 3)):
        with pytest.raises(OptionError, match=rf"^{option} has no effect with draft_mode 'recompute' "):
            DFlashEngine(loaded.target, loaded.tokenizer, loaded.drafter, draft_mode="recompute", **{option: value})
    engine = DFlashEngine.from_pretrained(*tiny_pair, max_batch_size=2, max_context=64, prefix_slots=3)
    assert engine.batch_decoder().slots == 5 and engine.batch_decoder().target_kv.k[0].shape[0] == 5
    pair = ["--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1])]
    serial = "(one sequence at a time, which keeps the last request's rows only)"
    for args, why in ((["--no-prefix-reuse"], "--no-prefix-reuse (no prefix is reused)"),
                      (["--max-batch-size", "1"], f"--max-batch-size 1 {serial}"),
                      (["--draft-mode", "recompute"], f"--draft-mode recompute {serial}")):
        for flag in ("--prefix-slots", "--shared-starts"):
            assert cli_main(["serve", *pair, flag, "3", *args]) == 2
            err = capsys.readouterr().err
            assert err == f"dflash-torch: error: {flag} has no effect with {why}; drop it\n"
        assert cli_main(["serve", *pair, "--shared-starts", "-1", *args]) == 2
        assert capsys.readouterr().err == "dflash-torch: error: --shared-starts must be an integer >= 0, got -1\n"


OPEN = [5, 6]  # a chat template's opening of the reply (outside the varied prompts' set, as MORE)


def chat_turns(target, drafter, reuse: bool, checkpoint: bool, add: bool):
    """A chat of three turns and a retry of the third, on three slots while another sequence
    decodes (it leaves during turn 2: the turns' slots move), each turn's prompt its history
    then ``OPEN``; the next history renders the reply otherwise than it was generated (its
    first token replaced, as a template that strips the thinking), so the next prompt
    leaves the last one where its history ends. With ``checkpoint``, each turn gives that
    position (:meth:`BatchDecoder.join` / ``add``'s ``checkpoint``). Before each turn a
    short unrelated request passes through the slot the turn takes. -> the Turns, the
    histories' lengths and the prompt rows reused per turn."""
    t = Turns.of(target, drafter, 3, reuse)
    batch = t.batch
    t.join("o", varied_prompts(target, 1, seed=40, length=9)[0], GREEDY, 70)
    history, lengths, reused = varied_prompts(target, 1, seed=41, length=2 * C + 3)[0], [], []
    for k, (budget, params) in enumerate(((20, GREEDY), (25, SAMPLED), (15, GREEDY), (15, GREEDY))):
        if k in (1, 2):
            history = history + OPEN[:1] + [4] + t.out[k - 1][1:t.budgets[k - 1]] + MORE
        if k:
            t.join(("z", k), [3] + varied_prompts(target, 1, seed=k, length=5)[0], GREEDY, 5)
            t.until_gone(("z", k))
        lengths.append(len(history))
        before = batch.reused_prefill_tokens
        (t.add if add else t.join)(k, history + OPEN, params, budget, **({"checkpoint": len(history)} if checkpoint else {}))
        t.until_gone(k)
        reused.append(batch.reused_prefill_tokens - before)
    t.until_gone("o")
    return t, lengths, reused


@pytest.mark.parametrize("add", [False, True], ids=["join", "add"])
@pytest.mark.parametrize("models", ["agree_models", "qwen35_models", "hybrid_models", "ring_models"],
                         ids=["attention", "qwen35-hybrid", "qwen3-next-hybrid-moe", "gpt-oss-rings"])
def test_a_chat_checkpoint_lets_the_next_turn_reuse_its_history(request, models, add):
    """Where the template renders the last reply otherwise than it was generated, the next
    turn leaves the last prompt where its messages end. A hybrid or ring model, whose
    checkpoint is at the prompt's end by default, reuses nothing of it; given the history's
    end as ``checkpoint``, it keeps its checkpoint there and reuses exactly the history (an
    attention model, with or without one, the common start), and the retry of turn 2 reuses
    its history (a hybrid model) or all of it (attention: its last logits are kept). Every turn decodes
    as with reuse off, through join and through add."""
    target, drafter = request.getfixturevalue(models)
    on, lengths, reused = chat_turns(target, drafter, True, True, add)
    off, lengths_off, reused_off = chat_turns(target, drafter, False, True, add)
    _, _, at_end = chat_turns(target, drafter, True, False, add)
    assert lengths == lengths_off and reused_off == [0, 0, 0, 0]
    same_runs(on, off)
    assert [on.cached[k] for k in range(4)] == reused  # (each prefill Round's cached_tokens)
    if models == "agree_models":  # (the common start: the history and the opening's first token; the retry: all)
        assert reused == [0, lengths[0] + 1, lengths[1] + 1, lengths[2] + len(OPEN)]
    else:
        assert reused == [0, lengths[0], lengths[1], lengths[2]]
    assert on.result(3)[0] == on.result(2)[0]
    assert at_end == (reused if models == "agree_models" else [0, 0, 0, lengths[2] + len(OPEN)])


def test_a_checkpoint_is_checked(agree_models):  # noqa: F811 (the imported fixture)
    """``checkpoint`` and ``shared_end`` must be positions inside the prompt: anything else is
    refused by join and add, and the batch is left as it was."""
    target, drafter = agree_models
    batch = BatchDecoder(target, drafter, max_batch_size=1, max_context=64, prefill_chunk=C)
    for bad in (0, 6, -1, True, 2.0, "3"):
        for call in (batch.join, batch.add):
            for name in ("checkpoint", "shared_end"):
                with pytest.raises(DFlashError, match=rf"{name} must be None or a position in \(0, 5\]"):
                    call("a", [1, 2, 3, 4, 5], GREEDY, 4, **{name: bad})
    assert batch.seq_ids == [] and batch.free_slots == 1


@pytest.mark.parametrize("models", ["agree_models", "qwen35_models", "hybrid_models", "ring_models"],
                         ids=["attention", "qwen35-hybrid", "qwen3-next-hybrid-moe", "gpt-oss-rings"])
def test_the_same_prompt_again_is_not_read(request, models):
    """A prompt sent again (a regenerated reply, a retry) reuses all of its rows and the
    kept last logits: the target reads none of it (a hybrid target too: its checkpoint is
    the state at that prompt's end), through join and through add; each run decodes as
    with reuse off (the seeded repeat gives the first run's tokens)."""
    target, drafter = request.getfixturevalue(models)
    runs = {}
    for reuse in (True, False):
        t = Turns.of(target, drafter, 2, reuse)
        batch = t.batch
        p = varied_prompts(target, 1, seed=49, length=C + 7)[0]
        read, reused = [], []
        for k, params in enumerate((SAMPLED, SAMPLED, GREEDY)):
            before = batch.prefill_tokens, batch.reused_prefill_tokens
            if k < 2:
                t.join(k, p, params, 12)
            else:  # (add: its prefill now, not in a step)
                t.add(k, p, params, 12)
            t.until_gone(k)
            read.append(batch.prefill_tokens - before[0])
            reused.append(batch.reused_prefill_tokens - before[1])
        runs[reuse] = t, read, reused
    (on, read, reused), (off, read_off, reused_off) = runs[True], runs[False]
    n = len(on.prompts[0])
    assert read == [n, 0, 0] and reused == [0, n, n]
    assert read_off == [n, n, n] and reused_off == [0, 0, 0]
    same_runs(on, off)
    assert on.result(0)[0] == on.result(1)[0]


@pytest.mark.parametrize("mode", ["fixed-shapes", "compiled"])
def test_fixed_shapes_and_compiled_reuse_without_new_graphs(agree_models, mode):  # noqa: F811 (the imported fixture)
    """Fixed shapes (compiled with the "eager" backend: TorchDynamo's guards decide
    recompilation): turn 0 leaves its rows in the top slot (3); three sequences then decode
    with a padding row in that slot (run past the retained rows), and turn 1 joins into it
    and reuses the rows in place. No graph is built after warmup() and every sequence
    decodes as with reuse off."""
    import torch._dynamo
    import torch._dynamo.utils as dynamo_utils

    target, drafter = agree_models
    kw = dict(static=True) if mode == "fixed-shapes" else dict(compile=True, compile_backend="eager")
    runs = {}
    for reuse in (True, False):
        torch._dynamo.reset()
        dynamo_utils.counters.clear()
        batch = BatchDecoder(target, drafter, max_batch_size=4, max_context=200, prefill_chunk=32, reuse_prefix=reuse,
                             **kw)
        batch.warmup()
        graphs, frames = dynamo_utils.counters["stats"]["unique_graphs"], dynamo_utils.counters["frames"]["total"]
        t = Turns(batch)
        p0 = varied_prompts(target, 1, seed=47, length=C + 5)[0]
        t.join(0, p0, GREEDY, 20)
        t.until_gone(0)
        kept = sorted(batch._retained) if reuse else []
        for j in range(3):
            t.join(("o", j), [3 + j] + varied_prompts(target, 1, seed=50 + j, length=6)[0], SAMPLED, 40 + 5 * j)
        for _ in range(4):
            t.step()
        assert batch.free_slots == 1 and (not reuse or 3 in batch._retained)
        p1 = p0 + t.out[0][:20] + MORE
        before = batch.reused_prefill_tokens
        t.join(1, p1, GREEDY, 20)
        t.until_gone(1)
        reused = batch.reused_prefill_tokens - before
        for j in range(3):
            t.until_gone(("o", j))
        assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs, "a graph was built after warm-up"
        assert dynamo_utils.counters["frames"]["total"] == frames, "a frame was re-traced after warm-up"
        runs[reuse] = t, kept, reused
    (on, kept, reused), off = runs[True], runs[False][0]
    assert kept == [3] and reused == len(p0) + min(20, len(on.out[0]) - 1)
    same_runs(on, off)


def test_fixed_shapes_drop_a_retained_prefix_beyond_the_rounds_keys(agree_models):  # noqa: F811 (the imported fixture)
    """Fixed shapes: a long turn leaves 270 rows in the top slot; three short sequences
    decode (a 256-key bucket) with a padding row in that slot, which cannot run past 270
    rows inside 256 keys: the prefix is dropped (not overwritten), the follow-up turn reads
    its prompt whole, and every sequence decodes as with reuse off."""
    target, drafter = agree_models
    runs = {}
    for reuse in (True, False):
        batch = BatchDecoder(target, drafter, max_batch_size=4, max_context=300, prefill_chunk=32, static=True,
                             reuse_prefix=reuse)
        t = Turns(batch)
        long = varied_prompts(target, 1, seed=48, length=250)[0]
        assert long[0] not in (3, 4, 5)
        t.join("long", long, GREEDY, 21)
        t.until_gone("long")
        kept = sorted((i, len(r.ids)) for i, r in batch._retained.items())
        for j in range(3):
            t.join(("p", j), [3 + j] + varied_prompts(target, 1, seed=60 + j, length=6)[0], GREEDY, 12)
        t.step()
        t.step()
        dropped = 3 not in batch._retained
        for j in range(3):
            t.until_gone(("p", j))
        before = batch.reused_prefill_tokens
        t.join("more", long + t.out["long"][:21] + MORE, GREEDY, 10)
        t.until_gone("more")
        runs[reuse] = t, kept, dropped, batch.reused_prefill_tokens - before
    (on, kept, dropped, reused), off = runs[True], runs[False][0]
    assert len(kept) == 1 and kept[0][0] == 3 and kept[0][1] + 16 > 256 and dropped and reused == 0
    same_runs(on, off)


def test_generate_batch_reuses_the_last_turn(agree_pair):
    """Through the engine: the second call's prompt is the first's prompt + its reply + a
    message; it reuses the first's rows (``reused_prefill_tokens``) and gives the tokens of
    an engine with reuse off; reuse_prefix must be a bool."""
    results, counts = {}, {}
    for reuse in (True, False):
        engine = DFlashEngine.from_pretrained(*agree_pair, max_batch_size=2, max_context=256, reuse_prefix=reuse)
        prompt = list(range(20, 20 + 120))
        first = engine.generate_batch([prompt], max_new_tokens=24, ignore_eos=True)[0]
        follow = prompt + first.token_ids + MORE
        before = engine.batch_decoder().reused_prefill_tokens
        second = engine.generate_batch([follow, prompt], max_new_tokens=[16, 10], temperature=[0.9, 0.0], seed=5,
                                       ignore_eos=True)
        results[reuse] = [first.token_ids] + [r.token_ids for r in second]
        counts[reuse] = engine.batch_decoder().reused_prefill_tokens - before
    assert results[True] == results[False]
    assert counts[False] == 0 and counts[True] >= len(prompt) + 24 - 1 + len(prompt) - 1
    with pytest.raises(DFlashError, match="^reuse_prefix must be True or False, got 1$"):
        BatchDecoder(engine.target, engine.drafter, max_batch_size=1, max_context=64, reuse_prefix=1)
    with pytest.raises(DFlashError, match="^reuse_prefix must be True or False, got 'yes'$"):
        DFlashEngine.from_pretrained(*agree_pair, reuse_prefix="yes")


def test_the_same_prompt_again_behind_a_chunk_over_the_prefill_budget(agree_models):  # noqa: F811 (the imported fixture)
    """A prefill budget below the chunk: a step whose first joiner read a whole chunk (over
    the budget) still takes the next joiner's prompt reused whole (it reads nothing), in
    that step; it used to stop there, losing the kept logits, and fail the next step on an
    empty chunk. Every sequence decodes as with reuse off."""
    target, drafter = agree_models
    runs = {}
    for reuse in (True, False):
        t = Turns.of(target, drafter, 3, reuse, prefill_budget=C // 2)
        batch = t.batch
        p = varied_prompts(target, 1, seed=50, length=9)[0]
        t.join(0, p, GREEDY, 3)
        t.until_gone(0)
        t.join("x", [3] + varied_prompts(target, 1, seed=51, length=9)[0], GREEDY, 40)  # (steps with a round: bounded)
        t.step()
        t.join("q", varied_prompts(target, 1, seed=52, length=C)[0], GREEDY, 5)  # one chunk, over the budget
        t.join(1, p, GREEDY, 5)
        before = batch.prefill_tokens
        t.step()
        both = "q" in t.out and 1 in t.out
        t.until_gone(1)
        t.until_gone("q")
        t.until_gone("x")
        runs[reuse] = t, both, batch.prefill_tokens - before
    (on, both, read), (off, _, read_off) = runs[True], runs[False]
    assert both and read == C and read_off == C + len(p)
    same_runs(on, off)



def target_alone(target, prompt, n: int) -> list[int]:
    """The first ``n`` tokens of target-only greedy decoding of ``prompt`` alone (prefill chunks of ``C``)."""
    from conftest import run_rounds
    from dflash_torch.decoding import SpeculativeDecoder

    return run_rounds(SpeculativeDecoder(target, None, prefill_chunk=C), prompt, n)[0]


def leave_in_prefill(batch: BatchDecoder, out: dict, budgets: dict, prompt, chunks: int, sid="gone", **join) -> None:
    """``prompt`` joins as ``sid`` and leaves after ``chunks`` steps, each reading one chunk
    of it (:func:`one_chunk_steps`), as a server's request that went away in its prefill."""
    budgets[sid] = 10
    batch.join(sid, prompt, GREEDY, 10, **join)
    for _ in range(chunks):
        assert sid not in one_chunk_steps(batch, out, budgets)
    batch.remove(sid)


def one_chunk_steps(batch: BatchDecoder, out: dict, budgets: dict, until=None) -> dict:
    """Steps that read at most one prefill chunk each (``stop`` says so after it), gathering
    tokens in ``out`` and removing each sequence once it has its budget; one step, or
    (``until``: a seq_id) until that sequence has left. -> the last step's rounds."""
    for _ in range(300):
        rounds = batch.step(stop=lambda: True)
        for sid, rnd in rounds.items():
            out.setdefault(sid, []).append(rnd)
        for sid in batch.seq_ids:
            if sum(len(r.tokens) for r in out.get(sid, [])) >= budgets[sid]:
                batch.remove(sid)
        if until is None or until not in batch:
            return rounds
    raise AssertionError(f"{until!r} did not finish")


@pytest.mark.parametrize("mode", ["alone", "beside-streams-fixed-shapes"])
def test_a_joiner_that_leaves_in_its_prefill_keeps_its_chunks_for_the_next_prompt(agree_models, mode):  # noqa: F811
    """A prompt of 5 chunks joins and leaves after 2 (a request that went away in its
    prefill): the 32 rows of those chunks stay as a retained prefix in its slot, without
    logits; a prompt then prefilled there takes exactly the rows it shares with them, its
    last token read: the same prompt again (a retry: 32), an extension (32, through add),
    one that shares 20 tokens (20), one shorter than the rows (24 of its 25), the rows' own
    tokens (31 of 32: not taken as "the same prompt again", whose logits were never read),
    one that differs right after them (32); each decodes as target-only greedy decoding
    alone. ``beside-streams-fixed-shapes``: three streams decode meanwhile in fixed-shape
    rounds, whose padding row runs in the joiner's slot past the part read."""
    target, drafter = agree_models
    p = varied_prompts(target, 1, seed=53, length=4 * C + 5)[0]
    cases = {"retry": (p, 2 * C), "extends": (p + MORE, 2 * C), "shares-part": (p[:20] + MORE, 20),
             "shorter": (p[:25], 24), "its-rows": (p[:2 * C], 2 * C - 1), "differs-after-them": (p[:2 * C] + MORE, 2 * C)}
    static = mode != "alone"
    for name, (prompt, reused) in cases.items():
        batch = BatchDecoder(target, drafter, max_batch_size=4, max_context=200, prefill_chunk=C, static=static)
        out, budgets = {}, {}
        for j in range(3 if static else 0):
            budgets[("o", j)] = 150
            batch.add(("o", j), [3 + j] + varied_prompts(target, 1, seed=60 + j, length=6)[0], GREEDY, 150)
        slot = len(batch.seq_ids)
        leave_in_prefill(batch, out, budgets, p, 2)
        assert {i: r.ids for i, r in batch._retained.items()} == {slot: p[:2 * C]}, name
        before = batch.prefill_tokens, batch.reused_prefill_tokens
        budgets[name] = 12
        if name == "extends":  # (its prefill now, alone)
            out[name] = [batch.add(name, prompt, GREEDY, 12)]
        else:
            batch.join(name, prompt, GREEDY, 12)
        one_chunk_steps(batch, out, budgets, until=name)
        assert out[name][0].cached_tokens == reused, name
        assert batch.reused_prefill_tokens - before[1] == reused, name
        assert batch.prefill_tokens - before[0] == len(prompt) - reused, name
        assert sum((r.tokens for r in out[name]), [])[:12] == target_alone(target, prompt, 12), name


def test_a_shared_prefill_left_by_its_first_holder_goes_on_for_the_next(agree_models):  # noqa: F811
    """Two sequences share a prompt's prefill; the first leaves after 2 of its 5 chunks: the
    second takes over its place and the part read (nothing is retained, nothing read again),
    and decodes as target-only greedy decoding alone."""
    target, drafter = agree_models
    p = varied_prompts(target, 1, seed=53, length=4 * C + 5)[0]
    batch = BatchDecoder(target, drafter, max_batch_size=2, max_context=200, prefill_chunk=C)
    out, budgets = {}, {"gone": 10, "twin": 12}
    batch.join("gone", p, GREEDY, 10)
    batch.join("twin", p, GREEDY, 12)
    for _ in range(2):
        assert not one_chunk_steps(batch, out, budgets)
    batch.remove("gone")
    assert batch._retained == {} and batch.seq_ids == ["twin"]
    one_chunk_steps(batch, out, budgets, until="twin")
    assert batch.prefill_tokens == len(p) and batch.reused_prefill_tokens == 0 and out["twin"][0].cached_tokens == 0
    assert sum((r.tokens for r in out["twin"]), [])[:12] == target_alone(target, p, 12)


@pytest.mark.parametrize("models", ["qwen35_models", "ring_models"], ids=["qwen35-hybrid", "gpt-oss-rings"])
def test_a_hybrid_or_ring_target_keeps_no_rows_of_a_joiner_that_leaves_in_its_prefill(request, models):
    """A hybrid target's recurrent state and a sliding-window target's rings are kept where a
    prompt ended or was checkpointed only: a joiner that leaves after 2 of its 5 chunks keeps
    nothing (as SpeculativeDecoder on such targets), and the same prompt again is read whole
    and decodes as target-only greedy decoding alone."""
    target, drafter = request.getfixturevalue(models)
    p = varied_prompts(target, 1, seed=53, length=4 * C + 5)[0]
    batch = BatchDecoder(target, drafter, max_batch_size=2, max_context=200, prefill_chunk=C)
    out, budgets = {}, {"again": 12}
    leave_in_prefill(batch, out, budgets, p, 2)
    assert batch._retained == {} and batch.prefill_tokens == 2 * C
    batch.join("again", p, GREEDY, 12)
    one_chunk_steps(batch, out, budgets, until="again")
    assert batch.prefill_tokens == 2 * C + len(p) and batch.reused_prefill_tokens == 0
    assert sum((r.tokens for r in out["again"]), [])[:12] == target_alone(target, p, 12)


def test_a_joiner_that_leaves_in_its_prefill_keeps_the_rows_it_reused_too(agree_models):  # noqa: F811
    """A finished sequence leaves the rows of a prompt sharing 40 tokens with ``p``. A joiner
    of ``p`` that takes those 40 and leaves before reading a chunk adds no retained prefix
    (that one holds them; no duplicate); one that takes them, reads a chunk and leaves keeps
    all 56 rows, which the same prompt then reuses; each decodes as target-only greedy alone."""
    target, drafter = agree_models
    p = varied_prompts(target, 1, seed=53, length=4 * C + 5)[0]
    batch = BatchDecoder(target, drafter, max_batch_size=3, max_context=200, prefill_chunk=C)
    out, budgets = {}, {"a": 8, "x": 100, "again": 12, "later": 12}
    batch.join("a", p[:40] + MORE, GREEDY, 8)
    one_chunk_steps(batch, out, budgets, until="a")
    assert [r.ids[:44] for r in batch._retained.values()] == [p[:40] + MORE]
    batch.join("x", [3] + varied_prompts(target, 1, seed=61, length=C - 1)[0], GREEDY, 100)  # (one chunk)
    budgets["gone"] = 10
    batch.join("gone", p, GREEDY, 10)
    before = batch.reused_prefill_tokens
    assert set(one_chunk_steps(batch, out, budgets)) == {"x"}  # x's chunk; "gone" takes 40 rows, reads none
    assert batch.reused_prefill_tokens - before == 40
    batch.remove("gone")
    assert [r.ids[:44] for r in batch._retained.values()] == [p[:40] + MORE]
    leave_in_prefill(batch, out, budgets, p, 1)  # takes the 40 rows again, reads 16 more
    assert sorted(len(r.ids) for r in batch._retained.values() if r.ids == p[:56]) == [56]
    for sid in ("again", "later"):  # ("later": "again"'s rows, 69 + 11, reused)
        before = batch.reused_prefill_tokens
        batch.join(sid, p, GREEDY, 12)
        one_chunk_steps(batch, out, budgets, until=sid)
        assert batch.reused_prefill_tokens - before == (56 if sid == "again" else len(p)), sid
        assert sum((r.tokens for r in out[sid]), [])[:12] == target_alone(target, p, 12), sid
