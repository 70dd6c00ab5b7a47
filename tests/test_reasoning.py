"""Splitting a reasoning model's reply into ``reasoning_content`` and ``content``
(dflash_torch/serving/reasoning.py): the ``think``, ``gemma4`` and ``harmony`` formats on whole
replies, and the same parts however the reply is cut into streamed pieces."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_torch.serving.reasoning import HarmonyParser, ThinkParser, new_parser, resolve_parser, split

HARMONY = ("<|channel|>analysis<|message|>We need 2+2. That is 4.<|end|><|start|>assistant"
           "<|channel|>final<|message|>The answer is **4**.")

CASES = [  # (parser kind, prompt tail, reply, reasoning, answer)
    ("think", "", "<think>\nadd them\n</think>\n\n4", "\nadd them\n", "\n\n4"),
    ("think", "", "\n<think>a</think>b", "a", "b"),
    ("think", "", "no thinking here, 2 < 3 </think> stays", "", "no thinking here, 2 < 3 </think> stays"),
    ("think", "", "<think>cut while thinking", "cut while thinking", ""),
    ("think", "", "<thi", "", "<thi"),
    ("think", "", "", "", ""),
    ("think", "<|im_start|>assistant\n<think>\n", "opened by the template</think>answer", "opened by the template", "answer"),
    ("think", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "plain answer", "", "plain answer"),
    ("think", "assistant\n<think>\n", "<think>\nopened twice</think>answer", "\nopened twice", "answer"),
    ("think", "assistant\n<think>\n", "\n<thinking aloud", "\n<thinking aloud", ""),
    ("think", "assistant\n<think>\n", "\n<thi", "\n<thi", ""),
    # Gemma 4: the thought channel, its name line dropped; with thinking off, an empty one
    ("gemma4", "", "<|channel>thought\nAdd them: 4.<channel|>The answer is 4.", "Add them: 4.", "The answer is 4."),
    ("gemma4", "", "<|channel>thought\n<channel|>Hello.", "", "Hello."),
    ("gemma4", "", "<|channel>thought\ncut while thinking", "cut while thinking", ""),
    ("gemma4", "", "<|channel>though", "", ""),  # (cut inside the name line: nothing to show)
    ("gemma4", "", "no channel: a <channel|> b", "", "no channel: a <channel|> b"),
    ("gemma4", "<|turn>model\n<|channel>", "thought\nopened by the prompt<channel|>x", "opened by the prompt", "x"),
    ("gemma4", "<|turn>model\n<|channel>thought\n", "forced thinking<channel|>x", "forced thinking", "x"),
    ("gemma4", "<|turn>model\n<|channel>thought\n<channel|>", "thinking off: all answer", "", "thinking off: all answer"),
    ("harmony", "", HARMONY, "We need 2+2. That is 4.", "The answer is **4**."),
    ("harmony", "", "<|channel|>final<|message|>only an answer", "", "only an answer"),
    ("harmony", "", "<|channel|>analysis<|message|>cut while thinking", "cut while thinking", ""),
    ("harmony", "", "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": 1}<|call|>", "",
     '{"a": 1}'),
    ("harmony", "", "no markers at all: a < b", "", "no markers at all: a < b"),
    ("harmony", "", "<|channel|>analysis<|message|>F#: f <| x<|end|><|start|>assistant<|channel|>final<|message|>y <|",
     "F#: f <| x", "y <|"),
    ("harmony", "", "<|channel|>analysis<|message|>r<|end|>stray<|start|>assistant<|message|>no channel", "r",
     "strayno channel"),
    ("harmony", "", "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>analysis<|message|>y<|end|>"
                    "<|start|>assistant<|channel|>final<|message|>z", "xy", "z"),
]


@pytest.mark.parametrize("kind,prompt,reply,reasoning,answer", CASES)
def test_whole_replies(kind, prompt, reply, reasoning, answer):
    assert split(new_parser(kind, prompt), reply) == (reasoning, answer)


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_streamed_pieces_give_the_same_parts(case, cuts):
    kind, prompt, reply, reasoning, answer = case
    bounds = sorted({c % (len(reply) + 1) for c in cuts} | {0, len(reply)})
    parser = new_parser(kind, prompt)
    got_r, got_a = [], []
    for a, b in zip(bounds, bounds[1:]):
        r, t = parser.feed(reply[a:b])
        got_r.append(r)
        got_a.append(t)
    r, t = parser.finish()
    assert ("".join(got_r) + r, "".join(got_a) + t) == (reasoning, answer)


def test_markers_are_held_back_only_while_they_may_still_complete():
    p = HarmonyParser()
    assert p.feed("<|channel|>final<|message|>Hi <|") == ("", "Hi ")  # "<|" may start a marker
    assert p.feed("there") == ("", "<|there")
    t = ThinkParser()
    assert t.feed("<think>abc</th") == ("abc", "")
    assert t.feed("ink>done") == ("", "done")


def test_auto_picks_the_format_by_model_and_template():
    assert resolve_parser("auto", "gpt_oss", None) == "harmony"
    assert resolve_parser("auto", "qwen3", "{% if x %}<think>\n\n</think>{% endif %}") == "think"
    assert resolve_parser("auto", "qwen3", "# {{ m.content }}") == "none"
    named = {"default": "{% if x %}<think>\n\n</think>{% endif %}", "tool_use": "# {{ m.content }}"}  # several templates
    assert resolve_parser("auto", "qwen3", named) == "think"
    assert resolve_parser("none", "gpt_oss", None) == "none" and new_parser("none") is None
    gemma = "{%- if enable_thinking %}<|think|>{% endif %}<|turn>model\n{{ '<|channel>thought\n<channel|>' }}"
    assert resolve_parser("auto", "gemma4_text", gemma) == "gemma4"
    assert resolve_parser("auto", "gpt_oss", "<|channel|>") == "harmony"  # (harmony's <|channel|> is another marker)
    assert resolve_parser("auto", "qwen3", "<|channel|>analysis") == "none"


# --- a real server, a real model that writes "</think>" -------------------------------------------

THINKING_TEMPLATE = ("{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}# assistant:\n<think>\n{% endif %}")


def make_thinking_pair(root, template: str, special: bool = False):
    """An agreeable pair (under ``root``) whose target often writes the added token
    ``</think>`` (a special token with ``special``), with the chat ``template``."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from conftest import make_agreeable_pair, make_tokenizer

    tok_dir = root / "tokenizer"
    make_tokenizer(tok_dir, vocab_size=318)  # room for one added token in the targets' 320
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    tok.add_tokens([AddedToken("</think>", special=special)])
    tok.chat_template = template
    tok.save_pretrained(str(tok_dir))
    return make_agreeable_pair(root / "pair", tok_dir, agree_token=tok.convert_tokens_to_ids("</think>"), beta=1.0)


