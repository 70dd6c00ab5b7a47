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
from scipy.stats import chisquare

from conftest import load_hf
from dflash_torch import DFlashEngine, DFlashError, SamplingParams
from dflash_torch.sampling import accept_greedy, accept_sampling, probabilities

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

def processed(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Target distribution after temperature, then top-k (ties kept), then top-p (the smallest
    set of most likely tokens whose probability reaches top_p), in float64."""
    x = logits.double() / temperature
    if top_k:
        x = x.masked_fill(x < x.topk(top_k, dim=-1).values[..., -1:], float("-inf"))
    p = x.softmax(-1)
    if top_p < 1:
        sp, order = p.sort(-1, descending=True)
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
    "temperature-random-drafter": ("random", "def f(x):", dict(temperature=0.1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_matches_the_exact_target_distribution(case, agree_pair, tiny_pair):
    pair, text, params = CASES[case]
    target, drafter = agree_pair if pair == "agree" else tiny_pair
    engine = DFlashEngine.from_pretrained(target, drafter, block_size=4)
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
    if pair == "agree":
        assert sum(t > 1 for t in taus) > SAMPLES // 10
        # and the same samples are far from what "accept every draft" would give (c, c, c)
        assert counts.get((42, 42, 42), 0) < 0.9 * SAMPLES
    if case == "temperature":  # the test has power: a nearby wrong distribution is rejected
        assert chi_square_pvalue(counts, exact_joint(load_hf(target), prompt, 3, temperature=0.4), SAMPLES) < ALPHA


def test_top_k_1_sampling_equals_greedy(agree_pair):
    """One-hot target and draft distributions: rejection sampling must reproduce greedy decoding."""
    spec = DFlashEngine.from_pretrained(*agree_pair)
    base = DFlashEngine(spec.target, spec.tokenizer)
    for seed, prompt in enumerate(["def f(x):", "class Stack:\n", "import os\n"]):
        ref = base.generate(prompt, max_new_tokens=32, ignore_eos=True)
        out = spec.generate(prompt, max_new_tokens=32, ignore_eos=True, temperature=0.7, top_k=1, seed=seed)
        assert out.token_ids == ref.token_ids
        assert out.stats.mean_acceptance_length > 1.5


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
               dict(temperature=0.5, top_k=1), dict(temperature=2.0, top_k=10, top_p=0.3), dict(temperature=1.0, top_k=2)):
        ours = probabilities(logits, SamplingParams(**kw))
        torch.testing.assert_close(ours.double(), processed(logits, **kw), atol=1e-6, rtol=1e-5)
    assert int((probabilities(logits, SamplingParams(temperature=1.0, top_k=2))[0] > 0).sum()) == 3  # ties kept


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0),
                                dict(top_p=1.5), dict(top_k=-1), dict(top_k=2.5)])
def test_invalid_sampling_parameters(kw):
    with pytest.raises(DFlashError) as err:
        SamplingParams(**kw)
    assert "\n" not in str(err.value)
