"""``dflash-torch chat``: a real subprocess fed lines on stdin; its replies are the Python
API's replies to the same conversation (float32, greedy), the engine's prefix reuse reads
only what each turn adds, ``/reset`` starts over, and a refused turn leaves the
conversation as it was."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from conftest import REFUSING_TEMPLATE

from dflash_torch import DFlashEngine

SYSTEM = "You write Python."
NEW = 12


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return DFlashEngine.from_pretrained(*tiny_pair, dtype="float32")


def replies(engine, turns: list[list[str]]) -> list[str]:
    """The engine's replies to conversations: each list of user messages, after the system
    message, each turn's reply kept in the conversation."""
    out = []
    for messages in turns:
        conversation = [{"role": "system", "content": SYSTEM}]
        for text in messages:
            conversation.append({"role": "user", "content": text})
            reply = engine.generate(conversation, chat=True, max_new_tokens=NEW).text
            conversation.append({"role": "assistant", "content": reply})
            out.append(reply)
    return out


def stats_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("[") and "prompt tokens reused" in line]


def test_chat_replies_are_the_engines_and_reuse_the_last_turn(cli, tiny_pair, engine):
    target, drafter = tiny_pair
    stdin = "def f(x):\nclass A:\n\n/reset\ndef f(x):\n/what\n/help\n/?\n/quit\nnever read\n"
    proc = cli("chat", "--target", str(target), "--draft", str(drafter), "--dtype", "float32", "--system", SYSTEM,
                   "--max-new-tokens", str(NEW), stdin=stdin)
    assert proc.returncode == 1, proc.stderr  # (/what: piped input, a line failed)
    expected = replies(engine, [["def f(x):", "class A:"], ["def f(x):"]])
    assert proc.stdout == "".join(r + "\n" for r in expected)
    lines = stats_lines(proc.stderr)
    assert len(lines) == 3, proc.stderr
    reused = [int(line.split(", ")[-1].split(" of ")[0]) for line in lines]
    first = len(engine.encode_prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "def f(x):"}],
                                     chat=True))
    assert reused[0] == 0 and reused[1] >= first - 1, lines  # (turn 2 holds turn 1's prompt)
    assert "[conversation reset]" in proc.stderr and "unknown command '/what'" in proc.stderr
    assert proc.stderr.count("/reset (forget the conversation)") == 3 and "unknown command '/help'" not in proc.stderr
    # (every command it takes listed, /quit and /? too, and what Ctrl-C does at the prompt, trial-267)
    assert ("[commands: /reset (forget the conversation), /exit or /quit (or Ctrl-D), /help or /? (this list), // for "
            "a message starting with /; Ctrl-C stops a reply, and at the prompt exits]\n") in proc.stderr


def test_at_a_terminal_with_stdout_redirected_lines_are_read_whole_and_the_prompt_stays_out(tiny_pair, engine):
    """``chat > log`` typed at a terminal: the ``>>>`` prompt is written on the terminal and the
    log holds the replies alone (input() wrote the prompt into it, and nothing showed); a pasted
    line of 6,000 bytes arrives whole (read as the terminal's canonical mode passes it, it was
    cut at 4,095 bytes, silently), as with stdout on the terminal (readline reads it)."""
    import os
    import pty
    import select
    import subprocess
    import sys
    import time

    master, slave = pty.openpty()
    seen = [b""]

    def read(timeout: float) -> None:  # (the terminal's output: its echo must not fill the pty)
        if select.select([master], [], [], timeout)[0]:
            seen[0] += os.read(master, 65536)

    def until(want: bytes) -> None:
        deadline = time.monotonic() + 240
        while want not in seen[0]:
            assert time.monotonic() < deadline and proc.poll() is None, seen[0][-300:]
            read(0.2)
        seen[0] = seen[0][seen[0].index(want) + len(want):]

    long = "y" * 6000
    try:
        proc = subprocess.Popen([sys.executable, "-m", "dflash_torch.cli", "chat", "--target", str(tiny_pair[0]),
                                 "--draft", str(tiny_pair[1]), "--dtype", "float32", "--system", SYSTEM,
                                 "--max-new-tokens", str(NEW)], stdin=slave, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"))
        os.close(slave)
        until(b">>> ")
        for i in range(0, len(long), 1000):  # (pasted: in pieces, the echo read between them)
            os.write(master, long[i:i + 1000].encode())
            read(0.1)
        os.write(master, b"\r")
        until(b">>> ")
        os.write(master, b"def f(x):\r")
        until(b">>> ")
        os.write(master, b"\x04")  # (Ctrl-D at the prompt)
        out, err = proc.communicate(timeout=300)
    finally:
        os.close(master)
    assert proc.returncode == 0, err
    assert out == replies(engine, [["def f(x):"]])[0] + "\n" and ">>>" not in out and ">>>" not in err
    whole = len(engine.encode_prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": long}],
                                     chat=True, check_length=False))
    assert f"dflash-torch: error: the prompt ({whole} tokens) leaves no room for a new token" in err, err


