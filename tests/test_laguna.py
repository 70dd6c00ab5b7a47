"""Laguna targets (``laguna``) against transformers' own ``LagunaForCausalLM``.

* our forward == transformers' (logits and every layer's output, float32, within 1e-5), in
  one pass, in pieces and with fixed shapes: sliding-window layers with more query heads
  than the full ones (two mask groupings), YaRN on the full layers rotating half of each
  head, plain RoPE on the sliding ones, a per-head softplus gate, a soft-capped sigmoid
  router with a routing bias, a routed scale and a shared expert; and a variant (a gate per
  channel, transformers' default RoPE, biases, an unusual dense / sparse pattern); each
  Laguna part changes the logits, so the comparison has power; in bfloat16 the router and
  the mixture of experts round as transformers' do;
* the flat vLLM schema of the older published configs gives bit for bit the logits of the
  equivalent nested config; without ``swa_rope_parameters`` the sliding layers take the
  full layers' RoPE (as vLLM); a nested and a legacy RoPE that disagree are refused;
* checkpoints: per-expert (as ``save_pretrained`` writes them) or stacked, the in-memory
  names of transformers too; FP8 blocks and W4A16 dequantized when loading equal the
  dequantized checkpoint, packed == dequantized bit for bit (NVFP4: tests/test_nvfp4.py);
* greedy speculative decoding == transformers' greedy ``generate``; an agreeable pair is
  lossless eager, chunked, fixed shapes, batched, compiled (no recompile), with prefix reuse;
* config errors and unknown weights are refused in one line.
"""

from __future__ import annotations

import json
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
YARN = {"rope_type": "yarn", "rope_theta": 500000.0, "partial_rotary_factor": 0.5, "factor": 32.0,
        "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.0}
SLIDING = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}


def make_laguna_target(out_dir: Path, *, seed: int = 0, **overrides) -> Path:
    """Save a tiny random Laguna target with transformers' ``LagunaForCausalLM``: 4 layers
    (full, then 3 sliding with a window of 8), 4 query heads on the full layer and 6 on the
    sliding ones over 2 key/value heads of 16, the published RoPE (YaRN over the first half
    of each full head, plain RoPE on the sliding ones), 6 experts (top 2) with a shared
    expert after a dense first layer, a router soft cap and a routed scale; random norm
    weights and routing biases. ``overrides``: config fields."""
    import transformers

    torch.manual_seed(seed)
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, sliding_window=8,
               layer_types=["full_attention"] + ["sliding_attention"] * 3, num_attention_heads_per_layer=[4, 6, 6, 6],
               rope_parameters={"full_attention": YARN, "sliding_attention": SLIDING}, num_experts=6,
               num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=24,
               moe_routed_scaling_factor=2.5, moe_router_logit_softcapping=3.0, max_position_embeddings=2048,
               eos_token_id=EOS_ID, bos_token_id=EOS_ID, pad_token_id=EOS_ID, experts_implementation="eager")
    cfg.update(overrides)
    model = transformers.LagunaForCausalLM(transformers.LagunaConfig(**cfg)).eval()
    with torch.no_grad():  # larger-than-default weights give peaked, less tie-prone logits
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias") or (name.endswith(".bias") and p.dim() == 1):
                p.normal_(0, 0.1)
            elif p.dim() >= 2:
                p.normal_(0, 0.08)
            elif name.endswith("norm.weight"):
                p.normal_(1, 0.2)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_dir):
    """(target_dir, random drafter_dir) of a tiny Laguna target."""
    root = tmp_path_factory.mktemp("laguna")
    target = make_laguna_target(root / "target", seed=5)
    copy_tokenizer(tokenizer_dir, target)
    return target, save_drafter(root / "drafter", drafter_config(target, block_size=16), seed=5)


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    """A Laguna target with a gate per channel, q/k/v/o biases, transformers' default RoPE
    (the config saved without rope_parameters), sparse / dense layers alternating, no soft
    cap, one expert per token, no scale."""
    target = make_laguna_target(tmp_path_factory.mktemp("laguna-variant") / "target", seed=7, gating="per-element",
                                attention_bias=True, rope_parameters=None, mlp_layer_types=["sparse", "dense"] * 2,
                                moe_router_logit_softcapping=0.0, moe_routed_scaling_factor=1.0, num_experts_per_tok=1)
    cfg = json.loads((target / "config.json").read_text())
    del cfg["rope_parameters"]
    (target / "config.json").write_text(json.dumps(cfg))
    return target


