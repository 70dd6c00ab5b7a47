"""Scoring the prompt through the OpenAI-compatible server: completions ``echo`` (the prompt's
text and, with ``logprobs``, its tokens' logprobs before the completion's; ``max_tokens`` 0
scores only) and vLLM's ``prompt_logprobs`` (both endpoints), on a real ``dflash-torch serve``
subprocess (batched slots, prefix reuse on) with the real ``openai`` client.

The reference is transformers' model of the target scoring the prompt in one forward pass;
the generated part is the server's own answer to the same request without echo. The
lm-evaluation-harness ``local-completions`` loglikelihood payload is checked end to end.
"""

from __future__ import annotations

import pytest
import torch
from conftest import load_hf
from test_server import MODEL, PROMPT, _assert_openai_error
from test_server_logprobs import ATOL, MESSAGES, _text
from test_server_scheduler import _serve

from dflash_torch import DFlashEngine

LONG = "def average(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n"


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    with _serve(tiny_pair, tmp_path_factory.mktemp("echo")) as srv:
        yield srv


@pytest.fixture(scope="module")
def engine(tiny_pair):
    """The server's target in this process, for tokenizing and token strings."""
    return DFlashEngine.from_pretrained(tiny_pair[0], no_draft=True)


@pytest.fixture(scope="module")
def oracle(tiny_pair):
    return load_hf(tiny_pair[0])


