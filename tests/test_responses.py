"""OpenAI's Responses API (``POST /v1/responses``): real servers (the shipped pair, speculative
with the hermes tool-call format and target-only, as tests/test_structured_server.py serves
them; the scripted tool-calling model of tests/test_tools.py) and the ``openai`` client's
``client.responses.create`` / ``client.responses.stream``.

Oracles: the reply equals the chat completion of the same messages (and the Python engine's
``generate(..., chat=True)``), greedy speculative output equals the target alone's; streamed
deltas concatenate to the non-streamed text; every event and response validates against
the openai package's own types; the prompts of multi-turn inputs with function calls are
transformers' ``apply_chat_template`` (tests/test_tools.py's oracle)."""

from __future__ import annotations

import json
import re
from typing import get_args

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseIncludable, ResponseStreamEvent
from pydantic import TypeAdapter
from test_reasoning import thinking_pair  # noqa: F401 (fixture)
from test_server import API_KEY, MODEL
from test_structured_server import DEAD_END, PERSON, _calls, conforms, servers  # noqa: F401
from test_structured_server import TOOLS as CHAT_TOOLS
from test_tools import MESSAGES as TOOL_MESSAGES
from test_tools import WANT_CALLS, _oracle, _with_dict_arguments, scripted_pair, server  # noqa: F401 (fixtures)

from dflash_torch import DFlashEngine
from dflash_torch.serving.protocol import ResponsesRequest, responses_message, responses_param
from dflash_torch.serving.responses import ResponseBuilder
from dflash_torch.serving.tools import ToolCall

EVENT = TypeAdapter(ResponseStreamEvent)
PROMPT = "def fibonacci(n):"
STOP = {"stop": ["\n\n"]}  # (the shipped model writes a blank line soon: a reply that ends, not cut)


def flat(tools: list[dict]) -> list[dict]:
    """Chat completions' tools in the Responses API's flat shape."""
    return [{"type": "function", **tool["function"]} for tool in tools]


FLAT_TOOLS = flat(CHAT_TOOLS)


def _respond(client, **kw) -> Response:
    return client.responses.create(**{"model": MODEL, "temperature": 0, **kw})


def _events(client, **kw) -> list:
    """The stream's events, each checked against the openai package's event types."""
    events = list(client.responses.create(**{"model": MODEL, "temperature": 0, "stream": True, **kw}))
    for ev in events:
        EVENT.validate_python(ev.to_dict())
    assert [ev.sequence_number for ev in events] == list(range(len(events)))
    return events


def _shape(response) -> list:
    """The output of a response without its random ids."""
    return [{k: v for k, v in item.to_dict().items() if k not in ("id", "call_id")} for item in response.output]


def _raw(client, body: dict) -> httpx.Response:
    return httpx.post(f"{client.base_url}responses", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=120)


def test_text_equals_chat_completions_and_the_engine(servers):
    spec, alone = servers
    messages = [{"role": "user", "content": PROMPT}]
    chat = spec.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    r = _respond(spec, input=PROMPT, max_output_tokens=24)
    Response.model_validate(r.to_dict())
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.output_text == chat.choices[0].message.content and len(r.output) == 1
    assert r.output[0].type == "message" and r.output[0].id.startswith("msg_")
    # cut by max_output_tokens: incomplete, with the reason
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, 24)
    assert r.usage.total_tokens == r.usage.input_tokens + 24 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert (r.max_output_tokens, r.temperature, r.top_p, r.tool_choice, r.tools) == (24, 0, 1, "auto", [])
    assert _respond(alone, input=PROMPT, max_output_tokens=24).output_text == r.output_text  # (lossless)
    # (trial-210: the settings every Response echoes, sent back, were a 400 "tool_choice needs tools")
    assert _respond(spec, input=PROMPT, max_output_tokens=24, tool_choice="auto", tools=[]).output_text == r.output_text
    engine = DFlashEngine.from_pretrained()
    assert engine.generate(messages, chat=True, max_new_tokens=24).text == r.output_text
    # a reply that ends: completed (a stop string, a vLLM-style extension)
    done = _respond(spec, input=PROMPT, max_output_tokens=200, extra_body=STOP)
    assert done.status == "completed" and done.incomplete_details is None and done.output[0].status == "completed"
    assert done.output_text == engine.generate(messages, chat=True, max_new_tokens=200, stop=["\n\n"]).text != ""
    # instructions, and a list of items: developer is system, output_text parts of an assistant message
    items = [{"role": "developer", "content": "Python only."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "def f"},
                                                             {"type": "input_text", "text": "(x):"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "  return x",
                                                                   "annotations": []}]},
             {"role": "user", "content": "class A:"}]
    r = _respond(spec, input=items, instructions="Be brief.", max_output_tokens=16, metadata={"k": "v"})
    history = [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Python only."},
               {"role": "user", "content": "def f\n(x):"}, {"role": "assistant", "content": "  return x"},
               {"role": "user", "content": "class A:"}]
    chat = spec.chat.completions.create(model=MODEL, messages=history, temperature=0, max_tokens=16)
    assert r.output_text == chat.choices[0].message.content and r.usage.input_tokens == chat.usage.prompt_tokens
    assert (r.instructions, r.metadata) == ("Be brief.", {"k": "v"})


def test_a_refusal_part_of_an_assistant_message_item_is_its_text(servers):
    """An assistant message item sent back as OpenAI returned it may hold a ``refusal``
    content part: its text joins the content as an output_text part's does, as chat reads
    refusal parts (it was a 400 "only text content is supported")."""
    spec, _ = servers
    items = [{"role": "user", "content": "def f(x):"},
             {"type": "message", "role": "assistant", "content": [
                 {"type": "output_text", "text": "  return x", "annotations": []},
                 {"type": "refusal", "refusal": "I can't help with that."}]},
             {"role": "user", "content": "class A:"}]
    r = _respond(spec, input=items, max_output_tokens=8)
    history = [{"role": "user", "content": "def f(x):"},
               {"role": "assistant", "content": "  return x\nI can't help with that."},
               {"role": "user", "content": "class A:"}]
    chat = spec.chat.completions.create(model=MODEL, messages=history, temperature=0, max_tokens=8)
    assert r.output_text == chat.choices[0].message.content and r.usage.input_tokens == chat.usage.prompt_tokens

