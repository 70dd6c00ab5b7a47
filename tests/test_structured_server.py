"""Structured outputs in the OpenAI-compatible server and the CLI: ``response_format``
(``json_object``, ``json_schema``), vLLM's ``structured_outputs`` and ``guided_*`` fields,
chat ``tool_choice`` ``required`` / a named function (hermes and qwen3_coder tool calls constrained by a
grammar), and ``dflash-torch generate --json-schema / --json-object / --regex / --choice /
--grammar``.

Real servers of the shipped pair (``dflash-torch serve``) and the ``openai`` client. Oracles:
the outputs parse and match their constraint (a small JSON-schema check written here, a
regex fullmatch, membership of the choices); greedy speculative output equals a
``--no-draft`` (target-only) server's for the same request (lossless); tool calls equal
target-only decoding with the grammar the server builds (:func:`hermes_grammar`)."""

from __future__ import annotations

import json
import re
from contextlib import ExitStack

import httpx
import openai
import pytest
from test_server import MODEL
from test_server_scheduler import _serve, _streamed_choices

from dflash_torch import DFlashEngine, DFlashError
from dflash_torch.engine import DEFAULT_DRAFTER, DEFAULT_TARGET
from dflash_torch.serving.tools import hermes_grammar

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "admin"],
          "properties": {"name": {"enum": ["Ann", "Bob"]}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "admin": {"type": "boolean"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "days"],
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "properties": {}}}}
TOOLS = [WEATHER, TIME]
MESSAGES = [{"role": "user", "content": "Who is it? Answer in JSON."}]
REGEX = r"[0-9]{2,4}(\.[0-9]{1,2})?"
CHOICES = ["alpha", "beta", "gamma"]


def conforms(value, schema: dict) -> bool:
    """``value`` is valid under ``schema`` (the keywords the schemas here use)."""
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(value, dict) or not all(k in value for k in schema.get("required", [])):
            return False
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False and set(value) - set(props):
            return False
        return all(conforms(v, props[k]) for k, v in value.items() if k in props)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool) and \
            schema.get("minimum", value) <= value <= schema.get("maximum", value)
    if kind == "boolean":
        return isinstance(value, bool)
    return kind is None


