"""Target model configurations parsed from Hugging Face ``config.json`` dicts, and the
field checks that target and drafter parsers share.

Targets: :class:`TargetConfig`, filled by the parser of each family module (see
:mod:`dflash_torch.models.registry`) from the helpers here. Drafters:
:mod:`dflash_torch.models.drafter_config`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import warnings
from dataclasses import dataclass, field

import torch

from ..errors import DFlashError, OptionError, shown
from ..options import json_type

log = logging.getLogger("dflash_torch")


MIN_POSITIONS = 2  # a target must hold one prompt token and one generated token
# required keys of each supported rope scaling rule (besides rope_type)
ROPE_SCALING_KEYS = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ("factor",)}
# the keys each rule reads besides those (transformers' required and optional keys of the rule)
ROPE_RULE_KEYS = {"linear": ("factor",),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                  "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate",
                           "attention_factor", "mscale", "mscale_all_dim")}
# keys that transformers 5 keeps in rope_parameters next to the scaling rule, but are not scaling
_NOT_SCALING = ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")


def _rope(cfg: dict, what: str = "target", default_theta: float = 10000.0) -> tuple[float, dict | None]:
    """RoPE base and scaling rule from either the v4 (``rope_theta`` + ``rope_scaling``)
    or the v5 (``rope_parameters``) transformers layout. As in transformers, a
    ``rope_scaling`` dict is read in place of ``rope_parameters`` when both are given.

    Returns:
        ``(rope_theta, scaling)``. ``rope_theta`` comes from the rope dict read if it has one,
        else the top level, else ``default_theta`` (transformers' config class default of
        the model type: :func:`transformers_default`). ``scaling`` is None for plain RoPE (no dict,
        ``rope_type`` default, or ``mrope``: multimodal RoPE with equal text positions is
        plain RoPE), else a new dict holding ``rope_type`` (linear, llama3, yarn) and that
        rule's parameters only (:data:`ROPE_RULE_KEYS`): ``rope_theta``, ``partial_rotary_factor``,
        ``mrope_section`` and ``mrope_interleaved`` are dropped (the caller reads
        ``partial_rotary_factor`` itself), and so is any other key the rule does not read
        (e.g. YaRN's ``finetuned`` in some Llama-2 configs), with a one-line WARNING (logger
        ``dflash_torch``) naming the non-null ones, as transformers warns of "unrecognized
        keys" and runs. For llama3/yarn, a top-level
        ``original_max_position_embeddings`` overrides the dict's (as transformers'
        config standardisation does); when neither has it, it stays absent and
        :class:`~dflash_torch.models.rope.Rotary` uses ``max_position_embeddings``.

    Raises:
        DFlashError: an unsupported rope type (names the supported ones), a rule's
            required key missing, a rope dict that is not an object, a ``rope_theta`` that
            is not a number > 0; each message names the file (``what``: target / drafter).
    """
    params = object_field(cfg, "rope_scaling", what) or object_field(cfg, "rope_parameters", what) or {}
    theta = number_field(params, "rope_theta", what, number_field(cfg, "rope_theta", what, default_theta))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("default", "mrope"):
        return float(theta), None
    where = f"{what} config.json {'rope_scaling' if cfg.get('rope_scaling') else 'rope_parameters'}"
    if kind not in ROPE_SCALING_KEYS:
        raise DFlashError(f"{where}: unsupported rope scaling type {kind!r}; supported: {', '.join(ROPE_SCALING_KEYS)}")
    scaling = {k: v for k, v in params.items() if k in ROPE_RULE_KEYS[kind]}
    unread = [k for k, v in params.items() if k not in (*ROPE_RULE_KEYS[kind], *_NOT_SCALING, "type", "rope_type")
              and v is not None]
    if unread:
        log.warning(f"dflash-torch: WARNING: {where}: ignoring {', '.join(unread)}, which rope scaling type "
                    f"{kind!r} does not read")
    scaling["rope_type"] = kind
    if kind in ("llama3", "yarn") and cfg.get("original_max_position_embeddings") is not None:
        scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    # (yarn's factor may be null: max_position_embeddings / original, as transformers derives it)
    missing = [k for k in ROPE_SCALING_KEYS[kind] if scaling.get(k) is None and not (kind == "yarn" and k in scaling)]
    if kind in ("llama3", "yarn") and not (scaling.get("original_max_position_embeddings") or cfg.get("max_position_embeddings")):
        missing.append("original_max_position_embeddings (or max_position_embeddings)")
    elif kind == "yarn" and scaling.get("factor") is None and "factor" in scaling and not cfg.get("max_position_embeddings"):
        missing.append("max_position_embeddings (to derive its null factor)")
    if missing:
        raise DFlashError(f"{where}: rope scaling type {kind!r} lacks {', '.join(missing)}")
    for key, value in scaling.items():
        if value is None or key == "rope_type":
            continue
        if key == "truncate":
            ok, want = isinstance(value, bool), "true or false"
        elif key == "original_max_position_embeddings":
            ok, want = isinstance(value, int) and not isinstance(value, bool) and value >= 1, "an integer >= 1"
        else:  # factor, low/high_freq_factor, beta_fast/slow, attention_factor, mscale, mscale_all_dim
            low = 0 if key in ("mscale", "mscale_all_dim") else None  # (mscale_all_dim 0 turns it off)
            ok = finite_number(value) and (
                value >= low if low is not None else value > 0)
            want = "a number >= 0" if low is not None else "a number > 0"
        if not ok:
            raise DFlashError(f"{where}.{key} must be {want}, got {value!r}")
    return float(theta), scaling


def transformers_default(model_type: str, key: str) -> float | None:
    """The default of ``key`` in transformers' config class of ``model_type`` (a multimodal
    wrapper without it: its text config class's), e.g. ``max_position_embeddings``, or
    ``default_theta`` (the RoPE base it takes when a config gives none); None where
    transformers has no such model type, or the class no such numeric default."""
    from transformers import CONFIG_MAPPING

    try:
        cls = CONFIG_MAPPING[model_type]
    except (KeyError, ImportError):
        return None
    if not hasattr(cls, key):
        cls = getattr(cls, "sub_configs", {}).get("text_config", cls)
    value = getattr(cls, key, None)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _require(cfg: dict, keys: list[str], what: str) -> None:
    """Each of ``keys`` is in ``cfg``, not null, and a positive integer (:func:`check_int`).

    Raises:
        DFlashError: a key missing or null (all such ones named) or not an integer >= 1.
    """
    missing = [k for k in keys if cfg.get(k) is None]
    if missing:
        raise DFlashError(f"{what} config.json lacks {', '.join(missing)}")
    for k in keys:
        check_int(cfg, k, what)


def architectures(cfg: dict, what: str) -> list[str]:
    """``cfg["architectures"]``: a list of class names (``[]`` when absent or null).

    Raises:
        DFlashError: anything but a list of strings.
    """
    archs = cfg.get("architectures")
    if archs is None:
        return []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise DFlashError(f"{what} config.json architectures must be a list of class names, got {archs!r}")
    return archs


def object_field(cfg: dict, key: str, what: str) -> dict | None:
    """``cfg[key]``: absent or null (None), or a JSON object (a dict).

    Raises:
        DFlashError: any other value.
    """
    value = cfg.get(key)
    if value is not None and not isinstance(value, dict):
        raise DFlashError(f"{what} config.json {key} must be an object, got {value!r}")
    return value


def finite_number(value) -> bool:
    """Whether ``value`` is a JSON number (an int or a float, not a bool) whose float is finite
    (an integer too large for a float, e.g. a 1 and 400 zeros, is not: math.isfinite would
    raise OverflowError on it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def number_field(cfg: dict, key: str, what: str, default: float) -> float:
    """``cfg[key]`` as a float, ``default`` when absent or null.

    Raises:
        DFlashError: a value that is not a finite number > 0 (a string, a bool, ...).
    """
    value = cfg.get(key)
    if value is None:
        return default
    if not finite_number(value) or value <= 0:
        raise DFlashError(f"{what} config.json {key} must be a number > 0, got {value!r}")
    return float(value)


def bool_field(cfg: dict, key: str, what: str, default: bool) -> bool:
    """``cfg[key]``, a JSON true / false; ``default`` when absent or null.

    Raises:
        DFlashError: any other value (the string ``"false"`` would read as true).
    """
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise DFlashError(f"{what} config.json {key} must be true or false, got {value!r}")
    return value


SILU_NAMES = ("silu", "swish")  # transformers' names of the SwiGLU MLP's activation
GELU_TANH_NAMES = ("gelu_pytorch_tanh", "gelu_tanh")  # transformers' names of GELU with the tanh approximation


def check_activation(cfg: dict, what: str) -> None:
    """Refuse a ``hidden_act`` other than SiLU: every MLP here is SwiGLU with SiLU, so any
    other activation would be decoded as SiLU, unlike the model it names.

    Raises:
        DFlashError: ``{what} config.json hidden_act ... is not supported``.
    """
    act = cfg.get("hidden_act")
    if act is not None and act not in SILU_NAMES:
        raise DFlashError(f"{what} config.json hidden_act {act!r} is not supported (only silu)")


def check_vocab_ids(ids: list[int], vocab_size: int, where: str) -> list[int]:
    """``ids`` (``eos_token_id`` values from the file ``where``), each in ``[0, vocab_size)``.

    Raises:
        DFlashError: an id outside the vocabulary (a stop id that could never be generated).
    """
    for i in ids:
        if i >= vocab_size:
            raise DFlashError(f"{where} eos_token_id {i} is outside the vocabulary of {vocab_size} tokens")
    return ids


def check_int(cfg: dict, key: str, what: str, minimum: int = 1):
    """``cfg[key]`` when it is absent or null (returned as is) or an integer >= ``minimum``.

    Raises:
        DFlashError: ``{what} config.json {key} must be an integer >= {minimum}, got ...``
            (for a string, a float, a bool, a list, ... or a smaller integer).
    """
    value = cfg.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise DFlashError(f"{what} config.json {key} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass
class LinearAttentionConfig:
    """Shape of the Gated DeltaNet layers of a hybrid target (Hugging Face ``linear_*`` keys)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int


@dataclass
class MoEConfig:
    """A target's sparse mixture-of-experts MLP (Hugging Face ``num_experts``,
    ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``,
    ``shared_expert_intermediate_size``; 0 = no shared expert)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0


@dataclass
class TargetConfig:
    """Shape and hyper-parameters of a target model (one decoder-only LLM).

    The common fields come first; hybrid and mixture-of-experts families add
    ``layer_types`` (``"full_attention"`` / ``"linear_attention"`` per layer, default all
    attention), ``linear_attention``, ``moe`` with ``moe_layers`` (which layers use it),
    ``attention_output_gate`` and ``partial_rotary_factor``. :meth:`from_dict` hands a
    ``config.json`` to the parser of its family module (:mod:`.registry`).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: list[int] = field(default_factory=list)
    partial_rotary_factor: float = 1.0
    layer_types: list[str] = field(default_factory=list)
    attention_output_gate: bool = False
    linear_attention: LinearAttentionConfig | None = None
    moe: MoEConfig | None = None
    moe_layers: list[bool] = field(default_factory=list)
    mtp_layers: int = 0  # multi-token-prediction layers stored as model.layers.{num_hidden_layers + i}: not read
    checkpoint_prefix: str = "model."  # where the decoder's weights live in the checkpoint
    mxfp4: bool = False  # the checkpoint stores its expert matrices in MXFP4 (gpt-oss; see mxfp4.py)
    keep_mxfp4: bool = False  # hold them packed, dequantizing the experts each forward runs (set when loading)
    fp8_block: tuple[int, int] | None = None  # weight_block_size of a fine-grained FP8 checkpoint (see fp8.py)
    fp8_scale_fmt: str = "float"  # its scale_fmt: "float", or "ue8m0" (one-byte powers of two, DeepSeek-V4)
    fp4_experts: bool = False  # its routed experts are FP4 (DeepSeek-V4's expert_dtype "fp4"; mxfp4 is then True)
    keep_fp8: bool = False  # hold its weights as stored, dequantizing them each forward (set when loading)
    int_quant: tuple[int, int | None] | None = None  # (bits, group_size) of packed integer weights (see packed_int.py)
    keep_int: bool = False  # hold them packed, dequantizing them each forward (set when loading)
    # NVFP4 / ModelOpt weights (see nvfp4.py; dequantized when loading unless keep_nvfp4): "compressed-tensors"
    # (nvfp4-pack-quantized), "modelopt" (ModelOpt NVFP4), "modelopt-fp8" (ModelOpt per-tensor FP8) or
    # "modelopt-mixed" (both); None: none
    nvfp4: str | None = None
    keep_nvfp4: bool = False  # hold the NVFP4 weights packed, dequantizing them each forward (set when loading)

    @property
    def feature_size(self) -> int:
        """Values of one layer's feature row (``TargetModel.forward``'s ``feature_layers``):
        ``hidden_size`` here; a family whose residual stream is wider (several streams)
        says more."""
        return self.hidden_size

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if not self.moe_layers:
            self.moe_layers = [self.moe is not None] * self.num_hidden_layers

    @classmethod
    def from_dict(cls, cfg: dict) -> "TargetConfig":
        """Parse a target ``config.json`` with the parser of its family.

        Raises:
            DFlashError: unsupported family, a DFlash drafter passed as target, a quantized
                checkpoint, or missing / inconsistent keys.
        """
        from .registry import family

        archs = architectures(cfg, "target")
        if any(a.startswith("DFlash") for a in archs):
            raise OptionError("target must be the target LLM's checkpoint, not a DFlash drafter's", "target")
        from . import fp8, nvfp4, packed_int

        module = family(cfg.get("model_type"))
        refuse_quantized(cfg, "target", allowed=getattr(module, "QUANTIZATION_METHODS", ()))
        check_dtype_field(cfg, "target")
        config = module.parse_config(cfg)
        quant = quantization_config(cfg)
        if quant is not None and quant.get("quant_method") == "fp8":
            config.fp8_block = fp8.check_config(quant, "target")
            config.fp8_scale_fmt = fp8.scale_format(quant, "target")
            if fp8.expert_format(cfg, quant, "target") == "fp4":
                if not getattr(module, "FP4_EXPERTS", False):
                    raise DFlashError(f"the target checkpoint declares expert_dtype 'fp4' (FP4 experts); dflash-torch "
                                      f"reads those for deepseek_v4 only, not {cfg.get('model_type')!r}")
                config.fp4_experts = config.mxfp4 = True  # (the experts' numbers are MXFP4's: --mxfp4 says how to hold them)
        if quant is not None and quant.get("quant_method") == packed_int.METHOD:
            groups = quant.get("config_groups")
            formats = {quant.get("format")} | {g.get("format") for g in (groups.values() if isinstance(groups, dict)
                                                                        else ()) if isinstance(g, dict)}
            if nvfp4.CT_FORMAT in formats:
                nvfp4.check_ct_config(quant, "target")
                config.nvfp4 = nvfp4.CT_METHOD
            else:
                config.int_quant = packed_int.check_config(quant, "target")
        if quant is not None and quant.get("quant_method") == nvfp4.MODELOPT:
            config.nvfp4 = nvfp4.check_modelopt_config(quant, "target")
        return config


def check_dtype_field(cfg: dict, what: str) -> None:
    """Raise :class:`DFlashError` when the ``what`` ``config.json`` names a weight dtype
    (``torch_dtype`` / ``dtype``, top level or in ``text_config``) that torch does not know.
    The engine loads in the dtype it is asked for, so such a value (a corrupt file) passed
    unnoticed, except where transformers' tokenizer loader reads this file: its error then
    blamed the tokenizer. ``"auto"`` passes at the top level (the tokenizer loader reads it as
    absent), not in ``text_config``, where transformers' config classes fail on it."""
    text = cfg.get("text_config")
    for where, prefix in ((cfg, ""), (text if isinstance(text, dict) else {}, "text_config.")):
        for key in ("torch_dtype", "dtype"):
            value = where.get(key)
            if value is None or (value == "auto" and not prefix):
                continue
            if value == "auto":
                raise DFlashError(f"{what} config.json {prefix}{key} 'auto' is not read by transformers' config classes "
                                  "(they fail on it; only a top-level dtype may be 'auto'): give the weights' dtype "
                                  "(e.g. 'bfloat16') or remove it")
            if not isinstance(value, str) or not isinstance(getattr(torch, value.removeprefix("torch."), None), torch.dtype):
                raise DFlashError(f"{what} config.json {prefix}{key} {value!r} is not a torch dtype (e.g. 'bfloat16')")


