"""MiniMax-M2 targets (``minimax_m2``) against transformers' own ``MiniMaxM2ForCausalLM``.

* our forward == transformers' (logits and every layer's output, float32), in one pass, in
  pieces and with fixed shapes; with the config written as the published checkpoints write
  it (``rotary_dim``, remote-code fields); the parts that differ from Qwen3-MoE (the
  routing bias, the norm over the whole projection, partial RoPE) each change the logits,
  so the comparison has power;
* FP8 checkpoints (the published format; ``fmt: "float8_e4m3fn"``, per-expert ``w1`` /
  ``w2`` / ``w3``): dequantized == transformers on the dequantized weights, packed == the
  dequantized model bit for bit;
* greedy speculative decoding == transformers' greedy ``generate``; an agreeable pair
  accepting many tokens per round is lossless (eager, chunked, fixed shapes, batched),
  compiled rounds too;
* the multi-token-prediction layers a config announces are not read; other unknown
  weights and configs describing another model are refused in one line.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import (check_compiled_rounds_are_lossless, check_forward_matches_transformers,
                      check_greedy_equals_transformers, check_many_accepted_tokens_are_lossless, copy_tokenizer,
                      drafter_config, edited_checkpoint, forward_in_pieces, load_hf, make_agreeable_pair,
                      make_minimax_m2_target, save_drafter)
from dflash_torch import DFlashError
from dflash_torch.models import fp8
from dflash_torch.models.target import TargetModel
from test_fp8 import dequantized_copy, our_logits, to_fp8

IDS = torch.randint(0, 320, (30,), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_dir):
    """(target_dir, random drafter_dir) of a tiny MiniMax-M2 target."""
    root = tmp_path_factory.mktemp("minimax_m2")
    target = make_minimax_m2_target(root / "target", seed=5, tokenizer=False)
    copy_tokenizer(tokenizer_dir, target)
    return target, save_drafter(root / "drafter", drafter_config(target, block_size=16), seed=5)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A tiny MiniMax-M2 target whose config.json is laid out as the published ones."""
    return make_minimax_m2_target(tmp_path_factory.mktemp("minimax_m2_published") / "target", seed=6,
                                  tokenizer=False, published_config=True)


@pytest.mark.parametrize("pieces,static", [([30], False), ([11, 1, 7, 11], False), ([16, 14], True)])
def test_forward_matches_transformers(checkpoint, pieces, static):
    target_dir, _ = checkpoint
    ours = TargetModel.from_pretrained(target_dir, torch.float32)
    assert ours.rotary.rotary_dim == 8 and ours.config.moe.num_experts == 6
    check_forward_matches_transformers(ours, load_hf(target_dir), IDS, pieces, static)


def test_the_published_config_layout_matches_transformers(published):
    """``rotary_dim`` (no ``partial_rotary_factor``), a top-level ``rope_theta`` and the
    remote-code fields transformers does not read: the same model as transformers loads."""
    cfg = json.loads((published / "config.json").read_text())
    assert "rope_parameters" not in cfg and cfg["rotary_dim"] == 8 and cfg["num_mtp_modules"] == 3
    ours = TargetModel.from_pretrained(published, torch.float32)
    assert ours.rotary.rotary_dim == 8 and ours.config.mtp_layers == 3
    check_forward_matches_transformers(ours, load_hf(published), IDS, [13, 17], False)


@pytest.mark.parametrize("change", ["no routing bias", "per-head norm", "whole-head rope"])
def test_each_minimax_part_matters(checkpoint, change):
    """Guards the comparison above: without the routing bias, with q/k norms per head (a
    Qwen3 norm over the first head_dim weights) or rotating whole heads, the logits
    differ from transformers'."""
    from dflash_torch.models.rope import Rotary

    target_dir, _ = checkpoint
    ours = TargetModel.from_pretrained(target_dir, torch.float32)
    for layer in ours.model.layers:
        attn = layer.self_attn
        if change == "no routing bias":
            layer.mlp.e_score_correction_bias.data.zero_()
        elif change == "per-head norm":
            attn.norm_queries = lambda q, n=attn.q_norm: q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + n.eps) \
                * n.weight[: q.shape[-1]]
    if change == "whole-head rope":
        cfg = ours.config
        ours.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    with torch.no_grad():
        ref = load_hf(target_dir)(IDS[None]).logits[0]
    logits, _ = forward_in_pieces(ours, IDS, [30], False)
    assert (logits - ref).abs().max() > 1e-3


def test_greedy_speculative_equals_transformers_generate(checkpoint):
    check_greedy_equals_transformers(*checkpoint)


@pytest.fixture(scope="module")
def agree_minimax(tmp_path_factory, tokenizer_dir):
    return make_agreeable_pair(tmp_path_factory.mktemp("agree-minimax_m2"), tokenizer_dir, model_type="minimax_m2",
                               alpha=0.5, beta=5.0, self_scale=0.0)


