"""A DFlash drafter config.json read as the DFlash reference reads it: keys the file leaves
out take the defaults of transformers' config class of its ``model_type``.

* z-lab/gpt-oss-20b-DFlash's layout (``model_type: "gpt_oss"``, no layer_types,
  sliding_window or rope dict, shrunk): transformers' GptOssConfig's alternating 128-token
  sliding-window layers and YaRN RoPE (our cos/sin == transformers' rotary embedding's, the
  reference's ``Qwen3RotaryEmbedding``); greedy speculative decoding with such a drafter ==
  target-only decoding over a prompt longer than the window;
* a qwen3 drafter with ``use_sliding_window`` + ``max_window_layers`` and no layer_types:
  the layer types transformers derives;
* the values a file gives keep winning;
* the keys vLLM reads besides the reference's (top-level / EAGLE-style / DSpark-style target
  layers and mask token id, ``logit_scale``, ``midlayer.*`` tensor names) are read, and those
  that change the attention or the features in vLLM or MiMo's code and that dflash-torch does
  not run (partial RoPE, interleaved RoPE, a value scale, no aux hidden states) are refused in
  one line;
* the reference's ``input_embedding_scale``, ``output_multiplier`` and ``final_logit_softcapping``
  shape a DFlash drafter as they shape a DFlash 2 one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

import dflash_torch
from dflash_torch import DFlashEngine
from dflash_torch.models.drafter_config import DrafterConfig
from dflash_torch.models.drafter import DFlashDrafter
from dflash_torch.models.rope import Rotary


def gpt_oss_drafter_json(hidden: int = 64, heads: int = 4, kv_heads: int = 2, head_dim: int = 16, layers: int = 2,
                         vocab: int = 512, target_layer_ids=(0, 1)) -> dict:
    """z-lab/gpt-oss-20b-DFlash's config.json (as published, 2026-04), shrunk."""
    return {"architectures": ["DFlashDraftModel"], "attention_bias": True, "attention_dropout": 0.0, "block_size": 8,
            "bos_token_id": 0, "dflash_config": {"mask_token_id": 1, "target_layer_ids": list(target_layer_ids)},
            "dtype": "bfloat16", "eos_token_id": 0, "head_dim": head_dim, "hidden_act": "silu", "hidden_size": hidden,
            "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2 * hidden,
            "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": heads,
            "num_hidden_layers": layers, "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-05, "rope_theta": 150000,
            "vocab_size": vocab}


def hf_config(cfg: dict):
    return AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})


def test_gpt_oss_drafter_gets_transformers_sliding_windows_and_yarn():
    cfg = gpt_oss_drafter_json(layers=4)
    hf = hf_config(cfg)
    d = DrafterConfig.from_dict(cfg)
    assert hf.layer_types == ["sliding_attention", "full_attention"] * 2 and hf.sliding_window == 128
    assert d.sliding_windows == [hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types]
    rope = hf.rope_parameters
    assert rope["rope_type"] == "yarn" and d.rope_theta == rope["rope_theta"] == 150000
    assert d.rope_scaling == {k: v for k, v in rope.items() if k != "rope_theta"}
    assert (d.head_dim, d.rms_norm_eps, d.attention_bias) == (hf.head_dim, hf.rms_norm_eps, hf.attention_bias)
    # the reference's RoPE: transformers' Qwen3RotaryEmbedding of that config object (inv_freq: we compute it in
    # float64 then round, transformers in float32, a few ulp apart; cos/sin where those ulp do not show)
    hf_rotary = Qwen3RotaryEmbedding(hf)
    rotary = Rotary(d.head_dim, d.rope_theta, d.rope_scaling, max_position_embeddings=d.max_position_embeddings)
    torch.testing.assert_close(rotary.inv_freq, hf_rotary.inv_freq, rtol=1e-6, atol=0)
    assert rotary.attention_factor == pytest.approx(hf_rotary.attention_scaling, rel=1e-12) and rotary.attention_factor > 1
    positions = torch.tensor([0, 1, 7, 100, 1000])
    want_cos, want_sin = hf_rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    cos, sin = rotary.cos_sin(positions, torch.float32)
    torch.testing.assert_close(cos, want_cos[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sin, want_sin[0], atol=1e-5, rtol=1e-5)
    plain_cos, _ = Rotary(d.head_dim, d.rope_theta, None).cos_sin(positions, torch.float32)
    assert (plain_cos - want_cos[0]).abs().max() > 0.1  # (what the file read as written gave: far off)


def test_qwen3_use_sliding_window_and_max_window_layers_give_transformers_layer_types():
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 3,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
           "block_size": 8, "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1,
           "rope_theta": 1000000.0, "dflash_config": {"mask_token_id": 1, "target_layer_ids": [0, 1, 2]}}
    hf = hf_config(cfg)
    assert hf.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    d = DrafterConfig.from_dict(cfg)
    assert d.sliding_windows == [None, 32, 32]
    assert (d.rope_theta, d.rope_scaling, d.rms_norm_eps) == (1000000.0, None, hf.rms_norm_eps)
    # without use_sliding_window (the published Qwen3 drafters): every layer full attention, as before
    d = DrafterConfig.from_dict({**cfg, "use_sliding_window": False})
    assert d.sliding_windows == [None] * 3 and (d.rope_theta, d.rope_scaling) == (1000000.0, None)


@pytest.mark.parametrize("explicit, windows, scaling", [
    ({"layer_types": ["full_attention", "full_attention"]}, [None, None], "yarn"),
    ({"sliding_window": 16}, [16, None], "yarn"),
    ({"rope_scaling": {"rope_type": "default"}}, [128, None], None),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 150000}}, [128, None], "linear"),
])
def test_values_the_file_gives_win(explicit, windows, scaling):
    d = DrafterConfig.from_dict({**gpt_oss_drafter_json(), **explicit})
    assert d.sliding_windows == windows
    assert (d.rope_scaling or {}).get("rope_type") == scaling
    assert d.rope_theta == 150000


@pytest.mark.parametrize("name", ["drafter", "drafter-dflash1"])
def test_the_shipped_qwen3_drafters_read_as_before(name):
    """The shipped default drafters (model_type qwen3, every key the reference reads given or
    with the value we took before): the same config as without transformers' defaults."""
    cfg = json.loads((Path(dflash_torch.__file__).parent / "assets" / "default" / name / "config.json").read_text())
    assert cfg["model_type"] == "qwen3"
    assert DrafterConfig.from_dict(cfg) == DrafterConfig.from_dict({k: v for k, v in cfg.items() if k != "model_type"})


