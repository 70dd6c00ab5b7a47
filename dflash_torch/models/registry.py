"""Which module implements each target ``model_type`` (as transformers 5.x writes it).

A family module defines ``parse_config(cfg: dict) -> TargetConfig`` and ``Model``, a
:class:`~dflash_torch.models.target.TargetModel` subclass.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import DFlashError

FAMILIES = {
    "qwen3": "llama",
    "llama": "llama",
    "qwen2": "llama",
    "qwen3_moe": "qwen3_moe",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "qwen3_next": "qwen3_next",
    "gpt_oss": "gpt_oss",
    "muse_glimmer_text": "muse_glimmer",
    "muse_glimmer": "muse_glimmer",
    "gemma4_text": "gemma4",
    "gemma4": "gemma4",
    "gemma4_unified_text": "gemma4",
    "gemma4_unified": "gemma4",
    "minimax_m2": "minimax_m2",
    "deepseek_v3": "deepseek_v3",
    "kimi_k25": "deepseek_v3",
    "glm4_moe_lite": "glm4_moe_lite",
    "deepseek_v32": "deepseek_v32",
    "glm_moe_dsa": "deepseek_v32",
    "deepseek_v4": "deepseek_v4",
    "laguna": "laguna",
    "nemotron_h": "nemotron_h",
    "mimo_v2_flash": "mimo_v2_flash",
    "glm5_next": "glm5_next",
    "glm5_next_text": "glm5_next",
    "kimi_linear": "kimi_linear",
}


def family(model_type: str | None) -> ModuleType:
    """The family module of a target ``model_type``.

    Raises:
        DFlashError: a ``model_type`` no family supports.
    """
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise DFlashError(f"unsupported target model_type {model_type!r}; supported: {', '.join(FAMILIES)}")
    return importlib.import_module(f"{__package__}.{FAMILIES[model_type]}")
