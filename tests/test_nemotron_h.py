"""Nemotron-H targets (``nemotron_h``: Mamba-2 + NoPE attention + relu2 MLP + non-gated MoE
blocks) against transformers' own ``NemotronHForCausalLM``.

* our forward == transformers' (logits and every block's output, float32): one pass over more
  than one 64-token chunk, in pieces through the cache (eager and fixed shapes), a deferred
  verify committed in part then single tokens; patterns with all four block kinds, MoE with
  and without the latent projection, with and without expert groups;
* both checkpoint layouts (NVIDIA's ``backbone.`` with per-expert weights, transformers'
  ``model.`` with stacked ones) load the same model;
* Mamba-2 rollback: the state after a verify block and a commit of its first n rows == the
  state after feeding only those n rows, for every n; batched == one sequence at a time;
* greedy speculative decoding == transformers' greedy ``generate`` (block sizes 2..16,
  recompute, fixed shapes, a batch of two); an agreeable pair whose rounds accept many
  tokens is lossless eager, chunked, fixed-shape, batched and compiled (no recompiles);
* refusals in one line; the published Nemotron 3 Nano 30B-A3B config reads as transformers
  reads it (and builds the same parameter count).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import (EOS_ID, VOCAB, added_tensor, check_compiled_rounds_are_lossless, check_forward_matches_transformers,
                      check_greedy_equals_transformers, check_many_accepted_tokens_are_lossless, check_rollback,
                      copy_tokenizer, drafter_config, edited_checkpoint, incremental_logits, load_hf, save_drafter)
from dflash_torch import DFlashError
from dflash_torch.cache import RecurrentState
from dflash_torch.models import nemotron_h
from dflash_torch.models.config import TargetConfig
from dflash_torch.models.target import TargetModel

# two tiny shapes: every block kind, MoE with a latent projection and 2 expert groups (top 1 group),
# and MoE in the model width without groups
SHAPES = {
    "latent-groups": dict(hybrid_override_pattern="M*E-ME*M", moe_latent_size=24, n_group=2, topk_group=1),
    "plain": dict(hybrid_override_pattern="ME*M-EM", n_group=1, topk_group=1),
}
H = 64


def make_nemotron_target(out_dir: Path, *, seed: int = 0, layout: str = "backbone", **overrides) -> Path:
    """Save a tiny random Nemotron-H with transformers' own class (NVIDIA's ``backbone.`` names,
    per-expert weights, as its ``save_pretrained`` writes them), or with ``layout="model"``
    rewritten into transformers' in-memory names (``model.``, stacked experts)."""
    import transformers

    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              intermediate_size=96, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16, conv_kernel=4,
              chunk_size=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              moe_shared_expert_intermediate_size=48, routed_scaling_factor=2.0, max_position_embeddings=1024,
              eos_token_id=EOS_ID, bos_token_id=EOS_ID, pad_token_id=EOS_ID, tie_word_embeddings=False)
    kw.update(overrides)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**kw)).eval()
    with torch.no_grad():  # dt_bias around 0: softplus(dt) stays far above time_step_min, where transformers'
        # prompt path clamps (see mamba2.py; test_small_time_steps_are_not_clamped)
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif name.endswith(("A_log", "dt_bias", "D", "e_score_correction_bias")):
                p.normal_(0, 0.5)
            elif name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.normal_(1, 0.1)
            else:
                p.normal_(0, 0.1)
    model.save_pretrained(str(out_dir))
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = len(cfg["layers_block_type"])  # (for the test drafters' config)
    (out_dir / "config.json").write_text(json.dumps(cfg))
    if layout == "model":
        state = load_file(str(out_dir / "model.safetensors"))
        state = {("model." + k[len("backbone."):] if k.startswith("backbone.") else k): v for k, v in state.items()}
        nemotron_h._stack_experts(state, kw["n_routed_experts"])
        save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "model.safetensors"),
                  metadata={"format": "pt"})
    return Path(out_dir)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir) -> dict:
    """shape -> (target_dir, random drafter_dir)."""
    out = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        root = tmp_path_factory.mktemp(name)
        target = make_nemotron_target(root / "target", seed=i, **shape)
        copy_tokenizer(tokenizer_dir, target)
        out[name] = target, save_drafter(root / "drafter", drafter_config(target, block_size=16), seed=i)
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_transformers(checkpoints, shape):
    target_dir, _ = checkpoints[shape]
    hf, ours = load_hf(target_dir), TargetModel.from_pretrained(target_dir, torch.float32)
    assert ours.config.model_type == "nemotron_h" and ours.recurrent
    L = ours.config.num_hidden_layers
    ids = torch.randint(2, VOCAB, (90,), generator=torch.Generator().manual_seed(1))  # > one 64-token chunk
    with torch.no_grad():
        ref = hf(ids[None], output_hidden_states=True)
        cache = ours.new_cache()
        cache.reset(128)
        logits, feats = ours(ids, torch.arange(90), cache, 90, list(range(L)))
    torch.testing.assert_close(logits, ref.logits[0], rtol=1e-4, atol=1e-4)
    for layer in range(L):  # (block l's output: hidden_states[l + 1]; the last one after the final norm)
        torch.testing.assert_close(feats[:, layer * H:(layer + 1) * H], ref.hidden_states[layer + 1][0],
                                   rtol=1e-4, atol=1e-4)
    # pieces through the cache, eager and fixed shapes (attending over the whole preallocated buffer)
    for static in (False, True):
        check_forward_matches_transformers(ours, hf, ids[:60], [23, 16, 1, 1, 19], static)
    # a prefill chunk, a deferred verify block committed in part, single tokens
    torch.testing.assert_close(incremental_logits(ours, ids), ref.logits[0, :60], rtol=1e-4, atol=1e-4)


