"""The bench command end to end on a tiny pair, and the large-shape timing helper."""

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch._dynamo

from dflash_torch import DFlashError
from dflash_torch.bench.cli import _shapes_table
from dflash_torch.bench.shapes import drafter_config, round_vs_step, target_config
from dflash_torch.bench.sweep import context_sweep
from dflash_torch.models.drafter import DFlashDrafter


def run_bench(cli, pair, *args: str):
    """``dflash-torch bench`` on ``pair`` (target, drafter) with ``args``, run in this process by
    ``cli`` (the :func:`conftest.cli` fixture): its returncode, stdout and stderr."""
    target, drafter = pair
    return cli("bench", "--target", str(target), "--draft", str(drafter), *args)


def test_bench_cli_writes_report(tiny_pair, tmp_path, cli):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):", "import os\n"]))
    out = tmp_path / "out"
    proc = run_bench(cli, tiny_pair, "--prompts", str(prompts), "--max-new-tokens", "12", "--modes", "target-only,inject,recompute",
                     "--sweep", "64,16", "--out", str(out), "--no-progress", "--num-prompts", "5")
    assert proc.returncode == 0, proc.stderr
    assert f"bench: 2 prompts in {prompts}, fewer than --num-prompts 5: timing 2" in proc.stderr
    report = json.loads((out / "bench.json").read_text())
    names = [m["name"] for m in report["modes"]]
    assert names == ["target-only", "inject", "recompute"]
    for m in report["modes"]:
        # 12 tokens per prompt, the first from the prefill: generated_tokens counts it, as batch_sizes' rows and
        # generate --json count it, decode_tokens (the timed ones) does not
        assert (m["generated_tokens"], m["decode_tokens"]) == (2 * 12, 2 * 11)
        assert m["decode_tokens_per_second"] == pytest.approx(m["decode_tokens"] / m["decode_time"])
        # tau counts the tokens kept (the last round's past --max-new-tokens not: helper-26)
        assert sum(int(tau) * n for tau, n in m["acceptance_histogram"].items()) == m["decode_tokens"]
        assert m["mean_acceptance_length"] * m["rounds"] == pytest.approx(m["decode_tokens"])
        assert m["cudagraphs_skipped"] is None  # (eager, and no CUDA)
        assert m["decode_tokens_per_second"] > 0
    for m in report["modes"][1:]:
        assert m["outputs_identical_to_target_only"] is True
        assert sum(m["acceptance_histogram"].values()) == m["rounds"]
        # eager modes: the like-for-like baseline is eager target-only itself
        assert m["speedup_vs_target_only_same_compile"] == m["speedup_vs_target_only"]
    assert report["modes"][0]["speedup_vs_target_only_same_compile"] is None
    assert report["sweep"]["lengths"] == [16, 64] and len(report["sweep"]["inject"]) == 2
    assert (out / "modes.png").stat().st_size > 0 and (out / "sweep.png").stat().st_size > 0
    assert "| inject" in proc.stdout
    assert "ratio 64/16: inject " in proc.stdout  # (--sweep 64,16 is timed shortest first)


