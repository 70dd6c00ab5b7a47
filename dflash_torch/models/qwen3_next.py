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
from . import fp8, qwen3_5
from .config import (TargetConfig, base_target_fields, bool_field, layer_types, linear_attention_config, moe_config,
                     rotary_fraction, sparse_layers)
from .moe import fuse_expert_weights

QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "modelopt")  # dequantized when loading (fp8, packed_int, nvfp4)


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
        """Split each linear-attention layer's fused ``in_proj_qkvz`` / ``in_proj_ba`` into
        Qwen3.5's four projections (FP8 weights kept as stored: their row scales alike),
        then stack the experts.

        Raises:
            DFlashError: an ``in_proj_qkvz`` without its ``in_proj_ba``, or either of
                another number of rows than config.json implies.
        """
        la = cfg.linear_attention
        dims = (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim)
        for key in [k for k in state if k.endswith("linear_attn.in_proj_qkvz.weight")]:
            base = key[: -len("in_proj_qkvz.weight")]
            if base + "in_proj_ba.weight" not in state:
                raise DFlashError(f"target checkpoint has {key} but not {base}in_proj_ba.weight")
            for suffix in ("", fp8.ROW_SCALE_SUFFIX):
                for fused, split, parts in (("in_proj_qkvz", _split_qkvz, ("in_proj_qkv", "in_proj_z")),
                                            ("in_proj_ba", _split_ba, ("in_proj_b", "in_proj_a"))):
                    name = f"{base}{fused}.weight{suffix}"
                    if name in state:
                        for part, rows in zip(parts, split(state.pop(name), *dims, name)):
                            state[f"{base}{part}.weight{suffix}"] = rows
        return fuse_expert_weights(state, cfg.moe.num_experts)


def _split_qkvz(qkvz: torch.Tensor, nk: int, nv: int, dk: int, dv: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the fused ``in_proj_qkvz`` (grouped per key head: q, k, v, z) -> the rows of
    Qwen3.5's ``in_proj_qkv`` (all q, all k, all v) and ``in_proj_z``."""
    r = nv // nk  # value heads per key head
    cols = qkvz.shape[-1]
    if qkvz.dim() != 2 or qkvz.shape[0] != nk * (2 * dk + 2 * r * dv):
        raise DFlashError(f"target weight {name} has shape {tuple(qkvz.shape)}, config.json implies "
                          f"({nk * (2 * dk + 2 * r * dv)}, {cols})")
    q, k, v, z = qkvz.view(nk, 2 * dk + 2 * r * dv, cols).split([dk, dk, r * dv, r * dv], dim=1)
    return torch.cat([t.reshape(-1, cols) for t in (q, k, v)]), z.reshape(-1, cols)


def _split_ba(ba: torch.Tensor, nk: int, nv: int, dk: int, dv: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the fused ``in_proj_ba`` (grouped per key head: b, a) -> Qwen3.5's
    ``in_proj_b`` and ``in_proj_a`` rows."""
    r = nv // nk
    cols = ba.shape[-1]
    if ba.dim() != 2 or ba.shape[0] != 2 * nv:
        raise DFlashError(f"target weight {name} has shape {tuple(ba.shape)}, config.json implies ({2 * nv}, {cols})")
    b, a = ba.view(nk, 2 * r, cols).split([r, r], dim=1)
    return b.reshape(-1, cols), a.reshape(-1, cols)
