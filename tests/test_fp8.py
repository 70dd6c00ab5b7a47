"""Fine-grained FP8 target checkpoints (``quant_method: "fp8"``, block scales
``weight_scale_inv``; dflash_torch.models.fp8): dequantized when loading, equal to what
transformers loads.

Oracles: transformers' own loading of the FP8 checkpoint on the CPU (it dequantizes, with
``Fp8Dequantize``) where every weight is a whole number of blocks; transformers' own
dequantizer of partial blocks (``_dequantize_fp8_weight``, the one its FP8 linear's backward
pass uses) where weights end in partial edge blocks, which its CPU loading cannot read
(it derives the block from the shapes: a ValueError, or silently wrong scales). The FP8
checkpoints are the tiny random ones of conftest, quantized here (per block: max |w| / 448).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import copy_tokenizer, edited_checkpoint, load_hf, make_agreeable_pair, make_hybrid_target, make_target
from dflash_torch import DFlashEngine, DFlashError
from dflash_torch.bench.modes import divergences
from dflash_torch.models import fp8
from dflash_torch.models.config import TargetConfig
from dflash_torch.models.target import TargetModel

FP8_MAX = 448.0  # largest float8_e4m3fn
PROMPT = [3, 17, 42, 9, 100, 7, 250, 64]
RTOL = 1e-4  # as test_models: our forward against transformers' (the weights themselves are equal)
BF16_TIE = 0.125  # a logit gap this small at a bf16 divergence is a near-tie (2 ulps of bf16 at 8-16)


def bfloat16_near_tie_taus(pair, prompts=("def f(x):", "class A:\n    pass\n"), max_new_tokens: int = 32) -> list[int]:
    """Speculative decoding of a (target dir, drafter dir) pair in bfloat16 against the same
    target alone: every divergence is a near-tie of the target (a logit gap within
    :data:`BF16_TIE`; a batched verify may flip those, README.md). -> the acceptance lengths."""
    spec = DFlashEngine.from_pretrained(*pair, dtype="bfloat16")
    target_only = DFlashEngine(spec.target, spec.tokenizer)
    taus = []
    for prompt in prompts:
        ref = target_only.generate(prompt, max_new_tokens=max_new_tokens, ignore_eos=True)
        out = spec.generate(prompt, max_new_tokens=max_new_tokens, ignore_eos=True)
        for d in divergences(spec.target, [spec.encode_prompt(prompt)], [ref.token_ids], [out.token_ids]):
            assert abs(d["logit_gap"]) <= BF16_TIE, (prompt, d)
        taus += out.stats.acceptance_lengths
    return taus


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[rows, cols]`` -> (float8_e4m3fn ``[rows, cols]``, float32 scales
    ``[ceil(rows / bo), ceil(cols / bi)]``): each block divided by max |w| / 448."""
    rows, cols = w.shape
    bo, bi = block
    grid = (math.ceil(rows / bo), math.ceil(cols / bi))
    padded = torch.zeros(grid[0] * bo, grid[1] * bi)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(grid[0], bo, grid[1], bi)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=2 ** -20)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(fp8.FORMAT)
    return q.view(grid[0] * bo, grid[1] * bi)[:rows, :cols].contiguous(), scale