def refuse_quantized(cfg: dict, what: str, allowed: tuple[str, ...] = ()) -> None:
    """Raise :class:`DFlashError` when the ``what`` (target / drafter) ``config.json`` has a
    ``quantization_config`` (top level or in ``text_config``) whose ``quant_method`` is not
    in ``allowed`` (the methods its family dequantizes when loading, e.g. gpt-oss's mxfp4).
    A ``quantization_config`` that is not an object, or has no ``quant_method``, is refused
    as such (it read as ``quant_method 'unknown'``)."""
    quant, key = _quantization_entry(cfg)
    if not quant:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method is not None and method in allowed:
        return
    model_type = cfg.get("model_type")
    also = (f" (and {', '.join(allowed)} for this model_type)" if allowed
            else f" for model_type {model_type!r}" if isinstance(model_type, str) and what == "target" else "")
    reads = f"dflash-torch reads unquantized float32/bfloat16/float16 weights only{also}"
    if not isinstance(quant, dict):
        raise DFlashError(f"{what} config.json {key} must be an object naming its quant_method, got {json_type(quant)} "
                          f"{shown(quant)}; {reads}")
    if method is None:
        raise DFlashError(f"{what} config.json {key} has no quant_method (which names how the weights are quantized, "
                          f"e.g. 'fp8'); {reads}")
    raise DFlashError(f"the {what} checkpoint is quantized (quant_method {method!r}); {reads}")


