"""NVFP4 weights (compressed-tensors ``nvfp4-pack-quantized`` and NVIDIA ModelOpt NVFP4) and
ModelOpt per-tensor FP8, dequantized when loading (dflash_torch/models/nvfp4.py).

Oracles: compressed-tensors' own compressor writes the NVFP4 checkpoints (its
``NVFP4PackedCompressor`` over real tiny transformers models' weights) and its own
decompression is the reference; ModelOpt checkpoints are written by a helper here and
checked against a plain reference written from the format's description (``fp4 *
weight_scale * weight_scale_2``, each nibble decoded from its bits), and the same quantized
values written in both formats load to the same weights.

* every weight of a compressed-tensors NVFP4 Qwen3 (and of a Qwen3-MoE's experts, and of a
  Qwen3-Next) equals the library's decompression, bit for bit, bfloat16 and float32 (and
  transformers' loading of the checkpoint, bfloat16); the logits equal those of the model
  loaded from the library's dequantized weights;
* ModelOpt NVFP4 / FP8 weights equal the reference, rounded once (float32 and bfloat16),
  from ``config.json``'s ``quantization_config`` or an older ``hf_quant_config.json``;
* greedy speculative decoding == target-only decoding (dense, MoE, hybrid Nemotron-H);
* what cannot be run exactly is refused in one line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
from safetensors.torch import load_file, save_file

from conftest import (copy_tokenizer, drafter_config, edited_checkpoint, forward_in_pieces, make_hybrid_target,
                      make_target, save_drafter)
from dflash_torch import DFlashError
from dflash_torch.models import nvfp4
from dflash_torch.models.target import TargetModel

IDS = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(3))
DTYPES = [torch.float32, torch.bfloat16]


# --- compressed-tensors ---


def ct_scheme(activations: bool = False):
    return preset_name_to_scheme("NVFP4" if activations else "NVFP4A16", ["Linear"])


def ct_compress(w: torch.Tensor, activations: bool = False) -> dict[str, torch.Tensor]:
    """``w`` [out, in] compressed by compressed-tensors as llm-compressor does it: a global scale
    from the tensor's range, FP8 scales per 16 from each group's, then its NVFP4 compressor."""
    scheme = ct_scheme(activations)
    gs = generate_gparam(w.min(), w.max())
    groups = w.unflatten(-1, (-1, nvfp4.GROUP))
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=gs)
    out = dict(NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": gs}, scheme))
    if activations:
        out["input_global_scale"] = torch.tensor([1234.5])
    return out


def ct_decompressed(parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """compressed-tensors' dequantization of one weight's ``parts``: its compressor's own
    ``decompress`` (bfloat16, what the library returns); in float32, its functions with
    float32 in place of bfloat16."""
    scheme = ct_scheme()
    if dtype == torch.bfloat16:
        return NVFP4PackedCompressor.decompress(dict(parts), scheme)["weight"]
    packed = parts["weight_packed"]
    q = unpack_fp4_from_uint8(packed, packed.shape[0], 2 * packed.shape[1], dtype=torch.float32)
    return ct_dequantize(q, parts["weight_scale"].float(), args=scheme.weights, dtype=torch.float32,
                         global_scale=parts["weight_global_scale"])


def ct_config(activations: bool = False, ignore=("lm_head",)) -> dict:
    cfg = QuantizationConfig(config_groups={"group_0": ct_scheme(activations)}, format=nvfp4.CT_FORMAT,
                             quantization_status="compressed", ignore=list(ignore)).model_dump(mode="json")
    cfg["quant_method"] = "compressed-tensors"
    return cfg


def _quantized(key: str, which) -> bool:
    return key.endswith(("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")) and which(key)


def to_ct_nvfp4(src: Path, dst: Path, which=lambda key: True, activations: bool = False) -> Path:
    """``src`` with every projection ``X.weight`` ``which`` accepts compressed by compressed-tensors
    (``X.weight_packed`` / ``X.weight_scale`` / ``X.weight_global_scale``) and the config's
    quantization_config."""
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    for key in [k for k in state if _quantized(k, which)]:
        for name, t in ct_compress(state.pop(key).float(), activations).items():
            state[key.removesuffix("weight") + name] = t
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = ct_config(activations)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def ct_parts(state: dict, name: str) -> dict[str, torch.Tensor]:
    base = name.removesuffix("weight")
    return {k: state[base + k] for k in ("weight_packed", "weight_scale", "weight_global_scale")}


def plain_copy(src: Path, dst: Path, weights: dict[str, torch.Tensor]) -> Path:
    """``src`` with the quantized parts replaced by ``weights`` (name -> float32 matrix) and no
    quantization config."""
    shutil.copytree(src, dst)
    (dst / "hf_quant_config.json").unlink(missing_ok=True)
    state = load_file(str(dst / "model.safetensors"))
    for name, w in weights.items():
        base = name.removesuffix("weight")
        for k in [k for k in state if k.startswith(base) and k[len(base):] in (
                "weight", "weight_packed", "weight_scale", "weight_global_scale", "input_global_scale",
                "weight_scale_2", "input_scale")]:
            del state[k]
        state[name] = w
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _logits(model: TargetModel) -> torch.Tensor:
    return forward_in_pieces(model, IDS, [7, 13], False)[0]


@pytest.fixture(scope="module")
def ct_dense(tmp_path_factory, tokenizer_dir):
    """(NVFP4A16 Qwen3 target written by compressed-tensors, lm_head unquantized, random drafter)."""
    root = tmp_path_factory.mktemp("ct")
    src = make_target(root / "src", "qwen3", seed=2, tokenizer=False, tie_word_embeddings=False)
    target = to_ct_nvfp4(src, root / "target")
    copy_tokenizer(tokenizer_dir, target)
    return target, save_drafter(root / "drafter", drafter_config(target, block_size=8), seed=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ct_weights_equal_the_librarys_decompression_bit_for_bit(ct_dense, dtype):
    target, _ = ct_dense
    stored = load_file(str(target / "model.safetensors"))
    ours = TargetModel.from_pretrained(target, dtype).state_dict()
    names = [k.removesuffix("_packed") for k in stored if k.endswith("_packed")]
    assert len(names) == 4 * 7 and stored[names[0] + "_packed"].dtype == torch.uint8
    for name in names:
        ref = ct_decompressed(ct_parts(stored, name), dtype)
        assert ours[name].dtype == dtype and torch.equal(ours[name], ref.to(dtype)), name
    for k in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"):
        assert torch.equal(ours[k], stored[k].to(dtype))


def test_ct_weights_equal_transformers_loading_the_checkpoint_in_bfloat16(ct_dense):
    """transformers decompresses such a checkpoint with compressed-tensors (to bfloat16: its
    float32 model then holds bfloat16 weights and its forward fails, so bfloat16 only)."""
    import transformers

    target, _ = ct_dense
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = hf(IDS[None]).logits[0]
    theirs = hf.state_dict()
    ours = TargetModel.from_pretrained(target, torch.bfloat16)
    mine = ours.state_dict()
    assert mine.keys() <= theirs.keys()  # (theirs also keeps the scales)
    for k in mine:
        assert torch.equal(mine[k], theirs[k]), k
    torch.testing.assert_close(_logits(ours).float(), ref.float(), rtol=0.05, atol=0.05)


def test_ct_logits_equal_the_model_of_the_librarys_dequantized_weights(ct_dense, tmp_path):
    target, _ = ct_dense
    stored = load_file(str(target / "model.safetensors"))
    weights = {k.removesuffix("_packed"): ct_decompressed(ct_parts(stored, k.removesuffix("_packed")), torch.float32)
               for k in stored if k.endswith("_packed")}
    plain = TargetModel.from_pretrained(plain_copy(target, tmp_path / "plain", weights), torch.float32)
    ours = TargetModel.from_pretrained(target, torch.float32)
    assert torch.equal(_logits(ours), _logits(plain))
    src = TargetModel.from_pretrained(target.parent / "src", torch.float32)
    assert not torch.equal(_logits(ours), _logits(src))  # (quantized: the test sees the rounding)
    torch.testing.assert_close(_logits(ours), _logits(src), rtol=0, atol=2.0)


def test_ct_nvfp4_with_quantized_activations_loads_the_same_weights(ct_dense, tmp_path):
    """The NVFP4 (W4A4) scheme: its input_global_scale is not used (activations unquantized)."""
    src = make_target(tmp_path / "src", "qwen3", seed=2, tokenizer=False, tie_word_embeddings=False)
    w4a4 = to_ct_nvfp4(src, tmp_path / "w4a4", activations=True)
    assert any(k.endswith("input_global_scale") for k in load_file(str(w4a4 / "model.safetensors")))
    mine, theirs = (TargetModel.from_pretrained(d, torch.bfloat16).state_dict() for d in (w4a4, ct_dense[0]))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "qwen3_5_moe"])
def test_ct_moe_and_hybrid_weights_equal_the_librarys_decompression(tmp_path, family):
    """Per-expert matrices (stacked when loading), a hybrid's linear-attention projections, a
    multimodal wrapper (its vision tower, quantized too, is not read)."""
    src = make_hybrid_target(tmp_path / "src", family, tokenizer=False)
    target = to_ct_nvfp4(src, tmp_path / "ct")
    stored = load_file(str(target / "model.safetensors"))
    assert any(".experts.3.up_proj.weight_packed" in k for k in stored)
    weights = {k.removesuffix("_packed"): ct_decompressed(ct_parts(stored, k.removesuffix("_packed")), torch.bfloat16)
               for k in stored if k.endswith("_packed")}
    plain = plain_copy(target, tmp_path / "plain", weights)
    mine = TargetModel.from_pretrained(target, torch.bfloat16).state_dict()
    theirs = TargetModel.from_pretrained(plain, torch.bfloat16).state_dict()
    assert mine.keys() == theirs.keys()
    for k in mine:
        assert torch.equal(mine[k], theirs[k]), k


def _family_target(root: Path, family: str) -> Path:
    if family == "laguna":
        from test_laguna import make_laguna_target

        return make_laguna_target(root / "src", seed=5, shared_expert_intermediate_size=32)
    if family == "deepseek_v3":
        from test_deepseek_v3 import make_deepseek_target

        return make_deepseek_target(root / "src")
    from conftest import make_minimax_m2_target

    return make_minimax_m2_target(root / "src", tokenizer=False)


@pytest.mark.parametrize("family", ["laguna", "minimax_m2", "deepseek_v3"])
def test_other_families_load_both_formats_as_the_librarys_decompression(tmp_path, family):
    """compressed-tensors NVFP4 == the library's decompression (bfloat16) for each family's
    layout (per-expert w1 / w2 / w3, MLA's projections); ModelOpt NVFP4 holding the same
    values (power-of-two per-tensor scales) loads the same weights."""
    src = _family_target(tmp_path, family)
    mo = to_modelopt(src, tmp_path / "mo", scale_2=2.0 ** -11)
    ct = edited_checkpoint(mo, tmp_path / "ct", config=lambda cfg: cfg.update(quantization_config=ct_config()),
                           state=_modelopt_as_ct)
    stored = load_file(str(ct / "model.safetensors"))
    weights = {k.removesuffix("_packed"): ct_decompressed(ct_parts(stored, k.removesuffix("_packed")), torch.bfloat16)
               for k in stored if k.endswith("_packed")}
    assert len(weights) > 20
    plain = TargetModel.from_pretrained(plain_copy(ct, tmp_path / "plain", weights), torch.bfloat16).state_dict()
    for target in (ct, mo):
        mine = TargetModel.from_pretrained(target, torch.bfloat16).state_dict()
        assert mine.keys() == plain.keys()
        for k in mine:
            assert torch.equal(mine[k], plain[k]), (target.name, k)


def test_ct_speculative_decoding_equals_target_only(ct_dense):
    _check_speculative_equals_target_only(*ct_dense)


def _check_speculative_equals_target_only(target: Path, drafter: Path, prompts=("def f(x):", "import os\n")):
    from dflash_torch import DFlashEngine

    spec = DFlashEngine.from_pretrained(target, drafter, dtype="float32")
    plain = DFlashEngine(spec.target, spec.tokenizer)
    refs = [plain.generate(p, max_new_tokens=24, ignore_eos=True).token_ids for p in prompts]
    for prompt, ref in zip(prompts, refs):
        assert spec.generate(prompt, max_new_tokens=24, ignore_eos=True).token_ids == ref
    batch = DFlashEngine(spec.target, spec.tokenizer, spec.drafter, max_batch_size=2, max_context=128)
    assert [o.token_ids for o in batch.generate_batch(list(prompts), max_new_tokens=24, ignore_eos=True)] == refs


# --- ModelOpt ---


def fp4_reference(packed: torch.Tensor) -> torch.Tensor:
    """The E2M1 values of ``packed`` (low nibble first) decoded from their bits: float64."""
    nib = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).long()
    sign, exp, man = 1 - 2 * (nib >> 3), (nib >> 1) & 3, nib & 1
    mag = torch.where(exp == 0, 0.5 * man, 2.0 ** (exp - 1) * (1 + 0.5 * man))
    return (sign * mag).double()


def modelopt_reference(packed, scale, scale_2) -> torch.Tensor:
    """``fp4 * weight_scale * weight_scale_2``, exact (float64)."""
    return (fp4_reference(packed).unflatten(-1, (-1, 16)) * scale.double()[..., None]).flatten(-2) * scale_2.double()


def _encode_fp4(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` (in units of its group's scale) to the nearest E2M1 value's nibble."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    idx = (x.abs()[..., None] - grid).abs().argmin(-1)
    return (idx | ((x < 0).long() << 3)).to(torch.uint8)


def modelopt_compress(w: torch.Tensor, scale_2: float | None = None) -> dict[str, torch.Tensor]:
    """``w`` [out, in] as ModelOpt stores NVFP4: the per-tensor scale amax / (6 * 448) (or
    ``scale_2``), FP8 scales per 16 (the group's amax / 6 over it), nibbles packed low first."""
    s2 = torch.tensor(scale_2 if scale_2 is not None else float(w.abs().max()) / (6 * 448), dtype=torch.float32)
    groups = w.double().unflatten(-1, (-1, 16))
    scale = (groups.abs().amax(-1) / 6 / s2.double()).clamp(min=2 ** -9).to(nvfp4.FP8)
    nib = _encode_fp4(groups / (scale.double() * s2.double())[..., None]).flatten(-2)
    packed = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return {"weight": packed, "weight_scale": scale, "weight_scale_2": s2, "input_scale": torch.tensor(0.01)}


def modelopt_config(algo: str = "NVFP4", ignore=("lm_head",)) -> dict:
    return {"quant_method": "modelopt", "quant_algo": algo, "group_size": 16, "ignore": list(ignore),
            "kv_cache_scheme": None, "producer": {"name": "modelopt", "version": "0.39.0"}}


def to_modelopt(src: Path, dst: Path, which=lambda key: True, algo: str = "NVFP4", legacy: bool = False,
                scale_2: float | None = None) -> Path:
    """``src`` with every projection ``X.weight`` ``which`` accepts quantized as ModelOpt writes it
    (NVFP4, or per-tensor FP8: ``X.weight`` e4m3 with ``X.weight_scale``); its quantization in
    config.json's quantization_config, or (``legacy``) in a hf_quant_config.json."""
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    for key in [k for k in state if _quantized(k, which)]:
        w, base = state.pop(key).float(), key.removesuffix("weight")
        if algo == "NVFP4":
            parts = modelopt_compress(w, scale_2)
        else:
            s = w.abs().max() / 448
            parts = {"weight": (w / s).to(nvfp4.FP8), "weight_scale": s.reshape(()), "input_scale": torch.tensor(0.01)}
        state.update({base + k: v for k, v in parts.items()})
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    if legacy:
        (dst / "hf_quant_config.json").write_text(json.dumps({
            "producer": {"name": "modelopt", "version": "0.23.0"},
            "quantization": {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": 16,
                             "exclude_modules": ["lm_head"]}}))
    else:
        cfg["quantization_config"] = modelopt_config(algo)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def check_rounded_once(ours: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype, name: str = "") -> None:
    """``ours`` (``dtype``) is ``exact`` (float64) rounded to nearest: in float32 torch's
    (correctly rounded) conversion; in bfloat16 no neighbour of ``ours`` is nearer, and a tie
    keeps the even one."""
    assert ours.dtype == dtype, name
    if dtype == torch.float32:
        assert torch.equal(ours, exact.float()), name
        return
    bits = ours.view(torch.int16).int()
    err = (ours.double() - exact).abs()
    for step in (-1, 1):
        other = (bits + step).to(torch.int16).view(dtype).double()
        other_err = (other - exact).abs().nan_to_num(nan=float("inf"))  # (past zero: a NaN pattern)
        assert bool((err <= other_err).all()), name
        tie = err == other_err
        assert bool(((bits & 1) == 0)[tie].all()), name


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory, tokenizer_dir):
    """(tiny Nemotron-H source, its ModelOpt NVFP4 copy, random drafter): NVIDIA's layout
    (``backbone.``, per-expert weights), every projection quantized."""
    from test_nemotron_h import SHAPES, make_nemotron_target

    root = tmp_path_factory.mktemp("nemotron")
    src = make_nemotron_target(root / "src", **SHAPES["plain"])
    target = to_modelopt(src, root / "nvfp4")
    copy_tokenizer(tokenizer_dir, target)
    return src, target, save_drafter(root / "drafter", drafter_config(target, block_size=8), seed=1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_modelopt_nemotron_weights_equal_the_reference_rounded_once(nemotron, dtype):
    from dflash_torch.models.nemotron_h import Model

    src, target, _ = nemotron
    stored = load_file(str(target / "model.safetensors"))
    model = TargetModel.from_pretrained(target, dtype)
    ours = model.state_dict()
    names = [k for k in stored if k.endswith("_proj.weight") and stored[k].dtype == torch.uint8]
    assert any(".experts.7.down_proj." in k for k in names) and any("mixer.in_proj" in k for k in names)
    cfg = model.config
    experts = {}
    for name in names:
        exact = modelopt_reference(stored[name], stored[name + "_scale"], stored[name + "_scale_2"])
        mine = Model._our_name(cfg, "model." + name.removeprefix("backbone."))
        if ".experts." in name:  # (stacked when loading: checked below)
            experts[name] = exact
            continue
        check_rounded_once(ours[mine], exact, dtype, name)
    for key, value in ours.items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            prefix = Model.checkpoint_name(cfg, key).rsplit(".", 1)[0].replace("model.", "backbone.", 1)
            proj = key.rsplit(".", 1)[1].replace("gate_up_proj", "up_proj")
            exact = torch.stack([experts[f"{prefix}.{e}.{proj}.weight"] for e in range(value.shape[0])])
            check_rounded_once(value, exact, dtype, key)


def test_modelopt_and_ct_holding_the_same_values_load_the_same_weights(tmp_path):
    """Power-of-two per-tensor scales (1 / weight_global_scale == weight_scale_2 exactly): the
    two formats' arithmetics then agree, bit for bit, in float32 and bfloat16."""
    src = make_target(tmp_path / "src", "qwen3", tokenizer=False, tie_word_embeddings=False)
    mo = to_modelopt(src, tmp_path / "mo", scale_2=2.0 ** -12)
    ct = edited_checkpoint(mo, tmp_path / "ct", config=lambda cfg: cfg.update(quantization_config=ct_config()),
                           state=_modelopt_as_ct)
    stored = load_file(str(ct / "model.safetensors"))
    for dtype in DTYPES:
        mine = TargetModel.from_pretrained(mo, dtype).state_dict()
        theirs = TargetModel.from_pretrained(ct, dtype).state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
        name = "model.layers.2.mlp.down_proj.weight"
        assert torch.equal(mine[name], ct_decompressed(ct_parts(stored, name), dtype).to(dtype))


def _modelopt_as_ct(state: dict) -> None:
    for key in [k for k in state if _quantized(k, lambda k: True) and state[k].dtype == torch.uint8]:
        base = key.removesuffix("weight")
        state[base + "weight_packed"] = state.pop(key)
        state[base + "weight_global_scale"] = (1 / state.pop(base + "weight_scale_2")).reshape(1)
        del state[base + "input_scale"]


def test_an_older_hf_quant_config_loads_the_same_model(nemotron, tmp_path):
    src, target, _ = nemotron
    legacy = to_modelopt(src, tmp_path / "legacy", legacy=True)
    assert "quantization_config" not in json.loads((legacy / "config.json").read_text())
    mine = TargetModel.from_pretrained(legacy, torch.bfloat16).state_dict()
    theirs = TargetModel.from_pretrained(target, torch.bfloat16).state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_modelopt_fp8_weights_equal_the_reference_rounded_once(tmp_path, dtype):
    """ModelOpt per-tensor FP8 (NVIDIA's -FP8 releases): e4m3 times its scale, rounded once."""
    src = make_hybrid_target(tmp_path / "src", "qwen3_moe", tokenizer=False)
    target = to_modelopt(src, tmp_path / "fp8", algo="FP8", which=lambda k: ".experts." not in k)
    stored = load_file(str(target / "model.safetensors"))
    ours = TargetModel.from_pretrained(target, dtype).state_dict()
    names = [k for k in stored if k.endswith("_proj.weight") and stored[k].dtype == nvfp4.FP8]
    assert len(names) == 6 * 4
    for name in names:
        exact = stored[name].double() * stored[name.removesuffix("weight") + "weight_scale"].double()
        check_rounded_once(ours[name], exact, dtype, name)


def modelopt_mixed(tmp_path: Path) -> tuple[Path, Path, Path, dict]:
    """A tiny Qwen3-MoE target as ModelOpt's MIXED_PRECISION releases store it (experts NVFP4,
    the other linear layers FP8) -> (that checkpoint, the experts-only NVFP4 one, the FP8
    one it was made of, its ``quantized_layers``), under ``tmp_path``."""
    src = make_hybrid_target(tmp_path / "src", "qwen3_moe", tokenizer=False)
    experts = to_modelopt(src, tmp_path / "experts", which=lambda k: ".experts." in k)
    rest = to_modelopt(src, tmp_path / "rest", which=lambda k: ".experts." not in k, algo="FP8")
    layers = {k.removesuffix(".weight"): {"quant_algo": "NVFP4", "group_size": 16} if ".experts." in k
              else {"quant_algo": "FP8"} for k in load_file(str(src / "model.safetensors")) if _quantized(k, bool)}

    def mix(state):
        state.update({k: v for k, v in load_file(str(experts / "model.safetensors")).items() if ".experts." in k})

    mixed = edited_checkpoint(rest, tmp_path / "mixed", state=mix, config=lambda cfg: cfg["quantization_config"].update(
        quant_algo="MIXED_PRECISION", quantized_layers=layers))
    return mixed, experts, rest, layers


def test_modelopt_mixed_precision_and_w4a16_nvfp4_load_each_weight_by_its_dtype(tmp_path):
    """MIXED_PRECISION (experts NVFP4, the rest FP8, as NVIDIA's mixed releases) == each part
    loaded from a checkpoint of its one algorithm; W4A16_NVFP4 (no input_scale) == NVFP4."""
    mixed, experts, rest, _ = modelopt_mixed(tmp_path)
    mine = TargetModel.from_pretrained(mixed, torch.bfloat16).state_dict()
    nv, fp = (TargetModel.from_pretrained(d, torch.bfloat16).state_dict() for d in (experts, rest))
    for k in mine:
        assert torch.equal(mine[k], (nv if ".experts." in k else fp)[k]), k
    w4a16 = edited_checkpoint(experts, tmp_path / "w4a16", config=_set("quant_algo", "W4A16_NVFP4"), state=lambda w: [
        w.pop(k) for k in [k for k in w if k.endswith("input_scale")]])
    theirs = TargetModel.from_pretrained(w4a16, torch.bfloat16).state_dict()
    assert all(torch.equal(theirs[k], nv[k]) for k in nv)


def test_modelopt_speculative_decoding_equals_target_only_hybrid(nemotron):
    _check_speculative_equals_target_only(*nemotron[1:])


def test_modelopt_speculative_decoding_equals_target_only_moe(tmp_path, tokenizer_dir):
    src = make_hybrid_target(tmp_path / "src", "qwen3_moe", tokenizer=False)
    target = to_modelopt(src, tmp_path / "nvfp4")
    copy_tokenizer(tokenizer_dir, target)
    _check_speculative_equals_target_only(target, save_drafter(tmp_path / "d", drafter_config(target, block_size=8)))


def test_round_once_rounds_float64_once():
    """Values whose float32 rounding lands on a bfloat16 tie: rounding twice would be wrong."""
    base = torch.tensor([1.0, 1.5, -3.0, 2.0 ** -130], dtype=torch.float64)
    half_ulp = 2.0 ** -8 * base.abs()  # (a tie in bfloat16, 8 significant bits)
    x = torch.cat([base + half_ulp * (1 + 2.0 ** -30), base + half_ulp * (1 - 2.0 ** -30), base + half_ulp])
    check_rounded_once(nvfp4.round_once(x[:8], torch.bfloat16), x[:8], torch.bfloat16)
    assert not torch.equal(x[:8].float().to(torch.bfloat16), nvfp4.round_once(x[:8], torch.bfloat16))
    check_rounded_once(nvfp4.round_once(x, torch.bfloat16), x, torch.bfloat16)
    assert torch.equal(nvfp4.round_once(x, torch.float32), x.float())


# --- refusals ---


def _ct_group(**change):
    def edit(cfg):
        group = cfg["quantization_config"]["config_groups"]["group_0"]
        for key, value in change.items():
            (group["weights"] if key in ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic")
             else group)[key] = value
    return edit


def _set(key, value):
    return lambda cfg: cfg["quantization_config"].__setitem__(key, value)


@pytest.mark.parametrize("config,message", [
    (_ct_group(group_size=32), "group_size 32"),
    (_ct_group(num_bits=8), "num_bits 8"),
    (_ct_group(symmetric=False), "symmetric False"),
    (_ct_group(dynamic=True), "dynamic True"),
    (_ct_group(input_activations={"num_bits": 8, "type": "float", "strategy": "token"}), "quantizes input_activations"),
    (_ct_group(output_activations={"num_bits": 8, "type": "float"}), "quantizes output_activations"),
    (_ct_group(format="pack-quantized"), "format 'pack-quantized' beside 'nvfp4-pack-quantized'"),
    (_set("kv_cache_scheme", {"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
    (_set("transform_config", {"config_groups": {"u": {"type": "hadamard"}}}), "transform_config"),
    (_set("sparsity_config", {"format": "sparse-24-bitmask"}), "sparsity_config"),
])
def test_ct_schemes_that_cannot_be_read_exactly_are_refused_in_one_line(ct_dense, tmp_path, config, message):
    target = edited_checkpoint(ct_dense[0], tmp_path / "edited", config=config)
    with pytest.raises(DFlashError, match=message) as err:
        TargetModel.from_pretrained(target, torch.float32)
    assert "\n" not in str(err.value)


P = "model.layers.1.self_attn.k_proj."


@pytest.mark.parametrize("state,message", [
    (lambda w: w.pop(P + "weight_global_scale"), f"NVFP4 weight {P}weight_packed has no {P}weight_global_scale"),
    (lambda w: w.pop(P + "weight_packed"), rf"{P}weight_(global_)?scale has no NVFP4 weight {P}weight_packed"),
    (lambda w: w.__setitem__(P + "weight", torch.zeros(32, 64)), f"both {P}weight and the packed"),
    (lambda w: w.__setitem__(P + "weight_zero_point", torch.zeros(32, 4)), "is a zero point"),
    (lambda w: w.__setitem__(P + "weight_global_scale", torch.zeros(1)), "not a positive finite number"),
    (lambda w: w.__setitem__(P + "weight_global_scale", torch.tensor([float("nan")])), "not a positive finite"),
    (lambda w: w.__setitem__(P + "weight_global_scale", torch.ones(1, dtype=torch.bfloat16)), "expected float32"),
    (lambda w: w.__setitem__(P + "weight_scale", w[P + "weight_scale"].float()), "expected float8_e4m3fn"),
    (lambda w: w.__setitem__(P + "weight_scale", w[P + "weight_scale"][:, :2].contiguous()), r"\(32, 2\), expected"),
    (lambda w: w[P + "weight_scale"].view(torch.uint8).__setitem__((0, 0), 0x7F), "holds NaN"),
    (lambda w: w.__setitem__(P + "weight_packed", w[P + "weight_packed"].view(torch.int8)), "is int8 with 2 dim"),
    (lambda w: w.__setitem__(P + "weight_packed", w[P + "weight_packed"][:, :4].contiguous()), "not a multiple"),
])
def test_bad_ct_tensors_are_refused_in_one_line(ct_dense, tmp_path, state, message):
    target = edited_checkpoint(ct_dense[0], tmp_path / "edited", state=state)
    with pytest.raises(DFlashError, match=message) as err:
        TargetModel.from_pretrained(target, torch.float32)
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def modelopt_dense(tmp_path_factory):
    root = tmp_path_factory.mktemp("mo")
    src = make_target(root / "src", "qwen3", tokenizer=False, tie_word_embeddings=False)
    return to_modelopt(src, root / "nvfp4")


@pytest.mark.parametrize("config,message", [
    (_set("quant_algo", "W4A8_AWQ"), "quant_algo 'W4A8_AWQ'"),
    (_set("quant_algo", "FP8_PB_WO"), "quant_algo 'FP8_PB_WO'"),
    (_set("quant_algo", "MIXED_PRECISION"), "'MIXED_PRECISION' without quantized_layers"),
    (lambda cfg: cfg["quantization_config"].update(quant_algo="MIXED_PRECISION", quantized_layers={
        "model.layers.0.mlp.down_proj": {"quant_algo": "NVFP4", "group_size": 16},
        "model.layers.0.mlp.up_proj": {"quant_algo": "W4A8_AWQ"}}),
     "'model.layers.0.mlp.up_proj' has quant_algo 'W4A8_AWQ'"),
    (lambda cfg: cfg["quantization_config"].update(quant_algo="MIXED_PRECISION", quantized_layers={
        "model.layers.0.mlp.down_proj": {"quant_algo": "NVFP4", "group_size": 32}}), "group_size 32"),
    (_set("group_size", 32), "group_size 32"),
    (_set("kv_cache_scheme", {"num_bits": 8, "type": "float"}), "has a kv_cache_scheme"),
    (_set("kv_cache_quant_algo", "NVFP4"), "quantizes the KV cache as kv_cache_quant_algo 'NVFP4'"),
    (_set("quant_algo", "FP8"), "is a ModelOpt FP8 scale, but .* is uint8, not float8_e4m3fn"),
])
def test_modelopt_configs_that_cannot_be_read_exactly_are_refused_in_one_line(modelopt_dense, tmp_path, config,
                                                                              message):
    target = edited_checkpoint(modelopt_dense, tmp_path / "edited", config=config)
    with pytest.raises(DFlashError, match=message) as err:
        TargetModel.from_pretrained(target, torch.float32)
    assert "\n" not in str(err.value)


def _kv_scales(w):
    for key in [k for k in w if k.endswith(("k_proj.weight", "v_proj.weight"))]:
        w[key.removesuffix("weight") + ("k_scale" if ".k_proj." in key else "v_scale")] = torch.tensor(0.02)


def test_an_fp8_kv_cache_is_kept_in_the_model_dtype(modelopt_dense, tmp_path):
    """kv_cache_quant_algo FP8 (NVIDIA's Nemotron releases): the k_scale / v_scale are not read,
    the model is the one without them; a scale that is not per-tensor is refused."""
    kv = edited_checkpoint(modelopt_dense, tmp_path / "kv", state=_kv_scales,
                           config=_set("kv_cache_quant_algo", "FP8"))
    assert any(k.endswith(".k_scale") for k in load_file(str(kv / "model.safetensors")))
    a = TargetModel.from_pretrained(modelopt_dense, torch.float32).state_dict()
    b = TargetModel.from_pretrained(kv, torch.float32).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    bad = edited_checkpoint(kv, tmp_path / "bad", state=lambda w: w.__setitem__(
        "model.layers.0.self_attn.k_proj.k_scale", torch.ones(4)))
    with pytest.raises(DFlashError, match=r"k_proj\.k_scale is not a per-tensor KV cache scale \(float32, one "
                                          r"value\)$"):
        TargetModel.from_pretrained(bad, torch.float32)


@pytest.mark.parametrize("state,message", [
    (lambda w: w.pop(P + "weight_scale_2"), f"NVFP4 weight {P}weight has no {P}weight_scale_2"),
    (lambda w: w.pop(P + "weight"), f"{P}input_scale is a ModelOpt NVFP4 scale, but there is no {P}weight"),
    (lambda w: w.__setitem__(P + "weight_scale_2", torch.tensor(float("inf"))), "not a positive finite number"),
    (lambda w: w.__setitem__(P + "weight_scale_2", torch.tensor(-1.0)), "not a positive finite number"),
    (lambda w: w.__setitem__(P + "weight_scale_2", torch.ones(3)), r"\(3,\), expected float32 with one value"),
    (lambda w: w.__setitem__(P + "weight", torch.zeros(32, 64, dtype=nvfp4.FP8)),
     "is a ModelOpt NVFP4 scale, but .* is float8_e4m3fn, not uint8"),
    (lambda w: w.__setitem__(P + "weight_scale", w[P + "weight_scale"].to(torch.bfloat16)), "expected float8_e4m3fn"),
    (lambda w: w.__setitem__("model.layers.0.mlp.up_proj.input_scale", torch.tensor(1.0)),
     "up_proj.input_scale is a ModelOpt NVFP4 scale, but model.layers.0.mlp.up_proj.weight is float32"),
])
def test_bad_modelopt_tensors_are_refused_in_one_line(modelopt_dense, tmp_path, state, message):
    if "up_proj.input_scale" in message:  # (an unquantized projection beside a stray scale)
        src = modelopt_dense.parent / "src"
        base = to_modelopt(src, tmp_path / "partial", which=lambda k: "mlp.up_proj" not in k)
        target = edited_checkpoint(base, tmp_path / "edited", state=state)
    else:
        target = edited_checkpoint(modelopt_dense, tmp_path / "edited", state=state)
    with pytest.raises(DFlashError, match=message) as err:
        TargetModel.from_pretrained(target, torch.float32)
    assert "\n" not in str(err.value)


def _group_scale_byte(byte: int):
    """Set the first group scale of ``P``'s weight to the float8 byte ``byte``."""
    return lambda w: w[P + "weight_scale"].view(torch.uint8).__setitem__((0, 0), byte)


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
@pytest.mark.parametrize("mode", ["dequantize", "packed"])
def test_negative_group_scales_are_refused_and_zero_ones_load(ct_dense, modelopt_dense, tmp_path, fmt, mode):
    """A float8 group scale is a magnitude: a negative one (sign bit set: -1.0 is 0xB8) is a corrupt
    checkpoint, refused in one line naming it (it loaded, and changed the output); a zero one
    (e.g. ModelOpt's float8 rounding of a tiny group's scale) or a negative zero makes its 16
    weights zero."""
    src = ct_dense[0] if fmt == "compressed-tensors" else modelopt_dense
    bad = edited_checkpoint(src, tmp_path / "bad", state=_group_scale_byte(0xB8))
    with pytest.raises(DFlashError, match=rf"^NVFP4 scale {P}weight_scale holds negative values \(a corrupt "
                                          r"checkpoint: group scales are zero or positive\)$"):
        TargetModel.from_pretrained(bad, torch.float32, nvfp4=mode)
    plain = TargetModel.from_pretrained(src, torch.float32, nvfp4="dequantize").state_dict()[P + "weight"]
    for byte in (0x00, 0x80):
        zero = edited_checkpoint(src, tmp_path / f"zero-{byte}", state=_group_scale_byte(byte))
        TargetModel.from_pretrained(zero, torch.float32, nvfp4=mode)
        w = TargetModel.from_pretrained(zero, torch.float32, nvfp4="dequantize").state_dict()[P + "weight"]
        assert not w[0, :16].any() and plain[0, :16].any()
        assert torch.equal(w[:, 16:], plain[:, 16:]) and torch.equal(w[1:], plain[1:])


def test_the_other_formats_packed_modes_refuse_nvfp4_checkpoints(ct_dense, modelopt_dense):
    """The packed modes of the other formats refuse NVFP4 / ModelOpt checkpoints in one line,
    naming what they keep packed; auto loads them dequantized where they fit (nvfp4="packed":
    test_nvfp4_packed.py)."""
    with pytest.raises(DFlashError, match="format 'pack-quantized'") as err:
        TargetModel.from_pretrained(ct_dense[0], torch.float32, int_weights="packed")
    assert "\n" not in str(err.value)
    with pytest.raises(DFlashError, match="quant_method 'fp8'"):
        TargetModel.from_pretrained(modelopt_dense, torch.float32, fp8="packed")
    model = TargetModel.from_pretrained(modelopt_dense, torch.float32, fp8="auto", int_weights="auto")
    assert model.config.nvfp4 == "modelopt" and model.model.layers[0].mlp.up_proj.weight.dtype == torch.float32


@pytest.mark.parametrize("text,message", [
    ("{", "hf_quant_config.json is not valid JSON"),
    ('{"producer": {"name": "modelopt"}}', "hf_quant_config.json has no 'quantization' object"),
    ('{"producer": {"name": "other"}, "quantization": {"quant_algo": "NVFP4"}}', "quant_method 'other'"),
])
def test_a_bad_hf_quant_config_is_refused_in_one_line(nemotron, tmp_path, text, message):
    legacy = to_modelopt(nemotron[0], tmp_path / "legacy", legacy=True)
    (legacy / "hf_quant_config.json").write_text(text)
    with pytest.raises(DFlashError, match=message) as err:
        TargetModel.from_pretrained(legacy, torch.float32)
    assert "\n" not in str(err.value)


def test_families_without_modelopt_support_refuse_it(tmp_path):
    from conftest import make_gpt_oss_target

    src = make_gpt_oss_target(tmp_path / "src", tokenizer=False)
    target = edited_checkpoint(src, tmp_path / "edited", config=lambda cfg: cfg.update(
        quantization_config=modelopt_config()))
    with pytest.raises(DFlashError, match="quant_method 'modelopt'"):
        TargetModel.from_pretrained(target, torch.float32)
