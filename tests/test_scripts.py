"""The measurement scripts of ``scripts/`` that the README names (and eval_default_pair.py,
which its make_default_pair.sh runs), in this process (``main(argv)``) on the shipped pair:
a bad option value, a file that cannot be read or an output path that cannot be written is
one line ``NAME.py: error: ...`` on stderr and exit status 2, as the ``dflash-torch``
command ends, before anything is measured (they were tracebacks: OptionError,
ZeroDivisionError, IndexError, StatisticsError, FileNotFoundError, IsADirectoryError; or a
``--num-prompts -1`` read as a Python slice, ``--threads`` beyond the CPUs taken)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from dflash_torch.options import usable_cpus

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
TOO_MANY = str((usable_cpus() or 1) + 1)  # (threads beyond the CPUs this process may use)


def run_script(name: str, argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """scripts/NAME.py's ``main(argv)`` here: (exit status, stdout, stderr)."""
    monkeypatch.setattr(sys, "path", [str(SCRIPTS), *sys.path])
    module = importlib.import_module(name)
    capsys.readouterr()
    try:
        module.main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


BAD = [  # (script, arguments, the error line's text after "NAME.py: error: ")
    ("eval_default_pair", ["--block-size", "99"], "--block-size must be an integer in [1, 16]"),
    ("eval_default_pair", ["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1, got 0"),
    ("eval_default_pair", ["--num-prompts", "-1"], "--num-prompts must be an integer >= 1, got -1"),
    ("eval_default_pair", ["--dtype", "float16"], "--dtype float16 is not supported"),
    ("eval_default_pair", ["--prompts", "/nonexistent/p.jsonl"], "prompt file /nonexistent/p.jsonl does not exist"),
    ("eval_default_pair", ["--out", "{tmp}"], "--out {tmp} is a directory"),
    ("eval_default_pair", ["--num-threads", TOO_MANY], "--threads must be an integer from 1 to the CPUs"),
    ("eval_default_pair", ["--num-prom", "3"], "unrecognized arguments: --num-prom 3; did you mean --num-prompts?"),
    ("draft_policy", ["--reps", "0"], "--reps must be an integer >= 1, got 0"),
    ("draft_policy", ["--requests", "0"], "--requests must be an integer >= 1, got 0"),
    ("draft_policy", ["--streams", "0"], "--streams must be an integer >= 1, got 0"),
    ("draft_policy", ["--threads", TOO_MANY], "--threads must be an integer from 1 to the CPUs"),
    ("draft_policy", ["--json", "{tmp}"], "--json {tmp} is a directory"),
    ("draft_policy", ["--dtype", "float16"], "--dtype float16 is not supported"),
    ("prefill_stalls", ["--streams", "0"], "--streams must be an integer >= 1, got 0"),
    ("prefill_stalls", ["--join-after", "-1"], "--join-after must be an integer >= 0, got -1"),  # (was a busy loop)
    ("prefill_stalls", ["--short-new-tokens", "1"],  # (a ValueError: no round, no gap between rounds)
     "--short-new-tokens must be an integer >= 2, got 1: the first token comes from the prefill"),
    ("draft_policy", ["--new-tokens", "1"],  # (a ZeroDivisionError: no decode time)
     "--new-tokens must be an integer >= 2, got 1: the first token comes from the prefill"),
    ("logit_bias_tau", ["--max-new-tokens", "1"],  # (a StatisticsError: no tau)
     "--max-new-tokens must be an integer >= 2, got 1: the first token comes from the prefill"),
    ("structured_tau", ["--max-new-tokens", "1"],
     "--max-new-tokens must be an integer >= 2, got 1: the first token comes from the prefill"),
    ("prefix_reuse", ["--json", "{tmp}"], "--json {tmp} is a directory"),
    ("prefix_reuse", ["--drafter", "{tmp}"], "--drafter: {tmp} has no config.json"),  # (named draft: the engine's)
    ("draft_policy", ["--drafter", "{tmp}"], "--drafter: {tmp} has no config.json"),
    ("prefix_reuse_batch", ["--conversations", "0"], "--conversations must be an integer >= 1, got 0"),
    ("prefix_reuse_batch", ["--system-tokens", "-1"], "--system-tokens must be an integer >= 0, got -1"),
    ("shared_prefill", ["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    ("logit_bias_tau", ["--prompts", "0"], "--prompts must be an integer >= 1, got 0"),
    ("structured_tau", ["--threads", TOO_MANY], "--threads must be an integer from 1 to the CPUs"),
    ("sink_attention_speed", ["--repeats", "0"], "--repeats must be an integer >= 1, got 0"),
    ("sliding_ring_memory", ["--contexts", "4096", "0"], "--contexts must be an integer >= 1, got 0"),
    ("long_prompt_tau", ["--extra", "0,x"], "--extra must be comma-separated integers, got '0,x'"),
    ("long_prompt_tau", ["--extra", "-1"], "--extra counts must be >= 0, got '-1'"),
    ("long_prompt_tau", ["--prompts", "64"], "--prompts must be below 64"),
    ("long_prompt_tau", ["--extra", "4000"], "--extra 4000 makes prompts of up to"),  # (past the target's context)
]


@pytest.mark.parametrize("script,argv,error", BAD, ids=[f"{s} {' '.join(a)}" for s, a, _ in BAD])
def test_bad_arguments_are_one_line_and_exit_2(script, argv, error, tmp_path, monkeypatch, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code, out, err = run_script(script, argv, monkeypatch, capsys)
    assert code == 2 and out == "", err
    assert len(err.splitlines()) == 1 and err.startswith(f"{script}.py: error: {error.replace('{tmp}', str(tmp_path))}"), err


def test_draft_policy_says_every_target_only_round_has_no_drafts(monkeypatch, capsys):
    """Its target-only line said "target-only rounds 0": the count of rounds the decoder ran
    without drafts for want of them, which target-only decoding (no drafter) never counts.
    Now each line gives its decode rounds without drafts out of its rounds: none of draft's,
    all of target-only's."""
    code, out, err = run_script("draft_policy", ["--reps", "1", "--requests", "2", "--new-tokens", "4", "--streams", "2"],
                                monkeypatch, capsys)
    assert code == 0, err
    lines = {line.split(":")[0].split()[-1]: line for line in out.splitlines() if line.startswith("rep 0 ")}
    draft, target_only = (lines[m].split("rounds without drafts ")[1].split(" of ") for m in ("draft", "target-only"))
    assert draft[0] == "0" and int(draft[1]) > 0, lines
    assert target_only[0] == target_only[1] and int(target_only[0]) > 0, lines
    assert "outputs identical across modes and reps: True" in out


def test_prefix_reuse_batch_shares_a_system_prompt_on_a_hybrid_pair(agree_hybrid_pair, monkeypatch, capsys):
    """With ``--system-tokens``, the conversations after the first (one slot: each joins when
    the last one left) take the system prompt from the last one's rows with the snapshot of the
    hybrid state where it ends (``shared_end``): 64 tokens each fewer read than without it,
    and the same tokens in every mode."""
    target, drafter = agree_hybrid_pair
    code, out, err = run_script("prefix_reuse_batch", ["--target", str(target), "--drafter", str(drafter),
                                                       "--system-tokens", "64", "--conversations", "3", "--turns", "1",
                                                       "--max-batch-size", "1", "--message-tokens", "8",
                                                       "--reply-tokens", "4", "--threads", "1"], monkeypatch, capsys)
    assert code == 0, err
    read = {line.split(":")[0]: int(line.split(", read ")[1].split(",")[0]) for line in out.splitlines() if ", read " in line}
    assert read == {"reuse on": 3 * 72 - 2 * 64, "reuse off": 3 * 72, "reuse on, no shared_end": 3 * 72}, out
    assert "outputs identical: True" in out


def test_eval_default_pair_has_no_tau_where_no_round_ran(tmp_path, monkeypatch, capsys):
    """With one new token (the prefill's) no decoding round runs: each prompt's tau and
    their mean are null, as mean_tau is (they were 0.0, below tau's least value 1)."""
    report = tmp_path / "e.json"
    code, _, err = run_script("eval_default_pair", ["--num-prompts", "2", "--max-new-tokens", "1", "--no-identity",
                                                    "--out", str(report)], monkeypatch, capsys)
    assert code == 0, err
    got = json.loads(report.read_text())
    assert [(r["tau"], r["rounds"], r["tokens"]) for r in got["per_prompt"]] == [(None, 0, 1)] * 2, got
    assert got["mean_tau"] is None and got["mean_tau_per_prompt"] is None, got


def test_prefill_stalls_warm_up_fits_few_new_tokens(monkeypatch, capsys):
    """Its warm-up asked for 16 and 8 new tokens of a context sized for the run's: any run
    with both counts under 15 was refused, naming 16 tokens it was not asked for."""
    code, out, err = run_script("prefill_stalls", ["--threads", "1", "--streams", "1", "--short-new-tokens", "2",
                                                   "--long-tokens", "64", "--long-new-tokens", "2", "--reps", "1"],
                                monkeypatch, capsys)
    assert code == 0, err
    assert "outputs identical across modes and reps: True" in out


def test_train_default_target_records_paths_the_build_machine_does_not_own(monkeypatch, tmp_path):
    """trial-319 (b): train_default_target.py recorded its defaults, resolved from its own
    file, as the build machine's absolute paths (/work/main/dflash_torch/assets/default/target)
    and the stdlib as /root/.pyenv/...; now relative to the repository, under <sys.prefix>,
    and any other path as given."""
    monkeypatch.setattr(sys, "path", [str(SCRIPTS), *sys.path])
    corpus = importlib.import_module("default_corpus")
    root = corpus.REPO_ROOT
    assert corpus.recorded_path(root / "dflash_torch" / "assets" / "default" / "target") == \
        "dflash_torch/assets/default/target"
    stdlib, prefix, base = corpus.stdlib_dir(), Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()
    name, under = ("<sys.prefix>", prefix) if stdlib.is_relative_to(prefix) else ("<sys.base_prefix>", base)
    assert corpus.recorded_path(stdlib) == f"{name}/{stdlib.relative_to(under).as_posix()}"
    assert corpus.recorded_path(str(tmp_path / "work")) == str(tmp_path / "work")
