"""The target model against transformers' own classes (the oracle), float32.

For each tiny random checkpoint (saved by transformers' Qwen3ForCausalLM,
LlamaForCausalLM or Qwen2ForCausalLM) our TargetModel must reproduce the logits and
every layer's output (layer l == Hugging Face ``hidden_states[l + 1]``) within a
relative error of 1e-4, in a full forward and through the static KV cache
(prefill, one-token steps, rollback and overwrite, fixed-shape attention).
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import load_hf, make_target
from dflash_torch import DFlashError
from dflash_torch.models.config import TargetConfig
from dflash_torch.models.target import TargetModel

RTOL = 1e-4

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}

# name: (family, make_target overrides, prompt length)
CASES = {
    "qwen3-gqa-tied": ("qwen3", {}, 48),
    "qwen3-mha-untied": ("qwen3", {"num_key_value_heads": 4, "tie_word_embeddings": False}, 48),
    # positions up to 3x original_max_position_embeddings: the scaled low/medium frequencies matter
    "llama3-rope-scaling-untied-gqa": ("llama", {"rope_scaling": LLAMA3_SCALING, "num_key_value_heads": 1,
                                                 "tie_word_embeddings": False}, 192),
    "llama-tied": ("llama", {}, 48),
    "llama-attention-bias": ("llama", {"attention_bias": True}, 48),  # q/k/v and o_proj biases
    "qwen3-attention-bias": ("qwen3", {"attention_bias": True}, 48),  # (as Llama's; was refused for its o_proj.bias)
    "qwen2-bias-sharded-untied": ("qwen2", {"tie_word_embeddings": False, "max_shard_size": "150KB"}, 48),
}


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).norm() / ref.float().norm())


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    family, overrides, length = CASES[request.param]
    path = make_target(tmp_path_factory.mktemp(request.param), family, tokenizer=False, **overrides)
    hf = load_hf(path)
    ours = TargetModel.from_pretrained(path, torch.float32)
    g = torch.Generator().manual_seed(len(request.param))
    ids = torch.randint(0, hf.config.vocab_size, (length,), generator=g)
    return request.param, path, hf, ours, ids


def hf_forward(hf, ids: torch.Tensor):
    with torch.no_grad():
        out = hf(ids[None], output_hidden_states=True)
    return out.logits[0], [h[0] for h in out.hidden_states]


def test_checkpoint_layout_is_what_the_case_claims(case):
    name, path, hf, ours, _ = case
    cfg = TargetConfig.from_dict(json.loads((path / "config.json").read_text()))
    if "sharded" in name:
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        assert not (path / "model.safetensors").exists()
    if "bias" in name:
        assert cfg.attention_bias and ours.model.layers[0].self_attn.q_proj.bias is not None
        assert (ours.model.layers[0].self_attn.o_proj.bias is not None) == (cfg.model_type != "qwen2")
    if "rope-scaling" in name:
        assert cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "llama3"
    tied = ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    assert tied == ("untied" not in name)
    assert cfg.num_key_value_heads == hf.config.num_key_value_heads


def _matches_transformers(path, n: int = 40) -> None:
    """Our target's logits over ``n`` positions (from 3 on) == transformers' (float32)."""
    hf = load_hf(path)
    ids = torch.arange(3, 3 + n)
    ours = TargetModel.from_pretrained(path, torch.float32)
    cache = ours.new_cache()
    cache.reset(n)
    with torch.no_grad():
        logits, _ = ours(ids, torch.arange(n), cache, n, [0])
        ref = hf(ids[None]).logits[0]
    assert rel_err(logits, ref) <= RTOL


def test_a_single_file_beside_an_index_is_read_as_transformers_reads_it(tmp_path):
    """A directory holding both ``model.safetensors`` and a sharded copy (index + shards) of
    other weights (a stale re-save): the single file is read, as transformers reads it (the
    index used to win: other weights, silently); the index's shards need not be whole then."""
    from safetensors.torch import load_file, save_file

    path = make_target(tmp_path / "both", "qwen3", tokenizer=False, max_shard_size="150KB")
    shards = sorted(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values()))
    state = load_file(str(path / shards[0]))
    for s in shards[1:]:
        state.update(load_file(str(path / s)))
    g = torch.Generator().manual_seed(0)
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=g) if v.dim() == 2 else v for k, v in state.items()},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / shards[-1]).unlink()  # (transformers reads none of them)
    _matches_transformers(path, 9)