def test_many_accepted_tokens_are_lossless(agree_minimax):
    check_many_accepted_tokens_are_lossless(*agree_minimax)


def test_compiled_rounds_are_lossless_and_do_not_recompile(agree_minimax):
    check_compiled_rounds_are_lossless(*agree_minimax)


# --- FP8, the published format ---


def _fp8_checkpoint(src, dst):
    """``src`` in FP8 as MiniMax publishes it: attention projections and every expert's
    ``w1`` / ``w2`` / ``w3`` in blocks of 16 x 16 (the router, norms, embeddings and head
    unquantized), ``fmt`` spelled ``float8_e4m3fn``."""
    out = to_fp8(src, dst, (16, 16), suffixes=("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"].update(fmt="float8_e4m3fn", modules_to_not_convert=["gate", "e_score_correction_bias",
                                                                                   "lm_head"])
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_fp8_checkpoints_dequantized_and_packed(checkpoint, tmp_path):
    """Dequantized when loading: the logits of transformers on transformers' dequantization
    of the same checkpoint. Kept packed: the dequantized model's logits bit for bit, with the
    experts held FP8."""
    quantized = _fp8_checkpoint(checkpoint[0], tmp_path / "fp8")
    stored = load_file(str(quantized / "model.safetensors"))
    assert stored["model.layers.0.block_sparse_moe.experts.5.w2.weight"].dtype == fp8.FORMAT
    assert stored["model.layers.0.block_sparse_moe.gate.weight"].dtype == torch.float32
    plain = TargetModel.from_pretrained(quantized, torch.float32, fp8="dequantize")
    with torch.no_grad():
        ref = load_hf(dequantized_copy(quantized, tmp_path / "dequantized"))(IDS[None]).logits[0]
    logits, _ = forward_in_pieces(plain, IDS, [30], False)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    packed = TargetModel.from_pretrained(quantized, torch.float32, fp8="packed")
    assert packed.model.layers[0].mlp.experts.gate_up_proj.dtype == fp8.FORMAT
    assert torch.equal(our_logits(packed), our_logits(plain))


# --- loading: MTP layers, refusals ---


def _with_mtp_layers(target_dir, dst, layers: int, edit: dict, extra=None):
    """``target_dir`` plus ``layers`` layers ``model.layers.{N + i}``: MTP modules in the layout
    their loaders read (a decoder layer's tensors, here layer 0's, plus ``eh_proj``, ``enorm``,
    ``hnorm``, ``shared_head``; the published checkpoints hold none), its config edited by
    ``edit`` and ``extra`` (name -> tensor) added."""
    state = load_file(str(target_dir / "model.safetensors"))
    n = json.loads((target_dir / "config.json").read_text())["num_hidden_layers"]
    for i in range(n, n + layers):
        for key in [k for k in state if k.startswith("model.layers.0.")]:
            state[key.replace("model.layers.0.", f"model.layers.{i}.")] = state[key].clone()
        for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            state[f"model.layers.{i}.{name}"] = torch.ones(64)
        state[f"model.layers.{i}.eh_proj.weight"] = torch.zeros(64, 128)
        state[f"model.layers.{i}.shared_head.head.weight"] = torch.zeros(320, 64)
    state.update(extra or {})
    return edited_checkpoint(target_dir, dst, config=lambda cfg: cfg.update(edit), state=lambda w: w.update(state))


def test_announced_mtp_layers_are_not_read_and_others_are_refused(checkpoint, tmp_path):
    """The layers ``num_mtp_modules`` announces (``use_mtp`` false or not: the layers are
    stored either way) are skipped; a layer past them, or past a decoder without MTP
    modules, is an unknown weight."""
    target_dir, _ = checkpoint
    base, _ = forward_in_pieces(TargetModel.from_pretrained(target_dir, torch.float32), IDS, [30], False)
    for i, edit in enumerate(({"use_mtp": True, "num_mtp_modules": 2}, {"use_mtp": False, "num_mtp_modules": 2})):
        ours = TargetModel.from_pretrained(_with_mtp_layers(target_dir, tmp_path / f"mtp{i}", 2, edit), torch.float32)
        assert torch.equal(forward_in_pieces(ours, IDS, [30], False)[0], base)
    for i, (layers, edit) in enumerate(((3, {"num_mtp_modules": 2}), (1, {"num_mtp_modules": 0}), (1, {}))):
        with pytest.raises(DFlashError, match=rf"does not use .*model\.layers\.{4 + layers - 1}\."):
            TargetModel.from_pretrained(_with_mtp_layers(target_dir, tmp_path / f"bad{i}", layers, edit), torch.float32)


def test_a_decoder_layer_counted_as_an_mtp_module_is_refused(checkpoint, tmp_path):
    """A config one decoder layer short that announces one MTP module would skip the real
    layer 3 (a different model, silently): refused, since a decoder layer has no
    ``eh_proj``; so is a tensor of a module an MTP module does not have."""
    target_dir, _ = checkpoint
    short = edited_checkpoint(target_dir, tmp_path / "short",
                              config=lambda c: c.update(num_hidden_layers=3, num_mtp_modules=1))
    with pytest.raises(DFlashError, match=r"^target checkpoint .*: layer 3 is past num_hidden_layers 3 within "
                                          r"num_mtp_modules x mtp_transformer_layers 1, but has no eh_proj\.weight: "
                                          r"not a multi-token-prediction layer \(check num_hidden_layers and "
                                          r"num_mtp_modules x mtp_transformer_layers\)$"):
        TargetModel.from_pretrained(short, torch.float32)
    junk = _with_mtp_layers(target_dir, tmp_path / "junk", 1, {"num_mtp_modules": 1},
                            {"model.layers.4.totally_unknown.weight": torch.zeros(3)})
    with pytest.raises(DFlashError, match=r"^target checkpoint .* has weights a multi-token-prediction layer does not "
                                          r"hold \(an unsupported variant\?\): model\.layers\.4\.totally_unknown\.weight$"):
        TargetModel.from_pretrained(junk, torch.float32)


@pytest.mark.parametrize("rope", [
    dict(rope_parameters=None),
    # (transformers reads rope_scaling in place of rope_parameters: a rope_theta in the latter does not count)
    dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, rope_scaling={"rope_type": "linear", "factor": 2.0}),
], ids=["no-rope", "both-keys"])
def test_a_config_without_rope_theta_takes_transformers_default(checkpoint, tmp_path, rope):
    """transformers' MiniMaxM2Config defaults rope_theta to 5e6 (not the usual 10000; a config
    with both rope dicts got 10000)."""
    target = edited_checkpoint(checkpoint[0], tmp_path / "edited", config=lambda cfg: cfg.update(
        rope, rotary_dim=8))
    assert "rope_theta" not in json.loads((target / "config.json").read_text())
    ours = TargetModel.from_pretrained(target, torch.float32)
    assert ours.config.rope_theta == 5e6
    check_forward_matches_transformers(ours, load_hf(target), IDS, [30], False)