def test_the_schema_check_can_fail():
    assert conforms({"name": "Ann", "age": 3, "admin": False}, PERSON)
    for bad in ({"name": "Cy", "age": 3, "admin": False}, {"name": "Ann", "age": 100, "admin": False},
                {"name": "Ann", "age": True, "admin": False}, {"name": "Ann", "age": 3}, [1],
                {"name": "Ann", "age": 3, "admin": 0}, {"name": "Ann", "age": 3, "admin": False, "x": 1}):
        assert not conforms(bad, PERSON), bad


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(speculative, target-only) servers of the shipped pair, both writing hermes tool calls."""
    logdir = tmp_path_factory.mktemp("structured")
    with ExitStack() as stack:
        spec = stack.enter_context(_serve((DEFAULT_TARGET, DEFAULT_DRAFTER), logdir, "--max-batch-size", "4",
                                          "--tool-call-parser", "hermes"))
        alone = stack.enter_context(_serve((DEFAULT_TARGET, None), logdir, "--no-draft", "--max-batch-size", "4",
                                           "--tool-call-parser", "qwen3_coder"))
        yield spec.client(), alone.client()


def _chat(client, **kw):
    """A chat completion of MESSAGES (greedy, at most 400 tokens, unless ``kw`` says otherwise)."""
    return client.chat.completions.create(**{"model": MODEL, "messages": MESSAGES, "temperature": 0,
                                             "max_tokens": 400, **kw})


def _complete(client, **kw):
    """A completion of ``x = `` (greedy, at most 400 tokens, unless ``kw`` says otherwise)."""
    return client.completions.create(**{"model": MODEL, "prompt": "x = ", "temperature": 0, "max_tokens": 400, **kw})


def test_json_schema_and_json_object_are_lossless_streamed_and_not_with_n_and_logprobs(servers):
    """(The long JSON requests are sent at once, to be decoded together: this model's JSON is
    hundreds of tokens of whitespace, and one round of several sequences costs little more
    than one of one.)"""
    from concurrent.futures import ThreadPoolExecutor

    # (a longer timeout: the requests beyond the server's 4 slots wait for the others)
    spec, alone = (client.with_options(timeout=600) for client in servers)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    # the schema as vLLM's json (an object, or its text) and guided_json: the same constraint
    same = ({"structured_outputs": {"json": PERSON}}, {"structured_outputs": {"json": json.dumps(PERSON)}},
            {"guided_json": PERSON})
    with ThreadPoolExecutor(6) as pool:
        asked = pool.submit(_chat, spec, response_format=fmt, n=2, logprobs=True, top_logprobs=2)
        wanted = pool.submit(_chat, alone, response_format=fmt)
        streamed = pool.submit(lambda: _streamed_choices(_chat(spec, response_format=fmt, stream=True)))
        alike = [pool.submit(_chat, spec, extra_body=body) for body in same]
        r, want = asked.result(), wanted.result()
        streamed, alike = streamed.result(), [a.result() for a in alike]
    content = want.choices[0].message.content
    assert conforms(json.loads(content), PERSON), content
    for choice in r.choices:  # (greedy: both choices are the target's output)
        assert choice.message.content == content and choice.finish_reason == "stop"
        assert len(choice.logprobs.content) == r.usage.completion_tokens // 2
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
        # (drafts were taken: not trivially equal; this test model's JSON is hard to guess, tau ~1.1,
        # now that the whitespace default keeps it from writing runs of 32 newlines, which it guessed)
        assert choice.model_extra["dflash"]["mean_acceptance_length"] > 1
    text, finish, _ = streamed
    assert text == {0: content} and finish == {0: "stop"}
    # json_object, on /v1/completions too (OpenAI's field; vLLM's structured_outputs.json_object the same)
    json_object = {"response_format": {"type": "json_object"}}  # (the openai client's completions lack the field)
    obj = _complete(alone, extra_body=json_object).choices[0].text
    assert isinstance(json.loads(obj), dict)
    assert _complete(spec, extra_body=json_object).choices[0].text == obj
    assert _complete(spec, extra_body={"structured_outputs": {"json_object": True}}).choices[0].text == obj
    # a json_schema field beside type json_object is not read (trial-277: a 400, json_schema.schema missing)
    stray = {"response_format": {"type": "json_object", "json_schema": {"name": "x"}}}
    assert _complete(spec, extra_body=stray).choices[0].text == obj
    # type text: no constraint
    plain = _complete(spec, max_tokens=6, extra_body={"response_format": {"type": "text"}})
    assert plain.choices[0].text == _complete(alone, max_tokens=6).choices[0].text and plain.usage.completion_tokens == 6
    for body, got in zip(same, alike):  # (vLLM's json and guided_json: the same constraint)
        assert got.choices[0].message.content == content, body


def test_disable_any_whitespace_is_the_whitespace_pattern_nothing(servers):
    """vLLM's structured_outputs.disable_any_whitespace true: JSON without whitespace (as the
    whitespace pattern ""), beside response_format too; with another kind of constraint it has
    nothing to do; with a whitespace pattern as well, a 400."""
    spec, alone = servers
    person = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    loose = _complete(alone, extra_body={"response_format": person}).choices[0].text
    assert re.search(r"\s", loose), loose  # (guard: this model writes whitespace in JSON by default)
    tight = _complete(alone, extra_body={"guided_json": PERSON, "guided_whitespace_pattern": ""}).choices[0].text
    assert not re.search(r"\s", tight) and conforms(json.loads(tight), PERSON), tight
    for body in ({"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}},
                 {"response_format": person, "structured_outputs": {"disable_any_whitespace": True}}):
        assert _complete(spec, extra_body=body).choices[0].text == tight, body
        assert _complete(alone, extra_body=body).choices[0].text == tight, body
    assert _complete(spec, extra_body={"structured_outputs": {"json": PERSON, "disable_any_whitespace": False}}
                     ).choices[0].text == loose
    regex = _complete(spec, extra_body={"guided_regex": REGEX}).choices[0].text
    assert _complete(spec, extra_body={"structured_outputs": {"regex": REGEX, "disable_any_whitespace": True}}
                     ).choices[0].text == regex
    with pytest.raises(openai.BadRequestError) as err:
        _complete(spec, extra_body={"guided_whitespace_pattern": " ", "structured_outputs": {
            "json_object": True, "disable_any_whitespace": True}})
    assert err.value.body["param"] == "structured_outputs" and "both given" in err.value.body["message"]


def test_regex_choice_and_grammar_are_lossless(servers):
    spec, alone = servers
    cases = [({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
             ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
             ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
             ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
             ({"structured_outputs": {"grammar": 'start: "yes" | "no" | "n" DIGIT\nDIGIT: /[0-9]/'}},
              lambda t: re.fullmatch(r"yes|no|n[0-9]", t)),
             ({"guided_grammar": 'start: "(" start ")" | "x"'}, lambda t: re.fullmatch(r"\(*x\)*", t) and t.count("(") == t.count(")"))]
    for body, ok in cases:
        want = _complete(alone, extra_body=body, logprobs=0).choices[0]
        assert ok(want.text) and want.finish_reason == "stop", (body, want)
        got = _complete(spec, extra_body=body, logprobs=1, n=2)
        assert [c.text for c in got.choices] == [want.text] * 2, body
        assert len(got.choices[0].logprobs.tokens) == got.usage.completion_tokens // 2
        text, finish, usage = _streamed_choices(_complete(spec, extra_body=body, stream=True,
                                                          stream_options={"include_usage": True}))
        assert text == {0: want.text} and finish == {0: "stop"}
        assert usage.completion_tokens == got.usage.completion_tokens // 2 == len(want.logprobs.tokens)
        chat = _chat(spec, extra_body=body).choices[0].message.content
        assert ok(chat) and chat == _chat(alone, extra_body=body).choices[0].message.content, body


def test_sampled_constrained_outputs_match_their_constraint(servers):
    spec, _ = servers
    r = _complete(spec, temperature=1.0, seed=3, n=4, extra_body={"guided_choice": CHOICES})
    assert all(c.text in CHOICES for c in r.choices)
    r = _chat(spec, temperature=0.8, seed=5, n=3, response_format={"type": "json_schema", "json_schema": {
        "name": "p", "schema": PERSON}})
    assert all(conforms(json.loads(c.message.content), PERSON) for c in r.choices)
    r = _complete(spec, temperature=1.0, seed=1, n=3, extra_body={"structured_outputs": {"regex": REGEX}})
    assert all(re.fullmatch(REGEX, c.text) for c in r.choices)


def _calls(tool_calls) -> list[tuple[str, dict]]:
    assert all(c.type == "function" and c.id.startswith("call_") for c in tool_calls)
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


def _schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS + [NOTE] if t["function"]["name"] == name)


def test_tool_choice_required_and_named_give_tool_calls_equal_to_target_only(servers, engine):
    spec, _ = servers
    alone = engine
    for tool_choice, extra, name, parallel in [("required", {"parallel_tool_calls": False}, None, False),
                                               ({"type": "function", "function": {"name": "get_time"}}, {}, "get_time",
                                                True),
                                               ({"type": "function", "function": {"name": "get_weather"}}, {},
                                                "get_weather", True)]:
        want = alone.generate(MESSAGES, chat=True, tools=TOOLS, max_new_tokens=400,
                              structured_output={"grammar": hermes_grammar(TOOLS, name, parallel)})
        r = _chat(spec, tools=TOOLS, tool_choice=tool_choice, n=2, **extra)
        for choice in r.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
            calls = _calls(choice.message.tool_calls)
            assert len(calls) == 1 and (name is None or calls[0][0] == name), calls
            assert conforms(calls[0][1], _schema_of(calls[0][0])), calls
            text = want.text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
            assert json.loads(text) == {"name": calls[0][0], "arguments": calls[0][1]}
        streamed, finish, chunks = [], None, list(_chat(spec, tools=TOOLS, tool_choice=tool_choice, stream=True,
                                                         **extra))
        # the first chunk: the role, content null as the message's (trial-277: content "", no text could come)
        first = chunks[0].choices[0].delta
        assert first.role == "assistant" and first.content is None and "content" in first.model_fields_set, first
        for chunk in chunks:
            for ch in chunk.choices:
                assert ch.delta.content is None
                streamed += ch.delta.tool_calls or []
                finish = ch.finish_reason or finish
        assert finish == "tool_calls" and _calls(streamed) == calls
        # so the openai client's stream helper assembles the message as create() returns it
        with spec.chat.completions.stream(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=400, tools=TOOLS,
                                          tool_choice=tool_choice, **extra) as stream:
            message = stream.get_final_completion().choices[0].message
        assert message.content is None and _calls(message.tool_calls) == calls, message
    # required, parallel calls allowed: one call or more, each valid, until max_tokens at most
    r = _chat(spec, tools=TOOLS, tool_choice="required", max_tokens=120)
    calls = _calls(r.choices[0].message.tool_calls)
    assert calls and all(conforms(args, _schema_of(name)) for name, args in calls)


CALL_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def _flat(tool_choice) -> dict | str:
    """A chat ``tool_choice`` as the Responses API spells it."""
    return tool_choice if isinstance(tool_choice, str) else {"type": "function", "name": tool_choice["function"]["name"]}


def test_stop_strings_and_stop_token_ids_do_not_cut_a_forced_call(servers, engine):
    """A reply that ``tool_choice`` forces to call (required, a named function) ends where its
    constraint ends it, after its last call: its ``stop`` strings and ``stop_token_ids`` are
    not applied (they cut the call: finish_reason stop, no tool_calls, the call's raw text as
    content, or no text at all; trial-292), in chat, streamed and not, and in Responses, with
    the calls of the request without them, speculative as target-only (hermes; qwen3_coder
    without a drafter); invalid ones are still 400s. (Each server's requests of one
    ``tool_choice`` are sent at once, to be decoded together.)"""
    from concurrent.futures import ThreadPoolExecutor

    spec, alone = (client.with_options(timeout=600) for client in servers)  # (those queued wait for the others)
    want = engine.generate(MESSAGES, chat=True, tools=TOOLS, max_new_tokens=400,
                           structured_output={"grammar": hermes_grammar(TOOLS, "get_weather")})
    every_token = sorted(set(want.token_ids[:-1]))  # (the call's tokens, <tool_call> included: both formats')
    cuts = [{"stop": ["</tool_call>"]}, {"stop": "\n"}, {"stop": ['"'], "extra_body": {"include_stop_str_in_output": True}},
            {"extra_body": {"stop_token_ids": every_token}}]

    def streamed_calls(client, tool_choice, extra: dict, cut: dict) -> tuple[list, str | None]:
        streamed, finish = [], None
        for chunk in _chat(client, tools=TOOLS, tool_choice=tool_choice, stream=True, **extra, **cut):
            for ch in chunk.choices:
                assert ch.delta.content is None
                streamed += ch.delta.tool_calls or []
                finish = ch.finish_reason or finish
        return streamed, finish

    for client, tool_choice, extra, tried in [(spec, CALL_WEATHER, {}, cuts),
                                              (spec, "required", {"parallel_tool_calls": False}, cuts[1::2]),
                                              (alone, CALL_WEATHER, {}, cuts[::3])]:
        responses = {"model": MODEL, "input": MESSAGES, "temperature": 0, "max_output_tokens": 400,
                     "tools": [{"type": "function", **t["function"]} for t in TOOLS],
                     "tool_choice": _flat(tool_choice), **extra,
                     "extra_body": {"stop": "\n", "stop_token_ids": every_token}}
        with ThreadPoolExecutor(8) as pool:
            plain = pool.submit(_chat, client, tools=TOOLS, tool_choice=tool_choice, **extra)
            replies = [pool.submit(_chat, client, tools=TOOLS, tool_choice=tool_choice, **extra, **cut) for cut in tried]
            streams = [pool.submit(streamed_calls, client, tool_choice, extra, cut)
                       if client is not alone and cut in cuts[1::2] else None for cut in tried]
            answer = pool.submit(client.responses.create, **responses)
            plain = plain.result().choices[0]
            assert plain.finish_reason == "tool_calls", plain
            calls = _calls(plain.message.tool_calls)
            if client is spec and tool_choice is CALL_WEATHER:  # (target-only decoding's call)
                assert calls == [("get_weather", json.loads(want.text.split("\n")[1])["arguments"])]
            for cut, reply, stream in zip(tried, replies, streams):
                r = reply.result().choices[0]
                assert r.finish_reason == "tool_calls" and r.message.content is None, (cut, r)
                assert _calls(r.message.tool_calls) == calls, cut
                if stream is not None:
                    streamed, finish = stream.result()
                    assert finish == "tool_calls" and _calls(streamed) == calls, cut
            r = answer.result()
        assert r.status == "completed" and [(o.type, o.name, json.loads(o.arguments)) for o in r.output] == \
            [("function_call", name, args) for name, args in calls], r
    for bad, param in (({"stop_token_ids": [10**9]}, "stop_token_ids"), ({"stop": [""]}, "stop")):  # (still checked)
        with pytest.raises(openai.BadRequestError) as err:
            _chat(spec, tools=TOOLS, tool_choice=CALL_WEATHER, extra_body=bad)
        assert err.value.body["param"] == param, err.value.body


def test_max_tokens_where_a_forced_call_or_a_choice_is_complete_is_no_cut(servers):
    """``max_tokens`` reached where the constraint can only end (only the EOS may follow: a
    named call complete up to its closing marker, a choice written whole) is the natural end:
    finish_reason tool_calls / stop, Responses status completed (were length / incomplete,
    the full call in tool_calls; trial-292), streamed and not, speculative as target-only; a
    token short of it, length."""
    _, alone = servers
    for client in servers:  # (hermes; qwen3_coder without a drafter)
        whole = _chat(client, tools=TOOLS, tool_choice=CALL_WEATHER)
        n, calls = whole.usage.completion_tokens - 1, _calls(whole.choices[0].message.tool_calls)  # (n: all but the EOS)
        r = _chat(client, tools=TOOLS, tool_choice=CALL_WEATHER, max_tokens=n)
        assert r.usage.completion_tokens == n and r.choices[0].finish_reason == "tool_calls", r
        assert _calls(r.choices[0].message.tool_calls) == calls
        streamed, finish = [], None
        for chunk in _chat(client, tools=TOOLS, tool_choice=CALL_WEATHER, max_tokens=n, stream=True):
            for ch in chunk.choices:
                streamed += ch.delta.tool_calls or []
                finish = ch.finish_reason or finish
        assert finish == "tool_calls" and _calls(streamed) == calls
        responses = {"model": MODEL, "input": MESSAGES, "temperature": 0, "max_output_tokens": n,
                     "tools": [{"type": "function", **t["function"]} for t in TOOLS], "tool_choice": _flat(CALL_WEATHER)}
        r = client.responses.create(**responses)
        assert r.status == "completed" and [(o.name, json.loads(o.arguments)) for o in r.output] == calls, r
        assert [e for e in client.responses.create(**responses, stream=True)][-1].type == "response.completed"
        short = _chat(client, tools=TOOLS, tool_choice=CALL_WEATHER, max_tokens=n - 1).choices[0]
        assert short.finish_reason == "length" and not short.message.tool_calls, short
        assert client.responses.create(**{**responses, "max_output_tokens": n - 1}).status == "incomplete"
    # a choice (none begins another): the same, speculative as target-only
    want = _complete(alone, extra_body={"guided_choice": CHOICES})
    n, text = want.usage.completion_tokens - 1, want.choices[0].text  # (all but the EOS)
    assert want.choices[0].finish_reason == "stop" and text in CHOICES and n >= 1, want
    for client in servers:
        got = _complete(client, max_tokens=n, extra_body={"guided_choice": CHOICES}).choices[0]
        assert (got.text, got.finish_reason) == (text, "stop"), got
        streamed, finish, _ = _streamed_choices(_complete(client, max_tokens=n, stream=True,
                                                          extra_body={"guided_choice": CHOICES}))
        assert streamed == {0: text} and finish == {0: "stop"}
        assert _complete(client, max_tokens=n - 1, extra_body={"guided_choice": CHOICES}).choices[0].finish_reason \
            == ("length" if n > 1 else "stop")


@pytest.fixture(scope="module")
def engine():
    """The shipped target alone (its tokenizer for the grammars)."""
    return DFlashEngine.from_pretrained(no_draft=True)


@pytest.fixture(scope="module")
def spec_engine():
    """The shipped pair (speculative), loaded once for the module."""
    return DFlashEngine.from_pretrained()


@pytest.fixture(scope="module")
def accepts(engine):
    """``accepts(grammar, text)``: llguidance takes the tokens of ``text`` and then may end."""
    from llguidance import LLMatcher

    tokenizer = engine.grammars.tokenizer()

    def accepts(grammar: str, text: str) -> bool:
        m = LLMatcher(tokenizer, LLMatcher.grammar_from_lark(grammar))
        return all(m.consume_token(t) for t in engine.tokenizer.encode(text, add_special_tokens=False)) and \
            m.is_accepting()

    return accepts


def test_tool_call_grammar_accepts_what_the_hermes_parser_reads(accepts):
    """The grammar's calls (a reasoning the template opened first) are what the parser reads back."""
    from dflash_torch.serving.tools import new_reply_parser, parse_reply


    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert accepts(hermes_grammar(TOOLS), one) and accepts(hermes_grammar(TOOLS), two)
    assert not accepts(hermes_grammar(TOOLS, parallel=False), two)
    assert not accepts(hermes_grammar(TOOLS, "get_time"), one)
    assert not accepts(hermes_grammar(TOOLS), one.replace("Oslo", "Rome"))  # (not in the enum)
    assert not accepts(hermes_grammar(TOOLS), "Sure. " + one)
    thought = "first </thin k> then</think>\n\n" + two
    assert accepts(hermes_grammar(TOOLS, reasoning="opened"), thought)
    assert not accepts(hermes_grammar(TOOLS, reasoning="opened"), two)
    # a reply that may open a reasoning (Qwen3's thinking mode: the model writes <think>)
    optional = hermes_grammar(TOOLS, reasoning="optional")
    assert accepts(optional, two) and accepts(optional, "<think>\n" + thought)
    assert not accepts(optional, thought) and not accepts(optional, "Sure. " + one)
    # a function without parameters takes none (OpenAI: "an empty parameter list")
    bare = [{"type": "function", "function": {"name": "get_time"}}]
    assert accepts(hermes_grammar(bare), '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not accepts(hermes_grammar(bare), '<tool_call>\n{"name": "get_time", "arguments": {"x": 1}}\n</tool_call>')
    reasoning, content, calls = parse_reply(new_reply_parser("think", "hermes", "<think>\n"), thought, True)
    assert (reasoning, content) == ("first </thin k> then", "")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo", "days": 2}),
                                                                   ("get_time", {})]


