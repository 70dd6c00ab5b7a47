"""DeepSeek-V4 targets (``deepseek_v4``) against transformers' own ``DeepseekV4ForCausalLM``, on
a tiny random checkpoint covering every part: four layers (sliding, CSA, HCA, CSA), a sliding
window of 6, compress rates 4 (CSA) and 8 (HCA) so windows complete often, an indexer keeping
3 entries of up to 10 (its choice matters), 3 hyper-connection streams, a hash-routed layer and
top-k layers with score correction biases, YaRN on the compress RoPE; random sinks,
hyper-connection weights and position biases:

* our forward == transformers' (logits, and every layer's output streams, the drafters'
  features), in one pass, in pieces, token by token, with fixed shapes, with rings shorter
  than the sequence, in chunks of one query row, for sequences batched in cache slots, and
  after rejected blocks (their rows rewritten);
* guards: each part computed the wrong way (the indexer's choice, the overlapping half of CSA
  windows, the hyper-connection mix's transpose, hash routing, the output's inverse RoPE)
  makes the comparison fail, and perturbing the sinks or the indexer's query weights changes
  transformers' logits while ours still match, so the comparisons have power;
* the cache layout (slots per layer, the memory check's bytes) and DeepSeek-V4-Flash's
  published shapes (284.3B parameters, 6,880 bytes of cache a token in bfloat16);
* greedy target-only and speculative decoding == transformers' greedy ``generate``; an
  agreeable pair accepting several tokens a round is lossless (eager, chunked, fixed shapes,
  batched, compiled without recompiles, prefix reuse); drafters are in the Speculators
  format with ``target_hidden_size`` = ``hc_mult * hidden_size`` (as the published one); a
  DFlash-format drafter, and training one, are refused in one line;
* the published layout (top-level DeepSeek names) loads to the same logits, the
  multi-token-prediction tensors are not read, unknown tensors are refused; legacy config
  keys fold as transformers folds them; unsupported configs are refused in one line.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import (EOS_ID, VOCAB, check_compiled_rounds_are_lossless, check_greedy_equals_transformers,
                      check_many_accepted_tokens_are_lossless, copy_tokenizer, drafter_config, edited_checkpoint,
                      load_hf, make_agreeable, save_drafter, v4_drafter)
from dflash_torch import DFlashError
from dflash_torch.cache import cache_bytes
from dflash_torch.models import deepseek_v4, deepseek_v4_attention
from dflash_torch.models.config import TargetConfig
from dflash_torch.models.target import TargetModel

SLIDING, CSA, HCA = deepseek_v4.SLIDING, deepseek_v4.CSA, deepseek_v4.HCA
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32.0,
        "beta_slow": 1.0}
TINY = dict(vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
            head_dim=32, q_lora_rank=24, num_experts_per_tok=2, n_routed_experts=4,
            layer_types=[SLIDING, CSA, HCA, CSA], compress_rates={CSA: 4, HCA: 8},
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"], hc_mult=3, sliding_window=6, o_groups=2,
            o_lora_rank=8, index_n_heads=8, index_head_dim=16, index_topk=3, partial_rotary_factor=0.25,
            max_position_embeddings=1024, rope_parameters=YARN, eos_token_id=EOS_ID, bos_token_id=EOS_ID,
            pad_token_id=EOS_ID, tie_word_embeddings=False)
IDS = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1))
ATOL = 1e-5


def make_v4_target(out_dir: Path, *, seed: int = 0, **overrides) -> Path:
    """Save a tiny random ``DeepseekV4ForCausalLM`` (:data:`TINY` plus ``overrides``; eager
    experts): matrices N(0, 0.1), norms N(1, 0.2), the other vectors (hyper-connection bases
    and scales, sinks, position biases) N(0, 0.5), score correction biases N(0, 0.3), a
    random token -> experts table."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.DeepseekV4Config(**{**TINY, **overrides}, experts_implementation="eager")
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1)
            elif name.endswith("norm.weight"):
                p.normal_(1, 0.2)
            else:
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                experts, k = config.n_routed_experts, config.num_experts_per_tok
                b.copy_(torch.stack([torch.randperm(experts)[:k] for _ in range(b.shape[0])]))
            elif name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_dir):
    """(target_dir, random drafter_dir) of the tiny DeepSeek-V4 target."""
    root = tmp_path_factory.mktemp("deepseek_v4")
    target = make_v4_target(root / "target", seed=3)
    copy_tokenizer(tokenizer_dir, target)
    return target, v4_drafter(target, root / "drafter", seed=3)


