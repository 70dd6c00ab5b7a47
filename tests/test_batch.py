"""Batched decoding (dflash_torch.batch): every sequence's output in a batch equals its
output decoded alone (float32 greedy token for token; sampling with the same seed), for
mixed prompt lengths, budgets and stops, with sequences joining and leaving mid-run,
freed slots reused, finished sequences held as padding, target-only, DFlash 2, hybrid
(Gated DeltaNet) targets and targets whose sliding-window layers keep rings."""

from __future__ import annotations

import pytest
import torch

from conftest import drafter_config, edited_checkpoint, make_hybrid_target, run_rounds, save_drafter, varied_prompts

from dflash_torch import DFlashEngine, DFlashError, SamplingParams
from dflash_torch.batch import BatchDecoder
from dflash_torch.decoding import SpeculativeDecoder
from dflash_torch.models.drafter import DFlashDrafter
from dflash_torch.models.target import TargetModel


@pytest.fixture(scope="module")
def agree_models(agree_pair):
    target_dir, drafter_dir = agree_pair
    return TargetModel.from_pretrained(target_dir, torch.float32), DFlashDrafter.from_pretrained(drafter_dir, torch.float32)


@pytest.fixture(scope="module")
def ring_models(agree_gpt_oss_pair, tmp_path_factory):
    """A gpt-oss target (sliding window 8 on layers 0 and 2: with prefill chunks of
    ``CHUNK_TOKENS`` its sliding layers keep rings of 8 + 16 - 1 rows, which the sequences
    here wrap around many times) and its agreeable drafter (B = 16) with a sliding window of
    8 on its first layer (a ring of 8 + 64 + 16 - 1 rows: a backlog of injections is one write)."""
    target_dir, drafter_dir = agree_gpt_oss_pair
    drafter_dir = edited_checkpoint(drafter_dir, tmp_path_factory.mktemp("ring-drafter") / "d", config=lambda c: c.update(
        layer_types=["sliding_attention", "full_attention"], sliding_window=8, use_sliding_window=True))
    return TargetModel.from_pretrained(target_dir, torch.float32), DFlashDrafter.from_pretrained(drafter_dir, torch.float32)


@pytest.fixture(scope="module")
def hybrid_models(agree_hybrid_pair):
    """A hybrid (Gated DeltaNet + attention, experts) Qwen3-Next target and its agreeable drafter."""
    target_dir, drafter_dir = agree_hybrid_pair
    return TargetModel.from_pretrained(target_dir, torch.float32), DFlashDrafter.from_pretrained(drafter_dir, torch.float32)


@pytest.fixture(scope="module")
def qwen35_models(tmp_path_factory):
    """A tiny random Qwen3.5 hybrid target (Gated DeltaNet + attention, dense) and a random drafter."""
    root = tmp_path_factory.mktemp("qwen35-batch")
    target_dir = make_hybrid_target(root / "target", "qwen3_5_text", seed=2, tokenizer=False)
    drafter_dir = save_drafter(root / "drafter", drafter_config(target_dir, block_size=8))
    return TargetModel.from_pretrained(target_dir, torch.float32), DFlashDrafter.from_pretrained(drafter_dir, torch.float32)


@pytest.fixture(scope="module")
def agree_engine(agree_pair):
    return DFlashEngine.from_pretrained(*agree_pair, max_batch_size=3, max_context=256)


def mixed_prompts(target, n=5):
    """Prompts of lengths 3 to 40 whose continuations switch between the drafter's token
    and others (so acceptance lengths differ between sequences and rounds)."""
    lengths = [3, 12, 5, 40, 7, 20, 9]
    return [varied_prompts(target, 1, seed=i, length=lengths[i % len(lengths)])[0] for i in range(n)]


def drive(batch: BatchDecoder, plan: list[tuple], n_rounds: int = 200, join: bool = False) -> dict:
    """Run the step API: ``plan`` holds ``(round, action, seq_id, prompt, params, budget)``
    with action ``"add"`` or ``"remove"``, applied before that round (an add waits for a
    free slot; ``join``: it joins, its prefill runs in the steps); a sequence is also
    removed once it has ``budget`` tokens. Returns ``{seq_id: committed tokens}`` (cut to budget)."""
    out, budgets, todo = {}, {}, list(plan)
    for r in range(n_rounds):
        for item in list(todo):
            when, action, sid, prompt, params, budget = item
            if when > r or (action == "add" and not batch.free_slots):
                continue
            todo.remove(item)
            if action == "add" and join:
                batch.join(sid, prompt, params, budget)
                out[sid], budgets[sid] = [], budget
            elif action == "add":
                out[sid], budgets[sid] = list(batch.add(sid, prompt, params, budget).tokens), budget
            elif sid in batch:
                batch.remove(sid)
        for sid, rnd in batch.step().items():
            out[sid] += rnd.tokens
        for sid in batch.seq_ids:
            if len(out[sid]) >= budgets[sid]:
                batch.remove(sid)
        if not batch.seq_ids and not todo:
            break
    return {sid: toks[:budgets[sid]] for sid, toks in out.items()}


def join_leave_plan(prompts: list[list[int]]) -> tuple[list[tuple], list[int], list[SamplingParams]]:
    """A :func:`drive` plan over 4 prompts, greedy and seeded sampling mixed: three join,
    the first leaves mid-run (round 4) and the fourth takes its slot; and the budgets and
    sampling parameters of the four."""
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.9, seed=4)
    budgets, params = [40, 25, 30, 20], [greedy, sampled, greedy, sampled]
    plan = [(0, "add", 0, prompts[0], params[0], budgets[0]), (1, "add", 1, prompts[1], params[1], budgets[1]),
            (2, "add", 2, prompts[2], params[2], budgets[2]), (4, "remove", 0, None, None, None),
            (4, "add", 3, prompts[3], params[3], budgets[3])]
    return plan, budgets, params


def alone(target, drafter, prompt, n, params=None, block_size=None):
    return run_rounds(SpeculativeDecoder(target, drafter, block_size=block_size), prompt, n, params)[0]


