"""Structured outputs after a reasoning the chat template opened (``<think>\\n`` at the end of
the generation prompt, as Qwen3 / Qwen3.5 thinking mode): the constraint applies after
``</think>`` (:mod:`dflash_torch.serving.constraints`), so ``content`` is the constrained
output and ``reasoning_content`` the thinking; and vLLM's JSON whitespace patterns.

Two targets: a copy of the shipped target whose template opens ``<think>`` (its tokenizer
spells ``</think>`` in four tokens: the text form), and a small agreeable pair whose target
writes ``</think>`` often, as one added token (which llguidance takes for a special token,
as Qwen3's own ``</think>``). Oracles: llguidance matchers (what each grammar accepts);
the constraint's own check on ``content`` (a JSON parse and schema check, a regex
fullmatch, membership of the choices); greedy speculative == a ``--no-draft`` server's;
streamed == not; without a reasoning, the Python engine with the plain constraint."""

from __future__ import annotations

import json
import re
import shutil
from contextlib import ExitStack

import openai
import pytest
from llguidance import LLMatcher
from test_server import MODEL
from test_server_scheduler import _serve
from test_structured_server import (
    CHOICES,
    PERSON,
    REGEX,
    TOOLS,
    _calls,
    _schema_of,
    conforms,
)
from transformers import AutoTokenizer

from dflash_torch import DFlashEngine, DFlashError
from dflash_torch.engine import DEFAULT_TARGET
from dflash_torch.serving.constraints import (
    after_reasoning,
    think_tokens,
    with_whitespace,
)
from dflash_torch.structured import StructuredOutput

