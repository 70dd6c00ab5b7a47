"""Extra chat template variables (``chat_template_kwargs``; the OpenAI ``reasoning_effort``):
Qwen3's ``enable_thinking``, gpt-oss's ``reasoning_effort``. transformers'
``apply_chat_template`` with the same variables is the oracle for the prompt; the
Python API, the CLI and a real server (``openai`` client) must all render it so."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
from transformers import AutoTokenizer

from dflash_torch import DFlashEngine, DFlashError
from test_server_scheduler import _serve

# a template with Qwen3's and gpt-oss's switches (the shapes of their real templates' tests)
TEMPLATE = ("{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}# assistant:"
            "{% if enable_thinking is defined and not enable_thinking %} <no-think>{% endif %}"
            "{% if reasoning_effort is defined %} effort={{ reasoning_effort }}{% endif %}\n{% endif %}")
MESSAGES = [{"role": "user", "content": "def f(x):"}]


@pytest.fixture(scope="module")
def switch_pair(tiny_pair, tmp_path_factory):
    """The tiny pair, its target's tokenizer given :data:`TEMPLATE`."""
    target, drafter = tiny_pair
    out = tmp_path_factory.mktemp("switch") / "target"
    shutil.copytree(target, out)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(out))
    return out, drafter


def _oracle(target_dir, **kwargs) -> list[int]:
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, **kwargs)
    return tok.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def engine(switch_pair):
    return DFlashEngine.from_pretrained(*switch_pair)


def test_the_template_gets_the_variables(switch_pair, engine):
    target_dir, _ = switch_pair
    plain = engine.encode_prompt(MESSAGES)
    assert plain == _oracle(target_dir)
    for kwargs in ({"enable_thinking": False}, {"reasoning_effort": "low"}, {"enable_thinking": True}):
        assert engine.encode_prompt(MESSAGES, chat_template_kwargs=kwargs) == _oracle(target_dir, **kwargs)
        assert engine.encode_prompt("def f(x):", chat=True, chat_template_kwargs=kwargs) == _oracle(target_dir, **kwargs)
    assert engine.encode_prompt(MESSAGES, chat_template_kwargs={"enable_thinking": False}) != plain
    ids = _oracle(target_dir, enable_thinking=False)
    want = engine.generate(ids, max_new_tokens=8, ignore_eos=True).token_ids
    assert engine.generate(MESSAGES, chat_template_kwargs={"enable_thinking": False}, max_new_tokens=8,
                           ignore_eos=True).token_ids == want
    assert "".join(c.text for c in engine.stream("def f(x):", chat=True, chat_template_kwargs={"enable_thinking": False},
                                                 max_new_tokens=8, ignore_eos=True)) == engine.decode(want)
    batch = engine.generate_batch([MESSAGES, "def f(x):"], chat=True, chat_template_kwargs={"enable_thinking": False},
                                  max_new_tokens=8, ignore_eos=True)
    assert [o.token_ids for o in batch] == [want, want]


@pytest.mark.parametrize("prompt,chat,kwargs,message", [
    (MESSAGES, False, ["enable_thinking"], r"chat_template_kwargs must be an object \(a dict\) with string keys"),
    (MESSAGES, False, {1: True}, "with string keys"),
    (MESSAGES, False, {"add_generation_prompt": False}, r"cannot set add_generation_prompt \(an argument of the chat"),
    (MESSAGES, False, {"messages": []}, "cannot set messages"),
    ("def f(x):", False, {"enable_thinking": False}, r"apply to chat prompts only"),
    ([5, 6, 7], True, {"enable_thinking": False}, r"apply to chat prompts only"),
])
def test_bad_variables_are_refused_in_one_line(engine, prompt, chat, kwargs, message):
    with pytest.raises(DFlashError, match=message) as err:
        engine.generate(prompt, chat=chat, chat_template_kwargs=kwargs, max_new_tokens=2)
    assert "\n" not in str(err.value)


def test_empty_chat_options_on_a_text_prompt_ask_nothing(engine):
    """chat_template_kwargs={} on a text prompt asks for nothing, as tools=[] does: the text
    decodes as without it (it was refused as if it set variables; wrappers pass {} by default)."""
    want = engine.generate("def f(x):", max_new_tokens=4).token_ids
    assert engine.generate("def f(x):", chat_template_kwargs={}, tools=[], max_new_tokens=4).token_ids == want


def test_a_variable_that_breaks_the_template_is_a_one_line_error(engine, monkeypatch):
    monkeypatch.setattr(engine.tokenizer, "chat_template", "{{ raise_exception('no') if x }}{{ messages[0]['content'] }}")
    # (named alone: the messages render without them; trial-126: "these messages or chat_template_kwargs")
    with pytest.raises(DFlashError, match="^the chat template cannot render these chat_template_kwargs: ") as err:
        engine.encode_prompt(MESSAGES, chat_template_kwargs={"x": True, "raise_exception": 3})
    assert err.value.names == ("chat_template_kwargs",)


def test_cli(switch_pair, engine, capsys):
    from dflash_torch.cli import main as cli_main

    target_dir, drafter_dir = switch_pair
    base = ["generate", "--target", str(target_dir), "--draft", str(drafter_dir), "--max-new-tokens", "8", "--ignore-eos",
            "--json"]
    assert cli_main(base + ["--chat", "--chat-template-kwargs", '{"enable_thinking": false}', "def f(x):"]) == 0
    want = engine.generate(MESSAGES, chat_template_kwargs={"enable_thinking": False}, max_new_tokens=8, ignore_eos=True)
    assert json.loads(capsys.readouterr().out)["token_ids"] == want.token_ids
    assert cli_main(base + ["--chat-template-kwargs", '{"enable_thinking": false}', "def f(x):"]) == 2
    assert capsys.readouterr().err.strip() == (
        "dflash-torch: error: --chat-template-kwargs apply to chat prompts only: add --chat")