_ONCE: dict = {}  # (function, id(target), id(drafter), prompt, args) -> (target, drafter, tokens)


def once(fn, target, drafter, prompt, *args) -> list[int]:
    """``fn(target, drafter, prompt, *args)`` (:func:`alone`, :func:`alone_chunked`: a fresh
    decoder, greedy or seeded, so deterministic) decoded once in this module: the tests that
    differ only in how the batch runs (add or join, eager or fixed shapes) share their references."""
    key = (fn.__name__, id(target), id(drafter), tuple(prompt), *args)
    if key not in _ONCE:  # (the entry holds the models: their ids stay theirs)
        _ONCE[key] = target, drafter, fn(target, drafter, prompt, *args)
    return list(_ONCE[key][2])


@pytest.mark.parametrize("models", ["agree_models", "hybrid_models"], ids=["attention", "hybrid"])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, top_k=50, seed=7)],
                         ids=["greedy", "sampling"])
def test_sequences_joining_and_leaving_decode_as_alone(request, models, params):
    """Mixed lengths and budgets; a sequence joins after others ran, one is cancelled
    mid-run, its slot (and a finished one's) is reused; each equals its decode alone.
    Hybrid: each sequence's recurrent state lives in its slot (prefilled from zero in a
    reused slot, moved with its sequence, committed over its own accepted rows)."""
    target, drafter = request.getfixturevalue(models)
    prompts = mixed_prompts(target, 6)
    seeded = lambda i: params if params.greedy else SamplingParams(temperature=0.9, top_k=50, seed=100 + i)
    batch = BatchDecoder(target, drafter, max_batch_size=3, max_context=256)
    budgets = [30, 55, 12, 40, 25, 33]
    plan = [(0, "add", 0, prompts[0], seeded(0), budgets[0]), (0, "add", 1, prompts[1], seeded(1), budgets[1]),
            (2, "add", 2, prompts[2], seeded(2), budgets[2]),
            (3, "remove", 1, None, None, None),  # cancelled mid-run: frees a slot for 3
            (3, "add", 3, prompts[3], seeded(3), budgets[3]),
            (6, "add", 4, prompts[4], seeded(4), budgets[4])]
    out = drive(batch, plan)
    plan2 = [(0, "add", 5, prompts[5], seeded(5), budgets[5])]  # after everything left: slot 0 again
    out.update(drive(batch, plan2))
    assert batch.free_slots == 3
    for sid in (0, 2, 3, 4, 5):
        assert out[sid] == alone(target, drafter, prompts[sid], budgets[sid], seeded(sid)), f"sequence {sid}"
    assert len(out[1]) < budgets[1]  # (it was cancelled)
    assert out[1] == alone(target, drafter, prompts[1], budgets[1], seeded(1))[:len(out[1])]


@pytest.mark.parametrize("models", ["agree_models", "hybrid_models"], ids=["attention", "hybrid"])
def test_finished_sequences_held_as_padding_change_nothing(request, models):
    """A sequence whose budget is used but which stays in the batch runs as padding
    (same positions, nothing committed): the others still decode as alone; a hybrid
    target's recurrent state of the finished sequence stays as it was."""
    target, drafter = request.getfixturevalue(models)
    prompts = mixed_prompts(target, 3)
    batch = BatchDecoder(target, drafter, max_batch_size=3, max_context=128)
    out = {i: list(batch.add(i, p, SamplingParams(), n).tokens) for i, (p, n) in enumerate(zip(prompts, (2, 50, 40)))}
    finished = None
    for _ in range(100):
        rounds = batch.step()
        if not rounds:
            break
        assert (0 in rounds) == (len(out[0]) < 2)  # decoded only until its budget (2) is used
        for sid, rnd in rounds.items():
            out[sid] += rnd.tokens
        if finished is None and len(out[0]) >= 2 and batch.target_state is not None:
            finished = [t[0].clone() for t in batch.target_state.conv + batch.target_state.ssm]
    assert batch.seq_ids == [0, 1, 2]
    for i, n in ((1, 50), (2, 40)):
        assert out[i][:n] == alone(target, drafter, prompts[i], n)
    if batch.target_state is not None:
        assert finished and all(torch.equal(a, t[0]) for a, t in zip(finished, batch.target_state.conv + batch.target_state.ssm))


def test_target_only_batch_equals_target_only_alone(agree_models):
    target, _ = agree_models
    prompts = mixed_prompts(target, 4)
    for params in (SamplingParams(), SamplingParams(temperature=1.1, seed=3)):
        batch = BatchDecoder(target, None, max_batch_size=4, max_context=128)
        assert batch.block_size == 1
        plan = [(i, "add", i, p, params, 20 + 5 * i) for i, p in enumerate(prompts)]
        out = drive(batch, plan)
        for i, p in enumerate(prompts):
            assert out[i] == alone(target, None, p, 20 + 5 * i, params), f"sequence {i}"


def test_dflash2_batch_equals_alone(agree_dflash2_pair):
    target = TargetModel.from_pretrained(agree_dflash2_pair[0], torch.float32)
    drafter = DFlashDrafter.from_pretrained(agree_dflash2_pair[1], torch.float32)
    prompts = mixed_prompts(target, 3)
    for params in (SamplingParams(), SamplingParams(temperature=0.8, seed=11)):
        batch = BatchDecoder(target, drafter, max_batch_size=3, max_context=128)
        out = drive(batch, [(i, "add", i, p, params, 30) for i, p in enumerate(prompts)])
        for i, p in enumerate(prompts):
            assert out[i] == alone(target, drafter, p, 30, params), f"sequence {i}"


