"""``dflash-torch chat``: a conversation with the model in the terminal.

Each line typed is a user message; the reply streams as it is decoded, then one line of
stats on stderr. The conversation goes through the tokenizer's chat template every turn,
and the engine's prefix reuse (one sequence at a time: the last request's rows) reads
only the part of each prompt that the last request's tokens do not start. Lines starting
with ``/`` are commands: ``/reset`` (forget the conversation, keep ``--system``), ``/exit`` or
``/quit`` (or end of input, Ctrl-D), ``/help`` or ``/?``; ``//`` starts a message with ``/``. Ctrl-C stops a
reply (what was generated is kept in the conversation; a turn stopped before its first token, in
its prefill, is dropped); at the prompt it exits (the quick presses of a burst that stopped a
reply excepted). A turn the engine refuses
(e.g. a conversation that outgrew ``--max-context``) prints its error and the conversation
goes on without it; so does a line longer than any message the context could hold, which is
read no further than that (its rest read in pieces and dropped: memory stays flat) and refused in the
words of the engine's refusal. Options that would refuse every turn are refused at start. With stdin
not a terminal (piped input), a line that failed (a turn refused, an unknown command, a line
that is not UTF-8, a reply that cannot be sent back) makes the exit status 1 at the end of
the input (or ``/exit``), after the lines that follow it are read as usual. With
``--compile`` the decoding graphs of turns up to ``--warmup-context`` tokens of context
(default 256) are built at start, as ``serve`` builds them; a turn that builds a graph after
that (a longer conversation reaching a new length bucket) says so in its stats line.

A reasoning model's reply (the format the server's ``auto`` reasoning parser picks: ``<think>``
templates, gpt-oss's harmony channels) shows its reasoning after a ``[reasoning]`` line, then its
answer after an ``[answer]`` line, markers dropped; the conversation keeps the answer as the
assistant's content (and the reasoning as ``reasoning_content`` where the template reads that),
as a client of the server sends it back. A reply the template cannot take back is said on stderr
and its turn is not kept.
"""

from __future__ import annotations

import argparse
import os
import sys

from .cli import (
    GREEDY,
    _isatty,
    add_chat_template_kwargs_arg,
    add_model_args,
    add_sampling_args,
    add_warmup_arg,
    check_stdout,
    check_warmup_context,
    error_message,
    generation_config_values,
    interrupt_again,
    load_engine,
    too_long_error,
    warm_up,
    write_stdout,
)
from .errors import ContextLengthError, DFlashError, OptionError
from .options import check_min_tokens_default, context_limit, n_tokens
from .serving.reasoning import new_parser, resolve_parser

HELP = ("commands: /reset (forget the conversation), /exit or /quit (or Ctrl-D), /help or /? (this list), // for a "
        "message starting with /; Ctrl-C stops a reply, and at the prompt exits")
# the sampling flags that --generation-config auto fills from generation_config.json when not given, and
# their values otherwise (greedy, 256 tokens; without --max-new-tokens each turn's is cut to the context its prompt leaves)
RECOMMENDED = {**GREEDY, "max_new_tokens": 256}


def register(sub) -> None:
    p = sub.add_parser("chat", help="chat with the model in the terminal (multi-turn, streamed)",
                       description="Chat with the model in the terminal: each line a user message, the reply streamed. "
                                   "With piped input (stdin not a terminal), a line that failed (a turn refused, an "
                                   "unknown command, a line that is not UTF-8, a reply that cannot be sent back) makes "
                                   "the exit status 1 once the rest of the input has been read (or /exit).")
    p.add_argument("--system", default=None, help="a system message that starts the conversation")
    add_chat_template_kwargs_arg(p, "(every turn)")
    p.add_argument("--generation-config", default="auto", choices=["auto", "none"],
                   help="sampling values not given as flags (--temperature, --top-k, --top-p, --min-p, "
                        "--repetition-penalty, --max-new-tokens): auto (default) takes those the target's "
                        "generation_config.json recommends, as serve does; none (or a value the file does not set) "
                        "keeps greedy decoding and 256 tokens; without --max-new-tokens a turn's tokens are cut to "
                        "the context its prompt leaves")
    p.add_argument("--no-prefix-reuse", action="store_true",
                   help="read every turn's whole prompt (default: the part the last turn's tokens hold is reused)")
    add_model_args(p)
    add_warmup_arg(p, "a turn that goes past it compiles its bucket's graphs first (its stats line says so)")
    add_sampling_args(p, "default: the target's generation_config.json's max_new_tokens, else 256; cut to the context "
                         "each turn's prompt leaves", recommended=True)
    p.set_defaults(func=_chat, **dict.fromkeys(RECOMMENDED))  # (None: not given)


