"""Log-probabilities through the OpenAI-compatible server: a real ``dflash-torch serve``
subprocess (batched slots) and the real ``openai`` client.

Chat: ``logprobs: true`` + ``top_logprobs`` -> ``choices[i].logprobs.content``; legacy
completions: ``logprobs: k`` -> ``{tokens, token_logprobs, top_logprobs, text_offset}``;
streamed, each chunk carries its tokens'. The reference is the same pair in-process
(``DFlashEngine.generate(..., logprobs=k)``, whose values tests/test_logprobs.py checks
against transformers' scoring of the sequence)."""

from __future__ import annotations

import pytest
from test_server import MODEL, PROMPT, _assert_openai_error
from test_server_scheduler import _serve

from dflash_torch import DFlashEngine
from dflash_torch.serving.scheduler import choice_seed

ATOL = 1e-4
MESSAGES = [{"role": "user", "content": "def f(x):"}]


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    with _serve(tiny_pair, tmp_path_factory.mktemp("logprobs")) as srv:
        yield srv


@pytest.fixture(scope="module")
def engine(tiny_pair):
    """The server's pair in this process: the reference."""
    return DFlashEngine.from_pretrained(*tiny_pair)


def _text(engine, token_id: int) -> str:
    """A token's string in logprobs: its bytes as UTF-8, invalid bytes escaped as \\xNN."""
    return engine.token_bytes(token_id).decode("utf-8", errors="backslashreplace")


def _check_completion_logprobs(engine, lp, ref, k: int) -> None:
    """A legacy ``logprobs`` object (dict) against the reference result's TokenLogprob s
    (and text: each whole-character token's text is at its ``text_offset``)."""
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert lp["tokens"] == [_text(engine, e.token_id) for e in ref.logprobs]
    assert lp["token_logprobs"] == pytest.approx([e.logprob for e in ref.logprobs], abs=ATOL)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    for token, offset, e in zip(lp["tokens"], lp["text_offset"], ref.logprobs):
        if offset + len(token) <= len(ref.text) and "\\x" not in token:
            assert ref.text[offset:offset + len(token)] == token, (offset, token)
    for top, e, token in zip(lp["top_logprobs"], ref.logprobs, lp["tokens"]):
        want = {_text(engine, t): v for t, v in e.top}
        want.setdefault(token, e.logprob)  # (the chosen token is always there: up to k + 1 entries)
        assert top == pytest.approx(want, abs=ATOL) and k <= len(top) <= k + 1


def _check_chat_logprobs(engine, content, ref, k: int) -> None:
    """A chat ``logprobs.content`` list (dicts) against the reference result's TokenLogprob s."""
    assert len(content) == len(ref.logprobs)
    for item, e in zip(content, ref.logprobs):
        text = _text(engine, e.token_id)
        assert item["token"] == text and item["bytes"] == list(engine.token_bytes(e.token_id))
        assert item["logprob"] == pytest.approx(e.logprob, abs=ATOL)
        assert [t["token"] for t in item["top_logprobs"]] == [_text(engine, t) for t, _ in e.top] and len(e.top) == k
        assert [t["logprob"] for t in item["top_logprobs"]] == pytest.approx([v for _, v in e.top], abs=ATOL)
        assert [t["bytes"] for t in item["top_logprobs"]] == [list(engine.token_bytes(t)) for t, _ in e.top]


