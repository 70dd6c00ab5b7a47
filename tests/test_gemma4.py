"""Gemma 4 targets (``gemma4``, ``gemma4_text``; dense as gemma-4-31B-it, with the mixture of
experts beside the MLP as gemma-4-26B-A4B-it; ``gemma4_unified`` as gemma-4-12B-it) against
transformers' own ``Gemma4ForConditionalGeneration`` / ``Gemma4ForCausalLM`` /
``Gemma4UnifiedForConditionalGeneration``.

* our forward == transformers' (logits and every layer's output, float32) over prompts
  longer than the sliding window, in one pass, in pieces and with fixed shapes; each
  Gemma 4 part (embedding scale, value norm, values from ``k_proj``, unscaled scores,
  proportional RoPE, layer scalars, window, soft cap, the experts) changes the logits
  (so the comparison can fail);
* both ways a config states the full-attention layers' shape (``per_layer_config``, as
  transformers 5 saves it, or ``global_head_dim`` / ``num_global_key_value_heads``, as the
  published configs do) read as transformers reads them; absent keys take transformers'
  defaults (which differ between ``gemma4_text`` and ``gemma4_unified_text``);
* greedy speculative decoding == transformers' greedy ``generate``: block sizes, inject
  and recompute, fixed shapes, batched (whose caches hold layers of two head sizes),
  compiled; an agreeable pair that accepts many tokens per round across the window;
* drafts embed their block with the scaled embedding and read the soft-capped logits;
* the multimodal layout, a text config over it, and configs we cannot run (refused in one line).
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import (check_compiled_rounds_are_lossless, check_forward_matches_transformers,
                      check_greedy_equals_transformers, check_many_accepted_tokens_are_lossless, copy_tokenizer,
                      drafter_config, edited_checkpoint, forward_in_pieces, load_hf, make_agreeable_pair,
                      make_gemma4_target, save_drafter)
from dflash_torch import DFlashEngine, DFlashError
from dflash_torch.models import layers
from dflash_torch.models.drafter import DFlashDrafter
from dflash_torch.models.rope import Rotary
from dflash_torch.models.target import TargetModel

NEW_TOKENS = 24
KINDS = ["dense", "moe", "unified"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir):
    """kind -> (target_dir, random drafter_dir) of a tiny multimodal Gemma 4 target."""
    out = {}
    for kind in KINDS:
        root = tmp_path_factory.mktemp(f"gemma4-{kind}")
        target = make_gemma4_target(root / "target", seed=3, tokenizer=False, moe=kind == "moe", unified=kind == "unified")
        copy_tokenizer(tokenizer_dir, target)
        out[kind] = target, save_drafter(root / "drafter", drafter_config(target, block_size=16), seed=5)
    return out



@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pieces,static", [([30], False), ([11, 1, 7, 11], False), ([16, 14], True)])
def test_forward_matches_transformers(checkpoints, kind, pieces, static):
    target_dir, _ = checkpoints[kind]
    ours = TargetModel.from_pretrained(target_dir, torch.float32)
    cfg = ours.config
    assert cfg.model_type == ("gemma4_unified_text" if kind == "unified" else "gemma4_text")
    assert cfg.checkpoint_prefix == "model.language_model."
    assert cfg.layer_types == ["sliding_attention"] * 5 + ["full_attention"] and cfg.sliding_window == 8
    assert cfg.layer_head_dims == [16] * 5 + [32] and cfg.layer_kv_heads == [2] * 5 + [1]
    assert ours.kv_shapes() == [(2, 16)] * 5 + [(1, 32)] and ours.model.layers[5].self_attn.v_proj is None
    assert (cfg.moe is not None) == (kind == "moe")
    ids = torch.randint(0, cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(1))
    check_forward_matches_transformers(ours, load_hf(target_dir), ids, pieces, static)


@pytest.mark.parametrize("change", ["embed_scale", "v_norm", "k_eq_v", "scale", "proportional_rope", "layer_scalar",
                                    "window", "softcap", "experts"])
def test_each_part_matters(checkpoints, change):
    """Guards the test above: without any one Gemma 4 part the logits differ from
    transformers' (so the comparison can fail)."""
    target_dir, _ = checkpoints["moe"]
    hf = load_hf(target_dir)
    ids = torch.arange(2, 32)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    ours = TargetModel.from_pretrained(target_dir, torch.float32)
    if change == "embed_scale":
        ours.embed_inputs = lambda i: ours.model.embed_tokens(i)
    elif change == "softcap":
        ours.output_logits = lambda h: ours.lm_head(h)
    elif change == "proportional_rope":  # a quarter of the head rotated in the layout of Qwen3.5's partial rotary
        ours.rotary["full_attention"] = Rotary(32, 1e6, None, partial_rotary_factor=0.25)
    for layer in ours.model.layers:
        attn = layer.self_attn
        if change == "v_norm":
            attn.v_norm = torch.nn.Identity()
        elif change == "k_eq_v" and attn.k_eq_v:  # values from the normed keys instead of the raw projection
            keys_values = attn._keys_values
            attn._keys_values = lambda k, v, cos, sin, kv=keys_values, a=attn: (
                kv(k, v, cos, sin)[0], a.v_norm(a.k_norm(k.reshape(k.shape[0], a.kv_heads, a.head_dim))).transpose(0, 1))
        elif change == "scale":
            attn.attend = lambda q, k, v, bias: layers.attend(q, k, v, bias)
        elif change == "layer_scalar":
            layer.layer_scalar.fill_(1.0)
        elif change == "window":
            layer.sliding_window = None
        elif change == "experts":
            layer.post_feedforward_layernorm_2.weight.data.zero_()
    if change == "window":  # (the masks a forward builds are listed once, when the model is built)
        ours.attention_masks = ((None, 2), (None, 4))
    logits, _ = forward_in_pieces(ours, ids, [30], False)
    assert (logits - ref).abs().max() > 1e-2, change