@pytest.fixture(scope="module")
def thinking_pair(tmp_path_factory):
    """:func:`make_thinking_pair` with a chat template that opens ``<think>`` itself (as
    Qwen3.5-style templates do)."""
    return make_thinking_pair(tmp_path_factory.mktemp("thinking"), THINKING_TEMPLATE)


def test_server_splits_reasoning_from_content_streamed_and_not(thinking_pair, tmp_path_factory):
    from dflash_torch import DFlashEngine
    from test_server_scheduler import _serve

    logdir = tmp_path_factory.mktemp("reasoning-server")
    messages = [{"role": "user", "content": "def f(x):"}]
    engine = DFlashEngine.from_pretrained(*thinking_pair)
    raw = engine.generate(messages, max_new_tokens=40, ignore_eos=True).text
    assert 0 < raw.index("</think>") < raw.rindex("</think>")  # thinks, answers (a later </think> is answer)
    reasoning, answer = raw.split("</think>", 1)
    with _serve(thinking_pair, logdir) as server:  # --reasoning-parser auto: the template mentions <think>
        client = server.client()
        model = client.models.list().data[0].id
        kw = dict(model=model, messages=messages, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
        r = client.chat.completions.create(**kw)
        msg = r.choices[0].message
        assert (msg.reasoning_content, msg.content) == (reasoning, answer)
        # the reasoning's tokens (its text encoded again, as /v1/responses counts them), in OpenAI's usage field
        thought = len(engine.tokenizer.encode(reasoning, add_special_tokens=False))
        assert r.usage.completion_tokens_details.reasoning_tokens == thought > 0
        two = client.chat.completions.create(**kw, n=2)  # (every choice's)
        assert two.usage.completion_tokens_details.reasoning_tokens == 2 * thought
        parts = {"reasoning_content": [], "content": []}
        usages = []
        for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
            usages.append(chunk.usage)
            delta = chunk.choices[0].delta if chunk.choices else None
            for key in parts:
                if delta is not None and getattr(delta, key, None):
                    parts[key].append(getattr(delta, key))
        assert ("".join(parts["reasoning_content"]), "".join(parts["content"])) == (reasoning, answer)
        assert usages[-1].completion_tokens_details.reasoning_tokens == thought and usages[-1].completion_tokens == 40
        # a reply cut inside its reasoning has no answer: content null, as vLLM's and as streamed (it was "")
        first = engine.generate(messages, max_new_tokens=1, ignore_eos=True).text
        assert first and "</think>" not in first
        msg = client.chat.completions.create(**{**kw, "max_tokens": 1}).choices[0].message
        assert (msg.reasoning_content, msg.content) == (first, None)
        # a reply of whitespace: held back while a <think> the model writes again may follow, so a stream with
        # logprobs sends them alone; while the reply thinks no piece claims content (they came as content "")
        space = engine.tokenizer.encode(" ", add_special_tokens=False)
        spaces = {**kw, "max_tokens": 5, "logit_bias": {str(space[0]): 100}}
        msg = client.chat.completions.create(**spaces).choices[0].message
        assert (msg.reasoning_content, msg.content) == (" " * 5, None)
        pieces = [c.choices[0] for c in client.chat.completions.create(stream=True, logprobs=True, **spaces)
                  if c.choices]
        assert pieces[0].delta.content == "" and [p.delta.content for p in pieces[1:]] == [None] * (len(pieces) - 1)
        reasoned = [getattr(p.delta, "reasoning_content", None) for p in pieces]
        assert all(t is not None for t, p in zip(reasoned, pieces) if p.logprobs)  # ("" where held back)
        assert "".join(t or "" for t in reasoned) == " " * 5
        assert sum(len(p.logprobs.content) for p in pieces if p.logprobs) == 5
        # a stop string that ends the reply before its reasoning wrote anything: it ended while thinking, so no
        # answer (content null, not ""), and an empty reasoning; streamed alike (no text after the role's piece)
        stopped = {**kw, "stop": [raw[:3]]}
        choice = client.chat.completions.create(**stopped).choices[0]
        assert (choice.message.reasoning_content, choice.message.content, choice.finish_reason) == ("", None, "stop")
        pieces = [c.choices[0] for c in client.chat.completions.create(stream=True, **stopped) if c.choices]
        assert [(p.delta.content, getattr(p.delta, "reasoning_content", None)) for p in pieces] == [("", None),
                                                                                                     (None, None)]
        assert pieces[-1].finish_reason == "stop"
        # completions are not chat replies: raw text
        text = client.completions.create(model=model, prompt=engine.decode(engine.encode_prompt(messages)),
                                         max_tokens=40, temperature=0, extra_body={"ignore_eos": True}).choices[0].text
        assert text == raw
    with _serve(thinking_pair, logdir, "--reasoning-parser", "none") as server:
        client = server.client()
        r = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, max_tokens=40,
                                           temperature=0, extra_body={"ignore_eos": True})
        msg = r.choices[0].message
        assert msg.content == raw and getattr(msg, "reasoning_content", None) is None
        assert r.usage.completion_tokens_details.reasoning_tokens == 0  # (no reasoning split off)


