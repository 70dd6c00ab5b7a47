"""Hybrid (Gated DeltaNet + attention) and mixture-of-experts targets: Qwen3-MoE, Qwen3.5
(text, MoE and the multimodal wrappers) and Qwen3-Next, against transformers' own classes.

* our forward == transformers' (logits and every layer's output, float32);
* rollback: the recurrent state after a verify block and a commit of its first n rows
  == the state after feeding only those n rows, for every n;
* greedy speculative decoding == transformers' greedy ``generate`` token for token, for
  block sizes 2..16, inject and recompute, eager and fixed shapes, with random drafters
  and with agreeable pairs that accept many tokens per round (partial rollbacks);
* compiled rounds do not recompile; the inductor path is lossless;
* the multimodal wrapper decodes text only, without reading its vision tower.
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
import torch
import torch._dynamo
import torch._dynamo.utils as dynamo_utils
from safetensors import safe_open

from conftest import (HYBRID_FAMILIES, check_rollback, copy_tokenizer, drafter_config, hf_greedy, incremental_logits,
                      load_hf, make_agreeable_pair, make_hybrid_target, save_drafter, serve_in_thread)
from dflash_torch import DFlashEngine, DFlashError
from dflash_torch.decoding import SpeculativeDecoder
from dflash_torch.models.drafter import DFlashDrafter
from dflash_torch.models.config import TargetConfig
from dflash_torch.models.target import TargetModel
from dflash_torch.sampling import SamplingParams

RTOL = 1e-4
NEW_TOKENS = 24
PROMPTS = ["def f(x):", "import os\nimport sys\n"]
RECURRENT = [f for f in HYBRID_FAMILIES if f != "qwen3_moe"]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).norm() / ref.float().norm())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir) -> dict:
    """model_type -> (target_dir, random drafter_dir) for every hybrid / MoE family."""
    out = {}
    for i, family in enumerate(HYBRID_FAMILIES):
        root = tmp_path_factory.mktemp(family)
        target = make_hybrid_target(root / "target", family, seed=i, tokenizer=False)
        copy_tokenizer(tokenizer_dir, target)
        out[family] = target, save_drafter(root / "drafter", drafter_config(target, block_size=16), seed=i)
    return out


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_forward_matches_transformers(checkpoints, family):
    target_dir, _ = checkpoints[family]
    hf, ours = load_hf(target_dir), TargetModel.from_pretrained(target_dir, torch.float32)
    wrapped = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}  # the wrappers decode their text model
    assert ours.config.model_type == wrapped.get(family, family)
    ids = torch.randint(2, 320, (90,), generator=torch.Generator().manual_seed(1))  # > one 64-token chunk
    with torch.no_grad():
        ref = hf(ids[None], output_hidden_states=True)
        cache = ours.new_cache()
        cache.reset(128)
        logits, feats = ours(ids, torch.arange(90), cache, 90, list(range(6)))
    assert rel_err(logits, ref.logits[0]) < RTOL
    for layer in range(6):
        assert rel_err(feats[:, layer * 64:(layer + 1) * 64], ref.hidden_states[layer + 1][0]) < RTOL
    # the incremental path: a prefill chunk, a deferred verify block committed in part, single tokens
    assert rel_err(incremental_logits(ours, ids), ref.logits[0, :60]) < RTOL


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_sharded_checkpoint_with_tied_embeddings(tmp_path, family):
    target_dir = make_hybrid_target(tmp_path / family, family, tokenizer=False, tie_word_embeddings=True,
                                    max_shard_size="100KB")
    assert (target_dir / "model.safetensors.index.json").is_file()
    hf, ours = load_hf(target_dir), TargetModel.from_pretrained(target_dir, torch.float32)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ids = torch.randint(2, 320, (20,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache = ours.new_cache()
        cache.reset(32)
        assert rel_err(ours(ids, torch.arange(20), cache, 20)[0], hf(ids[None]).logits[0]) < RTOL


@pytest.mark.parametrize("family", RECURRENT)
def test_rollback_equals_feeding_only_the_accepted_tokens(checkpoints, family):
    target_dir, _ = checkpoints[family]
    model = TargetModel.from_pretrained(target_dir, torch.float32)
    check_rollback(model, torch.randint(2, 320, (60,), generator=torch.Generator().manual_seed(2)), range(1, 17))


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_batched_gated_deltanet_equals_one_sequence_at_a_time(checkpoints, family):
    """One Gated DeltaNet layer over N sequences at once (the batch decoder's path) ==
    the same layer over each sequence alone: a prefill chunk committed over a different
    count per sequence (one past a 64-token chunk), then a deferred verify block from
    those different states and one commit of a different accepted count per sequence
    (0: the state stays as it is): outputs, conv and ssm states."""
    from dflash_torch.cache import RecurrentState

    model = TargetModel.from_pretrained(checkpoints[family][0], torch.float32)
    layer = next(l for l in model.model.layers if l.kind == "linear_attention")
    mixer, slot = layer.linear_attn, layer.slot
    N, P, B = 4, 70, 16
    prefill_rows, accepted_rows = torch.tensor([3, 70, 20, 9]), torch.tensor([1, 16, 7, 0])
    g = torch.Generator().manual_seed(4)
    prompts, blocks = torch.randn(N, P, 64, generator=g), torch.randn(N, B, 64, generator=g)
    batched = RecurrentState(torch.float32, "cpu", N)
    alone = [RecurrentState(torch.float32, "cpu") for _ in range(N)]
    for state in [batched] + alone:
        for l in model.model.layers:
            if l.kind == "linear_attention":
                l.linear_attn.new_state(state)
    with torch.no_grad():
        out = mixer(prompts.view(N * P, -1), batched, slot, commit=prefill_rows)
        ref = [mixer(prompts[i], alone[i], slot, commit=int(prefill_rows[i])) for i in range(N)]
        torch.testing.assert_close(out, torch.cat(ref), rtol=1e-5, atol=1e-6)
        out = mixer(blocks.view(N * B, -1), batched, slot, defer=True)
        ref = [mixer(blocks[i], alone[i], slot, defer=True) for i in range(N)]
        torch.testing.assert_close(out, torch.cat(ref), rtol=1e-5, atol=1e-6)
        before = [alone[i].ssm[slot].clone() for i in range(N)]
        mixer.commit(batched, slot, accepted_rows)
        for i in range(N):
            if accepted_rows[i] > 0:
                mixer.commit(alone[i], slot, accepted_rows[i])
    assert torch.equal(alone[3].ssm[slot], before[3])  # (the reference of a 0 count: untouched)
    for i in range(N):
        torch.testing.assert_close(batched.conv[slot][i], alone[i].conv[slot][0], rtol=0, atol=0)
        torch.testing.assert_close(batched.ssm[slot][i], alone[i].ssm[slot][0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_greedy_speculative_equals_transformers_generate(checkpoints, family):
    target_dir, drafter_dir = checkpoints[family]
    hf = load_hf(target_dir)
    spec = DFlashEngine.from_pretrained(target_dir, drafter_dir)
    target_only = DFlashEngine(spec.target, spec.tokenizer)
    engines = [target_only] + [DFlashEngine(spec.target, spec.tokenizer, spec.drafter, block_size=B) for B in (2, 3, 8, 16)]
    engines += [DFlashEngine(spec.target, spec.tokenizer, spec.drafter, draft_mode="recompute", block_size=5),
                DFlashEngine(spec.target, spec.tokenizer, spec.drafter, static=True, max_context=300)]
    for prompt in PROMPTS:
        ids = spec.encode_prompt(prompt)
        ref = hf_greedy(hf, ids, NEW_TOKENS)
        for engine in engines:
            assert engine.generate(ids, max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids == ref, \
                (engine.block_size, engine.decoder.draft_mode, engine.decoder.static)


AGREE_SETTINGS = {"qwen3_5_text": dict(alpha=0.5, self_scale=0.0), "qwen3_next": dict(alpha=1.0, self_scale=0.0)}


@pytest.fixture(scope="module", params=list(AGREE_SETTINGS))
def agree_hybrid(request, tmp_path_factory, tokenizer_dir):
    """An agreeable pair (conftest.make_agreeable_pair) tuned so that the acceptance length
    varies over 1..5: the recurrent state is rolled back to many points of a block."""
    return request.param, make_agreeable_pair(tmp_path_factory.mktemp("agree-" + request.param), tokenizer_dir,
                                              model_type=request.param, **AGREE_SETTINGS[request.param])


def test_partial_acceptance_rounds_are_lossless(agree_hybrid):
    """Many tokens accepted per round, at every acceptance length: the recurrent state is
    rolled back to the middle of the verify block over and over."""
    family, (target_dir, drafter_dir) = agree_hybrid
    hf = load_hf(target_dir)
    spec = DFlashEngine.from_pretrained(target_dir, drafter_dir)
    static = DFlashEngine(spec.target, spec.tokenizer, spec.drafter, static=True, max_context=256, prefill_chunk=32)
    taus = []
    for prompt in ([5, 17, 99, 3], list(range(2, 45))):
        ref = hf_greedy(hf, prompt, 80)
        for engine in (spec, static):
            out = engine.generate(prompt, max_new_tokens=80, ignore_eos=True)
            assert out.token_ids == ref
            taus += out.stats.acceptance_lengths
    assert sum(taus) / len(taus) > 1.5 and len(set(taus)) >= 4, sorted(set(taus))


def _run(decoder, prompt, n):
    tokens = []
    for rnd in decoder.rounds(prompt, SamplingParams(), n):
        tokens.extend(rnd.tokens)
    return tokens[:n]


def test_compiled_hybrid_rounds_do_not_recompile(agree_hybrid):
    family, (target_dir, drafter_dir) = agree_hybrid
    target = TargetModel.from_pretrained(target_dir, torch.float32)
    drafter = DFlashDrafter.from_pretrained(drafter_dir, torch.float32)
    torch._dynamo.reset()
    dynamo_utils.counters.clear()  # (reset() leaves the counters of earlier tests)
    compiled = SpeculativeDecoder(target, drafter, compile=True, compile_backend="eager", max_context=256, prefill_chunk=32)
    eager = SpeculativeDecoder(target, drafter)
    _run(compiled, [5, 17, 99, 3], 40)
    graphs, frames = dynamo_utils.counters["stats"]["unique_graphs"], dynamo_utils.counters["frames"]["total"]
    assert graphs == 1 + 2 + 1  # prefill, propose, verify, commit (one length bucket)
    for prompt in ([11, 12, 13], list(range(2, 60))):
        assert _run(compiled, prompt, 100) == _run(eager, prompt, 100)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs, "a graph was recompiled after warm-up"
    assert dynamo_utils.counters["frames"]["total"] == frames, "a frame was re-traced after warm-up"


def test_inductor_compiled_hybrid_moe_rounds_are_lossless(tmp_path, tokenizer_dir):
    """The real CPU path of ``--compile`` on a (2-layer) hybrid mixture-of-experts target."""
    target_dir = make_hybrid_target(tmp_path / "target", "qwen3_next", seed=3, tokenizer=False, num_hidden_layers=2,
                                    layer_types=["linear_attention", "full_attention"])
    drafter_dir = save_drafter(tmp_path / "drafter", drafter_config(target_dir, num_layers=1, block_size=8))
    target = TargetModel.from_pretrained(target_dir, torch.float32)
    drafter = DFlashDrafter.from_pretrained(drafter_dir, torch.float32)
    torch._dynamo.reset()
    compiled = SpeculativeDecoder(target, drafter, compile=True, max_context=128, prefill_chunk=32)
    reference = hf_greedy(load_hf(target_dir), list(range(2, 40)), 30)
    assert _run(compiled, list(range(2, 40)), 30) == reference


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_a_layout_without_layer_types_that_the_weights_disagree_with_is_named(checkpoints, family, tmp_path):
    """A hybrid config.json without ``layer_types`` is laid out by ``full_attention_interval``
    (as transformers derives it); a checkpoint laid out otherwise is refused naming the layers
    that hold the other kind's weights and what sets the layout (trial-251: "lacks weights:
    model.layers.1.linear_attn.A_log, ..." alone)."""
    from conftest import edited_checkpoint

    def drop_layer_types(cfg, interval=None):
        text = cfg.get("text_config", cfg)
        del text["layer_types"]
        if interval is not None:
            text["full_attention_interval"] = interval
        else:
            text.pop("full_attention_interval", None)

    target_dir, _ = checkpoints[family]
    for interval, layers in ((2, "layers 1, 5 hold"), (1, "layers 0, 1, 2, 4, 5 hold"), (None, None)):
        edited = edited_checkpoint(target_dir, tmp_path / f"{family}-{interval}",
                                   config=lambda cfg: drop_layer_types(cfg, interval))
        if layers is None:  # (the default interval, 4, lays out this checkpoint's layers: it loads)
            assert TargetModel.from_pretrained(edited, torch.float32).config.layer_types[3] == "full_attention"
            continue
        with pytest.raises(DFlashError) as err:
            TargetModel.from_pretrained(edited, torch.float32)
        message = str(err.value)
        assert "lacks weights: " in message and "\n" not in message, message
        layout = "full attention in every layer" if interval == 1 else \
            f"full attention every {interval} layers, linear attention between"
        assert (f"config.json gives no layer_types, so full_attention_interval {interval} lays out the layers: "
                f"{layout}; {layers} weights of the other kind: give layer_types") in message, message


def test_wrapper_reads_no_vision_weights(checkpoints, monkeypatch):
    target_dir, _ = checkpoints["qwen3_5"]
    with safe_open(str(target_dir / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any(k.startswith("model.visual.") for k in keys) and any(k.startswith("model.language_model.") for k in keys)
    import dflash_torch.checkpoint as checkpoint

    read = []
    original = checkpoint.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.inner = original(*args, **kwargs)

        def __enter__(self):
            handle = self.inner.__enter__()
            outer = self

            class Handle:
                def keys(self):
                    return handle.keys()

                def get_tensor(self, key):
                    read.append(key)
                    return handle.get_tensor(key)
            outer.handle = Handle()
            return outer.handle

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

    monkeypatch.setattr(checkpoint, "safe_open", Recording)
    model = TargetModel.from_pretrained(target_dir, torch.float32)
    assert read and not any(k.startswith("model.visual.") for k in read)
    assert not any("visual" in name for name, _ in model.named_parameters())


@pytest.mark.parametrize("family, extra", [
    ("qwen3_5_text", "model.layers.0.linear_attn.extra_bias"),
    # a vision tower is skipped only in the multimodal wrappers; text checkpoints have none
    ("qwen3_5_text", "model.visual.blocks.0.attn.qkv.weight"),
    ("qwen3_5_moe_text", "model.visual.blocks.0.attn.qkv.weight"),
    ("qwen3_next", "model.visual.blocks.0.attn.qkv.weight"),
])
def test_unknown_weights_in_a_hybrid_checkpoint_are_refused(checkpoints, tmp_path, family, extra):
    import shutil

    from safetensors.torch import load_file, save_file

    target_dir, _ = checkpoints[family]
    bad = tmp_path / "bad"
    shutil.copytree(target_dir, bad)
    state = load_file(str(bad / "model.safetensors"))
    state[extra] = torch.zeros(4)
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(DFlashError, match=extra.replace(".", r"\.")):
        TargetModel.from_pretrained(bad, torch.float32)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("extra, words", [
    # beside the language model's weights, a tensor named as a text checkpoint's would be: no format has it
    ("model.norm.weight", "outside it (and outside the vision tower) that no Qwen3.5 model uses: model.norm.weight"),
    ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.gate_proj.weight"),
    # unknown inside the language model: named as the file names it, with the file's model_type
    ("model.language_model.layers.0.mlp.extra", "this {family} model does not use .*model\\.language_model\\.layers\\.0\\.mlp\\.extra"),
])
def test_unknown_weights_in_a_multimodal_checkpoint_are_refused_by_their_own_names(checkpoints, tmp_path, family,
                                                                                   extra, words):
    from conftest import edited_checkpoint

    target_dir, _ = checkpoints[family]
    bad = edited_checkpoint(target_dir, tmp_path / "bad", state=lambda s: s.update({extra: torch.zeros(4)}))
    with pytest.raises(DFlashError, match=words.format(family=family) if "{" in words else re.escape(words)) as err:
        TargetModel.from_pretrained(bad, torch.float32)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_a_text_config_with_the_multimodal_weight_layout_loads(checkpoints, tmp_path, family):
    """A wrapper's text_config saved as a text checkpoint, its decoder weights left under
    model.language_model. (transformers' text classes read that layout): the same model."""
    from conftest import edited_checkpoint

    target_dir, _ = checkpoints[family]

    def to_text(cfg):
        text = cfg.pop("text_config")
        tie = cfg.get("tie_word_embeddings")
        cfg.clear()
        cfg.update(text, architectures=["Qwen3_5ForCausalLM" if family == "qwen3_5" else "Qwen3_5MoeForCausalLM"])
        if tie is not None:
            cfg["tie_word_embeddings"] = tie

    text = edited_checkpoint(target_dir, tmp_path / "text", config=to_text,
                             state=lambda s: [s.pop(k) for k in list(s) if k.startswith("model.visual.")])
    ids = torch.arange(3, 20)
    logits, models = [], []
    for d in (text, target_dir):
        model = TargetModel.from_pretrained(d, torch.float32)
        assert model.config.model_type == family + "_text"
        models.append(model)
        with torch.no_grad():
            cache = model.new_cache()
            cache.reset(32)
            logits.append(model(ids, torch.arange(17), cache, 17)[0])
    # the same model: config and every weight bit for bit; the logits then agree to float32
    # rounding (not bit for bit: the weights lie at other offsets of another file, and the
    # matmul kernels' summation order may follow the alignment: 5e-7 was seen)
    assert models[0].config == models[1].config
    ours, theirs = models[0].state_dict(), models[1].state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert rel_err(logits[0], logits[1]) < 1e-6
    with torch.no_grad():  # (and transformers' text class reads that layout as the same model)
        assert rel_err(logits[0], load_hf(text)(ids[None]).logits[0]) < RTOL
    # with the vision tower left in: refused, saying so (helper-28: "weights outside ... the vision tower")
    with_tower = edited_checkpoint(target_dir, tmp_path / "text-and-tower", config=to_text)
    with pytest.raises(DFlashError, match=r"has a vision tower \(model\.visual\.\*\), which a qwen3_5\w* config "
                                          r"does not describe: use the checkpoint's multimodal config\.json"):
        TargetModel.from_pretrained(with_tower, torch.float32)


def test_a_wrapper_config_over_text_layout_weights_says_so(checkpoints, tmp_path):
    """The multimodal config over a text checkpoint's weights (model.layers.*, none under
    model.language_model.): refused as such, not as "keeps its decoder's weights under
    model.language_model. but also has weights outside it"."""
    from conftest import edited_checkpoint

    inner = "model.language_model."
    bad = edited_checkpoint(checkpoints["qwen3_5"][0], tmp_path / "bad", state=lambda s: s.update(
        {"model." + k[len(inner):]: s.pop(k) for k in list(s) if k.startswith(inner)}))
    with pytest.raises(DFlashError, match=r"^the target config.json is a Qwen3.5 multimodal wrapper's .* but no weight "
                                          r"of the checkpoint is there: its weights \(model\.embed_tokens\.weight, "
                                          r"\.\.\.\) are laid out as a text checkpoint's; use the text model's config"):
        TargetModel.from_pretrained(bad, torch.float32)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "qwen3_vl"}, "unsupported target model_type 'qwen3_vl'"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantized"),
    ({"layer_types": ["linear_attention"] * 5}, "layer_types has 5 entries"),
    ({"layer_types": ["sliding_attention"] * 6}, "sliding_attention"),
    ({"layer_types": "linear_attention"}, "layer_types must be a list of 6 layer type names"),
    ({"linear_num_value_heads": 3}, "not a multiple"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false, got 'yes'"),
    ({"attn_output_gate": 1}, "attn_output_gate must be true or false, got 1"),
    ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
])
def test_bad_hybrid_configs_are_refused_in_one_line(checkpoints, change, message):
    target_dir, _ = checkpoints["qwen3_next"]
    cfg = json.loads((target_dir / "config.json").read_text())
    cfg.update(change)
    with pytest.raises(DFlashError, match=message) as err:
        TargetConfig.from_dict(cfg)
    assert "\n" not in str(err.value)


def test_cli_and_server_decode_a_hybrid_target_losslessly(checkpoints, cli):
    """The multimodal Qwen3.5 wrapper through ``dflash-torch generate`` (in this process) and
    a real HTTP server of its app (uvicorn, in a thread) with the official openai client:
    both equal transformers."""
    from dflash_torch.serving.app import create_app

    target_dir, drafter_dir = checkpoints["qwen3_5"]
    target_only = DFlashEngine.from_pretrained(target_dir, no_draft=True)
    ids = target_only.encode_prompt(PROMPTS[0])
    ref = hf_greedy(load_hf(target_dir), ids, NEW_TOKENS)
    models = ["--target", str(target_dir), "--draft", str(drafter_dir)]
    out = cli("generate", *models, "--prompt", PROMPTS[0], "--json", "--max-new-tokens", str(NEW_TOKENS),
              "--ignore-eos")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["token_ids"] == ref
    with serve_in_thread(create_app(DFlashEngine.from_pretrained(target_dir, drafter_dir))) as base:
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt=ids, max_tokens=NEW_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == target_only.decode(ref)
        assert out.usage.completion_tokens == NEW_TOKENS
