"""Model configurations parsed from Hugging Face ``config.json`` dicts.

Target families: ``qwen3`` (q/k RMSNorm), ``llama`` (optionally ``rope_scaling``
type ``llama3``) and ``qwen2`` (bias on q/k/v projections). Drafters: the published
DFlash format (``architectures: ["DFlashDraftModel"]``, see the DFlash reference
implementation z-lab/dflash, ``dflash/model.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import DFlashError

TARGET_FAMILIES = ("qwen3", "llama", "qwen2")


# required keys of each supported rope scaling rule (besides rope_type)
ROPE_SCALING_KEYS = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ("factor",)}
# keys that transformers 5 keeps in rope_parameters next to the scaling rule, but are not scaling
_NOT_SCALING = ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """RoPE base and scaling rule from either the v4 (``rope_theta`` + ``rope_scaling``)
    or the v5 (``rope_parameters``) transformers layout.

    Returns:
        ``(rope_theta, scaling)``. ``rope_theta`` comes from the rope dict if it has one,
        else the top level, else 10000. ``scaling`` is None for plain RoPE (no dict,
        ``rope_type`` default, or ``mrope``: multimodal RoPE with equal text positions is
        plain RoPE), else a new dict holding ``rope_type`` (linear, llama3, yarn) and that
        rule's parameters only: ``rope_theta``, ``partial_rotary_factor``,
        ``mrope_section`` and ``mrope_interleaved`` are dropped (the caller reads
        ``partial_rotary_factor`` itself). For llama3/yarn, a top-level
        ``original_max_position_embeddings`` overrides the dict's (as transformers'
        config standardisation does); when neither has it, it stays absent and
        :class:`~dflash_torch.models.rope.Rotary` uses ``max_position_embeddings``.

    Raises:
        DFlashError: an unsupported rope type (names the supported ones), or a rule's
            required key missing.
    """
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("default", "mrope"):
        return float(theta), None
    if kind not in ROPE_SCALING_KEYS:
        raise DFlashError(f"unsupported rope scaling type {kind!r}; supported: {', '.join(ROPE_SCALING_KEYS)}")
    scaling = {k: v for k, v in params.items() if k not in _NOT_SCALING and k != "type"}
    scaling["rope_type"] = kind
    if kind in ("llama3", "yarn") and cfg.get("original_max_position_embeddings") is not None:
        scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    missing = [k for k in ROPE_SCALING_KEYS[kind] if k not in scaling]
    if kind in ("llama3", "yarn") and not (scaling.get("original_max_position_embeddings") or cfg.get("max_position_embeddings")):
        missing.append("original_max_position_embeddings (or max_position_embeddings)")
    if missing:
        raise DFlashError(f"rope scaling type {kind!r} lacks {', '.join(missing)}")
    return float(theta), scaling


def _require(cfg: dict, keys: list[str], what: str) -> None:
    missing = [k for k in keys if k not in cfg]
    if missing:
        raise DFlashError(f"{what} config.json lacks {', '.join(missing)}")


@dataclass
class TargetConfig:
    """Shape and hyper-parameters of a target model (one decoder-only LLM)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, cfg: dict) -> "TargetConfig":
        """Parse a target ``config.json``.

        Raises:
            DFlashError: unsupported family, a DFlash drafter passed as target, or missing keys.
        """
        archs = cfg.get("architectures") or []
        if "DFlashDraftModel" in archs:
            raise DFlashError("the target checkpoint is a DFlash drafter; pass the target LLM as --target")
        model_type = cfg.get("model_type")
        if model_type not in TARGET_FAMILIES:
            raise DFlashError(f"unsupported target model_type {model_type!r}; supported: {', '.join(TARGET_FAMILIES)}")
        _require(cfg, ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"], "target")
        if cfg.get("mlp_bias"):
            raise DFlashError("target configs with mlp_bias=true are not supported")
        if cfg.get("use_sliding_window"):
            raise DFlashError("target configs with use_sliding_window=true are not supported")
        heads = cfg["num_attention_heads"]
        theta, scaling = _rope(cfg)
        eos = cfg.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type != "llama")),
            # Qwen2 always has q/k/v biases (transformers' Qwen2Config saves attention_bias: null)
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias")),
            qk_norm=model_type == "qwen3",
            eos_token_ids=eos,
        )


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference rule for ``target_layer_ids`` when a drafter config omits them.

    One drafter layer reads the middle target layer (L // 2); N > 1 layers read N ids
    spread evenly from layer 1 to layer L - 3 (DFlash reference, ``build_target_layer_ids``).
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DrafterConfig:
    """Shape and DFlash settings of a drafter (no embedding, no LM head of its own)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    attention_bias: bool
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int | None
    vocab_size: int | None
    sliding_windows: list[int | None]
    max_position_embeddings: int | None = None  # the fallback of yarn/llama3's original_max_position_embeddings

    @classmethod
    def from_dict(cls, cfg: dict) -> "DrafterConfig":
        """Parse a DFlash drafter ``config.json``.

        Raises:
            DFlashError: not a DFlash drafter, no mask token id, no block size, missing keys.
        """
        archs = cfg.get("architectures") or []
        dflash = cfg.get("dflash_config") or {}
        if "DFlashDraftModel" not in archs and not dflash:
            raise DFlashError(
                f"the drafter checkpoint is not a DFlash drafter (architectures={archs}); "
                "expected architectures ['DFlashDraftModel'] with a dflash_config"
            )
        _require(cfg, ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"], "drafter")
        if "mask_token_id" not in dflash:
            raise DFlashError("drafter config.json lacks dflash_config.mask_token_id")
        block_size = cfg.get("block_size", dflash.get("block_size"))
        if block_size is None:
            raise DFlashError("drafter config.json has no block_size (top level or in dflash_config)")
        if int(block_size) < 2:
            raise DFlashError(f"drafter block_size must be >= 2, got {block_size}")
        n = cfg["num_hidden_layers"]
        num_target_layers = cfg.get("num_target_layers")
        layer_ids = dflash.get("target_layer_ids")
        if layer_ids is None:
            if num_target_layers is None:
                raise DFlashError("drafter config.json has neither dflash_config.target_layer_ids nor num_target_layers")
            layer_ids = default_target_layer_ids(num_target_layers, n)
        heads = cfg["num_attention_heads"]
        layer_types = cfg.get("layer_types") or ["full_attention"] * n
        if len(layer_types) != n:
            raise DFlashError(f"drafter layer_types has {len(layer_types)} entries but num_hidden_layers is {n}")
        windows = [cfg.get("sliding_window") if t == "sliding_attention" else None for t in layer_types]
        if any(t == "sliding_attention" for t in layer_types) and not cfg.get("sliding_window"):
            raise DFlashError("drafter layer_types uses sliding_attention but sliding_window is not set")
        theta, scaling = _rope(cfg)
        return cls(
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=bool(cfg.get("attention_bias", False)),
            block_size=int(block_size),
            mask_token_id=int(dflash["mask_token_id"]),
            target_layer_ids=[int(i) for i in layer_ids],
            num_target_layers=num_target_layers,
            vocab_size=cfg.get("vocab_size"),
            sliding_windows=windows,
            max_position_embeddings=cfg.get("max_position_embeddings"),
        )

    def to_dict(self) -> dict:
        """A ``config.json`` dict in the published DFlash drafter format."""
        cfg = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "vocab_size": self.vocab_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "layer_types": ["sliding_attention" if w else "full_attention" for w in self.sliding_windows],
            "torch_dtype": "bfloat16",
        }
        if self.rope_scaling:
            cfg["rope_scaling"] = self.rope_scaling
        if self.max_position_embeddings is not None:
            cfg["max_position_embeddings"] = self.max_position_embeddings
        windows = [w for w in self.sliding_windows if w]
        if windows:
            cfg["sliding_window"] = windows[0]
        return cfg


def validate_pair(target: TargetConfig, drafter: DrafterConfig) -> None:
    """Check that a drafter was made for this target.

    Raises:
        DFlashError: one line naming both values, for a hidden size mismatch, a
            target layer id outside the target, a different ``num_target_layers``,
            a mask token id outside the vocabulary, or a different vocabulary size.
    """
    if drafter.hidden_size != target.hidden_size:
        raise DFlashError(f"incompatible pair: drafter hidden_size {drafter.hidden_size} != target hidden_size {target.hidden_size}")
    if drafter.num_target_layers is not None and drafter.num_target_layers != target.num_hidden_layers:
        raise DFlashError(
            f"incompatible pair: drafter num_target_layers {drafter.num_target_layers} != target num_hidden_layers {target.num_hidden_layers}"
        )
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        raise DFlashError(
            f"incompatible pair: drafter target_layer_ids {drafter.target_layer_ids} include {bad}, outside the target's {target.num_hidden_layers} layers"
        )
    if not 0 <= drafter.mask_token_id < target.vocab_size:
        raise DFlashError(f"incompatible pair: drafter mask_token_id {drafter.mask_token_id} is outside the target vocabulary of {target.vocab_size}")
    if drafter.vocab_size is not None and drafter.vocab_size != target.vocab_size:
        raise DFlashError(f"incompatible pair: drafter vocab_size {drafter.vocab_size} != target vocab_size {target.vocab_size}")
