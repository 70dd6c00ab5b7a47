"""Request fields through the OpenAI-compatible server, on a real ``dflash-torch serve``
subprocess with the real ``openai`` client and raw HTTP: fields the server does not know,
inside the request's objects too, are logged once by their path (and ignored); vLLM's
``stream_options.continuous_usage_stats``; a chat that overflows the context names
``messages`` (Responses: ``input``)."""

from __future__ import annotations

import re
import time

import pytest
from test_server import LONG_PROMPT, MODEL, _assert_openai_error
from test_server_scheduler import _serve

LOGGED = re.compile(r"WARNING: .*: (ignored|passed) the request fields? (.*?) (?:\(not known|to the chat template)")


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    with _serve(tiny_pair, tmp_path_factory.mktemp("fields")) as srv:
        yield srv


def _logged(server, want: int) -> list[tuple[str, str]]:
    """``(ignored | passed, path)`` of each field the server's log names (waiting for ``want`` of them)."""
    for _ in range(50):
        found = [(m.group(1), name) for m in LOGGED.finditer(server.log.read_text())
                 for name in re.findall(r"'([^']*)'", m.group(2))]
        if len(found) >= want:
            break
        time.sleep(0.1)
    return found


PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "strcit_free": True}}, "required": ["city"]}
# each field an OpenAI client sends (the assistant message as the client got it back, ...) and each
# free-form object (a JSON schema, logit_bias, chat_template_kwargs, a call's arguments) holds no warning
CHAT = {
    "model": MODEL, "max_tokens": 2, "temperature": 0,
    "messages": [
        {"role": "system", "content": "be brief", "name": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "weather?"}], "name": "u", "nmae": "typo"},
        {"role": "assistant", "content": None, "refusal": None, "annotations": [], "audio": None,
         "function_call": None,
         "tool_calls": [{"id": "call_1", "type": "function", "index": 0,  # (kept by clients that joined deltas)
                         "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit_free": 1}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "user", "content": "thanks"},
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                                "parameters": PARAMETERS, "strict": True, "strcit": True}}],
    "tool_choice": "auto", "parallel_tool_calls": True,
    "logit_bias": {"5": 1.0}, "chat_template_kwargs": {"enable_thinking": False, "nested_free": {"a": 1}},
    "response_format": {"type": "json_schema",
                        "json_schema": {"name": "w", "description": "d", "strict": True, "strcit": True,
                                        "schema": {"type": "object", "additionalProperties_free": 1}}},
}
RESPONSES = {
    "model": MODEL, "max_output_tokens": 2, "temperature": 0, "instructions": "be brief",
    "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x = "}], "nmae": "typo"},
        # (an output of an earlier response sent back as input, as the client got it)
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None, "status": "completed",
         "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "1", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{}", "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": "2", "id": "fco_1", "status": "completed"},
    ],
    "text": {"fromat": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}, "verbosity": "low"},
    "reasoning": {"efort": "low", "summary": "auto"}, "metadata": {"k_free": "v"},
    "structured_outputs": {"regex": "[0-9]+", "disable_fallback": True, "disable_fallbak": True},
    "tools": [{"type": "function", "name": "f", "description": "d", "parameters": PARAMETERS, "strict": True,
               "strcit": True}],
    "stream": True, "stream_options": {"include_obfuscation": False},
}