def test_unknown_model_type_reads_the_file_as_written():
    cfg = {**gpt_oss_drafter_json(), "model_type": "no_such_family"}
    d = DrafterConfig.from_dict(cfg)
    assert d.sliding_windows == [None, None] and d.rope_scaling is None


def test_gpt_oss_layout_drafter_is_lossless_over_its_window(agree_gpt_oss_pair, tmp_path):
    """The published gpt-oss drafter layout on a tiny gpt-oss target: its layers use
    transformers' 128-token windows and YaRN, and greedy speculative decoding of a prompt
    longer than the window equals target-only decoding."""
    target, _ = agree_gpt_oss_pair
    t = json.loads((target / "config.json").read_text())
    cfg = gpt_oss_drafter_json(t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"],
                               vocab=t["vocab_size"], target_layer_ids=(0, 2))
    d = DrafterConfig.from_dict(cfg)
    assert d.sliding_windows == [128, None] and d.rope_scaling["rope_type"] == "yarn"
    torch.manual_seed(0)
    model = DFlashDrafter(d)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(drafter / "model.safetensors"))
    (drafter / "config.json").write_text(json.dumps(cfg))
    prompt = [(7 * i) % 300 + 10 for i in range(150)]
    ref = DFlashEngine.from_pretrained(target, no_draft=True).generate(prompt, max_new_tokens=32, ignore_eos=True)
    engine = DFlashEngine.from_pretrained(target, drafter)
    assert engine.drafter.kv_windows() == [128, None]
    out = engine.generate(prompt, max_new_tokens=32, ignore_eos=True)
    assert out.token_ids == ref.token_ids
    assert out.stats.mean_acceptance_length > 1  # (drafts were accepted: the drafter's path ran)


# --- a null key, a file transformers refuses, its log lines, the caller's dict --------------------------------

@pytest.mark.parametrize("key", ["use_cache", "tie_word_embeddings", "attention_dropout", "head_dim"])
def test_a_null_key_reads_as_absent(key):
    """transformers 5 refuses a null where its class wants a value; a null reads as absent (as
    everywhere in the parser), so the other keys still take transformers' defaults."""
    d = DrafterConfig.from_dict({**gpt_oss_drafter_json(), key: None})
    assert d.sliding_windows == [128, None] and d.rope_scaling["rope_type"] == "yarn"
    assert d == DrafterConfig.from_dict({k: v for k, v in gpt_oss_drafter_json().items() if k != key})


def test_a_file_transformers_refuses_says_so_in_one_warning(caplog):
    cfg = {**gpt_oss_drafter_json(), "use_cache": "yes"}
    with caplog.at_level("WARNING", logger="dflash_torch"):
        d = DrafterConfig.from_dict(cfg)
    assert d.sliding_windows == [None, None] and d.rope_scaling is None  # (the file as written)
    [record] = [r for r in caplog.records if r.name == "dflash_torch"]
    message = record.getMessage()
    assert "\n" not in message and "GptOssConfig (model_type 'gpt_oss')" in message
    assert "Field 'use_cache' expected bool, got str (value: 'yes')" in message
    assert "do not take that class's defaults" in message



def test_a_model_type_transformers_does_not_know_says_which_defaults_it_takes(caplog):
    """A drafter config.json of a model_type transformers does not know (or none) has no class
    whose defaults fill the keys it leaves out (the DFlash reference's AutoConfig fails on it):
    one WARNING names them and the defaults taken (trial-251: a "foobar" drafter without
    rms_norm_eps and rope_theta ran without a word); a file that gives them says nothing."""
    full = {**gpt_oss_drafter_json(), "model_type": "foobar", "num_key_value_heads": 2, "head_dim": 32,
            "rms_norm_eps": 1e-5, "attention_bias": False, "hidden_act": "silu", "rope_theta": 5e5}
    for model_type in ("foobar", None):
        cfg = {k: v for k, v in full.items() if k not in ("rms_norm_eps", "rope_theta")}
        cfg["model_type"] = model_type
        caplog.clear()
        with caplog.at_level("WARNING", logger="dflash_torch"):
            d = DrafterConfig.from_dict(cfg)
        assert d.rms_norm_eps == 1e-6 and d.rope_theta == 10000.0
        [record] = [r for r in caplog.records if r.name == "dflash_torch"]
        message = record.getMessage()
        assert "\n" not in message and "(rms_norm_eps, rope_theta) take dflash-torch's defaults" in message, message
        assert ("model_type 'foobar', which transformers does not know" if model_type else "has no model_type") in message
    caplog.clear()
    with caplog.at_level("WARNING", logger="dflash_torch"):
        d = DrafterConfig.from_dict(full)
    assert d.rms_norm_eps == 1e-5 and d.rope_theta == 5e5 and not caplog.records
    # (a RoPE rule without a theta leaves it out too: trial-256; one inside the rule gives it)
    for rope, said in (({"rope_type": "default"}, True), ({"rope_type": "default", "rope_theta": 5e5}, False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="dflash_torch"):
            d = DrafterConfig.from_dict({**{k: v for k, v in full.items() if k != "rope_theta"}, "rope_scaling": rope})
        assert d.rope_theta == (10000.0 if said else 5e5)
        assert ("(rope_theta) take dflash-torch's defaults" in caplog.text) == said, caplog.text


def test_an_engine_load_says_the_warning_once(tiny_pair, tmp_path, caplog):
    """The engine parses the drafter's config.json once (DFlashEngine.from_pretrained checks
    it against the target, then loads the drafter with it): its warning is logged once."""
    from conftest import edited_checkpoint

    target, drafter = tiny_pair
    d = edited_checkpoint(drafter, tmp_path / "drafter", config=lambda c: c.update(use_sliding_window="yes"))
    with caplog.at_level("WARNING", logger="dflash_torch"):
        DFlashEngine.from_pretrained(target, d, dtype="float32")
    said = [r.getMessage() for r in caplog.records if "does not load in transformers" in r.getMessage()]
    assert len(said) == 1 and "Qwen3Config (model_type 'qwen3')" in said[0], said

NOTICES = {  # edits of a qwen3 drafter config on which transformers logs or warns while it reads the file
    "mistral-layer-types": {"model_type": "mistral", "layer_types": ["full_attention"] * 2},
    "yarn-factor": {"rope_scaling": {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 1024},
                    "max_position_embeddings": 8192},  # (factor 3 != 8192 / 1024)
    "pad-token-id": {"pad_token_id": 7777},  # (outside the vocabulary)
}


def test_transformers_notices_do_not_reach_the_terminal():
    """In a fresh process (transformers' log handler on the real stderr, Python's warnings
    shown): reading the configs prints nothing; transformers itself does print on them."""
    import os
    import subprocess
    import sys

    base = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
            "vocab_size": 512, "block_size": 8, "dflash_config": {"mask_token_id": 1, "target_layer_ids": [0, 1]}}
    cfgs = [{**base, **edits} for edits in NOTICES.values()]
    script = ("import json, sys, transformers\n"
              "from dflash_torch.models.drafter_config import DrafterConfig\n"
              "cfgs = json.loads(sys.argv[2])\n"
              "for cfg in cfgs:\n"
              "    if sys.argv[1] == 'ours':\n"
              "        DrafterConfig.from_dict(cfg)\n"
              "    else:\n"
              "        transformers.AutoConfig.for_model(**cfg)\n"
              "print(transformers.logging.get_verbosity())\n")
    env = {**os.environ, "PYTHONWARNINGS": "always", "PYTHONPATH": str(Path(dflash_torch.__file__).parents[1])}

    def run(who):
        return subprocess.run([sys.executable, "-c", script, who, json.dumps(cfgs)], capture_output=True, text=True,
                              env=env, timeout=120, check=True)

    ours, theirs = run("ours"), run("transformers")
    for words in ("Mistral model with layer_types", "RoPE scaling factor", "pad_token_id"):
        assert words in theirs.stderr
    assert ours.stderr == "" and ours.stdout == theirs.stdout  # (and transformers' verbosity as it was)


