"""NVFP4 weights kept packed (``nvfp4="packed"``: dflash_torch/models/nvfp4.py's
:class:`Nvfp4Linear` and NVFP4 experts), in both published formats (compressed-tensors
``nvfp4-pack-quantized``, ModelOpt NVFP4), against the same checkpoints dequantized when
loading (``nvfp4="dequantize"``, checked against the libraries and the format in
test_nvfp4.py).

* the logits are those of the dequantized model, bit for bit (float32 and bfloat16; a dense,
  an MoE and a hybrid Nemotron-H family; projections joined or not; compiled);
* greedy speculative decoding on a packed target (one sequence and batched) == target-only
  decoding of the dequantized one;
* the memory check counts what the packed layers hold, and the quantized matrices take
  4.5 bits a weight (plus a float32 per row);
* the option is checked in one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import (check_gathered_dispatch, copy_tokenizer, drafter_config, edited_checkpoint, forward_in_pieces,
                      make_hybrid_target, make_target, save_drafter)
from test_nvfp4 import nemotron, to_ct_nvfp4, to_modelopt  # noqa: F401  (nemotron: a fixture)
from dflash_torch import DFlashError, checkpoint
from dflash_torch.errors import OptionError
from dflash_torch.models import nvfp4
from dflash_torch.models.moe import Experts
from dflash_torch.models.target import TargetModel

IDS = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(3))
DTYPES = [torch.float32, torch.bfloat16]
FORMATS = {"ct": to_ct_nvfp4, "modelopt": to_modelopt}


def _logits(model: TargetModel) -> torch.Tensor:
    return forward_in_pieces(model, IDS, [7, 13], False)[0]


def _packed_layers(model: TargetModel) -> tuple[int, int]:
    """(Nvfp4Linear layers, NVFP4 expert stacks) of a model."""
    return (sum(isinstance(m, nvfp4.Nvfp4Linear) for m in model.modules()),
            sum(isinstance(m, Experts) and m.nvfp4_kind > 0 for m in model.modules()))


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """(family, format) -> an NVFP4 checkpoint of a tiny target, every projection quantized."""
    root, made = tmp_path_factory.mktemp("packed"), {}

    def get(family: str, fmt: str) -> Path:
        if (family, fmt) not in made:
            src = root / family
            if not src.exists():
                if family == "qwen3":
                    make_target(src, "qwen3", seed=4, tokenizer=False, tie_word_embeddings=False)
                else:
                    make_hybrid_target(src, family, seed=4, tokenizer=False)
            made[family, fmt] = FORMATS[fmt](src, root / f"{family}-{fmt}")
        return made[family, fmt]

    return get


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family,fmt", [("qwen3", "ct"), ("qwen3", "modelopt"), ("qwen3_moe", "ct"),
                                        ("qwen3_moe", "modelopt"), ("qwen3_next", "ct")])
def test_packed_weights_give_the_dequantized_model_bit_for_bit(quantized, family, fmt, dtype):
    """Each quantized linear an Nvfp4Linear, the experts NVFP4 stacks; the logits those of the
    model dequantized when loading, bit for bit, projections joined or not (Qwen3-Next: a hybrid
    with a shared expert; its Gated DeltaNet projections are stored unquantized here)."""
    from dflash_torch.models.fusing import fuse_projections

    target = quantized(family, fmt)
    plain = TargetModel.from_pretrained(target, dtype, nvfp4="dequantize")
    packed = TargetModel.from_pretrained(target, dtype, nvfp4="packed")
    assert packed.config.keep_nvfp4 and not plain.config.keep_nvfp4
    linears, experts = _packed_layers(packed)
    stored = load_file(str(target / "model.safetensors"))
    quantized_names = [k for k in stored if stored[k].dtype == torch.uint8]
    per_expert = sum(".experts." in k for k in quantized_names)
    assert linears + per_expert == len(quantized_names) and linears > 0
    assert experts == sum(isinstance(m, Experts) for m in plain.modules()) and _packed_layers(plain) == (0, 0)
    assert experts > 0 or family == "qwen3"
    kind = nvfp4.CT if fmt == "ct" else nvfp4.MODELOPT_NVFP4
    assert {m.nvfp4_kind for m in packed.modules() if isinstance(m, nvfp4.Nvfp4Linear)} == {kind}
    assert torch.equal(_logits(packed), _logits(plain))
    fuse_projections(packed, query=True)
    fuse_projections(plain, query=True)
    joined = [m for name, m in packed.named_modules() if name.endswith((".qkv_proj", ".gate_up_proj"))]
    assert joined and all(isinstance(m, nvfp4.Nvfp4Linear) for m in joined)
    assert torch.equal(_logits(packed), _logits(plain))


def test_the_dequantized_weights_of_packed_layers_are_the_loaders(quantized):
    """Each Nvfp4Linear's matrix (and each expert's) dequantized as its forward does (read from
    its tables) equals the weight loaded dequantized, value for value."""
    target = quantized("qwen3_moe", "modelopt")
    plain = TargetModel.from_pretrained(target, torch.bfloat16, nvfp4="dequantize").state_dict()
    packed = TargetModel.from_pretrained(target, torch.bfloat16, nvfp4="packed")
    checked = 0
    for name, m in packed.named_modules():
        if isinstance(m, nvfp4.Nvfp4Linear):
            w = nvfp4.lookup_pairs(m.weight, m.weight_scale, m.table, m.row_table)
            assert m.table.dtype == torch.bfloat16 and torch.equal(w, plain[name + ".weight"]), name
            checked += 1
        elif isinstance(m, Experts):
            for attr in ("gate_up_proj", "down_proj"):
                w = nvfp4.lookup(getattr(m, attr), getattr(m, attr + "_scale"), getattr(m, attr + "_table"),
                                 getattr(m, attr + "_rows"))
                assert torch.equal(w, plain[f"{name}.{attr}"]), name
                checked += 1
    assert checked == 6 * 4 + 6 * 2  # (q, k, v, o; the experts)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_a_packed_hybrid_nemotron_gives_the_dequantized_model_bit_for_bit(nemotron, dtype):  # noqa: F811
    """Nemotron-H (ModelOpt, NVIDIA's backbone. layout): per-expert NVFP4 matrices stacked
    packed (non-gated relu2 experts), Mamba-2 and attention projections Nvfp4Linear."""
    _, target, _ = nemotron
    plain = TargetModel.from_pretrained(target, dtype, nvfp4="dequantize")
    packed = TargetModel.from_pretrained(target, dtype, nvfp4="packed")
    linears, experts = _packed_layers(packed)
    assert linears > 0 and experts > 0
    assert torch.equal(_logits(packed), _logits(plain))


@pytest.fixture(scope="module")
def ct_pair(tmp_path_factory, tokenizer_dir):
    """(compressed-tensors NVFP4 Qwen3 target with a tokenizer, random drafter)."""
    root = tmp_path_factory.mktemp("ct-pair")
    src = make_target(root / "src", "qwen3", seed=2, tokenizer=False, tie_word_embeddings=False)
    target = to_ct_nvfp4(src, root / "target")
    copy_tokenizer(tokenizer_dir, target)
    return target, save_drafter(root / "drafter", drafter_config(target, block_size=8), seed=2)


def test_speculative_decoding_on_a_packed_target_equals_target_only(ct_pair):
    from dflash_torch import DFlashEngine

    target, drafter = ct_pair
    prompts = ["def f(x):", "import os\n"]
    packed = DFlashEngine.from_pretrained(target, drafter, dtype="float32", nvfp4="packed")
    assert packed.target.config.keep_nvfp4
    plain = DFlashEngine.from_pretrained(target, None, dtype="float32", no_draft=True, nvfp4="dequantize")
    refs = [plain.generate(p, max_new_tokens=24, ignore_eos=True).token_ids for p in prompts]
    for prompt, ref in zip(prompts, refs):
        assert packed.generate(prompt, max_new_tokens=24, ignore_eos=True).token_ids == ref
    batch = DFlashEngine(packed.target, packed.tokenizer, packed.drafter, max_batch_size=2, max_context=128)
    assert [o.token_ids for o in batch.generate_batch(prompts, max_new_tokens=24, ignore_eos=True)] == refs


def test_speculative_decoding_on_a_packed_moe_target_equals_target_only(quantized, tokenizer_dir, tmp_path):
    """ModelOpt MoE (only the chosen experts dequantized each forward): float32 == target-only;
    bfloat16 (where verifying a block rounds otherwise than one token at a time) == the same
    speculative decoding on the dequantized target, token for token."""
    from dflash_torch import DFlashEngine

    target = edited_checkpoint(quantized("qwen3_moe", "modelopt"), tmp_path / "target")
    copy_tokenizer(tokenizer_dir, target)
    drafter = save_drafter(tmp_path / "drafter", drafter_config(target, block_size=8), seed=3)
    prompts = ["def f(x):", "import os\n"]
    for dtype in ("float32", "bfloat16"):
        packed = DFlashEngine.from_pretrained(target, drafter, dtype=dtype, nvfp4="packed")
        plain = DFlashEngine.from_pretrained(target, drafter, dtype=dtype, nvfp4="dequantize")
        if dtype == "float32":
            plain = DFlashEngine(plain.target, plain.tokenizer)  # (target-only)
        refs = [plain.generate(p, max_new_tokens=16, ignore_eos=True).token_ids for p in prompts]
        for prompt, ref in zip(prompts, refs):
            assert packed.generate(prompt, max_new_tokens=16, ignore_eos=True).token_ids == ref, dtype
        batches = [DFlashEngine(e.target, e.tokenizer, packed.drafter, max_batch_size=2, max_context=128)
                   for e in (packed, plain)]
        outs = [[o.token_ids for o in b.generate_batch(prompts, max_new_tokens=16, ignore_eos=True)] for b in batches]
        assert outs[0] == (refs if dtype == "float32" else outs[1]), dtype


@pytest.mark.parametrize("fmt", ["ct", "modelopt"])
def test_the_memory_check_counts_what_the_packed_layers_hold(quantized, fmt):
    """The saving the memory check subtracts is exactly the packed model's parameter bytes
    less the dequantized one's; the quantized matrices (in 64 columns here: the per-row float32
    scale adds 1/16 byte a weight) take at most (0.5 + 1/16 + 4/64) / 2 of their bfloat16 bytes
    (about a quarter: 0.28 for real widths)."""
    target = quantized("qwen3", fmt)
    dtype = torch.bfloat16
    plain = TargetModel.from_pretrained(target, dtype, nvfp4="dequantize")
    packed = TargetModel.from_pretrained(target, dtype, nvfp4="packed")
    saving = checkpoint.nvfp4_saving(target, dtype, plain.config.nvfp4)
    assert checkpoint.weight_bytes(plain, dtype) - checkpoint.weight_bytes(packed, dtype) == saving > 0
    params = dict(packed.named_parameters())
    held = sum(p.numel() * p.element_size() for m in packed.modules() if isinstance(m, nvfp4.Nvfp4Linear)
               for p in (m.weight, m.weight_scale, m.weight_scale_2))
    dense = sum(p.numel() * dtype.itemsize for k, p in plain.named_parameters()
                if k in params and params[k].dtype == torch.uint8)
    assert dense > 0 and held <= (0.5 + 1 / 16 + 4 / 64) / 2 * dense
    ratio = (0.5 + 1 / 16 + 4 / 4096) / 2  # (a 4096-column matrix)
    assert 0.28 < ratio < 0.285


def test_auto_keeps_packed_only_when_the_dequantized_weights_would_not_fit(quantized, monkeypatch):
    target = quantized("qwen3", "ct")
    plain = TargetModel.from_pretrained(target, torch.float32, nvfp4="dequantize")
    need = checkpoint.weight_bytes(plain, torch.float32)
    monkeypatch.setattr(checkpoint, "available_memory", lambda device: 10 * need)
    assert not TargetModel.from_pretrained(target, torch.float32).config.keep_nvfp4
    monkeypatch.setattr(checkpoint, "available_memory", lambda device: need)  # (90% of it is too little)
    assert TargetModel.from_pretrained(target, torch.float32).config.keep_nvfp4
    monkeypatch.setattr(checkpoint, "available_memory", lambda device: need // 8)  # (not even packed)
    with pytest.raises(DFlashError, match=r"\(NVFP4 weights kept packed\); cpu has"):
        TargetModel.from_pretrained(target, torch.float32)


def test_modelopt_mixed_precision_keeps_nvfp4_packed_and_dequantizes_fp8(tmp_path):
    """MIXED_PRECISION: the NVFP4 experts kept packed, the FP8 layers dequantized (in every
    mode); the logits those of the dequantized model."""
    from test_nvfp4 import modelopt_mixed

    mixed, _, rest, layers = modelopt_mixed(tmp_path)
    plain = TargetModel.from_pretrained(mixed, torch.bfloat16, nvfp4="dequantize")
    packed = TargetModel.from_pretrained(mixed, torch.bfloat16, nvfp4="packed")
    assert _packed_layers(packed) == (0, 6)
    assert packed.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert torch.equal(_logits(packed), _logits(plain))
    fp8_only = edited_checkpoint(rest, tmp_path / "fp8-mixed", config=lambda cfg: cfg["quantization_config"].update(
        quant_algo="MIXED_PRECISION", quantized_layers={k: v for k, v in layers.items() if ".experts." not in k}))
    with pytest.raises(OptionError, match="nvfp4 packed keeps NVFP4 weights packed, but the target checkpoint has "
                                          "none") as err:
        TargetModel.from_pretrained(fp8_only, torch.float32, nvfp4="packed")
    assert "\n" not in str(err.value)


def test_the_nvfp4_option_is_checked(quantized, ct_pair, tmp_path):
    from dflash_torch import DFlashEngine
    from test_packed_int import to_packed

    plain = make_target(tmp_path / "plain", "qwen3", tokenizer=False)
    w4a16 = to_packed(plain, tmp_path / "w4a16", 4, 16)
    fp8 = to_modelopt(plain, tmp_path / "fp8", algo="FP8")
    for target, why in ((plain, "its config.json declares no NVFP4 weights"), (w4a16, "declares no NVFP4"),
                        (fp8, "its weights are ModelOpt per-tensor FP8, dequantized when loading")):
        with pytest.raises(OptionError, match="nvfp4 packed keeps NVFP4 weights packed, but the target checkpoint "
                                              f"has none .*{why}") as err:
            TargetModel.from_pretrained(target, torch.float32, nvfp4="packed")
        assert "\n" not in str(err.value)
    with pytest.raises(OptionError, match="but the target checkpoint has none"):
        DFlashEngine.from_pretrained(plain, None, no_draft=True, nvfp4="packed")
    with pytest.raises(OptionError, match="nvfp4 must be one of auto, dequantize, packed, got 'unpacked'"):
        DFlashEngine.from_pretrained(*ct_pair, nvfp4="unpacked")
    assert TargetModel.from_pretrained(fp8, torch.float32, nvfp4="auto").config.nvfp4 == "modelopt-fp8"


def test_the_cli_passes_nvfp4(monkeypatch, ct_pair):
    from dflash_torch import cli, engine

    seen = {}
    monkeypatch.setattr(engine.DFlashEngine, "from_pretrained", classmethod(lambda cls, *a, **kw: seen.update(kw)))
    for flags, mode in (([], "auto"), (["--nvfp4", "packed"], "packed")):
        cli.load_engine(cli.build_parser().parse_args(["generate", "--target", str(ct_pair[0]), "--no-draft", *flags,
                                                       "hello"]))
        assert seen["nvfp4"] == mode
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "--nvfp4", "unpacked", "hello"])


def test_a_packed_weight_overflowing_the_dtype_is_refused_in_one_line(quantized, tmp_path):
    """A tiny weight_global_scale: the dequantized weight is infinite, refused in every mode."""
    name = "model.layers.1.self_attn.k_proj."
    target = edited_checkpoint(quantized("qwen3", "ct"), tmp_path / "huge", state=lambda w: w.__setitem__(
        name + "weight_global_scale", torch.tensor([1e-38])))
    with pytest.raises(DFlashError, match=f"NVFP4 weight {name}weight_packed times its scales is not finite in "
                                          "bfloat16") as err:
        TargetModel.from_pretrained(target, torch.bfloat16, nvfp4="packed")
    assert "\n" not in str(err.value)
    with pytest.raises(DFlashError, match="holds NaN or infinite values"):
        TargetModel.from_pretrained(target, torch.bfloat16, nvfp4="dequantize")


def test_a_quantized_lm_head_is_dequantized_when_the_decoder_stays_packed(quantized, tmp_path):
    """The head, which drafters read too, is dequantized; the logits those of the dequantized model."""
    from test_nvfp4 import modelopt_compress

    def quantize_head(state):
        w = state.pop("lm_head.weight")
        state.update({"lm_head." + k: v for k, v in modelopt_compress(w.float()).items()})

    head = edited_checkpoint(quantized("qwen3", "modelopt"), tmp_path / "head", state=quantize_head)
    plain = TargetModel.from_pretrained(head, torch.bfloat16, nvfp4="dequantize")
    packed = TargetModel.from_pretrained(head, torch.bfloat16, nvfp4="packed")
    assert type(packed.lm_head) is torch.nn.Linear and packed.lm_head.weight.dtype == torch.bfloat16
    assert isinstance(packed.model.layers[0].self_attn.q_proj, nvfp4.Nvfp4Linear)
    assert torch.equal(_logits(packed), _logits(plain))


@pytest.mark.parametrize("kind", [nvfp4.CT, nvfp4.MODELOPT_NVFP4])
def test_a_compiled_nvfp4_linear_equals_the_eager_one(kind):
    """An opaque custom op: the compiled graph runs the eager arithmetic, bit for bit."""
    layer = nvfp4.Nvfp4Linear.like(torch.nn.Linear(64, 48, bias=True), kind).to_empty(device="cpu")
    g = torch.Generator().manual_seed(kind)
    with torch.no_grad():
        layer.weight.copy_(torch.randint(0, 256, layer.weight.shape, generator=g, dtype=torch.uint8))
        layer.weight_scale.copy_((torch.rand(layer.weight_scale.shape, generator=g) / 8).to(nvfp4.FP8))
        layer.weight_scale_2.copy_(torch.rand(48, generator=g) + 0.5)
        layer.bias.copy_(torch.randn(48, generator=g))
    layer.bias.data = layer.bias.data.to(torch.bfloat16)
    layer.build_tables(torch.bfloat16)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    compiled = torch.compile(layer, backend="inductor", fullgraph=True)
    assert torch.equal(compiled(x), layer(x))


@pytest.mark.parametrize("tokens", [1, 6])
def test_gathered_dispatch_of_nvfp4_experts_equals_the_sparse_one(quantized, tokens):
    """The dispatch CUDA graphs capture (every pair gathers its expert) == the sparse one."""
    model = TargetModel.from_pretrained(quantized("qwen3_moe", "ct"), torch.float32, nvfp4="packed")
    check_gathered_dispatch(model, tokens)


def test_joined_scales_split_exactly():
    scale = torch.rand(3, 5, 4).to(nvfp4.FP8)
    rows = torch.rand(3, 5) * 1e-30
    joined = nvfp4.joined_scales(scale, rows)
    assert joined.dtype == torch.uint8 and joined.shape == (3, 5, 8)
    s, r = nvfp4.split_scales(joined)
    assert torch.equal(s.view(torch.uint8), scale.view(torch.uint8)) and torch.equal(r, rows)


@pytest.mark.parametrize("family", ["laguna", "minimax_m2", "deepseek_v3"])
def test_other_families_packed_give_the_dequantized_model_bit_for_bit(tmp_path, family):
    """Each family's layout (per-expert w1 / w2 / w3, MLA's projections: kv_b_proj, read per
    head, is dequantized when loading) kept packed: the dequantized model's logits, bfloat16."""
    from test_nvfp4 import _family_target

    target = to_modelopt(_family_target(tmp_path, family), tmp_path / "mo")
    plain = TargetModel.from_pretrained(target, torch.bfloat16, nvfp4="dequantize")
    packed = TargetModel.from_pretrained(target, torch.bfloat16, nvfp4="packed")
    linears, experts = _packed_layers(packed)
    assert linears > 0 and experts > 0
    assert torch.equal(_logits(packed), _logits(plain))