def test_streamed_events_give_the_non_streamed_response(servers):
    spec, _ = servers
    whole = _respond(spec, input=PROMPT, max_output_tokens=40)
    events = _events(spec, input=PROMPT, max_output_tokens=40)
    types = [ev.type for ev in events]
    deltas = [ev for ev in events if ev.type == "response.output_text.delta"]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * len(deltas) + \
        ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert len(deltas) > 1 and "".join(ev.delta for ev in deltas) == whole.output_text
    assert events[-2].item.status == "incomplete" and events[-3].part.text == whole.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final.status == "incomplete" and final.id == events[0].response.id and _shape(final) == _shape(whole)
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens, 40)
    # the client's stream helper, a reply that ends
    want = _respond(spec, input=PROMPT, max_output_tokens=200, extra_body=STOP)
    with spec.responses.stream(model=MODEL, input=PROMPT, temperature=0, max_output_tokens=200, extra_body=STOP) as s:
        text = "".join(ev.delta for ev in s if ev.type == "response.output_text.delta")
        got = s.get_final_response()
    assert got.status == "completed" and got.output_text == text == want.output_text
    # raw: each event's "event:" line is its type
    with httpx.stream("POST", f"{spec.base_url}responses", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": MODEL, "input": PROMPT, "max_output_tokens": 4, "stream": True}, timeout=120) as h:
        lines = [line for line in h.iter_lines() if line]
    assert h.headers["content-type"].startswith("text/event-stream")
    pairs = list(zip(lines[::2], lines[1::2]))
    assert all(e == "event: " + json.loads(d.removeprefix("data: "))["type"] for e, d in pairs) and pairs


def test_function_calls_the_model_writes_and_a_multi_turn_input(server, scripted_pair):
    from transformers import AutoTokenizer

    client = server.client()
    model = client.models.list().data[0].id
    tools = flat(CHAT_TOOLS)
    r = client.responses.create(model=model, input=TOOL_MESSAGES[0]["content"], tools=tools, temperature=0)
    Response.model_validate(r.to_dict())
    assert [item.type for item in r.output] == ["message", "function_call", "function_call"] and r.status == "completed"
    assert r.output_text == "Let me check."
    calls = r.output[1:]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == WANT_CALLS
    assert all(c.call_id.startswith("call_") and c.id.startswith("fc_") and c.status == "completed" for c in calls)
    tok = AutoTokenizer.from_pretrained(str(scripted_pair[0]))
    assert r.usage.input_tokens == len(_oracle(tok, TOOL_MESSAGES, tools=CHAT_TOOLS))
    assert [t.name for t in r.tools] == ["get_weather", "get_time"]
    events = _events(client, model=model, input=TOOL_MESSAGES, tools=tools)
    args = [ev for ev in events if ev.type.startswith("response.function_call_arguments.")]
    assert [ev.type.rsplit(".", 1)[1] for ev in args] == ["delta", "done"] * 2
    assert [json.loads(ev.arguments) for ev in args[1::2]] == [a for _, a in WANT_CALLS]
    assert events[-1].type == "response.completed" and _shape(events[-1].response) == _shape(r)
    # tool_choice none: the model is not told of the tools and its reply is text
    r = client.responses.create(model=model, input=TOOL_MESSAGES, tools=tools, tool_choice="none", temperature=0)
    assert [item.type for item in r.output] == ["message"] and "<tool_call>" in r.output_text
    # the calls and their outputs of earlier turns: the prompt is transformers' (arguments as a dict)
    turn = [{"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "call_b", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "14:05"}]}]
    r = client.responses.create(model=model, input=TOOL_MESSAGES + turn, tools=tools, temperature=0,
                                max_output_tokens=1)
    history = TOOL_MESSAGES + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_b", "content": "14:05"}]
    want = len(_oracle(tok, _with_dict_arguments(history), tools=CHAT_TOOLS))
    assert r.usage.input_tokens == want
    chat = client.chat.completions.create(model=model, messages=history, tools=CHAT_TOOLS, temperature=0, max_tokens=1)
    assert chat.usage.prompt_tokens == want
    # the model's own output items sent back as they came, then the outputs: the same prompt
    back = client.responses.create(model=model, input=TOOL_MESSAGES, tools=tools, temperature=0)
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "ok"} for c in back.output[1:]]
    r = client.responses.create(model=model, input=TOOL_MESSAGES + [item.to_dict() for item in back.output] + outputs,
                                tools=tools, temperature=0, max_output_tokens=1)
    history = TOOL_MESSAGES + [{"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in back.output[1:]]}] + [{"role": "tool", "tool_call_id": o["call_id"], "content": "ok"} for o in outputs]
    assert r.usage.input_tokens == len(_oracle(tok, _with_dict_arguments(history), tools=CHAT_TOOLS))


def test_parallel_tool_calls_false_gives_the_first_function_call_only(server):
    """As chat's: the reply's first call only (trial-97: both), streamed and not alike."""
    client = server.client()
    model = client.models.list().data[0].id
    kw = dict(model=model, input=TOOL_MESSAGES, tools=flat(CHAT_TOOLS), parallel_tool_calls=False)
    r = client.responses.create(temperature=0, **kw)
    assert [item.type for item in r.output] == ["message", "function_call"] and r.output_text == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in r.output[1:]] == WANT_CALLS[:1]
    assert r.parallel_tool_calls is False and r.status == "completed"
    events = _events(client, **kw)
    assert len([ev for ev in events if ev.type == "response.function_call_arguments.delta"]) == 1
    assert events[-1].type == "response.completed" and _shape(events[-1].response) == _shape(r)


def test_a_function_call_item_with_empty_arguments_is_a_call_without_arguments(server, scripted_pair):
    """``arguments`` ``""`` is ``{}``, as in chat (trial-97: a 400), and so are null and no
    ``arguments`` (trial-101: null was refused in pydantic's words); text that is not a JSON
    object is refused, naming the item's ``arguments``."""
    from transformers import AutoTokenizer

    client = server.client()
    model = client.models.list().data[0].id
    turn = [{"type": "function_call", "call_id": "call_a", "name": "get_time", "arguments": ""},
            {"type": "function_call_output", "call_id": "call_a", "output": "14:05"}]
    r = client.responses.create(model=model, input=TOOL_MESSAGES + turn, tools=flat(CHAT_TOOLS), temperature=0,
                                max_output_tokens=1)
    history = TOOL_MESSAGES + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "14:05"}]
    tok = AutoTokenizer.from_pretrained(str(scripted_pair[0]))
    assert r.usage.input_tokens == len(_oracle(tok, history, tools=CHAT_TOOLS))
    call = {k: v for k, v in turn[0].items() if k != "arguments"}
    for item in ({**call, "arguments": None}, call):
        r = client.responses.create(model=model, input=TOOL_MESSAGES + [item, turn[1]], tools=flat(CHAT_TOOLS),
                                    temperature=0, max_output_tokens=1)
        assert r.usage.input_tokens == len(_oracle(tok, history, tools=CHAT_TOOLS)), item
    for bad, words in (("{oops", "not valid JSON"), ("[1]", "must be a JSON object's text, got an array"),
                       ("null", "got null"), ("5", "got a number"), ('"s"', "got a string"), ("true", "got a boolean"),
                       ('{"a": NaN}', "NaN is not JSON")):  # (strict JSON: trial-134)
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=model, input=TOOL_MESSAGES + [{**turn[0], "arguments": bad}, turn[1]],
                                    tools=flat(CHAT_TOOLS), max_output_tokens=1)
        assert err.value.body["param"] == "input.1.arguments" and words in err.value.body["message"], err.value.body