def test_both_ways_of_stating_the_full_attention_shape_read_alike(checkpoints, tmp_path):
    """transformers 5 saves ``per_layer_config``; the published configs state
    ``global_head_dim`` and ``num_global_key_value_heads`` instead (and without
    ``attention_k_eq_v`` the full layers keep ``num_key_value_heads``)."""
    target_dir, _ = checkpoints["dense"]

    def published(cfg):
        text = cfg["text_config"]
        assert text.pop("per_layer_config") == {"5": {"head_dim": 32, "num_key_value_heads": 1}}
        text.update(global_head_dim=32, num_global_key_value_heads=1)

    edited = edited_checkpoint(target_dir, tmp_path / "published", config=published)
    ours = TargetModel.from_pretrained(edited, torch.float32)
    assert ours.kv_shapes() == [(2, 16)] * 5 + [(1, 32)]
    check_forward_matches_transformers(ours, load_hf(edited), torch.arange(3, 25), [22], False)


@pytest.mark.parametrize("text_type,wrapper", [("gemma4_text", "gemma4"), ("gemma4_unified_text", "gemma4_unified")])
def test_absent_keys_take_transformers_defaults(text_type, wrapper):
    """A config with only the required keys reads as transformers' config class fills it in
    (window, context, layer pattern, full layers' head size, RoPE, tying, no soft cap)."""
    import transformers

    from dflash_torch.models.config import TargetConfig

    required = dict(vocab_size=320, hidden_size=64, num_hidden_layers=7, num_attention_heads=4, intermediate_size=96,
                    hidden_size_per_layer_input=0)
    if text_type == "gemma4_unified_text":
        del required["hidden_size_per_layer_input"]  # (the 12B has no per-layer embeddings)
    theirs = (transformers.Gemma4TextConfig if text_type == "gemma4_text" else transformers.Gemma4UnifiedTextConfig)(**required)
    for cfg in (dict(required, model_type=text_type), {"model_type": wrapper, "text_config": required}):
        ours = TargetConfig.from_dict(cfg)
        assert ours.model_type == text_type
        assert (ours.sliding_window, ours.max_position_embeddings) == (theirs.sliding_window, theirs.max_position_embeddings)
        assert ours.layer_types == theirs.layer_types and ours.tie_word_embeddings is theirs.tie_word_embeddings is True
        assert ours.final_logit_softcapping is theirs.final_logit_softcapping is None
        assert ours.layer_head_dims == [theirs.per_layer_config[i].head_dim for i in range(7)]
        assert ours.layer_kv_heads == [theirs.per_layer_config[i].num_key_value_heads for i in range(7)]
        assert ours.rope == {"sliding_attention": (10000.0, None), "full_attention": (
            1e6, {"rope_type": "proportional", "partial_rotary_factor": 0.25, "factor": 1.0})}
        assert theirs.rope_parameters["full_attention"]["partial_rotary_factor"] == 0.25


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_speculative_equals_transformers_generate(checkpoints, kind):
    check_greedy_equals_transformers(*checkpoints[kind], block_sizes=(2, 16))