def test_the_callers_dict_is_not_changed_and_to_dict_shares_nothing():
    import copy

    cfg = {**gpt_oss_drafter_json(), "rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "max_position_embeddings": 4096}
    before = copy.deepcopy(cfg)
    d = DrafterConfig.from_dict(cfg)
    assert cfg == before
    out = d.to_dict()
    out["rope_scaling"]["factor"] = 99.0
    assert d.rope_scaling["factor"] == 4.0


# --- sliding windows ----------------------------------------------------------------------------------------

def test_swa_window_size_wins_over_a_default_sliding_window():
    """dflash_config.swa_window_size with no sliding_window in the file: transformers' default
    window (gpt-oss's 128) yields to it, as vLLM uses it; a sliding_window the file gives and
    that differs is still refused."""
    cfg = gpt_oss_drafter_json()
    cfg["dflash_config"].update(use_swa=True, swa_window_size=512)
    assert DrafterConfig.from_dict(cfg).sliding_windows == [512, None]
    with pytest.raises(dflash_torch.DFlashError, match="two sliding windows: sliding_window 128 and "
                                                      "dflash_config.swa_window_size 512"):
        DrafterConfig.from_dict({**cfg, "sliding_window": 128})


def qwen3_sliding_drafter_json(**edits) -> dict:
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
            "vocab_size": 512, "block_size": 8, "dflash_config": {"mask_token_id": 1, "target_layer_ids": [0, 1]},
            "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8, **edits}


@pytest.mark.parametrize("use_sliding_window", [False, None])
def test_sliding_layers_whose_window_transformers_drops_are_refused(use_sliding_window):
    """model_type qwen3 without use_sliding_window true: transformers' Qwen3Config (the DFlash
    reference) gives sliding_window None, so those layers run no window there."""
    cfg = qwen3_sliding_drafter_json(use_sliding_window=use_sliding_window)
    assert hf_config({k: v for k, v in cfg.items() if v is not None}).sliding_window is None
    with pytest.raises(dflash_torch.DFlashError) as err:
        DrafterConfig.from_dict(cfg)
    assert str(err.value) == (
        "drafter config.json has sliding_attention layers and sliding_window 8, but transformers' Qwen3Config "
        "(model_type 'qwen3') gives no window (use_sliding_window false turns it off): transformers and the DFlash "
        "reference run those layers with no window, and vLLM refuses the file; set use_sliding_window true")
    d = DrafterConfig.from_dict(qwen3_sliding_drafter_json(use_sliding_window=True))
    assert d.sliding_windows == [8, None]


def test_a_written_config_keeps_its_windows_in_transformers():
    """to_dict (what ``dflash-torch train`` writes) says use_sliding_window true where a layer
    slides: transformers (the DFlash reference, vLLM) reads the windows dflash-torch runs."""
    for cfg in (gpt_oss_drafter_json(layers=4), qwen3_sliding_drafter_json(use_sliding_window=True)):
        d = DrafterConfig.from_dict(cfg)
        out = d.to_dict()
        assert out["use_sliding_window"] is True
        hf = hf_config(out)
        assert [hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types] == d.sliding_windows
        assert DrafterConfig.from_dict(out) == d
    out = DrafterConfig.from_dict({**qwen3_sliding_drafter_json(), "layer_types": None, "sliding_window": None}).to_dict()
    assert "use_sliding_window" not in out and "sliding_window" not in out


# --- rope_parameters per layer type ---------------------------------------------------------------------------

def test_rope_parameters_per_layer_type_read_as_the_one_they_give():
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6, "original_max_position_embeddings": 1024}
    cfg = {**qwen3_sliding_drafter_json(use_sliding_window=True),
           "rope_parameters": {"full_attention": dict(yarn), "sliding_attention": dict(yarn)}}
    d = DrafterConfig.from_dict(cfg)
    assert d == DrafterConfig.from_dict({**cfg, "rope_parameters": yarn})
    assert d.rope_theta == 1e6 and d.rope_scaling["rope_type"] == "yarn" and d.rope_scaling["factor"] == 4.0


