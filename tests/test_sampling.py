"""Sampling is lossless: speculative decoding with temperature / top-k / top-p draws
tokens from exactly the target's own distribution.

Oracles are independent of the engine: the exact distribution of the first three
generated tokens is enumerated with transformers' model (temperature, top-k and top-p
applied by the code in this file), and the synthetic test of the acceptance rule
compares against the p it was given. Every statistical test is a chi-square
goodness-of-fit test at significance level ALPHA = 0.001, with fixed seeds, so the
suite is deterministic.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from conftest import load_hf
from dflash_torch import DFlashEngine, DFlashError, SamplingParams
from dflash_torch.sampling import accept_greedy, accept_sampling, probabilities, sample

ALPHA = 0.001  # significance level of every chi-square test here


def chi_square_pvalue(counts: dict, probs: dict, n: int, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit of observed ``counts`` (category -> count, n in all) to
    ``probs`` (category -> probability). Categories expected fewer than ``min_expected``
    times, the probability mass not enumerated, and any observed category not in
    ``probs`` are pooled into one bin."""
    big = [k for k, p in probs.items() if p * n >= min_expected]
    obs = [counts.get(k, 0) for k in big]
    exp = [probs[k] * n for k in big]
    rest_obs, rest_exp = n - sum(obs), n - sum(exp)
    if rest_exp >= min_expected or rest_obs > 0:
        obs.append(rest_obs)
        exp.append(max(rest_exp, 1e-9))
    exp = [e * sum(obs) / sum(exp) for e in exp]  # float rounding only
    return float(chisquare(obs, exp).pvalue)


# --- the acceptance rule on synthetic distributions ---------------------------------------

P = torch.tensor([[0.40, 0.30, 0.20, 0.10, 0.00],
                  [0.05, 0.05, 0.10, 0.30, 0.50],
                  [0.25, 0.25, 0.25, 0.25, 0.00]])
Q = torch.tensor([[0.10, 0.10, 0.50, 0.00, 0.30],   # q > p, q = 0 < p and q > 0 = p all occur
                  [0.05, 0.05, 0.10, 0.30, 0.50]])  # q == p: always accepted


def test_accept_sampling_output_is_distributed_as_p():
    g = torch.Generator().manual_seed(1234)
    draws = 12000
    first, second, bonus = {}, {}, {}
    n_second = n_bonus = 0
    accepted = [0, 0, 0]
    for _ in range(draws):
        draft = torch.multinomial(Q, 1, generator=g)[:, 0]
        a, tok = accept_sampling(draft, Q, P, g)
        a, tok = int(a), int(tok)
        accepted[a] += 1
        committed = draft[:a].tolist() + [tok]
        first[committed[0]] = first.get(committed[0], 0) + 1
        if len(committed) >= 2:  # position 2 is produced only when d_1 was accepted
            second[committed[1]] = second.get(committed[1], 0) + 1
            n_second += 1
        if a == 2:
            bonus[tok] = bonus.get(tok, 0) + 1
            n_bonus += 1
    # acceptance probability of d_1 is sum_x min(p, q) = 0.1 + 0.1 + 0.2 = 0.4; d_2 (q == p) always
    assert accepted[1] == 0
    assert abs(accepted[2] / draws - 0.4) < 0.03
    assert first.get(4, 0) == 0  # p = 0 token never output, though the drafter proposes it 30% of the time
    assert chi_square_pvalue(first, dict(enumerate(P[0].tolist())), draws) > ALPHA
    assert chi_square_pvalue(second, dict(enumerate(P[1].tolist())), n_second) > ALPHA
    assert chi_square_pvalue(bonus, dict(enumerate(P[2].tolist())), n_bonus) > ALPHA


def test_accept_greedy_prefix_and_bonus():
    logits = torch.full((5, 7), -1.0)
    for row, tok in enumerate([3, 1, 4, 1, 5]):
        logits[row, tok] = 1.0
    for draft, want in (([3, 1, 4, 1], (4, 5)), ([3, 1, 0, 1], (2, 4)), ([2, 1, 4, 1], (0, 3)), ([3, 1, 4, 0], (3, 1))):
        a, tok = accept_greedy(torch.tensor(draft), logits)
        assert (int(a), int(tok)) == want


# --- end to end: the engine's first generated tokens vs the exact target distribution -----

