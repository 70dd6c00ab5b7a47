"""logit_bias (OpenAI) and min_tokens (vLLM) (SamplingParams, sampling.LogitsProcessor).

Oracles: transformers' own ``generate`` (``sequence_bias`` of single tokens is a logit
bias, ``min_new_tokens`` masks the EOS) for target-only decoding, and target-only
decoding for speculative decoding, which must commit exactly the same tokens with the
same bias in every decoding mode (the bias and the min_tokens mask apply to every verify
row, the bonus token and the prefill's token). With sampling: a banned token never
appears, a forced one always does, and the first tokens follow the exact biased
distribution (chi-square, as in test_penalties). Then the engine, the CLI and a real
server with the ``openai`` client.
"""

from __future__ import annotations

import pytest
import torch
from conftest import AGREE_TOKEN, EOS_ID, load_hf, run_rounds, varied_prompts
from test_batch import churned_batch_equals_alone
from test_penalties import hf_generate, reference_penalized
from test_sampling import ALPHA, chi_square_pvalue, processed

from dflash_torch import DFlashEngine, DFlashError, SamplingParams
from dflash_torch.batch import BatchDecoder
from dflash_torch.decoding import SpeculativeDecoder
from dflash_torch.models.drafter import DFlashDrafter
from dflash_torch.models.target import TargetModel
from dflash_torch.sampling import LogitsProcessor
from dflash_torch.stopping import Stopper

NEW_TOKENS = 24
C = AGREE_TOKEN  # the agreeable target's favourite token (its drafter proposes it nearly everywhere)


def test_processor_rows_equal_the_formula():
    """LogitsProcessor on a verify block: row j == (logits + bias), then the penalties over
    the committed tokens and d_1 .. d_j, then -inf for the held ids where row j predicts one
    of the first min_tokens tokens; draft_scores: bias and mask only."""
    g = torch.Generator().manual_seed(0)
    V, R = 40, 6
    prompt, generated, draft = [3, 7], [7, 11], [11, 20, 3, 5, 5]
    logits = torch.randn(R, V, generator=g) * 3
    bias = {5: -100.0, 11: 2.5, 20: 7.0}
    params = SamplingParams(logit_bias=bias, presence_penalty=0.7, repetition_penalty=1.3, min_tokens=5,
                            min_tokens_ids={0, 9})
    proc = LogitsProcessor(params, prompt, V, torch.device("cpu"))
    proc.commit(generated[:1])
    proc.commit(generated[1:])
    out = proc.apply(logits, torch.tensor(draft))
    dense = torch.zeros(V)
    dense[list(bias)] = torch.tensor(list(bias.values()))
    for j in range(R):
        want = reference_penalized(logits[j] + dense, prompt, generated + draft[:j], presence=0.7, repetition=1.3)
        if len(generated) + j < 5:  # row j predicts generated token number 2 + j (0-based)
            want[[0, 9]] = float("-inf")
        torch.testing.assert_close(out[j], want, rtol=0, atol=1e-5)
    assert torch.isinf(out[2, 0]) and torch.isfinite(out[3, 0])  # (the mask ends at min_tokens)
    scores = proc.draft_scores(logits[:R - 1])
    masked = (logits[:R - 1] + dense).index_put_((torch.arange(3)[:, None], torch.tensor([0, 9])), torch.tensor(float("-inf")))
    torch.testing.assert_close(scores, masked, rtol=0, atol=0)
    # a DFlash 2 lattice: the edges into each candidate get its bias; held candidates a huge finite penalty
    ids = torch.tensor([[0, 5, 9], [9, 0, 11], [0, 9, 20], [0, 1, 2], [3, 4, 5]])
    edges = torch.randn(5, 3, 3, generator=g)
    got_ids, got = proc.draft_scores((ids, edges))
    add = dense[ids] - torch.isin(ids, torch.tensor([0, 9])) * (torch.arange(5) < 3)[:, None] * torch.finfo(torch.float32).max
    assert got_ids is ids and torch.isfinite(got).all()
    torch.testing.assert_close(got, edges + add[:, None, :], rtol=0, atol=0)
    assert (got.argmax(-1)[1] == 2).all() and (got.argmax(-1)[2] == 2).all()  # (never a held candidate)
    assert LogitsProcessor.new(SamplingParams(min_tokens=3), prompt, logits) is None  # (no ids to hold: nothing to do)
    assert LogitsProcessor.new(SamplingParams(), prompt, logits) is None


