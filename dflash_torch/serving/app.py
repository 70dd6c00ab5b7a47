"""An OpenAI-compatible HTTP server for a :class:`DFlashEngine`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses``
(all with ``stream``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus).

``/v1/responses`` (OpenAI's Responses API, stateless: ``store`` true and
``previous_response_id`` are 400s) is served as the chat completion of its input
(:meth:`.protocol.ResponsesRequest.chat_request`: the same template, sampling, stop handling,
parsers, constraints, scheduler); its answer is a Response object or its stream of events
(:mod:`.responses`), and its errors name its own parameters (``text.format``,
``max_output_tokens``, ``input.3.content``, ...: :func:`_as_responses`); chat's own
parameters sent to it are 400s (``unknown_parameter``, :meth:`.protocol.ResponsesRequest.chat_only`).

Requests go through a scheduler (see :mod:`.scheduler`): once its body is validated and
its prompts are tokenized and fit the context (validating and tokenizing run in threads of
the server's pool, so a large body holds neither the engine nor the event loop), a request's
choices (one per prompt of a list, times ``n``) wait in a bounded queue and run in the
engine's slots. A prompt (a chat's: its messages as the chat template renders them) longer
than the engine's ``max_prompt_chars`` cannot fit and is refused before it is tokenized; a body larger than
12 bytes per such character + 1 MiB is dropped as it arrives. A body sent with
``Content-Encoding`` gzip or deflate is decoded (its decoded size under the same limit; at
most 64 gzip members).
Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for any
invalid or unsupported input (any body the JSON parser or the validation cannot take, or
not valid data of its Content-Encoding, included), 401 for a missing or wrong API key, 404
for an unknown model or route, 408 (``request_timeout``, the connection closed) for a body not
whole ``body_timeout`` seconds after its headers, 413 for a body over that limit (sent or decoded), 415 (with
``Accept-Encoding``) for another Content-Encoding, 503 with ``Retry-After`` when the queue is
full, 503 with ``Retry-After`` once the server shuts down or drains (a stream starts, its status and headers sent, once its
prefill is done: an error found before is its status; a stream that fails after it started
ends with an error event and ``[DONE]``); a 500 means a server bug, or ``--compile``'s graphs that torch
failed to build (:class:`~dflash_torch.errors.CompileError`, named in the message; the
server goes on).
CORS headers (starlette's ``CORSMiddleware``; ``create_app``'s ``allowed_origins``, ...) let
browsers' scripts call the server; a preflight ``OPTIONS`` needs no API key.

Chat replies are split into ``reasoning_content`` (:mod:`.reasoning`), ``content`` and, for
a request with ``tools``, ``tool_calls`` (:mod:`.tools`; with ``parallel_tool_calls`` false,
the reply's first call only, as vLLM).

Structured outputs (both endpoints): ``response_format`` (OpenAI: ``json_object``,
``json_schema``), ``structured_outputs`` and ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` (vLLM) constrain the output
(:mod:`dflash_torch.structured`); chat ``tool_choice`` ``required`` or a named function
constrains it to tool calls (:data:`.tools.FORCED_CALL_GRAMMARS`: hermes, qwen3_coder, glm45,
glm47, kimi_k2, deepseek_v31), which end the reply: its ``stop`` and ``stop_token_ids`` are not
applied (they would cut a call or leave none). A
constraint is compiled (and checked: a 400 names its field) in a thread before the request
queues, so a slow compile holds neither the engine nor the event loop. In a chat whose
template opened a reasoning (``<think>`` at the prompt's end, ``think`` reasoning parser),
the constraint applies after it (:func:`.constraints.after_reasoning`): ``content`` is the
constrained output, ``reasoning_content`` the thinking; where the template neither opened
nor closed one, the reply may open a reasoning first (``<think>`` ... ``</think>``, as
Qwen3's thinking mode writes it), then the constraint applies. vLLM's ``guided_whitespace_pattern``
sets a JSON constraint's whitespace (:func:`.constraints.with_whitespace`).

Defaults follow OpenAI's API: ``temperature`` 1, ``top_p`` 1, ``max_tokens`` 16 for
completions and the rest of the context for chat, except where the target's
``generation_config.json`` recommends values (``create_app(generation_config="auto")``, as
vLLM). Extensions: ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``; responses carry a ``dflash`` object with the
request's speculative-decoding statistics (with several choices, each choice has its own).

Log-probabilities (chat ``logprobs``, completions ``logprobs`` and ``echo``, vLLM's
``prompt_logprobs``): :mod:`.logprobs`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import hmac
import json
import threading
import time
import uuid
import zlib
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect

from ..batch import DEFAULT_MAX_BATCH_SIZE
from ..engine import StreamChunk
from ..errors import DFlashError, about_prompt
from ..options import (check_api_key, check_body_timeout, check_chat_template_kwargs, check_flag, check_keepalive,
                       check_min_tokens_default, check_model_name, check_strings)
from ..structured import StructuredOutput
from .constraints import after_reasoning, special_token, think_tokens, with_whitespace
from .logprobs import Scoring, chat_logprobs, completion_logprobs, joined_logprobs
from .metrics import MetricsMiddleware, ServerMetrics
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ResponsesInputError,
                       ResponsesRequest, TokenizeChatRequest, TokenizeCompletionRequest, conflicting_fields,
                       describe_validation_error, known_fields, unknown_fields, responses_message, responses_param,
                       tool_choice_name, unsupported_field, validation_code, CHAT_TEMPLATE_REFUSED)
from .reasoning import (GEMMA4_CLOSE, GEMMA4_OPEN, HARMONY_MARKERS, THINK_CLOSE, THINK_OPEN, check_reasoning_parser,
                        resolve_parser)
from .responses import ResponseBuilder, marker_pieces, sse_event
from .scheduler import (RETRY_AFTER_S, Event, Job, ParamError, QueueFull, Scheduler, ShuttingDown, check_slots,
                        choice_seed, fit_max_tokens, log, make_backend, param_of)
from .tools import (CALL_CLOSE, CALL_OPEN, DEEPSEEK_MARKERS, FORCED_CALL_GRAMMARS, FORCED_CALL_MARKERS,
                    GEMMA4_CALL_CLOSE, GEMMA4_CALL_OPEN, GEMMA4_QUOTE, GLM_MARKERS, KIMI_MARKERS,
                    MINIMAX_CALL_CLOSE, MINIMAX_CALL_OPEN, check_tool_parser, forced_call_error, json_text,
                    new_reply_parser, parse_reply, resolve_tool_parser)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# where omitted sampling values come from: the target's generation_config.json, or OpenAI's defaults
GENERATION_CONFIGS = ("auto", "none")
DISCONNECT_POLL_S = 0.5
# Unknown request fields are logged by name, each once; their names are the clients' to choose, so:
IGNORED_LOGGED = 256  # the most names a server remembers having logged (then it forgets the least recently sent)
IGNORED_PER_LINE = 20  # the most names one request's log line names (the rest counted: "and N more")
# 503 queue_full refusals are logged at most once per this many seconds (the rest counted in the next line):
# clients that retry every Retry-After second would otherwise write a line each
QUEUE_FULL_LOG_S = 10.0
# the request bodies' Content-Encoding s taken -> zlib's wbits (deflate: the zlib format, as HTTP defines it)
CONTENT_CODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
# the most members a gzip request body may have (a client sends 1; each costs zlib a copy of the rest of the body)
MAX_GZIP_MEMBERS = 64
ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/v1/models/{model}", "/tokenize",
             "/detokenize", "/health", "/metrics"}


class LogLimit:
    """A limit on the log lines of an event that clients may repeat at will (a 503
    queue_full, which every client retrying after its Retry-After gets again): the first
    event is logged, then at most one in any ``interval`` seconds, whose line says how many
    went unlogged since the line before. Thread-safe.

    Args:
        interval: the fewest seconds between two logged events (a float > 0, on the clock of
            ``time.monotonic``).
    """

    def __init__(self, interval: float):
        self.interval = interval
        self._last: float | None = None  # (when the last logged event happened)
        self._unlogged = 0
        self._lock = threading.Lock()

    def take(self, now: float | None = None) -> int | None:
        """Count an event happening at ``now`` (``time.monotonic()`` seconds; None: now) and
        say whether to log it.

        Returns:
            None where it is not to be logged (less than ``interval`` seconds after the last
            one logged); otherwise the number of events not logged since that one (0 for the
            first event).
        """
        if now is None:
            now = time.monotonic()
        with self._lock:
            if self._last is not None and now - self._last < self.interval:
                self._unlogged += 1
                return None
            unlogged, self._last, self._unlogged = self._unlogged, now, 0
            return unlogged

    def note(self, unlogged: int, counter: str) -> str:
        """The end of a logged event's line, in parentheses: how many events since the line
        before were not logged (``unlogged``, as :meth:`take` returned it), the limit, and the
        /metrics ``counter`` that counts every event."""
        since = f"{unlogged} more since the last such line, not logged; " if unlogged else ""
        return f"({since}logged at most once per {self.interval:g} s; /metrics counts every one: {counter})"


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def response(self) -> JSONResponse:
        """This error's response: OpenAI's error JSON, with its status and headers."""
        response = error_response(self.status, self.message, self.type, self.param, self.code)
        response.headers.update(self.headers or {})
        return response


class ClientGone(Exception):
    """The client disconnected before its request was read."""


def shutting_down() -> APIError:
    """The 503 ``server_shutting_down`` of a request the server will not serve because it shuts
    down (or drains), with ``Retry-After`` (seconds), as a full queue's 503: a client or a load
    balancer retries it, elsewhere."""
    return APIError(503, "the server is shutting down; retry the request later", type="server_error",
                    code="server_shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _JSONResponse(JSONResponse):
    """starlette's JSON response, whose text has any lone surrogate escaped (:func:`.tools.json_text`:
    a string holding one, which a model's JSON may spell, would not encode to UTF-8)."""

    def render(self, content) -> bytes:
        return json_text(content, allow_nan=False, separators=(",", ":")).encode("utf-8")