def test_forced_tool_calls_equal_chat_completions(servers):
    spec, _ = servers
    messages = [{"role": "user", "content": "Who is it? Answer in JSON."}]
    for choice, flat_choice, extra in [("required", "required", {"parallel_tool_calls": False}),
                                       ({"type": "function", "function": {"name": "get_weather"}},
                                        {"type": "function", "name": "get_weather"}, {})]:
        chat = spec.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS, tool_choice=choice,
                                            temperature=0, max_tokens=400, **extra)
        want = _calls(chat.choices[0].message.tool_calls)
        r = _respond(spec, input=messages, tools=FLAT_TOOLS, tool_choice=flat_choice, max_output_tokens=400, **extra)
        assert [item.type for item in r.output] == ["function_call"] * len(want) and r.output_text == ""
        assert [(c.name, json.loads(c.arguments)) for c in r.output] == want and r.status == "completed"
        events = _events(spec, input=messages, tools=FLAT_TOOLS, tool_choice=flat_choice, max_output_tokens=400, **extra)
        done = [ev.item for ev in events if ev.type == "response.output_item.done"]
        assert [(c.name, json.loads(c.arguments)) for c in done] == want
        assert r.to_dict()["tool_choice"] == flat_choice


def test_text_format_json_schema_conforms_and_is_lossless(servers):
    """(The four long JSON requests are sent at once, to be decoded together: this model's JSON
    is hundreds of tokens, mostly whitespace.)"""
    from concurrent.futures import ThreadPoolExecutor

    spec, alone = (client.with_options(timeout=600) for client in servers)  # (decoded together: slower each)
    messages = [{"role": "user", "content": "Who is it? Answer in JSON."}]
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    with ThreadPoolExecutor(4) as pool:
        asked = pool.submit(_respond, spec, input=messages, text={"format": fmt}, max_output_tokens=400)
        wanted = pool.submit(_respond, alone, input=messages, text={"format": fmt}, max_output_tokens=400)
        chatted = pool.submit(spec.chat.completions.create, model=MODEL, messages=messages, temperature=0,
                              max_tokens=400, response_format={"type": "json_schema", "json_schema": {
                                  "name": "person", "schema": PERSON, "strict": True}})
        streamed = pool.submit(_events, spec, input=messages, text={"format": fmt}, max_output_tokens=400)
        r, want, chat, streamed = asked.result(), wanted.result(), chatted.result(), streamed.result()
    assert r.status == "completed" and conforms(json.loads(r.output_text), PERSON)
    assert want.output_text == r.output_text
    assert chat.choices[0].message.content == r.output_text
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"
    assert streamed[-1].response.output_text == r.output_text
    obj = _respond(spec, input="x = ", text={"format": {"type": "json_object"}}, max_output_tokens=400)
    assert isinstance(json.loads(obj.output_text), dict)


# Chat Completions' parameters and the engine's, and its way of naming a chat message
CHAT_NAMES = (r"\b(?:max_tokens|max_completion_tokens|max_new_tokens|response_format|reasoning_effort|messages|"
              r"message \d|stream_options\.include_usage|functions|prompt_logprobs)\b")
