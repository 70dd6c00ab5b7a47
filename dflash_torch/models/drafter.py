"""The DFlash drafter: a small stack of Qwen3-style layers that denoises a block of
mask tokens in one forward pass, conditioned on target features through its K/V.

Follows the DFlash paper (arXiv 2602.06036) and the reference implementation
(z-lab/dflash, ``dflash/model.py``): context features ``c_p = hidden_norm(fc(f_p))``
enter every layer only as keys/values (``k_norm(k_proj(c_p))`` with RoPE at ``p``,
``v_proj(c_p)``; no q/k norms where ``dflash_config.use_qk_norm`` is false); queries come
from the block only; attention is non-causal.

Two ways to hold the context (the ``draft_mode``):

* :class:`InjectedContext` (``inject``): a persistent KV cache. Each round only the
  newly committed positions are projected and written (KV injection); the block's own
  K/V are written at the block positions and overwritten by later rounds.
* :class:`RecomputedContext` (``recompute``): keeps every committed feature row and
  re-projects all of them each round (the cache-less workaround from the llama.cpp
  discussion in ``shared/seed``); a test oracle and a baseline.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from ..cache import KVCache, ring_positions
from ..checkpoint import (all_finite, check_fits, load_config, load_state_dict, missing_note, tensor_names,
                          weight_file_sizes)
from ..errors import DFlashError
from ..sampling import SamplingParams, greedy_tokens, probabilities, sample
from ..structured import GrammarState
from .attention import Attention
from .drafter_config import DrafterConfig
from .layers import MLP, RMSNorm, attend, attention_bias, embedding
from .rope import Rotary


def drafter_class(cfg: DrafterConfig) -> type["DFlashDrafter"]:
    """The module class of a drafter config: :class:`DFlashDrafter`,
    :class:`~dflash_torch.models.dflash2.DFlash2Drafter` for a DFlash 2 config or
    :class:`~dflash_torch.models.speculators.SpeculatorsDrafter` for a Speculators-format one,
    :class:`~dflash_torch.models.laguna_drafter.LagunaDrafter` for a Laguna DFlash one."""
    if cfg.laguna is not None:
        from .laguna_drafter import LagunaDrafter

        return LagunaDrafter
    if cfg.dflash2 is not None:
        from .dflash2 import DFlash2Drafter

        return DFlash2Drafter
    if cfg.speculators is not None:
        from .speculators import SpeculatorsDrafter

        return SpeculatorsDrafter
    return DFlashDrafter


class DraftLayer(nn.Module):
    """One drafter layer: non-causal attention over context K/V + block, then SwiGLU MLP.

    The block rows pass through three steps, which the DFlash 2 layer
    (:class:`~dflash_torch.models.dflash2.DFlash2Layer`) extends; context rows never do.
    ``block_len`` is the number of rows of one block: the rows ``[T, hidden]`` are whole
    blocks in order (one block at inference, many in training).
    """

    def __init__(self, cfg: DrafterConfig, sliding_window: int | None):
        super().__init__()
        self.self_attn = Attention(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.attention_bias, cfg.qk_norm, cfg.rms_norm_eps, o_bias=cfg.attention_bias,
        )
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, activation=cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sliding_window = sliding_window

    def context_input(self, c: torch.Tensor) -> torch.Tensor:
        """Context rows ``c`` ``[n, hidden]`` -> what this layer projects their keys/values
        from: ``c`` itself (the DFlash reference; a Laguna DFlash layer norms them first)."""
        return c

    def attention_input(self, x: torch.Tensor, block_len: int) -> tuple[torch.Tensor, object]:
        """Residual stream ``x`` ``[T, hidden]`` -> the attention's input (queries and the
        block's keys/values come from it) and a state for :meth:`attention_output`."""
        return self.input_layernorm(x), None

    def attention_output(self, attended: torch.Tensor, state: object, block_len: int) -> torch.Tensor:
        """Attention output ``[T, heads * head_dim]`` -> what is added to the residual stream."""
        return self.self_attn.o_proj(attended)

    def mlp_output(self, x: torch.Tensor, block_len: int) -> torch.Tensor:
        """Residual stream ``[T, hidden]`` -> the MLP branch added to it."""
        return self.mlp(self.post_attention_layernorm(x))


