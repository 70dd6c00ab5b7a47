"""Round-vs-step timing at the shapes of real target/drafter pairs, with randomly
initialised weights (the timing of a forward does not depend on the weight values).

Reports the time of one DFlash round (propose + verify + accept + the rollback of a
hybrid target's recurrent state) against one target-only decoding step, and the
speedup that follows at the published DFlash acceptance lengths. That speedup is a
*projection*: tau is taken from the DFlash paper (arXiv 2602.06036, Qwen3-8B, greedy),
not measured on these random models.

A target whose weights would not fit comfortably in memory is built with only a
whole number of periods of its layer pattern (e.g. 3 linear-attention + 1
full-attention layer, every expert of each MoE layer kept); the per-layer part of
its times is scaled to the full depth and the result says so (``scaled``,
``layers_timed``).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time

import torch
from torch import nn

from ..checkpoint import memory_text
from ..decoding import SpeculativeDecoder, compile_counts, eager_fallbacks
from ..errors import DFlashError
from ..models.config import TargetConfig
from ..models.drafter_config import DrafterConfig
from ..models.drafter import DFlashDrafter
from ..models.gated_deltanet import GatedDeltaNet, GatedRMSNorm
from ..models.gemma4 import Router as Gemma4Router
from ..models.layers import RMSNorm, ScaledRMSNorm, ZeroCenteredRMSNorm
from ..models.gpt_oss import GptOssMoE
from ..models.moe import SparseMoE
from ..models.fusing import fuse_by_default, fuse_projections
from ..models.packing import pack_linears, packing_supported
from ..models.registry import family
from ..models.rope import Rotary
from ..models.target import TargetModel
from ..sampling import accept_greedy, greedy_tokens
from .profile import kernel_summary
from ..training.trainer import TrainConfig, make_drafter_config

# The text-model fields of each public Hugging Face config.json (Qwen/<name>/config.json);
# keys the decoder ignores (bos/eos ids, dropout, vision tower) are left out. Where
# each number was read (public copies of the configs, model cards, training recipes):
_QWEN3 = {  # Qwen3 dense: Qwen/Qwen3-{0.6B,1.7B,4B,8B} config.json (their values are also in
    # transformers' Qwen3Config docs and many public finetune configs, e.g. copies of Qwen3-8B's)
    "model_type": "qwen3", "vocab_size": 151936, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "max_position_embeddings": 40960, "attention_bias": False,
}
# Qwen3.5 (multimodal wrapper, text under text_config). Hidden/layers/heads/kv heads/
# head_dim 256/FFN width/vocab 248320/rope_theta 1e7 with 25% partial rotary/3:1 layout
# from the Qwen3.5 model cards and public transcriptions of the configs (Qwen3.5-4B-Base
# text config in public fine-tuning tests; Qwen3.5-9B dense config in public serving
# tests; Qwen3.5/3.6-27B config fixtures; THUDM/slime scripts/models/qwen3.5-27B.sh);
# linear_* (Gated DeltaNet) dims from the same configs and the cards ("Number of Linear
# Attention Heads: 32 for V and 16 for QK, Head Dimension 128"; 48 for V for the 27B).
_QWEN3_5_TEXT = {
    "vocab_size": 248320, "head_dim": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_num_key_heads": 16,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "attn_output_gate": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}


_GPT_OSS = {
    "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_experts_per_tok": 4,
    "sliding_window": 128, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "attention_bias": True,
    "tie_word_embeddings": False, "swiglu_limit": 7.0, "rope_theta": 150000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
}


# Gemma 4 (text fields of google/gemma-4-*-it; the published checkpoints are multimodal
# wrappers, their decoder as gemma4_text here): every 6th layer full attention (heads of
# 512, keys reused as values, proportional RoPE on a quarter of the head), the others a
# window of 1,024 (heads of 256); tied 262,144-token vocabulary, logits soft-capped at 30.
# 31B: 60 layers, hidden 5376, 32 query heads over 16 KV heads (4 on full layers), MLP
# 21,504 (the model card of mlboydaisuke/Gemma-4-31B-CoreAI, apxml.com/models/gemma-4-31b).
# 26B-A4B: 30 layers, hidden 2816, 16 query heads over 8 KV heads (2 on full layers), a GeGLU
# MLP of 2,112 beside 128 experts of 704, 8 per token (a public write-up of the 26B-A4B's
# decode on MLX; transformers' Gemma4TextConfig EP plan names its 2 global KV heads).
_GEMMA4 = {
    "model_type": "gemma4_text", "vocab_size": 262144, "head_dim": 256, "global_head_dim": 512,
    "attention_k_eq_v": True, "sliding_window": 1024, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "final_logit_softcapping": 30.0, "hidden_size_per_layer_input": 0, "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
}


def _qwen3_5(model_type: str, tie: bool, **text) -> dict:
    return {"model_type": model_type, "tie_word_embeddings": tie,
            "text_config": {**_QWEN3_5_TEXT, "model_type": f"{model_type}_text", **text}}


SHAPES: dict[str, dict] = {
    "qwen3-0.6b": {**_QWEN3, "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "intermediate_size": 3072, "tie_word_embeddings": True},
    "qwen3-1.7b": {**_QWEN3, "hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "intermediate_size": 6144, "tie_word_embeddings": True},
    "qwen3-4b": {**_QWEN3, "hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "intermediate_size": 9728, "tie_word_embeddings": True},
    "qwen3-8b": {**_QWEN3, "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "intermediate_size": 12288, "tie_word_embeddings": False},
    # Qwen3.5-4B: tied embeddings per the small Qwen3.5 releases (not confirmed for the 4B itself)
    "qwen3.5-4b": _qwen3_5("qwen3_5", True, hidden_size=2560, num_hidden_layers=32, num_attention_heads=16,
                           num_key_value_heads=4, intermediate_size=9216, linear_num_value_heads=32),
    "qwen3.5-9b": _qwen3_5("qwen3_5", False, hidden_size=4096, num_hidden_layers=32, num_attention_heads=16,
                           num_key_value_heads=4, intermediate_size=12288, linear_num_value_heads=32),
    "qwen3.5-27b": _qwen3_5("qwen3_5", False, hidden_size=5120, num_hidden_layers=64, num_attention_heads=24,
                            num_key_value_heads=4, intermediate_size=17408, linear_num_value_heads=48),
    # Qwen3-30B-A3B (Qwen3-Coder-30B-A3B has the same layer shapes; rope_theta 1e7, 256K
    # context): 48 layers of 128 experts, 8 per token, width 768, all layers sparse. From
    # THUDM/slime scripts/models/qwen3-30B-A3B.sh, Ascend MindSpeed-RL qwen3_30b_a3b.yaml,
    # transformers' Qwen3MoeConfig defaults (which describe it) and public finetune configs.
    "qwen3-30b-a3b": {**_QWEN3, "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "intermediate_size": 6144,
                      "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                      "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "tie_word_embeddings": False},
    # Qwen3.5-35B-A3B: 40 layers, 10 x (3 Gated DeltaNet + 1 gated attention), 256 experts,
    # 8 routed + 1 shared, width 512 (model card; transformers' Qwen3_5MoeTextConfig
    # defaults name this checkpoint; public configs of its finetunes)
    "qwen3.5-35b-a3b": _qwen3_5("qwen3_5_moe", False, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                                num_key_value_heads=2, linear_num_value_heads=32, num_experts=256,
                                num_experts_per_tok=8, moe_intermediate_size=512,
                                shared_expert_intermediate_size=512),
    # Qwen3-Next-80B-A3B-Instruct config.json (public transcriptions of the release
    # config; transformers' Qwen3NextConfig names this checkpoint); layer_types unset in
    # the release, i.e. every 4th layer full attention
    "qwen3-next-80b-a3b": {
        "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "intermediate_size": 5120,
        "rms_norm_eps": 1e-6, "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
        "max_position_embeddings": 262144, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "tie_word_embeddings": False,
    },
    # openai/gpt-oss-20b and -120b config.json (also the defaults of transformers'
    # GptOssConfig, which names the 120b, and the gpt-oss model card): 24 / 36 layers
    # alternating 128-token sliding-window and full attention, 32 / 128 experts, 4 per token
    "gpt-oss-20b": {**_GPT_OSS, "num_hidden_layers": 24, "num_local_experts": 32},
    "gpt-oss-120b": {**_GPT_OSS, "num_hidden_layers": 36, "num_local_experts": 128},
    "gemma-4-31b": {**_GEMMA4, "hidden_size": 5376, "num_hidden_layers": 60, "num_attention_heads": 32,
                    "num_key_value_heads": 16, "num_global_key_value_heads": 4, "intermediate_size": 21504},
    "gemma-4-26b-a4b": {**_GEMMA4, "hidden_size": 2816, "num_hidden_layers": 30, "num_attention_heads": 16,
                        "num_key_value_heads": 8, "num_global_key_value_heads": 2, "intermediate_size": 2112,
                        "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704},
}
PUBLISHED_TAU = {"mean (paper, Qwen3-8B)": 6.49, "MT-Bench": 4.24, "MATH-500": 7.87}
MEMORY_FRACTION = 0.4  # targets whose weights take more of the machine's RAM are built as a layer subset
# a timing is flagged UNRELIABLE (:func:`unreliable`) where its repeats spread wider than this (slowest / fastest),
# or its round/step falls under this fraction of the round/step by weights read (a little under it is noise)
MAX_REPEAT_SPREAD = 1.5
FLOOR_SLACK = 0.9


def target_config(shape: str | dict) -> TargetConfig:
    """The target config of ``shape``: a name of :data:`SHAPES` or a ``config.json`` dict.

    Raises:
        DFlashError: an unknown name (the message lists the known ones) or a config its
            family's parser refuses.
    """
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise DFlashError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
        shape = SHAPES[shape]
    return TargetConfig.from_dict(shape)


def drafter_config(target: TargetConfig, draft_layers: int = 5, block_size: int = 16) -> DrafterConfig:
    """The drafter ``dflash-torch train`` would build for ``target``: its attention
    layers' hidden size, heads and RoPE base, ``draft_layers`` deep; for a target whose
    every MLP is a mixture of experts, a dense MLP of the width a token passes through."""
    train = TrainConfig(target="", data=[], out="", num_layers=draft_layers, block_size=block_size)
    return make_drafter_config(target, train, mask_token_id=target.vocab_size - 1)


def _random_init(module: nn.Module, dtype: torch.dtype, device: str) -> nn.Module:
    """Materialise a meta-device model in ``dtype`` on ``device`` with random weights:
    linears, embeddings, convolutions, experts and routers ~ N(0, 0.02); RMSNorm scales 1
    (zero-centred norms, which scale by ``1 + weight``, get 0), layer scalars 1; Gated DeltaNet
    ``dt_bias`` = 1 and ``A_log`` = log U(0.01, 16), as transformers initialises them
    (decays in (0, 1): the recurrence stays bounded). Seeded, and leaves the global RNG
    as it was."""
    module = module.to(dtype).to_empty(device=device)  # cast while on meta: no float32 copy is ever allocated
    seen = set()
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for m in module.modules():
            for name, p in m.named_parameters(recurse=False):
                if id(p) in seen:  # tied embedding / LM head
                    continue
                seen.add(id(p))
                if isinstance(m, ZeroCenteredRMSNorm):
                    p.zero_()
                elif isinstance(m, (RMSNorm, ScaledRMSNorm, GatedRMSNorm)) or (isinstance(m, GatedDeltaNet) and name == "dt_bias"):
                    p.fill_(1.0)
                elif isinstance(m, GatedDeltaNet) and name == "A_log":
                    p.copy_(torch.empty(p.shape).uniform_(0.01, 16).log_())
                else:
                    p.normal_(0, 0.02)
        for name, b in module.named_buffers():  # (to_empty left them unset: Gemma 4's layer scalars)
            if name.endswith("layer_scalar"):
                b.fill_(1.0)
    # to_empty left the (non-persistent) rope tables unset
    if isinstance(module, TargetModel):
        module.rotary = module.make_rotary().to(device)
    elif isinstance(module, DFlashDrafter):
        cfg = module.config
        module.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                               max_position_embeddings=cfg.max_position_embeddings).to(device)
    return module.eval()


def build_drafter(shape: str | dict, dtype: torch.dtype, device: str, draft_layers: int = 5,
                  block_size: int = 16, fuse: bool | None = None) -> tuple[DFlashDrafter, nn.Embedding]:
    """A random drafter for a target of ``shape`` and an embedding of its width that gives
    every token id one random row (enough to embed mask blocks for propose timing, whatever
    the mask token id; the target itself is not built). ``fuse``: join its projections
    (:mod:`~dflash_torch.models.fusing`; None: as the engine, on CUDA)."""
    dcfg = drafter_config(target_config(shape), draft_layers, block_size)
    with torch.device("meta"):
        drafter = DFlashDrafter(dcfg)
    drafter = _random_init(drafter, dtype, device)
    if fuse_by_default(device) if fuse is None else fuse:  # as the engine loads models
        fuse_projections(drafter, query=False)
    if packing_supported(dtype, device):
        pack_linears(drafter)
    return drafter, OneRowEmbedding(dcfg.hidden_size, dtype, device)


class OneRowEmbedding(nn.Module):
    """Embeds every token id ``[T]`` as the same random row -> ``[T, hidden]``."""

    def __init__(self, hidden: int, dtype: torch.dtype, device: str):
        super().__init__()
        self.row = nn.Parameter(torch.randn(1, hidden, dtype=dtype, device=device) * 0.02, requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.row.expand(ids.shape[0], -1)


def weight_bytes(cfg: TargetConfig, dtype: torch.dtype, device: str) -> tuple[int, list[int]]:
    """Bytes the weights of a target take once built as the engine builds it (in
    ``dtype``, plus the prepacked copy of every linear weight where packing applies):
    ``(embedding + final norm + LM head, [each decoder layer])``. Counted on the meta
    device (nothing is allocated)."""
    with torch.device("meta"):
        model = family(cfg.model_type).Model(cfg)
    layers = [_bytes(layer, dtype, device) for layer in model.model.layers]
    return _bytes(model, dtype, device) - sum(layers), layers


def _bytes(module: nn.Module, dtype: torch.dtype, device: str) -> int:
    """Bytes of ``module``'s parameters in ``dtype``, plus the prepacked copy of every
    linear weight where packing applies on ``device``."""
    n = sum(p.numel() for p in module.parameters())
    if packing_supported(dtype, device):
        n += sum(m.weight.numel() for m in module.modules() if type(m) is nn.Linear)
    return n * torch.empty((), dtype=dtype).element_size()


def pattern_period(cfg: TargetConfig) -> int:
    """The shortest run of layers that repeats to make the whole stack (same token mixer
    and same dense/MoE MLP at every position): 4 for a 3:1 hybrid, 1 for a uniform
    stack, ``num_hidden_layers`` when nothing repeats."""
    kinds = list(zip(cfg.layer_types, cfg.moe_layers))
    n = len(kinds)
    return next(p for p in range(1, n + 1) if n % p == 0 and kinds == kinds[:p] * (n // p))


def layers_to_build(fixed: int, per_layer: list[int], period: int, budget: int) -> int:
    """How many decoder layers to build: all of them when the weights (``fixed`` bytes
    plus ``per_layer``, see :func:`weight_bytes`) fit in ``budget`` bytes, else the most
    whole periods of the layer pattern that fit (at least one)."""
    total = len(per_layer)
    if fixed + sum(per_layer) <= budget:
        return total
    n = period
    while n + period < total and fixed + sum(per_layer[:n + period]) <= budget:
        n += period
    return n


def device_memory(device: str) -> int:
    """Bytes of memory the weights live in: the GPU's for ``cuda``, else this machine's RAM."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def layers_that_fit(shape: str | dict, dtype: torch.dtype, device: str,
                    memory_budget: int | None = None) -> tuple[int, int, list[int]]:
    """How many target layers :func:`round_vs_step` builds for ``shape`` (see its
    ``memory_budget``), with the bytes of :func:`weight_bytes`: ``(layers, fixed, per_layer)``.

    Raises:
        DFlashError: an unknown shape name, a config its parser refuses, or a target of
            which even one period of layers, with the drafter, does not fit in 80% of the
            memory of ``device`` (its message gives bfloat16's need where float32 was
            asked and bfloat16 would fit).
    """
    cfg = target_config(shape)
    memory = device_memory(device)
    budget = int(MEMORY_FRACTION * memory) if memory_budget is None else memory_budget
    n, fixed, per_layer, need = _layers_and_need(cfg, dtype, device, budget)
    if need > 0.8 * memory:
        hint = ""
        if dtype == torch.float32:  # (bfloat16 halves the weights, but on a CPU adds their prepacked copies)
            half = _layers_and_need(cfg, torch.bfloat16, device, budget)[3]
            if half <= 0.8 * memory:
                hint = f"; in bfloat16 (--dtype bfloat16) it needs {memory_text(half, True)}"
        raise DFlashError(f"shape {shape if isinstance(shape, str) else cfg.model_type} needs "
                          f"{memory_text(need, True)} in {str(dtype).removeprefix('torch.')} for {n} of its "
                          f"{cfg.num_hidden_layers} layers and the drafter; {device} has {memory_text(memory, True)}, of "
                          f"which a shape may take 80% ({memory_text(0.8 * memory, True)}){hint}")
    return n, fixed, per_layer