def processed(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
              min_p: float = 0.0) -> torch.Tensor:
    """Target distribution after temperature, then top-k (ties kept), then min-p (tokens
    below min_p times the largest probability dropped), then top-p (the smallest set of most
    likely tokens whose probability reaches top_p; among equally likely tokens the lower id
    counts as more likely), in float64."""
    x = logits.double() / temperature
    if 0 < top_k < x.shape[-1]:
        x = x.masked_fill(x < x.topk(top_k, dim=-1).values[..., -1:], float("-inf"))
    p = x.softmax(-1)
    if min_p > 0:
        p = p.masked_fill(p < min_p * p.amax(-1, keepdim=True), 0.0)
        p = p / p.sum(-1, keepdim=True)
    if top_p < 1:
        sp, order = p.sort(dim=-1, descending=True, stable=True)
        drop = (sp.cumsum(-1) - sp) >= top_p
        drop[..., 0] = False
        p = torch.zeros_like(p).scatter(-1, order, sp.masked_fill(drop, 0.0))
        p = p / p.sum(-1, keepdim=True)
    return p


@torch.no_grad()
def exact_joint(hf, prompt: list[int], n: int, eps: float = 1e-5, **params) -> dict[tuple, float]:
    """P(t_1..t_n | prompt) for every sequence reached through prefixes of probability > eps."""
    probs = {(): 1.0}
    for _ in range(n):
        prefixes = [k for k, v in probs.items() if v > eps]
        rows = processed(hf(torch.tensor([prompt + list(k) for k in prefixes])).logits[:, -1], **params)
        probs = {k + (t,): probs[k] * float(row[t]) for k, row in zip(prefixes, rows) for t in row.nonzero()[:, 0].tolist()}
    return probs


