"""MiMo-V2-Flash targets (``mimo_v2_flash``) against transformers' own ``MiMoV2FlashForCausalLM``.

* our forward == transformers' (logits and every layer's output, float32, within 1e-5), in
  one pass, in pieces and with fixed shapes, over 30 tokens with a sliding window of 8: full
  and sliding layers (twice the key/value heads, attention sinks), keys 24 wide and values 16
  (cached as two halves of 20), partial RoPE per layer type, the value scale, a group-limited
  router with a routed scale; and variants (values wider than keys, an odd row, biases, no
  value scale, the published config's own keys with ``sliding_window_size``); dropping the
  sinks, the value scale, the partial rotation, the window or the routed scale each moves the
  logits, so the comparison has power;
* the published shapes as transformers reads the published config (window 129, RoPE over
  64 of 192 channels, 4 / 8 key/value heads), every weight's shape transformers', and the KV
  cache's bytes a token;
* checkpoints: per-expert or stacked experts, the sinks under either name (not both), the
  multi-token-prediction layers under ``model.mtp.`` skipped and nothing else; FP8 blocks
  dequantized as transformers dequantizes them, packed == dequantized; scales that do not
  tile a weight refused;
* greedy speculative decoding == transformers' greedy ``generate``; an agreeable pair is
  lossless eager, chunked, fixed shapes, batched, compiled (no recompile), with prefix reuse;
* config errors and unknown weights are refused in one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import (EOS_ID, VOCAB, check_compiled_rounds_are_lossless, check_forward_matches_transformers,
                      check_greedy_equals_transformers, check_many_accepted_tokens_are_lossless, copy_tokenizer,
                      drafter_config, edited_checkpoint, forward_in_pieces, load_hf, make_agreeable, save_drafter)
from dflash_torch import DFlashError
from dflash_torch.models import fp8, registry
from dflash_torch.models.target import TargetModel

IDS = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(1))
ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.334},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.334}}
# the published config.json (XiaomiMiMo/MiMo-V2-Flash), FP8 quantization left out
PUBLISHED = {
    "architectures": ["MiMoV2FlashForCausalLM"], "model_type": "mimo_v2_flash", "vocab_size": 152576,
    "hidden_size": 4096, "num_hidden_layers": 48, "num_attention_heads": 64, "num_key_value_heads": 4,
    "head_dim": 192, "v_head_dim": 128, "swa_num_attention_heads": 64, "swa_num_key_value_heads": 8,
    "swa_head_dim": 192, "swa_v_head_dim": 128, "partial_rotary_factor": 0.334, "rope_theta": 5000000,
    "swa_rope_theta": 10000, "sliding_window": 128, "sliding_window_size": 128, "attention_chunk_size": 128,
    "hybrid_layer_pattern": [0 if i == 0 or (i + 1) % 6 == 0 else 1 for i in range(48)],
    "moe_layer_freq": [0] + [1] * 47, "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
    "intermediate_size": 16384, "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
    "routed_scaling_factor": None, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 1,
    "topk_group": 1, "norm_topk_prob": True, "n_shared_experts": None, "layernorm_epsilon": 1e-5,
    "attention_value_scale": 0.707, "max_position_embeddings": 262144, "tie_word_embeddings": False}


def make_mimo_target(out_dir: Path, *, seed: int = 0, **overrides) -> Path:
    """Save a tiny random MiMo-V2-Flash target with transformers' ``MiMoV2FlashForCausalLM``:
    4 layers (full, sliding, sliding, full; window 8), 4 query heads, 1 key/value head on full
    layers and 2 on sliding ones, keys 24 wide and values 16, RoPE over 8 channels (0.334),
    8 experts (top 2) in 2 groups (1 kept) after a dense first layer, routed scale 2; random
    norm weights, sinks (N(0, 1)) and routing biases. ``overrides``: config fields."""
    import transformers

    torch.manual_seed(seed)
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=1, head_dim=24, v_head_dim=16, sliding_window=8,
               layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
               rope_parameters=ROPE, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2,
               topk_group=1, routed_scaling_factor=2.0, max_position_embeddings=2048, eos_token_id=EOS_ID,
               bos_token_id=EOS_ID, pad_token_id=EOS_ID, experts_implementation="eager")
    cfg.update(overrides)
    model = transformers.MiMoV2FlashForCausalLM(transformers.MiMoV2FlashConfig(**cfg)).eval()
    with torch.no_grad():  # larger-than-default weights give peaked, less tie-prone logits
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif name.endswith("norm.weight"):
                p.normal_(1, 0.2)
            elif name.endswith(("sinks", ".bias")):
                p.normal_(0, 1.0 if name.endswith("sinks") else 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_dir):
    """(target_dir, random drafter_dir) of a tiny MiMo-V2-Flash target."""
    root = tmp_path_factory.mktemp("mimo")
    target = make_mimo_target(root / "target", seed=5)
    copy_tokenizer(tokenizer_dir, target)
    return target, save_drafter(root / "drafter", drafter_config(target, block_size=16), seed=5)


@pytest.fixture(scope="module")
def model(checkpoint):
    return TargetModel.from_pretrained(checkpoint[0], torch.float32)


@pytest.fixture(scope="module")
def hf_logits(checkpoint):
    with torch.no_grad():
        return load_hf(checkpoint[0])(IDS[None]).logits[0]


def _logits(model, pieces=(30,), static=False) -> torch.Tensor:
    return forward_in_pieces(model, IDS, list(pieces), static)[0]


@pytest.mark.parametrize("pieces,static", [([30], False), ([11, 1, 7, 11], False), ([16, 14], True)])
def test_forward_matches_transformers(checkpoint, model, pieces, static):
    assert registry.family("mimo_v2_flash").Model is type(model)
    assert model.kv_shapes() == [(1, 20), (2, 20), (2, 20), (1, 20)] and model.kv_windows() == [None, 8, 8, None]
    assert model.attention_masks == ((None, 4), (8, 2))
    assert {k: r.rotary_dim for k, r in model.rotary.items()} == {"full_attention": 8, "sliding_attention": 8}
    assert [layer.mlp.__class__.__name__ for layer in model.model.layers] == ["MLP"] + ["MiMoMoE"] * 3
    assert [layer.self_attn.sinks is not None for layer in model.model.layers] == [False, True, True, False]
    ref = check_forward_matches_transformers(model, load_hf(checkpoint[0]), IDS, pieces, static)
    assert (_logits(model, pieces, static) - ref.logits[0]).abs().max() < 1e-5


@pytest.mark.parametrize("overrides", [
    dict(head_dim=12, v_head_dim=20, attention_bias=True),  # values wider than keys, q/k/v biases
    dict(head_dim=24, v_head_dim=15, attention_value_scale=None),  # an odd row (padded), no value scale
    dict(rope_parameters=None, sliding_window_size=5, num_attention_heads=8, num_key_value_heads=2, n_group=1,
         routed_scaling_factor=None, mlp_layer_types=["sparse", "dense", "sparse", "sparse"]),
], ids=["wide-values", "odd-row", "defaults"])
def test_variants_match_transformers(tmp_path, overrides):
    target = make_mimo_target(tmp_path / "target", seed=7, **overrides)
    ours = TargetModel.from_pretrained(target, torch.float32)
    if "sliding_window_size" in overrides:  # (transformers: size + 1)
        assert ours.kv_windows() == [None, 6, 6, None] and ours.config.rope == {
            "full_attention": (5e6, 0.334), "sliding_attention": (1e4, 0.334)}
    ref = check_forward_matches_transformers(ours, load_hf(target), IDS, [13, 17], False)
    assert (_logits(ours, [13, 17]) - ref.logits[0]).abs().max() < 1e-5


def test_the_published_keys_read_as_transformers_reads_them(checkpoint, hf_logits, tmp_path):
    """The published config's own keys (hybrid_layer_pattern, moe_layer_freq, swa_* shapes,
    rope_theta / swa_rope_theta / partial_rotary_factor, layernorm_epsilon, the sink flags,
    sliding_window_size) beside transformers' ones, agreeing: the same logits."""
    def published(c):
        c.update(hybrid_layer_pattern=[0, 1, 1, 0], moe_layer_freq=[0, 1, 1, 1], swa_num_attention_heads=4,
                 swa_num_key_value_heads=2, swa_head_dim=24, swa_v_head_dim=16, rope_theta=5000000,
                 swa_rope_theta=10000, partial_rotary_factor=0.334, layernorm_epsilon=1e-5,
                 add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False, sliding_window_size=7,
                 scoring_func="sigmoid", topk_method="noaux_tc", n_shared_experts=None)

    ours = TargetModel.from_pretrained(edited_checkpoint(checkpoint[0], tmp_path / "hub", config=published),
                                       torch.float32)
    assert ours.kv_windows() == [None, 8, 8, None]
    assert (_logits(ours) - hf_logits).abs().max() < 1e-5


