"""The target LLM (Qwen3, Llama / Llama-3, Qwen2) with a static KV cache and
capture of intermediate layer outputs (the DFlash context features)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..cache import KVCache
from ..checkpoint import load_config, load_state_dict
from ..errors import DFlashError
from .attention import Attention
from .config import TargetConfig
from .layers import MLP, RMSNorm, attend, attention_bias
from .rope import Rotary


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: causal self-attention then SwiGLU MLP, both residual."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.self_attn = Attention(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.attention_bias, cfg.qk_norm, cfg.rms_norm_eps,
            o_bias=cfg.attention_bias and cfg.model_type == "llama",  # Llama's attention_bias covers o_proj too
        )
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class _Backbone(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TargetModel(nn.Module):
    """A decoder-only LLM that returns logits and the outputs of chosen layers.

    Parameter names follow Hugging Face (``model.embed_tokens``, ``model.layers.*``,
    ``model.norm``, ``lm_head``), so checkpoints load as they are.
    """

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.config = cfg
        self.model = _Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_position_embeddings=cfg.max_position_embeddings)

    @classmethod
    def from_pretrained(cls, model_dir: Path, dtype: torch.dtype, device: str | torch.device = "cpu") -> "TargetModel":
        """Load a Hugging Face checkpoint directory.

        Raises:
            DFlashError: unsupported config; weights missing, unused (an unsupported
                variant, e.g. biases the config does not announce) or of the wrong shape.
        """
        cfg = TargetConfig.from_dict(load_config(model_dir))
        with torch.device("meta"):
            model = cls(cfg)
        state = load_state_dict(model_dir, dtype, device)
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        expected = {k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
        missing = sorted(expected - state.keys())
        if missing:
            raise DFlashError(f"target checkpoint {model_dir} lacks weights: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        unused = sorted(k for k in state.keys() - expected if not k.endswith("rotary_emb.inv_freq"))
        if unused:
            raise DFlashError(
                f"target checkpoint {model_dir} has weights this {cfg.model_type} model does not use "
                f"(an unsupported variant?): {', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''}"
            )
        shapes = model.state_dict()
        for k in expected:
            if tuple(state[k].shape) != tuple(shapes[k].shape):
                raise DFlashError(f"target weight {k} has shape {tuple(state[k].shape)}, config.json implies {tuple(shapes[k].shape)}")
        state = {k: v for k, v in state.items() if k in expected}
        model.load_state_dict(state, strict=False, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_position_embeddings=cfg.max_position_embeddings).to(device)
        return model.eval()

    def new_cache(self) -> KVCache:
        """An empty KV cache matching this model's layers, heads, dtype and device."""
        w = self.model.embed_tokens.weight
        c = self.config
        return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, w.dtype, w.device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, hidden]`` for ``input_ids`` ``[T]``."""
        return self.model.embed_tokens(input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on already-normalised hidden states ``[T, hidden]`` -> ``[T, vocab]``."""
        return self.lm_head(hidden)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        kv_len: int | None,
        feature_layers: list[int] | None = None,
        logits_from: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``T`` tokens at ``positions``, writing their K/V into ``cache``.

        Args:
            input_ids: int64 ``[T]``.
            positions: int64 ``[T]``, consecutive absolute positions.
            cache: the KV cache; positions before ``positions[0]`` must be filled.
            kv_len: attend over cache entries ``[0, kv_len)`` under the causal mask (eager:
                ``positions[-1] + 1``; fixed shapes: a length bucket, entries past
                ``positions`` are masked); ``None`` attends over the whole buffer.
            feature_layers: target layer ids whose outputs to return (layer ``l`` is
                Hugging Face ``hidden_states[l + 1]``; for the last layer that is the
                output after the final norm, as in transformers).
            logits_from: compute logits only for rows ``[logits_from, T)``.

        Returns:
            logits ``[T - logits_from, vocab]`` (model dtype) and the concatenated layer
            outputs ``[T, len(feature_layers) * hidden]`` (or None).
        """
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        k_pos = torch.arange(cache.capacity if kv_len is None else kv_len, device=x.device)
        groups = self.config.num_attention_heads // self.config.num_key_value_heads
        bias = attention_bias(k_pos[None, :] <= positions[:, None], groups, x.dtype)
        wanted = set(feature_layers or ())
        captured = {}
        for i, layer in enumerate(self.model.layers):
            h = layer.input_layernorm(x)
            attn = layer.self_attn
            k, v = attn.key_value(h, cos, sin)
            cache.write(i, positions, k, v)
            ck, cv = cache.view(i, kv_len)
            out = attend(attn.query(h, cos, sin), ck, cv, bias)
            x = x + attn.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in wanted:
                captured[i] = x
        last = len(self.model.layers) - 1
        if last in wanted:  # Hugging Face's hidden_states[L] is the final-normed output
            captured[last] = self.model.norm(x)
            normed = captured[last][logits_from:]
        else:
            normed = self.model.norm(x[logits_from:])
        features = torch.cat([captured[i] for i in feature_layers], dim=-1) if feature_layers else None
        logits = self.lm_head(normed)
        return logits, features
