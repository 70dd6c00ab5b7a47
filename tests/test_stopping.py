"""Stopping is decided on committed tokens, inside a block: stop token ids, stop strings
and max_new_tokens cut exactly where they occur, even when the round that committed the
token committed more after it; the decision is the one token-at-a-time decoding makes,
whatever the round boundaries (property tests against a brute-force oracle and against
target-only decoding); tokens are never stripped by value; requests on one engine are
independent; streamed deltas add up to the final text; stats add up."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import AGREE_TOKEN, corpus_texts, make_sentencepiece_tokenizer, varied_prompts, serve_in_thread
from dflash_torch import DFlashEngine, DFlashError
from dflash_torch.stopping import IncrementalText, Stopper, find_stop, partial_stop

PROMPTS = ["def f(x):", "class Stack:\n    def push(self, item):\n", "import os\nimport sys\n", "x",
           "    return self._data[index]\n", "for i in range(10):\n"]
N = 48


@pytest.fixture(scope="module")
def engines(agree_pair):
    """Engines of the agreeable pair (many multi-token rounds) for B = 4 and 16."""
    target, drafter = agree_pair
    e16 = DFlashEngine.from_pretrained(target, drafter)
    return {16: e16, 4: DFlashEngine(e16.target, e16.tokenizer, e16.drafter, block_size=4)}


def round_spans(out) -> list[tuple[int, int]]:
    """[start, end) token index ranges of the prefill step and of each decoding round."""
    spans, i = [(0, 1)], 1
    for tau in out.stats.acceptance_lengths:
        spans.append((i, i + tau))
        i += tau
    return spans


def mid_block_indices(out) -> list[int]:
    """Indices of tokens that are not the last of their round (excluding the last round, which
    a max_new_tokens cut may have shortened): stopping there must drop the rest of the round."""
    return [i for start, end in round_spans(out)[1:-1] for i in range(start, end - 1)]


@pytest.fixture(scope="module")
def references(engines):
    """(prompt, greedy output without stops) for text prompts and varied token-id prompts."""
    prompts = PROMPTS[:2] + varied_prompts(engines[16].target, 6)
    return {B: [(p, e.generate(p, max_new_tokens=N, ignore_eos=True)) for p in prompts] for B, e in engines.items()}


@pytest.mark.parametrize("B", [4, 16])
def test_stop_token_inside_an_accepted_block(engines, references, B):
    engine, found = engines[B], 0
    for prompt, ref in references[B]:
        ids = ref.token_ids
        for i in mid_block_indices(ref):
            if ids[i] in ids[:i]:
                continue  # only a token's first occurrence decides where it stops
            out = engine.generate(prompt, max_new_tokens=N, ignore_eos=True, stop_token_ids=[ids[i]])
            assert out.token_ids == ids[:i + 1]  # up to and including the stop token, nothing after
            assert out.finish_reason == "stop"
            assert out.text == engine.decode(ids[:i])  # the stop token's text is not in the text
            assert out.stats.generated_tokens == i + 1
            # tau counts the tokens kept: the round that committed the stop token is cut there
            assert 1 + sum(out.stats.acceptance_lengths) == out.stats.generated_tokens
            found += 1
            break
    assert found >= 2, "no prompt put a token's first occurrence inside a block"
    prompt, ref = references[B][0]  # the very first (prefill) token is a stop token
    out = engine.generate(prompt, max_new_tokens=N, ignore_eos=True, stop_token_ids=[ref.token_ids[0]])
    assert out.token_ids == ref.token_ids[:1] and out.text == "" and out.finish_reason == "stop"


@pytest.mark.parametrize("B", [4, 16])
def test_stop_string_inside_a_block(engines, references, B):
    engine, found = engines[B], 0
    for prompt, ref in references[B]:
        ids, full = ref.token_ids, ref.text
        for i in mid_block_indices(ref):
            upto = engine.decode(ids[:i + 1])
            before = engine.decode(ids[:i])
            if not full.startswith(upto) or len(upto) < 2 or upto == before:
                continue
            # a stop string ending inside token i's text; with one character of the token before
            # it, so it spans a token boundary too
            for stop in {upto[len(before) - 1:], upto[-1:]}:
                at = full.find(stop)
                if "\ufffd" in stop or at + len(stop) != len(upto):
                    continue  # it must first complete with token i
                out = engine.generate(prompt, max_new_tokens=N, ignore_eos=True, stop=["\x00never", stop])
                assert out.finish_reason == "stop"
                assert out.text == full[:at]
                assert stop not in out.text
                assert out.token_ids == ids[:i + 1]  # the token completing it, never past it
                assert out.stats.generated_tokens == i + 1
                found += 1
        if found >= 4:
            break
    assert found >= 2, "no stop string completed inside a block"


@pytest.mark.parametrize("B", [4, 16])
def test_max_new_tokens_landing_mid_block(engines, references, B):
    engine, checked = engines[B], 0
    for prompt, ref in references[B][:3]:
        for i in mid_block_indices(ref)[:4]:
            n = i + 1
            out = engine.generate(prompt, max_new_tokens=n, ignore_eos=True)
            assert out.token_ids == ref.token_ids[:n] and len(out.token_ids) == n
            assert out.finish_reason == "length" and out.stats.generated_tokens == n
            assert out.text == engine.decode(ref.token_ids[:n])
            # the last round committed more than was kept; its tau counts the tokens kept (as the reference)
            assert 1 + sum(out.stats.acceptance_lengths) == n
            checked += 1
    assert checked >= 4
    out = engine.generate(PROMPTS[0], max_new_tokens=1, ignore_eos=True)  # the prefill token only
    assert out.token_ids == references[B][0][1].token_ids[:1] and out.stats.acceptance_lengths == []


def test_generated_mask_id_is_kept(agree_pair, tmp_path):
    """A drafter whose mask token id is c, a token the target generates often."""
    target, drafter = agree_pair
    d = tmp_path / "mask-is-c"
    shutil.copytree(drafter, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"]["mask_token_id"] = AGREE_TOKEN
    (d / "config.json").write_text(json.dumps(cfg))
    spec = DFlashEngine.from_pretrained(target, d)
    assert spec.drafter.config.mask_token_id == AGREE_TOKEN
    base = DFlashEngine(spec.target, spec.tokenizer)
    for prompt in PROMPTS[:3]:
        ref = base.generate(prompt, max_new_tokens=N, ignore_eos=True)
        out = spec.generate(prompt, max_new_tokens=N, ignore_eos=True)
        assert AGREE_TOKEN in ref.token_ids
        assert out.token_ids == ref.token_ids and len(out.token_ids) == N
        assert out.text == ref.text == spec.decode(ref.token_ids)
        chunks = list(spec.stream(prompt, max_new_tokens=N, ignore_eos=True))
        assert [t for c in chunks for t in c.token_ids] == ref.token_ids


@pytest.mark.parametrize("mode", ["inject", "recompute", "fixed-shape"])
def test_back_to_back_requests_match_a_fresh_engine(agree_pair, tiny_pair, mode):
    opts = dict(draft_mode="recompute") if mode == "recompute" else dict(static=(mode == "fixed-shape"))
    long_prompt = "import heapq\nimport bisect\n\nclass PriorityQueue:\n    def __init__(self):\n        self._heap = []\n"
    for target, drafter in (agree_pair, tiny_pair):
        used = DFlashEngine.from_pretrained(target, drafter, **opts)
        first = used.generate(long_prompt, max_new_tokens=40, ignore_eos=True)
        second = used.generate("x", max_new_tokens=30, ignore_eos=True)
        third = used.generate("def f(x):", max_new_tokens=30, ignore_eos=True, temperature=0.8, seed=2)
        fresh = DFlashEngine.from_pretrained(target, drafter, **opts)
        assert second.token_ids == fresh.generate("x", max_new_tokens=30, ignore_eos=True).token_ids
        fresh3 = DFlashEngine.from_pretrained(target, drafter, **opts)
        assert third.token_ids == fresh3.generate("def f(x):", max_new_tokens=30, ignore_eos=True, temperature=0.8, seed=2).token_ids
        again = used.generate(long_prompt, max_new_tokens=40, ignore_eos=True)
        assert again.token_ids == first.token_ids


@pytest.mark.parametrize("stop_at", [None, 0.5, 0.8], ids=["no-stop", "stop-string-mid", "two-stop-strings"])
def test_streaming_deltas_concatenate_to_the_final_text(agree_pair, tiny_pair, stop_at):
    for target, drafter in (agree_pair, tiny_pair):
        engine = DFlashEngine.from_pretrained(target, drafter)
        for prompt in PROMPTS[:2] + varied_prompts(engine.target, 2, seed=1):
            stop = None
            if stop_at is not None:  # stop strings that do occur in this output
                full = engine.generate(prompt, max_new_tokens=40, ignore_eos=True).text
                k = int(len(full) * stop_at)
                stop = [full[k:k + 2]] if stop_at == 0.5 else ["\x00never", full[k:k + 3], full[-1:]]
            out = engine.generate(prompt, max_new_tokens=40, ignore_eos=True, stop=stop)
            chunks = list(engine.stream(prompt, max_new_tokens=40, ignore_eos=True, stop=stop))
            assert len(chunks) > 1 or len(out.token_ids) == 1
            assert "".join(c.text for c in chunks) == out.text
            assert [t for c in chunks for t in c.token_ids] == out.token_ids
            assert all(c.finish_reason is None and c.stats is None for c in chunks[:-1])
            assert chunks[-1].finish_reason == out.finish_reason and chunks[-1].stats is not None
            if stop is None:
                assert out.text == engine.decode(out.token_ids) and out.finish_reason == "length"
            else:
                assert out.finish_reason == "stop"
                assert not any(s in out.text for s in stop)
                assert engine.decode(out.token_ids).startswith(out.text)


def test_stats_are_consistent(engines, references, tiny_pair):
    target, _ = tiny_pair
    outs = [(engines[B], ref) for B in (4, 16) for _, ref in references[B]]
    no_draft = DFlashEngine.from_pretrained(target, no_draft=True)
    outs.append((no_draft, no_draft.generate("def f(x):", max_new_tokens=20, ignore_eos=True)))
    prompt, ref = references[16][-1]
    stopped = engines[16].generate(prompt, max_new_tokens=N, ignore_eos=True, stop=[ref.text[10:12]])
    outs.append((engines[16], stopped))
    for engine, out in outs:
        st, B = out.stats, engine.block_size
        taus = st.acceptance_lengths
        assert st.generated_tokens == len(out.token_ids)
        assert st.block_size == B
        assert all(1 <= t <= B for t in taus)
        assert sum(taus) >= st.generated_tokens - 1
        assert sum(taus) - (st.generated_tokens - 1) < B  # only the last round can overshoot
        assert sum(st.acceptance_histogram.values()) == len(taus)
        assert all(st.acceptance_histogram[t] == taus.count(t) for t in set(taus))
        assert st.mean_acceptance_length == pytest.approx(sum(taus) / len(taus))
        assert len(st.propose_times) == len(st.verify_times) == len(taus)
        assert st.decode_tokens_per_second > 0 and st.prefill_time > 0
        assert st.prompt_tokens > 0
        d = st.to_dict()
        assert json.loads(json.dumps(d))["acceptance_lengths"] == taus
    assert set(outs[-2][1].stats.acceptance_lengths) == {1}  # target-only: one token per step
    assert stopped.finish_reason == "stop" and stopped.stats.prompt_tokens == len(prompt)


def test_unfinished_stream_in_same_thread_is_an_error_not_a_hang(tiny_pair, monkeypatch):
    """A second request while this thread read an open stream last, and no thread reads it
    on, can never run: it raises once the stream has not moved for STALLED_STREAM_S
    seconds; after close() the engine serves again."""
    import pytest

    from dflash_torch import DFlashEngine, DFlashError, engine as engine_module

    monkeypatch.setattr(engine_module, "STALLED_STREAM_S", 0.3)
    target, drafter = tiny_pair
    engine = DFlashEngine.from_pretrained(target, drafter)
    first = engine.stream("def f(x):", max_new_tokens=20, ignore_eos=True)
    next(first)
    with pytest.raises(DFlashError, match="still open"):
        engine.generate("def f(x):", max_new_tokens=5)
    first.close()
    out = engine.generate("def f(x):", max_new_tokens=5, ignore_eos=True)
    assert len(out.token_ids) == 5


# --- the token-at-a-time decision, whatever the round boundaries -------------------------
# (hypothesis runs derandomized, without an example database: the suite stays deterministic)
PROPERTY = settings(max_examples=300, deadline=None, derandomize=True, database=None)


def hf_decode(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def decoders(tokenizer_dir):
    """name -> (decode, vocabulary size): the byte-level BPE test tokenizer (its single-byte
    tokens make incomplete and invalid UTF-8 common), the shipped default pair's, and a
    SentencePiece-style one (Metaspace: a word-start marker whose space is dropped at the
    start of a decode, so a token's text depends on the token before it), and a Llama-2-style
    one with byte fallback (a run of byte tokens decodes as one: a byte can turn the run
    before it into U+FFFD characters). Each with its byte tokens (the engine's
    ``byte_token_ids``)."""
    from tokenizers import Tokenizer, decoders as dec, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from dflash_torch.engine import DEFAULT_TARGET

    meta = Tokenizer(models.BPE(unk_token="<unk>"))
    meta.pre_tokenizer, meta.decoder = pre_tokenizers.Metaspace(), dec.Metaspace()
    meta.train_from_iterator(corpus_texts(), trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>"],
                                                                 show_progress=False))
    toks = {"byte-level": AutoTokenizer.from_pretrained(str(tokenizer_dir)),
            "default": AutoTokenizer.from_pretrained(str(DEFAULT_TARGET)),
            "metaspace": PreTrainedTokenizerFast(tokenizer_object=meta, unk_token="<unk>", eos_token="</s>"),
            "byte-fallback": make_sentencepiece_tokenizer()}
    held = {name: frozenset(i for i in range(len(t)) if re.fullmatch("<0x[0-9A-F]{2}>", t.convert_ids_to_tokens(i)))
            for name, t in toks.items()}
    assert len(held["byte-fallback"]) == 256 and not held["byte-level"] and not held["default"]
    return {name: (hf_decode(t), len(t), held[name]) for name, t in toks.items()}


@st.composite
def token_runs(draw, vocab: int, max_size: int = 40):
    """Token ids drawn from a small random subset of the vocabulary (repetitive text, so
    stop strings overlap and recur), or from all of it."""
    ids = st.integers(0, vocab - 1)
    alphabet = draw(st.lists(ids, min_size=1, max_size=8, unique=True))
    return draw(st.lists(st.one_of(st.sampled_from(alphabet), ids) if draw(st.booleans()) else st.sampled_from(alphabet),
                         min_size=1, max_size=max_size))


@st.composite
def overlapping_stops(draw, text: str):
    """Stop strings cut from ``text`` around one place, in any order: an inner one and an
    outer one around it (the outer starts first, the inner completes first), 0-2 more
    overlapping them, and sometimes one that may not occur at all."""
    m = draw(st.integers(0, max(0, len(text) - 1)))
    n = m + draw(st.integers(1, 4))
    i, j = max(0, m - draw(st.integers(0, 4))), n + draw(st.integers(0, 8))
    stops = [text[m:n], text[i:j]]
    for _ in range(draw(st.integers(0, 2))):
        a = draw(st.integers(i, max(i, min(j, len(text)) - 1)))
        stops.append(text[a:a + draw(st.integers(1, 10))])
    if draw(st.booleans()):
        stops.append(draw(st.text(alphabet="os\n i()I", min_size=1, max_size=6)))
    return draw(st.permutations([s for s in stops if s] or ["\x00never"]))


def reference_stop(decode, ids, stops, stop_ids, max_new_tokens, include=False, held=frozenset(), context=()):
    """The definition, by brute force: one token at a time, the whole text decoded again
    (``include``: the text keeps the stop string, the longest of those starting first;
    ``held``: byte tokens, whose text counts once a token outside them follows, or for a stop
    string once their run so far is valid UTF-8 at a character boundary; ``context``:
    tokens before ``ids`` not ending in a byte token, their text not part of the output's).
    Returns (text, number of tokens kept, finish reason)."""
    start = len(decode(list(context)))

    def text_of(k):
        return decode(list(context) + ids[:k])[start:]

    def cut(text):
        found = [(text.find(s), -len(s)) for s in stops if s in text]
        if not found:
            return None
        start, minus_length = min(found)
        return text[:start - minus_length] if include else text[:start]

    def end(text, k, reason):  # trailing U+FFFD characters (and byte tokens) are final at the end
        kept = cut(text)
        return (kept, k, "stop") if kept is not None else (text, k, reason)

    text = ""
    for k in range(1, len(ids) + 1):
        if ids[k - 1] in stop_ids:
            return end(text_of(k - 1), k, "stop")
        if ids[k - 1] not in held:  # (else: no new complete text)
            text = text_of(k).rstrip("\ufffd")  # complete text after token k
        kept = cut(text)  # none was complete before token k
        if kept is None and ids[k - 1] in held and "\ufffd" not in text_of(k)[len(text):]:
            kept = cut(text_of(k))  # (a run of byte tokens valid so far: its text is final if the output ends here)
        if kept is not None:
            return kept, k, "stop"
        if k == max_new_tokens:
            return end(text_of(k), k, "length")
    raise AssertionError("max_new_tokens is past the tokens")


def run_stopper(decode, ids, stops, stop_ids, max_new_tokens, sizes, include=False, held=frozenset(), context=None):
    """Feed ``ids`` to a :class:`Stopper` in rounds of ``sizes`` tokens (cycled) until it finishes
    (``context``: the prompt, given to :meth:`Stopper.start`)."""
    stopper = Stopper(decode, stops, stop_ids, max_new_tokens, include_stop=include, held=held)
    if context is not None:
        stopper.start(context)
    deltas, kept, i, r = [], 0, 0, 0
    while True:
        tokens = ids[i:i + sizes[r % len(sizes)]]
        text, k, finish = stopper.feed(tokens)
        assert 0 < k <= len(tokens) and (finish is not None or k == len(tokens))
        deltas.append(text)
        kept, i, r = kept + k, i + len(tokens), r + 1
        if finish:
            assert stopper.generated == kept
            return "".join(deltas), kept, finish


def test_find_stop_and_partial_stop_examples():
    # the issue's example: "\nimp" completes with the token " import"; "os\nimport os" does not
    assert find_stop("import os\nimport", len("import os\n"), ["os\nimport os", "\nimp"]) == len("import os")
    # two stop strings completed by the same new text: the earliest start wins
    assert find_stop("xxabcd", 3, ["cd", "abc"]) == 2
    # an occurrence that ended before the new text is not new
    assert find_stop("ab--ab", 4, ["ab"]) == 4 and find_stop("ab--", 3, ["ab"]) is None
    assert partial_stop("foo\nim", ["\nimport", "xyz"]) == 3
    assert partial_stop("foo\n", ["\n\n", "o\n\n"]) == 2
    assert partial_stop("abc", ["abc"]) == 0  # a complete occurrence is not a partial one
    assert partial_stop("", ["a"]) == 0 and partial_stop("abc", []) == 0
    # include_stop_str_in_output: the cut is after the occurrence that starts first
    assert find_stop("import os\nimport", len("import os\n"), ["os\nimport os", "\nimp"], include=True) == \
        len("import os\nimp")
    assert find_stop("xxabcd", 3, ["cd", "abc"], include=True) == 5
    assert find_stop("xxabcd", 3, ["ab", "abcd"], include=True) == 6  # (both start at 2: the longer)


@PROPERTY
@given(text=st.text(alphabet="ab\n", max_size=12), cut=st.integers(0, 12),
       stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=5), min_size=1, max_size=4))
def test_find_stop_and_partial_stop_match_their_definitions(text, cut, stops):
    new_from = min(cut, len(text))
    ends_after = [i for s in stops for i in range(len(text)) if text.startswith(s, i) and i + len(s) > new_from]
    assert find_stop(text, new_from, stops) == min(ends_after, default=None)
    assert partial_stop(text, stops) == max([k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])], default=0)


NAMES = ["byte-level", "default", "metaspace", "byte-fallback"]


@PROPERTY
@given(data=st.data(), name=st.sampled_from(NAMES))
def test_incremental_text_is_the_decoded_text(decoders, data, name):
    """The pieces add up to what the tokens add to the context's text, each as soon as it is
    final: after each token, the complete text (byte tokens: once a token outside them
    follows); no piece is taken back (a byte-fallback run turned into U+FFFD characters
    by a later byte repeated its text before)."""
    decode, vocab, held = decoders[name]
    context = data.draw(st.one_of(st.just([]), token_runs(vocab, max_size=6)))
    ids = data.draw(token_runs(vocab))
    start = len(decode(context))
    text, pieces = IncrementalText(decode, held), []
    text.start(context)
    for k, t in enumerate(ids, 1):
        pieces.append(text.push(t))
        if t in held:
            assert pieces[-1] == ""
        else:
            assert "".join(pieces) == decode(context + ids[:k])[start:].rstrip("\ufffd")
    assert "".join(pieces) + text.flush() == decode(context + ids)[start:]


def test_incremental_text_of_a_byte_run_that_a_later_byte_makes_invalid(decoders):
    """The trial's tokens <0x0D> <0xE9> ar: '\r' alone, but the run '\r\xe9' is not UTF-8,
    so the text is two U+FFFD characters: '\r' was returned, then again as U+FFFD."""
    decode, vocab, held = decoders["byte-fallback"]
    tok = make_sentencepiece_tokenizer()
    ids = tok.convert_tokens_to_ids(["<0x0D>", "<0xE9>", "ar", "<0x0D>"])
    assert decode(ids[:1]) == "\r" and decode(ids[:3]) == "\ufffd\ufffdar"
    text = IncrementalText(decode, held)
    pieces = [text.push(t) for t in ids]
    assert pieces == ["", "", "\ufffd\ufffdar", ""] and text.flush() == "\r"
    # with the context a SentencePiece word-start marker keeps its space
    word = tok.convert_tokens_to_ids("▁")
    text = IncrementalText(decode, held)
    text.start(tok.encode("x is"))
    assert decode([word]) == "" and text.push(word) == " "


def test_text_after_a_prompt_ending_in_a_byte_run_and_after_skipped_special_tokens(decoders):
    """(helper-51) A prompt ending in byte-fallback characters ("Say 中文": 6 byte tokens,
    the last 4 start inside 中): the output's bytes joined that invalid run, U+FFFD for
    'AAA'. With skip_special_tokens, a word after a skipped special token lost its space
    (the special token alone became the context and decoded to nothing)."""
    tok = make_sentencepiece_tokenizer()
    decode, _, held = decoders["byte-fallback"]
    prompt = tok.encode("Say 中文")
    a = tok.convert_tokens_to_ids("<0x41>")
    assert sum(t in held for t in prompt[-6:]) == 6 and decode(prompt[-4:]).startswith("\ufffd")
    stopper = Stopper(decode, [], set(), 3, held=held)
    stopper.start(prompt)
    assert stopper.feed([a, a, a]) == ("AAA", 3, "length") and decode(prompt + [a] * 3)[len(decode(prompt)):] == "AAA"

    def skipping(ids):
        return tok.decode(ids, skip_special_tokens=True)

    unk, bos = tok.convert_tokens_to_ids(["<unk>", "<s>"])
    prompt = tok.encode("Hello", add_special_tokens=False)
    for out in ([unk, *tok.encode(" the cat", add_special_tokens=False)],
                [*tok.encode(" the", add_special_tokens=False), unk, *tok.encode(" cat", add_special_tokens=False)],
                [bos, *tok.encode(" cat", add_special_tokens=False)]):
        want = skipping(prompt + out)[len(skipping(prompt)):]
        assert want.endswith(" cat")
        for sizes in ([1], [len(out)]):
            stopper = Stopper(skipping, [" cat"], set(), 16)
            stopper.start(prompt)
            pieces, i = [], 0
            while i < len(out):
                piece, kept, finish = stopper.feed(out[i:i + sizes[0]])
                pieces.append(piece)
                i += kept
                if finish:
                    break
            assert finish == "stop" and "".join(pieces) == want[:-len(" cat")], (out, sizes, pieces)


@PROPERTY
@given(data=st.data(), name=st.sampled_from(NAMES))
def test_stopper_decides_as_token_at_a_time_whatever_the_rounds(decoders, data, name):
    """Random token sequences after a random prompt, overlapping stop strings cut from their
    text, a stop token id, max_new_tokens and round sizes: the text, the kept tokens and
    the finish reason are the brute-force oracle's (rounds of one token: target-only
    decoding)."""
    decode, vocab, held = decoders[name]
    prompt = data.draw(st.one_of(st.just([]), token_runs(vocab, max_size=12)))
    while prompt and prompt[-1] in held:  # (a prompt ending inside a byte run: test_a_context_that_ends_inside_a_byte_run)
        prompt = prompt[:-1]
    tail = prompt[-16:]  # Stopper.start's context: the prompt's last 4 tokens, twice as many while those decode to
    n = min(4, len(tail))  # '', one more while they start inside a byte run's character
    while n < len(tail):
        if not decode(tail[-n:]):
            n = min(2 * n, len(tail))
        elif tail[-n] in held and decode(tail[-n:]).startswith("\ufffd"):
            n += 1
        else:
            break
    context = tail[len(tail) - n:]
    ids = data.draw(token_runs(vocab))
    stops = data.draw(overlapping_stops(decode(context + ids)[len(decode(context)):]))
    stop_ids = set(data.draw(st.lists(st.sampled_from(ids), max_size=1)))
    max_new_tokens = data.draw(st.integers(1, len(ids)))
    sizes = data.draw(st.lists(st.integers(1, 16), min_size=1, max_size=6))
    kw = dict(held=held, context=context)
    want = reference_stop(decode, ids, stops, stop_ids, max_new_tokens, **kw)
    assert run_stopper(decode, ids, stops, stop_ids, max_new_tokens, [1], held=held, context=prompt) == want
    assert run_stopper(decode, ids, stops, stop_ids, max_new_tokens, sizes, held=held, context=prompt) == want
    assert not any(s in want[0] for s in stops)
    kept = reference_stop(decode, ids, stops, stop_ids, max_new_tokens, include=True, **kw)  # the stop string kept
    assert run_stopper(decode, ids, stops, stop_ids, max_new_tokens, sizes, include=True, held=held,
                       context=prompt) == kept
    assert kept[1:] == want[1:] and kept[0].startswith(want[0])


def test_overlapping_stop_strings_of_the_issue_on_the_default_pair():
    """Issue 14: the stop string that completes first wins, not the one that starts first."""
    spec = DFlashEngine.from_pretrained()
    base = DFlashEngine(spec.target, spec.tokenizer)
    kw = dict(stop=["os\nimport os", "\nimp"], max_new_tokens=32)
    want = base.generate("import os\n", **kw)
    assert want.text == "import os" and want.finish_reason == "stop"
    got = spec.generate("import os\n", **kw)
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    assert max(got.stats.acceptance_lengths) > 1  # a round committed several tokens
    chunks = list(spec.stream("import os\n", **kw))
    assert "".join(c.text for c in chunks) == want.text


@pytest.fixture(scope="module")
def stop_pairs(engines):
    """name -> (speculative engine, target-only engine, [(prompt, target-only output)]): the
    shipped default pair (real code text, several tokens per round) and the agreeable pair
    (many tokens per round)."""
    default = DFlashEngine.from_pretrained()
    code = ["import os\n", "def fibonacci(n):", "class Stack:\n    def push(self, item):\n", "for i in range(10):\n"]
    out = {}
    for name, spec, prompts in (("default", default, code),
                                ("agree", engines[16], PROMPTS[:3] + varied_prompts(engines[16].target, 4, seed=2))):
        base = DFlashEngine(spec.target, spec.tokenizer)
        out[name] = spec, base, [(p, base.generate(p, max_new_tokens=N, ignore_eos=True)) for p in prompts]
    return out


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(data=st.data(), name=st.sampled_from(["default", "agree"]), B=st.integers(2, 16))
def test_overlapping_stop_strings_match_target_only_decoding(stop_pairs, data, name, B):
    """Block sizes 2..16, overlapping stop strings cut from the target-only output:
    generate and the streamed deltas give target-only decoding's text, token ids and
    finish reason."""
    spec, base, refs = stop_pairs[name]
    prompt, ref = data.draw(st.sampled_from(refs))
    stops = data.draw(overlapping_stops(ref.text))
    kw = dict(max_new_tokens=N, ignore_eos=True, stop=stops)
    want = base.generate(prompt, **kw)
    engine = DFlashEngine(spec.target, spec.tokenizer, spec.drafter, block_size=B)
    got = engine.generate(prompt, **kw)
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    chunks = list(engine.stream(prompt, **kw))
    assert "".join(c.text for c in chunks) == want.text
    assert [t for c in chunks for t in c.token_ids] == want.token_ids


def test_skip_special_tokens_and_include_stop_str_in_output():
    """vLLM's two text options: special tokens (here EOS, generated with ignore_eos) left out
    of the text but not out of the token ids, and the stop string kept; speculative output
    equals the target alone's, one sequence and batched (the shipped pair: varied text)."""
    engine = DFlashEngine.from_pretrained()
    prompt = "def fibonacci(n):"
    alone = DFlashEngine(engine.target, engine.tokenizer)  # target-only decoding
    eos = min(engine.stop_token_ids)
    assert eos in engine.special_token_ids
    kw = dict(max_new_tokens=48, ignore_eos=True, logit_bias={eos: 6.0})  # (EOS tokens amid the text)
    full = engine.generate(prompt, **kw)
    assert eos in full.token_ids and len(set(full.token_ids)) > 1, full.token_ids
    skipped = engine.generate(prompt, skip_special_tokens=True, **kw)
    assert skipped.token_ids == full.token_ids
    assert skipped.text == engine.decode([t for t in full.token_ids if t not in engine.special_token_ids])
    assert engine.decode([eos]) in full.text and engine.decode([eos]) not in skipped.text
    assert alone.generate(prompt, skip_special_tokens=True, **kw).text == skipped.text
    text = skipped.text
    stop = max(set(text), key=text.find)  # the character whose first occurrence comes last
    assert text.find(stop) > 0, text
    kept = engine.generate(prompt, skip_special_tokens=True, include_stop_str_in_output=True, stop=[stop], **kw)
    assert kept.text == text[:text.find(stop) + len(stop)] and kept.finish_reason == "stop"
    assert alone.generate(prompt, skip_special_tokens=True, include_stop_str_in_output=True, stop=[stop],
                          **kw).token_ids == kept.token_ids
    batch = engine.generate_batch([prompt, prompt], skip_special_tokens=[True, False],
                                  include_stop_str_in_output=[True, False], stop=[stop], **kw)
    assert batch[0].text == kept.text
    assert batch[1].text == engine.generate(prompt, stop=[stop], **kw).text
    with pytest.raises(DFlashError, match="skip_special_tokens must be True or False"):
        engine.generate(prompt, skip_special_tokens="yes")


@pytest.fixture(scope="module")
def sp_engine(sentencepiece_pair):
    """A speculative engine over a Llama-2-style (SentencePiece, byte fallback) tokenizer."""
    return DFlashEngine.from_pretrained(*sentencepiece_pair)


def pipeline_text(engine, prompt_ids, out_ids, skip=False):
    """transformers' text-generation pipeline's text (``return_full_text=False``): the
    decoded prompt and output less the decoded prompt."""
    def decode(ids):
        return engine.tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    return decode(prompt_ids + out_ids)[len(decode(prompt_ids)):]


def test_sentencepiece_output_text_keeps_its_first_space(sp_engine):
    """A SentencePiece tokenizer drops a word-start marker's space at the start of a decode:
    the first output word kept it only with the prompt decoded before it (vLLM's and
    transformers' text). Text, chat and token-id prompts, prompts ending in special tokens
    (skipped from the text or not); generate, stream and the batch decoder; a stop string
    with the space fires at that first token."""
    e = sp_engine
    the = e.tokenizer.convert_tokens_to_ids("▁the▁")
    assert e.decode([the]) == "the "
    bos, eos = 1, 2
    x_is = e.encode_prompt("x is")
    assert x_is[0] == bos
    prompts = ["x is", [{"role": "user", "content": "hi"}], x_is, x_is + [eos], x_is + [eos, bos], [bos]]
    for skip in (False, True):
        kw = dict(max_new_tokens=3, logit_bias={the: 100.0}, ignore_eos=True, skip_special_tokens=skip)
        outs = [e.generate(p, **kw) for p in prompts]
        batch = e.generate_batch(prompts, **kw)
        for p, out, batched in zip(prompts, outs, batch):
            ids = e.encode_prompt(p)
            assert out.token_ids == [the] * 3
            want = pipeline_text(e, ids, out.token_ids, skip)
            assert out.text == batched.text == "".join(c.text for c in e.stream(p, **kw)) == want, (p, skip)
            first_space = not (skip and p == [bos])  # (the prompt decodes to nothing: no space before)
            assert want == (" the  the  the " if first_space else "the  the  the "), (p, skip)
            stopped = e.generate(p, **{**kw, "stop": [" the"]})
            assert (stopped.text, stopped.token_ids, stopped.finish_reason) == (
                ("", [the], "stop") if first_space else ("the ", [the, the], "stop"))
            assert e.generate_batch([p], **{**kw, "stop": [" the"]})[0].token_ids == stopped.token_ids


def test_sentencepiece_sampled_text_is_the_pipeline_text(sp_engine):
    """Sampled outputs (byte tokens among them, the output text taking a run of them when it
    ends) are transformers' pipeline text, one sequence and batched."""
    e = sp_engine
    vocab = e.tokenizer.get_vocab()
    byte_ids = {vocab[f"<0x{b:02X}>"] for b in range(256)}
    prompts = ["def f(x):\n    return", "x is", "import os\n", [{"role": "user", "content": "hi"}]]
    kw = dict(max_new_tokens=24, temperature=1.5, ignore_eos=True, logit_bias={b: 2.0 for b in byte_ids})
    saw_bytes = 0
    for seed in range(3):
        outs = e.generate_batch(prompts, seed=seed, **kw)
        for p, out in zip(prompts, outs):
            ids = e.encode_prompt(p)
            saw_bytes += sum(t in byte_ids for t in out.token_ids)
            assert out.text == pipeline_text(e, ids, out.token_ids)
            assert e.generate(p, seed=seed, **kw).text == out.text
    assert saw_bytes > 10
    assert e.byte_token_ids == byte_ids and not byte_ids & e.special_token_ids


@pytest.mark.parametrize("slots", [None, 1], ids=["batched", "serial"])
def test_sentencepiece_text_from_the_server(sentencepiece_pair, sp_engine, slots):
    """The server (its batched backend, and the serial one; a real HTTP server, uvicorn in a
    thread of this process, and a real HTTP client) gives the same text: completions,
    streamed or not, and chat, with the first word's space; a stop string with it fires."""
    import openai

    from dflash_torch.serving.app import create_app

    model = "tiny-dflash"
    the = sp_engine.tokenizer.convert_tokens_to_ids("▁the▁")
    kw = dict(model=model, max_tokens=3, temperature=0, logit_bias={str(the): 100}, extra_body={"ignore_eos": True})
    app = create_app(DFlashEngine.from_pretrained(*sentencepiece_pair), model_name=model, max_batch_size=slots)
    with serve_in_thread(app) as base:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        assert c.completions.create(prompt="x is", **kw).choices[0].text == " the  the  the "
        streamed = c.completions.create(prompt="x is", stream=True, **kw)
        assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == " the  the  the "
        stopped = c.completions.create(prompt="x is", stop=[" the"], **kw).choices[0]
        assert (stopped.text, stopped.finish_reason) == ("", "stop")
        reply = c.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw).choices[0]
        assert reply.message.content == " the  the  the "
        # logprobs: each token's text is the text it adds (the first word's space too), and
        # echo's text_offset s index the echoed text (after <s>, whose text it does not hold;
        # a token-id prompt without <s> decodes without its first word's space)
        lp = c.completions.create(prompt="x is", logprobs=1, **kw).choices[0].logprobs
        assert "".join(lp.tokens) == " the  the  the " and lp.text_offset == [0, 5, 10]
        for prompt in ("x is", sp_engine.encode_prompt("x is")[1:]):
            got = c.completions.create(prompt=prompt, echo=True, logprobs=1, **kw).choices[0]
            assert got.text == "x is the  the  the "
            tokens, offsets = got.logprobs.tokens, got.logprobs.text_offset
            assert offsets[0] == 0 and offsets == sorted(offsets)
            assert offsets[-3:] == [4, 9, 14]
            for token, offset in zip(tokens, offsets):
                if offset > 0:  # (past the start: the tokens before it hold text the echo drops)
                    assert got.text[offset:offset + len(token)] == token, (tokens, offsets)


