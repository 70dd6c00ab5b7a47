"""The GPU tooling (scripts/gpu_check.sh, gpu_summary.py, gpu_probe.py, fp8_speed.py,
mxfp4_speed.py) on a CPU: a mistake is refused up front in one line, a part that fails is
named at the end with a non-zero exit, and a result file that cannot be read is named
while the rest of the summary is still rendered. (It runs once on a scarce GPU: a failure
there must be loud and must not waste the run.)"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_torch.options import usable_cpus

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
CHECK = SCRIPTS / "gpu_check.sh"


def gpu_check(*args: str, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess:
    """``bash scripts/gpu_check.sh ARGS`` from ``cwd`` with ``env`` added."""
    full = {**os.environ, "PYTHON": sys.executable, **env}
    full["PYTHONPATH"] = os.pathsep.join(filter(None, (env.get("PYTHONPATH"), str(ROOT), os.environ.get("PYTHONPATH"))))
    return subprocess.run(["bash", str(CHECK), *args], cwd=cwd, env=full, capture_output=True, text=True, timeout=120)


def one_error_line(proc: subprocess.CompletedProcess, prefix: str) -> str:
    """The only stderr line of ``proc`` (which must start with ``prefix``)."""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), proc.stderr
    return lines[0]


def run_main(name: str, args: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """scripts/NAME.py's ``main()`` in this process with ``args``: (exit code, stdout, stderr),
    the script imported afresh."""
    monkeypatch.setattr(sys, "path", [str(SCRIPTS), *sys.path])
    monkeypatch.delitem(sys.modules, name, raising=False)
    module = importlib.import_module(name)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *args])
    try:
        module.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def test_gpu_check_runs_every_part_then_names_the_failed_ones_and_exits_1(tmp_path):
    """Every part failed (DEVICE=bogus): it went on to the next part and the summary, then
    exited 0 with an empty table; now the failed parts are named at the end (exit 1). A
    relative OUT_DIR is the caller's, not the repo root's."""
    proc = gpu_check("out", "pair,fp32", cwd=tmp_path, DEVICE="bogus")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "=== shipped pair, bf16" in proc.stdout and "=== shipped pair, float32" in proc.stdout
    assert "part pair_bf16 failed" in proc.stdout and "part pair_fp32 failed" in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("gpu_check.sh: error: 2 part(s) failed: pair_bf16, pair_fp32"), proc.stderr
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert "no result files in" in log and last in log
    assert not (ROOT / "out").exists()


def test_gpu_check_of_parts_that_write_no_result_file_exits_0(tmp_path):
    """``tests`` alone (the CUDA tests, skipped here) writes no result file: the summary has
    nothing to read, which is no failure (trial-220: 'no result files found', exit 1). (The part's
    pytest run is cut to test_cuda.py's CUDA-graph tests, which skip here: its CPU tests, which
    the suite runs itself, cost ~30 s of subprocesses.)"""
    proc = gpu_check(str(tmp_path / "out"), "tests", DEVICE="cpu", PYTEST_ADDOPTS="-k cuda_graphs")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "=== CUDA tests" in proc.stdout and "no result files in" in proc.stdout, proc.stdout
    assert " skipped" in proc.stdout, proc.stdout  # (the CUDA tests ran, skipped without a GPU)


@pytest.mark.parametrize("where", ["file", "proc"])
def test_gpu_check_stops_at_once_when_it_cannot_create_out_dir(tmp_path, where):
    """A file in the way, or /proc: one line, exit 2, before any part (it ran every part)."""
    (tmp_path / "afile").write_text("")
    out = "afile/out" if where == "file" else "/proc/nope"
    proc = gpu_check(out, "pair", cwd=tmp_path, DEVICE="cpu")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_error_line(proc, "gpu_check.sh: error: cannot write OUT_DIR ")
    assert (str(tmp_path / "afile" / "out") if where == "file" else "/proc/nope") in line
    assert proc.stdout == ""


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_gpu_check_help_prints_the_usage(tmp_path, flag):
    """--help / -h print the header's usage, exit 0 (they ran ``mkdir -p --help``)."""
    proc = gpu_check(flag, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert "Usage: scripts/gpu_check.sh [OUT_DIR] [PARTS]" in proc.stdout and "PARTS: comma-separated" in proc.stdout
    assert "set -uo" not in proc.stdout and list(tmp_path.iterdir()) == []


def test_gpu_check_refuses_unknown_parts_before_anything_runs(tmp_path):
    """``bogus,pairs`` were ignored (nothing ran, exit 0): one line naming the parts, exit 2."""
    proc = gpu_check("out", "pair,bogus,pairs", cwd=tmp_path, DEVICE="cpu")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_error_line(proc, "gpu_check.sh: error: unknown part 'bogus'")
    assert "probe,pair,shapes,hybrid,gptoss,gemma,fp8,profile,tests,fp32" in line
    assert proc.stdout == "" and not (tmp_path / "out").exists()


def test_gpu_check_names_python_or_torch_not_the_gpu(tmp_path):
    """A python that cannot run, or whose torch does not import, was reported as 'no CUDA device'."""
    proc = gpu_check("out", cwd=tmp_path, PYTHON="/nonexistent/python")
    assert proc.returncode == 2
    assert "python cannot run (/nonexistent/python" in one_error_line(proc, "gpu_check.sh: error: ")
    (tmp_path / "fake" / "torch").mkdir(parents=True)
    (tmp_path / "fake" / "torch" / "__init__.py").write_text("raise ImportError('this torch is broken')\n")
    proc = gpu_check("out", cwd=tmp_path, PYTHONPATH=str(tmp_path / "fake"))
    assert proc.returncode == 2
    line = one_error_line(proc, "gpu_check.sh: error: torch is not importable by ")
    assert "this torch is broken" in line and not (tmp_path / "out").exists()


def shapes_report(*compiled: bool) -> dict:
    """A bench.json of ``--shapes qwen3-8b`` with the entries (eager / compiled) that gpu_summary reads."""
    return {"shapes": [{"shape": "qwen3-8b", "compiled": c, "dtype": "bfloat16", "moe": None, "weights_gib": 14.1,
                        "target_step_s": 0.007, "round_s": 0.0085, "propose_s": 0.0014, "round_over_step": 1.21,
                        "cudagraph_skips": 0, "recompiles": 0, "eager_fallbacks": 0} for c in compiled]}


def pair_report() -> dict:
    """A bench.json of the shipped pair (float32, two modes) with what gpu_summary reads."""
    mode = {"decode_tokens_per_second": 100.0, "mean_acceptance_length": 1.0, "outputs_identical_to_target_only": True}
    return {"modes": [dict(mode, name="target-only"),
                      dict(mode, name="inject", decode_tokens_per_second=250.0, mean_acceptance_length=4.5)],
            "sweep": None}


def test_gpu_summary_without_result_files_says_so(tmp_path, monkeypatch, capsys):
    """A missing or empty folder printed an empty table, exit 0."""
    for out, why in ((tmp_path / "missing", "no such folder"), (tmp_path, "looked for probe.json")):
        code, stdout, err = run_main("gpu_summary", [str(out)], monkeypatch, capsys)
        assert code == 1 and stdout == ""
        assert err.startswith(f"gpu_summary.py: error: no result files found in {out} ({why}") and err.count("\n") == 1, err


def test_gpu_summary_names_each_bad_file_and_renders_the_rest(tmp_path, monkeypatch, capsys):
    """Truncated JSON (JSONDecodeError), probe.json without a key (KeyError), a shapes file with
    only a compiled entry (KeyError: False): one line naming each file, the other files'
    rows still rendered, the skipped files noted, exit 1."""
    (tmp_path / "pair_fp32.json").write_text(json.dumps(pair_report()))
    (tmp_path / "pair_bf16.json").write_text(json.dumps(pair_report())[:40])
    (tmp_path / "probe.json").write_text(json.dumps({"device": "NVIDIA H200"}))
    (tmp_path / "qwen3_8b.json").write_text(json.dumps(shapes_report(True)))
    (tmp_path / "qwen35_9b.json").write_text(json.dumps(shapes_report(False, True)))
    code, out, err = run_main("gpu_summary", [str(tmp_path)], monkeypatch, capsys)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 4, err
    for line, name, why in zip(lines, ("probe", "qwen3_8b", "pair_bf16"),
                               ("no key 'torch'", "no eager entry", "not readable JSON")):
        assert line.startswith(f"gpu_summary.py: error: {tmp_path / name}.json: ") and why in line, line
    assert lines[3] == "gpu_summary.py: checks skipped (file unreadable or incomplete): probe.json, qwen3_8b.json, pair_bf16.json"
    assert "| shipped pair fp32: inject eager / target-only eager | 2.50 |" in " ".join(out.split())
    assert "qwen3-8b compiled round / compiled step" in out  # (qwen35_9b.json, whole, under the shape's name)
    assert "shipped pair bf16" not in out


def test_gpu_summary_of_good_files_exits_0(tmp_path, monkeypatch, capsys):
    (tmp_path / "pair_fp32.json").write_text(json.dumps(pair_report()))
    (tmp_path / "qwen3_8b.json").write_text(json.dumps(shapes_report(False, True)))
    code, out, err = run_main("gpu_summary", [str(tmp_path)], monkeypatch, capsys)
    assert code == 0 and err == ""
    assert "| check " in out and "qwen3-8b eager step / round / propose (ms)" in out and "shipped pair fp32" in out


def test_gpu_summary_marks_a_timing_bench_flagged_unreliable(tmp_path, monkeypatch, capsys):
    """A shape's timings that bench flagged UNRELIABLE (its repeats spread wide: a loaded
    machine) were rendered as any others, their goals "yes"/"NO": they are marked UNRELIABLE,
    the goals read from them "?", bench's reason printed under the table; the counts (CUDA
    graphs skipped, recompiles) are not timings and keep their verdict."""
    why = "UNRELIABLE: the repeats spread 3.1x (slowest / fastest): the machine was likely loaded; rerun it on an idle one"
    report = shapes_report(False, True)
    report["shapes"][1]["unreliable"] = why
    (tmp_path / "qwen3_8b.json").write_text(json.dumps(report))
    code, out, err = run_main("gpu_summary", [str(tmp_path)], monkeypatch, capsys)
    assert code == 0 and err == ""
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")]
                                              for line in out.splitlines() if line.startswith("| "))}
    assert rows["qwen3-8b eager step / round / propose (ms)"] == ["7.00 / 8.50 / 1.40", "", "-"]
    assert rows["qwen3-8b compiled step / round / propose (ms)"] == ["7.00 / 8.50 / 1.40 UNRELIABLE", "", "-"]
    assert rows["qwen3-8b compiled step / floor"] == ["2.22 UNRELIABLE", "<= 1.5", "?"]
    assert rows["qwen3-8b compiled round / compiled step"] == ["1.21 UNRELIABLE", "<= 1.15", "?"]
    assert rows["qwen3-8b compiled: CUDA graphs skipped, recompiles, steps run eager"][2] == "yes"
    assert rows["PROJECTION: speedup at tau 6.49 (mean (paper, Qwen3-8B))"][0] == "5.34x UNRELIABLE"
    assert out.splitlines()[-1] == f"qwen3-8b compiled step / round / propose (ms): {why}"
    report["shapes"][1]["unreliable"] = None  # (as bench writes a reliable one: the verdicts)
    (tmp_path / "qwen3_8b.json").write_text(json.dumps(report))
    code, out, err = run_main("gpu_summary", [str(tmp_path)], monkeypatch, capsys)
    assert code == 0 and "UNRELIABLE" not in out and out.splitlines()[-1].startswith("| PROJECTION")
    assert "| qwen3-8b compiled round / compiled step | 1.21 | <= 1.15 | NO |" in " ".join(out.split())


