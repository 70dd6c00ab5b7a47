"""GLM-5.3-Flash targets (``glm5_next``: Kimi Delta Attention + NoPE latent attention with a pooled
sparse indexer + hyper-connections + clamped MoE) against transformers' own
``Glm5NextForConditionalGeneration`` (saved with ``save_pretrained``: the published names).

* our forward == transformers' (logits and every layer's output streams, float32): one pass
  past the indexer's budget (so pools are chosen), in pieces through the cache (eager and fixed
  shapes), a deferred verify committed in part then single tokens; a second shape with the
  softplus forget gate, no expert groups, three streams;
* KDA rollback: the state after a verify block and a commit of its first n rows == the state
  after feeding only those n rows, for every n; batched == one sequence at a time;
* power: the same checks fail when a part is wrong (KDA's decay shared by a head's channels,
  every pool kept, the rollback with a per-head decay);
* greedy speculative decoding == transformers' greedy ``generate``; an agreeable pair whose
  rounds accept many tokens is lossless eager, chunked, fixed-shape, batched and compiled;
* fine-grained FP8 (every projection, the experts, KDA's and the indexer's linears) == transformers
  loading it; kept packed == dequantized bit for bit;
* transformers' in-memory names load the same model; refusals in one line; GLM-5.3-Flash's
  config as transformers' defaults describe it reads as transformers reads it (parameter shapes,
  KV-cache bytes a token).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import (EOS_ID, VOCAB, added_tensor, check_compiled_rounds_are_lossless, check_greedy_equals_transformers,
                      check_many_accepted_tokens_are_lossless, check_rollback, copy_tokenizer, drafter_config,
                      edited_checkpoint, incremental_logits, load_hf, save_drafter, to_speculators)
from dflash_torch import DFlashError
from dflash_torch.cache import RecurrentState, cache_bytes
from dflash_torch.models import glm5_next, kda
from dflash_torch.models.config import TargetConfig
from dflash_torch.models.gated_deltanet import state_after
from dflash_torch.models.target import TargetModel

H = 64
KINDS = ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention", "indexed_attention"]
# index_topk 16 in pools of 4: a query past 19 tokens attends to 4 chosen pools and its own incomplete one
TINY = dict(vocab_size=VOCAB, hidden_size=H, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=32,
            q_lora_rank=48, qk_nope_head_dim=16, v_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2,
            index_topk=16, index_head_dim=16, index_n_heads=8, index_kpool=4, linear_head_dim=8, linear_num_heads=4,
            hc_mult=2, routed_scaling_factor=2.0, layer_types=KINDS,
            mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse"],
            indexer_types=["full", "full", "shared", "full", "full"], eos_token_id=EOS_ID, pad_token_id=EOS_ID,
            max_position_embeddings=4096)
SHAPES = {
    "safe-gate": {},
    "softplus-gate": dict(linear_lower_bound=None, n_group=1, hc_mult=3, index_kpool=2, index_topk=8,
                          indexer_types=["full"] * 5, mlp_layer_types=["sparse"] * 5),
}
VISION = dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=H, intermediate_size=32,
              projection_intermediate_size=32)
ATOL = 1e-5  # one pass (measured: about 3e-6 on logits of magnitude ~1)
PIECES_ATOL = 5e-5  # through the cache, in pieces (measured: up to about 2e-5; another rounding order)


def make_glm5_target(out_dir: Path, *, seed: int = 0, **overrides) -> Path:
    """Save a tiny random ``Glm5NextForConditionalGeneration`` (:data:`TINY` plus ``overrides``;
    a one-block vision tower) with transformers' ``save_pretrained`` (the published names: the
    forget gate flat under ``self_attn``, split convolutions, ``hc_attn_fn``, per-expert weights).
    Weights are drawn wide enough that the indexer's scores do not tie (see the module docstring
    of :mod:`~dflash_torch.models.glm5_next`)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Glm5NextConfig(text_config={**TINY, **overrides}, vision_config=VISION, tie_word_embeddings=False)
    model = transformers.Glm5NextForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".visual." in name:
                continue
            if name.endswith(("A_log", "_hc.base", "_hc.scale", "k_norm.bias")):
                p.normal_(0, 0.5)
            elif name.endswith("dt_bias"):
                p.normal_(0, 1.0)
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0, 0.3)
            elif name.endswith(("norm.weight", "layernorm.weight")):
                p.normal_(1, 0.1)
            elif p.dim() >= 2:
                p.normal_(0, 0.08)
            else:
                p.normal_(0, 0.1)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


