"""DeepSeek-V4's published quantized weights (deepseek-ai/DeepSeek-V4-Flash), as
transformers reads them.

The format (transformers 5.24: ``integrations/finegrained_fp8.py``'s ``Fp8Dequantize`` and
``FP8Experts``, ``quantizers/quantizer_finegrained_fp8.py``'s rename of ``X.scale`` to
``X.weight_scale_inv``, ``utils/quantization_config.py``'s ``FineGrainedFP8Config``;
DeepSeek-V4-Flash's ``config.json``): ``quant_method: "fp8"``, ``fmt: "e4m3"``,
``scale_fmt: "ue8m0"``, ``weight_block_size: [128, 128]``, dynamic activations, and
``expert_dtype: "fp4"`` at the top level of ``config.json`` (transformers' DeepseekV4Config
moves it into the quantization_config, where V4.1 publishes it). Linears: e4m3 ``X.weight``
and ``float8_e8m0fnu`` ``X.scale`` per 128 x 128 block. Routed experts: int8 ``X.weight``
``[out, in / 2]`` (two E2M1 elements a byte, the low nibble first) and ``float8_e8m0fnu``
``X.scale`` ``[out, in / 32]``. Compressor and indexer-weight projections, the router,
norms, hyper-connection parameters, embeddings and head stay unquantized.

The writer here (:func:`quantize_fp8`, :func:`quantize_fp4`, :func:`to_published_layout`) is
ours; the reader oracle is transformers: its dequantizer, and its models loading the
quantized checkpoints on the CPU (which dequantizes them).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_torch import DFlashError
from dflash_torch.checkpoint import fp4_saving, fp8_saving
from dflash_torch.models import fp8, mxfp4
from dflash_torch.models.moe import Experts, dispatch_experts, gathered_experts

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
PUBLISHED_QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                   "weight_block_size": [128, 128]}  # DeepSeek-V4-Flash's quantization_config, verbatim


def e8m0(exponents: torch.Tensor) -> torch.Tensor:
    """Powers of two ``2 ** exponents`` as ``float8_e8m0fnu`` (biased by 127)."""
    return (exponents + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def quantize_fp8(w: torch.Tensor, block: tuple[int, int], scale_fmt: str = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[rows, cols]`` (multiples of ``block``) as e4m3 and one scale per block: the least
    power of two that brings the block's largest magnitude within e4m3's 448, as ue8m0
    (``scale_fmt="ue8m0"``), or that magnitude over 448 in float32 (``"float"``)."""
    rows, cols = w.shape
    b = w.float().reshape(rows // block[0], block[0], cols // block[1], block[1])
    amax = b.abs().amax((1, 3)).clamp(min=2.0 ** -100)
    if scale_fmt == "float":
        scale = amax / 448
        return (b / scale[:, None, :, None]).reshape(rows, cols).to(fp8.FORMAT), scale
    exp = torch.ceil(torch.log2(amax / 448)).int()
    q = (b / torch.exp2(exp.float())[:, None, :, None]).reshape(rows, cols).to(fp8.FORMAT)
    return q, e8m0(exp)


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[..., rows, cols]`` (``cols`` a multiple of 32) as DeepSeek-V4's FP4: the nearest
    E2M1 value of each element over its group's power of two (the least that brings the
    group's largest magnitude within 6), two a byte, the low nibble first; int8 ``[..., rows,
    cols / 2]`` and e8m0 ``[..., rows, cols / 32]``."""
    g = w.float().unflatten(-1, (-1, 32))
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=2.0 ** -100) / 6)).int()
    x = g / torch.exp2(exp.float())[..., None]
    magnitude = (x.abs()[..., None] - torch.tensor(E2M1)).abs().argmin(-1)
    code = (magnitude | ((x < 0).long() << 3)).flatten(-2).to(torch.uint8)
    return (code[..., 0::2] | (code[..., 1::2] << 4)).view(torch.int8), e8m0(exp)


def to_published_layout(src: Path, dst: Path, block: tuple[int, int], fp8_keys, fp4_keys, *,
                        expert_dtype_at: str = "top", base: bool = False) -> Path:
    """A copy of the single-file checkpoint ``src`` at ``dst`` in DeepSeek-V4's published
    layout: the weights ``fp8_keys`` accepts as e4m3 with ue8m0 block scales, those
    ``fp4_keys`` accepts as FP4, each scale named ``X.scale``; ``expert_dtype: "fp4"`` at the
    top level of config.json (``expert_dtype_at="top"``) or in its quantization_config
    (``"quant"``). ``base``: DeepSeek-V4-Flash-Base's layout instead (``expert_dtype: "fp8"``:
    those experts e4m3 too; float32 scales, no ``scale_fmt``)."""
    shutil.copytree(src, dst)
    out = {}
    for key, w in load_file(str(src / "model.safetensors")).items():
        if key.endswith(".weight") and fp4_keys(key) and not base:
            out[key], out[key.removesuffix("weight") + "scale"] = quantize_fp4(w)
        elif key.endswith(".weight") and (fp8_keys(key) or base and fp4_keys(key)):
            out[key], out[key.removesuffix("weight") + "scale"] = quantize_fp8(w, block, "float" if base else "ue8m0")
        else:
            out[key] = w
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = dict(PUBLISHED_QUANT, weight_block_size=list(block))
    (cfg if expert_dtype_at == "top" else cfg["quantization_config"])["expert_dtype"] = "fp4"
    if base:  # DeepSeek-V4-Flash-Base: FP8 experts, float32 scales
        cfg["expert_dtype"] = "fp8"
        cfg["quantization_config"].pop("scale_fmt")
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def hf_dequantizer():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one


# --- the formats, against transformers' dequantizer ---


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stored", ["float8_e8m0fnu", "uint8"])
def test_fp8_with_ue8m0_scales_dequantizes_as_transformers(dtype, stored):
    """e4m3 weights with one-byte power-of-two block scales (stored as ``float8_e8m0fnu``, as
    DeepSeek-V4-Flash, or as their ``uint8`` bytes, which transformers also reads): bit for
    bit transformers' float32 product rounded once, dequantized when loading
    (:func:`fp8.dequantize`) and kept packed (row scales, :func:`fp8.dequantize_rows`)."""
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(2, 96, 160, generator=g) * 100).to(fp8.FORMAT)
    scale = torch.randint(100, 150, (2, 3, 5), generator=g, dtype=torch.uint8)
    scale = scale.view(torch.float8_e8m0fnu) if stored == "float8_e8m0fnu" else scale
    ref = hf_dequantizer()(weight, scale, output_dtype=dtype)
    ours = fp8.dequantize(weight, scale, (32, 32), dtype, scale_fmt="ue8m0")
    assert ours.dtype == dtype and torch.equal(ours, ref)
    assert torch.equal(fp8.dequantize_rows(weight, fp8.row_scales(scale, (32, 32), 96), 32, dtype), ref)
    # every scale is a power of two: 2 ** (byte - 127), exactly, 2 ** -127 included
    assert torch.equal(fp8.scale_values(torch.tensor([0, 127, 254], dtype=torch.uint8)),
                       torch.tensor([2.0 ** -127, 1.0, 2.0 ** 127]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stored", ["float8_e8m0fnu", "uint8"])
def test_fp4_experts_dequantize_as_transformers(dtype, stored):
    """DeepSeek-V4's FP4 experts (int8 two a byte, an e8m0 scale per 32 along a row): bit for
    bit transformers' ``Fp8Dequantize`` (its E2M1 table, the low nibble first, float32 product
    rounded once), and the same values as gpt-oss's MXFP4 reading of the same bytes as blocks
    (the packed experts' path)."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randint(-128, 128, (3, 40, 48), generator=g, dtype=torch.int8)
    scale = torch.randint(105, 140, (3, 40, 3), generator=g, dtype=torch.uint8)
    scale = scale.view(torch.float8_e8m0fnu) if stored == "float8_e8m0fnu" else scale
    ref = hf_dequantizer()(weight, scale, output_dtype=dtype)
    ours = mxfp4.dequantize_fp4(weight, scale, dtype)
    assert ours.shape == (3, 40, 96) and torch.equal(ours, ref)
    assert torch.equal(mxfp4.dequantize(*mxfp4.fp4_as_blocks(weight, scale), dtype), ref)


def test_the_fp4_value_table_and_nibble_order_are_transformers():
    """Codes 0-7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and 8-15 their negatives; a byte holds the
    element of the lower column in its low nibble."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    assert Fp8Dequantize._FP4_E2M1_LUT == E2M1 + tuple(-v for v in E2M1)
    byte = torch.tensor([[0x3F, 0x81]], dtype=torch.uint8).view(torch.int8)  # (low, high): (15, 3), (1, 8)
    one = e8m0(torch.zeros(1, 2, dtype=torch.int32))
    got = mxfp4.dequantize_fp4(torch.cat([byte] * 16, dim=1), one, torch.float32)[0, :4]
    assert got.tolist() == [-6.0, 1.5, 0.5, -0.0] and torch.equal(got, hf_dequantizer()(
        torch.cat([byte] * 16, dim=1), one, output_dtype=torch.float32)[0, :4])


def test_the_writer_is_read_back_by_transformers():
    """Our quantizer's output, dequantized by transformers, is the input within the formats'
    precision (e4m3: 3 mantissa bits; E2M1 over a power of two: within half a step of 6)."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 96, generator=g)
    q, s = quantize_fp8(w, (32, 32))
    assert q.dtype == fp8.FORMAT and s.dtype == torch.float8_e8m0fnu and s.shape == (2, 3)
    assert (hf_dequantizer()(q, s, output_dtype=torch.float32) - w).abs().max() <= w.abs().max() / 8
    q, s = quantize_fp4(w)
    assert q.dtype == torch.int8 and q.shape == (64, 48) and s.shape == (64, 3)
    back = hf_dequantizer()(q, s, output_dtype=torch.float32)
    group_max = w.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True)
    assert ((back - w).unflatten(-1, (-1, 32)).abs() <= group_max / 3 + 1e-6).all()


