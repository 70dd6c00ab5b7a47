"""GLM-4-MoE-Lite targets (``glm4_moe_lite``, GLM-4.7-Flash), run by the DeepSeek-V3 model,
against transformers' own ``Glm4MoeLiteForCausalLM``, on tiny random checkpoints (4 heads, a
latent of 32 + 8, query heads of 24 + 8 and values of 16 (GLM-4.7-Flash's proportions), 8
experts in 4 groups, 2 groups chosen, 3 experts a token, 2 shared experts; layers as
``mlp_layer_types`` says, default one dense then two mixture-of-experts layers; random norms and
score correction biases):

* our forward == transformers' (logits and every layer's output, float32), in one pass, in
  pieces and with fixed shapes; other ``mlp_layer_types`` patterns, without the query's low
  rank, RoPE not interleaved, YaRN with DeepSeek's softmax scale; guards: the score correction
  bias, the group limit and the layer pattern each change the logits;
* greedy speculative decoding == transformers' greedy ``generate``; an agreeable pair accepting
  many tokens a round (eager, chunked prefill, fixed shapes, batched, compiled, prefix reuse;
  bfloat16 == target-only but at near-ties);
* the multi-token-prediction layer (``model.layers.{num_hidden_layers}.*``, announced by
  ``num_nextn_predict_layers``) is not read; other unknown weights are refused; bad configs are
  refused in one line; GLM-4.7-Flash's shapes (transformers' defaults) are read as transformers
  reads them;
* fine-grained FP8 (as DeepSeek-V3's loads) == transformers' own loading of it, and
  compressed-tensors W4A16 == the library's own dequantization; kept packed == dequantized bit
  for bit; the router float32 in bfloat16.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import (EOS_ID, VOCAB, assert_same_weights, check_compiled_rounds_are_lossless,
                      check_forward_matches_transformers, check_greedy_equals_transformers,
                      check_many_accepted_tokens_are_lossless, copy_tokenizer, drafter_config, edited_checkpoint,
                      forward_in_pieces, load_hf, make_agreeable, randomize_moe_weights, save_drafter)
from dflash_torch import DFlashError
from dflash_torch.models import deepseek_v3, glm4_moe_lite
from dflash_torch.models.config import TargetConfig
from dflash_torch.models.target import TargetModel

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8,
            routed_scaling_factor=1.8, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
            qk_nope_head_dim=24, n_group=4, topk_group=2, num_experts_per_tok=3, max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, eos_token_id=EOS_ID,
            bos_token_id=EOS_ID, pad_token_id=EOS_ID, tie_word_embeddings=False)


def make_glm_target(out_dir: Path, *, seed: int = 0, **overrides) -> Path:
    """Save a tiny random ``Glm4MoeLiteForCausalLM`` (:data:`TEXT` plus ``overrides``;
    transformers' eager experts), with larger-than-default weights, norms around 1 and score
    correction biases that change which experts are chosen."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Glm4MoeLiteConfig(**{**TEXT, **overrides}, experts_implementation="eager")
    model = transformers.Glm4MoeLiteForCausalLM(config).eval()
    randomize_moe_weights(model)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_dir):
    """(target_dir, random drafter_dir, B = 16) of the tiny GLM-4-MoE-Lite target."""
    root = tmp_path_factory.mktemp("glm4_moe_lite")
    target = make_glm_target(root / "target", seed=5)
    copy_tokenizer(tokenizer_dir, target)
    return target, save_drafter(root / "drafter", drafter_config(target, block_size=16), seed=5)


