"""Nemotron-H targets (``nemotron_h``, ``NemotronHForCausalLM``: NVIDIA Nemotron-H, Nemotron 3
Nano 30B-A3B, Nemotron 3 Super, Nemotron 3.5 Lightning): hybrid stacks of *blocks*, each one
norm, one sublayer and its residual, ``x + sublayer(norm(x))``. Layout as in transformers'
``modeling_nemotron_h.py``:

* **Block kinds**, from ``layers_block_type`` (``"linear_attention"`` (or the legacy
  ``"mamba"``), ``"full_attention"`` (``"attention"``), ``"mlp"``, ``"moe"``) or else the
  ``hybrid_override_pattern`` string (``M``, ``*``, ``-``, ``E`` one letter a block; default
  ``M E * -``), as transformers' ``NemotronHConfig`` reads them; ``num_hidden_layers`` is the
  number of blocks whatever the key says (transformers ignores it). Feature capture counts
  blocks: layer ``l`` is Hugging Face ``hidden_states[l + 1]``, the output of block ``l``, as
  DFlash drafters' ``target_layer_ids`` name them.
* **Mamba-2 blocks**: :class:`~dflash_torch.models.mamba2.Mamba2Mixer` (state in the shared
  :class:`~dflash_torch.cache.RecurrentState`, rolled back exactly after a verify; always
  float32, whatever ``mamba_ssm_cache_dtype`` says, which transformers does not read either).
* **Attention blocks**: grouped-query attention with no position encoding (NoPE: transformers'
  ``NemotronHAttention`` rotates nothing), no biases (transformers builds none whatever
  ``attention_bias`` says: ``true`` is refused), softmax scale ``head_dim ** -0.5``.
* **MLP blocks**: ``down_proj(relu(up_proj(x)) ** 2)`` (``mlp_hidden_act`` relu2, biases with
  ``mlp_bias``).
* **MoE blocks**: DeepSeek-V3's router (:class:`~dflash_torch.models.deepseek_v3.TopkRouter`:
  sigmoid scores, experts chosen on ``scores + e_score_correction_bias`` within the
  ``topk_group`` best of ``n_group`` groups, weighted by their scores renormalised when
  ``norm_topk_prob``, times ``routed_scaling_factor``; float32), **non-gated** relu2 experts
  (``experts.up_proj`` ``[E, I, d]``, ``experts.down_proj`` ``[E, d, I]``), with
  ``moe_latent_size`` run in a latent width ``d``: ``fc2_latent_proj(experts(fc1_latent_proj(x)))``
  (``d = hidden_size`` and no projections otherwise), plus one shared relu2 MLP of
  ``moe_shared_expert_intermediate_size`` (``n_shared_experts`` is not read, as in transformers).
* **Norms**: RMSNorm with the weight applied in float32 before the cast back (transformers'
  ``NemotronHRMSNorm``), eps ``layer_norm_epsilon``.

``residual_in_fp32`` and ``rescale_prenorm_residual`` change nothing transformers computes
(the first is not read by its forward, the second is initialisation only), so they are
accepted as they are.

Checkpoints: transformers' names (``model.embeddings``, ``model.layers.{i}.norm``,
``model.layers.{i}.mixer.*``, ``model.norm_f``, ``lm_head``) or NVIDIA's published ones
(``backbone.`` in place of ``model.``), experts stacked (``mixer.experts.up_proj``) or per
expert (``mixer.experts.{e}.up_proj.weight``, stacked when loading). The multi-token-prediction
weights (``mtp.*``) are skipped when ``num_nextn_predict_layers`` announces them, refused as
unknown otherwise. NVIDIA's ModelOpt releases (``quant_method: "modelopt"``: ``-NVFP4``, FP4
weights in groups of 16, and ``-FP8``, per-tensor FP8) are dequantized when loading
(:mod:`~dflash_torch.models.nvfp4`; activations unquantized); other quantized checkpoints
are refused.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import DFlashError
from .attention import Attention
from .config import MoEConfig, TargetConfig, base_target_fields, bool_field, check_int, number_field
from .deepseek_v3 import TopkRouter, check_expert_groups
from .layers import Float32WeightRMSNorm
from .mamba2 import Mamba2Mixer
from .moe import Experts, dispatch_experts
from .target import MLP_ONLY, DecoderLayer, MixerBlock, MlpBlock, TargetModel

QUANTIZATION_METHODS = ("modelopt",)  # ModelOpt NVFP4 / per-tensor FP8, dequantized when loading (nvfp4.py)

# transformers' NemotronHConfig defaults, for keys a config.json leaves out (an explicit null stays null)
DEFAULTS = dict(vocab_size=131072, hidden_size=4096, tie_word_embeddings=False, eos_token_id=2,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                attention_bias=False, sliding_window=None, intermediate_size=21504, mlp_hidden_act="relu2",
                mlp_bias=False, ssm_state_size=128, mamba_num_heads=128, mamba_head_dim=64, mamba_hidden_act="silu",
                n_groups=8, conv_kernel=4, time_step_min=0.001, use_conv_bias=True, use_bias=False,
                n_routed_experts=8, moe_intermediate_size=7688, moe_shared_expert_intermediate_size=7688,
                moe_latent_size=None, num_experts_per_tok=2, routed_scaling_factor=1.0, n_group=1, topk_group=1,
                norm_topk_prob=True, num_nextn_predict_layers=0, layer_norm_epsilon=1e-5)
# older key names that transformers' NemotronHConfig reads in place of the current ones
ALIASES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_dt_min": "time_step_min",
           "mamba_dt_limit": "time_step_limit", "mamba_conv_bias": "use_conv_bias"}
PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
LEGACY_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
BLOCK_TYPES = ("linear_attention", "full_attention", "mlp", "moe")
LAYOUTS = ("model.", "backbone.")  # transformers' names, NVIDIA's published ones
MTP_PREFIXES = ("mtp.", "model.mtp.", "backbone.mtp.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(norm|mixer)\.(.*)$")


@dataclass
class NemotronHConfig(TargetConfig):
    """:class:`TargetConfig` plus Nemotron-H's Mamba-2 shapes, MoE router and latent size
    (names as in ``config.json``). ``layer_types`` holds ``"linear_attention"``,
    ``"full_attention"`` or ``"mlp"`` (an MLP or MoE block, :data:`~dflash_torch.models.target.MLP_ONLY`)
    per block, ``moe_layers`` which of the latter are MoE; ``block_types`` transformers' names."""

    block_types: tuple[str, ...] = ()
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    n_groups: int = 8
    ssm_state_size: int = 128
    conv_kernel: int = 4
    use_conv_bias: bool = True
    use_bias: bool = False
    mlp_bias: bool = False
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_nextn_predict_layers: int = 0