@pytest.fixture(scope="module")
def server(switch_pair, tmp_path_factory):
    """A server whose default variables turn thinking off."""
    with _serve(switch_pair, tmp_path_factory.mktemp("switch-server"),
                "--chat-template-kwargs", '{"enable_thinking": false}') as srv:
        yield srv


def test_server_defaults_request_variables_and_reasoning_effort(server, switch_pair):
    target_dir, _ = switch_pair
    client = server.client()
    model = client.models.list().data[0].id

    def prompt_tokens(**kw) -> int:
        r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, **kw)
        return r.usage.prompt_tokens

    assert prompt_tokens() == len(_oracle(target_dir, enable_thinking=False))  # the server's default
    assert prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": True}}) == len(
        _oracle(target_dir, enable_thinking=True))
    assert prompt_tokens(reasoning_effort="high") == len(_oracle(target_dir, enable_thinking=False,
                                                                 reasoning_effort="high"))
    # OpenAI's other efforts: minimal / xhigh as low / high (the values gpt-oss's template knows)
    assert prompt_tokens(reasoning_effort="minimal") == len(_oracle(target_dir, enable_thinking=False,
                                                                    reasoning_effort="low"))
    assert prompt_tokens(reasoning_effort="xhigh") == len(_oracle(target_dir, enable_thinking=False,
                                                                  reasoning_effort="high"))
    assert prompt_tokens(reasoning_effort="none", extra_body={"chat_template_kwargs": {"enable_thinking": True}}) == len(
        _oracle(target_dir, enable_thinking=True, reasoning_effort="low"))  # (the request's own variable wins)
    assert len(_oracle(target_dir, enable_thinking=False)) != len(_oracle(target_dir, enable_thinking=True))
    for body, param in (({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
                        ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
                        ({"reasoning_effort": "extreme"}, "reasoning_effort")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, extra_body=body)
        assert err.value.body["param"] == param, err.value.body


def test_reasoning_effort_none_turns_thinking_off_over_the_server_default():
    from dflash_torch.serving.protocol import ChatCompletionRequest

    def variables(**kw):
        return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **kw).template_kwargs(
            {"enable_thinking": True})

    assert variables(reasoning_effort="none") == {"enable_thinking": False, "reasoning_effort": "low"}
    assert variables(reasoning_effort="minimal") == {"enable_thinking": True, "reasoning_effort": "low"}
    assert variables(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == {
        "enable_thinking": True, "reasoning_effort": "low"}
    assert variables() == {"enable_thinking": True}


def test_bench_chat_prompts_with_variables(switch_pair, tmp_path, capsys):
    from dflash_torch.cli import main as cli_main

    target_dir, drafter_dir = switch_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": MESSAGES[0]["content"]}) + "\n")
    base = ["bench", "--target", str(target_dir), "--draft", str(drafter_dir), "--prompts", str(prompts)]
    assert cli_main(base + ["--max-new-tokens", "4", "--modes", "target-only,inject", "--sweep", "", "--out",
                            str(tmp_path / "out"), "--no-progress", "--chat",
                            "--chat-template-kwargs", '{"enable_thinking": false}']) == 0
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert report["prompt_tokens"] == [len(_oracle(target_dir, enable_thinking=False))]
    assert report["chat"] is True and report["chat_template_kwargs"] == {"enable_thinking": False}
    assert report["mxfp4"] is None
    # ({"messages"} prompts are chats without --chat: the same tokens; a template's refusal names the prompt)
    prompts.write_text(json.dumps({"prompt": "x"}) + "\n" + json.dumps({"messages": MESSAGES}) + "\n")
    assert cli_main(base + ["--max-new-tokens", "4", "--modes", "target-only", "--sweep", "", "--out",
                            str(tmp_path / "out"), "--no-progress",
                            "--chat-template-kwargs", '{"enable_thinking": false}']) == 0
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert report["prompt_tokens"][1] == len(_oracle(target_dir, enable_thinking=False)), report["prompt_tokens"]
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": 5}]}) + "\n")
    capsys.readouterr()
    assert cli_main(base + ["--out", str(tmp_path / "bad")]) == 2
    assert capsys.readouterr().err.startswith("dflash-torch: error: prompt 1: chat message 0 has a content of type int")
    prompts.write_text(json.dumps({"prompt": MESSAGES[0]["content"]}) + "\n")
    assert cli_main(base + ["--chat-template-kwargs", '{"enable_thinking": false}', "--out", str(tmp_path / "bad")]) == 2
    assert "--chat-template-kwargs apply to chat prompts only: add --chat" in capsys.readouterr().err
    # (a variable of the template call itself: the flag's fault, named as the flag, not prompt 1's, as generate says)
    rc = cli_main(base + ["--chat", "--chat-template-kwargs", '{"add_generation_prompt": false}', "--out",
                          str(tmp_path / "bad")])
    assert (rc, capsys.readouterr().err) == (2, "dflash-torch: error: --chat-template-kwargs cannot set "
                                                "add_generation_prompt (an argument of the chat template call itself)\n")