# --- target-only decoding == transformers -------------------------------------------------


@pytest.fixture(scope="module")
def tiny_target_only(tiny_pair):
    return DFlashEngine.from_pretrained(tiny_pair[0], no_draft=True, max_batch_size=3)


PROMPTS = ["def f(x):", "class Stack:\n    def push(self, x):", "import os\n"]


def test_target_only_bias_and_min_tokens_equal_transformers_generate(tiny_pair, tiny_target_only):
    """Greedy target-only decoding (alone and batched) with logit_bias == transformers'
    ``generate(sequence_bias=...)`` with one-token sequences; with min_tokens and an EOS made
    likely by the bias == ``generate(min_new_tokens=...)`` (EOS masked before it)."""
    hf = load_hf(tiny_pair[0])
    engine = tiny_target_only
    ids = [engine.encode_prompt(p) for p in PROMPTS]
    plain = [hf_generate(hf, p, NEW_TOKENS) for p in ids]
    top = [max(set(r), key=r.count) for r in plain]  # each prompt's most frequent token, banned
    bias = {top[0]: -100.0, top[1]: -100.0, 100: 3.0, 57: 2.0}
    refs = [hf_generate(hf, p, NEW_TOKENS, sequence_bias={(t,): b for t, b in bias.items()}) for p in ids]
    assert all(ref != p for ref, p in zip(refs, plain))  # (the bias changes every output)
    assert [o.token_ids for o in engine.generate_batch(ids, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                                       logit_bias=bias)] == refs
    for p, ref in zip(ids, refs):
        assert engine.generate(p, max_new_tokens=NEW_TOKENS, ignore_eos=True, logit_bias=bias).token_ids == ref
    # min_tokens: EOS (0) pushed up so that it would come first; held back for 7 tokens
    eos = {EOS_ID: 12.0}
    for p in ids:
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=EOS_ID, pad_token_id=EOS_ID,
                               min_new_tokens=7, sequence_bias={(EOS_ID,): 12.0})[0, len(p):].tolist()
        assert engine.generate(p, max_new_tokens=NEW_TOKENS, logit_bias=eos).token_ids == [EOS_ID]  # (power)
        out = engine.generate(p, max_new_tokens=NEW_TOKENS, logit_bias=eos, min_tokens=7)
        assert out.token_ids == want and out.token_ids[-1] == EOS_ID and len(out.token_ids) == 8
        assert out.finish_reason == "stop"


# --- lossless: speculative == target-only with the same bias --------------------------------


@pytest.fixture(scope="module", params=["dflash", "dflash2"])
def models(request, agree_pair, agree_dflash2_pair):
    target_dir, drafter_dir = {"dflash": agree_pair, "dflash2": agree_dflash2_pair}[request.param]
    return TargetModel.from_pretrained(target_dir, torch.float32), DFlashDrafter.from_pretrained(drafter_dir, torch.float32)


# each changes the agreeable target's greedy output; the last holds EOS back for 10 tokens
# while forcing it (with min_tokens_ids as the engine sets them: the stop ids)
BIASED = [SamplingParams(logit_bias={C: -100.0}), SamplingParams(logit_bias={C: 1.5, 121: 2.0, 5: -2.0}),
          SamplingParams(logit_bias={C: -1.0, 273: 1.0}, frequency_penalty=0.5),
          SamplingParams(logit_bias={EOS_ID: 100.0, C: 1.0}, min_tokens=10, min_tokens_ids={EOS_ID})]