def block_types(cfg: dict) -> list[str]:
    """Each block's type as transformers' ``NemotronHConfig`` reads it: ``layers_block_type``
    (or its alias ``layer_types``; legacy ``"mamba"`` / ``"attention"`` renamed), else
    ``hybrid_override_pattern``, else transformers' default ``M E * -``.

    Raises:
        DFlashError: one line: not a list of known types / not a string of ``M * - E``, or empty.
    """
    types = cfg.get("layers_block_type")
    if types is None:
        types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or not types or any(LEGACY_TYPES.get(t, t) not in BLOCK_TYPES for t in types):
            raise DFlashError(f"target config.json layers_block_type must be a non-empty list of "
                              f"{', '.join(BLOCK_TYPES)}, got {types!r}")
        return [LEGACY_TYPES.get(t, t) for t in types]
    pattern = cfg.get("hybrid_override_pattern")
    if pattern is None:
        return ["linear_attention", "moe", "full_attention", "mlp"]
    if not isinstance(pattern, str) or not pattern or any(c not in PATTERN for c in pattern):
        raise DFlashError(f"target config.json hybrid_override_pattern must be a string of the letters M (Mamba-2), "
                          f"* (attention), - (MLP) and E (MoE), got {pattern!r}")
    return [PATTERN[c] for c in pattern]


