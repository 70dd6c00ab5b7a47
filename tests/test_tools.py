"""Tool calling (OpenAI function calling): the tools, tool messages and earlier calls
reach the chat template as transformers' ``apply_chat_template(tools=...)`` renders them;
the calls a reply writes (hermes, qwen3_coder, minimax_m2, gemma4, harmony formats) come back as
``message.tool_calls`` (dflash_torch/serving/tools.py), whole and streamed; a real server
and a real tiny model that writes a call."""

from __future__ import annotations

import gc
import json
import shutil

import numpy as np
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from dflash_torch import DFlashEngine, DFlashError
from dflash_torch.serving.tools import new_reply_parser, parse_reply, resolve_tool_parser

from conftest import TIME, TOOLS



def _tool(parameters) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}

HERMES = ('Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
CODER = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n"
         "</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n"
         "<parameter=ratio>\nnull\n</parameter>\n</function>\n</tool_call>")
GEMMA4 = ('<|channel>thought\nThe user wants both.<channel|>Checking.<|tool_call>call:get_weather{city:<|"|>Paris, FR'
          '<|"|>,days:2,metric:true,hours:[1,2.5],ratio:null}<tool_call|><|tool_call>call:get_time{}<tool_call|>')
MINIMAX = ('Need both.</think>\nLet me check.\n<minimax:tool_call>\n<invoke name="get_weather">\n'
           '<parameter name="city">Paris, FR</parameter>\n<parameter name="days"> 2 </parameter>\n'
           '<parameter name="metric">true</parameter>\n<parameter name="hours">[1, 2]</parameter>\n'
           '<parameter name="ratio">null</parameter>\n</invoke>\n<invoke name="get_time">\n</invoke>\n'
           '</minimax:tool_call>')
HARMONY = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
           'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}')