def test_rope_parameters_per_layer_type_that_differ_are_refused():
    cfg = {**qwen3_sliding_drafter_json(use_sliding_window=True), "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    with pytest.raises(dflash_torch.DFlashError) as err:
        DrafterConfig.from_dict(cfg)
    assert "\n" not in str(err.value) and str(err.value).startswith(
        "drafter config.json rope_parameters gives one RoPE per layer type (full_attention, sliding_attention) and "
        "they differ: ") and str(err.value).endswith("dflash-torch's DFlash drafter runs one RoPE in every layer")


# --- an error a transformers default caused says so -----------------------------------------------------------

def test_an_error_from_a_transformers_default_names_it(tiny_pair, tmp_path):
    """A qwen3 drafter whose config.json leaves out head_dim / num_key_value_heads /
    attention_bias: transformers' Qwen3Config defaults (head_dim 128, 32 key/value heads, no
    bias) do not fit its weights or heads, and the error says where the value came from."""
    from conftest import edited_checkpoint

    _, drafter = tiny_pair
    cfg = json.loads((drafter / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["head_dim"] != 128 and cfg["num_attention_heads"] % 32
    d = edited_checkpoint(drafter, tmp_path / "no-head-dim", config=lambda c: c.pop("head_dim"))
    with pytest.raises(dflash_torch.DFlashError, match=r"self_attn\.\w+_proj\.weight has shape .*, config implies .* "
                       r"\(head_dim 128: transformers' Qwen3Config default, the file gives none\)$"):
        DFlashDrafter.from_pretrained(d, torch.float32)
    cfg.pop("num_key_value_heads")
    with pytest.raises(dflash_torch.DFlashError, match=rf"^drafter num_attention_heads {cfg['num_attention_heads']} is "
                       r"not a multiple of num_key_value_heads 32 \(num_key_value_heads 32: transformers' Qwen3Config "
                       r"default, the file gives none\)$"):
        DrafterConfig.from_dict(cfg)
    d = edited_checkpoint(drafter, tmp_path / "bias", config=lambda c: (c.pop("attention_bias", None), c.update(
        model_type="gpt_oss", rope_theta=150000)))
    with pytest.raises(dflash_torch.DFlashError, match=r"lacks weights: .*_proj\.bias.*\(attention_bias True: "
                       r"transformers' GptOssConfig default, the file gives none\)$"):
        DFlashDrafter.from_pretrained(d, torch.float32)
    # a value the file gives: no note
    d = edited_checkpoint(drafter, tmp_path / "head-dim-8", config=lambda c: c.update(head_dim=8))
    with pytest.raises(dflash_torch.DFlashError, match=r"config implies \(\d+, \d+\)$"):
        DFlashDrafter.from_pretrained(d, torch.float32)


# --- the keys vLLM reads beyond the DFlash reference's ---------------------------------------------------------

def plain_qwen3_drafter_json(**edits) -> dict:
    """A qwen3 DFlash drafter config.json of full-attention layers reading target layers 1 and 5 of 8."""
    cfg = qwen3_sliding_drafter_json(layer_types=None, sliding_window=None, num_target_layers=8)
    cfg["dflash_config"] = {"mask_token_id": 1, "target_layer_ids": [1, 5]}
    return {k: v for k, v in {**cfg, **edits}.items() if v is not None}


@pytest.mark.parametrize("edit", [
    lambda c: c.update(target_layer_ids=[2, 6]),
    lambda c: c.update(eagle_aux_hidden_state_layer_ids=[3, 7]),  # (vLLM's aux ids: the input of layer a)
    lambda c: c.update(eagle_aux_hidden_state_layer_ids=[7, 3]),  # (vLLM captures them in layer order)
    lambda c: c.update(eagle_aux_hidden_state_layer_ids=[3, 7], target_layer_ids=[2, 6], num_target_layers=None),
    lambda c: c.update(target_layer_ids=[2, 6], num_target_layers=None),
    lambda c: c.update(target_layer_ids=[2, 6], dflash_config={"mask_token_id": 1, "target_layer_ids": [2, 6]}),
    lambda c: c.update(dspark_target_layer_ids=[2, 6]),  # (target layer ids: vLLM adds 1 as to target_layer_ids)
    lambda c: c["dflash_config"].update(layer_ids=[3, 7]),  # (aux ids, as vLLM reads them: used as they are)
    lambda c: c.update(eagle_config={"layer_ids": [7, 3]}),
    lambda c: c.update(eagle_config={"layer_ids": [3, 7]}, dspark_target_layer_ids=[2, 6], target_layer_ids=[2, 6],
                       eagle_aux_hidden_state_layer_ids=[3, 7], num_target_layers=None),
])
def test_top_level_and_eagle_target_layer_ids_are_read(edit):
    """vLLM reads a DFlash drafter's target layers from eagle_aux_hidden_state_layer_ids, else
    dflash_config.target_layer_ids, else dspark_target_layer_ids, else the top-level
    target_layer_ids (the DFlash reference from the second and the last), else
    dflash_config.layer_ids / eagle_config.layer_ids (aux ids): without
    dflash_config.target_layer_ids, the reference rule over num_target_layers ([1, 5] for 2
    of 8 layers) must not replace them."""
    cfg = plain_qwen3_drafter_json()
    cfg["dflash_config"].pop("target_layer_ids")
    edit(cfg)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    assert DrafterConfig.from_dict(cfg).target_layer_ids == [2, 6]


def test_aux_layer_ids_past_the_target_are_named_as_written(tiny_pair):
    """Aux ids past the target's layers are refused naming the key and the ids as written (trial-229:
    it said ``target_layer_ids [0, 4] include [4]``, ids the file does not hold, under a key it
    does not have); target layer ids as written are named as before."""
    from dflash_torch.models.config import TargetConfig
    from dflash_torch.models.drafter_config import validate_pair

    target = TargetConfig.from_dict(json.loads((tiny_pair[0] / "config.json").read_text()))
    n = target.num_hidden_layers
    for edit, said in ((dict(eagle_aux_hidden_state_layer_ids=[1, n + 1]), f"target_layer_ids [0, {n}] include [{n}], "
                        f"outside the target's {n} layers (read from its eagle_aux_hidden_state_layer_ids [1, {n + 1}]: "
                        "id a is the output of target layer a - 1)"),
                       (dict(target_layer_ids=[0, n]), f"target_layer_ids [0, {n}] include [{n}], outside the target's "
                        f"{n} layers")):
        cfg = plain_qwen3_drafter_json(num_target_layers=n, **edit)
        cfg["dflash_config"].pop("target_layer_ids")
        with pytest.raises(dflash_torch.DFlashError) as err:
            validate_pair(target, DrafterConfig.from_dict(cfg))
        assert str(err.value) == "incompatible pair: drafter " + said, str(err.value)


@pytest.mark.parametrize("edit,said", [
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[4, 5, 6]),
     "eagle_aux_hidden_state_layer_ids [4, 5, 6] (target layers [3, 4, 5]) and dflash_config.target_layer_ids [1, 5]"),
    (lambda c: c.update(target_layer_ids=[2, 6]), "dflash_config.target_layer_ids [1, 5] and target_layer_ids [2, 6]"),
    (lambda c: (c["dflash_config"].pop("target_layer_ids"), c.update(eagle_aux_hidden_state_layer_ids=[2, 6],
                                                                      target_layer_ids=[2, 6])),
     "eagle_aux_hidden_state_layer_ids [2, 6] (target layers [1, 5]) and target_layer_ids [2, 6]"),
    (lambda c: c.update(dspark_target_layer_ids=[2, 6]), "dflash_config.target_layer_ids [1, 5] and "
     "dspark_target_layer_ids [2, 6]"),
    (lambda c: c["dflash_config"].update(layer_ids=[1, 5]), "dflash_config.target_layer_ids [1, 5] and "
     "dflash_config.layer_ids [1, 5] (target layers [0, 4])"),
    (lambda c: c.update(eagle_config={"layer_ids": [2, 7]}, target_layer_ids=[1, 5]), "dflash_config.target_layer_ids "
     "[1, 5] and eagle_config.layer_ids [2, 7] (target layers [1, 6])"),
])
def test_two_target_layer_lists_that_differ_are_refused(edit, said):
    cfg = plain_qwen3_drafter_json()
    edit(cfg)
    with pytest.raises(dflash_torch.DFlashError) as err:
        DrafterConfig.from_dict(cfg)
    assert str(err.value) == (f"drafter config.json gives two sets of target layers: {said}; which the drafter was "
                              "trained with is unknown: drop one or make them agree")


def test_no_target_layers_anywhere_names_every_key_and_aux_id_zero_is_refused():
    cfg = plain_qwen3_drafter_json(num_target_layers=None)
    cfg["dflash_config"].pop("target_layer_ids")
    with pytest.raises(dflash_torch.DFlashError) as err:
        DrafterConfig.from_dict(cfg)
    assert str(err.value) == ("drafter config.json has neither dflash_config.target_layer_ids (nor target_layer_ids / "
                              "eagle_aux_hidden_state_layer_ids / dspark_target_layer_ids / dflash_config.layer_ids / "
                              "eagle_config.layer_ids) nor num_target_layers")
    for key, edit in (("eagle_aux_hidden_state_layer_ids", {"eagle_aux_hidden_state_layer_ids": [0, 4]}),
                      ("dflash_config.layer_ids", {"dflash_config": {**cfg["dflash_config"], "layer_ids": [0, 4]}}),
                      ("eagle_config.layer_ids", {"eagle_config": {"layer_ids": [0, 4]}})):
        with pytest.raises(dflash_torch.DFlashError, match=rf"^drafter config.json {key} \[0, 4\] must be distinct "
                           r"ids >= 1 \(id a is the output of target layer a - 1; 0, the embedding output"):
            DrafterConfig.from_dict({**cfg, **edit})
    with pytest.raises(dflash_torch.DFlashError, match=r"^drafter config.json target_layer_ids must be a non-empty list "
                       r"of integers, got \['a'\]$"):
        DrafterConfig.from_dict({**cfg, "target_layer_ids": ["a"]})


def test_a_top_level_mask_token_id_is_read_and_two_that_differ_are_refused():
    """vLLM falls back to a top-level mask_token_id (so does the DFlash reference): the engine
    must not look one up in the tokenizer instead (needs_mask_token_id)."""
    from dflash_torch.models.drafter_config import needs_mask_token_id

    cfg = plain_qwen3_drafter_json(mask_token_id=5)
    cfg["dflash_config"].pop("mask_token_id")
    assert not needs_mask_token_id(cfg) and DrafterConfig.from_dict(cfg).mask_token_id == 5
    assert needs_mask_token_id({**cfg, "mask_token_id": None})
    cfg["dflash_config"]["mask_token_id"] = 5  # (the same id twice: one id)
    assert DrafterConfig.from_dict(cfg).mask_token_id == 5
    cfg["dflash_config"]["mask_token_id"] = 1
    with pytest.raises(dflash_torch.DFlashError) as err:
        DrafterConfig.from_dict(cfg)
    assert str(err.value) == ("drafter config.json gives two mask token ids: dflash_config.mask_token_id 1 and "
                              "mask_token_id 5; which the drafter was trained with is unknown: drop one or make them equal")


@pytest.mark.parametrize("edit,words", [
    (dict(model_type="deepseek_v41", dspark_target_layer_ids=[1, 5]), "drafter config.json has model_type deepseek_v41 "
     "and dspark_target_layer_ids [1, 5] (vLLM reads a DeepSeek V4.1 drafter's ids as the inputs of those layers"),
    (dict(use_aux_hidden_state=False), "drafter config.json sets use_aux_hidden_state false (vLLM then feeds the "
     "drafter the target's last hidden state, with no fc)"),
    (dict(eagle_config={"use_aux_hidden_state": False}), "drafter config.json sets eagle_config.use_aux_hidden_state "
     "false"),
    (dict(dflash_config={"mask_token_id": 1, "target_layer_ids": [1, 5], "use_aux_hidden_state": False}),
     "drafter config.json sets dflash_config.use_aux_hidden_state false"),
    (dict(eagle_config=[1]), "drafter config.json eagle_config must be an object, got [1]"),
])
def test_vllm_keys_whose_layers_dflash_torch_does_not_read_are_refused(edit, words):
    """A DeepSeek V4.1 model type's dspark_target_layer_ids (vLLM reads them as layer inputs)
    and use_aux_hidden_state false (vLLM: the target's last hidden state, no fc) would change
    the features the drafter reads: refused in one line; use_aux_hidden_state true is read."""
    with pytest.raises(dflash_torch.DFlashError) as err:
        DrafterConfig.from_dict(plain_qwen3_drafter_json(**edit))
    assert str(err.value).startswith(words) and "\n" not in str(err.value), str(err.value)
    assert DrafterConfig.from_dict(plain_qwen3_drafter_json(use_aux_hidden_state=True, eagle_config={
        "use_aux_hidden_state": True})) == DrafterConfig.from_dict(plain_qwen3_drafter_json())


@pytest.mark.parametrize("key", ["dspark_noise_token_id", "pard_token", "ptd_token_id"])
def test_vllms_other_mask_token_keys_are_read_and_two_that_differ_are_refused(key):
    """vLLM fills a DFlash drafter's mask slots from dflash_config.mask_token_id, mask_token_id,
    then dspark_noise_token_id, pard_token, ptd_token_id: read (not looked up in the tokenizer
    instead); one that differs from another is refused."""
    from dflash_torch.models.drafter_config import needs_mask_token_id

    cfg = plain_qwen3_drafter_json(**{key: 5})
    cfg["dflash_config"].pop("mask_token_id")
    assert not needs_mask_token_id(cfg) and DrafterConfig.from_dict(cfg).mask_token_id == 5
    assert DrafterConfig.from_dict({**cfg, "mask_token_id": 5}).mask_token_id == 5
    with pytest.raises(dflash_torch.DFlashError) as err:
        DrafterConfig.from_dict({**cfg, "mask_token_id": 1})
    assert str(err.value) == (f"drafter config.json gives two mask token ids: mask_token_id 1 and {key} 5; which the "
                              "drafter was trained with is unknown: drop one or make them equal")
    for bad in ("<pad>", True, -1):  # (trial-229: named mask_token_id; true beside a 1 was taken as 1)
        with pytest.raises(dflash_torch.DFlashError) as err:
            DrafterConfig.from_dict({**cfg, key: bad, "mask_token_id": 1})
        assert str(err.value) == f"drafter config.json {key} must be an integer >= 0, got {bad!r}", str(err.value)


def test_an_eagle_config_mask_token_id_is_read_only_where_another_key_gives_it():
    """vLLM merges eagle_config under dflash_config, but fills the mask slots from
    dflash_config.mask_token_id / mask_token_id and reads eagle_config.mask_token_id only to
    place a separate mask embedding (the DFlash reference not at all): an equal one is read,
    one alone or another one is refused, never replaced by a tokenizer look-up."""
    from dflash_torch.models.drafter_config import needs_mask_token_id

    cfg = plain_qwen3_drafter_json(eagle_config={"mask_token_id": 1})
    assert DrafterConfig.from_dict(cfg).mask_token_id == 1
    cfg["eagle_config"]["mask_token_id"] = 5
    with pytest.raises(dflash_torch.DFlashError) as err:
        DrafterConfig.from_dict(cfg)
    assert str(err.value) == ("drafter config.json gives eagle_config.mask_token_id 5 and dflash_config.mask_token_id 1: "
                              "vLLM fills the mask slots from dflash_config.mask_token_id / mask_token_id "
                              "(eagle_config's only places a separate mask embedding) and the DFlash reference does not "
                              "read it; set dflash_config.mask_token_id")
    cfg["dflash_config"].pop("mask_token_id")
    assert not needs_mask_token_id(cfg)
    with pytest.raises(dflash_torch.DFlashError, match=r"^drafter config.json gives eagle_config.mask_token_id 5: vLLM"):
        DrafterConfig.from_dict(cfg)


def test_an_engine_reads_the_top_level_mask_token_id_and_eagle_layer_ids(tiny_pair, tmp_path, caplog):
    """The drafter with its dflash_config settings moved to the keys vLLM also reads drafts as
    itself: the same target layers and mask id, the same tokens and acceptance."""
    from conftest import edited_checkpoint

    target, drafter = tiny_pair
    ids = [0, 2]  # (distinct: vLLM captures a layer once, however often its aux ids name it)
    drafter = edited_checkpoint(drafter, tmp_path / "base", config=lambda c: c["dflash_config"].update(target_layer_ids=ids))
    mask = json.loads((drafter / "config.json").read_text())["dflash_config"]["mask_token_id"]

    def move(c):
        c["dflash_config"] = {}
        c.update(eagle_aux_hidden_state_layer_ids=[i + 1 for i in ids], mask_token_id=mask, num_target_layers=None)
    moved = edited_checkpoint(drafter, tmp_path / "moved", config=move)
    with caplog.at_level("INFO", logger="dflash_torch"):
        a = DFlashEngine.from_pretrained(target, moved, dtype="float32")
    assert "mask_token_id" not in caplog.text  # (no tokenizer look-up was made)
    assert (a.drafter.config.target_layer_ids, a.drafter.config.mask_token_id) == (ids, mask)
    b = DFlashEngine.from_pretrained(target, drafter, dtype="float32")
    prompt = [5, 17, 99, 3, 42]
    x, y = (e.generate(prompt, max_new_tokens=24, ignore_eos=True) for e in (a, b))
    assert x.token_ids == y.token_ids and x.stats.acceptance_lengths == y.stats.acceptance_lengths


@pytest.mark.parametrize("edit,words", [
    (dict(partial_rotary_factor=0.5), "drafter config.json sets partial_rotary_factor 0.5 (RoPE on part of each head, "
     "as vLLM and MiMo's code run it); dflash-torch's DFlash drafter rotates the whole head"),
    (dict(rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}),
     "drafter config.json sets rope_parameters.partial_rotary_factor 0.25 (RoPE on part of each head"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}),
     "drafter config.json sets rope_scaling.partial_rotary_factor 0.5 (RoPE on part of each head"),
    (dict(partial_rotary_factor=1.5), "drafter config.json partial_rotary_factor must be a number in (0, 1], got 1.5"),
    # (the factor of the model_type's transformers class, the file leaving rope_parameters out: vLLM applies it as one
    # the file sets; it was taken unsaid, the whole head rotated, trial-294)
    (dict(model_type="qwen3_5_text", rope_theta=None, rope_scaling=None, rope_parameters=None),
     "drafter config.json leaves out rope_parameters, which its model_type 'qwen3_5_text' (transformers' "
     "Qwen3_5TextConfig) sets to rope_parameters.partial_rotary_factor 0.25 (RoPE on part of each head, as vLLM and "
     "MiMo's code run it); dflash-torch's DFlash drafter rotates the whole head; give the file its own rope_parameters"),
    (dict(is_neox_style=False), "drafter config.json sets is_neox_style false (RoPE on interleaved channel pairs, as "
     "vLLM runs it); dflash-torch's DFlash drafter rotates the two halves of each head (true)"),
    (dict(is_neox_style="false"), "drafter config.json is_neox_style must be true or false, got 'false'"),
    (dict(dflash_config={"mask_token_id": 1, "target_layer_ids": [1, 5], "attention_value_scale": 0.612}),
     "drafter config.json sets dflash_config.attention_value_scale 0.612 (MiMo's factor on the attention values); "
     "dflash-torch's DFlash drafter does not scale them"),
    (dict(logit_scale=0), "drafter config.json logit_scale must be a number > 0, got 0"),
])
def test_keys_that_change_the_attention_in_vllm_or_mimo_are_refused(edit, words):
    """partial_rotary_factor < 1 (MiMo's DFlash drafters: their code and vLLM rotate part of
    each head), is_neox_style false (vLLM: interleaved RoPE) and MiMo's attention_value_scale
    are refused in one line; their default values are not."""
    with pytest.raises(dflash_torch.DFlashError) as err:
        DrafterConfig.from_dict(plain_qwen3_drafter_json(**edit))
    assert str(err.value).startswith(words) and "\n" not in str(err.value), str(err.value)
    plain = DrafterConfig.from_dict(plain_qwen3_drafter_json())
    defaults = dict(partial_rotary_factor=1.0, is_neox_style=True, logit_scale=1.0,
                    dflash_config={"mask_token_id": 1, "target_layer_ids": [1, 5], "attention_value_scale": 1.0})
    assert DrafterConfig.from_dict(plain_qwen3_drafter_json(**defaults)) == plain


