"""Presence, frequency and repetition penalties (SamplingParams, sampling.penalize).

Oracles: transformers' own ``generate(repetition_penalty=...)`` for the repetition
penalty, a plain loop written here (the whole sequence through transformers' model every
step, the formula applied token by token, argmax) for all three, and target-only decoding
for speculative decoding, which must give exactly the same tokens with the same
penalties (the penalty of each verify row counts the drafts before it). With sampling,
the first tokens' distribution is compared with the exact penalised one (chi-square, as
in test_sampling).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from conftest import load_hf, make_agreeable_pair, run_rounds, varied_prompts
from test_batch import churned_batch_equals_alone
from test_sampling import ALPHA, chi_square_pvalue, processed

from dflash_torch import DFlashEngine, DFlashError, SamplingParams
from dflash_torch.decoding import SpeculativeDecoder
from dflash_torch.models.drafter import DFlashDrafter
from dflash_torch.models.target import TargetModel
from dflash_torch.sampling import penalize, probabilities

NEW_TOKENS = 32


def reference_penalized(logits: torch.Tensor, prompt: list[int], generated: list[int], presence: float = 0.0,
                        frequency: float = 0.0, repetition: float = 1.0) -> torch.Tensor:
    """The penalties, token by token (vLLM's order: repetition over prompt and generated
    tokens, then frequency and presence over the generated ones)."""
    x = logits.clone()
    if repetition != 1:
        for t in set(prompt) | set(generated):
            x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t, c in Counter(generated).items():
        x[t] = x[t] - frequency * c
        x[t] = x[t] - presence
    return x


@torch.no_grad()
def reference_greedy(hf, prompt: list[int], n: int, **penalties) -> list[int]:
    """Greedy decoding by hand: the whole sequence through ``hf`` every step, no cache."""
    out = []
    for _ in range(n):
        logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        out.append(int(reference_penalized(logits, prompt, out, **penalties).argmax()))
    return out


def hf_generate(hf, prompt: list[int], n: int, **kw) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, eos_token_id=None, **kw)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("penalties", [dict(presence=1.5), dict(frequency=-0.7), dict(repetition=1.7),
                                       dict(presence=0.5, frequency=0.5, repetition=0.8)])
def test_each_block_row_counts_the_drafts_before_it(penalties):
    """penalize on a block: row j == the formula over prompt, committed tokens and d_1 .. d_j
    (repeated draft tokens, drafts already generated, tokens only in the prompt)."""
    from dflash_torch.sampling import Penalties

    g = torch.Generator().manual_seed(0)
    V, R = 50, 6
    prompt, generated = [3, 7, 7, 9], [7, 11, 11, 12]
    draft = [11, 20, 20, 3, 12]
    logits = torch.randn(R, V, generator=g) * 3
    pen = Penalties(as_params(**penalties), prompt, V, torch.device("cpu"))
    pen.commit(generated[:1])
    pen.commit(generated[1:])
    out = pen.apply(logits, torch.tensor(draft))
    for j in range(R):
        want = reference_penalized(logits[j], prompt, generated + draft[:j], **penalties)
        torch.testing.assert_close(out[j], want, rtol=0, atol=1e-6)
    assert not torch.equal(out[1], out[2])  # (a draft changes the rows after it)
    first = pen.apply(logits[:1])  # one position, no draft
    torch.testing.assert_close(first[0], reference_penalized(logits[0], prompt, generated, **penalties), rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_target_only(tiny_pair):
    return DFlashEngine.from_pretrained(tiny_pair[0], no_draft=True, max_batch_size=3)


PROMPTS = ["def f(x):", "class Stack:\n    def push(self, x):", "import os\n"]


@pytest.mark.parametrize("r", [1.6, 0.6])
def test_repetition_penalty_equals_transformers_generate(tiny_pair, tiny_target_only, r):
    """Target-only greedy decoding (alone and batched) with repetition_penalty == transformers'
    ``generate(do_sample=False, repetition_penalty=r)`` (its RepetitionPenaltyLogitsProcessor)."""
    hf = load_hf(tiny_pair[0])
    engine, changed = tiny_target_only, 0
    ids = [engine.encode_prompt(p) for p in PROMPTS]
    refs = [hf_generate(hf, p, NEW_TOKENS, repetition_penalty=r) for p in ids]
    batch = engine.generate_batch(ids, max_new_tokens=NEW_TOKENS, ignore_eos=True, repetition_penalty=r)
    assert [out.token_ids for out in batch] == refs
    for p, ref in zip(ids, refs):
        assert engine.generate(p, max_new_tokens=NEW_TOKENS, ignore_eos=True, repetition_penalty=r).token_ids == ref
        changed += ref != hf_generate(hf, p, NEW_TOKENS)
    assert changed >= 2  # the penalty changes the output: the comparison has power


PENALTIES = [dict(presence=1.5), dict(frequency=0.8), dict(presence=-1.0),
             dict(presence=0.6, frequency=0.4, repetition=1.3)]


def as_params(presence: float = 0.0, frequency: float = 0.0, repetition: float = 1.0, **kw) -> SamplingParams:
    return SamplingParams(presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition, **kw)


@pytest.mark.parametrize("penalties", PENALTIES, ids=[str(p) for p in PENALTIES])
def test_penalties_equal_a_plain_reference_loop(tiny_pair, tiny_target_only, penalties):
    """Target-only greedy decoding with presence / frequency (/ repetition) penalties ==
    transformers' forward over the whole sequence every step, the formula, argmax."""
    hf = load_hf(tiny_pair[0])
    changed = 0
    p = as_params(**penalties)
    for text in PROMPTS[:2]:
        ids = tiny_target_only.encode_prompt(text)
        ref = reference_greedy(hf, ids, NEW_TOKENS, **penalties)
        out = tiny_target_only.generate(ids, max_new_tokens=NEW_TOKENS, ignore_eos=True, presence_penalty=p.presence_penalty,
                                        frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty)
        assert out.token_ids == ref
        changed += ref != reference_greedy(hf, ids, NEW_TOKENS)
    assert changed >= 1


