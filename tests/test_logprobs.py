"""Token log-probabilities (``SamplingParams.logprobs``): what speculative decoding reports
for each committed token is the target's own distribution at that position.

The oracle is transformers' model of the target scoring the final sequence (prompt +
generated tokens) in one forward pass: ``log_softmax`` of its float32 logits at the
position before each generated token. Checked on an attention target (Qwen3) and a
hybrid one (Qwen3.5: Gated DeltaNet + attention), with agreeable drafters so that most
rounds accept draft tokens, greedy and seeded sampling, on the single-sequence decoder
(eager and fixed shapes) and the batch decoder (eager, fixed shapes, compiled).
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
NEW = 40  # tokens per sequence
GREEDY = SamplingParams(logprobs=5)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, seed=7, logprobs=3)
CHOSEN_ONLY = SamplingParams(temperature=1.2, seed=3, logprobs=0)


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5_text"])
def pair(request, agree_pair, tmp_path_factory, tokenizer_dir):
    """(oracle, target, drafter): an agreeable pair (many tokens accepted per round) with an
    attention target or a hybrid Qwen3.5 one, loaded by transformers and by us."""
    if request.param == "qwen3":
        target_dir, drafter_dir = agree_pair
    else:
        target_dir, drafter_dir = make_agreeable_pair(tmp_path_factory.mktemp("logprobs-qwen35"), tokenizer_dir,
                                                      model_type="qwen3_5_text", alpha=0.5, self_scale=0.0)
    return (load_hf(target_dir), TargetModel.from_pretrained(target_dir, torch.float32),
            DFlashDrafter.from_pretrained(drafter_dir, torch.float32))


def assert_target_logprobs(oracle, prompt: list[int], tokens: list[int], logprobs, k: int) -> None:
    """``logprobs`` (one TokenLogprob per token of ``tokens``) are the oracle's: the chosen
    token's log-probability, and the k most likely tokens (their log-probabilities, most
    likely first, none left out: a near-tie may order two of them either way)."""
    assert len(logprobs) == len(tokens)
    with torch.no_grad():
        logits = oracle(torch.tensor([prompt + tokens])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1]  # row j: the position of tokens[j]
    for j, (token, entry) in enumerate(zip(tokens, logprobs)):
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(ref[j, token]), abs=ATOL), j
        assert len(entry.top) == k
        ids, values = [t for t, _ in entry.top], [v for _, v in entry.top]
        assert len(set(ids)) == k and values == sorted(values, reverse=True), j
        assert torch.allclose(torch.tensor(values), ref[j, ids], atol=ATOL), j
        if k:
            kth = float(ref[j].topk(k).values[-1])
            assert values[-1] >= kth - ATOL, j  # nothing more likely was left out


def decode_alone(decoder: SpeculativeDecoder, prompt: list[int], params: SamplingParams):
    """(tokens, logprobs, acceptance lengths) of the first NEW tokens a single-sequence decoder commits."""
    tokens, logprobs, taus = [], [], []
    for rnd in decoder.rounds(prompt, params, NEW):
        assert (rnd.logprobs is None) == (params.logprobs is None)
        tokens += rnd.tokens
        logprobs += rnd.logprobs or []
        taus.append(rnd.acceptance_length)
    return tokens[:NEW], logprobs[:NEW], taus[1:]


@pytest.mark.parametrize("static", [False, True], ids=["eager", "fixed-shapes"])
def test_single_sequence_logprobs_are_the_targets(pair, static):
    oracle, target, drafter = pair
    decoder = SpeculativeDecoder(target, drafter, static=static, max_context=128 if static else None, prefill_chunk=16)
    taus = []
    for i, params in enumerate([GREEDY, SAMPLED, CHOSEN_ONLY]):
        prompt = varied_prompts(target, 1, seed=i, length=20)[0]
        tokens, logprobs, round_taus = decode_alone(decoder, prompt, params)
        assert_target_logprobs(oracle, prompt, tokens, logprobs, params.logprobs)
        taus += round_taus
    assert max(taus) >= 2, taus  # accepted draft tokens are covered, not only bonus tokens


@pytest.mark.parametrize("mode", ["eager", "fixed-shapes", "compiled"])
def test_batch_logprobs_are_the_targets(pair, mode):
    """Three sequences in one batch (joined with chunked prefill, one added at once), one
    of them without logprobs; each sequence's logprobs are the target's."""
    oracle, target, drafter = pair
    if mode == "compiled":
        import torch._dynamo

        torch._dynamo.reset()
    batch = BatchDecoder(target, drafter, max_batch_size=4, max_context=128, prefill_chunk=16,
                         static=mode == "fixed-shapes", compile=mode == "compiled", compile_backend="eager")
    prompts = varied_prompts(target, 4, seed=11, length=20)
    plan = {0: GREEDY, 1: SAMPLED, 2: CHOSEN_ONLY, 3: SamplingParams()}
    tokens = {sid: [] for sid in plan}
    logprobs = {sid: [] for sid in plan}
    taus = []

    def record(sid, rnd):
        assert (rnd.logprobs is None) == (plan[sid].logprobs is None)
        assert rnd.logprobs is None or [e.token_id for e in rnd.logprobs] == rnd.tokens
        tokens[sid] += rnd.tokens
        logprobs[sid] += rnd.logprobs or []
        if rnd.acceptance_length is not None:
            taus.append(rnd.acceptance_length)

    record(0, batch.add(0, prompts[0], plan[0], NEW))
    for sid in (1, 2, 3):
        batch.join(sid, prompts[sid], plan[sid], NEW)
    while batch.seq_ids:
        for sid, rnd in batch.step().items():
            record(sid, rnd)
        for sid in list(batch.seq_ids):
            if len(tokens[sid]) >= NEW:
                batch.remove(sid)
    for sid in (0, 1, 2):
        assert_target_logprobs(oracle, prompts[sid], tokens[sid][:NEW], logprobs[sid][:NEW], plan[sid].logprobs)
    assert logprobs[3] == []
    assert max(taus) >= 2, taus


def test_logprobs_with_a_penalty_are_the_raw_targets(pair):
    """With a presence penalty (which changes the tokens) the logprobs stay those of the
    target's raw distribution, on the single-sequence and the batch decoder alike."""
    oracle, target, drafter = pair
    prompt = varied_prompts(target, 1, seed=21, length=20)[0]
    plain, _, _ = decode_alone(SpeculativeDecoder(target, drafter, prefill_chunk=16), prompt, GREEDY)
    params = SamplingParams(presence_penalty=1.5, logprobs=2)
    tokens, logprobs, _ = decode_alone(SpeculativeDecoder(target, drafter, prefill_chunk=16), prompt, params)
    assert tokens != plain  # (the penalty matters here)
    assert_target_logprobs(oracle, prompt, tokens, logprobs, 2)
    batch = BatchDecoder(target, drafter, max_batch_size=1, max_context=128, prefill_chunk=16)
    rnd = batch.add(0, prompt, params, NEW)
    got, got_lp = list(rnd.tokens), list(rnd.logprobs)
    while len(got) < NEW:
        rnd = batch.step()[0]
        got += rnd.tokens
        got_lp += rnd.logprobs
    assert got[:NEW] == tokens
    assert_target_logprobs(oracle, prompt, got[:NEW], got_lp[:NEW], 2)