def test_generate_batch_equals_generate(agree_engine):
    """More prompts than slots (they queue and join as others finish), per-prompt budgets,
    stops that fire at different rounds, per-prompt sampling seeds."""
    engine = agree_engine
    prompts = mixed_prompts(engine.target, 5)
    budgets = [40, 17, 60, 9, 33]
    greedy = [engine.generate(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, budgets)]
    # a stop token from each greedy output, at a different place in each
    stops = [[g.token_ids[k]] for g, k in zip(greedy, (30, 3, 45, 8, 1))]
    expected = [engine.generate(p, max_new_tokens=n, stop_token_ids=s, ignore_eos=True)
                for p, n, s in zip(prompts, budgets, stops)]
    assert len({len(e.token_ids) for e in expected}) >= 4 and any(e.finish_reason == "stop" for e in expected)
    got = engine.generate_batch(prompts, max_new_tokens=budgets, stop_token_ids=stops, ignore_eos=True)
    for e, g in zip(expected, got):
        assert (g.token_ids, g.text, g.finish_reason) == (e.token_ids, e.text, e.finish_reason)
        assert g.stats.generated_tokens == len(g.token_ids) and g.stats.prompt_tokens == e.stats.prompt_tokens
    # a stop string for all, cut as alone
    text_stop = greedy[2].text[20:23]
    expected = [engine.generate(p, max_new_tokens=n, stop=text_stop, ignore_eos=True) for p, n in zip(prompts, budgets)]
    got = engine.generate_batch(prompts, max_new_tokens=budgets, stop=text_stop, ignore_eos=True)
    assert [(g.text, g.token_ids, g.finish_reason) for g in got] == [(e.text, e.token_ids, e.finish_reason) for e in expected]
    seeds = [5, 6, 7, 8, 9]
    expected = [engine.generate(p, max_new_tokens=n, temperature=0.9, seed=s, ignore_eos=True)
                for p, n, s in zip(prompts, budgets, seeds)]
    got = engine.generate_batch(prompts, max_new_tokens=budgets, temperature=0.9, seed=seeds, ignore_eos=True)
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    assert engine.batch_decoder().free_slots == 3  # every slot was freed


def test_generate_batch_takes_arrays_and_tensors_of_token_ids(agree_engine):
    """Each prompt of generate_batch may be anything generate takes: 1-D NumPy arrays and
    torch tensors of token ids too (they were read as one prompt of scalars and refused);
    a list of scalar ids (NumPy or torch too) is still refused as one prompt."""
    import numpy as np

    engine = agree_engine
    prompts = mixed_prompts(engine.target, 2)
    expected = [engine.generate(p, max_new_tokens=8, ignore_eos=True).token_ids for p in prompts]
    for kind in (np.array, torch.tensor):
        got = engine.generate_batch([kind(p) for p in prompts], max_new_tokens=8, ignore_eos=True)
        assert [g.token_ids for g in got] == expected
        with pytest.raises(DFlashError, match=r"this looks like one prompt .*: pass \[prompt\]$"):
            engine.generate_batch([kind(t) for t in prompts[0]], max_new_tokens=8)


def test_bad_batch_input_is_refused(agree_pair, agree_engine, agree_models):
    engine = agree_engine
    with pytest.raises(DFlashError, match="3 values for 2 prompts"):
        engine.generate_batch([[5, 6], [7]], max_new_tokens=[1, 2, 3])
    # (trial-139: "stop must be a string or a list of strings", for a per-prompt form half given)
    with pytest.raises(DFlashError, match=r"^stop mixes str items and lists: give one list of str items for all "
                                          r"prompts, or one item per prompt, each None or a list of str items$"):
        engine.generate_batch([[5, 6], [7]], stop=[["The"], "data"])
    with pytest.raises(DFlashError, match=r"^stop_token_ids mixes int items and lists"):
        engine.generate_batch([[5, 6], [7]], stop_token_ids=[3, [4]])
    # (per-prompt items given flat, one None among them: it said "stop must be a string or a list of strings")
    with pytest.raises(DFlashError, match=r"^stop mixes str items and None: give one list of str items for all "
                                          r"prompts, or one item per prompt, each None or a list of str items$"):
        engine.generate_batch([[5, 6], [7], [8]], stop=["\n", None, "("])
    with pytest.raises(DFlashError, match="non-empty list"):
        engine.generate_batch([])
    with pytest.raises(DFlashError, match="temperature"):
        engine.generate_batch([[5], [6]], temperature=[0.0, -1.0], max_new_tokens=4)
    with pytest.raises(DFlashError, match="exceeds the context"):
        engine.generate_batch([[5], [6] * 250], max_new_tokens=10)
    with pytest.raises(DFlashError, match="max_batch_size must be an integer >= 1"):
        DFlashEngine.from_pretrained(*agree_pair, max_batch_size=0)
    target, drafter = agree_models
    for tokenizer in (drafter, None, engine):  # (the drafter given second, where the tokenizer goes)
        with pytest.raises(DFlashError, match=rf"^tokenizer must be a transformers tokenizer .*got {type(tokenizer).__name__}"):
            DFlashEngine(target, tokenizer, drafter)
    for decoder in (BatchDecoder, SpeculativeDecoder):
        with pytest.raises(DFlashError, match=r"^target must be a TargetModel, got DFlashEngine \(pass engine.target\)$"):
            decoder(engine, drafter)
        with pytest.raises(DFlashError, match=r"^drafter must be a DFlashDrafter or None, got TargetModel$"):
            decoder(target, target)
    # (trial-310: a drafter of another dtype than the target's was taken, and generate failed inside torch: "expected
    # m1 and m2 to have the same dtype"; so did one on another device)
    drafter_dir = agree_pair[1]
    bf16 = DFlashDrafter.from_pretrained(drafter_dir, torch.bfloat16)
    meta = DFlashDrafter.from_pretrained(drafter_dir, torch.float32).to("meta")
    tokenizer = engine.tokenizer
    for make in (lambda d: DFlashEngine(target, tokenizer, d), lambda d: SpeculativeDecoder(target, d),
                 lambda d: BatchDecoder(target, d, max_batch_size=1, max_context=64)):
        with pytest.raises(DFlashError, match=r"^the drafter's weights are bfloat16 but the target's float32: load both "
                                              r"in one dtype \(DFlashEngine.from_pretrained\(dtype=\.\.\.\) loads both\)$"):
            make(bf16)
        with pytest.raises(DFlashError, match=r"^the drafter is on meta but the target on cpu: load both on one device"):
            make(meta)
    with pytest.raises(DFlashError, match=r"max_batch_size 1000000000 x the target's context, 1024 tokens \(the default "
                                          r"max_context\) need .*; lower either"):
        BatchDecoder(target, drafter, max_batch_size=10**9)
    batch = BatchDecoder(target, drafter, max_batch_size=1, max_context=64)
    with pytest.raises(DFlashError, match="^params must be a SamplingParams, got dict$"):
        batch.add("a", [5, 6], {"temperature": 0.0}, 4)
    with pytest.raises(DFlashError, match="^params must be a SamplingParams, got NoneType$"):
        batch.join("a", [5, 6], None, 4)
    batch.add("a", [5, 6], SamplingParams(), 4)
    with pytest.raises(DFlashError, match="already in the batch"):
        batch.add("a", [5], SamplingParams(), 4)
    with pytest.raises(DFlashError, match="full"):
        batch.add("b", [5], SamplingParams(), 4)
    with pytest.raises(DFlashError, match="not in the batch"):
        batch.remove("b")