# --- the loader, on a host with stacked experts (DeepSeek-V3's layers; transformers reads the layout for it too) ---

ROUTED = re.compile(r"\.experts\.\d+\.")


def routed(key: str) -> bool:
    return bool(ROUTED.search(key))


def linears(key: str) -> bool:
    return key.endswith(("_proj.weight", "_proj_with_mqa.weight")) and not routed(key)


@pytest.fixture(scope="module")
def host(tmp_path_factory, tokenizer_dir):
    """A tiny DeepSeek-V3 in DeepSeek-V4's published layout: every projection e4m3 with ue8m0
    scales per [8, 16] block, the routed experts FP4, scales named ``X.scale``."""
    from test_deepseek_v3 import make_deepseek_target

    from conftest import copy_tokenizer

    root = tmp_path_factory.mktemp("v4-layout")
    src = make_deepseek_target(root / "src", seed=5)
    copy_tokenizer(tokenizer_dir, src)
    return to_published_layout(src, root / "published", (8, 16), linears, routed, expert_dtype_at="quant")


@pytest.fixture
def fp4_host(monkeypatch):
    """DeepSeek-V3's family reading FP4 experts as deepseek_v4 does (``FP4_EXPERTS``): the loader's
    path for the published layout, on a model transformers loads such checkpoints into."""
    from dflash_torch.models import deepseek_v3

    monkeypatch.setattr(deepseek_v3, "FP4_EXPERTS", True, raising=False)


