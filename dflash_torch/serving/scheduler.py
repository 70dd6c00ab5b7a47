"""The request scheduler between the HTTP handlers and the engine.

A request becomes a :class:`Job` of one or more :class:`Sequence` s, one per choice (each
prompt of a list, times ``n``). A job arrives tokenized and checked against the context
(:func:`fit_max_tokens`: the app does both before it submits, so a long prompt never
holds the engine). Its sequences wait in one FIFO queue and run in a batch of at most
``max_batch_size`` slots:

- :meth:`Scheduler.submit` takes a job only when all its sequences fit in the free slots
  plus ``max_queue`` waiting places, and raises :class:`QueueFull` at once otherwise (the
  server answers 503 with ``Retry-After``): a request never waits behind a full queue.
- One scheduler thread drives the engine. While sequences wait or run, it runs
  :meth:`Scheduler._drive` on the process's compute thread (:mod:`dflash_torch.compute`:
  one call for as long as there is work, no hand-off per round), which loops: admit
  waiting sequences into free slots (``backend.add``), run one decoding round of every
  running sequence and the next chunk of the prompts being prefilled (``backend.step``), hand each sequence's committed chunk to its
  request's asyncio queue as the round commits it, and free the slot of every sequence
  that finished or whose request went away (``backend.remove``) before the next round.
- An ``add`` or ``step`` that built graphs (a compiled engine: a round or prefill past
  the buckets the start-up warm-up built; torch's count of the graphs it built grew) is logged in
  one warning line when it ends (what it ran: a round's sequences, rows and keys; its
  seconds, while every stream waited) and counted in ``dflash_serving_compiles_total`` and
  ``dflash_serving_compile_seconds_total``.
- A request that goes away (:meth:`Job.cancel`) leaves the waiting queue at once; its
  running sequences (prefilling ones too) stop after the current step (a step that only
  prefills ends after the current prefill chunk).

The backend
-----------
The scheduler drives the engine through a *backend*: ``max_batch_size`` (int, the slots),
``prefill_tokens`` (int, prompt tokens the engine has read so far), ``reused_prefill_tokens``
(int, prompt tokens it took from retained prefixes instead), ``target_only_rounds`` (int,
rounds run without drafts above the engine's ``draft_max_batch_size`` or by its
``"auto"`` policy), ``compiled_what(step)`` (str: what the last ``add`` (``step`` False) or
``step`` ran, for the log line of one that built graphs) and three methods, all
called on the compute thread:

``add(seq)``
    take ``seq`` (a :class:`Sequence`: ``prompt_ids``, ``max_new_tokens``, ``kwargs``,
    the sampling and stop arguments of :meth:`DFlashEngine.stream`, seed included, ``logprobs``
    and ``prompt_logprobs`` optional) into a
    free slot to be prefilled (now, or by the next steps); raises
    :class:`~dflash_torch.DFlashError` for a request the engine refuses (the slot stays free).
``step()``
    one decoding round of every added sequence whose prefill is done (and, batched, the
    next chunk of the prompts still being prefilled): a list of ``(seq, StreamChunk)``,
    one per sequence that committed tokens (a prefill's first token included), with the stopping already applied (text cut at a stop
    string, ``finish_reason`` and ``stats`` on a sequence's last chunk, exactly as
    :meth:`DFlashEngine.stream` yields them). A sequence whose chunk has a
    ``finish_reason`` has left the backend (its slot is free).
``remove(seq)``
    drop an unfinished sequence (its client went away), freeing its slot.

:class:`SerialBackend` runs an engine that decodes one sequence at a time (one slot)
through :meth:`DFlashEngine.stream`; :class:`BatchedBackend` runs the slots of an engine
with a step-level batch decoder (``DFlashEngine.batch_decoder()``: ``join`` / ``step`` /
``remove`` of ids, one :class:`~dflash_torch.decoding.Round` per sequence per step):
a joining prompt is prefilled in chunks between rounds (``prefill_budget`` tokens per
step), so the running streams never wait for a whole long prompt, and the choices of one
prompt (``n`` > 1), admitted one after the other, share that prompt's prefill.
:func:`make_backend` picks one.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from .. import compute
from ..decoding import graphs_built
from ..engine import StreamChunk
from ..errors import CompileError, ContextLengthError, DFlashError, OptionError
from ..options import check_min_tokens_room, n_tokens
from .metrics import ServerMetrics

log = logging.getLogger("dflash_torch.serving")

RETRY_AFTER_S = 1  # the Retry-After of the 503s: a full queue, a server shutting down (or draining)

# The request parameter an engine error message is about, from its first word.
_PARAM_OF_MESSAGE = {"stop token ids": "stop_token_ids", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "seed": "seed",
                     "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                     "repetition_penalty": "repetition_penalty", "logit_bias": "logit_bias", "min_tokens": "min_tokens",
                     "stop": "stop", "max_new_tokens": "max_tokens", "prompt": "prompt", "the prompt": "prompt",
                     "chat messages": "messages", "chat_template_kwargs": "chat_template_kwargs", "tools": "tools",
                     "tool call arguments": "messages", "ignore_eos": "ignore_eos",
                     "continue_final_message": "continue_final_message",
                     # (the app names its request's field: Job.param_aliases)
                     "structured_output": "structured_output", "structured output": "structured_output"}


class ParamError(DFlashError):
    """A user error about one request parameter."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # (pickled with its param, as OptionError)
        return type(self), (str(self), self.param), self.__dict__