def test_skip_special_tokens_keeps_the_markers_a_reply_parser_reads(tmp_path_factory):
    """A tokenizer whose ``</think>`` is a special token: a chat with skip_special_tokens
    still splits its reasoning (the parser's markers are kept), a completion drops it."""
    from dflash_torch import DFlashEngine
    from test_server_scheduler import _serve

    root = tmp_path_factory.mktemp("special-think")
    pair = make_thinking_pair(root, THINKING_TEMPLATE, special=True)
    engine = DFlashEngine.from_pretrained(*pair)
    close = engine.tokenizer.convert_tokens_to_ids("</think>")
    assert close in engine.special_token_ids
    messages = [{"role": "user", "content": "def f(x):"}]
    raw = engine.generate(messages, max_new_tokens=40, ignore_eos=True).text
    reasoning, answer = raw.split("</think>", 1)
    with _serve(pair, tmp_path_factory.mktemp("special-think-logs")) as server:
        client = server.client()
        model = client.models.list().data[0].id
        for skip in (False, True):
            msg = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0,
                                                 extra_body={"ignore_eos": True, "skip_special_tokens": skip})
            assert (msg.choices[0].message.reasoning_content, msg.choices[0].message.content) == (reasoning, answer)
        prompt = engine.decode(engine.encode_prompt(messages))
        text = client.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0,
                                         extra_body={"ignore_eos": True, "skip_special_tokens": True}).choices[0].text
        assert text == raw.replace("</think>", "")
        # a last message that opened its thinking (continue_final_message): the reply goes on as reasoning
        started = [*messages, {"role": "assistant", "content": "<think>\nI"}]
        opts = {"add_generation_prompt": False, "continue_final_message": True}
        ids = engine.encode_prompt(started, **opts)
        assert engine.decode(ids).endswith("<think>\nI")
        go_on = engine.generate(ids, max_new_tokens=40, ignore_eos=True).text
        assert "</think>" in go_on
        msg = client.chat.completions.create(model=model, messages=started, max_tokens=40, temperature=0,
                                             extra_body={"ignore_eos": True, **opts}).choices[0].message
        assert (msg.reasoning_content, msg.content) == tuple(go_on.split("</think>", 1))


