"""Kimi Linear targets (``kimi_linear``: Kimi Delta Attention + position-free latent attention +
DeepSeek-V3's mixture of experts) against transformers' own ``KimiLinearForCausalLM`` (saved with
``save_pretrained``: the published names, the published config's keys and its 1-indexed
``linear_attn_config`` layer lists), on tiny random checkpoints:

* our forward == transformers' (logits and every layer's output, float32): one pass past a
  64-token KDA chunk, in pieces through the cache (eager and fixed shapes), a deferred verify
  committed in part then single tokens == transformers' own cached decoding token by token; a
  second shape (the query's low rank, no expert groups, ``layer_types`` / ``mlp_layer_types``
  given); guards: KDA's per-channel decay and the latent attention's unrotated channels matter;
* KDA rollback: the state after a verify block and a commit of its first n rows == the state
  after feeding only those n rows;
* greedy speculative decoding == transformers' greedy ``generate`` (block sizes, recompute, fixed
  shapes, batched); an agreeable pair whose rounds accept many tokens is lossless eager, chunked,
  fixed-shape, batched and compiled (no recompilation), and prefix reuse decodes as without;
* transformers' in-memory names load the same model; bad configs and checkpoints are refused in
  one line; Kimi-Linear-48B-A3B's published config reads as transformers reads it (parameter
  shapes, count, cache bytes).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import (EOS_ID, VOCAB, added_tensor, check_compiled_rounds_are_lossless, check_greedy_equals_transformers,
                      check_many_accepted_tokens_are_lossless, copy_tokenizer, drafter_config, edited_checkpoint,
                      check_rollback, forward_in_pieces, incremental_logits, load_hf, make_agreeable, save_drafter)
from dflash_torch import DFlashError
from dflash_torch.cache import cache_bytes
from dflash_torch.models import kda, kimi_linear
from dflash_torch.models.config import TargetConfig
from dflash_torch.models.rope import Rotary
from dflash_torch.models.target import TargetModel

H = 64
# the published config's keys (num_experts, num_expert_group, ...; layers 1-indexed), tiny shapes
TINY = dict(vocab_size=VOCAB, hidden_size=H, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, routed_scaling_factor=2.0, first_k_dense_replace=1, num_experts=8,
            num_experts_per_token=2, num_expert_group=2, topk_group=1, num_shared_experts=1, moe_renormalize=True,
            model_max_length=4096, mla_use_nope=True, moe_router_activation_func="sigmoid", moe_layer_freq=1,
            eos_token_id=EOS_ID, pad_token_id=EOS_ID, bos_token_id=EOS_ID, tie_word_embeddings=False,
            linear_attn_config={"full_attn_layers": [3], "kda_layers": [1, 2, 4], "num_heads": 4, "head_dim": 8,
                                "short_conv_kernel_size": 4})
VARIANT = dict(q_lora_rank=24, num_expert_group=1, num_hidden_layers=5, first_k_dense_replace=None,
               layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention",
                            "linear_attention"],
               mlp_layer_types=["sparse", "dense", "sparse", "sparse", "dense"],
               linear_attn_config={"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 3})
ATOL = 2e-5  # one pass (measured: about 7e-6 on logits of magnitude ~3)
PIECES_ATOL = 5e-5  # through the cache, in pieces (another rounding order)
IDS = torch.randint(2, VOCAB, (90,), generator=torch.Generator().manual_seed(1))  # > one 64-token KDA chunk


def make_kimi_target(out_dir: Path, *, seed: int = 0, **overrides) -> Path:
    """Save a tiny random ``KimiLinearForCausalLM`` (:data:`TINY` plus ``overrides``, None
    removing a key) with transformers' ``save_pretrained`` (the published names: the forget gate
    flat under ``self_attn``, split convolutions, ``block_sparse_moe`` with per-expert ``w1`` /
    ``w2`` / ``w3``). Forget gates, norms and score correction biases are drawn wide."""
    import transformers

    torch.manual_seed(seed)
    text = {k: v for k, v in {**TINY, **overrides}.items() if v is not None}
    model = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**text)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.normal_(0, 0.5)
            elif name.endswith("dt_bias"):
                p.normal_(0, 1.0)
            elif name.endswith(("norm.weight", "layernorm.weight")):
                p.normal_(1, 0.1)
            elif p.dim() >= 2:
                p.normal_(0, 0.08)
            else:
                p.normal_(0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_dir):
    """(target_dir, random drafter_dir with B = 8) of the tiny Kimi Linear target."""
    root = tmp_path_factory.mktemp("kimi_linear")
    target = make_kimi_target(root / "target")
    copy_tokenizer(tokenizer_dir, target)
    return target, save_drafter(root / "drafter", drafter_config(target, block_size=8), seed=3)


@pytest.fixture(scope="module")
def models(checkpoint):
    """(transformers' model, ours) of :func:`checkpoint`."""
    return load_hf(checkpoint[0]), TargetModel.from_pretrained(checkpoint[0], torch.float32)


def _hf_token_by_token(hf, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """transformers' logits of ``ids``: a prefill of ``prefill`` tokens, then one token at a time
    through its own cache."""
    with torch.no_grad():
        out = hf(ids[None, :prefill], use_cache=True)
        cache, logits = out.past_key_values, [out.logits[0]]
        for p in range(prefill, len(ids)):
            out = hf(ids[None, p:p + 1], cache=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits[0])
    return torch.cat(logits)


def test_forward_matches_transformers(models):
    hf, ours = models
    assert ours.config.model_type == "kimi_linear" and ours.recurrent
    assert ours.config.layer_types == ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
    assert ours.config.moe_layers == [False, True, True, True] and ours.config.n_group == 2
    with torch.no_grad():
        ref = hf(IDS[None], output_hidden_states=True)
    logits, feats = forward_in_pieces(ours, IDS, [90], False)
    torch.testing.assert_close(logits, ref.logits[0], rtol=ATOL, atol=ATOL)
    for layer in range(ours.config.num_hidden_layers - 1):  # (transformers' last hidden state is the final norm's)
        torch.testing.assert_close(feats[:, layer * H:(layer + 1) * H], ref.hidden_states[layer + 1][0],
                                   rtol=ATOL, atol=ATOL)
    for static in (False, True):  # pieces through the cache, eager and over the whole preallocated buffer
        lg, _ = forward_in_pieces(ours, IDS[:70], [23, 16, 1, 1, 29], static)
        torch.testing.assert_close(lg, ref.logits[0, :70], rtol=ATOL, atol=PIECES_ATOL)
    mine = incremental_logits(ours, IDS)  # a prefill chunk, a deferred verify block committed in part, single tokens
    torch.testing.assert_close(mine, ref.logits[0, :60], rtol=ATOL, atol=PIECES_ATOL)
    torch.testing.assert_close(mine, _hf_token_by_token(hf, IDS[:60], 40), rtol=ATOL, atol=PIECES_ATOL)


def test_variant_matches_transformers(tmp_path):
    """The query's low rank, one expert group, ``layer_types`` and ``mlp_layer_types`` given,
    KDA heads of 16 with a 3-tap convolution (``linear_attn_config`` without layer lists)."""
    target = make_kimi_target(tmp_path / "t", seed=2, **VARIANT)
    hf, ours = load_hf(target), TargetModel.from_pretrained(target, torch.float32)
    assert ours.config.moe_layers == [True, False, True, True, False] and ours.config.q_lora_rank == 24
    assert (ours.config.linear_num_heads, ours.config.linear_head_dim, ours.config.linear_conv_kernel_dim) == (2, 16, 3)
    with torch.no_grad():
        ref = hf(IDS[None]).logits[0]
    torch.testing.assert_close(forward_in_pieces(ours, IDS, [90], False)[0], ref, rtol=ATOL, atol=ATOL)
    torch.testing.assert_close(forward_in_pieces(ours, IDS[:50], [30, 1, 19], False)[0], ref[:50], rtol=ATOL,
                               atol=PIECES_ATOL)


def test_the_details_matter(models, monkeypatch):
    """The comparison above fails when KDA's decay is shared by a head's channels (Gated
    DeltaNet's) or when the latent attention rotates its ``qk_rope_head_dim`` channels (RoPE, as
    the remote code would with ``mla_use_nope`` false): both change the logits far beyond the tolerance."""
    hf, ours = models
    with torch.no_grad():
        ref = hf(IDS[None]).logits[0]
    forget = kda.ForgetGate.forward
    monkeypatch.setattr(kda.ForgetGate, "forward", lambda self, x: forget(self, x).mean(-1, keepdim=True).expand(
        -1, self.heads, self.head_dim))
    per_head = forward_in_pieces(ours, IDS, [90], False)[0]
    monkeypatch.undo()
    rotary = Rotary(ours.config.qk_rope_head_dim, 10000.0, None)

    def rotated(layer, h, kv, step):  # (what the remote code would run with mla_use_nope false)
        attn = layer.self_attn
        q, latent = attn.project(h, *rotary.cos_sin(step.positions.reshape(-1), h.dtype))
        kv.write(layer.slot, step.positions, *attn.halves(latent))
        return attn.output(attn.attend(q, *kv.view(layer.slot, step.kv_len), step.biases[None, 1]))
    monkeypatch.setattr(kimi_linear.Model, "_self_attention", staticmethod(rotated))
    with_rope = forward_in_pieces(ours, IDS, [90], False)[0]
    monkeypatch.undo()
    assert (forward_in_pieces(ours, IDS, [90], False)[0] - ref).abs().max() < ATOL
    assert (per_head - ref).abs().max() > 1e-2 and (with_rope - ref).abs().max() > 1e-2


def test_rollback_equals_feeding_only_the_accepted_tokens(models):
    _, model = models
    check_rollback(model, torch.randint(2, VOCAB, (60,), generator=torch.Generator().manual_seed(2)), (1, 6, 16))


def test_greedy_speculative_equals_transformers_generate(checkpoint):
    check_greedy_equals_transformers(*checkpoint, block_sizes=(3, 8), new_tokens=16)


@pytest.fixture(scope="module")
def agree_pair(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("kimi_linear-agree")
    target = make_kimi_target(root / "target", seed=1)
    return make_agreeable(target, tokenizer_dir, root, "kimi_linear", block_size=8, alpha=1.0, beta=5.0,
                          self_scale=0.3)


def test_many_accepted_tokens_are_lossless(agree_pair):
    check_many_accepted_tokens_are_lossless(*agree_pair)


def test_prefix_reuse_decodes_as_without(agree_pair):
    """A three-turn conversation through the batch decoder reuses its history (latent rows and
    the KDA states) and decodes exactly as with reuse off (tokens, acceptance lengths, rows)."""
    from test_prefix_reuse import reuse_decodes_as_without

    _, reused = reuse_decodes_as_without(agree_pair)
    assert reused[0] == 0 and reused[1] > 0 and reused[2] > 0


def test_transformers_in_memory_names_load_the_same_model(models, checkpoint, tmp_path):
    """A checkpoint written with transformers' in-memory names (``forget_gate.*``, one
    ``conv1d``, ``A_log`` ``[1, 1, heads, 1]``, ``mlp.`` with stacked experts) loads exactly as
    the published names."""
    hf, ours = models
    out = tmp_path / "in-memory"
    out.mkdir()
    (out / "config.json").write_text((checkpoint[0] / "config.json").read_text())
    state = hf.state_dict()
    assert any(".forget_gate." in k for k in state) and state["model.layers.0.self_attn.forget_gate.A_log"].dim() == 4
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    theirs = TargetModel.from_pretrained(out, torch.float32).state_dict()
    mine = ours.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def _config(**changes) -> dict:
    cfg = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", **copy.deepcopy(TINY)}
    for key, value in changes.items():
        if key.startswith("linear_attn_config."):
            cfg["linear_attn_config"][key.split(".", 1)[1]] = value
        else:
            cfg[key] = value
    return cfg


@pytest.mark.parametrize("changes, message", [
    (dict(mla_use_nope=False), "mla_use_nope False is not supported"),
    (dict(num_key_value_heads=2), "num_key_value_heads 2 != num_attention_heads 4"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(moe_router_activation_func="softmax"), "moe_router_activation_func 'softmax' is not supported"),
    (dict(moe_layer_freq=2), "moe_layer_freq 2 is not supported"),
    (dict(use_grouped_topk=False), "use_grouped_topk false with topk_group 1 < num_expert_group 2"),
    (dict(num_experts=8, num_local_experts=16), "gives num_experts 8 and num_local_experts 16"),
    (dict(num_expert_group=3), "n_group 3 must split n_routed_experts 8"),
    (dict(**{"linear_attn_config.gate_lower_bound": -5.0}), "gate_lower_bound -5.0 is not supported"),
    (dict(**{"linear_attn_config.full_attn_layers": [0]}), "must list layer numbers from 1 to num_hidden_layers 4"),
    (dict(**{"linear_attn_config.full_attn_layers": [3, 4]}), "must name each of the 4 layers (1-indexed) once"),
    (dict(**{"linear_attn_config.kda_layers": [1, 2]}), "must name each of the 4 layers (1-indexed) once"),
    (dict(layer_types=["linear_attention"] * 4), "layer_types disagrees with linear_attn_config"),
    (dict(layer_types=["linear_attention"] * 3 + ["mamba"]), "layer_types must give"),
    (dict(mlp_layer_types=["dense"] * 4), "first_k_dense_replace 1 disagrees with mlp_layer_types"),
    (dict(mlp_layer_types=["dense", "moe", "sparse", "sparse"]), "mlp_layer_types must list"),
    (dict(**{"linear_attn_config.head_dim": "8"}), "linear_head_dim must be an integer"),
    (dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}), "quant_method 'fp8'); dflash-torch reads unquantized float32/bfloat16/float16 weights only for "
     "model_type 'kimi_linear'"),
])
def test_bad_configs_are_refused_in_one_line(changes, message):
    with pytest.raises(DFlashError) as err:
        TargetConfig.from_dict(_config(**changes))
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


L = "model.layers."


@pytest.mark.parametrize("edit, message", [
    (added_tensor(L + "2.self_attn.q_a_proj.weight", (24, 64)), "does not use"),  # a low rank the config does not announce
    (added_tensor(L + "4.eh_proj.weight", (64, 128)), "does not use"),  # a layer num_nextn_predict_layers 0 does not announce
    (added_tensor(L + "0.self_attn.conv1d.bias", (96,)), "variant?): model.layers.0.self_attn.conv1d.bias"),
    (lambda s: s.pop(L + "0.self_attn.k_conv1d.weight"), "part of its split convolution"),
    (lambda s: s.pop(L + "1.block_sparse_moe.experts.3.w3.weight"), "expert 3 lacks up_proj.weight"),
    (lambda s: s.pop(L + "3.self_attn.A_log"), "lacks weights: model.layers.3.self_attn.A_log"),
    (lambda s: s.pop(L + "2.block_sparse_moe.gate.e_score_correction_bias"),
     "lacks weights: model.layers.2.block_sparse_moe.gate.e_score_correction_bias"),
    (lambda s: s.update({L + "1.mlp.gate.weight": s[L + "1.block_sparse_moe.gate.weight"].clone()}), "twice"),
    (lambda s: s.update({L + "0.self_attn.forget_gate.dt_bias": s[L + "0.self_attn.dt_bias"].clone()}), "twice"),
    (lambda s: s.update({L + "0.self_attn.A_log": torch.zeros(1, 1, 5, 1)}), "A_log has shape (1, 1, 5, 1)"),
])
def test_bad_checkpoints_are_refused_in_one_line(checkpoint, tmp_path, edit, message):
    target = edited_checkpoint(checkpoint[0], tmp_path / "t", state=edit)
    with pytest.raises(DFlashError) as err:
        TargetModel.from_pretrained(target, torch.float32)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


# moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json (its architecture keys)
PUBLISHED = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "first_k_dense_replace": 1,
             "head_dim": 72, "hidden_act": "silu", "hidden_size": 2304, "intermediate_size": 9216,
             "kv_lora_rank": 512, "linear_attn_config": {
                 "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
                 "kda_layers": [i for i in range(1, 27) if i % 4], "num_heads": 32, "short_conv_kernel_size": 4},
             "mla_use_nope": True, "model_max_length": 1048576, "moe_intermediate_size": 1024, "moe_layer_freq": 1,
             "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "num_attention_heads": 32,
             "num_expert_group": 1, "num_experts": 256, "num_experts_per_token": 8, "num_hidden_layers": 27,
             "num_key_value_heads": 32, "num_nextn_predict_layers": 0, "num_shared_experts": 1, "q_lora_rank": None,
             "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_scaling": None,
             "rope_theta": 10000.0, "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "topk_group": 1,
             "torch_dtype": "bfloat16", "use_grouped_topk": True, "v_head_dim": 128, "vocab_size": 163840,
             "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839}


def test_published_config_reads_as_transformers_reads_it():
    import transformers

    theirs = transformers.KimiLinearConfig(**{k: v for k, v in PUBLISHED.items() if k != "architectures"})
    ours = TargetConfig.from_dict(PUBLISHED)
    assert ours.layer_types == theirs.layer_types and ours.layer_types.count("full_attention") == 7
    assert ours.layer_types[26] == "full_attention" and ours.layer_types[3] == "full_attention"
    assert ours.moe_layers == [t == "sparse" for t in theirs.mlp_layer_types] and ours.moe_layers.count(False) == 1
    for key in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "n_group", "topk_group",
                "routed_scaling_factor", "rms_norm_eps", "vocab_size", "hidden_size", "max_position_embeddings"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert (ours.moe.num_experts, ours.moe.top_k, ours.moe.intermediate_size) == (256, 8, 1024)
    assert ours.softmax_scale == 192 ** -0.5 and ours.eos_token_ids == [163586]
    with torch.device("meta"):
        mine = kimi_linear.Model(ours)
        reference = transformers.KimiLinearForCausalLM(theirs)
    shapes = {k: tuple(v.shape) for k, v in mine.state_dict().items()}
    ref = {k.replace(".self_attn.", ".linear_attn.") if theirs.layer_types[int(k.split(".")[2])] == "linear_attention"
           else k: tuple(v.shape) for k, v in reference.state_dict().items() if k.startswith("model.layers.")}
    ref.update({k: tuple(v.shape) for k, v in reference.state_dict().items() if not k.startswith("model.layers.")})
    ref = {k: ((v[2],) if k.endswith("A_log") else v) for k, v in ref.items()}  # ([1, 1, heads, 1] held as [heads])
    assert shapes == ref
    params = sum(v.numel() for v in mine.state_dict().values())
    assert params == sum(v.numel() for v in reference.state_dict().values()) and 48e9 < params < 50e9
    # bfloat16 bytes a token: 7 latent-attention layers, a latent row of 512 + 64 each
    assert sum(h * d * 2 * 2 for h, d in mine.kv_shapes()) == 7 * 576 * 2 == 8_064
    # the KDA state per sequence: 20 layers of 32 heads of 128 x 128 float32 plus 3 conv inputs of 3 * 4096 each
    assert cache_bytes(mine, None, 1, 0) == 20 * (32 * 128 * 128 * 4 + 3 * 3 * 4096 * 4)


def test_compiled_rounds_are_lossless_and_do_not_recompile(agree_pair):
    check_compiled_rounds_are_lossless(*agree_pair)


@pytest.mark.parametrize("changes", [
    dict(linear_attn_config={"num_heads": 8}),  # no layer lists: transformers' default (layers 4, 8, ... full)
    dict(linear_attn_config=None, linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=3,
         first_k_dense_replace=3),
    dict(num_experts=None, num_local_experts=16, num_expert_group=None, n_group=4, topk_group=2,
         num_experts_per_token=None, num_experts_per_tok=3, num_shared_experts=None, n_shared_experts=2,
         moe_renormalize=None, norm_topk_prob=False, model_max_length=None, max_position_embeddings=2048),
    dict(layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
         mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
])
def test_config_variants_read_as_transformers_reads_them(changes):
    """transformers' own names, defaults and derivations (layer types without lists, dense layers
    from ``first_k_dense_replace``, ``linear_*`` keys at the top level) read as it reads them."""
    import transformers

    layers = 9 if "linear_attn_config" in changes else 4  # (9: past the published lists of TINY's 4 layers)
    cfg = {k: v for k, v in _config(num_hidden_layers=layers, **changes).items() if v is not None}
    theirs = transformers.KimiLinearConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    ours = TargetConfig.from_dict(cfg)
    assert ours.layer_types == theirs.layer_types
    assert ours.moe_layers == [t == "sparse" for t in theirs.mlp_layer_types]
    assert (ours.moe.num_experts, ours.moe.top_k, ours.moe.norm_topk_prob, ours.moe.shared_expert_intermediate_size) \
        == (theirs.num_local_experts, theirs.num_experts_per_tok, theirs.norm_topk_prob,
            theirs.moe_intermediate_size * theirs.n_shared_experts)
    for key in ("n_group", "topk_group", "max_position_embeddings", "linear_num_heads", "linear_head_dim",
                "linear_conv_kernel_dim"):
        assert getattr(ours, key) == getattr(theirs, key), key
