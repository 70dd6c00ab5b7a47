"""The engine's single worker thread and the jobs it runs.

The engine is synchronous and runs one sequence at a time, so every generation runs
as one job on a single-thread executor: jobs wait their turn in the executor's FIFO
queue (the engine runs each round on its compute thread, see :mod:`dflash_torch.compute`).
A job arrives tokenized and checked against the context (:func:`fit_max_tokens`: the
app does both before it queues the job, so a long prompt never holds the engine) and
runs :meth:`DFlashEngine.generate` (the whole generation one call on the compute thread,
no hand-off per round), whose chunk callback hands each chunk to the request's asyncio
queue (a request that does not stream gets its whole output in one event: the event
loop wakes once, not once per round, and leaves the cores to the decoding). A request
that goes away sets the job's ``cancelled`` event: a waiting job is skipped, a running
one stops after the current round, which frees the engine for the next job.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..engine import StreamChunk
from ..errors import DFlashError
from .metrics import ServerMetrics

log = logging.getLogger("dflash_torch.serving")

# The request parameter an engine error message is about, from its first word.
_PARAM_OF_MESSAGE = {"stop token ids": "stop_token_ids", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "seed": "seed",
                     "stop": "stop", "max_new_tokens": "max_tokens", "prompt": "prompt", "the prompt": "prompt",
                     "chat messages": "messages"}


class ParamError(DFlashError):
    """A user error about one request parameter."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


def param_of(exc: DFlashError) -> str | None:
    if isinstance(exc, ParamError):
        return exc.param
    msg = str(exc)
    for prefix, param in _PARAM_OF_MESSAGE.items():
        if msg.startswith(prefix + " ") or msg.startswith(prefix + "("):
            return param
    return None


class ShuttingDown(Exception):
    """The server is shutting down: no new jobs."""


class _Cancelled(Exception):
    """Raised by a job's chunk callback: its request went away."""


@dataclass
class Event:
    """What a job reports: ``start`` (prompt_tokens), ``chunk`` (a StreamChunk),
    ``error`` (a user error: ``(message, param)``), ``fatal`` (a server error: message),
    ``unavailable`` (the server is shutting down), ``done``."""

    kind: str
    value: object = None


def fit_max_tokens(engine, prompt_tokens: int, requested: int | None, default: int | None) -> int:
    """Tokens to generate for a prompt of ``prompt_tokens``: ``requested``, else ``default``
    cut to the context, else the whole rest of the context.

    Raises:
        ParamError: an empty prompt, or a prompt (+ ``requested``) that does not fit.
    """
    if prompt_tokens == 0:  # (engine.stream([]) would read [] as an empty chat conversation)
        raise ParamError("the prompt is empty (0 tokens)", "prompt")
    room = engine.max_context - prompt_tokens
    if room < 1:
        raise ParamError(f"the prompt ({prompt_tokens} tokens) does not fit the model's context of "
                         f"{engine.max_context} tokens (at least one token must be generated)", "prompt")
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise ParamError(f"max_tokens ({requested}) + the prompt ({prompt_tokens} tokens) exceed the model's "
                         f"context of {engine.max_context} tokens; use at most {room}", "max_tokens")
    return requested


@dataclass(eq=False)
class GenerationJob:
    prompt_ids: list[int]
    max_new_tokens: int
    kwargs: dict                       # sampling / stop arguments of engine.stream
    loop: asyncio.AbstractEventLoop
    stream: bool = True                # False: one chunk event with the whole output
    arrived: float = field(default_factory=time.perf_counter)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    last_disconnect_check: float = field(default_factory=time.monotonic)

    def cancel(self) -> None:
        self.cancelled.set()

    def put(self, kind: str, value: object = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, Event(kind, value))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled.set()


class EngineWorker:
    """Runs :class:`GenerationJob` s one at a time on a dedicated thread."""

    def __init__(self, engine, metrics: ServerMetrics):
        self.engine, self.metrics = engine, metrics
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-engine")
        self._jobs: set[GenerationJob] = set()
        self._jobs_lock = threading.Lock()
        self.closed = False

    def submit(self, job: GenerationJob) -> None:
        """Queue ``job``.

        Raises:
            ShuttingDown: after :meth:`shutdown`.
        """
        with self._jobs_lock:
            if self.closed:
                raise ShuttingDown()
            self._jobs.add(job)
        self.metrics.queue_depth.inc()
        self.executor.submit(self._run, job)

    def shutdown(self) -> None:
        """Refuse new jobs and end every job now: each gets an ``unavailable`` event at once
        (its request answers without waiting for the engine); a waiting job is dropped, a
        running one stops after its current round. Idempotent."""
        with self._jobs_lock:
            self.closed = True
            jobs = list(self._jobs)
        for job in jobs:
            job.cancel()
            job.put("unavailable")
        self.executor.shutdown(wait=False, cancel_futures=True)

    def _run(self, job: GenerationJob) -> None:
        try:
            if job.cancelled.is_set():  # the client left while it waited
                self.metrics.cancelled.inc()
            else:
                self._generate(job)
        except DFlashError as exc:
            job.put("error", (str(exc), param_of(exc)))
        except Exception as exc:  # a bug, not the user's input: report a 500
            log.exception("generation failed")
            job.put("fatal", f"{type(exc).__name__}: {exc}")
        finally:
            with self._jobs_lock:
                self._jobs.discard(job)
            self.metrics.queue_depth.dec()
            job.put("done")

    def _generate(self, job: GenerationJob) -> None:
        ids = job.prompt_ids
        text, token_ids = [], []  # a non-streamed request's output so far
        seen = {"start": False, "token": False}

        def on_chunk(chunk: StreamChunk) -> None:  # on the engine's compute thread, as rounds commit
            if not seen["start"]:  # the engine validated the request: it has started
                seen["start"] = True
                job.put("start", len(ids))
                self.metrics.prompt_tokens.inc(len(ids))
            if chunk.token_ids:
                self.metrics.generated_tokens.inc(len(chunk.token_ids))
                if not seen["token"]:
                    seen["token"] = True
                    self.metrics.ttft.observe(time.perf_counter() - job.arrived)
            if chunk.stats is not None:
                self.metrics.observe_rounds(list(chunk.stats.acceptance_lengths))
            if job.stream:
                job.put("chunk", chunk)
            else:  # one event (one wake-up of the event loop) for the whole output
                text.append(chunk.text)
                token_ids.extend(chunk.token_ids)
                if chunk.finish_reason is not None:
                    job.put("chunk", StreamChunk("".join(text), token_ids, chunk.finish_reason, chunk.stats))
            if job.cancelled.is_set() and chunk.finish_reason is None:
                raise _Cancelled()  # stops the generation after this round

        try:  # the whole generation is one call on the compute thread: no hand-off per round
            self.engine.generate(ids, on_chunk=on_chunk, max_new_tokens=job.max_new_tokens, **job.kwargs)
        except _Cancelled:
            self.metrics.cancelled.inc()