def test_speculative_greedy_with_bias_equals_target_only(models):
    """SpeculativeDecoder with logit_bias (and min_tokens) commits exactly the target-only
    tokens in every decoding mode: injection eager and with fixed shapes, the cache-less
    recompute drafter; rounds accept several drafts."""
    target, drafter = models
    prompts = varied_prompts(target, 3, length=8)
    spec = [SpeculativeDecoder(target, drafter), SpeculativeDecoder(target, drafter, static=True, max_context=256),
            SpeculativeDecoder(target, drafter, draft_mode="recompute")]
    alone = SpeculativeDecoder(target, None)
    taus = []
    for params in BIASED:
        for prompt in prompts:
            ref = run_rounds(alone, prompt, NEW_TOKENS, params)[0]
            assert ref != run_rounds(alone, prompt, NEW_TOKENS)[0], params  # (the bias changes the output)
            for decoder in spec:
                out, t = run_rounds(decoder, prompt, NEW_TOKENS, params)
                assert out == ref, (params, prompt, decoder.static, decoder.draft_mode)
                taus += t
    assert sum(t > 2 for t in taus) >= 5
    forced = run_rounds(alone, prompts[0], NEW_TOKENS, BIASED[-1])[0]
    assert EOS_ID not in forced[:10] and set(forced[10:]) == {EOS_ID}  # min_tokens, then the forced EOS


def test_compiled_rounds_with_bias_equal_target_only(agree_pair):
    """The compiled path (torch.compile, eager backend: the same graphs as inductor) with a bias."""
    target = TargetModel.from_pretrained(agree_pair[0], torch.float32)
    drafter = DFlashDrafter.from_pretrained(agree_pair[1], torch.float32)
    compiled = SpeculativeDecoder(target, drafter, compile=True, compile_backend="eager", max_context=128,
                                  prefill_chunk=32)
    alone = SpeculativeDecoder(target, None)
    for params, prompt in zip(BIASED[1:], varied_prompts(target, 3, length=8)):
        assert run_rounds(compiled, prompt, NEW_TOKENS, params)[0] == run_rounds(alone, prompt, NEW_TOKENS, params)[0]


@pytest.mark.parametrize("mode", ["eager", "fixed-shapes", "target-only-rounds"])
def test_batch_with_mixed_biases_equals_alone(models, mode):
    """Sequences with different biases (one without, one with min_tokens, one sampling with
    a seed) in one batch, joined and added: greedy ones commit their target-only tokens, the
    sampled one what it samples alone with the same seed."""
    target, drafter = models
    prompts = varied_prompts(target, 6, length=8)
    params = [SamplingParams(), BIASED[0], BIASED[1], BIASED[3], BIASED[2],
              SamplingParams(logit_bias={C: -100.0, 121: 1.0}, temperature=0.8, seed=11)]
    if mode == "target-only-rounds":  # (a target-only round draws differently from a drafting one)
        params[5] = BIASED[0]
    out = churned_batch_equals_alone(target, drafter, prompts, params, mode, leaver=2, n_new=NEW_TOKENS)
    assert C not in out[1] and C not in out[5]


# --- sampling -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def agree_engine(agree_pair):
    return DFlashEngine.from_pretrained(*agree_pair, block_size=4, max_batch_size=4, max_context=128)


def test_banned_token_is_never_sampled_and_a_forced_one_always(agree_engine):
    """-100 on the target's favourite token: it never appears in sampled outputs (alone and
    batched, many seeds), though it is most of the unbiased ones; +100 on a token: every
    token is it."""
    e, prompt = agree_engine, agree_engine.encode_prompt("def f(x):")
    kw = dict(max_new_tokens=12, ignore_eos=True, temperature=0.5)
    unbiased = [t for s in range(8) for t in e.generate(prompt, seed=s, **kw).token_ids]
    assert unbiased.count(C) > len(unbiased) // 2  # (the ban has power)
    banned = [e.generate(prompt, seed=s, logit_bias={C: -100}, **kw) for s in range(16)]
    banned += e.generate_batch([prompt] * 8, seed=list(range(16, 24)), logit_bias={C: -100}, **kw)
    assert all(C not in out.token_ids and len(out.token_ids) == 12 for out in banned)
    assert len({tuple(out.token_ids) for out in banned}) > 10  # (sampled: varied)
    forced = [e.generate(prompt, seed=s, logit_bias={77: 100}, **kw) for s in range(4)]
    forced.append(e.generate(prompt, logit_bias={77: 100}, max_new_tokens=12, ignore_eos=True))
    assert all(out.token_ids == [77] * 12 for out in forced)


