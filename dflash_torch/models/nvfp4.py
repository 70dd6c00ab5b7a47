"""NVFP4 weights (4-bit floats in groups of 16 with FP8 scales and a per-tensor scale), in
the two formats they are published in, and NVIDIA ModelOpt's per-tensor FP8.

The numbers: each weight is an FP4 E2M1 value (one sign bit, two exponent bits, one
mantissa bit: the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), two a byte along a row, element
``2j`` in the low nibble of byte ``j`` and ``2j + 1`` in its high nibble (bit 3 of a nibble
is the sign, bits 0-2 the magnitude's index); each group of 16 consecutive columns of a row
has a ``float8_e4m3fn`` scale, and the whole matrix a float32 scale.

1. compressed-tensors' ``nvfp4-pack-quantized`` format (``quantization_config.quant_method:
   "compressed-tensors"``, as llm-compressor writes its NVFP4A16 and NVFP4 schemes): a
   quantized linear ``X`` stores ``X.weight_packed`` uint8 ``[..., out, in / 2]``,
   ``X.weight_scale`` float8_e4m3fn ``[..., out, in / 16]``, ``X.weight_global_scale``
   float32 (one value; the reciprocal of a scale) and, with quantized input activations,
   ``X.input_global_scale``. The weight is ``fp4 * (weight_scale / weight_global_scale)``,
   computed as compressed-tensors' own decompression computes it (``NVFP4PackedCompressor``,
   compressed-tensors 0.20): the quotient rounded to float32, the product in float32,
   rounded once to the dtype the model runs in; bit for bit its values in bfloat16 (tested;
   the library returns bfloat16 whatever the model's dtype, a float32 model here keeps the
   float32 product).
2. NVIDIA ModelOpt's NVFP4 (``quantization_config.quant_method: "modelopt"`` with
   ``quant_algo: "NVFP4"``, or a ``hf_quant_config.json`` beside an older ``config.json``):
   ``X.weight`` uint8 ``[..., out, in / 2]``, ``X.weight_scale`` float8_e4m3fn
   ``[..., out, in / 16]``, ``X.weight_scale_2`` float32 (one value) and ``X.input_scale``
   float32 (the activations' scale). The weight is ``fp4 * weight_scale * weight_scale_2``
   (as vLLM's, SGLang's and TensorRT-LLM's ModelOpt loaders read it): exact in float64 (at
   most 2 + 4 + 24 significant bits), rounded once to the model's dtype.
   ``quant_algo: "FP8"`` (ModelOpt's per-tensor FP8, NVIDIA's ``-FP8`` releases): ``X.weight``
   float8_e4m3fn ``[..., out, in]`` times ``X.weight_scale`` float32 (one value), exact in
   float64, rounded once.

Activations are not quantized: the weights are dequantized when loading (into float32 /
bfloat16 / float16, the dtype the model runs in) and the model runs unquantized, as
compressed-tensors' decompression leaves it and as vLLM's weight-only FP4 (Marlin) path runs
on GPUs without FP4 tensor cores; or (``nvfp4="packed"``) each NVFP4 weight is kept as stored:
an :class:`Nvfp4Linear` (or NVFP4 experts) holding the FP4 bytes, the float8 group scales and
the per-tensor scale of each row (float32), 4.5 bits a weight (about 0.28 of bfloat16), and
dequantizing what each forward runs by reading tables the loader's own arithmetic
(:func:`dequantize_rows`) fills once: for one per-tensor scale a weight depends on its
group scale's byte and its nibble alone, 4096 values (:func:`tables`, :func:`lookup`), so
the values, and the logits, are the same bit for bit. ModelOpt's per-tensor FP8 weights
are dequantized when loading in every mode. The activation scales (``input_global_scale``,
``input_scale``) are read for nothing but their presence. Likewise a ModelOpt checkpoint's
FP8 KV cache (``kv_cache_quant_algo: "FP8"``, NVIDIA's Nemotron NVFP4 / FP8 releases): the
KV cache is kept in the model's dtype and the per-tensor ``*.k_scale`` / ``*.v_scale``
(float32, one value) are not read, as vLLM does with ``--kv-cache-dtype auto``. Modules the config ignores /
excludes are stored unquantized and load as they are. What cannot be run exactly (another
``quant_algo``, a KV cache quantized otherwise than FP8, a group size other than 16, scales of the wrong dtype
or shape, NaN or negative group scales, non-finite or non-positive per-tensor scales, ...) is refused in
one line.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from ..errors import DFlashError

CT_METHOD, CT_FORMAT = "compressed-tensors", "nvfp4-pack-quantized"
MODELOPT = "modelopt"
NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")  # (the same weights; W4A16 with unquantized activations)
LAYER_ALGOS = (*NVFP4_ALGOS, "FP8")  # what a MIXED_PRECISION checkpoint's layers may use
MODELOPT_ALGOS = (*LAYER_ALGOS, "MIXED_PRECISION")
# TargetConfig.nvfp4 of a ModelOpt checkpoint, by quant_algo
MODELOPT_FORMATS = {"NVFP4": "modelopt", "W4A16_NVFP4": "modelopt", "FP8": "modelopt-fp8",
                    "MIXED_PRECISION": "modelopt-mixed"}
GROUP = 16  # columns per FP8 group scale
FP8 = torch.float8_e4m3fn
# compressed-tensors: X.weight_packed, X.weight_scale, X.weight_global_scale; X.input_global_scale (not used)
CT_PACKED, CT_SCALE, CT_GLOBAL, CT_INPUT = "weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"
# ModelOpt: X.weight, X.weight_scale, X.weight_scale_2; X.input_scale (not used)
MO_SCALE, MO_SCALE_2, MO_INPUT = "weight_scale", "weight_scale_2", "input_scale"
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def hf_quant_config(model_dir: Path, cfg: dict) -> dict | None:
    """The ``quantization_config`` an older ModelOpt checkpoint declares in a separate
    ``hf_quant_config.json`` (``{"producer": {"name": "modelopt", ...}, "quantization":
    {"quant_algo": ..., "kv_cache_quant_algo": ..., "group_size": ..., "exclude_modules":
    [...]}}``), as the ``quantization_config`` dict a newer one writes in ``config.json``
    (``quant_method: "modelopt"`` plus the ``quantization`` keys); None when ``config.json``
    has a ``quantization_config`` of its own (top level or in ``text_config``) or there is no
    such file.

    Raises:
        DFlashError: a ``hf_quant_config.json`` that is not a JSON object with a
            ``quantization`` object.
    """
    path = Path(model_dir) / "hf_quant_config.json"
    text = cfg.get("text_config")
    if cfg.get("quantization_config") or (isinstance(text, dict) and text.get("quantization_config")):
        return None
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DFlashError(f"{path} is not valid JSON: {exc}") from None
    quant = value.get("quantization") if isinstance(value, dict) else None
    if not isinstance(quant, dict):
        raise DFlashError(f"{path} has no 'quantization' object (a ModelOpt hf_quant_config.json holds one)")
    producer = value.get("producer")
    name = producer.get("name") if isinstance(producer, dict) else None
    return {"quant_method": MODELOPT if name in (None, MODELOPT) else str(name), **quant}


def check_ct_config(quant: dict, what: str = "target") -> None:
    """Check a compressed-tensors ``quantization_config`` of format ``nvfp4-pack-quantized``
    (every config group's weights: 4-bit ``float``, ``tensor_group`` strategy, symmetric,
    groups of 16, stored scales).

    Raises:
        DFlashError: one line: a config group of another format or weight scheme, quantized
            input activations other than NVFP4's (4-bit float, groups of 16; those are not
            quantized here), quantized output activations, a ``kv_cache_scheme``, a sparse
            format, a non-empty ``transform_config``, no config groups.
    """
    where = f"the {what} checkpoint's compressed-tensors quantization_config"
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise DFlashError(f"{where} has no config_groups")
    if quant.get("kv_cache_scheme"):
        raise DFlashError(f"{where} has a kv_cache_scheme (a quantized KV cache); dflash-torch reads only weight "
                          "quantization")
    sparsity = quant.get("sparsity_config")
    if sparsity and not (isinstance(sparsity, dict) and sparsity.get("format") == "dense"):
        raise DFlashError(f"{where} has a sparsity_config of format "
                          f"{sparsity.get('format') if isinstance(sparsity, dict) else sparsity!r}; dflash-torch reads "
                          "only dense NVFP4 weights")
    if quant.get("transform_config"):
        raise DFlashError(f"{where} has a transform_config (online rotations); dflash-torch reads only plain NVFP4 "
                          "weights")
    for name, group in groups.items():
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise DFlashError(f"{where}: config group {name!r} has no weights scheme")
        fmt = group.get("format") or quant.get("format")
        if fmt != CT_FORMAT:
            raise DFlashError(f"{where}: config group {name!r} has format {fmt!r} beside {CT_FORMAT!r}; dflash-torch "
                              "reads one format per checkpoint")
        here = f"{where}: config group {name!r}"
        if not _is_nvfp4(group["weights"]) or group["weights"].get("dynamic", False):
            raise DFlashError(f"{here} has weights {_describe(group['weights'])}; {CT_FORMAT} holds NVFP4 weights "
                              "(4-bit float, strategy 'tensor_group', symmetric, group_size 16, stored scales)")
        acts = group.get("input_activations")
        if acts and not _is_nvfp4(acts):
            raise DFlashError(f"{here} quantizes input_activations as {_describe(acts)}; dflash-torch reads NVFP4 "
                              "weight-only (NVFP4A16) and NVFP4 (W4A4) schemes, activations unquantized")
        if group.get("output_activations"):
            raise DFlashError(f"{here} quantizes output_activations; dflash-torch reads only weight quantization")


def _is_nvfp4(args: dict) -> bool:
    return (args.get("num_bits") == 4 and args.get("type") == "float" and args.get("group_size") == GROUP
            and args.get("strategy", "tensor_group") == "tensor_group" and args.get("symmetric", True) is True)


def _describe(args: dict) -> str:
    return ", ".join(f"{k} {args.get(k)!r}" for k in ("num_bits", "type", "strategy", "group_size", "symmetric",
                                                       "dynamic") if k in args)


def check_modelopt_config(quant: dict, what: str = "target") -> str:
    """How the weights of a ModelOpt checkpoint are stored (``quant_method: "modelopt"``:
    ``quantization_config`` in ``config.json``, or built from ``hf_quant_config.json`` by
    :func:`hf_quant_config`), as :class:`~dflash_torch.models.config.TargetConfig`'s
    ``nvfp4`` says it: ``"modelopt"`` (``quant_algo`` ``"NVFP4"`` or ``"W4A16_NVFP4"``),
    ``"modelopt-fp8"`` (``"FP8"``, per-tensor scales) or ``"modelopt-mixed"``
    (``"MIXED_PRECISION"`` whose ``quantized_layers`` each use one of those: each weight is
    then read by its dtype, uint8 NVFP4, float8_e4m3fn FP8).

    Raises:
        DFlashError: one line: another ``quant_algo`` (e.g. ``W4A8_AWQ``, ``FP8_PB_WO``,
            ``NVFP4_AWQ``, ``MXFP8``), a MIXED_PRECISION layer using one, or with no
            ``quantized_layers``; NVFP4 with a ``group_size`` other than 16; a KV cache
            quantized otherwise than ``kv_cache_quant_algo: "FP8"`` (or a ``kv_cache_scheme``).
    """
    where = f"the {what} checkpoint's ModelOpt quantization_config"
    algo = quant.get("quant_algo")
    if not isinstance(algo, str) or algo.upper() not in MODELOPT_ALGOS:
        raise DFlashError(f"{where} has quant_algo {algo!r}; dflash-torch reads 'NVFP4' / 'W4A16_NVFP4' (FP4 weights, "
                          "FP8 scales per 16), 'FP8' (per-tensor scales) and 'MIXED_PRECISION' of those")
    algo = algo.upper()
    if quant.get("kv_cache_scheme"):
        raise DFlashError(f"{where} has a kv_cache_scheme {quant['kv_cache_scheme']!r}; dflash-torch reads "
                          "ModelOpt's kv_cache_quant_algo 'FP8' only")
    kv = quant.get("kv_cache_quant_algo")
    if kv and not (isinstance(kv, str) and kv.upper() == "FP8"):
        raise DFlashError(f"{where} quantizes the KV cache as kv_cache_quant_algo {kv!r}; dflash-torch reads 'FP8' "
                          "(kept in the model's dtype) or none")
    layers = {"quant_algo": {"quant_algo": algo, "group_size": quant.get("group_size", GROUP)}}
    if algo == "MIXED_PRECISION":
        layers = quant.get("quantized_layers")
        if not isinstance(layers, dict) or not layers:
            raise DFlashError(f"{where} has quant_algo 'MIXED_PRECISION' without quantized_layers (each quantized "
                              "layer's quant_algo)")
    for name, layer in layers.items():
        here = where if algo != "MIXED_PRECISION" else f"{where}: quantized_layers {name!r}"
        layer_algo = layer.get("quant_algo") if isinstance(layer, dict) else None
        if not isinstance(layer_algo, str) or layer_algo.upper() not in LAYER_ALGOS:
            raise DFlashError(f"{here} has quant_algo {layer_algo!r}; dflash-torch reads 'NVFP4', 'W4A16_NVFP4' and "
                              "'FP8' layers")
        if layer_algo.upper() in NVFP4_ALGOS and layer.get("group_size", GROUP) != GROUP:
            raise DFlashError(f"{here} has group_size {layer.get('group_size')!r}; NVFP4 scales groups of 16")
    return MODELOPT_FORMATS[algo]


@functools.lru_cache(maxsize=None)
def _table(device: torch.device) -> torch.Tensor:
    """float32 ``[16]``: the value of each E2M1 nibble (bit 3 the sign)."""
    return torch.tensor([*E2M1, *(-v for v in E2M1)], dtype=torch.float32, device=device)


_ELEMENTS_PER_CHUNK = 1 << 23  # weights dequantized at a time (float64 temporaries of at most 64 MB)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The FP4 values of ``packed`` (uint8 ``[..., rows, cols / 2]``, see the module
    docstring): float32 ``[..., rows, cols]`` (exact; a negative zero for the nibble 8)."""
    data = packed.contiguous()
    idx = torch.stack([data & 15, data >> 4], dim=-1).flatten(-2)
    return _table(packed.device).index_select(0, idx.reshape(-1).int()).view(idx.shape)


