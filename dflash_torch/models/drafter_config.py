"""Drafter configurations parsed from Hugging Face ``config.json`` dicts.

The published DFlash format (``architectures: ["DFlashDraftModel"]``, see the DFlash
reference implementation z-lab/dflash, ``dflash/model.py``), the DFlash 2 format
(``architectures: ["DFlash2DraftModel"]``, :class:`DFlash2Settings`) and transformers'
own DFlash "assistant" drafters parse into :class:`DrafterConfig`; the Speculators and
Laguna DFlash formats are read by their own modules (``speculators.py``,
``laguna_drafter.py``). :func:`validate_pair` checks a drafter against its target
(:class:`~dflash_torch.models.config.TargetConfig`).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import DFlashError
from .config import (GELU_TANH_NAMES, SILU_NAMES, TargetConfig, _require, _rope, architectures, bool_field, check_int,
                     finite_number, number_field, object_field, quiet_transformers, refuse_quantized)

if TYPE_CHECKING:
    from .laguna_drafter import LagunaDraftSettings
    from .speculators import SpeculatorsSettings

log = logging.getLogger("dflash_torch")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference rule for ``target_layer_ids`` when a drafter config omits them.

    One drafter layer reads the middle target layer (L // 2); N > 1 layers read N ids
    spread evenly from layer 1 to layer L - 3 (DFlash reference, ``build_target_layer_ids``;
    below 4 target layers that range is empty and the ids come out negative).
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


# DFlash 2 keys of ``dflash_config`` (a top-level key of the same name is read too)
DFLASH2_REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# keys of drafter training variants that change what the drafter computes, with the values we
# run (the first is named in the error; null reads as unset): a DFlash, DFlash 2 or Speculators
# config that sets another value is refused rather than run wrongly (refuse_variants)
# ("dflash": speculators' name of the plain DFlash projector, the alternative to its Domino one)
VARIANT_KEYS = {"projector_type": (None, "dflash"), "shift_label": (False,), "pure_draft_prefix_len": (0,),
                "attention_mode": ("gqa",)}
# (DFlash 2: block attention non-causal, whichever key says it: is_causal, or dflash_config.causal as Laguna's DFlash has it)
DFLASH2_VARIANT_KEYS = {**VARIANT_KEYS, "projector_type": (None,), "is_causal": (False,), "causal": (False,)}


def refuse_variants(value, kind: str, keys: dict[str, tuple]) -> None:
    """Refuse a drafter trained as a variant dflash-torch does not run: ``sample_from_anchor``
    true (the anchor slot predicts too, a DSpark-style block), or a key of ``keys``
    (e.g. :data:`VARIANT_KEYS`) set to a value outside its tuple. ``value(key)``: the
    config's value of ``key`` (None when absent); ``kind``: the format, for the message.

    Raises:
        DFlashError: one line naming the key and its value.
    """
    anchor = value("sample_from_anchor")
    if anchor is not None and not isinstance(anchor, bool):
        raise DFlashError(f"drafter config.json sample_from_anchor must be true or false, got {anchor!r}")
    if anchor:
        raise DFlashError("drafter config.json has sample_from_anchor true (the anchor slot predicts too, a "
                          "DSpark-style block); dflash-torch runs DFlash blocks whose anchor is the last committed token")
    for key, runs in keys.items():
        got = value(key)
        if got is not None and got not in runs:
            named = " or ".join(repr(r) for r in runs if r is not None)
            runs_ = f"{key}={named}{' (or unset)' if None in runs else ''}" if named else f"{key} unset"
            raise DFlashError(f"{kind} drafter config sets {key}={got!r}; only {runs_} is supported")


class NotADrafterError(DFlashError):
    """The drafter's config.json is not a DFlash drafter's (a target's, say): its loader names
    the checkpoint it read, a local directory that shadows a Hub id too (see
    :func:`dflash_torch.hub.loaded_from`)."""


@dataclass
class DFlash2Settings:
    """The two modules a DFlash 2 drafter adds to the DFlash backbone
    (:mod:`dflash_torch.models.dflash2`).

    Attributes:
        conv_kernel_size: taps of the grouped dynamic convolutions (2 in the published one).
        conv_group_size: channels per group sharing one dynamic tap weight (16);
            divides ``hidden_size``.
        selector_rank: rank of the candidate selector's codebooks (256).
        selector_top_k: candidates kept per draft slot (16), at most the vocabulary.
        input_embedding_scale: factor on the block's token embeddings (default 1).
        output_multiplier: factor on the draft logits before the selector (default 1).
        final_logit_softcapping: ``cap`` of ``tanh(v / cap) * cap`` on the draft logits
            after ``output_multiplier``, or None (default).
        selector_vocab_size: the selector proposes token ids below it only (NeMo-Automodel's
            export: the tokenizer's ids, the rows past them padding of the embedding table),
            or None (default): the whole vocabulary.
    """

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    selector_vocab_size: int | None = None

    @classmethod
    def from_dict(cls, cfg: dict, hidden_size: int, vocab_size: int | None) -> "DFlash2Settings":
        """Read the DFlash 2 keys of a drafter ``config.json`` (``dflash_config`` first, then
        the top level, as the public DFlash 2 ports do).

        Raises:
            DFlashError: a required key missing, a value out of range, no ``vocab_size``
                (the codebooks have one row per token), or a variant key we do not run.
        """
        dflash = cfg.get("dflash_config") or {}

        def value(key, default=None):
            return dflash.get(key, cfg.get(key, default))

        missing = [k for k in DFLASH2_REQUIRED if value(k) is None]
        if missing:
            raise DFlashError(f"DFlash 2 drafter config.json lacks dflash_config.{', dflash_config.'.join(missing)}")
        refuse_variants(value, "DFlash 2", DFLASH2_VARIANT_KEYS)
        ints = {k: value(k) for k in DFLASH2_REQUIRED}
        bad = [k for k, v in ints.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad:
            raise DFlashError(f"DFlash 2 drafter {bad[0]} must be an integer >= 1, got {ints[bad[0]]!r}")
        if hidden_size % ints["conv_group_size"]:
            raise DFlashError(f"DFlash 2 drafter conv_group_size {ints['conv_group_size']} does not divide hidden_size {hidden_size}")
        if vocab_size is None:
            raise DFlashError("DFlash 2 drafter config.json lacks vocab_size (the selector codebooks have one row per token)")
        if ints["selector_top_k"] > vocab_size:
            raise DFlashError(f"DFlash 2 drafter selector_top_k {ints['selector_top_k']} exceeds vocab_size {vocab_size}")
        return cls(**ints, **draft_scaling(value, "DFlash 2 drafter"),
                   selector_vocab_size=_selector_vocab(value("selector_vocab_size"), ints["selector_top_k"], vocab_size))

    def to_dict(self) -> dict:
        """The ``dflash_config`` entries (optional ones only when not the default)."""
        out = {k: getattr(self, k) for k in DFLASH2_REQUIRED}
        out.update(draft_scaling_dict(self))
        if self.selector_vocab_size is not None:
            out["selector_vocab_size"] = self.selector_vocab_size
        return out


DRAFT_SCALING_KEYS = ("input_embedding_scale", "output_multiplier", "final_logit_softcapping")
# the largest factor a drafter config may put on its embeddings or logits (published ones are near 1; a far larger
# one turns draft logits into inf, and every sampled draft into torch's "probability tensor contains inf" error)
MAX_DRAFT_FACTOR = 1e6


def draft_scaling(value, kind: str) -> dict:
    """The DFlash reference's three factors on a DFlash or DFlash 2 drafter's math (z-lab/dflash,
    ``dflash/model.py``, which reads each from ``dflash_config``, else the top level, for both
    formats): ``input_embedding_scale`` (default 1) multiplies the block's token embeddings
    before the first layer; ``output_multiplier`` (default 1) multiplies the draft logits
    (the LM head on the final-normed rows), and then ``final_logit_softcapping`` (default
    None: none) caps them, ``tanh(v / cap) * cap``. ``value(key)``: the config's value of
    ``key`` (None when absent or null); ``kind``: the format, for messages.

    Returns:
        ``{"input_embedding_scale": float, "output_multiplier": float, "final_logit_softcapping": float | None}``.

    Raises:
        DFlashError: a value that is not a finite number of magnitude at most
            :data:`MAX_DRAFT_FACTOR`, or a soft cap <= 0 (one line).
    """
    got = {k: value(k) for k in DRAFT_SCALING_KEYS}
    for k, v in got.items():
        if v is not None and (not finite_number(v) or abs(v) > MAX_DRAFT_FACTOR):
            raise DFlashError(f"{kind} {k} must be a finite number of magnitude at most {MAX_DRAFT_FACTOR:g}, got {v!r}")
    cap = got["final_logit_softcapping"]
    if cap is not None and cap <= 0:
        raise DFlashError(f"{kind} final_logit_softcapping must be > 0 (or null for none), got {cap!r}")
    return {"input_embedding_scale": 1.0 if got["input_embedding_scale"] is None else float(got["input_embedding_scale"]),
            "output_multiplier": 1.0 if got["output_multiplier"] is None else float(got["output_multiplier"]),
            "final_logit_softcapping": None if cap is None else float(cap)}


def draft_scaling_dict(settings) -> dict:
    """The ``dflash_config`` entries of :func:`draft_scaling`'s three keys that ``settings`` (a
    :class:`DFlash2Settings` or :class:`DrafterConfig`) sets to other than the default."""
    out = {}
    if settings.input_embedding_scale != 1.0:
        out["input_embedding_scale"] = settings.input_embedding_scale
    if settings.output_multiplier != 1.0:
        out["output_multiplier"] = settings.output_multiplier
    if settings.final_logit_softcapping is not None:
        out["final_logit_softcapping"] = settings.final_logit_softcapping
    return out


def _selector_vocab(size, top_k: int, vocab_size: int) -> int | None:
    """A DFlash 2 ``selector_vocab_size`` checked: None, or an integer from ``top_k`` (the
    candidates it must hold) to ``vocab_size``.

    Raises:
        DFlashError: any other value.
    """
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or not top_k <= size <= vocab_size):
        raise DFlashError(f"DFlash 2 drafter selector_vocab_size must be an integer from selector_top_k ({top_k}) to "
                          f"vocab_size ({vocab_size}), got {size!r}")
    return size


LAGUNA_ARCHITECTURE = "DFlashLagunaForCausalLM"  # poolside's Laguna DFlash drafters (models/laguna_drafter.py)

# transformers' own DFlash drafters ("assistant" models, run by its DFlashTokenCandidateGenerator):
# a DFlash drafter whose config keeps block_size, mask_token_id and target_layer_ids at the
# top level and whose context projection (fc, hidden_norm) is named encoder.fc, encoder.output_norm_enc
ASSISTANT_ARCHITECTURES = ("MuseGlimmerAssistantModel",)
# the DFlash drafter classes read (an architecture naming DFlash that is none of these is refused:
# a later format may keep these weight names and read them differently)
KNOWN_DFLASH_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel", LAGUNA_ARCHITECTURE)
ASSISTANT_WEIGHTS = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
# what transformers' MuseGlimmerAssistantConfig takes when a key is absent (every layer a window of 2048)
ASSISTANT_DEFAULTS = {"sliding_window": 2048, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072}
ASSISTANT_ROPE_THETA = 500000.0  # (its default_theta: where neither its rope dict nor the top level gives one)


# what the DFlash reference's drafter (z-lab/dflash, ``dflash/model.py``) reads from its config object,
# besides the RoPE keys: where a drafter's config.json leaves one out, the default of transformers' config class
# of its model_type applies (:func:`with_transformers_defaults`)
# (and max_position_embeddings, which its RoPE reads only for a llama3 / yarn rule's original context length)
REFERENCE_CONFIG_KEYS = ("num_key_value_heads", "head_dim", "rms_norm_eps", "attention_bias", "hidden_act",
                         "layer_types", "sliding_window")


def one_rope_for_every_layer(cfg: dict) -> dict:
    """``cfg`` with a ``rope_parameters`` given per layer type (``{"full_attention": {...},
    "sliding_attention": {...}}``, as transformers 5 writes it) read as the one RoPE its
    entries all give (as the Speculators reader flattens them): dflash-torch's DFlash drafter
    runs one RoPE in every layer. Other configs come back as they are.

    Raises:
        DFlashError: entries that differ, or keys besides the layer types (one line).
    """
    rope = cfg.get("rope_parameters")
    kinds = ("full_attention", "sliding_attention")
    if not isinstance(rope, dict) or not any(k in kinds for k in rope):
        return cfg
    entries = list(rope.values())
    if any(k not in kinds for k in rope) or not all(isinstance(e, dict) for e in entries) or any(
            e != entries[0] for e in entries):
        raise DFlashError(f"drafter config.json rope_parameters gives one RoPE per layer type ({', '.join(rope)}) and "
                          f"they differ: {rope!r}; dflash-torch's DFlash drafter runs one RoPE in every layer")
    return {**cfg, "rope_parameters": dict(entries[0])}


def transformers_config_class(model_type) -> type | None:
    """transformers' config class of ``model_type`` (None: not a model type it knows)."""
    if not isinstance(model_type, str):
        return None
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        return CONFIG_MAPPING[model_type]
    except (ImportError, KeyError, ValueError):
        return None


def with_transformers_defaults(cfg: dict) -> dict:
    """A DFlash-format drafter ``config.json`` dict completed as the DFlash reference reads it:
    the reference builds its drafter from the config object transformers makes of the file
    (``AutoConfig``: the config class of its ``model_type``), so a key the file leaves out
    takes that class's value. Here :data:`REFERENCE_CONFIG_KEYS`, where the file has no
    ``rope_scaling`` / ``rope_parameters`` the RoPE rule (``rope_parameters``, or the older
    ``rope_scaling`` + ``rope_theta``), and for a llama3 / yarn rule ``max_position_embeddings``,
    each where absent or null in ``cfg``, are taken from
    ``transformers.AutoConfig.for_model(model_type, **cfg)`` (given a deep copy of ``cfg``'s
    non-null keys: a null, or a ``dtype`` / ``torch_dtype`` "auto", reads as absent, as everywhere in dflash-torch's parser,
    but for ``num_key_value_heads``, whose null transformers' classes read as ``num_attention_heads``; its log
    lines and warnings silenced); e.g. a ``gpt_oss`` drafter gets gpt-oss's alternating
    128-token sliding-window layers and YaRN RoPE, a ``qwen3`` one with
    ``use_sliding_window`` and ``max_window_layers`` the layer types transformers derives from
    them. Values the file gives are kept; a ``sliding_window`` the file leaves out is not
    taken where ``dflash_config.swa_window_size`` gives the window (vLLM's DFlash drafter
    uses that). A ``model_type`` transformers does not know (or none) leaves ``cfg`` as it is,
    with a one-line WARNING naming the keys it leaves out, which take dflash-torch's defaults; a file
    transformers refuses too, with a one-line WARNING (logger ``dflash_torch``) naming the
    model type and transformers' reason (the parser's own checks then name a fault in the
    keys dflash-torch reads).

    Returns:
        ``cfg`` itself, or a new dict with the values taken from transformers added.

    Raises:
        DFlashError: ``sliding_attention`` layers and a ``sliding_window`` that transformers'
            class drops (``qwen3``, ``qwen2``, ``qwen3_moe``: ``use_sliding_window`` not true),
            so that transformers and the DFlash reference run those layers with no window
            and vLLM refuses the file.
    """
    model_type = cfg.get("model_type")
    config_class = transformers_config_class(model_type)
    if config_class is None:
        left_out = [k for k in ("num_key_value_heads", "head_dim", "rms_norm_eps", "attention_bias", "hidden_act")
                    if cfg.get(k) is None]
        ropes = [r for r in (cfg.get("rope_parameters"), cfg.get("rope_scaling")) if isinstance(r, dict)]
        if cfg.get("rope_theta") is None and all(r.get("rope_theta") is None for r in ropes):
            left_out.append("rope_theta")
        if left_out:  # (no class to take them from: the DFlash reference's AutoConfig fails on such a file)
            kind = "no model_type" if model_type is None else f"model_type {model_type!r}, which transformers does not know"
            log.warning(f"dflash-torch: WARNING: the drafter's config.json has {kind}, so the keys it leaves out "
                        f"({', '.join(left_out)}) take dflash-torch's defaults (num_key_value_heads: "
                        "num_attention_heads, head_dim: hidden_size / num_attention_heads, rms_norm_eps 1e-06, no "
                        "attention bias, silu, rope_theta 10000), not those of the model type it was trained as: "
                        "set model_type (e.g. qwen3) or the keys")
        return cfg
    # (a dtype "auto" reads as absent, as transformers' from_pretrained given a dtype reads it: its config class
    # alone takes it for a torch dtype's name and fails on torch.auto)
    given = copy.deepcopy({k: v for k, v in cfg.items() if k != "model_type" and v is not None
                           and not (k in ("dtype", "torch_dtype") and v == "auto")})
    if "num_key_value_heads" in cfg and cfg["num_key_value_heads"] is None:
        # (an explicit null is not absent here: transformers' classes read it as num_attention_heads, multi-head
        # attention, where they take it, unlike their default when the key is left out, e.g. Qwen3Config's 32)
        given["num_key_value_heads"] = None
    with quiet_transformers():
        try:
            from transformers import AutoConfig

            hf = AutoConfig.for_model(model_type, **given)
        except Exception as exc:  # (transformers' own validation of a user's file: any of its errors)
            reason = " ".join(str(exc).split())
            log.warning(f"dflash-torch: WARNING: the drafter's config.json does not load in transformers' "
                        f"{config_class.__name__} (model_type {model_type!r}): {reason[:300]}"
                        f"{' ...' if len(reason) > 300 else ''}; the keys it leaves out do not take that class's "
                        "defaults (layer types, sliding window, RoPE rule, ...), as the DFlash reference would")
            return cfg
    dflash = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
    types = cfg.get("layer_types") if cfg.get("layer_types") is not None else getattr(hf, "layer_types", None)
    if (cfg.get("sliding_window") is not None and getattr(hf, "sliding_window", None) is None
            and dflash.get("swa_window_size") is None and isinstance(types, list) and "sliding_attention" in types):
        raise DFlashError(f"drafter config.json has sliding_attention layers and sliding_window "
                          f"{cfg['sliding_window']!r}, but transformers' {config_class.__name__} (model_type "
                          f"{model_type!r}) gives no window (use_sliding_window false turns it off): transformers and "
                          "the DFlash reference run those layers with no window, and vLLM refuses the file; set "
                          "use_sliding_window true")
    filled = {k: getattr(hf, k, None) for k in REFERENCE_CONFIG_KEYS if cfg.get(k) is None}
    if dflash.get("swa_window_size") is not None:  # (the window given: a default sliding_window yields to it)
        filled.pop("sliding_window", None)
    if cfg.get("rope_scaling") is None and cfg.get("rope_parameters") is None:
        params = getattr(hf, "rope_parameters", None)
        if isinstance(params, dict) and "rope_type" in params:  # (transformers 5; not one rule per layer type)
            filled["rope_parameters"] = copy.deepcopy(params)
        elif params is None:  # (transformers 4)
            filled["rope_scaling"] = copy.deepcopy(getattr(hf, "rope_scaling", None))
            if cfg.get("rope_theta") is None:
                filled["rope_theta"] = getattr(hf, "rope_theta", None)
    filled = {k: copy.deepcopy(v) for k, v in filled.items() if v is not None}
    rope = {**cfg, **filled}
    rope = rope.get("rope_scaling") or rope.get("rope_parameters")
    if cfg.get("max_position_embeddings") is None and isinstance(rope, dict) and rope.get(
            "rope_type", rope.get("type")) in ("llama3", "yarn"):
        filled["max_position_embeddings"] = getattr(hf, "max_position_embeddings", None)
    filled = {k: v for k, v in filled.items() if v is not None}
    return {**cfg, **filled} if filled else cfg


def layer_id_list(value, key: str) -> list[int]:
    """A config's list of layer ids checked: a non-empty list of integers.

    Raises:
        DFlashError: anything else (one line naming ``key``).
    """
    if not isinstance(value, list) or not value or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise DFlashError(f"drafter config.json {key} must be a non-empty list of integers, got {value!r}")
    return value


def aux_layer_ids(value, key: str) -> list[int]:
    """Target layers from vLLM's aux hidden-state ids ``value`` (``key`` names them in messages):
    id a is what vLLM captures as the input of target layer a, the output of layer a - 1; read
    in layer order, as vLLM captures them.

    Raises:
        DFlashError: not a non-empty list of integers, an id below 1 (the embedding output, which
            a DFlash-format drafter does not read) or repeated (one line).
    """
    ids = layer_id_list(value, key)
    if min(ids) < 1 or len(set(ids)) != len(ids):
        raise DFlashError(f"drafter config.json {key} {ids} must be distinct ids >= 1 (id a is the output of target "
                          "layer a - 1; 0, the embedding output, is not read by a DFlash drafter)")
    return [a - 1 for a in sorted(ids)]


def eagle_settings(cfg: dict) -> dict:
    """A drafter ``config.json``'s ``eagle_config`` object ({} when absent or null): vLLM's DFlash
    drafter merges it under ``dflash_config``.

    Raises:
        DFlashError: a value that is not an object.
    """
    return object_field(cfg, "eagle_config", "drafter") or {}


# the keys that give vLLM's aux hidden-state ids (id a: the output of target layer a - 1), not target layer ids
AUX_LAYER_KEYS = ("eagle_aux_hidden_state_layer_ids", "dflash_config.layer_ids", "eagle_config.layer_ids")


def given_target_layer_ids(cfg: dict, dflash: dict, assistant: bool = False) -> tuple[list[int], str, object] | None:
    """The target layers a DFlash-format drafter reads, from whichever of the keys vLLM reads
    gives them (it takes the first given, in this order; ``assistant``: transformers' assistant
    format, whose ``dflash`` is its top level):

    * ``eagle_aux_hidden_state_layer_ids``: vLLM's aux ids (:func:`aux_layer_ids`: id a is the
      output of target layer a - 1; a public vLLM guide tells users to add it);
    * ``dflash_config.target_layer_ids`` (the output of layer i is feature i);
    * ``dspark_target_layer_ids``, target layer ids as ``target_layer_ids`` (vLLM adds 1 to them as
      to those; but for a ``deepseek_v41`` model type, whose ids vLLM reads otherwise: refused);
    * the top-level ``target_layer_ids`` (the DFlash reference's fallback too);
    * ``dflash_config.layer_ids``, then ``eagle_config.layer_ids``: vLLM's aux ids again.

    A null reads as absent. Every key given must give the same layers.

    Returns:
        ``(target layer ids, key, its value as written)``: the ids (the output of layer i is
        feature i), read from ``key`` (the first of the keys above given; named in messages
        about the ids), or None where no key gives them.

    Raises:
        DFlashError: a value that is not a list of integers, an aux id below 1 or repeated, a
            ``deepseek_v41`` model type's ``dspark_target_layer_ids``, or two keys that give
            different layers (one line naming both keys and values: which one the drafter was
            trained with is unknown).
    """
    eagle = eagle_settings(cfg)
    found = []  # (key as named in messages, its value as written, the target layer ids it gives)
    if cfg.get("eagle_aux_hidden_state_layer_ids") is not None:
        value = cfg["eagle_aux_hidden_state_layer_ids"]
        found.append(("eagle_aux_hidden_state_layer_ids", value, aux_layer_ids(value, "eagle_aux_hidden_state_layer_ids")))
    if not assistant and dflash.get("target_layer_ids") is not None:
        value = dflash["target_layer_ids"]
        found.append(("dflash_config.target_layer_ids", value, layer_id_list(value, "dflash_config.target_layer_ids")))
    if cfg.get("dspark_target_layer_ids") is not None:
        value = cfg["dspark_target_layer_ids"]
        if cfg.get("model_type") == "deepseek_v41":
            raise DFlashError(f"drafter config.json has model_type deepseek_v41 and dspark_target_layer_ids {value!r} "
                              "(vLLM reads a DeepSeek V4.1 drafter's ids as the inputs of those layers, not their "
                              "outputs); dflash-torch's DFlash drafter does not read that layout: set target_layer_ids")
        found.append(("dspark_target_layer_ids", value, layer_id_list(value, "dspark_target_layer_ids")))
    if cfg.get("target_layer_ids") is not None:
        found.append(("target_layer_ids", cfg["target_layer_ids"], layer_id_list(cfg["target_layer_ids"], "target_layer_ids")))
    for key, value in (("dflash_config.layer_ids", None if assistant else dflash.get("layer_ids")),
                       ("eagle_config.layer_ids", eagle.get("layer_ids"))):
        if value is not None:
            found.append((key, value, aux_layer_ids(value, key)))
    aux = AUX_LAYER_KEYS
    for key, value, ids in found[1:]:
        if ids != found[0][2]:
            first, value0, ids0 = found[0]
            said = lambda k, v, i: f"{k} {v}" + (f" (target layers {i})" if k in aux else "")  # noqa: E731
            raise DFlashError(f"drafter config.json gives two sets of target layers: {said(first, value0, ids0)} and "
                              f"{said(key, value, ids)}; which the drafter was trained with is unknown: drop one or "
                              "make them agree")
    return (found[0][2], found[0][0], found[0][1]) if found else None


# keys vLLM falls back to for the token of a DFlash drafter's mask slots, after dflash_config.mask_token_id
# and mask_token_id (its get_parallel_drafting_token_id; DSpark, PARD and PTD drafters name it so)
MASK_TOKEN_FALLBACKS = ("dspark_noise_token_id", "pard_token", "ptd_token_id")


def given_target_hidden_size(cfg: dict, dflash: dict) -> int | None:
    """The width of one target layer's feature row that a DFlash or DFlash 2 drafter's ``fc``
    reads, where its ``config.json`` gives one other than its ``hidden_size``:
    ``target_hidden_size`` at the top level (the key EAGLE-3 and Speculators drafters, and
    vLLM's loaders of them, read) or in ``dflash_config``; e.g. ``hc_mult * hidden_size``
    for a target whose layers carry several residual streams (GLM-5.3-Flash, DeepSeek-V4).
    None where neither gives one (``fc`` reads ``hidden_size`` values a layer).

    Raises:
        DFlashError: a value that is not an integer >= 1, or two that differ.
    """
    top = check_int(cfg, "target_hidden_size", "drafter")
    inner = check_int({"dflash_config.target_hidden_size": dflash.get("target_hidden_size")},
                      "dflash_config.target_hidden_size", "drafter")
    if None not in (top, inner) and top != inner:
        raise DFlashError(f"drafter config.json has two target_hidden_size values: {top} at the top level and "
                          f"{inner} in dflash_config; make them equal")
    return top if top is not None else inner


def mask_token_keys(cfg: dict, dflash: dict) -> list[tuple[str, object]]:
    """The keys a DFlash-format drafter config may give its mask token id under, in the order
    vLLM reads them (``dflash_config.mask_token_id``, ``mask_token_id``, then
    :data:`MASK_TOKEN_FALLBACKS`), each with its value as written (None: absent or null)."""
    return [("dflash_config.mask_token_id", dflash.get("mask_token_id")), ("mask_token_id", cfg.get("mask_token_id")),
            *((key, cfg.get(key)) for key in MASK_TOKEN_FALLBACKS)]


def given_mask_token_id(cfg: dict, dflash: dict):
    """The mask token id of a DFlash-format drafter config: ``dflash_config.mask_token_id``, else
    the top-level ``mask_token_id`` (the DFlash reference's fallback), else
    :data:`MASK_TOKEN_FALLBACKS` (vLLM fills a DFlash drafter's mask slots with the first of
    these five it finds); None where none gives one (nulls read as absent). An
    ``eagle_config.mask_token_id`` (vLLM merges ``eagle_config`` under ``dflash_config``, but
    fills the mask slots from the keys above and reads that one only to place a separate mask
    embedding, which dflash-torch's drafters do not have; the DFlash reference does not read it)
    is read only where it equals that id.

    Raises:
        DFlashError: two of the keys given and different, or an ``eagle_config.mask_token_id``
            that no other key confirms (one line naming them; which one the drafter was trained
            with is unknown).
    """
    given = [(key, value) for key, value in mask_token_keys(cfg, dflash) if value is not None]
    for key, value in given:  # (each named if it is no token id: a string, a bool, a negative number)
        check_int({key: value}, key, "drafter", minimum=0)
    for key, value in given[1:]:
        if value != given[0][1]:
            raise DFlashError(f"drafter config.json gives two mask token ids: {given[0][0]} {given[0][1]!r} and {key} "
                              f"{value!r}; which the drafter was trained with is unknown: drop one or make them equal")
    eagle = eagle_settings(cfg).get("mask_token_id")
    if eagle is not None and (not given or eagle != given[0][1]):
        also = f" and {given[0][0]} {given[0][1]!r}" if given else ""
        raise DFlashError(f"drafter config.json gives eagle_config.mask_token_id {eagle!r}{also}: vLLM fills the mask "
                          "slots from dflash_config.mask_token_id / mask_token_id (eagle_config's only places a separate "
                          "mask embedding) and the DFlash reference does not read it; set dflash_config.mask_token_id")
    return given[0][1] if given else None


def refuse_aux_off(cfg: dict, dflash: dict) -> None:
    """Refuse ``use_aux_hidden_state: false`` (in ``dflash_config``, ``eagle_config`` or at the top
    level, as vLLM's DFlash drafter looks it up): vLLM then feeds the drafter the target's last
    hidden state with no ``fc`` projection instead of the target layers' features.

    Raises:
        DFlashError: one line naming the key.
    """
    for key, value in (("dflash_config.use_aux_hidden_state", dflash.get("use_aux_hidden_state")),
                       ("eagle_config.use_aux_hidden_state", eagle_settings(cfg).get("use_aux_hidden_state")),
                       ("use_aux_hidden_state", cfg.get("use_aux_hidden_state"))):
        if not bool_field({key: value}, key, "drafter", True):
            raise DFlashError(f"drafter config.json sets {key} false (vLLM then feeds the drafter the target's last "
                              "hidden state, with no fc); dflash-torch's DFlash drafter reads the features of its "
                              "target layers through fc")


def refuse_rope_and_value_variants(cfg: dict, dflash: dict, default_of: str | None = None) -> None:
    """Refuse the DFlash-format keys that change the drafter's attention in the code that runs
    such drafters and that dflash-torch's DFlash drafter does not apply:

    * ``partial_rotary_factor`` below 1 (top level, or in ``rope_parameters`` / ``rope_scaling``):
      RoPE on the first part of each head only. MiMo's DFlash drafters (e.g. XiaomiMiMo
      MiMo-V2.5-Pro-FP4-DFlash: 0.5) set it; vLLM's DFlash drafter rotates that part (its
      RoPE reads the factor that transformers 5 moves into ``rope_parameters``), as MiMo's own
      attention code does (its ``rope_dim``), and users serving them report the drafter's
      acceptance collapses when the whole head is rotated, as the DFlash reference's
      ``Qwen3RotaryEmbedding`` does under transformers 5 (its plain RoPE ignores the factor;
      under transformers 4 the tables come out narrower than the head and its attention
      fails). So the drafter was trained rotating part of the head: run whole-head it would
      draft with other positions than it was trained on (the Speculators reader refuses the
      key as well, and dflash-torch's qwen3 targets: :func:`~dflash_torch.models.config.refuse_partial_rotary`);
    * ``is_neox_style: false``: vLLM's DFlash drafter then rotates interleaved channel pairs
      (GPT-J style); dflash-torch rotates the two halves of the head (``true``, the default);
    * ``dflash_config.attention_value_scale`` other than 1: MiMo's factor on the attention
      values (MiMo's attention code multiplies every value row by it before attending);
      dflash-torch's DFlash drafter does not scale them (the published MiMo drafters that set
      it also have attention sinks, :func:`refuse_attention_sinks`).

    ``default_of``: checking the values the file left out, taken from transformers' config
    class of its ``model_type`` (:func:`with_transformers_defaults`; a ``qwen3_5_text`` drafter
    without ``rope_parameters`` gets Qwen3.5's ``partial_rotary_factor`` 0.25, which vLLM
    applies): that phrase (``"model_type 'qwen3_5_text' (transformers' Qwen3_5TextConfig)"``),
    named in the message as what gives the value.

    Raises:
        DFlashError: one line naming the key and its value (and ``default_of``).
    """
    sets = "sets" if default_of is None else f"leaves out {{}}, which its {default_of} sets to"
    for where, params in (("rope_parameters", cfg.get("rope_parameters")), ("rope_scaling", cfg.get("rope_scaling")),
                          ("", cfg)):
        factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
        if factor is None:
            continue
        key = f"{where}.partial_rotary_factor" if where else "partial_rotary_factor"
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise DFlashError(f"drafter config.json {key} must be a number in (0, 1], got {factor!r}")
        if factor != 1:
            raise DFlashError(f"drafter config.json {sets.format(where or key)} {key} {factor!r} (RoPE on part of each "
                              "head, as vLLM and MiMo's code run it); dflash-torch's DFlash drafter rotates the whole "
                              "head" + (f"; give the file its own {where or key}" if default_of else ""))
    if not bool_field(cfg, "is_neox_style", "drafter", True):
        raise DFlashError("drafter config.json sets is_neox_style false (RoPE on interleaved channel pairs, as vLLM "
                          "runs it); dflash-torch's DFlash drafter rotates the two halves of each head (true)")
    scale = dflash.get("attention_value_scale")
    if scale is not None:
        if not finite_number(scale):
            raise DFlashError(f"drafter config.json dflash_config.attention_value_scale must be a number, got {scale!r}")
        if scale != 1:
            raise DFlashError(f"drafter config.json sets dflash_config.attention_value_scale {scale!r} (MiMo's factor on "
                              "the attention values); dflash-torch's DFlash drafter does not scale them")


def logit_scale_field(cfg: dict) -> float:
    """``logit_scale``: the factor vLLM's DFlash drafter multiplies its draft logits by
    (default 1; a null reads as absent).

    Raises:
        DFlashError: a value that is not a finite number > 0, or above :data:`MAX_DRAFT_FACTOR`.
    """
    scale = number_field(cfg, "logit_scale", "drafter", 1.0)
    if scale > MAX_DRAFT_FACTOR:
        raise DFlashError(f"drafter config.json logit_scale must be a number > 0 and at most {MAX_DRAFT_FACTOR:g}, got "
                          f"{cfg['logit_scale']!r}")
    return scale


def transformers_default_note(taken: dict[str, str], values: dict, *keys: str) -> str:
    """`` (head_dim 128: transformers' Qwen3Config default, the file gives none)`` for those of
    ``keys`` in ``taken`` (key -> the config class whose default it took; ``values``: their
    values), "" where none is."""
    parts = [f"{k} {values[k]!r}: transformers' {taken[k]} default, the file gives none" for k in keys if k in taken]
    return f" ({'; '.join(parts)})" if parts else ""


@dataclass
class DrafterConfig:
    """Shape and DFlash settings of a drafter (an embedding table and LM head of its own only
    where ``own_embedding`` / ``own_lm_head`` or a format's settings say so)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    attention_bias: bool
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int | None
    vocab_size: int | None
    sliding_windows: list[int | None]
    max_position_embeddings: int | None = None  # the fallback of yarn/llama3's original_max_position_embeddings
    dflash2: DFlash2Settings | None = None  # set for a DFlash 2 drafter (architectures DFlash2DraftModel)
    checkpoint_names: dict[str, str] = field(default_factory=dict)  # our weight name -> the checkpoint's, where they differ
    hidden_act: str = "silu"  # the MLP's activation: silu (SwiGLU) or gelu_tanh (GeGLU), a key of layers.ACTIVATIONS
    causal_layers: list[bool] | None = None  # per layer: block rows see the block causally (None given: no layer)
    speculators: "SpeculatorsSettings | None" = None  # set for a Speculators-format drafter (models/speculators.py)
    target_hidden_size: int | None = None  # values of one target layer's feature row; None: hidden_size
    laguna: "LagunaDraftSettings | None" = None  # set for a Laguna DFlash drafter (models/laguna_drafter.py)
    # a DFlash-format drafter's own embed_tokens / lm_head (config.json has_embed_tokens / has_lm_head; where it says
    # neither, DFlashDrafter.from_pretrained sets them as the checkpoint has them); False for the other formats
    own_embedding: bool = False
    own_lm_head: bool = False
    qk_norm: bool = True  # per-head q/k RMSNorms in the drafter's attention (dflash_config.use_qk_norm false: none)
    logit_scale: float = 1.0  # config.json logit_scale: the draft logits' factor (vLLM's LogitsProcessor scale)
    # a DFlash drafter's factors of the DFlash reference (draft_scaling; a DFlash 2 drafter's are its dflash2's: scaling)
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # the keys config.json leaves out that took transformers' defaults (with_transformers_defaults): key -> its class
    transformers_defaults: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    # the key and value target_layer_ids were read from where they are vLLM's aux ids (messages name it), else None
    layer_ids_source: str | None = field(default=None, compare=False, repr=False)

    def default_note(self, *keys: str) -> str:
        """Where any of ``keys`` took transformers' default (the file gives none), a note for
        an error message it may have caused, e.g. `` (head_dim 128: transformers' Qwen3Config
        default, the file gives none)``; else ""."""
        return transformers_default_note(self.transformers_defaults, {k: getattr(self, k) for k in keys}, *keys)

    @property
    def partial_rotary_factor(self) -> float:
        """The fraction of each head that the drafter's RoPE rotates (1 but for a Laguna
        DFlash drafter whose config asks for less)."""
        return 1.0 if self.laguna is None else self.laguna.partial_rotary_factor

    @property
    def feature_size(self) -> int:
        """Values of one target layer's feature row that ``fc`` reads (``target_hidden_size``,
        else ``hidden_size``)."""
        return self.hidden_size if self.target_hidden_size is None else self.target_hidden_size

    @property
    def scaling(self) -> "DFlash2Settings | DrafterConfig":
        """What holds the drafter's ``input_embedding_scale``, ``output_multiplier`` and
        ``final_logit_softcapping`` (:func:`draft_scaling`): :attr:`dflash2` for a DFlash 2
        drafter, else this config."""
        return self if self.dflash2 is None else self.dflash2

    def __post_init__(self):
        if self.causal_layers is None:  # (one form for "no causal layer", so parsed and built configs compare equal)
            self.causal_layers = [False] * self.num_hidden_layers
        if self.dflash2 is not None and draft_scaling_dict(self):  # (one place for them: scaling)
            raise ValueError("a DFlash 2 drafter config keeps input_embedding_scale, output_multiplier and "
                             "final_logit_softcapping in its dflash2 settings")

    @classmethod
    def from_dict(cls, cfg: dict) -> "DrafterConfig":
        """Parse a DFlash (``DFlashDraftModel``), DFlash 2 (``DFlash2DraftModel``) or
        transformers-format DFlash (:data:`ASSISTANT_ARCHITECTURES`, e.g.
        ``MuseGlimmerAssistantModel``: the settings at the top level, the context
        projection's weights under ``encoder.``) drafter ``config.json``. Keys a DFlash or
        DFlash 2 file leaves out (layer types, sliding window, RoPE rule, ...) take the
        defaults of transformers' config class of its ``model_type``, as the DFlash reference
        reads them (:func:`with_transformers_defaults`).

        A Speculators-format ``config.json`` (vLLM's speculators library:
        ``speculators_model_type: "dflash"``) is read by
        :func:`~dflash_torch.models.speculators.read_config`, a Laguna DFlash one
        (``architectures: ["DFlashLagunaForCausalLM"]``) by
        :func:`~dflash_torch.models.laguna_drafter.read_config`.

        Raises:
            DFlashError: not a DFlash drafter, a quantized checkpoint, no mask token id, no
                block size, missing keys, an MLP activation other than SiLU / GELU-tanh, bad
                DFlash 2 settings (:meth:`DFlash2Settings.from_dict`), a Speculators
                config :func:`~dflash_torch.models.speculators.read_config` refuses, a
                training variant we do not run (:func:`refuse_variants`: ``sample_from_anchor``,
                ``shift_label``, ``projector_type``, ... in ``dflash_config`` or at the top
                level), attention sinks (:func:`refuse_attention_sinks`), bad sliding
                windows (:func:`sliding_windows`: ``dflash_config.use_swa`` /
                ``swa_window_size``; :func:`with_transformers_defaults`: a window
                transformers drops), a ``rope_parameters`` per layer type whose entries
                differ (:func:`one_rope_for_every_layer`), ``num_attention_heads`` not a multiple
                of ``num_key_value_heads``; target layer ids or mask token ids given twice and
                differing (:func:`given_target_layer_ids`, :func:`given_mask_token_id`); partial
                or interleaved RoPE or a value scale (:func:`refuse_rope_and_value_variants`);
                ``use_aux_hidden_state`` false (:func:`refuse_aux_off`); a
                ``logit_scale`` that is not a number > 0, or other than 1 in a DFlash 2 config, or
                with an ``output_multiplier`` or soft cap in a DFlash one; bad
                :func:`draft_scaling` factors. A message about a value taken from transformers'
                defaults says so (:meth:`default_note`).

        The target layers and mask token id are read where vLLM reads them too (the
        top-level ``target_layer_ids`` / ``mask_token_id``, ``eagle_aux_hidden_state_layer_ids``,
        ``dspark_target_layer_ids``, ``dflash_config`` / ``eagle_config`` ``layer_ids``,
        :data:`MASK_TOKEN_FALLBACKS`; ``eagle_config.mask_token_id`` only where another key
        gives the same id);
        ``logit_scale`` (default 1) multiplies the draft logits, as in vLLM. A DFlash drafter's
        ``input_embedding_scale``, ``output_multiplier`` and ``final_logit_softcapping``
        (``dflash_config``, else the top level) are read as the DFlash reference applies them
        (:func:`draft_scaling`), as for DFlash 2. ``target_hidden_size`` (top level or
        ``dflash_config``: :func:`given_target_hidden_size`) gives the width of the target
        feature rows ``fc`` reads where it is not ``hidden_size`` (several residual streams).
        """
        if "speculators_model_type" in cfg:
            from .speculators import read_config

            return read_config(cfg)
        archs = architectures(cfg, "drafter")
        if LAGUNA_ARCHITECTURE in archs:
            from .laguna_drafter import read_config

            return read_config(cfg)
        dflash = object_field(cfg, "dflash_config", "drafter") or {}
        assistant = any(a in ASSISTANT_ARCHITECTURES for a in archs if isinstance(a, str))
        if assistant:  # (transformers' DFlash assistants keep the DFlash settings at the top level)
            dflash = {k: cfg.get(k) for k in ("mask_token_id", "target_layer_ids", "block_size")}
            cfg = {**ASSISTANT_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
            if cfg.get("layer_types") is None:
                cfg["layer_types"] = ["sliding_attention"] * cfg["num_hidden_layers"] if isinstance(
                    cfg.get("num_hidden_layers"), int) else None
        if any("dflash" in a.lower() and a not in KNOWN_DFLASH_ARCHITECTURES for a in archs):  # (beside a known one too)
            raise DFlashError(
                f"the drafter checkpoint is a DFlash model dflash-torch does not know (architectures={archs}); "
                f"it reads {list(KNOWN_DFLASH_ARCHITECTURES)}, and running another as one of those could "
                "draft from weights it reads differently")
        if "DFlash2DraftModel" not in archs and "DFlashDraftModel" not in archs and not dflash:
            raise NotADrafterError(
                f"the drafter checkpoint is not a DFlash drafter (architectures={archs}); "
                "expected architectures ['DFlashDraftModel'] or ['DFlash2DraftModel'] with a dflash_config, "
                f"['{LAGUNA_ARCHITECTURE}'], one of {list(ASSISTANT_ARCHITECTURES)}, or a Speculators-format "
                "config (speculators_model_type \"dflash\")"
            )
        refuse_quantized(cfg, "drafter")
        if "DFlash2DraftModel" not in archs:  # (DFlash2Settings.from_dict refuses DFlash 2's, is_causal too)
            refuse_variants(lambda key: dflash.get(key, cfg.get(key)), "DFlash", VARIANT_KEYS)
        refuse_attention_sinks(cfg, dflash)
        refuse_rope_and_value_variants(cfg, dflash)
        refuse_aux_off(cfg, dflash)
        _require(cfg, ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"], "drafter")
        mask_token_id = given_mask_token_id(cfg, dflash)
        if mask_token_id is None:
            raise DFlashError(f"drafter config.json lacks {'' if assistant else 'dflash_config.'}mask_token_id"
                              + ("" if assistant else " (or a top-level one; loaded with its target, DFlashEngine "
                                 "takes it from the target's tokenizer: fill_mask_token_id)"))
        check_int({"mask_token_id": mask_token_id}, "mask_token_id", "drafter", minimum=0)
        block_size = cfg.get("block_size") if cfg.get("block_size") is not None else dflash.get("block_size")
        if block_size is None:
            raise DFlashError("drafter config.json has no block_size (top level or in dflash_config)")
        if None not in (cfg.get("block_size"), dflash.get("block_size")) and cfg["block_size"] != dflash["block_size"]:
            raise DFlashError(f"drafter config.json has two block sizes: block_size {cfg['block_size']!r} and "
                              f"dflash_config.block_size {dflash['block_size']!r}; make them equal")
        check_int({"block_size": block_size}, "block_size", "drafter", minimum=2)
        target_hidden = given_target_hidden_size(cfg, dflash)
        taken = {}  # key -> the transformers config class whose default it took
        if not assistant:  # (the keys the file leaves out, as the DFlash reference reads them)
            given, cfg = cfg, with_transformers_defaults(one_rope_for_every_layer(cfg))
            if cfg is not given:
                kind = transformers_config_class(cfg.get("model_type")).__name__
                # (a factor the class gives, e.g. Qwen3.5's 0.25: vLLM applies it, as one the file sets: trial-294)
                refuse_rope_and_value_variants({k: v for k, v in cfg.items() if given.get(k) is None}, {},
                                               f"model_type {cfg.get('model_type')!r} (transformers' {kind})")
                taken = {k: kind for k in ("head_dim", "num_key_value_heads", "attention_bias")
                         if given.get(k) is None and cfg.get(k) is not None
                         and not (k == "num_key_value_heads" and k in given)}  # (its null: num_attention_heads)
        for key in ("num_key_value_heads", "head_dim", "sliding_window", "vocab_size"):
            check_int(cfg, key, "drafter")
        n = cfg["num_hidden_layers"]
        num_target_layers = check_int(cfg, "num_target_layers", "drafter")
        given_layers = given_target_layer_ids(cfg, dflash, assistant)
        layer_ids, layers_key, layers_value = given_layers or (None, None, None)
        if layer_ids is None:
            where = "target_layer_ids" if assistant else "dflash_config.target_layer_ids"
            if num_target_layers is None:
                others = ("eagle_aux_hidden_state_layer_ids / dspark_target_layer_ids / eagle_config.layer_ids"
                          if assistant else "target_layer_ids / eagle_aux_hidden_state_layer_ids / "
                          "dspark_target_layer_ids / dflash_config.layer_ids / eagle_config.layer_ids")
                raise DFlashError(f"drafter config.json has neither {where} (nor {others}) nor num_target_layers")
            layer_ids = default_target_layer_ids(num_target_layers, n)
            if min(layer_ids) < 0:  # (the rule spreads them over layers 1 .. L - 3: a target of under 4 layers has none)
                raise DFlashError(f"drafter config.json has no {where}, and the reference rule gives {layer_ids} for "
                                  f"{n} drafter layers over a target of {num_target_layers} layers; set {where}")
        act = cfg.get("hidden_act") or "silu"
        if act not in SILU_NAMES + GELU_TANH_NAMES:
            raise DFlashError(f"drafter config.json hidden_act {act!r} is not supported "
                              f"(silu, or GELU-tanh: {', '.join(GELU_TANH_NAMES)})")
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if isinstance(heads, int) and heads % kv_heads:
            note = transformers_default_note(taken, {"num_key_value_heads": kv_heads}, "num_key_value_heads")
            raise DFlashError(f"drafter num_attention_heads {heads} is not a multiple of num_key_value_heads "
                              f"{kv_heads}{note}")
        layer_types = cfg.get("layer_types") or ["full_attention"] * n
        if not isinstance(layer_types, list) or len(layer_types) != n:
            raise DFlashError(f"drafter layer_types must be a list of {n} entries (num_hidden_layers), got {layer_types!r}")
        for kind in layer_types:
            if kind not in ("full_attention", "sliding_attention"):
                raise DFlashError(f"drafter layer_types must be full_attention or sliding_attention, got {kind!r}")
        windows = sliding_windows(cfg, dflash, layer_types)
        theta, scaling = _rope(cfg, "drafter", ASSISTANT_ROPE_THETA if assistant else 10000.0)
        v2 = DFlash2Settings.from_dict(cfg, cfg["hidden_size"], cfg.get("vocab_size")) if "DFlash2DraftModel" in archs else None
        own = {key: bool_field(cfg, key, "drafter", False) for key in ("has_embed_tokens", "has_lm_head")}
        if (own["has_embed_tokens"] or own["has_lm_head"]) and not isinstance(cfg.get("vocab_size"), int):
            raise DFlashError("drafter config.json has_embed_tokens / has_lm_head true needs vocab_size (the rows of "
                              "its own table)")
        causal = block_causality(cfg, dflash, layer_types, plain=not assistant and v2 is None)
        logit_scale = logit_scale_field(cfg)
        if v2 is not None and logit_scale != 1.0:  # (its logits' own factor is dflash_config.output_multiplier)
            raise DFlashError(f"DFlash 2 drafter config.json sets logit_scale {cfg['logit_scale']!r}; a DFlash 2 "
                              "drafter scales its draft logits by dflash_config.output_multiplier only")
        factors = {}  # (the DFlash reference's factors: a DFlash 2 drafter's are read by DFlash2Settings)
        if v2 is None and not assistant:
            factors = draft_scaling(lambda key: dflash.get(key) if dflash.get(key) is not None else cfg.get(key),
                                    "DFlash drafter")
            if logit_scale != 1.0 and (factors["output_multiplier"] != 1.0 or factors["final_logit_softcapping"] is not None):
                raise DFlashError(f"drafter config.json sets logit_scale {cfg['logit_scale']!r} (vLLM's factor on the "
                                  "draft logits) and output_multiplier / final_logit_softcapping (the DFlash "
                                  "reference's); which the drafter was trained with is unknown: drop one")
        return cls(
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=number_field(cfg, "rms_norm_eps", "drafter", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=bool_field(cfg, "attention_bias", "drafter", False),
            block_size=int(block_size),
            mask_token_id=int(mask_token_id),
            target_layer_ids=[int(i) for i in layer_ids],
            layer_ids_source=f"{layers_key} {layers_value}" if layers_key in AUX_LAYER_KEYS else None,
            num_target_layers=num_target_layers,
            vocab_size=cfg.get("vocab_size"),
            sliding_windows=windows,
            max_position_embeddings=cfg.get("max_position_embeddings"),
            dflash2=v2,
            checkpoint_names=dict(ASSISTANT_WEIGHTS) if assistant else {},
            hidden_act="silu" if act in SILU_NAMES else "gelu_tanh",
            causal_layers=causal,
            own_embedding=own["has_embed_tokens"],
            own_lm_head=own["has_lm_head"],
            qk_norm=bool_field({"dflash_config.use_qk_norm": dflash.get("use_qk_norm")}, "dflash_config.use_qk_norm",
                               "drafter", True),
            logit_scale=logit_scale,
            target_hidden_size=target_hidden,
            **factors,
            transformers_defaults=taken,
        )

    def to_dict(self) -> dict:
        """A ``config.json`` dict in the published DFlash (or, with ``dflash2``, DFlash 2) drafter format
        (``model_type`` qwen3; where a layer slides, ``use_sliding_window`` true, which
        transformers' Qwen3Config needs to keep the window, so transformers, the DFlash
        reference and vLLM read the drafter as dflash-torch does). A new dict: it shares no
        object with this config.

        Raises:
            DFlashError: a Speculators-format config (its own embedding, LM head and attention
                rules have no place in this format)."""
        if self.speculators is not None:
            raise DFlashError("a Speculators-format drafter config has no DFlash-format config.json")
        if self.laguna is not None:  # (its aux norms, gate and context input norm have no place in this format)
            raise DFlashError("a Laguna DFlash drafter config has no DFlash-format config.json (dflash-torch runs "
                              "that format, it does not write or train it)")
        cfg = {
            "architectures": ["DFlash2DraftModel" if self.dflash2 else "DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "attention_bias": self.attention_bias,
            "hidden_act": "gelu_pytorch_tanh" if self.hidden_act == "gelu_tanh" else "silu",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "vocab_size": self.vocab_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "layer_types": ["sliding_attention" if w else "full_attention" for w in self.sliding_windows],
            "torch_dtype": "bfloat16",
        }
        causal = list(self.causal_layers)
        if self.dflash2:
            if any(causal):
                raise DFlashError("a DFlash 2 drafter's block attention is non-causal in every layer")
            cfg["dflash_config"] = {"block_size": self.block_size, **cfg["dflash_config"], **self.dflash2.to_dict()}
            cfg["is_causal"] = False
        elif causal != [w is not None for w in self.sliding_windows]:  # (not the default rule: say it)
            if len(set(causal)) > 1:
                raise DFlashError("a DFlash-format config.json says one block causality for every layer (is_causal); "
                                  f"this drafter has {causal}")
            cfg["is_causal"] = causal[0]
        for key, own in (("has_embed_tokens", self.own_embedding), ("has_lm_head", self.own_lm_head)):
            if own:
                cfg[key] = True
        if not self.qk_norm:
            cfg["dflash_config"]["use_qk_norm"] = False
        cfg["dflash_config"].update(draft_scaling_dict(self))  # (a DFlash 2 config's: in dflash2.to_dict())
        if self.logit_scale != 1.0:
            cfg["logit_scale"] = self.logit_scale
        if self.target_hidden_size is not None:
            cfg["target_hidden_size"] = self.target_hidden_size
        if self.rope_scaling:
            cfg["rope_scaling"] = copy.deepcopy(self.rope_scaling)
        if self.max_position_embeddings is not None:
            cfg["max_position_embeddings"] = self.max_position_embeddings
        windows = [w for w in self.sliding_windows if w]
        if windows:  # (transformers' Qwen3Config keeps the window only with use_sliding_window true)
            cfg["sliding_window"] = windows[0]
            cfg["use_sliding_window"] = True
        return cfg


DEFAULT_MASK_TOKEN = "<|MASK|>"  # the mask token SGLang and the DFlash reference's demo add to the tokenizer


def needs_mask_token_id(cfg: dict) -> bool:
    """Whether a drafter ``config.json`` dict is one :func:`fill_mask_token_id` completes: the
    DFlash / DFlash 2 format (not Speculators', not transformers' assistants) without
    ``dflash_config.mask_token_id``, a top-level ``mask_token_id``, or another key
    :func:`given_mask_token_id` reads or refuses (vLLM's fallbacks :data:`MASK_TOKEN_FALLBACKS`,
    ``eagle_config.mask_token_id``)."""
    dflash = cfg.get("dflash_config")
    archs = cfg.get("architectures")
    if "speculators_model_type" in cfg or (dflash is not None and not isinstance(dflash, dict)) or not isinstance(
            archs if archs is not None else [], list):  # (malformed: DrafterConfig.from_dict says so)
        return False
    archs = archs or []
    if not (dflash or "DFlashDraftModel" in archs or "DFlash2DraftModel" in archs):
        return False
    eagle = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    return eagle.get("mask_token_id") is None and all(v is None for _, v in mask_token_keys(cfg, dflash or {}))


def token_ids(tokenizer) -> set[int]:
    """The ids text can be tokenized to: those of ``tokenizer``'s vocabulary, its added
    tokens included (``get_vocab()``). They need not be ``0 .. len(tokenizer) - 1``: a
    vocabulary may have gaps (an id no token has) and then ids at and past ``len(tokenizer)``."""
    return {int(i) for i in tokenizer.get_vocab().values()}


def unused_token_id(tokenizer, vocab_size: int) -> int | None:
    """The first embedding row (an id in ``0 .. vocab_size - 1``) that is no token of
    ``tokenizer``'s vocabulary (:func:`token_ids`), so no text is tokenized to it: where the
    vocabulary's ids have no gaps, ``len(tokenizer)`` (the row past its last token, the id
    :func:`fill_mask_token_id` gives a mask token the tokenizer lacks); else its first gap.
    None where every row is a token."""
    used = token_ids(tokenizer)
    return next((i for i in range(vocab_size) if i not in used), None)


def fill_mask_token_id(cfg: dict, tokenizer, vocab_size: int) -> tuple[dict, str | None]:
    """A DFlash-format drafter ``config.json`` dict that has no mask token id (none of the keys
    :func:`needs_mask_token_id` looks for: as SpecForge wrote them before it
    recorded one) with that id filled in as SGLang resolves
    it: ``dflash_config.mask_token`` (default :data:`DEFAULT_MASK_TOKEN`) looked up in the
    target's ``tokenizer``, else the id adding it as a new token would get (``len(tokenizer)``,
    as the DFlash reference's demo does with ``add_special_tokens``; the tokenizer itself is
    not changed). Other configs come back as they are.

    Returns:
        ``(config, note)``: a new dict and a line saying what was resolved, or ``(cfg, None)``;
        the line starts with ``WARNING:`` where that added id is already a token's id (a
        vocabulary whose ids have gaps, :func:`token_ids`: text holding it looks masked).

    Raises:
        DFlashError: a ``mask_token`` that is not a non-empty string, or an id that lands
            outside the target's embedding table (``vocab_size`` rows).
    """
    if not needs_mask_token_id(cfg):
        return cfg, None
    dflash = dict(cfg.get("dflash_config") or {})
    token = dflash.get("mask_token")
    token = DEFAULT_MASK_TOKEN if token is None else token  # (null is the default, as SGLang reads it)
    if not isinstance(token, str) or not token:
        raise DFlashError(f"drafter config.json dflash_config.mask_token must be a non-empty string, got {token!r}")
    found = tokenizer.get_vocab().get(token)
    token_id = len(tokenizer) if found is None else int(found)
    how = ("its id in the target's tokenizer" if found is not None
           else f"the id it gets added after the tokenizer's {len(tokenizer)} tokens, as SGLang adds it")
    if not 0 <= token_id < vocab_size:
        raise DFlashError(f"drafter config.json has no dflash_config.mask_token_id, and its mask token {token!r} would be "
                          f"id {token_id} ({how}), outside the target's {vocab_size} embedding rows; set mask_token_id")
    dflash["mask_token_id"] = token_id
    note = f"the drafter's config.json has no mask_token_id: mask token {token!r} is id {token_id} ({how})"
    if found is None and token_id in token_ids(tokenizer):  # (a vocabulary with gaps: len(tokenizer) is a token's id)
        taken = tokenizer.convert_ids_to_tokens(token_id)
        note = (f"WARNING: {note}, which is already the tokenizer's token {taken!r} (the tokenizer's ids have a gap): "
                "text holding that token looks like a masked slot to the drafter; if it was trained with another id, "
                "set dflash_config.mask_token_id in its config.json")
    return {**cfg, "dflash_config": dflash}, note


def sliding_windows(cfg: dict, dflash: dict, layer_types: list[str]) -> list[int | None]:
    """Per drafter layer, its sliding window (None: full attention), as vLLM's DFlash drafter
    resolves them: the ``sliding_attention`` layers of ``layer_types``, or every layer where
    ``dflash_config.use_swa`` is true and ``layer_types`` names none (absent or all
    full; MiMo's DFlash drafters); the window is ``dflash_config.swa_window_size``, else
    ``sliding_window``. (Block causality stays :func:`block_causality`'s, from
    ``layer_types``: a window that ``use_swa`` adds leaves the block non-causal.)

    Raises:
        DFlashError: ``use_swa`` not true or false, a window that is not an integer >= 1,
            sliding layers without a window, or ``swa_window_size`` and ``sliding_window``
            that differ (SGLang reads the one, vLLM the other).
    """
    use_swa = bool_field({"dflash_config.use_swa": dflash.get("use_swa")}, "dflash_config.use_swa", "drafter", False)
    size = check_int({"dflash_config.swa_window_size": dflash.get("swa_window_size")}, "dflash_config.swa_window_size",
                     "drafter")
    top = cfg.get("sliding_window")
    if None not in (size, top) and size != top:
        raise DFlashError(f"drafter config.json has two sliding windows: sliding_window {top!r} and "
                          f"dflash_config.swa_window_size {size!r}; make them equal")
    window = top if size is None else size
    sliding = [t == "sliding_attention" for t in layer_types]
    if use_swa and not any(sliding):
        sliding = [True] * len(layer_types)
    if any(sliding) and not window:
        raise DFlashError("drafter layer_types uses sliding_attention but sliding_window is not set"
                          if not use_swa else "drafter dflash_config.use_swa is true but neither "
                          "dflash_config.swa_window_size nor sliding_window is set")
    return [window if s else None for s in sliding]


def refuse_attention_sinks(cfg: dict, dflash: dict) -> None:
    """Refuse a drafter whose attention has a learned sink logit per head
    (``dflash_config.attention_sink_bias``, or the top-level ``add_swa_attention_sink_bias``
    vLLM falls back to): dflash-torch's DFlash drafter has none, and without the sink the
    attention weights differ.

    Raises:
        DFlashError: either key true (one line naming it).
    """
    for where, value in (("dflash_config.attention_sink_bias", dflash.get("attention_sink_bias")),
                         ("add_swa_attention_sink_bias", cfg.get("add_swa_attention_sink_bias"))):
        if bool_field({where: value}, where, "drafter", False):
            raise DFlashError(f"drafter config.json sets {where} true (a learned attention-sink logit per head, "
                              "MiMo-style); dflash-torch's DFlash drafter has no attention sinks")


def block_causality(cfg: dict, dflash: dict, layer_types: list[str], plain: bool) -> list[bool]:
    """Per drafter layer, whether its block rows see the block causally (a row, the block's
    rows up to its own) rather than whole: an explicit ``is_causal`` (or
    ``dflash_config.causal``) for every layer; else, for a ``plain`` DFlash drafter, its
    sliding-window layers causal and its full-attention layers not, as SGLang's and vLLM's
    DFlash drafters and SpecForge's DFlash training mask have it (and dflash-mlx); DFlash 2
    drafters and transformers' assistants see the block whole in every layer.

    Raises:
        DFlashError: ``is_causal`` / ``causal`` not true or false, or both given, one true and
            the other false.
    """
    given = {key: value for key, value in (("is_causal", cfg.get("is_causal")),
                                           ("dflash_config.causal", dflash.get("causal"))) if value is not None}
    for key, value in given.items():
        if not isinstance(value, bool):
            raise DFlashError(f"drafter config.json {key} must be true or false, got {value!r}")
    if len(set(given.values())) > 1:
        said = " and ".join(f"{key} {str(value).lower()}" for key, value in given.items())
        raise DFlashError(f"drafter config.json sets {said}: which block attention the drafter was trained with "
                          "is unknown; drop one of them")
    if given:
        return [next(iter(given.values()))] * len(layer_types)
    return [plain and t == "sliding_attention" for t in layer_types]


def validate_pair(target: TargetConfig, drafter: DrafterConfig) -> None:
    """Check that a drafter was made for this target.

    Raises:
        DFlashError: one line naming both values, for a hidden size or feature width
            (:attr:`DrafterConfig.feature_size`) mismatch, a
            target layer id outside the target, a different ``num_target_layers``,
            a mask token id outside the vocabulary, or a different vocabulary size; a
            Speculators drafter's aux id beyond the target's layer count.
    """
    if drafter.hidden_size != target.hidden_size:
        raise DFlashError(f"incompatible pair: drafter hidden_size {drafter.hidden_size} != target hidden_size {target.hidden_size}")
    if drafter.feature_size != target.feature_size:
        given = "target_hidden_size" if drafter.target_hidden_size is not None else "its hidden_size"
        wider = (drafter.target_hidden_size is None and drafter.speculators is None and drafter.laguna is None
                 and target.feature_size != target.hidden_size)
        raise DFlashError(f"incompatible pair: the drafter reads target features of {drafter.feature_size} values a layer "
                          f"({given}), the target's layers give {target.feature_size}"
                          + (f" ({target.feature_size // target.hidden_size} residual streams of {target.hidden_size}); "
                             "a drafter whose fc reads them says so with target_hidden_size "
                             f"{target.feature_size} in its config.json" if wider else ""))
    if drafter.num_target_layers is not None and drafter.num_target_layers != target.num_hidden_layers:
        raise DFlashError(
            f"incompatible pair: drafter num_target_layers {drafter.num_target_layers} != target num_hidden_layers {target.num_hidden_layers}"
        )
    if drafter.speculators is not None:  # (aux ids: 0 .. L, the inputs of layers 0 .. L - 1 and the last output)
        bad = [a for a in drafter.speculators.aux_ids if not 0 <= a <= target.num_hidden_layers]
        if bad:
            raise DFlashError(f"incompatible pair: the drafter's aux_hidden_state_layer_ids {list(drafter.speculators.aux_ids)} "
                              f"include {bad}, beyond the target's {target.num_hidden_layers} layers")
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < target.num_hidden_layers and drafter.speculators is None]
    if bad:
        raise DFlashError(
            f"incompatible pair: drafter target_layer_ids {drafter.target_layer_ids} include {bad}, outside the target's {target.num_hidden_layers} layers"
            + (f" (read from its {drafter.layer_ids_source}: id a is the output of target layer a - 1)"
               if drafter.layer_ids_source else ""))
    if not 0 <= drafter.mask_token_id < target.vocab_size:
        raise DFlashError(f"incompatible pair: drafter mask_token_id {drafter.mask_token_id} is outside the target vocabulary of {target.vocab_size}")
    if drafter.laguna is not None and drafter.vocab_size != target.vocab_size:  # (it drafts through the target's LM head)
        raise DFlashError(f"incompatible pair: drafter draft_vocab_size {drafter.vocab_size} != target vocab_size "
                          f"{target.vocab_size} (a Laguna DFlash drafter reads the target's LM head)")
    if drafter.vocab_size is not None and drafter.vocab_size != target.vocab_size:
        raise DFlashError(f"incompatible pair: drafter vocab_size {drafter.vocab_size} != target vocab_size {target.vocab_size}")