# (reasoning parser, tool parser, prompt tail, reply, ended with a stop, reasoning, content, [(name, arguments)])
CASES = [
    ("none", "hermes", "", HERMES, True, "", "Let me check.",
     [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]),
    ("none", "hermes", "", "no call here, 1 < 2", True, "", "no call here, 1 < 2", []),
    ("none", "hermes", "", "a <tool_call> mentioned", True, "", "a <tool_call> mentioned", []),
    ("none", "hermes", "", "bad:\n<tool_call>\n{not json}\n</tool_call>\nafter", True, "",
     "bad:\n<tool_call>\n{not json}\n</tool_call>\nafter", []),
    ("none", "hermes", "", 'cut:\n<tool_call>\n{"name": "get_time", "argu', False, "",
     'cut:\n<tool_call>\n{"name": "get_time", "argu', []),
    ("none", "hermes", "", '<tool_call>\n{"name": "get_time", "arguments": "{\\"a\\": 1}"}\n</tool_call>\n\nDone.',
     True, "", "Done.", [("get_time", {"a": 1})]),
    ("none", "hermes", "", '<tool_call>{"name": "get_time", "parameters": {"a": 1}}</tool_call>', True, "", "",
     [("get_time", {"a": 1})]),  # ("parameters" where "arguments" is absent, as README says)
    ("think", "hermes", "<|im_start|>assistant\n<think>\n", "plan</think>\n\n" + HERMES[len("Let me check.\n\n"):],
     True, "plan", "", [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]),
    ("think", "hermes", "", '<think><tool_call>{"name": "get_time", "arguments": {}}</tool_call></think>ok', True,
     '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "ok", []),  # (a call in the reasoning: text)
    ("none", "qwen3_coder", "", "Sure." + "\n" + CODER, True, "", "Sure.",
     [("get_weather", {"city": "New York", "days": 3, "metric": True, "hours": [1, 2], "ratio": None})]),
    ("none", "qwen3_coder", "", "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n"
     "<parameter=note>\n a\n\nb \n</parameter>\n</function>\n</tool_call>", True, "", "",
     [("get_weather", {"days": "three", "note": " a\n\nb "})]),  # (not an integer: the text)
    ("none", "qwen3_coder", "", "<tool_call>\n<function=get_time>\n</function>\n</tool_call>", True, "", "",
     [("get_time", {})]),
    ("none", "qwen3_coder", "", "<tool_call>\nno function\n</tool_call>", True, "",
     "<tool_call>\nno function\n</tool_call>", []),
    ("none", "qwen3_coder", "", CODER[:60], False, "", CODER[:60], []),
    # the close markers inside an argument's text (a file the model writes): still one call
    ("none", "hermes", "", 'A.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "a </tool_call> b"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', True, "", "A.",
     [("get_weather", {"city": "a </tool_call> b"}), ("get_time", {})]),
    ("none", "hermes", "", "<tool_call>\n{bad}\n</tool_call> x </tool_call>\n<tool_call>\n"
     '{"name": "get_time", "arguments": {}}\n</tool_call>', True, "", "<tool_call>\n{bad}\n</tool_call> x </tool_call>",
     [("get_time", {})]),
    ("none", "qwen3_coder", "", "<tool_call>\n<function=get_weather>\n<parameter=city>\nx </parameter> y </tool_call>"
     "\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", True, "", "",
     [("get_weather", {"city": "x </parameter> y </tool_call>", "days": 3})]),
    # Gemma 4: its notation (bare keys, <|"|> strings, bare numbers / booleans / null, lists, objects)
    ("gemma4", "gemma4", "", GEMMA4, True, "The user wants both.", "Checking.",
     [("get_weather", {"city": "Paris, FR", "days": 2, "metric": True, "hours": [1, 2.5], "ratio": None}),
      ("get_time", {})]),
    ("none", "gemma4", "", '<|tool_call>call:f{q:<|"|>a } b, c:d<|"|>,o:{k:[<|"|>]<|"|>,{x:-1e3}]}}<tool_call|>ok',
     True, "", "ok", [("f", {"q": "a } b, c:d", "o": {"k": ["]", {"x": -1000.0}]}})]),
    ("none", "gemma4", "", '<|tool_call>call:f{q:<|"|>unclosed}<tool_call|>after', True, "",
     '<|tool_call>call:f{q:<|"|>unclosed}<tool_call|>after', []),  # (malformed: stays content)
    ("none", "gemma4", "", "<|tool_call>call:f{key}<tool_call|>", True, "", "<|tool_call>call:f{key}<tool_call|>", []),
    ("none", "gemma4", "", "<|tool_call>call:get_time{", False, "", "<|tool_call>call:get_time{", []),  # (cut)
    ("none", "gemma4", "", "a <tool_call> of another format", True, "", "a <tool_call> of another format", []),
    # calls sit inside the text: its spaces stay (helper-2: "thenend")
    ("none", "gemma4", "", "Look then <|tool_call>call:get_time{}<tool_call|> end", True, "", "Look then  end",
     [("get_time", {})]),
    # bare values that strict JSON does not have stay strings (NaN, a float out of range: the arguments stay JSON)
    ("none", "gemma4", "", "<|tool_call>call:f{x:NaN,y:1e999,z:-Infinity,w:2.5e3}<tool_call|>", True, "", "",
     [("f", {"x": "NaN", "y": "1e999", "z": "-Infinity", "w": 2500.0})]),
    # nested deeper than 100: a malformed call, kept as text (helper-2: a RecursionError, a 500)
    ("none", "gemma4", "", "<|tool_call>call:f{a:" + "[" * 1500 + "]" * 1500 + "}<tool_call|>", True, "",
     "<|tool_call>call:f{a:" + "[" * 1500 + "]" * 1500 + "}<tool_call|>", []),
    ("none", "gemma4", "", "<|tool_call>call:f{a:" + "[" * 99 + "]" * 99 + "}<tool_call|>", True, "", "",
     [("f", {"a": json.loads("[" * 99 + "]" * 99)})]),
    ("none", "hermes", "", '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}</tool_call>",
     True, "", '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}</tool_call>", []),
    ("none", "hermes", "", '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>', True, "",
     '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>', []),  # (not JSON: not a call)
    # MiniMax-M2: the template opens <think> in the prompt; several calls in one block
    ("think", "minimax_m2", "]~b]ai\n<think>\n", MINIMAX, True, "Need both.", "\nLet me check.",
     [("get_weather", {"city": "Paris, FR", "days": 2, "metric": True, "hours": [1, 2], "ratio": None}),
      ("get_time", {})]),
    ("none", "minimax_m2", "", "<minimax:tool_call><invoke name='get_weather'><parameter name=city>\n a </parameter> b"
     "\n</parameter><parameter name=\"days\">three</parameter></invoke></minimax:tool_call>Done.", True, "", "Done.",
     [("get_weather", {"city": "a </parameter> b", "days": "three"})]),  # (a bare / quoted name; not an integer: text)
    # as MiniMax's guide reads a block: text between the calls, or inside one, is ignored (a value then ends at
    # its first </parameter>); "null" is null for any type; booleans, integers, numbers as the guide types them
    ("none", "minimax_m2", "", '<minimax:tool_call>\nlet me\n<invoke name="get_time"></invoke>\nstray text\n'
     '<invoke name="get_weather">\nnote\n<parameter name="city">null</parameter> and <parameter name="metric">YES'
     '</parameter>\n<parameter name="days">+5</parameter><parameter name="ratio">1e3</parameter></invoke>'
     "</minimax:tool_call>", True, "", "",
     [("get_time", {}), ("get_weather", {"city": None, "metric": True, "days": 5, "ratio": 1000})]),
    ("none", "minimax_m2", "", "<minimax:tool_call><invoke name=get weather><parameter name=a b>x</parameter>"
     '</invoke></minimax:tool_call>', True, "", "", [("get weather", {"a b": "x"})]),  # (bare names, spaces and all)
    ("none", "minimax_m2", "", '<minimax:tool_call><invoke name="get_weather"><parameter name="metric">maybe'
     '</parameter><parameter name="days">2.5</parameter><parameter name="hours">{"a": 1}</parameter></invoke>'
     "</minimax:tool_call>", True, "", "",
     [("get_weather", {"metric": "maybe", "days": "2.5", "hours": '{"a": 1}'})]),  # (not of the schema's type: text)
    ("none", "minimax_m2", "", "<minimax:tool_call>\n</minimax:tool_call>", True, "",
     "<minimax:tool_call>\n</minimax:tool_call>", []),
    ("none", "minimax_m2", "", MINIMAX[40:120], False, "", MINIMAX[40:120], []),  # (cut)
    ("none", "minimax_m2", "", "a <tool_call> of another format", True, "", "a <tool_call> of another format", []),
    # text before and after calls stays apart (helper-9: "Sure.After.")
    ("none", "hermes", "", 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nAfter.', True, "",
     "Sure.\nAfter.", [("get_time", {})]),
    ("none", "minimax_m2", "", 'A<minimax:tool_call><invoke name="get_time"></invoke></minimax:tool_call>\n\n'
     '<minimax:tool_call><invoke name="get_time"></invoke></minimax:tool_call> B', True, "", "A\n\nB",
     [("get_time", {}), ("get_time", {})]),
    ("none", "qwen3_coder", "", "x  " + CODER + "\n<tool_call>\ncut", False, "", "x  <tool_call>\ncut",
     [("get_weather", {"city": "New York", "days": 3, "metric": True, "hours": [1, 2], "ratio": None})]),
    ("harmony", "harmony", "", HARMONY, True, "Need the weather.", "", [("get_weather", {"city": "Oslo"})]),
    ("harmony", "harmony", "", HARMONY, False, "Need the weather.", '{"city": "Oslo"}', []),  # cut: no call
    ("harmony", "harmony", "", "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>",
     True, "", "", [("get_time", {})]),
    ("harmony", "harmony", "", "<|channel|>commentary to=functions.get_time<|message|>oops<|call|>", True, "", "oops",
     []),
    ("harmony", "harmony", "", "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>"
     'commentary to=functions.get_time <|constrain|>json<|message|>{"tz": "UTC"}<|call|>', True, "", "Checking.",
     [("get_time", {"tz": "UTC"})]),
    ("harmony", "harmony", "", "<|channel|>final<|message|>No tools needed.", True, "", "No tools needed.", []),
    # an empty or blank name names no function: a malformed call, kept as text (trial-292: a call named "")
    ("none", "hermes", "", '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>', True, "",
     '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>', []),
    ("none", "hermes", "", '<tool_call>{"name": " ", "arguments": {}}</tool_call>\n<tool_call>{"name": "get_time", '
     '"arguments": {}}</tool_call>', True, "", '<tool_call>{"name": " ", "arguments": {}}</tool_call>',
     [("get_time", {})]),
    ("none", "qwen3_coder", "", "<tool_call>\n<function= >\n</function>\n</tool_call>", True, "",
     "<tool_call>\n<function= >\n</function>\n</tool_call>", []),
    ("harmony", "harmony", "", "<|channel|>commentary to=functions. <|constrain|>json<|message|>{}<|call|>", True, "",
     "{}", []),
]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("reasoning,tools,prompt,reply,complete,want_reasoning,content,calls", CASES)
def test_whole_replies(reasoning, tools, prompt, reply, complete, want_reasoning, content, calls):
    got_reasoning, got_content, got_calls = parse_reply(new_reply_parser(reasoning, tools, prompt, TOOLS), reply,
                                                        complete)
    assert (got_reasoning, got_content, _calls(got_calls)) == (want_reasoning, content, calls)
    assert all(c.id.startswith("call_") for c in got_calls) and len({c.id for c in got_calls}) == len(got_calls)


@settings(max_examples=80, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=16))
def test_streamed_pieces_give_the_same_calls_and_content(case, cuts):
    reasoning, tools, prompt, reply, complete, want_reasoning, content, calls = case
    bounds = sorted({c % (len(reply) + 1) for c in cuts} | {0, len(reply)})
    parser = new_reply_parser(reasoning, tools, prompt, TOOLS)
    got = [parser.feed(reply[a:b]) for a, b in zip(bounds, bounds[1:])] + [parser.finish(complete)]
    assert "".join(g[0] for g in got) == want_reasoning
    assert "".join(g[1] for g in got) == content
    assert _calls([c for g in got for c in g[2]]) == calls


def test_numbers_beyond_a_float_are_kept_as_written():
    """A call's JSON may hold a number no float holds (``1E400``: valid JSON, which the grammar
    of a forced call allows): the call is parsed (hermes; qwen3_coder for a parameter of type
    number) and its arguments keep the number's text (``json.dumps`` would write Infinity,
    which no JSON parser reads); a string that looks like the placeholder stays a string."""
    args = '{"city": "\\u0000", "ratio": 70387E78376883, "hours": [1e999, -2E+500, 1.5, "x"]}'
    reply = f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
    _, content, calls = parse_reply(new_reply_parser("none", "hermes", "", TOOLS), reply, True)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", args)]
    assert json.loads(calls[0].arguments, parse_float=str)["ratio"] == "70387E78376883"
    reply = "<tool_call>\n<function=get_weather>\n<parameter=ratio>\n-1e999\n</parameter>\n</function>\n</tool_call>"
    _, _, calls = parse_reply(new_reply_parser("none", "qwen3_coder", "", TOOLS), reply, True)
    assert [c.arguments for c in calls] == ['{"ratio": -1e999}']


def test_text_that_may_begin_a_marker_is_held_back_only_while_it_may_complete():
    p = new_reply_parser("none", "hermes")
    assert p.feed("Hi <tool") == ("", "Hi", [])  # (the space: next to a call, it would be dropped)
    assert p.feed("box") == ("", " <toolbox", [])
    _, content, calls = p.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert (content, _calls(calls)) == ("", [("f", {})])


def test_auto_picks_the_format_by_model_and_template():
    assert resolve_tool_parser("auto", "gpt_oss", None, "harmony") == "harmony"
    assert resolve_tool_parser("auto", "qwen3", "<tool_call>\n<function=x>", "think") == "qwen3_coder"
    assert resolve_tool_parser("auto", "qwen3", "<tool_call>\n{{ tool_call | tojson }}", "think") == "hermes"
    assert resolve_tool_parser("auto", "llama", "{{ m.content }}", "none") == "none"
    assert resolve_tool_parser("auto", "qwen3", {"default": "x", "tool_use": "<tool_call>"}, "none") == "hermes"
    assert resolve_tool_parser("hermes", "gpt_oss", None, "harmony") == "hermes"
    gemma = "{%- for tc in m.tool_calls %}<|tool_call>call:{{ tc.function.name }}{...}<tool_call|>{% endfor %}"
    assert resolve_tool_parser("auto", "gemma4_text", gemma, "gemma4") == "gemma4"
    minimax = '{{- "<minimax:tool_call>\n" }}{%- for tc in m.tool_calls %}<invoke name="{{ tc.function.name }}">'
    assert resolve_tool_parser("auto", "minimax_m2", minimax, "think") == "minimax_m2"
    with pytest.raises(DFlashError, match="--tool-call-parser harmony needs --reasoning-parser harmony"):
        resolve_tool_parser("harmony", "qwen3", None, "none")


# --- the prompt: transformers' apply_chat_template is the oracle --------------------------------

# small templates that follow each family's format (Qwen3: hermes; Qwen3-Coder / Qwen3.5: XML
# parameters, which iterate the arguments as a mapping; gpt-oss: harmony, arguments | tojson)
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
    "{% endif %}{% for tc in m.tool_calls or [] %}{% set tc = tc.function %}\n<tool_call>\n"
    '{"name": "{{ tc.name }}", "arguments": {% if tc.arguments is string %}{{ tc.arguments }}{% else %}'
    "{{ tc.arguments | tojson }}{% endif %}}\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CODER_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for tool in tools %}\n<function>\n<name>{{ tool.function.name }}"
    "</name>{% for k, v in tool.function.parameters.properties | items %}\n<parameter><name>{{ k }}</name><type>"
    "{{ v.type }}</type></parameter>{% endfor %}\n</function>{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for tc in m.tool_calls or [] %}{% set tc = tc.function %}\n<tool_call>\n<function={{ tc.name }}>\n"
    "{% for k, v in tc.arguments | items %}<parameter={{ k }}>\n{{ v if v is string else v | tojson }}\n"
    "</parameter>\n{% endfor %}</function>\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: medium<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools\n\nnamespace functions {\n{% for tool in tools %}"
    "// {{ tool.function.description }}\ntype {{ tool.function.name }} = (_: "
    "{{ tool.function.parameters | tojson }}) => any;\n{% endfor %}}<|end|>{% endif %}"
    "{%- for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}{% for tc in m.tool_calls %}"
    "<|start|>assistant to=functions.{{ tc.function.name }}<|channel|>commentary json<|message|>"
    "{{ tc.function.arguments | tojson }}<|call|>{% endfor %}{% elif m.role == 'tool' %}<|start|>functions.tool "
    "to=assistant<|channel|>commentary<|message|>{{ m.content | tojson }}<|end|>{% else %}<|start|>{{ m.role }}"
    "<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}")

CONVERSATION = [  # OpenAI's shapes: the arguments are JSON text
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Weather in Paris, and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
    {"role": "user", "content": "And tomorrow?"},
]


ANSWERED = CONVERSATION[:-1] + [{"role": "assistant", "content": "Sunny, 14:05."}]  # (each call answered)