@torch.no_grad()
def exact_joint_biased(hf, prompt: list[int], n: int, temperature: float, bias: dict[int, float],
                       eps: float = 1e-5) -> dict[tuple, float]:
    """P(t_1..t_n | prompt) with the bias then temperature, for every sequence of probability
    > eps (the rest is pooled by chi_square_pvalue)."""
    dense = torch.zeros(hf.config.vocab_size)
    for t, b in bias.items():
        dense[t] = b
    probs = {(): 1.0}
    for _ in range(n):
        prefixes = list(probs)
        logits = hf(torch.tensor([prompt + list(k) for k in prefixes])).logits[:, -1].float()
        rows = processed(logits + dense, temperature) * torch.tensor([probs[k] for k in prefixes], dtype=torch.float64)[:, None]
        probs = {k + (t,): float(row[t]) for k, row in zip(prefixes, rows) for t in (row > eps).nonzero()[:, 0].tolist()}
    return probs


SAMPLES = 500


def test_speculative_sampling_with_bias_matches_the_exact_distribution(agree_pair):
    """The first three tokens sampled with a logit bias, speculatively (blocks of 4, drafts
    accepted), follow the exact biased distribution; the unbiased one is rejected. (Batched,
    one seed per sequence: each samples what it samples alone, see test_batch.)"""
    bias = {C: -1.5, 121: 1.0, 5: 1.0}
    engine = DFlashEngine.from_pretrained(*agree_pair, block_size=4, max_batch_size=50, max_context=64)
    prompt = engine.encode_prompt("def f(x):")
    hf = load_hf(agree_pair[0])
    counts, taus = {}, []
    for out in engine.generate_batch([prompt] * SAMPLES, max_new_tokens=3, ignore_eos=True, seed=list(range(SAMPLES)),
                                     temperature=0.5, logit_bias=bias):
        key = tuple(out.token_ids)
        counts[key] = counts.get(key, 0) + 1
        taus += out.stats.acceptance_lengths
    assert chi_square_pvalue(counts, exact_joint_biased(hf, prompt, 3, 0.5, bias), SAMPLES) > ALPHA
    assert sum(t > 1 for t in taus) > SAMPLES // 10  # drafts were accepted
    assert chi_square_pvalue(counts, exact_joint_biased(hf, prompt, 3, 0.5, {}), SAMPLES) < ALPHA  # (power)


# --- min_tokens and stop strings ------------------------------------------------------------


def test_stop_strings_count_only_after_min_tokens():
    """vLLM's semantics: a stop string completed within the first min_tokens tokens does not
    count; one completed later does, and may start in their text."""
    pieces = [" is", " Lee", ",", " and", " I", "'m", " a", " stud", "ent"]

    def run(min_tokens: int, stops: list[str]):
        s = Stopper(lambda ids: "".join(pieces[i] for i in ids), stops, set(), 20, min_tokens)
        return s.feed(list(range(len(pieces))))

    assert run(0, ["e"]) == (" is L", 2, "stop")
    assert run(5, ["e"]) == (" is Lee, and I'm a stud", 9, "stop")
    assert run(4, ["I'm"]) == (" is Lee, and ", 6, "stop")  # completed by token 6, started in token 5
    assert run(6, ["I'm"])[2] is None  # completed by token 6 <= min_tokens: ignored