def check_parts(packed: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor, packed_name: str,
                scale_name: str, tensor_scale_name: str) -> torch.Tensor:
    """Check an NVFP4 weight's parts and return its per-tensor scale as one float32 value
    per row of the weight's matrices (``[rows]``, ``rows`` the product of ``packed``'s
    dimensions but the last).

    Args:
        packed: uint8 ``[..., out, in / 2]`` (``in`` a multiple of 16).
        scale: float8_e4m3fn ``[..., out, in / 16]``, zero or positive (a zero group scale,
            e.g. one too small for float8, makes its 16 weights zero), no NaN.
        tensor_scale: float32, one value, or one per leading index (stacked experts:
            ``[...]`` or ``[..., 1]``), finite and positive.
        packed_name, scale_name, tensor_scale_name: the names, for errors.

    Raises:
        DFlashError: one line naming the tensor, for any other dtype or shape, NaN or
            negative group scales, a non-finite or non-positive per-tensor scale.
    """
    if packed.dtype != torch.uint8 or packed.dim() < 2:
        raise DFlashError(f"NVFP4 weight {packed_name} is {str(packed.dtype).removeprefix('torch.')} with "
                          f"{packed.dim()} dimensions, expected uint8 [..., out, in / 2]")
    cols = 2 * packed.shape[-1]
    if cols % GROUP:
        raise DFlashError(f"NVFP4 weight {packed_name} has {cols} columns, not a multiple of the group size {GROUP}")
    want = (*packed.shape[:-1], cols // GROUP)
    if scale.dtype != FP8 or tuple(scale.shape) != want:
        raise DFlashError(f"NVFP4 scale {scale_name} is {str(scale.dtype).removeprefix('torch.')} "
                          f"{tuple(scale.shape)}, expected float8_e4m3fn {want}")
    data = scale.view(torch.uint8)
    if data.numel() and int(data.max()) > 0x7E:  # (one reduction: zero and positive bytes are 0x00-0x7E)
        if bool(((data & 0x7F) == 0x7F).any()):  # (the bytes 0x7F, 0xFF)
            raise DFlashError(f"NVFP4 scale {scale_name} holds NaN values (a corrupt checkpoint)")
        if bool((data > 0x80).any()):  # (the sign bit set on a nonzero value; 0x80 is -0)
            raise DFlashError(f"NVFP4 scale {scale_name} holds negative values (a corrupt checkpoint: group scales "
                              "are zero or positive)")
    return _tensor_scale_rows(tensor_scale, packed.shape, tensor_scale_name, "NVFP4 per-tensor scale")


def _tensor_scale_rows(scale: torch.Tensor, shape: torch.Size, name: str, what: str) -> torch.Tensor:
    lead = tuple(shape[:-2])
    if scale.dtype != torch.float32 or scale.numel() != 1 and tuple(scale.shape) not in (lead, (*lead, 1)):
        raise DFlashError(f"{what} {name} is {str(scale.dtype).removeprefix('torch.')} {tuple(scale.shape)}, "
                          f"expected float32 with one value{f' (or one per matrix, {lead})' if lead else ''}")
    if not bool((torch.isfinite(scale) & (scale > 0)).all()):
        raise DFlashError(f"{what} {name} is not a positive finite number ({scale.flatten()[:4].tolist()}; a "
                          "corrupt checkpoint)")
    rows = shape[:-1].numel()
    return scale.reshape(-1).repeat_interleave(rows // scale.numel())


def _by_rows(parts: list[torch.Tensor], rows_scale: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
             device, fn) -> torch.Tensor:
    """``fn(*row chunks of parts, row chunk of rows_scale)`` (float64 or float32 ``[r, cols]``)
    rounded to ``dtype`` into a new ``[*shape]`` tensor, a few rows at a time."""
    cols = shape[-1]
    out = torch.empty(shape, dtype=dtype, device=device)
    flat = out.view(-1, cols)
    parts = [p.reshape(flat.shape[0], -1) for p in parts]
    step = max(1, _ELEMENTS_PER_CHUNK // cols)
    for r in range(0, flat.shape[0], step):
        flat[r:r + step] = fn(*(p[r:r + step].to(device) for p in parts), rows_scale[r:r + step].to(device))
    return out


def dequantize_ct(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype,
                  name: str = "weight") -> torch.Tensor:
    """The matrix a compressed-tensors NVFP4 weight encodes, in ``dtype``:
    ``fp4 * (weight_scale / weight_global_scale)``, the quotient rounded to float32 and the
    product computed in float32 (compressed-tensors' arithmetic), rounded once to ``dtype``.

    Args:
        packed: ``X.weight_packed``, uint8 ``[..., out, in / 2]``.
        scale: ``X.weight_scale``, float8_e4m3fn ``[..., out, in / 16]``.
        global_scale: ``X.weight_global_scale``, float32, one value (or one per stacked matrix).
        dtype: float32, bfloat16 or float16.
        name: ``X.weight``, for errors.

    Returns:
        ``[..., out, in]`` in ``dtype``, on ``packed``'s device.

    Raises:
        DFlashError: as :func:`check_parts`.
    """
    base = name.removesuffix("weight")
    gs = check_parts(packed, scale, global_scale, base + CT_PACKED, base + CT_SCALE, base + CT_GLOBAL)
    return dequantize_rows(packed, scale, gs, CT, dtype)


def _ct_rows(p: torch.Tensor, s: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """compressed-tensors' arithmetic on ``r`` rows: ``p`` uint8 ``[r, cols / 2]``, ``s``
    float8_e4m3fn ``[r, cols / 16]``, ``g`` float32 ``[r]`` (the global scale of each row) ->
    ``[r, cols]`` in ``dtype``."""
    ratio = s.float() / g[:, None]  # (float32 quotient, as the library divides)
    return (unpack(p).unflatten(-1, (-1, GROUP)) * ratio[..., None]).flatten(-2).to(dtype)


def dequantize_modelopt(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor, dtype: torch.dtype,
                        name: str = "weight") -> torch.Tensor:
    """The matrix a ModelOpt NVFP4 weight encodes, in ``dtype``: ``fp4 * weight_scale *
    weight_scale_2``, exact in float64, rounded once to ``dtype`` (:func:`round_once`).

    Args:
        packed: ``X.weight``, uint8 ``[..., out, in / 2]``.
        scale: ``X.weight_scale``, float8_e4m3fn ``[..., out, in / 16]``.
        scale_2: ``X.weight_scale_2``, float32, one value (or one per stacked matrix).
        dtype: float32, bfloat16 or float16.
        name: ``X.weight``, for errors.

    Returns:
        ``[..., out, in]`` in ``dtype``, on ``packed``'s device.

    Raises:
        DFlashError: as :func:`check_parts`.
    """
    base = name.removesuffix("weight")
    s2 = check_parts(packed, scale, scale_2, name, base + MO_SCALE, base + MO_SCALE_2)
    return dequantize_rows(packed, scale, s2, MODELOPT_NVFP4, dtype)


def _modelopt_rows(p: torch.Tensor, s: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """ModelOpt's arithmetic on ``r`` rows (as :func:`_ct_rows`, ``g`` the ``weight_scale_2``
    of each row): exact in float64, rounded once."""
    block = s.double() * g.double()[:, None]  # exact: at most 4 + 24 significant bits
    return round_once((unpack(p).double().unflatten(-1, (-1, GROUP)) * block[..., None]).flatten(-2), dtype)


CT, MODELOPT_NVFP4 = 1, 2  # how the per-tensor scale applies (Nvfp4Linear.nvfp4_kind, Experts.nvfp4)
_ROWS = {CT: _ct_rows, MODELOPT_NVFP4: _modelopt_rows}


def dequantize_rows(packed: torch.Tensor, scale: torch.Tensor, rows_scale: torch.Tensor, kind: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """The matrix of checked NVFP4 parts, in ``dtype``: what :func:`dequantize_ct` (``kind``
    :data:`CT`) or :func:`dequantize_modelopt` (:data:`MODELOPT_NVFP4`) gives for them, by the
    same code, a few rows at a time. No host read (CUDA graphs can capture it).

    Args:
        packed: uint8 ``[..., rows, cols / 2]``.
        scale: float8_e4m3fn ``[..., rows, cols / 16]``.
        rows_scale: float32, the per-tensor scale of each row (``[..., rows]``, or flat:
            as many values as rows), on ``packed``'s device.
        kind: :data:`CT` (``fp4 * (scale / rows_scale)``) or :data:`MODELOPT_NVFP4`
            (``fp4 * scale * rows_scale``).
        dtype: float32, bfloat16 or float16.

    Returns:
        ``[..., rows, cols]`` in ``dtype``, on ``packed``'s device.
    """
    fn = _ROWS[kind]
    return _by_rows([packed, scale], rows_scale.reshape(-1), (*packed.shape[:-1], 2 * packed.shape[-1]), dtype,
                    packed.device, lambda p, s, g: fn(p, s, g, dtype))


def dequantize_modelopt_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                            name: str = "weight") -> torch.Tensor:
    """The matrix a ModelOpt per-tensor FP8 weight encodes, in ``dtype``: ``weight *
    weight_scale``, exact in float64 (at most 4 + 24 significant bits), rounded once
    (:func:`round_once`).

    Args:
        weight: ``X.weight``, float8_e4m3fn ``[..., out, in]``, no NaN.
        scale: ``X.weight_scale``, float32, one value (or one per stacked matrix), finite
            and positive.
        dtype: float32, bfloat16 or float16.
        name: ``X.weight``, for errors.

    Returns:
        ``[..., out, in]`` in ``dtype``, on ``weight``'s device.

    Raises:
        DFlashError: one line naming the tensor, for another dtype or shape, NaN bytes, a
            non-finite or non-positive scale.
    """
    if weight.dtype != FP8 or weight.dim() < 2:
        raise DFlashError(f"FP8 weight {name} is {str(weight.dtype).removeprefix('torch.')} with {weight.dim()} "
                          "dimensions, expected float8_e4m3fn [..., out, in]")
    if bool(((weight.view(torch.uint8) & 0x7F) == 0x7F).any()):
        raise DFlashError(f"FP8 weight {name} holds NaN values (a corrupt checkpoint)")
    s = _tensor_scale_rows(scale, weight.shape, name.removesuffix("weight") + MO_SCALE, "ModelOpt FP8 scale")
    return _by_rows([weight], s, tuple(weight.shape), dtype, weight.device,
                    lambda w, g: round_once(w.double() * g.double()[:, None], dtype))


def round_once(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 ``x`` rounded once (to nearest, ties to even) to ``dtype`` (float32,
    bfloat16, float16): torch converts float64 to bfloat16 / float16 through float32, two
    roundings that can differ from one; rounding to float32 by round-to-odd first (an
    inexact result gets an odd last bit) keeps the second rounding exact (float32 holds at
    least 2 bits more than either)."""
    narrow = x.float()
    if dtype == torch.float32:
        return narrow
    inexact = narrow.double() != x
    bits = narrow.view(torch.int32)
    # truncate toward zero: one step down in magnitude where nearest rounding went up
    up = inexact & (narrow.double().abs() > x.abs())
    bits = torch.where(up, bits - 1, bits)
    bits = torch.where(inexact, bits | 1, bits)
    return bits.view(torch.float32).to(dtype)


# --- kept packed (nvfp4="packed") ---

ROW_SCALE_2_SUFFIX = "_scale_2"  # held packed: X.weight -> X.weight_scale_2 (float32, the per-tensor scale of each row)


def joined_scales(scale: torch.Tensor, rows_scale: torch.Tensor) -> torch.Tensor:
    """One tensor holding an NVFP4 weight's scales, as loading carries them to the model
    (through the families' renaming and the stacking of experts, like the one scale tensor
    of the other formats): uint8 ``[..., rows, cols / 16 + 4]``, each row's
    float8_e4m3fn group scales' bytes then its float32 per-tensor scale's 4 bytes (the
    machine's byte order). :func:`split_scales` undoes it exactly.

    Args:
        scale: float8_e4m3fn ``[..., rows, cols / 16]``.
        rows_scale: float32 with one value per row (``[..., rows]`` or flat).
    """
    tail = rows_scale.to(device=scale.device, dtype=torch.float32).reshape(*scale.shape[:-1], 1).view(torch.uint8)
    return torch.cat([scale.view(torch.uint8), tail], dim=-1)


def split_scales(joined: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(group scales float8_e4m3fn [..., rows, cols / 16], per-row scales float32 [..., rows])``
    of :func:`joined_scales`'s ``joined`` (new tensors)."""
    return joined[..., :-4].contiguous().view(FP8), joined[..., -4:].contiguous().view(torch.float32)[..., 0]


TABLE = 256 * 16  # values of a table: one per (float8 group-scale byte, FP4 nibble)


@functools.lru_cache(maxsize=None)
def _grid(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (group-scale byte, nibble) pair as NVFP4 parts of 256 rows of 16 columns: uint8
    ``[256, 8]`` (row ``b``'s nibbles 0..15 in order) and float8_e4m3fn ``[256, 1]`` (row
    ``b``'s scale: the byte ``b``)."""
    nibbles = torch.arange(16, dtype=torch.uint8, device=device)
    packed = (nibbles[0::2] | (nibbles[1::2] << 4)).expand(256, 8).contiguous()
    return packed, torch.arange(256, dtype=torch.uint8, device=device).view(FP8)[:, None]


def tables(rows_scale: torch.Tensor, kind: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The dequantization tables of NVFP4 weights whose rows have the per-tensor scales
    ``rows_scale``: for a fixed per-tensor scale a weight is a function of its group scale's
    byte and its nibble alone, so each distinct scale gets the 4096 values of
    :func:`dequantize_rows` (the loader's arithmetic, run on every pair: exact by
    construction), and :func:`lookup` dequantizes by reading them. One host read (the number
    of distinct scales).

    Args:
        rows_scale: float32, the per-tensor scale of each row, any shape (``[rows]``,
            stacked experts ``[E, rows]``), checked (:func:`check_parts`).
        kind: :data:`CT` or :data:`MODELOPT_NVFP4`.
        dtype: float32, bfloat16 or float16.

    Returns:
        ``(table, rows)``: ``table`` ``[T, 4096]`` in ``dtype`` on ``rows_scale``'s device
        (``T`` distinct scales; entry ``byte * 16 + nibble``: NaN for the NaN bytes 0x7F and
        0xFF, which checked scales never hold), ``rows`` int32 of ``rows_scale``'s shape,
        each row's table.
    """
    distinct, rows = torch.unique(rows_scale.reshape(-1), return_inverse=True)
    packed, scale = _grid(rows_scale.device)
    t = distinct.numel()
    table = dequantize_rows(packed.repeat(t, 1), scale.repeat(t, 1), distinct.repeat_interleave(256), kind, dtype)
    return table.view(t, TABLE), rows.to(torch.int32).view(rows_scale.shape)


def lookup(packed: torch.Tensor, scale: torch.Tensor, table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The matrix of checked NVFP4 parts read from their :func:`tables`: what
    :func:`dequantize_rows` gives for them, bit for bit, a few rows at a time (int32
    indices, 4 bytes a weight, for at most 2**23 weights at once). No host read (CUDA
    graphs can capture it).

    Args:
        packed: uint8 ``[..., rows, cols / 2]``.
        scale: float8_e4m3fn ``[..., rows, cols / 16]``.
        table: ``[T, 4096]``, on ``packed``'s device.
        rows: int32 ``[..., rows]`` (or flat), each row's table (``0 <= rows < T``).

    Returns:
        ``[..., rows, cols]`` in ``table``'s dtype, on ``packed``'s device.
    """
    cols = 2 * packed.shape[-1]
    out = torch.empty((*packed.shape[:-1], cols), dtype=table.dtype, device=packed.device)
    flat, values = out.view(-1, cols), table.view(-1)
    p = packed.reshape(flat.shape[0], cols // GROUP, GROUP // 2)
    s, r_table = scale.reshape(flat.shape[0], cols // GROUP).view(torch.uint8), rows.reshape(-1)
    step = max(1, _ELEMENTS_PER_CHUNK // cols)
    for r in range(0, flat.shape[0], step):
        pr = p[r:r + step]
        base = (r_table[r:r + step, None] * TABLE + s[r:r + step].int() * 16)[..., None]  # int32 [r, groups, 1]
        idx = torch.empty((*pr.shape, 2), dtype=torch.int32, device=packed.device)
        torch.add(base, pr & 15, out=idx[..., 0])  # (element 2j: the low nibble)
        torch.add(base, pr >> 4, out=idx[..., 1])
        torch.index_select(values, 0, idx.view(-1), out=flat[r:r + step].view(-1))
    return out


def pair_tables(table: torch.Tensor) -> torch.Tensor:
    """:func:`tables`' ``table`` ``[T, 4096]`` by packed byte: ``[T, 65536, 2]`` in its dtype,
    entry ``[t, scale_byte * 256 + byte]`` the values of ``byte``'s low and high nibbles
    (elements ``2j`` and ``2j + 1``) under ``scale_byte``, for :func:`lookup_pairs` (one
    gather a byte instead of a value: 256 KB a table in bfloat16, 512 KB in float32)."""
    b = torch.arange(256, device=table.device)
    by_byte = table.view(-1, 256, 16)
    return torch.stack([by_byte[:, :, b & 15], by_byte[:, :, b >> 4]], dim=-1).reshape(-1, 256 * 256, 2)


def lookup_pairs(packed: torch.Tensor, scale: torch.Tensor, pairs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """:func:`lookup` reading :func:`pair_tables` (the same values, bit for bit): each
    packed byte's two values gathered at once (as one integer of twice the dtype's width),
    int32 indices of 2 bytes a weight, for at most 2**23 weights at once. No host read.

    Args:
        packed: uint8 ``[..., rows, cols / 2]``.
        scale: float8_e4m3fn ``[..., rows, cols / 16]``.
        pairs: ``[T, 65536, 2]`` (float32, bfloat16 or float16), on ``packed``'s device.
        rows: int32 ``[..., rows]`` (or flat), each row's table (``0 <= rows < T``).

    Returns:
        ``[..., rows, cols]`` in ``pairs``' dtype, on ``packed``'s device.
    """
    cols = 2 * packed.shape[-1]
    out = torch.empty((*packed.shape[:-1], cols), dtype=pairs.dtype, device=packed.device)
    word = torch.int64 if pairs.dtype.itemsize == 4 else torch.int32
    flat, values = out.view(-1, cols).view(word), pairs.view(word).view(-1)  # [rows, cols / 2] words
    p = packed.reshape(flat.shape[0], cols // GROUP, GROUP // 2)
    s, r_table = scale.reshape(flat.shape[0], cols // GROUP).view(torch.uint8), rows.reshape(-1)
    step = max(1, _ELEMENTS_PER_CHUNK // cols)
    for r in range(0, flat.shape[0], step):
        base = ((r_table[r:r + step, None] * 256 + s[r:r + step].int()) * 256)[..., None]  # int32 [r, groups, 1]
        torch.index_select(values, 0, (p[r:r + step] + base).view(-1), out=flat[r:r + step].view(-1))
    return out


def check_finite(packed: torch.Tensor, scale: torch.Tensor, rows_scale: torch.Tensor, kind: int, dtype: torch.dtype,
                 name: str) -> None:
    """Raise :class:`DFlashError` unless every value of the weight (:func:`dequantize_rows`) is
    finite in ``dtype``, as a dequantized weight must be (e.g. a tiny ``weight_global_scale``
    overflows): checked a few rows at a time, nothing kept."""
    p, s, g = packed.reshape(-1, packed.shape[-1]), scale.reshape(-1, scale.shape[-1]), rows_scale.reshape(-1)
    step = max(1, _ELEMENTS_PER_CHUNK // (2 * p.shape[1]))
    for r in range(0, p.shape[0], step):
        if not bool(torch.isfinite(_ROWS[kind](p[r:r + step], s[r:r + step], g[r:r + step], dtype)).all()):
            raise DFlashError(f"NVFP4 weight {name} times its scales is not finite in "
                              f"{str(dtype).removeprefix('torch.')} (a corrupt checkpoint)")


class Nvfp4Linear(torch.nn.Module):
    """A linear layer whose weight stays NVFP4: ``weight`` uint8 ``[out, in / 2]`` (two FP4
    values a byte, as stored), ``weight_scale`` float8_e4m3fn ``[out, in / 16]`` (the group
    scales, as stored), ``weight_scale_2`` float32 ``[out]`` (the per-tensor scale of each
    row: compressed-tensors' ``weight_global_scale``, a divisor, or ModelOpt's
    ``weight_scale_2``, a factor, as ``nvfp4_kind`` says: :data:`CT` or
    :data:`MODELOPT_NVFP4`), ``bias`` (in the model's dtype) or None; and, once loaded,
    :meth:`build_tables` (buffers, not saved): ``table`` ``[T, 65536, 2]`` in the model's
    dtype and ``row_table`` int32 ``[out]`` (:func:`tables`, :func:`pair_tables`: one table
    per distinct per-tensor scale, a joined layer's parts each keeping theirs). Each forward
    dequantizes the weight by reading the tables (:func:`lookup_pairs`, the loader's values)
    and applies it: the output of an ``nn.Linear`` holding the dequantized weight, bit for
    bit, in about 0.28 of its bfloat16 memory (4.5 bits a weight) between forwards, plus 256
    KB (bfloat16) or 512 KB (float32) a table."""

    custom_op = True  # run by a torch.library custom operator (see TargetModel.from_pretrained)

    def __init__(self, in_features: int, out_features: int, bias: bool, kind: int):
        super().__init__()
        self.in_features, self.out_features, self.nvfp4_kind = in_features, out_features, kind
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features // 2, dtype=torch.uint8),
                                         requires_grad=False)
        self.weight_scale = torch.nn.Parameter(torch.empty(out_features, in_features // GROUP, dtype=FP8),
                                               requires_grad=False)
        self.weight_scale_2 = torch.nn.Parameter(torch.empty(out_features), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.register_buffer("table", None, persistent=False)
        self.register_buffer("row_table", None, persistent=False)

    @classmethod
    def like(cls, linear: torch.nn.Module, kind: int) -> "Nvfp4Linear":
        """An (uninitialised, meta) :class:`Nvfp4Linear` of ``linear``'s shape, to load into."""
        with torch.device("meta"):
            return cls(linear.in_features, linear.out_features, linear.bias is not None, kind)

    def build_tables(self, dtype: torch.dtype) -> None:
        """Build ``table`` and ``row_table`` (:func:`tables`, :func:`pair_tables`) for forwards
        in ``dtype`` (float32, bfloat16 or float16), on the weight's device, from the loaded
        scales."""
        table, self.row_table = tables(self.weight_scale_2, self.nvfp4_kind, dtype)
        self.table = pair_tables(table)

    @classmethod
    def joined(cls, parts: list["Nvfp4Linear"]) -> "Nvfp4Linear":
        """One layer whose output is the outputs of ``parts`` (same input width and kind, all
        with a bias or all without; tables built for one dtype or not built) side by side:
        their bytes, scales and biases stacked (each row keeps its own per-tensor scale), and
        their tables (one per distinct scale of them all)."""
        first = parts[0]
        out = cls.like(torch.nn.Linear(first.in_features, sum(p.out_features for p in parts),
                                       bias=first.bias is not None, device="meta"), first.nvfp4_kind)
        with torch.no_grad():
            for name in ("weight", "weight_scale", "weight_scale_2", "bias"):
                if getattr(first, name) is not None:
                    setattr(out, name, torch.nn.Parameter(torch.cat([getattr(p, name) for p in parts]),
                                                          requires_grad=False))
        if first.table is not None:
            out.build_tables(first.table.dtype)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in]`` in the tables' dtype -> ``[..., out]`` in ``x.dtype``.

        Raises:
            DFlashError: no tables built (:meth:`build_tables`), or built for another dtype.
        """
        if self.table is None or self.table.dtype != x.dtype:
            raise DFlashError(f"an NVFP4 linear layer ran on {str(x.dtype).removeprefix('torch.')} input with "
                              f"{'no tables' if self.table is None else 'tables in ' + str(self.table.dtype)} "
                              "(Nvfp4Linear.build_tables(dtype) builds them for the model's dtype)")
        return nvfp4_linear(x, self.weight, self.weight_scale, self.table, self.row_table, self.bias)


@torch.library.custom_op("dflash_torch::nvfp4_linear", mutates_args=())
def nvfp4_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, table: torch.Tensor,
                 row_table: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, lookup_pairs(weight, scale, table, row_table), bias)`` (``table`` in
    ``x.dtype``): a custom operator, so that ``torch.compile`` keeps it one opaque node
    running the eager gather (:func:`lookup_pairs`)."""
    return torch.nn.functional.linear(x, lookup_pairs(weight, scale, table, row_table), bias)


@nvfp4_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, table: torch.Tensor, row_table: torch.Tensor,
      bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def build_tables(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Build the tables (:func:`tables`) of every NVFP4 layer below ``model`` (loaded):
    :class:`Nvfp4Linear` layers and NVFP4 experts (a nonzero ``nvfp4_kind``), for
    forwards in ``dtype``."""
    for m in model.modules():
        if getattr(m, "nvfp4_kind", 0):
            m.build_tables(dtype)