IDS = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(1))


def test_the_published_layout_loads_as_transformers_loads_it(host, fp4_host):
    """Dequantized when loading, the weights equal those transformers loads from the same
    checkpoint on the CPU, bit for bit, in float32 and bfloat16 (FP8 linears with ue8m0 scales
    under DeepSeek's names, FP4 experts stacked; the router float32 in both), and the float32
    logits its model's. Kept packed (FP8 linears as Fp8Linear, FP4 experts as MXFP4 blocks;
    either alone or both), the logits equal the dequantized model's bit for bit."""
    import transformers
    from conftest import assert_same_weights, forward_in_pieces

    from dflash_torch.models.target import TargetModel

    stored = load_file(str(host / "model.safetensors"))
    assert stored["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == torch.int8
    assert stored["model.layers.1.mlp.experts.3.up_proj.scale"].dtype == torch.float8_e8m0fnu
    assert stored["model.layers.1.self_attn.q_b_proj.scale"].dtype == torch.float8_e8m0fnu
    assert stored["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    for dtype in (torch.float32, torch.bfloat16):
        ours = TargetModel.from_pretrained(host, dtype)
        hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(host), dtype=dtype,
                                                                experts_implementation="eager").eval()
        mine, theirs = ours.state_dict(), hf.state_dict()
        assert_same_weights(mine, theirs, dtype)
        ref = forward_in_pieces(ours, IDS, [20, 10], False)[0]
        if dtype == torch.float32:
            with torch.no_grad():
                torch.testing.assert_close(ref, hf(IDS[None]).logits[0], rtol=1e-4, atol=1e-4)
        for fp8_mode, mxfp4_mode in (("packed", "packed"), ("dequantize", "packed"), ("packed", "dequantize")):
            packed = TargetModel.from_pretrained(host, dtype, fp8=fp8_mode, mxfp4=mxfp4_mode)
            layer = packed.model.layers[1]
            assert isinstance(layer.self_attn.q_b_proj, fp8.Fp8Linear) == (fp8_mode == "packed")
            assert layer.mlp.experts.mxfp4 == (mxfp4_mode == "packed")
            assert packed.config.keep_mxfp4 == (mxfp4_mode == "packed") and packed.config.mxfp4
            if mxfp4_mode == "packed":
                assert layer.mlp.experts.gate_up_proj.dtype == torch.uint8 and layer.mlp.experts.gate_up_proj.dim() == 4
            assert layer.self_attn.kv_b_proj.weight.dtype == dtype and layer.mlp.gate.weight.dtype == torch.float32
            assert torch.equal(forward_in_pieces(packed, IDS, [20, 10], False)[0], ref), (dtype, fp8_mode, mxfp4_mode)


@pytest.mark.parametrize("tokens", [1, 6])
def test_packed_fp4_experts_dispatch_as_the_dequantized_ones(host, fp4_host, tokens):
    """The experts held as MXFP4 blocks give the dequantized experts' output bit for bit, in the
    sparse dispatch and in the gathered one (CUDA graphs: 1 token, each pair's expert
    dequantized; 6 tokens, all experts), float32 and bfloat16."""
    from dflash_torch.models.target import TargetModel

    for dtype in (torch.float32, torch.bfloat16):
        moe = TargetModel.from_pretrained(host, dtype, fp8="dequantize", mxfp4="packed").model.layers[1].mlp
        plain = TargetModel.from_pretrained(host, dtype, fp8="dequantize", mxfp4="dequantize").model.layers[1].mlp
        x = torch.randn(tokens, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(0)).to(dtype)
        weights, experts = moe.gate(x)
        e, p = moe.experts, plain.experts
        packed_args = dict(gate_up_scales=e.gate_up_proj_scale, down_scales=e.down_proj_scale)
        for run in (dispatch_experts, gathered_experts):
            assert torch.equal(run(x, experts, weights, e.gate_up_proj, e.down_proj, **packed_args),
                               run(x, experts, weights, p.gate_up_proj, p.down_proj)), (dtype, run)


def test_speculative_decoding_on_packed_fp4_experts_equals_target_only(host, fp4_host, tmp_path):
    """FP8 linears and FP4 experts kept packed: greedy speculative decoding (one sequence, and a
    batch of two) == target-only decoding of the dequantized model."""
    from conftest import drafter_config, save_drafter

    from dflash_torch import DFlashEngine

    drafter = save_drafter(tmp_path / "drafter", drafter_config(host, block_size=8), seed=4)
    packed = DFlashEngine.from_pretrained(host, drafter, dtype="float32", fp8="packed", mxfp4="packed")
    assert packed.target.config.keep_fp8 and packed.target.model.layers[2].mlp.experts.mxfp4
    plain = DFlashEngine.from_pretrained(host, None, dtype="float32", no_draft=True, fp8="dequantize",
                                         mxfp4="dequantize")
    prompts = ("def f(x):", "import os\n")
    refs = [plain.generate(p, max_new_tokens=24, ignore_eos=True).token_ids for p in prompts]
    assert [packed.generate(p, max_new_tokens=24, ignore_eos=True).token_ids for p in prompts] == refs
    batch = DFlashEngine(packed.target, packed.tokenizer, packed.drafter, max_batch_size=2, max_context=128)
    assert [o.token_ids for o in batch.generate_batch(list(prompts), max_new_tokens=24, ignore_eos=True)] == refs


def test_auto_keeps_the_fp4_experts_packed_first_and_the_memory_check_counts_them(host, fp4_host, monkeypatch):
    """auto: everything dequantized when that fits in 90% of the free memory; else the FP4
    experts kept packed (the bulk), the FP8 linears too only when that still does not fit; the
    estimates are exact (the headers' FP4 and FP8 bytes and scales), and the refusal says
    what was kept."""
    import dflash_torch.checkpoint as checkpoint
    from dflash_torch.models.target import TargetModel

    dtype = torch.bfloat16
    plain = checkpoint.weight_bytes(TargetModel.from_pretrained(host, dtype), dtype)
    model = TargetModel.from_pretrained(host, dtype, fp8="packed", mxfp4="packed")
    cfg, cls = model.config, type(model)
    keep = lambda k: cls.checkpoint_keys(cfg, k)  # noqa: E731
    fp4_saved = fp4_saving(host, dtype, keep)
    fp8_saved = fp8_saving(host, dtype, (8, 16), lambda k: keep(k) and not cls.dequantized_keys(cfg, k))
    assert fp4_saved > 0 and fp8_saved > 0
    assert checkpoint.weight_bytes(model, dtype) == plain - fp4_saved - fp8_saved  # the estimate is exact
    experts_only = TargetModel.from_pretrained(host, dtype, fp8="dequantize", mxfp4="packed")
    assert checkpoint.weight_bytes(experts_only, dtype) == plain - fp4_saved
    for free, kept in ((plain / 0.9, (False, False)), (plain / 0.9 - 1, (True, False)),
                       ((plain - fp4_saved) / 0.9 - 1, (True, True))):
        monkeypatch.setattr(checkpoint, "available_memory", lambda device, free=free: free)
        cfg = TargetModel.from_pretrained(host, dtype).config
        assert (cfg.keep_mxfp4, cfg.keep_fp8) == kept, free
    monkeypatch.setattr(checkpoint, "available_memory", lambda device: plain - fp4_saved - fp8_saved - 1)
    with pytest.raises(DFlashError, match=r"^the target needs .* [kMG]B for its weights in bfloat16 \(FP4 experts kept "
                                          r"packed, FP8 weights kept as stored\); cpu has .* [kMG]B free$"):
        TargetModel.from_pretrained(host, dtype)


Q = "model.layers.1.self_attn.q_b_proj"
X = "model.layers.1.mlp.experts.3.up_proj"


def _config(edit):
    return lambda c: edit(c, c["quantization_config"])


def _set(key, value):
    def edit(w):
        w[key] = value(w)
    return edit


@pytest.mark.parametrize("config,state,message", [
    (_config(lambda c, q: q.pop("expert_dtype")), None,
     r"weight (model\.layers\.\d\.mlp\.experts\.\d\.\w+)\.weight is int8 with a scale \1\.scale \(FP4 experts\) but "
     r"config\.json declares no expert_dtype 'fp4'$"),
    (_config(lambda c, q: q.update(expert_dtype="fp8")), None, r"declares no expert_dtype 'fp4'"),
    (_config(lambda c, q: q.update(expert_dtype="fp5")), None,
     r"quantization_config has expert_dtype 'fp5'; dflash-torch reads 'fp4' .* and 'fp8'$"),
    (_config(lambda c, q: c.update(expert_dtype="fp8")), None,
     r"config\.json has expert_dtype 'fp8' but its quantization_config 'fp4'$"),
    (_config(lambda c, q: q.update(activation_scheme="static")), None, r"has activation_scheme 'static'"),
    (_config(lambda c, q: q.update(scale_fmt="float")), None,
     r"FP8 scale model\.layers\.\d\.\S+\.scale has dtype float8_e8m0fnu; expected float32 or bfloat16 \(e8m0 scales "
     r"need scale_fmt 'ue8m0'"),
    (None, _set(X + ".scale", lambda w: w[X + ".scale"].float()),
     rf"FP4 scale {X}\.scale has dtype float32; FP4 experts read only float8_e8m0fnu scales"),
    (None, _set(X + ".scale", lambda w: w[X + ".scale"][:, :1].contiguous()),
     rf"FP4 scale {X}\.scale has shape \(32, 1\); weight {X}\.weight \(32, 32\) \(64 columns\) in groups of 32 needs "
     r"\(32, 2\)$"),
    (None, _set(X + ".scale", lambda w: w[X + ".scale"].view(torch.uint8).index_fill(0, torch.tensor([3]), 255)
                .view(torch.float8_e8m0fnu)), rf"MXFP4 weight {X}\.weight has scale 255 \(NaN in the MX format\)"),
    (None, _set(Q + ".scale", lambda w: w[Q + ".scale"].view(torch.uint8).index_fill(0, torch.tensor([1]), 255)
                .view(torch.float8_e8m0fnu)), rf"FP8 scale {Q}\.scale holds NaN or infinite values"),
    (None, _set(Q + ".scale", lambda w: w[Q + ".scale"].float()),
     rf"FP8 scale {Q}\.scale has dtype float32; the config's scale_fmt 'ue8m0' stores float8_e8m0fnu"),
    (None, lambda w: w.pop(Q + ".scale"),
     rf"weight {Q}\.weight is float8_e4m3fn without its scale {Q}\.weight_scale_inv \(or {Q}\.scale\)$"),
    (None, lambda w: w.update({Q + ".weight_scale_inv": w[Q + ".scale"].clone()}),
     rf"weight {Q}\.weight has two scales, {Q}\.weight_scale_inv and {Q}\.scale$"),
    (None, lambda w: w.update(dict(zip((X + ".weight", X + ".scale"), quantize_fp8(
        mxfp4.dequantize_fp4(w[X + ".weight"], w[X + ".scale"], torch.float32), (8, 16))))),
     rf"routed expert weight {X}\.weight is float8_e4m3fn but config\.json declares expert_dtype 'fp4' \(a mixed layout\)"),
])
@pytest.mark.parametrize("mode", ["dequantize", "packed"])
def test_what_cannot_be_read_exactly_is_refused_in_one_line(host, fp4_host, tmp_path, config, state, message, mode):
    from conftest import edited_checkpoint

    from dflash_torch.models.target import TargetModel

    bad = edited_checkpoint(host, tmp_path / "bad", config=config, state=state)
    with pytest.raises(DFlashError, match=message) as err:
        TargetModel.from_pretrained(bad, torch.float32, fp8=mode, mxfp4="auto" if "expert_dtype" in message else mode)
    assert "\n" not in str(err.value)


def test_fp4_experts_are_read_for_deepseek_v4_only_and_must_be_there(host, fp4_host, tmp_path, monkeypatch):
    """expert_dtype 'fp4' elsewhere than a deepseek_v4 target is refused; declared but without
    any FP4 weight, too; ``--mxfp4 packed`` on an FP8 checkpoint without FP4 experts as well."""
    from conftest import edited_checkpoint

    from dflash_torch.models import deepseek_v3
    from dflash_torch.models.config import TargetConfig
    from dflash_torch.models.target import TargetModel

    cfg = json.loads((host / "config.json").read_text())
    monkeypatch.delattr(deepseek_v3, "FP4_EXPERTS")
    with pytest.raises(DFlashError, match=r"^the target checkpoint declares expert_dtype 'fp4' \(FP4 experts\); "
                                          r"dflash-torch reads those for deepseek_v4 only, not 'deepseek_v3'$"):
        TargetConfig.from_dict(cfg)
    monkeypatch.setattr(deepseek_v3, "FP4_EXPERTS", True, raising=False)
    assert TargetConfig.from_dict(cfg).fp4_experts
    dequantized = {k: (mxfp4.dequantize_fp4(v, w[k[:-6] + "scale"], torch.float32).to(torch.bfloat16)
                       if v.dtype == torch.int8 else v) for w in [load_file(str(host / "model.safetensors"))]
                   for k, v in w.items() if not (k.endswith(".scale") and w[k[:-5] + "weight"].dtype == torch.int8)}
    no_fp4 = edited_checkpoint(host, tmp_path / "no-fp4", state=lambda w: (w.clear(), w.update(dequantized)))
    with pytest.raises(DFlashError, match=r"config\.json declares expert_dtype 'fp4' but the checkpoint holds no FP4 "
                                          r"\(int8\) expert weights$"):
        TargetModel.from_pretrained(no_fp4, torch.float32)
    plain_fp8 = edited_checkpoint(no_fp4, tmp_path / "fp8", config=lambda c: c["quantization_config"].pop("expert_dtype"))
    TargetModel.from_pretrained(plain_fp8, torch.float32)
    with pytest.raises(DFlashError, match=r"^mxfp4 packed keeps MXFP4 expert weights packed, but the target checkpoint "
                                          r"has none"):
        TargetModel.from_pretrained(plain_fp8, torch.float32, mxfp4="packed")


# --- DeepSeek-V4 itself ---

V4_FP8 = re.compile(r"(^|\.)(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|indexer\.wq_b|shared_experts\.w[123])\.weight$")
V4_FP4 = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")


@pytest.fixture(scope="module")
def v4(tmp_path_factory, tokenizer_dir):
    """A tiny DeepSeek-V4 (test_deepseek_v4's, experts 32 wide) in the published layout:
    DeepSeek's top-level names; wq_a, wq_b, wkv, wo_a, wo_b, the indexer's wq_b and the shared
    experts e4m3 with ue8m0 scales per [8, 8] block; the routed experts FP4; the compressors',
    the indexer's weights_proj, the router, norms, hyper-connections, embeddings and head as
    they were; ``expert_dtype: "fp4"`` at the top level of config.json."""
    from test_deepseek_v4 import make_v4_target, published_layout

    from conftest import copy_tokenizer

    root = tmp_path_factory.mktemp("v4-quant")
    src = make_v4_target(root / "src", seed=3, moe_intermediate_size=32)
    copy_tokenizer(tokenizer_dir, src)
    top = published_layout(src, root / "top")
    return to_published_layout(top, root / "published", (8, 8), V4_FP8.search, V4_FP4.search)


V4_IDS = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1))