BAD = [  # (body fields, status, param, words of the message)
    ({"store": True}, 400, "store", "no state"),
    ({"previous_response_id": "resp_1"}, 400, "previous_response_id", "no state"),
    ({"conversation": "conv_1"}, 400, "conversation", "no state"),
    ({"background": True}, 400, "background", "no state"),
    ({"truncation": "auto"}, 400, "truncation", "disabled"),
    # (trial-210: pydantic's type names, "expected one of str, list[dict[str,any]]" and "... list[_Part]")
    ({"input": 5}, 400, "input", "invalid value for input: expected a string or an array of input items, got a number"),
    ({"input": []}, 400, "input", "empty"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input.0.type", "stored"),
    ({"input": [{"type": "web_search_call"}]}, 400, "input.0.type", "not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input.0.content.0.type", "only text"),
    # (media in a function_call_output or reasoning item: refused as a message's, trial-208: answered, unseen)
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1",
                 "output": [{"type": "input_text", "text": "r", "image_url": "data:x"}]}]}, 400,
     "input.1.output", "part 0 holds 'image_url': only text is supported"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "r", "images": ["AA"]}]}, 400,
     "input.1", "holds 'images': only text is supported"),
    ({"input": [{"role": "user", "content": "q"},
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "t", "image_url": "x"}]},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]}, 400,
     "input.1.summary", "part 0 holds 'image_url': only text is supported"),
    ({"input": [{"role": "user", "content": "q"}, {"type": "reasoning", "summary": [], "video": "x"},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]}, 400,
     "input.1", "holds 'video': only text is supported"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input.0.role", "invalid value"),
    # (OpenAI's refusal content part: an assistant message's output, not a user's)
    ({"input": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]}, 400, "input.0.content.0.type",
     "input.0.content.0 is a refusal part, which only an assistant message may hold"),
    ({"input": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "refusal"}]}]}, 400,
     "input.1.content.0.refusal", "missing required parameter: input.1.content.0.refusal"),
    ({"input": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "refusal", "refusal": 5}]}]},
     400, "input.1.content", "part 0's 'refusal' must be a string, got a number"),  # (was "expected one of str, list[_Part]")
    ({"input": ["hi"]}, 400, "input.0", "invalid value for input.0: expected an input item (an object), got a string"),
    ({"input": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]}, 400, "input.1.content",
     "invalid value for input.1.content: expected a string or an array of content parts, got null"),
    ({"input": [{"role": "user", "content": "q"}, {"type": "function_call", "call_id": "c", "name": "f"},
                {"type": "function_call_output", "call_id": "c", "output": {"a": 1}}]}, 400, "input.2.output",
     "invalid value for input.2.output: expected a string or an array of content parts, got an object"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "name": "f", "arguments": "{}"}]}, 400,
     "input.1.call_id", "missing"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]}, 400,
     "input.0.arguments", "not valid JSON"),
    # (the item's index in input, whatever messages instructions and merged calls make of it)
    ({"instructions": "s", "input": [{"role": "user", "content": "q"},
                                     {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                                     {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "[1]"}]},
     400, "input.2.arguments", "input.2.arguments must be a JSON object"),
    # a function_call_output answers an earlier function_call (OpenAI: "No tool call found ...")
    ({"input": [{"role": "user", "content": "q"}, {"type": "function_call_output", "call_id": "c9", "output": "1"}]},
     400, "input.1.call_id", "No tool call found for function call output with call_id c9"),
    ({"input": [{"role": "user", "content": "q"}, {"type": "function_call_output", "call_id": "c1", "output": "1"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]},
     400, "input.1.call_id", "No tool call found"),
    # each function_call has its output, after it and before the next message, once (OpenAI: "No tool output found for
    # function call ..."; trial-292: taken, the model seeing a call without its result)
    ({"input": [{"role": "user", "content": "q"}, {"type": "function_call", "call_id": "c1", "name": "f",
                                                   "arguments": "{}"}]}, 400, "input.1",
     "no function_call_output for the function call input.1 (call_id c1): each function_call item needs a "
     "function_call_output item with its call_id after it in input"),
    ({"input": [{"role": "user", "content": "q"}, {"type": "function_call", "call_id": "c1", "name": "f"},
                {"type": "function_call", "call_id": "c2", "name": "f"},
                {"type": "function_call", "call_id": "c3", "name": "f"},
                {"type": "function_call_output", "call_id": "c1", "output": "1"}, {"role": "user", "content": "go"}]},
     400, "input.2", "no function_call_output for the function call input.2 (call_id c2) (nor for 1 more of its "
                     "calls): each function_call item needs a function_call_output item with its call_id after it, "
                     "before the message input.5"),
    # (a function_call after outputs starts a new turn: named as a function_call, not a message, trial-299 b)
    ({"input": [{"role": "user", "content": "q"}, {"type": "function_call", "call_id": "c1", "name": "f"},
                {"type": "function_call", "call_id": "c2", "name": "f"},
                {"type": "function_call_output", "call_id": "c1", "output": "1"},
                {"type": "function_call", "call_id": "c3", "name": "f"},
                {"type": "function_call_output", "call_id": "c2", "output": "2"},
                {"type": "function_call_output", "call_id": "c3", "output": "3"}]},
     400, "input.2", "no function_call_output for the function call input.2 (call_id c2): each function_call item needs "
                     "a function_call_output item with its call_id after it, before the function_call input.4, which "
                     "follows function_call_output items"),
    ({"input": [{"role": "user", "content": "q"}, {"type": "function_call", "call_id": "c1", "name": "f"},
                {"type": "function_call_output", "call_id": "c1", "output": "1"},
                {"type": "function_call_output", "call_id": "c1", "output": "2"}]}, 400, "input.3.call_id",
     "input.3 is a second function_call_output for call_id c1, which input.2 already answered (each function call "
     "has one output)"),
    # Chat Completions' parameters: not the Responses API's (OpenAI: an unknown parameter), the equivalent named
    ({"max_tokens": 5}, 400, "max_tokens", "max_tokens is not a Responses parameter; use max_output_tokens"),
    ({"max_completion_tokens": 5}, 400, "max_completion_tokens", "use max_output_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "messages", "use input"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format", "use text.format"),
    ({"reasoning_effort": "low"}, 400, "reasoning_effort", "use reasoning.effort"),
    ({"n": 2}, 400, "n", "n is not a Responses parameter"),
    ({"n": 1}, 400, "n", "one response"),
    ({"logprobs": True}, 400, "logprobs", "not supported in /v1/responses"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options.include_usage", "usage is always"),
    ({"functions": [{"name": "f"}]}, 400, "functions", "use tools"),
    ({"prompt_logprobs": 1}, 400, "prompt_logprobs", "not a Responses parameter"),
    # (chat's prompt options: a response is a new assistant turn; they were ignored)
    ({"continue_final_message": True, "add_generation_prompt": False}, 400, "continue_final_message",
     "/v1/chat/completions parameter"),
    ({"add_generation_prompt": False}, 400, "add_generation_prompt", "new assistant turn"),
    ({"chat_template": "{{ 'x' }}"}, 400, "chat_template", "the model's own chat template"),
    # errors of the chat machinery and the engine, in the Responses API's names
    ({"min_tokens": 5}, 400, "min_tokens", "at most max_output_tokens (4)"),
    # (a forced call ends the reply: not "a structured output", trial-299 h)
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}], "tool_choice": "required",
      "ignore_eos": True}, 400, "ignore_eos",
     "tool_choice 'required' (a forced tool call, which the reply ends after) cannot be combined with ignore_eos"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}], "tool_choice": "required",
      "min_tokens": 2}, 400, "min_tokens", "cannot be combined with min_tokens (2)"),
    ({"tool_choice": "required", "tools": []}, 400, "tool_choice", "tool_choice needs tools"),  # ('auto' is taken)
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "array", "uniqueItems": True}}}}], "tool_choice": "required"}, 400, "tools.0.parameters",
     "tools.0.parameters (function 'f') cannot constrain the forced tool call of tool_choice 'required': the JSON "
     "Schema keyword 'uniqueItems' is not supported"),  # (named as the Responses API nests it; trial-292: unnamed; param
    # the path the message names, trial-299 g: was tools)
    ({"text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "array", "uniqueItems": True}}}}, 400,
     "text.format.schema", "text.format.schema is invalid: the JSON Schema keyword 'uniqueItems' is not supported"),
    # (the tool's path as the Responses API nests it: no "function")
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "objekt"}}]}, 400,
     "tools", "tools[0].parameters must be the JSON Schema of an object"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools.0.type", "function tools"),
    ({"tools": [{"type": "function"}]}, 400, "tools.0.name", "missing"),
    # (trial-210: an empty name and two tools of one name were taken; the chat parameter's path as the Responses
    # API's, no "function")
    ({"tools": [{"type": "function", "name": ""}]}, 400, "tools.0.name",
     "invalid value for tools.0.name: a function needs a name its calls can give, got an empty string"),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f", "description": "g"}]}, 400,
     "tools.1.name",
     "tools.0 and tools.1 are two different tools named 'f'"),
    # (trial-210: taken, asking for nothing; OpenAI's values are taken, see test_ignored_fields_and_the_client_error_type)
    ({"include": ["bogus.thing"]}, 400, "include",
     "invalid value for include: 'bogus.thing' is not one of the Responses API's include values, "
     "'file_search_call.results', 'web_search_call.results', "),
    # (trial-101: the forms were quoted Python's way, {'type': 'function', 'name': ...})
    ({"tools": FLAT_TOOLS, "tool_choice": {"type": "allowed_tools", "tools": []}}, 400, "tool_choice.type",
     """tool_choice must be 'none', 'auto', 'required' or {"type": "function", "name": ...}; 'allowed_tools' is not """
     "supported"),
    # (the exact path, trial-101: tool_choice)
    ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice.name", "not among"),
    # (trial-101: "missing required parameter: tool_choice.name", the forms unnamed, null as missing)
    ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function"}}, 400, "tool_choice.name",
     """tool_choice.name is missing; tool_choice must be 'none', 'auto', 'required' or {"type": "function", "name": """
     "...}"),
    ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": None}}, 400, "tool_choice.name",
     """tool_choice.name must be a string, got null; tool_choice must be 'none', 'auto', 'required' or {"type": """
     '"function", "name": ...}'),
    # (trial-97: "expected one of literal['none','auto','required']", the object form unnamed)
    ({"tools": FLAT_TOOLS, "tool_choice": "Auto"}, 400, "tool_choice",
     """tool_choice must be 'none', 'auto', 'required' or {"type": "function", "name": ...}; got 'Auto'"""),
    ({"tools": FLAT_TOOLS, "tool_choice": {"name": "get_weather"}}, 400, "tool_choice.type", "tool_choice.type is missing"),
    ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": 1}}, 400, "tool_choice.name",
     "tool_choice.name must be a string, got a number"),
    ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, 400,
     "tool_choice.name", "tool_choice.name is missing ({'function': {'name': ...}} is chat completions' form)"),
    ({"tool_choice": "required"}, 400, "tool_choice", "needs tools"),
    ({"tools": FLAT_TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, 400, "tool_choice",
     "text.format json_object"),
    ({"text": {"format": {"type": "json_schema", "name": "a b", "schema": PERSON}}}, 400, "text.format.name", "64"),
    ({"text": {"format": {"type": "json_schema", "name": "p"}}}, 400, "text.format", "schema"),
    # (chat completions' nesting: "needs a name and a schema", the misplaced key unnamed; trial-240)
    ({"text": {"format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}}, 400, "text.format",
     "invalid value for text.format: a json_schema format is flat ({'type': 'json_schema', 'name': ..., 'schema': "
     "...}), not nested under 'json_schema' as in chat completions"),
    ({"text": {"format": {"type": "json_schema", "name": "p", "json_schema": PERSON}}}, 400, "text.format",
     "not nested under 'json_schema'"),
    ({"text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "objekt"}}}}, 400, "text.format.schema",
     "text.format.schema is invalid"),
    ({"text": {"format": {"type": "xml"}}}, 400, "text.format.type", "json_schema"),
    ({"reasoning": {"effort": "extreme"}}, 400, "reasoning.effort", "minimal"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens", "greater than or equal to 1"),
    ({"max_output_tokens": 10**6}, 400, "max_output_tokens", "max_output_tokens (1000000)"),
    ({"temperature": "hot"}, 400, "temperature", "number"),
    ({"top_p": 0}, 400, "top_p", "greater than 0"),
    ({"metadata": {"k": 1}}, 400, "metadata.k", "string"),
    ({"top_logprobs": 2}, 400, "top_logprobs", "not supported"),
    ({"seed": "1"}, 400, "seed", "integer"),
    ({"guided_regex": "(("}, 400, "guided_regex", "regex"),
    ({"model": "other"}, 404, "model", "does not exist"),
]


@pytest.mark.parametrize("body,status,param,words", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_requests_are_errors_naming_the_responses_parameter(servers, body, status, param, words):
    spec, _ = servers
    for stream in (False, True):
        h = _raw(spec, {"model": MODEL, "input": "hi", "max_output_tokens": 4, "stream": stream, **body})
        e = h.json()["error"]
        assert h.status_code == status and e["param"] == param and words in e["message"], e
        assert "\n" not in e["message"] and e["type"], e
        # no Chat Completions (or engine) name in the message, but a chat parameter refused as unknown
        chat_names = set(re.findall(CHAT_NAMES, e["message"]))
        assert not chat_names or (chat_names == {param} and e["code"] == "unknown_parameter"), e


def test_stream_options_without_stream_is_refused_as_in_chat(servers):
    """``stream_options`` without ``stream: true`` is a 400 in /v1/responses as in chat and
    completions (it was taken without a word); with ``stream`` it is accepted."""
    spec, _ = servers
    for path, body in (("responses", {"input": "hi", "max_output_tokens": 2,
                                      "stream_options": {"include_obfuscation": False}}),
                       ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                             "stream_options": {"include_usage": True}})):
        h = httpx.post(f"{spec.base_url}{path}", json={"model": MODEL, **body},
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
        e = h.json()["error"]
        assert h.status_code == 400 and e["param"] == "stream_options", e
        assert e["message"] == "stream_options is only allowed when stream is true", e
    h = _raw(spec, {"model": MODEL, "input": "hi", "max_output_tokens": 2, "stream": True,
                    "stream_options": {"include_obfuscation": False}})
    assert h.status_code == 200 and h.text.startswith("event: response.created"), h.text


def test_ignored_fields_and_the_client_error_type(servers):
    spec, _ = servers
    r = _respond(spec, input="x", max_output_tokens=2, store=False, truncation="disabled", user="u",
                 reasoning={"summary": "auto"}, include=[v for v in get_args(ResponseIncludable) if "logprobs" not in v],
                 parallel_tool_calls=True,
                 extra_body={"service_tier": "auto", "prompt_cache_key": "k", "unknown_field": {"a": 1}})
    assert r.usage.output_tokens == 2 and r.store is False and r.user == "u"
    # the documented extensions (vLLM-style) and OpenAI's stream_options are not chat-only fields: served
    r = _respond(spec, input="x", max_output_tokens=2, extra_body={
        "seed": 1, "stop": ["\n\n"], "top_k": 5, "logit_bias": {"5": 1.0}, "ignore_eos": True, "min_tokens": 1,
        "repetition_penalty": 1.1, "presence_penalty": 0.1, "frequency_penalty": 0.1, "stop_token_ids": [0],
        "chat_template_kwargs": {}})
    assert r.usage.output_tokens == 2
    r = _respond(spec, input="x", max_output_tokens=20, extra_body={"guided_choice": ["yes", "no"]})
    assert r.output_text in ("yes", "no")
    for effort in ("none", "minimal", "xhigh"):  # (OpenAI's efforts beyond chat's low, medium, high)
        assert _respond(spec, input="x", max_output_tokens=2, reasoning={"effort": effort}).reasoning.effort == effort
    events = _events(spec, input="x", max_output_tokens=2, stream_options={"include_obfuscation": False})
    assert events[-1].response.usage.output_tokens == 2
    with pytest.raises(openai.BadRequestError) as err:
        _respond(spec, input="x", store=True)
    assert err.value.body["param"] == "store" and err.value.body["code"] == "unsupported_parameter"


def test_the_builder_writes_reasoning_text_and_calls_as_the_openai_types():
    echo = {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True, "text": {"format": {"type": "text"}}}
    b = ResponseBuilder("resp_1", "m", echo)
    call = ToolCall("get_time", "{}")
    events = b.start() + b.feed(reasoning="think ") + b.feed(reasoning="more", text="Hi") + b.feed(text=" there") + \
        b.feed(calls=[call]) + b.finish("stop", 5, 9, cached_tokens=2, reasoning_tokens=3, extra={"dflash": None})
    for ev in events:
        EVENT.validate_python(ev)
    assert [ev["sequence_number"] for ev in events] == list(range(len(events)))
    types = [ev["type"] for ev in events]
    assert types == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                     "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
                     "response.output_item.done",
                     "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == "Hi there" and final.status == "completed"
    reasoning, message, fc = final.output
    assert message.type == "message" and message.content[0].annotations == [] and reasoning.type == "reasoning" and reasoning.content[0].text == "think more" and reasoning.summary == []
    assert (fc.call_id, fc.name, fc.arguments) == (call.id, "get_time", "{}")
    assert final.usage.input_tokens_details.cached_tokens == 2 and final.usage.output_tokens_details.reasoning_tokens == 3
    assert b.response() == events[-1]["response"]
    # cut while reasoning: incomplete, and the reasoning item too; nothing at all: an empty message
    b = ResponseBuilder("resp_2", "m", echo)
    events = b.feed(reasoning="hmm") + b.finish("length", 5, 1, thinking=True)
    assert events[-1]["type"] == "response.incomplete" and b.items[0]["status"] == "incomplete"
    b = ResponseBuilder("resp_3", "m", echo)
    b.finish("stop", 5, 1)
    assert Response.model_validate(b.response()).output_text == "" and b.items[0]["type"] == "message"
    error = b.error("boom", "server_error", None, None)
    EVENT.validate_python(error)


def test_output_items_keep_the_replys_order_whole_or_in_pieces():
    """A reply with reasoning, text, a call, then text again (a call cut, or an answer after a
    call) gives items in that order whether the parser sees it whole (a non-streamed reply,
    one round's tokens) or token by token (marker_pieces)."""
    from dflash_torch.serving.responses import marker_pieces
    from dflash_torch.serving.tools import new_reply_parser

    reply = ('plan it</think>Let me look. <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
             'and a <b>cut <tool_call>\n{"name": "get_ti')
    echo = {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True, "text": {"format": {"type": "text"}}}
    orders = []
    for pieces in ([reply], list(reply)):
        parser, b = new_reply_parser("think", "hermes", "# assistant:\n<think>\n"), ResponseBuilder("r", "m", echo)
        for chunk in pieces:
            for piece in marker_pieces(chunk):
                b.feed(*parser.feed(piece))
        b.feed(*parser.finish(False))
        b.finish("length", 5, 9)
        orders.append([(i["type"], i["status"], i.get("name") or i["content"][0]["text"]) for i in b.items])
    assert orders[0] == orders[1] == [
        ("reasoning", "completed", "plan it"), ("message", "completed", "Let me look."),
        ("function_call", "completed", "get_time"),
        ("message", "incomplete", 'and a <b>cut <tool_call>\n{"name": "get_ti')], orders


@pytest.mark.parametrize("prompt,reply,finish,items", [
    ("", "<think>", "length", [("reasoning", "incomplete", "")]),  # (Qwen3: the model opens it, then is cut)
    ("# assistant:\n<think>\n", "", "stop", [("reasoning", "completed", "")]),  # (a stop string took it all)
    ("", "", "length", [("message", "incomplete", "")]),  # (nothing: the reply may have been an answer)
    ("# assistant:\n<think>\n", "r</think>", "length", [("reasoning", "completed", "r")]),
])
def test_a_reply_that_ended_in_its_reasoning_before_its_text_has_a_reasoning_item(prompt, reply, finish, items):
    """As chat's ``content`` null: the reply ended while thinking, with no answer (an empty
    message item only where nothing says it thought)."""
    from dflash_torch.serving.responses import marker_pieces
    from dflash_torch.serving.tools import new_reply_parser

    echo = {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True, "text": {"format": {"type": "text"}}}
    parser, b = new_reply_parser("think", "none", prompt), ResponseBuilder("r", "m", echo)
    for piece in marker_pieces(reply):
        b.feed(*parser.feed(piece))
    b.feed(*parser.finish(finish == "stop"))
    events = b.finish(finish, 5, 1, thinking=parser.thinking)
    for ev in events:
        EVENT.validate_python(ev)
    assert [(i["type"], i["status"], i["content"][0]["text"]) for i in b.items] == items


def test_reasoning_items_of_a_thinking_model(thinking_pair):
    """A model that thinks (the template opens ``<think>``), then answers: a reasoning item,
    then the message, as chat's ``reasoning_content`` and ``content``. (The app in this
    process, through the openai client: a server process costs ~4 s CPU to start.)"""
    from starlette.testclient import TestClient

    from dflash_torch.serving.app import create_app

    messages = [{"role": "user", "content": "def f(x):"}]
    app = create_app(DFlashEngine.from_pretrained(*thinking_pair), API_KEY, MODEL)  # (reasoning parser auto: think)
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key=API_KEY, max_retries=0, http_client=http)
        kw = dict(max_output_tokens=40, extra_body={"ignore_eos": True})
        msg = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].message
        assert msg.reasoning_content and msg.content
        r = _respond(client, input=messages, **kw)
        assert [item.type for item in r.output] == ["reasoning", "message"] and r.status == "incomplete"
        assert r.output[0].id.startswith("rs_") and r.output[0].summary == [] and r.output[0].status == "completed"
        assert (r.output[0].content[0].text, r.output_text) == (msg.reasoning_content, msg.content)
        assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens == 40
        events = _events(client, input=messages, **kw)
        thought = "".join(ev.delta for ev in events if ev.type == "response.reasoning_text.delta")
        said = "".join(ev.delta for ev in events if ev.type == "response.output_text.delta")
        assert (thought, said) == (msg.reasoning_content, msg.content)
        assert [ev.type for ev in events if ev.type.endswith(".done")][:3] == [
            "response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]
        assert _shape(events[-1].response) == _shape(r)
        # the reasoning item sent back (with the next turn): accepted
        back = [m for m in messages] + [item.to_dict() for item in r.output] + [{"role": "user", "content": "more"}]
        assert _respond(client, input=back, max_output_tokens=2).usage.output_tokens == 2
        # cut just after </think>: the reasoning closed, its item is complete (the response is
        # not); one token earlier it was cut while thinking (both items' states, streamed too)
        engine = DFlashEngine.from_pretrained(*thinking_pair)
        ids = engine.generate(messages, max_new_tokens=40, ignore_eos=True).token_ids
        n = ids.index(engine.tokenizer.convert_tokens_to_ids("</think>")) + 1
        for limit, state in ((n, "completed"), (n - 1, "incomplete")):
            r = _respond(client, input=messages, max_output_tokens=limit, extra_body={"ignore_eos": True})
            assert r.status == "incomplete" and [(i.type, i.status) for i in r.output] == [("reasoning", state)]
            assert r.output[0].content[0].text == msg.reasoning_content
            final = _events(client, input=messages, max_output_tokens=limit, extra_body={"ignore_eos": True})[-1]
            assert final.type == "response.incomplete" and final.response.output[0].status == state
        # a stop string that ends the reply before its reasoning wrote anything: an empty reasoning item (chat's
        # reasoning_content "", content null), not an empty message, streamed alike
        stopped = dict(input=messages, max_output_tokens=40, extra_body={"ignore_eos": True,
                                                                         "stop": [msg.reasoning_content[:3]]})
        r = _respond(client, **stopped)
        assert r.status == "completed" and [(i.type, i.status, i.content[0].text) for i in r.output] == [
            ("reasoning", "completed", "")] and r.output_text == ""
        final = _events(client, **stopped)[-1]
        assert final.type == "response.completed" and _shape(final.response) == _shape(r)


def test_input_items_become_chat_messages():
    req = ResponsesRequest.model_validate({"instructions": "sys", "input": [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2", "output": "2"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "then"}]},
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c3", "output": "3"},
        {"role": "developer", "content": "dev"},
        # reasoning between parallel calls: one assistant turn, answered after both (trial-299 b: refused)
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r1"}]},
        {"type": "function_call", "call_id": "c4", "name": "f", "arguments": "{}"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r2"}]},
        {"type": "function_call", "call_id": "c5", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c4", "output": "4"},
        {"type": "function_call_output", "call_id": "c5", "output": "5"}]})
    def call(i, n, a):
        return {"id": i, "type": "function", "function": {"name": n, "arguments": a}}

    assert req.input_messages() == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "hmm",
         "tool_calls": [call("c1", "f", "{}"), call("c2", "g", '{"x": 1}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}, {"role": "tool", "tool_call_id": "c2", "content": "2"},
        {"role": "assistant", "content": "", "tool_calls": [call("c3", "f", "{}")], "reasoning_content": "then"},
        {"role": "tool", "tool_call_id": "c3", "content": "3"}, {"role": "system", "content": "dev"},
        {"role": "assistant", "content": "", "tool_calls": [call("c4", "f", "{}"), call("c5", "g", "{}")],
         "reasoning_content": "r1\nr2"},
        {"role": "tool", "tool_call_id": "c4", "content": "4"}, {"role": "tool", "tool_call_id": "c5", "content": "5"}]
    chat = req.chat_request()
    assert chat.engine_messages() == req.input_messages() and chat.messages[2].tool_calls[1].id == "c2"
    # chat's parameter names in errors, as the Responses API's
    chat_names = ("response_format", "response_format.json_schema.name", "max_completion_tokens", "messages", "prompt",
                  "reasoning_effort", "tool_choice", None)
    assert [responses_param(p) for p in chat_names] == [
        "text.format", "text.format.name", "max_output_tokens", "input", "input", "reasoning.effort", "tool_choice", None]
    assert responses_message("max_tokens (9) and response_format json_schema; not max_tokensx") == \
        "max_output_tokens (9) and text.format json_schema; not max_tokensx"
    # a chat message as the input item it came from (instructions first; merged calls: their own items)
    sources = req._sources
    assert [responses_param(p, sources) for p in (
        "messages.0", "messages.1.content.0.text", "messages.2.tool_calls.1.function.arguments", "messages.2.content",
        "messages.4.tool_call_id", "messages.5.tool_calls.0", "messages.11.content", "tools.1.function.parameters",
        "tool_choice.function.name", "messages.8.tool_calls.1")] == [
        "instructions", "input.0.content.0.text", "input.4.arguments", "input.2.content", "input.6.call_id", "input.8",
        "input", "tools.1.parameters", "tool_choice.name", "input.14"]
    assert responses_message("tool call arguments must be a JSON object: message 2, call 1: got list", sources) == \
        "tool call arguments must be a JSON object: input.4: got list"
    assert responses_message("invalid value for messages.1.content: bad", sources, "messages.1.content") == \
        "invalid value for input.0.content: bad"
    assert responses_message("the chat template refuses these messages: roles", sources) == \
        "the chat template refuses this input: roles"
    assert responses_message("min_tokens (5) must be at most max_new_tokens (2)") == \
        "min_tokens (5) must be at most max_output_tokens (2)"


@pytest.mark.parametrize("effort,chat_effort", [("none", "low"), ("minimal", "low"), ("low", "low"),
                                                ("medium", "medium"), ("high", "high"), ("xhigh", "high")])
def test_reasoning_efforts_map_onto_chats(effort, chat_effort):
    """OpenAI's reasoning.effort values as chat's reasoning_effort (the template variable:
    low, medium, high); "none" also turns thinking off (enable_thinking false) unless the
    request's chat_template_kwargs say otherwise; the response repeats the effort sent."""
    req = ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": effort}})
    chat = req.chat_request()
    off = {"enable_thinking": False} if effort == "none" else {}
    assert chat.reasoning_effort == effort  # (passed on: chat maps it, as for a chat request)
    assert chat.template_kwargs({"enable_thinking": True}) == {"enable_thinking": True, **off,
                                                               "reasoning_effort": chat_effort}
    assert req.echo(chat)["reasoning"]["effort"] == effort
    own = ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": effort},
                                           "chat_template_kwargs": {"enable_thinking": True, "x": 1}}).chat_request()
    assert own.template_kwargs(None) == {"enable_thinking": True, "x": 1, "reasoning_effort": chat_effort}


def test_a_failure_mid_stream_is_an_error_event(servers):
    spec, _ = servers
    events = list(spec.responses.create(model=MODEL, input="x = ", max_output_tokens=10, stream=True,
                                        extra_body={"guided_grammar": DEAD_END}))
    assert events[0].type == "response.created" and events[-1].type == "error", [ev.type for ev in events]
    assert events[-1].param == "guided_grammar" and "structured output failed" in events[-1].message
    EVENT.validate_python(events[-1].to_dict())
