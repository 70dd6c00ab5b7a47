"""MXFP4 weights (the OCP Microscaling format's FP4 E2M1 elements with one shared power-of-two
scale per block of 32; the format gpt-oss checkpoints store their expert matrices in).

A checkpoint stores a matrix ``[..., rows, cols]`` as two uint8 tensors:
``NAME_blocks`` ``[..., rows, cols / 32, 16]``, each byte two 4-bit elements (the low
nibble first), and ``NAME_scales`` ``[..., rows, cols / 32]``, the biased exponent ``s`` of
each block (value ``2 ** (s - 127)``). A 4-bit element is a sign bit and an E2M1 magnitude:
0, 0.5, 1, 1.5, 2, 3, 4 or 6. Every element times its scale is exact in bfloat16 and
float32, so dequantizing loses nothing (OCP Microscaling Formats (MX) v1.0 specification;
the layout of the gpt-oss checkpoints as transformers' ``integrations/mxfp4.py`` reads it).

DeepSeek-V4-Flash stores its routed experts in the same numbers, another layout (its FP8
checkpoint's ``expert_dtype: "fp4"``; transformers' ``Fp8Dequantize`` and ``FP8Experts``
read it): ``X.weight`` int8 ``[..., rows, cols / 2]``, the row's elements two a byte, the low
nibble first, and ``X.scale`` ``float8_e8m0fnu`` ``[..., rows, cols / 32]``, one power of two
per 32 elements of a row. That is this module's layout with the 16 bytes of each block side
by side (:func:`fp4_as_blocks` views one as the other); :func:`dequantize_fp4` dequantizes it
with transformers' arithmetic (float32 product, rounded once).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..errors import DFlashError

BLOCK = 32  # elements per shared scale
_ROWS_PER_CHUNK = 4096  # matrix rows dequantized at once


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, name: str = "weight") -> torch.Tensor:
    """The matrix that ``blocks`` and ``scales`` encode, in ``dtype``.

    Args:
        blocks: uint8 ``[..., rows, G, 16]`` (``G = cols / 32`` blocks per row, two elements a byte).
        scales: uint8 ``[..., rows, G]``, biased power-of-two exponents (127 means 1).
        dtype: float32, bfloat16 or float16 (float16 cannot hold every scale: too large or
            small a block becomes inf or 0, which the loader's finiteness check reports).
        name: the weight's name, for errors.

    Returns:
        ``[..., rows, G * 32]`` in ``dtype``, on the device of ``blocks``.

    Raises:
        DFlashError: a tensor that is not uint8, or shapes that do not match (``blocks``
            with fewer than 3 dimensions).
    """
    _check_layout(blocks, scales, name)
    out = torch.empty(*scales.shape[:-1], scales.shape[-1] * BLOCK, dtype=dtype, device=blocks.device)
    pairs = _byte_values(dtype, blocks.device)
    flat_blocks, flat_scales, flat_out = blocks.flatten(0, -3), scales.flatten(0, -2), out.flatten(0, -2)
    for i in range(0, flat_blocks.shape[0], _ROWS_PER_CHUNK):  # bounded temporaries
        b, s = flat_blocks[i:i + _ROWS_PER_CHUNK], flat_scales[i:i + _ROWS_PER_CHUNK]
        values = F.embedding(b.int(), pairs).flatten(-2)  # [rows, G, 32], low nibble first
        scale = torch.exp2(s.float() - 127).to(dtype)  # a power of two: exact in every float dtype's range
        flat_out[i:i + _ROWS_PER_CHUNK] = (values * scale[..., None]).flatten(-2)
    return out


@functools.lru_cache(maxsize=None)
def _byte_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[256, 2]``: the two E2M1 elements of each byte value, the low nibble's first (0,
    0.5, 1, 1.5, 2, 3, 4, 6 for codes 0-7, the same negated for 8-15). Built once per dtype
    and device: the first, eager forward builds it, so a CUDA graph capture of packed
    experts only reads it (a capture may not copy from the host)."""
    table = torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0),
                         dtype=dtype, device=device)
    byte = torch.arange(256, device=device)
    return torch.stack([table[byte & 0x0F], table[byte >> 4]], dim=-1)


