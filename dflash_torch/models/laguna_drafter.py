"""poolside's Laguna DFlash drafters (``architectures: ["DFlashLagunaForCausalLM"]``, e.g.
poolside/Laguna-XS-2.1-DFlash and poolside/Laguna-S-2.1-DFlash).

A DFlash drafter (:mod:`dflash_torch.models.drafter`: no embedding, no LM head; the block
is embedded with the target's table and its logits come from the target's LM head) with
Laguna's attention layers. The facts below are read from vLLM's loader of this format
(``models/laguna_dflash.py`` and the Laguna layers it builds on) and SGLang's
``DFlashLagunaForCausalLM``; no code of theirs is used here:

* context features: each of the k target feature slices (one per ``target_layer_ids``
  entry, ``feature_size`` values) is normalised by its own RMSNorm ``aux_hidden_norms.{j}``
  before the concatenation goes through ``fc`` and ``hidden_norm``;
* every layer projects the context rows' keys/values from its own ``input_layernorm`` of
  them (the DFlash reference projects the context rows as they are);
* the attention output is multiplied by ``softplus(g_proj(h))`` (``h``: the layer's normed
  input rows; softplus in float32, cast back) before ``o_proj``: one gate per head,
  broadcast over its channels (``gating`` true or ``"per-head"``), or one per channel
  (``"per-element"``); ``gating`` false / ``"disabled"``: no gate and no ``g_proj``;
* ``dflash_config.causal``: the block seen causally in every layer (the published drafters:
  true, every layer a sliding window of 512 over context and block, as
  :meth:`~dflash_torch.models.drafter.DFlashDrafter.visible_keys` has it);
* ``target_layer_ids`` count as the output of that target layer (our feature ids); vLLM's
  ``eagle_aux_hidden_state_layer_ids``, when given, are those ids + 1;
* RoPE per layer type as vLLM resolves it (:func:`rope_for`); one layer type for every
  layer (vLLM's "uniform drafter layer flavor");
* weights: ``layers.{i}.self_attn.qkv_proj.weight`` fused (rows: queries, keys, values),
  split here into ``q_proj`` / ``k_proj`` / ``v_proj`` (or stored separately), and
  ``layers.{i}.self_attn.g_proj.weight``, ``aux_hidden_norms.{j}.weight``; names at the top
  level as published, or all under ``model.``.

The format is run, not written: its config has no DFlash-format ``config.json``
(:meth:`DrafterConfig.to_dict` refuses it) and the trainer does not start from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import DFlashError
from .config import check_int, finite_number, object_field, refuse_quantized
from .drafter_config import DrafterConfig
from .drafter import DFlashDrafter, DraftLayer
from .laguna import softplus_gated
from .layers import RMSNorm
from .rope import rotary_dim

GATING = ("per-head", "per-element", "disabled")
LAYER_TYPES = ("full_attention", "sliding_attention")
PREFIX = "model."  # (SGLang reads the tensors under it too)
# keys this module reads itself; the rest of the config goes to the DFlash parser
_OWN_KEYS = ("architectures", "rope_parameters", "rope_scaling", "swa_rope_parameters", "partial_rotary_factor",
             "rope_theta", "gating", "num_experts", "eagle_aux_hidden_state_layer_ids", "draft_vocab_size",
             "num_attention_heads_per_layer", "gating_types", "swa_attention_sink_enabled", "qkv_bias")


@dataclass
class LagunaDraftSettings:
    """What a Laguna DFlash drafter adds to :class:`DrafterConfig`.

    ``gating``: one of :data:`GATING`; ``partial_rotary_factor``: the fraction of each head
    its RoPE rotates (1 in the published drafters).
    """

    gating: str = "per-head"
    partial_rotary_factor: float = 1.0


def _gating(value) -> str:
    """``gating`` as one of :data:`GATING` (absent: per-head, the default of the family's
    config class, as transformers' ``LagunaConfig`` has it)."""
    if value is None or value is True or value == "per-head":
        return "per-head"
    if value is False or value == "disabled":
        return "disabled"
    if value == "per-element":
        return value
    raise DFlashError(f"drafter config.json gating must be true, false, 'per-head', 'per-element' or 'disabled', "
                      f"got {value!r}")


def rope_for(cfg: dict, layer_type: str) -> dict:
    """The RoPE dict of the layers of ``layer_type``, as vLLM resolves a Laguna layer's: a
    ``rope_parameters`` (or older ``rope_scaling``) nested by layer type gives that type's
    entry (else the ``full_attention`` one), a flat one itself; for sliding-window layers a
    ``swa_rope_parameters`` dict replaces it; the top-level ``rope_theta`` and
    ``partial_rotary_factor`` fill what the dict lacks.

    Raises:
        DFlashError: a RoPE entry that is not an object, or no ``rope_theta`` anywhere.
    """
    params = object_field(cfg, "rope_parameters", "drafter")
    if params is None:
        params = object_field(cfg, "rope_scaling", "drafter")
    params = params or {}
    if any(t in params for t in LAYER_TYPES):
        key = layer_type if layer_type in params else "full_attention"
        params = params.get(key)
        if not isinstance(params, dict):
            raise DFlashError(f"drafter config.json rope_parameters.{key} must be an object, got {params!r}")
    if layer_type == "sliding_attention" and object_field(cfg, "swa_rope_parameters", "drafter") is not None:
        params = cfg["swa_rope_parameters"]
    params = dict(params)
    for key in ("rope_theta", "partial_rotary_factor"):
        if params.get(key) is None and cfg.get(key) is not None:
            params[key] = cfg[key]
    if params.get("rope_theta") is None:
        raise DFlashError("drafter config.json gives no rope_theta (top level or in its rope parameters)")
    return params


def read_config(cfg: dict) -> DrafterConfig:
    """Parse a Laguna DFlash drafter ``config.json`` (``DFlashLagunaForCausalLM``).

    Raises:
        DFlashError (one line each): layer types missing or mixed, experts
            (``num_experts`` > 0), a ``draft_vocab_size`` other than ``vocab_size`` (or
            neither given), ``eagle_aux_hidden_state_layer_ids`` other than
            ``target_layer_ids`` + 1, no ``dflash_config.target_layer_ids``, two
            ``num_target_layers``, ``target_layer_ids`` not increasing, no ``dflash_config``,
            an unknown ``gating``, per-layer head counts or gates,
            attention sinks or biases, a partial rotary factor that rotates no even number
            of channels, a quantized checkpoint, or what :meth:`DrafterConfig.from_dict`
            refuses in the rest.
    """
    refuse_quantized(cfg, "drafter")
    types = cfg.get("layer_types")
    if types is None:
        raise DFlashError("Laguna DFlash drafter config.json lacks layer_types (vLLM requires them)")
    if isinstance(types, list) and len(set(map(str, types))) > 1:
        raise DFlashError(f"Laguna DFlash drafter layer_types mixes {sorted(set(map(str, types)))}; its layers must "
                          "all be of one type (vLLM's uniform drafter layer flavor)")
    experts = check_int(cfg, "num_experts", "drafter", minimum=0)
    if experts:
        raise DFlashError(f"Laguna DFlash drafter config.json has num_experts {experts}; only dense drafters "
                          "(num_experts 0) are supported")
    vocab, draft_vocab = check_int(cfg, "vocab_size", "drafter"), check_int(cfg, "draft_vocab_size", "drafter")
    if draft_vocab is not None and vocab is not None and draft_vocab != vocab:
        raise DFlashError(f"Laguna DFlash drafter draft_vocab_size {draft_vocab} != vocab_size {vocab}; it drafts "
                          "through the target's LM head, over the whole vocabulary (no draft-to-target map)")
    if vocab is None and draft_vocab is None:
        raise DFlashError("Laguna DFlash drafter config.json lacks draft_vocab_size (and vocab_size)")
    dflash = object_field(cfg, "dflash_config", "drafter")
    if dflash is None:
        raise DFlashError("Laguna DFlash drafter config.json lacks dflash_config (its block_size, mask_token_id and "
                          "target_layer_ids)")
    ids = dflash.get("target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise DFlashError(f"Laguna DFlash drafter dflash_config.target_layer_ids must be a non-empty list of "
                          f"integers, got {ids!r}")
    if any(a >= b for a, b in zip(ids, ids[1:])):  # (vLLM gathers the layers' outputs in layer order, each once)
        raise DFlashError(f"Laguna DFlash drafter dflash_config.target_layer_ids {ids} must be increasing (vLLM "
                          "feeds the target layers' outputs to fc in layer order, each once)")
    eagle = cfg.get("eagle_aux_hidden_state_layer_ids")
    if eagle is not None and eagle != [i + 1 for i in ids]:
        raise DFlashError(f"Laguna DFlash drafter eagle_aux_hidden_state_layer_ids {eagle!r} are not "
                          f"dflash_config.target_layer_ids {ids} + 1 (vLLM's capture of those layers' outputs)")
    layers = check_int(dflash, "num_target_layers", "drafter")
    if layers is not None and cfg.get("num_target_layers") not in (None, layers):
        raise DFlashError(f"Laguna DFlash drafter config.json has num_target_layers {cfg['num_target_layers']!r} and "
                          f"dflash_config.num_target_layers {layers}; make them equal")
    gating = _gating(cfg.get("gating"))
    heads = cfg.get("num_attention_heads")
    for key, uniform in (("num_attention_heads_per_layer", heads), ("gating_types", None)):
        value = cfg.get(key)
        if value is not None and not (isinstance(value, list) and uniform is not None and set(value) <= {uniform}):
            raise DFlashError(f"Laguna DFlash drafter config.json sets {key} {value!r}; per-layer values are not "
                              "supported (every layer as num_attention_heads and gating say)")
    for key in ("swa_attention_sink_enabled", "qkv_bias", "attention_bias"):
        if cfg.get(key) not in (None, False):
            raise DFlashError(f"Laguna DFlash drafter config.json sets {key} {cfg[key]!r}; dflash-torch runs "
                              "Laguna DFlash drafters without attention sinks or biases (as published)")
    kind = types[0] if isinstance(types, list) and types and types[0] in LAYER_TYPES else "full_attention"
    rope = rope_for(cfg, kind)
    partial = rope.pop("partial_rotary_factor", None)
    partial = 1.0 if partial is None else partial
    if not finite_number(partial) or not 0 < partial <= 1:
        raise DFlashError(f"Laguna DFlash drafter partial_rotary_factor must be a number in (0, 1], got {partial!r}")
    plain = {k: v for k, v in cfg.items() if k not in _OWN_KEYS}
    plain.update(architectures=["DFlashDraftModel"], rope_parameters=rope,
                 vocab_size=vocab if vocab is not None else draft_vocab)
    if layers is not None:
        plain["num_target_layers"] = layers
    out = DrafterConfig.from_dict(plain)
    rotary_dim(out.head_dim, partial)  # (an even number of channels in [2, head_dim], or refused here)
    out.laguna = LagunaDraftSettings(gating=gating, partial_rotary_factor=float(partial))
    return out


class LagunaDraftLayer(DraftLayer):
    """A drafter layer with Laguna's attention: the context rows' keys/values from this
    layer's input norm of them (:meth:`context_input`), and the softplus output gate
    ``self_attn.g_proj`` on the block rows' attention output."""

    def __init__(self, cfg: DrafterConfig, sliding_window: int | None):
        super().__init__(cfg, sliding_window)
        self.gating = cfg.laguna.gating
        width = {"per-head": cfg.num_attention_heads, "per-element": cfg.num_attention_heads * cfg.head_dim}
        if self.gating == "disabled":
            self.self_attn.g_proj = None
        else:
            self.self_attn.g_proj = nn.Linear(cfg.hidden_size, width[self.gating], bias=False)

    def context_input(self, c: torch.Tensor) -> torch.Tensor:
        return self.input_layernorm(c)

    def attention_input(self, x: torch.Tensor, block_len: int) -> tuple[torch.Tensor, object]:
        h = self.input_layernorm(x)
        return h, h  # (the gate reads the normed rows too)

    def attention_output(self, attended: torch.Tensor, state: object, block_len: int) -> torch.Tensor:
        attn = self.self_attn
        if attn.g_proj is not None:
            attended = softplus_gated(attended, attn.g_proj(state), attn.heads, self.gating == "per-head")
        return attn.o_proj(attended)


class LagunaDrafter(DFlashDrafter):
    """A Laguna DFlash drafter (see the module docstring): the DFlash drafter with
    ``aux_hidden_norms`` on the target features and :class:`LagunaDraftLayer` layers."""

    layer_class = LagunaDraftLayer

    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        self.aux_hidden_norms = nn.ModuleList(RMSNorm(cfg.feature_size, cfg.rms_norm_eps) for _ in cfg.target_layer_ids)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features ``[n, k * feature_size]`` -> context rows ``[n, hidden]``: each
        layer's slice normed by its ``aux_hidden_norms`` entry, then ``fc`` and ``hidden_norm``."""
        slices = features.split(self.config.feature_size, dim=-1)
        normed = torch.cat([norm(part) for norm, part in zip(self.aux_hidden_norms, slices)], dim=-1)
        return self.hidden_norm(self.fc(normed))

    def adapt_checkpoint(self, state: dict[str, torch.Tensor], model_dir: Path) -> dict[str, torch.Tensor]:
        """Split each layer's fused ``self_attn.qkv_proj.weight`` into ``q_proj`` / ``k_proj`` /
        ``v_proj``; with every name under ``model.``, record the checkpoint's names
        (``checkpoint_names``: the loader maps them, and names them so in its messages).

        Raises:
            DFlashError: names with and without the ``model.`` prefix, a layer with both the
                fused and separate projections or neither, a fused weight of the wrong shape.
        """
        c = self.config
        prefixed = [k for k in state if k.startswith(PREFIX)]
        prefix = PREFIX if prefixed else ""
        if prefixed and len(prefixed) != len(state):
            plain = sorted(k for k in state if not k.startswith(PREFIX))
            raise DFlashError(f"drafter checkpoint {model_dir} names some weights under {PREFIX!r} and some not "
                              f"({', '.join(plain[:3])}{' ...' if len(plain) > 3 else ''})")
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        for i in range(c.num_hidden_layers):
            base = f"{prefix}layers.{i}.self_attn."
            fused = base + "qkv_proj.weight"
            separate = [base + f"{p}_proj.weight" for p in "qkv" if base + f"{p}_proj.weight" in state]
            if fused not in state:
                if not separate:
                    raise DFlashError(f"drafter checkpoint {model_dir} lacks {fused} (or q_proj, k_proj and v_proj)")
                continue
            if separate:
                raise DFlashError(f"drafter checkpoint {model_dir} has both {fused} and {', '.join(separate)}; "
                                  "a layer's projections are stored fused or separately, not both")
            w = state.pop(fused)
            if tuple(w.shape) != (q + 2 * kv, c.hidden_size):
                raise DFlashError(f"drafter weight {fused} has shape {tuple(w.shape)}, config implies "
                                  f"{(q + 2 * kv, c.hidden_size)}")
            for name, part in zip("qkv", w.split([q, kv, kv])):
                state[f"{base}{name}_proj.weight"] = part
        if prefix:
            c.checkpoint_names = {k: prefix + k for k in self.state_dict()}
        return state