ADD = {"type": "function", "function": {"name": "add", "strict": True, "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def _unique_keys(pairs):
    """``json.loads``' object_pairs_hook: an object that names a key twice is an error."""
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), keys
    return dict(pairs)


def test_strict_schemas_hold_objects_to_their_declared_keys(servers, accepts):
    """``strict: true`` (a tool's ``function.strict``, ``response_format.json_schema.strict``):
    every object schema that does not say ``additionalProperties`` takes only the keys it
    declares, as OpenAI's strict mode reads it (trial-277: a forced strict call of add(a, b)
    gave ``{"a": 1, "b": 1, "browser": "b"}`` and a strict json_schema
    ``{"a": 0, "b": -1, "bb": -1, "bb": -1, ...}``: schema-valid, as an absent
    additionalProperties allows any key, but not what strict means); without strict, as before.
    Where that would refuse keys another schema gives the object (an allOf's branches), the
    object is left open (trial-283: such schemas were 400s; the many shapes:
    :func:`test_strict_schema_closes_only_objects_whose_keys_are_their_own`)."""
    # the trial's requests: a forced strict call (hermes, qwen3_coder) and a strict json_schema (chat, Responses)
    ask = [{"role": "user", "content": "Write a function that adds two numbers."}]
    for client in servers:
        r = _chat(client, messages=ask, max_tokens=200, tools=[ADD],
                  tool_choice={"type": "function", "function": {"name": "add"}}).choices[0]
        assert r.finish_reason == "tool_calls" and [(n, set(a)) for n, a in _calls(r.message.tool_calls)] == \
            [("add", {"a", "b"})], r
    schema = ADD["function"]["parameters"]
    fmt = {"type": "json_schema", "json_schema": {"name": "add", "schema": schema, "strict": True}}
    content = _chat(spec := servers[0], messages=ask, max_tokens=200, response_format=fmt).choices[0].message.content
    assert set(json.loads(content, object_pairs_hook=_unique_keys)) == {"a", "b"}, content
    text = spec.responses.create(model=MODEL, input=ask[0]["content"], temperature=0, max_output_tokens=200, text={
        "format": {"type": "json_schema", "name": "add", "schema": schema, "strict": True}}).output_text
    assert text == content
    # the grammar: a strict tool's call holds no other key, nested objects neither
    call = '<tool_call>\n{"name": "add", "arguments": %s}\n</tool_call>'
    loose = {"type": "function", "function": {k: v for k, v in ADD["function"].items() if k != "strict"}}
    extra = '{"a": 1, "b": 1, "browser": "b"}'
    assert accepts(hermes_grammar([ADD], "add"), call % '{"a": 1, "b": 1}')
    assert not accepts(hermes_grammar([ADD], "add"), call % extra) and accepts(hermes_grammar([loose], "add"), call % extra)
    # nested objects too: $defs, items, anyOf branches (a plain union), a root typed ["object", "null"]; an
    # explicit additionalProperties kept; an allOf's branches left open (its object holds the keys of them all)
    point = {"type": "object", "properties": {"x": {"type": "integer"}}}
    nested = {"type": ["object", "null"], "$defs": {"P": point}, "properties": {
        "p": {"$ref": "#/$defs/P"}, "l": {"type": "array", "items": point}, "o": {"anyOf": [point, {"type": "null"}]},
        "free": {"type": "object", "additionalProperties": True},
        "both": {"allOf": [point, {"type": "object", "properties": {"y": {"type": "integer"}}}]}}}
    strict = {"type": "function", "function": {"name": "add", "strict": True, "parameters": nested}}
    for args, ok in [('{"p": {"x": 1}, "l": [{"x": 2}], "o": {"x": 3}, "free": {"w": 4}, "both": {"x": 5, "y": 6}}', True),
                     ('{"p": {"x": 1, "w": 2}}', False), ('{"l": [{"x": 1, "w": 2}]}', False),
                     ('{"o": {"w": 1}}', False), ('{"w": 1}', False), ('{"both": {"x": 1, "y": 2, "w": 3}}', True),
                     ('{"both": {"x": "1"}}', False)]:
        assert accepts(hermes_grammar([strict], "add"), call % args) is ok, args
        assert accepts(hermes_grammar([{"type": "function", "function": {"name": "add", "parameters": nested}}], "add"),
                       call % args) is (ok or '"1"' not in args), args  # (not strict: any extra key)
    # a root $ref (as zod-to-json-schema writes parameters): its definition is closed, the root left to it
    zod = {"type": "function", "function": {"name": "add", "strict": True, "parameters": {
        "$ref": "#/definitions/Add", "definitions": {"Add": ADD["function"]["parameters"]}}}}
    assert accepts(hermes_grammar([zod], "add"), call % '{"a": 1, "b": 2}')
    assert not accepts(hermes_grammar([zod], "add"), call % extra)
    # an allOf extending a $ref'd base (trial-283: a 400, "required property 'id' is unsatisfiable"): the
    # object holds the keys of both; a strict function whose parameters are a union of objects (was a 400)
    extended = {"$defs": {"Base": BASE}, "allOf": [{"$ref": "#/$defs/Base"}, NAMED]}
    fmt = {"type": "json_schema", "json_schema": {"name": "named", "schema": extended, "strict": True}}
    content = json.loads(_chat(spec, messages=ask, max_tokens=100, response_format=fmt, extra_body={
        "guided_whitespace_pattern": ""}).choices[0].message.content)  # (no run of spaces to max_tokens)
    assert isinstance(content.get("id"), int) and isinstance(content.get("name"), str), content
    union = {"type": "function", "function": {"name": "add", "strict": True, "parameters": {"oneOf": [BASE, NAMED]}}}
    r = _chat(spec, messages=ask, max_tokens=100, tools=[union], tool_choice="required", parallel_tool_calls=False).choices[0]
    assert r.finish_reason == "tool_calls" and [set(a) for _, a in _calls(r.message.tool_calls)] in ([{"id"}], [{"name"}])


BASE = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
NAMED = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
UNION = [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
         {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]
POINT = {"type": "object", "properties": {"x": {"type": "integer"}}}


def _obj(**properties):
    """An object schema with these ``properties``."""
    return {"type": "object", "properties": properties}


def _inherit(base_config: dict, config: dict) -> dict:
    """OpenAPI's inheritance: a subtype extending a $ref'd base, both declaring the object ``config``
    (``base_config``, ``config``: their schemas of it); the base requires ``name`` and ``config``."""
    return {"$defs": {"Base": {**_obj(name={"type": "string"}, config=base_config), "required": ["name", "config"]}},
            "allOf": [{"$ref": "#/$defs/Base"}, _obj(config=config)]}


# (schema, is_object, instances strict_schema's schema takes, instances it refuses): every schema here takes
# each of its good instances without strict too (the rewrite narrows no schema beyond its declared keys)
STRICT_CASES = [
    # an allOf extending a $ref'd base, at the root, as a tool's parameters, nested (trial-283 (a))
    ({"$defs": {"Base": BASE}, "allOf": [{"$ref": "#/$defs/Base"}, NAMED]}, False,
     [{"id": 1, "name": "n"}, {"id": 1, "name": "n", "w": 2}], [{"id": 1}, {"name": "n"}]),
    ({"$defs": {"Base": BASE}, "allOf": [{"$ref": "#/$defs/Base"}, NAMED]}, True, [{"id": 1, "name": "n"}], []),
    ({"$defs": {"A": POINT}, "type": "object", "properties": {
        "p": {"allOf": [{"$ref": "#/$defs/A"}, {"properties": {"y": {}}}]}, "q": {"$ref": "#/$defs/A"}}}, False,
     [{"p": {"x": 1, "y": 2}}, {"q": {"x": 1}}], [{"w": 1}]),  # (q's A: open, as it is p's allOf branch)
    # the object's own properties beside a single allOf branch (b)
    ({**BASE, "allOf": [NAMED]}, False, [{"id": 1, "name": "n"}], [{"id": 1}]),
    ({"type": "object", "$defs": {"P": POINT}, "properties": {"p": {"allOf": [{"$ref": "#/$defs/P"}], "title": "P"}}},
     False, [{"p": {"x": 1}}], [{"p": {"x": 1, "w": 2}}]),  # (but an allOf wrapping one $ref alone: closed)
    # anyOf / oneOf branches beside the parent's keys (c); a plain union's branches are closed
    ({"type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"], "anyOf": UNION}, False,
     [{"kind": "k", "a": 1}, {"kind": "k", "b": 1}], [{"kind": "k"}]),
    ({"type": "object", "anyOf": UNION}, False, [{"a": 1}, {"b": 1}], [{"a": 1, "c": 1}, {}]),
    ({"anyOf": [BASE, NAMED]}, True, [{"id": 1}, {"name": "n"}], [{"id": 1, "w": 2}]),
    ({"$defs": {"Base": BASE}, "allOf": [{"$ref": "#/$defs/Base"}, {"anyOf": UNION}]}, False,
     [{"id": 1, "a": 2}], [{"a": 2}]),  # (a union inside an allOf branch: open too)
    # $ref beside properties of its own (d), and a chain of $refs from an open position
    ({"$defs": {"B": BASE}, "$ref": "#/$defs/B", "properties": {"name": {"type": "string"}}}, False,
     [{"id": 1, "name": "n"}, {"id": 1, "w": 2}], [{"name": "n"}]),
    ({"$defs": {"A": {"$ref": "#/$defs/B"}, "B": POINT}, "allOf": [{"$ref": "#/$defs/A"}, {"properties": {"y": {}}}],
      "properties": {"z": {"$ref": "#/$defs/B"}}}, False, [{"x": 1, "y": 2}, {"z": {"x": 1, "w": 2}}], []),
    # $ref targets outside $defs (OpenAPI's components) and escaped pointers are closed (e)
    ({"components": {"schemas": {"X": POINT}}, "type": "object", "properties": {
        "p": {"$ref": "#/components/schemas/X", "description": "a point"}}}, False,
     [{"p": {"x": 1}}], [{"p": {"x": 1, "w": 2}}, {"w": 1}]),
    ({"$defs": {"A/B c": POINT}, "$ref": "#/$defs/A~1B%20c"}, False, [{"x": 1}], [{"x": 1, "w": 2}]),
    # an object schema without properties is free-form (f); so is one that requires an undeclared key
    ({"type": "object", "required": ["a"]}, False, [{"a": 1}, {"a": 1, "b": 2}], [{}]),
    ({"type": "object", "properties": {"meta": {"type": "object"}}}, False, [{"meta": {"k": 1}}], [{"w": 1}]),
    ({"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}, False, [{"a": 1, "b": 2}], [{"a": 1}]),
    ({"type": "object", "properties": {"a": {}}, "enum": [{"a": 1, "b": 2}]}, False, [{"a": 1, "b": 2}], [{"a": 1}]),
    # kept: a root $ref (zod), patternProperties' keys, an additionalProperties schema, ["object", "null"],
    # pydantic's Optional of a model, a recursive $ref to the root, empty properties, an anchor (left open)
    ({"$ref": "#/definitions/Add", "definitions": {"Add": {**BASE, "properties": {"id": {}, "b": {}}}},
      "$schema": "http://json-schema.org/draft-07/schema#"}, True, [{"id": 1, "b": 2}], [{"id": 1, "c": 3}]),
    ({**POINT, "patternProperties": {"^x_": {"type": "integer"}}}, False, [{"x": 1, "x_1": 2}], [{"x": 1, "y": 2}]),
    ({**POINT, "additionalProperties": {"type": "string"}}, False, [{"x": 1, "z": "s"}], [{"x": 1, "z": 2}]),
    ({**POINT, "type": ["object", "null"]}, False, [{"x": 1}, None], [{"x": 1, "y": 2}]),
    ({"type": "object", "$defs": {"M": POINT}, "properties": {
        "m": {"anyOf": [{"$ref": "#/$defs/M"}, {"type": "null"}], "default": None}}}, False,
     [{"m": {"x": 1}}, {"m": None}], [{"m": {"x": 1, "w": 2}}, {"w": 1}]),
    ({"type": "object", "properties": {"v": {"type": "integer"}, "c": {"$ref": "#"}}}, False,
     [{"v": 1, "c": {"v": 2}}], [{"c": {"w": 1}}]),
    ({"type": "object", "properties": {}}, True, [{}], [{"a": 1}]),
    ({"type": "array", "items": POINT}, False, [[{"x": 1}]], [[{"x": 1, "w": 1}]]),
    ({"$defs": {"A": {**POINT, "$anchor": "a"}}, "allOf": [{"$ref": "#a"}, {"properties": {"y": {}}}]}, False,
     [{"x": 1, "y": 2}], []),
    # openness propagates down (trial-288 (a)): the objects inside a schema another schema describes too (an
    # allOf branch, a $ref beside keys of its own, an anyOf branch beside the parent's) are left open, as the
    # other schema may describe the same property or item: were closed each to its own keys, {}-only or a 400
    (_inherit(_obj(retries={"type": "integer"}), _obj(timeout={"type": "number"})), False,
     [{"name": "n", "config": {"retries": 1, "timeout": 2.5}}, {"name": "n", "config": {"retries": 1}}],
     [{"name": "n"}]),
    (_inherit({**_obj(retries={"type": "integer"}), "required": ["retries"]},
              {**_obj(timeout={"type": "number"}), "required": ["timeout"]}), True,
     [{"name": "n", "config": {"retries": 1, "timeout": 2.5}}], [{"name": "n", "config": {"retries": 1}}]),
    ({"allOf": [_obj(p=_obj(x={})), _obj(p=_obj(y={}))]}, False, [{"p": {"x": 1, "y": 2}}, {"p": {"x": 1}}], []),
    ({"$defs": {"B": _obj(p=_obj(x={}))}, "$ref": "#/$defs/B", "properties": {"p": _obj(y={})}}, False,
     [{"p": {"x": 1, "y": 2}}], []),
    ({"allOf": [{"type": "array", "items": _obj(x={})}, {"type": "array", "items": _obj(y={})}]}, False,
     [[{"x": 1, "y": 2}], [{"x": 1}]], []),
    ({"allOf": [{"type": "object", "additionalProperties": _obj(x={})},
                {"type": "object", "additionalProperties": _obj(y={})}]}, False, [{"k": {"x": 1, "y": 2}}], []),
    ({"type": "array", "items": _obj(x={}), "anyOf": [{"items": _obj(y={})}, {"maxItems": 1}]}, False,
     [[{"x": 1, "y": 2}, {"x": 1, "y": 2}], [{"x": 1}]], []),
    ({"$defs": {"C1": _obj(r={}), "C2": _obj(t={})},
      "allOf": [_obj(c={"$ref": "#/$defs/C1"}), _obj(c={"$ref": "#/$defs/C2"})]}, False, [{"c": {"r": 1, "t": 2}}], []),
    ({**_obj(p=_obj(x={})), "anyOf": [_obj(p=_obj(y={})), _obj(q={})]}, False,
     [{"p": {"x": 1, "y": 2}}, {"p": {"x": 1}, "q": 1}], []),
    # ... but a plain union's objects and those of an object in a position of its own stay closed
    ({"anyOf": [_obj(p=_obj(x={})), {"type": "null"}]}, False, [{"p": {"x": 1}}, None],
     [{"p": {"x": 1, "w": 2}}, {"w": 1}]),
    ({"type": "object", "properties": {"s": {"allOf": [_obj(x={}), _obj(y={})]}, "t": _obj(u=_obj(v={}))}}, False,
     [{"s": {"x": 1, "y": 2, "w": 3}, "t": {"u": {"v": 1}}}], [{"t": {"u": {"v": 1, "w": 2}}}, {"w": 1}]),
    # the values of properties and patternProperties side by side are left open (a regex may match a declared
    # name: llguidance applies both schemas; (b) was a 400; whether it matches is not tried), the object closed
    ({"type": "object", "required": ["foo"], "properties": {
        "foo": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "bar": _obj(c={})},
      "patternProperties": {"^f": {"type": "object", "properties": {"b": {"type": "integer"}}}, "^z": _obj(d={})}},
     False, [{"foo": {"a": 1, "b": 2}, "bar": {"c": 1}, "z1": {"d": 1}}, {"foo": {"a": 1, "w": 2}},
             {"foo": {"a": 1}, "bar": {"c": 1, "w": 2}}],
     [{"foo": {"a": 1}, "w": 1}]),
    ({**_obj(a=_obj(x={}), bb=_obj(y={})), "patternProperties": {"^\\p{L}$": _obj(z={})}}, False,
     [{"a": {"x": 1, "z": 2}}, {"bb": {"y": 1, "w": 2}}], [{"ab": 1}]),
    ({**_obj(a=_obj(x={})), "patternProperties": {"^(a+)+$": _obj(z={})}}, False,  # (a regex that backtracks
     [{"a": {"x": 1, "w": 2}}, {"aa": {"z": 1, "w": 2}}], [{"b": 1}]),           # exponentially: never run)
]


def test_strict_schema_closes_only_objects_whose_keys_are_their_own(engine):
    """:func:`strict_schema` adds ``additionalProperties: false`` only where that cannot refuse
    keys another schema gives the same object (an allOf's branches, a $ref's definition beside
    properties, a union's branches beside the parent's keys) nor make a schema unsatisfiable (an
    object without properties, a required key not declared): trial-283, each a 400 or a schema that took
    only ``{}``; llguidance's grammar of the rewritten schema (as a strict request's) is the oracle."""
    from llguidance import LLMatcher

    from dflash_torch.serving.constraints import strict_schema

    tokenizer = engine.grammars.tokenizer()

    def takes(schema, value) -> bool:
        m = LLMatcher(tokenizer, engine.grammars.compile({"json": schema}).grammar, log_level=0)
        return all(m.consume_token(t) for t in engine.tokenizer.encode(json.dumps(value), add_special_tokens=False)) \
            and m.is_accepting()

    for schema, is_object, good, bad in STRICT_CASES:
        before = json.dumps(schema)
        strict = strict_schema(schema, is_object)
        assert json.dumps(schema) == before  # (not changed)
        for value in good:
            assert takes(schema, value) and takes(strict, value), (schema, strict, value)
        for value in bad:
            assert not takes(strict, value), (schema, strict, value)
    # where it closes: exactly the object schemas in their own position
    assert strict_schema(POINT) == {**POINT, "additionalProperties": False} and "additionalProperties" not in POINT
    assert strict_schema({"type": "object", "enum": [{"k": 1}], "additionalProperties": {"type": "integer"}}) == \
        {"type": "object", "enum": [{"k": 1}], "additionalProperties": {"type": "integer"}}  # (values, explicit kept)
    closed = {**POINT, "additionalProperties": False}
    assert strict_schema({"anyOf": [POINT, {"type": "null"}], "title": "t"}) == \
        {"anyOf": [closed, {"type": "null"}], "title": "t"}
    assert strict_schema({"allOf": [POINT, POINT]}) == {"allOf": [POINT, POINT]}
    assert strict_schema({"type": "object", "properties": {"meta": {"type": "object"}}}, True) == \
        {"type": "object", "properties": {"meta": {"type": "object"}}, "additionalProperties": False}
    assert strict_schema({"properties": {"p": {"$ref": "#/c/x"}}, "c": {"x": POINT}}) == \
        {"properties": {"p": {"$ref": "#/c/x"}}, "c": {"x": closed}, "additionalProperties": False}
    assert strict_schema({"properties": {"p": {"$ref": "#/c/x", "required": ["x"]}}, "c": {"x": POINT}}) == \
        {"properties": {"p": {"$ref": "#/c/x", "required": ["x"]}}, "c": {"x": POINT}, "additionalProperties": False}
    deep = {"type": "object", "properties": {}}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(DFlashError, match="nested too deeply"):
        strict_schema(deep)


def test_a_lone_surrogate_escape_in_a_models_call_comes_back_escaped(servers):
    """JSON may spell a lone UTF-16 surrogate (``"\\ud83d"``), which UTF-8 cannot encode: in a
    call the model writes (forced here by guided_choice), its arguments come back with the
    escape kept, in chat and Responses, streamed or not (were a 500 "UnicodeEncodeError", a stream
    cut without an error event or [DONE], uncounted by dflash_generation_errors_total; trial-242);
    a name holding one names no tool: the call stays text, as the model wrote it."""
    spec, alone = servers
    string = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"s": {"type": "string"}}}}}]
    array = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"s": {"type": "array"}}}}}]
    hermes = '<tool_call>\n{"name": %s, "arguments": {"s": %s}}\n</tool_call>'
    coder = "<tool_call>\n<function=add>\n<parameter=s>\n%s\n</parameter>\n</function>\n</tool_call>"
    cases = [(spec, string, hermes % ('"add"', '"\\ud83d"'), '{"s": "\\ud83d"}'),
             (spec, string, hermes % ('"add"', '"a\\ud83d\\ude00\\udc00"'), '{"s": "a\U0001F600\\udc00"}'),
             (alone, array, coder % '["\\udc00", "\\ud83d\\ude00"]', '{"s": ["\\udc00", "\U0001F600"]}')]
    for client, tools, text, arguments in cases:
        body = {"temperature": 0, "max_tokens": 100, "tools": tools, "extra_body": {"guided_choice": [text]}}
        r = _chat(client, **body).choices[0]
        assert r.finish_reason == "tool_calls" and r.message.content is None, r
        assert [(c.function.name, c.function.arguments) for c in r.message.tool_calls] == [("add", arguments)]
        streamed = [c for chunk in _chat(client, stream=True, **body) for ch in chunk.choices
                    for c in ch.delta.tool_calls or []]
        assert [(c.function.name, c.function.arguments) for c in streamed] == [("add", arguments)]
        responses = {"model": MODEL, "input": "x", "temperature": 0, "max_output_tokens": 100,
                     "tools": [{"type": "function", **t["function"]} for t in tools], "extra_body": body["extra_body"]}
        output = client.responses.create(**responses).output
        assert [(o.type, o.name, o.arguments) for o in output] == [("function_call", "add", arguments)], output
        done = [e for e in client.responses.create(**responses, stream=True)][-1]
        assert done.type == "response.completed" and done.response.output[0].arguments == arguments, done
    # a lone surrogate in the name: text
    named = hermes % ('"add\\ud83d"', '"x"')
    r = _chat(spec, temperature=0, max_tokens=100, tools=string, extra_body={"guided_choice": [named]}).choices[0]
    assert r.finish_reason == "stop" and not r.message.tool_calls and r.message.content == named, r
    for client in servers:  # (nothing failed)
        metrics = httpx.get(str(client.base_url).removesuffix("/v1/") + "/metrics").text
        assert "\ndflash_generation_errors_total 0.0\n" in metrics