def _layers_and_need(cfg: TargetConfig, dtype: torch.dtype, device: str,
                     budget: int) -> tuple[int, int, list[int], int]:
    """:func:`layers_that_fit`'s count for ``dtype`` within ``budget`` bytes, with the bytes
    of :func:`weight_bytes` and those of the layers built plus the drafter:
    ``(layers, fixed, per_layer, need)``."""
    fixed, per_layer = weight_bytes(cfg, dtype, device)
    n = layers_to_build(fixed, per_layer, pattern_period(cfg), budget)
    with torch.device("meta"):
        drafter = _bytes(DFlashDrafter(drafter_config(cfg)), dtype, device)
    return n, fixed, per_layer, fixed + sum(per_layer[:n]) + drafter


def build_pair(shape: str | dict, dtype: torch.dtype, device: str, draft_layers: int = 5, block_size: int = 16,
               layers: int | None = None, fuse: bool | None = None) -> tuple[TargetModel, DFlashDrafter]:
    """A random target of ``shape`` (a name of :data:`SHAPES` or a ``config.json`` dict)
    and a random DFlash drafter of ``draft_layers`` layers for it (shaped for the full
    target). ``layers``: build only the first ``layers`` decoder layers (None: all).
    ``fuse``: join projections (:mod:`~dflash_torch.models.fusing`; None: as the
    engine, on CUDA)."""
    cfg = target_config(shape)
    dcfg = drafter_config(cfg, draft_layers, block_size)
    if layers is not None and layers < cfg.num_hidden_layers:
        cfg = dataclasses.replace(cfg, num_hidden_layers=layers, layer_types=cfg.layer_types[:layers],
                                  moe_layers=cfg.moe_layers[:layers])
    with torch.device("meta"):
        target, drafter = family(cfg.model_type).Model(cfg), DFlashDrafter(dcfg)
    target = _random_init(target, dtype, device)
    if cfg.tie_word_embeddings:
        target.lm_head.weight = target.model.embed_tokens.weight
    drafter = _random_init(drafter, dtype, device)
    if fuse_by_default(device) if fuse is None else fuse:  # as the engine loads models
        fuse_projections(target, query=True)
        fuse_projections(drafter, query=False)
    if packing_supported(dtype, device):
        pack_linears(target)
        pack_linears(drafter)
    return target, drafter


