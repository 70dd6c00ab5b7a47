"""``dflash-torch serve``: load a target + drafter pair and serve the OpenAI-compatible
API with uvicorn.

stdout carries the server's log: a line as the models begin to load, the start line once it
serves, uvicorn's access lines; stderr the rest of it. A closed stdout is refused before
anything loads, and one that cannot take the first lines (a full disk) ends the command in one
line, status 1, as generate's output; a log stream whose reader went away (``serve | head``)
is said once on stderr and dropped, and the server serves on. SIGTERM / SIGHUP / Ctrl-C end
it as the signal would (status 128 + its number; where the signal raised again does not end
the process, as for a container's PID 1, it exits with that status), with a line on stderr
where they came while the models loaded."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from ..errors import DFlashError
from ..options import check_api_key, check_model_name


def json_strings(text: str) -> list[str]:
    """argparse type of the CORS flags (``--allowed-origins``, ...): a JSON list of strings, as vLLM takes them."""
    import json

    what = "a JSON list of strings, e.g. '[\"*\"]'"
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"must be {what} ({exc})") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text[:80]!r}")
    return value


def register(sub) -> None:
    from ..cli import add_chat_template_kwargs_arg, add_model_args, add_warmup_arg, int_or_auto

    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/responses)",
                       description="Serve /v1/completions, /v1/chat/completions, /v1/responses, /v1/models, "
                                   "/tokenize, /detokenize, /health and /metrics.")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind: IPv4, IPv6 without brackets (::1, ::) or a host name (default 127.0.0.1); "
                        ":: listens on IPv6 only (IPv4 clients are refused), 0.0.0.0 on IPv4 only, '' on both")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("DFLASH_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize and /openapi.json (default: $DFLASH_API_KEY, else no key)")
    p.add_argument("--model-name", default=None,
                   help="model id clients use (default: the target directory's name, or its Hugging Face id as given, "
                        "without an @REVISION; a snapshot directory of the Hugging Face cache, "
                        ".../models--ORG--NAME/snapshots/COMMIT: its id, ORG/NAME)")
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="most sequences decoded together (default 8; --draft-mode recompute decodes one "
                        "sequence at a time: one slot, and refuses a larger value)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="sequences that may wait for a slot (default 64; 0: none, a request is taken only when "
                        "free slots hold all its choices); a request that does not fit gets 503 with Retry-After")
    add_warmup_arg(p, "a request that goes past it compiles its bucket's graphs while every stream waits (logged in "
                      "a WARNING line, counted in /metrics: dflash_serving_compiles_total)")
    p.add_argument("--no-prefix-reuse", action="store_true",
                   help="read every prompt whole (default: a prompt that starts with a finished sequence's "
                        "tokens, such as the next turn of a chat, reuses its rows and reads only the rest; one "
                        "sequence at a time, with --max-batch-size 1 or --draft-mode recompute, the last "
                        "request's rows)")
    p.add_argument("--prefix-slots", type=int, default=0, metavar="N",
                   help="cache slots beyond --max-batch-size that only keep finished sequences' rows for prefix "
                        "reuse, so that more conversations than --max-batch-size keep theirs (default 0: only the "
                        "free slots keep them; each slot costs --max-context positions of cache)")
    p.add_argument("--shared-starts", type=int, default=None, metavar="N",  # (None: batch.SHARED_STARTS, 2)
                   help="snapshots of the state where a chat's system messages end, kept for hybrid and "
                        "sliding-window targets so that conversations sharing a system prompt read only the rest; "
                        "each costs one slot's recurrent state and rings (default 2; 0: none)")
    p.add_argument("--draft-max-batch-size", type=int_or_auto, default=None, metavar="N|auto",
                   help="draft only while at most N sequences decode; rounds of more run target-only (where a "
                        "verify's cost grows with its rows, as on a CPU, many streams decode faster without drafts). "
                        "auto: each round drafts or not by the measured tokens/s of both kinds of rounds at its "
                        "number of sequences (default: always draft)")
    p.add_argument("--reasoning-parser", default="auto", choices=["auto", "none", "think", "gemma4", "harmony"],
                   help="split chat replies into reasoning_content and content: think (<think>...</think>: Qwen3, "
                        "Qwen3.5, DeepSeek-R1), gemma4 (<|channel>thought ...<channel|>: Gemma 4), harmony (gpt-oss's "
                        "analysis / final channels), none (all content), or auto (default: harmony for gpt-oss, gemma4 "
                        "when the chat template mentions <|channel>, think when it mentions <think>)")
    p.add_argument("--tool-call-parser", default="auto",
                   choices=["auto", "none", "hermes", "qwen3_coder", "glm45", "glm47", "minimax_m2", "gemma4", "kimi_k2",
                            "deepseek_v31", "harmony"],
                   help="find the tool calls of chat replies to requests with tools (message.tool_calls): hermes "
                        "(<tool_call>{json}</tool_call>: Qwen2.5, Qwen3), qwen3_coder (<tool_call><function=...>: "
                        "Qwen3-Coder, Qwen3.5, Qwen3.6), glm45 (<tool_call>NAME<arg_key>K</arg_key><arg_value>V"
                        "</arg_value>...</tool_call>, a newline after each part: GLM-4.5, GLM-4.6), glm47 (the same "
                        "without the newlines: GLM-4.7, GLM-5, GLM-5.1), "
                        "minimax_m2 (<minimax:tool_call><invoke name=...>: MiniMax-M2), "
                        "gemma4 (<|tool_call>call:NAME{...}<tool_call|>: Gemma 4), "
                        "kimi_k2 (<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX"
                        "<|tool_call_argument_begin|>{json}<|tool_call_end|>...: Kimi-K2, K2.5), "
                        "deepseek_v31 (<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}"
                        "<｜tool▁call▁end｜>...: DeepSeek-V3.1; V3 / R1's function<｜tool▁sep｜>NAME ```json``` too), "
                        "harmony (gpt-oss), none (replies stay text), or auto (default: by the model and its chat "
                        "template)")
    p.add_argument("--generation-config", default="auto", choices=["auto", "none"],
                   help="defaults of the sampling values a request omits (temperature, top_k, top_p, min_p, "
                        "repetition_penalty; a chat's max_tokens): auto (default, as vLLM) takes those the target's "
                        "generation_config.json sets, none keeps OpenAI's (temperature 1, top_p 1, no top_k / min_p)")
    p.add_argument("--sse-keepalive", type=float, default=15.0, metavar="SECONDS",
                   help="send an SSE comment line (': keep-alive', which clients skip) on a stream that has sent "
                        "nothing for this long, e.g. while a tool call is held back until complete (default 15; 0: never)")
    p.add_argument("--timeout-keep-alive", type=float, default=5, metavar="SECONDS",
                   help="close an HTTP keep-alive connection idle this long (default 5, uvicorn's); behind a load "
                        "balancer or proxy that keeps idle connections open longer (AWS ALB: 60 s), set it above "
                        "the balancer's idle timeout, or it may send a request on a connection the server is "
                        "closing (a 502)")
    p.add_argument("--body-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="answer a request whose body has not arrived whole this long after its headers with a 408 "
                        "request_timeout and close its connection, so that a client that stalls mid-body holds no "
                        "connection (nor a drain) for longer (default 60; 0: no limit; a client that stalls "
                        "before its headers end is not timed out)")
    p.add_argument("--drain-timeout", type=float, default=0.0, metavar="SECONDS",
                   help="on SIGTERM (or SIGHUP), stop taking requests at once (each new one, /health too, gets a 503 "
                        "server_shutting_down with Retry-After), let those running or queued finish, streams too, "
                        "for up to this long, then end the rest and exit, as a load balancer's rolling restart "
                        "wants (default 0: end every request at once); a second SIGTERM (or SIGHUP) during the "
                        "drain, or Ctrl-C (SIGINT) at any time, ends them at once")
    p.add_argument("--allowed-origins", type=json_strings, default=["*"], metavar="JSON",
                   help="CORS: the origins whose browser scripts may call the server, a JSON list, e.g. "
                        "'[\"http://localhost:3000\"]' (default [\"*\"]: any)")
    p.add_argument("--allowed-methods", type=json_strings, default=["*"], metavar="JSON",
                   help="CORS: the HTTP methods they may use, a JSON list (default [\"*\"]: any)")
    p.add_argument("--allowed-headers", type=json_strings, default=["*"], metavar="JSON",
                   help="CORS: the request headers they may send, a JSON list (default [\"*\"]: any)")
    p.add_argument("--allow-credentials", action="store_true",
                   help="CORS: let them send credentials, the browser's cookies and HTTP authentication (default: "
                        "not; a script's own Authorization header is a request header, allowed by --allowed-headers). "
                        "Preflight OPTIONS requests are answered without the API key")
    add_chat_template_kwargs_arg(p, "for every chat request (a request's own chat_template_kwargs and "
                                    "reasoning_effort override them)")
    p.add_argument("--log-level", default="info", type=str.lower, choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn log level, in any case (default info)")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from ..batch import (SHARED_STARTS, check_draft_max_batch_size, check_prefix_slots,
                         check_shared_starts)
    from ..cli import check_model_options, check_stdout, check_warmup_context
    from .scheduler import check_slots

    check_stdout()  # (its start line and access log: a closed stdout is refused before the models load)
    check_model_options(args)  # (before the loading line: a refused --device / --dtype / --threads loads nothing)
    if not 1 <= args.port <= 65535:
        raise DFlashError(f"--port must be in [1, 65535], got {args.port}")
    api_key = check_api_key(args.api_key, "--api-key (or $DFLASH_API_KEY)")
    check_model_name(args.model_name, "--model-name")
    if args.max_batch_size is not None:  # (None: 8, or 1 with --draft-mode recompute)
        check_slots(args.max_batch_size, "--max-batch-size")
        if args.max_batch_size > 1 and args.draft_mode == "recompute" and not args.no_draft:
            raise DFlashError("--max-batch-size has no effect with --draft-mode recompute (it decodes one sequence "
                              "at a time); drop it")
    check_slots(args.max_queue, "--max-queue", minimum=0)
    # (the ranges of the engine's options, and what needs no model, before the models load; the
    # engine checks them again, with what does: a drafter of block size 1 refuses --draft-max-batch-size)
    check_prefix_slots(args.prefix_slots)
    if args.shared_starts is not None:
        check_shared_starts(args.shared_starts)
    check_draft_max_batch_size(args.draft_max_batch_size, drafter=not args.no_draft, draft_mode=args.draft_mode,
                               block_size=args.block_size)
    check_warmup_context(args)
    if not 0 <= args.sse_keepalive < float("inf"):
        raise DFlashError(f"--sse-keepalive must be a number of seconds >= 0 (0 = no keep-alive), got "
                          f"{args.sse_keepalive:g}")
    if not 0 < args.timeout_keep_alive < float("inf"):
        raise DFlashError(f"--timeout-keep-alive must be a number of seconds > 0, got {args.timeout_keep_alive:g}")
    if not 0 <= args.body_timeout < float("inf"):
        raise DFlashError(f"--body-timeout must be a number of seconds >= 0 (0: no limit), got {args.body_timeout:g}")
    if not 0 <= args.drain_timeout < float("inf"):
        raise DFlashError(f"--drain-timeout must be a number of seconds >= 0 (0: no drain), got {args.drain_timeout:g}")
    # (each of these serves the batch decoder's prefix reuse only; a default value is not refused)
    for flag, given in (("--prefix-slots", args.prefix_slots != 0),
                        ("--shared-starts", args.shared_starts not in (None, SHARED_STARTS))):
        if given and (args.no_prefix_reuse or args.max_batch_size == 1 or args.draft_mode == "recompute"):
            if args.no_prefix_reuse:
                raise DFlashError(f"{flag} has no effect with --no-prefix-reuse (no prefix is reused); drop it")
            why = "--max-batch-size 1" if args.max_batch_size == 1 else "--draft-mode recompute"
            raise DFlashError(f"{flag} has no effect with {why} (one sequence at a time, which keeps the last "
                              "request's rows only); drop it")
    # (fail before loading models when the address is taken; held from now on, served by uvicorn)
    sockets = listen(args.host, args.port)
    try:
        return _serve_on(args, sockets, api_key)
    finally:
        for sock in sockets:
            sock.close()


def _serve_on(args: argparse.Namespace, sockets: list, api_key: str | None) -> int:
    """``dflash-torch serve`` once its listening ``sockets`` are bound: load, then serve on them."""
    import contextlib
    import signal
    import threading
    import time

    import uvicorn

    from ..cli import load_engine, warm_up
    from .app import create_app

    write_log(loading_line(args) + "\n")  # (a big model loads for minutes: not a silent wait)
    with stopped_while_loading():
        engine = load_engine(args)
        warm_up(engine, args, batch=engine.max_batch_size > 1)
    app = create_app(engine, api_key=api_key, model_name=args.model_name, max_batch_size=args.max_batch_size,
                     max_queue=args.max_queue, chat_template_kwargs=args.chat_template_kwargs,
                     reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                     generation_config=args.generation_config, sse_keepalive=args.sse_keepalive,
                     body_timeout=args.body_timeout,
                     allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                     allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials)
    scheduler = app.state.scheduler
    try:  # (a start line that stdout cannot take: one line, status 1, as generate's output)
        _start_lines(args, engine, app)
    except BaseException:
        _wait_for_engine(scheduler)
        raise

    drain_log = logging.getLogger("dflash_torch.serving")

    class Server(uvicorn.Server):
        signals: list[int]  # (those caught, raised again once the server ended: capture_signals)
        drain_until: float | None = None  # (time.monotonic() at which a drain SIGTERM / SIGHUP began ends)
        draining = False
        drain_sig: int | None = None  # (the SIGTERM / SIGHUP that began it)
        drain_cut: int | None = None  # (a second SIGTERM / SIGHUP during the drain: it ends at once)

        def handle_exit(self, sig, frame):
            # (uvicorn's, but SIGTERM and SIGHUP with --drain-timeout start a drain: on_tick; another one
            # during the drain ends it at once)
            self.signals.append(sig)
            if sig != signal.SIGINT and args.drain_timeout and not self.should_exit:
                if self.drain_until is None:
                    self.drain_sig, self.drain_until = sig, time.monotonic() + args.drain_timeout
                elif self.drain_cut is None:  # (logged by on_tick: not in a signal handler)
                    self.drain_cut, self.drain_until = sig, time.monotonic()
            elif self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # (a second Ctrl-C: uvicorn stops waiting for the connections)
            else:
                self.should_exit = True

        @contextlib.contextmanager
        def capture_signals(self):
            # (uvicorn's, with SIGHUP, which an ssh session that drops sends, as SIGTERM, unless it was
            # ignored at start: nohup): once the server has ended, the last signal caught is raised
            # again, under the handler it replaced (killed by SIGTERM, status 143, as without the
            # server; SIGINT: KeyboardInterrupt, status 130; as PID 1: end_by_signal)
            self.signals = []
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            caught = [signal.SIGINT, signal.SIGTERM]
            if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
                caught.append(signal.SIGHUP)
            replaced = {sig: signal.signal(sig, self.handle_exit) for sig in caught}
            try:
                yield
            finally:
                for sig, handler in replaced.items():
                    signal.signal(sig, handler)
            if self.signals:
                end_by_signal(self.signals[-1])

        async def on_tick(self, counter):
            if self.drain_until is not None and not self.should_exit:
                if not self.draining:
                    self.draining = True
                    left = app.state.drain()
                    drain_log.warning("%s: draining: new requests get a 503 server_shutting_down; %d in progress "
                                      "may finish for up to %g s (--drain-timeout)",
                                      signal.Signals(self.drain_sig).name, left, args.drain_timeout)
                left = app.state.requests_in_progress()
                if not left:
                    drain_log.info("drained: every request taken has finished; shutting down")
                    self.should_exit = True
                elif time.monotonic() >= self.drain_until:
                    why = (f"the drain took --drain-timeout {args.drain_timeout:g} s" if self.drain_cut is None else
                           f"{signal.Signals(self.drain_cut).name} during the drain (a second signal)")
                    drain_log.warning("%s: ending the %d request%s still in progress", why, left, "s" if left > 1 else "")
                    self.should_exit = True
            return await super().on_tick(counter)

        async def shutdown(self, sockets=None):
            # Ctrl-C / SIGTERM / SIGHUP (after the drain of --drain-timeout): end the generations
            # first (a queued request gets a 503, a stream an error event and [DONE], a running round
            # finishes) rather than when uvicorn's graceful time runs out and it cancels them (a bare
            # 500, a stream cut short, a traceback); a request whose response has not started (its
            # body arriving, its prompt being tokenized) gets a 503
            app.state.shutdown()
            await super().shutdown(sockets=sockets)
            if self.force_exit:  # a second Ctrl-C skips the app's shutdown; asyncio.run would then cancel
                await self.lifespan.shutdown()  # its lifespan task, which logs a CancelledError traceback

    logger = logging.getLogger("dflash_torch")  # (the server's own messages, at uvicorn's --log-level)
    logger.addHandler(log_handler())
    logger.setLevel(args.log_level.upper())
    logger.propagate = False
    if (warning := unparsed_calls_warning(args.tool_call_parser, app.state.tool_call_parser,
                                          getattr(engine.tokenizer, "chat_template", None))) is not None:
        logger.warning(warning)
    server = Server(uvicorn_config(app, args))
    try:
        server.run(sockets=sockets)  # (after Ctrl-C, raises KeyboardInterrupt: the signal raised again once shut down)
    finally:
        _wait_for_engine(scheduler)
    return 0 if server.started else 1


def end_by_signal(sig: int) -> None:
    """End the process as the signal ``sig`` (that stopped the server) would: raise it again
    under the handler now in place, its default action killing the process (status 128 +
    ``sig`` in a shell), SIGINT's Python handler raising ``KeyboardInterrupt``. Where that
    returns (the process is PID 1, a container's first process, whose signals of default
    action the kernel ignores; the signal is ignored; a handler returned), raise
    ``SystemExit(128 + sig)``, the status a shell would have shown.

    Raises:
        KeyboardInterrupt: raised by the handler of ``sig`` (SIGINT's).
        SystemExit: ``128 + sig``, where raising ``sig`` did not end the process.
    """
    import signal

    signal.raise_signal(sig)
    raise SystemExit(128 + sig)


def loading_line(args: argparse.Namespace) -> str:
    """The line ``serve`` writes to stdout as it begins to load the models of the parsed
    arguments ``args``: ``dflash-torch: loading 'TARGET' + drafter 'DRAFTER' ...``."""
    target = "the shipped target" if args.target is None else repr(args.target)
    if args.no_draft:
        what = f"{target} (no drafter: --no-draft)"
    elif args.draft is not None:
        what = f"{target} + drafter {args.draft!r}"
    else:
        what = "the shipped target + drafter" if args.target is None else target
    return f"dflash-torch: loading {what} ..."


class _Stopped(KeyboardInterrupt):
    """A SIGTERM or SIGHUP (``sig``) that stops the server while it starts, as a Ctrl-C does."""

    def __init__(self, sig: int):
        super().__init__(sig)
        self.sig = sig


@contextlib.contextmanager
def stopped_while_loading():
    """Inside the block (the server loading its models, building its graphs), SIGTERM and
    SIGHUP (unless ignored at start: nohup) raise ``KeyboardInterrupt`` as Ctrl-C does (the
    first one; later ones are ignored until the block ends): one that stops the block, Ctrl-C
    too, is said in one line on stderr (``dflash-torch: SIGTERM while the server was starting
    (loading its models): stopped before serving``; they ended it without a word), then the
    process ends as the signal would (:func:`end_by_signal`, once its handler of before the
    block is back). Only in the main thread (where Python runs signal handlers); elsewhere the
    block runs as is.

    Raises:
        KeyboardInterrupt: SIGINT (Ctrl-C) stopped the block (status 130).
        SystemExit: ``128 + sig`` where SIGTERM or SIGHUP raised again did not end the process.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = [signal.SIGTERM] + ([signal.SIGHUP] if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN else [])
    raised: list[int] = []

    def stop(sig, frame):
        if not raised:
            raised.append(sig)
            raise _Stopped(sig)

    previous = {sig: signal.signal(sig, stop) for sig in caught}
    try:
        yield
    except KeyboardInterrupt as exc:
        sig = exc.sig if isinstance(exc, _Stopped) else signal.SIGINT
        print(f"dflash-torch: {signal.Signals(sig).name} while the server was starting (loading its models): "
              "stopped before serving", file=sys.stderr, flush=True)
        if sig != signal.SIGINT:
            for caught_sig, handler in previous.items():
                signal.signal(caught_sig, handler)
            end_by_signal(sig)
        raise
    finally:
        for caught_sig, handler in previous.items():
            signal.signal(caught_sig, handler)


def _start_lines(args: argparse.Namespace, engine, app) -> None:
    """Write the server's start line (what it serves, where, how) to stdout, and the sampling
    values the target's generation_config.json gives requests that omit them.

    Raises:
        OutputError: stdout cannot take them (e.g. ``No space left on device``; see :func:`write_log`).
    """
    scheduler = app.state.scheduler
    write_log(f"dflash-torch: serving {app.state.model_id!r} on {served_url(args.host, args.port)} "
              f"(block size {engine.block_size}, context {engine.max_context}, {scheduler.max_batch_size} "
              f"slot{'s' if scheduler.max_batch_size > 1 else ''}"
              + (f" + {args.prefix_slots} prefix slot{'s' if args.prefix_slots > 1 else ''}" if args.prefix_slots
                 else "")
              + f", queue {scheduler.max_queue}, "
              f"reasoning parser {app.state.reasoning_parser}, tool call parser {app.state.tool_call_parser})\n")
    if app.state.sampling_defaults:
        taken = dict(app.state.sampling_defaults)
        cap = taken.pop("max_new_tokens", None)
        write_log("dflash-torch: requests that omit them get the sampling values of the target's "
                  "generation_config.json: " + ", ".join(f"{k} {v}" for k, v in taken.items())
                  + ("" if cap is None else f"{'; ' if taken else ''}chat and Responses requests without "
                     f"max_tokens at most {cap} tokens (its max_new_tokens)")
                  + " (--generation-config none: OpenAI's defaults)\n")


def write_log(text: str) -> None:
    """Write ``text``, a line of the server's log on stdout (its start lines), and flush it.
    A reader that went away (``serve | head -n1``) does not stop the server, whose log stdout
    is: one line on stderr says its log lines are dropped from now on (:func:`log_gone`), and
    stdout is pointed at /dev/null.

    Raises:
        OutputError: stdout cannot take it otherwise (e.g. ``No space left on device``): known
            at start, it ends the command in one line, status 1, as generate's output.
    """
    from ..cli import _drop_stdout, write_stdout

    try:
        write_stdout(text)
    except BrokenPipeError as exc:
        _drop_stdout()
        try:  # (what the buffer holds goes to /dev/null)
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        log_gone("stdout", exc)


def log_gone(where: str, exc: OSError) -> None:
    """Say on stderr, in one line, that the server's log lines to ``where`` (``stdout``) are
    dropped from now on: a write there failed with ``exc``."""
    try:
        print(f"dflash-torch: cannot write the server's log lines to {where} ({exc.strerror or exc}): they are "
              "dropped from now on", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def uvicorn_config(app, args: argparse.Namespace):
    """The ``uvicorn.Config`` serving ``app`` as the parsed ``serve`` arguments ``args`` ask
    (``--host``, ``--port``, ``--log-level``, ``--timeout-keep-alive``); uvicorn's log lines
    (its own on stderr, the access lines on stdout) through :class:`LogHandler` s. Making it
    configures uvicorn's loggers."""
    import copy

    import uvicorn
    from uvicorn.config import LOGGING_CONFIG

    log_config = copy.deepcopy(LOGGING_CONFIG)
    for handler in log_config["handlers"].values():
        handler["class"] = f"{LogHandler.__module__}.{LogHandler.__qualname__}"
    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5,
                          timeout_keep_alive=args.timeout_keep_alive, log_config=log_config)


class LogHandler(logging.StreamHandler):
    """A ``logging.StreamHandler`` of the server's log lines whose stream, once a write to it
    fails with an ``OSError`` (its reader went away: ``serve | head``; a full disk), is gone:
    one line on stderr says so (``dflash-torch: cannot write the server's log lines to stdout
    (Broken pipe): they are dropped from now on``), its file descriptor is pointed at /dev/null
    (what its buffer holds would fail again at exit), and it writes no more lines; the server
    serves on. (logging's own handler writes a "--- Logging error ---" traceback to stderr for
    each line.) Another error is logging's: its traceback."""

    gone = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.gone:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        from ..cli import _to_devnull

        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            super().handleError(record)
            return
        self.gone = True
        stream = self.stream
        where = "stdout" if stream is sys.stdout else "stderr" if stream is sys.stderr else \
            str(getattr(stream, "name", "its stream")).strip("<>")
        _to_devnull(stream.fileno)
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
        if stream is not sys.stderr:
            log_gone(where, exc)


def log_handler() -> logging.Handler:
    """The handler of the server's own log lines (stderr, a :class:`LogHandler`): in the format
    of uvicorn's (``INFO:     message``: the level and its colon padded to 9 characters,
    coloured where uvicorn colours its own), so that a parser of uvicorn's lines reads them too."""
    from uvicorn.logging import DefaultFormatter

    handler = LogHandler()
    handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
    return handler


def unparsed_calls_warning(choice: str, resolved: str, chat_template: str | dict | None) -> str | None:
    """The start-up warning of ``--tool-call-parser auto`` that found no call format it knows
    (``resolved`` ``none``) in a chat template that renders tools or tool calls (its source
    names ``tools`` or ``tool_calls``; a dict of named
    templates: any of them): the calls a reply writes come back as its text. None otherwise."""
    import re

    from .tools import PARSERS

    sources = chat_template.values() if isinstance(chat_template, dict) else [chat_template or ""]
    if choice != "auto" or resolved != "none" or not any(re.search(r"\btool(s|_calls)\b", str(t)) for t in sources):
        return None
    known = ", ".join(p for p in PARSERS if p not in ("auto", "none"))
    return ("--tool-call-parser auto knows no tool call format of this chat template, which renders tools or tool "
            "calls: the tool calls that replies write come back as text in content (finish_reason stop); the parsers: "
            f"{known} (--tool-call-parser NAME)")


def _host_port(host: str, port: int) -> str:
    """``host:port`` as in a URL (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def served_url(host: str, port: int) -> str:
    """The API's base URL for the start line: ``http://host:port/v1``; for ``--host ""``
    (every interface, IPv4 and IPv6: see :func:`listen`), which has no address to write,
    ``http://localhost:port/v1`` (every interface), the URL that reaches it from this machine."""
    if not host:
        return f"http://{_host_port('localhost', port)}/v1 (every interface)"
    return f"http://{_host_port(host, port)}/v1"


def listen(host: str, port: int) -> list:
    """Listen on ``host``, ``port``: a TCP socket bound to every address ``host`` resolves to
    (IPv4 and IPv6; ``""``: every interface), as uvicorn (asyncio's ``create_server``) binds
    them, listening at once, so that the port is the caller's from now on (no other process can
    take it while the models load; a connection made meanwhile waits in the backlog until the
    sockets are served: ``uvicorn.Server.run(sockets=...)``).

    Returns:
        The listening ``socket.socket`` s (the caller closes them).

    Raises:
        DFlashError: ``host`` in brackets (``[::1]``: give ``::1``), does not resolve, or an
            address is taken or not this machine's.
    """
    import socket

    if host.startswith("[") and host.endswith("]"):
        raise DFlashError(f"--host takes an IPv6 address without brackets: --host {host[1:-1]}, not {host}")
    sockets = []
    try:
        # (as asyncio: "" is every interface)
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # (as asyncio: [::] is not also 0.0.0.0)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen()  # (taken: another socket, SO_REUSEADDR or not, cannot bind it now)
    except OSError as e:
        for sock in sockets:
            sock.close()
        raise DFlashError(f"cannot listen on {_host_port(host, port)}: {e.strerror}") from None
    return sockets


def _wait_for_engine(scheduler) -> None:
    """Let the running round finish before the process exits: an interpreter that exits while
    the compute thread is inside a torch op aborts the process ("terminate called without an
    active exception"). Another Ctrl-C meanwhile exits at once, without finalizing."""
    try:
        scheduler.close()
    except KeyboardInterrupt:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