def glm5_drafter(target: Path, out_dir: Path, *, std: float = 0.08, seed: int = 0, block_size: int = 8) -> Path:
    """A random Speculators-format DFlash drafter (two layers) reading the target's multi-stream
    features (``target_hidden_size`` = ``hc_mult * hidden_size``)."""
    from dflash_torch.models.drafter import DFlashDrafter

    text = json.loads((target / "config.json").read_text())["text_config"]
    cfg = drafter_config(target, block_size=block_size)
    cfg.target_hidden_size = text["hc_mult"] * text["hidden_size"]
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    plain = save_drafter(Path(str(out_dir) + "-dflash"), cfg, model.state_dict())
    target_state = load_file(str(target / "model.safetensors"))
    (out_dir.parent / "flat").mkdir(exist_ok=True)  # (to_speculators reads model.embed_tokens.weight)
    save_file({"model.embed_tokens.weight": target_state["model.language_model.embed_tokens.weight"],
               "lm_head.weight": target_state["lm_head.weight"]}, str(out_dir.parent / "flat" / "model.safetensors"))
    out = to_speculators(plain, out_dir.parent / "flat", out_dir)
    spec = json.loads((out / "config.json").read_text())
    spec["target_hidden_size"] = cfg.target_hidden_size
    spec["speculators_config"]["verifier"]["architectures"] = ["Glm5NextForConditionalGeneration"]
    (out / "config.json").write_text(json.dumps(spec, indent=2))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir) -> dict:
    """shape -> target_dir."""
    out = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        target = make_glm5_target(tmp_path_factory.mktemp(name) / "target", seed=i, **shape)
        copy_tokenizer(tokenizer_dir, target)
        out[name] = target
    return out


@pytest.fixture(scope="module")
def models(checkpoints) -> dict:
    """shape -> (transformers' model, ours)."""
    return {name: (load_hf(t), TargetModel.from_pretrained(t, torch.float32)) for name, t in checkpoints.items()}


def _streams(hf_out, layer: int) -> torch.Tensor:
    """transformers' layer ``layer`` output streams ``[T, hc * H]``."""
    return hf_out.hidden_states[layer + 1][0].flatten(1)


def _forward(model, ids: torch.Tensor, pieces: list[int], static: bool) -> tuple[torch.Tensor, torch.Tensor]:
    cache = model.new_cache()
    cache.reset(128)
    layers = list(range(model.config.num_hidden_layers))
    logits, feats, start = [], [], 0
    with torch.no_grad():
        for n in pieces:
            end = start + n
            lg, f = model(ids[start:end], torch.arange(start, end), cache, None if static else end, layers)
            logits.append(lg)
            feats.append(f)
            start = end
    return torch.cat(logits), torch.cat(feats)


IDS = torch.randint(2, VOCAB, (90,), generator=torch.Generator().manual_seed(1))  # > one 64-token KDA chunk


@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_transformers(models, shape):
    hf, ours = models[shape]
    assert ours.config.model_type == "glm5_next" and ours.recurrent and ours.config.feature_size == \
        ours.config.hc_mult * H
    L = ours.config.num_hidden_layers
    with torch.no_grad():
        ref = hf(IDS[None], output_hidden_states=True)
    logits, feats = _forward(ours, IDS, [90], False)
    width = ours.config.feature_size
    torch.testing.assert_close(logits, ref.logits[0], rtol=ATOL, atol=ATOL)
    for layer in range(L - 1):  # (transformers' last hidden state is the final norm's output)
        torch.testing.assert_close(feats[:, layer * width:(layer + 1) * width], _streams(ref, layer),
                                   rtol=ATOL, atol=ATOL)
    for static in (False, True):  # pieces through the cache, eager and over the whole preallocated buffer
        lg, _ = _forward(ours, IDS[:70], [23, 16, 1, 1, 29], static)
        torch.testing.assert_close(lg, ref.logits[0, :70], rtol=ATOL, atol=PIECES_ATOL)
    # a prefill chunk, a deferred verify block committed in part, single tokens
    torch.testing.assert_close(incremental_logits(ours, IDS), ref.logits[0, :60], rtol=ATOL, atol=PIECES_ATOL)