def test_both_checkpoint_layouts_load_the_same_model(checkpoints, tmp_path):
    """transformers' names with stacked experts load exactly as NVIDIA's ``backbone.`` names with
    per-expert weights."""
    nvidia = TargetModel.from_pretrained(checkpoints["latent-groups"][0], torch.float32)
    hf_layout = make_nemotron_target(tmp_path / "t", seed=0, layout="model", **SHAPES["latent-groups"])
    assert not any(k.startswith("backbone.") for k in load_file(str(hf_layout / "model.safetensors")))
    ours = TargetModel.from_pretrained(hf_layout, torch.float32)
    a, b = nvidia.state_dict(), ours.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert nvidia.config.checkpoint_prefix == "backbone." and ours.config.checkpoint_prefix == "model."


@pytest.mark.parametrize("shape", SHAPES)
def test_rollback_equals_feeding_only_the_accepted_tokens(checkpoints, shape):
    model = TargetModel.from_pretrained(checkpoints[shape][0], torch.float32)
    check_rollback(model, torch.randint(2, VOCAB, (60,), generator=torch.Generator().manual_seed(2)), range(1, 17))


def test_batched_mamba2_equals_one_sequence_at_a_time(checkpoints):
    """One Mamba-2 layer over N sequences at once == over each alone: a prefill chunk committed
    over a different count per sequence (past a 64-token chunk), a deferred verify block from
    those states and a commit of a different accepted count per sequence (0: unchanged)."""
    model = TargetModel.from_pretrained(checkpoints["latent-groups"][0], torch.float32)
    layer = next(layer for layer in model.model.layers if layer.kind == "linear_attention")
    mixer, slot = layer.linear_attn, layer.slot
    N, P, B = 4, 70, 16
    prefill_rows, accepted_rows = torch.tensor([3, 70, 20, 9]), torch.tensor([1, 16, 7, 0])
    g = torch.Generator().manual_seed(4)
    prompts, blocks = torch.randn(N, P, H, generator=g), torch.randn(N, B, H, generator=g)
    batched = RecurrentState(torch.float32, "cpu", N)
    alone = [RecurrentState(torch.float32, "cpu") for _ in range(N)]
    for state in [batched] + alone:
        for other in model.model.layers:
            if other.kind == "linear_attention":
                other.linear_attn.new_state(state)
    with torch.no_grad():
        out = mixer(prompts.view(N * P, -1), batched, slot, commit=prefill_rows)
        ref = [mixer(prompts[i], alone[i], slot, commit=int(prefill_rows[i])) for i in range(N)]
        for i in range(N):  # (rows past a sequence's committed count are not used)
            torch.testing.assert_close(out.view(N, P, -1)[i, :prefill_rows[i]], ref[i][:prefill_rows[i]],
                                       rtol=1e-5, atol=1e-6)
        out = mixer(blocks.view(N * B, -1), batched, slot, defer=True)
        ref = [mixer(blocks[i], alone[i], slot, defer=True) for i in range(N)]
        torch.testing.assert_close(out, torch.cat(ref), rtol=1e-5, atol=1e-6)
        before = alone[3].ssm[slot].clone()
        mixer.commit(batched, slot, accepted_rows)
        for i in range(N):
            if accepted_rows[i] > 0:
                mixer.commit(alone[i], slot, accepted_rows[i])
    assert torch.equal(alone[3].ssm[slot], before)
    for i in range(N):
        assert torch.equal(batched.conv[slot][i], alone[i].conv[slot][0])
        torch.testing.assert_close(batched.ssm[slot][i], alone[i].ssm[slot][0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_speculative_equals_transformers_generate(checkpoints, shape):
    check_greedy_equals_transformers(*checkpoints[shape])


@pytest.fixture(scope="module")
def agreeable(tmp_path_factory, tokenizer_dir):
    """A Nemotron-H target whose random drafter agrees with it often (conftest's recipe: a
    shared direction u in every token embedding, the agree token's head row ``5 u``)."""
    from dflash_torch.models.drafter import DFlashDrafter

    root = tmp_path_factory.mktemp("agree-nemotron")
    target = make_nemotron_target(root / "target", seed=1, **SHAPES["latent-groups"])
    state = load_file(str(target / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    u = torch.randn(H, generator=g)
    u /= u.norm()
    scale = torch.rand(VOCAB, 1, generator=g) * 2
    scale[42] = 0.5  # (tuned: runs of the agree token of varied length)
    state["backbone.embeddings.weight"] += 4.0 * scale * u
    state["lm_head.weight"][42] = 5.0 * u
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    copy_tokenizer(tokenizer_dir, target)
    cfg = drafter_config(target, block_size=16)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    return target, save_drafter(root / "drafter", cfg, drafter.state_dict())


def test_partial_acceptance_rounds_are_lossless(agreeable):
    """Many tokens accepted per round at varied lengths (the Mamba-2 states rolled back to many
    points of a block): eager, chunked prefill, fixed shapes and batched == transformers."""
    check_many_accepted_tokens_are_lossless(*agreeable)


def test_compiled_rounds_do_not_recompile(agreeable):
    check_compiled_rounds_are_lossless(*agreeable)


def _edit(key, value):
    def edit(cfg):
        cfg[key] = value
    return edit


@pytest.mark.parametrize("edit, message", [
    (_edit("layers_block_type", ["mamba", "conv"]), "layers_block_type must be a non-empty list"),
    (lambda c: (c.pop("layers_block_type"), c.update(hybrid_override_pattern="M*X-")), "hybrid_override_pattern must be"),
    (_edit("n_groups", 3), "n_groups 3 must divide mamba_num_heads 8"),
    (_edit("time_step_limit", [0.01, 10.0]), "time_step_limit"),
    (_edit("sliding_window", 128), "sliding_window 128 is not supported"),
    (_edit("attention_bias", True), "attention_bias true is not supported"),
    (_edit("mlp_hidden_act", "silu"), "mlp_hidden_act 'silu' is not supported"),
    (_edit("mamba_hidden_act", "gelu"), "mamba_hidden_act 'gelu' is not supported"),
    (_edit("n_group", 3), "n_group 3 must split n_routed_experts 8"),
    (_edit("num_experts_per_tok", 5), "num_experts_per_tok 5 and topk_group 1 must fit"),
    (_edit("mamba_head_dim", "8"), "mamba_head_dim must be an integer"),
    (_edit("quantization_config", {"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}), "quant_algo 'W4A8_AWQ'"),
    (_edit("quantization_config", {"quant_method": "fp8", "weight_block_size": [128, 128]}), "quant_method 'fp8'"),
])
def test_bad_configs_are_refused_in_one_line(checkpoints, tmp_path, edit, message):
    target = edited_checkpoint(checkpoints["latent-groups"][0], tmp_path / "t", config=edit)
    with pytest.raises(DFlashError) as err:
        TargetModel.from_pretrained(target, torch.float32)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("edit, message", [
    (added_tensor("backbone.layers.1.mixer.q_proj.bias", (64,)), "does not use"),  # attention biases: not in transformers
    (added_tensor("mtp.layers.0.eh_proj.weight"), "does not use"),  # MTP weights, not announced
    (added_tensor("backbone.layers.8.norm.weight"), "does not use"),  # a block past the pattern
    (lambda s: s.pop("backbone.layers.2.mixer.experts.3.up_proj.weight"), "experts [3] lack up_proj.weight"),
    (lambda s: s.pop("backbone.layers.0.mixer.D"), "lacks weights: backbone.layers.0.mixer.D"),
    (lambda s: s.update({"model.embeddings.weight": s["backbone.embeddings.weight"].clone()}), "holds model.embeddings.weight twice"),
])
def test_bad_checkpoints_are_refused_in_one_line(checkpoints, tmp_path, edit, message):
    target = edited_checkpoint(checkpoints["latent-groups"][0], tmp_path / "t", state=edit)
    with pytest.raises(DFlashError) as err:
        TargetModel.from_pretrained(target, torch.float32)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_announced_mtp_weights_are_skipped(checkpoints, tmp_path):
    src = checkpoints["latent-groups"][0]
    target = edited_checkpoint(src, tmp_path / "t", config=_edit("num_nextn_predict_layers", 1),
                               state=added_tensor("mtp.layers.0.eh_proj.weight"))
    a, b = TargetModel.from_pretrained(src, torch.float32), TargetModel.from_pretrained(target, torch.float32)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# NVIDIA-Nemotron-3-Nano-30B-A3B's config.json as published (the keys that shape the model)
NANO = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 131072, "hidden_size": 2688,
    "intermediate_size": 1856, "num_hidden_layers": 52, "max_position_embeddings": 262144,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", "num_attention_heads": 32,
    "num_key_value_heads": 2, "head_dim": 128, "attention_bias": False, "mamba_num_heads": 64, "mamba_head_dim": 64,
    "ssm_state_size": 128, "conv_kernel": 4, "chunk_size": 128, "n_groups": 8, "expand": 2, "n_routed_experts": 128,
    "n_shared_experts": 1, "num_experts_per_tok": 6, "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True, "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712,
    "time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 0.0001, "layer_norm_epsilon": 1e-05,
    "norm_eps": 1e-05, "mamba_hidden_act": "silu", "mlp_hidden_act": "relu2", "mamba_proj_bias": False,
    "mamba_ssm_cache_dtype": "float32", "mlp_bias": False, "use_bias": False, "use_conv_bias": True,
    "residual_in_fp32": False, "rescale_prenorm_residual": True, "sliding_window": None, "partial_rotary_factor": 1.0,
    "rope_theta": 10000, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}


def test_published_nano_config_reads_as_transformers_reads_it():
    import transformers

    theirs = transformers.NemotronHConfig(**{k: v for k, v in NANO.items() if k not in ("architectures", "model_type")})
    ours = TargetConfig.from_dict(NANO)
    assert ours.num_hidden_layers == theirs.num_hidden_layers == 52
    assert list(ours.block_types) == theirs.layers_block_type
    assert ours.block_types.count("linear_attention") == 23 and ours.block_types.count("moe") == 23
    assert [i for i, t in enumerate(ours.layer_types) if t == "full_attention"] == [5, 12, 19, 26, 33, 42]
    for key in ("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel", "head_dim",
                "num_key_value_heads", "n_group", "topk_group", "routed_scaling_factor"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert (ours.moe.num_experts, ours.moe.top_k, ours.moe.intermediate_size, ours.moe.shared_expert_intermediate_size) \
        == (theirs.n_routed_experts, theirs.num_experts_per_tok, theirs.moe_intermediate_size,
            theirs.moe_shared_expert_intermediate_size)
    assert ours.rms_norm_eps == theirs.layer_norm_epsilon and ours.moe_latent_size is None
    # the same parameters, shape for shape (built on the meta device)
    with torch.device("meta"):
        mine = nemotron_h.Model(ours)
        reference = transformers.NemotronHForCausalLM(theirs)
    shapes = {nemotron_h.Model.checkpoint_name(ours, k): tuple(v.shape) for k, v in mine.state_dict().items()}
    ref = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    assert shapes == ref
    assert sum(v.numel() for v in mine.state_dict().values()) == 31_577_940_288  # (the "31.6B total" of its card)


def test_small_time_steps_are_not_clamped(checkpoints, tmp_path):
    """Heads whose ``softplus(dt + dt_bias)`` falls below ``time_step_min`` (0.001): our logits
    are transformers' with the time-step limit ``[0, inf)`` (NVIDIA's reference code, vLLM, and
    transformers' own default since it dropped the floor at ``time_step_min`` its prompt path
    had), and that floor would have changed them."""
    target_dir, _ = checkpoints["plain"]

    def small_steps(w):
        for key in [k for k in w if k.endswith("mixer.dt_bias")]:
            w[key][::2] = -9.0  # (softplus ~ 1.2e-4 on every other head)

    target = edited_checkpoint(target_dir, tmp_path / "small-dt", state=small_steps)
    ids = torch.randint(2, VOCAB, (40,), generator=torch.Generator().manual_seed(2))
    hf, ours = load_hf(target), TargetModel.from_pretrained(target, torch.float32)
    mixers = [module for module in hf.modules() if hasattr(module, "time_step_limit")]
    assert mixers
    with torch.no_grad():
        logits_with = {}
        for limit in ((hf.config.time_step_min, float("inf")), (0.0, float("inf"))):
            for module in mixers:  # (set both ways: transformers' default limit changed between versions)
                module.time_step_limit = limit
            logits_with[limit[0]] = hf(ids[None]).logits[0]
        floored, unclamped = logits_with[hf.config.time_step_min], logits_with[0.0]
        cache = ours.new_cache()
        cache.reset(64)
        logits, _ = ours(ids, torch.arange(40), cache, 40)
    torch.testing.assert_close(logits, unclamped, rtol=1e-4, atol=1e-4)
    assert (logits - floored).abs().max() > 1e-3


def test_init_from_target_where_the_first_copied_block_has_no_input_norm(tmp_path):
    """``train --init-from-target``'s layer copy on a Nemotron-H whose block ``l0`` (the
    first the drafter would copy) is an MLP block and whose features include block
    ``l0 - 1``: ``fc`` starts as the selection of that slice, and ``hidden_norm`` keeps its
    fresh initialisation (an MLP block has no norm before an attention; it used to fail
    with an AttributeError); the drafter's layer (of another kind) is left as it was."""
    from dflash_torch.models.drafter import DFlashDrafter
    from dflash_torch.training.objective import copy_target_layers

    target_dir = make_nemotron_target(tmp_path / "t", hybrid_override_pattern="M*E-", n_group=1, topk_group=1)
    target = TargetModel.from_pretrained(target_dir, torch.float32)
    assert target.model.layers[3].input_layernorm is None
    drafter = DFlashDrafter(drafter_config(target_dir, num_layers=1, target_layer_ids=[2]))
    fresh = {k: v.clone() for k, v in drafter.state_dict().items()}
    copy_target_layers(drafter, target)
    assert torch.equal(drafter.fc.weight, torch.eye(H)) and torch.equal(drafter.hidden_norm.weight, fresh["hidden_norm.weight"])
    assert all(torch.equal(v, fresh["layers.0." + k]) for k, v in drafter.layers[0].state_dict().items())
    torch.testing.assert_close(drafter.norm.weight, target.model.norm.weight)


@pytest.mark.parametrize("pattern", ["MMMM", "M-ME"])
def test_batches_of_a_target_with_no_attention_layer(tmp_path, tokenizer_dir, pattern):
    """A target with no attention block (no K/V cache at all): batched engines, with a drafter
    and target-only, give the single-sequence greedy tokens (those of transformers' forward
    without a cache: its ``generate`` needs an attention layer), and a second call whose
    prompts extend the first's reuses their rows (each slot's recurrent checkpoint). Batched
    engines (every server) used to fail building their slot caches with an IndexError."""
    from dflash_torch import DFlashEngine

    target = make_nemotron_target(tmp_path / "t", hybrid_override_pattern=pattern, n_group=1, topk_group=1)
    copy_tokenizer(tokenizer_dir, target)
    drafter = save_drafter(tmp_path / "d", drafter_config(target, block_size=8))
    spec = DFlashEngine.from_pretrained(target, drafter)
    assert spec.target.num_kv_layers == 0
    first = [[5, 17, 99, 3], list(range(2, 30))]
    second = [p + [7, 8, 9] for p in first]
    alone = DFlashEngine(spec.target, spec.tokenizer)
    refs = {tuple(p): alone.generate(p, max_new_tokens=20, ignore_eos=True).token_ids for p in first + second}
    hf, ids = load_hf(target), first[0]
    with torch.no_grad():
        for _ in range(20):
            ids = ids + [int(hf(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax())]
    assert ids[len(first[0]):] == refs[tuple(first[0])]
    for drafts in (spec.drafter, None):
        batch = DFlashEngine(spec.target, spec.tokenizer, drafts, max_batch_size=2, max_context=128)
        for prompts in (first, second):
            outs = batch.generate_batch(prompts, max_new_tokens=20, ignore_eos=True)
            assert [o.token_ids for o in outs] == [refs[tuple(p)] for p in prompts], drafts
        assert batch.batch_decoder().reused_prefill_tokens == sum(map(len, first))