def _chat(args: argparse.Namespace) -> int:
    from . import compute

    with compute.this_thread():  # loading and decoding on this thread, interrupted by Ctrl-C as usual
        return _chat_here(args)


def _chat_here(args: argparse.Namespace) -> int:
    check_stdout()
    if sys.stdin is None:  # (started with stdin closed: `<&-`)
        raise DFlashError("stdin is closed: chat reads its messages from stdin (a terminal, or a pipe)")
    check_warmup_context(args)
    engine = load_engine(args)
    if getattr(engine.tokenizer, "chat_template", None) is None:
        raise DFlashError("the target's tokenizer has no chat template; use 'dflash-torch generate' for plain text")
    kwargs = _sampling(engine, args)
    start = [{"role": "system", "content": args.system}] if args.system is not None else []
    _check_start(engine, start, kwargs)
    warm_up(engine, args, file=sys.stderr)  # (--compile: the graphs of turns up to --warmup-context tokens, now)
    messages = list(start)
    for stream in (sys.stdin, sys.stdout):  # (bytes that are not text: one turn's error, not a traceback)
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="surrogateescape" if stream is sys.stdin else "replace")
    # how replies split into reasoning and answer (the server's auto reasoning parser): the answer is
    # what goes back to the model (reasoning too where the template reads reasoning_content)
    template = getattr(engine.tokenizer, "chat_template", None)
    reasoning = resolve_parser("auto", engine.target.config.model_type, template)
    keeps_reasoning = "reasoning_content" in str(template)
    interactive = sys.stdin.isatty()
    failed = False  # (a line that failed: with piped input, the exit status is 1 at the end)
    if interactive:
        try:
            import readline  # noqa: F401 (line editing and history for input())
        except ImportError:
            pass
        print(f"[{HELP}]", file=sys.stderr)
    # (stdout redirected, `chat > log`: the prompt goes to the terminal, not into the file)
    redirected = interactive and not sys.stdout.isatty()
    # (a line read no further than a message that could fit the context: "\r" and "//"'s first "/" aside)
    longest = engine.max_prompt_chars + 2
    while True:
        cut = None  # (a line past `longest`: its first characters, the rest dropped)
        try:
            line = _input_at_terminal(">>> ", longest) if redirected else input(">>> ") if interactive \
                else _read_line(longest)
        except LongLine as exc:
            line, cut = exc.head, exc
        except EOFError:
            if interactive:  # (Ctrl-D: the shell's prompt starts a line of its own, not the prompt's)
                print(file=sys.stderr)
            return int(failed and not interactive)
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 130
        text = _utf8(line.removesuffix("\r"))  # (a line of a CRLF file)
        failed |= text is None
        if text is None or (not text.strip() and (cut is None or cut.blank_rest)):
            continue
        if text.startswith("/") and not text.startswith("//"):
            command = text.strip()
            if command in ("/exit", "/quit") and (cut is None or cut.blank_rest):
                return int(failed and not interactive)
            if command == "/reset" and (cut is None or cut.blank_rest):
                messages = list(start)
                print("[conversation reset]", file=sys.stderr)
            elif command in ("/help", "/?") and (cut is None or cut.blank_rest):
                print(f"[{HELP}]", file=sys.stderr)
            else:
                shown = repr(command) if cut is None else f"{command[:40]!r}... ({len(command)}+ characters)"
                print(f"[unknown command {shown}; {HELP}]", file=sys.stderr)
                failed = True
            continue
        if cut is not None:  # (refused as the engine refuses a message too long for the context: not read whole)
            print(f"dflash-torch: error: {too_long_error(engine, 'the message')}; it was not sent", file=sys.stderr)
            failed = True
            continue
        messages.append({"role": "user", "content": text[1:] if text.startswith("//") else text})
        reply = _reply(engine, messages, kwargs, args.option_flags, len(messages) > len(start) + 1, reasoning)
        if isinstance(reply, str):  # refused, or stopped before its first token: the message is not part of it
            messages.pop()
            failed |= reply == "refused"
            continue
        thought, answer = reply
        messages.append({"role": "assistant", "content": answer,
                         **({"reasoning_content": thought} if keeps_reasoning and thought else {})})
        try:  # (a reply the template cannot take back would refuse every later turn)
            engine.encode_prompt(messages, True, kwargs["chat_template_kwargs"], check_length=False)
        except DFlashError as exc:
            del messages[-2:]
            failed = True
            print(f"dflash-torch: error: the reply cannot be sent back to the model ({exc}); this turn is not kept "
                  "in the conversation", file=sys.stderr)