# opens <think> (Qwen3.5's thinking mode); with enable_thinking false writes an empty reasoning, closed (as
# Qwen3's templates do); with model_thinks neither (Qwen3's thinking mode: the model writes <think> itself)
THINKING = ("{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}"
            "# assistant:\n{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
            "{% elif not model_thinks %}<think>\n{% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "Who is it? Answer in JSON."}]
GRAMMAR = '%ignore /[ ]+/\nstart: "x" rest\nrest: "}" | "y" rest'  # (its own %ignore; a "}" inside)


@pytest.fixture(scope="module")
def shipped_thinking(tmp_path_factory):
    """The shipped target, its chat template's generation prompt ending with ``<think>\\n``."""
    target = tmp_path_factory.mktemp("shipped-thinking") / "target"
    shutil.copytree(DEFAULT_TARGET, target)
    template = (target / "chat_template.jinja").read_text()
    edited = template.replace("{{ '\\n' }}{% endif %}", "{{ '\\n<think>\\n' }}{% endif %}")
    assert edited != template
    (target / "chat_template.jinja").write_text(edited)
    return target


@pytest.fixture(scope="module")
def thinking_pair(tmp_path_factory):
    """An agreeable pair whose target often writes the added token ``</think>``
    (``test_reasoning.make_thinking_pair``); its template opens ``<think>`` unless
    ``enable_thinking`` is false."""
    from test_reasoning import make_thinking_pair

    return make_thinking_pair(tmp_path_factory.mktemp("thinking-structured"), THINKING)


# --- the grammars ------------------------------------------------------------------------------

ACCEPTS = [  # (constraint, outputs it allows, outputs it refuses)
    ({"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "description": "} {"}},
     ['{"a": 1}', '{"a":\n  2}'], ['{"b": 1}', '\n{"a": 1}', '{"a":' + " " * 65 + "1}"]),  # (at most 64)
    ({"json_object": True}, ['{"a": "x"}', "{}"], ["[1]", '"x"']),
    ({"regex": r"a/b\/c[/]+\d"}, ["a/b/c//1"], ["a/b/c1", "a\\/b/c/1"]),
    ({"choice": ['say "hi"', "a\\b", "x"]}, ['say "hi"', "a\\b", "x"], ["y", "say hi", "a"]),
    ({"grammar": GRAMMAR}, ["x }", "xyy}", "x y }"], ["x", "xq}"]),
]


@pytest.mark.parametrize("which", ["text", "token"])
def test_the_grammar_is_the_rest_of_the_reasoning_then_the_constraint(which, shipped_thinking, thinking_pair):
    """Text up to the first ``</think>`` (text, or the one added token), then exactly an output
    of the constraint (JSON with the engine's whitespace default), nothing before ``</think>``."""
    engine = DFlashEngine.from_pretrained(shipped_thinking if which == "text" else thinking_pair[0], no_draft=True)
    tokenizer = engine.grammars.tokenizer()
    tokens = think_tokens(engine.tokenizer, tokenizer)
    end = tokens[1]
    assert (end is None) == (which == "text")
    assert len(engine.tokenizer.encode("</think>", add_special_tokens=False)) == (4 if which == "text" else 1)

    def accepts(spec: StructuredOutput, text: str) -> bool:
        m = LLMatcher(tokenizer, engine.grammars.compile(spec).grammar, log_level=0)
        return all(m.consume_token(t) for t in engine.tokenizer.encode(text, add_special_tokens=False)) and \
            m.is_accepting()

    for spec, good, bad in ACCEPTS:
        plain = StructuredOutput.coerce(spec)
        wrapped = after_reasoning(plain, "opened", tokens)
        optional = after_reasoning(plain, "optional", tokens)  # (the reply may open a reasoning)
        for text in good:
            assert accepts(plain, text), (spec, text)
            assert accepts(wrapped, "a </thi nk> <think>\n</think>" + text), (spec, text)
            assert not accepts(wrapped, text) and not accepts(wrapped, "a</think>\n" + text), (spec, text)
            assert not accepts(wrapped, "a</think></think>" + text), (spec, text)  # (the first </think> ends it)
            assert accepts(optional, text) and accepts(optional, "<think>\na <think></think>" + text), (spec, text)
            assert not accepts(optional, "a</think>" + text) and not accepts(optional, "<think>a" + text), (spec, text)
            assert not accepts(optional, "<think>a</think></think>" + text), (spec, text)
        for text in bad:
            assert not accepts(plain, text) and not accepts(wrapped, "a</think>" + text), (spec, text)
            assert not accepts(optional, text) and not accepts(optional, "<think>a</think>" + text), (spec, text)
    # a whitespace pattern, and a schema's own x-guidance, hold after the reasoning too
    compact = with_whitespace(StructuredOutput(json_object=True), "[ ]?")
    for spec in (compact, after_reasoning(compact, "opened", tokens)):
        prefix = "" if spec is compact else "a</think>"
        assert accepts(spec, prefix + '{"a": 1}') and not accepts(spec, prefix + '{"a":  1}')
        assert not accepts(spec, prefix + '{"a":\n1}')
    own = after_reasoning(StructuredOutput(json={"type": "object", "x-guidance": {"whitespace_flexible": False}}),
                          "opened", tokens)
    assert accepts(own, 'a</think>{"a":1}') and not accepts(own, 'a</think>{"a": 1}')


# --- the server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(thinking_pair, tmp_path_factory):
    """(speculative, target-only) servers of the thinking pair (reasoning parser auto: think),
    writing hermes tool calls."""
    logdir = tmp_path_factory.mktemp("structured-reasoning")
    with ExitStack() as stack:
        hermes = ("--max-batch-size", "4", "--tool-call-parser", "hermes")
        spec = stack.enter_context(_serve(thinking_pair, logdir, *hermes))
        alone = stack.enter_context(_serve((thinking_pair[0], None), logdir, "--no-draft", *hermes))
        yield spec.client(), alone.client()


def _chat(client, **kw):
    return client.chat.completions.create(**{"model": MODEL, "messages": MESSAGES, "temperature": 0,
                                             "max_tokens": 600, **kw})


def _streamed(events) -> tuple[str, str, str]:
    """(reasoning_content, content, finish reason) of a streamed chat reply."""
    reasoning, content, finish = [], [], None
    for ev in events:
        for ch in ev.choices:
            reasoning.append(getattr(ch.delta, "reasoning_content", None) or "")
            content.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    return "".join(reasoning), "".join(content), finish


CASES = [  # (request fields, check of the content)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
     lambda t: conforms(json.loads(t), PERSON)),
    ({"response_format": {"type": "json_object"}, "guided_whitespace_pattern": "[ ]?"},  # (this model's JSON objects
     lambda t: isinstance(json.loads(t), dict) and not re.search(r"\s\s|[^\S ]", t)),  # end with less whitespace)
    ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
    ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
    ({"guided_grammar": GRAMMAR}, lambda t: re.fullmatch(r"x( *y)* *\}", t)),
    ({"guided_json": PERSON, "guided_whitespace_pattern": ""},  # (no whitespace at all)
     lambda t: conforms(json.loads(t), PERSON) and not re.search(r"\s", t)),
    # structured_outputs holding only options beside another field's constraint: they apply to it
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
      "structured_outputs": {"whitespace_pattern": ""}}, lambda t: conforms(json.loads(t), PERSON) and not re.search(r"\s", t)),
]