def test_min_tokens_with_the_engine(agree_pair, agree_engine):
    """min_tokens holds the EOS and stop_token_ids back (the output has no stop token before
    it, the same as target-only) and stop strings completed before it; with ignore_eos, EOS
    is not held back (nor a stop)."""
    e = agree_engine
    target_only = DFlashEngine.from_pretrained(agree_pair[0], no_draft=True, max_context=128)
    prompt = varied_prompts(e.target, 1, length=6)[0]
    forced = {EOS_ID: 100.0}
    assert e.generate(prompt, max_new_tokens=20, logit_bias=forced).token_ids == [EOS_ID]
    out = e.generate(prompt, max_new_tokens=20, logit_bias=forced, min_tokens=9)
    assert len(out.token_ids) == 10 and EOS_ID not in out.token_ids[:9] and out.finish_reason == "stop"
    sampled = e.generate(prompt, max_new_tokens=20, logit_bias={EOS_ID: 4.0}, min_tokens=9, temperature=1.0, seed=3)
    assert EOS_ID not in sampled.token_ids[:9]
    # a stop token id is held back too (here C, forced)
    held = e.generate(prompt, max_new_tokens=20, ignore_eos=True, stop_token_ids=[C], logit_bias={C: 100.0},
                      min_tokens=5)
    assert C not in held.token_ids[:5] and held.token_ids[-1] == C and len(held.token_ids) == 6
    # ignore_eos: the EOS is neither a stop nor held back
    free = e.generate(prompt, max_new_tokens=6, ignore_eos=True, logit_bias=forced, min_tokens=3)
    assert free.token_ids == [EOS_ID] * 6 and free.finish_reason == "length"
    # a stop string within the first tokens does not count
    full = e.generate(prompt, max_new_tokens=16, ignore_eos=True)
    stop = e.decode(full.token_ids[:1])
    assert e.generate(prompt, max_new_tokens=16, ignore_eos=True, stop=stop).token_ids == full.token_ids[:1]
    late = e.generate(prompt, max_new_tokens=16, ignore_eos=True, stop=stop, min_tokens=16)
    assert late.token_ids == full.token_ids and late.finish_reason == "length"
    assert target_only.generate(prompt, max_new_tokens=20, logit_bias=forced, min_tokens=9).token_ids == out.token_ids


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,name", [
    (dict(logit_bias={5: 101}), "logit_bias"), (dict(logit_bias={5: float("nan")}), "logit_bias"),
    (dict(logit_bias={5: "1"}), "logit_bias"), (dict(logit_bias={5: True}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias={"-1": 1.0}), "logit_bias"),
    (dict(logit_bias={" 5": 1.0}), "logit_bias"), (dict(logit_bias={"5.0": 1.0}), "logit_bias"),
    (dict(logit_bias={"1" * 19: 1.0}), "logit_bias"), (dict(logit_bias={"５": 1.0}), "logit_bias"),
    (dict(logit_bias=[(5, 1.0)]), "logit_bias"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=1.5), "min_tokens"), (dict(min_tokens=True), "min_tokens")])
def test_bad_values_are_refused(kw, name, tiny_target_only):
    with pytest.raises(DFlashError, match=f"^{name} ") as exc:
        SamplingParams(**kw)
    assert exc.value.names == (name,) and "\n" not in str(exc.value)
    with pytest.raises(DFlashError, match=f"^{name} "):
        tiny_target_only.generate("x", max_new_tokens=2, **kw)


def test_decimal_string_keys_as_in_an_openai_body_are_token_ids(tiny_target_only):
    assert SamplingParams(logit_bias={"5": 1, "007": -2.5, 9: 3}).logit_bias == {5: 1.0, 7: -2.5, 9: 3.0}
    # (helper-152: leading zeros past Python's 4300 digits were a ValueError of int())
    assert SamplingParams(logit_bias={"0" * 5000 + "5": 1, "0" * 5000: 2}).logit_bias == {5: 1.0, 0: 2.0}
    e = tiny_target_only
    forced = e.generate("x", max_new_tokens=4, logit_bias={"42": 100}).token_ids
    assert forced == e.generate("x", max_new_tokens=4, logit_bias={42: 100}).token_ids == [42] * 4
    # (two keys of one token: which bias is meant? trial-139, the last one won unsaid)
    # (trial-156: a key of 200,000 digits was quoted whole)
    for bias, keys in (({5: 100, "5": -100}, "5 and '5'"), ({"5": 1, "05": 2}, "'5' and '05'"),
                       ({"0" * 200_000 + "5": 1, 5: 2}, "a key of 200001 characters and 5")):
        with pytest.raises(DFlashError, match=f"^logit_bias gives token 5 twice \\(as {keys}\\)$"):
            e.generate("x", max_new_tokens=2, logit_bias=bias)
    with pytest.raises(DFlashError, match=r"^logit_bias keys must be token ids .*, got a key of 5000 characters$"):
        SamplingParams(logit_bias={"1" * 5000: 1})
    # (an int key of over 4300 digits: printing it was Python's ValueError)
    with pytest.raises(DFlashError, match=r"^logit_bias keys must be token ids .*, got an integer of about 5001 digits$"):
        SamplingParams(logit_bias={-10**5000: 1})
    with pytest.raises(DFlashError, match=r"^logit_bias token ids must be in \[0, \d+\) \(the vocabulary\), got an "
                                          r"integer of about 5001 digits$"):
        e.generate("x", max_new_tokens=2, logit_bias={10**5000: 1})