@pytest.fixture(scope="module")
def models(checkpoint):
    """(ours, transformers', transformers' output on :data:`IDS` with hidden states)."""
    ours = TargetModel.from_pretrained(checkpoint[0], torch.float32)
    hf = load_hf(checkpoint[0])
    with torch.no_grad():
        ref = hf(IDS[None], output_hidden_states=True)
    return ours, hf, ref


def run_pieces(model, ids, pieces, *, static=False, max_rows=None, features=True):
    """Logits (and layers 0..L-1's features) of ``ids`` fed in consecutive pieces."""
    cache = model.new_cache(max_rows)
    cache.reset(64)
    layers = list(range(model.config.num_hidden_layers)) if features else None
    logits, feats, start = [], [], 0
    with torch.no_grad():
        for n in pieces:
            lg, f = model(ids[start:start + n], torch.arange(start, start + n), cache,
                          None if static else start + n, feature_layers=layers)
            logits.append(lg)
            feats.append(f)
            start += n
    return torch.cat(logits), torch.cat(feats) if features else None


@pytest.mark.parametrize("pieces,static,max_rows", [
    ([40], False, None), ([11, 1, 7, 5, 16], False, None), ([1] * 40, False, None), ([16, 13, 11], True, None),
    ([5] * 8, False, 5), ([3, 5, 4, 4, 4, 5, 5, 5, 5], True, 5)],
    ids=["one-pass", "pieces", "token-by-token", "fixed-shapes", "rings", "rings-fixed-shapes"])
def test_forward_matches_transformers(models, pieces, static, max_rows):
    """Logits and each layer's feature (its output streams one after another, as the
    published drafter reads them) == transformers' whole-sequence forward; with ``max_rows``
    the window and compressor-input slots are rings of window + 4 rows."""
    ours, _, ref = models
    logits, feats = run_pieces(ours, IDS, pieces, static=static, max_rows=max_rows)
    torch.testing.assert_close(logits, ref.logits[0], rtol=0, atol=ATOL)
    w = ours.config.feature_size
    assert w == 3 * ours.config.hidden_size
    for layer in range(ours.config.num_hidden_layers - 1):  # (HF's last entry is the final-normed output)
        torch.testing.assert_close(feats[:, layer * w:(layer + 1) * w], ref.hidden_states[layer + 1][0].flatten(1),
                                   rtol=0, atol=ATOL)
    last = ours.config.num_hidden_layers
    with torch.no_grad():
        _, f = ours(IDS, torch.arange(40), _fresh(ours), 40, feature_layers=[-1, last - 1, last])
    embed = ours.model.embed_tokens(IDS)
    torch.testing.assert_close(f[:, :w], embed.repeat(1, 3), rtol=0, atol=0)
    torch.testing.assert_close(f[:, w:2 * w], f[:, 2 * w:], rtol=0, atol=0)


def test_indexer_ties_pick_the_same_entries_in_any_shape(tmp_path):
    """One indexer head: its ReLU makes many entries score exactly 0, so the top-k often cuts
    through a tie. The picks among equal scores must not depend on the forward's shape (a
    verify block against the same rows one at a time, a batch against one sequence): one
    pass, pieces and token by token give the same logits (``topk`` picked differently per
    shape, 0.2 apart, and speculative decoding differed from target-only)."""
    ours = TargetModel.from_pretrained(make_v4_target(tmp_path / "t", seed=2, index_n_heads=1, index_topk=2),
                                       torch.float32)
    whole, _ = run_pieces(ours, IDS, [40], static=False, features=False)
    for pieces in ([1] * 40, [8] * 5, [3, 7, 2, 9, 11, 8]):
        logits, _ = run_pieces(ours, IDS, pieces, static=False, features=False)
        torch.testing.assert_close(logits, whole, rtol=0, atol=ATOL)