def test_power_a_wrong_part_is_caught(models, monkeypatch):
    """The comparison above fails when KDA's decay is shared by a head's channels (Gated
    DeltaNet's) or when the indexer keeps every pool (dense attention): both change the logits
    far beyond the tolerance, so the sparse choice and the per-channel decay are exercised."""
    hf, ours = models["safe-gate"]
    with torch.no_grad():
        ref = hf(IDS[None]).logits[0]
    right, _ = _forward(ours, IDS, [90], False)
    forget = kda.ForgetGate.forward
    monkeypatch.setattr(kda.ForgetGate, "forward", lambda self, x: forget(self, x).mean(-1, keepdim=True).expand(
        -1, self.heads, self.head_dim))
    per_head, _ = _forward(ours, IDS, [90], False)
    monkeypatch.undo()
    monkeypatch.setattr(glm5_next.PooledIndexer, "pool_bias", lambda self, x, q, rows, bias, pos: bias)
    dense, _ = _forward(ours, IDS, [90], False)
    assert (right - ref).abs().max() < ATOL
    assert (per_head - ref).abs().max() > 1e-2 and (dense - ref).abs().max() > 1e-2
    # (the first 20 tokens see no more pools than the indexer keeps: dense there)
    torch.testing.assert_close(dense[:19], ref[:19], rtol=ATOL, atol=ATOL)


@pytest.mark.parametrize("shape", SHAPES)
def test_rollback_equals_feeding_only_the_accepted_tokens(models, shape):
    _, model = models[shape]
    check_rollback(model, torch.randint(2, VOCAB, (60,), generator=torch.Generator().manual_seed(2)), range(1, 17))


def test_kda_rollback_needs_the_per_channel_decay(models):
    """The closed form with each channel's own cumulative decay gives the state after n rows;
    with the decay averaged over a head's channels (Gated DeltaNet's form) it does not."""
    _, model = models["safe-gate"]
    layer = next(layer for layer in model.model.layers if layer.kind == "linear_attention")
    mixer, slot = layer.linear_attn, layer.slot
    g = torch.Generator().manual_seed(5)
    x, block = torch.randn(20, H, generator=g), torch.randn(16, H, generator=g)
    verified, fed = RecurrentState(torch.float32, "cpu"), RecurrentState(torch.float32, "cpu")
    for state in (verified, fed):
        mixer.new_state(state)
    with torch.no_grad():
        for state in (verified, fed):
            mixer(x, state, 0)
        mixer(block, verified, 0, defer=True)
        mixer(block[:9], fed, 0)
        conv_in, k, u, G = verified.stashed(0)
        exact = state_after(verified.ssm[0], k, u, G, 9)
        shared = state_after(verified.ssm[0], k, u, G.mean(-1), 9)
    assert slot >= 0
    torch.testing.assert_close(exact, fed.ssm[0], rtol=1e-5, atol=1e-6)
    assert (shared - fed.ssm[0]).abs().max() > 1e-3


def test_batched_kda_equals_one_sequence_at_a_time(models):
    """One KDA layer over N sequences at once == over each alone: a prefill committed over a
    different count per sequence (past a 64-token chunk), a deferred block, a commit of a
    different accepted count per sequence (0: unchanged)."""
    _, model = models["safe-gate"]
    mixer = next(layer for layer in model.model.layers if layer.kind == "linear_attention").linear_attn
    N, P, B = 4, 70, 16
    prefill_rows, accepted_rows = torch.tensor([3, 70, 20, 9]), torch.tensor([1, 16, 7, 0])
    g = torch.Generator().manual_seed(4)
    prompts, blocks = torch.randn(N, P, H, generator=g), torch.randn(N, B, H, generator=g)
    batched, alone = RecurrentState(torch.float32, "cpu", N), [RecurrentState(torch.float32, "cpu") for _ in range(N)]
    for state in [batched] + alone:
        mixer.new_state(state)
    with torch.no_grad():
        out = mixer(prompts.view(N * P, -1), batched, 0, commit=prefill_rows)
        ref = [mixer(prompts[i], alone[i], 0, commit=int(prefill_rows[i])) for i in range(N)]
        for i in range(N):
            torch.testing.assert_close(out.view(N, P, -1)[i, :prefill_rows[i]], ref[i][:prefill_rows[i]],
                                       rtol=1e-5, atol=1e-6)
        out = mixer(blocks.view(N * B, -1), batched, 0, defer=True)
        ref = [mixer(blocks[i], alone[i], 0, defer=True) for i in range(N)]
        torch.testing.assert_close(out, torch.cat(ref), rtol=1e-5, atol=1e-6)
        before = alone[3].ssm[0].clone()
        mixer.commit(batched, 0, accepted_rows)
        for i in range(N):
            if accepted_rows[i] > 0:
                mixer.commit(alone[i], 0, accepted_rows[i])
    assert torch.equal(alone[3].ssm[0], before)
    for i in range(N):
        assert torch.equal(batched.conv[0][i], alone[i].conv[0][0])
        torch.testing.assert_close(batched.ssm[0][i], alone[i].ssm[0][0], rtol=1e-5, atol=1e-6)