def weights_read(target: TargetModel, drafter: DFlashDrafter, layers: int) -> tuple[int, int] | None:
    """Bytes of weights that a target-only step and a propose read, for a dense target
    whose full depth is ``layers`` (the built layers' bytes scaled to it): the step reads
    every decoder layer, the final norm and the LM head; the propose reads the whole
    drafter and the target's LM head (both read only a few rows of the token embedding,
    left out). None for a mixture-of-experts target (what a step reads depends on the
    experts its tokens hit)."""
    if target.config.moe is not None:
        return None

    def size(params) -> int:
        return sum(p.numel() * p.element_size() for p in params)

    built = target.model.layers
    head = size([target.lm_head.weight])
    step = size(built.parameters()) * layers // len(built) + size(target.model.norm.parameters()) + head
    return step, size(drafter.parameters()) + head


def _experts_hit(target: TargetModel, run) -> float | None:
    """Mean number of distinct experts the router picks per MoE layer during ``run()``
    (None for a target without MoE layers)."""
    counts = []

    def count(module, args):
        counts.append(module.route(args[0])[1].unique().numel())

    def routed(module, args, out):  # (a Gemma 4 router returns the routing itself)
        counts.append(out[1].unique().numel())

    hooks = [m.register_forward_pre_hook(count) for m in target.modules() if isinstance(m, (SparseMoE, GptOssMoE))]
    hooks += [m.register_forward_hook(routed) for m in target.modules() if isinstance(m, Gemma4Router)]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return sum(counts) / len(counts) if counts else None