class ContextParamError(ParamError, ContextLengthError):
    """A request parameter (the prompt, ``max_tokens``) that makes the request not fit the
    model's context (code ``context_length_exceeded``)."""


def param_of(exc: DFlashError) -> str | None:
    if isinstance(exc, ParamError):
        return exc.param
    if isinstance(exc, OptionError) and exc.name in _PARAM_OF_MESSAGE:  # (the option it names, however it reads)
        return _PARAM_OF_MESSAGE[exc.name]
    msg = str(exc)
    for prefix, param in _PARAM_OF_MESSAGE.items():
        if msg.startswith((prefix + " ", prefix + "(", prefix + ":")):
            return param
    return None


class ShuttingDown(Exception):
    """The server is shutting down: no new jobs."""


class QueueFull(Exception):
    """The slots and the waiting places cannot take the job now; retry after ``retry_after`` seconds.

    ``held`` sequences run or wait; waiting ones take a free slot first, so the message
    counts them as the busy slots and then the taken waiting places. ``slots_why``: what
    set the number of slots (the backend's ``slots_why``)."""

    def __init__(self, held: int, asked: int, max_batch_size: int, max_queue: int, retry_after: int = RETRY_AFTER_S,
                 slots_why: str = "--max-batch-size"):
        busy = min(held, max_batch_size)
        waiting = (f"{held - busy} of {max_queue} waiting places taken (--max-queue)" if max_queue
                   else "no waiting places (--max-queue 0)")
        state = f"{busy} of {max_batch_size} slots busy ({slots_why}) and {waiting}; retry in {retry_after} s"
        if asked == 1:
            super().__init__(f"the server is full: {state}")
        else:
            super().__init__(f"the server has no room for this request's {asked} choices now: {state}")
        self.retry_after = retry_after


def check_slots(value, name: str, minimum: int = 1) -> int:
    """``--max-batch-size`` / ``--max-queue``: an integer >= ``minimum`` (1; the queue's 0:
    no waiting places).

    Raises:
        DFlashError: anything else (``name`` is the option's name in the message).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise DFlashError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The sampling seed of choice ``choice`` (0-based, within one prompt) of a request with ``seed``.

    Choice 0 uses ``seed`` itself (so ``n=1`` samples as before); choice ``j > 0`` uses the
    BLAKE2b digest (digest size 8) of the ASCII text ``f"{seed}/{j}"`` read as a little-endian
    integer, its top bit cleared (a seed in ``[0, 2**63)``, which the API accepts). Each choice
    thus has its own random stream, reproducible from the request's seed, and samples exactly
    as a request of ``n=1`` with its derived seed. No seed: None (every
    choice draws its own nondeterministic seed).
    """
    if seed is None or choice == 0:
        return seed
    return int.from_bytes(hashlib.blake2b(f"{seed}/{choice}".encode(), digest_size=8).digest(), "little") & (2**63 - 1)