SAMPLES = 500
CASES = {
    # name: (pair, prompt, sampling params); the agreeable drafter is accepted often
    "temperature": ("agree", "def f(x):", dict(temperature=0.3)),
    "top-k": ("agree", "def f(x):", dict(temperature=0.5, top_k=4)),
    "top-p": ("agree", "import os\n", dict(temperature=0.4, top_p=0.9)),
    "min-p": ("agree", "import os\n", dict(temperature=0.8, min_p=0.05, top_p=0.95)),
    "temperature-random-drafter": ("random", "def f(x):", dict(temperature=0.1)),
    # a hybrid MoE target, blocks of 2 so that most samples span two rounds: a rejected
    # draft rolls the recurrent state back mid-block before the next round
    "temperature-hybrid-moe": ("agree-hybrid", "def f(x):", dict(temperature=0.5)),
    # a DFlash 2 drafter: drafts come from the candidate walk, q is the walk's own
    # distribution (zero outside each slot's top-K candidates)
    "temperature-dflash2": ("agree-dflash2", "def f(x):", dict(temperature=0.5)),
    "top-p-dflash2": ("agree-dflash2", "import os\n", dict(temperature=0.4, top_p=0.9)),
    # a Speculators-format drafter: drafts from two thirds of the vocabulary (q is zero on the
    # rest, where the target's samples still land) and a causal sliding-window layer
    "temperature-speculators": ("agree-speculators", "def f(x):", dict(temperature=0.5)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_matches_the_exact_target_distribution(case, agree_pair, tiny_pair, agree_hybrid_pair,
                                                                    agree_dflash2_pair, agree_speculators_pair):
    pair, text, params = CASES[case]
    target, drafter = {"agree": agree_pair, "random": tiny_pair, "agree-hybrid": agree_hybrid_pair,
                       "agree-dflash2": agree_dflash2_pair, "agree-speculators": agree_speculators_pair}[pair]
    engine = DFlashEngine.from_pretrained(target, drafter, block_size=2 if pair == "agree-hybrid" else 4)
    prompt = engine.encode_prompt(text)
    exact = exact_joint(load_hf(target), prompt, 3, **params)
    counts, taus = {}, []
    for seed in range(SAMPLES):
        out = engine.generate(prompt, max_new_tokens=3, ignore_eos=True, seed=seed, **params)
        key = tuple(out.token_ids)
        assert len(key) == 3
        counts[key] = counts.get(key, 0) + 1
        taus += out.stats.acceptance_lengths
    assert chi_square_pvalue(counts, exact, SAMPLES) > ALPHA
    # the drafter path really ran: rejected drafts always, accepted drafts with the agreeable pair
    assert sum(t < 4 for t in taus) > SAMPLES // 10
    if pair.startswith("agree"):  # (tau counts the tokens kept: drafts accepted past the 3 are seen in longer runs)
        longer = [t for seed in range(20) for t in engine.generate(prompt, max_new_tokens=12, ignore_eos=True,
                                                                     seed=seed, **params).stats.acceptance_lengths]
        assert sum(t > 1 for t in longer) > len(longer) // 10
        # and the same samples are far from what "accept every draft" would give (c, c, c)
        assert counts.get((42, 42, 42), 0) < 0.9 * SAMPLES
    if case == "temperature":  # the test has power: a nearby wrong distribution is rejected
        assert chi_square_pvalue(counts, exact_joint(load_hf(target), prompt, 3, temperature=0.4), SAMPLES) < ALPHA
    if case == "min-p":  # min_p really changes the distribution, and the test sees it
        without = {k: v for k, v in params.items() if k != "min_p"}
        assert chi_square_pvalue(counts, exact_joint(load_hf(target), prompt, 3, **without), SAMPLES) < ALPHA


def test_top_k_1_sampling_equals_greedy(agree_pair):
    """One-hot target and draft distributions: rejection sampling must reproduce greedy decoding."""
    spec = DFlashEngine.from_pretrained(*agree_pair)
    base = DFlashEngine(spec.target, spec.tokenizer)
    for seed, prompt in enumerate(["def f(x):", "class Stack:\n", "import os\n"]):
        ref = base.generate(prompt, max_new_tokens=32, ignore_eos=True)
        out = spec.generate(prompt, max_new_tokens=32, ignore_eos=True, temperature=0.7, top_k=1, seed=seed)
        assert out.token_ids == ref.token_ids
        assert out.stats.mean_acceptance_length > 1.5


def test_seeds_differing_above_bit_31_sample_differently_on_a_cpu():
    """torch's CPU generator keeps 32 bits of a seed: a seed outside [0, 2**32) seeds it
    with a hash of its 64 bits, so 0, 2**32, 2**40, 7 * 2**32 (and -1, 2**32 - 1) draw
    differently; a seed in [0, 2**32) seeds it as torch does; seeds are taken modulo 2**64."""
    def draws(seed: int) -> list[float]:
        return torch.rand(4, generator=SamplingParams(temperature=1.0, seed=seed).generator("cpu")).tolist()

    seeds = [0, 2**32, 2**40, 7 * 2**32, -1, 2**32 - 1, 5, 5 + 2**33, 2**63 - 1]
    assert len({tuple(draws(s)) for s in seeds}) == len(seeds)
    assert draws(5) == torch.rand(4, generator=torch.Generator().manual_seed(5)).tolist()
    assert draws(-1) == draws(2**64 - 1) and draws(2**40) == draws(2**40)


def test_sampling_is_reproducible_with_a_seed(tiny_pair):
    """Seeds make requests reproducible; different seeds give different samples."""
    target, drafter = tiny_pair
    engine = DFlashEngine.from_pretrained(target, drafter)
    a = engine.generate("def f(x):", max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=3)
    b = engine.generate("def f(x):", max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=3)
    c = engine.generate("def f(x):", max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=4)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12
    assert a.token_ids != c.token_ids


def test_probabilities_match_the_oracle_processing():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    logits[0, :3] = 10.0  # a three-way tie at the top
    for kw in (dict(temperature=0.7), dict(temperature=1.3, top_k=5), dict(temperature=1.0, top_p=0.5),
               dict(temperature=0.5, top_k=1), dict(temperature=2.0, top_k=10, top_p=0.3), dict(temperature=1.0, top_k=2),
               dict(temperature=1.0, min_p=0.1), dict(temperature=1.5, top_k=20, min_p=0.05, top_p=0.7),
               dict(temperature=0.7, min_p=1.0)):
        ours = probabilities(logits, SamplingParams(**kw))
        torch.testing.assert_close(ours.double(), processed(logits, **kw), atol=1e-6, rtol=1e-5)
    assert int((probabilities(logits, SamplingParams(temperature=1.0, top_k=2))[0] > 0).sum()) == 3  # ties kept


def test_min_p_matches_transformers_min_p_warper():
    """min_p alone, against transformers' own MinPLogitsWarper (an independent oracle)."""
    from transformers.generation.logits_process import MinPLogitsWarper
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 64, generator=g) * 4
    for t, m in ((1.0, 0.05), (0.6, 0.2), (1.7, 0.5)):
        want = MinPLogitsWarper(m)(None, logits / t).softmax(-1)
        got = probabilities(logits, SamplingParams(temperature=t, min_p=m))
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        assert (got == 0).any()  # the test has power: some tokens are dropped


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0),
                                dict(top_p=1.5), dict(top_k=-2), dict(top_k=2.5), dict(temperature=10**400),
                                dict(top_p=10**400), dict(min_p=-0.1), dict(min_p=1.01), dict(min_p=float("nan")),
                                dict(min_p="0.1")])
