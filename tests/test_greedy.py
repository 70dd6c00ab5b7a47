"""Greedy speculative decoding is token-identical to greedy target-only decoding and
to transformers' ``generate(do_sample=False)``, for block sizes 2, 4, 8 and 16, many
prompts and several targets/drafters: random drafters (almost every draft rejected)
and an agreeable pair whose drafter is accepted often (multi-token acceptance)."""

from __future__ import annotations

import pytest
import torch

from conftest import AGREE_TOKEN, MASK_ID, copy_tokenizer, drafter_config, load_hf, save_drafter
from conftest import make_target
from dflash_torch import DFlashEngine

NEW_TOKENS = 40
BLOCK_SIZES = [2, 4, 8, 16]
TEXT_PROMPTS = ["def f(x):", "    return self._data[index]\n", "# Copyright\n\"\"\"Heap queue algorithm.\"\"\"\n", "import os\nimport sys\n", "class Stack:\n    def push(self, item):\n", "x"]


def id_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    long = torch.randint(2, vocab, (37,), generator=g).tolist()
    long[5] = MASK_ID  # the mask token inside a prompt is just a token
    return [long, [MASK_ID, 3, MASK_ID]]


@pytest.fixture(scope="module", params=["random-qwen3", "random-llama", "agree"])
def setup(request, tiny_pair, agree_pair, tmp_path_factory, tokenizer_dir):
    if request.param == "random-qwen3":
        target, drafter = tiny_pair
    elif request.param == "random-llama":
        root = tmp_path_factory.mktemp("llama-pair")
        target = make_target(root / "target", "llama", seed=3, tokenizer=False, tie_word_embeddings=False)
        copy_tokenizer(tokenizer_dir, target)
        drafter = save_drafter(root / "drafter", drafter_config(target, num_layers=1, block_size=16), seed=5)
    else:
        target, drafter = agree_pair
    spec = DFlashEngine.from_pretrained(target, drafter)
    base = DFlashEngine(spec.target, spec.tokenizer)  # target-only decoding (what --no-draft builds)
    prompts = [spec.encode_prompt(p) for p in TEXT_PROMPTS] + id_prompts(spec.target.config.vocab_size)
    refs = [base.generate(p, max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids for p in prompts]
    return request.param, spec, base, target, prompts, refs


def test_target_only_matches_transformers_generate(setup):
    _, _, base, target, prompts, refs = setup
    assert base.block_size == 1 and base.drafter is None
    hf = load_hf(target)
    for prompt, ref in zip(prompts, refs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                              do_sample=False, eos_token_id=None)
        assert out[0, len(prompt):].tolist() == ref
        assert len(ref) == NEW_TOKENS


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_speculative_greedy_is_token_identical(setup, block_size):
    name, spec, _, _, prompts, refs = setup
    engine = DFlashEngine(spec.target, spec.tokenizer, spec.drafter, block_size=block_size)
    assert engine.block_size == block_size
    taus = []
    for prompt, ref in zip(prompts, refs):
        out = engine.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        assert out.token_ids == ref, f"{name} B={block_size} prompt {prompt[:8]}..."
        assert out.finish_reason == "length" and out.stats.generated_tokens == NEW_TOKENS
        assert all(1 <= t <= block_size for t in out.stats.acceptance_lengths)
        taus += out.stats.acceptance_lengths
    mean_tau = sum(taus) / len(taus)
    if name == "agree":
        # the drafter is really accepted, over multi-token paths of several lengths
        assert mean_tau >= (1.5 if block_size == 2 else 2.0), mean_tau
        assert max(taus) == block_size
        if block_size >= 8:
            assert any(1 < t < block_size for t in taus), taus


def test_agreeable_target_predicts_c_often_but_not_always(agree_pair):
    base = DFlashEngine.from_pretrained(agree_pair[0], no_draft=True)
    prompts = [base.encode_prompt(p) for p in TEXT_PROMPTS] + id_prompts(base.target.config.vocab_size)
    refs = [base.generate(p, max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids for p in prompts]
    frac = [sum(t == AGREE_TOKEN for t in ref) / len(ref) for ref in refs]
    overall = sum(frac) / len(frac)
    assert 0.3 <= overall <= 0.95, frac
    assert min(frac) < 0.9  # at least one prompt where the target often goes elsewhere


@pytest.mark.parametrize("block_size", [4, 16])
def test_fixed_shape_rounds_are_token_identical(setup, block_size):
    """The fixed-shape (static cache, masked attention, all-B-rows inject) loop, eager."""
    name, spec, _, _, prompts, refs = setup
    engine = DFlashEngine(spec.target, spec.tokenizer, spec.drafter, block_size=block_size, static=True)
    for prompt, ref in list(zip(prompts, refs))[::2]:
        assert engine.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids == ref, name


@pytest.mark.parametrize("static", [False, True], ids=["sliced", "fixed-shape"])
def test_chunked_prefill_is_token_identical(setup, static):
    """Prompts longer than the prefill chunk (several chunks, the last one partial)."""
    name, spec, _, _, prompts, refs = setup
    engine = DFlashEngine(spec.target, spec.tokenizer, spec.drafter, block_size=8, static=static, prefill_chunk=8)
    long_prompts = [(p, r) for p, r in zip(prompts, refs) if len(p) > 8]
    assert len(long_prompts) >= 2
    for prompt, ref in long_prompts:
        assert engine.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids == ref, name


def test_a_drafter_without_a_mask_token_id_takes_it_from_the_tokenizer(agree_pair, tmp_path, caplog):
    """A DFlash drafter config without ``dflash_config.mask_token_id`` (SpecForge's older
    ones): its ``mask_token`` (default ``<|MASK|>``, the test tokenizer's id 1, the agreeable
    drafter's mask id) is looked up in the target's tokenizer, as SGLang does: the same drafts;
    a token the tokenizer lacks gets the id it would be added as (inside the embedding table)."""
    import logging
    import shutil

    from conftest import VOCAB, edited_checkpoint, make_target

    target, drafter = agree_pair
    no_id = edited_checkpoint(drafter, tmp_path / "no-id", config=lambda c: c["dflash_config"].pop("mask_token_id"))
    with caplog.at_level(logging.INFO, logger="dflash_torch"):
        a, b = DFlashEngine.from_pretrained(target, drafter), DFlashEngine.from_pretrained(target, no_id)
    assert b.drafter.config.mask_token_id == MASK_ID
    null = edited_checkpoint(drafter, tmp_path / "null", config=lambda c: c["dflash_config"].update(
        mask_token_id=None, mask_token=None))  # (null: the default, as SGLang reads it)
    assert DFlashEngine.from_pretrained(target, null).drafter.config.mask_token_id == MASK_ID
    assert "mask token '<|MASK|>' is id 1 (its id in the target's tokenizer)" in caplog.text
    prompt = [5, 17, 99, 3]
    x, y = (e.generate(prompt, max_new_tokens=40, ignore_eos=True) for e in (a, b))
    assert x.token_ids == y.token_ids and x.stats.acceptance_lengths == y.stats.acceptance_lengths
    # a target whose embedding table has rows past the tokenizer: an unknown mask token gets the first
    big = make_target(tmp_path / "big", "qwen3", seed=1, tokenizer=False, vocab_size=VOCAB + 8, tie_word_embeddings=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (target / name).is_file():
            shutil.copy(target / name, big / name)
    other = edited_checkpoint(drafter, tmp_path / "other", config=lambda c: (
        c.update(vocab_size=VOCAB + 8), c["dflash_config"].pop("mask_token_id"), c["dflash_config"].update(mask_token="<m>")))
    engine = DFlashEngine.from_pretrained(big, other)
    assert engine.drafter.config.mask_token_id == VOCAB
    out = engine.generate(prompt, max_new_tokens=20, ignore_eos=True)
    assert out.token_ids == DFlashEngine(engine.target, engine.tokenizer).generate(prompt, max_new_tokens=20,
                                                                                   ignore_eos=True).token_ids
