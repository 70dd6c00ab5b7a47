"""RoPE (dflash_torch.models.rope) against transformers' own rotary embeddings (the oracle):
default, linear, llama3 and yarn frequencies and attention factors, parsed from
config dicts by our ``_rope``; partial rotary (Qwen3-Next, Qwen3.5); apply_rope on a
partial head; a yarn target and a yarn drafter end to end."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb as qwen3_apply_rotary_pos_emb
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding
from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb as next_apply_rotary_pos_emb

import dflash_torch
from conftest import drafter_config, load_hf, make_target, save_drafter
from dflash_torch import DFlashEngine, DFlashError
from dflash_torch.models.config import TargetConfig, _rope
from dflash_torch.models.drafter_config import DrafterConfig
from dflash_torch.models.rope import Rotary, apply_rope, rope_attention_factor, rope_inv_freq
from dflash_torch.models.target import TargetModel

# inv_freq: we compute in float64 then round, transformers in float32 (a few ulp apart)
INV_FREQ_RTOL = 5e-7

BASE = dict(hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=131072)

YARN_CASES = {
    "qwen3-4x": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6},
    "betas": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16.0,
              "beta_slow": 2.0, "rope_theta": 10000.0},
    "truncate-false": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                       "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0},
    "mscale-equal": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "rope_theta": 10000.0},
    "mscale-ratio": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707,
                     "mscale_all_dim": 1.0, "rope_theta": 10000.0},
    "mscale-only": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 8192, "mscale": 0.5,
                    "rope_theta": 10000.0},
    "attention-factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                         "attention_factor": 0.8, "rope_theta": 1e6},
    # transformers' config standardisation fills original_max_position_embeddings from
    # max_position_embeddings: a ramp over 131072 positions
    "no-original": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
    "v4-type-key": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16384},
}
OTHER_CASES = {
    "default": {"rope_type": "default", "rope_theta": 1e6},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
}


def ours(cfg: dict, head_dim: int) -> Rotary:
    """Our Rotary built from a config.json dict the way the model loaders do."""
    theta, scaling = _rope(copy.deepcopy(cfg))
    params = cfg.get("rope_parameters") or {}
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    return Rotary(head_dim, theta, scaling, partial, max_position_embeddings=cfg.get("max_position_embeddings"))


def compare_tables(hf_emb, rotary: Rotary, positions: torch.Tensor, hf_positions: torch.Tensor) -> None:
    assert rotary.inv_freq.shape == hf_emb.inv_freq.shape
    torch.testing.assert_close(rotary.inv_freq, hf_emb.inv_freq, rtol=INV_FREQ_RTOL, atol=0)
    assert rotary.attention_factor == pytest.approx(hf_emb.attention_scaling, rel=1e-12)
    with torch.no_grad():
        ref_cos, ref_sin = hf_emb(torch.zeros(1), hf_positions)
    cos, sin = rotary.cos_sin(positions, torch.float32)
    assert cos.shape == (len(positions), rotary.rotary_dim) and cos.dtype == torch.float32
    # the angles (position * inv_freq, rounded to float32) differ by at most position times
    # (the inv_freq difference + one float32 ulp of inv_freq <= 1): bound each row by that
    d_inv = float((rotary.inv_freq - hf_emb.inv_freq).abs().max())
    tol = (positions.double() * (d_inv + 2.0 ** -23) + 1e-6)[:, None] * max(1.0, rotary.attention_factor)
    assert ((cos - ref_cos.reshape(cos.shape)).abs() <= tol).all()
    assert ((sin - ref_sin.reshape(sin.shape)).abs() <= tol).all()
    # bfloat16 tables are the float32 ones (attention factor included) rounded once
    cos16, _ = rotary.cos_sin(positions, torch.bfloat16)
    assert torch.equal(cos16, cos.to(torch.bfloat16))


POSITIONS = torch.cat([torch.arange(0, 300), torch.tensor([1023, 2048, 4095])])


@pytest.mark.parametrize("name", list(YARN_CASES) + list(OTHER_CASES))
def test_frequencies_attention_factor_and_tables_match_transformers(name):
    params = {**YARN_CASES, **OTHER_CASES}[name]
    cfg = {**BASE, "rope_parameters": params}
    if name == "v4-type-key":  # transformers 4 layout: rope_theta at the top, rope_scaling with "type"
        cfg = {**BASE, "rope_theta": 10000.0, "rope_scaling": params}
    hf_cfg = transformers.Qwen3Config(**copy.deepcopy(cfg))
    hf_emb = Qwen3RotaryEmbedding(hf_cfg)
    rotary = ours(cfg, BASE["head_dim"])
    compare_tables(hf_emb, rotary, POSITIONS, POSITIONS[None])
    kind = params.get("rope_type", params.get("type"))
    assert hf_cfg.rope_parameters["rope_type"] == kind
    if kind == "yarn" and name != "mscale-equal":
        assert rotary.attention_factor != 1.0  # the factor really is applied in these cases
    # the functions behind Rotary agree with it
    _, scaling = _rope(copy.deepcopy(cfg))
    assert torch.equal(rope_inv_freq(64, hf_emb.config.rope_parameters["rope_theta"], scaling,
                                     max_position_embeddings=BASE["max_position_embeddings"]), rotary.inv_freq)
    assert rope_attention_factor(scaling, BASE["max_position_embeddings"]) == rotary.attention_factor


def test_top_level_original_max_position_embeddings_wins_like_transformers():
    """transformers' standardisation gives a top-level original_max_position_embeddings
    priority over the one inside the rope dict (Phi-3 style configs)."""
    cfg = {**BASE, "original_max_position_embeddings": 8192, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}}
    hf_emb = Qwen3RotaryEmbedding(transformers.Qwen3Config(**copy.deepcopy(cfg)))
    assert hf_emb.config.rope_parameters["original_max_position_embeddings"] == 8192
    rotary = ours(cfg, 64)
    compare_tables(hf_emb, rotary, POSITIONS, POSITIONS[None])
    # and it is not the same table as the in-dict value would give
    inner = Rotary(64, 1e6, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    assert not torch.allclose(inner.inv_freq, rotary.inv_freq, rtol=1e-3)


PARTIAL_CASES = {
    "qwen3-next-default": (transformers.Qwen3NextConfig, Qwen3NextRotaryEmbedding, {"rope_theta": 1e7}),
    "qwen3-next-yarn": (transformers.Qwen3NextConfig, Qwen3NextRotaryEmbedding,
                        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                         "rope_theta": 1e7}),
    "qwen3.5-mrope": (transformers.Qwen3_5TextConfig, Qwen3_5TextRotaryEmbedding,
                      {"rope_type": "default", "mrope_section": [11, 11, 10], "mrope_interleaved": True,
                       "rope_theta": 1e7}),
    "qwen3.5-moe-mrope": (transformers.Qwen3_5MoeTextConfig,
                          transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeTextRotaryEmbedding,
                          {"rope_type": "default", "mrope_section": [11, 11, 10], "mrope_interleaved": True,
                           "rope_theta": 1e7}),
}


@pytest.mark.parametrize("name", list(PARTIAL_CASES))
def test_partial_rotary_tables_match_transformers(name):
    """partial_rotary_factor 0.25 (in rope_parameters, as transformers 5 saves it): a
    64-wide rotary slice of a 256-wide head. Qwen3.5's multimodal RoPE with equal
    temporal/height/width positions (text) is plain RoPE."""
    cfg_cls, emb_cls, params = PARTIAL_CASES[name]
    hf_cfg = cfg_cls(hidden_size=512, num_attention_heads=2, head_dim=256, max_position_embeddings=131072,
                     rope_parameters=copy.deepcopy(params))
    assert hf_cfg.rope_parameters["partial_rotary_factor"] == 0.25
    saved = hf_cfg.to_dict()  # what config.json holds
    hf_emb = emb_cls(hf_cfg)
    rotary = ours(saved, 256)
    assert rotary.rotary_dim == 64
    hf_positions = POSITIONS[None] if "next" in name else POSITIONS[None, None].expand(3, 1, -1)
    compare_tables(hf_emb, rotary, POSITIONS, hf_positions)


def test_rope_scaling_dict_holds_only_the_scaling_rule():
    theta, scaling = _rope({"max_position_embeddings": 1024, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
        "mrope_interleaved": True}})
    assert (theta, scaling) == (1e7, None)
    assert _rope({"rope_theta": 5e5, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}) == (5e5, None)
    assert _rope({"rope_theta": 5e5, "partial_rotary_factor": 0.5}) == (5e5, None)
    assert _rope({}) == (10000.0, None)
    theta, scaling = _rope({"max_position_embeddings": 1024, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e7, "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10], "mrope_interleaved": True}})
    assert theta == 1e7 and scaling == {"rope_type": "yarn", "factor": 4.0}
    # v4 "type" key becomes rope_type
    assert _rope({"rope_theta": 1.0e4, "rope_scaling": {"type": "linear", "factor": 2.0}}) == (
        1.0e4, {"rope_type": "linear", "factor": 2.0})


@pytest.mark.parametrize("cfg, message", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "config.json rope_scaling: unsupported rope scaling type 'dynamic'; supported: linear, llama3, yarn"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0]}},
     "config.json rope_parameters: unsupported rope scaling type 'longrope'; supported: linear, llama3, yarn"),
    ({"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 1024}},
     "config.json rope_parameters: rope scaling type 'yarn' lacks factor"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
     "config.json rope_parameters: rope scaling type 'yarn' lacks original_max_position_embeddings (or max_position_embeddings)"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 1024}},
     "config.json rope_parameters: rope scaling type 'yarn' lacks max_position_embeddings (to derive its null factor)"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}},
     "config.json rope_scaling: rope scaling type 'llama3' lacks low_freq_factor, high_freq_factor"),
    ({"rope_scaling": {"rope_type": "linear"}}, "config.json rope_scaling: rope scaling type 'linear' lacks factor"),
])
@pytest.mark.parametrize("what", ["target", "drafter"])
def test_bad_rope_configs_give_one_line_errors(cfg, message, what):
    """Each names the file it is about (a drafter's bad rule read as if the target's were bad)."""
    with pytest.raises(DFlashError) as err:
        _rope(cfg, what)
    assert str(err.value) == f"{what} {message}"


def test_odd_or_empty_rotary_dim_is_refused():
    with pytest.raises(DFlashError, match="even rotary dimension"):
        Rotary(64, 1e4, None, partial_rotary_factor=0.3)  # 19 channels
    with pytest.raises(DFlashError, match="even rotary dimension"):
        Rotary(64, 1e4, None, partial_rotary_factor=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_partial_and_full_match_transformers(dtype):
    g = torch.Generator().manual_seed(0)
    heads, t, head_dim = 3, 17, 32
    positions = torch.arange(40, 40 + t)
    q = torch.randn(heads, t, head_dim, generator=g).to(dtype)
    k = torch.randn(1, t, head_dim, generator=g).to(dtype)
    for factor, reference in [(0.25, next_apply_rotary_pos_emb), (0.5, next_apply_rotary_pos_emb),
                              (1.0, qwen3_apply_rotary_pos_emb)]:
        rotary = Rotary(head_dim, 10000.0, None, partial_rotary_factor=factor)
        cos, sin = rotary.cos_sin(positions, dtype)
        ref_q, ref_k = reference(q[None], k[None], cos[None], sin[None])
        out_q, out_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        assert out_q.shape == q.shape and out_q.dtype == dtype
        assert torch.equal(out_q, ref_q[0]) and torch.equal(out_k, ref_k[0]), factor
        d = rotary.rotary_dim
        assert torch.equal(out_q[..., d:], q[..., d:])  # channels past rotary_dim pass through
        if factor < 1:
            assert not torch.equal(out_q[..., :d], q[..., :d])


YARN_TARGET = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}


def test_yarn_target_matches_transformers(tmp_path):
    """A Qwen3 target with yarn rope_parameters (positions up to 3x the original length)."""
    path = make_target(tmp_path / "t", "qwen3", tokenizer=False, max_position_embeddings=128,
                       rope_parameters=dict(YARN_TARGET))
    cfg = TargetConfig.from_dict(json.loads((path / "config.json").read_text()))
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    hf = load_hf(path)
    model = TargetModel.from_pretrained(path, torch.float32)
    assert model.rotary.attention_factor == pytest.approx(hf.model.rotary_emb.attention_scaling)
    ids = torch.randint(0, cfg.vocab_size, (96,), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache()
    cache.reset(len(ids))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        logits, _ = model(ids, torch.arange(len(ids)), cache, len(ids), [0])
    assert float((logits - ref).norm() / ref.norm()) <= 1e-4


@pytest.mark.parametrize("scaling, max_positions", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, None),
    ({"rope_type": "yarn", "factor": 8.0, "beta_fast": 8.0, "mscale": 0.707, "mscale_all_dim": 1.0}, 64),
], ids=["yarn", "yarn-from-max-positions"])
def test_yarn_drafter_loads_and_decodes_losslessly(tmp_path, tiny_pair, scaling, max_positions):
    target, _ = tiny_pair
    cfg = dataclasses.replace(drafter_config(target, num_layers=2, block_size=4), rope_scaling=dict(scaling),
                              max_position_embeddings=max_positions)
    saved = cfg.to_dict()
    assert saved["rope_scaling"] == scaling
    assert saved.get("max_position_embeddings") == max_positions
    loaded = DrafterConfig.from_dict(saved)
    # (a file without max_position_embeddings reads transformers' Qwen3Config default, as the DFlash reference
    # does: its YaRN keeps the explicit factor, so the RoPE below is the same)
    assert loaded.max_position_embeddings == (32768 if max_positions is None else max_positions)
    assert loaded == dataclasses.replace(cfg, max_position_embeddings=loaded.max_position_embeddings)
    drafter_dir = save_drafter(tmp_path / "drafter", cfg, seed=3)

    spec = DFlashEngine.from_pretrained(target, drafter_dir)
    rotary = spec.drafter.rotary
    assert rotary.attention_factor == rope_attention_factor(scaling, max_positions) != 1.0
    expected = rope_inv_freq(cfg.head_dim, cfg.rope_theta, scaling, max_position_embeddings=max_positions)
    assert torch.equal(rotary.inv_freq, expected)
    assert not torch.allclose(expected, rope_inv_freq(cfg.head_dim, cfg.rope_theta, None))
    base = DFlashEngine(spec.target, spec.tokenizer)
    for prompt in [spec.encode_prompt("def f(x):"), list(range(2, 40))]:
        ref = base.generate(prompt, max_new_tokens=30, ignore_eos=True).token_ids
        out = spec.generate(prompt, max_new_tokens=30, ignore_eos=True)
        assert out.token_ids == ref
        assert len(out.stats.acceptance_lengths) > 1


def _logits(target_dir, n=118):
    hf = load_hf(target_dir)
    ours = TargetModel.from_pretrained(target_dir, torch.float32)
    ids = torch.arange(2, 2 + n)
    cache = ours.new_cache()
    cache.reset(n + 8)
    with torch.no_grad():
        return ours(ids, torch.arange(n), cache, n)[0], hf(ids[None]).logits[0]


def test_yarn_with_a_null_factor_derives_it_like_transformers(tmp_path):
    """``factor: null``: max_position_embeddings / original_max_position_embeddings (it was
    refused as "lacks factor"); an absent factor is still refused."""
    target = make_target(tmp_path / "yarn", "qwen3", tokenizer=False, max_position_embeddings=256, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0})
    cfg = json.loads((target / "config.json").read_text())
    cfg["rope_parameters"]["factor"] = None
    (target / "config.json").write_text(json.dumps(cfg))
    ours, ref = _logits(target)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    del cfg["rope_parameters"]["factor"]
    with pytest.raises(DFlashError, match="^target config.json rope_parameters: rope scaling type 'yarn' lacks factor$"):
        _rope(cfg)


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2", "qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("where", ["rope_parameters", "top level"])
def test_partial_rotary_is_refused_where_transformers_rotates_whole_heads(tmp_path, family, where):
    """transformers' rotary of these families ignores ``partial_rotary_factor`` (plain RoPE) or
    cannot run it (a scaling rule): it was applied, giving other logits than the file's model."""
    from conftest import make_gpt_oss_target, make_hybrid_target

    if family == "gpt_oss":
        target = make_gpt_oss_target(tmp_path / family, tokenizer=False)
    elif family == "qwen3_moe":
        target = make_hybrid_target(tmp_path / family, family, tokenizer=False)
    else:
        target = make_target(tmp_path / family, family, tokenizer=False)
    cfg = json.loads((target / "config.json").read_text())
    (cfg["rope_parameters"] if where == "rope_parameters" else cfg)["partial_rotary_factor"] = 0.5
    (target / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match=rf"^target partial_rotary_factor 0.5 is not supported for model_type '{family}'"):
        TargetModel.from_pretrained(target, torch.float32)