@pytest.fixture(scope="module")
def agree_gemma(tmp_path_factory, tokenizer_dir):
    return make_agreeable_pair(tmp_path_factory.mktemp("agree-gemma4"), tokenizer_dir, model_type="gemma4",
                               alpha=1.0, beta=5.0, self_scale=0.0)


def test_many_accepted_tokens_across_the_window_are_lossless(agree_gemma):
    check_many_accepted_tokens_are_lossless(*agree_gemma)


def test_compiled_rounds_are_lossless_and_do_not_recompile(agree_gemma):
    check_compiled_rounds_are_lossless(*agree_gemma)  # (no graph break: helper-1 found .item() breaking every one)


def test_drafts_read_the_scaled_embedding_and_the_soft_capped_logits(checkpoints):
    """The drafter embeds its block as the decoder does (times sqrt(hidden), rounded to the
    model dtype, as transformers' scaled embedding); its drafts read the target's soft-capped
    logits."""
    target_dir, drafter_dir = checkpoints["dense"]
    for dtype in (torch.float32, torch.bfloat16):
        target = TargetModel.from_pretrained(target_dir, dtype)
        ids = torch.tensor([3, 7, 11])
        scale = torch.tensor(target.config.hidden_size ** 0.5).to(dtype)
        assert scale == 8.0
        torch.testing.assert_close(target.embed(ids), target.model.embed_tokens.weight[ids] * scale, rtol=0, atol=0)
        torch.testing.assert_close(target.embed_inputs(ids), target.embed(ids), rtol=0, atol=0)
    target = TargetModel.from_pretrained(target_dir, torch.float32)
    h = torch.randn(4, target.config.hidden_size)
    capped = torch.tanh(target.lm_head(h) / 10.0) * 10.0
    torch.testing.assert_close(target.output_logits(h), capped)
    drafter = DFlashDrafter.from_pretrained(drafter_dir, torch.float32)
    torch.testing.assert_close(drafter.draft_logits(target, h), capped)


def test_text_configs_load_like_the_wrapper(checkpoints, tmp_path):
    """A ``gemma4_text`` config reads the decoder in either layout: the wrapper's
    (``model.language_model.``) or ``model.``; over a checkpoint with the vision tower it
    is refused."""
    target_dir, _ = checkpoints["moe"]
    wrapper = TargetModel.from_pretrained(target_dir, torch.float32)

    def to_text(cfg):
        text = cfg.pop("text_config")
        cfg.clear()
        cfg.update(text, architectures=["Gemma4ForCausalLM"])

    towers = ("model.vision_tower.", "model.embed_vision.")
    text_dir = edited_checkpoint(target_dir, tmp_path / "text", config=to_text,
                                 state=lambda w: [w.pop(k) for k in list(w) if k.startswith(towers)])
    flat = edited_checkpoint(text_dir, tmp_path / "flat", state=lambda w: w.update(
        {"model." + k[len("model.language_model."):]: w.pop(k) for k in list(w) if k.startswith("model.language_model.")}))
    ids = torch.arange(2, 22)
    ref, _ = forward_in_pieces(wrapper, ids, [20], False)
    for d, prefix in ((text_dir, "model.language_model."), (flat, "model.")):
        model = TargetModel.from_pretrained(d, torch.float32)
        assert model.config.checkpoint_prefix == prefix and model.config.moe == wrapper.config.moe
        ours, theirs = model.state_dict(), wrapper.state_dict()
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
        torch.testing.assert_close(forward_in_pieces(model, ids, [20], False)[0], ref, rtol=1e-6, atol=1e-6)
    check_forward_matches_transformers(TargetModel.from_pretrained(flat, torch.float32), load_hf(flat), ids, [20], False)
    with_vision = edited_checkpoint(target_dir, tmp_path / "text-vision", config=to_text)
    with pytest.raises(DFlashError, match=r"^the target checkpoint has a vision or audio tower \(model.vision_tower.\*\), "
                                          "which a gemma4_text config does not describe"):
        TargetModel.from_pretrained(with_vision, torch.float32)