def _check_layout(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> None:
    """Raise :class:`DFlashError` unless ``blocks`` and ``scales`` are uint8 ``[..., rows, G, 16]`` and ``[..., rows, G]``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise DFlashError(f"MXFP4 weight {name}: blocks and scales must be uint8, got "
                          f"{str(blocks.dtype).removeprefix('torch.')} and {str(scales.dtype).removeprefix('torch.')}")
    if blocks.dim() < 3 or blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise DFlashError(f"MXFP4 weight {name}: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not "
                          f"match (expected [..., rows, G, {BLOCK // 2}] and [..., rows, G])")


def check_fp4_pair(weight: torch.Tensor, scale: torch.Tensor, name: str = "weight",
                   scale_name: str | None = None) -> None:
    """Raise :class:`DFlashError` (one line naming the weight) unless ``weight`` and ``scale`` are
    a DeepSeek-V4 FP4 pair :func:`dequantize_fp4` reads: an int8 (or uint8) weight
    ``[..., rows, cols / 2]`` with at least 2 dimensions, a ``float8_e8m0fnu`` (or ``uint8``)
    scale ``[..., rows, cols / 32]``, finite in float32 and bfloat16 (:func:`check_finite`)."""
    from .fp8 import E8M0

    scale_name = scale_name or name + "_scale_inv"
    if weight.dtype not in (torch.int8, torch.uint8) or weight.dim() < 2:
        raise DFlashError(f"FP4 weight {name} is {str(weight.dtype).removeprefix('torch.')} {tuple(weight.shape)}, "
                          "expected int8 [..., rows, cols / 2] (two FP4 elements a byte)")
    if scale.dtype not in (E8M0, torch.uint8):
        raise DFlashError(f"FP4 scale {scale_name} has dtype {str(scale.dtype).removeprefix('torch.')}; FP4 experts "
                          "read only float8_e8m0fnu scales (one power of two per 32 elements)")
    cols = 2 * weight.shape[-1]
    want = (*weight.shape[:-1], cols // BLOCK)
    if cols % BLOCK or tuple(scale.shape) != want:
        raise DFlashError(f"FP4 scale {scale_name} has shape {tuple(scale.shape)}; weight {name} "
                          f"{tuple(weight.shape)} ({cols} columns) in groups of {BLOCK} needs "
                          f"{want if cols % BLOCK == 0 else 'a multiple of 32 columns'}")
    check_finite(*fp4_as_blocks(weight, scale), name)


def fp4_as_blocks(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A DeepSeek-V4 FP4 pair (int8 ``[..., rows, cols / 2]``, e8m0 ``[..., rows, cols / 32]``)
    as this module's uint8 ``blocks`` ``[..., rows, cols / 32, 16]`` and ``scales``
    ``[..., rows, cols / 32]``: views of the same bytes (the same elements in the same order)."""
    return weight.view(torch.uint8).unflatten(-1, (-1, BLOCK // 2)), scale.view(torch.uint8)


def dequantize_fp4(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The matrix a checked DeepSeek-V4 FP4 pair (:func:`check_fp4_pair`) encodes, in ``dtype``:
    :func:`dequantize` of :func:`fp4_as_blocks` of the pair (each element, its E2M1 value with
    the low nibble first, times its group's power of two). That is what transformers'
    ``Fp8Dequantize`` computes (the product in float32, rounded once to ``dtype``): in float32
    and bfloat16, the dtypes the engine runs in, every product is exact.

    Returns:
        ``[..., rows, cols]`` in ``dtype``, on ``weight``'s device.
    """
    return dequantize(*fp4_as_blocks(weight, scale), dtype)


def dequantize_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Replace every ``NAME_blocks`` / ``NAME_scales`` pair of ``state`` by ``NAME``, the
    dequantized matrix in ``dtype`` (:func:`dequantize`), one pair at a time (in place).

    Returns:
        ``state``.

    Raises:
        DFlashError: a ``_blocks`` tensor without its ``_scales`` or the other way round,
            a pair whose ``NAME`` is in ``state`` too (the matrix stored twice), or a pair
            :func:`dequantize` refuses.
    """
    names = {k.removesuffix("_blocks") for k in state if k.endswith("_blocks")}
    names |= {k.removesuffix("_scales") for k in state if k.endswith("_scales")}
    for name in sorted(names):
        if f"{name}_blocks" not in state or f"{name}_scales" not in state:
            half = "_scales" if f"{name}_blocks" in state else "_blocks"
            raise DFlashError(f"MXFP4 weight {name} lacks its {name}{half} tensor")
        if name in state:
            raise DFlashError(f"weight {name} is stored twice, unquantized and as MXFP4 {name}_blocks / _scales")
        state[name] = dequantize(state.pop(f"{name}_blocks"), state.pop(f"{name}_scales"), dtype, name)
    return state


def check_finite(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> None:
    """Refuse a pair whose values are not all finite in float32 and bfloat16 (the dtypes
    the experts run in): a scale of 255, which the MX format reserves for NaN, or a scale
    of 254 (2 ** 127) on a block holding an element of magnitude 2 or more (its value
    exceeds both dtypes' largest, just under 2 ** 128). Either means a corrupt checkpoint;
    dequantized, such blocks hold NaN or infinite values, which the loader refuses.

    Raises:
        DFlashError: naming the weight; or a pair :func:`dequantize` refuses.
    """
    _check_layout(blocks, scales, name)
    if bool((scales == 255).any()):
        raise DFlashError(f"MXFP4 weight {name} has scale 255 (NaN in the MX format): a corrupt checkpoint")
    top = blocks[scales == 254]  # [n, 16]: the bytes of the blocks scaled by 2 ** 127
    if bool((top & 0x44).any()):  # bit 2 of either nibble: an E2M1 magnitude of 2, 3, 4 or 6
        raise DFlashError(f"MXFP4 weight {name} has scale 254 on a block with elements of magnitude 2 or more "
                          "(infinite in float32 and bfloat16): a corrupt checkpoint")
