"""DeepSeek-V3-architecture targets (``deepseek_v3``, and ``kimi_k25``: Kimi-K2.5's multimodal
wrapper, decoded as text) against transformers' own ``DeepseekV3ForCausalLM`` and
``Kimi_K25ForConditionalGeneration``, on tiny random checkpoints (4 heads, a latent of 32 + 8,
8 experts in 4 groups, 2 groups chosen, 3 experts a token, 2 shared experts, one dense layer
then two mixture-of-experts layers; random norms and score correction biases):

* our forward (latent cache, absorbed attention) == transformers' (logits and every layer's
  output, float32), in one pass, in pieces and with fixed shapes; with and without the
  query's low rank, interleaved RoPE or not, YaRN with DeepSeek's softmax scale or none;
  guards: each of those details changes the logits;
* the cache holds one latent row per token and layer (the real models' sizes computed);
* greedy speculative decoding == transformers' greedy ``generate`` (block sizes, inject and
  recompute, fixed shapes, batched); an agreeable pair accepting many tokens a round
  (eager, chunked prefill, fixed shapes, batched, compiled, prefix reuse);
* Kimi-K2.5's layout (decoder under ``language_model.model.``, vision tower and projector
  not read) == transformers' Kimi class; the multi-token-prediction layer is not read,
  other unknown weights are refused; fine-grained FP8 == transformers' dequantization, and
  kept packed == dequantized bit for bit; bad configs are refused in one line;
* compressed-tensors INT4 (Kimi-K2.5's published format: routed experts in groups of 32; and
  every projection in groups of 16) == compressed-tensors' own dequantization, kept packed ==
  dequantized bit for bit (``kv_b_proj`` dequantized when loading), the memory check's saving
  exact, speculative decoding == target-only; the real model's packed weights: 594.2 GB.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import (EOS_ID, VOCAB, check_compiled_rounds_are_lossless, check_forward_matches_transformers,
                      check_greedy_equals_transformers, check_many_accepted_tokens_are_lossless, copy_tokenizer,
                      assert_same_weights, drafter_config, edited_checkpoint, forward_in_pieces, load_hf,
                      make_agreeable, randomize_moe_weights, save_drafter)
from dflash_torch import DFlashEngine, DFlashError
from dflash_torch.models import deepseek_v3
from dflash_torch.models.config import TargetConfig
from dflash_torch.models.target import TargetModel

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8,
            routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
            qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1,
            max_position_embeddings=1024, rope_parameters=YARN, eos_token_id=EOS_ID, bos_token_id=EOS_ID,
            pad_token_id=EOS_ID, tie_word_embeddings=False)


def make_deepseek_target(out_dir: Path, *, seed: int = 0, **overrides) -> Path:
    """Save a tiny random ``DeepseekV3ForCausalLM`` (:data:`TEXT` plus ``overrides``;
    transformers' eager experts, the oracle's reference loop)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(**{**TEXT, **overrides}, experts_implementation="eager")
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    randomize_moe_weights(model)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


def kimi_model(seed: int = 0):
    """A tiny random ``Kimi_K25ForConditionalGeneration`` (in memory: transformers 5.24 saves
    its decoder under ``language_model.model.blocks.*`` and cannot read that back)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Kimi_K25Config(
        text_config=dict(TEXT, experts_implementation="eager"), tie_word_embeddings=False, projection_hidden_size=32,
        vision_config=dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                           pos_emb_height=4, pos_emb_width=4))
    model = transformers.Kimi_K25ForConditionalGeneration(config).eval()
    randomize_moe_weights(model, "model.language_model.")
    randomize_moe_weights(model, "lm_head.")
    return model


def save_kimi(model, out_dir: Path, *, published: bool = True) -> Path:
    """``model``'s config and weights in Kimi-K2.5's published layout (``language_model.model.*``,
    ``language_model.lm_head.weight``, ``vision_tower.*``, ``mm_projector.*``, one tensor per
    expert), or (``published`` False) as transformers names them in memory
    (``model.language_model.*``, ``lm_head.weight``, ``model.vision_tower.*``, stacked experts)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if published:
        renamed = {}
        for key, t in state.items():
            if key.startswith("model.language_model."):
                key = "language_model.model." + key[len("model.language_model."):]
            elif key == "lm_head.weight":
                key = "language_model.lm_head.weight"
            else:
                key = key.removeprefix("model.")
            if key.endswith("experts.gate_up_proj"):
                inter = t.shape[1] // 2
                for e in range(t.shape[0]):
                    renamed[key.replace("gate_up_proj", f"{e}.gate_proj.weight")] = t[e, :inter].clone()
                    renamed[key.replace("gate_up_proj", f"{e}.up_proj.weight")] = t[e, inter:].clone()
            elif key.endswith("experts.down_proj"):
                for e in range(t.shape[0]):
                    renamed[key.replace("down_proj", f"{e}.down_proj.weight")] = t[e].clone()
            else:
                renamed[key] = t
        state = renamed
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_dir):
    """(target_dir, random drafter_dir, B = 16) of the tiny DeepSeek-V3 target."""
    root = tmp_path_factory.mktemp("deepseek_v3")
    target = make_deepseek_target(root / "target", seed=5)
    copy_tokenizer(tokenizer_dir, target)
    return target, save_drafter(root / "drafter", drafter_config(target, block_size=16), seed=5)