@pytest.mark.parametrize("change", ["no sinks", "no value scale", "whole-head rope", "no window", "no routed scale"])
def test_each_mimo_part_matters(checkpoint, hf_logits, change):
    """Guards the comparisons above: each part changed alone moves the logits off transformers'."""
    from dflash_torch.models.rope import Rotary

    ours = TargetModel.from_pretrained(checkpoint[0], torch.float32)
    for layer in ours.model.layers:
        if change == "no sinks":
            layer.self_attn.sinks = None
        elif change == "no value scale":
            layer.self_attn.value_scale = 1.0
        elif change == "no window":
            layer.sliding_window = None
        elif change == "no routed scale" and hasattr(layer.mlp, "gate"):
            layer.mlp.gate.scaling = 1.0
    if change == "no window":
        ours.attention_masks = ((None, 4), (None, 2))
    if change == "whole-head rope":
        ours.rotary = torch.nn.ModuleDict({k: Rotary(24, t, None) for k, (t, _) in ours.config.rope.items()})
    assert (_logits(ours) - hf_logits).abs().max() > 1e-3


def test_bfloat16_routing_matches_transformers(checkpoint, model):
    """In bfloat16 a sparse layer's router picks transformers' experts with its weights bit for
    bit (float32 router weights, as transformers keeps them); the logits stay within
    bfloat16 rounding of transformers'."""
    import transformers

    hf = transformers.MiMoV2FlashForCausalLM.from_pretrained(str(checkpoint[0]), dtype=torch.bfloat16).eval()
    ours = TargetModel.from_pretrained(checkpoint[0], torch.bfloat16)
    assert ours.model.layers[1].mlp.gate.weight.dtype == hf.model.layers[1].mlp.gate.weight.dtype == torch.float32
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.no_grad():
        for i in (1, 3):
            _, ref_weights, ref_experts = hf.model.layers[i].mlp.gate(x)
            weights, experts = ours.model.layers[i].mlp.gate(x)
            order, ref_order = experts.sort(dim=-1), ref_experts.sort(dim=-1)
            assert torch.equal(order.values, ref_order.values)
            assert torch.equal(weights.gather(1, order.indices), ref_weights.gather(1, ref_order.indices))
        ref = hf(IDS[None]).logits[0].float()
    torch.testing.assert_close(_logits(ours).float(), ref, rtol=0.05, atol=0.05)