def test_step_level_misuse_is_refused_before_it_corrupts_anything(agree_engine, agree_models):
    """helper-29: an unhashable seq_id was taken, then step() failed after moving every cache
    (the other sequences lost a round); a second rounds() silently corrupted an open one;
    rounds() took params None and max_new_tokens 0; prefill_chunk 0 failed deep inside;
    generate_batch failed with a KeyError while batch_decoder() held the user's sequences."""
    from dflash_torch.decoding import SpeculativeDecoder

    target, drafter = agree_models
    p0, p1 = [5, 9, 2, 7], [11, 4, 4, 8, 3]
    batch = BatchDecoder(target, drafter, max_batch_size=2, max_context=64)
    batch.add("good", p0, SamplingParams(), 30)
    with pytest.raises(DFlashError, match=r"^seq_id must be hashable \(e\.g\. an int or a str\), got list$"):
        batch.add(["bad"], p1, SamplingParams(), 30)
    with pytest.raises(DFlashError, match="^seq_id must be hashable"):
        batch.join(["bad"], p1, SamplingParams(), 30)
    out = {"good": []}
    run_to_end(batch, out, {"good": 29})
    assert out["good"][:29] == alone(target, drafter, p0, 30)[1:30]
    for bad in (0, -4, 2.5):
        with pytest.raises(DFlashError, match="prefill_chunk must be an integer >= 1"):
            BatchDecoder(target, drafter, max_batch_size=1, max_context=64, prefill_chunk=bad)
        with pytest.raises(DFlashError, match="prefill_chunk must be an integer >= 1"):
            SpeculativeDecoder(target, drafter, prefill_chunk=bad)

    # (a chunk above the context is the context: the whole prompt in one forward, the same tokens; its
    # buffers were sized by it, 8 bytes a token: 2**40 failed to allocate, trial-168)
    for decoder in (SpeculativeDecoder(target, drafter, max_context=64, prefill_chunk=2**40),
                    SpeculativeDecoder(target, drafter, max_context=64, prefill_chunk=2**40, static=True)):
        assert decoder.prefill_chunk == 64
        assert [t for r in decoder.rounds(p0, SamplingParams(), 6) for t in r.tokens][:6] == alone(target, drafter, p0, 6)
    huge = BatchDecoder(target, drafter, max_batch_size=1, max_context=64, prefill_chunk=2**40)
    assert huge.prefill_chunk == 64
    huge.add("good", p0, SamplingParams(), 30)
    out = {"good": []}
    run_to_end(huge, out, {"good": 29})
    assert out["good"][:29] == alone(target, drafter, p0, 30)[1:30]

    import numpy as np  # (NumPy integers are the same numbers, as everywhere: helper-30)
    numpy_dec = SpeculativeDecoder(target, drafter, prefill_chunk=np.int64(4))
    assert [t for r in numpy_dec.rounds(p0, SamplingParams(), np.int64(6)) for t in r.tokens][:6] == alone(
        target, drafter, p0, 6)
    dec = SpeculativeDecoder(target, drafter)
    with pytest.raises(DFlashError, match="^params must be a SamplingParams, got NoneType$"):
        dec.rounds(p0, None, 8)
    for bad in (0, -5, 2.5):
        with pytest.raises(DFlashError, match="max_new_tokens must be an integer >= 1"):
            dec.rounds(p0, SamplingParams(), bad)
    first = dec.rounds(p0, SamplingParams(), 20)
    next(first), next(first)
    second = [t for r in dec.rounds(p1, SamplingParams(), 20) for t in r.tokens]
    assert second[:20] == alone(target, drafter, p1, 20)[:20]
    with pytest.raises(DFlashError, match="a later rounds\\(\\) call on this SpeculativeDecoder took over its caches"):
        next(first)

    engine = agree_engine
    mine = engine.batch_decoder()
    mine.add("mine", p0, SamplingParams(), 10)
    try:
        with pytest.raises(DFlashError, match="generate_batch cannot run while engine.batch_decoder\\(\\) holds "
                                              "sequences of its own \\(1: e.g. 'mine'\\); remove them first"):
            engine.generate_batch([p1], max_new_tokens=4)
        assert mine.seq_ids == ["mine"]
    finally:
        mine.remove("mine")
    assert engine.generate_batch([p1], max_new_tokens=4)[0].token_ids == engine.generate(p1, max_new_tokens=4).token_ids