def _sampling(engine, args: argparse.Namespace) -> dict:
    """The ``stream`` keyword arguments of every turn: the flags, else (``--generation-config
    auto``) the target's generation_config.json, else greedy decoding and 256 tokens; said
    on stderr where the file gave them. Without ``--max-new-tokens`` the engine's
    ``default_max_new_tokens`` is set to the file's (or 256) and each turn gets it cut to
    the context its prompt leaves, as the server cuts its default (``max_new_tokens`` None).

    Raises:
        DFlashError: values the engine refuses (as a turn would, for every turn), a
            ``--max-new-tokens`` that leaves no room for a prompt in the context, or a
            ``--min-tokens`` above the default.
    """
    try:
        recommended = {}
        if args.generation_config == "auto":
            recommended = dict(engine.generation_defaults)
            if engine.recommended_max_new_tokens is not None:
                recommended["max_new_tokens"] = engine.recommended_max_new_tokens
    except DFlashError as exc:  # (refused whole, as serve does, even for a value a flag gives)
        raise DFlashError(f"{exc} (--generation-config none: greedy decoding, 256 tokens)") from None
    taken = {k: v for k, v in recommended.items() if k in RECOMMENDED and getattr(args, k) is None}
    kwargs = {k: taken.get(k, v) if getattr(args, k) is None else getattr(args, k) for k, v in RECOMMENDED.items()}
    kwargs.update(seed=args.seed, presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                  logit_bias=args.logit_bias, min_tokens=args.min_tokens, stop=args.stop, ignore_eos=args.ignore_eos)
    if args.max_new_tokens is None:  # (a default: cut to the context each turn leaves)
        whose = ", generation_config.json's" if "max_new_tokens" in taken else ""
        check_min_tokens_default(args.min_tokens, kwargs["max_new_tokens"], whose=whose)
    engine.request_params(**kwargs)  # (checked now: refused at every turn otherwise)
    if args.max_new_tokens is None:
        engine.default_max_new_tokens, kwargs["max_new_tokens"] = kwargs["max_new_tokens"], None
    elif kwargs["max_new_tokens"] >= engine.max_context:
        try:  # (raising --max-context is advice only where it would hold a one-word message's prompt too)
            least = len(engine.encode_prompt([{"role": "user", "content": "hi"}], True, args.chat_template_kwargs))
        except DFlashError:
            least = 1
        raise DFlashError(f"--max-new-tokens {kwargs['max_new_tokens']} leaves no room for a prompt in the "
                          f"context of {engine.max_context} tokens; lower it"
                          + " (or raise --max-context)" * _can_raise(engine, kwargs["max_new_tokens"] + least))
    if taken:
        print(f"[sampling from the target's generation_config.json: {generation_config_values(taken)}"
              + " (flags override it; --generation-config none: greedy decoding, 256 tokens)]", file=sys.stderr)
    return dict(kwargs, chat=True, chat_template_kwargs=args.chat_template_kwargs)