def test_a_stop_string_completed_inside_a_byte_run_ends_the_output_there(sp_engine, sentencepiece_pair):
    """A run of byte tokens (a byte-fallback vocabulary's ``<0xE4> <0xB8> <0xAD>`` for 中)
    is held until a token outside it ends it (a later byte could turn it into U+FFFD
    characters), but a stop string completed inside it ends the output at the token that
    completes it (it ran on to the end of the run: past the stop in token ids, logprobs and
    usage). Speculative and target-only alike."""
    regex = {"regex": "中中中 x"}
    whole = sp_engine.generate("x is", max_new_tokens=20, structured_output=regex)
    assert whole.text == "中中中 x" and all(t in sp_engine.byte_token_ids for t in whole.token_ids[:9])
    for engine in (sp_engine, DFlashEngine.from_pretrained(sentencepiece_pair[0], no_draft=True)):
        for include, text in ((False, ""), (True, "中")):
            got = engine.generate("x is", max_new_tokens=20, structured_output=regex, stop=["中"],
                                  include_stop_str_in_output=include, logprobs=0)
            assert (got.text, got.token_ids, got.finish_reason) == (text, whole.token_ids[:3], "stop")
            assert len(got.logprobs) == 3
        got = engine.generate("x is", max_new_tokens=20, structured_output=regex, stop=["中中"])
        assert (got.text, got.token_ids) == ("", whole.token_ids[:6])


