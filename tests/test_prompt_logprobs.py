"""Prompt log-probabilities (``prompt_logprobs=k``): each prompt token's log-probability
under the target given the tokens before it, taken from the logits the prefill computes
anyway, chunk by chunk.

The oracle is transformers' model of the target scoring the prompt in one forward pass
(``log_softmax`` of its float32 logits, row i - 1 for token i). Checked on an attention
target (Qwen3) and a hybrid one (Qwen3.5: Gated DeltaNet + attention), on the
single-sequence decoder (eager and fixed-shape chunks, padded), the batch decoder (chunked
joins, a whole-prefill add, shared prefills, prefix reuse) and the engine's
``generate`` / ``stream`` / ``generate_batch``; the generated tokens are those of a request
that does not ask.
"""

from __future__ import annotations

import pytest
import torch
from conftest import load_hf, make_agreeable_pair, varied_prompts

from dflash_torch import DFlashEngine, DFlashError, SamplingParams
from dflash_torch.batch import BatchDecoder
from dflash_torch.decoding import SpeculativeDecoder
from dflash_torch.models.drafter import DFlashDrafter
from dflash_torch.models.target import TargetModel

ATOL = 1e-4
NEW = 12
GREEDY = SamplingParams()
CHUNK = 16  # prefill chunk of the step-level tests: prompts of 40 tokens span 3 chunks (the last one partial)


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5_text"])
def pair(request, agree_pair, tmp_path_factory, tokenizer_dir):
    """(target_dir, drafter_dir, oracle, target, drafter) of an agreeable pair with an
    attention target or a hybrid Qwen3.5 one."""
    if request.param == "qwen3":
        target_dir, drafter_dir = agree_pair
    else:
        target_dir, drafter_dir = make_agreeable_pair(tmp_path_factory.mktemp("prompt-lp-qwen35"), tokenizer_dir,
                                                      model_type="qwen3_5_text", alpha=0.5, self_scale=0.0)
    return (target_dir, drafter_dir, load_hf(target_dir), TargetModel.from_pretrained(target_dir, torch.float32),
            DFlashDrafter.from_pretrained(drafter_dir, torch.float32))