def test_logit_scale_multiplies_the_draft_logits(tiny_pair, tmp_path):
    """vLLM's DFlash drafter multiplies its draft logits by config.json logit_scale (its
    LogitsProcessor scale): the drafter's draft logits are the target LM head's, times it."""
    from conftest import edited_checkpoint
    from dflash_torch.models.target import TargetModel

    target_dir, drafter = tiny_pair
    scaled = edited_checkpoint(drafter, tmp_path / "scaled", config=lambda c: c.update(logit_scale=2.5))
    target = TargetModel.from_pretrained(target_dir, torch.float32)
    d = DFlashDrafter.from_pretrained(scaled, torch.float32)
    d.share_with(target)
    assert d.config.logit_scale == 2.5 and DrafterConfig.from_dict(d.config.to_dict()) == d.config
    hidden = torch.randn(3, 5, d.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = d.draft_scores(hidden, torch.zeros(3, dtype=torch.long), target)
    head = target.lm_head.weight if getattr(target, "lm_head", None) is not None else target.model.embed_tokens.weight
    torch.testing.assert_close(got, 2.5 * hidden[:, 1:] @ head.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(dflash_torch.DFlashError, match=r"^DFlash 2 drafter config.json sets logit_scale 2.5; a DFlash 2 "
                       r"drafter scales its draft logits by dflash_config.output_multiplier only$"):
        DrafterConfig.from_dict({**d.config.to_dict(), "architectures": ["DFlash2DraftModel"], "dflash_config": {
            **d.config.to_dict()["dflash_config"], "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8,
            "selector_top_k": 4}})


REFERENCE_FACTORS = dict(input_embedding_scale=1.5, output_multiplier=0.5, final_logit_softcapping=3.0)


def test_the_reference_factors_shape_a_dflash_drafter(tiny_pair, tmp_path):
    """The DFlash reference applies dflash_config (else top-level) input_embedding_scale,
    output_multiplier and final_logit_softcapping to DFlash drafters too, not only DFlash 2
    ones: the block's embeddings times the scale, and draft logits ``tanh(m * lm_head(h) / cap) * cap``
    (the target's LM head as it is, no output scale of its own); their defaults leave the
    drafter as it was, bit for bit, and decoding stays lossless."""
    from conftest import edited_checkpoint
    from dflash_torch.models.drafter import InjectedContext
    from dflash_torch.models.target import TargetModel

    target_dir, drafter = tiny_pair
    shaped = edited_checkpoint(drafter, tmp_path / "shaped", config=lambda c: c["dflash_config"].update(REFERENCE_FACTORS))
    top = edited_checkpoint(drafter, tmp_path / "top", config=lambda c: c.update(REFERENCE_FACTORS))
    default = edited_checkpoint(drafter, tmp_path / "default", config=lambda c: c["dflash_config"].update(
        input_embedding_scale=1.0, output_multiplier=1.0, final_logit_softcapping=None))
    target = TargetModel.from_pretrained(target_dir, torch.float32)
    d, t, base, plain = (DFlashDrafter.from_pretrained(x, torch.float32) for x in (shaped, top, default, drafter))
    for x in (d, base, plain):
        x.share_with(target)
    assert (d.config.input_embedding_scale, d.config.output_multiplier, d.config.final_logit_softcapping) == (1.5, 0.5, 3.0)
    assert t.config == d.config and DrafterConfig.from_dict(d.config.to_dict()) == d.config
    assert base.config == plain.config
    # the draft logits, by hand from the target's LM head
    hidden = torch.randn(3, 5, d.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 20
    anchor = torch.zeros(3, dtype=torch.long)
    with torch.inference_mode():
        got, unshaped, before = (x.draft_scores(hidden, anchor, target) for x in (d, base, plain))
    head = target.lm_head.weight if getattr(target, "lm_head", None) is not None else target.model.embed_tokens.weight
    raw = hidden[:, 1:] @ head.T
    assert got.dtype == torch.float32 and raw.abs().max() > 3.0  # (the cap bends them)
    torch.testing.assert_close(got, torch.tanh(0.5 * raw / 3.0) * 3.0, rtol=1e-5, atol=1e-5)
    assert unshaped.dtype == before.dtype and torch.equal(unshaped, before)
    # the block's embeddings: the shaped drafter on e == the plain drafter on 1.5 * e
    block, positions = torch.tensor([7] + [d.config.mask_token_id] * 7), torch.arange(9, 17)
    features = torch.randn(9, len(d.config.target_layer_ids) * d.config.hidden_size,
                           generator=torch.Generator().manual_seed(1))
    outs = []
    for x, scale in ((d, 1.0), (plain, 1.5), (plain, 1.0)):
        ctx = InjectedContext(x)
        ctx.reset(17)
        ctx.inject(x, features, torch.arange(9))
        with torch.inference_mode():
            outs.append(x(target.embed(block) * scale, positions, ctx, 17))
    torch.testing.assert_close(outs[0], outs[1])
    assert not torch.allclose(outs[0], outs[2])
    # decoding with it stays lossless
    prompt = [5, 17, 99, 3, 42]
    a, b = (DFlashEngine.from_pretrained(target_dir, x, dtype="float32") for x in (shaped, drafter))
    assert a.generate(prompt, max_new_tokens=16, ignore_eos=True).token_ids == b.generate(
        prompt, max_new_tokens=16, ignore_eos=True).token_ids


@pytest.mark.parametrize("edit,words", [
    (dict(logit_scale=2.0, output_multiplier=0.5), "drafter config.json sets logit_scale 2.0 (vLLM's factor on the draft "
     "logits) and output_multiplier / final_logit_softcapping (the DFlash reference's); which the drafter was trained "
     "with is unknown: drop one"),
    (dict(logit_scale=2.0, dflash_config={"mask_token_id": 1, "target_layer_ids": [1, 5], "final_logit_softcapping": 5}),
     "drafter config.json sets logit_scale 2.0 (vLLM's factor"),
    (dict(output_multiplier="2"), "DFlash drafter output_multiplier must be a finite number of magnitude at most 1e+06, "
     "got '2'"),
    (dict(input_embedding_scale=float("inf")), "DFlash drafter input_embedding_scale must be a finite number of"),
    (dict(final_logit_softcapping=0), "DFlash drafter final_logit_softcapping must be > 0 (or null for none), got 0"),
    # (trial-229: 1e308 passed and turned every sampled draft into torch's inf/nan error; 10**400 was an OverflowError)
    (dict(input_embedding_scale=1e300), "DFlash drafter input_embedding_scale must be a finite number of magnitude"),
    (dict(output_multiplier=10**400), "DFlash drafter output_multiplier must be a finite number of magnitude"),
    (dict(logit_scale=1e308), "drafter config.json logit_scale must be a number > 0 and at most 1e+06, got 1e+308"),
    (dict(logit_scale=10**400), "drafter config.json logit_scale must be a number > 0, got 1000"),
])
def test_bad_or_clashing_reference_factors_are_refused(edit, words):
    """A logit_scale (vLLM's factor, which the DFlash reference does not read) together with the
    reference's output_multiplier or soft cap (which vLLM does not read): which one the drafter
    was trained with is unknown; a logit_scale with only input_embedding_scale is read."""
    with pytest.raises(dflash_torch.DFlashError) as err:
        DrafterConfig.from_dict(plain_qwen3_drafter_json(**edit))
    assert str(err.value).startswith(words) and "\n" not in str(err.value), str(err.value)
    d = DrafterConfig.from_dict(plain_qwen3_drafter_json(logit_scale=2.0, input_embedding_scale=1.5))
    assert (d.logit_scale, d.input_embedding_scale) == (2.0, 1.5)


@pytest.mark.parametrize("model_type", ["qwen3", "llama", "gpt_oss"])
def test_a_null_num_key_value_heads_reads_as_transformers_reads_it(model_type, caplog):
    """transformers' Qwen3Config / LlamaConfig read an explicit null num_key_value_heads as
    num_attention_heads (multi-head attention), not as their default when the key is left out
    (Qwen3Config's 32); GptOssConfig refuses the null: the file is then read as written (with
    transformers' one-line warning), its null num_key_value_heads num_attention_heads."""
    cfg = plain_qwen3_drafter_json(model_type=model_type)
    cfg["num_key_value_heads"] = None
    with caplog.at_level("WARNING", logger="dflash_torch"):
        d = DrafterConfig.from_dict(cfg)
    assert d.num_key_value_heads == cfg["num_attention_heads"] == 4
    if model_type != "gpt_oss":
        assert hf_config(cfg).num_key_value_heads == 4 and not caplog.text
    else:
        assert "does not load in transformers' GptOssConfig" in caplog.text
    assert "num_key_value_heads" not in d.transformers_defaults  # (trial-229: a message said the file gives none)


def test_eagle_style_midlayer_weights_are_read_for_one_layer(tiny_pair, tmp_path):
    """EAGLE-style ``midlayer.*`` tensor names (vLLM maps them to ``layers.0.*``): a one-layer
    drafter so named loads as the same drafter named ``layers.0.*``; a drafter of more layers
    is refused with a hint (which layer they are is unknown), not a bare list of missing weights."""
    from conftest import drafter_config, edited_checkpoint, save_drafter

    target, two = tiny_pair
    one = save_drafter(tmp_path / "one", drafter_config(target, num_layers=1))

    def rename(w):
        for k in [k for k in w if k.startswith("layers.0.")]:
            w["midlayer." + k[len("layers.0."):]] = w.pop(k)
    mid = edited_checkpoint(one, tmp_path / "mid", state=rename)
    a, b = (DFlashDrafter.from_pretrained(d, torch.float32) for d in (one, mid))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    for d in (edited_checkpoint(two, tmp_path / "mid2", state=rename),
              edited_checkpoint(one, tmp_path / "both", state=lambda w: (rename(w), w.update(
                  {"layers.0.input_layernorm.weight": w["midlayer.input_layernorm.weight"].clone()})))):
        with pytest.raises(dflash_torch.DFlashError) as err:
            DFlashDrafter.from_pretrained(d, torch.float32)
        assert str(err.value).startswith(f"drafter checkpoint {d} names weights EAGLE-style (midlayer.") and str(
            err.value).endswith("rename them layers.<i>.*") and "\n" not in str(err.value), str(err.value)
    # (under a prefix too: the missing layers.0.* are named with the prefix to drop, not a bare list)
    d = edited_checkpoint(mid, tmp_path / "prefixed", state=lambda w: [w.update({"model." + k: w.pop(k)})
                                                                       for k in [k for k in w if k.startswith("midlayer.")]])
    with pytest.raises(dflash_torch.DFlashError) as err:
        DFlashDrafter.from_pretrained(d, torch.float32)
    assert str(err.value).endswith("(it holds them under the prefix 'model.': model.midlayer.input_layernorm.weight, "
                                   "...; rename them without it)"), str(err.value)