def test_a_context_that_ends_inside_a_byte_run(sp_engine):
    """A token-id prompt whose last tokens are byte tokens of a character the output's bytes
    complete (a byte-fallback decoder writes one U+FFFD per byte of an incomplete run, so
    the context's text was too long by those characters and the output lost its first
    ones: ' x' came out 'x', a stop string ' x' never fired): the character is the
    context's, the output's text starts after it. A complete character that output bytes
    turn invalid stays the context's too (the output's byte is its one U+FFFD); a run
    starting with a space byte (which a decode alone strips) counts it; a stop string in the
    output's part of such a run, or in a run already invalid, ends the output at once."""
    e = sp_engine
    byte = {b: e.tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    assert all(e.byte_token_values[byte[b]] == b for b in range(256))
    emoji = [byte[b] for b in "😀".encode()]
    prompt = e.encode_prompt("x is")
    after = e.encode_prompt("x中 y")[1:]  # (less <s>; "▁x ..." adds " x" after the emoji)

    def text_of(context, out):
        text = IncrementalText(e.decode, e.byte_token_values)
        text.start(context)
        return "".join(text.push(t) for t in out) + text.flush()

    for cut in (1, 2, 3):  # the prompt ends after `cut` of the emoji's 4 bytes
        out = emoji[cut:] + after
        assert text_of(prompt + emoji[:cut], out) == " x中 y", cut
        stopper = Stopper(e.decode, [" x"], set(), 20, held=e.byte_token_values)
        stopper.start(prompt + emoji[:cut])
        assert stopper.feed(out)[::2] == ("", "stop"), cut
    assert text_of(prompt + emoji, [byte[0xE4]]) == "\ufffd"  # (the run turned invalid: 5 U+FFFD, 4 the prompt's)
    zhong = [byte[b] for b in "中".encode()]
    assert text_of([byte[0x20]], zhong) == "中"  # (a run decoded alone drops its leading space)
    assert text_of([0, byte[0x20], *zhong[:2]], zhong[2:]) == ""
    stopper = Stopper(e.decode, ["a"], set(), 20, held=e.byte_token_values)  # (a stop in the output's part of the run)
    stopper.start(prompt + zhong[:1])
    assert stopper.feed(zhong[1:] + [byte[0x61]] * 4)[1:] == (3, "stop")
    stopper = Stopper(e.decode, ["\ufffd"], set(), 20, held=e.byte_token_values)  # (0xFF: never valid, so final)
    stopper.start(prompt)
    assert stopper.feed([byte[0xFF]] + [byte[0x41]] * 7)[1:] == (1, "stop")
