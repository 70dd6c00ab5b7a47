"""Muse Glimmer targets (``muse_glimmer``, ``muse_glimmer_text``) against transformers' own
``MuseGlimmerForConditionalGeneration``, and transformers' DFlash drafter format
(``MuseGlimmerAssistantModel``) against transformers' own assistant model.

* our forward == transformers' (logits and every layer's output, float32) over prompts
  longer than the sliding window, in one pass, in pieces and with fixed shapes; each
  Muse Glimmer part (embedding norm, NoPE layers, output gate, window, soft cap) changes
  the logits (so the comparison can fail);
* greedy speculative decoding == transformers' greedy ``generate``: block sizes, inject
  and recompute, fixed shapes, batched, compiled; an agreeable pair that accepts many
  tokens per round across the window; a DFlash 2 drafter;
* drafts read the plain embedding (no ``embed_norm``, as transformers' DFlash does) and
  the LM head on the target's scale;
* an assistant-format drafter saved by transformers gives transformers' hidden states,
  decodes losslessly, and is refused when its weights do not fit the format;
* configs and checkpoints we cannot run are refused in one line.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import (check_compiled_rounds_are_lossless, check_forward_matches_transformers,
                      check_greedy_equals_transformers, check_many_accepted_tokens_are_lossless, copy_tokenizer,
                      drafter_config, edited_checkpoint, forward_in_pieces, hf_greedy, load_hf, make_agreeable_pair,
                      make_dflash2_from, make_muse_glimmer_target, save_drafter)
from dflash_torch import DFlashEngine, DFlashError
from dflash_torch.models.drafter import DFlashDrafter, RecomputedContext
from dflash_torch.models.target import TargetModel

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_dir):
    """(target_dir, random drafter_dir) of a tiny multimodal Muse Glimmer target."""
    root = tmp_path_factory.mktemp("muse")
    target = make_muse_glimmer_target(root / "target", seed=5, tokenizer=False)
    copy_tokenizer(tokenizer_dir, target)
    return target, save_drafter(root / "drafter", drafter_config(target, block_size=16), seed=5)



@pytest.mark.parametrize("pieces,static", [([30], False), ([11, 1, 7, 11], False), ([16, 14], True)])
def test_forward_matches_transformers(checkpoint, pieces, static):
    target_dir, _ = checkpoint
    hf = load_hf(target_dir)
    ours = TargetModel.from_pretrained(target_dir, torch.float32)
    assert ours.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                                       "sliding_attention", "full_attention"]
    assert ours.config.nope_layers == [False, True, False, False, False, True] and ours.config.sliding_window == 8
    ids = torch.randint(0, ours.config.vocab_size, (30,), generator=torch.Generator().manual_seed(1))
    ref = check_forward_matches_transformers(ours, hf, ids, pieces, static)
    assert ref.logits.abs().max() > 2.5  # the soft cap (5) bends these


@pytest.mark.parametrize("change", ["embed_norm", "nope", "gate", "window", "softcap", "post_norms"])
def test_each_part_matters(checkpoint, change):
    """Guards the test above: without any one Muse Glimmer part the logits differ from
    transformers' (so the comparison can fail)."""
    target_dir, _ = checkpoint
    hf = load_hf(target_dir)
    ids = torch.arange(2, 32)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    ours = TargetModel.from_pretrained(target_dir, torch.float32)
    if change == "embed_norm":
        ours.embed_inputs = ours.embed
    elif change == "softcap":
        ours.output_logits = lambda h: ours.lm_head(h) * ours.config.output_multiplier
    for layer in ours.model.layers:
        attn = layer.self_attn
        if change == "nope":
            attn.rope = True
        elif change == "gate":  # sigmoid(0) = 0.5 everywhere
            attn.gate_proj.weight.data.zero_()
        elif change == "window":
            layer.sliding_window = None
        elif change == "post_norms":
            layer.post_feedforward_layernorm = torch.nn.Identity()
    logits, _ = forward_in_pieces(ours, ids, [30], False)
    assert (logits - ref).abs().max() > 1e-2, change