def _with_dict_arguments(messages: list[dict]) -> list[dict]:
    """The conversation as templates need it: each call's arguments a dict."""
    return [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                                 for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]


def _oracle(tokenizer, messages, **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("template", [HERMES_TEMPLATE, CODER_TEMPLATE, HARMONY_TEMPLATE], ids=["hermes", "coder", "harmony"])
def test_prompt_with_tools_and_tool_messages_is_transformers(local_engine, monkeypatch, template):
    monkeypatch.setattr(local_engine.tokenizer, "chat_template", template)
    tok = local_engine.tokenizer
    want = _oracle(tok, _with_dict_arguments(CONVERSATION), tools=TOOLS)
    assert local_engine.encode_prompt(CONVERSATION, tools=TOOLS) == want
    assert local_engine.encode_prompt(_with_dict_arguments(CONVERSATION), tools=TOOLS) == want  # (dicts: as they are)
    assert local_engine.encode_prompt(CONVERSATION) == _oracle(tok, _with_dict_arguments(CONVERSATION)) != want
    assert local_engine.encode_prompt("hi", chat=True, tools=TOOLS) == _oracle(tok, [{"role": "user", "content": "hi"}],
                                                                                tools=TOOLS)
    assert CONVERSATION[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "days": 2}'  # (not changed)
    if template == HARMONY_TEMPLATE:  # the JSON text itself would be rendered as a JSON string
        assert want != _oracle(tok, CONVERSATION, tools=TOOLS)


def test_an_earlier_replys_reasoning_reaches_the_template(local_engine, monkeypatch):
    """An assistant message's reasoning_content (or vLLM's newer reasoning) reaches the chat
    template as reasoning_content, as transformers renders it (helper-2: chat dropped it,
    while Gemma 4's template writes it back before the calls)."""
    from dflash_torch.serving.protocol import ChatCompletionRequest

    template = ("{% for m in messages %}# {{ m.role }}: {% if m.reasoning_content %}[{{ m.reasoning_content }}]"
                "{% endif %}{{ m.content or '' }}\n{% endfor %}")
    monkeypatch.setattr(local_engine.tokenizer, "chat_template", template)
    for field in ("reasoning_content", "reasoning"):
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes", field: "Think."},
                    {"role": "user", "content": "more"}]
        sent = ChatCompletionRequest(messages=messages).engine_messages()
        assert sent[1] == {"role": "assistant", "content": "yes", "reasoning_content": "Think."}
        want = [dict(m) for m in messages]
        want[1] = {"role": "assistant", "content": "yes", "reasoning_content": "Think."}
        assert local_engine.encode_prompt(sent) == _oracle(local_engine.tokenizer, want)
        assert "[Think.]" in local_engine.decode(local_engine.encode_prompt(sent))


def test_a_tool_message_answers_a_call_by_its_id_or_is_taken_without_one(local_engine):
    """The Python API takes a tool message answering an earlier call by its id, one without a
    ``tool_call_id`` (as Hugging Face's examples write them) and, after a call without an
    ``id``, any id (the server's checks); an id no earlier call has is refused (the parametrized
    refusals above), as are calls left unanswered, but those without an id, those of a last
    assistant message that ``continue_final_message`` continues, and those of training data
    (``check_tool_call_ids`` false); an id a later turn's call has again is that call's."""
    from dflash_torch.chat_template import chat_messages

    def call(**id_):
        return {"role": "assistant", "content": None,
                "tool_calls": [{**id_, "type": "function", "function": {"name": "f", "arguments": "{}"}}]}

    user = {"role": "user", "content": "q"}
    for history in ([user, call(id="c"), {"role": "tool", "tool_call_id": "c", "content": "r"}],
                    [user, call(id="c"), {"role": "tool", "name": "f", "content": "r"}],
                    [user, call(), {"role": "tool", "tool_call_id": "anything", "content": "r"}],
                    [user, call(id=1), {"role": "tool", "tool_call_id": 1, "content": "r"}]):  # (trial-256: refused)
        assert [m["role"] for m in chat_messages(history)] == ["user", "assistant", "tool"]
    assert len(CONVERSATION) == len(chat_messages(CONVERSATION))
    answer = {"role": "tool", "tool_call_id": "call_0", "content": "r"}
    reused = [user, call(id="call_0"), answer, user, call(id="call_0"), answer, user]  # (clients that number each turn's)
    assert len(chat_messages(reused)) == 7
    assert len(chat_messages([user, call(), user, call(), {"role": "tool", "content": "r"}])) == 5  # (no ids: unchecked)
    unanswered = [user, call(id="c"), user]
    with pytest.raises(DFlashError, match=r"^chat message 1: .* not answered before chat message 2: 'c'$"):
        chat_messages(unanswered)
    assert len(chat_messages(unanswered, check_tool_call_ids=False)) == 3  # (training data)
    # a last assistant message of calls: refused, unless the prompt ends inside it (continued: the reply goes on there)
    started = [user, {**call(id="c"), "content": "Let me"}]
    with pytest.raises(DFlashError, match=r"not answered before the messages end .*continue_final_message=True"):
        local_engine.encode_prompt(started, add_generation_prompt=False)
    ids = local_engine.encode_prompt(started, add_generation_prompt=False, continue_final_message=True)
    assert local_engine.decode(ids).endswith("Let me")
    with pytest.raises(DFlashError, match=r"^chat message 1: .* not answered before chat message 2: 'c'$"):
        local_engine.encode_prompt(unanswered + [{"role": "assistant", "content": "x"}], add_generation_prompt=False,
                                   continue_final_message=True)  # (only the last message is continued)


def test_an_assistant_message_of_calls_alone_is_the_servers_prompt():
    """An assistant message with ``tool_calls`` and ``content`` None (or none) is the prompt
    of ``content`` ``""``, as the server takes it (trial-101: on the shipped default pair,
    whose template adds the content to a string, encode_prompt and generate refused it)."""
    from dflash_torch import DFlashEngine
    from dflash_torch.serving.protocol import ChatCompletionRequest

    engine = DFlashEngine.from_pretrained()
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}

    def history(**content):
        return [{"role": "user", "content": "q"}, {"role": "assistant", **content, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c", "content": "r"}]

    want = engine.encode_prompt(history(content=""))
    assert engine.encode_prompt(history(content=None)) == engine.encode_prompt(history()) == want
    assert engine.encode_prompt(ChatCompletionRequest(messages=history(content=None)).engine_messages()) == want
    assert history(content=None)[1]["content"] is None
    out = engine.generate(history(content=None), max_new_tokens=2, temperature=0)
    assert out.token_ids == engine.generate(history(content=""), max_new_tokens=2, temperature=0).token_ids


def test_content_parts_are_joined_as_the_server_joins_them(local_engine):
    """A message's content given as OpenAI's list of parts (text parts; refusal parts in an
    assistant message) is their texts joined by newlines, the prompt the server's chat
    completions give the same messages."""
    from dflash_torch.serving.protocol import ChatCompletionRequest

    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "c"}, {"type": "refusal", "refusal": "no"}]},
                {"role": "user", "content": "d"}]
    joined = [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "c\nno"},
              {"role": "user", "content": "d"}]
    ids = local_engine.encode_prompt(messages)
    assert ids == local_engine.encode_prompt(joined) == _oracle(local_engine.tokenizer, joined)
    assert ids == local_engine.encode_prompt(ChatCompletionRequest(messages=messages).engine_messages())
    assert messages[0]["content"][0] == {"type": "text", "text": "a"}  # (the caller's messages are not changed)


def test_an_assistants_refusal_is_its_text_as_the_server_reads_it(local_engine):
    """An assistant message with ``content: None`` and a ``refusal`` (OpenAI's reply) is taken,
    as the server's chat completions take it, its refusal the message's text after its content
    (it was refused: "content may be None with tool_calls", trial-208); the prompt is the
    server's for the same messages."""
    from dflash_torch.serving.protocol import ChatCompletionRequest

    for refused, text in (({"content": None, "refusal": "I cannot"}, "I cannot"),
                          ({"content": "c", "refusal": "no"}, "c\nno"), ({"refusal": ""}, "")):
        user, go = {"role": "user", "content": "hi"}, {"role": "user", "content": "go"}
        messages, plain = [user, {"role": "assistant", **refused}, go], [user, {"role": "assistant", "content": text}, go]
        ids = local_engine.encode_prompt(messages)
        assert ids == local_engine.encode_prompt(plain) == _oracle(local_engine.tokenizer, plain)
        assert ids == local_engine.encode_prompt(ChatCompletionRequest(messages=messages).engine_messages())
    out = local_engine.generate(messages, chat=True, max_new_tokens=2, temperature=0)
    assert out.token_ids == local_engine.generate(plain, chat=True, max_new_tokens=2, temperature=0).token_ids


def test_empty_media_fields_and_an_assistants_audio_reply_are_taken(local_engine):
    """Media keys with nothing in them (``images: []``, ``image_url: null``) and an assistant's
    ``audio`` (OpenAI's reply object, sent back beside its text) hold no media: taken, and the
    prompt is that of the same messages without them (in the server's request model too);
    a message that does hold media is refused (test_bad_tools_and_calls_are_one_line_errors)."""
    from dflash_torch.serving.protocol import ChatCompletionRequest

    messages = [{"role": "user", "content": "a", "images": []},
                {"role": "assistant", "content": "b", "audio": {"id": "audio_1"}},
                {"role": "user", "content": [{"type": "text", "text": "c", "image_url": None}], "video": ""}]
    plain = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    ids = local_engine.encode_prompt(messages)
    assert ids == local_engine.encode_prompt(plain) == _oracle(local_engine.tokenizer, plain)
    assert ids == local_engine.encode_prompt(ChatCompletionRequest(messages=messages).engine_messages())
    # (an empty tuple is nothing too, as an empty list: trial-208 refused it as holding images)
    assert local_engine.encode_prompt([{**messages[0], "images": ()}] + messages[1:]) == ids


