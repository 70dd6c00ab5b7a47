"""Rotary position embedding (RoPE) in the "rotate half" layout of Llama/Qwen.

Frequency rules (``scaling["rope_type"]``, the ``rope_scaling`` / ``rope_parameters``
dict of a Hugging Face config, parsed by :func:`dflash_torch.models.config._rope`):

* ``None`` / ``"default"``: ``inv_freq[i] = theta ** (-2i / rotary_dim)``.
* ``"linear"``: ``inv_freq / factor``.
* ``"llama3"``: Meta's Llama 3.1 rule (``factor``, ``low_freq_factor``,
  ``high_freq_factor``, ``original_max_position_embeddings``).
* ``"yarn"``: YaRN (arXiv 2309.00071): ``factor``, optional ``beta_fast`` (32),
  ``beta_slow`` (1), ``original_max_position_embeddings``, ``truncate`` (True),
  ``attention_factor`` / ``mscale`` / ``mscale_all_dim``. YaRN also scales cos and sin
  by an attention factor (:func:`rope_attention_factor`).
* ``"proportional"`` (Gemma 4's full-attention layers; transformers'
  ``_compute_proportional_rope_parameters``): the first ``int(partial_rotary_factor *
  head_dim / 2)`` frequencies are ``theta ** (-2i / head_dim)``, the rest of the
  ``head_dim / 2`` are 0 (those channel pairs pass through), all divided by ``factor``
  (default 1). Unlike partial rotary below, the pairs span the whole head (channel ``i``
  with ``i + head_dim / 2``).

``original_max_position_embeddings`` absent from the dict falls back to the model's
``max_position_embeddings`` (as transformers' config standardisation does).

Partial rotary (``partial_rotary_factor`` < 1, e.g. 0.25 in Qwen3-Next and Qwen3.5):
only the first ``rotary_dim = int(head_dim * partial_rotary_factor)`` channels of each
head are rotated; the rest pass through.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import DFlashError


def rotary_dim(head_dim: int, partial_rotary_factor: float = 1.0) -> int:
    """Rotated channels per head: ``int(head_dim * partial_rotary_factor)``.

    Raises:
        DFlashError: the result is not an even number in ``[2, head_dim]``.
    """
    dim = int(head_dim * partial_rotary_factor)
    if dim < 2 or dim > head_dim or dim % 2:
        raise DFlashError(
            f"RoPE needs an even rotary dimension in [2, head_dim]; head_dim {head_dim} "
            f"with partial_rotary_factor {partial_rotary_factor} gives {dim}"
        )
    return dim


def _kind(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default"))


def _original_max_positions(scaling: dict, max_position_embeddings: int | None) -> float:
    """The pre-training context length of a llama3/yarn rule."""
    length = scaling.get("original_max_position_embeddings") or max_position_embeddings
    if length is None:
        raise DFlashError(
            f"rope scaling type {_kind(scaling)!r} needs original_max_position_embeddings "
            "(or the model's max_position_embeddings)"
        )
    return float(length)


def _yarn_factor(scaling: dict, max_position_embeddings: int | None) -> float:
    """YaRN's ``factor``; when null, ``max_position_embeddings / original`` (DeepSeek-V3 style)."""
    factor = scaling.get("factor")
    if factor is None:
        if max_position_embeddings is None:
            raise DFlashError("rope scaling type 'yarn' has factor null and no max_position_embeddings to derive it")
        return max_position_embeddings / _original_max_positions(scaling, max_position_embeddings)
    return float(factor)


def _yarn_inv_freq(base: torch.Tensor, dim: int, theta: float, scaling: dict,
                   max_position_embeddings: int | None) -> torch.Tensor:
    """Blend of interpolated (``base / factor``) and extrapolated (``base``) frequencies,
    with a linear ramp over the channel range between ``beta_fast`` and ``beta_slow``
    rotations within the original context."""
    factor = _yarn_factor(scaling, max_position_embeddings)
    original = _original_max_positions(scaling, max_position_embeddings)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def channel(rotations: float) -> float:  # the channel that turns `rotations` times over `original` positions
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = channel(beta_fast), channel(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return (base / factor) * ramp + base * (1 - ramp)


def _llama3_inv_freq(base: torch.Tensor, scaling: dict, max_position_embeddings: int | None) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = _original_max_positions(scaling, max_position_embeddings)
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > old_len / low, base / factor, base)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, partial_rotary_factor: float = 1.0,
                  max_position_embeddings: int | None = None) -> torch.Tensor:
    """Inverse RoPE frequencies, ``[rotary_dim // 2]`` float32 (computed in float64).

    Args:
        head_dim: channels per attention head.
        theta: RoPE base.
        scaling: ``None`` or a dict with ``rope_type`` in default / linear / llama3 / yarn /
            proportional and that rule's parameters (see the module docstring; proportional
            reads its own ``partial_rotary_factor`` from it); other keys are ignored.
        partial_rotary_factor: fraction of ``head_dim`` that is rotated.
        max_position_embeddings: fallback for a missing ``original_max_position_embeddings``.

    Computed on the CPU whatever the default device (a model built on the meta device
    rebuilds its :class:`Rotary` on its device after loading; meta arithmetic would import
    ``torch._dynamo``, about a second of every command's start).

    Raises:
        DFlashError: an unknown ``rope_type``, a rotary dimension that is not even, or
            no original context length for llama3/yarn.
    """
    with torch.device("cpu"):
        return _inv_freq(head_dim, theta, scaling, partial_rotary_factor, max_position_embeddings)


