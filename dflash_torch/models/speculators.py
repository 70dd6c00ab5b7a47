"""DFlash drafters in the Speculators format.

vLLM's ``speculators`` library (github.com/vllm-project/speculators, ``DFlashDraftModel``)
trains DFlash drafters and publishes them in a layout of its own (e.g. the
``RedHatAI/*-speculator.dflash`` checkpoints), which vLLM serves as they are. The facts
below are read from speculators' ``models/dflash`` (config, model and training attention
mask) and from vLLM's DFlash loader (``models/qwen3_dflash.py``,
``configs/speculators/algos.py``):

* ``config.json``: ``speculators_model_type: "dflash"``. The drafter layers' shape is a
  nested ``transformer_layer_config``, a transformers Qwen3 (or Llama) config saved as its
  difference from that class's defaults: absent keys take them, so it is completed by
  transformers' own config class. ``block_size`` (default 8), ``mask_token_id``,
  ``draft_vocab_size`` (default 32000) and ``aux_hidden_state_layer_ids``: ids a counted as
  vLLM captures hidden states (the input of decoder layer a, i.e. the output of layer
  a - 1; 0 the embedding output; the target's layer count L its last layer's output before
  the final norm), so our target layer ids are a - 1 (:meth:`SpeculatorsDrafter.feature_layers`).
* weights: the DFlash body as in the DFlash reference (``layers.*``, ``fc``,
  ``hidden_norm``, ``norm``); ``lm_head`` ``[draft_vocab_size, hidden]``, the drafter's own LM
  head (its logits are used as they are: no output scale or soft cap); optionally
  ``embed_tokens`` (else the target's embedding table, its rows as stored: no scale);
  with a draft vocabulary smaller than the target's, ``d2t`` (int64 ``[draft_vocab_size]``:
  draft id i is target token ``i + d2t[i]``) and ``t2d`` (bool ``[vocab_size]``: the same
  set as a mask). ``verifier_lm_head`` / ``verifier_norm`` are training-time copies of the
  target's, used only for the training loss.
* attention: full-attention layers as in the DFlash reference (every context key and
  the whole block, non-causal); a sliding-window layer sees the context keys at positions
  ``>= s - sliding_window`` (s: the block's first position) and the block causally, unless
  ``sliding_window_non_causal`` (as speculators' training mask).

Tokens outside a smaller draft vocabulary get the draft logit ``-inf`` (as vLLM maps
them): they are never drafted and have draft probability 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import DFlashError
from .config import bool_field, check_int, object_field, quiet_transformers, refuse_quantized
from .drafter_config import DrafterConfig, refuse_variants
from .drafter import DFlashDrafter, DraftLayer, same_tensor
from .layers import embedding

DEFAULT_DRAFT_VOCAB = 32000  # speculators' DFlashSpeculatorConfig defaults
DEFAULT_BLOCK_SIZE = 8
TRAINING_ONLY = ("verifier_lm_head.weight", "verifier_norm.weight")  # the training loss's copies of the target's
# speculators' variant keys that change the drafter's output, with the values we run (refuse_variants): a
# Domino projector (a causal correction head) and labels shifted by one slot; pure_draft_prefix_len (default 1)
# only shapes Domino's head, auf only training's loss mask
VARIANT_KEYS = {"projector_type": ("dflash", None), "shift_label": (False,)}


@dataclass
class SpeculatorsSettings:
    """What a Speculators-format drafter adds to :class:`DrafterConfig`.

    ``own_embedding`` / ``own_lm_head`` / ``has_d2t``: whether the checkpoint ships
    ``embed_tokens.weight`` / ``lm_head.weight`` / ``d2t`` (set from its tensor names by
    :func:`match_checkpoint`; a config alone assumes an LM head and no embedding, as
    speculators saves them).
    """

    draft_vocab_size: int
    own_embedding: bool = False
    own_lm_head: bool = True
    has_d2t: bool = False
    verifier_families: tuple[str, ...] = ()  # the model families speculators_config.verifier.architectures name
    aux_ids: tuple[int, ...] = ()  # aux_hidden_state_layer_ids, in layer order


def _layer_config(cfg: dict) -> dict:
    """The complete ``transformer_layer_config``: transformers' config class of its
    ``model_type`` (Qwen3 when absent, as speculators reads it) fills the keys saved as defaults."""
    from transformers import AutoConfig

    layer = object_field(cfg, "transformer_layer_config", "drafter")
    if layer is None:
        raise DFlashError("drafter config.json (Speculators format) lacks transformer_layer_config")
    model_type = layer.get("model_type", "qwen3")
    try:
        config_class = type(AutoConfig.for_model(model_type))
    except ValueError:
        raise DFlashError(f"drafter config.json transformer_layer_config has model_type {model_type!r}, which "
                          "transformers does not know (speculators writes qwen3 or llama)") from None
    try:
        with quiet_transformers():  # (its notices on the file, e.g. a YaRN factor: dflash-torch says what matters)
            return config_class(**{k: v for k, v in layer.items() if k != "model_type"}).to_dict()
    except Exception as exc:  # (transformers' own validation of a user's file: any of its errors)
        reason = " ".join(str(exc).split())
        raise DFlashError(f"drafter config.json transformer_layer_config (model_type {model_type!r}) does not load "
                          f"in transformers: {reason[:300]}{' ...' if len(reason) > 300 else ''}") from None


def read_config(cfg: dict) -> DrafterConfig:
    """Parse a Speculators-format DFlash drafter ``config.json``.

    Raises:
        DFlashError: another Speculators model type (e.g. ``dspark``, ``eagle3``), a
            drafter trained to predict from its anchor slot (``sample_from_anchor``), a
            Domino projector or shifted labels (:data:`VARIANT_KEYS`), no
            ``transformer_layer_config`` / ``mask_token_id`` / ``aux_hidden_state_layer_ids``,
            a negative aux id, a ``target_hidden_size`` that is not an integer >= 1,
            partial RoPE, sliding-window layers without a window, a draft vocabulary larger
            than the target's, a ``quantization_config``, a layer config transformers' own
            class refuses, or anything :meth:`DrafterConfig.from_dict` refuses in it.

    The aux ids are read in increasing order (vLLM captures the features walking the
    layers; a repeated id, which the library refuses to train, reads that layer twice);
    nested per-layer-type ``rope_parameters`` give the ``sliding_attention`` entry (as the
    library flattens them).
    """
    kind = cfg.get("speculators_model_type")
    refuse_quantized(cfg, "drafter")
    if kind != "dflash":
        raise DFlashError(f"drafter config.json is a Speculators {kind!r} model; dflash-torch runs Speculators "
                          "'dflash' drafters only")
    refuse_variants(cfg.get, "Speculators", VARIANT_KEYS)
    layer = _layer_config(cfg)
    if cfg.get("mask_token_id") is None:
        raise DFlashError("drafter config.json (Speculators format) lacks mask_token_id")
    ids = cfg.get("aux_hidden_state_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise DFlashError(f"drafter config.json aux_hidden_state_layer_ids must be a non-empty list of integers, got {ids!r}")
    if min(ids) < 0:
        raise DFlashError(f"drafter config.json aux_hidden_state_layer_ids {ids} include {min(ids)}")
    ids = sorted(ids)  # (vLLM captures them walking the layers: the features come in layer order)
    target_hidden = check_int(cfg, "target_hidden_size", "drafter")
    rope = layer.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("sliding_attention"), dict):
        rope = layer["rope_parameters"] = rope["sliding_attention"]  # (per-layer-type RoPE: the library takes this one)
    rope = rope or layer.get("rope_scaling") or {}
    partial = rope.get("partial_rotary_factor", layer.get("partial_rotary_factor", 1.0)) if isinstance(rope, dict) else 1.0
    # (a factor below 1: vLLM serves it rotating part of each head, while the library's model builds its RoPE with
    # transformers' Qwen3RotaryEmbedding, whose plain RoPE ignores the factor under transformers 5 and rotates the
    # whole head: the two disagree, which the checkpoint was trained with is unknown, and dflash-torch's drafter
    # rotates whole heads only; the DFlash format refuses the key too, drafter_config.refuse_rope_and_value_variants)
    if partial not in (None, 1, 1.0):
        raise DFlashError(f"drafter transformer_layer_config has partial_rotary_factor {partial!r}; dflash-torch "
                          "runs drafters that rotate the whole head")
    draft_vocab = check_int(cfg, "draft_vocab_size", "drafter")
    draft_vocab = DEFAULT_DRAFT_VOCAB if draft_vocab is None else draft_vocab
    vocab = layer.get("vocab_size")
    if isinstance(vocab, int) and draft_vocab > vocab:
        raise DFlashError(f"drafter config.json draft_vocab_size {draft_vocab} exceeds the vocabulary of "
                          f"{vocab} tokens (transformer_layer_config.vocab_size)")
    if "sliding_attention" in (layer.get("layer_types") or ()) and layer.get("sliding_window") is None:
        raise DFlashError("drafter transformer_layer_config has sliding_attention layers but no window "
                          "(sliding_window is null, or use_sliding_window false turns it off)")
    block_size = cfg.get("block_size", DEFAULT_BLOCK_SIZE)
    dflash = {k: v for k, v in layer.items() if k not in ("dflash_config", "block_size", "num_target_layers")}
    dflash.update(architectures=["DFlashDraftModel"], block_size=block_size,
                  dflash_config={"mask_token_id": cfg["mask_token_id"], "target_layer_ids": [i - 1 for i in ids]})
    out = DrafterConfig.from_dict(dflash)
    out.target_hidden_size = target_hidden
    non_causal = bool_field(cfg, "sliding_window_non_causal", "drafter", False)
    out.causal_layers = [w is not None and not non_causal for w in out.sliding_windows]
    spec = cfg.get("speculators_config")
    verifier = spec.get("verifier") if isinstance(spec, dict) else None
    archs = verifier.get("architectures") if isinstance(verifier, dict) else None  # (informational: odd values ignored)
    out.speculators = SpeculatorsSettings(
        draft_vocab_size=draft_vocab,
        verifier_families=tuple(sorted(_families(archs))),
        aux_ids=tuple(ids))
    return out


FAMILY_SUFFIXES = ("ForConditionalGeneration", "TextForCausalLM", "ForCausalLM", "TextModel", "Model")


def _families(architectures) -> set[str]:
    """``["Qwen3ForCausalLM"]`` -> ``{"Qwen3"}``: the model families of architecture names (a
    text and a multimodal checkpoint of one family share one; a single name may come as a
    string; names that are not non-empty strings are skipped)."""
    names = [architectures] if isinstance(architectures, str) else architectures
    out = set()
    for name in names if isinstance(names, (list, tuple)) else ():
        if isinstance(name, str) and name:
            suffix = next((x for x in FAMILY_SUFFIXES if name.endswith(x) and len(name) > len(x)), "")
            out.add(name[:len(name) - len(suffix)])
    return out


def verifier_mismatch(cfg: DrafterConfig, target_architectures: list) -> str | None:
    """A warning when a Speculators drafter was trained for another model family than the
    target's (``speculators_config.verifier.architectures`` against the target's
    ``architectures``): the output stays the target's, but its drafts will rarely be accepted.
    None when they match or either is unknown."""
    trained = set(cfg.speculators.verifier_families if cfg.speculators else ())
    given = _families(target_architectures)
    if not trained or not given or trained & given:
        return None
    return (f"the drafter was trained for a {'/'.join(sorted(trained))} target (speculators_config.verifier), this "
            f"target is {'/'.join(sorted(given))}: the output is the target's, but few drafts may be accepted")


def match_checkpoint(cfg: DrafterConfig, names: set[str]) -> None:
    """Record in ``cfg.speculators`` which optional tensors the checkpoint ships (``names``).

    Raises:
        DFlashError: a draft vocabulary smaller than the target's without ``lm_head.weight``
            (the target's LM head has the other size) or without ``d2t`` (no way to map
            draft ids to tokens).
    """
    s = cfg.speculators
    s.own_embedding = "embed_tokens.weight" in names
    s.own_lm_head = "lm_head.weight" in names
    s.has_d2t = "d2t" in names
    if s.draft_vocab_size != cfg.vocab_size:
        for name, why in (("lm_head.weight", "its LM head"), ("d2t", "the draft-to-target token map")):
            if name not in names:
                raise DFlashError(f"the drafter has a draft vocabulary of {s.draft_vocab_size} tokens (the target's: "
                                  f"{cfg.vocab_size}) but its checkpoint lacks {name} ({why})")


class SpeculatorsDrafter(DFlashDrafter):
    """A Speculators-format DFlash drafter (see the module docstring): the DFlash body with,
    where its checkpoint has them, its own embedding and LM head and a draft vocabulary.

    ``embed_tokens``: ``nn.Embedding`` ``[vocab, hidden]`` or None (the target's table);
    ``lm_head``: ``nn.Linear`` ``hidden -> draft_vocab_size`` or None (the target's, same
    vocabulary); ``d2t``: int64 ``[draft_vocab_size]`` offsets (token = draft id + offset) or
    None (draft id = token).
    """

    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        s = cfg.speculators
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size) if s.own_embedding else None
        self.lm_head = nn.Linear(cfg.hidden_size, s.draft_vocab_size, bias=False) if s.own_lm_head else None
        if s.has_d2t:
            self.register_buffer("d2t", torch.zeros(s.draft_vocab_size, dtype=torch.long))
        else:
            self.d2t = None

    def adapt_checkpoint(self, state: dict[str, torch.Tensor], model_dir) -> dict[str, torch.Tensor]:
        """Check the vocabulary map (``d2t``, and ``t2d`` against it) and drop the tensors
        that only training reads (``t2d``, :data:`TRAINING_ONLY`), and an identity ``d2t``
        (a draft vocabulary that is the target's: the module then keeps none).

        Raises:
            DFlashError: ``d2t`` not integer, of the wrong shape, mapping to a token outside
                the vocabulary or two draft ids to one token; ``t2d`` of the wrong shape or
                marking another set of tokens; with equal vocabularies, a ``d2t`` that is not
                all zero (the identity).
        """
        s, vocab = self.config.speculators, self.config.vocab_size
        t2d = state.pop("t2d", None)
        for name in TRAINING_ONLY:
            state.pop(name, None)
        d2t = state.get("d2t")
        if d2t is None:
            return state
        if d2t.is_floating_point() or d2t.dtype == torch.bool or tuple(d2t.shape) != (s.draft_vocab_size,):
            raise DFlashError(f"drafter checkpoint {model_dir}: d2t must be an integer tensor of shape "
                              f"({s.draft_vocab_size},), got {str(d2t.dtype).removeprefix('torch.')} {tuple(d2t.shape)}")
        d2t = d2t.long()
        tokens = torch.arange(s.draft_vocab_size, device=d2t.device) + d2t
        if int(tokens.min()) < 0 or int(tokens.max()) >= vocab:
            raise DFlashError(f"drafter checkpoint {model_dir}: d2t maps a draft id to a token outside the "
                              f"vocabulary of {vocab} (a corrupt checkpoint?)")
        if tokens.unique().numel() != tokens.numel():
            raise DFlashError(f"drafter checkpoint {model_dir}: d2t maps two draft ids to one token (a corrupt checkpoint?)")
        if s.draft_vocab_size != vocab and not bool((tokens[1:] > tokens[:-1]).all()):
            raise DFlashError(f"drafter checkpoint {model_dir}: d2t does not map draft ids to tokens in increasing order, "
                              "as speculators writes it (draft id i is the i-th token of the draft vocabulary, lm_head's row i)")
        if s.draft_vocab_size == vocab:  # (the identity: no map to apply each round)
            if bool((d2t != 0).any()):
                raise DFlashError(f"drafter checkpoint {model_dir}: the draft vocabulary is the target's, but d2t reorders it")
            del self._buffers["d2t"]
            self.d2t = None
            del state["d2t"]
            return state
        if t2d is not None:
            marked = t2d.reshape(-1).bool()
            if marked.numel() != vocab or int(marked.sum()) != s.draft_vocab_size or not bool(marked[tokens].all()):
                raise DFlashError(f"drafter checkpoint {model_dir}: t2d does not mark the tokens d2t maps to "
                                  "(a corrupt checkpoint?)")
        state["d2t"] = d2t
        return state

    def share_with(self, target) -> int:
        """Use the target's embedding table / LM head instead of the drafter's own copies
        where these equal them bit for bit (as a converted checkpoint's do); returns the
        bytes freed."""
        freed = 0
        table = target.model.embed_tokens.weight
        if self.embed_tokens is not None and same_tensor(self.embed_tokens.weight, table):
            freed += self.embed_tokens.weight.nbytes
            self.embed_tokens = None
        head = getattr(target.lm_head, "weight", None)
        if self.lm_head is not None and self.d2t is None and head is not None and same_tensor(self.lm_head.weight, head):
            freed += self.lm_head.weight.nbytes
            self.lm_head = None
        return freed

    def feature_layers(self, target) -> list[int]:
        """The target feature ids of the aux ids as vLLM captures them, the input of decoder
        layer a: the output of layer a - 1; for a = 0 the decoder's input rows
        (:data:`~dflash_torch.models.target.EMBEDDING_OUTPUT`), for a = the target's layer
        count the last layer's output before the final norm (feature id L)."""
        layers = target.config.num_hidden_layers
        return [layers if a == layers else a - 1 for a in self.config.speculators.aux_ids]

    def embed(self, target, tokens: torch.Tensor) -> torch.Tensor:
        """The block's embedding rows: the drafter's own table, else the target's rows as
        stored (no family scale: speculators embeds with a plain copy of the table)."""
        table = self.embed_tokens if self.embed_tokens is not None else target.model.embed_tokens
        return table(tokens)

    def draft_logits(self, target, slots: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[..., vocab]`` of final hidden rows ``slots`` ``[..., hidden]``: the
        drafter's LM head (else the target's, without its output scale or soft cap),
        spread over the target's vocabulary through ``d2t`` (``-inf`` elsewhere); times the
        layer config's ``logit_scale`` where it is not 1 (as vLLM scales them)."""
        logits = self.lm_head(slots) if self.lm_head is not None else target.logits(slots)
        if self.config.logit_scale != 1.0:
            logits = logits * self.config.logit_scale
        if self.d2t is None:
            return logits
        tokens = self.d2t + torch.arange(self.d2t.shape[0], device=self.d2t.device)
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy(-1, tokens, logits)

    def kv_windows(self) -> list[int | None]:
        """A sliding layer's block reaches one position further back than its window: its
        first row sees ``[s - window, s]`` (:meth:`visible_keys`), ``window + 1`` positions."""
        return [None if layer.sliding_window is None else layer.sliding_window + 1 for layer in self.layers]

    def visible_keys(self, layer: DraftLayer, positions: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Full-attention layers: every key before the block's end. Sliding-window layers:
        the context keys at positions ``>= s - window`` (s: the block's first position) and
        the block's keys up to the row's own position (the whole block with
        ``sliding_window_non_causal``), as speculators trains them."""
        last = positions[..., None] if layer.causal else positions[..., -1:, None]
        if layer.sliding_window is None:
            return k_pos <= last
        return (k_pos >= positions[..., :1, None] - layer.sliding_window) & (k_pos <= last)

