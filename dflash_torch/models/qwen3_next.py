"""Qwen3-Next targets (``qwen3_next``, e.g. Qwen3-Next-80B-A3B, Qwen3-Coder-Next): the
Qwen3.5 hybrid decoder (Gated DeltaNet + gated attention, ``(1 + weight)`` norms, partial
RoPE) with mixture-of-experts MLPs and a shared expert on the layers that
``decoder_sparse_step`` / ``mlp_only_layers`` select (dense SwiGLU elsewhere), top-k
renormalised when ``norm_topk_prob``.

Its checkpoints fuse the linear-attention input projections per key-head group
(``in_proj_qkvz``: for each group ``[q, k, v, z]``; ``in_proj_ba``: ``[b, a]``; layout as
in transformers' ``Qwen3NextGatedDeltaNet.fix_query_key_value_ordering``); loading
reorders their rows into the Qwen3.5 layout (``in_proj_qkv``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``), which computes exactly the same projections. The
multi-token-prediction head (``mtp.``) is not read.
"""

from __future__ import annotations

import torch

from ..errors import DFlashError
from . import qwen3_5
from .config import (TargetConfig, base_target_fields, bool_field, layer_types, linear_attention_config, moe_config,
                     rotary_fraction, sparse_layers)
from .moe import fuse_expert_weights

QUANTIZATION_METHODS = ("fp8",)  # fine-grained FP8 weights, dequantized when loading (see fp8.py)


def parse_config(cfg: dict) -> TargetConfig:
    """A ``qwen3_next`` ``config.json`` -> :class:`TargetConfig`."""
    if "intermediate_size" not in cfg:
        raise DFlashError("target config.json lacks intermediate_size")
    fields = base_target_fields(cfg, "qwen3_next")
    moe = moe_config(cfg, shared_expert=True)
    fields.update(
        qk_norm=True,
        attention_output_gate=bool_field(cfg, "attn_output_gate", "target", True),  # published configs say true
        layer_types=layer_types(cfg),
        linear_attention=linear_attention_config(cfg),
        partial_rotary_factor=rotary_fraction(cfg, default=0.25),
        moe=moe,
        moe_layers=sparse_layers(cfg, moe.num_experts),
    )
    return TargetConfig(**fields)


class Model(qwen3_5.Model):
    """A Qwen3-Next decoder (the Qwen3.5 hybrid layers; MoE on the sparse layers)."""

    @classmethod
    def convert_checkpoint(cls, cfg: TargetConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        la = cfg.linear_attention
        for key in [k for k in state if k.endswith("linear_attn.in_proj_qkvz.weight")]:
            base = key[: -len("in_proj_qkvz.weight")]
            qkvz = state.pop(key)
            ba = state.pop(base + "in_proj_ba.weight", None)
            if ba is None:
                raise DFlashError(f"target checkpoint has {key} but not {base}in_proj_ba.weight")
            state.update(_split_projections(qkvz, ba, la.num_key_heads, la.num_value_heads, la.key_head_dim,
                                            la.value_head_dim, base, key))
        return fuse_expert_weights(state, cfg.moe.num_experts)


def _split_projections(qkvz: torch.Tensor, ba: torch.Tensor, nk: int, nv: int, dk: int, dv: int, base: str,
                       name: str) -> dict[str, torch.Tensor]:
    """Rows of the fused projections (grouped per key head) -> the four Qwen3.5 projections."""
    r = nv // nk  # value heads per key head
    hidden = qkvz.shape[-1]
    if qkvz.shape[0] != nk * (2 * dk + 2 * r * dv) or ba.shape[0] != 2 * nv:
        raise DFlashError(f"target weight {name} has shape {tuple(qkvz.shape)}, config.json implies "
                          f"({nk * (2 * dk + 2 * r * dv)}, {hidden})")
    q, k, v, z = qkvz.view(nk, 2 * dk + 2 * r * dv, hidden).split([dk, dk, r * dv, r * dv], dim=1)
    b, a = ba.view(nk, 2 * r, hidden).split([r, r], dim=1)

    def flat(t: torch.Tensor) -> torch.Tensor:  # group-major rows, as in the Qwen3.5 layout
        return t.reshape(-1, hidden)

    return {
        base + "in_proj_qkv.weight": torch.cat([flat(q), flat(k), flat(v)]),
        base + "in_proj_z.weight": flat(z),
        base + "in_proj_b.weight": flat(b),
        base + "in_proj_a.weight": flat(a),
    }