def test_completions_logprobs_streamed_and_not(server, engine):
    ref = engine.generate(PROMPT, max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    client = server.client()
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert r.choices[0].text == ref.text and r.usage.completion_tokens == len(ref.token_ids)
    _check_completion_logprobs(engine, r.choices[0].logprobs.model_dump(), ref, 3)
    parts = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = []
    for ev in client.completions.create(stream=True, **kw):
        lp = ev.choices[0].logprobs
        text.append(ev.choices[0].text)
        if lp is not None:
            for key in parts:
                parts[key] += getattr(lp, key)
        else:
            assert not ev.choices[0].text
    assert "".join(text) == ref.text
    _check_completion_logprobs(engine, parts, ref, 3)
    plain = client.completions.create(**{**kw, "logprobs": None})
    assert plain.choices[0].logprobs is None and plain.choices[0].text == ref.text


def test_chat_logprobs_streamed_and_not(server, engine):
    ref = engine.generate(MESSAGES, max_new_tokens=10, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)
    client = server.client()
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0.8, seed=3, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == ref.text and r.usage.completion_tokens == len(ref.token_ids)
    content = [c.model_dump() for c in r.choices[0].logprobs.content]
    _check_chat_logprobs(engine, content, ref, 2)
    assert b"".join(bytes(c["bytes"]) for c in content).decode("utf-8", errors="replace") == ref.text
    content, text = [], []
    for ev in client.chat.completions.create(stream=True, **kw):
        if not ev.choices:
            continue
        delta, lp = ev.choices[0].delta, ev.choices[0].logprobs
        text.append(delta.content or "")
        if lp is not None:
            content += [c.model_dump() for c in lp.content]
    assert "".join(text) == ref.text
    _check_chat_logprobs(engine, content, ref, 2)
    only_chosen = client.chat.completions.create(**{**kw, "top_logprobs": None})
    assert all(c.top_logprobs == [] for c in only_chosen.choices[0].logprobs.content)
    assert [c.logprob for c in only_chosen.choices[0].logprobs.content] == pytest.approx(
        [e.logprob for e in ref.logprobs], abs=ATOL)


def test_n_choices_each_carry_their_own_logprobs(server, engine):
    client = server.client()
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.9, seed=11, n=3, logprobs=1,
                                  extra_body={"ignore_eos": True})
    assert len(r.choices) == 3
    for j, choice in enumerate(r.choices):
        ref = engine.generate(PROMPT, max_new_tokens=8, temperature=0.9, seed=choice_seed(11, j), ignore_eos=True,
                              logprobs=1)
        assert choice.text == ref.text
        _check_completion_logprobs(engine, choice.logprobs.model_dump(), ref, 1)


def test_no_logprobs_past_a_stop_string(server, engine):
    """The logprobs end with the token that completed the stop string (as usage counts),
    streamed or not: none of the tokens the round committed after it."""
    full = engine.generate(PROMPT, max_new_tokens=30, temperature=0, ignore_eos=True, logprobs=1)
    stop = engine.decode(full.token_ids[12:14])
    ref = engine.generate(PROMPT, max_new_tokens=30, temperature=0, ignore_eos=True, logprobs=1, stop=stop)
    assert ref.finish_reason == "stop" and len(ref.token_ids) < len(full.token_ids)
    client = server.client()
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, logprobs=1, stop=[stop],
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == len(ref.token_ids)
    _check_completion_logprobs(engine, r.choices[0].logprobs.model_dump(), ref, 1)
    tokens = []
    for ev in client.completions.create(stream=True, **kw):
        if ev.choices[0].logprobs is not None:
            tokens += ev.choices[0].logprobs.tokens
    assert tokens == [_text(engine, t) for t in ref.token_ids]
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0, stop=[stop],
                                          logprobs=True, extra_body={"ignore_eos": True})
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens


@pytest.mark.parametrize("path,body,status,param,message", [
    ("/v1/completions", {"logprobs": 5}, 200, None, None),
    ("/v1/completions", {"logprobs": 6}, 400, "logprobs", "less than or equal to 5"),
    ("/v1/completions", {"logprobs": -1}, 400, "logprobs", "greater than or equal to 0"),
    ("/v1/completions", {"logprobs": 1, "echo": True}, 200, None, None),
    ("/v1/completions", {"prompt_logprobs": 21}, 400, "prompt_logprobs", "less than or equal to 20"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 20}, 200, None, None),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "less than or equal to 20"),
    ("/v1/chat/completions", {"top_logprobs": 2}, 400, "top_logprobs", "needs logprobs set to true"),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 0}, 400, "top_logprobs", "needs logprobs set to true"),
], ids=["5", "6", "negative", "echo", "prompt_logprobs 21", "top 20", "top 21", "top without logprobs",
        "top with logprobs false"])
def test_logprobs_ranges(server, path, body, status, param, message):
    prompt = {"prompt": "x"} if path == "/v1/completions" else {"messages": MESSAGES}
    r = server.post(path, {**prompt, "max_tokens": 2, **body})
    if status == 200:
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        if path == "/v1/completions":  # (echo: the prompt's first token has no logprobs, its second does)
            assert len(lp["top_logprobs"][1 if body.get("echo") else 0]) >= body["logprobs"]
        else:
            assert len(lp["content"][0]["top_logprobs"]) == 20
        return
    err = _assert_openai_error(r, status)
    assert err["param"] == param, err
    if message is not None:
        assert message in err["message"], err


def _offsets_index_the_text(text: str, tokens: list[str], ids: list[int], offsets: list[int], skipped) -> None:
    """Legacy ``text_offset`` s against the text: non-decreasing, none past its end, and each
    token with text of its own (whole characters, not skipped) at its offset."""
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets), (text, tokens, offsets)
    for token, token_id, offset in zip(tokens, ids, offsets):
        if token_id not in skipped and "\\x" not in token:
            assert text[offset:offset + len(token)] == token, (text, tokens, offsets)


