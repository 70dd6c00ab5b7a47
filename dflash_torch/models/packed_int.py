"""Integer weights packed into int32 words: the ``pack-quantized`` format of
compressed-tensors (``quantization_config.quant_method: "compressed-tensors"``), in which
llm-compressor writes weight-only W4A16 / W8A16 checkpoints (e.g. RedHatAI's
``*-quantized.w4a16`` models, Kimi-K2.5's INT4 experts).

A quantized linear ``X`` stores:

* ``X.weight_packed``: int32 ``[..., out, ceil(in * bits / 32)]``: the ``in`` integers of
  each row, each offset by ``2 ** (bits - 1)`` to be unsigned, written densely at bit
  ``i * bits`` of the row's little-endian words (for 4 bits: element ``2j`` in the low
  nibble of byte ``j``, element ``2j + 1`` in its high nibble);
* ``X.weight_scale``: floating point ``[..., out, in / group_size]`` (strategy ``group``) or
  ``[..., out, 1]`` (``channel``);
* ``X.weight_shape``: the integers ``[out, in]``.

The weight is each integer ``q`` (in ``[-2 ** (bits - 1), 2 ** (bits - 1) - 1]``) times its
group's scale: symmetric schemes only (no zero point). The product is exact in float32 (at
most 8 + 8 significant bits) and rounded once to the dtype the model runs in, so the values
equal compressed-tensors' own dequantization (which multiplies in the scale's dtype) and
transformers' loading of such a checkpoint (tested).

Modules the config ``ignore``s are stored unquantized and load as they are. Loading
dequantizes each weight as it is read (:func:`dequantize`), or (``int_weights="packed"``)
keeps it packed: an :class:`IntLinear` (or stacked experts) holding the int32 words and
the scales (in the checkpoint's dtype), dequantizing what each forward runs with the same arithmetic (so the same
values), at about a quarter (4 bits) or half (8 bits) of bfloat16's memory.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import DFlashError
from .fp8 import check_scale_values

METHOD = "compressed-tensors"
PACKED, SCALE, SHAPE = "_packed", "_scale", "_shape"  # X.weight -> X.weight_packed, X.weight_scale, X.weight_shape
UNSUPPORTED_PARTS = {"_zero_point": "a zero point (an asymmetric scheme)",
                     "_g_idx": "a group index (activation-ordered groups, actorder 'group')"}


def check_config(quant: dict, what: str = "target") -> tuple[int, int | None]:
    """``(bits, group_size)`` (group_size None: one scale per output channel) of a
    compressed-tensors ``quantization_config`` that :func:`dequantize` reads exactly.

    Raises:
        DFlashError: one line, for what cannot be run exactly: a format other than
            ``pack-quantized`` (e.g. ``float-quantized`` FP8, sparse formats;
            ``nvfp4-pack-quantized`` is read by :mod:`~dflash_torch.models.nvfp4`, the target
            config sends it there), quantized activations (``input_activations``, W8A8 schemes),
            weights that are not ``int`` of 4 or 8 bits, asymmetric, with a strategy other
            than ``group`` / ``channel``, or with ``actorder: "group"``; config groups whose
            weight schemes differ; a KV cache scheme; a sparse format (``sparsity_config``
            other than ``dense``); online transforms (a ``transform_config``).
    """
    where = f"the {what} checkpoint's compressed-tensors quantization_config"
    if quant.get("format", "pack-quantized") != "pack-quantized":
        raise DFlashError(f"{where} has format {quant['format']!r}; dflash-torch reads only 'pack-quantized' "
                          "(integer weights packed in int32, e.g. W4A16)")
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise DFlashError(f"{where} has no config_groups")
    if quant.get("kv_cache_scheme"):
        raise DFlashError(f"{where} has a kv_cache_scheme (a quantized KV cache); dflash-torch reads only "
                          "weight-only schemes")
    sparsity = quant.get("sparsity_config")
    if sparsity and not (isinstance(sparsity, dict) and sparsity.get("format") == "dense"):
        raise DFlashError(f"{where} has a sparsity_config of format "
                          f"{sparsity.get('format') if isinstance(sparsity, dict) else sparsity!r}; dflash-torch reads "
                          "only dense pack-quantized weights")
    if quant.get("transform_config"):
        raise DFlashError(f"{where} has a transform_config (online rotations, e.g. QuIP / SpinQuant); dflash-torch "
                          "reads only plain pack-quantized weights")
    schemes = set()
    for name, group in groups.items():
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise DFlashError(f"{where}: config group {name!r} has no weights scheme")
        fmt = group.get("format") or quant.get("format")
        if fmt != "pack-quantized":
            raise DFlashError(f"{where} has format {fmt!r}; dflash-torch reads only 'pack-quantized' "
                              "(integer weights packed in int32, e.g. W4A16)")
        for part in ("input_activations", "output_activations"):
            if group.get(part):
                raise DFlashError(f"{where}: config group {name!r} quantizes {part} (e.g. W8A8); dflash-torch reads "
                                  "only weight-only schemes (W4A16, W8A16)")
        schemes.add(_weight_scheme(group["weights"], f"{where}: config group {name!r}"))
    if len(schemes) > 1:
        raise DFlashError(f"{where} has config groups with different weight schemes {sorted(schemes, key=str)}; "
                          "dflash-torch reads one scheme per checkpoint")
    return schemes.pop()


def _weight_scheme(w: dict, where: str) -> tuple[int, int | None]:
    bits, kind, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
    if kind != "int" or bits not in (4, 8) or isinstance(bits, bool):
        raise DFlashError(f"{where} has weights of type {kind!r} with num_bits {bits!r}; dflash-torch reads int "
                          "weights of 4 or 8 bits")
    if w.get("symmetric", True) is not True:
        raise DFlashError(f"{where} has asymmetric weights (zero points); dflash-torch reads only symmetric ones")
    if w.get("dynamic", False):
        raise DFlashError(f"{where} has dynamic weight scales; dflash-torch reads only stored scales")
    if w.get("actorder") == "group":
        raise DFlashError(f"{where} has actorder 'group' (activation-ordered groups); dflash-torch reads only "
                          "groups of consecutive columns")
    if strategy == "channel":
        return bits, None
    group = w.get("group_size")
    if strategy != "group" or not isinstance(group, int) or isinstance(group, bool) or group < 1:
        raise DFlashError(f"{where} has strategy {strategy!r} with group_size {group!r}; dflash-torch reads "
                          "'group' (with a group_size >= 1) or 'channel'")
    return bits, group


def unpack(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """The integers of ``packed`` (int32 ``[..., rows, words]``, see the module docstring):
    int8 ``[..., rows, cols]``, each in ``[-2 ** (bits - 1), 2 ** (bits - 1) - 1]``."""
    if sys.byteorder != "little":  # (the words' bytes are read in memory order)
        raise DFlashError("packed integer weights are read on little-endian machines only")
    data = packed.contiguous().view(torch.uint8)  # [..., rows, 4 * words], little-endian bytes
    if bits == 4:
        data = torch.stack([data & 15, data >> 4], dim=-1).flatten(-2)
    return (data[..., :cols].to(torch.int16) - (1 << (bits - 1))).to(torch.int8)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor, bits: int, group: int | None,
               dtype: torch.dtype, name: str = "weight") -> torch.Tensor:
    """The matrix that a packed weight and its scales encode, in ``dtype``.

    Args:
        packed: int32 ``[..., out, ceil(in * bits / 32)]``.
        scale: floating point ``[..., out, in / group]`` (``[..., out, 1]`` when ``group`` is
            None), finite, zero or positive (a zero scale makes its group zero).
        shape: the integers ``[out, in]`` (``X.weight_shape``).
        bits: 4 or 8; group: the group size (None: per output channel).
        dtype: float32, bfloat16 or float16.
        name: the weight's name (``X.weight``), for errors.

    Returns:
        ``[..., out, in]`` in ``dtype``, on the device of ``packed``.

    Raises:
        DFlashError: one line naming the weight: ``packed`` not int32, a ``shape`` that is not
            two integers matching ``packed``'s rows and words, ``in`` not a multiple of the
            group, a scale of another shape, not floating point, not finite or negative.
    """
    scale, cols = check_parts(packed, scale, shape, bits, group, name)
    return dequantize_groups(packed, scale, bits, group, cols, dtype)


def check_parts(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor, bits: int, group: int | None,
                name: str = "weight") -> tuple[torch.Tensor, int]:
    """Check a packed weight's parts (as :func:`dequantize`'s arguments) and return its scales
    (in their own dtype, on ``packed``'s device) and its number of columns.

    Raises:
        DFlashError: as :func:`dequantize`.
    """
    if packed.dtype != torch.int32 or packed.dim() < 2:
        raise DFlashError(f"{name}{PACKED} is {str(packed.dtype).removeprefix('torch.')} with {packed.dim()} "
                          "dimensions, expected int32 [..., out, words]")
    dims = [int(d) for d in shape.flatten().tolist()] if not shape.is_floating_point() else []
    if len(dims) != 2 or dims[0] != packed.shape[-2] or math.ceil(dims[1] * bits / 32) != packed.shape[-1]:
        raise DFlashError(f"{name}{SHAPE} {shape.tolist()} does not match {name}{PACKED} of shape "
                          f"{tuple(packed.shape)} ({bits}-bit integers, 32 / {bits} per word)")
    rows, cols = dims
    if group is not None and cols % group:
        raise DFlashError(f"{name} has {cols} columns, not a multiple of the group_size {group}")
    want = (*packed.shape[:-1], cols // group if group else 1)
    if tuple(scale.shape) != want or not scale.is_floating_point():
        raise DFlashError(f"{name}{SCALE} is {str(scale.dtype).removeprefix('torch.')} {tuple(scale.shape)}, "
                          f"expected floating point {want}")
    scale = scale.to(device=packed.device)
    values = scale.float() if scale.element_size() == 1 else scale  # (float8 scales: torch compares only wider ones)
    check_scale_values(values, f"{name}{SCALE}", "symmetric")
    return scale, cols


def dequantize_groups(packed: torch.Tensor, scales: torch.Tensor, bits: int, group: int | None, cols: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """:func:`dequantize` of checked parts: ``scales`` ``[..., out, in / group or 1]`` (any
    floating dtype: widened exactly to float32), ``cols`` the columns ``in``. No host read
    (CUDA graphs can capture it)."""
    q = unpack(packed, bits, cols).to(torch.float32)
    per = group or cols
    return (q.unflatten(-1, (cols // per, per)) * scales.float()[..., None]).flatten(-2).to(dtype)


def words(cols: int, bits: int) -> int:
    """int32 words of a packed row of ``cols`` integers of ``bits`` bits."""
    return math.ceil(cols * bits / 32)


class IntLinear(nn.Module):
    """A linear layer whose weight stays packed: ``weight`` int32 ``[out, in * bits / 32]``
    (the checkpoint's ``weight_packed``), ``weight_scale`` ``[out, in / group or 1]`` (in the
    checkpoint's dtype, e.g. bfloat16: widened exactly when used),
    ``bias`` (in the model's dtype) or None. Each forward dequantizes the weight into the
    input's dtype (:func:`dequantize_groups`) and applies it: the output of an ``nn.Linear``
    holding the dequantized weight."""

    custom_op = True  # run by a torch.library custom operator (see TargetModel.from_pretrained)

    def __init__(self, in_features: int, out_features: int, bias: bool, bits: int, group: int | None,
                 scale_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features, self.int_bits, self.int_group = in_features, out_features, bits, group or 0
        self.weight = nn.Parameter(torch.empty(out_features, words(in_features, bits), dtype=torch.int32),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, in_features // group if group else 1,
                                                     dtype=scale_dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    @classmethod
    def like(cls, linear: nn.Module, bits: int, group: int | None, scale_dtype: torch.dtype = torch.float32
             ) -> "IntLinear":
        """An (uninitialised, meta) :class:`IntLinear` of ``linear``'s shape, to load into."""
        with torch.device("meta"):
            return cls(linear.in_features, linear.out_features, linear.bias is not None, bits, group, scale_dtype)

    @classmethod
    def joined(cls, parts: list["IntLinear"]) -> "IntLinear":
        """One layer whose output is the outputs of ``parts`` (same input width and scheme, all
        with a bias or all without) side by side: their words, scales and biases stacked."""
        first = parts[0]
        out = cls.like(nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None,
                                 device="meta"), first.int_bits, first.int_group or None, first.weight_scale.dtype)
        with torch.no_grad():
            for name in ("weight", "weight_scale", "bias"):
                if getattr(first, name) is not None:
                    setattr(out, name, nn.Parameter(torch.cat([getattr(p, name) for p in parts]), requires_grad=False))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in]`` -> ``[..., out]`` in ``x.dtype``."""
        return int_linear(x, self.weight, self.weight_scale, self.int_bits, self.int_group, self.in_features, self.bias)


@torch.library.custom_op("dflash_torch::int_linear", mutates_args=())
def int_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bits: int, group: int, cols: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, dequantize_groups(weight, scales, bits, group or None, cols, x.dtype), bias)``:
    a custom operator, so that ``torch.compile`` keeps it one opaque node (the byte view of
    the words is not traced)."""
    return F.linear(x, dequantize_groups(weight, scales, bits, group or None, cols, x.dtype), bias)


@int_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bits: int, group: int, cols: int,
      bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])
