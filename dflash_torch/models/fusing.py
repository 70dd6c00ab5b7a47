"""Joined projections for inference on a GPU: the linears of a layer that read the same
rows become one (a target attention's ``q_proj``/``k_proj``/``v_proj`` -> ``qkv_proj``,
a drafter attention's ``k_proj``/``v_proj`` -> ``kv_proj``, every SwiGLU MLP's
``gate_proj``/``up_proj`` -> ``gate_up_proj``, a Gated DeltaNet layer's four input
projections -> ``in_proj``).

Decoding multiplies 1 (a target-only step) to B (a verify or propose block) rows by
each weight: reading the weights is the cost. One matmul over the joined weight
replaces two or three small ones, each a kernel launch with its own tail (under CUDA
graphs the launches are not paid on the host, but every kernel still starts, ramps up
and drains on the device). The usual layout of GPU inference engines (e.g. vLLM's
merged QKV and gate-up linears, gpt-fast's ``wqkv``). Same outputs, column for column.

On a CPU this gains nothing measurable (float32 ``F.linear`` timed in a loop on this
project's 2-core machine at the shipped pair's widths, 1 and 16 rows: joined and
separate within noise of each other), so the engine joins on CUDA only
(:func:`fuse_by_default`). What it gains on a GPU is measured by
``scripts/gpu_profile.py`` (joined vs separate, kernel by kernel).
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import Attention
from .gated_deltanet import GatedDeltaNet
from .layers import MLP


def fuse_by_default(device: torch.device | str) -> bool:
    """Whether the engine joins projections on ``device``: on CUDA."""
    return torch.device(device).type == "cuda"


def fuse_projections(model: nn.Module, query: bool) -> int:
    """Join the projections of every :class:`Attention`, :class:`MLP` and
    :class:`GatedDeltaNet` below ``model``
    (in place; a model loaded for inference: parameter names change, weights are moved
    into the joined tensors, not copied twice).

    Args:
        query: join the query projection too (a target: :meth:`Attention.project`);
            False for a drafter (keys and values only).

    Returns:
        the number of modules changed.
    """
    count = 0
    for m in model.modules():
        if isinstance(m, Attention) and m.qkv_proj is None and m.kv_proj is None:
            m.fuse(query)
            count += 1
        elif (isinstance(m, MLP) and m.gate_up_proj is None) or (isinstance(m, GatedDeltaNet) and m.in_proj is None):
            m.fuse()
            count += 1
    return count
