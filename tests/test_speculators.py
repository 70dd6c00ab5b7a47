"""Speculators-format DFlash drafters (vLLM's speculators library: ``speculators_model_type``
"dflash"; e.g. the RedHatAI ``*-speculator.dflash`` checkpoints).

The oracle for the drafter itself is the library: tests/data/speculators holds tiny
checkpoints its own ``DFlashDraftModel`` wrote and the draft logits it computed for them
(``scripts/speculators_reference.py``). The oracle for decoding is the target alone
(transformers' ``generate``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import (SPEC_DRAFT_TOKENS, VOCAB, check_compiled_rounds_are_lossless,
                      check_greedy_equals_transformers, check_many_accepted_tokens_are_lossless, edited_checkpoint,
                      load_hf, to_speculators)
from safetensors.torch import load_file

from dflash_torch import DFlashEngine, DFlashError
from dflash_torch.models.drafter import DFlashDrafter, InjectedContext, RecomputedContext
from dflash_torch.models.speculators import SpeculatorsDrafter

DATA = Path(__file__).parent / "data" / "speculators"
CASES = ["draft-vocab-causal", "full-vocab-non-causal", "llama-gelu-bias"]


def library_case(name: str):
    drafter = DFlashDrafter.from_pretrained(DATA / name, torch.float32)
    return drafter, load_file(str(DATA / name / "reference.safetensors"))


def draft_logits_at(drafter, ref, anchor: int, mode: str) -> torch.Tensor:
    """Our draft logits ``[B - 1, vocab]`` for the block anchored at ``anchor`` (context: the
    reference's features of positions ``[0, anchor)``), through the injected cache (a slice,
    or the whole buffer under a mask) or the recomputed context."""
    B = drafter.config.block_size
    feats, ids = ref["features"], ref["input_ids"]
    if mode == "ring":  # rings sized for writes of B rows (prefill chunks of B): injected B rows at a time
        ctx = InjectedContext(drafter, max_rows=B)
        ctx.reset(64)
        assert [t.shape[1] for t in ctx.cache.k] == [w + B - 1 if w else ctx.cache.capacity for w in drafter.kv_windows()]
        for c0 in range(0, anchor, B):
            ctx.inject(drafter, feats[c0:min(anchor, c0 + B)], torch.arange(c0, min(anchor, c0 + B)))
        ctx.inject(drafter, feats[anchor:anchor + B], torch.arange(anchor, anchor + B))  # (a rejected block's rows)
    else:
        ctx = RecomputedContext(drafter) if mode == "recompute" else InjectedContext(drafter)
        ctx.reset(64)
        ctx.inject(drafter, feats[:anchor], torch.arange(anchor))
    if mode == "static":  # (stale rows past the block, as a fixed-shape buffer holds)
        ctx.inject(drafter, feats[anchor:], torch.arange(anchor, len(feats)))
        ctx.cache.length = anchor
    block = torch.full((B,), drafter.config.mask_token_id)
    block[0] = ids[anchor]
    with torch.no_grad():
        hidden = drafter(drafter.embed(None, block), torch.arange(anchor, anchor + B), ctx,
                         None if mode in ("static", "ring") else anchor + B)
        return drafter.draft_logits(None, hidden[1:])


@pytest.mark.parametrize("mode", ["slice", "static", "recompute", "ring"])
@pytest.mark.parametrize("case", CASES)
def test_draft_logits_equal_the_speculators_library(case, mode):
    """The library's own draft logits (its training forward: sliding-window layer causal in
    the block unless non-causal, the window counted from the block's start; a full layer)
    for blocks inside, at and past the window, over the draft vocabulary (mapped through
    d2t; -inf elsewhere). "ring": the sliding layer keeps a ring for writes of B rows, whose
    block reaches one position more than a DFlash drafter's (``[s - window, s]``: a ring of
    ``window + B`` rows; with one row fewer the block's last row displaced position
    ``s - window``, helper-7's finding), and a rejected block's rows lie past the block."""
    drafter, ref = library_case(case)
    assert isinstance(drafter, SpeculatorsDrafter)
    assert drafter.config.target_layer_ids == [0, 2]  # (aux ids [1, 3]: the inputs of layers 1 and 3)
    for anchor in ref["anchors"].tolist():
        ours = draft_logits_at(drafter, ref, anchor, mode)
        theirs = ref[f"logits_{anchor}"][1:]
        if drafter.d2t is not None:
            tokens = drafter.d2t + torch.arange(len(drafter.d2t))
            outside = torch.ones(ours.shape[-1], dtype=torch.bool).index_fill(0, tokens, False)
            assert outside.sum() == VOCAB_OF_FIXTURES - len(tokens)
            assert torch.isneginf(ours[:, outside]).all()
            ours = ours[:, tokens]
        torch.testing.assert_close(ours, theirs, atol=2e-6, rtol=1e-5)


VOCAB_OF_FIXTURES = 96


def test_the_fixture_attention_rules_matter():
    """The oracle comparison has power: reading the causal fixture with the DFlash reference's
    rules (non-causal, window per row) changes its logits well beyond the tolerance."""
    drafter, ref = library_case("draft-vocab-causal")
    for layer in drafter.layers:
        layer.causal = False
    ours = draft_logits_at(drafter, ref, 9, "slice")
    tokens = drafter.d2t + torch.arange(len(drafter.d2t))
    assert (ours[:, tokens] - ref["logits_9"][1:]).abs().max() > 1e-3


def test_greedy_equals_transformers_with_a_draft_vocabulary_and_a_causal_window(tiny_pair, tmp_path):
    """A random drafter in the Speculators format (two thirds of the vocabulary, a causal
    sliding window of 4 on its first layer): target-only output in every mode."""
    target, drafter = tiny_pair
    spec = to_speculators(drafter, target, tmp_path / "spec", draft_tokens=SPEC_DRAFT_TOKENS, sliding_window=4)
    check_greedy_equals_transformers(target, spec, block_sizes=(2, 16), new_tokens=20)


def test_a_converted_drafter_drafts_as_the_original(agree_pair, tmp_path):
    """The agreeable DFlash drafter written in the Speculators format (full vocabulary, the
    target's embedding and LM head: what speculators' converter makes of a DFlash checkpoint)
    drafts the same tokens: equal outputs and equal acceptance lengths."""
    target, drafter = agree_pair
    spec = to_speculators(drafter, target, tmp_path / "spec")
    a = DFlashEngine.from_pretrained(target, drafter)
    b = DFlashEngine(a.target, a.tokenizer, DFlashDrafter.from_pretrained(spec, torch.float32))
    for prompt in ([5, 17, 99, 3], list(range(2, 45))):
        x = a.generate(prompt, max_new_tokens=60, ignore_eos=True)
        y = b.generate(prompt, max_new_tokens=60, ignore_eos=True)
        assert x.token_ids == y.token_ids
        assert x.stats.acceptance_lengths == y.stats.acceptance_lengths
        assert x.stats.mean_acceptance_length > 2


def test_many_accepted_tokens_are_lossless(agree_speculators_pair):
    check_many_accepted_tokens_are_lossless(*agree_speculators_pair)


def test_compiled_rounds_are_lossless(agree_speculators_pair):
    check_compiled_rounds_are_lossless(*agree_speculators_pair)


def test_drafts_stay_in_the_draft_vocabulary(agree_speculators_pair):
    """Greedy and sampled drafts are draft-vocabulary tokens; sampled drafts' q is zero
    outside it."""
    from dflash_torch.sampling import SamplingParams

    target, drafter_dir = agree_speculators_pair
    engine = DFlashEngine.from_pretrained(target, drafter_dir)
    drafter = engine.drafter
    hidden = torch.randn(2, 16, engine.target.config.hidden_size)
    with torch.no_grad():
        logits = drafter.draft_scores(hidden, torch.tensor([5, 6]), engine.target)
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[SPEC_DRAFT_TOKENS] = True
    greedy, _ = drafter.choose_draft(logits, SamplingParams(), None)
    assert allowed[greedy].all()
    tokens, q = drafter.choose_draft(logits[0], SamplingParams(temperature=2.0), torch.Generator().manual_seed(0))
    assert allowed[tokens].all() and (q[:, ~allowed] == 0).all() and torch.allclose(q.sum(-1), torch.ones(15))


def test_a_guide_that_allows_no_draft_token_still_drafts(agree_speculators_pair):
    """A structured-output guide whose allowed tokens are all outside the draft vocabulary:
    drafting picks among the allowed tokens (uniformly when sampling) instead of failing."""
    from dflash_torch.sampling import SamplingParams

    target, drafter_dir = agree_speculators_pair
    engine = DFlashEngine.from_pretrained(target, drafter_dir)
    outside = [t for t in range(VOCAB) if t % 3 == 1 and t > 1][:3]

    class Only:  # (the GrammarState protocol that choose_draft uses: allowed tokens, advance)
        def next_allowed(self):
            mask = torch.zeros(VOCAB, dtype=torch.bool)
            mask[outside] = True
            return mask

        def advance(self, token):
            return token in outside

    hidden = torch.randn(16, engine.target.config.hidden_size)
    with torch.no_grad():
        logits = engine.drafter.draft_scores(hidden, torch.tensor(5), engine.target)
    greedy, _ = engine.drafter.choose_draft(logits, SamplingParams(), None, guide=Only())
    assert set(greedy.tolist()) <= set(outside)
    tokens, q = engine.drafter.choose_draft(logits, SamplingParams(temperature=0.5), torch.Generator().manual_seed(1),
                                            guide=Only())
    assert set(tokens.tolist()) <= set(outside)
    torch.testing.assert_close(q[:, outside], torch.full((15, 3), 1 / 3))


def test_the_target_embedding_and_lm_head_are_shared_when_equal(agree_pair, tmp_path):
    """Copies of the target's embedding table and LM head in the checkpoint are dropped at
    load (the drafter uses the target's); a different embedding table is kept and used."""
    target, drafter = agree_pair
    copies = to_speculators(drafter, target, tmp_path / "copies", ship_embedding=True, ship_lm_head=True)
    plain = to_speculators(drafter, target, tmp_path / "plain")
    a = DFlashEngine.from_pretrained(target, copies)
    b = DFlashEngine.from_pretrained(target, plain)
    assert a.drafter.embed_tokens is None and a.drafter.lm_head is None
    prompt = [5, 17, 99, 3]
    x, y = (e.generate(prompt, max_new_tokens=40, ignore_eos=True) for e in (a, b))
    assert x.token_ids == y.token_ids and x.stats.acceptance_lengths == y.stats.acceptance_lengths
    own = torch.randn(VOCAB, a.target.config.hidden_size)
    other = DFlashEngine.from_pretrained(target, to_speculators(drafter, target, tmp_path / "own", embed_tokens=own))
    assert other.drafter.embed_tokens is not None
    torch.testing.assert_close(other.drafter.embed(other.target, torch.tensor([3, 4])), own[[3, 4]])
    z = other.generate(prompt, max_new_tokens=40, ignore_eos=True)
    assert z.token_ids == x.token_ids  # (lossless whatever it drafts)


def test_cli_generate_with_a_speculators_drafter(agree_speculators_pair):
    """``dflash-torch generate`` takes a Speculators-format drafter directory as ``--draft``:
    the target-only tokens, several accepted per round."""
    import os
    import subprocess
    import sys

    target, drafter = agree_speculators_pair
    spec = DFlashEngine.from_pretrained(target, drafter)
    ref = DFlashEngine(spec.target, spec.tokenizer).generate("def f(x):", max_new_tokens=24, ignore_eos=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "-m", "dflash_torch.cli", "generate", "--target", str(target), "--draft",
                           str(drafter), "--prompt", "def f(x):", "--max-new-tokens", "24", "--ignore-eos", "--json"],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["token_ids"] == ref.token_ids
    assert out["stats"]["mean_acceptance_length"] > 1.5


def _set(key, value):
    return lambda c: c.__setitem__(key, value)


def _layer(key, value):
    return lambda c: c["transformer_layer_config"].__setitem__(key, value)


def _drop(key):
    return lambda c: c.pop(key)


BAD_CONFIGS = [
    (_set("speculators_model_type", "dspark"), r"is a Speculators 'dspark' model; dflash-torch runs Speculators 'dflash'"),
    (_set("speculators_model_type", "eagle3"), r"Speculators 'eagle3' model"),
    (_set("sample_from_anchor", True), r"sample_from_anchor true"),
    # speculators' Domino projector and shifted labels change what the slots predict: refused by that key
    (_set("shift_label", True), r"^Speculators drafter config sets shift_label=True; only shift_label=False is supported$"),
    (_set("projector_type", "domino"), r"^Speculators drafter config sets projector_type='domino'; only "
                                       r"projector_type='dflash' \(or unset\) is supported$"),
    (_drop("transformer_layer_config"), r"lacks transformer_layer_config"),
    (_set("transformer_layer_config", [1]), r"transformer_layer_config must be an object, got \[1\]"),
    (_layer("model_type", "no_such_model"), r"has model_type 'no_such_model', which transformers does not know"),
    (_drop("mask_token_id"), r"lacks mask_token_id"),
    (_drop("aux_hidden_state_layer_ids"), r"aux_hidden_state_layer_ids must be a non-empty list of integers, got None"),
    (_set("aux_hidden_state_layer_ids", [-1, 2]), r"aux_hidden_state_layer_ids \[-1, 2\] include -1"),
    (_set("aux_hidden_state_layer_ids", [2, 5]), r"aux_hidden_state_layer_ids \[2, 5\] include \[5\], beyond the target's 4 layers"),
    (_set("quantization_config", {"quant_method": "compressed-tensors"}), r"quantiz"),
    (_layer("model_type", "Qwen3"), r"^drafter config.json transformer_layer_config has model_type 'Qwen3', which transformers "
                                    r"does not know \(speculators writes qwen3 or llama\)$"),
    (_layer("num_hidden_layers", 3), r"transformer_layer_config \(model_type 'qwen3'\) does not load in transformers: "),
    (_layer("hidden_size", "64"), r"does not load in transformers: "),
    (_layer("use_sliding_window", False), r"has sliding_attention layers but no window \(sliding_window is null, or "
                                          r"use_sliding_window false turns it off\)"),
    (_set("aux_hidden_state_layer_ids", [1, 9]), r"include \[9\], beyond the target's 4 layers"),
    (_set("target_hidden_size", 128), r"incompatible pair: the drafter reads target features of 128 values a layer "
                                      r"\(target_hidden_size\), the target's layers give 64"),
    (_set("target_hidden_size", 0), r"target_hidden_size must be an integer >= 1, got 0"),
    (_layer("rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     r"partial_rotary_factor 0.5"),
    # (vLLM's DFlash drafter reads the layer config's is_neox_style: false rotates interleaved channel pairs)
    (_layer("is_neox_style", False), r"^drafter config.json sets is_neox_style false \(RoPE on interleaved channel "
                                     r"pairs, as vLLM runs it\); dflash-torch's DFlash drafter rotates the two halves"),
    (_set("draft_vocab_size", VOCAB + 1), rf"draft_vocab_size {VOCAB + 1} exceeds the vocabulary of {VOCAB} tokens"),
    (_layer("hidden_act", "gelu"), r"hidden_act 'gelu' is not supported"),
    (_layer("vocab_size", VOCAB * 2), rf"drafter vocab_size {VOCAB * 2} != target vocab_size {VOCAB}"),
    (_layer("layer_types", ["sliding_attention", "chunked_attention"]), r"must be full_attention or sliding_attention"),
]


def _shuffle_pair(w):  # two draft ids onto one token
    w["d2t"][1] = w["d2t"][0] - 1


def _swap_tokens(w):  # the same tokens, two of them in the other order
    t = w["d2t"] + torch.arange(len(w["d2t"]))
    t[[3, 4]] = t[[4, 3]]
    w["d2t"] = t - torch.arange(len(t))


BAD_WEIGHTS = [
    (_swap_tokens, r"d2t does not map draft ids to tokens in increasing order, as speculators writes it"),
    (lambda w: w.pop("d2t"), r"a draft vocabulary of 213 tokens .* but its checkpoint lacks d2t"),
    (lambda w: w.pop("lm_head.weight"), r"lacks lm_head.weight \(its LM head\)"),
    (lambda w: w.__setitem__("d2t", w["d2t"].float()), r"d2t must be an integer tensor of shape \(213,\), got float32"),
    (lambda w: w.__setitem__("d2t", w["d2t"][:-1].clone()), r"d2t must be an integer tensor of shape \(213,\)"),
    (lambda w: w["d2t"].__setitem__(-1, VOCAB), r"d2t maps a draft id to a token outside the vocabulary of 320"),
    (_shuffle_pair, r"d2t maps two draft ids to one token"),
    (lambda w: w["t2d"].__setitem__(0, not bool(w["t2d"][0])), r"t2d does not mark the tokens d2t maps to"),
    (lambda w: w.__setitem__("layers.0.self_attn.extra.weight", torch.zeros(2)), r"weights a DFlash drafter does not use"),
    (lambda w: w.__setitem__("lm_head.weight", w["lm_head.weight"][:-1].clone()), r"lm_head.weight has shape \(212, 64\), config implies \(213, 64\)"),
    (lambda w: w["fc.weight"].__setitem__((0, 0), float("nan")), r"fc.weight holds NaN"),
    (lambda w: w.__setitem__("embed_tokens.weight", torch.zeros(VOCAB, 32)), r"embed_tokens.weight has shape \(320, 32\)"),
]


@pytest.mark.parametrize("part,edit,message", [("config", *c) for c in BAD_CONFIGS] + [("state", *w) for w in BAD_WEIGHTS])
def test_bad_speculators_checkpoints_are_refused(agree_speculators_pair, tmp_path, part, edit, message):
    """An edited config.json (``config``) or weight file (``state``) is refused in one line."""
    target, drafter = agree_speculators_pair
    bad = edited_checkpoint(drafter, tmp_path / "bad", **{part: edit})
    with pytest.raises(DFlashError, match=message):
        DFlashEngine.from_pretrained(target, bad)


def test_a_domino_checkpoint_is_refused_by_its_projector_type(agree_speculators_pair, tmp_path):
    """A Domino speculator (projector_type domino, shift_label true, its correction head's
    weights) is named by its projector_type, before the weights are read; the defaults
    speculators writes for a plain DFlash one (projector_type dflash, shift_label false,
    pure_draft_prefix_len 1, auf false) load."""
    target, drafter = agree_speculators_pair

    def domino_head(w):
        w["domino_head.prefix_gru.weight_ih_l0"] = torch.zeros(48, 64)
        w["domino_head.embed_proj.0.weight"] = torch.zeros(16, 80)

    domino = edited_checkpoint(drafter, tmp_path / "domino", state=domino_head, config=lambda c: c.update(
        projector_type="domino", shift_label=True, pure_draft_prefix_len=1, emb_dim=16, gru_hidden_dim=16))
    with pytest.raises(DFlashError, match=r"^Speculators drafter config sets projector_type='domino'"):
        DFlashEngine.from_pretrained(target, domino)
    plain = edited_checkpoint(drafter, tmp_path / "plain", config=lambda c: c.update(
        projector_type="dflash", shift_label=False, pure_draft_prefix_len=1, auf=False, emb_dim=256, gru_hidden_dim=1024))
    assert DFlashEngine.from_pretrained(target, plain).drafter.config.speculators is not None


def test_training_only_tensors_are_dropped(agree_speculators_pair, tmp_path):
    """verifier_lm_head / verifier_norm (the training loss's copies of the target's) load and
    change nothing."""
    target, drafter = agree_speculators_pair

    def add(w):
        w["verifier_lm_head.weight"] = w["lm_head.weight"].clone()
        w["verifier_norm.weight"] = torch.ones(64)

    with_extra = edited_checkpoint(drafter, tmp_path / "extra", state=add)
    a, b = DFlashEngine.from_pretrained(target, drafter), DFlashEngine.from_pretrained(target, with_extra)
    assert a.generate([5, 17, 99, 3], max_new_tokens=30, ignore_eos=True).stats.acceptance_lengths == \
        b.generate([5, 17, 99, 3], max_new_tokens=30, ignore_eos=True).stats.acceptance_lengths


def test_an_identity_d2t_with_the_full_vocabulary_is_accepted(agree_pair, tmp_path):
    target, drafter = agree_pair
    spec = to_speculators(drafter, target, tmp_path / "spec", ship_lm_head=True)
    ident = edited_checkpoint(spec, tmp_path / "ident", state=lambda w: w.__setitem__("d2t", torch.zeros(VOCAB, dtype=torch.long)))
    engine = DFlashEngine.from_pretrained(target, ident)
    assert engine.drafter.d2t is None  # (dropped: nothing to map)
    out = engine.generate([5, 17, 99, 3], max_new_tokens=30, ignore_eos=True)
    assert out.stats.mean_acceptance_length > 2
    moved = edited_checkpoint(spec, tmp_path / "moved", state=lambda w: w.__setitem__(
        "d2t", torch.cat([torch.tensor([1, -1]), torch.zeros(VOCAB - 2, dtype=torch.long)])))
    with pytest.raises(DFlashError, match="the draft vocabulary is the target's, but d2t reorders it"):
        DFlashEngine.from_pretrained(target, moved)


def test_training_from_a_speculators_drafter_is_refused(agree_speculators_pair, tmp_path):
    from dflash_torch.models.config import TargetConfig
    from dflash_torch.training.trainer import TrainConfig, load_init_drafter

    target, drafter = agree_speculators_pair
    cfg = TrainConfig(target=str(target), data=[], out=str(tmp_path / "out"), init_from=str(drafter))
    tcfg = TargetConfig.from_dict(json.loads((Path(target) / "config.json").read_text()))
    with pytest.raises(DFlashError, match="is a Speculators-format drafter; dflash-torch trains DFlash-format drafters"):
        load_init_drafter(cfg, tcfg)


def test_to_speculators_writes_the_library_layout(tiny_pair, tmp_path):
    """The test helper that writes Speculators checkpoints imitates the library's layout (the
    committed fixtures, which the library wrote): the same config.json keys at the top and in
    transformer_layer_config (less those the library adds for its own bookkeeping), and
    with a draft vocabulary the same tensor kinds (int64 d2t, bool t2d, an LM head)."""
    target, drafter = tiny_pair
    ours_dir = to_speculators(drafter, target, tmp_path / "spec", draft_tokens=SPEC_DRAFT_TOKENS, sliding_window=4)
    ours = json.loads((ours_dir / "config.json").read_text())
    lib = json.loads((DATA / "draft-vocab-causal" / "config.json").read_text())
    assert set(ours) == set(lib) - {"transformers_version"}
    bookkeeping = {"attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
                   "max_window_layers", "transformers_version", "use_cache"}
    assert set(ours["transformer_layer_config"]) == set(lib["transformer_layer_config"]) - bookkeeping
    w_ours, w_lib = load_file(str(ours_dir / "model.safetensors")), load_file(str(DATA / "draft-vocab-causal" / "model.safetensors"))
    assert set(w_ours) == set(w_lib) - {"embed_tokens.weight"}  # (speculators >= 0.9 saves none; the fixture adds one)
    assert (w_ours["d2t"].dtype, w_ours["t2d"].dtype) == (w_lib["d2t"].dtype, w_lib["t2d"].dtype) == (torch.int64, torch.bool)


def test_bad_config_messages_are_one_short_line(agree_speculators_pair, tmp_path):
    """transformers' own errors about a layer config come back as one line of at most a few
    hundred characters (its list of every known model type is not repeated)."""
    target, drafter = agree_speculators_pair
    for i, edit in enumerate([_layer("model_type", "Qwen3"), _layer("num_hidden_layers", 3), _layer("rms_norm_eps", "x")]):
        bad = edited_checkpoint(drafter, tmp_path / f"bad{i}", config=edit)
        with pytest.raises(DFlashError) as err:
            DFlashEngine.from_pretrained(target, bad)
        assert "\n" not in str(err.value) and len(str(err.value)) < 500, str(err.value)


def test_aux_ids_are_read_in_layer_order(agree_pair, tmp_path):
    """vLLM captures the aux hidden states walking the layers: a config listing them out of
    order reads the features in layer order, and drafts as the sorted one."""
    target, drafter = agree_pair
    a = to_speculators(drafter, target, tmp_path / "sorted", aux_ids=[1, 3])
    b = to_speculators(drafter, target, tmp_path / "backwards", aux_ids=[3, 1])
    x, y = DFlashEngine.from_pretrained(target, a), DFlashEngine.from_pretrained(target, b)
    assert x.drafter.config.target_layer_ids == y.drafter.config.target_layer_ids == [0, 2]
    prompt = [5, 17, 99, 3]
    assert x.generate(prompt, max_new_tokens=30, ignore_eos=True).stats.acceptance_lengths == \
        y.generate(prompt, max_new_tokens=30, ignore_eos=True).stats.acceptance_lengths


def test_per_layer_type_rope_takes_the_sliding_entry():
    """Nested ``rope_parameters`` (one per layer type, as some verifiers have) give the
    ``sliding_attention`` entry, as the library flattens them for its drafter."""
    from dflash_torch.models.drafter_config import DrafterConfig

    cfg = json.loads((DATA / "draft-vocab-causal" / "config.json").read_text())
    cfg["transformer_layer_config"]["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
    assert DrafterConfig.from_dict(cfg).rope_theta == 500000.0


def test_target_hidden_size_sets_the_width_fc_reads():
    """``target_hidden_size`` (a target whose layers give wider feature rows than the drafter's
    hidden size, e.g. DeepSeek-V4's four residual streams) is the width of each target layer's
    features that ``fc`` reads; equal to the hidden size or absent, it changes nothing."""
    from dflash_torch.models.drafter_config import DrafterConfig

    cfg = json.loads((DATA / "draft-vocab-causal" / "config.json").read_text())
    hidden = cfg["transformer_layer_config"]["hidden_size"]
    layers = len(cfg["aux_hidden_state_layer_ids"])
    plain = DrafterConfig.from_dict(cfg)
    assert plain.feature_size == hidden and plain.target_hidden_size is None
    cfg["target_hidden_size"] = hidden
    assert DrafterConfig.from_dict(cfg).feature_size == hidden
    cfg["target_hidden_size"] = 4 * hidden
    wide = DrafterConfig.from_dict(cfg)
    assert wide.feature_size == 4 * hidden
    fc = SpeculatorsDrafter(wide).fc
    assert (fc.in_features, fc.out_features) == (layers * 4 * hidden, hidden)


def test_a_drafter_for_another_model_family_is_warned_about(agree_speculators_pair, tmp_path, caplog):
    """speculators_config.verifier.architectures names what the drafter was trained for: a
    target of another family loads (the output is the target's) with a warning; the same
    family (text or multimodal) loads silently."""
    import logging

    target, drafter = agree_speculators_pair

    def verifier(archs):
        return lambda c: c["speculators_config"]["verifier"].update(architectures=archs)

    llama = edited_checkpoint(drafter, tmp_path / "llama", config=verifier(["LlamaForCausalLM"]))
    wrapper = edited_checkpoint(drafter, tmp_path / "wrapper", config=verifier(["Qwen3ForConditionalGeneration"]))
    with caplog.at_level(logging.WARNING, logger="dflash_torch"):
        DFlashEngine.from_pretrained(target, drafter)
        DFlashEngine.from_pretrained(target, wrapper)
        assert "trained for" not in caplog.text
        DFlashEngine.from_pretrained(target, llama)
    assert ("the drafter was trained for a Llama target (speculators_config.verifier), this target is Qwen3: the "
            "output is the target's, but few drafts may be accepted") in caplog.text


@pytest.mark.parametrize("trained,target,warns", [
    (["MuseGlimmerForConditionalGeneration"], ["MuseGlimmerTextModel"], False),
    (["Qwen3ForCausalLM"], ["Qwen3Model"], False),
    (["Gemma4ForConditionalGeneration"], ["Gemma4ForCausalLM"], False),
    (["Qwen3ForCausalLM"], "Qwen3ForCausalLM", False),  # (a single name as a string)
    ("LlamaForCausalLM", ["Qwen3ForCausalLM"], True),
    ([""], ["Qwen3ForCausalLM"], False),  # (nothing known: no warning)
    ([None, 3, ["x"]], ["Qwen3ForCausalLM"], False),
    (["Qwen3MoeForCausalLM"], ["Qwen3ForCausalLM"], True),
])
def test_model_families_are_compared_by_name(trained, target, warns):
    from dflash_torch.models.drafter_config import DrafterConfig
    from dflash_torch.models.speculators import verifier_mismatch

    cfg = json.loads((DATA / "draft-vocab-causal" / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["architectures"] = trained
    assert (verifier_mismatch(DrafterConfig.from_dict(cfg), target) is not None) == warns


def test_aux_ids_zero_and_the_layer_count_read_what_vllm_captures(agree_pair, tmp_path):
    """Aux id 0 is the embedding output (transformers' hidden_states[0]) and aux id L (the
    target's layer count) the last layer's output before the final norm, as vLLM captures
    them (speculators' --include-last-layer); the ids between are the layers' outputs."""
    from dflash_torch.models.target import EMBEDDING_OUTPUT

    target, drafter = agree_pair
    spec = to_speculators(drafter, target, tmp_path / "spec", aux_ids=[0, 4])
    engine = DFlashEngine.from_pretrained(target, spec)
    assert engine.drafter.feature_layers(engine.target) == [EMBEDDING_OUTPUT, 4]
    hf = load_hf(target)
    last = {}
    hf.model.layers[-1].register_forward_hook(lambda m, i, o: last.__setitem__("out", o[0] if isinstance(o, tuple) else o))
    ids = torch.tensor([5, 17, 99, 3, 42, 42])
    with torch.no_grad():
        ref = hf(ids[None], output_hidden_states=True)
        cache = engine.target.new_cache()
        cache.reset(16)
        _, feats = engine.target(ids, torch.arange(6), cache, 6, feature_layers=[EMBEDDING_OUTPUT, 4, 1, 3])
    H = engine.target.config.hidden_size
    torch.testing.assert_close(feats[:, :H], ref.hidden_states[0][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(feats[:, H:2 * H], last["out"].reshape(6, H), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(feats[:, 2 * H:3 * H], ref.hidden_states[2][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(feats[:, 3 * H:], ref.hidden_states[4][0], atol=1e-5, rtol=1e-5)  # (normed)
    assert (feats[:, H:2 * H] - feats[:, 3 * H:]).abs().max() > 0.1  # (the two ends of the last layer differ)
    base = DFlashEngine(engine.target, engine.tokenizer)
    for prompt in ([5, 17, 99, 3], list(range(2, 45))):
        assert engine.generate(prompt, max_new_tokens=30, ignore_eos=True).token_ids == \
            base.generate(prompt, max_new_tokens=30, ignore_eos=True).token_ids


def test_transformers_notices_on_the_layer_config_do_not_reach_the_terminal():
    """In a fresh process (transformers' log handler on the real stderr, Python's warnings
    shown): a ``transformer_layer_config`` with a model card's YaRN (factor 4, a
    ``max_position_embeddings`` 1.25 times the original) prints nothing, one with a key the rule
    does not read only dflash-torch's WARNING (transformers' config class, which fills the
    layer config's defaults, printed "The explicitly set RoPE scaling factor ... does not
    match ..." and "Unrecognized keys in `rope_parameters` ...")."""
    import os
    import subprocess
    import sys

    import transformers

    import dflash_torch

    cfg = json.loads((DATA / "draft-vocab-causal" / "config.json").read_text())
    layer = cfg["transformer_layer_config"]
    layer.pop("rope_parameters", None)
    layer.pop("rope_theta", None)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    card = {**cfg, "transformer_layer_config": {**layer, "max_position_embeddings": 40960, "rope_scaling": yarn}}
    extra = {**cfg, "transformer_layer_config": {**layer, "max_position_embeddings": 40960,
                                                  "rope_scaling": {**yarn, "finetuned": True}}}
    script = ("import json, sys, transformers\n"
              "from dflash_torch.models.drafter_config import DrafterConfig\n"
              "cfg = DrafterConfig.from_dict(json.loads(sys.argv[1]))\n"
              "print(json.dumps([cfg.rope_scaling, transformers.logging.get_verbosity()]))\n")
    env = {**os.environ, "PYTHONWARNINGS": "always", "PYTHONPATH": str(Path(dflash_torch.__file__).parents[1])}
    for given, said in ((card, ""), (extra, "dflash-torch: WARNING: drafter config.json rope_parameters: ignoring "
                                           "finetuned, which rope scaling type 'yarn' does not read\n")):
        out = subprocess.run([sys.executable, "-c", script, json.dumps(given)], capture_output=True, text=True, env=env,
                             timeout=120, check=True)
        assert out.stderr == said and json.loads(out.stdout) == [yarn, transformers.logging.get_verbosity()]