def _logits(model, pieces=(30,), static=False) -> torch.Tensor:
    return forward_in_pieces(model, IDS, list(pieces), static)[0]


def _hf_logits(target_dir: Path) -> torch.Tensor:
    with torch.no_grad():
        return load_hf(target_dir)(IDS[None]).logits[0]


@pytest.mark.parametrize("pieces,static", [([30], False), ([11, 1, 7, 11], False), ([16, 14], True)])
def test_forward_matches_transformers(checkpoint, pieces, static):
    ours = TargetModel.from_pretrained(checkpoint[0], torch.float32)
    assert registry.family("laguna").Model is type(ours)
    assert ours.attention_masks == ((None, 2), (8, 3)) and [layer.self_attn.heads for layer in ours.model.layers] == [4, 6, 6, 6]
    assert {k: r.rotary_dim for k, r in ours.rotary.items()} == {"full_attention": 8, "sliding_attention": 16}
    assert [layer.mlp.__class__.__name__ for layer in ours.model.layers] == ["MLP"] + ["LagunaMoE"] * 3
    ref = check_forward_matches_transformers(ours, load_hf(checkpoint[0]), IDS, pieces, static)
    assert (_logits(ours, pieces, static) - ref.logits[0]).abs().max() < 1e-5


def test_a_gate_per_channel_biases_and_default_rope_match_transformers(variant):
    ours = TargetModel.from_pretrained(variant, torch.float32)
    attn = ours.model.layers[1].self_attn
    assert attn.g_proj.weight.shape == (6 * 16, 64) and attn.q_proj.bias is not None and attn.o_proj.bias is not None
    assert ours.config.rope == {"full_attention": (500000.0, None, 0.5), "sliding_attention": (10000.0, None, 1.0)}
    assert ours.config.moe_layers == [True, False, True, False]
    ref = check_forward_matches_transformers(ours, load_hf(variant), IDS, [13, 17], False)
    assert (_logits(ours, [13, 17]) - ref.logits[0]).abs().max() < 1e-5


@pytest.mark.parametrize("change", ["sigmoid gate", "no routing bias", "no soft cap", "no routed scale",
                                    "no yarn", "no shared expert"])
def test_each_laguna_part_matters(checkpoint, change):
    """Guards the comparison above: each part changed alone moves the logits off transformers'."""
    from dflash_torch.models.rope import Rotary

    ours = TargetModel.from_pretrained(checkpoint[0], torch.float32)
    for layer in ours.model.layers[1:]:
        attn, mlp = layer.self_attn, layer.mlp
        if change == "sigmoid gate":
            attn.output = lambda a, g, attn=attn: attn.o_proj((a.view(a.shape[0], attn.heads, -1)
                                                               * torch.sigmoid(g)[..., None]).flatten(1))
        elif change == "no routing bias":
            mlp.e_score_correction_bias.data.zero_()
        elif change == "no soft cap":
            mlp.softcap = 0.0
        elif change == "no routed scale":
            mlp.routed_scaling_factor = 1.0
        elif change == "no shared expert":
            mlp.shared_experts = None
    if change == "no yarn":
        ours.rotary["full_attention"] = Rotary(16, 500000.0, None, partial_rotary_factor=0.5)
    assert (_logits(ours) - _hf_logits(checkpoint[0])).abs().max() > 1e-3


def test_bfloat16_routing_and_experts_round_as_transformers(checkpoint):
    """In bfloat16 a sparse layer's router picks transformers' experts with its weights bit
    for bit, and the layer's output (routed sum times the scale, plus the shared expert) is
    transformers' bit for bit; the whole model's logits stay within bfloat16 rounding."""
    hf = load_hf(checkpoint[0]).to(torch.bfloat16)
    ours = TargetModel.from_pretrained(checkpoint[0], torch.bfloat16)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.no_grad():
        for i in (1, 3):
            theirs, mine = hf.model.layers[i].mlp, ours.model.layers[i].mlp
            _, ref_weights, ref_experts = theirs.gate(x)
            weights, experts = mine.route(x)
            assert torch.equal(experts, ref_experts) and torch.equal(weights, ref_weights)
            assert weights.dtype == torch.bfloat16 and len(experts.unique()) == 6
            assert torch.equal(mine(x), theirs(x[None])[0])
        ref = hf(IDS[None]).logits[0].float()
    torch.testing.assert_close(_logits(ours).float(), ref, rtol=0.05, atol=0.05)


