"""Joined projections (dflash_torch.models.fusing): a fused target still matches
transformers' own classes (the oracle) and the unfused model; fused decoding (eager,
recompute, DFlash 2, compiled with inductor, batched) commits exactly the tokens of
unfused target-only decoding; no weight is lost or kept twice."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import (load_hf, make_gemma4_target, make_hybrid_target, make_minimax_m2_target, make_target, run_rounds,
                      varied_prompts)
from dflash_torch.decoding import SpeculativeDecoder
from dflash_torch.engine import DFlashEngine
from dflash_torch.models.attention import Attention
from dflash_torch.models.drafter import DFlashDrafter
from dflash_torch.models.fusing import fuse_projections
from dflash_torch.models.gated_deltanet import GatedDeltaNet
from dflash_torch.models.layers import MLP
from dflash_torch.models.target import TargetModel

RTOL = 1e-4

CASES = {  # name: (builder, family, overrides)
    "qwen3": (make_target, "qwen3", {}),
    "llama-attention-bias": (make_target, "llama", {"attention_bias": True}),  # q/k/v and o biases
    "qwen2-bias": (make_target, "qwen2", {"tie_word_embeddings": False}),
    "qwen3.5-gated-attention": (make_hybrid_target, "qwen3_5_text", {}),  # q_proj also yields the output gate
    "qwen3-next-shared-expert": (make_hybrid_target, "qwen3_next", {}),  # the shared expert is a SwiGLU MLP
    # GeGLU MLPs; the full-attention layer's values come from k_proj (no v part in qkv_proj)
    "gemma4-k-eq-v": (lambda out, family, **kw: make_gemma4_target(out, multimodal=False, moe=True, **kw), "gemma4", {}),
    # q/k norms over the whole projection, after splitting the joined qkv_proj's output
    "minimax_m2-whole-projection-norm": (lambda out, family, **kw: make_minimax_m2_target(out, **kw), "minimax_m2", {}),
}


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).norm() / ref.float().norm())


def _forward(model: TargetModel, ids: torch.Tensor, static: bool):
    cache = model.new_cache()
    cache.reset(len(ids) + 8)
    L = model.config.num_hidden_layers
    with torch.no_grad():
        return model(ids, torch.arange(len(ids)), cache, None if static else len(ids), list(range(L)))


@pytest.mark.parametrize("name", list(CASES))
def test_fused_target_matches_transformers_and_the_unfused_model(name, tmp_path):
    build, family, overrides = CASES[name]
    path = build(tmp_path / name, family, tokenizer=False, **overrides)
    plain = TargetModel.from_pretrained(path, torch.float32)
    fused = copy.deepcopy(plain)
    n_params = sum(p.numel() for p in plain.parameters())
    changed = fuse_projections(fused, query=True)
    attns = [m for m in fused.modules() if isinstance(m, Attention)]
    mlps = [m for m in fused.modules() if isinstance(m, MLP)]
    gdns = [m for m in fused.modules() if isinstance(m, GatedDeltaNet)]
    assert attns and changed == len(attns) + len(mlps) + len(gdns)
    assert bool(gdns) == (build is make_hybrid_target)
    assert all(m.in_proj is not None and not hasattr(m, "in_proj_z") for m in gdns)
    assert all(a.qkv_proj is not None and not hasattr(a, "q_proj") and not hasattr(a, "k_proj") for a in attns)
    assert all(m.gate_up_proj is not None and not hasattr(m, "up_proj") for m in mlps)
    assert sum(p.numel() for p in fused.parameters()) == n_params  # nothing dropped, nothing kept twice
    assert fuse_projections(fused, query=True) == 0  # joined once only

    ids = torch.randint(0, plain.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = load_hf(path)(ids[None], output_hidden_states=True)
    H = plain.config.hidden_size
    for static in (False, True):
        logits, feats = _forward(fused, ids, static)
        assert rel_err(logits, ref.logits[0]) <= RTOL, (name, static)
        for layer in range(plain.config.num_hidden_layers):
            assert rel_err(feats[:, layer * H:(layer + 1) * H], ref.hidden_states[layer + 1][0]) <= RTOL, (name, layer)
        plain_logits, plain_feats = _forward(plain, ids, static)
        torch.testing.assert_close(logits, plain_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(feats, plain_feats, rtol=1e-5, atol=1e-5)


def _pair(pair, fuse: bool):
    target = TargetModel.from_pretrained(pair[0], torch.float32)
    drafter = DFlashDrafter.from_pretrained(pair[1], torch.float32)
    if fuse:
        fuse_projections(target, query=True)
        assert fuse_projections(drafter, query=False) > 0
        attn = drafter.layers[0].self_attn
        assert attn.kv_proj is not None and attn.q_proj is not None and not hasattr(attn, "v_proj")
    return target, drafter


@pytest.mark.parametrize("which", ["dflash", "dflash2", "hybrid"])
def test_fused_speculative_decoding_equals_unfused_target_only(which, agree_pair, agree_dflash2_pair,
                                                                agree_hybrid_pair):
    pair = {"dflash": agree_pair, "dflash2": agree_dflash2_pair, "hybrid": agree_hybrid_pair}[which]
    target, drafter = _pair(pair, fuse=True)
    plain_target, _ = _pair(pair, fuse=False)
    baseline = SpeculativeDecoder(plain_target, None)
    modes = [SpeculativeDecoder(target, drafter), SpeculativeDecoder(target, drafter, static=True, max_context=256)]
    if which != "hybrid":
        modes.append(SpeculativeDecoder(target, drafter, draft_mode="recompute"))
    taus = []
    for prompt in varied_prompts(plain_target, 3, seed=2, length=6):
        want = run_rounds(baseline, prompt, 40)[0]
        for decoder in modes:
            got, t = run_rounds(decoder, prompt, 40)
            assert got == want, (which, decoder.draft_mode, decoder.static)
            taus += t
    assert max(taus) > 1  # drafts were accepted: the fused drafter's blocks were verified, not just rejected


def test_fused_inductor_compiled_rounds_are_lossless(agree_pair):
    """The compiled (inductor) path a CUDA engine takes, with joined projections."""
    target, drafter = _pair(agree_pair, fuse=True)
    torch._dynamo.reset()
    compiled = SpeculativeDecoder(target, drafter, compile=True, max_context=256, prefill_chunk=32)
    baseline = SpeculativeDecoder(_pair(agree_pair, fuse=False)[0], None)
    out, taus = run_rounds(compiled, list(range(2, 40)), 40)
    assert out == run_rounds(baseline, list(range(2, 40)), 40)[0]
    assert max(taus) > 1


@pytest.mark.parametrize("pair", ["agree_pair", "agree_hybrid_pair"])
def test_engine_joins_projections_on_request_and_by_default_on_cuda_only(pair, request):
    agree_pair = request.getfixturevalue(pair)
    prompts = ["abc", "hello there", "x = 1"]
    plain = DFlashEngine.from_pretrained(*agree_pair)
    attention = lambda engine: next(m for m in engine.target.modules() if isinstance(m, Attention))  # noqa: E731
    assert attention(plain).qkv_proj is None  # CPU default: separate projections
    fused = DFlashEngine.from_pretrained(*agree_pair, fuse=True)
    assert attention(fused).qkv_proj is not None
    assert fused.drafter.layers[0].self_attn.kv_proj is not None
    assert all(m.in_proj is not None for m in fused.target.modules() if isinstance(m, GatedDeltaNet))
    batch = fused.generate_batch(prompts, max_new_tokens=24, ignore_eos=True)
    for prompt, got in zip(prompts, batch):
        want = plain.generate(prompt, max_new_tokens=24, ignore_eos=True)
        assert got.token_ids == want.token_ids
    if torch.cuda.is_available():
        assert attention(DFlashEngine.from_pretrained(*agree_pair, device="cuda")).qkv_proj is not None
