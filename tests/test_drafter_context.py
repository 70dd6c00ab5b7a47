"""KV injection is exact: the drafter's logits with the persistent injected KV cache
(sliced or fixed-shape, injected on its own or folded into the next propose, sliding-window
layers keeping every position or a ring) equal those of the cache-less drafter that re-projects every
committed feature each round, and a from-scratch reference of the DFlash drafter
(written here from the DFlash paper's description), round after round with varying accepted counts; and
both draft modes generate identical tokens."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import drafter_config, save_drafter
from dflash_torch import DFlashEngine
from dflash_torch.models.drafter import DFlashDrafter, InjectedContext, RecomputedContext
from dflash_torch.models.target import TargetModel

ATOL = 1e-5
# accepted draft counts a of successive rounds (tau = a + 1), B = 16
ACCEPTED = [0, 3, 15, 1, 7, 0, 0, 12, 2, 15, 5]


# --- an independent reference of one drafter forward (no engine code on the math path) ---

def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):  # x [T, heads, d], rotate-half layout
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


def _linear(x, proj):
    return x @ proj.weight.T + (0 if proj.bias is None else proj.bias)


def reference_block_logits(drafter: DFlashDrafter, target: TargetModel, ctx_feats, block_ids, s):
    """Draft logits [B-1, V] for the block at [s, s+B) given all committed features [s, k*H]."""
    cfg = drafter.config
    nh, nkv, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    B = block_ids.shape[0]
    c = _rms(ctx_feats @ drafter.fc.weight.T, drafter.hidden_norm.weight, eps)
    x = target.model.embed_tokens.weight[block_ids]
    ctx_pos, blk_pos = torch.arange(s), torch.arange(s, s + B)
    for i, layer in enumerate(drafter.layers):
        a = layer.self_attn
        h = _rms(x, layer.input_layernorm.weight, eps)
        qk_norm = (lambda x, norm: _rms(x, norm.weight, eps)) if cfg.qk_norm else (lambda x, norm: x)
        q = _rope(qk_norm(_linear(h, a.q_proj).view(B, nh, hd), a.q_norm), blk_pos, cfg.rope_theta)
        src = torch.cat([c, h])  # context rows, then block rows
        k = _linear(src, a.k_proj).view(-1, nkv, hd)
        k = _rope(qk_norm(k, a.k_norm), torch.cat([ctx_pos, blk_pos]), cfg.rope_theta)
        v = _linear(src, a.v_proj).view(-1, nkv, hd)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        att = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)  # non-causal: all keys visible ...
        k_pos, window = torch.cat([ctx_pos, blk_pos]), cfg.sliding_windows[i]
        visible = torch.ones(B, len(k_pos), dtype=torch.bool)
        if (cfg.causal_layers or [False] * len(drafter.layers))[i]:  # ... but a causal layer's: up to p
            visible &= k_pos[None] <= blk_pos[:, None]
        if window is not None:  # ... and a sliding-window layer's: (p - window, ...]
            visible &= k_pos[None] > blk_pos[:, None] - window
        att = att.masked_fill(~visible, float("-inf"))
        out = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(B, nh * hd)
        x = x + _linear(out, a.o_proj)
        m = layer.mlp
        y = _rms(x, layer.post_attention_layernorm.weight, eps)
        x = x + (F.silu(y @ m.gate_proj.weight.T) * (y @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    return _rms(x, drafter.norm.weight, eps)[1:] @ target.lm_head.weight.T


@pytest.fixture(scope="module", params=["3-layers-incl-last-target-layer", "sliding-window-layer",
                                        "sliding-window-non-causal", "attention-bias", "use-swa", "no-qk-norm"])
def models(request, tiny_pair, tmp_path_factory):
    target_dir, _ = tiny_pair
    cfg = drafter_config(target_dir, num_layers=3 if request.param.startswith("3") else 2, block_size=16,
                         target_layer_ids=[0, 2, 3] if request.param.startswith("3") else [1, 2])
    if request.param.startswith("sliding"):  # (published DFlash drafters' sliding layers: causal in the block)
        cfg.sliding_windows = [8, None]
        cfg.causal_layers = [request.param == "sliding-window-layer", False]
    if request.param == "attention-bias":  # q/k/v and o_proj biases, as the reference drafter has them
        cfg.attention_bias = True
    if request.param == "no-qk-norm":  # dflash_config.use_qk_norm false: no q/k RMSNorms (nor their weights)
        cfg.qk_norm = False
    d = save_drafter(tmp_path_factory.mktemp("ctx-drafter"), cfg, seed=11)
    if request.param == "use-swa":  # MiMo's layout: no layer_types, dflash_config.use_swa: every layer slides, non-causal
        written = json.loads((d / "config.json").read_text())
        for key in ("layer_types", "sliding_window", "is_causal"):
            written.pop(key, None)
        written["dflash_config"].update(use_swa=True, swa_window_size=4)
        (d / "config.json").write_text(json.dumps(written))
        cfg.sliding_windows, cfg.causal_layers = [4, 4], [False, False]
    drafter = DFlashDrafter.from_pretrained(d, torch.float32)
    assert [layer.causal for layer in drafter.layers] == (cfg.causal_layers or [False] * cfg.num_hidden_layers)
    assert [layer.sliding_window for layer in drafter.layers] == cfg.sliding_windows
    assert (drafter.layers[0].self_attn.q_norm is None) == (not cfg.qk_norm)
    biases = [m.bias for m in drafter.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None]
    assert len(biases) == (4 * cfg.num_hidden_layers if cfg.attention_bias else 0)
    assert all(b.abs().sum() > 0 for b in biases)
    return request.param, TargetModel.from_pretrained(target_dir, torch.float32), drafter


@torch.inference_mode()
def test_inject_recompute_and_reference_agree_round_after_round(models):
    name, target, drafter = models
    B, mask_id = drafter.config.block_size, drafter.config.mask_token_id
    layers = drafter.config.target_layer_ids
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(2, target.config.vocab_size, (21,), generator=g)
    P = len(prompt)
    capacity = P + sum(ACCEPTED) + len(ACCEPTED) + B + 1

    tcache = target.new_cache()
    tcache.reset(capacity)
    inj, fixed, rec = InjectedContext(drafter), InjectedContext(drafter), RecomputedContext(drafter)
    # folded: the verify's rows are injected by the next propose (accepted rows / all B rows)
    folded, folded_fixed = InjectedContext(drafter), InjectedContext(drafter)
    # rings for sliding-window layers (window + max(B, P) - 1 rows: the prompt's P rows are one write)
    ringed, ringed_fixed = InjectedContext(drafter, max_rows=P), InjectedContext(drafter, max_rows=P)
    rows = [t.shape[1] for t in ringed.cache.k]
    for ctx in (inj, fixed, rec, folded, folded_fixed, ringed, ringed_fixed):
        ctx.reset(capacity)
    assert [t.shape[1] for t in ringed.cache.k] == [(w + P - 1) if w else ringed.cache.capacity
                                                    for w in drafter.kv_windows()], rows
    for ctx in (fixed, folded_fixed, ringed_fixed):
        ctx.reset(capacity + 64)  # stale rows past the context must stay masked out
        for t in ctx.cache.k + ctx.cache.v:
            t.normal_()

    logits, feats = target(prompt, torch.arange(P), tcache, P, layers)
    all_feats = [feats]
    for ctx in (inj, fixed, rec, folded, folded_fixed, ringed, ringed_fixed):
        ctx.inject(drafter, feats, torch.arange(P))
    token = int(logits[-1].argmax())
    s = P
    pending = pending_fixed = None
    for rnd, a in enumerate(ACCEPTED):
        positions = torch.arange(s, s + B)
        block = torch.full((B,), mask_id, dtype=torch.long)
        block[0] = token
        emb = target.embed(block)
        out_inj = target.logits(drafter(emb, positions, inj, s + B)[1:])
        out_fixed = target.logits(drafter(emb, positions, fixed, None)[1:])
        out_rec = target.logits(drafter(emb, positions, rec, s + B)[1:])
        out_folded = target.logits(drafter(emb, positions, folded, s + B, inject=pending)[1:])
        out_folded_fixed = target.logits(drafter(emb, positions, folded_fixed, None, inject=pending_fixed)[1:])
        out_ringed = target.logits(drafter(emb, positions, ringed, s + B, inject=pending)[1:])
        out_ringed_fixed = target.logits(drafter(emb, positions, ringed_fixed, None, inject=pending_fixed)[1:])
        for out, what in ((out_ringed, "rings"), (out_ringed_fixed, "rings, fixed shapes")):
            torch.testing.assert_close(out, out_rec, atol=ATOL, rtol=ATOL, msg=f"{name}: round {rnd} {what} vs recompute")
        torch.testing.assert_close(out_folded, out_rec, atol=ATOL, rtol=ATOL, msg=f"{name}: round {rnd} folded vs recompute")
        torch.testing.assert_close(out_folded_fixed, out_rec, atol=ATOL, rtol=ATOL,
                                   msg=f"{name}: round {rnd} folded fixed-shape vs recompute")
        assert out_inj.shape == (B - 1, target.config.vocab_size)
        torch.testing.assert_close(out_inj, out_rec, atol=ATOL, rtol=ATOL, msg=f"{name}: round {rnd} inject vs recompute")
        torch.testing.assert_close(out_fixed, out_rec, atol=ATOL, rtol=ATOL, msg=f"{name}: round {rnd} fixed-shape vs recompute")
        ref = reference_block_logits(drafter, target, torch.cat(all_feats), block, s)
        torch.testing.assert_close(out_inj, ref, atol=ATOL, rtol=ATOL, msg=f"{name}: round {rnd} vs reference")
        # verify a block of (random) draft tokens with the target; commit a + 1 rows
        verify = torch.cat([block[:1], torch.randint(2, target.config.vocab_size, (B - 1,), generator=g)])
        vlogits, vfeats = target(verify, positions, tcache, s + B, layers)
        inj.inject(drafter, vfeats[:a + 1], positions[:a + 1])
        fixed.inject(drafter, vfeats, positions)  # all B rows; rows past a + 1 are overwritten later
        rec.inject(drafter, vfeats[:a + 1], positions[:a + 1])
        pending, pending_fixed = (vfeats[:a + 1], positions[:a + 1]), (vfeats, positions)
        all_feats.append(vfeats[:a + 1])
        token = int(vlogits[a].argmax())
        s += a + 1
    assert rec.length == s == P + sum(ACCEPTED) + len(ACCEPTED)
    assert not any(drafter.kv_windows()) or min(t.shape[1] for t in ringed.cache.k) < s - 40  # (positions wrapped)


@torch.inference_mode()
def test_rings_from_a_prompt_shorter_than_the_window(models):
    """A ring (fixed shapes: every row read, stale and never-written rows random) while the
    block is still inside the first window: rows that hold no position yet stay masked;
    round after round the draft logits equal the recomputed context's."""
    name, target, drafter = models
    B, mask_id, layers = drafter.config.block_size, drafter.config.mask_token_id, drafter.config.target_layer_ids
    prompt = torch.tensor([5, 9, 13])
    tcache = target.new_cache()
    tcache.reset(256)
    ringed, rec = InjectedContext(drafter, max_rows=B), RecomputedContext(drafter)
    for ctx in (ringed, rec):
        ctx.reset(256)
    for t in ringed.cache.k + ringed.cache.v:
        t.normal_()
    logits, feats = target(prompt, torch.arange(3), tcache, 3, layers)
    for ctx in (ringed, rec):
        ctx.inject(drafter, feats, torch.arange(3))
    token, s, pending = int(logits[-1].argmax()), 3, None
    for rnd, a in enumerate([0, 1, 0, 2, 15, 3]):
        positions = torch.arange(s, s + B)
        block = torch.full((B,), mask_id, dtype=torch.long)
        block[0] = token
        emb = target.embed(block)
        out_rec = target.logits(drafter(emb, positions, rec, s + B)[1:])
        out = target.logits(drafter(emb, positions, ringed, None, inject=pending)[1:])
        torch.testing.assert_close(out, out_rec, atol=ATOL, rtol=ATOL, msg=f"{name}: round {rnd} rings vs recompute")
        vlogits, vfeats = target(block, positions, tcache, s + B, layers)
        rec.inject(drafter, vfeats[:a + 1], positions[:a + 1])
        pending = (vfeats, positions)
        token, s = int(vlogits[a].argmax()), s + a + 1


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
def test_draft_modes_generate_identical_tokens(agree_pair, tiny_pair, sampling):
    kwargs = dict(max_new_tokens=40, ignore_eos=True)
    if sampling:
        kwargs.update(temperature=0.8, top_p=0.95, seed=5)
    for target, drafter in (agree_pair, tiny_pair):
        inject = DFlashEngine.from_pretrained(target, drafter, draft_mode="inject")
        recompute = DFlashEngine(inject.target, inject.tokenizer, inject.drafter, draft_mode="recompute")
        assert recompute.decoder.draft_mode == "recompute"
        for prompt in ("def f(x):", "import heapq\n\nclass Queue:\n"):
            a = inject.generate(prompt, **kwargs)
            b = recompute.generate(prompt, **kwargs)
            assert a.token_ids == b.token_ids
            assert a.stats.acceptance_lengths == b.stats.acceptance_lengths
            assert len(a.token_ids) == 40


