"""The GPU tooling (scripts/gpu_check.sh, gpu_summary.py, gpu_probe.py, fp8_speed.py,
mxfp4_speed.py) on a CPU: a mistake is refused up front in one line, a part that fails is
named at the end with a non-zero exit, and a result file that cannot be read is named
while the rest of the summary is still rendered. (It runs once on a scarce GPU: a failure
there must be loud and must not waste the run.)"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert last.startswith("gpu_check.sh: error: 3 part(s) failed: pair_bf16, pair_fp32, summary"), proc.stderr
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert "no result files found" in log and last in log
    assert not (ROOT / "out").exists()


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