def test_a_forced_call_of_parameters_typed_object_or_another_type_writes_an_object(servers, accepts):
    """``parameters`` whose ``type`` lists ``object`` with other types (``["object", "null"]``):
    a forced call's arguments are an object, its only valid arguments (hermes' grammar allowed
    the others: ``"arguments": null``, ``[0]``, ``"r"``, which the parser could not take, so the
    call came back as text, finish_reason stop; trial-242); a type without ``object`` is a 400."""
    call = '<tool_call>\n{"name": "f", "arguments": %s}\n</tool_call>'
    for other in ("null", "array", "string"):
        tools = [{"type": "function", "function": {"name": "f", "parameters": {
            "type": ["object", other], "properties": {}, "additionalProperties": False}}}]
        grammar = hermes_grammar(tools, "f")
        assert accepts(grammar, call % "{}")
        assert not any(accepts(grammar, call % v) for v in ("null", "[0]", '"r"'))
        named = {"type": "function", "function": {"name": "f"}}
        for client in servers:  # (hermes, qwen3_coder)
            r = _chat(client, max_tokens=40, tools=tools, tool_choice=named).choices[0]
            assert r.finish_reason == "tool_calls" and _calls(r.message.tool_calls) == [("f", {})], r
        flat = [{"type": "function", **tools[0]["function"]}]
        output = servers[0].responses.create(model=MODEL, input=MESSAGES[0]["content"], max_output_tokens=40,
                                             tools=flat, tool_choice={"type": "function", "name": "f"}).output
        assert [(o.type, o.name, json.loads(o.arguments)) for o in output] == [("function_call", "f", {})], output
    with pytest.raises(openai.BadRequestError) as err:
        _chat(servers[0], max_tokens=8, tool_choice="required", tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": ["array", "null"]}}}])
    assert err.value.body["param"] == "tools" and "tools[0].function.parameters must be the JSON Schema of an object" \
        in err.value.body["message"], err.value.body


BAD = [  # (endpoint, body, param, words of the message)
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format", "json_schema object"),
    ("completion", {"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
     "response_format.json_schema.schema", "missing"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": PERSON}}},
     "response_format.json_schema.name", "64"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": PERSON}}},
     "response_format.json_schema.name", "64"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema", "response_format.json_schema.schema is invalid"),
    ("completion", {"guided_json": "{not json"}, "guided_json", "not JSON"),
    ("completion", {"guided_regex": "(("}, "guided_regex", "regex"),
    ("completion", {"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "regex"),
    ("completion", {"guided_choice": []}, "guided_choice", "non-empty"),
    ("completion", {"guided_choice": "yes"}, "guided_choice", "expected an array, got a string"),
    ("completion", {"guided_grammar": "start: undefined_rule"}, "guided_grammar", "grammar"),
    ("completion", {"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ("completion", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ("completion", {"structured_outputs": {"structural_tag": {"x": 1}, "regex": "a"}}, "structured_outputs",
     "structural_tag"),
    ("chat", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "both"),
    ("completion", {"structured_outputs": {"choice": ["a"]}, "guided_json": PERSON}, "guided_json", "both"),
    ("completion", {"guided_regex": "a", "ignore_eos": True}, "ignore_eos", "ignore_eos"),
    ("completion", {"guided_regex": "a", "min_tokens": 2}, "min_tokens", "min_tokens"),
    ("chat", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    # a forced call ends the reply: not "a structured output" the user never asked for (trial-299 h)
    ("chat", {"tools": TOOLS, "tool_choice": "required", "ignore_eos": True}, "ignore_eos",
     "tool_choice 'required' (a forced tool call, which the reply ends after) cannot be combined with ignore_eos"),
    ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": TOOLS[0]["function"]["name"]}},
              "min_tokens": 5}, "min_tokens",
     "(a named function: a forced tool call, which the reply ends after) cannot be combined with min_tokens (5)"),
    # (the exact path, trial-101: tool_choice)
    ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "tool_choice names the function 'nope', which is not among the request's tools"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}], "tool_choice": "required"}, "tools",
     "tools[0].function.parameters.properties.a.type must name JSON types"),
    # llguidance fails on these at their first token (its parser's and lexer's limits): refused when
    # compiled, before a stream's headers (were a 200, then an error event)
    ("completion", {"guided_regex": "a{1000}{1000}"}, "guided_regex",
     "regex cannot be used (llguidance fails on it at its first token): lexer error: too many expressions"),
    ("chat", {"guided_grammar": 'start: x\nx: "a" x'}, "guided_grammar", "grammar cannot be used"),
    ("completion", {"structured_outputs": {"grammar": 'start: "[1,2]" x\nx: "a" x'}}, "structured_outputs",
     "Too many items"),
    # a keyword llguidance does not implement: the grammar cannot be built; the tool is named, in words (trial-292:
    # "tools cannot constrain ...: at 5(14): failed to compile JSON schema: Unimplemented keys: [\"uniqueItems\"]")
    ("chat", {"tools": TOOLS + [{"type": "function", "function": {"name": "dedupe", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}], "tool_choice": "required"},
     "tools.2.function.parameters", "tools.2.function.parameters (function 'dedupe') cannot constrain the forced tool call of tool_choice "
     "'required': the JSON Schema keyword 'uniqueItems' is not supported (constrained decoding cannot enforce it); "),
    ("chat", {"tools": TOOLS + [{"type": "function", "function": {"name": "dedupe", "parameters": {
        "type": "object", "properties": {"a": {"not": {}, "uniqueItems": True}}}}}],
        "tool_choice": {"type": "function", "function": {"name": "dedupe"}}},
     "tools.2.function.parameters", "tools.2.function.parameters (function 'dedupe') cannot constrain the forced tool call of tool_choice "
     "'dedupe' (a named function): the JSON Schema keywords 'not' and 'uniqueItems' are not supported"),
    # a required property that holds itself: no finite value (trial-292: "parser error: Too many items (limit 50000;
    # ff_tokens); try avoiding single-byte/short lexemes")
    ("chat", {"tools": [TIME, {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "$defs": {"node": {"type": "object", "properties": {"c": {"$ref": "#/$defs/node"}},
                                             "required": ["c"], "additionalProperties": False}},
        "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"]}}}],
        "tool_choice": {"type": "function", "function": {"name": "tree"}}},
     "tools.1.function.parameters", "tools.1.function.parameters (function 'tree') cannot constrain the forced tool call of tool_choice "
     "'tree' (a named function): the schema is too large or complex to be compiled into a grammar of the call"),
    # a response format's schema: named by its path, in the same words (was "response_format json is invalid:
    # Unimplemented keys: [\"uniqueItems\"]")
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema",
     "response_format.json_schema.schema is invalid: the JSON Schema keyword 'uniqueItems' is not supported"),
]


