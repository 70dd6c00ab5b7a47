"""Multimodal checkpoints decoded as text: their config keeps the language model's under
``text_config``, and the weights of their language model lie under ``model.language_model.``
beside towers (vision, audio) that a text decoder never runs. Shared by the families whose
published checkpoints are such wrappers (Qwen3.5, Muse Glimmer, Gemma 4)."""

from __future__ import annotations

import torch

from ..errors import DFlashError

INNER = "model.language_model."


def text_config(cfg: dict, wrappers, inherit: tuple[str, ...] = ()) -> dict:
    """The language model's config dict: a wrapper's (``model_type`` in ``wrappers``)
    ``text_config``, with the wrapper's values of the ``inherit`` keys where it has none
    (some wrappers keep those at the top level); any other config as it is.

    Raises:
        DFlashError: a wrapper config without ``text_config``.
    """
    if cfg.get("model_type") not in wrappers:
        return cfg
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise DFlashError(f"target config.json of model_type {cfg['model_type']!r} lacks text_config")
    merged = dict(text)
    for key in inherit:
        if merged.get(key) is None and cfg.get(key) is not None:
            merged[key] = cfg[key]
    return merged


def unwrap_language_model(cfg, state: dict[str, torch.Tensor], towers: tuple[str, ...], tower_words: str,
                          family: str, wrappers: str) -> dict[str, torch.Tensor]:
    """Move the decoder's weights from ``model.language_model.X`` to ``model.X`` (in place).

    A text config whose checkpoint keeps that layout (transformers' text classes read it)
    is read the same way; ``cfg.checkpoint_prefix`` is then set to it, so that messages
    name the weights as the file does.

    Args:
        cfg: the target config (its ``checkpoint_prefix`` and ``model_type`` are read, the
            former may be set).
        state: name -> tensor, with the towers' weights already left out of a wrapper's.
        towers: name prefixes of the parts a text decoder does not run.
        tower_words: those parts in words, without an article, for messages (e.g.
            ``"vision tower"``).
        family: the family's name, for messages (e.g. ``"Qwen3.5"``).
        wrappers: the wrapper ``model_type`` values, for messages (e.g. ``"qwen3_5 or qwen3_5_moe"``).

    Raises:
        DFlashError: a text config over a checkpoint with a tower (the tower named), a
            wrapper config over a checkpoint with no weight under ``model.language_model.``
            (a text checkpoint's layout), or a checkpoint with weights under ``model.``
            outside the language model and the towers.
    """
    if cfg.checkpoint_prefix == "model." and any(k.startswith(INNER) for k in state):
        cfg.checkpoint_prefix = INNER
    if cfg.checkpoint_prefix != INNER:
        return state
    if not any(k.startswith(INNER) for k in state):  # (the config is a wrapper's: a text config would read them)
        first = next((k for k in sorted(state) if k.startswith("model.")), None)
        raise DFlashError(f"the target config.json is a {family} multimodal wrapper's (model_type {wrappers}), whose "
                          f"decoder's weights lie under {INNER}, but no weight of the checkpoint is there"
                          + (f": its weights ({first}, ...) are laid out as a text checkpoint's; use the text model's "
                             "config.json (text_config's keys, with its model_type, at the top level)" if first else ""))
    outside = sorted(k for k in state if k.startswith("model.") and not k.startswith(INNER))
    tower = next((p for p in towers if any(k.startswith(p) for k in outside)), None)
    if tower is not None:
        raise DFlashError(f"the target checkpoint has a {tower_words} ({tower}*), which a {cfg.model_type} config does "
                          f"not describe: use the checkpoint's multimodal config.json (model_type {wrappers}, decoded "
                          "as text) or leave those weights out")
    if outside:
        raise DFlashError(f"the target checkpoint keeps its decoder's weights under {INNER} but also has weights "
                          f"outside it (and outside the {tower_words}) that no {family} model uses: "
                          f"{', '.join(outside[:5])}{' ...' if len(outside) > 5 else ''}")
    for key in [k for k in state if k.startswith(INNER)]:
        state["model." + key[len(INNER):]] = state.pop(key)
    return state