def test_query_chunks_match_transformers(models, monkeypatch):
    """With a budget of 64 scores, every query row attends in a chunk of its own: the same."""
    ours, _, ref = models
    monkeypatch.setattr(deepseek_v4_attention, "_SCORES_PER_CHUNK", 64)
    for pieces, static in (([40], False), ([16, 13, 11], True)):
        logits, _ = run_pieces(ours, IDS, pieces, static=static, features=False)
        torch.testing.assert_close(logits, ref.logits[0], rtol=0, atol=ATOL)


def _fresh(model, max_rows=None):
    cache = model.new_cache(max_rows)
    cache.reset(64)
    return cache


def test_batched_slots_match_transformers(models):
    """Two sequences of 43 tokens prefilled alone in their slots then verified in blocks of
    8 and a last one of 3 together, in slots of exactly 43 positions (rings of window + 7
    rows; the last HCA window, 40..47, runs past the buffer's end) == transformers on each."""
    from dflash_torch.batch import SlotKVCache
    from dflash_torch.cache import TargetCache

    ours, hf, _ = models
    seqs = [torch.randint(0, VOCAB, (43,), generator=torch.Generator().manual_seed(s)) for s in (2, 4)]
    with torch.no_grad():
        refs = [hf(seq[None]).logits[0] for seq in seqs]
    heads, dims = zip(*ours.kv_shapes())
    slots = SlotKVCache.allocate(ours.num_kv_layers, 3, heads, 43, dims, torch.float32, "cpu", ours.kv_windows(), 8)
    outs = [[], []]
    with torch.no_grad():
        for j, seq in enumerate(seqs):
            for s in (0, 8):
                outs[j].append(ours(seq[s:s + 8], torch.arange(s, s + 8), TargetCache(slots.slot(j)), s + 8)[0])
        for s, e in ((16, 24), (24, 32), (32, 40), (40, 43)):
            lg, _ = ours(torch.cat([seq[s:e] for seq in seqs]), torch.stack([torch.arange(s, e)] * 2),
                         TargetCache(slots.first(2)), e)
            outs[0].append(lg[:e - s])
            outs[1].append(lg[e - s:])
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(torch.cat(out), ref, rtol=0, atol=ATOL)


def test_rejected_rows_are_rewritten(models):
    """A block of wrong tokens verified and then rolled back (a rejected draft), then the
    right tokens from the same position: the logits are those of the right tokens alone
    (every row a forward writes is rewritten by the next forward over its position)."""
    ours, _, ref = models
    for max_rows in (None, 8):
        cache = _fresh(ours, max_rows)
        out = []
        with torch.no_grad():
            out.append(ours(IDS[:13], torch.arange(13), cache, 13)[0])
            for s in range(13, 40, 7):
                e = min(s + 7, 40)
                wrong = (IDS[s:e] + 5) % VOCAB
                ours(wrong, torch.arange(s, e), cache, e)  # (rejected: the cache length stays at s)
                out.append(ours(IDS[s:e], torch.arange(s, e), cache, e)[0])
        torch.testing.assert_close(torch.cat(out), ref.logits[0], rtol=0, atol=ATOL)


def _wrong_select(self, h, q_res, index_keys, visible, step):
    picks = torch.arange(visible.shape[-1]).expand(*visible.shape)
    return picks, visible  # every visible entry: no indexer


def _wrong_pool(self, tokens, valid):
    if self.c == 2:  # the overlapping half (window w - 1's) dropped
        valid = valid & (torch.arange(tokens.shape[-2]) >= self.ratio)
    return _POOL(self, tokens, valid)


_POOL = deepseek_v4_attention.Compressor.pool


def _wrong_mix(streams, out, post, comb):
    return post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb, streams)  # (comb not transposed)