@torch.inference_mode()
def round_vs_step(shape: str | dict, dtype: torch.dtype = torch.bfloat16, device: str = "cpu", context: int = 512,
                  block_size: int = 16, repeats: int = 5, draft_layers: int = 5,
                  memory_budget: int | None = None, compiled: bool = False, fuse: bool | None = None,
                  profile: bool = False, compile_mode: str | None = None) -> dict:
    """Median seconds of one target-only step and of one DFlash round after ``context``
    committed tokens.

    The step is a 1-token verify that advances a hybrid target's recurrent state
    directly (target-only decoding). The round is a propose, a verify of B tokens (B
    random token ids: a random drafter's own argmax repeats tokens, which would route
    every row of an MoE verify to the same experts), the greedy acceptance with its one
    host sync, and, for a hybrid target, the commit of the accepted rows into the
    recurrent state, as :meth:`SpeculativeDecoder.rounds` runs them.

    Args:
        shape: a name of :data:`SHAPES` or a ``config.json`` dict.
        memory_budget: bytes the target's weights may take (default: 40% of the
            memory of ``device``). Over it, only whole periods of the layer pattern are
            built and timed (at least one), and the time a step or a round spends in
            decoder layers and commits (read by hooks at the first layer's input norm
            and at the final norm, in the same call) is scaled to the full depth; what
            every forward pays once (embedding, rope tables, mask, final norm, LM head,
            acceptance) and the propose are timed as they are. ``measured`` keeps the
            unscaled medians and their layer parts.
        compiled: time the fixed-shape steps as ``--compile`` runs them (``torch.compile``;
            on CUDA with CUDA graphs), after warm-up calls that build the graphs, instead
            of eager steps. Needs every layer in memory (no scaling through compiled
            graphs). Adds ``recompiles`` (graphs built after the warm-up),
            ``cudagraph_skips`` (graphs that ran without CUDA graphs, CUDA only) and
            ``eager_fallbacks`` (compiled steps that reached torch's recompile limit
            and ran eager after it).
        fuse: join projections as the engine does (None: on CUDA; see
            :mod:`~dflash_torch.models.fusing`).
        compile_mode: the ``torch.compile`` mode of ``compiled`` (None: as ``--compile``).
        profile: also profile ``repeats`` calls each of the step, the propose, the
            verify and the round (:func:`~dflash_torch.bench.profile.kernel_summary`: the
            kernels they run on a GPU) into ``profile``.

    Returns:
        a dict: ``floor_round_over_step``, the round/step that the weights read imply
        (step + propose bytes over step bytes, :func:`weights_read`: what round/step is
        when every forward runs at the same fraction of the memory bandwidth; None for
        MoE), times in seconds (``target_step_s``, ``round_s``, and two parts of the
        round timed alone: ``propose_s``, and ``verify_s``, the verify with its acceptance,
        host sync and commit; the round's rest is what its parts cost together beyond that),
        ``round_over_step``, ``layers``, ``layers_timed``, ``scaled``, the measured
        pieces of a scaled result (``measured``), ``experts_hit_per_moe_layer`` (distinct
        experts in one verify, None without MoE) and ``projected_speedup`` (tau x step /
        round at each of :data:`PUBLISHED_TAU`, the paper's acceptance lengths at B=16;
        None where that tau exceeds ``block_size``: a round accepts at most B tokens),
        ``repeat_spread`` (the slowest over the fastest of the ``repeats`` calls, the wider
        of the step's and the round's) and ``unreliable`` (:func:`unreliable`: why the
        figures cannot be trusted, None where nothing says so).

    Raises:
        DFlashError: an unknown shape name, a config its parser refuses, or a target of
            which even one period of layers does not fit in this machine's memory (with
            ``compiled``: of which not all layers fit).
    """
    cfg = target_config(shape)
    L = cfg.num_hidden_layers
    n, fixed, per_layer = layers_that_fit(shape, dtype, device, memory_budget)
    if compiled and n < L:
        raise DFlashError(f"compiled timing of shape {shape if isinstance(shape, str) else cfg.model_type} needs all "
                          f"{L} layers in memory; only {n} fit on {device}")
    need = fixed + sum(per_layer[:n])
    target, drafter = build_pair(shape, dtype, device, draft_layers=draft_layers, block_size=block_size,
                                 layers=n, fuse=fuse)
    fused = fuse_by_default(device) if fuse is None else fuse
    B = block_size
    block = torch.randint(0, cfg.vocab_size - 2, (B,), generator=torch.Generator().manual_seed(0)).to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    more = L / n - 1  # the layers not built, in units of the built ones
    clock = {"start": 0.0, "layers": 0.0}  # seconds in decoder layers and commits during the current call

    def layers_start(*_):
        sync()
        clock["start"] = time.perf_counter()

    def layers_stop(*_):
        sync()
        clock["layers"] += time.perf_counter() - clock["start"]

    def timed(fn) -> tuple[float, float, float]:
        """Medians over ``repeats`` calls of ``fn`` (after ``warmups`` warm-up calls) of its seconds, of
        the part spent in decoder layers and commits, and of the first plus ``more`` times
        the second: each call's own layer time scales it, so the scaling never subtracts
        times measured in different calls."""
        total, layers = [], []
        for _ in range(warmups - 1):  # compiled: the graphs are built and recorded here
            fn()
        graphs = compile_counts()[0]
        for _ in range(repeats + 1):
            clock["layers"] = 0.0
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            total.append(time.perf_counter() - t0)
            layers.append(clock["layers"])
        total, layers = total[1:], layers[1:]
        spreads.append(max(total) / min(total))
        rebuilt["graphs"] += compile_counts()[0] - graphs
        scaled = [t + more * lt for t, lt in zip(total, layers)]
        return tuple(sorted(x)[len(x) // 2] for x in (total, layers, scaled))

    # The committed context is the caches' zero-filled first ``context`` positions (and a
    # zero recurrent state): a forward's time does not depend on the values it reads,
    # and a prefill, which would only fill them, takes minutes at large shapes on a CPU.
    spec = SpeculativeDecoder(target, drafter, block_size=B, max_context=context + 64, compile=compiled,
                              compile_mode=compile_mode)
    if n < L:  # feature layers of the full depth -> the built layer at the same place in the pattern
        spec.feature_layers = [i % n for i in spec.feature_layers]
    spec.target_cache.reset(context + 64)
    spec.context.reset(context + 64)
    base = SpeculativeDecoder(target, None, max_context=context + 64, compile=compiled,  # B = 1: verifies commit directly
                              compile_mode=compile_mode)
    base.target_cache = spec.target_cache
    tok = block[:1]
    rebuilt = {"graphs": 0}  # graphs built after the warm-up calls
    spreads: list[float] = []  # slowest / fastest of the repeats, each timing's
    skips, fallbacks = compile_counts()[1], eager_fallbacks()
    warmups = 3 if compiled else 1  # reduce-overhead: compile, warm up, record; then replays
    if compiled:  # fixed shapes, as the decoding loop calls the compiled steps
        pos, start = torch.tensor(context, device=device), torch.tensor(context, device=device)
        kv_step, kv_round = spec.kv_bucket(context + 1), spec.kv_bucket(context + B)
    else:
        pos = start = context
        kv_step, kv_round = context + 1, context + B
    # the layers run from the first layer's input norm to the final norm
    hooks = [target.model.layers[0].input_layernorm.register_forward_pre_hook(layers_start),
             target.model.norm.register_forward_pre_hook(layers_stop)] if n < L else []
    step_measured, step_layers, step = timed(lambda: base._verify_fn(tok, pos, kv_step))

    # the propose injects the previous verify's B feature rows (the fixed-shape worst
    # case); placed at the block's own positions, where the block's K/V overwrite them
    feats = [drafter.fc.weight.new_zeros(B, drafter.fc.in_features)]

    def verify_accept_commit():
        logits, out = spec._verify_fn(block, pos, kv_round)
        feats[0] = spec._carry(out)
        accepted, bonus = accept_greedy(block[1:], logits)
        torch.cat([accepted.view(1), block[1:], bonus.view(1)]).tolist()  # the round's one host sync
        if spec.defer_commit:  # hybrid target: the rollback of its recurrent layers
            t0 = time.perf_counter()
            spec._commit_fn(accepted + 1)
            sync()
            clock["layers"] += time.perf_counter() - t0

    def one_round():
        greedy_tokens(spec._draft_fn(tok[0], pos, kv_round, feats[0], start))
        verify_accept_commit()

    round_measured, round_layers, rnd = timed(one_round)
    spread = max(spreads)  # (of the step and the round, which round/step divides)
    verify = timed(verify_accept_commit)[2]
    for h in hooks:
        h.remove()
    propose = timed(lambda: spec._draft_fn(tok[0], pos, kv_round, feats[0], start))[0]
    profiled = None
    if profile:
        profiled = {"step": kernel_summary(lambda: base._verify_fn(tok, pos, kv_step), repeats, device),
                    "propose": kernel_summary(lambda: spec._draft_fn(tok[0], pos, kv_round, feats[0], start), repeats, device),
                    "verify": kernel_summary(verify_accept_commit, repeats, device),
                    "round": kernel_summary(one_round, repeats, device)}
    counts = {}
    if compiled:  # the hooks that count experts cannot run inside graphs
        hits = None
        counts = {"recompiles": rebuilt["graphs"], "cudagraph_skips": compile_counts()[1] - skips,
                  "eager_fallbacks": eager_fallbacks() - fallbacks}
    else:
        hits = _experts_hit(target, verify_accept_commit)
    read = weights_read(target, drafter, L)
    measured = None
    if n < L:
        measured = {"target_step_s": step_measured, "target_step_layers_s": step_layers,
                    "round_s": round_measured, "round_layers_and_commit_s": round_layers}
    result = {
        "shape": shape if isinstance(shape, str) else "custom", "model_type": cfg.model_type, "compiled": compiled,
        "dtype": str(dtype).removeprefix("torch."), "device": device, "context": context, "block_size": B,
        "draft_layers": drafter.config.num_hidden_layers, "layers": L, "layers_timed": n, "scaled": n < L,
        "weights_gib": (fixed + sum(per_layer)) / 2**30, "built_gib": need / 2**30,
        "step_weight_bytes": read[0] if read else None, "propose_weight_bytes": read[1] if read else None,
        "floor_round_over_step": (read[0] + read[1]) / read[0] if read else None,
        "compile_mode": compile_mode, "fused": fused,
        "target_step_s": step, "round_s": rnd, "propose_s": propose, "verify_s": verify, "round_over_step": rnd / step,
        "measured": measured, "experts_hit_per_moe_layer": hits,
        "moe": None if cfg.moe is None else {"num_experts": cfg.moe.num_experts, "top_k": cfg.moe.top_k},
        "projected_speedup": {k: tau * step / rnd if tau <= B else None for k, tau in PUBLISHED_TAU.items()}, "profile": profiled, **counts,
        "repeat_spread": spread,
    }
    result["unreliable"] = unreliable(result)
    target = drafter = base = spec = None  # free the large weights before the next shape is built
    gc.collect()
    return result


def unreliable(result: dict) -> str | None:
    """Why the timings of a :func:`round_vs_step` ``result`` cannot be trusted, in words
    (None where nothing says so): a round/step below 1 (a round, a propose and a verify of B
    tokens, cannot cost less than one 1-token step), below :data:`FLOOR_SLACK` x the round/step
    by weights read (``floor_round_over_step``), or repeats that spread wider than
    :data:`MAX_REPEAT_SPREAD` (slowest / fastest). Each is what a loaded machine (other
    work, memory pressure, swapping) does to a timing: rerun it on an idle one."""
    ratio, floor, spread = result["round_over_step"], result["floor_round_over_step"], result["repeat_spread"]
    why = []
    if ratio < 1:
        why.append(f"round/step {ratio:.2f} is below 1 (a round, a propose and a verify of {result['block_size']} "
                   "tokens, cannot cost less than one 1-token step)")
    elif floor is not None and ratio < FLOOR_SLACK * floor:
        why.append(f"round/step {ratio:.2f} is below its floor by weights read, {floor:.2f}")
    if spread > MAX_REPEAT_SPREAD:
        why.append(f"the repeats spread {spread:.1f}x (slowest / fastest)")
    if not why:
        return None
    return "UNRELIABLE: " + "; ".join(why) + ": the machine was likely loaded; rerun it on an idle one"