def test_the_same_tool_twice_is_taken_null_fields_and_all(local_engine):
    """The same definition twice is one function, also where one copy spells out null defaults
    (trial-217: a client's ``"strict": null`` made it 'two different functions')."""
    tool = _tool({"type": "object"})
    filled = {**tool, "function": {**tool["function"], "strict": None, "description": None}}
    assert local_engine.encode_prompt(CONVERSATION, tools=[tool, filled]) == \
        local_engine.encode_prompt(CONVERSATION, tools=[tool, tool])
    with pytest.raises(DFlashError, match="two different functions named 'f'"):
        local_engine.encode_prompt(CONVERSATION, tools=[tool, {**filled, "function": {**filled["function"],
                                                                                   "strict": True}}])


@pytest.mark.parametrize("prompt,kwargs,message", [
    (CONVERSATION, {"tools": {"name": "f"}}, r"^tools must be a list of objects"),
    (CONVERSATION, {"tools": ["f"]}, r"^tools must be a list of objects"),
    ("hi", {"tools": TOOLS}, r"^tools apply to chat prompts only"),
    ([5, 6], {"tools": TOOLS, "chat": True}, r"^tools apply to chat prompts only"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}], {},
     r"^tool call arguments must be a JSON object: message 0, call 0: not valid JSON"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "3"}}]}], {},
     r"^tool call arguments must be a JSON object: message 0, call 0: got a number$"),
    # (JSON's names of the types, not Python's: trial-101 said NoneType, list, int, str, bool)
    *[([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": text}}]}], {},
       rf"^tool call arguments must be a JSON object: message 0, call 0: got {words}$")
      for text, words in (("null", "null"), ("[]", "an array"), ('"s"', "a string"), ("true", "a boolean"))],
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": [1]}}]}], {},
     r"^tool call arguments must be a JSON object: message 0, call 0: got an array$"),
    # (strict JSON, as the reply parsers read it: trial-134 rendered NaN)
    *[([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": text}}]}], {},
       rf"^tool call arguments must be a JSON object: message 0, call 0: not valid JSON \({name} is not JSON\)$")
      for text, name in (('{"a": NaN}', "NaN"), ('{"a": [-Infinity]}', "-Infinity"), ('{"a": Infinity}', "Infinity"))],
    *[([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": [number]}}}]}], {},
       r"^tool call arguments must be a JSON object: message 0, call 0: holds NaN or infinity, which JSON has not$")
      for number in (float("nan"), float("inf"), float("-inf"))],
    ([{"role": "assistant", "tool_calls": [{"name": "f"}]}], {}, r"^chat messages need tool_calls as a list"),
    ([{"role": "assistant", "content": None}], {}, r"^chat message 0 has a null content: each message is"),
    ([{"role": "user", "content": "hi"}, {"content": "hi"}], {}, r"^chat message 1 has no role: each message is"),
    # (a refusal: an assistant's text, as the server takes it; a 400 there otherwise)
    ([{"role": "user", "content": "hi", "refusal": "no"}], {},
     r"^chat message 0 has a refusal, which only an assistant message may hold$"),
    ([{"role": "assistant", "content": None, "refusal": 5}], {}, r"^chat message 0: refusal must be a string, got int$"),
    # (tool calls on another message, a tool_call_id on one not a tool message: as the server refuses them, trial-242)
    ([{"role": "user", "content": "hi", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}],
     {}, r"^chat message 0 has tool_calls, which only an assistant message may hold$"),
    ([{"role": "system", "content": "hi", "tool_call_id": "c"}], {},
     r"^chat message 0 has a tool_call_id, which only a tool message may hold$"),
    # (a tool message answers an earlier call by its id, as the server checks it: it was taken unchecked)
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "call_2", "content": "r"}], {},
     r"^chat message 2: tool_call_id 'call_2' is not the id of a tool call of an earlier assistant message"),
    ([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_1", "content": "r"}], {},
     r"^chat message 1: tool_call_id 'call_1' is not the id of a tool call of an earlier assistant message"),
    # (each call with an id answered right after its message, once, as OpenAI and the server check: trial-292 took
    # the model seeing a call without its result)
    (ANSWERED[:3] + ANSWERED[4:], {},
     r"^chat message 2: an assistant message's tool calls must each be answered by a tool message \(its tool_call_id "
     r"the call's id\) right after it, before a message of another role; not answered before chat message 4: "
     r"'call_1'$"),
    (ANSWERED[:3] + ANSWERED[5:], {}, r"^chat message 2: .* not answered before chat message 3: 'call_1', 'call_2'$"),
    (ANSWERED[:4] + ANSWERED[3:], {},  # (call_1 twice: call_2 unanswered is not reached)
     r"^chat message 4: tool_call_id 'call_1' answers a tool call that chat message 3 already answered \(each call "
     r"is answered once\)$"),
    # (a tool message without an id took the call by position: said so, not "already answered", trial-299 f)
    (ANSWERED[:3] + [{"role": "tool", "content": "r"}] + ANSWERED[3:], {},
     r"^chat message 4: tool_call_id 'call_1' answers a tool call that chat message 3, a tool message without a "
     r"tool_call_id, was taken to answer \(it answers the first call not yet answered; each call is answered once\)$"),
    ([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "content": "r"}, {"role": "tool", "tool_call_id": "a", "content": "r"}], {},
     r"^chat message 2: tool_call_id 'a' answers a tool call that chat message 1, a tool message without a "
     r"tool_call_id, was taken to answer"),
    (ANSWERED + [{"role": "assistant", "content": "ok"}, {"role": "tool", "tool_call_id": "call_2", "content": "r"}],
     {}, r"^chat message 7: tool_call_id 'call_2' answers a tool call that chat message 4 already answered"),
    (ANSWERED[:3], {}, r"^chat message 2: .* not answered before the messages end \(to continue that assistant "
                       r"message instead, pass continue_final_message=True with add_generation_prompt=False\): "
                       r"'call_1', 'call_2'$"),
    (ANSWERED[:3], {"add_generation_prompt": False}, r"^chat message 2: .* not answered before the messages end"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {},
     r"^chat message 0: content part 0 must be \{'type': 'text', 'text': str\}"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "refusal", "refusal": "no"}]}], {},
     r"^chat message 0: content part 1 must be"),
    ([{"role": "user", "content": [{"type": "text"}]}], {}, r"^chat message 0: content part 0 must be"),
    # (media beside the text were dropped unsaid; an assistant's audio, OpenAI's reply sent back, is not one)
    ([{"role": "user", "content": "hi", "images": ["aGk="]}], {}, r"^chat message 0 holds 'images': only text is supported"),
    # (values told by type: an array was a bare ValueError "truth value of an array is ambiguous", trial-208)
    ([{"role": "user", "content": "hi", "images": np.zeros((2, 2))}], {},
     r"^chat message 0 holds 'images': only text is supported"),
    ([{"role": "assistant", "content": None, "tool_calls": np.zeros(2), "audio": np.zeros(2)}], {},
     r"^chat messages need tool_calls as a list"),
    ([{"role": "assistant", "content": None, "audio": {"id": "audio_1"}}], {},
     r"^chat message 0 holds 'audio': only text is supported"),  # (an audio reply alone: nothing to read)
    ([{"role": "user", "content": [{"type": "text", "text": "a", "image_url": {"url": "x"}}]}], {},
     r"^chat message 0: content part 0 holds 'image_url': only text is supported$"),
    # malformed parameter schemas, named (helper-27: blamed on chat_template_kwargs, or free text in forced calls)
    (CONVERSATION, {"tools": [_tool({"type": "object", "properties": [1]})]},
     r"^tools\[0\]\.function\.parameters\.properties must be an object of parameter schemas, got \[1\]"),
    (CONVERSATION, {"tools": [_tool({"type": "object", "properties": {"a": 5}})]},
     r"^tools\[0\]\.function\.parameters\.properties\.a must be a JSON Schema"),
    (CONVERSATION, {"tools": [_tool({"type": "object", "properties": {"a": {"type": "banana"}}})]},
     r"^tools\[0\]\.function\.parameters\.properties\.a\.type must name JSON types .* got 'banana'"),
    (CONVERSATION, {"tools": [TIME, _tool({"type": "string"})]},
     r"^tools\[1\]\.function\.parameters must be the JSON Schema of an object \(type \"object\"\), got type 'string'"),
    (CONVERSATION, {"tools": [_tool({"type": "object", "required": "a"})]},
     r"^tools\[0\]\.function\.parameters\.required must be a list of parameter names"),
    (CONVERSATION, {"tools": [_tool([1])]}, r"^tools\[0\]\.function\.parameters must be a JSON Schema object"),
    # (trial-138: two functions of one name, the last one's schema used for a forced call of it)
    (CONVERSATION, {"tools": [TIME, _tool({"type": "object"}), _tool({"type": "object"}), _tool({"required": []})]},
     r"^tools\[1\] and tools\[3\] are two different functions named 'f': a call of it could mean either; "
     r"give each its own name$"),
    # malformed tools the server refuses with a 400 (trial-233: passed to the template unsaid in Python)
    (CONVERSATION, {"tools": [{"type": "function", "function": {"name": ""}}]},
     r"^tools\[0\]\.function\.name: a function needs a name its calls can give, got an empty string$"),
    (CONVERSATION, {"tools": [TIME, {"type": "function", "function": {"name": "   "}}]},
     r"^tools\[1\]\.function\.name: a function needs a name its calls can give, got blanks$"),
    (CONVERSATION, {"tools": [{"type": "function"}]}, r"^tools\[0\]\.function is missing; a tool is \{'type'"),
    (CONVERSATION, {"tools": [{"foo": 1}]}, r"^tools\[0\]\.type is missing; a tool is \{'type': 'function', "),
    (CONVERSATION, {"tools": [{"type": "web_search", "function": TIME["function"]}]},
     r"^tools\[0\]\.type must be 'function', got 'web_search'; a tool is"),
    (CONVERSATION, {"tools": [{"type": "function", "function": "f"}]},
     r"^tools\[0\]\.function must be an object \(a dict\), got 'f'; a tool is"),
    (CONVERSATION, {"tools": [{"type": "function", "function": None}]},  # (given null: not "missing", trial-235)
     r"^tools\[0\]\.function must be an object \(a dict\), got None; a tool is"),
    (CONVERSATION, {"tools": [{"type": "function", "function": {"description": "d"}}]},
     r"^tools\[0\]\.function\.name is missing$"),
    (CONVERSATION, {"tools": [{"type": "function", "function": {"name": 5}}]},
     r"^tools\[0\]\.function\.name must be a string, got 5$"),
    (CONVERSATION, {"tools": [{"type": "function", "function": {"name": "f", "description": 5}}]},
     r"^tools\[0\]\.function\.description must be a string, got 5$"),
])
def test_bad_tools_and_calls_are_one_line_errors(local_engine, prompt, kwargs, message):
    with pytest.raises(DFlashError, match=message) as err:
        local_engine.encode_prompt(prompt, **kwargs)
    assert "\n" not in str(err.value)
    if "tools" in kwargs:
        assert err.value.name == "tools"