# --- the flat (vLLM) config schema ---


def _legacy(cfg: dict, swa: bool = True) -> None:
    """``cfg`` (the nested schema transformers writes) rewritten in vLLM's flat schema."""
    rope = cfg.pop("rope_parameters")
    full = dict(rope["full_attention"])
    cfg["rope_theta"] = full.pop("rope_theta")
    cfg["partial_rotary_factor"] = full.pop("partial_rotary_factor")
    cfg["rope_scaling"] = full
    if swa:
        cfg["swa_rope_parameters"] = rope["sliding_attention"]
    cfg.pop("mlp_layer_types")
    cfg.update(gating="per-head", mlp_only_layers=[0], decoder_sparse_step=1, norm_topk_prob=True, qkv_bias=False,
               swa_attention_sink_enabled=False)


def test_the_legacy_flat_schema_gives_the_nested_configs_logits(checkpoint, tmp_path):
    nested = TargetModel.from_pretrained(checkpoint[0], torch.float32)
    legacy_dir = edited_checkpoint(checkpoint[0], tmp_path / "legacy", config=_legacy)
    assert "rope_parameters" not in json.loads((legacy_dir / "config.json").read_text())
    legacy = TargetModel.from_pretrained(legacy_dir, torch.float32)
    assert legacy.config.rope == nested.config.rope and legacy.config.moe_layers == nested.config.moe_layers
    assert torch.equal(_logits(legacy), _logits(nested))
    # without swa_rope_parameters the sliding layers reuse the full layers' RoPE, as vLLM does
    reuse = TargetModel.from_pretrained(edited_checkpoint(checkpoint[0], tmp_path / "no-swa",
                                                          config=lambda c: _legacy(c, swa=False)), torch.float32)
    assert reuse.config.rope["sliding_attention"] == reuse.config.rope["full_attention"] == nested.config.rope["full_attention"]
    assert (_logits(reuse) - _logits(nested)).abs().max() > 1e-3