def test_deepseek_v4_s_published_weights_load_as_transformers_loads_them(v4):
    """DeepSeek-V4 in its published layout: dequantized when loading, our weights equal those
    transformers loads from the same checkpoint (float32 and bfloat16, bit for bit), and the
    float32 logits its model's; kept packed (FP8 linears, FP4 experts, either or both; wo_a,
    read as a matrix, dequantized when loading), the logits equal the dequantized model's bit
    for bit, one pass and in pieces."""
    import transformers
    from test_deepseek_v4 import run_pieces

    from dflash_torch.models import deepseek_v4_attention
    from dflash_torch.models.target import TargetModel

    stored = load_file(str(v4 / "model.safetensors"))
    assert stored["layers.1.attn.wq_a.weight"].dtype == fp8.FORMAT
    assert stored["layers.1.attn.wo_a.scale"].dtype == torch.float8_e8m0fnu
    assert stored["layers.1.attn.indexer.wq_b.scale"].dtype == torch.float8_e8m0fnu
    assert stored["layers.1.ffn.experts.2.w2.weight"].dtype == torch.int8
    assert stored["layers.1.ffn.experts.2.w2.scale"].shape == (32, 1)  # (hidden 32, moe_intermediate 32)
    assert stored["layers.1.attn.compressor.wkv.weight"].dtype == torch.float32
    assert json.loads((v4 / "config.json").read_text())["expert_dtype"] == "fp4"
    for dtype in (torch.float32, torch.bfloat16):
        ours = TargetModel.from_pretrained(v4, dtype)
        hf = transformers.DeepseekV4ForCausalLM.from_pretrained(str(v4), dtype=dtype,
                                                                experts_implementation="eager").eval()
        mine, theirs = ours.state_dict(), hf.state_dict()
        assert mine.keys() <= theirs.keys()
        for k in mine:
            assert mine[k].dtype == theirs[k].dtype and torch.equal(mine[k], theirs[k]), (dtype, k)
        refs = {(40,): run_pieces(ours, V4_IDS, [40], features=False)[0],
                (17, 1, 22): run_pieces(ours, V4_IDS, [17, 1, 22], features=False)[0]}
        if dtype == torch.float32:
            with torch.no_grad():
                torch.testing.assert_close(refs[40,], hf(V4_IDS[None]).logits[0], rtol=0, atol=1e-5)
        for fp8_mode, mxfp4_mode in (("packed", "packed"), ("dequantize", "packed"), ("packed", "dequantize")):
            packed = TargetModel.from_pretrained(v4, dtype, fp8=fp8_mode, mxfp4=mxfp4_mode)
            attn, moe = packed.model.layers[1].self_attn, packed.model.layers[1].mlp
            assert isinstance(attn.q_a_proj, fp8.Fp8Linear) == (fp8_mode == "packed")
            assert isinstance(attn.compressor.indexer.q_b_proj, fp8.Fp8Linear) == (fp8_mode == "packed")
            assert type(attn.o_a_proj) is deepseek_v4_attention.GroupedProjection and attn.o_a_proj.weight.dtype == dtype
            assert moe.experts.mxfp4 == (mxfp4_mode == "packed")
            for pieces, ref in refs.items():
                assert torch.equal(run_pieces(packed, V4_IDS, list(pieces), features=False)[0], ref), (dtype, pieces)


