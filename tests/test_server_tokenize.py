"""vLLM's ``/tokenize`` and ``/detokenize`` on a real ``dflash-torch serve`` subprocess: the
tokens are exactly those the same completion or chat request prefills (its
``usage.prompt_tokens`` and :meth:`DFlashEngine.encode_prompt` of the same prompt in this
process), and the text of token ids is the engine's decoding of them."""

from __future__ import annotations

import pytest
from test_server import MODEL, PROMPT, _assert_openai_error
from test_server_scheduler import _serve

from dflash_torch import DFlashEngine

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):"}]
TOOLS = [{"type": "function", "function": {"name": "run", "description": "Run code.",
                                           "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    with _serve(tiny_pair, tmp_path_factory.mktemp("tokenize")) as srv:
        yield srv


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return DFlashEngine.from_pretrained(tiny_pair[0], no_draft=True)


def _tokens(server, body: dict) -> dict:
    r = server.post("/tokenize", {"model": MODEL, **body})
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"count", "max_model_len", "tokens", "token_strs"} and out["count"] == len(out["tokens"])
    return out


def test_a_prompt_tokenizes_as_its_completion_prefills(server, engine):
    client = server.client()
    out = _tokens(server, {"prompt": PROMPT})
    assert out["tokens"] == engine.encode_prompt(PROMPT) and out["token_strs"] is None
    assert out["count"] == client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).usage.prompt_tokens
    assert out["max_model_len"] == client.models.list().data[0].model_extra["max_model_len"]
    assert _tokens(server, {"prompt": [5, 9, 11]})["tokens"] == [5, 9, 11]  # (token ids as they are)
    # it reads only what tokenizing reads: sampling fields a completion would refuse do not matter
    assert _tokens(server, {"prompt": PROMPT, "best_of": 3, "max_tokens": 0})["tokens"] == out["tokens"]
    # nor sampling values a completion refuses alone (helper-27: 400s), in either kind of request
    bad_sampling = {"temperature": 99, "max_tokens": -5, "n": 0, "logit_bias": {"x": 1}, "stop": 17}
    assert _tokens(server, {"prompt": PROMPT, **bad_sampling})["tokens"] == out["tokens"]
    assert _tokens(server, {"messages": MESSAGES, **bad_sampling})["tokens"] == engine.encode_prompt(MESSAGES)
    # and a text too long for the context is tokenized anyway: count may exceed max_model_len (as vLLM)
    long = _tokens(server, {"prompt": PROMPT * (engine.max_prompt_chars // len(PROMPT) + 2)})
    assert long["count"] > long["max_model_len"]
    strs = _tokens(server, {"prompt": PROMPT, "return_token_strs": True, "add_special_tokens": True})["token_strs"]
    assert strs == engine.tokenizer.convert_ids_to_tokens(out["tokens"])


def test_messages_tokenize_as_their_chat_completion_prefills(server, engine):
    client = server.client()
    out = _tokens(server, {"messages": MESSAGES})
    assert out["tokens"] == engine.encode_prompt(MESSAGES)
    assert out["count"] == client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1).usage.prompt_tokens
    with_tools = _tokens(server, {"messages": MESSAGES, "tools": TOOLS, "add_generation_prompt": True})
    assert with_tools["tokens"] == engine.encode_prompt(MESSAGES, tools=TOOLS)
    assert with_tools["count"] == client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                                                 max_tokens=1).usage.prompt_tokens


def test_detokenize_is_the_text_of_the_tokens(server, engine):
    ids = _tokens(server, {"prompt": "print('héllo')  # ünïcode\n"})["tokens"]
    r = server.post("/detokenize", {"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": engine.decode(ids)}
    assert r.json()["prompt"].endswith("print('héllo')  # ünïcode\n")


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/tokenize", {"prompt": [3, 10 ** 9]}, 400, "prompt"),
    ("/tokenize", {"prompt": ""}, 400, "prompt"),  # (200 with count 0, where a completion refuses it)
    ("/tokenize", {"prompt": PROMPT, "add_special_tokens": False}, 400, "add_special_tokens"),
    # (a chat's template options are honoured as in chat completions; both true contradict each other)
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"prompt": PROMPT, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ 'x' }}"}, 400, "chat_template"),  # (was ignored)
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"prompt": PROMPT, "messages": MESSAGES}, 400, "messages"),  # (messages were taken silently)
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": PROMPT, "model": "other"}, 404, "model"),
    ("/tokenize", {"prompt": PROMPT, "return_token_strs": "yes"}, 400, "return_token_strs"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_bad_requests_are_openai_errors_naming_the_field(server, path, body, status, param):
    err = _assert_openai_error(server.post(path, body), status)
    assert err["param"] == param, err


def test_the_api_key_is_needed(server):
    for path, body in (("/tokenize", {"prompt": PROMPT}), ("/detokenize", {"tokens": [1]})):
        assert server.post(path, body, key=None).status_code == 401
        assert server.post(path, body, key="wrong").status_code == 401


def test_tokenize_and_detokenize_are_counted_as_their_own_endpoints(server):
    """(helper-27: both were counted as endpoint="other")"""
    _tokens(server, {"prompt": PROMPT})
    assert server.post("/detokenize", {"model": MODEL, "tokens": [1]}).status_code == 200
    m = server.metrics()
    for path in ("/tokenize", "/detokenize"):
        assert m[("dflash_requests_total", (("endpoint", path), ("status", "200")))] >= 1, path