@pytest.mark.parametrize("kind", ["full", "read-only"])
def test_a_stderr_that_cannot_take_the_stats_lines_drops_them(tiny_pair, engine, tmp_path, kind):
    """stderr on a full disk (``2>/dev/full``) or open read-only (``2>&-`` through pyenv's shim):
    the stats lines are dropped, every line gets its reply and the status is 0 (the first stats
    line was an uncaught OSError: one reply, status 1)."""
    import os
    import subprocess
    import sys

    from conftest import stderr_that_cannot_take

    turns = ["def f(x):", "class A:", "import os"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    with stderr_that_cannot_take(kind, tmp_path) as stderr:
        proc = subprocess.run([sys.executable, "-m", "dflash_torch", "chat", "--target", str(tiny_pair[0]), "--draft",
                               str(tiny_pair[1]), "--dtype", "float32", "--system", SYSTEM, "--max-new-tokens",
                               str(NEW)], input="".join(t + "\n" for t in turns), stdout=subprocess.PIPE, text=True,
                              env=env, timeout=300, **stderr)
    assert proc.returncode == 0
    assert proc.stdout == "".join(r + "\n" for r in replies(engine, [turns]))


def test_a_refused_turn_leaves_the_conversation_as_it_was(cli, tiny_pair, engine):
    target, drafter = tiny_pair
    long = "x = 1; " * 40
    system = [{"role": "system", "content": SYSTEM}]
    # a message that fits a new conversation, not this one (the longest such: the history takes more room)
    medium = next(
        "y = 2; " * k for k in range(40, 0, -1)
        if len(engine.encode_prompt(system + [{"role": "user", "content": "y = 2; " * k}], chat=True,
                                    check_length=False)) + NEW <= 160)
    proc = cli("chat", "--target", str(target), "--draft", str(drafter), "--dtype", "float32", "--system", SYSTEM,
                   "--max-new-tokens", str(NEW), "--max-context", "160",
                   stdin=f"{long}\ndef f(x):\n{long}\n{medium}\nclass A:\n")
    assert proc.returncode == 1, proc.stderr  # (piped input: the refused turns make the status 1, at the end)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dflash-torch: error: ")]
    assert len(errors) == 3, proc.stderr
    # (the prompt alone exceeds the context: named, not --max-new-tokens)
    pattern = r"dflash-torch: error: the prompt \((1[6-9]\d|[2-9]\d\d) tokens\) leaves no room for a new token in the context of 160 tokens; shorten it or raise --max-context \(up to 1024\)"
    assert re.fullmatch(pattern, errors[0]), errors  # (the first turn: nothing to /reset)
    # (trial-156: a message too long for any conversation got the /reset hint after a first turn, where it cannot help)
    assert re.fullmatch(pattern, errors[1]), errors
    # a message that fits a new conversation: led by what fills the context, the earlier turns, and /reset; not
    # the error's advice to shorten the prompt or raise --max-context, which cannot be taken mid-chat (trial-184)
    assert re.fullmatch(r"dflash-torch: error: this conversation no longer fits: (the prompt \(\d+ tokens\) leaves "
                        r"no room for a new token in the context of 160 tokens|prompt \(\d+ tokens\) \+ "
                        r"--max-new-tokens \(12\) exceeds the context of 160 tokens); /reset starts a new "
                        r"conversation; a longer one needs a chat started with a larger --max-context \(up to 1024\)",
                        errors[2]), errors
    assert proc.stdout == "".join(r + "\n" for r in replies(engine, [["def f(x):", "class A:"]]))


def test_a_line_too_long_for_the_context_is_read_no_further_and_refused(cli, tiny_pair, engine):
    """``tr '\\0' a < /dev/zero | head -c 1500000000 | chat`` (trial-304 a: the whole line held,
    4.7 GB, before the refusal): a line longer than any message the context could hold is
    refused in the words of the engine's refusal and the chat goes on (piped: exit status 1 at
    the end); its rest is read and dropped, so a blank one is skipped, and a command followed
    by blanks runs, as before."""
    from dflash_torch.tokenizer import max_prompt_chars

    limit = max_prompt_chars(engine.tokenizer, 64)
    stdin = f"{'a' * (3 * limit)}\n{' ' * (3 * limit)}\ndef f(x):\n/reset{' ' * (3 * limit)}\n"
    proc = cli("chat", "--target", str(tiny_pair[0]), "--no-draft", "--dtype", "float32", "--max-context", "64",
               "--max-new-tokens", "4", stdin=stdin)
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dflash-torch: error: ")]
    assert errors == [f"dflash-torch: error: the message has more than {limit} characters: more than the context of "
                      f"64 tokens can hold (at most {limit} characters with this tokenizer); it was not sent"], errors
    assert proc.stderr.count("[conversation reset]") == 1, proc.stderr
    assert proc.stdout == engine.generate([{"role": "user", "content": "def f(x):"}], chat=True,
                                          max_new_tokens=4).text + "\n"


def test_a_long_lines_rest_is_dropped_as_it_is_read(monkeypatch):
    """chat's reader of piped lines holds no more of a line than it may take (memory flat
    whatever the line's length: the 20 MB line here peaks under 1 MB of Python's allocations,
    where the whole line was read), says whether the rest it dropped was blank, and reads the
    next line whole."""
    import io
    import sys
    import tracemalloc

    from dflash_torch import chat

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"a" * 20_000_000 + b"\nnext\n" + b"/exit" +
                                                                  b" " * 300 + b"\n")))
    tracemalloc.start()
    try:
        with pytest.raises(chat.LongLine) as long:
            chat._read_line(100)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert long.value.head == "a" * 101 and not long.value.blank_rest and peak < 1 << 20, peak
    assert chat._read_line(100) == "next"
    with pytest.raises(chat.LongLine) as long:
        chat._read_line(100)
    assert long.value.head.strip() == "/exit" and long.value.blank_rest
    with pytest.raises(EOFError):
        chat._read_line(100)


