"""Prometheus metrics of the server (text exposition format at ``GET /metrics``).

Each app owns its registry, so several apps can live in one process (tests).

=====================================  =========  ==============================================
name                                   type       meaning
=====================================  =========  ==============================================
dflash_requests_total                  counter    HTTP requests by ``endpoint`` (the route: a path, or
                                                  ``/v1/models/{model}``; ``other``: no route's) and ``status``
dflash_request_latency_seconds         histogram  request latency (whole stream included) by endpoint
dflash_time_to_first_token_seconds     histogram  from arrival to the first generated token (a scoring
                                                  request generates none: not observed)
dflash_requests_cancelled_total        counter    generations (choices: a request's n) dropped or stopped early: the client went away
dflash_prompt_tokens_total             counter    prompt tokens of started generations, each choice
                                                  its own (n choices: n times; ``usage.prompt_tokens``: once)
dflash_prefill_tokens_total            counter    prompt tokens the target read (choices sharing a prompt: once)
dflash_reused_prefill_tokens_total     counter    prompt tokens taken from a retained prefix instead (prefix reuse)
dflash_generated_tokens_total          counter    generated (committed, emitted) tokens, as ``usage.completion_tokens``
                                                  counts them (cancelled sequences' too; a scoring request's,
                                                  ``echo`` with ``max_tokens`` 0: none, its one decoded token dropped)
dflash_target_only_rounds_total        counter    rounds run without drafts (more sequences than
                                                  ``--draft-max-batch-size``, or chosen by its
                                                  ``auto`` policy; their tau is 1)
dflash_acceptance_length               histogram  tokens committed per decoding round (tau), one per sequence
                                                  in the round, observed as the round commits (the rounds
                                                  of cancelled sequences too)
dflash_mean_acceptance_length          gauge      mean tau over all rounds since start (as the histogram)
dflash_queue_depth                     gauge      sequences waiting for or holding the engine
dflash_running_requests                gauge      sequences in the running batch (one per choice)
dflash_waiting_requests                gauge      sequences waiting for a slot (one per choice)
dflash_rejected_requests_total         counter    requests refused with 503 because the queue was full
dflash_generation_errors_total         counter    requests whose generation failed on a server error (a bug, or
                                                  ``--compile``'s graphs torch failed to build), streamed or not:
                                                  a 500, or the error event of a stream that had started (whose
                                                  status, 200, was sent); once per request
dflash_batch_size                      histogram  sequences that decoded in a round, observed once per
                                                  decoding round (a step that only prefills: none; sequences
                                                  still prefilling are not counted)
dflash_request_acceptance_length       histogram  mean tau of each sequence that finished (with rounds;
                                                  not a cancelled one)
dflash_open_requests                   gauge      requests the scheduler holds (a leak check)
dflash_threads                         gauge      live threads of the process (a leak check)
dflash_event_loop_tasks                gauge      asyncio tasks of the server's event loop (a leak check)
dflash_compiled_steps_run_eager        gauge      compiled steps that reached torch's recompile limit and
                                                  run eager since (``--compile``; anything but 0 is a defect)
dflash_serving_compiles_total          counter    engine steps (a round, a prefill) that built graphs while serving
                                                  (``--compile``: past the buckets the start-up warm-up built, see
                                                  ``--warmup-context``; every stream waits meanwhile; each is logged)
dflash_serving_compile_seconds_total   counter    seconds those steps took (their compiles, mostly)
process_*                              (various)  the process's memory, CPU, open files (Linux)
=====================================  =========  ==============================================

A request with several choices (a list of prompts, ``n`` > 1) runs one sequence per
choice: the running, waiting and batch figures count sequences. Its choices of one
prompt share that prompt's prefill (batched backend): ``dflash_prefill_tokens_total``
grows by the prompt once, ``dflash_prompt_tokens_total`` once per choice (as the
generated, cancelled and sequence figures count choices; ``usage.prompt_tokens`` of the
response counts each prompt once).

Each sequence's first token is its prefill's, every later one a decoding round's, so
``dflash_generated_tokens_total`` == ``dflash_acceptance_length_sum`` +
``dflash_time_to_first_token_seconds_count`` (cancelled sequences included; a scoring
request's sequence, whose one token is dropped and runs no round, counts in neither), and
``dflash_acceptance_length_count`` == the sum of ``dflash_batch_size``.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               generate_latest)

from ..decoding import eager_fallbacks

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


class ServerMetrics:
    """All metrics of one app, in their own registry."""

    def __init__(self, block_size: int = 16):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("dflash_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("dflash_request_latency_seconds", "Request latency in seconds (streams: until the last byte)",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("dflash_time_to_first_token_seconds", "Seconds from request arrival to the first generated "
                              "token (not observed for a scoring request: echo with max_tokens 0)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.cancelled = Counter("dflash_requests_cancelled", "Generations stopped early because the client went away", registry=r)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens of started generations, counted for each "
                                     "choice (a request of n choices of a prompt: n times; its usage.prompt_tokens "
                                     "counts the prompt once)", registry=r)
        self.prefill_tokens = Counter("dflash_prefill_tokens", "Prompt tokens the target read (a prompt shared by "
                                      "several choices is read once)", registry=r)
        self.reused_prefill_tokens = Counter("dflash_reused_prefill_tokens", "Prompt tokens taken from a retained "
                                             "prefix (an earlier request's rows) instead of read", registry=r)
        self.generated_tokens = Counter("dflash_generated_tokens", "Generated (committed, emitted) tokens, as "
                                        "usage.completion_tokens counts them (cancelled sequences' too; a scoring "
                                        "request's: none)",
                                        registry=r)
        self.target_only_rounds = Counter("dflash_target_only_rounds", "Rounds run without drafts (more sequences "
                                          "than --draft-max-batch-size, or chosen by its auto policy)", registry=r)
        self.acceptance = Histogram("dflash_acceptance_length", "Tokens committed per decoding round by each "
                                    "sequence in it (tau, bonus token included), observed as the round commits",
                                    buckets=tuple(range(1, max(block_size, 1) + 1)), registry=r)
        self.mean_acceptance = Gauge("dflash_mean_acceptance_length", "Mean acceptance length over all decoding rounds since start",
                                     registry=r)
        self.queue_depth = Gauge("dflash_queue_depth", "Sequences waiting for or holding the engine", registry=r)
        self.running = Gauge("dflash_running_requests", "Sequences in the running batch (one per choice)", registry=r)
        self.waiting = Gauge("dflash_waiting_requests", "Sequences waiting for a slot (one per choice)", registry=r)
        self.rejected = Counter("dflash_rejected_requests", "Requests refused with 503 because the queue was full", registry=r)
        self.generation_errors = Counter(
            "dflash_generation_errors", "Requests whose generation failed on a server error, streamed or not (a 500, "
            "or the error event of a stream whose 200 was sent); once per request", registry=r)
        self.batch_size = Histogram("dflash_batch_size", "Sequences that decoded in a round (not those prefilling), observed "
                                    "once per decoding round",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.request_acceptance = Histogram(
            "dflash_request_acceptance_length", "Mean acceptance length of each finished sequence (with decoding rounds; "
            "not a cancelled one)",
            buckets=tuple(1 + k / 2 for k in range(2 * max(block_size, 1) - 1)), registry=r)
        self.open_requests = Gauge("dflash_open_requests", "Requests the scheduler holds", registry=r)
        self.threads = Gauge("dflash_threads", "Live threads of the process", registry=r)
        self.threads.set_function(threading.active_count)
        self.event_loop_tasks = Gauge("dflash_event_loop_tasks", "Asyncio tasks of the server's event loop", registry=r)
        self.run_eager = Gauge("dflash_compiled_steps_run_eager",
                               "Compiled steps that reached torch's recompile limit and run eager since", registry=r)
        self.run_eager.set_function(eager_fallbacks)
        self.serving_compiles = Counter("dflash_serving_compiles", "Engine steps (a round, a prefill) that built "
                                        "graphs while serving (--compile: past the buckets of the start-up warm-up)",
                                        registry=r)
        self.serving_compile_seconds = Counter("dflash_serving_compile_seconds", "Seconds the engine steps that built "
                                               "graphs while serving took (every stream waited)", registry=r)
        ProcessCollector(registry=r)
        self._lock = threading.Lock()
        self._tau_sum = 0
        self._rounds = 0

    def observe_request(self, taus: list[int]) -> None:
        """A finished sequence's taus (one per decoding round): its mean tau, if it ran a round
        (its rounds are already in the per-round figures: :meth:`observe_rounds`)."""
        if taus:
            self.request_acceptance.observe(sum(taus) / len(taus))

    def observe_rounds(self, taus: list[int]) -> None:
        """One decoding round's taus (tokens committed), one per sequence that decoded in it."""
        for tau in taus:
            self.acceptance.observe(tau)
        with self._lock:
            self._tau_sum += sum(taus)
            self._rounds += len(taus)
            if self._rounds:
                self.mean_acceptance.set(self._tau_sum / self._rounds)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class MetricsMiddleware:
    """Pure ASGI middleware: counts requests by endpoint and status and observes latency
    when the response has been sent completely (streams included). ``endpoints``: the
    labels, paths, or a route's path ending in a parameter (``/v1/models/{model}``: every
    path under ``/v1/models/``); a request to none of them is counted as ``other``."""

    def __init__(self, app, metrics: ServerMetrics, endpoints: set[str]):
        self.app, self.metrics, self.endpoints = app, metrics, endpoints
        self.prefixes = sorted(((e[:e.index("{")], e) for e in endpoints if e.endswith("}") and "{" in e), reverse=True)

    def endpoint(self, path: str) -> str:
        """The label of a request to ``path``."""
        if path in self.endpoints:
            return path
        return next((label for prefix, label in self.prefixes if path.startswith(prefix)), "other")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = self.endpoint(path)
        status = {"code": 500}
        start = time.perf_counter()

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
