"""poolside's Laguna DFlash drafters (``architectures: ["DFlashLagunaForCausalLM"]``).

No library runs this drafter on a CPU (speculators converts it into a plain DFlash drafter,
dropping its gate and aux norms; vLLM and SGLang need GPUs), so the oracle for the drafter
is a plain reference written here from the format's semantics (per-slice aux norms before
``fc``, context keys/values from each layer's input norm, the softplus output gate, the
causal sliding window), reading the weights from the checkpoint's safetensors; the oracle
for decoding is the target alone. The tiny checkpoints are laid out as the published ones
(fused ``qkv_proj``, no ``model.`` prefix, vLLM's config keys), scaled down to the tiny
Qwen3 target of conftest.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    MASK_ID,
    assert_same_weights,
    check_compiled_rounds_are_lossless,
    edited_checkpoint,
)
from safetensors.torch import load_file, save_file

from dflash_torch import DFlashEngine, DFlashError
from dflash_torch.batch import SlotKVCache
from dflash_torch.models.drafter_config import DrafterConfig
from dflash_torch.models.drafter import (
    DFlashDrafter,
    InjectedContext,
    RecomputedContext,
)
from dflash_torch.models.fusing import fuse_projections
from dflash_torch.models.laguna_drafter import LagunaDrafter

ATOL = 1e-5
B = 16
WINDOW = 8  # (binds: blocks anchored past it)
IDS = [0, 2, 3]  # target_layer_ids over the 4-layer target
ANCHORS = [3, 12, 27]


def laguna_config(target_dir: Path, *, gating="per-head", window: int = WINDOW, layers: int = 2, **extra) -> dict:
    """The published config.json of Laguna-XS-2.1-DFlash, scaled down to the target's shape."""
    t = json.loads((target_dir / "config.json").read_text())
    cfg = {"architectures": ["DFlashLagunaForCausalLM"], "model_type": "laguna", "hidden_size": t["hidden_size"],
           "intermediate_size": 96, "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "attention_bias": False, "hidden_act": "silu", "rms_norm_eps": 1e-6,
           "max_position_embeddings": 262144, "rope_theta": 500000.0, "sliding_window": window,
           "vocab_size": t["vocab_size"], "draft_vocab_size": t["vocab_size"], "torch_dtype": "bfloat16",
           "gating": gating, "layer_types": ["sliding_attention"] * layers, "num_experts": 0,
           "eagle_aux_hidden_state_layer_ids": [i + 1 for i in IDS],
           "dflash_config": {"block_size": B, "mask_token_id": MASK_ID, "num_target_layers": t["num_hidden_layers"],
                             "target_layer_ids": list(IDS), "causal": True}}
    cfg.update(extra)
    return cfg


def laguna_weights(cfg: dict, *, seed: int = 0, std: float = 0.08, norm_std: float = 0.3) -> dict[str, torch.Tensor]:
    """Random tensors named and laid out as the published checkpoints' (fused qkv_proj):
    matrices Normal(0, ``std``), norm weights 1 + Normal(0, ``norm_std``)."""
    g = torch.Generator().manual_seed(seed)
    H, nh, nkv, hd, I = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                          "intermediate_size"))
    k = len(cfg["dflash_config"]["target_layer_ids"])
    gate = {"per-head": nh, "per-element": nh * hd}.get(cfg["gating"])

    def mat(*shape):
        return torch.randn(*shape, generator=g) * std

    def norm(n):
        return 1 + norm_std * torch.randn(n, generator=g)

    w = {"fc.weight": mat(H, k * H), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    w.update({f"aux_hidden_norms.{j}.weight": norm(H) for j in range(k)})
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        w.update({p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H),
                  p + "self_attn.qkv_proj.weight": mat((nh + 2 * nkv) * hd, H), p + "self_attn.o_proj.weight": mat(H, nh * hd),
                  p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
                  p + "mlp.gate_proj.weight": mat(I, H), p + "mlp.up_proj.weight": mat(I, H), p + "mlp.down_proj.weight": mat(H, I)})
        if gate:
            w[p + "self_attn.g_proj.weight"] = mat(gate, H) * 5  # (gates well away from softplus(0))
    return w


