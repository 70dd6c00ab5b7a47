"""Static, preallocated KV cache for one sequence.

Both the target and the drafter keep one. Entries are written at absolute
positions by index assignment (so positions may be a device tensor and shapes never
depend on the sequence length); ``length`` says how many positions are committed.
Rollback is just moving ``length``: entries past it are stale and are overwritten
before they can be read.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values: ``k[layer]``/``v[layer]`` of shape ``[kv_heads, capacity, head_dim]``.

    One tensor per layer (not views of one stacked tensor): torch.compile then writes
    new entries in place instead of copying the whole buffer on every write.

    Attributes:
        length: number of committed positions ``[0, length)`` (tokens).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str):
        self.shape = (num_layers, num_kv_heads, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.k = [torch.zeros(num_kv_heads, 0, head_dim, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.length = 0

    @property
    def capacity(self) -> int:
        """Positions that fit (tokens)."""
        return self.k[0].shape[1]

    def reset(self, capacity: int) -> None:
        """Start a new sequence: length 0, room for at least ``capacity`` positions.

        The buffers are reallocated only when they must grow (to a multiple of 256).
        """
        if capacity > self.capacity:
            capacity = -(-capacity // 256) * 256
            layers, heads, hd = self.shape
            self.k = [torch.zeros(heads, capacity, hd, dtype=self.dtype, device=self.device) for _ in range(layers)]
            self.v = [torch.zeros_like(t) for t in self.k]
        self.length = 0

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[kv_heads, T, head_dim]`` at int64 ``positions`` ``[T]``."""
        self.k[layer][:, positions] = k
        self.v[layer][:, positions] = v

    def view(self, layer: int, end: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``[0, end)`` (``end=None``: the whole buffer)."""
        if end is None:
            return self.k[layer], self.v[layer]
        return self.k[layer][:, :end], self.v[layer][:, :end]