def test_speculative_decoding_on_a_packed_deepseek_v4_equals_target_only(v4, tmp_path):
    """DeepSeek-V4 in its published layout, FP8 linears and FP4 experts kept packed: greedy
    speculative decoding (one sequence, and a batch of two) == target-only decoding of the
    dequantized model."""
    from conftest import v4_drafter

    from dflash_torch import DFlashEngine

    drafter = v4_drafter(v4, tmp_path / "drafter", seed=4)
    packed = DFlashEngine.from_pretrained(v4, drafter, dtype="float32", fp8="packed", mxfp4="packed")
    assert packed.target.config.keep_fp8 and packed.target.config.keep_mxfp4
    plain = DFlashEngine.from_pretrained(v4, None, dtype="float32", no_draft=True, fp8="dequantize", mxfp4="dequantize")
    prompts = ("def f(x):", "import os\n")
    refs = [plain.generate(p, max_new_tokens=24, ignore_eos=True).token_ids for p in prompts]
    assert [packed.generate(p, max_new_tokens=24, ignore_eos=True).token_ids for p in prompts] == refs
    batch = DFlashEngine(packed.target, packed.tokenizer, packed.drafter, max_batch_size=2, max_context=128)
    assert [o.token_ids for o in batch.generate_batch(list(prompts), max_new_tokens=24, ignore_eos=True)] == refs


