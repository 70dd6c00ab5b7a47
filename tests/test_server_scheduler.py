"""The server's request scheduler, end to end (issue 13): a real ``dflash-torch serve``
subprocess, the real ``openai`` client and raw HTTP; no mocks.

Several choices per request (a list of prompts, ``n`` > 1), many concurrent streams
with clients that leave early, a bounded queue (503 with Retry-After), and no leak after
hundreds of requests."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest
from conftest import read_completion_stream
from test_server import API_KEY, MODEL, PROMPT, Server, _assert_openai_error, _env, _free_port, _wait_until_up, stop

from dflash_torch.cache import common_start
from dflash_torch.serving.scheduler import choice_seed

PROMPTS = ["def f(x):", "class A:", "import os\n", "for i in range(10):", "x = [", "# a comment", "while True:",
           "return"]


@contextmanager
def _serve(tiny_pair, logdir, *extra: str, code: str | None = None):
    """A server of ``tiny_pair`` (target, drafter; drafter None: none, e.g. with ``--no-draft``);
    ``code``: the Python code run (``python -c``) instead of the CLI's module (it runs the CLI)."""
    target, drafter = tiny_pair
    port = _free_port()
    log = logdir / f"server-{port}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, *(["-c", code] if code else ["-m", "dflash_torch.cli"]), "serve", "--target", str(target),
             *(["--draft", str(drafter)] if drafter is not None else []), "--port", str(port), "--model-name", MODEL,
             "--log-level", "warning", "--api-key", API_KEY, *extra],
            stdout=fh, stderr=subprocess.STDOUT, env=_env())
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_until_up(proc, base, log)
        yield Server(base, proc, log)
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    with _serve(tiny_pair, tmp_path_factory.mktemp("sched")) as srv:
        yield srv


def _gauge(m: dict, name: str) -> float:
    return m[(name, ())]


def _kw(temperature: float, seed: int | None = None, **extra) -> dict:
    kw = dict(model=MODEL, temperature=temperature, extra_body={"ignore_eos": True}, **extra)
    if seed is not None:
        kw["seed"] = seed
    return kw


def _streamed_choices(events) -> tuple[dict[int, str], dict[int, str], object]:
    """Text and finish reason per choice index, and the usage, of a streamed completion."""
    text: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    usage = None
    for ev in events:
        if ev.usage is not None:
            usage = ev.usage
        for ch in ev.choices:
            piece = ch.text if hasattr(ch, "text") else (ch.delta.content or "")
            text.setdefault(ch.index, []).append(piece)
            if ch.finish_reason is not None:
                assert ch.index not in finish, "two finish reasons for one choice"
                finish[ch.index] = ch.finish_reason
    return {i: "".join(t) for i, t in text.items()}, finish, usage


# --------------------------------------------------------------------------------------
def test_a_list_of_prompts_gives_one_choice_per_prompt_in_order(server, local_engine):
    c = server.client()
    ids = local_engine.encode_prompt("x = 1\n")
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    alone = [c.completions.create(prompt=p, max_tokens=12, **_kw(0)) for p in prompts]
    alone_ids = c.completions.create(prompt=ids, max_tokens=12, **_kw(0))
    r = c.completions.create(prompt=prompts, max_tokens=12, **_kw(0))
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.text for ch in r.choices] == [a.choices[0].text for a in alone]
    assert r.usage.prompt_tokens == sum(len(local_engine.encode_prompt(p)) for p in prompts)
    assert r.usage.completion_tokens == 3 * 12 and r.usage.total_tokens == r.usage.prompt_tokens + 36
    # token-id prompts, two of them, one the same as a text prompt
    r2 = c.completions.create(prompt=[ids, local_engine.encode_prompt(prompts[1])], max_tokens=12, **_kw(0))
    assert [ch.text for ch in r2.choices] == [alone_ids.choices[0].text, alone[1].choices[0].text]
    # streamed: each chunk names its choice; the same texts and usage
    texts, finish, usage = _streamed_choices(c.completions.create(
        prompt=prompts, max_tokens=12, stream=True, stream_options={"include_usage": True}, **_kw(0)))
    assert texts == {i: a.choices[0].text for i, a in enumerate(alone)}
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert usage.prompt_tokens == r.usage.prompt_tokens and usage.completion_tokens == 36


def test_n_choices_greedy_are_identical_and_sampled_ones_follow_their_derived_seeds(server):
    c = server.client()
    alone = c.completions.create(prompt=PROMPT, max_tokens=16, **_kw(0)).choices[0].text
    r = c.completions.create(prompt=PROMPT, max_tokens=16, n=3, **_kw(0))
    assert [ch.index for ch in r.choices] == [0, 1, 2] and {ch.text for ch in r.choices} == {alone}
    assert r.usage.completion_tokens == 48 and r.usage.prompt_tokens == \
        c.completions.create(prompt=PROMPT, max_tokens=1, **_kw(0)).usage.prompt_tokens  # counted once, not n times

    sample = _kw(1.0, seed=11, top_p=0.95)
    a = c.completions.create(prompt=PROMPT, max_tokens=20, n=3, **sample)
    b = c.completions.create(prompt=PROMPT, max_tokens=20, n=3, **sample)
    texts = [ch.text for ch in a.choices]
    assert texts == [ch.text for ch in b.choices]  # reproducible
    assert len(set(texts)) == 3, texts  # each choice has its own random stream
    # choice j samples exactly as one request with the documented derived seed
    for j, text in enumerate(texts):
        single = c.completions.create(prompt=PROMPT, max_tokens=20, **{**sample, "seed": choice_seed(11, j)})
        assert single.choices[0].text == text, j
    assert choice_seed(11, 0) == 11
    # a list of prompts with n: choice i * n + j is prompt i's choice j, seeded as above
    r = c.completions.create(prompt=[PROMPT, PROMPTS[1]], max_tokens=20, n=2, **sample)
    other = c.completions.create(prompt=PROMPTS[1], max_tokens=20, n=2, **sample)
    assert [ch.text for ch in r.choices] == texts[:2] + [ch.text for ch in other.choices]
    # streamed with several choices: the same texts, chunks carry their index
    s_texts, finish, usage = _streamed_choices(c.completions.create(
        prompt=PROMPT, max_tokens=20, n=3, stream=True, stream_options={"include_usage": True}, **sample))
    assert s_texts == dict(enumerate(texts)) and set(finish) == {0, 1, 2} and usage.completion_tokens == 60


def test_best_of_equal_to_n_returns_every_candidate_and_other_values_are_refused(server):
    """best_of (legacy completions) is how many candidates are generated, the best n
    returned: best_of == n returns them all, the same choices as n alone; best_of > n
    would need ranking (refused), best_of < n is invalid."""
    c = server.client()
    sample = _kw(1.0, seed=23)
    plain = c.completions.create(prompt=[PROMPT, PROMPTS[1]], max_tokens=12, n=2, **sample)
    both = c.completions.create(prompt=[PROMPT, PROMPTS[1]], max_tokens=12, n=2, best_of=2, **sample)
    assert [ch.text for ch in both.choices] == [ch.text for ch in plain.choices]
    assert len({ch.text for ch in both.choices}) == 4
    # (the token counts; cached_tokens depends on what earlier requests left for prefix reuse: it failed alone)
    assert (both.usage.prompt_tokens, both.usage.completion_tokens) == (plain.usage.prompt_tokens,
                                                                         plain.usage.completion_tokens)
    one = c.completions.create(prompt=PROMPT, max_tokens=12, best_of=1, **sample)
    assert one.choices[0].text == plain.choices[0].text
    for kw, words in [(dict(n=2, best_of=3), "best_of > n is not supported (best_of=3, n=2)"),
                      (dict(best_of=2), "best_of > n is not supported (best_of=2, n=1)"),
                      (dict(n=3, best_of=2), "best_of must be >= n (best_of=2, n=3)"),
                      (dict(best_of=0), "best_of")]:
        with pytest.raises(openai.BadRequestError) as err:
            c.completions.create(prompt=PROMPT, max_tokens=4, **kw, **sample)
        body = err.value.body
        assert err.value.status_code == 400 and body["param"] == "best_of" and words in body["message"], body