def _wrong_router(self, x, input_ids):
    if not self.hashed:
        return _ROUTE(self, x, input_ids)
    scores = torch.nn.functional.softplus(torch.nn.functional.linear(x.float(), self.weight.float())).sqrt()
    experts = torch.topk(scores, self.top_k, dim=-1)[1]  # (hash layers routed by score)
    weights = scores.gather(1, experts)
    return weights / weights.sum(dim=-1, keepdim=True) * self.scaling, experts


_ROUTE = deepseek_v4.Router.forward


@pytest.mark.parametrize("part,target,wrong", [
    ("indexer selection", (deepseek_v4_attention.Attention, "_select"), _wrong_select),
    ("CSA overlap half", (deepseek_v4_attention.Compressor, "pool"), _wrong_pool),
    ("hyper-connection comb transpose", (deepseek_v4, "mix_streams"), _wrong_mix),
    ("hash routing", (deepseek_v4.Router, "forward"), _wrong_router),
    ("inverse output RoPE", (deepseek_v4_attention, "unrotate"), lambda x, cos, sin: x),
])
def test_each_part_is_guarded(models, monkeypatch, part, target, wrong):
    """Each part computed the wrong way changes the logits beyond the tolerance (so the
    comparisons above would fail), and the right way matches."""
    ours, _, ref = models
    monkeypatch.setattr(*target, wrong)
    logits, _ = run_pieces(ours, IDS, [40], features=False)
    assert (logits - ref.logits[0]).abs().max() > 1e-3, part


def test_sinks_and_indexer_weights_matter(models, checkpoint, tmp_path):
    """Perturbing the sinks, or the indexer's query projection (which acts only through
    which entries a query attends), changes transformers' logits and ours still match."""
    _, _, ref = models
    for key in ("model.layers.1.attn.attn_sink", "model.layers.3.attn.indexer.wq_b.weight"):
        target = edited_checkpoint(checkpoint[0], tmp_path / key, state=lambda w: w.update({key: w[key] * -2}))
        hf = load_hf(target)
        with torch.no_grad():
            new = hf(IDS[None]).logits[0]
        assert (new - ref.logits[0]).abs().max() > 1e-3, key
        logits, _ = run_pieces(TargetModel.from_pretrained(target, torch.float32), IDS, [17, 23], features=False)
        torch.testing.assert_close(logits, new, rtol=0, atol=ATOL)


def test_cache_slots(checkpoint):
    """Per layer: the window (key = value: its halves, 16 + 16), and for CSA / HCA the
    compressor's per-token inputs (CSA: 2 x 64 + 2 x 32 = 192 values; HCA: 64) in a ring
    window of 2 * ratio / ratio, and the entries (CSA: 32 + 16 = 48 values over a window's
    4 rows, 12 a row; HCA: 32 over 8 rows, 4 a row), every position kept."""
    ours = TargetModel.from_pretrained(checkpoint[0], torch.float32)
    assert ours.num_kv_layers == 10
    assert ours.kv_shapes() == [(1, 16), (1, 16), (1, 96), (1, 6), (1, 16), (1, 32), (1, 2), (1, 16), (1, 96),
                                (1, 6)]
    assert ours.kv_windows() == [6, 6, 8, None, 6, 8, None, 6, 8, None]
    cache = ours.new_cache(4)
    cache.reset(64)
    assert [t.shape[1] for t in cache.kv.k[:4]] == [9, 9, 11, 256]
    held = sum(t.numel() * t.element_size() for t in cache.kv.k + cache.kv.v)
    assert cache_bytes(ours, None, 1, 256, max_rows=4) == held  # (the memory check counts what is allocated)


