"""gpt-oss targets (``gpt_oss``) against transformers' own ``GptOssForCausalLM``.

* our forward == transformers' (logits and every layer's output, float32), over prompts
  longer than the sliding window, in one pass, in pieces and with fixed shapes;
* attention sinks: the chunked and batched sink attention == one pass per sequence;
* MXFP4 checkpoints: our dequantization == transformers' ``convert_moe_packed_tensors``
  bit for bit, and the loaded model == transformers' model holding those experts;
* greedy speculative decoding == transformers' greedy ``generate``: block sizes, inject
  and recompute, fixed shapes, batched, compiled; an agreeable pair that accepts many
  tokens per round across the sliding window; an MXFP4 pair == target-only decoding;
* bad checkpoints are refused in one line.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import (check_compiled_rounds_are_lossless, check_forward_matches_transformers,
                      check_greedy_equals_transformers, check_many_accepted_tokens_are_lossless, copy_tokenizer,
                      drafter_config, edited_checkpoint, forward_in_pieces, load_hf, make_gpt_oss_target,
                      save_drafter)
from dflash_torch import DFlashEngine, DFlashError
from dflash_torch.models import gpt_oss, mxfp4
from dflash_torch.models.target import TargetModel

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_dir):
    """(target_dir, random drafter_dir) of a tiny gpt-oss target."""
    root = tmp_path_factory.mktemp("gpt_oss")
    target = make_gpt_oss_target(root / "target", seed=5, tokenizer=False)
    copy_tokenizer(tokenizer_dir, target)
    return target, save_drafter(root / "drafter", drafter_config(target, block_size=16), seed=5)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(mxfp4_gpt_oss_pair):
    return mxfp4_gpt_oss_pair



@pytest.mark.parametrize("pieces,static", [([30], False), ([11, 1, 7, 11], False), ([16, 14], True)])
def test_forward_matches_transformers(checkpoint, pieces, static):
    target_dir, _ = checkpoint
    hf = load_hf(target_dir)
    ours = TargetModel.from_pretrained(target_dir, torch.float32)
    assert ours.config.layer_types == ["sliding_attention", "full_attention"] * 2 and ours.config.sliding_window == 8
    ids = torch.randint(0, ours.config.vocab_size, (30,), generator=torch.Generator().manual_seed(1))
    check_forward_matches_transformers(ours, hf, ids, pieces, static)


def test_the_window_and_the_sinks_matter(checkpoint):
    """Guards the test above: without the window or without the sinks the logits differ
    from transformers' (so the comparison can fail)."""
    target_dir, _ = checkpoint
    hf = load_hf(target_dir)
    ids = torch.arange(2, 32)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    for change in ("window", "sinks"):
        ours = TargetModel.from_pretrained(target_dir, torch.float32)
        for layer in ours.model.layers:
            if change == "window":
                layer.sliding_window = None
            else:
                layer.self_attn.sinks.data.fill_(-1e4)
        logits, _ = forward_in_pieces(ours, ids, [30], False)
        assert (logits - ref).abs().max() > 1e-2, change