def test_chat_n_choices(server):
    c = server.client()
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=12, n=2, temperature=1.0,
              seed=5, extra_body={"ignore_eos": True})
    r = c.chat.completions.create(**kw)
    texts = [ch.message.content for ch in r.choices]
    assert [ch.index for ch in r.choices] == [0, 1] and texts[0] != texts[1]
    assert r.usage.completion_tokens == 24
    chunks = list(c.chat.completions.create(stream=True, **kw))
    assert sorted(ch.choices[0].index for ch in chunks if ch.choices[0].delta.role) == [0, 1]
    streamed, finish, _ = _streamed_choices(chunks)
    assert streamed == {0: texts[0], 1: texts[1]} and finish == {0: "length", 1: "length"}


def test_eight_concurrent_openai_streams_some_leaving(server):
    """8 streams at once (greedy and seeded sampling, mixed prompts and lengths), 3 of
    them closing after a few events: every other one gets exactly its output alone; the
    leavers' sequences stop (their slots serve the rest), nothing stays in the scheduler."""
    c = server.client()
    leavers = {1, 4, 6}
    specs = [dict(prompt=PROMPTS[i], max_tokens=400 if i in leavers else 8 + 4 * i,
                  **(_kw(0) if i % 2 == 0 else _kw(0.9, seed=100 + i))) for i in range(8)]
    alone = {i: c.completions.create(**specs[i]).choices[0].text for i in range(8) if i not in leavers}
    before = server.metrics()
    barrier = threading.Barrier(8)
    results: dict[int, dict] = {}

    def run(i: int) -> None:
        try:
            client = server.client()
            barrier.wait()
            stream = client.completions.create(stream=True, stream_options={"include_usage": True}, **specs[i])
            text, usage, _ = read_completion_stream(stream, 3 if i in leavers else None)
            results[i] = {"text": text, "usage": usage}
        except Exception as exc:  # reported by the main thread
            results[i] = {"error": repr(exc)}

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads)
    assert all("error" not in r for r in results.values()), results
    for i in range(8):
        if i in leavers:
            assert results[i]["text"] and results[i]["usage"] is None
        else:
            assert results[i]["text"] == alone[i], i
            assert results[i]["usage"].completion_tokens == specs[i]["max_tokens"]
    # the slots were freed and serve the next request
    assert c.completions.create(**specs[0]).choices[0].text == alone[0]
    m = server.metrics()
    delta = lambda name: m.get((name, ()), 0.0) - before.get((name, ()), 0.0)  # noqa: E731
    assert delta("dflash_requests_cancelled_total") == len(leavers)
    stayed = sum(specs[i]["max_tokens"] for i in range(8) if i not in leavers) + specs[0]["max_tokens"]
    assert 0 < delta("dflash_generated_tokens_total") - stayed < len(leavers) * 400 / 2  # cut long before 400
    assert delta("dflash_batch_size_count") > 0 and delta("dflash_request_acceptance_length_count") == 8 - len(leavers) + 1
    for name in ("dflash_running_requests", "dflash_waiting_requests", "dflash_queue_depth", "dflash_open_requests"):
        assert _gauge(m, name) == 0, name
    assert "Traceback" not in server.log.read_text()


def _deltas(server, before: dict, *names: str) -> list[float]:
    m = server.metrics()
    return [m.get((name, ()), 0.0) - before.get((name, ()), 0.0) for name in names]


def test_acceptance_metrics_take_each_round_as_it_commits_cancelled_sequences_too(server):
    """A decoding round's tau reaches /metrics when the round commits: a stream still running
    shows its rounds, and a stream whose client leaves keeps them (they were missing: the
    figures were taken from a sequence's final stats, which a cancelled one never has).
    Every generated token is a sequence's first (prefill) token or a round's."""
    names = ("dflash_generated_tokens_total", "dflash_acceptance_length_sum", "dflash_acceptance_length_count",
             "dflash_time_to_first_token_seconds_count", "dflash_batch_size_sum", "dflash_requests_cancelled_total",
             "dflash_request_acceptance_length_count")
    before = server.metrics()
    stream = server.client().completions.create(prompt=PROMPTS[1], max_tokens=900, stream=True, **_kw(0))
    text, _, events = read_completion_stream(stream, 3)
    assert events == 3 and text
    taus_so_far = _deltas(server, before, "dflash_acceptance_length_count")[0]
    stream.close()
    for _ in range(300):  # (the server sees the client leave within a round or two)
        d = dict(zip(names, _deltas(server, before, *names)))
        if d["dflash_requests_cancelled_total"] == 1:
            break
        time.sleep(0.05)
    assert d["dflash_requests_cancelled_total"] == 1
    assert taus_so_far >= 2  # (3 chunks streamed: the prefill's and 2 rounds' at least)
    assert d["dflash_acceptance_length_count"] >= taus_so_far and d["dflash_generated_tokens_total"] > 3
    assert d["dflash_generated_tokens_total"] == (d["dflash_acceptance_length_sum"]
                                                  + d["dflash_time_to_first_token_seconds_count"]), d
    assert d["dflash_batch_size_sum"] == d["dflash_acceptance_length_count"]
    assert d["dflash_request_acceptance_length_count"] == 0  # (a sequence's mean tau: finished ones)
    m = server.metrics()
    assert m[("dflash_mean_acceptance_length", ())] == pytest.approx(
        m[("dflash_acceptance_length_sum", ())] / m[("dflash_acceptance_length_count", ())])


def test_batch_size_is_observed_once_per_decoding_round_not_per_prefill_step(server, local_engine):
    """``dflash_batch_size`` counts decoding rounds (it counted every engine step, the
    prompt's prefill steps too); a request alone decodes one sequence per round, and the
    acceptance figures hold its rounds as its stats list them."""
    names = ("dflash_batch_size_count", "dflash_batch_size_sum", "dflash_acceptance_length_count",
             "dflash_acceptance_length_sum", "dflash_request_acceptance_length_count")
    long_prompt = "def f(x):\n    return x + 1\n" * 40
    assert len(local_engine.encode_prompt(long_prompt)) > 256  # (prefilled in several steps)
    for prompt in (PROMPTS[2], long_prompt):
        before = server.metrics()
        r = server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 0,
                                            "ignore_eos": True}).json()
        hist = {int(k): v for k, v in r["dflash"]["acceptance_histogram"].items()}
        rounds = sum(hist.values())
        assert rounds >= 1 and 1 + sum(k * v for k, v in hist.items()) == r["usage"]["completion_tokens"] == 20
        assert _deltas(server, before, *names) == [rounds, rounds, rounds, 19, 1], prompt