def test_full_forward_logits_and_every_layer_match_transformers(case):
    name, _, hf, ours, ids = case
    ref_logits, ref_hidden = hf_forward(hf, ids)
    L, H = ours.config.num_hidden_layers, ours.config.hidden_size
    cache = ours.new_cache()
    cache.reset(len(ids))
    with torch.no_grad():
        logits, feats = ours(ids, torch.arange(len(ids)), cache, len(ids), list(range(L)))
    assert logits.dtype == torch.float32
    assert rel_err(logits, ref_logits) <= RTOL, name
    assert feats.shape == (len(ids), L * H)
    for layer in range(L):
        err = rel_err(feats[:, layer * H:(layer + 1) * H], ref_hidden[layer + 1])
        assert err <= RTOL, f"{name}: layer {layer} vs hidden_states[{layer + 1}]: rel err {err:.2e}"
    # a sparse, unordered choice of layers is concatenated in the order asked for
    pick = [L - 2, 0]
    with torch.no_grad():
        _, two = ours(ids, torch.arange(len(ids)), cache, len(ids), pick)
    assert torch.equal(two, torch.cat([feats[:, l * H:(l + 1) * H] for l in pick], dim=-1))


@pytest.mark.parametrize("static", [False, True], ids=["sliced", "fixed-shape"])
def test_static_cache_incremental_decoding_and_rollback(case, static):
    """Prefill, one-token steps, then a rollback and an overwrite with different tokens:
    every step's logits equal transformers' full forward of the sequence so far."""
    name, _, hf, ours, ids = case
    T = len(ids)
    P, steps = T - 6, 6
    L = ours.config.num_hidden_layers
    cache = ours.new_cache()
    cache.reset(T + 16)
    kv = (lambda end: None) if static else (lambda end: end)
    ref_logits, ref_hidden = hf_forward(hf, ids)
    with torch.no_grad():
        logits, _ = ours(ids[:P], torch.arange(P), cache, kv(P), logits_from=P - 1)
        assert logits.shape[0] == 1
        assert rel_err(logits, ref_logits[P - 1:P]) <= RTOL
        for t in range(P, P + steps):
            logits, feats = ours(ids[t:t + 1], torch.tensor([t]), cache, kv(t + 1), [L // 2])
            assert rel_err(logits, ref_logits[t:t + 1]) <= RTOL, f"{name}: step at position {t}"
            assert rel_err(feats, ref_hidden[L // 2 + 1][t:t + 1]) <= RTOL
        # rollback to P + 2 committed positions, then overwrite P+2.. with other tokens in one block
        keep = P + 2
        new_tail = (ids[keep:keep + 4] + 7) % ours.config.vocab_size
        seq2 = torch.cat([ids[:keep], new_tail])
        ref2, _ = hf_forward(hf, seq2)
        logits, _ = ours(new_tail, torch.arange(keep, keep + 4), cache, kv(keep + 4))
        assert rel_err(logits, ref2[keep:]) <= RTOL, f"{name}: block after rollback"
        # and a single step after that block
        nxt = torch.tensor([int(ref2[-1].argmax())])
        ref3, _ = hf_forward(hf, torch.cat([seq2, nxt]))
        logits, _ = ours(nxt, torch.tensor([keep + 4]), cache, kv(keep + 5))
        assert rel_err(logits, ref3[-1:]) <= RTOL


def test_an_index_entry_written_with_a_leading_dot_slash_is_the_same_shard(tmp_path):
    """``"./model-00002-of-00003.safetensors"`` for some weights of a shard the index names
    plainly for others: one file, read once (it was read as two: "weight X is in both
    model-00002... and model-00002..."), as transformers reads it."""
    path = make_target(tmp_path / "dot", "qwen3", tokenizer=False, max_shard_size="150KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    names = sorted(index["weight_map"])
    for name in names[::2]:
        index["weight_map"][name] = "./" + index["weight_map"][name]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    _matches_transformers(path, 9)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_config_without_tie_word_embeddings_is_untied_as_in_transformers(tmp_path, family):
    """transformers' Qwen3 / Qwen2 / Llama configs default to an untied head: a config.json
    that omits the key runs the checkpoint's own lm_head.weight (it was dropped for the
    embeddings before)."""
    from conftest import edited_checkpoint

    src = make_target(tmp_path / "src", family, tokenizer=False, tie_word_embeddings=False)
    path = edited_checkpoint(src, tmp_path / "no-key", config=lambda c: c.pop("tie_word_embeddings"))
    hf = load_hf(path)
    assert not hf.config.tie_word_embeddings
    ours = TargetModel.from_pretrained(path, torch.float32)
    assert ours.lm_head.weight.data_ptr() != ours.model.embed_tokens.weight.data_ptr()
    ids = torch.arange(3, 40)
    ref, _ = hf_forward(hf, ids)
    cache = ours.new_cache()
    cache.reset(len(ids))
    with torch.no_grad():
        logits, _ = ours(ids, torch.arange(len(ids)), cache, len(ids), [0])
    assert rel_err(logits, ref) <= RTOL


def test_tied_target_stored_as_its_head_alone_runs_as_transformers_runs_it(tiny_pair, tmp_path):
    """tie_word_embeddings true with the shared table stored as lm_head.weight only (no
    model.embed_tokens.weight): transformers ties it and runs it; it was refused, "lacks
    weights: model.embed_tokens.weight". The head is the embedding too: greedy decoding (the
    target alone, with the drafter, batched) gives transformers' tokens."""
    from safetensors.torch import load_file

    from conftest import check_greedy_equals_transformers, edited_checkpoint

    target, drafter = tiny_pair

    def head_only(w):
        w["lm_head.weight"] = w.pop("model.embed_tokens.weight")

    path = edited_checkpoint(target, tmp_path / "head-only", state=head_only)
    stored = load_file(str(path / "model.safetensors"))
    assert "model.embed_tokens.weight" not in stored and json.loads((path / "config.json").read_text())["tie_word_embeddings"]
    hf = load_hf(path)  # (the oracle reads the head as the embedding too)
    assert torch.equal(hf.model.embed_tokens.weight, stored["lm_head.weight"])
    model = TargetModel.from_pretrained(path, torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.model.embed_tokens.weight, stored["lm_head.weight"])
    check_greedy_equals_transformers(path, drafter, block_sizes=(16,))


def test_tied_config_with_a_head_of_its_own_is_refused(tmp_path):
    """tie_word_embeddings true and an lm_head.weight unlike the embeddings: which one the
    author meant is unknown, so the checkpoint is refused, not run with one of them dropped;
    a stored head equal to the embeddings loads."""
    from conftest import edited_checkpoint
    from dflash_torch.errors import DFlashError

    src = make_target(tmp_path / "src", "qwen3", tokenizer=False, tie_word_embeddings=False)
    bad = edited_checkpoint(src, tmp_path / "bad", config=lambda c: c.update(tie_word_embeddings=True))
    with pytest.raises(DFlashError, match="ties the output head.*lm_head.weight of its own"):
        TargetModel.from_pretrained(bad, torch.float32)

    def same_head(w):
        w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()

    good = edited_checkpoint(src, tmp_path / "good", config=lambda c: c.update(tie_word_embeddings=True), state=same_head)
    model = TargetModel.from_pretrained(good, torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_a_dtype_auto_config_loads_as_transformers_loads_it(tmp_path, caplog, key):
    """``"dtype": "auto"`` in config.json (target and drafter): transformers' model loader reads
    it given a dtype, but its config class alone takes it for ``torch.auto``: the target was
    refused ("cannot load the tokenizer ...: module 'torch' has no attribute 'auto'") and a
    drafter's config lost transformers' defaults with a WARNING. In ``text_config``, where
    transformers' config classes fail on it whatever the loader, it is refused in one line."""
    import transformers

    from conftest import drafter_config, hf_greedy, save_drafter
    from dflash_torch import DFlashEngine, DFlashError

    target = make_target(tmp_path / "t", "llama")
    drafter = save_drafter(tmp_path / "d", drafter_config(target, block_size=4))
    for path in (target, drafter):
        cfg = json.loads((path / "config.json").read_text())
        cfg.pop("dtype", None), cfg.pop("torch_dtype", None)
        (path / "config.json").write_text(json.dumps(dict(cfg, **{key: "auto"})))
    with caplog.at_level("WARNING", logger="dflash_torch"):
        spec = DFlashEngine.from_pretrained(target, drafter, dtype="float32")
    assert [r.getMessage() for r in caplog.records if r.name == "dflash_torch"] == []
    prompt = list(range(5, 25))
    # (transformers' AutoModelForCausalLM reads it given a dtype; LlamaForCausalLM.from_pretrained fails on it too)
    ref = hf_greedy(transformers.AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval(), prompt, 16)
    assert spec.generate(prompt, max_new_tokens=16, ignore_eos=True).token_ids == ref
    cfg = json.loads((target / "config.json").read_text())
    with pytest.raises(DFlashError, match=rf"^target config.json text_config.{key} 'auto' is not read by transformers' "
                                          r"config classes \(they fail on it; only a top-level dtype may be 'auto'\)"):
        TargetConfig.from_dict(dict(cfg, text_config={key: "auto"}))


SLIDING_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_sliding_layer_types_without_a_window_are_refused_like_a_drafter_s(tmp_path, family):
    """``layer_types`` naming sliding layers while ``use_sliding_window`` is false or absent:
    transformers' config drops the window and its forward fails; dflash-torch ran the model
    silently with full attention. Refused in one line."""
    path = make_target(tmp_path / "t", family, tokenizer=False)
    cfg = json.loads((path / "config.json").read_text())
    for use in ({}, {"use_sliding_window": False}):
        edited = {**{k: v for k, v in cfg.items() if k != "use_sliding_window"}, "layer_types": SLIDING_TYPES,
                  "sliding_window": 8, **use}
        hf = transformers_config(edited)
        assert hf.sliding_window is None and hf.layer_types == SLIDING_TYPES
        with pytest.raises(DFlashError, match=r"^target config.json layer_types has sliding_attention layers but no "
                                              r"window \(sliding_window is null, or use_sliding_window false turns it "
                                              r"off, as transformers reads the file\)"):
            TargetConfig.from_dict(edited)
    with pytest.raises(DFlashError, match=rf"^target config.json slides 2 of 4 layers over 8 tokens \(use_sliding_window "
                                          rf"true\): sliding-window attention is not supported for model_type '{family}'$"):
        TargetConfig.from_dict(dict(cfg, layer_types=SLIDING_TYPES, sliding_window=8, use_sliding_window=True))


@pytest.mark.parametrize("family, edit", [
    ("qwen2", {"max_window_layers": 4}), ("qwen3", {"max_window_layers": 6}),
    ("qwen3", {"layer_types": ["full_attention"] * 4}), ("qwen2", {"sliding_window": None}),
    ("llama", {}),  # (transformers' Llama reads neither key: no window)
], ids=["qwen2-max-window-layers", "qwen3-max-window-layers", "qwen3-all-full", "qwen2-null-window", "llama"])
def test_use_sliding_window_where_no_layer_slides_runs_as_transformers(tmp_path, family, edit):
    """``use_sliding_window: true`` was refused even where no layer slides as transformers reads
    the file (every layer below ``max_window_layers``, every layer full, a null window) or where
    the family reads no window (llama)."""
    path = make_target(tmp_path / "t", family, tokenizer=False)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("layer_types", None)  # (as saved: derived from max_window_layers, all full)
    cfg.update({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0, **edit})
    (path / "config.json").write_text(json.dumps(cfg))
    assert "sliding_attention" not in (getattr(transformers_config(cfg), "layer_types", None) or [])
    _matches_transformers(path)


def test_qwen3_moe_slides_every_layer_where_transformers_gives_a_window(tmp_path):
    from conftest import make_hybrid_target

    path = make_hybrid_target(tmp_path / "moe", "qwen3_moe", tokenizer=False)
    cfg = json.loads((path / "config.json").read_text())
    with pytest.raises(DFlashError, match=r"^target config.json slides 6 of 6 layers over 8 tokens"):
        TargetConfig.from_dict(dict(cfg, use_sliding_window=True, sliding_window=8))
    without = {k: v for k, v in cfg.items() if k != "sliding_window"}
    with pytest.raises(DFlashError, match=r"^target config.json slides 6 of 6 layers over 4096 tokens"):
        TargetConfig.from_dict(dict(without, use_sliding_window=True))  # (transformers' default window)
    assert TargetConfig.from_dict(dict(cfg, use_sliding_window=True, sliding_window=None)).moe is not None
    # (transformers' Qwen3-MoE reads no layer types: all full attention without a window)
    assert TargetConfig.from_dict(dict(cfg, layer_types=["sliding_attention"] * 6, sliding_window=8)).moe is not None


def transformers_config(cfg: dict):
    """transformers' config object of a config.json dict."""
    import transformers

    return transformers.AutoConfig.for_model(**cfg)
