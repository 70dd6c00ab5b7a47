"""The sampling a model's ``generation_config.json`` recommends, and ``min_p``.

* ``DFlashEngine.generation_defaults`` reads ``temperature``, ``top_k``, ``top_p``, ``min_p``
  and ``repetition_penalty`` (vLLM's list, less ``max_new_tokens``: the engine's default,
  cut to the context a prompt leaves as the server cuts it); a bad value is refused where
  it is used (the server's defaults), not when loading.
* A real ``dflash-torch serve`` subprocess gives a request that omits them the recommended
  values (vLLM's ``--generation-config auto``), and OpenAI's defaults with
  ``--generation-config none``: a seeded request without them decodes exactly as the same
  request with them written out.
* ``min_p`` 1 keeps only the most likely token, so sampling with it is greedy decoding:
  speculative output then equals target-only greedy output (Python, batch, server).
"""

from __future__ import annotations

import json
import shutil

import pytest
from test_server import MODEL
from test_server_scheduler import _serve

from dflash_torch import DFlashEngine, DFlashError

RECOMMENDED = {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1,
               "max_new_tokens": 6}
PROMPTS = ["def f(x):", "class A:", "import os\n", "x = ["]


def _with_generation_config(target, root, fields: dict):
    copy = shutil.copytree(target, root)
    path = copy / "generation_config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**cfg, "do_sample": True, **fields}))
    return copy


@pytest.fixture(scope="module")
def recommended_pair(tiny_pair, tmp_path_factory):
    target, drafter = tiny_pair
    return _with_generation_config(target, tmp_path_factory.mktemp("gen") / "target", RECOMMENDED), drafter


@pytest.fixture(scope="module")
def none_server(recommended_pair, tmp_path_factory):
    """A server of ``recommended_pair`` started with ``--generation-config none`` (it samples
    as a server of the tiny pair does); one for the module: a server start costs ~4 s CPU."""
    with _serve(recommended_pair, tmp_path_factory.mktemp("none"), "--generation-config", "none") as srv:
        yield srv


SAMPLING = {k: v for k, v in RECOMMENDED.items() if k != "max_new_tokens"}


def test_generation_defaults_are_the_fields_it_sets(recommended_pair, tiny_pair, tmp_path):
    engine = DFlashEngine.from_pretrained(*recommended_pair)
    assert engine.generation_defaults == SAMPLING
    assert engine.recommended_max_new_tokens == engine.default_max_new_tokens == RECOMMENDED["max_new_tokens"]
    plain = DFlashEngine.from_pretrained(*tiny_pair)
    assert plain.generation_defaults == {}  # (it sets none of them)
    assert (plain.recommended_max_new_tokens, plain.default_max_new_tokens) == (None, 256)
    # null is unset, top_k -1 is vLLM's "off", other fields are not sampling defaults
    other = _with_generation_config(tiny_pair[0], tmp_path / "other",
                                    {"temperature": None, "top_k": -1, "num_beams": 4, "max_length": 99})
    assert DFlashEngine.from_pretrained(other, no_draft=True).generation_defaults == {"top_k": 0}
    # they are keyword arguments of generate (which itself defaults to greedy; its length to the file's)
    out = engine.generate("def f(x):", seed=1, ignore_eos=True, **engine.generation_defaults)
    assert len(out.token_ids) == RECOMMENDED["max_new_tokens"]
    assert len(engine.generate("def f(x):", ignore_eos=True).token_ids) == RECOMMENDED["max_new_tokens"]


def test_the_recommended_max_new_tokens_is_cut_to_the_context_as_the_server_cuts_it(tiny_pair, tmp_path):
    """``generate(prompt, **engine.generation_defaults)`` (the README's recipe for sampling as
    the server does for requests that omit values) with generation_config.json's
    max_new_tokens 20 and a prompt that leaves 8 tokens: 8 tokens, as the server and
    ``generate(prompt)`` give (it was refused: "prompt (32 tokens) + max_new_tokens (20)
    exceeds the context of 40 tokens"); where it fits, the file's 20, not 256; a given
    max_new_tokens that does not fit stays refused."""
    from dflash_torch.serving import create_app

    target = _with_generation_config(tiny_pair[0], tmp_path / "t", {"temperature": 0.0, "max_new_tokens": 20})
    engine = DFlashEngine.from_pretrained(target, tiny_pair[1], max_context=40)
    ids = list(range(5, 37))  # 32 tokens: 8 left
    ref = engine.generate(ids, max_new_tokens=8, ignore_eos=True).token_ids
    assert engine.generate(ids, ignore_eos=True, **engine.generation_defaults).token_ids == ref
    assert engine.generate(ids, ignore_eos=True).token_ids == ref
    assert [r.token_ids for r in engine.generate_batch([ids, ids[:10]], ignore_eos=True)] == [
        ref, engine.generate(ids[:10], max_new_tokens=20, ignore_eos=True).token_ids]
    with pytest.raises(DFlashError, match=r"^prompt \(32 tokens\) \+ max_new_tokens \(20\) exceeds"):
        engine.generate(ids, max_new_tokens=20)
    # the server takes the file's value as the limit of a chat request without max_tokens (it read it from
    # generation_defaults)
    assert create_app(engine).state.sampling_defaults == {"temperature": 0.0, "max_new_tokens": 20}
    assert create_app(engine, generation_config="none").state.sampling_defaults == {}