def _scores(oracle, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' float32 logits over ``ids`` in one forward: row i - 1 scores token i."""
    with torch.no_grad():
        return torch.log_softmax(oracle(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check_echoed(engine, oracle, lp: dict, ids: list[int], k: int, text: str) -> None:
    """The prompt part of an echoed legacy logprobs object (its first ``len(ids)`` entries)."""
    ref = _scores(oracle, ids)
    P = len(ids)
    assert lp["tokens"][:P] == [_text(engine, t) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:P] == pytest.approx([float(ref[i - 1, ids[i]]) for i in range(1, P)], abs=ATOL)
    for i in range(1, P):
        top = lp["top_logprobs"][i]
        assert k <= len(top) <= k + 1 and top[lp["tokens"][i]] == pytest.approx(lp["token_logprobs"][i], abs=ATOL)
        best = ref[i - 1].topk(k)
        assert sorted(top.values(), reverse=True)[:k] == pytest.approx(best.values.tolist(), abs=ATOL)
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and len(offsets) == len(lp["tokens"])
    for token, offset in zip(lp["tokens"], offsets):
        if "\\x" not in token:
            assert text[offset:offset + len(token)] == token, (offset, token)


def test_echo_with_logprobs_streamed_and_not(server, engine, oracle):
    client = server.client()
    ids = engine.encode_prompt(LONG)
    kw = dict(model=MODEL, prompt=LONG, max_tokens=6, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw)
    r = client.completions.create(echo=True, **kw)
    choice = r.choices[0]
    assert choice.text == LONG + plain.choices[0].text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == plain.usage.completion_tokens == 6
    lp = choice.logprobs.model_dump()
    _check_echoed(engine, oracle, lp, ids, 2, choice.text)
    gen = plain.choices[0].logprobs.model_dump()
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert lp[key][len(ids):] == gen[key]
    assert lp["text_offset"][len(ids):] == [len(LONG) + o for o in gen["text_offset"]]
    parts = {key: [] for key in lp}
    text = []
    for ev in client.completions.create(stream=True, echo=True, **kw):
        text.append(ev.choices[0].text)
        if ev.choices[0].logprobs is not None:
            for key in parts:
                parts[key] += getattr(ev.choices[0].logprobs, key)
    assert "".join(text) == choice.text and parts == lp
    only_text = client.completions.create(**{**kw, "logprobs": None}, echo=True)
    assert only_text.choices[0].text == choice.text and only_text.choices[0].logprobs is None


def test_echo_n_and_list_prompts(server, engine, oracle):
    prompts = [PROMPT, "class A:\n    pass\n"]
    r = server.client().completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=4, temperature=0.9, seed=5,
                                           echo=True, logprobs=1, extra_body={"ignore_eos": True})
    assert len(r.choices) == 4 and r.usage.prompt_tokens == sum(len(engine.encode_prompt(p)) for p in prompts)
    for c in r.choices:
        prompt = prompts[c.index // 2]
        ids = engine.encode_prompt(prompt)
        assert c.text.startswith(prompt)
        lp = c.logprobs.model_dump()
        assert len(lp["tokens"]) == len(ids) + 4
        _check_echoed(engine, oracle, lp, ids, 1, c.text)


def _check_vllm(engine, oracle, scored: list, ids: list[int], k: int) -> None:
    """vLLM's ``prompt_logprobs``: None, then per token {id: {logprob, rank, decoded_token}}."""
    ref = _scores(oracle, ids)
    assert len(scored) == len(ids) and scored[0] is None
    for i in range(1, len(ids)):
        entry = scored[i]
        assert str(ids[i]) in entry and k <= len(entry) <= k + 1
        assert entry[str(ids[i])]["logprob"] == pytest.approx(float(ref[i - 1, ids[i]]), abs=ATOL)
        ranked = sorted((v["rank"], v["logprob"]) for v in entry.values() if v["rank"] is not None)
        assert [r for r, _ in ranked] == list(range(1, k + 1))
        assert [v for _, v in ranked] == pytest.approx(ref[i - 1].topk(k).values.tolist(), abs=ATOL)
        for t, v in entry.items():
            assert v["decoded_token"] == _text(engine, int(t))
            if v["rank"] is None:  # (only the prompt token's rank is unknown, when outside the top k)
                assert t == str(ids[i])


def test_vllm_prompt_logprobs_both_endpoints(server, engine, oracle):
    ids = engine.encode_prompt(LONG)
    r = server.post("/v1/completions", {"model": MODEL, "prompt": LONG, "max_tokens": 3, "temperature": 0,
                                        "prompt_logprobs": 3, "n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    for c in body["choices"]:
        assert c["logprobs"] is None and not c["text"].startswith(LONG)
        _check_vllm(engine, oracle, c["prompt_logprobs"], ids, 3)
    plain = server.post("/v1/completions", {"model": MODEL, "prompt": LONG, "max_tokens": 3, "temperature": 0}).json()
    assert "prompt_logprobs" not in plain["choices"][0] and plain["choices"][0]["text"] == body["choices"][0]["text"]
    chat_ids = engine.encode_prompt(MESSAGES)
    r = server.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 3,
                                             "temperature": 0, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    _check_vllm(engine, oracle, body["choices"][0]["prompt_logprobs"], chat_ids, 0)
    assert body["prompt_logprobs"] == body["choices"][0]["prompt_logprobs"]
    streamed = [getattr(ev.choices[0], "prompt_logprobs", None) for ev in server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0, stream=True, extra_body={"prompt_logprobs": 0})
        if ev.choices]
    assert [s for s in streamed if s is not None] == [body["prompt_logprobs"]]


def test_prefix_reuse_still_scores_every_prompt_token(server, engine, oracle):
    """A retained prefix covers the prompt (prefix reuse is on): a request that asks for the
    prompt's logprobs reads it whole and gets them all; one that does not still reuses it."""
    prompt = LONG + "# again\n"
    ids = engine.encode_prompt(prompt)
    client = server.client()
    kw = dict(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    first = client.completions.create(**kw)
    again = client.completions.create(**kw)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # (rows retained)
    scored = client.completions.create(echo=True, logprobs=1, **kw)
    assert scored.usage.prompt_tokens_details.cached_tokens == 0
    assert scored.choices[0].text == prompt + first.choices[0].text == prompt + again.choices[0].text
    _check_echoed(engine, oracle, scored.choices[0].logprobs.model_dump(), ids, 1, scored.choices[0].text)
    longer = client.completions.create(**{**kw, "prompt": prompt + "x = 1\n"}, echo=True, logprobs=0)
    _check_echoed(engine, oracle, longer.choices[0].logprobs.model_dump(), engine.encode_prompt(prompt + "x = 1\n"), 0,
                  longer.choices[0].text)


def test_lm_eval_loglikelihood_payload(server, engine, oracle):
    """lm-evaluation-harness ``local-completions`` loglikelihood: token-id prompts (context +
    continuation, a batch of them), ``max_tokens`` 1, greedy, ``logprobs`` 1, ``echo``; it sums
    ``token_logprobs[ctxlen:-1]`` and calls the continuation greedy when each of its tokens has
    the top logprob."""
    pairs = [("def f(x):\n    return", " x + 1"), ("import os\nimport", " sys\n"), (PROMPT, PROMPT)]
    encoded = [(engine.encode_prompt(c), engine.encode_prompt(t)) for c, t in pairs]
    payload = {"model": MODEL, "prompt": [c + t for c, t in encoded], "max_tokens": 1, "temperature": 0,
               "logprobs": 1, "echo": True, "seed": 1234}
    r = server.post("/v1/completions", payload)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for choice, (ctx, cont) in zip(choices, encoded):
        ids, ctxlen = ctx + cont, len(ctx)
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1
        ref = _scores(oracle, ids)
        want = sum(float(ref[i - 1, ids[i]]) for i in range(ctxlen, len(ids)))
        assert sum(lp["token_logprobs"][ctxlen:-1]) == pytest.approx(want, abs=1e-3)
        greedy = all(tok == max(top.values()) for tok, top in zip(lp["token_logprobs"][ctxlen:-1],
                                                                 lp["top_logprobs"][ctxlen:-1]))
        assert greedy == all(int(ref[i - 1].argmax()) == ids[i] for i in range(ctxlen, len(ids)))


def test_max_tokens_zero_scores_the_prompt_only(server, engine, oracle):
    """... and generates nothing: usage.completion_tokens 0, and the metrics' generated tokens
    (its one decoded token is dropped) and time to first token leave it out, as they say."""
    ids = engine.encode_prompt(LONG)
    client = server.client()
    before = server.metrics()
    kw = dict(model=MODEL, prompt=LONG, max_tokens=0, echo=True, logprobs=2, temperature=0)
    r = client.completions.create(**kw)
    c = r.choices[0]
    assert c.text == LONG and c.finish_reason == "length" and r.usage.completion_tokens == 0
    lp = c.logprobs.model_dump()
    assert len(lp["tokens"]) == len(ids)
    _check_echoed(engine, oracle, lp, ids, 2, c.text)
    events = [ev.choices[0] for ev in client.completions.create(stream=True, **kw)]
    assert "".join(e.text for e in events) == LONG and events[-1].finish_reason == "length"
    assert sum(len(e.logprobs.tokens) for e in events if e.logprobs is not None) == len(ids)
    after = server.metrics()
    for name in ("dflash_generated_tokens_total", "dflash_time_to_first_token_seconds_count"):
        assert after[(name, ())] == before[(name, ())], name
    assert after[("dflash_prompt_tokens_total", ())] == before[("dflash_prompt_tokens_total", ())] + 2 * len(ids)


@pytest.mark.parametrize("path,body,param,message", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "0 only with echo"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, "max_tokens", "0 only with echo"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens", "must be 0"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", "less than or equal to 20"),
    ("/v1/chat/completions", {"messages": MESSAGES, "prompt_logprobs": -1}, "prompt_logprobs", "greater than"),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, "echo", None),
    ("/v1/chat/completions", {"messages": MESSAGES, "echo": True}, "echo", "not supported in chat"),
], ids=["max_tokens 0 without echo", "chat max_tokens 0", "min_tokens with max_tokens 0", "prompt_logprobs 21",
        "prompt_logprobs -1", "echo not a bool", "echo in chat"])
def test_refused(server, path, body, param, message):
    err = _assert_openai_error(server.post(path, {"model": MODEL, **body}), 400)
    assert err["param"] == param, err
    if message is not None:
        assert message in err["message"], err
