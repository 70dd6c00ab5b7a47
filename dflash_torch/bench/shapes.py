"""Round-vs-step timing at the shapes of real target/drafter pairs, with randomly
initialised weights (the timing of a forward does not depend on the weight values).

Reports the time of one DFlash round (propose + verify + inject) against one
target-only decoding step, and the speedup that follows at the published DFlash
acceptance lengths. That speedup is a *projection*: tau is taken from the DFlash
paper (arXiv 2602.06036, Qwen3-8B, greedy), not measured on these random models.
"""

from __future__ import annotations

import gc
import time

import torch

from ..decoding import SpeculativeDecoder
from ..models.config import DrafterConfig, TargetConfig, default_target_layer_ids
from ..models.drafter import DFlashDrafter
from ..models.rope import Rotary
from ..models.packing import pack_linears, packing_supported
from ..models.registry import family
from ..models.target import TargetModel

# Shapes from the public Qwen3 configs (hidden, layers, heads, kv heads, head dim, MLP).
SHAPES = {
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072),
    "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144),
    "qwen3-4b": (2560, 36, 32, 8, 128, 9728),
    "qwen3-8b": (4096, 36, 32, 8, 128, 12288),
}
VOCAB = 151936
PUBLISHED_TAU = {"mean (paper, Qwen3-8B)": 6.49, "MT-Bench": 4.24, "MATH-500": 7.87}


def _random_init(module: torch.nn.Module, dtype: torch.dtype, device: str) -> torch.nn.Module:
    module.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02, generator=g)
    module = module.to(dtype)
    if isinstance(module, (TargetModel, DFlashDrafter)):  # to_empty left the (non-persistent) rope table unset
        cfg = module.config
        module.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_position_embeddings=cfg.max_position_embeddings).to(device)
    return module


def drafter_config(shape: str | tuple, draft_layers: int = 5, block_size: int = 16, vocab: int = VOCAB) -> DrafterConfig:
    """The config of a DFlash drafter for a target of ``shape`` (layers shaped like the target's)."""
    hidden, layers, heads, kv, hd, inter = SHAPES[shape] if isinstance(shape, str) else shape
    return DrafterConfig(hidden, draft_layers, heads, kv, hd, inter, 1e-6, 1e6, None, False, block_size, vocab - 1,
                         default_target_layer_ids(layers, draft_layers), layers, vocab, [None] * draft_layers)


def build_drafter(shape: str | tuple, dtype: torch.dtype, device: str, draft_layers: int = 5,
                  block_size: int = 16) -> tuple[DFlashDrafter, torch.nn.Embedding]:
    """A random drafter for a target of ``shape`` and a small random embedding of its width
    (enough to embed mask blocks for propose timing; the target itself is not built)."""
    cfg = drafter_config(shape, draft_layers, block_size, vocab=1024)
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg)
    drafter = _random_init(drafter, dtype, device).eval()
    if packing_supported(dtype, device):  # as the engine loads models
        pack_linears(drafter)
    embed = torch.nn.Embedding(1024, cfg.hidden_size, device=device, dtype=dtype)
    return drafter, embed


def build_pair(shape: str | tuple, dtype: torch.dtype, device: str, draft_layers: int = 5, block_size: int = 16,
               vocab: int = VOCAB):
    """A random target of ``shape`` (a name of :data:`SHAPES` or its tuple) and a random
    DFlash drafter of ``draft_layers`` layers for it."""
    hidden, layers, heads, kv, hd, inter = SHAPES[shape] if isinstance(shape, str) else shape
    tcfg = TargetConfig("qwen3", vocab, hidden, layers, heads, kv, hd, inter, 1e-6, 1e6, None, 40960, True, False, True, [])
    dcfg = drafter_config(shape, draft_layers, block_size, vocab)
    with torch.device("meta"):
        target, drafter = family(tcfg.model_type).Model(tcfg), DFlashDrafter(dcfg)
    target = _random_init(target, dtype, device).eval()
    target.lm_head.weight = target.model.embed_tokens.weight
    drafter = _random_init(drafter, dtype, device).eval()
    if packing_supported(dtype, device):  # as the engine loads models
        pack_linears(target)
        pack_linears(drafter)
    return target, drafter


@torch.inference_mode()
def round_vs_step(shape: str | tuple, dtype: torch.dtype = torch.bfloat16, device: str = "cpu", context: int = 512,
                  block_size: int = 16, repeats: int = 5, vocab: int = VOCAB, draft_layers: int = 5) -> dict:
    """Median seconds of one target-only step and of one DFlash round at ``context`` tokens."""
    target, drafter = build_pair(shape, dtype, device, draft_layers=draft_layers, block_size=block_size, vocab=vocab)
    prompt = torch.randint(0, vocab - 2, (context,)).tolist()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def median(fn):
        times = []
        for _ in range(repeats + 1):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        times = sorted(times[1:])
        return times[len(times) // 2]

    base = SpeculativeDecoder(target, None, max_context=context + 64)
    base.target_cache.reset(context + 64)
    base._prefill(torch.tensor(prompt, device=device), context)
    tok = torch.tensor(1, device=device)
    step = median(lambda: base._verify_fn(tok.view(1), context, context + 1))

    spec = SpeculativeDecoder(target, drafter, block_size=block_size, max_context=context + 64)
    spec.target_cache.reset(context + 64)
    spec.context.reset(context + 64)
    spec._prefill(torch.tensor(prompt, device=device), context)
    B = block_size

    # the propose injects the previous verify's B feature rows (the fixed-shape worst
    # case); placed at the block's own positions, where the block's K/V overwrite them
    feats = [drafter.fc.weight.new_zeros(B, drafter.fc.in_features)]

    def one_round():
        draft = spec._draft_fn(tok, context, context + B, feats[0], context).argmax(-1)
        logits, feats[0] = spec._verify_fn(torch.cat([tok.view(1), draft]), context, context + B)
        logits.argmax(-1).tolist()

    rnd = median(one_round)
    propose = median(lambda: spec._draft_fn(tok, context, context + B, feats[0], context))
    result = {
        "shape": shape, "dtype": str(dtype).removeprefix("torch."), "device": device, "context": context,
        "block_size": B, "draft_layers": drafter.config.num_hidden_layers,
        "target_step_s": step, "round_s": rnd, "propose_s": propose, "round_over_step": rnd / step,
        "projected_speedup": {k: tau * step / rnd for k, tau in PUBLISHED_TAU.items()},
    }
    del target, drafter, base, spec
    gc.collect()
    return result