def test_invalid_sampling_parameters(kw):
    with pytest.raises(DFlashError) as err:
        SamplingParams(**kw)
    assert "\n" not in str(err.value)


def test_top_k_minus_one_is_off_as_in_vllm():
    """top_k -1 (vLLM's and the server's spelling of no limit) is taken as 0, as the server takes it."""
    assert SamplingParams(top_k=-1, temperature=1.0) == SamplingParams(top_k=0, temperature=1.0)


def test_equal_params_hash_equal_with_a_logit_bias():
    """SamplingParams is a frozen dataclass with a hash, but hash() raised "unhashable type: 'dict'"
    once logit_bias was set (trial-310); equal params (the bias's ids as ints or strings, in any
    order) must hash equal."""
    a, b = SamplingParams(logit_bias={5: 1, 7: -2.5}, seed=3), SamplingParams(logit_bias={"7": -2.5, "05": 1.0}, seed=3)
    assert a == b and hash(a) == hash(b)
    assert hash(SamplingParams(top_k=-1)) == hash(SamplingParams(top_k=0))
    assert len({a, b, SamplingParams(logit_bias={5: 1}), SamplingParams()}) == 3


# --- every accepted parameter value decodes: extreme temperatures, top-p, top-k, logits ----
# (deterministic: hypothesis runs derandomized, without an example database)
PROPERTY = settings(max_examples=300, deadline=None, derandomize=True, database=None)
TINY_TEMPERATURES = [5e-324, 1e-300, 1e-46, 1e-40, 1e-20]  # below float32's range included
HUGE_TEMPERATURES = [1e39, 1e300, 10**30]                   # above float32's range, and an int
temperatures = st.one_of(st.sampled_from(TINY_TEMPERATURES + HUGE_TEMPERATURES + [1e-6, 1e6]),
                         st.floats(min_value=5e-324, max_value=1e308))
top_ps = st.one_of(st.sampled_from([5e-324, 1e-9, 1.0]), st.floats(min_value=0, max_value=1, exclude_min=True))


@st.composite
def logit_rows(draw, max_scale: float = 1e30, min_rows: int = 1):
    """Logits ``[N, V]``: random, peaked (one token far above), flat (all equal) or with a
    three-way tie at the top, at scales from 1e-6 to 1e30, in float32 or bfloat16."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    rows, vocab = draw(st.integers(min_rows, 3)), draw(st.integers(2, 40))
    scale = draw(st.sampled_from([s for s in (1e-6, 1.0, 30.0, 1e4, 1e30) if s <= max_scale]))
    x = torch.randn(rows, vocab, generator=g) * scale
    shape = draw(st.sampled_from(["random", "peaked", "flat", "ties"]))
    if shape == "peaked":
        x[:, draw(st.integers(0, vocab - 1))] = scale * 1000
    elif shape == "flat":
        x = torch.full_like(x, scale)
    elif shape == "ties":
        x[:, : min(3, vocab)] = x.amax() + scale
    return x.to(draw(st.sampled_from([torch.float32, torch.bfloat16])))


def is_max(logits: torch.Tensor) -> torch.Tensor:
    x = logits.float()
    return x == x.amax(dim=-1, keepdim=True)


@PROPERTY
@given(logits=logit_rows(), t=temperatures, top_k=st.integers(0, 50), top_p=top_ps, seed=st.integers(0, 2**31),
       min_p=st.one_of(st.just(0.0), st.floats(min_value=0, max_value=1)))
def test_probabilities_are_a_distribution_for_every_accepted_value(logits, t, top_k, top_p, seed, min_p):
    p = probabilities(logits, SamplingParams(temperature=t, top_k=top_k, top_p=top_p, min_p=min_p))
    assert p.dtype == torch.float32 and p.shape == logits.shape
    assert torch.isfinite(p).all() and (p >= 0).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(len(p)), atol=1e-5, rtol=0)
    assert ((p > 0) & is_max(logits)).any(-1).all()  # a most likely token is always kept
    if 0 < top_k < logits.shape[-1]:
        x = logits.float()
        assert (p[x < x.topk(top_k, dim=-1).values[:, -1:]] == 0).all()
    token = sample(p, torch.Generator().manual_seed(seed))
    assert (p[torch.arange(len(p)), token] > 0).all()


@PROPERTY
@given(logits=logit_rows(), t=temperatures, top_k=st.integers(0, 50))
def test_probabilities_match_the_float64_oracle_wherever_it_is_defined(logits, t, top_k):
    """Away from the limits where float64 itself overflows, the values are the oracle's."""
    want = processed(logits.float(), float(t), top_k)
    if torch.isfinite(want).all():
        got = probabilities(logits, SamplingParams(temperature=t, top_k=top_k))
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-4)


