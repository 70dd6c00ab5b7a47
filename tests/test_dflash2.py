"""DFlash 2 drafters: the published format loads (and malformed ones are refused), the
grouped dynamic convolution equals a plain per-row loop, the candidate walk equals a
brute-force reference (greedy, and exactly distributed when sampling), identity
convolutions with zero codebooks propose exactly what the same backbone proposes as a
DFlash drafter, and greedy speculative decoding with random DFlash 2 drafters equals
target-only decoding in every mode (inject, recompute, fixed shapes, compiled, with no
recompilation after warm-up)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils as dynamo_utils
from safetensors.torch import save_file
from scipy.stats import chisquare

from conftest import dflash2_config, make_dflash2_from, run_rounds, save_drafter
from dflash_torch import DFlashEngine, DFlashError, SamplingParams
from dflash_torch.decoding import SpeculativeDecoder
from dflash_torch.models.dflash2 import DFlash2Drafter, GroupedDynamicConv, walk
from dflash_torch.models.drafter import DFlashDrafter, InjectedContext
from dflash_torch.models.target import TargetModel

H, V = 64, 320  # the tiny targets of conftest


# --- the published format ---------------------------------------------------------------

def published_config(**dflash_overrides) -> dict:
    """A DFlash 2 config.json as published: the DFlash 2 keys in dflash_config (block size
    only there), a sliding-window layer, is_causal false."""
    dflash = dict(block_size=8, mask_token_id=1, target_layer_ids=[1, 2], conv_kernel_size=2, conv_group_size=16,
                  selector_rank=32, selector_top_k=16, input_embedding_scale=1.5, output_multiplier=0.8,
                  final_logit_softcapping=30.0)
    dflash.update(dflash_overrides)
    return dict(architectures=["DFlash2DraftModel"], model_type="qwen3", hidden_size=H, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128, rms_norm_eps=1e-6,
                rope_theta=10000.0, attention_bias=False, hidden_act="silu", vocab_size=V, num_target_layers=4,
                layer_types=["sliding_attention", "full_attention"], sliding_window=8, use_sliding_window=True,
                is_causal=False,
                dflash_config=dflash)


def published_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the published names and shapes, written out here from the
    format's description (hidden 64, taps 2, groups 64 / 16 = 4, rank 32, vocab 320)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"fc.weight": (H, 2 * H), "hidden_norm.weight": (H,), "norm.weight": (H,),
              "candidate_selector.predecessor_codebook": (V, 32), "candidate_selector.successor_codebook": (V, 32),
              "candidate_selector.hidden_projection.weight": (32, H)}
    for i in range(2):
        p = f"layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (64, H), p + "self_attn.k_proj.weight": (32, H),
                       p + "self_attn.v_proj.weight": (32, H), p + "self_attn.o_proj.weight": (H, 64),
                       p + "self_attn.q_norm.weight": (16,), p + "self_attn.k_norm.weight": (16,),
                       p + "mlp.gate_proj.weight": (128, H), p + "mlp.up_proj.weight": (128, H),
                       p + "mlp.down_proj.weight": (H, 128), p + "input_layernorm.weight": (H,),
                       p + "post_attention_layernorm.weight": (H,)})
        for conv in ("attention_conv", "mlp_conv"):
            shapes[f"{p}{conv}.base_kernel"] = (2, 2, H)
            shapes[f"{p}{conv}.kernel_projection.weight"] = (2 * 2 * 4, H)
    return {k: torch.randn(s, generator=g) * (1.0 if len(s) == 1 or "codebook" in k else 0.08) for k, s in shapes.items()}


def write_checkpoint(out: Path, cfg: dict, tensors: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_published_checkpoint_loads_with_every_weight(tiny_pair, tmp_path):
    target, _ = tiny_pair
    tensors = published_tensors()
    ckpt = write_checkpoint(tmp_path / "v2", published_config(), tensors)
    engine = DFlashEngine.from_pretrained(target, ckpt)
    drafter = engine.drafter
    assert isinstance(drafter, DFlash2Drafter) and engine.block_size == 8
    s = drafter.config.dflash2
    assert (s.conv_kernel_size, s.conv_group_size, s.selector_rank, s.selector_top_k) == (2, 16, 32, 16)
    assert (s.input_embedding_scale, s.output_multiplier, s.final_logit_softcapping) == (1.5, 0.8, 30.0)
    assert drafter.config.sliding_windows == [8, None] and drafter.config.target_layer_ids == [1, 2]
    state = drafter.state_dict()
    assert state.keys() == tensors.keys()
    for k, v in tensors.items():
        assert torch.equal(state[k], v), k
    base = DFlashEngine(engine.target, engine.tokenizer)
    out = engine.generate("def f(x):", max_new_tokens=20, ignore_eos=True)
    assert out.token_ids == base.generate("def f(x):", max_new_tokens=20, ignore_eos=True).token_ids
    # the exported config reads back the same
    from dflash_torch.models.drafter_config import DrafterConfig
    assert DrafterConfig.from_dict(drafter.config.to_dict()) == drafter.config
    # input_embedding_scale multiplies the block's embeddings
    unscaled = write_checkpoint(tmp_path / "v2-unscaled", published_config(input_embedding_scale=1.0), tensors)
    plain = DFlashDrafter.from_pretrained(unscaled, torch.float32)
    block, positions = torch.tensor([7] + [1] * 7), torch.arange(9, 17)
    outs = []
    for d, scale in ((drafter, 1.0), (plain, 1.5)):
        ctx = InjectedContext(d)
        ctx.reset(17)
        ctx.inject(d, torch.ones(9, 128), torch.arange(9))
        with torch.no_grad():
            outs.append(d(engine.target.embed(block) * scale, positions, ctx, 17))
    torch.testing.assert_close(outs[0], outs[1])


CONFIG_ERRORS = {
    "missing-top-k": (dict(selector_top_k=None), "selector_top_k"),
    "group-does-not-divide": (dict(conv_group_size=24), "conv_group_size 24 does not divide"),
    "top-k-above-vocab": (dict(selector_top_k=V + 1), "exceeds vocab_size"),
    "zero-rank": (dict(selector_rank=0), "selector_rank"),
    "negative-softcap": (dict(final_logit_softcapping=-1.0), "final_logit_softcapping"),
    "causal-block": (dict(is_causal=True), "is_causal"),
    # (Laguna's DFlash key, read for DFlash drafters: a DFlash 2 one runs non-causal block attention only)
    "causal-block-dflash-config": (dict(causal=True), "sets causal=True; only causal=False is supported"),
    "shift-label-variant": (dict(shift_label=True), "shift_label"),
    "anchor-sampling-variant": (dict(sample_from_anchor=True), "sample_from_anchor true"),
    "selector-vocab-below-top-k": (dict(selector_vocab_size=8), "selector_vocab_size must be an integer from "
                                                                "selector_top_k (16) to vocab_size (320), got 8"),
    "selector-vocab-above-vocab": (dict(selector_vocab_size=V + 1), "selector_vocab_size"),
    # block_size at the top level too, another value: which one the drafter was trained for is unknown
    "two-block-sizes": (dict(top_block_size=16), "two block sizes: block_size 16 and dflash_config.block_size 8"),
}


@pytest.mark.parametrize("case", list(CONFIG_ERRORS))
def test_malformed_dflash2_configs_are_refused_in_one_line(tiny_pair, tmp_path, case):
    target, _ = tiny_pair
    change, words = CONFIG_ERRORS[case]
    cfg = published_config()
    for k, v in change.items():
        if v is None:
            del cfg["dflash_config"][k]
        elif k == "is_causal":
            cfg[k] = v
        elif k == "top_block_size":
            cfg["block_size"] = v
        else:
            cfg["dflash_config"][k] = v
    ckpt = write_checkpoint(tmp_path / case, cfg, published_tensors())
    with pytest.raises(DFlashError) as err:
        DFlashEngine.from_pretrained(target, ckpt)
    assert "\n" not in str(err.value) and words in str(err.value), str(err.value)


def test_a_null_top_level_block_size_defers_to_dflash_config(tiny_pair, tmp_path):
    """``"block_size": null`` beside ``dflash_config.block_size`` 8 (helper-28: "has no block_size")."""
    cfg = published_config()
    cfg["block_size"] = None
    engine = DFlashEngine.from_pretrained(tiny_pair[0], write_checkpoint(tmp_path / "null", cfg, published_tensors()))
    assert engine.block_size == 8
    del cfg["dflash_config"]["block_size"]
    with pytest.raises(DFlashError, match="has no block_size"):
        DFlashEngine.from_pretrained(tiny_pair[0], write_checkpoint(tmp_path / "none", cfg, published_tensors()))


@pytest.mark.parametrize("case", ["lacks-codebook", "extra-tensor", "wrong-kernel-shape", "nan-codebook"])
def test_dflash2_weights_must_match_exactly(tiny_pair, tmp_path, case):
    """Missing, unknown, misshaped and non-finite weights are refused in one line (a NaN
    codebook, as a diverged training run leaves, made sampled rounds raise torch's
    "probability tensor contains either inf, nan" from the walk)."""
    target, _ = tiny_pair
    tensors = published_tensors()
    if case == "lacks-codebook":
        del tensors["candidate_selector.successor_codebook"]
        words = "lacks weights: candidate_selector.successor_codebook"
    elif case == "extra-tensor":
        tensors["candidate_selector.bias"] = torch.zeros(V)
        words = "DFlash 2 drafter does not use"
    elif case == "nan-codebook":
        tensors["candidate_selector.predecessor_codebook"][3, 1] = float("nan")
        words = "drafter weight candidate_selector.predecessor_codebook holds NaN or infinite values"
    else:
        tensors["layers.1.mlp_conv.base_kernel"] = torch.zeros(2, 3, H)
        words = "layers.1.mlp_conv.base_kernel has shape (2, 3, 64)"
    ckpt = write_checkpoint(tmp_path / case, published_config(), tensors)
    with pytest.raises(DFlashError) as err:
        DFlashEngine.from_pretrained(target, ckpt)
    assert "\n" not in str(err.value) and words in str(err.value), str(err.value)


# --- the grouped dynamic convolution -------------------------------------------------------

def reference_conv(x, base, delta, block_len):
    """y[i, c] = sum_t (base[t, c] + delta[i, t, c // group]) * x[i - t, c], zero before the block, row by row."""
    T, hidden = x.shape
    group = hidden // delta.shape[-1]
    y = torch.zeros_like(x)
    for i in range(T):
        start = i // block_len * block_len
        for t in range(base.shape[0]):
            if i - t >= start:
                for c in range(hidden):
                    y[i, c] += (base[t, c] + delta[i, t, c // group]) * x[i - t, c]
    return y


@pytest.mark.parametrize("taps,block_len", [(2, 4), (3, 4), (3, 2)], ids=["published-taps", "3-taps", "taps-past-block"])
def test_convolution_equals_a_per_row_loop(taps, block_len):
    torch.manual_seed(0)
    hidden, group = 32, 8
    conv = GroupedDynamicConv(hidden, taps, group)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(0, 0.3)
    x = torch.randn(4 * block_len, hidden)
    delta = (x @ conv.kernel_projection.weight.T).view(-1, 2, taps, hidden // group)  # [T, side, tap, group]
    y, delta_finish = conv.prepare(x, block_len)
    torch.testing.assert_close(y, reference_conv(x, conv.base_kernel[0], delta[:, 0], block_len))
    out = torch.randn_like(x)  # a sublayer's output
    torch.testing.assert_close(conv.finish(out, delta_finish, block_len),
                               reference_conv(out, conv.base_kernel[1], delta[:, 1], block_len))
    # a fresh module is the identity on both sides
    fresh = GroupedDynamicConv(hidden, taps, group)
    y0, d0 = fresh.prepare(x, block_len)
    assert torch.equal(y0, x) and torch.equal(fresh.finish(out, d0, block_len), out)


# --- the candidate walk ------------------------------------------------------------------

def reference_walk(unary, h, P, S, anchor, K):
    """The walk of the DFlash 2 description, slot by slot in plain Python (float64): candidates
    ranked by unary score then token id; from the chosen predecessor take the best edge
    score, ties to the lower rank."""
    tokens, pred = [], anchor
    for l in range(unary.shape[0]):
        ranked = sorted(range(unary.shape[1]), key=lambda v: (-float(unary[l, v]), v))[:K]
        scores = [float(unary[l, c]) + sum(float(P[pred, r] * h[l, r] * S[c, r]) for r in range(h.shape[1])) for c in ranked]
        best = max(range(K), key=lambda j: (scores[j], -j))
        pred = ranked[best]
        tokens.append(pred)
    return tokens


@torch.no_grad()
@pytest.mark.parametrize("scaled", [False, True], ids=["plain-logits", "multiplier-and-softcap"])
def test_greedy_walk_equals_the_brute_force_reference(tiny_pair, tmp_path, scaled):
    target_dir, _ = tiny_pair
    cfg = dflash2_config(target_dir, top_k=6)
    if scaled:
        cfg.dflash2.output_multiplier, cfg.dflash2.final_logit_softcapping = 3.0, 2.0
    target = TargetModel.from_pretrained(target_dir, torch.float32)
    drafter = DFlashDrafter.from_pretrained(save_drafter(tmp_path / "v2", cfg), torch.float32)
    sel = drafter.candidate_selector
    g = torch.Generator().manual_seed(3)
    departures = 0
    for trial in range(6):
        hidden = torch.randn(8, H, generator=g)  # a block: anchor row + 7 draft slots
        anchor = torch.randint(0, V, (), generator=g)
        ids, scores = drafter.draft_scores(hidden, anchor, target)
        tokens, q = drafter.choose_draft((ids, scores), SamplingParams(), None)
        assert q is None
        unary = (hidden[1:] @ target.lm_head.weight.T).double()
        if scaled:  # times the multiplier, then the soft cap
            unary = torch.tanh(unary * 3.0 / 2.0) * 2.0
        h = (hidden[1:] @ sel.hidden_projection.weight.T).double()
        want = reference_walk(unary, h, sel.predecessor_codebook.double(), sel.successor_codebook.double(), int(anchor), 6)
        assert tokens.tolist() == want
        # the lattice's edge scores themselves (a sampled walk draws from them): unary + pairwise
        pred = torch.cat([anchor.expand(1, 6), ids[:-1]])  # [slots, K] predecessors
        pair = torch.einsum("lir,lr,ljr->lij", sel.predecessor_codebook.double()[pred], h,
                            sel.successor_codebook.double()[ids])
        torch.testing.assert_close(scores.double(), unary.gather(-1, ids)[:, None, :] + pair, atol=1e-4, rtol=1e-4)
        departures += sum(t != int(u.argmax()) for t, u in zip(want, unary))
    assert departures > 5  # the pairwise term really changes choices


def test_ties_go_to_the_lower_id_then_the_lower_rank():
    from dflash_torch.models.dflash2 import CandidateSelector

    sel = CandidateSelector(8, 10, 2, 3)
    unary = torch.tensor([[0.0, 1.0, 5.0, 0.0, 5.0, 2.0, 0.0, 0.0, 0.0, 5.0]])
    values, ids = sel.candidates(unary)
    assert ids.tolist() == [[2, 4, 9]] and values.tolist() == [[5.0, 5.0, 5.0]]
    wide = CandidateSelector(8, 4096, 2, 16)  # (topk returns the tied ids of a flat row in no particular order)
    assert wide.candidates(torch.zeros(3, 4096))[1].tolist() == [list(range(16))] * 3
    # equal edge scores: the walk takes the lower rank
    choice = torch.tensor([[1, 1, 1], [2, 0, 1]])
    assert walk(choice).tolist() == [1, 0]
    scores = torch.tensor([[[1.0, 3.0, 3.0]] * 3, [[0.0, 0.0, 0.0], [7.0, 7.0, 1.0], [0.0, 0.0, 0.0]]])
    tokens, _ = tiny_dflash2(10).choose_draft((torch.tensor([[5, 6, 7], [1, 2, 3]]), scores), SamplingParams(), None)
    assert tokens.tolist() == [6, 1]


def test_sampled_walk_is_exactly_distributed_and_returns_its_q():
    """Paths of a random 3-slot, 3-candidate lattice: empirical frequencies against the
    product of the per-step softmax rows; q is each step's row on the vocabulary."""
    torch.manual_seed(0)
    ids = torch.tensor([[4, 1, 7], [2, 9, 4], [0, 3, 5]])
    scores = torch.randn(3, 3, 3)
    scores[0] = scores[0, 0]  # slot 0: every row is the anchor's
    T = 0.7
    rows = torch.softmax(scores.double() / T, dim=-1)
    exact = {}
    for r in itertools.product(range(3), repeat=3):
        exact[r] = float(rows[0, 0, r[0]] * rows[1, r[0], r[1]] * rows[2, r[1], r[2]])
    params = SamplingParams(temperature=T)
    drafter = tiny_dflash2(10)
    g = torch.Generator().manual_seed(1)
    counts, n = {}, 6000
    for _ in range(n):
        tokens, q = drafter.choose_draft((ids, scores), params, g)
        ranks = tuple(int((ids[l] == tokens[l]).nonzero()) for l in range(3))
        counts[ranks] = counts.get(ranks, 0) + 1
        prev = (0,) + ranks[:2]
        for l in range(3):
            want = torch.zeros(10, dtype=torch.float64)
            want[ids[l]] = rows[l, prev[l]]
            torch.testing.assert_close(q[l].double(), want, atol=1e-6, rtol=1e-5)
    keys = sorted(exact)
    p = chisquare([counts.get(k, 0) for k in keys], [exact[k] * n for k in keys]).pvalue
    assert p > 0.001, p
    # top-k 1 keeps one candidate per row: the sampled walk is the greedy walk
    greedy, _ = drafter.choose_draft((ids, scores), SamplingParams(), None)
    one, q = drafter.choose_draft((ids, scores), SamplingParams(temperature=1.0, top_k=1), g)
    assert torch.equal(one, greedy) and torch.equal(q.max(-1).values, torch.ones(3))


def tiny_dflash2(vocab: int) -> DFlash2Drafter:
    """A one-layer DFlash 2 drafter over a vocabulary of ``vocab`` tokens (top-3)."""
    from dflash_torch.models.drafter_config import DFlash2Settings, DrafterConfig

    cfg = DrafterConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                        intermediate_size=32, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, attention_bias=False,
                        block_size=4, mask_token_id=0, target_layer_ids=[0], num_target_layers=2, vocab_size=vocab,
                        sliding_windows=[None], dflash2=DFlash2Settings(2, 8, 4, 3))
    return DFlash2Drafter(cfg)


# --- identity modules: exactly the DFlash backbone ------------------------------------------

def test_identity_convolutions_and_zero_codebooks_propose_what_the_backbone_proposes(agree_pair, tmp_path):
    target_dir, v1_dir = agree_pair
    v2_dir = make_dflash2_from(v1_dir, tmp_path / "identity")
    target = TargetModel.from_pretrained(target_dir, torch.float32)
    v1 = DFlashDrafter.from_pretrained(v1_dir, torch.float32)
    v2 = DFlashDrafter.from_pretrained(v2_dir, torch.float32)
    assert isinstance(v2, DFlash2Drafter) and not v2.candidate_selector.successor_codebook.any()
    # the proposal of one block, for random contexts and anchors, at two block sizes
    g = torch.Generator().manual_seed(0)
    for B in (16, 5):
        for trial in range(4):
            s = int(torch.randint(3, 40, (), generator=g))
            feats = torch.randn(s, v1.fc.in_features, generator=g)
            block = torch.tensor([int(torch.randint(2, V, (), generator=g))] + [v1.config.mask_token_id] * (B - 1))
            proposals = []
            for d in (v1, v2):
                ctx = InjectedContext(d)
                ctx.reset(s + B)
                ctx.inject(d, feats, torch.arange(s))
                hidden = d(target.embed(block), torch.arange(s, s + B), ctx, s + B)
                proposals.append((hidden, d.choose_draft(d.draft_scores(hidden, block[0], target), SamplingParams(), None)[0]))
            assert torch.equal(proposals[0][0], proposals[1][0])
            assert torch.equal(proposals[0][1], proposals[1][1])
    # and whole decodes: every round commits the same tokens with the same acceptance length
    for prompt in ([5, 17, 99, 3], list(range(2, 30))):
        rounds = [[(r.tokens, r.acceptance_length) for r in SpeculativeDecoder(target, d).rounds(prompt, SamplingParams(), 60)]
                  for d in (v1, v2)]
        assert rounds[0] == rounds[1]
        assert max(r[1] or 0 for r in rounds[0]) > 2


# --- greedy speculative decoding == target-only decoding -----------------------------------

@pytest.fixture(scope="module", params=["random", "agree"])
def dflash2_setup(request, tiny_pair, agree_dflash2_pair, tmp_path_factory):
    """A random DFlash 2 drafter with every optional setting (embedding scale, output
    multiplier, soft cap, 3 taps, a sliding-window layer), and the agreeable one."""
    if request.param == "random":
        target_dir, _ = tiny_pair
        cfg = dflash2_config(target_dir, taps=3, top_k=8, target_layer_ids=[1, 3])
        cfg.sliding_windows = [8, None]
        s = cfg.dflash2
        s.input_embedding_scale, s.output_multiplier, s.final_logit_softcapping = 1.3, 0.9, 3.0
        drafter_dir = save_drafter(tmp_path_factory.mktemp("random-dflash2"), cfg, seed=5)
    else:
        target_dir, drafter_dir = agree_dflash2_pair
    target = TargetModel.from_pretrained(target_dir, torch.float32)
    drafter = DFlashDrafter.from_pretrained(drafter_dir, torch.float32)
    assert isinstance(drafter, DFlash2Drafter)
    prompts = [[5, 17, 99, 3], list(range(2, 40)), [7] * 20]
    baseline = SpeculativeDecoder(target, None)
    refs = [run_rounds(baseline, p, 48)[0] for p in prompts]
    return request.param, target, drafter, prompts, refs


@pytest.mark.parametrize("mode", ["inject", "recompute", "fixed-shape"])
@pytest.mark.parametrize("B", [4, 16])
def test_greedy_speculative_equals_target_only(dflash2_setup, mode, B):
    name, target, drafter, prompts, refs = dflash2_setup
    decoder = SpeculativeDecoder(target, drafter, block_size=B, draft_mode="recompute" if mode == "recompute" else "inject",
                                 static=mode == "fixed-shape", max_context=256, prefill_chunk=16)
    taus = []
    for prompt, ref in zip(prompts, refs):
        out, t = run_rounds(decoder, prompt, 48)
        assert out == ref, f"{name} {mode} B={B} prompt {prompt[:6]}"
        taus += t
    if name == "agree" and B == 16:
        assert max(taus) > 3 and sum(taus) / len(taus) > 1.3, taus


def test_engine_rounds_equal_the_training_replay(dflash2_setup):
    """The acceptance lengths of real decoding equal those replayed by training's batched
    forward and walk (:func:`greedy_walk`, the anchor of each block its true token)."""
    from dflash_torch.training.objective import greedy_walk

    name, target, drafter, prompts, refs = dflash2_setup
    decoder = SpeculativeDecoder(target, drafter)
    for prompt, ref in zip(prompts, refs):
        _, taus = run_rounds(decoder, prompt, 48)
        with torch.no_grad():
            replay = greedy_walk(drafter, target, torch.tensor(prompt + ref), len(prompt))
        assert replay and replay == taus[:len(replay)], (name, replay, taus)


def test_compiled_rounds_equal_target_only_without_recompiling(dflash2_setup):
    name, target, drafter, prompts, refs = dflash2_setup
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    compiled = SpeculativeDecoder(target, drafter, compile=True, compile_backend="eager", max_context=320, prefill_chunk=32)
    run_rounds(compiled, [5, 17, 99, 3], 300)  # warm-up to the context limit: every bucket's graphs
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    frames = dynamo_utils.counters["frames"]["total"]
    for prompt, ref in zip(prompts, refs):
        assert run_rounds(compiled, prompt, 48)[0] == ref, name
    out, _ = run_rounds(compiled, [9, 8, 7], 40, SamplingParams(temperature=0.8, seed=1))  # sampling reuses the graphs
    assert len(out) == 40
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs, "a graph was recompiled after warm-up"
    assert dynamo_utils.counters["frames"]["total"] == frames, "a frame was re-traced after warm-up"


def test_bfloat16_engine_with_a_dflash2_drafter(agree_dflash2_pair):
    """bfloat16 (CPU: prepacked linears) decodes and accepts drafts; in float32 it is exact."""
    engine = DFlashEngine.from_pretrained(*agree_dflash2_pair, dtype="bfloat16")
    out = engine.generate("def f(x):", max_new_tokens=40, ignore_eos=True)
    assert len(out.token_ids) == 40 and max(out.stats.acceptance_lengths) > 1


def test_selector_vocab_size_keeps_drafts_below_it(agree_dflash2_pair, tmp_path):
    """``dflash_config.selector_vocab_size`` (NeMo-Automodel's DFlash 2 export: the tokenizer's
    ids, the embedding rows past them padding): the selector's candidates, and so every
    draft, are ids below it; verification is unchanged (greedy output = target-only), and
    it round-trips through to_dict."""
    from conftest import edited_checkpoint
    from dflash_torch.models.drafter_config import DrafterConfig

    target_dir, drafter_dir = agree_dflash2_pair
    limit = 150  # (the agreeable pair drafts ids across the vocabulary: some at or past it)
    capped = edited_checkpoint(drafter_dir, tmp_path / "capped",
                               config=lambda c: c["dflash_config"].update(selector_vocab_size=limit))
    prompt = list(range(2, 40))
    reference = DFlashEngine.from_pretrained(target_dir, no_draft=True).generate(prompt, max_new_tokens=48,
                                                                                 ignore_eos=True).token_ids
    drafted = {}
    for name, d in (("whole", drafter_dir), ("capped", capped)):
        engine = DFlashEngine.from_pretrained(target_dir, d)
        seen, step = [], engine.decoder._draft_fn

        def record(*args, _step=step, _seen=seen, **kwargs):
            scores = _step(*args, **kwargs)
            _seen.append(scores[0].clone())  # (a DFlash 2 drafter's scores: candidate ids, edge scores)
            return scores

        engine.decoder._draft_fn = record
        assert engine.generate(prompt, max_new_tokens=48, ignore_eos=True).token_ids == reference
        drafted[name] = torch.cat([ids.reshape(-1) for ids in seen])
    assert int(drafted["whole"].max()) >= limit  # (so the cap has something to exclude)
    assert int(drafted["capped"].max()) < limit
    cfg = DrafterConfig.from_dict(json.loads((capped / "config.json").read_text()))
    assert cfg.dflash2.selector_vocab_size == limit
    assert DrafterConfig.from_dict(cfg.to_dict()).dflash2.selector_vocab_size == limit