def test_nothing_leaks_after_200_requests(server):
    """200 short requests from 4 clients at once (streamed or not, some streams closed
    early, some with several choices): afterwards no request, sequence, thread or event-loop
    task is left over and the memory has not grown beyond noise."""
    def burst(n_requests: int) -> None:
        errors = []

        def client_loop(k: int) -> None:
            client = server.client()
            try:
                for r in range(k, n_requests, 4):
                    kw = dict(prompt=PROMPTS[r % 8], max_tokens=3, **_kw(0 if r % 3 else 0.8, seed=r))
                    if r % 5 == 0:
                        kw["n"] = 2
                    if r % 2:
                        with client.completions.create(stream=True, **kw) as stream:
                            for _ in stream:
                                if r % 4 == 3:
                                    break  # leave after the first event
                    else:
                        assert client.completions.create(**kw).usage.completion_tokens == 3 * kw.get("n", 1)
            except Exception as exc:
                errors.append(repr(exc))

        threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert not errors, errors

    burst(40)  # warm-up: thread pools reach their working size
    before = server.metrics()
    burst(200)
    after = server.metrics()
    assert after[("dflash_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] - \
        before[("dflash_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 200
    for name in ("dflash_running_requests", "dflash_waiting_requests", "dflash_open_requests"):
        assert _gauge(after, name) == 0, name
    assert _gauge(after, "dflash_threads") <= _gauge(before, "dflash_threads") + 2
    assert _gauge(after, "dflash_event_loop_tasks") <= _gauge(before, "dflash_event_loop_tasks") + 2
    if ("process_resident_memory_bytes", ()) in after:  # (Linux)
        grown = _gauge(after, "process_resident_memory_bytes") - _gauge(before, "process_resident_memory_bytes")
        assert grown < 64 * 2**20, grown


# --------------------------------------------------------------------------------------
def test_a_full_queue_answers_503_with_retry_after_at_once(tiny_pair, tmp_path):
    """One slot, one waiting place: a third request is refused at once, while the first
    streams and the second waits; once the stream leaves, the waiting one is served."""
    with _serve(tiny_pair, tmp_path, "--max-batch-size", "1", "--max-queue", "1") as srv:
        streaming, events = threading.Event(), []
        body = {"model": MODEL, "prompt": PROMPT, "stream": True, "temperature": 0, "max_tokens": 1000,
                "ignore_eos": True}
        headers = {"Authorization": f"Bearer {API_KEY}"}

        def stream(stop: threading.Event):
            with httpx.stream("POST", f"{srv.base}/v1/completions", json=body, headers=headers, timeout=120) as r:
                for line in r.iter_lines():
                    events.append(line)
                    streaming.set()
                    if stop.is_set():
                        return  # closes the connection

        def wait_for(name: str, value: float):
            while _gauge(srv.metrics(), name) != value:
                streaming.wait(0.05)

        stop = threading.Event()
        first = threading.Thread(target=stream, args=(stop,))
        first.start()
        assert streaming.wait(120), srv.log.read_text()
        wait_for("dflash_running_requests", 1)
        waiting = {}
        second = threading.Thread(target=lambda: waiting.setdefault(
            "r", srv.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0})))
        second.start()
        wait_for("dflash_waiting_requests", 1)
        r = srv.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        err = _assert_openai_error(r, 503)
        assert err["code"] == "queue_full" and err["type"] == "server_error", err
        # (it said "2 sequences wait ... (at most 1)": the bound counts the free slots too; then
        # "this request's 1 sequences do not fit behind the 1 queued (room for 1: 0 free slots, ...)")
        assert err["message"] == ("the server is full: 1 of 1 slots busy (--max-batch-size) and 1 of 1 waiting "
                                  "places taken (--max-queue); retry in 1 s"), err
        assert httpx.head(f"{srv.base}/health", timeout=10).status_code == 200  # (load balancers' probes)
        assert int(r.headers["retry-after"]) >= 1
        r = httpx.post(f"{srv.base}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4},
                       headers={**headers, "Origin": "http://app.example"}, timeout=60)
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        # (a browser's script may read it: trial-101, it was not exposed)
        assert r.headers["access-control-expose-headers"] == "Retry-After"
        with pytest.raises(openai.InternalServerError):
            srv.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        # three choices are more than the slot and the queue hold: a 400, whatever the load
        err = _assert_openai_error(srv.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 3}), 400)
        assert err["param"] == "n" and err["message"] == (
            "3 choices (1 prompt x n=3) are more than this server holds (2: 1 slot (--max-batch-size) and 1 waiting "
            "place (--max-queue))"), err
        r = srv.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 2})  # (two fit, once both are free)
        err = _assert_openai_error(r, 503)
        assert err["code"] == "queue_full" and err["message"] == (
            "the server has no room for this request's 2 choices now: 1 of 1 slots busy (--max-batch-size) and 1 of 1 "
            "waiting places taken (--max-queue); retry in 1 s"), err
        # so are token ids outside the vocabulary (they were a 503 "retry in 1 s" while the queue was full)
        for field, value in (("logit_bias", {"999999": 5}), ("stop_token_ids", [999999])):
            r = srv.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, field: value})
            assert _assert_openai_error(r, 400)["param"] == field, r.text
        m = srv.metrics()
        assert _gauge(m, "dflash_running_requests") == 1 and _gauge(m, "dflash_waiting_requests") == 1
        assert first.is_alive() and second.is_alive()  # the refusals did not wait for them
        stop.set()
        first.join(120)
        second.join(120)
        assert waiting["r"].status_code == 200 and waiting["r"].json()["usage"]["completion_tokens"] == 4
        m = srv.metrics()
        assert m[("dflash_rejected_requests_total", ())] >= 2
        assert _gauge(m, "dflash_running_requests") == 0 and _gauge(m, "dflash_waiting_requests") == 0
        assert srv.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).status_code == 200
        r = srv.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "n": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
        assert json.loads(events[0][len("data: "):])["choices"][0]["index"] == 0
        assert "Traceback" not in srv.log.read_text()


class _Streams:
    """Streams of long completions that run until told to stop (each holds a slot)."""

    def __init__(self, srv):
        self.srv, self.stop, self.threads, self.started = srv, threading.Event(), [], []

    def start(self):
        started = threading.Event()
        body = {"model": MODEL, "prompt": PROMPT, "stream": True, "temperature": 0, "max_tokens": 1000,
                "ignore_eos": True}

        def stream():
            with httpx.stream("POST", f"{self.srv.base}/v1/completions", json=body,
                              headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as r:
                for _ in r.iter_lines():
                    started.set()
                    if self.stop.is_set():
                        return  # closes the connection

        t = threading.Thread(target=stream)
        t.start()
        self.threads.append(t)
        assert started.wait(120), self.srv.log.read_text()

    def wait_for(self, name: str, value: float):
        while _gauge(self.srv.metrics(), name) != value:
            self.stop.wait(0.05)

    def end(self):
        self.stop.set()
        for t in self.threads:
            t.join(120)
        self.wait_for("dflash_running_requests", 0)


# ``dflash-torch serve`` with a probe: as the models start loading, another socket (SO_REUSEADDR, as
# uvicorn's and most servers' are) tries to bind the server's port, and says how that went
_PROBE_THE_PORT = (
    "import socket\nfrom dflash_torch import cli\nload = cli.load_engine\n"
    "def probe(args):\n"
    "    with socket.socket() as s:\n"
    "        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "        try:\n"
    "            s.bind((args.host, args.port))\n"
    "            print('probe: the port was free while the models loaded', flush=True)\n"
    "        except OSError as e:\n"
    "            print('probe: binding the port while the models loaded:', e.strerror, flush=True)\n"
    "    return load(args)\n"
    "cli.load_engine = probe\ncli.entry()\n")


def test_sigterm_with_a_drain_timeout_lets_the_requests_taken_finish(tiny_pair, tmp_path):
    """--drain-timeout: SIGTERM while a stream runs (one slot), a request waits in the queue and a
    third one's body is still arriving: the server stops taking requests at once (a new one, and
    /health, get a 503 server_shutting_down with Retry-After; /metrics still answers), the three
    finish whole (the third taken once its body arrives), then the server exits, killed by
    SIGTERM as without a drain. Without it, SIGTERM ended them all at once (a stream's error
    event, 503s), which failed every running generation of a load balancer's rolling restart.
    And the port is the server's from the check that it is free on: while the models load,
    another socket cannot bind it (it could: the check's socket was closed, and uvicorn bound
    the port again after the load, so a process that took it meanwhile made the server fail
    late, with uvicorn's "address already in use" and exit 3)."""
    import signal
    import socket

    tokens = 600
    with _serve(tiny_pair, tmp_path, "--max-batch-size", "1", "--drain-timeout", "600", code=_PROBE_THE_PORT) as srv:
        assert "probe: binding the port while the models loaded: Address already in use" in srv.log.read_text()
        port = int(srv.base.rsplit(":", 1)[1])
        body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": tokens, "ignore_eos": True}
        headers = {"Authorization": f"Bearer {API_KEY}"}
        events, answers = [], {}

        def stream():
            with httpx.stream("POST", f"{srv.base}/v1/completions", headers=headers, timeout=120,
                              json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
                answers["stream"] = r.status_code
                events.extend(line[len("data: "):] for line in r.iter_lines() if line.startswith("data: "))

        def wait_for(name: str, value: float, at_least: bool = False):
            deadline = time.time() + 120
            while not (_gauge(srv.metrics(), name) >= value if at_least else _gauge(srv.metrics(), name) == value):
                assert time.time() < deadline, srv.log.read_text()
                time.sleep(0.02)

        # the third request first, while the server is idle: its headers and part of its body
        third = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}).encode()
        tasks = _gauge(srv.metrics(), "dflash_event_loop_tasks")  # (the /metrics request's own included)
        with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Authorization: Bearer %s\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
                         % (API_KEY.encode(), len(third)) + third[:10])
            # (its handler reads the body; and the wait for its next piece, --body-timeout's, is a task too)
            wait_for("dflash_event_loop_tasks", tasks + 1, at_least=True)
            clients = [threading.Thread(target=stream),
                       threading.Thread(target=lambda: answers.setdefault("queued", srv.post("/v1/completions", body)))]
            clients[0].start()
            wait_for("dflash_running_requests", 1)
            clients[1].start()
            wait_for("dflash_waiting_requests", 1)  # (behind the stream, which still runs)
            srv.proc.send_signal(signal.SIGTERM)
            deadline = time.time() + 60
            while (health := httpx.get(f"{srv.base}/health", timeout=10)).status_code == 200:  # (till the drain starts)
                assert time.time() < deadline, srv.log.read_text()
                time.sleep(0.02)
            streamed_at_drain = len(events)  # (the stream goes on: more come, below)
            for r in (health, srv.post("/v1/completions", {**body, "max_tokens": 2})):
                assert _assert_openai_error(r, 503)["code"] == "server_shutting_down" and int(r.headers["retry-after"]) >= 1
            assert httpx.get(f"{srv.base}/metrics", timeout=10).status_code == 200
            assert srv.proc.poll() is None  # (the third request holds the drain)
            sock.sendall(third[10:])
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        for t in clients:
            t.join(120)
        assert srv.proc.wait(60) == -15, srv.log.read_text()
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), reply
    assert json.loads(payload)["usage"]["completion_tokens"] == 4
    assert answers["stream"] == 200 and events[-1] == "[DONE]" and streamed_at_drain < len(events), events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], chunks[-2:]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == tokens
    queued = answers["queued"]
    assert queued.status_code == 200, queued.text
    assert queued.json()["choices"][0]["finish_reason"] == "length"
    assert queued.json()["usage"]["completion_tokens"] == tokens
    text = srv.log.read_text()
    assert "SIGTERM: draining" in text and "Traceback" not in text, text