def test_transformers_in_memory_names_load_the_same_model(models, checkpoints, tmp_path):
    """A checkpoint written with transformers' in-memory names (``forget_gate.*``, one
    ``conv1d``, ``attn_hc.fn``, stacked experts) loads exactly as the published names."""
    hf, ours = models["safe-gate"]
    out = tmp_path / "in-memory"
    out.mkdir()
    (out / "config.json").write_text((checkpoints["safe-gate"] / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(out / "model.safetensors"))
    assert any(".forget_gate." in k for k in hf.state_dict())
    theirs = TargetModel.from_pretrained(out, torch.float32).state_dict()
    mine = ours.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_fp8_checkpoint_equals_transformers_dequantization_and_packed_equals_dequantized(checkpoints, tmp_path):
    """Fine-grained FP8 (e4m3, blocks of [8, 16]) on every projection of the published names (KDA's
    ``q/k/v/b/f_*/g_*/o_proj``, the latent attention's, the indexer's ``wq_b`` / ``wk`` /
    ``weights_proj``, dense, shared and per-expert MLPs): our float32 logits == those of transformers
    loading the FP8 checkpoint itself (on the CPU: dequantized); kept packed (FP8
    linears, the experts as stored, ``kv_b_proj`` dequantized) the logits equal the dequantized
    model's bit for bit, in float32 and bfloat16."""
    import transformers
    from test_fp8 import to_fp8

    from dflash_torch.models import fp8

    quantized = to_fp8(checkpoints["safe-gate"], tmp_path / "fp8", (8, 16),
                       suffixes=("_proj.weight", "_proj_with_mqa.weight", ".wq_b.weight", ".wk.weight"))
    stored = load_file(str(quantized / "model.safetensors"))
    for key in ("0.self_attn.f_b_proj", "0.self_attn.q_proj", "1.self_attn.indexer.wk", "1.mlp.experts.3.up_proj",
                "1.self_attn.kv_b_proj"):
        assert stored[f"{P}{key}.weight"].dtype == fp8.FORMAT, key
    hf = transformers.Glm5NextForConditionalGeneration.from_pretrained(str(quantized), dtype=torch.float32,
                                                                       experts_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(IDS[None]).logits[0]
    for dtype in (torch.float32, torch.bfloat16):
        plain = TargetModel.from_pretrained(quantized, dtype)
        packed = TargetModel.from_pretrained(quantized, dtype, fp8="packed")
        layers = packed.model.layers
        assert isinstance(layers[0].linear_attn.forget_gate.f_b_proj, fp8.Fp8Linear)
        assert isinstance(layers[1].self_attn.indexer.wk, fp8.Fp8Linear)
        assert layers[1].self_attn.kv_b_proj.weight.dtype == dtype and layers[1].mlp.experts.fp8_block_cols == 16
        a, b = _forward(plain, IDS[:50], [30, 20], False)[0], _forward(packed, IDS[:50], [30, 20], False)[0]
        assert torch.equal(a, b), dtype
        if dtype == torch.float32:
            torch.testing.assert_close(_forward(plain, IDS, [90], False)[0], ref, rtol=ATOL, atol=ATOL)


@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_speculative_equals_transformers_generate(checkpoints, tmp_path, shape):
    drafter = glm5_drafter(checkpoints[shape], tmp_path / "spec")
    check_greedy_equals_transformers(checkpoints[shape], drafter, block_sizes=(3, 8), new_tokens=20)


@pytest.fixture(scope="module")
def agree_pair(tmp_path_factory, tokenizer_dir):
    """(target_dir, drafter_dir): a target whose small random drafter agrees with it often (a
    shared direction u in every token embedding, the agree token's head row ``5 u``, as the
    other families' agreeable pairs), with a drafter reading the target's streams."""
    root = tmp_path_factory.mktemp("glm5_agree")
    target = make_glm5_target(root / "target", seed=1)
    state = load_file(str(target / "model.safetensors"))
    embed = "model.language_model.embed_tokens.weight"
    g = torch.Generator().manual_seed(0)
    u = torch.randn(H, generator=g)
    u /= u.norm()
    scale = torch.rand(VOCAB, 1, generator=g) * 2
    scale[42] = 0.3
    state[embed] += 1.0 * scale * u
    state["lm_head.weight"][42] = 5.0 * u
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    copy_tokenizer(tokenizer_dir, target)
    return target, glm5_drafter(target, root / "spec", std=0.02)


def test_many_accepted_tokens_are_lossless(agree_pair):
    check_many_accepted_tokens_are_lossless(*agree_pair)


def test_compiled_rounds_are_lossless_and_do_not_recompile(agree_pair):
    check_compiled_rounds_are_lossless(*agree_pair)


def test_dflash_format_drafter_reads_the_streams_by_target_hidden_size(agree_pair, tmp_path):
    """A DFlash-format drafter (``DFlashDraftModel``) of the multi-stream features says their
    width with ``target_hidden_size`` (top level or ``dflash_config``), as EAGLE-3 and
    Speculators configs do: it runs as the same drafter in the Speculators format does (same
    tokens, same acceptance lengths: target-only's). Without the key, the refusal names it."""
    from dflash_torch import DFlashEngine

    target, spec_dir = agree_pair
    plain = Path(str(spec_dir) + "-dflash")  # (glm5_drafter's DFlash-format copy of the same weights)
    cfg = json.loads((plain / "config.json").read_text())
    text = json.loads((target / "config.json").read_text())["text_config"]
    hidden, streams = text["hidden_size"], text["hc_mult"]
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["target_hidden_size"] == streams * hidden
    reference = DFlashEngine.from_pretrained(target, spec_dir)
    want = reference.generate([5, 17, 99, 3], max_new_tokens=40, ignore_eos=True)
    assert sum(want.stats.acceptance_lengths) / len(want.stats.acceptance_lengths) > 1.5
    for where in ("top", "dflash_config"):
        moved = shutil.copytree(plain, tmp_path / where)
        edited = dict(cfg)
        if where == "dflash_config":
            edited["dflash_config"] = {**cfg["dflash_config"], "target_hidden_size": edited.pop("target_hidden_size")}
        (moved / "config.json").write_text(json.dumps(edited))
        engine = DFlashEngine(reference.target, reference.tokenizer,
                              DFlashEngine.from_pretrained(target, moved).drafter)
        got = engine.generate([5, 17, 99, 3], max_new_tokens=40, ignore_eos=True)
        assert got.token_ids == want.token_ids
        assert got.stats.acceptance_lengths == want.stats.acceptance_lengths
    for edited, message in (
            ({k: v for k, v in cfg.items() if k != "target_hidden_size"},
             rf"reads target features of {hidden} values a layer \(its hidden_size\), the target's layers give "
             rf"{streams * hidden} \({streams} residual streams of {hidden}\); a drafter whose fc reads them says so "
             rf"with target_hidden_size {streams * hidden}"),
            ({**cfg, "dflash_config": {**cfg["dflash_config"], "target_hidden_size": hidden}},
             rf"two target_hidden_size values: {streams * hidden} at the top level and {hidden} in dflash_config"),
            ({**cfg, "target_hidden_size": 0}, "target_hidden_size must be an integer >= 1, got 0")):
        bad = shutil.copytree(plain, tmp_path / "bad", dirs_exist_ok=True)
        (bad / "config.json").write_text(json.dumps(edited))
        with pytest.raises(DFlashError, match=message):
            DFlashEngine.from_pretrained(target, bad)


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_train_writes_a_drafter_of_the_streams_that_decodes_losslessly(checkpoints, tmp_path, arch):
    """``train`` on a multi-stream target: the drafter's fc reads every stream (config.json's
    ``target_hidden_size`` = ``hc_mult * hidden_size``; its head size, which the position-free
    target's ``head_dim`` 0 does not give, ``hidden_size / num_attention_heads``), and it
    decodes as target-only decoding does."""
    from dflash_torch import DFlashEngine
    from dflash_torch.training.trainer import Trainer, TrainConfig

    target = checkpoints["safe-gate"]
    text = json.loads((target / "config.json").read_text())["text_config"]
    data = tmp_path / "d.txt"
    data.write_text("def f(x):\n    return x + 1\n" * 40)
    out = tmp_path / "drafter"
    Trainer(TrainConfig(target=str(target), data=[str(data)], out=str(out), steps=2, batch=2, seq_len=64,
                        anchors_per_seq=4, val_seqs=0, warmup_steps=1, progress=False, arch=arch),
            log=lambda line: None).run()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["target_hidden_size"] == text["hc_mult"] * text["hidden_size"]
    assert cfg["head_dim"] == text["hidden_size"] // text["num_attention_heads"]
    spec = DFlashEngine.from_pretrained(target, out)
    base = DFlashEngine(spec.target, spec.tokenizer)
    assert spec.drafter.fc.weight.shape[1] == len(cfg["dflash_config"]["target_layer_ids"]) * cfg["target_hidden_size"]
    assert spec.generate("def g(y):", max_new_tokens=20, ignore_eos=True).token_ids == \
        base.generate("def g(y):", max_new_tokens=20, ignore_eos=True).token_ids


def _edit(key, value, text=True):
    def edit(cfg):
        (cfg["text_config"] if text else cfg)[key] = value
    return edit


@pytest.mark.parametrize("edit, message", [
    (_edit("qk_rope_head_dim", 64), "qk_rope_head_dim 64 is not supported"),
    (_edit("num_key_value_heads", 2), "num_key_value_heads 2 != num_attention_heads 4"),
    (_edit("index_topk", 18), "index_topk 18 must be a multiple of index_kpool 4"),
    (_edit("index_kpool_always_select_tail", False), "index_kpool_always_select_tail false"),
    (_edit("hidden_act", "gelu"), "hidden_act 'gelu' is not supported"),
    (_edit("layer_types", ["linear_attention"] * 4 + ["mamba"]), "layer_types must be"),
    (_edit("indexer_types", ["full", "shared", "full", "full", "full"]), "layer 1 a shared indexed layer"),
    (_edit("indexer_types", ["full", "full", "full", "full", "shared"]), "layer 4 a shared indexed layer"),
    (lambda c: (c["text_config"].pop("indexer_types"), c["text_config"].update(index_topk_pattern="FFXFF")),
     "index_topk_pattern must be a string"),
    (_edit("mlp_layer_types", ["dense"] * 4), "mlp_layer_types must list"),
    (_edit("n_group", 3), "n_group 3 must split n_routed_experts 8"),
    (_edit("linear_head_dim", "8"), "linear_head_dim must be an integer"),
    (_edit("linear_lower_bound", 3.0), "linear_lower_bound must be a negative number or null"),
    (_edit("text_config", {"model_type": "qwen3"}, text=False), "expected glm5_next_text"),
    (lambda c: c.pop("text_config"), "config.json of model_type 'glm5_next' lacks text_config"),
    (_edit("quantization_config", {"quant_method": "modelopt", "quant_algo": "FP8"}, text=False),
     "quant_method 'modelopt'"),
])
def test_bad_configs_are_refused_in_one_line(checkpoints, tmp_path, edit, message):
    target = edited_checkpoint(checkpoints["safe-gate"], tmp_path / "t", config=edit)
    with pytest.raises(DFlashError) as err:
        TargetModel.from_pretrained(target, torch.float32)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


P = "model.language_model.layers."


def _moved(prefix):
    """A state edit: the decoder's weights moved from ``model.language_model.`` to ``prefix``."""
    def edit(state):
        for key in [k for k in state if k.startswith("model.language_model.")]:
            state[prefix + key[len("model.language_model."):]] = state.pop(key)
    return edit


@pytest.mark.parametrize("edit, message", [
    (added_tensor(P + "1.self_attn.q_a_proj.bias", (48,)), "does not use"),  # attention biases the config does not announce
    (added_tensor(P + "5.eh_proj.weight", (64, 128)), "does not use"),  # an MTP layer num_nextn_predict_layers 0 does not announce
    (added_tensor(P + "0.self_attn.rope.inv_freq"), "does not use"),
    (added_tensor(P + "0.self_attn.indexer.wk.weight", (16, 64)), "does not use"),  # (a KDA layer has no indexer)
    (lambda s: s.pop(P + "0.self_attn.k_conv1d.weight"), "part of its split convolution"),
    (lambda s: s.pop(P + "1.mlp.experts.3.up_proj.weight"), "up_proj"),
    (lambda s: s.pop(P + "3.self_attn.A_log"), "lacks weights: model.language_model.layers.3.self_attn.A_log"),
    (lambda s: s.pop(P + "4.hc_ffn_fn"), "lacks weights: model.language_model.layers.4.hc_ffn_fn"),
    (lambda s: s.update({P + "0.attn_hc.fn": s[P + "0.hc_attn_fn"].clone()}), "twice"),
    # a glm5_next config, as transformers' wrapper, reads the decoder under model.language_model. only
    (_moved("language_model.model."), "GLM-5.3-Flash multimodal wrapper's (model_type glm5_next), whose decoder's "
     "weights lie under model.language_model., but no weight of the checkpoint is there"),
    (_moved("model."), "its weights (model.embed_tokens.weight, ...) are laid out as a text checkpoint's"),
])
def test_bad_checkpoints_are_refused_in_one_line(checkpoints, tmp_path, edit, message):
    def no_mtp(cfg):
        cfg["text_config"]["num_nextn_predict_layers"] = 0
    target = edited_checkpoint(checkpoints["safe-gate"], tmp_path / "t", config=no_mtp, state=edit)
    with pytest.raises(DFlashError) as err:
        TargetModel.from_pretrained(target, torch.float32)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_mtp_and_shared_indexer_weights_are_skipped_text_configs_load(checkpoints, models, tmp_path):
    src = checkpoints["safe-gate"]
    mtp = edited_checkpoint(src, tmp_path / "mtp", state=lambda s: s.update({
        P + "5.eh_proj.weight": torch.zeros(64, 128), P + "5.shared_head.norm.weight": torch.ones(64),
        P + "2.self_attn.indexer.wk.weight": torch.zeros(16, 64)}))  # (layer 2 shares layer 1's choice: no indexer)
    a, b = models["safe-gate"][1].state_dict(), TargetModel.from_pretrained(mtp, torch.float32).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    not_mtp = edited_checkpoint(src, tmp_path / "not-mtp", state=added_tensor(P + "5.input_layernorm.weight", (64,)))
    with pytest.raises(DFlashError, match="no eh_proj.weight"):
        TargetModel.from_pretrained(not_mtp, torch.float32)

    def text_only(cfg):
        cfg.update(cfg.pop("text_config"))
    with pytest.raises(DFlashError, match="vision tower"):
        TargetModel.from_pretrained(edited_checkpoint(src, tmp_path / "text", config=text_only), torch.float32)
    # a glm5_next_text config over the decoder alone, and a glm5_next config keeping its text keys at the
    # top level (no text_config, as transformers reads one), load the same model
    def no_tower(state):
        for key in [k for k in state if k.startswith("model.visual.")]:
            del state[key]
    text = edited_checkpoint(src, tmp_path / "text-only", config=text_only, state=no_tower)

    def flat(cfg):
        cfg.update({k: v for k, v in cfg.pop("text_config").items() if k != "model_type"})
    for target in (text, edited_checkpoint(src, tmp_path / "flat", config=flat)):
        b = TargetModel.from_pretrained(target, torch.float32).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# GLM-5.3-Flash as transformers' Glm5NextConfig defaults describe it (zai-org/GLM-5.3-Flash)
PUBLISHED = {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
             "text_config": {"model_type": "glm5_next_text"}, "vision_config": {"model_type": "glm5_next_vision"},
             "tie_word_embeddings": False}


def test_published_config_reads_as_transformers_reads_it():
    import transformers

    theirs = transformers.Glm5NextConfig().text_config
    ours = TargetConfig.from_dict(PUBLISHED)
    assert ours.num_hidden_layers == theirs.num_hidden_layers == 45
    assert [k == "linear_attention" for k in ours.layer_types] == [k == "linear_attention" for k in theirs.layer_types]
    assert ours.layer_types.count("full_attention") == 11
    assert ours.indexer_full == [k == "indexed_attention" and m == "full" for k, m in
                                 zip(theirs.layer_types, theirs.indexer_types)]
    assert ours.moe_layers == [t == "sparse" for t in theirs.mlp_layer_types] and ours.moe_layers.count(False) == 3
    for key in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim", "index_topk", "index_head_dim",
                "index_n_heads", "index_kpool", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim",
                "linear_lower_bound", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "swiglu_limit", "n_group",
                "topk_group", "routed_scaling_factor", "rms_norm_eps", "vocab_size", "hidden_size"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert (ours.moe.num_experts, ours.moe.top_k, ours.moe.intermediate_size) == (288, 8, 2048)
    assert ours.softmax_scale == 256 ** -0.5 and ours.feature_size == 4 * 4096
    with torch.device("meta"):
        mine = glm5_next.Model(ours)
        reference = transformers.Glm5NextForConditionalGeneration(transformers.Glm5NextConfig())
    shapes = {glm5_next.Model.checkpoint_name(ours, k): tuple(v.shape) for k, v in mine.state_dict().items()}
    ref = {k: tuple(v.shape) for k, v in reference.state_dict().items() if ".visual." not in k}
    assert shapes == ref
    params = sum(v.numel() for v in mine.state_dict().values())
    assert params == 313_326_828_862  # (transformers' defaults: 42 layers of 288 experts; about 313B)
    # bfloat16 bytes a token: 11 indexed layers, each a latent row of 512 (+ 2 * 128 with a full indexer)
    per_token = sum(h * d * 2 * 2 for h, d in mine.kv_shapes())
    assert per_token == 11 * 768 * 2 == 16_896
    # and the KDA state per sequence: 34 layers of 64 heads of 128 x 128 float32 plus 3 conv inputs of 3 * 8192 each
    assert cache_bytes(mine, None, 1, 0) == 34 * (64 * 128 * 128 * 4 + 3 * 3 * 8192 * 4)  # (float32 on meta)


@pytest.mark.parametrize("text, refused", [
    (dict(linear_attn_config={"head_dim": 64, "num_heads": 32, "short_conv_kernel_size": 3, "gate_lower_bound": None,
                              "safe_gate": False}), False),
    (dict(linear_attn_config={"num_heads": 16, "gate_lower_bound": None}), False),  # (safe_gate default: bound -5)
    (dict(num_hidden_layers=4, layer_types=["linear_attention", "indexed_attention", "indexed_attention",
          "linear_attention"], index_topk_pattern="FFSF"), False),
    (dict(num_hidden_layers=6, index_topk_freq=2, index_skip_topk_offset=2, layer_types=["indexed_attention"] * 6,
          mlp_layer_types=["dense"] + ["sparse"] * 5), False),  # (full, full, shared, full, shared, full)
    (dict(num_hidden_layers=2, layer_types=["full_attention", "linear_attention"]), False),
    # layer 7 shares layer 6's choice, but layer 6 is a KDA layer: transformers fails when it runs
    (dict(num_hidden_layers=8, index_topk_pattern="FFSFFFFS"), True),
])
def test_config_variants_read_as_transformers_reads_them(text, refused):
    """The keys transformers' ``Glm5NextTextConfig`` derives others from (``linear_attn_config``,
    ``index_topk_pattern``, ``index_topk_freq`` / ``index_skip_topk_offset``, ``full_attention`` as
    ``indexed_attention``, fewer than three layers) read as it reads them."""
    import transformers

    theirs = transformers.Glm5NextConfig(text_config=dict(text)).text_config
    published = {**PUBLISHED, "text_config": {"model_type": "glm5_next_text", **text}}
    if refused:
        with pytest.raises(DFlashError, match="layer 7 a shared indexed layer, but layer 6 is not"):
            TargetConfig.from_dict(published)
        return
    ours = TargetConfig.from_dict(published)
    assert [k == "linear_attention" for k in ours.layer_types] == [k == "linear_attention" for k in theirs.layer_types]
    assert ours.indexer_full == [k == "indexed_attention" and m == "full"
                                 for k, m in zip(theirs.layer_types, theirs.indexer_types)]
    assert ours.moe_layers == [t == "sparse" for t in theirs.mlp_layer_types]
    for key in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "linear_lower_bound"):
        assert getattr(ours, key) == getattr(theirs, key), key


def test_self_distill_loads_the_multimodal_wrapper_and_continues_as_our_engine(checkpoints, tmp_path):
    """``train --self-distill`` on a GLM-5.3-Flash target: transformers' AutoModelForCausalLM
    does not map ``Glm5NextConfig`` (it was a ValueError traceback, trial-263), so the class its
    config.json names is loaded; its greedy continuations of text prompts (two lengths: left
    padding) equal our engine's target-only greedy output. A target transformers cannot load is
    refused in one line naming self_distill (--self-distill on the command line)."""
    from dflash_torch import DFlashEngine
    from dflash_torch.cli import build_parser, error_message
    from dflash_torch.errors import OptionError
    from dflash_torch.tokenizer import load_tokenizer
    from dflash_torch.training.distill import self_distill

    target = checkpoints["safe-gate"]
    tokenizer = load_tokenizer(target)
    prompts = [tokenizer.encode("def f(x):\n    return")[:6], tokenizer.encode("hello world, this is")[:4]]
    examples = self_distill(target, tokenizer, prompts, [False, False], 20, batch_size=2, progress=False)
    engine = DFlashEngine(TargetModel.from_pretrained(target, torch.float32), tokenizer)
    for p, ex in zip(prompts, examples):
        assert ex.ids[:len(p)].tolist() == p and len(ex.ids) == 20
        assert ex.ids[len(p):].tolist() == list(engine.generate(p, max_new_tokens=20 - len(p), ignore_eos=True).token_ids)
    from dflash_torch.training.distill import load_distill_model

    bare = tmp_path / "bare"  # (its config only: transformers finds no weights)
    bare.mkdir()
    shutil.copy(target / "config.json", bare / "config.json")
    with pytest.raises(OptionError) as err:
        load_distill_model(bare)
    message = str(err.value)
    assert message.startswith("self_distill runs the target with transformers, which cannot load it (") and \
        message.endswith("); train without self_distill") and "\n" not in message, message
    flags = build_parser().parse_args(["train", "--target", "t", "--data", "d", "--out", "o"]).option_flags
    assert error_message(err.value, flags).startswith("--self-distill runs the target")
    assert error_message(err.value, flags).endswith("train without --self-distill")