def _quantization_entry(cfg: dict) -> tuple[object, str]:
    """``(value, key)`` of a ``config.json``'s ``quantization_config``: the top-level one
    (``key`` ``"quantization_config"``), else ``text_config``'s (``"text_config.quantization_config"``);
    ``(None, "")`` where neither is set (absent, null or empty)."""
    if cfg.get("quantization_config"):
        return cfg["quantization_config"], "quantization_config"
    text = cfg.get("text_config")
    if isinstance(text, dict) and text.get("quantization_config"):
        return text["quantization_config"], "text_config.quantization_config"
    return None, ""


def quantization_config(cfg: dict) -> dict | None:
    """The ``quantization_config`` of a ``config.json`` (top level, else in ``text_config``),
    None when there is none (absent, null or empty). A value that is not an object reads as
    ``{"quant_method": "unknown"}``, which no family allows (:func:`refuse_quantized` refuses
    it first)."""
    quant, _ = _quantization_entry(cfg)
    if not quant:
        return None
    return quant if isinstance(quant, dict) else {"quant_method": "unknown"}


# the RoPE bases of the config classes whose default is not 10000, for a transformers whose config
# classes do not state them as class attributes (transformers_default then knows none)
_DEFAULT_THETA = {"gpt_oss": 150000.0, "minimax_m2": 5_000_000.0}