def _check_start(engine, start: list[dict], kwargs: dict) -> None:
    """Refuse a ``--system`` message (``start``) that would refuse every turn: one the chat
    template refuses, or one that leaves no room for a one-word message and
    ``--max-new-tokens`` (without it: a token, or ``--min-tokens``); without ``--system``, a
    ``--max-context`` or ``--max-new-tokens`` that leaves no such room.

    Raises:
        DFlashError: naming ``--system`` (or ``--max-context``, ``--max-new-tokens``) and why.
    """
    try:
        ids = engine.encode_prompt(start + [{"role": "user", "content": "hi"}], True, kwargs["chat_template_kwargs"])
    except DFlashError as exc:
        if isinstance(exc, OptionError) and "chat_template_kwargs" in exc.names:
            raise  # (about --chat-template-kwargs, named as that flag: not about --system)
        if start:
            try:  # (the template refuses the turn without --system too: not --system's doing)
                engine.encode_prompt([{"role": "user", "content": "hi"}], True, kwargs["chat_template_kwargs"])
            except DFlashError:
                start = []
        raise DFlashError(f"--system: {exc}" if start else str(exc)) from None
    if kwargs["max_new_tokens"] is None:  # (the default, cut to the room: at least a token, or --min-tokens)
        need = max(1, kwargs["min_tokens"])
        if len(ids) + need > engine.max_context:
            below = _can_raise(engine, len(ids) + need)
            if start:
                what, advice = "--system leaves", ["shorten it"] + ["raise --max-context"] * below
            else:
                what = (f"--max-context {engine.max_context} leaves" if engine.max_context < context_limit(engine.target.config)
                        else "the target's context leaves")
                advice = ["raise it"] * below
            advice = advice + ["lower --min-tokens"] * (need > 1) or ["use a target with a longer context"]
            more = f"--min-tokens {need}" if need > 1 else "a new token"
            raise DFlashError(f"{what} no room for a turn: with a one-word message the prompt takes {len(ids)} tokens, "
                              f"and with {more} that exceeds the context of {engine.max_context} tokens; "
                              + " or ".join([", ".join(advice[:-1]), advice[-1]] if len(advice) > 1 else advice))
        return
    n, new = len(ids), kwargs["max_new_tokens"]
    if n + new > engine.max_context:
        fits = n + max(1, kwargs["min_tokens"]) <= engine.max_context  # (a lower --max-new-tokens would do)
        if start:
            what = "--system leaves"
        elif fits:
            what = f"--max-new-tokens {new} leaves"
        else:
            what = (f"--max-context {engine.max_context} leaves" if engine.max_context < context_limit(engine.target.config)
                    else "the target's context leaves")
        advice = (["shorten it"] * bool(start) + ["lower --max-new-tokens"] * fits
                  + ["raise --max-context"] * _can_raise(engine, n + new) or ["use a target with a longer context"])
        raise DFlashError(f"{what} no room for a turn: with a one-word message the prompt takes {n} tokens, "
                          f"and with --max-new-tokens {new} that exceeds the context of {engine.max_context} tokens; "
                          + " or ".join([", ".join(advice[:-1]), advice[-1]] if len(advice) > 1 else advice))


def _can_raise(engine, tokens: int) -> bool:
    """Whether a larger --max-context, up to the target's context, would hold ``tokens``
    (advice to raise it is given only then)."""
    return engine.max_context < tokens <= context_limit(engine.target.config)


class LongLine(Exception):
    """A line of stdin longer than :func:`_read_line` reads: ``head``, its first characters
    (as many as it was given, and one more); ``blank_rest``, whether the rest of the line
    (read, and dropped) was whitespace only, so that the line's ``strip()`` is ``head``'s."""

    def __init__(self, head: str, blank_rest: bool):
        super().__init__(f"a line of more than {len(head) - 1} characters")
        self.head, self.blank_rest = head, blank_rest


# characters a read of a long line's rest takes at a time (it is dropped: memory for no more)
_DROP_CHUNK = 1 << 16


def _read_line(longest: int | None = None) -> str:
    """The next line of stdin (piped input; a terminal's where :func:`_input_at_terminal` cannot
    open it), without its line break (as input() reads it, but writing no prompt: input("")
    fails where stdout cannot take output); ``longest``: the most characters a line may have
    (None: any), past which no more of it is held (an endless line, ``tr '\\0' a < /dev/zero |``,
    is read in pieces of :data:`_DROP_CHUNK` characters and dropped: memory stays flat).

    Raises:
        EOFError: at the end of the input.
        LongLine: a line of more than ``longest`` characters, its line break aside (its rest
            read up to its line break, or the end of the input, and dropped).
    """
    line = sys.stdin.readline() if longest is None else sys.stdin.readline(longest + 1)
    if not line:
        raise EOFError
    if longest is not None and len(line) > longest and not line.endswith("\n"):
        blank = True
        while True:
            rest = sys.stdin.readline(_DROP_CHUNK)
            blank = blank and not rest.strip()
            if not rest or rest.endswith("\n"):
                raise LongLine(line, blank)
    return line.removesuffix("\n")


