"""MiniMax-M2 targets (``minimax_m2``: MiniMax-M2, M2.1, M2.5; transformers'
``modeling_minimax_m2.py``, the oracle of the tests).

Every layer is full causal attention (grouped-query, no biases) followed by a sparse
mixture of SwiGLU experts; no dense layers, no shared expert. Two things differ from the
Qwen3-MoE layers (:mod:`.qwen3_moe`):

* the q/k RMSNorm spans the whole projection (``q_norm`` ``[heads * head_dim]``,
  ``k_norm`` ``[kv_heads * head_dim]``: one norm per row over all heads), before RoPE;
* the router scores experts with ``sigmoid`` (float32) and *chooses* the top-k by score
  plus a learned ``e_score_correction_bias`` ``[E]``, while the routing weights are the
  chosen experts' sigmoid scores (without the bias) renormalised to sum to 1; they stay
  float32 until each expert's weighted output is rounded to the activation dtype.

RoPE is partial: the first ``rotary_dim`` (published: 64 of 128) channels of each head,
rotate-half layout; the published configs say so with a top-level ``rotary_dim``, which
transformers turns into ``partial_rotary_factor = rotary_dim / head_dim`` when the config
gives no factor.

Checkpoints store the MoE as ``block_sparse_moe`` with per-expert ``w1`` (gate), ``w3``
(up) and ``w2`` (down) matrices; they are renamed and stacked when loaded. The published
checkpoints are fine-grained FP8 (``quant_method: "fp8"``, 128 x 128 blocks; see
:mod:`.fp8`). Layers past ``num_hidden_layers`` (``model.layers.{N + i}``) are the
multi-token-prediction modules a config announces with ``num_mtp_modules`` / ``use_mtp``:
not read, but checked to be ones (:meth:`Model.check_skipped`). The remote-code fields of
the published configs that transformers' class does not read either are checked where they
would describe another model (``attn_type_list`` with linear-attention layers,
``qk_norm_type`` other than ``"per_layer"``, ``scoring_func`` other than ``"sigmoid"``, a
shared expert, no routing bias), else ignored.
A ``sliding_window`` (not null) is refused: transformers' attention mask ignores it while
its cache applies it, so it describes no one model.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..errors import DFlashError
from . import llama
from .attention import Attention
from .config import MoEConfig, TargetConfig, base_target_fields, bool_field, check_int, rotary_fraction
from .layers import RMSNorm
from .moe import SparseMoE, fuse_expert_weights
from .target import DecoderLayer, check_mtp_layers

QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "modelopt")  # dequantized when loading (fp8, packed_int, nvfp4)

_EXPERT = re.compile(r"^(?P<prefix>.*)\.block_sparse_moe\.(?P<rest>.*)$")
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_RENAMED = re.compile(r"\.experts\.(\d+)\.(w1|w2|w3)\.")


def parse_config(cfg: dict) -> TargetConfig:
    """A ``minimax_m2`` ``config.json`` -> :class:`TargetConfig`.

    Raises:
        DFlashError: missing keys (``intermediate_size``: each expert's; ``num_local_experts``
            / ``num_experts``; ``num_experts_per_tok``), or a variant transformers'
            ``minimax_m2`` class would not run as the file describes it (see the module
            docstring).
    """
    if not cfg.get("intermediate_size"):
        raise DFlashError("target config.json lacks intermediate_size (each expert's)")
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    if experts is None or "num_experts_per_tok" not in cfg:
        raise DFlashError("target config.json lacks num_local_experts or num_experts_per_tok")
    _refuse_variants(cfg)
    fields = base_target_fields(cfg, "minimax_m2")  # (no rope_theta given: MiniMaxM2Config's 5,000,000)
    fields["partial_rotary_factor"] = _partial_rotary(cfg, fields["head_dim"])
    num_experts = check_int({"num_local_experts": experts}, "num_local_experts", "target", minimum=1)
    top_k = check_int(cfg, "num_experts_per_tok", "target", minimum=1)
    if top_k > num_experts:
        raise DFlashError(f"target num_experts_per_tok {top_k} must be in [1, num_local_experts={num_experts}]")
    moe = MoEConfig(num_experts=num_experts, top_k=top_k, intermediate_size=fields["intermediate_size"],
                    norm_topk_prob=True)
    # (use_mtp says whether a server runs them; the layers are stored either way)
    mtp = (check_int(cfg, "num_mtp_modules", "target", minimum=0) or 0) * (check_int(cfg, "mtp_transformer_layers", "target") or 1)
    bool_field(cfg, "use_mtp", "target", False)
    fields.update(qk_norm=True, moe=moe, attention_bias=False, mtp_layers=mtp)
    return TargetConfig(**fields)


def _refuse_variants(cfg: dict) -> None:
    types = cfg.get("attn_type_list")
    n = cfg.get("num_hidden_layers")
    if types is not None and (not isinstance(types, list) or len(types) != n
                              or any(isinstance(t, bool) or t not in (0, 1) for t in types)):
        raise DFlashError(f"target config.json attn_type_list must list 0 or 1 for each of the {n} layers, "
                          f"got {types!r}")
    if types is not None and 0 in types:
        raise DFlashError(f"target config.json attn_type_list {types!r} has linear-attention layers (0); "
                          "minimax_m2 targets with linear-attention layers are not supported")
    if not bool_field(cfg, "use_qk_norm", "target", True):
        raise DFlashError("target config.json has use_qk_norm false; minimax_m2 targets without q/k norms are "
                          "not supported")
    checks = (("qk_norm_type", "per_layer"), ("scoring_func", "sigmoid"))
    for key, supported in checks:
        if cfg.get(key, supported) != supported:
            raise DFlashError(f"target config.json {key} {cfg[key]!r} is not supported for minimax_m2 "
                              f"(only {supported!r})")
    if cfg.get("sliding_window") is not None:
        raise DFlashError(f"target config.json sliding_window {cfg['sliding_window']!r} is not supported for "
                          "minimax_m2 (transformers' attention ignores it, other engines may apply it)")
    if check_int(cfg, "shared_intermediate_size", "target", minimum=0):
        raise DFlashError("target config.json has shared_intermediate_size > 0 (a shared expert); minimax_m2 "
                          "targets with a shared expert are not supported")
    if not bool_field(cfg, "use_routing_bias", "target", True):
        raise DFlashError("target config.json has use_routing_bias false; minimax_m2 targets route with "
                          "e_score_correction_bias")


def _partial_rotary(cfg: dict, head_dim: int) -> float:
    """``partial_rotary_factor``, else the published configs' ``rotary_dim / head_dim``."""
    factor = rotary_fraction(cfg, default=0.0)
    if factor:
        return factor
    dim = check_int(cfg, "rotary_dim", "target", minimum=1)
    if dim is None:
        return 1.0
    if dim > head_dim:
        raise DFlashError(f"target config.json rotary_dim {dim} exceeds head_dim {head_dim}")
    return dim / head_dim