def test_unknown_fields_in_the_request_objects_are_logged_by_path_once(server):
    """A misspelt field inside an object (``text.fromat``, ``stream_options.include_usgae``,
    ``messages[].nmae``, ...) is ignored, as a top-level one is, and logged once by its path; a
    tool function's unknown field reaches the chat template, and its log says so; the fields
    OpenAI clients send and the free-form objects' contents are not logged."""
    for _ in range(2):  # (each logged once)
        r = server.post("/v1/chat/completions", CHAT)
        assert r.status_code == 200, r.text
        r = server.post("/v1/chat/completions", {**CHAT, "response_format": None, "stream": True,
                                                 "stream_options": {"include_usgae": True, "include_obfuscation": True}})
        assert r.status_code == 200 and '"usage"' not in r.text, r.text  # (include_usage misspelt: not honoured)
        r = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True,
                                            "stream_options": {"include_usage": True, "include_usgae": True},
                                            "structured_outputs": {"regex": "[a-z]+", "disable_fallback": True}})
        assert r.status_code == 200 and '"usage": {' in r.text, r.text
        for body in ({"model": MODEL, "prompt": "hi", "add_special_tokenz": False, "temperature": 0.5},
                     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "return_tokn_strs": True,
                      "max_tokens": 3}):  # (/tokenize: the known fields it does not read are not logged)
            r = server.post("/tokenize", body)
            assert r.status_code == 200 and r.json()["count"] > 0, r.text
        r = server.post("/v1/responses", RESPONSES)
        assert r.status_code == 200, r.text
        # (text.format misspelt: not applied, the response says text)
        assert '"text": {"format": {"type": "text"}, "verbosity": "low"}' in r.text, r.text
    want = [("ignored", "messages[].nmae"), ("ignored", "response_format.json_schema.strcit"),
            ("passed", "tools[].function.strcit"), ("ignored", "stream_options.include_usgae"),
            ("ignored", "text.fromat"), ("ignored", "reasoning.efort"), ("ignored", "input[].nmae"),
            ("ignored", "structured_outputs.disable_fallbak"), ("passed", "tools[].strcit"),
            ("ignored", "add_special_tokenz"), ("ignored", "return_tokn_strs")]
    found = _logged(server, len(want))
    assert sorted(found) == sorted(want), found
    assert "WARNING:  /v1/responses: ignored the request fields 'text.fromat', 'reasoning.efort', 'input[].nmae', " \
           "'structured_outputs.disable_fallbak' (not known to this server; each logged once)" in server.log.read_text()


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(server):
    """vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): each chunk's
    ``usage`` counts the prompt and the tokens generated so far; the last chunk has the whole usage."""
    c = server.client()
    options = {"include_usage": True, "continuous_usage_stats": True}
    for chat in (True, False):
        kw = dict(model=MODEL, max_tokens=6, temperature=0, stream=True, stream_options=options,
                  extra_body={"ignore_eos": True})
        stream = c.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw) if chat else \
            c.completions.create(prompt="def f(x):", **kw)
        chunks = list(stream)
        last = chunks[-1]
        assert not last.choices and last.usage.completion_tokens == 6, last
        prompt = last.usage.prompt_tokens
        counts = []
        for chunk in chunks[:-1]:
            u = chunk.usage
            assert u.prompt_tokens == prompt and u.total_tokens == prompt + u.completion_tokens, chunk
            counts.append(u.completion_tokens)
        assert counts == sorted(counts) and counts[-1] == 6 and counts[0] == (0 if chat else 1), counts
        # without it: usage null on the chunks, as before
        kw["stream_options"] = {"include_usage": True}
        plain = list(c.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw) if chat else
                     c.completions.create(prompt="def f(x):", **kw))
        assert all(chunk.usage is None for chunk in plain[:-1]) and plain[-1].usage.completion_tokens == 6
    # n choices: each chunk counts its own choice's tokens (as vLLM), the last one all of them
    chunks = list(c.completions.create(model=MODEL, prompt="def f(x):", n=2, max_tokens=6, temperature=0, stream=True,
                                       stream_options=options, extra_body={"ignore_eos": True}))
    seen = {0: [], 1: []}
    for chunk in chunks[:-1]:
        seen[chunk.choices[0].index].append(chunk.usage.completion_tokens)
    assert all(v == sorted(v) and v[-1] == 6 for v in seen.values()), seen
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == prompt
    # continuous_usage_stats alone (no include_usage): no usage at all, as vLLM
    r = server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 2, "stream": True,
                                             "stream_options": {"continuous_usage_stats": True}})
    assert r.status_code == 200 and '"usage"' not in r.text, r.text