def to_fp8(src: Path, dst: Path, block: tuple[int, int], not_convert: tuple[str, ...] = (),
           scale_dtype: torch.dtype = torch.float32, suffixes: tuple[str, ...] = ("_proj.weight",)) -> Path:
    """Copy the checkpoint ``src`` to ``dst`` with every decoder projection (``*_proj.weight``,
    or the names ending in ``suffixes``, under ``model.``, not the vision tower, not a module
    of ``not_convert``) in FP8, as the official ``*-FP8`` checkpoints store them, and the
    config's ``quantization_config``."""
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    for key in [k for k in state]:
        module = key.removesuffix(".weight")
        if (key.endswith(suffixes) and state[key].dim() == 2 and not key.startswith("model.visual.")
                and module not in not_convert):
            state[key], scale = quantize(state[key], block)
            state[module + ".weight_scale_inv"] = scale.to(scale_dtype)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block), "modules_to_not_convert": ["lm_head", *not_convert]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def dequantized_copy(src: Path, dst: Path) -> Path:
    """``src`` (FP8) with every pair dequantized in float32 by transformers'
    ``_dequantize_fp8_weight`` (partial edge blocks included), config without quantization."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    block = cfg.pop("quantization_config")["weight_block_size"]
    state = load_file(str(dst / "model.safetensors"))
    for key in [k for k in state if k.endswith("_scale_inv")]:
        scale, weight = state.pop(key), key.removesuffix("_scale_inv")
        state[weight] = _dequantize_fp8_weight(state[weight], scale, block, torch.float32)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def hf_logits(model_dir: Path) -> torch.Tensor:
    with torch.no_grad():
        return load_hf(model_dir)(torch.tensor([PROMPT])).logits[0]


def our_logits(model: TargetModel) -> torch.Tensor:
    cache = model.new_cache()
    cache.reset(len(PROMPT))
    with torch.no_grad():
        return model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), cache, len(PROMPT))[0]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).norm() / ref.float().norm())


def build(root: Path, family: str, **overrides) -> Path:
    """A tiny unquantized checkpoint of ``family`` (``qwen3`` or a hybrid / MoE model_type)."""
    if family == "qwen3":
        return make_target(root, "qwen3", tokenizer=False, **overrides)
    return make_hybrid_target(root, family, tokenizer=False, **overrides)


# --- the dequantizer ---


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,block", [((200, 72), (128, 32)), ((3, 50, 70), (16, 24)), ((48, 64), (16, 16))])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_dequantize_equals_transformers(dtype, shape, block, scale_dtype):
    """Bit for bit: transformers' float32 product rounded once to ``dtype``; with partial edge
    blocks (``_dequantize_fp8_weight``) and, for whole blocks, its loader's ``Fp8Dequantize``."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(shape, generator=g) * 100).to(fp8.FORMAT)
    scale = (torch.rand(fp8.scale_shape(shape, block), generator=g) * 1e-3).to(scale_dtype)
    ours = fp8.dequantize(weight, scale, block, dtype)
    assert ours.dtype == dtype and ours.shape == weight.shape
    assert torch.equal(ours, _dequantize_fp8_weight(weight, scale.float(), list(block), torch.float32).to(dtype))
    if all(n % b == 0 for n, b in zip(shape[-2:], block)):
        assert torch.equal(ours, Fp8Dequantize(None)._dequantize_one(weight, scale, output_dtype=dtype))
    # a partial edge block takes its own scale: the last row and column scale by the last block's
    last = weight[..., -1:, -1:].float() * scale[..., -1:, -1:].float()
    assert torch.equal(ours[..., -1:, -1:], last.to(dtype))


def test_dequantize_works_in_chunks_of_block_rows(monkeypatch):
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(100, 40, generator=g) * 50).to(fp8.FORMAT)
    scale = torch.rand(fp8.scale_shape(weight.shape, (8, 16)), generator=g)
    whole = fp8.dequantize(weight, scale, (8, 16), torch.float32)
    monkeypatch.setattr(fp8, "_ELEMENTS_PER_CHUNK", 8 * 40 * 3)  # 3 block rows at a time
    assert torch.equal(fp8.dequantize(weight, scale, (8, 16), torch.float32), whole)


# --- whole checkpoints ---


@pytest.fixture(scope="module")
def whole_blocks(tmp_path_factory):
    """family -> FP8 checkpoint whose weights are whole [16, 16] blocks (read by transformers
    on the CPU); the Gated DeltaNet's in_proj_ba (8 rows) and a few modules stay unquantized
    (modules_to_not_convert), as in the official checkpoints."""
    root = tmp_path_factory.mktemp("fp8-whole")
    out = {}
    for family, keep in (("qwen3", ("model.layers.1.mlp.down_proj",)),
                         ("qwen3_moe", ("model.layers.2.self_attn.o_proj",)),
                         ("qwen3_next", tuple(f"model.layers.{i}.linear_attn.in_proj_ba" for i in (0, 1, 2, 4, 5))
                          + ("model.layers.3.self_attn.o_proj",))):
        out[family] = (to_fp8(build(root / family, family), root / f"{family}-fp8", (16, 16), keep), keep)
    return out


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen3_next"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_equal_transformers_loading_the_fp8_checkpoint(whole_blocks, family, dtype):
    """Every weight equals transformers' own, loaded from the same FP8 checkpoint on the CPU
    (which dequantizes: ``Fp8Dequantize``), bit for bit; logits match; the modules of
    modules_to_not_convert load as stored."""
    import transformers

    model_dir, keep = whole_blocks[family]
    cfg = json.loads((model_dir / "config.json").read_text())
    hf = getattr(transformers, cfg["architectures"][0]).from_pretrained(str(model_dir), dtype=dtype).eval()
    ours = TargetModel.from_pretrained(model_dir, dtype)
    theirs, mine = hf.state_dict(), ours.state_dict()
    if family == "qwen3_next":  # (ours splits the fused linear-attention projections)
        theirs = type(ours).convert_checkpoint(ours.config, dict(theirs))
    shared = [k for k in mine if k in theirs]
    assert len(shared) >= len(mine) - 1, sorted(set(mine) - set(theirs))  # (all but a tied lm_head)
    for k in shared:
        assert mine[k].dtype == dtype and torch.equal(mine[k], theirs[k]), k
    stored = load_file(str(model_dir / "model.safetensors"))
    assert stored["model.layers.3.self_attn.q_proj.weight"].dtype == fp8.FORMAT
    for module in keep:
        assert stored[module + ".weight"].dtype == torch.float32 and module + ".weight_scale_inv" not in stored
        if module + ".weight" in mine:
            assert torch.equal(mine[module + ".weight"], stored[module + ".weight"].to(dtype)), module
    if dtype == torch.float32:
        with torch.no_grad():
            ref = hf(torch.tensor([PROMPT])).logits[0]
        assert rel_err(our_logits(ours), ref) <= RTOL


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_moe"])
def test_partial_edge_blocks_match_transformers(tmp_path, family):
    """Blocks of [24, 40]: every matrix ends in partial blocks (64 = 2 * 24 + 16 rows, 64 =
    40 + 24 columns, ...). Our model from the FP8 checkpoint equals, weight for weight, our
    model from transformers' dequantization of it, and its logits match transformers'."""
    src = build(tmp_path / "src", family)
    quantized = to_fp8(src, tmp_path / "fp8", (24, 40), scale_dtype=torch.bfloat16 if family == "qwen3_5_moe" else torch.float32)
    reference = dequantized_copy(quantized, tmp_path / "dequantized")
    ours = TargetModel.from_pretrained(quantized, torch.float32)
    plain = TargetModel.from_pretrained(reference, torch.float32)
    mine, theirs = ours.state_dict(), plain.state_dict()
    assert mine.keys() == theirs.keys()
    for k in mine:
        assert torch.equal(mine[k], theirs[k]), k
    original = TargetModel.from_pretrained(src, torch.float32).state_dict()
    assert not torch.equal(mine["model.layers.3.self_attn.q_proj.weight"], original["model.layers.3.self_attn.q_proj.weight"])
    assert rel_err(our_logits(ours), hf_logits(reference)) <= RTOL