def test_max_queue_0_serves_while_a_slot_is_free_and_answers_503_at_once_when_all_are_busy(tiny_pair, tmp_path):
    """--max-queue 0: no waiting places (it was refused, "--max-queue must be an integer >= 1").
    With two slots, a request runs while one stream holds a slot; with both busy, one gets
    a 503 with Retry-After at once; requests one after the other never meet a busy slot
    (a slot is free before its request's answer ends)."""
    with _serve(tiny_pair, tmp_path, "--max-batch-size", "2", "--max-queue", "0") as srv:
        assert "slots, queue 0," in srv.log.read_text()
        for _ in range(6):  # back to back
            assert srv.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).status_code == 200
        r = srv.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "n": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
        err = _assert_openai_error(srv.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 3}), 400)
        assert err["param"] == "n" and err["message"] == (
            "3 choices (1 prompt x n=3) are more than this server holds (2: 2 slots (--max-batch-size) and no waiting "
            "places (--max-queue 0))"), err
        streams = _Streams(srv)
        streams.start()
        streams.wait_for("dflash_running_requests", 1)
        r = srv.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text  # the free slot
        err = _assert_openai_error(srv.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 2}), 503)
        assert err["message"] == ("the server has no room for this request's 2 choices now: 1 of 2 slots busy "
                                  "(--max-batch-size) and no waiting places (--max-queue 0); retry in 1 s"), err
        streams.start()
        streams.wait_for("dflash_running_requests", 2)
        r = srv.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        err = _assert_openai_error(r, 503)
        assert err["code"] == "queue_full" and int(r.headers["retry-after"]) >= 1
        assert err["message"] == ("the server is full: 2 of 2 slots busy (--max-batch-size) and no waiting places "
                                  "(--max-queue 0); retry in 1 s"), err
        assert all(t.is_alive() for t in streams.threads)  # the refusal did not wait for them
        streams.end()
        assert srv.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).status_code == 200
        m = srv.metrics()
        assert m[("dflash_rejected_requests_total", ())] == 2 and _gauge(m, "dflash_waiting_requests") == 0
        assert "Traceback" not in srv.log.read_text()


def test_recompute_messages_name_it_as_the_cause_of_its_one_slot(tiny_pair, tmp_path):
    """--draft-mode recompute decodes one sequence at a time: the 400 of too many choices and
    the 503 of a full server said "1 slots, --max-batch-size" / "1 of 1 slots busy
    (--max-batch-size)", blaming a flag that had not set it (and "1 prompts")."""
    with _serve(tiny_pair, tmp_path, "--draft-mode", "recompute", "--max-queue", "1") as srv:
        assert "1 slot, queue 1," in srv.log.read_text()
        err = _assert_openai_error(srv.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 3}), 400)
        assert err["message"] == (
            "3 choices (1 prompt x n=3) are more than this server holds (2: 1 slot (--draft-mode recompute decodes "
            "one sequence at a time) and 1 waiting place (--max-queue))"), err
        streams = _Streams(srv)
        streams.start()
        streams.wait_for("dflash_running_requests", 1)
        waiting = {}
        second = threading.Thread(target=lambda: waiting.setdefault(
            "r", srv.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})))
        second.start()
        streams.wait_for("dflash_waiting_requests", 1)
        err = _assert_openai_error(srv.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}), 503)
        assert err["message"] == ("the server is full: 1 of 1 slots busy (--draft-mode recompute decodes one sequence "
                                  "at a time) and 1 of 1 waiting places taken (--max-queue); retry in 1 s"), err
        streams.end()
        second.join(120)
        assert waiting["r"].status_code == 200, waiting["r"].text


def test_max_batch_size_above_1_with_recompute_is_refused_in_one_line(tiny_pair, capsys):
    """It has no effect (one sequence at a time), as --prefix-slots and --draft-max-batch-size
    there: the CLI refuses it before loading models, and so do from_pretrained and create_app.
    Left out (or 1) it is one slot."""
    from dflash_torch import DFlashEngine
    from dflash_torch.cli import main as cli_main
    from dflash_torch.errors import DFlashError
    from dflash_torch.serving.app import create_app

    argv = ["serve", "--port", str(_free_port()), "--draft-mode", "recompute", "--target", "/nonexistent"]
    assert cli_main([*argv, "--max-batch-size", "4"]) == 2
    assert capsys.readouterr().err == ("dflash-torch: error: --max-batch-size has no effect with --draft-mode "
                                       "recompute (it decodes one sequence at a time); drop it\n")
    for ok in ([], ["--max-batch-size", "1"]):  # (then the missing target)
        assert cli_main([*argv, *ok]) == 2
        assert "--max-batch-size" not in capsys.readouterr().err
    with pytest.raises(DFlashError) as exc:
        DFlashEngine.from_pretrained(*tiny_pair, draft_mode="recompute", max_batch_size=4)
    assert str(exc.value) == ("max_batch_size has no effect with draft_mode 'recompute' (it decodes one sequence at "
                              "a time); drop it")
    engine = DFlashEngine.from_pretrained(*tiny_pair, draft_mode="recompute")
    assert engine.max_batch_size == 1
    assert DFlashEngine.from_pretrained(*tiny_pair, draft_mode="recompute", max_batch_size=1).max_batch_size == 1
    assert DFlashEngine.from_pretrained(*tiny_pair).max_batch_size == 8
    with pytest.raises(DFlashError) as exc:
        DFlashEngine(engine.target, engine.tokenizer, engine.drafter, draft_mode="recompute", max_batch_size=2)
    assert str(exc.value).startswith("max_batch_size has no effect with draft_mode 'recompute'")
    with pytest.raises(DFlashError) as exc:
        create_app(engine, max_batch_size=4)
    assert str(exc.value) == ("max_batch_size has no effect with an engine of draft_mode 'recompute' (it decodes one "
                              "sequence at a time); drop it")
    for kw in ({}, {"max_batch_size": 1}):
        app = create_app(engine, **kw)
        assert app.state.scheduler.max_batch_size == 1
        app.state.scheduler.close()


