"""DeepSeek Sparse Attention (DSA) targets: ``deepseek_v32`` (``DeepseekV32ForCausalLM``:
DeepSeek-V3.2, DeepSeek-V3.2-Exp) and ``glm_moe_dsa`` (``GlmMoeDsaForCausalLM``: GLM-5,
GLM-5.1), run by :mod:`.deepseek_v3`'s model with a *lightning indexer* added to the attention.
Layout as in transformers' ``modular_deepseek_v32.py`` and ``modular_glm_moe_dsa.py``:

* **Attention**: DeepSeek-V3's multi-head latent attention (absorbed, over a latent cache:
  :mod:`.deepseek_v3`), always with the query's low rank (``q_lora_rank`` may not be null) and
  interleaved RoPE (transformers' classes have no ``rope_interleave``), the same softmax scale
  (times DeepSeek's YaRN ``mscale_all_dim`` factor squared).
* **The lightning indexer** (Hugging Face ``self_attn.indexer.*``) chooses which keys each query
  may attend to. Its queries are ``wq_b(q_resid)`` (``q_resid = q_a_layernorm(q_a_proj(x))``,
  the attention's own query latent), ``index_n_heads`` heads of ``index_head_dim``; its key, one
  per token, is ``k_norm(wk(x))`` (``k_norm`` a LayerNorm with bias, eps 1e-6). RoPE (the
  attention's tables) rotates the first ``qk_rope_head_dim`` channels of both: consecutive halves
  for DeepSeek-V3.2, interleaved pairs for GLM-MoE-DSA (a config's ``indexer_rope_interleave``,
  which vLLM reads and transformers does not, must agree). A query's score of a key is
  ``sum_h w_h * relu(q_h . k) / sqrt(index_head_dim)`` in float32, ``w = weights_proj(x) /
  sqrt(index_n_heads)``; over the keys the causal mask lets it see, the ``index_topk`` best are
  the only ones its attention reads (all of them while it sees no more than ``index_topk``).
  DeepSeek's reference inference code and vLLM score with queries and keys rotated by a Hadamard
  transform (dot products unchanged) and quantized to FP8; transformers and dflash-torch score
  the unquantized values, so where two keys' scores are within FP8's rounding the keys chosen can
  differ from those engines' (the output stays the target's own, as dflash-torch computes it).
  ``weights_proj`` runs in the model's dtype (transformers keeps it float32 only for float16,
  which dflash-torch does not run).
* **Shared layers** (GLM-MoE-DSA): ``indexer_types`` says per layer ``"full"`` (runs its
  indexer) or ``"shared"`` (no indexer: reuses the choice of the last full layer before it, in
  the same forward). Default, as transformers' config derives it: from ``index_topk_pattern``
  (a string of ``F`` / ``S``, or a list of those names), else layer ``i`` is full when
  ``max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0`` (defaults 2 and 1: every
  layer full). DeepSeek-V3.2 runs an indexer on every layer.
* **MLP**: a dense SwiGLU MLP or DeepSeek-V3's mixture of experts per ``mlp_layer_types``
  (default: the first ``first_k_dense_replace`` layers dense; when both are given
  ``mlp_layer_types`` wins, as in transformers, whose saved configs hold both), router as
  DeepSeek-V3's.

**Cache.** The indexer's key is one row per token, like the latent: a layer with an indexer
caches ``[c, k_pe, index_k]`` (``kv_lora_rank + qk_rope_head_dim + index_head_dim`` = 704
values a token for DeepSeek-V3.2 and GLM-5; 85,888 bytes a token over DeepSeek-V3.2's 61 layers
in bfloat16, 109,824 over GLM-5's 78 with every layer full; a shared layer caches the 576
values of the latent alone), split into the key and value buffers as :mod:`.deepseek_v3` splits
its latent rows: the caches, their memory accounting, slots, prefix reuse and compiled rounds
work as they are.

**Selection.** Each forward, a layer with an indexer scores its query rows against the index
keys of the cache rows it views (query rows taken in chunks, about 2**25 scores held at once),
masks what the causal mask hides (in fixed-shape mode the unwritten rows too, whatever they
hold) and keeps the ``min(index_topk, viewed rows)`` best: masked rows rank last, so they are
kept only when fewer than ``index_topk`` rows are visible, and the causal mask still hides them.
Equal scores (the ReLU makes exact zeros possible) are kept lowest position first (a stable
sort, not ``topk``, whose choice among ties depends on the shape it runs on), so a query
chooses the same keys in a verify block as one token at a time: the choice depends only on its
causal prefix, and speculative decoding stays lossless. (transformers' ``topk`` picks among
exact ties as it happens to: only there can the two differ.) The attention's additive mask is
the causal one with the unchosen keys masked; shared layers reuse the last full layer's.

Checkpoints: as :mod:`.deepseek_v3` (per-expert weights stacked; the multi-token-prediction
layers ``model.layers.{num_hidden_layers + i}.*``, ``i < num_nextn_predict_layers`` (layer 61 of
DeepSeek-V3.2, 78 of GLM-5), not read; nor the indexer weights a checkpoint may hold for a
"shared" layer, which runs none; any other unknown weight refused). Fine-grained FP8
(DeepSeek-V3.2's and GLM-5-FP8's format) loads through :mod:`.fp8`, the indexer's FP8 linears
included (kept FP8 with ``--fp8 packed``, as every linear but ``kv_b_proj``); compressed-tensors
``pack-quantized`` integers through :mod:`.packed_int` likewise (``--int-weights packed``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import KVCache
from ..errors import DFlashError
from . import deepseek_v3, glm4_moe_lite
from .config import check_int
from .target import DecoderLayer, _Step

QUANTIZATION_METHODS = deepseek_v3.QUANTIZATION_METHODS
MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
INDEXER_TYPES = ("full", "shared")
PATTERN_LETTERS = {"F": "full", "S": "shared"}
GLM_ONLY_KEYS = ("indexer_types", "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset")
INDEX_KEY_EPS = 1e-6  # eps of the indexer's k_norm (a LayerNorm)
_SCORES_PER_CHUNK = 1 << 25  # indexer scores held at once (query rows are taken in chunks)
# transformers' DeepseekV32Config defaults, for keys a config.json leaves out (an explicit null stays null)
V32_DEFAULTS = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
                    n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
                    num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=163840, rms_norm_eps=1e-6,
                    bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, attention_bias=False,
                    first_k_dense_replace=3, index_topk=2048, index_head_dim=128, index_n_heads=64,
                    num_nextn_predict_layers=0)
# transformers' GlmMoeDsaConfig defaults (GLM-5's shapes; the rest inherited from DeepseekV32Config)
GLM_DEFAULTS = dict(V32_DEFAULTS, vocab_size=154880, hidden_size=6144, intermediate_size=12288, num_hidden_layers=78,
                    num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048, v_head_dim=256,
                    qk_nope_head_dim=192, n_group=1, topk_group=1, max_position_embeddings=202752, rms_norm_eps=1e-5,
                    index_n_heads=32)


@dataclasses.dataclass
class DsaConfig(deepseek_v3.DeepseekV3Config):
    """:class:`~dflash_torch.models.deepseek_v3.DeepseekV3Config` plus the indexer's shapes;
    ``indexer_full``: per layer, whether it runs an indexer (False: a GLM-MoE-DSA "shared"
    layer); ``index_interleave``: the indexer's RoPE rotates interleaved pairs (GLM-MoE-DSA)
    rather than consecutive halves (DeepSeek-V3.2)."""

    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 64
    indexer_full: list[bool] = dataclasses.field(default_factory=list)
    index_interleave: bool = False


def indexer_types(cfg: dict, glm: bool) -> list[bool]:
    """Which layers run an indexer (``cfg``: with the defaults filled in): every layer for
    ``deepseek_v32``; for ``glm_moe_dsa`` ``indexer_types``, else ``index_topk_pattern``, else
    ``index_topk_freq`` / ``index_skip_topk_offset``, as transformers' ``GlmMoeDsaConfig`` reads them.

    Raises:
        DFlashError: one line: a GLM-MoE-DSA key in a ``deepseek_v32`` config (transformers'
            DeepSeek-V3.2 ignores it); not ``num_hidden_layers`` values of ``"full"`` /
            ``"shared"`` (a pattern: ``F`` / ``S``); a first layer not full (nothing to share);
            a non-integer or non-positive ``index_topk_freq``, a non-integer offset.
    """
    layers = cfg["num_hidden_layers"]
    if not glm:
        given = [k for k in GLM_ONLY_KEYS if cfg.get(k) is not None]
        if given:
            raise DFlashError(f"target config.json {given[0]} is a glm_moe_dsa key; transformers' deepseek_v32 runs "
                              "an indexer on every layer and ignores it")
        return [True] * layers
    types, where = cfg.get("indexer_types"), "indexer_types"
    if types is None and cfg.get("index_topk_pattern") is not None:
        pattern, where = cfg["index_topk_pattern"], "index_topk_pattern"
        if isinstance(pattern, str):
            if any(c not in PATTERN_LETTERS for c in pattern):
                raise DFlashError(f"target config.json index_topk_pattern must be a string of 'F' (full) and 'S' "
                                  f"(shared), got {pattern!r}")
            types = [PATTERN_LETTERS[c] for c in pattern]
        else:
            types = pattern
    elif types is None:
        freq = check_int(cfg, "index_topk_freq", "target")
        offset = check_int(cfg, "index_skip_topk_offset", "target", minimum=-(1 << 62))
        freq = 1 if freq is None else freq
        offset = 2 if offset is None else offset
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
        where = f"index_topk_freq {freq} / index_skip_topk_offset {offset}"
    if not isinstance(types, list) or len(types) != layers or any(t not in INDEXER_TYPES for t in types):
        raise DFlashError(f"target config.json {where} must give 'full' or 'shared' for each of the {layers} layers, "
                          f"got {types!r}")
    if types and types[0] != "full":
        raise DFlashError(f"target config.json {where} makes layer 0 'shared': no full layer before it to share "
                          "the indexer's choice of")
    return [t == "full" for t in types]


def parse_config(cfg: dict) -> DsaConfig:
    """A ``deepseek_v32`` or ``glm_moe_dsa`` ``config.json`` -> :class:`DsaConfig` (keys left
    out take transformers' ``DeepseekV32Config`` / ``GlmMoeDsaConfig`` defaults; ``head_dim`` is
    ignored, as transformers sets it to ``qk_rope_head_dim``).

    Raises:
        DFlashError: one line: a null ``q_lora_rank`` (transformers' DSA attention always has
            the query's low rank); ``rope_interleave`` false (transformers' classes always
            interleave); a null or non-positive ``index_topk`` / ``index_head_dim`` /
            ``index_n_heads``; ``index_head_dim`` < ``qk_rope_head_dim``; an
            ``indexer_rope_interleave`` other than the model type's (true for ``glm_moe_dsa``,
            false for ``deepseek_v32``: transformers ignores the key, vLLM follows it); ``layer_types`` other
            than ``"indexed_attention"`` per layer; a null ``first_k_dense_replace`` without
            ``mlp_layer_types``; those of :func:`indexer_types`, of
            :func:`glm4_moe_lite.mlp_layer_types <dflash_torch.models.glm4_moe_lite.mlp_layer_types>`
            (not ``num_hidden_layers`` values of ``"dense"`` / ``"sparse"``)
            and of :func:`deepseek_v3.parse_config <dflash_torch.models.deepseek_v3.parse_config>`
            (routing, shapes, partial rotary factor, ...).
    """
    glm = cfg.get("model_type") == "glm_moe_dsa"
    text = {**(GLM_DEFAULTS if glm else V32_DEFAULTS), **cfg}
    layers = check_int(text, "num_hidden_layers", "target")
    if layers is None:
        raise DFlashError("target config.json has null num_hidden_layers")
    for key in ("q_lora_rank", "qk_rope_head_dim", "index_topk", "index_head_dim", "index_n_heads"):
        if text.get(key) is None:
            raise DFlashError(f"target config.json has null {key} (DeepSeek Sparse Attention needs it)")
        check_int(text, key, "target")
    if text.get("rope_interleave") not in (None, True):
        raise DFlashError(f"target config.json rope_interleave {text['rope_interleave']!r} is not supported: "
                          f"transformers' {cfg.get('model_type')} always rotates interleaved pairs")
    said = text.get("indexer_rope_interleave")
    if said is not None and said is not glm:
        raise DFlashError(f"target config.json indexer_rope_interleave {said!r} is not supported for "
                          f"{cfg.get('model_type')}: transformers' class rotates the indexer's channels "
                          f"{'in interleaved pairs' if glm else 'in consecutive halves'} whatever it says, vLLM "
                          "follows the key: the two would run different models")
    if text["index_head_dim"] < text["qk_rope_head_dim"]:
        raise DFlashError(f"target index_head_dim {text['index_head_dim']} < qk_rope_head_dim "
                          f"{text['qk_rope_head_dim']}: the indexer rotates its first qk_rope_head_dim channels")
    kinds = text.get("layer_types")
    if kinds is not None and kinds != ["indexed_attention"] * layers:
        raise DFlashError(f"target config.json layer_types must be 'indexed_attention' for each of the {layers} "
                          f"layers, got {kinds!r}")
    full = indexer_types(text, glm)
    if text.get("mlp_layer_types") is None:
        first = check_int(text, "first_k_dense_replace", "target", minimum=0)
        if first is None:
            raise DFlashError("target config.json has null first_k_dense_replace (and no mlp_layer_types)")
        dense = min(first, layers)
        text["mlp_layer_types"] = ["dense"] * dense + ["sparse"] * (layers - dense)
    # (mlp_layer_types wins over first_k_dense_replace, as in transformers, which saves both)
    sparse = glm4_moe_lite.mlp_layer_types({k: v for k, v in text.items() if k != "first_k_dense_replace"})
    # first_k_dense_replace only to satisfy deepseek_v3's parse: the layers are set from mlp_layer_types below
    dropped = ("mlp_layer_types", "layer_types", "rope_interleave", *GLM_ONLY_KEYS)
    base = deepseek_v3.parse_config({k: v for k, v in text.items() if k not in dropped} | {"first_k_dense_replace": 0})
    base.moe_layers = sparse
    return DsaConfig(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                     index_topk=text["index_topk"], index_head_dim=text["index_head_dim"],
                     index_n_heads=text["index_n_heads"], indexer_full=full, index_interleave=glm)


class Indexer(nn.Module):
    """The lightning indexer (see the module docstring). Hugging Face names: ``wq_b``,
    ``wk``, ``k_norm`` (weight and bias), ``weights_proj``."""

    def __init__(self, cfg: DsaConfig):
        super().__init__()
        self.heads, self.head_dim, self.top_k = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.rope_dim, self.interleave = cfg.qk_rope_head_dim, cfg.index_interleave
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEX_KEY_EPS)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.heads, bias=False)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE of the first ``qk_rope_head_dim`` channels of ``x`` ``[heads, T, index_head_dim]``."""
        rot, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([deepseek_v3.rotate(rot, cos, sin, self.interleave), rest], dim=-1)

    def key(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, hidden]`` -> the index keys ``[T, index_head_dim]`` (``x.dtype``), as cached."""
        return self._rope(self.k_norm(self.wk(x))[None], cos, sin)[0]

    def sparse_bias(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    keys: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """The attention's mask with the keys this indexer does not choose masked.

        Args:
            x: the layer's normed input rows ``[rows, hidden]`` (N sequences: theirs one after another).
            q_resid: ``q_a_layernorm(q_a_proj(x))`` ``[rows, q_lora_rank]``.
            cos, sin: the rows' RoPE tables ``[rows, qk_rope_head_dim]``.
            keys: the index keys of the viewed cache rows ``[N, Tk, index_head_dim]``.
            bias: the causal additive mask ``[rows, Tk]`` (N sequences: ``[N, rows / N, Tk]``),
                0 where visible, -inf elsewhere.

        Returns:
            ``bias``'s shape and dtype, -inf also at the visible keys outside a query's
            ``index_topk`` best (``bias`` itself when ``index_topk`` >= Tk: every key kept).
        """
        n, tk = keys.shape[0], keys.shape[1]
        if self.top_k >= tk:
            return bias
        mask = bias if bias.dim() == 3 else bias[None]
        rows = x.shape[0]
        tq = rows // n
        q = self._rope(self.wq_b(q_resid).view(rows, self.heads, self.head_dim).transpose(0, 1), cos, sin)
        q = q.transpose(0, 1).float().reshape(n, tq, self.heads, self.head_dim)
        weights = (self.weights_proj(x).float() * self.heads ** -0.5).view(n, tq, 1, self.heads)
        keys_t = keys.float().transpose(-1, -2)[:, None]  # [N, 1, D, Tk]
        step = max(1, _SCORES_PER_CHUNK // (n * self.heads * tk))
        scale = self.head_dim ** -0.5
        outs = []
        for start in range(0, tq, step):
            scores = F.relu(torch.matmul(q[:, start:start + step], keys_t) * scale)  # [N, chunk, Hi, Tk]
            index = torch.matmul(weights[:, start:start + step], scores).squeeze(-2)  # [N, chunk, Tk]
            hidden = mask[:, start:start + step] != 0
            index = index.masked_fill(hidden, float("-inf"))
            picks = index.sort(dim=-1, descending=True, stable=True).indices[..., :self.top_k]
            chosen = torch.zeros_like(hidden).scatter_(-1, picks, True)
            outs.append(mask[:, start:start + step].masked_fill(~chosen, float("-inf")))
        out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        return out if bias.dim() == 3 else out[0]


class SparseLatentAttention(deepseek_v3.LatentAttention):
    """DeepSeek-V3's latent attention plus the lightning indexer (``indexer``; None on a
    GLM-MoE-DSA "shared" layer). Its cache rows are ``[c, k_pe, index_k]`` (``[c, k_pe]`` without
    an indexer), their two halves in ``head_dim`` values each."""

    def __init__(self, cfg: DsaConfig, full: bool):
        super().__init__(cfg)
        self.indexer = Indexer(cfg) if full else None
        self.row_dim = self.latent_dim + (cfg.index_head_dim if full else 0)
        self.head_dim = -(-self.row_dim // 2)

    def index_keys(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The index keys of viewed cache rows (``k``, ``v``: the halves, ``[1, Tk, head_dim]``
        or ``[N, 1, Tk, head_dim]``) -> ``[N, Tk, index_head_dim]``."""
        if k.dim() == 3:
            k, v = k[None], v[None]
        start = self.latent_dim
        if start >= self.head_dim:  # (all in the second half)
            return v[:, 0, :, start - self.head_dim:self.row_dim - self.head_dim]
        return torch.cat([k[:, 0], v[:, 0]], dim=-1)[..., start:self.row_dim]


