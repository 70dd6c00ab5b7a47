"""The target LLM: a decoder stack with a static KV cache (attention layers), an exactly
rolled-back recurrent state (linear-attention layers of hybrid targets) and capture of
intermediate layer outputs (the DFlash context features).

:class:`TargetModel` is the shared decoder; each family module (``llama.py``,
``qwen3_moe.py``, ``qwen3_5.py``, ``qwen3_next.py``, ``gpt_oss.py``, ``muse_glimmer.py``, ``gemma4.py``,
``minimax_m2.py``, ``deepseek_v3.py``, ``deepseek_v4.py``, ``laguna.py``, ``glm4_moe_lite.py``,
``deepseek_v32.py`` on ``deepseek_v3.py``, ``mimo_v2_flash.py``, ``glm5_next.py`` (on ``deepseek_v32.py``, with
``deepseek_v4.py``'s hyper-connections and ``kda.py``'s linear attention), ``kimi_linear.py`` (``kda.py``'s
linear attention beside ``deepseek_v3.py``'s latent attention and experts) and ``nemotron_h.py``, whose blocks hold
one sublayer each: :class:`MixerBlock`, :class:`MlpBlock`)
says how its config reads, which layers it builds and how its checkpoint's weight names
map onto them.
:func:`dflash_torch.models.registry.family` finds the module of a ``model_type``.
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..cache import KVCache, RecurrentState, TargetCache, ring_positions
from ..checkpoint import (all_finite, check_fits, fits, fp4_saving, fp8_saving, int_saving, load_config,
                          load_state_dict, missing_note, nvfp4_saving, tensor_names, weight_file_sizes)
from ..errors import DFlashError, OptionError, first_line
from ..options import check_fp8, check_int_weights, check_mxfp4, check_nvfp4
from . import fp8 as fp8_format
from .config import TargetConfig, derived_layout_note
from .gated_deltanet import GatedDeltaNet
from .layers import RMSNorm, attention_bias, embedding
from .rope import Rotary


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: a token mixer (``self_attn`` or, in hybrid targets,
    ``linear_attn``) then the MLP (``mlp``: dense or mixture of experts), both residual.

    Attributes:
        kind: ``"full_attention"``, ``"sliding_attention"``, ``"linear_attention"`` or
            :data:`MLP_ONLY` (a block without a token mixer, :class:`MlpBlock`).
        slot: this layer's index in the KV cache or in the recurrent state (-1: neither).
        sliding_window: for ``"sliding_attention"``, how many positions a query sees (itself
            and the ``sliding_window - 1`` before it; a decoder's cache keeps a ring of the
            last positions for it, see :meth:`TargetModel.new_cache`);
            None: all positions before it.
        rope_key: which of the model's RoPE tables the layer's attention uses (None: the
            model's one :class:`Rotary`; a key of its ``nn.ModuleDict`` of them otherwise).
    """

    rope_key: str | None = None

    def __init__(self, kind: str, mixer: nn.Module, mlp: nn.Module, norm: nn.Module, post_norm: nn.Module, slot: int,
                 sliding_window: int | None = None):
        super().__init__()
        self.kind, self.slot, self.sliding_window = kind, slot, sliding_window
        if kind == "linear_attention":
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp = mlp
        self.input_layernorm = norm
        self.post_attention_layernorm = post_norm

    def add_mixer(self, x: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
        """The residual stream after the token mixer: ``x + mixed`` (``mixed``: the mixer's
        output on ``input_layernorm(x)``)."""
        return x + mixed

    def add_mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream after the MLP: ``x + mlp(post_attention_layernorm(x))``."""
        return x + self.mlp(self.post_attention_layernorm(x))


MLP_ONLY = "mlp"  # the kind of a layer with an MLP (dense or experts) and no token mixer (Nemotron-H's blocks)


def has_kv(kind: str) -> bool:
    """Whether a layer of ``kind`` keeps keys and values in the KV cache (an attention layer:
    not a linear-attention layer, not an :data:`MLP_ONLY` block)."""
    return kind not in ("linear_attention", MLP_ONLY)


class MixerBlock(DecoderLayer):
    """A block of one norm, one token mixer and its residual, with no MLP (Nemotron-H's
    attention and Mamba-2 blocks): ``x + mixer(input_layernorm(x))``. Kind
    ``"full_attention"`` (the mixer is ``self_attn``) or ``"linear_attention"``
    (``linear_attn``)."""

    def __init__(self, kind: str, mixer: nn.Module, norm: nn.Module, slot: int):
        super().__init__(kind, mixer, None, norm, None, slot)

    def add_mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x


class MlpBlock(DecoderLayer):
    """A block of one norm, one MLP (dense or a mixture of experts) and its residual, with no
    token mixer (Nemotron-H's MLP and MoE blocks; kind :data:`MLP_ONLY`):
    ``x + mlp(post_attention_layernorm(x))``. The decoder loop runs only :meth:`add_mlp`."""

    def __init__(self, mlp: nn.Module, norm: nn.Module, slot: int):
        super().__init__(MLP_ONLY, None, mlp, None, norm, slot)


class SandwichDecoderLayer(DecoderLayer):
    """A decoder layer that also normalises each sublayer's output before the residual add
    (Gemma 2 / Muse Glimmer): ``x + post_attention_layernorm(mixer(input_layernorm(x)))``, then
    ``x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))``. (Here
    ``post_attention_layernorm`` is the attention output's norm, as these checkpoints name it,
    not the MLP's input norm of :class:`DecoderLayer`.)"""

    def __init__(self, kind: str, mixer: nn.Module, mlp: nn.Module, norm: nn.Module, post_attention_norm: nn.Module,
                 pre_feedforward_norm: nn.Module, post_feedforward_norm: nn.Module, slot: int,
                 sliding_window: int | None = None):
        super().__init__(kind, mixer, mlp, norm, post_attention_norm, slot, sliding_window)
        self.pre_feedforward_layernorm = pre_feedforward_norm
        self.post_feedforward_layernorm = post_feedforward_norm

    def add_mixer(self, x: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
        return x + self.post_attention_layernorm(mixed)

    def add_mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class _Backbone(nn.Module):
    def __init__(self, embed: nn.Embedding, layers: list[DecoderLayer], norm: nn.Module):
        super().__init__()
        self.embed_tokens = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm


@dataclass
class _Step:
    """What every attention layer of one forward shares: ``rope``, the cos/sin tables per
    :attr:`DecoderLayer.rope_key`; ``biases``, the additive mask per (sliding window, query
    heads per key/value head), window None for full causal attention; ``carried``, what a
    layer leaves for later layers of the same forward (DeepSeek Sparse Attention: the last
    indexer's sparse mask, which GLM-MoE-DSA's "shared" layers reuse)."""

    positions: torch.Tensor
    rope: dict[str | None, tuple[torch.Tensor, torch.Tensor]]
    biases: dict[tuple[int | None, int], torch.Tensor]
    kv_len: int | None
    carried: dict = field(default_factory=dict)


def visible_rows(positions: torch.Tensor, span: int, window: int | None, rows: int | None) -> torch.Tensor:
    """Which of a layer's first ``span`` cache rows each query sees: bool ``[..., T, span]`` for
    int64 ``positions`` ``[..., T]``. Causal; with a sliding ``window`` (tokens) only the last
    ``window`` positions; ``rows``: the layer keeps a ring of that many rows (with a window),
    each row masked by the position it holds (:func:`~dflash_torch.cache.ring_positions`)."""
    q_pos = positions[..., None]
    if rows is not None:
        held = ring_positions(positions, rows, min(span, rows)).unsqueeze(-2)
        return (held <= q_pos) & (held > q_pos - window) & (held >= 0)
    k_pos = torch.arange(span, device=positions.device)
    visible = k_pos <= q_pos
    return visible if window is None else visible & (k_pos > q_pos - window)


EMBEDDING_OUTPUT = -1  # the feature id of the decoder's input rows (see TargetModel.forward's feature_layers)


def _import_dynamo() -> None:
    """Import ``torch._dynamo`` for a model that runs ``torch.library`` custom operators (a
    mixture of experts' dispatch, weights kept packed): torch imports it at a custom
    operator's first call, which takes seconds (2-6 s on a 2-core CPU), so loading pays it,
    not the first request's prefill (trial-318).

    Raises:
        DFlashError: the import failed on the file system: torch creates inductor's cache
            directory then (``TORCHINDUCTOR_CACHE_DIR`` that cannot be created or written).
    """
    try:
        importlib.import_module("torch._dynamo")
    except OSError as exc:
        from ..decoding import inductor_cache

        raise DFlashError(f"this target runs its experts or packed weights as torch custom operators, whose first "
                          f"use imports torch._dynamo, which failed: {first_line(exc)}; torch inductor's cache "
                          f"directory (TORCHINDUCTOR_CACHE_DIR={inductor_cache()}) must be one this process can create "
                          "and write: set TORCHINDUCTOR_CACHE_DIR to another, or unset it") from exc


class TargetModel(nn.Module):
    """A decoder-only LLM that returns logits and the outputs of chosen layers.

    Parameter names follow Hugging Face (``model.embed_tokens``, ``model.layers.*``,
    ``model.norm``, ``lm_head``), so text checkpoints load as they are; family modules
    rename the rest (multimodal wrappers, fused projections, per-expert weights).
    Subclasses implement :meth:`make_layer` and may override :attr:`norm_class`,
    :meth:`checkpoint_keys` and :meth:`convert_checkpoint`.
    """

    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.config = cfg
        layers, kv_slots, linear_slots = [], 0, 0
        for i, kind in enumerate(cfg.layer_types):
            slot = linear_slots if kind == "linear_attention" else kv_slots if has_kv(kind) else -1
            layers.append(self.make_layer(i, kind, slot))
            linear_slots += kind == "linear_attention"
            kv_slots += has_kv(kind)
        self.num_kv_layers = kv_slots
        # the attention masks a forward builds: one per (sliding window (None: full causal), query heads per kv head)
        self.attention_masks = tuple({(layer.sliding_window, layer.self_attn.heads // layer.self_attn.kv_heads): None
                                      for layer in layers if has_kv(layer.kind)})
        embed = embedding(cfg.vocab_size, cfg.hidden_size)
        self.model = _Backbone(embed, layers, self.norm_class(cfg.hidden_size, cfg.rms_norm_eps))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = self.make_rotary()

    def make_layer(self, index: int, kind: str, slot: int) -> DecoderLayer:
        """The decoder layer ``index`` of type ``kind`` (``cfg.layer_types[index]``), using
        cache slot ``slot``."""
        raise NotImplementedError

    def make_rotary(self) -> nn.Module:
        """The RoPE tables: one :class:`Rotary` (every layer's ``rope_key`` None), or an
        ``nn.ModuleDict`` of them keyed by the layers' ``rope_key`` (a family whose layer
        types rotate differently, e.g. Gemma 4)."""
        cfg = self.config
        return Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, partial_rotary_factor=cfg.partial_rotary_factor,
                      max_position_embeddings=cfg.max_position_embeddings)

    # --- loading ---

    @classmethod
    def checkpoint_keys(cls, cfg: TargetConfig, key: str) -> bool:
        """Whether a checkpoint tensor is read at all (False for known parts a text target
        never runs, e.g. a vision tower: they are not materialized)."""
        return True

    @classmethod
    def check_skipped(cls, cfg: TargetConfig, skipped: set[str], model_dir: Path) -> None:
        """Check the checkpoint tensors that :meth:`checkpoint_keys` skips (``skipped``: their
        names) are what the family means to skip (nothing to check here).

        Raises:
            DFlashError: a family's override finds a tensor it would drop wrongly.
        """

    @classmethod
    def convert_checkpoint(cls, cfg: TargetConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Map checkpoint tensor names/layouts onto this model's parameters (in place)."""
        return state

    @classmethod
    def float32_keys(cls, cfg: TargetConfig, key: str) -> bool:
        """Whether a checkpoint tensor (a floating-point one, not FP8) is held in float32
        whatever dtype the model runs in (transformers' ``_keep_in_fp32_modules_strict``,
        e.g. DeepSeek-V3's router); False: cast to the model's dtype."""
        return False

    @classmethod
    def dequantized_keys(cls, cfg: TargetConfig, key: str) -> bool:
        """Whether a quantized checkpoint tensor (its name in the checkpoint: an FP8 weight or
        an ``X.weight_packed``) is dequantized when loading even where the checkpoint's
        weights are kept packed (a matrix the model reads other than by applying it, e.g.
        DeepSeek-V3's ``kv_b_proj``): the memory check then counts it dequantized. False here."""
        return False

    @classmethod
    def checkpoint_name(cls, cfg: TargetConfig, key: str) -> str:
        """The name in the checkpoint of this model's parameter ``key`` (for messages)."""
        if cfg.checkpoint_prefix != "model." and key.startswith("model."):
            return cfg.checkpoint_prefix + key[len("model."):]
        return key

    @classmethod
    def from_pretrained(cls, model_dir: Path, dtype: torch.dtype, device: str | torch.device = "cpu",
                        mxfp4: str = "auto", fp8: str = "auto", int_weights: str = "auto",
                        nvfp4: str = "auto", parsed: TargetConfig | None = None) -> "TargetModel":
        """Load a Hugging Face checkpoint directory with the class of its family.

        Args:
            parsed: the :class:`TargetConfig` of ``model_dir``'s ``config.json`` where the
                caller has it already (not parsed again, so that a warning of the parse is
                said once; the caller's object is not changed), else None (the file is read).
            mxfp4: how to hold expert matrices a checkpoint stores in MXFP4 (gpt-oss) or
                FP4 (DeepSeek-V4-Flash's ``expert_dtype: "fp4"``, the same numbers):
                ``"dequantize"`` them when loading (fastest), keep them ``"packed"`` (a
                quarter of bfloat16's memory; each forward dequantizes the experts it
                runs), or ``"auto"``: dequantize when the weights then take at most 90% of
                the device's free memory, else keep them packed (DeepSeek-V4: decided
                before ``fp8``'s ``"auto"``, which then counts the experts as kept).
            fp8: the same for the weights of a fine-grained FP8 checkpoint
                (:mod:`~dflash_torch.models.fp8`): ``"dequantize"``, ``"packed"`` (1 byte a
                weight plus float32 row scales, about half of bfloat16; each forward
                dequantizes the matrices it runs, of a mixture of experts only the experts
                chosen) or ``"auto"`` (as for ``mxfp4``).
            int_weights: the same for the packed integer weights of a compressed-tensors
                W4A16 / W8A16 checkpoint (:mod:`~dflash_torch.models.packed_int`; ``"packed"``:
                the int32 words plus float32 scales, about a quarter (4 bits) or half (8 bits)
                of bfloat16).
            nvfp4: the same for the NVFP4 weights of a compressed-tensors
                ``nvfp4-pack-quantized`` or ModelOpt NVFP4 / MIXED_PRECISION checkpoint
                (:mod:`~dflash_torch.models.nvfp4`; ``"packed"``: the FP4 bytes, the float8
                group scales and a float32 scale per row, 4.5 bits a weight, about 0.28 of
                bfloat16, plus small tables; each forward dequantizes what it runs by reading
                tables the loader's arithmetic fills when loading, so the logits are those of
                ``"dequantize"``, bit for bit). ModelOpt's
                per-tensor FP8 weights are dequantized when loading in every mode.

        Raises:
            DFlashError: unsupported config; ``mxfp4="packed"`` / ``fp8="packed"`` /
                ``int_weights="packed"`` / ``nvfp4="packed"`` for a checkpoint without such
                weights (:class:`~dflash_torch.errors.OptionError`); weights that would not fit in the device's free memory
                (:func:`~dflash_torch.checkpoint.check_fits`); weights missing, unknown (an
                unsupported variant, e.g. biases the config does not announce), of the
                wrong shape, not floating point (e.g. int8: quantized) or not finite (NaN, inf).
                A model run by custom operators (experts, weights kept packed) whose import
                of ``torch._dynamo`` failed on the file system (:func:`_import_dynamo`).
        """
        from .registry import family

        raw = load_config(model_dir)
        cfg = TargetConfig.from_dict(raw) if parsed is None else copy.deepcopy(parsed)
        check_mxfp4(mxfp4, cfg.mxfp4)
        check_fp8(fp8, cfg.fp8_block is not None, has_mxfp4=cfg.mxfp4)
        check_int_weights(int_weights, cfg.int_quant is not None)
        check_nvfp4(nvfp4, cfg.nvfp4 not in (None, "modelopt-fp8"), fp8_only=cfg.nvfp4 == "modelopt-fp8")
        model_cls = family(cfg.model_type).Model if cls is TargetModel else cls
        with torch.device("meta"):
            model = model_cls(cfg)
            if cfg.mxfp4 and not cfg.fp4_experts and (
                    mxfp4 == "packed" or (mxfp4 == "auto" and not fits(model, dtype, device, share=0.9))):
                cfg.keep_mxfp4 = True  # (gpt-oss: the model holds its experts packed)
                model = model_cls(cfg)
        keep = lambda k: model_cls.checkpoint_keys(cfg, k)  # noqa: E731
        kept_packed = lambda k: keep(k) and not model_cls.dequantized_keys(cfg, k)  # noqa: E731
        saving, keep_fp8, fp4_saved, keep_fp4 = 0, False, 0, False
        if cfg.fp4_experts:  # DeepSeek-V4's FP4 experts (in an FP8 checkpoint): kept packed first, the bulk of it
            fp4_saved = fp4_saving(model_dir, dtype, keep)
            if fp4_saved == 0:
                raise DFlashError(f"target checkpoint {model_dir}: config.json declares expert_dtype 'fp4' but the "
                                  "checkpoint holds no FP4 (int8) expert weights")
            keep_fp4 = mxfp4 == "packed" or (mxfp4 == "auto" and not fits(model, dtype, device, share=0.9))
        if cfg.fp8_block is not None and fp8 != "dequantize":
            saving = fp8_saving(model_dir, dtype, cfg.fp8_block, kept_packed)  # (< 0 where the row scales outweigh it)
            keep_fp8 = fp8 == "packed" or (saving > 0 and not fits(model, dtype, device, share=0.9,
                                                                   saving=fp4_saved if keep_fp4 else 0))
        keep_int = False
        if cfg.int_quant is not None and int_weights != "dequantize":
            saving = int_saving(model_dir, dtype, *cfg.int_quant, kept_packed)
            keep_int = int_weights == "packed" or (saving > 0 and not fits(model, dtype, device, share=0.9))
        keep_nvfp4 = False
        if cfg.nvfp4 not in (None, "modelopt-fp8") and nvfp4 != "dequantize":
            saving = nvfp4_saving(model_dir, dtype, cfg.nvfp4, kept_packed)
            if nvfp4 == "packed" and saving == 0:  # (e.g. a MIXED_PRECISION checkpoint whose layers are all FP8)
                raise OptionError("nvfp4 packed keeps NVFP4 weights packed, but the target checkpoint has none (no "
                                  "uint8 NVFP4 weight among the weights it reads; its FP8 weights are dequantized "
                                  "when loading; use auto or dequantize)", "nvfp4")
            keep_nvfp4 = nvfp4 == "packed" or (saving > 0 and not fits(model, dtype, device, share=0.9))
        kept = [what for what, held in (("FP4 experts kept packed", keep_fp4), ("FP8 weights kept as stored", keep_fp8),
                                         ("packed integer weights kept packed", keep_int),
                                         ("NVFP4 weights kept packed", keep_nvfp4)) if held]
        check_fits(model, dtype, device, "target", saving=(saving if keep_fp8 or keep_int or keep_nvfp4 else 0)
                   + (fp4_saved if keep_fp4 else 0), kept=", ".join(kept) or "FP8 weights kept as stored",
                   files=weight_file_sizes(model_dir))
        model_cls.check_skipped(cfg, {k for k in tensor_names(model_dir) if not keep(k)}, model_dir)
        if keep_fp8 or keep_fp4 or keep_int or keep_nvfp4 or any(getattr(m, "custom_op", False) for m in model.modules()):
            _import_dynamo()  # (before the weights are read: it may fail)
        state = load_state_dict(model_dir, dtype, device, keep=keep, fp8_block=cfg.fp8_block, keep_fp8=keep_fp8,
                                int_quant=cfg.int_quant, keep_int=keep_int,
                                float32=lambda k: model_cls.float32_keys(cfg, k), scale_fmt=cfg.fp8_scale_fmt,
                                fp4=cfg.fp4_experts, keep_fp4=keep_fp4, nvfp4=cfg.nvfp4, keep_nvfp4=keep_nvfp4)
        state = model_cls.convert_checkpoint(cfg, state)
        if keep_fp8:
            cfg.keep_fp8 = True
            _keep_fp8(model, state, cfg.fp8_block[1], dtype)
        if keep_fp4:
            cfg.keep_mxfp4 = True
            _keep_fp4(model, state, dtype)
        if keep_int:
            cfg.keep_int = True
            _keep_int(model, state, cfg.int_quant, dtype)
        if keep_nvfp4:
            cfg.keep_nvfp4 = True
            _keep_nvfp4(model, state, cfg.nvfp4, dtype)
        if cfg.tie_word_embeddings:
            head, embed = state.pop("lm_head.weight", None), state.get("model.embed_tokens.weight")
            if head is not None and embed is None:  # (the tied table stored as the head alone: transformers ties it so)
                state["model.embed_tokens.weight"] = head
            elif head is not None and not (head.shape == embed.shape and torch.equal(head, embed)):
                raise DFlashError(f"target checkpoint {model_dir}: config.json ties the output head to the embeddings "
                                  "(tie_word_embeddings true) but the weights hold an lm_head.weight of its own; "
                                  "set tie_word_embeddings to false to run that head")
        expected = {k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
        name = lambda k: model_cls.checkpoint_name(cfg, k)  # noqa: E731
        missing = sorted(map(name, expected - state.keys()))
        unused = sorted(name(k) for k in state.keys() - expected if not k.endswith("rotary_emb.inv_freq"))
        if missing:
            note = missing_note(model_dir, missing)
            text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
            if not note and ("linear_attention" in cfg.layer_types or text.get("full_attention_interval") is not None):
                note = derived_layout_note(text, missing, unused)  # (a hybrid laid out by full_attention_interval)
            raise DFlashError(f"target checkpoint {model_dir} lacks weights: {', '.join(missing[:5])}"
                              f"{' ...' if len(missing) > 5 else ''}{note}")
        if unused:
            raise DFlashError(
                f"target checkpoint {model_dir} has weights this {raw.get('model_type')} model does not use "
                f"(an unsupported variant?): {', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''}"
            )
        shapes = model.state_dict()
        kept_ids = fp8_format.kept_parameters(model)
        kept = {k for k, p in model.named_parameters() if id(p) in kept_ids}
        for k in sorted(expected):  # (sorted: a weight before its row scales, X.weight_scale)
            if tuple(state[k].shape) != tuple(shapes[k].shape):
                raise DFlashError(f"target weight {name(k)} has shape {tuple(state[k].shape)}, "
                                  f"config.json implies {tuple(shapes[k].shape)}")
            if not shapes[k].is_floating_point() or k in kept:  # packed MXFP4 or FP8 weights, their scales
                if state[k].dtype != shapes[k].dtype:
                    raise DFlashError(f"target weight {name(k)} has dtype {str(state[k].dtype).removeprefix('torch.')}, "
                                      f"expected {str(shapes[k].dtype).removeprefix('torch.')}")
                continue
            if not state[k].is_floating_point():
                raise DFlashError(f"target weight {name(k)} has dtype {str(state[k].dtype).removeprefix('torch.')}; "
                                  "dflash-torch reads floating-point weights only (float32 / bfloat16 / float16 / float64; a quantized checkpoint?)")
            if not all_finite(state[k]):
                raise DFlashError(f"target weight {name(_name_of_part(k, state[k]))} holds NaN or infinite values "
                                  "(a corrupt checkpoint)")
        model.load_state_dict({k: state[k] for k in expected}, strict=False, assign=True)
        if keep_nvfp4:  # (each NVFP4 layer's dequantization tables, in the model's dtype)
            from .nvfp4 import build_tables

            build_tables(model, dtype)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.rotary = model.make_rotary().to(device)
        return model.eval()

    # --- per-sequence state ---

    @property
    def recurrent(self) -> bool:
        """True for hybrid targets (linear-attention layers with a recurrent state)."""
        return any(kind == "linear_attention" for kind in self.config.layer_types)

    def kv_shapes(self) -> list[tuple[int, int]]:
        """``(kv_heads, head_dim)`` of each attention layer's KV cache, in cache slot order."""
        return [(layer.self_attn.kv_heads, layer.self_attn.head_dim) for layer in self.model.layers
                if has_kv(layer.kind)]

    def kv_windows(self) -> list[int | None]:
        """Each attention layer's sliding window (tokens; None: full attention), in cache slot order."""
        return [layer.sliding_window for layer in self.model.layers if has_kv(layer.kind)]

    def new_cache(self, max_rows: int | None = None) -> TargetCache:
        """An empty cache matching this model's layers, heads, dtype and device.

        Args:
            max_rows: the most rows (tokens) one forward on this cache runs (a decoder's
                block size or prefill chunk, whichever is larger): sliding-window layers
                then keep a ring of ``window + max_rows - 1`` positions
                (:class:`~dflash_torch.cache.KVCache`) instead of every position. None
                (default): every position kept (a forward of any length).
        """
        w = self.model.embed_tokens.weight
        heads, dims = zip(*self.kv_shapes()) if self.num_kv_layers else ((), ())
        kv = KVCache(self.num_kv_layers, heads, dims, w.dtype, w.device, self.kv_windows(), max_rows)
        recurrent = None
        if self.recurrent:
            recurrent = RecurrentState(w.dtype, w.device)
            for layer in self.model.layers:  # slots are handed out in layer order
                if layer.kind == "linear_attention":
                    layer.linear_attn.new_state(recurrent)
        return TargetCache(kv, recurrent)

    def commit(self, cache: TargetCache, rows) -> None:
        """Advance every linear-attention layer's state over the first ``rows`` tokens of
        the last block run with ``defer_commit`` (the rollback of recurrent layers; a
        no-op for pure-attention targets).

        Args:
            rows: accepted tokens + 1, in ``[1, T]`` (int or 0-dim int64 tensor); batched:
                int64 ``[N]``, one count per sequence of ``cache.recurrent`` (0: that
                sequence's state stays as it is).
        """
        for layer in self.model.layers:
            if layer.kind == "linear_attention":
                layer.linear_attn.commit(cache.recurrent, layer.slot, rows)

    # --- forward ---

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, hidden]`` for ``input_ids`` ``[T]``, as drafters embed their
        block: the embedding table's rows (a family whose decoder transforms them further,
        e.g. Muse Glimmer's ``embed_norm``, does that in :meth:`embed_inputs`)."""
        return self.model.embed_tokens(input_ids)

    def embed_inputs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The decoder's input rows ``[T, hidden]`` for ``input_ids`` ``[T]`` (here
        :meth:`embed`)."""
        return self.model.embed_tokens(input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on already-normalised hidden states ``[T, hidden]`` -> ``[T, vocab]``, as
        drafters read it: ``lm_head`` alone."""
        return self.lm_head(hidden)

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's own logits ``[T, vocab]`` of normalised hidden states ``[T, hidden]``:
        :meth:`logits`, then whatever the family applies to them (Muse Glimmer: a scale and a
        soft cap). Verify and target-only decoding sample from these."""
        return self.lm_head(hidden)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: TargetCache,
        kv_len: int | None,
        feature_layers: list[int] | None = None,
        logits_from: int = 0,
        commit=None,
        defer_commit: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``T`` tokens at ``positions``, writing their K/V into ``cache`` and advancing
        the recurrent state of linear-attention layers.

        Args:
            input_ids: int64 ``[T]``.
            positions: int64 ``[T]``, consecutive absolute positions. Batched decoding:
                ``[N, T / N]``, the positions of N sequences whose rows follow one
                another in ``input_ids``, with ``cache`` holding a
                :class:`~dflash_torch.batch.SlotKVCache` view of N slots and, for a
                hybrid target, a :class:`RecurrentState` of those N sequences.
            cache: the target cache; positions before ``positions[0]`` must be filled.
            kv_len: attend over cache entries ``[0, kv_len)`` under the causal mask (eager:
                ``positions[-1] + 1``; fixed shapes: a length bucket, entries past
                ``positions`` are masked); ``None`` attends over the whole buffer. A
                sliding-window layer with a ring attends over its first ``min(kv_len,
                rows)`` rows, masked by the position each holds.
            feature_layers: target layer ids whose outputs to return (layer ``l`` is
                Hugging Face ``hidden_states[l + 1]``; for the last layer that is the
                output after the final norm, as in transformers). Two more ids, which vLLM's
                hidden-state capture (and so Speculators-format drafters) can name:
                :data:`EMBEDDING_OUTPUT` (-1), the decoder's input rows (``hidden_states[0]``),
                and ``num_hidden_layers``, the last layer's output before the final norm.
            logits_from: compute logits only for rows ``[logits_from, T)``.
            commit: recurrent layers advance over the first ``commit`` rows only (int,
                0-dim tensor, or ``[N]`` int64 per sequence; a padded prefill chunk); None:
                over all rows.
            defer_commit: recurrent layers keep their state and record the block, to be
                advanced by :meth:`commit` once acceptance is known (a verify; batched:
                each sequence's state records its own rows).

        Returns:
            logits ``[T - logits_from, vocab]`` (model dtype) and the concatenated layer
            outputs ``[T, len(feature_layers) * hidden]`` (or None).
        """
        x = self.embed_inputs(input_ids)
        flat = positions.reshape(-1)
        if isinstance(self.rotary, Rotary):
            rope = {None: self.rotary.cos_sin(flat, x.dtype)}
        else:
            rope = {key: rotary.cos_sin(flat, x.dtype) for key, rotary in self.rotary.items()}
        biases = {}
        if self.num_kv_layers:
            span = cache.capacity if kv_len is None else kv_len
            for window, groups in self.attention_masks:
                rows = None if window is None else cache.kv.ring_rows(window)
                biases[window, groups] = attention_bias(visible_rows(positions, span, window, rows), groups, x.dtype)
        step = _Step(positions, rope, biases, kv_len)
        wanted = set(feature_layers or ())
        captured = {EMBEDDING_OUTPUT: x} if EMBEDDING_OUTPUT in wanted else {}
        for i, layer in enumerate(self.model.layers):
            if layer.kind != MLP_ONLY:  # (a block without a token mixer has its MLP only)
                h = layer.input_layernorm(x)
                if layer.kind == "linear_attention":
                    mixed = layer.linear_attn(h, cache.recurrent, layer.slot, commit, defer_commit)  # N sequences at once
                else:
                    mixed = self._self_attention(layer, h, cache.kv, step)
                x = layer.add_mixer(x, mixed)
            x = layer.add_mlp(x)
            if i in wanted:
                captured[i] = x
        last = len(self.model.layers) - 1
        if last + 1 in wanted:  # (the last layer's output before the final norm)
            captured[last + 1] = x
        if last in wanted:  # Hugging Face's hidden_states[L] is the final-normed output
            captured[last] = self.model.norm(x)
            normed = captured[last][logits_from:]
        else:
            normed = self.model.norm(x[logits_from:])
        features = torch.cat([captured[i] for i in feature_layers], dim=-1) if feature_layers else None
        return self.output_logits(normed), features

    @staticmethod
    def _self_attention(layer: DecoderLayer, h: torch.Tensor, kv: KVCache, step: _Step) -> torch.Tensor:
        attn = layer.self_attn
        q, gate, k, v = attn.project(h, *step.rope[layer.rope_key])
        kv.write(layer.slot, step.positions, k, v)
        ck, cv = kv.view(layer.slot, step.kv_len)
        return attn.output(attn.attend(q, ck, cv, step.biases[layer.sliding_window, attn.heads // attn.kv_heads]), gate)


DECODER_LAYERS = "model.layers."  # (the linears that keep quantized weights: a decoder layer's)
# what a multi-token-prediction layer holds besides a decoder layer's tensors (DeepSeek-V3's layout:
# the embedding and hidden norms, their projection, the head; each with any parameter suffix)
MTP_PARTS = ("eh_proj.", "enorm.", "hnorm.", "shared_head.norm.", "shared_head.head.", "embed_tokens.")


def check_mtp_layers(model_dir: Path, first: int, count: int, key: str, decoder_name=lambda k: k) -> None:
    """Check the multi-token-prediction layers a config announces, ``model.layers.{first + i}``
    (``i < count``; ``first``: ``num_hidden_layers``), before they are skipped unread: each
    one present holds ``eh_proj.weight`` (what makes one: a layer without it is a decoder
    layer that a wrong ``num_hidden_layers`` / ``key`` would silently drop), and otherwise
    only :data:`MTP_PARTS` and tensors of the modules a decoder layer of the same checkpoint
    has (the module paths after ``model.layers.{j}.``, ``j < first``, whatever the tensor:
    an MTP layer a quantizer left out holds ``X.weight`` where the decoder layers hold
    ``X.weight_packed`` and its scales). Not read, its shapes are not checked. Only the
    safetensors headers are read. ``decoder_name``: a checkpoint name -> the name with the
    decoder under ``model.`` (None: not the decoder's); messages give the checkpoint's.

    Raises:
        DFlashError: a layer without ``eh_proj.weight``; a tensor of a module no decoder layer
            has and not one of :data:`MTP_PARTS`.
    """
    layers: dict[int, dict[str, str]] = {}  # index -> {name in the layer: the checkpoint's name}
    for name in tensor_names(model_dir):
        ours = decoder_name(name)
        parts = ours.split(".", 3) if ours is not None and ours.startswith(DECODER_LAYERS) else ()
        if len(parts) == 4 and parts[2].isdigit():
            layers.setdefault(int(parts[2]), {})[parts[3]] = name
    modules = {part.rpartition(".")[0] for i in range(first) for part in layers.get(i, {})}
    for i in range(first, first + count):
        held = layers.get(i, {})
        if held and "eh_proj.weight" not in held:
            raise DFlashError(f"target checkpoint {model_dir}: layer {i} is past num_hidden_layers {first} within "
                              f"{key} {count}, but has no eh_proj.weight: not a multi-token-prediction layer "
                              f"(check num_hidden_layers and {key})")
        unknown = sorted(name for part, name in held.items()
                         if part.rpartition(".")[0] not in modules and not part.startswith(MTP_PARTS))
        if unknown:
            raise DFlashError(f"target checkpoint {model_dir} has weights a multi-token-prediction layer does not hold "
                              f"(an unsupported variant?): {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")


def _keep_fp8(model: nn.Module, state: dict[str, torch.Tensor], block_cols: int, dtype: torch.dtype) -> None:
    """Give every matrix that ``state`` holds as FP8 with row scales (``NAME`` and
    ``NAME_scale``) an FP8 layer of ``model`` (built on the meta device) to load into
    (:func:`_keep_quantized`): a decoder layer's ``nn.Linear`` becomes an
    :class:`~dflash_torch.models.fp8.Fp8Linear`, stacked experts keep FP8 matrices
    (:meth:`~dflash_torch.models.moe.Experts.keep_fp8`), anything else is dequantized into
    ``dtype`` in ``state`` (the values loading gives)."""
    def keep_experts(experts, scales):
        if not experts.fp8_block_cols:
            experts.keep_fp8(block_cols)

    _keep_quantized(model, state, lambda linear, scales: fp8_format.Fp8Linear.like(linear, block_cols), keep_experts,
                    lambda weight, scales, cols: fp8_format.dequantize_rows(weight, scales, block_cols, dtype),
                    fp8_format.FORMAT)


def _keep_int(model: nn.Module, state: dict[str, torch.Tensor], scheme: tuple[int, int | None], dtype: torch.dtype
              ) -> None:
    """As :func:`_keep_fp8`, for packed integer weights (``NAME`` int32 words and
    ``NAME_scale``, in the checkpoint's dtype): :class:`~dflash_torch.models.packed_int.IntLinear`
    layers and packed experts."""
    from .packed_int import IntLinear, dequantize_groups

    def keep_experts(experts, scales):
        if not experts.int_bits:
            experts.keep_int(*scheme, scales.dtype)

    _keep_quantized(model, state, lambda linear, scales: IntLinear.like(linear, *scheme, scales.dtype), keep_experts,
                    lambda weight, scales, cols: dequantize_groups(
                        weight, scales, *scheme, cols or weight.shape[-1] * 32 // scheme[0], dtype), torch.int32)


def _keep_nvfp4(model: nn.Module, state: dict[str, torch.Tensor], fmt: str, dtype: torch.dtype) -> None:
    """As :func:`_keep_fp8`, for NVFP4 weights (``NAME`` uint8 ``[..., rows, cols / 2]`` and
    ``NAME_scale``, :func:`~dflash_torch.models.nvfp4.joined_scales`, from
    :func:`~dflash_torch.checkpoint.load_state_dict` with ``keep_nvfp4``; ``fmt``: the
    checkpoint's format, :class:`~.config.TargetConfig`'s ``nvfp4``):
    :class:`~dflash_torch.models.nvfp4.Nvfp4Linear` layers and NVFP4 experts
    (:meth:`~dflash_torch.models.moe.Experts.keep_nvfp4`), anything else dequantized into
    ``dtype``; then each kept ``NAME_scale`` split into the group scales (``NAME_scale``)
    and the per-row scales (``NAME_scale_2``) the layers hold."""
    from .nvfp4 import CT, CT_METHOD, MODELOPT_NVFP4, ROW_SCALE_2_SUFFIX, Nvfp4Linear, dequantize_rows, split_scales

    kind = CT if fmt == CT_METHOD else MODELOPT_NVFP4
    suffix = fp8_format.ROW_SCALE_SUFFIX

    def keep_experts(experts, scales):
        if not experts.nvfp4_kind:
            experts.keep_nvfp4(kind)

    _keep_quantized(model, state, lambda linear, scales: Nvfp4Linear.like(linear, kind), keep_experts,
                    lambda weight, scales, cols: dequantize_rows(weight, *split_scales(scales), kind, dtype),
                    torch.uint8)
    for key in [k for k in state if k.endswith(suffix) and k.removesuffix(suffix) in state
                and state[k.removesuffix(suffix)].dtype == torch.uint8]:
        state[key], state[key.removesuffix(suffix) + ROW_SCALE_2_SUFFIX] = split_scales(state[key])


def _keep_fp4(model: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """As :func:`_keep_fp8`, for DeepSeek-V4's FP4 experts (``NAME`` uint8 ``[..., rows, cols /
    2]`` and ``NAME_scale`` uint8 ``[..., rows, cols / 32]``, :func:`~dflash_torch.checkpoint.load_state_dict`
    with ``keep_fp4``): stacked experts hold them as MXFP4 blocks and scales
    (:meth:`~dflash_torch.models.moe.Experts.keep_mxfp4`; the same bytes, ``[..., rows, cols /
    32, 16]``), anything else (a decoder linear too) is dequantized into ``dtype``."""
    from .moe import Experts
    from .mxfp4 import BLOCK, dequantize_fp4

    def keep_experts(experts, scales):
        if not experts.mxfp4:
            experts.keep_mxfp4()

    _keep_quantized(model, state, None, keep_experts, lambda weight, scales, cols: dequantize_fp4(weight, scales, dtype),
                    torch.uint8)
    for name, owner in model.named_modules():  # the kept experts' bytes, as the MXFP4 blocks they are
        if isinstance(owner, Experts) and owner.mxfp4:
            for attr in ("gate_up_proj", "down_proj"):
                key = f"{name}.{attr}"
                if key in state and state[key].dim() == 3:
                    state[key] = state[key].unflatten(-1, (-1, BLOCK // 2))


def _keep_quantized(model: nn.Module, state: dict[str, torch.Tensor], linear, keep_experts, dequantize,
                    held: torch.dtype) -> None:
    """For each matrix ``NAME`` that ``state`` holds quantized (in dtype ``held``) with its
    scales ``NAME_scale``: a decoder layer's ``nn.Linear`` owning it is replaced by
    ``linear(that linear, scales)`` (a meta layer to load into; None: dequantized instead),
    stacked experts get ``keep_experts(experts, scales)``, and a matrix held by anything else
    (e.g. a quantized LM head, which drafters read too) is dequantized in ``state`` by
    ``dequantize(matrix, scales, columns)`` (columns None where the owner has no such
    parameter: the unknown-weight check then names it)."""
    from .moe import Experts

    suffix = fp8_format.ROW_SCALE_SUFFIX
    for key in [k for k in state if k.endswith(suffix) and k.removesuffix(suffix) in state
                and state[k.removesuffix(suffix)].dtype == held]:
        name = key.removesuffix(suffix)
        path, attr = name.rsplit(".", 1)
        try:
            owner = model.get_submodule(path)
        except AttributeError:  # (not a parameter of this model: the unknown-weight check names it)
            continue
        if linear is not None and type(owner) is nn.Linear and attr == "weight" and path.startswith(DECODER_LAYERS):
            parent, child = path.rsplit(".", 1)
            setattr(model.get_submodule(parent), child, linear(owner, state[key]))
        elif isinstance(owner, Experts) and attr in ("gate_up_proj", "down_proj"):
            keep_experts(owner, state[key])
        else:
            cols = getattr(owner, attr).shape[-1] if hasattr(owner, attr) else None
            state[name] = dequantize(state[name], state.pop(key), cols)


def _name_of_part(key: str, t: torch.Tensor) -> str:
    """``key`` of a weight holding non-finite values, with the first expert holding them when
    it is a stacked expert tensor ``[E, ...]`` (its checkpoint may store one tensor per expert)."""
    if key.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        return f"{key} (expert {next(e for e in range(t.shape[0]) if not all_finite(t[e]))})"
    return key


def gated_deltanet(cfg: TargetConfig) -> GatedDeltaNet:
    """The linear-attention mixer of a hybrid target (``cfg.linear_attention``)."""
    la = cfg.linear_attention
    return GatedDeltaNet(cfg.hidden_size, la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim,
                         la.conv_kernel, cfg.rms_norm_eps)


def sparse_moe(cfg: TargetConfig) -> nn.Module:
    """The mixture-of-experts MLP of a target (``cfg.moe``)."""
    from .moe import SparseMoE

    m = cfg.moe
    return SparseMoE(cfg.hidden_size, m.num_experts, m.top_k, m.intermediate_size, m.norm_topk_prob,
                     m.shared_expert_intermediate_size)