def test_a_chat_that_overflows_the_context_names_messages_and_its_code(server):
    """A chat whose messages do not fit the context is a 400 about ``messages`` (Responses:
    ``input``), not about a ``prompt`` the request does not have; a completion's stays ``prompt``.
    Every such 400 (the prompt, the prompt with max_tokens, a prompt refused from its length in
    characters) has OpenAI's code ``context_length_exceeded`` (it had none, trial-170), so that
    clients tell it from other bad requests."""
    messages = [{"role": "user", "content": LONG_PROMPT}]
    overflow = "context_length_exceeded"
    for stream in (False, True):
        err = _assert_openai_error(server.post("/v1/chat/completions", {"model": MODEL, "messages": messages,
                                                                        "max_tokens": 4, "stream": stream}), 400)
        assert err["param"] == "messages" and "does not fit the model's context" in err["message"], err
        assert err["code"] == overflow, err
        err = _assert_openai_error(server.post("/v1/responses", {"model": MODEL, "input": LONG_PROMPT,
                                                                 "max_output_tokens": 4, "stream": stream}), 400)
        assert err["param"] == "input" and "does not fit the model's context" in err["message"], err
        assert err["code"] == overflow, err
    err = _assert_openai_error(server.post("/v1/completions", {"model": MODEL, "prompt": LONG_PROMPT,
                                                               "max_tokens": 4}), 400)
    assert err["param"] == "prompt" and err["code"] == overflow, err
    err = _assert_openai_error(server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 5000}), 400)
    assert err["param"] == "max_tokens" and "exceed the model's context" in err["message"], err
    assert err["code"] == overflow, err
    err = _assert_openai_error(server.post("/v1/completions", {"model": MODEL, "prompt": "x" * 10**6}), 400)
    assert "characters: more than the context" in err["message"] and err["code"] == overflow, err
    # (scoring, max_tokens 0 with echo: one position more than the prompt, said so; it said a token must be generated)
    score = {"model": MODEL, "max_tokens": 0, "echo": True, "logprobs": 0}
    err = _assert_openai_error(server.post("/v1/completions", {**score, "prompt": [5] * 1024}), 400)
    assert err["message"] == ("the prompt (1024 tokens) does not fit the model's context of 1024 tokens (scoring a "
                              "prompt takes a position more: at most 1023 tokens)") and err["code"] == overflow, err
    assert server.post("/v1/completions", {**score, "prompt": [5] * 1023}).status_code == 200
    err = _assert_openai_error(server.post("/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 4}), 400)
    assert err["param"] == "prompt" and err["code"] is None, err  # (an empty prompt is another bad request)


def test_responses_instructions_that_alone_overflow_the_context_are_named(server):
    """trial-317 (e): a 50,000-character ``instructions`` got the 400 context_length_exceeded
    with param ``input``, a field that was short. Now ``instructions`` where they alone do not
    fit (with a long input too); ``input`` where the two together overflow."""
    overflow = "context_length_exceeded"
    long = LONG_PROMPT * (50_000 // len(LONG_PROMPT) + 1)
    half = "def f(x):\n    return x\n" * 60  # (about 600 tokens: fits alone, not twice)
    for instructions, text, param in ((long[:50_000], "hi", "instructions"), (LONG_PROMPT, "hi", "instructions"),
                                      (LONG_PROMPT, LONG_PROMPT, "instructions"), (half, half, "input"),
                                      ("be brief", LONG_PROMPT, "input")):
        for stream in (False, True):
            err = _assert_openai_error(server.post("/v1/responses", {
                "model": MODEL, "instructions": instructions, "input": text, "max_output_tokens": 4,
                "stream": stream}), 400)
            assert (err["param"], err["code"]) == (param, overflow), (len(instructions), len(text), err)


def test_min_tokens_above_the_room_a_prompt_leaves_names_that_room_not_a_max_tokens_never_sent(server):
    """A request without max_tokens whose prompt leaves fewer tokens than its min_tokens: the
    400 says min_tokens exceeds the tokens left after the prompt (it said "min_tokens (20) must
    be at most max_tokens (4)", the default cut to the room, a value the client never sent):
    completions (each prompt of several), chat and Responses; a max_tokens sent stays named."""
    ctx = server.post("/tokenize", {"model": MODEL, "prompt": "a"}).json()["max_model_len"]
    room_line = "min_tokens (20) exceeds the 4 tokens left in the context of {} tokens after the prompt ({} tokens)"
    ids = [66] * (ctx - 4)
    ten = room_line.replace("(20)", "(10)")  # (completions' default is 16: within it, the room is what is short)
    err = _assert_openai_error(server.post("/v1/completions", {"model": MODEL, "prompt": ids, "min_tokens": 10}), 400)
    assert (err["message"], err["param"], err["code"]) == (ten.format(ctx, ctx - 4), "min_tokens",
                                                           "context_length_exceeded"), err  # (it had none, trial-173)
    err = _assert_openai_error(server.post("/v1/completions", {"model": MODEL, "prompt": [[66] * 5, ids],
                                                               "min_tokens": 10}), 400)
    assert (err["message"], err["param"]) == ("prompt 1: " + ten.format(ctx, ctx - 4), "min_tokens"), err
    err = _assert_openai_error(server.post("/v1/completions", {"model": MODEL, "prompt": ids, "min_tokens": 20,
                                                               "max_tokens": 4}), 400)
    assert (err["message"], err["param"]) == ("min_tokens (20) must be at most max_tokens (4)", "min_tokens"), err
    assert err["code"] is None  # (not about the context)
    ok = server.post("/v1/completions", {"model": MODEL, "prompt": ids, "min_tokens": 4, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4, ok.text
    # above completions' default of 16: that default is named (not "max_tokens (16)", a value never sent), and
    # no prompt, as it is every prompt's
    for prompt in ([66] * 5, [[66] * 5, ids]):
        err = _assert_openai_error(server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "min_tokens": 20}), 400)
        assert (err["message"], err["param"]) == (
            "min_tokens (20) exceeds the default max_tokens (16), which applies where none is given", "min_tokens"), err
    # a chat (and a Response) whose rendered messages leave 4 tokens
    def count(k):
        return server.post("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "a " * k}]}).json()["count"]
    k = ctx // 2
    while count(k) < ctx - 4:
        k += max(1, (ctx - 4 - count(k)) // 2)
    while count(k) > ctx - 4:
        k -= 1
    n = count(k)
    assert ctx - 20 < n <= ctx - 4, n
    line = room_line.replace("4 tokens left", f"{ctx - n} tokens left").format(ctx, n)
    err = _assert_openai_error(server.post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "a " * k}], "min_tokens": 20}), 400)
    assert (err["message"], err["param"]) == (line, "min_tokens"), err
    err = _assert_openai_error(server.post("/v1/responses", {
        "model": MODEL, "input": [{"role": "user", "content": "a " * k}], "min_tokens": 20}), 400)
    assert (err["message"], err["param"]) == (line, "min_tokens"), err
