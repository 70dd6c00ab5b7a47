"""SparseMoE (dflash_torch.models.moe) against transformers' own sparse MoE blocks (the
oracle): Qwen3MoeSparseMoeBlock, Qwen3NextSparseMoeBlock (shared expert) and
Qwen3_5MoeSparseMoeBlock. Weights travel through a real ``save_pretrained`` checkpoint
(per-expert safetensors keys) and :func:`fuse_expert_weights`. Also: unused experts
are never computed, fuse errors, and the dispatch under torch.compile."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from torch._dynamo import utils as dynamo_utils

from dflash_torch import DFlashError
from dflash_torch.models.moe import SparseMoE, fuse_expert_weights

HIDDEN, EXPERTS, INTER, SHARED = 32, 8, 16, 24

# name: (config class, model class, overrides)
CASES = {
    "qwen3_moe-norm-k2": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                          {"norm_topk_prob": True, "num_experts_per_tok": 2}),
    "qwen3_moe-nonorm-k3": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                            {"norm_topk_prob": False, "num_experts_per_tok": 3}),
    "qwen3_moe-nonorm-k1": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                            {"norm_topk_prob": False, "num_experts_per_tok": 1}),
    "qwen3_next-norm-k2": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                           {"norm_topk_prob": True, "num_experts_per_tok": 2}),
    "qwen3_next-nonorm-k1": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                             {"norm_topk_prob": False, "num_experts_per_tok": 1}),
    "qwen3_5_moe-k4": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM,
                       {"num_experts_per_tok": 4}),
    "qwen3_5_moe-k1": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM,
                       {"num_experts_per_tok": 1}),
}


def save_hf_moe(out_dir: Path, name: str):
    """A tiny random 2-layer MoE model of ``name``'s family saved by transformers; returns
    (its layer-1 ``mlp`` block, eager expert loop, float32, and the config)."""
    cfg_cls, model_cls, overrides = CASES[name]
    torch.manual_seed(len(name))
    cfg = cfg_cls(vocab_size=64, hidden_size=HIDDEN, intermediate_size=48, moe_intermediate_size=INTER,
                  shared_expert_intermediate_size=SHARED, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, num_experts=EXPERTS, linear_num_key_heads=2,
                  linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                  experts_implementation="eager", **overrides)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # peaked router logits and non-trivial experts
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(str(out_dir))
    return model.model.layers[1].mlp, cfg


def ours_from_checkpoint(out_dir: Path, cfg) -> SparseMoE:
    """Layer 1's mlp as a SparseMoE, from the saved safetensors via fuse_expert_weights."""
    state = load_file(str(out_dir / "model.safetensors"))
    prefix = "model.layers.1.mlp."
    assert f"{prefix}experts.0.gate_proj.weight" in state  # the per-expert layout is what is tested
    fuse_expert_weights(state, cfg.num_experts)
    layer = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    moe = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                    getattr(cfg, "norm_topk_prob", True),  # Qwen3.5-MoE always renormalises
                    None if cfg.model_type == "qwen3_moe" else cfg.shared_expert_intermediate_size)
    moe.load_state_dict(layer, strict=True)
    return moe.eval()


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    hf_block, cfg = save_hf_moe(out, request.param)
    return request.param, hf_block, ours_from_checkpoint(out, cfg)


@pytest.mark.parametrize("rows", [1, 16, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sparse_moe_matches_transformers(pair, rows, dtype):
    name, hf_block, moe = pair
    assert (moe.shared_expert is not None) == ("qwen3_moe" not in name)
    hf_block, moe = copy.deepcopy(hf_block).to(dtype), copy.deepcopy(moe).to(dtype)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows)).to(dtype)
    with torch.no_grad():
        ref = hf_block(x[None])[0]
        out = moe(x)
        weights, experts = moe.route(x)
        _, ref_weights, ref_experts = hf_block.gate(x)
    assert out.shape == (rows, HIDDEN) and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(out, ref)  # bfloat16 defaults: rtol 1.6e-2, atol 1e-5
    # the router agrees with transformers' and the routing is not degenerate
    assert torch.equal(experts, ref_experts) and torch.equal(weights, ref_weights)
    if rows == 256:
        assert len(experts.unique()) == EXPERTS
    if moe.norm_topk_prob:
        torch.testing.assert_close(weights.float().sum(-1), torch.ones(rows), rtol=1e-2, atol=1e-2)
    else:
        assert (weights.float().sum(-1) < 0.999).any()