def test_a_conversation_that_outgrew_the_context_is_told_what_can_help(cli, tiny_pair, tmp_path):
    """Without --max-new-tokens a turn fills the context left (--ignore-eos); the next turn is
    refused with the facts, /reset, and a larger --max-context only where one would hold it:
    not at the target's own context (the error's "shorten it or raise --max-context" was
    given mid-chat, where neither can be done)."""
    target = shutil.copytree(tiny_pair[0], tmp_path / "target")
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 80}))
    for flags, limit in ((["--target", str(tiny_pair[0]), "--max-context", "80"], 1024), (["--target", str(target)], 80)):
        proc = cli("chat", *flags, "--no-draft", "--dtype", "float32", "--ignore-eos", stdin="import os\nimport sys\n")
        assert proc.returncode == 1, proc.stderr
        errors = [line for line in proc.stderr.splitlines() if line.startswith("dflash-torch: error: ")]
        assert len(errors) == 1 and re.fullmatch(
            r"dflash-torch: error: this conversation no longer fits: the prompt \(\d+ tokens\) leaves no room for a new "
            r"token in (the|the target's) context of 80 tokens; /reset starts a new conversation"
            + (rf"; a longer one needs a chat started with a larger --max-context \(up to {limit}\)" if limit > 80 else ""),
            errors[0]), errors
    # a turn whose prompt fits, but not with the --min-tokens it asks (its default max_new_tokens, 40, is cut to the
    # room left): the same form, not the bare error (trial-267)
    (target / "config.json").write_text(json.dumps(config))
    (target / "generation_config.json").write_text(json.dumps({"max_new_tokens": 40}))
    proc = cli("chat", "--target", str(target), "--no-draft", "--dtype", "float32", "--ignore-eos", "--max-context",
               "110", "--min-tokens", "40", stdin="import os\nimport sys\n")
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dflash-torch: error: ")]
    assert len(errors) == 1 and re.fullmatch(
        r"dflash-torch: error: this conversation no longer fits: --min-tokens \(40\) exceeds the \d+ tokens left in the "
        r"context of 110 tokens after the prompt \(\d+ tokens\); /reset starts a new conversation; a longer one needs a "
        r"chat started with a larger --max-context \(up to 1024\)", errors[0]), errors