def test_logprobs_do_not_change_the_tokens(agree_pair):
    """With and without logprobs: the same tokens (greedy and seeded sampling), one sequence
    and a batch; ``logprobs`` aligned with ``token_ids`` (the stop token included), None
    when not asked."""
    engine = DFlashEngine.from_pretrained(*agree_pair, max_batch_size=3, max_context=256)
    prompts = varied_prompts(engine.target, 3, seed=5, length=12)
    sampling = [dict(), dict(temperature=0.9, seed=1), dict(temperature=0.7, top_k=20, seed=2)]
    for prompt, kw in zip(prompts, sampling):
        plain = engine.generate(prompt, max_new_tokens=NEW, **kw)
        with_lp = engine.generate(prompt, max_new_tokens=NEW, logprobs=2, **kw)
        assert plain.logprobs is None
        assert with_lp.token_ids == plain.token_ids and with_lp.text == plain.text
        assert [e.token_id for e in with_lp.logprobs] == with_lp.token_ids
        streamed = list(engine.stream(prompt, max_new_tokens=NEW, logprobs=2, **kw))
        assert [e for c in streamed for e in c.logprobs] == with_lp.logprobs
    kws = dict(max_new_tokens=NEW, temperature=[s.get("temperature", 0.0) for s in sampling],
               top_k=[s.get("top_k", 0) for s in sampling], seed=[s.get("seed") for s in sampling])
    plain = engine.generate_batch(prompts, **kws)
    with_lp = engine.generate_batch(prompts, logprobs=[1, None, 0], **kws)
    assert [r.token_ids for r in with_lp] == [r.token_ids for r in plain]
    assert with_lp[1].logprobs is None
    for r, k in ((with_lp[0], 1), (with_lp[2], 0)):
        assert [e.token_id for e in r.logprobs] == r.token_ids and all(len(e.top) == k for e in r.logprobs)