def fit_max_tokens(engine, prompt_tokens: int, requested: int | None, default: int | None,
                   name: str = "max_tokens", min_tokens: int = 0, scoring: bool = False) -> int:
    """Tokens to generate for a prompt of ``prompt_tokens``: ``requested`` (the request's
    field ``name``), else ``default`` cut to the context, else the whole rest of the context.
    ``scoring``: the request scores its prompt only (``max_tokens`` 0: one token decoded, dropped).

    Raises:
        ParamError: an empty prompt, a prompt (+ ``requested``) that does not fit.
        OptionError: with no ``requested``, a ``min_tokens`` above the tokens the prompt
            leaves (:func:`~dflash_torch.options.check_min_tokens_room`; named as such: the cut
            default is no value the client sent; one above ``default`` itself is refused
            before any prompt is read).
    """
    if prompt_tokens == 0:  # (engine.stream([]) would read [] as an empty chat conversation)
        raise ParamError("the prompt is empty (0 tokens)", "prompt")
    room = engine.max_context - prompt_tokens
    if room < 1:
        why = ("scoring a prompt takes a position more: at most " + n_tokens(engine.max_context - 1) if scoring
               else "at least one token must be generated")
        raise ContextParamError(f"the prompt ({n_tokens(prompt_tokens)}) does not fit the model's context of "
                                f"{engine.max_context} tokens ({why})", "prompt")
    if requested is None:
        check_min_tokens_room(min_tokens, prompt_tokens, engine.max_context)
        return room if default is None else min(default, room)
    if requested > room:
        raise ContextParamError(f"{name} ({requested}) + the prompt ({n_tokens(prompt_tokens)}) exceed the model's "
                         f"context of {engine.max_context} tokens; use at most {room}", name)
    return requested


@dataclass
class Event:
    """What a job reports about its choice ``index``: ``start`` (prompt tokens), ``chunk``
    (a StreamChunk), ``error`` (a user error: ``(message, param)``), ``fatal`` (a server
    error: message), ``unavailable`` (the server is shutting down), ``done`` (the choice
    ended, however: one per choice, always last)."""

    kind: str
    value: object = None
    index: int = 0


@dataclass(eq=False)
class Sequence:
    """One choice of a job: what the engine decodes as one sequence."""

    job: Job
    index: int                         # the choice's index in the response
    prompt_ids: list[int]
    max_new_tokens: int
    kwargs: dict                       # arguments of engine.stream: sampling, stop, seed, history_end; shared_end
    got_token: bool = False
    text: list[str] = field(default_factory=list)       # a non-streamed choice's output so far
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)        # (TokenLogprob, when kwargs asks for them)
    prompt_logprobs: list | None = None                 # (its first chunk's, when kwargs asks for them)


@dataclass(eq=False)
class Job:
    """One request: its sequences and the asyncio queue that gets their events."""

    loop: asyncio.AbstractEventLoop
    stream: bool = True                # False: one chunk event per choice, with its whole output
    arrived: float = field(default_factory=time.perf_counter)
    sequences: list[Sequence] = field(default_factory=list)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    last_disconnect_check: float = field(default_factory=time.monotonic)
    scheduler: Scheduler | None = None
    unfinished: int = 0                # sequences without their ``done`` event yet
    # an engine error's param -> the request's field it stands for (structured_output -> response_format)
    param_aliases: dict[str, str] = field(default_factory=dict)
    request_id: str = ""               # the id its response carries (``chatcmpl-...``), for the log
    scores_only: bool = False          # it scores its prompt only: the one token decoded is dropped, not generated
    failed: bool = False               # a choice failed on a server error (counted once per job)

    def add(self, prompt_ids: list[int], max_new_tokens: int, kwargs: dict) -> Sequence:
        """Append a choice (its index is the number of choices before it)."""
        seq = Sequence(self, len(self.sequences), prompt_ids, max_new_tokens, kwargs)
        self.sequences.append(seq)
        return seq

    def cancel(self) -> None:
        """The request went away (or ended): drop its waiting sequences now, stop its
        running ones after the current round. Idempotent."""
        if self.scheduler is not None:
            self.scheduler.cancel(self)
        else:
            self.cancelled.set()

    def put(self, kind: str, value: object = None, index: int = 0) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, Event(kind, value, index))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled.set()