class WholeProjectionNormAttention(Attention):
    """Attention whose q/k RMSNorm spans all heads of a row (``q_norm`` ``[heads * head_dim]``,
    ``k_norm`` ``[kv_heads * head_dim]``) instead of each head."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__(hidden, heads, kv_heads, head_dim, bias=False, qk_norm=False, eps=eps)
        self.q_norm = RMSNorm(heads * head_dim, eps)
        self.k_norm = RMSNorm(kv_heads * head_dim, eps)

    def norm_queries(self, q: torch.Tensor) -> torch.Tensor:
        return self.q_norm(q.flatten(1)).view_as(q)

    def norm_keys(self, k: torch.Tensor) -> torch.Tensor:
        return self.k_norm(k.flatten(1)).view_as(k)


class SigmoidRoutedMoE(SparseMoE):
    """:class:`~dflash_torch.models.moe.SparseMoE` (no shared expert) with MiniMax-M2's router
    (see the module docstring): its forward dispatches the experts this :meth:`route`
    chooses. Parameters as there, plus ``e_score_correction_bias`` ``[E]`` (in the model's
    dtype, as transformers loads it)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int):
        super().__init__(hidden, num_experts, top_k, intermediate, norm_topk_prob=True)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router: ``x`` ``[T, H]`` -> (float32 weights ``[T, k]`` summing to 1 per row,
        int64 expert ids ``[T, k]``)."""
        scores = torch.sigmoid(self.gate(x).float())
        experts = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        return weights / weights.sum(dim=-1, keepdim=True), experts


class Model(llama.Model):
    """MiniMax-M2 decoder layers: whole-projection q/k norm attention, sigmoid-routed experts."""

    def make_layer(self, index: int, kind: str, slot: int) -> DecoderLayer:
        cfg = self.config
        attn = WholeProjectionNormAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                            cfg.head_dim, cfg.rms_norm_eps)
        m = cfg.moe
        moe = SigmoidRoutedMoE(cfg.hidden_size, m.num_experts, m.top_k, m.intermediate_size)
        return DecoderLayer(kind, attn, moe, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
                            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), slot)

    @classmethod
    def checkpoint_keys(cls, cfg: TargetConfig, key: str) -> bool:
        """Skip the multi-token-prediction layers the config announces (``model.layers.{i}``,
        ``num_hidden_layers <= i < num_hidden_layers + num_mtp_modules *
        mtp_transformer_layers``, as vLLM skips them); any other layer past the decoder's is
        refused as an unknown weight."""
        m = re.match(r"^model\.layers\.(\d+)\.", key)
        return not (m and cfg.num_hidden_layers <= int(m[1]) < cfg.num_hidden_layers + cfg.mtp_layers)

    @classmethod
    def check_skipped(cls, cfg: TargetConfig, skipped: set[str], model_dir) -> None:
        """The layers skipped are multi-token-prediction modules
        (:func:`~dflash_torch.models.target.check_mtp_layers`). The published checkpoints hold
        none (their tensors stop at layer ``num_hidden_layers - 1``); where an MTP module is
        stored as ``model.layers.{N + i}`` (the layers vLLM skips), its loaders read it in
        DeepSeek-V3's layout: a decoder layer's tensors plus ``eh_proj`` (``[H, 2H]``, the
        embedding and hidden rows joined), ``enorm``, ``hnorm`` and ``shared_head``. A decoder
        layer has no ``eh_proj``: a skipped layer without one is a decoder layer that a
        ``num_hidden_layers`` too small would silently drop.

        Raises:
            DFlashError: a skipped layer without ``eh_proj.weight``, or with a tensor an MTP module
                does not hold.
        """
        if skipped:
            check_mtp_layers(model_dir, cfg.num_hidden_layers, cfg.mtp_layers,
                             "num_mtp_modules x mtp_transformer_layers")

    @classmethod
    def convert_checkpoint(cls, cfg: TargetConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``X.block_sparse_moe.Y`` -> ``X.mlp.Y``, experts' ``w1`` / ``w3`` / ``w2`` ->
        ``gate_proj`` / ``up_proj`` / ``down_proj`` (FP8 row scales alike), then stacked
        (:func:`~dflash_torch.models.moe.fuse_expert_weights`)."""
        for key in [k for k in state if ".block_sparse_moe." in k]:
            m = _EXPERT.match(key)
            rest = _RENAMED.sub(lambda e: f".experts.{e[1]}.{_PROJ[e[2]]}.", "." + m["rest"])[1:]
            state[f"{m['prefix']}.mlp.{rest}"] = state.pop(key)
        try:
            return fuse_expert_weights(state, cfg.moe.num_experts)
        except DFlashError as e:  # (named as the checkpoint names them)
            message = str(e).replace(".mlp.experts", ".block_sparse_moe.experts")
            for theirs, ours in _PROJ.items():
                message = message.replace(ours, theirs)
            raise DFlashError(message) from None

    @classmethod
    def checkpoint_name(cls, cfg: TargetConfig, key: str) -> str:
        """As the checkpoint names it (the stacked experts: each expert's ``w1`` / ``w3``, ``w2``)."""
        key = key.replace(".mlp.experts.gate_up_proj", ".mlp.experts.{0..%d}.w1/w3" % (cfg.moe.num_experts - 1))
        key = key.replace(".mlp.experts.down_proj", ".mlp.experts.{0..%d}.w2" % (cfg.moe.num_experts - 1))
        return key.replace(".mlp.", ".block_sparse_moe.")