def _input_at_terminal(prompt: str, longest: int | None = None) -> str:
    """``input(prompt)`` where stdin is a terminal and stdout is not (``chat > log``): file
    descriptor 1 is stdin's terminal while it reads, so that input() reads through readline
    (line editing, and whole lines: a line read from a terminal as it is, in its canonical
    mode, is cut at 4,095 bytes), the prompt and the echo on the terminal, not in the file.
    Where that terminal cannot be opened: the prompt on stderr and :func:`_read_line` (of lines
    up to ``longest`` characters).

    Raises:
        EOFError: at the end of the input (Ctrl-D).
        LongLine: :func:`_read_line`'s, where it reads the line.
    """
    try:
        tty = os.open(os.ttyname(sys.stdin.fileno()), os.O_WRONLY | os.O_NOCTTY)
    except OSError:
        print(prompt, end="", file=sys.stderr, flush=True)
        return _read_line(longest)
    saved = os.dup(1)
    try:
        os.dup2(tty, 1)
        return input(prompt)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(tty)


def _utf8(line: str) -> str | None:
    """A line read from stdin as text, or None (said on stderr) where its bytes are not UTF-8."""
    try:
        return line.encode(sys.stdin.encoding or "utf-8", "surrogateescape").decode("utf-8")
    except (UnicodeDecodeError, UnicodeEncodeError, LookupError) as exc:
        at = f" (byte 0x{exc.object[exc.start]:02x})" if isinstance(exc, UnicodeDecodeError) else ""
        print(f"dflash-torch: error: the line is not UTF-8 text{at}; it was not sent", file=sys.stderr)
        return None


def _context_needed(engine, messages: list[dict], kwargs: dict) -> int | None:
    """The context a turn on ``messages`` needs (tokens): its prompt's, and ``--max-new-tokens``
    (without it: a token, or ``--min-tokens``); None where the chat template refuses them."""
    try:
        n = len(engine.encode_prompt(messages, True, kwargs["chat_template_kwargs"], check_length=False))
    except DFlashError:
        return None
    return n + (kwargs["max_new_tokens"] or max(1, kwargs["min_tokens"]))


def _fits_alone(engine, messages: list[dict], kwargs: dict) -> bool:
    """Whether the last message of ``messages`` would fit the context in a new conversation
    (after the system message, if any): where it would not, /reset cannot help."""
    fresh = [m for m in messages[:1] if m.get("role") == "system"] + messages[-1:]
    need = _context_needed(engine, fresh, kwargs)
    return need is not None and need <= engine.max_context