@pytest.mark.parametrize("body,ok", CASES, ids=[next(iter(c[0])) + str(i) for i, c in enumerate(CASES)])
def test_the_constraint_lands_in_content_after_the_reasoning(servers, body, ok):
    spec, alone = servers
    want = _chat(alone, extra_body=body).choices[0]
    msg = want.message
    assert want.finish_reason == "stop" and ok(msg.content), (body, msg)
    assert msg.reasoning_content and "</think>" not in msg.reasoning_content, msg
    got = _chat(spec, extra_body=body, n=2)  # (greedy: both choices are the target's)
    for choice in got.choices:
        assert (choice.message.reasoning_content, choice.message.content) == (msg.reasoning_content, msg.content)
        assert choice.finish_reason == "stop"
    assert _streamed(_chat(spec, extra_body=body, stream=True)) == (msg.reasoning_content, msg.content, "stop")


def test_forced_tool_calls_follow_the_reasoning_closed_by_its_token(servers, thinking_pair):
    """tool_choice a named function: the reasoning ends at the added ``</think>`` token (a
    special token to llguidance, named by id in the grammar), then the call; a stop string or
    id met in the reasoning does not end it there."""
    spec, alone = servers
    kw = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    want = _chat(alone, **kw).choices[0]
    assert want.finish_reason == "tool_calls" and want.message.reasoning_content, want
    calls = _calls(want.message.tool_calls)
    assert len(calls) == 1 and calls[0][0] == "get_weather" and conforms(calls[0][1], _schema_of("get_weather"))
    got = _chat(spec, **kw).choices[0]
    assert got.finish_reason == "tool_calls" and got.message.reasoning_content == want.message.reasoning_content
    assert _calls(got.message.tool_calls) == calls
    # a stop string the reasoning completes, the </think> token as a stop id: not applied in a forced reply,
    # which ends after its call (they ended it in the reasoning, with no call: trial-292), streamed and not
    close = AutoTokenizer.from_pretrained(str(thinking_pair[0])).convert_tokens_to_ids("</think>")
    stops = {"stop": [want.message.reasoning_content[-2:]], "extra_body": {"stop_token_ids": [close]}}
    for client in servers:
        got = _chat(client, **kw, **stops).choices[0]
        assert got.finish_reason == "tool_calls" and got.message.reasoning_content == want.message.reasoning_content
        assert _calls(got.message.tool_calls) == calls
    reasoning, content, finish = _streamed(_chat(spec, stream=True, **kw, **stops))
    assert (reasoning, content, finish) == (want.message.reasoning_content, "", "tool_calls")


