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
"""

from __future__ import annotations

import math

import torch

from ..errors import DFlashError

FORMAT = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
STATIC_SCALES = ("input_scale", "activation_scale")  # per-tensor activation scales of a static scheme
_ELEMENTS_PER_CHUNK = 1 << 24  # float32 temporaries of at most 64 MB


def check_config(quant: dict, what: str = "target") -> tuple[int, int]:
    """The block ``(bo, bi)`` of a ``quant_method: "fp8"`` ``quantization_config`` that
    :func:`dequantize` reads exactly.

    Raises:
        DFlashError: one line, for what cannot be run exactly: ``activation_scheme`` other
            than ``"dynamic"`` (static activation scales), ``fmt`` other than ``"e4m3"``, a
            ``weight_block_size`` that is not two integers >= 1 (e.g. null: one scale per
            tensor), ``scale_fmt`` other than ``"float"`` (e.g. ``"ue8m0"``), or FP8
            embeddings (``modules_to_convert``).
    """
    where = f"the {what} checkpoint's FP8 quantization_config"
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise DFlashError(f"{where} has activation_scheme {scheme!r}; dflash-torch reads only 'dynamic' "
                          "(weights dequantized when loading, activations unquantized)")
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise DFlashError(f"{where} has fmt {fmt!r}; dflash-torch reads only 'e4m3' (float8_e4m3fn weights)")
    block = quant.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
        raise DFlashError(f"{where} has weight_block_size {block!r}; dflash-torch reads only block-wise scales "
                          "(two integers, e.g. [128, 128])")
    scale_fmt = quant.get("scale_fmt") or "float"
    if scale_fmt != "float":
        raise DFlashError(f"{where} has scale_fmt {scale_fmt!r}; dflash-torch reads only float scales")
    if quant.get("modules_to_convert"):
        raise DFlashError(f"{where} has modules_to_convert (FP8 embeddings); dflash-torch reads only FP8 linear weights")
    return block[0], block[1]


def scale_shape(weight_shape: torch.Size | tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The shape of the scales of a weight ``[..., out, in]``: ``[..., ceil(out / bo), ceil(in / bi)]``."""
    *lead, rows, cols = weight_shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
               name: str = "weight") -> torch.Tensor:
    """The matrix that an FP8 ``weight`` and its block scales encode, in ``dtype``.

    Each element (exact in float32) times its block's scale (float32; a bfloat16 or
    float16 scale is widened exactly), in float32, rounded once to ``dtype``: transformers'
    ``Fp8Dequantize`` arithmetic, so the values are equal to those it loads. Works a few
    block rows at a time (float32 temporaries of at most 64 MB).

    Args:
        weight: ``float8_e4m3fn`` ``[..., out, in]`` (at least 2 dimensions).
        scale_inv: floating point ``[..., ceil(out / bo), ceil(in / bi)]``, finite.
        block: ``(bo, bi)``, the ``weight_block_size`` of the checkpoint's config.
        dtype: float32, bfloat16 or float16.
        name: the weight's name, for errors.

    Returns:
        ``[..., out, in]`` in ``dtype``, on the device of ``weight``.

    Raises:
        DFlashError: a weight that is not ``float8_e4m3fn`` or has fewer than 2 dimensions, a
            scale that is not floating point (or is itself FP8), of another shape, or not
            finite (NaN, inf).
    """
    check_pair(weight, scale_inv, block, name)
    *lead, rows, cols = weight.shape
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    w, s, o = weight.reshape(-1, rows, cols), scale_inv.to(weight.device).reshape(-1, *scale_inv.shape[-2:]), out.view(-1, rows, cols)
    step = block[0] * max(1, _ELEMENTS_PER_CHUNK // (block[0] * cols))  # whole block rows
    for m in range(w.shape[0]):
        for r in range(0, rows, step):
            stop = min(rows, r + step)
            # the scale of each row (its block row's) and column (its block column's)
            scale = s[m, r // block[0]: math.ceil(stop / block[0])].float()
            scale = scale.repeat_interleave(block[0], dim=0)[: stop - r].repeat_interleave(block[1], dim=1)[:, :cols]
            o[m, r:stop] = (w[m, r:stop].float() * scale).to(dtype)
    return out


def check_pair(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str) -> None:
    """Raise :class:`DFlashError` unless ``weight`` and ``scale_inv`` are what
    :func:`dequantize` reads (see there)."""
    if weight.dtype != FORMAT:
        raise DFlashError(f"FP8 weight {name} has dtype {str(weight.dtype).removeprefix('torch.')}; "
                          "the config's fmt e4m3 means float8_e4m3fn")
    if weight.dim() < 2:
        raise DFlashError(f"FP8 weight {name} has shape {tuple(weight.shape)}; block scales need a matrix")
    if not scale_inv.is_floating_point() or scale_inv.element_size() < 2:
        raise DFlashError(f"FP8 scale {name}{SCALE_SUFFIX} has dtype {str(scale_inv.dtype).removeprefix('torch.')}; "
                          "expected float32 or bfloat16")
    expected = scale_shape(weight.shape, block)
    if tuple(scale_inv.shape) != expected:
        raise DFlashError(f"FP8 scale {name}{SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}; weight "
                          f"{tuple(weight.shape)} in blocks of {list(block)} needs {expected}")
    if not bool(torch.isfinite(scale_inv).all()):
        raise DFlashError(f"FP8 scale {name}{SCALE_SUFFIX} holds NaN or infinite values (a corrupt checkpoint)")