def error_response(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return _JSONResponse(error_body(message, type, param, code), status_code=status)


class ServerErrorMiddleware:
    """Pure ASGI middleware: a request whose handler raised before its response started is
    answered with a 500 in OpenAI's error shape, inside the CORS middleware so that a
    browser's script can read it (starlette's own 500, outermost, has no CORS headers); the
    exception is raised again so that the server logs its traceback. A stream that fails
    after it started is not this middleware's (its error event is the route's)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_wrapper(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception as exc:
            if not started:
                response = error_response(500, f"internal server error: {type(exc).__name__}", type="server_error")
                await response(scope, receive, send)
            raise


def needs_key(path: str) -> bool:
    """Whether the API key guards the request path ``path``: ``/v1`` and every path under it
    (an unknown one too), ``/tokenize``, ``/detokenize`` and ``/openapi.json``, FastAPI's
    schema, which lists the routes (a trailing slash too)."""
    return path == "/v1" or path.startswith("/v1/") or path.rstrip("/") in ("/tokenize", "/detokenize",
                                                                           "/openapi.json")


def key_error(authorization: str, api_key: str) -> APIError | None:
    """The 401 of a request whose ``Authorization`` header (``""``: none) does not carry
    ``Bearer <api_key>``; None when it does."""
    scheme, _, token = authorization.partition(" ")
    if not authorization.strip():
        return APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
    if scheme.lower() != "bearer" or not token.strip():
        return APIError(401, "malformed Authorization header: send 'Authorization: Bearer <key>'",
                        code="invalid_api_key")
    if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        return APIError(401, "incorrect API key provided", code="invalid_api_key")
    return None


class APIKeyMiddleware:
    """Pure ASGI middleware: a request to a path the key guards (:func:`needs_key`) without
    ``Authorization: Bearer <api_key>`` gets a 401 (OpenAI's error JSON) before it is routed,
    so that no 404, 405 or trailing slash's redirect tells a client without the key which
    routes exist. (A CORS preflight is answered outside it, without the key.)"""

    def __init__(self, app, api_key: str):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and needs_key(scope.get("path", "")):
            err = key_error(Headers(scope=scope).get("authorization", ""), self.api_key)
            if err is not None:
                return await err.response()(scope, receive, send)
        await self.app(scope, receive, send)


# The threads that tokenize prompts and compile constraints beside the event loop: a pool of
# the module's own, not the event loop's default one, which asyncio.run waits for when the server
# exits (a long prompt's tokenizing held up an exit after Ctrl-C for seconds; see busy()).
_pool = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="dflash-serve")
_calls: set[concurrent.futures.Future] = set()  # (those not done)


async def to_thread(fn, /, *args):
    """``fn(*args)`` in a thread of the server's pool (the event loop goes on meanwhile);
    its result, or its exception raised here."""
    future = _pool.submit(fn, *args)
    _calls.add(future)
    future.add_done_callback(_calls.discard)
    return await asyncio.wrap_future(future)


def busy() -> bool:
    """Whether a :func:`to_thread` call still runs (e.g. a request's prompt still being tokenized
    after the request was answered at shutdown): an interpreter exiting now would wait for it
    (the CLI exits without finalizing then, as :func:`dflash_torch.cli.entry` says)."""
    return any(not f.done() for f in list(_calls))


class UnstartedRequests:
    """The requests whose response has not started (the body still arriving, the prompt being
    tokenized, the job waiting for its first token), for :meth:`end` to answer at once when the
    server shuts down, and the number of requests in progress (started or not), which a
    draining server waits for. Their handlers run inside :class:`ShutdownMiddleware`; the event
    loop's only."""

    def __init__(self):
        self.closed = False
        self.draining = False  # (new requests get the 503; those in progress go on)
        self.in_progress = 0  # (requests inside ShutdownMiddleware, until their response is sent)
        self.tasks: set[asyncio.Task] = set()  # (their handlers' tasks)
        self.ended: set[asyncio.Task] = set()  # (those end() cancelled)

    def end(self) -> None:
        """Cancel every such handler: its request gets a 503 ``server_shutting_down`` (as any
        request from now on). Idempotent."""
        self.closed = True
        for task in self.tasks - self.ended:
            self.ended.add(task)
            task.cancel()


class ShutdownMiddleware:
    """Pure ASGI middleware: a request whose handler :meth:`UnstartedRequests.end` cancelled
    before its response started, or that arrives after, gets a 503 ``server_shutting_down``
    (OpenAI's error JSON, ``Retry-After``) at once, its handler left without a traceback. Without
    it, uvicorn waits its graceful time (5 s) for such a request, then cancels it: a bare 500 and
    a traceback. While the server drains, a request that arrives gets that 503 too (``/metrics``
    excepted), and those in progress go on."""

    def __init__(self, app, unstarted: UnstartedRequests):
        self.app, self.unstarted = app, unstarted

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        unstarted = self.unstarted
        if unstarted.closed or (unstarted.draining and scope["path"] != "/metrics"):
            return await self._shutting_down(scope, receive, send)
        task = asyncio.current_task()
        started = False

        async def send_wrapper(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                unstarted.tasks.discard(task)
            await send(message)

        unstarted.tasks.add(task)
        unstarted.in_progress += 1
        try:
            await self.app(scope, receive, send_wrapper)
        except asyncio.CancelledError:
            if task not in unstarted.ended or started:  # (not ours: uvicorn's, or the response had started)
                raise
            if hasattr(task, "uncancel"):  # (Python 3.11+: the task goes on, no longer cancelled)
                task.uncancel()
            await self._shutting_down(scope, receive, send)
        finally:
            unstarted.in_progress -= 1
            unstarted.tasks.discard(task)
            unstarted.ended.discard(task)

    @staticmethod
    async def _shutting_down(scope, receive, send) -> None:
        await shutting_down().response()(scope, receive, send)


def _as_responses(exc: APIError, req: ResponsesRequest) -> APIError:
    """An error of the chat machinery serving the Responses request ``req``, with the Responses
    API's parameter names (``text.format`` for ``response_format``, ``input.3.content`` for
    the chat message that input item became, ...) in its ``param`` and message."""
    sources = req._sources
    return APIError(exc.status, responses_message(exc.message, sources, exc.param),
                    param=responses_param(exc.param, sources), code=exc.code, type=exc.type, headers=exc.headers)


def _one_line(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    return text[:300] or type(exc).__name__


def _decompress(data: bytes, coding: str, limit: int) -> bytes:
    """``data`` decoded from the content coding ``coding`` (a key of :data:`CONTENT_CODINGS`;
    a gzip body of several members, at most :data:`MAX_GZIP_MEMBERS` of them, is their data
    joined), at most ``limit`` + 1 bytes of it: a longer result is cut there, so that a small
    body that expands without end (a zip bomb) costs no more than that.

    Raises:
        zlib.error, ValueError: ``data`` is not (whole) data of that coding, or has more
            gzip members than that."""
    out = b""
    for _ in range(MAX_GZIP_MEMBERS):
        d = zlib.decompressobj(CONTENT_CODINGS[coding])
        out += d.decompress(data, limit + 1 - len(out))  # (at least 1: 0 would mean no limit)
        if len(out) > limit:
            return out
        if not d.eof:
            raise ValueError("it ends before its compressed data does")
        data = d.unused_data
        if not data:
            return out
        if coding == "deflate":
            raise ValueError(f"{len(data)} bytes follow its compressed data")
    raise ValueError(f"it has more than {MAX_GZIP_MEMBERS} gzip members (the most this server takes)")


def _count(n: int, noun: str) -> str:
    """``1 slot``, ``3 slots``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _sse(obj) -> str:
    return f"data: {json_text(obj)}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, reasoning_tokens: int | None = None) -> dict:
    """OpenAI's ``usage`` object; ``cached_tokens``: prompt tokens served from a retained prefix;
    ``reasoning_tokens`` (a chat's: :func:`_reasoning_tokens`, else None: no such field): its
    ``completion_tokens_details.reasoning_tokens``."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


def _reasoning_tokens(tokenizer, reasoning: str, limit: int) -> int:
    """The tokens of a reply's reasoning (the text its reasoning parser split off, markers
    not included) as the tokenizer encodes that text again (no special tokens added), at
    most ``limit`` (the reply's tokens); 0 for none. Chat's
    ``usage.completion_tokens_details.reasoning_tokens`` and the Responses API's
    ``usage.output_tokens_details.reasoning_tokens``."""
    return min(len(tokenizer.encode(reasoning, add_special_tokens=False)), limit) if reasoning else 0


def _cached_tokens(per_choice: list[int], n: int) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` of a request whose choice ``i * n + j``
    is prompt ``i``'s ``j``-th, from each choice's prompt tokens taken from a retained prefix
    (``GenerationStats.cached_prompt_tokens``): per prompt, counted once as in
    ``prompt_tokens``, the tokens that none of its choices read, i.e. the fewest any of
    them took (a choice reads its prompt from where the rows it took end; choices that
    share a prefill took the same)."""
    return sum(min(per_choice[i:i + n]) for i in range(0, len(per_choice), n))


def _stats_summary(stats) -> dict | None:
    """A response's (or a choice's) ``dflash`` object: the speculative-decoding statistics
    of its :class:`~dflash_torch.engine.GenerationStats` (times in seconds);
    ``mean_acceptance_length`` and ``decode_tokens_per_second`` are null where no decoding
    round ran (the reply ended with the prefill's token: ``max_tokens`` 1, a stop at once)."""
    if stats is None:
        return None
    d = stats.to_dict()  # (its nulls where no round ran, its histogram's keys as strings)
    return {k: d[k] for k in ("mean_acceptance_length", "acceptance_histogram", "block_size", "draft_mode",
                              "prefill_time", "decode_time", "decode_tokens_per_second")}


class _JobStreamingResponse(StreamingResponse):
    """A streaming response that cancels its job however the stream ends (a client
    disconnect, a failed send, or the normal end, where cancelling is a no-op)."""

    def __init__(self, content, job: Job, **kwargs):
        super().__init__(content, **kwargs)
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


KEEPALIVE_FRAME = ": keep-alive\n\n"  # an SSE comment: clients skip it (the openai client does)


async def with_keepalive(frames: AsyncIterator[str], interval: float) -> AsyncIterator[str]:
    """``frames`` with :data:`KEEPALIVE_FRAME` sent whenever ``interval`` seconds (> 0) pass
    without one, so that a stream that is silent for long (a tool call held back until it
    is complete, a slow round) does not hit a client's or a proxy's read timeout."""
    it = frames.__aiter__()
    pending = asyncio.ensure_future(it.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield KEEPALIVE_FRAME
                continue
            try:
                frame = pending.result()
            except StopAsyncIteration:
                return
            yield frame
            pending = asyncio.ensure_future(it.__anext__())
    finally:  # (the stream ends or the client left: the inner stream is closed too)
        if not pending.done():
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        else:
            # (its outcome retrieved: a client that left just as the inner stream ended, at its finish
            # chunk, left the StopAsyncIteration unread, asyncio's "Task exception was never retrieved")
            if not pending.cancelled():
                pending.exception()
            with contextlib.suppress(BaseException):
                await it.aclose()


def create_app(engine, api_key: str | None = None, model_name: str | None = None, *, max_batch_size: int | None = None,
               max_queue: int = 64, chat_template_kwargs: dict | None = None,
               reasoning_parser: str = "auto", tool_call_parser: str = "auto",
               generation_config: str = "auto", sse_keepalive: float = 15.0, body_timeout: float = 60.0,
               allowed_origins: list[str] = ("*",), allowed_methods: list[str] = ("*",),
               allowed_headers: list[str] = ("*",), allow_credentials: bool = False) -> FastAPI:
    """The FastAPI app serving ``engine``.

    Args:
        engine: a loaded :class:`~dflash_torch.engine.DFlashEngine`.
        api_key: when set, every ``/v1`` path (an unknown one too), ``/tokenize``,
            ``/detokenize`` and ``/openapi.json`` require ``Authorization: Bearer <api_key>``
            (:func:`needs_key`): a 401 without it,
            before a 404, 405 or redirect (``/health`` and ``/metrics`` stay open); surrounding
            whitespace is dropped.
        model_name: the model id clients must use (default: ``engine.name``).
        max_batch_size: most sequences decoded together (slots; default 8, at most the
            engine's ``max_batch_size``); an engine that decodes one sequence at a time
            (``draft_mode="recompute"``) has one, and refuses a larger ``max_batch_size``
            (see :func:`.scheduler.make_backend`).
        max_queue: sequences that may wait for a slot (0: none, a request is taken only
            when free slots hold all its choices); a request that does not fit gets a 503
            with ``Retry-After`` at once.
        chat_template_kwargs: extra chat template variables of every chat request (e.g.
            ``{"enable_thinking": False}``); a request's own ``chat_template_kwargs`` and
            ``reasoning_effort`` override them (:meth:`DFlashEngine.encode_prompt`).
        reasoning_parser: how chat replies are split into ``reasoning_content`` and
            ``content`` (:mod:`.reasoning`): ``think`` (``<think>...</think>``), ``gemma4``
            (``<|channel>thought ... <channel|>``), ``harmony`` (gpt-oss), ``none`` (all
            content), or ``auto`` (default): ``harmony`` for a gpt-oss target, ``gemma4`` when
            the chat template mentions ``<|channel>``, ``think`` when it mentions ``<think>``,
            else none.
        tool_call_parser: how the tool calls of a chat reply to a request with ``tools`` are
            found (:mod:`.tools`): ``hermes``, ``qwen3_coder``, ``glm45``, ``glm47``, ``minimax_m2``,
            ``gemma4``, ``kimi_k2``, ``deepseek_v31``, ``harmony`` (gpt-oss; needs the
            ``harmony`` reasoning parser), ``none`` (the reply stays text), or ``auto``
            (default): by the model and its chat template (:func:`.tools.resolve_tool_parser`).
        generation_config: ``auto`` (default, as vLLM's ``--generation-config auto``): a
            request that omits ``temperature``, ``top_k``, ``top_p``, ``min_p`` or
            ``repetition_penalty`` gets the value of the target's ``generation_config.json``
            (:attr:`DFlashEngine.generation_defaults`), and a chat (or Responses) request that
            omits ``max_tokens`` at most its ``max_new_tokens``; ``none``: OpenAI's defaults
            (as vLLM's ``--generation-config vllm``).
        sse_keepalive: seconds (> 0) a stream may go without an event before the server
            sends an SSE comment line (``: keep-alive``), which clients skip; 0: never.
        body_timeout: seconds a request's body may take to arrive whole, from when its
            headers did (default 60; 0: no limit): a client that stalls mid-body gets a 408
            ``request_timeout`` (OpenAI's error JSON, ``Connection: close``) and its connection
            is closed, rather than holding it, and a drain, for as long as it likes.
        allowed_origins, allowed_methods, allowed_headers, allow_credentials: CORS, so that
            a browser's scripts may call the server (starlette's ``CORSMiddleware``, as vLLM's
            flags of those names): the origins, methods (in any case: ``post`` is ``POST``)
            and request headers allowed (``"*"``: any; default any of each) and whether
            credentials (the browser's cookies and HTTP authentication) may be sent (default
            false). A preflight ``OPTIONS`` request is answered without the API key (browsers
            send none with it); a 503's ``Retry-After`` is exposed to the browser's scripts.

    Raises:
        DFlashError: an empty API key or one that is not printable ASCII; an empty or
            blank ``model_name``; ``chat_template_kwargs`` not a dict of string keys or setting
            an argument of the template call; an unknown ``reasoning_parser`` or ``tool_call_parser``,
            or ``harmony`` tool calls without ``harmony`` reasoning; ``max_batch_size``
            not an integer >= 1, or > 1 for an engine of ``draft_mode="recompute"``;
            ``max_queue`` not an integer >= 0; a ``generation_config`` other than ``auto``
            or ``none``, or ``auto`` with a bad value in the target's ``generation_config.json``;
            ``sse_keepalive`` or ``body_timeout`` not a finite number >= 0; the CORS lists not lists of strings or
            ``allow_credentials`` not a bool; batch caches of ``max_batch_size`` x the
            engine's context that do not fit the device (one slot: the caches of one sequence
            of the engine's context, to which a request may grow them).

    The engine's own WARNING about a chat template that leaves out tools is turned off
    (:attr:`DFlashEngine.warn_tools_left_out`): the server logs its own, once, at its first
    request with tools.
    """
    api_key = check_api_key(api_key)
    model_id = check_model_name(model_name) or engine.name
    default_template_kwargs = check_chat_template_kwargs(chat_template_kwargs, engine.reserved_template_variables())
    reasoning = resolve_parser(check_reasoning_parser(reasoning_parser), engine.target.config.model_type,
                               getattr(engine.tokenizer, "chat_template", None))
    tool_calls = resolve_tool_parser(check_tool_parser(tool_call_parser), engine.target.config.model_type,
                                     getattr(engine.tokenizer, "chat_template", None), reasoning)
    if generation_config not in GENERATION_CONFIGS:
        raise DFlashError(f"generation_config must be one of {', '.join(GENERATION_CONFIGS)}, got {generation_config!r}")
    try:
        sampling_defaults = {}
        if generation_config == "auto":
            sampling_defaults = dict(engine.generation_defaults)
            if engine.recommended_max_new_tokens is not None:  # (the limit of a chat request without max_tokens)
                sampling_defaults["max_new_tokens"] = engine.recommended_max_new_tokens
    except DFlashError as exc:
        raise DFlashError(f"{exc} (to leave the file's sampling unread and keep OpenAI's defaults: serve "
                          "--generation-config none, create_app(generation_config='none'))") from None
    keepalive = check_keepalive(sse_keepalive)
    body_timeout = check_body_timeout(body_timeout)
    # (methods in capitals: starlette compares a preflight's method, which browsers send so, as written;
    # Retry-After exposed: a browser's script reads it on a 503)
    cors = dict(allow_origins=check_strings(allowed_origins, "allowed_origins"),
                allow_methods=[m.upper() for m in check_strings(allowed_methods, "allowed_methods")],
                allow_headers=check_strings(allowed_headers, "allowed_headers"),
                allow_credentials=check_flag(allow_credentials, "allow_credentials"), expose_headers=["Retry-After"])
    metrics = ServerMetrics(block_size=getattr(engine, "block_size", 16) or 16)
    if max_batch_size is None:
        max_batch_size = DEFAULT_MAX_BATCH_SIZE
    elif max_batch_size != 1 and not getattr(engine, "batched", True):  # (as from_pretrained refuses it)
        check_slots(max_batch_size, "max_batch_size")
        raise DFlashError("max_batch_size has no effect with an engine of draft_mode 'recompute' (it decodes one "
                          "sequence at a time); drop it")
    scheduler = Scheduler(make_backend(engine, max_batch_size), metrics, max_queue=max_queue)
    metrics.open_requests.set_function(scheduler.open_jobs)
    created = int(time.time())
    # no prompt longer than max_prompt_chars characters fits the context, and JSON spells a
    # character in at most 12 bytes (an escaped surrogate pair); 1 MiB for everything else
    max_body = 12 * engine.max_prompt_chars + 2**20
    token_info = functools.lru_cache(maxsize=2**17)(  # (logprobs: a token's string and bytes)
        lambda token_id: (engine.token_text(token_id), engine.token_bytes(token_id)))

    unstarted = UnstartedRequests()
    queue_full_log = LogLimit(QUEUE_FULL_LOG_S)  # (503 queue_full lines: see QUEUE_FULL_LOG_S)

    def shutdown() -> None:
        """End every request at once (the server shuts down; on the event loop): the scheduler's
        jobs (:meth:`Scheduler.shutdown`), and requests whose response has not started (a 503:
        :class:`ShutdownMiddleware`). Idempotent."""
        scheduler.shutdown()
        unstarted.end()

    def drain() -> int:
        """Stop taking requests, and let those in progress finish (the server drains before it
        shuts down; on the event loop): from now on a request gets a 503 ``server_shutting_down``
        with ``Retry-After`` at once (``/health`` too, so that a load balancer stops sending
        any; ``/metrics`` excepted); those already taken (running, queued, or not yet queued:
        their body arriving, their prompt being tokenized) go on, streams too. Idempotent.
        Returns the number of requests in progress (:func:`requests_in_progress`)."""
        unstarted.draining = True
        return unstarted.in_progress

    def requests_in_progress() -> int:
        """Requests taken whose response has not been sent whole yet (streams until their
        last frame; ``/metrics`` requests too)."""
        return unstarted.in_progress

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        shutdown()

    app = FastAPI(title="dflash-torch", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    engine.warn_tools_left_out = False  # (prepare logs its own WARNING, which names this server's tool-call format)
    app.state.engine, app.state.metrics, app.state.scheduler, app.state.model_id = engine, metrics, scheduler, model_id
    app.state.reasoning_parser, app.state.tool_call_parser = reasoning, tool_calls
    app.state.sampling_defaults = sampling_defaults
    app.state.shutdown, app.state.drain, app.state.requests_in_progress = shutdown, drain, requests_in_progress
    if api_key is not None:  # (innermost: its 401s are counted)
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(ShutdownMiddleware, unstarted=unstarted)  # (its 503s are counted)
    app.add_middleware(MetricsMiddleware, metrics=metrics, endpoints=ENDPOINTS)
    app.add_middleware(ServerErrorMiddleware)
    # (outermost: a preflight is answered before the routes, whose API key check it does not reach)
    app.add_middleware(CORSMiddleware, **cors)

    # ---- errors -------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone):
        return client_left(request)

    @app.exception_handler(DFlashError)
    async def _dflash_error(request: Request, exc: DFlashError):
        return error_response(400, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        err = (exc.errors() or [{}])[0]
        param = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or None
        return error_response(400, f"invalid value for {param}: {err.get('msg', 'invalid request')}", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"method {request.method} not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        response = error_response(exc.status_code, message, code=code)
        response.headers.update(exc.headers or {})  # (a 405's Allow)
        return response

    # ---- helpers ------------------------------------------------------------------------
    def client_left(request: Request, rid: str | None = None) -> Response:
        """A 499 (nginx's "client closed request"; no client reads it, the metrics count it) for a
        request whose client went away before its answer, logged (INFO) as uvicorn's access log
        writes a line, which uvicorn writes for no response its client did not stay for;
        ``rid``: the request's id, once it has one."""
        client = f"{request.client.host}:{request.client.port}" if request.client else "-"
        log.info('%s - "%s %s HTTP/%s" 499 (the client went away before its answer%s)', client, request.method,
                 request.url.path, request.scope.get("http_version", "1.1"), f"; request {rid}" if rid else "")
        return Response(status_code=499)

    def too_large(what: str) -> APIError:
        return APIError(413, f"{what} is larger than this server accepts ({max_body} bytes: "
                             f"no longer prompt fits the model's context of {engine.max_context} tokens)",
                        code="request_too_large")

    async def read_body(request: Request) -> bytes:
        """The body, unless it is larger than ``max_body``: then the rest is read and dropped
        (a client still sending would get a reset instead of the answer) and it is a 413; a
        body that declares (``Content-Length``) more than 8 x ``max_body`` is a 413 at once,
        nothing read; a body not whole ``body_timeout`` seconds after the handler began to
        read it (its headers arrived) is a 408 that closes the connection."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > 8 * max_body:
            raise too_large(f"the request body ({int(declared)} bytes)")
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + body_timeout
        stream = request.stream().__aiter__()
        try:
            while True:
                try:
                    chunk = await (asyncio.wait_for(stream.__anext__(), max(deadline - loop.time(), 0))
                                   if body_timeout else stream.__anext__())
                except StopAsyncIteration:
                    break
                size += len(chunk)
                if size <= max_body:
                    chunks.append(chunk)
        except ClientDisconnect:  # it left while sending: nobody to answer
            raise ClientGone() from None
        except asyncio.TimeoutError:  # (it stalled: answered, if it still reads, and the connection closed)
            raise APIError(408, f"the request body did not arrive within {body_timeout:g} s of its headers "
                                f"({size} bytes came; --body-timeout)", code="request_timeout",
                           headers={"Connection": "close"}) from None
        if size > max_body:
            raise too_large(f"the request body ({size} bytes)")
        return b"".join(chunks)

    def decode_body(body: bytes, header: str) -> bytes:
        """The body sent with the ``Content-Encoding`` ``header``, decoded: gzip and deflate
        (in the order the header lists them; ``identity`` is none), each result at most
        ``max_body`` bytes (a 413: a zip bomb is cut there); any other coding is a 415 (with
        ``Accept-Encoding``, as RFC 7694 asks), data that is not of its coding a 400."""
        codings = [c.strip().lower() for c in header.split(",") if c.strip()]
        unknown = [c for c in codings if c not in CONTENT_CODINGS and c != "identity"]
        if unknown:
            raise APIError(415, f"Content-Encoding {unknown[0][:40]!r} is not supported: send the body uncompressed, or "
                                f"with Content-Encoding gzip or deflate", code="unsupported_content_encoding",
                           headers={"Accept-Encoding": "gzip, deflate"})
        for coding in reversed(codings):
            if coding == "identity":
                continue
            try:
                body = _decompress(body, coding, max_body)
            except (zlib.error, ValueError) as exc:
                raise APIError(400, f"the request body is not valid {coding} data (its Content-Encoding): "
                                    f"{_one_line(exc)}") from None
            if len(body) > max_body:
                raise too_large(f"the request body decompressed ({coding}, its Content-Encoding)")
        return body

    async def parse(request: Request, schema):
        """The request's body (decoded from its ``Content-Encoding``, all its header lines in
        order: :func:`decode_body`) validated by ``schema`` (a model class, or a function of the
        decoded JSON object that returns the class to validate it with). Decoding and validating
        run in a thread of the server's pool (:func:`to_thread`): a large body (tens of
        thousands of messages, keys, ...) takes a second of them, which would stall every
        other request and stream on the event loop."""
        body = await read_body(request)
        encoding = ", ".join(request.headers.getlist("content-encoding"))
        try:
            path = request.url.path
            return await to_thread(lambda: validate_body(decode_body(body, encoding), schema, path))
        except APIError:
            raise
        except RecursionError:  # the JSON parser, the Unicode check or pydantic went too deep
            raise APIError(400, "the request body is nested too deeply") from None
        except Exception as exc:  # whatever else a parser raises on a body is the body's fault
            raise APIError(400, f"the request body cannot be parsed: {type(exc).__name__}") from None

    def validate_body(body: bytes, schema, path: str):
        try:
            data = json.loads(body)
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int of over 4300 digits
            if "int_max_str_digits" in str(exc):  # (Python's limit; its message advises a Python call)
                raise APIError(400, "the request body holds an integer of more than 4300 digits") from None
            raise APIError(400, f"the request body is not valid JSON: {_one_line(exc)}") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        if not isinstance(schema, type):  # (chosen by the body)
            schema = schema(data)
        try:  # JSON escapes can smuggle in lone surrogates, which no tokenizer accepts
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "the request contains invalid Unicode (a lone surrogate escape)") from None
        try:
            req = schema.model_validate(data)
        except ValidationError as exc:
            message, param = describe_validation_error(exc)
            raise APIError(400, message, param=param, code=validation_code(exc)) from None
        if req.model is not None and req.model != model_id:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {model_id!r}",
                           param="model", code="model_not_found")
        if isinstance(req, ResponsesRequest):
            req = validate_responses(req)
        elif getattr(req, "samples", False):  # (not /tokenize's or /detokenize's: they sample nothing)
            check_fields(req)
        warn_unknown(req, data, path)  # (of a request taken)
        return req

    warned: dict[str, None] = {}  # unknown fields logged, the least recently sent first (at most IGNORED_LOGGED)
    warned_lock = threading.Lock()  # (requests are validated in the pool's threads, several at once)

    def warn_unknown(req, data: dict, path: str) -> None:
        """Log the fields of the request ``req`` (``data`` validated) that the server does not
        know (a misspelt ``max_token`` or ``text.fromat`` would otherwise pass unseen), by
        their path, each once: ignored, or (a tool's function's) passed to the chat template
        as sent (:func:`~.protocol.unknown_fields`, which cuts a key to 80 characters). A
        request's line names at most :data:`IGNORED_PER_LINE` of them (``and N more``), and the
        server remembers the last :data:`IGNORED_LOGGED` names sent (a name it forgot is logged
        again), so that no client can flood the log or, by sending many names, stop a later
        misspelt field from being logged."""
        ignored, passed = unknown_fields(req, data)
        with warned_lock:
            log_unknown(ignored, passed, path)

    def log_unknown(ignored: list[str], passed: list[str], path: str) -> None:
        for fields, what in ((ignored, "ignored the request field%s %s (not known to this server; each logged once)"),
                             (passed, "passed the request field%s %s to the chat template as sent (not known to "
                                      "this server; each logged once)")):
            for k in fields:  # (those logged before: recently sent again, kept longest)
                if k in warned:
                    warned[k] = warned.pop(k)
            fresh = [k for k in fields if k not in warned]
            if not fresh:
                continue
            named = fresh[:IGNORED_PER_LINE]
            warned.update(dict.fromkeys(named))
            while len(warned) > IGNORED_LOGGED:
                del warned[next(iter(warned))]
            names = ", ".join(repr(k) for k in named)
            if len(fresh) > len(named):
                names += f" and {len(fresh) - len(named)} more"
            log.warning("%s: " + what, path, "s" if len(fresh) > 1 else "", names)

    def check_fields(req) -> None:
        bad = conflicting_fields(req)
        if bad is not None:
            raise APIError(400, bad[1], param=bad[0])
        bad = unsupported_field(req)
        if bad is not None:
            raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")

    def validate_responses(req: ResponsesRequest) -> ResponsesRequest:
        """A Responses request checked, with ``req.chat`` the chat request it is served as."""
        bad = req.chat_only()
        if bad is not None:  # (OpenAI: an unknown parameter)
            raise APIError(400, bad[1], param=bad[0], code="unknown_parameter")
        if req.stream_options is not None and not req.stream:  # (as chat's, and OpenAI's)
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        bad = req.unsupported()
        if bad is not None:
            raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")
        if (missing := req.missing()) is not None:
            raise APIError(400, f"missing required parameter: {missing}", param=missing)
        try:
            chat = req.chat_request()
        except ResponsesInputError as exc:
            raise APIError(400, exc.message, param=exc.param, code="unsupported_parameter" if exc.unsupported else None
                           ) from None
        except ValidationError as exc:
            message, param = describe_validation_error(exc)
            raise _as_responses(APIError(400, message, param=param, code=validation_code(exc)), req) from None
        try:
            check_fields(chat)
        except APIError as exc:
            raise _as_responses(exc, req) from None
        req._chat = chat
        return req

    def sse(frames: AsyncIterator[str]) -> AsyncIterator[str]:
        """A stream's frames, with keep-alive comments unless ``sse_keepalive`` is 0."""
        return with_keepalive(frames, keepalive) if keepalive else frames

    async def next_event(job: Job, request: Request | None) -> Event | None:
        """The job's next event; None when the client went away (checked every
        DISCONNECT_POLL_S seconds, whether events flow or not)."""
        if request is None:
            return await job.queue.get()
        while True:
            now = time.monotonic()
            if now - job.last_disconnect_check >= DISCONNECT_POLL_S:
                job.last_disconnect_check = now
                if await request.is_disconnected():
                    job.cancel()
                    return None
            try:
                return await asyncio.wait_for(job.queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue

    async def answer_events(job: Job, first: Event, request: Request | None = None):
        """An answer's events in order: ``first`` (the one :func:`run` waited for), then the job's
        (:func:`next_event`); with ``request`` (a non-streamed answer), a None once its client went
        away, which ends them."""
        ev = first
        while ev is not None:
            yield ev
            ev = await next_event(job, request)
        yield None

    def job_error(ev: Event) -> APIError | None:
        """The error a job's ``error`` / ``fatal`` / ``unavailable`` event stands for."""
        if ev.kind == "error":
            message, param = ev.value
            return APIError(400, message, param=param)
        if ev.kind == "fatal":
            return APIError(500, f"generation failed: {ev.value}", type="server_error")
        if ev.kind == "unavailable":
            return shutting_down()
        return None

    def raise_job_error(ev: Event) -> None:
        if (err := job_error(ev)) is not None:
            raise err

    def answer_error(job: Job, exc: Exception) -> APIError:
        """The 500 of a server error (a bug) in writing ``job``'s answer from its output (the
        reply's parsing, its JSON): logged and counted as a failed generation
        (:meth:`.scheduler.Scheduler.answer_failed`), as one in the decoding is."""
        return APIError(500, f"generation failed: {scheduler.answer_failed(job, exc)}", type="server_error")

    async def guarded(frames: AsyncIterator[str], job: Job, failure) -> AsyncIterator[str]:
        """A stream's ``frames``; a server error in writing them (a bug, after the stream's
        status was sent) ends the stream with ``failure(error)``'s frames (its error event, as
        a failed generation's: :func:`answer_error`), not with a cut connection."""
        try:
            async for frame in frames:
                yield frame
        except Exception as exc:
            for frame in failure(answer_error(job, exc)):
                yield frame
        finally:  # (the stream ends or the client left: the inner stream is closed too)
            await frames.aclose()

    tools_checked: list[bool] = []  # (whether a request with tools was rendered without them too: once per server)

    def prepare(prompts: list, chat: bool, requested: int | None, default: int | None,
                template_kwargs: dict | None, tools: list[dict] | None,
                prompt_options: dict | None = None,
                max_tokens_name: str = "max_tokens", min_tokens: int = 0,
                scoring: bool = False) -> list[tuple[list[int], int, dict]]:
        """``(token ids, max new tokens, ends)`` of each prompt (in a thread: tokenizing
        a long prompt holds neither the engine nor the event loop); ``ends``: ``history_end``,
        the history end of a chat that ends with the opening of the reply (see
        :meth:`DFlashEngine.history_end`), else None, and ``shared_end``, where a chat's leading
        system messages end (:meth:`DFlashEngine.shared_end`, for the batch decoder), else None."""
        vocab = engine.target.config.vocab_size
        if requested is None and default is not None:  # (every prompt's: no prompt named)
            try:
                check_min_tokens_default(min_tokens, default, max_tokens_name)
            except DFlashError as exc:
                raise APIError(400, str(exc), param="min_tokens") from None
        out = []
        for i, prompt in enumerate(prompts):
            try:
                ids = engine.encode_prompt(prompt, chat, template_kwargs, tools, **(prompt_options or {}))
                if tools and not tools_checked:  # (the first request with tools, for a template that drops them)
                    tools_checked.append(True)
                    if engine.tools_left_out(prompt, chat, template_kwargs, tools, ids=ids, **(prompt_options or {})):
                        # (a call is forced only in a format of FORCED_CALL_GRAMMARS; in another, forcing is a 400)
                        forced = (" unless tool_choice forces a call" if tool_calls in FORCED_CALL_GRAMMARS else
                                  f": this server's tool-call format is {tool_calls!r}, so tool_choice 'required' or a "
                                  f"named function, which would force a call, is refused")
                        log.warning("the chat template leaves out a request's tools (it renders the same prompt with "
                                    "and without them): the model is not told of them, and calls none%s (logged once)",
                                    forced)
                if any(not 0 <= t < vocab for t in ids):  # checked for every prompt before any runs
                    raise ParamError(f"prompt token ids must be in [0, {vocab})", "prompt")
                opens_reply = chat and (prompt_options or {}).get("add_generation_prompt", True)
                end = engine.history_end(prompt, ids, chat, template_kwargs, tools) if opens_reply else None
                shared = engine.shared_end(prompt, ids, chat, template_kwargs, tools) if chat else None
                fitted = fit_max_tokens(engine, len(ids), requested, default, max_tokens_name, min_tokens, scoring)
                out.append((ids, fitted, {"history_end": end, "shared_end": shared}))
            except DFlashError as exc:
                param = param_of(exc)
                if chat and param == "prompt":  # (a chat's prompt is its messages, rendered)
                    param = "messages"
                raise APIError(400, about_prompt(str(exc), i) if len(prompts) > 1 else str(exc), param=param,
                               code=getattr(exc, "code", None)) from None
        return out

    def check_sampling(max_new_tokens: int, kwargs: dict, aliases: dict) -> None:
        """The request's sampling and stop values checked as the engine will check them when
        a slot takes it (token ids against the vocabulary too), so that a request that can
        never run is a 400 now, not a 503 "retry" while the queue is full; ``aliases``: the
        request's names of the engine's fields (``structured_output``)."""
        try:
            engine.request_params(max_new_tokens, **{k: v for k, v in kwargs.items() if k != "prompt_logprobs"})
        except DFlashError as exc:
            param = param_of(exc)
            message = str(exc).replace("max_new_tokens", "max_tokens")  # (the request's name of it)
            raise APIError(400, message, param=aliases.get(param, param)) from None

    def compile_constraint(spec, param: str, where: str = "") -> StructuredOutput:
        """``spec`` checked and compiled for the engine (kept in its cache: the sequences'
        own compiles find it there); an error is a 400 about ``param``, the request's field
        (a ``response_format``'s invalid schema: ``response_format.json_schema.schema``, the path
        the message names; ``where``: words after its name in the message)."""
        try:
            structured = StructuredOutput.coerce(spec)
            engine.grammars.compile(structured)
        except DFlashError as exc:
            message = str(exc)
            schema = "structured_output json schema " if message.startswith("structured_output json schema ") \
                else "structured_output json "
            if param == "response_format" and message.startswith(schema):  # (json_schema's: named by its path)
                message = "response_format.json_schema.schema" + where + " " + message[len(schema):]
                param = "response_format.json_schema.schema"  # (param: the path the message names, trial-299 g)
            elif message.startswith("structured_output"):
                message = param + where + message[len("structured_output"):]
            raise APIError(400, message, param=param) from None
        return structured

    @functools.cache
    def think() -> tuple[int | None, int | None]:
        """The tokenizer's one token for ``<think>`` and for ``</think>`` that grammars name by
        id (:func:`think_tokens`)."""
        return think_tokens(engine.tokenizer, engine.grammars.tokenizer())

    @functools.cache
    def call_tokens() -> tuple[int | None, ...]:
        """The tokenizer's one token for each marker of the server's forced calls
        (:data:`.tools.FORCED_CALL_MARKERS`: ``<tool_call>`` and ``</tool_call>``, GLM's
        ``<arg_key>`` ... too), if any (:func:`special_token`)."""
        llg = engine.grammars.tokenizer()
        markers = FORCED_CALL_MARKERS.get(tool_calls, (CALL_OPEN, CALL_CLOSE))
        return tuple(special_token(engine.tokenizer, llg, m) for m in markers)

    @functools.cache
    def parser_markers(with_tools: bool) -> frozenset[int]:
        """The tokens that spell a marker of this chat's reply parsers alone (``<think>`` for
        ``think``, harmony's ``<|channel|>`` ..., ``<tool_call>`` for a request with tools):
        kept in a chat's text when it skips special tokens, so that its reasoning and tool
        calls are still found."""
        markers = {"think": (THINK_OPEN, THINK_CLOSE), "gemma4": (GEMMA4_OPEN, GEMMA4_CLOSE),
                   "harmony": HARMONY_MARKERS}.get(reasoning, ())
        if with_tools and tool_calls in ("hermes", "qwen3_coder"):
            markers += (CALL_OPEN, CALL_CLOSE)
        elif with_tools and tool_calls == "gemma4":
            markers += (GEMMA4_CALL_OPEN, GEMMA4_CALL_CLOSE, GEMMA4_QUOTE)
        elif with_tools and tool_calls in ("glm45", "glm47"):
            markers += GLM_MARKERS
        elif with_tools and tool_calls == "minimax_m2":
            markers += (MINIMAX_CALL_OPEN, MINIMAX_CALL_CLOSE)
        elif with_tools and tool_calls == "kimi_k2":
            markers += KIMI_MARKERS
        elif with_tools and tool_calls == "deepseek_v31":
            markers += DEEPSEEK_MARKERS
        ids = {engine.tokenizer.convert_tokens_to_ids(m) for m in markers}
        return frozenset(i for i in ids if isinstance(i, int) and i in engine.special_token_ids)

    def reply_reasoning(prompt_tail: str) -> str | None:
        """How a chat reply after a prompt ending in ``prompt_tail`` reasons, for its
        constraint (:func:`.constraints.reasoning_start`; the ``think`` format, as
        :class:`~.reasoning.ThinkParser` reads the reply): ``"opened"``, the template opened a
        ``<think>`` the reply continues (Qwen3.5's thinking mode); ``"optional"``, the reply may
        open one (Qwen3's thinking mode: the model writes ``<think>``); None: no reasoning (no
        ``think`` format, not a chat, or the prompt closed one: thinking off)."""
        if reasoning != "think":
            return None
        tail = prompt_tail.rstrip()
        return "opened" if tail.endswith(THINK_OPEN) else None if tail.endswith(THINK_CLOSE) else "optional"

    def tool_call_constraint(req, tools: list[dict], reply: str | None) -> tuple[str, dict]:
        """``(param, structured output)`` of a chat request whose ``tool_choice`` forces calls
        (``required`` or a named function): the grammar of its tools' calls in the server's
        format (:data:`.tools.FORCED_CALL_GRAMMARS`; after the reasoning the template opened or
        the reply may open, ``reply``: :func:`reply_reasoning`); a tool the format cannot
        write is a 400 about ``tools``."""
        name = req.tool_choice.function.name if not isinstance(req.tool_choice, str) else None
        try:
            grammar = FORCED_CALL_GRAMMARS[tool_calls](tools, name, req.parallel_tool_calls is not False, reply,
                                                       think(), call_tokens())
        except DFlashError as exc:
            raise APIError(400, str(exc), param="tools") from None
        return "tools", {"grammar": grammar}

    def compile_tool_calls(req, tools: list[dict], reply: str | None) -> tuple[str, StructuredOutput]:
        """:func:`tool_call_constraint` compiled; a grammar that cannot be is a 400 about
        ``tools.i.function.parameters`` of the first tool whose calls alone cannot be compiled
        (``tools`` where each can be alone), in words
        (:func:`.tools.forced_call_error`: each called tool's grammar compiled alone to find it)."""
        param, spec = tool_call_constraint(req, tools, reply)
        structured = StructuredOutput.coerce(spec)
        try:
            engine.grammars.compile(structured)
        except DFlashError as exc:
            name = req.tool_choice.function.name if not isinstance(req.tool_choice, str) else None

            def failure(tool: dict) -> str | None:
                try:
                    engine.grammars.compile(StructuredOutput(grammar=FORCED_CALL_GRAMMARS[tool_calls](
                        [tool], name, req.parallel_tool_calls is not False, reply, think(), call_tokens())))
                except DFlashError as one:
                    return str(one)
                return None

            message, where = forced_call_error(tools, name, failure, str(exc))
            raise APIError(400, message, param=where) from None
        return param, structured

    def check_tool_call_format(req) -> None:
        if tool_calls not in FORCED_CALL_GRAMMARS:
            raise APIError(400, f"tool_choice {tool_choice_name(req.tool_choice)}"
                                f" needs the hermes, qwen3_coder, glm45, glm47, kimi_k2 or deepseek_v31 tool-call "
                                f"format, which constrained decoding writes; "
                                f"this server's is {tool_calls!r} (--tool-call-parser); use tool_choice 'auto' or 'none'",
                           param="tool_choice", code="unsupported_parameter")

    def request_constraint(req, chat: bool, tools: list[dict] | None, prompt_tail: str) -> tuple[str, StructuredOutput] | None:
        """``(param, compiled structured output)`` of a request (in a thread), None for none:
        its constraint as sent (checked and compiled first: a 400 names its field), with its
        JSON whitespace pattern, and in a chat whose template opened a reasoning (or whose reply
        may open one), after it (:mod:`.constraints`); or the tool calls ``tool_choice`` forces."""
        reply = reply_reasoning(prompt_tail) if chat else None
        if chat and req.forces_tool_calls():
            return compile_tool_calls(req, tools, reply)
        found = req.constraint()
        if found is None:
            return None
        param, spec = found
        structured = compile_constraint(spec, param)
        if (space := req.whitespace_pattern()) is not None:  # (a JSON constraint: conflicting_fields checked)
            field, pattern = space
            try:
                structured = compile_constraint(with_whitespace(structured, pattern), field)
            except APIError as exc:  # (the constraint compiled without it: the pattern's fault)
                name = "structured_outputs.whitespace_pattern" if field == "structured_outputs" else field
                why = exc.message.split(" is invalid: ", 1)[-1].rstrip(": ")
                raise APIError(400, f"{name} {pattern[:80]!r} is not a valid whitespace pattern (a regex): {why}",
                               param=field) from None
        if reply is not None:
            structured = compile_constraint(after_reasoning(structured, reply, think()), param, " after the reasoning")
        return param, structured

    async def run(request: Request, req, prompts: list, chat: bool, default_max_tokens: int | None, kind: str,
                  responses: ResponsesRequest | None = None):
        """Serve ``n`` choices of each prompt of ``prompts`` (choice ``i * n + j`` is the
        ``j``-th of prompt ``i``, sampled with :func:`choice_seed` ``(seed, j)``); ``kind``
        ``responses``: the chat request ``req`` made of ``responses`` (one choice), answered
        as a Response."""
        arrived = time.perf_counter()
        created_at = int(time.time())  # (OpenAI's created: when the request came, streamed or not)
        n = req.n or 1
        room = scheduler.max_batch_size + scheduler.max_queue  # (a request that fits it may wait for it: a 503)
        if n * len(prompts) > room:
            slots, queue = scheduler.max_batch_size, scheduler.max_queue
            raise APIError(400, f"{n * len(prompts)} choices ({_count(len(prompts), 'prompt')} x n={n}) are more than "
                                f"this server holds ({room}: {_count(slots, 'slot')} ({scheduler.slots_why}) and "
                                f"{_count(queue, 'waiting place') if queue else 'no waiting places'} (--max-queue"
                                f"{'' if queue else ' 0'}))", param="n" if len(prompts) == 1 else "prompt")
        template_kwargs, tools = None, None
        if chat:  # (in a thread: thousands of tools take a while to copy)
            template_kwargs, tools = await to_thread(lambda: (req.template_kwargs(default_template_kwargs),
                                                              req.engine_tools()))
        requested = 1 if req.scores_only() else req.requested_max_tokens()  # (scores only: one token, dropped)
        prepared = await to_thread(prepare, prompts, chat, requested, default_max_tokens,
                                   template_kwargs, tools, req.prompt_options() if chat else None,
                                   req.max_tokens_field(), req.min_tokens, req.scores_only())
        prompt_tail = engine.decode(prepared[0][0][-8:]) if chat else ""  # (a chat has one prompt)
        if chat and req.continue_final_message:  # the reply goes on inside a thinking the last message opened
            last = req.messages[-1].text()
            if last.rfind(THINK_OPEN) > last.rfind(THINK_CLOSE):
                prompt_tail = THINK_OPEN
            elif reasoning == "think":  # or inside its answer: no reasoning to open first (reply_reasoning)
                prompt_tail = THINK_CLOSE
        kwargs = req.sampling_kwargs(sampling_defaults)
        if chat and kwargs["skip_special_tokens"] and (reasoning != "none" or tools):
            kwargs["skip_special_tokens"] = parser_markers(bool(tools))  # (all special tokens but the parsers' markers)
        if chat and req.forces_tool_calls():
            check_tool_call_format(req)
        rid = {"chat": "chatcmpl-", "completion": "cmpl-", "responses": "resp_"}[kind] + uuid.uuid4().hex
        job = Job(loop=asyncio.get_running_loop(), stream=bool(req.stream), arrived=arrived, request_id=rid,
                  scores_only=req.scores_only())
        job.param_aliases["max_tokens"] = req.max_tokens_field()  # (max_completion_tokens where that was sent)
        if req.constraint() is not None or (chat and req.forces_tool_calls()):
            param, kwargs["structured_output"] = await to_thread(request_constraint, req, chat, tools, prompt_tail)
            job.param_aliases["structured_output"] = param
        await to_thread(check_sampling, prepared[0][1], kwargs, job.param_aliases)
        if chat and req.forces_tool_calls():
            # a forced reply (its reasoning, if any, then its calls) ends where its constraint ends it, after
            # its last call (EOS): the stop strings and ids, checked above, are not applied, as they would cut
            # a call short or end the reasoning with no call (max_tokens still can cut it: finish "length")
            kwargs.update(stop=None, stop_token_ids=None)
        for ids, max_new_tokens, ends in prepared:
            for j in range(n):
                job.add(ids, max_new_tokens, {**kwargs, "seed": choice_seed(kwargs["seed"], j), **ends})
        try:
            scheduler.submit(job)
        except ShuttingDown:
            raise shutting_down() from None
        except QueueFull as exc:
            if (unlogged := queue_full_log.take()) is not None:
                log.warning("%s: 503 queue_full (%s): %s %s", request.url.path, _count(len(job.sequences), "choice"),
                            exc, queue_full_log.note(unlogged, "dflash_rejected_requests_total"))
            raise APIError(503, str(exc), type="server_error", code="queue_full",
                           headers={"Retry-After": str(exc.retry_after)}) from None
        prompt_tokens = sum(len(ids) for ids, _, _ in prepared)  # once per prompt, whatever n
        scoring = Scoring(req, kind, prompts, prepared, n, engine.decode, engine.special_token_ids)
        try:
            # Wait in the queue, then for the prefill: the first event after the choices' starts (a
            # stream's first chunk, the prefill's token; a non-streamed choice's whole output; or its
            # error), so that a stream's headers go out only then: an error found by then (in its
            # prefill, say) is the request's status, and a client that leaves by then is a 499.
            ev = await next_event(job, request)
            while ev is not None and ev.kind == "start":
                ev = await next_event(job, request)
            if ev is None:
                return client_left(request, job.request_id)
            raise_job_error(ev)
            if ev.kind == "done":  # cancelled before it started
                return client_left(request, job.request_id)
            first = ev  # (handed on: the answer's first event)
            # (a chat has one prompt; its end tells whether the template opened the reasoning; calls
            # are looked for when the model was given tools)
            parsers = None if kind == "completion" else \
                [new_reply_parser(reasoning, tool_calls if tools else "none", prompt_tail, tools,
                                  req.parallel_tool_calls is not False) for _ in job.sequences]
            if parsers is not None and parsers[0] is None:
                parsers = None
            if kind == "responses":
                builder = ResponseBuilder(rid, model_id, responses.echo(req, sampling_defaults, prepared[0][1]),
                                          created_at)
                parser = None if parsers is None else parsers[0]
                if req.stream:
                    def failed(err: APIError) -> list[str]:
                        return [sse_event(builder.error(err.message, err.type, err.param, err.code))]

                    return _JobStreamingResponse(sse(guarded(response_stream(job, first, builder, parser, prompt_tokens,
                                                                             responses), job, failed)), job,
                                                 media_type="text/event-stream",
                                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
                return await response_complete(job, first, request, builder, parser, prompt_tokens)
            if req.stream:
                def failed(err: APIError) -> list[str]:  # (as a stream whose generation failed ends)
                    return [_sse(error_body(err.message, err.type, err.param, err.code)), "data: [DONE]\n\n"]

                frames = stream_events(job, first, req, rid, created_at, kind, prompt_tokens, n, parsers, scoring)
                return _JobStreamingResponse(sse(guarded(frames, job, failed)), job,
                                             media_type="text/event-stream",
                                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return await complete(job, first, request, rid, created_at, kind, prompt_tokens, n, parsers, scoring)
        except Exception as exc:
            job.cancel()
            if isinstance(exc, (APIError, DFlashError)):
                raise
            raise answer_error(job, exc) from None  # (a bug writing the answer: counted, logged, a 500)
        except BaseException:
            job.cancel()
            raise

    async def complete(job: Job, first: Event, request: Request, rid: str, created_at: int, kind: str,
                       prompt_tokens: int, n: int, parsers, scoring: Scoring):
        outs = [{"text": [], "tokens": 0, "finish": None, "stats": None, "logprobs": None, "prompt_logprobs": None}
                for _ in job.sequences]
        left = len(outs)
        async for ev in answer_events(job, first, request):
            if ev is None:
                return client_left(request, job.request_id)
            raise_job_error(ev)
            if ev.kind == "done":
                left -= 1
                if not left:
                    break
            elif ev.kind == "chunk":
                out, chunk = outs[ev.index], ev.value
                if chunk.prompt_logprobs is not None:
                    out["prompt_logprobs"] = chunk.prompt_logprobs
                if chunk.finish_reason is not None:
                    out["finish"], out["stats"] = chunk.finish_reason, chunk.stats
                if scoring.scores_only:  # (the one token decoded is not part of the answer)
                    out["finish"] = "length"
                    if chunk.logprobs is not None:
                        out["logprobs"] = []
                    continue
                out["text"].append(chunk.text)
                out["tokens"] += len(chunk.token_ids)
                if chunk.logprobs is not None:
                    out["logprobs"] = (out["logprobs"] or []) + chunk.logprobs
        n_tokens = sum(out["tokens"] for out in outs)
        usage = _usage(prompt_tokens, n_tokens, _cached_tokens([out["stats"].cached_prompt_tokens for out in outs], n),
                       0 if kind == "chat" else None)
        choices = []
        for i, out in enumerate(outs):
            content, logprobs = "".join(out["text"]), out["logprobs"]
            if kind == "chat":
                logprobs = None if logprobs is None else chat_logprobs(logprobs, token_info)
                message, finish = {"role": "assistant", "content": content}, out["finish"]
                if parsers is not None:
                    reasoning_text, message["content"], calls = parse_reply(parsers[i], content, finish == "stop")
                    thinking = parsers[i].thinking  # (it ended inside its reasoning: cut, or a stop string, there)
                    usage["completion_tokens_details"]["reasoning_tokens"] += _reasoning_tokens(
                        engine.tokenizer, reasoning_text, out["tokens"])
                    if reasoning != "none":  # (no reasoning parser: no such field, as without tools; an empty
                        # reasoning it ended in, "" as the Responses API's empty reasoning item, trial-305 c)
                        message["reasoning_content"] = reasoning_text or ("" if thinking else None)
                    if calls or reasoning_text or thinking:  # (an answer of nothing beside them, or none as it
                        # ended while thinking: null, as vLLM's and as streamed)
                        message["content"] = message["content"] or None
                    if calls:
                        message["tool_calls"] = [call.to_openai() for call in calls]
                        finish = "tool_calls" if finish == "stop" else finish
                choice = {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish}
            else:
                offsets = scoring.text_offsets(i, token_info)
                echoed = scoring.echo_logprobs(i, out["prompt_logprobs"], token_info)
                logprobs = None if logprobs is None else completion_logprobs(logprobs, token_info, offsets)
                choice = {"index": i, "text": scoring.echo_text(i) + content,
                          "logprobs": joined_logprobs(echoed, logprobs), "finish_reason": out["finish"]}
            choice.update(scoring.vllm(i, out["prompt_logprobs"], token_info))
            if len(outs) > 1:
                choice["dflash"] = _stats_summary(out["stats"])
            choices.append(choice)
        body = {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": created_at, "model": model_id, "system_fingerprint": None,
                "choices": choices, "usage": usage,
                "dflash": _stats_summary(outs[0]["stats"]) if len(outs) == 1 else None}
        if kind == "chat" and "prompt_logprobs" in choices[0]:  # (where vLLM's chat responses have them; one prompt)
            body["prompt_logprobs"] = choices[0]["prompt_logprobs"]
        return _JSONResponse(body)

    async def stream_events(job: Job, first: Event, req, rid: str, created_at: int, kind: str, prompt_tokens: int,
                            n: int, parsers, scoring: Scoring):
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        include_usage, continuous_usage = req.include_usage, req.continuous_usage

        def frame(choices, **extra):
            d = {"id": rid, "object": obj, "created": created_at, "model": model_id, "system_fingerprint": None,
                 "choices": choices}
            if continuous_usage:  # (vLLM's continuous_usage_stats: on every chunk, its choice's tokens so far)
                if choices:
                    i = choices[0]["index"]
                    p, c = len(job.sequences[i].prompt_ids), choice_tokens[i]
                else:
                    p, c = prompt_tokens, n_tokens
                d["usage"] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
            elif include_usage:
                d["usage"] = None
            d.update(extra)
            return _sse(d)

        offsets = [scoring.text_offsets(i, token_info) for i in range(len(job.sequences))]  # (legacy text_offset s)
        echoed = [False] * len(job.sequences)  # (echo: each choice's prompt text sent)

        calls_sent = [0] * len(job.sequences)  # (each choice's tool calls so far: the next one's index)

        def empty_part(index: int, role: bool) -> str | None:
            """The delta key of a chat piece with no text: the role's piece's ``content`` (as
            OpenAI's first piece); else its tokens' logprobs alone (their text held back by the
            parser), under the part the reply is in: ``reasoning_content`` while it thinks,
            ``content`` once it answers, neither while that is not known (trial-305 a: a
            client takes a ``content`` for the answer's start)."""
            if role or parsers is None or parsers[index].answering:
                return "content"
            return "reasoning_content" if parsers[index].thinking else None

        def choice(index, text=None, finish=None, role=False, logprobs=None, reasoning_text="", calls=(), prompt=None):
            """A choice's piece; ``logprobs``: the TokenLogprob s of its tokens (None: none asked);
            ``calls``: the tool calls it completes; ``prompt``: its prompt's TokenLogprob s (the
            choice's first piece, when echo or prompt_logprobs asks for them)."""
            extra = {} if prompt is None else scoring.vllm(index, prompt, token_info)
            if kind == "chat":
                delta = {}
                if role:
                    delta["role"] = "assistant"
                if reasoning_text:
                    delta["reasoning_content"] = reasoning_text
                if text:
                    delta["content"] = text
                elif text is not None and not (reasoning_text or calls) and (part := empty_part(index, role)):
                    delta[part] = text
                if calls:
                    delta["tool_calls"] = [{"index": calls_sent[index] + k, **call.to_openai()}
                                           for k, call in enumerate(calls)]
                    calls_sent[index] += len(calls)
                lp = None if logprobs is None else chat_logprobs(logprobs, token_info)
                return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish, **extra}
            prompt_lp = None if prompt is None else scoring.echo_logprobs(index, prompt, token_info)
            lp = None if logprobs is None else completion_logprobs(logprobs, token_info, offsets[index])
            return {"index": index, "text": text or "", "logprobs": joined_logprobs(prompt_lp, lp), "finish_reason": finish,
                    **extra}

        n_tokens, left = 0, len(job.sequences)
        choice_tokens = [0] * left  # (each choice's tokens so far)
        cached = [0] * left  # (each choice's, set as it finishes)
        thoughts = [0] * left  # (each chat choice's reasoning tokens, set as it finishes)
        reasoning_parts: list[list[str]] = [[] for _ in range(left)]  # (each chat choice's reasoning so far)
        if kind == "chat":  # (the role first; content "", or null where tool_choice forces calls: no text can come)
            forced = req.forces_tool_calls()
            for i in range(left):
                first_piece = choice(i, None if forced else "", role=True)
                if forced:
                    first_piece["delta"]["content"] = None  # (as the message of a reply not streamed has it)
                yield frame([first_piece])
        async for ev in answer_events(job, first):
            if ev.kind == "done":
                left -= 1
                if not left:
                    break
                continue
            if (err := job_error(ev)) is not None:  # the status is sent: an error event, then the end
                yield _sse(error_body(err.message, err.type, err.param, err.code))
                yield "data: [DONE]\n\n"
                return
            if ev.kind != "chunk":
                continue
            chunk, i = ev.value, ev.index
            prompt_lps = chunk.prompt_logprobs  # (on a choice's first chunk, when asked)
            if scoring.scores_only:  # (the one token decoded is not part of the answer)
                chunk = StreamChunk("", [], "length" if chunk.finish_reason is not None else None, chunk.stats,
                                    None if chunk.logprobs is None else [])
            if scoring.echo and not echoed[i]:  # (the prompt's text before the completion's)
                echoed[i] = True
                chunk = replace(chunk, text=scoring.echo_text(i) + chunk.text)
            n_tokens += len(chunk.token_ids)
            choice_tokens[i] += len(chunk.token_ids)
            reasoning_text, text, calls = ("", chunk.text, []) if parsers is None else parsers[i].feed(chunk.text)
            reasoning_parts[i].append(reasoning_text)
            # a piece with text (not all held back by a parser: no empty delta), or with tokens whose
            # logprobs were asked for (their text may be held back), or the prompt's logprobs
            piece = bool(text or reasoning_text) or bool(chunk.logprobs) or (
                prompt_lps is not None and (scoring.echo_k is not None or scoring.vllm_k is not None))
            if chunk.finish_reason is None:
                if piece or calls:
                    yield frame([choice(i, text, logprobs=chunk.logprobs, reasoning_text=reasoning_text, calls=calls,
                                        prompt=prompt_lps)])
                continue
            summary = _stats_summary(chunk.stats)
            cached[i] = chunk.stats.cached_prompt_tokens
            if kind == "chat":
                finish = chunk.finish_reason
                if parsers is not None:  # what the parser held back
                    held_reasoning, held, held_calls = parsers[i].finish(finish == "stop")
                    reasoning_text, text, calls = reasoning_text + held_reasoning, text + held, calls + held_calls
                    reasoning_parts[i].append(held_reasoning)
                thoughts[i] = _reasoning_tokens(engine.tokenizer, "".join(reasoning_parts[i]), choice_tokens[i])
                if piece or reasoning_text or text or calls:
                    yield frame([choice(i, text, logprobs=chunk.logprobs, reasoning_text=reasoning_text, calls=calls,
                                        prompt=prompt_lps)])
                if finish == "stop" and calls_sent[i]:
                    finish = "tool_calls"
                yield frame([choice(i, finish=finish)], dflash=summary)
            else:
                yield frame([choice(i, chunk.text, chunk.finish_reason, logprobs=chunk.logprobs, prompt=prompt_lps)],
                            dflash=summary)
        if include_usage:
            yield frame([], usage=_usage(prompt_tokens, n_tokens, _cached_tokens(cached, n),
                                         sum(thoughts) if kind == "chat" else None))
        yield "data: [DONE]\n\n"

    def response_pieces(builder: ResponseBuilder, parser, chunk: StreamChunk, state: dict, prompt_tokens: int) -> list[dict]:
        """The Response events of a chunk of the reply (``state``: the tokens and reasoning so far)."""
        state["tokens"] += len(chunk.token_ids)
        events = []
        if parser is None:
            events += builder.feed("", chunk.text, [])
        else:  # (piece by piece: the output items in the reply's order, text after a call included)
            parts = [parser.feed(piece) for piece in marker_pieces(chunk.text)]
            if chunk.finish_reason is not None:  # what the parser held back
                parts.append(parser.finish(chunk.finish_reason == "stop"))
            for reasoning_text, text, calls in parts:
                state["reasoning"].append(reasoning_text)
                events += builder.feed(reasoning_text, text, calls)
        if chunk.finish_reason is not None:
            reasoning_tokens = _reasoning_tokens(engine.tokenizer, "".join(state["reasoning"]), state["tokens"])
            events += builder.finish(chunk.finish_reason, prompt_tokens, state["tokens"],
                                     chunk.stats.cached_prompt_tokens, reasoning_tokens,
                                     {"dflash": _stats_summary(chunk.stats)}, parser is not None and parser.thinking)
        return events

    async def response_complete(job: Job, first: Event, request: Request, builder: ResponseBuilder, parser,
                                prompt_tokens: int):
        state = {"tokens": 0, "reasoning": []}
        async for ev in answer_events(job, first, request):
            if ev is None:
                return client_left(request, job.request_id)
            if (err := job_error(ev)) is not None:
                raise err  # (named as the Responses API names it by the route, _as_responses)
            if ev.kind == "done":
                break
            if ev.kind == "chunk":
                response_pieces(builder, parser, ev.value, state, prompt_tokens)
        return _JSONResponse(builder.response())

    async def response_stream(job: Job, first: Event, builder: ResponseBuilder, parser, prompt_tokens: int,
                              req: ResponsesRequest):
        state = {"tokens": 0, "reasoning": []}
        for event in builder.start():
            yield sse_event(event)
        async for ev in answer_events(job, first):
            if ev.kind == "done":
                return
            if (err := job_error(ev)) is not None:  # the status is sent: an error event, then the end
                err = _as_responses(err, req)
                yield sse_event(builder.error(err.message, err.type, err.param, err.code))
                return
            if ev.kind == "chunk":
                for event in response_pieces(builder, parser, ev.value, state, prompt_tokens):
                    yield sse_event(event)

    # ---- routes -------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse(request, CompletionRequest)
        return await run(request, req, req.prompts(), False, COMPLETIONS_DEFAULT_MAX_TOKENS, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await parse(request, ChatCompletionRequest)
        messages = await to_thread(req.engine_messages)  # (in a thread: tens of thousands of them take a while)
        return await run(request, req, [messages], True, sampling_defaults.get("max_new_tokens"), "chat")

    @app.post("/v1/responses")
    async def responses(request: Request):
        req = await parse(request, ResponsesRequest)
        chat = req._chat
        messages = await to_thread(chat.engine_messages)  # (in a thread, as a chat's)
        try:
            return await run(request, chat, [messages], True, sampling_defaults.get("max_new_tokens"),
                             "responses", responses=req)
        except APIError as exc:
            exc = _as_responses(exc, req)
            if exc.code == "context_length_exceeded" and exc.param == "input" and req.instructions and \
                    await to_thread(overflows_alone, req.instructions):
                exc.param = "instructions"  # (the field that does not fit, not the input after it)
            raise exc from None

    def overflows_alone(text: str) -> bool:
        """Whether ``text`` (a Responses request's ``instructions``) alone leaves no room in the
        context: more characters than any prompt that fits, or at least as many tokens as the
        context (one must be generated)."""
        return len(text) > engine.max_prompt_chars or \
            len(engine.tokenizer.encode(text, add_special_tokens=False)) >= engine.max_context

    def tokenize_schema(data: dict):
        """The /tokenize request class of a body; the fields it knows that tokenizing does not
        read (the sampling fields, ...) are dropped unchecked, as vLLM ignores them there (those
        it does not know stay, to be logged as ignored). Both a ``prompt`` and ``messages`` are
        refused (which one to tokenize?)."""
        if "messages" in data and "prompt" in data:
            raise APIError(400, "/tokenize takes a prompt or messages, not both", param="messages")
        schema = TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
        for key in (set(data) & known_fields(schema)) - schema.READS:
            del data[key]
        return schema

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's ``/tokenize``: the tokens a completion of ``prompt``, or a chat of
        ``messages``, prefills (the same encoding, chat template and variables)."""
        req = await parse(request, tokenize_schema)
        chat = isinstance(req, TokenizeChatRequest)
        if (bad := req.fixed_option()) is not None:
            raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")
        if chat and req.chat_template is not None:  # (as a chat completion refuses it)
            raise APIError(400, CHAT_TEMPLATE_REFUSED, param="chat_template", code="unsupported_parameter")
        if chat:
            prompt, template_kwargs, tools = await to_thread(lambda: (  # (in a thread, as a chat's)
                req.engine_messages(), req.template_kwargs(default_template_kwargs), req.engine_tools()))
            prompt_options = req.prompt_options()
        else:
            prompts = req.prompts()
            if len(prompts) != 1:
                raise APIError(400, f"/tokenize takes one prompt, got {len(prompts)}", param="prompt")
            prompt, template_kwargs, tools, prompt_options = prompts[0], None, None, {}
        try:
            ids = await to_thread(functools.partial(engine.encode_prompt, **prompt_options, check_length=False),
                                  prompt, chat, template_kwargs, tools)
        except DFlashError as exc:
            raise APIError(400, str(exc), param=param_of(exc)) from None
        vocab = engine.target.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):  # (token ids given as the prompt; as a completion refuses them)
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        if not ids:  # (an empty text: a completion refuses it)
            raise APIError(400, "the prompt is empty (0 tokens)", param="prompt")
        strs = engine.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.max_context, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's ``/detokenize``: the text of ``tokens`` (ids in the vocabulary)."""
        req = await parse(request, DetokenizeRequest)
        vocab = engine.target.config.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"tokens must be token ids in [0, {vocab})", param="tokens")
        return {"prompt": engine.decode(req.tokens)}

    # (GET routes answer HEAD too, as load balancers' probes send it; left out of the OpenAPI schema, where a
    # route of two methods repeats its operation id: FastAPI's "Duplicate Operation ID" warning)
    @app.api_route("/v1/models", methods=["GET", "HEAD"], include_in_schema=False)
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                            "owned_by": "dflash-torch", "max_model_len": engine.max_context}]}

    @app.api_route("/v1/models/{name:path}", methods=["GET", "HEAD"], include_in_schema=False)
    async def model(name: str):
        if name != model_id:
            raise APIError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")
        return {"id": model_id, "object": "model", "created": created, "owned_by": "dflash-torch",
                "max_model_len": engine.max_context}

    @app.api_route("/health", methods=["GET", "HEAD"], include_in_schema=False)
    async def health():
        """200 ``{"status": "ok", "model": ...}`` while requests can be served; 503
        ``{"status": "unavailable", "model": ..., "reason": ...}`` once they cannot (the
        scheduler's decoding loop has ended: :meth:`.scheduler.Scheduler.unavailable`). Once the
        server shuts down or drains, every request, this one too, is a 503 ``server_shutting_down``."""
        reason = scheduler.unavailable()
        if reason is not None:
            return JSONResponse({"status": "unavailable", "model": model_id, "reason": reason}, status_code=503)
        return {"status": "ok", "model": model_id}

    @app.api_route("/metrics", methods=["GET", "HEAD"], include_in_schema=False)
    async def metrics_endpoint():
        metrics.event_loop_tasks.set(len(asyncio.all_tasks()))
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    return app