def test_greedy_speculative_equals_transformers_generate(checkpoint):
    check_greedy_equals_transformers(*checkpoint)


@pytest.fixture(scope="module")
def agree_muse(tmp_path_factory, tokenizer_dir):
    return make_agreeable_pair(tmp_path_factory.mktemp("agree-muse"), tokenizer_dir, model_type="muse_glimmer",
                               alpha=1.0, beta=5.0, self_scale=0.45)


def test_many_accepted_tokens_across_the_window_are_lossless(agree_muse):
    check_many_accepted_tokens_are_lossless(*agree_muse)


def test_compiled_rounds_are_lossless_and_do_not_recompile(agree_muse):
    check_compiled_rounds_are_lossless(*agree_muse)


def test_drafts_read_the_plain_embedding_and_the_target_scale(checkpoint, tmp_path):
    """The drafter embeds its block without ``embed_norm`` (transformers' DFlash bypasses
    it); DFlash drafts and a DFlash 2 drafter that leaves the scale at its defaults take the
    target's logit scale; a DFlash 2 drafter with its own scale applies it to the plain head."""
    target_dir, drafter_dir = checkpoint
    target = TargetModel.from_pretrained(target_dir, torch.float32)
    ids = torch.tensor([3, 7, 11])
    torch.testing.assert_close(target.embed(ids), target.model.embed_tokens.weight[ids])
    assert (target.embed_inputs(ids) - target.embed(ids)).abs().max() > 1e-2
    h = torch.randn(4, target.config.hidden_size)
    cfg = target.config
    scaled = torch.tanh(target.lm_head(h) * cfg.output_multiplier / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    torch.testing.assert_close(target.logits(h), target.lm_head(h))
    torch.testing.assert_close(target.output_logits(h), scaled)
    drafter = DFlashDrafter.from_pretrained(drafter_dir, torch.float32)
    torch.testing.assert_close(drafter.draft_logits(target, h), scaled)
    plain2 = DFlashDrafter.from_pretrained(make_dflash2_from(drafter_dir, tmp_path / "v2"), torch.float32)
    torch.testing.assert_close(plain2.draft_logits(target, h), scaled)
    own2 = DFlashDrafter.from_pretrained(make_dflash2_from(drafter_dir, tmp_path / "v2-own"), torch.float32)
    own2.config.dflash2.output_multiplier, own2.config.dflash2.final_logit_softcapping = 2.0, 3.0
    torch.testing.assert_close(own2.draft_logits(target, h), torch.tanh(target.lm_head(h) * 2.0 / 3.0) * 3.0)


def test_dflash2_drafter_decodes_losslessly(agree_muse, tmp_path):
    target_dir, drafter_dir = agree_muse
    v2 = make_dflash2_from(drafter_dir, tmp_path / "v2", conv_std=0.2, selector_std=0.3)
    cfg = json.loads((v2 / "config.json").read_text())  # the scale of the published Muse Glimmer DFlash 2 drafters
    cfg["dflash_config"].update(output_multiplier=0.5, final_logit_softcapping=5.0)
    (v2 / "config.json").write_text(json.dumps(cfg))
    spec = DFlashEngine.from_pretrained(target_dir, v2)
    target_only = DFlashEngine(spec.target, spec.tokenizer)
    for prompt in ([5, 17, 99, 3], list(range(2, 30))):
        ref = target_only.generate(prompt, max_new_tokens=40, ignore_eos=True).token_ids
        out = spec.generate(prompt, max_new_tokens=40, ignore_eos=True)
        assert out.token_ids == ref
    sampled = spec.generate([5, 17, 99, 3], max_new_tokens=16, ignore_eos=True, temperature=0.8, seed=3)
    assert len(sampled.token_ids) == 16


def test_text_configs_load_like_the_wrapper(checkpoint, tmp_path, tokenizer_dir):
    """A ``muse_glimmer_text`` config reads the decoder in either layout: the wrapper's
    (``model.language_model.``) or ``model.``; over a checkpoint with the vision tower it is
    refused."""
    target_dir, _ = checkpoint
    wrapper = TargetModel.from_pretrained(target_dir, torch.float32)
    text_dir = make_muse_glimmer_target(tmp_path / "text", seed=5, tokenizer=False, vision=False)
    text = TargetModel.from_pretrained(text_dir, torch.float32)
    assert text.config.checkpoint_prefix == "model.language_model."
    flat = edited_checkpoint(text_dir, tmp_path / "flat", state=lambda w: w.update(
        {"model." + k[len("model.language_model."):]: w.pop(k) for k in list(w) if k.startswith("model.language_model.")}))
    flat_model = TargetModel.from_pretrained(flat, torch.float32)
    ids = torch.arange(2, 22)
    ref, _ = forward_in_pieces(wrapper, ids, [20], False)
    for model in (text, flat_model):
        torch.testing.assert_close(forward_in_pieces(model, ids, [20], False)[0], ref, rtol=0, atol=0)
    with_vision = edited_checkpoint(target_dir, tmp_path / "text-vision", config=lambda c: (c.clear(), c.update(
        json.loads((text_dir / "config.json").read_text()))))
    with pytest.raises(DFlashError, match=r"^the target checkpoint has a vision tower \(model.vision_tower.\*\), which a "
                                          "muse_glimmer_text config does not describe"):
        TargetModel.from_pretrained(with_vision, torch.float32)


def test_the_wrapper_flag_ties_the_head_as_in_transformers(checkpoint, tmp_path):
    """The wrapper's own ``tie_word_embeddings`` (default false) ties its lm_head, as
    transformers' ``MuseGlimmerForConditionalGeneration`` reads it; ``text_config``'s does not."""
    target_dir, _ = checkpoint
    ids = torch.arange(2, 22)
    # text_config ties, the wrapper says nothing: transformers saves and runs an lm_head of its own
    own_head = make_muse_glimmer_target(tmp_path / "text-tie", seed=6, tokenizer=False, tie_word_embeddings=True)
    assert "tie_word_embeddings" not in json.loads((own_head / "config.json").read_text())
    # the wrapper ties, text_config does not, no lm_head.weight: transformers ties
    tied = edited_checkpoint(target_dir, tmp_path / "wrapper-tie", config=lambda c: c.update(tie_word_embeddings=True),
                             state=lambda w: w.pop("lm_head.weight"))
    for path in (own_head, tied):
        ours = TargetModel.from_pretrained(path, torch.float32)
        check_forward_matches_transformers(ours, load_hf(path), ids, [20], False)
    assert not TargetModel.from_pretrained(own_head, torch.float32).config.tie_word_embeddings
    # the wrapper does not tie, text_config does, no lm_head.weight: transformers would run a random head
    untied = edited_checkpoint(target_dir, tmp_path / "text-tie-no-head", config=lambda c: (
        c.update(tie_word_embeddings=False), c["text_config"].update(tie_word_embeddings=True)),
        state=lambda w: w.pop("lm_head.weight"))
    with pytest.raises(DFlashError, match="lacks weights: lm_head.weight$"):
        TargetModel.from_pretrained(untied, torch.float32)


def test_config_defaults_are_transformers(tmp_path):
    """A text config without ``head_dim``, ``num_key_value_heads`` or ``rms_norm_eps`` reads
    transformers' ``MuseGlimmerTextConfig`` defaults (128, 2, 1e-5: not hidden_size / heads,
    the heads, 1e-6), and the model equals transformers' own."""
    built = make_muse_glimmer_target(tmp_path / "full", seed=7, tokenizer=False, head_dim=128, num_key_value_heads=2,
                                     rms_norm_eps=1e-5)
    bare = edited_checkpoint(built, tmp_path / "bare", config=lambda c: [
        c["text_config"].pop(k) for k in ("head_dim", "num_key_value_heads", "rms_norm_eps")])
    hf = load_hf(bare)
    ours = TargetModel.from_pretrained(bare, torch.float32)
    theirs = hf.config.text_config
    assert (ours.config.head_dim, ours.config.num_key_value_heads, ours.config.rms_norm_eps) == (
        theirs.head_dim, theirs.num_key_value_heads, theirs.rms_norm_eps) == (128, 2, 1e-5)
    check_forward_matches_transformers(ours, hf, torch.arange(2, 22), [20], False)


@pytest.mark.parametrize("config,state,message", [
    (lambda c: c["text_config"].update(layer_rope_theta=[10000.0, 0, 500.0, 10000.0, 10000.0, 0]), None,
     r"^target layer_rope_theta holds \[500.0\], neither 0 \(no RoPE\) nor rope_theta 10000.0"),
    (lambda c: c["text_config"].update(layer_rope_theta=[0] * 5), None, "layer_rope_theta must be a list of 6 numbers"),
    (lambda c: c["text_config"].update(hidden_activation="gelu_pytorch_tanh"), None,
     r"hidden_activation 'gelu_pytorch_tanh' is not supported \(only silu\)"),
    (lambda c: c["text_config"]["rope_parameters"].update(partial_rotary_factor=0.5), None,
     "sets partial_rotary_factor; Muse Glimmer rotates whole heads"),
    (lambda c: c["text_config"].update(layer_types=["linear_attention"] * 6), None,
     r"layer_types \['linear_attention'\] are not supported by muse_glimmer"),
    (lambda c: c["text_config"].update(final_logit_softcapping=0), None, r"final_logit_softcapping must be a number > 0, got 0$"),
    (lambda c: c["text_config"].update(sliding_window=None), None, "has sliding_attention layers but sliding_window is null"),
    (lambda c: c.pop("text_config"), None, "of model_type 'muse_glimmer' lacks text_config"),
    (None, lambda w: w.pop("model.language_model.layers.2.self_attn.gate_proj.weight"),
     "lacks weights: model.language_model.layers.2.self_attn.gate_proj.weight$"),
    (None, lambda w: w.update({"model.language_model.layers.0.self_attn.q_norm.weight": torch.ones(16)}),
     "does not use .*: model.language_model.layers.0.self_attn.q_norm.weight$"),
    (None, lambda w: w.update({"model.multi_modal_projector.weight": torch.ones(4, 4)}),
     r"also has weights outside it \(and outside the vision tower\) that no Muse Glimmer model uses: "
     "model.multi_modal_projector.weight$"),
])
def test_bad_checkpoints_are_refused_in_one_line(checkpoint, tmp_path, config, state, message):
    target_dir, _ = checkpoint
    bad = edited_checkpoint(target_dir, tmp_path / "bad", config=config, state=state)
    with pytest.raises(DFlashError, match=message) as err:
        TargetModel.from_pretrained(bad, torch.float32)
    assert "\n" not in str(err.value)


# --- transformers' DFlash drafter format: MuseGlimmerAssistantModel ---

@pytest.fixture(scope="module")
def assistant(checkpoint, tmp_path_factory):
    """A random ``MuseGlimmerAssistantModel`` saved by transformers for the tiny target
    (2 sliding-window layers of 8, B = 8, target layers 1 and 3)."""
    import transformers

    target_dir, _ = checkpoint
    torch.manual_seed(7)
    cfg = transformers.MuseGlimmerAssistantConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, sliding_window=8, max_position_embeddings=1024, block_size=8, mask_token_id=1,
        target_layer_ids=[1, 3], rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = transformers.MuseGlimmerAssistantModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.08) if p.dim() == 2 else p.normal_(1, 0.2)
    out = tmp_path_factory.mktemp("assistant")
    model.save_pretrained(str(out))
    return out, model