def _inv_freq(head_dim: int, theta: float, scaling: dict | None, partial_rotary_factor: float,
              max_position_embeddings: int | None) -> torch.Tensor:
    """:func:`rope_inv_freq` on the default device."""
    kind = _kind(scaling)
    if kind == "proportional":
        angles = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
        rotated = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.float64) / head_dim))
        inv_freq = torch.cat([rotated, torch.zeros(head_dim // 2 - angles, dtype=torch.float64)])
        return (inv_freq / float(scaling.get("factor", 1.0))).float()
    dim = rotary_dim(head_dim, partial_rotary_factor)
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if kind == "default":
        inv_freq = base
    elif kind == "linear":
        inv_freq = base / float(scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(base, scaling, max_position_embeddings)
    elif kind == "yarn":
        inv_freq = _yarn_inv_freq(base, dim, theta, scaling, max_position_embeddings)
    else:
        raise DFlashError(f"unsupported rope scaling type {kind!r}; supported: llama3, linear, yarn, proportional")
    return inv_freq.float()


def rope_attention_factor(scaling: dict | None, max_position_embeddings: int | None = None) -> float:
    """The factor that multiplies cos and sin: 1.0 except for YaRN, where it is
    ``attention_factor`` if given, else ``m(factor, mscale) / m(factor, mscale_all_dim)``
    when both ``mscale`` and ``mscale_all_dim`` are set, else ``m(factor, 1)``, with
    ``m(s, k) = 0.1 * k * ln(s) + 1`` for ``s > 1`` and 1 otherwise."""
    if _kind(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling, max_position_embeddings)

    def m(scale: float, k: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0

    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(m(factor, mscale) / m(factor, mscale_all_dim))
    return m(factor)


class Rotary(nn.Module):
    """RoPE tables for one model.

    Args:
        head_dim: channels per attention head.
        theta: RoPE base.
        scaling: see :func:`rope_inv_freq`.
        partial_rotary_factor: rotate only the first ``int(head_dim * factor)`` channels.
        max_position_embeddings: the model's context length (fallback for llama3/yarn's
            ``original_max_position_embeddings``).

    Attributes:
        inv_freq: ``[rotary_dim // 2]`` float32 buffer (not saved in checkpoints).
        rotary_dim: rotated channels per head.
        attention_factor: float multiplying cos and sin (YaRN; 1.0 otherwise).

    Raises:
        DFlashError: see :func:`rope_inv_freq`.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, partial_rotary_factor: float = 1.0,
                 max_position_embeddings: int | None = None):
        super().__init__()
        self.rotary_dim = head_dim if _kind(scaling) == "proportional" else rotary_dim(head_dim, partial_rotary_factor)
        self.attention_factor = rope_attention_factor(scaling, max_position_embeddings)
        inv_freq = rope_inv_freq(head_dim, theta, scaling, partial_rotary_factor, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin tables ``[T, rotary_dim]`` in ``dtype`` for int64 ``positions`` ``[T]``
        (rotate-half RoPE: :meth:`pair_cos_sin`'s tables twice)."""
        cos, sin = self.pair_cos_sin(positions, dtype)
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)

    def pair_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[*positions.shape, rotary_dim // 2]`` in ``dtype``, one entry per rotated
        pair of channels (as interleaved RoPE reads them), computed in float32 and multiplied by
        ``attention_factor`` before the cast."""
        freqs = positions.float()[..., None] * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[heads, T, head_dim]`` by per-position ``cos``/``sin`` ``[T, rotary_dim]``.

    The first ``rotary_dim = cos.shape[-1]`` channels are rotated (rotate-half layout
    within them); channels past ``rotary_dim`` pass through unchanged. Returns a tensor
    shaped like ``x``.
    """
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return _rotate(x, cos, sin)
    return torch.cat([_rotate(x[..., :d], cos, sin), x[..., d:]], dim=-1)