def test_deepseek_v4_s_memory_check_counts_what_is_kept(v4):
    """The headers' estimate of what keeping packed saves is exact for DeepSeek-V4 (wo_a counted
    dequantized: it is)."""
    from dflash_torch import checkpoint
    from dflash_torch.models.target import TargetModel

    dtype = torch.bfloat16
    plain = checkpoint.weight_bytes(TargetModel.from_pretrained(v4, dtype), dtype)
    model = TargetModel.from_pretrained(v4, dtype, fp8="packed", mxfp4="packed")
    cfg, cls = model.config, type(model)
    keep = lambda k: cls.checkpoint_keys(cfg, k)  # noqa: E731
    saved = fp4_saving(v4, dtype, keep) + fp8_saving(v4, dtype, (8, 8), lambda k: keep(k) and not cls.dequantized_keys(cfg, k))
    assert checkpoint.weight_bytes(model, dtype) == plain - saved



V4X = "layers.1.ffn.experts.2.w1"  # (an FP4 expert weight, as the published layout names it)


@pytest.mark.parametrize("state,message", [
    (lambda w: w.pop(V4X + ".scale"),
     rf"weight {V4X}\.weight is an FP4 weight \(int8\) without its scale {V4X}\.scale \(or {V4X}\.weight_scale_inv\)$"),
    (_set(V4X + ".weight", lambda w: w[V4X + ".weight"].view(torch.uint8)),
     rf"weight {V4X}\.weight is uint8 with a scale {V4X}\.scale; quantized FP8 weights are float8_e4m3fn, FP4 weights "
     r"int8 \(two e2m1 values a byte\)$"),
    (_set("layers.1.attn_norm.scale", lambda w: e8m0(torch.zeros(1, dtype=torch.int32))),
     r"layers\.1\.attn_norm\.scale is a scale \(float8_e8m0fnu\) beside the unquantized weight "
     r"layers\.1\.attn_norm\.weight \(float32\); a scale belongs to a quantized weight$"),
    (_set("layers.1.attn.wfoo.scale", lambda w: e8m0(torch.zeros(1, 1, dtype=torch.int32))),
     r"layers\.1\.attn\.wfoo\.scale is a scale \(float8_e8m0fnu\) without its weight layers\.1\.attn\.wfoo\.weight$"),
], ids=["fp4-scale-missing", "fp4-weight-uint8", "scale-beside-unquantized", "scale-without-weight"])
@pytest.mark.parametrize("mode", ["dequantize", "packed", "auto"])
def test_deepseek_v4_s_bad_quantized_tensors_are_named_in_one_line(v4, tmp_path, state, message, mode):
    """A missing FP4 scale, FP4 bytes stored as uint8, a ue8m0 scale beside an unquantized
    weight or without one: one line naming the tensors as the checkpoint names them, the same
    whether the weights are dequantized or kept packed."""
    from conftest import edited_checkpoint

    from dflash_torch.models.target import TargetModel

    bad = edited_checkpoint(v4, tmp_path / "bad", state=state)
    with pytest.raises(DFlashError, match=rf"^{re.escape(str(bad))}: {message}") as err:
        TargetModel.from_pretrained(bad, torch.float32, fp8=mode, mxfp4=mode)
    assert "\n" not in str(err.value)