# --- lossless: speculative decoding == target-only decoding, with the same penalties -------


@pytest.fixture(scope="module")
def qwen35_agree_pair(tmp_path_factory, tokenizer_dir):
    """An agreeable pair (conftest.make_agreeable_pair) on a hybrid Qwen3.5 (Gated DeltaNet) target."""
    return make_agreeable_pair(tmp_path_factory.mktemp("agree-qwen35-pen"), tokenizer_dir, model_type="qwen3_5_text",
                               alpha=0.5, self_scale=0.0)


@pytest.fixture(scope="module", params=["dflash", "dflash2", "qwen3.5"])
def models(request, agree_pair, agree_dflash2_pair, qwen35_agree_pair):
    target_dir, drafter_dir = {"dflash": agree_pair, "dflash2": agree_dflash2_pair,
                               "qwen3.5": qwen35_agree_pair}[request.param]
    return TargetModel.from_pretrained(target_dir, torch.float32), DFlashDrafter.from_pretrained(drafter_dir, torch.float32)


# strong enough to change the agreeable target's greedy output (it predicts token 42 often)
# (negative presence + frequency: runs of 42 whose end depends on its count, drafts included)
LOSSLESS = [as_params(presence=1.5), as_params(frequency=0.7), as_params(repetition=1.8),
            as_params(presence=0.5, frequency=0.5, repetition=1.3), as_params(presence=-1.0, frequency=0.3)]


def test_speculative_greedy_with_penalties_equals_target_only(models):
    """One sequence: SpeculativeDecoder (eager and fixed shapes) with penalties commits
    exactly the target-only tokens, over rounds that accept several drafts."""
    target, drafter = models
    prompts = varied_prompts(target, 3, length=8)
    spec = [SpeculativeDecoder(target, drafter), SpeculativeDecoder(target, drafter, static=True, max_context=256)]
    alone = SpeculativeDecoder(target, None)
    plain = [run_rounds(alone, prompt, NEW_TOKENS)[0] for prompt in prompts]  # (without penalties)
    taus, changed = [], 0
    for params in LOSSLESS:
        for prompt, without in zip(prompts, plain):
            ref = run_rounds(alone, prompt, NEW_TOKENS, params)[0]
            changed += ref != without
            for decoder in spec:
                out, t = run_rounds(decoder, prompt, NEW_TOKENS, params)
                assert out == ref, (params, prompt, decoder.static)
                taus += t
    assert changed >= len(LOSSLESS) * len(prompts) // 2
    assert sum(t > 2 for t in taus) >= 5  # rows past the block's first predict after accepted drafts


@pytest.mark.parametrize("mode", ["eager", "fixed-shapes", "target-only-rounds"])
def test_batch_with_mixed_penalties_equals_alone(models, mode):
    """Sequences with different penalties (one without, one sampling with a seed) in one
    batch, joined and added: greedy ones commit their target-only tokens, the sampled one
    the tokens it samples alone with the same seed. "target-only-rounds": rounds of more
    than 2 sequences run without drafts (all greedy then)."""
    target, drafter = models
    prompts = varied_prompts(target, 6, length=8)
    params = [SamplingParams(), as_params(presence=-1.0, frequency=0.3), as_params(presence=-1.0, frequency=0.3),
              as_params(frequency=0.7, repetition=1.4), as_params(presence=0.5, frequency=0.5, repetition=1.3),
              as_params(presence=1.0, repetition=1.2, temperature=0.8, seed=11)]
    if mode == "target-only-rounds":  # (a target-only round draws differently from a drafting one)
        params[5] = as_params(presence=1.0, repetition=1.2)
    out = churned_batch_equals_alone(target, drafter, prompts, params, mode, leaver=3, n_new=NEW_TOKENS)
    plain = run_rounds(SpeculativeDecoder(target, None), prompts[1], len(out[1]))[0]
    assert out[1] != plain  # the penalty changed the output


# --- sampling: the first tokens' distribution is the exact penalised one ---------------------