@pytest.mark.parametrize("s", [5, 20])
def test_assistant_drafter_matches_transformers(assistant, s):
    """Our drafter loaded from transformers' assistant checkpoint gives its hidden states
    for a block after ``s`` context positions (20: past the window of 8). Where the window
    binds, transformers' bidirectional window mask lets a query at position p see keys down
    to p - window; the DFlash reference (z-lab/dflash ``model_mlx.py``: keys with
    ``query - key < sliding_window``) and we stop at p - window + 1, so ours at window 8
    equals transformers' at window 7."""
    from transformers import MuseGlimmerAssistantModel
    from transformers.cache_utils import DFlashCache

    path, _ = assistant
    ours = DFlashDrafter.from_pretrained(path, torch.float32)
    assert ours.config.block_size == 8 and ours.config.target_layer_ids == [1, 3]
    assert ours.config.sliding_windows == [8, 8] and ours.config.mask_token_id == 1
    g = torch.Generator().manual_seed(0)
    B = 8
    feats, block = torch.randn(s, 2 * 64, generator=g), torch.randn(B, 64, generator=g)
    with torch.no_grad():
        context = RecomputedContext(ours)
        context.inject(ours, feats, torch.arange(s))
        got = ours(block, torch.arange(s, s + B), context, kv_len=s + B)
    for window, equal in ((7, True), (8, s + B <= 8)):
        hf = MuseGlimmerAssistantModel.from_pretrained(str(path), sliding_window=window).eval()
        cache = DFlashCache(config=hf.config)  # (as transformers' DFlashTokenCandidateGenerator drives it)
        cache.activate_past_recording()
        cache.set_previous_accepted_tokens(s)
        with torch.no_grad():
            ref = hf(noise_embeds=block[None], context_hidden_states=feats[None], position_ids=torch.arange(s + B)[None],
                     attention_mask=torch.ones(1, s + B, dtype=torch.long), cache=cache).last_hidden_state[0]
        if equal:
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        else:
            assert (got - ref).abs().max() > 1e-2