MIDLAYER = "midlayer."  # EAGLE-style name of a one-layer drafter's layer (vLLM's DFlash loader maps it to layers.0.)


def eagle_layer_names(state: dict[str, torch.Tensor], num_layers: int, model_dir) -> dict[str, torch.Tensor]:
    """A drafter checkpoint's tensors with EAGLE-style ``midlayer.*`` names read as
    ``layers.0.*``, as vLLM's DFlash loader maps them, where that is unambiguous: a drafter of
    one layer (``num_layers``) whose checkpoint has no ``layers.*`` tensor. Other checkpoints
    come back as they are. ``state``: tensor name -> tensor (not changed).

    Raises:
        DFlashError: ``midlayer.*`` tensors in a drafter of more than one layer, or beside
            ``layers.*`` ones (one line: which layer they are is unknown).
    """
    mid = [k for k in state if k.startswith(MIDLAYER)]
    if not mid:
        return state
    if num_layers != 1 or any(k.startswith("layers.") for k in state):
        raise DFlashError(f"drafter checkpoint {model_dir} names weights EAGLE-style ({mid[0]}, ...: the one layer of a "
                          f"one-layer drafter, which vLLM reads as layers.0.*) but its config.json has num_hidden_layers "
                          f"{num_layers}{' and it has layers.* weights too' if num_layers == 1 else ''}; rename them "
                          "layers.<i>.*")
    return {("layers.0." + k[len(MIDLAYER):] if k.startswith(MIDLAYER) else k): v for k, v in state.items()}