class Model(deepseek_v3.Model):
    """DeepSeek Sparse Attention decoder layers: latent attention with the lightning indexer
    (or a GLM-MoE-DSA shared layer's reuse of the last indexer's choice), then a dense MLP or
    DeepSeek-V3's mixture of experts; checkpoint names and loading as DeepSeek-V3's."""

    def make_layer(self, index: int, kind: str, slot: int) -> DecoderLayer:
        layer = super().make_layer(index, kind, slot)
        layer.self_attn = SparseLatentAttention(self.config, self.config.indexer_full[index])
        return layer

    @staticmethod
    def _shared_indexer(cfg: DsaConfig, key: str) -> bool:
        """Whether ``key`` is an indexer weight of a decoder layer that shares the choice of the
        last full layer (and so runs no indexer)."""
        if not key.startswith("model.layers.") or ".self_attn.indexer." not in key:
            return False
        index = key.split(".")[2]
        return index.isdigit() and int(index) < cfg.num_hidden_layers and not cfg.indexer_full[int(index)]

    @classmethod
    def checkpoint_keys(cls, cfg: DsaConfig, key: str) -> bool:
        """As DeepSeek-V3's (the multi-token-prediction layers are not read), and a "shared"
        layer's indexer weights are not read either: a checkpoint may keep every layer's indexer
        while its ``indexer_types`` has some layers reuse another's choice, which then never run
        (transformers builds no indexer on those layers and ignores the weights)."""
        return super().checkpoint_keys(cfg, key) and not cls._shared_indexer(cfg, key)

    @classmethod
    def check_skipped(cls, cfg: DsaConfig, skipped: set[str], model_dir) -> None:
        """DeepSeek-V3's check of the multi-token-prediction layers skipped (the shared layers'
        indexer weights are skipped by design)."""
        super().check_skipped(cfg, {k for k in skipped if not cls._shared_indexer(cfg, k)}, model_dir)

    @staticmethod
    def _self_attention(layer: DecoderLayer, h: torch.Tensor, kv: KVCache, step: _Step) -> torch.Tensor:
        attn = layer.self_attn
        cos, sin = step.rope[None]
        q_resid = attn.q_a_layernorm(attn.q_a_proj(h))
        q, latent = attn.project(h, cos, sin, q_resid)
        if attn.indexer is not None:
            latent = torch.cat([latent, attn.indexer.key(h, cos, sin)], dim=-1)
        kv.write(layer.slot, step.positions, *attn.halves(latent))
        k, v = kv.view(layer.slot, step.kv_len)
        if attn.indexer is not None:
            bias = attn.indexer.sparse_bias(h, q_resid, cos, sin, attn.index_keys(k, v), step.biases[None, 1])
            step.carried["dsa_bias"] = bias
        else:
            bias = step.carried["dsa_bias"]
        return attn.output(attn.attend(q, k, v, bias))