@pytest.mark.parametrize("parameters", [
    {"type": ["object", "null"], "properties": {"a": {"type": ["string", "null"]}}},  # (helper-28: refused)
    {"type": ["object"]}, {}, {"properties": {"a": {}}}, {"type": "object", "properties": {"a": True}},
    {"type": "object", "additionalProperties": False, "required": ["a"], "properties": {"a": {"type": "string"}}},
    {"$defs": {"P": {"type": "object"}}, "type": "object", "properties": {"p": {"$ref": "#/$defs/P"},
                                                                         "q": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}},
])
def test_valid_parameter_schemas_pass(local_engine, parameters):
    local_engine.encode_prompt(CONVERSATION, tools=[_tool(parameters)])


def test_a_template_that_cannot_render_the_tools_names_them(local_engine, monkeypatch):
    """A TypeError while rendering names what the request added only when the messages
    render without it: the tools here, not chat_template_kwargs (they render); a template
    that fails on the messages names them, whatever else was sent (trial-126: "param":
    "tools", "these messages or chat_template_kwargs or tools", for a DeepSeek template's
    failure on the calls' arguments)."""
    monkeypatch.setattr(local_engine.tokenizer, "chat_template",
                        "{% for t in tools or [] %}{{ t.function.name + 1 }}{% endfor %}{{ messages[0].content }}")
    for kwargs in ({}, {"chat_template_kwargs": {"x": 1}}):
        with pytest.raises(DFlashError, match=r"^the chat template cannot render these tools: ") as err:
            local_engine.encode_prompt("hi", chat=True, tools=[TIME], **kwargs)
        assert err.value.names == ("tools",)
    local_engine.encode_prompt("hi", chat=True, chat_template_kwargs={"x": 1})
    monkeypatch.setattr(local_engine.tokenizer, "chat_template",
                        "{% for t in tools or [] %}{{ t.function.name }}{% endfor %}{{ messages[0].content + 1 }}")
    for kwargs in ({}, {"tools": [TIME]}, {"tools": [TIME], "chat_template_kwargs": {"x": 1}}):
        with pytest.raises(DFlashError, match=r"^the chat template cannot render these messages: ") as err:
            local_engine.encode_prompt("hi", chat=True, **kwargs)
        assert not hasattr(err.value, "name")


def test_a_role_the_chat_template_drops_is_refused(local_engine, monkeypatch):
    """A message of a role OpenAI's API has not is refused where the template renders the
    prompt the same without it (Qwen3's renders only the roles it knows: a ``function``
    result was dropped unsaid, the model answering without it); a template that renders
    any role takes it, and the usual roles are not checked (a system message the template
    leaves out stays the template's choice)."""
    messages = [{"role": "user", "content": "hi"}, {"role": "function", "content": "RESULT"}]
    assert "RESULT" in local_engine.tokenizer.decode(local_engine.encode_prompt(messages))  # (renders any role)
    monkeypatch.setattr(local_engine.tokenizer, "chat_template",
                        "{% for m in messages %}{% if m.role in ('user', 'assistant', 'tool') %}<{{ m.role }}>"
                        "{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    with pytest.raises(DFlashError, match=r"^chat message 1 has role 'function', which this model's chat template "
                                          r"does not render \(the prompt leaves out the message") as err:
        local_engine.generate(messages, max_new_tokens=1)
    assert "system, developer, user, assistant, tool" in str(err.value)
    local_engine.encode_prompt([{"role": "system", "content": "s"}, *messages[:1]])  # (a usual role: the template's)
    # (a content found elsewhere in the prompt: the drop was taken, trial-303)
    for echoed in ([{"role": "user", "content": "tell me the result"}, {"role": "function", "content": "the result"}],
                   [{"role": "user", "content": "q"}, {"role": "function", "content": "<"}]):
        with pytest.raises(DFlashError, match=r"^chat message 1 has role 'function'"):
            local_engine.encode_prompt(echoed)
    with pytest.raises(DFlashError, match=r"^chat message 1 has role 'function'"):  # (no content: the prompt without it)
        local_engine.encode_prompt([messages[0], {"role": "function", "content": ""}])
    # (a template that counts the messages renders another prompt without one: trial-299 took the drop)
    template = local_engine.tokenizer.chat_template
    monkeypatch.setattr(local_engine.tokenizer, "chat_template", "{{ messages | length }} messages\n" + template)
    with pytest.raises(DFlashError, match=r"^chat message 1 has role 'function'"):
        local_engine.encode_prompt(messages)
    # (a template that renders the start of a content, or upper-cases it, renders the message: taken)
    for shown_as in ("{{ m.content[:12] }}", "{{ m.content | upper }}"):
        monkeypatch.setattr(local_engine.tokenizer, "chat_template", "{% for m in messages %}<{{ m.role }}>"
                            + shown_as + "{% endfor %}<assistant>")
        local_engine.encode_prompt([messages[0], {"role": "function", "content": "sunny and 21 degrees in Paris"}])
    # (one render more, not one per such message: 200 ipython results took 7.6 s, trial-299)
    monkeypatch.setattr(local_engine.tokenizer, "chat_template",
                        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    renders = []
    render = type(local_engine.tokenizer).apply_chat_template
    monkeypatch.setattr(type(local_engine.tokenizer), "apply_chat_template",
                        lambda self, *a, **k: renders.append(1) or render(self, *a, **k))
    long = [messages[0]] + [{"role": r, "content": f"r{i}"} for i in range(100) for r in ("assistant", "ipython")]
    local_engine.encode_prompt(long)
    assert len(renders) == 2
    monkeypatch.setattr(local_engine.tokenizer, "chat_template",
                        "{% for m in messages %}{% if m.role == 'user' %}<user>{% endif %}{{ m.content }}"
                        "{% endfor %}<assistant>")
    assert "RESULT" in local_engine.tokenizer.decode(local_engine.encode_prompt(messages))


def test_tools_a_chat_template_leaves_out_are_warned_once_in_python(tiny_pair, caplog):
    """Tools given in Python to a chat template that renders the same prompt without them (one
    written without tools, as the shipped default target's) get one WARNING through the package
    logger, as the server logs it (trial-233: dropped unsaid): once per engine, whichever of
    encode_prompt, generate, stream and generate_batch renders them first; none where the
    template renders them, nor from an engine a server was made for (it logs its own)."""
    from dflash_torch.serving.app import create_app

    messages = [{"role": "user", "content": "x"}]
    ignores, served, renders = (DFlashEngine.from_pretrained(tiny_pair[0], no_draft=True) for _ in range(3))
    renders.tokenizer.chat_template = ("{% for t in tools or [] %}{{ t.function.name }}{% endfor %}"
                                       "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>")
    assert ignores.tokenizer.chat_template != renders.tokenizer.chat_template
    assert not renders.tools_left_out(messages, tools=[TIME]) and not ignores.tools_left_out(messages)
    create_app(served, tool_call_parser="none")
    assert ignores.tools_left_out(messages, tools=[TIME])
    with caplog.at_level("WARNING", logger="dflash_torch"):
        renders.generate(messages, tools=TOOLS, max_new_tokens=2)
        served.generate(messages, tools=TOOLS, max_new_tokens=2)
        for _ in range(2):
            ignores.generate(messages, tools=TOOLS, max_new_tokens=2)
            list(ignores.stream(messages, tools=TOOLS, max_new_tokens=2))
            ignores.generate_batch([messages, messages], tools=TOOLS, max_new_tokens=2)
            ignores.encode_prompt("x", chat=True, tools=[TIME])
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records if "tools" in r.getMessage()] == [
        ("dflash_torch", "WARNING", "the chat template leaves out the tools given (it renders the same prompt with "
         "and without them): the model is not told of them, and calls none (logged once)")]
    # (a template that refuses the prompt without tools does not leave them out: no error from the check)
    renders.tokenizer.chat_template = "{% if not tools %}{{ raise_exception('no tools') }}{% endif %}" + \
        renders.tokenizer.chat_template
    assert renders.encode_prompt(messages, tools=[TIME]) and not renders.tools_left_out(messages, tools=[TIME])