def test_bench_rejects_unknown_mode(tiny_pair, tmp_path, cli):
    proc = run_bench(cli, tiny_pair, "--modes", "warp-speed", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert "unknown bench mode" in proc.stderr and "Traceback" not in proc.stderr


# tiny config.json dicts, parsed by each family's own parser like the named shapes
TINY_QWEN3 = {"model_type": "qwen3", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
              "rope_theta": 1000000.0, "max_position_embeddings": 512, "tie_word_embeddings": True}
# Qwen3.5-MoE text: two periods of 3 Gated DeltaNet + 1 gated attention layer, every MLP routed
TINY_HYBRID_MOE = {"model_type": "qwen3_5_moe_text", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 8,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "full_attention_interval": 4,
                   "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                   "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 8, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "max_position_embeddings": 512}


def test_sweep_and_round_vs_step_small_shape(tiny_pair):
    _, drafter_dir = tiny_pair
    drafter = DFlashDrafter.from_pretrained(drafter_dir, torch.float32)
    embed = torch.nn.Embedding(drafter.config.vocab_size, drafter.config.hidden_size)
    sweep = context_sweep(drafter, embed, [8, 32], block_size=4, repeats=1)
    assert all(t > 0 for t in sweep["inject"] + sweep["recompute"])
    r = round_vs_step(TINY_QWEN3, torch.float32, context=16, block_size=4, repeats=1, draft_layers=2)
    assert r["target_step_s"] > 0 and r["round_s"] > 0
    assert (r["layers"], r["layers_timed"], r["scaled"], r["measured"]) == (4, 4, False, None)
    assert r["experts_hit_per_moe_layer"] is None and r["moe"] is None
    # (a round of B=4 accepts at most 4 tokens: the paper's tau, all above 4, projects nothing)
    assert set(r["projected_speedup"].values()) == {None}
    r = round_vs_step(TINY_QWEN3, torch.float32, context=16, block_size=5, repeats=1, draft_layers=2)
    assert r["projected_speedup"] == {"mean (paper, Qwen3-8B)": None, "MT-Bench": 4.24 * r["target_step_s"] / r["round_s"],
                                      "MATH-500": None}
    table = _shapes_table([r]).splitlines()
    assert table[4].endswith("| - |") and any(line.startswith("PROJECTED '-': the paper's tau 6.49") for line in table)
    assert r["floor_round_over_step"] > 1 and not any(line.startswith("Round/step by weights read '-'") for line in table)
    # the growth from the shortest length to the longest, whatever their order
    sweep = context_sweep(drafter, embed, [32, 8], block_size=4, repeats=1)
    assert sweep["ratio_longest_over_shortest"]["inject"] == sweep["inject"][0] / sweep["inject"][1]


def test_a_round_vs_step_a_loaded_machine_made_impossible_is_flagged_unreliable():
    """trial-318 (b): under load, --shapes printed "round/step 0.12" (a round, a propose and a
    verify of 16 tokens, costing an eighth of one 1-token step) and a ~50x PROJECTED speedup,
    unflagged. Now a round/step below 1, well below its floor by weights read, or repeats that
    spread wide are flagged UNRELIABLE, in the result, the progress line's words and the table."""
    from dflash_torch.bench.shapes import MAX_REPEAT_SPREAD, unreliable

    r = round_vs_step(TINY_QWEN3, torch.float32, context=16, block_size=4, repeats=3, draft_layers=2)
    assert r["repeat_spread"] >= 1 and r["unreliable"] == unreliable(r)
    floor = r["floor_round_over_step"]
    fine = dict(r, round_over_step=max(1.0, floor), repeat_spread=1.1)
    assert unreliable(fine) is None and unreliable(dict(fine, round_over_step=0.91 * floor)) is None
    loaded = dict(r, round_over_step=0.12, repeat_spread=1.2)
    assert unreliable(loaded) == ("UNRELIABLE: round/step 0.12 is below 1 (a round, a propose and a verify of 4 tokens, "
                                  "cannot cost less than one 1-token step): the machine was likely loaded; rerun it on "
                                  "an idle one")
    assert unreliable(dict(fine, round_over_step=0.8 * floor)).startswith("UNRELIABLE: round/step ")
    assert unreliable(dict(fine, floor_round_over_step=None, repeat_spread=MAX_REPEAT_SPREAD + 0.5)) == (
        f"UNRELIABLE: the repeats spread {MAX_REPEAT_SPREAD + 0.5:.1f}x (slowest / fastest): the machine was likely "
        "loaded; rerun it on an idle one")
    loaded["unreliable"] = unreliable(loaded)
    table = _shapes_table([fine | {"unreliable": None}, loaded]).splitlines()
    rows = [line for line in table if line.startswith("| custom | qwen3 |")]
    assert "| 0.12 UNRELIABLE |" in rows[1] and "UNRELIABLE" not in rows[0]
    assert f"custom: {loaded['unreliable']} (its PROJECTED speedup too)" in table


def _finite_positive(*values):
    return all(math.isfinite(v) and v > 0 for v in values)


def test_round_vs_step_hybrid_moe_full_and_layer_subset():
    """A hybrid MoE target end to end, built whole and (forced by a 1-byte memory budget)
    as one period of its layer pattern, whose per-layer time is scaled to the full depth."""
    kw = dict(dtype=torch.float32, context=32, block_size=4, repeats=5, draft_layers=2)
    full = round_vs_step(TINY_HYBRID_MOE, **kw)
    part = round_vs_step(TINY_HYBRID_MOE, memory_budget=1, **kw)
    assert (full["layers"], full["layers_timed"], full["scaled"]) == (8, 8, False)
    assert (part["layers"], part["layers_timed"], part["scaled"]) == (8, 4, True)
    assert full["model_type"] == part["model_type"] == "qwen3_5_moe_text"
    for r in (full, part):
        assert _finite_positive(r["target_step_s"], r["round_s"], r["propose_s"])
        # every MoE layer of a 4-token verify hits between top-k and all of the 8 experts
        assert 2 <= r["experts_hit_per_moe_layer"] <= 8 and r["moe"] == {"num_experts": 8, "top_k": 2}
    m = part["measured"]
    assert _finite_positive(*m.values())
    # the layers (and commits) are a part of each measured time; scaling adds that part
    # once more for the 4 layers not built
    assert m["target_step_layers_s"] < m["target_step_s"] < part["target_step_s"]
    assert m["round_layers_and_commit_s"] < m["round_s"] < part["round_s"]
    table = _shapes_table([full, part]).splitlines()
    rows = [line for line in table if line.startswith("| custom | qwen3_5_moe_text |")]
    assert len(rows) == 2 and "| all 8 |" in rows[0] and "| 4 of 8, SCALED |" in rows[1]
    assert any(line.startswith("SCALED rows") for line in table)
    # (no floor for an MoE target, "-" in its column: the table says why; trial-268, it did not)
    assert full["floor_round_over_step"] is part["floor_round_over_step"] is None
    assert [r.split("|")[8] for r in rows] == [" - "] * 2
    assert ("Round/step by weights read '-': a mixture-of-experts target, whose step reads the experts its token is "
            "routed to, not weights known from the shape (bench.json: null).") in table


def test_hybrid_round_commits_the_accepted_rows(monkeypatch):
    """A hybrid target's round ends with the rollback of its recurrent state (the commit
    of the accepted rows), as the decoding loop does; its target-only step commits in
    the verify itself; a pure-attention target never commits."""
    from dflash_torch.models.target import TargetModel

    rows = []
    real_commit = TargetModel.commit

    def observed_commit(self, cache, n):
        rows.append(int(n))
        real_commit(self, cache, n)

    monkeypatch.setattr(TargetModel, "commit", observed_commit)
    round_vs_step(TINY_HYBRID_MOE, torch.float32, context=16, block_size=4, repeats=1, draft_layers=2)
    # the timed rounds (repeats + 1 warm-up), the verify timed alone (as many), then the
    # verify counting expert hits
    assert len(rows) == 2 + 2 + 1
    assert all(1 <= n <= 4 for n in rows)
    rows.clear()
    round_vs_step(TINY_QWEN3, torch.float32, context=16, block_size=4, repeats=1, draft_layers=2)
    assert rows == []


TINY_GPT_OSS = {"model_type": "gpt_oss", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 32,
                "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 8, "max_position_embeddings": 512}


def test_round_vs_step_gpt_oss_shape_and_named_gpt_oss_shapes():
    """gpt-oss (sink attention, sliding layers, biased experts) through round_vs_step, built
    whole and as one period (a sliding and a full layer); the named shapes parse."""
    from dflash_torch.bench.shapes import SHAPES, build_pair, pattern_period, target_config

    kw = dict(dtype=torch.float32, context=32, block_size=4, repeats=2, draft_layers=2)
    for budget, built in ((None, 4), (1, 2)):
        r = round_vs_step(TINY_GPT_OSS, memory_budget=budget, **kw)
        assert r["model_type"] == "gpt_oss" and (r["layers"], r["layers_timed"]) == (4, built)
        assert _finite_positive(r["target_step_s"], r["round_s"], r["propose_s"])
        assert 2 <= r["experts_hit_per_moe_layer"] <= 8 and r["moe"] == {"num_experts": 8, "top_k": 2}
    target, _ = build_pair(TINY_GPT_OSS, torch.float32, "cpu", draft_layers=2, block_size=4)
    assert bool((target.model.norm.weight == 1).all()) and target.model.layers[0].mlp.router.weight.std() > 0
    for name, layers, experts in (("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)):
        cfg = target_config(SHAPES[name])
        assert (cfg.num_hidden_layers, cfg.moe.num_experts, cfg.moe.top_k, cfg.sliding_window) == (layers, experts, 4, 128)
        assert pattern_period(cfg) == 2 and cfg.rope_scaling["truncate"] is False


# Gemma 4 text with the mixture of experts beside each MLP: two periods of 2 sliding + 1 full layer
TINY_GEMMA4_MOE = {"model_type": "gemma4_text", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 6,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
                   "num_global_key_value_heads": 1, "attention_k_eq_v": True, "intermediate_size": 64,
                   "hidden_size_per_layer_input": 0, "sliding_window": 8, "enable_moe_block": True, "num_experts": 8,
                   "top_k_experts": 2, "moe_intermediate_size": 32, "max_position_embeddings": 512,
                   "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2}


def test_round_vs_step_gemma4_shape_and_named_gemma4_shapes():
    """Gemma 4 (two head sizes, layer scalars, a router of its own) through round_vs_step,
    built whole and as one period; the named shapes parse as the published models are."""
    from dflash_torch.bench.shapes import SHAPES, build_pair, pattern_period, target_config

    kw = dict(dtype=torch.float32, context=32, block_size=4, repeats=2, draft_layers=2)
    for budget, built in ((None, 6), (1, 3)):
        r = round_vs_step(TINY_GEMMA4_MOE, memory_budget=budget, **kw)
        assert r["model_type"] == "gemma4_text" and (r["layers"], r["layers_timed"]) == (6, built)
        assert _finite_positive(r["target_step_s"], r["round_s"], r["propose_s"])
        assert 2 <= r["experts_hit_per_moe_layer"] <= 8 and r["moe"] == {"num_experts": 8, "top_k": 2}
    target, _ = build_pair(TINY_GEMMA4_MOE, torch.float32, "cpu", draft_layers=2, block_size=4)
    layer = target.model.layers[2]
    assert bool((layer.layer_scalar == 1).all()) and bool((layer.post_feedforward_layernorm.weight == 1).all())
    assert layer.router.proj.weight.std() > 0 and target.kv_shapes()[2] == (1, 32)
    dense, moe = target_config(SHAPES["gemma-4-31b"]), target_config(SHAPES["gemma-4-26b-a4b"])
    assert (dense.num_hidden_layers, dense.layer_head_dims[4:6], dense.layer_kv_heads[4:6]) == (60, [256, 512], [16, 4])
    assert (moe.num_hidden_layers, moe.moe.num_experts, moe.moe.top_k, moe.layer_kv_heads[4:6]) == (30, 128, 8, [8, 2])
    assert pattern_period(dense) == pattern_period(moe) == 6 and dense.final_logit_softcapping == 30.0


def test_layer_subset_keeps_the_layer_pattern():
    from dflash_torch.bench.shapes import SHAPES, layers_to_build, pattern_period, target_config

    assert pattern_period(target_config(TINY_HYBRID_MOE)) == 4
    assert [pattern_period(target_config(SHAPES[n])) for n in ("qwen3-1.7b", "qwen3-30b-a3b", "qwen3.5-9b",
                                                             "qwen3.5-35b-a3b", "qwen3-next-80b-a3b")] == [1, 1, 4, 4, 4]
    # whole periods that fit; at least one; all layers when everything fits
    assert layers_to_build(10, [5] * 8, 4, budget=1) == 4
    assert layers_to_build(10, [5] * 12, 4, budget=10 + 5 * 8) == 8
    assert layers_to_build(10, [5] * 8, 4, budget=10 + 5 * 8) == 8
    assert layers_to_build(10, [5] * 8, 8, budget=1) == 8  # no shorter period: the whole stack


def test_named_shapes_parse_with_their_family_parsers():
    from dflash_torch.bench.shapes import SHAPES, drafter_config, target_config

    kinds = {name: target_config(name) for name in SHAPES}
    assert {"qwen3.5-4b", "qwen3.5-9b", "qwen3.5-27b", "qwen3-30b-a3b", "qwen3.5-35b-a3b",
            "qwen3-next-80b-a3b"} <= set(SHAPES)
    assert kinds["qwen3-next-80b-a3b"].moe.num_experts == 512 and kinds["qwen3-next-80b-a3b"].layer_types[:4] == [
        "linear_attention"] * 3 + ["full_attention"]
    assert kinds["qwen3.5-35b-a3b"].model_type == "qwen3_5_moe_text" and kinds["qwen3.5-35b-a3b"].moe.top_k == 8
    assert kinds["qwen3.5-9b"].partial_rotary_factor == 0.25 and kinds["qwen3.5-9b"].linear_attention.num_value_heads == 32
    # drafters are dense: the MoE targets' drafter MLP is the width a token passes through
    assert drafter_config(kinds["qwen3.5-35b-a3b"]).intermediate_size == 8 * 512 + 512
    assert drafter_config(kinds["qwen3-1.7b"]).intermediate_size == 6144
    with pytest.raises(DFlashError, match="unknown shape 'qwen9-huge'; choose from qwen3-0.6b, .*qwen3-next-80b-a3b"):
        target_config("qwen9-huge")


def test_random_init_keeps_norms_and_recurrence_sane():
    from dflash_torch.bench.shapes import build_pair

    target, _ = build_pair(TINY_HYBRID_MOE, torch.float32, "cpu", draft_layers=2, block_size=4)
    gdn = target.model.layers[0].linear_attn
    decay = (-gdn.A_log.exp() * torch.nn.functional.softplus(gdn.dt_bias)).exp()  # per-token decay at a = 0
    assert bool(((decay > 0) & (decay < 1)).all()) and bool((gdn.dt_bias == 1).all())
    assert bool((target.model.norm.weight == 0).all())  # (1 + w) norms: scale 1
    assert bool((gdn.norm.weight == 1).all())
    assert target.model.layers[0].mlp.gate.weight.std() > 0  # a random router


def test_shape_drafter_is_usable_for_the_sweep():
    from dflash_torch.bench.shapes import build_drafter
    from dflash_torch.models.rope import rope_inv_freq

    drafter, embed = build_drafter({**TINY_QWEN3, "num_hidden_layers": 6}, torch.float32, "cpu", draft_layers=2,
                                   block_size=4)
    assert drafter.config.num_hidden_layers == 2 and drafter.config.target_layer_ids == [1, 3]
    # the rope table is rebuilt after the meta-device init (to_empty leaves buffers unset)
    assert torch.equal(drafter.rotary.inv_freq, rope_inv_freq(16, 1e6, None))
    sweep = context_sweep(drafter, embed, [8, 32], block_size=4, repeats=1)
    assert all(t > 0 for t in sweep["inject"] + sweep["recompute"])
    # a named shape: its mask token id (151935) is embedded too
    drafter, embed = build_drafter("qwen3-0.6b", torch.float32, "cpu", draft_layers=1, block_size=4)
    assert drafter.config.mask_token_id == 151935
    assert all(t > 0 for t in context_sweep(drafter, embed, [8], block_size=4, repeats=1)["inject"])


def test_divergences_report_first_index_and_logit_gap(tiny_pair):
    from conftest import load_hf

    from dflash_torch.bench.modes import divergences
    from dflash_torch.models.target import TargetModel

    target_dir, _ = tiny_pair
    target = TargetModel.from_pretrained(target_dir, torch.float32)
    prompt = [5, 9, 13, 2]
    hf = load_hf(target_dir)
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    assert divergences(target, [prompt], [ref], [list(ref)]) == []
    other = (ref[3] + 1) % target.config.vocab_size
    changed = ref[:3] + [other] + ref[4:]
    (d,) = divergences(target, [prompt], [ref], [changed])
    # (the prompt counted from 1, as bench's messages name prompts: "prompt 1 (206 tokens) ...")
    assert (d["prompt"], d["index"], d["reference_token"], d["token"]) == (1, 3, ref[3], other)
    (d,) = divergences(target, [[7, 8], prompt], [ref, ref], [ref, changed])
    assert (d["prompt"], d["index"]) == (2, 3)
    with torch.no_grad():  # oracle: transformers' logits after prompt + the common prefix
        logits = hf(torch.tensor([prompt + ref[:3]])).logits[0, -1]
    assert abs(d["logit_gap"] - float(logits[ref[3]] - logits[other])) < 1e-4
    assert d["logit_gap"] > 0  # the reference token is the greedy choice


def test_bench_refuses_bad_options_with_one_line(tiny_pair, tmp_path, capsys):
    from dflash_torch.cli import main as cli_main

    target, drafter = tiny_pair
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    base = ["bench", "--target", str(target), "--draft", str(drafter), "--out", str(tmp_path / "o")]
    cases = [(["--modes", ""], "--modes is empty"), (["--sweep", "0"], "--sweep"), (["--sweep", "128,-5"], "--sweep"),
             (["--max-context", "100"], "--max-context"), (["--out", str(a_file)], "--out"),
             (["--sweep-shapes", "qwen9-huge"], "unknown shape"), (["--shapes", "qwen3-1.7b,qwen9-huge"], "qwen3-next-80b-a3b"),
             (["--modes", "inject,target-only,inject"], "more than once"),
             (["--draft-max-batch-size", "2"], "--draft-max-batch-size applies to --batch-sizes"),
             (["--shapes-compiled"], "--shapes-compiled applies to --shapes only")]
    for extra, words in cases:
        assert cli_main(base + extra) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], (extra, err)
    # a run refused after --out was made (here: a target that is no checkpoint) leaves no empty --out behind,
    # nor the parents it made; a directory that was there stays
    made = tmp_path / "new" / "deeper" / "o"
    assert cli_main(["bench", "--target", str(a_file), "--draft", str(drafter), "--out", str(made)]) == 2
    assert "--target" in capsys.readouterr().err and not (tmp_path / "new").exists()
    dotted = tmp_path / "made" / ".." / "sib"  # (mkdir makes made/ and sib/: both go)
    assert cli_main(["bench", "--target", str(a_file), "--draft", str(drafter), "--out", str(dotted)]) == 2
    capsys.readouterr()
    assert not (tmp_path / "made").exists() and not (tmp_path / "sib").exists()
    (tmp_path / "kept").mkdir()
    assert cli_main(["bench", "--target", str(a_file), "--draft", str(drafter), "--out", str(tmp_path / "kept")]) == 2
    assert (tmp_path / "kept").is_dir()


def test_a_shape_that_cannot_fit_is_refused_before_anything_is_timed(tiny_pair, tmp_path, capsys, monkeypatch):
    """``--shapes a,b`` where b cannot fit: one line, before the modes or shape a are timed
    (it used to time a for minutes, then end in the error and write no report)."""
    from dflash_torch.bench import shapes
    from dflash_torch.cli import main as cli_main

    monkeypatch.setattr(shapes, "device_memory", lambda device: 2**31)  # a 2 GiB machine
    target, drafter = tiny_pair
    out = tmp_path / "o"
    rc = cli_main(["bench", "--target", str(target), "--draft", str(drafter), "--out", str(out), "--dtype", "float32",
                   "--shapes", "qwen3-0.6b,qwen3-8b", "--sweep", "", "--no-progress"])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "shape qwen3-8b needs" in err[0] and "GiB in float32" in err[0] and "cpu has 2.0 GiB" in err[0], err
    assert "layers and the drafter" in err[0], err  # (the drafter counts: a 5-layer one of the shape's width)
    assert err[0].endswith("of which a shape may take 80% (1.6 GiB)"), err  # (nor would it fit in bfloat16)
    assert "target-only" not in captured.out and not out.exists()


def test_the_bfloat16_hint_is_given_only_where_bfloat16_fits(monkeypatch):
    """A float32 shape that does not fit suggests bfloat16 with its need, counted as bench
    builds it (on a CPU with oneDNN bfloat16 each linear weight also has a prepacked copy,
    so it may not fit either: "halves it" was said, and bfloat16 was refused again)."""
    from dflash_torch.bench import shapes

    def refusal(memory: int, dtype: torch.dtype = torch.float32) -> str:
        monkeypatch.setattr(shapes, "device_memory", lambda device: memory)
        with pytest.raises(DFlashError) as e:
            shapes.layers_that_fit("qwen3-8b", dtype, "cpu")
        return str(e.value)

    f32 = float(re.search(r"needs ([\d.]+) GiB in float32", refusal(2**31)).group(1))
    bf16 = float(re.search(r"needs ([\d.]+) GiB in bfloat16", refusal(2**31, torch.bfloat16)).group(1))
    assert "bfloat16" not in refusal(2**31)  # (it does not fit in bfloat16 either)
    memory = int((bf16 + f32) / 2 / 0.8 * 2**30)  # fits in bfloat16, not in float32
    hint = re.search(r"; in bfloat16 \(--dtype bfloat16\) it needs ([\d.]+) GiB$", refusal(memory))
    assert hint, refusal(memory)
    assert bf16 - 0.05 <= float(hint.group(1)) <= 0.8 * memory / 2**30
    shapes.layers_that_fit("qwen3-8b", torch.bfloat16, "cpu")  # (and bfloat16 is accepted)


@pytest.mark.parametrize("sweep_shapes", ["", "qwen3-8b"])
def test_a_sweep_that_cannot_fit_is_refused_before_anything_is_timed(tiny_pair, tmp_path, capsys, monkeypatch,
                                                                     sweep_shapes):
    """``--sweep 99999999``: one line naming --sweep, before any mode runs (it was an allocator
    traceback after the modes had been timed)."""
    from dflash_torch.bench import sweep
    from dflash_torch.cli import main as cli_main

    monkeypatch.setattr(sweep, "available_memory", lambda device: 2**30)  # a 1 GiB machine
    target, drafter = tiny_pair
    length = "100000" if sweep_shapes else "99999999"  # (the tiny drafter's rows are small; a qwen3-8b one's are not)
    rc = cli_main(["bench", "--target", str(target), "--draft", str(drafter), "--out", str(tmp_path / "o"),
                   "--dtype", "float32", "--modes", "target-only", "--num-prompts", "1", "--max-new-tokens", "4",
                   "--sweep", f"128,{length}", "--sweep-shapes", sweep_shapes, "--no-progress"])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    what = "a qwen3-8b-shaped drafter" if sweep_shapes else "the drafter"
    assert rc == 2 and len(err) == 1 and f"--sweep {length} needs about" in err[0] and what in err[0], err
    assert "cpu has 1.0 GiB free: lower --sweep" in err[0] and "target-only" not in captured.out


def test_modes_plot_of_target_only_alone_warns_nothing(tmp_path):
    """``bench --modes target-only``: the acceptance panel has no curve; the plot is written
    without matplotlib's "No artists with labels found to put in legend" warning."""
    import warnings

    from dflash_torch.bench.cli import _plots

    report = {"modes": [{"name": "target-only", "decode_tokens_per_second": 100.0, "acceptance_histogram": {"1": 10}}],
              "sweep": None, "shape_sweeps": []}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _plots(report, tmp_path) == [str(tmp_path / "modes.png")]
    assert (tmp_path / "modes.png").stat().st_size > 0


def test_acceptance_plot_draws_drafting_modes_only():
    from dflash_torch.bench.cli import drafting_modes

    names = ["target-only", "inject", "recompute", "target-only-compiled", "inject-compiled"]
    assert [m["name"] for m in drafting_modes([{"name": n} for n in names])] == ["inject", "recompute", "inject-compiled"]


def test_acceptance_histogram_is_bars_of_every_tau_from_zero():
    """Every tau from 1 to the block size is a bar, one without rounds a bar of 0, the rounds
    axis from 0 (it was a line through the non-empty bins only, the axis from their least: a
    tau of 0 rounds between two others looked like some)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dflash_torch.bench.cli import acceptance_bars

    modes = [{"name": "inject", "acceptance_histogram": {"1": 5, "3": 7}},  # (as bench.json has them: str keys)
             {"name": "recompute", "acceptance_histogram": {2: 4, 3: 8}}]
    fig, ax = plt.subplots()
    try:
        acceptance_bars(ax, modes, 4)
        assert not ax.get_lines()
        assert [p.get_height() for p in ax.patches] == [5, 0, 7, 0, 0, 4, 8, 0]
        assert ax.get_ylim()[0] == 0 and list(ax.get_xticks()) == [1, 2, 3, 4]
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["inject", "recompute"]
    finally:
        plt.close(fig)


def test_round_vs_step_compiled_builds_its_graphs_in_warm_up(monkeypatch):
    """The compiled step and round as --compile runs them: fixed shapes, every graph built
    during the warm-up calls (none after), no CUDA graph skipped (none on a CPU). TorchDynamo's
    guards decide whether a graph is built, before any backend runs: torch.compile's cheap
    "eager" backend sees the same graphs (inductor's ~40 s of C++ builds are the losslessness
    tests' of test_compile.py, test_fusing.py and test_hybrid.py)."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **opts: compile_(fn, **dict(opts, backend="eager")))
    torch._dynamo.reset()
    r = round_vs_step(TINY_QWEN3, torch.float32, context=16, block_size=4, repeats=2, draft_layers=2, compiled=True)
    assert r["compiled"] is True and (r["recompiles"], r["cudagraph_skips"], r["eager_fallbacks"]) == (0, 0, 0)
    assert _finite_positive(r["target_step_s"], r["round_s"], r["propose_s"])
    assert r["experts_hit_per_moe_layer"] is None
    table = _shapes_table([round_vs_step(TINY_QWEN3, torch.float32, context=16, block_size=4, repeats=1,
                                         draft_layers=2), r])
    assert "| custom (compiled) | qwen3 |" in table


def test_round_vs_step_compiled_needs_every_layer():
    with pytest.raises(DFlashError, match="needs all 8 layers"):
        round_vs_step(TINY_HYBRID_MOE, torch.float32, context=16, block_size=4, repeats=1, draft_layers=2,
                      memory_budget=1, compiled=True)


def test_bench_batch_sizes_writes_table_plot_and_fields(tiny_pair, tmp_path, cli):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):", "import os\n", "class A:", "x = 1"]))
    out = tmp_path / "out"
    proc = run_bench(cli, tiny_pair, "--prompts", str(prompts), "--max-new-tokens", "10", "--modes", "", "--sweep", "",
                     "--batch-sizes", "1,3", "--block-size", "4", "--out", str(out), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((out / "bench.json").read_text())["batch_sizes"]
    assert [(r["batch_size"], r["mode"]) for r in rows] == [(1, "target-only"), (1, "dflash"), (3, "target-only"), (3, "dflash")]
    for r in rows:  # the 4 prompts cycled to 4 requests per slot of the largest batch: 12 requests
        assert r["requests"] == 12
        assert r["generated_tokens"] == 12 * 10 and r["decode_tokens"] == 12 * 9
        assert r["aggregate_decode_tokens_per_second"] > 0 and 0 < r["p50_latency_s"] <= r["p95_latency_s"]
        assert r["scaling_vs_batch_1"] is not None
        # one tau per sequence and round, the last one counting the tokens kept
        assert r["mean_acceptance_length"] * r["mean_batch"] * r["rounds"] == pytest.approx(r["decode_tokens"])
    assert rows[2]["mean_batch"] == 3  # target-only: every request takes 9 rounds, so the batch stays full
    assert 2 < rows[3]["mean_batch"] <= 3  # dflash: requests finish at different rounds
    for r in rows[1::2]:
        assert r["outputs_identical_to_target_only"] is True and r["speedup_vs_target_only"] > 0
        assert r["target_only_rounds"] == 0  # (always drafting: no --draft-max-batch-size)
    assert [r["target_only_rounds"] for r in rows[::2]] == [None, None]  # (target-only rows: no draft to skip)
    assert (out / "batch_sizes.png").stat().st_size > 0
    assert "| 3 | dflash | " in proc.stdout and "12 requests of 10 tokens" in proc.stdout
    # the table says whether each DFlash row's outputs are target-only's, as bench.json does
    table = [line for line in proc.stdout.splitlines() if line.startswith("| 1 |") or line.startswith("| 3 |")]
    assert [line.rstrip().endswith("| identical |" if "dflash" in line else "| - |") for line in table] == [True] * 4


def test_bench_batch_sizes_with_target_only_rounds_above_a_limit(tiny_pair, tmp_path, cli):
    """``--draft-max-batch-size 1``: the DFlash rows' rounds of more than one sequence run
    target-only (tau 1 while 3 decode), outputs stay the target's, bench.json records it."""
    out = tmp_path / "out"
    proc = run_bench(cli, tiny_pair, "--max-new-tokens", "10", "--num-prompts", "3", "--modes", "", "--sweep", "",
                     "--batch-sizes", "3", "--block-size", "4", "--draft-max-batch-size", "1", "--out", str(out),
                     "--no-progress")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "bench.json").read_text())
    assert report["draft_max_batch_size"] == 1
    dflash = report["batch_sizes"][1]
    assert dflash["mode"] == "dflash" and dflash["outputs_identical_to_target_only"] is True
    assert dflash["mean_acceptance_length"] == 1.0  # (3 decode in every round: 12 requests, 3 slots, 10 tokens each)
    # the table and bench.json say how many rounds ran without drafts (nothing showed the policy at work)
    assert dflash["target_only_rounds"] == dflash["rounds"] > 0
    assert f"| 3 | dflash | 3.00 | {dflash['rounds']} of {dflash['rounds']} |" in proc.stdout, proc.stdout
    assert "| 3 | target-only | 3.00 | - |" in proc.stdout, proc.stdout


def test_bench_rejects_bad_batch_sizes(tiny_pair, tmp_path, cli):
    proc = run_bench(cli, tiny_pair, "--batch-sizes", "1,0", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert "--batch-sizes must be distinct integers >= 1" in proc.stderr and "Traceback" not in proc.stderr


def test_round_vs_step_joined_projections_verify_part_and_profile():
    """The verify timed alone, joined projections on request, and the profile of each part
    (on a CPU: the top-level ops; on a GPU the same summary lists device kernels)."""
    from dflash_torch.bench.profile import kind_of, summary_lines

    r = round_vs_step(TINY_QWEN3, torch.float32, context=16, block_size=4, repeats=2, draft_layers=2,
                      fuse=True, profile=True)
    assert r["fused"] is True and _finite_positive(r["verify_s"], r["propose_s"], r["round_s"])
    # weights read, counted from the shapes by hand (float32): a target layer is q, k, v, o,
    # the MLP and four norms; the drafter's layers are alike, plus fc and two norms; both
    # read the LM head
    d = drafter_config(target_config(TINY_QWEN3), 2, 4)
    H, I, head = 64, 128, 128 * 64

    def layer(inter):
        return 2 * H * H + 2 * H * 32 + 3 * H * inter + 2 * H + 2 * 16

    step = 4 * (4 * layer(I) + H + head)  # bytes: 4 layers, the final norm, the LM head
    propose = 4 * (2 * layer(d.intermediate_size) + len(d.target_layer_ids) * H * H + 2 * H + head)
    assert (r["step_weight_bytes"], r["propose_weight_bytes"]) == (step, propose)
    assert r["floor_round_over_step"] == (step + propose) / step
    assert round_vs_step(TINY_QWEN3, torch.float32, context=16, block_size=4, repeats=1, draft_layers=2)["fused"] is False
    for part in ("step", "propose", "verify", "round"):
        s = r["profile"][part]
        assert s["calls"] == 2 and s["kernels"] > 0 and 0 < s["busy_us"]
        assert s["top"] and all(t["per_call"] > 0 for t in s["top"])
        assert abs(sum(s["by_kind"].values()) - s["busy_us"]) < 1e-6 * s["busy_us"] + 1e-9
    # a verify runs matmuls; the round's profile holds at least the verify's kinds of work
    assert "matmul" in r["profile"]["verify"]["by_kind"]
    assert summary_lines("step", r["profile"]["step"])[0].startswith("step: ")
    # device kernel names as cuBLAS, inductor and SDPA name them
    assert [kind_of(n) for n in ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "nvjet_hsh_128x64_64x4_1x2_h_bz_TNT",
                                 "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "flash_fwd_splitkv_kernel",
                                 "fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "void at::native::index_elementwise_kernel",
                                 "cudaGraphLaunch")] == \
        ["matmul", "matmul", "fused (triton)", "attention", "attention", "copy / index", "other"]


def test_prompt_file_errors_name_the_file_and_line(tmp_path):
    """A bench prompt file is read line by line: an empty or non-string prompt, a line that
    is not an object with a prompt, a missing or empty file are one-line errors naming the
    file (and the line); an empty prompt used to pass here and fail later without either."""
    from dflash_torch.bench.modes import load_prompts

    f = tmp_path / "p.jsonl"
    for lines, words in [(['{"prompt": "a"}', '{"prompt": ""}'], f"{f}:2: the prompt must be a non-empty string, got ''"),
                         (['{"text": 5}'], f"{f}:1: the prompt must be a non-empty string, got 5"),
                         (['["a"]'], f"{f}:1: expected a JSON object with a 'prompt' (or 'text') field, or 'messages'"),
                         (['{"messages": []}'], f"{f}:1: 'messages' must be a non-empty list of chat messages "
                                                '({"role": ..., "content": ...} objects), got []'),
                         (['{"messages": ["hi"]}'], f"{f}:1: 'messages' must be a non-empty list of chat messages "
                                                    '({"role": ..., "content": ...} objects), got [\'hi\']'),
                         (['{"messages": [{"role": "user", "content": "a"}], "text": "a"}'],
                          f"{f}:1: the object has 'text' and 'messages': which is the prompt? keep one"),
                         (['{"prompt": "a", "text": "b"}'], f"{f}:1: the object has 'prompt' and 'text': which is the "
                                                            "prompt? keep one"),
                         (['{"messages": [{"role": "user", "content": "\\udfff"}]}'],
                          f"{f}:1: the prompt is not valid Unicode text (a lone surrogate escape)"),
                         (['{"prompt": "' + "x" * 80 + '", "x": 1}', '{"text": ["' + "y" * 80 + '"]}'],
                          f"{f}:2: the prompt must be a non-empty string, got ['{'y' * 55}..."),
                         (['{"prompt": "a"}', '{oops'], f"{f}:2: not valid JSON (Expecting property name enclosed in "
                                                        "double quotes)"),
                         (['{"prompt": "a\\ud800"}'], f"{f}:1: the prompt is not valid Unicode text (a lone surrogate escape)"),
                         ([""], f"{f} has no prompts")]:
        f.write_text("\n".join(lines))
        with pytest.raises(DFlashError) as err:
            load_prompts(f, None)
        assert str(err.value) == words
    with pytest.raises(DFlashError, match="does not exist"):
        load_prompts(tmp_path / "none.jsonl", None)
    with pytest.raises(DFlashError, match="is a directory; pass a JSONL file"):  # (it said "does not exist")
        load_prompts(tmp_path, None)
    f.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')  # (latin-1: a traceback before)
    with pytest.raises(DFlashError) as err:
        load_prompts(f, None)
    assert str(err.value) == f"{f}:2: not UTF-8 text (byte 0xe9)"


def test_prompt_fields_bench_ignores_are_named_once(tmp_path, capsys):
    """Fields of a prompt line that bench does not read (a request's sampling settings: it
    decodes greedily at --max-new-tokens) are named in one WARNING line, with the count of the
    lines used that have them (they were ignored without a word); the shipped set's labels
    (id, module) and null fields are not."""
    from dflash_torch.bench.modes import load_prompts
    from dflash_torch.engine import ASSETS

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "def f(x):", "max_tokens": 3, "temperature": 1}\n{"prompt": "a", "id": "x", "seed": null}\n'
                 '{"messages": [{"role": "user", "content": "b"}], "temperature": 0}\n{"prompt": "c", "stop": ["x"]}\n')
    assert load_prompts(f, 3) == ["def f(x):", "a", [{"role": "user", "content": "b"}]]
    assert capsys.readouterr().err == (f"WARNING: {f}: bench ignores the fields 'max_tokens', 'temperature' (2 lines): "
                                       "it decodes greedily, --max-new-tokens tokens per prompt\n")
    load_prompts(f, 1)
    assert "the fields 'max_tokens', 'temperature' (1 line)" in capsys.readouterr().err
    load_prompts(ASSETS / "prompts.jsonl", None)
    assert capsys.readouterr().err == ""
    f.write_text('{"prompt": "a"}\n\n{"text": "b", "prompt": null}\n{"messages": [{"role": "user", "content": "c"}], '
                 '"text": null}\n')  # (a null field is absent, as in train's records: trial-146)
    assert load_prompts(f, None) == ["a", "b", [{"role": "user", "content": "c"}]] and load_prompts(f, 1) == ["a"]


def test_a_prompt_longer_than_the_context_is_one_line(tiny_pair, tmp_path, capsys):
    """A prompt that alone exceeds the target's context (1024 tokens) is named in one line,
    exit 2 (it was an IndexError traceback from the cache)."""
    from dflash_torch.cli import main as cli_main

    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):"}) + "\n" + json.dumps({"prompt": "x = 1\n" * 2000}) + "\n")
    rc = cli_main(["bench", "--target", str(tiny_pair[0]), "--modes", "target-only", "--prompts", str(prompts),
                   "--max-new-tokens", "4", "--sweep", "", "--no-progress", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "error: prompt 2 (" in err[0] and "exceeds the target's context of 1024 tokens" in err[0], err


def test_target_only_modes_need_no_drafter_and_a_drafting_mode_says_what_to_do(tiny_pair, tmp_path, capsys):
    """A target without a drafter can be timed target-only (it used to be refused with "needs
    --draft ... (or --no-draft)", and bench refuses --no-draft); a drafting mode without
    --draft names --draft and --modes, not --no-draft."""
    from dflash_torch.cli import main as cli_main

    target, _ = tiny_pair
    base = ["bench", "--target", str(target), "--num-prompts", "1", "--max-new-tokens", "4", "--sweep", "",
            "--no-progress"]
    assert cli_main(base + ["--modes", "target-only", "--out", str(tmp_path / "o")]) == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "o" / "bench.json").read_text())
    assert [m["name"] for m in report["modes"]] == ["target-only"] and report["draft"] is None
    capsys.readouterr()
    for modes in ("target-only,inject", "target-only"):
        extra = ["--batch-sizes", "1"] if modes == "target-only" else []
        assert cli_main(base + ["--modes", modes, "--out", str(tmp_path / "p"), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--draft" in err[0] and "--no-draft" not in err[0], err


def test_the_default_sweep_is_skipped_quietly_without_a_drafter(tiny_pair, tmp_path, capsys):
    """A target without --draft skips the default --sweep (nothing to sweep) and says nothing;
    an explicit --sweep is refused before anything is timed (it was skipped silently, exit 0,
    "sweep": null); --sweep '' is fine."""
    from dflash_torch.cli import main as cli_main

    target, _ = tiny_pair
    base = ["bench", "--target", str(target), "--num-prompts", "1", "--max-new-tokens", "2", "--modes", "target-only",
            "--no-progress"]
    for i, extra in enumerate(([], ["--sweep", ""], ["--sweep", " "])):
        out = tmp_path / f"o{i}"
        assert cli_main(base + ["--out", str(out), *extra]) == 0, (extra, capsys.readouterr().err)
        assert json.loads((out / "bench.json").read_text())["sweep"] is None
        assert not (out / "sweep.png").exists() and "sweep" not in capsys.readouterr().err
    assert cli_main(base + ["--out", str(tmp_path / "p"), "--sweep", "128,512"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--sweep" in err[0] and "--draft" in err[0], err
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("flag, value", [
    ("--sweep", "128,,256"), ("--sweep", "128,"), ("--batch-sizes", ",2"), ("--modes", "target-only,,inject"),
    ("--shapes", "qwen3-0.6b, ,qwen3-8b"), ("--sweep-shapes", "qwen3-0.6b,"),
])
def test_an_empty_item_in_a_comma_list_is_refused(tiny_pair, tmp_path, capsys, flag, value):
    """``--sweep 128,,256`` (or an empty item in another comma list) is one line naming the
    option, exit 2, before anything is timed (it was dropped silently: 128,256 was timed);
    a whole value that is empty still means none (the test above, ``--modes ''``)."""
    from dflash_torch.cli import main as cli_main

    target, drafter = tiny_pair
    args = ["bench", "--target", str(target), "--draft", str(drafter), "--out", str(tmp_path / "o"),
            "--modes", "target-only", "--num-prompts", "1", "--max-new-tokens", "2", "--sweep", "", "--no-progress"]
    rc = cli_main(args + [flag, value])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert rc == 2 and err == [f"dflash-torch: error: {flag} has an empty item in {value!r}: separate its items with "
                               "single commas"], err
    assert "target-only:" not in captured.out and not (tmp_path / "o").exists()


def test_bench_tau_counts_the_tokens_kept_when_the_last_round_overshoots(agree_pair):
    """An agreeable pair accepts long blocks, so the round that reaches --max-new-tokens
    commits more than is kept: tau counts only what is kept, as the DFlash reference's
    ``produced`` (helper-26: bench's tau was 15-25% above tokens / rounds at 32 tokens)."""
    from dflash_torch.bench.batching import batch_size_bench
    from dflash_torch.bench.modes import ALL_MODES, run_modes
    from dflash_torch.models.target import TargetModel

    target = TargetModel.from_pretrained(agree_pair[0], torch.float32)
    drafter = DFlashDrafter.from_pretrained(agree_pair[1], torch.float32)
    prompts = [list(range(5, 12)), list(range(40, 49))]
    for n in (10, 21):
        (res, outputs), = run_modes([ALL_MODES["inject"]], target, drafter, prompts, block_size=None,
                                    max_new_tokens=n, max_context=128, warmup_prompts=0, progress=False)
        assert [len(o) for o in outputs] == [n, n] and (res.generated_tokens, res.decode_tokens) == (2 * n, 2 * (n - 1))
        assert sum(tau * k for tau, k in res.acceptance_histogram.items()) == res.decode_tokens
        assert max(res.acceptance_histogram) > 1  # (long blocks were accepted)
        rows = batch_size_bench(target, drafter, prompts, [2], n, progress=False)
        dflash = next(r for r in rows if r["mode"] == "dflash")
        assert dflash["mean_acceptance_length"] * dflash["mean_batch"] * dflash["rounds"] == \
            pytest.approx(dflash["decode_tokens"])


def test_a_sweep_past_the_pairs_context_says_so(tiny_pair, tmp_path, capsys):
    """``--sweep`` lengths above the target's context (1024 here) are timed (the drafter's
    cost at that length) with a note that this pair cannot reach them; those within it are not named."""
    from dflash_torch.cli import main as cli_main

    target, drafter = tiny_pair
    rc = cli_main(["bench", "--target", str(target), "--draft", str(drafter), "--out", str(tmp_path / "o"),
                   "--dtype", "float32", "--modes", "target-only", "--num-prompts", "1", "--max-new-tokens", "4",
                   "--sweep", "128,1024,2048", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert ("note: --sweep lengths 2048 exceed the target's context of 1024 tokens: the loaded drafter's sweep times "
            "contexts this pair cannot reach (the cost alone)\n") in err
    assert json.loads((tmp_path / "o" / "bench.json").read_text())["sweep"]["lengths"] == [128, 1024, 2048]
    # (the default sweep's 8192 is past most pairs' context, the shipped pair's 4096 too: no note every run,
    # trial-140; its lengths past the context are left out of the pair's sweep, said in one line under its
    # table, trial-282: it timed the shipped drafter at 8192)
    assert cli_main(["bench", "--target", str(target), "--draft", str(drafter), "--out", str(tmp_path / "o"),
                     "--dtype", "float32", "--modes", "target-only", "--num-prompts", "1", "--max-new-tokens", "4",
                     "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "note: --sweep" not in captured.err
    assert json.loads((tmp_path / "o" / "bench.json").read_text())["sweep"]["lengths"] == [128, 512]
    assert ("| 512 | " in captured.out and "ratio 512/128: " in captured.out and "\n(the default sweep leaves out 2048, "
            "8192 for the loaded drafter: past the target's context of 1024 tokens; --sweep 128,512,2048,8192 times its "
            "propose there too)\n") in captured.out, captured.out


def test_compiled_modes_build_every_length_bucket_before_the_timed_decodes(tmp_path, tokenizer_dir, monkeypatch):
    """A compiled mode's timed decodes compile nothing, whatever the acceptance lengths.

    The pair accepts all 16 tokens of every block, so a decode starting at position p
    runs rounds at p, p + 16, ...; the length buckets here are 256, 512 and 768 keys (the
    caches of max_context 500 hold 768 positions), a round at s reaching 768 when
    s + 16 > 512. The timed decode of the 17-token prompt has a round at 497; the warm-up's
    decode of the 5-token prompt to the context limit (495 tokens) has its last round at
    485: it never reached 768, whose graphs were then built in a timed decode (as bench on
    the shipped pair did: "inject-compiled: 2 recompile(s) after warm-up").
    torch.compile runs with dynamo's "eager" backend: every graph is traced and counted as
    with inductor, at a fraction of the compile time."""
    from conftest import make_agreeable_pair

    from dflash_torch.bench.modes import ALL_MODES, run_modes
    from dflash_torch.models.target import TargetModel

    target_dir, drafter_dir = make_agreeable_pair(tmp_path, tokenizer_dir, alpha=1.0, self_scale=0.0)
    target = TargetModel.from_pretrained(target_dir, torch.float32)
    drafter = DFlashDrafter.from_pretrained(drafter_dir, torch.float32)
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **opts: compile_(fn, **{**opts, "backend": "eager"}))
    prompts = [list(range(5, 10)), list(range(40, 57))]
    for warmup_prompts in (1, 0):
        torch._dynamo.reset()
        (res, outputs), = run_modes([ALL_MODES["inject-compiled"]], target, drafter, prompts, block_size=None,
                                    max_new_tokens=482, max_context=500, warmup_prompts=warmup_prompts, progress=False)
        assert res.acceptance_histogram == {1: 2, 16: 60}  # (whole blocks; each decode's last round keeps 1)
        assert res.eager_fallbacks == 0
        if warmup_prompts:
            assert res.recompiles_after_warmup == 0
        else:  # without a warm-up every graph is built while timed, and counted
            assert res.recompiles_after_warmup > 0


def test_bench_help_leaves_out_the_decoding_options_it_refuses(tmp_path, capsys, monkeypatch):
    """bench picks the decoding with --modes and sizes the context itself: its --help does not
    offer --no-draft, --compile, --draft-mode, --max-context and --prefill-chunk (generate's
    still does), and each is still refused in one line."""
    from dflash_torch.cli import main as cli_main

    monkeypatch.setenv("COLUMNS", "1000")
    refused = ["--no-draft", "--compile", "--draft-mode", "--max-context", "--prefill-chunk"]
    for command in ("bench", "generate"):
        with pytest.raises(SystemExit):
            cli_main([command, "--help"])
        text = capsys.readouterr().out  # (an option in the usage line "[--flag ...]" or starting a line of its own)
        offered = [flag for flag in refused if re.search(rf"(\[|^\s+){flag}\b(?!-)", text, re.M)]
        assert offered == ([] if command == "bench" else refused), command
    for extra in (["--no-draft"], ["--compile"], ["--draft-mode", "recompute"], ["--draft-mode", "inject"], ["--max-context", "100"],
                  ["--prefill-chunk", "64"]):
        assert cli_main(["bench", "--out", str(tmp_path / "o"), *extra]) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and extra[0] in err[0], (extra, err)
        if extra[0] in ("--no-draft", "--compile", "--draft-mode"):  # (the flag given alone: it named all three)
            assert err[0].endswith(f"with --modes; drop {extra[0]}"), err


@pytest.mark.parametrize("extra, words", [
    (["--max-new-tokens", "1"], "--max-new-tokens must be >= 2 for bench, got 1: the first token comes from the prefill"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 2 for bench, got 0: the first token comes from the prefill"),
    (["--shapes", "qwen3-0.6b", "--block-size", "1"], "--shapes times DFlash rounds of --block-size tokens, which must be "
                                                      ">= 2, got 1"),
    (["--no-draft-given", "--shapes", "qwen3-0.6b"], "--shapes times DFlash rounds at the drafter's block size, and this "
                                                     "target has no --draft"),
    (["--no-draft-given", "--sweep", "64", "--sweep-shapes", "qwen3-0.6b"], "--sweep-shapes times DFlash rounds"),
    (["--no-draft-given", "--sweep", "128,512"], "--sweep times the drafter's propose at these context lengths, and "
                                                 "this target has no --draft: add --draft or drop --sweep"),
    (["--sweep-shapes", "qwen3-0.6b"], "--sweep-shapes sweeps the --sweep context lengths, and --sweep is empty"),
    (["--sweep", "128,64,128"], "--sweep lists a context length more than once"),
    (["--prompts", ""], "--prompts is empty"),
    (["--out", ""], "--out is empty"),
    (["--batch-sizes", "100000"], "--batch-sizes 100000: the caches of 100000 sequences x "),
    (["--bench-json-is-a-dir"], "bench.json: it is a directory"),
    (["--part-is-a-dir"], "bench.json.part: it is a directory"),
    (["--shapes", "qwen3-0.6b", "--shapes-compiled"], "--shapes-compiled times shape qwen3-0.6b with all 28 layers in "
                                                      "memory; only 3 fit on cpu"),
])
def test_bench_refuses_what_it_can_check_before_timing(tiny_pair, tmp_path, capsys, monkeypatch, extra, words):
    """Each of these was refused (or a traceback, or a silent no-op) only after the modes
    had been timed, or named options bench does not have (max_batch_size, --max-context):
    now one line, exit 2, naming bench's own flags, before anything is timed (helper-74)."""
    from dflash_torch.bench import batching, shapes
    from dflash_torch.cli import main as cli_main

    monkeypatch.setattr(batching, "available_memory", lambda device: 2**30)  # a 1 GiB machine for the caches
    monkeypatch.setattr(shapes, "device_memory", lambda device: 2**31)  # qwen3-0.6b in float32: 4 of 28 layers fit
    target, drafter = tiny_pair
    out = tmp_path / "o"
    args = ["bench", "--target", str(target), "--draft", str(drafter), "--out", str(out), "--dtype", "float32",
            "--modes", "target-only", "--num-prompts", "1", "--max-new-tokens", "4", "--sweep", "", "--no-progress"]
    if "--no-draft-given" in extra:
        args[3:5] = []
    if "--bench-json-is-a-dir" in extra:
        (out / "bench.json").mkdir(parents=True)
    if "--part-is-a-dir" in extra:
        (out / "bench.json.part").mkdir(parents=True)
    rc = cli_main(args + [a for a in extra if a not in ("--no-draft-given", "--bench-json-is-a-dir", "--part-is-a-dir")])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and words in err[0], err
    assert "max_batch_size" not in err[0] and "--max-context" not in err[0], err
    assert "target-only:" not in captured.out  # (nothing was timed)


def test_unmeasured_figures_are_none_not_zero_or_a_division_by_zero(tiny_pair):
    """With one new token (it comes from the prefill) no decoding round runs: tok/s, tau and
    their ratios are None ("-"), not 0.0 (run_modes) or a ZeroDivisionError (batch_size_bench)."""
    from dflash_torch.bench.batching import batch_size_bench, batch_table
    from dflash_torch.bench.cli import _table
    from dflash_torch.bench.modes import ALL_MODES, run_modes
    from dflash_torch.models.target import TargetModel

    target = TargetModel.from_pretrained(tiny_pair[0], torch.float32)
    drafter = DFlashDrafter.from_pretrained(tiny_pair[1], torch.float32)
    prompts = [list(range(5, 12)), list(range(40, 49))]
    runs = run_modes([ALL_MODES["target-only"], ALL_MODES["inject"]], target, drafter, prompts, block_size=4,
                     max_new_tokens=1, max_context=64, warmup_prompts=0, progress=False)
    for res, outputs in runs:
        assert [len(o) for o in outputs] == [1, 1] and res.rounds == 0
        assert res.decode_tokens_per_second is None and res.mean_acceptance_length is None
    row = [line for line in _table([asdict(res) for res, _ in runs]).splitlines() if line.startswith("| inject")][0]
    assert row.split("|")[2].strip() == "-" and row.split("|")[5].strip() == "-"
    rows = batch_size_bench(target, drafter, prompts, [1, 2], 1, block_size=4, progress=False)
    for r in rows:
        assert r["aggregate_decode_tokens_per_second"] is None and r["mean_acceptance_length"] is None
        assert r["speedup_vs_target_only"] is None and r["scaling_vs_batch_1"] is None
    assert "| 2 | dflash |" in batch_table(rows)


def test_batch_caches_bytes_is_what_the_batch_decoder_counts(tiny_pair, monkeypatch):
    """bench refuses a batch size whose caches cannot fit before timing, without allocating
    them: its count is the batch decoder's own (just above it the decoder refuses, in bench's
    words; just below, it is built)."""
    from dflash_torch import batch
    from dflash_torch.bench.batching import _batch_decoder, batch_caches_bytes
    from dflash_torch.cache import FIT_MARGIN
    from dflash_torch.models.target import TargetModel

    target = TargetModel.from_pretrained(tiny_pair[0], torch.float32)
    drafter = DFlashDrafter.from_pretrained(tiny_pair[1], torch.float32)
    for d, block_size in ((drafter, 4), (drafter, None), (None, None)):
        need = batch_caches_bytes(target, d, 3, 100, block_size)
        for scale, fits in ((0.999, False), (1.001, True)):
            monkeypatch.setattr(batch, "available_memory", lambda device, free=need / 0.9 * scale: free)
            if fits:
                _batch_decoder(target, d, 3, 100, block_size, None)
            else:
                with pytest.raises(DFlashError, match=r"^--batch-sizes 3: the caches of 3 sequences x 100 positions \(the "
                                                      r"longest prompt \+ --max-new-tokens\) need .*; lower --batch-sizes "
                                                      r"or --max-new-tokens \(3 sequences of at most (\d+) positions "
                                                      r"fit in 90% of that\)$") as err:
                    _batch_decoder(target, d, 3, 100, block_size, None)
                most = int(re.search(r"at most (\d+) positions", str(err.value)).group(1))
                room = need * scale * FIT_MARGIN  # (the figure stays a little below the line: it fits when passed back)
                assert most < 100 and batch_caches_bytes(target, d, 3, most, block_size) <= room  # (it fits)
                assert batch_caches_bytes(target, d, 3, most + 1, block_size) > room  # (one more does not)


def test_batch_sizes_build_one_decoder_at_a_time(tiny_pair, monkeypatch):
    """Each batch decoder's caches are freed before the next are allocated, so the up-front
    check, which counts one decoder's, holds (the target-only decoder was alive while the
    DFlash one was built: a batch size between about 56% and 90% of free memory passed the
    check and was refused after the modes were timed)."""
    import weakref

    from dflash_torch.bench import batching
    from dflash_torch.models.target import TargetModel

    target = TargetModel.from_pretrained(tiny_pair[0], torch.float32)
    drafter = DFlashDrafter.from_pretrained(tiny_pair[1], torch.float32)
    built, build = [], batching._batch_decoder

    def tracked(*args):
        alive = [ref for ref in built if ref() is not None]
        assert not alive, f"{len(alive)} earlier decoder(s) alive"
        decoder = build(*args)
        built.append(weakref.ref(decoder))
        return decoder

    monkeypatch.setattr(batching, "_batch_decoder", tracked)
    rows = batching.batch_size_bench(target, drafter, [[5, 6, 7], [8, 9]], [1, 2], 4, progress=False)
    assert len(built) == 4 and len(rows) == 4


def test_batch_sizes_with_a_prompt_that_fills_the_context(tiny_pair, tmp_path, capsys):
    """A prompt + --max-new-tokens exactly the target's context (1024): the batch caches are
    capped at it, as the modes' are (they asked for 1025 positions: "--max-context must be an
    integer in [2, 1024]" after the modes were timed, and no bench.json)."""
    from dflash_torch.cli import main as cli_main

    target, drafter = tiny_pair
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"prompt": "x = 1\n" * 200}) + "\n")
    args = ["bench", "--target", str(target), "--draft", str(drafter), "--prompts", str(prompts), "--sweep", "",
            "--modes", "target-only", "--batch-sizes", "1", "--block-size", "4", "--no-progress",
            "--out", str(tmp_path / "o")]
    assert cli_main(args + ["--max-new-tokens", "5000"]) == 2  # (the error names the prompt's length)
    n = int(re.search(r"prompt 1 \((\d+) tokens\)", capsys.readouterr().err).group(1))
    assert 900 < n < 1022, n
    rc = cli_main(args + ["--max-new-tokens", str(1024 - n)])
    err = capsys.readouterr().err
    assert rc == 0, err
    rows = json.loads((tmp_path / "o" / "bench.json").read_text())["batch_sizes"]
    assert [r["mode"] for r in rows] == ["target-only", "dflash"] and rows[1]["outputs_identical_to_target_only"]
    assert all(r["generated_tokens"] == 4 * (1024 - n) for r in rows)


def test_bench_json_survives_a_plot_that_cannot_be_written_and_stale_plots_go(tiny_pair, tmp_path, capsys,
                                                                              monkeypatch):
    """The plots are written after bench.json; one that fails is one line (exit 2), the
    results kept (bench.json lists no plot then, and no earlier run's plot is left), as where
    matplotlib cannot be imported. A plot this run does not make (an earlier
    run's sweep.png, batch_sizes.png) is removed from --out: it would not show these results."""
    from dflash_torch.bench import cli as bench_cli
    from dflash_torch.cli import main as cli_main

    target, drafter = tiny_pair
    out = tmp_path / "o"
    out.mkdir()
    for name in ("sweep.png", "batch_sizes.png", "mine.png"):
        (out / name).write_bytes(b"old")
    args = ["bench", "--target", str(target), "--draft", str(drafter), "--out", str(out), "--modes", "target-only",
            "--num-prompts", "1", "--max-new-tokens", "4", "--sweep", "", "--no-progress"]
    assert cli_main(args) == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "mine.png", "modes.png"]
    assert json.loads((out / "bench.json").read_text())["plots"] == [str(out / "modes.png")]
    (out / "bench.json").unlink()

    def no_room(report, where):
        raise OSError(28, "No space left on device", str(where / "modes.png"))

    monkeypatch.setattr(bench_cli, "_plots", no_room)
    rc = cli_main(args)
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert rc == 2 and err == [f"dflash-torch: error: wrote {out / 'bench.json'}, but cannot write the plot "
                               f"{out / 'modes.png'}: No space left on device"], err
    report = json.loads((out / "bench.json").read_text())
    assert [m["name"] for m in report["modes"]] == ["target-only"] and report["plots"] == []
    assert not (out / "modes.png").exists()  # (the earlier run's: not of these results, which list no plot)
    assert "| target-only" in captured.out  # (the table was printed before the plots)
    # bench.json itself cannot be written (here: no room on the device): the tables are printed,
    # an earlier bench.json is left whole (it was truncated), one line says so
    monkeypatch.undo()
    # (matplotlib that cannot be imported, as uninstalled: the same, one line saying what to install;
    # it was a traceback after the whole run, and bench.json listed the plot it did not write)
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "matplotlib", None)
        rc = cli_main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"dflash-torch: error: wrote {out / 'bench.json'}, but cannot draw the plots: matplotlib "
                               "cannot be imported (import of matplotlib halted; None in sys.modules); pip install "
                               "--upgrade matplotlib"], err
    assert json.loads((out / "bench.json").read_text())["plots"] == []
    before = (out / "bench.json").read_text()

    def full(self, text, *a, **k):
        raise OSError(28, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_text", full)
    rc = cli_main(args)
    monkeypatch.undo()
    captured = capsys.readouterr()
    assert rc == 2 and captured.err.strip().splitlines() == [
        f"dflash-torch: error: cannot write {out / 'bench.json'}: No space left on device (the figures are printed "
        "above)"], captured.err
    assert "| target-only" in captured.out and (out / "bench.json").read_text() == before
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "mine.png"]


def test_prompt_file_may_be_a_pipe(tmp_path):
    """``--prompts /dev/stdin`` or a process substitution (a pipe, not a regular file) is read
    (it was refused: "does not exist")."""
    import os
    import threading

    from dflash_torch.bench.modes import load_prompts

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def feed():
        with open(fifo, "w") as f:
            f.write('{"prompt": "a"}\n{"prompt": "b"}\n')

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        assert load_prompts(fifo, None) == ["a", "b"]
    finally:
        if writer.is_alive():  # (refused without reading: let the writer's open return)
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        writer.join(10)


def test_bench_prompts_dash_reads_stdin(tiny_pair, tmp_path, cli):
    """``bench --prompts -`` reads the JSONL prompts from stdin (it said "prompt file - does not
    exist"); an error in them names <stdin> and the line. (Run in this process, :func:`conftest.cli`.)"""
    target, drafter = tiny_pair
    args = ["bench", "--target", str(target), "--prompts", "-", "--max-new-tokens", "4", "--modes", "target-only",
            "--sweep", "", "--out", str(tmp_path / "out"), "--no-progress"]
    proc = cli(*args, stdin='{"prompt": "x = 1"}\n{"prompt": "y = 2"}\n')
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["prompts"] == 2
    proc = cli(*args, stdin='{"prompt": "x = 1"}\nnot json\n')
    assert proc.returncode == 2 and proc.stderr == "dflash-torch: error: <stdin>:2: not valid JSON (Expecting value)\n"


def test_a_refused_chat_prompt_is_one_line_even_with_fewer_prompts_than_asked(tiny_pair, tmp_path, capsys):
    """One prompt whose messages the checks refuse, with --num-prompts 2: only the error (the
    "fewer than --num-prompts" note came first, for a file that was then refused)."""
    from dflash_torch.cli import main as cli_main

    prompts = tmp_path / "bad.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi", "image_url": "x.png"}]}) + "\n")
    rc = cli_main(["bench", "--target", str(tiny_pair[0]), "--modes", "target-only", "--prompts", str(prompts),
                   "--num-prompts", "2", "--max-new-tokens", "4", "--sweep", "", "--no-progress",
                   "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "error: prompt 1: chat message 0 holds 'image_url'" in err[0], err


def test_batch_sizes_are_timed_in_increasing_order_and_one_prompt_is_singular(tiny_pair, tmp_path, capsys):
    """``--batch-sizes 2,1`` is reported 1 then 2, as --sweep lengths are sorted (the plot's
    line doubled back); one prompt is "the 1 prompt cycled"."""
    from dflash_torch.cli import main as cli_main

    target, drafter = tiny_pair
    out = tmp_path / "o"
    rc = cli_main(["bench", "--target", str(target), "--draft", str(drafter), "--num-prompts", "1", "--modes", "",
                   "--sweep", "", "--batch-sizes", "2,1", "--block-size", "4", "--max-new-tokens", "3",
                   "--no-progress", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    rows = json.loads((out / "bench.json").read_text())["batch_sizes"]
    assert [r["batch_size"] for r in rows] == [1, 1, 2, 2]
    table = [line.split("|")[1].strip() for line in captured.out.splitlines() if re.match(r"\| \d+ \|", line)]
    assert table == ["1", "1", "2", "2"], captured.out
    assert "the 1 prompt cycled" in captured.out, captured.out


def test_bench_writes_its_files_whatever_stdout_cannot_take(tiny_pair, tmp_path, capsys, monkeypatch):
    """bench's files are its product: a stdout whose reader went away (``| true``) stops the
    printing only, the files are written and the status is 0 (the run was lost quietly: no --out
    at all, status 0); a full disk (``> /dev/full``) is one line, status 1, the files written (it
    was an OSError traceback); a closed stdout (``>&-``) is refused before anything runs, as
    generate refuses it (bench ran to the end, status 0)."""
    import os

    from dflash_torch.cli import main as cli_main

    target, drafter = tiny_pair
    args = ["bench", "--target", str(target), "--draft", str(drafter), "--modes", "target-only,inject", "--num-prompts",
            "1", "--max-new-tokens", "4", "--sweep", "", "--no-progress"]
    read, write = os.pipe()
    os.close(read)  # (the reader went away before the first line)
    with open(write, "w") as gone, open("/dev/full", "w") as full:
        for stdout, code, err in ((gone, 0, []), (full, 1, ["dflash-torch: error: cannot write the output to stdout: "
                                                             "No space left on device"])):
            out = tmp_path / str(code)
            monkeypatch.setattr(sys, "stdout", stdout)
            rc = cli_main(args + ["--out", str(out)])
            monkeypatch.undo()
            assert (rc, capsys.readouterr().err.splitlines()) == (code, err)
            assert sorted(p.name for p in out.iterdir()) == ["bench.json", "modes.png"]
            assert [m["name"] for m in json.loads((out / "bench.json").read_text())["modes"]] == ["target-only", "inject"]
    monkeypatch.setattr(sys, "stdout", None)
    rc = cli_main(args + ["--out", str(tmp_path / "closed")])
    monkeypatch.undo()
    assert (rc, capsys.readouterr().err) == (1, "dflash-torch: error: stdout is closed: nowhere to write the output\n")
    assert not (tmp_path / "closed").exists()


def test_bench_json_records_the_commit_of_a_hub_id_and_draws_no_bar_in_a_file(tiny_pair, tmp_path, capsys, monkeypatch):
    """bench.json recorded a Hub id as given (``acme/t@main``), not the commit it loaded (main
    moves): ``target_revision`` / ``draft_revision`` are the cached snapshots' commits, null for
    a local directory. Its stderr not a terminal, no progress bar is drawn there (a log file
    filled with the bar's \\r-separated redraws) (trial-284)."""
    from huggingface_hub import constants
    from test_errors import _cache_repo

    from dflash_torch.cli import main as cli_main

    target, drafter = tiny_pair
    _cache_repo(tmp_path / "hub", "acme/t", target)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "o"
    rc = cli_main(["bench", "--target", "acme/t@main", "--draft", str(drafter), "--modes", "target-only,inject",
                   "--num-prompts", "1", "--max-new-tokens", "4", "--sweep", "", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 0 and "\r" not in err and "decode" not in err, err
    report = json.loads((out / "bench.json").read_text())
    assert (report["target"], report["target_revision"], report["draft"], report["draft_revision"]) == \
        ("acme/t@main", "a" * 40, str(drafter), None)


def test_plots_need_no_writable_home(tmp_path):
    """matplotlib's config directory that cannot be made (a read-only home; here a home that
    is a file) was a multi-line warning in bench's output (trial-300); pyplot() draws the
    same, quietly (matplotlib imported afresh, in a subprocess)."""
    home = tmp_path / "home"
    home.write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("MPLCONFIGDIR", "XDG_CONFIG_HOME", "XDG_CACHE_HOME")}
    code = ("from dflash_torch.bench import pyplot; plt = pyplot(); fig, ax = plt.subplots(); ax.plot([1, 2]); "
            f"fig.savefig({str(tmp_path / 'p.png')!r})")
    run = subprocess.run([sys.executable, "-c", code], env={**env, "HOME": str(home)}, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert (tmp_path / "p.png").stat().st_size > 0
