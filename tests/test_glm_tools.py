"""GLM's tool calls (GLM-4.5 / 4.6: ``glm45``, GLM-4.7 / 5: ``glm47``):
``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>``, read whole
and streamed (dflash_torch/serving/tools.py), picked by ``--tool-call-parser auto`` from
chat templates in GLM's layout (GLM45_TEMPLATE / GLM47_TEMPLATE below, small templates of our
own), and forced calls (``tool_choice`` required / a named function) written in GLM's own
layout: a real server of a tiny model with such a template, whose calls the template renders
back as the very text the model wrote."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from dflash_torch import DFlashEngine, DFlashError
from dflash_torch.serving.tools import (Glm45Parser, glm45_grammar, glm47_grammar, new_reply_parser, parse_reply,
                                        resolve_tool_parser)

from conftest import TOOLS

# small templates that follow GLM's layout: the tools in the system part, the roles as <|user|> /
# <|assistant|> / <|observation|> (tool results in <tool_response>), an optional <think>...</think>,
# and each call's arguments as <arg_key> / <arg_value> pairs, a string value as it is, any other as
# JSON. GLM-4.5 / 4.6 put a newline before each call, after its name and after each pair, and the
# reply after <|assistant|> begins with a newline; GLM-4.7 / 5 write none of those newlines.
GLM45_TEMPLATE = (  # (transformers drops a newline that follows a {% ... %} tag: they come before the tags)
    "[gMASK]<sop>{% if tools %}<|system|>\n# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools>{% endif %}"
    "{%- for m in messages %}{% if m.role == 'tool' %}{% if loop.first or loop.previtem.role != 'tool' %}"
    "<|observation|>{% endif %}{{ '\\n<tool_response>\\n' ~ m.content ~ '\\n</tool_response>' }}"
    "{% elif m.role == 'assistant' %}<|assistant|>\n<think>{{ m.reasoning_content or '' }}</think>"
    "{{ '\\n' ~ m.content if m.content else '' }}{% for tc in m.tool_calls or [] %}{% set tc = tc.function %}"
    "{{ '\\n<tool_call>' ~ tc.name ~ '\\n' }}{% for k, v in tc.arguments | items %}<arg_key>{{ k }}</arg_key>\n"
    "<arg_value>{{ v if v is string else v | tojson }}</arg_value>\n{% endfor %}</tool_call>{% endfor %}"
    "{% else %}<|{{ m.role }}|>\n{{ m.content }}{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{{ '\\n<think></think>' if enable_thinking is false else '' }}"
    "{% endif %}")
GLM47_TEMPLATE = (
    "[gMASK]<sop>{% if tools %}<|system|>\n# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools>{% endif %}"
    "{%- for m in messages %}{% if m.role == 'tool' %}{% if loop.first or loop.previtem.role != 'tool' %}"
    "<|observation|>{% endif %}<tool_response>{{ m.content }}</tool_response>"
    "{% elif m.role == 'assistant' %}<|assistant|>{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
    "{% endif %}</think>{{ m.content or '' }}{% for tc in m.tool_calls or [] %}{% set tc = tc.function %}"
    "<tool_call>{{ tc.name }}{% for k, v in tc.arguments | items %}<arg_key>{{ k }}</arg_key><arg_value>"
    "{{ v if v is string else v | tojson }}</arg_value>{% endfor %}</tool_call>{% endfor %}"
    "{% else %}<|{{ m.role }}|>{{ m.content }}{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{{ '</think>' if enable_thinking is false else '<think>' }}"
    "{% endif %}")
TEMPLATES = {"glm45": GLM45_TEMPLATE, "glm47": GLM47_TEMPLATE}
GRAMMARS = {"glm45": glm45_grammar, "glm47": glm47_grammar}


GLM45 = ("\n<think>Need both.</think>\nLet me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
         "<arg_value>New York</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>metric</arg_key>\n"
         "<arg_value>true</arg_value>\n<arg_key>hours</arg_key>\n<arg_value>[1, 2]</arg_value>\n<arg_key>ratio</arg_key>\n"
         "<arg_value>null</arg_value>\n</tool_call>\n<tool_call>get_time\n</tool_call>")
GLM47 = ("Need both.</think>Let me check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>New York</arg_value>"
         "<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>metric</arg_key><arg_value>true</arg_value>"
         "<arg_key>hours</arg_key><arg_value>[1, 2]</arg_value><arg_key>ratio</arg_key><arg_value>null</arg_value>"
         "</tool_call><tool_call>get_time</tool_call>")
BOTH = [("get_weather", {"city": "New York", "days": 3, "metric": True, "hours": [1, 2], "ratio": None}),
        ("get_time", {})]

# (reasoning parser, tool parser, prompt tail, reply, ended with a stop, reasoning, content, [(name, arguments)])
CASES = [
    ("think", "glm45", "<|assistant|>", GLM45, True, "Need both.", "\nLet me check.", BOTH),  # (as minimax_m2's)
    ("think", "glm47", "<|assistant|><think>", GLM47, True, "Need both.", "Let me check.", BOTH),
    ("none", "glm45", "", GLM47[len("Need both.</think>"):], True, "", "Let me check.", BOTH),  # (one parser reads both)
    # a string parameter keeps its text as written; an untyped one (no schema) is JSON where it parses as JSON
    ("none", "glm47", "", "<tool_call>get_weather<arg_key>city</arg_key><arg_value> 42 </arg_value><arg_key>note"
     "</arg_key><arg_value>{\"a\": 1}</arg_value><arg_key>other</arg_key><arg_value>plain text</arg_value></tool_call>",
     True, "", "", [("get_weather", {"city": " 42 ", "note": {"a": 1}, "other": "plain text"})]),
    # a value that does not read as its type stays text; an unknown function's values as untyped
    ("none", "glm45", "", "<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>three</arg_value>\n</tool_call>"
     "<tool_call>nope\n<arg_key>n</arg_key>\n<arg_value>7</arg_value>\n</tool_call>", True, "", "",
     [("get_weather", {"days": "three"}), ("nope", {"n": 7})]),
    # an </arg_value> inside a value: it ends at the one the next <arg_key> or the call's end follows
    ("none", "glm45", "", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>a</arg_value> b</arg_value>\n"
     "</tool_call>", True, "", "", [("get_weather", {"city": "a</arg_value> b"})]),
    # not a call: no name, a name over two lines, text between the arguments; they stay text
    ("none", "glm45", "", "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>", True, "",
     "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>", []),
    ("none", "glm45", "", "<tool_call>get\nweather</tool_call>", True, "", "<tool_call>get\nweather</tool_call>", []),
    ("none", "glm47", "", "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value> so</tool_call>", True, "",
     "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value> so</tool_call>", []),
    # cut by max_tokens inside a call: text
    ("none", "glm45", "", "Sure.\n<tool_call>get_weather\n<arg_key>city", False, "",
     "Sure.\n<tool_call>get_weather\n<arg_key>city", []),
    # a call inside the reasoning is reasoning
    ("think", "glm47", "<think>", "<tool_call>get_time</tool_call></think>ok", True, "<tool_call>get_time</tool_call>",
     "ok", []),
]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("reasoning,tools,prompt,reply,complete,want_reasoning,content,calls", CASES)
def test_whole_replies(reasoning, tools, prompt, reply, complete, want_reasoning, content, calls):
    got = parse_reply(new_reply_parser(reasoning, tools, prompt, TOOLS), reply, complete)
    assert (got[0], got[1], _calls(got[2])) == (want_reasoning, content, calls)
    assert len({c.id for c in got[2]}) == len(got[2])


@pytest.mark.parametrize("case", CASES)
def test_streamed_char_by_char_equals_whole(case):
    reasoning, tools, prompt, reply, complete, want_reasoning, content, calls = case
    parser = new_reply_parser(reasoning, tools, prompt, TOOLS)
    got = [parser.feed(ch) for ch in reply] + [parser.finish(complete)]
    assert ("".join(g[0] for g in got), "".join(g[1] for g in got)) == (want_reasoning, content)
    assert _calls([c for g in got for c in g[2]]) == calls
    # each call comes out as soon as its </tool_call> is read
    if calls:
        ends = [i for i, g in enumerate(got[:-1]) if g[2]]
        assert ends and all(reply[:i + 1].endswith("</tool_call>") for i in ends)


def test_auto_picks_glm_from_glm_templates():
    assert resolve_tool_parser("auto", "glm4_moe", TEMPLATES["glm45"], "think") == "glm45"
    assert resolve_tool_parser("auto", "glm4_moe_lite", TEMPLATES["glm47"], "think") == "glm47"
    tokenizer_style = {"default": TEMPLATES["glm47"]}
    assert resolve_tool_parser("auto", "glm_moe_dsa", tokenizer_style, "think") == "glm47"
    # (the Qwen formats are unchanged)
    assert resolve_tool_parser("auto", "qwen3", "<tool_call>\n<function=x>", "think") == "qwen3_coder"
    assert resolve_tool_parser("auto", "qwen3", "<tool_call>\n{{ tool_call | tojson }}", "think") == "hermes"


def test_cli_takes_the_glm_parsers(capsys):
    from dflash_torch.cli import main as cli_main

    with pytest.raises(SystemExit):
        cli_main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "glm45 (<tool_call>NAME<arg_key>" in help_text and "glm47 (the same without the newlines" in help_text


def _render(tokenizer, template: str, messages: list[dict], **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, chat_template=template, tools=TOOLS, tokenize=False, **kwargs)


def _assistant(calls: list[tuple[str, dict]]) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": args}} for name, args in calls]}


@pytest.mark.parametrize("kind,reply", [("glm45", GLM45), ("glm47", GLM47)])
def test_templates_write_the_replies_the_parsers_read(kind, reply, tokenizer_dir):
    """The templates write a reply with reasoning, text and two calls as GLM45 / GLM47 above."""
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    user = [{"role": "user", "content": "hi"}]
    prompt = _render(tok, TEMPLATES[kind], user, add_generation_prompt=True)
    assistant = {**_assistant(BOTH), "content": "Let me check.", "reasoning_content": "Need both."}
    assert _render(tok, TEMPLATES[kind], user + [assistant]) == prompt + reply


@pytest.mark.parametrize("kind", ["glm45", "glm47"])
def test_grammar_takes_what_the_template_writes_and_the_parser_reads(kind, tokenizer_dir):
    """The forced-call grammar accepts the calls as GLM's template writes them (the
    arguments in the schema's order) and refuses others; the parser reads them back."""
    from llguidance import LLMatcher

    from conftest import EOS_ID
    from dflash_torch.structured import GrammarCompiler

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    llg = GrammarCompiler(tok, len(tok), [EOS_ID]).tokenizer()

    def accepts(grammar: str, text: str) -> bool:
        m = LLMatcher(llg, LLMatcher.grammar_from_lark(grammar))
        return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()

    user = [{"role": "user", "content": "hi"}]
    prompt = _render(tok, TEMPLATES[kind], user, add_generation_prompt=True, enable_thinking=False)
    good = [("get_weather", {"city": "Oslo  </arg_key>", "days": 2, "metric": False, "hours": [1, "a"],
                             "ratio": None}), ("get_time", {}), ("get_weather", {"city": "Paris", "ratio": 2.5})]
    grammar = GRAMMARS[kind](TOOLS)
    for calls in [[c] for c in good] + [good]:
        rendered = _render(tok, TEMPLATES[kind], user + [_assistant(calls)], enable_thinking=False)
        text = rendered[len(prompt):].removeprefix("\n")  # (GLM-4.5 / 4.6 write a newline before their calls)
        assert rendered.startswith(prompt) and text.startswith("<tool_call>"), rendered
        assert accepts(grammar, text), text
        _, content, parsed = parse_reply(new_reply_parser("none", kind, tools=TOOLS), text, True)
        assert content == "" and _calls(parsed) == calls
    one, two = (_render(tok, TEMPLATES[kind], user + [_assistant(good[:n])], enable_thinking=False)[len(prompt):]
                .removeprefix("\n") for n in (1, 2))
    assert not accepts(GRAMMARS[kind](TOOLS, parallel=False), two)
    assert not accepts(GRAMMARS[kind](TOOLS, "get_time"), one) and accepts(GRAMMARS[kind](TOOLS, "get_weather"), one)
    for bad in ([("get_weather", {"days": 2})], [("get_weather", {"days": 2, "city": "Oslo"})],
                [("get_weather", {"city": "x", "days": 1.5})], [("get_weather", {"city": "x", "metric": "yes"})],
                [("get_time", {"x": 1})], [("nope", {})]):
        text = _render(tok, TEMPLATES[kind], user + [_assistant(bad)], enable_thinking=False)[len(prompt):] \
            .removeprefix("\n")
        assert not accepts(grammar, text), bad
    assert not accepts(grammar, "Sure. " + one)
    assert accepts(GRAMMARS[kind](TOOLS, reasoning="opened"), "first</think>" + one)
    # GLM-4.5 / 4.6 begin a reply with a newline (before their <think> or call); GLM-4.7 does not
    assert accepts(GRAMMARS[kind](TOOLS, reasoning="optional"), "\n<think>a</think>\n" + one) == (kind == "glm45")
    assert accepts(GRAMMARS[kind](TOOLS), "\n" + one) == (kind == "glm45")
    with pytest.raises(DFlashError, match="cannot be written as a GLM call"):
        GRAMMARS[kind]([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a<b": {"type": "string"}}}}}])
    assert Glm45Parser.convert("[1, 2]", None) == [1, 2] and Glm45Parser.convert("[1, 2", None) == "[1, 2"


# bounded values (an enum, a small integer): a random model's forced call ends
FORCED_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "days"],
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "metric": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.mark.parametrize("kind", ["glm45", "glm47"])
@pytest.mark.parametrize("markers", ["text", "special tokens"])
def test_forced_calls_are_written_as_glm_writes_them(kind, markers, tmp_path, tokenizer_dir):
    """A server of a tiny model with GLM's template (--tool-call-parser auto: the GLM parser):
    tool_choice a named function / required (one call: a random model would call on and on)
    gives the call of target-only decoding with the grammar, and the template renders that
    call back as the very text the model wrote. ``markers`` "special tokens": GLM's markers
    (``<tool_call>``, ``<arg_key>`` ...) are each one special token, as in GLM's tokenizers:
    the grammar takes them as tokens, and the server keeps them for the parser."""
    from tokenizers import AddedToken

    from conftest import VOCAB, make_target
    from dflash_torch.serving.tools import GLM_MARKERS
    from test_server_scheduler import _serve

    target = make_target(tmp_path / "target", "qwen3", vocab_size=VOCAB + len(GLM_MARKERS))
    tok = AutoTokenizer.from_pretrained(str(target))
    if markers == "special tokens":
        tok.add_tokens([AddedToken(m, special=True, normalized=False) for m in GLM_MARKERS])
        assert all(len(tok.encode(m, add_special_tokens=False)) == 1 for m in GLM_MARKERS)
    tok.chat_template = TEMPLATES[kind]
    tok.save_pretrained(str(target))
    off = {"enable_thinking": False}
    engine = DFlashEngine.from_pretrained(target, no_draft=True)
    prompt = _render(tok, TEMPLATES[kind], MESSAGES, add_generation_prompt=True, enable_thinking=False)
    with _serve((target, None), tmp_path, "--no-draft", "--chat-template-kwargs", json.dumps(off)) as server:
        client = server.client()
        model = client.models.list().data[0].id
        for tool_choice, name in [({"type": "function", "function": {"name": "get_weather"}}, "get_weather"),
                                  ("required", None)]:
            ids = tuple(tok.convert_tokens_to_ids(m) if markers == "special tokens" else None for m in GLM_MARKERS)
            grammar = GRAMMARS[kind](FORCED_TOOLS, name, parallel=False, call_tokens=ids)
            want = engine.generate(MESSAGES, chat=True, tools=FORCED_TOOLS, chat_template_kwargs=off, max_new_tokens=200,
                                   structured_output={"grammar": grammar}, skip_special_tokens=False)
            assert want.finish_reason == "stop" and want.text.lstrip("\n").startswith("<tool_call>"), want.text
            r = client.chat.completions.create(model=model, messages=MESSAGES, tools=FORCED_TOOLS,
                                               tool_choice=tool_choice, parallel_tool_calls=False, temperature=0,
                                               max_tokens=200).choices[0]
            assert r.finish_reason == "tool_calls" and r.message.content is None, r
            calls = [(c.function.name, json.loads(c.function.arguments)) for c in r.message.tool_calls]
            assert calls and all(name is None or n == name for n, _ in calls)
            rendered = _render(tok, TEMPLATES[kind], MESSAGES + [_assistant(calls)], enable_thinking=False)
            # (GLM-4.5 / 4.6's template writes a newline before the calls: the model may write it, or not)
            newline = "\n" if kind == "glm45" and not want.text.startswith("\n") else ""
            assert rendered == prompt + newline + want.text, (rendered[len(prompt):], want.text)


@pytest.mark.parametrize("kind", ["glm45", "glm47"])
def test_a_required_parameter_with_an_empty_enum_cannot_be_forced(kind, tokenizer_dir):
    """``"enum": []`` allows no value: a required parameter's forced call is refused (its
    grammar took any text until max_tokens, trial-134), untyped, a string or through a
    ``$ref``; an optional one is left out of the call (as hermes' JSON schema leaves it)."""
    from llguidance import LLMatcher

    from conftest import EOS_ID
    from dflash_torch.structured import GrammarCompiler

    def tool(e: dict, required: list[str]) -> list[dict]:
        return [{"type": "function", "function": {"name": "pick", "parameters": {
            "type": "object", "properties": {"e": e, "n": {"type": "integer"}}, "required": required,
            "$defs": {"none": {"enum": []}}}}}]

    for e in ({"enum": []}, {"type": "string", "enum": []}, {"type": "integer", "enum": []}, {"$ref": "#/$defs/none"}):
        with pytest.raises(DFlashError, match=r"^tools function 'pick': its required parameter 'e' allows no value "
                                              r"\(an empty enum\), so no call can be written$"):
            GRAMMARS[kind](tool(e, ["e"]), "pick")
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    llg = GrammarCompiler(tok, len(tok), [EOS_ID]).tokenizer()
    grammar = GRAMMARS[kind](tool({"enum": []}, ["n"]), "pick")
    user = [{"role": "user", "content": "hi"}]
    prompt = _render(tok, TEMPLATES[kind], user, add_generation_prompt=True, enable_thinking=False)
    for args, ok in (({"n": 1}, True), ({"e": "x", "n": 1}, False), ({"n": 1, "e": "x"}, False)):
        text = _render(tok, TEMPLATES[kind], user + [_assistant([("pick", args)])], enable_thinking=False)
        m = LLMatcher(llg, LLMatcher.grammar_from_lark(grammar))
        tokens = tok.encode(text[len(prompt):].removeprefix("\n"), add_special_tokens=False)
        assert (all(m.consume_token(t) for t in tokens) and m.is_accepting()) == ok, args