def test_yes_no_options_must_be_bools(agree_engine):
    """ignore_eos / chat that are not bools are refused (a string such as "false" is truthy:
    ignore_eos="false" ignored the EOS and chat="no" applied the chat template)."""
    engine = agree_engine
    with pytest.raises(DFlashError, match=r"^prompt 1: ignore_eos must be True or False, got 'false'$"):
        engine.generate_batch([[5], [6]], ignore_eos=[True, "false"], max_new_tokens=2)
    # a value shared by all prompts names no prompt (it said "prompt 0:")
    with pytest.raises(DFlashError, match=r"^ignore_eos must be True or False, got 'false'$"):
        engine.generate_batch([[5], [6]], ignore_eos="false", max_new_tokens=2)
    with pytest.raises(DFlashError, match=r"^temperature must be a finite number >= 0, got -1$"):
        engine.generate_batch([[5], [6]], temperature=-1, max_new_tokens=2)
    with pytest.raises(DFlashError, match=r"^prompt 1: temperature must be a finite number >= 0, got -1$"):
        engine.generate_batch([[5], [6]], temperature=[0.5, -1], max_new_tokens=2)
    with pytest.raises(DFlashError, match=r"^ignore_eos must be True or False, got 1$"):
        engine.generate([5], ignore_eos=1, max_new_tokens=2)
    with pytest.raises(DFlashError, match=r"^chat must be True or False, got 'no'$"):
        engine.generate_batch(["hi"], chat="no", max_new_tokens=2)
    with pytest.raises(DFlashError, match=r"^chat must be True or False, got None$"):
        next(iter(engine.stream("hi", chat=None, max_new_tokens=2)))


def test_hybrid_generate_batch_equals_generate(agree_hybrid_pair):
    """A hybrid target's prompts go through the batch decoder (more prompts than slots),
    each as ``generate`` alone."""
    engine = DFlashEngine.from_pretrained(*agree_hybrid_pair, max_batch_size=2, max_context=64)
    prompts = [[5, 6, 7], [9] * 12, [11, 12]]
    budgets = [12, 20, 7]
    expected = [engine.generate(p, max_new_tokens=n, ignore_eos=True).token_ids for p, n in zip(prompts, budgets)]
    got = engine.generate_batch(prompts, max_new_tokens=budgets, ignore_eos=True)
    assert [g.token_ids for g in got] == expected
    assert engine._batch is not None and engine.batch_decoder().free_slots == 2  # (it went through the batch)