def test_assistant_drafter_decodes_losslessly(checkpoint, assistant):
    target_dir, _ = checkpoint
    path, _ = assistant
    hf = load_hf(target_dir)
    spec = DFlashEngine.from_pretrained(target_dir, path)
    assert spec.block_size == 8
    for prompt in ([5, 17, 99, 3], list(range(2, 30))):
        assert spec.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids == hf_greedy(hf, prompt, NEW_TOKENS)


@pytest.mark.parametrize("edit,message", [
    (lambda w: w.update({"fc.weight": w["encoder.fc.weight"].clone()}), "does not use .*: fc.weight$"),
    (lambda w: w.pop("encoder.output_norm_enc.weight"), "lacks weights: encoder.output_norm_enc.weight$"),
    (lambda w: w.update({"encoder.fc.weight": torch.zeros(64, 64)}),
     r"^drafter weight encoder.fc.weight has shape \(64, 64\), config implies \(64, 128\)$"),
])
def test_bad_assistant_checkpoints_are_refused_by_their_own_names(assistant, tmp_path, edit, message):
    from safetensors.torch import load_file

    path, _ = assistant
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((path / "config.json").read_text())
    weights = load_file(str(path / "model.safetensors"))
    edit(weights)
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(DFlashError, match=message):
        DFlashDrafter.from_pretrained(bad, torch.float32)