@pytest.mark.parametrize("endpoint,body,param,words", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_constraints_are_400s_naming_the_field(servers, endpoint, body, param, words):
    spec, _ = servers
    with pytest.raises(openai.BadRequestError) as err:
        (_chat if endpoint == "chat" else _complete)(spec, max_tokens=8, extra_body=body, stream=True)
    e = err.value.body
    assert e["param"] == param and words in e["message"] and "\n" not in e["message"], e
    if param.startswith(("tools", "response_format")):  # (llguidance's places in the grammar the server wrote, its own terms)
        assert not re.search(r"\bat \d+\(\d+\)|ff_tokens|Unimplemented keys|failed to compile", e["message"]), e


def test_a_forced_calls_schema_error_names_the_tool_in_every_format(engine):
    """The message of forced calls whose grammar cannot be compiled (:func:`forced_call_error`, the
    server's 400) names the first tool whose calls alone cannot be, in each format's grammar, in
    words (trial-292: the tool unnamed, "at 5(14): failed to compile JSON schema: Unimplemented
    keys"); where each tool compiles alone, none is blamed."""
    from dflash_torch.serving.tools import FORCED_CALL_GRAMMARS, forced_call_error

    bad = {"type": "function", "function": {"name": "dedupe", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}
    tools = [WEATHER, bad, TIME]
    for kind, grammar in FORCED_CALL_GRAMMARS.items():
        def failure(tool: dict) -> str | None:
            try:
                engine.grammars.compile({"grammar": grammar([tool], None)})
            except DFlashError as exc:
                return str(exc)
            return None

        with pytest.raises(DFlashError) as err:
            engine.grammars.compile({"grammar": grammar(tools, None)})
        assert forced_call_error(tools, None, failure, str(err.value)) == (
            "tools.1.function.parameters (function 'dedupe') cannot constrain the forced tool call of tool_choice "
            "'required': the JSON Schema keyword 'uniqueItems' is not supported (constrained decoding cannot enforce "
            "it); fix the schema, or use tool_choice 'auto' (not constrained)", "tools.1.function.parameters"), kind
    # (param: the dotted path the message names, as the server's other 400s; trial-299 g: was tools)
    assert forced_call_error(tools, "get_time", lambda tool: None, "structured_output grammar is invalid: at 1(2): x") \
        == ("tools cannot constrain the forced tool calls of tool_choice 'get_time' (a named function) together (each "
            "tool's alone can be): x", "tools")


def test_a_forced_call_of_a_required_parameter_with_an_empty_enum_is_a_400(servers):
    """``"enum": []`` allows no value: a forced call that must write it cannot be written
    (qwen3_coder wrote unconstrained text until max_tokens, trial-134; hermes' JSON schema
    was already refused by llguidance); an optional one is left out of the call."""
    def tools(required: list[str]) -> list[dict]:
        return [{"type": "function", "function": {"name": "pick", "parameters": {
            "type": "object", "additionalProperties": False, "properties": {"e": {"type": "string", "enum": []}},
            "required": required}}}]

    # (hermes' schema fails to compile: param its path, trial-299 g; qwen3_coder's grammar refuses it as it is built)
    for client, words, param in zip(servers, ("'e' is unsatisfiable", "tools function 'pick': its required parameter "
                                                                      "'e' allows no value (an empty enum)"),
                                    ("tools.0.function.parameters", "tools")):
        for choice in ("required", {"type": "function", "function": {"name": "pick"}}):
            with pytest.raises(openai.BadRequestError) as err:
                _chat(client, max_tokens=8, tools=tools(["e"]), tool_choice=choice)
            e = err.value.body
            assert e["param"] == param and words in e["message"] and "\n" not in e["message"], e
        r = _chat(client, tools=tools([]), tool_choice="required", parallel_tool_calls=False).choices[0]
        assert r.finish_reason == "tool_calls" and json.loads(r.message.tool_calls[0].function.arguments) == {}, r


NOTE = {"type": "function", "function": {"name": "save_note", "parameters": {
    "type": "object", "required": ["text"],
    "properties": {"text": {"type": "string"}, "pinned": {"type": "boolean"}, "tags": {"type": "array", "items": {
        "type": "string"}}, "priority": {"type": "integer", "minimum": 1, "maximum": 3},
        "level": {"enum": [1, 2.5, True, None, "high"]}}}}}
CODER_TOOLS = [WEATHER, TIME, NOTE]
# Qwen3.5's chat template's layout of an assistant message's calls (transformers renders it: the oracle)
QWEN35_CALLS_TEMPLATE = (
    "{%- for m in messages %}{%- for tc in m.tool_calls %}{% set tc = tc.function %}"
    "{%- if not loop.first %}{{ '\\n' }}{% endif %}{{ '<tool_call>\\n<function=' + tc.name + '>\\n' }}"
    "{%- for k, v in tc.arguments | items %}{{ '<parameter=' + k + '>\\n' }}"
    "{%- set v = v | tojson | safe if v is mapping or (v is sequence and v is not string) else v | string %}"
    "{{ v }}{{ '\\n</parameter>\\n' }}{%- endfor %}{{ '</function>\\n</tool_call>' }}{%- endfor %}{%- endfor %}")


def _rendered_calls(tokenizer, calls: list[tuple[str, dict]]) -> str:
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": args}} for name, args in calls]}
    return tokenizer.apply_chat_template([message], chat_template=QWEN35_CALLS_TEMPLATE, tokenize=False)


def test_qwen3_coder_call_grammar_accepts_what_the_template_writes_and_the_parser_reads(engine, accepts):
    """The grammar takes the calls as Qwen3.5's template writes them (valid arguments, in the
    schema's order) and refuses invalid ones; the qwen3_coder parser reads them back."""
    from dflash_torch.serving.tools import Qwen3CoderParser, new_reply_parser, parse_reply, qwen3_coder_grammar


    good = [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {}),
            ("save_note", {"text": "buy milk\n</parameter> twice", "pinned": True, "tags": ["a", "b c"]}),
            ("save_note", {"text": "", "priority": 3}), ("save_note", {"text": "x", "level": 2.5}),
            ("save_note", {"text": "x", "level": True}), ("save_note", {"text": "x", "level": None}),
            ("save_note", {"text": "x", "level": "high"}), ("save_note", {"text": "x", "level": 1})]
    grammar = qwen3_coder_grammar(CODER_TOOLS)
    for calls in [[call] for call in good] + [good]:
        text = _rendered_calls(engine.tokenizer, calls)
        assert accepts(grammar, text), text
        _, content, parsed = parse_reply(new_reply_parser("none", "qwen3_coder", tools=CODER_TOOLS), text, True)
        assert content == "" and [(c.name, json.loads(c.arguments)) for c in parsed] == calls
    one = _rendered_calls(engine.tokenizer, [good[0]])
    assert not accepts(qwen3_coder_grammar(CODER_TOOLS, parallel=False), _rendered_calls(engine.tokenizer, good[:2]))
    assert not accepts(qwen3_coder_grammar(CODER_TOOLS, "get_time"), one)
    assert accepts(qwen3_coder_grammar(CODER_TOOLS, "get_weather"), one)
    for bad in ([("get_weather", {"city": "Rome", "days": 2})], [("get_weather", {"city": "Oslo", "days": 9})],
                [("get_weather", {"city": "Oslo"})], [("get_weather", {"days": 2, "city": "Oslo"})],
                [("get_time", {"x": 1})], [("save_note", {"text": "a", "pinned": "maybe"})],
                [("save_note", {"text": "a", "priority": 1.5})], [("save_note", {"text": "a", "level": 3})],
                [("save_note", {"text": "a", "level": "low"})], [("nope", {})]):
        assert not accepts(grammar, _rendered_calls(engine.tokenizer, bad)), bad
    assert not accepts(grammar, "Sure. " + one)
    thought = "first </thin k> then</think>\n\n" + one
    assert accepts(qwen3_coder_grammar(CODER_TOOLS, reasoning="opened"), thought)
    assert not accepts(qwen3_coder_grammar(CODER_TOOLS, reasoning="opened"), one)
    # schemas as pydantic writes them: Optional[...] (anyOf with null), nested models ($defs, $ref,
    # allOf), a required key the properties do not describe, type lists, an enum of arrays
    model = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    color = {"type": "string", "enum": ["red", "green"], "title": "Color"}  # (a pydantic Enum)
    pet = {"oneOf": [{"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]},
                     {"type": "object", "properties": {"kind": {"const": "dog"}, "bark": {"type": "boolean"}},
                      "required": ["kind"]}]}
    typed = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "$defs": {"M": model, "Color": color}, "required": ["q"],
        "x-guidance": {"coerce_one_of": True},  # (the tool's JSON options reach its parameters' values)
        "properties": {"opt": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "m": {"$ref": "#/$defs/M"},
                       "all": {"allOf": [{"$ref": "#/$defs/M"}]}, "nb": {"type": ["boolean", "null"]},
                       "tags": {"enum": [["é"], []]}, "color": {"$ref": "#/$defs/Color"},
                       "finish": {"anyOf": [{"enum": ["matte", "gloss"], "type": "string"}, {"type": "null"}]},
                       "pet": pet}}}}]
    typed_good = [("f", {"q": "any text"}), ("f", {"opt": 5, "q": "x"}), ("f", {"opt": None, "q": "x"}),
                  ("f", {"m": {"x": 1}, "all": {"x": 2}, "q": "x"}), ("f", {"nb": True, "q": "x"}),
                  ("f", {"nb": None, "q": "x"}), ("f", {"tags": ["é"], "q": "x"}), ("f", {"color": "green", "q": "x"}),
                  ("f", {"finish": "matte", "q": "x"}), ("f", {"finish": None, "q": "x"}),
                  ("f", {"pet": {"kind": "dog", "bark": True}, "q": "x"})]
    for calls in [[call] for call in typed_good]:
        text = _rendered_calls(engine.tokenizer, calls)
        assert accepts(qwen3_coder_grammar(typed), text), text
        _, _, parsed = parse_reply(new_reply_parser("none", "qwen3_coder", tools=typed), text, True)
        assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls
    for bad in ([("f", {})], [("f", {"opt": "hello", "q": "x"})], [("f", {"m": {"x": "a"}, "q": "x"})],
                [("f", {"all": {}, "q": "x"})], [("f", {"nb": 3, "q": "x"})], [("f", {"color": "blue", "q": "x"})],
                [("f", {"finish": "sparkly", "q": "x"})], [("f", {"pet": {"kind": "cow"}, "q": "x"})]):
        assert not accepts(qwen3_coder_grammar(typed), _rendered_calls(engine.tokenizer, bad)), bad
    assert Qwen3CoderParser.convert("True", {"type": "boolean"}) is True  # (the template's | string of true)
    assert Qwen3CoderParser.convert("None", {"type": ["null", "integer"]}) is None
    with pytest.raises(DFlashError, match="cannot be written as a qwen3_coder call"):
        qwen3_coder_grammar([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a>b": {"type": "string"}}}}}])


def test_qwen3_coder_forced_calls_are_lossless(servers, engine, spec_engine):
    """tool_choice required / a named function with the qwen3_coder format: the target-only
    server's calls are those of target-only decoding with the grammar, parsed; speculative
    decoding with that grammar writes the same reply."""
    from dflash_torch.serving.tools import new_reply_parser, parse_reply, qwen3_coder_grammar

    _, alone = servers  # (--tool-call-parser qwen3_coder)
    target_only, spec = engine, spec_engine
    for tool_choice, name, parallel in [("required", None, True), ({"type": "function", "function": {"name": "get_weather"}},
                                                                    "get_weather", True),
                                        ({"type": "function", "function": {"name": "save_note"}}, "save_note", True)]:
        grammar = qwen3_coder_grammar(CODER_TOOLS, name, parallel)
        want = target_only.generate(MESSAGES, chat=True, tools=CODER_TOOLS, max_new_tokens=200,
                                    structured_output={"grammar": grammar})
        assert spec.generate(MESSAGES, chat=True, tools=CODER_TOOLS, max_new_tokens=200,
                             structured_output={"grammar": grammar}).text == want.text
        r = _chat(alone, tools=CODER_TOOLS, tool_choice=tool_choice, max_tokens=200).choices[0]
        _, content, calls = parse_reply(new_reply_parser("none", "qwen3_coder", tools=CODER_TOOLS), want.text,
                                        want.finish_reason == "stop")
        if want.finish_reason == "stop":
            assert r.finish_reason == "tool_calls" and r.message.content is None, r
            assert _calls(r.message.tool_calls) == [(c.name, json.loads(c.arguments)) for c in calls]
            assert calls and all(name is None or c.name == name for c in calls)
            assert all(conforms(json.loads(c.arguments), _schema_of(c.name)) for c in calls if c.name != "save_note")
        else:  # (cut by max_tokens inside a call: it stays text)
            assert r.finish_reason == "length" and r.message.content == content


def test_qwen3_coder_forced_calls_follow_a_root_ref_and_refuse_keywords_they_cannot_enforce(servers):
    """The object a tool's ``parameters`` describe through a root ``$ref`` (as zod-to-json-schema
    writes it) or an ``allOf`` of one ``$ref``: a qwen3_coder (and GLM) forced call writes its
    properties, typed (were none: ``{}`` although ``n`` was required; trial-242). A keyword on
    that object that a call written as its properties cannot be held to (``not``,
    ``propertyNames``, ``maxProperties`` below the properties' count, ...) is a 400 about
    ``tools`` naming it, as hermes' llguidance refuses those it does not implement (were
    ignored: arguments that broke the schema)."""
    from dflash_torch.serving.tools import glm45_grammar, qwen3_coder_grammar

    spec, alone = servers  # (hermes, qwen3_coder)
    args = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for parameters in ({"$ref": "#/definitions/args", "definitions": {"args": args},
                        "$schema": "http://json-schema.org/draft-07/schema#"},
                       {"type": "object", "allOf": [{"$ref": "#/$defs/A"}], "$defs": {"A": args}}):
        tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
        for client in servers:
            r = _chat(client, max_tokens=60, tools=tools, tool_choice="required", parallel_tool_calls=False).choices[0]
            calls = _calls(r.message.tool_calls)
            assert r.finish_reason == "tool_calls" and [c[0] for c in calls] == ["f"], r
            assert isinstance(calls[0][1].get("n"), int) and not isinstance(calls[0][1]["n"], bool), calls
            assert client is spec or list(calls[0][1]) == ["n"], calls  # (hermes may add keys: the schema allows them)
    two = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}}
    for keyword in ({"not": {"required": ["a"]}}, {"propertyNames": {"maxLength": 1}},
                    {"dependentRequired": {"a": ["b"]}}, {"if": {"required": ["a"]}, "then": {"required": ["b"]}}):
        tools = [{"type": "function", "function": {"name": "f", "parameters": {**two, **keyword}}}]
        for client in servers:
            with pytest.raises(openai.BadRequestError) as err:
                _chat(client, max_tokens=8, tools=tools, tool_choice="required")
            e = err.value.body
            # (param: the parameters' path where the message names it, a schema that fails to compile, trial-299 g)
            path = "tools.0.function.parameters"
            assert e["param"] == (path if e["message"].startswith(path) else "tools"), e
            assert repr(next(iter(keyword)))[1:-1] in e["message"], e
    # the keywords llguidance takes but a call written as the properties cannot be held to
    for keyword, words in (({"maxProperties": 0}, "maxProperties 0 of parameters"),
                           ({"minProperties": 1}, "minProperties 1 of parameters"),
                           ({"anyOf": [{"required": ["a"]}]}, "the keyword 'anyOf' of parameters"),
                           ({"enum": [{"a": 1}]}, "the keyword 'enum' of parameters"),
                           ({"patternProperties": {"^a": {"type": "string"}}}, "patternProperties '^a' of parameters"),
                           ({"$ref": "#/$defs/A", "$defs": {"A": args}}, "the keyword '$ref' of parameters")):
        tools = [{"type": "function", "function": {"name": "f", "parameters": {**two, **keyword}}}]
        with pytest.raises(openai.BadRequestError) as err:
            _chat(alone, max_tokens=8, tools=tools, tool_choice={"type": "function", "function": {"name": "f"}})
        e = err.value.body
        assert e["param"] == "tools" and e["message"].startswith(f"tools function 'f': {words} cannot be enforced in "
                                                                 "a qwen3_coder call"), e
        with pytest.raises(DFlashError, match=f"{re.escape(words)} cannot be enforced in a glm45 call"):
            glm45_grammar(tools)
    # what such a call holds to is taken: a maxProperties of all, a minProperties of the required,
    # a pattern no property's name matches
    for keyword in ({"maxProperties": 2}, {"minProperties": 0}, {"patternProperties": {"^z": {"type": "string"}}}):
        qwen3_coder_grammar([{"type": "function", "function": {"name": "f", "parameters": {**two, **keyword}}}])