def test_greedy_speculative_decoding_equals_target_only_on_fp8_targets(tmp_path, tokenizer_dir):
    """A drafter with an FP8 Qwen3 and an FP8 Qwen3-Next (hybrid, MoE) target: the greedy
    output is the target's own, in float32 and bfloat16, with drafts accepted."""
    for model_type, kwargs in (("qwen3", {}), ("qwen3_next", {"alpha": 1.0, "self_scale": 0.0})):
        target, drafter = make_agreeable_pair(tmp_path / model_type, tokenizer_dir, block_size=8, model_type=model_type,
                                              **kwargs)
        quantized = to_fp8(target, tmp_path / f"{model_type}-fp8", (32, 48))
        for dtype in ("float32", "bfloat16"):
            spec = DFlashEngine.from_pretrained(quantized, drafter, dtype=dtype)
            assert spec.target.model.layers[3].self_attn.q_proj.weight.dtype == getattr(torch, dtype)
            target_only = DFlashEngine(spec.target, spec.tokenizer)
            taus = []
            for prompt in ("def f(x):", "class A:\n    pass\n"):
                ref = target_only.generate(prompt, max_new_tokens=24, ignore_eos=True)
                out = spec.generate(prompt, max_new_tokens=24, ignore_eos=True)
                if dtype == "float32":
                    assert out.token_ids == ref.token_ids, (model_type, dtype, prompt)
                else:  # bf16: a batched verify may flip a near-tie of the target (README.md), nothing more
                    for d in divergences(spec.target, [spec.encode_prompt(prompt)], [ref.token_ids], [out.token_ids]):
                        assert abs(d["logit_gap"]) <= BF16_TIE, (model_type, prompt, d)
                taus += out.stats.acceptance_lengths
            assert max(taus) > 1, (model_type, dtype)  # drafts were accepted: the check compared something


def test_a_weight_and_its_scale_in_different_shards(whole_blocks, tmp_path):
    """Sharded: every scale in a shard of its own, after the weights' shard; loads as the single file."""
    model_dir, _ = whole_blocks["qwen3_moe"]
    sharded = tmp_path / "sharded"
    shutil.copytree(model_dir, sharded)
    state = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    shards = {"model-00001-of-00002.safetensors": {k: v for k, v in state.items() if not k.endswith("_scale_inv")},
              "model-00002-of-00002.safetensors": {k: v for k, v in state.items() if k.endswith("_scale_inv")}}
    for name, part in shards.items():
        save_file(part, str(sharded / name), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, part in shards.items() for k in part}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    single, split = (TargetModel.from_pretrained(d, torch.bfloat16).state_dict() for d in (model_dir, sharded))
    assert single.keys() == split.keys() and all(torch.equal(single[k], split[k]) for k in single)