class SerialBackend:
    """One slot over :meth:`DFlashEngine.stream` (an engine that decodes one sequence at a time).

    The caches of one sequence of the engine's context, to which a request may grow them,
    must fit the device (:meth:`~dflash_torch.decoding.SpeculativeDecoder.check_context_fits`),
    so that caches that cannot fit are refused when the server starts rather than in every
    request that leaves out ``max_tokens``, as the batched backend's are.

    Raises:
        DFlashError: those caches do not fit the device (an
            :class:`~dflash_torch.errors.OptionError` naming ``max_context``).
    """

    max_batch_size = 1

    def __init__(self, engine, slots_why: str = "--max-batch-size"):
        compute.run(engine.decoder.check_context_fits)
        self.engine = engine
        self.slots_why = slots_why  # (why one slot, for the server's messages)
        self.prefill_tokens = 0
        self.reused_prefill_tokens = 0
        self.target_only_rounds = 0  # (nor a batch to stop drafting for)
        self.seq: Sequence | None = None
        self._chunks = None
        self._first: StreamChunk | None = None  # the prefill's chunk, returned by the next step
        self._context = 0  # tokens of the sequence held (prompt + generated)
        self._round_at = 0  # its tokens when the last step's round began

    def compiled_what(self, step: bool) -> str:
        """What the last :meth:`add` (its prefill) or :meth:`step` (a round) ran (see the module docstring)."""
        if not step:
            return f"the prefill of a {self._context}-token prompt"
        n, decoder = self._round_at, self.engine.decoder
        keys = decoder.kv_bucket(n - 1 + decoder.block_size) if decoder.static else n
        return f"a round of the one sequence at {n} tokens of context ({keys} keys)"

    def add(self, seq: Sequence) -> None:
        """Prefill ``seq`` now; one whose request goes away meanwhile stops after the current
        prefill chunk and is not held (the scheduler then ends it)."""
        from ..decoding import PrefillStopped

        assert self.seq is None, "the serial backend has one slot"
        decoder = self.engine.decoder
        kwargs = {k: v for k, v in seq.kwargs.items() if k != "shared_end"}  # (the batch decoder's only)
        chunks = self.engine.stream(seq.prompt_ids, max_new_tokens=seq.max_new_tokens, **kwargs)
        read, reused = decoder.prefill_tokens, decoder.reused_prefill_tokens
        decoder.stop_prefill = seq.job.cancelled.is_set
        self._context = len(seq.prompt_ids)
        try:
            first = next(chunks)  # checks the request, then prefills
        except PrefillStopped:
            chunks.close()
        except BaseException:
            chunks.close()
            raise
        else:
            self.seq, self._chunks, self._first = seq, chunks, first
        finally:
            decoder.stop_prefill = None
            self.prefill_tokens += decoder.prefill_tokens - read
            self.reused_prefill_tokens += decoder.reused_prefill_tokens - reused  # (the last request's rows)

    def step(self) -> list[tuple[Sequence, StreamChunk]]:
        seq = self.seq
        if seq is None:
            return []
        if self._first is not None:
            chunk, self._first = self._first, None
        else:
            self._round_at = self._context
            try:
                chunk = next(self._chunks)
            except BaseException:
                self.remove(seq)
                raise
        self._context += len(chunk.token_ids)
        if chunk.finish_reason is not None:
            self.remove(seq)
        return [(seq, chunk)]

    def remove(self, seq: Sequence) -> None:
        if seq is self.seq:
            chunks, self.seq, self._chunks, self._first = self._chunks, None, None, None
            chunks.close()  # frees the engine