def test_a_tokenizer_without_a_chat_template_is_refused(cli, tiny_pair, tmp_path):
    target = shutil.copytree(tiny_pair[0], tmp_path / "target")
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    (target / "chat_template.jinja").unlink(missing_ok=True)
    proc = cli("chat", "--target", str(target), "--no-draft", stdin="hi\n")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("dflash-torch: error: the target's tokenizer has no chat template; use 'dflash-torch "
                           "generate' for plain text\n")


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(tiny_pair):
    """SIGINT while a reply streams ends that reply (what it wrote is kept); the next line
    gets a reply as usual, and ``/exit`` ends the chat with status 0. (500 new tokens: the
    interrupted reply may have run for a while on a loaded machine, and the next turn's
    prompt, which holds it, must leave room for them in the 1,024-token context; with 900 a
    reply of 79 tokens made the next turn overflow it.)"""
    import os
    import signal
    import time

    proc = _chat_process(tiny_pair, 500)
    try:
        proc.stdin.write(b"def f(x):\n")
        proc.stdin.flush()
        os.set_blocking(proc.stdout.fileno(), False)
        deadline = time.monotonic() + 120
        while not proc.stdout.read(64):  # the reply has started
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(b"class A:\n/exit\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err.decode()
    assert proc.returncode == 0, err
    assert re.search(r"^\[[1-9][0-9]* tokens?, finish=interrupted\]$", err, re.M) and len(stats_lines(err)) == 1, err


def test_ctrl_c_stops_each_reply_after_an_interrupted_one(tiny_pair):
    """A command ignores the Ctrl-Cs after the one that stopped it (dflash_torch.cli.entry), but
    chat goes on after an interrupted reply: there the next Ctrl-C stops the next reply too."""
    import os
    import signal
    import time

    proc = _chat_process(tiny_pair, 400)
    err = b""

    def wait(what):
        nonlocal err
        deadline = time.monotonic() + 120
        while not what():
            err += proc.stderr.read() or b""  # (what chat said meanwhile: shown where the wait fails)
            assert time.monotonic() < deadline and proc.poll() is None, err
            time.sleep(0.02)

    try:
        os.set_blocking(proc.stdout.fileno(), False)
        os.set_blocking(proc.stderr.fileno(), False)
        for turn, line in enumerate([b"def f(x):\n", b"class A:\n"], 1):
            proc.stdin.write(line)
            proc.stdin.flush()
            wait(lambda: proc.stdout.read(64))  # the reply has started
            proc.send_signal(signal.SIGINT)

            def stopped():
                return err.count(b"finish=interrupted") == turn  # (wait reads stderr into err)

            wait(stopped)
            proc.stdout.read()  # (what the reply wrote meanwhile)
        _, rest = proc.communicate(b"/exit\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = (err + rest).decode()
    assert proc.returncode == 0, err
    assert len(re.findall(r"^\[[1-9][0-9]* tokens?, finish=interrupted\]$", err, re.M)) == 2, err


class _Lines:
    """chat's stdin in-process (a terminal where ``tty``): its lines, and at each line read a
    hook (``on_read[i]``, for the i-th line; at the end of the input, the key ``None``)."""

    def __init__(self, lines: list[str], on_read: dict, tty: bool):
        self.lines, self.on_read, self.tty, self.encoding = list(lines), on_read, tty, "utf-8"
        self.read = 0

    def isatty(self) -> bool:
        return self.tty

    def reconfigure(self, **kwargs) -> None:
        pass

    def fileno(self) -> int:  # (none: input() reads through readline())
        import io

        raise io.UnsupportedOperation("fileno")

    def readline(self, size: int = -1) -> str:  # (its lines are short: none is longer than a size chat asks)
        hook = self.on_read.get(self.read if self.lines else None)
        if hook is not None:
            hook()
        self.read += 1
        return self.lines.pop(0) + "\n" if self.lines else ""


@pytest.fixture
def sigint_as_entry_sets_it(monkeypatch):
    """SIGINT handled in this process as ``dflash-torch`` handles it (cli.entry: cli._on_sigint),
    with no time limit on a burst (cli.INSIST_S: the burst's quick presses are those before
    the command moves on, whatever the machine's speed); the handler there was, after."""
    import signal

    from dflash_torch import cli

    monkeypatch.setattr(cli, "_interrupts_raised", 0)
    monkeypatch.setattr(cli, "_last_raised", 0.0)
    monkeypatch.setattr(cli, "INSIST_S", float("inf"))
    previous = signal.signal(signal.SIGINT, cli._on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _ctrl_c() -> None:
    import os
    import signal

    os.kill(os.getpid(), signal.SIGINT)  # (a real SIGINT: its handler runs in this, the main, thread)


@pytest.mark.parametrize("tty", [False, True])
def test_a_quick_second_ctrl_c_only_stops_the_reply(tiny_pair, engine, monkeypatch, capsys, sigint_as_entry_sets_it,
                                                    tty):
    """Two quick Ctrl-Cs during a reply (the second lands once the reply stopped: at the prompt,
    or with piped input as the next line is read): the reply stops and the chat goes on, at a
    terminal and with piped input (the second ended the chat, status 130: trial-267). A Ctrl-C
    in the next reply stops it, however soon after; one at the prompt after a reply that was
    not interrupted ends the chat (130). In-process, real SIGINTs sent at those points."""
    import sys

    from dflash_torch import chat, cli

    stream = engine.stream
    stops = {1, 2}  # the turns whose reply gets a Ctrl-C after its first chunk
    turn = [0]

    def interrupted_stream(*args, **kwargs):
        turn[0] += 1
        chunks = stream(*args, **kwargs)
        try:
            for chunk in chunks:
                yield chunk
                if turn[0] in stops:
                    _ctrl_c()
        finally:
            chunks.close()

    monkeypatch.setattr(engine, "stream", interrupted_stream)
    monkeypatch.setattr(chat, "load_engine", lambda args: engine)
    if tty:  # (`chat > log` at a terminal: the terminal's echo of ^C ends its line before the stats line, trial-267)
        monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    turns = ["def f(x):", "class A:", "import os", "never read"]
    # (the second of each burst as lines 2 and 3 are read; then one at the prompt after turn 3, not interrupted)
    monkeypatch.setattr(sys, "stdin", _Lines(turns, {1: _ctrl_c, 2: _ctrl_c, 3: _ctrl_c}, tty))
    args = cli.build_parser().parse_args(["chat", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]),
                                          "--dtype", "float32", "--system", SYSTEM, "--max-new-tokens", str(NEW)])
    assert args.func(args) == 130
    err = capsys.readouterr().err
    assert len(re.findall(r"^>>> \n\[[1-9][0-9]* tokens?, finish=interrupted\]$", err, re.M)) == 2 * tty, err
    err = err.replace(">>> ", "")  # (the prompt, on stderr at a "terminal" that cannot be opened)
    assert len(re.findall(r"^\[[1-9][0-9]* tokens?, finish=interrupted\]$", err, re.M)) == 2, err
    assert len(stats_lines(err)) == 1 and sys.stdin.lines == ["never read"], err  # (turn 3 in full)


def test_a_turn_stopped_in_its_prefill_is_dropped_and_the_earlier_turns_rows_kept(tiny_pair, engine, monkeypatch,
                                                                                  capsys, sigint_as_entry_sets_it):
    """Ctrl-C while a long message's prompt is read (before the reply's first token): one line
    says the message is not kept, and the chat goes on as if it had not been sent (it stayed,
    with an empty reply, trial-267); the next turn reuses the rows the caches hold (the
    earlier turns', and the start of the stopped prompt that matches), which it read again from
    nothing. (The Ctrl-C lands inside a prefill chunk, after the target's forward: that chunk's
    rows are not kept.)"""
    import sys

    from dflash_torch import chat, cli

    turns = ["def f(x):", "x = 1; " * 30, "class A:"]
    calls = [0]

    def load(args):
        loaded = cli.load_engine(args)
        prefill = loaded.decoder._prefill_fn

        def interrupted_prefill(*a, **kw):
            out = prefill(*a, **kw)
            calls[0] += 1
            if sys.stdin.read == 2 and calls[0] == 3:  # (turn 2, its third chunk: past the rows turn 1 left)
                _ctrl_c()
            return out

        monkeypatch.setattr(loaded.decoder, "_prefill_fn", interrupted_prefill)
        return loaded

    monkeypatch.setattr(chat, "load_engine", load)
    monkeypatch.setattr(sys, "stdin", _Lines(turns, {1: lambda: calls.__setitem__(0, 0)}, False))
    args = cli.build_parser().parse_args(["chat", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]),
                                          "--dtype", "float32", "--system", SYSTEM, "--max-new-tokens", str(NEW),
                                          "--prefill-chunk", "8"])
    assert args.func(args) == 0  # (piped input: a stopped turn is no failure)
    out, err = capsys.readouterr()
    assert calls[0] >= 3, err
    assert "[interrupted before the reply began: this message is not kept in the conversation]\n" in err, err
    assert "finish=interrupted" not in err, err
    expected = replies(engine, [[turns[0], turns[2]]])
    assert out == "".join(r + "\n" for r in expected), err
    lines = stats_lines(err)
    from dflash_torch.cache import common_start

    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": turns[0]}]
    first = engine.encode_prompt(history, chat=True) + engine.generate(history, chat=True, max_new_tokens=NEW).token_ids
    history.append({"role": "assistant", "content": expected[0]})
    stopped, last = (engine.encode_prompt(history + [{"role": "user", "content": text}], chat=True)
                     for text in turns[1:])
    read = min(common_start(first, stopped), len(first) - 1) + 2 * 8  # (turn 2's rows: turn 1's, and 2 chunks)
    assert len(lines) == 2 and int(lines[1].split(", ")[-1].split(" of ")[0]) == min(common_start(stopped, last),
                                                                                      read), err