def parse_config(cfg: dict) -> NemotronHConfig:
    """A ``nemotron_h`` ``config.json`` -> :class:`NemotronHConfig` (keys left out take
    transformers' ``NemotronHConfig`` defaults; its older key names, e.g. ``mamba_n_groups``,
    read as it reads them).

    Raises:
        DFlashError: one line: those of :func:`block_types`; a key of the wrong type or out of
            range; Mamba-2 shapes that do not add up (``n_groups`` not dividing
            ``mamba_num_heads``); activations other than ``relu2`` (MLPs) and ``silu`` (Mamba-2);
            ``time_step_limit`` other than ``[0, inf]`` (the Mamba-2 time step is not clamped:
            :mod:`.mamba2`); a ``sliding_window`` (transformers'
            attention ignores it, other engines may not); ``attention_bias`` true (transformers
            builds no biases); MoE groups that do not split the experts into groups of 2 or more,
            or more experts per token than the chosen groups hold.
    """
    text = dict(cfg)
    for old, new in ALIASES.items():
        if old in text:
            text[new] = text.pop(old)
    text = {**DEFAULTS, **text}
    types = block_types(text)
    text["num_hidden_layers"] = len(types)
    ints = ("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel")
    if "moe" in types:
        ints += ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "moe_shared_expert_intermediate_size", "n_group", "topk_group")
    if "mlp" in types:
        ints += ("intermediate_size",)
    missing = [k for k in ints if text.get(k) is None]
    if missing:
        raise DFlashError(f"target config.json has null {', '.join(missing)}")
    for key in ints + ("moe_latent_size",):
        check_int(text, key, "target")
    check_int(text, "num_nextn_predict_layers", "target", minimum=0)
    if text["mamba_num_heads"] % text["n_groups"]:
        raise DFlashError(f"target n_groups {text['n_groups']} must divide mamba_num_heads {text['mamba_num_heads']} "
                          "(each group's B and C serve whole heads)")
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if text.get(key) != want:
            raise DFlashError(f"target config.json {key} {text.get(key)!r} is not supported (only {want!r})")
    limit = text.get("time_step_limit")
    if limit is not None and (not isinstance(limit, (list, tuple)) or [_number(v) for v in limit] != [0, math.inf]):
        raise DFlashError(f"target config.json time_step_limit {limit!r} is not supported (only [0.0, inf]: "
                          "the Mamba-2 time step is not clamped, as NVIDIA's reference code and vLLM run it)")
    if text.get("sliding_window") is not None:
        raise DFlashError(f"target config.json sliding_window {text['sliding_window']!r} is not supported for "
                          "nemotron_h (transformers' attention ignores it, other engines may apply it)")
    if bool_field(text, "attention_bias", "target", False):
        raise DFlashError("target config.json attention_bias true is not supported for nemotron_h (transformers "
                          "builds its attention without biases)")
    moe = None
    if "moe" in types:
        experts, _, top_k = check_expert_groups(text)
        moe = MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=text["moe_intermediate_size"],
                        norm_topk_prob=bool_field(text, "norm_topk_prob", "target", True),
                        shared_expert_intermediate_size=text["moe_shared_expert_intermediate_size"])
    base = {k: v for k, v in text.items() if k not in ("rms_norm_eps", "hidden_act")}  # (norm eps: layer_norm_epsilon)
    fields = base_target_fields(base, "nemotron_h")
    fields.update(
        num_hidden_layers=len(types),
        intermediate_size=text.get("intermediate_size") or 0,
        rms_norm_eps=number_field(text, "layer_norm_epsilon", "target", 1e-5),
        partial_rotary_factor=1.0,  # (no RoPE at all)
        layer_types=[MLP_ONLY if t in ("mlp", "moe") else t for t in types],
        moe=moe,
        moe_layers=[t == "moe" for t in types],
        block_types=tuple(types),
        mamba_num_heads=text["mamba_num_heads"],
        mamba_head_dim=text["mamba_head_dim"],
        n_groups=text["n_groups"],
        ssm_state_size=text["ssm_state_size"],
        conv_kernel=text["conv_kernel"],
        use_conv_bias=bool_field(text, "use_conv_bias", "target", True),
        use_bias=bool_field(text, "use_bias", "target", False),
        mlp_bias=bool_field(text, "mlp_bias", "target", False),
        moe_latent_size=text.get("moe_latent_size"),
        n_group=text.get("n_group") or 1,
        topk_group=text.get("topk_group") or 1,
        routed_scaling_factor=number_field(text, "routed_scaling_factor", "target", 1.0),
        num_nextn_predict_layers=text["num_nextn_predict_layers"] or 0,
    )
    return NemotronHConfig(**fields)


def _number(value):
    """A config value as a number: transformers saves infinity as ``{"__float__": "Infinity"}``
    (plain JSON has no infinity; Python's reader also takes a bare ``Infinity``)."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        return {"Infinity": math.inf, "-Infinity": -math.inf}.get(value["__float__"], math.nan)
    return value


class Relu2MLP(nn.Module):
    """A non-gated MLP: ``down_proj(relu(up_proj(x)) ** 2)`` (``[T, hidden]`` -> ``[T, hidden]``)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool):
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())