def test_ids_outside_the_vocabulary_and_min_tokens_above_max_are_refused(tiny_target_only, tiny_pair):
    e, V = tiny_target_only, tiny_target_only.target.config.vocab_size
    with pytest.raises(DFlashError, match=rf"^logit_bias token ids must be in \[0, {V}\) \(the vocabulary\), got {V}$"):
        e.generate("x", max_new_tokens=2, logit_bias={3: 1.0, V: 1.0})
    with pytest.raises(DFlashError, match=r"^prompt 1: logit_bias token ids must be in"):
        e.generate_batch(["x", "y"], max_new_tokens=2, logit_bias=[None, {V + 5: -1.0}])
    with pytest.raises(DFlashError, match=r"^min_tokens \(5\) must be at most max_new_tokens \(4\)$"):
        e.generate("x", max_new_tokens=4, min_tokens=5)
    target = TargetModel.from_pretrained(tiny_pair[0], torch.float32)
    with pytest.raises(DFlashError, match="^logit_bias token ids must be in"):  # (the decoders check too)
        next(SpeculativeDecoder(target, None).rounds([5, 6], SamplingParams(logit_bias={V: 1.0}), 4))
    with pytest.raises(DFlashError, match="^min_tokens_ids token ids must be in"):
        BatchDecoder(target, None, max_batch_size=1, max_context=64).add(
            0, [5], SamplingParams(min_tokens=2, min_tokens_ids={V}), 4)
    # min_tokens_ids covering the vocabulary leave no token (trial-208: greedy emitted a held-back id, sampling
    # raised torch's "probability tensor contains inf/nan"), refused as generate refuses stop ids that do
    every = frozenset(range(V))
    line = (rf"^min_tokens \(3\) holds back every id of min_tokens_ids until then, and they cover the whole vocabulary "
            rf"\({V} ids\): no token is left to generate; drop min_tokens or some min_tokens_ids$")
    for temperature in (0.0, 1.0):
        params = SamplingParams(min_tokens=3, min_tokens_ids=every, temperature=temperature)
        with pytest.raises(DFlashError, match=line):
            SpeculativeDecoder(target, None).rounds([5, 6], params, 6)
        batch = BatchDecoder(target, None, max_batch_size=1, max_context=64)
        with pytest.raises(DFlashError, match=line):
            batch.add(0, [5], params, 6)
        with pytest.raises(DFlashError, match=line):
            batch.join(0, [5], params, 6)
    left = SamplingParams(min_tokens=3, min_tokens_ids=every - {7})  # (one id left: min_tokens gives it)
    assert [rnd.tokens for rnd in SpeculativeDecoder(target, None).rounds([5, 6], left, 3)][:3] == [[7]] * 3
    assert SamplingParams(min_tokens_ids=every).min_tokens_ids == every  # (without min_tokens: nothing held back)


# --- the CLI --------------------------------------------------------------------------------