# every float8_e4m3fn byte the loader takes as a group scale (it refuses the NaN bytes 0x7F and
# 0xFF and the negative ones): zero, the subnormals 0x01-0x07, the normals up to 448 (0x7E), and
# the negative zero 0x80
SCALE_BYTES = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F and b <= 0x80], dtype=torch.uint8)
# per-tensor scales: typical ones, 1, and ones whose products are subnormal (CT: 1e36 divides;
# ModelOpt: 1e-36 multiplies) or large; all products finite in float32 and bfloat16, as the
# loader's finiteness check requires
TABLE_SCALES = {nvfp4.CT: [1.0, 2688 / 0.37, 3.0, 7e-3, 1e36],
                nvfp4.MODELOPT_NVFP4: [1.0, 0.37 / 2688, 1 / 3, 1e-36, 1e30]}


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("kind", [nvfp4.CT, nvfp4.MODELOPT_NVFP4], ids=["ct", "modelopt"])
def test_the_tables_give_the_loaders_values_for_every_scale_byte_and_nibble(kind, dtype):
    """A matrix holding every (group-scale byte the loader takes, packed byte) pair, so every (byte,
    nibble) pair, under each of several per-tensor scales, its rows shuffled so the tables
    (one per distinct scale) interleave: read from its tables (:func:`nvfp4.lookup`, and by
    byte pairs, :func:`nvfp4.lookup_pairs`) it is what the loader dequantizes (dequantize_ct /
    dequantize_modelopt, a matrix per scale), bit for bit."""
    scales = torch.tensor(TABLE_SCALES[kind], dtype=torch.float32)
    n, b = scales.numel(), SCALE_BYTES.numel()
    packed = torch.arange(256, dtype=torch.uint8).expand(n, b, 256).contiguous()  # each row: bytes 0..255
    scale = SCALE_BYTES.view(nvfp4.FP8)[None, :, None].expand(n, b, 32).contiguous()
    loader = nvfp4.dequantize_ct if kind == nvfp4.CT else nvfp4.dequantize_modelopt
    want = loader(packed, scale, scales, dtype).view(n * b, 512)
    assert torch.isfinite(want).all() and (want != 0).any() and (want.abs() < torch.finfo(dtype).tiny).any()
    order = torch.randperm(n * b, generator=torch.Generator().manual_seed(kind))
    rows_scale = nvfp4.check_parts(packed, scale, scales, "p", "s", "g")
    table, rows = nvfp4.tables(rows_scale[order], kind, dtype)
    assert table.shape == (n, 4096) and table.dtype == dtype and rows.dtype == torch.int32
    packed, scale = packed.view(n * b, 256)[order], scale.view(n * b, 32)[order]
    bits = torch.int32 if dtype == torch.float32 else torch.int16  # (compared as bits: -0.0 is not 0.0)
    assert torch.equal(nvfp4.lookup(packed, scale, table, rows).view(bits), want[order].view(bits))
    pairs = nvfp4.pair_tables(table)
    assert pairs.shape == (n, 65536, 2) and pairs.dtype == dtype
    assert torch.equal(nvfp4.lookup_pairs(packed, scale, pairs, rows).view(bits), want[order].view(bits))


def test_an_nvfp4_linear_runs_only_on_tables_of_its_dtype():
    layer = nvfp4.Nvfp4Linear.like(torch.nn.Linear(32, 16, bias=False), nvfp4.CT).to_empty(device="cpu")
    with torch.no_grad():
        layer.weight.zero_()
        layer.weight_scale.copy_(torch.ones(16, 2).to(nvfp4.FP8))
        layer.weight_scale_2.fill_(2.0)
    with pytest.raises(DFlashError, match="no tables"):
        layer(torch.zeros(1, 32))
    layer.build_tables(torch.bfloat16)
    with pytest.raises(DFlashError, match="tables in torch.bfloat16"):
        layer(torch.zeros(1, 32))
    assert torch.equal(layer(torch.zeros(1, 32, dtype=torch.bfloat16)), torch.zeros(1, 16, dtype=torch.bfloat16))
    joined = nvfp4.Nvfp4Linear.joined([layer, layer])
    assert joined.table.shape == (1, 65536, 2) and torch.equal(joined.row_table, torch.zeros(32, dtype=torch.int32))