def test_unused_experts_are_never_computed(pair):
    """Experts no token chose hold NaN weights: a dense evaluation (every expert for every
    token, weighted by zero) would turn the output NaN."""
    _, _, moe = pair
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = moe(x)
        _, experts = moe.route(x)
        unused = sorted(set(range(EXPERTS)) - set(experts.flatten().tolist()))
        assert unused
        saved = moe.experts.gate_up_proj.clone(), moe.experts.down_proj.clone()
        moe.experts.gate_up_proj[unused] = float("nan")
        moe.experts.down_proj[unused] = float("nan")
        try:
            after = moe(x)
        finally:
            moe.experts.gate_up_proj.copy_(saved[0])
            moe.experts.down_proj.copy_(saved[1])
    assert torch.equal(after, before)


def test_compiled_moe_compiles_once_for_any_routing(tmp_path):
    """The data-dependent expert loop is one custom-op node: a compiled function calling
    SparseMoE is one graph (no graph break), traced once for same-shaped inputs with
    different routings, never recompiled, and returns what eager returns."""
    _, cfg = save_hf_moe(tmp_path, "qwen3_next-norm-k2")
    moe = ours_from_checkpoint(tmp_path, cfg)
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def layer(x):
        return x + moe(torch.nn.functional.rms_norm(x, (HIDDEN,)))

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=counting_backend, dynamic=False)
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(3, HIDDEN, generator=g) for _ in range(4)]  # 3 rows x 2 of 8 experts
    with torch.no_grad():
        routings = [moe.route(torch.nn.functional.rms_norm(x, (HIDDEN,)))[1] for x in inputs]
        hit_sets = {tuple(sorted(set(r.flatten().tolist()))) for r in routings}
        assert len(hit_sets) > 1 and all(not torch.equal(routings[0], r) for r in routings[1:])
        first = compiled(inputs[0])
        n_graphs = len(graphs)
        unique = dynamo_utils.counters["stats"]["unique_graphs"]
        frames = dynamo_utils.counters["frames"]["total"]
        assert n_graphs == 1, "the expert dispatch broke the graph"
        outs = [first] + [compiled(x) for x in inputs[1:]]
        assert len(graphs) == n_graphs, "a graph was compiled again for a new routing"
        assert dynamo_utils.counters["stats"]["unique_graphs"] == unique
        assert dynamo_utils.counters["frames"]["total"] == frames, "a frame was re-traced for a new routing"
        for x, out in zip(inputs, outs):
            assert torch.equal(out, layer(x))
    torch._dynamo.reset()