class BatchedBackend:
    """``max_batch_size`` slots of the engine's step-level batch decoder
    (:meth:`DFlashEngine.batch_decoder`), each sequence with its own stopper and stats.

    The batch decoder (its caches) is built here, so that caches that cannot fit are
    refused when the server starts rather than in every request.

    Raises:
        DFlashError: the engine's batch caches do not fit the device.
    """

    def __init__(self, engine, max_batch_size: int):
        self.engine = engine
        self.max_batch_size = min(max_batch_size, engine.max_batch_size)
        self.slots_why = ("--max-batch-size" if self.max_batch_size == max_batch_size
                          else "the engine's max_batch_size")  # (for the server's messages)
        compute.run(engine.batch_decoder)
        self._state: dict[Sequence, tuple] = {}  # seq -> (stats, stopper)

    def add(self, seq: Sequence) -> None:
        from ..engine import GenerationStats

        e = self.engine
        kwargs = dict(seq.kwargs)
        prompt_logprobs, history_end = kwargs.pop("prompt_logprobs", None), kwargs.pop("history_end", None)
        shared_end = kwargs.pop("shared_end", None)
        params, stopper = e.request_params(seq.max_new_tokens, **kwargs)  # (checked as engine.stream checks them)
        stopper.start(seq.prompt_ids)
        stats = GenerationStats(prompt_tokens=len(seq.prompt_ids), block_size=e.block_size,
                                draft_mode=e.decoder.draft_mode if e.drafter is not None else None)
        # (prefilled by the steps; with prompt_logprobs, read whole: see dflash_torch.batch)
        e.batch_decoder().join(seq, seq.prompt_ids, params, stopper.max_new_tokens, prompt_logprobs, history_end,
                               shared_end)
        self._state[seq] = (stats, stopper)

    @property
    def prefill_tokens(self) -> int:
        return self.engine.batch_decoder().prefill_tokens

    @property
    def reused_prefill_tokens(self) -> int:
        return self.engine.batch_decoder().reused_prefill_tokens

    @property
    def target_only_rounds(self) -> int:
        return self.engine.batch_decoder().target_only_rounds

    def compiled_what(self, step: bool) -> str:
        """What the last :meth:`step` ran: its decoding round's shape (the batch decoder's
        :attr:`~dflash_torch.batch.BatchDecoder.last_round`; an :meth:`add` runs nothing)."""
        r = self.engine.batch_decoder().last_round
        if not step or r is None:
            return "a step"
        kind = "a target-only round" if r.block == 1 < self.engine.block_size else "a round"
        return (f"{kind} of {r.sequences} sequence{'s' if r.sequences > 1 else ''} "
                f"({r.rows} row{'s' if r.rows > 1 else ''}, {r.keys} keys)")

    def step(self) -> list[tuple[Sequence, StreamChunk | DFlashError]]:
        """Each sequence's chunk of one batch round, or the error that ends that sequence alone
        (its structured-output constraint failed: :attr:`Round.error`); it is out of the batch.
        A step without a round stops reading a prompt after the chunk in which a request
        went away (the scheduler then frees its slot), not at the prompt's end."""
        out = []
        for seq, rnd in self.engine.batch_decoder().step(stop=self._cancelled).items():
            try:
                out.append(self._chunk(seq, rnd))
            except DFlashError as exc:
                self.remove(seq)
                out.append((seq, exc))
        return out

    def _cancelled(self) -> bool:
        return any(seq.job.cancelled.is_set() for seq in self._state)

    def _chunk(self, seq: Sequence, rnd) -> tuple[Sequence, StreamChunk]:
        stats, stopper = self._state[seq]
        chunk = self.engine.record_round(rnd, stats, stopper)
        if chunk.finish_reason is not None:
            self.remove(seq)
        return seq, chunk

    def remove(self, seq: Sequence) -> None:
        if self._state.pop(seq, None) is not None:
            self.engine.batch_decoder().remove(seq)


def make_backend(engine, max_batch_size: int):
    """The backend that runs ``engine`` with at most ``max_batch_size`` slots.

    :class:`BatchedBackend` (``min(max_batch_size, engine.max_batch_size)`` slots) for an
    engine with a batch decoder (pure-attention and hybrid targets), else (also for an
    engine that is not ``batched``: ``draft_mode="recompute"``) :class:`SerialBackend` (one slot).
    Its ``slots_why`` says what set the number of slots, for the server's messages.

    Raises:
        DFlashError: ``max_batch_size`` not an integer >= 1, or caches that do not fit (the
            batch caches; one slot: those of one sequence of the engine's context).
    """
    check_slots(max_batch_size, "max_batch_size")
    if max_batch_size == 1:
        return SerialBackend(engine)
    if not hasattr(engine, "batch_decoder"):
        return SerialBackend(engine, "the engine decodes one sequence at a time")
    if not getattr(engine, "batched", True):
        return SerialBackend(engine, "--draft-mode recompute decodes one sequence at a time")
    return BatchedBackend(engine, max_batch_size)