def test_generate_says_which_generation_config_values_it_leaves(cli, recommended_pair, tiny_pair):
    """``dflash-torch generate`` takes the file's max_new_tokens but its sampling values from
    its flags only (greedy by default, its --help's defaults): it did so silently beside chat's
    note of the values it samples with; now one stderr line names the values it leaves that
    would change the decode and the flags that would use them (with --json too: stdout stays
    one JSON object), nor for a target whose file recommends none."""
    target, drafter = map(str, recommended_pair)
    greedy = DFlashEngine.from_pretrained(target, drafter).generate("def f(x):")
    note = ("note: greedy decoding; the target's generation_config.json values (temperature 0.7, top_k 5, top_p 0.9, "
            "min_p 0.05, repetition_penalty 1.1) are not used (generate takes sampling values from its flags only): "
            "pass --temperature 0.7 --top-k 5 --top-p 0.9 --min-p 0.05 --repetition-penalty 1.1 to use them")
    proc = cli("generate", "def f(x):", "--target", target, "--draft", drafter)
    assert proc.returncode == 0 and proc.stdout == greedy.text
    assert proc.stderr.splitlines()[0] == note and len(proc.stderr.splitlines()) == 2, proc.stderr
    proc = cli("generate", "def f(x):", "--target", target, "--draft", drafter, "--json", "--temperature", "1")
    assert proc.returncode == 0 and proc.stderr.strip() == (  # (trial-256: a sampling flag silenced the rest)
        "note: sampling at temperature 1.0; the target's generation_config.json values (top_k 5, top_p 0.9, min_p 0.05, "
        "repetition_penalty 1.1) are not used (generate takes sampling values from its flags only): pass --top-k 5 "
        "--top-p 0.9 --min-p 0.05 --repetition-penalty 1.1 to use them"), proc.stderr
    proc = cli("generate", "def f(x):", "--target", target, "--draft", drafter, "--json", "--temperature", "0.7",
               "--top-k", "5", "--top-p", "0.9", "--min-p", "0.05", "--repetition-penalty", "1.1")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr  # (every value given: nothing left)
    proc = cli("generate", "def f(x):", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), "--json")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_generates_note_names_only_values_that_would_change_the_decode():
    """The values the note names (:func:`~dflash_torch.cli.unused_generation_config_note`):
    the truncations (top_k, top_p, min_p) only where the decode would sample, at the given
    --temperature or else the file's (trial-256: a file of temperature 0 and top_k 20 said
    "pass --top-k 20", which changes nothing); a repetition penalty, which greedy decoding
    follows too, always; none of a flag given."""
    from dflash_torch.cli import unused_generation_config_note as note

    assert note({"temperature": 0.0, "top_k": 20}, {}) is None
    assert note({"top_k": 20, "top_p": 0.8}, {}) is None  # (no temperature: greedy)
    assert note({"temperature": 0.7, "top_k": 20}, {"temperature": 0.0}) is None  # (greedy asked for)
    assert note({"temperature": 0.7, "top_k": 20}, {"top_k": 3}) == (
        "note: greedy decoding; the target's generation_config.json values (temperature 0.7) are not used (generate "
        "takes sampling values from its flags only): pass --temperature 0.7 to use them")
    assert note({"top_k": 20, "repetition_penalty": 1.05}, {}).startswith(
        "note: greedy decoding; the target's generation_config.json values (repetition_penalty 1.05) are not used")
    assert note({"temperature": 0.6, "top_p": 0.95, "max_new_tokens": 9}, {"temperature": 1.0}) == (
        "note: sampling at temperature 1.0; the target's generation_config.json values (top_p 0.95) are not used "
        "(generate takes sampling values from its flags only): pass --top-p 0.95 to use them")