@pytest.fixture(scope="module")
def agree_pair(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("deepseek_v3-agree")
    target = make_deepseek_target(root / "target", seed=1)
    return make_agreeable(target, tokenizer_dir, root, "deepseek_v3", alpha=1.0, beta=5.0, self_scale=0.3)


IDS = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("pieces,static", [([30], False), ([11, 1, 7, 11], False), ([16, 14], True)])
def test_forward_matches_transformers(checkpoint, pieces, static):
    target_dir, _ = checkpoint
    ours = TargetModel.from_pretrained(target_dir, torch.float32)
    assert isinstance(ours, deepseek_v3.Model) and ours.config.moe_layers == [False, True, True]
    check_forward_matches_transformers(ours, load_hf(target_dir), IDS, pieces, static)


@pytest.mark.parametrize("overrides", [dict(q_lora_rank=None), dict(rope_interleave=False),
                                       dict(rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
                                       dict(rope_parameters=dict(YARN, mscale=0.707, mscale_all_dim=0.8, factor=40.0)),
                                       dict(n_group=1, topk_group=1, norm_topk_prob=False, first_k_dense_replace=0,
                                            kv_lora_rank=31, attention_bias=True)],
                         ids=["q_proj", "rope-not-interleaved", "no-rope-scaling", "yarn-attention-factor",
                              "one-group-odd-latent-biases"])
def test_variants_match_transformers(tmp_path, overrides):
    """Queries without the low rank (``q_proj``), RoPE on consecutive halves, plain RoPE
    (softmax scale without DeepSeek's mscale), YaRN whose ``mscale`` and ``mscale_all_dim``
    differ (cos and sin scaled, as DeepSeek-V2 has it), one group of experts without
    renormalisation, every layer a mixture, an odd latent row (41: the cache's value
    half padded), biases on the projections that take them."""
    target_dir = make_deepseek_target(tmp_path / "target", seed=2, **overrides)
    ours = TargetModel.from_pretrained(target_dir, torch.float32)
    check_forward_matches_transformers(ours, load_hf(target_dir), IDS, [17, 13], False)


def test_the_details_matter(checkpoint):
    """Guards the comparisons above: reading pairs of RoPE channels as halves, the softmax
    scale without DeepSeek's mscale, no score correction bias, no group limit, each changes
    the logits (so the comparison can fail)."""
    target_dir, _ = checkpoint
    with torch.no_grad():
        ref = load_hf(target_dir)(IDS[None]).logits[0]
    for change in ("interleave", "scale", "bias", "groups"):
        ours = TargetModel.from_pretrained(target_dir, torch.float32)
        for layer in ours.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if change == "interleave":
                attn.interleave = False
            elif change == "scale":
                attn.scale = (16 + 8) ** -0.5
            elif change == "bias" and isinstance(mlp, deepseek_v3.DeepseekV3MoE):
                mlp.gate.e_score_correction_bias.data.zero_()
            elif change == "groups" and isinstance(mlp, deepseek_v3.DeepseekV3MoE):
                mlp.gate.topk_group = mlp.gate.n_group
        logits, _ = forward_in_pieces(ours, IDS, [30], False)
        assert (logits - ref).abs().max() > 1e-3, change


def test_the_cache_holds_one_latent_row_per_token(checkpoint):
    """Per layer one "head" in each of the key and value buffers, the two halves of the
    40-value latent row; for DeepSeek-V3 / Kimi-K2.5 (61 layers, a latent of 512 + 64), 70,272
    bytes a token in bfloat16, against 4,997,120 / 2,498,560 for their expanded per-head keys
    and values (128 / 64 heads of 192 + 128)."""
    target_dir, _ = checkpoint
    ours = TargetModel.from_pretrained(target_dir, torch.float32)
    assert ours.kv_shapes() == [(1, 20)] * 3
    cache = ours.new_cache()
    cache.reset(8)
    assert [tuple(t.shape) for t in cache.kv.k + cache.kv.v] == [(1, 256, 20)] * 6
    for heads, expanded in ((128, 4_997_120), (64, 2_498_560)):
        cfg = deepseek_v3.parse_config({"model_type": "deepseek_v3", "num_attention_heads": heads,
                                        "n_group": 1, "topk_group": 1})
        with torch.device("meta"):
            model = deepseek_v3.Model(cfg)
        per_token = sum(h * d * 2 for h, d in model.kv_shapes()) * 2  # (bfloat16)
        assert model.kv_shapes() == [(1, 288)] * 61 and per_token == 70_272
        assert 61 * heads * (192 + 128) * 2 == expanded


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


def test_latent_attention_batched_and_chunked_equal_one_pass(monkeypatch):
    """The absorbed attention of N sequences at once equals each alone, in chunks of query
    rows as in one, and equals the definition: per head, softmax(scale * q . [c, k_pe] +
    bias) mixing the rows' c."""
    cfg = deepseek_v3.parse_config({**TEXT, "model_type": "deepseek_v3", "kv_lora_rank": 31})
    attn = deepseek_v3.LatentAttention(cfg)
    g = torch.Generator().manual_seed(0)
    n, tq, tk, heads = 3, 5, 11, cfg.num_attention_heads
    q = torch.randn(heads, n * tq, 39, generator=g)
    latent = torch.randn(n, tk, 39, generator=g)
    k, v = zip(*(attn.halves(latent[i]) for i in range(n)))
    k, v = torch.stack(k), torch.stack(v)  # [N, 1, Tk, 20]
    assert torch.equal(v[..., -1], torch.zeros(n, 1, tk))  # (39 values: the second half padded)
    bias = torch.zeros(n, tq, tk).masked_fill(torch.rand(n, tq, tk, generator=g) < 0.3, float("-inf"))
    bias[..., 0] = 0
    batched = attn.attend(q, k, v, bias)
    for i in range(n):
        one = attn.attend(q[:, i * tq:(i + 1) * tq], k[i], v[i], bias[i])
        torch.testing.assert_close(batched[:, i * tq:(i + 1) * tq], one)
        p = torch.softmax(q[:, i * tq:(i + 1) * tq] @ latent[i].T * attn.scale + bias[i], dim=-1)
        torch.testing.assert_close(one, p @ latent[i, :, :31])
    monkeypatch.setattr(deepseek_v3, "_SCORES_PER_CHUNK", n * heads * tk * 2)  # two query rows a chunk
    torch.testing.assert_close(attn.attend(q, k, v, bias), batched)


def test_bfloat16_speculative_decoding_is_the_target_s_own_but_near_ties(agree_pair):
    """bfloat16: speculative decoding commits target-only decoding's tokens, but where a
    batched verify flips a near-tie of the target (README.md), with drafts accepted."""
    from test_fp8 import bfloat16_near_tie_taus

    assert max(bfloat16_near_tie_taus(agree_pair)) > 4


@pytest.mark.parametrize("published", [True, False], ids=["published-layout", "transformers-names"])
def test_kimi_k25_matches_transformers(tmp_path, published):
    """The Kimi-K2.5 wrapper: its decoder (under ``language_model.model.`` as published, or
    ``model.language_model.``) decodes as transformers' ``Kimi_K25ForConditionalGeneration``
    on text; the vision tower and projector are not read; a missing weight is named as the
    file names it."""
    hf = kimi_model(seed=3)
    target_dir = save_kimi(hf, tmp_path / "kimi", published=published)
    stored = load_file(str(target_dir / "model.safetensors"))
    assert any(k.startswith(("vision_tower.", "model.vision_tower.")) for k in stored)
    ours = TargetModel.from_pretrained(target_dir, torch.float32)
    assert ours.config.model_type == "deepseek_v3" and ours.config.wrapped
    check_forward_matches_transformers(ours, hf, IDS, [20, 10], False)
    decoder, head = ("language_model.model.", "language_model.lm_head.") if published else ("model.language_model.", "lm_head.")
    for key in (decoder + "layers.1.self_attn.kv_b_proj.weight", head + "weight"):  # (named as the file names them)
        bad = edited_checkpoint(target_dir, tmp_path / key, state=lambda w: w.pop(key))
        with pytest.raises(DFlashError, match=rf"^target checkpoint .* lacks weights: {key}$"):
            TargetModel.from_pretrained(bad, torch.float32)


def test_the_multi_token_prediction_layer_is_not_read(checkpoint, tmp_path):
    """A checkpoint with DeepSeek-V3's MTP layer (``model.layers.3.*``: a decoder layer plus
    its own norms, projection and head, as published) decodes as the one without; with
    ``num_nextn_predict_layers`` 0 those weights are unknown and refused, as is any other
    unknown weight; a config that would take a decoder layer for an MTP one is refused."""
    target_dir, _ = checkpoint
    mtp = edited_checkpoint(target_dir, tmp_path / "mtp", state=_with_mtp_layer({}, embed=False))
    assert json.loads((mtp / "config.json").read_text())["num_nextn_predict_layers"] == 1
    with torch.no_grad():
        ref = load_hf(target_dir)(IDS[None]).logits[0]
    logits, _ = forward_in_pieces(TargetModel.from_pretrained(mtp, torch.float32), IDS, [30], False)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    no_mtp = edited_checkpoint(mtp, tmp_path / "no-mtp", config=lambda c: c.update(num_nextn_predict_layers=0))
    with pytest.raises(DFlashError, match=r"^target checkpoint .* has weights this deepseek_v3 model does not use "
                                          r"\(an unsupported variant\?\): model\.layers\.3\."):
        TargetModel.from_pretrained(no_mtp, torch.float32)
    # a config that counts a decoder layer as MTP (num_hidden_layers one short, two MTP layers) would
    # silently drop that layer: refused, since a real MTP layer has eh_proj
    short = edited_checkpoint(mtp, tmp_path / "short", config=lambda c: c.update(num_hidden_layers=2,
                                                                                  num_nextn_predict_layers=2))
    with pytest.raises(DFlashError, match=r"^target checkpoint .*: layer 2 is past num_hidden_layers 2 within "
                                          r"num_nextn_predict_layers 2, but has no eh_proj\.weight: not a multi-token-"
                                          r"prediction layer \(check num_hidden_layers and num_nextn_predict_layers\)$"):
        TargetModel.from_pretrained(short, torch.float32)
    extra = edited_checkpoint(target_dir, tmp_path / "extra",
                              state=lambda w: w.update({"model.layers.1.self_attn.k_norm.weight": torch.ones(8)}))
    with pytest.raises(DFlashError, match=r"does not use .*: model\.layers\.1\.self_attn\.k_norm\.weight$"):
        TargetModel.from_pretrained(extra, torch.float32)


def _with_mtp_layer(extra: dict, embed: bool = True, layer: dict | None = None):
    """A ``state`` edit for :func:`edited_checkpoint`: an MTP layer 3 as published (a copy of
    decoder layer 2, of ``layer``'s tensors where given, else the checkpoint's; its norms,
    ``eh_proj``, head and, with ``embed``, embedding), plus ``extra``."""
    def add(w):
        source = w if layer is None else layer
        for key in [k for k in source if k.startswith("model.layers.2.")]:
            w[key.replace("model.layers.2.", "model.layers.3.")] = source[key].clone()
        for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            w[f"model.layers.3.{name}"] = torch.ones(64)
        w["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
        w["model.layers.3.shared_head.head.weight"] = torch.zeros(VOCAB, 64)
        if embed:
            w["model.layers.3.embed_tokens.weight"] = torch.zeros(VOCAB, 64)
        w.update(extra)
    return add


def test_an_mtp_layer_holds_only_what_one_holds(checkpoint, tmp_path):
    """The MTP layer is not read, but not skipped unseen either: a tensor of a module neither a
    decoder layer nor an MTP layer's own parts have is refused as other unknown weights are
    (kimi_k25, glm4_moe_lite, deepseek_v32 and glm_moe_dsa share this check). An MTP layer
    that a quantizer left out (plain ``.weight`` where the decoder layers hold INT4
    ``weight_packed`` and scales) loads (trial-192: it was refused for names and shapes the
    decoder layers do not have)."""
    target_dir, _ = checkpoint
    TargetModel.from_pretrained(edited_checkpoint(target_dir, tmp_path / "mtp", state=_with_mtp_layer({})), torch.float32)
    junk = edited_checkpoint(target_dir, tmp_path / "junk",
                             state=_with_mtp_layer({"model.layers.3.totally_unknown.weight": torch.zeros(3)}))
    with pytest.raises(DFlashError, match=r"^target checkpoint .* has weights a multi-token-prediction layer does not "
                                          r"hold \(an unsupported variant\?\): model\.layers\.3\.totally_unknown\.weight$"):
        TargetModel.from_pretrained(junk, torch.float32)
    packed = int4(target_dir, tmp_path / "int4", 16, EVERY_LAYER)
    assert any(k.endswith("weight_packed") for k in load_file(str(packed / "model.safetensors")))
    plain = load_file(str(target_dir / "model.safetensors"))
    left_out = edited_checkpoint(packed, tmp_path / "int4-mtp", state=_with_mtp_layer({}, layer=plain))
    TargetModel.from_pretrained(left_out, torch.float32)


def test_a_kimi_k25_mtp_layer_is_checked_under_its_published_names(tmp_path):
    """Kimi-K2.5's MTP layer (``language_model.model.layers.{N}``) is checked as DeepSeek-V3's,
    named in messages as the file names it."""
    target_dir = save_kimi(kimi_model(seed=3), tmp_path / "kimi")
    prefix = "language_model.model.layers."

    def add_mtp(w):
        for key in [k for k in w if k.startswith(prefix + "2.")]:
            w[key.replace(prefix + "2.", prefix + "3.")] = w[key].clone()
        w[prefix + "3.eh_proj.weight"] = torch.zeros(64, 128)
        w[prefix + "3.totally_unknown.weight"] = torch.zeros(3)

    def announce(cfg):
        cfg["text_config"]["num_nextn_predict_layers"] = 1

    junk = edited_checkpoint(target_dir, tmp_path / "junk", config=announce, state=add_mtp)
    with pytest.raises(DFlashError, match=r"does not hold \(an unsupported variant\?\): "
                                          r"language_model\.model\.layers\.3\.totally_unknown\.weight$"):
        TargetModel.from_pretrained(junk, torch.float32)


def test_fp8_checkpoint_equals_transformers_dequantized(checkpoint, tmp_path):
    """DeepSeek-V3's official FP8 format (e4m3 with block scales; every projection quantized,
    the router not). Blocks of [8, 16], whole in every matrix: our weights equal those
    transformers itself loads from the FP8 checkpoint on the CPU, bit for bit, in float32 and
    bfloat16 (the router float32 in both), and the float32 logits its model's. Blocks of
    [24, 40], partial at the edges (which transformers' CPU loading cannot read): our weights
    equal transformers' dequantizer's (``_dequantize_fp8_weight``). Kept packed
    (``fp8="packed"``: FP8 linears and experts, ``kv_b_proj`` dequantized when loading since
    the absorbed attention reads it per head), the logits equal the dequantized model's bit
    for bit, in float32 and bfloat16."""
    import transformers
    from test_fp8 import dequantized_copy, to_fp8

    from dflash_torch.models import fp8

    target_dir, _ = checkpoint
    for block in ((8, 16), (24, 40)):
        quantized = to_fp8(target_dir, tmp_path / f"fp8-{block[0]}", block,
                           suffixes=("_proj.weight", "_proj_with_mqa.weight"))
        stored = load_file(str(quantized / "model.safetensors"))
        assert stored["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].dtype == fp8.FORMAT
        assert stored["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == fp8.FORMAT
        assert stored["model.layers.1.mlp.gate.weight"].dtype == torch.float32
        oracle = quantized if block == (8, 16) else dequantized_copy(quantized, tmp_path / f"dequantized-{block[0]}")
        for dtype in (torch.float32, torch.bfloat16):
            ours = TargetModel.from_pretrained(quantized, dtype)
            hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(oracle), dtype=dtype,
                                                                    experts_implementation="eager").eval()
            mine, theirs = ours.state_dict(), hf.state_dict()
            assert_same_weights(mine, theirs, block, dtype)
            if dtype == torch.float32:
                with torch.no_grad():
                    ref = hf(IDS[None]).logits[0]
                torch.testing.assert_close(forward_in_pieces(ours, IDS, [30], False)[0], ref, rtol=1e-4, atol=1e-4)
            packed = TargetModel.from_pretrained(quantized, dtype, fp8="packed")
            layer = packed.model.layers[1]
            assert isinstance(layer.self_attn.q_b_proj, fp8.Fp8Linear) and layer.mlp.experts.fp8_block_cols
            assert layer.self_attn.kv_b_proj.weight.dtype == dtype and layer.mlp.gate.weight.dtype == torch.float32
            assert torch.equal(forward_in_pieces(packed, IDS, [20, 10], False)[0],
                               forward_in_pieces(ours, IDS, [20, 10], False)[0]), (block, dtype)


def test_bfloat16_keeps_the_router_in_float32_as_transformers(checkpoint):
    """In bfloat16 the router's weight and score correction bias stay float32 (transformers'
    ``_keep_in_fp32_modules_strict``); everything else is bfloat16."""
    import transformers

    target_dir, _ = checkpoint
    ours = TargetModel.from_pretrained(target_dir, torch.bfloat16)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(target_dir), dtype=torch.bfloat16)
    theirs = hf.state_dict()
    mine = ours.state_dict()
    for key in ("model.layers.1.mlp.gate.weight", "model.layers.2.mlp.gate.e_score_correction_bias"):
        assert mine[key].dtype == theirs[key].dtype == torch.float32 and torch.equal(mine[key], theirs[key])
    assert mine["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.bfloat16


# DeepSeek-V3's published config.json (its official weights are FP8; auto_map left out)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280}


def test_deepseek_v3_s_published_config_is_read():
    """The FP8 block, the routing, the dense first layers, the MTP layer to skip, YaRN with
    DeepSeek's softmax scale (192 ** -0.5 * (0.1 ln 40 + 1) ** 2, transformers' value) and
    transformers' RoPE tables."""
    import math

    import transformers

    cfg = TargetConfig.from_dict(DEEPSEEK_V3)
    assert cfg.fp8_block == (128, 128) and cfg.moe_layers[:4] == [False, False, False, True]
    assert (cfg.n_group, cfg.topk_group, cfg.moe.top_k, cfg.num_nextn_predict_layers) == (8, 4, 8, 1)
    assert abs(cfg.softmax_scale - 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2) < 1e-12
    hf_config = transformers.DeepseekV3Config(**{k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"})
    hf_rope = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding(hf_config)
    with torch.device("meta"):
        model = deepseek_v3.Model(cfg)
    ours = model.make_rotary()
    # (inv_freq: ours computed in float64 then rounded, transformers' in float32: a few ulp apart, as test_rope)
    torch.testing.assert_close(ours.inv_freq, hf_rope.inv_freq, rtol=1e-6, atol=0)
    assert ours.attention_factor == hf_rope.attention_scaling
    assert model.model.layers[60].self_attn.scale == transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(
        hf_config, 0).scaling


def _kimi_config(**text):
    return {"model_type": "kimi_k25", "text_config": {"model_type": "deepseek_v3", **TEXT, **text}}


@pytest.mark.parametrize("cfg,message", [
    ({**TEXT, "model_type": "deepseek_v3", "scoring_func": "softmax"},
     r"^target config.json scoring_func 'softmax' is not supported \(DeepSeek-V3 routing: sigmoid\)$"),
    ({**TEXT, "model_type": "deepseek_v3", "topk_method": "group_limited_greedy"},
     r"^target config.json topk_method 'group_limited_greedy' is not supported"),
    ({**TEXT, "model_type": "deepseek_v3", "moe_layer_freq": 2}, r"^target config.json moe_layer_freq 2 is not supported"),
    ({**TEXT, "model_type": "deepseek_v3", "num_key_value_heads": 2}, r"^target num_key_value_heads 2 != num_attention_heads 4"),
    ({**TEXT, "model_type": "deepseek_v3", "n_group": 3}, r"^target n_group 3 must split n_routed_experts 8"),
    ({**TEXT, "model_type": "deepseek_v3", "topk_group": 1, "num_experts_per_tok": 3},
     r"^target num_experts_per_tok 3 and topk_group 1 must fit in n_group 4 groups of 2 experts$"),
    ({**TEXT, "model_type": "deepseek_v3", "n_group": None}, r"^target config.json has null n_group$"),
    ({**TEXT, "model_type": "deepseek_v3", "qk_rope_head_dim": 7}, r"^target qk_rope_head_dim 7 must be even"),
    ({**TEXT, "model_type": "deepseek_v3", "first_k_dense_replace": -1},
     r"^target config.json first_k_dense_replace must be an integer >= 0, got -1$"),
    ({**TEXT, "model_type": "deepseek_v3", "rope_parameters": dict(YARN, partial_rotary_factor=0.5)},
     r"^target partial_rotary_factor 0.5 is not supported for model_type 'deepseek_v3'"),
    ({"model_type": "kimi_k25"}, r"^target config.json of model_type 'kimi_k25' lacks text_config$"),
    ({"model_type": "kimi_k25", "text_config": {"model_type": "qwen3"}},
     r"^target config.json of model_type 'kimi_k25' has a text_config of model_type 'qwen3'; expected deepseek_v3$"),
    ({**_kimi_config(), "quantization_config": {"quant_method": "awq", "bits": 4}},
     r"^the target checkpoint is quantized \(quant_method 'awq'\); dflash-torch reads unquantized "
     r"float32/bfloat16/float16 weights only \(and fp8, compressed-tensors, modelopt for this "
     r"model_type\)$"),
    ({**_kimi_config(), "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized"}},
     r"^the target checkpoint's compressed-tensors quantization_config has no config_groups$"),
])
def test_bad_configs_are_refused_in_one_line(cfg, message):
    with pytest.raises(DFlashError, match=message) as err:
        TargetConfig.from_dict(cfg)
    assert "\n" not in str(err.value)


def test_kimi_config_reads_the_text_config_and_the_wrapper_head():
    """The wrapper's ``tie_word_embeddings`` governs its head (default true, as transformers'
    ``Kimi_K25Config``); the wrapper's ``eos_token_id`` serves where the text config has
    none; an older text config's ``kimi_k2`` reads as ``deepseek_v3``; keys left out take
    transformers' defaults (Kimi-K2.5's published text config, shapes abridged)."""
    text = {k: v for k, v in TEXT.items() if k not in ("eos_token_id", "tie_word_embeddings")}
    cfg = TargetConfig.from_dict({"model_type": "kimi_k25", "eos_token_id": 7,
                                  "text_config": {**text, "model_type": "kimi_k2"}})
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == [7] and cfg.checkpoint_prefix == "language_model.model."
    defaults = TargetConfig.from_dict({"model_type": "deepseek_v3"})
    assert (defaults.num_hidden_layers, defaults.kv_lora_rank, defaults.q_lora_rank, defaults.n_group,
            defaults.moe.num_experts, defaults.moe_layers[:4], defaults.num_nextn_predict_layers) == (
        61, 512, 1536, 8, 256, [False, False, False, True], 1)
    kimi = TargetConfig.from_dict({"model_type": "kimi_k25", "tie_word_embeddings": False, "text_config": {
        "model_type": "kimi_k2", "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 384,
        "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.827,
        "vocab_size": 163840, "max_position_embeddings": 262144, "num_nextn_predict_layers": 0,
        "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}, "rope_theta": 50000.0}})
    m = 0.1 * __import__("math").log(64.0) + 1
    assert not kimi.tie_word_embeddings and abs(kimi.softmax_scale - 192 ** -0.5 * m * m) < 1e-12


# --- compressed-tensors INT4 (Kimi-K2.5's published weights: its routed experts, groups of 32) ---

KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
ROUTED = lambda key: ".experts." in key  # noqa: E731  (not .shared_experts.)
# attention, the dense MLP, shared and routed experts (and the projections of Kimi's vision tower, not read)
EVERY_LAYER = lambda key: ".layers." in key  # noqa: E731
INT4_CASES = {  # layout, group, what is quantized, where the quantization_config sits
    "deepseek-experts-g32": ("deepseek", 32, ROUTED, "top"),
    "kimi-experts-g32-in-text-config": ("kimi", 32, ROUTED, "text_config"),
    "kimi-every-layer-g16": ("kimi", 16, EVERY_LAYER, "top"),
}


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory, tokenizer_dir):
    """A tiny Kimi-K2.5 in its published layout (one tensor per expert), with a tokenizer."""
    target = save_kimi(kimi_model(seed=3), tmp_path_factory.mktemp("kimi") / "target")
    copy_tokenizer(tokenizer_dir, target)
    return target


def int4(src: Path, dst: Path, group: int, which, where: str = "top") -> Path:
    """``src`` with the projections ``which`` accepts (``kv_a_proj_with_mqa`` too) INT4,
    symmetric, in groups of ``group``, packed by compressed-tensors; Kimi-K2.5's
    quantization_config (its ``ignore`` list when only the routed experts are quantized), at
    the top level or in the ``text_config``."""
    from test_packed_int import scheme, to_packed

    out = to_packed(src, dst, 4, group, which=which, suffixes=("_proj.weight", "_proj_with_mqa.weight"))
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]
    quant = scheme(4, group, KIMI_IGNORE if which is ROUTED else ["lm_head"])
    (cfg["text_config"] if where == "text_config" else cfg)["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _int4_case(case: str, checkpoint, kimi_dir, tmp_path) -> tuple[Path, Path, int, bool, str]:
    """(source, quantized checkpoint, group, attention quantized, decoder prefix in the file)."""
    layout, group, which, where = INT4_CASES[case]
    src = checkpoint[0] if layout == "deepseek" else kimi_dir
    prefix = "model." if layout == "deepseek" else "language_model.model."
    return src, int4(src, tmp_path / "int4", group, which, where), group, which is EVERY_LAYER, prefix


@pytest.mark.parametrize("case", list(INT4_CASES))
def test_int4_weights_equal_the_librarys_dequantization(checkpoint, kimi_dir, tmp_path, case):
    """Dequantized when loading (``int_weights="dequantize"``): every weight equals our model
    loaded from compressed-tensors' own dequantization of the checkpoint, bit for bit, in
    float32 and bfloat16 (the router float32 in both); the quantized ones differ from the
    unquantized source (the test sees the rounding)."""
    from test_packed_int import library_dequantized

    src, quantized, group, attention, prefix = _int4_case(case, checkpoint, kimi_dir, tmp_path)
    stored = load_file(str(quantized / "model.safetensors"))
    assert stored[prefix + "layers.2.mlp.experts.7.down_proj.weight_packed"].dtype == torch.int32
    assert (prefix + "layers.1.self_attn.kv_b_proj.weight_packed" in stored) == attention
    assert (prefix + "layers.1.mlp.shared_experts.up_proj.weight_packed" in stored) == attention
    assert TargetConfig.from_dict(json.loads((quantized / "config.json").read_text())).int_quant == (4, group)
    oracle = library_dequantized(quantized, tmp_path / "oracle", 4, group)
    for dtype in (torch.float32, torch.bfloat16):
        mine = TargetModel.from_pretrained(quantized, dtype, int_weights="dequantize").state_dict()
        theirs = TargetModel.from_pretrained(oracle, dtype).state_dict()
        assert_same_weights(mine, theirs, dtype)
        assert mine["model.layers.1.mlp.gate.weight"].dtype == torch.float32
        if dtype == torch.float32:
            original = TargetModel.from_pretrained(src, dtype).state_dict()
            for key, rounded in (("model.layers.1.mlp.experts.gate_up_proj", True),
                                 ("model.layers.1.self_attn.kv_b_proj.weight", attention)):
                assert torch.equal(mine[key], original[key]) != rounded, key


@pytest.mark.parametrize("case", list(INT4_CASES))
def test_int4_kept_packed_gives_the_dequantized_model_bit_for_bit(checkpoint, kimi_dir, tmp_path, case):
    """Kept packed (``int_weights="packed"``): the routed experts as int32 words, every other
    quantized linear an IntLinear, ``kv_b_proj`` (read per head by the absorbed attention)
    dequantized when loading; the logits equal the dequantized model's bit for bit, in float32
    and bfloat16; the memory check's saving (:func:`~dflash_torch.checkpoint.int_saving` of what
    stays packed) is exactly what the packed model saves."""
    from test_packed_int import _packed_layers

    from dflash_torch import checkpoint as ckpt
    from dflash_torch.models.moe import Experts
    from dflash_torch.models.packed_int import IntLinear

    _, quantized, group, attention, prefix = _int4_case(case, checkpoint, kimi_dir, tmp_path)
    stored = load_file(str(quantized / "model.safetensors"))
    linears = sum(k.startswith(prefix) and k.endswith("_packed") and ".experts." not in k and "kv_b_proj" not in k
                  for k in stored)
    for dtype in (torch.float32, torch.bfloat16):
        plain = TargetModel.from_pretrained(quantized, dtype, int_weights="dequantize")
        packed = TargetModel.from_pretrained(quantized, dtype, int_weights="packed")
        assert packed.config.keep_int and not plain.config.keep_int
        assert _packed_layers(packed) == (linears, 2) and (linears > 0) == attention
        for layer in packed.model.layers[1:]:
            e = layer.mlp.experts
            assert isinstance(e, Experts) and (e.int_bits, e.int_group) == (4, group)
            assert e.gate_up_proj.dtype == e.down_proj.dtype == torch.int32 and e.gate_up_proj.shape == (8, 64, 8)
        layer = packed.model.layers[1]
        attn = layer.self_attn
        assert type(attn.kv_b_proj) is deepseek_v3._KvUpProjection and attn.kv_b_proj.weight.dtype == dtype
        assert torch.equal(attn.kv_b_proj.weight, plain.model.layers[1].self_attn.kv_b_proj.weight)
        for module in (attn.q_a_proj, attn.q_b_proj, attn.kv_a_proj_with_mqa, attn.o_proj,
                       layer.mlp.shared_experts.down_proj, packed.model.layers[0].mlp.gate_proj):
            assert isinstance(module, IntLinear) == attention and (attention or type(module) is torch.nn.Linear)
        assert layer.mlp.gate.weight.dtype == torch.float32 and type(packed.lm_head) is torch.nn.Linear
        assert torch.equal(forward_in_pieces(packed, IDS, [20, 10], False)[0],
                           forward_in_pieces(plain, IDS, [20, 10], False)[0]), dtype
        cfg, model_cls = packed.config, type(packed)
        saving = ckpt.int_saving(quantized, dtype, 4, group, lambda k: model_cls.checkpoint_keys(cfg, k)
                                 and not model_cls.dequantized_keys(cfg, k))
        assert saving == ckpt.weight_bytes(plain, dtype) - ckpt.weight_bytes(packed, dtype) > 0


def test_speculative_decoding_on_a_packed_int4_kimi_equals_target_only(kimi_dir, tmp_path):
    """A Kimi-K2.5 layout whose every layer is INT4 (experts, attention, dense and shared MLPs)
    kept packed: greedy speculative decoding (one sequence, and a batch of two) == target-only
    decoding of the dequantized model."""
    quantized = int4(kimi_dir, tmp_path / "int4", 16, EVERY_LAYER)
    drafter = save_drafter(tmp_path / "drafter", drafter_config(quantized, block_size=8), seed=4)
    packed = DFlashEngine.from_pretrained(quantized, drafter, dtype="float32", int_weights="packed")
    assert packed.target.config.keep_int and packed.target.model.layers[2].mlp.experts.int_bits == 4
    plain = DFlashEngine.from_pretrained(quantized, None, dtype="float32", no_draft=True, int_weights="dequantize")
    prompts = ("def f(x):", "import os\n")
    refs = [plain.generate(p, max_new_tokens=24, ignore_eos=True).token_ids for p in prompts]
    assert [packed.generate(p, max_new_tokens=24, ignore_eos=True).token_ids for p in prompts] == refs
    batch = DFlashEngine(packed.target, packed.tokenizer, packed.drafter, max_batch_size=2, max_context=128)
    assert [o.token_ids for o in batch.generate_batch(list(prompts), max_new_tokens=24, ignore_eos=True)] == refs


def test_kimi_k25_s_weights_held_packed_take_594_gb():
    """Kimi-K2.5's published shapes (hidden 7168, 61 layers, the first dense, 384 routed experts
    of 2048, one shared, vocab 163840, MLA ranks 1536 / 512, 64 heads) with its routed experts
    kept packed (INT4 words, bfloat16 scales per 32 columns, as stored) and everything else bfloat16: the
    README's figure. Dequantized to bfloat16 they would take 2.05 TB."""
    from dflash_torch import checkpoint as ckpt
    from dflash_torch.models.moe import Experts

    cfg = TargetConfig.from_dict({"model_type": "kimi_k25", "tie_word_embeddings": False, "text_config": {
        "model_type": "kimi_k2", "hidden_size": 7168, "num_hidden_layers": 61, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 384,
        "num_experts_per_tok": 8, "n_shared_experts": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_group": 1, "topk_group": 1,
        "first_k_dense_replace": 1, "vocab_size": 163840, "num_nextn_predict_layers": 0,
        "quantization_config": dict(INT4_KIMI, ignore=KIMI_IGNORE)}})
    assert cfg.int_quant == (4, 32)
    with torch.device("meta"):
        model = deepseek_v3.Model(cfg)
    routed = sum(p.numel() for m in model.modules() if isinstance(m, Experts) for p in m.parameters())
    assert routed == 60 * 384 * 3 * 7168 * 2048
    assert ckpt.weight_bytes(model, torch.bfloat16) == 2_052_816_464_896
    for m in model.modules():
        if isinstance(m, Experts):
            m.keep_int(*cfg.int_quant, torch.bfloat16)
    rest = 2_052_816_464_896 - 2 * routed  # (bfloat16: embeddings, head, attention, dense and shared MLPs, routers)
    assert ckpt.weight_bytes(model, torch.bfloat16) == rest + routed // 2 + routed // 32 * 2 == 594_205_305_856


INT4_KIMI = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                 "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                 "dynamic": False, "actorder": None, "observer": "minmax"}, "input_activations": None,
                 "output_activations": None}}, "kv_cache_scheme": None}