def test_a_reply_may_open_its_reasoning_then_the_constraint(servers, thinking_pair):
    """The template neither opens nor closes a reasoning (Qwen3's thinking mode: the model
    writes ``<think>`` itself): the reply may think first, then the constraint applies (it
    applied from the first token, so such a model could not think). Speculative, target-only
    and Python with the grammar of :func:`after_reasoning` ``"optional"`` agree."""
    spec, alone = servers
    engine = DFlashEngine.from_pretrained(thinking_pair[0], no_draft=True)
    tokens = think_tokens(engine.tokenizer, engine.grammars.tokenizer())
    kwargs = {"model_thinks": True}
    assert not engine.decode(engine.encode_prompt(MESSAGES, chat_template_kwargs=kwargs)).rstrip().endswith("think>")
    for (body, ok), structured in ((CASES[0], {"json": PERSON}), (CASES[2], {"choice": CHOICES})):
        grammar = after_reasoning(StructuredOutput.coerce(structured), "optional", tokens).grammar
        raw = engine.generate(MESSAGES, chat=True, max_new_tokens=600, structured_output={"grammar": grammar},
                              chat_template_kwargs=kwargs).text
        assert raw.startswith("<think>") and "</think>" in raw, raw  # (this model thinks when it may)
        reasoning, content = raw[len("<think>"):].split("</think>", 1)
        for client in (spec, alone):
            msg = _chat(client, extra_body={**body, "chat_template_kwargs": kwargs}).choices[0].message
            assert (msg.reasoning_content, msg.content) == (reasoning, content) and ok(content), (body, msg)


def test_a_continued_answer_does_not_open_a_reasoning(servers, thinking_pair):
    """continue_final_message of an assistant answer (the template neither opened nor closed
    a reasoning): the constraint applies from the first token, as in Python; the model
    does not open a reasoning in the middle of the answer it continues."""
    spec, _ = servers
    engine = DFlashEngine.from_pretrained(thinking_pair[0], no_draft=True)
    messages = MESSAGES + [{"role": "assistant", "content": "Sure: "}]
    kwargs = {"model_thinks": True}
    ids = engine.encode_prompt(messages, add_generation_prompt=False, continue_final_message=True,
                               chat_template_kwargs=kwargs)
    want = engine.generate(ids, max_new_tokens=600, structured_output={"choice": CHOICES}).text
    msg = _chat(spec, messages=messages, extra_body={"guided_choice": CHOICES, "continue_final_message": True,
                                                     "add_generation_prompt": False, "chat_template_kwargs": kwargs})
    msg = msg.choices[0].message
    assert (msg.content, getattr(msg, "reasoning_content", None)) == (want, None)


def test_without_a_reasoning_nothing_changes(servers, thinking_pair):
    """The template closed the reasoning (``enable_thinking`` false), or the endpoint is
    completions: the constraint applies from the first token, as in Python."""
    spec, _ = servers
    engine = DFlashEngine.from_pretrained(thinking_pair[0], no_draft=True)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    for body, structured in ((CASES[0][0], {"json": PERSON}), ({"guided_choice": CHOICES}, {"choice": CHOICES})):
        want = engine.generate(MESSAGES, chat=True, max_new_tokens=600, structured_output=structured,
                               chat_template_kwargs={"enable_thinking": False}).text
        msg = _chat(spec, extra_body={**body, **off}).choices[0].message
        assert (msg.content, getattr(msg, "reasoning_content", None)) == (want, None)
        prompt = engine.decode(engine.encode_prompt(MESSAGES))
        assert prompt.endswith("<think>\n")  # (a completion's prompt may end so: it is text, not a chat reply)
        text = spec.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=600,
                                       extra_body=body).choices[0].text
        assert text == engine.generate(prompt, max_new_tokens=600, structured_output=structured).text