@pytest.mark.parametrize("top,text", [(None, False), (False, True)])
def test_the_wrappers_own_tie_word_embeddings_ties_its_head(checkpoints, tmp_path, top, text):
    """transformers' Gemma4ForConditionalGeneration ties its lm_head by the wrapper's flag
    (default true), whatever the text config says (helper-1: the text config's was read, and
    these checkpoints were refused)."""
    import transformers

    target_dir, _ = checkpoints["dense"]
    cfg = json.loads((target_dir / "config.json").read_text())
    cfg["text_config"]["tie_word_embeddings"] = text
    if top is None:
        cfg.pop("tie_word_embeddings")
    else:
        cfg["tie_word_embeddings"] = top
    hf = transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(**cfg)).eval()
    hf.load_state_dict(load_hf(target_dir).state_dict(), strict=False)
    if top is False:
        with torch.no_grad():
            hf.lm_head.weight.normal_(0, 0.3)
    hf.save_pretrained(str(tmp_path / "t"))
    ours = TargetModel.from_pretrained(tmp_path / "t", torch.float32)
    assert ours.config.tie_word_embeddings is (top is not False)
    check_forward_matches_transformers(ours, load_hf(tmp_path / "t"), torch.arange(3, 25), [22], False)


@pytest.mark.parametrize("text_type,wrapper", [("gemma4_text", "gemma4"), ("gemma4_unified_text", "gemma4_unified")])
def test_rope_scaling_is_read_as_transformers_reads_it(text_type, wrapper):
    """``rope_scaling`` keyed by layer type replaces ``rope_parameters`` (as in transformers);
    a flat rule, on a text config or in a wrapper's ``text_config``, is refused (it was
    dropped: plain RoPE, the logits of the file without it); on the wrapper itself it is
    not read (transformers' wrapper config ignores it too)."""
    import transformers

    from dflash_torch.models.config import TargetConfig

    required = dict(vocab_size=320, hidden_size=64, num_hidden_layers=7, num_attention_heads=4, intermediate_size=96,
                    hidden_size_per_layer_input=0)
    text_cls = transformers.Gemma4TextConfig if text_type == "gemma4_text" else transformers.Gemma4UnifiedTextConfig
    nested = {"sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
              "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 5e5}}
    text = dict(required, rope_scaling=nested, rope_parameters=DEFAULT_GEMMA4_ROPE)
    assert text_cls(**json.loads(json.dumps(text))).rope_parameters == nested
    ours = TargetConfig.from_dict(dict(text, model_type=text_type)).rope
    assert ours == {"sliding_attention": (20000.0, None),
                    "full_attention": (5e5, {"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 1.0})}
    flat = {"rope_type": "linear", "factor": 8.0}
    for cfg in (dict(required, model_type=text_type, rope_scaling=flat),
                {"model_type": wrapper, "text_config": dict(required, rope_scaling=flat)}):
        with pytest.raises(DFlashError, match=r"^target config.json rope_scaling \{'rope_type': 'linear', 'factor': "
                                              r"8.0\} is not supported by Gemma 4"):
            TargetConfig.from_dict(cfg)
    # errors of a keyed rope_scaling name it, not rope_parameters
    only_full = {"full_attention": nested["full_attention"]}
    with pytest.raises(DFlashError, match=r"^target config.json rope_scaling has no object for sliding_attention"):
        TargetConfig.from_dict(dict(required, model_type=text_type, rope_scaling=only_full))
    no_theta = {**nested, "sliding_attention": {"rope_type": "default"}}
    with pytest.raises(DFlashError, match=r"^target config.json rope_scaling.sliding_attention lacks rope_theta"):
        TargetConfig.from_dict(dict(required, model_type=text_type, rope_scaling=no_theta))
    wrapped = TargetConfig.from_dict({"model_type": wrapper, "text_config": required, "rope_scaling": flat})
    assert wrapped.rope == TargetConfig.from_dict({"model_type": wrapper, "text_config": required}).rope
    assert transformers.CONFIG_MAPPING[wrapper](text_config=required, rope_scaling=flat).text_config.rope_parameters == (
        text_cls(**required).rope_parameters)


DEFAULT_GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                       "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                          "rope_theta": 1000000.0}}


def _text(edit):
    """A config edit applied to the wrapper's ``text_config``."""
    return lambda cfg: edit(cfg["text_config"])


@pytest.mark.parametrize("config,state,message", [
    (_text(lambda t: t.pop("hidden_size_per_layer_input")), None,
     r"^target hidden_size_per_layer_input 256: Gemma 4 per-layer input embeddings \(the on-device E2B / E4B models\) "
     r"are not supported$"),
    (_text(lambda t: t.update(num_kv_shared_layers=2)), None, r"^target num_kv_shared_layers > 0: .* not supported$"),
    (_text(lambda t: t.update(use_bidirectional_attention="all")), None,
     r"^target use_bidirectional_attention 'all' is not supported"),
    (_text(lambda t: t.update(hidden_activation="silu")), None, r"^target config.json hidden_activation 'silu' is not supported"),
    (_text(lambda t: t["rope_parameters"]["full_attention"].update(rope_type="yarn")), None,
     r"^target rope_parameters.full_attention.rope_type 'yarn' is not supported for Gemma 4 \(default, proportional\)$"),
    (_text(lambda t: t["rope_parameters"]["full_attention"].pop("rope_theta")), None,
     r"^target config.json rope_parameters.full_attention lacks rope_theta$"),
    (_text(lambda t: t.update(hidden_size_per_layer_input=None)), None, r"^target hidden_size_per_layer_input 256: "),
    (_text(lambda t: t["rope_parameters"].pop("sliding_attention")), None,
     r"^target config.json rope_parameters has no object for sliding_attention layers"),
    (_text(lambda t: t["rope_parameters"]["full_attention"].update(partial_rotary_factor=1.5)), None,
     r"^target config.json rope_parameters.full_attention.partial_rotary_factor must be in \(0, 1\], got 1.5$"),
    (_text(lambda t: t["per_layer_config"]["5"].update(sliding_window=4)), None,
     r"^target config.json per_layer_config.5 overrides \['sliding_window'\]; a Gemma 4 layer reads only head_dim, "
     r"num_key_value_heads from it$"),
    (_text(lambda t: t["per_layer_config"].update({"9": {"head_dim": 8}})), None,
     r"^target config.json per_layer_config key '9' is not a layer index in \[0, 6\)$"),
    (_text(lambda t: t["per_layer_config"].update({"4": {"head_dim": 8}})), None,
     r"^target sliding_attention layers have head sizes \[8, 16\]"),
    (_text(lambda t: t.update(layer_types=["sliding_attention"] * 6)), None,
     r"^target layer_types must end with full_attention"),
    # a flat rope_scaling rule was dropped: the file ran with plain RoPE (transformers cannot run it either)
    (_text(lambda t: t.update(rope_scaling={"rope_type": "linear", "factor": 8.0})), None,
     r"^target config.json rope_scaling \{'rope_type': 'linear', 'factor': 8.0\} is not supported by Gemma 4 "
     r"\(RoPE per layer type from rope_parameters\)$"),
    (_text(lambda t: t.update(enable_moe_block=True)), None,
     r"^target config.json sets enable_moe_block but lacks num_experts, top_k_experts, moe_intermediate_size$"),
    (None, lambda w: w.pop("model.language_model.layers.2.layer_scalar"),
     r"lacks weights: model.language_model.layers.2.layer_scalar$"),
    (None, lambda w: w.update({"model.language_model.layers.5.self_attn.v_proj.weight": torch.zeros(32, 64)}),
     r"has weights this gemma4 model does not use .*model.language_model.layers.5.self_attn.v_proj.weight$"),
])
def test_bad_checkpoints_are_refused_in_one_line(checkpoints, tmp_path, config, state, message):
    target_dir, _ = checkpoints["dense"]
    bad = edited_checkpoint(target_dir, tmp_path / "bad", config=config, state=state)
    with pytest.raises(DFlashError, match=message) as err:
        TargetModel.from_pretrained(bad, torch.float32)
    assert "\n" not in str(err.value)


def test_the_published_drafter_layout_decodes_losslessly(checkpoints, tmp_path):
    """A drafter as z-lab publishes them for Gemma 4 (``model_type`` qwen3, every layer but
    the last a sliding window, a ``final_logit_softcapping`` of its own, which drafts on the
    target's scale ignore): greedy output is target-only decoding's."""
    target_dir, drafter_dir = checkpoints["dense"]
    cfg = json.loads((drafter_dir / "config.json").read_text())
    cfg.update(layer_types=["sliding_attention", "full_attention"], sliding_window=4, use_sliding_window=True,
               final_logit_softcapping=10.0)
    sliding = edited_checkpoint(drafter_dir, tmp_path / "sliding", config=lambda c: (c.clear(), c.update(cfg)))
    spec = DFlashEngine.from_pretrained(target_dir, sliding)
    assert spec.drafter.config.sliding_windows == [4, None]
    target_only = DFlashEngine(spec.target, spec.tokenizer)
    for prompt in ([5, 17, 99, 3], list(range(2, 30))):
        assert (spec.generate(prompt, max_new_tokens=30, ignore_eos=True).token_ids
                == target_only.generate(prompt, max_new_tokens=30, ignore_eos=True).token_ids)