def test_hybrid_batch_runs_each_sequence_on_its_own_state(qwen35_models):
    """A Qwen3.5 hybrid target with a random drafter (B = 8), sampling: tokens and
    acceptance lengths equal each sequence's decode alone, eager and with fixed shapes
    (padding rows run a dummy block on a free slot's state, which nothing reads);
    sequences join after others ran and one leaves mid-run (the last slot's state moves
    into its slot)."""
    target, drafter = qwen35_models
    prompts = [[5, 6, 7], list(range(10, 50)), [9] * 17, [30, 31, 32, 33]]
    params = [SamplingParams(temperature=1.5, seed=40 + i) for i in range(4)]
    budgets = [30, 40, 25, 35]
    expected = [run_rounds(SpeculativeDecoder(target, drafter, block_size=8), p, n, q)
                for p, n, q in zip(prompts, budgets, params)]
    for static in (False, True):
        batch = BatchDecoder(target, drafter, block_size=8, max_batch_size=4, max_context=128, static=static)
        out, taus = {}, {}
        for i in (0, 1, 2):
            out[i], taus[i] = list(batch.add(i, prompts[i], params[i], budgets[i]).tokens), []
        for r in range(100):
            if r == 2:  # joins later; then 0 leaves mid-run: 3 (the last slot) moves into slot 0
                out[3], taus[3] = list(batch.add(3, prompts[3], params[3], budgets[3]).tokens), []
            if r == 4:
                batch.remove(0)
            rounds = batch.step()
            if not rounds:
                break
            for sid, rnd in rounds.items():
                out[sid] += rnd.tokens
                taus[sid].append(rnd.acceptance_length)
        for i in (1, 2, 3):
            assert (out[i][:budgets[i]], taus[i]) == expected[i], f"sequence {i}, static={static}"
        assert out[0] == expected[0][0][:len(out[0])]
        assert max(max(t) for t in taus.values()) > 1
    # target-only (B = 1: each row advances its own state as it runs, nothing deferred)
    batch = BatchDecoder(target, None, max_batch_size=3, max_context=128)
    out = drive(batch, [(i, "add", i, p, params[i], 20) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert out[i] == alone(target, None, p, 20, params[i]), f"target-only sequence {i}"


def test_random_drafter_batch_proposes_as_alone(tiny_pair):
    """A random drafter whose attention matters (unlike the agreeable one's small weights):
    with sampling, every sequence's tokens and acceptance lengths equal its decode alone,
    so each block attends to its own context only."""
    target = TargetModel.from_pretrained(tiny_pair[0], torch.float32)
    drafter = DFlashDrafter.from_pretrained(tiny_pair[1], torch.float32)
    prompts = [[5, 6, 7], list(range(10, 50)), [9] * 17]
    batch = BatchDecoder(target, drafter, block_size=8, max_batch_size=3, max_context=128)
    params = [SamplingParams(temperature=1.5, seed=20 + i) for i in range(3)]
    out = {i: list(batch.add(i, p, params[i], 40).tokens) for i, p in enumerate(prompts)}
    taus = {i: [] for i in out}
    while rounds := batch.step():
        for sid, rnd in rounds.items():
            out[sid] += rnd.tokens
            taus[sid].append(rnd.acceptance_length)
    for i, p in enumerate(prompts):
        tokens, expected_taus = run_rounds(SpeculativeDecoder(target, drafter, block_size=8), p, 40, params[i])
        assert (out[i][:40], taus[i]) == (tokens, expected_taus), f"sequence {i}"
    assert max(max(t) for t in taus.values()) > 1


# --- chunked prefill (join): a long prompt joins while others decode ---

CHUNK_TOKENS = 16  # the prefill chunk of these tests (a prompt of 5 * 16 + 3 tokens reads in 6 chunks)


def alone_chunked(target, drafter, prompt, n, params, block_size=None):
    """Decoding alone with the batch's prefill chunk (the same prefill forwards)."""
    decoder = SpeculativeDecoder(target, drafter, block_size=block_size, prefill_chunk=CHUNK_TOKENS)
    return run_rounds(decoder, prompt, n, params)[0]


def run_to_end(batch: BatchDecoder, out: dict, budgets: dict) -> None:
    """Step until every sequence held has its budget (each removed then); ``out`` gathers tokens."""
    for _ in range(300):
        for sid, rnd in batch.step().items():
            out.setdefault(sid, []).extend(rnd.tokens)
        for sid in batch.seq_ids:
            if len(out.get(sid, [])) >= budgets[sid]:
                batch.remove(sid)
        if not batch.seq_ids:
            return
    raise AssertionError("the batch did not finish")


def churned_batch_equals_alone(target, drafter, prompts, params, mode: str, leaver: int, n_new: int) -> dict:
    """Decode six sequences in one batch with churn (4 join one by one, 3 rounds, ``leaver``
    leaves mid-run, 2 more join; ``n_new`` tokens each, odd ones 4 less) and check that each
    commits what it decodes alone with its params (greedy: target-only; sampled: the drafter
    with the same seed). ``mode``: eager, fixed-shapes, or target-only-rounds (rounds of more
    than 2 sequences run without drafts). Returns the tokens of each sequence that stayed."""
    batch = BatchDecoder(target, drafter, max_batch_size=5, max_context=256, static=mode == "fixed-shapes",
                         draft_max_batch_size=2 if mode == "target-only-rounds" else None)
    budgets = {i: n_new - 4 * (i % 2) for i in range(len(prompts))}
    out = {0: list(batch.add(0, prompts[0], params[0], budgets[0]).tokens)}
    for i in range(1, 4):
        batch.join(i, prompts[i], params[i], budgets[i])
    for _ in range(3):
        for sid, rnd in batch.step().items():
            out.setdefault(sid, []).extend(rnd.tokens)
    batch.remove(leaver)  # leaves mid-run: two others join
    del out[leaver]
    for i in (4, 5):
        batch.join(i, prompts[i], params[i], budgets[i])
    run_to_end(batch, out, budgets)
    assert sorted(out) == sorted(set(range(6)) - {leaver})
    for i in out:
        p = params[i]
        ref = run_rounds(SpeculativeDecoder(target, None if p.greedy else drafter), prompts[i], budgets[i], p)[0]
        assert out[i][:budgets[i]] == ref, (i, p)
    return {i: out[i][:budgets[i]] for i in out}


@pytest.mark.parametrize("static", [False, True], ids=["eager", "fixed-shapes"])
@pytest.mark.parametrize("models", ["agree_models", "hybrid_models", "qwen35_models", "ring_models"],
                         ids=["attention", "hybrid", "qwen35-random-drafter", "gpt-oss-rings"])
def test_a_long_prompt_joins_in_chunks_while_others_keep_decoding(request, models, static):
    """Three sequences decode (greedy and seeded sampling); a prompt of 6 chunks joins:
    during each of the 6 steps that read it every running sequence commits a round, its
    first token comes with the 6th, and every output equals its decode alone. Fixed
    shapes: the round's 4th row is padding in the joiner's slot (it runs past the part
    of the prompt already read, and the joiner's recurrent state is kept)."""
    target, drafter = request.getfixturevalue(models)
    greedy = SamplingParams()
    params = [greedy, SamplingParams(temperature=0.9, seed=31), greedy, SamplingParams(temperature=0.9, seed=32)]
    prompts = mixed_prompts(target, 3) + [varied_prompts(target, 1, seed=9, length=5 * CHUNK_TOKENS + 3)[0]]
    budgets = {0: 150, 1: 150, 2: 150, 3: 40} if models != "qwen35_models" else {0: 40, 1: 40, 2: 40, 3: 30}
    batch = BatchDecoder(target, drafter, max_batch_size=4, max_context=320, prefill_chunk=CHUNK_TOKENS, static=static)
    out = {i: list(batch.add(i, prompts[i], params[i], budgets[i]).tokens) for i in range(3)}
    for sid, rnd in batch.step().items():
        out[sid] += rnd.tokens
    batch.join(3, prompts[3], params[3], budgets[3])
    assert batch.free_slots == 0 and batch.seq_ids == [0, 1, 2, 3]
    for k in range(1, 7):
        rounds = batch.step()
        assert {0, 1, 2} <= set(rounds) and all(rounds[i].acceptance_length >= 1 for i in (0, 1, 2)), k
        assert (3 in rounds) == (k == 6), k
        for sid, rnd in rounds.items():
            out.setdefault(sid, []).extend(rnd.tokens)
    assert rounds[3].acceptance_length is None and len(rounds[3].tokens) == 1
    assert all(len(out[i]) < budgets[i] for i in range(3))  # (they were still decoding)
    run_to_end(batch, out, budgets)
    for i in range(4):
        assert out[i][:budgets[i]] == once(alone_chunked, target, drafter, prompts[i], budgets[i], params[i]), \
            f"sequence {i}"


@pytest.mark.parametrize("models", ["agree_models", "hybrid_models", "ring_models"],
                         ids=["attention", "hybrid", "gpt-oss-rings"])
def test_sequences_leaving_while_a_prompt_is_prefilled(request, models):
    """A joiner partly prefilled moves with the batch: down a slot when a decoding
    sequence leaves, up one when another is added (prefilled at once) in its slot;
    a joiner removed while it waits or while it is prefilled frees its slot at once, and
    the next one starts its prompt from scratch there. Every output equals its decode alone."""
    target, drafter = request.getfixturevalue(models)
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.9, seed=21)
    long_prompts = [varied_prompts(target, 1, seed=s, length=4 * CHUNK_TOKENS + 5)[0] for s in (11, 12, 13)]
    short = mixed_prompts(target, 2)
    params = {0: greedy, 1: sampled, 2: greedy, 3: sampled, 4: greedy}
    prompts = {0: short[0], 1: long_prompts[0], 2: long_prompts[1], 3: short[1], 4: long_prompts[2]}
    budgets = {0: 120, 1: 40, 2: 30, 3: 30, 4: 35}
    batch = BatchDecoder(target, drafter, max_batch_size=3, max_context=256, prefill_chunk=CHUNK_TOKENS)
    out = {0: list(batch.add(0, prompts[0], params[0], budgets[0]).tokens)}
    batch.join(1, prompts[1], params[1], budgets[1])
    batch.join(2, prompts[2], params[2], budgets[2])

    def step():
        rounds = batch.step()
        for sid, rnd in rounds.items():
            out.setdefault(sid, []).extend(rnd.tokens)
        return rounds

    assert set(step()) == {0} and set(step()) == {0}  # 1 has read 2 of its 5 chunks in slot 1
    batch.remove(2)  # waiting: its place is free at once
    assert batch.free_slots == 1 and batch.seq_ids == [0, 1]
    out[3] = list(batch.add(3, prompts[3], params[3], budgets[3]).tokens)  # in slot 1: 1 moves up to slot 2
    assert set(step()) == {0, 3}
    batch.remove(0)  # slot 0 <- 3, slot 1 <- 1's partly read prompt
    assert batch.seq_ids == [3, 1]
    assert set(step()) == {3}
    assert set(step()) == {3, 1}  # 1's fifth chunk: its first token
    batch.join(4, prompts[4], params[4], budgets[4])
    step()
    batch.remove(1)  # 4 has read a chunk in slot 2; 1 leaves slot 1, 4's prompt moves there
    assert batch.free_slots == 1 and batch.seq_ids == [3, 4]
    batch.join(2, prompts[2], params[2], budgets[2])
    step()
    batch.remove(4)  # mid-prefill: its slot is free at once, 2 starts its prompt from scratch there
    assert batch.free_slots == 1 and batch.seq_ids == [3, 2]
    run_to_end(batch, out, budgets)
    assert batch.free_slots == 3
    for i in (2, 3):
        assert out[i][:budgets[i]] == once(alone_chunked, target, drafter, prompts[i], budgets[i], params[i]), \
            f"sequence {i}"
    for i in (0, 1):  # (cancelled)
        assert out[i] == once(alone_chunked, target, drafter, prompts[i], budgets[i], params[i])[:len(out[i])], \
            f"sequence {i}"
    assert 4 not in out


def test_joining_prompts_take_turns_under_the_prefill_budget(agree_models):
    """prefill_budget = 2 chunks: prompts of 3 and 2 chunks join; the first reads 2 chunks,
    then its last and the second's first, then the second's last. A step with no round
    reads the first joiner whole. Each equals its decode alone."""
    target, drafter = agree_models
    C = CHUNK_TOKENS
    prompts = [mixed_prompts(target, 1)[0]] + [varied_prompts(target, 1, seed=s, length=n * C)[0]
                                               for s, n in ((40, 3), (41, 2))]
    params = [SamplingParams(), SamplingParams(temperature=0.9, seed=5), SamplingParams()]
    budgets = {0: 120, 1: 30, 2: 30}
    batch = BatchDecoder(target, drafter, max_batch_size=3, max_context=256, prefill_chunk=C, prefill_budget=2 * C)
    batch.join(0, prompts[0], params[0], budgets[0])
    first = batch.step()  # nothing decodes: 0's prompt is read whole
    assert set(first) == {0} and first[0].acceptance_length is None
    out = {0: list(first[0].tokens)}
    batch.join(1, prompts[1], params[1], budgets[1])
    batch.join(2, prompts[2], params[2], budgets[2])
    joined = []
    for _ in range(3):
        rounds = batch.step()
        joined.append(sorted(sid for sid, rnd in rounds.items() if rnd.acceptance_length is None))
        for sid, rnd in rounds.items():
            out.setdefault(sid, []).extend(rnd.tokens)
    assert joined == [[], [1], [2]]
    run_to_end(batch, out, budgets)
    for i in range(3):
        assert out[i][:budgets[i]] == once(alone_chunked, target, drafter, prompts[i], budgets[i], params[i]), \
            f"sequence {i}"
    with pytest.raises(DFlashError, match="prefill_budget must be an integer >= 1, got 0"):
        BatchDecoder(target, drafter, max_batch_size=1, max_context=64, prefill_budget=0)


def test_a_hybrid_target_only_batch_keeps_a_joiners_state(qwen35_models):
    """Target-only on a hybrid target with fixed shapes: each row advances its own
    recurrent state as it runs, so the padding row in a partly prefilled joiner's slot
    would advance the joiner's state; it is kept. Each output equals its decode alone."""
    target, _ = qwen35_models
    params = [SamplingParams(temperature=1.2, seed=50 + i) for i in range(4)]
    prompts = [[5, 6, 7], list(range(10, 30)), [9] * 7, list(range(100, 100 + 3 * CHUNK_TOKENS + 2))]
    budgets = {0: 30, 1: 30, 2: 30, 3: 20}
    batch = BatchDecoder(target, None, max_batch_size=4, max_context=128, prefill_chunk=CHUNK_TOKENS, static=True)
    out = {i: list(batch.add(i, prompts[i], params[i], budgets[i]).tokens) for i in range(3)}
    batch.join(3, prompts[3], params[3], budgets[3])
    run_to_end(batch, out, budgets)
    for i in range(4):
        assert out[i][:budgets[i]] == once(alone_chunked, target, None, prompts[i], budgets[i], params[i]), \
            f"sequence {i}"


@pytest.mark.parametrize("join", [False, True], ids=["add", "join"])
def test_compiled_batch_rounds_do_not_recompile(agree_models, join):
    """Fixed shapes: batch buckets (1, 2, 4) x length buckets (256 keys, the 333-position
    cache); after warmup() every round of sequences joining and leaving (batch sizes 1 to
    4, contexts past 256; prompts prefilled at once or in chunks between rounds) reuses a
    graph, and each output equals its decode alone.
    TorchDynamo's guards decide recompilation, so the cheap "eager" backend is enough."""
    import torch._dynamo
    import torch._dynamo.utils as dynamo_utils

    target, drafter = agree_models
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    batch = BatchDecoder(target, drafter, max_batch_size=4, max_context=300, prefill_chunk=32, compile=True,
                         compile_backend="eager")
    assert batch.warmup() == 3 * 2
    graphs, frames = dynamo_utils.counters["stats"]["unique_graphs"], dynamo_utils.counters["frames"]["total"]
    assert graphs == 2 * 3 * 2  # propose and verify per bucket pair
    prompts = mixed_prompts(target, 6)
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.9, seed=4)
    budgets = [250, 40, 30, 200, 60, 20]
    params = [greedy, sampled, greedy, sampled, greedy, greedy]
    plan = [(0, "add", 0, prompts[0], params[0], budgets[0]), (3, "add", 1, prompts[1], params[1], budgets[1]),
            (4, "add", 2, prompts[2], params[2], budgets[2]), (5, "add", 3, prompts[3], params[3], budgets[3]),
            (6, "add", 4, prompts[4], params[4], budgets[4]), (8, "remove", 3, None, None, None),
            (9, "add", 5, prompts[5], params[5], budgets[5])]
    out = drive(batch, plan, join=join)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs, "a graph was recompiled after warm-up"
    assert dynamo_utils.counters["frames"]["total"] == frames, "a frame was re-traced after warm-up"
    for sid in (0, 1, 2, 4, 5):
        assert out[sid] == once(alone, target, drafter, prompts[sid], budgets[sid], params[sid]), f"sequence {sid}"
    with pytest.raises(DFlashError, match="empty batch"):
        batch.add("x", [5], greedy, 3)
        batch.warmup()