class DFlashDrafter(nn.Module):
    """DFlash draft model. Parameter names match published checkpoints:
    ``layers.*``, ``fc``, ``hidden_norm``, ``norm``. As the DFlash reference's, it embeds
    the block with the target's ``embed_tokens`` and applies the target's ``lm_head`` to the
    output; a self-contained checkpoint that ships its own ``embed_tokens.weight``
    (``[vocab, hidden]``) or ``lm_head.weight`` (``[vocab, hidden]``) uses those instead, as
    vLLM's DFlash drafters do (config.json ``has_embed_tokens`` / ``has_lm_head``; absent:
    whether the checkpoint ships them).

    Drafting is split in two so that the decoding loop serves every drafter family
    alike: :meth:`draft_scores` (tensor work only, no sampling parameters: the part a
    compiled step runs) and :meth:`choose_draft` (greedy choice or sampling with the
    request's parameters and random generator).
    """

    layer_class = DraftLayer

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(self.layer_class(cfg, w) for w in cfg.sliding_windows)
        for layer, causal in zip(self.layers, cfg.causal_layers):
            layer.causal = causal  # (block rows see the block up to themselves: visible_keys)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.feature_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = self.make_rotary(cfg)
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size) if cfg.own_embedding else None
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if cfg.own_lm_head else None

    @staticmethod
    def make_rotary(cfg: DrafterConfig) -> Rotary:
        """The drafter's RoPE tables (built again on the load device after a meta-device build)."""
        return Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.partial_rotary_factor,
                      max_position_embeddings=cfg.max_position_embeddings)

    @staticmethod
    def from_pretrained(model_dir: Path, dtype: torch.dtype, device: str | torch.device = "cpu",
                        config: dict | None = None, parsed: DrafterConfig | None = None) -> "DFlashDrafter":
        """Load a published-format drafter checkpoint directory: a DFlash drafter (also in
        transformers' assistant format, e.g. ``MuseGlimmerAssistantModel``), a DFlash 2 one
        (then a :class:`~dflash_torch.models.dflash2.DFlash2Drafter`), a Speculators-format
        one (then a :class:`~dflash_torch.models.speculators.SpeculatorsDrafter`) or a Laguna
        DFlash one (then a :class:`~dflash_torch.models.laguna_drafter.LagunaDrafter`). ``config``:
        its ``config.json`` dict as read and completed by the caller (e.g. a mask token id
        resolved with the target's tokenizer, :func:`~dflash_torch.models.drafter_config.fill_mask_token_id`);
        None reads the file. ``parsed``: ``config``'s :class:`DrafterConfig` where the caller
        has it already (not parsed again, so that a warning of the parse is said once; the
        caller's object is not changed), else None.

        Raises:
            DFlashError: not a DFlash config, a ``mask_embedding.pt`` beside it (a learned
                mask embedding, not read), EAGLE-style ``midlayer.*`` weights where they do not
                name the one layer (:func:`eagle_layer_names`), or weights missing, unknown, of the
                wrong shape, not floating point (e.g. int8) or not finite (NaN / inf), or
                what the class's :meth:`adapt_checkpoint` refuses.
        """
        raw = load_config(model_dir) if config is None else config
        if (Path(model_dir) / "mask_embedding.pt").exists():  # (a pickle beside the safetensors: never silently unread)
            raise DFlashError(f"drafter {model_dir} ships mask_embedding.pt (a learned mask-token embedding outside "
                              "its safetensors); dflash-torch embeds mask tokens with the embedding table and does "
                              "not read that file")
        cfg = DrafterConfig.from_dict(raw) if parsed is None else copy.deepcopy(parsed)
        if cfg.speculators is not None:  # (which optional tensors it ships decides the modules)
            from .speculators import match_checkpoint

            match_checkpoint(cfg, tensor_names(model_dir))
        with torch.device("meta"):
            model = drafter_class(cfg)(cfg)
        files = weight_file_sizes(model_dir)
        check_fits(model, dtype, device, "drafter", files=files)  # (before any file is read: tables of its own add)
        if _find_own_tables(cfg, raw, model_dir):
            with torch.device("meta"):
                model = drafter_class(cfg)(cfg)
            check_fits(model, dtype, device, "drafter", files=files)
        state = model.adapt_checkpoint(eagle_layer_names(load_state_dict(model_dir, dtype, device, what="drafter"),
                                                         cfg.num_hidden_layers, model_dir), model_dir)
        expected = model.state_dict()
        names = cfg.checkpoint_names  # (our name -> the checkpoint's, for the transformers-format drafters)
        name = lambda k: names.get(k, k)  # noqa: E731
        taken = {k for k in state if k in names}  # our own name in that layout: a weight no format has
        for ours, theirs in names.items():
            if theirs in state:
                state[ours] = state.pop(theirs)
        missing = sorted(map(name, expected.keys() - state.keys()))
        if missing:
            raise DFlashError(f"drafter checkpoint {model_dir} lacks weights: {', '.join(missing[:5])}"
                              f"{' ...' if len(missing) > 5 else ''}{missing_note(model_dir, missing, state.keys() - expected.keys())}"
                              + (cfg.default_note("attention_bias") if any(k.endswith("_proj.bias") for k in missing) else ""))
        unknown = sorted((state.keys() - expected.keys()) | taken)
        for table, key in (("embed_tokens.weight", "has_embed_tokens"), ("lm_head.weight", "has_lm_head")):
            if table in unknown and raw.get(key) is False:
                raise DFlashError(f"drafter checkpoint {model_dir} ships {table} but its config.json says {key}: false "
                                  f"(set it true to use the drafter's own table, or remove the tensor)")
        qk = [k for k in unknown if k.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight"))]
        if qk and not cfg.qk_norm:
            raise DFlashError(f"drafter checkpoint {model_dir} ships q/k norm weights ({qk[0]}, ...) but its config.json "
                              "says dflash_config.use_qk_norm: false (set it true to use them, or remove the tensors)")
        if unknown:  # never run a checkpoint in part: weights we do not know would be silently dropped
            kind = "DFlash 2" if cfg.dflash2 else "Laguna DFlash" if cfg.laguna else "DFlash"
            raise DFlashError(f"drafter checkpoint {model_dir} has weights a {kind} drafter does not use "
                              f"(an unsupported variant?): {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}"
                              + (cfg.default_note("attention_bias") if any(k.endswith("_proj.bias") for k in unknown) else ""))
        for k, v in expected.items():
            if tuple(state[k].shape) != tuple(v.shape):
                raise DFlashError(f"drafter weight {name(k)} has shape {tuple(state[k].shape)}, config implies {tuple(v.shape)}"
                                  + (cfg.default_note("head_dim", "num_key_value_heads") if ".self_attn." in k else ""))
            if v.is_floating_point() and not state[k].is_floating_point():
                raise DFlashError(f"drafter weight {name(k)} has dtype {str(state[k].dtype).removeprefix('torch.')}; "
                                  "dflash-torch reads floating-point weights only (float32 / bfloat16 / float16 / float64; a quantized checkpoint?)")
            if not all_finite(state[k]):  # e.g. a diverged training run
                raise DFlashError(f"drafter weight {name(k)} holds NaN or infinite values (a corrupt or diverged checkpoint)")
        model.load_state_dict(state, strict=True, assign=True)
        model.rotary = model.make_rotary(cfg).to(device)
        return model.eval()

    def adapt_checkpoint(self, state: dict[str, torch.Tensor], model_dir: Path) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors ``state`` as this module loads them (here as they are)."""
        return state

    def feature_layers(self, target) -> list[int]:
        """The target feature ids (``TargetModel.forward``'s ``feature_layers``) whose outputs
        make this drafter's context features, in order: its ``target_layer_ids``."""
        return list(self.config.target_layer_ids)

    def share_with(self, target) -> int:
        """Drop the drafter's own embedding table / LM head where they equal the target's bit
        for bit (a self-contained checkpoint's copies), reading the target's rows and head
        instead (as stored, as the copies gave them); returns the bytes freed."""
        freed = 0
        if self.embed_tokens is not None and same_tensor(self.embed_tokens.weight, target.model.embed_tokens.weight):
            freed += self.embed_tokens.weight.nbytes
            self.embed_tokens = None
        head = getattr(target.lm_head, "weight", None)
        if self.lm_head is not None and head is not None and same_tensor(self.lm_head.weight, head):
            freed += self.lm_head.weight.nbytes
            self.lm_head = None
        return freed

    def kv_windows(self) -> list[int | None]:
        """What each layer's cache must keep for a block (tokens; None: every position): the
        positions its block's first row sees, its sliding window ``(s - window, s]`` here
        (:meth:`visible_keys`), which a ring of the cache then holds."""
        return [layer.sliding_window for layer in self.layers]

    def new_cache(self, max_rows: int | None = None) -> KVCache:
        """An empty drafter KV cache (one entry per drafter layer). ``max_rows``: the most
        rows (tokens) one write to it holds and the most rows a block has (a decoder's
        block size, prefill chunk or injection, whichever is larger): sliding-window layers
        then keep a ring of ``window + max_rows - 1`` positions (see
        :class:`~dflash_torch.cache.KVCache`); None (default): every position kept."""
        w = self.fc.weight
        c = self.config
        return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, w.dtype, w.device, self.kv_windows(),
                       max_rows)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features ``[n, k * feature_size]`` -> context rows ``c`` ``[n, hidden]``."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context keys/values ``[kv_heads, n, head_dim]`` of feature rows at ``positions`` ``[n]``."""
        c = self.project_context(features)
        cos, sin = self.rotary.cos_sin(positions, c.dtype)
        return [layer.self_attn.key_value(layer.context_input(c), cos, sin) for layer in self.layers]

    def embed(self, target, tokens: torch.Tensor) -> torch.Tensor:
        """The block's token embeddings ``[..., hidden]`` of int64 ``tokens`` ``[...]``: the
        target's (:meth:`TargetModel.embed`, as the DFlash reference embeds its blocks); with
        an embedding table of its own, its rows as stored (no family scale), also once
        :meth:`share_with` has swapped an equal copy for the target's table."""
        if self.embed_tokens is not None:
            return self.embed_tokens(tokens)
        if self.config.own_embedding:
            return target.model.embed_tokens(tokens)
        return target.embed(tokens)

    def block_input(self, block_embeds: torch.Tensor) -> torch.Tensor:
        """The residual stream's start from the block's token embeddings ``[T, hidden]``: times
        the config's ``input_embedding_scale`` where it is not 1 (as the DFlash reference scales
        them, :func:`~dflash_torch.models.drafter_config.draft_scaling`), else as they are."""
        scale = self.config.scaling.input_embedding_scale
        return block_embeds if scale == 1.0 else block_embeds * scale

    def limits_keys(self, layer: DraftLayer) -> bool:
        """Whether a block row of ``layer`` may miss a key before its block's end (then even
        a slice of the cache that ends there needs a mask): a sliding window, or a causal block."""
        return layer.sliding_window is not None or layer.causal

    def visible_keys(self, layer: DraftLayer, positions: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Which keys each block row of ``layer`` attends to: bool ``[..., B, n]`` for the
        block positions ``positions`` int64 ``[..., B]`` and key positions ``k_pos`` ``[n]``.
        Every key before the block's end (non-causal, as the DFlash reference), or, in a
        causal layer (``DrafterConfig.causal_layers``), up to the row's own position; within
        the sliding window ``(p - window, p]`` of row position p where the layer has one."""
        last = positions[..., None] if layer.causal else positions[..., -1:, None]
        visible = k_pos <= last  # (a block sees up to its own end, or a row up to itself)
        if layer.sliding_window is not None:
            visible = visible & (k_pos > positions[..., None] - layer.sliding_window)
        return visible

    def _bias(self, layer: DraftLayer, positions: torch.Tensor, n_keys: int, static: bool,
              dtype: torch.dtype, ring: int | None = None) -> torch.Tensor | None:
        """Additive key mask (:func:`attention_bias`) of :meth:`visible_keys` for keys at
        positions ``[0, n_keys)``, or those the first ``n_keys`` rows of a ring of ``ring``
        rows hold (:func:`~dflash_torch.cache.ring_positions`); None when every key is visible."""
        if ring is None and not static and not self.limits_keys(layer):
            return None
        if ring is None:
            visible = self.visible_keys(layer, positions, torch.arange(n_keys, device=positions.device))
        else:
            held = ring_positions(positions, ring, n_keys).unsqueeze(-2)  # [1 or N, 1, n_keys]
            visible = self.visible_keys(layer, positions, held) & (held >= 0)
        groups = self.config.num_attention_heads // self.config.num_key_value_heads
        return attention_bias(visible.expand(*positions.shape, n_keys), groups, dtype)

    def forward(self, block_embeds: torch.Tensor, positions: torch.Tensor,
                context: "InjectedContext | RecomputedContext", kv_len: int | None,
                mask_keys: bool = False, inject: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Denoise one block.

        Args:
            block_embeds: ``[B, hidden]``, the target's embeddings of ``[last, mask, ...]``.
            positions: int64 ``[B]``, the block's absolute positions ``[s, s + B)``.
                Batched decoding: ``[N, B]``, the blocks of N sequences (their rows follow
                one another in ``block_embeds`` ``[N * B, hidden]``; ``inject`` positions
                ``[N, n]``), with ``context`` holding a
                :class:`~dflash_torch.batch.SlotKVCache` view of N slots.
            context: holds the context K/V of positions ``[0, s)``.
            kv_len: ``s + B`` to attend over a slice of the injected cache, or ``None`` to
                attend over the whole preallocated buffer under a mask (fixed shapes).
            mask_keys: ``kv_len`` is a length bucket that may exceed ``s + B``: mask the
                cache entries past the block (implied by ``kv_len=None``).
            inject: optional ``(features [n, k * feature_size], feature_positions [n])`` to
                inject in the same pass (:class:`InjectedContext` only): each layer
                projects those context rows and the block rows through one
                ``k_proj``/``v_proj`` call and writes the context rows first, so a block
                position that is also a feature position ends up holding the block's K/V.
                Same cache contents as :meth:`InjectedContext.inject` followed by this call.

        Returns:
            final-normed hidden states ``[B, hidden]``; row j predicts the token at ``s + j``.

        Raises:
            ValueError: ``inject`` given with a :class:`RecomputedContext`.
        """
        x = self.block_input(block_embeds)
        B = positions.shape[-1]  # rows of one block
        recomputed = context.layer_kv(self) if isinstance(context, RecomputedContext) else None
        if inject is not None and recomputed is not None:
            raise ValueError("inject= needs an InjectedContext (the recompute context re-projects all features)")
        n_ctx = 0
        if inject is None:
            cos, sin = self.rotary.cos_sin(positions.reshape(-1), x.dtype)
        else:
            ctx_rows, ctx_positions = self.project_context(inject[0]), inject[1]
            n_ctx = ctx_positions.numel()
            cos_all, sin_all = self.rotary.cos_sin(torch.cat([ctx_positions.reshape(-1), positions.reshape(-1)]), x.dtype)
            cos, sin = cos_all[n_ctx:], sin_all[n_ctx:]
        static = recomputed is None and (kv_len is None or mask_keys)
        biases = {}  # one mask per (sliding window, causality) (every layer attends over the same keys)
        for i, layer in enumerate(self.layers):
            h, state = layer.attention_input(x, B)
            attn = layer.self_attn
            if n_ctx:
                k_all, v_all = attn.key_value(torch.cat([layer.context_input(ctx_rows), h]), cos_all, sin_all)
                context.cache.write(i, ctx_positions, k_all[:, :n_ctx], v_all[:, :n_ctx])
                kb, vb = k_all[:, n_ctx:], v_all[:, n_ctx:]
            else:
                kb, vb = attn.key_value(h, cos, sin)
            if recomputed is None:
                k, v = context.block_kv(i, positions, kb, vb, kv_len)
            else:
                ck, cv = recomputed[i]
                k, v = torch.cat([ck, kb], dim=1), torch.cat([cv, vb], dim=1)
            kind = (layer.sliding_window, layer.causal)
            if kind not in biases:
                ring = None if recomputed is not None else context.cache.layer_ring(i)
                biases[kind] = self._bias(layer, positions, k.shape[-2], static, x.dtype, ring)
            out = attend(attn.query(h, cos, sin), k, v, biases[kind])
            x = x + layer.attention_output(out, state, B)
            x = x + layer.mlp_output(x, B)
        return self.norm(x)

    def draft_scores(self, hidden: torch.Tensor, anchor: torch.Tensor, target) -> torch.Tensor:
        """What :meth:`choose_draft` picks the draft from: the draft logits ``[..., B-1, V]``
        of the final hidden rows ``hidden`` ``[..., B, hidden]`` of :meth:`forward` (row 0,
        the anchor's, is not a draft slot), through the target's LM head
        (:meth:`draft_logits`). ``anchor`` (the block's first token, int64 ``[...]``) is
        unused here. Leading dimensions are blocks (training and evaluation)."""
        return self.draft_logits(target, hidden[..., 1:, :])

    def unary_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[..., V]`` -> float32 ``[..., V]``: times the config's
        ``output_multiplier``, then ``tanh(v / cap) * cap`` when ``final_logit_softcapping``
        is set (:func:`~dflash_torch.models.drafter_config.draft_scaling`)."""
        s = self.config.scaling
        x = logits.float()
        if s.output_multiplier != 1.0:
            x = x * s.output_multiplier
        if s.final_logit_softcapping is not None:
            x = torch.tanh(x / s.final_logit_softcapping) * s.final_logit_softcapping
        return x

    def draft_logits(self, target, slots: torch.Tensor) -> torch.Tensor:
        """The draft logits ``[..., V]`` of final hidden rows ``slots`` ``[..., hidden]``: the
        target's LM head with the target's own output scale (:meth:`TargetModel.output_logits`;
        Muse Glimmer's multiplier and soft cap), as the DFlash reference's drafters take it, so
        that sampled drafts are on the target's scale. (The same for training and decoding.)
        With an LM head of its own: that head's logits as they are (no output scale or soft
        cap), also once :meth:`share_with` has swapped an equal copy for the target's head.
        Either times the config's ``logit_scale`` where it is not 1 (as vLLM's DFlash drafter
        scales its draft logits). A config with an ``output_multiplier`` other than 1 or a
        ``final_logit_softcapping``: the LM head's logits (the target's without its output
        scale, as the DFlash reference reads its ``lm_head``) through :meth:`unary_scores`
        instead (float32)."""
        s = self.config.scaling
        shaped = s.output_multiplier != 1.0 or s.final_logit_softcapping is not None
        if self.lm_head is not None:
            logits = self.lm_head(slots)
        elif self.config.own_lm_head or shaped:
            logits = target.logits(slots)
        else:
            logits = target.output_logits(slots)
        if shaped:
            return self.unary_scores(logits)
        return logits if self.config.logit_scale == 1.0 else logits * self.config.logit_scale

    def choose_draft(self, scores: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                     guide: GrammarState | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens from :meth:`draft_scores`.

        Args:
            guide: a structured-output constraint (one block only): each slot is then chosen
                in turn among the tokens it allows after the drafts before it (slots where
                it allows nothing more, past an EOS, are not masked), and the guide's path
                holds the draft afterwards (see :mod:`dflash_torch.structured`).

        Returns:
            ``(tokens, q)``: int64 ``[B-1]`` and, when sampling, the float32 ``[B-1, V]``
            distributions they were drawn from (None for greedy decoding): the argmax of
            each slot, or a sample of each slot's :func:`~dflash_torch.sampling.probabilities`
            (masked by the guide's tokens, if any). Greedy decoding without a guide also
            takes leading block dimensions (``[..., B-1]`` tokens).
        """
        if guide is not None and params.greedy:  # each slot's argmax, or its argmax among the allowed tokens
            tokens = greedy_tokens(scores).tolist()
            for r, token in enumerate(tokens):
                if not guide.advance(token):
                    allowed = guide.next_allowed()
                    if allowed is not None:
                        tokens[r] = int(greedy_tokens(_allowed_scores(scores[r:r + 1], allowed))[0])
                        guide.advance(tokens[r])
            return torch.tensor(tokens, dtype=torch.long, device=scores.device), None
        if guide is not None:
            tokens, probs = [], []
            for row in scores:
                allowed = guide.next_allowed()
                x = row[None].float() if allowed is None else _allowed_scores(row[None], allowed)
                p = probabilities(x, params)
                token = sample(p, generator)
                probs.append(p)
                tokens.append(token)
                guide.advance(int(token))
            return torch.cat(tokens), torch.cat(probs)
        if params.greedy:
            return greedy_tokens(scores), None
        probs = probabilities(scores, params)
        return sample(probs, generator), probs