def _chat_process(pair, max_new_tokens: int):
    """``dflash-torch chat`` on ``pair`` in a subprocess, its stdin, stdout and stderr piped
    (one token per round: a reply long enough to be interrupted while it streams)."""
    import os
    import subprocess
    import sys

    target, drafter = pair
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "dflash_torch.cli", "chat", "--target", str(target), "--draft",
                             str(drafter), "--block-size", "1", "--max-new-tokens", str(max_new_tokens), "--ignore-eos"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def test_sampling_comes_from_generation_config_unless_given(cli, tiny_pair, tmp_path):
    """``--generation-config auto`` (the default): the sampling values the target's
    generation_config.json recommends, where no flag gives them, said on stderr; a flag
    overrides its value; ``none``: greedy decoding, 256 tokens."""
    target = shutil.copytree(tiny_pair[0], tmp_path / "target")
    config = json.loads((target / "generation_config.json").read_text()) if (target / "generation_config.json").exists() else {}
    config.update(temperature=0.8, top_k=7, max_new_tokens=6)
    (target / "generation_config.json").write_text(json.dumps(config))
    api = DFlashEngine.from_pretrained(target, tiny_pair[1], dtype="float32")
    conversation = [{"role": "user", "content": "def f(x):"}]

    def chat(*flags):
        proc = cli("chat", "--target", str(target), "--draft", str(tiny_pair[1]), "--dtype", "float32", *flags,
                       stdin="def f(x):\n")
        assert proc.returncode == 0, proc.stderr
        return proc

    proc = chat("--seed", "3")
    assert proc.stdout == api.generate(conversation, chat=True, temperature=0.8, top_k=7, max_new_tokens=6,
                                       seed=3).text + "\n"
    assert "[sampling from the target's generation_config.json: temperature 0.8, top_k 7, max_new_tokens 6 (flags " \
           "override it; --generation-config none: greedy decoding, 256 tokens)]" in proc.stderr
    proc = chat("--temperature", "0")
    assert proc.stdout == api.generate(conversation, chat=True, max_new_tokens=6).text + "\n"
    assert "top_k 7, max_new_tokens 6" in proc.stderr and "temperature 0.8" not in proc.stderr
    proc = chat("--generation-config", "none", "--max-new-tokens", "9")
    assert proc.stdout == api.generate(conversation, chat=True, max_new_tokens=9).text + "\n"
    assert "generation_config" not in proc.stderr
    config.update(temperature=-3)  # (a file with a bad value is refused whole, as serve refuses it)
    (target / "generation_config.json").write_text(json.dumps(config))
    proc = cli("chat", "--target", str(target), "--draft", str(tiny_pair[1]), "--temperature", "0", stdin="hi\n")
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1] == (
        "dflash-torch: error: generation_config.json: temperature must be a finite number >= 0, got -3 "
        "(--generation-config none: greedy decoding, 256 tokens)"), proc.stderr


