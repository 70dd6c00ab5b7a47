"""The ``dflash-torch generate`` command: run as a real subprocess where the process itself is
what is tested (its exit status and output streams, signals, stdin and stdout as the shell gives
them), in this process (:func:`cli`) where only the command's behaviour is."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import stderr_that_cannot_take

from dflash_torch import DFlashEngine

PROMPT = "def f(x):"


def run_cli(*args: str, stdin: str | None = None, module: str = "dflash_torch.cli") -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", module, *args], input=stdin if stdin is not None else "",
                          capture_output=True, text=True, timeout=240, env=env)


@pytest.fixture(scope="module")
def pair_args(agree_pair):
    target, drafter = agree_pair
    return ["--target", str(target), "--draft", str(drafter)]


@pytest.fixture(scope="module")
def api(agree_pair):
    return DFlashEngine.from_pretrained(*agree_pair)


def parse_single_json(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) == 1, stdout
    obj = json.loads(lines[0])
    assert isinstance(obj, dict)
    return obj


@pytest.fixture(scope="module")
def json_output(pair_args):
    """``generate --json`` of PROMPT, 24 tokens, run in this process (its stdout and stderr
    redirected): its one JSON object."""
    import contextlib
    import io

    from dflash_torch.cli import main as cli_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(["generate", *pair_args, "--prompt", PROMPT, "--max-new-tokens", "24", "--ignore-eos", "--json"])
    assert rc == 0, err.getvalue()
    return parse_single_json(out.getvalue())


def test_json_is_one_object_with_the_documented_keys(json_output, api):
    out = json_output
    assert {"text", "token_ids", "finish_reason", "stats"} <= out.keys()
    assert {"acceptance_lengths", "mean_acceptance_length", "decode_tokens_per_second"} <= out["stats"].keys()
    ref = api.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    assert out["token_ids"] == ref.token_ids and len(out["token_ids"]) == 24
    assert out["text"] == ref.text
    assert out["finish_reason"] == "length"
    taus = out["stats"]["acceptance_lengths"]
    assert taus == ref.stats.acceptance_lengths
    assert out["stats"]["mean_acceptance_length"] == pytest.approx(sum(taus) / len(taus))
    assert out["stats"]["decode_tokens_per_second"] > 0
    assert out["stats"]["times_include_compilation"] is False  # (true with --compile, as the text stats line says)


def test_json_stats_of_a_reply_without_a_decoding_round_have_null_tau_and_rate(cli, pair_args, api):
    """One token (the prefill's): no decoding round, so no tau (>= 1 by definition), no
    decode rate and no mean propose or verify time per round: null, not 0.0 (which would pull
    an average over runs down; trial-233: the mean times were 0.0), in ``generate --json`` as
    in :meth:`GenerationStats.to_dict`; a reply with rounds has numbers there."""
    nulls = ("mean_acceptance_length", "decode_tokens_per_second", "mean_propose_time", "mean_verify_time")
    proc = cli("generate", *pair_args, PROMPT, "--max-new-tokens", "1", "--ignore-eos", "--json")
    assert proc.returncode == 0, proc.stderr
    stats = parse_single_json(proc.stdout)["stats"]
    assert stats["acceptance_lengths"] == [] and stats["generated_tokens"] == 1
    assert [stats[k] for k in nulls] == [None] * 4, stats
    stats = api.generate(PROMPT, max_new_tokens=1, ignore_eos=True).stats.to_dict()
    assert stats["acceptance_lengths"] == [] and [stats[k] for k in nulls] == [None] * 4, stats
    stats = api.generate(PROMPT, max_new_tokens=4, ignore_eos=True).stats.to_dict()
    assert stats["mean_acceptance_length"] >= 1 and stats["mean_verify_time"] > 0 and stats["mean_propose_time"] >= 0


def test_logprobs_in_the_json_object_are_the_python_apis(cli, json_output, pair_args, api):
    """``--json --logprobs 2``: the same tokens as without, and per token its id, text, bytes
    and log-probability with the 2 most likely tokens there, as ``generate(logprobs=2)``
    gives them; without ``--logprobs`` the key is null; without ``--json`` it is refused
    with one line before anything is loaded."""
    proc = cli("generate", *pair_args, PROMPT, "--max-new-tokens", "24", "--ignore-eos", "--json", "--logprobs", "2")
    assert proc.returncode == 0, proc.stderr
    out = parse_single_json(proc.stdout)
    assert out["token_ids"] == json_output["token_ids"] and json_output["logprobs"] is None
    ref = api.generate(PROMPT, max_new_tokens=24, ignore_eos=True, logprobs=2)

    def item(token_id: int, logprob: float) -> dict:
        return {"token_id": token_id, "token": api.token_text(token_id), "bytes": list(api.token_bytes(token_id)),
                "logprob": logprob}

    assert len(out["logprobs"]) == len(out["token_ids"]) == 24
    for got, want in zip(out["logprobs"], ref.logprobs):
        assert got["top_logprobs"] == [item(t, lp) for t, lp in want.top] and len(want.top) == 2
        assert got == {**item(want.token_id, want.logprob), "top_logprobs": got["top_logprobs"]}
    assert bytes(b for e in out["logprobs"] for b in e["bytes"]).decode("utf-8", errors="replace") == out["text"]
    proc = cli("generate", "--target", "/nonexistent", PROMPT, "--logprobs", "2")
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr == ("dflash-torch: error: --logprobs needs --json (the log-probabilities are printed in its "
                           "JSON object)\n")


def test_prompt_logprobs_in_the_json_object_are_the_python_apis(cli, json_output, pair_args, api):
    """``--json --prompt-logprobs 1``: the same tokens as without; per prompt token (the
    first: null) its id, text, bytes and log-probability with the most likely token there,
    as ``generate(prompt_logprobs=1)`` gives them; without ``--json`` refused in one line."""
    proc = cli("generate", *pair_args, PROMPT, "--max-new-tokens", "24", "--ignore-eos", "--json",
                   "--prompt-logprobs", "1")
    assert proc.returncode == 0, proc.stderr
    out = parse_single_json(proc.stdout)
    assert out["token_ids"] == json_output["token_ids"] and json_output["prompt_logprobs"] is None
    ref = api.generate(PROMPT, max_new_tokens=24, ignore_eos=True, prompt_logprobs=1)
    assert out["prompt_logprobs"][0] is None and ref.prompt_logprobs[0] is None
    assert len(out["prompt_logprobs"]) == len(ref.prompt_logprobs) == len(api.encode_prompt(PROMPT)) > 1
    for got, want in zip(out["prompt_logprobs"][1:], ref.prompt_logprobs[1:]):
        assert (got["token_id"], got["logprob"]) == (want.token_id, want.logprob)
        assert [(t["token_id"], t["logprob"]) for t in got["top_logprobs"]] == want.top and len(want.top) == 1
    proc = cli("generate", "--target", "/nonexistent", PROMPT, "--prompt-logprobs", "2")
    assert proc.returncode == 2 and proc.stderr.startswith("dflash-torch: error: --prompt-logprobs needs --json"), proc.stderr


def test_prompt_on_stdin_through_python_m_dflash_torch(json_output, pair_args):
    proc = run_cli("generate", *pair_args, "--max-new-tokens", "24", "--ignore-eos", "--json", stdin=PROMPT,
                   module="dflash_torch")
    assert proc.returncode == 0, proc.stderr
    assert parse_single_json(proc.stdout)["token_ids"] == json_output["token_ids"]


def test_no_draft_equals_speculative_output(cli, json_output, pair_args):
    proc = cli("generate", *pair_args[:2], PROMPT, "--max-new-tokens", "24", "--ignore-eos", "--json", "--no-draft")
    assert proc.returncode == 0, proc.stderr
    out = parse_single_json(proc.stdout)
    assert out["token_ids"] == json_output["token_ids"] and out["text"] == json_output["text"]
    assert set(out["stats"]["acceptance_lengths"]) == {1}
    assert json_output["stats"]["mean_acceptance_length"] > 1


def test_a_small_prefill_chunk_decodes_the_same(cli, json_output, pair_args, api):
    """--prefill-chunk (prefill_chunk= in the API) reads the prompt in pieces of that many
    tokens: the same tokens as the default chunk of 256."""
    assert len(api.tokenizer(PROMPT)["input_ids"]) > 3
    proc = cli("generate", *pair_args, "--prompt", PROMPT, "--max-new-tokens", "24", "--ignore-eos", "--json",
                   "--prefill-chunk", "3")
    assert proc.returncode == 0, proc.stderr
    assert parse_single_json(proc.stdout)["token_ids"] == json_output["token_ids"]


def test_tiny_temperature_decodes_as_greedy(cli, json_output, pair_args):
    """A temperature of 1e-40 is the greedy limit, not a traceback (issue 14)."""
    proc = cli("generate", *pair_args, PROMPT, "--max-new-tokens", "24", "--ignore-eos", "--json",
                   "--temperature", "1e-40", "--seed", "0")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    out = parse_single_json(proc.stdout)
    assert out["token_ids"] == json_output["token_ids"] and out["text"] == json_output["text"]


def test_penalty_flags_equal_the_python_api(cli, json_output, pair_args, api):
    proc = cli("generate", *pair_args, PROMPT, "--max-new-tokens", "24", "--ignore-eos", "--json",
                   "--presence-penalty", "1.5", "--frequency-penalty", "0.3", "--repetition-penalty", "1.2")
    assert proc.returncode == 0, proc.stderr
    out = parse_single_json(proc.stdout)
    ref = api.generate(PROMPT, max_new_tokens=24, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.3,
                       repetition_penalty=1.2)
    assert out["token_ids"] == ref.token_ids and out["token_ids"] != json_output["token_ids"]


def test_chat_and_streaming_text(cli, pair_args, api):
    proc = cli("generate", *pair_args, "--prompt", "Explain heaps.", "--chat", "--max-new-tokens", "16",
                   "--ignore-eos", "--block-size", "8", "--draft-mode", "recompute")
    assert proc.returncode == 0, proc.stderr
    ref = api.generate("Explain heaps.", chat=True, max_new_tokens=16, ignore_eos=True)
    assert ref.stats.prompt_tokens == len(api.encode_prompt("# user: Explain heaps.\n# assistant:\n"))
    assert proc.stdout == ref.text  # streamed text, as it is (stdout not a terminal: no line break added)
    stats_line = proc.stderr.strip().splitlines()[-1]
    assert "16 tokens" in stats_line and "finish=length" in stats_line and "tau" in stats_line


def test_one_token_stats_line_reports_no_decoding_round(cli, pair_args):
    proc = cli("generate", *pair_args, "--prompt", PROMPT, "--max-new-tokens", "1", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    stats_line = proc.stderr.strip().splitlines()[-1]
    assert stats_line.startswith("[1 token, ") and "no decoding round" in stats_line and "tau" not in stats_line


def test_error_is_one_line_without_traceback(pair_args, tmp_path):
    """(every error case runs in-process in test_errors.py; this one is a real process)"""
    proc = run_cli("generate", "--target", str(tmp_path / "missing"), pair_args[2], pair_args[3], "--prompt", PROMPT)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dflash-torch: error:") and "does not exist" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.fixture(scope="module")
def not_utf8_prompt(pair_args):
    """``generate`` of a Latin-1 prompt, as the argument and then on stdin, in one real process
    per stdin error handler (``PYTHONIOENCODING``; the process's argv and stdin bytes as the
    interpreter decodes them): ``run(encoding)`` -> ``{"argument": (status, stderr), "stdin":
    (status, stderr)}`` (each process started once: ~4 s CPU)."""
    code = ("import sys\n"
            "from dflash_torch.cli import main\n"
            "for args in (sys.argv[2:] + [sys.argv[1]], sys.argv[2:]):  # (the prompt as the argument, then on stdin)\n"
            "    print('--', file=sys.stderr, flush=True)\n"
            "    try:\n"
            "        status = main(args)\n"
            "    except SystemExit as exc:  # (as the command's entry point takes it)\n"
            "        status = exc.code\n"
            "    print(status, flush=True)\n")
    prompt = "caf\u00e9 = 1\n".encode("latin-1")
    runs = {}

    def run(encoding: str) -> dict:
        if encoding not in runs:
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONIOENCODING=encoding)
            proc = subprocess.run([sys.executable, "-c", code, prompt, "generate", *pair_args, "--max-new-tokens", "4"],
                                  input=prompt, capture_output=True, timeout=240, env=env)
            assert proc.returncode == 0, proc.stderr.decode()
            statuses, errs = proc.stdout.decode().split(), proc.stderr.decode().split("--\n")[1:]
            assert len(statuses) == len(errs) == 2, (proc.stdout, proc.stderr)
            runs[encoding] = {where: (int(status), err) for where, status, err in zip(("argument", "stdin"), statuses,
                                                                                      errs)}
        return runs[encoding]

    return run


@pytest.mark.parametrize("encoding", ["utf-8:strict", "utf-8:surrogateescape"])
@pytest.mark.parametrize("where", ["stdin", "argument"])
def test_a_prompt_that_is_not_utf8_is_one_line_naming_the_byte(not_utf8_prompt, where, encoding):
    """A Latin-1 prompt (piped or as the argument) is refused naming the bad byte, whatever
    the locale's error handler for stdin (strict under en_US.UTF-8, surrogateescape under C.UTF-8).
    (A real process, shared by the two cases of an encoding: :func:`not_utf8_prompt`.)"""
    status, stderr = not_utf8_prompt(encoding)[where]
    assert status == 2 and "Traceback" not in stderr, stderr
    assert stderr.strip() == f"dflash-torch: error: the prompt {'on stdin' if where == 'stdin' else 'argument'} is not " \
                             "UTF-8 text (byte 0xe9 at offset 3)"


NOT_UTF8_FLAGS = [("--regex", b"\xff", 0), ("--grammar", b'start: "\xff"', 8), ("--json-schema", b'{"const": "\xff"}', 11)]


@pytest.fixture(scope="module")
def not_utf8_flags() -> dict:
    """``generate x FLAG VALUE`` for each of :data:`NOT_UTF8_FLAGS`, in turn in one real process
    (argv's bytes as the interpreter decodes them; one start, ~4 s CPU, for the three):
    ``{flag: (status, stdout, stderr)}``."""
    code = ("import sys\n"
            "from dflash_torch.cli import main\n"
            "for flag, value in zip(sys.argv[1::2], sys.argv[2::2]):\n"
            "    print('--', flush=True)\n"
            "    print('--', file=sys.stderr, flush=True)\n"
            "    try:\n"
            "        status = main(['generate', 'x', flag, value])\n"
            "    except SystemExit as exc:  # (as the command's entry point takes it)\n"
            "        status = exc.code\n"
            "    print(f'--status {status}', flush=True)\n")
    argv = [part for flag, value, _ in NOT_UTF8_FLAGS for part in (flag, value)]
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, timeout=240,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr.decode()
    outs, errs = proc.stdout.split(b"--\n")[1:], proc.stderr.split(b"--\n")[1:]
    assert len(outs) == len(errs) == len(NOT_UTF8_FLAGS), (proc.stdout, proc.stderr)
    runs = {}
    for (flag, _, _), out, err in zip(NOT_UTF8_FLAGS, outs, errs):
        before, _, status = out.rpartition(b"--status ")
        runs[flag] = (int(status), before, err)
    return runs


@pytest.mark.parametrize("flag,value,offset", NOT_UTF8_FLAGS)
def test_a_flag_that_is_not_utf8_is_one_line_naming_it(not_utf8_flags, flag, value, offset):
    """A text flag holding a byte that is not UTF-8 (a real process: argv's bytes, shared by the
    three flags: :func:`not_utf8_flags`) is refused in one line naming the flag and the byte,
    exit 2, before anything loads (--regex and --grammar were a 34-line UnicodeEncodeError
    traceback from llguidance; --json-schema "Value is not JSON serializable: '\\udcff'")."""
    status, stdout, stderr = not_utf8_flags[flag]
    assert status == 2 and stdout == b"", stderr
    assert stderr.decode() == f"dflash-torch: error: {flag} is not UTF-8 text (byte 0xff at offset {offset})\n"


# the flags that name a file or directory (or a Hugging Face id): taken whatever their bytes
PATH_FLAGS = {"--target", "--draft", "--init-from", "--data", "--out", "--work-dir", "--prompts"}


def _value_options() -> list[tuple[str, str]]:
    """(command, option) of every option of every command that takes a value, its flag (a
    positional argument: its name)."""
    import argparse

    from dflash_torch.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [(command, (a.option_strings or [a.dest])[0]) for command, p in sub.choices.items() for a in p._actions
            if a.nargs != 0]


VALUE_OPTIONS = _value_options()


@pytest.mark.parametrize("command,option", [(c, o) for c, o in VALUE_OPTIONS if o in PATH_FLAGS])
def test_every_path_flag_expands_a_leading_tilde(monkeypatch, tmp_path, command, option):
    """A path flag's ``~`` that the shell left (``--out=~/x``, a quoted ``'~/x'``) is the home
    directory, for every path flag of every command: bench's --out made a literal ./~ directory."""
    from dflash_torch.cli import build_parser

    monkeypatch.setenv("HOME", str(tmp_path))
    required = {"train": ["--target", "t", "--data", "d", "--out", "o"]}.get(command, [])
    args = build_parser().parse_args([command, *required, f"{option}=~/x"])
    value = getattr(args, option[2:].replace("-", "_"))
    assert (value[-1] if isinstance(value, list) else value) == str(tmp_path / "x")


@pytest.mark.parametrize("command,option", [(c, o) for c, o in VALUE_OPTIONS if o in ("--json-schema", "--grammar")])
def test_a_text_or_file_flags_file_expands_a_leading_tilde(monkeypatch, tmp_path, command, option):
    """The @FILE of --json-schema and --grammar expands a leading ``~`` as the path flags do (a
    shell leaves ``@~/x`` as it is): it was looked for in a directory named ~."""
    from dflash_torch.cli import STRUCTURED_FLAGS, build_parser, structured_output

    monkeypatch.setenv("HOME", str(tmp_path))
    text = '{"type": "integer"}' if option == "--json-schema" else 'start: "yes"'
    (tmp_path / "s").write_text(text)
    args = build_parser().parse_args([command, *(["x"] if command == "generate" else []), option, "@~/s"])
    assert structured_output(args) == {STRUCTURED_FLAGS[option]: json.loads(text) if option == "--json-schema" else text}


@pytest.mark.parametrize("command,option", [(c, o) for c, o in VALUE_OPTIONS if o not in PATH_FLAGS])
def test_every_text_value_must_be_utf8(capsys, command, option):
    """Every value of every command but a path must be UTF-8 text (argv's other bytes reach
    Python as lone surrogates: --stop $'\\xff' was taken and could never match, --choice
    "lone leading surrogate in hex escape", --system, --api-key, --model-name reached the
    tokenizer or the server): one line naming the flag, exit 2."""
    from dflash_torch.cli import main as cli_main

    what = option if option.startswith("--") else f"the {option} argument"
    with pytest.raises(SystemExit) as exc:
        cli_main([command, *([option] if option.startswith("--") else []), "ab\udcff"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == f"dflash-torch: error: {what} is not UTF-8 text (byte 0xff at offset 2)\n"


def test_paths_may_hold_any_bytes(tmp_path, capsys):
    """A path need not be UTF-8: --target, --data, ... and the @FILE of --grammar take it as
    the file system does (the grammar file's text must be UTF-8)."""
    from dflash_torch.cli import main as cli_main

    assert {o for _, o in VALUE_OPTIONS} >= PATH_FLAGS
    grammar = os.fsencode(tmp_path) + b"/g\xff.lark"
    with open(grammar, "wb") as fh:
        fh.write(b'start: "yes"')
    missing = os.fsdecode(os.fsencode(tmp_path) + b"/t\xff")
    assert cli_main(["generate", "x", "--target", missing, "--no-draft", "--grammar", "@" + os.fsdecode(grammar)]) == 2
    assert re.fullmatch(r"dflash-torch: error: --target: model directory '.*/t\\udcff' does not exist\n",
                        capsys.readouterr().err)


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_ctrl_c_while_decoding_exits_130_without_a_traceback(pair_args, tmp_path, command):
    import signal

    if command == "generate":  # interrupted once text streams
        args, marker, pipe = ["generate", *pair_args, PROMPT, "--max-new-tokens", "900", "--ignore-eos"], "", "stdout"
    else:  # interrupted once the timed decoding starts (its progress bar appears)
        # (300 tokens: each mode's warm-up decodes as many before the bar; the timed decodes, 4 of 300 tokens, run on
        # well past the Ctrl-C)
        args = ["bench", *pair_args, "--num-prompts", "2", "--max-new-tokens", "300", "--modes", "target-only,inject",
                "--sweep", "", "--out", str(tmp_path / "bench")]
        marker, pipe = "decode", "stderr"
    def read(fd: int) -> bytes:
        try:
            return os.read(fd, 4096)
        except OSError:  # (EIO: a terminal whose other end has closed)
            return b""

    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    terminal = stderr = None
    if pipe == "stderr":  # (a terminal: the progress bar is drawn only there, with a window size, not 0 columns)
        import fcntl
        import pty
        import struct
        import termios

        terminal, stderr = pty.openpty()
        fcntl.ioctl(stderr, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "dflash_torch.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE if stderr is None else stderr, env=env)
    if stderr is not None:
        os.close(stderr)
    seen = b""
    try:
        while True:
            data = read(proc.stdout.fileno() if terminal is None else terminal)
            assert data, (proc.wait(), seen)  # the command ended before it was interrupted
            seen += data
            if marker.encode() in seen and (marker or seen.strip()):
                break
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        if terminal is not None:
            while more := read(terminal):
                seen += more
        err = seen.decode() if terminal is not None else err.decode()
    finally:
        proc.kill()
        if terminal is not None:
            os.close(terminal)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "terminate called" not in err, err
    if command == "generate":  # (says it was cut)
        assert re.search(r"^\[[0-9]+ tokens?, finish=interrupted\]$", err, re.M), err


def test_a_burst_of_ctrl_cs_exits_130_without_a_traceback(tiny_pair):
    """Several quick Ctrl-Cs (a key held down, or pressed again while the command stops): the
    first interrupts the generation, the others are ignored, not raised inside its clean-up or
    the interpreter's exit callbacks ("Exception ignored in atexit callback"): status 130, no
    traceback. Twenty signals 0.05 ms apart once the text streams (before the fix, 7 runs in 8
    ended with a traceback), three times."""
    import signal
    import time

    target, drafter = tiny_pair
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-m", "dflash_torch.cli", "generate", "--target", str(target),
                                 "--draft", str(drafter), PROMPT, "--max-new-tokens", "900", "--ignore-eos"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        try:
            assert os.read(proc.stdout.fileno(), 4096), proc.communicate()  # the text streams
            for _ in range(20):
                proc.send_signal(signal.SIGINT)
                time.sleep(0.00005)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 130, err.decode()
        assert b"Traceback" not in err and b"Exception ignored" not in err, err.decode()


def _ignore_sigint() -> None:  # (as a shell without job control does for a command it starts in the background)
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("command, status", [("train", 130), ("bench", 130), ("generate", 130), ("chat", 130),
                                             ("nosuch", 2)])
def test_sigint_stops_a_command_started_with_sigint_ignored(command, status):
    """A command started with SIGINT ignored (`dflash-torch train ... &` from a script) stops on
    SIGINT from its start, as in the foreground (train: its checkpoint saved, 130), as serve
    does: train trained on to its last step (trial-293 d), generate and chat (fed by a pipe) went
    on to their end, status 0 (trial-304 e). Here the process sends it itself as the command's
    main() begins (status 130; ignored, main() refuses the missing flags: 2). What is no command
    keeps it ignored."""
    code = ("import os, signal, sys\nfrom dflash_torch import cli\nmain = cli.main\n"
            "cli.main = lambda: os.kill(os.getpid(), signal.SIGINT) or main()\n"
            f"sys.argv = ['dflash-torch', {command!r}, '--no-such-flag']\ncli.entry()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), preexec_fn=_ignore_sigint, stdin=subprocess.DEVNULL)
    assert proc.returncode == status, (proc.returncode, proc.stderr)
    assert (not proc.stderr) == (status == 130), proc.stderr


def test_a_ctrl_c_after_a_swallowed_one_interrupts_again(monkeypatch):
    """The burst rule ignores the Ctrl-Cs right after the one raised; one that comes
    cli.INSIST_S later raises again: a first one that an import swallowed (numpy's, inside
    torch's, trial-146) left the command deaf to every later Ctrl-C. One while the compute
    thread is busy raises too; none once the command has ended."""
    import time

    from dflash_torch import cli

    monkeypatch.setattr(cli, "_interrupts_raised", 0)
    monkeypatch.setattr(cli, "_last_raised", 0.0)
    with pytest.raises(KeyboardInterrupt):
        cli._on_sigint(2, None)
    cli._on_sigint(2, None)  # (the burst's next one: ignored)
    assert cli._interrupts_raised == 1
    monkeypatch.setattr(cli, "_last_raised", time.monotonic() - cli.INSIST_S)
    with pytest.raises(KeyboardInterrupt):
        cli._on_sigint(2, None)
    cli._on_sigint(2, None)
    monkeypatch.setattr(cli, "_interrupts_raised", None)
    monkeypatch.setattr(cli, "_last_raised", 0.0)
    cli._on_sigint(2, None)  # (ended: ignored)


def test_ctrl_c_while_the_command_line_starts_exits_130_without_a_traceback(pair_args):
    """Importing the command line does not import torch (the package's names load on first
    use), so a Ctrl-C while torch loads lands in ``main`` like any other: exit status 130,
    no traceback. The signal is sent once the process maps torch's library (it is loading
    torch, or already the models: both are interrupts ``main`` handles), not after a fixed
    0.5 s, which a loaded machine spent still starting the interpreter (killed by SIGINT)."""
    import signal
    import time

    code = ("import sys, dflash_torch.cli; print('torch' in sys.modules, "
            "[n for n in dir(dflash_torch) if not n.startswith('__')] == sorted(dflash_torch.__all__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False True", out  # (dir: the public names only)
    proc = subprocess.Popen([sys.executable, "-m", "dflash_torch", "generate", *pair_args, PROMPT],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        with open(f"/proc/{proc.pid}/maps") as maps:
            if "libtorch" in maps.read():
                break
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err.decode(), err.decode()


def test_ctrl_c_inside_torchs_import_of_numpy_exits_130():
    """A Ctrl-C inside torch's import of numpy (here: sent as that import begins) ends the
    command with 130: torch's import swallowed it (it clears numpy's failed import; numpy's
    next import then failed, or the command went on: here to refuse serve's --port 0, status 2)."""
    code = ("import os, signal, sys\n"
            "class Finder:\n"
            "    sent = False\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'numpy' and not Finder.sent:\n"
            "            Finder.sent = True\n"
            "            os.kill(os.getpid(), signal.SIGINT)\n"
            "sys.meta_path.insert(0, Finder())\n"
            "from dflash_torch import cli\n"
            "sys.argv = ['dflash-torch', 'serve', '--port', '0']\n"
            "cli.entry()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 130 and not out.stderr, (out.returncode, out.stderr)


def test_generate_imports_neither_the_http_stack_nor_torch_dynamo(pair_args):
    """generate / bench / train run where FastAPI and uvicorn are not installed (e.g. a GPU
    machine used only to benchmark): a generate imports neither. Nor does an eager one import
    ``torch._dynamo`` (building the models on the meta device and marking the caches' static
    addresses imported it: half a second and 70 MB of every start), nor does reading the compile
    counters after it (a server's first ``/metrics`` stalled its event loop for 2-3 s on that import)."""
    code = ("import contextlib, io, sys; from dflash_torch.cli import main\n"
            "from dflash_torch.decoding import compile_counts, eager_fallbacks\n"
            "with contextlib.redirect_stdout(io.StringIO()): status = main(sys.argv[1:])\n"
            "assert compile_counts() == (0, 0) and eager_fallbacks() == 0\n"
            "print(status, sorted(m for m in ('fastapi', 'uvicorn', 'starlette', 'torch._dynamo') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, "generate", *pair_args, PROMPT, "--max-new-tokens", "8"],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0 []", out.stdout


def test_memory_running_out_mid_run_is_one_line_naming_what_asks_for_less(pair_args, capsys, monkeypatch):
    """The machine's memory running out while a command runs (past the load and start-up
    checks, which count weights and caches: a long prefill chunk's activations, torch's
    compiler) is one line and status 1, naming the command's options that ask for less
    (trial-255: a 67-line traceback ending in "DefaultCPUAllocator: can't allocate memory",
    or torch's compiler wrapping a MemoryError in 120 lines)."""
    from dflash_torch import DFlashEngine
    from dflash_torch.cli import main, out_of_memory

    import torch

    def allocate(*args, **kwargs):  # (a real failure of torch's CPU allocator, where a forward pass would hit it)
        torch.empty(2 ** 62, dtype=torch.uint8)
        yield

    monkeypatch.setattr(DFlashEngine, "stream", allocate)
    assert main(["generate", *pair_args, "--threads", "1", PROMPT, "--max-new-tokens", "4"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("dflash-torch: error: out of memory while running (DefaultCPUAllocator: can't "
                                        "allocate memory: you tried to allocate "), err
    assert err.endswith("): free memory, or ask for less (--prefill-chunk, --max-new-tokens, --max-context)\n"), err
    try:  # (wrapped, as torch's compiler raises it: found under the error it was raised from)
        try:
            raise MemoryError()
        except MemoryError as exc:
            raise RuntimeError("InternalTorchDynamoError: MemoryError") from exc
    except RuntimeError as exc:
        wrapped = exc
    assert out_of_memory(wrapped) == "MemoryError"
    assert out_of_memory(RuntimeError("shapes cannot be multiplied")) is None and out_of_memory(ValueError("x")) is None


def test_a_missing_dependency_is_one_line_naming_it_for_every_command():
    """Without a package dflash-torch needs (here psutil, or tokenizers, as if uninstalled),
    every command is one line naming it and how to install it, exit 1: ``train`` vanished from
    the commands ("invalid choice: 'train'") and ``generate`` was a ModuleNotFoundError
    traceback (trial-169); tokenizers, missing behind transformers' lazy import of
    AutoTokenizer, was named by neither (trial-173)."""
    # (one process per missing package, its command lines run in turn: each's stderr and status after a marker line)
    code = ("import json, sys; sys.modules[sys.argv[1]] = None; from dflash_torch.cli import main\n"
            "for args in json.loads(sys.argv[2]):\n"
            "    print('--', file=sys.stderr, flush=True)\n"
            "    print(main(args), flush=True)\n")
    for module, argvs in (("psutil", [["train", "--help"], ["generate", "x", "--max-new-tokens", "1"]]),
                          ("tokenizers", [["generate", "x", "--max-new-tokens", "1"]])):
        proc = subprocess.run([sys.executable, "-c", code, module, json.dumps(argvs)], capture_output=True, text=True,
                              timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == 0 and proc.stdout == "1\n" * len(argvs), (proc.stdout, proc.stderr)
        assert proc.stderr == len(argvs) * ("--\n" f"dflash-torch: error: the Python package {module!r} is not "
                                            f"installed, and dflash-torch needs it: pip install {module}\n"), proc.stderr
    from dflash_torch.cli import import_error_message  # (a module whose PyPI name is another)

    assert import_error_message(ModuleNotFoundError("No module named 'yaml'", name="yaml")).endswith("pip install PyYAML")
    # (torch: the CPU build's index, as a plain pip install torch on Linux fetches the CUDA build: trial-254)
    assert import_error_message(ModuleNotFoundError("No module named 'torch'", name="torch")).endswith(
        "pip install torch (a CPU-only machine: pip install torch --index-url https://download.pytorch.org/whl/cpu, "
        "not the CUDA build pip picks by default on Linux)")


def test_a_value_argparse_refuses_is_quoted_short(cli):
    """A 5,000-digit --seed (or JSON option) that argparse refuses is quoted by its head and
    length, not whole (trial-173)."""
    for args, refused in ((["--seed", "9" * 5000], "invalid int value: '" + "9" * 40 + "...' (5000 characters)"),
                          (["--max-new-tokens", "x"], "invalid int value: 'x'")):
        proc = cli("generate", "x", *args)
        assert proc.returncode == 2 and refused in proc.stderr and len(proc.stderr) < 300, proc.stderr


def test_a_negative_number_with_an_exponent_or_inf_is_every_numeric_flags_value(capsys):
    """``-1e-3`` (and ``-inf``) after a numeric flag of any command is its value, which its type
    takes (a float flag) or refuses naming it (an int flag), and then its range check: argparse
    took it for a flag, "argument --lr: expected one argument", where ``--lr=-1e-3`` was "--lr
    must be a finite number > 0" (trial-293 f)."""
    from dflash_torch.cli import build_parser

    parser = build_parser()
    required = {"generate": ["x"], "train": ["--target", "t", "--data", "d", "--out", "o"]}
    checked = 0
    for command, sub in parser._commands().items():
        for action in sub._actions:
            kind = getattr(action.type, "__name__", None)
            if not action.option_strings or kind not in ("float", "int", "int_or_auto"):
                continue
            flag = action.option_strings[0]
            for value in ("-1e-3", "-2.5E+2", "-inf"):
                argv = [command, *required.get(command, []), flag, value]
                if kind == "float":
                    got = getattr(parser.parse_args(argv), action.dest)
                    assert got == float(value) or got == [float(value)], (argv, got)
                else:
                    with pytest.raises(SystemExit):
                        parser.parse_args(argv)
                    err = capsys.readouterr().err
                    named = "/".join(action.option_strings)  # (argparse names an option by all its flags)
                    assert err.startswith(f"dflash-torch: error: argument {named}: ") and f"'{value}'" in err, (argv, err)
                checked += 1
    assert checked > 100


def test_long_flags_are_not_taken_abbreviated(capsys):
    """A prefix of a flag is refused as unknown, in every command (argparse took ``--temp`` as
    --temperature; ``serve --chat``, a flag of generate, as --chat-template-kwargs: "expected
    one argument"; chat alone refused them, trial-171), in one line that names the command's
    flags it may have meant (those it begins, else difflib's close ones; trial-233: none), exit
    status 2."""
    from dflash_torch.cli import main as cli_main

    for args, unknown in (
            (["generate", "x", "--temp", "0.5"], "--temp 0.5; did you mean --temperature?"),
            (["generate", "--temp", "0.5", "x"], "--temp 0.5; did you mean --temperature?"),  # (0.5 was named x)
            (["serve", "--chat"], "--chat; --chat is an option of generate and bench, not of serve; did you mean "
                                  "--chat-template-kwargs?"),
            (["bench", "--num-p", "1"], "--num-p 1; did you mean --num-prompts?"),
            (["train", "--target", "t", "--data", "d", "--out", "o", "--step", "1"], "--step 1; did you mean --steps?"),
            (["chat", "--max-new", "8"], "--max-new 8; did you mean --max-new-tokens?"),
            (["generate", "x", "--top", "1"], "--top 1; did you mean --top-k or --top-p?"),
            (["generate", "x", "--temprature=1"], "--temprature=1; did you mean --temperature?"),  # (a typo: difflib)
            (["generate", "x", "--temp", "-0.5"], "--temp -0.5; did you mean --temperature?"),  # (trial-248: -0.5 left out)
            (["generate", "x", "--zzz"], "--zzz"),
            # (a command's flag before the command, the program's after it: where it goes; case aside; trial-235)
            (["--no-draft", "generate", "x"], "--no-draft; --no-draft is an option of generate: give it after the "
                                              "command (dflash-torch generate --no-draft ...)"),
            (["generate", "x", "--version"], "--version; --version is an option of dflash-torch itself: give it "
                                             "before the command (dflash-torch --version)"),
            (["--verson", "generate", "x"], "--verson; did you mean --version or --json?"),
            (["generate", "x", "--TEMPERATURE", "1"], "--TEMPERATURE 1; did you mean --temperature?"),
            # (another command's flag: whose it is, not a close one of this command: --port was "--prompt?")
            (["generate", "--port", "8000", "x"], "--port 8000; --port is an option of serve, not of generate"),
            (["serve", "--max-new-tokens", "5"], "--max-new-tokens 5; --max-new-tokens is an option of generate, "
                                                 "chat and bench, not of serve"),
            # (a command's flag with its value before the command: the value was "invalid choice: '5'")
            (["--max-new-tokens", "5", "generate", "x"], "--max-new-tokens 5; --max-new-tokens is an option of "
                                                         "generate: give it after the command (dflash-torch generate "
                                                         "--max-new-tokens ...)"),
            (["--max-new-tokens", "5", "x"], "--max-new-tokens 5; --max-new-tokens is an option of generate, chat "
                                             "and bench: give it after the command (dflash-torch generate "
                                             "--max-new-tokens ...)"),
            (["--steps", "3", "generate"], "--steps 3; --steps is an option of train, not of generate"),
            # (a command's flag after `--`, whose words are arguments: before `--`, not "after the command", which it
            # is; trial-304 b)
            (["generate", "--", "def f(x):", "--max-new-tokens", "3"], "--max-new-tokens 3; the words after -- are the "
                                                                       "prompt, not options: give --max-new-tokens "
                                                                       "before -- (dflash-torch generate "
                                                                       "--max-new-tokens ... -- PROMPT)"),
            (["serve", "--", "--port", "3"], "-- --port 3; the words after -- are not read as options: give --port "
                                             "before -- (dflash-torch serve --port ...)"),
            # (the same flag before `--` too: only the one after it named, with the same hint; more words than the
            # prompt after `--`: the prompt is one argument; trial-314 a, b)
            (["generate", "--max-new-tokens", "4", "--", "hi", "--max-new-tokens", "5"],
             "--max-new-tokens 5; the words after -- are the prompt, not options: give --max-new-tokens before -- "
             "(dflash-torch generate --max-new-tokens ... -- PROMPT)"),
            (["generate", "--", "hello", "world"], "world; the words after -- are arguments, not options: the prompt is "
                                                   "one argument, quote it (dflash-torch generate [OPTIONS] -- 'PROMPT "
                                                   "WORDS')"),
            # (a flag straight after `--` is the prompt; a spelling's hint after `--` says its flag goes before it:
            # trial-316 c)
            (["generate", "--", "--max-new-tokens", "4"], "4; the words after -- are arguments, not options: "
                                                          "--max-new-tokens was taken for the prompt; give it before -- "
                                                          "(dflash-torch generate --max-new-tokens ... -- PROMPT)"),
            (["generate", "--", "hello", "--temp", "0.5"], "--temp 0.5; did you mean --temperature? (before --: the "
                                                           "words after it are arguments)"),
            # (other tools' names for a flag: ours, from the table the Python API's hints use; --draft-model was
            # "--draft-mode or --draft?", --do-sample "--compile?", --max-length none)
            (["generate", "x", "--draft-model", "d"], "--draft-model d; did you mean --draft?"),
            (["generate", "x", "--do-sample"], "--do-sample; did you mean --temperature? (a --temperature above 0 "
                                               "samples; the default, 0, is greedy)"),
            (["generate", "x", "--max-length", "5"], "--max-length 5; did you mean --max-new-tokens? (it counts the "
                                                     "generated tokens only, not the prompt's)"),
            (["chat", "--stop_strings", "x"], "--stop_strings x; did you mean --stop?"),
            (["generate", "x", "--response-format", "j"], "--response-format j; did you mean --json-schema or "
                                                          "--json-object?"),
            (["serve", "--max-model-len", "64", "--model", "m"], "--max-model-len 64 --model m; did you mean "
                                                                 "--max-context?"),
            (["serve", "--enable-prefix-caching"], "--enable-prefix-caching; prefix reuse is on by default "
                                                   "(--no-prefix-reuse turns it off)"),
            (["bench", "--num-speculative-tokens", "8"], "--num-speculative-tokens 8; did you mean --block-size? "
                                                         "(tokens per block: each round drafts the block size - 1 tokens)"),
            (["generate", "x", "--gamma", "8"], "--gamma 8; --gamma is an option of train, not of generate; did you "
                                                "mean --block-size? (tokens per block: each round drafts the block "
                                                "size - 1 tokens)"),
            (["generate", "x", "--n", "2"], "--n 2"),  # (no flag does its work: not --no-draft or --nvfp4)
            # (trial-299: the closest spelling named flags of other work: --chat-template-kwargs, --version,
            # --max-new-tokens, --block-size, --save-dtype)
            (["generate", "x", "--chat-template", "t"], "--chat-template t; the model's own chat template is used "
                                                        "(its tokenizer's); --chat-template-kwargs sets its variables"),
            (["generate", "x", "--revision", "r"], "--revision r; a revision is given with the model's Hugging Face "
                                                   "id: --target ORG/NAME@REVISION (--draft too)"),
            (["serve", "--max-num-batched-tokens", "5"], "--max-num-batched-tokens 5"),
            (["generate", "x", "--max-input-tokens", "5"], "--max-input-tokens 5"),
            (["generate", "x", "--batch-size", "4"], "--batch-size 4"),
            (["serve", "--batch-size", "4"], "--batch-size 4"),  # (llama.cpp's: tokens per step, trial-303)
            (["generate", "x", "--input-ids", "1"], "--input-ids 1"),  # (not --prompt: it takes text)
            (["train", "--target", "t", "--data", "d", "--out", "o", "--batch-size", "4"],
             "--batch-size 4; did you mean --batch?"),
            (["train", "--target", "t", "--data", "d", "--out", "o", "--save-steps", "4"],
             "--save-steps 4; did you mean --ckpt-every?"),
            (["train", "--target", "t", "--data", "d", "--out", "o", "--max-model-len", "9"], "--max-model-len 9"),
            # (trainers' names: the training sequence length, the gradient clip, the batch)
            (["train", "--target", "t", "--data", "d", "--out", "o", "--max-seq-len", "9"],
             "--max-seq-len 9; did you mean --seq-len?"),
            (["train", "--target", "t", "--data", "d", "--out", "o", "--max-seq-length", "9"],
             "--max-seq-length 9; did you mean --seq-len?"),
            (["train", "--target", "t", "--data", "d", "--out", "o", "--max-grad-norm", "1"],
             "--max-grad-norm 1; did you mean --grad-clip?"),
            (["train", "--target", "t", "--data", "d", "--out", "o", "--per-device-train-batch-size", "2"],
             "--per-device-train-batch-size 2; did you mean --batch?"),
            (["serve", "--max-seq-len", "64"], "--max-seq-len 64; did you mean --max-context?")):
        with pytest.raises(SystemExit) as exit:
            cli_main(args)
        assert exit.value.code == 2 and capsys.readouterr().err == \
            f"dflash-torch: error: unrecognized arguments: {unknown} (see --help)\n", args
    for args, hint in ((["--verson"], "--verson; did you mean --version?"), (["--no-draft"], "--no-draft; --no-draft is an option of generate, chat, serve and bench: give it after "
                                    "the command (dflash-torch generate --no-draft ...)")):
        with pytest.raises(SystemExit) as exit:  # (no command: the flag argparse took for none is named too)
            cli_main(args)
        assert exit.value.code == 2 and capsys.readouterr().err == ("dflash-torch: error: the following arguments are "
                                                                    f"required: command; unrecognized arguments: {hint} "
                                                                    "(see --help)\n"), args


def test_other_tools_flag_names_point_to_flags_that_exist():
    """Each flag the table of other tools' names points to is a flag of some command, each
    CLI note belongs to a name of the table, and the names the Python API maps to its
    arguments reach the flags of those arguments (``max_model_len`` -> ``--max-context``)."""
    from dflash_torch.aliases import ALIASES, FLAG_NOTES, FLAGS, flag_hint
    from dflash_torch.cli import build_parser

    commands = build_parser()._commands()
    every = {f for p in commands.values() for f in p.flags.values()}
    assert {f for flags in FLAGS.values() for f in flags} <= every
    assert set(FLAG_NOTES) <= set(ALIASES) | set(FLAGS)
    named = {re.search(r"did you mean (--[\w-]+)", flag_hint("--" + n, every) or "") for n in ALIASES}
    assert {"--max-new-tokens", "--max-context", "--block-size", "--draft", "--target", "--stop", "--seed",
            "--max-batch-size", "--model-name", "--dtype", "--device"} <= {m[1] for m in named if m}


def test_stop_help_says_how_to_pass_a_newline(capsys, monkeypatch):
    """``--stop '\\n'`` is a backslash and an n (the shell's quoting, taken as written: no
    escapes are read), so it never matched a newline: the help of every command with --stop
    says how bash passes one (trial-233)."""
    from dflash_torch.cli import main as cli_main

    monkeypatch.setenv("COLUMNS", "1000")
    for command in ("generate", "chat"):
        with pytest.raises(SystemExit):
            cli_main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        line = text.split("--stop STOP ", 1)[1].split(" --ignore-eos", 1)[0]
        assert "taken as written" in line and "--stop $'\\n'" in line, (command, line)


def test_help_says_when_the_shipped_drafter_and_the_batch_slots_apply(capsys, monkeypatch):
    """``--draft``'s default (the shipped drafter) goes with the shipped target only (another
    target without --draft is refused), and ``serve --max-batch-size`` does not batch a
    recompute engine: the help says so for every command that takes the option."""
    from dflash_torch.cli import main as cli_main

    monkeypatch.setenv("COLUMNS", "1000")  # (no wrapping inside a flag's name)
    for command in ("generate", "serve", "bench"):
        with pytest.raises(SystemExit):
            cli_main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "(default: the shipped drafter, which goes with the shipped target only)" in text, command
        if command == "serve":
            assert "--draft-mode recompute decodes one sequence at a time: one slot" in text


def test_text_stdout_cannot_encode_is_replaced_not_a_traceback():
    """A stdout that cannot encode the output (``PYTHONIOENCODING=ascii``): ``?`` for what
    it cannot write, exit 0 (it was a UnicodeEncodeError traceback); token 2431 of the
    shipped tokenizer is a right single quotation mark."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONIOENCODING="ascii")
    proc = subprocess.run([sys.executable, "-m", "dflash_torch.cli", "generate", "x", "--max-new-tokens", "3",
                           "--logit-bias", '{"2431": 100}'], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0 and proc.stdout == "???", proc.stderr


def test_a_chat_prompt_on_stdin_loses_its_final_line_break(cli, pair_args, api):
    """``echo hi | generate --chat``: the message is "hi", as ``generate hi --chat`` and a
    ``chat`` line send it (the line break echo adds was part of the user message); a text
    prompt keeps it."""
    want = api.generate([{"role": "user", "content": "hi"}], max_new_tokens=4, ignore_eos=True).token_ids
    for stdin in ("hi\n", "hi\r\n"):
        proc = cli("generate", *pair_args, "--chat", "--max-new-tokens", "4", "--ignore-eos", "--json", stdin=stdin)
        assert proc.returncode == 0, proc.stderr
        out = parse_single_json(proc.stdout)
        assert out["token_ids"] == want and out["stats"]["prompt_tokens"] == len(api.encode_prompt("hi", chat=True))
    proc = cli("generate", *pair_args, "--max-new-tokens", "4", "--ignore-eos", "--json", stdin="def f(x):\n")
    assert parse_single_json(proc.stdout)["stats"]["prompt_tokens"] == len(api.encode_prompt("def f(x):\n"))


def test_an_endless_stdin_is_read_no_further_than_the_context_can_hold(cli, tiny_pair):
    """``yes | generate`` (trial-304 a: read to its end first, 7.9 GB and growing until killed;
    a 1 GB one refused after 2.2 GB): stdin is read no further than the longest prompt the
    context could hold (and one character more; --chat: the line break it drops too), then
    refused in the words of the engine's refusal, exit 2: the bytes read are about that many,
    memory flat. A byte that is not UTF-8 past the first read is named at its offset from the
    start of stdin."""
    import io

    from conftest import EndlessInput
    from transformers import AutoTokenizer

    from dflash_torch.tokenizer import max_prompt_chars

    limit = max_prompt_chars(AutoTokenizer.from_pretrained(str(tiny_pair[0])), 16)
    pair = ["--target", str(tiny_pair[0]), "--no-draft", "--max-new-tokens", "2", "--max-context", "16"]
    for chat in ([], ["--chat"]):
        endless = EndlessInput(b"y\n", most=64 * limit + (1 << 20))  # (a read to its end fails there)
        proc = cli("generate", *pair, *chat, stdin=io.TextIOWrapper(io.BufferedReader(endless)))
        assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
        assert proc.stderr == (f"dflash-torch: error: the prompt on stdin has more than {limit} characters: more than "
                               f"the context of 16 tokens can hold (at most {limit} characters with this tokenizer)\n")
        assert endless.taken <= limit + 3 + io.DEFAULT_BUFFER_SIZE, (endless.taken, limit)
    data = "\u00e9".encode() * (limit - 1) + b"\xff"  # (two bytes a character: read in several pieces)
    proc = cli("generate", *pair, stdin=io.TextIOWrapper(io.BytesIO(data)))
    assert proc.returncode == 2 and proc.stderr == (f"dflash-torch: error: the prompt on stdin is not UTF-8 text (byte "
                                                    f"0xff at offset {2 * (limit - 1)})\n"), proc.stderr


def test_streamed_text_is_the_output_as_generated_and_a_terminal_gets_a_line_break(cli, tiny_pair, monkeypatch):
    """stdout not a terminal (``generate ... > file``, a pipe) holds the generated text as it is:
    ``--regex 'abc\\n'`` writes ``abc\\n``, as ``--json``'s text says (a line break was added:
    ``abc\\n\\n``, trial-304 c); on a terminal a line break after it keeps the shell's prompt
    on a line of its own."""
    import pty

    from dflash_torch.cli import main as cli_main

    args = ["generate", "x = ", "--target", str(tiny_pair[0]), "--no-draft", "--regex", "abc\n"]
    proc = cli(*args)
    assert (proc.returncode, proc.stdout) == (0, "abc\n"), proc.stderr
    assert parse_single_json(cli(*args, "--json").stdout)["text"] == "abc\n"
    master, slave = pty.openpty()
    try:
        with open(slave, "w", encoding="utf-8") as terminal:
            monkeypatch.setattr(sys, "stdout", terminal)
            assert cli_main(args) == 0
            monkeypatch.undo()
        seen = b""  # (what the terminal passes on, in pieces maybe; once it is closed, EIO after the last)
        while len(seen.replace(b"\r\n", b"\n")) < len(b"abc\n\n"):
            try:
                more = os.read(master, 4096)
            except OSError:
                break
            if not more:
                break
            seen += more
        assert seen.replace(b"\r\n", b"\n") == b"abc\n\n", seen  # (the terminal's ONLCR: \r\n)
    finally:
        os.close(master)


@pytest.mark.parametrize("logprobs", [[], ["--logprobs", "1"]])
def test_ctrl_c_with_json_prints_what_was_generated_so_far(cli, pair_args, api, monkeypatch, logprobs):
    """``generate --json`` stopped by a Ctrl-C (SIGINT) while it decodes: the object of the
    text and tokens so far (the uninterrupted run's first ones), ``finish_reason``
    "interrupted" and of the stats the count of tokens, as the streamed text's stats line
    gives them then (``[N tokens, finish=interrupted]``, the same N), exit status 130 (it
    printed nothing, trial-304 d). In-process: a real SIGINT once the third round is taken."""
    import signal

    from dflash_torch import cli as cli_module

    load = cli_module.load_engine

    def interrupted_at_the_fourth_round(args):
        engine = load(args)
        record, taken = engine.record_round, [0]

        def interrupted(*a, **kw):
            taken[0] += 1
            if taken[0] == 4:
                os.kill(os.getpid(), signal.SIGINT)  # (its handler runs in this, the main, thread)
            return record(*a, **kw)

        monkeypatch.setattr(engine, "record_round", interrupted)
        return engine

    monkeypatch.setattr(cli_module, "load_engine", interrupted_at_the_fourth_round)
    args = ["generate", *pair_args, PROMPT, "--max-new-tokens", "200", "--ignore-eos"]
    proc = cli(*args, "--json", *logprobs)
    assert proc.returncode == 130, proc.stderr
    out = parse_single_json(proc.stdout)
    whole = api.generate(PROMPT, max_new_tokens=200, ignore_eos=True)
    n = len(out["token_ids"])
    assert 3 <= n < 200 and out["token_ids"] == whole.token_ids[:n], out  # (the prefill's token, two rounds' at least)
    assert out["text"] and whole.text.startswith(out["text"])
    assert out["finish_reason"] == "interrupted" and out["stats"] == {"generated_tokens": n}
    assert out["prompt_logprobs"] is None and (len(out["logprobs"]) == n if logprobs else out["logprobs"] is None)
    streamed = cli(*args)
    assert streamed.returncode == 130 and streamed.stdout == out["text"]  # (no line break added: not a terminal)
    assert streamed.stderr.splitlines()[-1] == f"[{n} tokens, finish=interrupted]", streamed.stderr

    def interrupted_while_loading(args):  # (a Ctrl-C before the decode began printed nothing: trial-314 c)
        os.kill(os.getpid(), signal.SIGINT)
        return load(args)

    monkeypatch.setattr(cli_module, "load_engine", interrupted_while_loading)
    proc = cli(*args, "--json", *logprobs)
    assert proc.returncode == 130, proc.stderr
    assert parse_single_json(proc.stdout) == {"text": "", "token_ids": [], "finish_reason": "interrupted",
                                              "stats": {"generated_tokens": 0}, "logprobs": [] if logprobs else None,
                                              "prompt_logprobs": None}


@pytest.mark.parametrize("command", ["generate", "generate --json", "chat"])
def test_output_stdout_cannot_take_is_one_line_and_status_1(tiny_pair, command):
    """stdout on a full disk (/dev/full) or closed (``>&-``): one line on stderr, exit status 1
    (were an OSError or AttributeError traceback, and --json with stdout closed exited 0)."""
    args = [sys.executable, "-m", "dflash_torch.cli", *command.split(), "--target", str(tiny_pair[0]), "--no-draft",
            "--max-new-tokens", "3"] + (["def f(x):"] if command.startswith("generate") else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    with open("/dev/full", "w") as full:
        proc = subprocess.run(args, input="hi\nho\n", stdout=full, stderr=subprocess.PIPE, text=True, env=env,
                              timeout=240)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines()[-1] == "dflash-torch: error: cannot write the output to stdout: No space left on device"
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    proc = subprocess.run(args, input="hi\n", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          timeout=240, preexec_fn=lambda: os.close(1))
    assert proc.returncode == 1 and proc.stderr == "dflash-torch: error: stdout is closed: nowhere to write the output\n"


def test_help_stdout_cannot_take_is_one_line_and_status_1(capsys, monkeypatch):
    """``--help`` (and ``--version``) on a full disk (``> /dev/full``): one line, status 1, as the
    output of generate (argparse dropped the error: the help lost, status 0); a reader that went
    away (``| head -1``) ends it quietly, status 0."""
    from dflash_torch.cli import main as cli_main

    for args in (["bench", "--help"], ["generate", "--help"], ["--version"]):
        with open("/dev/full", "w") as full:  # (a new one each time: a failed stdout is pointed at /dev/null)
            monkeypatch.setattr(sys, "stdout", full)
            rc = cli_main(args)
            monkeypatch.undo()
        assert (rc, capsys.readouterr().err) == (1, "dflash-torch: error: cannot write the output to stdout: "
                                                        "No space left on device\n"), args
    read, write = os.pipe()
    os.close(read)
    with open(write, "w") as gone:
        monkeypatch.setattr(sys, "stdout", gone)
        rc = cli_main(["generate", "--help"])
        monkeypatch.undo()
    assert (rc, capsys.readouterr().err) == (0, "")
    for args in (["bench", "--help"], ["--version"]):  # (closed, >&-: the text went to stderr, status 0: trial-256)
        monkeypatch.setattr(sys, "stdout", None)
        rc = cli_main(args)
        monkeypatch.undo()
        assert (rc, capsys.readouterr().err) == (1, "dflash-torch: error: stdout is closed: nowhere to write the "
                                                    "output\n"), args
    with pytest.raises(SystemExit) as exc:  # (one stdout takes: the help, status 0)
        cli_main(["generate", "--help"])
    assert exc.value.code == 0 and "usage: dflash-torch generate" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["full", "read-only", "closed"])
def test_diagnostics_stderr_cannot_take_are_dropped(pair_args, api, tmp_path, kind):
    """``generate`` with a stderr that cannot take its stats line: the line is dropped, the
    output is whole and the status 0 (an uncaught OSError after the output made it 1), and
    nothing meant for stderr lands on stdout (``print(file=None)`` writes there)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    with stderr_that_cannot_take(kind, tmp_path) as stderr:
        proc = subprocess.run([sys.executable, "-m", "dflash_torch", "generate", *pair_args, PROMPT, "--max-new-tokens",
                               "4", "--ignore-eos"], stdout=subprocess.PIPE, text=True, env=env, timeout=240, **stderr)
    assert proc.returncode == 0
    assert proc.stdout == api.generate(PROMPT, max_new_tokens=4, ignore_eos=True).text


@pytest.mark.parametrize("command", ["bench", "train"])
def test_bench_and_train_go_on_where_stderr_cannot_take_their_lines(tiny_pair, tmp_path, command):
    """``bench`` and ``train`` with stderr on a full disk: their notes and progress lines are
    dropped, and they write their results and exit 0 (they failed at the first line, status 1,
    and removed their --out)."""
    target, drafter = tiny_pair
    out = tmp_path / "out"
    if command == "bench":
        (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": PROMPT}) + "\n")
        args = ["bench", "--target", str(target), "--draft", str(drafter), "--prompts", str(tmp_path / "p.jsonl"),
                "--max-new-tokens", "4", "--modes", "inject", "--sweep", "16", "--num-prompts", "1"]
    else:
        (tmp_path / "c.txt").write_text("def f(x):\n    return x\n" * 50)
        args = ["train", "--target", str(target), "--data", str(tmp_path / "c.txt"), "--steps", "1", "--seq-len", "64",
                "--batch", "2", "--val-seqs", "0"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    with stderr_that_cannot_take("full", tmp_path) as stderr:
        proc = subprocess.run([sys.executable, "-m", "dflash_torch", *args, "--out", str(out)], stdout=subprocess.PIPE,
                              text=True, env=env, timeout=300, **stderr)
    assert proc.returncode == 0, proc.stdout
    assert (out / ("bench.json" if command == "bench" else "model.safetensors")).is_file(), proc.stdout


def test_a_dash_prompt_reads_stdin(cli, tiny_pair):
    """``generate -`` reads the prompt from stdin as Unix tools read ``-`` (it generated from the
    text "-", stdin ignored); ``--prompt -`` is the text "-"."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    pair = ["--target", str(tiny_pair[0]), "--no-draft", "--max-new-tokens", "2", "--json"]
    proc = cli("generate", "-", *pair, stdin="import os\nimport sys\n")
    assert proc.returncode == 0, proc.stderr
    assert parse_single_json(proc.stdout)["stats"]["prompt_tokens"] == len(tok("import os\nimport sys\n")["input_ids"])
    proc = cli("generate", "--prompt", "-", *pair, stdin="import os\nimport sys\n")
    assert parse_single_json(proc.stdout)["stats"]["prompt_tokens"] == len(tok("-")["input_ids"])


def test_a_dash_prompt_reads_a_terminal_to_its_end(tiny_pair, cli):
    """``generate -`` on a terminal reads what is typed up to Ctrl-D, as ``cat -`` does (it was
    refused: 'no prompt'); a bare ``generate`` there is still refused, its message saying how
    to type one, and --help says that a prompt left out is read from stdin only where it is not
    a terminal (it said "left out or -: read from stdin", trial-267). (Both command lines in
    turn in one real process whose stdin is the terminal.)"""
    import pty

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    pair = ["--target", str(tiny_pair[0]), "--no-draft", "--max-new-tokens", "2", "--json"]
    code = ("import json, sys\n"
            "from dflash_torch.cli import main\n"
            "for args in json.loads(sys.argv[1]):\n"
            "    print('--', flush=True)\n"
            "    print('--', file=sys.stderr, flush=True)\n"
            "    try:\n"
            "        status = main(args)\n"
            "    except SystemExit as exc:  # (as the command's entry point takes it)\n"
            "        status = exc.code\n"
            "    print(f'--status {status}', flush=True)\n")
    argvs = [["generate", "-", *pair], ["generate", *pair]]
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(argvs)], stdin=slave, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"))
        os.close(slave)
        os.write(master, b"import os\n\x04")  # (the line, then Ctrl-D at the start of the next)
        out, err = proc.communicate(timeout=300)
    finally:
        os.close(master)
    assert proc.returncode == 0, err
    (typed_out, bare_out), (typed_err, bare_err) = out.split("--\n")[1:], err.split("--\n")[1:]
    typed_out, _, status = typed_out.rpartition("--status ")
    assert status == "0\n", typed_err
    assert parse_single_json(typed_out)["stats"]["prompt_tokens"] == len(tok("import os\n")["input_ids"])
    assert bare_out == "--status 2\n" and bare_err.endswith(
        "dflash-torch: error: no prompt: pass --prompt TEXT, a positional prompt, or pipe it on stdin; to type it at "
        "the terminal: generate - (ended by Ctrl-D)\n"), bare_err
    shown = " ".join(cli("generate", "--help").stdout.split())
    assert ("-: read from stdin to its end (at a terminal: typed, ended by Ctrl-D); left out: read from stdin where "
            "it is not a terminal (a pipe, a file)") in shown, shown