T, A, U = "thinking", "answering", None  # (U: not known yet, e.g. text that may still become <think>)


@pytest.mark.parametrize("kind,prompt,reply,where", [
    ("think", "", "<think>abc", T), ("think", "", "<think>abc</think>", A), ("think", "", "abc", A),
    ("think", "", "", U), ("think", "", " \n<thi", U), ("think", "", "<think>", T),
    ("think", "assistant\n<think>\n", "", T), ("think", "assistant\n<think>\n", "\r\r", T),
    ("think", "assistant\n<think>\n", "x</think>", A),
    ("gemma4", "", "<|channel>thought\nabc", T), ("gemma4", "", "<|channel>thought\nabc<channel|>", A),
    ("harmony", "", "<|channel|>analysis<|message|>abc", T),
    ("harmony", "", "<|channel|>analysis<|message|>abc<|end|>", A),
    ("harmony", "", "<|channel|>final<|message|>abc", A), ("harmony", "", "<|channel|>analy", U),
    ("harmony", "", "<|channel|>final<|message|>a<|end|><|start|>assistant", U)])
def test_a_parser_says_whether_the_reply_is_still_thinking(kind, prompt, reply, where):
    """(A Responses reasoning item cut by the token limit is incomplete only while thinking; a
    streamed piece whose text is held back goes under the part the reply is in, trial-305 a.)"""
    from dflash_torch.serving.tools import new_reply_parser

    parser = new_parser(kind, prompt)
    parser.feed(reply)
    assert (parser.thinking, parser.answering) == (where == T, where == A)
    parser.finish()
    assert parser.thinking is (where == T)
    reply_parser = new_reply_parser(kind, "harmony" if kind == "harmony" else "none", prompt)
    for piece in reply:
        reply_parser.feed(piece)
    assert (reply_parser.thinking, reply_parser.answering) == (where == T, where == A)
    reply_parser.finish(False)
    assert reply_parser.thinking is (where == T)
    assert new_reply_parser("none", "hermes").answering  # (no reasoning parser: all answer)