def test_cli_flags_equal_the_python_api(agree_pair, agree_engine, capsys):
    import json

    from dflash_torch.cli import main as cli_main

    base = ["generate", "--target", str(agree_pair[0]), "--draft", str(agree_pair[1]), "--block-size", "4",
            "--max-new-tokens", "12", "--json", "def f(x):"]
    assert cli_main(base + ["--logit-bias", '{"42": -100, "121": 2.5}', "--min-tokens", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    ref = agree_engine.generate("def f(x):", max_new_tokens=12, logit_bias={C: -100, 121: 2.5}, min_tokens=3)
    assert out["token_ids"] == ref.token_ids and ref.token_ids != agree_engine.generate("def f(x):", max_new_tokens=12).token_ids
    for bad, message in [('{"42": 200}', "--logit-bias values must be numbers in [-100, 100]"),
                         ('{"99999": 1}', "--logit-bias token ids must be in [0, "),
                         (["--min-tokens", "13"], "--min-tokens (13) must be at most --max-new-tokens (12)")]:
        extra = bad if isinstance(bad, list) else ["--logit-bias", bad]
        assert cli_main(base + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith("dflash-torch: error: ") and message in err and err.count("\n") == 1, err
    for bad in ['{"a": 1}', "[1]", "{"]:  # argparse refuses it (exit 2, usage + one error line)
        with pytest.raises(SystemExit) as exc:
            cli_main(base + ["--logit-bias", bad])
        assert exc.value.code == 2 and "--logit-bias" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_cli_refuses_one_token_given_twice(command, capsys):
    """``--logit-bias '{"1": 5, "01": -5}'``: two keys of token 1 (which bias is meant?) are
    refused in one line naming the token and both keys, as the Python API and the server refuse
    them (SamplingParams' check), before anything loads (it was taken: the CLI read both keys
    as the int 1, the last one won); a key given twice is refused as JSON's."""
    from dflash_torch.cli import main as cli_main

    args = [command, *(["x"] if command == "generate" else []), "--logit-bias"]
    assert cli_main(args + ['{"1": 5, "01": -5}']) == 2
    assert capsys.readouterr().err == "dflash-torch: error: --logit-bias gives token 1 twice (as '1' and '01')\n"
    with pytest.raises(SystemExit) as exc:
        cli_main(args + ['{"1": 5, "1": -5}'])
    assert exc.value.code == 2 and capsys.readouterr().err == \
        "dflash-torch: error: argument --logit-bias: gives the key '1' twice (which value is meant?) (see --help)\n"
    with pytest.raises(SystemExit) as exc:
        cli_main(args[:-1] + ["--chat-template-kwargs", '{"enable_thinking": true, "enable_thinking": false}'])
    assert exc.value.code == 2 and "--chat-template-kwargs: gives the key 'enable_thinking' twice" in \
        capsys.readouterr().err


# --- the server -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(agree_pair, tmp_path_factory):
    from test_server_scheduler import _serve

    with _serve(agree_pair, tmp_path_factory.mktemp("bias"), "--max-batch-size", "4") as srv:
        yield srv


def test_server_logit_bias_and_min_tokens_equal_the_python_api(server, agree_pair):
    """logit_bias (token-id strings) and min_tokens in both endpoints, streamed and not, n > 1
    sampled in a batch: what DFlashEngine.generate gives with the same parameters."""
    from test_server import MODEL
    from test_server_scheduler import _streamed_choices

    from dflash_torch.serving.scheduler import choice_seed

    engine = DFlashEngine.from_pretrained(*agree_pair)
    prompt = "def f(x):"
    bias = {C: -100.0, 121: 2.5}
    body = dict(model=MODEL, max_tokens=16, extra_body={"ignore_eos": True, "min_tokens": 2},
                logit_bias={str(t): b for t, b in bias.items()})
    ref = engine.generate(prompt, max_new_tokens=16, ignore_eos=True, min_tokens=2, logit_bias=bias)
    assert ref.token_ids != engine.generate(prompt, max_new_tokens=16, ignore_eos=True).token_ids  # (power)
    c = server.client()
    assert c.completions.create(prompt=prompt, temperature=0, **body).choices[0].text == ref.text
    text, finish, _ = _streamed_choices(c.completions.create(prompt=prompt, temperature=0, stream=True, **body))
    assert text == {0: ref.text} and finish == {0: "length"}
    messages = [{"role": "user", "content": prompt}]
    chat = engine.generate(messages, chat=True, max_new_tokens=16, ignore_eos=True, min_tokens=2, logit_bias=bias)
    assert c.chat.completions.create(messages=messages, temperature=0, **body).choices[0].message.content == chat.text
    r = c.completions.create(prompt=prompt, temperature=0.8, seed=7, n=3, **body)
    for j, choice in enumerate(r.choices):
        want = engine.generate(prompt, max_new_tokens=16, ignore_eos=True, min_tokens=2, logit_bias=bias,
                               temperature=0.8, seed=choice_seed(7, j))
        assert choice.text == want.text and C not in want.token_ids
    # min_tokens holds the EOS back (forced by the bias): 5 tokens, the last one EOS
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logit_bias={"0": 100},
                             extra_body={"min_tokens": 4})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 5