class NemotronHMoE(nn.Module):
    """Routed non-gated experts (optionally in a latent width) plus a shared relu2 MLP. Hugging
    Face names: ``gate.*``, ``experts.up_proj`` (held as ``experts.gate_up_proj``, up rows
    only: :class:`~dflash_torch.models.moe.Experts` with ``gated=False``), ``experts.down_proj``,
    ``fc1_latent_proj`` / ``fc2_latent_proj`` (with ``moe_latent_size``), ``shared_experts.*``."""

    def __init__(self, cfg: NemotronHConfig):
        super().__init__()
        m = cfg.moe
        width = cfg.moe_latent_size or cfg.hidden_size
        self.gate = TopkRouter(cfg)
        self.experts = Experts(m.num_experts, width, m.intermediate_size, gated=False)
        self.shared_experts = Relu2MLP(cfg.hidden_size, m.shared_expert_intermediate_size, cfg.mlp_bias)
        if cfg.moe_latent_size is not None:
            self.fc1_latent_proj = nn.Linear(cfg.hidden_size, width, bias=cfg.mlp_bias)
            self.fc2_latent_proj = nn.Linear(width, cfg.hidden_size, bias=cfg.mlp_bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, hidden]`` -> ``[T, hidden]`` in ``x.dtype``."""
        weights, experts = self.gate(x)
        routed = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        e = self.experts
        routed = dispatch_experts(routed, experts, weights, e.gate_up_proj, e.down_proj, relu2=True, **e.quantization())
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        return routed + self.shared_experts(x)


class Model(TargetModel):
    """A Nemotron-H decoder: one block per ``layer_types`` entry (see the module docstring)."""

    norm_class = Float32WeightRMSNorm

    def make_layer(self, index: int, kind: str, slot: int) -> DecoderLayer:
        cfg = self.config
        norm = Float32WeightRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if kind == MLP_ONLY:
            mlp = NemotronHMoE(cfg) if cfg.moe_layers[index] else Relu2MLP(cfg.hidden_size, cfg.intermediate_size,
                                                                              cfg.mlp_bias)
            return MlpBlock(mlp, norm, slot)
        if kind == "linear_attention":
            mixer = Mamba2Mixer(cfg.hidden_size, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups,
                                cfg.ssm_state_size, cfg.conv_kernel, cfg.rms_norm_eps,
                                proj_bias=cfg.use_bias, conv_bias=cfg.use_conv_bias)
        else:
            mixer = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                              False, False, cfg.rms_norm_eps)
            mixer.rope = False  # NoPE
        return MixerBlock(kind, mixer, norm, slot)

    # --- loading ---

    @classmethod
    def checkpoint_keys(cls, cfg: NemotronHConfig, key: str) -> bool:
        """Skip the multi-token-prediction weights (``mtp.*``) when ``num_nextn_predict_layers``
        announces them."""
        return not (cfg.num_nextn_predict_layers > 0 and key.startswith(MTP_PREFIXES))

    @classmethod
    def _our_name(cls, cfg: NemotronHConfig, key: str) -> str:
        """A checkpoint name (``model.`` layout) as this model names the parameter."""
        if key == "model.embeddings.weight":
            return "model.embed_tokens.weight"
        if key == "model.norm_f.weight":
            return "model.norm.weight"
        m = _LAYER.match(key)
        if m is None or int(m[1]) >= len(cfg.block_types):
            return key  # (not a parameter of ours: refused as unknown under its own name)
        i, part, rest = int(m[1]), m[2], m[3]
        kind = cfg.layer_types[i]
        if part == "norm":
            return f"model.layers.{i}.{'post_attention_layernorm' if kind == MLP_ONLY else 'input_layernorm'}.{rest}"
        sub = {"linear_attention": "linear_attn", "full_attention": "self_attn", MLP_ONLY: "mlp"}[kind]
        if cfg.moe_layers[i] and rest in ("experts.up_proj", "experts.up_proj_scale"):
            rest = rest.replace("experts.up_proj", "experts.gate_up_proj")
        return f"model.layers.{i}.{sub}.{rest}"

    @classmethod
    def checkpoint_name(cls, cfg: NemotronHConfig, key: str) -> str:
        """transformers' (or NVIDIA's, for a ``backbone.`` checkpoint) name of our parameter ``key``."""
        name = {"model.embed_tokens.weight": "model.embeddings.weight", "model.norm.weight": "model.norm_f.weight"}.get(key)
        if name is None:
            name = re.sub(r"^(model\.layers\.\d+\.)(input_layernorm|post_attention_layernorm)\.", r"\1norm.", key)
            name = re.sub(r"^(model\.layers\.\d+\.)(linear_attn|self_attn|mlp)\.", r"\1mixer.", name)
            name = name.replace(".experts.gate_up_proj", ".experts.up_proj")
        if cfg.checkpoint_prefix != "model." and name.startswith("model."):
            name = cfg.checkpoint_prefix + name[len("model."):]
        return name

    @classmethod
    def convert_checkpoint(cls, cfg: NemotronHConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """NVIDIA's ``backbone.`` names as transformers' ``model.`` ones (``cfg.checkpoint_prefix``
        set to the layout found, for messages), per-expert weights stacked, then every name
        as this model's parameters name it.

        Raises:
            DFlashError: a checkpoint holding a weight under both layouts; per-expert weights
                missing an expert or a matrix, of inconsistent shapes, or next to stacked ones.
        """
        if any(k.startswith("backbone.") for k in state):
            cfg.checkpoint_prefix = "backbone."
            for key in [k for k in state if k.startswith("backbone.")]:
                name = "model." + key[len("backbone."):]
                if name in state:
                    raise DFlashError(f"the target checkpoint holds {name} twice (as {key} and {name})")
                state[name] = state.pop(key)
        if cfg.moe is not None:
            _stack_experts(state, cfg.moe.num_experts)
        return {cls._our_name(cfg, k): v for k, v in state.items()}

    @classmethod
    def float32_keys(cls, cfg: NemotronHConfig, key: str) -> bool:
        """The router's weight and score correction bias stay float32 (as in transformers)."""
        return key.endswith((".mixer.gate.weight", ".mixer.gate.e_score_correction_bias"))