def _per_expert_state(num_experts: int = 4, inter: int = 6, hidden: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {"model.embed_tokens.weight": torch.randn(7, hidden, generator=g),
             "model.layers.0.mlp.gate.weight": torch.randn(num_experts, hidden, generator=g)}
    for layer in (0, 2):
        for e in range(num_experts):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            state[p + "gate_proj.weight"] = torch.randn(inter, hidden, generator=g)
            state[p + "up_proj.weight"] = torch.randn(inter, hidden, generator=g)
            state[p + "down_proj.weight"] = torch.randn(hidden, inter, generator=g)
    return state


def test_fuse_expert_weights_stacks_per_layer_and_leaves_other_keys():
    state = _per_expert_state()
    original = dict(state)
    fused_layer = {"model.layers.1.mlp.experts.gate_up_proj": torch.randn(4, 12, 5),
                   "model.layers.1.mlp.experts.down_proj": torch.randn(4, 5, 6)}
    state.update(fused_layer)
    out = fuse_expert_weights(state, 4)
    assert out is state
    assert not any(".experts.0." in k for k in out)
    for layer in (0, 2):
        p = f"model.layers.{layer}.mlp.experts."
        gate_up, down = out[p + "gate_up_proj"], out[p + "down_proj"]
        assert gate_up.shape == (4, 12, 5) and down.shape == (4, 5, 6)
        for e in range(4):
            assert torch.equal(gate_up[e, :6], original[f"{p}{e}.gate_proj.weight"])
            assert torch.equal(gate_up[e, 6:], original[f"{p}{e}.up_proj.weight"])
            assert torch.equal(down[e], original[f"{p}{e}.down_proj.weight"])
    for k, v in fused_layer.items():
        assert out[k] is v
    assert out["model.embed_tokens.weight"] is original["model.embed_tokens.weight"]
    assert out["model.layers.0.mlp.gate.weight"] is original["model.layers.0.mlp.gate.weight"]
    assert len(out) == 2 + 2 * 2 + 2


def _drop(key):
    def edit(state):
        del state[key]
    return edit


def _drop_expert(layer, e):
    def edit(state):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            del state[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"]
    return edit


def _set(key, value):
    def edit(state):
        state[key] = value
    return edit


@pytest.mark.parametrize("edit, message", [
    (_drop("model.layers.2.mlp.experts.3.up_proj.weight"),
     "expert weights of model.layers.2.mlp.experts: expert 3 lacks up_proj.weight"),
    (_drop_expert(0, 1), "expert weights of model.layers.0.mlp.experts: experts 1 are missing (num_experts 4)"),
    (_set("model.layers.0.mlp.experts.4.gate_proj.weight", torch.zeros(6, 5)),
     "expert weights of model.layers.0.mlp.experts: expert ids [4] are outside num_experts 4"),
    (_set("model.layers.2.mlp.experts.2.gate_proj.weight", torch.zeros(7, 5)),
     "expert weights of model.layers.2.mlp.experts: expert 2 gate_proj.weight is (7, 5) torch.float32, expected (6, 5)"),
    (_set("model.layers.2.mlp.experts.1.down_proj.weight", torch.zeros(6, 5)),
     "expert weights of model.layers.2.mlp.experts: expert 1 down_proj.weight is (6, 5) torch.float32, expected (5, 6)"),
    (_set("model.layers.0.mlp.experts.0.down_proj.weight", torch.zeros(6, 5)),
     "expert weights of model.layers.0.mlp.experts: expert 0 has gate_proj (6, 5) and down_proj (6, 5)"),
    (_set("model.layers.0.mlp.experts.3.up_proj.weight", torch.zeros(6, 5, dtype=torch.bfloat16)),
     "expert 3 up_proj.weight is (6, 5) torch.bfloat16, expected (6, 5) torch.float32"),
    (_set("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(4, 12, 5)),
     "expert weights of model.layers.0.mlp.experts: both per-expert weights and the stacked"),
], ids=["lacks-matrix", "missing-expert", "extra-expert", "wrong-gate-shape", "wrong-down-shape",
        "transposed-down", "dtype", "both-layouts"])
def test_fuse_expert_weights_refuses_incomplete_or_inconsistent_groups(edit, message):
    state = _per_expert_state()
    edit(state)
    with pytest.raises(DFlashError) as err:
        fuse_expert_weights(state, 4)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_top_k_outside_the_experts_is_refused():
    with pytest.raises(DFlashError, match="num_experts_per_tok 9 must be between 1 and num_experts 8"):
        SparseMoE(HIDDEN, 8, 9, INTER, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_experts_match_the_sparse_dispatch(dtype):
    """The CUDA-graph path (no host read) computes what the sparse dispatch computes, for
    routings with repeated and with unused experts."""
    from dflash_torch.models.moe import dispatch_experts, gathered_experts

    g = torch.Generator().manual_seed(0)
    E, H, I, T, k = 6, 32, 16, 5, 2
    x = torch.randn(T, H, generator=g).to(dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)
    down = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
    weights = torch.rand(T, k, generator=g).to(dtype)
    for experts in (torch.tensor([[0, 1], [1, 0], [0, 5], [1, 5], [0, 1]]), torch.randperm(E, generator=g)[:k].repeat(T, 1)):
        sparse = dispatch_experts(x, experts, weights, gate_up, down)
        gathered = gathered_experts(x, experts, weights, gate_up, down)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(gathered, sparse, rtol=tol, atol=tol)


def test_corrupt_expert_weight_is_named_with_its_expert(tmp_path):
    """A NaN in one expert's matrix of a per-expert checkpoint is refused naming the stacked
    weight and the expert (the message named only the stacked tensor of all experts)."""
    from safetensors.torch import save_file

    from conftest import make_hybrid_target
    from dflash_torch.models.target import TargetModel

    make_hybrid_target(tmp_path, "qwen3_moe")
    (file,) = tmp_path.glob("*.safetensors")
    state = load_file(file)
    state["model.layers.1.mlp.experts.2.up_proj.weight"][3, 1] = float("nan")
    save_file(state, str(file), metadata={"format": "pt"})
    with pytest.raises(DFlashError) as err:
        TargetModel.from_pretrained(tmp_path, torch.float32)
    assert "target weight model.layers.1.mlp.experts.gate_up_proj (expert 2) holds NaN" in str(err.value)


def test_loading_a_mixture_of_experts_imports_dynamo_not_its_first_prefill(tmp_path, tiny_pair):
    """A custom operator's first call imports ``torch._dynamo`` (seconds on a CPU): a target
    that runs one (its experts) imports it when loading, so that the first request's prefill
    does not pay it (trial-318: a 1-token prompt's prefill_time 2.5 s on a tiny Qwen3-MoE); a
    dense target does not (its loading stays light). Where that import fails on the file
    system (``TORCHINDUCTOR_CACHE_DIR`` that cannot be created: it raised in the first
    forward, a traceback) loading says so in one line, before reading the weights, without
    speaking of compiling (trial-325 a). In new processes: the dense target first."""
    import subprocess
    import sys

    from conftest import make_hybrid_target

    moe_dir = make_hybrid_target(tmp_path / "moe", "qwen3_moe", seed=3, tokenizer=False)
    (tmp_path / "a-file").write_text("")
    code = ("import os, sys, torch\nfrom dflash_torch import DFlashError\n"
            "from dflash_torch.models.target import TargetModel\n"
            "for d in sys.argv[2:]:\n"
            "    if d == sys.argv[-1] and sys.argv[1] != '-':\n        os.environ['TORCHINDUCTOR_CACHE_DIR'] = sys.argv[1]\n"
            "    try:\n        TargetModel.from_pretrained(d, torch.float32)\n"
            "    except DFlashError as e:\n        print('refused:', e)\n"
            "    print('torch._dynamo' in sys.modules)")
    bad = str(tmp_path / "a-file" / "cache")
    for cache, expected in (("-", ["False", "True"]), (bad, ["False", "False"])):
        out = subprocess.run([sys.executable, "-c", code, cache, str(tiny_pair[0]), str(moe_dir)], capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert [line for line in lines if line in ("True", "False")] == expected, out.stdout
        refused = [line for line in lines if line.startswith("refused:")]
        assert refused == ([] if cache == "-" else [
            f"refused: this target runs its experts or packed weights as torch custom operators, whose first use imports "
            f"torch._dynamo, which failed: [Errno 20] Not a directory: '{bad}'; torch inductor's cache directory "
            f"(TORCHINDUCTOR_CACHE_DIR={bad}) must be one this process can create and write: set "
            "TORCHINDUCTOR_CACHE_DIR to another, or unset it"]), out.stdout