def test_published_flash_shapes():
    """DeepSeek-V4-Flash's published shapes (43 layers: 2 sliding then CSA / HCA alternating)
    on the meta device: the parameter count and the cache's bytes a token (see the report)."""
    ratios = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)] + [0]
    cfg = deepseek_v4.parse_config({"model_type": "deepseek_v4", "compress_ratios": ratios, "num_hash_layers": 3,
                                    "qk_rope_head_dim": 64, "rope_scaling": {"type": "yarn", "factor": 16,
                                    "original_max_position_embeddings": 65536}})
    assert cfg.layer_types.count(CSA) == 21 and cfg.layer_types.count(HCA) == 20
    with torch.device("meta"):
        model = deepseek_v4.Model(cfg)
    params = sum(p.numel() for p in model.parameters())
    assert 280e9 < params < 300e9, params
    # per token, bfloat16: the window and input slots are rings (a fixed size); the entry slots hold
    # an entry (CSA: 512 + 128 values; HCA: 512) over its window's rows (4: 160 a row; 128: 4 a row)
    per_token = sum(h * d * 2 * 2 for (h, d), w in zip(model.kv_shapes(), model.kv_windows()) if w is None)
    assert per_token == 2 * (21 * 160 + 20 * 4) == 6880


def test_greedy_speculative_equals_transformers_generate(checkpoint):
    check_greedy_equals_transformers(*checkpoint, block_sizes=(3, 8))


@pytest.fixture(scope="module")
def agree_pair(tmp_path_factory, tokenizer_dir):
    """(target_dir, drafter_dir): the agreeable recipe (conftest's :func:`make_agreeable`) on a V4
    target, with a Speculators drafter of small weights (N(0, 0.02)) reading its streams."""
    root = tmp_path_factory.mktemp("deepseek_v4_agree")
    target = make_v4_target(root / "target", seed=1)
    # (c's own multiple of u as large as the others' mean: runs of c that the context ends, tau 1..8)
    target, _ = make_agreeable(target, tokenizer_dir, root, "deepseek_v4", block_size=8, alpha=1.0, self_scale=1.0)
    return target, v4_drafter(target, root / "spec", std=0.02)


def test_many_accepted_tokens_are_lossless(agree_pair):
    check_many_accepted_tokens_are_lossless(*agree_pair)


def test_compiled_rounds_are_lossless_and_do_not_recompile(agree_pair):
    check_compiled_rounds_are_lossless(*agree_pair)


def test_prefix_reuse_decodes_as_without(agree_pair):
    from test_prefix_reuse import reuse_decodes_as_without

    _, reused = reuse_decodes_as_without(agree_pair)
    assert reused[0] == 0 and reused[1] > 0 and reused[2] > 0


def test_embedding_and_last_layer_features_are_lossless(agree_pair, tmp_path):
    """A drafter reading the embedding and the last layer's streams (aux ids 0 and 4)
    decodes exactly the target's own tokens; a DFlash-format drafter, which reads features
    of hidden_size values a layer, is refused in one line."""
    from dflash_torch import DFlashEngine

    target, _ = agree_pair
    spec = DFlashEngine.from_pretrained(target, v4_drafter(target, tmp_path / "spec", std=0.02, layer_ids=[-1, 3]))
    alone = DFlashEngine(spec.target, spec.tokenizer)
    for prompt in ([5, 17, 99, 3], list(range(2, 30))):
        out = spec.generate(prompt, max_new_tokens=40, ignore_eos=True)
        assert out.token_ids == alone.generate(prompt, max_new_tokens=40, ignore_eos=True).token_ids
        assert max(out.stats.acceptance_lengths) > 1
    plain = save_drafter(tmp_path / "plain", drafter_config(target, block_size=8))
    with pytest.raises(DFlashError, match="reads target features of 32 values a layer") as e:
        DFlashEngine.from_pretrained(target, plain)
    assert "\n" not in str(e.value)


def published_layout(src: Path, dst: Path, *, extra: dict | None = None) -> Path:
    """``src`` rewritten with the published checkpoint's top-level DeepSeek names
    (``embed.weight``, ``layers.*``, ``norm.weight``, ``hc_head_fn`` ..., ``head.weight``)."""
    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
           "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
           "model.hc_head.hc_scale": "hc_head_scale"}

    def rename(state):
        renamed = {top.get(k, k.removeprefix("model.")): v for k, v in state.items()}
        state.clear()
        state.update(renamed, **(extra or {}))

    return edited_checkpoint(src, dst, state=rename)


