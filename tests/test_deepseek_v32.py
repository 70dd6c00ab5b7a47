"""DeepSeek Sparse Attention targets (``deepseek_v32``: DeepSeek-V3.2; ``glm_moe_dsa``: GLM-5 /
GLM-5.1), run by :mod:`dflash_torch.models.deepseek_v32`, against transformers' own
``DeepseekV32ForCausalLM`` and ``GlmMoeDsaForCausalLM`` on tiny random checkpoints (4 heads, a
latent of 32 + 8, queries of 24 + 8, values of 16; an indexer of 8 heads of 16 channels keeping
the 4 (DeepSeek-V3.2) or 5 (GLM) best keys, far fewer than the 30 to 130 positions decoded, so
the sparsity bites; 8 experts in 4 groups, the first layer dense; GLM's middle layer "shared"):

* our forward == transformers' (logits and every layer's output, float32), in one pass, in
  pieces and with fixed shapes, both model types, other sharing patterns; guards: the same
  weights with a dense ``index_topk``, without a shared layer's reuse, without the indexer's RoPE
  or with the other RoPE layout each change the logits by more than 1e-3;
* the indexer: batched == one sequence at a time, chunked == one pass, the choice == its
  definition, and rows the causal mask hides never displace a visible key, whatever they hold;
* greedy speculative decoding == transformers' greedy ``generate``; an agreeable pair accepting
  many tokens a round (eager, chunked prefill, fixed shapes, batched, compiled, prefix reuse;
  bfloat16 == target-only but at near-ties);
* the multi-token-prediction layer is not read; bad configs are refused in one line; the
  published shapes (transformers' defaults) are read as transformers reads them; fine-grained
  FP8 == transformers' own loading of it, compressed-tensors W4A16 == the library's own
  dequantization; kept packed == dequantized bit for bit.
"""

from __future__ import annotations

import importlib
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
from dflash_torch.models import deepseek_v32
from dflash_torch.models.config import TargetConfig
from dflash_torch.models.target import TargetModel

TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8,
            routed_scaling_factor=1.8, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
            qk_nope_head_dim=24, n_group=4, topk_group=2, num_experts_per_tok=3, max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, eos_token_id=EOS_ID,
            bos_token_id=EOS_ID, pad_token_id=EOS_ID, tie_word_embeddings=False, first_k_dense_replace=1,
            index_head_dim=16, index_n_heads=8)
KINDS = {"deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(index_topk=4)),
         "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(index_topk=5, index_topk_pattern="FSF"))}
IDS = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(1))


def make_dsa_target(out_dir: Path, model_type: str, *, seed: int = 0, **overrides) -> Path:
    """Save a tiny random DSA target of ``model_type`` (:data:`TEXT`, its :data:`KINDS`
    overrides, then ``overrides``; transformers' eager experts) with larger-than-default
    weights, norms around 1, LayerNorm biases and score correction biases that matter."""
    import transformers

    config_name, model_name, kind = KINDS[model_type]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**{**TEXT, **kind, **overrides}, experts_implementation="eager")
    model = getattr(transformers, model_name)(config).eval()
    randomize_moe_weights(model)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


@pytest.fixture(scope="module", params=list(KINDS))
def checkpoint(request, tmp_path_factory, tokenizer_dir):
    """(target_dir, random drafter_dir) of the tiny target of each model type."""
    root = tmp_path_factory.mktemp(request.param)
    target = make_dsa_target(root / "target", request.param, seed=5)
    copy_tokenizer(tokenizer_dir, target)
    return target, save_drafter(root / "drafter", drafter_config(target, block_size=16), seed=5)


