"""compressed-tensors pack-quantized weights (W4A16 / W8A16; dflash_torch/models/packed_int.py).

Oracles: compressed-tensors' own packing (``pack_to_int32``) and dequantization
(``dequantize``), and transformers loading the same checkpoint (which decompresses it with
compressed-tensors).

* our unpacking inverts the library's packing (4 and 8 bits, any row length);
* every weight of a W4A16 Qwen3 equals transformers' own, bit for bit, in float32 and
  bfloat16, and the logits match;
* a Qwen3-MoE whose experts are quantized per channel (8 bits) and per group of 16 (4
  bits) equals our model loaded from the library's dequantization of it, bit for bit;
* greedy speculative decoding on a W4A16 target == transformers' greedy ``generate``;
* what cannot be read exactly is refused in one line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
from safetensors.torch import load_file, save_file

from conftest import (check_gathered_dispatch, check_greedy_equals_transformers, copy_tokenizer, drafter_config,
                      edited_checkpoint, forward_in_pieces, make_hybrid_target, make_target, save_drafter)
from dflash_torch import DFlashError
from dflash_torch.models import packed_int
from dflash_torch.models.target import TargetModel

IDS = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(3))


def _args(bits: int, group: int | None) -> QuantizationArgs:
    return QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="group" if group else "channel",
                            group_size=group)


def quantize(w: torch.Tensor, bits: int, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[..., rows, cols]`` -> (int8 integers, bfloat16 scales ``[..., rows, cols / group or 1]``):
    round to nearest of each group's max |w| / (2 ** (bits - 1) - 0.5)."""
    cols = w.shape[-1]
    per = group or cols
    g = w.float().unflatten(-1, (cols // per, per))
    top = (1 << (bits - 1))
    scale = (g.abs().amax(-1) / (top - 0.5)).clamp(min=1e-8).to(torch.bfloat16)
    q = torch.round(g / scale.float()[..., None]).clamp(-top, top - 1).to(torch.int8)
    return q.flatten(-2), scale


def scheme(bits: int, group: int | None, ignore: list[str]) -> dict:
    weights = {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "group" if group else "channel",
               "group_size": group, "dynamic": False, "actorder": None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ignore, "kv_cache_scheme": None, "sparsity_config": {}}


def to_packed(src: Path, dst: Path, bits: int, group: int | None, which=lambda key: True,
              suffixes: tuple[str, ...] = ("_proj.weight",)) -> Path:
    """``src`` with every decoder projection ``X.weight`` (a name ending in one of ``suffixes``)
    that ``which`` accepts stored as ``X.weight_packed`` / ``X.weight_scale`` / ``X.weight_shape``
    (packed by compressed-tensors), and the config's quantization_config."""
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    for key in [k for k in state if k.endswith(suffixes) and which(k)]:
        q, scale = quantize(state.pop(key), bits, group)
        state[key + "_packed"] = pack_to_int32(q, bits)
        state[key + "_scale"] = scale
        state[key + "_shape"] = torch.tensor(q.shape, dtype=torch.int64)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = scheme(bits, group, ["lm_head"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def library_dequantized(src: Path, dst: Path, bits: int, group: int | None) -> Path:
    """``src`` (packed) with every weight dequantized by compressed-tensors' own functions, in
    float32, and no quantization_config."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    for key in [k for k in state if k.endswith("_packed")]:
        name = key.removesuffix("_packed")
        shape = torch.Size(state.pop(name + "_shape").tolist())
        q = unpack_from_int32(state.pop(key), bits, shape)
        state[name] = ct_dequantize(q, state.pop(name + "_scale").float(), None, _args(bits, group))
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    for where in (cfg, cfg.get("text_config") or {}):  # (a wrapper's may sit in its text_config)
        where.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows,cols", [(3, 64), (5, 70), (2, 9), (4, 1)])
def test_unpacking_inverts_the_librarys_packing(bits, rows, cols):
    top = 1 << (bits - 1)
    q = torch.randint(-top, top, (rows, cols), generator=torch.Generator().manual_seed(cols), dtype=torch.int8)
    packed = pack_to_int32(q, bits)
    assert torch.equal(packed_int.unpack(packed, bits, cols), q)
    stacked = torch.stack([q, -q.clamp(min=-top + 1)])  # (experts stack their matrices)
    assert torch.equal(packed_int.unpack(pack_to_int32(stacked, bits), bits, cols), stacked)


@pytest.fixture(scope="module")
def w4a16(tmp_path_factory, tokenizer_dir):
    """(W4A16 Qwen3 target, groups of 16, lm_head unquantized, random drafter)."""
    root = tmp_path_factory.mktemp("w4a16")
    src = make_target(root / "src", "qwen3", seed=2, tokenizer=False, tie_word_embeddings=False)
    target = to_packed(src, root / "target", 4, 16)
    copy_tokenizer(tokenizer_dir, target)
    return target, save_drafter(root / "drafter", drafter_config(target, block_size=8), seed=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_equal_transformers_loading_the_checkpoint(w4a16, dtype):
    import transformers

    target, _ = w4a16
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype).eval()
    with torch.no_grad():
        ref = hf(IDS[None]).logits[0]  # (its first forward decompresses the weights)
    theirs = hf.state_dict()
    ours = TargetModel.from_pretrained(target, dtype)
    mine = ours.state_dict()
    assert mine.keys() <= theirs.keys()  # (theirs also keeps the scales and shapes)
    for k in mine:
        assert mine[k].dtype == dtype and torch.equal(mine[k], theirs[k]), k
    stored = load_file(str(target / "model.safetensors"))
    assert stored["model.layers.1.mlp.down_proj.weight_packed"].dtype == torch.int32
    if dtype == torch.float32:
        logits, _ = forward_in_pieces(ours, IDS, [20], False)
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits,group", [(8, None), (4, 16)])
def test_quantized_experts_equal_the_librarys_dequantization(tmp_path, bits, group):
    """Per-expert packed matrices (as Kimi-K2.5 stores its experts), attention unquantized."""
    src = make_hybrid_target(tmp_path / "src", "qwen3_moe", tokenizer=False)
    packed = to_packed(src, tmp_path / "packed", bits, group, which=lambda k: ".experts." in k)
    assert any(k.endswith("experts.3.up_proj.weight_packed") for k in load_file(str(packed / "model.safetensors")))
    ours = TargetModel.from_pretrained(packed, torch.float32)
    plain = TargetModel.from_pretrained(library_dequantized(packed, tmp_path / "plain", bits, group), torch.float32)
    mine, theirs = ours.state_dict(), plain.state_dict()
    assert mine.keys() == theirs.keys()
    for k in mine:
        assert torch.equal(mine[k], theirs[k]), k
    original = TargetModel.from_pretrained(src, torch.float32).state_dict()
    key = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(mine[key], original[key])  # (quantized: the test sees the rounding)


def test_greedy_speculative_decoding_equals_transformers(w4a16):
    check_greedy_equals_transformers(*w4a16, block_sizes=(8,), new_tokens=16)


def _quant(**change):
    def edit(cfg):
        group = cfg["quantization_config"]["config_groups"]["group_0"]
        for key, value in change.items():
            (group["weights"] if key in ("num_bits", "type", "symmetric", "strategy", "group_size", "actorder",
                                         "dynamic") else group)[key] = value
    return edit


def _set(key, value):
    return lambda cfg: cfg["quantization_config"].__setitem__(key, value)


@pytest.mark.parametrize("config,message", [
    (_quant(format="float-quantized"), "format 'float-quantized'; dflash-torch reads only 'pack-quantized'"),
    (_quant(input_activations={"num_bits": 8, "type": "int"}), "quantizes input_activations"),
    (_quant(symmetric=False), "asymmetric"),
    (_quant(actorder="group"), "actorder 'group'"),
    (_quant(num_bits=3), "num_bits 3"),
    (_quant(type="float"), "type 'float'"),
    (_quant(strategy="tensor"), "strategy 'tensor'"),
    (_quant(dynamic=True), "dynamic weight scales"),
    (_set("kv_cache_scheme", {"num_bits": 8}), "kv_cache_scheme"),
    (_set("sparsity_config", {"format": "sparse-24-bitmask"}), "sparsity_config of format 'sparse-24-bitmask'"),
    (_set("transform_config", {"config_groups": {"u": {"type": "hadamard"}}}), "transform_config"),
    (_set("config_groups", {}), "no config_groups"),
    (lambda cfg: cfg["quantization_config"]["config_groups"].__setitem__("group_1", {
        "targets": ["re:.*mlp.*"], "format": "pack-quantized",
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}), "different weight schemes"),
])
def test_schemes_that_cannot_be_read_exactly_are_refused_in_one_line(w4a16, tmp_path, config, message):
    target = edited_checkpoint(w4a16[0], tmp_path / "edited", config=config)
    with pytest.raises(DFlashError, match=message) as err:
        TargetModel.from_pretrained(target, torch.float32)
    assert "\n" not in str(err.value)


P = "model.layers.1.self_attn.k_proj.weight"


@pytest.mark.parametrize("state,message", [
    (lambda w: w.pop(P + "_scale"), f"packed weight {P}_packed has no {P}_scale"),
    (lambda w: w.pop(P + "_shape"), f"packed weight {P}_packed has no {P}_shape"),
    (lambda w: w.pop(P + "_packed"), f"{P}_scale has no packed weight {P}_packed"),
    (lambda w: w.__setitem__(P + "_zero_point", torch.zeros(32, 4)), "is a zero point"),
    (lambda w: w.__setitem__(P + "_shape", torch.tensor([32, 48])), r"does not match .*_packed of shape \(32, 8\)"),
    (lambda w: w.__setitem__(P + "_scale", torch.ones(32, 2)), r"_scale is .* \(32, 2\), expected floating point \(32, 4\)"),
    (lambda w: w[P + "_scale"].__setitem__((0, 0), float("nan")), "holds NaN or infinite values"),
    (lambda w: w[P + "_scale"].__setitem__((0, 0), -0.5),
     rf"^{P}_scale holds negative values \(a corrupt checkpoint: symmetric scales are zero or positive\)$"),
    (lambda w: w.__setitem__(P + "_packed", w[P + "_packed"].to(torch.int64)), "is int64 with 2 dimensions"),
])
def test_bad_packed_weights_are_refused_in_one_line(w4a16, tmp_path, state, message):
    target = edited_checkpoint(w4a16[0], tmp_path / "edited", state=state)
    with pytest.raises(DFlashError, match=message) as err:
        TargetModel.from_pretrained(target, torch.float32)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("mode", ["dequantize", "packed"])
def test_a_zero_group_scale_loads_as_a_zero_group(w4a16, tmp_path, mode):
    """A zero scale (a group of zeros) makes its group zero, the rest as it was; only negative
    scales are refused (above)."""
    zero = edited_checkpoint(w4a16[0], tmp_path / "zero", state=lambda w: w[P + "_scale"].__setitem__((0, 0), 0.0))
    plain = TargetModel.from_pretrained(w4a16[0], torch.float32).state_dict()[P]
    layer = TargetModel.from_pretrained(zero, torch.float32, int_weights=mode).model.layers[1].self_attn.k_proj
    w = (packed_int.dequantize_groups(layer.weight, layer.weight_scale, 4, 16, 64, torch.float32)
         if mode == "packed" else layer.weight)
    assert not w[0, :16].any() and plain[0, :16].any()
    assert torch.equal(w[0, 16:], plain[0, 16:]) and torch.equal(w[1:], plain[1:])


def test_a_dense_sparsity_config_and_an_empty_transform_config_change_nothing(w4a16, tmp_path):
    """(helper-11) llm-compressor writes them: "dense" means no sparsity."""
    target = edited_checkpoint(w4a16[0], tmp_path / "dense", config=lambda cfg: cfg["quantization_config"].update(
        sparsity_config={"format": "dense", "global_sparsity": 0.14, "sparsity_structure": "unstructured"},
        transform_config={}))
    assert torch.equal(_logits(TargetModel.from_pretrained(target, torch.float32)),
                       _logits(TargetModel.from_pretrained(w4a16[0], torch.float32)))


def test_families_without_packed_integer_weights_refuse_them(tmp_path):
    from conftest import make_gpt_oss_target

    src = make_gpt_oss_target(tmp_path / "src", tokenizer=False)
    target = edited_checkpoint(src, tmp_path / "edited", config=lambda cfg: cfg.update(
        quantization_config=scheme(4, 16, [])))
    with pytest.raises(DFlashError, match="quant_method 'compressed-tensors'"):
        TargetModel.from_pretrained(target, torch.float32)


# --- kept packed (int_weights="packed") ---


def _packed_layers(model: TargetModel) -> tuple[int, int]:
    """(IntLinear layers, packed expert stacks) of a model."""
    from dflash_torch.models.moe import Experts

    return (sum(isinstance(m, packed_int.IntLinear) for m in model.modules()),
            sum(isinstance(m, Experts) and m.int_bits > 0 for m in model.modules()))


def _logits(model: TargetModel) -> torch.Tensor:
    return forward_in_pieces(model, IDS, [7, 13], False)[0]


@pytest.mark.parametrize("family,bits,group", [("qwen3", 4, 16), ("qwen3_moe", 8, None), ("qwen3_moe", 4, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_give_the_dequantized_model_bit_for_bit(tmp_path, family, bits, group, dtype):
    """Every quantized matrix held packed (each linear an IntLinear, the experts int32 words),
    in less memory; the logits those of the model dequantized when loading, bit for bit,
    projections joined or not."""
    from dflash_torch import checkpoint
    from dflash_torch.models.fusing import fuse_projections

    src = (make_target(tmp_path / "src", "qwen3", tokenizer=False, tie_word_embeddings=False) if family == "qwen3"
           else make_hybrid_target(tmp_path / "src", "qwen3_moe", tokenizer=False))
    quantized = to_packed(src, tmp_path / "q", bits, group)
    plain = TargetModel.from_pretrained(quantized, dtype, int_weights="dequantize")
    packed = TargetModel.from_pretrained(quantized, dtype, int_weights="packed")
    assert packed.config.keep_int and not plain.config.keep_int
    linears, experts = _packed_layers(packed)
    stored = load_file(str(quantized / "model.safetensors"))
    per_expert = sum(k.endswith("_packed") and ".experts." in k for k in stored)
    assert linears + per_expert == sum(k.endswith("_packed") for k in stored) and linears > 0
    assert experts == (6 if family == "qwen3_moe" else 0) and _packed_layers(plain) == (0, 0)
    assert checkpoint.weight_bytes(packed, dtype) < checkpoint.weight_bytes(plain, dtype)
    assert torch.equal(_logits(packed), _logits(plain))
    fuse_projections(packed, query=True)
    fuse_projections(plain, query=True)
    assert torch.equal(_logits(packed), _logits(plain))


@pytest.mark.parametrize("tokens", [1, 6])
def test_gathered_dispatch_of_packed_experts_equals_the_sparse_one(tmp_path, tokens):
    """The dispatch CUDA graphs capture (every pair gathers its expert) == the sparse one."""
    src = make_hybrid_target(tmp_path / "src", "qwen3_moe", tokenizer=False)
    model = TargetModel.from_pretrained(to_packed(src, tmp_path / "q", 4, 16), torch.float32, int_weights="packed")
    check_gathered_dispatch(model, tokens)


def test_a_compiled_int_linear_equals_the_eager_one():
    layer = packed_int.IntLinear.like(torch.nn.Linear(64, 48, bias=True), 4, 16).to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.weight.copy_(torch.randint(-2 ** 31, 2 ** 31 - 1, layer.weight.shape, generator=g, dtype=torch.int64)
                           .to(torch.int32))
        layer.weight_scale.copy_(torch.rand(layer.weight_scale.shape, generator=g) / 8)
        layer.bias.copy_(torch.randn(48, generator=g))
    x = torch.randn(5, 64, generator=g)
    compiled = torch.compile(layer, backend="inductor", fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-5)


def test_speculative_decoding_on_a_packed_target_equals_target_only(w4a16):
    from dflash_torch import DFlashEngine

    target, drafter = w4a16
    packed = DFlashEngine.from_pretrained(target, drafter, dtype="float32", int_weights="packed")
    assert packed.target.config.keep_int
    plain = DFlashEngine.from_pretrained(target, None, dtype="float32", no_draft=True, int_weights="dequantize")
    for prompt in ("def f(x):", "import os\n"):
        ref = plain.generate(prompt, max_new_tokens=24, ignore_eos=True).token_ids
        assert packed.generate(prompt, max_new_tokens=24, ignore_eos=True).token_ids == ref
    batch = DFlashEngine(packed.target, packed.tokenizer, packed.drafter, max_batch_size=2, max_context=128)
    outs = batch.generate_batch(["def f(x):", "import os\n"], max_new_tokens=24, ignore_eos=True)
    assert [o.token_ids for o in outs] == [plain.generate(p, max_new_tokens=24, ignore_eos=True).token_ids
                                           for p in ("def f(x):", "import os\n")]


def test_auto_keeps_packed_only_when_the_dequantized_weights_would_not_fit(w4a16, monkeypatch):
    from dflash_torch import checkpoint

    target, _ = w4a16
    plain = TargetModel.from_pretrained(target, torch.float32, int_weights="dequantize")
    need = checkpoint.weight_bytes(plain, torch.float32)
    monkeypatch.setattr(checkpoint, "available_memory", lambda device: 10 * need)
    assert not TargetModel.from_pretrained(target, torch.float32).config.keep_int
    monkeypatch.setattr(checkpoint, "available_memory", lambda device: need)  # (90% of it is too little)
    assert TargetModel.from_pretrained(target, torch.float32).config.keep_int


def test_the_int_weights_option_is_checked(w4a16, tmp_path):
    from dflash_torch import DFlashEngine

    target, drafter = w4a16
    plain = make_target(tmp_path / "plain", "qwen3", tokenizer=False)
    with pytest.raises(DFlashError, match="int_weights packed keeps packed integer weights packed, but the target "
                                          "checkpoint has none"):
        TargetModel.from_pretrained(plain, torch.float32, int_weights="packed")
    with pytest.raises(DFlashError, match="int_weights"):
        DFlashEngine.from_pretrained(target, drafter, int_weights="unpacked")


def test_rows_ending_inside_a_word_are_dequantized_while_the_others_stay_packed(tmp_path):
    src = make_target(tmp_path / "src", "qwen3", tokenizer=False, intermediate_size=70)
    quantized = to_packed(src, tmp_path / "q", 4, None)  # (down_proj: 70 columns, 280 bits)
    plain = TargetModel.from_pretrained(quantized, torch.float32, int_weights="dequantize")
    assert plain.model.layers[0].mlp.down_proj.weight.shape == (64, 70)
    packed = TargetModel.from_pretrained(quantized, torch.float32, int_weights="packed")
    mlp = packed.model.layers[0].mlp
    assert type(mlp.down_proj) is torch.nn.Linear and isinstance(mlp.up_proj, packed_int.IntLinear)
    assert torch.equal(_logits(packed), _logits(plain))


def test_a_quantized_lm_head_is_dequantized_when_the_decoder_stays_packed(w4a16, tmp_path):
    """(helper-11: a traceback) The head, which drafters read too, is dequantized; the logits
    are those of the dequantized model."""
    src = make_target(tmp_path / "src", "qwen3", tokenizer=False, tie_word_embeddings=False)
    quantized = to_packed(src, tmp_path / "q", 4, 16, which=lambda k: True)
    def pack_head(weights):
        q, scale = quantize(weights.pop("lm_head.weight"), 4, 16)
        weights.update({"lm_head.weight_packed": pack_to_int32(q, 4), "lm_head.weight_scale": scale,
                        "lm_head.weight_shape": torch.tensor(q.shape)})

    head = edited_checkpoint(quantized, tmp_path / "head", state=pack_head)
    plain = TargetModel.from_pretrained(head, torch.float32, int_weights="dequantize")
    packed = TargetModel.from_pretrained(head, torch.float32, int_weights="packed")
    assert type(packed.lm_head) is torch.nn.Linear and packed.lm_head.weight.dtype == torch.float32
    assert isinstance(packed.model.layers[0].self_attn.q_proj, packed_int.IntLinear)
    assert torch.equal(_logits(packed), _logits(plain))


def test_a_config_declaring_packed_weights_over_plain_ones_is_refused(w4a16, tmp_path):
    """(trial-260: it ran the plain weights, unsaid; transformers refuses such a checkpoint)"""
    def unpacked(w):
        for key in [k for k in w if k.endswith("_packed")]:
            name = key.removesuffix("_packed")
            shape = w.pop(name + "_shape").tolist()
            del w[name + "_scale"], w[key]
            w[name] = torch.zeros(shape)

    target = edited_checkpoint(w4a16[0], tmp_path / "plain", state=unpacked)
    for mode in ("dequantize", "packed"):
        with pytest.raises(DFlashError, match=r"config\.json declares compressed-tensors pack-quantized weights but the "
                           r"checkpoint holds none \(int32 X\.weight_packed with X\.weight_scale and X\.weight_shape\)$"):
            TargetModel.from_pretrained(target, torch.float32, int_weights=mode)


def test_a_weight_stored_both_packed_and_not_is_refused(w4a16, tmp_path):
    target = edited_checkpoint(w4a16[0], tmp_path / "both", state=lambda w: w.__setitem__(P, torch.zeros(32, 64)))
    for mode in ("dequantize", "packed"):
        with pytest.raises(DFlashError, match=rf"both {P} and the packed {P}_packed"):
            TargetModel.from_pretrained(target, torch.float32, int_weights=mode)


def test_a_packed_weight_that_is_not_a_matrix_is_refused_in_one_line_in_every_mode(w4a16, tmp_path):
    target = edited_checkpoint(w4a16[0], tmp_path / "flat", state=lambda w: w.__setitem__(
        P + "_packed", w[P + "_packed"].flatten()))
    for mode in ("auto", "dequantize", "packed"):
        with pytest.raises(DFlashError, match="is int32 with 1 dimensions, expected int32"):
            TargetModel.from_pretrained(target, torch.float32, int_weights=mode)