class Scheduler:
    """Runs :class:`Job` s on a backend; see the module docstring.

    Args:
        backend: see the module docstring (e.g. :func:`make_backend`).
        metrics: the app's :class:`ServerMetrics`.
        max_queue: waiting sequences beyond the free slots (>= 0; 0: a job is taken only
            when free slots hold all its sequences).

    Raises:
        DFlashError: ``max_queue`` is not an integer >= 0.
    """

    def __init__(self, backend, metrics: ServerMetrics, max_queue: int = 64):
        self.backend, self.metrics = backend, metrics
        self.max_batch_size = check_slots(backend.max_batch_size, "max_batch_size")
        self.max_queue = check_slots(max_queue, "max_queue", minimum=0)
        self.slots_why = getattr(backend, "slots_why", "--max-batch-size")  # (what set max_batch_size)
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # only the drive loop changes it
        self._jobs: set[Job] = set()
        # (what the backend had read and reused: the metrics count from here)
        self._prefill_tokens, self._reused_tokens = backend.prefill_tokens, backend.reused_prefill_tokens
        self._target_only_rounds = backend.target_only_rounds
        self.closed = False
        self._thread = threading.Thread(target=self._loop, name="dflash-scheduler", daemon=True)
        self._thread.start()

    # ---- the event loop's side ---------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue every sequence of ``job``, or none.

        Raises:
            ShuttingDown: after :meth:`shutdown`, or once the scheduler thread has ended
                (:meth:`unavailable`).
            QueueFull: its sequences do not fit the free slots plus ``max_queue`` waiting places.
        """
        with self._cond:
            if self.unavailable() is not None:
                raise ShuttingDown()
            held = len(self._waiting) + len(self._running)
            if held + len(job.sequences) > self.max_batch_size + self.max_queue:
                self.metrics.rejected.inc()
                raise QueueFull(held, len(job.sequences), self.max_batch_size, self.max_queue,
                                slots_why=self.slots_why)
            job.scheduler, job.unfinished = self, len(job.sequences)
            self._jobs.add(job)
            self._waiting.extend(job.sequences)
            self._update_gauges()
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """See :meth:`Job.cancel`."""
        with self._cond:
            if job.cancelled.is_set():
                return
            job.cancelled.set()
            dropped = [s for s in self._waiting if s.job is job]
            if dropped:
                self._waiting = deque(s for s in self._waiting if s.job is not job)
                self._update_gauges()
        for seq in dropped:
            self.metrics.cancelled.inc()
            self._done(seq)

    def shutdown(self) -> None:
        """Refuse new jobs and end every job now: each gets an ``unavailable`` event at once
        (its request answers without waiting for the engine); waiting sequences are dropped,
        running ones stop after the current round. Idempotent."""
        with self._cond:
            self.closed = True
            jobs = list(self._jobs)
            dropped = list(self._waiting)
            self._waiting.clear()
            self._update_gauges()
            self._cond.notify_all()
        for job in jobs:
            job.cancelled.set()
            job.put("unavailable")
        for seq in dropped:
            self._done(seq)

    def close(self) -> None:
        """:meth:`shutdown`, then wait until the engine is idle: the running round (or prefill)
        finishes and the scheduler thread ends. A process must not exit before: its interpreter
        would stop the compute thread inside a torch op, which aborts the process."""
        self.shutdown()
        self._thread.join()

    def unavailable(self) -> str | None:
        """Why no new job can run (the server's ``/health`` says it), None while they can: after
        :meth:`shutdown`, or once the scheduler thread has ended (the process is exiting: its
        compute thread takes no more work), when :meth:`submit` refuses every job."""
        if self.closed:
            return "the server is shutting down"
        if not self._thread.is_alive():
            return "the server's decoding loop has ended (the process is exiting)"
        return None

    def open_jobs(self) -> int:
        """Jobs with a sequence that has not ended (the leak check of the tests)."""
        with self._cond:
            return len(self._jobs)

    # ---- the scheduler thread ----------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self.closed:
                    self._cond.wait()
                if not self._waiting:  # closed
                    return
            try:
                compute.run(self._drive)
            except SystemExit:  # (the process exits while a daemon thread runs the server: compute._stop)
                return
            except BaseException as exc:  # (a bug: _drive reports every failure of a request to it)
                try:
                    compute.run(self._abandon, exc)
                except SystemExit:
                    return
                except BaseException:
                    log.exception("the scheduler's decoding loop failed")

    # ---- the compute thread ------------------------------------------------------------
    def _abandon(self, exc: BaseException) -> None:
        """A bug escaped :meth:`_drive`: end each running sequence with it (its request's 500,
        logged with the traceback) and free its slot; the scheduler then serves on. Without
        this, those requests would wait forever and their slots stay held (the loop sleeps
        until a new sequence waits)."""
        if not self._running:
            log.error("the scheduler's decoding loop failed", exc_info=exc)
        for seq in list(self._running):
            self._fail(seq, exc)
            self._remove(seq)

    def _drive(self) -> None:
        """Admit, step, deliver, free; until no sequence runs or waits."""
        running = self._running
        while True:
            self._admit()
            if not running:
                with self._cond:
                    if not self._waiting:
                        return
                continue
            graphs, t0 = graphs_built(), time.perf_counter()
            try:
                results = self.backend.step()
            except Exception as exc:  # a failed round fails every sequence in it
                for seq in list(running):
                    self._fail(seq, exc)
                    self._remove(seq)
                continue
            finally:
                self._count_backend()
            self._count_compile(graphs, t0, step=True)
            self._count_round(results)
            for seq, chunk in results:
                if isinstance(chunk, DFlashError):  # (that sequence alone failed; the backend let it go)
                    self._fail(seq, chunk)
                    self._leave(seq)
                    continue
                self._deliver(seq, chunk)
                if chunk.finish_reason is not None:
                    self._leave(seq)
            for seq in [s for s in running if s.job.cancelled.is_set()]:
                self._remove(seq)
                self.metrics.cancelled.inc()
            if compute.interrupted():  # the process exits (compute._stop, a server in a daemon thread): stop here
                for seq in list(running):  # (a 503 server_shutting_down, as at shutdown: a client may retry it elsewhere)
                    seq.job.put("unavailable")
                    self._remove(seq)
                return

    def _admit(self) -> None:
        while len(self._running) < self.max_batch_size:
            with self._cond:
                if not self._waiting:
                    return
                seq = self._waiting.popleft()
                self._running.append(seq)  # (counted as running while it prefills)
                self._update_gauges()
            graphs, t0 = graphs_built(), time.perf_counter()
            try:
                self.backend.add(seq)
            except Exception as exc:
                self._fail(seq, exc)
                self._leave(seq)
                continue
            self._count_compile(graphs, t0, step=False)
            seq.job.put("start", len(seq.prompt_ids), seq.index)
            self.metrics.prompt_tokens.inc(len(seq.prompt_ids))

    def _count_backend(self) -> None:
        read, reused = self.backend.prefill_tokens, self.backend.reused_prefill_tokens
        self.metrics.prefill_tokens.inc(read - self._prefill_tokens)
        self.metrics.reused_prefill_tokens.inc(reused - self._reused_tokens)
        self._prefill_tokens, self._reused_tokens = read, reused
        plain = self.backend.target_only_rounds
        self.metrics.target_only_rounds.inc(plain - self._target_only_rounds)
        self._target_only_rounds = plain

    def _count_compile(self, graphs: int, t0: float, step: bool) -> None:
        """After a backend ``add`` or ``step`` (``step``) that succeeded, begun at ``t0`` with
        ``graphs`` built (:func:`~dflash_torch.decoding.graphs_built`): if it built graphs (a
        compiled engine past its warm-up's buckets), log it in one line and count it (see the
        module docstring)."""
        if graphs_built() == graphs:
            return
        took = time.perf_counter() - t0
        self.metrics.serving_compiles.inc()
        self.metrics.serving_compile_seconds.inc(took)
        log.warning("compiled the graphs of %s while serving: %.1f s, every stream waiting (graphs past the start-up "
                    "warm-up's: see --warmup-context)", self.backend.compiled_what(step), took)

    def _count_round(self, results: list) -> None:
        """The acceptance and batch-size metrics of one step's decoding round, as it commits:
        a chunk of a sequence that has its first token (the prefill's) is that sequence's
        decoding round, its tau the tokens it committed (what :class:`GenerationStats`'s
        ``acceptance_lengths`` records). A step that only prefills runs no round."""
        taus = [len(chunk.token_ids) for seq, chunk in results
                if not isinstance(chunk, DFlashError) and seq.got_token and chunk.token_ids]
        if taus:
            self.metrics.batch_size.observe(len(taus))
            self.metrics.observe_rounds(taus)

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        """End ``seq`` with ``exc``: a user error (a :class:`DFlashError`: an ``error`` event,
        the request's 400), or a server error (torch's compiler failed, or a bug: a ``fatal``
        event, the request's 500 or a started stream's error event), which is logged with the
        request's id (and the bug's traceback) and counted in ``dflash_generation_errors_total``
        (once per request, however many of its choices fail)."""
        job = seq.job
        if isinstance(exc, DFlashError) and not isinstance(exc, CompileError):
            param = param_of(exc)
            named, message = job.param_aliases.get(param, param), str(exc)
            if isinstance(exc, OptionError) and named and exc.name and exc.name != named:  # (the request's name for it)
                message = re.sub(rf"(?<![\w.]){re.escape(exc.name)}(?![\w.])", named, message, count=1)
            job.put("error", (message, named), seq.index)
            return
        job.put("fatal", self._server_error(job, exc, seq.index if len(job.sequences) > 1 else None), seq.index)

    def answer_failed(self, job: Job, exc: Exception) -> str:
        """A server error (a bug) in writing ``job``'s answer from its output (its reply's
        parsing, its JSON), on the event loop: a failed generation as :meth:`_fail` takes it
        (logged as ``generation failed (request <id>)`` with the traceback, counted in
        ``dflash_generation_errors_total`` once per request). Returns the message for the
        client (the error's type and text, and the request's id)."""
        return self._server_error(job, exc)

    def _server_error(self, job: Job, exc: Exception, index: int | None = None) -> str:
        """Count (once per job) and log the server error ``exc`` of ``job`` (``index``: the
        choice that failed, where the request has several); the client's message."""
        with self._cond:
            first, job.failed = not job.failed, True
        if first:
            self.metrics.generation_errors.inc()
        name = f"request {job.request_id or '(no id)'}" + (f" choice {index}" if index is not None else "")
        if isinstance(exc, CompileError):  # (torch's compiler failed, not the request: a 500 that names it)
            log.error("generation failed (%s): %s", name, exc)
            message = str(exc)
        else:  # a bug, not the user's input: report a 500
            log.error("generation failed (%s)", name, exc_info=exc)
            message = f"{type(exc).__name__}: {exc}"
        # (the id in the client's message too: a non-streamed 500 carries no other, and the log names it)
        return f"{message} ({name})" if job.request_id else message

    def _remove(self, seq: Sequence) -> None:
        """Take an unfinished sequence out of the backend and the batch."""
        try:
            self.backend.remove(seq)
        except Exception:
            log.exception("removing a sequence failed")
        self._leave(seq)

    def _leave(self, seq: Sequence) -> None:
        """``seq`` is out of the backend: free its slot and end it."""
        with self._cond:
            self._running.remove(seq)
            self._update_gauges()
        self._done(seq)

    def _done(self, seq: Sequence) -> None:
        job = seq.job
        job.put("done", None, seq.index)
        with self._cond:
            job.unfinished -= 1
            if job.unfinished <= 0:
                self._jobs.discard(job)

    def _deliver(self, seq: Sequence, chunk: StreamChunk) -> None:
        """Metrics, then the chunk to its request (a non-streamed choice: one event at its end)."""
        m, job = self.metrics, seq.job
        if chunk.token_ids:
            first, seq.got_token = not seq.got_token, True
            if not job.scores_only:  # (a scoring request's one token is dropped: none generated, as its usage says)
                m.generated_tokens.inc(len(chunk.token_ids))
                if first:
                    m.ttft.observe(time.perf_counter() - job.arrived)
        if chunk.stats is not None:  # (its rounds are observed as they commit: _count_round)
            m.observe_request(chunk.stats.acceptance_lengths)
        if job.stream:
            job.put("chunk", chunk, seq.index)
            return
        seq.text.append(chunk.text)
        seq.token_ids.extend(chunk.token_ids)
        if chunk.logprobs is not None:
            seq.logprobs.extend(chunk.logprobs)
        if chunk.prompt_logprobs is not None:
            seq.prompt_logprobs = chunk.prompt_logprobs
        if chunk.finish_reason is not None:
            logprobs = seq.logprobs if chunk.logprobs is not None else None
            job.put("chunk", StreamChunk("".join(seq.text), seq.token_ids, chunk.finish_reason, chunk.stats, logprobs,
                                         seq.prompt_logprobs), seq.index)

    def _update_gauges(self) -> None:  # (under self._cond)
        waiting, running = len(self._waiting), len(self._running)
        self.metrics.waiting.set(waiting)
        self.metrics.running.set(running)
        self.metrics.queue_depth.set(waiting + running)