# DeepSeek V3's, V3.1's and R1's way: a call's arguments joined to a string (a template of our own)
JOINING_TEMPLATE = (
    "{%- if tools %}## Tools{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n{% endif %}"
    "{%- for m in messages %}<|{{ m.role }}|>{{ m.content or '' }}{% for tc in m.tool_calls or [] %}"
    "{{ '<|call|>' + tc.function.name + '<|sep|>' + tc.function.arguments + '<|end|>' }}{% endfor %}\n{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}")


def _with_text_arguments(messages: list[dict], **dumps) -> list[dict]:
    """The conversation with each call's dict arguments as JSON text (``json.dumps(**dumps)``)."""
    return [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"],
                                                                                              **dumps)}}
                                 for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]


def test_a_template_that_joins_the_arguments_to_a_string_gets_their_text(local_engine, monkeypatch):
    """DeepSeek's templates write ``'<｜tool▁sep｜>' + arguments``: a dict was a 400 (trial-126:
    every conversation with an earlier call). Such a template gets each call's arguments as
    the text it was sent as (the prompt is the client's own rendering of its messages), a
    dict's as compact JSON; a template that needs a mapping still gets one (above)."""
    tok = local_engine.tokenizer
    monkeypatch.setattr(tok, "chat_template", JOINING_TEMPLATE)
    want = _oracle(tok, CONVERSATION, tools=TOOLS)  # (the arguments as sent: JSON text)
    assert local_engine.encode_prompt(CONVERSATION, tools=TOOLS) == want
    assert local_engine.encode_prompt(CONVERSATION) == _oracle(tok, CONVERSATION) != want
    assert local_engine.encode_prompt(CONVERSATION, tools=TOOLS, chat_template_kwargs={"x": 1}) == want
    assert local_engine.generate(CONVERSATION, tools=TOOLS, max_new_tokens=1).stats.prompt_tokens == len(want)
    spaced = [{**m, "tool_calls": [{"function": {"name": "get_time", "arguments": ' {"a" :  "é"} '}}]}
              if m.get("tool_calls") else m for m in CONVERSATION]
    assert local_engine.encode_prompt(spaced) == _oracle(tok, spaced)  # (kept as written)
    big = [{**m, "tool_calls": [{"function": {"name": "get_time", "arguments": '{"a": 1e400}'}}]}
           if m.get("tool_calls") else m for m in CONVERSATION]  # (valid JSON, taken; NaN is not: above)
    assert '<|sep|>{"a": 1e400}<|end|>' in tok.decode(local_engine.encode_prompt(big))
    dicts = _with_dict_arguments(CONVERSATION)
    compact = _oracle(tok, _with_text_arguments(dicts, separators=(",", ":"), ensure_ascii=False), tools=TOOLS)
    assert local_engine.encode_prompt(dicts, tools=TOOLS) == compact
    empty = [{**m, "tool_calls": [{"function": {"name": "get_time", "arguments": arguments}}]}
             if m.get("tool_calls") else m for m in CONVERSATION for arguments in ("",)]
    assert "<|sep|>{}<|end|>" in tok.decode(local_engine.encode_prompt(empty))  # ("" is {}, as vLLM takes it)
    # a template that fails either way: the first failure (on the mapping), named as the messages'
    monkeypatch.setattr(tok, "chat_template", JOINING_TEMPLATE.replace("+ '<|end|>'", "+ 1"))
    with pytest.raises(DFlashError, match=r"^the chat template cannot render these messages: can only concatenate "
                                          r"str \(not \"dict\"\) to str$") as err:
        local_engine.encode_prompt(CONVERSATION, tools=TOOLS, chat_template_kwargs={"x": 1})
    assert not hasattr(err.value, "name")



def _nested(depth: int) -> dict:
    value = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def test_arguments_and_tools_nested_too_deeply_are_one_line_errors(local_engine, monkeypatch):
    """Python's JSON parser and the template's ``tojson`` recurse once per level: a
    RecursionError would be a 500 in the server."""
    monkeypatch.setattr(local_engine.tokenizer, "chat_template", HERMES_TEMPLATE)
    deep_text = '{"a":' * 3000 + "1" + "}" * 3000
    calls = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": deep_text}}]}]
    with pytest.raises(DFlashError, match=r"^tool call arguments must be a JSON object: message 0, call 0: nested too "
                                          r"deeply$"):
        local_engine.encode_prompt(calls)
    tools = [{"type": "function", "function": {"name": "f", "parameters": _nested(3000)}}]
    with pytest.raises(DFlashError, match=r"^the chat template cannot render these messages: .* nested too deeply$"):
        local_engine.encode_prompt("hi", chat=True, tools=tools)

# --- a real model that writes tool calls ----------------------------------------------------------

ASSISTANT = "<|assistant|>"
# the reply, one added token per piece: each token occurs once, so a bigram chain writes it
SCRIPT = ["Let me check.", "\n\n<tool", '_call>\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}\n</tool_',
          "call>\n<tool_call>", '\n{"name": "get_time", "arguments": {}}', "\n</tool_call>"]
SCRIPTED_TEMPLATE = (
    "{%- if tools %}# tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}\n{% endif %}"
    "{%- for m in messages %}# {{ m.role }}: {{ m.content }}{% for tc in m.tool_calls or [] %}<tool_call>"
    "{{ {'name': tc.function.name, 'arguments': tc.function.arguments} | tojson }}</tool_call>{% endfor %}\n"
    "{% endfor %}{%- if add_generation_prompt %}" + ASSISTANT + "{% endif %}")


def make_scripted_pair(root, tokenizer_dir, assistant: str, script: list[str], template: str,
                       special: tuple[str, ...] = ()):
    """A Qwen3 target that writes ``script`` then EOS after the prompt's last token
    ``assistant``: one-hot embeddings of the script's tokens, attention and MLP outputs
    zero (the last hidden state is the current token's embedding), lm_head mapping each token
    to its successor; a random drafter (speculative decoding is lossless whatever it drafts).
    Every piece of ``script`` is one added token (``special``: those added as special tokens),
    each once, with the chat ``template``. Returns (target, drafter, the reply's token ids)."""
    from tokenizers import AddedToken

    from conftest import EOS_ID, VOCAB, copy_tokenizer, drafter_config, make_target, save_drafter

    tok_dir = root / "tokenizer"
    shutil.copytree(tokenizer_dir, tok_dir)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    tok.add_tokens([AddedToken(t, special=t in special, normalized=False) for t in [assistant, *script]])
    tok.chat_template = template
    tok.save_pretrained(str(tok_dir))
    chain = tok.convert_tokens_to_ids([assistant, *script]) + [EOS_ID]
    target = make_target(root / "target", "qwen3", tokenizer=False, tie_word_embeddings=False,
                         vocab_size=VOCAB + len(chain))
    state = load_file(str(target / "model.safetensors"))
    for name in state:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            state[name].zero_()
    state["model.embed_tokens.weight"].zero_()
    state["lm_head.weight"].zero_()
    for k, (token, successor) in enumerate(zip(chain, chain[1:])):
        state["model.embed_tokens.weight"][token, k] = 1.0
        state["lm_head.weight"][successor, k] = 5.0  # (x sqrt(hidden) by the final norm: logit 40 vs 0)
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    copy_tokenizer(tok_dir, target)
    return target, save_drafter(root / "drafter", drafter_config(target)), chain[1:]


@pytest.fixture(scope="module")
def scripted_pair(tmp_path_factory, tokenizer_dir):
    """:func:`make_scripted_pair` writing :data:`SCRIPT` (hermes calls)."""
    return make_scripted_pair(tmp_path_factory.mktemp("scripted"), tokenizer_dir, ASSISTANT, SCRIPT, SCRIPTED_TEMPLATE)


MESSAGES = [{"role": "user", "content": "Weather in Paris, and the time?"}]
WANT_CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_the_scripted_model_writes_its_calls_target_only_and_speculative(scripted_pair):
    target, drafter, reply_ids = scripted_pair
    alone = DFlashEngine.from_pretrained(target, no_draft=True).generate(MESSAGES, tools=TOOLS, max_new_tokens=20)
    assert alone.token_ids == reply_ids and alone.finish_reason == "stop"
    assert alone.text == "".join(SCRIPT)
    engine = DFlashEngine.from_pretrained(target, drafter)
    assert engine.generate(MESSAGES, tools=TOOLS, max_new_tokens=20).token_ids == reply_ids
    assert "".join(c.text for c in engine.stream(MESSAGES, tools=TOOLS, max_new_tokens=20)) == alone.text
    assert [r.token_ids for r in engine.generate_batch([MESSAGES, MESSAGES], tools=TOOLS, max_new_tokens=20)] == \
        [reply_ids, reply_ids]


@pytest.fixture(scope="module")
def server(scripted_pair, tmp_path_factory):
    from test_server_scheduler import _serve

    # --tool-call-parser auto: hermes; keep-alive comments whenever 1 ms passes without a frame
    # (while a call is held back): the streams below read through them
    with _serve(scripted_pair[:2], tmp_path_factory.mktemp("tools-server"), "--sse-keepalive", "0.001") as srv:
        yield srv


def _message_calls(tool_calls) -> list[tuple[str, dict]]:
    assert all(c.type == "function" and c.id.startswith("call_") for c in tool_calls)
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


