"""The bench command end to end on a tiny pair, and the large-shape timing helper."""

import json
import subprocess
import sys

import torch

from dflash_torch.bench.shapes import round_vs_step
from dflash_torch.bench.sweep import context_sweep
from dflash_torch.models.drafter import DFlashDrafter


def test_bench_cli_writes_report(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):", "import os\n"]))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_torch.cli", "bench", "--target", str(target), "--draft", str(drafter),
         "--prompts", str(prompts), "--max-new-tokens", "12", "--modes", "target-only,inject,recompute",
         "--sweep", "16,64", "--out", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "bench.json").read_text())
    names = [m["name"] for m in report["modes"]]
    assert names == ["target-only", "inject", "recompute"]
    for m in report["modes"]:
        assert m["generated_tokens"] == 2 * 11  # 12 tokens per prompt, the first from prefill
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


def test_bench_rejects_unknown_mode(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_torch.cli", "bench", "--target", str(target), "--draft", str(drafter),
         "--modes", "warp-speed", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown bench mode" in proc.stderr and "Traceback" not in proc.stderr


def test_sweep_and_round_vs_step_small_shape(tiny_pair):
    _, drafter_dir = tiny_pair
    drafter = DFlashDrafter.from_pretrained(drafter_dir, torch.float32)
    embed = torch.nn.Embedding(drafter.config.vocab_size, drafter.config.hidden_size)
    sweep = context_sweep(drafter, embed, [8, 32], block_size=4, repeats=1)
    assert all(t > 0 for t in sweep["inject"] + sweep["recompute"])
    r = round_vs_step((64, 4, 4, 2, 16, 128), torch.float32, context=16, block_size=4, repeats=1, vocab=128, draft_layers=2)
    assert r["target_step_s"] > 0 and r["round_s"] > 0
    assert r["projected_speedup"]["mean (paper, Qwen3-8B)"] == 6.49 * r["target_step_s"] / r["round_s"]


def test_shape_drafter_is_usable_for_the_sweep():
    from dflash_torch.bench.shapes import build_drafter
    from dflash_torch.models.rope import rope_inv_freq

    drafter, embed = build_drafter((64, 6, 4, 2, 16, 128), torch.float32, "cpu", draft_layers=2, block_size=4)
    assert drafter.config.num_hidden_layers == 2 and drafter.config.target_layer_ids == [1, 3]
    # the rope table is rebuilt after the meta-device init (to_empty leaves buffers unset)
    assert torch.equal(drafter.rotary.inv_freq, rope_inv_freq(16, 1e6, None))
    sweep = context_sweep(drafter, embed, [8, 32], block_size=4, repeats=1)
    assert all(t > 0 for t in sweep["inject"] + sweep["recompute"])


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
    assert (d["prompt"], d["index"], d["reference_token"], d["token"]) == (0, 3, ref[3], other)
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
             (["--sweep-shapes", "qwen9-huge"], "unknown shape"), (["--modes", "inject,target-only,inject"], "more than once")]
    for extra, words in cases:
        assert cli_main(base + extra) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], (extra, err)