def test_legacy_keys_beside_a_nested_rope_must_agree(checkpoint, tmp_path):
    agree = edited_checkpoint(checkpoint[0], tmp_path / "agree", config=lambda c: c.update(
        rope_theta=500000.0, partial_rotary_factor=0.5, swa_rope_parameters=SLIDING, mlp_only_layers=[0]))
    assert torch.equal(_logits(TargetModel.from_pretrained(agree, torch.float32)),
                       _logits(TargetModel.from_pretrained(checkpoint[0], torch.float32)))
    for i, (edit, message) in enumerate([
            ({"rope_theta": 10000.0}, "nested rope_parameters and the legacy rope_theta, which disagree on the "
                                      "full_attention layers' rope_theta: 500000.0 against 10000.0"),
            ({"partial_rotary_factor": 1.0}, "legacy partial_rotary_factor, which disagree"),
            ({"swa_rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "legacy swa_rope_parameters"),
            ({"mlp_only_layers": [0, 1]}, "disagrees with its legacy mlp_only_layers")]):
        bad = edited_checkpoint(checkpoint[0], tmp_path / f"bad{i}", config=lambda c: c.update(edit))
        with pytest.raises(DFlashError, match=message) as err:
            TargetModel.from_pretrained(bad, torch.float32)
        assert "\n" not in str(err.value)


# --- checkpoint layouts, quantized checkpoints ---


def test_stacked_experts_and_in_memory_names_load_alike(checkpoint, tmp_path):
    """Experts stacked (``experts.gate_up_proj`` / ``down_proj``), the bias under
    ``mlp.gate.`` and the shared expert as ``shared_experts``: transformers' in-memory names
    load as the saved ones; one weight under two names is refused."""
    base = _logits(TargetModel.from_pretrained(checkpoint[0], torch.float32))

    def stack(w):
        for i in range(1, 4):
            p = f"model.layers.{i}.mlp."
            w[p + "experts.gate_up_proj"] = torch.stack([torch.cat([w.pop(f"{p}experts.{e}.gate_proj.weight"),
                                                                    w.pop(f"{p}experts.{e}.up_proj.weight")])
                                                         for e in range(6)])
            w[p + "experts.down_proj"] = torch.stack([w.pop(f"{p}experts.{e}.down_proj.weight") for e in range(6)])
            w[p + "gate.e_score_correction_bias"] = w.pop(p + "experts.e_score_correction_bias")
            for k in [k for k in w if k.startswith(p + "shared_expert.")]:
                w[k.replace("shared_expert.", "shared_experts.")] = w.pop(k)

    stacked = edited_checkpoint(checkpoint[0], tmp_path / "stacked", state=stack)
    assert torch.equal(_logits(TargetModel.from_pretrained(stacked, torch.float32)), base)
    twice = edited_checkpoint(checkpoint[0], tmp_path / "twice", state=lambda w: w.update(
        {"model.layers.2.mlp.gate.e_score_correction_bias": w["model.layers.2.mlp.experts.e_score_correction_bias"].clone()}))
    with pytest.raises(DFlashError, match="holds both model.layers.2.mlp.*e_score_correction_bias and"):
        TargetModel.from_pretrained(twice, torch.float32)


def test_fp8_blocks_dequantized_and_packed(checkpoint, tmp_path):
    """Fine-grained FP8 (every projection, the per-expert matrices and the gate projection
    in 16 x 16 blocks, partial ones at the shared expert's 24): dequantized when loading,
    every weight equals our model's from transformers' dequantization of the same file, and
    the logits transformers'; kept packed, the dequantized model's logits bit for bit."""
    from test_fp8 import dequantized_copy, to_fp8

    quantized = to_fp8(checkpoint[0], tmp_path / "fp8", (16, 16))
    stored = load_file(str(quantized / "model.safetensors"))
    assert stored["model.layers.1.mlp.experts.5.down_proj.weight"].dtype == fp8.FORMAT
    assert stored["model.layers.1.self_attn.g_proj.weight"].dtype == fp8.FORMAT
    assert stored["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    plain = TargetModel.from_pretrained(quantized, torch.float32, fp8="dequantize")
    reference = dequantized_copy(quantized, tmp_path / "dequantized")
    theirs = TargetModel.from_pretrained(reference, torch.float32).state_dict()
    mine = plain.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    torch.testing.assert_close(_logits(plain), _hf_logits(reference), rtol=1e-5, atol=1e-5)
    packed = TargetModel.from_pretrained(quantized, torch.float32, fp8="packed")
    assert packed.model.layers[1].mlp.experts.gate_up_proj.dtype == fp8.FORMAT
    assert isinstance(packed.model.layers[1].self_attn.g_proj, fp8.Fp8Linear)
    assert torch.equal(_logits(packed), _logits(plain))


def test_w4a16_dequantized_and_packed(checkpoint, tmp_path):
    """compressed-tensors W4A16 (groups of 8): dequantized == compressed-tensors' own
    dequantization bit for bit; packed == dequantized bit for bit."""
    from test_packed_int import library_dequantized, to_packed

    quantized = to_packed(checkpoint[0], tmp_path / "w4a16", 4, 8)
    plain = TargetModel.from_pretrained(quantized, torch.float32, int_weights="dequantize")
    theirs = TargetModel.from_pretrained(library_dequantized(quantized, tmp_path / "lib", 4, 8),
                                         torch.float32).state_dict()
    mine = plain.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    packed = TargetModel.from_pretrained(quantized, torch.float32, int_weights="packed")
    assert packed.model.layers[2].mlp.experts.int_bits == 4
    assert torch.equal(_logits(packed), _logits(plain))


def test_an_nvfp4_config_without_nvfp4_weights_is_refused_in_one_line(checkpoint, tmp_path):
    """(NVFP4 Laguna checkpoints load: tests/test_nvfp4.py.) A config that declares NVFP4 over
    unquantized weights, or without config groups, is refused."""
    for i, (quant, message) in enumerate([
            ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {}},
             "no config_groups"),
            ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "declares ModelOpt NVFP4 weights but the checkpoint "
                                                                  "holds none")]):
        target = edited_checkpoint(checkpoint[0], tmp_path / f"q{i}", config=lambda c: c.update(quantization_config=quant))
        with pytest.raises(DFlashError, match=message) as err:
            TargetModel.from_pretrained(target, torch.float32)
        assert "\n" not in str(err.value)


# --- decoding ---


def test_greedy_speculative_equals_transformers_generate(checkpoint):
    check_greedy_equals_transformers(*checkpoint, block_sizes=(4, 16), new_tokens=16)