def test_bad_lines_and_options(tiny_pair, engine, tmp_path, monkeypatch, capsys):
    """A line that is not UTF-8 is not sent (one error line, the chat goes on); ``//`` starts
    a message with ``/`` (a CRLF line's ``\\r`` is not part of it); options that would refuse every turn are refused at start (exit 2,
    the flag named, nothing read); ``--chat`` (a generate flag) is not taken for
    ``--chat-template-kwargs``, whose own error is named as that flag; stdin closed is one line."""
    import io
    import sys

    from dflash_torch.cli import main as cli_main

    target, drafter = tiny_pair
    pair = ["--target", str(target), "--draft", str(drafter), "--dtype", "float32"]
    refusing = shutil.copytree(target, tmp_path / "refusing")
    (refusing / "chat_template.jinja").write_text(REFUSING_TEMPLATE)
    booming = shutil.copytree(target, tmp_path / "booming")  # (refuses any turn where a variable is set)
    (booming / "chat_template.jinja").write_text("{% if boom %}{{ raise_exception('boom is set') }}{% endif %}"
                                                 "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    long_system = len(engine.encode_prompt([{"role": "system", "content": "be brief " * 700},
                                            {"role": "user", "content": "hi"}], chat=True))
    least = len(engine.encode_prompt([{"role": "user", "content": "hi"}], chat=True))  # (no --system)
    assert least > 6
    turn = f"no room for a turn: with a one-word message the prompt takes {least} tokens, and with --max-new-tokens"
    # (in-process, stdin made as the interpreter makes a piped one: UTF-8, lines split at "\n" alone, "\r" kept)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe bad\n\xe4\xbd\n//path\r\n"),
                                                       encoding="utf-8", newline="\n"))
    capsys.readouterr()
    code = cli_main(["chat", *pair, "--max-new-tokens", str(NEW), "--system", SYSTEM])
    out, err = capsys.readouterr()
    assert code == 1, err  # (the line not sent: piped input, the status is 1 after the rest was read)
    assert "dflash-torch: error: the line is not UTF-8 text (byte 0xff); it was not sent\n" in err
    # (a character cut short at the line's end: refused alike, not taken for an empty line, trial-267)
    assert "dflash-torch: error: the line is not UTF-8 text (byte 0xe4); it was not sent\n" in err
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "/path"}]
    assert out == engine.generate(conversation, chat=True, max_new_tokens=NEW).text + "\n"
    for flags, line in ((["--temperature", "-1"], "--temperature must be a finite number >= 0, got -1.0"),
                        (["--max-context", "10", "--max-new-tokens", "10"],
                         "--max-new-tokens 10 leaves no room for a prompt in the context of 10 tokens; lower it (or "
                         "raise --max-context)"),
                        (["--max-context", "10"], "--max-context 10 leaves no room for a turn: with a one-word message "
                                                  "the prompt takes "),
                        (["--min-tokens", "300"], "--min-tokens (300) exceeds the default --max-new-tokens (256), which "
                                                  "applies where none is given"),
                        (["--chat"], "unrecognized arguments: --chat; --chat is an option of generate and bench, not of chat; "
                                    "did you mean --chat-template-kwargs? (see --help)"),
                        # (named as the flag, not as --system's fault: it said "--system: chat_template_kwargs ...")
                        (["--system", "be brief", "--chat-template-kwargs", '{"add_generation_prompt": false}'],
                         "--chat-template-kwargs cannot set add_generation_prompt"),
                        # (a --system that refuses every turn: each turn printed its error, exit 0)
                        (["--max-context", "64", "--max-new-tokens", "10", "--system", "be brief " * 40],
                         "--system leaves no room for a turn: with a one-word message the prompt takes "),
                        (["--target", str(refusing), "--no-draft", "--system", "be brief"],
                         "--system: the chat template refuses these messages: System role not supported"),
                        # (refused without --system too: not said to be --system's doing, trial-173)
                        (["--target", str(booming), "--no-draft", "--system", "be brief", "--chat-template-kwargs",
                          '{"boom": true}'], "the chat template refuses these messages: boom is set"),
                        # (at the target's own context: no advice to raise --max-context, which cannot go higher)
                        (["--system", "be brief " * 700], f"--system leaves no room for a turn: with a one-word message "
                         f"the prompt takes {long_system} tokens, and with a new token that exceeds the context of 1024 "
                         "tokens; shorten it\n"),
                        (["--system", "be brief " * 700, "--max-new-tokens", "4"], "--system leaves no room for a turn: "
                         f"with a one-word message the prompt takes {long_system} tokens, and with --max-new-tokens 4 "
                         "that exceeds the context of 1024 tokens; shorten it\n"),  # (the prompt alone exceeds it)
                        (["--system", "be brief " * 700, "--max-new-tokens", "4", "--max-context", "1000"],
                         f"--system leaves no room for a turn: with a one-word message the prompt takes {long_system} "
                         "tokens, and with --max-new-tokens 4 that exceeds the context of 1000 tokens; shorten it\n"),
                        # (below it, where even the target's context could not hold it: no advice to raise it either)
                        (["--system", "be brief " * 700, "--max-context", "1000"], "--system leaves no room for a "
                         f"turn: with a one-word message the prompt takes {long_system} tokens, and with a new token "
                         "that exceeds the context of 1000 tokens; shorten it\n"),
                        # (without --system too: the shortest turn and --max-new-tokens past the context; chat
                        # started and refused every turn, exit 0)
                        (["--max-context", str(least + 5), "--max-new-tokens", "10"], f"--max-new-tokens 10 leaves {turn} "
                         f"10 that exceeds the context of {least + 5} tokens; lower --max-new-tokens or raise --max-context\n"),
                        (["--max-new-tokens", str(1025 - least)], f"--max-new-tokens {1025 - least} leaves {turn} "
                         f"{1025 - least} that exceeds the context of 1024 tokens; lower --max-new-tokens\n"),
                        (["--max-context", "6", "--max-new-tokens", "2"], f"--max-context 6 leaves {turn} 2 that exceeds "
                         "the context of 6 tokens; raise --max-context\n"),
                        (["--max-context", "64", "--max-new-tokens", "64"], "--max-new-tokens 64 leaves no room for a "
                         "prompt in the context of 64 tokens; lower it (or raise --max-context)\n"),
                        (["--max-context", "1024", "--max-new-tokens", "1024"], "--max-new-tokens 1024 leaves no room "
                         "for a prompt in the context of 1024 tokens; lower it\n"),
                        # (nor where the target's context would not hold a one-word message's prompt and them)
                        (["--max-context", "1000", "--max-new-tokens", "1023"], "--max-new-tokens 1023 leaves no room "
                         "for a prompt in the context of 1000 tokens; lower it\n")):
        # (in-process: refused at start, before a line is read; a process each took the test 85 s)
        monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
        try:
            code = cli_main(["chat", *(flags if flags[0] == "--target" else [*pair, *flags])])
        except SystemExit as exc:  # (argparse's, for an unknown flag)
            code = exc.code
        assert code == 2
        out, err = capsys.readouterr()
        assert out == "" and err, err
        last = err.splitlines(keepends=True)[-1]
        assert last.startswith(f"dflash-torch: error: {line}"), err
    monkeypatch.setattr(sys, "stdin", None)  # (started with stdin closed, `<&-`: it was an AttributeError traceback)
    assert cli_main(["chat", *pair]) == 2
    assert capsys.readouterr().err == ("dflash-torch: error: stdin is closed: chat reads its messages from stdin (a "
                                       "terminal, or a pipe)\n")