_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>up_proj|down_proj)\.weight"
                         r"(?P<scale>_scale)?$")


def _stack_experts(state: dict[str, torch.Tensor], num_experts: int) -> None:
    """Per-expert ``P.{e}.up_proj.weight`` ``[I, d]`` / ``P.{e}.down_proj.weight`` ``[d, I]``
    -> stacked ``P.up_proj`` ``[E, I, d]`` / ``P.down_proj`` ``[E, d, I]`` (transformers' layout),
    in place, layer by layer; NVFP4 weights kept packed come with their scales
    (``P.{e}.up_proj.weight_scale``, :func:`~dflash_torch.models.nvfp4.joined_scales`), stacked
    alike into ``P.up_proj_scale`` / ``P.down_proj_scale``.

    Raises:
        DFlashError: one line naming the layer: an expert id >= E, an expert or a matrix
            missing, shapes or dtypes unlike expert 0's, or stacked weights next to them.
    """
    groups: dict[str, dict[tuple[int, str], str]] = {}
    for key in state:
        m = _PER_EXPERT.match(key)
        if m:
            groups.setdefault(m["prefix"], {})[int(m["expert"]), m["proj"] + (m["scale"] or "")] = key
    for prefix, keys in groups.items():
        where = f"expert weights of {prefix}"
        extra = sorted({e for e, _ in keys if e >= num_experts})
        if extra:
            raise DFlashError(f"{where}: expert ids {extra[:8]} are outside n_routed_experts {num_experts}")
        scaled = ("up_proj_scale", "down_proj_scale") if any(p.endswith("_scale") for _, p in keys) else ()
        for proj in ("up_proj", "down_proj", *scaled):
            label = proj.removesuffix("_scale") + ".weight" + ("_scale" if proj.endswith("_scale") else "")
            absent = [e for e in range(num_experts) if (e, proj) not in keys]
            if absent:
                raise DFlashError(f"{where}: experts {absent[:8]} lack {label} (n_routed_experts {num_experts})")
            if f"{prefix}.{proj}" in state:
                raise DFlashError(f"{where}: both per-expert weights and the stacked {prefix}.{proj}")
            first = state[keys[0, proj]]
            for e in range(num_experts):
                t = state[keys[e, proj]]
                if t.shape != first.shape or t.dtype != first.dtype or t.dim() != 2:
                    raise DFlashError(f"{where}: expert {e} {label} is {tuple(t.shape)} {t.dtype}, expected "
                                      f"{tuple(first.shape)} {first.dtype} like expert 0")
            state[f"{prefix}.{proj}"] = torch.stack([state.pop(keys[e, proj]) for e in range(num_experts)])