def _quantize_rows(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_fp8` of ``w`` whose rows need not fill the last block (a router's
    ``[experts, hidden]``): zero rows padded for the scales, dropped from the weight."""
    rows = w.shape[0]
    q, s = quantize_fp8(torch.cat([w, w.new_zeros(-rows % block[0], w.shape[1])]), block)
    return q[:rows].contiguous(), s


def test_deepseek_v4_s_quantized_head_router_and_embeddings_load_packed_as_dequantized(v4, tmp_path):
    """An FP8 ``head.weight``, router ``ffn.gate.weight`` and ``embed.weight`` (ue8m0 ``X.scale``;
    the published checkpoint keeps them unquantized): dequantized when loading, the weights
    transformers loads, bit for bit; with the linears and experts kept packed they are
    dequantized all the same (not decoder linears) and the logits equal the dequantized
    model's bit for bit; the memory estimate counts them dequantized."""
    import transformers
    from conftest import edited_checkpoint
    from test_deepseek_v4 import run_pieces

    from dflash_torch import checkpoint
    from dflash_torch.models.target import TargetModel

    keys = ("head", "layers.1.ffn.gate", "layers.2.ffn.gate", "embed")

    def quantize(w):
        for k in keys:
            w[k + ".weight"], w[k + ".scale"] = _quantize_rows(w[k + ".weight"], (8, 8))

    q = edited_checkpoint(v4, tmp_path / "q", state=quantize)
    stored = load_file(str(q / "model.safetensors"))
    plain = TargetModel.from_pretrained(q, torch.float32, fp8="dequantize", mxfp4="dequantize")
    mine = plain.state_dict()
    for key, ours in zip(keys, ("lm_head.weight", "model.layers.1.mlp.gate.weight", "model.layers.2.mlp.gate.weight",
                                "model.embed_tokens.weight")):
        assert stored[key + ".weight"].dtype == fp8.FORMAT
        assert torch.equal(mine[ours], hf_dequantizer()(stored[key + ".weight"], stored[key + ".scale"],
                                                        output_dtype=torch.float32)), key
    # (transformers' model reads the routers so too; a quantized head or embedding it reads unscaled)
    theirs = transformers.DeepseekV4ForCausalLM.from_pretrained(str(q), dtype=torch.float32,
                                                                experts_implementation="eager").state_dict()
    for k in ("model.layers.1.mlp.gate.weight", "model.layers.2.mlp.gate.weight"):
        assert torch.equal(mine[k], theirs[k]), k
    ref = run_pieces(plain, V4_IDS, [40], features=False)[0]
    for fp8_mode, mxfp4_mode in (("packed", "packed"), ("packed", "dequantize")):
        packed = TargetModel.from_pretrained(q, torch.float32, fp8=fp8_mode, mxfp4=mxfp4_mode)
        assert isinstance(packed.model.layers[1].self_attn.q_a_proj, fp8.Fp8Linear)
        assert type(packed.lm_head) is torch.nn.Linear and packed.lm_head.weight.dtype == torch.float32
        assert torch.equal(run_pieces(packed, V4_IDS, [40], features=False)[0], ref), (fp8_mode, mxfp4_mode)
    cls, cfg = type(packed), packed.config
    saved = fp8_saving(q, torch.float32, (8, 8), lambda k: not cls.dequantized_keys(cfg, k))
    assert checkpoint.weight_bytes(packed, torch.float32) == checkpoint.weight_bytes(plain, torch.float32) - saved


FLASH_CONFIG = {  # deepseek-ai/DeepSeek-V4-Flash's config.json (its architecture keys, as published)
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "expert_dtype": "fp4", "hc_eps": 1e-06,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "head_dim": 512, "hidden_act": "silu", "hidden_size": 4096,
    "index_head_dim": 128, "index_n_heads": 64, "index_topk": 512, "max_position_embeddings": 1048576,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 64, "num_experts_per_tok": 6, "num_hidden_layers": 43, "num_hash_layers": 3,
    "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 8, "o_lora_rank": 1024, "q_lora_rank": 1024,
    "qk_rope_head_dim": 64, "quantization_config": PUBLISHED_QUANT, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"}, "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus",
    "sliding_window": 128, "swiglu_limit": 10.0, "tie_word_embeddings": False, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "vocab_size": 129280, "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0], "bos_token_id": 0, "eos_token_id": 1, "attention_bias": False}


def test_deepseek_v4_flash_s_weights_held_packed_take_158_gb():
    """DeepSeek-V4-Flash's published config (284.3 B parameters without the MTP layer) read as
    FP8 with ue8m0 block scales of [128, 128] and FP4 experts; held in bfloat16 with its FP4
    experts packed (bytes and one-byte exponents: 277.0 B parameters in 147 GB) and its FP8
    linears kept (e4m3 plus float32 row scales; wo_a dequantized, as loading does), the weights
    take 157.5 GB (146.7 GiB); dequantized to bfloat16, 568.7 GB. (Its published files, the MTP
    layer included, are 159.6 GB.)"""
    from torch import nn

    from dflash_torch import checkpoint as ckpt
    from dflash_torch.models import deepseek_v4
    from dflash_torch.models.config import TargetConfig

    cfg = TargetConfig.from_dict(FLASH_CONFIG)
    assert (cfg.fp8_block, cfg.fp8_scale_fmt, cfg.fp4_experts, cfg.mxfp4) == ((128, 128), "ue8m0", True, True)
    with torch.device("meta"):
        model = deepseek_v4.Model(cfg)
    assert sum(p.numel() for p in model.parameters()) == 284_332_240_471
    assert ckpt.weight_bytes(model, torch.bfloat16) == 568_664_480_942
    published_bf16 = ("compressor.kv_proj", "compressor.gate_proj", "indexer.kv_proj", "indexer.gate_proj", "weights_proj")
    routed = fp8_weights = 0
    for name, m in list(model.named_modules()):
        if type(m) is nn.Linear and name.startswith("model.layers.") and not name.endswith(published_bf16):
            parent, child = name.rsplit(".", 1)
            setattr(model.get_submodule(parent), child, fp8.Fp8Linear.like(m, 128))
            fp8_weights += m.weight.numel()
        elif isinstance(m, Experts):
            routed += sum(p.numel() for p in m.parameters())
            m.keep_mxfp4()
    assert routed == 43 * 256 * 3 * 4096 * 2048 and fp8_weights == 4_414_504_960
    assert ckpt.weight_bytes(model, torch.bfloat16) == 157_506_886_830


def test_deepseek_v4_flash_base_s_layout_fp8_experts_with_float_scales(v4, tmp_path):
    """DeepSeek-V4-Flash-Base's layout (``expert_dtype: "fp8"``: the experts e4m3 like the
    linears, float32 block scales still named ``X.scale``): equal to transformers' loading,
    bit for bit; kept packed (FP8 experts included), the dequantized model's logits bit for
    bit; ``--mxfp4 packed`` is refused (no FP4 experts)."""
    import transformers
    from test_deepseek_v4 import make_v4_target, published_layout, run_pieces

    from dflash_torch.models.target import TargetModel

    top = published_layout(make_v4_target(tmp_path / "src", seed=3, moe_intermediate_size=32), tmp_path / "top")
    base = to_published_layout(top, tmp_path / "base", (8, 8), V4_FP8.search, V4_FP4.search, base=True)
    stored = load_file(str(base / "model.safetensors"))
    assert stored["layers.1.ffn.experts.2.w2.weight"].dtype == fp8.FORMAT
    assert stored["layers.1.ffn.experts.2.w2.scale"].dtype == torch.float32
    ours = TargetModel.from_pretrained(base, torch.float32)
    assert not ours.config.fp4_experts and ours.config.fp8_scale_fmt == "float"
    theirs = transformers.DeepseekV4ForCausalLM.from_pretrained(str(base), dtype=torch.float32).state_dict()
    for k, t in ours.state_dict().items():
        assert torch.equal(t, theirs[k]), k
    packed = TargetModel.from_pretrained(base, torch.float32, fp8="packed")
    assert packed.model.layers[1].mlp.experts.fp8_block_cols == 8
    assert torch.equal(run_pieces(packed, V4_IDS, [40], features=False)[0],
                       run_pieces(ours, V4_IDS, [40], features=False)[0])
    with pytest.raises(DFlashError, match="^mxfp4 packed keeps MXFP4 expert weights packed, but the target checkpoint has none"):
        TargetModel.from_pretrained(base, torch.float32, mxfp4="packed")