@torch.no_grad()
def exact_joint_penalized(hf, prompt: list[int], n: int, temperature: float, eps: float = 1e-5,
                          **penalties) -> dict[tuple, float]:
    """P(t_1..t_n | prompt) with the penalties then temperature, for every sequence reached
    through prefixes of probability > eps."""
    probs = {(): 1.0}
    for _ in range(n):
        prefixes = [k for k, v in probs.items() if v > eps]
        logits = hf(torch.tensor([prompt + list(k) for k in prefixes])).logits[:, -1].float()
        rows = torch.stack([reference_penalized(row, prompt, list(k), **penalties) for row, k in zip(logits, prefixes)])
        rows = processed(rows, temperature)
        probs = {k + (t,): probs[k] * float(row[t]) for k, row in zip(prefixes, rows) for t in row.nonzero()[:, 0].tolist()}
    return probs


SAMPLES = 500


def test_speculative_sampling_with_penalties_matches_the_exact_distribution(agree_pair):
    """The first three tokens sampled with penalties, speculatively (blocks of 4), follow the
    exact penalised distribution. A negative presence penalty with a frequency penalty
    makes the verify rows after an accepted draft of token 42 see a different penalty for
    42 at each count (the rows must count the drafts before them)."""
    target, drafter = agree_pair
    penalties = dict(presence=-0.5, frequency=0.4, repetition=1.2)
    engine = DFlashEngine.from_pretrained(target, drafter, block_size=4)
    prompt = engine.encode_prompt("def f(x):")
    hf = load_hf(target)
    exact = exact_joint_penalized(hf, prompt, 3, 0.3, **penalties)
    counts, taus = {}, []
    for seed in range(SAMPLES):
        out = engine.generate(prompt, max_new_tokens=3, ignore_eos=True, seed=seed, temperature=0.3,
                              presence_penalty=-0.5, frequency_penalty=0.4, repetition_penalty=1.2)
        key = tuple(out.token_ids)
        counts[key] = counts.get(key, 0) + 1
        taus += out.stats.acceptance_lengths
    assert chi_square_pvalue(counts, exact, SAMPLES) > ALPHA
    assert sum(t > 1 for t in taus) > SAMPLES // 10  # drafts were accepted: rows after them were penalised
    # power: the unpenalised distribution is rejected
    assert chi_square_pvalue(counts, exact_joint_penalized(hf, prompt, 3, 0.3), SAMPLES) < ALPHA


# --- parameters ------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(presence_penalty=2.5), dict(presence_penalty=float("nan")),
                                dict(frequency_penalty=-2.01), dict(frequency_penalty="1"),
                                dict(repetition_penalty=0), dict(repetition_penalty=-1.0),
                                dict(repetition_penalty=float("inf")), dict(repetition_penalty=True)])
def test_out_of_range_penalties_are_refused(kw, tiny_target_only):
    name = next(iter(kw))
    with pytest.raises(DFlashError, match=f"^{name} must be") as exc:
        SamplingParams(**kw)
    assert exc.value.names == (name,) and "\n" not in str(exc.value)
    with pytest.raises(DFlashError, match=f"^{name} must be"):
        tiny_target_only.generate("x", max_new_tokens=2, **kw)


def test_penalties_are_stored_as_floats():
    p = SamplingParams(presence_penalty=1, frequency_penalty=-2, repetition_penalty=2)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (1.0, -2.0, 2.0)
    assert all(type(x) is float for x in (p.presence_penalty, p.frequency_penalty, p.repetition_penalty))
    assert p.penalized and not SamplingParams().penalized


@pytest.mark.parametrize("r", [1e-50, 1e300])
def test_extreme_repetition_penalties_sample_without_overflow(agree_pair, r):
    """A repetition penalty that takes a seen token's logit beyond float32's range (1e-50
    divides a positive logit to inf) is clamped to the finite range: sampling still works
    (it used to fail on inf - inf = nan probabilities: a RuntimeError, a 500 in the server,
    and in a batch every other sequence of the round failed with it), alone and batched,
    and greedy speculative decoding still equals target-only."""
    logits = torch.tensor([[3.0, -2.0, 1.0, 0.5]])
    x = SamplingParams(repetition_penalty=r, temperature=1.0)
    pen = penalize(logits, torch.zeros(4), torch.tensor([True, True, False, False]), torch.tensor([0, 1]), x)
    assert torch.isfinite(pen).all() and torch.isfinite(probabilities(pen, x)).all()
    engine = DFlashEngine.from_pretrained(*agree_pair, max_batch_size=2, max_context=128)
    prompts = varied_prompts(engine.target, 2, seed=4, length=6)
    vocab = engine.target.config.vocab_size
    kw = dict(max_new_tokens=8, repetition_penalty=r, ignore_eos=True)
    outs = [engine.generate(prompts[0], temperature=1.0, seed=1, **kw)]
    outs += engine.generate_batch(prompts, temperature=1.0, seed=1, **kw)
    assert all(len(o.token_ids) == 8 and all(0 <= t < vocab for t in o.token_ids) for o in outs)
    target_only = DFlashEngine.from_pretrained(agree_pair[0], no_draft=True, max_context=128)
    assert engine.generate(prompts[0], **kw).token_ids == target_only.generate(prompts[0], **kw).token_ids