def test_block_causality_follows_the_published_rule(tiny_pair):
    """Which drafter layers see their block causally: a DFlash drafter's sliding-window layers
    (SGLang's and vLLM's DFlash drafters, SpecForge's training mask, dflash-mlx), unless
    ``is_causal`` (or ``dflash_config.causal``; both, saying two things: refused) says it for every
    layer; DFlash 2 drafters and transformers' assistants never."""
    import json

    from dflash_torch import DFlashError
    from dflash_torch.models.drafter_config import DrafterConfig

    _, drafter = tiny_pair
    base = json.loads((drafter / "config.json").read_text())
    base.update(layer_types=["sliding_attention", "full_attention"], sliding_window=8, use_sliding_window=True)

    def causal(**edits):
        cfg = json.loads(json.dumps(base))
        for key, value in edits.items():
            if key == "causal":
                cfg["dflash_config"]["causal"] = value
            else:
                cfg[key] = value
        return DrafterConfig.from_dict(cfg).causal_layers

    assert causal() == [True, False]
    assert causal(is_causal=False) == [False, False] and causal(is_causal=True) == [True, True]
    assert causal(causal=True) == [True, True] and causal(causal=True, is_causal=True) == [True, True]
    with pytest.raises(DFlashError, match="sets is_causal true and dflash_config.causal false: which block attention "
                                          "the drafter was trained with is unknown"):
        causal(causal=False, is_causal=True)
    assert causal(layer_types=["full_attention"] * 2) == [False, False]
    dflash2 = dict(base["dflash_config"], conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    assert causal(architectures=["DFlash2DraftModel"], dflash_config=dflash2) == [False, False]
    with pytest.raises(DFlashError, match="is_causal must be true or false, got 'yes'"):
        causal(is_causal="yes")
    # a config written back says what the rule would not give
    cfg = DrafterConfig.from_dict(dict(base, is_causal=False))
    assert cfg.to_dict()["is_causal"] is False and "is_causal" not in DrafterConfig.from_dict(base).to_dict()


def test_use_swa_slides_every_layer_as_vllm_does(tiny_pair):
    """``dflash_config.use_swa`` (MiMo's DFlash drafters; vLLM's ``_resolve_layer_attention``):
    where ``layer_types`` names no sliding layer (absent or all full), every layer gets the
    window ``dflash_config.swa_window_size`` (else ``sliding_window``) and the block stays
    non-causal; where ``layer_types`` has sliding layers it decides, as without the key.
    ``swa_window_size`` alone gives the window of ``layer_types``' sliding layers (SGLang's
    fallback); with a different ``sliding_window`` it is refused (the two engines disagree on
    which one wins). A config written back keeps the windows and the causality."""
    from dflash_torch import DFlashError
    from dflash_torch.models.drafter_config import DrafterConfig

    _, drafter = tiny_pair
    base = json.loads((drafter / "config.json").read_text())

    def parsed(dflash=None, **edits):
        cfg = json.loads(json.dumps(base))
        cfg["dflash_config"].update(dflash or {})
        for key, value in edits.items():
            if value is None:
                cfg.pop(key, None)
            else:
                cfg[key] = value
        out = DrafterConfig.from_dict(cfg)
        return out.sliding_windows, out.causal_layers

    full, mixed = ["full_attention"] * 2, ["sliding_attention", "full_attention"]
    swa = dict(use_swa=True, swa_window_size=8)
    assert parsed(swa, layer_types=full) == ([8, 8], [False, False])
    assert parsed(swa, layer_types=None) == ([8, 8], [False, False])
    assert parsed(dict(use_swa=True), layer_types=None, sliding_window=6) == ([6, 6], [False, False])
    assert parsed(swa, layer_types=full, is_causal=True) == ([8, 8], [True, True])
    assert parsed(swa, layer_types=mixed) == ([8, None], [True, False])
    assert parsed(dict(swa_window_size=8), layer_types=mixed, sliding_window=None) == ([8, None], [True, False])
    assert parsed(dict(use_swa=False, swa_window_size=8), layer_types=full) == ([None, None], [False, False])
    with pytest.raises(DFlashError, match="two sliding windows: sliding_window 6 and dflash_config.swa_window_size 8"):
        parsed(swa, sliding_window=6)
    cfg = json.loads(json.dumps(base))
    cfg["dflash_config"].update(swa)
    written = DrafterConfig.from_dict(DrafterConfig.from_dict(cfg).to_dict())
    assert (written.sliding_windows, written.causal_layers) == ([8, 8], [False, False])


@pytest.mark.parametrize("layout", ["use-swa", "no-qk-norm"])
def test_use_swa_and_no_qk_norm_drafters_decode_as_the_target(tiny_pair, tmp_path, layout):
    """Greedy speculative decoding with a drafter of either layout (dflash_config.use_swa with a
    window of 4; use_qk_norm false, no q/k norm weights) gives the target-only tokens, in the
    sliced and the fixed-shape loops and a batch (generate_batch)."""
    from conftest import edited_checkpoint, run_rounds
    from dflash_torch.decoding import SpeculativeDecoder

    target_dir, drafter_dir = tiny_pair
    if layout == "use-swa":
        d = edited_checkpoint(drafter_dir, tmp_path / layout, config=lambda c: (
            c.pop("layer_types", None), c["dflash_config"].update(use_swa=True, swa_window_size=4)))
    else:
        d = edited_checkpoint(drafter_dir, tmp_path / layout, config=lambda c: c["dflash_config"].update(use_qk_norm=False),
                              state=lambda w: [w.pop(k) for k in list(w) if k.endswith(("q_norm.weight", "k_norm.weight"))])
    target = TargetModel.from_pretrained(target_dir, torch.float32)
    drafter = DFlashDrafter.from_pretrained(d, torch.float32)
    assert [layer.sliding_window for layer in drafter.layers] == ([4, 4] if layout == "use-swa" else [None, None])
    prompts = [[5, 6, 7], list(range(10, 40))]
    refs = [run_rounds(SpeculativeDecoder(target, None), p, 40)[0] for p in prompts]
    for static in (False, True):
        decoder = SpeculativeDecoder(target, drafter, block_size=8, static=static, max_context=128)
        assert [run_rounds(decoder, p, 40)[0] for p in prompts] == refs, static
    engine = DFlashEngine.from_pretrained(target_dir, d)
    assert [out.token_ids for out in engine.generate_batch(prompts, max_new_tokens=40, ignore_eos=True)] == refs
    if layout == "no-qk-norm":  # the weights shipped beside use_qk_norm false: the key is named
        from dflash_torch import DFlashError

        kept = edited_checkpoint(drafter_dir, tmp_path / "kept", config=lambda c: c["dflash_config"].update(use_qk_norm=False))
        with pytest.raises(DFlashError, match=r"ships q/k norm weights \(layers.0.self_attn.k_norm.weight, ...\) but its "
                                              r"config.json says dflash_config.use_qk_norm: false"):
            DFlashDrafter.from_pretrained(kept, torch.float32)


def recorded_drafts(decoder) -> list:
    """Record the draft scores of every propose of ``decoder`` (a SpeculativeDecoder or a
    BatchDecoder, not compiled): a list that fills as it decodes."""
    seen, step = [], decoder._draft_fn

    def record(*args, **kwargs):
        scores = step(*args, **kwargs)
        seen.append(scores.clone())
        return scores

    decoder._draft_fn = record
    return seen


@torch.inference_mode()
def test_decoders_draft_as_the_recomputed_context_round_after_round(tiny_pair):
    """The decoding loops inject the context where it belongs: the draft logits of every
    round of the sliced and the fixed-shape loop, and of each sequence of a batch (eager
    and fixed shapes), equal those of the cache-less recompute loop, with varying accepted
    counts (sampling at a high temperature, seeded: the same tokens in every loop). (The
    tokens cannot show this: drafts change only how many are accepted, and few are.)"""
    from conftest import run_rounds
    from dflash_torch.batch import BatchDecoder
    from dflash_torch.decoding import SpeculativeDecoder
    from dflash_torch.sampling import SamplingParams

    target = TargetModel.from_pretrained(tiny_pair[0], torch.float32)
    drafter = DFlashDrafter.from_pretrained(tiny_pair[1], torch.float32)
    prompts, n = [[5, 6, 7], list(range(10, 40))], 24
    params = [SamplingParams(temperature=1.5, seed=20 + i) for i in range(len(prompts))]
    want, taus = [], []
    for prompt, p in zip(prompts, params):
        rec = SpeculativeDecoder(target, drafter, block_size=8, draft_mode="recompute")
        scores = recorded_drafts(rec)
        taus += run_rounds(rec, prompt, n, p)[1]
        want.append(scores)
    assert max(taus) > 1  # (some drafts accepted: the rows injected vary)
    for static in (False, True):
        for prompt, p, expected in zip(prompts, params, want):
            decoder = SpeculativeDecoder(target, drafter, block_size=8, static=static, max_context=128)
            scores = recorded_drafts(decoder)
            run_rounds(decoder, prompt, n, p)
            assert len(scores) == len(expected) > 3
            for rnd, (got, ref) in enumerate(zip(scores, expected)):
                torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL, msg=f"static={static} round {rnd}")
        batch = BatchDecoder(target, drafter, block_size=8, max_batch_size=2, max_context=128, static=static)
        scores = recorded_drafts(batch)
        for i, prompt in enumerate(prompts):
            batch.add(i, prompt, params[i], n)
        rounds = {0: 0, 1: 0}
        while (done := batch.step()) and len(scores) < 8:
            for i in done:  # (slot i: sequence i, none left)
                torch.testing.assert_close(scores[-1][i], want[i][rounds[i]], atol=ATOL, rtol=ATOL,
                                           msg=f"batch static={static} sequence {i} round {rounds[i]}")
                rounds[i] += 1
        assert min(rounds.values()) > 3