def assert_prompt_logprobs(oracle, prompt: list[int], scored, k: int) -> None:
    """``scored`` (one entry per prompt token, the first None) is the oracle's scoring of
    ``prompt``: each token's log-probability and the k most likely tokens before it."""
    assert scored is not None and len(scored) == len(prompt) and scored[0] is None
    with torch.no_grad():
        ref = torch.log_softmax(oracle(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for i in range(1, len(prompt)):
        e, row = scored[i], ref[i - 1]
        assert e.token_id == prompt[i], i
        assert e.logprob == pytest.approx(float(row[prompt[i]]), abs=ATOL), i
        assert len(e.top) == k, i
        ids, values = [t for t, _ in e.top], [v for _, v in e.top]
        assert values == sorted(values, reverse=True), i
        assert torch.allclose(torch.tensor(values), row[ids], atol=ATOL), i
        if k:
            assert values[-1] >= float(row.topk(k).values[-1]) - ATOL, i  # nothing more likely left out


def _rounds(decoder, prompt, params=GREEDY, **kw):
    """(tokens, the prefill round) of a single-sequence decoding of NEW tokens."""
    tokens, first = [], None
    for rnd in decoder.rounds(prompt, params, NEW, **kw):
        first = first or rnd
        tokens += rnd.tokens
    return tokens[:NEW], first


@pytest.mark.parametrize("static", [False, True], ids=["eager", "fixed-shapes"])
def test_single_sequence_prompt_logprobs_are_the_targets(pair, static):
    _, _, oracle, target, drafter = pair
    decoder = SpeculativeDecoder(target, drafter, static=static, max_context=128 if static else None,
                                 prefill_chunk=CHUNK)
    prompt = varied_prompts(target, 1, seed=3, length=40)[0]  # chunks of 16, 16 and 8 (padded to 16 with fixed shapes)
    plain, first = _rounds(decoder, prompt)
    assert first.prompt_logprobs is None
    sampled = SamplingParams(temperature=0.8, seed=5)
    plain_sampled, _ = _rounds(decoder, prompt, sampled)
    for k, params, want in ((3, SamplingParams(), plain), (0, sampled, plain_sampled)):
        tokens, first = _rounds(decoder, prompt, params, prompt_logprobs=k)
        assert tokens == want  # the same tokens as without
        assert_prompt_logprobs(oracle, prompt, first.prompt_logprobs, k)
    _, first = _rounds(decoder, prompt[:1], prompt_logprobs=2)
    assert first.prompt_logprobs == [None]  # a one-token prompt: nothing scores its token


def test_batch_prompt_logprobs_are_the_targets(pair):
    """Chunked joins (two sharing a prefill with the same k, one with another k, one without),
    a whole-prefill add, and a prompt whose rows are retained from an earlier sequence: every
    sequence that asks gets every prompt token scored, and the same tokens as decoding alone."""
    _, _, oracle, target, drafter = pair
    alone = SpeculativeDecoder(target, drafter, prefill_chunk=CHUNK)
    batch = BatchDecoder(target, drafter, max_batch_size=5, max_context=160, prefill_chunk=CHUNK)
    p0, p1, p2 = varied_prompts(target, 3, seed=9, length=40)
    plan = {"a": (p0, 2), "a2": (p0, 2), "b": (p0, 4), "c": (p1, None), "d": (p2, 1)}
    out = {sid: [] for sid in plan}
    firsts = {}

    def run():
        while batch.seq_ids:
            for sid, rnd in batch.step().items():
                if rnd.acceptance_length is None:
                    firsts[sid] = rnd
                out[sid] += rnd.tokens
            for sid in list(batch.seq_ids):
                if len(out[sid]) >= NEW:
                    batch.remove(sid)

    rnd = batch.add("d", p2, SamplingParams(), NEW, prompt_logprobs=1)
    firsts["d"], out["d"] = rnd, list(rnd.tokens)
    for sid in ("a", "a2", "b", "c"):
        batch.join(sid, plan[sid][0], SamplingParams(), NEW, prompt_logprobs=plan[sid][1])
    read = batch.prefill_tokens
    run()
    assert batch.prefill_tokens - read == 3 * len(p0)  # p0 once for a and a2 (shared), again for b; p1; not p2
    for sid, (prompt, k) in plan.items():
        assert out[sid][:NEW] == _rounds(alone, prompt)[0], sid
        if k is None:
            assert firsts[sid].prompt_logprobs is None
        else:
            assert_prompt_logprobs(oracle, prompt, firsts[sid].prompt_logprobs, k)
    # prefix reuse: p0's rows are retained now; a plain request takes them, one that asks reads p0 whole
    reused, read = batch.reused_prefill_tokens, batch.prefill_tokens
    out.update(e=[], f=[])
    batch.join("e", p0 + p1[:5], SamplingParams(), NEW)
    run()
    assert batch.reused_prefill_tokens > reused
    reused = batch.reused_prefill_tokens
    longer = p0 + p1[:5]
    batch.join("f", longer, SamplingParams(), NEW, prompt_logprobs=2)
    run()
    assert batch.reused_prefill_tokens == reused and firsts["f"].cached_tokens == 0
    assert out["f"][:NEW] == out["e"][:NEW] == _rounds(alone, longer)[0]
    assert_prompt_logprobs(oracle, longer, firsts["f"].prompt_logprobs, 2)


def test_engine_generate_stream_and_batch(pair):
    """The public API over the engine's default prefill chunk (256): a 300-token prompt spans
    two chunks, alone (``generate``, ``stream``) and in ``generate_batch`` (eager and fixed shapes)."""
    target_dir, drafter_dir, oracle, target, _ = pair
    prompt = varied_prompts(target, 1, seed=4, length=300)[0]
    short = prompt[:30]
    for static in (False, True):
        engine = DFlashEngine.from_pretrained(target_dir, drafter_dir, dtype="float32", static=static, max_context=400,
                                              max_batch_size=3)
        plain = engine.generate(prompt, max_new_tokens=NEW, ignore_eos=True)
        assert plain.prompt_logprobs is None
        out = engine.generate(prompt, max_new_tokens=NEW, ignore_eos=True, prompt_logprobs=2, logprobs=1)
        assert out.token_ids == plain.token_ids
        assert_prompt_logprobs(oracle, prompt, out.prompt_logprobs, 2)
        chunks = list(engine.stream(prompt, max_new_tokens=NEW, ignore_eos=True, prompt_logprobs=0))
        assert chunks[0].prompt_logprobs is not None and all(c.prompt_logprobs is None for c in chunks[1:])
        assert [e.logprob if e else None for e in chunks[0].prompt_logprobs] == \
            [e.logprob if e else None for e in out.prompt_logprobs]
        results = engine.generate_batch([prompt, short, prompt], max_new_tokens=NEW, ignore_eos=True,
                                        prompt_logprobs=[3, None, 3])
        assert results[0].token_ids == results[2].token_ids == plain.token_ids and results[1].prompt_logprobs is None
        assert_prompt_logprobs(oracle, prompt, results[0].prompt_logprobs, 3)
        assert_prompt_logprobs(oracle, prompt, results[2].prompt_logprobs, 3)


@pytest.mark.parametrize("value", [-1, 21, True, 1.0, "2"])
def test_bad_prompt_logprobs_are_refused(pair, value):
    _, _, _, target, drafter = pair
    with pytest.raises(DFlashError, match="prompt_logprobs must be an integer in"):
        next(SpeculativeDecoder(target, drafter).rounds([5, 6], SamplingParams(), 2, prompt_logprobs=value))
    with pytest.raises(DFlashError, match="prompt_logprobs must be an integer in"):
        BatchDecoder(target, drafter, max_batch_size=1, max_context=64).join(0, [5, 6], SamplingParams(), 2,
                                                                             prompt_logprobs=value)
