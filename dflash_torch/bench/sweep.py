"""Propose time against the committed context length: injected KV cache vs recompute.

The drafter runs alone on synthetic context features (random rows of the right
width), so lengths beyond the target's own context limit can be measured.
"""

from __future__ import annotations

import time

import torch

from ..checkpoint import available_memory, memory_text
from ..errors import DFlashError
from ..models.drafter_config import DrafterConfig
from ..models.drafter import DFlashDrafter, InjectedContext, RecomputedContext, drafter_class
from ..models.packing import packing_supported


def sweep_bytes(cfg: DrafterConfig, context_len: int, block_size: int, dtype: torch.dtype) -> int:
    """An upper estimate of the memory (bytes) one :func:`propose_time` at ``context_len``
    takes: the random feature rows (made in float32, then cast), the injected cache and the
    recompute mode's re-projected keys and values, of every drafter layer."""
    elem = torch.empty((), dtype=dtype).element_size()
    width = len(cfg.target_layer_ids) * cfg.feature_size
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    return (context_len + block_size + 1) * ((4 + elem) * width + 2 * elem * kv)


def check_sweep_fits(cfg: DrafterConfig, lengths: list[int], block_size: int, dtype: torch.dtype,
                     device: str | torch.device, what: str = "the drafter", built: bool = True) -> None:
    """Refuse a sweep whose longest context would not fit in 90% of ``device``'s free memory
    (``built`` False: the drafter is yet to be made, so its weights count too, twice where
    its linears are prepacked).

    Raises:
        DFlashError: naming ``--sweep``, the bytes needed and those free.
    """
    free, longest = available_memory(device), max(lengths)
    need = sweep_bytes(cfg, longest, block_size, dtype)
    if not built:
        with torch.device("meta"):
            params = sum(p.numel() for p in drafter_class(cfg)(cfg).parameters())
        need += params * torch.empty((), dtype=dtype).element_size() * (2 if packing_supported(dtype, device) else 1)
    if free is not None and need > 0.9 * free:
        raise DFlashError(f"--sweep {longest} needs about {memory_text(need, True)} for {what}'s propose timing; "
                          f"{device} has {memory_text(free, True)} free: lower --sweep")


@torch.inference_mode()
def propose_time(drafter: DFlashDrafter, embed: torch.nn.Module, mode: str, context_len: int,
                 block_size: int, repeats: int = 5, seed: int = 0) -> float:
    """Median seconds of one propose (drafter forward over a block of ``block_size``) at
    ``context_len`` committed tokens, with the context held as ``mode`` (inject | recompute).

    In ``recompute`` mode each propose re-projects all ``context_len`` feature rows
    (as the cache-less drafter must); in ``inject`` mode the rows before the last
    ``block_size`` were injected once, and each propose injects the last ``block_size``
    rows (a full round's worth, as the decoding loop folds them into the propose) and
    reads the cache.
    """
    cfg = drafter.config
    w = drafter.fc.weight
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(context_len, w.shape[1], generator=g).to(w.device, w.dtype)
    ctx = InjectedContext(drafter) if mode == "inject" else RecomputedContext(drafter)
    ctx.reset(context_len + block_size + 1)
    fresh = max(context_len - block_size, 0) if mode == "inject" else context_len
    for c0 in range(0, fresh, 1024):
        c1 = min(c0 + 1024, fresh)
        ctx.inject(drafter, feats[c0:c1], torch.arange(c0, c1, device=w.device))
    inject = None
    if fresh < context_len:
        inject = (feats[fresh:], torch.arange(fresh, context_len, device=w.device))
    block = torch.full((block_size,), cfg.mask_token_id, dtype=torch.long, device=w.device)
    x = embed(block)
    positions = torch.arange(context_len, context_len + block_size, device=w.device)
    times = []
    for _ in range(repeats + 1):
        if w.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        drafter(x, positions, ctx, context_len + block_size, inject=inject)
        if w.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return times[len(times) // 2]


def context_sweep(drafter: DFlashDrafter, embed: torch.nn.Module, lengths: list[int], block_size: int,
                  repeats: int = 5) -> dict:
    """``{"lengths": [...], "inject": [s...], "recompute": [s...], "ratio_longest_over_shortest":
    {"inject": r, "recompute": r}}``: median propose seconds per length, and the growth
    from the shortest length to the longest."""
    out = {"lengths": list(lengths), "inject": [], "recompute": []}
    for n in lengths:
        for mode in ("inject", "recompute"):
            out[mode].append(propose_time(drafter, embed, mode, n, block_size, repeats))
    longest, shortest = lengths.index(max(lengths)), lengths.index(min(lengths))
    out["ratio_longest_over_shortest"] = {m: out[m][longest] / out[m][shortest] for m in ("inject", "recompute")}
    return out