@pytest.mark.parametrize("config,message", [
    ({"attn_type_list": [1, 0, 1, 1]}, "attn_type_list .* has linear-attention layers .0.; minimax_m2 targets with linear-attention layers are not supported"),
    ({"attn_type_list": [1, 1]}, r"attn_type_list must list 0 or 1 for each of the 4 layers, got \[1, 1\]"),
    ({"attn_type_list": [True] * 4}, "attn_type_list must list 0 or 1"),
    ({"qk_norm_type": "per_head"}, "qk_norm_type 'per_head' is not supported for minimax_m2"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
    ({"shared_intermediate_size": 128}, "shared expert"),
    ({"use_routing_bias": False}, "use_routing_bias false"),
    ({"use_qk_norm": False}, "use_qk_norm false"),
    ({"rotary_dim": 32, "rope_parameters": {"rope_theta": 5e6, "rope_type": "default"}}, "rotary_dim 32 exceeds head_dim 16"),
    ({"num_experts_per_tok": 7}, r"num_experts_per_tok 7 must be in \[1, num_local_experts=6\]"),
    ({"intermediate_size": None}, "lacks intermediate_size"),
    ({"sliding_window": 4}, "sliding_window 4 is not supported for minimax_m2"),
])
def test_configs_of_other_models_are_refused_in_one_line(checkpoint, tmp_path, config, message):
    target = edited_checkpoint(checkpoint[0], tmp_path / "edited", config=lambda cfg: cfg.update(config))
    with pytest.raises(DFlashError, match=message) as err:
        TargetModel.from_pretrained(target, torch.float32)
    assert "\n" not in str(err.value)


def test_a_null_sliding_window_is_read(checkpoint, tmp_path):
    """``sliding_window: null`` (what transformers writes by default) is full attention."""
    target = edited_checkpoint(checkpoint[0], tmp_path / "edited", config=lambda cfg: cfg.update(sliding_window=None))
    assert TargetModel.from_pretrained(target, torch.float32).kv_windows() == [None] * 4


def test_a_missing_expert_is_named_in_one_line(checkpoint, tmp_path):
    target = edited_checkpoint(checkpoint[0], tmp_path / "edited",
                               state=lambda w: w.pop("model.layers.2.block_sparse_moe.experts.3.w3.weight"))
    with pytest.raises(DFlashError, match=r"model\.layers\.2\.block_sparse_moe\.experts: expert 3 lacks w3\.weight"):
        TargetModel.from_pretrained(target, torch.float32)


def test_stacked_expert_weights_are_named_as_the_checkpoint_names_them(checkpoint, tmp_path):
    target = edited_checkpoint(checkpoint[0], tmp_path / "edited", config=lambda cfg: cfg.update(num_hidden_layers=3))
    with pytest.raises(DFlashError, match=r"model\.layers\.3\.block_sparse_moe\.experts\.\{0\.\.5\}\.w2"):
        TargetModel.from_pretrained(target, torch.float32)