# --- the published shapes ---


def test_published_shapes_as_transformers_builds_them():
    """The published config (with its FP8 quantization_config, 128 x 128 blocks): windows of 129 (sliding_window_size 128 + 1), RoPE over 64 of 192
    channels (5e6 on full layers, 1e4 on sliding ones), 4 / 8 key/value heads, 9 full layers;
    every weight has transformers' shape (both built on the meta device); the KV cache holds
    320 values per key/value head and token, 222,720 bytes a token in bfloat16 with every
    position kept, and beside the sliding layers' rings 23,040 (the full layers')."""
    import transformers

    from dflash_torch.cache import cache_bytes
    from dflash_torch.models.config import TargetConfig
    from dflash_torch.models.mimo_v2_flash import Model

    cfg = TargetConfig.from_dict(dict(PUBLISHED))
    quantized = TargetConfig.from_dict({**PUBLISHED, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}})
    assert quantized.fp8_block == (128, 128) and cfg.fp8_block is None
    assert cfg.sliding_window == 129 and cfg.rope == {"full_attention": (5e6, 0.334), "sliding_attention": (1e4, 0.334)}
    assert cfg.rms_norm_eps == 1e-5 and cfg.routed_scaling_factor == 1.0 and cfg.attention_value_scale == 0.707
    theirs_cfg = transformers.MiMoV2FlashConfig.from_dict(dict(PUBLISHED))
    assert theirs_cfg.sliding_window == 129 and theirs_cfg.layer_types == cfg.layer_types
    assert [t == "sparse" for t in theirs_cfg.mlp_layer_types] == cfg.moe_layers
    with torch.device("meta"):
        ours = Model(cfg).to(torch.bfloat16)
        theirs = transformers.MiMoV2FlashForCausalLM(theirs_cfg)
    assert {k: r.rotary_dim for k, r in Model.make_rotary(ours).items()} == {"full_attention": 64, "sliding_attention": 64}
    mine = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    ref = {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    assert mine == ref
    shapes = ours.kv_shapes()
    assert shapes.count((4, 160)) == 9 and shapes.count((8, 160)) == 39 and len(shapes) == 48
    assert cache_bytes(ours, None, 1, 1024) == 1024 * 222_720
    assert cache_bytes(ours, None, 1, 1024, max_rows=16) == 1024 * 23_040 + (129 + 15) * 39 * 8 * 320 * 2


# --- checkpoints ---


def test_stacked_experts_and_in_memory_sink_names_load_alike(checkpoint, model, tmp_path):
    """Experts stacked (``experts.gate_up_proj`` / ``down_proj``) and the sinks under their
    in-memory name load into the same weights; one weight under two names is refused."""
    def stack(w):
        for i in range(1, 4):
            p = f"model.layers.{i}.mlp.experts."
            w[p + "gate_up_proj"] = torch.stack([torch.cat([w.pop(f"{p}{e}.gate_proj.weight"),
                                                            w.pop(f"{p}{e}.up_proj.weight")]) for e in range(8)])
            w[p + "down_proj"] = torch.stack([w.pop(f"{p}{e}.down_proj.weight") for e in range(8)])
        for i in (1, 2):
            w[f"model.layers.{i}.self_attn.sinks"] = w.pop(f"model.layers.{i}.self_attn.attention_sink_bias")

    stacked = TargetModel.from_pretrained(edited_checkpoint(checkpoint[0], tmp_path / "stacked", state=stack),
                                          torch.float32).state_dict()
    base = model.state_dict()
    assert stacked.keys() == base.keys() and all(torch.equal(stacked[k], base[k]) for k in base)
    twice = edited_checkpoint(checkpoint[0], tmp_path / "twice", state=lambda w: w.update(
        {"model.layers.2.self_attn.sinks": w["model.layers.2.self_attn.attention_sink_bias"].clone()}))
    with pytest.raises(DFlashError, match="holds both model.layers.2.self_attn.attention_sink_bias and") as err:
        TargetModel.from_pretrained(twice, torch.float32)
    assert "\n" not in str(err.value)


def test_mtp_layers_are_skipped_and_nothing_else(checkpoint, hf_logits, tmp_path):
    """``model.mtp.layers.{i}.*`` holding ``eh_proj`` are not read (transformers ignores the
    prefix); a tensor under ``model.mtp.`` elsewhere, or an MTP layer without ``eh_proj``, is
    refused in one line."""
    def mtp(w):
        for i in range(2):
            w[f"model.mtp.layers.{i}.eh_proj.weight"] = torch.zeros(64, 128)
            w[f"model.mtp.layers.{i}.enorm.weight"] = torch.ones(64)
            w[f"model.mtp.layers.{i}.self_attn.q_proj.weight"] = torch.zeros(96, 64)

    with_mtp = edited_checkpoint(checkpoint[0], tmp_path / "mtp", state=mtp)
    assert (_logits(TargetModel.from_pretrained(with_mtp, torch.float32)) - hf_logits).abs().max() < 1e-5
    for name, edit, message in [
            ("stray", lambda w: w.update({"model.mtp.norm.weight": torch.ones(64)}),
             r"has model\.mtp\.norm\.weight under model\.mtp\. but outside"),
            ("no-eh", lambda w: w.pop("model.mtp.layers.1.eh_proj.weight"),
             r"model\.mtp\.layers\.1 has no eh_proj\.weight")]:
        bad = edited_checkpoint(with_mtp, tmp_path / name, state=edit)
        with pytest.raises(DFlashError, match=message) as err:
            TargetModel.from_pretrained(bad, torch.float32)
        assert "\n" not in str(err.value)


def test_fp8_blocks_dequantized_and_packed(checkpoint, tmp_path):
    """Fine-grained FP8 (every projection and per-expert matrix in 16 x 16 blocks, partial ones
    at the 24-wide key rows): dequantized when loading, every weight equals our model's from
    transformers' dequantization of the same file, and the logits transformers'; kept packed,
    the dequantized model's logits bit for bit; scales that do not tile a weight are refused."""
    from test_fp8 import dequantized_copy, to_fp8

    quantized = to_fp8(checkpoint[0], tmp_path / "fp8", (16, 16))
    stored = load_file(str(quantized / "model.safetensors"))
    assert stored["model.layers.1.mlp.experts.5.down_proj.weight"].dtype == fp8.FORMAT
    assert stored["model.layers.1.self_attn.k_proj.weight"].dtype == fp8.FORMAT
    assert stored["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    plain = TargetModel.from_pretrained(quantized, torch.float32, fp8="dequantize")
    reference = dequantized_copy(quantized, tmp_path / "dequantized")
    theirs = TargetModel.from_pretrained(reference, torch.float32).state_dict()
    mine = plain.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    with torch.no_grad():
        ref = load_hf(reference)(IDS[None]).logits[0]
    torch.testing.assert_close(_logits(plain), ref, rtol=1e-5, atol=1e-5)
    packed = TargetModel.from_pretrained(quantized, torch.float32, fp8="packed")
    assert packed.model.layers[1].mlp.experts.gate_up_proj.dtype == fp8.FORMAT
    assert isinstance(packed.model.layers[0].self_attn.k_proj, fp8.Fp8Linear)
    assert torch.equal(_logits(packed), _logits(plain))
    # a scale grid per head (two block rows for each 24-row key head) does not tile the weight in blocks of 16
    per_head = edited_checkpoint(quantized, tmp_path / "per-head", state=lambda w: w.update(
        {"model.layers.0.self_attn.k_proj.weight_scale_inv": torch.ones(3, 4)}))
    with pytest.raises(DFlashError, match=r"FP8 scale model\.layers\.0\.self_attn\.k_proj\.weight_scale_inv has shape "
                                          r"\(3, 4\)") as err:
        TargetModel.from_pretrained(per_head, torch.float32)
    assert "\n" not in str(err.value)


# --- decoding ---


def test_greedy_speculative_equals_transformers_generate(checkpoint):
    check_greedy_equals_transformers(*checkpoint, block_sizes=(4, 16), new_tokens=16)


@pytest.fixture(scope="module")
def agree_mimo(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("agree-mimo")
    # (c's own multiple of u at 1: runs of c long enough for acceptance lengths of 1 to 7)
    return make_agreeable(make_mimo_target(root / "target", seed=1), tokenizer_dir, root, "mimo_v2_flash",
                          self_scale=1.0)


def test_many_accepted_tokens_are_lossless(agree_mimo):
    check_many_accepted_tokens_are_lossless(*agree_mimo)


def test_compiled_rounds_are_lossless_and_do_not_recompile(agree_mimo):
    check_compiled_rounds_are_lossless(*agree_mimo)


def test_prefix_reuse_decodes_as_without(agree_mimo):
    from test_prefix_reuse import reuse_decodes_as_without

    _, reused = reuse_decodes_as_without(agree_mimo)
    assert reused[0] == 0 and reused[1] > 0 and reused[2] > 0


# --- refusals ---


@pytest.mark.parametrize("config,message", [
    ({"layer_types": ["full_attention"] * 3}, "layer_types has 3 entries but num_hidden_layers is 4"),
    ({"layer_types": ["full_attention", "linear_attention"] * 2},
     r"layer_types \['linear_attention'\] are not supported by mimo_v2_flash"),
    ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types must list 'dense' or 'sparse'"),
    ({"hybrid_layer_pattern": [0, 1, 1, 1]}, r"hybrid_layer_pattern \[0, 1, 1, 1\] disagrees with the layer_types"),
    ({"hybrid_layer_pattern": [0, 2, 1, 0]}, "hybrid_layer_pattern must list 0 .full. or 1"),
    ({"moe_layer_freq": [1, 1, 1, 1]}, r"moe_layer_freq \[1, 1, 1, 1\] disagrees with the mlp_layer_types"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, "rope_scaling .* is not supported by mimo_v2_flash"),
    ({"rope_theta": 1e7}, "rope_theta 10000000.0 disagrees with the full_attention layers' rope_theta 5000000.0"),
    ({"swa_rope_theta": 5e6}, "swa_rope_theta 5000000.0 disagrees with the sliding_attention layers' rope_theta"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 disagrees with the full_attention layers'"),
    ({"rope_parameters": {"full_attention": ROPE["full_attention"]}},
     "rope_parameters has no object for sliding_attention layers"),
    ({"rope_parameters": {**ROPE, "sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}},
     "rope_parameters.sliding_attention.rope_type 'yarn' is not supported"),
    ({"rope_parameters": {**ROPE, "full_attention": {"rope_type": "default"}}},
     "rope_parameters.full_attention lacks rope_theta"),
    ({"rope_parameters": {**ROPE, "full_attention": {"rope_theta": 1e6, "partial_rotary_factor": 0.3}}},
     "RoPE needs an even rotary dimension"),
    ({"layernorm_epsilon": 1e-6}, "layernorm_epsilon 1e-06 differs from rms_norm_eps"),
    ({"swa_num_key_value_heads": 1}, "swa_num_key_value_heads 1 differs from twice num_key_value_heads"),
    ({"swa_v_head_dim": 24}, "swa_v_head_dim 24 differs from v_head_dim"),
    ({"add_swa_attention_sink_bias": False}, "add_swa_attention_sink_bias false"),
    ({"add_full_attention_sink_bias": True}, "no sinks on full-attention layers"),
    ({"n_shared_experts": 1}, "no shared expert"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
    ({"topk_method": "greedy"}, "topk_method 'greedy' is not supported"),
    ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of the full_attention layers' 3"),
    ({"head_dim": None}, "head_dim must be an integer >= 1, got null"),
    ({"n_group": 3}, "n_group 3 must split n_routed_experts 8"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 and topk_group 1 must fit"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"quantization_config": {"quant_method": "mxfp4"}}, "quant_method 'mxfp4'"),
])
def test_config_errors_are_refused_in_one_line(checkpoint, tmp_path, config, message):
    target = edited_checkpoint(checkpoint[0], tmp_path / "edited", config=lambda cfg: cfg.update(config))
    with pytest.raises(DFlashError, match=message) as err:
        TargetModel.from_pretrained(target, torch.float32)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("edit,message", [
    (lambda w: w.update({"model.layers.0.self_attn.attention_sink_bias": torch.zeros(4)}),
     r"does not use .*model\.layers\.0\.self_attn\.attention_sink_bias"),
    (lambda w: w.pop("model.layers.1.self_attn.attention_sink_bias"),
     r"lacks weights: model\.layers\.1\.self_attn\.attention_sink_bias"),
    (lambda w: w.pop("model.layers.2.mlp.experts.3.up_proj.weight"), r"model\.layers\.2\.mlp\.experts: expert 3 lacks up_proj\.weight"),
    (lambda w: w.update({"model.layers.1.mlp.shared_experts.up_proj.weight": torch.zeros(32, 64)}),
     r"does not use .*shared_experts"),
    (lambda w: w.update({"model.layers.1.self_attn.v_proj.weight": torch.zeros(2 * 24, 64)}),
     r"target weight model\.layers\.1\.self_attn\.v_proj\.weight has shape \(48, 64\), config\.json implies \(32, 64\)"),
])
def test_unknown_or_missing_weights_are_refused_in_one_line(checkpoint, tmp_path, edit, message):
    target = edited_checkpoint(checkpoint[0], tmp_path / "edited", state=edit)
    with pytest.raises(DFlashError, match=message) as err:
        TargetModel.from_pretrained(target, torch.float32)
    assert "\n" not in str(err.value)


def test_init_from_target_leaves_mimo_attention_layers_as_they_are(checkpoint):
    """--init-from-target on a target whose attention is not the shared ``Attention`` class
    (values narrower than keys, sinks): no layer is copied, nothing fails (was an AttributeError)."""
    from dflash_torch.models.drafter import DFlashDrafter
    from dflash_torch.training.objective import copy_target_layers

    target_dir = checkpoint[0]
    target = TargetModel.from_pretrained(target_dir, torch.float32)
    drafter = DFlashDrafter(drafter_config(target_dir, num_layers=2))
    before = {k: v.clone() for k, v in drafter.layers.state_dict().items()}
    copy_target_layers(drafter, target)
    after = drafter.layers.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