@pytest.mark.parametrize("skip", [False, True], ids=["specials kept", "skip_special_tokens"])
def test_text_offset_after_a_prompt_that_ends_inside_a_character(server, engine, skip):
    """A token-id prompt may end inside a UTF-8 character that the generated bytes complete
    (in one token or several), or never do: that character is the prompt's text, not the
    output's (as the engine decodes the output after the prompt's last tokens), and the
    offsets count the output's characters alone (they were one too many from the first
    token on: its continuation byte counted as a U+FFFD), streamed or not. With ``echo``
    the generated tokens' offsets are those past the echoed text (they were one too many
    there too where skip_special_tokens joins the bytes around a special token of the
    prompt, which the echoed text keeps)."""
    vocab = range(engine.target.config.vocab_size)
    byte = {b: next(i for i in vocab if engine.token_bytes(i) == bytes([b])) for b in (0xC3, 0xE2, 0xF0, 0x9F, 0x98, 0x82,
                                                                                       0x80, 0xAC)}
    words = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    a, mask = engine.tokenizer.encode("a", add_special_tokens=False)[0], 1  # (<|MASK|>: a special token)
    assert mask in engine.special_token_ids
    prompts = [words + [byte[0xC3]], words + [byte[0xE2]], words + [byte[0xE2], byte[0x82]],
               words + [byte[0xF0], byte[0x9F], byte[0x98]], words + [byte[0xC3], mask]]
    # (continuation bytes and "a"; less often a special token and a lead byte)
    bias = {str(byte[0x80]): 100, str(byte[0xAC]): 100, str(a): 100, str(mask): 98, str(byte[0xC3]): 97}
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 6, "temperature": 1, "seed": 3, "n": 6, "logprobs": 0,
            "logit_bias": bias, "ignore_eos": True, "skip_special_tokens": skip}
    skipped = engine.special_token_ids if skip else frozenset()
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == len(prompts) * 6
    streamed = {}
    for ev in server.client().completions.create(stream=True, **{k: v for k, v in body.items() if k in (
            "model", "prompt", "max_tokens", "temperature", "seed", "n", "logprobs", "logit_bias")},
            extra_body={"ignore_eos": True, "skip_special_tokens": skip}):
        for c in ev.choices:
            got = streamed.setdefault(c.index, {"text": "", "tokens": [], "text_offset": []})
            got["text"] += c.text
            if c.logprobs is not None:
                got["tokens"] += c.logprobs.tokens
                got["text_offset"] += c.logprobs.text_offset
    id_of = {_text(engine, int(t)): int(t) for t in bias}
    shorter = 0  # (choices whose text has fewer characters than their bytes decoded alone)
    for c in choices:
        lp = c["logprobs"]
        ids = [id_of[t] for t in lp["tokens"]]
        _offsets_index_the_text(c["text"], lp["tokens"], ids, lp["text_offset"], skipped)
        assert lp["text_offset"][0] == 0
        assert streamed[c["index"]] == {"text": c["text"], "tokens": lp["tokens"], "text_offset": lp["text_offset"]}
        alone = b"".join(engine.token_bytes(t) for t in ids if t not in skipped).decode("utf-8", errors="replace")
        shorter += len(c["text"]) < len(alone) and a in ids
    assert shorter, [(c["text"], c["logprobs"]["tokens"]) for c in choices]  # (the case this covers is there)
    # with echo, the offsets go on from the prompt's tokens over the prompt's text, its
    # unfinished character included: the generated tokens' are those past the echoed text
    r = server.post("/v1/completions", {**body, "echo": True})
    assert r.status_code == 200, r.text
    for c, alone in zip(r.json()["choices"], choices, strict=True):
        lp, k = c["logprobs"], len(prompts[c["index"] // 6])
        echoed = c["text"][:len(c["text"]) - len(alone["text"])]
        assert c["text"] == echoed + alone["text"] and lp["tokens"][k:] == alone["logprobs"]["tokens"]
        assert lp["text_offset"][k:] == [len(echoed) + o for o in alone["logprobs"]["text_offset"]], (
            c["text"], alone["text"], lp["tokens"][k:], lp["text_offset"], alone["logprobs"]["text_offset"])
        _offsets_index_the_text(c["text"], lp["tokens"], prompts[c["index"] // 6] + [id_of[t] for t in lp["tokens"][k:]],
                                lp["text_offset"], skipped)