def test_an_eager_batch_warmup_runs_no_round(agree_models, agree_engine):  # noqa: F811 (the imported fixture)
    """An eager batch decoder has no shapes to prepare: warmup() runs nothing (a round per
    length and batch size of a 4,096-position cache took minutes) and leaves it as it was;
    the engine's ``warmup(batch=...)`` takes a bool only."""
    target, drafter = agree_models
    batch = BatchDecoder(target, drafter, max_batch_size=2, max_context=1024)
    assert batch.warmup() == 0 and batch.free_slots == 2
    with pytest.raises(DFlashError, match="^batch must be True or False, got 'yes'$"):
        agree_engine.warmup(batch="yes")


def test_compiled_hybrid_batch_rounds_do_not_recompile(hybrid_models):
    """A hybrid target, fixed shapes compiled: after warmup() (batch buckets 1, 2, 3 x the
    133-position cache) rounds of sequences joining and leaving reuse the graphs (the
    verify graph leaves every state as it was and records each sequence's block; the
    commit runs after it) and each output equals its decode alone. The "eager" backend:
    TorchDynamo's guards decide recompilation."""
    import torch._dynamo
    import torch._dynamo.utils as dynamo_utils

    target, drafter = hybrid_models
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    batch = BatchDecoder(target, drafter, max_batch_size=3, max_context=100, prefill_chunk=32, compile=True,
                         compile_backend="eager")
    assert batch.warmup() == 3
    graphs, frames = dynamo_utils.counters["stats"]["unique_graphs"], dynamo_utils.counters["frames"]["total"]
    prompts = mixed_prompts(target, 4)
    plan, budgets, params = join_leave_plan(prompts)
    out = drive(batch, plan)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs, "a graph was recompiled after warm-up"
    assert dynamo_utils.counters["frames"]["total"] == frames, "a frame was re-traced after warm-up"
    for sid in (1, 2, 3):
        assert out[sid] == alone(target, drafter, prompts[sid], budgets[sid], params[sid]), f"sequence {sid}"
    assert out[0] == alone(target, drafter, prompts[0], budgets[0], params[0])[:len(out[0])]