def test_server_returns_tool_calls(server, scripted_pair):
    target, _, reply_ids = scripted_pair
    tok = AutoTokenizer.from_pretrained(str(target))
    client = server.client()
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, temperature=0, n=2, logprobs=True)
    assert r.usage.prompt_tokens == len(_oracle(tok, MESSAGES, tools=TOOLS))
    assert r.usage.completion_tokens == 2 * len(reply_ids)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me check."
        assert _message_calls(choice.message.tool_calls) == WANT_CALLS
        # the tokens are the target's own (the EOS included)
        assert [lp.token for lp in choice.logprobs.content] == [tok.decode([t]) for t in reply_ids]
    # the call ids are unique
    assert len({c.id for ch in r.choices for c in ch.message.tool_calls}) == 4
    # tool_choice none: the model is not told of the tools, and nothing is parsed
    r = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="none", temperature=0)
    assert r.usage.prompt_tokens == len(_oracle(tok, MESSAGES))
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == "".join(SCRIPT)
    assert r.choices[0].finish_reason == "stop"
    # cut by max_tokens inside the first call: all text
    r = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=3)
    assert r.choices[0].message.content == "".join(SCRIPT[:3]) and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "length"
    # a conversation with the calls and their results (arguments as JSON text) renders as transformers does
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"}]
    r = client.chat.completions.create(model=model, messages=history, tools=TOOLS, temperature=0, max_tokens=1)
    assert r.usage.prompt_tokens == len(_oracle(tok, _with_dict_arguments(history), tools=TOOLS))
    log = server.log.read_text()
    assert "--tool-call-parser auto" not in log  # (auto found hermes: no warning)
    assert "leaves out a request's tools" not in log  # (its template renders them)


def test_server_streams_tool_calls(server):
    client = server.client()
    model = client.models.list().data[0].id
    content, calls, finish, usage = {}, {}, {}, None
    for chunk in client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, temperature=0, n=2,
                                                stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for ch in chunk.choices:
            content[ch.index] = content.get(ch.index, "") + (ch.delta.content or "")
            for call in ch.delta.tool_calls or []:
                calls.setdefault(ch.index, []).append(call)
            if ch.finish_reason is not None:
                finish[ch.index] = ch.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    assert content == {0: "Let me check.", 1: "Let me check."}
    for index in (0, 1):
        assert [c.index for c in calls[index]] == [0, 1]
        assert _message_calls(calls[index]) == WANT_CALLS
    assert usage.completion_tokens == 2 * (len(SCRIPT) + 1)
    # the raw stream: SSE comments while the calls were held back, between whole events
    import httpx
    import test_server

    body = {"model": model, "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "stream": True}
    for _ in range(5):  # (a comment needs a 1-ms gap between frames: one stream whose frames were all queued had none)
        with httpx.stream("POST", f"{server.base}/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {test_server.API_KEY}"}) as r:
            events = r.read().decode().split("\n\n")
        if ": keep-alive" in events:
            break
    assert ": keep-alive" in events and events[-2:] == ["data: [DONE]", ""]
    assert all(e == ": keep-alive" or e.startswith("data: ") for e in events[:-1]), events
    # and no empty delta for the rounds the parser held back (they were sent, 27 in one stream)
    deltas = [json.loads(e[len("data: "):])["choices"][0]["delta"] for e in events
              if e.startswith("data: {") and json.loads(e[len("data: "):])["choices"]]
    assert not [d for d in deltas if d.get("content") == "" and set(d) == {"content"}], deltas


def test_parallel_tool_calls_false_returns_the_first_call_only(server):
    """``parallel_tool_calls: false`` with ``tool_choice`` auto: the reply's first call only, as
    vLLM returns it (OpenAI: at most one call; trial-97: both calls), streamed and not alike
    (no delta of the second call)."""
    client = server.client()
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=MESSAGES, tools=TOOLS, temperature=0, parallel_tool_calls=False)
    r = client.chat.completions.create(n=2, **kw)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
        assert _message_calls(choice.message.tool_calls) == WANT_CALLS[:1]
    content, calls, finish = {}, {}, {}
    for chunk in client.chat.completions.create(n=2, stream=True, **kw):
        for ch in chunk.choices:
            content[ch.index] = content.get(ch.index, "") + (ch.delta.content or "")
            calls.setdefault(ch.index, []).extend(ch.delta.tool_calls or [])
            if ch.finish_reason is not None:
                finish[ch.index] = ch.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls"} and content == {0: "Let me check.", 1: "Let me check."}
    for index in (0, 1):
        assert [c.index for c in calls[index]] == [0] and _message_calls(calls[index]) == WANT_CALLS[:1]
    # true (or not given): every call
    r = client.chat.completions.create(**{**kw, "parallel_tool_calls": True})
    assert _message_calls(r.choices[0].message.tool_calls) == WANT_CALLS


def test_a_reply_without_a_reasoning_parser_has_no_reasoning_content_field(server):
    """With reasoning parser none (auto, for this template), a reply to a request with
    ``tools`` has no ``reasoning_content`` field, streamed or not, as a reply without tools
    (helper-152: ``"reasoning_content": null``), whether it calls tools or not."""
    import httpx
    import test_server

    headers = {"Authorization": f"Bearer {test_server.API_KEY}"}
    for extra in ({}, {"max_tokens": 3}, {"tool_choice": "none"}):  # (calls; text cut in a call; no tools told)
        body = {"model": test_server.MODEL, "messages": MESSAGES, "tools": TOOLS, "temperature": 0, **extra}
        r = httpx.post(f"{server.base}/v1/chat/completions", json=body, headers=headers, timeout=120)
        message = r.json()["choices"][0]["message"]
        assert r.status_code == 200 and "reasoning_content" not in message, (extra, r.text)
        assert ("tool_calls" in message) == (not extra), message
        with httpx.stream("POST", f"{server.base}/v1/chat/completions", json={**body, "stream": True},
                          headers=headers, timeout=120) as r:
            events = r.read().decode().split("\n\n")
        deltas = [json.loads(e[len("data: "):])["choices"][0]["delta"] for e in events
                  if e.startswith("data: {") and json.loads(e[len("data: "):])["choices"]]
        assert deltas and not [d for d in deltas if "reasoning_content" in d], (extra, deltas)


def test_keepalive_frames_fill_silences_and_end_with_the_stream():
    import asyncio

    from dflash_torch.serving.app import KEEPALIVE_FRAME, with_keepalive

    ended = []

    async def frames():
        try:
            for i in range(3):
                await asyncio.sleep(0.05)
                yield f"data: {i}\n\n"
        finally:
            ended.append(True)

    async def collect(limit=None):
        out = []
        async for f in with_keepalive(frames(), 0.01):
            out.append(f)
            if limit is not None and len([x for x in out if x != KEEPALIVE_FRAME]) == limit:
                break
        return out

    out = asyncio.run(collect())
    assert [f for f in out if f != KEEPALIVE_FRAME] == ["data: 0\n\n", "data: 1\n\n", "data: 2\n\n"]
    assert out[0] == KEEPALIVE_FRAME and out.count(KEEPALIVE_FRAME) >= 3 and ended == [True]
    ended.clear()

    async def leave_early():  # (a client that goes away: the inner stream is closed too)
        agen = with_keepalive(frames(), 0.01)
        async for f in agen:
            if f != KEEPALIVE_FRAME:
                break
        await agen.aclose()

    asyncio.run(leave_early())
    assert ended == [True]
    ended.clear()

    async def leave_after_a_frame():  # (closed where it handed a frame on, the next one not asked for)
        agen = with_keepalive(frames(), 10)
        assert await agen.__anext__() == "data: 0\n\n"
        await agen.aclose()
        return list(ended)

    assert asyncio.run(leave_after_a_frame()) == [True]

    async def leave_as_it_ends():  # (cancelled, the client gone, just as the inner stream ended: trial-277)
        errors = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context["message"]))
        release = asyncio.Event()

        async def last_frame():
            yield "data: last\n\n"
            await release.wait()

        agen = with_keepalive(last_frame(), 10)
        assert await agen.__anext__() == "data: last\n\n"
        step = asyncio.ensure_future(agen.__anext__())
        for _ in range(3):  # (the step waits for the inner stream's next frame)
            await asyncio.sleep(0)
        release.set()  # the inner stream ends (StopAsyncIteration) ...
        step.cancel()  # ... as the step is cancelled, before it saw the end
        with pytest.raises(asyncio.CancelledError):
            await step
        await agen.aclose()
        del agen, step
        gc.collect()  # (an unread task exception is reported when the task is collected)
        await asyncio.sleep(0)
        return errors

    assert asyncio.run(leave_as_it_ends()) == []  # (was ["Task exception was never retrieved"])