BAD = [  # (body, param, words of the message)
    ({"structured_outputs": {"structural_tag": {"x": 1}}}, "structured_outputs", "structural_tag is not supported"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "JSON constraint"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "has none"),
    ({"structured_outputs": {"choice": ["a"], "whitespace_pattern": " "}}, "structured_outputs",
     "structured_outputs.whitespace_pattern sets"),
    ({"guided_whitespace_pattern": " ", "structured_outputs": {"json": PERSON, "whitespace_pattern": " "}},
     "structured_outputs", "one JSON whitespace pattern"),
    ({"response_format": {"type": "json_object"}, "guided_whitespace_pattern": "(("}, "guided_whitespace_pattern",
     "'((' is not a valid whitespace pattern"),
    ({"structured_outputs": {"json": PERSON, "whitespace_pattern": "[a-"}}, "structured_outputs",
     "structured_outputs.whitespace_pattern '[a-' is not a valid whitespace pattern"),
    ({"guided_grammar": "start: nothing"}, "guided_grammar", "grammar is invalid"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs",
     "structured_outputs needs exactly one of json, regex, choice, grammar, json_object; got none"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs",  # (it said "got none", trial-233)
     "structured_outputs.json_object must be true (the output is any JSON object), got false, which asks for no "
     "constraint"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "got regex, choice"),
]


@pytest.mark.parametrize("body,param,words", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_requests_are_400s_naming_the_field(servers, body, param, words):
    spec, _ = servers
    with pytest.raises(openai.BadRequestError) as err:
        _chat(spec, max_tokens=8, extra_body=body)
    e = err.value.body
    assert e["param"] == param and words in e["message"] and "\n" not in e["message"], e


def test_the_text_of_an_added_non_special_token_is_refused_clearly(thinking_pair, servers):
    """``</think>`` here is an added token with special=False (as Qwen3's tokenizer has
    ``<think>`` and ``<tool_call>``), which llguidance's tokenizer takes as special all the
    same: it never matches its text as text. A constraint that forces that text failed on
    llguidance's raw parser error (``token "\\xff[318]" doesn't satisfy the grammar; forced
    bytes: got '<'; applying '\\xff'``: at the first token when compiled, else mid-decoding);
    now it fails with the message of the engine's special tokens, when compiled where the
    text comes first. A grammar naming the token still gets it. Python API (speculative and
    target-only) and server."""
    target, drafter = thinking_pair
    alone = DFlashEngine.from_pretrained(target, no_draft=True, dtype="float32")
    end = alone.tokenizer.convert_tokens_to_ids("</think>")
    assert end not in alone.special_token_ids and alone.grammars.tokenizer().is_special_token(end)
    assert end in alone.grammars.checked_ids()
    reason = (f"the constraint requires the text of the special token {end} ('</think>') here, which the tokenizer "
              "reads as that token, not as text: this output cannot be written")
    for engine in (DFlashEngine.from_pretrained(target, drafter, dtype="float32"), alone):
        for so in ({"regex": "</think>[a-z]{2}"}, {"choice": ["</think>"]}):
            with pytest.raises(DFlashError, match=f"^{re.escape(f'structured_output {next(iter(so))} cannot be used: {reason}')}$"):
                engine.generate("x = ", max_new_tokens=20, structured_output=so)
        with pytest.raises(DFlashError, match=f"^{re.escape(f'structured output failed: {reason}')}$"):
            engine.generate("x = ", max_new_tokens=20, structured_output={"json": {"const": "</think>"}})
        r = engine.generate("x = ", max_new_tokens=20, structured_output={"grammar": f'start: "ab" <[{end}]> "cd"'})
        assert (r.text, r.finish_reason) == ("ab</think>cd", "stop") and end in r.token_ids
    spec, _ = servers
    for body, param, words in (({"structured_outputs": {"regex": "</think>[a-z]{2}"}}, "structured_outputs",
                                f"structured_outputs regex cannot be used: {reason}"),
                               ({"guided_json": {"const": "</think>"}}, "guided_json", f"structured output failed: {reason}")):
        with pytest.raises(openai.BadRequestError) as err:
            spec.completions.create(model=MODEL, prompt="x = ", max_tokens=20, temperature=0, extra_body=body)
        e = err.value.body
        assert e["param"] == param and words in e["message"] and "\n" not in e["message"], e