OSS_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 4096}


@pytest.mark.parametrize("rope, theta", [
    ({}, None), ({}, 5000.0),
    ({"rope_scaling": OSS_YARN}, None), ({"rope_parameters": OSS_YARN}, None), ({"rope_scaling": OSS_YARN}, 5000.0),
    ({"rope_parameters": {**OSS_YARN, "rope_theta": 150000.0}, "rope_scaling": {**OSS_YARN, "factor": 8.0}}, None),
], ids=["none", "none-top-theta", "scaling-no-theta", "parameters-no-theta", "scaling-top-theta", "both-keys"])
def test_a_gpt_oss_config_without_rope_theta_takes_transformers_default(tmp_path, rope, theta):
    """No ``rope_parameters`` / ``rope_scaling``: GptOssConfig's YaRN (factor 32, original 4096,
    not truncated); a ``rope_theta`` nowhere (neither in the rope dict read nor at the top
    level; a ``rope_scaling`` is read in place of ``rope_parameters``): GptOssConfig's
    default_theta, 150000 (it was plain RoPE, theta 10000, with no rope dict; theta 10000 with one)."""
    from conftest import make_gpt_oss_target

    target = make_gpt_oss_target(tmp_path / "oss", tokenizer=False)
    cfg = json.loads((target / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.pop("rope_scaling", None)
    cfg.pop("rope_theta", None)
    cfg.update(copy.deepcopy(rope))
    if theta is not None:
        cfg["rope_theta"] = theta
    (target / "config.json").write_text(json.dumps(cfg))
    assert transformers.GptOssConfig.from_dict(copy.deepcopy(cfg)).rope_parameters["rope_theta"] == (theta or 150000.0)
    ours, ref = _logits(target, 60)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    assert TargetModel.from_pretrained(target, torch.float32).config.rope_theta == (theta or 150000.0)


def test_yarn_extends_the_context_to_original_times_factor_and_decodes_there_as_transformers(tmp_path):
    """YaRN added as the Qwen3 model card says (``rope_scaling`` with factor 4 and the
    pre-training length as original, ``max_position_embeddings`` left as shipped): the
    context is max(max_position_embeddings, original x factor) (vLLM's length; transformers
    runs any length), not max_position_embeddings (a max_context past it was refused). Past
    max_position_embeddings our prompt logits and greedy tokens are transformers'; the limit
    is named truthfully, and the trainer's --seq-len check reads it too. A linear rule
    stretches max_position_embeddings by its factor (vLLM's length; the logits there are
    transformers'); llama3 keeps it (its configs state the extended length there)."""
    from conftest import hf_greedy
    from dflash_torch.options import check_max_context, target_context
    from dflash_torch.training.trainer import TrainConfig, Trainer

    path = make_target(tmp_path / "t", "qwen3", max_position_embeddings=80, num_hidden_layers=2)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 10000.0
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    (path / "config.json").write_text(json.dumps(cfg))
    assert target_context(TargetConfig.from_dict(cfg)) == (
        256, "YaRN factor 4.0 x original_max_position_embeddings 64")
    engine = DFlashEngine.from_pretrained(path, no_draft=True)
    assert engine.max_context == 256
    hf = load_hf(path)
    ids = torch.randint(2, cfg["vocab_size"], (230,), generator=torch.Generator().manual_seed(3)).tolist()
    out = engine.generate(ids, max_new_tokens=26, ignore_eos=True, prompt_logprobs=0)
    assert out.token_ids == hf_greedy(hf, ids, 26)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    ours = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])
    torch.testing.assert_close(ours, ref[torch.arange(len(ids) - 1), ids[1:]], rtol=1e-4, atol=1e-4)
    batch = DFlashEngine(engine.target, engine.tokenizer, max_batch_size=2)
    assert batch.max_context == 256
    assert [o.token_ids for o in batch.generate_batch([ids, ids[:200]], max_new_tokens=[26, 8], ignore_eos=True)] == [
        out.token_ids, hf_greedy(hf, ids[:200], 8)]
    with pytest.raises(DFlashError, match=r"^max_context must be an integer in \[2, 256\] \(the target's context: YaRN "
                                          r"factor 4.0 x original_max_position_embeddings 64\), got 257$"):
        DFlashEngine.from_pretrained(path, no_draft=True, max_context=257)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(DFlashError, match=r"^seq_len 257 exceeds the target's context of 256 tokens$"):  # (the field)
        Trainer(TrainConfig(target=str(path), data=[str(data)], out=str(tmp_path / "o"), work_dir=str(tmp_path / "w"),
                            steps=1, seq_len=257, progress=False), log=lambda m: None).run()
    linear = dict(cfg, rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert target_context(TargetConfig.from_dict(linear)) == (320, "linear factor 4.0 x max_position_embeddings 80")
    (path / "config.json").write_text(json.dumps(linear))
    engine, hf = DFlashEngine.from_pretrained(path, no_draft=True), load_hf(path)
    assert engine.max_context == 320
    out = engine.generate(ids, max_new_tokens=12, ignore_eos=True)
    assert out.token_ids == hf_greedy(hf, ids, 12)
    for rule in ({"rope_type": "linear", "factor": 0.5},
                 {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64},
                 {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}):
        assert target_context(TargetConfig.from_dict(dict(cfg, rope_scaling=rule))) == (80, "max_position_embeddings")
    with pytest.raises(DFlashError, match=r"in \[2, 80\] \(the target's context: max_position_embeddings\), got 81$"):
        check_max_context(81, TargetConfig.from_dict(dict(cfg, rope_scaling=rule)))


def test_defaults_are_those_of_transformers_config_classes():
    """:func:`transformers_default`, the source of a target's ``max_position_embeddings`` and
    ``rope_theta`` where its config gives none, says what each family's transformers config
    class fills in (a multimodal wrapper: its text config's)."""
    from dflash_torch.models.config import transformers_default
    from dflash_torch.models.registry import FAMILIES

    for model_type in FAMILIES:
        cls = transformers.CONFIG_MAPPING[model_type]
        theirs = cls(rope_scaling={"rope_type": "linear", "factor": 2.0})
        text = getattr(theirs, "text_config", None) or theirs
        if isinstance(text.rope_parameters, dict) and "rope_theta" in text.rope_parameters:
            assert transformers_default(model_type, "default_theta") == text.rope_parameters["rope_theta"], model_type
        if model_type != "kimi_k25":  # (its text_config class is AutoConfig: parsed as deepseek_v3)
            assert transformers_default(model_type, "max_position_embeddings") == text.max_position_embeddings, model_type
    assert transformers_default("gpt_oss", "default_theta") == 150000.0
    assert transformers_default("no_such_model", "max_position_embeddings") is None


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
def test_a_target_without_max_position_embeddings_takes_transformers_default(tmp_path, family):
    """No ``max_position_embeddings``: the model type's transformers default (Qwen3 32768,
    Llama 2048; it was 4096), both as the context length and where YaRN derives a null
    factor from it (the logits differed from transformers' by up to 1 nat)."""
    target = make_target(tmp_path / family, family, tokenizer=False, max_position_embeddings=2048, rope_parameters={
        "rope_type": "yarn", "factor": None, "original_max_position_embeddings": 256, "rope_theta": 10000.0})
    cfg = json.loads((target / "config.json").read_text())
    del cfg["max_position_embeddings"]
    (target / "config.json").write_text(json.dumps(cfg))
    expected = transformers.CONFIG_MAPPING[family]().max_position_embeddings
    assert TargetConfig.from_dict(cfg).max_position_embeddings == expected != 4096
    ours, ref = _logits(target, 60)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_no_max_position_embeddings_and_no_default_is_refused():
    from dflash_torch.models.config import base_target_fields

    cfg = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(DFlashError, match=r"^target config.json lacks max_position_embeddings \(transformers has no "
                                          r"default for model_type 'no_such_model'\)$"):
        base_target_fields(cfg, "no_such_model")
    assert base_target_fields(dict(cfg, max_position_embeddings=100), "no_such_model")["max_position_embeddings"] == 100


def test_keys_a_rope_rule_does_not_read_are_ignored_with_one_warning(tmp_path, caplog):
    """YaRN's ``finetuned: true`` (NousResearch's Yarn-Llama-2 configs) or a ``comment`` were
    refused ("rope_scaling.finetuned must be a number > 0, got True"); transformers warns of
    unrecognized keys and runs. Now ignored, named in one WARNING per file and load (target and
    drafter); the decoded tokens are transformers' (positions past the original length); the
    keys the rule reads are still checked."""
    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "finetuned": True,
               "comment": "x", "low_freq_factor": None}
    target = make_target(tmp_path / "t", "llama", max_position_embeddings=128)
    cfg = json.loads((target / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(rope_theta=10000.0, rope_scaling=scaling)  # (as the Yarn-Llama-2 files have it)
    (target / "config.json").write_text(json.dumps(cfg))
    drafter = save_drafter(tmp_path / "d", dataclasses.replace(drafter_config(target, block_size=4),
                                                               rope_scaling=dict(scaling)))
    with caplog.at_level("WARNING", logger="dflash_torch"):
        spec = DFlashEngine.from_pretrained(target, drafter, dtype="float32")
    assert [r.getMessage() for r in caplog.records if r.name == "dflash_torch"] == [
        f"dflash-torch: WARNING: {what} config.json rope_scaling: ignoring finetuned, comment, which rope scaling "
        "type 'yarn' does not read" for what in ("target", "drafter")]
    assert spec.target.config.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    prompt = list(range(2, 70))
    with torch.no_grad():
        ref = load_hf(target).generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None)
    assert spec.generate(prompt, max_new_tokens=24, ignore_eos=True).token_ids == ref[0, len(prompt):].tolist()
    with pytest.raises(DFlashError, match=r"^target config.json rope_scaling.factor must be a number > 0, got True$"):
        _rope(dict(cfg, rope_scaling=dict(scaling, factor=True)))


def test_transformers_notices_on_a_target_rope_do_not_reach_the_terminal(tmp_path):
    """In a fresh process per target (transformers' log handler on the real stderr, Python's
    warnings shown): a Qwen3 model card's YaRN (``rope_scaling`` factor 4 with a
    ``max_position_embeddings`` 1.25 times the original) prints nothing, and a key the rule does
    not read only dflash-torch's one WARNING, from ``DFlashEngine.from_pretrained`` and
    ``train --self-distill``'s target loading (first, in the fresh process) and from
    ``dflash-torch generate`` (its ``main``, next); transformers itself, last in the same process,
    still prints its notices, and its verbosity is as it was. (transformers read the config.json
    for the tokenizer and the self-distill model and printed "The explicitly set RoPE scaling
    factor ... does not match ..." and "Unrecognized keys in `rope_parameters` ...".) Between the
    parts, transformers' ``warning_once`` cache is emptied, so that a notice one part let out
    would be printed again by the next."""
    import os
    import subprocess
    import sys

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    card = make_target(tmp_path / "card", max_position_embeddings=320)
    cfg = json.loads((card / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    (card / "config.json").write_text(json.dumps(dict(cfg, rope_scaling=yarn)))
    extra = make_target(tmp_path / "extra", max_position_embeddings=320)
    (extra / "config.json").write_text(json.dumps(dict(cfg, rope_parameters=dict(yarn, rope_theta=10000.0,
                                                                                  finetuned=True))))
    warning = ("dflash-torch: WARNING: target config.json rope_parameters: ignoring finetuned, which rope scaling type "
               "'yarn' does not read\n")
    env = {**os.environ, "PYTHONWARNINGS": "always", "PYTHONPATH": str(Path(dflash_torch.__file__).parents[1])}
    # one process per target (each starting the interpreter and torch costs ~4 s CPU): ours, then the CLI's main,
    # then transformers' own loading, each part's stderr and stdout told apart by a marker line
    script = ("import sys, transformers\n"
              "from transformers.utils.logging import warning_once\n"
              "from dflash_torch import DFlashEngine\n"
              "from dflash_torch.cli import main\n"
              "from dflash_torch.tokenizer import load_tokenizer\n"
              "from dflash_torch.training.distill import self_distill\n"
              "def part(name):\n"
              "    warning_once.cache_clear()\n"
              "    for stream in (sys.stdout, sys.stderr):\n"
              "        stream.flush()\n"
              "        print(f'--{name}--', file=stream, flush=True)\n"
              "print(transformers.logging.get_verbosity())\n"
              "part('ours')\n"
              "DFlashEngine.from_pretrained(sys.argv[1], no_draft=True, max_context=64)\n"
              "self_distill(sys.argv[1], load_tokenizer(sys.argv[1]), [[5, 6, 7]], [False], seq_len=6, progress=False)\n"
              "print(transformers.logging.get_verbosity())\n"
              "part('cli')\n"
              "status = main(['generate', '--target', sys.argv[1], '--no-draft', '--max-new-tokens', '2',\n"
              "               '--threads', '1', '--json', 'x'])\n"
              "part('transformers')\n"
              "transformers.AutoTokenizer.from_pretrained(sys.argv[1])\n"
              "print(transformers.logging.get_verbosity())\n"
              "print(status)\n")

    def parts(stream):
        before, rest = stream.split("--ours--\n")
        ours, rest = rest.split("--cli--\n")
        cli, theirs = rest.split("--transformers--\n")
        return before, ours, cli, theirs

    for target, said in ((card, ""), (extra, warning)):
        run = subprocess.run([sys.executable, "-c", script, str(target)], capture_output=True, text=True, env=env,
                             timeout=300, check=True)
        _, ours_err, cli_err, theirs_err = parts(run.stderr)
        verbosity, ours_out, cli_out, theirs_out = parts(run.stdout)
        assert "The explicitly set RoPE scaling factor" in theirs_err
        assert ("Unrecognized keys in `rope_parameters`" in theirs_err) == (target == extra)
        assert ours_err == said and ours_out == verbosity  # (and transformers' verbosity as it was)
        assert theirs_out == verbosity + "0\n"
        assert cli_err == said and len(json.loads(cli_out)["token_ids"]) == 2