def test_no_logprobs_past_a_stop_string(agree_pair):
    """A stop string ends the output inside a round: the logprobs end at the token that
    completed it, as the token ids do (the rest of that round's tokens are not reported)."""
    engine = DFlashEngine.from_pretrained(*agree_pair)
    prompt = varied_prompts(engine.target, 1, seed=5, length=12)[0]
    full = engine.generate(prompt, max_new_tokens=NEW, ignore_eos=True, logprobs=1)
    stop = engine.decode(full.token_ids[10:12])
    cut = engine.generate(prompt, max_new_tokens=NEW, ignore_eos=True, logprobs=1, stop=stop)
    assert cut.finish_reason == "stop" and len(cut.token_ids) < len(full.token_ids)
    assert cut.logprobs == full.logprobs[:len(cut.token_ids)]
    batch = engine.generate_batch([prompt], max_new_tokens=NEW, ignore_eos=True, logprobs=1, stop=stop)[0]
    assert batch.token_ids == cut.token_ids and len(batch.logprobs) == len(cut.token_ids)


@pytest.mark.parametrize("value", [-1, 21, True, 1.0, "2"])
def test_bad_logprobs_are_refused(value, local_engine):
    with pytest.raises(DFlashError, match=r"^logprobs must be an integer in \[0, 20\], got"):
        SamplingParams(logprobs=value)
    with pytest.raises(DFlashError, match="logprobs"):
        local_engine.generate("x", max_new_tokens=2, logprobs=value)
    with pytest.raises(DFlashError, match="logprobs"):
        local_engine.generate_batch(["x"], max_new_tokens=2, logprobs=value)


def test_token_bytes_are_exact_for_a_byte_level_vocabulary(local_engine):
    """Tokens that hold part of a multi-byte character (their text alone is U+FFFD) give
    their own bytes: a text's tokens' bytes, joined, are the text's UTF-8."""
    text = "naïve “quotes” – 😊 日本語 and ASCII"
    ids = local_engine.encode_prompt(text)
    partial = [t for t in ids if "\ufffd" in local_engine.decode([t])]
    assert partial, "the test tokenizer should split some characters over tokens"
    assert b"".join(local_engine.token_bytes(t) for t in ids) == text.encode("utf-8")
    assert local_engine.token_bytes(0) == local_engine.decode([0]).encode("utf-8")  # an added token: its text


def test_token_bytes_of_a_sentencepiece_vocabulary(sentencepiece_pair):
    """A Llama-2-style vocabulary (SentencePiece pieces, byte fallback): a word-start piece
    ``▁the`` adds " the" (decoded alone its space is dropped, as at a text's start), a byte
    token ``<0xNN>`` its one byte; an output's tokens' bytes, joined, are its text's UTF-8,
    and so are the logprobs' ``token`` s of a generation."""
    engine = DFlashEngine.from_pretrained(*sentencepiece_pair)
    the = engine.tokenizer.convert_tokens_to_ids("▁the▁")
    assert engine.decode([the]) == "the "
    assert engine.token_bytes(the) == b" the " and engine.token_text(the) == " the "
    text = "x is déjà 日本 the end"
    ids = engine.encode_prompt(text)[1:]  # (less <s>)
    assert any(t in engine.byte_token_ids for t in ids), "some characters should fall back to byte tokens"
    assert b"".join(engine.token_bytes(t) for t in ids) == b" " + text.encode("utf-8")  # (with the marker put first)
    assert engine.token_bytes(1) == b"<s>"  # an added token: its text
    out = engine.generate("x is", max_new_tokens=12, logprobs=0, ignore_eos=True,
                          logit_bias={the: 3.0, engine.tokenizer.convert_tokens_to_ids("<0xC3>"): 2.0})
    assert b"".join(engine.token_bytes(e.token_id) for e in out.logprobs) == out.text.encode("utf-8")