BAD_SERVE_FLAGS = [
    (["--max-queue", "-1"], "--max-queue must be an integer >= 0, got -1"),
    (["--max-batch-size", "0"], "--max-batch-size must be an integer >= 1, got 0"),
    (["--warmup-context", "0"], "--warmup-context must be an integer >= 1, got 0"),
    # (trial-309: these two were checked once the models had loaded, the range before the rule of
    # --max-batch-size 1, which said "--prefix-slots has no effect with --max-batch-size 1 ...")
    (["--prefix-slots", "-1"], "--prefix-slots must be an integer >= 0, got -1"),
    (["--prefix-slots", "-1", "--max-batch-size", "1"], "--prefix-slots must be an integer >= 0, got -1"),
    # (trial-315: the pool of shared-start snapshots was fixed at 2; its flag is checked as --prefix-slots)
    (["--shared-starts", "-1"], "--shared-starts must be an integer >= 0, got -1"),
    (["--shared-starts", "-1", "--no-prefix-reuse"], "--shared-starts must be an integer >= 0, got -1"),
    (["--shared-starts", "0", "--no-prefix-reuse"],
     "--shared-starts has no effect with --no-prefix-reuse (no prefix is reused); drop it"),
    (["--shared-starts", "3", "--draft-mode", "recompute"], "--shared-starts has no effect with --draft-mode "
     "recompute (one sequence at a time, which keeps the last request's rows only); drop it"),
    (["--draft-max-batch-size", "0"], "--draft-max-batch-size must be an integer >= 1 or 'auto', got 0"),
    (["--draft-max-batch-size", "2", "--no-draft"],
     "--draft-max-batch-size has no effect without a drafter (--no-draft: every round is target-only); drop it"),
    (["--draft-max-batch-size", "auto", "--block-size", "1"],
     "--draft-max-batch-size has no effect with --block-size 1 (every round is target-only); drop it"),
    # (as the other flags of seconds echo the value given: it said "got -1.0")
    (["--sse-keepalive", "-1"], "--sse-keepalive must be a number of seconds >= 0 (0 = no keep-alive), got -1"),
    (["--sse-keepalive", "nan"], "--sse-keepalive must be a number of seconds >= 0 (0 = no keep-alive), got nan"),
    (["--drain-timeout", "-1"], "--drain-timeout must be a number of seconds >= 0 (0: no drain), got -1"),
]


