"""Tool calls in sections of calls (dflash_torch/serving/tools.py): Kimi-K2's
(``--tool-call-parser kimi_k2``) and DeepSeek-V3.1's, V3's and R1's (``deepseek_v31``),
whole replies and the same replies fed in pieces (the result does not depend on the cuts),
``auto`` picking them from the chat template, ``parallel_tool_calls`` false; a real server
with a tiny model that writes the calls, its markers special tokens (templates of our own);
forced calls (``tool_choice`` required / a named function) as those templates write them."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_torch import DFlashEngine, DFlashError
from dflash_torch.serving.tools import (DEEPSEEK_MARKERS, KIMI_MARKERS, deepseek_v31_grammar, kimi_k2_grammar,
                                         new_reply_parser, parse_reply, resolve_tool_parser)

from conftest import TOOLS

KIMI = ('Let me check.\n<|tool_calls_section_begin|>\n<|tool_call_begin|>functions.get_weather:0'
        '<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|>\n'
        '<|tool_call_begin|> functions.get_time:1 <|tool_call_argument_begin|> {} <|tool_call_end|>'
        '<|tool_calls_section_end|>')
DEEPSEEK = ('Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 2}'
            '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
# DeepSeek-V3 (0324) and R1: the type, then the name and the arguments in a fenced JSON block
DEEPSEEK_V3 = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
               '{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
               'get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
BOTH = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
K_CALL = '<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|>'
D_CALL = '<｜tool▁call▁begin｜>f<｜tool▁sep｜>{"a": 1}<｜tool▁call▁end｜>'


def _kimi(*calls: str) -> str:
    return "<|tool_calls_section_begin|>" + "".join(calls) + "<|tool_calls_section_end|>"


def _deepseek(*calls: str) -> str:
    return "<｜tool▁calls▁begin｜>" + "".join(calls) + "<｜tool▁calls▁end｜>"


# (reasoning parser, tool parser, prompt tail, reply, ended with a stop, reasoning, content, [(name, arguments)])
CASES = [
    ("none", "kimi_k2", "", KIMI, True, "", "Let me check.", BOTH),
    ("think", "kimi_k2", "<|im_assistant|>assistant<|im_middle|><think>", "Both.</think>" + KIMI[len("Let me check."):],
     True, "Both.", "", BOTH),
    ("none", "kimi_k2", "", "no call here, a <|tool_call_begin|> and 1 < 2", True, "",
     "no call here, a <|tool_call_begin|> and 1 < 2", []),
    # the prefix and the index may be missing; whitespace around the section's calls is dropped, text stays apart
    ("none", "kimi_k2", "", "A\n" + _kimi("<|tool_call_begin|>get_time<|tool_call_argument_begin|>{}<|tool_call_end|>")
     + "\n\nB", True, "", "A\nB", [("get_time", {})]),
    # markers inside an argument's text: still the call
    ("none", "kimi_k2", "", _kimi('<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": "x <|tool_call_end|>'
                                  ' <|tool_calls_section_end|> y"}<|tool_call_end|>'), True, "", "",
     [("f", {"a": "x <|tool_call_end|> <|tool_calls_section_end|> y"})]),
    # malformed: arguments not a JSON object, text between calls, no call, no argument marker: all content
    ("none", "kimi_k2", "", _kimi(K_CALL.replace('{"a": 1}', "{a: 1}")) + "after", True, "",
     _kimi(K_CALL.replace('{"a": 1}', "{a: 1}")) + "after", []),
    ("none", "kimi_k2", "", _kimi(K_CALL.replace('{"a": 1}', "[1]")), True, "", _kimi(K_CALL.replace('{"a": 1}', "[1]")),
     []),
    ("none", "kimi_k2", "", _kimi(K_CALL, " and ", K_CALL), True, "", _kimi(K_CALL, " and ", K_CALL), []),
    ("none", "kimi_k2", "", _kimi(), True, "", _kimi(), []),
    ("none", "kimi_k2", "", _kimi("<|tool_call_begin|>functions.f:0{}<|tool_call_end|>"), True, "",
     _kimi("<|tool_call_begin|>functions.f:0{}<|tool_call_end|>"), []),
    # a malformed section, then a good one: the first is content, the second calls
    ("none", "kimi_k2", "", _kimi("junk") + "x" + _kimi(K_CALL), True, "", _kimi("junk") + "x", [("f", {"a": 1})]),
    ("none", "kimi_k2", "", KIMI[:150], False, "", KIMI[:150], []),  # (cut inside the section)
    ("none", "kimi_k2", "", "a <tool_call> of another format", True, "", "a <tool_call> of another format", []),
    ("none", "deepseek_v31", "", DEEPSEEK, True, "", "Sure.", BOTH),
    ("none", "deepseek_v31", "", DEEPSEEK_V3, True, "", "", BOTH),
    ("think", "deepseek_v31", "<｜Assistant｜><think>", "Both.</think>Sure.\n\n" + DEEPSEEK[len("Sure."):] + "\nDone.",
     True, "Both.", "Sure.\n\nDone.", BOTH),
    # a V3.1 call of a function named "function"; the two layouts in one section; whitespace between the parts
    ("none", "deepseek_v31", "", _deepseek(D_CALL.replace(">f<", ">function<"), '\n<｜tool▁call▁begin｜> function '
                                           '<｜tool▁sep｜> f \n```json\n{"b": "```"}\n``` <｜tool▁call▁end｜>'), True, "", "",
     [("function", {"a": 1}), ("f", {"b": "```"})]),
    ("none", "deepseek_v31", "", _deepseek(D_CALL.replace('{"a": 1}', '{"a": "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"}')),
     True, "", "", [("f", {"a": "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"})]),
    ("none", "deepseek_v31", "", _deepseek(D_CALL.replace('{"a": 1}', '{"a": NaN}')), True, "",
     _deepseek(D_CALL.replace('{"a": 1}', '{"a": NaN}')), []),
    ("none", "deepseek_v31", "", _deepseek(D_CALL.replace("<｜tool▁sep｜>", "")), True, "",
     _deepseek(D_CALL.replace("<｜tool▁sep｜>", "")), []),
    ("none", "deepseek_v31", "", _deepseek(D_CALL.replace(">f<", ">two words<")), True, "",
     _deepseek(D_CALL.replace(">f<", ">two words<")), []),
    ("none", "deepseek_v31", "", _deepseek(), True, "", _deepseek(), []),
    ("none", "deepseek_v31", "", DEEPSEEK[:90], False, "", DEEPSEEK[:90], []),  # (cut)
    # an unclosed section is content even when the reply ended (as an unclosed call of the other formats)
    ("none", "deepseek_v31", "", "x" + _deepseek(D_CALL)[:-len("<｜tool▁calls▁end｜>")], True, "",
     "x" + _deepseek(D_CALL)[:-len("<｜tool▁calls▁end｜>")], []),
    # one format's markers are text to the other's parser
    ("none", "deepseek_v31", "", KIMI, True, "", KIMI, []),
    ("none", "kimi_k2", "", DEEPSEEK, True, "", DEEPSEEK, []),
]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _fed(case, bounds: list[int], parallel: bool = True):
    reasoning, tools, prompt, reply, complete = case[:5]
    parser = new_reply_parser(reasoning, tools, prompt, TOOLS, parallel)
    got = [parser.feed(reply[a:b]) for a, b in zip(bounds, bounds[1:])] + [parser.finish(complete)]
    return "".join(g[0] for g in got), "".join(g[1] for g in got), [c for g in got for c in g[2]]


@pytest.mark.parametrize("case", CASES)
def test_whole_replies_and_every_cut(case):
    reasoning, tools, prompt, reply, complete, want_reasoning, content, calls = case
    got_reasoning, got_content, got_calls = parse_reply(new_reply_parser(reasoning, tools, prompt, TOOLS), reply,
                                                        complete)
    assert (got_reasoning, got_content, _calls(got_calls)) == (want_reasoning, content, calls)
    assert len({c.id for c in got_calls}) == len(got_calls)
    for cut in range(len(reply) + 1):  # (one cut anywhere, and one character a piece)
        got = _fed(case, [0, cut, len(reply)])
        assert (got[0], got[1], _calls(got[2])) == (want_reasoning, content, calls), cut
    got = _fed(case, list(range(len(reply) + 1)))
    assert (got[0], got[1], _calls(got[2])) == (want_reasoning, content, calls)


@settings(max_examples=100, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=16))
def test_pieces_give_the_same_calls_and_content(case, cuts):
    reply = case[3]
    got = _fed(case, sorted({c % (len(reply) + 1) for c in cuts} | {0, len(reply)}))
    assert (got[0], got[1], _calls(got[2])) == (case[5], case[6], case[7])


def test_kimi_call_ids_are_the_headers_it_wrote():
    """A Kimi call's id is its header (``functions.NAME:IDX``), as Kimi's template writes a
    call back in the conversation; a header without the index gets a ``call_`` id."""
    _, _, calls = parse_reply(new_reply_parser("none", "kimi_k2", "", TOOLS), KIMI, True)
    assert [c.id for c in calls] == ["functions.get_weather:0", "functions.get_time:1"]
    _, _, calls = parse_reply(new_reply_parser("none", "kimi_k2"), _kimi(K_CALL.replace("functions.f:0", "f")), True)
    assert calls[0].name == "f" and calls[0].id.startswith("call_")
    _, _, calls = parse_reply(new_reply_parser("none", "deepseek_v31"), DEEPSEEK, True)
    assert all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("tools,reply", [("kimi_k2", KIMI), ("deepseek_v31", DEEPSEEK), ("deepseek_v31", DEEPSEEK_V3)])
def test_parallel_tool_calls_false_keeps_the_first_call(tools, reply):
    case = ("none", tools, "", reply, True)
    for bounds in ([0, len(reply)], list(range(len(reply) + 1))):
        _, _, calls = _fed(case, bounds, parallel=False)
        assert _calls(calls) == BOTH[:1]


def test_auto_picks_kimi_and_deepseek_by_their_templates_markers():
    kimi = ("{%- if m.tool_calls %}<|tool_calls_section_begin|>{%- for tc in m.tool_calls %}<|tool_call_begin|>"
            "{{ tc.id }}<|tool_call_argument_begin|>{{ tc.function.arguments | tojson }}<|tool_call_end|>")
    assert resolve_tool_parser("auto", "kimi_k25", kimi, "think") == "kimi_k2"
    deepseek = "{{ '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tc.function.name + '<｜tool▁sep｜>' }}"
    assert resolve_tool_parser("auto", "deepseek_v3", deepseek, "think") == "deepseek_v31"
    assert resolve_tool_parser("auto", "deepseek_v32", {"default": "x", "tool_use": deepseek}, "none") == "deepseek_v31"
    assert resolve_tool_parser("auto", "deepseek_v3", "<|tool▁calls▁begin|>", "none") == "none"  # (ASCII bars: not it)
    assert resolve_tool_parser("deepseek_v31", "qwen3", "<tool_call>", "none") == "deepseek_v31"


def test_serve_takes_the_new_parsers_by_name():
    from dflash_torch.cli import build_parser
    from dflash_torch.serving.tools import PARSERS

    for name in PARSERS:  # (the command's choices are the parsers')
        assert build_parser().parse_args(["serve", "--tool-call-parser", name]).tool_call_parser == name
    assert {"kimi_k2", "deepseek_v31"} <= set(PARSERS)


# --- a real server: a tiny model that writes Kimi's or DeepSeek's calls ----------------------------

KIMI_ASSISTANT = "<|im_assistant|>assistant<|im_middle|>"
# (each token once: the second call comes inside one plain added token)
KIMI_SCRIPT = ["Let me check.", "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.get_weather:0",
               "<|tool_call_argument_begin|>", '{"city": "Paris"}', "<|tool_call_end|>",
               "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>",
               "<|tool_calls_section_end|>"]
KIMI_TEMPLATE = (
    "{%- if tools %}<|im_system|>tool_declare<|im_middle|>{% for tool in tools %} {{ tool.function.name }}{% endfor %}"
    "<|im_end|>{% endif %}"
    "{%- for m in messages %}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content or '' }}"
    "{%- if m.tool_calls %}<|tool_calls_section_begin|>{% for tc in m.tool_calls %}<|tool_call_begin|>{{ tc.id }}"
    "<|tool_call_argument_begin|>{{ tc.function.arguments | tojson }}<|tool_call_end|>{% endfor %}"
    "<|tool_calls_section_end|>{% endif %}<|im_end|>{% endfor %}"
    "{%- if add_generation_prompt %}" + KIMI_ASSISTANT + "{% endif %}")
DEEPSEEK_ASSISTANT = "<｜Assistant｜>"
DEEPSEEK_SCRIPT = ["Sure.", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "get_weather", "<｜tool▁sep｜>",
                   '{"city": "Paris"}', "<｜tool▁call▁end｜>",
                   "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜>",
                   "<｜tool▁calls▁end｜>"]
DEEPSEEK_TEMPLATE = (
    "{%- if tools %}## Tools{% for tool in tools %} {{ tool.function.name }}{% endfor %}\n{% endif %}"
    "{%- for m in messages %}{{ '<｜User｜>' if m.role == 'user' else '<｜Assistant｜>' }}{{ m.content or '' }}"
    "{%- if m.tool_calls %}<｜tool▁calls▁begin｜>{% for tc in m.tool_calls %}{{ '<｜tool▁call▁begin｜>' + "
    "tc.function.name + '<｜tool▁sep｜>' }}{{ tc.function.arguments | tojson }}<｜tool▁call▁end｜>{% endfor %}"
    "<｜tool▁calls▁end｜>{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}" + DEEPSEEK_ASSISTANT + "{% endif %}")
FORMATS = {"kimi_k2": (KIMI_ASSISTANT, KIMI_SCRIPT, KIMI_TEMPLATE, "Let me check.",
                       ["functions.get_weather:0", "functions.get_time:1"]),
           "deepseek_v31": (DEEPSEEK_ASSISTANT, DEEPSEEK_SCRIPT, DEEPSEEK_TEMPLATE, "Sure.", None)}
MESSAGES = [{"role": "user", "content": "Weather in Paris, and the time?"}]
WANT_CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {})]


@pytest.mark.parametrize("kind", FORMATS)
def test_server_returns_kimi_and_deepseek_calls(kind, tmp_path_factory, tokenizer_dir):
    """--tool-call-parser auto picks the format from the template; the markers (special
    tokens) are kept for the parser when a request skips special tokens, so the content and
    calls are the same either way, whole and streamed; ``parallel_tool_calls`` false keeps
    the first call."""
    from test_server_scheduler import _serve
    from test_tools import make_scripted_pair

    assistant, script, template, content, ids = FORMATS[kind]
    root = tmp_path_factory.mktemp(kind)
    special = tuple(p for p in script if p.startswith("<") and p.endswith(">") and p.count("<") == 1)
    target, drafter, reply_ids = make_scripted_pair(root, tokenizer_dir, assistant, script, template, special=special)
    out = DFlashEngine.from_pretrained(target, drafter).generate(MESSAGES, tools=TOOLS, max_new_tokens=20)
    assert out.token_ids == reply_ids and out.text == "".join(script)
    with _serve((target, drafter), root) as server:
        assert f"tool call parser {kind}" in server.log.read_text()
        client = server.client()
        model = client.models.list().data[0].id
        for skip in (False, True):
            kw = dict(model=model, messages=MESSAGES, tools=TOOLS, temperature=0, extra_body={"skip_special_tokens": skip})
            choice = client.chat.completions.create(**kw).choices[0]
            assert (choice.finish_reason, choice.message.content) == ("tool_calls", content)
            calls = choice.message.tool_calls
            assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == WANT_CALLS
            assert [c.id for c in calls] == ids if ids else all(c.id.startswith("call_") for c in calls)
            text, streamed, finish = [], [], None
            for chunk in client.chat.completions.create(stream=True, **kw):
                if chunk.choices:
                    text.append(chunk.choices[0].delta.content or "")
                    streamed += chunk.choices[0].delta.tool_calls or []
                    finish = chunk.choices[0].finish_reason or finish
            assert ("".join(text), finish) == (content, "tool_calls")
            assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in streamed] == [
                (i, name, args) for i, (name, args) in enumerate(WANT_CALLS)]
        choice = client.chat.completions.create(parallel_tool_calls=False, **kw).choices[0]
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
        # cut by max_tokens inside the section: all text
        choice = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, temperature=0,
                                                max_tokens=4).choices[0]
        assert (choice.message.content, choice.message.tool_calls) == ("".join(script[:4]), None)


# --- forced calls: the grammar writes the calls as the templates above write them ------------------

GRAMMARS = {"kimi_k2": (kimi_k2_grammar, KIMI_TEMPLATE, KIMI_MARKERS, "<|im_end|>"),
            "deepseek_v31": (deepseek_v31_grammar, DEEPSEEK_TEMPLATE, DEEPSEEK_MARKERS, "")}


def _assistant(calls: list[tuple[str, dict]], ids: list[str] | None = None) -> dict:
    ids = ids or [f"functions.{name}:{i}" for i, (name, _) in enumerate(calls)]
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": id_, "type": "function", "function": {"name": name, "arguments": args}}
        for id_, (name, args) in zip(ids, calls)]}


def _written(tok, kind: str, calls: list[tuple[str, dict]], tools: list[dict] = TOOLS, ids=None) -> str:
    """The text the template writes for an assistant turn of ``calls`` (after the prompt; Kimi's
    ``<|im_end|>`` left out)."""
    _, template, _, end = GRAMMARS[kind]
    prompt = tok.apply_chat_template(MESSAGES, chat_template=template, tools=tools, tokenize=False,
                                     add_generation_prompt=True)
    rendered = tok.apply_chat_template(MESSAGES + [_assistant(calls, ids)], chat_template=template, tools=tools,
                                       tokenize=False)
    assert rendered.startswith(prompt) and rendered.endswith(end), rendered
    return rendered[len(prompt):len(rendered) - len(end)]


@pytest.mark.parametrize("kind", GRAMMARS)
def test_grammar_takes_what_the_template_writes_and_the_parser_reads(kind, tokenizer_dir):
    from llguidance import LLMatcher
    from transformers import AutoTokenizer

    from conftest import EOS_ID
    from dflash_torch.structured import GrammarCompiler

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    llg = GrammarCompiler(tok, len(tok), [EOS_ID]).tokenizer()

    def accepts(grammar: str, text: str) -> bool:
        m = LLMatcher(llg, LLMatcher.grammar_from_lark(grammar))
        return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()

    grammar = GRAMMARS[kind][0]
    good = [("get_weather", {"city": "Oslo <|tool_call_end|>", "days": 2, "metric": False, "hours": [1, "a"],
                             "ratio": None}), ("get_time", {}), ("get_weather", {"city": "Paris", "ratio": 2.5})]
    for calls in [[c] for c in good] + [good]:
        text = _written(tok, kind, calls)
        assert accepts(grammar(TOOLS), text), text
        _, content, parsed = parse_reply(new_reply_parser("none", kind, tools=TOOLS), text, True)
        assert content == "" and _calls(parsed) == calls
    one, two = _written(tok, kind, good[:1]), _written(tok, kind, good[:2])
    assert not accepts(grammar(TOOLS, parallel=False), two) and accepts(grammar(TOOLS, parallel=False), one)
    assert not accepts(grammar(TOOLS, "get_time"), one) and accepts(grammar(TOOLS, "get_weather"), one)
    for bad in ([("get_weather", {"days": 2})], [("get_weather", {"city": "x", "days": 1.5})], [("nope", {})]):
        assert not accepts(grammar(TOOLS), _written(tok, kind, bad)), bad
    assert not accepts(grammar(TOOLS), "Sure. " + one)
    assert accepts(grammar(TOOLS, reasoning="opened"), "first</think>" + one)
    if kind == "kimi_k2":  # (the index: the model's own number, as written)
        assert accepts(grammar(TOOLS), _written(tok, kind, good[:1], ids=["functions.get_weather:12"]))
        assert not accepts(grammar(TOOLS), _written(tok, kind, good[:1], ids=["functions.get_weather:x"]))
    with pytest.raises(DFlashError, match="cannot be written as a .* call"):
        grammar([{"type": "function", "function": {"name": "get weather"}}])


# bounded values (an enum, a small integer): a random model's forced call ends
FORCED_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "days"],
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "metric": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("kind", GRAMMARS)
def test_forced_calls_are_written_as_the_template_writes_them(kind, tmp_path):
    """A server of a tiny random model with the template above (--tool-call-parser auto),
    its markers special tokens: tool_choice a named function / required (one call: a random
    model would call on and on) gives the call of target-only decoding with the grammar (which
    takes the markers as tokens), and the template renders that call back (Kimi: with the id
    the server returned) as the very text the model wrote."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from conftest import VOCAB, make_target
    from test_server_scheduler import _serve

    grammar, template, markers, _ = GRAMMARS[kind]
    target = make_target(tmp_path / "target", "qwen3", vocab_size=VOCAB + len(markers))
    tok = AutoTokenizer.from_pretrained(str(target))
    tok.add_tokens([AddedToken(m, special=True, normalized=False) for m in markers])
    assert all(len(tok.encode(m, add_special_tokens=False)) == 1 for m in markers)
    tok.chat_template = template
    tok.save_pretrained(str(target))
    engine = DFlashEngine.from_pretrained(target, no_draft=True)
    ids = tuple(tok.convert_tokens_to_ids(m) for m in markers)
    with _serve((target, None), tmp_path, "--no-draft") as server:
        client = server.client()
        model = client.models.list().data[0].id
        for tool_choice, name in [({"type": "function", "function": {"name": "get_weather"}}, "get_weather"),
                                  ("required", None)]:
            forced = grammar(FORCED_TOOLS, name, parallel=False, call_tokens=ids)
            want = engine.generate(MESSAGES, chat=True, tools=FORCED_TOOLS, max_new_tokens=200,
                                   structured_output={"grammar": forced}, skip_special_tokens=False)
            assert want.finish_reason == "stop" and want.text.startswith(markers[0]), want.text
            r = client.chat.completions.create(model=model, messages=MESSAGES, tools=FORCED_TOOLS,
                                               tool_choice=tool_choice, parallel_tool_calls=False, temperature=0,
                                               max_tokens=200).choices[0]
            assert r.finish_reason == "tool_calls" and r.message.content is None, r
            calls = [(c.function.name, json.loads(c.function.arguments)) for c in r.message.tool_calls]
            assert len(calls) == 1 and name in (None, calls[0][0])
            written = _written(tok, kind, calls, FORCED_TOOLS, [c.id for c in r.message.tool_calls])
            assert written == want.text, (written, want.text)