@pytest.mark.parametrize("args,error", [(["--prompts", "32"], "--prompts must be 1 to 31"),
                                        (["--prompts", "0"], "--prompts must be 1 to 31"),
                                        (["--tokens", "1"], "--tokens must be at least 2")])
def test_gpu_probe_refuses_what_it_cannot_run_before_the_gpu(args, error, monkeypatch, capsys):
    """--prompts 32 and up was an IndexError after the whole GPU run (64 held-out prompts: two
    groups and one more), --prompts 0 a ZeroDivisionError: refused up front (also without a GPU)."""
    code, out, err = run_main("gpu_probe", args, monkeypatch, capsys)
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1].startswith(f"gpu_probe.py: error: {error}"), err


@pytest.mark.parametrize("script,args,error", [
    ("fp8_speed", ["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
    ("fp8_speed", ["--dtype", "bogus"], "argument --dtype: invalid choice: 'bogus'"),
    ("fp8_speed", ["--hidden", "100"], "--hidden must be a positive multiple of 128, got 100"),
    ("fp8_speed", ["--family", "qwen3_next", "--hidden", "384"], "--hidden must be a positive multiple of 256"),
    ("fp8_speed", ["--family", "qwen3_moe", "--format", "w4a16", "--hidden", "128"],
     "--hidden must be a positive multiple of 256"),
    ("fp8_speed", ["--reps", "0"], "--reps must be at least 1, got 0"),
    ("fp8_speed", ["--tokens", "0"], "--tokens must be at least 1, got 0"),
    ("fp8_speed", ["--device", "bogus"], "--device must be cpu, cuda or cuda:N"),
    ("fp8_speed", ["--threads", str((usable_cpus() or 1) + 1)], "--threads must be an integer from 1 to the CPUs"),
    ("mxfp4_speed", ["--hidden", "48"], "--hidden must be a positive multiple of 32, got 48"),
    ("mxfp4_speed", ["--reps", "0"], "--reps must be at least 1, got 0"),
    ("mxfp4_speed", ["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
    ("mxfp4_speed", ["--experts", "2"], "--experts must be at least 4"),
])
def test_speed_scripts_refuse_bad_options_in_one_line(script, args, error, monkeypatch, capsys):
    """A traceback each (ZeroDivisionError, ValueError, a shape mismatch, torch's dtype
    lookup), some after building the checkpoint: argparse's error, exit 2."""
    code, out, err = run_main(script, args, monkeypatch, capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"{script}.py: error: {error}"), err  # (no usage lines)
    assert "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
@pytest.mark.parametrize("script", ["fp8_speed", "mxfp4_speed"])
def test_speed_scripts_on_cuda_without_a_gpu_fail_in_one_line(script, monkeypatch, capsys):
    code, out, err = run_main(script, ["--device", "cuda"], monkeypatch, capsys)
    assert code == 2 and out == ""
    assert err.strip().startswith(f"{script}.py: error: no CUDA device") and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("script,last", [("fp8_speed", "and the memory each takes."),
                                         ("mxfp4_speed", "and the memory each takes.")])
def test_speed_scripts_help_gives_the_whole_first_paragraph(script, last, monkeypatch, capsys):
    code, out, _ = run_main(script, ["--help"], monkeypatch, capsys)
    assert code == 0 and " ".join(out.split()).count(last) == 1, out


def test_fp8_speed_runs_fp8_without_compressed_tensors(monkeypatch, capsys):
    """The fp8 part of gpu_check.sh on a machine without compressed-tensors (the GPU machine has
    none): fp8_speed.py imported it at the top, through the test suite's W4A16 and NVFP4
    quantizers. Its fp8 format runs (at 1152 wide: 9 heads, whose key-value heads were 2, a
    shape error), the others say in one line what they need."""
    for name in [m for m in sys.modules if m.split(".")[0] == "compressed_tensors"] + ["compressed_tensors"]:
        monkeypatch.setitem(sys.modules, name, None)  # (an import of it fails: ModuleNotFoundError)
    for name in ("test_nvfp4", "test_packed_int"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    code, out, err = run_main("fp8_speed", ["--hidden", "1152", "--layers", "1", "--tokens", "2", "--reps", "1"],
                              monkeypatch, capsys)
    assert code == 0, err
    assert "same tokens: True" in out
    code, out, err = run_main("fp8_speed", ["--format", "w4a16"], monkeypatch, capsys)
    assert code == 2 and out == ""
    assert err.strip() == "fp8_speed.py: error: --format w4a16 needs the package compressed_tensors (pip install compressed-tensors)"
