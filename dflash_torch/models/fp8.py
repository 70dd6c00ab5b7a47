"""Fine-grained FP8 weights (``quantization_config.quant_method: "fp8"``: the format of the
official Qwen ``*-FP8`` checkpoints, e.g. Qwen3-8B-FP8, Qwen3-Coder-30B-A3B-Instruct-FP8,
Qwen3-Next-80B-A3B-Instruct-FP8, Qwen3.5 / 3.6 ``*-FP8``).

A quantized linear ``X`` stores ``X.weight`` in ``float8_e4m3fn`` ``[..., out, in]`` and
``X.weight_scale_inv`` (float32 or bfloat16) ``[..., ceil(out / bo), ceil(in / bi)]``,
one scale per block of ``weight_block_size = [bo, bi]`` elements (the blocks at the bottom
and right edges are partial when ``out`` or ``in`` is not a multiple); the real weight is
each element times its block's scale. Embeddings, norms, the lm_head and the modules the
config lists in ``modules_to_not_convert`` are stored unquantized and load as they are.

Loading dequantizes each pair once, tensor by tensor as the checkpoint is read
(:func:`dequantize`), with transformers' arithmetic (its ``Fp8Dequantize``, which it uses
to load such checkpoints without a GPU): the product is taken in float32 and rounded once
to the dtype the model runs in. Unlike it, the block is ``weight_block_size`` (partial edge
blocks included), not the weight's shape divided by the scale grid's.

Or the weights stay FP8 (``--fp8 packed``: about half of bfloat16's memory): each pair is
held as the e4m3 weight and its *row scales* ``X.weight_scale`` (float32
``[..., out, ceil(in / bi)]``: every row's block scales, :func:`row_scales`; rows, unlike
blocks, can be split and joined like the weight's, e.g. to stack experts or fuse
projections), and each forward dequantizes what it runs (:func:`dequantize_rows`: the same
float32 product rounded once, so the same values as when loading): every
:class:`Fp8Linear` its matrix, a mixture of experts only the experts some token chose.

DeepSeek-V4's published checkpoints (DeepSeek-V4-Flash) use the same format with two
differences: ``scale_fmt: "ue8m0"``, each block scale a power of two stored in one byte
(``float8_e8m0fnu``, value ``2 ** (byte - 127)``; transformers also reads such scales stored
as ``uint8``), and the scale of ``X.weight`` named ``X.scale`` (transformers' FP8 loader
renames ``X.scale`` to ``X.weight_scale_inv``; vLLM's DeepSeek-V4 weight mapper does too).
An e8m0 scale widens to float32 exactly, so the arithmetic above is unchanged. Their routed
experts are FP4 (``expert_dtype: "fp4"``, top level in ``config.json`` or in the
``quantization_config``; :mod:`.mxfp4`'s :func:`~.mxfp4.dequantize_fp4`); DeepSeek-V4-Flash-Base's
(``expert_dtype: "fp8"``) are FP8 like its linears.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import DFlashError

FORMAT = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
ROW_SCALE_SUFFIX = "_scale"  # held packed: X.weight -> X.weight_scale (row scales, float32)
SCALE_FORMATS = ("float", "ue8m0")  # scale_fmt: float32 / bfloat16 scales, or one-byte powers of two (DeepSeek-V4)
E8M0 = getattr(torch, "float8_e8m0fnu", None)  # (the dtype of ue8m0 scales; torch >= 2.7)
EXPERT_FORMATS = ("fp8", "fp4")  # expert_dtype: the routed experts' format in a DeepSeek-V4 FP8 checkpoint
STATIC_SCALES = ("input_scale", "activation_scale")  # per-tensor activation scales of a static scheme
_ELEMENTS_PER_CHUNK = 1 << 24  # float32 temporaries of at most 64 MB


def check_config(quant: dict, what: str = "target") -> tuple[int, int]:
    """The block ``(bo, bi)`` of a ``quant_method: "fp8"`` ``quantization_config`` that
    :func:`dequantize` reads exactly.

    Raises:
        DFlashError: one line, for what cannot be run exactly: ``activation_scheme`` other
            than ``"dynamic"`` (static activation scales), ``fmt`` other than ``"e4m3"`` (or
            ``"float8_e4m3fn"``), a
            ``weight_block_size`` that is not two integers >= 1 (e.g. null: one scale per
            tensor), ``scale_fmt`` other than ``"float"`` or ``"ue8m0"``, or FP8
            embeddings (``modules_to_convert``).
    """
    where = f"the {what} checkpoint's FP8 quantization_config"
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise DFlashError(f"{where} has activation_scheme {scheme!r}; dflash-torch reads only 'dynamic' "
                          "(weights dequantized when loading, activations unquantized)")
    fmt = quant.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):  # (MiniMax-M2's checkpoints spell it out)
        raise DFlashError(f"{where} has fmt {fmt!r}; dflash-torch reads only 'e4m3' / 'float8_e4m3fn' weights")
    block = quant.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
        raise DFlashError(f"{where} has weight_block_size {block!r}; dflash-torch reads only block-wise scales "
                          "(two integers, e.g. [128, 128])")
    scale_format(quant, what)
    if quant.get("modules_to_convert"):
        raise DFlashError(f"{where} has modules_to_convert (FP8 embeddings); dflash-torch reads only FP8 linear weights")
    return block[0], block[1]


def scale_format(quant: dict, what: str = "target") -> str:
    """The ``scale_fmt`` of an FP8 ``quantization_config``: ``"float"`` (absent or null: float32
    or bfloat16 scales) or ``"ue8m0"`` (one-byte powers of two, DeepSeek-V4).

    Raises:
        DFlashError: any other value.
    """
    scale_fmt = quant.get("scale_fmt") or "float"
    if scale_fmt not in SCALE_FORMATS:
        raise DFlashError(f"the {what} checkpoint's FP8 quantization_config has scale_fmt {scale_fmt!r}; dflash-torch "
                          "reads only 'float' and 'ue8m0' scales")
    return scale_fmt


def expert_format(cfg: dict, quant: dict, what: str = "target") -> str | None:
    """The ``expert_dtype`` an FP8 checkpoint declares for its routed experts (DeepSeek-V4:
    ``"fp4"``, DeepSeek-V4-Flash's FP4 experts, or ``"fp8"``), at the top level of
    ``config.json`` (``cfg``, as DeepSeek-V4-Flash publishes it) or in its
    ``quantization_config`` (``quant``, where transformers moves it); None when neither says.

    Raises:
        DFlashError: a value other than ``"fp4"`` / ``"fp8"``, or two places that disagree.
    """
    values = {where: d["expert_dtype"] for where, d in (("config.json", cfg), ("quantization_config", quant))
              if d.get("expert_dtype") is not None}
    for where, value in values.items():
        if value not in EXPERT_FORMATS:
            raise DFlashError(f"the {what} checkpoint's {where} has expert_dtype {value!r}; dflash-torch reads "
                              "'fp4' (FP4 experts with ue8m0 scales per 32) and 'fp8'")
    if len(set(values.values())) > 1:
        raise DFlashError(f"the {what} checkpoint's config.json has expert_dtype {values['config.json']!r} but its "
                          f"quantization_config {values['quantization_config']!r}")
    return next(iter(values.values()), None)


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """float32 values of block scales: a float32 / bfloat16 / float16 / ``float8_e8m0fnu``
    scale widened (exactly), a ``uint8`` one read as the e8m0 exponent ``2 ** (byte - 127)``
    (as transformers reads it). e8m0's 0xFF is NaN, a uint8 255 infinite."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def scale_shape(weight_shape: torch.Size | tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The shape of the scales of a weight ``[..., out, in]``: ``[..., ceil(out / bo), ceil(in / bi)]``."""
    *lead, rows, cols = weight_shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
               name: str = "weight", scale_fmt: str = "float", scale_name: str | None = None) -> torch.Tensor:
    """The matrix that an FP8 ``weight`` and its block scales encode, in ``dtype``.

    Each element (exact in float32) times its block's scale (float32; a bfloat16 or
    float16 scale is widened exactly), in float32, rounded once to ``dtype``: transformers'
    ``Fp8Dequantize`` arithmetic, so the values are equal to those it loads. Works a few
    block rows at a time (float32 temporaries of at most 64 MB).

    Args:
        weight: ``float8_e4m3fn`` ``[..., out, in]`` (at least 2 dimensions).
        scale_inv: ``[..., ceil(out / bo), ceil(in / bi)]``, finite, zero or positive (a
            zero scale makes its block zero): floating point
            (``scale_fmt`` ``"float"``), or ``float8_e8m0fnu`` / ``uint8`` (``"ue8m0"``,
            :func:`scale_values`).
        block: ``(bo, bi)``, the ``weight_block_size`` of the checkpoint's config.
        dtype: float32, bfloat16 or float16.
        name: the weight's name, for errors.
        scale_fmt: the config's ``scale_fmt`` (:func:`scale_format`).
        scale_name: the scale's name, for errors (default ``name + "_scale_inv"``).

    Returns:
        ``[..., out, in]`` in ``dtype``, on the device of ``weight``.

    Raises:
        DFlashError: a weight that is not ``float8_e4m3fn`` or has fewer than 2 dimensions, a
            scale of another dtype than ``scale_fmt`` says, of another shape, not finite
            (NaN, inf) or negative.
    """
    check_pair(weight, scale_inv, block, name, scale_fmt, scale_name)
    *lead, rows, cols = weight.shape
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    w, s, o = weight.reshape(-1, rows, cols), scale_inv.to(weight.device).reshape(-1, *scale_inv.shape[-2:]), out.view(-1, rows, cols)
    step = block[0] * max(1, _ELEMENTS_PER_CHUNK // (block[0] * cols))  # whole block rows
    for m in range(w.shape[0]):
        for r in range(0, rows, step):
            stop = min(rows, r + step)
            # the scale of each row (its block row's) and column (its block column's)
            scale = scale_values(s[m, r // block[0]: math.ceil(stop / block[0])])
            scale = scale.repeat_interleave(block[0], dim=0)[: stop - r].repeat_interleave(block[1], dim=1)[:, :cols]
            o[m, r:stop] = (w[m, r:stop].float() * scale).to(dtype)
    return out


def check_pair(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str,
               scale_fmt: str = "float", scale_name: str | None = None) -> None:
    """Raise :class:`DFlashError` unless ``weight`` and ``scale_inv`` are what
    :func:`dequantize` reads (see there)."""
    scale_name = scale_name or name + SCALE_SUFFIX
    if weight.dtype != FORMAT:
        raise DFlashError(f"FP8 weight {name} has dtype {str(weight.dtype).removeprefix('torch.')}; "
                          "the config's FP8 format (fmt) is float8_e4m3fn")
    if weight.dim() < 2:
        raise DFlashError(f"FP8 weight {name} has shape {tuple(weight.shape)}; block scales need a matrix")
    check_scale_dtype(scale_inv, scale_fmt, scale_name)
    expected = scale_shape(weight.shape, block)
    if tuple(scale_inv.shape) != expected:
        raise DFlashError(f"FP8 scale {scale_name} has shape {tuple(scale_inv.shape)}; weight "
                          f"{tuple(weight.shape)} in blocks of {list(block)} needs {expected}")
    check_scale_values(scale_values(scale_inv), f"FP8 scale {scale_name}", "block")


def check_scale_values(scales: torch.Tensor, label: str, kind: str) -> None:
    """Refuse floating-point ``scales`` that are not all finite and zero or positive, judged by
    two reductions (their least and greatest value; a NaN makes both NaN): much faster than an
    elementwise test, for the scales of every quantized weight a checkpoint holds (elementwise
    only to say what is wrong). ``label``: the tensor in words; ``kind``: the scales' kind.

    Raises:
        DFlashError: ``{label} holds NaN or infinite values`` / ``holds negative values``."""
    if not scales.numel():
        return
    low, high = torch.aminmax(scales)
    if bool((low >= 0) & (high < math.inf)):
        return
    if not bool(torch.isfinite(scales).all()):
        raise DFlashError(f"{label} holds NaN or infinite values (a corrupt checkpoint)")
    raise DFlashError(f"{label} holds negative values (a corrupt checkpoint: {kind} scales are zero or positive)")


def check_scale_dtype(scale: torch.Tensor, scale_fmt: str, scale_name: str) -> None:
    """Raise :class:`DFlashError` unless ``scale``'s dtype is one ``scale_fmt`` stores: float32,
    bfloat16 or float16 for ``"float"``; ``float8_e8m0fnu`` or ``uint8`` (its bytes) for ``"ue8m0"``."""
    dtype = str(scale.dtype).removeprefix("torch.")
    if scale_fmt == "ue8m0":
        if scale.dtype not in (E8M0, torch.uint8):
            raise DFlashError(f"FP8 scale {scale_name} has dtype {dtype}; the config's scale_fmt 'ue8m0' stores "
                              "float8_e8m0fnu (one-byte powers of two)")
    elif not scale.is_floating_point() or scale.element_size() < 2:
        raise DFlashError(f"FP8 scale {scale_name} has dtype {dtype}; expected float32 or bfloat16"
                          + (" (e8m0 scales need scale_fmt 'ue8m0' in the quantization_config)"
                             if scale.dtype in (E8M0, torch.uint8) else ""))


def check_finite_bytes(weight: torch.Tensor, name: str) -> None:
    """Raise :class:`DFlashError` when the ``float8_e4m3fn`` ``weight`` holds a NaN (its only
    non-finite values: the bytes 0x7F and 0xFF), e.g. a corrupt checkpoint."""
    if bool(((weight.view(torch.uint8) & 0x7F) == 0x7F).any()):
        raise DFlashError(f"FP8 weight {name} holds NaN values (a corrupt checkpoint)")


def check_finite_product(weight: torch.Tensor, scales: torch.Tensor, block_cols: int, dtype: torch.dtype,
                         name: str) -> None:
    """Raise :class:`DFlashError` unless every element of the FP8 ``weight`` times its row
    scale (:func:`dequantize_rows`) is finite in ``dtype``, as the dequantized weight must
    be: a finite but huge scale (e.g. 1e37) overflows. Checked a few rows at a time (float32
    temporaries of at most 64 MB)."""
    w, s = weight.reshape(-1, weight.shape[-1]), scales.reshape(-1, scales.shape[-1])
    step = max(1, _ELEMENTS_PER_CHUNK // max(1, w.shape[1]))
    for r in range(0, w.shape[0], step):
        if not bool(torch.isfinite(dequantize_rows(w[r:r + step], s[r:r + step], block_cols, dtype)).all()):
            raise DFlashError(f"FP8 weight {name} times its scales is not finite in "
                              f"{str(dtype).removeprefix('torch.')} (a corrupt checkpoint)")


def row_scales(scale_inv: torch.Tensor, block: tuple[int, int], rows: int) -> torch.Tensor:
    """The block scales ``[..., ceil(rows / bo), G]`` of a weight with ``rows`` rows as one
    scale row per weight row: float32 ``[..., rows, G]`` (each block row repeated ``bo``
    times, the last one cut to the rows it covers). Exact (a bfloat16 or e8m0 scale widens
    exactly, :func:`scale_values`)."""
    return scale_values(scale_inv).repeat_interleave(block[0], dim=-2)[..., :rows, :].contiguous()


def dequantize_rows(weight: torch.Tensor, scales: torch.Tensor, block_cols: int, dtype: torch.dtype) -> torch.Tensor:
    """The matrix that an FP8 ``weight`` and its row scales encode, in ``dtype``: each
    element times its block's scale in float32, rounded once (the values :func:`dequantize`
    gives for the same pair).

    Args:
        weight: ``float8_e4m3fn`` ``[..., rows, cols]``.
        scales: float32 ``[..., rows, ceil(cols / block_cols)]`` (:func:`row_scales`).
        block_cols: ``bi``, the columns of a block.
        dtype: the result's dtype.

    Returns:
        ``[..., rows, cols]`` in ``dtype``, on ``weight``'s device (with float32 temporaries
        of the whole matrix).
    """
    *lead, rows, cols = weight.shape
    groups = scales.shape[-1]
    # each byte's value from a table: on a CPU 4.5x faster than weight.float() (a 3072 x 1024
    # matrix: 3.1 against 13.9 ms on one core), the same values
    w = _byte_values(weight.device).index_select(0, weight.view(torch.uint8).reshape(-1).int()).view(weight.shape)
    if cols == groups * block_cols:  # whole blocks across: scale each group of columns
        return (w.view(*lead, rows, groups, block_cols) * scales[..., None]).view(weight.shape).to(dtype)
    return (w * scales.repeat_interleave(block_cols, dim=-1)[..., :cols]).to(dtype)


def kept_parameters(model: nn.Module) -> set[int]:
    """The ids of the parameters below ``model`` that stay FP8 with their row scales (those of
    modules with a nonzero ``fp8_block_cols``: :class:`Fp8Linear`, FP8 experts) or packed
    integers with their scales (a nonzero ``int_bits``: :class:`~.packed_int.IntLinear`,
    packed experts) or NVFP4 bytes with their scales (a nonzero ``nvfp4_kind``:
    :class:`~.nvfp4.Nvfp4Linear`, NVFP4 experts): what the loader does not cast to the model's dtype."""
    return {id(p) for m in model.modules() if getattr(m, "fp8_block_cols", 0) or getattr(m, "int_bits", 0)
            or getattr(m, "nvfp4_kind", 0)
            for name, p in m.named_parameters(recurse=False) if name != "bias"}


@functools.lru_cache(maxsize=None)
def _byte_values(device: torch.device) -> torch.Tensor:
    """float32 ``[256]``: the value of each ``float8_e4m3fn`` byte (NaN for 0x7F and 0xFF).
    Built once per device, by the first (eager) forward, so that a CUDA graph capture only
    reads it."""
    return torch.arange(256, dtype=torch.uint8, device=device).view(FORMAT).float()


class Fp8Linear(nn.Module):
    """A linear layer whose weight stays FP8: ``weight`` ``float8_e4m3fn`` ``[out, in]``,
    ``weight_scale`` float32 ``[out, ceil(in / fp8_block_cols)]`` (row scales), ``bias`` (in the
    model's dtype) or None. Each forward dequantizes the weight to the input's dtype
    (:func:`dequantize_rows`) and applies it: the output of an ``nn.Linear`` holding the
    dequantized weight, at about half of its memory (bfloat16) between forwards."""

    custom_op = True  # run by a torch.library custom operator (see TargetModel.from_pretrained)

    def __init__(self, in_features: int, out_features: int, bias: bool, fp8_block_cols: int):
        super().__init__()
        self.in_features, self.out_features, self.fp8_block_cols = in_features, out_features, fp8_block_cols
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FORMAT), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, math.ceil(in_features / fp8_block_cols)),
                                         requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    @classmethod
    def like(cls, linear: nn.Linear, fp8_block_cols: int) -> "Fp8Linear":
        """An (uninitialised, meta) :class:`Fp8Linear` of ``linear``'s shape, to load into."""
        with torch.device("meta"):
            return cls(linear.in_features, linear.out_features, linear.bias is not None, fp8_block_cols)

    @classmethod
    def joined(cls, parts: list["Fp8Linear"]) -> "Fp8Linear":
        """One layer whose output is the outputs of ``parts`` (same input width and block
        columns, all with a bias or all without) side by side: their weights and row scales
        stacked."""
        first = parts[0]
        out = cls.like(nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None,
                                 device="meta"), first.fp8_block_cols)
        with torch.no_grad():
            for name in ("weight", "weight_scale", "bias"):
                if getattr(first, name) is not None:
                    setattr(out, name, nn.Parameter(torch.cat([getattr(p, name) for p in parts]), requires_grad=False))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in]`` -> ``[..., out]`` in ``x.dtype``."""
        return fp8_linear(x, self.weight, self.weight_scale, self.fp8_block_cols, self.bias)


@torch.library.custom_op("dflash_torch::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, block_cols: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, dequantize_rows(weight, scales, block_cols, x.dtype), bias)``.

    A custom operator, so that ``torch.compile`` keeps it one opaque node that runs these
    eager kernels. Traced through (torch 2.13, CPU inductor), the compiled dequantization
    of matrices that end in partial blocks (``repeat_interleave`` of the scales, then a
    slice) gave wrong values, off by up to 1e35 against eager, and compiled decoding of
    such a target committed other tokens. No host read: CUDA graphs capture it.
    """
    return F.linear(x, dequantize_rows(weight, scales, block_cols, x.dtype), bias)


@fp8_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, block_cols: int,
      bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])