@PROPERTY
@given(logits=logit_rows(), t=st.sampled_from(TINY_TEMPERATURES), top_k=st.integers(0, 50))
def test_tiny_temperature_is_uniform_over_the_maximum(logits, t, top_k):
    """The limit T -> 0+: one-hot on the argmax, uniform over tied maxima; never NaN."""
    top = is_max(logits)
    p = probabilities(logits, SamplingParams(temperature=t, top_k=top_k))
    assert torch.equal(p, top.float() / top.sum(-1, keepdim=True))


@PROPERTY
@given(logits=logit_rows(), t=st.sampled_from(TINY_TEMPERATURES + HUGE_TEMPERATURES + [1.0]), top_k=st.integers(0, 50))
def test_min_p_1_keeps_exactly_the_most_likely_tokens_at_every_temperature(logits, t, top_k):
    """(At a huge temperature float32 probabilities round to equal values: a test on them kept near-ties.)"""
    p = probabilities(logits, SamplingParams(temperature=t, top_k=top_k, min_p=1.0))
    assert torch.equal(p > 0, is_max(logits))


@PROPERTY
@given(logits=logit_rows(max_scale=1e4), t=st.sampled_from(HUGE_TEMPERATURES), top_k=st.integers(0, 50))
def test_huge_temperature_is_uniform_over_the_kept_tokens(logits, t, top_k):
    x = logits.float()
    kept = x >= x.topk(top_k, dim=-1).values[:, -1:] if 0 < top_k < x.shape[-1] else torch.ones_like(x, dtype=torch.bool)
    p = probabilities(logits, SamplingParams(temperature=t, top_k=top_k))
    torch.testing.assert_close(p, kept.float() / kept.sum(-1, keepdim=True), atol=1e-7, rtol=0)


@PROPERTY
@given(target=logit_rows(min_rows=2), draft=logit_rows(), t=temperatures, top_k=st.integers(0, 50), top_p=top_ps,
       seed=st.integers(0, 2**31), min_p=st.sampled_from([0.0, 0.05, 0.5, 1.0]))
def test_accept_sampling_stays_valid_for_every_accepted_value(target, draft, t, top_k, top_p, seed, min_p):
    """Drafts and the bonus / correction token always have positive target probability;
    at the T -> 0+ limit the committed tokens are the target's argmax (greedy decoding)."""
    rows = min(len(target), len(draft) + 1)
    vocab = min(target.shape[1], draft.shape[1])
    target, draft = target[:rows, :vocab], draft[:rows - 1, :vocab]
    params = SamplingParams(temperature=t, top_k=top_k, top_p=top_p, min_p=min_p)
    g = torch.Generator().manual_seed(seed)
    p, q = probabilities(target, params), probabilities(draft, params)
    d = sample(q, g)
    a, tok = accept_sampling(d, q, p, g)
    a, tok = int(a), int(tok)
    committed = d[:a].tolist() + [tok]
    assert 0 <= a < rows
    assert all(p[i, c] > 0 for i, c in enumerate(committed))
    if t in TINY_TEMPERATURES and (is_max(target).sum(-1) == 1).all():
        assert committed == target.float().argmax(-1)[: a + 1].tolist()