def test_the_default_max_new_tokens_is_cut_to_the_context_a_turn_leaves(cli, tiny_pair, engine, tmp_path):
    """Without --max-new-tokens a turn gets the default (generation_config.json's
    max_new_tokens, else 256) cut to the context its prompt leaves, as ``generate`` and the
    server cut theirs (chat exited at start: "--max-new-tokens 256 (the default) leaves no
    room for a prompt in the context of 200 tokens"); ``--generation-config none`` cuts 256,
    not the file's; a given --max-new-tokens that does not fit stays refused."""
    target = shutil.copytree(tiny_pair[0], tmp_path / "target")
    path = target / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    (target / "generation_config.json").write_text(json.dumps({**config, "max_new_tokens": 5}))
    conversation = [{"role": "user", "content": "def f(x):"}]
    room = 120 - len(engine.encode_prompt(conversation, chat=True))
    pair = ["--target", str(target), "--draft", str(tiny_pair[1]), "--dtype", "float32", "--max-context", "120",
            "--ignore-eos"]
    for flags, n in ((["--generation-config", "none"], room), ([], 5), (["--max-new-tokens", "1"], 1)):
        proc = cli("chat", *pair, *flags, stdin="def f(x):\n")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == engine.generate(conversation, chat=True, max_new_tokens=n, ignore_eos=True).text + "\n"
        # (one token: "[1 token", not "[1 tokens")
        assert stats_lines(proc.stderr)[0].startswith(f"[{n} token{'s' * (n != 1)}, finish=length"), proc.stderr
    proc = cli("chat", *pair, "--max-new-tokens", str(room + 1), stdin="def f(x):\n")
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr  # (piped input: the refused turn makes the status 1)
    assert proc.stderr.splitlines()[-1].startswith("dflash-torch: error: prompt ("), proc.stderr
    assert f"+ --max-new-tokens ({room + 1}) exceeds the context of 120 tokens" in proc.stderr


HARMONY_TEMPLATE = """{{- "<|start|>system<|message|>Reasoning: medium<|end|>" }}
{%- for message in messages -%}
  {%- if message.role == 'assistant' -%}
    {%- if "<|channel|>analysis<|message|>" in message.content or "<|channel|>final<|message|>" in message.content %}
      {{- raise_exception("You have passed a message containing <|channel|> tags in the content field.") }}
    {%- endif %}
    {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
  {%- else -%}
    {{- "<|start|>" + message.role + "<|message|>" + message.content + "<|end|>" }}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"""


@pytest.fixture(scope="module")
def harmony_target(tmp_path_factory):
    """A tiny gpt-oss target whose tokenizer has harmony's markers (special tokens) and gpt-oss's
    chat-template check that an assistant's content holds no channel markers."""
    from conftest import make_gpt_oss_target, make_tokenizer
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("harmony")
    target = make_gpt_oss_target(root / "target", seed=3, tokenizer=False)
    make_tokenizer(root / "tok", vocab_size=317)
    tok = AutoTokenizer.from_pretrained(str(root / "tok"))
    tok.add_tokens([AddedToken("<|channel|>", special=True), AddedToken("<|message|>", special=True)],
                   special_tokens=True)
    tok.add_tokens([AddedToken("analysis", special=False)])
    tok.chat_template = HARMONY_TEMPLATE
    tok.save_pretrained(str(target))
    return target


def test_a_harmony_reply_goes_back_as_its_answer(cli, harmony_target):
    """gpt-oss: a reply's analysis channel is shown as reasoning, its markers are not shown, and
    the conversation keeps the answer alone (the template refuses channel markers in an
    assistant's content: every later turn was refused)."""
    from dflash_torch.serving.reasoning import HarmonyParser, split

    bias = '{"317": 100, "318": 100, "319": 100}'  # (<|channel|>, <|message|>, analysis: a reply of harmony markup)
    proc = cli("chat", "--target", str(harmony_target), "--no-draft", "--dtype", "float32", "--logit-bias", bias,
                   "--temperature", "1", "--seed", "1", "--max-new-tokens", "200",
                   stdin="hello\nsecond question\nthird question\n")
    assert proc.returncode == 0, proc.stderr
    assert "error" not in proc.stderr and len(stats_lines(proc.stderr)) == 3, proc.stderr
    assert "<|channel|>" not in proc.stdout and "<|message|>" not in proc.stdout
    assert "[reasoning]\n" in proc.stdout
    # each turn's prompt holds the last one's whole: what went back is what the next turn reads
    reused = [int(line.split(", ")[-1].split(" of ")[0]) for line in stats_lines(proc.stderr)]
    assert reused[1] > 0 and reused[2] > reused[1], proc.stderr
    assert split(HarmonyParser(), "<|channel|>analysis<|message|>a<|end|>") == ("a", "")


def test_a_reply_the_template_refuses_is_not_kept(cli, tiny_pair, tmp_path):
    """A reply the chat template cannot take back (here: any assistant message) is said on
    stderr and left out of the conversation, so the next turn is not refused for it."""
    target = shutil.copytree(tiny_pair[0], tmp_path / "target")
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ raise_exception('no "
                               "assistant') }}{% endif %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}# assistant:\n")
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    (target / "chat_template.jinja").unlink(missing_ok=True)
    proc = cli("chat", "--target", str(target), "--no-draft", "--dtype", "float32", "--max-new-tokens", "4",
                   stdin="hello\nagain\n")
    assert proc.returncode == 1, proc.stderr  # (piped input: the turns not kept make the status 1)
    assert proc.stderr.count("the reply cannot be sent back to the model") == 2, proc.stderr
    assert len(stats_lines(proc.stderr)) == 2, proc.stderr