BAD_RECOMMENDED = [  # (field, value, the one-line error)
    ("temperature", "0.6", "generation_config.json: temperature must be a finite number >= 0, got '0.6'"),
    ("top_p", 0, "generation_config.json: top_p must be in (0, 1], got 0"),
    ("min_p", 1.5, "generation_config.json: min_p must be in [0, 1] (0 = off), got 1.5"),
    ("top_k", 2.5, "generation_config.json: top_k must be an integer >= -1 (0 or -1 = off), got 2.5"),
    ("max_new_tokens", 0, "generation_config.json: max_new_tokens must be an integer >= 1, got 0"),
    ("repetition_penalty", -1, "generation_config.json: repetition_penalty must be a finite number > 0"),
]


@pytest.mark.parametrize("field,value,words", BAD_RECOMMENDED, ids=[c[0] for c in BAD_RECOMMENDED])
def test_a_bad_recommended_value_is_refused_where_it_is_used(tiny_pair, tmp_path, caplog, field, value, words):
    """A checkpoint whose generation_config.json recommends a bad value still loads and
    generates (generate reads only its max_new_tokens, where valid, as its default length);
    its generation_defaults, recommended_max_new_tokens, and a server that would take them,
    are refused in one line naming the file and field."""
    from dflash_torch.serving import create_app

    target = _with_generation_config(tiny_pair[0], tmp_path / "bad", {field: value})
    with caplog.at_level("WARNING", logger="dflash_torch"):
        engine = DFlashEngine.from_pretrained(target, no_draft=True)
    said = [r.getMessage() for r in caplog.records if "not taken as a default length" in r.getMessage()]
    # a bad length there is said when loading (generate took 256 without a word where chat and serve refuse it);
    # in words true for serve too (it said "a request ... gets 256 tokens" where serve's default is another)
    assert said == ([f"dflash-torch: {words}; it is not taken as a default length (generate without max_new_tokens "
                     "gives 256 tokens, cut to the context its prompt leaves; serve has its own default)"]
                    if field == "max_new_tokens" else []), said
    assert len(engine.generate("x", max_new_tokens=2, ignore_eos=True).token_ids) == 2
    # (the default length: a bad max_new_tokens there is not taken, another field's bad value leaves it)
    assert engine.default_max_new_tokens == 256
    for use in (lambda: engine.generation_defaults, lambda: engine.recommended_max_new_tokens,
                lambda: create_app(engine)):
        with pytest.raises(DFlashError) as err:
            use()
        assert str(err.value).startswith(words) and "\n" not in str(err.value), str(err.value)
    create_app(engine, generation_config="none")  # (the file's sampling unread)
    # an integral float is the integer it holds
    target = _with_generation_config(tiny_pair[0], tmp_path / "float", {"top_k": 20.0, "max_new_tokens": 8.0})
    floats = DFlashEngine.from_pretrained(target, no_draft=True)
    assert (floats.generation_defaults, floats.default_max_new_tokens) == ({"top_k": 20}, 8)
    assert type(floats.default_max_new_tokens) is int
    target = _with_generation_config(tiny_pair[0], tmp_path / "both", {"top_p": 0, "max_new_tokens": 8})
    assert DFlashEngine.from_pretrained(target, no_draft=True).default_max_new_tokens == 8


def test_min_p_1_sampling_is_greedy_decoding(agree_pair):
    """min_p 1 drops every token less likely than the most likely one: rejection sampling
    then commits exactly the greedy tokens, alone and in a batch, and drafts are accepted."""
    spec = DFlashEngine.from_pretrained(*agree_pair, block_size=8)
    base = DFlashEngine(spec.target, spec.tokenizer)
    refs = [base.generate(p, max_new_tokens=24, ignore_eos=True).token_ids for p in PROMPTS]
    for seed, (prompt, ref) in enumerate(zip(PROMPTS, refs)):
        out = spec.generate(prompt, max_new_tokens=24, ignore_eos=True, temperature=(1.3, 1e7, 1e30, 0.01)[seed],
                            min_p=1.0, seed=seed)  # (huge temperatures: float32 probabilities all round alike)
        assert out.token_ids == ref
        assert out.stats.mean_acceptance_length > 1.5
    batch = spec.generate_batch(PROMPTS, max_new_tokens=24, ignore_eos=True, temperature=1.3, seed=[1, 2, 3, 4],
                                min_p=[1.0, 1.0, 1.0, 1.0])
    assert [r.token_ids for r in batch] == refs


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), "0.1", True])
def test_invalid_min_p_is_one_line_naming_it(agree_pair, value):
    engine = DFlashEngine.from_pretrained(agree_pair[0], no_draft=True)
    with pytest.raises(DFlashError, match=r"^min_p must be in \[0, 1\]") as err:
        engine.generate("x", max_new_tokens=2, temperature=1.0, min_p=value)
    assert "\n" not in str(err.value)