def test_the_memory_check_counts_dequantized_weights(whole_blocks, monkeypatch):
    """The FP8 checkpoint is half its dequantized bfloat16 size on disk; loading it
    dequantized needs the dequantized size, and is refused in one line when less is free."""
    import dflash_torch.checkpoint as checkpoint

    model_dir, _ = whole_blocks["qwen3"]
    model = TargetModel.from_pretrained(model_dir, torch.bfloat16)
    need = checkpoint.weight_bytes(model, torch.bfloat16)
    on_disk = (model_dir / "model.safetensors").stat().st_size
    assert on_disk < need
    monkeypatch.setattr(checkpoint, "available_memory", lambda device: need - 1)
    with pytest.raises(DFlashError, match="^the target needs .* [kMG]B for its weights in bfloat16; cpu has .* [kMG]B free$"):
        TargetModel.from_pretrained(model_dir, torch.bfloat16, fp8="dequantize")
    monkeypatch.setattr(checkpoint, "available_memory", lambda device: need)
    TargetModel.from_pretrained(model_dir, torch.bfloat16, fp8="dequantize")


# --- kept as stored (fp8="packed") ---


def _fp8_layers(model: TargetModel) -> tuple[int, int]:
    """(Fp8Linear layers, expert modules holding FP8 matrices) of ``model``."""
    from dflash_torch.models.moe import Experts

    return (sum(isinstance(m, fp8.Fp8Linear) for m in model.modules()),
            sum(isinstance(m, Experts) and m.gate_up_proj.dtype == fp8.FORMAT for m in model.modules()))