def test_a_recompute_engine_batches_one_sequence_at_a_time(tiny_pair):
    """``draft_mode="recompute"``: the batch decoder drafts with the injected cache only, so
    ``generate_batch`` decodes the prompts one after another with the recompute drafter (it
    ran them through the batch decoder, i.e. with injection, and labelled the stats
    'recompute'), ``batch_decoder()`` refuses, and the server gets one slot."""
    from dflash_torch.serving.scheduler import SerialBackend, make_backend

    engine = DFlashEngine.from_pretrained(*tiny_pair, draft_mode="recompute")
    prompts = ["def f(x):", "import os\n"]
    alone = [engine.generate(p, max_new_tokens=8, ignore_eos=True) for p in prompts]
    batch = engine.generate_batch(prompts, max_new_tokens=8, ignore_eos=True)
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]
    assert [r.stats.draft_mode for r in batch] == ["recompute"] * 2
    assert engine._batch is None and not engine.batched  # no batch decoder was built
    with pytest.raises(DFlashError, match="^draft_mode 'recompute' decodes one sequence at a time"):
        engine.batch_decoder()
    assert isinstance(make_backend(engine, 8), SerialBackend)


def test_generate_batch_after_a_failure_in_a_step_frees_every_slot(agree_pair, monkeypatch):
    """A failure inside a step (injected here into the second prompt's first token, after its
    prefill left the joining queue and before it decodes) reaches the caller as itself, and
    every slot is freed: the engine's next generate_batch decodes as a new engine's. (The
    cleanup used to remove that sequence too, which was in neither list: it raised "sequence 1
    is not in the batch" instead, and left the other sequence in, so that every later call
    failed with "already in the batch".)"""
    import dflash_torch.batch as batch_module

    engine = DFlashEngine.from_pretrained(*agree_pair, max_batch_size=2, max_context=128)
    prompts = varied_prompts(engine.target, 3, seed=3, length=6)
    first_token, calls = batch_module.first_token, []

    def failing_second(*args):
        calls.append(len(calls))
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return first_token(*args)

    monkeypatch.setattr(batch_module, "first_token", failing_second)
    with pytest.raises(RuntimeError, match="^injected failure$"):
        engine.generate_batch(prompts, max_new_tokens=8, ignore_eos=True)
    monkeypatch.undo()
    assert engine.batch_decoder().free_slots == 2 and engine.batch_decoder().seq_ids == []
    fresh = DFlashEngine.from_pretrained(*agree_pair, max_batch_size=2, max_context=128)
    expected = [r.token_ids for r in fresh.generate_batch(prompts, max_new_tokens=8, ignore_eos=True)]
    assert [r.token_ids for r in engine.generate_batch(prompts, max_new_tokens=8, ignore_eos=True)] == expected