def base_target_fields(cfg: dict, model_type: str) -> dict:
    """The common :class:`TargetConfig` fields of a (text) ``config.json`` dict. Where it
    gives no ``max_position_embeddings`` or no ``rope_theta``, those of transformers' config
    class of ``model_type`` apply (:func:`transformers_default`; the RoPE rule sees that
    context length too, as transformers' does).

    Raises:
        DFlashError: missing keys (``max_position_embeddings`` too, where transformers has
            no default for ``model_type``), unsupported rope scaling.
    """
    _require(cfg, ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"], "target")
    for key in ("num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings"):
        check_int(cfg, key, "target", minimum=MIN_POSITIONS if key == "max_position_embeddings" else 1)
    check_activation(cfg, "target")
    if cfg.get("max_position_embeddings") is None:
        default = transformers_default(model_type, "max_position_embeddings")
        if default is None:
            raise DFlashError(f"target config.json lacks max_position_embeddings (transformers has no default for "
                              f"model_type {model_type!r})")
        cfg = dict(cfg, max_position_embeddings=default)
    heads = cfg["num_attention_heads"]
    default_theta = transformers_default(model_type, "default_theta") or _DEFAULT_THETA.get(model_type, 10000.0)
    theta, scaling = _rope(cfg, "target", default_theta)
    eos = check_vocab_ids(eos_token_ids(cfg.get("eos_token_id"), "target config.json"), cfg["vocab_size"],
                          "target config.json")
    return dict(
        model_type=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg.get("intermediate_size") or 0,
        rms_norm_eps=number_field(cfg, "rms_norm_eps", "target", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg["max_position_embeddings"],
        tie_word_embeddings=bool_field(cfg, "tie_word_embeddings", "target", False),
        attention_bias=bool_field(cfg, "attention_bias", "target", False),
        qk_norm=False,
        eos_token_ids=eos,
        partial_rotary_factor=rotary_fraction(cfg),
    )


def refuse_partial_rotary(fields: dict, model_type: str) -> None:
    """Refuse a ``partial_rotary_factor`` below 1 for a family whose transformers class
    rotates whole heads (its plain RoPE ignores the factor; with a scaling rule, the rotated
    size and the heads disagree): decoded either way, it would not be the model the file names.

    Raises:
        DFlashError: ``fields["partial_rotary_factor"]`` (from :func:`base_target_fields`) < 1.
    """
    if fields["partial_rotary_factor"] != 1.0:
        raise DFlashError(f"target partial_rotary_factor {fields['partial_rotary_factor']} is not supported for "
                          f"model_type {model_type!r} (transformers' {model_type} rotates whole heads)")


def refuse_sliding_layers(cfg: dict, model_type: str) -> None:
    """Refuse a ``qwen2`` / ``qwen3`` / ``qwen3_moe`` target whose layers slide as transformers'
    config class resolves the file (dflash-torch runs these families with full attention), or
    that names ``sliding_attention`` layers transformers gives no window (its forward fails on
    them; dflash-torch ran them silently with full attention). As transformers reads it: the
    window is ``sliding_window`` (default 4096) where ``use_sliding_window`` is true, else none;
    qwen2 / qwen3 layers are ``layer_types``, else sliding from ``max_window_layers`` (default
    28) on where there is a window; every qwen3_moe layer slides where there is a window (it
    reads no layer types). So ``use_sliding_window: true`` where no layer slides runs, as in
    transformers. ``llama`` reads none of these keys (transformers' runs no window): nothing
    is refused.

    Raises:
        DFlashError: sliding layers, with a window or without one; a ``layer_types`` or
            ``max_window_layers`` of the wrong type; ``num_hidden_layers`` missing or not an
            integer >= 1.
    """
    if model_type not in ("qwen2", "qwen3", "qwen3_moe"):
        return
    _require(cfg, ["num_hidden_layers"], "target")
    n = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window", 4096) if bool_field(cfg, "use_sliding_window", "target", False) else None
    if model_type == "qwen3_moe":
        types = ["full_attention" if window is None else "sliding_attention"] * n
    elif cfg.get("layer_types") is not None:
        types = check_layer_types(cfg["layer_types"], n, ("full_attention", "sliding_attention"), model_type)
    else:
        first = check_int(cfg, "max_window_layers", "target", minimum=0)
        first = 28 if first is None else first
        types = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(n)]
    sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    if sliding and window is None:
        raise DFlashError("target config.json layer_types has sliding_attention layers but no window (sliding_window "
                          "is null, or use_sliding_window false turns it off, as transformers reads the file): "
                          "transformers' forward fails on them; make them full_attention if the model has no window")
    if sliding:
        raise DFlashError(f"target config.json slides {len(sliding)} of {n} layers over {window} tokens "
                          f"(use_sliding_window true): sliding-window attention is not supported for model_type "
                          f"{model_type!r}")


def eos_token_ids(value, where: str) -> list[int]:
    """An ``eos_token_id`` value (null, an id, or a list of ids) as a list of ids.

    Raises:
        DFlashError: anything else (``where`` names the file in the message).
    """
    ids = [] if value is None else [value] if not isinstance(value, list) else value
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise DFlashError(f"{where} eos_token_id must be a token id or a list of them, got {value!r}")
    return list(ids)


def rotary_fraction(cfg: dict, default: float = 1.0) -> float:
    """``partial_rotary_factor`` (the fraction of each head that RoPE rotates) from
    ``rope_parameters`` (transformers 5 layout) or the top level (older layout)."""
    params = cfg.get("rope_parameters") or {}
    value = params.get("partial_rotary_factor")
    value = cfg.get("partial_rotary_factor") if value is None else value
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise DFlashError(f"target partial_rotary_factor must be a number in (0, 1], got {value!r}")
    return float(value)


def layer_types(cfg: dict) -> list[str]:
    """Per-layer token mixer of a hybrid config: ``layer_types``, or every
    ``full_attention_interval``-th layer (default 4) full attention, the rest linear.

    Raises:
        DFlashError: a ``layer_types`` of the wrong length or with an unknown type.
    """
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        interval = check_int(cfg, "full_attention_interval", "target") or 4
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    return check_layer_types(types, n, ("full_attention", "linear_attention"))


def derived_layout_note(cfg: dict, missing: list[str], unused: list[str]) -> str:
    """A note to follow ``lacks weights: ...`` of a hybrid checkpoint whose config.json gives no
    ``layer_types`` (laid out by :func:`layer_types` from ``full_attention_interval``), where a
    layer that lacks weights holds others the layout does not take (a checkpoint laid out
    otherwise): which layers, and that ``layer_types`` sets the layout; "" where none does.
    ``missing`` and ``unused`` are checkpoint names (``model.layers.{i}.`` ...)."""
    if cfg.get("layer_types") is not None:
        return ""

    def layers(names):
        return {int(m.group(1)) for n in names if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", n))}

    both = sorted(layers(missing) & layers(unused))
    if not both:
        return ""
    interval = cfg.get("full_attention_interval")
    how = f"full_attention_interval {interval}" if interval is not None else "full_attention_interval's default (4)"
    every = interval if interval is not None else 4
    listed = ", ".join(map(str, both[:5])) + (" ..." if len(both) > 5 else "")
    layout = "full attention in every layer" if every == 1 else \
        f"full attention every {every} layers, linear attention between"
    return (f" (config.json gives no layer_types, so {how} lays out the layers: {layout}; layer"
            f"{'s' if len(both) > 1 else ''} {listed} hold{'' if len(both) > 1 else 's'} weights of the other kind: give "
            "layer_types as the checkpoint's layers are)")


def check_layer_types(types, n: int, supported: tuple[str, ...], family: str | None = None) -> list[str]:
    """A target's ``layer_types`` value: a list of ``n`` type names, each in ``supported``
    (``family``: the model_type to name in the message when a type is not supported).

    Raises:
        DFlashError: not a list of strings, a list of another length, or an unsupported type.
    """
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise DFlashError(f"target layer_types must be a list of {n} layer type names (num_hidden_layers), got {types!r}")
    if len(types) != n:
        raise DFlashError(f"target layer_types has {len(types)} entries but num_hidden_layers is {n}")
    unknown = sorted(set(types) - set(supported))
    if unknown:
        by = f" by {family}" if family else ""
        raise DFlashError(f"target layer_types {unknown} are not supported{by} ({', '.join(supported)})")
    return list(types)


def linear_attention_config(cfg: dict) -> LinearAttentionConfig:
    """The Gated DeltaNet shape of a hybrid config.

    Raises:
        DFlashError: missing keys, or value heads not a multiple of key heads.
    """
    keys = ["linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"]
    _require(cfg, keys, "target")
    la = LinearAttentionConfig(*(cfg[k] for k in keys), conv_kernel=check_int(cfg, "linear_conv_kernel_dim", "target") or 4)
    if la.num_value_heads % la.num_key_heads:
        raise DFlashError(f"target linear_num_value_heads {la.num_value_heads} is not a multiple of "
                          f"linear_num_key_heads {la.num_key_heads}")
    return la


def moe_config(cfg: dict, *, norm_topk_prob: bool | None = None, shared_expert: bool = False) -> MoEConfig:
    """The mixture-of-experts MLP of a config (``norm_topk_prob`` forced when the family
    always renormalises; ``shared_expert`` reads ``shared_expert_intermediate_size``).

    Raises:
        DFlashError: missing keys or a top-k larger than the number of experts.
    """
    cfg = dict(cfg)
    if "num_experts" not in cfg and "num_local_experts" in cfg:  # transformers 5 writes Qwen3-MoE's under this name
        cfg["num_experts"] = cfg["num_local_experts"]
    _require(cfg, ["num_experts", "num_experts_per_tok", "moe_intermediate_size"], "target")
    moe = MoEConfig(
        num_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["moe_intermediate_size"],
        norm_topk_prob=bool_field(cfg, "norm_topk_prob", "target", False) if norm_topk_prob is None else norm_topk_prob,
        shared_expert_intermediate_size=(check_int(cfg, "shared_expert_intermediate_size", "target") or 0)
        if shared_expert else 0,  # (0 read as "lacks" it: the family needs one)
    )
    if not 1 <= moe.top_k <= moe.num_experts:
        raise DFlashError(f"target num_experts_per_tok {moe.top_k} must be in [1, num_experts={moe.num_experts}]")
    if shared_expert and not moe.shared_expert_intermediate_size:
        raise DFlashError("target config.json lacks shared_expert_intermediate_size")
    return moe


def sparse_layers(cfg: dict, num_experts: int) -> list[bool]:
    """Which layers use the MoE MLP (Qwen3-MoE / Qwen3-Next rule): layer i unless it is in
    ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``.

    Raises:
        DFlashError: ``decoder_sparse_step`` not an integer >= 1, ``mlp_only_layers`` not a
            list of integers.
    """
    step = check_int(cfg, "decoder_sparse_step", "target") or 1
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise DFlashError(f"target config.json mlp_only_layers must be a list of layer indices, got {dense!r}")
    dense = set(dense)
    return [num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(cfg["num_hidden_layers"])]


@contextlib.contextmanager
def quiet_transformers():
    """transformers' log lines and Python warnings silenced (its notices about a config it
    reads, e.g. deprecated ``rope_scaling`` or a YaRN factor, are not actionable in dflash-torch)."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)