def test_server_refuses_calls_whose_arguments_are_not_json_objects(server):
    """(tool_choice required / a named function: tests/test_structured_server.py)"""
    client = server.client()
    model = client.models.list().data[0].id
    bad = MESSAGES + [{"role": "assistant", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_time", "arguments": "{oops"}}]}]
    where = "messages.1.tool_calls.0.function.arguments"  # (the exact path, as a missing field's; was "messages")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=bad, tools=TOOLS)
    assert err.value.body["param"] == where and "not valid JSON" in err.value.body["message"]
    assert err.value.body["message"].startswith(f"invalid value for {where}: must be a JSON object's text")
    deep = MESSAGES + [{"role": "assistant", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_time", "arguments": "[" * 5000 + "]" * 5000}}]}]
    with pytest.raises(openai.BadRequestError) as err:  # (not a 500)
        client.chat.completions.create(model=model, messages=deep, tools=TOOLS)
    assert err.value.body["param"] == where and "nested too deeply" in err.value.body["message"]
    for arguments in ('{"a": NaN}', '{"a": {"b": Infinity}}'):  # (strict JSON: trial-134 rendered NaN)
        strict = MESSAGES + [{"role": "assistant", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_time", "arguments": arguments}}]}]
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=model, messages=strict, tools=TOOLS)
        assert err.value.body["param"] == where and "is not JSON" in err.value.body["message"]
    import httpx
    import test_server

    body = {"model": model, "tools": TOOLS, "messages": MESSAGES + [{"role": "assistant", "tool_calls": [  # (raw body:
        {"id": "call_a", "type": "function", "function": {"name": "get_time", "arguments": {"a": None}}}]}]}  # NaN)
    text = json.dumps(body).replace('"a": null', '"a": NaN')
    reply = httpx.post(f"{server.base}/v1/chat/completions", content=text, timeout=60,
                       headers={"content-type": "application/json", "Authorization": f"Bearer {test_server.API_KEY}"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == where, reply.text
    assert "holds NaN or Infinity" in reply.json()["error"]["message"]
    listed = MESSAGES + [{"role": "assistant", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "[1]"}}]}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=listed, tools=TOOLS)
    assert err.value.body["param"] == "messages.1.tool_calls.1.function.arguments"
    assert err.value.body["message"].endswith("must be a JSON object's text, got an array")
    # JSON's names of the types (trial-101: "got a JSON NoneType", list, int, str, bool)
    for text, words in (("null", "null"), ("[]", "an array"), ("5", "a number"), ('"s"', "a string"),
                        ("true", "a boolean")):
        called = MESSAGES + [{"role": "assistant", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_time", "arguments": text}}]}]
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=model, messages=called, tools=TOOLS)
        assert err.value.body["param"] == where
        assert err.value.body["message"] == f"invalid value for {where}: must be a JSON object's text, got {words}"


OMITTED = object()


def test_server_takes_empty_call_arguments_as_an_empty_object(server, scripted_pair):
    """An earlier call's ``arguments`` ``""`` or null is ``{}``, as vLLM takes them (trial-97:
    a 400 "not valid JSON"): the prompt is the one of ``{}``; so is a call without
    ``arguments``, as the engine takes it (trial-101: a 400 "missing required parameter")."""
    tok = AutoTokenizer.from_pretrained(str(scripted_pair[0]))
    client = server.client()
    model = client.models.list().data[0].id

    def history(arguments):
        function = {"name": "get_time"} if arguments is OMITTED else {"name": "get_time", "arguments": arguments}
        return MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_a", "type": "function", "function": function}]},
            {"role": "tool", "tool_call_id": "call_a", "content": "14:05"}]

    want = len(_oracle(tok, history({}), tools=TOOLS))
    for arguments in ("", None, "{}", OMITTED):
        r = client.chat.completions.create(model=model, messages=history(arguments), tools=TOOLS, temperature=0,
                                           max_tokens=1)
        assert r.usage.prompt_tokens == want, arguments


def test_unparsed_calls_warning_only_for_auto_none_and_a_template_with_tools():
    from dflash_torch.serving.cli import unparsed_calls_warning

    assert unparsed_calls_warning("auto", "none", JOINING_TEMPLATE).startswith("--tool-call-parser auto knows no ")
    assert unparsed_calls_warning("auto", "none", {"default": "{{ messages }}", "tool_use": JOINING_TEMPLATE})
    calls_only = "{% for m in messages %}{% for tc in m.tool_calls or [] %}{{ tc.function.name }}{% endfor %}{% endfor %}"
    assert unparsed_calls_warning("auto", "none", calls_only)  # (DeepSeek V3.1's: no tools, their calls)
    assert unparsed_calls_warning("none", "none", JOINING_TEMPLATE) is None  # (asked for)
    assert unparsed_calls_warning("auto", "hermes", HERMES_TEMPLATE) is None
    assert unparsed_calls_warning("auto", "none", "{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert unparsed_calls_warning("auto", "none", None) is None


def test_server_renders_a_joining_templates_history_and_warns_of_its_unparsed_calls(tmp_path_factory, tokenizer_dir):
    """A DeepSeek-style template (arguments joined to a string; call markers no parser
    knows): a conversation with an earlier call renders as the client's own rendering of its
    messages, in chat, Responses and /tokenize (trial-126: a 400 naming the tools); auto
    picks no parser, which start-up says in one WARNING line (trial-126: silent), and the
    reply's call comes back as text."""
    from test_server_scheduler import _serve

    from dflash_torch.serving.tools import PARSERS

    root = tmp_path_factory.mktemp("joining-tools")
    script = ["Checking.", "<|call|>get_time<|sep|>", "{}<|end|>"]
    target, drafter, reply_ids = make_scripted_pair(root, tokenizer_dir, ASSISTANT, script, JOINING_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(str(target))
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"}]
    want = _oracle(tok, history, tools=TOOLS)
    with _serve((target, drafter), root) as server:
        client = server.client()
        model = client.models.list().data[0].id
        choice = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, temperature=0).choices[0]
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == ("".join(script), None, "stop")
        r = client.chat.completions.create(model=model, messages=history, tools=TOOLS, temperature=0, max_tokens=1)
        assert r.usage.prompt_tokens == len(want)
        r = server.post("/tokenize", {"model": model, "messages": history, "tools": TOOLS})
        assert r.status_code == 200 and r.json()["tokens"] == want
        items = [{"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                 {"type": "function_call_output", "call_id": "call_a", "output": "sunny"}]
        flat = [{"type": "function", **t["function"]} for t in TOOLS]
        r = client.responses.create(model=model, input=MESSAGES + items, tools=flat, temperature=0, max_output_tokens=1)
        assert r.usage.input_tokens == len(want)
        warnings = [line for line in server.log.read_text().splitlines() if "WARNING" in line]
    known = ", ".join(p for p in PARSERS if p not in ("auto", "none"))
    assert warnings == [
        "WARNING:  --tool-call-parser auto knows no tool call format of this chat template, which renders tools or "
        "tool calls: the tool calls that replies write come back as text in content (finish_reason stop); the parsers: "
        f"{known} (--tool-call-parser NAME)"]


# --- Gemma 4: its thought channel and calls, the markers special tokens --------------------------

GEMMA4_TURN = "<|turn>model\n"
# (each token once: the closing <|"|> of the string comes inside a plain added token)
GEMMA4_SCRIPT = ["<|channel>", "thought\n", "Both needed.", "<channel|>", "Checking.", "<|tool_call>",
                 "call:get_weather{city:", '<|"|>', 'Paris<|"|>,days:2}', "<tool_call|>"]
GEMMA4_SPECIAL = ("<|channel>", "<channel|>", "<|tool_call>", '<|"|>', "<tool_call|>")
GEMMA4_TEMPLATE = (
    "{%- if tools %}<|turn>system\n{% for tool in tools %}<|tool>{{ tool.function.name }}<tool|>{% endfor %}"
    "<turn|>\n{% endif %}"
    "{%- for m in messages %}<|turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{% if m.reasoning_content %}<|channel>thought\n{{ m.reasoning_content }}<channel|>{% endif %}{{ m.content or '' }}"
    "{% for tc in m.tool_calls or [] %}<|tool_call>call:{{ tc.function.name }}{}<tool_call|>{% endfor %}<turn|>\n"
    "{% endfor %}{%- if add_generation_prompt %}" + GEMMA4_TURN + "{% endif %}")


def test_server_reads_gemma4_reasoning_and_calls_whose_markers_are_special_tokens(tmp_path_factory, tokenizer_dir):
    """--reasoning-parser / --tool-call-parser auto pick gemma4 from the template; the markers
    (special tokens) are kept for the parsers when a request skips special tokens, so the
    reasoning, content and calls are the same either way, whole and streamed."""
    from test_server_scheduler import _serve

    root = tmp_path_factory.mktemp("gemma4-tools")
    target, drafter, reply_ids = make_scripted_pair(root, tokenizer_dir, GEMMA4_TURN, GEMMA4_SCRIPT, GEMMA4_TEMPLATE,
                                                    special=GEMMA4_SPECIAL)
    engine = DFlashEngine.from_pretrained(target, drafter)
    out = engine.generate(MESSAGES, tools=TOOLS, max_new_tokens=20)
    assert out.token_ids == reply_ids and out.text == "".join(GEMMA4_SCRIPT)
    with _serve((target, drafter), root) as server:
        client = server.client()
        model = client.models.list().data[0].id
        for skip in (False, True):
            kw = dict(model=model, messages=MESSAGES, tools=TOOLS, temperature=0, extra_body={"skip_special_tokens": skip})
            choice = client.chat.completions.create(**kw).choices[0]
            assert choice.finish_reason == "tool_calls"
            assert (choice.message.reasoning_content, choice.message.content) == ("Both needed.", "Checking.")
            assert _message_calls(choice.message.tool_calls) == [("get_weather", {"city": "Paris", "days": 2})]
            reasoning, content, calls = [], [], []
            for chunk in client.chat.completions.create(stream=True, **kw):
                delta = chunk.choices[0].delta if chunk.choices else None
                if delta is not None:
                    reasoning.append(getattr(delta, "reasoning_content", None) or "")
                    content.append(delta.content or "")
                    calls += delta.tool_calls or []
            assert ("".join(reasoning), "".join(content)) == ("Both needed.", "Checking.")
            assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
                ("get_weather", {"city": "Paris", "days": 2})]
        # tool_choice required has no grammar in this format: refused, as for harmony
        with pytest.raises(openai.BadRequestError,
                           match="needs the hermes, qwen3_coder, glm45, glm47, kimi_k2 or deepseek_v31 tool-call format"):
            client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required")