def _reply(engine, messages: list[dict], kwargs: dict, flags: dict[str, str], history: bool,
           reasoning: str = "none") -> tuple[str, str] | str:
    """Stream one reply to stdout and its stats line to stderr -> ``(reasoning, answer)``
    (what was generated before a Ctrl-C too); ``"interrupted"`` where a Ctrl-C stopped the turn
    before its first token (in the prefill of its prompt: said on stderr, and the turn is not
    to be kept); ``"refused"`` when the engine refused the request (its
    error naming the flags, ``flags``: :func:`~dflash_torch.cli.error_message`; a prompt, or
    the tokens the turn asks of it (``--max-new-tokens``, ``--min-tokens``), past the context (a
    :class:`~dflash_torch.errors.ContextLengthError`) led by "this conversation no longer fits"
    and followed by a hint to /reset,
    not by the error's advice, where the conversation has past turns, ``history``, and the message
    alone would fit; and by one to start a chat with a larger ``--max-context`` where that would hold it).

    ``reasoning``: the reply's format (:mod:`~dflash_torch.serving.reasoning`): its reasoning
    is shown after a ``[reasoning]`` line, then the answer after an ``[answer]`` line (markers
    such as harmony's dropped); ``none``: the reply is all answer, shown as it is.

    With a compiled engine, a turn that built a graph (torch's count of traced frames grew:
    e.g. a length bucket reached for the first time) ends its stats line with ``; times
    include a one-off compilation``."""
    tokens, stats, finish = 0, None, None
    parts = {"reasoning": [], "answer": []}
    parser = None
    if reasoning != "none":
        try:  # (whether the template opened the reasoning: the prompt's end)
            tail = engine.decode(engine.encode_prompt(messages, True, kwargs["chat_template_kwargs"])[-8:])
        except DFlashError:
            tail = ""  # (refused by stream below, with its message)
        parser = new_parser(reasoning, tail)
    shown = [None]  # the part shown last

    def show(thought: str, answer: str) -> None:
        out = []
        for name, text in (("reasoning", thought), ("answer", answer)):
            if not text:
                continue
            if shown[0] != name and (name == "reasoning" or shown[0] is not None):
                out.append(("" if shown[0] is None else "\n") + f"[{name}]\n")
            shown[0] = name
            parts[name].append(text)
            out.append(text)
        if out:
            write_stdout("".join(out))

    compiled = engine.decoder.compiled
    if compiled:  # (a turn that builds a graph, e.g. for a length bucket past the warm-up's, says so)
        from .decoding import compile_counts

        frames = compile_counts()[0]
    chunks = engine.stream(messages, **kwargs)
    try:
        for chunk in chunks:
            if not tokens:  # the reply has begun: a Ctrl-C now stops it, however soon after the last one (until now
                interrupt_again()  # the quick ones of that one's burst were ignored: at the prompt, it ended the chat)
            tokens += len(chunk.token_ids)
            show(*(parser.feed(chunk.text) if parser is not None else ("", chunk.text)))
            stats, finish = chunk.stats, chunk.finish_reason
    except KeyboardInterrupt:
        finish = "interrupted"
    except DFlashError as exc:
        # (the prompt, or the tokens a turn asks of it: --max-new-tokens, --min-tokens, past the context)
        full = isinstance(exc, ContextLengthError)
        if history and full and _fits_alone(engine, messages, kwargs):  # (the earlier turns fill it)
            # (the facts, without the error's advice, to shorten the prompt or raise --max-context: not for mid-chat)
            facts = error_message(exc, flags).split("; ")[0]
            longer = _can_raise(engine, _context_needed(engine, messages, kwargs) or 0)
            print(f"dflash-torch: error: this conversation no longer fits: {facts}; /reset starts a new conversation"
                  + "; a longer one needs a chat started with a larger --max-context (up to "
                    f"{context_limit(engine.target.config)})" * longer, file=sys.stderr)
        else:
            print(f"dflash-torch: error: {error_message(exc, flags)}", file=sys.stderr)
        return "refused"
    finally:
        chunks.close()  # (frees the engine for the next turn)
    # (a Ctrl-C typed at the terminal echoes "^C" there; with stdout elsewhere, `chat > log`, stderr ends its line)
    echoed = finish == "interrupted" and _isatty(sys.stderr) and not _isatty(sys.stdout)
    if finish == "interrupted" and not tokens:  # (nothing generated: the turn goes, the earlier ones stay)
        if _isatty(sys.stdout):
            write_stdout("\n")  # (after the echoed "^C")
        print(("\n" if echoed else "") + "[interrupted before the reply began: this message is not kept in the "
              "conversation]", file=sys.stderr, flush=True)
        return "interrupted"
    if parser is not None:
        show(*parser.finish())
    write_stdout("\n")
    if echoed:
        print(file=sys.stderr)
    if stats is not None:
        decode = (f"mean tau {stats.mean_acceptance_length:.2f}, decode {stats.decode_tokens_per_second:.1f} tok/s, "
                  if stats.acceptance_lengths else "no decoding round, ")
        built = compiled and compile_counts()[0] > frames
        print(f"[{n_tokens(stats.generated_tokens)}, finish={finish}, {decode}prefill {stats.prefill_time * 1000:.0f} ms, "
              f"{stats.cached_prompt_tokens} of {stats.prompt_tokens} prompt tokens reused"
              f"{'; times include a one-off compilation' if built else ''}]", file=sys.stderr, flush=True)
    else:  # (stopped before the last chunk, which carries the stats)
        print(f"[{n_tokens(tokens)}, finish={finish}]", file=sys.stderr, flush=True)
    return "".join(parts["reasoning"]), "".join(parts["answer"])