@pytest.mark.parametrize("tty", [False, True])
def test_piped_input_exits_1_after_a_line_that_failed(cli, tiny_pair, engine, monkeypatch, capsys, tty):
    """With stdin not a terminal, a line that failed (here an unknown command and a turn past
    --max-context) makes the exit status 1, at the end: the lines after it are answered as
    usual (it was 0, so a script could not tell). At a terminal the status stays 0.
    (In-process: a pipe cannot be a terminal.)"""
    import io
    import sys

    from dflash_torch.cli import build_parser

    class Input(io.StringIO):
        def isatty(self) -> bool:
            return tty

    target, drafter = tiny_pair
    args = build_parser().parse_args(["chat", "--target", str(target), "--draft", str(drafter), "--dtype",
                                         "float32", "--system", SYSTEM, "--max-new-tokens", str(NEW),
                                         "--max-context", "160"])
    for lines, status in ((["/what", "x = 1; " * 40, "def f(x):"], 1), (["/help", "def f(x):"], 0),
                          (["/what", "def f(x):", "/exit", "never read"], 1)):
        monkeypatch.setattr(sys, "stdin", Input("".join(line + "\n" for line in lines)))
        assert args.func(args) == (status if not tty else 0), lines
        out, err = capsys.readouterr()
        assert replies(engine, [["def f(x):"]])[0] + "\n" in out, (out, err)  # (the turn after it answered)
        assert ("unknown command '/what'" in err) == ("/what" in lines), err
        # (at a terminal the end of the input, Ctrl-D, ends the prompt's line: the shell's prompt followed it)
        assert err.endswith(">>> \n") == (tty and "/exit" not in lines), err
    assert "makes the exit status 1 once the rest of the input has been read" in " ".join(
        cli("chat", "--help").stdout.split())


def test_help_says_where_the_sampling_defaults_come_from(cli):
    """chat takes its sampling defaults from generation_config.json (--generation-config auto):
    its --help says so per flag (it said "(default 256)", "0 = greedy (default)"); generate,
    which decodes greedily unless told, says its fixed defaults."""
    chat = " ".join(cli("chat", "--help").stdout.split())
    for flag, key, value in (("--max-new-tokens", "max_new_tokens", "256"), ("--temperature", "temperature", "0"),
                             ("--top-k", "top_k", "0"), ("--top-p", "top_p", "1"), ("--min-p", "min_p", "0"),
                             ("--repetition-penalty", "repetition_penalty", "1")):
        line = chat.split(f"{flag} {flag[2:].upper().replace('-', '_')} ", 1)[1].split(" --", 1)[0]
        assert f"default: the target's generation_config.json's {key}, else {value}" in line, (flag, line)
    assert "greedy (default)" not in chat and "tokens (default 256)" not in chat
    generate = " ".join(cli("generate", "--help").stdout.split())
    assert "0 = greedy (default 0)" in generate and "1 = off (default 1)" in generate
    assert "generation_config.json's max_new_tokens, else 256" in generate


def test_chat_compile_warms_up_and_says_when_a_turn_compiled(tiny_pair, monkeypatch, capsys):
    """``chat --compile`` builds its graphs at start as serve does (up to --warmup-context,
    default 256): a second turn, whose prefill after the reused prefix reaches the 512-key
    bucket, then builds none (it compiled that bucket, a 10-30 s stall on a real model). A
    turn that does build a graph (past a --warmup-context 1) says so in its stats line, and
    only then. A --warmup-context past the context (600 over 256) is capped at it, with a note, and
    no turn builds a graph. (In-process, with the engine compiled by the eager backend: inductor's
    compiles take minutes on this CPU.)"""
    import io
    import sys

    import torch._dynamo

    from dflash_torch import chat, cli
    from dflash_torch.decoding import compile_counts

    target, drafter = tiny_pair
    plain = DFlashEngine.from_pretrained(target, drafter, dtype="float32")
    built: list[int] = []  # graphs (frames traced) each turn built

    def load(args):
        torch._dynamo.reset()
        engine = DFlashEngine(plain.target, plain.tokenizer, plain.drafter, max_context=args.max_context,
                              compile=args.compile, compile_backend="eager")
        stream = engine.stream

        def counted(*a, **kw):
            before = compile_counts()[0]
            yield from stream(*a, **kw)
            built.append(compile_counts()[0] - before)

        engine.stream = counted
        return engine

    monkeypatch.setattr(chat, "load_engine", load)

    def run(*extra: str, max_context: int = 512) -> str:
        built.clear()
        monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\nand again\n"))
        args = cli.build_parser().parse_args(["chat", "--target", str(target), "--draft", str(drafter), "--compile",
                                             "--max-context", str(max_context), "--max-new-tokens", "40",
                                             "--ignore-eos", *extra])
        assert args.func(args) == 0
        return capsys.readouterr().err

    err = run()
    assert "dflash-torch: compiling the decoding graphs (one-off) ..." in err and "dflash-torch: compiled in" in err
    lines = stats_lines(err)
    assert len(lines) == 2 and int(lines[1].split(", ")[-1].split(" of ")[0]) > 0, err  # (turn 2 reuses turn 1)
    assert built == [0, 0], err  # no turn built a graph after the warm-up
    assert "compilation" not in err, err
    err = run("--warmup-context", "1")  # (the first bucket only: turn 2's prefill chunk past the reused prefix compiles)
    lines = stats_lines(err)
    assert built[0] == 0 and built[1] > 0, err
    assert not lines[0].endswith("; times include a one-off compilation]"), err
    assert lines[1].endswith("reused; times include a one-off compilation]"), err
    assert "note: --warmup-context" not in err
    # (capped at the context, now with a note: trial-140, it was silent; a context of 256, one length bucket, builds
    # half the graphs of 512's two)
    err = run("--warmup-context", "600", max_context=256)
    assert ("note: --warmup-context 600 is more than the context of 256 tokens: the graphs are built up to 256\n"
            in err), err
    assert len(stats_lines(err)) == 2, err
    assert built == [0, 0], err


@pytest.mark.parametrize("extra, message", [(["--compile", "--warmup-context", "0"], "--warmup-context must be an integer >= 1, got 0"),
                                            (["--warmup-context", "100"], "--warmup-context has no effect without --compile")])
def test_chat_refuses_a_bad_warmup_context_before_loading_models(extra, message, capsys):
    """chat's --warmup-context is serve's: a count, with --compile only, refused in one line
    before the models load."""
    from dflash_torch.cli import main as cli_main

    assert cli_main(["chat", *extra, "--target", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