@pytest.fixture(scope="module", params=list(KINDS))
def agree_pair(request, tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp(f"{request.param}-agree")
    target = make_dsa_target(root / "target", request.param, seed=1)
    # (c's own share of u, tuned so that rounds accept from 1 to 16 tokens, with both kinds of rounds common)
    self_scale = {"deepseek_v32": 0.6, "glm_moe_dsa": 0.3}[request.param]
    return make_agreeable(target, tokenizer_dir, root, request.param, alpha=1.0, beta=5.0, self_scale=self_scale)


@pytest.mark.parametrize("pieces,static", [([30], False), ([11, 1, 7, 11], False), ([16, 14], True)])
def test_forward_matches_transformers(checkpoint, pieces, static):
    target_dir, _ = checkpoint
    ours = TargetModel.from_pretrained(target_dir, torch.float32)
    cfg = ours.config
    assert type(ours) is deepseek_v32.Model and cfg.moe_layers == [False, True, True]
    assert cfg.indexer_full == ([True, False, True] if cfg.model_type == "glm_moe_dsa" else [True] * 3)
    check_forward_matches_transformers(ours, load_hf(target_dir), IDS, pieces, static)


@pytest.mark.parametrize("model_type,overrides", [
    ("glm_moe_dsa", dict(num_hidden_layers=4, index_topk_pattern=None, index_topk_freq=2, index_skip_topk_offset=1)),
    ("glm_moe_dsa", dict(indexer_types=["full", "shared", "shared"], mlp_layer_types=["sparse", "dense", "sparse"],
                         index_topk=3)),
    ("deepseek_v32", dict(index_topk=6, index_head_dim=8, first_k_dense_replace=0, kv_lora_rank=31)),
], ids=["glm-freq-offset", "glm-two-shared-sparse-dense", "v32-all-rotated-all-sparse-odd-latent"])
def test_variants_match_transformers(tmp_path, model_type, overrides):
    """Other schedules of shared layers (``index_topk_freq`` / ``index_skip_topk_offset``: full,
    shared, full, shared; two shared after a full one), ``mlp_layer_types`` other than
    ``first_k_dense_replace`` says (transformers builds those of ``mlp_layer_types``), an index
    head of rotated channels only, an odd latent row."""
    target_dir = make_dsa_target(tmp_path / "target", model_type, seed=2, **overrides)
    ours = TargetModel.from_pretrained(target_dir, torch.float32)
    hf = load_hf(target_dir)
    assert ours.config.indexer_full == [layer.self_attn.indexer is not None for layer in hf.model.layers]
    assert False in ours.config.indexer_full or model_type == "deepseek_v32"
    check_forward_matches_transformers(ours, hf, IDS, [17, 13], False)


def _logits(model) -> torch.Tensor:
    return forward_in_pieces(model, IDS, [30], False)[0]


def test_the_details_matter(checkpoint, tmp_path, monkeypatch):
    """Guards the comparisons above, each changing the logits by more than 1e-3: the same
    weights with ``index_topk`` 1000 (dense attention); the indexer without its RoPE or with
    the other layout (halves / interleaved pairs); GLM: a shared layer attending densely
    instead of reusing the last full layer's choice."""
    target_dir, _ = checkpoint
    with torch.no_grad():
        ref = load_hf(target_dir)(IDS[None]).logits[0]
    dense = edited_checkpoint(target_dir, tmp_path / "dense", config=lambda c: c.update(index_topk=1000))
    assert (_logits(TargetModel.from_pretrained(dense, torch.float32)) - ref).abs().max() > 1e-3
    ours = TargetModel.from_pretrained(target_dir, torch.float32)
    torch.testing.assert_close(_logits(ours), ref, rtol=1e-4, atol=1e-4)
    indexers = [layer.self_attn.indexer for layer in ours.model.layers if layer.self_attn.indexer is not None]
    for indexer in indexers:
        indexer.interleave = not indexer.interleave
    assert (_logits(ours) - ref).abs().max() > 1e-3, "the other RoPE layout"
    for indexer in indexers:
        indexer.interleave = not indexer.interleave
    with monkeypatch.context() as m:
        m.setattr(deepseek_v32.Indexer, "_rope", lambda self, x, cos, sin: x)
        assert (_logits(ours) - ref).abs().max() > 1e-3, "no RoPE"
    if ours.config.model_type == "glm_moe_dsa":
        run = deepseek_v32.Model._self_attention

        def no_reuse(layer, h, kv, step):
            if layer.self_attn.indexer is None:
                step.carried["dsa_bias"] = step.biases[None, 1]
            return run(layer, h, kv, step)

        monkeypatch.setattr(deepseek_v32.Model, "_self_attention", staticmethod(no_reuse))
        assert (_logits(ours) - ref).abs().max() > 1e-3, "no reuse"


def _indexer(top_k: int = 4) -> deepseek_v32.Indexer:
    cfg = deepseek_v32.parse_config({**TEXT, "model_type": "glm_moe_dsa", "index_topk": top_k})
    torch.manual_seed(0)
    indexer = deepseek_v32.Indexer(cfg)
    with torch.no_grad():
        for p in indexer.parameters():
            p.normal_(0, 0.3)
    return indexer


def test_the_indexer_s_choice_batched_chunked_and_by_definition(monkeypatch):
    """N sequences at once == each alone; in chunks of query rows == in one; each query keeps
    exactly the ``index_topk`` visible keys of highest ``sum_h w_h relu(q_h . k) /
    sqrt(index_head_dim)`` (those it sees when no more), masked keys staying masked."""
    indexer = _indexer()
    g = torch.Generator().manual_seed(0)
    n, tq, tk = 3, 5, 11
    x, q_resid = torch.randn(n * tq, 64, generator=g), torch.randn(n * tq, 48, generator=g)
    cos, sin = torch.randn(n * tq, 8, generator=g), torch.randn(n * tq, 8, generator=g)
    keys = torch.randn(n, tk, 16, generator=g)
    visible = torch.arange(tk) <= torch.arange(tk - tq, tk)[:, None] - torch.arange(n)[:, None, None] * 3
    bias = torch.zeros(n, tq, tk).masked_fill(~visible, float("-inf"))
    batched = indexer.sparse_bias(x, q_resid, cos, sin, keys, bias)
    for i in range(n):
        rows = slice(i * tq, (i + 1) * tq)
        one = indexer.sparse_bias(x[rows], q_resid[rows], cos[rows], sin[rows], keys[i:i + 1], bias[i])
        assert torch.equal(batched[i], one)
        q = indexer._rope(indexer.wq_b(q_resid[rows]).view(tq, 8, 16).transpose(0, 1), cos[rows], sin[rows])
        scores = torch.relu(q @ keys[i].T / 4).permute(1, 0, 2)  # [Tq, heads, Tk]
        w = indexer.weights_proj(x[rows]) / 8 ** 0.5
        score = (w[..., None] * scores).sum(1)
        for t in range(tq):
            seen = visible[i, t].nonzero().flatten()
            best = seen[score[t, seen].argsort(descending=True)[:4]]
            assert set((one[t] == 0).nonzero().flatten().tolist()) == set(best.tolist())
    assert (batched == 0).sum(-1).max() == 4 and (batched == 0).sum(-1).min() < 4  # (an early query sees fewer)
    monkeypatch.setattr(deepseek_v32, "_SCORES_PER_CHUNK", n * 8 * tk * 2)  # two query rows a chunk
    assert torch.equal(indexer.sparse_bias(x, q_resid, cos, sin, keys, bias), batched)


def test_hidden_rows_never_displace_a_visible_key():
    """Whatever the rows the causal mask hides hold (unwritten rows of a fixed-shape buffer:
    zeros, stale keys, huge values, NaN), the choice among the visible keys is the same, and
    ties (exact zeros) keep the lowest position, whatever the number of rows after them."""
    indexer = _indexer(top_k=3)
    g = torch.Generator().manual_seed(1)
    x, q_resid = torch.randn(2, 64, generator=g), torch.randn(2, 48, generator=g)
    cos, sin = torch.ones(2, 8), torch.zeros(2, 8)
    keys = torch.randn(1, 12, 16, generator=g)
    bias = torch.zeros(2, 12).masked_fill(torch.arange(12) > torch.tensor([[6], [7]]), float("-inf"))
    want = indexer.sparse_bias(x, q_resid, cos, sin, keys, bias)
    for junk in (0.0, 1e4, -1e4, float("nan"), float("inf")):
        garbage = keys.clone()
        garbage[:, 8:] = junk
        assert torch.equal(indexer.sparse_bias(x, q_resid, cos, sin, garbage, bias), want), junk
    zeros = torch.zeros(1, 12, 16)  # (every score 0: a tie of all visible keys)
    chosen = indexer.sparse_bias(x, q_resid, cos, sin, zeros, bias) == 0
    assert chosen[0].nonzero().flatten().tolist() == chosen[1].nonzero().flatten().tolist() == [0, 1, 2]
    short = indexer.sparse_bias(x[:1], q_resid[:1], cos[:1], sin[:1], zeros[:, :7], bias[:1, :7]) == 0
    assert short[0].nonzero().flatten().tolist() == [0, 1, 2]


def test_the_cache_holds_the_index_key_with_the_latent_row(checkpoint):
    """A layer with an indexer caches ``[c, k_pe, index_k]`` (32 + 8 + 16 = 56 values: two
    halves of 28), a GLM shared layer the 40-value latent alone (two halves of 20)."""
    target_dir, _ = checkpoint
    ours = TargetModel.from_pretrained(target_dir, torch.float32)
    full = ours.config.indexer_full
    assert ours.kv_shapes() == [(1, 28 if f else 20) for f in full]


def test_greedy_speculative_equals_transformers_generate(checkpoint):
    check_greedy_equals_transformers(*checkpoint)


def test_many_accepted_tokens_are_lossless(agree_pair):
    check_many_accepted_tokens_are_lossless(*agree_pair)


def test_compiled_rounds_are_lossless_and_do_not_recompile(agree_pair):
    check_compiled_rounds_are_lossless(*agree_pair)


def test_prefix_reuse_decodes_as_without(agree_pair):
    """A three-turn conversation through the batch decoder reuses its history's cache rows
    (latent and index keys) and decodes exactly as with reuse off."""
    from test_prefix_reuse import reuse_decodes_as_without

    prompts, reused = reuse_decodes_as_without(agree_pair)
    assert reused[0] == 0 and reused[1] > len(prompts[0]) and reused[2] > len(prompts[1])


def test_bfloat16_speculative_decoding_is_the_target_s_own_but_near_ties(agree_pair):
    """bfloat16: speculative decoding commits target-only decoding's tokens, but where a
    batched verify flips a near-tie of the target (README.md), with rounds accepting two
    drafts or more."""
    from test_fp8 import bfloat16_near_tie_taus

    assert max(bfloat16_near_tie_taus(agree_pair)) > 2


def test_the_multi_token_prediction_layer_is_not_read(checkpoint, tmp_path):
    """A checkpoint with an MTP layer (``model.layers.3.*``: a decoder layer plus its own norms,
    projection and head) and ``num_nextn_predict_layers`` 1, as published, decodes as the one
    without; unannounced, those weights are unknown and refused."""
    target_dir, _ = checkpoint

    def add_mtp(w):
        for key in [k for k in w if k.startswith("model.layers.2.")]:
            w[key.replace("model.layers.2.", "model.layers.3.")] = w[key].clone()
        for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            w[f"model.layers.3.{name}"] = torch.ones(64)
        w["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)

    unannounced = edited_checkpoint(target_dir, tmp_path / "unannounced", state=add_mtp)
    with pytest.raises(DFlashError, match=r"^target checkpoint .* has weights this .* model does not use "
                                          r"\(an unsupported variant\?\): model\.layers\.3\."):
        TargetModel.from_pretrained(unannounced, torch.float32)
    mtp = edited_checkpoint(unannounced, tmp_path / "mtp", config=lambda c: c.update(num_nextn_predict_layers=1))
    with torch.no_grad():
        ref = load_hf(target_dir)(IDS[None]).logits[0]
    torch.testing.assert_close(_logits(TargetModel.from_pretrained(mtp, torch.float32)), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type", list(KINDS))
def test_published_shapes_are_read_as_transformers_reads_them(model_type):
    """Our defaults are transformers' config class's; DeepSeek-V3.2 (61 layers) and GLM-5 (78)
    cache 512 + 64 + 128 = 704 values a token and layer: 85,888 / 109,824 bytes a token in
    bfloat16 (every GLM-5 layer full by default); the RoPE tables and softmax scale are
    transformers'; the indexer's RoPE layout is the model type's."""
    import transformers

    config_name, _, _ = KINDS[model_type]
    hf = getattr(transformers, config_name)()
    defaults = deepseek_v32.GLM_DEFAULTS if model_type == "glm_moe_dsa" else deepseek_v32.V32_DEFAULTS
    for key, value in defaults.items():
        if key != "num_nextn_predict_layers":  # (not a key of transformers' configs: 0, as for glm4_moe_lite)
            assert getattr(hf, key) == value, key
    cfg = TargetConfig.from_dict({"model_type": model_type, "rope_theta": 10000})
    layers = 78 if model_type == "glm_moe_dsa" else 61
    assert cfg.indexer_full == [True] * layers and cfg.moe_layers == [i >= 3 for i in range(layers)]
    assert cfg.index_interleave == (model_type == "glm_moe_dsa")
    with torch.device("meta"):
        model = deepseek_v32.Model(cfg)
    assert model.kv_shapes() == [(1, 352)] * layers
    assert sum(h * d * 2 for h, d in model.kv_shapes()) * 2 == {61: 85_888, 78: 109_824}[layers]
    hf.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    prefix = config_name.removesuffix("Config")
    rotary = getattr(module, f"{prefix}RotaryEmbedding")(hf)
    torch.testing.assert_close(model.make_rotary().inv_freq, rotary.inv_freq, rtol=1e-6, atol=0)
    with torch.device("meta"):
        attention = getattr(module, f"{prefix}Attention")(hf, 0)
    assert model.model.layers[0].self_attn.scale == attention.scaling
    assert attention.indexer.k_norm.eps == deepseek_v32.INDEX_KEY_EPS


def test_glm_sharing_schedules_are_transformers():
    """``indexer_types`` as transformers' config derives it from ``index_topk_pattern`` or
    ``index_topk_freq`` / ``index_skip_topk_offset``."""
    import transformers

    for extra in (dict(index_topk_pattern="FFSSFS"), dict(index_topk_freq=3), dict(index_topk_freq=2,
                  index_skip_topk_offset=4), dict(index_topk_pattern=["full", "shared"] * 3)):
        hf = transformers.GlmMoeDsaConfig(num_hidden_layers=6, **extra)
        ours = TargetConfig.from_dict({"model_type": "glm_moe_dsa", "num_hidden_layers": 6, **extra})
        assert ours.indexer_full == [t == "full" for t in hf.indexer_types], extra


V32 = {**TEXT, "model_type": "deepseek_v32", "index_topk": 4}
GLM = {**TEXT, "model_type": "glm_moe_dsa", "index_topk": 4}


@pytest.mark.parametrize("cfg,message", [
    ({**V32, "q_lora_rank": None}, r"^target config.json has null q_lora_rank \(DeepSeek Sparse Attention needs it\)$"),
    ({**V32, "index_topk": 0}, r"^target config.json index_topk must be an integer >= 1, got 0$"),
    ({**GLM, "index_topk": None}, r"^target config.json has null index_topk "),
    ({**V32, "index_n_heads": 2.5}, r"^target config.json index_n_heads must be an integer >= 1, got 2.5$"),
    ({**V32, "index_head_dim": 4}, r"^target index_head_dim 4 < qk_rope_head_dim 8: "),
    ({**V32, "rope_interleave": False}, r"^target config.json rope_interleave False is not supported"),
    ({**GLM, "indexer_rope_interleave": False},
     r"^target config.json indexer_rope_interleave False is not supported for glm_moe_dsa: .* in interleaved pairs"),
    ({**V32, "indexer_rope_interleave": True}, r"^target config.json indexer_rope_interleave True is not supported "
                                               r"for deepseek_v32: .* in consecutive halves"),
    ({**V32, "index_topk_pattern": "FSF"}, r"^target config.json index_topk_pattern is a glm_moe_dsa key"),
    ({**GLM, "indexer_types": ["full", "shared"]},
     r"^target config.json indexer_types must give 'full' or 'shared' for each of the 3 layers, got \['full', 'shared'\]$"),
    ({**GLM, "indexer_types": ["full", "sparse", "full"]}, r"^target config.json indexer_types must give"),
    ({**GLM, "indexer_types": ["shared", "full", "full"]},
     r"^target config.json indexer_types makes layer 0 'shared': no full layer before it"),
    ({**GLM, "index_topk_pattern": "FXF"}, r"^target config.json index_topk_pattern must be a string of 'F'"),
    ({**GLM, "index_topk_pattern": "FS"}, r"^target config.json index_topk_pattern must give .* 3 layers"),
    ({**GLM, "index_topk_freq": 0}, r"^target config.json index_topk_freq must be an integer >= 1, got 0$"),
    ({**GLM, "index_topk_freq": 2, "index_skip_topk_offset": 0},
     r"^target config.json index_topk_freq 2 / index_skip_topk_offset 0 makes layer 0 'shared'"),
    ({**GLM, "index_skip_topk_offset": "2"}, r"^target config.json index_skip_topk_offset must be an integer"),
    ({**V32, "layer_types": ["full_attention"] * 3}, r"^target config.json layer_types must be 'indexed_attention'"),
    ({**V32, "first_k_dense_replace": None}, r"^target config.json has null first_k_dense_replace"),
    ({**V32, "mlp_layer_types": ["dense", "moe", "sparse"]}, r"^target config.json mlp_layer_types must list"),
    ({**V32, "num_key_value_heads": 2}, r"^target num_key_value_heads 2 != num_attention_heads 4"),
    ({**GLM, "scoring_func": "softmax"}, r"^target config.json scoring_func 'softmax' is not supported"),
    ({**V32, "quantization_config": {"quant_method": "awq", "bits": 4}},
     r"^the target checkpoint is quantized \(quant_method 'awq'\)"),
])
def test_bad_configs_are_refused_in_one_line(cfg, message):
    with pytest.raises(DFlashError, match=message) as err:
        TargetConfig.from_dict(cfg)
    assert "\n" not in str(err.value)


def test_fp8_checkpoint_equals_transformers_and_packed_equals_dequantized(checkpoint, tmp_path):
    """Fine-grained FP8 (e4m3, blocks of [8, 16], every projection quantized, the indexer's
    ``wq_b``, ``wk`` and ``weights_proj`` too; the router and norms not): our weights equal those
    transformers itself loads from the FP8 checkpoint on the CPU, bit for bit, in float32 and
    bfloat16 (the router float32, ``weights_proj`` bfloat16 as there), and the float32 logits
    its model's; kept packed (the indexer's linears FP8, ``kv_b_proj`` dequantized when loading)
    the logits equal the dequantized model's bit for bit."""
    import transformers
    from test_fp8 import to_fp8

    from dflash_torch.models import fp8

    target_dir, _ = checkpoint
    quantized = to_fp8(target_dir, tmp_path / "fp8", (8, 16),
                       suffixes=("_proj.weight", "_proj_with_mqa.weight", ".wq_b.weight", ".wk.weight"))
    stored = load_file(str(quantized / "model.safetensors"))
    for key in ("indexer.wq_b", "indexer.wk", "indexer.weights_proj", "q_b_proj"):
        assert stored[f"model.layers.0.self_attn.{key}.weight"].dtype == fp8.FORMAT, key
    assert stored["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    arch = json.loads((target_dir / "config.json").read_text())["architectures"][0]
    for dtype in (torch.float32, torch.bfloat16):
        ours = TargetModel.from_pretrained(quantized, dtype)
        hf = getattr(transformers, arch).from_pretrained(str(quantized), dtype=dtype,
                                                         experts_implementation="eager").eval()
        mine = ours.state_dict()
        assert_same_weights(mine, hf.state_dict(), dtype)
        assert mine["model.layers.1.mlp.gate.weight"].dtype == torch.float32
        assert mine["model.layers.0.self_attn.indexer.weights_proj.weight"].dtype == dtype
        if dtype == torch.float32:
            with torch.no_grad():
                ref = hf(IDS[None]).logits[0]
            torch.testing.assert_close(_logits(ours), ref, rtol=1e-4, atol=1e-4)
        packed = TargetModel.from_pretrained(quantized, dtype, fp8="packed")
        attn = packed.model.layers[0].self_attn
        assert isinstance(attn.indexer.wq_b, fp8.Fp8Linear) and isinstance(attn.indexer.weights_proj, fp8.Fp8Linear)
        assert attn.kv_b_proj.weight.dtype == dtype
        assert torch.equal(forward_in_pieces(packed, IDS, [20, 10], False)[0],
                           forward_in_pieces(ours, IDS, [20, 10], False)[0]), dtype


def test_int4_weights_equal_the_librarys_dequantization_and_packed_the_dequantized(checkpoint, tmp_path):
    """compressed-tensors W4A16 (``pack-quantized``, symmetric, groups of 16; every projection,
    the indexer's too): dequantized when loading, our weights equal our model loaded from
    compressed-tensors' own dequantization bit for bit, in float32 and bfloat16 (the router
    float32); kept packed (the indexer's linears packed, ``kv_b_proj`` dequantized when loading),
    the logits equal the dequantized model's bit for bit."""
    from test_packed_int import _packed_layers, library_dequantized, to_packed

    from dflash_torch.models.packed_int import IntLinear

    target_dir, _ = checkpoint
    quantized = to_packed(target_dir, tmp_path / "int4", 4, 16,
                          suffixes=("_proj.weight", "_proj_with_mqa.weight", ".wq_b.weight", ".wk.weight"))
    assert load_file(str(quantized / "model.safetensors"))[
        "model.layers.0.self_attn.indexer.wk.weight_packed"].dtype == torch.int32
    oracle = library_dequantized(quantized, tmp_path / "oracle", 4, 16)
    for dtype in (torch.float32, torch.bfloat16):
        plain = TargetModel.from_pretrained(quantized, dtype, int_weights="dequantize")
        mine = plain.state_dict()
        assert_same_weights(mine, TargetModel.from_pretrained(oracle, dtype).state_dict(), dtype)
        assert mine["model.layers.1.mlp.gate.weight"].dtype == torch.float32
        packed = TargetModel.from_pretrained(quantized, dtype, int_weights="packed")
        linears, experts = _packed_layers(packed)
        attn = packed.model.layers[0].self_attn
        assert experts == 2 and isinstance(attn.indexer.wq_b, IntLinear) and attn.kv_b_proj.weight.dtype == dtype
        assert torch.equal(forward_in_pieces(packed, IDS, [20, 10], False)[0],
                           forward_in_pieces(plain, IDS, [20, 10], False)[0]), dtype


def test_a_glm_5_config_as_published_reads_as_transformers_reads_it():
    """A GLM-5-series config.json as zai-org publishes them (the keys transformers 5.x saves plus
    those vLLM reads: ``indexer_rope_interleave`` true, ``index_share_for_mtp_iteration``,
    ``moe_router_dtype``, ``head_dim`` 192 / ``qk_head_dim`` 256; an indexer on layers 0-2 and every
    fourth from 6, the others shared): the layers that run an indexer, the experts, the shapes and the stop tokens are
    transformers'; the same config with ``indexer_types`` written out reads the same."""
    import transformers

    published = {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "attention_bias": False,
        "eos_token_id": [154820, 154827, 154829], "first_k_dense_replace": 3, "head_dim": 192, "hidden_act": "silu",
        "hidden_size": 6144, "index_head_dim": 128, "index_n_heads": 32, "index_share_for_mtp_iteration": True,
        "index_skip_topk_offset": 3, "index_topk": 2048, "index_topk_freq": 4, "index_topk_pattern": None,
        "indexer_rope_interleave": True, "intermediate_size": 12288, "kv_lora_rank": 512,
        "max_position_embeddings": 1048576, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
        "moe_router_dtype": "float32", "n_group": 1, "n_routed_experts": 256, "n_shared_experts": 1,
        "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 8, "num_hidden_layers": 78,
        "num_key_value_heads": 64, "num_nextn_predict_layers": 1, "pad_token_id": 154820, "q_lora_rank": 2048,
        "qk_head_dim": 256, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05,
        "rope_interleave": True, "rope_parameters": {"rope_theta": 8000000, "rope_type": "default"},
        "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 1,
        "topk_method": "noaux_tc", "vocab_size": 154880}
    hf = transformers.GlmMoeDsaConfig(**{k: v for k, v in published.items()
                                         if k not in ("architectures", "model_type")})
    ours = TargetConfig.from_dict(published)
    assert ours.indexer_full == [t == "full" for t in hf.indexer_types]
    assert [i for i, full in enumerate(ours.indexer_full) if full] == [0, 1, 2, *range(6, 78, 4)]
    assert ours.moe_layers == [t == "sparse" for t in hf.mlp_layer_types]
    assert (ours.num_hidden_layers, ours.q_lora_rank, ours.v_head_dim, ours.index_n_heads, ours.index_interleave,
            ours.eos_token_ids, ours.rope_theta) == (78, 2048, 256, 32, True, [154820, 154827, 154829], 8000000)
    written = TargetConfig.from_dict({**published, "indexer_types": hf.indexer_types})
    assert written.indexer_full == ours.indexer_full


def test_a_shared_layer_s_indexer_weights_are_not_read(checkpoint, tmp_path):
    """A GLM-MoE-DSA checkpoint that keeps an indexer on a "shared" layer (layer 1 of the "FSF"
    tiny model: a copy of layer 0's), as checkpoints trained with every indexer may, loads and
    decodes as the one without (transformers builds none there); a full layer's indexer weights
    missing are still refused."""
    target_dir, _ = checkpoint
    if TargetConfig.from_dict(json.loads((target_dir / "config.json").read_text())).indexer_full[1]:
        pytest.skip("every layer of this model type runs an indexer")

    def add_indexer(w):
        for key in [k for k in w if k.startswith("model.layers.0.self_attn.indexer.")]:
            w[key.replace("model.layers.0.", "model.layers.1.")] = w[key].clone()

    kept = edited_checkpoint(target_dir, tmp_path / "kept", state=add_indexer)
    torch.testing.assert_close(_logits(TargetModel.from_pretrained(kept, torch.float32)),
                               _logits(TargetModel.from_pretrained(target_dir, torch.float32)), rtol=0, atol=0)

    def drop_indexer(w):
        for key in [k for k in w if k.startswith("model.layers.2.self_attn.indexer.wk.")]:
            del w[key]

    with pytest.raises(DFlashError, match=r"model\.layers\.2\.self_attn\.indexer\.wk\.weight") as err:
        TargetModel.from_pretrained(edited_checkpoint(target_dir, tmp_path / "missing", state=drop_indexer),
                                    torch.float32)
    assert "\n" not in str(err.value)