@pytest.mark.parametrize("args, line", BAD_SERVE_FLAGS, ids=[" ".join(args) for args, _ in BAD_SERVE_FLAGS])
def test_serve_refuses_bad_slot_flags_before_loading_models(args, line, capsys):
    from dflash_torch.cli import main as cli_main

    assert cli_main(["serve", "--port", str(_free_port()), *args, "--target", "/nonexistent"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"dflash-torch: error: {line}\n"
    assert "loading" not in captured.out, captured.out  # (refused before the models load)


def test_serve_refuses_warmup_context_without_compile(capsys):
    """--warmup-context only sizes the start-up compile: without --compile it would do
    nothing, so it is refused in one line (it was accepted silently)."""
    from dflash_torch.cli import main as cli_main

    assert cli_main(["serve", "--port", str(_free_port()), "--warmup-context", "100", "--target", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--warmup-context has no effect without --compile" in err[0], err


def test_serve_refuses_batch_caches_that_do_not_fit_at_start(tiny_pair, cli):
    """A --max-batch-size whose caches cannot fit is refused when serve starts, in one line
    (it served, announcing the slots, and answered every request with a 400 about caches),
    naming the flags (it said max_batch_size and max_context, the Python names)."""
    target, drafter = tiny_pair
    proc = cli("serve", "--target", str(target), "--draft", str(drafter), "--port", str(_free_port()),
               "--max-batch-size", str(10**9), "--log-level", "warning")  # (in this process: a refusal, no server)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and ("--max-batch-size 1000000000 x the target's context, 1024 tokens "
                              "(the default --max-context) need") in err[0], err
    assert "max_batch_size" not in err[0] and "max_context" not in err[0] and "lower either" in err[0], err
    assert "serving" not in proc.stdout


@pytest.fixture(scope="module")
def hybrid_chat_pair(agree_hybrid_pair, tmp_path_factory):
    """``agree_hybrid_pair`` with a chat template whose generation prompt starts the reply's
    rendering (as ChatML's does)."""
    import shutil

    target = shutil.copytree(agree_hybrid_pair[0], tmp_path_factory.mktemp("hybrid-chat") / "target")
    (target / "chat_template.jinja").write_text("{% for m in messages %}# {{ m['role'] }}:\n{{ m['content'] }}\n"
                                                "{% endfor %}{% if add_generation_prompt %}# assistant:\n{% endif %}")
    return target, agree_hybrid_pair[1]


@pytest.fixture(scope="module")
def hybrid_server(hybrid_chat_pair, tmp_path_factory):
    """A server of ``hybrid_chat_pair`` with 3 slots, for the module (a start costs ~5 s CPU)."""
    with _serve(hybrid_chat_pair, tmp_path_factory.mktemp("hybrid"), "--max-batch-size", "3") as srv:
        yield srv


def test_a_hybrid_target_is_served_in_several_slots(agree_hybrid_pair, hybrid_server):
    """A hybrid target (Gated DeltaNet + attention) gets ``--max-batch-size`` slots, and
    concurrent requests batched in them each answer as ``generate`` alone."""
    from dflash_torch import DFlashEngine

    engine = DFlashEngine.from_pretrained(*agree_hybrid_pair, max_context=256)
    prompts = PROMPTS[:3]
    expected = [engine.generate(p, max_new_tokens=24, temperature=0, ignore_eos=True).text for p in prompts]
    srv = hybrid_server
    assert "3 slots" in srv.log.read_text()
    answers = {}

    def ask(i: int):
        answers[i] = srv.post("/v1/completions", {"model": MODEL, "prompt": prompts[i], "max_tokens": 24,
                                                  "temperature": 0, "ignore_eos": True})

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [answers[i].json()["choices"][0]["text"] for i in range(3)] == expected
    assert "Traceback" not in srv.log.read_text()


def test_a_long_prompt_joins_while_a_stream_runs(server, local_engine):
    """A prompt of three prefill chunks (256 tokens each) arrives while a stream decodes:
    both answer exactly as alone."""
    c = server.client()
    text = "\n".join(PROMPTS * 40)
    ids = local_engine.encode_prompt(text)[:700]
    assert len(ids) == 700
    stream_kw, long_kw = dict(prompt=PROMPT, max_tokens=300, **_kw(0)), dict(prompt=ids, max_tokens=16, **_kw(0.9, seed=3))
    alone = [c.completions.create(**stream_kw).choices[0].text, c.completions.create(**long_kw).choices[0].text]
    stream = c.completions.create(stream=True, **stream_kw)
    first = next(iter(stream)).choices[0].text  # the stream runs
    joined = c.completions.create(**long_kw).choices[0].text
    rest, _, _ = read_completion_stream(stream)
    assert [first + rest, joined] == alone
    assert "Traceback" not in server.log.read_text()


def test_a_sequence_cancelled_while_its_prompt_is_prefilled_frees_its_slot(tiny_pair, local_engine):
    """The server's batched backend on a real engine: a prompt of three prefill chunks
    joins while a stream decodes; the stream gets a chunk every step while the prompt is
    read; the joiner, removed after two chunks (its client went away), frees its slot at
    once and leaves the rows of those chunks there (prefix reuse); the slot then serves the
    same prompt (a retry), which reads only the rest and answers as alone. (The joiner's
    prefill starts with a copy of the start it shares with the stream's prompt, from the
    stream's slot: its chunks follow those rows.)"""
    import asyncio

    from dflash_torch import DFlashEngine, compute
    from dflash_torch.serving.scheduler import BatchedBackend, Job

    engine = DFlashEngine.from_pretrained(*tiny_pair, max_batch_size=2)
    backend = BatchedBackend(engine, 2)
    batch = engine.batch_decoder()
    loop = asyncio.new_event_loop()
    job = Job(loop)
    kw = dict(temperature=0.0, top_k=0, top_p=1.0, seed=None, stop=None, stop_token_ids=None, ignore_eos=True)
    long_ids = local_engine.encode_prompt("\n".join(PROMPTS * 40))[:600]
    running = job.add(local_engine.encode_prompt(PROMPT), 80, kw)
    leaving, again = job.add(long_ids, 12, kw), job.add(long_ids, 12, kw)
    tokens = {running: [], again: []}

    def step() -> list:
        got = compute.run(backend.step)
        for seq, chunk in got:
            tokens[seq].extend(chunk.token_ids)
        return [seq for seq, _ in got]

    compute.run(backend.add, running)
    assert step() == [running]  # its prefill: nothing else runs
    compute.run(backend.add, leaving)
    assert step() == [running] and step() == [running]  # two of the three chunks
    assert batch.free_slots == 0
    compute.run(backend.remove, leaving)
    assert batch.free_slots == 1 and batch.seq_ids == [running]
    read, reused = backend.prefill_tokens, backend.reused_prefill_tokens
    compute.run(backend.add, again)
    for _ in range(100):
        if not step():
            break
    assert batch.free_slots == 2
    shared = common_start(running.prompt_ids, long_ids)  # (copied from the stream's slot before the two chunks)
    assert 0 < shared < 256
    assert reused == shared and backend.reused_prefill_tokens - reused == shared + 2 * 256
    assert backend.prefill_tokens - read == 600 - shared - 2 * 256
    assert tokens[again] == engine.generate(long_ids, max_new_tokens=12, ignore_eos=True).token_ids
    assert tokens[running] == engine.generate(running.prompt_ids, max_new_tokens=80, ignore_eos=True).token_ids
    loop.close()


def test_a_prompt_read_alone_stops_after_the_chunk_in_which_its_request_went_away(tiny_pair, local_engine):
    """The server's batched backend on a real engine: a prompt of three prefill chunks
    (256 tokens each) with no stream decoding is read whole by one step, unless its request
    went away: then the step ends after one chunk (the scheduler frees the slot after each
    step), whose rows stay (prefix reuse). The same prompt then reads only the rest, and
    answers as alone."""
    import asyncio

    from dflash_torch import DFlashEngine, compute
    from dflash_torch.serving.scheduler import BatchedBackend, Job

    engine = DFlashEngine.from_pretrained(*tiny_pair, max_batch_size=2)
    backend = BatchedBackend(engine, 2)
    batch = engine.batch_decoder()
    loop = asyncio.new_event_loop()
    kw = dict(temperature=0.0, top_k=0, top_p=1.0, seed=None, stop=None, stop_token_ids=None, ignore_eos=True)
    long_ids = local_engine.encode_prompt("\n".join(PROMPTS * 40))[:600]
    leaving_job, staying_job = Job(loop), Job(loop)
    leaving, staying = leaving_job.add(long_ids, 12, kw), staying_job.add(long_ids, 12, kw)
    read = backend.prefill_tokens
    compute.run(backend.add, leaving)
    leaving_job.cancelled.set()  # (what Job.cancel sets while the scheduler steps)
    assert compute.run(backend.step) == [] and backend.prefill_tokens - read == batch.prefill_chunk == 256
    compute.run(backend.remove, leaving)
    assert batch.free_slots == 2
    read, reused = backend.prefill_tokens, backend.reused_prefill_tokens
    compute.run(backend.add, staying)
    tokens = [chunk.token_ids for seq, chunk in compute.run(backend.step)]
    assert len(tokens) == 1 and backend.prefill_tokens - read == 600 - 256  # one step: the rest of its prefill
    assert backend.reused_prefill_tokens - reused == 256
    while batch.seq_ids:
        tokens += [chunk.token_ids for seq, chunk in compute.run(backend.step)]
    assert sum(tokens, []) == engine.generate(long_ids, max_new_tokens=12, ignore_eos=True).token_ids
    loop.close()


def test_a_prompt_read_in_the_one_slot_stops_after_the_chunk_in_which_its_request_went_away(tiny_pair, local_engine):
    """The server's one-slot backend (``--max-batch-size 1``) on a real engine: a prompt of
    three prefill chunks whose request went away is read for one chunk only, and not held
    (it was read whole); that chunk's rows stay (prefix reuse), so the same prompt then reads
    only the rest, and answers as alone."""
    import asyncio

    from dflash_torch import DFlashEngine, compute
    from dflash_torch.serving.scheduler import Job, SerialBackend

    engine = DFlashEngine.from_pretrained(*tiny_pair)
    backend = SerialBackend(engine)
    loop = asyncio.new_event_loop()
    kw = dict(temperature=0.0, top_k=0, top_p=1.0, seed=None, stop=None, stop_token_ids=None, ignore_eos=True)
    long_ids = local_engine.encode_prompt("\n".join(PROMPTS * 40))[:600]
    leaving_job, staying_job = Job(loop), Job(loop)
    leaving, staying = leaving_job.add(long_ids, 12, kw), staying_job.add(long_ids, 12, kw)
    leaving_job.cancelled.set()  # (what Job.cancel sets while the scheduler steps)
    compute.run(backend.add, leaving)
    assert backend.seq is None and backend.prefill_tokens == engine.decoder.prefill_chunk == 256
    compute.run(backend.add, staying)
    assert backend.prefill_tokens == 256 + 600 - 256 and backend.reused_prefill_tokens == 256
    tokens = []
    while backend.seq is not None:
        tokens += [chunk.token_ids for seq, chunk in compute.run(backend.step)]
    assert sum(tokens, []) == engine.generate(long_ids, max_new_tokens=12, ignore_eos=True).token_ids
    loop.close()


def test_n_choices_of_a_long_prompt_read_it_once_and_answer_as_n_requests(server, local_engine):
    """n=3 of a prompt of three prefill chunks (seeded sampling; a prompt that no earlier
    request began with): the choices equal three n=1 requests with the derived seeds,
    streamed or not; the target reads the prompt once for the request
    (``dflash_prefill_tokens_total``) and none of it for the three requests (prompt-prefix
    reuse: the rows and last logits of the first request's choices were kept). A stream of
    such a request that its client leaves after its first event frees its three slots, and
    the next request answers the same."""
    c = server.client()
    ids = local_engine.encode_prompt("n choices:\n" + "\n".join(PROMPTS * 40))[:600]
    sample = dict(prompt=ids, max_tokens=16, **_kw(0.9, seed=7, top_p=0.95))
    read = lambda: server.metrics()[("dflash_prefill_tokens_total", ())]  # noqa: E731
    before = read()
    shared = [ch.text for ch in c.completions.create(n=3, **sample).choices]
    assert read() - before == 600
    alone = [c.completions.create(**{**sample, "seed": choice_seed(7, j)}).choices[0].text for j in range(3)]
    assert shared == alone and len(set(alone)) == 3
    assert read() - before == 600
    texts, finish, _ = _streamed_choices(c.completions.create(n=3, stream=True, **sample))
    assert texts == dict(enumerate(alone)) and finish == {0: "length", 1: "length", 2: "length"}
    cancelled = server.metrics()[("dflash_requests_cancelled_total", ())]
    text, usage, _ = read_completion_stream(c.completions.create(**{**sample, "max_tokens": 300}, n=3, stream=True), 1)
    assert text and usage is None
    assert [ch.text for ch in c.completions.create(n=3, **sample).choices] == alone
    m = server.metrics()
    assert m[("dflash_requests_cancelled_total", ())] - cancelled == 3
    for name in ("dflash_running_requests", "dflash_waiting_requests", "dflash_open_requests"):
        assert _gauge(m, name) == 0, name
    assert "Traceback" not in server.log.read_text()


def test_a_request_sharing_a_prompt_being_read_when_its_first_holder_leaves(tiny_pair, local_engine):
    """The server's batched backend on a real engine, step by step: while a stream decodes,
    a request of one choice and then one of two choices with the same long prompt join
    (all three share one prefill); after one of the three chunks the first request's client
    goes away: the second request's choices take over the chunk read, the prompt is read
    once in all, and both choices answer as ``generate`` alone with their seeds."""
    import asyncio

    from dflash_torch import DFlashEngine, compute
    from dflash_torch.serving.scheduler import BatchedBackend, Job

    engine = DFlashEngine.from_pretrained(*tiny_pair, max_batch_size=4)
    backend = BatchedBackend(engine, 4)
    batch = engine.batch_decoder()
    loop = asyncio.new_event_loop()
    greedy = dict(temperature=0.0, top_k=0, top_p=1.0, seed=None, stop=None, stop_token_ids=None, ignore_eos=True)
    sampled = lambda j: {**greedy, "temperature": 0.9, "seed": choice_seed(3, j)}  # noqa: E731
    long_ids = local_engine.encode_prompt("\n".join(PROMPTS * 40))[:600]
    running = Job(loop).add(local_engine.encode_prompt(PROMPT), 80, greedy)
    leaving = Job(loop).add(long_ids, 12, sampled(0))
    job = Job(loop)
    staying = [job.add(long_ids, 12, sampled(j)) for j in range(2)]
    tokens = {seq: [] for seq in [running, *staying]}

    def step() -> list:
        got = compute.run(backend.step)
        for seq, chunk in got:
            tokens[seq].extend(chunk.token_ids)
        return [seq for seq, _ in got]

    compute.run(backend.add, running)
    assert step() == [running]
    read = backend.prefill_tokens
    for seq in [leaving, *staying]:
        compute.run(backend.add, seq)
    assert step() == [running]  # one of the three chunks
    compute.run(backend.remove, leaving)
    assert batch.free_slots == 1 and batch.seq_ids == [running, *staying]
    assert step() == [running] and set(step()) == {running, *staying}  # the last chunk: both first tokens
    for _ in range(100):
        if not step():
            break
    # (read once, after the start it shares with the stream's prompt, copied from its slot)
    assert backend.prefill_tokens - read == 600 - common_start(running.prompt_ids, long_ids) and batch.free_slots == 4
    for j, seq in enumerate(staying):
        assert tokens[seq] == engine.generate(long_ids, max_new_tokens=12, temperature=0.9, seed=choice_seed(3, j),
                                              ignore_eos=True).token_ids, j
    assert tokens[running] == engine.generate(running.prompt_ids, max_new_tokens=80, ignore_eos=True).token_ids
    loop.close()


def test_cached_tokens_count_each_prompt_once_with_a_list_and_n(server):
    """A list of two prompts with n=2 (the second extends the first, which an earlier request
    left retained): like ``usage.prompt_tokens``, ``cached_tokens`` counts each prompt once
    (the choices of a prompt share its prefill), so every prompt token is read or cached
    once (``dflash_prefill_tokens_total`` / ``dflash_reused_prefill_tokens_total``), streamed
    and not."""
    c = server.client()

    def read() -> tuple[float, float]:
        m = server.metrics()
        return m[("dflash_prefill_tokens_total", ())], m[("dflash_reused_prefill_tokens_total", ())]

    first = "def reuse_in_lists(x):\n    return [x] * 2\n"
    base = c.completions.create(prompt=first, max_tokens=4, **_kw(0.0)).usage.prompt_tokens  # (retained)
    for stream in (False, True):
        before = read()
        kw = dict(prompt=[first, first + "print(reuse_in_lists(3))\n"], max_tokens=4, n=2, **_kw(0.0))
        if stream:
            events = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
            usage = events[-1].usage
        else:
            usage = c.completions.create(**kw).usage
        after = read()
        cached = usage.prompt_tokens_details.cached_tokens
        assert after[0] - before[0] + after[1] - before[1] == usage.prompt_tokens, stream
        assert cached == after[1] - before[1], stream
        assert cached >= base - 1, stream  # (at least the first prompt's, but its last token)


def test_prompt_tokens_metric_counts_each_choice_and_says_so(server):
    """n=4 choices of a prompt: ``dflash_prompt_tokens_total`` grows by the prompt once per
    choice (as the generated tokens and the sequence gauges count choices), the prefill and
    reused counters by the prompt once (the choices share its prefill), as ``usage``; the
    metric's HELP says so (it said "Prompt tokens of started generations", read as the
    usage's count)."""
    c = server.client()

    def read() -> tuple[float, float]:
        m = server.metrics()
        return (m[("dflash_prompt_tokens_total", ())],
                m[("dflash_prefill_tokens_total", ())] + m[("dflash_reused_prefill_tokens_total", ())])

    before = read()
    usage = c.completions.create(prompt="def counted_per_choice(y):\n", max_tokens=3, n=4, **_kw(0.0)).usage
    after = read()
    assert after[0] - before[0] == 4 * usage.prompt_tokens
    assert after[1] - before[1] == usage.prompt_tokens
    text = httpx.get(f"{server.base}/metrics", timeout=30).text
    assert ("# HELP dflash_prompt_tokens_total Prompt tokens of started generations, counted for each choice (a "
            "request of n choices of a prompt: n times; its usage.prompt_tokens counts the prompt once)") in text, text


def test_cached_tokens_of_n_choices_are_those_no_choice_read(tiny_pair, tmp_path_factory):
    """n=2 choices of a prompt that extends a retained one, on 2 slots while another stream
    decodes: choice 0 takes the retained rows in the free slot, choice 1 waits for the
    stream's slot (freed here by its client leaving once choice 1 waits: a stream that ended
    by itself first, as on a loaded machine, left both slots free and the choices shared one
    prefill) and there copies choice 0's prompt rows from its slot (choice 0 decoding), all
    but the last token. ``usage`` counts the prompt once and, as cached, the tokens that no
    choice read: those choice 0 took (choice 1's count alone would claim the prompt's tokens
    that choice 0 read), streamed and not."""
    from concurrent.futures import ThreadPoolExecutor

    with _serve(tiny_pair, tmp_path_factory.mktemp("n-cached"), "--max-batch-size", "2") as srv:
        c = srv.client()

        def read() -> tuple[float, float]:
            m = srv.metrics()
            return m[("dflash_prefill_tokens_total", ())], m[("dflash_reused_prefill_tokens_total", ())]

        for stream in (False, True):
            first = f"def cached_by_choices_{int(stream)}(x):\n    return [x] * 3\n"
            c.completions.create(prompt=first, max_tokens=2, **_kw(0.0))  # (its rows retained in a free slot)
            busy = c.completions.create(prompt="class Busy:", max_tokens=900, stream=True, **_kw(0.0))
            next(iter(busy))  # decoding in the other slot
            before = read()
            # (300 tokens: choice 0 still decodes when busy's slot frees, some 100 ms after busy leaves)
            kw = dict(prompt=first + "print(3)\n", max_tokens=300, n=2, **_kw(0.0))
            if stream:
                ask = lambda: list(c.completions.create(  # noqa: E731
                    stream=True, stream_options={"include_usage": True}, **kw))[-1].usage
            else:
                ask = lambda: c.completions.create(**kw).usage  # noqa: E731
            with ThreadPoolExecutor(1) as pool:
                asked = pool.submit(ask)
                deadline = time.monotonic() + 120
                while srv.metrics()[("dflash_waiting_requests", ())] < 1:  # (choice 1 waits for busy's slot)
                    assert time.monotonic() < deadline and not asked.done()
                    time.sleep(0.05)
                busy.close()
                usage = asked.result(timeout=240)
            after = read()
            read_, reused = after[0] - before[0], after[1] - before[1]
            # each choice had a prefill of its own; choice 1 copied all but the prompt's last token
            # from choice 0, which took the retained rows (the first prompt's, less its last token)
            took = reused - (usage.prompt_tokens - 1)
            assert read_ + reused == 2 * usage.prompt_tokens and 0 < took < usage.prompt_tokens - 1, (read_, reused)
            assert usage.prompt_tokens_details.cached_tokens == took, stream


@pytest.fixture(scope="module")
def plain_server(tiny_pair, tmp_path_factory):
    """A server started with ``--no-prefix-reuse --draft-max-batch-size 1`` (neither flag
    changes an answer), for the module's two tests of them: a start costs ~4 s CPU."""
    with _serve(tiny_pair, tmp_path_factory.mktemp("plain"), "--no-prefix-reuse", "--draft-max-batch-size", "1") as srv:
        yield srv


def test_a_chat_conversation_reuses_its_history(server, plain_server):
    """Three turns of a chat through the openai client (greedy): each turn sends the whole
    conversation; the server reads only what is new (``dflash_prefill_tokens_total``: not
    the previous turn's prompt), while a server started with ``--no-prefix-reuse`` (and
    ``--draft-max-batch-size 1``) reads every prompt whole; both answer the same text. Each
    answer's ``usage.prompt_tokens_details.cached_tokens`` counts the prompt tokens not read
    (the last one streamed)."""
    def chat(srv) -> tuple[list[str], list[float]]:
        c = srv.client()
        def read() -> tuple[float, float]:
            m = srv.metrics()
            return m[("dflash_prefill_tokens_total", ())], m[("dflash_reused_prefill_tokens_total", ())]

        messages, replies, reads = [], [], []
        for k in range(3):
            messages.append({"role": "user", "content": f"turn {k} of a reuse test: " + " ".join(PROMPTS * (4 - k))})
            before = read()
            if k < 2:
                r = c.chat.completions.create(messages=messages, max_tokens=24, **_kw(0.0))
                reply, usage = r.choices[0].message.content, r.usage
            else:  # (streamed: the usage chunk)
                events = list(c.chat.completions.create(messages=messages, max_tokens=24, stream=True,
                                                        stream_options={"include_usage": True}, **_kw(0.0)))
                reply = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
                usage = events[-1].usage
            after = read()
            # every prompt token is either read or taken from a retained prefix (usage: cached_tokens)
            assert after[0] - before[0] + after[1] - before[1] == usage.prompt_tokens
            assert usage.prompt_tokens_details.cached_tokens == after[1] - before[1]
            reads.append((after[0] - before[0], usage.prompt_tokens))
            replies.append(reply)
            messages.append({"role": "assistant", "content": replies[-1]})
        return replies, reads

    replies, reads = chat(server)
    plain_replies, plain_reads = chat(plain_server)
    assert replies == plain_replies
    assert [read for read, _ in plain_reads] == [prompt for _, prompt in plain_reads]
    # the first turn: read whole but for the chat template's opening tokens, which an earlier test's
    # chat left in a retained prefix (the module's server keeps every leaver's rows)
    assert reads[0][1] == plain_reads[0][1] and reads[0][1] - 4 <= reads[0][0] <= reads[0][1]
    for k in (1, 2):  # the last turn's prompt is not read again (but for its last token or so: this
        # test template renders a reply in the history unlike its generation prompt, "# assistant:" + "\n")
        assert reads[k][0] <= reads[k][1] - reads[k - 1][1] + 2, k


def test_a_hybrid_chat_reuses_at_least_the_last_prompt(hybrid_chat_pair, hybrid_server, tmp_path_factory):
    """A hybrid target (Gated DeltaNet + attention) behind the server, a chat template whose
    generation prompt starts the reply's rendering (as ChatML's does), three chat turns
    (openai client, greedy): a reply is cut by ``max_tokens`` and re-encoded from its text,
    so the next prompt may leave the generated tokens inside the reply; each turn still
    takes at least the last prompt's rows (the slot's checkpoint of the recurrent state at
    the prompt's end), says so in ``usage.prompt_tokens_details.cached_tokens``, and
    answers as a server without prefix reuse does (the module's 3-slot server, and one with
    2 slots started with ``--no-prefix-reuse``)."""
    pair, root = hybrid_chat_pair, tmp_path_factory.mktemp("hybrid-plain")

    def chat(srv) -> tuple[list[str], list[tuple[int, int]]]:
        c, messages, replies, usages = srv.client(), [], [], []
        for k in range(3):
            messages.append({"role": "user", "content": f"turn {k}: " + " ".join(PROMPTS[k:k + 4])})
            r = c.chat.completions.create(messages=messages, max_tokens=24, **_kw(0.0))
            usages.append((r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
            replies.append(r.choices[0].message.content)
            messages.append({"role": "assistant", "content": replies[-1]})
        return replies, usages

    replies, usages = chat(hybrid_server)
    with _serve(pair, root, "--max-batch-size", "2", "--no-prefix-reuse") as plain:
        plain_replies, plain_usages = chat(plain)
    assert replies == plain_replies
    assert [cached for _, cached in plain_usages] == [0, 0, 0] and usages[0][1] == 0
    for k in (1, 2):
        assert usages[k - 1][0] <= usages[k][1] < usages[k][0], (k, usages)



def test_draft_max_batch_size_runs_busy_rounds_target_only(server, plain_server):
    """``serve --draft-max-batch-size 1`` (here with ``--no-prefix-reuse`` too): while two
    requests decode together their rounds run without drafts (``dflash_target_only_rounds_total``
    grows; a server without the flag counts none), and each answer (greedy) is that of the
    default server."""
    prompts = PROMPTS[:3]

    def ask(srv) -> tuple[list[str], float]:
        c, out = srv.client(), {}

        def run(i):
            out[i] = c.completions.create(prompt=prompts[i], max_tokens=40, **_kw(0.0)).choices[0].text

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [out[i] for i in range(len(prompts))], srv.metrics()[("dflash_target_only_rounds_total", ())]

    before = plain_server.metrics()[("dflash_target_only_rounds_total", ())]  # (the chat test's rounds: alone)
    texts, plain_rounds = ask(plain_server)
    default_texts, default_rounds = ask(server)
    assert texts == default_texts
    assert plain_rounds - before > 0 and default_rounds == 0


def test_queue_full_message_counts_waiting_sequences_as_busy_slots_first():
    """Two requests queued before the scheduler admitted either (no slot taken yet): the
    message said "behind the 2 queued (room for 2: 1 free slots, ...)"; the waiting ones
    take the free slot first, so the slot is busy and the one waiting place taken."""
    from dflash_torch.serving.scheduler import QueueFull

    assert str(QueueFull(2, 1, 1, 1)) == ("the server is full: 1 of 1 slots busy (--max-batch-size) and 1 of 1 "
                                          "waiting places taken (--max-queue); retry in 1 s")
    assert str(QueueFull(3, 2, 4, 1)) == ("the server has no room for this request's 2 choices now: 3 of 4 slots "
                                          "busy (--max-batch-size) and 0 of 1 waiting places taken (--max-queue); "
                                          "retry in 1 s")
    assert str(QueueFull(1, 1, 1, 0, slots_why="--draft-mode recompute decodes one sequence at a time")) == (
        "the server is full: 1 of 1 slots busy (--draft-mode recompute decodes one sequence at a time) and no "
        "waiting places (--max-queue 0); retry in 1 s")