# --- the command line -------------------------------------------------------------------------


def test_cli_flags_equal_the_python_api(tmp_path, capsys, spec_engine):
    from dflash_torch.cli import main as cli_main

    engine = spec_engine
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(PERSON))
    grammar_file = tmp_path / "g.lark"
    grammar_file.write_text('start: "yes" | "no"')
    cases = [(["--json-schema", json.dumps(PERSON)], {"json": PERSON}),
             (["--json-schema", f"@{schema_file}"], {"json": PERSON}),
             (["--json-object"], {"json_object": True}),
             (["--regex", REGEX], {"regex": REGEX}),
             (["--choice", "alpha", "--choice", "beta"], {"choice": ["alpha", "beta"]}),
             (["--grammar", 'start: "yes" | "no"'], {"grammar": 'start: "yes" | "no"'}),
             (["--grammar", f"@{grammar_file}"], {"grammar": 'start: "yes" | "no"'})]
    wants = {}  # (the Python API's output per constraint: a flag's two forms share it)
    for flags, spec in cases:
        assert cli_main(["generate", "--json", "--max-new-tokens", "300", *flags, "x = "]) == 0
        out = json.loads(capsys.readouterr().out)
        key = json.dumps(spec, sort_keys=True)
        if key not in wants:
            wants[key] = engine.generate("x = ", max_new_tokens=300, structured_output=spec)
        want = wants[key]
        assert out["token_ids"] == want.token_ids and out["finish_reason"] == "stop", flags
        if "json" in spec:
            assert conforms(json.loads(out["text"]), PERSON)