@pytest.fixture(scope="module")
def agree_laguna(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("agree-laguna")
    return make_agreeable(make_laguna_target(root / "target", seed=1), tokenizer_dir, root, "laguna")


def test_many_accepted_tokens_are_lossless(agree_laguna):
    check_many_accepted_tokens_are_lossless(*agree_laguna)


def test_compiled_rounds_are_lossless_and_do_not_recompile(agree_laguna):
    check_compiled_rounds_are_lossless(*agree_laguna)


def test_prefix_reuse_decodes_as_without(agree_laguna):
    from test_prefix_reuse import reuse_decodes_as_without

    _, reused = reuse_decodes_as_without(agree_laguna)
    assert reused[0] == 0 and reused[1] > 0 and reused[2] > 0


# --- refusals ---


@pytest.mark.parametrize("config,message", [
    ({"layer_types": ["full_attention"] * 3}, "layer_types has 3 entries but num_hidden_layers is 4"),
    ({"layer_types": ["full_attention", "linear_attention"] * 2}, r"layer_types \['linear_attention'\] are not supported by laguna"),
    ({"num_attention_heads_per_layer": [4, 6, 6]}, "num_attention_heads_per_layer must list an integer >= 1 for each of the 4 layers"),
    ({"num_attention_heads_per_layer": [4, 6, 5, 6]}, "target layer 2: 5 query heads are not a multiple of the 2 key/value heads"),
    ({"mlp_layer_types": ["dense", "sparse", "moe", "sparse"]}, r"mlp_layer_types \['moe'\] are not supported"),
    ({"mlp_layer_types": ["dense"]}, "mlp_layer_types must list dense or sparse for each of the 4 layers"),
    ({"sliding_window": None}, "has sliding_attention layers but no sliding_window"),
    ({"gating": "per-token"}, "gating 'per-token' is not supported"),
    ({"gating": False}, "gating false is ambiguous"),
    ({"moe_apply_router_weight_on_input": True}, "moe_apply_router_weight_on_input"),
    ({"swa_attention_sink_enabled": True}, "attention sinks are not supported"),
    ({"norm_topk_prob": False}, "always renormalises"),
    ({"moe_router_score_func": "sqrtsoftplus"}, "moe_router_score_func 'sqrtsoftplus' is not supported"),
    ({"num_experts_per_tok": 7}, r"num_experts_per_tok 7 must be in \[1, num_experts=6\]"),
    ({"rope_parameters": {"full_attention": YARN}}, "rope_parameters has no object for sliding_attention layers"),
    ({"rope_parameters": {"full_attention": YARN, "sliding_attention": {"rope_type": "longrope", "rope_theta": 1.0}}},
     "rope_parameters.sliding_attention.rope_type 'longrope' is not supported"),
    ({"rope_parameters": {"full_attention": {**YARN, "partial_rotary_factor": 1.5}, "sliding_attention": SLIDING}},
     r"partial_rotary_factor must be a number in \(0, 1\]"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": SLIDING}},
     "rope_parameters.full_attention lacks rope_theta"),
    ({"attention_bias": True, "qkv_bias": False}, "ambiguous"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
])
def test_config_errors_are_refused_in_one_line(checkpoint, tmp_path, config, message):
    target = edited_checkpoint(checkpoint[0], tmp_path / "edited", config=lambda cfg: cfg.update(config))
    with pytest.raises(DFlashError, match=message) as err:
        TargetModel.from_pretrained(target, torch.float32)
    assert "\n" not in str(err.value)


def test_a_config_transformers_refuses_is_named_in_one_line(checkpoint, tmp_path):
    """A config our parser reads but transformers' LagunaConfig refuses (a null sliding_window
    with only full-attention layers) fails where AutoTokenizer reads it: one whole line naming
    config.json and transformers' reason, not a cut-off message blaming the tokenizer."""
    from dflash_torch import DFlashEngine

    target = edited_checkpoint(checkpoint[0], tmp_path / "edited", config=lambda cfg: cfg.update(
        sliding_window=None, layer_types=["full_attention"] * 4))
    TargetModel.from_pretrained(target, torch.float32)  # (our parser reads it)
    with pytest.raises(DFlashError, match=r"transformers refuses .*config\.json \(AutoTokenizer reads it to load the "
                       r"tokenizer\): Validation error for field 'sliding_window': TypeError: .*expected int") as err:
        DFlashEngine.from_pretrained(target, no_draft=True)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("edit,message", [
    (lambda w: w.update({"model.layers.1.self_attn.sinks": torch.zeros(6)}), r"does not use .*model\.layers\.1\.self_attn\.sinks"),
    (lambda w: w.pop("model.layers.2.mlp.experts.3.up_proj.weight"), r"model\.layers\.2\.mlp\.experts: expert 3 lacks up_proj\.weight"),
    (lambda w: w.pop("model.layers.3.mlp.experts.e_score_correction_bias"), r"lacks weights: model\.layers\.3\.mlp\.experts\.e_score_correction_bias"),
    (lambda w: w.pop("model.layers.1.self_attn.g_proj.weight"), r"lacks weights: model\.layers\.1\.self_attn\.g_proj\.weight"),
])
def test_unknown_or_missing_weights_are_refused_in_one_line(checkpoint, tmp_path, edit, message):
    target = edited_checkpoint(checkpoint[0], tmp_path / "edited", state=edit)
    with pytest.raises(DFlashError, match=message) as err:
        TargetModel.from_pretrained(target, torch.float32)
    assert "\n" not in str(err.value)


def _parse(**cfg):
    from dflash_torch.models.laguna import parse_config

    base = dict(model_type="laguna", vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=48, sliding_window=8, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=8,
                layer_types=["full_attention"] + ["sliding_attention"] * 3)
    base.update(cfg)
    return parse_config(base)


def test_the_flat_schema_folds_as_vllm_reads_it():
    """Without swa_rope_parameters' own factor, the sliding layers take the top-level one (vLLM
    injects it into every layer's RoPE); a flat rope_parameters is the full layers' RoPE; the
    flat defaults are vLLM's (base 500,000, whole heads) while a config with no RoPE key at
    all takes transformers'; mlp_only_layers / decoder_sparse_step pick the dense layers (all
    of them without experts); qkv_bias alone biases q/k/v but not o_proj."""
    cfg = _parse(rope_theta=1e6, partial_rotary_factor=0.5, swa_rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    assert cfg.rope == {"full_attention": (1e6, None, 0.5), "sliding_attention": (1e4, None, 0.5)}
    flat = _parse(rope_parameters={"rope_type": "yarn", "rope_theta": 2e5, "factor": 4.0,
                                   "original_max_position_embeddings": 64})
    assert flat.rope["full_attention"][0] == 2e5 and flat.rope["full_attention"][1]["factor"] == 4.0
    assert flat.rope["sliding_attention"] == flat.rope["full_attention"] and flat.rope["full_attention"][2] == 1.0
    assert _parse(rope_theta=500000.0).rope["sliding_attention"] == (500000.0, None, 1.0)
    assert _parse().rope == {"full_attention": (500000.0, None, 0.5), "sliding_attention": (10000.0, None, 1.0)}
    assert _parse(mlp_only_layers=[0, 2]).moe_layers == [False, True, False, True]
    assert _parse(decoder_sparse_step=2).moe_layers == [False, True, False, True]
    dense = _parse(num_experts=0, mlp_only_layers=[])
    assert dense.moe is None and dense.moe_layers == [False] * 4
    biased = _parse(qkv_bias=True)
    assert biased.qkv_bias and not biased.attention_bias


def test_laguna_s_shapes_build_with_two_mask_groupings():
    """Laguna-S-2.1's attention layout (48 layers, hidden 3072, FULL, SWA, SWA, SWA; 48 query
    heads on full layers, 72 on sliding ones, 8 key/value heads of 128; YaRN over half of
    each full head): built on the meta device, one mask per (window, query heads per key/value
    head), keys and values of 8 x 128 in every layer, a gate per head."""
    from dflash_torch.models.laguna import Model

    cfg = _parse(vocab_size=100352, hidden_size=3072, num_hidden_layers=48, num_attention_heads=48,
                 num_key_value_heads=8, head_dim=128, sliding_window=512,
                 layer_types=["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(48)],
                 num_attention_heads_per_layer=[48 if i % 4 == 0 else 72 for i in range(48)],
                 rope_parameters={"full_attention": {**YARN, "original_max_position_embeddings": 8192},
                                  "sliding_attention": SLIDING}, max_position_embeddings=131072)
    with torch.device("meta"):
        model = Model(cfg)
    assert model.attention_masks == ((None, 6), (512, 9)) and set(model.kv_shapes()) == {(8, 128)}
    assert model.model.layers[1].self_attn.g_proj.weight.shape == (72, 3072)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (48 * 128, 3072)
    assert model.kv_windows()[:4] == [None, 512, 512, 512]
    rotary = Model.make_rotary(model)
    assert rotary["full_attention"].rotary_dim == 64 and rotary["sliding_attention"].rotary_dim == 128
