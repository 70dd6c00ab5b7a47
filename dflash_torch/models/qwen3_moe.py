"""Qwen3-MoE targets (``qwen3_moe``, e.g. Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3
attention (per-head q/k RMSNorm) with a sparse mixture-of-experts MLP (softmax router,
top-k, renormalised when ``norm_topk_prob``) on the layers that ``decoder_sparse_step``
/ ``mlp_only_layers`` select, a dense SwiGLU MLP elsewhere (transformers'
``modeling_qwen3_moe.py``). Per-expert checkpoint weights are stacked when loaded."""

from __future__ import annotations

import torch

from ..errors import DFlashError
from . import llama
from .config import (TargetConfig, base_target_fields, moe_config, refuse_partial_rotary, refuse_sliding_layers,
                     sparse_layers)
from .moe import fuse_expert_weights
from .target import DecoderLayer, sparse_moe

QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "modelopt")  # dequantized when loading (fp8, packed_int, nvfp4)


def parse_config(cfg: dict) -> TargetConfig:
    """A ``qwen3_moe`` ``config.json`` -> :class:`TargetConfig`.

    Raises:
        DFlashError: missing keys or sliding layers (not supported:
            :func:`~dflash_torch.models.config.refuse_sliding_layers`).
    """
    refuse_sliding_layers(cfg, "qwen3_moe")
    fields = base_target_fields(cfg, "qwen3_moe")
    refuse_partial_rotary(fields, "qwen3_moe")
    moe = moe_config(cfg)
    fields.update(qk_norm=True, moe=moe, moe_layers=sparse_layers(cfg, moe.num_experts))
    if not all(fields["moe_layers"]) and not fields["intermediate_size"]:
        raise DFlashError("target config.json lacks intermediate_size (needed by its dense layers)")
    return TargetConfig(**fields)


class Model(llama.Model):
    """Qwen3 decoder layers whose MLP is a mixture of experts where the config says so."""

    def make_layer(self, index: int, kind: str, slot: int) -> DecoderLayer:
        layer = super().make_layer(index, kind, slot)
        if self.config.moe_layers[index]:
            layer.mlp = sparse_moe(self.config)
        return layer

    @classmethod
    def convert_checkpoint(cls, cfg: TargetConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return fuse_expert_weights(state, cfg.moe.num_experts)