@pytest.mark.parametrize("rope", [{}, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                                  {"rope_parameters": {"rope_type": "default"}}], ids=["none", "scaling", "parameters"])
def test_assistant_config_defaults_are_transformers(assistant, tmp_path, rope):
    """A config without the keys transformers defaults (RoPE, layer types, window) reads
    them as ``MuseGlimmerAssistantConfig`` does: RoPE base 500000 (also where a rope dict
    gives no rope_theta: it was 10000), every layer a window of 2048."""
    import shutil

    from transformers import MuseGlimmerAssistantConfig

    path, _ = assistant
    bare = tmp_path / "bare"
    shutil.copytree(path, bare)
    cfg = json.loads((bare / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "sliding_window", "rms_norm_eps"):
        cfg.pop(key)
    cfg.pop("rope_theta", None)
    cfg.update(rope)
    (bare / "config.json").write_text(json.dumps(cfg))
    ours = DFlashDrafter.from_pretrained(bare, torch.float32).config
    ref = MuseGlimmerAssistantConfig.from_pretrained(str(bare))
    assert ours.rope_theta == ref.rope_parameters["rope_theta"] == 500000.0
    assert ours.sliding_windows == [ref.sliding_window] * 2 == [2048] * 2 and ref.layer_types == ["sliding_attention"] * 2
    assert ours.rms_norm_eps == ref.rms_norm_eps