@pytest.fixture(scope="module")
def agree_pair(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("glm4_moe_lite-agree")
    target = make_glm_target(root / "target", seed=1)
    return make_agreeable(target, tokenizer_dir, root, "glm4_moe_lite", alpha=1.0, beta=5.0, self_scale=0.3)


IDS = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("pieces,static", [([30], False), ([11, 1, 7, 11], False), ([16, 14], True)])
def test_forward_matches_transformers(checkpoint, pieces, static):
    target_dir, _ = checkpoint
    ours = TargetModel.from_pretrained(target_dir, torch.float32)
    assert type(ours) is glm4_moe_lite.Model and isinstance(ours, deepseek_v3.Model)
    assert ours.config.model_type == "glm4_moe_lite" and ours.config.moe_layers == [False, True, True]
    assert json.loads((target_dir / "config.json").read_text())["mlp_layer_types"] == ["dense", "sparse", "sparse"]
    check_forward_matches_transformers(ours, load_hf(target_dir), IDS, pieces, static)


@pytest.mark.parametrize("overrides", [
    dict(mlp_layer_types=["sparse", "dense", "sparse"]),
    dict(mlp_layer_types=["sparse"] * 3, q_lora_rank=None),
    dict(mlp_layer_types=["dense", "dense", "sparse"], rope_interleave=False),
    dict(num_hidden_layers=2, mlp_layer_types=["dense", "dense"]),
    dict(rope_parameters=dict(YARN, mscale=0.707, mscale_all_dim=0.8, factor=40.0), n_group=1, topk_group=1,
         norm_topk_prob=False, kv_lora_rank=31, attention_bias=True),
], ids=["sparse-dense-sparse", "all-sparse-q_proj", "two-dense-not-interleaved", "all-dense",
        "yarn-one-group-odd-latent-biases"])
def test_variants_match_transformers(tmp_path, overrides):
    """``mlp_layer_types`` patterns other than the default (a dense layer between experts, every
    layer a mixture, two dense first, no mixture at all), queries without the low rank, RoPE on
    consecutive halves, YaRN with DeepSeek's softmax scale (``mscale`` and ``mscale_all_dim``
    apart), one group without renormalisation, an odd latent row, biases."""
    target_dir = make_glm_target(tmp_path / "target", seed=2, **overrides)
    ours = TargetModel.from_pretrained(target_dir, torch.float32)
    want = overrides.get("mlp_layer_types", ["dense", "sparse", "sparse"])
    assert ours.config.moe_layers == [t == "sparse" for t in want]
    check_forward_matches_transformers(ours, load_hf(target_dir), IDS, [17, 13], False)


def test_the_details_matter(checkpoint, tmp_path):
    """Guards the comparisons above: no score correction bias or no group limit each change the
    logits by more than 1e-3; the layer pattern is the config's (the same weights under another
    ``mlp_layer_types`` lack the experts of the layer it makes sparse)."""
    target_dir, _ = checkpoint
    with torch.no_grad():
        ref = load_hf(target_dir)(IDS[None]).logits[0]
    for change in ("bias", "groups"):
        ours = TargetModel.from_pretrained(target_dir, torch.float32)
        for layer in ours.model.layers:
            mlp = layer.mlp
            if change == "bias" and isinstance(mlp, deepseek_v3.DeepseekV3MoE):
                mlp.gate.e_score_correction_bias.data.zero_()
            elif change == "groups" and isinstance(mlp, deepseek_v3.DeepseekV3MoE):
                mlp.gate.topk_group = mlp.gate.n_group
        logits, _ = forward_in_pieces(ours, IDS, [30], False)
        assert (logits - ref).abs().max() > 1e-3, change
    other = edited_checkpoint(target_dir, tmp_path / "other",
                              config=lambda c: c.update(mlp_layer_types=["sparse", "sparse", "sparse"]))
    with pytest.raises(DFlashError, match=r"lacks weights: model\.layers\.0\.mlp\.experts\."):
        TargetModel.from_pretrained(other, torch.float32)


def test_greedy_speculative_equals_transformers_generate(checkpoint):
    check_greedy_equals_transformers(*checkpoint)


def test_many_accepted_tokens_are_lossless(agree_pair):
    check_many_accepted_tokens_are_lossless(*agree_pair)


def test_compiled_rounds_are_lossless_and_do_not_recompile(agree_pair):
    check_compiled_rounds_are_lossless(*agree_pair)


def test_prefix_reuse_decodes_as_without(agree_pair):
    """A three-turn conversation through the batch decoder reuses its history's latent rows
    and decodes exactly as with reuse off (tokens, acceptance lengths, prompt rows)."""
    from test_prefix_reuse import reuse_decodes_as_without

    prompts, reused = reuse_decodes_as_without(agree_pair)
    assert reused[0] == 0 and reused[1] > len(prompts[0]) and reused[2] > len(prompts[1])


def test_bfloat16_speculative_decoding_is_the_target_s_own_but_near_ties(agree_pair):
    """bfloat16: speculative decoding commits target-only decoding's tokens, but where a
    batched verify flips a near-tie of the target (README.md), with drafts accepted."""
    from test_fp8 import bfloat16_near_tie_taus

    assert max(bfloat16_near_tie_taus(agree_pair)) > 4


def test_the_multi_token_prediction_layer_is_not_read(checkpoint, tmp_path):
    """A checkpoint with GLM-4.7-Flash's MTP layer (``model.layers.3.*``, the layer past
    ``num_hidden_layers``: a decoder layer plus its own norms, projection and head) and
    ``num_nextn_predict_layers`` 1, as published, decodes as the one without; without that key
    (transformers' config has none: 0) or with 0 those weights are unknown and refused, as is
    any other unknown weight, and a layer past the MTP layers."""
    target_dir, _ = checkpoint

    def add_layer(index):
        def add(w):
            for key in [k for k in w if k.startswith("model.layers.2.")]:
                w[key.replace("model.layers.2.", f"model.layers.{index}.")] = w[key].clone()
            for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
                w[f"model.layers.{index}.{name}"] = torch.ones(64)
            w[f"model.layers.{index}.eh_proj.weight"] = torch.zeros(64, 128)
            w[f"model.layers.{index}.shared_head.head.weight"] = torch.zeros(VOCAB, 64)
        return add

    unannounced = edited_checkpoint(target_dir, tmp_path / "unannounced", state=add_layer(3))
    assert "num_nextn_predict_layers" not in json.loads((unannounced / "config.json").read_text())
    with pytest.raises(DFlashError, match=r"^target checkpoint .* has weights this glm4_moe_lite model does not use "
                                          r"\(an unsupported variant\?\): model\.layers\.3\."):
        TargetModel.from_pretrained(unannounced, torch.float32)
    mtp = edited_checkpoint(unannounced, tmp_path / "mtp", config=lambda c: c.update(num_nextn_predict_layers=1))
    with torch.no_grad():
        ref = load_hf(target_dir)(IDS[None]).logits[0]
    logits, _ = forward_in_pieces(TargetModel.from_pretrained(mtp, torch.float32), IDS, [30], False)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    zero = edited_checkpoint(mtp, tmp_path / "zero", config=lambda c: c.update(num_nextn_predict_layers=0))
    with pytest.raises(DFlashError, match=r"does not use .*: model\.layers\.3\."):
        TargetModel.from_pretrained(zero, torch.float32)
    past = edited_checkpoint(mtp, tmp_path / "past", state=add_layer(4))
    with pytest.raises(DFlashError, match=r"does not use .*: model\.layers\.4\."):
        TargetModel.from_pretrained(past, torch.float32)
    extra = edited_checkpoint(target_dir, tmp_path / "extra",
                              state=lambda w: w.update({"model.layers.1.self_attn.k_norm.weight": torch.ones(8)}))
    with pytest.raises(DFlashError, match=r"does not use .*: model\.layers\.1\.self_attn\.k_norm\.weight$"):
        TargetModel.from_pretrained(extra, torch.float32)


# GLM-4.7-Flash's shapes (transformers' Glm4MoeLiteConfig defaults) with the keys its config.json
# gives for other engines (first_k_dense_replace, num_nextn_predict_layers, topk_method, rope_theta)
GLM_47_FLASH = {"architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite", "first_k_dense_replace": 1,
                "num_nextn_predict_layers": 1, "topk_method": "noaux_tc", "rope_theta": 1000000,
                "partial_rotary_factor": 1.0, "eos_token_id": [154820, 154827, 154829], "pad_token_id": 154820}


def test_glm_4_7_flash_s_shapes_are_read_as_transformers_reads_them():
    """47 layers, the first dense, one MTP layer to skip; 64 experts, 4 a token, routed scale
    1.8, one shared; a latent row of 512 + 64 = 576 values (54,144 bytes a token in bfloat16
    over 47 layers, against 962,560 for the expanded keys and values of 20 heads of 256 + 256, 17.8
    times more);
    the softmax scale and RoPE tables transformers computes."""
    import transformers
    from transformers.models.glm4_moe_lite import modeling_glm4_moe_lite as hf_glm

    cfg = TargetConfig.from_dict(GLM_47_FLASH)
    assert cfg.model_type == "glm4_moe_lite" and cfg.moe_layers == [False] + [True] * 46
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.routed_scaling_factor, cfg.moe.shared_expert_intermediate_size,
            cfg.num_nextn_predict_layers, cfg.eos_token_ids) == (64, 4, 1.8, 1536, 1, [154820, 154827, 154829])
    with torch.device("meta"):
        model = glm4_moe_lite.Model(cfg)
    assert model.kv_shapes() == [(1, 288)] * 47
    assert sum(h * d * 2 for h, d in model.kv_shapes()) * 2 == 54_144 and 47 * 20 * (192 + 64 + 256) * 2 == 962_560
    hf_config = transformers.Glm4MoeLiteConfig(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    assert hf_config.mlp_layer_types[:2] == ["dense", "sparse"]
    ours, theirs = model.make_rotary(), hf_glm.Glm4MoeLiteRotaryEmbedding(hf_config)
    torch.testing.assert_close(ours.inv_freq, theirs.inv_freq, rtol=1e-6, atol=0)
    assert model.model.layers[0].self_attn.scale == hf_glm.Glm4MoeLiteAttention(hf_config, 0).scaling == 256 ** -0.5


@pytest.mark.parametrize("cfg,message", [
    ({**TEXT, "mlp_layer_types": ["dense", "sparse"]},
     r"^target config.json mlp_layer_types must list 'dense' or 'sparse' for each of the 3 layers, got \['dense', 'sparse'\]$"),
    ({**TEXT, "mlp_layer_types": ["dense", "moe", "sparse"]}, r"^target config.json mlp_layer_types must list"),
    ({**TEXT, "first_k_dense_replace": 2},
     r"^target config.json first_k_dense_replace 2 disagrees with mlp_layer_types \(dense layers \[0\];"),
    ({**TEXT, "mlp_layer_types": ["sparse"] * 3, "first_k_dense_replace": 1},
     r"^target config.json first_k_dense_replace 1 disagrees with mlp_layer_types \(dense layers \[\];"),
    ({**TEXT, "first_k_dense_replace": -1}, r"^target config.json first_k_dense_replace must be an integer >= 0, got -1$"),
    ({**TEXT, "head_dim": 16}, r"^target config.json head_dim 16 != qk_rope_head_dim 8 "),
    ({**TEXT, "num_nextn_predict_layers": -1},
     r"^target config.json num_nextn_predict_layers must be an integer >= 0, got -1$"),
    ({**TEXT, "num_nextn_predict_layers": None}, r"^target config.json has null num_nextn_predict_layers$"),
    ({**TEXT, "scoring_func": "softmax"}, r"^target config.json scoring_func 'softmax' is not supported"),
    ({**TEXT, "n_group": 3}, r"^target n_group 3 must split n_routed_experts 8"),
    ({**TEXT, "num_key_value_heads": 2}, r"^target num_key_value_heads 2 != num_attention_heads 4"),
    ({**TEXT, "rope_parameters": dict(YARN, partial_rotary_factor=0.5)},
     r"^target partial_rotary_factor 0.5 is not supported for model_type 'glm4_moe_lite'"),
    ({**TEXT, "quantization_config": {"quant_method": "awq", "bits": 4}},
     r"^the target checkpoint is quantized \(quant_method 'awq'\); dflash-torch reads unquantized "
     r"float32/bfloat16/float16 weights only \(and fp8, compressed-tensors, modelopt for this "
     r"model_type\)$"),
])
def test_bad_configs_are_refused_in_one_line(cfg, message):
    with pytest.raises(DFlashError, match=message) as err:
        TargetConfig.from_dict({**cfg, "model_type": "glm4_moe_lite"})
    assert "\n" not in str(err.value)


def test_fp8_checkpoint_equals_transformers_and_packed_equals_dequantized(checkpoint, tmp_path):
    """Fine-grained FP8 (e4m3, blocks of [8, 16], every projection quantized, the router not),
    as DeepSeek-V3's loads: our weights equal those transformers itself loads from the FP8
    checkpoint on the CPU, bit for bit, in float32 and bfloat16 (the router float32 in both),
    and the float32 logits its model's; kept packed (``kv_b_proj`` dequantized when loading)
    the logits equal the dequantized model's bit for bit."""
    import transformers
    from test_fp8 import to_fp8

    from dflash_torch.models import fp8

    target_dir, _ = checkpoint
    quantized = to_fp8(target_dir, tmp_path / "fp8", (8, 16), suffixes=("_proj.weight", "_proj_with_mqa.weight"))
    stored = load_file(str(quantized / "model.safetensors"))
    assert stored["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == fp8.FORMAT
    assert stored["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    for dtype in (torch.float32, torch.bfloat16):
        ours = TargetModel.from_pretrained(quantized, dtype)
        hf = transformers.Glm4MoeLiteForCausalLM.from_pretrained(str(quantized), dtype=dtype,
                                                                 experts_implementation="eager").eval()
        assert_same_weights(ours.state_dict(), hf.state_dict(), dtype)
        assert ours.state_dict()["model.layers.1.mlp.gate.weight"].dtype == torch.float32
        if dtype == torch.float32:
            with torch.no_grad():
                ref = hf(IDS[None]).logits[0]
            torch.testing.assert_close(forward_in_pieces(ours, IDS, [30], False)[0], ref, rtol=1e-4, atol=1e-4)
        packed = TargetModel.from_pretrained(quantized, dtype, fp8="packed")
        layer = packed.model.layers[1]
        assert isinstance(layer.self_attn.q_b_proj, fp8.Fp8Linear) and layer.mlp.experts.fp8_block_cols
        assert layer.self_attn.kv_b_proj.weight.dtype == dtype
        assert torch.equal(forward_in_pieces(packed, IDS, [20, 10], False)[0],
                           forward_in_pieces(ours, IDS, [20, 10], False)[0]), dtype


def test_int4_weights_equal_the_librarys_dequantization_and_packed_the_dequantized(checkpoint, tmp_path):
    """compressed-tensors W4A16 (``pack-quantized``, symmetric, groups of 16; every projection,
    as DeepSeek-V3's loads): dequantized when loading, our weights equal our model loaded from
    compressed-tensors' own dequantization bit for bit, in float32 and bfloat16 (the router
    float32); kept packed (``kv_b_proj`` dequantized when loading), the logits equal the
    dequantized model's bit for bit."""
    from test_packed_int import _packed_layers, library_dequantized, to_packed

    target_dir, _ = checkpoint
    quantized = to_packed(target_dir, tmp_path / "int4", 4, 16, suffixes=("_proj.weight", "_proj_with_mqa.weight"))
    assert load_file(str(quantized / "model.safetensors"))["model.layers.1.mlp.experts.7.down_proj.weight_packed"].dtype \
        == torch.int32
    oracle = library_dequantized(quantized, tmp_path / "oracle", 4, 16)
    for dtype in (torch.float32, torch.bfloat16):
        plain = TargetModel.from_pretrained(quantized, dtype, int_weights="dequantize")
        mine = plain.state_dict()
        assert_same_weights(mine, TargetModel.from_pretrained(oracle, dtype).state_dict(), dtype)
        assert mine["model.layers.1.mlp.gate.weight"].dtype == torch.float32
        packed = TargetModel.from_pretrained(quantized, dtype, int_weights="packed")
        linears, experts = _packed_layers(packed)
        assert linears > 0 and experts == 2 and packed.model.layers[1].self_attn.kv_b_proj.weight.dtype == dtype
        assert torch.equal(forward_in_pieces(packed, IDS, [20, 10], False)[0],
                           forward_in_pieces(plain, IDS, [20, 10], False)[0]), dtype