# --- end to end: extreme values through generate (drafter on and off, float32 and bfloat16) ---

EXTREMES = {
    # name: (sampling params, True where the output must equal greedy decoding token for token)
    "temperature-1e-40": (dict(temperature=1e-40), True),
    "temperature-5e-324": (dict(temperature=5e-324), True),
    "top-p-1e-9": (dict(temperature=1.0, top_p=1e-9), True),
    "top-k-1-temperature-1e6": (dict(temperature=1e6, top_k=1), True),
    "temperature-1e-6": (dict(temperature=1e-6), False),
    "temperature-1e6": (dict(temperature=1e6), False),
    "temperature-1e300-top-p-0.5": (dict(temperature=1e300, top_p=0.5), False),
}


@pytest.fixture(scope="module")
def extreme_engines(agree_pair):
    """{(dtype, drafter on?): engine} for the agreeable pair (drafts are often accepted)."""
    out = {}
    for dtype in ("float32", "bfloat16"):
        spec = DFlashEngine.from_pretrained(*agree_pair, dtype=dtype)
        out[dtype, True], out[dtype, False] = spec, DFlashEngine(spec.target, spec.tokenizer)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("draft", [True, False], ids=["draft", "no-draft"])
def test_extreme_sampling_values_decode(extreme_engines, dtype, draft):
    """With T -> 0+ (or top-k 1, or a top-p below the top token's probability) the draft
    distributions are one-hot too, so speculative decoding proposes exactly the greedy drafts
    and, in either dtype, must give this engine's greedy output."""
    engine = extreme_engines[dtype, draft]
    prompt = "def f(x):"
    greedy = engine.generate(prompt, max_new_tokens=16, ignore_eos=True)
    for name, (params, is_greedy) in EXTREMES.items():
        out = engine.generate(prompt, max_new_tokens=16, ignore_eos=True, seed=0, **params)
        assert len(out.token_ids) == 16 and out.finish_reason == "length", name
        assert all(0 <= t < engine.target.config.vocab_size for t in out.token_ids), name
        assert out.text == engine.decode(out.token_ids), name
        if is_greedy:
            assert out.token_ids == greedy.token_ids, name
            assert out.stats.acceptance_lengths == greedy.stats.acceptance_lengths, name


def test_top_p_drops_a_token_once_the_mass_before_it_reaches_top_p():
    """Top-p's boundary: a token is dropped when the tokens ranked before it already reach
    top_p exactly (the smallest set whose probability reaches top_p), equal probabilities
    ranked by id. Exact in float32: equal logits give probabilities 1/2 and 1/4."""
    def kept(logits, top_p):
        return probabilities(torch.tensor([logits]), SamplingParams(temperature=1.0, top_p=top_p))[0].tolist()

    assert kept([0.0, 0.0], 0.5) == [1.0, 0.0]
    assert kept([0.0, 0.0, 0.0, 0.0], 0.5) == [0.5, 0.5, 0.0, 0.0]
    assert kept([0.0, 0.0, 0.0, 0.0], 0.75) == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0])
    assert kept([0.0, 0.0, 0.0, 0.0], 0.5000001) == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0])


def test_accept_sampling_with_a_limit_never_commits_a_rejected_draft():
    """With a draft limit k, draft k ends the round only where it passes its test; where it
    is rejected, row k's token is drawn from the residual as without a limit. A draft the
    target gives probability 0 is always rejected, so it is never committed; and with q
    unlike p, row k's token is still distributed as p (chi-square)."""
    g = torch.Generator().manual_seed(7)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    for _ in range(50):
        a, token = accept_sampling(torch.tensor([0]), q, p, g, limit=0)
        assert (int(a), int(token)) == (0, 1)
    p = torch.tensor([[0.2, 0.3, 0.5], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.5, 0.5, 0.0]])
    counts, n = {}, 4000
    for _ in range(n):
        draft = sample(q, g)
        a, token = accept_sampling(draft, q, p, g, limit=0)
        assert int(a) == 0
        counts[int(token)] = counts.get(int(token), 0) + 1
    assert chi_square_pvalue(counts, dict(enumerate(p[0].tolist())), n) > ALPHA