@pytest.mark.parametrize("flags,message", [
    (["--json-object", "--regex", "a"], "give at most one of --json-schema, --json-object, --regex, --choice, --grammar"),
    (["--choice", "a", "--grammar", "start: \"a\""], "got --choice and --grammar"),
    (["--regex", "(("], "error: --regex is invalid"),  # (was "--regex regex is invalid")
    (["--json-schema", "{bad"], "--json-schema must be a JSON schema"),
    (["--json-schema", "@/nonexistent/schema.json"], "--json-schema: cannot read"),
    (["--grammar", "start: nothing_here"], "error: --grammar is invalid"),
    (["--json-schema", '{"type": "nope"}'], "error: --json-schema is invalid: "),  # (was "--json-schema json is ...")
    (["--json-schema", "false"], "error: --json-schema false allows no value"),
    (["--regex", "[a&&b]"], "error: --regex allows no output: no text matches it"),
    (["--choice", "a", "--ignore-eos"], "--ignore-eos cannot be combined with a structured output"),
])
def test_cli_errors_are_one_line_exit_2(flags, message, capsys):
    from dflash_torch.cli import main as cli_main

    assert cli_main(["generate", *flags, "x = "]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash-torch: error: ") and message in err and err.count("\n") == 1, err


# compiles (its first token, a digit, is consumed), but llguidance cannot go on after it (';' or ',' then
# "a" forever: "Too many items"); start: x / x: "a" x, which fails so at its first token, is refused when compiled
DEAD_END = 'start: /[0-9]/ /[;,]/ x\nx: "a" x'


def test_a_constraint_that_fails_mid_decoding_fails_its_request_alone(servers):
    """A grammar that passes the compile-time checks and then fails (llguidance gives up on
    it) ends its own request with a 400 naming its field; a request decoding in the same
    batch at that moment runs to its end with the output it has alone."""
    import threading

    spec, _ = servers
    want = _complete(spec, max_tokens=160, extra_body={"ignore_eos": True}).choices[0].text
    got = {}
    long_one = threading.Thread(target=lambda: got.setdefault(
        "a", _complete(spec, max_tokens=160, extra_body={"ignore_eos": True})))
    long_one.start()
    for _ in range(3):
        with pytest.raises(openai.BadRequestError) as info:
            _complete(spec, max_tokens=10, extra_body={"guided_grammar": DEAD_END})
        assert "structured output failed" in str(info.value) and info.value.body["param"] == "guided_grammar"
    long_one.join(120)
    assert got["a"].choices[0].text == want and got["a"].choices[0].finish_reason == "length"


def test_a_constraint_that_fails_mid_decoding_raises_in_python():
    """In Python: generate raises a one-line DFlashError (speculative and target-only);
    generate_batch names the prompt; the engine decodes normally afterwards."""
    spec_engine = DFlashEngine.from_pretrained(dtype="float32")
    for engine in (spec_engine, DFlashEngine.from_pretrained(no_draft=True, dtype="float32")):
        with pytest.raises(DFlashError, match="^structured output failed: [^\n]*$"):
            engine.generate("x = ", max_new_tokens=20, structured_output={"grammar": DEAD_END})
    with pytest.raises(DFlashError, match="^prompt 1: structured output failed"):
        spec_engine.generate_batch(["x = ", "def f():"], max_new_tokens=20, structured_output=[None, {"grammar": DEAD_END}])
    assert spec_engine.generate("x = ", max_new_tokens=8).token_ids == \
        DFlashEngine.from_pretrained(no_draft=True, dtype="float32").generate("x = ", max_new_tokens=8).token_ids


def test_the_text_of_a_special_token_in_a_constraint_is_text_or_refused():
    """A constraint whose text holds a special token's text (``<|endoftext|>``, the EOS, and
    ``<|MASK|>`` of the shipped tokenizer): llguidance's masks let the special token's id
    through there, which ended the output early (an EOS: ``"`` for ``{"const":
    "<|endoftext|>"}``, invalid JSON, finish_reason stop) or failed on a parser error. Now a
    special token is allowed only where the matcher takes it (an EOS only where the
    constraint is complete): where the text can be written as text it is (an alternative,
    a JSON string that is not forced whole), where llguidance forces exactly that token
    the request fails in one line saying why; a grammar that names a special token as a
    token (llguidance's ``<|MASK|>`` outside quotes) still gets it. Speculative and
    target-only alike."""
    import re

    for engine in (DFlashEngine.from_pretrained(dtype="float32"), DFlashEngine.from_pretrained(no_draft=True, dtype="float32")):
        for so, token in (({"json": {"const": "<|endoftext|>"}}, "0 ('<|endoftext|>')"),
                          ({"choice": ["a<|MASK|>"]}, "1 ('<|MASK|>')")):
            message = (f"structured output failed: the constraint requires the text of the special token {token} here, "
                       "which the tokenizer reads as that token, not as text: this output cannot be written")
            with pytest.raises(DFlashError, match=f"^{re.escape(message)}$"):
                engine.generate("x = ", max_new_tokens=20, structured_output=so)
        r = engine.generate("x = ", max_new_tokens=20, structured_output={"choice": ["<|MASK|>", "plain"]})
        assert r.text in ("<|MASK|>", "plain") and 1 not in r.token_ids and r.finish_reason == "stop"
        try:  # (whether llguidance forces the string whole here depends on the whitespace taken before it)
            r = engine.generate("x = ", max_new_tokens=60, structured_output={"json": {
                "type": "object", "properties": {"a": {"const": "<|endoftext|>"}}, "required": ["a"]}})
            assert json.loads(r.text) == {"a": "<|endoftext|>"} and r.finish_reason == "stop", r.text
        except DFlashError as exc:
            assert str(exc).startswith("structured output failed: the constraint requires the text of the special "
                                       "token 0 ('<|endoftext|>') here"), exc
        r = engine.generate("x = ", max_new_tokens=20, structured_output={"grammar": 'start: "ab" <|MASK|> "cd"'})
        assert r.text == "ab<|MASK|>cd" and 1 in r.token_ids
        # an EOS the grammar names as a token ends the output there (it was refused as if forced as text)
        r = engine.generate("x = ", max_new_tokens=20, structured_output={"grammar": 'start: "ab" <|endoftext|>'})
        assert (r.text, r.token_ids[-1], r.finish_reason) == ("ab", 0, "stop")
        # not where the grammar goes on after it: the EOS would end the output before the constraint is
        # complete (the message said it required the EOS's text, though the grammar names the token);
        # refused when compiled where it comes first
        ends = ("the constraint requires the special token 0 ('<|endoftext|>') here, which ends the output (a stop "
                "token) before the constraint is complete: this output cannot be written")
        for grammar, message in (('start: "ab" <|endoftext|> "c"', f"structured output failed: {ends}"),
                                 ('start: <|endoftext|> "c"', f"structured_output grammar cannot be used: {ends}")):
            with pytest.raises(DFlashError, match=f"^{re.escape(message)}$"):
                engine.generate("x = ", max_new_tokens=20, structured_output={"grammar": grammar})


def test_hermes_grammar_takes_the_tokenizers_own_call_marker_tokens(tmp_path):
    """Where ``<tool_call>`` / ``</tool_call>`` are added tokens (Qwen3's tokenizer), which
    llguidance never matches to text, the forced-call grammar takes those tokens (as well as
    the markers spelled out); without them the one-token form is refused."""
    from conftest import make_tokenizer
    from transformers import AutoTokenizer

    from dflash_torch.serving.constraints import special_token
    from dflash_torch.serving.tools import CALL_CLOSE, CALL_OPEN
    from dflash_torch.structured import GrammarCompiler

    make_tokenizer(tmp_path, vocab_size=318)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    tok.add_tokens([CALL_OPEN, CALL_CLOSE])
    compiler = GrammarCompiler(tok, 320, [0])
    ids = (special_token(tok, compiler.tokenizer(), CALL_OPEN), special_token(tok, compiler.tokenizer(), CALL_CLOSE))
    assert None not in ids
    body = tok.encode('\n{"name": "get_time", "arguments": {}}\n', add_special_tokens=False)
    one_token = [ids[0]] + body + [ids[1], 0]
    spelled = tok.encode(CALL_OPEN[:1], add_special_tokens=False)  # ("<" alone: not the added token)
    spelled = spelled + tok.encode(CALL_OPEN[1:], add_special_tokens=False) + body + \
        tok.encode(CALL_CLOSE[:1], add_special_tokens=False) + tok.encode(CALL_CLOSE[1:], add_special_tokens=False) + [0]

    def accepts(grammar: str, tokens: list[int]) -> bool:
        state = compiler.compile({"grammar": grammar}).state("cpu")
        return all(state.advance(t) for t in tokens)

    with_tokens = hermes_grammar(TOOLS, "get_time", call_tokens=ids)
    assert accepts(with_tokens, one_token) and accepts(with_tokens, spelled)
    # without them: the markers' text is forced, whose one tokenization to llguidance's masks is the
    # added token, which it then fails to consume: nothing can be written, refused when compiled
    with pytest.raises(DFlashError, match=re.escape(f"cannot be used: the constraint requires the text of the special "
                                                    f"token {ids[0]} ('{CALL_OPEN}') here")):
        accepts(hermes_grammar(TOOLS, "get_time"), one_token)