def _completion(client, seed: int, **fields) -> str:
    extra = {"ignore_eos": True, **{k: fields.pop(k) for k in ("top_k", "min_p", "repetition_penalty") if k in fields}}
    return client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=12, seed=seed, extra_body=extra,
                                     **fields).choices[0].text


def test_the_server_defaults_to_the_recommended_sampling(recommended_pair, none_server, tmp_path_factory):
    explicit = {k: v for k, v in RECOMMENDED.items() if k != "max_new_tokens"}
    openai_defaults = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
    with _serve(recommended_pair, tmp_path_factory.mktemp("auto")) as srv:
        log = srv.log.read_text()
        assert "generation_config.json: temperature 0.7, top_k 5, top_p 0.9, min_p 0.05, repetition_penalty 1.1; chat and " \
            "Responses requests without max_tokens at most 6 tokens" in log, log
        client = srv.client()
        omitted = [_completion(client, seed) for seed in range(4)]
        assert omitted == [_completion(client, seed, **explicit) for seed in range(4)]
        # the test has power: OpenAI's defaults sample other text for these seeds
        assert omitted != [_completion(client, seed, **openai_defaults) for seed in range(4)]
        # a field the request sets wins over the recommended one
        assert _completion(client, 0, temperature=0.0) == _completion(client, 0, temperature=0.0, top_k=1)
        # a chat that omits max_tokens gets at most max_new_tokens; one that sets it, its own
        chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body={"ignore_eos": True})
        r = client.chat.completions.create(**chat)
        assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
        assert client.chat.completions.create(**chat, max_tokens=9).usage.completion_tokens == 9
        # a Response repeats the values it was served with
        resp = client.responses.create(model=MODEL, input="hi", max_output_tokens=3)
        assert (resp.temperature, resp.top_p, resp.max_output_tokens) == (0.7, 0.9, 3)
        # the limit too, where the file's max_new_tokens applied (it said null while cut at 6), streamed or not
        resp = client.responses.create(model=MODEL, input="hi", extra_body={"ignore_eos": True})
        assert (resp.status, resp.incomplete_details.reason, resp.usage.output_tokens) == ("incomplete",
                                                                                          "max_output_tokens", 6)
        assert resp.max_output_tokens == 6
        events = list(client.responses.create(model=MODEL, input="hi", stream=True, extra_body={"ignore_eos": True}))
        assert events[0].response.max_output_tokens == 6 and events[-1].response.max_output_tokens == 6
    srv = none_server
    client = srv.client()
    assert [_completion(client, seed) for seed in range(4)] == \
        [_completion(client, seed, **openai_defaults) for seed in range(4)]
    resp = client.responses.create(model=MODEL, input="hi", max_output_tokens=3)
    assert (resp.temperature, resp.top_p) == (1.0, 1.0)
    # no limit asked or recommended: the rest of the context applied, and is the one repeated
    resp = client.responses.create(model=MODEL, input="hi", extra_body={"ignore_eos": True})
    assert resp.max_output_tokens == resp.usage.output_tokens > 6 and resp.status == "incomplete"
    assert "generation_config.json" not in srv.log.read_text()


def test_min_p_over_http(none_server):
    """min_p 1 sampling is greedy decoding over HTTP (on the server without the target's
    recommendations: the tiny pair's sampling defaults), and bad min_p / min_tokens are 400s."""
    srv = none_server
    client = srv.client()
    greedy = _completion(client, 0, temperature=0.0)
    assert all(_completion(client, seed, temperature=1.5, min_p=1.0) == greedy for seed in range(3))
    r = srv.post("/v1/completions", {"model": MODEL, "prompt": "x", "min_p": 1.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_p", r.text
    # (a request's fields by their names: it said max_new_tokens)
    r = srv.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3, "min_tokens": 4})
    assert r.json()["error"]["message"] == "min_tokens (4) must be at most max_tokens (3)", r.text