@pytest.mark.parametrize("path", ["flash", "logits"])
def test_sink_attention_batched_and_chunked_equal_one_pass(monkeypatch, path):
    """Both ways of sink attention (torch's CPU flash attention scaled by the rows'
    log-sum-exp, the default on a CPU; the logits written out, elsewhere) give the
    definition, one sequence and batched, a sequence that sees no key included."""
    if path == "flash":
        assert gpt_oss._FLASH_CPU is not None  # (torch >= 2.7 has it: the default on a CPU for long blocks)
        monkeypatch.setattr(gpt_oss, "FLASH_MIN_ROWS", 1)
    else:
        monkeypatch.setattr(gpt_oss, "_FLASH_CPU", None)
    g = torch.Generator().manual_seed(0)
    heads, kv, d, n, tq, tk = 4, 2, 8, 3, 5, 11
    q = torch.randn(heads, n * tq, d, generator=g)
    k, v = torch.randn(n, kv, tk, d, generator=g), torch.randn(n, kv, tk, d, generator=g)
    bias = torch.zeros(n, 2 * tq, tk).masked_fill(torch.rand(n, 2 * tq, tk, generator=g) < 0.3, float("-inf"))
    bias[1] = float("-inf")  # a sequence that sees no key: the sink takes everything, output 0
    sinks = torch.randn(heads, generator=g)
    batched = gpt_oss.sink_attend(q, k, v, bias, sinks)
    for i in range(n):
        one = gpt_oss.sink_attend(q[:, i * tq:(i + 1) * tq], k[i], v[i], bias[i], sinks)
        torch.testing.assert_close(batched[i * tq:(i + 1) * tq], one)
        # the definition: softmax over [scores, sink], the sink's column dropped
        for h in range(heads):
            logits = q[h, i * tq:(i + 1) * tq] @ k[i, h // 2].T / d ** 0.5 + bias[i].view(2, tq, tk)[h % 2]
            p = torch.softmax(torch.cat([logits, sinks[h].expand(tq, 1)], dim=-1), dim=-1)[:, :-1]
            torch.testing.assert_close(one[:, h * d:(h + 1) * d], p @ v[i, h // 2])
    assert torch.all(batched[tq:2 * tq] == 0)
    monkeypatch.setattr(gpt_oss, "_SCORES_PER_CHUNK", heads * n * tk * 2)  # two query rows a chunk
    torch.testing.assert_close(gpt_oss.sink_attend(q, k, v, bias, sinks), batched)


def test_only_prefill_sized_blocks_take_the_flash_kernel(checkpoint):
    """The flash kernel's rows depend on how many run at once; a verify block's and a
    target-only step's must not, so those take the logits' path and only blocks of at least
    FLASH_MIN_ROWS (prefill chunks, read alike by both runs) the kernel: in bfloat16 a tiny
    gpt-oss's speculative output left the target-only one on most prompts (trial-248)."""
    g = torch.Generator().manual_seed(2)
    heads, kv, d, tk = 4, 2, 16, 300
    k, v = (torch.randn(kv, tk, d, generator=g).bfloat16() for _ in range(2))
    sinks = torch.randn(heads, generator=g)
    for tq, path in ((1, gpt_oss._sink_attend_logits), (16, gpt_oss._sink_attend_logits),
                     (gpt_oss.FLASH_MIN_ROWS, gpt_oss._sink_attend_flash)):
        q = torch.randn(heads, tq, d, generator=g).bfloat16()
        bias = torch.zeros(tq, tk).masked_fill(torch.arange(tk) > torch.arange(tk - tq, tk)[:, None], float("-inf"))
        bias = bias.repeat(heads // kv, 1)
        assert torch.equal(gpt_oss.sink_attend(q, k, v, bias, sinks), path(q, k, v, bias, sinks)), tq
    spec = DFlashEngine.from_pretrained(*checkpoint, dtype="bfloat16")
    target_only = DFlashEngine(spec.target, spec.tokenizer)
    for prompt in ("def f(x):", "class A:\n    pass\n", "import os\n", "for i in range(3):"):
        ref = target_only.generate(prompt, max_new_tokens=40, ignore_eos=True).token_ids
        assert spec.generate(prompt, max_new_tokens=40, ignore_eos=True).token_ids == ref, prompt


def test_sink_attention_by_flash_attention_equals_the_logits_in_bfloat16():
    """In bfloat16 at gpt-oss's head layout (8 query heads a key/value head, 64 dims) the
    CPU flash-attention path is the logits' path within bfloat16's rounding, causal rows
    over a cached prefix as a verify sees them."""
    g = torch.Generator().manual_seed(1)
    heads, kv, d, tq, tk = 16, 2, 64, 16, 200
    q = torch.randn(heads, tq, d, generator=g).bfloat16()
    k, v = (torch.randn(kv, tk, d, generator=g).bfloat16() for _ in range(2))
    causal = torch.zeros(tq, tk).masked_fill(torch.arange(tk) > torch.arange(tk - tq, tk)[:, None], float("-inf"))
    bias, sinks = causal.repeat(heads // kv, 1), torch.randn(heads, generator=g) * 3
    flash, logits = gpt_oss._sink_attend_flash(q, k, v, bias, sinks), gpt_oss._sink_attend_logits(q, k, v, bias, sinks)
    assert flash.dtype == logits.dtype == torch.bfloat16 and flash.shape == (tq, heads * d)
    torch.testing.assert_close(flash, logits, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantization_equals_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 255, (3, 40, 4), generator=g, dtype=torch.uint8)  # (255 is NaN in the MX format)
    ours = mxfp4.dequantize(blocks, scales, dtype)
    assert ours.shape == (3, 40, 128) and ours.dtype == dtype
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2))


def test_mxfp4_checkpoint_matches_transformers_with_dequantized_experts(mxfp4_checkpoint):
    """transformers needs accelerate (and for speed, triton) to load an MXFP4 checkpoint, so
    the oracle is its model class holding the experts its own dequantizer produces."""
    import transformers
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    target_dir, _ = mxfp4_checkpoint
    config = json.loads((target_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    state = load_file(str(target_dir / "model.safetensors"))
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in state)
    del config["quantization_config"]
    hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(**config)).eval()
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts."
        for name in ("gate_up_proj", "down_proj"):
            state[prefix + name] = convert_moe_packed_tensors(state.pop(prefix + name + "_blocks"),
                                                              state.pop(prefix + name + "_scales"), dtype=torch.float32)
    hf.load_state_dict(state, strict=True)
    ours = TargetModel.from_pretrained(target_dir, torch.float32)
    ids = torch.arange(3, 23)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    logits, _ = forward_in_pieces(ours, ids, [20], False)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_greedy_speculative_equals_transformers_generate(checkpoint):
    check_greedy_equals_transformers(*checkpoint)


@pytest.fixture(scope="module")
def agree_gpt_oss(agree_gpt_oss_pair):
    return agree_gpt_oss_pair


def test_many_accepted_tokens_across_the_window_are_lossless(agree_gpt_oss):
    check_many_accepted_tokens_are_lossless(*agree_gpt_oss)


def test_compiled_rounds_are_lossless_and_do_not_recompile(agree_gpt_oss):
    check_compiled_rounds_are_lossless(*agree_gpt_oss)


def test_mxfp4_pair_speculative_equals_target_only(mxfp4_checkpoint):
    target_dir, drafter_dir = mxfp4_checkpoint
    spec = DFlashEngine.from_pretrained(target_dir, drafter_dir)
    target_only = DFlashEngine(spec.target, spec.tokenizer)
    assert spec.target.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32
    for prompt in ("def f(x):", "class A:\n    pass\n"):
        ref = target_only.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids
        assert spec.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids == ref
    bf16 = DFlashEngine.from_pretrained(target_dir, drafter_dir, dtype="bfloat16")
    assert bf16.target.model.layers[0].mlp.experts.down_proj.dtype == torch.bfloat16
    out = bf16.generate("def f(x):", max_new_tokens=8, ignore_eos=True)
    assert len(out.token_ids) == 8


def _drop(key):
    return lambda w: w.pop(key)


def test_a_matrix_stored_both_unquantized_and_mxfp4_is_refused(mxfp4_checkpoint, tmp_path):
    """Neither copy wins silently (dequantized, the MXFP4 one replaced the other)."""
    key = "model.layers.1.mlp.experts.down_proj"
    bad = edited_checkpoint(mxfp4_checkpoint[0], tmp_path / "twice", state=lambda w: w.update({key: torch.zeros(4, 32, 64)}))
    with pytest.raises(DFlashError, match=f"^weight {key} is stored twice, unquantized and as MXFP4 {key}_blocks / _scales$"):
        TargetModel.from_pretrained(bad, torch.float32, mxfp4="dequantize")
    with pytest.raises(DFlashError, match=f"^target checkpoint .* has weights this gpt_oss model does not use .*: {key}$"):
        TargetModel.from_pretrained(bad, torch.float32, mxfp4="packed")


@pytest.mark.parametrize("config,state,message", [
    (lambda c: c.update(quantization_config={"quant_method": "fp8"}), None,
     r"quantized \(quant_method 'fp8'\); .*\(and mxfp4 for this model_type\)"),
    (lambda c: c.update(layer_types=["sliding_attention", "linear_attention"] * 2), None,
     r"layer_types \['linear_attention'\] are not supported by gpt_oss"),
    (lambda c: c.update(layer_types=4), None, r"^target layer_types must be a list of 4 layer type names .*got 4$"),
    (lambda c: c.update(layer_types="sliding_attention"), None, "layer_types must be a list of 4 layer type names"),
    (lambda c: c.update(layer_types=[["sliding_attention"]] * 4), None, "layer_types must be a list of 4 layer type names"),
    (lambda c: c.update(sliding_window=None), None, "has sliding_attention layers but no sliding_window"),
    (lambda c: c.update(num_experts_per_tok=9), None, r"num_experts_per_tok 9 must be in \[1, num_local_experts=4\]"),
    (None, _drop("model.layers.1.mlp.experts.down_proj_scales"),
     "MXFP4 weight model.layers.1.mlp.experts.down_proj lacks its model.layers.1.mlp.experts.down_proj_scales"),
    (None, _drop("model.layers.2.self_attn.sinks"), "lacks weights: model.layers.2.self_attn.sinks"),
    (None, lambda w: w.update({"model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(4, 64, 2, 15, dtype=torch.uint8)}),
     r"MXFP4 weight model.layers.0.mlp.experts.gate_up_proj: blocks \(4, 64, 2, 15\) and scales"),
])
def test_bad_checkpoints_are_refused_in_one_line(mxfp4_checkpoint, tmp_path, config, state, message):
    target_dir, _ = mxfp4_checkpoint
    bad = edited_checkpoint(target_dir, tmp_path / "bad", config=config, state=state)
    with pytest.raises(DFlashError, match=message) as err:
        TargetModel.from_pretrained(bad, torch.float32)
    assert "\n" not in str(err.value)


def _flatten(key, dims):
    """An edit: the tensor ``key`` with its leading dimensions merged, ``dims`` left."""
    return lambda w: w.update({key: w[key].reshape(-1, *w[key].shape[w[key].dim() - dims + 1:]).contiguous()})


_P = "model.layers.0.mlp.experts."


@pytest.mark.parametrize("mxfp4,edit,message", [
    (True, lambda w: (_flatten(_P + "gate_up_proj_blocks", 2)(w), _flatten(_P + "gate_up_proj_scales", 1)(w)),
     rf"^MXFP4 weight {_P}gate_up_proj: blocks \(512, 16\) and scales \(512,\) do not match"),
    (False, _flatten(_P + "gate_up_proj_bias", 1), rf"^target weight {_P}gate_up_proj_bias has shape \(192,\); expected 2"),
    (False, _flatten(_P + "down_proj", 2), rf"^target weight {_P}down_proj has shape \(96, 64\); expected 3 dimensions$"),
])
def test_expert_tensors_with_other_dimensions_are_refused_in_one_line(checkpoint, mxfp4_checkpoint, tmp_path, mxfp4,
                                                                       edit, message):
    """(They reached the gate/up row rewrite, or the dequantizer, and raised an IndexError.)"""
    bad = edited_checkpoint((mxfp4_checkpoint if mxfp4 else checkpoint)[0], tmp_path / "bad", state=edit)
    for mode in ("dequantize", "packed") if mxfp4 else ("auto",):
        with pytest.raises(DFlashError, match=message):
            TargetModel.from_pretrained(bad, torch.float32, mxfp4=mode)


def test_packed_mxfp4_experts_decode_like_dequantized_ones(mxfp4_checkpoint):
    """Experts kept MXFP4 (dequantized per forward) give the dequantized model's logits
    exactly, and its tokens in every decoding mode."""
    target_dir, drafter_dir = mxfp4_checkpoint
    packed = TargetModel.from_pretrained(target_dir, torch.float32, mxfp4="packed")
    plain = TargetModel.from_pretrained(target_dir, torch.float32, mxfp4="dequantize")
    experts = packed.model.layers[0].mlp.experts
    assert experts.packed and experts.gate_up_proj_blocks.dtype == torch.uint8 and not hasattr(experts, "gate_up_proj")
    assert not plain.model.layers[0].mlp.experts.packed
    from dflash_torch.checkpoint import weight_bytes
    assert weight_bytes(packed, torch.float32) < 0.6 * weight_bytes(plain, torch.float32)
    ids = torch.arange(3, 40)
    assert torch.equal(forward_in_pieces(packed, ids, [37], False)[0], forward_in_pieces(plain, ids, [37], False)[0])
    ref_engine = DFlashEngine.from_pretrained(target_dir, no_draft=True, mxfp4="dequantize")
    spec = DFlashEngine.from_pretrained(target_dir, drafter_dir, mxfp4="packed")
    static = DFlashEngine(spec.target, spec.tokenizer, spec.drafter, static=True, max_context=128)
    batch = DFlashEngine(spec.target, spec.tokenizer, spec.drafter, max_batch_size=2, max_context=128)
    prompts = ["def f(x):", "class A:\n    pass\n"]
    refs = [ref_engine.generate(p, max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids for p in prompts]
    for engine in (spec, static):
        assert [engine.generate(p, max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids for p in prompts] == refs
    assert [o.token_ids for o in batch.generate_batch(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)] == refs


@pytest.mark.parametrize("tokens", [1, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_dispatch_of_packed_experts_equals_the_sparse_one(mxfp4_checkpoint, dtype, tokens):
    """The CUDA-graph path == the eager one: 1 token (2 pairs, fewer than the 4 experts:
    each pair's expert dequantized) and 6 tokens (every expert dequantized, then gathered)."""
    from dflash_torch.models.moe import dispatch_experts, gathered_experts

    target_dir, _ = mxfp4_checkpoint
    moe = TargetModel.from_pretrained(target_dir, dtype, mxfp4="packed").model.layers[1].mlp
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 64, generator=g).to(dtype)
    top, experts = torch.topk(moe.router(x), 2, dim=-1)
    weights = torch.softmax(top, dim=-1, dtype=torch.float32).to(dtype)
    gate_up, down, gate_up_scales, down_scales = moe.experts.matrices()
    args = (x, experts, weights, gate_up, down, moe.experts.gate_up_proj_bias, moe.experts.down_proj_bias,
            moe.swiglu_limit, moe.swiglu_alpha, gate_up_scales, down_scales)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gathered_experts(*args), dispatch_experts(*args), **tol)


def test_auto_keeps_mxfp4_packed_only_when_dequantized_weights_would_not_fit(mxfp4_checkpoint, monkeypatch):
    import dflash_torch.checkpoint as checkpoint

    target_dir, _ = mxfp4_checkpoint
    need = {mode: checkpoint.weight_bytes(TargetModel.from_pretrained(target_dir, torch.float32, mxfp4=mode), torch.float32)
            for mode in ("packed", "dequantize")}
    for free, packed in ((need["dequantize"] * 2, False), (need["dequantize"], True), (need["packed"], True)):
        monkeypatch.setattr(checkpoint, "available_memory", lambda device: free)
        model = TargetModel.from_pretrained(target_dir, torch.float32)  # mxfp4="auto"
        assert model.model.layers[0].mlp.experts.packed == packed, free
    monkeypatch.setattr(checkpoint, "available_memory", lambda device: need["packed"] - 1)
    with pytest.raises(DFlashError, match="^the target needs .* [kMG]B for its weights in float32; cpu has .* [kMG]B free$"):
        TargetModel.from_pretrained(target_dir, torch.float32)


def _scale_254(element: int):
    """An edit: the first block of layer 2's down_proj gets scale 254 (2 ** 127) and every
    element the E2M1 code ``element``."""
    def edit(w):
        w["model.layers.2.mlp.experts.down_proj_scales"].view(-1)[0] = 254
        w["model.layers.2.mlp.experts.down_proj_blocks"].view(-1, 16)[0] = element * 0x11
    return edit


def test_packed_blocks_that_overflow_are_refused_like_dequantized_ones(mxfp4_checkpoint, tmp_path):
    """2 ** 127 times an element of 2 or more is infinite in float32 and bfloat16: dequantized,
    the loader refuses it; packed, it used to load and decode NaN logits (every token 0)."""
    target_dir, _ = mxfp4_checkpoint
    bad = edited_checkpoint(target_dir, tmp_path / "inf", state=_scale_254(4))  # code 4: 2.0
    with pytest.raises(DFlashError, match="^target weight model.layers.2.mlp.experts.down_proj .*holds NaN or infinite"):
        TargetModel.from_pretrained(bad, torch.float32, mxfp4="dequantize")
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.raises(DFlashError, match="^MXFP4 weight model.layers.2.mlp.experts.down_proj has scale 254 on a "
                                              r"block with elements of magnitude 2 or more \(infinite in float32"):
            TargetModel.from_pretrained(bad, dtype, mxfp4="packed")
    big = edited_checkpoint(target_dir, tmp_path / "big", state=_scale_254(3))  # code 3: 1.5, finite: both modes load it
    for mode in ("dequantize", "packed"):
        assert TargetModel.from_pretrained(big, torch.float32, mxfp4=mode).config.keep_mxfp4 == (mode == "packed")


def test_mxfp4_option_is_checked(checkpoint, mxfp4_checkpoint, tmp_path, capsys):
    from dflash_torch.cli import main as cli_main

    with pytest.raises(DFlashError, match=r"^mxfp4 packed keeps MXFP4 expert weights packed, but the target checkpoint has none"):
        DFlashEngine.from_pretrained(checkpoint[0], no_draft=True, mxfp4="packed")
    with pytest.raises(DFlashError, match=r"^mxfp4 must be one of auto, dequantize, packed, got 'fp4'$"):
        DFlashEngine.from_pretrained(checkpoint[0], no_draft=True, mxfp4="fp4")
    assert cli_main(["generate", "--target", str(checkpoint[0]), "--no-draft", "--mxfp4", "packed", "x"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "dflash-torch: error: --mxfp4 packed keeps MXFP4 expert weights packed, but the target checkpoint has none "
        "(use auto or dequantize)"]
    bad = edited_checkpoint(mxfp4_checkpoint[0], tmp_path / "nan-scale",
                state=lambda w: w["model.layers.3.mlp.experts.down_proj_scales"].view(-1)[5:7].fill_(255))
    with pytest.raises(DFlashError, match="^MXFP4 weight model.layers.3.mlp.experts.down_proj has scale 255"):
        TargetModel.from_pretrained(bad, torch.float32, mxfp4="packed")
    with pytest.raises(DFlashError, match="^target weight model.layers.3.mlp.experts.down_proj .*holds NaN or infinite"):
        TargetModel.from_pretrained(bad, torch.float32, mxfp4="dequantize")
