"""Prometheus metrics of the server (text exposition format at ``GET /metrics``).

Each app owns its registry, so several apps can live in one process (tests).

=====================================  =========  ==============================================
name                                   type       meaning
=====================================  =========  ==============================================
dflash_requests_total                  counter    HTTP requests by ``endpoint`` and ``status``
dflash_request_latency_seconds         histogram  request latency (whole stream included) by endpoint
dflash_time_to_first_token_seconds     histogram  from arrival to the first generated token
dflash_requests_cancelled_total        counter    generations dropped or stopped early: the client went away
dflash_prompt_tokens_total             counter    prompt tokens of started generations
dflash_generated_tokens_total          counter    generated (committed, emitted) tokens
dflash_acceptance_length               histogram  tokens committed per decoding round (tau)
dflash_mean_acceptance_length          gauge      mean tau over all rounds since start
dflash_queue_depth                     gauge      generations waiting for or holding the engine
=====================================  =========  ==============================================
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    """All metrics of one app, in their own registry."""

    def __init__(self, block_size: int = 16):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("dflash_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("dflash_request_latency_seconds", "Request latency in seconds (streams: until the last byte)",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("dflash_time_to_first_token_seconds", "Seconds from request arrival to the first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.cancelled = Counter("dflash_requests_cancelled", "Generations stopped early because the client went away", registry=r)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens of started generations", registry=r)
        self.generated_tokens = Counter("dflash_generated_tokens", "Generated tokens", registry=r)
        self.acceptance = Histogram("dflash_acceptance_length", "Tokens committed per decoding round (tau, bonus token included)",
                                    buckets=tuple(range(1, max(block_size, 1) + 1)), registry=r)
        self.mean_acceptance = Gauge("dflash_mean_acceptance_length", "Mean acceptance length over all decoding rounds since start",
                                     registry=r)
        self.queue_depth = Gauge("dflash_queue_depth", "Generations waiting for or holding the engine", registry=r)
        self._lock = threading.Lock()
        self._tau_sum = 0
        self._rounds = 0

    def observe_rounds(self, taus: list[int]) -> None:
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
    when the response has been sent completely (streams included)."""

    def __init__(self, app, metrics: ServerMetrics, endpoints: set[str]):
        self.app, self.metrics, self.endpoints = app, metrics, endpoints

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in self.endpoints else "other"
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