@pytest.mark.parametrize("family,block", [("qwen3", (16, 16)), ("qwen3", (24, 40)), ("qwen3_moe", (16, 16)),
                                          ("qwen3_moe", (24, 40)), ("qwen3_next", (24, 40)), ("qwen3_5_moe", (16, 16))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_give_the_dequantized_model_bit_for_bit(tmp_path, family, block, dtype):
    """Weights kept FP8 (dequantized each forward, experts only when chosen) give the logits
    of the model dequantized when loading, bit for bit, whole blocks or partial edge blocks
    (24 x 40 blocks split every matrix); every FP8 matrix is held FP8 (each linear an
    Fp8Linear, the experts FP8), in less memory; the unquantized modules stay as stored.
    Qwen3-Next's fused linear-attention projections (FP8 in_proj_qkvz, unquantized
    in_proj_ba) split with their row scales."""
    from dflash_torch import checkpoint

    keep = tuple(f"model.layers.{i}.linear_attn.in_proj_ba" for i in range(6)) if family == "qwen3_next" else ()
    quantized = to_fp8(build(tmp_path / "src", family), tmp_path / "fp8", block, keep,
                       suffixes=("_proj.weight", "in_proj_qkvz.weight"))
    plain = TargetModel.from_pretrained(quantized, dtype, fp8="dequantize")
    packed = TargetModel.from_pretrained(quantized, dtype, fp8="packed")
    assert packed.config.keep_fp8 and not plain.config.keep_fp8
    stored = load_file(str(quantized / "model.safetensors"))
    n_fp8 = sum(t.dtype == fp8.FORMAT for t in stored.values())
    linears, experts = _fp8_layers(packed)
    per_expert = sum(1 for k, t in stored.items() if t.dtype == fp8.FORMAT and ".experts." in k)
    if family == "qwen3_next":  # in_proj_qkvz -> in_proj_qkv + in_proj_z
        n_fp8 += sum(1 for k in stored if k.endswith("in_proj_qkvz.weight"))
    assert linears + per_expert == n_fp8 and linears > 0 and (experts > 0) == (per_expert > 0), (linears, experts, n_fp8)
    assert _fp8_layers(plain) == (0, 0)
    assert checkpoint.weight_bytes(packed, dtype) < checkpoint.weight_bytes(plain, dtype)
    assert torch.equal(our_logits(packed), our_logits(plain))
    mine, theirs = packed.state_dict(), plain.state_dict()
    for k in theirs:
        if k in mine and mine[k].dtype != fp8.FORMAT and not k.endswith(fp8.ROW_SCALE_SUFFIX):
            assert torch.equal(mine[k], theirs[k]), k  # (norms, embeddings, unquantized linears)


@pytest.mark.parametrize("rows,cols,block_cols,tokens", [(64, 64, 16, 8), (96, 64, 48, 16), (256, 128, 48, 1)])
def test_a_compiled_fp8_linear_equals_the_eager_one(rows, cols, block_cols, tokens):
    """torch.compile keeps the FP8 linear one opaque operator running the eager kernels:
    bit for bit the eager result, whole blocks (64 columns in blocks of 16) or a partial
    last block (64 or 128 columns in blocks of 48), whose dequantization inductor got wrong
    when traced through."""
    g = torch.Generator().manual_seed(0)
    layer = fp8.Fp8Linear(cols, rows, bias=False, fp8_block_cols=block_cols)
    layer.weight = torch.nn.Parameter((torch.randn(rows, cols, generator=g) * 100).clamp(-FP8_MAX, FP8_MAX)
                                      .to(fp8.FORMAT), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(torch.rand(rows, math.ceil(cols / block_cols), generator=g),
                                            requires_grad=False)
    x = torch.randn(tokens, cols, generator=g)
    eager = layer(x)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(layer, dynamic=False)(x), eager)
    dense = torch.nn.functional.linear(x, fp8.dequantize_rows(layer.weight, layer.weight_scale, block_cols, x.dtype))
    assert torch.equal(eager, dense)


@pytest.mark.parametrize("tokens", [1, 6])
def test_gathered_dispatch_of_fp8_experts_equals_the_sparse_one(tmp_path, tokens):
    """The CUDA-graph path of FP8 experts == the eager one: 1 token (2 pairs, fewer than the
    experts: each pair's expert dequantized) and 6 tokens (all experts, then gathered)."""
    from dflash_torch.models.moe import dispatch_experts, gathered_experts

    quantized = to_fp8(build(tmp_path / "src", "qwen3_moe"), tmp_path / "fp8", (24, 40))
    moe = TargetModel.from_pretrained(quantized, torch.float32, fp8="packed").model.layers[0].mlp
    x = torch.randn(tokens, moe.gate.in_features, generator=torch.Generator().manual_seed(0))
    weights, experts = moe.route(x)
    e = moe.experts
    args = (x, experts, weights, e.gate_up_proj, e.down_proj, None, None, 0.0, 1.0,
            e.gate_up_proj_scale, e.down_proj_scale, e.fp8_block_cols)
    torch.testing.assert_close(gathered_experts(*args), dispatch_experts(*args), rtol=1e-5, atol=1e-5)


def test_greedy_speculative_decoding_on_packed_fp8_targets_equals_target_only(tmp_path, tokenizer_dir):
    """FP8 Qwen3 and Qwen3-Next (hybrid, MoE) targets kept FP8: greedy speculative output ==
    target-only output of the packed target == that of the dequantized target (float32),
    with projections joined or not (a joined Gated DeltaNet projection mixes FP8 and
    unquantized parts), one sequence and batched."""
    for model_type, kwargs in (("qwen3", {}), ("qwen3_next", {"alpha": 1.0, "self_scale": 0.0})):
        target, drafter = make_agreeable_pair(tmp_path / model_type, tokenizer_dir, block_size=8, model_type=model_type,
                                              **kwargs)
        keep = (tuple(f"model.layers.{i}.linear_attn.in_proj_ba" for i in range(6)) if model_type == "qwen3_next"
                else ("model.layers.1.mlp.down_proj",))
        quantized = to_fp8(target, tmp_path / f"{model_type}-fp8", (32, 48), keep,
                           suffixes=("_proj.weight", "in_proj_qkvz.weight"))
        reference = DFlashEngine.from_pretrained(quantized, no_draft=True, dtype="float32", fp8="dequantize")
        prompts = ["def f(x):", "class A:\n    pass\n"]
        refs = [reference.generate(p, max_new_tokens=24, ignore_eos=True).token_ids for p in prompts]
        for fuse in (False, True):
            spec = DFlashEngine.from_pretrained(quantized, drafter, dtype="float32", fp8="packed", fuse=fuse)
            assert _fp8_layers(spec.target)[0] > 0
            target_only = DFlashEngine(spec.target, spec.tokenizer)
            taus = []
            for prompt, ref in zip(prompts, refs):
                assert target_only.generate(prompt, max_new_tokens=24, ignore_eos=True).token_ids == ref
                out = spec.generate(prompt, max_new_tokens=24, ignore_eos=True)
                assert out.token_ids == ref, (model_type, fuse, prompt)
                taus += out.stats.acceptance_lengths
            batch = spec.generate_batch(prompts, max_new_tokens=24, ignore_eos=True)
            assert [r.token_ids for r in batch] == refs, (model_type, fuse)
            assert max(taus) > 1, (model_type, fuse)  # drafts were accepted: the check compared something


def test_auto_keeps_fp8_only_when_the_dequantized_weights_would_not_fit(whole_blocks, monkeypatch):
    """auto: dequantized when that fits in 90% of the free memory, else kept FP8; the memory
    check counts what is kept (FP8 bytes and row scales: the checkpoint's headers), and
    refuses, saying so, when even that does not fit."""
    import dflash_torch.checkpoint as checkpoint

    model_dir, _ = whole_blocks["qwen3_moe"]
    dequantized = checkpoint.weight_bytes(TargetModel.from_pretrained(model_dir, torch.bfloat16), torch.bfloat16)
    kept = TargetModel.from_pretrained(model_dir, torch.bfloat16, fp8="packed")
    need = checkpoint.weight_bytes(kept, torch.bfloat16)
    assert need < 0.9 * dequantized
    assert dequantized - checkpoint.fp8_saving(model_dir, torch.bfloat16, (16, 16)) == need  # the estimate is exact
    monkeypatch.setattr(checkpoint, "available_memory", lambda device: dequantized / 0.9)
    assert not TargetModel.from_pretrained(model_dir, torch.bfloat16).config.keep_fp8
    monkeypatch.setattr(checkpoint, "available_memory", lambda device: dequantized / 0.9 - 1)
    assert TargetModel.from_pretrained(model_dir, torch.bfloat16).config.keep_fp8
    monkeypatch.setattr(checkpoint, "available_memory", lambda device: need - 1)
    with pytest.raises(DFlashError, match=r"^the target needs .* [kMG]B for its weights in bfloat16 \(FP8 weights kept as "
                                          r"stored\); cpu has .* [kMG]B free$"):
        TargetModel.from_pretrained(model_dir, torch.bfloat16)
    with pytest.raises(DFlashError, match=r"^the target needs .* [kMG]B for its weights in bfloat16; cpu has"):
        TargetModel.from_pretrained(model_dir, torch.bfloat16, fp8="dequantize")


def test_the_fp8_option_is_checked_before_loading(whole_blocks, tmp_path):
    from dflash_torch.errors import OptionError

    plain = build(tmp_path / "plain", "qwen3")
    with pytest.raises(OptionError, match=r"^fp8 packed keeps FP8 weights as stored, but the target checkpoint has none"):
        DFlashEngine.from_pretrained(plain, no_draft=True, fp8="packed")
    with pytest.raises(OptionError, match=r"^fp8 must be one of auto, dequantize, packed, got 'int4'$"):
        DFlashEngine.from_pretrained(whole_blocks["qwen3"][0], no_draft=True, fp8="int4")
    TargetModel.from_pretrained(plain, torch.float32, fp8="dequantize")  # (nothing to dequantize: accepted)
    from conftest import make_gpt_oss_target

    gpt_oss = make_gpt_oss_target(tmp_path / "gpt_oss", tokenizer=False, mxfp4=True)
    with pytest.raises(OptionError, match=r"^fp8 packed keeps FP8 weights as stored, but the target checkpoint has none "
                                          r"\(its weights are MXFP4: see mxfp4; use auto or dequantize\)$"):
        TargetModel.from_pretrained(gpt_oss, torch.float32, fp8="packed")


def test_a_nan_in_a_kept_fp8_weight_is_refused(whole_blocks, tmp_path):
    """e4m3's only non-finite values are NaN bytes (0x7F, 0xFF): refused when kept, as the
    dequantized model refuses the NaN they become."""
    model_dir, _ = whole_blocks["qwen3"]

    def nan(w):
        bytes_ = w[Q + ".weight"].view(torch.uint8).clone()
        bytes_[3, 5] = 0xFF
        w[Q + ".weight"] = bytes_.view(fp8.FORMAT)

    bad = edited_checkpoint(model_dir, tmp_path / "bad", state=nan)
    with pytest.raises(DFlashError, match=rf"^FP8 weight {Q}\.weight holds NaN values"):
        TargetModel.from_pretrained(bad, torch.float32, fp8="packed")
    with pytest.raises(DFlashError, match=rf"target weight {Q}\.weight holds NaN or infinite values"):
        TargetModel.from_pretrained(bad, torch.float32, fp8="dequantize")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_scale_whose_products_overflow_is_refused_when_kept(whole_blocks, tmp_path, dtype):
    """A finite scale so large that its block's weights times it overflow the model's dtype
    (a corrupt checkpoint): refused when kept FP8, as when dequantized (it loaded, and
    decoded NaN logits)."""
    model_dir, _ = whole_blocks["qwen3"]
    bad = edited_checkpoint(model_dir, tmp_path / "bad", state=_set(
        Q + ".weight_scale_inv", lambda w: w[Q + ".weight_scale_inv"].index_fill(0, torch.tensor([1]), 1e38)))
    with pytest.raises(DFlashError, match=rf"^FP8 weight {Q}\.weight times its scales is not finite in "
                                          rf"{str(dtype).removeprefix('torch.')} \(a corrupt checkpoint\)$"):
        TargetModel.from_pretrained(bad, dtype, fp8="packed")
    with pytest.raises(DFlashError, match=rf"target weight {Q}\.weight holds NaN or infinite values"):
        TargetModel.from_pretrained(bad, dtype, fp8="dequantize")


def test_narrow_blocks_are_kept_on_request_but_auto_keeps_only_what_saves_memory(tmp_path, monkeypatch):
    """Blocks 2 columns wide: float32 row scales then outweigh what bfloat16 would save (one
    scale per 2 weights). packed keeps them FP8 as asked (it was silently dequantized: nothing
    to save); auto, with the dequantized weights over 90% of the free memory, does not keep
    them (it did, then refused as too large what dequantized still fit)."""
    import dflash_torch.checkpoint as checkpoint

    quantized = to_fp8(build(tmp_path / "src", "qwen3"), tmp_path / "fp8", (16, 2))
    plain = TargetModel.from_pretrained(quantized, torch.bfloat16, fp8="dequantize")
    packed = TargetModel.from_pretrained(quantized, torch.bfloat16, fp8="packed")
    assert packed.config.keep_fp8 and _fp8_layers(packed)[0] > 0
    assert torch.equal(our_logits(packed), our_logits(plain))
    dequantized = checkpoint.weight_bytes(plain, torch.bfloat16)
    assert checkpoint.weight_bytes(packed, torch.bfloat16) > dequantized
    monkeypatch.setattr(checkpoint, "available_memory", lambda device: dequantized / 0.9 - 1)
    assert not TargetModel.from_pretrained(quantized, torch.bfloat16).config.keep_fp8


# --- refusals ---

Q = "model.layers.0.self_attn.q_proj"


def _quant(**change):
    return lambda c: c["quantization_config"].update(change)


def _set(key, value):
    def edit(w):
        w[key] = value(w)
    return edit


def _unquantized(w):
    """Every FP8 weight replaced by a float32 one (its scale dropped): a config that says FP8
    over weights that are not."""
    for key in [k for k in w if k.endswith("_scale_inv")]:
        del w[key]
        w[key.removesuffix("_scale_inv")] = torch.zeros(w[key.removesuffix("_scale_inv")].shape)


@pytest.mark.parametrize("config,state,message", [
    (_quant(activation_scheme="static"), None, r"FP8 quantization_config has activation_scheme 'static'; .*only 'dynamic'"),
    (None, _set(Q + ".input_scale", lambda w: torch.ones(())), rf"{Q}\.input_scale is a static FP8 activation scale"),
    (_quant(fmt="e5m2"), None, r"FP8 quantization_config has fmt 'e5m2'; dflash-torch reads only 'e4m3'"),
    (_quant(weight_block_size=None), None, r"weight_block_size None; dflash-torch reads only block-wise scales"),
    (_quant(weight_block_size=[16]), None, r"weight_block_size \[16\]"),
    (_quant(scale_fmt="ue8m0"), None,
     r"FP8 scale model\.layers\.\d\..*weight_scale_inv has dtype float32; the config's scale_fmt 'ue8m0' stores "
     r"float8_e8m0fnu"),
    (_quant(scale_fmt="e4m3"), None, r"scale_fmt 'e4m3'; dflash-torch reads only 'float' and 'ue8m0' scales"),
    (None, _set(Q + ".weight_scale_inv", lambda w: w[Q + ".weight_scale_inv"].log2().round().add(127).to(torch.uint8)
                .view(torch.float8_e8m0fnu)),
     rf"FP8 scale {Q}\.weight_scale_inv has dtype float8_e8m0fnu; expected float32 or bfloat16 \(e8m0 scales need "
     r"scale_fmt 'ue8m0'"),
    (None, lambda w: w.update({Q + ".scale": w[Q + ".weight_scale_inv"].clone()}),
     rf"weight {Q}\.weight has two scales, {Q}\.weight_scale_inv and {Q}\.scale$"),
    (_quant(modules_to_convert=["model.embed_tokens"]), None, r"modules_to_convert \(FP8 embeddings\)"),
    (lambda c: c.update(quantization_config={"quant_method": "compressed-tensors", "format": "float-quantized"}), None,
     r"compressed-tensors quantization_config has format 'float-quantized'; dflash-torch reads only 'pack-quantized'"),
    (None, lambda w: w.pop(Q + ".weight_scale_inv"), rf"weight {Q}\.weight is float8_e4m3fn without its scale {Q}\.weight_scale_inv"),
    (None, lambda w: w.pop(Q + ".weight"), rf"FP8 scale {Q}\.weight_scale_inv has no weight {Q}\.weight$"),
    (None, lambda w: w.update({Q + ".weight": w[Q + ".weight"][:48].contiguous(),
                               Q + ".weight_scale_inv": w[Q + ".weight_scale_inv"][:3].contiguous()}),
     rf"target weight {Q}\.weight has shape \(48, 64\), config\.json implies \(64, 64\)"),
    (None, _set(Q + ".weight_scale_inv", lambda w: w[Q + ".weight_scale_inv"][:, :1].contiguous()),
     rf"FP8 scale {Q}\.weight_scale_inv has shape \(4, 1\); weight \(64, 64\) in blocks of \[16, 16\] needs \(4, 4\)"),
    (None, _set(Q + ".weight_scale_inv", lambda w: w[Q + ".weight_scale_inv"].index_fill(0, torch.tensor([2]), float("inf"))),
     rf"FP8 scale {Q}\.weight_scale_inv holds NaN or infinite values"),
    (None, _set(Q + ".weight_scale_inv", lambda w: w[Q + ".weight_scale_inv"].index_fill(0, torch.tensor([1]), -0.01)),
     rf"^FP8 scale {Q}\.weight_scale_inv holds negative values \(a corrupt checkpoint: block scales are zero or "
     r"positive\)$"),
    (None, _set(Q + ".weight", lambda w: w[Q + ".weight"].float().to(torch.float8_e5m2)),
     rf"FP8 weight {Q}\.weight has dtype float8_e5m2; the config's FP8 format \(fmt\) is float8_e4m3fn"),
    (lambda c: c.pop("quantization_config"), None,
     r"weight model\.layers\.\d\..*is float8_e4m3fn but config\.json has no FP8 quantization_config"),
    (None, _unquantized,
     r"config\.json declares fine-grained FP8 weights \(quant_method 'fp8'\) but the checkpoint holds none "
     r"\(float8_e4m3fn X\.weight with X\.weight_scale_inv\)$"),
])
@pytest.mark.parametrize("mode", ["dequantize", "packed"])
def test_what_cannot_run_exactly_is_refused_in_one_line(whole_blocks, tokenizer_dir, tmp_path, config, state, message, mode):
    model_dir, _ = whole_blocks["qwen3"]
    bad = edited_checkpoint(model_dir, tmp_path / "bad", config=config, state=state)
    copy_tokenizer(tokenizer_dir, bad)  # (the engine reads the tokenizer first)
    if mode == "packed" and "has no FP8 quantization_config" in message:
        message = "^fp8 packed keeps FP8 weights as stored, but the target checkpoint has none"
    with pytest.raises(DFlashError, match=message) as err:
        DFlashEngine.from_pretrained(bad, no_draft=True, fp8=mode)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("mode", ["dequantize", "packed"])
def test_a_zero_block_scale_loads_as_a_zero_block(whole_blocks, tmp_path, mode):
    """A zero block scale (an all-zero block whose scale was not clamped) makes its block zero,
    the other blocks as they were; only negative scales are refused (above)."""
    model_dir, _ = whole_blocks["qwen3"]
    zero = edited_checkpoint(model_dir, tmp_path / "zero", state=_set(
        Q + ".weight_scale_inv", lambda w: w[Q + ".weight_scale_inv"].index_fill(0, torch.tensor([1]), 0.0)))
    plain = TargetModel.from_pretrained(model_dir, torch.float32).state_dict()[Q + ".weight"]
    model = TargetModel.from_pretrained(zero, torch.float32, fp8=mode)
    w = model.model.layers[0].self_attn.q_proj
    w = fp8.dequantize_rows(w.weight, w.weight_scale, 16, torch.float32) if mode == "packed" else w.weight
    assert not w[16:32].any() and plain[16:32].any()
    assert torch.equal(w[:16], plain[:16]) and torch.equal(w[32:], plain[32:])


def test_fp8_is_refused_where_it_is_not_read():
    """gpt-oss (MXFP4 only) and drafters keep refusing an FP8 quantization_config."""
    fp8_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    gpt_oss = {"model_type": "gpt_oss", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
               "num_attention_heads": 1, "quantization_config": fp8_config}
    with pytest.raises(DFlashError, match=r"quantized \(quant_method 'fp8'\); .*\(and mxfp4 for this model_type\)"):
        TargetConfig.from_dict(gpt_oss)
    from dflash_torch.models.drafter_config import DrafterConfig

    with pytest.raises(DFlashError, match=r"^the drafter checkpoint is quantized \(quant_method 'fp8'\)"):
        DrafterConfig.from_dict({"architectures": ["DFlashDraftModel"], "quantization_config": fp8_config})


def test_the_cli_keeps_fp8_weights_packed_on_request(tmp_path, tokenizer_dir, cli):
    """``generate --fp8 packed --json`` on an FP8 target gives the tokens of ``--fp8
    dequantize``; ``--fp8 packed`` on a checkpoint without FP8 weights is one line, exit 2.
    (The command run in this process, :func:`conftest.cli`.)"""
    target, drafter = make_agreeable_pair(tmp_path / "pair", tokenizer_dir, block_size=8)
    quantized = to_fp8(target, tmp_path / "fp8", (32, 48))
    outs = {}
    for mode in ("dequantize", "packed"):
        proc = cli("generate", "--target", str(quantized), "--draft", str(drafter), "--fp8", mode, "--json", "--ignore-eos",
                       "--max-new-tokens", "16", "--threads", "1", "--prompt", "def f(x):")
        assert proc.returncode == 0, proc.stderr
        outs[mode] = json.loads(proc.stdout)["token_ids"]
    assert outs["packed"] == outs["dequantize"] and len(outs["packed"]) == 16
    proc = cli("generate", "--target", str(target), "--draft", str(drafter), "--fp8", "packed", "--prompt", "x")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--fp8 packed keeps FP8 weights as stored, but the target checkpoint has none" in proc.stderr, proc.stderr