def test_published_layout_loads_and_mtp_is_not_read(models, checkpoint, tmp_path):
    _, _, ref = models
    mtp = {"mtp.0.attn.wq_a.weight": torch.zeros(24, 32), "mtp.0.hc_head_fn": torch.zeros(3, 96)}
    target = published_layout(checkpoint[0], tmp_path / "published", extra=mtp)
    assert "layers.0.attn.wq_a.weight" in load_file(str(target / "model.safetensors"))
    logits, _ = run_pieces(TargetModel.from_pretrained(target, torch.float32), IDS, [40], features=False)
    torch.testing.assert_close(logits, ref.logits[0], rtol=0, atol=ATOL)
    bad = published_layout(checkpoint[0], tmp_path / "unknown", extra={"layers.0.attn.wfoo.weight": torch.zeros(2)})
    with pytest.raises(DFlashError, match="layers.0.attn.wfoo.weight"):
        TargetModel.from_pretrained(bad, torch.float32)


def test_bfloat16_keeps_float32_parts(checkpoint):
    ours = TargetModel.from_pretrained(checkpoint[0], torch.bfloat16)
    dtypes = {k: p.dtype for k, p in ours.state_dict().items()}
    for key in ("model.layers.0.attn_hc.fn", "model.layers.1.self_attn.sinks", "model.hc_head.hc_fn",
                "model.layers.1.self_attn.compressor.position_bias", "model.layers.2.mlp.gate.e_score_correction_bias",
                "model.layers.1.self_attn.compressor.indexer.kv_norm.weight", "model.norm.weight"):
        assert dtypes[key] == torch.float32, key
    assert dtypes["model.layers.0.self_attn.q_a_proj.weight"] == torch.bfloat16
    assert dtypes["model.layers.0.mlp.gate.tid2eid"] == torch.int64
    logits, _ = run_pieces(ours, IDS, [20, 20], features=False)
    assert torch.isfinite(logits).all()