def save_laguna(out: Path, cfg: dict, weights: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    return out


# --- the plain reference (no engine code: the checkpoint's tensors and the semantics) ---

def _rms(x, w, eps):
    x = x.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):  # x [T, heads, d], rotate-half over the whole head
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)).float()
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


def reference_logits(cfg: dict, w: dict, embed: torch.Tensor, lm_head: torch.Tensor, feats: torch.Tensor,
                     block: torch.Tensor, s: int, drop: tuple[str, ...] = ()) -> torch.Tensor:
    """Draft logits ``[B - 1, V]`` of the block ``block`` at ``[s, s + B)`` given the target
    features ``feats`` ``[s, k * H]`` of positions ``[0, s)``. ``drop``: Laguna parts to
    leave out (``gate``, ``aux``, ``context_norm``), to show that each one matters."""
    nh, nkv, hd, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    theta, window, gating = cfg["rope_theta"], cfg["sliding_window"], cfg["gating"]
    H = cfg["hidden_size"]
    k = feats.shape[1] // H
    parts = [feats[:, j * H:(j + 1) * H] for j in range(k)]
    if "aux" not in drop:
        parts = [_rms(p, w[f"aux_hidden_norms.{j}.weight"], eps) for j, p in enumerate(parts)]
    c = _rms(torch.cat(parts, 1) @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    x = embed[block]
    n = len(block)
    ctx_pos, blk_pos = torch.arange(s), torch.arange(s, s + n)
    k_pos = torch.cat([ctx_pos, blk_pos])
    visible = (k_pos[None] <= blk_pos[:, None]) & (k_pos[None] > blk_pos[:, None] - window)  # causal + window
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        qkv = w[p + "self_attn.qkv_proj.weight"]
        wq, wk, wv = qkv.split([nh * hd, nkv * hd, nkv * hd])
        ln = w[p + "input_layernorm.weight"]
        h = _rms(x, ln, eps)
        src = torch.cat([c if "context_norm" in drop else _rms(c, ln, eps), h])
        q = _rope(_rms((h @ wq.T).view(n, nh, hd), w[p + "self_attn.q_norm.weight"], eps), blk_pos, theta)
        kk = _rope(_rms((src @ wk.T).view(-1, nkv, hd), w[p + "self_attn.k_norm.weight"], eps), k_pos, theta)
        vv = (src @ wv.T).view(-1, nkv, hd)
        kk, vv = kk.repeat_interleave(nh // nkv, 1), vv.repeat_interleave(nh // nkv, 1)
        att = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(hd)
        att = torch.softmax(att.masked_fill(~visible, float("-inf")).float(), -1)
        out = torch.einsum("hqk,khd->qhd", att, vv)  # [n, heads, hd]
        if gating not in (False, "disabled") and "gate" not in drop:
            gate = F.softplus((h @ w[p + "self_attn.g_proj.weight"].T).float())
            out = out * (gate[..., None] if gating in (True, "per-head") else gate.view(n, nh, hd))
        x = x + out.reshape(n, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        y = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        x = x + (F.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return _rms(x, w["norm.weight"], eps)[1:] @ lm_head.T


# --- fixtures ---

@pytest.fixture(scope="module")
def target(tiny_pair):
    """The tiny Qwen3 target (tied embedding: its LM head is its table) and its table."""
    target_dir, _ = tiny_pair
    embed = load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"]
    return target_dir, embed


@pytest.fixture(scope="module", params=["per-head", "per-element", "disabled"])
def laguna(request, target, tmp_path_factory):
    target_dir, _ = target
    cfg = laguna_config(target_dir, gating=request.param)
    w = laguna_weights(cfg, seed=3)
    return cfg, w, save_laguna(tmp_path_factory.mktemp(f"laguna-{request.param}"), cfg, w)


def features(s: int, k: int = len(IDS), H: int = 64, seed: int = 1) -> torch.Tensor:
    return 3 * torch.randn(s, k * H, generator=torch.Generator().manual_seed(seed))  # (off the unit scale: norms matter)


def block_of(anchor_token: int, n: int = B) -> torch.Tensor:
    block = torch.full((n,), MASK_ID)
    block[0] = anchor_token
    return block


@torch.no_grad()
def ours(drafter, embed, feats, block, s, mode):
    """Our draft logits for the block at ``s`` over the context ``feats[:s]``, held as ``mode``."""
    n = len(block)
    positions = torch.arange(s, s + n)
    kv_len = s + n
    inject = None
    if mode == "recompute":
        ctx = RecomputedContext(drafter)
    elif mode == "ring":
        ctx = InjectedContext(drafter, max_rows=n)
    else:
        ctx = InjectedContext(drafter)
    if mode == "fused":  # (k_proj / v_proj joined, as the engine does on a GPU; the gate stays its own)
        drafter = copy.deepcopy(drafter)
        assert fuse_projections(drafter, query=False) > 0 and drafter.layers[0].self_attn.kv_proj is not None
    ctx.reset(96)
    if mode == "static":  # fixed shapes: the whole buffer under a mask, stale rows past the block
        for t in ctx.cache.k + ctx.cache.v:
            t.normal_()
        kv_len = None
    if mode == "folded":  # the last rows injected in the same pass as the block
        ctx.inject(drafter, feats[:s - 2], torch.arange(s - 2))
        inject = (feats[s - 2:s], torch.arange(s - 2, s))
    elif mode == "ring":  # injected n rows at a time
        for c0 in range(0, s, n):
            ctx.inject(drafter, feats[c0:min(s, c0 + n)], torch.arange(c0, min(s, c0 + n)))
        kv_len = None
    else:
        ctx.inject(drafter, feats[:s], torch.arange(s))
    hidden = drafter(embed[block], positions, ctx, kv_len, inject=inject)
    return hidden[1:] @ embed.T


MODES = ["slice", "static", "recompute", "folded", "ring", "fused"]


def test_the_published_config_reads_as_the_format_says(target):
    target_dir, _ = target
    cfg = DrafterConfig.from_dict(laguna_config(target_dir))
    assert cfg.laguna.gating == "per-head" and cfg.laguna.partial_rotary_factor == 1.0
    assert cfg.target_layer_ids == IDS and cfg.num_target_layers == 4 and cfg.vocab_size == 320
    assert cfg.sliding_windows == [WINDOW, WINDOW] and cfg.causal_layers == [True, True]
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is None and cfg.block_size == B
    published = dict(laguna_config(target_dir), hidden_size=2048, intermediate_size=8192, num_hidden_layers=5,
                     num_attention_heads=64, num_key_value_heads=8, head_dim=128, sliding_window=512,
                     vocab_size=100352, draft_vocab_size=100352, layer_types=["sliding_attention"] * 5,
                     eagle_aux_hidden_state_layer_ids=[2, 14, 26, 34, 40],
                     dflash_config={"block_size": 16, "mask_token_id": 12, "num_target_layers": 40,
                                    "target_layer_ids": [1, 13, 25, 33, 39], "causal": True})
    big = DrafterConfig.from_dict(published)
    with torch.device("meta"):
        names = set(LagunaDrafter(big).state_dict())
    fused = {n for n in names if not n.endswith(("k_proj.weight", "v_proj.weight"))}  # (q/k/v: one qkv_proj each)
    assert len(fused) == 58  # the XS-2.1 checkpoint's 58 tensors


def test_rope_resolution_per_layer_type(target):
    """vLLM's order: a per-type entry of nested rope_parameters (else full_attention's), a
    flat dict, swa_rope_parameters for sliding layers, the top level filling the gaps."""
    target_dir, _ = target

    def rope(**extra):
        cfg = DrafterConfig.from_dict(laguna_config(target_dir, **extra))
        return cfg.rope_theta, cfg.rope_scaling, cfg.laguna.partial_rotary_factor

    assert rope() == (500000.0, None, 1.0)
    nested = {"full_attention": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    assert rope(rope_parameters=nested) == (1e4, None, 1.0)
    assert rope(rope_parameters=nested, layer_types=["full_attention"] * 2) == (1e6, None, 0.5)
    assert rope(rope_parameters={"full_attention": nested["full_attention"]}) == (1e6, None, 0.5)
    assert rope(rope_parameters={"rope_type": "linear", "factor": 2.0}) == (500000.0, {"rope_type": "linear", "factor": 2.0}, 1.0)
    assert rope(swa_rope_parameters={"rope_type": "default", "rope_theta": 123.0}, partial_rotary_factor=0.5) == (123.0, None, 0.5)
    assert rope(swa_rope_parameters={"rope_theta": 7.0}, layer_types=["full_attention"] * 2) == (500000.0, None, 1.0)


@pytest.mark.parametrize("mode", MODES)
def test_draft_logits_equal_the_reference(laguna, target, mode):
    """Through the injected cache (a slice, fixed shapes with stale rows, injected in the
    same pass, rings) and the recomputed context, blocks before, at and past the window."""
    cfg, w, d = laguna
    _, embed = target
    drafter = DFlashDrafter.from_pretrained(d, torch.float32)
    assert isinstance(drafter, LagunaDrafter)
    feats = features(max(ANCHORS))
    worst = 0.0
    for s in ANCHORS:
        block = block_of(int(s * 7 % 300) + 2)
        got = ours(drafter, embed, feats, block, s, mode)
        ref = reference_logits(cfg, w, embed, embed, feats[:s], block, s)
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL, msg=f"{cfg['gating']} {mode} anchor {s}")
        worst = max(worst, float((got - ref).abs().max()))
    print(f"laguna {cfg['gating']} {mode}: max |ours - reference| = {worst:.2e}")


@torch.no_grad()
def test_batched_slot_cache_equals_the_reference(laguna, target):
    """Two sequences in a slot cache (fixed shapes, rings), blocks at different positions."""
    cfg, w, d = laguna
    _, embed = target
    drafter = DFlashDrafter.from_pretrained(d, torch.float32)
    starts, seeds = [12, 27], [5, 6]
    kv = SlotKVCache.allocate(cfg["num_hidden_layers"], 2, cfg["num_key_value_heads"], 96, cfg["head_dim"],
                              torch.float32, torch.device("cpu"), drafter.kv_windows(), max_rows=32)
    all_feats = [features(s, seed=seed) for s, seed in zip(starts, seeds)]
    for i, f in enumerate(all_feats):
        InjectedContext(drafter, kv.slot(i)).inject(drafter, f, torch.arange(len(f)))
    blocks = [block_of(40 + i) for i in range(2)]
    positions = torch.stack([torch.arange(s, s + B) for s in starts])
    hidden = drafter(embed[torch.cat(blocks)], positions, InjectedContext(drafter, kv.first(2)), None)
    got = hidden.view(2, B, -1)[:, 1:] @ embed.T
    for i, s in enumerate(starts):
        ref = reference_logits(cfg, w, embed, embed, all_feats[i], blocks[i], s)
        torch.testing.assert_close(got[i], ref, atol=ATOL, rtol=ATOL)


def test_each_laguna_part_matters(target, tmp_path):
    """The comparison has power: the reference without the gate, without the aux norms or
    without the context rows' input norm is far from our logits."""
    target_dir, embed = target
    cfg = laguna_config(target_dir)
    w = laguna_weights(cfg, seed=3)
    drafter = DFlashDrafter.from_pretrained(save_laguna(tmp_path / "d", cfg, w), torch.float32)
    feats = features(27)
    block = block_of(77)
    got = ours(drafter, embed, feats, block, 27, "slice")
    for part in ("gate", "aux", "context_norm"):
        off = (got - reference_logits(cfg, w, embed, embed, feats, block, 27, drop=(part,))).abs().max()
        assert off > 1e-2, part
    wide = dict(cfg, sliding_window=512)  # (and the window binds in these tests)
    assert (got - reference_logits(wide, w, embed, embed, feats, block, 27)).abs().max() > 1e-2


def test_prefix_and_separate_projections_load_the_same(target, tmp_path):
    """All names under ``model.`` (as SGLang reads them) and q/k/v stored separately give
    the same weights as the published layout."""
    target_dir, _ = target
    cfg = laguna_config(target_dir)
    w = laguna_weights(cfg, seed=4)
    base = DFlashDrafter.from_pretrained(save_laguna(tmp_path / "base", cfg, w), torch.float32).state_dict()
    prefixed = {"model." + k: v for k, v in w.items()}
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    separate = {}
    for k, v in w.items():
        if k.endswith("qkv_proj.weight"):
            for name, part in zip("qkv", v.split([q, kv, kv])):
                separate[k.replace("qkv_proj", f"{name}_proj")] = part.clone()
        else:
            separate[k] = v
    for name, state in (("prefixed", prefixed), ("separate", separate),
                        ("both", {"model." + k: v for k, v in separate.items()})):
        other = DFlashDrafter.from_pretrained(save_laguna(tmp_path / name, cfg, state), torch.float32).state_dict()
        assert_same_weights(other, base, name)


def _prefixed_without(w: dict, name: str) -> None:
    """Every name under ``model.``, and ``name`` gone."""
    for k in list(w):
        w["model." + k] = w.pop(k)
    del w["model." + name]


REFUSALS = {
    "mixed layer types": (dict(layer_types=["sliding_attention", "full_attention"]), None,
                          "layer_types mixes \\['full_attention', 'sliding_attention'\\]"),
    "eagle ids": (dict(eagle_aux_hidden_state_layer_ids=[0, 2, 3]), None,
                  "eagle_aux_hidden_state_layer_ids \\[0, 2, 3\\] are not dflash_config.target_layer_ids"),
    "experts": (dict(num_experts=8), None, "num_experts 8; only dense drafters"),
    "ids out of order": (dict(dflash_config={"block_size": B, "mask_token_id": MASK_ID, "target_layer_ids": [3, 2, 0],
                                             "causal": True}, eagle_aux_hidden_state_layer_ids=[4, 3, 1]), None,
                         "target_layer_ids \\[3, 2, 0\\] must be increasing"),
    "ids repeated": (dict(dflash_config={"block_size": B, "mask_token_id": MASK_ID, "target_layer_ids": [2, 2, 3],
                                         "causal": True}, eagle_aux_hidden_state_layer_ids=None), None,
                     "target_layer_ids \\[2, 2, 3\\] must be increasing"),
    "no dflash_config": (dict(dflash_config=None), None, "lacks dflash_config \\(its block_size"),
    "causal not a bool": (dict(dflash_config={"block_size": B, "mask_token_id": MASK_ID, "target_layer_ids": IDS,
                                              "causal": "yes"}), None,
                          "dflash_config.causal must be true or false, got 'yes'"),
    "draft vocabulary": (dict(draft_vocab_size=256), None, "draft_vocab_size 256 != vocab_size 320"),
    "gating": (dict(gating="per-token"), None, "gating must be true, false, 'per-head', 'per-element' or 'disabled'"),
    "fused and separate": (None, lambda w: w.update({"layers.1.self_attn.k_proj.weight": torch.zeros(32, 64)}),
                           "has both layers.1.self_attn.qkv_proj.weight and layers.1.self_attn.k_proj.weight"),
    "unknown tensor": (None, lambda w: w.update({"layers.0.self_attn.sinks": torch.zeros(4)}),
                       "weights a Laguna DFlash drafter does not use \\(an unsupported variant\\?\\): layers.0.self_attn.sinks"),
    "missing aux norm": (None, lambda w: w.pop("aux_hidden_norms.2.weight"), "lacks weights: aux_hidden_norms.2.weight"),
    "fc width": (None, lambda w: w.update({"fc.weight": torch.zeros(64, 128)}),
                 "drafter weight fc.weight has shape \\(64, 128\\), config implies \\(64, 192\\)"),
    "prefixed, missing": (None, lambda w: _prefixed_without(w, "hidden_norm.weight"), "lacks weights: model.hidden_norm.weight"),
    "prefix on some names": (None, lambda w: w.update({"model.norm.weight": w.pop("norm.weight")}),
                             "names some weights under 'model.' and some not \\(aux_hidden_norms.0.weight"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals_are_one_line(case, target, tmp_path):
    target_dir, _ = target
    config, state, message = REFUSALS[case]
    cfg = laguna_config(target_dir)
    w = laguna_weights(cfg)
    src = save_laguna(tmp_path / "src", cfg, w)
    d = edited_checkpoint(src, tmp_path / "d", config=(lambda c: c.update(config)) if config else None, state=state)
    with pytest.raises(DFlashError, match=message) as err:
        DFlashEngine.from_pretrained(target_dir, d)
    assert "\n" not in str(err.value)


def test_pairing_writing_and_training_are_refused(target, tmp_path):
    """A vocabulary other than the target's is refused at pairing (it drafts through the
    target's LM head); its config has no DFlash-format config.json to write, and training
    does not start from it."""
    from dflash_torch.models.config import TargetConfig
    from dflash_torch.training.trainer import TrainConfig, load_init_drafter

    target_dir, _ = target
    good = save_laguna(tmp_path / "good", laguna_config(target_dir), laguna_weights(laguna_config(target_dir)))
    train = TrainConfig(target=str(target_dir), data=[], out=str(tmp_path / "out"), init_from=str(good))
    with pytest.raises(DFlashError, match="is a Laguna DFlash drafter; dflash-torch trains DFlash-format drafters"):
        load_init_drafter(train, TargetConfig.from_dict(json.loads((target_dir / "config.json").read_text())))
    cfg = laguna_config(target_dir, vocab_size=400, draft_vocab_size=400)
    d = save_laguna(tmp_path / "d", cfg, laguna_weights(cfg))
    with pytest.raises(DFlashError, match="drafter draft_vocab_size 400 != target vocab_size 320"):
        DFlashEngine.from_pretrained(target_dir, d)
    with pytest.raises(DFlashError, match="no DFlash-format config.json"):
        DrafterConfig.from_dict(laguna_config(target_dir)).to_dict()


@pytest.fixture(scope="module")
def engines(agree_pair, tmp_path_factory):
    """Target-only decoding and speculative decoding with a Laguna drafter (a window of 8)
    on conftest's agreeable target: its small random weights keep its drafts near the
    target's favourite token, so rounds accept from none to a whole block."""
    target_dir, _ = agree_pair
    cfg = laguna_config(target_dir)
    d = save_laguna(tmp_path_factory.mktemp("laguna-engine"), cfg, laguna_weights(cfg, seed=2, std=0.02, norm_std=0.1))
    spec = DFlashEngine.from_pretrained(target_dir, d)
    assert isinstance(spec.drafter, LagunaDrafter)
    return spec, DFlashEngine(spec.target, spec.tokenizer)


@pytest.mark.parametrize("block_size", [B, 4])
def test_speculative_decoding_equals_the_target_alone(engines, block_size):
    """Greedy: one sequence (eager, recompute, fixed shapes) and a batch of two give the
    target-only tokens; sampling with top_k 1 too. Seeded sampling: the same tokens from
    the injected and the recomputed context."""
    spec, alone = engines
    prompts = ["def f(x):", "import os\nimport sys\n"]
    kw = dict(max_new_tokens=40, ignore_eos=True)
    refs = [alone.generate(p, **kw).token_ids for p in prompts]
    taus = []
    variants = [DFlashEngine(spec.target, spec.tokenizer, spec.drafter, block_size=block_size),
                DFlashEngine(spec.target, spec.tokenizer, spec.drafter, block_size=block_size, draft_mode="recompute"),
                DFlashEngine(spec.target, spec.tokenizer, spec.drafter, block_size=block_size, static=True, max_context=128)]
    for prompt, ref in zip(prompts, refs):
        for engine in variants:
            out = engine.generate(prompt, **kw)
            assert out.token_ids == ref
            taus += out.stats.acceptance_lengths
        assert variants[0].generate(prompt, temperature=0.8, top_k=1, seed=3, **kw).token_ids == ref
        sampled = [e.generate(prompt, temperature=0.8, seed=5, **kw).token_ids for e in variants[:2]]
        assert sampled[0] == sampled[1]
    batch = DFlashEngine(spec.target, spec.tokenizer, spec.drafter, block_size=block_size, max_batch_size=2, max_context=128)
    assert [o.token_ids for o in batch.generate_batch(prompts, **kw)] == refs
    assert sum(taus) / len(taus) > 1.5 and len(set(taus)) >= 3, sorted(set(taus))  # (drafts were accepted)


def test_compiled_rounds_are_lossless(engines, agree_pair, tmp_path):
    """Compiled rounds (torch.compile, eager backend) commit the eager decoder's tokens, with
    no recompilation after warm-up and no graph break (the gate traces with the rest)."""
    target_dir, _ = agree_pair
    cfg = laguna_config(target_dir)
    d = save_laguna(tmp_path / "d", cfg, laguna_weights(cfg, seed=2, std=0.02, norm_std=0.1))
    check_compiled_rounds_are_lossless(target_dir, d)


def test_the_published_pairing_laguna_target_and_laguna_drafter(tmp_path, tokenizer_dir):
    """The pair as poolside publishes it: a Laguna target (``laguna``: per-layer query heads,
    gated attention, RoPE per layer type, experts) with a Laguna DFlash drafter reading its
    layers 0, 2 and 3. Greedy speculative decoding (eager, fixed shapes, a batch of two, block
    sizes 16 and 4) gives the target-only tokens, and drafts are accepted."""
    from conftest import make_agreeable
    from test_laguna import make_laguna_target

    target_dir, _ = make_agreeable(make_laguna_target(tmp_path / "target", seed=1), tokenizer_dir, tmp_path, "laguna")
    cfg = laguna_config(target_dir)
    d = save_laguna(tmp_path / "laguna-drafter", cfg, laguna_weights(cfg, seed=2, std=0.02, norm_std=0.1))
    spec = DFlashEngine.from_pretrained(target_dir, d)
    assert isinstance(spec.drafter, LagunaDrafter) and spec.target.config.model_type == "laguna"
    alone = DFlashEngine(spec.target, spec.tokenizer)
    prompts = ["def f(x):", "import os\nimport sys\n"]
    kw = dict(max_new_tokens=32, ignore_eos=True)
    refs = [alone.generate(p, **kw).token_ids for p in prompts]
    taus = []
    for block_size in (B, 4):
        for engine in (DFlashEngine(spec.target, spec.tokenizer, spec.drafter, block_size=block_size),
                       DFlashEngine(spec.target, spec.tokenizer, spec.drafter, block_size=block_size, static=True,
                                    max_context=128)):
            for prompt, ref in zip(prompts, refs):
                out = engine.generate(prompt, **kw)
                assert out.token_ids == ref
                taus += out.stats.acceptance_lengths
        batch = DFlashEngine(spec.target, spec.tokenizer, spec.drafter, block_size=block_size, max_batch_size=2,
                             max_context=128)
        assert [o.token_ids for o in batch.generate_batch(prompts, **kw)] == refs
    assert sum(taus) / len(taus) > 1.4 and len(set(taus)) >= 3, sorted(set(taus))  # (drafts were accepted: tau 1.82)