def _allowed_scores(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``scores`` ``[1, V]`` as float32, ``-inf`` where ``allowed`` (bool ``[V]``) is False;
    uniform over the allowed tokens when none of them has a finite score (a draft
    vocabulary that lacks them all)."""
    x = scores.float().masked_fill(~allowed, float("-inf"))
    if not bool(torch.isfinite(x).any()):
        x = torch.zeros_like(x).masked_fill(~allowed, float("-inf"))
    return x


class InjectedContext:
    """Drafter context as a persistent, preallocated KV cache updated by injection."""

    def __init__(self, drafter: DFlashDrafter, cache: KVCache | None = None, max_rows: int | None = None):
        # (batched decoding passes its own cache; max_rows: see DFlashDrafter.new_cache)
        self.cache = drafter.new_cache(max_rows) if cache is None else cache

    def reset(self, capacity: int) -> None:
        """Forget all context; room for ``capacity`` positions."""
        self.cache.reset(capacity)

    def resume(self, capacity: int, length: int) -> None:
        """Keep the context of the first ``length`` positions; room for ``capacity`` positions."""
        self.cache.resume(capacity, length)

    def inject(self, drafter: DFlashDrafter, features: torch.Tensor, positions: torch.Tensor) -> None:
        """KV injection: project ``features`` ``[n, k * feature_size]`` of ``positions`` ``[n]``
        through ``fc``, ``hidden_norm`` and each layer's ``k_proj``/``k_norm``/RoPE and
        ``v_proj``, and write them into the cache. Rows past the committed length may be
        written too (fixed shapes): the next block overwrites them before they are read."""
        for i, (k, v) in enumerate(drafter.context_kv(features, positions)):
            self.cache.write(i, positions, k, v)

    def block_kv(self, layer: int, positions: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor,
                 kv_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the block's K/V at its positions (they never survive as context: the
        next injection or block overwrites them) and return the keys/values to attend over."""
        self.cache.write(layer, positions, kb, vb)
        return self.cache.view(layer, kv_len)


class RecomputedContext:
    """Cache-less drafter context: every committed feature row is kept and re-projected
    through ``fc``, ``hidden_norm`` and every layer's ``k_proj``/``v_proj`` each round."""

    def __init__(self, drafter: DFlashDrafter):
        self.features: list[torch.Tensor] = []
        self.length = 0

    def reset(self, capacity: int) -> None:
        self.features, self.length = [], 0

    def resume(self, capacity: int, length: int) -> None:
        """Keep the feature rows of the first ``length`` positions."""
        self.features = [torch.cat(self.features)[:length]] if length else []
        self.length = length

    def inject(self, drafter: DFlashDrafter, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Append feature rows ``[n, k * feature_size]``; ``positions`` must continue the context."""
        if int(positions[0]) != self.length:
            raise RuntimeError(f"recompute context expects position {self.length}, got {int(positions[0])}")
        self.features.append(features)
        self.length += features.shape[0]

    def layer_kv(self, drafter: DFlashDrafter) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Re-project all accumulated features into per-layer context K/V."""
        feats = torch.cat(self.features, dim=0)
        self.features = [feats]
        return drafter.context_kv(feats, torch.arange(feats.shape[0], device=feats.device))


def _find_own_tables(cfg: DrafterConfig, raw: dict, model_dir: Path) -> bool:
    """Where a DFlash- or DFlash 2-format drafter's ``config.json`` (``raw``) says neither ``has_embed_tokens``
    nor ``has_lm_head``, set ``cfg.own_embedding`` / ``cfg.own_lm_head`` as its checkpoint ships
    ``embed_tokens.weight`` / ``lm_head.weight`` (as vLLM reads them); returns whether it ships one.

    Raises:
        DFlashError: it ships one but its config.json has no ``vocab_size``.
    """
    if cfg.speculators is not None or cfg.laguna is not None or any(raw.get(key) is not None for key in ("has_embed_tokens", "has_lm_head")):
        return False
    names = tensor_names(model_dir)
    cfg.own_embedding, cfg.own_lm_head = "embed_tokens.weight" in names, "lm_head.weight" in names
    if (cfg.own_embedding or cfg.own_lm_head) and not isinstance(cfg.vocab_size, int):
        raise DFlashError(f"drafter checkpoint {model_dir} ships its own embed_tokens / lm_head, but its "
                          "config.json has no vocab_size (the rows of that table)")
    return cfg.own_embedding or cfg.own_lm_head


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same values in the same shape, dtype and device."""
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