LEGACY = [
    {"compress_ratios": [0, 4, 128, 4, 0], "num_hash_layers": 2, "qk_rope_head_dim": 8},
    {"compress_ratios": [4, 128, 4, 128, 4], "compress_rate_hca": 128, "rope_scaling":
        {"type": "yarn", "factor": 16, "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1}},
    {"compress_rate_csa": 8, "compress_rate_hca": 16, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    # (both: transformers reads rope_scaling in place of rope_parameters; the latter's factor 16 was read)
    {"rope_parameters": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256},
     "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}},
    {"layer_types": [SLIDING, SLIDING, CSA, HCA], "mlp_layer_types": ["moe", "hash_moe", "moe", "moe"]},
    {},
    # nested parts without rope_theta: both take the top-level rope_theta (a KeyError before)
    {"rope_theta": 5000.0, "compress_rope_theta": 77777.0, "partial_rotary_factor": 0.25, "rope_parameters": {
        "main": {"rope_type": "default", "partial_rotary_factor": 0.25},
        "compress": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                     "partial_rotary_factor": 0.25}}},
    # nested parts without partial_rotary_factor, and with the one qk_rope_head_dim / head_dim gives
    {"partial_rotary_factor": 0.5, "rope_parameters": {"main": {"rope_type": "default"}, "compress": {"rope_type": "default"}}},
    {"qk_rope_head_dim": 8, "rope_parameters": {"main": {"partial_rotary_factor": 0.25},
                                                "compress": {"partial_rotary_factor": 0.25}}},
]


@pytest.mark.parametrize("legacy", LEGACY, ids=range(len(LEGACY)))
def test_legacy_config_folds_as_transformers(legacy):
    """Layer types, MLP types, compress rates, the rotated size and both RoPE tables (with
    their attention factor) equal what transformers' ``DeepseekV4Config`` makes of the same
    keys."""
    import transformers
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    base = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
                max_position_embeddings=4096)
    raw = {**base, **legacy}
    hf = transformers.DeepseekV4Config(**copy.deepcopy(raw))  # (it fills the nested rope dicts in place)
    ours = deepseek_v4.parse_config({"model_type": "deepseek_v4", **raw})
    assert ours.layer_types == hf.layer_types and ours.mlp_layer_types == hf.mlp_layer_types
    assert ours.compress_rates == hf.compress_rates and ours.rope_dim == hf.qk_rope_head_dim
    rot = DeepseekV4RotaryEmbedding(hf)
    model_rot = deepseek_v4.Model.make_rotary(type("M", (), {"config": ours})())
    for key in ("main", "compress"):
        torch.testing.assert_close(model_rot[key].inv_freq, getattr(rot, f"{key}_inv_freq"), rtol=1e-6, atol=0)
        assert model_rot[key].attention_factor == pytest.approx(getattr(rot, f"{key}_attention_scaling"))


@pytest.mark.parametrize("change,match", [
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"compress_ratios": [0, 4, 64, 4]}, "compress_ratios"),
    ({"compress_ratios": [0, 4, 128, 4], "compress_rate_csa": 8}, "disagrees"),
    ({"layer_types": [SLIDING, "full_attention", HCA, CSA]}, "layer_types"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"n_shared_experts": 2}, "n_shared_experts"),
    ({"num_key_value_heads": 4}, "num_key_value_heads"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"swiglu_limit": 0}, "swiglu_limit"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantized"),  # (FP8: test_deepseek_v4_quant.py)
    # (transformers rotates each nested part by its own factor; we rotate by the top-level one)
    ({"rope_parameters": {"main": {"partial_rotary_factor": 0.75}, "compress": {"partial_rotary_factor": 0.25}}},
     r"rope_parameters.main.partial_rotary_factor 0.75 disagrees with the top-level partial_rotary_factor 0.25"),
    ({"rope_parameters": {"main": {}, "compress": {**YARN, "partial_rotary_factor": 0.5}}},
     r"rope_parameters.compress.partial_rotary_factor 0.5 disagrees with the top-level partial_rotary_factor 0.25"),
])
def test_unsupported_configs_are_refused(change, match):
    raw = {"model_type": "deepseek_v4", **TINY, **change}
    if "compress_ratios" in change:
        raw.pop("layer_types")
        raw.pop("compress_rates")
    with pytest.raises(DFlashError, match=match) as e:
        TargetConfig.from_dict(raw)
    assert "\n" not in str(e.value)


def test_checkpoint_names():
    """DeepSeek's names (top level or under ``model.``) map onto transformers' in-memory names."""
    assert deepseek_v4.our_name("layers.3.attn.indexer.compressor.ape") == \
        "model.layers.3.self_attn.compressor.indexer.position_bias"
    assert deepseek_v4.our_name("model.layers.0.ffn.experts.5.w3.weight") == "model.layers.0.mlp.experts.5.up_proj.weight"
    assert deepseek_v4.our_name("layers.2.ffn.gate.bias") == "model.layers.2.mlp.gate.e_score_correction_bias"
    assert deepseek_v4.our_name("hc_head_scale") == "model.hc_head.hc_scale"
    assert deepseek_v4.our_name("head.weight") == "lm_head.weight"
    assert deepseek_v4.our_name("model.layers.1.self_attn.q_a_proj.weight") == "model.layers.1.self_attn.q_a_proj.weight"


def test_a_trained_drafter_reads_every_stream(checkpoint, tmp_path):
    """The trainer's drafter of a V4 target reads its layers' whole feature rows (streams of
    3 x 32 values a layer: ``target_hidden_size`` 96 in the DFlash format, which it was
    refused for before the format said it)."""
    from dflash_torch.training.trainer import TrainConfig, make_drafter_config

    cfg = TrainConfig(target=str(checkpoint[0]), data=[str(tmp_path / "data.jsonl")], out=str(tmp_path / "out"))
    dcfg = make_drafter_config(TargetConfig.from_dict({"model_type": "deepseek_v4", **TINY}), cfg, 1)
    assert dcfg.target_hidden_size == dcfg.feature_size == 96 and dcfg.to_dict()["target_hidden_size"] == 96